/* exec.c: the per-queue executor of native backends (CUDA, OpenCL), a workq (util/workq.h)
 * with one thread. Natively enqueued commands are handed over in submission order; the
 * executor waits for each one's native handle, runs host tasks and opens their gates, and
 * completes the command. This is how the core learns of completion
 * without running anything inside a driver callback.
 *
 * Keeping the submitting thread lean (backends with native_flush):
 * - A quiet command (TDM__CMD_QUIET: nobody can observe its event but the queue itself) may
 *   come without a native handle. It completes when the next handle in the FIFO does, since
 *   the native queue is in order; when none follows, the executor records one itself
 *   (native_flush) and waits for that.
 * - With wake_lazily, a push wakes a sleeping executor only when the command needs the host
 *   (host tasks, gates, host copies, frees, syncs) or when TDM__WORKQ_BATCH commands have piled
 *   up; anyone about to wait for or poll an event kicks its queue's executor
 *   (tdm__exec_kick), so completions are never late for an observer, and the submitting
 *   thread rarely pays for a wake-up or competes with the executor for the driver. */
#include "internal.h"

/* ---- the executor: one thread per native queue ---- */

static bool exec_lazy(const tdm__queue *q) { return tdm__b_wakes_lazily(q->dev); }

/* A quiet command without a native handle: it completes with the next handle. */
static bool held_back(const tdm__queue *q, const tdm__cmd *c) {
  return (c->flags & TDM__CMD_QUIET) && !c->wait && !c->gate && tdm__b_can_flush(q->dev);
}

static bool needs_host(const tdm__cmd *c) {
  return c->gate || c->kind == TDM__CMD_HOST || c->kind == TDM__CMD_FREE ||
         (c->flags & (TDM__CMD_SYNC | TDM__CMD_ON_HOST));
}

/* Completes the held commands, in order, with the status of the native wait that covers
 * them. */
static void finish_held(tdm__queue *q, int nstatus, int native) {
  tdm__cmd *c = q->x_held;
  q->x_held = NULL;
  q->x_held_tail = &q->x_held;
  while (c) {
    tdm__cmd *n = c->next;
    tdm__cmd_finish(c, nstatus, native);
    c = n;
  }
}

/* Waits for a native handle; returns the mapped status (the device is marked lost on
 * TDM_EDEVLOST) and releases the handle. */
static int wait_native(tdm__queue *q, void *handle, int *native) {
  int st = tdm__b_native_wait(q->dev, handle, native);
  tdm__b_native_release(q->dev, handle);
  return st;
}

/* No later handle covers the held commands: records one on the native queue and waits for
 * it. The record must land right after them and before anything that waits for this executor
 * (a later host task's gate, which opens only once the executor reaches that task: a handle
 * behind it would never complete). So it is made under the submission lock, and only while
 * the FIFO is empty (every command submitted so far is held here); otherwise it returns false
 * and the executor goes on with the FIFO, whose next handle will cover them. */
static bool flush_held(tdm__queue *q, bool always) {
  void *h = NULL;
  int native = 0;
  pthread_mutex_lock(&q->submit_mu);
  if (!always && !tdm__workq_empty(&q->xq)) {
    pthread_mutex_unlock(&q->submit_mu);
    return false;
  }
  int st = tdm__b_native_flush(q, &h);
  pthread_mutex_unlock(&q->submit_mu);
  if (st == 0) st = wait_native(q, h, &native);
  finish_held(q, st, native);
  return true;
}

/* The FIFO is empty: held commands are flushed before the executor sleeps or stops. */
static bool exec_idle(tdm__workq *wq) {
  tdm__queue *q = wq->ctx;
  if (!q->x_held) return false;
  flush_held(q, false);
  return true;
}

static void exec_run(tdm__workq *wq, tdm__workq_item *it) {
  tdm__queue *q = wq->ctx;
  tdm__cmd *c = TDM__CONTAINER_OF(it, tdm__cmd, link);
  if (held_back(q, c)) {
    c->next = NULL;
    *q->x_held_tail = c;
    q->x_held_tail = &c->next;
  } else if (!c->wait) {
    /* Unreachable while backends keep backend.h's rule (on an in-order queue, the only one
     * with held commands, every command but a quiet one comes with a handle). Should one
     * break it, the held commands are at least completed before this one runs. */
    if (q->x_held) flush_held(q, true);
    tdm__cmd_run(c);
  } else {
    int native = 0;
    void *h = c->wait;
    c->wait = NULL;
    int st = wait_native(q, h, &native);
    if (q->x_held) finish_held(q, st, native);
    tdm__cmd_finish(c, st, native);
  }
}

int tdm__exec_init(tdm__queue *q) { return tdm__workq_init(&q->xq, exec_run, exec_idle, q); }

int tdm__exec_start(tdm__queue *q) {
  q->x_held = NULL;
  q->x_held_tail = &q->x_held;
  if (tdm__workq_start(&q->xq))
    return tdm__error(TDM_ENOMEM, 0, "cannot start a queue executor thread");
  return 0;
}

void tdm__exec_stop(tdm__queue *q) { tdm__workq_stop(&q->xq); }

void tdm__exec_push(tdm__cmd *cmd) {
  tdm__queue *q = cmd->ev->q;
  tdm__workq_push(&q->xq, &cmd->link, !exec_lazy(q) || needs_host(cmd));
}

void tdm__exec_kick(tdm__queue *q) {
  /* Only a lazily woken executor can sleep with commands queued. */
  if (exec_lazy(q)) tdm__workq_kick(&q->xq);
}
