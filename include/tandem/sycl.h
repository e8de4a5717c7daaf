/* tandem/sycl.h: interop with the SYCL backend (the module libtandem-sycl.so, over Intel's DPC++
 * runtime: every device that runtime lists with USM device and host allocations, as sycl:N).
 *
 * The handles are pointers to the runtime's C++ objects, passed as void * so that C code can
 * hold them (a dpctl object's capsule holds the same pointers):
 * - tdm_device_native(dev, &p):   p is a sycl::context *, the device platform's default
 *                                 context (the one sycl::queue{device} uses). Borrowed.
 * - tdm_queue_native(q, &p):      p is the queue's sycl::queue * (in-order unless the queue is
 *                                 TDM_QUEUE_OUT_OF_ORDER; a tandem queue never shares it with
 *                                 another). Borrowed. Kernels other code submits to it are
 *                                 ordered with tandem's commands, and tandem's markers and
 *                                 tdm_queue_sync cover them: a marker is
 *                                 ext_oneapi_submit_barrier() with no events.
 * - tdm_queue_adopt(dev, sq, ..): wraps a sycl::queue * of the device (any context: a dpctl
 *                                 queue's own); tandem never destroys it, and the caller keeps
 *                                 it alive until tdm_queue_destroy on the wrapper returns. Its
 *                                 order must match TDM_QUEUE_OUT_OF_ORDER, and TDM_QUEUE_TIMING
 *                                 needs enable_profiling.
 * - tdm_event_native(ev, &p):     p is a sycl::event * that completes with ev's command, for a
 *                                 kernel's depends_on. Borrowed: valid while ev is.
 * - tdm_event_import(dev, e, &ev): e is a sycl::event * of other code (a dpctl SyclEvent's);
 *                                 tandem keeps a copy, so the caller may destroy its own at
 *                                 once. Queues wait for it through a gate (its context is not
 *                                 known).
 * - tdm_mem_native(ptr, &m, &o):  m is the USM allocation holding ptr, o the offset in it.
 * - tdm_mem_import(dev, u, n, &p): u is USM of the device's context (device, shared or host:
 *                                 a dpnp array's), used in place: p == u. tandem never frees
 *                                 it; tdm_free(p) only forgets it.
 *
 * Memory: TDM_MEM_DEVICE is sycl::malloc_device, TDM_MEM_PINNED sycl::malloc_host, both in
 * the context above; USM is usable by queues of its own context only (the runtime's rule).
 * On a CPU device (Intel's OpenCL CPU runtime) device memory is host memory, and the device
 * has TDM_DEVICE_CAP_HOST_MEMORY.
 *
 * Host work. Host tasks run on tandem's threads, never in the runtime: on an in-order queue
 * the commands after one wait, on the device, for a gate tandem opens once the task has run:
 * an OpenCL user event of the queue's context, made through the interop. Dependencies on
 * events of other contexts or backends wait on such a gate too. A device the runtime reaches
 * otherwise (Level Zero) has no such gate yet: host tasks and those dependencies get
 * TDM_ENOTSUP there (a SYCL host_task would do, but the runtime then blocks every later
 * submission to the queue on the host until it has run). Copies and fills with host memory on both sides are done
 * by tandem on the host, in queue order, so that a failure before them stops them.
 *
 * Errors: every SYCL exception, synchronous or met while waiting, becomes a TDM_E* code
 * (TDM_EBACKEND, TDM_ENOMEM) whose message quotes the runtime's words, with its error code as
 * the native code; none crosses into the caller.
 */
#ifndef TANDEM_SYCL_H
#define TANDEM_SYCL_H

#include "../tandem.h"

#endif /* TANDEM_SYCL_H */
