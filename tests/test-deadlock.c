/* test-deadlock.c: calls that would wait for themselves get TDM_EDEADLK, and the patterns the
 * execution model promises not to deadlock complete (cpu:0).
 *
 * Every case runs under ctest's time limit: a hang is a failure. Where a case must observe
 * something from another thread, it waits with a bounded limit only so that a hang is
 * reported in words.
 */
#include "harness.h"

static tdm_queue *new_queue(tdm_device *dev, unsigned flags) {
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, flags, &q));
  return q;
}

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

static int has_ooo(tdm_device *dev) {
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  return (info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER) != 0;
}

static int task_wait_gate_dl(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : 1; }

/* ---- Host tasks that would wait for themselves ------------------------------------------- */

struct self_call {
  tdm_queue *q;
  tdm_queue *other;
  atomic_int rc;
  atomic_int ran;
};

static int task_sync_own(void *arg) {
  struct self_call *s = arg;
  atomic_store(&s->rc, TH_CALL(tdm_queue_sync(s->q)));
  atomic_store(&s->ran, 1);
  return 0;
}

static int task_destroy_own(void *arg) {
  struct self_call *s = arg;
  atomic_store(&s->rc, TH_CALL(tdm_queue_destroy(s->q)));
  atomic_store(&s->ran, 1);
  return 0;
}

static int task_sync_other(void *arg) {
  struct self_call *s = arg;
  atomic_store(&s->rc, TH_CALL(tdm_queue_sync(s->other)));
  atomic_store(&s->ran, 1);
  return 0;
}

static void self_call_round(tdm_device *dev, unsigned flags, tdm_host_fn fn) {
  struct self_call s;
  tdm_event *ev = NULL;
  memset(&s, 0, sizeof s);
  atomic_store(&s.rc, 12345);
  s.q = new_queue(dev, flags);
  CHECK_OK(tdm_host_task(s.q, fn, &s, 0, NULL, &ev));
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
  CHECK_EQ(atomic_load(&s.ran), 1);
  CHECK_STATUS(atomic_load(&s.rc), TDM_EDEADLK);
  /* The queue is intact: it runs more work and can be destroyed from outside. */
  atomic_int count = 0;
  CHECK_OK(tdm_host_task(s.q, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(s.q));
  CHECK_EQ(atomic_load(&count), 1);
  CHECK_OK(tdm_queue_destroy(s.q));
}

TEST_CASE(task_syncs_own_queue) {
  tdm_device *dev = th_open();
  self_call_round(dev, TDM_QUEUE_IN_ORDER, task_sync_own);
  self_call_round(dev, TDM_QUEUE_OUT_OF_ORDER, task_sync_own);
  th_close();
}

TEST_CASE(task_destroys_own_queue) {
  tdm_device *dev = th_open();
  self_call_round(dev, TDM_QUEUE_IN_ORDER, task_destroy_own);
  self_call_round(dev, TDM_QUEUE_OUT_OF_ORDER, task_destroy_own);
  th_close();
}

/* Not a deadlock: a host task may sync another queue (negative control for the checks above). */
TEST_CASE(task_syncs_other_queue) {
  tdm_device *dev = th_open();
  struct self_call s;
  atomic_int count = 0;
  tdm_event *ev = NULL;
  memset(&s, 0, sizeof s);
  s.q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  s.other = new_queue(dev, TDM_QUEUE_IN_ORDER);
  CHECK_OK(tdm_host_task(s.other, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(s.q, task_sync_other, &s, 0, NULL, &ev));
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(atomic_load(&s.rc));
  CHECK_EQ(atomic_load(&count), 1);
  CHECK_OK(tdm_queue_destroy(s.q));
  CHECK_OK(tdm_queue_destroy(s.other));
  th_close();
}

/* A host task waits on the event of a command submitted after it on its own in-order queue:
 * that command can only run after the task returns. The task waits (bounded) for the test to
 * hand it the event, so the event exists before the wait. */
struct later_wait {
  th_gate handed;
  _Atomic(tdm_event *) later;
  tdm_event *earlier;
  atomic_int rc_later, rc_earlier;
};

static int task_wait_later(void *arg) {
  struct later_wait *w = arg;
  if (!th_gate_wait(&w->handed, TH_HANG_MS)) return 1;
  atomic_store(&w->rc_earlier, TH_CALL(tdm_event_wait(w->earlier)));
  atomic_store(&w->rc_later, TH_CALL(tdm_event_wait(atomic_load(&w->later))));
  return 0;
}

TEST_CASE(task_waits_later_event) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct later_wait w;
  atomic_int count = 0;
  tdm_event *later = NULL, *ev = NULL;
  memset(&w, 0, sizeof w);
  th_gate_init(&w.handed);
  atomic_store(&w.rc_later, 12345);
  atomic_store(&w.rc_earlier, 12345);
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &w.earlier));
  CHECK_OK(tdm_host_task(q, task_wait_later, &w, 0, NULL, &ev));
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &later));
  atomic_store(&w.later, later);
  th_gate_open(&w.handed);
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(atomic_load(&w.rc_earlier)); /* an earlier event of its own queue is fine */
  CHECK_STATUS(atomic_load(&w.rc_later), TDM_EDEADLK);
  CHECK_OK(tdm_event_wait(later));
  CHECK_EQ(atomic_load(&count), 2);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_event_release(later));
  CHECK_OK(tdm_event_release(w.earlier));
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&w.handed);
  th_close();
}

/* ---- Keep-alive releases ----------------------------------------------------------------- */

/* The release waits on a host task submitted to the queue after the keep-alive but before the
 * release completes. Releases run on their own thread, so the task is never stuck behind the
 * release that waits for it. */
struct release_waits {
  _Atomic(tdm_event *) task_ev;
  atomic_int rc, done;
};

static void release_wait_task(void *obj) {
  struct release_waits *r = obj;
  tdm_event *ev = NULL;
  for (long waited = 0; !(ev = atomic_load(&r->task_ev)) && waited < TH_HANG_MS; waited++)
    th_sleep_ms(1);
  atomic_store(&r->rc, ev ? tdm_event_wait(ev) : 1);
  atomic_store(&r->done, 1);
}

TEST_CASE(keep_alive_waits_task) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct release_waits r;
  atomic_int count = 0;
  tdm_event *ev = NULL;
  memset(&r, 0, sizeof r);
  atomic_store(&r.rc, 12345);
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, NULL));
  CHECK_OK(tdm_keep_alive(q, release_wait_task, &r));
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &ev));
  atomic_store(&r.task_ev, ev);
  CHECK_MSG(th_wait_atomic(&r.done, 1, TH_HANG_MS), "the release never finished");
  CHECK_OK(atomic_load(&r.rc));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&count), 2);
  CHECK_OK(tdm_event_release(ev)); /* the release is done with it */
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* The release submits work itself (and waits for it). */
struct release_submits {
  tdm_queue *q, *other;
  atomic_int rc, done, inner;
};

static void release_submit(void *obj) {
  struct release_submits *r = obj;
  tdm_event *ev = NULL, *ev2 = NULL;
  int rc = tdm_host_task(r->q, task_count, &r->inner, 0, NULL, &ev);
  if (rc == 0) rc = tdm_host_task(r->other, task_count, &r->inner, 0, NULL, &ev2);
  if (rc == 0) rc = tdm_event_wait(ev);
  if (rc == 0) rc = tdm_event_wait(ev2);
  if (ev) tdm_event_release(ev);
  if (ev2) tdm_event_release(ev2);
  atomic_store(&r->rc, rc);
  atomic_store(&r->done, 1);
}

TEST_CASE(keep_alive_submits_work) {
  tdm_device *dev = th_open();
  struct release_submits r;
  memset(&r, 0, sizeof r);
  atomic_store(&r.rc, 12345);
  r.q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  r.other = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  CHECK_OK(tdm_keep_alive(r.q, release_submit, &r));
  CHECK_MSG(th_wait_atomic(&r.done, 1, TH_HANG_MS), "the release never finished");
  CHECK_OK(atomic_load(&r.rc));
  CHECK_EQ(atomic_load(&r.inner), 2);
  CHECK_OK(tdm_queue_sync(r.q));
  CHECK_OK(tdm_queue_destroy(r.q));
  CHECK_OK(tdm_queue_destroy(r.other));
  th_close();
}

/* ---- Cross-queue copies in both directions ----------------------------------------------- */

enum { CROSS_ITERS = 1000, CROSS_N = 4096 };

struct crosser {
  tdm_queue *from, *to;
  unsigned char *dst, *src;
  int failures;
};

static void *cross_loop(void *arg) {
  struct crosser *c = arg;
  for (int i = 0; i < CROSS_ITERS; i++) {
    tdm_event *ev = NULL;
    if (tdm_memcpy_cross(c->from, c->to, c->dst, c->src, CROSS_N, 0, NULL,
                         i % 10 == 0 ? &ev : NULL) != 0)
      c->failures++;
    if (ev && tdm_event_release(ev) != 0) c->failures++;
  }
  return NULL;
}

/* Copies A-to-B and B-to-A from two threads at once: tdm_memcpy_cross never holds both queues'
 * locks, so this cannot deadlock, and the data arrives. */
TEST_CASE(cross_copy_both_ways) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *a = new_queue(dev, TDM_QUEUE_IN_ORDER), *b = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src_a, *dst_b, *src_b, *dst_a, *h, *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, CROSS_N, (void **)&src_a));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, CROSS_N, (void **)&dst_a));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, CROSS_N, (void **)&src_b));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, CROSS_N, (void **)&dst_b));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 2 * CROSS_N, (void **)&h));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, CROSS_N, (void **)&back));
  th_fill_random(h, 2 * CROSS_N, &rng);
  CHECK_OK(tdm_memcpy(a, src_a, h, CROSS_N, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(b, src_b, h + CROSS_N, CROSS_N, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(a));
  CHECK_OK(tdm_queue_sync(b));

  struct crosser ab = {a, b, dst_b, src_a, 0}, ba = {b, a, dst_a, src_b, 0};
  pthread_t t1, t2;
  CHECK(pthread_create(&t1, NULL, cross_loop, &ab) == 0);
  CHECK(pthread_create(&t2, NULL, cross_loop, &ba) == 0);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  CHECK_EQ(ab.failures, 0);
  CHECK_EQ(ba.failures, 0);
  CHECK_OK(tdm_queue_sync(a));
  CHECK_OK(tdm_queue_sync(b));

  CHECK_OK(tdm_memcpy(b, back, dst_b, CROSS_N, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(b));
  CHECK_MEM_EQ(back, h, CROSS_N);
  CHECK_OK(tdm_memcpy(a, back, dst_a, CROSS_N, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(a));
  CHECK_MEM_EQ(back, h + CROSS_N, CROSS_N);
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);

  CHECK_OK(tdm_free(src_a));
  CHECK_OK(tdm_free(dst_a));
  CHECK_OK(tdm_free(src_b));
  CHECK_OK(tdm_free(dst_b));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_queue_destroy(a));
  CHECK_OK(tdm_queue_destroy(b));
  th_close();
}

/* ---- The last shutdown from tandem's own threads ------------------------------------------ */

struct shutdown_call {
  atomic_int rc, done;
};

static int task_shutdown(void *arg) {
  struct shutdown_call *s = arg;
  atomic_store(&s->rc, TH_CALL(tdm_shutdown()));
  atomic_store(&s->done, 1);
  return 0;
}

static void release_shutdown(void *obj) {
  struct shutdown_call *s = obj;
  atomic_store(&s->rc, TH_CALL(tdm_shutdown()));
  atomic_store(&s->done, 1);
}

/* The last tdm_shutdown from a host task, or from a keep-alive release, would join the thread
 * it runs on: TDM_EDEADLK, and tandem stays up. With a second init reference held, the
 * shutdown from a task only drops that reference. */
TEST_CASE(shutdown_from_tandem_threads) {
  tdm_device *dev = th_open();
  for (int ooo = 0; ooo < 2; ooo++) {
    tdm_queue *q = new_queue(dev, ooo ? TDM_QUEUE_OUT_OF_ORDER : TDM_QUEUE_IN_ORDER);
    struct shutdown_call t, r;
    atomic_int count = 0;
    memset(&t, 0, sizeof t);
    memset(&r, 0, sizeof r);
    CHECK_OK(tdm_host_task(q, task_shutdown, &t, 0, NULL, NULL));
    CHECK_OK(tdm_keep_alive(q, release_shutdown, &r));
    CHECK_MSG(th_wait_atomic(&t.done, 1, TH_HANG_MS), "the host task never finished");
    CHECK_MSG(th_wait_atomic(&r.done, 1, TH_HANG_MS), "the release never finished");
    CHECK_STATUS(atomic_load(&t.rc), TDM_EDEADLK);
    CHECK_STATUS(atomic_load(&r.rc), TDM_EDEADLK);
    /* Still up: the queue works. */
    CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_EQ(atomic_load(&count), 1);
    /* Not the last reference: allowed. */
    CHECK_OK(tdm_init());
    memset(&t, 0, sizeof t);
    CHECK_OK(tdm_host_task(q, task_shutdown, &t, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_OK(atomic_load(&t.rc));
    CHECK_OK(tdm_queue_destroy(q));
  }
  th_close();
}

/* ---- Host tasks that wait for later ones on an out-of-order queue ------------------------- */

enum { WAITERS = 24 };

struct waiter_task {
  _Atomic(tdm_event *) target;
  atomic_int rc, done;
};

static int task_wait_target(void *arg) {
  struct waiter_task *w = arg;
  tdm_event *ev = NULL;
  for (long waited = 0; !(ev = atomic_load(&w->target)) && waited < TH_HANG_MS; waited++)
    th_sleep_ms(1);
  atomic_store(&w->rc, ev ? tdm_event_wait(ev) : 1);
  atomic_store(&w->done, 1);
  return 0;
}

/* More host tasks than tandem has host threads each block in tdm_event_wait for a later host
 * task with no dependencies. There is no cycle, so all must complete: a pool thread that
 * blocks in a wait is replaced while it waits. */
TEST_CASE(pool_tasks_wait_later_tasks) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  struct waiter_task w[WAITERS];
  atomic_int count = 0;
  for (int i = 0; i < WAITERS; i++) {
    memset(&w[i], 0, sizeof w[i]);
    atomic_store(&w[i].rc, 12345);
    CHECK_OK(tdm_host_task(q, task_wait_target, &w[i], 0, NULL, NULL));
  }
  th_sleep_ms(50); /* let the waiters take the threads */
  tdm_event *later[WAITERS];
  for (int i = 0; i < WAITERS; i++) {
    CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &later[i]));
    atomic_store(&w[i].target, later[i]);
  }
  for (int i = 0; i < WAITERS; i++) {
    CHECK_MSG(th_wait_atomic(&w[i].done, 1, TH_HANG_MS), "waiter %d never finished", i);
    CHECK_OK(atomic_load(&w[i].rc));
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&count), WAITERS);
  for (int i = 0; i < WAITERS; i++) CHECK_OK(tdm_event_release(later[i]));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A host task of an out-of-order queue waits for a marker, or a full barrier, recorded on its
 * own queue after it: both wait for every earlier command, the task among them, so the wait
 * is TDM_EDEADLK. A later task with no dependency may still be waited for, and so may
 * anything submitted before the task. */
struct own_marker {
  tdm_queue *q;
  int rc_marker, rc_barrier, rc_after_barrier, rc_plain;
};

static int task_wait_own_marker(void *arg) {
  struct own_marker *m = arg;
  tdm_event *ev = NULL;
  atomic_int n = 0;
  CHECK_OK(tdm_event_record(m->q, &ev));
  m->rc_marker = TH_CALL(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_queue_barrier(m->q, 0, NULL, &ev));
  m->rc_barrier = TH_CALL(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_host_task(m->q, task_count, &n, 0, NULL, &ev)); /* behind that barrier */
  m->rc_after_barrier = TH_CALL(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
  return 0;
}

TEST_CASE(ooo_task_waits_own_marker) {
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  struct own_marker m = {.q = q, 12345, 12345, 12345, 12345};
  tdm_event *ev;
  CHECK_OK(tdm_host_task(q, task_wait_own_marker, &m, 0, NULL, &ev));
  CHECK_MSG(th_event_wait_limited(ev, TH_HANG_MS) == 0, "the task hung or failed");
  CHECK_OK(tdm_event_release(ev));
  CHECK_STATUS(m.rc_marker, TDM_EDEADLK);
  CHECK_STATUS(m.rc_barrier, TDM_EDEADLK);
  CHECK_STATUS(m.rc_after_barrier, TDM_EDEADLK);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* The end of the producer/waiter cases: the producer ran once, and everything goes. */
static void producer_finish(tdm_event *producer, atomic_int *count, tdm_event *hold, tdm_queue *q,
                            tdm_queue *held, th_gate *gate) {
  CHECK_OK(tdm_event_wait(producer));
  CHECK_EQ(atomic_load(count), 1);
  CHECK_OK(tdm_event_release(producer));
  CHECK_OK(tdm_event_release(hold));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(held));
  th_gate_destroy(gate);
  th_close();
}

/* More waiting host tasks than the pool has threads and spares (TANDEM_CPU_POOL_THREADS = 4
 * and the 256 spares of threadpool.c): once every thread is blocked in a wait but one, the
 * next wait would leave none to run the producer, and fails with TDM_EDEADLK instead; the
 * waits that were made complete once it runs, and nothing hangs. */
enum { POOL_THREADS = 4, POOL_SPARES = 256, EXHAUST_WAITERS = 300 };

static atomic_int exhaust_started;

static int task_count_start_wait(void *arg) {
  atomic_fetch_add(&exhaust_started, 1);
  return task_wait_target(arg);
}

TEST_CASE(pool_exhausted_by_waiters) {
  setenv("TANDEM_CPU_POOL_THREADS", "4", 1);
  setenv("TANDEM_TRACKER_CAPACITY", "1024", 1); /* no collapse: the waiters are independent */
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER), *held = new_queue(dev, 0);
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *hold, *producer;
  atomic_int count = 0;
  /* The producer becomes ready once a gate on another queue opens, after every thread the
   * pool can have has taken a waiter. */
  CHECK_OK(tdm_host_task(held, task_wait_gate_dl, &gate, 0, NULL, &hold));
  CHECK_OK(tdm_host_task(q, task_count, &count, 1, &hold, &producer));
  static struct waiter_task w[EXHAUST_WAITERS];
  for (int i = 0; i < EXHAUST_WAITERS; i++) {
    memset(&w[i], 0, sizeof w[i]);
    atomic_store(&w[i].rc, 12345);
    atomic_store(&w[i].target, producer);
    CHECK_OK(tdm_host_task(q, task_count_start_wait, &w[i], 0, NULL, NULL));
  }
  CHECK_MSG(th_wait_atomic(&exhaust_started, POOL_THREADS + POOL_SPARES, TH_HANG_MS),
            "only %d waiters started", atomic_load(&exhaust_started));
  th_gate_open(&gate);
  int refused = 0;
  for (int i = 0; i < EXHAUST_WAITERS; i++) {
    CHECK_MSG(th_wait_atomic(&w[i].done, 1, TH_HANG_MS), "waiter %d never finished", i);
    int rc = atomic_load(&w[i].rc);
    CHECK_MSG(rc == 0 || rc == TDM_EDEADLK, "waiter %d got %s", i, tdm_err_name(rc));
    refused += rc == TDM_EDEADLK;
  }
  printf("%d of %d waits refused with TDM_EDEADLK\n", refused, EXHAUST_WAITERS);
  CHECK(refused > 0 && refused < EXHAUST_WAITERS);
  producer_finish(producer, &count, hold, q, held, &gate);
}

/* Waiters fill the tracker of an out-of-order queue, so the producer's submission collapses
 * them into a barrier the producer then depends on: a wait of theirs for it would never end,
 * and is TDM_EDEADLK instead. */
enum { TRACKED_WAITERS = 8 };

TEST_CASE(tracker_collapse_waiters) {
  setenv("TANDEM_TRACKER_CAPACITY", "8", 1);
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER), *held = new_queue(dev, 0);
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *hold, *producer;
  atomic_int count = 0;
  struct waiter_task w[TRACKED_WAITERS];
  CHECK_OK(tdm_host_task(held, task_wait_gate_dl, &gate, 0, NULL, &hold));
  for (int i = 0; i < TRACKED_WAITERS; i++) {
    memset(&w[i], 0, sizeof w[i]);
    atomic_store(&w[i].rc, 12345);
    CHECK_OK(tdm_host_task(q, task_wait_target, &w[i], 1, &hold, NULL));
  }
  CHECK_OK(tdm_host_task(q, task_count, &count, 0, NULL, &producer));
  for (int i = 0; i < TRACKED_WAITERS; i++) atomic_store(&w[i].target, producer);
  th_gate_open(&gate);
  for (int i = 0; i < TRACKED_WAITERS; i++) {
    CHECK_MSG(th_wait_atomic(&w[i].done, 1, TH_HANG_MS), "waiter %d never finished", i);
    CHECK_STATUS(atomic_load(&w[i].rc), TDM_EDEADLK);
  }
  producer_finish(producer, &count, hold, q, held, &gate);
}

/* ---- Bursts of host tasks ---------------------------------------------------------------- */

/* Enough host tasks, submitted faster than they complete, to exhaust whatever a backend keeps
 * per outstanding task if nothing bounds it (PoCL's user events and markers did). */
enum { BURST_TASKS = 8000, BURST_THREADS = 8 };

struct burst {
  tdm_queue *q;
  int n;
  atomic_int *count;
  int failures;
};

static void *burst_loop(void *arg) {
  struct burst *b = arg;
  for (int i = 0; i < b->n; i++)
    if (tdm_host_task(b->q, task_count, b->count, 0, NULL, NULL) != 0) b->failures++;
  return NULL;
}

/* nthreads threads submit BURST_TASKS host tasks in all to one queue, then it is synced once:
 * every task runs, and nothing is left pending. */
static void burst_round(tdm_device *dev, unsigned flags, int nthreads) {
  tdm_queue *q = new_queue(dev, flags);
  atomic_int count = 0;
  struct burst b[BURST_THREADS];
  pthread_t t[BURST_THREADS];
  for (int i = 0; i < nthreads; i++) {
    b[i] = (struct burst){q, BURST_TASKS / nthreads, &count, 0};
    CHECK(pthread_create(&t[i], NULL, burst_loop, &b[i]) == 0);
  }
  for (int i = 0; i < nthreads; i++) {
    pthread_join(t[i], NULL);
    CHECK_EQ(b[i].failures, 0);
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&count), BURST_TASKS);
  CHECK_OK(tdm_queue_destroy(q));
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);
}

TEST_CASE(host_task_burst_out_of_order) {
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  burst_round(dev, TDM_QUEUE_OUT_OF_ORDER, 1);
  th_close();
}

TEST_CASE(host_task_burst_out_of_order_threads) {
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  burst_round(dev, TDM_QUEUE_OUT_OF_ORDER, BURST_THREADS);
  th_close();
}

TEST_CASE(host_task_burst_in_order) {
  tdm_device *dev = th_open();
  burst_round(dev, TDM_QUEUE_IN_ORDER, 1);
  burst_round(dev, TDM_QUEUE_IN_ORDER, BURST_THREADS);
  th_close();
}

/* Records in a burst on an out-of-order queue: each is a marker over everything before it
 * (PoCL links such a marker to every command still in the queue). */
TEST_CASE(record_burst_out_of_order) {
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  for (int i = 0; i < BURST_TASKS; i++) {
    tdm_event *ev = NULL;
    CHECK_OK(tdm_event_record(q, &ev));
    CHECK_OK(tdm_event_release(ev));
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Threads submit chains to one out-of-order queue: a host task after the thread's last
 * record, a device fill after the task, a record. Each thread's fills land in order. */
enum { CHAIN_ITERS = 500, CHAIN_N = 64 };

struct chain {
  tdm_queue *q;
  unsigned char *buf;
  atomic_int *count;
  int failures;
};

static void *chain_loop(void *arg) {
  struct chain *c = arg;
  tdm_event *last = NULL;
  for (int i = 0; i < CHAIN_ITERS && !c->failures; i++) {
    tdm_event *task = NULL, *fill = NULL;
    if (tdm_host_task(c->q, task_count, c->count, last ? 1 : 0, last ? &last : NULL, &task) ||
        tdm_memset(c->q, c->buf, i & 0xff, CHAIN_N, 1, &task, &fill) ||
        (last && tdm_event_release(last)) || tdm_event_record(c->q, &last))
      c->failures++;
    if (task && tdm_event_release(task)) c->failures++;
    if (fill && tdm_event_release(fill)) c->failures++;
  }
  if (last && tdm_event_release(last)) c->failures++;
  return NULL;
}

TEST_CASE(chain_burst_out_of_order_threads) {
  tdm_device *dev = th_open();
  if (!has_ooo(dev)) TH_SKIP("%s has no out-of-order queues", th_device_id);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
  atomic_int count = 0;
  struct chain c[BURST_THREADS];
  pthread_t t[BURST_THREADS];
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, CHAIN_N, (void **)&back));
  for (int i = 0; i < BURST_THREADS; i++) {
    c[i] = (struct chain){q, NULL, &count, 0};
    CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, CHAIN_N, (void **)&c[i].buf));
    CHECK(pthread_create(&t[i], NULL, chain_loop, &c[i]) == 0);
  }
  for (int i = 0; i < BURST_THREADS; i++) {
    pthread_join(t[i], NULL);
    CHECK_EQ(c[i].failures, 0);
  }
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&count), BURST_THREADS * CHAIN_ITERS);
  unsigned char want[CHAIN_N];
  memset(want, (CHAIN_ITERS - 1) & 0xff, CHAIN_N);
  for (int i = 0; i < BURST_THREADS; i++) {
    CHECK_OK(tdm_memcpy(q, back, c[i].buf, CHAIN_N, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_MEM_EQ(back, want, CHAIN_N);
    CHECK_OK(tdm_free(c[i].buf));
  }
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_queue_destroy(q));
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);
  th_close();
}
