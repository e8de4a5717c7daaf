/* test-shutdown.c: the last tdm_shutdown against other threads. Calls that race it either
 * complete or get TDM_ENOTINIT; nothing is freed under a running thread (the ASan and TSan
 * builds are what catch that); queues made while it drains are drained too; a host task or a
 * keep-alive release that calls tdm_init during it gets an error instead of a hang.
 *
 * Every round starts a fresh context, lets helper threads hammer it, and shuts it down while
 * they run; a hang is a failure under ctest's time limit.
 */
#include "harness.h"

enum { ROUNDS = 12, RACERS = 3 };

/* What a racing thread may get from any call once the shutdown has begun. */
static int acceptable(int rc) {
  return rc == 0 || rc == TDM_ENOTINIT || rc == TDM_EHANDLE || rc == TDM_EAGAIN;
}

struct racer {
  pthread_t t;
  int kind;        /* which calls it makes */
  atomic_int stop; /* set once the context has gone */
  atomic_int laps; /* loops made while the context was live */
  int bad_rc;      /* a code outside acceptable(), with its call */
  const char *bad_call;
};

#define TRY(r, call)                                \
  do {                                              \
    int rc_ = (call);                               \
    if (!acceptable(rc_) && !(r)->bad_call) {       \
      (r)->bad_rc = rc_;                            \
      (r)->bad_call = #call;                        \
    }                                               \
    if (rc_ == TDM_ENOTINIT) goto out;              \
  } while (0)

static int task_nop(void *arg) {
  (void)arg;
  return 0;
}

/* kind 0: create, use and destroy queues of its own; 1: the default queue; 2: the current
 * queue and events shared through it. */
static void *racer_main(void *arg) {
  struct racer *r = arg;
  tdm_device *dev = NULL;
  while (!atomic_load(&r->stop)) {
    tdm_queue *q = NULL;
    tdm_event *ev = NULL;
    TRY(r, tdm_device_find(th_device_id, &dev));
    switch (r->kind) {
      case 0:
        TRY(r, tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
        TRY(r, tdm_host_task(q, task_nop, NULL, 0, NULL, &ev));
        TRY(r, tdm_event_wait(ev));
        TRY(r, tdm_event_release(ev));
        TRY(r, tdm_queue_destroy(q));
        break;
      case 1:
        TRY(r, tdm_default_queue(dev, &q));
        TRY(r, tdm_host_task(q, task_nop, NULL, 0, NULL, NULL));
        TRY(r, tdm_event_record(q, &ev));
        TRY(r, tdm_event_wait(ev));
        TRY(r, tdm_event_release(ev));
        TRY(r, tdm_queue_sync(q));
        break;
      default:
        TRY(r, tdm_current_queue(&q));
        TRY(r, tdm_event_record(q, &ev));
        TRY(r, tdm_queue_wait(q, ev));
        TRY(r, tdm_event_release(ev));
        break;
    }
    atomic_fetch_add(&r->laps, 1);
  }
out:
  return NULL;
}

/* Helper threads make calls of every kind while the main thread makes the last shutdown. */
TEST_CASE(calls_race_last_shutdown) {
  for (int round = 0; round < ROUNDS; round++) {
    th_open();
    struct racer r[RACERS];
    memset(r, 0, sizeof r);
    for (int i = 0; i < RACERS; i++) {
      r[i].kind = (i + round) % 3;
      CHECK(pthread_create(&r[i].t, NULL, racer_main, &r[i]) == 0);
    }
    for (int i = 0; i < RACERS; i++)
      CHECK_MSG(th_wait_atomic(&r[i].laps, 2, TH_HANG_MS), "racer %d made no progress", i);
    CHECK_OK(tdm_shutdown());
    for (int i = 0; i < RACERS; i++) {
      atomic_store(&r[i].stop, 1);
      pthread_join(r[i].t, NULL);
      CHECK_MSG(!r[i].bad_call, "racer %d: %s returned %s during the shutdown", i,
                r[i].bad_call, tdm_err_name(r[i].bad_rc));
    }
    /* Everything was freed and nothing is left counted: a later context starts clean. */
    tdm_stats st;
    CHECK_OK(tdm_init());
    CHECK_OK(tdm_stats_get(&st));
    CHECK_EQ(st.queues, 0);
    CHECK_EQ(st.allocations, 0);
    CHECK_OK(tdm_shutdown());
  }
}

/* A thread still inside tdm_queue_destroy (draining a queue whose host task takes a while)
 * when the last shutdown begins: the destroy completes, the shutdown waits for it. */
struct slow_destroy {
  tdm_queue *q;
  th_gate started;
  int rc;
};

static int task_slow(void *arg) {
  th_gate_open(arg);
  th_sleep_ms(30);
  return 0;
}

static void *destroy_main(void *arg) {
  struct slow_destroy *s = arg;
  s->rc = tdm_queue_destroy(s->q);
  return NULL;
}

TEST_CASE(shutdown_during_destroy) {
  for (int round = 0; round < 4; round++) {
    tdm_device *dev = th_open();
    struct slow_destroy s;
    pthread_t t;
    th_gate_init(&s.started);
    CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &s.q));
    CHECK_OK(tdm_host_task(s.q, task_slow, &s.started, 0, NULL, NULL));
    CHECK(th_gate_wait(&s.started, TH_HANG_MS));
    CHECK(pthread_create(&t, NULL, destroy_main, &s) == 0);
    th_sleep_ms(round * 5); /* into the destroy, or not yet: either must be safe */
    CHECK_OK(tdm_shutdown());
    pthread_join(t, NULL);
    CHECK_MSG(s.rc == 0 || s.rc == TDM_ENOTINIT, "the racing destroy returned %s",
              tdm_err_name(s.rc));
    th_gate_destroy(&s.started);
  }
}

/* Host tasks that create queues (and a default queue) while the shutdown drains: those
 * queues are drained and destroyed too, and their work runs. */
struct spawner {
  tdm_device *dev;
  atomic_int made, ran;
};

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

static int task_spawn(void *arg) {
  struct spawner *s = arg;
  tdm_queue *q = NULL, *dq = NULL;
  th_sleep_ms(20); /* let the shutdown begin */
  if (tdm_queue_create(s->dev, TDM_QUEUE_IN_ORDER, &q) == 0) {
    atomic_fetch_add(&s->made, 1);
    CHECK_OK(tdm_host_task(q, task_count, &s->ran, 0, NULL, NULL));
  }
  if (tdm_default_queue(s->dev, &dq) == 0) {
    atomic_fetch_add(&s->made, 1);
    CHECK_OK(tdm_host_task(dq, task_count, &s->ran, 0, NULL, NULL));
  }
  return 0;
}

TEST_CASE(queues_made_while_draining) {
  tdm_device *dev = th_open();
  struct spawner s = {.dev = dev};
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_host_task(q, task_spawn, &s, 0, NULL, NULL));
  CHECK_OK(tdm_shutdown());
  /* Each queue the task made ran its work before the shutdown returned. */
  CHECK_EQ(atomic_load(&s.made), 2);
  CHECK_EQ(atomic_load(&s.ran), 2);
  tdm_stats st;
  CHECK_OK(tdm_init());
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.queues, 0);
  CHECK_OK(tdm_shutdown());
}

/* A host task and a keep-alive release that call tdm_init while the last shutdown drains
 * their queue: an error (TDM_EDEADLK), not a hang. Whether the call comes before the
 * shutdown begins (then it is an init like any other, and the shutdown is not the last) is
 * up to the scheduler; both outcomes are checked. */
struct reinit {
  th_gate shutting;
  atomic_int rc;
  atomic_int done;
};

static int reinit_call(struct reinit *r) {
  CHECK(th_gate_wait(&r->shutting, TH_HANG_MS));
  th_sleep_ms(20); /* the main thread is inside tdm_shutdown by now, as a rule */
  int rc = tdm_init();
  atomic_store(&r->rc, rc);
  atomic_store(&r->done, 1);
  return rc == 0 || rc == TDM_EDEADLK ? 0 : rc;
}

static int task_reinit(void *arg) { return reinit_call(arg); }
static void release_reinit(void *arg) { (void)reinit_call(arg); }

static void reinit_round(int keep_alive) {
  tdm_device *dev = th_open();
  struct reinit r;
  tdm_queue *q;
  th_gate busy;
  th_gate_init(&busy);
  th_gate_init(&r.shutting);
  atomic_store(&r.rc, 12345);
  atomic_store(&r.done, 0);
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  if (keep_alive) {
    CHECK_OK(tdm_host_task(q, task_slow, &busy, 0, NULL, NULL));
    CHECK_OK(tdm_keep_alive(q, release_reinit, &r));
  } else {
    CHECK_OK(tdm_host_task(q, task_reinit, &r, 0, NULL, NULL));
  }
  th_gate_open(&r.shutting);
  CHECK_OK(tdm_shutdown());
  CHECK_EQ(atomic_load(&r.done), 1);
  int rc = atomic_load(&r.rc);
  CHECK_MSG(rc == 0 || rc == TDM_EDEADLK, "tdm_init from a %s returned %s",
            keep_alive ? "release" : "host task", tdm_err_name(rc));
  printf("tdm_init from a %s during the shutdown: %s\n", keep_alive ? "release" : "host task",
         tdm_err_name(rc));
  if (rc == 0) CHECK_OK(tdm_shutdown()); /* it came first: its reference is the last now */
  int n;
  CHECK_RC(tdm_device_count(&n), TDM_ENOTINIT);
  th_gate_destroy(&r.shutting);
  th_gate_destroy(&busy);
}

TEST_CASE(host_task_inits_during_shutdown) { reinit_round(0); }
TEST_CASE(release_inits_during_shutdown) { reinit_round(1); }

/* A program thread's tdm_init during the last shutdown waits for it, then starts afresh. */
static void *init_main(void *arg) {
  *(int *)arg = tdm_init();
  return NULL;
}

TEST_CASE(init_waits_for_shutdown) {
  tdm_device *dev = th_open();
  tdm_queue *q;
  th_gate g;
  th_gate_init(&g);
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_host_task(q, task_slow, &g, 0, NULL, NULL));
  CHECK(th_gate_wait(&g, TH_HANG_MS));
  int rc = 12345;
  pthread_t t;
  CHECK(pthread_create(&t, NULL, init_main, &rc) == 0);
  CHECK_OK(tdm_shutdown());
  pthread_join(t, NULL);
  CHECK_OK(rc);
  /* Whichever came first, exactly one reference is left, and the context works. */
  CHECK_OK(tdm_device_find(th_device_id, &dev));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_shutdown());
  CHECK_RC(tdm_shutdown(), TDM_ENOTINIT);
  th_gate_destroy(&g);
}
