/* pool.c: the threads that run out-of-order CPU queues. A command is held back, without
 * occupying a thread, until its dependencies complete (each completion decrements its count
 * through a continuation); then any pool thread runs it. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "cpu.h"

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static tdm__cmd *ready_head, *ready_tail;
static pthread_t *threads;
static long nthreads;
static bool stopping;

static void push_ready(tdm__cmd *cmd) {
  pthread_mutex_lock(&pool_mu);
  cmd->next = NULL;
  if (ready_tail)
    ready_tail->next = cmd;
  else
    ready_head = cmd;
  ready_tail = cmd;
  pthread_cond_signal(&pool_cv);
  pthread_mutex_unlock(&pool_mu);
}

static void release_one(tdm__cmd *cmd) {
  if (__atomic_sub_fetch(&cmd->bcount, 1, __ATOMIC_ACQ_REL) == 0) push_ready(cmd);
}

static void dep_done(tdm__waiter *w, tdm_event *ev) {
  tdm__dep *d = (tdm__dep *)((char *)w - offsetof(tdm__dep, w));
  release_one(d->cmd);
}

static void *pool_main(void *arg) {
  pthread_mutex_lock(&pool_mu);
  for (;;) {
    while (!ready_head && !stopping) pthread_cond_wait(&pool_cv, &pool_mu);
    tdm__cmd *c = ready_head;
    if (!c) break;
    ready_head = c->next;
    if (!ready_head) ready_tail = NULL;
    pthread_mutex_unlock(&pool_mu);
    tdm__cpu_svc->cmd_run(c);
    pthread_mutex_lock(&pool_mu);
  }
  pthread_mutex_unlock(&pool_mu);
  return NULL;
}

int tdm__cpu_pool_start(long n) {
  pthread_mutex_lock(&pool_mu);
  int rc = 0;
  if (!threads) {
    stopping = false;
    threads = calloc((size_t)n, sizeof *threads);
    if (!threads) rc = TDM_ENOMEM;
    for (long i = 0; !rc && i < n; i++) {
      if (pthread_create(&threads[i], NULL, pool_main, NULL)) {
        rc = TDM_ENOMEM;
        break;
      }
      nthreads++;
    }
  }
  if (rc && nthreads > 0) rc = 0; /* the threads that started serve */
  pthread_mutex_unlock(&pool_mu);
  return rc;
}

void tdm__cpu_pool_stop(void) {
  pthread_mutex_lock(&pool_mu);
  stopping = true;
  pthread_cond_broadcast(&pool_cv);
  pthread_mutex_unlock(&pool_mu);
  for (long i = 0; i < nthreads; i++) pthread_join(threads[i], NULL);
  free(threads);
  threads = NULL;
  nthreads = 0;
}

void tdm__cpu_pool_submit(tdm__cmd *cmd) {
  /* One extra count, dropped last, so the command cannot start while deps are registered. */
  cmd->bcount = (long)cmd->ndeps + 1;
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__dep *d = &cmd->deps[i];
    d->w.fn = dep_done;
    if (tdm__cpu_svc->event_on_complete(d->ev, &d->w)) release_one(cmd);
  }
  release_one(cmd);
}
