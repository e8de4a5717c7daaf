/* test-lifecycle.c: init/shutdown reference counting, versions, the backend and device lists,
 * options naming a device or backend that does not exist, fork safety and the refusal of a
 * backend module with a wrong table version (cpu:0).
 */
#include "harness.h"
#include <tandem/cpu.h>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#ifndef TANDEM_TEST_BADMODULE_DIR
#error "tests/CMakeLists.txt passes the directory of libtandem-badversion.so"
#endif

static int task_count(void *arg) {
  atomic_fetch_add((atomic_int *)arg, 1);
  return 0;
}

static void release_count(void *obj) { atomic_fetch_add((atomic_int *)obj, 1); }

static int task_wait_gate(void *arg) { return th_gate_wait(arg, TH_HANG_MS) ? 0 : 1; }

/* ---- Init and shutdown ------------------------------------------------------------------- */

TEST_CASE(init_refcount) {
  int count = -1;
  tdm_device *dev = NULL;
  tdm_queue *q = NULL;
  CHECK_OK(tdm_init());
  CHECK_OK(tdm_init());
  CHECK_OK(tdm_shutdown());
  /* One init is still outstanding. */
  CHECK_OK(tdm_device_count(&count));
  CHECK(count >= 1);
  CHECK_OK(tdm_device_find(th_device_id, &dev));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_shutdown());
  /* The last shutdown. */
  count = -1;
  CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT);
  CHECK_RC(tdm_device_find(th_device_id, &dev), TDM_ENOTINIT);
  CHECK_RC(tdm_shutdown(), TDM_ENOTINIT);
  CHECK_EQ(count, -1);
  /* Re-init works, more than once. */
  for (int round = 0; round < 3; round++) {
    atomic_int ran = 0;
    dev = th_open();
    CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    CHECK_EQ(atomic_load(&ran), 1);
    CHECK_OK(tdm_queue_destroy(q));
    th_close();
  }
}

static void *open_gate_later(void *arg) {
  th_sleep_ms(50); /* makes shutdown really wait; the result does not depend on it */
  th_gate_open(arg);
  return NULL;
}

/* The last shutdown drains what the program left behind, runs pending keep-alive releases,
 * and frees everything: a new init starts from zero live objects. */
TEST_CASE(shutdown_drains) {
  enum { N = 100 };
  tdm_device *dev = th_open();
  tdm_queue *q = NULL, *ooo = NULL, *def = NULL;
  tdm_event *ev = NULL;
  void *mem = NULL;
  atomic_int ran = 0, released = 0;
  th_gate gate;
  th_gate_init(&gate);
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_OUT_OF_ORDER, &ooo));
  CHECK_OK(tdm_default_queue(dev, &def));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, 4096, &mem));
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  for (int i = 0; i < N; i++) {
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, i == N - 1 ? &ev : NULL));
    CHECK_OK(tdm_host_task(ooo, task_count, &ran, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(def, task_count, &ran, 0, NULL, NULL));
  }
  CHECK_OK(tdm_keep_alive(q, release_count, &released));
  pthread_t th;
  CHECK(pthread_create(&th, NULL, open_gate_later, &gate) == 0);
  th_close();
  pthread_join(th, NULL);
  CHECK_EQ(atomic_load(&ran), 3 * N);
  CHECK_EQ(atomic_load(&released), 1);

  tdm_stats st;
  th_open();
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.queues, 0);
  CHECK_EQ(st.events, 0);
  CHECK_EQ(st.allocations, 0);
  CHECK_EQ(st.pending, 0);
  th_close();
  th_gate_destroy(&gate);
}

/* ---- Versions ---------------------------------------------------------------------------- */

TEST_CASE(version) {
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", TDM_VERSION_MAJOR, TDM_VERSION_MINOR,
           TDM_VERSION_PATCH);
  CHECK_EQ(tdm_version(), TDM_VERSION);
  CHECK(tdm_version_string() != NULL);
  CHECK_MSG(strcmp(tdm_version_string(), want) == 0, "version string \"%s\", want \"%s\"",
            tdm_version_string(), want);
  CHECK_EQ(TDM_VERSION, (TDM_VERSION_MAJOR << 16) | (TDM_VERSION_MINOR << 8) | TDM_VERSION_PATCH);
}

/* ---- Backends and devices ---------------------------------------------------------------- */

static int find_backend(const char *name, tdm_backend_info *out) {
  int n = 0;
  CHECK_OK(tdm_backend_count(&n));
  for (int i = 0; i < n; i++) {
    CHECK_OK(tdm_backend_get(i, out));
    if (strcmp(out->name, name) == 0) return 1;
  }
  return 0;
}

TEST_CASE(backends_and_devices) {
  tdm_device *dev = th_open();
  tdm_backend_info bi;
  int nb = 0, nd = 0, from_backends = 0;
  CHECK_OK(tdm_backend_count(&nb));
  CHECK(nb >= 1);
  for (int i = 0; i < nb; i++) {
    CHECK_OK(tdm_backend_get(i, &bi));
    CHECK(bi.name[0] != '\0' && memchr(bi.name, '\0', sizeof bi.name) != NULL);
    printf("backend %s: %s, %d device(s), %s\n", bi.name, tdm_err_name(bi.status),
           bi.device_count, bi.detail);
    if (bi.status == 0) from_backends += bi.device_count;
    else CHECK_EQ(bi.device_count, 0);
  }
  int rc = tdm_backend_get(nb, &bi); /* one past the end */
  CHECK_MSG(rc < 0, "tdm_backend_get(count) returned %s", tdm_err_name(rc));
  CHECK(find_backend("cpu", &bi));
  CHECK_EQ(bi.status, 0);
  CHECK(bi.device_count >= 1);

  CHECK_OK(tdm_device_count(&nd));
  CHECK_EQ(nd, from_backends);
  for (int i = 0; i < nd; i++) {
    tdm_device *d = NULL, *found = NULL;
    tdm_device_info info;
    char id[48];
    CHECK_OK(tdm_device_get(i, &d));
    CHECK_OK(tdm_device_info_get(d, &info));
    CHECK_EQ(info.index, i);
    snprintf(id, sizeof id, "%s:%d", info.backend, info.backend_index);
    CHECK_MSG(strcmp(id, info.id) == 0, "device %d has id %s, want %s", i, info.id, id);
    CHECK_OK(tdm_device_find(info.id, &found));
    CHECK(found == d);
    if (strcmp(info.backend, "cpu") == 0) CHECK(info.caps & TDM_DEVICE_CAP_HOST_MEMORY);
  }
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  CHECK(strcmp(info.id, th_device_id) == 0);
  th_close();
}

TEST_CASE(cpu_devices_env) {
  CHECK(setenv("TANDEM_CPU_DEVICES", "3", 1) == 0);
  th_open();
  tdm_backend_info bi;
  CHECK(find_backend("cpu", &bi));
  CHECK_EQ(bi.device_count, 3);
  for (int i = 0; i < 3; i++) {
    char id[16];
    tdm_device *d = NULL;
    tdm_queue *q = NULL;
    atomic_int ran = 0;
    snprintf(id, sizeof id, "cpu:%d", i);
    CHECK_OK(tdm_device_find(id, &d));
    CHECK_OK(tdm_queue_create(d, TDM_QUEUE_IN_ORDER, &q));
    CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
    CHECK_OK(tdm_queue_destroy(q));
    CHECK_EQ(atomic_load(&ran), 1);
  }
  tdm_device *d = NULL;
  CHECK_RC(tdm_device_find("cpu:3", &d), TDM_ENODEV);
  th_close();
}

/* ---- Options that name nothing ----------------------------------------------------------- */

/* stderr goes to a file between stderr_begin and stderr_end, which returns what was written. */
static int stderr_begin(FILE **file) {
  fflush(stderr);
  *file = tmpfile();
  CHECK(*file != NULL);
  int saved = dup(2);
  CHECK(saved >= 0 && dup2(fileno(*file), 2) == 2);
  return saved;
}

static const char *stderr_end(FILE *file, int saved) {
  static char text[4096];
  fflush(stderr);
  CHECK(dup2(saved, 2) == 2);
  close(saved);
  rewind(file);
  size_t n = fread(text, 1, sizeof text - 1, file);
  text[n] = 0;
  fclose(file);
  printf("stderr: \"%s\"\n", text);
  return text;
}

static int count_of(const char *text, const char *needle) {
  int n = 0;
  for (const char *p = text; (p = strstr(p, needle)); p++) n++;
  return n;
}

/* A TANDEM_DEVICE naming no device is reported once, at init; the default device is then
 * unavailable (not another one), and the devices that exist still work. */
TEST_CASE(env_device_missing) {
  CHECK(setenv("TANDEM_DEVICE", "no-such:0", 1) == 0);
  FILE *file;
  int saved = stderr_begin(&file);
  CHECK_OK(tdm_init());
  tdm_device *dev = NULL;
  tdm_queue *q = NULL;
  int rc1 = TH_CALL(tdm_device_find(NULL, &dev)), rc2 = TH_CALL(tdm_default_queue(NULL, &q));
  const char *text = stderr_end(file, saved);
  CHECK_EQ(count_of(text, "tandem: TANDEM_DEVICE=no-such:0 names no device"), 1);
  CHECK(strstr(text, "cpu:0") != NULL); /* the devices that do exist are listed */
  CHECK_STATUS(rc1, TDM_ENODEV);
  CHECK_STATUS(rc2, TDM_ENODEV);
  CHECK(dev == NULL && q == NULL);
  CHECK_OK(tdm_device_find("cpu:0", &dev));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();

  /* A device that exists: nothing to report. */
  CHECK(setenv("TANDEM_DEVICE", "cpu:0", 1) == 0);
  saved = stderr_begin(&file);
  CHECK_OK(tdm_init());
  text = stderr_end(file, saved);
  CHECK_EQ(count_of(text, "TANDEM_DEVICE"), 0);
  th_close();
}

/* TANDEM_BACKENDS: entries naming no backend are reported at init; a list naming none at all
 * says so (and leaves no devices). */
TEST_CASE(env_backends_unknown) {
  FILE *file;
  int count = -1;
  CHECK(setenv("TANDEM_BACKENDS", "cpu,no-such", 1) == 0);
  int saved = stderr_begin(&file);
  CHECK_OK(tdm_init());
  const char *text = stderr_end(file, saved);
  CHECK_EQ(count_of(text, "tandem: ignoring \"no-such\" in TANDEM_BACKENDS=cpu,no-such"), 1);
  CHECK_EQ(count_of(text, "tandem: "), 1);
  tdm_device *dev = NULL;
  CHECK_OK(tdm_device_find("cpu:0", &dev));
  th_close();

  CHECK(setenv("TANDEM_BACKENDS", "no-such,nor-this", 1) == 0);
  saved = stderr_begin(&file);
  CHECK_OK(tdm_init());
  text = stderr_end(file, saved);
  CHECK_EQ(count_of(text, "tandem: TANDEM_BACKENDS=no-such,nor-this names no known backend"), 1);
  CHECK_EQ(count_of(text, "tandem: "), 1);
  CHECK_OK(tdm_device_count(&count));
  CHECK_EQ(count, 0);
  th_close();

  /* Backends tandem knows of, present or not, are not reported. */
  CHECK(setenv("TANDEM_BACKENDS", "cpu,cuda,opencl", 1) == 0);
  saved = stderr_begin(&file);
  CHECK_OK(tdm_init());
  text = stderr_end(file, saved);
  CHECK_EQ(count_of(text, "TANDEM_BACKENDS"), 0);
  th_close();
}

/* ---- Fork -------------------------------------------------------------------------------- */

/* In the child every call returns TDM_EFORK at once, even with worker threads alive in the
 * parent at fork time (they do not exist in the child). */
static int child_checks(tdm_device *dev, tdm_queue *q) {
  int count = -1, bad = 0;
  tdm_queue *q2 = NULL;
  tdm_event *ev = NULL;
  tdm_clear_error(); /* so that the message checked below is one of these calls' */
  int rcs[] = {tdm_device_count(&count),
               tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q2),
               tdm_queue_sync(q),
               tdm_event_record(q, &ev),
               tdm_init(),
               tdm_shutdown()};
  for (size_t i = 0; i < sizeof rcs / sizeof rcs[0]; i++) {
    if (rcs[i] != TDM_EFORK) {
      fprintf(stderr, "child: call %zu returned %s, want TDM_EFORK\n", i, tdm_err_name(rcs[i]));
      bad = 1;
    }
  }
  if (count != -1 || q2 != NULL || ev != NULL) {
    fprintf(stderr, "child: an out-parameter was written\n");
    bad = 1;
  }
  if (strncmp(tdm_last_error(), "TDM_EFORK: ", 11) != 0) {
    fprintf(stderr, "child: no message for TDM_EFORK\n");
    bad = 1;
  }
  return bad;
}

TEST_CASE(fork_child) {
  tdm_device *dev = th_open();
  tdm_queue *q = NULL;
  atomic_int ran = 0;
  th_gate gate;
  th_gate_init(&gate);
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  /* Work held back in the parent at fork time: a lock or a pending command must not make the
   * child hang. */
  CHECK_OK(tdm_host_task(q, task_wait_gate, &gate, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) _exit(child_checks(dev, q));

  int status = 0;
  pid_t got = 0;
  for (long waited = 0; (got = waitpid(pid, &status, WNOHANG)) == 0 && waited < TH_HANG_MS;
       waited++)
    th_sleep_ms(1);
  if (got == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    th_fail(__FILE__, __LINE__, "the forked child hung in tandem");
  }
  CHECK(got == pid);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status 0x%x", status);

  /* The parent is unaffected. */
  th_gate_open(&gate);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_EQ(atomic_load(&ran), 1);
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&gate);
  th_close();
}

/* ---- Backend modules --------------------------------------------------------------------- */

TEST_CASE(module_bad_version) {
  CHECK(setenv("TANDEM_BACKEND_PATH", TANDEM_TEST_BADMODULE_DIR, 1) == 0);
  printf("TANDEM_BACKEND_PATH=%s\n", TANDEM_TEST_BADMODULE_DIR);
  tdm_device *dev = th_open();
  tdm_backend_info bi;
  CHECK_MSG(find_backend("badversion", &bi), "the module in %s is not listed",
            TANDEM_TEST_BADMODULE_DIR);
  printf("badversion: %s, %s\n", tdm_err_name(bi.status), bi.detail);
  CHECK_MSG(bi.status == TDM_EVERSION, "status %s, want TDM_EVERSION", tdm_err_name(bi.status));
  CHECK_EQ(bi.device_count, 0);
  CHECK(bi.detail[0] != '\0');
  /* Everything else still works. */
  CHECK(find_backend("cpu", &bi));
  CHECK_EQ(bi.status, 0);
  tdm_queue *q = NULL;
  atomic_int ran = 0;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_host_task(q, task_count, &ran, 0, NULL, NULL));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_EQ(atomic_load(&ran), 1);
  th_close();
}

/* TANDEM_TRACE: the last shutdown writes every command, per queue, in the Chrome trace-event
 * format. */
static int trace_task(void *arg) {
  (void)arg;
  return 0;
}

TEST_CASE(trace_file) {
  char path[128];
  snprintf(path, sizeof path, "/tmp/tandem-trace-%d.json", (int)getpid());
  unlink(path);
  CHECK(setenv("TANDEM_TRACE", path, 1) == 0);
  tdm_device *dev = th_open();
  tdm_queue *a, *b;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &a));
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &b));
  enum { N = 25 };
  for (int i = 0; i < N; i++) {
    CHECK_OK(tdm_host_task(a, trace_task, NULL, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(b, trace_task, NULL, 0, NULL, NULL));
  }
  CHECK_OK(tdm_queue_sync(a));
  CHECK_OK(tdm_queue_sync(b));
  CHECK_OK(tdm_queue_destroy(a));
  CHECK_OK(tdm_queue_destroy(b));
  th_close();
  FILE *f = fopen(path, "r");
  CHECK_MSG(f != NULL, "no trace at %s", path);
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  CHECK(strstr(buf, "\"traceEvents\"") != NULL);
  long tasks = 0, tids[2] = {-1, -1};
  for (const char *p = buf; (p = strstr(p, "\"name\": \"host task\"")); p++) {
    tasks++;
    const char *t = strstr(p, "\"tid\": ");
    CHECK(t != NULL);
    long tid = strtol(t + 7, NULL, 10);
    if (tids[0] < 0 || tids[0] == tid) tids[0] = tid;
    else tids[1] = tid;
  }
  CHECK_EQ(tasks, 2L * N);
  CHECK_MSG(tids[1] >= 0 && tids[0] != tids[1], "the two queues share one trace thread");
  unlink(path);
}

/* A TANDEM_TRACE path longer than tandem keeps is refused with a warning, not cut (the cut
 * path would name another file). The warning is read from stderr, sent to a file. */
TEST_CASE(trace_path_too_long) {
  static char path[5000];
  snprintf(path, sizeof path, "/tmp/tandem-trace-%d-", (int)getpid());
  size_t n = strlen(path);
  while (n < sizeof path - 8) { /* components of 200 bytes, so only the whole is too long */
    path[n] = (n % 201 == 0) ? '/' : 'x';
    n++;
  }
  strcpy(path + n, ".json");
  CHECK(setenv("TANDEM_TRACE", path, 1) == 0);
  char errpath[64];
  snprintf(errpath, sizeof errpath, "/tmp/tandem-stderr-%d.txt", (int)getpid());
  fflush(stderr);
  int saved = dup(2);
  FILE *err = fopen(errpath, "w+");
  CHECK(err != NULL && saved >= 0);
  dup2(fileno(err), 2);
  tdm_device *dev = th_open();
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char buf[512] = "";
  rewind(err);
  size_t got = fread(buf, 1, sizeof buf - 1, err);
  buf[got] = '\0';
  fclose(err);
  unlink(errpath);
  CHECK_MSG(strstr(buf, "TANDEM_TRACE") && strstr(buf, "ignoring"),
            "no warning about the long TANDEM_TRACE; stderr said: \"%s\"", buf);
  tdm_queue *q;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* tandem/cpu.h in a forked child: every call returns TDM_EFORK (the stream's worker stayed in
 * the parent), rather than succeeding and never running, or hanging. */
static void stream_bump(void *arg) { atomic_fetch_add((atomic_int *)arg, 1); }

TEST_CASE(cpu_stream_fork_child) {
  th_open();
  tdm_cpu_stream *s = NULL;
  atomic_int ran = 0;
  CHECK_OK(tdm_cpu_stream_create(&s));
  CHECK_OK(tdm_cpu_stream_launch(s, stream_bump, &ran));
  fflush(NULL);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    tdm_cpu_stream *t = NULL;
    int bad = 0;
    bad |= tdm_cpu_stream_launch(s, stream_bump, &ran) != TDM_EFORK;
    bad |= tdm_cpu_stream_destroy(s) != TDM_EFORK;
    bad |= tdm_cpu_stream_create(&t) != TDM_EFORK;
    bad |= t != NULL;
    _exit(bad ? 3 : 0);
  }
  int status = 0;
  pid_t got = 0;
  for (long waited = 0; (got = waitpid(pid, &status, WNOHANG)) == 0 && waited < TH_HANG_MS;
       waited++)
    th_sleep_ms(1);
  if (got == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    th_fail(__FILE__, __LINE__, "the forked child hung in tandem/cpu.h");
  }
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status 0x%x", status);
  CHECK_OK(tdm_cpu_stream_destroy(s)); /* the parent's stream is unaffected */
  CHECK_EQ(atomic_load(&ran), 1);
  th_close();
}
