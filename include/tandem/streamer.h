/* tandem/streamer.h: the expert streamer. It keeps a Mixture-of-Experts model's experts in
 * pinned host memory and copies the ones asked for into device slots, on copy queues of its
 * own, while the compute queue works:
 * - tdm_streamer_acquire(layer, e) returns the expert's device copy and makes the compute queue
 *   wait for it device-side (the caller's thread never blocks), so compute on expert j can run
 *   while expert j+1 is still on the wire;
 * - tdm_streamer_release(layer, e, done) says which compute event last reads it: its slot is
 *   overwritten only after that event (the copy queue waits for it device-side);
 * - tdm_streamer_prefetch(layer, experts) starts copies ahead of the acquires (look-ahead);
 *   demand misses go on a queue of their own, so they never wait behind prefetches, and at
 *   most prefetch_depth prefetches are in flight.
 * The device holds `budget_bytes` of experts that may stay resident between uses, plus
 * `staging_slots` slots that always exist (so a budget of 0 still streams through them).
 * Policies: TDM_CACHE_STATIC keeps a fixed set resident (the right choice for prefill's
 * cyclic scans); TDM_CACHE_LRU uses every slot as one least-recently-used cache (decode).
 * Only experts asked for are copied; the copies are whole experts.
 * Failures: a release's event that fails frees its slot all the same once it has completed.
 * A copy that fails (a device error, or a reader it waited for that failed) is reported to
 * what waited for it (the compute queue, *ready); the next acquire or prefetch of the expert
 * that no acquire holds copies it again, so once tdm_queue_sync has reported the error the
 * expert works again.
 * Every call is thread safe; an acquire/release pair may come from different threads.
 */
#ifndef TANDEM_STREAMER_H
#define TANDEM_STREAMER_H

#include <stdbool.h>

#include "../tandem.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_streamer tdm_streamer;

typedef enum tdm_cache_policy {
  TDM_CACHE_STATIC = 0, /* a fixed set stays resident; the others stream through staging slots */
  TDM_CACHE_LRU = 1     /* every slot is one LRU cache */
} tdm_cache_policy;

typedef struct tdm_streamer_config {
  tdm_queue *compute;       /* consumes the experts; its device holds the slots (borrowed) */
  int layers, experts;      /* experts are keyed by layer * experts + e */
  size_t expert_bytes;      /* bytes of one expert (all are equal) */
  const void *const *host;  /* host[key]: the expert in pinned or registered host memory; the
                               array and the memory must outlive the streamer */
  size_t budget_bytes;      /* device memory for experts that may stay resident */
  int staging_slots;        /* >= 1 slots that always exist, besides the budget (more than
                               layers * experts are not made: they could never be used) */
  tdm_cache_policy policy;
  const int *resident;      /* TDM_CACHE_STATIC: keys to keep resident, best first (NULL: key
                               order); as many as the budget holds are loaded at creation */
  int nresident;
  int prefetch_depth;       /* prefetch copies in flight at most (0: staging_slots) */
  bool time_copies;         /* time every copy on the device (link_busy_seconds): the copy
                               queues are TDM_QUEUE_TIMING (which costs them lazy completion)
                               and each copy is preceded by a timed marker, after what it
                               waits for, so its interval is the copy's own */
} tdm_streamer_config;

/* What the acquires found. Every successful acquire counts once, in exactly one of
 * resident_hits, inflight_hits and misses, so acquires = hits + misses and
 * hits = resident_hits + inflight_hits; a refused acquire (TDM_EBUSY, bad input) counts nowhere.
 * Whether an expert's copy is complete is asked of the copy's event (tdm_event_query) at the
 * acquire, so the answer never waits; a copy that failed counts as not complete.
 * The cache hit rate is resident_hits / acquires. hits / acquires is "resident or in flight":
 * an expert prefetched just before its acquire counts there although it was copied for this
 * use, so it says nothing of the bytes moved. Those are bytes_copied, which counts every copy
 * (demand and prefetch alike, used or not); the link bounds a workload by them, not by misses.
 * `tandem moe` reports these same figures (resident, in flight, miss, bytes copied). */
typedef struct tdm_streamer_stats {
  uint64_t acquires;
  uint64_t hits;          /* resident_hits + inflight_hits, kept for older callers */
  uint64_t misses;        /* not on the device nor on its way: a demand copy was made */
  uint64_t resident_hits; /* on the device with its copy complete: a cache hit, nothing waits */
  uint64_t inflight_hits; /* in a slot whose copy was still in flight (a prefetch's, an earlier
                             demand's, or the static resident set's first load): no new copy,
                             but the compute queue waits for that one */
  uint64_t prefetches, prefetch_hits, prefetch_dropped; /* issued, then acquired, over depth */
  uint64_t bytes_copied;           /* expert bytes copied host-to-device */
  int resident_slots, staging_slots;
  int prefetch_depth;              /* prefetch copies in flight at most */
  size_t device_bytes;             /* device memory the slots take */
  double link_busy_seconds;        /* time_copies: how long at least one copy was on the link,
                                      by the device's timestamps, over the copies completed by
                                      this call since the last reset; 0 otherwise */
} tdm_streamer_stats;

/* The caller owns the streamer. Creating it allocates the slots and, with TDM_CACHE_STATIC,
 * starts loading the resident set. A budget or slot count that cannot hold one expert, or
 * device memory too small: TDM_EINVAL / TDM_ENOMEM with the reason. */
TDM_API TDM_NODISCARD int tdm_streamer_create(const tdm_streamer_config *cfg,
                                              tdm_streamer **out);
/* Waits for the streamer's copies, then frees it, whatever it returns: a step that fails (a
 * copy queue's destroy, the slots' free in the compute queue's order) is retried another way
 * or skipped, and the first failure is returned with its message. The slots are never freed
 * while the compute queue or a copy may still use them; they are left allocated (and that is
 * said) only if no way to wait for that works. Acquired experts must have been released. */
TDM_API int tdm_streamer_destroy(tdm_streamer *s);
/* Makes expert (layer, e) available on the device: *dptr is its device copy, valid for work
 * submitted to the compute queue after this call (the compute queue is made to wait for the
 * copy device-side). *ready (optional; a new reference) completes when the copy has landed.
 * The slot stays pinned until tdm_streamer_release. Every slot pinned: TDM_EBUSY. */
TDM_API TDM_NODISCARD int tdm_streamer_acquire(tdm_streamer *s, int layer, int e,
                                               const void **dptr, tdm_event **ready);
/* Unpins expert (layer, e); its slot may be overwritten once `done` completes (NULL: once all
 * work submitted to the compute queue so far completes; an event is recorded for it only if
 * the slot can be overwritten at all, not for the static resident set). tandem keeps its own
 * reference. An expert acquired n times (by several threads, say) is released n times, in any
 * order: its slot is overwritten only after every release's event. */
TDM_API TDM_NODISCARD int tdm_streamer_release(tdm_streamer *s, int layer, int e,
                                               tdm_event *done);
/* Whether expert (layer, e) is on the device with its copy complete, so that an acquire now
 * would find it resident and make the compute queue wait for nothing: 1 yes, 0 no (not on
 * the device, or its copy still in flight), a negative TDM_E* code for bad input. It never
 * waits and counts nowhere; a copy in flight may land just after it answers. A caller that
 * batches work uses it to submit what is ready before acquiring what is not. */
TDM_API int tdm_streamer_ready(tdm_streamer *s, int layer, int e);
/* Where expert (layer, e) is now, as tdm_streamer_where answers it. */
typedef enum tdm_expert_where {
  TDM_EXPERT_ABSENT = 0,   /* in no slot, or in one whose copy failed and that no acquire
                              holds: an acquire would copy it on demand */
  TDM_EXPERT_INFLIGHT = 1, /* in a slot whose copy has not landed (a prefetch's, a demand's):
                              an acquire would copy nothing but make the compute queue wait */
  TDM_EXPERT_READY = 2     /* in a slot with its copy complete: what tdm_streamer_ready calls 1 */
} tdm_expert_where;
/* Where expert (layer, e) is: a tdm_expert_where (>= 0), or a negative TDM_E* code for bad
 * input. Like tdm_streamer_ready it never waits and counts nowhere, and the answer may be
 * stale at once (a copy in flight lands, a slot is overwritten by a later acquire). A caller
 * that can compute an expert elsewhere uses it to tell the experts that would cost a new copy
 * (absent) from those already paid for (in flight or ready). */
TDM_API int tdm_streamer_where(tdm_streamer *s, int layer, int e);
/* Starts copying the listed experts of `layer` that are not on the device yet, on the
 * prefetch queue, up to prefetch_depth in flight; the rest are dropped (counted). A prefetched
 * expert not acquired yet keeps its slot from later prefetches while its layer is still to
 * come, i.e. not below the layer of the latest acquire; once a later layer has been acquired
 * it was a wrong guess, and its slot goes back to the cache like any other. A prefetch for a
 * layer below the latest acquire's starts the next pass (say, layer 0's copies started
 * before its routing is known): layers count from it from then on, and every prefetched
 * expert not acquired so far counts as a wrong guess. */
TDM_API TDM_NODISCARD int tdm_streamer_prefetch(tdm_streamer *s, int layer, const int *experts,
                                                int n);
/* Orders the listed experts of `layer` for computing, in place, so that compute keeps busy
 * while copies land and every copy starts as early as it can: first the staged experts, in
 * the order they were last copied or used (under TDM_CACHE_STATIC those in staging slots;
 * under TDM_CACHE_LRU those prefetched and not acquired yet), so their slots free up first;
 * then the experts still to be copied, in the order given, with the experts held on the
 * device (the static resident set; under TDM_CACHE_LRU the other cached ones) spread evenly in
 * front of them, so the compute queue works on those while each copy lands. The result is a
 * permutation of the input; the order changes speed, never results. Bad input (an expert or
 * layer that does not exist): TDM_EINVAL, the list untouched. */
TDM_API int tdm_streamer_schedule(tdm_streamer *s, int layer, int *experts, int n);
/* The streamer's copy queues (borrowed, valid as long as the streamer): demand misses, and
 * prefetches. Work may be ordered against them with tdm_queue_wait, e.g. to serialize copies
 * after compute for a baseline. */
TDM_API int tdm_streamer_queues(tdm_streamer *s, tdm_queue **demand, tdm_queue **prefetch);
TDM_API int tdm_streamer_stats_get(tdm_streamer *s, tdm_streamer_stats *out);
/* Zeroes the counters (not the slots). */
TDM_API int tdm_streamer_stats_reset(tdm_streamer *s);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_STREAMER_H */
