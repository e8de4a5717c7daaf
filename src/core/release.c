/* release.c: keep-alive. A release waits for a queue-wide marker; the marker's completion only
 * pushes the release onto a list and wakes tandem's release thread, which calls it. The
 * release thread is not a queue worker, so a release can never block the work it waits for. */
#include <stdlib.h>

#include "internal.h"

/* A keep-alive. Recycled through its queue's free list (q->keeps), so registering one
 * allocates nothing in steady state; queue structs outlive the release thread. */
typedef struct keep {
  void *next;             /* first: the free list's link */
  tdm__queue *q;          /* whose free list it goes back to */
  tdm__waiter w;          /* the continuation node */
  tdm__workq_item link;   /* the release thread's FIFO */
  void (*release)(void *);
  void *obj;
  tdm__event *marker;
} keep;

/* The release thread: a workq with one thread. Every keep-alive registered is announced to it
 * (tdm__workq_expect), so it stops only once each one has been released: a marker's
 * continuation may still be on its way to push when the last queue has drained. */
static tdm__workq rel;
_Thread_local bool tdm__tls_releasing;

static void on_marker(tdm__waiter *w, tdm__event *ev) {
  tdm__workq_push(&rel, &TDM__CONTAINER_OF(w, keep, w)->link, true);
}

static void run_release(tdm__workq *wq, tdm__workq_item *it) {
  keep *k = TDM__CONTAINER_OF(it, keep, link);
  tdm__tls_releasing = true;
  tdm__event_unref(k->marker);
  k->release(k->obj);
  tdm__freelist_put(&k->q->keeps, k);
  tdm__workq_expect(wq, -1);
}

int tdm__release_start(void) {
  if (tdm__workq_init(&rel, run_release, NULL, NULL))
    return tdm__error(TDM_ENOMEM, 0, "cannot start the release thread");
  if (tdm__workq_start(&rel)) {
    tdm__workq_fini(&rel);
    return tdm__error(TDM_ENOMEM, 0, "cannot start the release thread");
  }
  return 0;
}

long tdm__release_pending(void) { return tdm__workq_expected(&rel); }

/* Runs after every queue has drained, so every outstanding release is already listed or on
 * its way. */
void tdm__release_stop(void) {
  tdm__workq_stop(&rel);
  tdm__workq_fini(&rel);
}

int tdm_keep_alive(tdm_queue *h, void (*release)(void *obj), void *obj) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  if (!release) return tdm__error(TDM_EINVAL, 0, "tdm_keep_alive: release is NULL");
  tdm__spec s = {.kind = TDM__CMD_MARKER, .op = "keep-alive marker", .all_prior = true};
  pthread_mutex_lock(&q->submit_mu); /* guards q->keeps' local list, as tdm__submit does */
  keep *k = NULL;
  if (atomic_load(&q->destroying))
    rc = tdm__error(TDM_EHANDLE, 0, "%s is being destroyed", q->label);
  else if (!(k = tdm__freelist_get(&q->keeps)) && !(k = tdm__malloc(sizeof *k)))
    rc = tdm__error(TDM_ENOMEM, 0, "no memory for a keep-alive");
  else if ((rc = tdm__submit_locked(q, &s, 0, NULL, &k->marker, NULL)))
    tdm__freelist_put(&q->keeps, k);
  pthread_mutex_unlock(&q->submit_mu);
  if (rc) return rc;
  k->q = q;
  k->release = release;
  k->obj = obj;
  tdm__workq_expect(&rel, 1);
  k->w.fn = on_marker;
  if (tdm__event_on_complete(k->marker, &k->w)) on_marker(&k->w, k->marker);
  return 0;
}
