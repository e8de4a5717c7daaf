/* defaults.c: per-device default queues (cached, created on first use with the flags of
 * $TANDEM_DEFAULT_QUEUE, or installed by the program) and each thread's current-queue stack. */
#include "internal.h"

#define STACK_MAX 64

/* Handles, so a queue destroyed while on the stack is seen as such. The stack belongs to one
 * init: a thread's first use after the context was shut down and made again empties it. */
static _Thread_local tdm_queue *tls_stack[STACK_MAX];
static _Thread_local int tls_depth;
static _Thread_local unsigned tls_epoch;

static void stack_sync(void) {
  unsigned e = atomic_load_explicit(&tdm__g.epoch, memory_order_relaxed);
  if (tls_epoch != e) {
    tls_epoch = e;
    tls_depth = 0;
  }
}

int tdm_default_queue(tdm_device *dev, tdm_queue **out) {
  TDM__ENTER();
  int rc;
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_default_queue: out is NULL");
  if (!dev && (rc = tdm_device_find(NULL, &dev))) return rc;
  if ((rc = tdm__device_check(dev))) return rc;
  pthread_mutex_lock(&tdm__g.mu);
  tdm__queue *q = dev->default_installed ? dev->default_installed : dev->default_cached;
  pthread_mutex_unlock(&tdm__g.mu);
  if (q) {
    *out = tdm__queue_handle(q);
    return 0;
  }
  /* Created outside ctx.mu (queue creation takes it); a racing thread's queue is dropped. */
  unsigned flags = tdm__g.opts.default_flags;
  if (!(dev->info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER)) flags &= ~(unsigned)TDM_QUEUE_OUT_OF_ORDER;
  tdm__queue *made;
  if ((rc = tdm__queue_create_internal(dev, flags, NULL, true, &made))) return rc;
  pthread_mutex_lock(&tdm__g.mu);
  tdm__queue *lost = NULL;
  if (dev->default_cached)
    lost = made;
  else
    dev->default_cached = made;
  q = dev->default_installed ? dev->default_installed : dev->default_cached;
  pthread_mutex_unlock(&tdm__g.mu);
  if (lost) tdm__queue_destroy_internal(lost);
  *out = tdm__queue_handle(q);
  return 0;
}

int tdm_default_queue_set(tdm_device *dev, tdm_queue *h) {
  TDM__ENTER();
  int rc;
  if (!dev && (rc = tdm_device_find(NULL, &dev))) return rc;
  if ((rc = tdm__device_check(dev))) return rc;
  tdm__queue *q = NULL;
  if (h && (rc = tdm__queue_get(h, &q))) return rc;
  if (q && q->dev != dev)
    return tdm__error(TDM_EXDEV, 0, "%s is not a queue of %s", q->label, dev->info.id);
  pthread_mutex_lock(&tdm__g.mu);
  dev->default_installed = q;
  pthread_mutex_unlock(&tdm__g.mu);
  return 0;
}

void tdm__defaults_forget(tdm__queue *q) {
  pthread_mutex_lock(&tdm__g.mu);
  if (q->dev->default_installed == q) q->dev->default_installed = NULL;
  if (q->dev->default_cached == q) q->dev->default_cached = NULL;
  pthread_mutex_unlock(&tdm__g.mu);
}

/* The last shutdown: the cached default queues are taken out of the table under the lock
 * (calls that began before the shutdown may still be reading it), then destroyed. */
void tdm__defaults_destroy_all(void) {
  for (int i = 0; i < tdm__g.ndevices; i++) {
    tdm_device *d = &tdm__g.devices[i];
    pthread_mutex_lock(&tdm__g.mu);
    tdm__queue *q = d->default_cached;
    d->default_installed = NULL;
    d->default_cached = NULL;
    if (q && atomic_exchange(&q->claimed, true)) q = NULL; /* another destroy has it */
    pthread_mutex_unlock(&tdm__g.mu);
    if (q) tdm__queue_destroy_final(q);
  }
}

int tdm_current_queue(tdm_queue **out) {
  TDM__ENTER();
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_current_queue: out is NULL");
  stack_sync();
  if (tls_depth > 0) {
    tdm_queue *h = tls_stack[tls_depth - 1];
    if (!tdm__queue_lookup(h))
      return tdm__error(TDM_EHANDLE, 0, "this thread's current queue was destroyed; pop it");
    *out = h;
    return 0;
  }
  return tdm_default_queue(NULL, out);
}

int tdm_current_queue_push(tdm_queue *h) {
  TDM__ENTER();
  tdm__queue *q;
  int rc = tdm__queue_get(h, &q);
  if (rc) return rc;
  stack_sync();
  if (tls_depth == STACK_MAX)
    return tdm__error(TDM_ESTATE, 0, "current-queue stack is full (%d)", STACK_MAX);
  tls_stack[tls_depth++] = h;
  return 0;
}

int tdm_current_queue_pop(void) {
  TDM__ENTER();
  stack_sync();
  if (tls_depth == 0) return tdm__error(TDM_ESTATE, 0, "current-queue stack is empty");
  tls_depth--;
  return 0;
}
