/* test-threads.c: tandem's own threads failing to start. The test defines pthread_create,
 * which comes before libc's in symbol lookup, so every call lands here; calls made from
 * tandem's libraries are counted, and the Nth from a given point fails with EAGAIN, for
 * N = 0, 1, 2, ... until an operation gets through without a failure. Each time the operation
 * either fails cleanly (TDM_ENOMEM with a message, nothing left behind) or succeeds with the
 * same results as without a failure. Calls from anywhere else (a driver's own threads) are
 * passed through untouched.
 */
#include "harness.h"

#include <dlfcn.h>
#include <errno.h>
#include <tandem/moe.h>

typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static _Atomic(create_fn) real_create;
static atomic_long tandem_creates;  /* calls from tandem's libraries so far */
static atomic_long fail_at = -1;    /* the call that fails, or -1 */
static atomic_int failed;           /* whether it has */

static bool from_tandem(const void *caller) {
  Dl_info info;
  return dladdr(caller, &info) && info.dli_fname && strstr(info.dli_fname, "/libtandem");
}

/* Default visibility (the build hides symbols by default), so libtandem's calls bind here. */
__attribute__((visibility("default"))) int pthread_create(pthread_t *thread,
                                                          const pthread_attr_t *attr,
                                                          void *(*fn)(void *), void *arg) {
  create_fn real = atomic_load(&real_create);
  if (!real) {
    real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
    atomic_store(&real_create, real);
  }
  if (from_tandem(__builtin_return_address(0)) &&
      atomic_fetch_add(&tandem_creates, 1) == atomic_load(&fail_at)) {
    atomic_store(&failed, 1);
    return EAGAIN;
  }
  return real(thread, attr, fn, arg);
}

/* Makes tandem's nth pthread_create from now fail. */
static void fail_nth(long n) {
  atomic_store(&failed, 0);
  atomic_store(&fail_at, atomic_load(&tandem_creates) + n);
}

/* Stops failing; returns whether a call failed since fail_nth. */
static bool fail_none(void) {
  atomic_store(&fail_at, -1);
  return atomic_load(&failed);
}

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

/* The interposition works: queue creation on cpu:0 starts a worker thread through it. */
TEST_CASE(interposed) {
  tdm_device *dev = th_open();
  long before = atomic_load(&tandem_creates);
  tdm_queue *q = NULL;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_MSG(atomic_load(&tandem_creates) > before || strcmp(th_backend_of(dev), "cpu") != 0,
            "libtandem's pthread_create calls do not reach the test's definition");
  th_close();
}

/* An in-order and an out-of-order queue (each with a host task) whose threads fail to start
 * one at a time: queue executors, CPU workers, tandem's host threads. */
TEST_CASE(queues) {
  tdm_device *dev = th_open();
  tdm_device_info info;
  tdm_stats before, after;
  CHECK_OK(tdm_device_info_get(dev, &info));
  bool ooo = info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER;
  CHECK_OK(tdm_stats_get(&before));
  for (long n = 0;; n++) {
    tdm_queue *qs[2] = {NULL, NULL};
    atomic_int ran = 0;
    fail_nth(n);
    int rc = TH_CALL(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &qs[0]));
    if (!rc && ooo) rc = TH_CALL(tdm_queue_create(dev, TDM_QUEUE_OUT_OF_ORDER, &qs[1]));
    for (int i = 0; !rc && i < 2; i++)
      if (qs[i]) rc = TH_CALL(tdm_host_task(qs[i], task_count, &ran, 0, NULL, NULL));
    bool fired = fail_none();
    if (rc) {
      CHECK_MSG(fired, "failed without a failed thread: %s", tdm_last_error());
      CHECK_STATUS(rc, TDM_ENOMEM);
    }
    for (int i = 0; i < 2; i++)
      if (qs[i]) {
        CHECK_OK(tdm_queue_sync(qs[i]));
        CHECK_OK(tdm_queue_destroy(qs[i]));
      }
    if (!rc) CHECK_EQ(atomic_load(&ran), ooo ? 2 : 1);
    CHECK_OK(tdm_stats_get(&after));
    CHECK_EQ(after.queues, before.queues);
    CHECK_EQ(after.pending, 0);
    if (!fired) {
      printf("%ld thread starts failed in turn\n", n);
      break;
    }
  }
  th_close();
}

/* The MoE model fills its weights on several threads, and runs queues and a streamer: with any
 * one of those threads failing to start, creating it fails cleanly or the model computes
 * the same output, bit for bit. */
TEST_CASE(moe_model) {
  tdm_device *dev = th_open();
  const tdm_moe_preset *p = tdm_moe_preset_find("tiny");
  CHECK(p != NULL);
  enum { T = 16 };
  tdm_moe_config cfg = {.preset = p, .device = dev, .seed = 7, .max_tokens = T,
                        .staging_slots = 2, .threads = 4};
  size_t n = (size_t)T * p->hidden;
  float *x = malloc(n * sizeof *x), *ref = malloc(n * sizeof *ref), *y = malloc(n * sizeof *y);
  CHECK(x && ref && y);
  tdm_moe_pass_stats st;
  tdm_moe_model *m = NULL;
  int rc = tdm_moe_model_create(&cfg, &m);
  if (rc == TDM_ENOTSUP) TH_SKIP("no MoE operations on %s: %s", th_device_id, tdm_last_error());
  CHECK_OK(rc);
  tdm_moe_make_input(m, x, T, 0, false);
  CHECK_OK(tdm_moe_forward(m, x, ref, T, true, &st));
  tdm_moe_model_destroy(m);

  for (long k = 0;; k++) {
    m = NULL;
    fail_nth(k);
    rc = TH_CALL(tdm_moe_model_create(&cfg, &m));
    bool fired = fail_none();
    if (rc) {
      CHECK_MSG(fired, "failed without a failed thread: %s", tdm_last_error());
      CHECK_STATUS(rc, TDM_ENOMEM);
      CHECK(m == NULL);
    } else {
      memset(y, 0xff, n * sizeof *y);
      CHECK_OK(tdm_moe_forward(m, x, y, T, true, &st));
      long at = th_first_diff(y, ref, n * sizeof *y);
      CHECK_MSG(at < 0, "thread start %ld failed: the output differs at byte %ld", k, at);
      tdm_moe_model_destroy(m);
    }
    if (!fired) {
      printf("%ld thread starts failed in turn\n", k);
      break;
    }
  }
  free(x);
  free(ref);
  free(y);
  th_close();
}
