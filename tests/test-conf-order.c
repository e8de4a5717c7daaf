/* test-conf-order.c: conformance, ordering: an in-order queue runs its commands in submission
 * order (from one thread or several, host tasks and copies alike), an out-of-order queue only
 * in the order its dependencies and barriers ask for, and a device-side wait (tdm_queue_wait)
 * orders one queue after another without blocking the caller. */
#include "conformance.h"

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

/* Long runs of copies nobody observes (quiet: on CUDA they go without a native event, and
 * complete with a later command's), with events recorded between them at uneven points: each
 * event, once waited for, covers every copy before it; one wait in the middle of the run takes
 * the pending copies to the queue's executor while more are submitted behind them. */
TEST_CASE(ordering_quiet_runs) {
  enum { ROUNDS = 150, EVERY = 37, MIDDLE = 75, NSRC = 4 };
  const size_t n = 4096;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src[NSRC];
  unsigned char *out = dev_alloc(dev, TDM_MEM_PINNED, ROUNDS * n);
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n);
  for (int k = 0; k < NSRC; k++) {
    src[k] = dev_alloc(dev, TDM_MEM_PINNED, n);
    th_fill_random(src[k], n, &rng);
  }
  th_fill_random(out, ROUNDS * n, &rng);
  tdm_event *ev[ROUNDS / EVERY + 1];
  int at[ROUNDS / EVERY + 1], nev = 0;
  for (int r = 0; r < ROUNDS; r++) {
    /* da is reused every round: a copy that overtakes another leaves the wrong source. */
    CHECK_OK(tdm_memcpy(q, da, src[r % NSRC], n, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q, out + (size_t)r * n, da, n, TDM_COPY_D2H, 0, NULL, NULL));
    if (r % EVERY == EVERY - 1) {
      at[nev] = r;
      CHECK_OK(tdm_event_record(q, &ev[nev++]));
    }
    if (r == MIDDLE) {
      CHECK_OK(tdm_event_wait(ev[nev - 1]));
      for (int k = 0; k <= at[nev - 1]; k++)
        CHECK_MSG(memcmp(out + (size_t)k * n, src[k % NSRC], n) == 0,
                  "round %d not landed when the event after it (round %d) completed", k,
                  at[nev - 1]);
    }
  }
  for (int e = 0; e < nev; e++) {
    CHECK_OK(tdm_event_wait(ev[e]));
    for (int k = 0; k <= at[e]; k++)
      CHECK_MSG(memcmp(out + (size_t)k * n, src[k % NSRC], n) == 0,
                "round %d not landed when the event after it (round %d) completed", k, at[e]);
    CHECK_OK(tdm_event_release(ev[e]));
  }
  CHECK_OK(tdm_queue_sync(q));
  for (int r = 0; r < ROUNDS; r++) CHECK_MEM_EQ(out + (size_t)r * n, src[r % NSRC], n);
  for (int k = 0; k < NSRC; k++) CHECK_OK(tdm_free(src[k]));
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(da));
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
