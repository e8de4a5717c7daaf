/* clsubmit.c: turns tandem commands into OpenCL commands. Every command gets a native event
 * (attached to its tandem event, so other OpenCL queues wait for it natively), except quiet
 * ones (only the queue can observe them: they complete with its next event) and, on
 * out-of-order queues, frees and deferred host work (host_work_ooo); it is handed to the
 * queue's executor, which waits for it with clWaitForEvents. Commands of out-of-order queues
 * and imported events (tdm_event_import) are reported by a callback that only gives notice,
 * and a watcher thread for the failures that PoCL does not call back for ("completion
 * notices").
 *
 * The queue's submission lock is held across these enqueues. That is safe even with PoCL's
 * basic driver, which may run commands and their callbacks inline in this thread: gates are
 * user events opened by the executor, and the one callback tandem sets (on_complete, below)
 * runs only the core's notification, which counts a command down and may push it onto the
 * thread pool's ready list, taking that list's lock and no other; no thread holds that lock
 * across an OpenCL call. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ocl.h"

/* A dependency from another backend or context: a user event, completed by a continuation
 * when the tandem event completes. */
typedef struct bridge {
  tdm__waiter w; /* first */
  cl_event uev;
} bridge;

static void bridge_fire(tdm__waiter *w, tdm__event *ev) {
  bridge *b = (bridge *)w;
  /* Always CL_COMPLETE: a failure is reported by tandem (TDM_EDEP), not by the driver. */
  clSetUserEventStatus(b->uev, CL_COMPLETE);
  clReleaseEvent(b->uev);
  free(b);
}

/* The native event a command of bq may put in its wait list for dep, or NULL (then a bridge,
 * or under host-side deferral the host, waits for it): dep's cl_event when it is of bq's
 * device, with two exceptions.
 * - An event that has already failed: PoCL 3.1 never runs a command whose wait list holds
 *   one (the core fails the command anyway, TDM_EDEP).
 * - A user event the caller imported. The caller completes it on the host in any case, so a
 *   native wait would save nothing over the bridge, and user events in wait lists are what
 *   PoCL handles worst: with the basic driver the caller's clSetUserEventStatus deadlocks,
 *   and a failure set on one makes PoCL take event locks in an order that can deadlock with
 *   an enqueue on another thread. tandem's own user events (gates) are never failed. */
static cl_event dep_native(tdm__bqueue *bq, tdm__event *dep) {
  const tdm__backend *be;
  cl_event native = ocl_svc->event_native(dep, &tdm__opencl_backend);
  if (!native || ocl_svc->event_device(dep, &be) != bq->bdev) return NULL;
  cl_int st = CL_COMPLETE;
  clGetEventInfo(native, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL);
  if (st < 0) return NULL;
  if (ocl_svc->event_imported(dep)) {
    cl_command_type type = CL_COMMAND_USER;
    clGetEventInfo(native, CL_EVENT_COMMAND_TYPE, sizeof type, &type, NULL);
    if (type == CL_COMMAND_USER) return NULL;
  }
  return native;
}

/* A cross-queue wait needs the producer flushed, or it may never start. */
static void flush_producer(tdm__bqueue *bq, cl_event native) {
  cl_command_queue producer;
  if (clGetEventInfo(native, CL_EVENT_COMMAND_QUEUE, sizeof producer, &producer, NULL) ==
          CL_SUCCESS &&
      producer && producer != bq->q)
    clFlush(producer);
}

typedef struct waitlist {
  cl_event *ev;
  cl_uint n;
  cl_uint nbridges;   /* the first nbridges entries of ev hold a reference of the list's */
  cl_event inline_ev[16];
} waitlist;

static void waitlist_free(waitlist *wl) {
  if (wl->ev != wl->inline_ev) free(wl->ev);
}

/* The command may already be complete and recycled here: only the list is used. */
static void waitlist_release_bridges(waitlist *wl) {
  for (cl_uint i = 0; i < wl->nbridges; i++) clReleaseEvent(wl->ev[i]);
}

/* Builds the wait list of cmd's dependencies on queue bq. */
static int waitlist_build(tdm__bqueue *bq, tdm__cmd *cmd, waitlist *wl) {
  wl->n = wl->nbridges = 0;
  wl->ev = cmd->ndeps + 1 <= 16 ? wl->inline_ev : malloc((cmd->ndeps + 1) * sizeof(cl_event));
  if (!wl->ev) return ocl_svc->error(TDM_ENOMEM, 0, "no memory for a wait list");
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__event *dep = cmd->deps[i].ev;
    cl_event native = dep_native(bq, dep);
    if (native) {
      flush_producer(bq, native);
      wl->ev[wl->n++] = native;
      continue;
    }
    /* Bridges go first, so they can be released without looking at cmd again. */
    if (wl->n > wl->nbridges) wl->ev[wl->n] = wl->ev[wl->nbridges];
    bridge *b = malloc(sizeof *b);
    cl_int err = CL_OUT_OF_HOST_MEMORY;
    if (b) b->uev = clCreateUserEvent(ocl_devs[bq->bdev].ctx, &err);
    if (!b || !b->uev) {
      free(b);
      waitlist_release_bridges(wl);
      waitlist_free(wl);
      return ocl_error(err, "clCreateUserEvent for a cross-device dependency");
    }
    b->w.fn = bridge_fire;
    clRetainEvent(b->uev); /* the wait list's reference; the bridge keeps its own */
    wl->ev[wl->nbridges++] = b->uev;
    wl->n++;
    if (ocl_svc->event_on_complete(dep, &b->w)) bridge_fire(&b->w, dep);
  }
  return 0;
}


/* Gives the command to tandem. done: the native event that completes with it (attached to the
 * tandem event, so other queues wait for it natively; NULL when it has none). wait: what the
 * core waits for before completing it (a reference it releases; NULL: nothing). gate: what the
 * core opens after host work. When done is also waited for, its one reference is lent to the
 * wait (TDM__CMD_WAIT_BORROWED): the tandem event keeps it while the command runs, which
 * saves a retain and a release per command. */
static void hand_over(tdm__cmd *cmd, cl_event done, cl_event wait, void *gate) {
  if (done) ocl_svc->event_set_native(cmd->ev, done);
  if (wait && wait == done) cmd->flags |= TDM__CMD_WAIT_BORROWED;
  cmd->wait = wait;
  cmd->gate = gate;
  ocl_svc->cmd_native(cmd);
}

/* Work the executor does on the host (host tasks, host-to-host copies, host fills, frees).
 * In-order: a marker before it (what it waits for), a user event as the gate, and a barrier on
 * the gate that later work orders after. Out-of-order: nothing on the native queue (see
 * host_work_ooo). */
static int host_work_ooo(tdm__bqueue *bq, tdm__cmd *cmd, bool gated);

static int host_work(tdm__bqueue *bq, tdm__cmd *cmd, waitlist *wl, bool gated) {
  if (bq->ooo) return host_work_ooo(bq, cmd, gated);
  cl_event pre = NULL, gate = NULL, done = NULL;
  cl_int err = clEnqueueMarkerWithWaitList(bq->q, wl->n, wl->n ? wl->ev : NULL, &pre);
  if (err != CL_SUCCESS) return ocl_error(err, "clEnqueueMarkerWithWaitList");
  if (!gated) {
    /* A free: after earlier work, on the host; later work need not wait for it. */
    hand_over(cmd, pre, pre, NULL);
    return 0;
  }
  gate = clCreateUserEvent(ocl_devs[bq->bdev].ctx, &err);
  if (gate) err = clEnqueueBarrierWithWaitList(bq->q, 1, &gate, &done);
  if (err != CL_SUCCESS) {
    if (gate) {
      clSetUserEventStatus(gate, CL_COMPLETE);
      clReleaseEvent(gate);
    }
    clReleaseEvent(pre);
    return ocl_error(err, "gating a host task");
  }
  if (cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST; /* host copy or fill */
  hand_over(cmd, done, pre, gate);
  return 0;
}

/* On an out-of-order queue the core itself waits for every dependency of host work before a
 * pool thread runs it, and later work can wait for its user event directly, so nothing goes
 * on the native queue. Markers there would cost more than they seem to: PoCL makes every
 * marker of an out-of-order queue wait for every command still in the queue, wait list or
 * not, linking it to each under the queue's lock, which the driver's threads also need to
 * retire commands; a burst of host tasks then outruns them, and the links grow without bound.
 * Under host-side deferral there is no user event either: later work waits for the task
 * through its tandem event (start_locked). */
static int host_work_ooo(tdm__bqueue *bq, tdm__cmd *cmd, bool gated) {
  cl_event gate = NULL;
  if (gated && !bq->defer) {
    cl_int err = CL_SUCCESS;
    gate = clCreateUserEvent(ocl_devs[bq->bdev].ctx, &err);
    if (!gate) return ocl_error(err, "clCreateUserEvent for a host task");
    clRetainEvent(gate); /* one reference for the tandem event, one for gate_open */
  }
  if (gated && cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST;
  hand_over(cmd, gate, NULL, gate);
  return 0;
}

/* Whether one side of a copy or fill is an OpenCL device buffer (the cl_mem in its registry
 * entry); pinned and pageable host memory are host pointers to the native queue. */
static inline bool ocl_is_buffer(const tdm__memref *m) {
  return m->kind == TDM_MEM_DEVICE && m->bm.handle;
}

static int enqueue(tdm__bqueue *bq, tdm__cmd *cmd, waitlist *wl) {
  cl_command_queue q = bq->q;
  cl_event ev = NULL;
  /* A quiet copy or fill gets no event: it completes with the queue's next one
   * (ocl_native_flush). Barriers keep theirs: PoCL's pthread driver can hang on a barrier
   * without one that waits for other queues. Not under host-side deferral either: PoCL's basic
   * driver deadlocks when a command without an event completes while it runs commands
   * inline. */
  cl_event *evp =
      (cmd->flags & TDM__CMD_QUIET) && cmd->kind != TDM__CMD_BARRIER && !bq->defer ? NULL : &ev;
  cl_int err = CL_SUCCESS;
  const char *what = "enqueue";
  switch (cmd->kind) {
    case TDM__CMD_COPY: {
      /* The core's registry entry carries each side's cl_mem and offset. */
      size_t n = cmd->u.copy.n;
      const tdm__memref *d = &cmd->u.copy.d, *s = &cmd->u.copy.s;
      bool dd = ocl_is_buffer(d), sd = ocl_is_buffer(s);
      if (n == 0 || (!dd && !sd)) return host_work(bq, cmd, wl, n != 0);
      if (dd && sd && d->bdev != s->bdev)
        return ocl_svc->error(TDM_ENOTSUP, 0, "copies between OpenCL devices are not supported");
      const cl_event *w = wl->n ? wl->ev : NULL;
      if (dd && sd) {
        what = "clEnqueueCopyBuffer";
        err = clEnqueueCopyBuffer(q, s->bm.handle, d->bm.handle, s->offset, d->offset, n, wl->n,
                                  w, evp);
      } else if (dd) {
        what = "clEnqueueWriteBuffer";
        err = clEnqueueWriteBuffer(q, d->bm.handle, CL_FALSE, d->offset, n, cmd->u.copy.src,
                                   wl->n, w, evp);
      } else {
        what = "clEnqueueReadBuffer";
        err = clEnqueueReadBuffer(q, s->bm.handle, CL_FALSE, s->offset, n, cmd->u.copy.dst,
                                  wl->n, w, evp);
      }
      break;
    }
    case TDM__CMD_FILL: {
      size_t n = cmd->u.fill.n;
      const tdm__memref *d = &cmd->u.fill.d;
      if (n == 0 || !ocl_is_buffer(d)) return host_work(bq, cmd, wl, n != 0);
      cl_uchar byte = (cl_uchar)cmd->u.fill.value;
      what = "clEnqueueFillBuffer";
      err = clEnqueueFillBuffer(q, d->bm.handle, &byte, 1, d->offset, n, wl->n,
                                wl->n ? wl->ev : NULL, evp);
      break;
    }
    case TDM__CMD_HOST: return host_work(bq, cmd, wl, true);
    case TDM__CMD_FREE: return host_work(bq, cmd, wl, false);
    case TDM__CMD_MARKER:
    case TDM__CMD_BARRIER: {
      /* An empty wait list covers every earlier command of the queue, whoever enqueued it.
       * With a list, the list is waited for as well. */
      bool all = cmd->kind == TDM__CMD_MARKER || (cmd->flags & TDM__CMD_ALL_PRIOR);
      cl_event first = NULL;
      if (all && wl->n) {
        err = clEnqueueMarkerWithWaitList(q, 0, NULL, &first);
        if (err != CL_SUCCESS) return ocl_error(err, "clEnqueueMarkerWithWaitList");
        wl->ev[wl->n++] = first;
      }
      what = cmd->kind == TDM__CMD_MARKER ? "clEnqueueMarkerWithWaitList"
                                           : "clEnqueueBarrierWithWaitList";
      err = cmd->kind == TDM__CMD_MARKER
                ? clEnqueueMarkerWithWaitList(q, wl->n, wl->n ? wl->ev : NULL, &ev)
                : clEnqueueBarrierWithWaitList(q, wl->n, wl->n ? wl->ev : NULL, &ev);
      if (first) {
        clReleaseEvent(first);
        wl->n--;
      }
      break;
    }
  }
  if (err != CL_SUCCESS) return ocl_error(err, what);
  hand_over(cmd, ev, ev, NULL);
  return 0;
}

static int submit_now(tdm__bqueue *bq, tdm__cmd *cmd) {
  waitlist wl;
  int rc = waitlist_build(bq, cmd, &wl);
  if (rc) return rc;
  rc = enqueue(bq, cmd, &wl);
  waitlist_release_bridges(&wl);
  waitlist_free(&wl);
  return rc;
}

/* ---- host-side deferral (drivers whose user events hang) ----
 * A command whose dependencies are not all native waits, unsubmitted, until they complete; a
 * host task is enqueued as a marker (what it waits for) and holds the queue until the executor
 * has run it. Meanwhile later commands wait in bq->held, in order. The gate handed to the
 * executor is the queue itself, tagged in its low bit. */

#define DEFER_GATE(bq) ((void *)((uintptr_t)(bq) | 1u))

static bool needs_gate(const tdm__cmd *cmd) {
  switch (cmd->kind) {
    case TDM__CMD_HOST: return true;
    case TDM__CMD_COPY:
      return cmd->u.copy.n && !ocl_is_buffer(&cmd->u.copy.d) && !ocl_is_buffer(&cmd->u.copy.s);
    case TDM__CMD_FILL:
      return cmd->u.fill.n && !ocl_is_buffer(&cmd->u.fill.d);
    default: return false;
  }
}

static void drain_locked(tdm__bqueue *bq);
static void resume(tdm__bqueue *bq, tdm__cmd *cmd);

/* Enqueues a command whose non-native dependencies have completed. */
static int enqueue_deferred(tdm__bqueue *bq, tdm__cmd *cmd) {
  waitlist wl;
  wl.n = wl.nbridges = 0;
  /* One spare entry: a marker may append an event of its own (see enqueue). */
  wl.ev = cmd->ndeps + 1 <= 16 ? wl.inline_ev : malloc((cmd->ndeps + 1) * sizeof(cl_event));
  if (!wl.ev) return ocl_svc->error(TDM_ENOMEM, 0, "no memory for a wait list");
  for (size_t i = 0; i < cmd->ndeps; i++) {
    cl_event native = dep_native(bq, cmd->deps[i].ev);
    if (native) wl.ev[wl.n++] = native;
  }
  int rc = 0;
  if (!bq->ooo && needs_gate(cmd)) {
    /* No native event: the task holds the queue until the executor has run it (its gate
     * resumes the queue), after a marker on what it waits for. */
    cl_event pre = NULL;
    cl_int err = clEnqueueMarkerWithWaitList(bq->q, wl.n, wl.n ? wl.ev : NULL, &pre);
    rc = err == CL_SUCCESS ? 0 : ocl_error(err, "clEnqueueMarkerWithWaitList");
    if (!rc) {
      if (cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST;
      bq->blocker = cmd;
      atomic_fetch_add(&bq->resumes, 1); /* the gate's resume() */
      hand_over(cmd, NULL, pre, DEFER_GATE(bq));
    }
  } else {
    rc = enqueue(bq, cmd, &wl);
  }
  waitlist_free(&wl);
  return rc;
}

static void dep_ready(tdm__waiter *w, tdm__event *ev) {
  tdm__dep *d = (tdm__dep *)((char *)w - offsetof(tdm__dep, w));
  if (__atomic_sub_fetch(&d->cmd->bcount, 1, __ATOMIC_ACQ_REL) == 0)
    resume((tdm__bqueue *)d->cmd->bdata, d->cmd);
}

/* Starts a command on a queue nothing holds: it either enqueues now, or becomes the blocker
 * until its non-native dependencies complete. */
static int start_locked(tdm__bqueue *bq, tdm__cmd *cmd) {
  cmd->bdata = bq;
  cmd->bcount = 1;
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__dep *d = &cmd->deps[i];
    if (dep_native(bq, d->ev)) continue;
    __atomic_add_fetch(&cmd->bcount, 1, __ATOMIC_ACQ_REL);
    d->w.fn = dep_ready;
    if (ocl_svc->event_on_complete(d->ev, &d->w))
      __atomic_sub_fetch(&cmd->bcount, 1, __ATOMIC_ACQ_REL);
  }
  /* A resume() will come for it unless the guard was the last count: counted before the guard
   * drops, so the queue cannot be freed under that resume. */
  atomic_fetch_add(&bq->resumes, 1);
  if (__atomic_sub_fetch(&cmd->bcount, 1, __ATOMIC_ACQ_REL) == 0) {
    atomic_fetch_sub(&bq->resumes, 1);
    return enqueue_deferred(bq, cmd);
  }
  if (!bq->ooo) bq->blocker = cmd; /* out-of-order: it waits alone */
  return 0;
}

/* A held command that cannot be enqueued completes with the error; it was accepted earlier. */
static void fail_held(tdm__cmd *cmd, int rc) { ocl_svc->cmd_done(cmd, rc, 0); }

static void held_push(tdm__bqueue *bq, tdm__cmd *cmd) {
  cmd->next = NULL;
  if (bq->held_tail)
    bq->held_tail->next = cmd;
  else
    bq->held_head = cmd;
  bq->held_tail = cmd;
}

static tdm__cmd *held_pop(tdm__bqueue *bq) {
  tdm__cmd *c = bq->held_head;
  bq->held_head = c->next;
  if (!bq->held_head) bq->held_tail = NULL;
  return c;
}

static void ooo_drain_locked(tdm__bqueue *bq);
static void ooo_drain(tdm__bqueue *bq);

static void drain_locked(tdm__bqueue *bq) {
  if (bq->ooo) {
    ooo_drain_locked(bq);
    return;
  }
  while (!bq->blocker && bq->held_head) {
    tdm__cmd *c = held_pop(bq);
    int rc = start_locked(bq, c);
    if (rc) fail_held(c, rc);
  }
}

/* cmd's dependencies completed (on an in-order queue it is the blocker), or, with cmd NULL,
 * an in-order queue's host task ran. */
static void resume(tdm__bqueue *bq, tdm__cmd *cmd) {
  pthread_mutex_lock(&bq->mu);
  if (!bq->ooo) bq->blocker = NULL;
  if (cmd) {
    int rc = enqueue_deferred(bq, cmd);
    if (rc) fail_held(cmd, rc);
  }
  drain_locked(bq);
  pthread_mutex_unlock(&bq->mu);
  if (bq->ooo) ooo_drain(bq);
  /* The last touch of bq: the commands just enqueued may already have completed, and the
   * queue's destruction waits for this count. */
  atomic_fetch_sub(&bq->resumes, 1);
}

/* ---- depth of out-of-order queues ----
 * PoCL links every marker of an out-of-order queue to every command still in the queue (see
 * host_work_ooo), so each record, sync, barrier or free costs time and memory in proportion
 * to the queue's depth, under the lock that the driver's threads need to retire commands: a
 * burst of them outruns those threads, and the depth, and the cost of the next marker, only
 * grow. So a command that goes on the native queue takes one of OCL_OOO_DEPTH slots, given
 * back when its event completes. With none free it waits in bq->held, unsubmitted, and so
 * does every later command that goes on the native queue (a marker enqueued late would cover
 * commands submitted after it); the completion that frees a slot submits it, on a pool
 * thread. Host work takes no slot and never waits here: it puts nothing on the native queue.
 * The submitting thread never blocks. The price of the bound: a host task that waits for work
 * submitted after it to its own queue hangs if OCL_OOO_DEPTH commands wait for the task. */

static bool goes_native(const tdm__cmd *cmd) {
  switch (cmd->kind) {
    case TDM__CMD_HOST:
    case TDM__CMD_FREE: return false;
    case TDM__CMD_COPY: return cmd->u.copy.n && !needs_gate(cmd);
    case TDM__CMD_FILL: return cmd->u.fill.n && !needs_gate(cmd);
    default: return true;
  }
}

/* Only a holder of bq->mu pops, so a slot on the stack cannot leave and come back under a
 * pop (no ABA). */
static ocl_slot *slot_take(tdm__bqueue *bq) {
  ocl_slot *s = atomic_load(&bq->free_slots);
  while (s && !atomic_compare_exchange_weak(&bq->free_slots, &s, s->next_free)) {
  }
  return s;
}

static void slot_give(tdm__bqueue *bq, ocl_slot *s) {
  ocl_slot *top = atomic_load(&bq->free_slots);
  do s->next_free = top;
  while (!atomic_compare_exchange_weak(&bq->free_slots, &top, s));
}

/* The event of a command holding slot w completed: on the completing thread, possibly inside
 * a submission (a held command that failed), where bq->mu is taken and ooo_drain leaves the
 * work to the holder. */
static void slot_done(tdm__waiter *w, tdm__event *ev) {
  ocl_slot *s = (ocl_slot *)w;
  tdm__bqueue *bq = s->bq;
  slot_give(bq, s);
  if (atomic_load(&bq->nheld)) {
    atomic_store(&bq->drain, true);
    ooo_drain(bq);
  }
  atomic_fetch_sub(&bq->resumes, 1); /* the last touch of bq */
}

/* Submits cmd with slot s (NULL: host work, which takes none); bq->mu held. The slot is
 * attached to the event first: the command may complete before this returns. On failure the
 * event will not complete, so the slot is given back here. */
static int ooo_start_locked(tdm__bqueue *bq, tdm__cmd *cmd, ocl_slot *s) {
  if (s) {
    atomic_fetch_add(&bq->resumes, 1); /* slot_done's */
    s->w.fn = slot_done;
    ocl_svc->event_on_complete(cmd->ev, &s->w); /* not complete: not yet submitted */
  }
  int rc = bq->defer ? start_locked(bq, cmd) : submit_now(bq, cmd);
  if (rc && s) {
    slot_give(bq, s);
    atomic_fetch_sub(&bq->resumes, 1);
  }
  return rc;
}

/* Submits held commands while slots are free; bq->mu held. A failure completes the command
 * (and gives its slot back) at once. */
static void ooo_drain_locked(tdm__bqueue *bq) {
  ocl_slot *s;
  while (bq->held_head && (s = slot_take(bq))) {
    tdm__cmd *c = held_pop(bq);
    atomic_fetch_sub(&bq->nheld, 1);
    int rc = ooo_start_locked(bq, c, s);
    if (rc) fail_held(c, rc);
  }
}

/* Runs a requested drain unless another thread holds bq->mu, in which case that thread runs
 * it after letting go: every holder of an out-of-order queue's mu calls this after unlocking.
 * So a completion that comes with bq->mu held, even on this thread, never blocks on it. */
static void ooo_drain(tdm__bqueue *bq) {
  while (atomic_load(&bq->drain) && pthread_mutex_trylock(&bq->mu) == 0) {
    atomic_store(&bq->drain, false);
    ooo_drain_locked(bq);
    pthread_mutex_unlock(&bq->mu);
  }
}

static int ooo_submit(tdm__bqueue *bq, tdm__cmd *cmd) {
  pthread_mutex_lock(&bq->mu);
  int rc = 0;
  ocl_slot *s = NULL;
  if (goes_native(cmd) && (bq->held_head || !(s = slot_take(bq)))) {
    held_push(bq, cmd);
    atomic_fetch_add(&bq->nheld, 1);
    atomic_store(&bq->drain, true); /* a slot may have come back since slot_take */
  } else {
    rc = ooo_start_locked(bq, cmd, s);
  }
  pthread_mutex_unlock(&bq->mu);
  ooo_drain(bq);
  return rc;
}

int ocl_submit(tdm__bqueue *bq, tdm__cmd *cmd) {
  if (bq->ooo) return ooo_submit(bq, cmd);
  if (!bq->defer) return submit_now(bq, cmd);
  pthread_mutex_lock(&bq->mu);
  int rc = 0;
  if (bq->blocker || bq->held_head)
    held_push(bq, cmd);
  else
    rc = start_locked(bq, cmd);
  pthread_mutex_unlock(&bq->mu);
  return rc;
}

/* tdm_queue_wait without a command, on an in-order queue: a barrier on ev's cl_event,
 * enqueued at once. Not while host-side deferral holds the queue (the barrier would pass the
 * held commands), nor for an event without a usable cl_event (dep_native): the core submits a
 * wait command then. */
int ocl_queue_wait_now(tdm__bqueue *bq, tdm__event *ev) {
  if (bq->ooo) return 1;
  cl_event native = dep_native(bq, ev);
  if (!native) return 1;
  if (bq->defer) {
    pthread_mutex_lock(&bq->mu);
    if (bq->blocker || bq->held_head) {
      pthread_mutex_unlock(&bq->mu);
      return 1;
    }
  }
  flush_producer(bq, native);
  cl_int err = clEnqueueBarrierWithWaitList(bq->q, 1, &native, NULL);
  if (bq->defer) pthread_mutex_unlock(&bq->mu);
  return err == CL_SUCCESS ? 0 : ocl_error(err, "clEnqueueBarrierWithWaitList");
}

int ocl_native_flush(tdm__bqueue *bq, void **handle) {
  cl_event ev = NULL;
  cl_int err = clEnqueueMarkerWithWaitList(bq->q, 0, NULL, &ev);
  if (err != CL_SUCCESS) return ocl_error(err, "clEnqueueMarkerWithWaitList");
  *handle = ev;
  return 0;
}

int ocl_native_wait(void *handle, int *native) {
  cl_event ev = handle;
  cl_int err = clWaitForEvents(1, &ev);
  cl_int st = CL_COMPLETE;
  clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL);
  if (err == CL_SUCCESS && st >= 0) return 0;
  *native = st < 0 ? st : err;
  return TDM_EBACKEND;
}

void ocl_native_release(void *handle) { clReleaseEvent((cl_event)handle); }

/* The caller's cl_event is the handle itself: tandem retains it twice (the tandem event's
 * reference and the wait's), so the caller may release its own at once. */
int ocl_event_import(int bdev, void *native, void **handle) {
  cl_event ev = native;
  cl_context ctx = NULL;
  cl_int err = clGetEventInfo(ev, CL_EVENT_CONTEXT, sizeof ctx, &ctx, NULL);
  if (err != CL_SUCCESS) return ocl_error(err, "clGetEventInfo on the event to import");
  if (ctx != ocl_devs[bdev].ctx)
    return ocl_svc->error(TDM_EXDEV, 0, "the event belongs to another context than opencl:%d's "
                                        "(create it in the context tdm_device_native returns)",
                          bdev);
  if ((err = clRetainEvent(ev)) != CL_SUCCESS) return ocl_error(err, "clRetainEvent");
  if ((err = clRetainEvent(ev)) != CL_SUCCESS) {
    clReleaseEvent(ev);
    return ocl_error(err, "clRetainEvent");
  }
  *handle = ev;
  return 0;
}

/* ---- completion notices ----
 * clSetEventCallback reports completions. PoCL 3.1 never calls a CL_COMPLETE callback for an
 * event that ends in an error (a user event set below 0, a command whose wait list failed),
 * so a watcher thread also looks at the events whose notice is pending, every OCL_WATCH_MS
 * while there are any, and gives notice for those that failed. Whichever comes first gives
 * notice; the other does nothing. A notice the watcher gave stays allocated until shutdown,
 * since a driver that keeps to the standard may still call back for it; one the driver called
 * back for is kept for reuse (watch.spare), so giving notice allocates nothing in steady
 * state. */

#define OCL_WATCH_MS 10

typedef struct notice {
  struct notice *next;
  cl_event ev; /* the watcher's reference */
  void (*fn)(void *);
  void *arg;
  atomic_bool given;       /* fn was called */
  atomic_bool called_back; /* the driver's callback returned: the watcher frees it */
} notice;

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  notice *pending; /* looked at every OCL_WATCH_MS */
  notice *failed;  /* notice given by the watcher: freed at shutdown */
  notice *spare;   /* called back and looked at: free for reuse */
  bool started, stop;
  pthread_t thread;
} watch = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* A driver callback: it only gives notice, which pushes and wakes a thread. */
static void CL_CALLBACK on_complete(cl_event ev, cl_int status, void *user) {
  notice *n = user;
  if (!atomic_exchange(&n->given, true)) n->fn(n->arg);
  atomic_store_explicit(&n->called_back, true, memory_order_release); /* last touch of n */
}

/* Looks at each notice of the list once, without watch.mu (clGetEventInfo may wait for the
 * driver's locks); returns those still pending, and in *spare those done with. */
static notice *watch_pass(notice *list, notice **spare) {
  notice *keep = NULL;
  for (notice *n = list, *next; n; n = next) {
    next = n->next;
    if (atomic_load_explicit(&n->called_back, memory_order_acquire)) {
      clReleaseEvent(n->ev);
      n->next = *spare;
      *spare = n;
      continue;
    }
    cl_int st = CL_COMPLETE;
    clGetEventInfo(n->ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL);
    if (st >= 0) {
      n->next = keep;
      keep = n;
      continue;
    }
    if (!atomic_exchange(&n->given, true)) n->fn(n->arg);
    clReleaseEvent(n->ev);
    n->ev = NULL;
    pthread_mutex_lock(&watch.mu);
    n->next = watch.failed;
    watch.failed = n;
    pthread_mutex_unlock(&watch.mu);
  }
  return keep;
}

static void *watch_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&watch.mu);
  while (!watch.stop) {
    if (!watch.pending) {
      pthread_cond_wait(&watch.cv, &watch.mu);
      continue;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += OCL_WATCH_MS * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&watch.cv, &watch.mu, &until);
    notice *list = watch.pending;
    watch.pending = NULL;
    pthread_mutex_unlock(&watch.mu);
    notice *spare = NULL;
    notice *keep = watch_pass(list, &spare);
    pthread_mutex_lock(&watch.mu);
    while (spare) {
      notice *next = spare->next;
      spare->next = watch.spare;
      watch.spare = spare;
      spare = next;
    }
    while (keep) {
      notice *next = keep->next;
      keep->next = watch.pending;
      watch.pending = keep;
      keep = next;
    }
  }
  pthread_mutex_unlock(&watch.mu);
  return NULL;
}

int ocl_native_notify(void *handle, void (*fn)(void *), void *arg) {
  cl_event ev = handle;
  pthread_mutex_lock(&watch.mu);
  notice *n = watch.spare;
  if (n) {
    watch.spare = n->next;
  } else {
    pthread_mutex_unlock(&watch.mu); /* not across malloc */
    if (!(n = malloc(sizeof *n))) return TDM_ENOMEM;
    pthread_mutex_lock(&watch.mu);
  }
  n->ev = ev;
  n->fn = fn;
  n->arg = arg;
  atomic_store_explicit(&n->given, false, memory_order_relaxed);
  atomic_store_explicit(&n->called_back, false, memory_order_relaxed);
  if (!watch.started && pthread_create(&watch.thread, NULL, watch_main, NULL) == 0)
    watch.started = true;
  bool ok = watch.started;
  if (ok) {
    clRetainEvent(ev);
    if (!watch.pending) pthread_cond_signal(&watch.cv); /* the watcher sleeps until then */
    n->next = watch.pending;
    watch.pending = n;
  }
  pthread_mutex_unlock(&watch.mu);
  if (!ok) {
    free(n);
    return TDM_ENOMEM; /* the core waits for the event itself */
  }
  if (clSetEventCallback(ev, CL_COMPLETE, on_complete, n) != CL_SUCCESS) {
    /* No notice will come from here: the core waits for the event itself. */
    atomic_store(&n->given, true);
    atomic_store_explicit(&n->called_back, true, memory_order_release);
    return TDM_EBACKEND;
  }
  return 0;
}

void ocl_notices_stop(void) {
  pthread_mutex_lock(&watch.mu);
  bool started = watch.started;
  watch.stop = true;
  pthread_cond_signal(&watch.cv);
  pthread_mutex_unlock(&watch.mu);
  if (started) pthread_join(watch.thread, NULL);
  watch.started = watch.stop = false;
}

/* After every context is released: no callback can come any more. */
void ocl_notices_free(void) {
  for (int pass = 0; pass < 3; pass++) {
    notice *n = pass == 0 ? watch.pending : pass == 1 ? watch.failed : watch.spare;
    while (n) {
      notice *next = n->next;
      if (n->ev && pass < 2) clReleaseEvent(n->ev);
      free(n);
      n = next;
    }
  }
  watch.pending = watch.failed = watch.spare = NULL;
}

void ocl_gate_open(void *gate) {
  if ((uintptr_t)gate & 1u) {
    resume((tdm__bqueue *)((uintptr_t)gate & ~(uintptr_t)1u), NULL);
    return;
  }
  clSetUserEventStatus((cl_event)gate, CL_COMPLETE);
  clReleaseEvent((cl_event)gate);
}
