/* test-moe.c: the expert streamer and the MoE layers, against every backend that has MoE
 * operations (others skip). Written against the public headers only.
 *
 * - streamed output is bitwise equal to the all-resident output, with and without overlap,
 *   for every cache policy, budget and slot count;
 * - the slot-reuse hazard: two slots, many experts, slow compute: no compute ever reads a
 *   half-written or replaced expert;
 * - prefetch depth, LRU hits, statistics; a pass's counts: resident, in flight, demand miss;
 * - host placement: HOST computes every decode expert that is not on the device on the host
 *   (nothing copied for them) and AUTO a calibrated share, within a relative L2 tolerance of
 *   the all-resident output (bitwise on a CPU device, where host and device run the same
 *   kernel), with counts that add up; DEVICE changes nothing (the bitwise case above); the
 *   host pool's size, by default and asked for;
 * - bad input: unknown preset, budgets and slot counts that cannot hold an expert, host
 *   memory too small for a preset, a host device that is not a CPU device, negative host
 *   queues.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include "harness.h"

#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tandem/moe.h>
#include <tandem/moe_ops.h>
#include <tandem/streamer.h>

/* ---- the streamer on its own ------------------------------------------------------------- */

enum { XB = 64 * 1024 }; /* expert bytes in the streamer tests */

struct experts {
  int layers, n;
  unsigned char *host; /* pinned, layers * n * XB */
  const void **ptrs;
};

static struct experts make_experts(tdm_device *dev, int layers, int n, uint64_t *rng) {
  struct experts x = {layers, n, NULL, NULL};
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, (size_t)layers * n * XB, (void **)&x.host));
  th_fill_random(x.host, (size_t)layers * n * XB, rng);
  x.ptrs = malloc(sizeof *x.ptrs * (size_t)layers * n);
  for (int k = 0; k < layers * n; k++) x.ptrs[k] = x.host + (size_t)k * XB;
  return x;
}

static void free_experts(struct experts *x) {
  CHECK_OK(tdm_free(x->host));
  free(x->ptrs);
}

static int slow_task(void *arg) {
  th_sleep_ms((long)(intptr_t)arg);
  return 0;
}

/* Two staging slots, 24 experts, a compute queue that is slow to read each one: every read
 * (a device-to-device copy of the slot, after a sleeping host task) must see the whole expert
 * that was acquired, never a half-written or a later one. */
TEST_CASE(slot_reuse_hazard) {
  enum { N = 24, ROUNDS = 3 };
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 1, N, &rng);
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = N, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 2,
                             .policy = TDM_CACHE_LRU};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  unsigned char *seen;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)N * ROUNDS * XB, (void **)&seen));
  int order[N * ROUNDS];
  for (int r = 0, i = 0; r < ROUNDS; r++)
    for (int e = 0; e < N; e++, i++) order[i] = (int)((e * 7 + r * 5) % N);
  for (int i = 0; i < N * ROUNDS; i++) {
    const void *w;
    /* Prefetch the next ones too, so copies race with the slow reads. */
    int next[2] = {order[(i + 1) % (N * ROUNDS)], order[(i + 2) % (N * ROUNDS)]};
    CHECK_OK(tdm_streamer_prefetch(s, 0, next, 2));
    CHECK_OK(tdm_streamer_acquire(s, 0, order[i], &w, NULL));
    CHECK_OK(tdm_host_task(q, slow_task, (void *)(intptr_t)2, 0, NULL, NULL));
    tdm_event *read;
    CHECK_OK(tdm_memcpy(q, seen + (size_t)i * XB, w, XB, TDM_COPY_D2D, 0, NULL, &read));
    CHECK_OK(tdm_streamer_release(s, 0, order[i], read));
    CHECK_OK(tdm_event_release(read));
  }
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, (size_t)N * ROUNDS * XB, (void **)&back));
  CHECK_OK(tdm_memcpy(q, back, seen, (size_t)N * ROUNDS * XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  for (int i = 0; i < N * ROUNDS; i++)
    CHECK_MSG(memcmp(back + (size_t)i * XB, x.ptrs[order[i]], XB) == 0,
              "read %d of expert %d saw other bytes: a slot was overwritten under its reader", i,
              order[i]);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.acquires, (long)(N * ROUNDS));
  CHECK(st.bytes_copied >= (uint64_t)N * XB);
  CHECK_OK(tdm_streamer_destroy(s));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(seen));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* LRU keeps what is reused; prefetches beyond the depth are dropped and counted; a static
 * resident set is never copied again. */
TEST_CASE(cache_and_prefetch) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 2, 8, &rng);
  tdm_streamer_config cfg = {.compute = q, .layers = 2, .experts = 8, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 2 * XB, .staging_slots = 2,
                             .policy = TDM_CACHE_LRU, .prefetch_depth = 1};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  const void *w;
  for (int rep = 0; rep < 5; rep++)
    for (int e = 0; e < 3; e++) {
      CHECK_OK(tdm_streamer_acquire(s, 1, e, &w, NULL));
      CHECK_OK(tdm_streamer_release(s, 1, e, NULL));
    }
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.misses, 3L);  /* 4 slots hold the 3 reused experts */
  CHECK_EQ((long)st.hits, 12L);
  CHECK_OK(tdm_streamer_stats_reset(s));
  int want[4] = {4, 5, 6, 7};
  CHECK_OK(tdm_streamer_prefetch(s, 0, want, 4));
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK(st.prefetches >= 1);
  CHECK(st.prefetches + st.prefetch_dropped == 4);
  CHECK_RC(tdm_streamer_acquire(s, 2, 0, &w, NULL), TDM_EINVAL); /* no layer 2 */
  CHECK_RC(tdm_streamer_release(s, 0, 3, NULL), TDM_ESTATE);     /* never acquired */
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_destroy(s));

  /* Static: the resident set is loaded once, at creation, and only staging slots copy. */
  int resident[2] = {8 + 1, 8 + 2};
  tdm_streamer_config sc = cfg;
  sc.policy = TDM_CACHE_STATIC;
  sc.resident = resident;
  sc.nresident = 2;
  CHECK_OK(tdm_streamer_create(&sc, &s));
  for (int rep = 0; rep < 3; rep++)
    for (int e = 1; e <= 2; e++) {
      CHECK_OK(tdm_streamer_acquire(s, 1, e, &w, NULL));
      CHECK_OK(tdm_streamer_release(s, 1, e, NULL));
    }
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.bytes_copied, 0L);
  CHECK_EQ((long)st.resident_slots, 2L);
  /* Non-resident experts stream through the one staging slot: the resident ones are never
   * chosen to be overwritten, however often the staging slot is reused. */
  for (int rep = 0; rep < 2; rep++)
    for (int e = 3; e < 8; e++) {
      CHECK_OK(tdm_streamer_acquire(s, 1, e, &w, NULL));
      CHECK_OK(tdm_streamer_release(s, 1, e, NULL));
    }
  for (int e = 1; e <= 2; e++) {
    CHECK_OK(tdm_streamer_acquire(s, 1, e, &w, NULL));
    CHECK_OK(tdm_streamer_release(s, 1, e, NULL));
  }
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.bytes_copied, 10L * XB);
  CHECK_EQ((long)st.hits, 6L + 2L);
  CHECK_OK(tdm_streamer_destroy(s));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A prefetch depth above the staging slots: the slots bound the copies, a call stops at the
 * first expert with no slot (the rest are counted as dropped), and slots freed by acquire and
 * release take the next prefetches. */
TEST_CASE(prefetch_depth_over_slots) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 1, 8, &rng);
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 8, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 2,
                             .policy = TDM_CACHE_STATIC, .prefetch_depth = 8};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  tdm_streamer_stats st;
  int want[6] = {0, 1, 2, 3, 4, 5};
  CHECK_OK(tdm_streamer_prefetch(s, 0, want, 6));
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ(st.prefetch_depth, 8);
  CHECK_EQ((long)st.prefetches, 2L);
  CHECK_EQ((long)st.prefetch_dropped, 4L);
  unsigned char *back;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, XB, (void **)&back));
  for (int e = 0; e < 6; e++) {
    const void *w;
    CHECK_OK(tdm_streamer_acquire(s, 0, e, &w, NULL));
    CHECK_OK(tdm_memcpy(q, back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_MSG(memcmp(back, x.ptrs[e], XB) == 0, "expert %d read back other bytes", e);
    CHECK_OK(tdm_streamer_prefetch(s, 0, want + e + 1, 5 - e));
  }
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.misses, 0L); /* every expert was prefetched before it was asked for */
  CHECK_EQ((long)st.prefetches, 6L);
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_streamer_destroy(s));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A prefetched expert that was never acquired keeps its slot from later prefetches only while
 * its layer is to come: once a later layer is acquired, the next prefetches take its slot
 * (least recently used first) instead of being dropped. Three staging slots, no budget. */
TEST_CASE(stale_prefetch_evicted) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 2, 8, &rng);
  tdm_streamer_config cfg = {.compute = q, .layers = 2, .experts = 8, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 0, .staging_slots = 3,
                             .policy = TDM_CACHE_LRU, .prefetch_depth = 8};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  int guess[2] = {0, 1}, next[2] = {3, 4};
  CHECK_OK(tdm_streamer_prefetch(s, 0, guess, 2)); /* layer 0's guesses, never acquired */
  const void *w;
  CHECK_OK(tdm_streamer_acquire(s, 1, 2, &w, NULL)); /* layer 1: the third slot */
  CHECK_OK(tdm_streamer_release(s, 1, 2, NULL));
  CHECK_OK(tdm_streamer_prefetch(s, 1, next, 2));
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.prefetches, 4L);
  CHECK_EQ((long)st.prefetch_dropped, 0L);
  /* The guesses are gone and layer 1's three experts are on the device. */
  CHECK_EQ(tdm_streamer_where(s, 0, 0), TDM_EXPERT_ABSENT);
  CHECK_EQ(tdm_streamer_where(s, 0, 1), TDM_EXPERT_ABSENT);
  for (int e = 2; e <= 4; e++) CHECK(tdm_streamer_where(s, 1, e) != TDM_EXPERT_ABSENT);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_destroy(s));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* time_copies: every copy is timed on the device, and link_busy_seconds is how long at least
 * one was on the link: above 0 once copies have landed, at most the wall time around them, 0
 * again after a reset, and 0 throughout without time_copies. Copies of 4 MiB, on demand and
 * prefetched, so both queues carry some. */
TEST_CASE(timed_copies) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  enum { BIG = 4 << 20, N = 6 };
  unsigned char *host;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, (size_t)N * BIG, (void **)&host));
  th_fill_random(host, (size_t)N * BIG, &rng);
  const void *ptrs[N];
  for (int e = 0; e < N; e++) ptrs[e] = host + (size_t)e * BIG;
  for (int timed = 0; timed < 2; timed++) {
    tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = N, .expert_bytes = BIG,
                               .host = ptrs, .budget_bytes = 0, .staging_slots = N,
                               .policy = TDM_CACHE_LRU, .time_copies = timed};
    tdm_streamer *s;
    CHECK_OK(tdm_streamer_create(&cfg, &s));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int pre[3] = {3, 4, 5};
    CHECK_OK(tdm_streamer_prefetch(s, 0, pre, 3));
    for (int e = 0; e < N; e++) {
      const void *w;
      CHECK_OK(tdm_streamer_acquire(s, 0, e, &w, NULL));
      CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
    }
    CHECK_OK(tdm_queue_sync(q));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double wall = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    tdm_streamer_stats st;
    CHECK_OK(tdm_streamer_stats_get(s, &st));
    CHECK_EQ((long)st.bytes_copied, (long)N * BIG);
    if (timed)
      CHECK_MSG(st.link_busy_seconds > 0 && st.link_busy_seconds <= wall,
                "link busy %g s of %g s", st.link_busy_seconds, wall);
    else
      CHECK(st.link_busy_seconds == 0);
    CHECK_OK(tdm_streamer_stats_reset(s));
    CHECK_OK(tdm_streamer_stats_get(s, &st));
    CHECK(st.link_busy_seconds == 0);
    CHECK_OK(tdm_streamer_destroy(s));
  }
  CHECK_OK(tdm_free(host));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* The compute order: staged experts first in the order of their copies, then the ones still
 * to copy in the order given, with the resident ones spread in front of them; always a
 * permutation; bad input leaves the list as it was. */
TEST_CASE(schedule_order) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 2, 12, &rng);
  int resident[6] = {0, 1, 2, 3, 4, 5};
  tdm_streamer_config cfg = {.compute = q, .layers = 2, .experts = 12, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = 6 * XB, .staging_slots = 2,
                             .policy = TDM_CACHE_STATIC, .resident = resident, .nresident = 6,
                             .prefetch_depth = 2};
  tdm_streamer *s;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  int ahead[2] = {9, 8};
  CHECK_OK(tdm_streamer_prefetch(s, 0, ahead, 2));
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.prefetches, 2L);
  int order[12], want[12] = {9, 0, 1, 8, 2, 6, 3, 7, 4, 10, 5, 11};
  for (int e = 0; e < 12; e++) order[e] = e;
  CHECK_OK(tdm_streamer_schedule(s, 0, order, 12));
  for (int i = 0; i < 12; i++)
    CHECK_MSG(order[i] == want[i], "position %d: expert %d, expected %d", i, order[i], want[i]);
  /* Layer 1 has nothing on the device: the order stays as given. */
  int l1[5] = {4, 2, 7, 0, 11};
  CHECK_OK(tdm_streamer_schedule(s, 1, l1, 5));
  CHECK(l1[0] == 4 && l1[1] == 2 && l1[2] == 7 && l1[3] == 0 && l1[4] == 11);
  /* Bad input: an expert or layer that does not exist; the list is untouched. */
  int bad[3] = {3, 12, 1};
  CHECK_RC(tdm_streamer_schedule(s, 0, bad, 3), TDM_EINVAL);
  CHECK(bad[0] == 3 && bad[1] == 12 && bad[2] == 1);
  CHECK_RC(tdm_streamer_schedule(s, 2, order, 12), TDM_EINVAL);
  CHECK_RC(tdm_streamer_schedule(s, 0, NULL, 2), TDM_EINVAL);
  CHECK_OK(tdm_streamer_schedule(s, 0, NULL, 0));
  /* After acquires and releases, a random list comes back a permutation of itself. */
  for (int i = 0; i < 2; i++) {
    const void *w;
    CHECK_OK(tdm_streamer_acquire(s, 0, ahead[i], &w, NULL));
    CHECK_OK(tdm_streamer_release(s, 0, ahead[i], NULL));
  }
  int perm[12], seen[12] = {0};
  for (int e = 0; e < 12; e++) perm[e] = e;
  for (int e = 11; e > 0; e--) {
    int j = (int)th_rand_below(&rng, (uint64_t)e + 1), t = perm[e];
    perm[e] = perm[j];
    perm[j] = t;
  }
  CHECK_OK(tdm_streamer_schedule(s, 0, perm, 12));
  for (int i = 0; i < 12; i++) seen[perm[i]]++;
  for (int e = 0; e < 12; e++) CHECK_EQ(seen[e], 1);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_streamer_destroy(s));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(streamer_bad_input) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  struct experts x = make_experts(dev, 1, 4, &rng);
  tdm_streamer_config cfg = {.compute = q, .layers = 1, .experts = 4, .expert_bytes = XB,
                             .host = x.ptrs, .budget_bytes = XB / 2, .staging_slots = 1};
  tdm_streamer *s = (tdm_streamer *)&cfg;
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL); /* budget below one expert */
  CHECK(strstr(tdm_last_error(), "cannot hold") != NULL);
  CHECK(s == (tdm_streamer *)&cfg);
  cfg.budget_bytes = 0;
  cfg.staging_slots = 0;
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "staging slot") != NULL);
  cfg.staging_slots = 1;
  cfg.prefetch_depth = -1;
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "prefetch depth") != NULL);
  cfg.prefetch_depth = 0;
  cfg.host = NULL;
  CHECK_RC(tdm_streamer_create(&cfg, &s), TDM_EINVAL);
  /* Every slot acquired: the next acquire says so instead of waiting forever. */
  cfg.host = x.ptrs;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  const void *w;
  CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w, NULL));
  CHECK_RC(tdm_streamer_acquire(s, 0, 1, &w, NULL), TDM_EBUSY);
  CHECK_OK(tdm_streamer_release(s, 0, 0, NULL));
  CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  /* Every refusal says why. */
  int bad[1] = {4};
  tdm_streamer_stats st;
  CHECK_RC(tdm_streamer_acquire(s, 0, 4, &w, NULL), TDM_EINVAL);
  CHECK_RC(tdm_streamer_acquire(s, 0, 0, NULL, NULL), TDM_EINVAL);
  CHECK_RC(tdm_streamer_release(s, 1, 0, NULL), TDM_EINVAL);
  CHECK_RC(tdm_streamer_release(s, 0, 1, NULL), TDM_ESTATE); /* released already */
  CHECK_RC(tdm_streamer_prefetch(s, 0, bad, 1), TDM_EINVAL);
  CHECK_RC(tdm_streamer_prefetch(s, 1, bad, 0), TDM_EINVAL);
  CHECK_RC(tdm_streamer_stats_get(s, NULL), TDM_EINVAL);
  CHECK_RC(tdm_streamer_stats_get(NULL, &st), TDM_EINVAL);
  CHECK_RC(tdm_streamer_stats_reset(NULL), TDM_EINVAL);
  CHECK_RC(tdm_streamer_destroy(NULL), TDM_EINVAL);
  CHECK_OK(tdm_streamer_destroy(s));
  free_experts(&x);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- the MoE layers ---------------------------------------------------------------------- */

static tdm_moe_model *make_model(tdm_device *dev, const tdm_moe_config *base, bool resident,
                                 size_t budget, int slots, tdm_cache_policy policy) {
  tdm_moe_config c = *base;
  /* The look-ahead predictor with the LRU policy (decode's), so both paths are covered. */
  c.predict = policy == TDM_CACHE_LRU;
  c.all_resident = resident;
  c.budget_bytes = budget;
  c.staging_slots = slots;
  c.policy = policy;
  tdm_moe_model *m = NULL;
  int rc = tdm_moe_model_create(&c, &m);
  if (rc == TDM_ENOTSUP) TH_SKIP("no MoE operations on %s: %s", th_device_id, tdm_last_error());
  CHECK_OK(rc);
  return m;
}

/* The streamed output is bitwise equal to the all-resident output on the same backend: same
 * kernels, deterministic reductions, whatever the budget, slots, policy, overlap and (under
 * LRU, with the predictor) how many layers the look-ahead predicts: 1, 2 or 3. Three
 * sizes of ubatch: 48 tokens (a GEMM per expert), then 5 and decode's 1 (experts in groups;
 * all resident, the routing stays on the device, which a budget of every expert also gives).
 * The 48-token ubatch runs twice, so that the second pass starts layer 0's copies at once. */
TEST_CASE(streamed_equals_resident) {
  tdm_device *dev = th_open();
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  CHECK(p != NULL);
  enum { T = 48, SMALL = 5, DECODE = 6 };
  tdm_moe_config base = {.preset = p, .device = dev, .seed = th_seed(), .skew = 1.2,
                         .locality = 0.7, .max_tokens = T};
  size_t H = (size_t)p->hidden, eb = tdm_moe_expert_bytes(p);
  size_t all = tdm_moe_host_bytes(p, p->layers);
  float *x = malloc((T + DECODE) * H * sizeof *x), *ref = malloc((T + DECODE) * H * sizeof *ref),
        *y = malloc((T + DECODE) * H * sizeof *y);
  tdm_moe_pass_stats st;
  tdm_moe_model *m = make_model(dev, &base, true, 0, 2, TDM_CACHE_STATIC);
  tdm_moe_make_input(m, x, T, 0, false);
  tdm_moe_make_input(m, x + T * H, DECODE, 0, true);
  CHECK_OK(tdm_moe_forward(m, x, ref, T, true, &st));
  CHECK_EQ((long)st.bytes_copied, 0L);
  CHECK_EQ((long)st.device_routed_layers, 0L);
  /* The small ubatch overwrites the first SMALL rows of the 48-token output. */
  CHECK_OK(tdm_moe_forward(m, x, ref, SMALL, true, &st));
  CHECK_EQ((long)st.device_routed_layers, (long)p->layers);
  for (int t = 0; t < DECODE; t++)
    CHECK_OK(tdm_moe_forward(m, x + (T + t) * H, ref + (T + t) * H, 1, true, &st));
  for (size_t i = 0; i < (T + DECODE) * H; i++) CHECK(isfinite(ref[i]));
  tdm_moe_model_destroy(m);

  /* 16 models: under ThreadSanitizer each takes some 6 s, and the case must finish on a
   * loaded 2-core machine (30 of them, with all / 4 and 2 slots, took 180 s alone there). */
  const size_t budgets[] = {0, eb, all / 2, all};
  const int slots[] = {1, 5};
  for (int pol = 0; pol < 2; pol++)
    for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++)
      for (size_t sl = 0; sl < sizeof slots / sizeof slots[0]; sl++) {
        tdm_moe_config c = base;
        c.predict_depth = (int)sl + 1;
        m = make_model(dev, &c, false, budgets[b], slots[sl], pol ? TDM_CACHE_LRU : TDM_CACHE_STATIC);
        for (int ov = 0; ov < 2; ov++) {
          memset(y, 0xff, (T + DECODE) * H * sizeof *y);
          CHECK_OK(tdm_moe_forward(m, x, y, T, ov, &st));
          if (budgets[b] == 0) CHECK(st.bytes_copied > 0);
          /* Again, after a pass of as many tokens: overlapped, layer 0's copies start with the
           * pass (before its routing), into the slots the last pass left. */
          CHECK_OK(tdm_moe_forward(m, x, y, T, ov, &st));
          CHECK_OK(tdm_moe_forward(m, x, y, SMALL, ov, &st));
          CHECK_EQ((long)st.device_routed_layers, budgets[b] == all ? (long)p->layers : 0L);
          for (int t = 0; t < DECODE; t++)
            CHECK_OK(tdm_moe_forward(m, x + (T + t) * H, y + (T + t) * H, 1, ov, &st));
          long at = th_first_diff(y, ref, (T + DECODE) * H * sizeof *y);
          CHECK_MSG(at < 0, "policy %s, budget %zu, %d slots, overlap %d, predict depth %d: "
                    "output differs from the all-resident output at byte %ld",
                    pol ? "lru" : "static", budgets[b], slots[sl], ov, c.predict_depth, at);
        }
        tdm_moe_model_destroy(m);
      }
  free(x);
  free(ref);
  free(y);
  th_close();
}

/* A large ubatch's experts in groups: the default where the table runs many rows as GEMMs
 * (experts_gemm_rows), and TANDEM_MOE_PREFILL_GROUPED=64 elsewhere: 80 tokens of top-4 (320
 * rows), streamed at budgets of nothing, one expert and half, overlapped and serialized,
 * bitwise equal to the all-resident model's output, whose pass routes on the device (group()
 * there, nothing back to the host); the groups differ from run to run (experts join a group as
 * they land), an expert's output must not. */
TEST_CASE(streamed_equals_resident_grouped) {
  tdm_device *dev = th_open();
  const tdm_moe_ops *ops = tdm_moe_ops_for(dev);
  CHECK(ops != NULL);
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  CHECK(p != NULL);
  enum { T = 80 };
  if (ops->experts_gemm_rows > 0) {
    CHECK(T * p->topk >= ops->experts_gemm_rows);
    CHECK(unsetenv("TANDEM_MOE_PREFILL_GROUPED") == 0);
  } else {
    CHECK(setenv("TANDEM_MOE_PREFILL_GROUPED", "64", 1) == 0);
  }
  tdm_moe_config base = {.preset = p, .device = dev, .seed = th_seed(), .skew = 1.2,
                         .locality = 0.7, .max_tokens = T};
  size_t H = (size_t)p->hidden, eb = tdm_moe_expert_bytes(p);
  size_t all = tdm_moe_host_bytes(p, p->layers);
  float *x = malloc(T * H * sizeof *x), *ref = malloc(T * H * sizeof *ref),
        *y = malloc(T * H * sizeof *y);
  CHECK(x && ref && y);
  tdm_moe_pass_stats st;
  tdm_moe_model *m = make_model(dev, &base, true, 0, 2, TDM_CACHE_STATIC);
  tdm_moe_make_input(m, x, T, 0, false);
  CHECK_OK(tdm_moe_forward(m, x, ref, T, true, &st));
  CHECK_EQ((long)st.device_routed_layers, (long)p->layers);
  CHECK_EQ((long)st.experts_computed, (long)st.acquires);
  CHECK(st.acquires > 0);
  for (size_t i = 0; i < T * H; i++) CHECK(isfinite(ref[i]));
  tdm_moe_model_destroy(m);
  const size_t budgets[] = {0, eb, all / 2};
  for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
    m = make_model(dev, &base, false, budgets[b], 5, TDM_CACHE_STATIC);
    for (int ov = 0; ov < 2; ov++) {
      memset(y, 0xff, T * H * sizeof *y);
      CHECK_OK(tdm_moe_forward(m, x, y, T, ov, &st));
      if (budgets[b] == 0) CHECK(st.bytes_copied > 0);
      CHECK_EQ((long)st.device_routed_layers, 0L);
      long at = th_first_diff(y, ref, T * H * sizeof *y);
      CHECK_MSG(at < 0, "budget %zu, overlap %d: output differs from the all-resident output "
                "at byte %ld", budgets[b], ov, at);
    }
    tdm_moe_model_destroy(m);
  }
  CHECK(unsetenv("TANDEM_MOE_PREFILL_GROUPED") == 0);
  free(x);
  free(ref);
  free(y);
  th_close();
}

/* Every acquire of a pass counts once: resident, in flight or a demand miss. */
static void check_found(const tdm_moe_pass_stats *st, const char *what) {
  CHECK_MSG(st->resident_hits + st->inflight_hits + st->demand_misses == st->acquires,
            "%s: %llu resident + %llu in flight + %llu misses != %llu acquires", what,
            (unsigned long long)st->resident_hits, (unsigned long long)st->inflight_hits,
            (unsigned long long)st->demand_misses, (unsigned long long)st->acquires);
  CHECK(st->hits == st->resident_hits + st->inflight_hits);
  CHECK(st->misses == st->demand_misses);
  CHECK_EQ((long)st->host_experts, 0L); /* placement DEVICE: nothing on the host */
}

/* What a pass reports it found. Decode under LRU with two slots for sixteen experts a token:
 * serialized, nothing is copied ahead, so there are demand misses; overlapped, the routed
 * experts are prefetched, and whether a copy has landed by its acquire (resident) or not (in
 * flight) depends on timing, but either way every token copies bytes. All resident, once the
 * resident set has landed: resident hits only, nothing copied. */
TEST_CASE(pass_counts) {
  tdm_device *dev = th_open();
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  CHECK(p != NULL);
  enum { DECODE = 4 };
  tdm_moe_config base = {.preset = p, .device = dev, .seed = th_seed(), .skew = 1.0,
                         .locality = 0.8, .max_tokens = 8};
  size_t H = (size_t)p->hidden;
  float *x = malloc(DECODE * H * sizeof *x), *y = malloc(DECODE * H * sizeof *y);
  tdm_moe_pass_stats st;
  tdm_moe_model *m = make_model(dev, &base, false, 0, 2, TDM_CACHE_LRU);
  tdm_moe_make_input(m, x, DECODE, 0, true);
  for (int ov = 0; ov < 2; ov++)
    for (int t = 0; t < DECODE; t++) {
      CHECK_OK(tdm_moe_forward(m, x + t * H, y + t * H, 1, ov, &st));
      check_found(&st, ov ? "overlapped decode" : "serialized decode");
      CHECK(st.acquires > 0);
      CHECK_EQ((long)st.device_routed_layers, 0L);
      CHECK_EQ((long)st.experts_computed, (long)st.acquires);
      CHECK(st.bytes_copied > 0);
      if (!ov) CHECK(st.demand_misses > 0);
    }
  tdm_moe_model_destroy(m);

  m = make_model(dev, &base, true, 0, 2, TDM_CACHE_STATIC);
  tdm_queue *prefetch = NULL;
  CHECK_OK(tdm_streamer_queues(tdm_moe_streamer(m), NULL, &prefetch));
  CHECK_OK(tdm_queue_sync(prefetch)); /* the resident set's first load, on the prefetch queue */
  for (int t = 0; t < DECODE; t++) {
    CHECK_OK(tdm_moe_forward(m, x + t * H, y + t * H, 1, true, &st));
    check_found(&st, "all resident");
    /* Routed on the device: each layer's top-k experts, all distinct, read back after. */
    CHECK_EQ((long)st.device_routed_layers, (long)p->layers);
    CHECK_EQ((long)st.acquires, (long)p->layers * p->topk);
    CHECK_EQ((long)st.experts_computed, (long)st.acquires);
    CHECK_EQ((long)st.resident_hits, (long)st.acquires);
    CHECK_EQ((long)st.bytes_copied, 0L);
  }
  tdm_moe_model_destroy(m);
  free(x);
  free(y);
  th_close();
}

/* ||y - ref|| / ||ref|| over n floats. */
static double rel_l2(const float *y, const float *ref, size_t n) {
  double d = 0, r = 0;
  for (size_t i = 0; i < n; i++) {
    d += ((double)y[i] - ref[i]) * ((double)y[i] - ref[i]);
    r += (double)ref[i] * ref[i];
  }
  return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* The tolerance of host-computed experts against the all-resident output, as `tandem moe`
 * checks it (tools/moe.c says why): the same weights and activations, f32 sums in other
 * orders. */
#define HOST_TOL 1e-3

/* Decode tokens one at a time (and one ubatch of SMALL tokens) with every expert on the device,
 * as the reference: outputs in ref. */
static void decode_reference(tdm_device *dev, const tdm_moe_config *base, const float *x,
                             float *ref, int decode, int small) {
  size_t H = (size_t)base->preset->hidden;
  tdm_moe_pass_stats st;
  tdm_moe_model *m = make_model(dev, base, true, 0, 2, TDM_CACHE_STATIC);
  for (int t = 0; t < decode; t++) CHECK_OK(tdm_moe_forward(m, x + t * H, ref + t * H, 1, true, &st));
  CHECK_OK(tdm_moe_forward(m, x, ref + decode * H, small, true, &st));
  tdm_moe_model_destroy(m);
}

/* The placement tests' inputs: `decode` tokens of the tiny preset (x), their all-resident
 * reference as decode_reference computes it (ref), and room for the same outputs (y). */
typedef struct place_case {
  tdm_moe_config base;
  size_t H, n;
  float *x, *ref, *y;
} place_case;

static place_case place_setup(tdm_device *dev, int decode, int small) {
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  place_case pc = {.base = {.preset = p, .device = dev, .seed = th_seed(), .skew = 1.0,
                            .locality = 0.7, .max_tokens = 8}};
  pc.H = (size_t)p->hidden;
  pc.n = (size_t)(decode + small) * pc.H;
  pc.x = malloc(decode * pc.H * sizeof *pc.x);
  pc.ref = malloc(pc.n * sizeof *pc.ref);
  pc.y = malloc(pc.n * sizeof *pc.y);
  CHECK(pc.x && pc.ref && pc.y);
  tdm_moe_model *m = make_model(dev, &pc.base, true, 0, 2, TDM_CACHE_STATIC);
  tdm_moe_make_input(m, pc.x, decode, 0, true);
  tdm_moe_model_destroy(m);
  decode_reference(dev, &pc.base, pc.x, pc.ref, decode, small);
  return pc;
}

static void place_teardown(place_case *pc) {
  free(pc->x);
  free(pc->ref);
  free(pc->y);
}

/* Whether the device under test is the CPU backend (host and device then run one kernel). */
static bool on_cpu(tdm_device *dev) {
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  return strcmp(info.backend, "cpu") == 0;
}

/* The cores this process may run on. */
static int affinity_cores(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                      : (int)sysconf(_SC_NPROCESSORS_ONLN);
}

/* Placement HOST with no budget, on a fresh model: nothing is ever copied, so every routed
 * expert is absent when placed and the host computes them all; no acquire, no byte copied.
 * The output is within the tolerance of the all-resident one (bitwise on a CPU device), with
 * overlap and without, for one host queue and for three (experts spread round-robin).
 * The host pool: with one queue its default size (the cores less 4 beside a device that is not
 * the host), with three the 3 threads asked for; on a CPU device the device's own op state has
 * started the pool first, at its default, which the model then shares. The overlapped runs
 * time the host experts (time_host): each pass's host_busy_seconds is above 0 and at most the
 * pass's time on each queue; the serialized runs do not, and report 0. The overlapped runs
 * time each layer's chain too (time_chain): every part is at least 0, the routing's way back
 * above 0, and the parts add up to no more than the pass (the device's clock against the
 * host's, with a little slack); untimed, every part is 0. */
TEST_CASE(host_placement) {
  tdm_device *dev = th_open();
  enum { DECODE = 6, SMALL = 5 };
  CHECK(unsetenv("TANDEM_MOE_CPU_THREADS") == 0); /* the default size, not the caller's */
  place_case pc = place_setup(dev, DECODE, SMALL);
  const tdm_moe_config base = pc.base;
  const tdm_moe_preset *p = base.preset;
  size_t H = pc.H, n = pc.n;
  float *x = pc.x, *ref = pc.ref, *y = pc.y;
  tdm_moe_pass_stats st;
  tdm_moe_model *m;
  const int queues[] = {1, 3};
  for (int qi = 0; qi < 2; qi++)
    for (int ov = 0; ov < 2; ov++) {
      tdm_moe_config c = base;
      c.placement = TDM_MOE_PLACE_HOST;
      c.host_queues = queues[qi];
      c.host_threads = qi ? 3 : 0;
      c.time_host = ov;
      c.time_chain = ov;
      m = make_model(dev, &c, false, 0, 2, TDM_CACHE_LRU); /* with the look-ahead predictor */
      tdm_moe_placement_info pi;
      CHECK_OK(tdm_moe_placement_get(m, &pi));
      CHECK_EQ((int)pi.placement, (int)TDM_MOE_PLACE_HOST);
      CHECK_EQ(pi.host_queues, queues[qi]);
      int cores = affinity_cores(), beside = cores - 4 > 1 ? cores - 4 : 1;
      if (on_cpu(dev))
        CHECK_EQ(pi.host_threads, cores);
      else
        CHECK_EQ(pi.host_threads, qi ? 3 : beside);
      CHECK(pi.link_gbs > 0 && pi.host_gbs > 0);
      CHECK(pi.link_gbs_shared > 0 && pi.host_gbs_shared > 0);
      CHECK(pi.host_share >= 0 && pi.host_share < 1);
      /* With no budget a decode layer's top-k all go to the host, dealt over the queues: the
       * calls calibrated carry top-k / queues experts, rounded (4 on one queue, 1 on three). */
      CHECK_EQ(pi.host_group, queues[qi] == 1 ? p->topk : (int)lround((double)p->topk / 3));
      memset(y, 0xff, n * sizeof *y);
      for (int t = 0; t < DECODE + 1; t++) {
        int T = t < DECODE ? 1 : SMALL;
        CHECK_OK(tdm_moe_forward(m, x + (t < DECODE ? t : 0) * H, y + t * H, T, ov, &st));
        CHECK_MSG(st.host_experts > 0 && st.acquires == 0 && st.bytes_copied == 0,
                  "pass %d: %llu host experts, %llu acquires, %llu bytes copied", t,
                  (unsigned long long)st.host_experts, (unsigned long long)st.acquires,
                  (unsigned long long)st.bytes_copied);
        CHECK_EQ((long)st.host_experts, (long)st.experts_computed);
        CHECK_EQ((long)st.host_candidates, (long)st.host_experts);
        if (ov)
          CHECK_MSG(st.host_busy_seconds > 0 &&
                        st.host_busy_seconds <= st.seconds * queues[qi],
                    "pass %d: host busy %g s in a %g s pass on %d queues", t,
                    st.host_busy_seconds, st.seconds, queues[qi]);
        else
          CHECK(st.host_busy_seconds == 0);
        double part[] = {st.chain_route_seconds, st.chain_submit_seconds,
                         st.chain_device_seconds, st.chain_join_seconds,
                         st.chain_combine_seconds}, sum = 0;
        for (int i = 0; i < 5; i++) {
          CHECK_MSG(part[i] >= 0 && (ov || part[i] == 0), "pass %d, overlap %d: chain part %d "
                    "is %g s", t, ov, i, part[i]);
          sum += part[i];
        }
        if (ov)
          CHECK_MSG(part[0] > 0 && sum <= 1.05 * st.seconds + 1e-4, "pass %d: the chain's "
                    "routing %g s, all parts %g s, in a %g s pass", t, part[0], sum, st.seconds);
        /* Decode: the top-k of every layer, all distinct. */
        if (T == 1) CHECK_EQ((long)st.host_experts, (long)p->layers * p->topk);
      }
      double d = rel_l2(y, ref, n);
      CHECK_MSG(d <= HOST_TOL, "%d host queues, overlap %d: ||y - ref|| / ||ref|| = %g", queues[qi],
                ov, d);
      if (on_cpu(dev))
        CHECK_MSG(th_first_diff(y, ref, n * sizeof *y) < 0, "%d host queues, overlap %d: on a "
                  "CPU device host experts run the device's kernel, yet the output differs",
                  queues[qi], ov);
      tdm_moe_model_destroy(m);
    }
  place_teardown(&pc);
  th_close();
}

/* Placement AUTO with no budget under LRU: the calibrated share is in [0, 1], every pass's
 * experts are counted once (resident, in flight, demand miss or host), the host took no more
 * than the candidates, and the output is within the tolerance of the all-resident one. */
TEST_CASE(auto_placement) {
  tdm_device *dev = th_open();
  enum { DECODE = 8, SMALL = 5 };
  place_case pc = place_setup(dev, DECODE, SMALL);
  const tdm_moe_config base = pc.base;
  const tdm_moe_preset *p = base.preset;
  size_t H = pc.H, n = pc.n;
  float *x = pc.x, *ref = pc.ref, *y = pc.y;
  tdm_moe_pass_stats st;
  tdm_moe_config c = base;
  c.placement = TDM_MOE_PLACE_AUTO;
  tdm_moe_model *m = make_model(dev, &c, false, 0, 2, TDM_CACHE_LRU);
  tdm_moe_placement_info pi;
  CHECK_OK(tdm_moe_placement_get(m, &pi));
  CHECK_EQ((int)pi.placement, (int)TDM_MOE_PLACE_AUTO);
  CHECK(pi.host_queues >= 1);
  CHECK(pi.host_share >= 0 && pi.host_share <= 1);
  /* The split rule of tandem/moe.h: the figures at once must beat the link alone by 5%. */
  double sum = pi.host_gbs_shared + pi.link_gbs_shared;
  CHECK(fabs(pi.host_share - (sum > 1.05 * pi.link_gbs ? pi.host_gbs_shared / sum : 0.0)) <
        1e-12);
  CHECK_MSG(pi.host_join_us > 0, "the host join's round trip is %g us", pi.host_join_us);
  CHECK_MSG(pi.host_group >= 1 && pi.host_group <= p->topk, "the host calls calibrated carry %d "
            "experts (top-k %d)", pi.host_group, p->topk);
  uint64_t host = 0;
  for (int ov = 0; ov < 2; ov++) {
    for (int t = 0; t < DECODE + 1; t++) {
      int T = t < DECODE ? 1 : SMALL;
      CHECK_OK(tdm_moe_forward(m, x + (t < DECODE ? t : 0) * H, y + t * H, T, ov, &st));
      CHECK_MSG(st.resident_hits + st.inflight_hits + st.demand_misses + st.host_experts ==
                    (uint64_t)st.experts_computed,
                "pass %d: %llu resident + %llu in flight + %llu misses + %llu host != %d "
                "computed", t, (unsigned long long)st.resident_hits,
                (unsigned long long)st.inflight_hits, (unsigned long long)st.demand_misses,
                (unsigned long long)st.host_experts, st.experts_computed);
      CHECK(st.acquires + st.host_experts == (uint64_t)st.experts_computed);
      CHECK(st.host_experts <= st.host_candidates);
      host += st.host_experts;
    }
    double d = rel_l2(y, ref, n);
    CHECK_MSG(d <= HOST_TOL, "overlap %d: ||y - ref|| / ||ref|| = %g", ov, d);
  }
  printf("auto placement: share %.2f (link %.2f GB/s, host %.2f GB/s alone; %.2f and %.2f at "
         "once), %llu host experts\n", pi.host_share, pi.link_gbs, pi.host_gbs,
         pi.link_gbs_shared, pi.host_gbs_shared, (unsigned long long)host);
  CHECK(pi.host_share_model == pi.host_share);
  tdm_moe_model_destroy(m);
  /* A share given as 0.35 without the look-ahead (so every non-resident expert is a candidate
   * when its layer is placed): rounding each layer's few candidates alone would give the host
   * 1 of 2, 3 or 4 (0.5, 0.33, 0.25); with the remainder carried from layer to layer the
   * host's part of all candidates is the share, within a candidate. */
  c.host_share = 0.35;
  c.predict = false;
  {
    tdm_moe_config cn = c;
    cn.budget_bytes = 0;
    cn.staging_slots = 2;
    cn.policy = TDM_CACHE_LRU;
    tdm_moe_model *mn = NULL;
    CHECK_OK(tdm_moe_model_create(&cn, &mn));
    uint64_t nh = 0, nc = 0;
    for (int rep = 0; rep < 4; rep++)
      for (int t = 0; t < DECODE; t++) {
        CHECK_OK(tdm_moe_forward(mn, x + t * H, y + t * H, 1, true, &st));
        nh += st.host_experts;
        nc += st.host_candidates;
      }
    CHECK_MSG(nc > 50 && fabs((double)nh - 0.35 * (double)nc) <= 1.0,
              "share 0.35: the host took %llu of %llu candidates", (unsigned long long)nh,
              (unsigned long long)nc);
    tdm_moe_model_destroy(mn);
  }
  c.host_share = 0;
  /* A share given as 1: every candidate goes to the host, none is copied on demand, and the
   * cost model's own share is still reported. */
  c.host_share = 1.0;
  m = make_model(dev, &c, false, 0, 2, TDM_CACHE_LRU);
  CHECK_OK(tdm_moe_placement_get(m, &pi));
  CHECK(pi.host_share == 1.0 && pi.host_share_model >= 0 && pi.host_share_model <= 1);
  /* Measured at the share given: all of a token's top-k, none being resident. */
  CHECK_EQ(pi.host_group, p->topk);
  for (int t = 0; t < DECODE; t++) {
    CHECK_OK(tdm_moe_forward(m, x + t * H, y + t * H, 1, true, &st));
    CHECK_MSG(st.host_experts == st.host_candidates && st.demand_misses == 0,
              "pass %d: %llu host experts of %llu candidates, %llu demand misses", t,
              (unsigned long long)st.host_experts, (unsigned long long)st.host_candidates,
              (unsigned long long)st.demand_misses);
  }
  CHECK_MSG(rel_l2(y, ref, DECODE * H) <= HOST_TOL, "share 1: ||y - ref|| / ||ref|| = %g",
            rel_l2(y, ref, DECODE * H));
  /* Placement DEVICE reports no calibration. */
  tdm_moe_model_destroy(m);
  m = make_model(dev, &base, false, 0, 2, TDM_CACHE_LRU);
  CHECK_OK(tdm_moe_placement_get(m, &pi));
  CHECK(pi.placement == TDM_MOE_PLACE_DEVICE && pi.host_queues == 0 && pi.host_share == 0 &&
        pi.host_join_us == 0 && pi.host_threads == 0);
  CHECK_RC(tdm_moe_placement_get(m, NULL), TDM_EINVAL);
  CHECK_RC(tdm_moe_placement_get(NULL, &pi), TDM_EINVAL);
  tdm_moe_model_destroy(m);
  place_teardown(&pc);
  th_close();
}


/* Expert parallelism (tdm_moe_config.devices): the routed experts split between this device
 * and a second one (th_open_pair()), at budgets of nothing, one expert, half and every expert
 * (each device's), static and LRU, overlapped and serialized; a prefill ubatch (a GEMM per
 * expert), a small one and decode tokens (experts in groups); then all again after
 * tdm_moe_rebalance has dealt the experts out by the loads measured. The output is the one-device
 * model's within rounding (each device's part of the weighted sum is added on its own), each
 * routed expert is computed once (the devices' acquires add up to the pass's), and each
 * device computes a share. The configurations a split refuses, each with its reason. */
TEST_CASE(expert_parallel) {
  const char *second_id;
  tdm_device *dev, *second = th_open_pair(&dev, &second_id);
  if (!second) TH_SKIP("no second device %s beside %s", second_id, th_device_id);
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  CHECK(p != NULL);
  enum { T = 48, SMALL = 5, DECODE = 3 };
  tdm_moe_config base = {.preset = p, .device = dev, .seed = th_seed(), .skew = 1.2,
                         .locality = 0.7, .max_tokens = T};
  size_t H = (size_t)p->hidden, eb = tdm_moe_expert_bytes(p), n = (T + SMALL + DECODE) * H;
  size_t all = tdm_moe_host_bytes(p, p->layers);
  float *x = malloc(n * sizeof *x), *ref = malloc(n * sizeof *ref), *y = malloc(n * sizeof *y);
  CHECK(x && ref && y);
  int sizes[2 + DECODE] = {T, SMALL};
  for (int i = 0; i < DECODE; i++) sizes[2 + i] = 1;
  tdm_moe_pass_stats st;
  int computed[2 + DECODE];
  tdm_moe_model *m = make_model(dev, &base, false, 0, 2, TDM_CACHE_STATIC);
  tdm_moe_make_input(m, x, T, 0, false);
  tdm_moe_make_input(m, x + T * H, SMALL, 1, false);
  tdm_moe_make_input(m, x + (T + SMALL) * H, DECODE, 0, true);
  for (int i = 0, at = 0; i < 2 + DECODE; at += sizes[i++]) {
    CHECK_OK(tdm_moe_forward(m, x + at * H, ref + at * H, sizes[i], true, &st));
    computed[i] = st.experts_computed;
  }
  tdm_moe_model_destroy(m);
  tdm_device *both[2] = {dev, second};
  base.devices = both;
  base.ndevices = 2;
  const size_t budgets[] = {0, eb, all / 4, all};
  /* CUDA's prefill experts take their activations as bf16 (test-moe-ops says why), the other
   * backends as f32: a CUDA device beside one of another backend is held to HOST_TOL, as host
   * experts beside a CUDA device are; other pairs compute the same sums in other orders. */
  const bool cuda_mixed = (strncmp(th_device_id, "cuda:", 5) == 0) !=
                          (strncmp(second_id, "cuda:", 5) == 0);
  const double tol = cuda_mixed ? HOST_TOL : 1e-5;
  double worst = 0;
  for (int pol = 0; pol < 2; pol++)
    for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
      m = make_model(dev, &base, false, budgets[b], 2, pol ? TDM_CACHE_LRU : TDM_CACHE_STATIC);
      /* the second time round, the experts dealt out again by the loads the first measured */
      for (int ov = 0; ov < 4; ov++) {
        if (ov == 2) CHECK_OK(tdm_moe_rebalance(m));
        memset(y, 0xff, n * sizeof *y);
        uint64_t each[2] = {0, 0}; /* acquires on each device, over the ubatches */
        for (int i = 0, at = 0; i < 2 + DECODE; at += sizes[i++]) {
          tdm_streamer_stats s0[2], s1[2];
          for (int d = 0; d < 2; d++)
            CHECK_OK(tdm_streamer_stats_get(tdm_moe_streamer_at(m, d), &s0[d]));
          CHECK_OK(tdm_moe_forward(m, x + at * H, y + at * H, sizes[i], ov % 2, &st));
          for (int d = 0; d < 2; d++) {
            CHECK_OK(tdm_streamer_stats_get(tdm_moe_streamer_at(m, d), &s1[d]));
            each[d] += s1[d].acquires - s0[d].acquires;
          }
          CHECK_EQ((long)st.device_routed_layers, 0L);
          CHECK_EQ(st.experts_computed, computed[i]);
          CHECK_EQ((long)st.acquires, (long)st.experts_computed);
          CHECK_EQ((long)st.acquires, (long)(s1[0].acquires - s0[0].acquires +
                                             s1[1].acquires - s0[1].acquires));
          if (budgets[b] == 0) CHECK(st.bytes_copied > 0);
        }
        CHECK_MSG(each[0] > 0 && each[1] > 0, "the devices acquired %llu and %llu experts",
                  (unsigned long long)each[0], (unsigned long long)each[1]);
        for (size_t i = 0; i < n; i++) CHECK(isfinite(y[i]));
        double err = rel_l2(y, ref, n);
        worst = err > worst ? err : worst;
        CHECK_MSG(err < tol, "%s and %s, policy %s, budget %zu, overlap %d%s: rel l2 %g "
                  "against one device", th_device_id, second_id, pol ? "lru" : "static",
                  budgets[b], ov % 2, ov >= 2 ? ", rebalanced" : "", err);
      }
      tdm_moe_model_destroy(m);
    }
  printf("%s and %s: at most %.3g (rel l2) from one device\n", th_device_id, second_id, worst);
  CHECK(tdm_moe_streamer_at(NULL, 0) == NULL);
  /* Rebalancing: not during a pass; with one device, nothing to do. */
  m = make_model(dev, &base, false, 0, 2, TDM_CACHE_STATIC);
  CHECK_OK(tdm_moe_pass_begin(m, 1, true, &st));
  CHECK_RC(tdm_moe_rebalance(m), TDM_ESTATE);
  CHECK_OK(tdm_moe_pass_end(m, 0, &st));
  CHECK_OK(tdm_moe_rebalance(m));
  tdm_moe_model_destroy(m);
  CHECK_RC(tdm_moe_rebalance(NULL), TDM_EINVAL);
  /* What a split refuses. */
  tdm_moe_config c = base;
  c.budget_bytes = eb;
  c.staging_slots = 2;
  const struct {
    int ndevices, first_other, twice, place, chain;
    const char *why;
  } bad[] = {{1, 0, 0, 0, 0, "2 to TDM_MOE_DEVICES_MAX"},
             {TDM_MOE_DEVICES_MAX + 1, 0, 0, 0, 0, "2 to TDM_MOE_DEVICES_MAX"},
             {2, 1, 0, 0, 0, "devices[0]"},
             {2, 0, 1, 0, 0, "each one once"},
             {2, 0, 0, 1, 0, "host placement"},
             {2, 0, 0, 0, 1, "time_chain"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    tdm_device *list[2] = {bad[i].first_other ? second : dev, bad[i].twice ? dev : second};
    c.devices = list;
    c.ndevices = bad[i].ndevices;
    c.placement = bad[i].place ? TDM_MOE_PLACE_HOST : TDM_MOE_PLACE_DEVICE;
    c.time_chain = bad[i].chain;
    m = NULL;
    CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
    CHECK_MSG(strstr(tdm_last_error(), bad[i].why) != NULL, "case %zu: %s", i, tdm_last_error());
    CHECK(m == NULL);
  }
  free(x);
  free(ref);
  free(y);
  th_close();
}

/* The fault loops below take every point in the normal build, every FAULT_STRIDE-th in the
 * sanitizer builds (a minute a device under ThreadSanitizer otherwise). */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define FAULT_STRIDE 4
#else
#define FAULT_STRIDE 1
#endif

/* Expert parallelism under failure: the nth host allocation or backend call of a two-device
 * model's creation, then of a pass (prefill-sized, then a decode token), fails, for every n
 * until the call succeeds without one. A failed creation returns the injected code with its
 * message and leaves nothing behind; a failed pass returns an error with a message, and the
 * next pass, fault-free, gives the output of a pass that never failed (as does a pass whose
 * fault hit what it may do without). */
TEST_CASE(expert_parallel_faults) {
  const char *second_id;
  tdm_device *dev, *second = th_open_pair(&dev, &second_id);
  if (!second) TH_SKIP("no second device %s beside %s", second_id, th_device_id);
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  /* Two layers, and a prefill ubatch just past the small ones (GROUPED_MAX_T): every kind of
   * step, in as few points as can be had, each failing once. */
  enum { T = 34, MAX_N = 4000 };
  tdm_device *both[2] = {dev, second};
  tdm_moe_config c = {.preset = p, .layers = 2, .device = dev, .seed = th_seed(), .skew = 1.2,
                      .max_tokens = T, .staging_slots = 2, .devices = both, .ndevices = 2};
  size_t H = (size_t)p->hidden;
  /* ref and y: a prefill's T rows, then a decode token's */
  float *x = malloc(T * H * sizeof *x), *ref = malloc((T + 1) * H * sizeof *ref),
        *y = malloc((T + 1) * H * sizeof *y);
  CHECK(x && ref && y);
  tdm_moe_pass_stats st;
  tdm_moe_model *m = NULL;
  int rc = tdm_moe_model_create(&c, &m);
  if (rc == TDM_ENOTSUP) TH_SKIP("no MoE operations on %s: %s", th_device_id, tdm_last_error());
  CHECK_OK(rc);
  tdm_moe_make_input(m, x, T, 0, false);
  CHECK_OK(tdm_moe_forward(m, x, ref, T, true, &st));
  CHECK_OK(tdm_moe_forward(m, x, ref + T * H, 1, true, &st)); /* a decode token */
  tdm_moe_model_destroy(m);
  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));
  long n;
  for (n = 0; n < MAX_N; n += FAULT_STRIDE) {
    m = (tdm_moe_model *)(uintptr_t)0x5e;
    CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC | TDM_FAULT_BACKEND, n, 0));
    rc = tdm_moe_model_create(&c, &m);
    int fired = tdm_fault_fired();
    CHECK_OK(tdm_fault_inject(0, -1, 0));
    if (!fired) {
      CHECK_OK(rc);
      break;
    }
    if (rc == 0) { /* the fault hit what creation may do without */
      tdm_moe_model_destroy(m);
    } else {
      CHECK_MSG(rc == TDM_ENOMEM || rc == TDM_EBACKEND, "creation, n=%ld: %s", n,
                tdm_last_error());
      CHECK(m == (tdm_moe_model *)(uintptr_t)0x5e);
    }
    TH_EXPECT_STATS_BACK(&base, "creation", n);
  }
  CHECK(n < MAX_N);
  printf("creation: %ld points, every %d failed in turn\n", n, FAULT_STRIDE);
  for (int decode = 0; decode < 2; decode++) {
    int Tp = decode ? 1 : T;
    float *want = decode ? ref + T * H : ref, *got = decode ? y + T * H : y;
    for (n = 0; n < MAX_N; n += FAULT_STRIDE) {
      CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC | TDM_FAULT_BACKEND, n, 0));
      rc = tdm_moe_forward(m, x, got, Tp, true, &st);
      int fired = tdm_fault_fired();
      CHECK_OK(tdm_fault_inject(0, -1, 0));
      if (!fired) {
        CHECK_OK(rc);
        break;
      }
      char why[256];
      snprintf(why, sizeof why, "%s", rc ? tdm_last_error() : "a fault and no failure");
      if (rc) { /* else the fault hit what a pass may do without (a keep-alive's block) */
        CHECK_MSG(strlen(tdm_last_error()) > 0, "%s pass, n=%ld: no message",
                  decode ? "decode" : "prefill", n);
        memset(got, 0xff, (size_t)Tp * H * sizeof *got);
        CHECK_OK(tdm_moe_forward(m, x, got, Tp, true, &st));
      }
      CHECK_MSG(th_first_diff(got, want, (size_t)Tp * H * sizeof *got) < 0, "%s pass, n=%ld: "
                "the output differs (%s)", decode ? "decode" : "prefill", n, why);
    }
    CHECK(n < MAX_N);
    printf("%s pass: %ld points, every %d failed in turn\n", decode ? "decode" : "prefill", n,
           FAULT_STRIDE);
  }
  tdm_moe_model_destroy(m);
  TH_EXPECT_STATS_BACK(&base, "after the passes", 0);
  free(x);
  free(ref);
  free(y);
  th_close();
}

TEST_CASE(moe_bad_input) {
  tdm_device *dev = th_open();
  CHECK(tdm_moe_preset_find("no-such-model") == NULL);
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  tdm_moe_config c = {.preset = p, .device = dev, .seed = 1, .max_tokens = 8,
                      .budget_bytes = tdm_moe_expert_bytes(p) / 2, .staging_slots = 2};
  tdm_moe_model *m = NULL;
  int rc = TH_CALL(tdm_moe_model_create(&c, &m));
  if (rc == TDM_ENOTSUP) TH_SKIP("no MoE operations on %s", th_device_id);
  CHECK_STATUS(rc, TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "cannot hold one") != NULL);
  CHECK(m == NULL);
  /* A preset whose experts cannot fit in this machine's memory: a clear refusal. */
  c.preset = tdm_moe_preset_find("deepseek-v3");
  c.budget_bytes = 0;
  CHECK_RC(tdm_moe_model_create(&c, &m), TDM_ENOMEM);
  CHECK(strstr(tdm_last_error(), "--layers") != NULL);
  c.preset = p;
  c.max_tokens = 0;
  CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
  /* A predict depth below 0 or above the most. */
  c.max_tokens = 8;
  c.predict = true;
  const int depths[] = {-1, TDM_MOE_PREDICT_DEPTH_MAX + 1};
  for (int i = 0; i < 2; i++) {
    c.predict_depth = depths[i];
    CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "predict depth") != NULL);
  }
  c.predict = false;
  c.predict_depth = 0;
  /* Placement: negative host queues, a placement that does not exist, a host device that is
   * not a CPU device (any other device present). */
  c.max_tokens = 8;
  c.placement = TDM_MOE_PLACE_HOST;
  c.host_queues = -1;
  CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "host queues") != NULL);
  c.host_queues = 0;
  c.placement = (tdm_moe_placement)7;
  CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "placement 7") != NULL);
  /* A host share outside [0, 1] (NaN too), or given where AUTO does not apply. */
  const double shares[] = {-0.1, 1.5, NAN};
  c.placement = TDM_MOE_PLACE_AUTO;
  for (int i = 0; i < 3; i++) {
    c.host_share = shares[i];
    CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "outside [0, 1]") != NULL);
  }
  c.host_share = 0.5;
  c.placement = TDM_MOE_PLACE_HOST;
  CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "AUTO only") != NULL);
  c.host_share = 0;
  c.placement = TDM_MOE_PLACE_AUTO;
  int ndev = 0;
  CHECK_OK(tdm_device_count(&ndev));
  for (int i = 0; i < ndev; i++) {
    tdm_device *d;
    tdm_device_info info;
    CHECK_OK(tdm_device_get(i, &d));
    CHECK_OK(tdm_device_info_get(d, &info));
    if (strcmp(info.backend, "cpu") == 0) continue;
    c.host = d;
    CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "not a CPU device") != NULL);
  }
  c.host = NULL;
  c.placement = TDM_MOE_PLACE_DEVICE;
  /* A caller's own preset with counts no model has, or whose products wrap: refused before
   * any size is computed from it. */
  const struct {
    int hidden, experts, topk, ffn, layers, max_tokens;
  } shapes[] = {{0, 8, 2, 64, 2, 8},       {64, 8, 9, 64, 2, 8},       {64, 8, 2, -64, 2, 8},
                {64, 0, 0, 64, 2, 8},      {64, 8, 2, 64, -1, 8},      {1 << 20, 8, 2, 1 << 20, 2, 8},
                {4096, 128, 8, 1536, 2, 1 << 19}, {64, 8, 2, 64, 2, (1 << 20) + 1}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    tdm_moe_preset bad = *p;
    bad.hidden = shapes[i].hidden;
    bad.experts = shapes[i].experts;
    bad.topk = shapes[i].topk;
    bad.ffn = shapes[i].ffn;
    bad.layers = shapes[i].layers;
    c.preset = &bad;
    c.max_tokens = shapes[i].max_tokens;
    CHECK_RC(tdm_moe_model_create(&c, &m), TDM_EINVAL);
    CHECK_MSG(strstr(tdm_last_error(), "shape") || strstr(tdm_last_error(), "too large"),
              "shape %zu: %s", i, tdm_last_error());
  }
  CHECK(m == NULL);
  th_close();
}
