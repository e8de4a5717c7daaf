/* exec.c: the per-queue executor of native backends (CUDA, OpenCL). Natively enqueued
 * commands are handed over in submission order; the executor waits for each one's native
 * handle, runs host tasks and opens their gates, and completes the command. This is how the
 * core learns of completion without running anything inside a driver callback. */
#include <stdlib.h>

#include "internal.h"

typedef struct tdm__exec {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  tdm__cmd *head, *tail;
  bool stop;
  pthread_t thread;
} tdm__exec;

static void *exec_main(void *arg) {
  tdm__exec *x = arg;
  pthread_mutex_lock(&x->mu);
  for (;;) {
    while (!x->head && !x->stop) pthread_cond_wait(&x->cv, &x->mu);
    tdm__cmd *c = x->head;
    if (!c) break;
    x->head = c->next;
    if (!x->head) x->tail = NULL;
    pthread_mutex_unlock(&x->mu);
    tdm__cmd_run(c);
    pthread_mutex_lock(&x->mu);
  }
  pthread_mutex_unlock(&x->mu);
  return NULL;
}

int tdm__exec_start(tdm_queue *q) {
  tdm__exec *x = tdm__calloc(1, sizeof *x);
  if (!x) return tdm__error(TDM_ENOMEM, 0, "no memory for a queue executor");
  pthread_mutex_init(&x->mu, NULL);
  pthread_cond_init(&x->cv, NULL);
  if (pthread_create(&x->thread, NULL, exec_main, x)) {
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    free(x);
    return tdm__error(TDM_ENOMEM, 0, "cannot start a queue executor thread");
  }
  q->exec = x;
  return 0;
}

void tdm__exec_stop(tdm_queue *q) {
  tdm__exec *x = q->exec;
  if (!x) return;
  pthread_mutex_lock(&x->mu);
  x->stop = true;
  pthread_cond_signal(&x->cv);
  pthread_mutex_unlock(&x->mu);
  pthread_join(x->thread, NULL);
  pthread_mutex_destroy(&x->mu);
  pthread_cond_destroy(&x->cv);
  free(x);
  q->exec = NULL;
}

void tdm__exec_push(tdm__cmd *cmd) {
  tdm__exec *x = cmd->ev->q->exec;
  pthread_mutex_lock(&x->mu);
  cmd->next = NULL;
  if (x->tail)
    x->tail->next = cmd;
  else
    x->head = cmd;
  x->tail = cmd;
  pthread_cond_signal(&x->cv);
  pthread_mutex_unlock(&x->mu);
}
