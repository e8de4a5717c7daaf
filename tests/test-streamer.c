/* test-streamer.c: the expert streamer's hit accounting, against every backend. Each case
 * forces one outcome deterministically and checks the counters of tdm_streamer_stats:
 *
 * - a resident hit: the expert's copy is known to be complete (the copy queues synchronized)
 *   when it is acquired again;
 * - an in-flight hit: the expert's copy is held back behind a gated host task on the
 *   streamer's own copy queue (tdm_streamer_queues), a prefetch's or an earlier demand's, so
 *   it cannot have completed when the expert is acquired;
 * - a miss: an expert that is nowhere on the device is copied on demand;
 * - refused acquires count nowhere, and acquires = hits + misses,
 *   hits = resident_hits + inflight_hits throughout;
 * - tdm_streamer_ready answers 0 for an expert that is absent or still in flight and 1 once its
 *   copy has landed, and tdm_streamer_where tells the three apart; neither counts anything.
 * - a compute that fails, released as its slot's reader, frees the slot all the same, and a
 *   copy that failed because it waited for that reader is redone by the next acquire once the
 *   compute queue's sync has reported the failure;
 * - slot and key counts that would overflow (staging_slots = INT_MAX, a budget of SIZE_MAX,
 *   layers * experts past INT_MAX, slots * expert_bytes past SIZE_MAX) are capped or refused
 *   cleanly, and a prefetch depth of INT_MAX costs nothing up front.
 * Every acquired slot is read back and compared with the expert's bytes, so a counter never
 * passes while the data is wrong. Written against the public headers only.
 */
#include "harness.h"

#include <tandem/streamer.h>

#include <limits.h>

enum { XB = 32 * 1024 }; /* bytes of one expert */

typedef struct experts {
  unsigned char *host; /* pinned, n * XB, key-major */
  const void **ptrs;
  int n;
} experts;

static experts make_experts(tdm_device *dev, int n, uint64_t *rng) {
  experts x = {NULL, NULL, n};
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, (size_t)n * XB, (void **)&x.host));
  th_fill_random(x.host, (size_t)n * XB, rng);
  x.ptrs = malloc(sizeof *x.ptrs * (size_t)n);
  CHECK(x.ptrs != NULL);
  for (int k = 0; k < n; k++) x.ptrs[k] = x.host + (size_t)k * XB;
  return x;
}

static void free_experts(experts *x) {
  CHECK_OK(tdm_free(x->host));
  free(x->ptrs);
}

/* The counters, checked against the expected outcome counts and the invariants. */
static void check_stats(tdm_streamer *s, long resident, long inflight, long misses) {
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.resident_hits, resident);
  CHECK_EQ((long)st.inflight_hits, inflight);
  CHECK_EQ((long)st.misses, misses);
  CHECK_EQ((long)st.hits, resident + inflight);
  CHECK_EQ((long)st.acquires, resident + inflight + misses);
}

/* Acquires (layer 0, e), reads its slot back through the compute queue, checks the bytes,
 * and releases it (done = NULL: all work on the compute queue so far). */
static void use_expert(tdm_streamer *s, tdm_queue *q, const experts *x, int e,
                       unsigned char *back) {
  const void *w;
  tdm_event *ready = NULL;
  CHECK_OK(tdm_streamer_acquire(s, 0, e, &w, &ready));
  CHECK(ready != NULL);
  CHECK_OK(tdm_memcpy(q, back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(tdm_event_query(ready), 0);
  CHECK_OK(tdm_event_release(ready));
  CHECK_MSG(memcmp(back, x->ptrs[e], XB) == 0, "expert %d read back other bytes", e);
}

/* Both copy queues drained: every slot's copy is complete. */
static void sync_copies(tdm_streamer *s) {
  tdm_queue *demand, *prefetch;
  CHECK_OK(tdm_streamer_queues(s, &demand, &prefetch));
  CHECK_OK(tdm_queue_sync(demand));
  CHECK_OK(tdm_queue_sync(prefetch));
}

static int gate_task(void *arg) {
  CHECK(th_gate_wait(arg, TH_HANG_MS));
  return 0;
}

/* A miss, then the same expert again once its copy is known to be complete: a resident hit,
 * under LRU and under the static policy (its resident set after the creation's load). */
TEST_CASE(stats_resident_hit) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 6, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 6, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 2 * XB, .staging_slots = 1,
                             .policy = TDM_CACHE_LRU};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  check_stats(s, 0, 0, 0);
  use_expert(s, q, &x, 3, back);
  check_stats(s, 0, 0, 1);
  sync_copies(s);
  use_expert(s, q, &x, 3, back);
  check_stats(s, 1, 0, 1);
  use_expert(s, q, &x, 4, back);
  sync_copies(s);
  use_expert(s, q, &x, 4, back);
  use_expert(s, q, &x, 3, back);
  check_stats(s, 3, 0, 2);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.bytes_copied, 2L * XB);
  CHECK_OK(tdm_streamer_stats_reset(s));
  check_stats(s, 0, 0, 0);
  CHECK_OK(tdm_streamer_destroy(s));

  /* Static: the resident set is loaded at creation; once that load is complete, acquiring
   * a resident expert is a resident hit and copies nothing. */
  int resident[2] = {5, 1};
  cfg.policy = TDM_CACHE_STATIC;
  cfg.resident = resident;
  cfg.nresident = 2;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  sync_copies(s);
  use_expert(s, q, &x, 5, back);
  use_expert(s, q, &x, 1, back);
  use_expert(s, q, &x, 0, back); /* not resident: through the staging slot */
  check_stats(s, 2, 0, 1);
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.bytes_copied, 1L * XB);
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Copies held back behind a gate on the streamer's own copy queues: a prefetched expert and
 * an expert whose earlier demand copy has not landed are in-flight hits, and the data that
 * lands once the gate opens is the expert's. */
TEST_CASE(stats_inflight_hit) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 8, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 3 * (size_t)XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 8, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 2 * XB, .staging_slots = 2,
                             .policy = TDM_CACHE_LRU, .prefetch_depth = 2};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  tdm_queue *demand, *prefetch;
  CHECK_OK(tdm_streamer_queues(s, &demand, &prefetch));
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *held_p, *held_d;
  CHECK_OK(tdm_host_task(prefetch, gate_task, &gate, 0, NULL, &held_p));
  CHECK_OK(tdm_host_task(demand, gate_task, &gate, 0, NULL, &held_d));

  /* A prefetch behind the gate, acquired before it can land. Absent, then in flight: not
   * ready either way; bad input is refused. */
  int want[1] = {6};
  CHECK_EQ(tdm_streamer_ready(s, 0, 6), 0);
  CHECK_EQ(tdm_streamer_where(s, 0, 6), TDM_EXPERT_ABSENT);
  CHECK_OK(tdm_streamer_prefetch(s, 0, want, 1));
  CHECK_EQ(tdm_streamer_ready(s, 0, 6), 0);
  CHECK_EQ(tdm_streamer_where(s, 0, 6), TDM_EXPERT_INFLIGHT);
  CHECK_RC(tdm_streamer_ready(s, 0, 8), TDM_EINVAL);
  CHECK_RC(tdm_streamer_ready(s, 1, 0), TDM_EINVAL);
  CHECK_RC(tdm_streamer_ready(NULL, 0, 0), TDM_EINVAL);
  CHECK_RC(tdm_streamer_where(s, 0, 8), TDM_EINVAL);
  CHECK_RC(tdm_streamer_where(s, -1, 0), TDM_EINVAL);
  CHECK_RC(tdm_streamer_where(NULL, 0, 0), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "tdm_streamer_where") != NULL);
  const void *w6, *w2, *w2b;
  tdm_event *r6, *r2, *r2b;
  CHECK_OK(tdm_streamer_acquire(s, 0, 6, &w6, &r6));
  CHECK_EQ(tdm_event_query(r6), TDM_EAGAIN);
  check_stats(s, 0, 1, 0);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.prefetch_hits, 1L);
  CHECK_EQ((long)st.prefetches, 1L);

  /* A demand copy behind the gate; released and acquired again before it can land. */
  CHECK_OK(tdm_streamer_acquire(s, 0, 2, &w2, &r2));
  check_stats(s, 0, 1, 1);
  CHECK_EQ(tdm_streamer_where(s, 0, 2), TDM_EXPERT_INFLIGHT); /* a demand copy, held back */
  CHECK_OK(tdm_memcpy(q, back + XB, w2, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 2, NULL));
  CHECK_OK(tdm_streamer_acquire(s, 0, 2, &w2b, &r2b));
  CHECK(w2b == w2);
  CHECK_EQ(tdm_event_query(r2b), TDM_EAGAIN);
  check_stats(s, 0, 2, 1);

  /* The compute queue waits for both copies on the device: its reads see the experts. */
  CHECK_OK(tdm_memcpy(q, back, w6, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, back + 2 * (size_t)XB, w2b, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 6, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 2, NULL));
  th_gate_open(&gate);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(memcmp(back, x.ptrs[6], XB) == 0, "the prefetched expert read back other bytes");
  CHECK_MSG(memcmp(back + XB, x.ptrs[2], XB) == 0, "the demand copy read back other bytes");
  CHECK_MSG(memcmp(back + 2 * (size_t)XB, x.ptrs[2], XB) == 0,
            "the second acquire read back other bytes");
  CHECK_EQ(tdm_event_query(r6), 0);
  CHECK_EQ(tdm_event_query(r2b), 0);
  for (tdm_event **e = (tdm_event *[]){r6, r2, r2b, held_p, held_d, NULL}; *e; e++)
    CHECK_OK(tdm_event_release(*e));

  /* Landed now: ready, and the same experts are resident hits. */
  sync_copies(s);
  check_stats(s, 0, 2, 1);
  CHECK_EQ(tdm_streamer_ready(s, 0, 6), 1);
  CHECK_EQ(tdm_streamer_ready(s, 0, 2), 1);
  CHECK_EQ(tdm_streamer_ready(s, 0, 5), 0);
  CHECK_EQ(tdm_streamer_where(s, 0, 6), TDM_EXPERT_READY);
  CHECK_EQ(tdm_streamer_where(s, 0, 2), TDM_EXPERT_READY);
  CHECK_EQ(tdm_streamer_where(s, 0, 5), TDM_EXPERT_ABSENT);
  check_stats(s, 0, 2, 1); /* asking counted nothing */
  use_expert(s, q, &x, 6, back);
  use_expert(s, q, &x, 2, back);
  check_stats(s, 2, 2, 1);
  CHECK_OK(tdm_streamer_destroy(s));
  th_gate_destroy(&gate);
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Misses: every first acquire copies on demand; an acquire refused because every slot is
 * pinned counts nowhere; one staging slot and no budget turns every change of expert into a
 * miss again. */
TEST_CASE(stats_misses) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 4, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 4, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 1,
                             .policy = TDM_CACHE_STATIC};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  for (int rep = 0; rep < 2; rep++)
    for (int e = 0; e < 4; e++) use_expert(s, q, &x, e, back);
  check_stats(s, 0, 0, 8);
  const void *w;
  CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w, NULL));
  CHECK_RC(tdm_streamer_acquire(s, 0, 2, &w, NULL), TDM_EBUSY);
  CHECK_RC(tdm_streamer_acquire(s, 0, 9, &w, NULL), TDM_EINVAL);
  check_stats(s, 0, 0, 9);
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.bytes_copied, 9L * XB);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* An expert acquired twice is released twice, the later-finishing reader first: its slot is
 * overwritten only after both readers (the copy into it waits for every release's event, not
 * the last one given). One slot, so the next acquire of another expert must reuse it. */
TEST_CASE(release_waits_for_every_reader) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q, *reader;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &reader));
  experts x = make_experts(dev, 2, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, 2 * (size_t)XB, (void **)&back));
  memset(back, 0, 2 * (size_t)XB);
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 2, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 1,
                             .policy = TDM_CACHE_LRU};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  const void *w, *w2;
  CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w, NULL));
  CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w2, NULL));
  CHECK(w == w2);
  CHECK_OK(tdm_queue_sync(q)); /* the copy has landed */
  /* The slow reader: a copy out of the slot on another queue, held behind a gate. */
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *held, *slow, *fast;
  CHECK_OK(tdm_host_task(reader, gate_task, &gate, 0, NULL, &held));
  CHECK_OK(tdm_memcpy(reader, back, w, XB, TDM_COPY_D2H, 0, NULL, &slow));
  CHECK_OK(tdm_event_record(q, &fast)); /* a reader that is already done */
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_release(s, 0, 0, slow));
  CHECK_OK(tdm_streamer_release(s, 0, 0, fast));
  /* Expert 1 must wait for the slow reader before it overwrites the one slot. */
  const void *w1;
  CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w1, NULL));
  CHECK(w1 == w);
  CHECK_OK(tdm_memcpy(q, back + XB, w1, XB, TDM_COPY_D2H, 0, NULL, NULL));
  th_sleep_ms(50); /* room for a copy that would not wait */
  CHECK_EQ(tdm_event_query(slow), TDM_EAGAIN);
  th_gate_open(&gate);
  CHECK_OK(tdm_queue_sync(reader));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(memcmp(back, x.ptrs[0], XB) == 0, "the slow reader saw the slot overwritten");
  CHECK_MSG(memcmp(back + XB, x.ptrs[1], XB) == 0, "expert 1 read back other bytes");
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  for (tdm_event **e = (tdm_event *[]){held, slow, fast, NULL}; *e; e++)
    CHECK_OK(tdm_event_release(*e));
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(reader));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Acquires (l, e) of a streamer over layers of `per` experts, reads its slot back, checks
 * the bytes and releases it. */
static void use_layer_expert(tdm_streamer *s, tdm_queue *q, const experts *x, int per, int l,
                             int e, unsigned char *back) {
  const void *w;
  CHECK_OK(tdm_streamer_acquire(s, l, e, &w, NULL));
  CHECK_OK(tdm_memcpy(q, back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, l, e, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(memcmp(back, x->ptrs[l * per + e], XB) == 0, "expert %d of layer %d read back "
            "other bytes", e, l);
}

/* A prefetch for a layer below the latest acquire's starts the next pass. Two slots, two
 * layers of two experts: layer 1's expert 0 is used, its expert 1 prefetched and never
 * acquired (kept from later prefetches while layer 1 is still to come). Then the next pass
 * prefetches layer 0's experts 0 and 1 ahead of its routing: layer 1's leftover is a wrong
 * guess now, so the second prefetch takes its slot rather than the first prefetch's (by the
 * layer rule alone the first kept none, layer 0 being below layer 1, and the second evicted
 * it). Both are then hits. */
TEST_CASE(prefetch_next_pass) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 4, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 2, .experts = 2, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 2,
                             .policy = TDM_CACHE_LRU, .prefetch_depth = 4};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  use_layer_expert(s, q, &x, 2, 1, 0, back);
  CHECK_OK(tdm_streamer_prefetch(s, 1, (const int[]){1}, 1));
  sync_copies(s);
  CHECK_OK(tdm_streamer_prefetch(s, 0, (const int[]){0, 1}, 2));
  CHECK_EQ(tdm_streamer_where(s, 1, 1), (int)TDM_EXPERT_ABSENT);
  CHECK_MSG(tdm_streamer_where(s, 0, 0) != TDM_EXPERT_ABSENT &&
                tdm_streamer_where(s, 0, 1) != TDM_EXPERT_ABSENT,
            "the next pass's prefetches evicted each other (layer 0: %d and %d)",
            tdm_streamer_where(s, 0, 0), tdm_streamer_where(s, 0, 1));
  use_layer_expert(s, q, &x, 2, 0, 0, back);
  use_layer_expert(s, q, &x, 2, 0, 1, back);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.misses, 1L);
  CHECK_EQ((long)st.prefetches, 3L);
  CHECK_EQ((long)st.prefetch_hits, 2L);
  CHECK_EQ((long)st.acquires, 3L);
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A compute that fails on purpose (a host task on the compute queue that reads nothing). */
static int task_fail(void *arg) {
  if (arg) CHECK(th_gate_wait(arg, TH_HANG_MS));
  return tdm_set_error(TDM_ETASK, 0, "a compute that fails on purpose");
}

/* A release whose event is a failed compute's, with one slot, so every other expert reuses it.
 * First the failure has completed when the slot is reused: the copy does not wait for it, and
 * works. Then it is still pending: the copy waits for it and fails with it, and once the
 * compute queue's sync has reported the failure, the expert is copied again, and so are the
 * others, each with its own bytes. */
TEST_CASE(failed_reader_does_not_poison) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 3, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 3, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 1,
                             .policy = TDM_CACHE_LRU};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  const void *w;
  tdm_event *bad;
  CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w, NULL));
  CHECK_OK(tdm_host_task(q, task_fail, NULL, 0, NULL, &bad));
  CHECK_OK(tdm_streamer_release(s, 0, 0, bad));
  CHECK_STATUS(tdm_queue_sync(q), TDM_ETASK);
  CHECK_OK(tdm_event_release(bad));
  use_expert(s, q, &x, 1, back); /* reuses the failed reader's slot */
  use_expert(s, q, &x, 0, back);

  th_gate gate;
  th_gate_init(&gate);
  CHECK_OK(tdm_streamer_acquire(s, 0, 2, &w, NULL));
  CHECK_OK(tdm_host_task(q, task_fail, &gate, 0, NULL, &bad));
  CHECK_OK(tdm_streamer_release(s, 0, 2, bad));
  CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w, NULL)); /* its copy waits for the failing reader */
  CHECK_OK(tdm_memcpy(q, back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  th_gate_open(&gate);
  CHECK_STATUS(tdm_queue_sync(q), TDM_ETASK);
  CHECK_OK(tdm_event_release(bad));
  th_gate_destroy(&gate);
  CHECK_EQ(tdm_streamer_where(s, 0, 1), TDM_EXPERT_ABSENT); /* its copy failed */
  CHECK_EQ(tdm_streamer_ready(s, 0, 1), 0);
  use_expert(s, q, &x, 1, back);
  use_expert(s, q, &x, 2, back);
  use_expert(s, q, &x, 1, back);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.acquires, 8L);
  CHECK_EQ((long)st.misses, 8L); /* one slot: every acquire a miss, the redone copy too */
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A streamer over x's 4 experts that must be created: its counts, and every expert read back. */
static void check_created(tdm_streamer_config cfg, tdm_queue *q, const experts *x,
                          unsigned char *back, int resident, int staging, int depth) {
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ(st.resident_slots, resident);
  CHECK_EQ(st.staging_slots, staging);
  CHECK_EQ(st.prefetch_depth, depth);
  CHECK_EQ((long)st.device_bytes, (long)(cfg.policy == TDM_CACHE_STATIC ? resident + staging
                                                                      : staging) * XB);
  CHECK_OK(tdm_streamer_prefetch(s, 0, (const int[]){0, 1, 2, 3}, 4));
  for (int e = 0; e < 4; e++) use_expert(s, q, x, e, back);
  CHECK_OK(tdm_streamer_destroy(s));
}

/* More prefetches in flight than slots, which only copies of evicted prefetches make: two
 * layers of two experts through one slot, the prefetch queue held back by a gate. */
static void check_inflight_grows(tdm_queue *q, const experts *x, unsigned char *back) {
  tdm_streamer_config cfg = {.compute = q, .layers = 2, .experts = 2, .expert_bytes = XB,
                             .host = x->ptrs, .staging_slots = 1, .policy = TDM_CACHE_LRU,
                             .prefetch_depth = INT_MAX};
  tdm_streamer *s;
  tdm_queue *pq;
  tdm_event *held;
  th_gate gate;
  th_gate_init(&gate);
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  CHECK_OK(tdm_streamer_queues(s, NULL, &pq));
  CHECK_OK(tdm_host_task(pq, gate_task, &gate, 0, NULL, &held));
  const void *w;
  for (int round = 0; round < 3; round++) {
    CHECK_OK(tdm_streamer_prefetch(s, 1, (const int[]){1}, 1)); /* in flight, held back */
    CHECK_OK(tdm_streamer_acquire(s, 1, 0, &w, NULL)); /* evicts it */
    CHECK_OK(tdm_streamer_release(s, 1, 0, NULL));
  }
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.prefetches, 3L);
  th_gate_open(&gate);
  CHECK_OK(tdm_event_wait(held));
  CHECK_OK(tdm_event_release(held));
  th_gate_destroy(&gate);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_acquire(s, 1, 1, &w, NULL));
  CHECK_OK(tdm_memcpy(q, back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 1, 1, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(memcmp(back, x->ptrs[3], XB) == 0, "expert 1 of layer 1 read back other bytes");
  CHECK_OK(tdm_streamer_destroy(s));
}

/* Counts whose sums or products would overflow: capped where more could never be used,
 * refused (TDM_EINVAL, TDM_ENOMEM, with a message) where they cannot be met. */
TEST_CASE(create_counts_do_not_overflow) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 4, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 4, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = XB, .staging_slots = INT_MAX,
                             .policy = TDM_CACHE_STATIC};
  /* Staging slots past the experts are not made (1 resident + INT_MAX overflowed an int). */
  check_created(cfg, q, &x, back, 1, 4, 4);
  cfg.policy = TDM_CACHE_LRU;
  cfg.budget_bytes = 0;
  check_created(cfg, q, &x, back, 0, 4, 4);
  /* A budget of SIZE_MAX holds every expert, once each. */
  cfg.policy = TDM_CACHE_STATIC;
  cfg.budget_bytes = SIZE_MAX;
  cfg.staging_slots = 1;
  check_created(cfg, q, &x, back, 4, 1, 1);
  /* A depth of INT_MAX: the in-flight list grows as prefetches need it. */
  cfg.budget_bytes = 0;
  cfg.staging_slots = 4;
  cfg.prefetch_depth = INT_MAX;
  check_created(cfg, q, &x, back, 0, 4, INT_MAX);
  check_inflight_grows(q, &x, back);
  cfg.prefetch_depth = 0;

  tdm_streamer *s = (tdm_streamer *)(uintptr_t)0x5e;
  cfg.layers = INT_MAX; /* layers * experts keys past INT_MAX */
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL);
  cfg.layers = 1 << 16;
  cfg.experts = 1 << 16;
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL);
  cfg.layers = 1;
  cfg.experts = 4;
  cfg.expert_bytes = SIZE_MAX / 2; /* 4 slots of it: past SIZE_MAX */
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_ENOMEM);
  CHECK(strstr(tdm_last_error(), "slots") != NULL);
  CHECK(s == (tdm_streamer *)(uintptr_t)0x5e);
  cfg.expert_bytes = XB;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  CHECK_RC(tdm_streamer_prefetch(s, 0, (const int[]){0}, -1), TDM_EINVAL);
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A compute queue destroyed before the streamer has drained: the slots are freed at once, and
 * nothing is left allocated. */
TEST_CASE(destroy_after_compute_queue) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  experts x = make_experts(dev, 2, &rng);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  tdm_stats before, after;
  CHECK_OK(tdm_stats_get(&before));
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 2, .expert_bytes = XB,
                             .host = x.ptrs, .staging_slots = 1, .policy = TDM_CACHE_LRU};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  use_expert(s, q, &x, 1, back);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_stats_get(&after));
  CHECK_EQ(after.allocations, before.allocations);
  CHECK_OK(tdm_free(back));
  free_experts(&x);
  th_close();
}
