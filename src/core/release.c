/* release.c: keep-alive. A release waits for a queue-wide marker; the marker's completion only
 * pushes the release onto a list and wakes tandem's release thread, which calls it. The
 * release thread is not a queue worker, so a release can never block the work it waits for. */
#include <stdlib.h>

#include "internal.h"

typedef struct keep {
  tdm__waiter w;          /* first: the continuation node */
  struct keep *next;
  void (*release)(void *);
  void *obj;
  tdm__event *marker;
} keep;

static pthread_mutex_t rel_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t rel_cv = PTHREAD_COND_INITIALIZER;
static keep *rel_head, *rel_tail;
static bool rel_stop;
static long rel_outstanding; /* registered but not yet released */
static pthread_t rel_thread;
_Thread_local bool tdm__tls_releasing;

static void push(keep *k) {
  pthread_mutex_lock(&rel_mu);
  k->next = NULL;
  if (rel_tail)
    rel_tail->next = k;
  else
    rel_head = k;
  rel_tail = k;
  pthread_cond_signal(&rel_cv);
  pthread_mutex_unlock(&rel_mu);
}

static void on_marker(tdm__waiter *w, tdm__event *ev) { push((keep *)w); }

static void *release_main(void *arg) {
  tdm__tls_releasing = true;
  pthread_mutex_lock(&rel_mu);
  for (;;) {
    while (!rel_head && !(rel_stop && rel_outstanding == 0)) pthread_cond_wait(&rel_cv, &rel_mu);
    if (!rel_head) break;
    keep *k = rel_head;
    rel_head = k->next;
    if (!rel_head) rel_tail = NULL;
    pthread_mutex_unlock(&rel_mu);
    tdm__event_unref(k->marker);
    k->release(k->obj);
    free(k);
    pthread_mutex_lock(&rel_mu);
    rel_outstanding--;
  }
  pthread_mutex_unlock(&rel_mu);
  return NULL;
}

int tdm__release_start(void) {
  rel_stop = false;
  rel_head = rel_tail = NULL;
  rel_outstanding = 0;
  if (pthread_create(&rel_thread, NULL, release_main, NULL))
    return tdm__error(TDM_ENOMEM, 0, "cannot start the release thread");
  return 0;
}

/* Runs after every queue has drained, so every outstanding release is already listed. */
void tdm__release_stop(void) {
  pthread_mutex_lock(&rel_mu);
  rel_stop = true;
  pthread_cond_signal(&rel_cv);
  pthread_mutex_unlock(&rel_mu);
  pthread_join(rel_thread, NULL);
}

int tdm_keep_alive(tdm_queue *h, void (*release)(void *obj), void *obj) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  if (!release) return tdm__error(TDM_EINVAL, 0, "tdm_keep_alive: release is NULL");
  keep *k = tdm__malloc(sizeof *k);
  if (!k) return tdm__error(TDM_ENOMEM, 0, "no memory for a keep-alive");
  k->release = release;
  k->obj = obj;
  tdm__spec s = {.kind = TDM__CMD_MARKER, .op = "keep-alive marker", .all_prior = true};
  if ((rc = tdm__submit(q, &s, 0, NULL, &k->marker, NULL))) {
    free(k);
    return rc;
  }
  pthread_mutex_lock(&rel_mu);
  rel_outstanding++;
  pthread_mutex_unlock(&rel_mu);
  k->w.fn = on_marker;
  if (tdm__event_on_complete(k->marker, &k->w)) push(k);
  return 0;
}
