/* test-conformance.c: the conformance suite, run unchanged against every backend's devices.
 *
 * Written only against the public API: device memory is read only through copies into pinned
 * memory, never by dereferencing a device pointer, so GPU backends run it as is. Cases that
 * need a backend's native queue type (external work, adoption) know only the CPU backend's and
 * are skipped (77) elsewhere. Each case is its own process (see harness.h), so cases that set
 * environment options do it before th_open().
 *
 * No case passes or fails on a timing: where work must still be pending at a check, it is held
 * back by a gate that only the test opens; sleeps only make a wrong order more likely to show.
 */
#include "harness.h"

#include <sched.h>

#include <tandem/cpu.h>

#include <math.h>

/* The native SDKs, where the build has them: the import cases make native events. */
#ifdef TANDEM_TEST_OPENCL
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#endif
#ifdef TANDEM_TEST_CUDA
#include <cuda_runtime.h>
#endif

/* ---- Shared helpers ---------------------------------------------------------------------- */

static int has_cap(tdm_device *dev, unsigned cap) {
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  return (info.caps & cap) != 0;
}

static void require_ooo(tdm_device *dev) {
  if (!has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER))
    TH_SKIP("%s has no out-of-order queues", th_device_id);
}

static tdm_queue *new_queue(tdm_device *dev, unsigned flags) {
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, flags, &q));
  CHECK(q != NULL);
  return q;
}

static void *dev_alloc(tdm_device *dev, tdm_mem_kind kind, size_t n) {
  void *p = NULL;
  CHECK_OK(tdm_malloc(dev, kind, n, &p));
  CHECK(p != NULL);
  return p;
}

static void wait_ok(tdm_event *ev) {
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
}

/* Reads n bytes of device memory through a D2H copy into `pinned` and a sync. */
static void read_device(tdm_queue *q, void *pinned, const void *dsrc, size_t n) {
  CHECK_OK(tdm_memcpy(q, pinned, dsrc, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
}

/* A host task that bumps a counter. */
static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

/* A host task that waits (bounded) for a gate; returns TDM_ETASK-worthy 1 if it never opened. */
static int task_wait_gate(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : 1; }

static int task_fail_einval(void *arg) {
  (void)arg;
  return TDM_EINVAL;
}

static int task_return_positive(void *arg) {
  (void)arg;
  return 7;
}

/* ---- In-order ordering ------------------------------------------------------------------- */

enum { LOG_MAX = 4096 };

struct order_log {
  atomic_int n;
  int ids[LOG_MAX];
};

struct log_arg {
  struct order_log *log;
  int id;
  int sleep_ms;
};

static int task_append(void *arg) {
  struct log_arg *a = arg;
  if (a->sleep_ms) th_sleep_ms(a->sleep_ms);
  int i = atomic_fetch_add(&a->log->n, 1);
  CHECK(i < LOG_MAX);
  a->log->ids[i] = a->id;
  return 0;
}

TEST_CASE(ordering_in_order) {
  enum { N = 2000 };
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct order_log *log = calloc(1, sizeof *log);
  struct log_arg *args = calloc(N, sizeof *args);
  for (int i = 0; i < N; i++) {
    args[i] = (struct log_arg){log, i, (i % 500 == 0) ? 5 : 0};
    CHECK_OK(tdm_host_task(q, task_append, &args[i], 0, NULL, NULL));
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&log->n), N);
  for (int i = 0; i < N; i++) CHECK_EQ(log->ids[i], i);
  CHECK_OK(tdm_queue_destroy(q));
  free(args);
  free(log);
  th_close();
}

/* Submissions from several threads to one queue: each thread's own commands keep their order. */
struct submitter {
  tdm_queue *q;
  struct order_log *log;
  struct log_arg *args;
  int tid;
};

enum { SUBMIT_THREADS = 4, SUBMIT_EACH = 500 };

static void *submit_many(void *arg) {
  struct submitter *s = arg;
  for (int i = 0; i < SUBMIT_EACH; i++) {
    s->args[i] = (struct log_arg){s->log, s->tid * SUBMIT_EACH + i, 0};
    CHECK_OK(tdm_host_task(s->q, task_append, &s->args[i], 0, NULL, NULL));
  }
  return NULL;
}

TEST_CASE(ordering_concurrent_submit) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct order_log *log = calloc(1, sizeof *log);
  struct submitter subs[SUBMIT_THREADS];
  pthread_t th[SUBMIT_THREADS];
  for (int t = 0; t < SUBMIT_THREADS; t++) {
    subs[t] = (struct submitter){q, log, calloc(SUBMIT_EACH, sizeof(struct log_arg)), t};
    CHECK(pthread_create(&th[t], NULL, submit_many, &subs[t]) == 0);
  }
  for (int t = 0; t < SUBMIT_THREADS; t++) pthread_join(th[t], NULL);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&log->n), SUBMIT_THREADS * SUBMIT_EACH);
  int last[SUBMIT_THREADS];
  for (int t = 0; t < SUBMIT_THREADS; t++) last[t] = -1;
  for (int i = 0; i < SUBMIT_THREADS * SUBMIT_EACH; i++) {
    int tid = log->ids[i] / SUBMIT_EACH, seq = log->ids[i] % SUBMIT_EACH;
    CHECK_MSG(seq == last[tid] + 1, "thread %d: task %d ran after task %d", tid, seq, last[tid]);
    last[tid] = seq;
  }
  CHECK_OK(tdm_queue_destroy(q));
  for (int t = 0; t < SUBMIT_THREADS; t++) free(subs[t].args);
  free(log);
  th_close();
}

/* A host task placed after a D2H checks the pinned data the D2H just wrote. */
struct chain_check {
  const unsigned char *got, *want;
  size_t n;
  atomic_int ok;
};

static int task_check_chain(void *arg) {
  struct chain_check *c = arg;
  atomic_store(&c->ok, memcmp(c->got, c->want, c->n) == 0 ? 1 : -1);
  return 0;
}

TEST_CASE(ordering_copy_chain) {
  enum { ROUNDS = 8 };
  const size_t n = 65537;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src[ROUNDS], *out[ROUNDS];
  struct chain_check checks[ROUNDS];
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n), *db = dev_alloc(dev, TDM_MEM_DEVICE, n);
  for (int r = 0; r < ROUNDS; r++) {
    src[r] = dev_alloc(dev, TDM_MEM_PINNED, n);
    out[r] = dev_alloc(dev, TDM_MEM_PINNED, n);
    th_fill_random(src[r], n, &rng);
    th_fill_random(out[r], n, &rng);
  }
  /* Every round reuses da and db: a copy that overtakes another shows up as wrong data. */
  for (int r = 0; r < ROUNDS; r++) {
    checks[r] = (struct chain_check){out[r], src[r], n, 0};
    CHECK_OK(tdm_memcpy(q, da, src[r], n, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q, db, da, n, TDM_COPY_D2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q, out[r], db, n, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(q, task_check_chain, &checks[r], 0, NULL, NULL));
  }
  CHECK_OK(tdm_queue_sync(q));
  for (int r = 0; r < ROUNDS; r++) {
    CHECK_MEM_EQ(out[r], src[r], n);
    CHECK_MSG(atomic_load(&checks[r].ok) == 1, "round %d: host task saw data before the D2H", r);
    CHECK_OK(tdm_free(src[r]));
    CHECK_OK(tdm_free(out[r]));
  }
  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Out-of-order queues ----------------------------------------------------------------- */

struct ooo_pair {
  th_gate gate;
  atomic_int first_saw_open;
};

static int task_first_blocks(void *arg) {
  struct ooo_pair *p = arg;
  atomic_store(&p->first_saw_open, th_gate_wait(&p->gate, TH_HANG_MS));
  return 0;
}

static int task_second_opens(void *arg) {
  struct ooo_pair *p = arg;
  th_gate_open(&p->gate);
  return 0;
}

/* The first task can only finish because the second, submitted later, runs independently. */
TEST_CASE(ooo_independent) {
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  unsigned flags = 0;
  CHECK_OK(tdm_queue_flags(q, &flags));
  CHECK(flags & TDM_QUEUE_OUT_OF_ORDER);
  struct ooo_pair p;
  th_gate_init(&p.gate);
  atomic_init(&p.first_saw_open, 0);
  CHECK_OK(tdm_host_task(q, task_first_blocks, &p, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_second_opens, &p, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(atomic_load(&p.first_saw_open) == 1,
            "the out-of-order queue ran its second task only after the first");
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&p.gate);
  th_close();
}

/* A chain of dependencies on an out-of-order queue; earlier tasks sleep longer, so ignoring a
 * dependency would reorder the log. */
TEST_CASE(ooo_dependencies) {
  enum { N = 16 };
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  struct order_log *log = calloc(1, sizeof *log);
  struct log_arg args[N];
  tdm_event *prev = NULL;
  for (int i = 0; i < N; i++) {
    tdm_event *ev = NULL;
    args[i] = (struct log_arg){log, i, N - i};
    CHECK_OK(tdm_host_task(q, task_append, &args[i], prev ? 1 : 0, prev ? &prev : NULL, &ev));
    if (prev) CHECK_OK(tdm_event_release(prev));
    prev = ev;
  }
  CHECK_OK(tdm_event_wait(prev));
  /* The last event completes only after the whole chain. */
  CHECK_EQ(atomic_load(&log->n), N);
  for (int i = 0; i < N; i++) CHECK_EQ(log->ids[i], i);
  CHECK_OK(tdm_event_release(prev));
  CHECK_OK(tdm_queue_destroy(q));
  free(log);
  th_close();
}

struct barrier_state {
  atomic_int before, after;
  atomic_int pre_saw_after[8];
  atomic_int post_saw_before[8];
};

struct barrier_arg {
  struct barrier_state *s;
  int i;
};

static int task_pre_barrier(void *arg) {
  struct barrier_arg *a = arg;
  th_sleep_ms(5 + a->i);
  atomic_store(&a->s->pre_saw_after[a->i], atomic_load(&a->s->after));
  atomic_fetch_add(&a->s->before, 1);
  return 0;
}

static int task_post_barrier(void *arg) {
  struct barrier_arg *a = arg;
  atomic_store(&a->s->post_saw_before[a->i], atomic_load(&a->s->before));
  atomic_fetch_add(&a->s->after, 1);
  return 0;
}

TEST_CASE(ooo_barrier) {
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  struct barrier_state s;
  struct barrier_arg pre[8], post[8];
  memset(&s, 0, sizeof s);
  tdm_event *bar = NULL;
  for (int i = 0; i < 8; i++) {
    pre[i] = (struct barrier_arg){&s, i};
    CHECK_OK(tdm_host_task(q, task_pre_barrier, &pre[i], 0, NULL, NULL));
  }
  CHECK_OK(tdm_queue_barrier(q, 0, NULL, &bar));
  for (int i = 0; i < 8; i++) {
    post[i] = (struct barrier_arg){&s, i};
    CHECK_OK(tdm_host_task(q, task_post_barrier, &post[i], 0, NULL, NULL));
  }
  CHECK_OK(tdm_event_wait(bar));
  CHECK_EQ(atomic_load(&s.before), 8); /* the barrier followed every earlier command */
  CHECK_OK(tdm_event_release(bar));
  CHECK_OK(tdm_queue_sync(q));
  for (int i = 0; i < 8; i++) {
    CHECK_EQ(atomic_load(&s.pre_saw_after[i]), 0);
    CHECK_EQ(atomic_load(&s.post_saw_before[i]), 8);
  }
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

struct flag_task {
  th_gate *gate;
  atomic_int done;
  atomic_int saw;
};

static int task_gate_then_done(void *arg) {
  struct flag_task *f = arg;
  int ok = th_gate_wait(f->gate, TH_HANG_MS);
  atomic_store(&f->done, 1);
  return ok ? 0 : 1;
}

static int task_record_done(void *arg) {
  struct flag_task *f = arg;
  atomic_store(&f->saw, atomic_load(&f->done));
  return 0;
}

/* A barrier with a dependency list waits for the listed events only, and orders later work. */
TEST_CASE(ooo_barrier_deps) {
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  struct flag_task a = {&gate, 0, 0};
  atomic_int b_ran = 0;
  tdm_event *ea = NULL, *eb = NULL, *bar = NULL, *ec = NULL;
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &a, 0, NULL, &ea));
  CHECK_OK(tdm_host_task(q, task_count, &b_ran, 0, NULL, &eb));
  CHECK_OK(tdm_queue_barrier(q, 1, &ea, &bar));
  CHECK_OK(tdm_host_task(q, task_record_done, &a, 0, NULL, &ec));
  /* b does not depend on a: it completes while the gate is still shut. */
  CHECK_OK(tdm_event_wait(eb));
  CHECK_EQ(atomic_load(&b_ran), 1);
  CHECK_RC(tdm_event_query(bar), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(ec), TDM_EAGAIN);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(ec));
  CHECK_EQ(atomic_load(&a.saw), 1);
  CHECK_OK(tdm_event_wait(bar));
  wait_ok(ea);
  wait_ok(eb);
  wait_ok(bar);
  wait_ok(ec);
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&gate);
  th_close();
}

/* ---- Device-side waits ------------------------------------------------------------------- */

struct cross_wait {
  th_gate gate;
  atomic_int a_done, a_timed_out, b_ran, b_saw_a;
};

static int task_cross_a(void *arg) {
  struct cross_wait *x = arg;
  if (!th_gate_wait(&x->gate, TH_HANG_MS)) atomic_store(&x->a_timed_out, 1);
  atomic_store(&x->a_done, 1);
  return 0;
}

static int task_cross_b(void *arg) {
  struct cross_wait *x = arg;
  atomic_store(&x->b_saw_a, atomic_load(&x->a_done));
  atomic_store(&x->b_ran, 1);
  return 0;
}

/* B waits device-side for A's held-back task. The submitting thread itself opens A's gate
 * afterwards, which proves that tdm_queue_wait and the later submission returned at once. */
static void cross_wait_round(tdm_device *dev, unsigned b_flags) {
  tdm_queue *qa = new_queue(dev, TDM_QUEUE_IN_ORDER), *qb = new_queue(dev, b_flags);
  struct cross_wait x;
  memset(&x, 0, sizeof x);
  th_gate_init(&x.gate);
  tdm_event *ea = NULL, *eb = NULL;
  CHECK_OK(tdm_host_task(qa, task_cross_a, &x, 0, NULL, &ea));
  CHECK_OK(tdm_queue_wait(qb, ea));
  CHECK_OK(tdm_host_task(qb, task_cross_b, &x, 0, NULL, &eb));
  CHECK_EQ(atomic_load(&x.b_ran), 0);
  CHECK_RC(tdm_event_query(eb), TDM_EAGAIN);
  th_gate_open(&x.gate);
  CHECK_OK(tdm_event_wait(eb));
  CHECK_EQ(atomic_load(&x.a_timed_out), 0);
  CHECK_MSG(atomic_load(&x.b_saw_a) == 1, "queue B ran its task before A's event completed");
  wait_ok(ea);
  wait_ok(eb);
  CHECK_OK(tdm_queue_destroy(qa));
  CHECK_OK(tdm_queue_destroy(qb));
  th_gate_destroy(&x.gate);
}

TEST_CASE(wait_cross_queue) {
  tdm_device *dev = th_open();
  cross_wait_round(dev, TDM_QUEUE_IN_ORDER);
  if (has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) cross_wait_round(dev, TDM_QUEUE_OUT_OF_ORDER);
  th_close();
}

/* A device-side wait orders copies too: B reads, on its own queue, what A wrote. */
TEST_CASE(wait_cross_queue_copies) {
  const size_t n = 1 << 20;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *qa = new_queue(dev, TDM_QUEUE_IN_ORDER), *qb = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);
  th_fill_random(out, n, &rng);
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *ea = NULL;
  CHECK_OK(tdm_host_task(qa, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qa, d, src, n, TDM_COPY_H2D, 0, NULL, &ea));
  CHECK_OK(tdm_queue_wait(qb, ea));
  CHECK_OK(tdm_memcpy(qb, out, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  th_gate_open(&gate);
  CHECK_OK(tdm_queue_sync(qb)); /* only B: its wait covers A's copy */
  CHECK_MEM_EQ(out, src, n);
  wait_ok(ea);
  CHECK_OK(tdm_queue_destroy(qa));
  CHECK_OK(tdm_queue_destroy(qb));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(d));
  th_gate_destroy(&gate);
  th_close();
}

/* ---- Markers ----------------------------------------------------------------------------- */

TEST_CASE(marker_after_work) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *m = NULL;
  /* A marker on an idle queue completes. */
  CHECK_OK(tdm_event_record(q, &m));
  wait_ok(m);

  th_gate gate;
  th_gate_init(&gate);
  struct flag_task f = {&gate, 0, 0};
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &f, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &m));
  CHECK_RC(tdm_event_query(m), TDM_EAGAIN);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(m));
  CHECK_EQ(atomic_load(&f.done), 1);
  CHECK_OK(tdm_event_release(m));
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&gate);
  th_close();
}

/* On an out-of-order queue too, a marker follows every earlier command. */
TEST_CASE(marker_ooo) {
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  th_gate g1, g2;
  th_gate_init(&g1);
  th_gate_init(&g2);
  struct flag_task f1 = {&g1, 0, 0}, f2 = {&g2, 0, 0};
  tdm_event *e1 = NULL, *m = NULL;
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &f1, 0, NULL, &e1));
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &f2, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &m));
  CHECK_RC(tdm_event_query(m), TDM_EAGAIN);
  th_gate_open(&g1);
  wait_ok(e1);
  CHECK_RC(tdm_event_query(m), TDM_EAGAIN); /* the second task is still held back */
  th_gate_open(&g2);
  CHECK_OK(tdm_event_wait(m));
  CHECK_EQ(atomic_load(&f1.done), 1);
  CHECK_EQ(atomic_load(&f2.done), 1);
  CHECK_OK(tdm_event_release(m));
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&g1);
  th_gate_destroy(&g2);
  th_close();
}

/* ---- Work submitted through the native queue (CPU backend only) -------------------------- */

static void require_cpu(tdm_device *dev) {
  if (strcmp(th_backend_of(dev), "cpu") != 0)
    TH_SKIP("the native queue type of backend %s is not known to this test",
            th_backend_of(dev));
}

struct raw_work {
  atomic_int done;
  th_gate *gate;
};

static void raw_sleep_then_flag(void *arg) {
  struct raw_work *w = arg;
  th_sleep_ms(50);
  atomic_store(&w->done, 1);
}

static void raw_gate_then_flag(void *arg) {
  struct raw_work *w = arg;
  th_gate_wait(w->gate, TH_HANG_MS);
  atomic_store(&w->done, 1);
}

struct release_probe {
  atomic_int calls;
  atomic_int saw_done;
  struct raw_work *work;
};

static void release_after_raw(void *obj) {
  struct release_probe *p = obj;
  atomic_store(&p->saw_done, atomic_load(&p->work->done));
  atomic_fetch_add(&p->calls, 1);
}

/* Markers, sync and keep-alive cover work that other code launched on the native stream. */
TEST_CASE(marker_external_work) {
  tdm_device *dev = th_open();
  require_cpu(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  void *native = NULL;
  CHECK_OK(tdm_queue_native(q, &native));
  CHECK(native != NULL);
  tdm_cpu_stream *s = native;

  struct raw_work w1 = {0, NULL}, w2 = {0, NULL};
  CHECK_OK(tdm_cpu_stream_launch(s, raw_sleep_then_flag, &w1));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(atomic_load(&w1.done) == 1, "tdm_queue_sync returned before native work finished");

  tdm_event *m = NULL;
  CHECK_OK(tdm_cpu_stream_launch(s, raw_sleep_then_flag, &w2));
  CHECK_OK(tdm_event_record(q, &m));
  CHECK_OK(tdm_event_wait(m));
  CHECK_MSG(atomic_load(&w2.done) == 1, "a marker completed before native work finished");
  CHECK_OK(tdm_event_release(m));

  th_gate gate;
  th_gate_init(&gate);
  struct raw_work w3 = {0, &gate};
  struct release_probe probe = {0, 0, &w3};
  CHECK_OK(tdm_cpu_stream_launch(s, raw_gate_then_flag, &w3));
  CHECK_OK(tdm_keep_alive(q, release_after_raw, &probe));
  CHECK_EQ(atomic_load(&probe.calls), 0);
  th_gate_open(&gate);
  CHECK_MSG(th_wait_atomic(&probe.calls, 1, TH_HANG_MS), "keep-alive release never ran");
  CHECK_EQ(atomic_load(&probe.saw_done), 1);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
  CHECK_EQ(atomic_load(&probe.calls), 1);
  th_gate_destroy(&gate);
}

/* A stream the program made is adopted, used, and outlives its wrapper. */
TEST_CASE(adopt_cpu_stream) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  require_cpu(dev);
  tdm_cpu_stream *s = NULL;
  CHECK_OK(tdm_cpu_stream_create(&s));
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_adopt(dev, s, TDM_QUEUE_IN_ORDER, &q));
  void *native = NULL;
  CHECK_OK(tdm_queue_native(q, &native));
  CHECK(native == (void *)s);

  const size_t n = 4099;
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);
  th_fill_random(out, n, &rng);
  atomic_int count = 0;
  struct raw_work w1 = {0, NULL}, w2 = {0, NULL};
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_cpu_stream_launch(s, raw_sleep_then_flag, &w1));
  CHECK_OK(tdm_memcpy(q, out, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(out, src, n);
  CHECK_EQ(atomic_load(&count), 1);
  CHECK_EQ(atomic_load(&w1.done), 1);
  CHECK_OK(tdm_queue_destroy(q));

  /* The stream is still the program's and still runs work. */
  CHECK_OK(tdm_cpu_stream_launch(s, raw_sleep_then_flag, &w2));
  CHECK_OK(tdm_cpu_stream_destroy(s));
  CHECK_MSG(atomic_load(&w2.done) == 1, "tdm_cpu_stream_destroy did not run queued work");
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(d));
  th_close();
}

/* ---- Copies ------------------------------------------------------------------------------ */

/* The host memory kinds a copy may touch. */
enum host_kind { HK_PINNED, HK_PAGEABLE, HK_TDM_HOST, HK_REGISTERED, HK_COUNT };
static const char *const host_kind_name[HK_COUNT] = {"pinned", "malloc", "TDM_MEM_HOST",
                                                     "registered"};

struct hbuf {
  unsigned char *p;
  size_t size;
  enum host_kind kind;
};

static struct hbuf hbuf_alloc(tdm_device *dev, enum host_kind kind, size_t n) {
  struct hbuf b = {NULL, n, kind};
  switch (kind) {
  case HK_PINNED: b.p = dev_alloc(dev, TDM_MEM_PINNED, n); break;
  case HK_TDM_HOST: b.p = dev_alloc(dev, TDM_MEM_HOST, n); break;
  case HK_PAGEABLE: b.p = malloc(n); break;
  case HK_REGISTERED:
    b.size = (n + 4095) / 4096 * 4096;
    b.p = aligned_alloc(4096, b.size);
    CHECK(b.p != NULL);
    CHECK_OK(tdm_host_register(dev, b.p, b.size));
    break;
  default: CHECK(!"bad host kind");
  }
  CHECK(b.p != NULL);
  return b;
}

static void hbuf_free(struct hbuf *b) {
  switch (b->kind) {
  case HK_PINNED:
  case HK_TDM_HOST: CHECK_OK(tdm_free(b->p)); break;
  case HK_PAGEABLE: free(b->p); break;
  case HK_REGISTERED:
    CHECK_OK(tdm_host_unregister(b->p));
    free(b->p);
    break;
  default: break;
  }
  b->p = NULL;
}

/* Offsets into the allocations and untouched guard bytes around every copied range. */
enum { OFF_SRC = 5, OFF_A = 11, OFF_B = 3, OFF_DST = 7, GUARD = 16, FILL_A = 0x5a, FILL_B = 0xa5 };

/* Checks that device buffer d (size total) holds `want` at [off, off+n) and `fill` elsewhere. */
static void check_device_range(tdm_queue *q, tdm_device *dev, const void *d, size_t total,
                               size_t off, const unsigned char *want, size_t n, int fill) {
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, total);
  read_device(q, back, d, total);
  CHECK_MEM_EQ(back + off, want, n);
  for (size_t i = 0; i < total; i++)
    if (i < off || i >= off + n)
      CHECK_MSG(back[i] == fill, "device byte %zu outside the copied range changed", i);
  CHECK_OK(tdm_free(back));
}

/* host(skind) -> device A -> device B -> host(dkind), at unaligned offsets into every buffer;
 * checks the data, the guards, and the copies' event. */
static void copy_round(tdm_device *dev, tdm_queue *q, size_t n, enum host_kind skind,
                       enum host_kind dkind, int use_auto, uint64_t *rng) {
  const size_t size_a = OFF_A + n + GUARD, size_b = OFF_B + n + GUARD;
  struct hbuf src = hbuf_alloc(dev, skind, OFF_SRC + n + GUARD);
  struct hbuf dst = hbuf_alloc(dev, dkind, OFF_DST + n + GUARD);
  unsigned char *dst_before = malloc(dst.size);
  unsigned char *da = dev_alloc(dev, TDM_MEM_DEVICE, size_a);
  unsigned char *db = dev_alloc(dev, TDM_MEM_DEVICE, size_b);
  tdm_event *ev = NULL;
  th_fill_random(src.p, src.size, rng);
  th_fill_random(dst.p, dst.size, rng);
  memcpy(dst_before, dst.p, dst.size);

  CHECK_OK(tdm_memset(q, da, FILL_A, size_a, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, db, FILL_B, size_b, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, da + OFF_A, src.p + OFF_SRC, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_H2D,
                      0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, db + OFF_B, da + OFF_A, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_D2D, 0,
                      NULL, NULL));
  CHECK_OK(tdm_memcpy(q, dst.p + OFF_DST, db + OFF_B, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_D2H,
                      0, NULL, &ev));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_query(ev));
  CHECK_OK(tdm_event_release(ev));

  if (th_first_diff(dst.p + OFF_DST, src.p + OFF_SRC, n) >= 0)
    printf("mismatch: n=%zu src=%s dst=%s %s\n", n, host_kind_name[skind], host_kind_name[dkind],
           use_auto ? "AUTO" : "explicit");
  CHECK_MEM_EQ(dst.p + OFF_DST, src.p + OFF_SRC, n);
  CHECK_MEM_EQ(dst.p, dst_before, OFF_DST);
  CHECK_MEM_EQ(dst.p + OFF_DST + n, dst_before + OFF_DST + n, dst.size - OFF_DST - n);
  check_device_range(q, dev, da, size_a, OFF_A, src.p + OFF_SRC, n, FILL_A);
  check_device_range(q, dev, db, size_b, OFF_B, src.p + OFF_SRC, n, FILL_B);

  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  hbuf_free(&src);
  hbuf_free(&dst);
  free(dst_before);
}

static const size_t copy_sizes[] = {1, 3, 4096, 65537, (1u << 20) + 7};
enum { N_COPY_SIZES = sizeof copy_sizes / sizeof copy_sizes[0] };

static void copy_all_kinds(int use_auto) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  for (int s = 0; s < N_COPY_SIZES; s++)
    for (int sk = 0; sk < HK_COUNT; sk++)
      for (int dk = 0; dk < HK_COUNT; dk++)
        copy_round(dev, q, copy_sizes[s], sk, dk, use_auto, &rng);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(copy_explicit) { copy_all_kinds(0); }

TEST_CASE(copy_auto) { copy_all_kinds(1); }

/* H2H between every pair of host kinds, explicit and AUTO. */
TEST_CASE(copy_h2h) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  for (int s = 0; s < N_COPY_SIZES; s++) {
    size_t n = copy_sizes[s];
    for (int sk = 0; sk < HK_COUNT; sk++)
      for (int dk = 0; dk < HK_COUNT; dk++)
        for (int use_auto = 0; use_auto < 2; use_auto++) {
          struct hbuf src = hbuf_alloc(dev, sk, OFF_SRC + n + GUARD);
          struct hbuf dst = hbuf_alloc(dev, dk, OFF_DST + n + GUARD);
          unsigned char *before = malloc(dst.size);
          th_fill_random(src.p, src.size, &rng);
          th_fill_random(dst.p, dst.size, &rng);
          memcpy(before, dst.p, dst.size);
          CHECK_OK(tdm_memcpy(q, dst.p + OFF_DST, src.p + OFF_SRC, n,
                              use_auto ? TDM_COPY_AUTO : TDM_COPY_H2H, 0, NULL, NULL));
          CHECK_OK(tdm_queue_sync(q));
          CHECK_MEM_EQ(dst.p + OFF_DST, src.p + OFF_SRC, n);
          CHECK_MEM_EQ(dst.p, before, OFF_DST);
          CHECK_MEM_EQ(dst.p + OFF_DST + n, before + OFF_DST + n, dst.size - OFF_DST - n);
          hbuf_free(&src);
          hbuf_free(&dst);
          free(before);
        }
  }
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* 256 MiB through pageable and pinned memory in both directions (pageable goes through the
 * staging ring, in stream order). */
TEST_CASE(copy_256mib) {
  const size_t n = (size_t)256 << 20;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *pageable = malloc(n);
  unsigned char *pinned = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n), *db = dev_alloc(dev, TDM_MEM_DEVICE, n);
  CHECK(pageable != NULL);
  th_fill_random(pageable, n, &rng);
  th_fill_random(pinned, n, &rng);
  /* pageable -> A -> B -> pinned */
  CHECK_OK(tdm_memcpy(q, da, pageable, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, db, da, n, TDM_COPY_D2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, pinned, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(pinned, pageable, n);
  /* new data: pinned -> B -> pageable */
  th_fill_random(pinned, n, &rng);
  CHECK_OK(tdm_memcpy(q, db, pinned, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, pageable, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(pageable, pinned, n);
  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  CHECK_OK(tdm_free(pinned));
  free(pageable);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Pageable memory is read and written in stream order, not at call time: a host task placed
 * before an H2D fills the source, and a host task placed after a D2H reads the destination. */
struct pageable_io {
  th_gate gate;
  unsigned char *buf;
  const unsigned char *want;
  size_t n;
  atomic_int ok;
};

static int task_gate_then_fill(void *arg) {
  struct pageable_io *p = arg;
  if (!th_gate_wait(&p->gate, TH_HANG_MS)) return 1;
  memcpy(p->buf, p->want, p->n);
  return 0;
}

static int task_check_pageable(void *arg) {
  struct pageable_io *p = arg;
  atomic_store(&p->ok, memcmp(p->buf, p->want, p->n) == 0 ? 1 : -1);
  return 0;
}

TEST_CASE(copy_pageable_stream_order) {
  const size_t n = (1u << 20) + 7;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = malloc(n), *dst = malloc(n), *want = malloc(n);
  unsigned char *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  CHECK(src && dst && want);
  th_fill_random(src, n, &rng);
  th_fill_random(dst, n, &rng);
  th_fill_random(want, n, &rng);
  struct pageable_io in = {.buf = src, .want = want, .n = n}, back = {.buf = dst, .want = want, .n = n};
  th_gate_init(&in.gate);
  CHECK_OK(tdm_host_task(q, task_gate_then_fill, &in, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, out, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, dst, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_check_pageable, &back, 0, NULL, NULL));
  th_gate_open(&in.gate);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(th_first_diff(out, want, n) < 0, "the pageable source was read at call time");
  CHECK_MSG(atomic_load(&back.ok) == 1, "the D2H into pageable memory had not landed when the "
            "next host task ran");
  CHECK_MEM_EQ(dst, want, n);
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(d));
  free(src);
  free(dst);
  free(want);
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&in.gate);
  th_close();
}

/* n == 0 is a no-op command: its event completes and nothing changes. */
TEST_CASE(copy_zero_bytes) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *h = dev_alloc(dev, TDM_MEM_PINNED, 64), *back = dev_alloc(dev, TDM_MEM_PINNED, 64);
  unsigned char before[64];
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, 64);
  th_fill_random(h, 64, &rng);
  memcpy(before, h, 64);
  CHECK_OK(tdm_memset(q, d, 0x77, 64, 0, NULL, NULL));
  tdm_event *e1 = NULL, *e2 = NULL, *e3 = NULL;
  CHECK_OK(tdm_memcpy(q, d, h, 0, TDM_COPY_H2D, 0, NULL, &e1));
  CHECK_OK(tdm_memcpy(q, h, d, 0, TDM_COPY_D2H, 0, NULL, &e2));
  CHECK_OK(tdm_memset(q, d, 0x11, 0, 0, NULL, &e3));
  wait_ok(e1);
  wait_ok(e2);
  wait_ok(e3);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(h, before, 64);
  read_device(q, back, d, 64);
  for (int i = 0; i < 64; i++) CHECK_EQ(back[i], 0x77);
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* tdm_mem_query describes every kind of memory. */
TEST_CASE(mem_query) {
  tdm_device *dev = th_open();
  tdm_mem_info info;
  struct hbuf b;
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, 1000);
  CHECK_OK(tdm_mem_query(d + 10, &info));
  CHECK_EQ(info.kind, TDM_MEM_DEVICE);
  CHECK(info.device == dev && info.base == d && info.size == 1000);
  CHECK_OK(tdm_free(d));
  for (int k = 0; k < HK_COUNT; k++) {
    static const tdm_mem_kind expect[HK_COUNT] = {TDM_MEM_PINNED, TDM_MEM_HOST, TDM_MEM_HOST,
                                                  TDM_MEM_REGISTERED};
    b = hbuf_alloc(dev, k, 5000);
    memset(&info, 0, sizeof info);
    CHECK_OK(tdm_mem_query(b.p + 1, &info));
    CHECK_MSG(info.kind == expect[k], "%s memory reported as kind %d", host_kind_name[k],
              (int)info.kind);
    if (k == HK_PAGEABLE) {
      CHECK(info.base == NULL);
    } else {
      CHECK(info.base == b.p);
      CHECK_EQ(info.size, b.size);
    }
    hbuf_free(&b);
  }
  th_close();
}

/* memset of device and host memory at offsets, read back through copies. */
TEST_CASE(memset_ranges) {
  const size_t n = 65537 + 2 * GUARD;
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  unsigned char *want = malloc(n);
  CHECK_OK(tdm_memset(q, d, 0x11, n, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, d + GUARD, 0xc3, n - 2 * GUARD, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, d + 100, 0x3c, 1, 0, NULL, NULL));
  memset(want, 0xc3, n - 2 * GUARD);
  want[100 - GUARD] = 0x3c;
  check_device_range(q, dev, d, n, GUARD, want, n - 2 * GUARD, 0x11);
  CHECK_OK(tdm_free(d));
  for (int k = 0; k < HK_COUNT; k++) {
    struct hbuf b = hbuf_alloc(dev, k, n);
    memset(b.p, 0x11, n);
    CHECK_OK(tdm_memset(q, b.p + GUARD, 0xc3, n - 2 * GUARD, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    for (size_t i = 0; i < n; i++)
      CHECK_EQ(b.p[i], (i < GUARD || i >= n - GUARD) ? 0x11 : 0xc3);
    hbuf_free(&b);
  }
  free(want);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Cross-queue copies ------------------------------------------------------------------ */

/* Held back by a gate, then inverts a host buffer that a later H2D on the same queue reads. */
struct invert_arg {
  th_gate gate;
  struct hbuf *buf;
};

static int task_gate_then_invert(void *arg) {
  struct invert_arg *a = arg;
  if (!th_gate_wait(&a->gate, TH_HANG_MS)) return 1;
  for (size_t i = 0; i < a->buf->size; i++) a->buf->p[i] ^= 0xff;
  return 0;
}

/* The cross copy runs after earlier work on the source queue, and the destination queue's
 * later work sees its data: only the destination queue is synced. */
TEST_CASE(memcpy_cross) {
  const size_t n = (1u << 20) + 7;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *qa = new_queue(dev, TDM_QUEUE_IN_ORDER), *qb = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct hbuf src = hbuf_alloc(dev, HK_PINNED, n), out = hbuf_alloc(dev, HK_PINNED, n);
  unsigned char *want = malloc(n);
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n), *db = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src.p, n, &rng);
  th_fill_random(out.p, n, &rng);
  for (size_t i = 0; i < n; i++) want[i] = src.p[i] ^ 0xff;
  struct invert_arg inv = {.buf = &src};
  th_gate_init(&inv.gate);

  tdm_event *ex = NULL;
  CHECK_OK(tdm_host_task(qa, task_gate_then_invert, &inv, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qa, da, src.p, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy_cross(qa, qb, db, da, n, 0, NULL, &ex));
  CHECK_OK(tdm_memcpy(qb, out.p, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_RC(tdm_event_query(ex), TDM_EAGAIN);
  th_gate_open(&inv.gate);
  CHECK_OK(tdm_queue_sync(qb));
  CHECK_MEM_EQ(out.p, want, n);
  wait_ok(ex);

  /* Back the other way, with a dependency on a third queue's held-back work. */
  tdm_queue *qc = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate g2;
  th_gate_init(&g2);
  struct flag_task f = {&g2, 0, 0};
  tdm_event *ec = NULL;
  CHECK_OK(tdm_host_task(qc, task_gate_then_done, &f, 0, NULL, &ec));
  /* The copy runs on qb: it must wait for qa's memset of da explicitly (a cross-queue copy
   * orders after the source queue's work and its dependencies, not the destination's). */
  tdm_event *ems = NULL;
  CHECK_OK(tdm_memset(qa, da, 0x42, n, 0, NULL, &ems));
  tdm_event *deps2[2] = {ec, ems};
  CHECK_OK(tdm_memcpy_cross(qb, qa, da, db, n, 2, deps2, &ex));
  CHECK_OK(tdm_event_release(ems));
  CHECK_OK(tdm_host_task(qa, task_record_done, &f, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qa, out.p, da, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_RC(tdm_event_query(ex), TDM_EAGAIN);
  th_gate_open(&g2);
  CHECK_OK(tdm_queue_sync(qa));
  CHECK_EQ(atomic_load(&f.saw), 1);
  CHECK_MEM_EQ(out.p, want, n);
  wait_ok(ex);
  wait_ok(ec);

  CHECK_OK(tdm_queue_destroy(qa));
  CHECK_OK(tdm_queue_destroy(qb));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  hbuf_free(&src);
  hbuf_free(&out);
  free(want);
  th_gate_destroy(&inv.gate);
  th_gate_destroy(&g2);
  th_close();
}

/* ---- Host tasks -------------------------------------------------------------------------- */

struct ht_check {
  unsigned char *pinned;
  const unsigned char *want;
  size_t n;
  atomic_int ok;
};

/* Checks the data an earlier D2H brought, then changes it for a later H2D to pick up. */
static int task_check_and_modify(void *arg) {
  struct ht_check *c = arg;
  atomic_store(&c->ok, memcmp(c->pinned, c->want, c->n) == 0 ? 1 : -1);
  for (size_t i = 0; i < c->n; i++) c->pinned[i] ^= 0x3c;
  return 0;
}

TEST_CASE(host_task_order) {
  const size_t n = 65537;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *mid = dev_alloc(dev, TDM_MEM_PINNED, n);
  unsigned char *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d1 = dev_alloc(dev, TDM_MEM_DEVICE, n), *d2 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);
  th_fill_random(mid, n, &rng);
  th_fill_random(out, n, &rng);
  struct ht_check c = {mid, src, n, 0};
  tdm_event *ev = NULL;
  CHECK_OK(tdm_memcpy(q, d1, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, mid, d1, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_check_and_modify, &c, 0, NULL, &ev));
  CHECK_OK(tdm_memcpy(q, d2, mid, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, out, d2, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  wait_ok(ev);
  CHECK_MSG(atomic_load(&c.ok) == 1, "the host task ran before the earlier D2H completed");
  for (size_t i = 0; i < n; i++) src[i] ^= 0x3c;
  CHECK_MEM_EQ(out, src, n);
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(mid));
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(d1));
  CHECK_OK(tdm_free(d2));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A host task with dependencies on other queues waits for them. */
TEST_CASE(host_task_deps) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *s = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate g1, g2;
  th_gate_init(&g1);
  th_gate_init(&g2);
  struct flag_task f1 = {&g1, 0, 0}, f2 = {&g2, 0, 0};
  tdm_event *deps[2] = {NULL, NULL}, *ev = NULL;
  CHECK_OK(tdm_host_task(r, task_gate_then_done, &f1, 0, NULL, &deps[0]));
  CHECK_OK(tdm_host_task(s, task_gate_then_done, &f2, 0, NULL, &deps[1]));
  CHECK_OK(tdm_host_task(q, task_record_done, &f2, 2, deps, &ev));
  CHECK_RC(tdm_event_query(ev), TDM_EAGAIN);
  th_gate_open(&g2);
  CHECK_OK(tdm_event_wait(deps[1]));
  CHECK_RC(tdm_event_query(ev), TDM_EAGAIN); /* still waiting for r */
  th_gate_open(&g1);
  CHECK_OK(tdm_event_wait(ev));
  CHECK_EQ(atomic_load(&f2.saw), 1);
  CHECK_EQ(atomic_load(&f1.done), 1);
  wait_ok(ev);
  wait_ok(deps[0]);
  wait_ok(deps[1]);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  CHECK_OK(tdm_queue_destroy(s));
  th_gate_destroy(&g1);
  th_gate_destroy(&g2);
  th_close();
}

struct nested {
  tdm_queue *q, *other;
  atomic_int inner_ran, other_ran;
  _Atomic(tdm_event *) inner_ev;
};

static int task_inner(void *arg) {
  atomic_fetch_add(&((struct nested *)arg)->inner_ran, 1);
  return 0;
}

static int task_other(void *arg) {
  atomic_fetch_add(&((struct nested *)arg)->other_ran, 1);
  return 0;
}

/* Calls tandem from a host task: more work on its own queue and on another, a marker, a query. */
static int task_outer(void *arg) {
  struct nested *n = arg;
  tdm_event *ev = NULL, *m = NULL;
  unsigned flags = 99;
  tdm_stats st;
  CHECK_OK(tdm_queue_flags(n->q, &flags));
  CHECK_OK(tdm_stats_get(&st));
  CHECK_OK(tdm_host_task(n->q, task_inner, n, 0, NULL, &ev));
  atomic_store(&n->inner_ev, ev);
  CHECK_OK(tdm_host_task(n->other, task_other, n, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(n->other, &m));
  CHECK_OK(tdm_event_wait(m)); /* another queue's work may be waited for */
  CHECK_OK(tdm_event_release(m));
  CHECK_EQ(atomic_load(&n->other_ran), 1);
  return 0;
}

TEST_CASE(host_task_calls_tandem) {
  tdm_device *dev = th_open();
  struct nested n;
  memset(&n, 0, sizeof n);
  n.q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  n.other = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *outer = NULL;
  CHECK_OK(tdm_host_task(n.q, task_outer, &n, 0, NULL, &outer));
  wait_ok(outer);
  /* The inner task was submitted before the outer one completed, so this sync covers it. */
  CHECK_OK(tdm_queue_sync(n.q));
  CHECK_EQ(atomic_load(&n.inner_ran), 1);
  tdm_event *inner = atomic_load(&n.inner_ev);
  CHECK(inner != NULL);
  CHECK_OK(tdm_event_query(inner));
  CHECK_OK(tdm_event_release(inner));
  CHECK_OK(tdm_queue_destroy(n.q));
  CHECK_OK(tdm_queue_destroy(n.other));
  th_close();
}

/* ---- Keep-alive -------------------------------------------------------------------------- */

struct keep {
  th_gate gate;
  atomic_int task_done, calls, saw_task_done;
  pthread_t worker, releaser;
};

static int task_keep_worker(void *arg) {
  struct keep *k = arg;
  k->worker = pthread_self();
  int ok = th_gate_wait(&k->gate, TH_HANG_MS);
  atomic_store(&k->task_done, 1);
  return ok ? 0 : 1;
}

static void release_keep(void *obj) {
  struct keep *k = obj;
  k->releaser = pthread_self();
  atomic_store(&k->saw_task_done, atomic_load(&k->task_done));
  atomic_fetch_add(&k->calls, 1);
}

static void release_count(void *obj) { atomic_fetch_add((atomic_int *)obj, 1); }

static void keep_alive_round(tdm_device *dev, unsigned flags, struct keep *k) {
  tdm_queue *q = new_queue(dev, flags);
  th_gate_init(&k->gate);
  CHECK_OK(tdm_host_task(q, task_keep_worker, k, 0, NULL, NULL));
  CHECK_OK(tdm_keep_alive(q, release_keep, k));
  CHECK_EQ(atomic_load(&k->calls), 0); /* the task before it is held back */
  th_gate_open(&k->gate);
  CHECK_MSG(th_wait_atomic(&k->calls, 1, TH_HANG_MS), "keep-alive release never ran");
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&k->saw_task_done), 1);
  CHECK_MSG(!pthread_equal(k->releaser, pthread_self()), "release ran on the caller's thread");
  CHECK_MSG(!pthread_equal(k->releaser, k->worker), "release ran on the queue's worker");
  CHECK_OK(tdm_queue_destroy(q));
}

TEST_CASE(keep_alive) {
  enum { MANY = 200 };
  tdm_device *dev = th_open();
  struct keep k1, k2;
  memset(&k1, 0, sizeof k1);
  memset(&k2, 0, sizeof k2);
  int ooo = has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER);
  keep_alive_round(dev, TDM_QUEUE_IN_ORDER, &k1);
  if (ooo) keep_alive_round(dev, TDM_QUEUE_OUT_OF_ORDER, &k2);

  /* Many objects, each released exactly once. */
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  atomic_int *counts = calloc(MANY, sizeof *counts);
  for (int i = 0; i < MANY; i++) {
    atomic_init(&counts[i], 0);
    CHECK_OK(tdm_keep_alive(q, release_count, &counts[i]));
  }
  CHECK_OK(tdm_queue_destroy(q));
  th_close(); /* joins the release thread */
  CHECK_EQ(atomic_load(&k1.calls), 1);
  if (ooo) CHECK_EQ(atomic_load(&k2.calls), 1);
  for (int i = 0; i < MANY; i++) CHECK_EQ(atomic_load(&counts[i]), 1);
  free(counts);
  th_gate_destroy(&k1.gate);
  if (ooo) th_gate_destroy(&k2.gate);
}

/* ---- Events ------------------------------------------------------------------------------ */

TEST_CASE(event_query_wait) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  struct flag_task f = {&gate, 0, 0};
  tdm_event *ev = NULL;
  tdm_queue *owner = NULL;
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &f, 0, NULL, &ev));
  CHECK_RC(tdm_event_query(ev), TDM_EAGAIN);
  CHECK_OK(tdm_event_retain(ev));
  CHECK_OK(tdm_event_release(ev)); /* still one reference left */
  CHECK_RC(tdm_event_query(ev), TDM_EAGAIN);
  CHECK_OK(tdm_event_queue(ev, &owner));
  CHECK(owner == q);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(tdm_event_query(ev));
  CHECK_EQ(atomic_load(&f.done), 1);
  CHECK_OK(tdm_event_release(ev));

  /* Releasing the last reference of a pending event is allowed; the work still runs. */
  th_gate g2;
  th_gate_init(&g2);
  struct flag_task f2 = {&g2, 0, 0};
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &f2, 0, NULL, &ev));
  CHECK_OK(tdm_event_release(ev));
  th_gate_open(&g2);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&f2.done), 1);
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&gate);
  th_gate_destroy(&g2);
  th_close();
}

/* Completion seen only by polling: many copies whose events nobody holds (a backend may give
 * them no native event of their own), then a marker that is only ever queried, never waited
 * for. Polling must see it complete, with everything before it done and no command pending;
 * a queue that only completes work when someone blocks on it would spin here forever. */
TEST_CASE(event_query_polling) {
  enum { COPIES = 300, BYTES = 4096 };
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, (size_t)COPIES * BYTES);
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, (size_t)COPIES * BYTES);
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, (size_t)COPIES * BYTES);
  th_fill_random(src, (size_t)COPIES * BYTES, &rng);
  memset(back, 0, (size_t)COPIES * BYTES);
  for (int i = 0; i < COPIES; i++) {
    size_t off = (size_t)i * BYTES;
    CHECK_OK(tdm_memcpy(q, d + off, src + off, BYTES, TDM_COPY_AUTO, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q, back + off, d + off, BYTES, TDM_COPY_AUTO, 0, NULL, NULL));
  }
  tdm_event *ev;
  CHECK_OK(tdm_event_record(q, &ev));
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc;
  while ((rc = tdm_event_query(ev)) == TDM_EAGAIN) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    CHECK_MSG(t.tv_sec - t0.tv_sec < TH_HANG_MS / 1000, "the marker never completed by polling");
    sched_yield();
  }
  CHECK_OK(rc);
  CHECK_MEM_EQ(back, src, (size_t)COPIES * BYTES);
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(event_timing) {
  tdm_device *dev = th_open();
  tdm_event *f1 = NULL, *f2 = NULL;
  double ms = -123.0;
  /* Without TDM_QUEUE_TIMING there is nothing to measure. */
  tdm_queue *plain = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_event_record(plain, &f1));
  CHECK_OK(tdm_event_record(plain, &f2));
  CHECK_OK(tdm_queue_sync(plain));
  CHECK_RC(tdm_event_elapsed(f1, f2, &ms), TDM_ENOTSUP);
  CHECK(ms == -123.0);
  wait_ok(f1);
  wait_ok(f2);
  CHECK_OK(tdm_queue_destroy(plain));
  if (!has_cap(dev, TDM_DEVICE_CAP_TIMING)) {
    th_close();
    TH_SKIP("%s has no timing", th_device_id);
  }

  const size_t n = 1 << 20;
  tdm_queue *q = new_queue(dev, TDM_QUEUE_TIMING), *q2 = new_queue(dev, TDM_QUEUE_TIMING);
  unsigned char *h = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  memset(h, 0x5e, n);
  tdm_event *e1 = NULL, *e2 = NULL, *e3 = NULL, *g = NULL;
  CHECK_OK(tdm_event_record(q, &e1));
  CHECK_OK(tdm_memcpy(q, d, h, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &e2));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_elapsed(e1, e2, &ms));
  CHECK_MSG(ms >= 0.0 && isfinite(ms), "elapsed %f ms", ms);
  printf("elapsed for a 1 MiB H2D: %.3f ms\n", ms);

  /* Pending end event: TDM_EAGAIN, ms untouched. */
  th_gate gate;
  th_gate_init(&gate);
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &e3));
  ms = -123.0;
  CHECK_RC(tdm_event_elapsed(e1, e3, &ms), TDM_EAGAIN);
  CHECK(ms == -123.0);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(e3));
  CHECK_OK(tdm_event_elapsed(e1, e3, &ms));
  CHECK(ms >= 0.0 && isfinite(ms));

  /* Two timing queues of one device. */
  CHECK_OK(tdm_event_record(q2, &g));
  CHECK_OK(tdm_event_wait(g));
  CHECK_OK(tdm_event_elapsed(e1, g, &ms));
  CHECK(isfinite(ms));
  wait_ok(e1);
  wait_ok(e2);
  wait_ok(e3);
  wait_ok(g);
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(q2));
  th_gate_destroy(&gate);
  th_close();
}

/* ---- Stream-ordered free ----------------------------------------------------------------- */

static long live_allocations(void) {
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  return st.allocations;
}

TEST_CASE(free_async) {
  const size_t n = 4096;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  th_fill_random(src, n, &rng);
  th_fill_random(out, n, &rng);
  th_gate gate;
  th_gate_init(&gate);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  long live = live_allocations();
  tdm_event *fev = NULL;

  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, out, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_free_async(q, d, 0, NULL, &fev));
  /* Using the pointer after the free was submitted is refused at once. */
  CHECK_RC(tdm_memcpy(q, d, src, 16, TDM_COPY_H2D, 0, NULL, NULL), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, out, d, 16, TDM_COPY_D2H, 0, NULL, NULL), TDM_EINVAL);
  CHECK_RC(tdm_memset(q, d, 1, 16, 0, NULL, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_query(fev), TDM_EAGAIN);
  CHECK_EQ(live_allocations(), live); /* not freed while earlier work is held back */
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(fev));
  CHECK_OK(tdm_event_release(fev));
  CHECK_OK(tdm_queue_sync(q)); /* the refused calls were never queue errors */
  CHECK_MEM_EQ(out, src, n);
  CHECK_EQ(live_allocations(), live - 1);

  /* With a dependency on another queue: freed only after it. */
  th_gate g2;
  th_gate_init(&g2);
  tdm_event *er = NULL;
  d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  CHECK_OK(tdm_host_task(r, task_wait_gate, &g2, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(r, d, src, n, TDM_COPY_H2D, 0, NULL, &er));
  CHECK_OK(tdm_free_async(q, d, 1, &er, &fev));
  CHECK_RC(tdm_event_query(fev), TDM_EAGAIN);
  CHECK_EQ(live_allocations(), live);
  th_gate_open(&g2);
  CHECK_OK(tdm_event_wait(fev));
  CHECK_EQ(live_allocations(), live - 1);
  wait_ok(fev);
  wait_ok(er);

  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  th_gate_destroy(&gate);
  th_gate_destroy(&g2);
  th_close();
}

/* ---- Order tracking ---------------------------------------------------------------------- */

static void release_all(tdm_event **evs, size_t n) {
  for (size_t i = 0; i < n; i++) CHECK_OK(tdm_event_release(evs[i]));
}

TEST_CASE(tracker_dependencies) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *s = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate g1, g2;
  th_gate_init(&g1);
  th_gate_init(&g2);
  tdm_event *er = NULL, *es = NULL, *eq = NULL, *deps[8], *one = NULL;
  size_t n = 99;

  CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
  CHECK_EQ(n, 0); /* a fresh queue owes nothing */

  CHECK_OK(tdm_host_task(r, task_wait_gate, &g1, 0, NULL, &er));
  CHECK_OK(tdm_host_task(s, task_wait_gate, &g1, 0, NULL, &es));
  CHECK_OK(tdm_queue_track(q, er));
  CHECK_OK(tdm_queue_track(q, es));
  CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
  CHECK_EQ(n, 2);
  for (size_t i = 0; i < n; i++) CHECK_RC(tdm_event_query(deps[i]), TDM_EAGAIN);
  release_all(deps, n);

  /* q's own held-back submission joins the list. */
  CHECK_OK(tdm_host_task(q, task_wait_gate, &g2, 0, NULL, &eq));
  CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
  CHECK_EQ(n, 3);
  /* The entries are new references: they stay valid after ours go. */
  CHECK_OK(tdm_event_release(er));
  CHECK_OK(tdm_event_release(es));
  for (size_t i = 0; i < n; i++) CHECK_RC(tdm_event_query(deps[i]), TDM_EAGAIN);

  /* cap = 1: one event that follows all three. */
  size_t n1 = 99;
  CHECK_OK(tdm_queue_dependencies(q, &one, 1, &n1));
  CHECK_EQ(n1, 1);
  CHECK_RC(tdm_event_query(one), TDM_EAGAIN);
  th_gate_open(&g1);
  CHECK_RC(tdm_event_query(eq), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(one), TDM_EAGAIN); /* q's own task is still held back */
  th_gate_open(&g2);
  CHECK_OK(tdm_event_wait(one));
  CHECK_OK(tdm_event_query(eq));
  for (size_t i = 0; i < n; i++) CHECK_OK(tdm_event_wait(deps[i]));
  release_all(deps, n);
  CHECK_OK(tdm_event_release(one));
  CHECK_OK(tdm_event_release(eq));

  /* Completed entries are pruned. */
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
  CHECK_EQ(n, 0);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  CHECK_OK(tdm_queue_destroy(s));
  th_gate_destroy(&g1);
  th_gate_destroy(&g2);
  th_close();
}

/* With $TANDEM_TRACKER_CAPACITY=4, tracking six pending events overflows the tracker: the
 * entries collapse into a barrier on q, so later work on q waits for them, and cap = 1 works. */
TEST_CASE(tracker_overflow) {
  enum { N = 6 };
  CHECK(setenv("TANDEM_TRACKER_CAPACITY", "4", 1) == 0);
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  atomic_int r_done = 0;
  tdm_event *er[N], *deps[16], *one = NULL, *et = NULL;
  size_t n = 99;
  tdm_stats base, now;
  CHECK_OK(tdm_stats_get(&base));

  CHECK_OK(tdm_host_task(r, task_wait_gate, &gate, 0, NULL, &er[0]));
  CHECK_OK(tdm_queue_track(q, er[0]));
  for (int i = 1; i < N; i++) {
    CHECK_OK(tdm_host_task(r, task_count, &r_done, 0, NULL, &er[i]));
    CHECK_OK(tdm_queue_track(q, er[i]));
  }
  CHECK_OK(tdm_queue_dependencies(q, deps, 16, &n));
  CHECK_MSG(n >= 1 && n <= 4, "%zu entries with a capacity of 4", n);
  release_all(deps, n);

  /* Later work on q waits for (at least) the collapsed entries, which include er[0]. */
  atomic_int probe = 0;
  CHECK_OK(tdm_host_task(q, task_count, &probe, 0, NULL, &et));
  CHECK_RC(tdm_event_query(et), TDM_EAGAIN);

  CHECK_OK(tdm_queue_dependencies(q, &one, 1, &n));
  CHECK_EQ(n, 1);
  CHECK_RC(tdm_event_query(one), TDM_EAGAIN);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(one));
  CHECK_EQ(atomic_load(&r_done), N - 1); /* it followed every tracked event */
  CHECK_OK(tdm_event_release(one));
  wait_ok(et);
  release_all(er, N);

  /* Many more: still bounded, and nothing leaks once it all completes. */
  for (int i = 0; i < 100; i++) {
    tdm_event *ev = NULL;
    CHECK_OK(tdm_host_task(r, task_count, &r_done, 0, NULL, &ev));
    CHECK_OK(tdm_queue_track(q, ev));
    CHECK_OK(tdm_event_release(ev));
  }
  CHECK_OK(tdm_queue_sync(r));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_stats_get(&now));
  CHECK_EQ(now.pending, 0);
  CHECK_MSG(now.events <= base.events + 4, "%ld events live, %ld at the start", now.events,
            base.events);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  th_gate_destroy(&gate);
  th_close();
}

/* A tracked foreign event that fails before the tracker collapses it makes the collapse barrier
 * fail, and through it later work on q that never named the event (the header says so): it
 * completes with TDM_EDEP, the next sync reports the failure once, and q stays usable. A
 * tdm_queue_dependencies call with a small cap submits that barrier itself. */
static int task_fail_after_gate(void *arg) {
  th_gate_wait(arg, TH_HANG_MS);
  return TDM_EINVAL;
}

TEST_CASE(tracker_collapse_failure) {
  CHECK(setenv("TANDEM_TRACKER_CAPACITY", "2", 1) == 0);
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  atomic_int ran = 0;
  tdm_event *bad = NULL, *other = NULL, *one = NULL, *later = NULL;
  size_t n = 0;
  CHECK_OK(tdm_host_task(r, task_fail_after_gate, &gate, 0, NULL, &bad));
  CHECK_OK(tdm_host_task(r, task_count, &ran, 0, NULL, &other));
  CHECK_OK(tdm_queue_track(q, bad));
  CHECK_OK(tdm_queue_track(q, other));
  CHECK_OK(tdm_queue_dependencies(q, &one, 1, &n)); /* collapses: submits the barrier to q */
  CHECK_EQ(n, 1);
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, &later));
  th_gate_open(&gate);
  CHECK_RC(tdm_event_wait(bad), TDM_EINVAL);
  CHECK_RC(tdm_event_wait(one), TDM_EDEP);
  CHECK_RC(tdm_event_wait(later), TDM_EDEP); /* never named bad, did not run */
  CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
  CHECK_OK(tdm_queue_sync(q)); /* reported once */
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_RC(tdm_queue_sync(r), TDM_EINVAL);
  CHECK_EQ(atomic_load(&ran), 1); /* only the task after the failure was reported (other
                                     ran behind bad on r, so it failed with TDM_EDEP too) */
  tdm_event *held[] = {bad, other, one, later};
  release_all(held, 4);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  th_gate_destroy(&gate);
  th_close();
}

/* ---- Default and current queues ---------------------------------------------------------- */

TEST_CASE(default_queue) {
  unsetenv("TANDEM_DEFAULT_QUEUE");
  tdm_device *dev = th_open();
  tdm_queue *d1 = NULL, *d2 = NULL, *got = NULL, *q = NULL;
  tdm_device *qdev = NULL;
  unsigned flags = 99;
  atomic_int count = 0;
  CHECK_OK(tdm_default_queue(dev, &d1));
  CHECK_OK(tdm_default_queue(dev, &d2));
  CHECK(d1 != NULL && d1 == d2);
  CHECK_OK(tdm_queue_flags(d1, &flags));
  CHECK_EQ(flags & TDM_QUEUE_OUT_OF_ORDER, 0);
  CHECK_OK(tdm_queue_device(d1, &qdev));
  CHECK(qdev == dev);
  CHECK_RC(tdm_queue_destroy(d1), TDM_EBUSY); /* tandem owns it */
  CHECK_OK(tdm_host_task(d1, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(d1));
  CHECK_EQ(atomic_load(&count), 1);

  q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_default_queue_set(dev, q));
  CHECK_OK(tdm_default_queue(dev, &got));
  CHECK(got == q);
  CHECK_OK(tdm_default_queue_set(dev, NULL));
  CHECK_OK(tdm_default_queue(dev, &got));
  CHECK(got == d1);

  /* Destroying an installed queue uninstalls it. */
  CHECK_OK(tdm_default_queue_set(dev, q));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_default_queue(dev, &got));
  CHECK(got == d1);
  CHECK_OK(tdm_host_task(got, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(got));
  CHECK_EQ(atomic_load(&count), 2);
  th_close();
}

struct other_thread {
  tdm_queue *seen;
  int pop_rc;
};

static void *look_from_other_thread(void *arg) {
  struct other_thread *o = arg;
  CHECK_OK(tdm_current_queue(&o->seen));
  o->pop_rc = tdm_current_queue_pop();
  return NULL;
}

TEST_CASE(current_queue) {
  unsetenv("TANDEM_DEVICE");
  tdm_device *dev = th_open();
  tdm_queue *def = NULL, *cur = NULL;
  tdm_queue *q1 = new_queue(dev, TDM_QUEUE_IN_ORDER), *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_default_queue(NULL, &def));
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == def);
  CHECK_OK(tdm_current_queue_push(q1));
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == q1);
  CHECK_OK(tdm_current_queue_push(q2));
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == q2);

  /* Another thread has its own (empty) stack. */
  struct other_thread o = {NULL, 0};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, look_from_other_thread, &o) == 0);
  pthread_join(th, NULL);
  CHECK(o.seen == def);
  CHECK_EQ(o.pop_rc, TDM_ESTATE);

  CHECK_OK(tdm_current_queue_pop());
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == q1);
  CHECK_OK(tdm_current_queue_pop());
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == def);
  CHECK_RC(tdm_current_queue_pop(), TDM_ESTATE);

  /* Depth up to 64; one more is refused and changes nothing. */
  for (int i = 0; i < 64; i++) CHECK_OK(tdm_current_queue_push(i % 2 ? q2 : q1));
  int rc = tdm_current_queue_push(q1);
  CHECK_MSG(rc < 0, "push 65 returned %s", tdm_err_name(rc));
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == q2);
  for (int i = 0; i < 64; i++) CHECK_OK(tdm_current_queue_pop());
  CHECK_RC(tdm_current_queue_pop(), TDM_ESTATE);
  CHECK_OK(tdm_queue_destroy(q1));
  CHECK_OK(tdm_queue_destroy(q2));
  th_close();
}

/* ---- Environment options ----------------------------------------------------------------- */

TEST_CASE(env_default_queue_ooo) {
  CHECK(setenv("TANDEM_DEFAULT_QUEUE", "out_of_order", 1) == 0);
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *d = NULL;
  unsigned flags = 0;
  atomic_int count = 0;
  CHECK_OK(tdm_default_queue(dev, &d));
  CHECK_OK(tdm_queue_flags(d, &flags));
  CHECK(flags & TDM_QUEUE_OUT_OF_ORDER);
  CHECK_OK(tdm_host_task(d, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(d, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(d));
  CHECK_EQ(atomic_load(&count), 2);
  th_close();
}

TEST_CASE(env_default_queue_in_order) {
  CHECK(setenv("TANDEM_DEFAULT_QUEUE", "in_order", 1) == 0);
  tdm_device *dev = th_open();
  tdm_queue *d = NULL;
  unsigned flags = 99;
  CHECK_OK(tdm_default_queue(dev, &d));
  CHECK_OK(tdm_queue_flags(d, &flags));
  CHECK_EQ(flags & TDM_QUEUE_OUT_OF_ORDER, 0);
  th_close();
}

TEST_CASE(env_device) {
  CHECK(setenv("TANDEM_DEVICE", th_device_id, 1) == 0);
  tdm_device *dev = th_open();
  tdm_device *found = NULL, *qdev = NULL;
  tdm_queue *d = NULL, *cur = NULL;
  CHECK_OK(tdm_device_find(NULL, &found));
  CHECK(found == dev);
  found = NULL;
  CHECK_OK(tdm_device_find("", &found));
  CHECK(found == dev);
  CHECK_OK(tdm_default_queue(NULL, &d));
  CHECK_OK(tdm_queue_device(d, &qdev));
  CHECK(qdev == dev);
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur == d);
  th_close();
}

/* ---- Errors ------------------------------------------------------------------------------ */

TEST_CASE(error_propagation) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  atomic_int ran_q = 0, ran_r = 0, ran_r2 = 0, ran_again = 0;
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, 256), *dst = dev_alloc(dev, TDM_MEM_PINNED, 256);
  unsigned char before[256];
  th_fill_random(src, 256, &rng);
  th_fill_random(dst, 256, &rng);
  memcpy(before, dst, 256);
  tdm_event *e_fail, *e_task, *e_copy, *e_dep, *e_dep2, *m;

  /* Held back so that every submission below is made before anything runs. */
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_fail_einval, NULL, 0, NULL, &e_fail));
  CHECK_OK(tdm_host_task(q, task_count, &ran_q, 0, NULL, &e_task));
  CHECK_OK(tdm_memcpy(q, dst, src, 256, TDM_COPY_H2H, 0, NULL, &e_copy));
  CHECK_OK(tdm_host_task(r, task_count, &ran_r, 1, &e_fail, &e_dep));
  CHECK_OK(tdm_host_task(r, task_count, &ran_r2, 0, NULL, &e_dep2));
  CHECK_OK(tdm_event_record(q, &m));
  th_gate_open(&gate);

  CHECK_RC(tdm_event_wait(e_fail), TDM_EINVAL);
  CHECK_RC(tdm_event_wait(e_task), TDM_EDEP);
  CHECK_RC(tdm_event_wait(e_copy), TDM_EDEP);
  CHECK_RC(tdm_event_wait(e_dep), TDM_EDEP);
  CHECK_RC(tdm_event_wait(e_dep2), TDM_EDEP);
  CHECK_RC(tdm_event_wait(m), TDM_EINVAL); /* the marker reports the first error */
  CHECK_RC(tdm_event_query(e_fail), TDM_EINVAL);
  CHECK_EQ(atomic_load(&ran_q), 0);
  CHECK_EQ(atomic_load(&ran_r), 0);
  CHECK_EQ(atomic_load(&ran_r2), 0);
  CHECK_MEM_EQ(dst, before, 256);

  CHECK_RC(tdm_queue_sync(q), TDM_EINVAL);
  CHECK_OK(tdm_queue_sync(q)); /* reported once */
  CHECK_RC(tdm_queue_sync(r), TDM_EDEP);
  CHECK_OK(tdm_queue_sync(r));

  /* The queue works again. */
  tdm_event *e_again = NULL, *m2 = NULL;
  CHECK_OK(tdm_host_task(q, task_count, &ran_again, 0, NULL, &e_again));
  CHECK_OK(tdm_memcpy(q, dst, src, 256, TDM_COPY_H2H, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &m2));
  wait_ok(e_again);
  wait_ok(m2);
  CHECK_EQ(atomic_load(&ran_again), 1);
  CHECK_MEM_EQ(dst, src, 256);

  tdm_event *all[] = {e_fail, e_task, e_copy, e_dep, e_dep2, m};
  release_all(all, 6);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(dst));
  th_gate_destroy(&gate);
  th_close();
}

/* Waits for events that have already completed: a successful one orders nothing and the
 * queue goes on (in-order and out-of-order), also as a dependency; a failed one still fails
 * what waits for it. */
TEST_CASE(wait_completed_events) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, 512), *dst = dev_alloc(dev, TDM_MEM_PINNED, 512);
  for (int round = 0; round < 2; round++) {
    unsigned flags = round ? TDM_QUEUE_OUT_OF_ORDER : TDM_QUEUE_IN_ORDER;
    if (round && !has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) break;
    tdm_queue *p = new_queue(dev, TDM_QUEUE_IN_ORDER), *q = new_queue(dev, flags);
    atomic_int ran = 0;
    tdm_event *ok = NULL, *bad = NULL, *copied = NULL, *task = NULL, *after = NULL;
    CHECK_OK(tdm_host_task(p, task_count, &ran, 0, NULL, &ok));
    CHECK_OK(tdm_event_wait(ok));
    CHECK_OK(tdm_queue_wait(q, ok));
    th_fill_random(src, 512, &rng);
    CHECK_OK(tdm_memcpy(q, dst, src, 512, TDM_COPY_H2H, 1, &ok, &copied));
    CHECK_OK(tdm_event_wait(copied));
    CHECK_MEM_EQ(dst, src, 512);
    CHECK_OK(tdm_queue_sync(q));
    /* A failed event stays a failure, completed or not. */
    CHECK_OK(tdm_host_task(p, task_fail_einval, NULL, 0, NULL, &bad));
    CHECK_RC(tdm_event_wait(bad), TDM_EINVAL);
    CHECK_RC(tdm_queue_sync(p), TDM_EINVAL);
    CHECK_OK(tdm_host_task(q, task_count, &ran, 1, &bad, &task));
    CHECK_RC(tdm_event_wait(task), TDM_EDEP);
    CHECK_OK(tdm_queue_wait(q, bad));
    CHECK_OK(tdm_event_record(q, &after));
    CHECK(tdm_event_wait(after) < 0);
    CHECK(tdm_queue_sync(q) < 0);
    CHECK_OK(tdm_queue_sync(q));
    CHECK_EQ(atomic_load(&ran), 1);
    tdm_event *all[] = {ok, bad, copied, task, after};
    release_all(all, 5);
    CHECK_OK(tdm_queue_destroy(q));
    CHECK_OK(tdm_queue_destroy(p));
  }
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(dst));
  th_close();
}

/* A marker reports a failure whose own event nobody asked for. */
TEST_CASE(error_marker_without_event) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *m = NULL;
  CHECK_OK(tdm_host_task(q, task_fail_einval, NULL, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q, &m));
  CHECK_RC(tdm_event_wait(m), TDM_EINVAL);
  CHECK_OK(tdm_event_release(m));
  CHECK_RC(tdm_queue_sync(q), TDM_EINVAL);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(error_positive_return) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *ev = NULL;
  CHECK_OK(tdm_host_task(q, task_return_positive, NULL, 0, NULL, &ev));
  CHECK_RC(tdm_event_wait(ev), TDM_ETASK);
  CHECK_OK(tdm_event_release(ev));
  CHECK_RC(tdm_queue_sync(q), TDM_ETASK);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Queue destruction ------------------------------------------------------------------- */

struct opener {
  th_gate *gate;
};

static void *open_gate_later(void *arg) {
  th_sleep_ms(50); /* makes destroy really wait; the result does not depend on it */
  th_gate_open(((struct opener *)arg)->gate);
  return NULL;
}

static void destroy_drains_round(tdm_device *dev, unsigned flags) {
  enum { N = 200 };
  tdm_queue *q = new_queue(dev, flags);
  th_gate gate;
  th_gate_init(&gate);
  struct flag_task first = {&gate, 0, 0};
  atomic_int count = 0;
  CHECK_OK(tdm_host_task(q, task_gate_then_done, &first, 0, NULL, NULL));
  for (int i = 0; i < N; i++) CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, NULL));
  struct opener o = {&gate};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, open_gate_later, &o) == 0);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_EQ(atomic_load(&first.done), 1);
  CHECK_EQ(atomic_load(&count), N);
  pthread_join(th, NULL);
  th_gate_destroy(&gate);
}

TEST_CASE(destroy_drains) {
  tdm_device *dev = th_open();
  destroy_drains_round(dev, TDM_QUEUE_IN_ORDER);
  if (has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) destroy_drains_round(dev, TDM_QUEUE_OUT_OF_ORDER);
  th_close();
}

/* destroy returns the queue's unreported error; its events stay valid afterwards. */
TEST_CASE(destroy_result_events_valid) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *owner = NULL;
  atomic_int count = 0;
  tdm_event *e_ok = NULL, *m = NULL, *e_fail = NULL, *e_after = NULL;
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &e_ok));
  CHECK_OK(tdm_event_record(q, &m));
  CHECK_OK(tdm_host_task(q, task_fail_einval, NULL, 0, NULL, &e_fail));
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &e_after));
  CHECK_RC(tdm_queue_destroy(q), TDM_EINVAL);
  CHECK_OK(tdm_event_query(e_ok));
  CHECK_OK(tdm_event_wait(m));
  CHECK_RC(tdm_event_wait(e_fail), TDM_EINVAL);
  CHECK_RC(tdm_event_query(e_after), TDM_EDEP);
  CHECK_OK(tdm_event_queue(e_ok, &owner)); /* borrowed, and destroyed: only the call is valid */
  CHECK_EQ(atomic_load(&count), 1);
  CHECK_OK(tdm_event_release(e_ok));
  CHECK_OK(tdm_event_release(m));
  CHECK_OK(tdm_event_release(e_fail));
  CHECK_OK(tdm_event_release(e_after));

  /* A clean queue destroys with 0, and a reported error is not reported again. */
  q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_destroy(q));
  q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_host_task(q, task_fail_einval, NULL, 0, NULL, NULL));
  CHECK_RC(tdm_queue_sync(q), TDM_EINVAL);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Imported native events -------------------------------------------------------------- */

/* A native event that the test completes when it chooses:
 * - OpenCL: a user event in the device's context (tdm_device_native's);
 * - CUDA: an event recorded on a tandem queue's stream behind a host task that waits for a
 *   gate: tandem holds the stream on the device until the task has run, so the event is
 *   pending, with no kernel and no timing involved, until the test opens the gate.
 * CPU devices have no native events (tdm_event_import: TDM_ENOTSUP). */
enum native_kind { NATIVE_NONE, NATIVE_OPENCL, NATIVE_CUDA };

struct native_ev {
  enum native_kind kind;
  void *ev;     /* the cl_event or cudaEvent_t; NULL once the test gave it up */
  th_gate gate; /* CUDA: the host task holding gq waits for it */
  tdm_queue *gq;
};

static enum native_kind native_kind_of(tdm_device *dev) {
  const char *b = th_backend_of(dev);
  if (strcmp(b, "opencl") == 0) {
#ifdef TANDEM_TEST_OPENCL
    return NATIVE_OPENCL;
#else
    TH_SKIP("this build has no OpenCL headers for the test");
#endif
  }
  if (strcmp(b, "cuda") == 0) {
#ifdef TANDEM_TEST_CUDA
    return NATIVE_CUDA;
#else
    TH_SKIP("this build has no CUDA runtime for the test");
#endif
  }
  return NATIVE_NONE;
}

#ifdef TANDEM_TEST_OPENCL
#define CHECK_CL(call) CHECK_MSG((call) == CL_SUCCESS, "%s failed", #call)
static cl_context device_context(tdm_device *dev) {
  void *ctx = NULL;
  CHECK_OK(tdm_device_native(dev, &ctx));
  return (cl_context)ctx;
}
#endif
#ifdef TANDEM_TEST_CUDA
#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t th_e_ = (call);                                                               \
    CHECK_MSG(th_e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(th_e_));              \
  } while (0)
#endif

/* A native event that stays pending until native_complete. */
static void native_pending(tdm_device *dev, enum native_kind kind, struct native_ev *n) {
  memset(n, 0, sizeof *n);
  n->kind = kind;
#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    cl_int err = CL_SUCCESS;
    n->ev = clCreateUserEvent(device_context(dev), &err);
    CHECK_MSG(n->ev && err == CL_SUCCESS, "clCreateUserEvent: %d", err);
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (kind == NATIVE_CUDA) {
    th_gate_init(&n->gate);
    n->gq = new_queue(dev, TDM_QUEUE_IN_ORDER);
    CHECK_OK(tdm_host_task(n->gq, task_wait_gate, &n->gate, 0, NULL, NULL));
    void *s = NULL;
    CHECK_OK(tdm_queue_native(n->gq, &s));
    cudaEvent_t e;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(e, (cudaStream_t)s));
    CHECK(cudaEventQuery(e) == cudaErrorNotReady);
    n->ev = e;
  }
#endif
  (void)dev;
}

/* Completes it; status < 0 makes it fail (OpenCL only: a CUDA event cannot report a failure
 * without a fault that breaks the whole context). */
static void native_complete(struct native_ev *n, int status) {
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL)
    CHECK_CL(clSetUserEventStatus((cl_event)n->ev, status < 0 ? status : CL_COMPLETE));
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    CHECK(status == 0);
    th_gate_open(&n->gate);
  }
#endif
  (void)status;
}

/* CUDA: destroys the queue that held the event back (counted in tdm_stats_get). */
static void native_free_queue(struct native_ev *n) {
  if (n->gq) {
    CHECK_OK(tdm_queue_destroy(n->gq));
    th_gate_destroy(&n->gate);
    n->gq = NULL;
  }
}

static void native_free(struct native_ev *n) {
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL && n->ev) {
    /* tandem gives back every reference it took once its event is freed (the last one from
     * a thread of its own, soon after). */
    cl_uint refs = 0;
    for (int waited = 0;; waited++) {
      CHECK_CL(clGetEventInfo((cl_event)n->ev, CL_EVENT_REFERENCE_COUNT, sizeof refs, &refs,
                              NULL));
      if (refs == 1 || waited >= TH_HANG_MS) break;
      th_sleep_ms(1);
    }
    CHECK_EQ(refs, 1);
    CHECK_CL(clReleaseEvent((cl_event)n->ev));
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    if (n->ev) CHECK_CUDA(cudaEventDestroy((cudaEvent_t)n->ev));
  }
#endif
  native_free_queue(n);
  n->ev = NULL;
}

/* A native event that has already completed. */
static void native_completed(tdm_device *dev, enum native_kind kind, struct native_ev *n) {
  memset(n, 0, sizeof *n);
  n->kind = kind;
#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    native_pending(dev, kind, n);
    native_complete(n, 0);
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (kind == NATIVE_CUDA) {
    tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
    void *s = NULL;
    CHECK_OK(tdm_queue_native(q, &s));
    cudaEvent_t e;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(e, (cudaStream_t)s));
    CHECK_CUDA(cudaEventSynchronize(e));
    CHECK_OK(tdm_queue_destroy(q));
    n->ev = e;
  }
#endif
  (void)dev;
}

/* After the import: on CUDA the caller may re-record its event and destroy it at once; the
 * import still stands for the work recorded into it before (the gated stream). */
static void native_after_import(struct native_ev *n) {
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    cudaStream_t idle;
    CHECK_CUDA(cudaStreamCreateWithFlags(&idle, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventRecord((cudaEvent_t)n->ev, idle));
    CHECK_CUDA(cudaEventSynchronize((cudaEvent_t)n->ev)); /* the re-recorded event completes */
    CHECK_CUDA(cudaEventDestroy((cudaEvent_t)n->ev));
    CHECK_CUDA(cudaStreamDestroy(idle));
    n->ev = NULL;
  }
#endif
  (void)n;
}

/* What tdm_event_native gives for an import of n, while n's work is pending. */
static void native_check_export(const struct native_ev *n, void *exported, void *orig) {
  CHECK(exported != NULL);
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL) CHECK(exported == orig); /* the caller's own cl_event */
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) /* tandem's own event, for the same (pending) work */
    CHECK(cudaEventQuery((cudaEvent_t)exported) == cudaErrorNotReady);
#endif
  (void)n;
  (void)orig;
}

/* Live objects come back to the baseline: the last references may be dropped on tandem's
 * threads just after the waits the test made return. */
static void check_stats_back(const tdm_stats *base) {
  tdm_stats now;
  for (int waited = 0;; waited++) {
    CHECK_OK(tdm_stats_get(&now));
    if (now.events == base->events && now.pending == base->pending &&
        now.queues == base->queues && now.allocations == base->allocations)
      return;
    CHECK_MSG(waited < TH_HANG_MS, "stats: %ld events, %ld pending, %ld queues, %ld allocations; "
              "baseline %ld, %ld, %ld, %ld", now.events, now.pending, now.queues,
              now.allocations, base->events, base->pending, base->queues, base->allocations);
    th_sleep_ms(1);
  }
}

/* A CPU device refuses imports; returns whether dev is one (and the case is over). */
static int import_cpu_refuses(tdm_device *dev, enum native_kind kind) {
  if (kind != NATIVE_NONE) return 0;
  int dummy = 0;
  tdm_event *ev = (tdm_event *)(uintptr_t)0x5e;
  CHECK_RC(tdm_event_import(dev, &dummy, &ev), TDM_ENOTSUP);
  CHECK(ev == (tdm_event *)(uintptr_t)0x5e);
  th_close();
  return 1;
}

/* OpenCL: the event of a command that other code enqueued on its own queue in the device's
 * context (as pyopencl does), imported: a tandem copy that depends on it reads what the
 * command wrote. */
static void import_foreign_command(tdm_device *dev, tdm_queue *q, size_t n, uint64_t *rng) {
#ifdef TANDEM_TEST_OPENCL
  cl_device_id id;
  cl_context ctx = device_context(dev);
  CHECK_CL(clGetContextInfo(ctx, CL_CONTEXT_DEVICES, sizeof id, &id, NULL));
  cl_int err = CL_SUCCESS;
  cl_command_queue uq = clCreateCommandQueue(ctx, id, 0, &err);
  CHECK_MSG(uq && err == CL_SUCCESS, "clCreateCommandQueue: %d", err);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *back = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *mem = NULL;
  size_t off = 0;
  th_fill_random(src, n, rng);
  memset(back, 0, n);
  CHECK_OK(tdm_mem_native(d, &mem, &off));
  cl_event wev = NULL;
  CHECK_CL(clEnqueueWriteBuffer(uq, (cl_mem)mem, CL_FALSE, off, n, src, 0, NULL, &wev));
  tdm_event *imp = NULL;
  CHECK_OK(tdm_event_import(dev, wev, &imp));
  CHECK_CL(clReleaseEvent(wev)); /* tandem holds its own references */
  CHECK_OK(tdm_memcpy(q, back, d, n, TDM_COPY_D2H, 1, &imp, NULL));
  CHECK_OK(tdm_event_release(imp));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(back, src, n);
  CHECK_CL(clFinish(uq));
  CHECK_CL(clReleaseCommandQueue(uq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
#else
  (void)dev, (void)q, (void)n, (void)rng;
#endif
}

struct import_task {
  tdm_event *imp;
  atomic_int ran, saw_done;
};

static int task_check_import(void *arg) {
  struct import_task *t = arg;
  atomic_store(&t->saw_done, tdm_event_query(t->imp) == 0);
  atomic_fetch_add(&t->ran, 1);
  return 0;
}

static void check_device_holds(tdm_queue *q, unsigned char *back, const void *d,
                               const unsigned char *want, size_t n) {
  read_device(q, back, d, n);
  CHECK_MEM_EQ(back, want, n);
}

/* An imported native event in a dependency list, a device-side wait, a host task of cpu:0
 * (the bridge between backends) and a tracker: all of them wait until the test completes the
 * native event, then the data arrives. A second import of the same event is released while
 * pending; an import of an event that already completed completes at once, whatever other
 * imports are still pending. */
TEST_CASE(import_event) {
  const size_t n = (1u << 20) + 3;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  if (import_cpu_refuses(dev, kind)) return;
  tdm_device *cpu = NULL;
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));

  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *q3 = new_queue(dev, TDM_QUEUE_IN_ORDER), *q4 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *cq = new_queue(cpu, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *src2 = dev_alloc(dev, TDM_MEM_PINNED, n);
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, n), *pattern = malloc(n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *d2 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);
  th_fill_random(src2, n, &rng);
  memset(pattern, 0x5a, n);
  CHECK_OK(tdm_memset(q3, d, 0x5a, n, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q3, d2, 0x5a, n, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q3));

  struct native_ev a;
  native_pending(dev, kind, &a);
  void *orig = a.ev;
  tdm_event *imp = NULL, *imp2 = NULL;
  CHECK_OK(tdm_event_import(dev, a.ev, &imp));
  CHECK_OK(tdm_event_import(dev, a.ev, &imp2));
  CHECK(imp != NULL && imp2 != NULL && imp != imp2);
  native_after_import(&a);
  void *exported = NULL;
  CHECK_OK(tdm_event_native(imp, &exported));
  native_check_export(&a, exported, orig);
  tdm_queue *owner = NULL;
  CHECK_RC(tdm_event_queue(imp, &owner), TDM_ENOTSUP);
  CHECK(owner == NULL);

  tdm_event *copy_ev = NULL, *wait_ev = NULL, *task_ev = NULL;
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 1, &imp2, &copy_ev));
  CHECK_OK(tdm_event_release(imp2)); /* tandem keeps what the copy needs */
  CHECK_RC(tdm_event_release(imp2), TDM_EHANDLE);
  CHECK_OK(tdm_queue_wait(q2, imp));
  CHECK_OK(tdm_memcpy(q2, d2, src2, n, TDM_COPY_H2D, 0, NULL, &wait_ev));
  struct import_task t = {.imp = imp};
  CHECK_OK(tdm_host_task(cq, task_check_import, &t, 1, &imp, &task_ev));
  CHECK_OK(tdm_queue_track(q4, imp));
  tdm_event *deps[4] = {NULL};
  size_t ndeps = 0;
  CHECK_OK(tdm_queue_dependencies(q4, deps, 4, &ndeps));
  CHECK_EQ(ndeps, 1);
  CHECK(deps[0] == imp);
  CHECK_OK(tdm_event_release(deps[0]));

  /* Another import, of an event that has completed: it does not wait behind the first. */
  struct native_ev b;
  native_completed(dev, kind, &b);
  tdm_event *imp_b = NULL;
  CHECK_OK(tdm_event_import(dev, b.ev, &imp_b));
  CHECK_OK(tdm_event_wait(imp_b));
  CHECK_OK(tdm_event_release(imp_b));
  native_free(&b);

  th_sleep_ms(50); /* makes a wrong order likelier to show; the checks do not depend on it */
  CHECK_RC(tdm_event_query(imp), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(copy_ev), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(wait_ev), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(task_ev), TDM_EAGAIN);
  CHECK_EQ(atomic_load(&t.ran), 0);
  check_device_holds(q3, back, d, pattern, n); /* nothing arrived */
  check_device_holds(q3, back, d2, pattern, n);

  native_complete(&a, 0);
  CHECK_OK(tdm_event_wait(imp));
  CHECK_OK(tdm_event_wait(copy_ev));
  CHECK_OK(tdm_event_wait(wait_ev));
  CHECK_OK(tdm_event_wait(task_ev));
  CHECK_EQ(atomic_load(&t.ran), 1);
  CHECK_EQ(atomic_load(&t.saw_done), 1);
  check_device_holds(q, back, d, src, n);
  check_device_holds(q2, back, d2, src2, n);
  CHECK_OK(tdm_queue_sync(q4));
  if (kind == NATIVE_OPENCL) import_foreign_command(dev, q, n, &rng);

  CHECK_OK(tdm_event_release(copy_ev));
  CHECK_OK(tdm_event_release(wait_ev));
  CHECK_OK(tdm_event_release(task_ev));
  CHECK_OK(tdm_event_release(imp));
  CHECK_RC(tdm_event_release(imp), TDM_EHANDLE);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(q2));
  CHECK_OK(tdm_queue_destroy(q3));
  CHECK_OK(tdm_queue_destroy(q4));
  CHECK_OK(tdm_queue_destroy(cq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(src2));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(d2));
  free(pattern);
  native_free_queue(&a);
  check_stats_back(&base);
  native_free(&a);
  th_close();
}

/* A native event that reports a failure (an OpenCL user event set below 0) fails its import
 * with TDM_EBACKEND and the native status; what depends on it, on the same device or through
 * the bridge to cpu:0, completes with TDM_EDEP without running; the queues stay usable. */
TEST_CASE(import_event_failed) {
  const size_t n = 65537;
  const int status = -1234;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  if (kind != NATIVE_OPENCL) TH_SKIP("only an OpenCL event can report a failure");
  tdm_device *cpu = NULL;
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *cq = new_queue(cpu, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *back = dev_alloc(dev, TDM_MEM_PINNED, n);
  unsigned char *back2 = dev_alloc(dev, TDM_MEM_PINNED, n);
  /* Native work queued behind the failure may still run (tandem reports it TDM_EDEP all the
   * same), so no two queues touch the same memory. */
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *d2 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  void *d3 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);

  struct native_ev a;
  native_pending(dev, kind, &a);
  tdm_event *imp = NULL, *copy_ev = NULL, *after_ev = NULL, *wait_ev = NULL, *task_ev = NULL;
  CHECK_OK(tdm_event_import(dev, a.ev, &imp));
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 1, &imp, &copy_ev));
  CHECK_OK(tdm_memset(q, d, 0, n, 0, NULL, &after_ev)); /* behind the failure in queue order */
  CHECK_OK(tdm_queue_wait(q2, imp));
  CHECK_OK(tdm_memset(q2, d2, 0, n, 0, NULL, &wait_ev));
  struct import_task t = {.imp = imp};
  CHECK_OK(tdm_host_task(cq, task_check_import, &t, 1, &imp, &task_ev));
  tdm_queue *qo = NULL;
  tdm_event *ooo_ev = NULL;
  if (has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) {
    qo = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
    CHECK_OK(tdm_memcpy(qo, back2, d3, n, TDM_COPY_D2H, 1, &imp, &ooo_ev));
  }
  CHECK_RC(tdm_event_query(imp), TDM_EAGAIN);

  native_complete(&a, status);
  CHECK_RC(tdm_event_wait(imp), TDM_EBACKEND);
  CHECK_EQ(tdm_last_native_error(), status);
  CHECK_RC(tdm_event_wait(copy_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(after_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(wait_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(task_ev), TDM_EDEP);
  CHECK_EQ(atomic_load(&t.ran), 0);
  if (qo) {
    CHECK_RC(tdm_event_wait(ooo_ev), TDM_EDEP);
    CHECK_OK(tdm_event_release(ooo_ev));
    CHECK_RC(tdm_queue_destroy(qo), TDM_EDEP);
  }
  CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
  CHECK_RC(tdm_queue_sync(q2), TDM_EDEP);
  CHECK_RC(tdm_queue_sync(cq), TDM_EDEP);

  /* Reported and cleared: the queues work again. */
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  check_device_holds(q, back, d, src, n);
  CHECK_OK(tdm_host_task(cq, task_count, &t.ran, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(cq));
  CHECK_EQ(atomic_load(&t.ran), 1);
  CHECK_OK(tdm_queue_sync(q2));

  tdm_event *evs[] = {imp, copy_ev, after_ev, wait_ev, task_ev};
  for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++) CHECK_OK(tdm_event_release(evs[i]));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(q2));
  CHECK_OK(tdm_queue_destroy(cq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(back2));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(d2));
  CHECK_OK(tdm_free(d3));
  check_stats_back(&base);
  native_free(&a);
  th_close();
}

/* Bad arguments, an OpenCL event of another context, injected faults (each a clean error that
 * leaves nothing behind, until the import succeeds) and a lost device. */
TEST_CASE(import_event_errors) {
  int dummy = 0;
  tdm_event *const sentinel = (tdm_event *)(uintptr_t)0x5e;
  tdm_event *ev = sentinel;
  CHECK_RC(tdm_event_import(NULL, &dummy, &ev), TDM_ENOTINIT);
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  CHECK_RC(tdm_event_import(dev, NULL, &ev), TDM_EINVAL);
  CHECK_RC(tdm_event_import(dev, &dummy, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_import(NULL, &dummy, &ev), TDM_EINVAL);
  CHECK_RC(tdm_event_import((tdm_device *)&dummy, &dummy, &ev), TDM_EHANDLE);
  CHECK(ev == sentinel);
  if (import_cpu_refuses(dev, kind)) return;

#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    cl_device_id id;
    CHECK_CL(clGetContextInfo(device_context(dev), CL_CONTEXT_DEVICES, sizeof id, &id, NULL));
    cl_int err = CL_SUCCESS;
    cl_context other = clCreateContext(NULL, 1, &id, NULL, NULL, &err);
    CHECK_MSG(other && err == CL_SUCCESS, "clCreateContext: %d", err);
    cl_event foreign = clCreateUserEvent(other, &err);
    CHECK_MSG(foreign && err == CL_SUCCESS, "clCreateUserEvent: %d", err);
    CHECK_RC(tdm_event_import(dev, foreign, &ev), TDM_EXDEV);
    CHECK(ev == sentinel);
    CHECK_CL(clSetUserEventStatus(foreign, CL_COMPLETE));
    CHECK_CL(clReleaseEvent(foreign));
    CHECK_CL(clReleaseContext(other));
  }
#endif

  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));
  static const unsigned kinds[] = {TDM_FAULT_ALLOC, TDM_FAULT_BACKEND,
                                   TDM_FAULT_ALLOC | TDM_FAULT_BACKEND};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    for (long nth = 0;; nth++) {
      CHECK_MSG(nth < 1000, "the import never succeeded");
      struct native_ev c;
      native_completed(dev, kind, &c);
      ev = sentinel;
      CHECK_OK(tdm_fault_inject(kinds[k], nth, 0));
      int rc = tdm_event_import(dev, c.ev, &ev);
      int fired = tdm_fault_fired();
      CHECK_OK(tdm_fault_inject(0, -1, 0));
      if (rc == 0) {
        CHECK(!fired);
        CHECK_OK(tdm_event_wait(ev));
        CHECK_OK(tdm_event_release(ev));
      } else {
        CHECK(fired);
        CHECK_MSG(rc == TDM_ENOMEM || rc == TDM_EBACKEND, "injected fault %ld gave %s", nth,
                  tdm_err_name(rc));
        CHECK(ev == sentinel);
      }
      check_stats_back(&base);
      native_free(&c);
      if (rc == 0) break;
    }
  }

  /* A backend call that reports a lost device marks it lost, as a real one would. */
  struct native_ev c;
  native_completed(dev, kind, &c);
  ev = sentinel;
  CHECK_OK(tdm_fault_inject(TDM_FAULT_BACKEND, 0, TDM_EDEVLOST));
  CHECK_RC(tdm_event_import(dev, c.ev, &ev), TDM_EDEVLOST);
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  CHECK_RC(tdm_event_import(dev, c.ev, &ev), TDM_EDEVLOST);
  CHECK(ev == sentinel);
  native_free(&c);
  th_close();
}
