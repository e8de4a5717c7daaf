/* defaults.c: per-device default queues (cached, created on first use with the flags of
 * $TANDEM_DEFAULT_QUEUE, or installed by the program) and each thread's current-queue stack. */
#include "internal.h"

#define STACK_MAX 64

static _Thread_local tdm_queue *tls_stack[STACK_MAX];
static _Thread_local int tls_depth;

int tdm_default_queue(tdm_device *dev, tdm_queue **out) {
  TDM__ENTER();
  int rc;
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_default_queue: out is NULL");
  if (!dev && (rc = tdm_device_find(NULL, &dev))) return rc;
  if ((rc = tdm__device_check(dev))) return rc;
  pthread_mutex_lock(&tdm__g.mu);
  tdm_queue *q = dev->default_installed ? dev->default_installed : dev->default_cached;
  pthread_mutex_unlock(&tdm__g.mu);
  if (q) {
    *out = q;
    return 0;
  }
  /* Created outside ctx.mu (queue creation takes it); a racing thread's queue is dropped. */
  unsigned flags = tdm__g.opts.default_flags;
  if (!(dev->info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER)) flags &= ~(unsigned)TDM_QUEUE_OUT_OF_ORDER;
  tdm_queue *made;
  if ((rc = tdm__queue_create_internal(dev, flags, NULL, true, &made))) return rc;
  pthread_mutex_lock(&tdm__g.mu);
  tdm_queue *lost = NULL;
  if (dev->default_cached)
    lost = made;
  else
    dev->default_cached = made;
  q = dev->default_installed ? dev->default_installed : dev->default_cached;
  pthread_mutex_unlock(&tdm__g.mu);
  if (lost) tdm__queue_destroy_internal(lost);
  *out = q;
  return 0;
}

int tdm_default_queue_set(tdm_device *dev, tdm_queue *q) {
  TDM__ENTER();
  int rc;
  if (!dev && (rc = tdm_device_find(NULL, &dev))) return rc;
  if ((rc = tdm__device_check(dev))) return rc;
  if (q && (rc = tdm__queue_check(q))) return rc;
  if (q && q->dev != dev)
    return tdm__error(TDM_EXDEV, 0, "%s is not a queue of %s", q->label, dev->info.id);
  pthread_mutex_lock(&tdm__g.mu);
  dev->default_installed = q;
  pthread_mutex_unlock(&tdm__g.mu);
  return 0;
}

void tdm__defaults_forget(tdm_queue *q) {
  pthread_mutex_lock(&tdm__g.mu);
  if (q->dev->default_installed == q) q->dev->default_installed = NULL;
  if (q->dev->default_cached == q) q->dev->default_cached = NULL;
  pthread_mutex_unlock(&tdm__g.mu);
}

void tdm__defaults_destroy_all(void) {
  for (int i = 0; i < tdm__g.ndevices; i++) {
    tdm_device *d = &tdm__g.devices[i];
    d->default_installed = NULL;
    if (d->default_cached) tdm__queue_destroy_internal(d->default_cached);
  }
}

int tdm_current_queue(tdm_queue **out) {
  TDM__ENTER();
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_current_queue: out is NULL");
  if (tls_depth > 0) {
    tdm_queue *q = tls_stack[tls_depth - 1];
    if (atomic_load(&q->magic) != TDM__MAGIC_QUEUE)
      return tdm__error(TDM_EHANDLE, 0, "this thread's current queue was destroyed; pop it");
    *out = q;
    return 0;
  }
  return tdm_default_queue(NULL, out);
}

int tdm_current_queue_push(tdm_queue *q) {
  TDM__ENTER();
  int rc = tdm__queue_check(q);
  if (rc) return rc;
  if (tls_depth == STACK_MAX)
    return tdm__error(TDM_ESTATE, 0, "current-queue stack is full (%d)", STACK_MAX);
  tls_stack[tls_depth++] = q;
  return 0;
}

int tdm_current_queue_pop(void) {
  TDM__ENTER();
  if (tls_depth == 0) return tdm__error(TDM_ESTATE, 0, "current-queue stack is empty");
  tls_depth--;
  return 0;
}
