/* exec.c: the per-queue executor of native backends (CUDA, OpenCL). Natively enqueued
 * commands are handed over in submission order; the executor waits for each one's native
 * handle, runs host tasks and opens their gates, and completes the command. This is how the
 * core learns of completion without running anything inside a driver callback. */
#include <stdlib.h>

#include "internal.h"

void tdm__cmdq_init(tdm__cmdq *f) {
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  f->head = f->tail = NULL;
  f->stop = false;
}

void tdm__cmdq_push(tdm__cmdq *f, tdm__cmd *cmd) {
  pthread_mutex_lock(&f->mu);
  cmd->next = NULL;
  if (f->tail)
    f->tail->next = cmd;
  else
    f->head = cmd;
  f->tail = cmd;
  pthread_cond_signal(&f->cv);
  pthread_mutex_unlock(&f->mu);
}

void tdm__cmdq_serve(tdm__cmdq *f) {
  pthread_mutex_lock(&f->mu);
  for (;;) {
    while (!f->head && !f->stop) pthread_cond_wait(&f->cv, &f->mu);
    tdm__cmd *c = f->head;
    if (!c) break; /* stopped and drained */
    f->head = c->next;
    if (!f->head) f->tail = NULL;
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

/* ---- the executor: one thread serving one queue's FIFO ---- */

typedef struct tdm__exec {
  tdm__cmdq fifo;
  pthread_t thread;
} tdm__exec;

static void *exec_main(void *arg) {
  tdm__cmdq_serve(&((tdm__exec *)arg)->fifo);
  return NULL;
}

int tdm__exec_start(tdm_queue *q) {
  tdm__exec *x = tdm__calloc(1, sizeof *x);
  if (!x) return tdm__error(TDM_ENOMEM, 0, "no memory for a queue executor");
  tdm__cmdq_init(&x->fifo);
  if (pthread_create(&x->thread, NULL, exec_main, x)) {
    pthread_mutex_destroy(&x->fifo.mu);
    pthread_cond_destroy(&x->fifo.cv);
    free(x);
    return tdm__error(TDM_ENOMEM, 0, "cannot start a queue executor thread");
  }
  q->exec = x;
  return 0;
}

void tdm__exec_stop(tdm_queue *q) {
  tdm__exec *x = q->exec;
  if (!x) return;
  tdm__cmdq_stop(&x->fifo);
  pthread_join(x->thread, NULL);
  pthread_mutex_destroy(&x->fifo.mu);
  pthread_cond_destroy(&x->fifo.cv);
  free(x);
  q->exec = NULL;
}

void tdm__exec_push(tdm__cmd *cmd) { tdm__cmdq_push(&cmd->ev->q->exec->fifo, cmd); }
