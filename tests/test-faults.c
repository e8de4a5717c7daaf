/* test-faults.c: fault injection (cpu:0, opencl:0, cuda:0). Each case loops n = 0, 1, 2, ...
 * making the nth host allocation and/or backend call of one operation fail, until the
 * operation succeeds. Between them the cases fail every fallible wrapper of the backend
 * gateway (src/core/backend.c) that the device's backend fills; the ones tandem's own threads
 * call after a submission returned (native waits and flushes, host-side copies) are failed
 * with TDM_FAULT_NATIVE by fault_native_completion, where the command, not the call, fails.
 *
 * Every iteration must end in one of two ways:
 * - success: no fault fired (the operation used fewer than n+1 fallible steps), the work runs,
 *   and the loop ends;
 * - the injected code (TDM_ENOMEM for allocations, TDM_EBACKEND for backend calls) with a
 *   message and nothing changed: out-parameters untouched, the host task or keep-alive release
 *   of the failed submission never runs, memory it would have written is unchanged, work
 *   submitted before it still completes, and the live-object counts of tdm_stats_get return
 *   to the baseline once the iteration has cleaned up.
 * The baseline is taken after a warm-up submission and a sync on every queue, because each
 * in-order queue's tracker keeps a reference to its last event.
 *
 * While a fault is armed, the work submitted before the operation is a host task held back by
 * a gate, so no tandem thread makes fallible calls of its own that could take the fault.
 */
#include "harness.h"

#ifdef TANDEM_TEST_SYCL
#include "sycl-native.h"
#endif
#ifdef TANDEM_TEST_CUDA
#include <cuda_runtime.h>
#endif

enum { N = 4096, MAX_ITER = 2000, PATTERN = 0x6b };

static const unsigned fault_kinds[] = {TDM_FAULT_ALLOC, TDM_FAULT_BACKEND,
                                       TDM_FAULT_ALLOC | TDM_FAULT_BACKEND};
static const char *const fault_kind_name[] = {"alloc", "backend", "alloc+backend"};

/* Everything the iterations share; set up once per case. */
struct fx {
  tdm_device *dev;
  tdm_queue *q, *r;
  unsigned char *src;  /* pinned, random */
  unsigned char *back; /* pinned, for reading device memory */
  unsigned char *dbuf; /* device memory that failed operations must leave alone */
  tdm_stats base;
  atomic_int releases; /* keep-alive releases that ran */
  int keep_ok;         /* keep-alive calls that succeeded */
  uint64_t rng;
};

static struct fx F;

#define SENTINEL_EVENT ((tdm_event *)(uintptr_t)0x5e)
#define SENTINEL_QUEUE ((tdm_queue *)(uintptr_t)0x5e)

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

static int task_wait_gate(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : 1; }

static void release_count(void *obj) { atomic_fetch_add((atomic_int *)obj, 1); }

/* ---- Baseline ---------------------------------------------------------------------------- */

static void fx_sync_all(void) {
  CHECK_OK(tdm_queue_sync(F.q));
  CHECK_OK(tdm_queue_sync(F.r));
}

/* Counts q's incomplete tracked entries (no injection armed). Asking for them also prunes
 * the tracker's completed entries, which puts the tracker in the same state every time. */
static size_t tracked_count_of(tdm_queue *q) {
  tdm_event *deps[64];
  size_t n = 0;
  CHECK_OK(tdm_queue_dependencies(q, deps, 64, &n));
  for (size_t i = 0; i < n; i++) CHECK_OK(tdm_event_release(deps[i]));
  return n;
}

static size_t tracked_count(void) { return tracked_count_of(F.q); }

/* Everything submitted has completed, and the trackers hold no completed entries: the state
 * in which the baseline is taken and compared. */
static void fx_settle(void) {
  fx_sync_all();
  CHECK_EQ(tracked_count_of(F.q), 0);
  CHECK_EQ(tracked_count_of(F.r), 0);
}

/* Live counts must come back to the baseline. Frees may finish on tandem's threads just after
 * the work they belong to completes, so this polls; the limit only turns a leak into a
 * failure instead of a hang. */
static void expect_baseline(const char *what, long n) {
  fx_settle();
  TH_EXPECT_STATS_BACK(&F.base, what, n);
}

static void fx_open(void) {
  memset(&F, 0, sizeof F);
  F.rng = th_seed();
  F.dev = th_open();
  CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_IN_ORDER, &F.q));
  CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_IN_ORDER, &F.r));
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_PINNED, N, (void **)&F.src));
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_PINNED, N, (void **)&F.back));
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_DEVICE, N, (void **)&F.dbuf));
  th_fill_random(F.src, N, &F.rng);
  /* Warm-up: one submission on each queue, so each tracker holds its one reference. */
  atomic_int dummy = 0;
  CHECK_OK(tdm_host_task(F.q, task_count, &dummy, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(F.r, task_count, &dummy, 0, NULL, NULL));
  fx_settle();
  /* The warm-up's events are freed by the threads that completed them, possibly just after
   * the sync returned: the baseline waits for them, so none is counted in it. */
  for (long waited = 0; waited < TH_HANG_MS; waited++) {
    CHECK_OK(tdm_stats_get(&F.base));
    if (F.base.events == 0 && F.base.pending == 0) break;
    th_sleep_ms(1);
  }
  CHECK_EQ(F.base.events, 0);
  CHECK_EQ(F.base.pending, 0);
}

static void fx_close(void) {
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  CHECK_OK(tdm_free(F.src));
  CHECK_OK(tdm_free(F.back));
  CHECK_OK(tdm_free(F.dbuf));
  CHECK_OK(tdm_queue_destroy(F.q));
  CHECK_OK(tdm_queue_destroy(F.r));
  th_close();
}

/* ---- Arming and judging ------------------------------------------------------------------ */

struct attempt {
  int rc;
  int fired;
  char msg[256];
};

/* Clears the message last, so that the message disarm() reads is the operation's own. */
static void arm(unsigned kinds, long n) {
  CHECK_OK(tdm_fault_inject(kinds, n, 0));
  tdm_clear_error();
}

/* Reads the message before any other tandem call, then whether the fault fired, then
 * disarms (in that order: tdm_fault_inject resets the fired flag). */
static struct attempt disarm(int rc) {
  struct attempt a;
  a.rc = rc;
  snprintf(a.msg, sizeof a.msg, "%s", tdm_last_error());
  a.fired = tdm_fault_fired();
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  return a;
}

/* Returns 1 on success. On failure, checks that the code is the injected one. */
static int judge(const char *what, unsigned kinds, long n, const struct attempt *a) {
  if (a->rc == 0) {
    CHECK_MSG(!a->fired, "%s, n=%ld: succeeded although the injected fault fired", what, n);
    return 1;
  }
  CHECK_MSG(a->fired, "%s, n=%ld: failed with %s (%s) but no fault fired", what, n,
            tdm_err_name(a->rc), a->msg);
  int want_alloc = a->rc == TDM_ENOMEM && (kinds & TDM_FAULT_ALLOC);
  int want_backend = a->rc == TDM_EBACKEND && (kinds & TDM_FAULT_BACKEND);
  CHECK_MSG(want_alloc || want_backend, "%s, n=%ld: failed with %s, not the injected code", what,
            n, tdm_err_name(a->rc));
  CHECK_MSG(th_message_fits(a->msg, a->rc, NULL), "%s, n=%ld: failed without a message of its "
            "own naming %s: \"%s\"", what, n, tdm_err_name(a->rc), a->msg);
  return 0;
}

/* Runs try_once(kinds, n) for n = 0, 1, ... until it reports success, for every kind set. */
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

/* ---- Work submitted before the operation ------------------------------------------------- */

/* A host task held back by a gate, on queue q: it must still complete whatever happens to the
 * operation submitted after it. */
struct prior {
  th_gate gate;
  tdm_event *ev;
};

static void prior_begin(struct prior *p, tdm_queue *q) {
  th_gate_init(&p->gate);
  p->ev = NULL;
  CHECK_OK(tdm_host_task(q, task_wait_gate, &p->gate, 0, NULL, &p->ev));
}

static void prior_end(struct prior *p) {
  th_gate_open(&p->gate);
  int rc = tdm_event_wait(p->ev);
  /* Only this thread opens the gate, after the operation returned: if the held-back task
   * gave up waiting, the operation blocked its caller on the earlier work. */
  CHECK_MSG(rc != TDM_ETASK, "the operation blocked the calling thread until earlier work "
            "completed (a held-back task's gate, opened only after the call returned, timed out)");
  CHECK_OK(rc);
  CHECK_OK(tdm_event_release(p->ev));
  th_gate_destroy(&p->gate);
}

/* Device buffer dbuf holds PATTERN everywhere. */
static void dbuf_reset(void) {
  CHECK_OK(tdm_memset(F.q, F.dbuf, PATTERN, N, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(F.q));
}

/* dbuf holds the source data (written == 1) or still PATTERN (written == 0). */
static void dbuf_expect(int written) {
  CHECK_OK(tdm_memcpy(F.q, F.back, F.dbuf, N, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(F.q));
  if (written) {
    CHECK_MEM_EQ(F.back, F.src, N);
  } else {
    for (size_t i = 0; i < N; i++)
      CHECK_MSG(F.back[i] == PATTERN, "a failed copy changed device byte %zu", i);
  }
}

/* ---- Queue creation and destruction ------------------------------------------------------ */

static int try_queue_create_flags(unsigned kinds, long n, unsigned flags) {
  tdm_queue *nq = SENTINEL_QUEUE;
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_create(F.dev, flags, &nq));
  int ok = judge("tdm_queue_create", kinds, n, &a);
  if (ok) {
    atomic_int ran = 0;
    CHECK(nq != SENTINEL_QUEUE && nq != NULL);
    CHECK_OK(tdm_host_task(nq, task_count, &ran, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(nq));
    CHECK_EQ(atomic_load(&ran), 1);
    CHECK_OK(tdm_queue_destroy(nq));
  } else {
    CHECK(nq == SENTINEL_QUEUE);
  }
  expect_baseline("tdm_queue_create", n);
  return ok;
}

static int try_queue_create_in_order(unsigned kinds, long n) {
  return try_queue_create_flags(kinds, n, TDM_QUEUE_IN_ORDER);
}
static int try_queue_create_ooo(unsigned kinds, long n) {
  return try_queue_create_flags(kinds, n, TDM_QUEUE_OUT_OF_ORDER | TDM_QUEUE_TIMING);
}

TEST_CASE(fault_queue_create) {
  fx_open();
  fault_loop("tdm_queue_create in-order", try_queue_create_in_order);
  fault_loop("tdm_queue_create out-of-order", try_queue_create_ooo);
  fx_close();
}

/* Teardown: a failed destroy leaves the queue alive and usable. */
static int try_queue_destroy(unsigned kinds, long n) {
  tdm_queue *nq = NULL;
  atomic_int ran = 0;
  CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_IN_ORDER, &nq));
  CHECK_OK(tdm_host_task(nq, task_count, &ran, 0, NULL, NULL));
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_destroy(nq));
  int ok = judge("tdm_queue_destroy", kinds, n, &a);
  if (ok) {
    CHECK_EQ(atomic_load(&ran), 1); /* drained */
  } else {
    unsigned flags = 99;
    CHECK_OK(tdm_queue_flags(nq, &flags));
    CHECK_OK(tdm_host_task(nq, task_count, &ran, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(nq));
    CHECK_EQ(atomic_load(&ran), 2);
    CHECK_OK(tdm_queue_destroy(nq));
  }
  expect_baseline("tdm_queue_destroy", n);
  return ok;
}

TEST_CASE(fault_queue_destroy) {
  fx_open();
  fault_loop("tdm_queue_destroy", try_queue_destroy);
  fx_close();
}

/* ---- Copies ------------------------------------------------------------------------------ */

/* H2D into dbuf with a dependency and an out event, from pinned or pageable memory (the
 * pageable path reserves staging). */
static int try_memcpy_from(unsigned kinds, long n, const unsigned char *src) {
  struct prior p;
  tdm_event *out = SENTINEL_EVENT;
  dbuf_reset();
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_memcpy(F.q, F.dbuf, src, N, TDM_COPY_H2D, 1, &p.ev, &out));
  int ok = judge("tdm_memcpy", kinds, n, &a);
  prior_end(&p);
  fx_sync_all();
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
  } else {
    CHECK(out == SENTINEL_EVENT);
  }
  dbuf_expect(ok);
  expect_baseline("tdm_memcpy", n);
  return ok;
}

static int try_memcpy_pinned(unsigned kinds, long n) { return try_memcpy_from(kinds, n, F.src); }

static unsigned char *pageable_src;
static int try_memcpy_pageable(unsigned kinds, long n) {
  return try_memcpy_from(kinds, n, pageable_src);
}

TEST_CASE(fault_memcpy) {
  fx_open();
  pageable_src = malloc(N);
  memcpy(pageable_src, F.src, N);
  fault_loop("tdm_memcpy pinned", try_memcpy_pinned);
  fault_loop("tdm_memcpy pageable", try_memcpy_pageable);
  free(pageable_src);
  fx_close();
}

/* Cross-queue copy from q to r into dbuf: both steps or neither. */
static int try_memcpy_cross(unsigned kinds, long n) {
  struct prior p;
  tdm_event *out = SENTINEL_EVENT;
  unsigned char *dsrc = NULL;
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_DEVICE, N, (void **)&dsrc));
  CHECK_OK(tdm_memcpy(F.q, dsrc, F.src, N, TDM_COPY_H2D, 0, NULL, NULL));
  dbuf_reset();
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_memcpy_cross(F.q, F.r, F.dbuf, dsrc, N, 1, &p.ev, &out));
  int ok = judge("tdm_memcpy_cross", kinds, n, &a);
  prior_end(&p);
  fx_sync_all();
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
  } else {
    CHECK(out == SENTINEL_EVENT);
  }
  dbuf_expect(ok);
  CHECK_OK(tdm_free(dsrc));
  expect_baseline("tdm_memcpy_cross", n);
  return ok;
}

TEST_CASE(fault_memcpy_cross) {
  fx_open();
  fault_loop("tdm_memcpy_cross", try_memcpy_cross);
  fx_close();
}

/* ---- Host tasks, keep-alive, markers, waits ---------------------------------------------- */

static int try_host_task(unsigned kinds, long n) {
  struct prior p;
  atomic_int ran = 0;
  tdm_event *out = SENTINEL_EVENT;
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_host_task(F.q, task_count, &ran, 1, &p.ev, &out));
  int ok = judge("tdm_host_task", kinds, n, &a);
  prior_end(&p);
  fx_sync_all();
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
    CHECK_EQ(atomic_load(&ran), 1);
  } else {
    CHECK(out == SENTINEL_EVENT);
    CHECK_MSG(atomic_load(&ran) == 0, "the host task of a failed submission ran");
  }
  expect_baseline("tdm_host_task", n);
  return ok;
}

TEST_CASE(fault_host_task) {
  fx_open();
  fault_loop("tdm_host_task", try_host_task);
  fx_close();
}

static int try_keep_alive(unsigned kinds, long n) {
  struct prior p;
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_keep_alive(F.q, release_count, &F.releases));
  int ok = judge("tdm_keep_alive", kinds, n, &a);
  if (ok) F.keep_ok++;
  prior_end(&p);
  fx_sync_all();
  CHECK_MSG(th_wait_atomic(&F.releases, F.keep_ok, TH_HANG_MS), "a keep-alive release never ran");
  CHECK_MSG(atomic_load(&F.releases) <= F.keep_ok, "the release of a failed keep-alive ran");
  expect_baseline("tdm_keep_alive", n);
  return ok;
}

TEST_CASE(fault_keep_alive) {
  fx_open();
  fault_loop("tdm_keep_alive", try_keep_alive);
  int keep_ok = F.keep_ok;
  fx_close(); /* joins the release thread: every release that will ever run has run */
  CHECK_EQ(atomic_load(&F.releases), keep_ok);
}

static int try_record(unsigned kinds, long n) {
  struct prior p;
  tdm_event *out = SENTINEL_EVENT;
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_event_record(F.q, &out));
  int ok = judge("tdm_event_record", kinds, n, &a);
  if (ok) CHECK_RC(tdm_event_query(out), TDM_EAGAIN); /* the prior task is held back */
  prior_end(&p);
  fx_sync_all();
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
  } else {
    CHECK(out == SENTINEL_EVENT);
  }
  expect_baseline("tdm_event_record", n);
  return ok;
}

TEST_CASE(fault_record) {
  fx_open();
  fault_loop("tdm_event_record", try_record);
  fx_close();
}

/* q waits on r's held-back task. If the wait failed, q must not wait for anything: a host task
 * submitted to q afterwards completes while r is still held back. */
static int try_queue_wait(unsigned kinds, long n) {
  struct prior p;
  atomic_int ran = 0;
  tdm_event *et = NULL;
  prior_begin(&p, F.r);
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_wait(F.q, p.ev));
  int ok = judge("tdm_queue_wait", kinds, n, &a);
  CHECK_OK(tdm_host_task(F.q, task_count, &ran, 0, NULL, &et));
  if (ok) {
    CHECK_RC(tdm_event_query(et), TDM_EAGAIN);
  } else {
    CHECK_MSG(th_event_wait_limited(et, TH_HANG_MS) == 0,
              "after a failed tdm_queue_wait the queue still waits");
  }
  prior_end(&p);
  fx_sync_all();
  CHECK_OK(tdm_event_wait(et));
  CHECK_OK(tdm_event_release(et));
  CHECK_EQ(atomic_load(&ran), 1);
  expect_baseline("tdm_queue_wait", n);
  return ok;
}

TEST_CASE(fault_queue_wait) {
  fx_open();
  fault_loop("tdm_queue_wait", try_queue_wait);
  fx_close();
}

/* ---- Order tracking ---------------------------------------------------------------------- */

static int try_track(unsigned kinds, long n) {
  struct prior p;
  prior_begin(&p, F.r);
  size_t before = tracked_count();
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_track(F.q, p.ev));
  int ok = judge("tdm_queue_track", kinds, n, &a);
  CHECK_EQ(tracked_count(), before + (ok ? 1 : 0));
  prior_end(&p);
  fx_sync_all();
  expect_baseline("tdm_queue_track", n);
  return ok;
}

/* cap = 1 with two pending entries forces a collapse into a barrier. */
static int try_dependencies_collapse(unsigned kinds, long n) {
  struct prior pr, pq;
  tdm_event *one = SENTINEL_EVENT;
  size_t got = 99;
  prior_begin(&pr, F.r);
  prior_begin(&pq, F.q);
  CHECK_OK(tdm_queue_track(F.q, pr.ev));
  CHECK_EQ(tracked_count(), 2);
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_dependencies(F.q, &one, 1, &got));
  int ok = judge("tdm_queue_dependencies", kinds, n, &a);
  if (ok) {
    CHECK_EQ(got, 1);
    CHECK_RC(tdm_event_query(one), TDM_EAGAIN);
  } else {
    CHECK(one == SENTINEL_EVENT);
    CHECK_EQ(got, 99);
    CHECK_EQ(tracked_count(), 2);
  }
  prior_end(&pr);
  prior_end(&pq);
  if (ok) {
    CHECK_OK(tdm_event_wait(one));
    CHECK_OK(tdm_event_release(one));
  }
  fx_sync_all();
  expect_baseline("tdm_queue_dependencies", n);
  return ok;
}

TEST_CASE(fault_tracker) {
  fx_open();
  fault_loop("tdm_queue_track", try_track);
  fault_loop("tdm_queue_dependencies (collapse)", try_dependencies_collapse);
  fx_close();
}

/* ---- Memory ------------------------------------------------------------------------------ */

/* A failed stream-ordered free leaves the memory allocated and usable. */
static int try_free_async(unsigned kinds, long n) {
  struct prior p;
  void *d = NULL;
  tdm_event *out = SENTINEL_EVENT;
  CHECK_OK(tdm_malloc(F.dev, TDM_MEM_DEVICE, N, &d));
  CHECK_OK(tdm_memcpy(F.q, d, F.src, N, TDM_COPY_H2D, 0, NULL, NULL));
  prior_begin(&p, F.q);
  arm(kinds, n);
  struct attempt a = disarm(tdm_free_async(F.q, d, 1, &p.ev, &out));
  int ok = judge("tdm_free_async", kinds, n, &a);
  prior_end(&p);
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
  } else {
    CHECK(out == SENTINEL_EVENT);
    CHECK_OK(tdm_memcpy(F.q, F.back, d, N, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(F.q));
    CHECK_MEM_EQ(F.back, F.src, N);
    CHECK_OK(tdm_free(d));
  }
  fx_sync_all();
  expect_baseline("tdm_free_async", n);
  return ok;
}

TEST_CASE(fault_free_async) {
  fx_open();
  fault_loop("tdm_free_async", try_free_async);
  fx_close();
}

static int try_malloc_kind(unsigned kinds, long n, tdm_mem_kind kind) {
  void *ptr = (void *)(uintptr_t)0x5e;
  arm(kinds, n);
  struct attempt a = disarm(tdm_malloc(F.dev, kind, N, &ptr));
  int ok = judge("tdm_malloc", kinds, n, &a);
  if (ok)
    CHECK_OK(tdm_free(ptr));
  else
    CHECK(ptr == (void *)(uintptr_t)0x5e);
  expect_baseline("tdm_malloc", n);
  return ok;
}

static int try_malloc_device(unsigned kinds, long n) {
  return try_malloc_kind(kinds, n, TDM_MEM_DEVICE);
}
static int try_malloc_pinned(unsigned kinds, long n) {
  return try_malloc_kind(kinds, n, TDM_MEM_PINNED);
}

static int try_host_register(unsigned kinds, long n) {
  void *mem = aligned_alloc(4096, 4 * 4096);
  tdm_mem_info info;
  CHECK(mem != NULL);
  arm(kinds, n);
  struct attempt a = disarm(tdm_host_register(F.dev, mem, 4 * 4096));
  int ok = judge("tdm_host_register", kinds, n, &a);
  CHECK_OK(tdm_mem_query(mem, &info));
  CHECK_EQ(info.kind, ok ? TDM_MEM_REGISTERED : TDM_MEM_HOST);
  if (ok) CHECK_OK(tdm_host_unregister(mem));
  free(mem);
  expect_baseline("tdm_host_register", n);
  return ok;
}

TEST_CASE(fault_memory) {
  fx_open();
  fault_loop("tdm_malloc device", try_malloc_device);
  fault_loop("tdm_malloc pinned", try_malloc_pinned);
  fault_loop("tdm_host_register", try_host_register);
  fx_close();
}

/* ---- Initialization ---------------------------------------------------------------------- */

/* A failed first tdm_init leaves tandem uninitialized, and a later one works. A backend that
 * fails to start may instead be listed as refused while init succeeds (how a missing GPU
 * driver is handled): then the fault must show in that backend's status. */
static int backends_refused(void) {
  int nb = 0, refused = 0;
  tdm_backend_info bi;
  CHECK_OK(tdm_backend_count(&nb));
  for (int i = 0; i < nb; i++) {
    CHECK_OK(tdm_backend_get(i, &bi));
    if (bi.status == TDM_ENOMEM || bi.status == TDM_EBACKEND) refused++;
  }
  return refused;
}

static int try_init(unsigned kinds, long n) {
  int count = -1;
  arm(kinds, n);
  struct attempt a = disarm(tdm_init());
  if (a.rc == 0 && a.fired) {
    CHECK_MSG(backends_refused() > 0, "tdm_init, n=%ld: a fault fired but nothing reports it", n);
    CHECK_OK(tdm_shutdown());
    return 0;
  }
  int ok = judge("tdm_init", kinds, n, &a);
  if (ok) {
    CHECK_OK(tdm_device_count(&count));
    CHECK(count >= 1);
    CHECK_EQ(backends_refused(), 0);
    CHECK_OK(tdm_shutdown());
  } else {
    CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT);
    CHECK_EQ(count, -1);
  }
  return ok;
}

TEST_CASE(fault_init) {
  fault_loop("tdm_init", try_init);
  /* Usable afterwards. */
  tdm_device *dev = th_open();
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Native handles (interop) -------------------------------------------------------------- */

/* Entries a backend may leave out answer TDM_ENOTSUP with a message, whether or not a fault is
 * armed; returns 1 (and prints why) when the call is one of those. */
static int unsupported(const char *what, int rc) {
  if (rc != TDM_ENOTSUP) return 0;
  CHECK_MSG(tdm_last_error()[0] != '\0', "%s: TDM_ENOTSUP without a message", what);
  printf("%s: not supported on %s (%s)\n", what, th_backend_of(F.dev), tdm_last_error());
  return 1;
}

#define SENTINEL_PTR ((void *)(uintptr_t)0x5e)

static int try_queue_native(unsigned kinds, long n) {
  void *native = SENTINEL_PTR;
  arm(kinds, n);
  struct attempt a = disarm(tdm_queue_native(F.q, &native));
  int ok = judge("tdm_queue_native", kinds, n, &a);
  CHECK(ok ? native != SENTINEL_PTR : native == SENTINEL_PTR);
  expect_baseline("tdm_queue_native", n);
  return ok;
}

static int try_device_native(unsigned kinds, long n) {
  void *native = SENTINEL_PTR;
  arm(kinds, n);
  struct attempt a = disarm(tdm_device_native(F.dev, &native));
  int ok = judge("tdm_device_native", kinds, n, &a);
  CHECK(ok ? native != SENTINEL_PTR : native == SENTINEL_PTR);
  expect_baseline("tdm_device_native", n);
  return ok;
}

static int try_mem_native(unsigned kinds, long n) {
  void *native = SENTINEL_PTR;
  size_t off = 99;
  arm(kinds, n);
  struct attempt a = disarm(tdm_mem_native(F.dbuf + 16, &native, &off));
  int ok = judge("tdm_mem_native", kinds, n, &a);
  if (ok) {
    CHECK(native != SENTINEL_PTR);
    CHECK(off <= 16);
  } else {
    CHECK(native == SENTINEL_PTR);
    CHECK_EQ(off, 99);
  }
  expect_baseline("tdm_mem_native", n);
  return ok;
}

TEST_CASE(fault_native_handles) {
  fx_open();
  void *native = NULL;
  size_t off = 0;
  if (!unsupported("tdm_queue_native", tdm_queue_native(F.q, &native)))
    fault_loop("tdm_queue_native", try_queue_native);
  if (!unsupported("tdm_device_native", tdm_device_native(F.dev, &native)))
    fault_loop("tdm_device_native", try_device_native);
  if (!unsupported("tdm_mem_native", tdm_mem_native(F.dbuf, &native, &off)))
    fault_loop("tdm_mem_native", try_mem_native);
  fx_close();
}

/* ---- Imports ------------------------------------------------------------------------------- */

/* Device memory tandem does not know, as tdm_mem_import takes it: OpenCL, a cl_mem of the
 * device's context (here the one behind an allocation of tandem's own, which the import then
 * aliases); CUDA, a cudaMalloc pointer. NULL where the backend imports nothing. */
static void *foreign_mem, *foreign_owner, *foreign_ctx;

static void foreign_open(void) {
  foreign_mem = foreign_owner = NULL;
  const char *b = th_backend_of(F.dev);
  if (strcmp(b, "opencl") == 0) {
    size_t off = 0;
    CHECK_OK(tdm_malloc(F.dev, TDM_MEM_DEVICE, N, &foreign_owner));
    CHECK_OK(tdm_mem_native(foreign_owner, &foreign_mem, &off));
    CHECK_EQ(off, 0);
  } else if (strcmp(b, "cuda") == 0) {
#ifdef TANDEM_TEST_CUDA
    CHECK(cudaMalloc(&foreign_mem, N) == cudaSuccess);
#else
    TH_SKIP("this build has no CUDA runtime for the test");
#endif
  } else if (strcmp(b, "sycl") == 0) {
#ifdef TANDEM_TEST_SYCL
    CHECK_OK(tdm_device_native(F.dev, &foreign_ctx));
    CHECK((foreign_mem = tsy_malloc_device(foreign_ctx, N)) != NULL); /* dpnp's USM, say */
#else
    TH_SKIP("this build has no SYCL runtime for the test");
#endif
  }
}

static void foreign_close(void) {
  if (foreign_owner) CHECK_OK(tdm_free(foreign_owner));
#ifdef TANDEM_TEST_SYCL
  else if (foreign_ctx)
    tsy_free(foreign_ctx, foreign_mem);
#endif
#ifdef TANDEM_TEST_CUDA
  else if (foreign_mem)
    CHECK(cudaFree(foreign_mem) == cudaSuccess);
#endif
  foreign_mem = foreign_owner = foreign_ctx = NULL;
}

/* A failed import leaves nothing registered; a good one is usable for copies, and freeing it
 * leaves the foreign memory to its owner. */
static int try_mem_import(unsigned kinds, long n) {
  void *p = SENTINEL_PTR;
  arm(kinds, n);
  struct attempt a = disarm(tdm_mem_import(F.dev, foreign_mem, N, &p));
  int ok = judge("tdm_mem_import", kinds, n, &a);
  if (ok) {
    tdm_mem_info info;
    CHECK_OK(tdm_mem_query(p, &info));
    CHECK_EQ(info.kind, TDM_MEM_DEVICE);
    CHECK_OK(tdm_memcpy(F.q, p, F.src, N, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(F.q, F.back, p, N, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(F.q));
    CHECK_MEM_EQ(F.back, F.src, N);
    CHECK_OK(tdm_free(p));
  } else {
    CHECK(p == SENTINEL_PTR);
  }
  expect_baseline("tdm_mem_import", n);
  return ok;
}

TEST_CASE(fault_mem_import) {
  fx_open();
  foreign_open();
  void *p = NULL;
  if (!foreign_mem) {
    int dummy = 0;
    CHECK(unsupported("tdm_mem_import", tdm_mem_import(F.dev, &dummy, N, &p)));
  } else {
    fx_settle();
    CHECK_OK(tdm_stats_get(&F.base)); /* with the foreign memory's owner */
    fault_loop("tdm_mem_import", try_mem_import);
  }
  foreign_close();
  fx_close();
}

/* An event of the device's native queue (a tandem record's), imported as other code's. */
static tdm_event *import_src;

static int try_event_import(unsigned kinds, long n) {
  void *native = NULL;
  tdm_event *out = SENTINEL_EVENT;
  CHECK_OK(tdm_event_native(import_src, &native));
  arm(kinds, n);
  struct attempt a = disarm(tdm_event_import(F.dev, native, &out));
  int ok = judge("tdm_event_import", kinds, n, &a);
  if (ok) {
    CHECK_OK(tdm_event_wait(out));
    CHECK_OK(tdm_event_release(out));
  } else {
    CHECK(out == SENTINEL_EVENT);
  }
  expect_baseline("tdm_event_import", n);
  return ok;
}

TEST_CASE(fault_event_import) {
  fx_open();
  void *native = NULL;
  tdm_event *first = NULL;
  CHECK_OK(tdm_event_record(F.q, &import_src));
  CHECK_OK(tdm_event_wait(import_src));
  int rc = tdm_event_native(import_src, &native);
  if (rc == TDM_ENOTSUP || (rc == 0 && tdm_event_import(F.dev, native, &first) == TDM_ENOTSUP)) {
    printf("tdm_event_import: no native events on %s (%s)\n", th_backend_of(F.dev),
           tdm_last_error());
  } else {
    CHECK_OK(rc);
    CHECK(first != NULL);
    /* The first import makes the device's import queue, which lives until shutdown: the
     * baseline includes it. */
    CHECK_OK(tdm_event_wait(first));
    CHECK_OK(tdm_event_release(first));
    fx_settle();
    CHECK_OK(tdm_stats_get(&F.base));
    fault_loop("tdm_event_import", try_event_import);
  }
  CHECK_OK(tdm_event_release(import_src));
  fx_close();
}

/* Timing: backends without native timing use the host clock and have nothing to fail. */
static tdm_event *timed[2];

static int try_event_elapsed(unsigned kinds, long n) {
  double ms = -1;
  arm(kinds, n);
  struct attempt a = disarm(tdm_event_elapsed(timed[0], timed[1], &ms));
  int ok = judge("tdm_event_elapsed", kinds, n, &a);
  CHECK(ok ? ms >= 0 : ms == -1);
  return ok;
}

TEST_CASE(fault_event_elapsed) {
  fx_open();
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(F.dev, &info));
  if (!(info.caps & TDM_DEVICE_CAP_TIMING)) {
    printf("tdm_event_elapsed: %s has no timing\n", info.id);
  } else {
    tdm_queue *tq = NULL;
    CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_IN_ORDER | TDM_QUEUE_TIMING, &tq));
    CHECK_OK(tdm_event_record(tq, &timed[0]));
    CHECK_OK(tdm_memcpy(tq, F.dbuf, F.src, N, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_event_record(tq, &timed[1]));
    CHECK_OK(tdm_queue_sync(tq));
    fault_loop("tdm_event_elapsed", try_event_elapsed);
    CHECK_OK(tdm_event_release(timed[0]));
    CHECK_OK(tdm_event_release(timed[1]));
    CHECK_OK(tdm_queue_destroy(tq));
  }
  fx_close();
}

/* ---- Completion: backend calls tandem's own threads make ------------------------------------
 * With TDM_FAULT_NATIVE armed, the nth native wait, flush or host-side copy that the executor
 * or a pool thread makes fails. Submitting never takes such a fault, so every call succeeds;
 * a fault that fired must then show as TDM_EBACKEND in the queue's next sync (the first error
 * since the last one, or the sync marker's own), with every other command complete (done or
 * TDM_EDEP), nothing hung, and nothing leaked (a record whose own wait failed reports it
 * on its event instead); the sync after that is clean and the queue works. n runs until a round passes with no fault fired. The round mixes what completes
 * natively: an H2D copy with an event, a quiet fill (the executor flushes for it), a
 * pageable D2H copy (host-side on native backends), a host task (gated) and a record, on an
 * in-order and an out-of-order queue. */
static unsigned char *pageable_back;

static int round_status_ok(int rc) { return rc == 0 || rc == TDM_EBACKEND || rc == TDM_EDEP; }

static int native_round(tdm_queue *q, int ooo, long n) {
  atomic_int ran = 0;
  tdm_event *ev[3] = {NULL, NULL, NULL}, *m = NULL, *c = NULL;
  CHECK_OK(tdm_fault_inject(TDM_FAULT_NATIVE, n, 0));
  CHECK_OK(tdm_memcpy(q, F.dbuf, F.src, N, TDM_COPY_H2D, 0, NULL, &ev[0]));
  /* In order, the fill and the D2H copy are quiet; out of order, each waits for the last. */
  CHECK_OK(tdm_memset(q, F.dbuf + N / 2, PATTERN, N / 2, ooo, &ev[0], ooo ? &m : NULL));
  CHECK_OK(tdm_memcpy(q, pageable_back, F.dbuf, N, TDM_COPY_D2H, ooo, &m, ooo ? &c : NULL));
  CHECK_OK(tdm_host_task(q, task_count, &ran, ooo, &c, &ev[1]));
  CHECK_OK(tdm_event_record(q, &ev[2]));
  if (m) CHECK_OK(tdm_event_release(m));
  if (c) CHECK_OK(tdm_event_release(c));
  int st[3];
  for (int i = 0; i < 3; i++) {
    st[i] = th_event_wait_limited(ev[i], TH_HANG_MS);
    CHECK_MSG(round_status_ok(st[i]), "n=%ld: event %d completed with %s (%s)", n, i,
              tdm_err_name(st[i]), tdm_last_error());
  }
  int sync = tdm_queue_sync(q);
  char msg[256];
  snprintf(msg, sizeof msg, "%s", tdm_last_error());
  int fired = tdm_fault_fired();
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  for (int i = 0; i < 3; i++) CHECK_OK(tdm_event_release(ev[i]));
  if (!fired) {
    CHECK_MSG(sync == 0, "n=%ld: sync failed with %s (%s) but no fault fired", n,
              tdm_err_name(sync), msg);
    for (int i = 0; i < 3; i++) CHECK_OK(st[i]);
    CHECK_EQ(atomic_load(&ran), 1);
    CHECK_MEM_EQ(pageable_back, F.src, N / 2);
  } else {
    /* A marker whose own native wait failed reports it on its event only: a marker's status
     * is never the queue's error (it reports earlier ones). */
    int seen = sync == TDM_EBACKEND;
    for (int i = 0; i < 3; i++) seen |= st[i] == TDM_EBACKEND;
    CHECK_MSG(seen, "n=%ld: a fault fired but no event and no sync reported it (sync: %s, %s)",
              n, tdm_err_name(sync), msg);
    CHECK_MSG(sync == 0 || sync == TDM_EBACKEND, "n=%ld: the sync returned %s (%s)", n,
              tdm_err_name(sync), msg);
    CHECK_MSG(sync == 0 || msg[0] != '\0', "n=%ld: the sync failed without a message", n);
    CHECK_MSG(atomic_load(&ran) <= 1, "n=%ld: the host task ran twice", n);
  }
  /* Reported once: the queue is clean and usable again. */
  CHECK_OK(tdm_queue_sync(q));
  atomic_int again = 0;
  CHECK_OK(tdm_host_task(q, task_count, &again, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&again), 1);
  expect_baseline("native completion", n);
  return !fired;
}

static tdm_queue *native_q;
static int native_ooo;
static int try_native_round(unsigned kinds, long n) {
  (void)kinds;
  return native_round(native_q, native_ooo, n);
}

TEST_CASE(fault_native_completion) {
  fx_open();
  pageable_back = malloc(N);
  CHECK(pageable_back != NULL);
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(F.dev, &info));
  native_q = F.q;
  native_ooo = 0;
  long n = 0;
  while (!try_native_round(TDM_FAULT_NATIVE, n)) {
    n++;
    CHECK_MSG(n < MAX_ITER, "still failing after %d injected faults", MAX_ITER);
  }
  printf("native completion, in-order: %ld failing point(s), then success\n", n);
  if (info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER) {
    tdm_queue *oq = NULL;
    CHECK_OK(tdm_queue_create(F.dev, TDM_QUEUE_OUT_OF_ORDER, &oq));
    fx_settle();
    CHECK_OK(tdm_stats_get(&F.base));
    native_q = oq;
    native_ooo = 1;
    n = 0;
    while (!try_native_round(TDM_FAULT_NATIVE, n)) {
      n++;
      CHECK_MSG(n < MAX_ITER, "still failing after %d injected faults", MAX_ITER);
    }
    printf("native completion, out-of-order: %ld failing point(s), then success\n", n);
    CHECK_OK(tdm_queue_destroy(oq));
  }
  free(pageable_back);
  fx_close();
}

/* ---- Lost devices -------------------------------------------------------------------------
 * A backend call that reports TDM_EDEVLOST, whether a public call made it (TDM_FAULT_BACKEND)
 * or tandem's own thread did on completion (TDM_FAULT_NATIVE), marks the device lost: later
 * calls on it say so, its queue can still be destroyed, and the next init starts afresh. */
static void device_lost_by(unsigned kind, const char *name) {
  tdm_device *dev = th_open();
  tdm_queue *q = NULL, *q2 = SENTINEL_QUEUE;
  void *d = NULL, *d2 = SENTINEL_PTR;
  tdm_event *ev = NULL;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, N, &d));
  CHECK_OK(tdm_fault_inject(kind, 0, TDM_EDEVLOST));
  int rc = TH_CALL(tdm_memset(q, d, PATTERN, N, 0, NULL, &ev));
  if (rc == 0) {
    rc = TH_CALL(th_event_wait_limited(ev, TH_HANG_MS));
    CHECK_OK(tdm_event_release(ev));
  }
  int fired = tdm_fault_fired();
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  if (!fired) {
    /* Nothing of the kind on this backend (the CPU backend makes no native calls). */
    CHECK_OK(rc);
    printf("device lost through %s: no such call on %s\n", name, th_backend_of(dev));
  } else {
    CHECK_STATUS(rc, TDM_EDEVLOST); /* its message was checked by TH_CALL */
    CHECK_RC(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q2), TDM_EDEVLOST);
    CHECK(q2 == SENTINEL_QUEUE);
    CHECK_RC(tdm_malloc(dev, TDM_MEM_DEVICE, N, &d2), TDM_EDEVLOST);
    CHECK(d2 == SENTINEL_PTR);
    CHECK_RC(tdm_memset(q, d, 0, N, 0, NULL, NULL), TDM_EDEVLOST);
    printf("device lost through %s: later calls refused\n", name);
  }
  (void)tdm_queue_destroy(q); /* drains; the status may report the loss */
  CHECK_OK(tdm_free(d));
  th_close();
  /* A new context enumerates the device afresh. */
  dev = th_open();
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(fault_device_lost) {
  device_lost_by(TDM_FAULT_BACKEND, "a submission");
  device_lost_by(TDM_FAULT_NATIVE, "a completion");
}
