/* conformance.h: what the conformance suite's programs (tests/test-conf-*.c) share.
 *
 * The conformance suite runs unchanged against every backend's devices; it is split by area,
 * one program per file, and tests/CMakeLists.txt registers every file's cases under the one
 * suite name, conformance.<backend>.<case>.
 *
 * Written only against the public API: device memory is read only through copies into pinned
 * memory, never by dereferencing a device pointer, so GPU backends run it as is. Cases that
 * need a backend's native queue type (external work, adoption) know only the CPU backend's and
 * are skipped (77) elsewhere. Each case is its own process (see harness.h), so cases that set
 * environment options do it before th_open().
 *
 * No case passes or fails on a timing: where work must still be pending at a check, it is held
 * back by a gate that only the test opens; sleeps only make a wrong order more likely to show.
 */
#ifndef TANDEM_TESTS_CONFORMANCE_H
#define TANDEM_TESTS_CONFORMANCE_H

#include "harness.h"

TH_HELPER int has_cap(tdm_device *dev, unsigned cap) {
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  return (info.caps & cap) != 0;
}

TH_HELPER void require_ooo(tdm_device *dev) {
  if (!has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER))
    TH_SKIP("%s has no out-of-order queues", th_device_id);
}

TH_HELPER tdm_queue *new_queue(tdm_device *dev, unsigned flags) {
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, flags, &q));
  CHECK(q != NULL);
  return q;
}

TH_HELPER void *dev_alloc(tdm_device *dev, tdm_mem_kind kind, size_t n) {
  void *p = NULL;
  CHECK_OK(tdm_malloc(dev, kind, n, &p));
  CHECK(p != NULL);
  return p;
}

TH_HELPER void wait_ok(tdm_event *ev) {
  CHECK_OK(tdm_event_wait(ev));
  CHECK_OK(tdm_event_release(ev));
}

/* Reads n bytes of device memory through a D2H copy into `pinned` and a sync. */
TH_HELPER void read_device(tdm_queue *q, void *pinned, const void *dsrc, size_t n) {
  CHECK_OK(tdm_memcpy(q, pinned, dsrc, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
}

/* A host task that bumps a counter. */
TH_HELPER int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

/* A host task that waits (bounded) for a gate; returns TDM_ETASK-worthy 1 if it never opened. */
TH_HELPER int task_wait_gate(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : 1; }

TH_HELPER int task_fail_einval(void *arg) {
  (void)arg;
  return TDM_EINVAL;
}

TH_HELPER int task_return_positive(void *arg) {
  (void)arg;
  return 7;
}

/* A host task held back by a gate that marks itself done (flag_task.done), and one that
 * records whether that task was done when it ran (flag_task.saw). */
struct flag_task {
  th_gate *gate;
  atomic_int done;
  atomic_int saw;
};

TH_HELPER int task_gate_then_done(void *arg) {
  struct flag_task *f = arg;
  int ok = th_gate_wait(f->gate, TH_HANG_MS);
  atomic_store(&f->done, 1);
  return ok ? 0 : 1;
}

TH_HELPER int task_record_done(void *arg) {
  struct flag_task *f = arg;
  atomic_store(&f->saw, atomic_load(&f->done));
  return 0;
}

TH_HELPER void release_all(tdm_event **evs, size_t n) {
  for (size_t i = 0; i < n; i++) CHECK_OK(tdm_event_release(evs[i]));
}

#endif /* TANDEM_TESTS_CONFORMANCE_H */
