/* event.c: events (reference counted, recycled per queue, completed once with a status) and the
 * free lists that make submission allocation-free in steady state. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "lfstack.h"
#include "util/spin.h"

_Atomic long tdm__signaling;

void tdm__signals_quiesce(void) {
  while (atomic_load_explicit(&tdm__signaling, memory_order_acquire)) sched_yield();
}

/* ---- free lists: a local list popped under the owner's lock, refilled whole from a lock-free
 * stack that any thread pushes onto (lfstack.h); get and put are inline (internal.h). */

void tdm__freelist_drain(tdm__freelist *p, void (*destroy)(void *)) {
  tdm__link *lists[2] = {p->local, tdm__lfstack_take(&p->returned)};
  p->local = NULL;
  for (int i = 0; i < 2; i++)
    for (tdm__link *it = lists[i], *n; it; it = n) {
      n = it->next;
      destroy(it);
    }
}

uint64_t tdm__now_ns(void) { return tdm__clock_ns(); }

/* ---- events ---- */

int tdm__event_get(tdm_event *h, tdm__event **out) {
  if (!h) return tdm__error(TDM_EINVAL, 0, "event is NULL");
  tdm__event *ev = tdm__handle_obj(h, TDM__KIND_EVENT);
  if (!ev || atomic_load_explicit(&ev->handle, memory_order_relaxed) != (uintptr_t)h ||
      atomic_load_explicit(&ev->urefs, memory_order_relaxed) <= 0)
    return tdm__error(TDM_EHANDLE, 0, "%p is not a live event (released, from before a "
                      "shutdown, or not an event)", (void *)h);
  *out = ev;
  return 0;
}

tdm_event *tdm__event_handout(tdm__event *ev) {
  if (atomic_fetch_add(&ev->urefs, 1) == 0) tdm__event_ref(ev);
  return (tdm_event *)(uintptr_t)atomic_load_explicit(&ev->handle, memory_order_relaxed);
}

void tdm__event_ref(tdm__event *ev) { atomic_fetch_add(&ev->refs, 1); }

/* An event of q whose last reference is gone, made ready for q's free list. */
static void event_scrub(tdm__queue *q, tdm__event *ev) {
  /* The last reference is this thread's: nobody else reads bev now, so no exchange. */
  void *bev = atomic_load_explicit(&ev->bev, memory_order_relaxed);
  atomic_store_explicit(&ev->bev, NULL, memory_order_relaxed);
  if (bev) tdm__b_native_release(q->dev, bev);
  if (ev->why) { /* only after a failure; nobody reads it now, every waiter held a reference */
    free(ev->why);
    ev->why = NULL;
  }
  ev->why_relayed = false;
  atomic_store_explicit(&ev->magic, TDM__MAGIC_DEAD, memory_order_relaxed);
  ev->q = NULL;
}

/* The n scrubbed events first..last (linked by next) go back to q together: one push, one
 * count, one drop of their n references to q (the last touch of q). */
static void events_put(tdm__queue *q, tdm__event *first, tdm__event *last, int n) {
  tdm__lfstack_push_list(&q->events.returned, first, last);
  atomic_fetch_add_explicit(&q->n_freed, n, memory_order_relaxed);
  tdm__queue_unref_n(q, n);
}

void tdm__event_free(tdm__event *ev) {
  tdm__queue *q = ev->q;
  event_scrub(q, ev);
  events_put(q, ev, ev, 1);
}

void tdm__event_unref(tdm__event *ev) {
  if (atomic_fetch_sub(&ev->refs, 1) == 1) tdm__event_free(ev);
}

/* status and native are read only by whoever sees ev done, which the batch publishes. */
void tdm__event_complete_unref(tdm__event *ev, int status, int native) {
  ev->status = status;
  ev->native = native;
  tdm__event_complete_batch(ev->q, &ev, 1);
}

void tdm__event_complete_batch(tdm__queue *q, tdm__event *const *evs, size_t n) {
  tdm__waiter *ws[TDM__BATCH_MAX];
  uint64_t last = 0; /* bit i: evs[i] lost its last reference */
  if (n > TDM__BATCH_MAX) n = TDM__BATCH_MAX; /* callers never pass more */
  pthread_mutex_lock(&q->mu);
  for (size_t i = 0; i < n; i++) {
    tdm__event *ev = evs[i];
    if (ev->timed) ev->t_ns = tdm__now_ns();
    atomic_store_explicit(&ev->done, 1, memory_order_release);
    ws[i] = ev->waiters;
    ev->waiters = NULL;
    if (atomic_fetch_sub(&ev->refs, 1) == 1) last |= (uint64_t)1 << i;
  }
  bool sleepers = q->cv_sleepers > 0;
  if (sleepers) tdm__signal_begin();
  pthread_mutex_unlock(&q->mu);
  /* Woken after the lock is let go, and only if someone sleeps: a waiter that shares this
   * CPU then runs without first blocking on the lock. q's struct is only freed at shutdown,
   * which waits for wake-ups in progress (tdm__signals_quiesce). */
  if (sleepers) {
    pthread_cond_broadcast(&q->cv);
    tdm__signal_end();
  }
  /* Continuations run outside the lock. Each belongs to a holder of a reference, so an event
   * outlives its loop; a node may be freed by its own fn, hence next is read first. */
  tdm__event *first = NULL, *tail = NULL;
  int nfree = 0;
  for (size_t i = 0; i < n; i++) {
    for (tdm__waiter *w = ws[i], *next; w; w = next) {
      next = w->next;
      w->fn(w, evs[i]);
    }
    if (!(last & ((uint64_t)1 << i))) continue;
    /* Freed together, after every continuation: each continuation's holder kept q alive. */
    tdm__event *ev = evs[i];
    event_scrub(q, ev);
    ev->next = first;
    first = ev;
    if (!tail) tail = ev;
    nfree++;
  }
  if (nfree) events_put(q, first, tail, nfree);
}

int tdm__event_on_complete(tdm__event *ev, tdm__waiter *w) {
  if (atomic_load_explicit(&ev->done, memory_order_acquire)) return 1;
  tdm__queue *q = ev->q;
  pthread_mutex_lock(&q->mu);
  int done = atomic_load_explicit(&ev->done, memory_order_relaxed);
  if (!done) {
    w->next = ev->waiters;
    ev->waiters = w;
  }
  pthread_mutex_unlock(&q->mu);
  if (!done) tdm__exec_kick(q);
  return done;
}

/* A waiter polls for TANDEM_SPIN_US (20 by default) before it sleeps: a completion that comes
 * within a few tens of microseconds (a short copy, a sync right after small work) then costs
 * no wake-up. It yields between polls, so a completing thread that shares its CPU runs rather
 * than waits. */

int tdm__event_wait_raw(tdm__event *ev) {
  if (!atomic_load_explicit(&ev->done, memory_order_acquire)) {
    tdm__queue *q = ev->q;
    tdm__exec_kick(q);
    uint64_t until = tdm__now_ns() + (uint64_t)tdm__g.opts.spin_us * 1000u;
    do {
      if (atomic_load_explicit(&ev->done, memory_order_acquire)) return ev->status;
      sched_yield();
    } while (tdm__now_ns() < until);
    pthread_mutex_lock(&q->mu);
    while (!atomic_load_explicit(&ev->done, memory_order_relaxed)) {
      q->cv_sleepers++;
      pthread_cond_wait(&q->cv, &q->mu);
      q->cv_sleepers--;
    }
    pthread_mutex_unlock(&q->mu);
  }
  return ev->status;
}

/* ---- failures in words: a failed host task's own message, kept for whoever learns of the
 * failure later, on another thread ---- */

char *tdm__why_dup(const char *s) {
  if (!s || !s[0]) return NULL;
  size_t n = strnlen(s, TDM__WHY_MAX - 1);
  /* Quiet: a lazily completed command (exec.c) may make this copy on a submitting thread. */
  char *p = tdm__malloc_quiet(n + 1);
  if (!p) return NULL; /* the plain message then, as if the failure had said nothing */
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

/* A chain of waits across queues, each relaying the failure the one before it waited for,
 * would bury the origin's words under a prefix per hop: a cause that is itself a wait's
 * account ("wait on Q (...) failed[, through K earlier waits]: ORIGIN") is summarized into a
 * count of the waits before, and its origin kept whole. */
#define WAIT_WORDS "wait on "
#define WAIT_THROUGH ", through "
void tdm__wait_words(char *buf, size_t n, const char *head, const char *cause) {
  unsigned long hops = 0;
  const char *origin = cause;
  if (strncmp(cause, WAIT_WORDS, sizeof WAIT_WORDS - 1) == 0) {
    const char *end = strstr(cause, ") failed");
    const char *rest = end ? end + strlen(") failed") : NULL;
    if (rest && strncmp(rest, WAIT_THROUGH, sizeof WAIT_THROUGH - 1) == 0) {
      hops = strtoul(rest + sizeof WAIT_THROUGH - 1, NULL, 10) + 1;
      rest = strstr(rest, ": ");
    } else if (rest && strncmp(rest, ": ", 2) == 0) {
      hops = 1;
    } else {
      rest = NULL;
    }
    if (rest && hops)
      origin = rest + 2;
    else
      hops = 0;
  }
  if (hops)
    snprintf(buf, n, "%s failed" WAIT_THROUGH "%lu earlier wait%s: %s", head, hops,
             hops == 1 ? "" : "s", origin);
  else
    snprintf(buf, n, "%s failed: %s", head, origin);
}

void tdm__event_describe(const tdm__event *ev, char *buf, size_t n) {
  char head[128];
  const char *op = ev->op ? ev->op : "command";
  snprintf(head, sizeof head, "%s on %s (command #%llu)", op, ev->q->label,
           (unsigned long long)ev->seq);
  if (ev->why && ev->why_relayed && strcmp(op, "wait") == 0)
    tdm__wait_words(buf, n, head, ev->why);
  else
    snprintf(buf, n, "%s failed%s%s", head, ev->why ? ": " : "", ev->why ? ev->why : "");
}

/* A relayed account is passed on as it is, so a chain of dependents names the failure that
 * started it rather than each link before it. */
char *tdm__event_cause_dup(const tdm__event *ev) {
  if (ev->why_relayed && ev->why) return tdm__why_dup(ev->why);
  char buf[TDM__WHY_MAX];
  tdm__event_describe(ev, buf, sizeof buf);
  return tdm__why_dup(buf);
}

/* ---- public ---- */

static int report(tdm__event *ev) {
  int st = ev->status;
  if (st < 0) {
    char buf[TDM__WHY_MAX];
    tdm__event_describe(ev, buf, sizeof buf);
    tdm__error(st, ev->native, "%s", buf);
  }
  return st;
}

int tdm_event_query(tdm_event *h) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  if (!atomic_load_explicit(&ev->done, memory_order_acquire)) {
    tdm__exec_kick(ev->q); /* a polling caller must see it complete */
    return TDM_EAGAIN;
  }
  return report(ev);
}

int tdm_event_wait(tdm_event *h) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  /* On an in-order queue every later command waits for the task; on an out-of-order one,
   * markers, full barriers (the tracker's too) and what comes after them do. */
  if (!atomic_load_explicit(&ev->done, memory_order_acquire) && tdm__tls_queue == ev->q &&
      ev->covers >= tdm__tls_seq)
    return tdm__error(TDM_EDEADLK, 0,
                      "a host task of %s (command #%llu) waits for command #%llu, which waits "
                      "for it", ev->q->label, (unsigned long long)tdm__tls_seq,
                      (unsigned long long)ev->seq);
  if (tdm__event_wait_host(ev) == TDM__WAIT_REFUSED) return TDM_EDEADLK; /* message set */
  return report(ev);
}

int tdm_event_elapsed(tdm_event *start_h, tdm_event *end_h, double *ms) {
  TDM__ENTER();
  tdm__event *start, *end;
  int rc;
  if ((rc = tdm__event_get(start_h, &start)) || (rc = tdm__event_get(end_h, &end))) return rc;
  if (!ms) return tdm__error(TDM_EINVAL, 0, "tdm_event_elapsed: ms is NULL");
  if (start->q->dev != end->q->dev)
    return tdm__error(TDM_EXDEV, 0, "events come from %s and %s", start->q->label,
                      end->q->label);
  if (!start->timed || !end->timed)
    return tdm__error(TDM_ENOTSUP, 0, "an event was not recorded on a TDM_QUEUE_TIMING queue");
  if (!atomic_load_explicit(&start->done, memory_order_acquire) ||
      !atomic_load_explicit(&end->done, memory_order_acquire))
    return tdm__error(TDM_EAGAIN, 0, "an event is still pending");
  return tdm__b_event_elapsed(start, end, ms);
}

/* The callers' count only moves between positive values: once it reaches 0 the handle is
 * dead, even while tandem's own references keep the struct alive. */
int tdm_event_retain(tdm_event *h) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  int u = atomic_load(&ev->urefs);
  do {
    if (u <= 0) return tdm__error(TDM_EHANDLE, 0, "%p was released", (void *)h);
  } while (!atomic_compare_exchange_weak(&ev->urefs, &u, u + 1));
  return 0;
}

int tdm_event_release(tdm_event *h) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  int u = atomic_load(&ev->urefs);
  do {
    if (u <= 0) return tdm__error(TDM_EHANDLE, 0, "%p was released", (void *)h);
  } while (!atomic_compare_exchange_weak(&ev->urefs, &u, u - 1));
  if (u == 1) tdm__event_unref(ev);
  return 0;
}

int tdm_event_queue(tdm_event *h, tdm_queue **q) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  if (!q) return tdm__error(TDM_EINVAL, 0, "tdm_event_queue: q is NULL");
  if (ev->q->imports)
    return tdm__error(TDM_ENOTSUP, 0, "an imported event belongs to no queue");
  *q = tdm__queue_handle(ev->q);
  return 0;
}

int tdm_event_native(tdm_event *h, void **native) {
  TDM__ENTER();
  tdm__event *ev;
  int rc = tdm__event_get(h, &ev);
  if (rc) return rc;
  if (!native) return tdm__error(TDM_EINVAL, 0, "tdm_event_native: native is NULL");
  void *bev = atomic_load_explicit(&ev->bev, memory_order_acquire);
  if (!bev) return tdm__error(TDM_ENOTSUP, 0, "this event has no native event (yet)");
  *native = tdm__b_native_export(ev->q->dev, bev);
  return 0;
}
