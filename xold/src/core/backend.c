/* backend.c: the one gateway to the backend table. Every call the core makes into a backend
 * goes through one wrapper here, tdm__b_<entry>, as SQLite's os.c does for its VFS. A wrapper:
 * - checks an optional entry for NULL and falls back, or fails with TDM_ENOTSUP and a message;
 * - passes tdm__fault() first, so a test can make that call fail (TDM_FAULT_BACKEND for calls
 *   a public call makes on its caller's thread; TDM_FAULT_NATIVE for those tandem's threads
 *   make once a submission has returned, which fail a command rather than a call);
 * - marks the device lost when the backend says TDM_EDEVLOST (tdm__device_note).
 * Wrappers for entries that cannot fail (void ones, native_export) only dispatch.
 * No other file of the core reaches into the table (the test suite's core.cpu.gateway check greps
 * for it). The wrappers on the submission and completion paths add one relaxed atomic load
 * (the fault check) and nothing else: no lock, no allocation. */
#include <string.h>

#include "internal.h"

/* The injected fault if one is due, else the call's own result; either way noted against dev
 * (which may be NULL at init, before a device exists). */
#define BCALL(dev, kind, expr)                                                   \
  (tdm__fault(kind) ? tdm__device_note((dev), tdm__fault_code_taken())          \
                    : tdm__device_note((dev), (expr)))

/* ---- life ---- */

int tdm__b_check_version(const tdm__backend *be, unsigned *version) {
  *version = be->abi_version;
  return be->abi_version == TDM__BACKEND_ABI ? 0 : TDM_EVERSION;
}

const char *tdm__b_name(const tdm__backend *be) { return be->name; }

int tdm__b_init(const tdm__backend *be, int *ndevices) {
  return BCALL(NULL, TDM_FAULT_BACKEND, be->init(&tdm__g.svc, ndevices));
}

void tdm__b_shutdown(const tdm__backend *be) { be->shutdown(); }

int tdm__b_device_info(tdm_device *dev) {
  return BCALL(NULL, TDM_FAULT_BACKEND, dev->be->device_info(dev->bindex, &dev->info));
}

int tdm__b_address_range(tdm_device *dev) {
  dev->range_base = dev->range_end = 0;
  if (!dev->be->address_range) return 0; /* no range of its own: nothing to refuse */
  uintptr_t base = 0;
  size_t size = 0;
  int rc = BCALL(NULL, TDM_FAULT_BACKEND, dev->be->address_range(dev->bindex, &base, &size));
  if (rc == 0 && size) {
    dev->range_base = base;
    dev->range_end = base + size;
  }
  return rc;
}

/* ---- queues ---- */

int tdm__b_queue_create(tdm__queue *q, void *adopt) {
  tdm_device *dev = q->dev;
  return BCALL(dev, TDM_FAULT_BACKEND,
               dev->be->queue_create(dev->bindex, q->flags, adopt, &q->bq));
}

void tdm__b_queue_destroy(tdm__queue *q) {
  q->dev->be->queue_destroy(q->bq);
  q->bq = NULL;
}

int tdm__b_queue_native(tdm__queue *q, void **native) {
  const tdm__backend *be = q->dev->be;
  if (!be->queue_native)
    return tdm__error(TDM_ENOTSUP, 0, "%s backend has no native queues", be->name);
  return BCALL(q->dev, TDM_FAULT_BACKEND, be->queue_native(q->bq, native));
}

int tdm__b_submit(tdm__queue *q, tdm__cmd *cmd) {
  return BCALL(q->dev, TDM_FAULT_BACKEND, q->dev->be->submit(q->bq, cmd));
}

int tdm__b_queue_wait_now(tdm__queue *q, tdm__event *ev) {
  if (!q->dev->be->queue_wait_now) return 1; /* the wait command does it */
  return BCALL(q->dev, TDM_FAULT_BACKEND, q->dev->be->queue_wait_now(q->bq, ev));
}

/* ---- memory ---- */

int tdm__b_mem_alloc(tdm_device *dev, tdm_mem_kind kind, size_t size, void **ptr,
                     tdm__bmem *bm) {
  memset(bm, 0, sizeof *bm);
  return BCALL(dev, TDM_FAULT_BACKEND, dev->be->mem_alloc(dev->bindex, kind, size, ptr, bm));
}

void tdm__b_mem_free(tdm_device *dev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm) {
  dev->be->mem_free(dev->bindex, kind, ptr, bm);
}

int tdm__b_host_register(tdm_device *dev, void *ptr, size_t size) {
  if (!dev->be->host_register) return 0; /* registration is the registry's entry only */
  return BCALL(dev, TDM_FAULT_BACKEND, dev->be->host_register(dev->bindex, ptr, size));
}

void tdm__b_host_unregister(tdm_device *dev, void *ptr) {
  if (dev->be->host_unregister) dev->be->host_unregister(dev->bindex, ptr);
}

int tdm__b_device_native(tdm_device *dev, void **native) {
  if (!dev->be->device_native)
    return tdm__error(TDM_ENOTSUP, 0, "%s has no native device handle", dev->info.id);
  return BCALL(dev, TDM_FAULT_BACKEND, dev->be->device_native(dev->bindex, native));
}

int tdm__b_mem_native(const tdm__alloc *a, const void *ptr, void **native, size_t *offset) {
  tdm_device *dev = a->dev;
  if (!dev->be->mem_native)
    return tdm__error(TDM_ENOTSUP, 0, "%s memory has no native object", dev->info.id);
  return BCALL(dev, TDM_FAULT_BACKEND,
               dev->be->mem_native(dev->bindex, (void *)a->base, (void *)ptr, &a->bm, native,
                                   offset));
}

int tdm__b_mem_import(tdm_device *dev, void *native, size_t size, void **ptr, tdm__bmem *bm) {
  if (!dev->be->mem_import)
    return tdm__error(TDM_ENOTSUP, 0, "%s cannot import foreign memory", dev->info.id);
  memset(bm, 0, sizeof *bm);
  int rc = BCALL(dev, TDM_FAULT_BACKEND, dev->be->mem_import(dev->bindex, native, size, ptr, bm));
  if (rc == 0) bm->flags |= TDM__BMEM_IMPORTED;
  return rc;
}

/* ---- events and native handles ---- */

int tdm__b_event_import(tdm_device *dev, void *native, void **handle) {
  if (!dev->be->event_import || !dev->be->native_notify)
    return tdm__error(TDM_ENOTSUP, 0, "%s cannot import native events", dev->info.id);
  return BCALL(dev, TDM_FAULT_BACKEND, dev->be->event_import(dev->bindex, native, handle));
}

void *tdm__b_native_export(const tdm_device *dev, void *handle) {
  return dev->be->native_export ? dev->be->native_export(handle) : handle;
}

/* Falls back to the host clock's completion times where either event has no native event or
 * the backend times none. */
int tdm__b_event_elapsed(const tdm__event *start, const tdm__event *end, double *ms) {
  tdm_device *dev = start->q->dev;
  void *a = atomic_load(&start->bev), *b = atomic_load(&end->bev);
  if (dev->be->event_elapsed && a && b)
    return BCALL(dev, TDM_FAULT_BACKEND, dev->be->event_elapsed(a, b, ms));
  *ms = ((double)end->t_ns - (double)start->t_ns) / 1e6;
  return 0;
}

bool tdm__b_is_native(const tdm_device *dev) { return dev->be->native_wait != NULL; }
bool tdm__b_wakes_lazily(const tdm_device *dev) { return dev->be->wake_lazily; }
bool tdm__b_can_flush(const tdm_device *dev) { return dev->be->native_flush != NULL; }
bool tdm__b_can_query(const tdm_device *dev) { return dev->be->native_done != NULL; }
/* Not a fallible step either: "cannot say" is a valid answer, after which the executor waits
 * with native_wait, where faults are injected. */
int tdm__b_native_done(const tdm_device *dev, void *handle) {
  return dev->be->native_done ? dev->be->native_done(handle) : 0;
}
bool tdm__b_can_notify(const tdm_device *dev) { return dev->be->native_notify != NULL; }
bool tdm__b_can_import(const tdm_device *dev) {
  return dev->be->event_import && dev->be->native_notify;
}

/* The real wait always happens, so an injected fault reports a failure of work that has
 * finished (as a device error found at completion would), never one still running: memory a
 * failed command used may be reused at once. */
int tdm__b_native_wait(tdm_device *dev, void *handle, int *native) {
  int rc = dev->be->native_wait(handle, native);
  if (tdm__fault(TDM_FAULT_NATIVE) && rc == 0) {
    rc = tdm__fault_code_taken();
    *native = 0;
  }
  return tdm__device_note(dev, rc);
}

/* Not a fallible step: declining (nonzero) is a valid answer, after which a pool thread waits
 * with native_wait, so there is nothing for a fault to fail. */
int tdm__b_native_notify(tdm_device *dev, void *handle, void (*fn)(void *), void *arg) {
  return dev->be->native_notify ? dev->be->native_notify(handle, fn, arg) : 1;
}

void tdm__b_native_release(const tdm_device *dev, void *handle) {
  dev->be->native_release(handle);
}

void tdm__b_gate_open(const tdm_device *dev, void *gate) { dev->be->gate_open(gate); }

int tdm__b_native_flush(tdm__queue *q, void **handle) {
  if (!q->dev->be->native_flush) /* the executor holds commands back only when it has one */
    return tdm__error(TDM_ENOTSUP, 0, "%s cannot flush its native queue", q->dev->info.id);
  return BCALL(q->dev, TDM_FAULT_NATIVE, q->dev->be->native_flush(q->bq, handle));
}

int tdm__b_host_copy(tdm_device *dev, tdm__cmd *cmd) {
  if (!dev->be->host_copy) {
    if (cmd->u.copy.n) memmove(cmd->u.copy.dst, cmd->u.copy.src, cmd->u.copy.n);
    return 0;
  }
  return BCALL(dev, TDM_FAULT_NATIVE, dev->be->host_copy(cmd));
}

