/* queue.c: queue objects. A queue struct is never returned to malloc while the context lives
 * (destroyed ones are recycled once no event refers to them); callers hold handles
 * (handle.c), so a destroyed queue's handle stays invalid when its struct is reused. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

int tdm__queue_get(tdm_queue *h, tdm__queue **out) {
  if (!h) return tdm__error(TDM_EINVAL, 0, "queue is NULL");
  tdm__queue *q = tdm__queue_lookup(h);
  if (!q)
    return tdm__error(TDM_EHANDLE, 0, "%p is not a live queue (destroyed, from before a "
                      "shutdown, or not a queue)", (void *)h);
  if (atomic_load(&q->destroying))
    return tdm__error(TDM_EHANDLE, 0, "%s is being destroyed", q->label);
  if (atomic_load(&q->dev->lost))
    return tdm__error(TDM_EDEVLOST, 0, "%s: device %s was lost", q->label, q->dev->info.id);
  *out = q;
  return 0;
}

void tdm__queue_unref(tdm__queue *q) { tdm__queue_unref_n(q, 1); }

void tdm__queue_unref_n(tdm__queue *q, int n) {
  if (atomic_fetch_sub(&q->refs, n) != n) return;
  pthread_mutex_lock(&tdm__g.mu);
  q->next_free = tdm__g.free_queues;
  tdm__g.free_queues = q;
  pthread_mutex_unlock(&tdm__g.mu);
}

static tdm__queue *queue_struct(void) {
  pthread_mutex_lock(&tdm__g.mu);
  tdm__queue *q = tdm__g.free_queues;
  if (q) {
    tdm__g.free_queues = q->next_free;
  } else if ((q = tdm__calloc(1, sizeof *q)) && tdm__exec_init(q)) {
    free(q);
    q = NULL;
  } else if (q && tdm__slot_new(q, &q->slot, &q->gen)) {
    tdm__exec_fini(q);
    free(q);
    q = NULL;
  } else if (q) {
    pthread_mutex_init(&q->submit_mu, NULL);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->next_all = tdm__g.queues;
    tdm__g.queues = q;
  }
  if (q) q->id = tdm__g.next_queue_id++;
  pthread_mutex_unlock(&tdm__g.mu);
  return q;
}

int tdm__queue_create_internal(tdm_device *dev, unsigned flags, void *adopt, bool owned,
                               tdm__queue **out) {
  if (flags & ~(unsigned)(TDM_QUEUE_OUT_OF_ORDER | TDM_QUEUE_TIMING))
    return tdm__error(TDM_EINVAL, 0, "unknown queue flags 0x%x", flags);
  if ((flags & TDM_QUEUE_OUT_OF_ORDER) && !(dev->info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER))
    return tdm__error(TDM_ENOTSUP, 0, "%s has no out-of-order queues", dev->info.id);
  if ((flags & TDM_QUEUE_TIMING) && !(dev->info.caps & TDM_DEVICE_CAP_TIMING))
    return tdm__error(TDM_ENOTSUP, 0, "%s has no timing", dev->info.id);
  tdm__queue *q = queue_struct();
  if (!q) return tdm__error(TDM_ENOMEM, 0, "no memory for a queue");
  q->dev = dev;
  q->flags = flags;
  q->ref_stock = 0;
  q->owned_by_tandem = owned;
  q->adopted = adopt != NULL;
  q->imports = false;
  atomic_store(&q->destroying, false);
  atomic_store(&q->claimed, false);
  atomic_store(&q->first_error, 0);
  q->chain_error = 0;
  q->seq = 0;
  q->can_lazy = false; /* tdm__exec_start sets it for native queues */
  atomic_store(&q->lz_reap, 0);
  snprintf(q->label, sizeof q->label, "%s/q%d", dev->info.id, q->id);
  int rc = (flags & TDM_QUEUE_OUT_OF_ORDER) ? tdm__threadpool_start() : 0;
  if (!rc) rc = tdm__tracker_init(q);
  if (!rc && tdm__b_is_native(dev) && (rc = tdm__exec_start(q))) tdm__tracker_fini(q);
  if (!rc) {
    rc = tdm__b_queue_create(q, adopt);
    if (rc) {
      tdm__error(rc, tdm_last_native_error(), "creating a queue on %s: %s", dev->info.id,
                 tdm__last_detail());
      tdm__tracker_fini(q);
      tdm__exec_stop(q);
    }
  }
  if (rc) {
    atomic_store(&q->refs, 1);
    tdm__queue_unref(q);
    return rc;
  }
  atomic_store(&q->refs, 1);
  atomic_fetch_add(&tdm__g.n_queues, 1);
  atomic_store(&q->magic, TDM__MAGIC_QUEUE);
  q->handle_was = tdm__handle_make(q->slot, &q->gen, TDM__KIND_QUEUE);
  atomic_store(&q->handle, q->handle_was);
  *out = q;
  return 0;
}

/* The end of a queue's life, once it has drained: its tracker goes, the references taken
 * ahead for events that will never be are given back, and the handle's reference is dropped
 * (events still alive keep the struct). */
static void queue_retire(tdm__queue *q) {
  pthread_mutex_lock(&q->submit_mu);
  atomic_store(&q->destroying, true);
  tdm__tracker_fini(q);
  int stock = q->ref_stock;
  q->ref_stock = 0;
  pthread_mutex_unlock(&q->submit_mu);
  /* An error nobody synced keeps its words until here; every command has completed. */
  pthread_mutex_lock(&q->mu);
  free(q->first_error_why);
  q->first_error_why = NULL;
  pthread_mutex_unlock(&q->mu);
  if (stock) atomic_fetch_sub(&q->refs, stock);
  atomic_store(&q->magic, TDM__MAGIC_DEAD);
  tdm__queue_unref(q);
}

/* Waits until every command submitted to q has completed (each completion broadcasts q->cv
 * to its sleepers after counting itself done: tdm__cmd_done). */
static void wait_all_done(tdm__queue *q) {
  tdm__exec_kick(q); /* lazily completed commands: nobody else may ask for them */
  pthread_mutex_lock(&q->mu);
  while (atomic_load(&q->n_done) != atomic_load(&q->n_submitted)) {
    q->cv_sleepers++;
    pthread_cond_wait(&q->cv, &q->mu);
    q->cv_sleepers--;
  }
  pthread_mutex_unlock(&q->mu);
}

/* The rest of a destroy, once q is marked destroying (no submission can come) and drained. */
static void queue_teardown(tdm__queue *q) {
  tdm__defaults_forget(q);
  tdm__exec_stop(q);
  tdm__b_queue_destroy(q);
  atomic_store(&q->handle, 0);
  atomic_fetch_sub(&tdm__g.n_queues, 1);
  queue_retire(q);
}

static void mark_destroying(tdm__queue *q) {
  pthread_mutex_lock(&q->submit_mu);
  atomic_store(&q->destroying, true);
  pthread_mutex_unlock(&q->submit_mu);
}

/* The caller has claimed q (q->claimed), so no other destroy runs on it. final: the last
 * shutdown's, which must not leave q alive: when the drain marker cannot be submitted (no
 * memory, a backend refusing it), q is drained by counting its commands done instead (only
 * what tandem submitted is covered then, which is all a shutdown can do). */
static int destroy(tdm__queue *q, bool final) {
  if (tdm__tls_queue == q) {
    atomic_store(&q->claimed, false);
    return tdm__error(TDM_EDEADLK, 0, "a host task of %s destroys its own queue", q->label);
  }
  /* Drain: a marker covers everything submitted, by tandem or through the native handle. */
  tdm__spec s = {.kind = TDM__CMD_MARKER, .op = "drain", .all_prior = true};
  tdm__event *ev;
  int rc = tdm__submit(q, &s, 0, NULL, &ev, NULL);
  if (rc && !atomic_load(&q->dev->lost) && !final) {
    atomic_store(&q->claimed, false);
    return rc; /* nothing destroyed; retry later */
  }
  mark_destroying(q);
  int status = 0;
  char why[TDM__WHY_MAX] = "";
  if (!rc) {
    status = tdm__event_wait_blocking(ev);
    if (status < 0 && ev->why) snprintf(why, sizeof why, ": %s", ev->why);
    tdm__event_unref(ev);
  } else if (final && !atomic_load(&q->dev->lost)) {
    wait_all_done(q);
  }
  queue_teardown(q);
  if (status < 0) tdm__error(status, 0, "%s had an unreported error%s", q->label, why);
  return status;
}

int tdm__queue_destroy_internal(tdm__queue *q) { return destroy(q, false); }
void tdm__queue_destroy_final(tdm__queue *q) { (void)destroy(q, true); }

int tdm__queue_create_imports(tdm_device *dev, tdm__queue **out) {
  tdm__queue *q = queue_struct();
  if (!q) return tdm__error(TDM_ENOMEM, 0, "no memory for a queue");
  q->dev = dev;
  q->flags = TDM_QUEUE_OUT_OF_ORDER; /* each import completes when its own native event does */
  q->ref_stock = 0;
  q->owned_by_tandem = true;
  q->adopted = false;
  q->imports = true;
  q->bq = NULL;
  atomic_store(&q->destroying, false);
  atomic_store(&q->claimed, true); /* never destroyed through the API */
  atomic_store(&q->first_error, 0);
  q->chain_error = 0;
  q->seq = 0;
  snprintf(q->label, sizeof q->label, "%s/import", dev->info.id);
  int rc = tdm__threadpool_start();
  if (!rc) rc = tdm__tracker_init(q);
  atomic_store(&q->refs, 1);
  if (rc) {
    tdm__queue_unref(q);
    return rc;
  }
  atomic_store(&q->magic, TDM__MAGIC_QUEUE);
  q->handle_was = 0; /* no handle: callers never name this queue */
  atomic_store(&q->handle, 0);
  *out = q;
  return 0;
}

void tdm__queue_destroy_imports(tdm__queue *q) {
  /* Each import completes on a thread-pool thread once its driver says so. */
  wait_all_done(q);
  queue_retire(q);
}

/* Frees every queue struct and its free lists; the last shutdown calls this after destroying
 * every live queue. */
void tdm__queues_free_all(void) {
  tdm__signals_quiesce(); /* no wake-up of a queue's waiters is still in progress */
  tdm__queue *q = tdm__g.queues;
  while (q) {
    tdm__queue *n = q->next_all;
    /* Events still held by the caller are freed too: they became invalid at shutdown. */
    for (tdm__event *ev = q->all_events, *nx; ev; ev = nx) {
      nx = ev->next_all;
      tdm__slot_free(ev->slot, ev->gen);
      free(ev->why);
      free(ev);
    }
    q->events.local = NULL;
    atomic_store(&q->events.returned, NULL);
    tdm__freelist_drain(&q->cmds, tdm__cmd_mem_free);
    tdm__freelist_drain(&q->keeps, free);
    free(q->first_error_why); /* NULL once retired; a queue never retired keeps its own */
    pthread_mutex_destroy(&q->submit_mu);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    tdm__exec_fini(q);
    tdm__slot_free(q->slot, q->gen);
    free(q);
    q = n;
  }
  tdm__g.queues = tdm__g.free_queues = NULL;
}

/* Events callers still hold at the last shutdown: their native events go back to the driver
 * while its module is still loaded. */
void tdm__queues_release_native(void) {
  for (tdm__queue *q = tdm__g.queues; q; q = q->next_all)
    for (tdm__event *ev = q->all_events; ev; ev = ev->next_all) {
      void *bev = atomic_exchange(&ev->bev, NULL);
      if (bev) tdm__b_native_release(q->dev, bev);
    }
}

/* ---- public ---- */

int tdm_queue_create(tdm_device *dev, unsigned flags, tdm_queue **out) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_queue_create: out is NULL");
  tdm__queue *q;
  if ((rc = tdm__queue_create_internal(dev, flags, NULL, false, &q))) return rc;
  *out = tdm__queue_handle(q);
  return 0;
}

int tdm_queue_adopt(tdm_device *dev, void *native, unsigned flags, tdm_queue **out) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!native || !out) return tdm__error(TDM_EINVAL, 0, "tdm_queue_adopt: NULL argument");
  if (!(dev->info.caps & TDM_DEVICE_CAP_ADOPT))
    return tdm__error(TDM_ENOTSUP, 0, "%s cannot adopt native queues", dev->info.id);
  tdm__queue *q;
  if ((rc = tdm__queue_create_internal(dev, flags, native, false, &q))) return rc;
  *out = tdm__queue_handle(q);
  return 0;
}

int tdm_queue_destroy(tdm_queue *h) {
  TDM__ENTER();
  if (!h) return tdm__error(TDM_EINVAL, 0, "queue is NULL");
  tdm__queue *q = tdm__queue_lookup(h);
  if (q && q->owned_by_tandem)
    return tdm__error(TDM_EBUSY, 0, "%s is a default queue owned by tandem", q->label);
  if (!q || atomic_exchange(&q->claimed, true))
    return tdm__error(TDM_EHANDLE, 0, "%p is not a live queue (destroyed, being destroyed, "
                      "or not a queue)", (void *)h);
  return tdm__queue_destroy_internal(q);
}

int tdm_queue_native(tdm_queue *h, void **native) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  if (!native) return tdm__error(TDM_EINVAL, 0, "tdm_queue_native: native is NULL");
  void *n = NULL;
  if ((rc = tdm__b_queue_native(q, &n))) return rc;
  *native = n;
  return 0;
}

int tdm_queue_device(tdm_queue *h, tdm_device **dev) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  if (!dev) return tdm__error(TDM_EINVAL, 0, "tdm_queue_device: dev is NULL");
  *dev = q->dev;
  return 0;
}

int tdm_queue_flags(tdm_queue *h, unsigned *flags) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  if (!flags) return tdm__error(TDM_EINVAL, 0, "tdm_queue_flags: flags is NULL");
  *flags = q->flags;
  return 0;
}
