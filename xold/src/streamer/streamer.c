/* streamer.c: the expert streamer (tandem/streamer.h), built on tandem's public API only: two
 * copy queues of its own (demand misses and prefetches), device slots in one allocation, and a
 * key -> slot map. A slot is reused only after every compute that read it since its copy: the
 * copy into it depends on those events, so the wait happens on the device. */
#include <pthread.h>
#include <stdbool.h>
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
  char *base; /* nslots * expert_bytes of device memory */
  int nslots, nfixed;
  slot *slots;
  int *evictable, nevictable; /* the slots that are not fixed, in index order */
  int *map;   /* key -> slot, or -1 */
  pthread_mutex_t mu;
  uint64_t tick;
  int acq_layer; /* the layer of the latest acquire (0 before any) */
  tdm_event **inflight; /* prefetch copies possibly still in flight */
  int ninflight, depth;
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
      int cap = s->cap_timed ? 2 * s->cap_timed : 64;
      struct timed *n = realloc(s->timed, (size_t)cap * sizeof *n);
      if (!n) return tdm_set_error(TDM_ENOMEM, 0, "no memory to time the streamer's copies");
      s->timed = n;
      s->cap_timed = cap;
    }
  }
  return rc ? rc : tdm_event_record(q, start);
}

/* Copies key into slot i on queue q, after the slot's last reader; the slot is the key's. */
static int load(tdm_streamer *s, int i, int key, tdm_queue *q) {
  slot *sl = &s->slots[i];
  /* After the slot's last reader, and after a copy into it that may still be landing (an
   * evicted prefetch on the other queue). */
  tdm_event *deps[FREE_MAX + 1], *ready = NULL, *start = NULL;
  size_t nd = 0;
  for (int j = 0; j < sl->nfree; j++) deps[nd++] = sl->free[j];
  if (sl->ready) deps[nd++] = sl->ready;
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

int tdm_streamer_create(const tdm_streamer_config *cfg, tdm_streamer **out) {
  int rc;
  if (!cfg || !out || !cfg->compute || !cfg->host || cfg->layers <= 0 || cfg->experts <= 0 ||
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
  tdm_device *dev;
  if ((rc = tdm_queue_device(cfg->compute, &dev))) return rc;
  tdm_streamer *s = calloc(1, sizeof *s);
  if (!s) return tdm_set_error(TDM_ENOMEM, 0, "tdm_streamer_create: no memory for the streamer");
  s->cfg = *cfg;
  s->dev = dev;
  long keys = (long)cfg->layers * cfg->experts;
  long fixed = (long)(cfg->budget_bytes / cfg->expert_bytes);
  if (fixed > keys) fixed = keys;
  s->nfixed = (int)fixed;
  s->nslots = s->nfixed + cfg->staging_slots;
  s->depth = cfg->prefetch_depth > 0 ? cfg->prefetch_depth : cfg->staging_slots;
  s->slots = calloc((size_t)s->nslots, sizeof *s->slots);
  s->evictable = malloc((size_t)s->nslots * sizeof *s->evictable);
  s->map = malloc((size_t)keys * sizeof *s->map);
  s->inflight = calloc((size_t)s->depth, sizeof *s->inflight);
  pthread_mutex_init(&s->mu, NULL);
  rc = (!s->slots || !s->evictable || !s->map || !s->inflight)
           ? tdm_set_error(TDM_ENOMEM, 0, "no memory for the streamer's tables")
           : 0;
  unsigned qflags = TDM_QUEUE_IN_ORDER | (cfg->time_copies ? TDM_QUEUE_TIMING : 0);
  if (!rc) rc = tdm_queue_create(dev, qflags, &s->demand);
  if (!rc) rc = tdm_queue_create(dev, qflags, &s->prefetch);
  if (!rc && cfg->time_copies) rc = tdm_event_record(s->prefetch, &s->t0);
  if (!rc &&
      (rc = tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)s->nslots * cfg->expert_bytes, (void **)&s->base)))
    tdm_set_error(rc, 0, "%d expert slots of %zu bytes (%d resident + %d staging) do not fit: %s",
               s->nslots, cfg->expert_bytes, s->nfixed, cfg->staging_slots, tdm_last_error());
  if (rc) {
    tdm_streamer_destroy(s);
    return rc;
  }
  for (long k = 0; k < keys; k++) s->map[k] = -1;
  for (int i = 0; i < s->nslots; i++) s->slots[i].key = -1;
  s->st.resident_slots = cfg->policy == TDM_CACHE_STATIC ? s->nfixed : 0;
  s->st.staging_slots = cfg->policy == TDM_CACHE_STATIC ? cfg->staging_slots : s->nslots;
  s->st.prefetch_depth = s->depth;
  s->st.device_bytes = (size_t)s->nslots * cfg->expert_bytes;
  if (cfg->policy == TDM_CACHE_STATIC) {
    /* Load the resident set once, on the prefetch queue. */
    for (int i = 0; i < s->nfixed && !rc; i++) {
      int key = (cfg->resident && i < cfg->nresident) ? cfg->resident[i] : i;
      if (key < 0 || key >= keys || s->map[key] >= 0) continue;
      rc = load(s, i, key, s->prefetch);
      s->slots[i].fixed = true;
    }
    s->st.bytes_copied = 0; /* the resident set's load is not part of any pass */
    if (rc) {
      tdm_streamer_destroy(s);
      return rc;
    }
  }
  for (int i = 0; i < s->nslots; i++)
    if (!s->slots[i].fixed) s->evictable[s->nevictable++] = i;
  *out = s;
  return 0;
}

int tdm_streamer_destroy(tdm_streamer *s) {
  if (!s) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_destroy: s is NULL");
  if (s->demand) tdm_queue_sync(s->demand);
  if (s->prefetch) tdm_queue_sync(s->prefetch);
  for (int i = 0; s->slots && i < s->nslots; i++) slot_clear_events(&s->slots[i]);
  for (int i = 0; i < s->ninflight; i++) tdm_event_release(s->inflight[i]);
  for (int i = 0; i < s->ntimed; i++) {
    tdm_event_release(s->timed[i].start);
    tdm_event_release(s->timed[i].end);
  }
  if (s->t0) tdm_event_release(s->t0);
  free(s->timed);
  free(s->spans);
  if (s->base) {
    /* Readers on the compute queue may still run: free in its order. */
    if (tdm_free_async(s->cfg.compute, s->base, 0, NULL, NULL)) tdm_free(s->base);
  }
  if (s->demand) tdm_queue_destroy(s->demand);
  if (s->prefetch) tdm_queue_destroy(s->prefetch);
  pthread_mutex_destroy(&s->mu);
  free(s->slots);
  free(s->evictable);
  free(s->map);
  free(s->inflight);
  free(s);
  return 0;
}

static int key_of(tdm_streamer *s, int layer, int e) {
  if (layer < 0 || layer >= s->cfg.layers || e < 0 || e >= s->cfg.experts) return -1;
  return layer * s->cfg.experts + e;
}

int tdm_streamer_acquire(tdm_streamer *s, int layer, int e, const void **dptr,
                         tdm_event **ready) {
  if (!s || !dptr) return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_acquire: s or dptr is NULL");
  int key = key_of(s, layer, e);
  if (key < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_acquire: expert %d of layer %d does not exist",
                      e, layer);
  pthread_mutex_lock(&s->mu);
  int rc = 0, i = s->map[key];
  /* Where the expert was, counted once the acquire succeeds. A mapped slot's copy is
   * complete when its event says so now; asking never waits. */
  enum { RESIDENT, INFLIGHT, MISS } found = MISS;
  bool prefetched = false;
  if (i >= 0) {
    const slot *sl = &s->slots[i];
    found = (!sl->ready || tdm_event_query(sl->ready) == 0) ? RESIDENT : INFLIGHT;
    prefetched = sl->unused_prefetch;
  } else {
    i = victim(s, false);
    if (i < 0) {
      rc = tdm_set_error(TDM_EBUSY, 0, "all %d streamer slots are acquired: release some",
                      s->nslots);
    } else {
      rc = load(s, i, key, s->demand);
    }
  }
  slot *sl = rc ? NULL : &s->slots[i];
  if (sl) {
    sl->pins++;
    sl->last_use = ++s->tick;
    /* The compute queue waits for the copy on the device; nothing waits here. A resident
     * expert's copy is complete: no wait to add. */
    if (found != RESIDENT && sl->ready && tdm_event_query(sl->ready) != 0)
      rc = tdm_queue_wait(s->cfg.compute, sl->ready);
    if (!rc && ready) {
      if (sl->ready) {
        tdm_event_retain(sl->ready);
        *ready = sl->ready;
      } else {
        rc = tdm_event_record(s->demand, ready);
      }
    }
    if (rc) {
      sl->pins--;
    } else {
      *dptr = s->base + (size_t)i * s->cfg.expert_bytes;
      sl->unused_prefetch = false;
      s->acq_layer = layer;
      s->st.acquires++;
      if (found == MISS) {
        s->st.misses++;
      } else {
        s->st.hits++;
        if (found == RESIDENT) s->st.resident_hits++;
        else s->st.inflight_hits++;
        if (prefetched) s->st.prefetch_hits++;
      }
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
  int i = s->map[key], where = TDM_EXPERT_ABSENT;
  if (i >= 0)
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

int tdm_streamer_prefetch(tdm_streamer *s, int layer, const int *experts, int n) {
  if (!s || (n && !experts) || layer < 0 || layer >= s->cfg.layers)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_streamer_prefetch: bad arguments");
  pthread_mutex_lock(&s->mu);
  /* Forget prefetches that have landed. */
  int k = 0;
  for (int j = 0; j < s->ninflight; j++) {
    if (tdm_event_query(s->inflight[j]) == TDM_EAGAIN)
      s->inflight[k++] = s->inflight[j];
    else
      tdm_event_release(s->inflight[j]);
  }
  s->ninflight = k;
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
    if (s->map[key] >= 0) continue;
    int i = full || s->ninflight >= s->depth ? -1 : victim(s, true);
    if (i < 0) {
      full = true;
      s->st.prefetch_dropped++;
      continue;
    }
    if ((rc = load(s, i, key, s->prefetch))) break;
    s->slots[i].unused_prefetch = true;
    s->slots[i].last_use = ++s->tick;
    tdm_event_retain(s->slots[i].ready);
    s->inflight[s->ninflight++] = s->slots[i].ready;
    s->st.prefetches++;
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
  int *buf = malloc((size_t)n * 3 * sizeof *buf);
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
    if (i < 0) {
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
    int upto = (int)((long)(j + 1) * nh / m);
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
