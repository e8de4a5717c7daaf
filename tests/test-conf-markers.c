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
