/* internal.h: the core's private structures and the functions its files share.
 *
 * Locking, in one place:
 * - ctx.mu guards the device table, the default queues and the list of queues. Never held
 *   across a backend call that may block on device work.
 * - q->submit_mu serializes submissions to one queue (their order is the order of taking it)
 *   and guards the local halves of the queue's free lists, its tracker and its sequence
 *   numbers. It is held across backend->submit, never across a wait.
 * - q->mu guards completion state of q's events (status, waiter lists) and q->cv. A leaf lock:
 *   held for a few instructions, never while calling a backend or a continuation, never while
 *   taking another lock.
 * - No thread holds two queues' submission locks at once (a cross-queue copy submits to one,
 *   releases it, then submits to the other).
 */
#ifndef TANDEM_CORE_INTERNAL_H
#define TANDEM_CORE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "lfstack.h"
#include "tandem.h"

#define TDM__MAX_DEVICES 64
#define TDM__MAX_BACKENDS 8
#define TDM__QUEUE_REF_BATCH 256 /* queue references an event submission takes at a time */

/* ---- handle.c ---- */
enum { TDM__KIND_QUEUE = 1, TDM__KIND_EVENT = 2 };
#define TDM__HANDLE_INDEX_BITS 30 /* a handle: [generation:32][kind:2][index:30] */
/* A slot for a new struct (cold: when a free list is empty), and the slot's last generation, from
 * which the struct goes on issuing handles. */
int tdm__slot_new(void *obj, uint32_t *slot, uint32_t *gen);
/* Gives the slot back with the last generation the struct issued (the struct is being freed). */
void tdm__slot_free(uint32_t slot, uint32_t gen);
/* A handle of the slot's next generation (*gen is the struct's copy); the struct stores it as
 * its current handle. Only the struct's owner calls it. */
static inline uint64_t tdm__handle_make(uint32_t slot, uint32_t *gen, unsigned kind) {
  if (++*gen == 0) *gen = 1; /* a handle is never 0 */
  return (uint64_t)*gen << 32 | (uint64_t)kind << TDM__HANDLE_INDEX_BITS | slot;
}
/* The table: chunks of slots, made as needed and never freed. */
#define TDM__SLOT_CHUNK_SHIFT 12
#define TDM__SLOT_MAX_CHUNKS 4096u /* 16M slots: more live objects than memory could hold */
typedef struct tdm__slot {
  _Atomic(void *) obj; /* the struct that owns the slot, or NULL */
  uint32_t gen;        /* the last generation issued while no struct owns it; under a lock */
  uint32_t next_free;  /* free list link, under the same lock */
} tdm__slot;
extern _Atomic(tdm__slot *) tdm__slot_chunks[TDM__SLOT_MAX_CHUNKS];
/* The struct whose slot a value of the kind names, or NULL; whether the value is that struct's
 * current handle is for the caller to compare. Inline: every public call resolves handles. */
static inline void *tdm__handle_obj(const void *handle, unsigned kind) {
  uint64_t h = (uint64_t)(uintptr_t)handle;
  uint32_t i = (uint32_t)h & ((1u << TDM__HANDLE_INDEX_BITS) - 1);
  if (((uint32_t)h >> TDM__HANDLE_INDEX_BITS) != kind ||
      (i >> TDM__SLOT_CHUNK_SHIFT) >= TDM__SLOT_MAX_CHUNKS)
    return NULL;
  tdm__slot *c =
      atomic_load_explicit(&tdm__slot_chunks[i >> TDM__SLOT_CHUNK_SHIFT], memory_order_acquire);
  if (!c) return NULL;
  return atomic_load_explicit(&c[i & ((1u << TDM__SLOT_CHUNK_SHIFT) - 1)].obj,
                              memory_order_acquire);
}

enum {
  TDM__MAGIC_QUEUE = 0x51554555u, /* "QUEU" */
  TDM__MAGIC_EVENT = 0x45564e54u, /* "EVNT" */
  TDM__MAGIC_DEAD = 0xdeadbeefu
};

/* ---- options.c ---- */
typedef struct tdm__options {
  char device[32];        /* TANDEM_DEVICE */
  unsigned default_flags; /* TANDEM_DEFAULT_QUEUE */
  long cpu_devices;       /* TANDEM_CPU_DEVICES */
  long cpu_pool_threads;  /* TANDEM_CPU_POOL_THREADS */
  long tracker_capacity;  /* TANDEM_TRACKER_CAPACITY */
  long opencl_defer;      /* TANDEM_OPENCL_DEFER */
  long cuda_blocking_sync;/* TANDEM_CUDA_BLOCKING_SYNC */
  char backend_path[1024];/* TANDEM_BACKEND_PATH */
  char backends[128];     /* TANDEM_BACKENDS: comma-separated allow list, empty = all */
  char trace[4096];       /* TANDEM_TRACE: Chrome trace file written at the last shutdown */
  long exit_wait_ms;      /* TANDEM_EXIT_WAIT_MS */
  long spin_us;           /* TANDEM_SPIN_US */
} tdm__options;
void tdm__options_load(tdm__options *o);
long tdm__option_long(const char *name, long def);

/* ---- event.c: free lists of recycled structs (a queue's events and commands): a locked local
 * list refilled whole from a lock-free return stack ---- */
typedef struct tdm__freelist {
  void *local;               /* popped under the owner's lock */
  char apart_[64];           /* a line or more between the owner's half and the others' */
  _Atomic(void *) returned;  /* pushed from any thread, taken whole by exchange */
  char apart2_[64];          /* and between it and whatever follows */
} tdm__freelist;
/* Items start with a `void *next` link. Inline: a submission takes two items and a
 * completion gives two back. */
static inline void *tdm__freelist_get(tdm__freelist *p) {
  if (!p->local) p->local = tdm__lfstack_take(&p->returned);
  tdm__link *it = p->local;
  if (it) p->local = it->next;
  return it;
}
static inline void tdm__freelist_put(tdm__freelist *p, void *item) {
  tdm__lfstack_push(&p->returned, item);
}
/* Returns the list first..last, linked by their first members, with one push. */
static inline void tdm__freelist_put_list(tdm__freelist *p, void *first, void *last) {
  tdm__lfstack_push_list(&p->returned, first, last);
}
void tdm__freelist_drain(tdm__freelist *p, void (*destroy)(void *));

/* ---- devices and context (context.c) ---- */
typedef struct tdm__backend_slot {
  const tdm__backend *be; /* NULL when refused */
  void *dl;               /* dlopen handle for modules */
  tdm_backend_info info;
  int first_device;
} tdm__backend_slot;

struct tdm_device {
  const tdm__backend *be;
  int bindex;             /* index within the backend */
  int index;
  _Atomic int lost;
  tdm_device_info info;
  uintptr_t range_base, range_end; /* address_range, or 0 and 0 */
  tdm__queue *default_cached;    /* created on first use, owned by tandem */
  tdm__queue *default_installed; /* the program's, borrowed */
  _Atomic(tdm__queue *) imports; /* its imported events' queue (import.c), made on first use */
};

/* The context's life (tdm__ctx.live). Between the first init and the last shutdown it is
 * LIVE. The last shutdown makes it CLOSING: calls from the program's threads are refused
 * (TDM_ENOTINIT) while those already inside tandem finish (it waits for them), and tandem's
 * own threads running the program's code (host tasks, keep-alive releases) go on calling, so
 * the work being drained completes. Once every queue has drained it is SEALED: every call is
 * refused, and nothing is freed until tandem's threads have been joined. */
enum { TDM__OFF = 0, TDM__LIVE = 1, TDM__CLOSING = 2, TDM__SEALED = 3 };

typedef struct tdm__ctx {
  pthread_mutex_t mu;
  int refs;                 /* init count; guarded by the init lock */
  _Atomic int live;         /* TDM__OFF, _LIVE, _CLOSING or _SEALED */
  _Atomic unsigned epoch;   /* counts first inits: per-thread state of an older one is stale */
  tdm__options opts;
  tdm__services svc;
  tdm__backend_slot backends[TDM__MAX_BACKENDS];
  int nbackends;
  tdm_device devices[TDM__MAX_DEVICES];
  int ndevices;
  tdm__queue *queues;        /* every queue struct, live or recycled; freed at shutdown */
  tdm__queue *free_queues;   /* recycled structs */
  int next_queue_id;
  _Atomic long n_queues, n_allocs;  /* events and pending commands are counted per queue */
  char apart_[64];
  /* Public calls in progress that the last shutdown waits for: every call that entered while
   * LIVE (tdm__enter). Apart from the rest: every call writes it twice. */
  _Atomic long calls;
} tdm__ctx;

extern tdm__ctx tdm__g;
extern _Atomic int tdm__forked;

/* Entry check for every public call: forked child, then initialized. Inline, with the
 * failures out of line: it runs at the start of every call. A call that enters while LIVE is
 * counted in tdm__g.calls until it returns (tdm__leave, run by the cleanup attribute of the
 * variable TDM__ENTER declares), so the last shutdown can wait for it before it frees
 * anything. The count goes up before the state is read, and the shutdown changes the state
 * before it reads the count (both sequentially consistent): a call either is seen by the
 * shutdown or sees that it has begun. */
int tdm__enter_fail(void);
static inline int tdm__enter(int *counted) {
  atomic_fetch_add_explicit(&tdm__g.calls, 1, memory_order_seq_cst);
  if (__builtin_expect(atomic_load_explicit(&tdm__forked, memory_order_relaxed) ||
                           atomic_load_explicit(&tdm__g.live, memory_order_seq_cst) !=
                               TDM__LIVE,
                       0)) {
    atomic_fetch_sub_explicit(&tdm__g.calls, 1, memory_order_release);
    return tdm__enter_fail();
  }
  *counted = 1;
  return 0;
}
static inline void tdm__leave(int *counted) {
  if (*counted) atomic_fetch_sub_explicit(&tdm__g.calls, 1, memory_order_release);
}
/* At the start of a public call's body, as a statement of its own. */
#define TDM__ENTER()                                                      \
  __attribute__((cleanup(tdm__leave))) int tdm__entered_ = 0;            \
  do {                                                                    \
    int enter_rc_ = tdm__enter(&tdm__entered_);                          \
    if (enter_rc_ < 0) return enter_rc_;                                  \
  } while (0)
/* Whether this thread is one of tandem's running the program's code (a host task, a
 * keep-alive release): admitted while CLOSING. */
bool tdm__on_tandem_thread(void);
/* Makes a forked child's calls fail with TDM_EFORK (installed by the first init, or the first
 * tandem/cpu.h call, whichever comes first). */
void tdm__fork_guard(void);

int tdm__device_check(tdm_device *dev);
/* Marks the device lost if code is TDM_EDEVLOST; returns code. Inline: every backend call of
 * the submission path passes through it, and almost always with 0. */
int tdm__device_lost(tdm_device *dev, int code);
static inline int tdm__device_note(tdm_device *dev, int code) {
  return __builtin_expect(code == TDM_EDEVLOST, 0) ? tdm__device_lost(dev, code) : code;
}

/* ---- errors.c ---- */
/* This thread's last message without the code name, for quoting in an outer message. */
const char *tdm__last_detail(void);
int tdm__error(int code, int native, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- fault.c: fault injection. Every host allocation of the core (tdm__malloc, tdm__calloc,
 * tdm__malloc_quiet) and every fallible wrapper of backend.c pass the fault hook; backend
 * entries that cannot fail (void ones, native_export, native_notify's declining) do not. */
/* Whether the armed fault fires here: inline, since every backend call of the submission path
 * asks, and nothing is armed outside fault tests (one relaxed load then). */
extern _Atomic int tdm__fault_armed;
int tdm__fault_slow(unsigned kind);
static inline int tdm__fault(unsigned kind) {
  return atomic_load_explicit(&tdm__fault_armed, memory_order_relaxed) ? tdm__fault_slow(kind)
                                                                        : 0;
}
void *tdm__malloc(size_t n);
void *tdm__calloc(size_t n, size_t size);
/* One zeroed struct that starts on a cache line (freed with free): for the recycled structs
 * of the submission path, whose layout puts what a submission writes in their first lines. */
#define TDM__CACHE_LINE 64
void *tdm__calloc_lines(size_t size);
/* The same as tdm__malloc, leaving the thread's message as it is when the fault fires: for an
 * allocation whose failure is nobody's error (it may run on a caller's thread, after the
 * caller's own call has set its message). */
void *tdm__malloc_quiet(size_t n);
int tdm__fault_code_taken(void);
/* Whether $TANDEM_BACKENDS allows the named backend. */
bool tdm__backend_allowed(const char *name);

/* ---- event.c ---- */
/* What a submission writes and a completion or free reads comes first, within two cache lines
 * (the core allocates events on a line boundary); what only failures, markers and shutdown
 * read comes last. */
struct tdm__event {
  void *next;               /* free-list link; must be first */
  _Atomic uint32_t magic;   /* TDM__MAGIC_EVENT while in use, for internal consistency */
  _Atomic int refs;         /* every holder: the command, the tracker, the callers (one) */
  _Atomic int urefs;        /* the callers' references; together they hold one of refs */
  uint32_t slot, gen;       /* the handle table's slot, for the struct's life; its generation */
  _Atomic uint64_t handle;  /* the handle callers hold for this use of the struct */
  _Atomic int done;
  int status;
  int native;
  bool timed;
  bool why_relayed;         /* why tells of an earlier failure this event reports (a marker's,
                               a TDM_EDEP's), not of its own */
  uint64_t t_ns;            /* completion time on the monotonic clock, when timed */
  uint64_t seq;             /* position in its queue */
  uint64_t covers;          /* the command waits for every command of its queue numbered up to
                               this (queue order, a full barrier or marker, a gate's), so a host
                               task of the queue numbered so cannot wait for it */
  const char *op;           /* what the command was, for messages */
  /* Failures only: what the message of its waiters adds after ": " (owned, at most
   * TDM__WHY_MAX bytes, freed when the event is); NULL on success, when there is nothing to
   * add, or when no memory was left to keep it. Written before done, read after. */
  char *why;
  tdm__queue *q;             /* holds a reference on q */
  tdm__waiter *waiters;     /* under q->mu */
  _Atomic(void *) bev;      /* native event, owned (native backends); may be set after the
                               event is published (host-side deferral), hence atomic */
  const char *cause_op;     /* markers only: the op of the failure the marker reports, and */
  uint64_t cause_seq;       /* its number (set when the marker completes) */
  tdm__event *next_all;      /* every event q ever allocated, so shutdown frees them all */
};
/* Resolves a caller's handle to a live event that the caller holds a reference to. */
int tdm__event_get(tdm_event *h, tdm__event **ev);
/* Hands ev to the caller as a new reference; returns the handle. */
tdm_event *tdm__event_handout(tdm__event *ev);
void tdm__event_ref(tdm__event *ev);
void tdm__event_unref(tdm__event *ev);
/* Completes ev and drops one reference (the command's) in the same critical section, so a
 * thread woken by the completion never sees that reference. */
void tdm__event_complete_unref(tdm__event *ev, int status, int native);
void tdm__event_free(tdm__event *ev);
int tdm__event_on_complete(tdm__event *ev, tdm__waiter *w);
/* Completes n events of q whose status and native code are set already, dropping one
 * reference of each, in one critical section; then runs their continuations, in order. */
void tdm__event_complete_batch(tdm__queue *q, tdm__event *const *evs, size_t n);
/* ---- event.c: failures in words ---- */
#define TDM__WHY_MAX 1024
/* A copy of s cut to TDM__WHY_MAX bytes, or NULL (s empty, or no memory): failure paths only. */
char *tdm__why_dup(const char *s);
/* ev's failure as its waiters hear it: "host task on cpu:0/q1 (command #5) failed", then ": "
 * and ev->why if it has one. */
void tdm__event_describe(const tdm__event *ev, char *buf, size_t n);
/* A wait's failure in words: head ("wait on cpu:0/q2 (command #3)"), then "failed" and the
 * account of the event it waited for (cause), a chain of waits summarized (event.c). */
void tdm__wait_words(char *buf, size_t n, const char *head, const char *cause);
/* For a command that fails because ev did (TDM_EDEP): ev's account of the failure it relays,
 * or ev described. NULL when no memory is left. */
char *tdm__event_cause_dup(const tdm__event *ev);
/* Blocks until ev completes; returns its status. No deadlock check. */
int tdm__event_wait_raw(tdm__event *ev);
/* The same for waits a caller's thread makes (public waits, syncs, destroys): a pool thread
 * that blocks here is replaced while it waits (threadpool.c), so the pool cannot starve. */
int tdm__event_wait_blocking(tdm__event *ev);
/* The same for tdm_event_wait: on a pool thread that is the last one not blocked, with every
 * spare started (threadpool.c), it does not wait and returns TDM__WAIT_REFUSED, with the
 * message set (the caller returns TDM_EDEADLK). */
#define TDM__WAIT_REFUSED (-100000)
int tdm__event_wait_host(tdm__event *ev);
/* Whether a wait of this thread would be refused so now (tdm_queue_sync asks before it
 * submits its marker, which would otherwise clear an error nobody hears of). */
bool tdm__threadpool_starved(void);
uint64_t tdm__now_ns(void);

/* ---- event.c: wake-ups of a queue's waiters ---- */
/* Wake-ups of q->cv are made after the waker lets go of q->mu (a woken thread that shares the
 * CPU then does not block on it at once). Each one in progress is counted from inside the lock
 * to after the signal: a driver's callback thread may still be signaling a queue whose work it
 * just completed when shutdown comes to destroy it, so shutdown first waits for the count to
 * reach zero (tdm__signals_quiesce). A workq counts its own (util/workq.h). */
extern _Atomic long tdm__signaling;
static inline void tdm__signal_begin(void) {
  atomic_fetch_add_explicit(&tdm__signaling, 1, memory_order_relaxed);
}
static inline void tdm__signal_end(void) {
  atomic_fetch_sub_explicit(&tdm__signaling, 1, memory_order_release);
}
void tdm__signals_quiesce(void);

/* ---- queue.c ---- */
/* An entry of a queue's list of events its next submission must take (xwait below). */
typedef struct tdm__xwait {
  tdm__event *ev; /* one reference, the list's */
  bool ordered;   /* a device-side wait already made natively (tdm__dep.ordered) */
} tdm__xwait;

/* Laid out by who writes what, each side apart from the others by at least a cache line
 * (the apart_ gaps), so a thread completing commands does not take the lines a submitting
 * thread reads and writes on every call (and the other way round): the header, read on every
 * call and written almost never; the submitting side (submit_mu and what it guards, the lazy
 * list); the executor's workq, which both sides use; and the completing side. */
struct tdm__queue {
  /* ---- read on every call, written almost never ---- */
  _Atomic uint32_t magic;   /* TDM__MAGIC_QUEUE while live */
  uint32_t slot, gen;       /* the handle table's slot, for the struct's life; its generation */
  _Atomic uint64_t handle;  /* the handle of this queue while it lives, else 0 */
  uint64_t handle_was;      /* the handle it had, for tdm_event_queue after it is destroyed */
  _Atomic bool claimed;     /* a tdm_queue_destroy is underway: a second one gets EHANDLE */
  tdm__queue *next_all;      /* ctx.queues */
  tdm__queue *next_free;     /* ctx.free_queues */
  tdm_device *dev;
  unsigned flags;
  bool owned_by_tandem;     /* a cached default queue */
  bool adopted;
  bool imports;             /* a device's queue of imported events: no backend queue, no handle */
  _Atomic bool destroying;
  int id;
  char label[48];           /* "cpu:0/q3", for messages */
  tdm__bqueue *bq;
  bool can_lazy; /* in-order, neither timed nor traced at creation, backend has native_done */
  char apart0_[64];
  /* ---- the submitting side ---- */
  pthread_mutex_t submit_mu;
  uint64_t seq;             /* under submit_mu */
  tdm__event *all_events;    /* under submit_mu */
  /* Counters, per queue so submitters share none. The submitter's side has one writer (under
   * submit_mu) and is never written by completing threads, so a submission takes no atomic
   * read-modify-write on a line they touch: events alive = submitted - freed, commands
   * pending = submitted - done. ref_stock: queue references taken ahead, a batch at a time,
   * one of which each new event takes (under submit_mu). */
  _Atomic long n_submitted;
  int ref_stock;
  /* tracker (tracker.c), under submit_mu */
  tdm__event **trk;
  size_t ntrk, trk_cap;
  tdm__event *gate;          /* out-of-order: the last barrier or wait; later work waits on it */
  /* Copies from other queues (tdm_memcpy_cross) that later work on this queue must wait for:
   * they become dependencies of the next submission (in-order) or of every submission until
   * a barrier (out-of-order). Capacity trk_cap; nxres slots are reserved by copies underway.
   * Also, on in-order queues, the events of device-side waits made without a command
   * (tdm_queue_wait, queue_wait_now): ordered, the native queue waits for them already, and
   * the next command takes them only for their status. */
  tdm__xwait *xwait;
  size_t nxwait, nxres;
  /* Lazy completion (exec.c): the lazy list, its newest command with a native handle
   * (lz_last) and the candidate for the next reap, under lz_mu (which also orders every
   * hand-over to the executor); lz_n its length; lz_quiet how many quiet commands without a
   * handle end it; lz_reap asks the submitting thread for a reap; x_pushed (under lz_mu) and
   * x_done (below) count the commands handed to the executor and finished by it; lz_reaping:
   * a reap is finishing commands. Queues without can_lazy use none of them. */
  pthread_mutex_t lz_mu;
  tdm__cmd *lz_head, *lz_tail, *lz_last, *lz_cand;
  unsigned long lz_steps, x_pushed;
  _Atomic long lz_n;
  _Atomic int lz_quiet, lz_reap, lz_reaping;
  /* The recycled structs: each list's local half is the submitting side's, the half other
   * threads return items to lies a line apart inside the list (tdm__freelist).
   * keeps: keep-alives (release.c). */
  tdm__freelist events, cmds, keeps;
  char apart1_[64];
  /* ---- both sides ---- */
  /* Native backends: the executor (exec.c), a workq serving natively enqueued commands. Its
   * lock and condition live as long as the struct (a waiter may kick the executor of a queue
   * that is being destroyed). */
  tdm__workq xq;
  char apart2_[64];
  /* ---- the completing side ---- */
  _Atomic int refs;         /* 1 for the handle while live, 1 per event, and ref_stock */
  pthread_mutex_t mu;
  pthread_cond_t cv;        /* completions of this queue's events (with mu) */
  int cv_sleepers;          /* threads waiting on cv, under mu */
  _Atomic long n_done;
  _Atomic long n_freed;
  _Atomic int first_error;  /* first failure since the last sync */
  const char *first_error_op; /* its command's op and number; with first_error, under mu */
  uint64_t first_error_seq;
  char *first_error_why;    /* that command described (tdm__event_describe), owned, or NULL;
                               under mu; a sync marker takes it */
  int chain_error;          /* in-order: an earlier failure; touched only in execution order */
  /* x_held: quiet commands waiting for the next native handle, in order; the executor's
   * thread alone touches them. */
  tdm__cmd *x_held, **x_held_tail;
  _Atomic unsigned long x_done;
  uint64_t trace_last_end;  /* tracing, in-order queues: end of the last command */
};
/* Resolves a caller's handle to a live queue (not being destroyed, device not lost). */
int tdm__queue_get(tdm_queue *h, tdm__queue **q);
/* q's handle as the caller sees it. */
static inline tdm_queue *tdm__queue_handle(const tdm__queue *q) {
  return (tdm_queue *)(uintptr_t)q->handle_was;
}
/* The live queue h names, or NULL (no other check). */
static inline tdm__queue *tdm__queue_lookup(tdm_queue *h) {
  tdm__queue *q = tdm__handle_obj(h, TDM__KIND_QUEUE);
  return q && atomic_load_explicit(&q->handle, memory_order_relaxed) == (uintptr_t)h ? q : NULL;
}
int tdm__queue_create_internal(tdm_device *dev, unsigned flags, void *adopt, bool owned,
                               tdm__queue **out);
int tdm__queue_destroy_internal(tdm__queue *q);
/* The last shutdown's: q is gone when it returns, even if its drain marker cannot be made. */
void tdm__queue_destroy_final(tdm__queue *q);
/* A device's queue of imported events (import.c): an out-of-order queue with no backend queue,
 * no executor and no handle; its commands come complete with a native handle. */
int tdm__queue_create_imports(tdm_device *dev, tdm__queue **out);
/* Frees it once every command on it has completed (waits for them). */
void tdm__queue_destroy_imports(tdm__queue *q);
void tdm__queue_unref(tdm__queue *q);
/* Drops n references at once (a batch of freed events'). */
void tdm__queue_unref_n(tdm__queue *q, int n);
void tdm__queues_free_all(void);
/* Gives back the native events of events callers still hold; before modules unload. */
void tdm__queues_release_native(void);

/* ---- submit.c ---- */
typedef struct tdm__spec {
  tdm__cmd_kind kind;
  unsigned flags;      /* TDM__CMD_* */
  const char *op;      /* for messages: "memcpy", "host task"... */
  bool gate;           /* out-of-order: later commands wait for this one */
  bool all_prior;      /* out-of-order: waits for every tracked entry (marker, full barrier) */
  bool untracked;      /* not added to the tracker (the tracker's own collapse barrier) */
  void *u_ptr0;        /* copy.dst, fill.dst, free_.ptr (host tasks: unused) */
  const void *u_ptr1;  /* copy.src, host.arg */
  size_t u_n;
  int u_value;
  tdm_host_fn fn;      /* host.fn: a function pointer, which a void * may not hold in C */
  tdm__memref dref, sref; /* copy (both), fill and free (dref): what the registry said */
  void *native;        /* an import (a barrier without deps): the handle event_import made,
                          with its two references; nothing goes to the backend's submit */
} tdm__spec;
/* The longest dependency list a caller may pass: far more than memory could hold, and small
 * enough that no size computed from it (with the implicit dependencies added) wraps. */
#define TDM__DEPS_MAX (SIZE_MAX / 4 / sizeof(tdm__dep))
/* A caller's dependency list resolved to events (inline when short). */
#define TDM__INLINE_DEPLIST 8
typedef struct tdm__deplist {
  tdm__event **v;
  size_t n;
  tdm__event *inl[TDM__INLINE_DEPLIST];
} tdm__deplist;
/* Checks and resolves deps; on success the caller ends with tdm__deps_put. */
int tdm__deps_get(size_t ndeps, tdm_event *const *deps, tdm__deplist *out);
void tdm__deps_put(tdm__deplist *d);
/* The common submission path: takes q->submit_mu, reserves everything, hands the command to
 * the backend, tracks it. q and deps must have been checked. The new event goes to an
 * internal holder through out and to the caller through out_handle, each with a reference
 * of its own. */
int tdm__submit(tdm__queue *q, const tdm__spec *spec, size_t ndeps, tdm__event *const *deps,
                tdm__event **out, tdm_event **out_handle);
/* The same with q->submit_mu already held. */
int tdm__submit_locked(tdm__queue *q, const tdm__spec *spec, size_t ndeps,
                       tdm__event *const *deps, tdm__event **out, tdm_event **out_handle);
void tdm__cmd_run(tdm__cmd *cmd);
/* Frees a command of a queue's free list (at shutdown), with the storage it kept. */
void tdm__cmd_mem_free(void *p);
/* The rest of tdm__cmd_run once cmd's native work is known to be done, with its status. */
void tdm__cmd_finish(tdm__cmd *cmd, int nstatus, int native);
/* Completes a reap's commands, the list linked by next (exec.c), in order. */
void tdm__cmd_finish_reaped(tdm__queue *q, tdm__cmd *list);
void tdm__cmd_done(tdm__cmd *cmd, int status, int native);
/* Completions gathered on this thread between tdm__batch_begin and tdm__batch_end (a reap:
 * exec.c): the commands are done one by one, their events complete together at the end.
 * One queue's commands only; past TDM__BATCH_MAX they complete at once, unbatched. */
#define TDM__BATCH_MAX 64
typedef struct tdm__batch {
  tdm__queue *q;
  size_t n;
  tdm__event *ev[TDM__BATCH_MAX];
} tdm__batch;
void tdm__batch_begin(tdm__batch *b, tdm__queue *q);
void tdm__batch_end(tdm__batch *b);
/* Thread-local: the queue and sequence number of the host task running on this thread. */
extern _Thread_local tdm__queue *tdm__tls_queue;
extern _Thread_local uint64_t tdm__tls_seq;

/* ---- exec.c: the per-queue executor ---- */

/* Once per queue struct: the executor's workq and the lazy list's lock (they live as long as
 * the struct); tdm__exec_fini destroys them with it. */
int tdm__exec_init(tdm__queue *q);
void tdm__exec_fini(tdm__queue *q);
int tdm__exec_start(tdm__queue *q);
/* Hands the lazy list over, runs what is queued, then joins the thread. */
void tdm__exec_stop(tdm__queue *q);
/* A natively enqueued command of q: onto the lazy list or to the executor (exec.c). Called
 * in q's submission order. */
void tdm__exec_push(tdm__cmd *cmd);
/* Whether q's next command may go quiet and without a native handle (TDM__CMD_QUIET): false
 * once enough of them end q's lazy list that a reap would have nothing to ask (exec.c). Under
 * q's submission lock. */
bool tdm__exec_quiet_ok(const tdm__queue *q);
/* After a submission, with no lock held: finishes the lazy commands known complete, when a
 * push asked for it (exec.c). */
void tdm__exec_reap(tdm__queue *q);
/* Hands q's lazy commands to its executor and wakes it if it sleeps with commands queued:
 * called before anyone waits for an event of q (the executor otherwise sleeps until work
 * needs it; see exec.c). Harmless on queues without an executor, and on destroyed ones. */
void tdm__exec_kick(tdm__queue *q);

/* ---- threadpool.c: tandem's shared host threads, for out-of-order queues ---- */
int tdm__threadpool_start(void);
void tdm__threadpool_stop(void);
/* Runs cmd (tdm__cmd_run) on a pool thread once every dependency has completed. */
void tdm__threadpool_after_deps(tdm__cmd *cmd);
void tdm__threadpool_ready(tdm__cmd *cmd);
/* A natively enqueued command: to the queue's executor (in-order) or, on an out-of-order
 * queue of a backend with native_notify, to the thread pool when the driver says it completed. */
void tdm__cmd_native(tdm__cmd *cmd);

/* ---- trace.c ---- */
extern _Atomic bool tdm__tracing;
void tdm__trace_start(void);
void tdm__trace_cmd(tdm__cmd *cmd, int status);
void tdm__trace_flush(void);

/* ---- tracker.c ---- */
int tdm__tracker_init(tdm__queue *q);
void tdm__tracker_fini(tdm__queue *q);
/* Makes room for one more entry (pruning, or collapsing into a barrier); submit_mu held. */
int tdm__tracker_reserve(tdm__queue *q);
/* Drops completed entries. */
void tdm__tracker_prune(tdm__queue *q);
/* Records ev (referenced by the tracker); cannot fail after a successful reserve. */
void tdm__tracker_add(tdm__queue *q, tdm__event *ev);
/* Cross-queue copies: reserve a slot (may submit a barrier to make room), then fill it. */
int tdm__xwait_reserve(tdm__queue *q);
/* Under submit_mu: whether the list has room for one more entry (pruning it if full). */
bool tdm__xwait_room(tdm__queue *q);
/* Under submit_mu, in-order q with room: adds ev as an ordered entry (with a reference of
 * the list's), or marks its entry ordered if it has one. */
void tdm__xwait_add_ordered(tdm__queue *q, tdm__event *ev);
void tdm__xwait_fill(tdm__queue *q, tdm__event *ev);
void tdm__xwait_cancel(tdm__queue *q);
/* After a submission: drops entries the queue's order now covers. */
void tdm__xwait_consumed(tdm__queue *q, bool covers_all);

/* ---- backend.c: the one gateway to the backend table ----
 * One wrapper per entry (backend.h documents the entries); nothing else in the core calls
 * through the table. Fallible wrappers return 0 or TDM_E*, with the message set, and mark the
 * device lost on TDM_EDEVLOST. */
typedef struct tdm__alloc tdm__alloc;
int tdm__b_check_version(const tdm__backend *be, unsigned *version);
const char *tdm__b_name(const tdm__backend *be);
int tdm__b_init(const tdm__backend *be, int *ndevices);
void tdm__b_shutdown(const tdm__backend *be);
int tdm__b_device_info(tdm_device *dev);       /* fills dev->info */
int tdm__b_address_range(tdm_device *dev);     /* sets dev->range_base and range_end */
int tdm__b_queue_create(tdm__queue *q, void *adopt); /* sets q->bq (q->dev, q->flags set) */
void tdm__b_queue_destroy(tdm__queue *q);
int tdm__b_queue_native(tdm__queue *q, void **native);
int tdm__b_submit(tdm__queue *q, tdm__cmd *cmd);
/* queue_wait_now: 0 made, 1 the backend cannot (no entry, or ev not native to it), or an error */
int tdm__b_queue_wait_now(tdm__queue *q, tdm__event *ev);
int tdm__b_mem_alloc(tdm_device *dev, tdm_mem_kind kind, size_t size, void **ptr,
                     tdm__bmem *bm);
void tdm__b_mem_free(tdm_device *dev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm);
int tdm__b_host_register(tdm_device *dev, void *ptr, size_t size);
void tdm__b_host_unregister(tdm_device *dev, void *ptr);
int tdm__b_device_native(tdm_device *dev, void **native);
int tdm__b_mem_native(const tdm__alloc *a, const void *ptr, void **native, size_t *offset);
int tdm__b_mem_import(tdm_device *dev, void *native, size_t size, void **ptr, tdm__bmem *bm);
int tdm__b_event_import(tdm_device *dev, void *native, void **handle);
void *tdm__b_native_export(const tdm_device *dev, void *handle);
int tdm__b_event_elapsed(const tdm__event *start, const tdm__event *end, double *ms);
bool tdm__b_is_native(const tdm_device *dev);   /* a native backend (it has native_wait) */
bool tdm__b_wakes_lazily(const tdm_device *dev);
bool tdm__b_can_flush(const tdm_device *dev);
bool tdm__b_can_query(const tdm_device *dev); /* native_done */
/* native_done (backend.h); 0 without one. */
int tdm__b_native_done(const tdm_device *dev, void *handle);
bool tdm__b_can_notify(const tdm_device *dev);
bool tdm__b_can_import(const tdm_device *dev);  /* event_import and native_notify */
int tdm__b_native_wait(tdm_device *dev, void *handle, int *native);
int tdm__b_native_notify(tdm_device *dev, void *handle, void (*fn)(void *), void *arg);
void tdm__b_native_release(const tdm_device *dev, void *handle);
void tdm__b_gate_open(const tdm_device *dev, void *gate);
int tdm__b_native_flush(tdm__queue *q, void **handle);
int tdm__b_host_copy(tdm_device *dev, tdm__cmd *cmd); /* NULL entry: memmove */

/* ---- memory.c ---- */
struct tdm__alloc {
  uintptr_t base;
  size_t size;
  tdm_mem_kind kind;
  tdm_device *dev;
  tdm__bmem bm;             /* the backend's handle (mem_alloc, mem_import) and TDM__BMEM_* */
  bool freeing;             /* a stream-ordered free is pending */
};
/* Checks a copy or fill on q and resolves TDM_COPY_AUTO. alt: a second device whose memory
 * may also take part (the destination queue's of a cross-queue copy), or NULL. */
/* The checks fill a tdm__memref per side from the registry, for the command (backend.h). */
int tdm__mem_check_copy(tdm__queue *q, tdm_device *alt, void *dst, const void *src, size_t n,
                        tdm_copy_dir *dir, tdm__memref *d, tdm__memref *s);
/* Checks a cross-queue copy (run on src_q; dst_q waits for it). */
int tdm__mem_check_cross(tdm__queue *src_q, tdm__queue *dst_q, void *dst, const void *src,
                         size_t n, tdm__memref *d, tdm__memref *s);
int tdm__mem_check_fill(tdm__queue *q, void *dst, size_t n, tdm__memref *d);
/* Marks the allocation at ptr as being freed and describes it for the free command. */
int tdm__mem_begin_free(tdm__queue *q, void *ptr, tdm__memref *m);
void tdm__mem_cancel_free(void *ptr);
/* freed: the backend already freed it natively; only the registry entry goes. */
void tdm__mem_finish_free(void *ptr, bool freed);
void tdm__mem_free_all(void);

/* ---- release.c ---- */
/* Set on the release thread, whose releases are the caller's code. */
extern _Thread_local bool tdm__tls_releasing;
int tdm__release_start(void);
void tdm__release_stop(void);
/* Keep-alives registered and not yet released. */
long tdm__release_pending(void);

/* ---- import.c ---- */
/* The last shutdown: waits for every imported event and frees the devices' import queues. */
void tdm__imports_stop(void);

/* ---- defaults.c ---- */
void tdm__defaults_forget(tdm__queue *q);
void tdm__defaults_destroy_all(void);

/* ---- modules.c ---- */
void tdm__modules_load(void);
void tdm__backend_add(const tdm__backend *be, void *dl, const char *detail);
void tdm__modules_unload(void);

#endif /* TANDEM_CORE_INTERNAL_H */
