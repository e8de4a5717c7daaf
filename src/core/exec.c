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
 *   thread rarely pays for a wake-up or competes with the executor for the driver.
 *
 * Lazy completion (backends with native_done, in-order queues that neither time nor trace):
 * a command nobody can be waiting for yet (a marker, a native copy, fill or wait with its own
 * native handle, or a quiet one without; no dependencies, nothing for the host to do) is not
 * handed to the executor at all. It goes on the queue's lazy list, in order, and completes in
 * one of two ways:
 * - reaped: every LZ_STEP lazy submissions, the submitting thread asks native_done of the
 *   command with a handle that was newest LZ_STEP submissions ago; if it has completed and the
 *   executor has nothing of its own left, that command and every lazy one before it complete
 *   there and then, on the submitting thread, with no driver wait and no other thread touching
 *   them. So that there is always one to ask, at most LZ_STEP - 1 quiet commands in a row go
 *   without a handle (tdm__exec_quiet_ok): the next one is submitted with its own;
 * - handed over: as soon as anyone watches (an observer's kick: a wait, a query, a waiter of
 *   another queue or backend, a keep-alive), when a command that needs the executor is
 *   handed over (the lazy ones go first, so the FIFO keeps submission order), or when LZ_MAX
 *   have piled up, the lazy list goes to the executor, which completes it as any other.
 * Completions stay in submission order: a reap only starts when the executor has finished
 * everything handed to it, and the executor finishes nothing while a reap is under way
 * (lz_reaping; a reap runs event waiters, which never block). Device-side waits need none of
 * this: they wait for the native event, which exists from submission on. */
#include <sched.h>

#include "internal.h"

/* ---- the executor: one thread per native queue ---- */

/* Reaps are tried every LZ_STEP lazy submissions; at LZ_MAX the list goes to the executor. */
#define LZ_STEP 16
#define LZ_MAX 64

static bool exec_lazy(const tdm__queue *q) { return tdm__b_wakes_lazily(q->dev); }

/* Called by the executor before it completes anything: a reap under way finishes first. */
static void reap_wait(tdm__queue *q) {
  while (atomic_load_explicit(&q->lz_reaping, memory_order_acquire)) sched_yield();
}

/* The executor has finished n commands handed to it (counted where a reap needs to know). */
static void exec_done(tdm__queue *q, unsigned long n) {
  if (q->can_lazy) atomic_fetch_add_explicit(&q->x_done, n, memory_order_release);
}

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
  unsigned long n = 0;
  reap_wait(q);
  while (c) {
    tdm__cmd *next = c->next;
    tdm__cmd_finish(c, nstatus, native);
    c = next;
    n++;
  }
  exec_done(q, n);
}

/* Waits for a native handle; returns the mapped status (the device is marked lost on
 * TDM_EDEVLOST) and releases the handle if it is owned (not lent: TDM__CMD_WAIT_BORROWED). */
static int wait_native(tdm__queue *q, void *handle, bool owned, int *native) {
  int st = tdm__b_native_wait(q->dev, handle, native);
  if (owned) tdm__b_native_release(q->dev, handle);
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
  if (st == 0) st = wait_native(q, h, true, &native);
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
    reap_wait(q);
    tdm__cmd_run(c);
    exec_done(q, 1);
  } else {
    int native = 0;
    void *h = c->wait;
    c->wait = NULL;
    int st = wait_native(q, h, !(c->flags & TDM__CMD_WAIT_BORROWED), &native);
    if (q->x_held) finish_held(q, st, native);
    reap_wait(q);
    tdm__cmd_finish(c, st, native);
    exec_done(q, 1);
  }
}

int tdm__exec_init(tdm__queue *q) {
  int e = tdm__workq_init(&q->xq, exec_run, exec_idle, q);
  if (!e && (e = pthread_mutex_init(&q->lz_mu, NULL))) tdm__workq_fini(&q->xq);
  return e;
}

void tdm__exec_fini(tdm__queue *q) {
  tdm__workq_fini(&q->xq); /* after wake-ups of the executor in progress */
  pthread_mutex_destroy(&q->lz_mu);
}

int tdm__exec_start(tdm__queue *q) {
  q->x_held = NULL;
  q->x_held_tail = &q->x_held;
  q->lz_head = q->lz_tail = q->lz_last = q->lz_cand = NULL;
  atomic_store(&q->lz_n, 0);
  atomic_store(&q->lz_quiet, 0);
  q->x_pushed = 0;
  atomic_store(&q->x_done, 0);
  atomic_store(&q->lz_reaping, 0);
  q->can_lazy = !(q->flags & (TDM_QUEUE_OUT_OF_ORDER | TDM_QUEUE_TIMING)) &&
                tdm__b_can_query(q->dev);
  if (tdm__workq_start(&q->xq))
    return tdm__error(TDM_ENOMEM, 0, "cannot start a queue executor thread");
  return 0;
}

/* Hands the lazy list to the executor, in order, waking it after the last if wake (always for
 * a backend whose executor is woken at every command). With q->lz_mu held. */
static void lz_hand_over(tdm__queue *q, bool wake) {
  tdm__cmd *c = q->lz_head;
  if (!c) return;
  wake = wake || !exec_lazy(q);
  q->lz_head = q->lz_tail = q->lz_last = q->lz_cand = NULL;
  atomic_store_explicit(&q->lz_n, 0, memory_order_relaxed);
  atomic_store_explicit(&q->lz_quiet, 0, memory_order_relaxed);
  while (c) {
    tdm__cmd *next = c->next;
    q->x_pushed++;
    tdm__workq_push(&q->xq, &c->link, wake && !next);
    c = next;
  }
}

void tdm__exec_stop(tdm__queue *q) {
  pthread_mutex_lock(&q->lz_mu);
  lz_hand_over(q, true);
  pthread_mutex_unlock(&q->lz_mu);
  tdm__workq_stop(&q->xq);
}

/* Whether nobody can be waiting for cmd, of a queue that completes lazily, yet (see the top).
 * A command without a handle is quiet: it completes with a later one. */
static bool lazy_ok(const tdm__queue *q, const tdm__cmd *cmd) {
  return (cmd->wait || held_back(q, cmd)) && !cmd->gate && cmd->ndeps == 0 &&
         !needs_host(cmd) && !atomic_load_explicit(&tdm__tracing, memory_order_relaxed);
}

bool tdm__exec_quiet_ok(const tdm__queue *q) {
  return !q->can_lazy ||
         atomic_load_explicit(&q->lz_quiet, memory_order_relaxed) < LZ_STEP - 1;
}

void tdm__exec_push(tdm__cmd *cmd) {
  tdm__queue *q = cmd->ev->q;
  if (!q->can_lazy) { /* no lazy list, so nothing to order against: the push alone */
    tdm__workq_push(&q->xq, &cmd->link, !exec_lazy(q) || needs_host(cmd));
    return;
  }
  cmd->next = NULL;
  pthread_mutex_lock(&q->lz_mu);
  if (lazy_ok(q, cmd)) {
    if (q->lz_tail)
      q->lz_tail->next = cmd;
    else
      q->lz_head = cmd;
    q->lz_tail = cmd;
    if (cmd->wait) q->lz_last = cmd;
    int quiet = cmd->wait ? 0 : atomic_load_explicit(&q->lz_quiet, memory_order_relaxed) + 1;
    atomic_store_explicit(&q->lz_quiet, quiet, memory_order_relaxed);
    long n = atomic_load_explicit(&q->lz_n, memory_order_relaxed) + 1;
    atomic_store_explicit(&q->lz_n, n, memory_order_relaxed);
    if (n >= LZ_MAX)
      lz_hand_over(q, false);
    else if (++q->lz_steps % LZ_STEP == 0)
      atomic_store_explicit(&q->lz_reap, 1, memory_order_relaxed);
  } else {
    lz_hand_over(q, false);
    q->x_pushed++;
    tdm__workq_push(&q->xq, &cmd->link, !exec_lazy(q) || needs_host(cmd));
  }
  pthread_mutex_unlock(&q->lz_mu);
}

void tdm__exec_reap(tdm__queue *q) {
  if (!atomic_load_explicit(&q->lz_reap, memory_order_relaxed)) return;
  tdm__cmd *mine = NULL, *last = NULL;
  pthread_mutex_lock(&q->lz_mu);
  atomic_store_explicit(&q->lz_reap, 0, memory_order_relaxed);
  tdm__cmd *cand = q->lz_cand;
  q->lz_cand = q->lz_last; /* the next one to ask, LZ_STEP submissions from now */
  if (cand && !atomic_load_explicit(&q->lz_reaping, memory_order_relaxed) &&
      atomic_load_explicit(&q->x_done, memory_order_acquire) == q->x_pushed &&
      tdm__b_native_done(q->dev, cand->wait)) {
    /* cand and every lazy command before it have completed, and the executor has nothing
     * left: they are this thread's to finish. */
    long k = 0;
    for (tdm__cmd *c = q->lz_head; c != cand->next; c = c->next) k++;
    mine = q->lz_head;
    last = cand;
    q->lz_head = cand->next;
    if (!q->lz_head) q->lz_tail = NULL;
    /* lz_last is cand or a later command: cand was the newest with a handle when chosen. */
    if (q->lz_last == cand) q->lz_last = NULL;
    if (q->lz_cand == cand) q->lz_cand = NULL;
    atomic_store_explicit(&q->lz_n, atomic_load_explicit(&q->lz_n, memory_order_relaxed) - k,
                          memory_order_relaxed);
    atomic_store_explicit(&q->lz_reaping, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&q->lz_mu);
  if (!mine) return;
  last->next = NULL;
  /* Their events complete together, under one lock of the queue's rather than one each. */
  tdm__cmd_finish_reaped(q, mine);
  atomic_store_explicit(&q->lz_reaping, 0, memory_order_release);
}

void tdm__exec_kick(tdm__queue *q) {
  if (atomic_load_explicit(&q->lz_n, memory_order_relaxed)) {
    pthread_mutex_lock(&q->lz_mu);
    lz_hand_over(q, true);
    pthread_mutex_unlock(&q->lz_mu);
  }
  /* Only a lazily woken executor can sleep with commands queued. */
  if (exec_lazy(q)) tdm__workq_kick(&q->xq);
}
