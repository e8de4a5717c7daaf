/* test-interop.c: what tandem promises code built on it. Libraries layered on tandem (its own
 * MoE library among them) report through tandem's message (tdm_set_error) and reach its fault
 * hook (tdm_fault_point). Programs that enqueue their own native work on tandem's queues
 * (tandem/opencl.h, tandem/cuda.h) see whether commands behind a host task wait in tandem
 * (TDM_DEVICE_CAP_HOST_DEFERRAL) or on the native queue, as the device's capability says,
 * through the public calls tandem/opencl.h tells them to use (tdm_event_native,
 * tdm_queue_dependencies); OpenCL runs under both of PoCL's CPU drivers (basic defers, pthread
 * does not).
 */
#include "harness.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

/* A layered library's message is tandem's: the same words, code name and native code, and it
 * may quote the message it replaces. */
TEST_CASE(set_error_is_the_message) {
  th_open();
  CHECK_EQ(tdm_set_error(TDM_EINVAL, 42, "layered %s %d", "call", 7), TDM_EINVAL);
  CHECK(strcmp(tdm_last_error(), "TDM_EINVAL: layered call 7 (native error 42)") == 0);
  CHECK_EQ(tdm_last_native_error(), 42);
  CHECK_EQ(tdm_set_error(TDM_EBACKEND, 0, "outer: %s", tdm_last_error()), TDM_EBACKEND);
  CHECK_MSG(strcmp(tdm_last_error(),
                   "TDM_EBACKEND: outer: TDM_EINVAL: layered call 7 (native error 42)") == 0,
            "%s", tdm_last_error());
  CHECK_EQ(tdm_last_native_error(), 0);
  th_close();
}

/* tdm_fault_point counts with tandem's own operations of its kind, fires once, and says so. */
TEST_CASE(fault_point_fires_once) {
  th_open();
  CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC, 1, 0));
  CHECK_EQ(tdm_fault_point(TDM_FAULT_BACKEND), 0); /* another kind: not counted */
  CHECK_EQ(tdm_fault_point(TDM_FAULT_ALLOC), 0);
  CHECK(!tdm_fault_fired());
  CHECK_EQ(tdm_fault_point(TDM_FAULT_ALLOC), TDM_ENOMEM);
  CHECK(tdm_fault_fired());
  CHECK(strstr(tdm_last_error(), "injected") != NULL);
  CHECK_EQ(tdm_fault_point(TDM_FAULT_ALLOC), 0);
  CHECK_OK(tdm_fault_inject(TDM_FAULT_BACKEND, 0, TDM_EDEVLOST));
  CHECK_EQ(tdm_fault_point(TDM_FAULT_BACKEND), TDM_EDEVLOST);
  CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC, -1, 0));
  th_close();
}

/* Holds its queue until *arg is set (10 s at most, so a broken test cannot hang). */
static int hold_until_set(void *arg) {
  atomic_int *go = arg;
  struct timespec nap = {0, 1000000};
  for (int i = 0; i < 10000 && !atomic_load(go); i++) nanosleep(&nap, NULL);
  return 0;
}

/* A copy queued behind a host task that has not run: with the capability, it waits in tandem
 * and has no native event (and the queue's dependencies show an incomplete event without
 * one); without it, it is on the native queue already, with its native event. */
TEST_CASE(held_commands_match_the_cap) {
  tdm_device *dev = th_open();
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  if (info.caps & TDM_DEVICE_CAP_HOST_MEMORY)
    TH_SKIP("%s runs every command on the host: it has no native queue to share", info.id);
  bool defer = (info.caps & TDM_DEVICE_CAP_HOST_DEFERRAL) != 0;
  printf("%s: host deferral %s\n", info.id, defer ? "on" : "off");
  enum { N = 4096 };
  tdm_queue *q;
  void *dbuf, *hbuf;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, N, &dbuf));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, N, &hbuf));
  memset(hbuf, 7, N);
  atomic_int go = 0;
  tdm_event *copied;
  CHECK_OK(tdm_host_task(q, hold_until_set, &go, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, dbuf, hbuf, N, TDM_COPY_H2D, 0, NULL, &copied));

  void *native = NULL;
  int rc = tdm_event_native(copied, &native);
  CHECK_MSG(defer ? rc != 0 : rc == 0, "tdm_event_native of a copy behind a pending host "
            "task: %s (host deferral %s)", tdm_err_name(rc), defer ? "on" : "off");
  tdm_event *deps[8];
  size_t n = 0;
  bool held = false;
  CHECK_OK(tdm_queue_dependencies(q, deps, 8, &n));
  for (size_t i = 0; i < n; i++) {
    if (tdm_event_query(deps[i]) == TDM_EAGAIN && tdm_event_native(deps[i], &native) != 0)
      held = true;
    CHECK_OK(tdm_event_release(deps[i]));
  }
  CHECK_MSG(held == defer, "held work seen: %d, host deferral: %d", held, defer);

  atomic_store(&go, 1);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_query(copied));
  CHECK_OK(tdm_event_release(copied));
  CHECK_OK(tdm_free(dbuf));
  CHECK_OK(tdm_free(hbuf));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}
