/* cudaorder.c: ordering work between two CUDA streams, one of which tandem does not own.
 *
 * The interop protocols name foreign streams: __cuda_array_interface__ carries the stream the
 * producer's work is on, and __dlpack__(stream=s) names the stream the consumer will use.
 * tandem's API orders its own queues; for a stream it does not own (including the legacy and
 * per-thread default streams, which cannot be adopted) this file records an event on the
 * producer stream and makes the consumer stream wait for it, with the CUDA driver API. The
 * driver is already in the process (tandem's CUDA backend loaded it), so it is found with
 * dlopen(RTLD_NOLOAD), never linked: the extension runs on machines without CUDA.
 */
#include "tdmpy.h"

#include <dlfcn.h>
#include <pthread.h>

typedef int CUresult;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
typedef int CUdevice;

static struct {
  int loaded; /* 1 found, -1 absent */
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*primary_retain)(CUcontext *, CUdevice);
  CUresult (*primary_release)(CUdevice);
  CUresult (*push)(CUcontext);
  CUresult (*pop)(CUcontext *);
  CUresult (*event_create)(CUevent *, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_sync)(CUevent);
  CUresult (*event_destroy)(CUevent);
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned);
} cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static void cu_load(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  cu.loaded = -1;
  if (!h) return;
#define SYM(field, name) \
  if (!(*(void **)&cu.field = dlsym(h, name))) return
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(primary_release, "cuDevicePrimaryCtxRelease_v2");
  SYM(push, "cuCtxPushCurrent_v2");
  SYM(pop, "cuCtxPopCurrent_v2");
  SYM(event_create, "cuEventCreate");
  SYM(event_record, "cuEventRecord");
  SYM(event_sync, "cuEventSynchronize");
  SYM(event_destroy, "cuEventDestroy_v2");
  SYM(stream_wait_event, "cuStreamWaitEvent");
#undef SYM
  cu.loaded = 1;
}

int tdmpy_cuda_order(tdmpy_state *st, int ordinal, void *producer, void *consumer) {
  pthread_once(&cu_once, cu_load);
  if (cu.loaded < 0) {
    PyErr_SetString(st->errors[-TDM_ENOTSUP],
                    "ordering with a foreign CUDA stream needs the CUDA driver in the process");
    return -1;
  }
  CUdevice dev;
  CUcontext ctx, popped;
  CUevent ev = NULL;
  const char *what = "cuDeviceGet";
  CUresult r;
  Py_BEGIN_ALLOW_THREADS
  r = cu.device_get(&dev, ordinal);
  if (!r && (what = "cuDevicePrimaryCtxRetain", !(r = cu.primary_retain(&ctx, dev)))) {
    if (!(what = "cuCtxPushCurrent", r = cu.push(ctx))) {
      /* 2: CU_EVENT_DISABLE_TIMING */
      if (!(what = "cuEventCreate", r = cu.event_create(&ev, 2)) &&
          !(what = "cuEventRecord", r = cu.event_record(ev, (CUstream)producer))) {
        if (consumer)
          what = "cuStreamWaitEvent", r = cu.stream_wait_event((CUstream)consumer, ev, 0);
        else
          what = "cuEventSynchronize", r = cu.event_sync(ev);
      }
      if (ev) cu.event_destroy(ev); /* the driver frees it once the wait no longer needs it */
      cu.pop(&popped);
    }
    cu.primary_release(dev);
  }
  Py_END_ALLOW_THREADS
  if (r) {
    PyErr_Format(st->errors[-TDM_EBACKEND], "ordering CUDA streams %p -> %p: %s failed with "
                 "CUresult %d", producer, consumer, what, r);
    return -1;
  }
  return 0;
}
