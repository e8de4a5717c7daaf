/* exit-pending.c: a program that returns from main without tdm_shutdown while host tasks,
 * keep-alive releases and copies are still pending on the devices it is given. Returning from
 * main must still end the process with status 0: no crash, no hang, whatever tandem's threads
 * are doing at that moment. Before the process ends, tandem waits (TANDEM_EXIT_WAIT_MS) for the
 * work submitted: each host task writes a line "t" when it finishes, and the program says how
 * many it submitted ("host tasks: N"), so a caller can count that all of them ran. With
 * --stuck, a host task that never returns goes first on the first device's in-order queue:
 * the wait is bounded, so the process still ends. ctest runs it several times per device (exit.<backend>.*).
 *
 *   exit-pending [--stuck] <device-id>...    exits 77 if a device does not exist
 */
#include <tandem.h>

#include <execinfo.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { TASKS = 6, BYTES = 256 << 10 };

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static int slow_task(void *arg) {
  (void)arg;
  sleep_ms(20);
  if (write(1, "t\n", 2) != 2) return -1;
  return 0;
}

/* Never returns: nothing ever opens it. */
static int stuck_task(void *arg) {
  (void)arg;
  for (;;) sleep_ms(1000);
  return 0;
}

static int ntasks; /* host tasks submitted (slow ones) */

static void slow_release(void *obj) {
  (void)obj;
  sleep_ms(20);
}

/* Leaves work pending on one queue: copies (each to memory of its own, so that those of an
 * out-of-order queue do not write the same bytes), slow host tasks, and keep-alives. */
static int leave_pending(tdm_queue *q, const char *host, char *dev_mem) {
  for (int i = 0; i < TASKS; i++) {
    if (tdm_memcpy(q, dev_mem + (size_t)i * BYTES, host, BYTES, TDM_COPY_H2D, 0, NULL, NULL) < 0 ||
        tdm_host_task(q, slow_task, NULL, 0, NULL, NULL) < 0)
      return -1;
    ntasks++;
    if (tdm_keep_alive(q, slow_release, NULL) < 0) return -1;
  }
  return 0;
}

static int submit_on(const char *id, bool stuck) {
  tdm_device *dev;
  tdm_device_info info;
  tdm_queue *in_order, *out_of_order;
  void *host, *dev_mem;
  size_t per_queue = (size_t)TASKS * BYTES;
  int rc = tdm_device_find(id, &dev);
  if (rc == TDM_ENODEV) {
    printf("SKIP: no device %s\n", id);
    return 77;
  }
  if (rc < 0 || tdm_device_info_get(dev, &info) < 0 ||
      tdm_malloc(dev, TDM_MEM_PINNED, BYTES, &host) < 0 ||
      tdm_malloc(dev, TDM_MEM_DEVICE, 2 * per_queue, &dev_mem) < 0 ||
      tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &in_order) < 0 ||
      (stuck && tdm_host_task(in_order, stuck_task, NULL, 0, NULL, NULL) < 0) ||
      leave_pending(in_order, host, dev_mem) < 0)
    return 1;
  if (info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER)
    if (tdm_queue_create(dev, TDM_QUEUE_OUT_OF_ORDER, &out_of_order) < 0 ||
        leave_pending(out_of_order, host, (char *)dev_mem + per_queue) < 0)
      return 1;
  return 0;
}

/* A crash prints the crashing thread's stack before the signal ends the process, so a failed
 * run says where it happened (addresses in libraries resolve with addr2line). */
static void on_crash(int sig) {
  static const char msg[] = "exit-pending: crashed; the crashing thread's stack:\n";
  void *pc[64];
  int n = backtrace(pc, 64);
  if (write(2, msg, sizeof msg - 1) < 0) n = 0;
  backtrace_symbols_fd(pc, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

int main(int argc, char **argv) {
  void *warm[1];
  (void)backtrace(warm, 1); /* loads the unwinder now, not inside the handler */
  signal(SIGSEGV, on_crash);
  signal(SIGBUS, on_crash);
  signal(SIGABRT, on_crash);
  bool stuck = argc > 1 && strcmp(argv[1], "--stuck") == 0;
  int first = stuck ? 2 : 1;
  if (argc < first + 1) {
    fprintf(stderr, "usage: exit-pending [--stuck] <device-id>...\n");
    return 2;
  }
  if (tdm_init() < 0) {
    fprintf(stderr, "exit-pending: tdm_init: %s\n", tdm_last_error());
    return 1;
  }
  for (int i = first; i < argc; i++) {
    int rc = submit_on(argv[i], stuck && i == first);
    if (rc == 1) fprintf(stderr, "exit-pending: on %s: %s\n", argv[i], tdm_last_error());
    if (rc) return rc;
  }
  tdm_stats st;
  if (tdm_stats_get(&st) == 0) printf("returning from main with %ld commands pending\n", st.pending);
  printf("host tasks: %d\n", ntasks);
  return 0;
}
