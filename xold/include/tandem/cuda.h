/* tandem/cuda.h: interop with the CUDA backend (the module libtandem-cuda.so).
 *
 * What the generic interop calls of tandem.h return on a CUDA device:
 * - tdm_device_native(dev, &p):    p points to the device's int ordinal (as cudaSetDevice takes
 *                                  it). Borrowed.
 * - tdm_queue_native(q, &p):       p is the queue's cudaStream_t: a non-blocking stream tandem
 *                                  created (never the legacy or per-thread default stream).
 *                                  Kernels launched on it are covered by tdm_event_record and
 *                                  tdm_queue_sync. Borrowed.
 * - tdm_queue_adopt(dev, s, ...):  wraps a cudaStream_t of that device; tandem never destroys
 *                                  it. The pseudo-handles 0 / cudaStreamLegacy and
 *                                  cudaStreamPerThread are refused (TDM_EINVAL).
 * - tdm_event_native(ev, &p):      p is a cudaEvent_t recorded after ev's command, for
 *                                  cudaStreamWaitEvent in user code. Borrowed: valid while ev is.
 * - tdm_event_import(dev, e, &ev): e is a cudaEvent_t recorded by other code (any device);
 *                                  ev completes with the work recorded into e at the call.
 *                                  tandem keeps no hold on e: destroy or re-record it at once.
 *                                  tdm_event_native(ev) is tandem's own cudaEvent_t for it.
 * - tdm_mem_native(ptr, &p, &o):   p is the device pointer itself, o is 0.
 * - tdm_mem_import(dev, p, n, &q): q == p: a device pointer from another library (a CuPy
 *                                  array, say) becomes usable by tandem copies; tdm_free(q)
 *                                  forgets it without freeing it.
 *
 * Pinned memory (TDM_MEM_PINNED) comes from cudaHostAlloc; tdm_host_register uses
 * cudaHostRegister. Every tandem call saves and restores the caller's current device.
 * Host memory given to a copy must stay untouched until the copy's event completes.
 *
 * The legacy default stream and device-side waits. A synchronous call on the legacy default
 * stream (cudaMemcpy or cudaMemcpyAsync with pageable memory, say) that waits device-side,
 * through cudaStreamWaitEvent on tdm_event_native(ev), for a command tandem runs on the host
 * (host tasks, pageable and host-only copies: the stream is held at a gate until tandem's
 * thread has done the work) blocks the CUDA calls of every other thread until it returns
 * (measured on an H200 with CUDA 13.0: cudaEventRecord on an unrelated non-blocking stream
 * waited for it). tandem's thread then cannot finish the command: a deadlock. Order the legacy
 * stream after tandem's work on the host (tdm_event_wait), or use a stream of your own created
 * non-blocking; tandem itself never makes the legacy stream wait.
 */
#ifndef TANDEM_CUDA_H
#define TANDEM_CUDA_H

#include "../tandem.h"

#endif /* TANDEM_CUDA_H */
