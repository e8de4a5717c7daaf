/* fault.c: fault injection and live-object counts for tests. Every host allocation of the
 * core (tdm__malloc, tdm__calloc, tdm__malloc_quiet) and every fallible call through the
 * backend table (the wrappers of backend.c) passes the fault hook, so a test can make the Nth
 * one fail and check that the operation fails cleanly. Backend entries that cannot fail (the
 * void ones, native_export, and native_notify, whose declining is a fallback) are not counted.
 * Libraries built on tandem reach the same counter through tdm_fault_point(). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;
_Atomic int tdm__fault_armed;
static unsigned fault_kinds;
static long fault_left;
static int fault_code;
static int fault_fired;
static _Thread_local int tls_taken_code;

int tdm_fault_inject(unsigned kinds, long nth, int code) {
  pthread_mutex_lock(&fault_mu);
  fault_kinds = kinds;
  fault_left = nth;
  fault_code = code;
  fault_fired = 0;
  atomic_store(&tdm__fault_armed, nth >= 0 && kinds != 0);
  pthread_mutex_unlock(&fault_mu);
  return 0;
}

int tdm_fault_fired(void) {
  pthread_mutex_lock(&fault_mu);
  int f = fault_fired;
  pthread_mutex_unlock(&fault_mu);
  return f;
}

/* Whether the armed fault fires at this point; the code it fails with is kept for the thread. */
static int fault_take(unsigned kind) {
  if (!atomic_load_explicit(&tdm__fault_armed, memory_order_relaxed)) return 0;
  int hit = 0;
  pthread_mutex_lock(&fault_mu);
  if (atomic_load(&tdm__fault_armed) && (fault_kinds & kind)) {
    if (fault_left-- == 0) {
      hit = 1;
      fault_fired = 1;
      atomic_store(&tdm__fault_armed, 0);
      /* Backend faults of either kind (a call's, or a completion's) default to EBACKEND. */
      tls_taken_code = fault_code ? fault_code
                                  : (kind == TDM_FAULT_ALLOC ? TDM_ENOMEM : TDM_EBACKEND);
    }
  }
  pthread_mutex_unlock(&fault_mu);
  return hit;
}

int tdm__fault_slow(unsigned kind) {
  int hit = fault_take(kind);
  if (hit) tdm__error(tls_taken_code, 0, "injected fault");
  return hit;
}

int tdm__fault_code_taken(void) { return tls_taken_code; }

int tdm_fault_point(unsigned kind) { return tdm__fault(kind) ? tls_taken_code : 0; }

void *tdm__malloc(size_t n) {
  if (tdm__fault(TDM_FAULT_ALLOC)) return NULL;
  return malloc(n);
}

void *tdm__malloc_quiet(size_t n) {
  if (fault_take(TDM_FAULT_ALLOC)) return NULL;
  return malloc(n);
}

void *tdm__calloc(size_t n, size_t size) {
  if (tdm__fault(TDM_FAULT_ALLOC)) return NULL;
  return calloc(n, size);
}

void *tdm__calloc_lines(size_t size) {
  if (tdm__fault(TDM_FAULT_ALLOC)) return NULL;
  size_t n = (size + TDM__CACHE_LINE - 1) / TDM__CACHE_LINE * TDM__CACHE_LINE;
  void *p = aligned_alloc(TDM__CACHE_LINE, n);
  if (p) memset(p, 0, n);
  return p;
}

int tdm_stats_get(tdm_stats *out) {
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_stats_get: out is NULL");
  out->queues = atomic_load(&tdm__g.n_queues);
  out->allocations = atomic_load(&tdm__g.n_allocs);
  out->events = out->pending = 0;
  pthread_mutex_lock(&tdm__g.mu);
  for (tdm__queue *q = tdm__g.queues; q; q = q->next_all) {
    /* The completing side first: it never runs ahead of the submitting side. */
    long freed = atomic_load(&q->n_freed), done = atomic_load(&q->n_done);
    long submitted = atomic_load(&q->n_submitted);
    out->events += submitted - freed;
    out->pending += submitted - done;
  }
  pthread_mutex_unlock(&tdm__g.mu);
  return 0;
}
