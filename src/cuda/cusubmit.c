/* cusubmit.c: turns tandem commands into stream operations. Every command ends with a recycled
 * event recorded on its stream, except quiet ones (whose completion only the queue can
 * observe: they complete with the next event, or one cu_native_flush records); the core waits
 * for it on the queue's executor (in-order) or is notified by the queue's notifier thread
 * (out-of-order queues, which round-robin over CU_OOO_STREAMS streams; see the notifier).
 * Host work (host tasks, pageable and host-only copies, host fills) holds the stream at a gate
 * until the core has done it; nothing tandem runs inside a CUDA callback. */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cu.h"

static int record(tdm__bqueue *bq, int si, cu_event **out) {
  cu_event *ev = cu_event_get(bq);
  if (!ev) return cu_svc->error(TDM_ENOMEM, 0, "no CUDA event");
  cudaError_t e = cudaEventRecord(ev->e, bq->s[si]);
  if (e != cudaSuccess) {
    cu_event_put(ev);
    return cu_error(e, "cudaEventRecord");
  }
  ev->stream = si;
  ev->bq = bq;
  *out = ev;
  return 0;
}

/* A dependency of another backend, or one not recorded natively: a gate the tandem event's
 * completion opens. */
static void bridge_fire(tdm__waiter *w, tdm__event *ev) { cu_gate_open((cu_gate *)w); }

/* Stream si waits for a native event: nothing to do for earlier work of the same stream
 * (implied by its order). Works across devices too, and whatever device is current. */
static int stream_wait(tdm__bqueue *bq, int si, const cu_event *native) {
  if (native->bq == bq && native->stream == si) return 0;
  cudaError_t e = cudaStreamWaitEvent(bq->s[si], native->e, 0);
  return e == cudaSuccess ? 0 : cu_error(e, "cudaStreamWaitEvent");
}

static int wait_deps(tdm__bqueue *bq, int si, tdm__cmd *cmd) {
  for (size_t i = 0; i < cmd->ndeps; i++) {
    if (cmd->deps[i].ordered) continue; /* cu_queue_wait_now made the wait already */
    tdm__event *dep = cmd->deps[i].ev;
    cu_event *native = cu_svc->event_native(dep, &tdm__cuda_backend);
    if (native) {
      int rc = stream_wait(bq, si, native);
      if (rc) return rc;
      continue;
    }
    cu_gate *g = cu_gate_get(bq->bdev);
    if (!g) return cu_svc->error(TDM_EBUSY, 0, "all %d gates of the device are in use", CU_GATES);
    int rc = cu_gate_enqueue(g, bq->s[si]);
    if (rc) {
      cu_gate_open(g); /* returns the slot */
      return rc;
    }
    g->w.fn = bridge_fire;
    if (cu_svc->event_on_complete(dep, &g->w)) cu_gate_open(g);
  }
  return 0;
}

/* Every other stream of an out-of-order queue joins stream si: what follows on si comes after
 * everything submitted to the queue so far. */
static int join_all(tdm__bqueue *bq, int si) {
  for (int i = 0; i < bq->nstreams; i++) {
    if (i == si) continue;
    cu_event *ev;
    int rc = record(bq, i, &ev);
    if (rc) return rc;
    cudaError_t e = cudaStreamWaitEvent(bq->s[si], ev->e, 0);
    cu_event_put(ev);
    if (e != cudaSuccess) return cu_error(e, "cudaStreamWaitEvent");
  }
  return 0;
}

static bool capturing(cudaStream_t s) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

/* Hands the command over: done is attached to the tandem event, wait is what the core waits
 * for (both references are the caller's, given away; where the two are one event, one
 * reference lent to the wait: TDM__CMD_WAIT_BORROWED). */
static void hand_over(tdm__cmd *cmd, cu_event *done, cu_event *wait, cu_gate *gate) {
  if (done) cu_svc->event_set_native(cmd->ev, done);
  cmd->wait = wait;
  cmd->gate = gate;
  cu_svc->cmd_native(cmd);
}

static int host_work(tdm__bqueue *bq, int si, tdm__cmd *cmd) {
  if (bq->ooo) {
    /* Out of order: a pool thread runs it once its dependencies have completed, and later
     * work waits only for what it names (through a gate on the tandem event). A gate on a
     * stream here would also hold the unrelated commands the round robin puts behind it, so
     * a host task waiting for a later one could wait for itself. */
    if (cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST;
    hand_over(cmd, NULL, NULL, NULL);
    return 0;
  }
  cu_event *pre, *done;
  int rc = record(bq, si, &pre);
  if (rc) return rc;
  cu_gate *g = cu_gate_get(bq->bdev);
  if (!g) {
    cu_event_put(pre);
    return cu_svc->error(TDM_EBUSY, 0, "all %d gates of the device are in use", CU_GATES);
  }
  if ((rc = cu_gate_enqueue(g, bq->s[si])) || (rc = record(bq, si, &done))) {
    cu_gate_open(g);
    cu_event_put(pre);
    return rc;
  }
  if (cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST;
  hand_over(cmd, done, pre, g);
  return 0;
}

/* Memory a copy must take through the host, in stream order: pageable or unknown memory, and
 * pinned memory of another backend's device (bdev -1), which CUDA never pinned, so that a
 * cudaMemcpyAsync would read it at once rather than in stream order. */
static bool pageable(const tdm__memref *r) {
  return r->kind == 0 || r->kind == TDM_MEM_HOST || (r->kind == TDM_MEM_PINNED && r->bdev < 0);
}

static int enqueue(tdm__bqueue *bq, int si, tdm__cmd *cmd) {
  cudaStream_t s = bq->s[si];
  cudaError_t e = cudaSuccess;
  const char *what = "";
  switch (cmd->kind) {
    case TDM__CMD_COPY: {
      void *dst = cmd->u.copy.dst;
      const void *src = cmd->u.copy.src;
      /* The core's registry says what the memory is: no pointer queries on this path. */
      bool dd = cmd->u.copy.d.kind == TDM_MEM_DEVICE, sd = cmd->u.copy.s.kind == TDM_MEM_DEVICE;
      bool dpage = pageable(&cmd->u.copy.d), spage = pageable(&cmd->u.copy.s);
      if (cmd->u.copy.n && ((!dd && !sd) || (dd && spage) || (sd && dpage)))
        return host_work(bq, si, cmd);
      what = "cudaMemcpyAsync";
      if (cmd->u.copy.n) e = cudaMemcpyAsync(dst, src, cmd->u.copy.n, cudaMemcpyDefault, s);
      break;
    }
    case TDM__CMD_FILL:
      if (cmd->u.fill.n && cmd->u.fill.d.kind != TDM_MEM_DEVICE) return host_work(bq, si, cmd);
      what = "cudaMemsetAsync";
      if (cmd->u.fill.n) e = cudaMemsetAsync(cmd->u.fill.dst, cmd->u.fill.value, cmd->u.fill.n, s);
      break;
    case TDM__CMD_HOST:
      if (capturing(s))
        return cu_svc->error(TDM_ESTATE, 0, "a stream being captured into a CUDA graph cannot "
                                            "run host tasks");
      return host_work(bq, si, cmd);
    case TDM__CMD_FREE: {
      /* The registry entry says what the memory is: device memory tandem allocated is freed
       * in stream order; an import is only forgotten, and host memory is freed by the core
       * after the marker below, from the executor. */
      const tdm__memref *m = &cmd->u.free_.m;
      if (m->kind == TDM_MEM_DEVICE && m->bdev >= 0 && !(m->bm.flags & TDM__BMEM_IMPORTED)) {
        what = "cudaFreeAsync";
        e = cudaFreeAsync(cmd->u.free_.ptr, s);
        if (e == cudaSuccess) cmd->flags |= TDM__CMD_NATIVE_FREED;
      }
      break;
    }
    case TDM__CMD_MARKER:
      if ((cmd->flags & TDM__CMD_SYNC) && capturing(s))
        return cu_svc->error(TDM_ESTATE, 0, "a stream being captured into a CUDA graph cannot "
                                            "be synchronized");
      /* fallthrough */
    case TDM__CMD_BARRIER:
      break;
  }
  if (e != cudaSuccess) return cu_error(e, what);
  if (cmd->flags & TDM__CMD_QUIET) {
    /* Nobody can observe it: it completes with the queue's next event (cu_native_flush). */
    hand_over(cmd, NULL, NULL, NULL);
    return 0;
  }
  cu_event *done;
  int rc = record(bq, si, &done);
  if (rc) return rc;
  /* One reference serves the tandem event and the wait (the core only borrows it). */
  cmd->flags |= TDM__CMD_WAIT_BORROWED;
  hand_over(cmd, done, done, NULL);
  return 0;
}

/* A call on a stream acts on the stream's device whatever device is current: a memory copy,
 * an event record (the event is the stream's device's: cu_event_take), a wait. So copies,
 * markers and waits are enqueued without the two current-device calls; fills and frees,
 * which launch or free on the device's behalf, are made with the device current, as are
 * gates (cu_gate_enqueue) and new events (cu_event_take). */
static bool needs_current(const tdm__cmd *cmd) {
  return cmd->kind == TDM__CMD_FILL || cmd->kind == TDM__CMD_FREE;
}

int cu_submit(tdm__bqueue *bq, tdm__cmd *cmd) {
  int saved = -1, rc;
  bool enter = needs_current(cmd);
  if (enter && (rc = cu_enter(bq->bdev, &saved))) return rc;
  int si = 0;
  if (bq->ooo) si = (int)(bq->rr++ % (unsigned)bq->nstreams);
  rc = wait_deps(bq, si, cmd);
  if (!rc && bq->ooo && (cmd->flags & TDM__CMD_ALL_PRIOR)) rc = join_all(bq, si);
  if (!rc) rc = enqueue(bq, si, cmd);
  if (enter) cu_leave(saved);
  return rc;
}

/* tdm_queue_wait without a command: the stream waits for ev's native event at once. Only an
 * event recorded by a CUDA queue has one; for any other the core submits a wait command
 * (which bridges it with a gate). */
int cu_queue_wait_now(tdm__bqueue *bq, tdm__event *ev) {
  cu_event *native = cu_svc->event_native(ev, &tdm__cuda_backend);
  if (!native || bq->ooo) return 1;
  return stream_wait(bq, 0, native);
}

/* ---- the core's side ---- */

int cu_native_flush(tdm__bqueue *bq, void **handle) {
  int saved, rc = cu_enter(bq->bdev, &saved);
  if (rc) return rc;
  cu_event *ev = NULL;
  rc = record(bq, 0, &ev);
  cu_leave(saved);
  if (!rc) *handle = ev;
  return rc;
}

int cu_native_wait(void *handle, int *native) {
  cu_event *ev = handle;
  cudaError_t e = cudaEventSynchronize(ev->e);
  if (e == cudaSuccess) return 0;
  *native = (int)e;
  return cu_error(e, "the command failed on the device");
}

void cu_native_release(void *handle) { cu_event_put(handle); }

/* cudaSuccess only: a device fault is sticky, so an event recorded after failed work never
 * reports success. */
int cu_native_done(void *handle) { return cudaEventQuery(((cu_event *)handle)->e) == cudaSuccess; }

/* What user code waits for is the cudaEvent_t, not tandem's wrapper around it. */
void *cu_native_export(void *handle) { return ((cu_event *)handle)->e; }

void cu_gate_open_entry(void *gate) { cu_gate_open(gate); }

int cu_event_elapsed(void *a, void *b, double *ms) {
  cu_event *x = a, *y = b;
  if (!x->timed || !y->timed) return cu_svc->error(TDM_ENOTSUP, 0, "events are not timed");
  float f = 0;
  cudaError_t e = cudaEventElapsedTime(&f, x->e, y->e);
  if (e != cudaSuccess) return cu_error(e, "cudaEventElapsedTime");
  *ms = f;
  return 0;
}

/* ---- the notifier: one thread per out-of-order queue ----
 * native_notify pushes the event (its own link: nothing is allocated) onto the queue's
 * notifier, a workq whose thread moves it to its stream's pending list. Each stream's events
 * complete in order, so only each list's head needs looking at; the lists are independent,
 * and a later stream's event may well be the one an earlier stream's work waits for (through
 * a gate on a host task that waits for it). So the thread never blocks on one stream's event
 * while others are pending: CUDA has no wait for the first of several events, so it polls the
 * heads (cudaEventQuery, which also reports a failed or lost device at once), backing off from
 * a yield to NOTE_BACKOFF_MAX_US between fruitless rounds, and sleeps on the workq once
 * nothing is pending. Each completion is notified in its stream's order. */

#define NOTE_BACKOFF_MAX_US 200

/* Run on the notifier's thread, for each event pushed: to its stream's pending list. */
static void note_take(tdm__workq *wq, tdm__workq_item *it) {
  tdm__bqueue *bq = wq->ctx;
  cu_event *ev = TDM__CONTAINER_OF(it, cu_event, note_link);
  int si = ev->stream;
  ev->note_next = NULL;
  if (bq->pend_tail[si])
    bq->pend_tail[si]->note_next = ev;
  else
    bq->pend_head[si] = ev;
  bq->pend_tail[si] = ev;
  bq->npend++;
  bq->backoff_us = 0;
}

/* Notifies the completed heads of stream si's list; returns how many. */
static int note_stream(tdm__bqueue *bq, int si) {
  int n = 0;
  cu_event *ev;
  while ((ev = bq->pend_head[si]) && cudaEventQuery(ev->e) != cudaErrorNotReady) {
    bq->pend_head[si] = ev->note_next;
    if (!bq->pend_head[si]) bq->pend_tail[si] = NULL;
    bq->npend--;
    void (*fn)(void *) = ev->note_fn;
    void *arg = ev->note_arg;
    fn(arg); /* may release the core's reference to ev: the last touch */
    n++;
  }
  return n;
}

static void note_back_off(tdm__bqueue *bq) {
  if (bq->backoff_us == 0) {
    sched_yield();
    bq->backoff_us = 1;
    return;
  }
  struct timespec ts = {0, (long)bq->backoff_us * 1000};
  nanosleep(&ts, NULL);
  bq->backoff_us = bq->backoff_us * 2 > NOTE_BACKOFF_MAX_US ? NOTE_BACKOFF_MAX_US
                                                           : bq->backoff_us * 2;
}

/* Run on the notifier's thread whenever its FIFO is empty: one round over the pending lists.
 * Returns true (look at the FIFO again, then come back) while any event is pending. */
static bool note_poll(tdm__workq *wq) {
  tdm__bqueue *bq = wq->ctx;
  if (!bq->npend) return false;
  cudaSetDevice(cu_devs[bq->bdev].ordinal);
  int done = 0;
  for (int si = 0; si < bq->nstreams; si++) done += note_stream(bq, si);
  if (done)
    bq->backoff_us = 0;
  else
    note_back_off(bq);
  return true;
}

int cu_notifier_start(tdm__bqueue *bq) {
  bq->npend = 0;
  bq->backoff_us = 0;
  int e = tdm__workq_init(&bq->notes, note_take, note_poll, bq);
  if (!e && (e = tdm__workq_start(&bq->notes))) tdm__workq_fini(&bq->notes);
  if (e) return cu_svc->error(TDM_ENOMEM, e, "cannot start a CUDA queue's notifier thread");
  return 0;
}

/* The core has drained the queue: every notice has been given. */
void cu_notifier_stop(tdm__bqueue *bq) {
  tdm__workq_stop(&bq->notes);
  tdm__workq_fini(&bq->notes);
}

int cu_native_notify(void *handle, void (*fn)(void *), void *arg) {
  cu_event *ev = handle;
  if (ev->imported) return cu_import_notify(ev, fn, arg);
  /* The core holds ev (cmd->wait, a reference of its own or one lent by the tandem event the
   * command holds) until fn has been called. */
  ev->note_fn = fn;
  ev->note_arg = arg;
  tdm__workq_push(&ev->bq->notes, &ev->note_link, true);
  return 0;
}
