/* cuda.c: the CUDA backend's table (the module libtandem-cuda.so): devices, queues (owned
 * non-blocking streams, or adopted ones), recycled events, gates, error mapping, and the
 * current-device discipline (every entry saves and restores the caller's device). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cu.h"

const tdm__services *cu_svc;
cu_device *cu_devs;
int cu_ndevs;

static bool sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorDevicesUnavailable: return true;
    default: return false;
  }
}

int cu_error(cudaError_t err, const char *what) {
  int code;
  if (sticky(err))
    code = TDM_EDEVLOST;
  else if (err == cudaErrorMemoryAllocation)
    code = TDM_ENOMEM;
  else if (err == cudaErrorInvalidValue || err == cudaErrorInvalidResourceHandle ||
           err == cudaErrorInvalidDevicePointer)
    code = TDM_EINVAL;
  else if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
    code = TDM_ENODEV;
  else if (err == cudaErrorNotSupported)
    code = TDM_ENOTSUP;
  else if (err == cudaErrorStreamCaptureUnsupported || err == cudaErrorStreamCaptureInvalidated)
    code = TDM_ESTATE;
  else
    code = TDM_EBACKEND;
  return cu_svc->error(code, (int)err, "%s: %s (%s)", what, cudaGetErrorString(err),
                       cudaGetErrorName(err));
}

/* When dev is current already, nothing will need restoring: *saved is -1, and cu_leave then
 * makes no call at all (one cudaGetDevice less on every submission of a program that keeps
 * its own device current). Nothing between the two calls changes the current device. */
int cu_enter(int dev, int *saved) {
  if (cudaGetDevice(saved) != cudaSuccess) *saved = -1;
  if (*saved == cu_devs[dev].ordinal) {
    *saved = -1;
    return 0;
  }
  cudaError_t e = cudaSetDevice(cu_devs[dev].ordinal);
  return e == cudaSuccess ? 0 : cu_error(e, "cudaSetDevice");
}

void cu_leave(int saved) {
  int now;
  if (saved >= 0 && cudaGetDevice(&now) == cudaSuccess && now != saved) cudaSetDevice(saved);
}

/* ---- events: recycled per device, timing only where asked ---- */

/* A free list per device without a lock: a queue takes events from a list of its own (touched
 * only under its submission lock) and refills it, all at once, from the device's stack, onto
 * which whoever drops an event's last reference pushes it. Popping the whole stack at once
 * leaves no ABA hazard; the thread completing events writes no line the submitting thread
 * reads on every record. */
static void ev_push(cu_event *ev) { tdm__lfstack_push(&cu_devs[ev->dev].ev_returned, ev); }

/* TANDEM_CUDA_BLOCKING_SYNC, read at init. */
static bool cu_blocking_sync;

cu_event *cu_event_take(cu_event **local, int dev, bool timed) {
  cu_event *ev = NULL;
  if (!timed) {
    if (!*local) *local = tdm__lfstack_take(&cu_devs[dev].ev_returned);
    if ((ev = *local)) *local = ev->next;
  }
  if (!ev) {
    ev = calloc(1, sizeof *ev);
    if (!ev) return NULL;
    /* By default no cudaEventBlockingSync: the executor waits with the device's scheduling
     * policy (it spins while there are spare cores), which keeps host-task round trips short.
     * TANDEM_CUDA_BLOCKING_SYNC=1 makes it sleep instead, for programs whose own threads want
     * every core (a spinning executor takes one from them for as long as it waits). */
    unsigned flags = timed ? cudaEventDefault : cudaEventDisableTiming;
    if (cu_blocking_sync) flags |= cudaEventBlockingSync;
    /* An event belongs to the device current when it is made; the callers (submissions among
     * them) need not make dev current for anything else. */
    int saved;
    if (cu_enter(dev, &saved)) {
      free(ev);
      return NULL;
    }
    cudaError_t e = cudaEventCreateWithFlags(&ev->e, flags);
    cu_leave(saved);
    if (e != cudaSuccess) {
      free(ev);
      return NULL;
    }
    ev->dev = dev;
    ev->timed = timed;
  }
  ev->imported = false;
  atomic_store_explicit(&ev->refs, 1, memory_order_relaxed);
  return ev;
}

cu_event *cu_event_get(tdm__bqueue *bq) { return cu_event_take(&bq->ev_local, bq->bdev, bq->timed); }

void cu_event_put(cu_event *ev) {
  /* The only reference left (the usual case: a command's wait borrows its event's) needs no
   * read-modify-write: with one holder, nobody else can take or drop one. The acquire pairs
   * with the decrement of a holder that let go before. */
  if (atomic_load_explicit(&ev->refs, memory_order_acquire) != 1 &&
      atomic_fetch_sub(&ev->refs, 1) != 1)
    return;
  if (ev->timed) {
    /* Timed events are rare (timing queues): not recycled. cudaEventDestroy does not block. */
    cudaEventDestroy(ev->e);
    free(ev);
    return;
  }
  ev_push(ev);
}

/* ---- gates ---- */

cu_gate *cu_gate_get(int dev) {
  cu_device *d = &cu_devs[dev];
  pthread_mutex_lock(&d->gate_mu);
  cu_gate *g = NULL;
  if (d->ngate_free) {
    int slot = d->gate_free[--d->ngate_free];
    g = &d->gates[slot];
    g->dev = dev;
    g->slot = slot;
    g->target = d->gate_val[slot] + 1; /* values only grow, so a slot is reusable at once */
    g->open = false;
  }
  pthread_mutex_unlock(&d->gate_mu);
  return g;
}

/* Fallback without stream memory operations: a host function that blocks the stream. */
static void CUDART_CB gate_block(void *arg) {
  cu_gate *g = arg;
  cu_device *d = &cu_devs[g->dev];
  pthread_mutex_lock(&d->gate_mu);
  while (!g->open) pthread_cond_wait(&d->gate_cv, &d->gate_mu);
  d->gate_free[d->ngate_free++] = g->slot;
  pthread_mutex_unlock(&d->gate_mu);
}

/* Made with the gate's device current: a driver-API call, off the hot path (host work only). */
int cu_gate_enqueue(cu_gate *g, cudaStream_t s) {
  cu_device *d = &cu_devs[g->dev];
  int saved, rc = cu_enter(g->dev, &saved);
  if (rc) return rc;
  if (d->wait_value) {
    CUresult r = cuStreamWaitValue32((CUstream)s, d->gate_dev + (CUdeviceptr)(g->slot * 4),
                                     g->target, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS)
      rc = cu_svc->error(TDM_EBACKEND, (int)r, "cuStreamWaitValue32 failed (%d)", (int)r);
  } else {
    cudaError_t e = cudaLaunchHostFunc(s, gate_block, g);
    if (e != cudaSuccess) rc = cu_error(e, "cudaLaunchHostFunc");
  }
  cu_leave(saved);
  return rc;
}

void cu_gate_open(cu_gate *g) {
  cu_device *d = &cu_devs[g->dev];
  pthread_mutex_lock(&d->gate_mu);
  if (d->wait_value) {
    __atomic_store_n(&d->gate_host[g->slot], g->target, __ATOMIC_RELEASE);
    d->gate_val[g->slot] = g->target;
    d->gate_free[d->ngate_free++] = g->slot;
  } else {
    g->open = true; /* the host function frees the slot */
    d->gate_val[g->slot] = g->target;
    pthread_cond_broadcast(&d->gate_cv);
  }
  pthread_mutex_unlock(&d->gate_mu);
}

/* ---- devices ---- */

static int init_device(cu_device *d, int ordinal) {
  memset(d, 0, sizeof *d);
  d->ordinal = ordinal;
  struct cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, ordinal);
  if (e != cudaSuccess) return cu_error(e, "cudaGetDeviceProperties");
  snprintf(d->name, sizeof d->name, "%.*s", (int)sizeof d->name - 1, p.name);
  d->memory = p.totalGlobalMem;
  pthread_mutex_init(&d->gate_mu, NULL);
  pthread_cond_init(&d->gate_cv, NULL);
  pthread_mutex_init(&d->stage_mu, NULL);
  pthread_mutex_init(&d->imp_mu, NULL);
  if ((e = cudaSetDevice(ordinal)) != cudaSuccess) return cu_error(e, "cudaSetDevice");
  if ((e = cudaStreamCreateWithFlags(&d->internal, cudaStreamNonBlocking)) != cudaSuccess)
    return cu_error(e, "cudaStreamCreateWithFlags");
  /* Gate words: mapped pinned memory the GPU polls and the host writes. */
  void *host;
  if ((e = cudaHostAlloc(&host, CU_GATES * 4, cudaHostAllocMapped | cudaHostAllocPortable)) !=
      cudaSuccess)
    return cu_error(e, "cudaHostAlloc for gates");
  memset(host, 0, CU_GATES * 4);
  d->gate_host = host;
  void *devp;
  if ((e = cudaHostGetDevicePointer(&devp, host, 0)) != cudaSuccess)
    return cu_error(e, "cudaHostGetDevicePointer");
  d->gate_dev = (CUdeviceptr)devp;
  for (int i = 0; i < CU_GATES; i++) d->gate_free[i] = CU_GATES - 1 - i;
  d->ngate_free = CU_GATES;
  /* 32-bit waits are part of the memory-operation API on current drivers; probe it once. */
  cu_gate *g = cu_gate_get((int)(d - cu_devs));
  d->wait_value = true;
  CUresult r = cuStreamWaitValue32((CUstream)d->internal, d->gate_dev + (CUdeviceptr)(g->slot * 4),
                                   0, CU_STREAM_WAIT_VALUE_GEQ);
  d->wait_value = r == CUDA_SUCCESS;
  cudaStreamSynchronize(d->internal);
  d->gate_free[d->ngate_free++] = g->slot;
  return cu_mem_init(d);
}

static int cuda_init(const tdm__services *svc, int *ndevices) {
  cu_svc = svc;
  cu_blocking_sync = svc->option_long("TANDEM_CUDA_BLOCKING_SYNC", 0) == 1;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return svc->error(TDM_ENODEV, (int)e, "no CUDA device (%s)",
                      e == cudaSuccess ? "none found" : cudaGetErrorString(e));
  }
  int saved;
  if (cudaGetDevice(&saved) != cudaSuccess) saved = -1;
  cu_devs = calloc((size_t)n, sizeof *cu_devs);
  if (!cu_devs) return svc->error(TDM_ENOMEM, 0, "no memory");
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    rc = init_device(&cu_devs[i], i);
    if (!rc) cu_ndevs++;
  }
  /* Peer access, explicitly, between every pair that supports it: device i may read and
   * write device j's memory, including what j's stream-ordered pool hands out (pool memory is
   * mapped only where the pool grants access, whatever cudaDeviceEnablePeerAccess says). */
  for (int i = 0; i < cu_ndevs; i++)
    for (int j = 0; j < cu_ndevs; j++) {
      int can = 0;
      if (i != j && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess && can) {
        cudaSetDevice(i);
        if (cudaDeviceEnablePeerAccess(j, 0) != cudaSuccess) cudaGetLastError();
        cudaMemPool_t pool;
        struct cudaMemAccessDesc acc = {.location = {.type = cudaMemLocationTypeDevice, .id = i},
                                 .flags = cudaMemAccessFlagsProtReadWrite};
        if (cudaDeviceGetDefaultMemPool(&pool, j) != cudaSuccess ||
            cudaMemPoolSetAccess(pool, &acc, 1) != cudaSuccess)
          cudaGetLastError();
      }
    }
  if (saved >= 0) cudaSetDevice(saved);
  if (cu_ndevs == 0) return rc ? rc : svc->error(TDM_ENODEV, 0, "no usable CUDA device");
  *ndevices = cu_ndevs;
  return 0;
}

static void cuda_shutdown(void) {
  cu_memcpy_team_stop();
  for (int i = 0; i < cu_ndevs; i++) {
    cu_device *d = &cu_devs[i];
    cudaSetDevice(d->ordinal);
    cudaStreamSynchronize(d->internal);
    cu_import_fini(d);
    cu_mem_fini(d);
    for (cu_event *ev = tdm__lfstack_take(&d->ev_returned), *n; ev; ev = n) {
      n = ev->next;
      cudaEventDestroy(ev->e);
      free(ev);
    }
    cudaFreeHost((void *)d->gate_host);
    cudaStreamDestroy(d->internal);
  }
  free(cu_devs);
  cu_devs = NULL;
  cu_ndevs = 0;
}

static int cuda_device_info(int bdev, tdm_device_info *info) {
  cu_device *d = &cu_devs[bdev];
  memset(info, 0, sizeof *info);
  snprintf(info->name, sizeof info->name, "%s", d->name);
  info->total_memory = d->memory;
  info->caps = TDM_DEVICE_CAP_TIMING | TDM_DEVICE_CAP_OUT_OF_ORDER | TDM_DEVICE_CAP_ADOPT |
               TDM_DEVICE_CAP_GPU;
  return 0;
}

/* ---- queues ---- */

static int cuda_queue_create(int bdev, unsigned flags, void *adopt, tdm__bqueue **out) {
  int saved, rc = cu_enter(bdev, &saved);
  if (rc) return rc;
  tdm__bqueue *bq = calloc(1, sizeof *bq);
  if (!bq) {
    cu_leave(saved);
    return cu_svc->error(TDM_ENOMEM, 0, "no memory for a CUDA queue");
  }
  bq->bdev = bdev;
  bq->ooo = (flags & TDM_QUEUE_OUT_OF_ORDER) != 0;
  bq->timed = (flags & TDM_QUEUE_TIMING) != 0;
  if (adopt) {
    cudaStream_t s = adopt;
    if (s == cudaStreamLegacy || s == cudaStreamPerThread || (uintptr_t)s < 16) {
      free(bq);
      cu_leave(saved);
      return cu_svc->error(TDM_EINVAL, 0, "the legacy and per-thread default streams cannot be "
                                          "adopted: create a non-blocking stream");
    }
    int sdev = -1;
    cudaError_t e = cudaStreamGetDevice(s, &sdev);
    if (e != cudaSuccess || sdev != cu_devs[bdev].ordinal) {
      free(bq);
      cu_leave(saved);
      if (e != cudaSuccess) return cu_error(e, "cudaStreamGetDevice on the adopted stream");
      return cu_svc->error(TDM_EXDEV, 0, "the adopted stream belongs to CUDA device %d", sdev);
    }
    if (bq->ooo) {
      free(bq);
      cu_leave(saved);
      return cu_svc->error(TDM_EINVAL, 0, "an adopted CUDA stream is in-order");
    }
    bq->adopted = true;
    bq->nstreams = 1;
    bq->s[0] = s;
  } else {
    bq->nstreams = bq->ooo ? CU_OOO_STREAMS : 1;
    for (int i = 0; i < bq->nstreams; i++) {
      cudaError_t e = cudaStreamCreateWithFlags(&bq->s[i], cudaStreamNonBlocking);
      if (e != cudaSuccess) {
        while (i--) cudaStreamDestroy(bq->s[i]);
        free(bq);
        rc = cu_error(e, "cudaStreamCreateWithFlags");
        cu_leave(saved);
        return rc;
      }
    }
  }
  if (bq->ooo && (rc = cu_notifier_start(bq))) {
    for (int k = 0; k < bq->nstreams; k++) cudaStreamDestroy(bq->s[k]); /* never adopted */
    free(bq);
    cu_leave(saved);
    return rc;
  }
  cu_leave(saved);
  *out = bq;
  return 0;
}

static void cuda_queue_destroy(tdm__bqueue *bq) {
  int saved;
  cu_enter(bq->bdev, &saved);
  if (bq->ooo) cu_notifier_stop(bq);
  if (!bq->adopted)
    for (int i = 0; i < bq->nstreams; i++) cudaStreamDestroy(bq->s[i]);
  cu_leave(saved);
  for (cu_event *ev = bq->ev_local, *n; ev; ev = n) {
    n = ev->next;
    ev_push(ev);
  }
  free(bq);
}

static int cuda_queue_native(tdm__bqueue *bq, void **native) {
  *native = bq->s[0];
  return 0;
}

static int cuda_device_native(int bdev, void **native) {
  *native = &cu_devs[bdev].ordinal;
  return 0;
}

const tdm__backend tdm__cuda_backend = {
    .abi_version = TDM__BACKEND_ABI,
    .name = "cuda",
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .device_info = cuda_device_info,
    .queue_create = cuda_queue_create,
    .queue_destroy = cuda_queue_destroy,
    .queue_native = cuda_queue_native,
    .submit = cu_submit,
    .mem_alloc = cu_mem_alloc,
    .mem_free = cu_mem_free,
    .host_register = cu_host_register,
    .host_unregister = cu_host_unregister,
    .device_native = cuda_device_native,
    .mem_native = cu_mem_native,
    .mem_import = cu_mem_import,
    .event_import = cu_event_import,
    .native_export = cu_native_export,
    .native_wait = cu_native_wait,
    .native_notify = cu_native_notify,
    .native_release = cu_native_release,
    .native_flush = cu_native_flush,
    .native_done = cu_native_done,
    .queue_wait_now = cu_queue_wait_now,
    .wake_lazily = true,
    .gate_open = cu_gate_open_entry,
    .host_copy = cu_host_copy,
    .event_elapsed = cu_event_elapsed,
};

__attribute__((visibility("default"))) const void *tdm_backend_module(void) {
  return &tdm__cuda_backend;
}
