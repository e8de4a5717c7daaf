/* workq.c: the FIFO-and-worker primitive (workq.h says what it promises). */
#include "util/workq.h"

#include <sched.h>

#include "util/spin.h"

int tdm__workq_init(tdm__workq *wq, tdm__workq_run_fn run, tdm__workq_idle_fn idle, void *ctx) {
  int e = pthread_mutex_init(&wq->mu, NULL);
  if (e) return e;
  if ((e = pthread_cond_init(&wq->cv, NULL))) {
    pthread_mutex_destroy(&wq->mu);
    return e;
  }
  wq->head = wq->tail = NULL;
  wq->stop = false;
  wq->sleepers = 0;
  wq->unsignaled = 0;
  wq->expected = 0;
  atomic_init(&wq->signaling, 0);
  wq->run = run;
  wq->idle = idle;
  wq->ctx = ctx;
  wq->running = false;
  wq->spin_ns = 0;
  atomic_init(&wq->queued, false);
  return 0;
}

void tdm__workq_fini(tdm__workq *wq) {
  while (atomic_load_explicit(&wq->signaling, memory_order_acquire)) sched_yield();
  pthread_mutex_destroy(&wq->mu);
  pthread_cond_destroy(&wq->cv);
}

/* Called with wq->mu held: lets go of it, then wakes one sleeping server if signal. The count
 * spans the signal because the pushed item may already have run, and its owner be tearing the
 * workq down, by the time the signal is made. */
static void unlock_wake(tdm__workq *wq, bool signal) {
  if (signal) {
    wq->unsignaled = 0;
    atomic_fetch_add_explicit(&wq->signaling, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&wq->mu);
  if (signal) {
    pthread_cond_signal(&wq->cv);
    atomic_fetch_sub_explicit(&wq->signaling, 1, memory_order_release); /* last touch of wq */
  }
}

/* Called with wq->mu held. */
static void append(tdm__workq *wq, tdm__workq_item *item) {
  item->next = NULL;
  if (wq->tail)
    wq->tail->next = item;
  else
    wq->head = item;
  wq->tail = item;
  atomic_store_explicit(&wq->queued, true, memory_order_relaxed);
}

/* Polls, without the lock, until an item is queued or spin_ns have passed; the caller looks
 * again under the lock either way. */
static void poll_queued(tdm__workq *wq) {
  uint64_t end = tdm__clock_ns() + (uint64_t)wq->spin_ns;
  for (unsigned i = 1; !atomic_load_explicit(&wq->queued, memory_order_relaxed); i++) {
    tdm__relax();
    if (i % 64 == 0 && tdm__clock_ns() > end) return;
  }
}

void tdm__workq_push(tdm__workq *wq, tdm__workq_item *item, bool wake) {
  pthread_mutex_lock(&wq->mu);
  append(wq, item);
  unlock_wake(wq, wq->sleepers && (wake || ++wq->unsignaled >= TDM__WORKQ_BATCH));
}

bool tdm__workq_try_push(tdm__workq *wq, tdm__workq_item *item, bool wake) {
  pthread_mutex_lock(&wq->mu);
  if (wq->stop) {
    pthread_mutex_unlock(&wq->mu);
    return false;
  }
  append(wq, item);
  unlock_wake(wq, wq->sleepers && (wake || ++wq->unsignaled >= TDM__WORKQ_BATCH));
  return true;
}

void tdm__workq_kick(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  unlock_wake(wq, wq->sleepers && wq->head);
}

bool tdm__workq_empty(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  bool empty = wq->head == NULL;
  pthread_mutex_unlock(&wq->mu);
  return empty;
}

void tdm__workq_expect(tdm__workq *wq, long n) {
  pthread_mutex_lock(&wq->mu);
  wq->expected += n;
  /* The last announced item ran while stopping: a server may sleep waiting for it. */
  unlock_wake(wq, wq->sleepers && wq->stop && wq->expected == 0);
}

long tdm__workq_expected(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  long n = wq->expected;
  pthread_mutex_unlock(&wq->mu);
  return n;
}

void tdm__workq_serve(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  for (;;) {
    if (!wq->head) {
      if (wq->idle) {
        pthread_mutex_unlock(&wq->mu);
        bool did = wq->idle(wq);
        pthread_mutex_lock(&wq->mu);
        if (did || wq->head) continue;
      }
      if (wq->stop && wq->expected == 0) break; /* stopped and drained */
      if (wq->spin_ns > 0 && !wq->stop) {
        pthread_mutex_unlock(&wq->mu);
        poll_queued(wq);
        pthread_mutex_lock(&wq->mu);
        if (wq->head || wq->stop) continue; /* a stop's broadcast found no sleeper */
      }
      wq->unsignaled = 0;
      wq->sleepers++;
      pthread_cond_wait(&wq->cv, &wq->mu);
      wq->sleepers--;
      continue;
    }
    tdm__workq_item *it = wq->head;
    wq->head = it->next;
    if (!wq->head) {
      wq->tail = NULL;
      atomic_store_explicit(&wq->queued, false, memory_order_relaxed);
    }
    pthread_mutex_unlock(&wq->mu);
    wq->run(wq, it);
    pthread_mutex_lock(&wq->mu);
  }
  pthread_mutex_unlock(&wq->mu);
}

static void *serve_main(void *arg) {
  tdm__workq_serve(arg);
  return NULL;
}

int tdm__workq_start(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  wq->head = wq->tail = NULL;
  atomic_store_explicit(&wq->queued, false, memory_order_relaxed);
  wq->stop = false;
  wq->unsignaled = 0;
  wq->expected = 0;
  pthread_mutex_unlock(&wq->mu);
  int e = pthread_create(&wq->thread, NULL, serve_main, wq);
  wq->running = e == 0;
  return e;
}

void tdm__workq_close(tdm__workq *wq) {
  pthread_mutex_lock(&wq->mu);
  wq->stop = true;
  pthread_cond_broadcast(&wq->cv);
  pthread_mutex_unlock(&wq->mu);
}

void tdm__workq_stop(tdm__workq *wq) {
  tdm__workq_close(wq);
  if (wq->running) pthread_join(wq->thread, NULL);
  wq->running = false;
}
