/* opencl.c: the OpenCL backend's table (the module libtandem-opencl.so): devices of every
 * platform the ICD loader finds, one context per device, queues, and error mapping. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ocl.h"

const tdm__services *ocl_svc;
ocl_device *ocl_devs;
int ocl_ndevs;

int ocl_error(cl_int err, const char *what) {
  int code;
  switch (err) {
    case CL_OUT_OF_HOST_MEMORY:
    case CL_OUT_OF_RESOURCES:
    case CL_MEM_OBJECT_ALLOCATION_FAILURE: code = TDM_ENOMEM; break;
    case CL_DEVICE_NOT_AVAILABLE:
    case CL_DEVICE_NOT_FOUND: code = TDM_ENODEV; break;
    case CL_INVALID_VALUE:
    case CL_INVALID_BUFFER_SIZE:
    case CL_INVALID_CONTEXT:
    case CL_INVALID_COMMAND_QUEUE:
    case CL_INVALID_MEM_OBJECT:
    case CL_INVALID_EVENT: code = TDM_EINVAL; break;
    default: code = TDM_EBACKEND; break;
  }
  return ocl_svc->error(code, err, "%s failed with OpenCL error %d", what, err);
}

static void release_devices(void) {
  for (int i = 0; i < ocl_ndevs; i++) {
    if (ocl_devs[i].internal) clReleaseCommandQueue(ocl_devs[i].internal);
    if (ocl_devs[i].ctx) clReleaseContext(ocl_devs[i].ctx);
  }
  free(ocl_devs);
  ocl_devs = NULL;
  ocl_ndevs = 0;
}

static int add_device(cl_platform_id p, cl_device_id id) {
  ocl_device *d = &ocl_devs[ocl_ndevs];
  memset(d, 0, sizeof *d);
  d->platform = p;
  d->id = id;
  cl_int err;
  cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)p, 0};
  d->ctx = clCreateContext(props, 1, &id, NULL, NULL, &err);
  if (!d->ctx) return err;
  d->internal = clCreateCommandQueue(d->ctx, id, 0, &err);
  if (!d->internal) {
    clReleaseContext(d->ctx);
    return err;
  }
  clGetDeviceInfo(id, CL_DEVICE_NAME, sizeof d->name - 1, d->name, NULL);
  clGetDeviceInfo(id, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof d->memory, &d->memory, NULL);
  cl_command_queue_properties qp = 0;
  clGetDeviceInfo(id, CL_DEVICE_QUEUE_PROPERTIES, sizeof qp, &qp, NULL);
  d->ooo = (qp & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) != 0;
  cl_device_type type = 0;
  clGetDeviceInfo(id, CL_DEVICE_TYPE, sizeof type, &type, NULL);
  d->gpu = (type & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)) != 0;
  /* PoCL 3.1's basic driver deadlocks inside clSetUserEventStatus when a command waits on the
   * user event, so on it tandem gates host work on the host. TANDEM_OPENCL_DEFER forces it. */
  long force = ocl_svc->option_long("TANDEM_OPENCL_DEFER", -1);
  d->defer = force >= 0 ? force == 1 : strncmp(d->name, "basic-", 6) == 0;
  ocl_ndevs++;
  return CL_SUCCESS;
}

static int ocl_init(const tdm__services *svc, int *ndevices) {
  ocl_svc = svc;
  cl_uint np = 0;
  cl_int err = clGetPlatformIDs(0, NULL, &np);
  if (err != CL_SUCCESS || np == 0)
    return svc->error(TDM_ENODEV, err, "no OpenCL platform (is an ICD such as PoCL installed?)");
  cl_platform_id *plats = calloc(np, sizeof *plats);
  if (!plats) return svc->error(TDM_ENOMEM, 0, "no memory");
  clGetPlatformIDs(np, plats, NULL);
  int cap = 0;
  for (cl_uint i = 0; i < np; i++) {
    cl_uint nd = 0;
    if (clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 0, NULL, &nd) == CL_SUCCESS) cap += (int)nd;
  }
  ocl_devs = calloc(cap ? (size_t)cap : 1, sizeof *ocl_devs);
  int rc = ocl_devs ? ocl_mem_init() : svc->error(TDM_ENOMEM, 0, "no memory");
  for (cl_uint i = 0; !rc && i < np; i++) {
    cl_uint nd = 0;
    if (clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 0, NULL, &nd) != CL_SUCCESS || !nd) continue;
    cl_device_id ids[64];
    if (nd > 64) nd = 64;
    clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, nd, ids, NULL);
    for (cl_uint j = 0; j < nd && ocl_ndevs < cap; j++) add_device(plats[i], ids[j]);
  }
  free(plats);
  if (rc) {
    release_devices();
    return rc;
  }
  if (ocl_ndevs == 0) {
    release_devices();
    ocl_mem_fini();
    return svc->error(TDM_ENODEV, 0, "OpenCL platforms found, but no usable device");
  }
  *ndevices = ocl_ndevs;
  return 0;
}

static void ocl_shutdown(void) {
  ocl_notices_stop();
  release_devices();
  ocl_notices_free();
  ocl_mem_fini();
}

static int ocl_device_info(int bdev, tdm_device_info *info) {
  ocl_device *d = &ocl_devs[bdev];
  memset(info, 0, sizeof *info);
  snprintf(info->name, sizeof info->name, "%s", d->name);
  info->total_memory = d->memory;
  info->caps = TDM_DEVICE_CAP_TIMING | TDM_DEVICE_CAP_ADOPT |
               (d->ooo ? TDM_DEVICE_CAP_OUT_OF_ORDER : 0) | (d->gpu ? TDM_DEVICE_CAP_GPU : 0) |
               (d->defer ? TDM_DEVICE_CAP_HOST_DEFERRAL : 0);
  return 0;
}

static int ocl_queue_create(int bdev, unsigned flags, void *adopt, tdm__bqueue **out) {
  ocl_device *d = &ocl_devs[bdev];
  cl_command_queue_properties want =
      ((flags & TDM_QUEUE_OUT_OF_ORDER) ? CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE : 0) |
      ((flags & TDM_QUEUE_TIMING) ? CL_QUEUE_PROFILING_ENABLE : 0);
  cl_command_queue q;
  cl_int err;
  if (adopt) {
    q = adopt;
    cl_context ctx = NULL;
    cl_command_queue_properties have = 0;
    err = clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof ctx, &ctx, NULL);
    if (err == CL_SUCCESS)
      err = clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof have, &have, NULL);
    if (err != CL_SUCCESS) return ocl_error(err, "clGetCommandQueueInfo on the adopted queue");
    if (ctx != d->ctx)
      return ocl_svc->error(TDM_EINVAL, 0,
                            "the adopted queue belongs to another context than opencl:%d's "
                            "(create it in the context tdm_device_native returns)",
                            bdev);
    if ((have & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) !=
        (want & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE))
      return ocl_svc->error(TDM_EINVAL, 0, "the adopted queue's out-of-order property does not "
                                           "match the flags");
    if ((want & CL_QUEUE_PROFILING_ENABLE) && !(have & CL_QUEUE_PROFILING_ENABLE))
      return ocl_svc->error(TDM_EINVAL, 0, "TDM_QUEUE_TIMING needs a profiling queue");
    clRetainCommandQueue(q);
  } else {
    q = clCreateCommandQueue(d->ctx, d->id, want, &err);
    if (!q) return ocl_error(err, "clCreateCommandQueue");
  }
  tdm__bqueue *bq = calloc(1, sizeof *bq);
  if (!bq) {
    clReleaseCommandQueue(q);
    return ocl_svc->error(TDM_ENOMEM, 0, "no memory for an OpenCL queue");
  }
  bq->q = q;
  bq->bdev = bdev;
  bq->ooo = (flags & TDM_QUEUE_OUT_OF_ORDER) != 0;
  bq->defer = d->defer;
  if (bq->ooo) {
    bq->slots = calloc(OCL_OOO_DEPTH, sizeof *bq->slots);
    if (!bq->slots) {
      clReleaseCommandQueue(q);
      free(bq);
      return ocl_svc->error(TDM_ENOMEM, 0, "no memory for an OpenCL queue");
    }
    for (int i = 0; i < OCL_OOO_DEPTH; i++) {
      bq->slots[i].bq = bq;
      bq->slots[i].next_free = i + 1 < OCL_OOO_DEPTH ? &bq->slots[i + 1] : NULL;
    }
    atomic_init(&bq->free_slots, &bq->slots[0]);
  }
  pthread_mutex_init(&bq->mu, NULL);
  *out = bq;
  return 0;
}

static void ocl_queue_destroy(tdm__bqueue *bq) {
  /* The core has drained the queue, but a thread that resumed held work or gave a slot back
   * may still be leaving resume() or slot_done(): brief, so yielding is enough. */
  while (atomic_load(&bq->resumes)) sched_yield();
  clReleaseCommandQueue(bq->q); /* an adopted queue loses only tandem's reference */
  pthread_mutex_destroy(&bq->mu);
  free(bq->slots);
  free(bq);
}

static int ocl_queue_native(tdm__bqueue *bq, void **native) {
  *native = bq->q;
  return 0;
}

static int ocl_device_native(int bdev, void **native) {
  *native = ocl_devs[bdev].ctx;
  return 0;
}

const tdm__backend tdm__opencl_backend = {
    .abi_version = TDM__BACKEND_ABI,
    .name = "opencl",
    .init = ocl_init,
    .shutdown = ocl_shutdown,
    .device_info = ocl_device_info,
    .queue_create = ocl_queue_create,
    .queue_destroy = ocl_queue_destroy,
    .queue_native = ocl_queue_native,
    .submit = ocl_submit,
    .mem_alloc = ocl_mem_alloc,
    .mem_free = ocl_mem_free,
    .device_native = ocl_device_native,
    .mem_native = ocl_mem_native,
    .mem_import = ocl_mem_import,
    .event_import = ocl_event_import,
    .address_range = ocl_mem_range,
    .native_wait = ocl_native_wait,
    .native_flush = ocl_native_flush,
    .queue_wait_now = ocl_queue_wait_now,
    .native_release = ocl_native_release,
    .native_notify = ocl_native_notify,
    .gate_open = ocl_gate_open,
};

__attribute__((visibility("default"))) const void *tdm_backend_module(void) {
  return &tdm__opencl_backend;
}
