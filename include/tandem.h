/* tandem.h: the public API of tandem, stream-ordered asynchronous work on accelerators.
 *
 * Conventions
 * - Every fallible call returns 0 on success or a negative TDM_E* code. Out-parameters are
 *   written only on success. tdm_last_error() gives this thread's message for the last failure.
 * - Handles are opaque. Objects made by a _create call are freed by the matching _destroy call;
 *   events are reference counted (tdm_event_retain / tdm_event_release). A queue or event
 *   handle is a value naming the object and its generation, not its address: a handle of a
 *   destroyed queue, of an event whose references the caller has all released, or from before
 *   the last tdm_shutdown gets TDM_EHANDLE, even once tandem reuses the object's memory, and
 *   so does any value that was never such a handle. Devices are entries of a fixed table.
 * - Every call is safe from any thread. Submissions to one queue from several threads take effect
 *   in the order the calls took the queue's lock.
 * - "Submission" functions take an optional dependency list (ndeps, deps): the command starts
 *   only after every listed event has completed, without blocking the caller. When `out` is not
 *   NULL it receives a new event (one reference, owned by the caller) that completes when the
 *   command has completed, carrying its status.
 * - If a command fails, its event completes with the error; commands that depend on it (through
 *   a dependency list, or by queue order on an in-order queue) complete with TDM_EDEP without
 *   running. On an out-of-order queue a failed wait or barrier (the tracker's too) fails every
 *   command submitted after it, however much later, until tdm_queue_sync() has reported it.
 *   tdm_queue_sync() returns the queue's first error and clears it; the queue stays
 *   usable. On GPU backends, device work already queued behind a failure cannot be taken back:
 *   it runs, and its events report TDM_EDEP all the same; host tasks behind it do not run.
 * - Wait cycles: a wait (tdm_queue_wait, a dependency) can only name an event that exists, so
 *   queues alone cannot wait in a cycle. A host task that blocks (tdm_event_wait) on work that
 *   can only run after it does can: on its own queue this is detected (TDM_EDEADLK): any later
 *   command of an in-order queue; on an out-of-order queue, a later marker or full barrier
 *   (the tracker's collapse barrier included: see Order tracking) and what is ordered after
 *   one. Through other queues (it waits for an event of q2 that depends on a later command of
 *   its own queue) it is the caller's error, not detected, and those queues never complete.
 *   Host tasks of out-of-order queues run on a shared pool that replaces a thread blocked in a
 *   wait, up to 256 spare threads; a wait that would block the last pool thread not blocked
 *   already, with every spare started, returns TDM_EDEADLK.
 */
#ifndef TANDEM_H
#define TANDEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TDM_API __attribute__((visibility("default")))
#define TDM_NODISCARD __attribute__((warn_unused_result))
#else
#define TDM_API
#define TDM_NODISCARD
#endif

/* ---- Version ---------------------------------------------------------------------------- */

#define TDM_VERSION_MAJOR 0
#define TDM_VERSION_MINOR 1
#define TDM_VERSION_PATCH 0
#define TDM_VERSION ((TDM_VERSION_MAJOR << 16) | (TDM_VERSION_MINOR << 8) | TDM_VERSION_PATCH)

/* The version of the library loaded at run time, encoded as TDM_VERSION. */
TDM_API unsigned tdm_version(void);
/* "MAJOR.MINOR.PATCH"; static storage. */
TDM_API const char *tdm_version_string(void);

/* ---- Errors ----------------------------------------------------------------------------- */

/* X(name, value, message): one table for codes, names and messages. */
#define TDM_ERRNO_MAP(X)                                                                      \
  X(EINVAL, -1, "invalid argument")                                                            \
  X(ENOMEM, -2, "out of memory")                                                               \
  X(ENODEV, -3, "no such device")                                                              \
  X(EHANDLE, -4, "invalid, destroyed or foreign handle")                                       \
  X(ERANGE, -5, "range extends past the end of an allocation")                                 \
  X(EDIRECTION, -6, "copy direction does not match the memory involved")                       \
  X(EXDEV, -7, "objects belong to different devices")                                          \
  X(EDEP, -8, "a dependency failed, so the command did not run")                               \
  X(EDEADLK, -9, "the call would wait for itself")                                             \
  X(EDEVLOST, -10, "device lost")                                                              \
  X(ENOTSUP, -11, "operation not supported by this backend or device")                         \
  X(EBACKEND, -12, "native backend error")                                                     \
  X(ETASK, -13, "host task reported failure")                                                  \
  X(EFORK, -14, "tandem cannot be used in a forked child")                                     \
  X(ENOTINIT, -15, "tandem is not initialized")                                                \
  X(EAGAIN, -16, "not complete yet")                                                           \
  X(EBUSY, -17, "object is in use")                                                            \
  X(EVERSION, -18, "version mismatch")                                                         \
  X(ESTATE, -19, "operation not valid in the object's current state")                          \
  X(ENOENT, -20, "no such file, key or entry")

enum {
#define TDM__ERRNO_ENUM(name, value, msg) TDM_##name = (value),
  TDM_ERRNO_MAP(TDM__ERRNO_ENUM)
#undef TDM__ERRNO_ENUM
  TDM_OK = 0
};

/* "TDM_EINVAL" and so on; "TDM_OK" for 0; "TDM_UNKNOWN" otherwise. Static storage. */
TDM_API const char *tdm_err_name(int code);
/* A short message for a code. Static storage. */
TDM_API const char *tdm_strerror(int code);
/* This thread's message for its last failed call (or for the failure a sync or wait
 * reported), naming the operation and, where there is one, the native error. Valid until this
 * thread's next tandem call. Never NULL. */
TDM_API const char *tdm_last_error(void);
/* The native error code (cudaError_t, cl_int, errno) behind this thread's last failure, or 0. */
TDM_API int tdm_last_native_error(void);
/* Forgets this thread's message and native error code (tdm_last_error() then says "no error"),
 * so that a caller can tell whether the next call set a message of its own, as with errno.
 * Needs no tdm_init(); never fails. */
TDM_API void tdm_clear_error(void);
/* For libraries built on tandem (tandem's own MoE library, say): sets this thread's message,
 * as tdm_last_error() and tdm_last_native_error() then report it ("TDM_EINVAL: <detail>", with
 * the native code when it is not 0), and returns code. So a layered library reports its
 * failures where its callers already look, and a failure of a tandem call it makes can be
 * quoted in its own message: the arguments may include tdm_last_error() itself. */
TDM_API int tdm_set_error(int code, int native, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---- Lifecycle -------------------------------------------------------------------------- */

/* Reference-counted: each successful tdm_init() needs one tdm_shutdown(). The first init
 * enumerates devices and loads backend modules; the last shutdown drains and destroys every
 * queue tandem still owns, joins its threads, releases every native object (including those
 * of events the caller still holds), then unloads modules. Handles the caller still holds at
 * the last shutdown become invalid (TDM_EHANDLE after a new init), and each thread's
 * current-queue stack is emptied. The last shutdown called from a host task or a keep-alive
 * release (tandem threads it would have to join) returns TDM_EDEADLK and shuts nothing down.
 * A process may also return from main without it, with work still pending: it exits
 * normally, after waiting for that work to complete for at most TANDEM_EXIT_WAIT_MS (2000 by
 * default; not from a host task or a keep-alive release), so that no tandem thread is inside a
 * driver when the drivers' exit handlers run. In a child forked after init every call returns
 * TDM_EFORK.
 * Other threads during the last shutdown: their calls already inside tandem complete (the
 * shutdown waits for them), later calls get TDM_ENOTINIT, and nothing is freed under them.
 * Host tasks and keep-alive releases it drains go on calling tandem; queues they create are
 * drained too. tdm_init from another thread waits for the shutdown to finish and starts a
 * fresh context; from a host task or a release the shutdown waits for, it returns
 * TDM_EDEADLK. */
TDM_API TDM_NODISCARD int tdm_init(void);
TDM_API int tdm_shutdown(void);

/* ---- Backends and devices --------------------------------------------------------------- */

typedef struct tdm_device tdm_device;
typedef struct tdm_queue tdm_queue;
typedef struct tdm_event tdm_event;

typedef struct tdm_backend_info {
  char name[16];     /* "cpu", "cuda", "opencl" */
  int status;        /* 0 when loaded, else why not (TDM_ENODEV: module or driver absent) */
  int device_count;  /* devices it contributed */
  char detail[256];  /* module path, or why it was refused */
} tdm_backend_info;

/* Backends tandem knows of (loaded or refused). */
TDM_API int tdm_backend_count(int *count);
TDM_API int tdm_backend_get(int index, tdm_backend_info *info);

enum {
  TDM_DEVICE_CAP_TIMING = 1u << 0,    /* queues can be created with TDM_QUEUE_TIMING */
  TDM_DEVICE_CAP_OUT_OF_ORDER = 1u << 1,
  TDM_DEVICE_CAP_ADOPT = 1u << 2,     /* tdm_queue_adopt works */
  TDM_DEVICE_CAP_HOST_MEMORY = 1u << 3, /* device memory is host memory (the CPU backend) */
  TDM_DEVICE_CAP_GPU = 1u << 4,         /* a GPU or other accelerator (not a CPU device) */
  /* Host work is gated on the host: a host task, or a dependency with no native event yet,
   * holds the later commands of its queue in tandem, unsubmitted, so native work enqueued on
   * tdm_queue_native() meanwhile runs before them (see tandem/opencl.h). */
  TDM_DEVICE_CAP_HOST_DEFERRAL = 1u << 5
};

typedef struct tdm_device_info {
  char id[32];           /* "cpu:0", "cuda:1": backend name and index within the backend */
  char backend[16];
  char name[128];        /* the device's own name */
  int index;             /* index among all devices, as tdm_device_get takes it */
  int backend_index;     /* index within its backend */
  uint64_t total_memory; /* bytes of device memory */
  unsigned caps;         /* TDM_DEVICE_CAP_* */
} tdm_device_info;

/* Devices are owned by tandem and valid until the last tdm_shutdown(). */
TDM_API int tdm_device_count(int *count);
TDM_API int tdm_device_get(int index, tdm_device **out);
/* By id ("cpu:0"), or NULL / "" for the default device: $TANDEM_DEVICE if set, else the first
 * GPU device, else cpu:0. */
TDM_API int tdm_device_find(const char *id, tdm_device **out);
TDM_API int tdm_device_info_get(tdm_device *dev, tdm_device_info *info);
/* The device's native handle for interop, as the backend's interop header defines it
 * (OpenCL: its cl_context; CUDA: a pointer to the int device ordinal; CPU: TDM_ENOTSUP).
 * Borrowed: valid until the last tdm_shutdown(). */
TDM_API int tdm_device_native(tdm_device *dev, void **native);

/* ---- Queues ----------------------------------------------------------------------------- */

enum {
  TDM_QUEUE_IN_ORDER = 0,          /* the default: commands take effect in submission order */
  TDM_QUEUE_OUT_OF_ORDER = 1u << 0, /* ordered only by dependency lists, waits and barriers */
  TDM_QUEUE_TIMING = 1u << 1        /* events recorded on it carry timestamps */
};

/* The caller owns the queue and destroys it with tdm_queue_destroy. It is never an alias of
 * another queue: two queues created here never share a native queue. */
TDM_API TDM_NODISCARD int tdm_queue_create(tdm_device *dev, unsigned flags, tdm_queue **out);
/* Drains the queue (nothing submitted is lost), then frees it. Events from it stay valid.
 * Called from a host task running on this queue: TDM_EDEADLK. On a queue tandem owns (a
 * cached default queue): TDM_EBUSY. If the queue is installed as its device's default, it is
 * uninstalled first. Returns the queue's first unreported error, if any, after destroying it. */
TDM_API int tdm_queue_destroy(tdm_queue *q);
/* Wraps a native queue (cudaStream_t, cl_command_queue, tdm_cpu_stream *). tandem never
 * destroys it; the caller keeps it alive until tdm_queue_destroy() on the wrapper returns. */
TDM_API TDM_NODISCARD int tdm_queue_adopt(tdm_device *dev, void *native, unsigned flags,
                                          tdm_queue **out);
/* The native queue, for user kernels. Valid as long as the queue. */
TDM_API int tdm_queue_native(tdm_queue *q, void **native);
TDM_API int tdm_queue_device(tdm_queue *q, tdm_device **dev);
TDM_API int tdm_queue_flags(tdm_queue *q, unsigned *flags);

/* Device-side wait: work submitted to q after this call starts after ev completes, and so
 * does work that other code puts on q's native queue (tdm_queue_native) after it (on a
 * device with TDM_DEVICE_CAP_HOST_DEFERRAL, only where ev has a native event: see
 * tandem/opencl.h). The caller returns at once. ev may come from any queue or device; tandem keeps its own reference for
 * as long as it needs one (so do dependency lists), and the caller may release ev at once.
 * Waiting for an event that has already completed without error costs no command (nor does
 * such an event in a dependency list); a failed one fails what waits for it (the next command
 * of q reports TDM_EDEP, and tdm_queue_sync the failure). On an in-order queue of a native
 * backend, a pending ev that a queue of the same backend recorded costs no command either:
 * the native queue is told to wait at once (CUDA: one cudaStreamWaitEvent), and q's next
 * command takes ev's status. */
TDM_API TDM_NODISCARD int tdm_queue_wait(tdm_queue *q, tdm_event *ev);
/* Barrier: the command waits for the listed events, or for every earlier command of the queue
 * when ndeps is 0, and every later command waits for it. */
TDM_API TDM_NODISCARD int tdm_queue_barrier(tdm_queue *q, size_t ndeps, tdm_event *const *deps,
                                            tdm_event **out);
/* Host wait for everything submitted to q before the call, including work other code put on
 * the native queue (it waits on a native queue-wide marker). Returns the queue's first error
 * since the last sync, and clears it. From a host task running on q: TDM_EDEADLK. */
TDM_API int tdm_queue_sync(tdm_queue *q);

/* ---- Events ----------------------------------------------------------------------------- */

/* A queue-wide marker: *out completes when all work submitted to q before it has completed,
 * including work submitted through the native handle by other code. Its status is the queue's
 * first error since the last sync (0 if none), so a marker reports a failure even if the
 * failed command's own event was released. */
TDM_API TDM_NODISCARD int tdm_event_record(tdm_queue *q, tdm_event **out);
/* 0 if the event completed successfully, TDM_EAGAIN if not complete yet, else the error the
 * work completed with. Never blocks. */
TDM_API int tdm_event_query(tdm_event *ev);
/* Blocks the calling thread until ev completes; returns its status as tdm_event_query does.
 * Waiting, from a host task, on an event its own queue will only complete later: TDM_EDEADLK. */
TDM_API int tdm_event_wait(tdm_event *ev);
/* Milliseconds between two completed events recorded on the same TDM_QUEUE_TIMING queue or
 * queues of one device. Not timed: TDM_ENOTSUP; other devices: TDM_EXDEV; pending: TDM_EAGAIN. */
TDM_API int tdm_event_elapsed(tdm_event *start, tdm_event *end, double *ms);
TDM_API int tdm_event_retain(tdm_event *ev);
/* Drops one reference; the event is freed when the last one goes, even if still pending.
 * The caller's references are counted apart from tandem's own: releasing more than the caller
 * holds gets TDM_EHANDLE, never a reference that pending work still needs. */
TDM_API int tdm_event_release(tdm_event *ev);
/* The native event behind ev, for user code that submits natively (OpenCL: a cl_event; CUDA:
 * a cudaEvent_t), or TDM_ENOTSUP if it has none (CPU events). Borrowed: valid while ev is. */
TDM_API int tdm_event_native(tdm_event *ev, void **native);
/* The queue that submitted ev. The returned pointer is borrowed and may be destroyed. An
 * imported event (tdm_event_import) has none: TDM_ENOTSUP. */
TDM_API int tdm_event_queue(tdm_event *ev, tdm_queue **q);
/* Imports a native event that other code made (a CuPy, PyTorch or pyopencl event, say) as a
 * tandem event, usable wherever tandem takes one: dependency lists, tdm_queue_wait,
 * tdm_queue_track. native is a cudaEvent_t on a CUDA device, a cl_event of the device's
 * context (the one tdm_device_native returns) on an OpenCL device. *out is a new event (one
 * caller reference) that completes when the native event's work completes, and fails with
 * TDM_EBACKEND, the native status in tdm_last_native_error, if the native event reports a
 * failure (an OpenCL execution status below 0). The call never blocks: a tandem thread learns
 * of the completion from a driver notification (no thread per import).
 * - CUDA: the work is what was recorded into the event when this is called, as with
 *   cudaStreamWaitEvent (an event never recorded counts as complete); a later cudaEventRecord
 *   by other code is not seen. tandem makes a stream of its own wait for the event and records
 *   an event of its own there, so the caller may destroy or re-record its event as soon as
 *   this returns. The event may come from any CUDA device of the process.
 * - OpenCL: tandem retains the cl_event for as long as it needs it (until the tandem event is
 *   freed), so the caller may release its own reference at once. A user event works: the tandem event completes when
 *   the caller sets its status (below 0: failed).
 * Queues of the same device wait for it natively (cudaStreamWaitEvent, a wait list), others
 * through tandem's bridge, as for any event (an OpenCL user event goes through the bridge
 * too: it completes on the host anyway). tdm_event_native returns the native event (on
 * CUDA, tandem's own, which completes with the same work); tdm_event_elapsed on it:
 * TDM_ENOTSUP. The last tdm_shutdown waits for pending imported events like any other work:
 * let them complete (or fail) first. NULL native or out: TDM_EINVAL; an OpenCL event of
 * another context: TDM_EXDEV; a CPU device: TDM_ENOTSUP. */
TDM_API TDM_NODISCARD int tdm_event_import(tdm_device *dev, void *native, tdm_event **out);

/* ---- Memory ----------------------------------------------------------------------------- */

typedef enum tdm_mem_kind {
  TDM_MEM_DEVICE = 1,   /* device memory */
  TDM_MEM_PINNED = 2,   /* page-locked host memory: the fast copy path */
  TDM_MEM_HOST = 3,     /* ordinary pageable host memory */
  TDM_MEM_REGISTERED = 4 /* caller's host memory registered with tdm_host_register */
} tdm_mem_kind;

typedef struct tdm_mem_info {
  tdm_mem_kind kind;
  tdm_device *device; /* device memory: its device; host kinds: the allocating device */
  void *base;         /* start of the allocation or registration containing the pointer */
  size_t size;        /* its size in bytes */
} tdm_mem_info;

/* The caller frees with tdm_free or tdm_free_async. Zero bytes: TDM_EINVAL; more than the
 * device or host can hold (SIZE_MAX, say): TDM_ENOMEM on every backend. */
TDM_API TDM_NODISCARD int tdm_malloc(tdm_device *dev, tdm_mem_kind kind, size_t size, void **ptr);
/* Frees at once; the caller guarantees no pending work uses the memory. This is not checked
 * (it would cost every submission a lookup): freeing memory that a pending command still
 * reads or writes is the caller's error, with the effects of a use after free on backends
 * whose memory is host memory. tdm_free_async orders the free after the work instead. */
TDM_API int tdm_free(void *ptr);
/* Stream-ordered free: the memory is freed once earlier work on q (and deps) is done. Using the
 * pointer in a submission after this call: TDM_EINVAL. */
TDM_API TDM_NODISCARD int tdm_free_async(tdm_queue *q, void *ptr, size_t ndeps,
                                         tdm_event *const *deps, tdm_event **out);
/* Registers caller-owned host memory for fast copies; the caller unregisters before freeing. */
TDM_API TDM_NODISCARD int tdm_host_register(tdm_device *dev, void *ptr, size_t size);
TDM_API int tdm_host_unregister(void *ptr);
/* Describes memory tandem knows about; any other pointer is TDM_MEM_HOST with base NULL.
 *
 * Pointers in copies and fills. Memory tandem knows (allocated, registered or imported) is
 * checked against its allocation: a range that runs past its end, or an unknown pointer whose
 * range runs into an allocation, is TDM_ERANGE. A pointer tandem does not know is taken as
 * pageable host memory, with one exception: backends whose device pointers come from an
 * address range of their own (OpenCL) refuse any pointer in that range outside a live
 * allocation (a freed one, say) with TDM_EINVAL. Where device memory is host memory (the CPU
 * backend) and where device pointers share the host's address space (CUDA), a freed device
 * pointer cannot be told from host memory: using it is the caller's error. */
TDM_API int tdm_mem_query(const void *ptr, tdm_mem_info *info);
/* The native object behind a pointer into tandem device memory, and the pointer's offset in
 * it (OpenCL: the cl_mem; CUDA: the device pointer itself, offset 0). Borrowed. */
TDM_API int tdm_mem_native(const void *ptr, void **native, size_t *offset);
/* Makes foreign device memory (a cl_mem, a CUDA device pointer from another library) usable
 * by tandem copies: *ptr is a tandem pointer to its first byte, freed with tdm_free, which
 * drops tandem's hold on it but never frees the foreign memory itself. */
TDM_API TDM_NODISCARD int tdm_mem_import(tdm_device *dev, void *native, size_t size, void **ptr);

/* ---- Copies and fill -------------------------------------------------------------------- */

typedef enum tdm_copy_dir {
  TDM_COPY_AUTO = 0, /* inferred from the memory involved */
  TDM_COPY_H2D = 1,
  TDM_COPY_D2H = 2,
  TDM_COPY_D2D = 3, /* same device, or peer devices of one backend */
  TDM_COPY_H2H = 4
} tdm_copy_dir;

/* Copies n bytes in stream order. Device memory must belong to q's device, except the source
 * of a D2D copy, which may be on a peer device. Host memory (source of H2D, destination of
 * D2H) must stay untouched until the copy's event completes. A direction that does not match
 * the memory: TDM_EDIRECTION; past the end of an allocation: TDM_ERANGE. Source and
 * destination ranges that overlap: TDM_EINVAL on every backend (no copy is a memmove). n == 0
 * is a no-op command that is ordered like any other; its pointers are not looked at and may
 * be NULL. */
TDM_API TDM_NODISCARD int tdm_memcpy(tdm_queue *q, void *dst, const void *src, size_t n,
                                     tdm_copy_dir dir, size_t ndeps, tdm_event *const *deps,
                                     tdm_event **out);
/* Cross-queue copy: the copy runs on src_q (after its earlier work and deps), and dst_q waits
 * for it device-side, so work submitted to dst_q afterwards sees the data. dst may be on
 * dst_q's device and src on src_q's device (a peer copy when they differ). It happens whole or
 * not at all: on failure nothing was submitted. The calling thread never blocks, and never
 * holds both queues' locks at once, so A-to-B and B-to-A copies from two threads cannot
 * deadlock. *out completes when the copy has.
 * Supported pairs: any device memory of src_q's backend (its own device, a peer device for
 * the source), host memory of any kind, and memory of a device whose memory is host memory
 * (TDM_DEVICE_CAP_HOST_MEMORY: cpu:N), which a GPU queue copies as pageable host memory. So
 * opencl:0 -> cpu:0 and cuda:0 -> cpu:0 work with src_q on the GPU; the other way round
 * (src_q on cpu:0, destination in GPU memory) the CPU cannot reach that memory: TDM_ENOTSUP
 * (make the GPU queue wait for the CPU queue, then copy on the GPU queue). Overlapping
 * ranges and n == 0: as tdm_memcpy. */
TDM_API TDM_NODISCARD int tdm_memcpy_cross(tdm_queue *src_q, tdm_queue *dst_q, void *dst,
                                           const void *src, size_t n, size_t ndeps,
                                           tdm_event *const *deps, tdm_event **out);
/* Sets n bytes of device or host memory to the byte value. n == 0: a no-op command (dst may
 * be NULL). */
TDM_API TDM_NODISCARD int tdm_memset(tdm_queue *q, void *dst, int value, size_t n, size_t ndeps,
                                     tdm_event *const *deps, tdm_event **out);

/* ---- Host work -------------------------------------------------------------------------- */

/* A host task returns 0, or a negative TDM_E* code that becomes its event's status (any other
 * value, and TDM_EAGAIN, which would read as "not complete yet", is recorded as TDM_ETASK). A failing task may say why with tdm_set_error(): the
 * message of whoever learns of the failure (its event's wait or query, a marker, the queue's
 * sync, a command that then completes with TDM_EDEP) quotes those words after naming the
 * task. */
typedef int (*tdm_host_fn)(void *arg);

/* Runs fn(arg) on a tandem thread once earlier work on q (and deps) is done; later work on q
 * waits for it to return. fn may call tandem, but syncing or destroying q from it returns
 * TDM_EDEADLK. On the CPU backend it runs on the queue's worker thread. Never run inside a
 * driver callback. */
TDM_API TDM_NODISCARD int tdm_host_task(tdm_queue *q, tdm_host_fn fn, void *arg, size_t ndeps,
                                        tdm_event *const *deps, tdm_event **out);

/* Calls release(obj) on tandem's release thread once all work submitted to q before this call
 * has completed (including native work by other code), whatever its status. It is called
 * exactly once if this returns 0, never if it fails. It may call tandem, but must not wait on
 * work that is not yet submitted. */
TDM_API TDM_NODISCARD int tdm_keep_alive(tdm_queue *q, void (*release)(void *obj), void *obj);

/* ---- Order tracking --------------------------------------------------------------------- */

/* Order tracker. Per queue, tandem keeps the events of its own recent submissions (on an
 * out-of-order queue; an in-order queue's order implies them) and the events handed to it
 * with tdm_queue_track(). Completed entries are pruned. The tracker is bounded
 * ($TANDEM_TRACKER_CAPACITY, default 64): when full, its entries collapse into one barrier
 * submitted to q that waits for all of them (so later work on q also waits for them).
 * Because that barrier is a command of q, a tracked foreign event that fails before it
 * completes fails the barrier, and through it work submitted to q afterwards, even work that
 * never named that event: it completes with TDM_EDEP and q's next sync reports the failure.
 * Track only events whose failure should stop q. */

/* Adds a foreign event (work submitted to q's native queue, or related work elsewhere) to q's
 * tracker; tandem takes its own reference. */
TDM_API TDM_NODISCARD int tdm_queue_track(tdm_queue *q, tdm_event *ev);
/* The events a new external submission on q must wait on to follow everything tandem knows of
 * on q: the tracker's incomplete entries, and on an in-order queue with work of tandem's own
 * not yet complete, a marker this call submits to q; at most `cap` of them, each a new
 * reference the caller releases; *n receives the count (0 when nothing is pending). If more
 * than cap are needed they are first collapsed into one barrier, which this call submits to
 * q, so cap >= 1 always suffices. */
TDM_API TDM_NODISCARD int tdm_queue_dependencies(tdm_queue *q, tdm_event **deps, size_t cap,
                                                 size_t *n);

/* ---- Default and current queues --------------------------------------------------------- */

/* The device's default queue (dev NULL: the default device), created on first use with the
 * flags of $TANDEM_DEFAULT_QUEUE (in_order unless set to out_of_order), or the queue the
 * program installed. Borrowed: do not destroy it. */
TDM_API TDM_NODISCARD int tdm_default_queue(tdm_device *dev, tdm_queue **out);
/* Installs the program's own queue as dev's default (NULL reverts to the cached one). The
 * caller keeps ownership; destroying it uninstalls it. */
TDM_API int tdm_default_queue_set(tdm_device *dev, tdm_queue *q);
/* This thread's current queue: the top of its push/pop stack, else the default device's
 * default queue. Borrowed. */
TDM_API TDM_NODISCARD int tdm_current_queue(tdm_queue **out);
/* Push and pop this thread's current queue (depth up to 64). Pop on an empty stack: TDM_ESTATE. */
TDM_API TDM_NODISCARD int tdm_current_queue_push(tdm_queue *q);
TDM_API int tdm_current_queue_pop(void);

/* ---- Testing hooks ---------------------------------------------------------------------- */

enum {
  TDM_FAULT_ALLOC = 1u << 0,   /* host allocations: tandem's own, and tdm_fault_point()'s */
  TDM_FAULT_BACKEND = 1u << 1, /* calls through the backend table made by a public call */
  /* Backend calls tandem's own threads make once a submission has returned (native waits and
   * flushes, host-side copies): the command fails with the code, the call that submitted it
   * does not. Apart from TDM_FAULT_BACKEND so that a test of a call's own steps is not hit. */
  TDM_FAULT_NATIVE = 1u << 2
};

/* Makes the nth (0-based) matching operation from now fail with `code` (0: TDM_ENOMEM for an
 * allocation, TDM_EBACKEND for a backend call); a fault fires once. nth < 0 disables. Counts
 * are global. A backend call failing with TDM_EDEVLOST marks its device lost, as a real one. */
TDM_API int tdm_fault_inject(unsigned kinds, long nth, int code);
/* Whether an injected fault has fired since the last tdm_fault_inject(). */
TDM_API int tdm_fault_fired(void);
/* For libraries built on tandem: call it where an operation of the given kind (one
 * TDM_FAULT_* bit) is about to happen, such as a host allocation, so that tdm_fault_inject()
 * can fail it too. Returns 0, or the injected code when the armed fault fires here (this
 * thread's message then says so): fail the operation with that code. */
TDM_API int tdm_fault_point(unsigned kind);

typedef struct tdm_stats {
  long queues;      /* live queues, including tandem's cached default queues */
  long events;      /* events not yet freed (held by callers or by pending work) */
  long allocations; /* live tdm_malloc allocations and registrations */
  long pending;     /* submitted commands not yet completed */
} tdm_stats;

/* Counts of live objects, for leak checks in tests. Valid at any time, before tdm_init and
 * after the last tdm_shutdown too (all zero then). */
TDM_API int tdm_stats_get(tdm_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_H */
