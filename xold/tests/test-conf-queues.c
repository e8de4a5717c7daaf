/* test-conf-queues.c: conformance, queues tandem hands out or keeps track of: order tracking
 * (tdm_queue_track, tdm_queue_dependencies) for external submissions, the default and the
 * per-thread current queue, and the environment options that choose them. */
#include "conformance.h"

/* ---- Order tracking ---------------------------------------------------------------------- */

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
