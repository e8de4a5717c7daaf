/* tracker.c: the order tracker. Per queue, the events of tandem's own recent submissions (on
 * an out-of-order queue; an in-order queue's order implies them, and a marker stands for them
 * where they must be named) and foreign events handed in with tdm_queue_track. Bounded:
 * completed entries are pruned, and when it is still full every entry collapses into one
 * barrier. All functions run with q->submit_mu held. */
#include <stdlib.h>

#include "internal.h"


int tdm__tracker_init(tdm__queue *q) {
  size_t cap = (size_t)tdm__g.opts.tracker_capacity;
  q->trk = tdm__calloc(cap, sizeof *q->trk);
  q->xwait = q->trk ? tdm__calloc(cap, sizeof *q->xwait) : NULL;
  if (!q->xwait) {
    free(q->trk);
    q->trk = NULL;
    return tdm__error(TDM_ENOMEM, 0, "no memory for a queue's tracker");
  }
  q->nxwait = q->nxres = 0;
  q->trk_cap = cap;
  q->ntrk = 0;
  q->gate = NULL;
  return 0;
}

void tdm__tracker_fini(tdm__queue *q) {
  for (size_t i = 0; i < q->ntrk; i++) tdm__event_unref(q->trk[i]);
  free(q->trk);
  q->trk = NULL;
  q->ntrk = q->trk_cap = 0;
  for (size_t i = 0; i < q->nxwait; i++) tdm__event_unref(q->xwait[i].ev);
  free(q->xwait);
  q->xwait = NULL;
  q->nxwait = q->nxres = 0;
  if (q->gate) tdm__event_unref(q->gate);
  q->gate = NULL;
}

void tdm__tracker_prune(tdm__queue *q) {
  size_t k = 0;
  for (size_t i = 0; i < q->ntrk; i++) {
    if (atomic_load(&q->trk[i]->done))
      tdm__event_unref(q->trk[i]);
    else
      q->trk[k++] = q->trk[i];
  }
  q->ntrk = k;
}

/* Replaces every entry with one barrier that waits for all of them. */
static int collapse(tdm__queue *q) {
  tdm__spec s = {.kind = TDM__CMD_BARRIER, .op = "tracker barrier", .gate = true,
                 .untracked = true};
  tdm__event *ev;
  int rc = tdm__submit_locked(q, &s, q->ntrk, q->trk, &ev, NULL);
  if (rc) return rc;
  for (size_t i = 0; i < q->ntrk; i++) tdm__event_unref(q->trk[i]);
  q->trk[0] = ev;
  q->ntrk = 1;
  return 0;
}

int tdm__tracker_reserve(tdm__queue *q) {
  if (q->ntrk < q->trk_cap) return 0;
  tdm__tracker_prune(q);
  return q->ntrk < q->trk_cap ? 0 : collapse(q);
}

/* The caller's event reference is taken over by the tracker (after tdm__tracker_reserve). */
void tdm__tracker_add(tdm__queue *q, tdm__event *ev) { q->trk[q->ntrk++] = ev; }

/* ---- cross-queue copies and device-side waits waiting to be covered by this queue's order
 * ---- */

/* Drops the entries that have completed. An ordered entry that failed stays: its failure is
 * the queue's, and the next command takes it. */
static void xwait_prune(tdm__queue *q) {
  size_t k = 0;
  for (size_t i = 0; i < q->nxwait; i++) {
    tdm__event *ev = q->xwait[i].ev;
    if (atomic_load(&ev->done) && !(q->xwait[i].ordered && ev->status != 0))
      tdm__event_unref(ev);
    else
      q->xwait[k++] = q->xwait[i];
  }
  q->nxwait = k;
}

bool tdm__xwait_room(tdm__queue *q) {
  if (q->nxwait + q->nxres >= q->trk_cap) xwait_prune(q);
  return q->nxwait + q->nxres < q->trk_cap;
}

void tdm__xwait_add_ordered(tdm__queue *q, tdm__event *ev) {
  for (size_t i = 0; i < q->nxwait; i++)
    if (q->xwait[i].ev == ev) { /* already listed: the one entry will do */
      q->xwait[i].ordered = true;
      return;
    }
  tdm__event_ref(ev);
  q->xwait[q->nxwait++] = (tdm__xwait){.ev = ev, .ordered = true};
}

int tdm__xwait_reserve(tdm__queue *q) {
  pthread_mutex_lock(&q->submit_mu);
  int rc = 0;
  if (atomic_load(&q->destroying)) {
    rc = tdm__error(TDM_EHANDLE, 0, "%s is being destroyed", q->label);
  } else {
    if (!tdm__xwait_room(q) && q->nxwait) {
      /* Make room: a barrier takes the waiting copies as dependencies. */
      tdm__spec s = {.kind = TDM__CMD_BARRIER, .op = "cross-copy barrier", .gate = true};
      rc = tdm__submit_locked(q, &s, 0, NULL, NULL, NULL);
    }
    if (!rc && q->nxwait + q->nxres >= q->trk_cap)
      rc = tdm__error(TDM_EBUSY, 0, "%s has %zu cross-queue copies underway", q->label, q->nxres);
    if (!rc) q->nxres++;
  }
  pthread_mutex_unlock(&q->submit_mu);
  return rc;
}

void tdm__xwait_fill(tdm__queue *q, tdm__event *ev) {
  pthread_mutex_lock(&q->submit_mu);
  q->nxres--;
  q->xwait[q->nxwait++] = (tdm__xwait){.ev = ev}; /* takes over the caller's reference */
  pthread_mutex_unlock(&q->submit_mu);
}

void tdm__xwait_cancel(tdm__queue *q) {
  pthread_mutex_lock(&q->submit_mu);
  q->nxres--;
  pthread_mutex_unlock(&q->submit_mu);
}

void tdm__xwait_consumed(tdm__queue *q, bool covers_all) {
  if (!covers_all) {
    xwait_prune(q);
    return;
  }
  for (size_t i = 0; i < q->nxwait; i++) tdm__event_unref(q->xwait[i].ev);
  q->nxwait = 0;
}

int tdm_queue_track(tdm_queue *qh, tdm_event *evh) {
  TDM__ENTER();
  tdm__queue *q;
  tdm__event *ev;
  int rc = tdm__queue_get(qh, &q);
  if (rc || (rc = tdm__event_get(evh, &ev))) return rc;
  pthread_mutex_lock(&q->submit_mu);
  rc = tdm__tracker_reserve(q);
  if (!rc) {
    tdm__event_ref(ev);
    tdm__tracker_add(q, ev);
  }
  pthread_mutex_unlock(&q->submit_mu);
  return rc;
}

int tdm_queue_dependencies(tdm_queue *qh, tdm_event **deps, size_t cap, size_t *n) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(qh, &q);
  if (rc) return rc;
  if (!n || (cap && !deps))
    return tdm__error(TDM_EINVAL, 0, "tdm_queue_dependencies: NULL output");
  pthread_mutex_lock(&q->submit_mu);
  tdm__tracker_prune(q);
  xwait_prune(q);
  /* An in-order queue with work of its own not yet complete: a marker names it. */
  bool own = !(q->flags & TDM_QUEUE_OUT_OF_ORDER) &&
             atomic_load(&q->n_done) < atomic_load(&q->n_submitted);
  size_t need = q->ntrk + q->nxwait + (own ? 1 : 0);
  tdm__event *marker = NULL;
  if (need > cap) {
    if (cap == 0)
      rc = tdm__error(TDM_EINVAL, 0, "cap is 0 but %zu events are needed", need);
    else
      rc = collapse(q); /* its barrier also takes the pending cross-queue copies, and on an
                           in-order queue comes after its own work */
    own = false;
  }
  if (!rc && own) {
    tdm__spec s = {.kind = TDM__CMD_MARKER, .op = "dependencies", .untracked = true};
    rc = tdm__submit_locked(q, &s, 0, NULL, &marker, NULL);
  }
  if (!rc) {
    size_t k = 0;
    for (size_t i = 0; i < q->ntrk; i++) deps[k++] = tdm__event_handout(q->trk[i]);
    for (size_t i = 0; i < q->nxwait; i++) deps[k++] = tdm__event_handout(q->xwait[i].ev);
    if (marker) deps[k++] = tdm__event_handout(marker);
    *n = k;
  }
  pthread_mutex_unlock(&q->submit_mu);
  if (marker) tdm__event_unref(marker);
  return rc;
}
