/* tandem/opencl.h: interop with the OpenCL backend (the module libtandem-opencl.so).
 *
 * What the generic interop calls of tandem.h return on an OpenCL device:
 * - tdm_device_native(dev, &p):   p is the device's cl_context. tandem creates one context per
 *                                 device; other code (pyopencl, user kernels) creates its queues
 *                                 and buffers in it. Borrowed: do not release it.
 * - tdm_queue_native(q, &p):      p is the queue's cl_command_queue. Borrowed.
 * - tdm_queue_adopt(dev, cq, ...): wraps a cl_command_queue created in the device's context
 *                                 (another context: TDM_EINVAL); tandem retains it while the
 *                                 wrapper lives and never releases the caller's reference. Its
 *                                 out-of-order property must match TDM_QUEUE_OUT_OF_ORDER, and
 *                                 TDM_QUEUE_TIMING needs CL_QUEUE_PROFILING_ENABLE.
 * - tdm_event_native(ev, &p):     p is a cl_event that completes with ev's command, for the
 *                                 wait list of a user kernel. Borrowed: valid while ev is.
 * - tdm_event_import(dev, e, &ev): e is a cl_event of the device's context (a user event, or
 *                                 one of a pyopencl queue); tandem retains it while it needs
 *                                 it, and tdm_event_native(ev) returns it. A status below 0
 *                                 fails ev (TDM_EBACKEND). Another context: TDM_EXDEV.
 * - tdm_mem_native(ptr, &m, &o):  m is the cl_mem holding ptr, o its offset in bytes. tandem's
 *                                 device pointers are addresses in a reserved range that is never
 *                                 reused, one cl_mem each; they cannot be dereferenced.
 * - tdm_mem_import(dev, m, n, &p): a tandem pointer for a foreign cl_mem of n bytes, created in
 *                                 the device's context; tandem retains it until tdm_free(p).
 *
 * Native work and host tasks. Where TDM_DEVICE_CAP_HOST_DEFERRAL is set (PoCL's basic driver,
 * whose user events hang, or TANDEM_OPENCL_DEFER=1), tandem gates host work on the host: after
 * a host task, or a dependency with no native event yet, the queue's later commands wait in
 * tandem, unsubmitted, and a kernel enqueued on the native queue meanwhile would run before
 * them. Such held work shows as an event of tdm_queue_dependencies() that is incomplete
 * (tdm_event_query: TDM_EAGAIN) and has no native event (tdm_event_native fails); while there
 * is one, enqueue native work from a host task on the queue instead (it then runs in queue
 * order). Without the capability, commands after a host task wait on the device for a user
 * event, and native work enqueued after them is ordered after them too.
 *
 * Pinned memory (TDM_MEM_PINNED) is a CL_MEM_ALLOC_HOST_PTR buffer mapped for the host. Host
 * memory given to a copy must stay untouched until the copy's event completes.
 */
#ifndef TANDEM_OPENCL_H
#define TANDEM_OPENCL_H

#include "../tandem.h"

#endif /* TANDEM_OPENCL_H */
