/* import.c: native events that other code made (a CuPy, PyTorch or pyopencl event), imported
 * as tandem events (tdm_event_import).
 *
 * The backend turns the native event into one of its handles (event_import); the core then
 * gives it a tandem event through the ordinary submission path, on a queue of the device
 * that exists only for this: out of order, with no backend queue and no executor. The command
 * is a barrier without dependencies whose native handle is the import's, so it takes the same
 * road as any native command of an out-of-order queue: the driver's notification
 * (native_notify) puts it on the thread pool's ready list, a pool thread reads its status and
 * completes the event. No thread waits per import, and one import never waits behind another.
 * The handle is also attached to the event, so queues of the same backend wait for it
 * natively; the others bridge to it through the event's completion, as for any event. */
#include "internal.h"

/* The device's import queue, made on first use; a thread that loses the race to make it
 * frees its own. */
static int import_queue(tdm_device *dev, tdm__queue **out) {
  tdm__queue *q = atomic_load_explicit(&dev->imports, memory_order_acquire);
  if (q) {
    *out = q;
    return 0;
  }
  tdm__queue *made;
  int rc = tdm__queue_create_imports(dev, &made);
  if (rc) return rc;
  if (!atomic_compare_exchange_strong(&dev->imports, &q, made)) {
    tdm__queue_destroy_imports(made);
    made = q;
  }
  *out = made;
  return 0;
}

int tdm_event_import(tdm_device *dev, void *native, tdm_event **out) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!native || !out) return tdm__error(TDM_EINVAL, 0, "tdm_event_import: NULL argument");
  /* Refused before the import queue is made, for a device that cannot import. */
  if (!tdm__b_can_import(dev))
    return tdm__error(TDM_ENOTSUP, 0, "%s cannot import native events", dev->info.id);
  tdm__queue *q;
  if ((rc = import_queue(dev, &q))) return rc;
  void *handle = NULL;
  rc = tdm__b_event_import(dev, native, &handle);
  if (rc)
    return tdm__error(rc, tdm_last_native_error(), "importing a native event on %s: %s",
                      dev->info.id, tdm__last_detail());
  tdm__spec s = {.kind = TDM__CMD_BARRIER, .op = "import", .untracked = true, .native = handle};
  if ((rc = tdm__submit(q, &s, 0, NULL, NULL, out))) {
    tdm__b_native_release(dev, handle);
    tdm__b_native_release(dev, handle);
  }
  return rc;
}

void tdm__imports_stop(void) {
  for (int i = 0; i < tdm__g.ndevices; i++) {
    tdm__queue *q = atomic_exchange(&tdm__g.devices[i].imports, NULL);
    if (q) tdm__queue_destroy_imports(q);
  }
}
