/* sysubmit.c: turns tandem commands into SYCL commands. Every command gets a SYCL event
 * (attached to its tandem event, so other queues of the same context wait for it natively),
 * and is handed to the queue's executor, which waits for it. Dependencies of another context
 * or backend wait on a gate that a continuation opens when their tandem event completes.
 * Host tasks never run in the runtime: on an in-order queue the commands after one wait on a
 * gate that the executor opens once the task has run. */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "sy.h"

/* ---- dependencies ---- */

/* A dependency from another context or backend: a gate opened when its event completes. */
typedef struct bridge {
  tdm__waiter w; /* first */
  sy_ev *gate;
} bridge;

static void bridge_fire(tdm__waiter *w, tdm__event *ev) {
  (void)ev; /* a failure is reported by tandem (TDM_EDEP), not by the runtime */
  bridge *b = (bridge *)w;
  sy_gate_open(b->gate);
  sy_ev_release(b->gate);
  free(b);
}

/* The SYCL events of cmd's dependencies, in v (which holds cmd->ndeps); the first *nbridges
 * are gates with a reference of the list's. */
typedef struct deplist {
  sy_ev **v;
  size_t n, nbridges;
  sy_ev *inl[8];
} deplist;

static void deplist_put(deplist *d) {
  for (size_t i = 0; i < d->nbridges; i++) sy_ev_release(d->v[i]);
  if (d->v != d->inl) free(d->v);
}

static int deplist_get(tdm__bqueue *bq, const tdm__cmd *cmd, deplist *d) {
  d->n = d->nbridges = 0;
  d->v = cmd->ndeps <= 8 ? d->inl : malloc(cmd->ndeps * sizeof *d->v);
  if (!d->v) return sy_svc->error(TDM_ENOMEM, 0, "no memory for a dependency list");
  for (size_t i = 0; i < cmd->ndeps; i++) {
    tdm__event *dep = cmd->deps[i].ev;
    sy_ev *native = sy_svc->event_native(dep, &tdm__sycl_backend);
    if (native && sy_ev_usable(native, bq->q)) {
      d->v[d->n++] = native; /* the command holds dep, and dep this reference */
      continue;
    }
    bridge *b = malloc(sizeof *b);
    int rc = b ? sy_gate_new(bq->q, &b->gate)
               : sy_svc->error(TDM_ENOMEM, 0, "no memory for a cross-context dependency");
    if (rc) {
      free(b);
      deplist_put(d);
      return rc;
    }
    /* Gates go first, so the list's references are released without looking at cmd again. */
    if (d->n > d->nbridges) d->v[d->n] = d->v[d->nbridges];
    sy_ev_retain(b->gate); /* the list's; the bridge keeps its own until it fires */
    d->v[d->nbridges++] = b->gate;
    d->n++;
    b->w.fn = bridge_fire;
    if (sy_svc->event_on_complete(dep, &b->w)) bridge_fire(&b->w, dep);
  }
  return 0;
}

/* ---- commands ---- */

/* Gives the command to tandem (as the OpenCL backend does): done is attached to the tandem
 * event and, when it is also what is waited for, lent to the wait. */
static void hand_over(tdm__cmd *cmd, sy_ev *done, sy_ev *wait, sy_ev *gate) {
  if (done) sy_svc->event_set_native(cmd->ev, done);
  if (wait && wait == done) cmd->flags |= TDM__CMD_WAIT_BORROWED;
  cmd->wait = wait;
  cmd->gate = gate;
  sy_svc->cmd_native(cmd);
}

/* Work the executor does on the host: host tasks, and copies and fills with host memory on
 * both sides (the core does them, so that a failure before them stops them as it stops a
 * task), and frees (ungated: later work need not wait for them). In-order: a barrier before
 * it (what the executor waits for), and a barrier on a gate that later commands wait behind.
 * Out-of-order: the core waits for its dependencies itself, and later work waits for the
 * gate, which is also its native event. */
static int host_work(tdm__bqueue *bq, tdm__cmd *cmd, deplist *d, bool gated) {
  sy_ev *pre = NULL, *gate = NULL, *done = NULL;
  if (gated && cmd->kind != TDM__CMD_HOST) cmd->flags |= TDM__CMD_ON_HOST;
  if (bq->ooo) {
    int rc = gated ? sy_gate_new(bq->q, &gate) : 0;
    if (rc) return rc;
    if (gate) sy_ev_retain(gate); /* one reference for the tandem event, one for gate_open */
    hand_over(cmd, gate, NULL, gate);
    return 0;
  }
  int rc = sy_barrier(bq->q, true, d->v, d->n, &pre);
  if (rc) return rc;
  if (!gated) {
    hand_over(cmd, pre, pre, NULL);
    return 0;
  }
  if ((rc = sy_gate_new(bq->q, &gate)) || (rc = sy_barrier(bq->q, false, &gate, 1, &done))) {
    if (gate) {
      sy_gate_open(gate);
      sy_ev_release(gate);
    }
    sy_ev_release(pre);
    return rc;
  }
  hand_over(cmd, done, pre, gate);
  return 0;
}

/* Whether one side of a copy or fill is device memory of this backend (USM device). */
static inline bool on_device(const tdm__memref *m) {
  return m->kind == TDM_MEM_DEVICE && m->bdev >= 0;
}

static int enqueue(tdm__bqueue *bq, tdm__cmd *cmd, deplist *d) {
  sy_ev *ev = NULL;
  int rc = 0;
  switch (cmd->kind) {
    case TDM__CMD_COPY:
      if (cmd->u.copy.n == 0 || (!on_device(&cmd->u.copy.d) && !on_device(&cmd->u.copy.s)))
        return host_work(bq, cmd, d, cmd->u.copy.n != 0);
      rc = sy_copy(bq->q, cmd->u.copy.dst, cmd->u.copy.src, cmd->u.copy.n, d->v, d->n, &ev);
      break;
    case TDM__CMD_FILL:
      if (cmd->u.fill.n == 0 || !on_device(&cmd->u.fill.d))
        return host_work(bq, cmd, d, cmd->u.fill.n != 0);
      rc = sy_fill(bq->q, cmd->u.fill.dst, cmd->u.fill.value, cmd->u.fill.n, d->v, d->n, &ev);
      break;
    case TDM__CMD_HOST: return host_work(bq, cmd, d, true);
    case TDM__CMD_FREE: return host_work(bq, cmd, d, false);
    case TDM__CMD_MARKER:
    case TDM__CMD_BARRIER:
      rc = sy_barrier(bq->q,
                      cmd->kind == TDM__CMD_MARKER || (cmd->flags & TDM__CMD_ALL_PRIOR) != 0,
                      d->v, d->n, &ev);
      break;
  }
  if (rc) return rc;
  hand_over(cmd, ev, ev, NULL);
  return 0;
}

int sy_submit(tdm__bqueue *bq, tdm__cmd *cmd) {
  deplist d;
  int rc = deplist_get(bq, cmd, &d);
  if (rc) return rc;
  rc = enqueue(bq, cmd, &d);
  deplist_put(&d);
  return rc;
}

/* tdm_queue_wait without a command, on an in-order queue: a barrier on ev's SYCL event, now. */
int sy_queue_wait_now(tdm__bqueue *bq, tdm__event *ev) {
  if (bq->ooo) return 1;
  sy_ev *native = sy_svc->event_native(ev, &tdm__sycl_backend);
  if (!native || !sy_ev_usable(native, bq->q)) return 1;
  return sy_barrier(bq->q, false, &native, 1, NULL);
}

/* ---- completion notices ----
 * The watcher looks at its list, gives notice for the events that completed, and sleeps a
 * little longer each time nothing did (from 20 us to 1 ms), or until a new one comes. */
typedef struct notice {
  struct notice *next;
  sy_ev *ev; /* a reference of the notice's */
  void (*fn)(void *);
  void *arg;
} notice;

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  notice *list;
  bool stop, started;
  pthread_t thread;
} watch = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void *watch_main(void *arg) {
  (void)arg;
  long nap_us = 20;
  pthread_mutex_lock(&watch.mu);
  for (;;) {
    while (!watch.list && !watch.stop) pthread_cond_wait(&watch.cv, &watch.mu);
    if (!watch.list && watch.stop) break;
    notice *mine = watch.list;
    watch.list = NULL;
    pthread_mutex_unlock(&watch.mu);
    notice *keep = NULL, *done = NULL;
    for (notice *n = mine, *next; n; n = next) {
      next = n->next;
      if (sy_ev_complete(n->ev)) {
        n->next = done;
        done = n;
      } else {
        n->next = keep;
        keep = n;
      }
    }
    for (notice *n = done, *next; n; n = next) {
      next = n->next;
      n->fn(n->arg);
      sy_ev_release(n->ev);
      free(n);
    }
    nap_us = done ? 20 : (nap_us * 2 > 1000 ? 1000 : nap_us * 2);
    pthread_mutex_lock(&watch.mu);
    while (keep) {
      notice *n = keep;
      keep = n->next;
      n->next = watch.list;
      watch.list = n;
    }
    if (watch.list && !done) {
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += nap_us * 1000;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
      }
      pthread_cond_timedwait(&watch.cv, &watch.mu, &until);
    }
  }
  pthread_mutex_unlock(&watch.mu);
  return NULL;
}

int sy_notices_start(void) {
  pthread_mutex_lock(&watch.mu);
  watch.stop = false;
  watch.list = NULL;
  int e = pthread_create(&watch.thread, NULL, watch_main, NULL);
  watch.started = e == 0;
  pthread_mutex_unlock(&watch.mu);
  return e ? sy_svc->error(TDM_ENOMEM, 0, "cannot start the SYCL backend's watcher thread") : 0;
}

/* At the last shutdown every event tandem waits for has completed, so the list drains. */
void sy_notices_stop(void) {
  pthread_mutex_lock(&watch.mu);
  bool started = watch.started;
  watch.stop = true;
  watch.started = false;
  pthread_cond_signal(&watch.cv);
  pthread_mutex_unlock(&watch.mu);
  if (started) pthread_join(watch.thread, NULL);
}

int sy_native_notify(void *handle, void (*fn)(void *), void *arg) {
  notice *n = malloc(sizeof *n);
  if (!n) return 1; /* declined: a pool thread waits for it instead */
  sy_ev_retain(handle);
  n->ev = handle;
  n->fn = fn;
  n->arg = arg;
  pthread_mutex_lock(&watch.mu);
  n->next = watch.list;
  watch.list = n;
  pthread_cond_signal(&watch.cv);
  pthread_mutex_unlock(&watch.mu);
  return 0;
}
