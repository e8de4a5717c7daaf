/* harness.h: the tiny header-only test harness every tests/test-*.c includes.
 *
 * A test program holds many cases, declared with TEST_CASE(name) { ... } at the start of a line
 * (tests/CMakeLists.txt finds them with a regex and registers one ctest test per case and
 * device). The program runs one case per process:
 *
 *   test-foo --list              prints the case names
 *   test-foo <device-id> <case>  runs one case against a device ("cpu:0", "cuda:0", ...)
 *
 * A case that needs tandem calls th_open(), which initializes tandem and exits 77 (skipped)
 * when the device does not exist. Cases set environment options before th_open(), since every
 * case is its own process. CHECK* macros print file:line, the expression and, for tandem
 * calls, the error name and tdm_last_error(), then end the process with status 1. They may be
 * used from any thread (host tasks, keep-alive releases, helper threads).
 *
 * CHECK_OK and CHECK_RC clear the thread's message (tdm_clear_error) before the call, so a
 * message they print or check was set by that call and not left over from an earlier one.
 */
#ifndef TANDEM_TESTS_HARNESS_H
#define TANDEM_TESTS_HARNESS_H

#include <tandem.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Helpers a given test program may not use. */
#define TH_HELPER __attribute__((unused)) static

/* ---- Registration ------------------------------------------------------------------------ */

typedef void (*th_case_fn)(void);

struct th_case {
  const char *name;
  th_case_fn fn;
};

enum { TH_MAX_CASES = 256 };
static struct th_case th_cases[TH_MAX_CASES];
static int th_ncases;
static const char *th_device_id = "cpu:0";

static void th_register(const char *name, th_case_fn fn) {
  if (th_ncases == TH_MAX_CASES) {
    fprintf(stderr, "harness: too many test cases\n");
    _exit(2);
  }
  th_cases[th_ncases].name = name;
  th_cases[th_ncases].fn = fn;
  th_ncases++;
}

/* The constructor runs before main and fills th_cases; the regex in tests/CMakeLists.txt
 * relies on this macro being written as TEST_CASE(name) at the start of a line. */
#define TEST_CASE(name)                                                                       \
  static void th_case_##name(void);                                                           \
  __attribute__((constructor)) static void th_register_##name(void) {                         \
    th_register(#name, th_case_##name);                                                       \
  }                                                                                           \
  static void th_case_##name(void)

/* ---- Failing and skipping ---------------------------------------------------------------- */

/* _exit, not exit: a failure may be reported from a tandem thread while others still run, and
 * running atexit handlers (or the library's destructors) from there could hang. */
__attribute__((noreturn, format(printf, 3, 4))) static void th_fail(const char *file, int line,
                                                                   const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "%s:%d: FAIL: ", file, line);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  fflush(stderr);
  _exit(1);
}

/* tdm_last_error() is read before any other tandem call so that it still describes `call`. */
__attribute__((noreturn)) static void th_fail_rc(const char *file, int line, const char *call,
                                                 int rc, int want) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", tdm_last_error());
  th_fail(file, line, "%s\n  returned %s (%d), expected %s (%d)\n  tdm_last_error: \"%s\"", call,
          tdm_err_name(rc), rc, tdm_err_name(want), want, msg);
}

#define TH_SKIP(...)                                                                          \
  do {                                                                                        \
    printf("SKIP: ");                                                                         \
    printf(__VA_ARGS__);                                                                      \
    printf("\n");                                                                             \
    fflush(stdout);                                                                           \
    _exit(77);                                                                                \
  } while (0)

#define CHECK(expr)                                                                           \
  do {                                                                                        \
    if (!(expr)) th_fail(__FILE__, __LINE__, "CHECK(%s)", #expr);                             \
  } while (0)

#define CHECK_MSG(expr, ...)                                                                  \
  do {                                                                                        \
    if (!(expr)) {                                                                            \
      fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                         \
      fprintf(stderr, __VA_ARGS__);                                                           \
      fprintf(stderr, "\n");                                                                  \
      th_fail(__FILE__, __LINE__, "CHECK(%s)", #expr);                                        \
    }                                                                                         \
  } while (0)

/* A tandem call that must succeed. */
#define CHECK_OK(call)                                                                        \
  do {                                                                                        \
    tdm_clear_error();                                                                        \
    int th_rc_ = (call);                                                                      \
    if (th_rc_ != 0) th_fail_rc(__FILE__, __LINE__, #call, th_rc_, 0);                        \
  } while (0)

/* What tdm_last_error() says when no call has set a message since tdm_clear_error(). */
#define TH_NO_MESSAGE "no error"

/* Whether `msg` is a message that a failure with code `rc` set since the thread's message was
 * last cleared: it names the code ("TDM_EINVAL: ...") or, where `call` is given, the function
 * called ("tdm_queue_sync" for "tdm_queue_sync(q)"). */
TH_HELPER int th_message_fits(const char *msg, int rc, const char *call) {
  const char *name = tdm_err_name(rc);
  size_t len = strlen(name);
  char fn[128];
  if (strcmp(msg, TH_NO_MESSAGE) == 0) return 0;
  if (strncmp(msg, name, len) == 0 && msg[len] == ':') return 1;
  if (!call) return 0;
  len = strcspn(call, "( ");
  if (len == 0 || len >= sizeof fn) return 0;
  memcpy(fn, call, len);
  fn[len] = '\0';
  return strstr(msg, fn) != NULL;
}

/* The checks behind CHECK_RC: `rc` must equal `want`, and a failure must have set a message of
 * its own (TDM_EAGAIN from a query is a state, not a failure, so it is exempt). */
TH_HELPER void th_check_rc(const char *file, int line, const char *call, int rc, int want) {
  char msg[512];
  if (rc != want) th_fail_rc(file, line, call, rc, want);
  if (rc >= 0 || rc == TDM_EAGAIN) return;
  snprintf(msg, sizeof msg, "%s", tdm_last_error());
  if (strcmp(msg, TH_NO_MESSAGE) == 0)
    th_fail(file, line, "%s returned %s but set no message", call, tdm_err_name(rc));
  if (!th_message_fits(msg, rc, call))
    th_fail(file, line, "%s returned %s, but its message names neither the code nor the "
            "call:\n  tdm_last_error: \"%s\"", call, tdm_err_name(rc), msg);
}

/* A tandem call that must return `want`; a failure must also set a message naming its code or
 * the call. */
#define CHECK_RC(call, want)                                                                  \
  do {                                                                                        \
    int th_want_ = (want);                                                                    \
    tdm_clear_error();                                                                        \
    int th_rc_ = (call);                                                                      \
    th_check_rc(__FILE__, __LINE__, #call, th_rc_, th_want_);                                 \
  } while (0)

/* A tandem call whose code is checked later (by another thread, or after more calls): clears
 * the message first, fails at once if the call fails without a message of its own, and
 * otherwise gives the code back. */
TH_HELPER int th_call_checked(const char *file, int line, const char *call, int rc) {
  if (rc < 0 && rc != TDM_EAGAIN) th_check_rc(file, line, call, rc, rc);
  return rc;
}
#define TH_CALL(call) th_call_checked(__FILE__, __LINE__, #call, (tdm_clear_error(), (call)))

/* A status that must equal `want` (one a host task or another thread got, or one kept from an
 * earlier call): its message is not this thread's to check. */
#define CHECK_STATUS(status, want)                                                            \
  do {                                                                                        \
    int th_rc_ = (status);                                                                    \
    int th_want_ = (want);                                                                    \
    if (th_rc_ != th_want_)                                                                   \
      th_fail(__FILE__, __LINE__, "%s is %s (%d), expected %s (%d)", #status,                 \
              tdm_err_name(th_rc_), th_rc_, tdm_err_name(th_want_), th_want_);                \
  } while (0)

/* Integer comparison that prints both sides. */
#define CHECK_EQ(a, b)                                                                        \
  do {                                                                                        \
    long long th_a_ = (long long)(a), th_b_ = (long long)(b);                                 \
    if (th_a_ != th_b_)                                                                       \
      th_fail(__FILE__, __LINE__, "CHECK_EQ(%s, %s): %lld != %lld", #a, #b, th_a_, th_b_);    \
  } while (0)

/* ---- Opening tandem on the case's device ------------------------------------------------- */

/* Prints what the backend of `id` reported, so a skip says why. */
TH_HELPER void th_explain_missing(const char *id) {
  int n = 0;
  size_t len = strcspn(id, ":");
  if (tdm_backend_count(&n) != 0) return;
  for (int i = 0; i < n; i++) {
    tdm_backend_info bi;
    if (tdm_backend_get(i, &bi) != 0) continue;
    if (strlen(bi.name) == len && strncmp(bi.name, id, len) == 0) {
      printf("backend %s: status %s, %d device(s), %s\n", bi.name, tdm_err_name(bi.status),
             bi.device_count, bi.detail);
      return;
    }
  }
  printf("backend %.*s is not known to this build\n", (int)len, id);
}

/* tdm_init(), then the case's device; exits 77 if the device does not exist. */
TH_HELPER tdm_device *th_open(void) {
  tdm_device *dev = NULL;
  int rc;
  CHECK_OK(tdm_init());
  rc = tdm_device_find(th_device_id, &dev);
  if (rc == TDM_ENODEV) {
    printf("device %s does not exist: %s\n", th_device_id, tdm_last_error());
    th_explain_missing(th_device_id);
    TH_SKIP("no device %s", th_device_id);
  }
  if (rc != 0) th_fail_rc(__FILE__, __LINE__, "tdm_device_find(th_device_id, &dev)", rc, 0);
  CHECK(dev != NULL);
  return dev;
}

TH_HELPER void th_close(void) { CHECK_OK(tdm_shutdown()); }

/* The backend name of a device ("cpu"). */
TH_HELPER const char *th_backend_of(tdm_device *dev) {
  static _Thread_local tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  return info.backend;
}

/* ---- Random data ------------------------------------------------------------------------- */

TH_HELPER uint64_t th_rand(uint64_t *state) { /* splitmix64 */
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

TH_HELPER uint64_t th_rand_below(uint64_t *state, uint64_t n) { return th_rand(state) % n; }

TH_HELPER void th_fill_random(void *buf, size_t n, uint64_t *state) {
  unsigned char *p = buf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = th_rand(state);
    memcpy(p + i, &v, 8);
  }
  if (i < n) {
    uint64_t v = th_rand(state);
    memcpy(p + i, &v, n - i);
  }
}

/* $TANDEM_TEST_SEED if set, else from the clock; always printed so a failure can be replayed. */
TH_HELPER uint64_t th_seed(void) {
  const char *env = getenv("TANDEM_TEST_SEED");
  uint64_t seed;
  if (env && *env) {
    seed = strtoull(env, NULL, 0);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
  }
  printf("seed: %llu (replay with TANDEM_TEST_SEED=%llu)\n", (unsigned long long)seed,
         (unsigned long long)seed);
  fflush(stdout);
  return seed;
}

/* Index of the first differing byte, or -1. */
TH_HELPER long th_first_diff(const void *a, const void *b, size_t n) {
  const unsigned char *x = a, *y = b;
  if (memcmp(a, b, n) == 0) return -1;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i]) return (long)i;
  return -1;
}

#define CHECK_MEM_EQ(got, want, n)                                                            \
  do {                                                                                        \
    long th_d_ = th_first_diff((got), (want), (n));                                           \
    if (th_d_ >= 0)                                                                           \
      th_fail(__FILE__, __LINE__, "%s != %s over %zu bytes: first difference at byte %ld "    \
              "(got 0x%02x, want 0x%02x)", #got, #want, (size_t)(n), th_d_,                   \
              ((const unsigned char *)(got))[th_d_], ((const unsigned char *)(want))[th_d_]); \
  } while (0)

/* ---- Threads and gates ------------------------------------------------------------------- */

TH_HELPER void th_sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* A one-shot latch: host tasks wait on it so that a test controls when work may complete. */
typedef struct th_gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int open;
} th_gate;

TH_HELPER void th_gate_init(th_gate *g) {
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->open = 0;
}

TH_HELPER void th_gate_destroy(th_gate *g) {
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
}

TH_HELPER void th_gate_open(th_gate *g) {
  pthread_mutex_lock(&g->mu);
  g->open = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

TH_HELPER int th_gate_is_open(th_gate *g) {
  int v;
  pthread_mutex_lock(&g->mu);
  v = g->open;
  pthread_mutex_unlock(&g->mu);
  return v;
}

/* Waits until the gate opens; gives up after `limit_ms` and returns 0. The limit only turns a
 * hang into a readable failure; it is never how a test decides that it passed. */
TH_HELPER int th_gate_wait(th_gate *g, long limit_ms) {
  struct timespec dl;
  int rc = 0;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += limit_ms / 1000;
  dl.tv_nsec += (limit_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g->mu);
  while (!g->open && rc == 0) rc = pthread_cond_timedwait(&g->cv, &g->mu, &dl);
  rc = g->open;
  pthread_mutex_unlock(&g->mu);
  return rc;
}

/* Two devices, for cases that split work between them (expert parallelism): the case's, and
 * TANDEM_TEST_SECOND, else cuda:1 beside cuda:0 (peer copies) where there is one, else
 * opencl:0 beside cpu:0, else cpu:0 (another backend: copies through pinned memory). Opens
 * the first; NULL (after th_close) when the second is absent. */
TH_HELPER tdm_device *th_open_pair(tdm_device **first, const char **second_id) {
  const char *env = getenv("TANDEM_TEST_SECOND");
  *second_id = env && *env ? env : strcmp(th_device_id, "cpu:0") == 0 ? "opencl:0" : "cpu:0";
  if (strncmp(*second_id, "cpu:", 4) == 0 && strcmp(*second_id, "cpu:0") != 0)
    CHECK(setenv("TANDEM_CPU_DEVICES", "2", 1) == 0); /* before th_open's init */
  *first = th_open();
  tdm_device *second = NULL;
  if (!(env && *env) && strcmp(th_device_id, "cuda:0") == 0 &&
      tdm_device_find("cuda:1", &second) == 0) {
    *second_id = "cuda:1";
    return second;
  }
  if (tdm_device_find(*second_id, &second) == 0) return second;
  th_close();
  return NULL;
}

/* Generous limit for "this must happen eventually" waits (sanitizer builds are slow). */
enum { TH_HANG_MS = 20000 };

/* Whether the live counts (queues, events, allocations) come back to base's, with nothing
 * pending, within TH_HANG_MS: the last frees and releases finish on tandem's threads just after
 * the work they belong to, so this polls, and a leak is a failure rather than a hang. *now
 * gets the last counts read, for the caller's message. */
TH_HELPER bool th_stats_back(const tdm_stats *base, tdm_stats *now) {
  for (long waited = 0; waited < TH_HANG_MS; waited++) {
    CHECK_OK(tdm_stats_get(now));
    if (now->queues == base->queues && now->events == base->events &&
        now->allocations == base->allocations && now->pending == 0)
      return true;
    th_sleep_ms(1);
  }
  return false;
}

/* th_stats_back, failing the case (what, n: where) when the counts stay off. */
#define TH_EXPECT_STATS_BACK(base, what, n)                                                   \
  do {                                                                                        \
    tdm_stats th_now_ = {0, 0, 0, 0};                                                         \
    if (!th_stats_back((base), &th_now_))                                                     \
      th_fail(__FILE__, __LINE__,                                                             \
              "%s, n=%ld: live counts did not return to the baseline: queues %ld (base %ld), " \
              "events %ld (base %ld), allocations %ld (base %ld), pending %ld",               \
              (what), (long)(n), th_now_.queues, (base)->queues, th_now_.events,              \
              (base)->events, th_now_.allocations, (base)->allocations, th_now_.pending);     \
  } while (0)

/* A host task held back by a gate: once the test opens it, copies n bytes from src to dst.
 * The way to keep an event pending until every submission that depends on it has returned. */
typedef struct th_gated_copy {
  th_gate *gate;
  void *dst;
  const void *src;
  size_t n;
} th_gated_copy;

TH_HELPER int th_gated_copy_task(void *p) {
  th_gated_copy *a = p;
  CHECK(th_gate_wait(a->gate, TH_HANG_MS));
  memcpy(a->dst, a->src, a->n);
  return 0;
}

/* Polls an event until it completes or `limit_ms` passes; returns its status or TDM_EAGAIN. */
TH_HELPER int th_event_wait_limited(tdm_event *ev, long limit_ms) {
  int rc;
  for (long waited = 0;; waited++) {
    rc = tdm_event_query(ev);
    if (rc != TDM_EAGAIN || waited >= limit_ms) return rc;
    th_sleep_ms(1);
  }
}

/* Polls an atomic int until it reaches `want` or `limit_ms` passes; returns whether it did. */
TH_HELPER int th_wait_atomic(atomic_int *v, int want, long limit_ms) {
  for (long waited = 0;; waited++) {
    if (atomic_load(v) >= want) return 1;
    if (waited >= limit_ms) return 0;
    th_sleep_ms(1);
  }
}

/* ---- main -------------------------------------------------------------------------------- */

static void th_usage(const char *prog) {
  fprintf(stderr, "usage: %s --list | <device-id> <case>\n", prog);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    for (int i = 0; i < th_ncases; i++) printf("%s\n", th_cases[i].name);
    return 0;
  }
  if (argc != 3) {
    th_usage(argv[0]);
    return 2;
  }
  th_device_id = argv[1];
  for (int i = 0; i < th_ncases; i++) {
    if (strcmp(th_cases[i].name, argv[2]) == 0) {
      setvbuf(stdout, NULL, _IOLBF, 0);
      printf("case %s on %s\n", argv[2], th_device_id);
      th_cases[i].fn();
      printf("PASS\n");
      fflush(stdout);
      return 0;
    }
  }
  fprintf(stderr, "unknown case %s\n", argv[2]);
  th_usage(argv[0]);
  return 2;
}

#endif /* TANDEM_TESTS_HARNESS_H */
