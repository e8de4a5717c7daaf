/* test-conf-markers.c: conformance, markers and events: a marker completes after every earlier
 * command of its queue, in-order or out-of-order, and after work other code launched on the
 * native queue (CPU backend: a tdm_cpu_stream, also one the program made and tandem adopted);
 * an event's query, wait and timing. */
#include "conformance.h"

#include <math.h>
#include <sched.h>

#include <tandem/cpu.h>

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

/* Events of an in-order queue complete in submission order however they are watched: a long
 * run of records and copies with their events, most released at once and none waited for
 * (on CUDA they complete lazily, on the submitting thread, or go to the executor when someone
 * watches: src/core/exec.c); the kept ones are polled newest first, so once one is seen
 * complete, every older one must be too; a host task behind them finds every one complete;
 * another queue that waits for the newest one device-side, with nobody on the host watching
 * it, reads what the copies before it wrote; and records behind a host task that fails all
 * report its failure, newest waited for first. */
struct all_done {
  tdm_event **ev;
  int n;
  atomic_int not_done;
};

static int task_all_done(void *arg) {
  struct all_done *a = arg;
  for (int i = 0; i < a->n; i++)
    if (tdm_event_query(a->ev[i]) != 0) atomic_fetch_add(&a->not_done, 1);
  return 0;
}

static int task_sleep_then_fail(void *arg) {
  (void)arg;
  struct timespec ts = {0, 2 * 1000 * 1000};
  nanosleep(&ts, NULL);
  return TDM_EINVAL;
}

TEST_CASE(events_complete_in_order) {
  enum { N = 240, KEEP_EVERY = 5, BYTES = 4096 };
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, (size_t)N * BYTES);
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, (size_t)N * BYTES);
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, (size_t)N * BYTES);
  th_fill_random(src, (size_t)N * BYTES, &rng);
  memset(back, 0, (size_t)N * BYTES);
  tdm_event *kept[N / KEEP_EVERY + 1];
  int nkept = 0;
  for (int i = 0; i < N; i++) {
    tdm_event *e = NULL;
    if (i % 2)
      CHECK_OK(tdm_memcpy(q, d + (size_t)i * BYTES, src + (size_t)i * BYTES, BYTES,
                          TDM_COPY_AUTO, 0, NULL, &e));
    else
      CHECK_OK(tdm_event_record(q, &e));
    if (i % KEEP_EVERY == KEEP_EVERY - 1)
      kept[nkept++] = e;
    else
      CHECK_OK(tdm_event_release(e));
  }
  /* Newest first: a completed event implies every older one. */
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int seen_done = -1;
    for (int k = nkept - 1; k >= 0; k--) {
      int rc = tdm_event_query(kept[k]);
      CHECK_MSG(rc == 0 || rc == TDM_EAGAIN, "event %d: %s", k, tdm_err_name(rc));
      if (rc == 0 && seen_done < 0) seen_done = k;
      CHECK_MSG(rc == 0 || seen_done < 0,
                "event %d is pending though the newer event %d completed", k, seen_done);
    }
    if (seen_done == nkept - 1) break;
    clock_gettime(CLOCK_MONOTONIC, &t);
    CHECK_MSG(t.tv_sec - t0.tv_sec < TH_HANG_MS / 1000, "the events never completed by polling");
    sched_yield();
  }
  /* More of the same, then a host task that looks at all of them. */
  for (int i = 0; i < N; i++) {
    tdm_event *e = NULL;
    CHECK_OK(tdm_event_record(q, &e));
    CHECK_OK(tdm_event_release(e));
  }
  struct all_done a = {kept, nkept, 0};
  tdm_event *task_ev = NULL;
  CHECK_OK(tdm_host_task(q, task_all_done, &a, 0, NULL, &task_ev));
  wait_ok(task_ev);
  CHECK_EQ(atomic_load(&a.not_done), 0);
  /* A device-side wait on an event nobody on the host watches: copies back on q2 after it. */
  tdm_event *last = NULL;
  CHECK_OK(tdm_event_record(q, &last));
  CHECK_OK(tdm_queue_wait(q2, last));
  CHECK_OK(tdm_event_release(last));
  for (int i = 1; i < N; i += 2)
    CHECK_OK(tdm_memcpy(q2, back + (size_t)i * BYTES, d + (size_t)i * BYTES, BYTES,
                        TDM_COPY_AUTO, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q2));
  for (int i = 1; i < N; i += 2)
    CHECK_MEM_EQ(back + (size_t)i * BYTES, src + (size_t)i * BYTES, BYTES);
  for (int k = 0; k < nkept; k++) CHECK_OK(tdm_event_release(kept[k]));
  CHECK_OK(tdm_queue_sync(q));
  /* Submitting while watching: each round records more, polls the oldest kept event (which
   * hands what is pending to whoever completes it) and checks the order newest first. */
  enum { ROUNDS = 40, PER_ROUND = 17 };
  tdm_event *w[ROUNDS];
  for (int r = 0; r < ROUNDS; r++) {
    for (int j = 0; j < PER_ROUND; j++) {
      tdm_event *e = NULL;
      CHECK_OK(tdm_event_record(q, &e));
      if (j == PER_ROUND - 1)
        w[r] = e;
      else
        CHECK_OK(tdm_event_release(e));
    }
    int rc = tdm_event_query(w[0]);
    CHECK_MSG(rc == 0 || rc == TDM_EAGAIN, "round %d: %s", r, tdm_err_name(rc));
    int seen_done = -1;
    for (int k = r; k >= 0; k--) {
      rc = tdm_event_query(w[k]);
      if (rc == 0 && seen_done < 0) seen_done = k;
      CHECK_MSG(rc == 0 || seen_done < 0,
                "round %d: event %d is pending though the newer event %d completed", r, k,
                seen_done);
    }
  }
  for (int r = 0; r < ROUNDS; r++) wait_ok(w[r]);
  /* Behind a host task that fails (slowly, so the records after it pile up), every record
   * reports that failure, the first error since the last sync, whoever completes it. */
  tdm_event *after[N];
  CHECK_OK(tdm_host_task(q, task_sleep_then_fail, NULL, 0, NULL, NULL));
  for (int i = 0; i < N; i++) CHECK_OK(tdm_event_record(q, &after[i]));
  for (int i = N - 1; i >= 0; i--) {
    int rc = th_event_wait_limited(after[i], TH_HANG_MS);
    CHECK_MSG(rc == TDM_EINVAL, "record %d after the failed task: %s", i, tdm_err_name(rc));
    CHECK_OK(tdm_event_release(after[i]));
  }
  CHECK_RC(tdm_queue_sync(q), TDM_EINVAL);
  CHECK_OK(tdm_queue_sync(q));
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_queue_destroy(q2));
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
