/* streamer.c: the expert streamer (tandem/streamer.h), built on tandem's public API only: two
 * copy queues of its own (demand misses and prefetches), device slots in one allocation, and a
 * key -> slot map. A slot is reused only after every compute that read it since its copy: the
 * copy into it depends on those events, so the wait happens on the device.
 *
 * Failures: a copy that failed (or that did not run because a reader it waited for failed)
 * leaves its slot mapped until an acquire or prefetch finds it, which copies the expert again;
 * the streamer's in-order copy queue that carries such an error is synced first, since until
 * then it would fail every later copy too. The teardown goes on past a failed step and reports
 * the first one, and never frees the slots while a compute may still read them. */
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/streamer.h"

enum { FREE_MAX = 4 }; /* release events kept per slot before they are joined into one */

typedef struct slot {
  int key;             /* -1: empty */
  int pins;            /* acquired and not yet released */
  bool fixed;          /* TDM_CACHE_STATIC's resident set: never evicted */
  bool unused_prefetch;/* prefetched and not acquired yet: prefetches do not evict it while
                          its layer is still to come (not below acq_layer) */
  uint64_t last_use;
  tdm_event *ready;    /* the copy into the slot */
  /* The releases' events not known to be complete: the slot is overwritten only after all of
   * them (an expert acquired by several threads is released once by each, in any order). */
  tdm_event *free[FREE_MAX];
  int nfree;
} slot;

struct tdm_streamer {
  tdm_streamer_config cfg;
  tdm_device *dev;
  tdm_queue *demand, *prefetch;
  tdm_event *last[2]; /* the latest copy on demand ([0]) and on prefetch ([1]) */
  char *base; /* nslots * expert_bytes of device memory */
  int nslots, nfixed;
  slot *slots;
  int *evictable, nevictable; /* the slots that are not fixed, in index order */
  int *map;   /* key -> slot, or -1 */
  pthread_mutex_t mu;
  uint64_t tick;
  int acq_layer; /* the layer of the latest acquire (0 before any) */
  tdm_event **inflight; /* prefetch copies possibly still in flight */
  int ninflight, cap_inflight, depth;
  tdm_streamer_stats st;
  /* time_copies: t0, a timed marker every interval is measured from; the copies not yet
   * harvested (their start markers and copy events); the intervals harvested since the last
   * reset, in ms from t0, in no particular order */
  tdm_event *t0;
  struct timed { tdm_event *start, *end; } *timed;
  int ntimed, cap_timed;
  struct span { double a, b; } *spans;
  size_t nspans, cap_spans;
};

/* The streamer's own host allocations pass tdm_fault_point, so that fault-injection tests
 * fail them as they fail tandem's; a count times a size that does not fit a size_t is refused
 * like memory that is not there. */
static void *xrealloc(void *old, size_t n, size_t size) {
  if (n == 0 || size == 0 || n > SIZE_MAX / size) return NULL;
  if (tdm_fault_point(TDM_FAULT_ALLOC)) return NULL;
  return realloc(old, n * size);
}

static void *xcalloc(size_t n, size_t size) {
  if (n == 0 || size == 0 || n > SIZE_MAX / size) return NULL;
  if (tdm_fault_point(TDM_FAULT_ALLOC)) return NULL;
  return calloc(n, size);
}

/* Whether the slot holds a copy that completed with an error (asking never waits). */
static bool copy_failed(const slot *sl) {
  int st = sl->ready ? tdm_event_query(sl->ready) : 0;
  return st < 0 && st != TDM_EAGAIN;
}

/* A failed copy that no acquire holds is made again, in its own slot, by the next acquire or
 * prefetch of its expert. One still held stays until its holders release it: their compute
 * waited for it and fails with it, and it must not be overwritten under them. */
static bool must_redo(const slot *sl) { return !sl->pins && copy_failed(sl); }

static void slot_clear_events(slot *sl) {
  if (sl->ready) tdm_event_release(sl->ready);
  sl->ready = NULL;
  for (int j = 0; j < sl->nfree; j++) tdm_event_release(sl->free[j]);
  sl->nfree = 0;
}

/* Adds a release's event (a reference the slot now owns) to those the slot's next copy waits
 * for, dropping the ones already complete; when FREE_MAX are still pending they are joined
 * into one barrier on the compute queue (whose later work may then wait for them too: they
 * were all recorded before it, so this adds no cycle). */
static int slot_add_free(tdm_streamer *s, slot *sl, tdm_event *ev) {
  int k = 0;
  for (int j = 0; j < sl->nfree; j++) {
    if (tdm_event_query(sl->free[j]) == TDM_EAGAIN)
      sl->free[k++] = sl->free[j];
    else
      tdm_event_release(sl->free[j]);
  }
  sl->nfree = k;
  if (sl->nfree == FREE_MAX) {
    tdm_event *joined;
    int rc = tdm_queue_barrier(s->cfg.compute, (size_t)sl->nfree, sl->free, &joined);
    if (rc) {
      tdm_event_release(ev);
      return rc;
    }
    for (int j = 0; j < sl->nfree; j++) tdm_event_release(sl->free[j]);
    sl->free[0] = joined;
    sl->nfree = 1;
  }
  sl->free[sl->nfree++] = ev;
  return 0;
}

/* ---- time_copies: each copy's interval on the device, and their union ---- */

/* Moves the timed copies that have completed into spans (those that failed are dropped);
 * the others stay. With s->mu held. */
static void harvest(tdm_streamer *s) {
  int k = 0;
  for (int j = 0; j < s->ntimed; j++) {
    struct timed *t = &s->timed[j];
    int st = tdm_event_query(t->end);
    if (st == TDM_EAGAIN) {
      s->timed[k++] = *t;
      continue;
    }
    double a, b;
    if (st == 0 && tdm_event_elapsed(s->t0, t->start, &a) == 0 &&
        tdm_event_elapsed(s->t0, t->end, &b) == 0 && b >= a) {
      if (s->nspans == s->cap_spans) {
        size_t cap = s->cap_spans ? 2 * s->cap_spans : 256;
        struct span *n = realloc(s->spans, cap * sizeof *n);
        if (n) {
          s->spans = n;
          s->cap_spans = cap;
        }
      }
      if (s->nspans < s->cap_spans) s->spans[s->nspans++] = (struct span){a, b};
    }
    tdm_event_release(t->start);
    tdm_event_release(t->end);
  }
  s->ntimed = k;
}

static int span_cmp(const void *x, const void *y) {
  double a = ((const struct span *)x)->a, b = ((const struct span *)y)->a;
  return (a > b) - (a < b);
}

/* The union of the spans, in seconds. The spans are replaced by that union (sorted and
 * disjoint), so they stay few however many copies are timed. With s->mu held. */
static double busy_seconds(tdm_streamer *s) {
  if (s->nspans == 0) return 0.0;
  qsort(s->spans, s->nspans, sizeof *s->spans, span_cmp);
  size_t k = 0;
  for (size_t j = 0; j < s->nspans; j++) {
    if (k && s->spans[j].a <= s->spans[k - 1].b) {
      if (s->spans[j].b > s->spans[k - 1].b) s->spans[k - 1].b = s->spans[j].b;
    } else {
      s->spans[k++] = s->spans[j];
    }
  }
  s->nspans = k;
  double busy = 0;
  for (size_t j = 0; j < k; j++) busy += s->spans[j].b - s->spans[j].a;
  return busy / 1e3;
}

/* A timed copy's start marker on q, after the copy's dependencies (waited for device-side
 * first, so that the marker and the copy come after them). With s->mu held. */
static int timed_start(tdm_streamer *s, tdm_queue *q, tdm_event *const *deps, size_t nd,
                       tdm_event **start) {
  int rc = 0;
  for (size_t j = 0; !rc && j < nd; j++) rc = tdm_queue_wait(q, deps[j]);
  if (!rc && s->ntimed == s->cap_timed) {
    harvest(s);
    if (s->ntimed == s->cap_timed) {
      int cap = s->cap_timed ? (s->cap_timed <= INT_MAX / 2 ? 2 * s->cap_timed : 0) : 64;
      struct timed *n = cap ? xrealloc(s->timed, (size_t)cap, sizeof *n) : NULL;
      if (!n) return tdm_set_error(TDM_ENOMEM, 0, "no memory to time the streamer's copies");
      s->timed = n;
      s->cap_timed = cap;
    }
  }
  return rc ? rc : tdm_event_record(q, start);
}

/* An in-order queue fails every command after a failed one until it is synced (tandem.h), so
 * a copy queue whose latest copy failed is synced before it copies again. The sync waits for
 * that queue's copies, on this error path only; the error it clears was the copy's waiters' to
 * hear (the compute queue that waited for it, its ready event), and they have. A sync that
 * cannot run (from a host task of that queue) leaves the next copy to fail and be redone. */
static void copyq_recover(tdm_streamer *s, tdm_queue *q) {
  tdm_event **last = &s->last[q == s->prefetch];
  int st = *last ? tdm_event_query(*last) : 0;
  if (st == 0 || st == TDM_EAGAIN) return;
  (void)tdm_queue_sync(q);
  tdm_event_release(*last);
  *last = NULL;
}

/* Copies key into slot i on queue q, after the slot's last reader; the slot is the key's. */
static int load(tdm_streamer *s, int i, int key, tdm_queue *q) {
  slot *sl = &s->slots[i];
  /* After the slot's readers, and after a copy into it that may still be landing (an evicted
   * prefetch on the other queue): those not complete yet. One that has completed, even with
   * an error, no longer touches the slot, and waiting for a failed one would fail this copy. */
  tdm_event *deps[FREE_MAX + 1], *ready = NULL, *start = NULL;
  size_t nd = 0;
  for (int j = 0; j < sl->nfree; j++)
    if (tdm_event_query(sl->free[j]) == TDM_EAGAIN) deps[nd++] = sl->free[j];
  if (sl->ready && tdm_event_query(sl->ready) == TDM_EAGAIN) deps[nd++] = sl->ready;
  copyq_recover(s, q);
  void *dst = s->base + (size_t)i * s->cfg.expert_bytes;
  int rc = 0;
  if (s->t0) {
    if ((rc = timed_start(s, q, deps, nd, &start))) return rc;
    nd = 0;
  }
  rc = tdm_memcpy(q, dst, s->cfg.host[key], s->cfg.expert_bytes, TDM_COPY_H2D, nd,
                  nd ? deps : NULL, &ready);
  if (rc) {
    if (start) tdm_event_release(start);
    return rc;
  }
  if (start) {
    tdm_event_retain(ready);
    s->timed[s->ntimed++] = (struct timed){start, ready};
  }
  tdm_event **last = &s->last[q == s->prefetch];
  if (*last) tdm_event_release(*last);
  tdm_event_retain(ready);
  *last = ready;
  if (sl->key >= 0) s->map[sl->key] = -1;
  slot_clear_events(sl);
  sl->key = key;
  sl->ready = ready;
  sl->unused_prefetch = false;
  s->map[key] = i;
  s->st.bytes_copied += s->cfg.expert_bytes;
  return 0;
}

/* The least recently used slot that may be overwritten, or -1. Prefetches spare slots holding
 * prefetched experts nobody has acquired yet. Only the evictable slots are looked at: with a
 * static resident set of thousands of experts this runs at every acquire and prefetch. */
static int victim(tdm_streamer *s, bool for_prefetch) {
  int best = -1;
  for (int j = 0; j < s->nevictable; j++) {
    int i = s->evictable[j];
    slot *sl = &s->slots[i];
    if (sl->pins ||
        (for_prefetch && sl->unused_prefetch && sl->key / s->cfg.experts >= s->acq_layer))
      continue;
    if (best < 0 || sl->last_use < s->slots[best].last_use) best = i;
    if (sl->key < 0) return i;
  }
  return best;
}

/* The slot counts. Every count, and every count times a size, is checked here before
 * anything is allocated: keys are ints (layer * experts + e), and so are slot indices. The
 * budget holds at most one slot per expert; so do the staging slots, as more could never hold
 * distinct experts at once, and a huge count (INT_MAX from Python, say) would only overflow
 * or make huge tables. */
static int plan_slots(const tdm_streamer_config *cfg, int *nfixed, int *nslots) {
  long long keys = (long long)cfg->layers * cfg->experts;
  if (keys > INT_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%d layers of %d experts: more than the streamer can "
                         "number (%d at most)", cfg->layers, cfg->experts, INT_MAX);
  size_t fixed = cfg->budget_bytes / cfg->expert_bytes;
  if (fixed > (size_t)keys) fixed = (size_t)keys;
  long long staging = cfg->staging_slots < keys ? cfg->staging_slots : keys;
  long long n = (long long)fixed + staging;
  if (n > INT_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%zu resident and %lld staging slots: more than the "
                         "streamer can number (%d at most)", fixed, staging, INT_MAX);
  if (cfg->expert_bytes > SIZE_MAX / (size_t)n)
    return tdm_set_error(TDM_ENOMEM, 0, "%lld expert slots of %zu bytes: more bytes than any "
                         "memory holds", n, cfg->expert_bytes);
  *nfixed = (int)fixed;
  *nslots = (int)n;
  return 0;
}

static int check_config(const tdm_streamer_config *cfg) {
  if (!cfg || !cfg->compute || !cfg->host || cfg->layers <= 0 || cfg->experts <= 0 ||
      cfg->expert_bytes == 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_create: a required field is missing");
  if (cfg->staging_slots < 1)
    return tdm_set_error(TDM_EINVAL, 0, "the streamer needs at least one staging slot (got %d)",
                         cfg->staging_slots);
  if (cfg->prefetch_depth < 0)
    return tdm_set_error(TDM_EINVAL, 0, "a prefetch depth of %d copies (0 or more)",
                         cfg->prefetch_depth);
  if (cfg->budget_bytes && cfg->budget_bytes < cfg->expert_bytes)
    return tdm_set_error(TDM_EINVAL, 0, "a budget of %zu bytes cannot hold one %zu-byte expert",
                         cfg->budget_bytes, cfg->expert_bytes);
  return 0;
}

/* The host tables. The in-flight list starts with room for as many prefetches as there are
 * slots (or the depth, if fewer) and grows up to the depth only if copies of evicted
 * prefetches are still in flight: a depth of INT_MAX costs nothing up front. */
static int make_tables(tdm_streamer *s) {
  size_t keys = (size_t)s->cfg.layers * (size_t)s->cfg.experts;
  s->slots = xcalloc((size_t)s->nslots, sizeof *s->slots);
  s->evictable = xcalloc((size_t)s->nslots, sizeof *s->evictable);
  s->map = xcalloc(keys, sizeof *s->map);
  s->cap_inflight = s->depth < s->nslots ? s->depth : s->nslots;
  s->inflight = xcalloc((size_t)s->cap_inflight, sizeof *s->inflight);
  if (!s->slots || !s->evictable || !s->map || !s->inflight)
    return tdm_set_error(TDM_ENOMEM, 0, "no memory for the streamer's tables");
  for (size_t k = 0; k < keys; k++) s->map[k] = -1;
  for (int i = 0; i < s->nslots; i++) s->slots[i].key = -1;
  return 0;
}

static int make_device_side(tdm_streamer *s) {
  unsigned qflags = TDM_QUEUE_IN_ORDER | (s->cfg.time_copies ? TDM_QUEUE_TIMING : 0);
  int rc = tdm_queue_create(s->dev, qflags, &s->demand);
  if (!rc) rc = tdm_queue_create(s->dev, qflags, &s->prefetch);
  if (!rc && s->cfg.time_copies) rc = tdm_event_record(s->prefetch, &s->t0);
  if (!rc &&
      (rc = tdm_malloc(s->dev, TDM_MEM_DEVICE, (size_t)s->nslots * s->cfg.expert_bytes,
                       (void **)&s->base)))
    tdm_set_error(rc, 0, "%d expert slots of %zu bytes (%d resident + %d staging) do not fit: %s",
                  s->nslots, s->cfg.expert_bytes, s->nfixed, s->nslots - s->nfixed,
                  tdm_last_error());
  return rc;
}

/* TDM_CACHE_STATIC: loads the resident set once, on the prefetch queue. */
static int load_resident(tdm_streamer *s) {
  const tdm_streamer_config *cfg = &s->cfg;
  int keys = cfg->layers * cfg->experts, rc = 0;
  for (int i = 0; i < s->nfixed && !rc; i++) {
    int key = (cfg->resident && i < cfg->nresident) ? cfg->resident[i] : i;
    if (key < 0 || key >= keys || s->map[key] >= 0) continue; /* the slot stages instead */
    rc = load(s, i, key, s->prefetch);
    s->slots[i].fixed = true;
  }
  s->st.bytes_copied = 0; /* the resident set's load is not part of any pass */
  return rc;
}

/* The first failure of a sequence that goes on past it (a teardown): its code and words, kept
 * aside since the steps after it overwrite the thread's message. */
typedef struct first_error {
  int rc, native;
  char why[512];
} first_error;

/* Notes rc, if it is the first failure, with the thread's message less what tdm_set_error
 * adds around the words again (the code's name before them, the native code after). */
static void note_error(first_error *f, int rc) {
  if (!rc || f->rc) return;
  const char *m = tdm_last_error(), *name = tdm_err_name(rc);
  size_t len = strlen(name), n;
  if (strncmp(m, name, len) == 0 && m[len] == ':') m += len + (m[len + 1] == ' ' ? 2 : 1);
  f->rc = rc;
  f->native = tdm_last_native_error();
  snprintf(f->why, sizeof f->why, "%s", m);
  char tail[48];
  snprintf(tail, sizeof tail, " (native error %d)", f->native);
  len = strlen(tail);
  if (f->native && (n = strlen(f->why)) >= len && strcmp(f->why + n - len, tail) == 0)
    f->why[n - len] = '\0';
}

int tdm_streamer_create(const tdm_streamer_config *cfg, tdm_streamer **out) {
  int rc, nfixed = 0, nslots = 0;
  tdm_device *dev;
  if (!out) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_create: out is NULL");
  if ((rc = check_config(cfg)) || (rc = plan_slots(cfg, &nfixed, &nslots)) ||
      (rc = tdm_queue_device(cfg->compute, &dev)))
    return rc;
  tdm_streamer *s = xcalloc(1, sizeof *s);
  if (!s) return tdm_set_error(TDM_ENOMEM, 0, "tdm_streamer_create: no memory for the streamer");
  pthread_mutex_init(&s->mu, NULL);
  s->cfg = *cfg;
  s->dev = dev;
  s->nfixed = nfixed;
  s->nslots = nslots;
  s->depth = cfg->prefetch_depth > 0 ? cfg->prefetch_depth : nslots - nfixed;
  rc = make_tables(s);
  if (!rc) rc = make_device_side(s);
  if (!rc && cfg->policy == TDM_CACHE_STATIC) rc = load_resident(s);
  if (rc) { /* rc and its message say what went wrong: creating, not tearing down */
    first_error f = {0, 0, ""};
    note_error(&f, rc);
    (void)tdm_streamer_destroy(s);
    return tdm_set_error(f.rc, f.native, "%s", f.why);
  }
  for (int i = 0; i < s->nslots; i++)
    if (!s->slots[i].fixed) s->evictable[s->nevictable++] = i;
  s->st.resident_slots = cfg->policy == TDM_CACHE_STATIC ? s->nfixed : 0;
  s->st.staging_slots = cfg->policy == TDM_CACHE_STATIC ? s->nslots - s->nfixed : s->nslots;
  s->st.prefetch_depth = s->depth;
  s->st.device_bytes = (size_t)s->nslots * cfg->expert_bytes;
  *out = s;
  return 0;
}

static bool queue_alive(tdm_queue *q) {
  unsigned flags;
  return tdm_queue_flags(q, &flags) == 0;
}

/* Destroys one of the streamer's copy queues, which drains it; returns whether it is gone. A
 * destroy that did not happen (its drain could not be submitted: no memory, say) is a failure,
 * noted, and is tried once more after a sync. An error the queue reports as it goes is a
 * copy's, which the work that waited for the copy has heard of: not the destroy's. */
static bool destroy_queue(tdm_queue *q, first_error *f) {
  int rc = tdm_queue_destroy(q);
  if (rc == 0 || !queue_alive(q)) return true;
  note_error(f, rc);
  (void)tdm_queue_sync(q);
  rc = tdm_queue_destroy(q);
  return rc == 0 || !queue_alive(q);
}

/* Frees the slots once the compute queue's readers are done: in its order, or where that free
 * cannot be queued, once a marker of it has completed (a marker, not a sync, so the queue's
 * error stays its owner's to hear). Never at once while the queue lives: a compute still
 * reading a slot would read freed memory. A compute queue destroyed already was drained by
 * its destroy. If no marker can be waited for either (this runs in a host task of the compute
 * queue, say), the slots are left allocated: a leak, reported, rather than a use after free. */
static void free_slots(tdm_streamer *s, first_error *f) {
  int rc = tdm_free_async(s->cfg.compute, s->base, 0, NULL, NULL);
  if (rc == 0) return;
  if (!queue_alive(s->cfg.compute)) {
    tdm_free(s->base);
    return;
  }
  note_error(f, rc);
  tdm_event *m;
  bool done = false;
  if (tdm_event_record(s->cfg.compute, &m) == 0) {
    (void)tdm_event_wait(m); /* its status is the queue's error, not the free's */
    done = tdm_event_query(m) != TDM_EAGAIN;
    tdm_event_release(m);
  }
  if (done) tdm_free(s->base);
  else snprintf(f->why + strlen(f->why), sizeof f->why - strlen(f->why), "%s",
                "; the slots are left allocated, as the compute queue may still read them");
}

int tdm_streamer_destroy(tdm_streamer *s) {
  if (!s) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_destroy: s is NULL");
  first_error f = {0, 0, ""};
  /* The copy queues first: once they are gone (drained), no copy writes a slot any more. */
  bool drained = true;
  if (s->demand) drained = destroy_queue(s->demand, &f) && drained;
  if (s->prefetch) drained = destroy_queue(s->prefetch, &f) && drained;
  for (int i = 0; s->slots && i < s->nslots; i++) slot_clear_events(&s->slots[i]);
  for (int i = 0; i < s->ninflight; i++) tdm_event_release(s->inflight[i]);
  for (int i = 0; i < s->ntimed; i++) {
    tdm_event_release(s->timed[i].start);
    tdm_event_release(s->timed[i].end);
  }
  for (int j = 0; j < 2; j++)
    if (s->last[j]) tdm_event_release(s->last[j]);
  if (s->t0) tdm_event_release(s->t0);
  if (s->base && drained) free_slots(s, &f);
  else if (s->base)
    snprintf(f.why + strlen(f.why), sizeof f.why - strlen(f.why), "%s",
             "; the slots are left allocated, as that queue's copies may still write them");
  free(s->timed);
  free(s->spans);
  pthread_mutex_destroy(&s->mu);
  free(s->slots);
  free(s->evictable);
  free(s->map);
  free(s->inflight);
  free(s);
  if (!f.rc) return 0;
  return tdm_set_error(f.rc, f.native, "tdm_streamer_destroy: %s", f.why);
}

static int key_of(tdm_streamer *s, int layer, int e) {
  if (layer < 0 || layer >= s->cfg.layers || e < 0 || e >= s->cfg.experts) return -1;
  return layer * s->cfg.experts + e;
}

/* Where an acquire found its expert. */
enum found { RESIDENT, INFLIGHT, MISS };

/* The slot of expert key for an acquire: the one it is in, or one it is copied into on demand
 * (a failed copy nobody holds is redone in its own slot). A mapped slot's copy is complete
 * when its event says so now; asking never waits. Returns the slot or a TDM_E* code. */
static int place(tdm_streamer *s, int key, enum found *found, bool *prefetched) {
  int i = s->map[key];
  if (i >= 0 && !must_redo(&s->slots[i])) {
    const slot *sl = &s->slots[i];
    *found = (!sl->ready || tdm_event_query(sl->ready) == 0) ? RESIDENT : INFLIGHT;
    *prefetched = sl->unused_prefetch;
    return i;
  }
  *found = MISS;
  if (i < 0 && (i = victim(s, false)) < 0)
    return tdm_set_error(TDM_EBUSY, 0, "all %d streamer slots are acquired: release some",
                         s->nslots);
  int rc = load(s, i, key, s->demand);
  return rc ? rc : i;
}

static void count_acquire(tdm_streamer *s, enum found found, bool prefetched) {
  s->st.acquires++;
  if (found == MISS) {
    s->st.misses++;
    return;
  }
  s->st.hits++;
  if (found == RESIDENT) s->st.resident_hits++;
  else s->st.inflight_hits++;
  if (prefetched) s->st.prefetch_hits++;
}

int tdm_streamer_acquire(tdm_streamer *s, int layer, int e, const void **dptr,
                         tdm_event **ready) {
  if (!s || !dptr) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_acquire: s or dptr is NULL");
  int key = key_of(s, layer, e);
  if (key < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_acquire: expert %d of layer %d does not exist",
                      e, layer);
  pthread_mutex_lock(&s->mu);
  enum found found; /* counted once the acquire succeeds */
  bool prefetched = false;
  int i = place(s, key, &found, &prefetched), rc = i < 0 ? i : 0;
  slot *sl = rc ? NULL : &s->slots[i];
  if (sl) {
    /* The compute queue waits for the copy on the device; nothing waits here. A resident
     * expert's copy is complete: no wait to add. */
    if (found != RESIDENT && sl->ready && tdm_event_query(sl->ready) != 0)
      rc = tdm_queue_wait(s->cfg.compute, sl->ready);
    tdm_event *r = NULL;
    if (!rc && ready) {
      if (sl->ready) rc = tdm_event_retain(r = sl->ready);
      else rc = tdm_event_record(s->demand, &r);
    }
    if (!rc) {
      if (ready) *ready = r;
      *dptr = s->base + (size_t)i * s->cfg.expert_bytes;
      sl->pins++;
      sl->last_use = ++s->tick;
      sl->unused_prefetch = false;
      s->acq_layer = layer;
      count_acquire(s, found, prefetched);
    }
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int tdm_streamer_where(tdm_streamer *s, int layer, int e) {
  int key = s ? key_of(s, layer, e) : -1;
  if (key < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_where: no streamer, or expert %d of layer "
                         "%d does not exist", e, layer);
  pthread_mutex_lock(&s->mu);
  int i = s->map[key], where = TDM_EXPERT_ABSENT; /* a failed copy: an acquire redoes it */
  if (i >= 0 && !must_redo(&s->slots[i]))
    where = !s->slots[i].ready || tdm_event_query(s->slots[i].ready) == 0 ? TDM_EXPERT_READY
                                                                         : TDM_EXPERT_INFLIGHT;
  pthread_mutex_unlock(&s->mu);
  return where;
}

int tdm_streamer_ready(tdm_streamer *s, int layer, int e) {
  int key = s ? key_of(s, layer, e) : -1;
  if (key < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_ready: no streamer, or expert %d of layer "
                         "%d does not exist", e, layer);
  return tdm_streamer_where(s, layer, e) == TDM_EXPERT_READY;
}

int tdm_streamer_release(tdm_streamer *s, int layer, int e, tdm_event *done) {
  if (!s) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_release: s is NULL");
  int key = key_of(s, layer, e);
  if (key < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_release: expert %d of layer %d does not exist",
                      e, layer);
  pthread_mutex_lock(&s->mu);
  int i = s->map[key];
  if (i < 0 || s->slots[i].pins == 0) {
    pthread_mutex_unlock(&s->mu);
    return tdm_set_error(TDM_ESTATE, 0, "tdm_streamer_release: expert %d of layer %d is not acquired",
                      e, layer);
  }
  slot *sl = &s->slots[i];
  /* A resident slot is never overwritten: no event to keep. Else the given one, or one
   * recorded now on the compute queue (still under the lock, so the slot cannot change). */
  int rc = 0;
  if (!sl->fixed) {
    tdm_event *ev = done;
    rc = done ? tdm_event_retain(done) : tdm_event_record(s->cfg.compute, &ev);
    if (!rc) rc = slot_add_free(s, sl, ev);
  }
  if (!rc) sl->pins--;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* Room in the in-flight list for one more prefetch (it grows only while copies of evicted
 * prefetches are still in flight, up to the depth). */
static int inflight_reserve(tdm_streamer *s) {
  if (s->ninflight < s->cap_inflight) return 0;
  int cap = s->cap_inflight <= s->depth / 2 ? 2 * s->cap_inflight : s->depth;
  tdm_event **n = xrealloc(s->inflight, (size_t)cap, sizeof *n);
  if (!n) return tdm_set_error(TDM_ENOMEM, 0, "no memory to track %d prefetches", cap);
  s->inflight = n;
  s->cap_inflight = cap;
  return 0;
}

/* Forgets the prefetches that have landed (or failed). */
static void inflight_prune(tdm_streamer *s) {
  int k = 0;
  for (int j = 0; j < s->ninflight; j++) {
    if (tdm_event_query(s->inflight[j]) == TDM_EAGAIN)
      s->inflight[k++] = s->inflight[j];
    else
      tdm_event_release(s->inflight[j]);
  }
  s->ninflight = k;
}

/* Starts a prefetch of key into slot i (a victim, or the key's own slot if its copy failed). */
static int prefetch_one(tdm_streamer *s, int i, int key) {
  int rc = inflight_reserve(s);
  if (!rc) rc = load(s, i, key, s->prefetch);
  if (rc) return rc;
  slot *sl = &s->slots[i];
  sl->unused_prefetch = !sl->fixed;
  sl->last_use = ++s->tick;
  tdm_event_retain(sl->ready);
  s->inflight[s->ninflight++] = sl->ready;
  s->st.prefetches++;
  return 0;
}

int tdm_streamer_prefetch(tdm_streamer *s, int layer, const int *experts, int n) {
  if (!s || n < 0 || (n && !experts) || layer < 0 || layer >= s->cfg.layers)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_prefetch: bad arguments");
  pthread_mutex_lock(&s->mu);
  inflight_prune(s);
  /* A layer below the latest acquire's is the next pass's: its layers are still to come, and
   * the unused prefetches of this pass, wrong guesses, keep their slots no longer. */
  if (layer < s->acq_layer) {
    for (int j = 0; j < s->nevictable; j++) s->slots[s->evictable[j]].unused_prefetch = false;
    s->acq_layer = layer;
  }
  int rc = 0;
  bool full = false; /* no slot or no depth left: nothing changes until the call returns */
  for (int j = 0; j < n && !rc; j++) {
    int key = key_of(s, layer, experts[j]);
    if (key < 0) {
      rc = tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_prefetch: expert %d of layer %d does not exist",
                      experts[j], layer);
      break;
    }
    int i = s->map[key];
    if (i >= 0 && !must_redo(&s->slots[i])) continue; /* on the device or on its way */
    if (full || s->ninflight >= s->depth) i = -1;
    else if (i < 0) i = victim(s, true);
    if (i < 0) {
      full = true;
      s->st.prefetch_dropped++;
      continue;
    }
    rc = prefetch_one(s, i, key);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* Sorts staged experts by the tick of their copy (insertion sort: a handful of staging
 * slots at most). */
static void sort_by_tick(tdm_streamer *s, int *keys, int n, int layer) {
  for (int i = 1; i < n; i++) {
    int e = keys[i], j = i;
    uint64_t t = s->slots[s->map[layer * s->cfg.experts + e]].last_use;
    for (; j > 0 && s->slots[s->map[layer * s->cfg.experts + keys[j - 1]]].last_use > t; j--)
      keys[j] = keys[j - 1];
    keys[j] = e;
  }
}

int tdm_streamer_schedule(tdm_streamer *s, int layer, int *experts, int n) {
  if (!s || n < 0 || (n && !experts) || layer < 0 || layer >= s->cfg.layers)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_schedule: bad arguments");
  if (n < 2) return 0;
  int *buf = xrealloc(NULL, (size_t)n, 3 * sizeof *buf);
  if (!buf) return tdm_set_error(TDM_ENOMEM, 0, "no memory to order %d experts", n);
  int *staged = buf, *held = buf + n, *absent = buf + 2 * n, ns = 0, nh = 0, na = 0;
  pthread_mutex_lock(&s->mu);
  for (int j = 0; j < n; j++) {
    int key = key_of(s, layer, experts[j]);
    if (key < 0) {
      pthread_mutex_unlock(&s->mu);
      free(buf);
      return tdm_set_error(TDM_EINVAL, 0,
                           "tdm_streamer_schedule: expert %d of layer %d does not exist",
                           experts[j], layer);
    }
    int i = s->map[key];
    if (i < 0 || must_redo(&s->slots[i])) {
      absent[na++] = experts[j];
    } else {
      const slot *sl = &s->slots[i];
      bool staging = sl->unused_prefetch || (s->cfg.policy == TDM_CACHE_STATIC && !sl->fixed);
      if (staging) staged[ns++] = experts[j];
      else held[nh++] = experts[j];
    }
  }
  sort_by_tick(s, staged, ns, layer);
  pthread_mutex_unlock(&s->mu);
  /* Staged first, then the rest; held experts go in front of the others, floor(j * nh / m)
   * of them before the j-th (m = the staged and absent ones), so each copy has compute in
   * front of it and none is left for after the last copy. */
  int m = ns + na, o = 0, h = 0;
  for (int j = 0; j < m; j++) {
    int upto = (int)((long long)(j + 1) * nh / m);
    if (j == 0 && ns) upto = 0; /* a staged expert is on its way already: no need to wait */
    while (h < upto) experts[o++] = held[h++];
    experts[o++] = j < ns ? staged[j] : absent[j - ns];
  }
  while (h < nh) experts[o++] = held[h++];
  free(buf);
  return 0;
}

int tdm_streamer_queues(tdm_streamer *s, tdm_queue **demand, tdm_queue **prefetch) {
  if (!s) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_queues: s is NULL");
  if (demand) *demand = s->demand;
  if (prefetch) *prefetch = s->prefetch;
  return 0;
}

int tdm_streamer_stats_get(tdm_streamer *s, tdm_streamer_stats *out) {
  if (!s || !out) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_stats_get: s or out is NULL");
  pthread_mutex_lock(&s->mu);
  if (s->t0) {
    harvest(s);
    s->st.link_busy_seconds = busy_seconds(s);
  }
  *out = s->st;
  pthread_mutex_unlock(&s->mu);
  return 0;
}

int tdm_streamer_stats_reset(tdm_streamer *s) {
  if (!s) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_stats_reset: s is NULL");
  pthread_mutex_lock(&s->mu);
  s->st.acquires = s->st.hits = s->st.misses = 0;
  s->st.resident_hits = s->st.inflight_hits = 0;
  s->st.prefetches = s->st.prefetch_hits = s->st.prefetch_dropped = 0;
  s->st.bytes_copied = 0;
  if (s->t0) harvest(s); /* what completed before the reset is not counted after it */
  s->nspans = 0;
  s->st.link_busy_seconds = 0;
  pthread_mutex_unlock(&s->mu);
  return 0;
}
