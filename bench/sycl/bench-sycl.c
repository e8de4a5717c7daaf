/* bench-sycl.c: what tandem's SYCL backend costs on top of the raw DPC++ calls it makes.
 *
 * Each figure is measured twice in the same run, rep by rep in alternating order: once through
 * tandem, once through raw DPC++ calls (raw.cpp) on in-order queues of the benchmark's own,
 * created in the context tandem exports (tdm_device_native) on the same device. Reported are
 * the medians over reps of the time per call, and their ratio. Both sides are drained
 * (tdm_queue_sync, queue::wait) outside the timed region between reps.
 *   submit      tdm_memcpy 64 B pinned -> device, no event  vs  queue::memcpy (USM host ->
 *               device)
 *   record      tdm_event_record + tdm_event_release     vs  ext_oneapi_submit_barrier() (the
 *                                                             event dropped)
 *   wait        tdm_queue_wait(B, event of A)            vs  B.ext_oneapi_submit_barrier({e})
 *               on an event of A; A's events are recorded and complete before the timed loop,
 *               so only the call itself is timed (tandem makes no command for a completed
 *               event)
 *   wait_pending the same, with A held behind a host task until the timed loop is over, so
 *               every wait is for a pending event
 *   round trip  64 B copy + tdm_queue_sync               vs  queue::memcpy + queue::wait
 * Benchmarks report; they never pass or fail on timing. The goal printed alongside is each
 * ratio within 1.5x.
 */
#include "raw.h"

#include "../sidebyside.h"

#include <tandem.h>
#include <tandem/sycl.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char usage[] =
    "usage: bench-sycl [--device D] [--json FILE] [--reps R] [--iters N]\n"
    "\n"
    "Measures the cost of tandem's submit, record, device-side wait and round trip on a SYCL\n"
    "device against the raw DPC++ calls on queues in the same context, interleaved rep by rep.\n"
    "\n"
    "options:\n"
    "  --device D    a SYCL device id (default sycl:0)\n"
    "  --json FILE   also write the results, with command, commit, machine and date, to FILE\n"
    "  --reps R      repetitions; medians are reported (default 31)\n"
    "  --iters N     calls per repetition (default 1000)\n"
    "  -h, --help    show this help\n"
    "\n"
    "Exits with 77 when the device is not there.\n";

enum { TINY = 64, SPAN = 64 * 1024 }; /* copy size, and the bytes the copies cycle over */
#define DEFAULT_DEVICE "sycl:0"
#define GOAL_RATIO 1.5

/* Everything the benchmarks share. tandem's side: queues q[0] (A) and q[1] (B), pinned source
 * and device destination. Raw side: its own queues and USM (raw.h). */
typedef struct ctx {
  long iters;
  tdm_device_info info;
  tdm_queue *q[2];
  unsigned char *pinned, *devmem;
  tdm_event **tev; /* iters: events of A for the wait benchmark */
  raw *r;
  atomic_int open; /* releases the host task that holds queue A (wait_pending) */
} ctx;

/* Reports a failed tandem call. It must come before any other tandem call of this thread,
 * cleanup included: tdm_last_error() is valid only until the thread's next call. */
static int report(const char *what, int rc) {
  /* tdm_last_error() starts with the code's name */
  fprintf(stderr, "bench-sycl: %s failed: %s\n", what, tdm_last_error());
  return rc;
}

/* A tandem call; on failure it is reported at once and control goes to `out`. */
#define TRY(what, call)                                                                            \
  do {                                                                                             \
    if ((rc = (call)) < 0) {                                                                       \
      report(what, rc);                                                                            \
      goto out;                                                                                    \
    }                                                                                              \
  } while (0)

/* Where copy i goes: the copies cycle through SPAN bytes. */
static size_t tiny_offset(long i) { return (size_t)(i % (SPAN / TINY)) * TINY; }

/* Untimed: both tandem queues idle. Keeps the first error. */
static int tandem_drain(ctx *c, int rc) {
  for (int k = 0; k < 2; k++) {
    int s = tdm_queue_sync(c->q[k]);
    if (s < 0 && rc >= 0)
      rc = report("tdm_queue_sync", s);
  }
  return rc;
}

static int raw_done(ctx *c, int rc) {
  int d = raw_drain(c->r);
  return rc < 0 ? rc : d;
}

/* ---- The two sides of each benchmark: run c->iters calls, time them --------------------------- */

static int tandem_submit(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    size_t off = tiny_offset(i);
    TRY("tdm_memcpy H2D", tdm_memcpy(c->q[0], c->devmem + off, c->pinned + off, TINY,
                                     TDM_COPY_H2D, 0, NULL, NULL));
  }
  *seconds = bu_seconds() - t0;
out:
  return tandem_drain(c, rc);
}

static int raw_submit_side(void *p, double *seconds) {
  ctx *c = p;
  double t0 = bu_seconds();
  int rc = raw_submit(c->r, c->iters, TINY);
  *seconds = bu_seconds() - t0;
  return raw_done(c, rc);
}

static int tandem_record(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    tdm_event *ev;
    TRY("tdm_event_record", tdm_event_record(c->q[0], &ev));
    tdm_event_release(ev);
  }
  *seconds = bu_seconds() - t0;
out:
  return tandem_drain(c, rc);
}

static int raw_record_side(void *p, double *seconds) {
  ctx *c = p;
  double t0 = bu_seconds();
  int rc = raw_record(c->r, c->iters);
  *seconds = bu_seconds() - t0;
  return raw_done(c, rc);
}

/* The timed part of both wait benchmarks: queue B waits for each of A's events in c->tev. */
static int tandem_time_waits(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++)
    TRY("tdm_queue_wait on queue B", tdm_queue_wait(c->q[1], c->tev[i]));
  *seconds = bu_seconds() - t0;
out:
  return rc;
}

static int raw_time_waits(ctx *c, int held, double *seconds) {
  int rc = raw_prepare_waits(c->r, c->iters, held);
  if (rc == 0) {
    double t0 = bu_seconds();
    rc = raw_waits(c->r, c->iters);
    *seconds = bu_seconds() - t0;
  }
  raw_open_gate(c->r);
  return raw_done(c, rc);
}

static int tandem_wait(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  long n = 0;
  for (; n < c->iters; n++)
    TRY("tdm_event_record on queue A", tdm_event_record(c->q[0], &c->tev[n]));
  TRY("tdm_event_wait", tdm_event_wait(c->tev[n - 1]));
  rc = tandem_time_waits(c, seconds);
out:
  for (long i = 0; i < n; i++)
    tdm_event_release(c->tev[i]);
  return tandem_drain(c, rc);
}

static int raw_wait_side(void *p, double *seconds) { return raw_time_waits(p, 0, seconds); }

/* Holds queue A until the benchmark opens it: polls, sleeping 20 us between looks. */
static int hold_queue(void *arg) {
  atomic_int *open = arg;
  const struct timespec nap = {0, 20000};
  while (!atomic_load(open)) nanosleep(&nap, NULL);
  return 0;
}

static int tandem_wait_pending(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  long n = 0;
  atomic_store(&c->open, 0);
  TRY("tdm_host_task on queue A", tdm_host_task(c->q[0], hold_queue, &c->open, 0, NULL, NULL));
  for (; n < c->iters; n++)
    TRY("tdm_event_record on queue A", tdm_event_record(c->q[0], &c->tev[n]));
  rc = tandem_time_waits(c, seconds);
out:
  atomic_store(&c->open, 1);
  for (long i = 0; i < n; i++)
    tdm_event_release(c->tev[i]);
  return tandem_drain(c, rc);
}

static int raw_wait_pending_side(void *p, double *seconds) { return raw_time_waits(p, 1, seconds); }

static int tandem_round_trip(void *p, double *seconds) {
  ctx *c = p;
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    size_t off = tiny_offset(i);
    TRY("tdm_memcpy H2D", tdm_memcpy(c->q[0], c->devmem + off, c->pinned + off, TINY,
                                     TDM_COPY_H2D, 0, NULL, NULL));
    TRY("tdm_queue_sync", tdm_queue_sync(c->q[0]));
  }
  *seconds = bu_seconds() - t0;
out:
  return tandem_drain(c, rc);
}

static int raw_round_trip_side(void *p, double *seconds) {
  ctx *c = p;
  double t0 = bu_seconds();
  int rc = raw_round_trips(c->r, c->iters, TINY);
  *seconds = bu_seconds() - t0;
  return raw_done(c, rc);
}

/* ---- The table of benchmarks, the runner, the report ---------------------------------------- */

static const sbs_bench benches[] = {
    {"submit", "submit: 64 B H2D copy, no event", "tdm_memcpy", "queue::memcpy", tandem_submit,
     raw_submit_side},
    {"record", "record: marker + release", "tdm_event_record + tdm_event_release",
     "ext_oneapi_submit_barrier()", tandem_record, raw_record_side},
    {"wait", "wait: B waits for a completed event of A", "tdm_queue_wait",
     "ext_oneapi_submit_barrier({e})", tandem_wait, raw_wait_side},
    {"wait_pending", "wait: B waits for a pending event of A", "tdm_queue_wait",
     "ext_oneapi_submit_barrier({e})", tandem_wait_pending, raw_wait_pending_side},
    {"round_trip", "round trip: 64 B copy + sync", "tdm_memcpy + tdm_queue_sync",
     "queue::memcpy + queue::wait", tandem_round_trip, raw_round_trip_side},
};
#define NBENCH (sizeof benches / sizeof benches[0])


static void print_header(const ctx *c, long reps, const bu_machine *m) {
  printf("bench-sycl: tandem %s on %s (%s), commit %s\n", tdm_version_string(), c->info.id,
         c->info.name, TANDEM_GIT_COMMIT);
  printf("machine: %s, %s, %ld cores\n", m->hostname, m->cpu, m->cores);
  printf("time per call, median of %ld reps x %ld calls; raw = the DPC++ calls on queues of\n"
         "the benchmark's own in tandem's context, measured in the same run, interleaved rep by "
         "rep\n\n",
         reps, c->iters);
  sbs_print_columns();
}


static int write_json(const char *path, const char *command, const ctx *c, long reps,
                      const bu_machine *m, const sbs_result *res) {
  bu_json j;
  if (!bu_json_begin(&j, "bench-sycl", path, command, TANDEM_GIT_COMMIT, tdm_version_string(),
                     m))
    return -1;
  bu_json_object(&j, "device");
  bu_json_string(&j, "id", c->info.id);
  bu_json_string(&j, "name", c->info.name);
  bu_json_end(&j);
  bu_json_int(&j, "reps", reps);
  bu_json_int(&j, "iterations", c->iters);
  bu_json_string(&j, "unit", "microseconds per call, median over reps");
  bu_json_string(&j, "baseline", "raw DPC++ calls on the benchmark's own in-order queues in the "
                                 "context tandem exports, same device");
  sbs_write_results(&j, benches, res, NBENCH, GOAL_RATIO);
  return bu_json_close(&j, "bench-sycl", path);
}

/* ---- Setup, options, main -------------------------------------------------------------------- */

/* 0, 2 when dev is not a SYCL device, or a negative code (reported). */
static int setup(ctx *c, tdm_device *dev) {
  int rc;
  void *native = NULL;
  TRY("tdm_device_info_get", tdm_device_info_get(dev, &c->info));
  if (strcmp(c->info.backend, "sycl") != 0) {
    fprintf(stderr, "bench-sycl: %s is not a SYCL device\n", c->info.id);
    return 2;
  }
  for (int k = 0; k < 2; k++)
    TRY("tdm_queue_create", tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &c->q[k]));
  TRY("tdm_malloc pinned", tdm_malloc(dev, TDM_MEM_PINNED, SPAN, (void **)&c->pinned));
  TRY("tdm_malloc device", tdm_malloc(dev, TDM_MEM_DEVICE, SPAN, (void **)&c->devmem));
  memset(c->pinned, 0x5a, SPAN);
  c->tev = calloc((size_t)c->iters, sizeof *c->tev);
  if (!c->tev) {
    fprintf(stderr, "bench-sycl: out of host memory\n");
    return -1;
  }
  TRY("tdm_device_native", tdm_device_native(dev, &native));
  if (!(c->r = raw_open(native, SPAN, c->iters))) return -1;
out:
  return rc;
}

static void teardown(ctx *c) {
  raw_close(c->r);
  for (int k = 0; k < 2; k++)
    if (c->q[k]) tdm_queue_destroy(c->q[k]);
  if (c->devmem) tdm_free(c->devmem);
  if (c->pinned) tdm_free(c->pinned);
  free(c->tev);
}

int main(int argc, char **argv) {
  sbs_options opt;
  ctx c = {0};
  sbs_result res[NBENCH];
  bu_machine m;
  tdm_device *dev;
  char command[1024];
  int rc = sbs_parse_options("bench-sycl", usage, DEFAULT_DEVICE, argc, argv, &opt);
  if (rc)
    return rc == 1 ? 0 : 2;
  bu_join_argv(argc, argv, command, sizeof command);
  bu_machine_get(&m);
  if ((rc = tdm_init()) < 0) {
    report("tdm_init", rc);
    return 1;
  }
  if ((rc = tdm_device_find(opt.device, &dev)) < 0) {
    fprintf(stderr, "bench-sycl: skipped: %s: %s\n", opt.device, tdm_last_error());
    tdm_shutdown();
    return rc == TDM_ENODEV ? 77 : 1;
  }
  c.iters = opt.iters;
  int code = setup(&c, dev);
  if (code != 0) {
    code = code == 2 ? 2 : 1; /* 2: not a SYCL device, a usage error */
    goto out;
  }
  print_header(&c, opt.reps, &m);
  if (sbs_run_all("bench-sycl", &c, c.iters, benches, NBENCH, opt.reps, res, GOAL_RATIO) < 0)
    goto out;
  code = opt.json && write_json(opt.json, command, &c, opt.reps, &m, res) < 0 ? 1 : 0;
  if (opt.json && code == 0)
    printf("\nresults written to %s\n", opt.json);
out:
  teardown(&c);
  tdm_shutdown();
  return code;
}
