/* test-conf-host.c: conformance, host work and lifetimes: host tasks run in queue order and
 * may call tandem, keep-alive releases run once the work before them is done, and a
 * stream-ordered free gives memory back only after the work that uses it. */
#include "conformance.h"

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

/* Memory freed in stream order and allocated again at once, over and over: a backend may free
 * natively (cudaFreeAsync) before the free command's completion reaches the registry, and
 * hand the same range to the next allocation; that allocation must succeed, be usable, and the
 * late completion must not take its entry. Live allocations balance at the end. */
TEST_CASE(free_async_then_allocate) {
  enum { ROUNDS = 200 };
  const size_t n = 1 << 20;
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  long live = live_allocations();
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  for (int i = 0; i < ROUNDS; i++) {
    CHECK_OK(tdm_memset(q, d, (int)(i & 0xff), n, 0, NULL, NULL));
    CHECK_OK(tdm_free_async(q, d, 0, NULL, NULL));
    d = dev_alloc(dev, TDM_MEM_DEVICE, n);
    unsigned char b = 0;
    CHECK_OK(tdm_memset(q, d, 7, n, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q, &b, d + n - 1, 1, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_EQ(b, 7);
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_free(d)); /* its entry survived every late completion */
  CHECK_EQ(live_allocations(), live);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}
