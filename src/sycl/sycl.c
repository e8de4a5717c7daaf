/* sycl.c: the SYCL backend's table (the module libtandem-sycl.so): every device of Intel's DPC++
 * runtime with USM, queues of its own (in-order, or out-of-order on request) or adopted ones,
 * USM memory, and the native handles of events (sy_ev, syrt.h). Commands are in sysubmit.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sy.h"

const tdm__services *sy_svc;
static int sy_ndevs;

static int sycl_init(const tdm__services *svc, int *ndevices) {
  sy_svc = svc;
  int n = 0;
  int rc = sy_init(svc->error, &n);
  if (rc) return rc;
  if (n == 0) {
    sy_fini();
    return svc->error(TDM_ENODEV, 0, "the DPC++ runtime lists no device with USM device and "
                                     "host allocations (Intel's OpenCL CPU runtime is one: "
                                     "OCL_ICD_VENDORS must name a folder with its .icd file)");
  }
  if ((rc = sy_notices_start())) {
    sy_fini();
    return rc;
  }
  sy_ndevs = n;
  *ndevices = n;
  return 0;
}

static void sycl_shutdown(void) {
  sy_notices_stop();
  sy_fini();
  sy_ndevs = 0;
}

static int sycl_device_info(int bdev, tdm_device_info *info) {
  sy_device_desc d;
  sy_device_describe(bdev, &d);
  memset(info, 0, sizeof *info);
  snprintf(info->name, sizeof info->name, "%s", d.name);
  info->total_memory = d.memory;
  info->caps = TDM_DEVICE_CAP_TIMING | TDM_DEVICE_CAP_ADOPT | TDM_DEVICE_CAP_OUT_OF_ORDER |
               (d.gpu ? TDM_DEVICE_CAP_GPU : 0) | (d.cpu ? TDM_DEVICE_CAP_HOST_MEMORY : 0);
  return 0;
}

static int sycl_queue_create(int bdev, unsigned flags, void *adopt, tdm__bqueue **out) {
  tdm__bqueue *bq = calloc(1, sizeof *bq);
  if (!bq) return sy_svc->error(TDM_ENOMEM, 0, "no memory for a SYCL queue");
  bq->bdev = bdev;
  bq->ooo = (flags & TDM_QUEUE_OUT_OF_ORDER) != 0;
  int rc = sy_queue_new(bdev, bq->ooo, (flags & TDM_QUEUE_TIMING) != 0, adopt, &bq->q);
  if (rc) {
    free(bq);
    return rc;
  }
  *out = bq;
  return 0;
}

static void sycl_queue_destroy(tdm__bqueue *bq) {
  sy_queue_free(bq->q);
  free(bq);
}

static int sycl_queue_native(tdm__bqueue *bq, void **native) {
  *native = sy_queue_native(bq->q);
  return 0;
}

static int sycl_device_native(int bdev, void **native) {
  *native = sy_device_context(bdev);
  return 0;
}

/* ---- memory: USM ---- */

static int usm_kind(tdm_mem_kind kind) {
  return kind == TDM_MEM_DEVICE ? 1 : kind == TDM_MEM_PINNED ? 2 : 3;
}

static int sycl_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm) {
  (void)bm; /* a USM pointer is its own handle */
  return sy_alloc(bdev, usm_kind(kind), size, ptr);
}

static void sycl_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm) {
  if (bm->flags & TDM__BMEM_IMPORTED) return; /* the caller's USM: only forgotten */
  sy_free(bdev, usm_kind(kind), ptr);
}

static int sycl_mem_native(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                           size_t *offset) {
  (void)bdev;
  (void)bm;
  *native = base;
  *offset = (size_t)((char *)ptr - (char *)base);
  return 0;
}

/* Foreign USM (a dpnp array's, say) is used in place: the pointer is tandem's pointer. */
static int sycl_mem_import(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm) {
  (void)size;
  (void)bm;
  int rc = sy_usm_check(bdev, native);
  if (rc) return rc;
  *ptr = native;
  return 0;
}

/* ---- native handles ---- */

static int sycl_native_wait(void *handle, int *native) { return sy_ev_wait(handle, native); }
static void sycl_native_release(void *handle) { sy_ev_release(handle); }
static void *sycl_native_export(void *handle) { return sy_ev_native(handle); }

/* A gate is opened once, and its reference for the opening goes with it. */
static void sycl_gate_open(void *gate) {
  sy_gate_open(gate);
  sy_ev_release(gate);
}

/* The caller's sycl::event is copied: the tandem event keeps one reference, the wait the other. */
static int sycl_event_import(int bdev, void *native, void **handle) {
  sy_ev *e;
  int rc = sy_ev_import(bdev, native, &e);
  if (rc) return rc;
  sy_ev_retain(e);
  *handle = e;
  return 0;
}

/* Lazy completion of in-order queues: a command nobody watches completes on the submitting
 * thread once a later one is seen complete (an in-order queue runs them in order). The runtime
 * reports asynchronous failures through the queue's asynchronous handler rather than through
 * the event's status, so the executor's wait (sy_ev_wait) would learn little more. Without it,
 * the executor woke for every batch of commands and waited for each, competing with the
 * submitting thread and the device's own threads (record 1.8x the raw barrier on the CPU
 * device). */
static int sycl_native_done(void *handle) { return sy_ev_complete(handle); }

static int sycl_event_elapsed(void *start, void *end, double *ms) {
  return sy_ev_elapsed(start, end, ms);
}

const tdm__backend tdm__sycl_backend = {
    .abi_version = TDM__BACKEND_ABI,
    .name = "sycl",
    .init = sycl_init,
    .shutdown = sycl_shutdown,
    .device_info = sycl_device_info,
    .queue_create = sycl_queue_create,
    .queue_destroy = sycl_queue_destroy,
    .queue_native = sycl_queue_native,
    .submit = sy_submit,
    .mem_alloc = sycl_mem_alloc,
    .mem_free = sycl_mem_free,
    .device_native = sycl_device_native,
    .mem_native = sycl_mem_native,
    .mem_import = sycl_mem_import,
    .event_import = sycl_event_import,
    .native_export = sycl_native_export,
    .native_wait = sycl_native_wait,
    .native_notify = sy_native_notify,
    .native_release = sycl_native_release,
    .gate_open = sycl_gate_open,
    /* A SYCL queue runs its commands without the executor's help (the runtime's own threads
     * submit and complete them): the executor is woken only for host work and waiters. */
    .wake_lazily = true,
    .native_done = sycl_native_done,
    .event_elapsed = sycl_event_elapsed,
    .queue_wait_now = sy_queue_wait_now,
};

__attribute__((visibility("default"))) const void *tdm_backend_module(void) {
  return &tdm__sycl_backend;
}
