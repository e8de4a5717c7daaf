/* syrt.h: the SYCL backend's C view of Intel's DPC++ runtime. syrt.cpp is the module's one C++
 * file: it holds every sycl:: object behind the opaque types below, and every function catches
 * at its edge, so no C++ type and no exception reaches the backend's C files (sycl.c,
 * sysubmit.c), which fill tandem's backend table with these calls.
 *
 * Every int function returns 0 or a negative TDM_E* code, with the message set through the
 * error function given to sy_init (the runtime's own words, and its error code as the native
 * code). Calls are safe from any thread; none waits for device work unless it says so. */
#ifndef TANDEM_SYRT_H
#define TANDEM_SYRT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sy_queue sy_queue; /* a sycl::queue, owned or adopted */
typedef struct sy_ev sy_ev;       /* a reference-counted sycl::event, or a gate */

typedef int (*sy_error_fn)(int code, int native, const char *fmt, ...);

/* Lists the runtime's devices that tandem can use (USM device and host allocations), each
 * with its platform's default context, the one other SYCL code (dpctl) shares. */
int sy_init(sy_error_fn error, int *ndevices);
/* After every queue and allocation is gone. */
void sy_fini(void);

typedef struct sy_device_desc {
  char name[128];
  uint64_t memory;
  bool gpu;
  bool cpu;    /* a CPU device: its USM device memory is host memory */
  bool opencl; /* the runtime reaches it through OpenCL: gates are OpenCL user events */
} sy_device_desc;
void sy_device_describe(int dev, sy_device_desc *d);
/* The device's sycl::context (a pointer to it), borrowed. */
void *sy_device_context(int dev);

/* adopt: NULL, or a sycl::queue * of one of the device's contexts, wrapped as it is (its
 * order must match ooo). */
int sy_queue_new(int dev, bool ooo, bool timing, void *adopt, sy_queue **out);
void sy_queue_free(sy_queue *q);
void *sy_queue_native(sy_queue *q); /* the sycl::queue *, borrowed */

/* Enqueues on q after every event of deps (events of q's context: sy_ev_usable) and, on an
 * in-order queue, after everything enqueued on it before. *out receives a new event (one
 * reference). */
int sy_copy(sy_queue *q, void *dst, const void *src, size_t n, sy_ev *const *deps,
            size_t ndeps, sy_ev **out);
int sy_fill(sy_queue *q, void *dst, int value, size_t n, sy_ev *const *deps, size_t ndeps,
            sy_ev **out);
/* A barrier: later commands of q wait for it. all: it also waits for every command enqueued
 * on q before it, whoever enqueued it (ext_oneapi_submit_barrier with no events). out may be
 * NULL. */
int sy_barrier(sy_queue *q, bool all, sy_ev *const *deps, size_t ndeps, sy_ev **out);

/* A gate: an event of q's context that completes when sy_gate_open is called (an OpenCL user
 * event through the interop; TDM_ENOTSUP where the runtime does not reach the device through
 * OpenCL). One reference. */
int sy_gate_new(sy_queue *q, sy_ev **out);
void sy_gate_open(sy_ev *gate);

void sy_ev_retain(sy_ev *e);
void sy_ev_release(sy_ev *e);
/* Blocks until e's work completes; 0, or TDM_EBACKEND with the runtime's code in *native. */
int sy_ev_wait(sy_ev *e, int *native);
/* Whether e's work has completed (with or without error), asked now. */
bool sy_ev_complete(sy_ev *e);
/* Whether a command of q may wait for e natively (an event of q's context). */
bool sy_ev_usable(const sy_ev *e, const sy_queue *q);
/* The sycl::event * behind e, borrowed. */
void *sy_ev_native(sy_ev *e);
/* Wraps a sycl::event * of other code (a copy of it is kept: the caller may destroy its own). */
int sy_ev_import(int dev, void *native, sy_ev **out);
/* Milliseconds between the ends of two events of timed queues. */
int sy_ev_elapsed(sy_ev *start, sy_ev *end, double *ms);

/* kind: 1 device, 2 pinned host (USM host), 3 pageable host. */
int sy_alloc(int dev, int kind, size_t size, void **ptr);
void sy_free(int dev, int kind, void *ptr);
/* Checks that ptr is USM of the device's context (device, shared or host). */
int sy_usm_check(int dev, void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_SYRT_H */
