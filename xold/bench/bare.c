/* bare.c: the pthread mutex/condvar baseline of bare.h. */
#include "bare.h"

#include <stddef.h>

static void *bare_worker(void *arg) {
  bare_queue *q = arg;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->stop)
      pthread_cond_wait(&q->nonempty, &q->mu);
    bare_node *n = q->head;
    if (!n)
      break; /* stopping, and nothing is left */
    q->head = n->next;
    if (!q->head)
      q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    n->fn(n->arg); /* n may be reused by its owner once fn has run: read nothing after */
    pthread_mutex_lock(&q->mu);
  }
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

int bare_queue_start(bare_queue *q) {
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->nonempty, NULL);
  q->head = q->tail = NULL;
  q->stop = 0;
  int rc = pthread_create(&q->worker, NULL, bare_worker, q);
  if (rc != 0) {
    pthread_cond_destroy(&q->nonempty);
    pthread_mutex_destroy(&q->mu);
  }
  return rc;
}

void bare_queue_stop(bare_queue *q) {
  pthread_mutex_lock(&q->mu);
  q->stop = 1;
  pthread_cond_signal(&q->nonempty);
  pthread_mutex_unlock(&q->mu);
  pthread_join(q->worker, NULL);
  pthread_cond_destroy(&q->nonempty);
  pthread_mutex_destroy(&q->mu);
}

void bare_queue_push(bare_queue *q, bare_node *n) {
  n->next = NULL;
  pthread_mutex_lock(&q->mu);
  if (q->tail)
    q->tail->next = n;
  else
    q->head = n;
  q->tail = n;
  pthread_cond_signal(&q->nonempty);
  pthread_mutex_unlock(&q->mu);
}

void bare_event_init(bare_event *e) {
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->done = 0;
}

void bare_event_destroy(bare_event *e) {
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
}

void bare_event_set(void *arg) {
  bare_event *e = arg;
  pthread_mutex_lock(&e->mu);
  e->done = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

void bare_event_wait(bare_event *e) {
  pthread_mutex_lock(&e->mu);
  while (!e->done)
    pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}

void bare_event_wait_reset(bare_event *e) {
  pthread_mutex_lock(&e->mu);
  while (!e->done)
    pthread_cond_wait(&e->cv, &e->mu);
  e->done = 0;
  pthread_mutex_unlock(&e->mu);
}
