/* bench-runtime.c: what tandem's runtime costs on top of the least pthreads could do.
 *
 * Each figure is measured twice in the same run, rep by rep in alternating order: once through
 * tandem, once through a bare mutex/condvar hand-off to a worker thread (bare.h). Reported are
 * the medians over reps of the time per operation, and their ratio. Neither side spins.
 *   submit      an empty tdm_host_task with no event  vs  pushing a node to a worker
 *   round trip  empty host task, then wait for it     vs  hand-off and a condvar signal back
 *   cross-queue A records, B waits on it device-side and runs an empty host task, the
 *               caller waits for B                    vs  the same with two bare workers
 *   tiny copy   64-byte pinned H2D copies, from one thread and from two (a queue each), until
 *               all landed                            vs  hand-offs that memcpy
 * Every benchmark runs under each requested thread placement (placement.h), because where the
 * scheduler puts a worker can change a hand-off's cost tenfold on a small machine, and a ratio
 * means something only when both sides run under the same placement.
 * Benchmarks report; they never pass or fail on timing. The goal printed alongside is a round
 * trip within 1.5x of the bare one.
 */
#include "bare.h"
#include "measure.h"
#include "placement.h"

#include <tandem.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: bench-runtime [--device D] [--json FILE] [--reps R] [--iters N] [--placement P,...]\n"
    "\n"
    "Measures tandem's submission cost, round-trip latency, cross-queue event wait and tiny-copy\n"
    "throughput against a bare pthread mutex/condvar hand-off, interleaved rep by rep.\n"
    "\n"
    "options:\n"
    "  --device D    device id (default cpu:0)\n"
    "  --json FILE   also write the results, with command, commit, machine and date, to FILE\n"
    "  --reps R      repetitions; medians are reported (default 21)\n"
    "  --iters N     operations per repetition (default 2000)\n"
    "  --placement P comma-separated thread placements to measure under (default same,split):\n"
    "                same   callers and workers pinned to one CPU\n"
    "                split  callers pinned to one CPU, workers to another\n"
    "                free   left to the scheduler (the cost then depends on where it puts\n"
    "                       each worker, so the ratio may say more about it than about tandem)\n"
    "  -h, --help    show this help\n";

enum { TINY = 64, SPAN = 64 * 1024 }; /* copy size, and the bytes each thread's copies cycle over */
#define GOAL_RATIO 1.5

typedef struct bare_copy {
  void *dst;
  const void *src;
  size_t n;
} bare_copy;

/* Everything the benchmarks share. Index k in the arrays is submitting thread k. */
typedef struct ctx {
  long iters;
  tdm_device_info info;
  tdm_queue *q[2];
  /* 2 * SPAN bytes each: thread k uses [k * SPAN, (k+1) * SPAN). The bare copies write to a
   * plain host buffer of their own: device memory need not be host-addressable. */
  unsigned char *pinned, *devmem, *bare_dst;
  bare_queue bq[2];
  int bq_started[2];
  bare_node *nodes[2];   /* iters + 1 each (the last drains) */
  bare_copy *copies[2];  /* iters each */
  bare_event ev[3];
  int ev_ready;
  placement_cpus cpus; /* the current placement; submitting threads pin themselves to callers */
} ctx;

/* Reports a failed tandem call. It must come before any other tandem call of this thread,
 * cleanup included: tdm_last_error() is valid only until the thread's next call. */
static int report(const char *what, int rc) {
  /* tdm_last_error() starts with the code's name */
  fprintf(stderr, "bench-runtime: %s failed: %s\n", what, tdm_last_error());
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

static int empty_task(void *arg) {
  (void)arg;
  return 0;
}

static void bare_empty(void *arg) { (void)arg; }

static void bare_copy_run(void *arg) {
  bare_copy *cp = arg;
  memcpy(cp->dst, cp->src, cp->n);
}

/* Bare worker B's half of the cross-queue round: wait for A's "record", then signal back. */
static void bare_wait_then_signal(void *arg) {
  ctx *c = arg;
  bare_event_wait(&c->ev[0]);
  bare_event_set(&c->ev[1]);
}

/* Queues a node that sets ev behind everything on bq, and sleeps until it ran. */
static void bare_drain(bare_queue *bq, bare_node *node, bare_event *ev) {
  *node = (bare_node){NULL, bare_event_set, ev};
  bare_queue_push(bq, node);
  bare_event_wait_reset(ev);
}

/* Where thread k's copy i goes: each thread cycles through its own SPAN bytes. */
static size_t tiny_offset(int k, long i) {
  return (size_t)k * SPAN + (size_t)(i % (SPAN / TINY)) * TINY;
}

/* ---- The two sides of each benchmark: run c->iters operations, time them --------------------- */

static int tandem_submit(ctx *c, double *seconds) {
  int rc;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++)
    TRY("tdm_host_task", tdm_host_task(c->q[0], empty_task, NULL, 0, NULL, NULL));
  *seconds = bu_seconds() - t0;
  /* Untimed: the queue is idle before the next measurement. */
  TRY("tdm_queue_sync", tdm_queue_sync(c->q[0]));
out:
  if (rc < 0)
    tdm_queue_sync(c->q[0]);
  return rc;
}

static int bare_submit(ctx *c, double *seconds) {
  bare_node *n = c->nodes[0];
  for (long i = 0; i < c->iters; i++)
    n[i] = (bare_node){NULL, bare_empty, NULL};
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++)
    bare_queue_push(&c->bq[0], &n[i]);
  *seconds = bu_seconds() - t0;
  bare_drain(&c->bq[0], &n[c->iters], &c->ev[0]);
  return 0;
}

static int tandem_round_trip(ctx *c, double *seconds) {
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    tdm_event *ev;
    TRY("tdm_host_task", tdm_host_task(c->q[0], empty_task, NULL, 0, NULL, &ev));
    if ((rc = tdm_event_wait(ev)) < 0)
      report("tdm_event_wait", rc);
    tdm_event_release(ev);
    if (rc < 0)
      goto out;
  }
  *seconds = bu_seconds() - t0;
out:
  return rc;
}

static int tandem_round_trip_sync(ctx *c, double *seconds) {
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    TRY("tdm_host_task", tdm_host_task(c->q[0], empty_task, NULL, 0, NULL, NULL));
    TRY("tdm_queue_sync", tdm_queue_sync(c->q[0]));
  }
  *seconds = bu_seconds() - t0;
out:
  return rc;
}

static int bare_round_trip(ctx *c, double *seconds) {
  bare_node *n = &c->nodes[0][0];
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    *n = (bare_node){NULL, bare_event_set, &c->ev[0]};
    bare_queue_push(&c->bq[0], n);
    bare_event_wait_reset(&c->ev[0]);
  }
  *seconds = bu_seconds() - t0;
  return 0;
}

static int tandem_cross(ctx *c, double *seconds) {
  int rc = 0;
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    tdm_event *ea, *eb;
    TRY("tdm_event_record on queue A", tdm_event_record(c->q[0], &ea));
    if ((rc = tdm_queue_wait(c->q[1], ea)) < 0 ||
        (rc = tdm_host_task(c->q[1], empty_task, NULL, 0, NULL, &eb)) < 0) {
      report("tdm_queue_wait or tdm_host_task on queue B", rc);
      tdm_event_release(ea);
      goto out;
    }
    if ((rc = tdm_event_wait(eb)) < 0)
      report("tdm_event_wait", rc);
    tdm_event_release(ea);
    tdm_event_release(eb);
    if (rc < 0)
      goto out;
  }
  *seconds = bu_seconds() - t0;
out:
  return rc;
}

static int bare_cross(ctx *c, double *seconds) {
  bare_node *a = &c->nodes[0][0], *b = &c->nodes[1][0];
  double t0 = bu_seconds();
  for (long i = 0; i < c->iters; i++) {
    *a = (bare_node){NULL, bare_event_set, &c->ev[0]};
    *b = (bare_node){NULL, bare_wait_then_signal, c};
    bare_queue_push(&c->bq[0], a);
    bare_queue_push(&c->bq[1], b);
    bare_event_wait_reset(&c->ev[1]);
    bare_event_wait_reset(&c->ev[0]); /* already set: B waited for it */
  }
  *seconds = bu_seconds() - t0;
  return 0;
}

/* Thread k's tiny copies, submitted and landed: through tandem on queue k, or bare worker k. */
static int tandem_copies(ctx *c, int k) {
  int rc;
  for (long i = 0; i < c->iters; i++) {
    size_t off = tiny_offset(k, i);
    TRY("tdm_memcpy H2D", tdm_memcpy(c->q[k], c->devmem + off, c->pinned + off, TINY,
                                     TDM_COPY_H2D, 0, NULL, NULL));
  }
  TRY("tdm_queue_sync", tdm_queue_sync(c->q[k]));
out:
  if (rc < 0)
    tdm_queue_sync(c->q[k]);
  return rc;
}

static int bare_copies(ctx *c, int k) {
  bare_node *n = c->nodes[k];
  for (long i = 0; i < c->iters; i++) {
    n[i] = (bare_node){NULL, bare_copy_run, &c->copies[k][i]};
    bare_queue_push(&c->bq[k], &n[i]);
  }
  bare_drain(&c->bq[k], &n[c->iters], &c->ev[k]);
  return 0;
}

static int tandem_copy1(ctx *c, double *seconds) {
  double t0 = bu_seconds();
  int rc = tandem_copies(c, 0);
  *seconds = bu_seconds() - t0;
  return rc;
}

static int bare_copy1(ctx *c, double *seconds) {
  double t0 = bu_seconds();
  bare_copies(c, 0);
  *seconds = bu_seconds() - t0;
  return 0;
}

/* Two submitting threads, released together by a barrier; the time is from the first start to
 * the last finish. */
typedef struct copier {
  ctx *c;
  int k, tandem, rc;
  pthread_barrier_t *start;
  double t0, t1;
} copier;

static void *copier_main(void *arg) {
  copier *cp = arg;
  placement_pin_self(&cp->c->cpus.callers); /* best effort: it worked for the main thread */
  pthread_barrier_wait(cp->start);
  cp->t0 = bu_seconds();
  cp->rc = cp->tandem ? tandem_copies(cp->c, cp->k) : bare_copies(cp->c, cp->k);
  cp->t1 = bu_seconds();
  return NULL;
}

static int copy2(ctx *c, int tandem, double *seconds) {
  pthread_barrier_t start;
  pthread_t th[2];
  copier cp[2];
  int started = 0, rc = 0;
  pthread_barrier_init(&start, NULL, 2);
  for (; started < 2; started++) {
    cp[started] = (copier){c, started, tandem, 0, &start, 0, 0};
    if ((rc = pthread_create(&th[started], NULL, copier_main, &cp[started])) != 0) {
      fprintf(stderr, "bench-runtime: pthread_create: %s\n", strerror(rc));
      break;
    }
  }
  if (started == 1) /* let the one that started through the barrier */
    pthread_barrier_wait(&start);
  for (int k = 0; k < started; k++)
    pthread_join(th[k], NULL);
  pthread_barrier_destroy(&start);
  if (started < 2 || cp[0].rc < 0 || cp[1].rc < 0)
    return -1;
  double first_start = cp[0].t0 < cp[1].t0 ? cp[0].t0 : cp[1].t0;
  double last_end = cp[0].t1 > cp[1].t1 ? cp[0].t1 : cp[1].t1;
  *seconds = last_end - first_start;
  return 0;
}

static int tandem_copy2(ctx *c, double *seconds) { return copy2(c, 1, seconds); }
static int bare_copy2(ctx *c, double *seconds) { return copy2(c, 0, seconds); }

/* ---- The table of benchmarks, the runner, the report ---------------------------------------- */

typedef struct bench {
  const char *key;   /* JSON name */
  const char *label; /* human name */
  int (*tandem)(ctx *, double *);
  int (*bare)(ctx *, double *);
  int ops_per_iter; /* operations per iteration: 2 when two threads each do iters */
  int goal;         /* a round trip: the 1.5x goal applies */
  int copies;       /* report throughput as well */
} bench;

static const bench benches[] = {
    {"submit_host_task", "submit: empty host task, no event", tandem_submit, bare_submit, 1, 0, 0},
    {"round_trip_event_wait", "round trip: host task + tdm_event_wait", tandem_round_trip,
     bare_round_trip, 1, 1, 0},
    {"round_trip_queue_sync", "round trip: host task + tdm_queue_sync", tandem_round_trip_sync,
     bare_round_trip, 1, 1, 0},
    {"cross_queue_wait", "record A, wait on B, host task, wait", tandem_cross, bare_cross, 1, 0, 0},
    {"tiny_copy_1_thread", "tiny copy 64 B H2D, 1 thread", tandem_copy1, bare_copy1, 1, 0, 1},
    {"tiny_copy_2_threads", "tiny copy 64 B H2D, 2 threads", tandem_copy2, bare_copy2, 2, 0, 1},
};
#define NBENCH (sizeof benches / sizeof benches[0])

typedef struct result {
  double tandem_us, bare_us, ratio; /* per operation, medians over reps */
} result;

typedef struct side_arg {
  ctx *c;
  const bench *b;
} side_arg;

static int side(void *p, int baseline, double *seconds) {
  side_arg *a = p;
  return baseline ? a->b->bare(a->c, seconds) : a->b->tandem(a->c, seconds);
}

static int run_bench(ctx *c, const bench *b, long reps, result *r) {
  side_arg a = {c, b};
  double t, bt, ops = (double)c->iters * b->ops_per_iter;
  if (bu_interleaved(&a, side, NULL, reps, &t, &bt) < 0)
    return -1;
  r->tandem_us = t / ops * 1e6;
  r->bare_us = bt / ops * 1e6;
  r->ratio = r->tandem_us / r->bare_us;
  return 0;
}

static void print_header(const ctx *c, long reps, const bu_machine *m) {
  printf("bench-runtime: tandem %s on %s (%s), commit %s\n", tdm_version_string(), c->info.id,
         c->info.name, TANDEM_GIT_COMMIT);
  printf("machine: %s, %s, %ld cores\n", m->hostname, m->cpu, m->cores);
  printf("time per operation, median of %ld reps x %ld iterations; bare = pthread mutex/condvar\n"
         "hand-off to a worker thread, measured in the same run, interleaved rep by rep\n",
         reps, c->iters);
}

static void print_placement(placement p) {
  printf("\nplacement %s: %s\n", placement_name(p), placement_about(p));
  printf("  %-40s %10s %10s %8s\n", "benchmark", "tandem", "bare", "ratio");
}

static void print_row(const bench *b, const result *r) {
  printf("  %-40s %7.3f us %7.3f us %7.2fx", b->label, r->tandem_us, r->bare_us, r->ratio);
  if (b->goal)
    printf("   goal <= %.1fx: %s", GOAL_RATIO, r->ratio <= GOAL_RATIO ? "met" : "missed");
  if (b->copies)
    printf("   %.2f vs %.2f M copies/s", 1.0 / r->tandem_us, 1.0 / r->bare_us);
  putchar('\n');
  fflush(stdout);
}

/* The measurements of one placement. */
typedef struct section {
  placement where;
  int measured; /* 0: the machine cannot provide the placement */
  result res[NBENCH];
} section;

static void write_result_json(bu_json *j, const bench *b, placement p, const result *r) {
  bu_json_object(j, NULL);
  bu_json_string(j, "name", b->key);
  bu_json_string(j, "placement", placement_name(p));
  bu_json_string(j, "description", b->label);
  bu_json_double(j, "tandem_us", r->tandem_us, 4);
  bu_json_double(j, "bare_us", r->bare_us, 4);
  bu_json_double(j, "ratio", r->ratio, 4);
  if (b->goal) {
    bu_json_double(j, "goal_ratio", GOAL_RATIO, 1);
    bu_json_bool(j, "goal_met", r->ratio <= GOAL_RATIO);
  }
  if (b->copies) {
    bu_json_double(j, "tandem_mcopies_per_s", 1.0 / r->tandem_us, 4);
    bu_json_double(j, "bare_mcopies_per_s", 1.0 / r->bare_us, 4);
  }
  bu_json_end(j);
}

static int write_json(const char *path, const char *command, const ctx *c, long reps,
                      const bu_machine *m, const section *sec, int nsec) {
  bu_json j;
  if (!bu_json_begin(&j, "bench-runtime", path, command, TANDEM_GIT_COMMIT, tdm_version_string(),
                     m))
    return -1;
  bu_json_object(&j, "device");
  bu_json_string(&j, "id", c->info.id);
  bu_json_string(&j, "name", c->info.name);
  bu_json_end(&j);
  bu_json_int(&j, "reps", reps);
  bu_json_int(&j, "iterations", c->iters);
  bu_json_string(&j, "unit", "microseconds per operation, median over reps");
  bu_json_string(&j, "baseline", "pthread mutex/condvar hand-off to a worker thread, no spinning");
  bu_json_object(&j, "placements");
  for (int i = 0; i < nsec; i++)
    bu_json_string(&j, placement_name(sec[i].where),
                   sec[i].measured ? placement_about(sec[i].where) : "not available here");
  bu_json_end(&j);
  bu_json_array(&j, "results");
  for (int i = 0; i < nsec; i++)
    for (size_t b = 0; sec[i].measured && b < NBENCH; b++)
      write_result_json(&j, &benches[b], sec[i].where, &sec[i].res[b]);
  bu_json_end(&j);
  return bu_json_close(&j, "bench-runtime", path);
}

/* ---- Setup, options, main -------------------------------------------------------------------- */

static int setup(ctx *c, const char *device) {
  int rc;
  tdm_device *dev;
  TRY("tdm_device_find", tdm_device_find(device, &dev));
  TRY("tdm_device_info_get", tdm_device_info_get(dev, &c->info));
  for (int k = 0; k < 2; k++)
    TRY("tdm_queue_create", tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &c->q[k]));
  TRY("tdm_malloc pinned", tdm_malloc(dev, TDM_MEM_PINNED, 2 * SPAN, (void **)&c->pinned));
  TRY("tdm_malloc device", tdm_malloc(dev, TDM_MEM_DEVICE, 2 * SPAN, (void **)&c->devmem));
  memset(c->pinned, 0x5a, 2 * SPAN);
  if (!(c->bare_dst = calloc(2, SPAN))) {
    fprintf(stderr, "bench-runtime: out of host memory\n");
    return -1;
  }
  for (int k = 0; k < 2; k++) {
    c->nodes[k] = calloc((size_t)c->iters + 1, sizeof *c->nodes[k]);
    c->copies[k] = calloc((size_t)c->iters, sizeof *c->copies[k]);
    if (!c->nodes[k] || !c->copies[k]) {
      fprintf(stderr, "bench-runtime: out of host memory\n");
      return -1;
    }
    for (long i = 0; i < c->iters; i++)
      c->copies[k][i] =
          (bare_copy){c->bare_dst + tiny_offset(k, i), c->pinned + tiny_offset(k, i), TINY};
    if ((rc = bare_queue_start(&c->bq[k])) != 0) {
      fprintf(stderr, "bench-runtime: pthread_create: %s\n", strerror(rc));
      return -1;
    }
    c->bq_started[k] = 1;
  }
  for (int i = 0; i < 3; i++)
    bare_event_init(&c->ev[i]);
  c->ev_ready = 1;
out:
  return rc;
}

static void teardown(ctx *c) {
  for (int k = 0; k < 2; k++) {
    if (c->bq_started[k])
      bare_queue_stop(&c->bq[k]);
    if (c->q[k])
      tdm_queue_destroy(c->q[k]);
    free(c->nodes[k]);
    free(c->copies[k]);
  }
  if (c->devmem)
    tdm_free(c->devmem);
  if (c->pinned)
    tdm_free(c->pinned);
  free(c->bare_dst);
  for (int i = 0; c->ev_ready && i < 3; i++)
    bare_event_destroy(&c->ev[i]);
}

typedef struct options {
  const char *device, *json;
  long reps, iters;
  placement where[PLACE_COUNT];
  int nwhere;
} options;

static int parse_long(const char *name, const char *s, long max, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 1 || v > max) {
    fprintf(stderr, "bench-runtime: %s wants a whole number from 1 to %ld, not '%s'\n", name,
            max, s);
    return -1;
  }
  *out = v;
  return 0;
}

/* 0 to run, 1 after printing help, 2 on a usage error. */
static int parse_options(int argc, char **argv, options *o) {
  *o = (options){"cpu:0", NULL, 21, 2000, {PLACE_SAME, PLACE_SPLIT}, 2};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int has_value = i + 1 < argc;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(usage, stdout);
      return 1;
    }
    if (strcmp(a, "--device") && strcmp(a, "--json") && strcmp(a, "--reps") &&
        strcmp(a, "--iters") && strcmp(a, "--placement")) {
      fprintf(stderr, "bench-runtime: unknown option '%s'\n%s", a, usage);
      return 2;
    }
    if (!has_value) {
      fprintf(stderr, "bench-runtime: option %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    if (strcmp(a, "--device") == 0)
      o->device = v;
    else if (strcmp(a, "--json") == 0)
      o->json = v;
    else if (strcmp(a, "--placement") == 0) {
      if ((o->nwhere = placement_parse(v, o->where)) < 0) {
        fprintf(stderr, "bench-runtime: --placement wants same, split or free, comma-separated, "
                        "not '%s'\n", v);
        return 2;
      }
    }
    else if (parse_long(a, v, strcmp(a, "--reps") == 0 ? 1000 : 10000000,
                        strcmp(a, "--reps") == 0 ? &o->reps : &o->iters) < 0)
      return 2;
  }
  return 0;
}

/* Pins the main thread and every worker, tandem's and bare, for placement p. 1 when the
 * machine cannot provide it, -1 on failure. */
static int apply_placement(ctx *c, placement p) {
  int rc;
  if (placement_cpus_get(p, &c->cpus) < 0)
    return 1;
  if ((rc = placement_pin_self(&c->cpus.callers)) != 0) {
    fprintf(stderr, "bench-runtime: pinning the main thread: %s\n", strerror(rc));
    return -1;
  }
  for (int k = 0; k < 2; k++) {
    if ((rc = placement_pin_tandem_worker(c->q[k], &c->cpus.workers)) < 0)
      return -1; /* reported by placement_pin_tandem_worker */
    if ((rc = placement_pin_bare_worker(&c->bq[k], &c->cpus.workers)) != 0) {
      fprintf(stderr, "bench-runtime: pinning a bare worker: %s\n", strerror(rc));
      return -1;
    }
  }
  return 0;
}

/* Runs every benchmark under placement p, printing each row as it completes. */
static int run_section(ctx *c, long reps, section *sec) {
  int rc = apply_placement(c, sec->where);
  if (rc < 0)
    return -1;
  if (rc > 0) {
    printf("\nplacement %s: not available (the process may run on one CPU only)\n",
           placement_name(sec->where));
    return 0;
  }
  print_placement(sec->where);
  for (size_t b = 0; b < NBENCH; b++) {
    if (run_bench(c, &benches[b], reps, &sec->res[b]) < 0)
      return -1;
    print_row(&benches[b], &sec->res[b]);
  }
  sec->measured = 1;
  return 0;
}

int main(int argc, char **argv) {
  options opt;
  ctx c = {0};
  section sec[PLACE_COUNT] = {0};
  bu_machine m;
  char command[1024];
  int rc = parse_options(argc, argv, &opt);
  if (rc)
    return rc == 1 ? 0 : 2;
  bu_join_argv(argc, argv, command, sizeof command);
  bu_machine_get(&m);
  if ((rc = tdm_init()) < 0) {
    report("tdm_init", rc);
    return 1;
  }
  c.iters = opt.iters;
  int code = 1;
  if (setup(&c, opt.device) != 0)
    goto out;
  print_header(&c, opt.reps, &m);
  for (int i = 0; i < opt.nwhere; i++) {
    sec[i].where = opt.where[i];
    if (run_section(&c, opt.reps, &sec[i]) < 0)
      goto out;
  }
  code = opt.json && write_json(opt.json, command, &c, opt.reps, &m, sec, opt.nwhere) < 0 ? 1 : 0;
  if (opt.json && code == 0)
    printf("\nresults written to %s\n", opt.json);
out:
  teardown(&c);
  tdm_shutdown();
  return code;
}
