/* submit.c: the one submission path every command takes (validate, reserve, hand to the
 * backend, track), the execution and error rules applied when a command runs, and the public
 * submission calls built on them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

_Thread_local tdm__queue *tdm__tls_queue;
_Thread_local uint64_t tdm__tls_seq;

/* A caller's list longer than the inline one is resolved into storage of the calling thread's,
 * kept from call to call (and freed by a key's destructor when the thread exits), so a caller
 * that keeps passing long lists allocates only while its lists grow. A second list on the same
 * thread before the first is put back (no caller does that today), or a thread whose storage
 * cannot be registered with the key, falls back to an allocation per call. */
static pthread_key_t deps_key;
static pthread_once_t deps_once = PTHREAD_ONCE_INIT;
static bool deps_key_ok;
static _Thread_local tdm__event **tls_deps;
static _Thread_local size_t tls_deps_cap;
static _Thread_local bool tls_deps_busy;

static void deps_key_make(void) { deps_key_ok = pthread_key_create(&deps_key, free) == 0; }

static tdm__event **deps_storage_get(size_t n) {
  if (tls_deps_busy) return tdm__malloc(n * sizeof(tdm__event *));
  if (tls_deps_cap < n) {
    pthread_once(&deps_once, deps_key_make);
    if (!deps_key_ok) return tdm__malloc(n * sizeof(tdm__event *));
    tdm__event **v = tdm__malloc(n * sizeof *v);
    if (!v) return NULL;
    if (pthread_setspecific(deps_key, v)) {
      free(v);
      return tdm__malloc(n * sizeof(tdm__event *));
    }
    free(tls_deps);
    tls_deps = v;
    tls_deps_cap = n;
  }
  tls_deps_busy = true;
  return tls_deps;
}

static void deps_storage_put(tdm__event **v) {
  if (v == tls_deps)
    tls_deps_busy = false;
  else
    free(v);
}

int tdm__deps_get(size_t ndeps, tdm_event *const *deps, tdm__deplist *out) {
  out->n = 0;
  out->v = out->inl;
  if (ndeps && !deps) return tdm__error(TDM_EINVAL, 0, "ndeps is %zu but deps is NULL", ndeps);
  /* No list of this length can exist in memory; and the command's own list (the caller's
   * plus the implicit ones, tdm__dep each) must be sizable without wrapping. */
  if (ndeps > TDM__DEPS_MAX)
    return tdm__error(TDM_EINVAL, 0, "ndeps is %zu, more than a list can hold (%zu)", ndeps,
                      (size_t)TDM__DEPS_MAX);
  if (ndeps > TDM__INLINE_DEPLIST && !(out->v = deps_storage_get(ndeps))) {
    out->v = out->inl;
    return tdm__error(TDM_ENOMEM, 0, "no memory for a list of %zu dependencies", ndeps);
  }
  for (size_t i = 0; i < ndeps; i++) {
    int rc = tdm__event_get(deps[i], &out->v[i]);
    if (rc) {
      tdm__deps_put(out);
      return tdm__error(rc, 0, "dependency %zu: %s", i, tdm__last_detail());
    }
  }
  out->n = ndeps;
  return 0;
}

void tdm__deps_put(tdm__deplist *d) {
  if (d->v != d->inl) deps_storage_put(d->v);
  d->v = d->inl;
  d->n = 0;
}

static bool ooo(const tdm__queue *q) { return (q->flags & TDM_QUEUE_OUT_OF_ORDER) != 0; }

/* A command as the core allocates it: what backends see, and storage for dependency lists
 * longer than the inline one, which stays with the command across uses (up to DEPS_KEPT
 * entries), so a queue that keeps submitting long lists allocates only until its commands
 * have grown to fit. */
typedef struct cmd_mem {
  tdm__cmd cmd; /* first: its first member is the free list's link */
  tdm__dep *heap;
  size_t heap_cap;
} cmd_mem;

#define DEPS_KEPT 256

void tdm__cmd_mem_free(void *p) {
  cmd_mem *m = p;
  free(m->heap);
  free(m);
}

/* Storage for n dependencies (n > TDM__INLINE_DEPS), or NULL. */
static tdm__dep *deps_storage(cmd_mem *m, size_t n) {
  if (m->heap_cap >= n) return m->heap;
  tdm__dep *d = tdm__malloc(n * sizeof *d);
  if (!d) return NULL;
  free(m->heap);
  m->heap = d;
  m->heap_cap = n;
  return d;
}

static void cmd_release_deps(tdm__cmd *cmd) {
  for (size_t i = 0; i < cmd->ndeps; i++) tdm__event_unref(cmd->deps[i].ev);
  cmd_mem *m = (cmd_mem *)cmd;
  /* Only a list that outgrew the inline one can have grown past DEPS_KEPT (and heap_cap lies
   * on a line a short list never touches). */
  if (cmd->deps != cmd->inline_deps && m->heap_cap > DEPS_KEPT) {
    free(m->heap);
    m->heap = NULL;
    m->heap_cap = 0;
  }
  cmd->deps = cmd->inline_deps;
  cmd->ndeps = 0;
}

/* Reserves a command and its event from q's free lists (allocating only when they are empty). */
static int reserve(tdm__queue *q, size_t total, tdm__cmd **cmd_out, tdm__event **ev_out) {
  tdm__cmd *cmd = tdm__freelist_get(&q->cmds);
  if (!cmd) {
    cmd_mem *m = tdm__calloc_lines(sizeof *m);
    if (!m) return tdm__error(TDM_ENOMEM, 0, "no memory for a command on %s", q->label);
    cmd = &m->cmd;
  }
  cmd->deps = cmd->inline_deps;
  if (total > TDM__INLINE_DEPS && !(cmd->deps = deps_storage((cmd_mem *)cmd, total))) {
    cmd->deps = cmd->inline_deps;
    tdm__freelist_put(&q->cmds, cmd);
    return tdm__error(TDM_ENOMEM, 0, "no memory for %zu dependencies on %s", total, q->label);
  }
  tdm__event *ev = tdm__freelist_get(&q->events);
  if (!ev && (ev = tdm__calloc_lines(sizeof *ev))) {
    if (tdm__slot_new(ev, &ev->slot, &ev->gen)) {
      free(ev);
      ev = NULL;
    } else {
      ev->next_all = q->all_events;
      q->all_events = ev;
    }
  }
  if (!ev) {
    cmd->deps = cmd->inline_deps;
    tdm__freelist_put(&q->cmds, cmd);
    return tdm__error(TDM_ENOMEM, 0, "no memory for an event on %s", q->label);
  }
  *cmd_out = cmd;
  *ev_out = ev;
  return 0;
}

static void add_dep(tdm__cmd *cmd, tdm__event *ev, bool ordered) {
  tdm__event_ref(ev);
  tdm__dep *d = &cmd->deps[cmd->ndeps++];
  d->ev = ev;
  d->cmd = cmd;
  d->w.next = NULL;
  d->w.fn = NULL;
  d->ordered = ordered;
}

/* The implicit dependencies of a submission: copies from other queues that this queue must
 * wait for, and on out-of-order queues the gate (last barrier or wait) and, for markers and full
 * barriers, every tracked entry. Returns how many dependencies the command may have at most. */
static size_t implicit_deps(tdm__queue *q, const tdm__spec *spec, size_t ndeps,
                            tdm__event **gate_dep, size_t *nall) {
  *gate_dep = NULL;
  *nall = 0;
  if (ooo(q)) {
    /* A gate that failed stays a dependency until a sync has reported it (tdm_queue_sync
     * drops it), so every later command fails whenever it is submitted. */
    if (q->gate && (!atomic_load(&q->gate->done) || q->gate->status != 0)) *gate_dep = q->gate;
    if (spec->all_prior) *nall = q->ntrk;
  }
  return ndeps + (*gate_dep ? 1 : 0) + *nall + q->nxwait;
}

/* Whether only the queue itself can observe the command's completion (TDM__CMD_QUIET). */
static bool quiet(const tdm__queue *q, const tdm__spec *spec, bool observed) {
  return !observed && !ooo(q) && !(q->flags & TDM_QUEUE_TIMING) &&
         spec->kind != TDM__CMD_HOST && spec->kind != TDM__CMD_FREE &&
         spec->kind != TDM__CMD_MARKER &&
         !atomic_load_explicit(&tdm__tracing, memory_order_relaxed) && tdm__exec_quiet_ok(q);
}

/* The command's kind, flags and operands, from the spec. */
static void cmd_fill(tdm__cmd *cmd, const tdm__spec *spec, bool is_quiet) {
  cmd->kind = spec->kind;
  cmd->flags = spec->flags | (spec->all_prior ? TDM__CMD_ALL_PRIOR : 0) |
               (is_quiet ? TDM__CMD_QUIET : 0);
  cmd->ndeps = 0;
  cmd->bdata = NULL;
  cmd->bcount = 0;
  cmd->t_start = 0;
  cmd->t_submit = atomic_load_explicit(&tdm__tracing, memory_order_relaxed) ? tdm__now_ns() : 0;
  cmd->next = NULL;
  cmd->wait = NULL;
  cmd->gate = NULL;
  switch (spec->kind) {
    case TDM__CMD_COPY:
      cmd->u.copy.dst = spec->u_ptr0;
      cmd->u.copy.src = spec->u_ptr1;
      cmd->u.copy.n = spec->u_n;
      cmd->u.copy.d = spec->dref;
      cmd->u.copy.s = spec->sref;
      break;
    case TDM__CMD_FILL:
      cmd->u.fill.dst = spec->u_ptr0;
      cmd->u.fill.value = spec->u_value;
      cmd->u.fill.n = spec->u_n;
      cmd->u.fill.d = spec->dref;
      break;
    case TDM__CMD_HOST:
      cmd->u.host.fn = spec->fn;
      cmd->u.host.arg = (void *)spec->u_ptr1;
      break;
    case TDM__CMD_FREE:
      cmd->u.free_.ptr = spec->u_ptr0;
      cmd->u.free_.m = spec->dref;
      break;
    default: break;
  }
}

/* The caller's dependencies, then the implicit ones (implicit_deps). A dependency that has
 * completed without error orders nothing any more: host-observed completion means its effects
 * are visible to whatever runs after it, so neither the backend nor the executor need to hear
 * of it (a failed one is kept: it fails the command). */
static void cmd_add_deps(tdm__queue *q, tdm__cmd *cmd, size_t ndeps, tdm__event *const *deps,
                         tdm__event *gate_dep, size_t nall) {
  for (size_t i = 0; i < ndeps; i++)
    if (!atomic_load_explicit(&deps[i]->done, memory_order_acquire) || deps[i]->status != 0)
      add_dep(cmd, deps[i], false);
  if (gate_dep) add_dep(cmd, gate_dep, false);
  for (size_t i = 0; i < nall; i++)
    if (q->trk[i] != q->gate) add_dep(cmd, q->trk[i], false);
  /* A cross-queue copy that has completed orders nothing; a device-side wait that failed
   * still fails the queue. */
  for (size_t i = 0; i < q->nxwait; i++) {
    const tdm__xwait *x = &q->xwait[i];
    if (!atomic_load(&x->ev->done) || (x->ordered && x->ev->status != 0))
      add_dep(cmd, x->ev, x->ordered);
  }
}

/* Readies ev for this use with refs references (urefs of them the caller's) and issues its
 * handle. Every reference the event will have is taken before the backend sees the command:
 * the command may complete (and drop its own) before submit returns. No other thread can see
 * the event before the backend hands the command over (under a lock, which publishes these
 * stores), so they need no ordering of their own: plain stores let the CPU go on while the
 * event's cache line, last written by the thread that completed its previous use, comes
 * back. */
static uint64_t event_begin(tdm__queue *q, tdm__event *ev, const tdm__spec *spec, int refs,
                            int urefs) {
  atomic_store_explicit(&ev->refs, refs, memory_order_relaxed);
  atomic_store_explicit(&ev->urefs, urefs, memory_order_relaxed);
  atomic_store_explicit(&ev->done, 0, memory_order_relaxed);
  ev->status = 0;
  ev->native = 0;
  ev->timed = (q->flags & TDM_QUEUE_TIMING) != 0;
  ev->t_ns = 0;
  ev->seq = q->seq + 1;
  ev->op = spec->op;
  ev->q = q;
  ev->waiters = NULL;
  atomic_store_explicit(&ev->bev, NULL, memory_order_relaxed);
  if (q->ref_stock == 0) {
    atomic_fetch_add_explicit(&q->refs, TDM__QUEUE_REF_BATCH, memory_order_relaxed);
    q->ref_stock = TDM__QUEUE_REF_BATCH;
  }
  q->ref_stock--; /* the event's reference to its queue */
  atomic_store_explicit(&ev->magic, TDM__MAGIC_EVENT, memory_order_relaxed);
  uint64_t handle = tdm__handle_make(ev->slot, &ev->gen, TDM__KIND_EVENT);
  atomic_store_explicit(&ev->handle, handle, memory_order_relaxed);
  return handle;
}

/* Hands the command to the backend, or, for an import (import.c), straight to the core's
 * completion path: the backend made the native handle already, and nothing is enqueued; the
 * handle's two references go to the event and to the wait. */
static int give_to_backend(tdm__queue *q, const tdm__spec *spec, tdm__cmd *cmd) {
  if (spec->native) {
    atomic_store_explicit(&cmd->ev->bev, spec->native, memory_order_release);
    cmd->wait = spec->native;
    tdm__cmd_native(cmd);
    return 0;
  }
  return tdm__b_submit(q, cmd);
}

/* The backend refused the command: everything reserved goes back; returns the error. */
static int submit_failed(tdm__queue *q, const tdm__spec *spec, tdm__cmd *cmd, int rc) {
  tdm__event *ev = cmd->ev;
  atomic_fetch_add_explicit(&q->n_done, 1, memory_order_relaxed);
  cmd_release_deps(cmd);
  atomic_store(&ev->refs, 1);
  tdm__event_unref(ev);
  tdm__freelist_put(&q->cmds, cmd);
  return tdm__error(rc, tdm_last_native_error(), "submitting %s to %s: %s", spec->op, q->label,
                    tdm__last_detail());
}

/* The backend took the command: the queue's order now includes it. */
static void submit_commit(tdm__queue *q, tdm__event *ev, bool track, bool gate) {
  q->seq++;
  if (q->nxwait) tdm__xwait_consumed(q, !ooo(q) || gate);
  if (track) tdm__tracker_add(q, ev);
  if (gate) {
    if (q->gate) tdm__event_unref(q->gate);
    q->gate = ev;
  }
}

int tdm__submit_locked(tdm__queue *q, const tdm__spec *spec, size_t ndeps,
                       tdm__event *const *deps, tdm__event **out, tdm_event **out_handle) {
  int rc;
  /* An in-order queue tracks none of its own commands: its order implies them, and
   * tdm_queue_dependencies stands a marker for them (tracker.c). */
  bool track = !spec->untracked && ooo(q);
  if (track && (rc = tdm__tracker_reserve(q))) return rc;
  tdm__event *gate_dep;
  size_t nall;
  size_t total = implicit_deps(q, spec, ndeps, &gate_dep, &nall);
  tdm__cmd *cmd = NULL;
  tdm__event *ev = NULL;
  if ((rc = reserve(q, total, &cmd, &ev))) return rc;

  cmd_fill(cmd, spec, quiet(q, spec, out || out_handle));
  cmd_add_deps(q, cmd, ndeps, deps, gate_dep, nall);
  bool gate = spec->gate && ooo(q);
  int refs = 1 + (track ? 1 : 0) + (gate ? 1 : 0) + (out ? 1 : 0) + (out_handle ? 1 : 0);
  uint64_t handle = event_begin(q, ev, spec, refs, out_handle ? 1 : 0);
  /* The tracker's collapse barrier (untracked) waits for every tracked entry, which is every
   * earlier command not complete. */
  ev->covers = (!ooo(q) || spec->all_prior || spec->untracked) ? q->seq
               : q->gate                                         ? q->gate->covers
                                                                 : 0;
  cmd->ev = ev;
  atomic_store_explicit(&q->n_submitted,
                        atomic_load_explicit(&q->n_submitted, memory_order_relaxed) + 1,
                        memory_order_relaxed);
  if ((rc = give_to_backend(q, spec, cmd))) return submit_failed(q, spec, cmd, rc);
  submit_commit(q, ev, track, gate);
  if (out) *out = ev;
  if (out_handle) *out_handle = (tdm_event *)(uintptr_t)handle;
  return 0;
}

int tdm__submit(tdm__queue *q, const tdm__spec *spec, size_t ndeps, tdm__event *const *deps,
                tdm__event **out, tdm_event **out_handle) {
  pthread_mutex_lock(&q->submit_mu);
  int rc = atomic_load(&q->destroying)
               ? tdm__error(TDM_EHANDLE, 0, "%s is being destroyed", q->label)
               : tdm__submit_locked(q, spec, ndeps, deps, out, out_handle);
  pthread_mutex_unlock(&q->submit_mu);
  if (q->can_lazy) tdm__exec_reap(q);
  return rc;
}

/* ---- execution ---- */

static _Thread_local tdm__batch *tls_batch; /* tdm__batch_begin */

/* Makes status the queue's first error since the last sync unless it has one, with the failed
 * command's name, number and words (why, taken over; NULL: none), and on an in-order queue
 * fails the commands after it. Rare, so a lock; the words are made before it. */
static void note_failure(tdm__queue *q, const char *op, uint64_t seq, char *why, int status) {
  pthread_mutex_lock(&q->mu);
  if (atomic_load(&q->first_error) == 0) {
    q->first_error_op = op;
    q->first_error_seq = seq;
    q->first_error_why = why;
    why = NULL;
    atomic_store(&q->first_error, status);
  }
  pthread_mutex_unlock(&q->mu);
  free(why);
  if (!ooo(q)) q->chain_error = status;
}

/* A device-side wait made without a command (tdm_queue_wait's cheap path) waited for failed,
 * an ordered dependency of marker cmd, the first command after it: the queue fails as it
 * would have with the wait command, which is named in the words. */
static void wait_failed(tdm__cmd *cmd, tdm__event *failed) {
  tdm__queue *q = cmd->ev->q;
  char *why = NULL;
  if (atomic_load(&q->first_error) == 0) {
    char buf[TDM__WHY_MAX], head[96];
    char *cause = tdm__event_cause_dup(failed);
    snprintf(head, sizeof head, "wait on %s (before command #%llu)", q->label,
             (unsigned long long)cmd->ev->seq);
    tdm__wait_words(buf, sizeof buf, head, cause ? cause : "the event it waited for failed");
    free(cause);
    why = tdm__why_dup(buf);
  }
  note_failure(q, "wait", cmd->ev->seq, why, TDM_EDEP);
}

void tdm__cmd_done(tdm__cmd *cmd, int status, int native) {
  tdm__event *ev = cmd->ev;
  tdm__queue *q = ev->q;
  /* A marker's status reports earlier failures; it is not a failure of its own. */
  if (status < 0 && cmd->kind != TDM__CMD_MARKER) {
    /* The words are made only while the queue has no earlier error to report. */
    char *why = NULL;
    if (atomic_load(&q->first_error) == 0) {
      char buf[TDM__WHY_MAX];
      tdm__event_describe(ev, buf, sizeof buf);
      why = tdm__why_dup(buf);
    }
    note_failure(q, ev->op, ev->seq, why, status);
  }
  if (atomic_load_explicit(&tdm__tracing, memory_order_relaxed)) tdm__trace_cmd(cmd, status);
  cmd_release_deps(cmd);
  cmd->ev = NULL;
  tdm__freelist_put(&q->cmds, cmd);
  tdm__batch *b = tls_batch;
  if (b && b->q == q && b->n < TDM__BATCH_MAX) {
    /* Read by waiters only once they see the event done, which the batch's end publishes
     * (after counting the batch's commands done, as below). */
    ev->status = status;
    ev->native = native;
    b->ev[b->n++] = ev;
    return;
  }
  atomic_fetch_add_explicit(&q->n_done, 1, memory_order_relaxed);
  tdm__event_complete_unref(ev, status, native);
}

void tdm__batch_begin(tdm__batch *b, tdm__queue *q) {
  b->q = q;
  b->n = 0;
  tls_batch = b;
}

void tdm__batch_end(tdm__batch *b) {
  tls_batch = NULL; /* continuations that complete other commands do so at once */
  if (b->n) {
    atomic_fetch_add_explicit(&b->q->n_done, (long)b->n, memory_order_relaxed);
    tdm__event_complete_batch(b->q, b->ev, b->n);
  }
  b->n = 0;
}

/* Host tasks run only on tandem's threads (a CPU queue's worker, a native queue's executor, a
 * pool thread), never inline in a caller's call, so the message cleared here is never a
 * caller's. It is cleared so that what the task says while it runs is its own: a message left
 * by an earlier task on the thread must not be taken for this one's. */
static int run_host_task(tdm__cmd *cmd) {
  tdm__queue *q = cmd->ev->q;
  tdm__queue *saved_q = tdm__tls_queue;
  uint64_t saved_seq = tdm__tls_seq;
  tdm__tls_queue = q;
  tdm__tls_seq = cmd->ev->seq;
  tdm_clear_error();
  int r = cmd->u.host.fn(cmd->u.host.arg);
  tdm__tls_queue = saved_q;
  tdm__tls_seq = saved_seq;
  if (r == 0) return 0;
  /* The task's message (tdm_set_error, or a tandem call of its own that failed) says why; the
   * event keeps it for its waiters, who are on other threads. Written before the event
   * completes, so they see it once they see the status. */
  /* A negative value inside the code table is kept, but for TDM_EAGAIN, which would read as
   * "not complete yet" for ever; anything else becomes TDM_ETASK, saying what it was. */
  const char *said = tdm__last_detail();
  if (r < 0 && r != TDM_EAGAIN && strcmp(tdm_err_name(r), "TDM_UNKNOWN") != 0) {
    cmd->ev->why = tdm__why_dup(said);
    return r;
  }
  char buf[TDM__WHY_MAX];
  snprintf(buf, sizeof buf, "it returned %d (%s), which a task may not return%s%s", r,
           tdm_err_name(r), said[0] ? ": " : "", said);
  cmd->ev->why = tdm__why_dup(buf);
  return TDM_ETASK;
}

/* Applies the execution rules to one command, on a host thread, in the queue's order:
 * - wait for the native work (native backends) and for every dependency;
 * - a failed dependency, or on an in-order queue an earlier failure, makes the command
 *   complete with TDM_EDEP without running (native work already queued still runs, but is
 *   reported so);
 * - markers report the queue's first error since the last sync; a sync marker clears it;
 * - host tasks and frees run here; copies and fills run here unless the backend is native. */
void tdm__cmd_run(tdm__cmd *cmd) {
  int native = 0, nstatus = 0;
  if (cmd->wait) {
    tdm_device *dev = cmd->ev->q->dev;
    nstatus = tdm__b_native_wait(dev, cmd->wait, &native);
    if (!(cmd->flags & TDM__CMD_WAIT_BORROWED)) tdm__b_native_release(dev, cmd->wait);
    cmd->wait = NULL;
  }
  tdm__cmd_finish(cmd, nstatus, native);
}

/* A copy of the words of q's first error since the last sync, for a command of an in-order
 * queue that does not run after it; NULL if there are none. Copied out under the lock, kept
 * after it. */
static char *first_error_why(tdm__queue *q) {
  char buf[TDM__WHY_MAX];
  buf[0] = '\0';
  pthread_mutex_lock(&q->mu);
  if (q->first_error_why) snprintf(buf, sizeof buf, "%s", q->first_error_why);
  pthread_mutex_unlock(&q->mu);
  return tdm__why_dup(buf);
}

/* A marker reports the queue's first error since the last sync, with its words; a sync marker
 * clears it and takes the words over. */
static void marker_finish(tdm__cmd *cmd, int nstatus, int native) {
  tdm__queue *q = cmd->ev->q;
  tdm__event *ev = cmd->ev;
  bool sync = (cmd->flags & TDM__CMD_SYNC) != 0;
  int status = 0;
  ev->cause_op = NULL; /* read only for markers */
  if (atomic_load(&q->first_error)) { /* rare: the error comes with its command's name */
    char buf[TDM__WHY_MAX];
    buf[0] = '\0';
    pthread_mutex_lock(&q->mu);
    status = sync ? atomic_exchange(&q->first_error, 0) : atomic_load(&q->first_error);
    ev->cause_op = q->first_error_op;
    ev->cause_seq = q->first_error_seq;
    if (sync) {
      ev->why = q->first_error_why;
      q->first_error_why = NULL;
    } else if (q->first_error_why) {
      snprintf(buf, sizeof buf, "%s", q->first_error_why);
    }
    pthread_mutex_unlock(&q->mu);
    if (!sync) ev->why = tdm__why_dup(buf);
    ev->why_relayed = true;
  }
  if (sync && !ooo(q)) q->chain_error = 0;
  if (!status && nstatus) status = nstatus;
  tdm__cmd_done(cmd, status, native);
}

/* A reaped command was put on the lazy list with no dependency, gate or host work, and its
 * native work has completed without error (exec.c): while its queue has no failure to report
 * and nothing is traced, finishing it comes down to completing its event with status 0, in a
 * batch, and returning the command, all of them with one push. Anything else takes
 * tdm__cmd_finish. The native handles go back first, as the executor's path does. */
void tdm__cmd_finish_reaped(tdm__queue *q, tdm__cmd *list) {
  tdm__batch b;
  tdm__batch_begin(&b, q);
  bool plain = !atomic_load(&q->first_error) && !q->chain_error &&
               !atomic_load_explicit(&tdm__tracing, memory_order_relaxed);
  tdm__cmd *first = NULL, *last = NULL;
  for (tdm__cmd *c = list, *next; c; c = next) {
    next = c->next;
    if (c->wait && !(c->flags & TDM__CMD_WAIT_BORROWED)) tdm__b_native_release(q->dev, c->wait);
    c->wait = NULL;
    if (!plain || c->ndeps || c->deps != c->inline_deps || b.n == TDM__BATCH_MAX) {
      tdm__cmd_finish(c, 0, 0);
      continue;
    }
    tdm__event *ev = c->ev;
    ev->cause_op = NULL; /* read only for markers */
    ev->status = 0;
    ev->native = 0;
    b.ev[b.n++] = ev;
    c->ev = NULL;
    c->next = first;
    first = c;
    if (!last) last = c;
  }
  if (first) tdm__freelist_put_list(&q->cmds, first, last);
  tdm__batch_end(&b);
}

void tdm__cmd_finish(tdm__cmd *cmd, int nstatus, int native) {
  tdm__queue *q = cmd->ev->q;
  if (cmd->kind == TDM__CMD_MARKER) {
    tdm__event *failed = NULL; /* the first device-side wait that failed */
    for (size_t i = 0; i < cmd->ndeps; i++)
      if (tdm__event_wait_raw(cmd->deps[i].ev) < 0 && cmd->deps[i].ordered && !failed)
        failed = cmd->deps[i].ev;
    if (failed) wait_failed(cmd, failed);
    marker_finish(cmd, nstatus, native);
    return;
  }
  int status = 0;
  tdm__event *failed = NULL; /* the first dependency that failed */
  for (size_t i = 0; i < cmd->ndeps; i++)
    if (tdm__event_wait_raw(cmd->deps[i].ev) < 0) {
      status = TDM_EDEP;
      if (!failed) failed = cmd->deps[i].ev;
    }
  if (status == 0 && !ooo(q) && q->chain_error) status = TDM_EDEP;
  if (status == TDM_EDEP) { /* rare: the command says which failure it did not run after */
    cmd->ev->why = failed ? tdm__event_cause_dup(failed) : first_error_why(q);
    cmd->ev->why_relayed = true;
  }
  if (status == 0 && nstatus) status = nstatus;
  bool host = !tdm__b_is_native(q->dev) || (cmd->flags & TDM__CMD_ON_HOST);
  if ((host || cmd->kind == TDM__CMD_HOST) &&
      atomic_load_explicit(&tdm__tracing, memory_order_relaxed))
    cmd->t_start = tdm__now_ns();
  if (status == 0) {
    switch (cmd->kind) {
      case TDM__CMD_COPY:
        if (host) status = tdm__b_host_copy(q->dev, cmd);
        break;
      case TDM__CMD_FILL:
        if (host && cmd->u.fill.n) memset(cmd->u.fill.dst, cmd->u.fill.value, cmd->u.fill.n);
        break;
      case TDM__CMD_HOST: status = run_host_task(cmd); break;
      default: break;
    }
  }
  /* Freed whatever the status: the caller gave the memory up when it submitted the free. */
  if (cmd->kind == TDM__CMD_FREE)
    tdm__mem_finish_free(cmd->u.free_.ptr, (cmd->flags & TDM__CMD_NATIVE_FREED) != 0);
  if (cmd->gate) {
    tdm__b_gate_open(q->dev, cmd->gate);
    cmd->gate = NULL;
  }
  tdm__cmd_done(cmd, status, status == nstatus ? native : 0);
}

/* ---- public submission calls ---- */

#define GET_Q(h, q)                              \
  tdm__queue *q;                                 \
  do {                                           \
    int get_rc_ = tdm__queue_get((h), &q);       \
    if (get_rc_) return get_rc_;                 \
  } while (0)

/* Submits with a caller's dependency list, resolved to events for the call's length. */
static int submit_public(tdm__queue *q, const tdm__spec *s, size_t ndeps,
                         tdm_event *const *deps, tdm_event **out) {
  if (ndeps == 0) return tdm__submit(q, s, 0, NULL, NULL, out);
  tdm__deplist d;
  int rc = tdm__deps_get(ndeps, deps, &d);
  if (rc) return rc;
  rc = tdm__submit(q, s, d.n, d.v, NULL, out);
  tdm__deps_put(&d);
  return rc;
}

int tdm_memcpy(tdm_queue *qh, void *dst, const void *src, size_t n, tdm_copy_dir dir,
               size_t ndeps, tdm_event *const *deps, tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  tdm__spec s = {.kind = TDM__CMD_COPY, .op = "memcpy", .u_ptr0 = dst, .u_ptr1 = src, .u_n = n};
  int rc = tdm__mem_check_copy(q, NULL, dst, src, n, &dir, &s.dref, &s.sref);
  if (rc) return rc;
  return submit_public(q, &s, ndeps, deps, out);
}

int tdm_memset(tdm_queue *qh, void *dst, int value, size_t n, size_t ndeps,
               tdm_event *const *deps, tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  tdm__spec s = {.kind = TDM__CMD_FILL, .op = "memset", .u_ptr0 = dst, .u_value = value,
                 .u_n = n};
  int rc = tdm__mem_check_fill(q, dst, n, &s.dref);
  if (rc) return rc;
  return submit_public(q, &s, ndeps, deps, out);
}

int tdm_host_task(tdm_queue *qh, tdm_host_fn fn, void *arg, size_t ndeps,
                  tdm_event *const *deps, tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  if (!fn) return tdm__error(TDM_EINVAL, 0, "tdm_host_task: fn is NULL");
  tdm__spec s = {.kind = TDM__CMD_HOST, .op = "host task", .fn = fn, .u_ptr1 = arg};
  return submit_public(q, &s, ndeps, deps, out);
}

int tdm_free_async(tdm_queue *qh, void *ptr, size_t ndeps, tdm_event *const *deps,
                   tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  tdm__deplist d;
  int rc = tdm__deps_get(ndeps, deps, &d);
  if (rc) return rc;
  tdm__spec s = {.kind = TDM__CMD_FREE, .op = "free", .u_ptr0 = ptr, .all_prior = true};
  if (!(rc = tdm__mem_begin_free(q, ptr, &s.dref))) {
    if ((rc = tdm__submit(q, &s, d.n, d.v, NULL, out))) tdm__mem_cancel_free(ptr);
  }
  tdm__deps_put(&d);
  return rc;
}

int tdm_memcpy_cross(tdm_queue *src_h, tdm_queue *dst_h, void *dst, const void *src, size_t n,
                     size_t ndeps, tdm_event *const *deps, tdm_event **out) {
  TDM__ENTER();
  GET_Q(src_h, src_q);
  GET_Q(dst_h, dst_q);
  tdm__spec copy = {.kind = TDM__CMD_COPY, .op = "cross-queue memcpy", .u_ptr0 = dst,
                    .u_ptr1 = src, .u_n = n};
  int rc = tdm__mem_check_cross(src_q, dst_q, dst, src, n, &copy.dref, &copy.sref);
  if (rc) return rc;
  tdm__deplist d;
  if ((rc = tdm__deps_get(ndeps, deps, &d))) return rc;
  /* dst_q's side is reserved first and filled last, and filling cannot fail: the call either
   * happens whole or not at all. The copy becomes a dependency of dst_q's next submissions,
   * so dst_q waits for it device-side. The two queue locks are never held together. */
  bool cross = src_q != dst_q;
  tdm__event *ev = NULL;
  tdm_event *h = NULL;
  if (cross && (rc = tdm__xwait_reserve(dst_q))) goto done;
  if ((rc = tdm__submit(src_q, &copy, d.n, d.v, &ev, out ? &h : NULL))) {
    if (cross) tdm__xwait_cancel(dst_q);
    goto done;
  }
  /* ev carries one reference for this call (and, with out, the caller's as well). */
  if (cross)
    tdm__xwait_fill(dst_q, ev);
  else
    tdm__event_unref(ev);
  if (out) *out = h;
done:
  tdm__deps_put(&d);
  return rc;
}

/* The specs of the two calls that name no operands, made once rather than per call (a spec
 * with its memory references is 136 bytes to clear). */
static const tdm__spec record_spec = {.kind = TDM__CMD_MARKER, .op = "marker", .all_prior = true};
static const tdm__spec wait_spec = {.kind = TDM__CMD_BARRIER, .op = "wait", .gate = true};

/* tdm_queue_wait's cheap path, on an in-order queue whose backend can make the native queue
 * wait for ev at once (queue_wait_now): no command, no event, nothing for the executor. ev
 * goes on the queue's xwait list, ordered, so the next command takes it as a dependency for
 * its status alone: a failure of ev then fails the queue as the wait command would have.
 * Returns 0 (made), 1 (the backend cannot, or the list is full: submit the wait command) or an
 * error. */
static int wait_now(tdm__queue *q, tdm__event *ev) {
  pthread_mutex_lock(&q->submit_mu);
  int rc;
  if (atomic_load(&q->destroying)) {
    rc = tdm__error(TDM_EHANDLE, 0, "%s is being destroyed", q->label);
  } else if (!tdm__xwait_room(q)) {
    rc = 1; /* the wait command's submission empties the list */
  } else if ((rc = tdm__b_queue_wait_now(q, ev)) == 0) {
    tdm__xwait_add_ordered(q, ev);
  } else if (rc < 0) {
    rc = tdm__error(rc, tdm_last_native_error(), "tdm_queue_wait on %s: %s", q->label,
                    tdm__last_detail());
  }
  pthread_mutex_unlock(&q->submit_mu);
  return rc;
}

int tdm_event_record(tdm_queue *qh, tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_event_record: out is NULL");
  return tdm__submit(q, &record_spec, 0, NULL, NULL, out);
}

int tdm_queue_wait(tdm_queue *qh, tdm_event *evh) {
  TDM__ENTER();
  GET_Q(qh, q);
  tdm__event *ev;
  int rc = tdm__event_get(evh, &ev);
  if (rc) return rc;
  /* An event that has completed without error orders nothing any more: no command at all
   * (on an out-of-order queue the current gate stays the gate, as it would have been this
   * wait's dependency). A failed one still makes the wait, which then fails the queue. */
  if (atomic_load_explicit(&ev->done, memory_order_acquire)) {
    if (ev->status == 0) return 0;
  } else if (!ooo(q) && !atomic_load_explicit(&tdm__tracing, memory_order_relaxed)) {
    rc = wait_now(q, ev); /* a traced wait stays a command, so the trace shows it */
    if (rc <= 0) return rc;
  }
  return tdm__submit(q, &wait_spec, 1, &ev, NULL, NULL);
}

int tdm_queue_barrier(tdm_queue *qh, size_t ndeps, tdm_event *const *deps, tdm_event **out) {
  TDM__ENTER();
  GET_Q(qh, q);
  tdm__spec s = {.kind = TDM__CMD_BARRIER, .op = "barrier", .gate = true,
                 .all_prior = ndeps == 0};
  return submit_public(q, &s, ndeps, deps, out);
}

int tdm_queue_sync(tdm_queue *qh) {
  TDM__ENTER();
  GET_Q(qh, q);
  if (tdm__tls_queue == q)
    return tdm__error(TDM_EDEADLK, 0, "a host task of %s syncs its own queue", q->label);
  if (tdm__threadpool_starved())
    return tdm__error(TDM_EDEADLK, 0, "tdm_queue_sync of %s from the last of tandem's pool "
                      "threads not blocked in a wait: none would be left to run its work",
                      q->label);
  tdm__spec s = {.kind = TDM__CMD_MARKER, .flags = TDM__CMD_SYNC, .op = "sync",
                 .all_prior = true};
  tdm__event *ev;
  int rc = tdm__submit(q, &s, 0, NULL, &ev, NULL);
  if (rc) return rc;
  rc = tdm__event_wait_blocking(ev);
  const char *cause = ev->cause_op;
  unsigned long long cause_seq = (unsigned long long)ev->cause_seq;
  int native = ev->native;
  /* The failure in words (with what a failed host task said), as its command's own waiters
   * hear it; without them (no memory was left to keep them), its name and number. */
  if (rc && ev->why)
    tdm__error(rc, native, "%s; the first error since the last sync", ev->why);
  else if (rc && cause)
    tdm__error(rc, native, "%s on %s (command #%llu) failed; the first error since the last sync",
               cause, q->label, cause_seq);
  else if (rc)
    tdm__error(rc, native, "%s: the first error since the last sync", q->label);
  uint64_t seq = ev->seq;
  tdm__event_unref(ev);
  /* Everything the tracker holds has completed: let it go now rather than at the next prune.
   * A failed gate from before the sync has been reported: later commands no longer take it. */
  pthread_mutex_lock(&q->submit_mu);
  tdm__tracker_prune(q);
  tdm__event *g = q->gate;
  if (g && g->seq < seq && atomic_load(&g->done) && g->status != 0) {
    q->gate = NULL;
    tdm__event_unref(g);
  }
  pthread_mutex_unlock(&q->submit_mu);
  return rc;
}
