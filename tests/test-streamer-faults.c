/* test-streamer-faults.c: the expert streamer under failure (cpu:0, opencl:0, cuda:0), written
 * against the public headers only, as tests/test-faults.c does for the runtime:
 *
 * - fault_create, fault_acquire, fault_release, fault_prefetch, fault_destroy loop n = 0, 1, ...
 *   making the nth host allocation and/or backend call of one streamer call fail (the
 *   streamer's own allocations pass tdm_fault_point), until the call succeeds. Each iteration
 *   must end either in success with no fault fired, or in the injected code with a message of
 *   its own, with nothing lost: out-parameters untouched, the expert still pinned after a
 *   failed release, every expert readable with its own bytes afterwards, a slot never
 *   overwritten under a reader; and, once the streamer is destroyed, the live counts of
 *   tdm_stats_get back at the baseline (no queue, event or allocation leaked). Work submitted
 *   during the call is held back behind gated host tasks on the compute and copy queues, so
 *   that no tandem thread makes fallible calls of its own while a fault is armed.
 * - fault_destroy also keeps a reader of a slot pending on the compute queue: whichever step
 *   fails, the slots must still be allocated when that reader runs.
 * - failed_copy_is_redone makes the nth native call tandem's threads make (TDM_FAULT_NATIVE)
 *   fail while an expert is copied and read: once the compute queue's sync has reported the
 *   failure, the expert must be readable again with its own bytes.
 */
#include "harness.h"

#include <tandem/streamer.h>

enum { XB = 4096, NX = 8, MAX_ITER = 500 };

static const unsigned fault_kinds[] = {TDM_FAULT_ALLOC, TDM_FAULT_BACKEND,
                                       TDM_FAULT_ALLOC | TDM_FAULT_BACKEND};
static const char *const fault_kind_name[] = {"alloc", "backend", "alloc+backend"};

#define SENTINEL_PTR ((const void *)(uintptr_t)0x5e)
#define SENTINEL_EVENT ((tdm_event *)(uintptr_t)0x5e)
#define SENTINEL_STREAMER ((tdm_streamer *)(uintptr_t)0x5e)

/* Everything the iterations share; set up once per case. */
static struct fx {
  tdm_device *dev;
  tdm_queue *q;        /* the compute queue */
  unsigned char *host; /* pinned, NX experts of XB bytes, random */
  const void *ptrs[NX];
  unsigned char *back; /* pinned, NX * XB, for reading slots back */
  bool timing;         /* the device's queues can be timed (time_copies) */
  tdm_stats base;
} F;

/* ---- Baseline ------------------------------------------------------------------------------ */

static size_t tracked_count(tdm_queue *q) {
  tdm_event *deps[64];
  size_t n = 0;
  CHECK_OK(tdm_queue_dependencies(q, deps, 64, &n));
  for (size_t i = 0; i < n; i++) CHECK_OK(tdm_event_release(deps[i]));
  return n;
}

static void fx_settle(void) {
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_EQ(tracked_count(F.q), 0);
}

/* Live counts back at the baseline once the iteration's streamer is gone. Frees finish on
 * tandem's threads just after their work, so this polls; the limit turns a leak into a
 * failure instead of a hang. */
static void expect_baseline(const char *what, long n) {
  fx_settle();
  TH_EXPECT_STATS_BACK(&F.base, what, n);
}

static int task_ok(void *arg) {
  (void)arg;
  return 0;
}

static void fx_open(void) {
  uint64_t rng = th_seed();
  memset(&F, 0, sizeof F);
  F.dev = th_open();
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(F.dev, &info));
  F.timing = (info.caps & TDM_DEVICE_CAP_TIMING) != 0;
  CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_IN_ORDER, &F.q));
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_PINNED, (size_t)NX * XB, (void **)&F.host));
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_PINNED, (size_t)NX * XB, (void **)&F.back));
  th_fill_random(F.host, (size_t)NX * XB, &rng);
  for (int k = 0; k < NX; k++) F.ptrs[k] = F.host + (size_t)k * XB;
  /* Warm-up: the compute queue's tracker holds its one reference from now on. */
  CHECK_OK(tdm_host_task(F.q, task_ok, NULL, 0, NULL, NULL));
  fx_settle();
  CHECK_OK(tdm_stats_get(&F.base));
}

static void fx_close(void) {
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  CHECK_OK(tdm_free(F.host));
  CHECK_OK(tdm_free(F.back));
  CHECK_OK(tdm_queue_destroy(F.q));
  th_close();
}

/* ---- Arming and judging (as in test-faults.c) ---------------------------------------------- */

struct attempt {
  int rc, fired;
  char msg[512];
};

static void arm(unsigned kinds, long n) {
  CHECK_OK(tdm_fault_inject(kinds, n, 0));
  tdm_clear_error();
}

static struct attempt disarm(int rc) {
  struct attempt a;
  a.rc = rc;
  snprintf(a.msg, sizeof a.msg, "%s", tdm_last_error());
  a.fired = tdm_fault_fired();
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  return a;
}

/* 1 on success; on failure, checks the code is the injected one, with a message. */
static int judge(const char *what, unsigned kinds, long n, const struct attempt *a) {
  if (a->rc == 0) {
    CHECK_MSG(!a->fired, "%s, n=%ld: succeeded although the injected fault fired", what, n);
    return 1;
  }
  CHECK_MSG(a->fired, "%s, n=%ld: failed with %s (%s) but no fault fired", what, n,
            tdm_err_name(a->rc), a->msg);
  int want = (a->rc == TDM_ENOMEM && (kinds & TDM_FAULT_ALLOC)) ||
             (a->rc == TDM_EBACKEND && (kinds & TDM_FAULT_BACKEND));
  CHECK_MSG(want, "%s, n=%ld: failed with %s (%s), not the injected code", what, n,
            tdm_err_name(a->rc), a->msg);
  CHECK_MSG(th_message_fits(a->msg, a->rc, NULL), "%s, n=%ld: failed without a message of its "
            "own naming %s: \"%s\"", what, n, tdm_err_name(a->rc), a->msg);
  return 0;
}

static void fault_loop(const char *what, int (*try_once)(unsigned kinds, long n)) {
  for (size_t k = 0; k < sizeof fault_kinds / sizeof fault_kinds[0]; k++) {
    long n = 0;
    while (!try_once(fault_kinds[k], n)) {
      n++;
      CHECK_MSG(n < MAX_ITER, "%s: still failing after %d injected faults", what, MAX_ITER);
    }
    printf("%s [%s]: %ld failing point(s), then success\n", what, fault_kind_name[k], n);
  }
}

/* ---- Gates: work held back while a fault is armed ------------------------------------------ */

static int task_wait_gate(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : TDM_ETASK; }

/* One gate holding back the compute queue and the streamer's copy queues. */
struct hold {
  th_gate gate;
  tdm_event *ev[3];
};

static void hold_begin(struct hold *h, tdm_streamer *s) {
  tdm_queue *qs[3] = {F.q, NULL, NULL};
  th_gate_init(&h->gate);
  CHECK_OK(tdm_streamer_queues(s, &qs[1], &qs[2]));
  for (int i = 0; i < 3; i++)
    CHECK_OK(tdm_host_task(qs[i], task_wait_gate, &h->gate, 0, NULL, &h->ev[i]));
}

static void hold_end(struct hold *h) {
  th_gate_open(&h->gate);
  for (int i = 0; i < 3; i++) {
    CHECK_OK(tdm_event_wait(h->ev[i])); /* TDM_ETASK: the call blocked on held-back work */
    CHECK_OK(tdm_event_release(h->ev[i]));
  }
  th_gate_destroy(&h->gate);
}

/* ---- Streamers ------------------------------------------------------------------------------ */

/* One layer of NX experts. */
static tdm_streamer_config config(int budget_experts, int staging, tdm_cache_policy policy,
                                  int depth, bool timed) {
  tdm_streamer_config cfg = {.compute = F.q, .layers = 1, .experts = NX, .expert_bytes = XB,
                             .host = F.ptrs, .budget_bytes = (size_t)budget_experts * XB,
                             .staging_slots = staging, .policy = policy,
                             .prefetch_depth = depth, .time_copies = timed && F.timing};
  return cfg;
}

static tdm_streamer *open_streamer(tdm_streamer_config cfg) {
  tdm_streamer *s = NULL;
  CHECK_OK(tdm_streamer_create(&cfg, &s));
  return s;
}

static void sync_copies(tdm_streamer *s) {
  tdm_queue *d, *p;
  CHECK_OK(tdm_streamer_queues(s, &d, &p));
  CHECK_OK(tdm_queue_sync(d));
  CHECK_OK(tdm_queue_sync(p));
}

/* Expert e's slot, read back through the compute queue once the queue has run: its bytes. */
static void expect_expert(const char *what, long n, const void *w, int e) {
  CHECK_OK(tdm_memcpy(F.q, F.back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_MSG(memcmp(F.back, F.ptrs[e], XB) == 0, "%s, n=%ld: expert %d read back other bytes",
            what, n, e);
}

/* Acquires expert e, reads it back, releases it. */
static void use_expert(const char *what, long n, tdm_streamer *s, int e) {
  const void *w = NULL;
  CHECK_OK(tdm_streamer_acquire(s, 0, e, &w, NULL));
  expect_expert(what, n, w, e);
  CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
}

static void close_streamer(tdm_streamer *s) {
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_OK(tdm_streamer_destroy(s));
}

/* ---- Create --------------------------------------------------------------------------------- */

static tdm_streamer_config create_cfg;

/* A failed create leaves *out alone and nothing behind; a good one streams every expert. */
static int try_create(unsigned kinds, long n) {
  tdm_streamer *s = SENTINEL_STREAMER;
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_create(&create_cfg, &s));
  int ok = judge("tdm_streamer_create", kinds, n, &a);
  if (ok) {
    CHECK(s != SENTINEL_STREAMER && s != NULL);
    for (int e = 0; e < NX; e++) use_expert("tdm_streamer_create", n, s, e);
    close_streamer(s);
  } else {
    CHECK(s == SENTINEL_STREAMER);
  }
  expect_baseline("tdm_streamer_create", n);
  return ok;
}

TEST_CASE(fault_create) {
  fx_open();
  static const int resident[3] = {5, 2, 7};
  create_cfg = config(0, 2, TDM_CACHE_LRU, 0, false);
  fault_loop("tdm_streamer_create lru", try_create);
  create_cfg = config(3, 1, TDM_CACHE_STATIC, 0, true);
  create_cfg.resident = resident;
  create_cfg.nresident = 3;
  fault_loop("tdm_streamer_create static, timed", try_create);
  fx_close();
}

/* ---- Acquire -------------------------------------------------------------------------------- */

static bool acquire_timed;

/* A miss into the one slot, whose earlier expert a reader still reads behind the gate: a failed
 * acquire leaves its out-parameters and counts alone and never overwrites the slot under the
 * reader; the expert can be acquired afterwards. */
static int try_acquire_miss(unsigned kinds, long n) {
  tdm_streamer *s = open_streamer(config(0, 1, TDM_CACHE_LRU, 0, acquire_timed));
  const void *w0 = NULL, *w = SENTINEL_PTR;
  tdm_event *ready = SENTINEL_EVENT;
  CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w0, NULL));
  CHECK_OK(tdm_queue_sync(F.q));
  sync_copies(s);
  struct hold h;
  hold_begin(&h, s);
  CHECK_OK(tdm_memcpy(F.q, F.back + XB, w0, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 0, NULL));
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_acquire(s, 0, 1, &w, &ready));
  int ok = judge("tdm_streamer_acquire (miss)", kinds, n, &a);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.acquires, ok ? 2L : 1L);
  CHECK_EQ((long)st.misses, ok ? 2L : 1L);
  if (!ok) {
    CHECK(w == SENTINEL_PTR && ready == SENTINEL_EVENT);
    w = NULL;
    ready = NULL;
  }
  hold_end(&h);
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_MSG(memcmp(F.back + XB, F.ptrs[0], XB) == 0,
            "acquire, n=%ld: the slot was overwritten under its reader", n);
  if (!ok) CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w, &ready));
  expect_expert("tdm_streamer_acquire (miss)", n, w, 1);
  CHECK_OK(tdm_event_wait(ready));
  CHECK_OK(tdm_event_release(ready));
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  close_streamer(s);
  expect_baseline("tdm_streamer_acquire (miss)", n);
  return ok;
}

/* A prefetched expert whose copy is held back: the acquire makes the compute queue wait. */
static int try_acquire_inflight(unsigned kinds, long n) {
  tdm_streamer *s = open_streamer(config(0, 2, TDM_CACHE_LRU, 2, acquire_timed));
  const void *w = SENTINEL_PTR;
  tdm_event *ready = SENTINEL_EVENT;
  struct hold h;
  hold_begin(&h, s);
  CHECK_OK(tdm_streamer_prefetch(s, 0, (const int[]){3}, 1));
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_acquire(s, 0, 3, &w, &ready));
  int ok = judge("tdm_streamer_acquire (in flight)", kinds, n, &a);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.inflight_hits, ok ? 1L : 0L);
  if (!ok) {
    CHECK(w == SENTINEL_PTR && ready == SENTINEL_EVENT);
    w = NULL;
    ready = NULL;
  }
  hold_end(&h);
  if (!ok) CHECK_OK(tdm_streamer_acquire(s, 0, 3, &w, &ready));
  expect_expert("tdm_streamer_acquire (in flight)", n, w, 3);
  CHECK_OK(tdm_event_wait(ready));
  CHECK_OK(tdm_event_release(ready));
  CHECK_OK(tdm_streamer_release(s, 0, 3, NULL));
  close_streamer(s);
  expect_baseline("tdm_streamer_acquire (in flight)", n);
  return ok;
}

TEST_CASE(fault_acquire) {
  fx_open();
  for (int timed = 0; timed < 2; timed++) {
    acquire_timed = timed;
    printf("time_copies %s\n", timed && F.timing ? "on" : "off");
    fault_loop("tdm_streamer_acquire miss", try_acquire_miss);
    fault_loop("tdm_streamer_acquire in flight", try_acquire_inflight);
  }
  fx_close();
}

/* ---- Release -------------------------------------------------------------------------------- */

static bool release_given; /* the release names its event, rather than NULL */

/* The fifth release of an expert acquired five times, with the four before still pending: it
 * joins them into a barrier. A failed release keeps the pin (the release can be made again);
 * either way the slot is overwritten only after every reader. */
static int try_release(unsigned kinds, long n) {
  tdm_streamer *s = open_streamer(config(0, 1, TDM_CACHE_LRU, 0, false));
  const void *w = NULL;
  for (int k = 0; k < 5; k++) CHECK_OK(tdm_streamer_acquire(s, 0, 0, &w, NULL));
  CHECK_OK(tdm_queue_sync(F.q));
  sync_copies(s);
  struct hold h;
  hold_begin(&h, s);
  CHECK_OK(tdm_memcpy(F.q, F.back + XB, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  for (int k = 0; k < 4; k++) CHECK_OK(tdm_streamer_release(s, 0, 0, NULL));
  tdm_event *done = NULL;
  if (release_given) CHECK_OK(tdm_event_record(F.q, &done));
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_release(s, 0, 0, done));
  int ok = judge("tdm_streamer_release", kinds, n, &a);
  if (!ok) CHECK_OK(tdm_streamer_release(s, 0, 0, done)); /* still pinned */
  CHECK_RC(tdm_streamer_release(s, 0, 0, NULL), TDM_ESTATE);
  if (done) CHECK_OK(tdm_event_release(done));
  const void *w1 = NULL; /* the one slot again, after every reader */
  CHECK_OK(tdm_streamer_acquire(s, 0, 1, &w1, NULL));
  CHECK(w1 == w);
  CHECK_OK(tdm_memcpy(F.q, F.back + 2 * XB, w1, XB, TDM_COPY_D2H, 0, NULL, NULL));
  hold_end(&h);
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_MSG(memcmp(F.back + XB, F.ptrs[0], XB) == 0,
            "release, n=%ld: the slot was overwritten under its reader", n);
  CHECK_MSG(memcmp(F.back + 2 * XB, F.ptrs[1], XB) == 0,
            "release, n=%ld: the next expert read back other bytes", n);
  CHECK_OK(tdm_streamer_release(s, 0, 1, NULL));
  close_streamer(s);
  expect_baseline("tdm_streamer_release", n);
  return ok;
}

TEST_CASE(fault_release) {
  fx_open();
  release_given = false;
  fault_loop("tdm_streamer_release (recorded, joined)", try_release);
  release_given = true;
  fault_loop("tdm_streamer_release (given)", try_release);
  fx_close();
}

/* ---- Prefetch ------------------------------------------------------------------------------- */

static bool prefetch_timed;

/* Prefetches experts 0..2 behind the gate. A failed call may have started the copies before
 * the failing one (they count as prefetches); every expert is then acquired with its bytes,
 * those prefetched as prefetch hits and the rest as misses. */
static int try_prefetch(unsigned kinds, long n) {
  tdm_streamer *s = open_streamer(config(0, 3, TDM_CACHE_LRU, 3, prefetch_timed));
  struct hold h;
  hold_begin(&h, s);
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_prefetch(s, 0, (const int[]){0, 1, 2}, 3));
  int ok = judge("tdm_streamer_prefetch", kinds, n, &a);
  tdm_streamer_stats st;
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  long started = (long)st.prefetches;
  CHECK(ok ? started == 3 : started < 3);
  for (int e = 0; e < 3; e++)
    CHECK_EQ(tdm_streamer_where(s, 0, e) != TDM_EXPERT_ABSENT, e < started);
  hold_end(&h);
  for (int e = 0; e < 3; e++) use_expert("tdm_streamer_prefetch", n, s, e);
  CHECK_OK(tdm_streamer_stats_get(s, &st));
  CHECK_EQ((long)st.prefetch_hits, started);
  CHECK_EQ((long)st.misses, 3 - started);
  close_streamer(s);
  expect_baseline("tdm_streamer_prefetch", n);
  return ok;
}

TEST_CASE(fault_prefetch) {
  fx_open();
  for (int timed = 0; timed < 2; timed++) {
    prefetch_timed = timed;
    printf("time_copies %s\n", timed && F.timing ? "on" : "off");
    fault_loop("tdm_streamer_prefetch", try_prefetch);
  }
  fx_close();
}

/* ---- Destroy -------------------------------------------------------------------------------- */

/* A reader of a slot held back on the compute queue when the streamer is destroyed: when it
 * runs, it notes whether the slots are still allocated (the live allocation count is the one
 * seen before the destroy), then copies the slot out. */
struct late_reader {
  th_gate gate;
  long allocations; /* with the slots */
  atomic_int freed_early;
  atomic_int destroyed; /* the destroy has returned */
};

static int task_check_alive(void *arg) {
  struct late_reader *r = arg;
  tdm_stats st;
  if (tdm_stats_get(&st) != 0 || st.allocations != r->allocations)
    atomic_store(&r->freed_early, 1);
  return 0;
}

/* Opens the gate once the destroy has returned, or once the injected fault has fired and a
 * little time has passed (the destroy may then wait for the reader: a free that could not be
 * queued). The delay only gives a wrongly early free room to show; it decides nothing. */
static void *gate_opener(void *arg) {
  struct late_reader *r = arg;
  for (long waited = 0; !atomic_load(&r->destroyed) && waited < TH_HANG_MS; waited++) {
    if (tdm_fault_fired() && waited >= 20) break;
    th_sleep_ms(1);
  }
  th_gate_open(&r->gate);
  return NULL;
}

/* Whatever step fails, the destroy releases everything (the baseline), reports the first
 * failure, and frees the slots only after the pending reader. */
static int try_destroy(unsigned kinds, long n) {
  int resident[1] = {4};
  tdm_streamer_config cfg = config(1, 2, TDM_CACHE_STATIC, 0, true);
  cfg.resident = resident;
  cfg.nresident = 1;
  tdm_streamer *s = open_streamer(cfg);
  for (int e = 0; e < 3; e++) use_expert("tdm_streamer_destroy", n, s, e);
  CHECK_OK(tdm_streamer_prefetch(s, 0, (const int[]){5, 6}, 2));
  const void *w = NULL; /* a resident hit: no copy left for the destroy to wait for */
  CHECK_OK(tdm_queue_sync(F.q));
  sync_copies(s);
  CHECK_OK(tdm_streamer_acquire(s, 0, 4, &w, NULL));
  struct late_reader r;
  th_gate_init(&r.gate);
  atomic_init(&r.freed_early, 0);
  atomic_init(&r.destroyed, 0);
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  r.allocations = st.allocations;
  CHECK_OK(tdm_host_task(F.q, task_wait_gate, &r.gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(F.q, task_check_alive, &r, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(F.q, F.back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, 4, NULL));
  pthread_t opener;
  CHECK(pthread_create(&opener, NULL, gate_opener, &r) == 0);
  arm(kinds, n);
  struct attempt a = disarm(tdm_streamer_destroy(s));
  atomic_store(&r.destroyed, 1);
  CHECK(pthread_join(opener, NULL) == 0);
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_MSG(!atomic_load(&r.freed_early), "destroy, n=%ld: the slots were freed while a reader "
            "on the compute queue was still to run (%s)", n, a.msg);
  CHECK_MSG(memcmp(F.back, F.ptrs[4], XB) == 0, "destroy, n=%ld: the late reader read other "
            "bytes", n);
  th_gate_destroy(&r.gate);
  int ok = judge("tdm_streamer_destroy", kinds, n, &a);
  expect_baseline("tdm_streamer_destroy", n);
  return ok;
}

TEST_CASE(fault_destroy) {
  fx_open();
  fault_loop("tdm_streamer_destroy", try_destroy);
  fx_close();
}

/* ---- Failed copies -------------------------------------------------------------------------- */

/* With the nth native call of tandem's threads failing, expert e is acquired (a miss, or a
 * prefetch's in-flight hit), read back and released. Whatever failed, once the compute
 * queue's sync has reported it, the expert is read back again with its own bytes: a failed
 * copy is redone, and a failed reader frees its slot. */
static int native_round(tdm_streamer *s, int e, bool prefetch, long n) {
  const void *w = NULL;
  CHECK_OK(tdm_fault_inject(TDM_FAULT_NATIVE, n, 0));
  if (prefetch) CHECK_OK(tdm_streamer_prefetch(s, 0, &e, 1));
  CHECK_OK(tdm_streamer_acquire(s, 0, e, &w, NULL));
  CHECK_OK(tdm_memcpy(F.q, F.back, w, XB, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
  int sync = tdm_queue_sync(F.q);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", tdm_last_error());
  int fired = tdm_fault_fired();
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  if (!fired) {
    CHECK_MSG(sync == 0, "n=%ld: the sync failed with %s (%s) but no fault fired", n,
              tdm_err_name(sync), msg);
    CHECK_MSG(memcmp(F.back, F.ptrs[e], XB) == 0, "n=%ld: expert %d read back other bytes", n, e);
    return 1;
  }
  /* The failure may also have hit the sync's own marker, which then reports it on its event
   * only: sync again until it is clean, as a caller would. */
  while (sync != 0) {
    CHECK_MSG(sync == TDM_EBACKEND || sync == TDM_EDEP, "n=%ld: the sync returned %s (%s)", n,
              tdm_err_name(sync), msg);
    sync = tdm_queue_sync(F.q);
  }
  for (int k = 0; k < 2; k++) {
    const void *again = NULL;
    CHECK_OK(tdm_streamer_acquire(s, 0, e, &again, NULL));
    CHECK_OK(tdm_memcpy(F.q, F.back, again, XB, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_streamer_release(s, 0, e, NULL));
    CHECK_OK(tdm_queue_sync(F.q));
    CHECK_MSG(memcmp(F.back, F.ptrs[e], XB) == 0, "n=%ld: expert %d read back other bytes after "
              "its failure was reported (try %d)", n, e, k);
  }
  return 0;
}

TEST_CASE(failed_copy_is_redone) {
  fx_open();
  for (int prefetch = 0; prefetch < 2; prefetch++) {
    /* One slot: every round's expert evicts the last one, whose reader may have failed. */
    tdm_streamer *s = open_streamer(config(0, 1, TDM_CACHE_LRU, 1, false));
    long n = 0;
    while (!native_round(s, (int)(n % NX), prefetch, n)) {
      n++;
      CHECK_MSG(n < MAX_ITER, "still failing after %d injected faults", MAX_ITER);
    }
    printf("failed copies (%s): %ld failing point(s), then success\n",
           prefetch ? "prefetched" : "on demand", n);
    CHECK_OK(tdm_streamer_destroy(s));
    expect_baseline("failed copies", n);
  }
  fx_close();
}
