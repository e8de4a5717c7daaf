/* backend.h: the backend table, the one interface between tandem's core and a backend.
 *
 * A backend (the built-in CPU backend, or a module such as libtandem-cuda.so) fills one
 * tdm__backend with designated initializers. Only src/core/backend.c calls through it (the
 * test suite's core.cpu.gateway check holds every other file to that): that is where arguments are
 * validated, missing optional entries fall back, faults are injected and lost devices noted.
 *
 * A module exports `const void *tdm_backend_module(void)` returning its table; the core refuses
 * a table whose abi_version differs from TDM__BACKEND_ABI (the first member, so any version's
 * table can be checked).
 *
 * Commands. The core turns every submission into a tdm__cmd and hands it to `submit`. The
 * backend owns the command until it gives it back in one of two ways:
 * - host-executed backends (CPU) call svc->cmd_run, which waits for the dependencies, applies
 *   the error rules, executes the command on the host and completes it;
 * - native backends (CUDA, OpenCL) enqueue the command on the native queue, set cmd->wait to
 *   a native handle that completes with it (and, for host tasks, cmd->gate to what holds the
 *   native queue until the task has run), and call svc->cmd_native. On an in-order queue the
 *   queue's executor, a tandem thread, then waits for the handle with native_wait in
 *   submission order, runs host tasks, opens their gates with gate_open, and completes the
 *   command. On an out-of-order queue the core asks native_notify to report the handle's
 *   completion, and a thread of its thread pool completes the command.
 * Driver callbacks: a backend may report completions from one (OpenCL's clSetEventCallback,
 * the host function behind a CUDA import), and then it runs tandem code there, but only the
 * notification native_notify was given: it counts the command's pending work down and, at
 * zero, pushes the command onto the thread pool's ready list and wakes a thread (a leaf lock,
 * never held across a backend call). Host tasks, releases and completions themselves never
 * run inside a driver callback.
 * A backend never frees a command or its event itself.
 */
#ifndef TANDEM_BACKEND_H
#define TANDEM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem.h"
#include "util/workq.h"

/* 0x00010009: the optional queue_wait_now (a device-side wait made at once, with no command:
 * tdm_queue_wait's cheap path), and tdm__dep.ordered, which marks a dependency such a wait
 * already ordered natively.
 * 0x00010008: TDM__CMD_WAIT_BORROWED: a backend that waits for the handle it attached to the
 * event lends it to cmd->wait instead of giving a second reference.
 * 0x00010007: the optional native_done (a non-blocking query that lets an in-order queue
 * complete unwatched commands lazily, on the submitting thread: src/core/exec.c).
 * 0x00010006: mem_alloc and mem_import return a tdm__bmem that the core keeps in its registry
 * entry; mem_free, mem_native and commands carry it back (tdm__memref), so a backend keeps no
 * registry of its own; and the MoE extension entry is gone (the MoE operations live in
 * libtandem_moe, on the public API); and commands embed the link of the queue-worker
 * primitive (tdm__workq_item, src/util/workq.h). */
#define TDM__BACKEND_ABI 0x00010009u

typedef struct tdm__bqueue tdm__bqueue; /* a backend's queue; opaque to the core */
/* The core's event and queue objects. The public tdm_event and tdm_queue are handles that the
 * core resolves to these at every entry point; backends see only these. */
typedef struct tdm__event tdm__event;
typedef struct tdm__queue tdm__queue;

typedef enum tdm__cmd_kind {
  TDM__CMD_COPY,    /* copy.dst <- copy.src, copy.n bytes */
  TDM__CMD_FILL,    /* fill.dst set to fill.value, fill.n bytes */
  TDM__CMD_HOST,    /* host.fn(host.arg) on a host thread */
  TDM__CMD_MARKER,  /* completes after all earlier work on the native queue */
  TDM__CMD_BARRIER, /* waits for its deps (the core lists them); later work waits for it */
  TDM__CMD_FREE     /* frees free_.ptr (the core's registry entry) */
} tdm__cmd_kind;

enum {
  TDM__CMD_SYNC = 1u << 0,        /* a marker made by tdm_queue_sync: clears the queue's error */
  TDM__CMD_NATIVE_FREED = 1u << 1, /* set by a native backend that freed the memory itself
                                      (stream-ordered); the core only forgets the pointer */
  TDM__CMD_ALL_PRIOR = 1u << 2,     /* a marker or barrier that covers every earlier command of
                                      the queue, besides its deps */
  TDM__CMD_ON_HOST = 1u << 3,       /* set by a native backend: the core does this copy or fill
                                      on the host (host memory on both sides) */
  TDM__CMD_QUIET = 1u << 4,         /* set by the core: only the queue itself can observe this
                                      command's completion (in-order queue, no event returned,
                                      no timing or tracing; on a queue that completes lazily,
                                      at most 15 in a row). A backend with native_flush may
                                      enqueue it without a native handle (cmd->wait NULL): it
                                      completes with the next handle of the queue */
  TDM__CMD_WAIT_BORROWED = 1u << 5  /* set by a native backend: cmd->wait is the handle it
                                      attached to the event (event_set_native), lent rather
                                      than given: the core waits for it but never releases it.
                                      The event keeps it until freed, and the command holds the
                                      event until it completes, so one reference serves both
                                      (no retain per command, no second release) */
};

/* What a backend keeps about one allocation: set by mem_alloc or mem_import, stored in the
 * core's registry entry for the allocation's life, and handed back with every command and call
 * on that memory. */
typedef struct tdm__bmem {
  void *handle;   /* the backend's object (OpenCL: the cl_mem); NULL where it needs none */
  unsigned flags; /* TDM__BMEM_*, set by the core */
} tdm__bmem;

enum {
  TDM__BMEM_IMPORTED = 1u << 0 /* tdm_mem_import: foreign memory, which tandem never frees */
};

/* One side of a copy or fill as the core's registry resolved it. Memory of another backend's
 * device reaches a backend only as host memory (kind TDM_MEM_PINNED, _REGISTERED or 0), with
 * no handle. */
typedef struct tdm__memref {
  tdm_mem_kind kind; /* 0: memory tandem does not know, which is pageable host memory */
  int bdev;          /* the owning device, within this backend; -1 when there is no handle */
  tdm__bmem bm;      /* zero unless bdev >= 0 */
  size_t offset;     /* of the pointer from the start of its allocation */
} tdm__memref;

typedef struct tdm__cmd tdm__cmd;

/* A continuation run when an event completes, on the completing thread, outside every lock.
 * It must not block. */
typedef struct tdm__waiter {
  struct tdm__waiter *next;
  void (*fn)(struct tdm__waiter *w, tdm__event *ev);
} tdm__waiter;

typedef struct tdm__dep {
  tdm__event *ev;    /* one reference held by the command */
  tdm__waiter w;    /* for backends that resolve dependencies by continuation */
  tdm__cmd *cmd;
  bool ordered;     /* the native queue already waits for ev (queue_wait_now made the wait):
                       the backend need not order the command after it again; the core still
                       takes ev's status */
} tdm__dep;

#define TDM__INLINE_DEPS 4

/* Laid out for the submitting thread: what every submission writes (up to the first inline
 * dependency) fills the first two cache lines of the struct (the core allocates it on a line
 * boundary), so a recycled command, last written by the thread that completed it, costs two
 * line transfers rather than five; the operands a record or wait never touches come last. */
struct tdm__cmd {
  tdm__cmd *next;          /* free for the backend's lists while it owns the command */
  tdm__workq_item link;    /* the workq (util/workq.h) that runs the command: the core's once
                              it has the command back, the CPU stream's while it is there */
  tdm__cmd_kind kind;
  unsigned flags;
  tdm__event *ev;           /* completes with the command's status */
  size_t ndeps;
  tdm__dep *deps;          /* inline_deps, or heap storage for larger lists */
  void *wait;              /* native backends: handle native_wait waits for */
  void *gate;              /* native backends, host tasks: handle gate_open releases */
  void *bdata;             /* scratch for the backend */
  long bcount;             /* scratch for the backend (pending dependency count) */
  uint64_t t_submit, t_start; /* tracing only: when submitted, when begun on a host thread */
  tdm__dep inline_deps[TDM__INLINE_DEPS];
  union {
    /* d, s: the memory as the core's registry knows it, so a backend never looks pointers up
     * (no registry of its own, no driver queries on this path). */
    struct { void *dst; const void *src; size_t n; tdm__memref d, s; } copy;
    struct { void *dst; int value; size_t n; tdm__memref d; } fill;
    struct { tdm_host_fn fn; void *arg; } host;
    struct { void *ptr; tdm__memref m; } free_; /* ptr is the allocation's start */
  } u;
};

struct tdm__backend;

/* Services the core offers backends (a module cannot link against the core's hidden symbols). */
typedef struct tdm__services {
  /* Runs cmd on the calling host thread: waits for its deps (blocking the caller), applies the
   * error rules (a failed dependency or, on an in-order queue, an earlier failure completes it
   * with TDM_EDEP without running), executes it, and completes it. */
  void (*cmd_run)(tdm__cmd *cmd);
  /* Completes cmd with status (0 or TDM_E*) and the native code, and gives it back. */
  void (*cmd_done)(tdm__cmd *cmd, int status, int native);
  /* Registers w to run when ev completes; returns 1 (and does not register) if it already has. */
  int (*event_on_complete)(tdm__event *ev, tdm__waiter *w);
  /* Sets this thread's error message; returns code. */
  int (*error)(int code, int native, const char *fmt, ...);
  /* Reads an option of the environment table ("TANDEM_CPU_DEVICES"), or def if unset. */
  long (*option_long)(const char *name, long def);
  /* Native backends: hands a command enqueued natively to the core, which completes it in
   * order on the queue's executor (in-order queues) or, on out-of-order queues, on a thread of
   * its thread pool once native_notify reports its handle complete. From this call on, the core
   * owns cmd->bcount and cmd->deps[].w. */
  void (*cmd_native)(tdm__cmd *cmd);
  /* Host-executed backends: runs cmd_run on a thread of the core's thread pool once its deps
   * have completed (out-of-order queues), without occupying a thread while it waits. */
  void (*threadpool_submit)(tdm__cmd *cmd);
  /* Native backends: attaches a native event to ev (released with native_release when ev is
   * freed), so other queues of the same backend can wait for it natively. */
  void (*event_set_native)(tdm__event *ev, void *handle);
  /* The native event attached to ev if a queue of backend `be` recorded it, else NULL. */
  void *(*event_native)(tdm__event *ev, const struct tdm__backend *be);
  /* The device index (within its backend) of the queue that submitted ev, and its backend. */
  int (*event_device)(tdm__event *ev, const struct tdm__backend **be);
  /* Whether ev was imported from a native event that other code made (tdm_event_import). */
  bool (*event_imported)(tdm__event *ev);
} tdm__services;

/* The table. Only src/core/backend.c calls through it, one wrapper (tdm__b_<entry>) per entry:
 * the wrapper checks optional entries for NULL (falling back, or failing with TDM_ENOTSUP and a
 * message), lets a test fail the call (tdm_fault_inject: TDM_FAULT_BACKEND for calls a public
 * call makes, TDM_FAULT_NATIVE for those tandem's threads make after a submission returned),
 * and marks the device lost when an entry returns TDM_EDEVLOST.
 *
 * Every int entry returns 0 or a TDM_E* code and sets the message through svc->error; on
 * failure it leaves its out-parameters alone and has changed nothing. "Required" entries are
 * never NULL. Unless an entry says otherwise it may be called from any thread, with no lock of
 * the core held, and may block briefly (a driver call), never on device work of a queue. */
typedef struct tdm__backend {
  unsigned abi_version; /* TDM__BACKEND_ABI; must stay the first member */
  const char *name;     /* "cpu", "cuda", "opencl": device ids are "<name>:<index>" */

  /* ---- life ---- */
  /* Required. Called once per context, before anything else, from tdm_init (under the init
   * lock); finds the devices. On failure the backend is listed as refused and nothing else of
   * it is called. */
  int (*init)(const tdm__services *svc, int *ndevices);
  /* Required. Called at the last shutdown, after every queue is destroyed and every
   * allocation freed; joins the backend's threads. The module is unloaded right after. */
  void (*shutdown)(void);
  /* Required. Called at init for each device; fills everything but the index fields. A
   * failure refuses the backend (shutdown is then called). */
  int (*device_info)(int bdev, tdm_device_info *info);
  /* Optional: the address range the device's memory takes its pointers from, when that range
   * is the backend's own and no host memory lives in it (OpenCL's reserved range). A pointer
   * in it outside every live allocation is refused instead of being taken as host memory.
   * Called once, at init, after device_info; a failure refuses the backend. */
  int (*address_range)(int bdev, uintptr_t *base, size_t *size);

  /* ---- queues ---- */
  /* Required. adopt is NULL for a new queue, else the native queue to wrap (never destroyed
   * by the backend). May block briefly (thread creation); the core holds no lock. */
  int (*queue_create)(int bdev, unsigned flags, void *adopt, tdm__bqueue **out);
  /* Required. The core has drained the queue and stopped its executor; frees it (an adopted
   * native queue survives). No lock held. */
  void (*queue_destroy)(tdm__bqueue *bq);
  /* Optional (NULL: TDM_ENOTSUP). The native handle for user code; must not block. */
  int (*queue_native)(tdm__bqueue *bq, void **native);
  /* Required. Takes ownership of cmd on success and must eventually complete it with
   * svc->cmd_done (possibly from another thread, possibly before returning). Called with the
   * queue's submission lock held, so it must not wait for device work or call back into the
   * public API; on failure it leaves cmd untouched. Must not allocate in steady state. */
  int (*submit)(tdm__bqueue *bq, tdm__cmd *cmd);

  /* ---- memory ----
   * The core's registry holds every allocation; a backend keeps what it needs about one in the
   * tdm__bmem it fills, which comes back with every call and command on that memory. */
  /* Required. Allocates size bytes of the kind (TDM_MEM_DEVICE, _PINNED or _HOST) and sets
   * bm->handle (bm comes zeroed). */
  int (*mem_alloc)(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm);
  /* Required. Frees what mem_alloc or mem_import made (bm as it returned it, with the core's
   * flags: an import is only forgotten). Never called while a command may still use the
   * memory; may block (a driver free); no lock of the core held. */
  void (*mem_free)(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm);
  /* Optional. Pins caller memory; a NULL entry means registration is bookkeeping only. */
  int (*host_register)(int bdev, void *ptr, size_t size);
  /* Optional; called for every successful host_register. */
  void (*host_unregister)(int bdev, void *ptr);

  /* ---- interop (optional; NULL: TDM_ENOTSUP) ---- */
  int (*device_native)(int bdev, void **native);
  /* The native object and offset for ptr, inside the device allocation at base (bm as
   * mem_alloc or mem_import set it). Must not block. */
  int (*mem_native)(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                    size_t *offset);
  /* Wraps foreign device memory, setting *ptr and bm->handle; the core flags the entry
   * TDM__BMEM_IMPORTED, and mem_free later only forgets it. */
  int (*mem_import)(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm);
  /* Optional (NULL: TDM_ENOTSUP; needs native_notify). tdm_event_import: turns a native event
   * of the device that other code made into a handle as native_wait, native_notify and
   * native_release take, that completes with the work the native event covers now (not with
   * what other code records into it later). *handle comes with two references: the core
   * attaches one to the tandem event and waits with the other. Must not wait for device
   * work. */
  int (*event_import)(int bdev, void *native, void **handle);
  /* Optional: the native event user code sees for a handle the backend attached to an event
   * (tdm_event_native), when that handle is not the native event itself; NULL: the handle.
   * Cannot fail; must not block. */
  void *(*native_export)(void *handle);

  /* ---- native backends only (NULL for host-executed ones) ----
   * Host tasks, and copies or fills the backend marks TDM__CMD_ON_HOST, are done by the core
   * on the host once cmd->wait completes; then the core opens cmd->gate, if the backend set
   * one. */
  /* Required of native backends: whether a backend is one. Blocks the executor (or a pool
   * thread) until the handle's work completes; returns 0 or the mapped error and its native
   * code. Must not call back into the core. */
  int (*native_wait)(void *handle, int *native);
  /* Optional: calls fn(arg) once the handle completes, from any thread, possibly at once in
   * the caller's. fn only pushes onto a list and wakes a thread. Returns 0 if registered;
   * anything else only declines (a pool thread then waits with native_wait). */
  int (*native_notify)(void *handle, void (*fn)(void *arg), void *arg);
  /* Required of native backends. Releases a handle given in cmd->wait (unless lent:
   * TDM__CMD_WAIT_BORROWED) or event_set_native.
   * Never blocks; called from any thread, possibly under the queue's submission lock. */
  void (*native_release)(void *handle);
  /* Required of native backends. Lets the native queue run past a host task's gate (called
   * once per gate, by the executor, after the task ran or was skipped). Never blocks. */
  void (*gate_open)(void *gate);
  /* Optional: records a native handle covering everything enqueued on the queue so far
   * (quiet commands enqueued without one complete with it); called by the executor with the
   * queue's submission lock held. A backend without it gives every command a handle; a
   * backend with it gives one to every command of an in-order queue that is not quiet. */
  int (*native_flush)(tdm__bqueue *bq, void **handle);
  /* Whether the native queue makes progress without the executor's help (CUDA streams do; an
   * OpenCL queue may need the flush that waiting implies). When true, the executor is woken
   * only when a command needs the host or someone waits; when false, at every command. */
  bool wake_lazily;
  /* Optional: does a TDM__CMD_ON_HOST copy that memmove cannot (pageable host memory on one
   * side, device memory on the other), on the executor; returns 0 or a TDM_E* code. It may
   * wait for its own private stream, never for a gated one. NULL: memmove. */
  int (*host_copy)(tdm__cmd *cmd);
  /* Optional: milliseconds between two native events of timed queues (both complete); NULL:
   * the host clock's times of completion. */
  int (*event_elapsed)(void *start, void *end, double *ms);
  /* Optional: whether the handle's work has completed without error, asked now, without
   * blocking: nonzero yes; 0 not yet, failed, or cannot say. On an in-order queue the core
   * asks it of a lazily completed command (exec.c), and a yes completes that command and
   * every lazy one before it without a wait of their own. So a backend offers it only where a
   * later command's success implies the earlier ones' (CUDA: a stream runs in order and a
   * device fault is sticky). Called from any thread, with no lock of the core held but the
   * queue's lazy-list lock; must not block or call back into the core. It also switches lazy
   * completion on for the backend's in-order queues: its commands then get no executor wait
   * until someone watches their events (tdm__exec_kick). */
  int (*native_done)(void *handle);
  /* Optional: makes the in-order queue's native queue wait, device-side, for ev's work, now
   * and without a command of its own (tdm_queue_wait's cheap path). Returns 0 once the wait
   * is made (or nothing needs making: earlier work of the same native queue), 1 when it
   * cannot make it that way (ev has no native event of this backend: the core submits a
   * wait command instead), or a TDM_E* code. The core then hands ev to the queue's next
   * command as a dependency marked ordered, for its status. Called with the queue's
   * submission lock held; must not block. */
  int (*queue_wait_now)(tdm__bqueue *bq, tdm__event *ev);
} tdm__backend;

/* The built-in CPU backend. */
extern const tdm__backend tdm__cpu_backend;

#endif /* TANDEM_BACKEND_H */
