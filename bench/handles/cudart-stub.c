/* cudart-stub.c: a stand-in for the CUDA runtime and driver libraries, so that the CUDA
 * backend's own host code can be counted by callgrind on a machine without a GPU. Every call
 * succeeds at once: one device, "device" memory is host memory, copies and fills happen when
 * they are enqueued, and every event and stream is complete. The instructions the real
 * runtime executes are not in any count taken with it; what is left is tandem's share.
 *
 * Build (not part of the CMake build), into a folder of its own:
 *   mkdir -p build/cudart-stub
 *   cc -O2 -fPIC -shared -Wl,--version-script=bench/handles/cudart-stub.map \
 *      -Wl,-soname,libcudart.so.13 -I/usr/local/cuda/include bench/handles/cudart-stub.c \
 *      -o build/cudart-stub/libcudart.so.13
 *   cc -O2 -fPIC -shared -Wl,-soname,libcuda.so.1 -DCUDART_STUB_DRIVER \
 *      -I/usr/local/cuda/include bench/handles/cudart-stub.c -o build/cudart-stub/libcuda.so.1
 * Run: LD_LIBRARY_PATH=build/cudart-stub build/percall-loop cuda:0 10000 (under callgrind). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef CUDART_STUB_DRIVER
#include <cuda.h>

CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags) {
  (void)s, (void)addr, (void)value, (void)flags;
  return CUDA_SUCCESS;
}
#else
#include <cuda_runtime_api.h>

static int current;

static void *block(size_t n) {
  void *p = NULL;
  return posix_memalign(&p, 256, n ? n : 1) ? NULL : p;
}

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
  if (d != 0) return cudaErrorInvalidDevice;
  memset(p, 0, sizeof *p);
  strcpy(p->name, "cudart-stub");
  p->totalGlobalMem = (size_t)16 << 30;
  p->major = 9;
  p->multiProcessorCount = 1;
  p->canMapHostMemory = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { current = d; return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int *d) { *d = current; return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
  (void)d, (void)peer;
  *can = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  (void)peer, (void)flags;
  return cudaSuccess;
}
static int pool_token;
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int d) {
  (void)d;
  *p = (cudaMemPool_t)&pool_token;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAccess(cudaMemPool_t p, const struct cudaMemAccessDesc *a, size_t n) {
  (void)p, (void)a, (void)n;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e ? "error (cudart-stub)" : "no error"; }
const char *cudaGetErrorName(cudaError_t e) { return e ? "cudaError (cudart-stub)" : "cudaSuccess"; }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  (void)flags;
  return (*s = block(64)) ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }
cudaError_t cudaStreamGetDevice(cudaStream_t s, int *d) { (void)s; *d = 0; return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
  (void)s;
  *st = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
  (void)s, (void)e, (void)flags;
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *arg) {
  (void)s;
  fn(arg);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  (void)flags;
  return (*e = block(64)) ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { free(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)e, (void)s; return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  (void)a, (void)b;
  *ms = 0;
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s) {
  (void)s;
  return (*p = block(n)) ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) { (void)s; free(p); return cudaSuccess; }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
  (void)flags;
  return (*p = block(n)) ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags) {
  (void)p, (void)n, (void)flags;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void *p) { (void)p; return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned flags) {
  (void)flags;
  *d = h;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  memset(a, 0, sizeof *a);
  a->type = cudaMemoryTypeDevice;
  a->devicePointer = (void *)p;
  a->hostPointer = (void *)p;
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k,
                            cudaStream_t s) {
  (void)k, (void)s;
  if (n) memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t s) {
  (void)s;
  if (n) memset(dst, v, n);
  return cudaSuccess;
}
#endif
