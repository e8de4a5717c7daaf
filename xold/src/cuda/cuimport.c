/* cuimport.c: CUDA events that other code recorded, imported as tandem events
 * (tdm_event_import).
 *
 * tandem does not keep the caller's cudaEvent_t. A stream of its own waits for it
 * (cudaStreamWaitEvent, which takes the work recorded into the event at that moment) and then
 * records a recycled event of tandem's, which stands for the import from then on. So the
 * caller may destroy or re-record its event as soon as the call returns, which Python callers
 * cannot help doing (a CuPy or PyTorch event is destroyed with its last Python reference, and
 * loops re-record one event every step), and the import means the same work whatever other
 * code does with the event afterwards. Keeping the caller's event instead would make both the
 * caller's duty and the import's meaning depend on when tandem happened to look at it.
 *
 * Each pending import has a stream to itself: a stream is taken again only once the last
 * event recorded on it has completed, and a new one is made when none is free. So an import
 * never completes late because an earlier one is still pending, whatever the caller's events
 * wait for (a host-side condition included).
 *
 * Completion reaches the core through a host function enqueued behind the record, which does
 * nothing but hand the notification over (the core pushes the command onto its ready list and
 * wakes a pool thread). Where stream memory operations are missing, tandem's gates are host
 * functions that block, and CUDA may run host functions one at a time, so a notification
 * could wait behind a gate that waits for it: there native_notify declines and a pool thread
 * waits for the event instead.
 */
#include <stdlib.h>

#include "cu.h"

typedef struct cu_import_stream {
  cudaStream_t s;
  cu_event *last; /* the last event recorded on it (a reference), or NULL */
} cu_import_stream;

/* note_state: no host function reports this import (native_notify declines); one will; it
 * has run; native_notify has set note_fn. */
enum { NOTE_OFF, NOTE_WAIT, NOTE_FIRED, NOTE_SET };

/* A host function: no CUDA call, nothing that blocks. */
static void CUDART_CB import_fired(void *arg) {
  cu_event *ev = arg;
  if (atomic_exchange(&ev->note_state, NOTE_FIRED) == NOTE_SET) ev->note_fn(ev->note_arg);
  cu_event_put(ev); /* an untimed event: back onto the free list's lock-free stack */
}

int cu_import_notify(cu_event *ev, void (*fn)(void *), void *arg) {
  if (atomic_load(&ev->note_state) == NOTE_OFF) return TDM_ENOTSUP;
  ev->note_fn = fn;
  ev->note_arg = arg;
  if (atomic_exchange(&ev->note_state, NOTE_SET) == NOTE_FIRED) fn(arg);
  return 0;
}

/* A stream with no pending import, oldest first; d->imp_mu held. */
static int take_stream(cu_device *d, int bdev, cu_import_stream **out) {
  for (int i = 0; i < d->nimp; i++) {
    int k = (d->imp_next + i) % d->nimp;
    cu_import_stream *st = &d->imp[k];
    if (!st->last || cudaEventQuery(st->last->e) != cudaErrorNotReady) {
      d->imp_next = (k + 1) % d->nimp;
      *out = st;
      return 0;
    }
  }
  if (d->nimp == CU_IMPORT_STREAMS)
    return cu_svc->error(TDM_EBUSY, 0, "%d imported events of cuda:%d are pending",
                         CU_IMPORT_STREAMS, bdev);
  if (!d->imp && !(d->imp = calloc(CU_IMPORT_STREAMS, sizeof *d->imp)))
    return cu_svc->error(TDM_ENOMEM, 0, "no memory for import streams");
  cu_import_stream *st = &d->imp[d->nimp];
  cudaError_t e = cudaStreamCreateWithFlags(&st->s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cu_error(e, "cudaStreamCreateWithFlags for imports");
  st->last = NULL;
  d->nimp++; /* imp_next still names the oldest import */
  *out = st;
  return 0;
}

int cu_event_import(int bdev, void *native, void **handle) {
  cu_device *d = &cu_devs[bdev];
  cudaEvent_t theirs = native;
  int saved, rc = cu_enter(bdev, &saved);
  if (rc) return rc;
  /* A handle the runtime knows not to be an event is refused here, before any stream waits. */
  cudaError_t e = cudaEventQuery(theirs);
  if (e != cudaSuccess && e != cudaErrorNotReady) {
    rc = cu_error(e, "cudaEventQuery on the event to import");
    cu_leave(saved);
    return rc;
  }
  pthread_mutex_lock(&d->imp_mu);
  cu_import_stream *st = NULL;
  cu_event *ev = NULL;
  if ((rc = take_stream(d, bdev, &st))) goto out;
  if (!(ev = cu_event_take(&d->imp_local, bdev, false))) {
    rc = cu_svc->error(TDM_ENOMEM, 0, "no CUDA event");
    goto out;
  }
  const char *what = "cudaStreamWaitEvent on the event to import";
  e = cudaStreamWaitEvent(st->s, theirs, 0);
  if (e == cudaSuccess) {
    what = "cudaEventRecord";
    e = cudaEventRecord(ev->e, st->s);
  }
  if (e != cudaSuccess) {
    cu_event_put(ev);
    rc = cu_error(e, what);
    goto out;
  }
  ev->bq = NULL;
  ev->stream = -1;
  ev->imported = true;
  ev->note_fn = NULL;
  ev->note_arg = NULL;
  /* References: the two the core takes, the stream's, and the host function's. */
  atomic_store(&ev->refs, 3);
  if (st->last) cu_event_put(st->last);
  st->last = ev;
  atomic_store(&ev->note_state, NOTE_OFF);
  if (d->wait_value) {
    atomic_store(&ev->note_state, NOTE_WAIT);
    atomic_fetch_add(&ev->refs, 1);
    if (cudaLaunchHostFunc(st->s, import_fired, ev) != cudaSuccess) {
      cudaGetLastError();
      atomic_store(&ev->note_state, NOTE_OFF); /* a pool thread will wait for it */
      atomic_fetch_sub(&ev->refs, 1);
    }
  }
  *handle = ev;
out:
  pthread_mutex_unlock(&d->imp_mu);
  cu_leave(saved);
  return rc;
}

void cu_import_fini(cu_device *d) {
  for (int i = 0; i < d->nimp; i++) {
    cudaStreamSynchronize(d->imp[i].s); /* its host functions have returned */
    if (d->imp[i].last) cu_event_put(d->imp[i].last);
    cudaStreamDestroy(d->imp[i].s);
  }
  free(d->imp);
  d->imp = NULL;
  d->nimp = 0;
  for (cu_event *ev = d->imp_local, *n; ev; ev = n) {
    n = ev->next;
    tdm__lfstack_push(&d->ev_returned, ev);
  }
  d->imp_local = NULL;
}
