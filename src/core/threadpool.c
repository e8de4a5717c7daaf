/* threadpool.c: the thread pool, tandem's shared host threads. They run commands of
 * out-of-order queues: a command is held back, without occupying a thread, until its
 * dependencies complete (each completion decrements its count through a continuation), or, for
 * native backends, until the driver notifies that its native work completed; then any pool
 * thread runs it with tdm__cmd_run. The ready list is a workq (util/workq.h) that every pool
 * thread serves; the driver notification only pushes onto it and wakes a thread.
 *
 * Host tasks may call tandem, and so may block a pool thread in a wait for work that only
 * another pool thread can run (a task waiting for a later, independent task of an
 * out-of-order queue). So a pool thread that blocks in a caller's wait is replaced: while it
 * waits, the pool keeps its number of unblocked threads by starting a spare (up to
 * TDM__THREADPOOL_SPARES of them; spares stay until shutdown and sleep when idle). When they
 * are all started and a wait would block the last thread not blocked already, a caller's wait
 * (tdm_event_wait, tdm_queue_sync) fails with TDM_EDEADLK instead: nothing would be left to
 * run the work it waits for. */
#include <stdlib.h>

#include "internal.h"

#define TDM__THREADPOOL_SPARES 256

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER; /* guards the thread list */
static tdm__workq ready; /* commands ready to run, served by every pool thread */
static pthread_t *threads;
static long nthreads, target, nblocked; /* under pool_mu */
static _Thread_local bool tls_pool_thread;

void tdm__threadpool_ready(tdm__cmd *cmd) { tdm__workq_push(&ready, &cmd->link, true); }

static void run_ready(tdm__workq *wq, tdm__workq_item *it) {
  tdm__cmd_run(TDM__CONTAINER_OF(it, tdm__cmd, link));
}

static void release_one(tdm__cmd *cmd) {
  if (__atomic_sub_fetch(&cmd->bcount, 1, __ATOMIC_ACQ_REL) == 0) tdm__threadpool_ready(cmd);
}

static void dep_done(tdm__waiter *w, tdm__event *ev) {
  tdm__dep *d = (tdm__dep *)((char *)w - offsetof(tdm__dep, w));
  release_one(d->cmd);
}

static void *pool_main(void *arg) {
  tls_pool_thread = true;
  tdm__workq_serve(&ready);
  return NULL;
}

/* Whether this pool thread is the last one not blocked in a wait, with no spare left to
 * start: under pool_mu. */
static bool starving(void) {
  return nthreads - nblocked <= 1 && nthreads >= target + TDM__THREADPOOL_SPARES;
}

bool tdm__threadpool_starved(void) {
  if (!tls_pool_thread) return false;
  pthread_mutex_lock(&pool_mu);
  bool s = starving();
  pthread_mutex_unlock(&pool_mu);
  return s;
}

static int wait_as_pool_thread(tdm__event *ev, bool may_refuse) {
  pthread_mutex_lock(&pool_mu);
  if (may_refuse && starving()) {
    pthread_mutex_unlock(&pool_mu);
    tdm__error(TDM_EDEADLK, 0, "every one of tandem's %ld pool threads would be blocked in a "
               "wait, with none left to run the work they wait for", nthreads);
    return TDM__WAIT_REFUSED;
  }
  nblocked++;
  if (nthreads - nblocked < target && nthreads < target + TDM__THREADPOOL_SPARES &&
      pthread_create(&threads[nthreads], NULL, pool_main, NULL) == 0)
    nthreads++; /* if none can start, this wait blocks as it would have */
  pthread_mutex_unlock(&pool_mu);
  int st = tdm__event_wait_raw(ev);
  pthread_mutex_lock(&pool_mu);
  nblocked--;
  pthread_mutex_unlock(&pool_mu);
  return st;
}

int tdm__event_wait_blocking(tdm__event *ev) {
  if (!tls_pool_thread || atomic_load_explicit(&ev->done, memory_order_acquire))
    return tdm__event_wait_raw(ev);
  return wait_as_pool_thread(ev, false);
}

int tdm__event_wait_host(tdm__event *ev) {
  if (!tls_pool_thread || atomic_load_explicit(&ev->done, memory_order_acquire))
    return tdm__event_wait_raw(ev);
  return wait_as_pool_thread(ev, true);
}

int tdm__threadpool_start(void) {
  long n = tdm__g.opts.cpu_pool_threads;
  pthread_mutex_lock(&pool_mu);
  int rc = 0;
  if (!threads) {
    target = n;
    nblocked = 0;
    if (tdm__workq_init(&ready, run_ready, NULL, NULL)) {
      pthread_mutex_unlock(&pool_mu);
      return tdm__error(TDM_ENOMEM, 0, "cannot start tandem's host threads");
    }
    threads = calloc((size_t)(n + TDM__THREADPOOL_SPARES), sizeof *threads);
    if (!threads) rc = TDM_ENOMEM;
    for (long i = 0; !rc && i < n; i++) {
      if (pthread_create(&threads[i], NULL, pool_main, NULL)) {
        rc = TDM_ENOMEM;
        break;
      }
      nthreads++;
    }
    if (rc && nthreads > 0) rc = 0; /* the threads that started serve */
    if (rc) {                         /* none started: leave no half-made pool behind */
      free(threads);
      threads = NULL;
      tdm__workq_fini(&ready);
    }
  }
  pthread_mutex_unlock(&pool_mu);
  return rc ? tdm__error(rc, 0, "cannot start tandem's host threads") : 0;
}

/* Runs after every queue has drained. */
void tdm__threadpool_stop(void) {
  pthread_mutex_lock(&pool_mu);
  bool started = threads != NULL;
  pthread_mutex_unlock(&pool_mu);
  if (!started) return;
  tdm__workq_close(&ready);
  pthread_mutex_lock(&pool_mu); /* no spare starts now: every queue has drained */
  long n = nthreads;
  pthread_mutex_unlock(&pool_mu);
  for (long i = 0; i < n; i++) pthread_join(threads[i], NULL);
  tdm__workq_fini(&ready); /* a completion thread may still be waking the list */
  free(threads);
  threads = NULL;
  nthreads = 0;
}

void tdm__threadpool_after_deps(tdm__cmd *cmd) {
  /* One extra count, dropped last, so the command cannot start while deps are registered. */
  cmd->bcount = (long)cmd->ndeps + 1;
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__dep *d = &cmd->deps[i];
    d->w.fn = dep_done;
    if (tdm__event_on_complete(d->ev, &d->w)) release_one(cmd);
  }
  release_one(cmd);
}

/* Driver notification for native commands of out-of-order queues: count down, return. */
static void native_done(void *arg) { release_one(arg); }

/* On an out-of-order queue a command reaches a pool thread only once its native work and every
 * dependency have completed, so pool threads never block on each other (a pool of waiting
 * threads could otherwise starve the completions they wait for). */
void tdm__cmd_native(tdm__cmd *cmd) {
  tdm__queue *q = cmd->ev->q;
  if (!(q->flags & TDM_QUEUE_OUT_OF_ORDER) || !tdm__b_can_notify(q->dev)) {
    tdm__exec_push(cmd);
    return;
  }
  cmd->bcount = (long)cmd->ndeps + 2; /* deps, the native work, and a guard dropped last */
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__dep *d = &cmd->deps[i];
    d->w.fn = dep_done;
    if (tdm__event_on_complete(d->ev, &d->w)) release_one(cmd);
  }
  /* Without a handle, or a notification, a pool thread waits for the native work itself. */
  if (!cmd->wait || tdm__b_native_notify(q->dev, cmd->wait, native_done, cmd)) release_one(cmd);
  release_one(cmd);
}
