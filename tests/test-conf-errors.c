/* test-conf-errors.c: conformance, failures and teardown: a failed command fails its event and
 * the work that depends on it, sync reports and clears the first error, what a failed host task
 * said reaches each of them, and destroying a queue drains what was submitted to it. */
#include "conformance.h"

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

/* Waits for an event that is still pending and then fails (a native backend waits for it
 * without a command of its own on an in-order queue): the queue fails all the same, its
 * marker, its next commands and its sync report it, the sync names the wait, and after the
 * sync the queue works again. Round 1 syncs right after the wait, so the failure reaches the
 * sync itself, whether it lands before or after the sync's submission. */
TEST_CASE(wait_pending_failure) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, 512), *dst = dev_alloc(dev, TDM_MEM_PINNED, 512);
  unsigned char before[512];
  for (int round = 0; round < 4; round++) {
    int sync_first = round & 1;
    unsigned flags = round >= 2 ? TDM_QUEUE_OUT_OF_ORDER : TDM_QUEUE_IN_ORDER;
    if (round >= 2 && !has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) break;
    tdm_queue *p = new_queue(dev, TDM_QUEUE_IN_ORDER), *q = new_queue(dev, flags);
    th_gate gate;
    th_gate_init(&gate);
    atomic_int ran = 0;
    th_fill_random(src, 512, &rng);
    th_fill_random(dst, 512, &rng);
    memcpy(before, dst, 512);
    tdm_event *bad = NULL, *m = NULL, *task = NULL, *copied = NULL;
    CHECK_OK(tdm_host_task(p, task_wait_gate, &gate, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(p, task_fail_einval, NULL, 0, NULL, &bad));
    CHECK_OK(tdm_queue_wait(q, bad));
    /* What q's work depends on now covers the pending event. */
    tdm_event *deps[8];
    size_t n = 0;
    CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
    CHECK(n >= 1);
    int pending = 0;
    for (size_t i = 0; i < n; i++) {
      pending += tdm_event_query(deps[i]) == TDM_EAGAIN;
      CHECK_OK(tdm_event_release(deps[i]));
    }
    CHECK_MSG(pending >= 1, "no dependency of the waiting queue is pending");
    if (sync_first) {
      th_gate_open(&gate);
      CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
    } else {
      CHECK_OK(tdm_event_record(q, &m));
      CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, &task));
      CHECK_OK(tdm_memcpy(q, dst, src, 512, TDM_COPY_H2H, 0, NULL, &copied));
      CHECK_RC(tdm_event_query(m), TDM_EAGAIN);
      th_gate_open(&gate);
      CHECK_RC(tdm_event_wait(m), TDM_EDEP);
      CHECK_RC(tdm_event_wait(task), TDM_EDEP);
      CHECK_RC(tdm_event_wait(copied), TDM_EDEP);
      CHECK_EQ(atomic_load(&ran), 0);
      CHECK_MEM_EQ(dst, before, 512);
      CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
    }
    CHECK_MSG(strstr(tdm_last_error(), "wait on") != NULL, "the sync does not name the wait: %s",
              tdm_last_error());
    CHECK_OK(tdm_queue_sync(q));
    CHECK_RC(tdm_event_wait(bad), TDM_EINVAL);
    CHECK_RC(tdm_queue_sync(p), TDM_EINVAL);
    /* The queue works again. */
    tdm_event *again = NULL;
    CHECK_OK(tdm_memcpy(q, dst, src, 512, TDM_COPY_H2H, 0, NULL, &again));
    wait_ok(again);
    CHECK_MEM_EQ(dst, src, 512);
    CHECK_OK(tdm_event_release(bad));
    if (!sync_first) {
      tdm_event *more[] = {m, task, copied};
      release_all(more, 3);
    }
    CHECK_OK(tdm_queue_destroy(q));
    CHECK_OK(tdm_queue_destroy(p));
    th_gate_destroy(&gate);
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

/* ---- A failed host task's own message ---------------------------------------------------- */

#define SAID "row 12000 is outside x"

/* Says why it fails, as a layered library's operation does. */
static int task_fail_said(void *arg) {
  (void)arg;
  return tdm_set_error(TDM_ERANGE, 0, "row %d is outside x", 12000);
}

/* Leaves a message behind and succeeds: the message is not a failure's. */
static int task_say_ok(void *arg) {
  (void)arg;
  tdm_set_error(TDM_EINVAL, 0, "left behind");
  return 0;
}

/* This thread's message contains a, and b unless it is NULL. */
static void msg_has(int line, const char *a, const char *b) {
  const char *msg = tdm_last_error();
  if (!strstr(msg, a) || (b && !strstr(msg, b)))
    th_fail(__FILE__, line, "message \"%s\" lacks \"%s\"%s%s", msg, a, b ? " or " : "",
            b ? b : "");
}

/* Nothing of either earlier task's text. */
static void msg_plain(int line) {
  const char *msg = tdm_last_error();
  if (strstr(msg, SAID) || strstr(msg, "left behind"))
    th_fail(__FILE__, line, "message \"%s\" carries an earlier task's text", msg);
}

static void task_message_round(tdm_device *dev, unsigned flags) {
  int in_order = !(flags & TDM_QUEUE_OUT_OF_ORDER);
  tdm_queue *q = new_queue(dev, flags), *r = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  atomic_int ran = 0;
  tdm_event *e_fail = NULL, *e_next = NULL, *e_other = NULL, *m = NULL;

  /* In order, held back so that everything below is submitted before the failure. */
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_fail_said, NULL, 0, NULL, &e_fail));
  /* In order, the next command fails by queue order; out of order, through its dependency. */
  CHECK_OK(tdm_host_task(q, task_count, &ran, in_order ? 0 : 1, &e_fail, &e_next));
  CHECK_OK(tdm_host_task(r, task_count, &ran, 1, &e_fail, &e_other));
  CHECK_OK(tdm_event_record(q, &m));
  th_gate_open(&gate);

  /* The failed task's event: the command, then what the task said. */
  CHECK_RC(tdm_event_wait(e_fail), TDM_ERANGE);
  msg_has(__LINE__, "host task on ", "(command #2) failed: " SAID);
  CHECK_RC(tdm_event_query(e_fail), TDM_ERANGE);
  msg_has(__LINE__, "(command #2) failed: " SAID, NULL);
  /* A command that did not run because of it names it, with its text. */
  CHECK_RC(tdm_event_wait(e_next), TDM_EDEP);
  msg_has(__LINE__, "(command #3) failed: host task on ", "(command #2) failed: " SAID);
  CHECK_RC(tdm_event_wait(e_other), TDM_EDEP);
  msg_has(__LINE__, "failed: host task on ", "(command #2) failed: " SAID);
  /* A marker reports it, and so does the sync, once. */
  CHECK_RC(tdm_event_wait(m), TDM_ERANGE);
  msg_has(__LINE__, "marker on ", "failed: host task on ");
  msg_has(__LINE__, "(command #2) failed: " SAID, NULL);
  CHECK_RC(tdm_queue_sync(q), TDM_ERANGE);
  msg_has(__LINE__, "(command #2) failed: " SAID, "the first error since the last sync");
  CHECK_OK(tdm_queue_sync(q));
  CHECK_RC(tdm_queue_sync(r), TDM_EDEP);
  msg_has(__LINE__, "(command #2) failed: " SAID, NULL);
  CHECK_EQ(atomic_load(&ran), 0);
  tdm_event *all[] = {e_fail, e_next, e_other, m};
  release_all(all, 4);

  /* A task that succeeds carries nothing, whatever it left in its message; one that fails
   * without a message gets the plain one, with nothing of an earlier task's text. */
  tdm_event *e_ok = NULL, *e_silent = NULL;
  CHECK_OK(tdm_host_task(q, task_say_ok, NULL, 0, NULL, &e_ok));
  CHECK_OK(tdm_host_task(q, task_fail_einval, NULL, 0, NULL, &e_silent));
  CHECK_OK(tdm_event_wait(e_ok));
  CHECK(strcmp(tdm_last_error(), TH_NO_MESSAGE) == 0);
  CHECK_RC(tdm_event_wait(e_silent), TDM_EINVAL);
  msg_plain(__LINE__);
  const char *msg = tdm_last_error();
  CHECK_MSG(strlen(msg) > 6 && strcmp(msg + strlen(msg) - 6, "failed") == 0, "message: %s", msg);
  CHECK_RC(tdm_queue_sync(q), TDM_EINVAL);
  msg_plain(__LINE__);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_release(e_ok));
  CHECK_OK(tdm_event_release(e_silent));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(r));
  th_gate_destroy(&gate);
}

/* What a failed host task said with tdm_set_error reaches whoever learns of the failure: its
 * event's wait and query, the work that depends on it, markers and the queue's sync. */
TEST_CASE(error_task_message) {
  tdm_device *dev = th_open();
  task_message_round(dev, TDM_QUEUE_IN_ORDER);
  if (has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) task_message_round(dev, TDM_QUEUE_OUT_OF_ORDER);
  th_close();
}

/* With no memory left to keep the task's text, the failure is reported as it would be
 * without one. */
TEST_CASE(error_task_message_no_memory) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *e_fail = NULL;
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_fail_said, NULL, 0, NULL, &e_fail));
  /* The next allocation tandem makes is the copy of the text, once the gate opens. */
  CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC, 0, 0));
  th_gate_open(&gate);
  CHECK_RC(tdm_event_wait(e_fail), TDM_ERANGE);
  msg_has(__LINE__, "(command #2) failed", NULL);
  msg_plain(__LINE__);
  CHECK(tdm_fault_fired());
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  CHECK_RC(tdm_queue_sync(q), TDM_ERANGE);
  msg_has(__LINE__, "(command #2) failed", NULL);
  msg_plain(__LINE__);
  CHECK_OK(tdm_event_release(e_fail));
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&gate);
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

/* ---- Failures on out-of-order queues are deterministic ----------------------------------- */

/* After a gate of an out-of-order queue failed (a wait for a failed event, a barrier with a
 * failed dependency, the tracker's collapse barrier over a failed tracked event), every later
 * command fails with TDM_EDEP however long after the failure it is submitted, until a sync
 * has reported the failure; after that the queue runs work again. how: 0 wait, 1 barrier, 2
 * tracker. */
static void failed_gate_round(int how) {
  tdm_device *dev = th_open();
  require_ooo(dev);
  tdm_queue *q = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER), *src = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *failed, *gate = NULL, *late;
  atomic_int ran = 0;
  th_gate g;
  th_gate_init(&g);
  /* Held back until the gate opens: the tracker case needs it pending when it collapses. */
  CHECK_OK(tdm_host_task(src, task_wait_gate, &g, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(src, task_fail_einval, NULL, 0, NULL, &failed));
  if (how == 2) {
    /* Capacity 2: the tracked event and a held-back task fill it; the next submission
     * collapses them into a barrier, which fails. */
    CHECK_OK(tdm_queue_track(q, failed));
    CHECK_OK(tdm_host_task(q, task_wait_gate, &g, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
  }
  th_gate_open(&g);
  CHECK_RC(tdm_event_wait(failed), TDM_EINVAL);
  if (how == 0) {
    CHECK_OK(tdm_queue_wait(q, failed));
    CHECK_OK(tdm_queue_barrier(q, 0, NULL, &gate)); /* after the wait, so done once it is */
  } else if (how == 1) {
    CHECK_OK(tdm_queue_barrier(q, 1, &failed, &gate));
  } else {
    CHECK_OK(tdm_queue_barrier(q, 0, NULL, &gate));
  }
  CHECK_RC(tdm_event_wait(gate), TDM_EDEP);
  th_sleep_ms(50); /* long after: the failed gate has completed by every measure */
  for (int i = 0; i < 3; i++) {
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, &late));
    CHECK_RC(tdm_event_wait(late), TDM_EDEP);
    CHECK_OK(tdm_event_release(late));
  }
  int before = atomic_load(&ran);
  CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, &late));
  CHECK_OK(tdm_event_wait(late));
  CHECK_OK(tdm_event_release(late));
  CHECK_EQ(atomic_load(&ran), before + 1);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_release(gate));
  CHECK_OK(tdm_event_release(failed));
  CHECK_RC(tdm_queue_sync(src), TDM_EINVAL);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(src));
  th_gate_destroy(&g);
  th_close();
}

TEST_CASE(ooo_failed_wait_sticks) { failed_gate_round(0); }
TEST_CASE(ooo_failed_barrier_sticks) { failed_gate_round(1); }
TEST_CASE(ooo_failed_tracker_barrier_sticks) {
  setenv("TANDEM_TRACKER_CAPACITY", "2", 1);
  failed_gate_round(2);
}

/* ---- A host task's code is never "pending" ----------------------------------------------- */

static int task_return_eagain(void *arg) {
  (void)arg;
  tdm_set_error(TDM_EAGAIN, 0, "what the task's query said");
  return TDM_EAGAIN;
}

TEST_CASE(task_returns_eagain) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_event *ev;
  CHECK_OK(tdm_host_task(q, task_return_eagain, NULL, 0, NULL, &ev));
  CHECK_RC(tdm_event_wait(ev), TDM_ETASK);
  CHECK_RC(tdm_event_query(ev), TDM_ETASK);
  CHECK_MSG(strstr(tdm_last_error(), "TDM_EAGAIN") && strstr(tdm_last_error(), "query said"),
            "the message names neither the code returned nor the task's words: %s",
            tdm_last_error());
  CHECK_OK(tdm_event_release(ev));
  CHECK_RC(tdm_queue_sync(q), TDM_ETASK);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- The origin's words survive a chain of waits ----------------------------------------- */

enum { CHAIN = 16 };
static char origin_words[420];

static int task_fail_words(void *arg) {
  (void)arg;
  return tdm_set_error(TDM_EINVAL, 0, "%s", origin_words);
}

/* A failure hops through CHAIN queues, each waiting device-side for a marker of the one
 * before: the last marker's waiter still reads the failed task's words whole. */
TEST_CASE(wait_chain_keeps_origin) {
  tdm_device *dev = th_open();
  memset(origin_words, 'w', sizeof origin_words - 5);
  memcpy(origin_words, "BEGIN", 5);
  memcpy(origin_words + sizeof origin_words - 8, "END", 4);
  tdm_queue *q[CHAIN];
  tdm_event *ev[CHAIN];
  th_gate gate;
  th_gate_init(&gate);
  for (int i = 0; i < CHAIN; i++) q[i] = new_queue(dev, TDM_QUEUE_IN_ORDER);
  /* Held back, so each wait below is made while the event it names is pending. */
  CHECK_OK(tdm_host_task(q[0], task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q[0], task_fail_words, NULL, 0, NULL, NULL));
  CHECK_OK(tdm_event_record(q[0], &ev[0]));
  for (int i = 1; i < CHAIN; i++) {
    CHECK_OK(tdm_queue_wait(q[i], ev[i - 1]));
    CHECK_OK(tdm_event_record(q[i], &ev[i]));
  }
  th_gate_open(&gate);
  CHECK_RC(tdm_event_wait(ev[CHAIN - 1]), TDM_EDEP);
  CHECK_MSG(strstr(tdm_last_error(), origin_words), "the origin's words were lost: %s",
            tdm_last_error());
  CHECK_RC(tdm_queue_sync(q[CHAIN - 1]), TDM_EDEP);
  CHECK_MSG(strstr(tdm_last_error(), origin_words), "the sync lost the origin's words: %s",
            tdm_last_error());
  printf("%s\n", tdm_last_error());
  for (int i = 0; i < CHAIN; i++) {
    CHECK_OK(tdm_event_release(ev[i]));
    (void)tdm_queue_sync(q[i]);
    CHECK_OK(tdm_queue_destroy(q[i]));
  }
  th_gate_destroy(&gate);
  th_close();
}
