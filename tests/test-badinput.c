/* test-badinput.c: bad input gets an error code, never a crash (cpu:0).
 *
 * NULL handles and out-parameters, destroyed and foreign handles, ranges past an allocation,
 * wrong copy directions, memory of another device, bad frees, calls before tdm_init, unknown
 * devices, and the error-name tables. Every failing call must leave its out-parameters
 * untouched (they hold sentinels here) and set a message of its own (CHECK_RC checks it).
 * Stale handles are safe to pass because tandem pools queue and event memory; each stale check
 * runs right after the handle died, before anything could reuse its slot.
 */
#include "harness.h"

#include <tandem/cpu.h>

#define SENTINEL_PTR ((void *)(uintptr_t)0x5e)
#define SENTINEL_QUEUE ((tdm_queue *)SENTINEL_PTR)
#define SENTINEL_EVENT ((tdm_event *)SENTINEL_PTR)
#define SENTINEL_DEVICE ((tdm_device *)SENTINEL_PTR)

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

static void release_count(void *obj) { atomic_fetch_add((atomic_int *)obj, 1); }

static tdm_queue *new_queue(tdm_device *dev) {
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  return q;
}

/* An event that has completed and that only the caller references. */
static tdm_event *completed_event(tdm_queue *q) {
  tdm_event *ev = NULL;
  atomic_int dummy = 0;
  CHECK_OK(tdm_event_record(q, &ev));
  /* A later command, so the tracker's reference moves off ev. */
  CHECK_OK(tdm_host_task(q, task_count, &dummy, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_query(ev));
  return ev;
}

/* ---- NULL -------------------------------------------------------------------------------- */

TEST_CASE(null_handles) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev), *qo = SENTINEL_QUEUE;
  tdm_event *ev = completed_event(q), *eo = SENTINEL_EVENT;
  void *p = SENTINEL_PTR;
  unsigned char buf[16];
  double ms = -1.0;
  atomic_int ran = 0;

  CHECK_RC(tdm_queue_create(NULL, 0, &qo), TDM_EINVAL);
  CHECK(qo == SENTINEL_QUEUE);
  CHECK_RC(tdm_queue_destroy(NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_sync(NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_wait(NULL, ev), TDM_EINVAL);
  CHECK_RC(tdm_queue_wait(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_barrier(NULL, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_queue_adopt(dev, NULL, 0, &qo), TDM_EINVAL);
  CHECK_RC(tdm_queue_adopt(NULL, SENTINEL_PTR, 0, &qo), TDM_EINVAL);
  CHECK(qo == SENTINEL_QUEUE);
  CHECK_RC(tdm_event_record(NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_event_query(NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_wait(NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_retain(NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_release(NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_elapsed(NULL, ev, &ms), TDM_EINVAL);
  CHECK_RC(tdm_event_elapsed(ev, NULL, &ms), TDM_EINVAL);
  CHECK(ms == -1.0);
  CHECK_RC(tdm_event_queue(NULL, &qo), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT && qo == SENTINEL_QUEUE);
  CHECK_RC(tdm_malloc(NULL, TDM_MEM_DEVICE, 16, &p), TDM_EINVAL);
  CHECK(p == SENTINEL_PTR);
  CHECK_RC(tdm_memcpy(NULL, buf, buf + 8, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, NULL, buf, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, buf, NULL, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy_cross(NULL, q, buf, buf + 8, 8, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy_cross(q, NULL, buf, buf + 8, 8, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memset(NULL, buf, 1, 8, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memset(q, NULL, 1, 8, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_host_task(NULL, task_count, &ran, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_host_task(q, NULL, &ran, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_keep_alive(NULL, release_count, &ran), TDM_EINVAL);
  CHECK_RC(tdm_keep_alive(q, NULL, &ran), TDM_EINVAL);
  CHECK_RC(tdm_free_async(NULL, SENTINEL_PTR, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_free_async(q, NULL, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_host_register(NULL, buf, sizeof buf), TDM_EINVAL);
  CHECK_RC(tdm_host_register(dev, NULL, 4096), TDM_EINVAL);
  CHECK_RC(tdm_queue_track(NULL, ev), TDM_EINVAL);
  CHECK_RC(tdm_queue_track(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_current_queue_push(NULL), TDM_EINVAL);
  tdm_device_info info;
  CHECK_RC(tdm_device_info_get(NULL, &info), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT);
  tdm_cpu_stream *cs = (tdm_cpu_stream *)SENTINEL_PTR;
  CHECK_RC(tdm_cpu_stream_create(NULL), TDM_EINVAL);
  CHECK_RC(tdm_cpu_stream_destroy(NULL), TDM_EHANDLE);
  CHECK_RC(tdm_cpu_stream_launch(NULL, release_count, &ran), TDM_EHANDLE);
  CHECK_OK(tdm_cpu_stream_create(&cs));
  CHECK_RC(tdm_cpu_stream_launch(cs, NULL, &ran), TDM_EINVAL);
  CHECK_OK(tdm_cpu_stream_destroy(cs));

  /* A dependency list with a NULL array or a NULL entry. */
  tdm_event *with_null[2] = {ev, NULL};
  CHECK_RC(tdm_host_task(q, task_count, &ran, 1, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_host_task(q, task_count, &ran, 2, with_null, &eo), TDM_EINVAL);
  CHECK_RC(tdm_queue_barrier(q, 2, with_null, &eo), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT);

  CHECK_OK(tdm_queue_sync(q)); /* refused calls are not queue errors */
  CHECK_EQ(atomic_load(&ran), 0);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
  CHECK_EQ(atomic_load(&ran), 0); /* no keep-alive release ran either */
}

TEST_CASE(null_out_params) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  tdm_event *ev = completed_event(q);
  void *p = NULL;
  size_t n = 0;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, &p));
  CHECK_RC(tdm_queue_create(dev, 0, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_native(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_device(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_flags(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_record(q, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_elapsed(ev, ev, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_queue(ev, NULL), TDM_EINVAL);
  CHECK_RC(tdm_malloc(dev, TDM_MEM_DEVICE, 16, NULL), TDM_EINVAL);
  CHECK_RC(tdm_mem_query(p, NULL), TDM_EINVAL);
  CHECK_RC(tdm_device_count(NULL), TDM_EINVAL);
  CHECK_RC(tdm_device_get(0, NULL), TDM_EINVAL);
  CHECK_RC(tdm_device_find("cpu:0", NULL), TDM_EINVAL);
  CHECK_RC(tdm_device_info_get(dev, NULL), TDM_EINVAL);
  CHECK_RC(tdm_backend_count(NULL), TDM_EINVAL);
  CHECK_RC(tdm_backend_get(0, NULL), TDM_EINVAL);
  CHECK_RC(tdm_default_queue(dev, NULL), TDM_EINVAL);
  CHECK_RC(tdm_current_queue(NULL), TDM_EINVAL);
  CHECK_RC(tdm_stats_get(NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_dependencies(q, NULL, 4, &n), TDM_EINVAL);
  tdm_event *deps[4];
  CHECK_RC(tdm_queue_dependencies(q, deps, 4, NULL), TDM_EINVAL);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_free(p));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Stale and foreign handles ----------------------------------------------------------- */

TEST_CASE(stale_queue) {
  tdm_device *dev = th_open();
  tdm_queue *live = new_queue(dev), *q = new_queue(dev), *qo = SENTINEL_QUEUE;
  tdm_event *ev = completed_event(live), *eo = SENTINEL_EVENT;
  unsigned char buf[16];
  unsigned flags = 99;
  void *native = SENTINEL_PTR;
  tdm_device *d = SENTINEL_DEVICE;
  atomic_int ran = 0;
  CHECK_OK(tdm_queue_destroy(q));
  /* No queue is created from here until the checks end, so q's slot stays dead. */
  CHECK_RC(tdm_queue_destroy(q), TDM_EHANDLE);
  CHECK_RC(tdm_queue_sync(q), TDM_EHANDLE);
  CHECK_RC(tdm_queue_flags(q, &flags), TDM_EHANDLE);
  CHECK_RC(tdm_queue_native(q, &native), TDM_EHANDLE);
  CHECK_RC(tdm_queue_device(q, &d), TDM_EHANDLE);
  CHECK_RC(tdm_queue_wait(q, ev), TDM_EHANDLE);
  CHECK_RC(tdm_queue_barrier(q, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_event_record(q, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_memcpy(q, buf, buf + 8, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_memcpy_cross(live, q, buf, buf + 8, 8, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_memset(q, buf, 1, 8, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_host_task(q, task_count, &ran, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_keep_alive(q, release_count, &ran), TDM_EHANDLE);
  CHECK_RC(tdm_queue_track(q, ev), TDM_EHANDLE);
  CHECK_RC(tdm_current_queue_push(q), TDM_EHANDLE);
  CHECK_RC(tdm_default_queue_set(dev, q), TDM_EHANDLE);
  CHECK(flags == 99 && native == SENTINEL_PTR && d == SENTINEL_DEVICE && eo == SENTINEL_EVENT);
  CHECK(qo == SENTINEL_QUEUE);
  CHECK_OK(tdm_queue_sync(live));
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_queue_destroy(live));
  th_close();
  CHECK_EQ(atomic_load(&ran), 0);
}

TEST_CASE(stale_event) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  tdm_event *ev = completed_event(q), *eo = SENTINEL_EVENT, *ok_ev = completed_event(q);
  tdm_queue *qo = SENTINEL_QUEUE;
  atomic_int ran = 0;
  double ms = -1.0;
  CHECK_OK(tdm_event_release(ev)); /* the last reference: ev is freed */
  CHECK_RC(tdm_event_query(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_wait(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_retain(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_release(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_queue(ev, &qo), TDM_EHANDLE);
  CHECK_RC(tdm_event_elapsed(ev, ok_ev, &ms), TDM_EHANDLE);
  CHECK_RC(tdm_queue_wait(q, ev), TDM_EHANDLE);
  CHECK_RC(tdm_queue_track(q, ev), TDM_EHANDLE);
  /* As a dependency: the submission is refused. */
  CHECK_RC(tdm_host_task(q, task_count, &ran, 1, &ev, &eo), TDM_EHANDLE);
  CHECK(eo == SENTINEL_EVENT && qo == SENTINEL_QUEUE && ms == -1.0);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&ran), 0);
  CHECK_OK(tdm_event_release(ok_ev));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(foreign_handles) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  tdm_event *ev = completed_event(q), *eo = SENTINEL_EVENT;
  void *zero = calloc(1, 4096);
  unsigned flags = 99;
  atomic_int ran = 0;
  CHECK(zero != NULL);
  /* An event passed as a queue, and a queue passed as an event. */
  CHECK_RC(tdm_queue_sync((tdm_queue *)ev), TDM_EHANDLE);
  CHECK_RC(tdm_queue_flags((tdm_queue *)ev, &flags), TDM_EHANDLE);
  CHECK_RC(tdm_host_task((tdm_queue *)ev, task_count, &ran, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_queue_destroy((tdm_queue *)ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_query((tdm_event *)q), TDM_EHANDLE);
  CHECK_RC(tdm_event_release((tdm_event *)q), TDM_EHANDLE);
  CHECK_RC(tdm_queue_wait(q, (tdm_event *)q), TDM_EHANDLE);
  /* Zero-filled memory tandem never handed out. */
  CHECK_RC(tdm_queue_sync(zero), TDM_EHANDLE);
  CHECK_RC(tdm_queue_destroy(zero), TDM_EHANDLE);
  CHECK_RC(tdm_event_record(zero, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_memset(zero, zero, 1, 16, 0, NULL, &eo), TDM_EHANDLE);
  CHECK_RC(tdm_event_query(zero), TDM_EHANDLE);
  CHECK_RC(tdm_event_wait(zero), TDM_EHANDLE);
  CHECK_RC(tdm_event_release(zero), TDM_EHANDLE);
  tdm_event *dep = zero;
  CHECK_RC(tdm_host_task(q, task_count, &ran, 1, &dep, &eo), TDM_EHANDLE);
  CHECK(flags == 99 && eo == SENTINEL_EVENT);
  for (size_t i = 0; i < 4096; i++) CHECK(((unsigned char *)zero)[i] == 0);
  /* The real objects are unharmed. */
  CHECK_OK(tdm_event_query(ev));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&ran), 0);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_queue_destroy(q));
  free(zero);
  th_close();
}

/* ---- Copies ------------------------------------------------------------------------------ */

TEST_CASE(copy_range) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  unsigned char *d = NULL, *h = NULL, *reg = aligned_alloc(4096, 4096);
  tdm_event *eo = SENTINEL_EVENT;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, (void **)&d));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 64, (void **)&h));
  CHECK_OK(tdm_host_register(dev, reg, 4096));
  CHECK_RC(tdm_memcpy(q, d, h, 65, TDM_COPY_H2D, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, d + 1, h, 64, TDM_COPY_H2D, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, d, h + 1, 64, TDM_COPY_H2D, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, h, d + 32, 33, TDM_COPY_D2H, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, d, reg + 4000, 97, TDM_COPY_H2D, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, d, h, SIZE_MAX, TDM_COPY_H2D, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, d + 8, h, SIZE_MAX - 4, TDM_COPY_AUTO, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memset(q, d + 60, 1, 5, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memset(q, h, 1, 65, 0, NULL, &eo), TDM_ERANGE);
  CHECK(eo == SENTINEL_EVENT);
  /* Exactly to the end is fine. */
  CHECK_OK(tdm_memcpy(q, d + 1, h, 63, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, d, reg + 4032, 64, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_host_unregister(reg));
  free(reg);
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(copy_direction) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  unsigned char *d = NULL, *d2 = NULL, *h = NULL, *h2 = NULL, *pageable = malloc(64);
  tdm_event *eo = SENTINEL_EVENT;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, (void **)&d));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, (void **)&d2));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 64, (void **)&h));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 64, (void **)&h2));
  CHECK_RC(tdm_memcpy(q, h2, h, 16, TDM_COPY_H2D, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, pageable, h, 16, TDM_COPY_H2D, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, d, d2, 16, TDM_COPY_H2D, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, d, d2, 16, TDM_COPY_D2H, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, h, h2, 16, TDM_COPY_D2H, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, d, h, 16, TDM_COPY_D2D, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, h, d, 16, TDM_COPY_D2D, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, h, d, 16, TDM_COPY_H2H, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK_RC(tdm_memcpy(q, d, pageable, 16, TDM_COPY_H2H, 0, NULL, &eo), TDM_EDIRECTION);
  CHECK(eo == SENTINEL_EVENT);
  CHECK_OK(tdm_queue_sync(q));
  free(pageable);
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(d2));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_free(h2));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* With two CPU devices, device memory of cpu:1 cannot be used on a cpu:0 queue. */
TEST_CASE(other_device) {
  CHECK(setenv("TANDEM_CPU_DEVICES", "2", 1) == 0);
  tdm_device *dev0 = th_open(), *dev1 = NULL;
  CHECK_OK(tdm_device_find("cpu:1", &dev1));
  CHECK(dev1 != dev0);
  tdm_queue *q0 = new_queue(dev0), *q1 = new_queue(dev1), *t0 = NULL, *t1 = NULL;
  unsigned char *d0 = NULL, *d1 = NULL, *h = NULL;
  tdm_event *eo = SENTINEL_EVENT, *e0 = NULL, *e1 = NULL;
  double ms = -1.0;
  CHECK_OK(tdm_malloc(dev0, TDM_MEM_DEVICE, 64, (void **)&d0));
  CHECK_OK(tdm_malloc(dev1, TDM_MEM_DEVICE, 64, (void **)&d1));
  CHECK_OK(tdm_malloc(dev0, TDM_MEM_PINNED, 64, (void **)&h));
  CHECK_RC(tdm_memcpy(q0, d1, h, 16, TDM_COPY_H2D, 0, NULL, &eo), TDM_EXDEV);
  CHECK_RC(tdm_memcpy(q0, h, d1, 16, TDM_COPY_D2H, 0, NULL, &eo), TDM_EXDEV);
  CHECK_RC(tdm_memcpy(q0, d1, d0, 16, TDM_COPY_D2D, 0, NULL, &eo), TDM_EXDEV);
  CHECK_RC(tdm_memset(q0, d1, 1, 16, 0, NULL, &eo), TDM_EXDEV);
  CHECK(eo == SENTINEL_EVENT);

  /* Timing across devices. */
  CHECK_OK(tdm_queue_create(dev0, TDM_QUEUE_TIMING, &t0));
  CHECK_OK(tdm_queue_create(dev1, TDM_QUEUE_TIMING, &t1));
  CHECK_OK(tdm_event_record(t0, &e0));
  CHECK_OK(tdm_event_record(t1, &e1));
  CHECK_OK(tdm_event_wait(e0));
  CHECK_OK(tdm_event_wait(e1));
  CHECK_RC(tdm_event_elapsed(e0, e1, &ms), TDM_EXDEV);
  CHECK(ms == -1.0);

  /* Waiting across devices is allowed. */
  CHECK_OK(tdm_queue_wait(q0, e1));
  CHECK_OK(tdm_queue_sync(q0));
  CHECK_OK(tdm_event_release(e0));
  CHECK_OK(tdm_event_release(e1));
  CHECK_OK(tdm_free(d0));
  CHECK_OK(tdm_free(d1));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_queue_destroy(q0));
  CHECK_OK(tdm_queue_destroy(q1));
  CHECK_OK(tdm_queue_destroy(t0));
  CHECK_OK(tdm_queue_destroy(t1));
  th_close();
}

/* ---- Memory ------------------------------------------------------------------------------ */

TEST_CASE(memory_errors) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  void *p = SENTINEL_PTR, *d = NULL;
  char *foreign = malloc(64);
  int on_stack = 0;
  tdm_event *eo = SENTINEL_EVENT;
  CHECK_RC(tdm_malloc(dev, TDM_MEM_DEVICE, 0, &p), TDM_EINVAL);
  CHECK_RC(tdm_malloc(dev, TDM_MEM_PINNED, 0, &p), TDM_EINVAL);
  CHECK_RC(tdm_malloc(dev, (tdm_mem_kind)99, 16, &p), TDM_EINVAL);
  CHECK(p == SENTINEL_PTR);
  CHECK_RC(tdm_free(foreign), TDM_EINVAL);
  CHECK_RC(tdm_free(&on_stack), TDM_EINVAL);
  CHECK_RC(tdm_free_async(q, foreign, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_host_unregister(foreign), TDM_EINVAL);
  CHECK_RC(tdm_host_register(dev, foreign, 0), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT);

  /* Double free, immediate and stream-ordered. */
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, &d));
  CHECK_OK(tdm_free(d));
  CHECK_RC(tdm_free(d), TDM_EINVAL);
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, &d));
  CHECK_OK(tdm_free_async(q, d, 0, NULL, NULL));
  CHECK_RC(tdm_free_async(q, d, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_free(d), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT);
  CHECK_OK(tdm_queue_sync(q));

  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.allocations, 0);
  free(foreign);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Lifecycle and lookup ---------------------------------------------------------------- */

TEST_CASE(before_init) {
  int count = -7;
  tdm_device *d = SENTINEL_DEVICE;
  tdm_queue *q = SENTINEL_QUEUE;
  tdm_backend_info bi;
  memset(&bi, 0x5e, sizeof bi);
  CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT);
  CHECK_RC(tdm_device_get(0, &d), TDM_ENOTINIT);
  CHECK_RC(tdm_device_find("cpu:0", &d), TDM_ENOTINIT);
  CHECK_RC(tdm_backend_count(&count), TDM_ENOTINIT);
  CHECK_RC(tdm_backend_get(0, &bi), TDM_ENOTINIT);
  CHECK_RC(tdm_default_queue(NULL, &q), TDM_ENOTINIT);
  CHECK_RC(tdm_current_queue(&q), TDM_ENOTINIT);
  CHECK_RC(tdm_current_queue_pop(), TDM_ENOTINIT);
  CHECK_RC(tdm_shutdown(), TDM_ENOTINIT);
  CHECK(count == -7 && d == SENTINEL_DEVICE && q == SENTINEL_QUEUE);
  CHECK(((unsigned char *)&bi)[0] == 0x5e);
  /* What needs no runtime works. */
  CHECK(tdm_version() == TDM_VERSION);
  CHECK(strcmp(tdm_err_name(TDM_ENOTINIT), "TDM_ENOTINIT") == 0);
  th_open();
  th_close();
}

TEST_CASE(unknown_device) {
  th_open();
  tdm_device *d = SENTINEL_DEVICE;
  CHECK_RC(tdm_device_find("cpu:9", &d), TDM_ENODEV);
  CHECK_RC(tdm_device_find("nosuch:0", &d), TDM_ENODEV);
  CHECK_RC(tdm_device_find("cpu:0x", &d), TDM_ENODEV);
  CHECK_RC(tdm_device_get(999, &d), TDM_ENODEV);
  CHECK(d == SENTINEL_DEVICE);
  th_close();
}

/* ---- Error names ------------------------------------------------------------------------- */

TEST_CASE(error_names) {
  struct {
    int code;
    const char *name, *msg;
  } table[] = {
#define ROW(name, value, msg) {TDM_##name, "TDM_" #name, msg},
      TDM_ERRNO_MAP(ROW)
#undef ROW
  };
  size_t n = sizeof table / sizeof table[0];
  for (size_t i = 0; i < n; i++) {
    CHECK(table[i].code < 0);
    CHECK_MSG(strcmp(tdm_err_name(table[i].code), table[i].name) == 0, "%s named %s",
              table[i].name, tdm_err_name(table[i].code));
    CHECK_MSG(strcmp(tdm_strerror(table[i].code), table[i].msg) == 0, "%s: \"%s\"",
              table[i].name, tdm_strerror(table[i].code));
    for (size_t j = 0; j < i; j++) CHECK(table[j].code != table[i].code);
  }
  CHECK(strcmp(tdm_err_name(0), "TDM_OK") == 0);
  CHECK(strcmp(tdm_err_name(-1000), "TDM_UNKNOWN") == 0);
  CHECK(strcmp(tdm_err_name(5), "TDM_UNKNOWN") == 0);
  CHECK(tdm_strerror(0) != NULL && tdm_strerror(-1000) != NULL && tdm_strerror(-1000)[0]);
  CHECK(tdm_last_error() != NULL);
}

/* tdm_clear_error forgets the message and the native code, before tdm_init too, and a call
 * that succeeds leaves the cleared state alone: how a caller tells that a failure set its own
 * message. */
TEST_CASE(clear_error) {
  tdm_device *d = SENTINEL_DEVICE;
  CHECK_RC(tdm_device_count(NULL), TDM_ENOTINIT);
  CHECK(strncmp(tdm_last_error(), "TDM_ENOTINIT: ", 14) == 0);
  tdm_clear_error();
  CHECK(strcmp(tdm_last_error(), "no error") == 0);
  CHECK_EQ(tdm_last_native_error(), 0);
  th_open();
  CHECK_RC(tdm_device_find("cpu:9", &d), TDM_ENODEV);
  CHECK(strncmp(tdm_last_error(), "TDM_ENODEV: ", 12) == 0);
  tdm_clear_error();
  CHECK_OK(tdm_device_find("cpu:0", &d));
  CHECK(strcmp(tdm_last_error(), "no error") == 0);
  tdm_clear_error(); /* twice is fine */
  CHECK(strcmp(tdm_last_error(), "no error") == 0);
  th_close();
}

/* ---- Handles that outlive their objects --------------------------------------------------- */

/* A destroyed queue's handle stays dead when a new queue reuses its memory, and a released
 * event's handle stays dead when a new event reuses its memory. */
TEST_CASE(recycled_handles) {
  tdm_device *dev = th_open();
  atomic_int ran = 0;
  for (int round = 0; round < 50; round++) {
    tdm_queue *q1 = new_queue(dev), *q2 = NULL;
    CHECK_OK(tdm_queue_destroy(q1));
    q2 = new_queue(dev);
    CHECK(q2 != q1);
    CHECK_RC(tdm_host_task(q1, task_count, &ran, 0, NULL, NULL), TDM_EHANDLE);
    CHECK_RC(tdm_queue_destroy(q1), TDM_EHANDLE);
    CHECK_OK(tdm_host_task(q2, task_count, &ran, 0, NULL, NULL)); /* q2 survived */

    tdm_event *a = completed_event(q2), *b = NULL;
    CHECK_OK(tdm_event_release(a));
    b = completed_event(q2); /* likely the same memory as a */
    CHECK(b != a);
    CHECK_RC(tdm_event_release(a), TDM_EHANDLE);
    CHECK_RC(tdm_event_query(a), TDM_EHANDLE);
    CHECK_OK(tdm_event_query(b)); /* b keeps its reference */
    CHECK_OK(tdm_event_release(b));
    CHECK_OK(tdm_queue_destroy(q2));
  }
  CHECK_EQ(atomic_load(&ran), 50);
  th_close();
}

static int task_wait_flag(void *arg) {
  while (!atomic_load((atomic_int *)arg)) th_sleep_ms(1);
  return 0;
}

/* Releasing more references than the caller holds, while tandem still holds its own for
 * pending work, is refused; the work completes. */
TEST_CASE(over_release_pending) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  atomic_int go = 0, ran = 0;
  tdm_event *ev = NULL, *after = NULL;
  CHECK_OK(tdm_host_task(q, task_wait_flag, &go, 0, NULL, &ev));
  CHECK_OK(tdm_event_retain(ev));
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_event_release(ev)); /* the caller's last */
  CHECK_RC(tdm_event_release(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_retain(ev), TDM_EHANDLE);
  CHECK_RC(tdm_queue_wait(q, ev), TDM_EHANDLE);
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, &after));
  atomic_store(&go, 1);
  CHECK_OK(tdm_event_wait(after));
  CHECK_EQ(atomic_load(&ran), 1);
  CHECK_OK(tdm_event_release(after));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Handles from before a shutdown are dead after the next init, and the current-queue stack
 * does not survive the shutdown. */
TEST_CASE(stale_after_shutdown) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev), *cur = NULL, *q2 = NULL;
  tdm_event *ev = completed_event(q), *pending = NULL;
  atomic_int go = 0;
  CHECK_OK(tdm_host_task(q, task_wait_flag, &go, 0, NULL, &pending));
  CHECK_OK(tdm_current_queue_push(q));
  atomic_store(&go, 1);
  th_close(); /* ev, pending and q are still held */
  dev = th_open();
  CHECK_RC(tdm_event_query(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_release(ev), TDM_EHANDLE);
  CHECK_RC(tdm_event_wait(pending), TDM_EHANDLE);
  CHECK_RC(tdm_queue_sync(q), TDM_EHANDLE);
  CHECK_RC(tdm_queue_destroy(q), TDM_EHANDLE);
  CHECK_RC(tdm_current_queue_pop(), TDM_ESTATE); /* the stack was emptied */
  CHECK_OK(tdm_current_queue(&cur));
  CHECK(cur != q);
  q2 = new_queue(dev);
  CHECK(q2 != q);
  CHECK_OK(tdm_queue_sync(q2));
  CHECK_OK(tdm_queue_destroy(q2));
  th_close();
}

struct destroy_race {
  tdm_queue *q;
  atomic_int go;
  int rc;
};

static void *destroy_thread(void *arg) {
  struct destroy_race *r = arg;
  while (!atomic_load(&r->go)) {
  }
  r->rc = tdm_queue_destroy(r->q);
  return NULL;
}

/* Two threads destroy one queue at once: one succeeds, the other gets TDM_EHANDLE. */
TEST_CASE(concurrent_destroy) {
  tdm_device *dev = th_open();
  for (int round = 0; round < 50; round++) {
    struct destroy_race r[2];
    pthread_t t[2];
    tdm_queue *q = new_queue(dev);
    atomic_int ran = 0;
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
    for (int i = 0; i < 2; i++) {
      r[i].q = q;
      atomic_store(&r[i].go, 0);
      r[i].rc = 1;
      CHECK(pthread_create(&t[i], NULL, destroy_thread, &r[i]) == 0);
    }
    atomic_store(&r[0].go, 1);
    atomic_store(&r[1].go, 1);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECK((r[0].rc == 0 && r[1].rc == TDM_EHANDLE) || (r[1].rc == 0 && r[0].rc == TDM_EHANDLE));
    CHECK_EQ(atomic_load(&ran), 1);
  }
  th_close();
}

/* A pointer into the device table that is not an entry's start is not a device. */
TEST_CASE(device_offset) {
  tdm_device *dev = th_open();
  tdm_device *bad = (tdm_device *)((char *)dev + 8);
  tdm_queue *q = SENTINEL_QUEUE;
  tdm_device_info info;
  void *p = SENTINEL_PTR;
  CHECK_RC(tdm_queue_create(bad, 0, &q), TDM_EHANDLE);
  CHECK_RC(tdm_device_info_get(bad, &info), TDM_EHANDLE);
  CHECK_RC(tdm_malloc(bad, TDM_MEM_DEVICE, 64, &p), TDM_EHANDLE);
  CHECK(q == SENTINEL_QUEUE && p == SENTINEL_PTR);
  th_close();
}

/* ---- Pointers outside every allocation, overlaps, empty copies ---------------------------- */

TEST_CASE(outside_allocations) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  tdm_event *eo = SENTINEL_EVENT;
  unsigned char *dv = NULL, host[64];
  memset(host, 7, sizeof host);
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 256, (void **)&dv));
  /* Partly inside: refused on every backend, whichever end it overlaps. */
  CHECK_RC(tdm_memcpy(q, dv - 8, host, 16, TDM_COPY_AUTO, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, host, dv - 8, 16, TDM_COPY_AUTO, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, dv + 250, host, 16, TDM_COPY_AUTO, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memset(q, dv - 4, 0, 8, 0, NULL, &eo), TDM_ERANGE);
  CHECK_RC(tdm_memcpy(q, (void *)(UINTPTR_MAX - 4), host, 16, TDM_COPY_AUTO, 0, NULL, &eo),
           TDM_ERANGE);
  if (strcmp(th_backend_of(dev), "opencl") == 0) {
    /* Device pointers live in a range of their own: outside a live allocation is an error. */
    CHECK_RC(tdm_memcpy(q, dv + 256, host, 8, TDM_COPY_AUTO, 0, NULL, &eo), TDM_EINVAL);
    CHECK_RC(tdm_memset(q, dv + 300, 0, 8, 0, NULL, &eo), TDM_EINVAL);
    unsigned char *gone = NULL;
    CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 64, (void **)&gone));
    CHECK_OK(tdm_free(gone));
    CHECK_RC(tdm_memcpy(q, host, gone, 8, TDM_COPY_AUTO, 0, NULL, &eo), TDM_EINVAL);
    CHECK_RC(tdm_memcpy(q, gone, host, 8, TDM_COPY_H2D, 0, NULL, &eo), TDM_EINVAL);
  }
  CHECK(eo == SENTINEL_EVENT);
  CHECK_OK(tdm_queue_sync(q));
  for (int i = 0; i < 64; i++) CHECK(host[i] == 7);
  CHECK_OK(tdm_free(dv));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(overlap_and_empty) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  tdm_event *eo = SENTINEL_EVENT, *e0 = NULL;
  unsigned char *dv = NULL, *pin = NULL, host[64];
  void *p = SENTINEL_PTR;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 256, (void **)&dv));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 256, (void **)&pin));
  /* Overlapping ranges: one rule on every backend. */
  CHECK_RC(tdm_memcpy(q, dv + 8, dv, 16, TDM_COPY_D2D, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, dv, dv + 8, 16, TDM_COPY_AUTO, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, pin, pin + 4, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EINVAL);
  CHECK_RC(tdm_memcpy(q, host, host, 8, TDM_COPY_H2H, 0, NULL, &eo), TDM_EINVAL);
  CHECK(eo == SENTINEL_EVENT);
  /* Adjacent is fine. */
  CHECK_OK(tdm_memcpy(q, dv + 16, dv, 16, TDM_COPY_D2D, 0, NULL, NULL));
  /* n == 0: a no-op command, NULL pointers accepted. */
  CHECK_OK(tdm_memcpy(q, NULL, NULL, 0, TDM_COPY_AUTO, 0, NULL, &e0));
  CHECK_OK(tdm_event_wait(e0));
  CHECK_OK(tdm_event_release(e0));
  CHECK_OK(tdm_memcpy(q, dv, NULL, 0, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, NULL, 0, 0, 0, NULL, NULL));
  CHECK_RC(tdm_memcpy(q, NULL, NULL, 0, (tdm_copy_dir)9, 0, NULL, &eo), TDM_EINVAL);
  /* More than anything can hold: out of memory on every backend. */
  CHECK_RC(tdm_malloc(dev, TDM_MEM_DEVICE, SIZE_MAX, &p), TDM_ENOMEM);
  CHECK_RC(tdm_malloc(dev, TDM_MEM_PINNED, SIZE_MAX, &p), TDM_ENOMEM);
  CHECK_RC(tdm_malloc(dev, TDM_MEM_HOST, SIZE_MAX, &p), TDM_ENOMEM);
  CHECK(p == SENTINEL_PTR);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_free(dv));
  CHECK_OK(tdm_free(pin));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* tdm_stats_get works before tdm_init and after the last shutdown. */
TEST_CASE(stats_anytime) {
  tdm_stats st;
  memset(&st, 0x5e, sizeof st);
  CHECK_OK(tdm_stats_get(&st));
  CHECK(st.queues == 0 && st.events == 0 && st.allocations == 0 && st.pending == 0);
  th_open();
  th_close();
  memset(&st, 0x5e, sizeof st);
  CHECK_OK(tdm_stats_get(&st));
  CHECK(st.queues == 0 && st.events == 0 && st.allocations == 0 && st.pending == 0);
}

static int task_fail_nomem(void *arg) {
  (void)arg;
  return TDM_ENOMEM;
}

/* A sync names the operation that failed and its command number, and no message repeats its
 * code. */
TEST_CASE(sync_names_failure) {
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev);
  atomic_int ran = 0;
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_fail_nomem, NULL, 0, NULL, NULL));
  CHECK_RC(tdm_queue_sync(q), TDM_ENOMEM);
  const char *msg = tdm_last_error();
  CHECK_MSG(strstr(msg, "host task") && strstr(msg, "#2"), "message: %s", msg);
  CHECK_MSG(strncmp(msg, "TDM_ENOMEM: ", 12) == 0 && !strstr(msg + 12, "TDM_ENOMEM"),
            "message: %s", msg);
  CHECK_OK(tdm_queue_sync(q)); /* cleared */
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

static int task_nop(void *arg) {
  (void)arg;
  return 0;
}

/* Counts whose byte sizes wrap: refused, and nothing cached from them (a later call with a
 * long list on the same thread must not write past what was allocated). */
TEST_CASE(counts_that_wrap) {
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  tdm_event *deps[12];
  for (int i = 0; i < 12; i++) CHECK_OK(tdm_event_record(q, &deps[i]));
  size_t wraps = ((size_t)1 << 61) + 1; /* times 8 bytes wraps to 8 */
  CHECK_RC(tdm_host_task(q, task_nop, NULL, wraps, deps, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_barrier(q, wraps, deps, NULL), TDM_EINVAL);
  CHECK_RC(tdm_queue_barrier(q, SIZE_MAX, deps, NULL), TDM_EINVAL);
  for (int round = 0; round < 3; round++) {
    tdm_event *ev;
    CHECK_OK(tdm_host_task(q, task_nop, NULL, 12, deps, &ev));
    CHECK_OK(tdm_event_wait(ev));
    CHECK_OK(tdm_event_release(ev));
  }
  for (int i = 0; i < 12; i++) CHECK_OK(tdm_event_release(deps[i]));
  /* A registration whose end wraps can never be found or unregistered: refused. */
  void *top = (void *)(UINTPTR_MAX - 4095);
  CHECK_RC(tdm_host_register(dev, top, 8192), TDM_ERANGE);
  CHECK_RC(tdm_host_register(dev, (void *)4096, SIZE_MAX), TDM_ERANGE);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}
