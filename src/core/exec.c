/* exec.c: a FIFO of commands served by threads (the pool's ready list), and the per-queue
 * executor of native backends (CUDA, OpenCL). Natively enqueued commands are handed over in
 * submission order; the executor waits for each one's native handle, runs host tasks and
 * opens their gates, and completes the command. This is how the core learns of completion
 * without running anything inside a driver callback.
 *
 * Keeping the submitting thread lean (backends with native_flush):
 * - A quiet command (TDM__CMD_QUIET: nobody can observe its event but the queue itself) may
 *   come without a native handle. It completes when the next handle in the FIFO does, since
 *   the native queue is in order; when none follows, the executor records one itself
 *   (native_flush) and waits for that.
 * - With wake_lazily, a push wakes a sleeping executor only when the command needs the host
 *   (host tasks, gates, host copies, frees, syncs) or when TDM__CMDQ_BATCH commands have piled
 *   up; anyone about to wait for or poll an event kicks its queue's executor
 *   (tdm__exec_kick), so completions are never late for an observer, and the submitting
 *   thread rarely pays for a wake-up or competes with the executor for the driver. */
#include <sched.h>
#include <stdlib.h>

#include "internal.h"

/* At most this many commands wait in the FIFO of a sleeping server without waking it, so
 * what they hold (events, dependencies) is returned promptly. */
#define TDM__CMDQ_BATCH 64

_Atomic long tdm__signaling;

void tdm__signals_quiesce(void) {
  while (atomic_load_explicit(&tdm__signaling, memory_order_acquire)) sched_yield();
}

void tdm__cmdq_init(tdm__cmdq *f) {
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  f->head = f->tail = NULL;
  f->stop = false;
  f->sleepers = 0;
  f->unsignaled = 0;
}

/* Called with f->mu held: lets go of it, then wakes one sleeping server if signal. After the
 * lock is let go, so a woken thread that shares this CPU does not block on it at once. What
 * was pushed may already have run and its queue drained by then (a pusher can be a driver's
 * callback thread): the count keeps shutdown from destroying f under the signal. */
static void cmdq_unlock_wake(tdm__cmdq *f, bool signal) {
  if (signal) {
    f->unsignaled = 0;
    tdm__signal_begin();
  }
  pthread_mutex_unlock(&f->mu);
  if (signal) {
    pthread_cond_signal(&f->cv);
    tdm__signal_end();
  }
}

void tdm__cmdq_push(tdm__cmdq *f, tdm__cmd *cmd, bool wake) {
  cmd->next = NULL;
  pthread_mutex_lock(&f->mu);
  if (f->tail)
    f->tail->next = cmd;
  else
    f->head = cmd;
  f->tail = cmd;
  cmdq_unlock_wake(f, f->sleepers && (wake || ++f->unsignaled >= TDM__CMDQ_BATCH));
}

void tdm__cmdq_kick(tdm__cmdq *f) {
  pthread_mutex_lock(&f->mu);
  cmdq_unlock_wake(f, f->sleepers && f->head);
}

/* Called with f->mu held. */
static void cmdq_sleep(tdm__cmdq *f) {
  f->sleepers++;
  pthread_cond_wait(&f->cv, &f->mu);
  f->sleepers--;
}

/* Called with f->mu held and f->head set. */
static tdm__cmd *cmdq_pop(tdm__cmdq *f) {
  tdm__cmd *c = f->head;
  f->head = c->next;
  if (!f->head) f->tail = NULL;
  return c;
}

void tdm__cmdq_serve(tdm__cmdq *f) {
  pthread_mutex_lock(&f->mu);
  for (;;) {
    while (!f->head && !f->stop) cmdq_sleep(f);
    if (!f->head) break; /* stopped and drained */
    tdm__cmd *c = cmdq_pop(f);
    pthread_mutex_unlock(&f->mu);
    tdm__cmd_run(c);
    pthread_mutex_lock(&f->mu);
  }
  pthread_mutex_unlock(&f->mu);
}

void tdm__cmdq_stop(tdm__cmdq *f) {
  pthread_mutex_lock(&f->mu);
  f->stop = true;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
}

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
static void finish_held(tdm__cmd **held, tdm__cmd ***tail, int nstatus, int native) {
  tdm__cmd *c = *held;
  *held = NULL;
  *tail = held;
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
static bool flush_held(tdm__queue *q, tdm__cmd **held, tdm__cmd ***tail, bool always) {
  void *h = NULL;
  int native = 0;
  pthread_mutex_lock(&q->submit_mu);
  pthread_mutex_lock(&q->xq.mu);
  bool empty = q->xq.head == NULL;
  pthread_mutex_unlock(&q->xq.mu);
  if (!empty && !always) {
    pthread_mutex_unlock(&q->submit_mu);
    return false;
  }
  int st = tdm__b_native_flush(q, &h);
  pthread_mutex_unlock(&q->submit_mu);
  if (st == 0) st = wait_native(q, h, &native);
  finish_held(held, tail, st, native);
  return true;
}

static void *exec_main(void *arg) {
  tdm__queue *q = arg;
  tdm__cmdq *f = &q->xq;
  tdm__cmd *held = NULL, **held_tail = &held;
  pthread_mutex_lock(&f->mu);
  for (;;) {
    if (!f->head) {
      if (held) {
        pthread_mutex_unlock(&f->mu);
        flush_held(q, &held, &held_tail, false);
        pthread_mutex_lock(&f->mu);
        continue;
      }
      if (f->stop) break; /* stopped and drained */
      f->unsignaled = 0;
      cmdq_sleep(f);
      continue;
    }
    tdm__cmd *c = cmdq_pop(f);
    pthread_mutex_unlock(&f->mu);
    if (held_back(q, c)) {
      c->next = NULL;
      *held_tail = c;
      held_tail = &c->next;
    } else if (!c->wait) {
      /* Unreachable while backends keep backend.h's rule (on an in-order queue, the only one
       * with held commands, every command but a quiet one comes with a handle). Should one
       * break it, the held commands are at least completed before this one runs. */
      if (held) flush_held(q, &held, &held_tail, true);
      tdm__cmd_run(c);
    } else {
      int native = 0;
      void *h = c->wait;
      c->wait = NULL;
      int st = wait_native(q, h, &native);
      if (held) finish_held(&held, &held_tail, st, native);
      tdm__cmd_finish(c, st, native);
    }
    pthread_mutex_lock(&f->mu);
  }
  pthread_mutex_unlock(&f->mu);
  return NULL;
}

int tdm__exec_start(tdm__queue *q) {
  q->xq.head = q->xq.tail = NULL;
  q->xq.stop = false;
  q->xq.unsignaled = 0;
  if (pthread_create(&q->x_thread, NULL, exec_main, q))
    return tdm__error(TDM_ENOMEM, 0, "cannot start a queue executor thread");
  q->x_running = true;
  return 0;
}

void tdm__exec_stop(tdm__queue *q) {
  if (!q->x_running) return;
  tdm__cmdq_stop(&q->xq);
  pthread_join(q->x_thread, NULL);
  q->x_running = false;
}

void tdm__exec_push(tdm__cmd *cmd) {
  tdm__queue *q = cmd->ev->q;
  tdm__cmdq_push(&q->xq, cmd, !exec_lazy(q) || needs_host(cmd));
}

void tdm__exec_kick(tdm__queue *q) {
  /* Only a lazily woken executor can sleep with commands queued. */
  if (exec_lazy(q)) tdm__cmdq_kick(&q->xq);
}
