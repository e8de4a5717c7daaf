/* overlap.c: `tandem bench overlap`: does a copy queue really overlap a compute queue?
 *
 * N chunks of random floats sit in pinned host memory. The copy queue copies chunk i into
 * device slot i and records an event; the compute queue waits for that event device-side and
 * runs real arithmetic on the landed chunk. Serialized (each copy also waits for the previous
 * compute) and overlapped (copies stream ahead) runs are timed in alternation, next to copy
 * alone and compute alone, after calibrating the compute so that both sides take about as long.
 * Every compute result is compared, at the end, with the same arithmetic done serially on the
 * host from the host copy of the data, and the device slots are zeroed before each run, so a
 * compute that started before its copy landed shows up as a mismatch.
 *
 * The compute is a host task reading device memory directly, so it needs a device whose memory
 * is host memory (the CPU backend); GPU compute comes with the GEMM operations.
 */
#include "overlap_dev.h"
#include "tool.h"

#include "measure.h"

#include <tandem.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char overlap_help[] =
    "usage: tandem bench overlap [--device D] [--json] [--trace FILE] [--chunks N] [--chunk-bytes B] [--reps R]\n"
    "\n"
    "Streams N chunks from pinned host memory to device slots on a copy queue while a compute\n"
    "queue waits for each chunk's event device-side and computes on it. Compute is calibrated\n"
    "to take about as long as the copy; then serialized and overlapped runs are timed in\n"
    "alternation and the median of R reps is reported, with the overlap efficiency\n"
    "max(copy, compute) / overlapped and the hidden fraction\n"
    "(serialized - overlapped) / min(copy, compute). Results are checked against the same\n"
    "arithmetic done serially on the host.\n"
    "\n"
    "options:\n"
    "  --device D        device id (default: the default device, see 'tandem devices')\n"
    "  --chunks N        number of chunks (default 32)\n"
    "  --chunk-bytes B   bytes per chunk, suffix K/M/G allowed (default 4M)\n"
    "  --reps R          repetitions; medians are reported (default 5)\n"
    "  --json            print JSON on stdout instead of the report\n"
    "  --trace FILE      write every command's start and end per queue to FILE in the Chrome\n"
    "                    trace-event format (open it in chrome://tracing or Perfetto)\n"
    "  -h, --help        show this help\n";

enum { LANES = 16, MAX_PASSES = 100000 };

typedef struct overlap_opts {
  const char *device; /* NULL: the default device */
  const char *trace;  /* --trace FILE: a Chrome trace of every command (TANDEM_TRACE) */
  int json;
  long chunks, reps;
  size_t chunk_bytes;
} overlap_opts;

/* One chunk's compute: the argument of its host task. */
typedef struct chunk_task {
  const float *x; /* the chunk in its device slot (host-addressable on this backend) */
  size_t n;       /* floats */
  int passes;
  double *result;
} chunk_task;

typedef struct overlap {
  overlap_opts opt;
  tdm_device_info info;
  tdm_queue *copyq, *compq;
  float *host;  /* pinned: the chunks' source */
  float *slots; /* device: slot i receives chunk i */
  size_t n;     /* floats per chunk */
  int passes;
  chunk_task *tasks;
  tdm_event **copy_ev, **comp_ev; /* per chunk, for the pipelined runs */
  double *results;                /* 3 * reps runs of `chunks` results, checked at the end */
  double *scratch;                /* results of calibration runs, not checked */
  odev *dev;                      /* device compute (an OpenCL kernel), or NULL: host tasks */
} overlap;

/* Per-rep timings in seconds. */
typedef struct timings {
  double *copy, *compute, *serialized, *overlapped;
} timings;

/* Runs a tandem call; on failure reports it at once (tdm_last_error() describes only the
 * thread's latest call) and jumps to `out`. */
#define TRY(what, call)                                                                            \
  do {                                                                                             \
    rc = (call);                                                                                   \
    if (rc < 0) {                                                                                  \
      tool_fail(what, rc);                                                                         \
      goto out;                                                                                    \
    }                                                                                              \
  } while (0)

/* The arithmetic: `passes` sweeps over the chunk, each keeping an exponentially weighted
 * running average per lane and accumulating every element times that average, in LANES
 * independent lanes. The result depends on every element, so a chunk read before its copy
 * landed gives a different result. noinline so that the host task and the serial check run the
 * very same machine code and must agree bit for bit. */
#if defined(__GNUC__)
__attribute__((noinline))
#endif
static double chunk_compute(const float *x, size_t n, int passes) {
  float avg[LANES] = {0}, dot[LANES] = {0};
  for (int p = 0; p < passes; p++) {
    const float a = 1.0f - 1.0f / (float)(64 + p % 64), b = 1.0f - a;
    size_t i = 0;
    for (; i + LANES <= n; i += LANES)
      for (int l = 0; l < LANES; l++) {
        avg[l] = avg[l] * a + x[i + l] * b;
        dot[l] += x[i + l] * avg[l];
      }
    for (; i < n; i++)
      dot[0] += x[i] * avg[0];
  }
  double sum = 0.0;
  for (int l = 0; l < LANES; l++)
    sum += (double)dot[l] + (double)avg[l];
  return sum;
}

static int chunk_task_run(void *arg) {
  chunk_task *t = arg;
  *t->result = chunk_compute(t->x, t->n, t->passes);
  return 0;
}

/* Uniform floats in [-1, 1) from a fixed seed (xorshift64*), so runs are reproducible. */
static void fill_random(float *x, size_t n) {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < n; i++) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    x[i] = (float)(int32_t)((s * 0x2545F4914F6CDD1Dull) >> 32) * (1.0f / 2147483648.0f);
  }
}

/* A progress line on stderr, only for a person watching a terminal. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void progress(const overlap *o, const char *fmt, ...) {
  va_list ap;
  if (o->opt.json || !isatty(STDERR_FILENO))
    return;
  fputs("  ... ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

/* ---- The runs: each leaves both queues idle and returns 0 or a reported failure ---------- */

/* Zeroes every device slot, so that a compute that ran before its copy landed is caught. */
static int clear_slots(overlap *o) {
  int rc;
  TRY("tdm_memset of the device slots",
      tdm_memset(o->copyq, o->slots, 0, o->n * sizeof(float) * (size_t)o->opt.chunks, 0, NULL,
                 NULL));
  TRY("tdm_queue_sync after tdm_memset", tdm_queue_sync(o->copyq));
out:
  return rc;
}

static int run_copy_alone(overlap *o, double *seconds) {
  int rc;
  double t0 = bu_seconds();
  for (long i = 0; i < o->opt.chunks; i++)
    TRY("tdm_memcpy H2D", tdm_memcpy(o->copyq, o->slots + i * o->n, o->host + i * o->n,
                                     o->opt.chunk_bytes, TDM_COPY_H2D, 0, NULL, NULL));
  TRY("tdm_queue_sync of the copy queue", tdm_queue_sync(o->copyq));
  *seconds = bu_seconds() - t0;
out:
  if (rc < 0)
    tdm_queue_sync(o->copyq); /* leave it idle; the failure is already reported */
  return rc;
}

/* Points chunk i's task at results[i] with the current pass count. */
static void prepare_tasks(overlap *o, double *results) {
  for (long i = 0; i < o->opt.chunks; i++)
    o->tasks[i] = (chunk_task){o->slots + i * o->n, o->n, o->passes, results + i};
}

/* Chunk i's compute, in the compute queue's order: a host task reading the slot (devices
 * whose memory the host reads), or a kernel of the device's own (odev). */
static int submit_compute(overlap *o, long i, tdm_event **done) {
  int rc = o->dev ? odev_enqueue(o->dev, o->tasks[i].x, o->n, o->passes, i)
                  : tdm_host_task(o->compq, chunk_task_run, &o->tasks[i], 0, NULL, NULL);
  /* A marker covers the kernel too: it is work other code put on the native queue. */
  if (rc == 0 && done) rc = tdm_event_record(o->compq, done);
  return rc;
}

/* Device compute leaves its results on the device: bring them back after the run. */
static int collect(overlap *o, double *results) {
  return o->dev ? odev_collect(o->dev, o->opt.chunks, results) : 0;
}

/* Compute on data already in the slots. */
static int run_compute_alone(overlap *o, double *results, double *seconds) {
  int rc;
  prepare_tasks(o, results);
  double t0 = bu_seconds();
  for (long i = 0; i < o->opt.chunks; i++)
    TRY("the compute", submit_compute(o, i, NULL));
  TRY("tdm_queue_sync of the compute queue", tdm_queue_sync(o->compq));
  *seconds = bu_seconds() - t0;
  TRY("collecting the results", collect(o, results));
out:
  if (rc < 0)
    tdm_queue_sync(o->compq);
  return rc;
}

/* Copy chunk i, record, make the compute queue wait for it device-side, compute. Serialized:
 * copy i also waits device-side for compute i-1, so nothing overlaps. */
static int run_pipeline(overlap *o, int serialized, double *results, double *seconds) {
  int rc;
  long i, ncopy = 0, ncomp = 0; /* events to release */
  prepare_tasks(o, results);
  double t0 = bu_seconds();
  for (i = 0; i < o->opt.chunks; i++) {
    if (serialized && i > 0)
      TRY("tdm_queue_wait of the copy queue", tdm_queue_wait(o->copyq, o->comp_ev[i - 1]));
    TRY("tdm_memcpy H2D", tdm_memcpy(o->copyq, o->slots + i * o->n, o->host + i * o->n,
                                     o->opt.chunk_bytes, TDM_COPY_H2D, 0, NULL, NULL));
    TRY("tdm_event_record", tdm_event_record(o->copyq, &o->copy_ev[i]));
    ncopy++;
    TRY("tdm_queue_wait of the compute queue", tdm_queue_wait(o->compq, o->copy_ev[i]));
    TRY("the compute", submit_compute(o, i, serialized ? &o->comp_ev[i] : NULL));
    ncomp += serialized;
  }
  TRY("tdm_queue_sync of the compute queue", tdm_queue_sync(o->compq));
  *seconds = bu_seconds() - t0;
  TRY("tdm_queue_sync of the copy queue", tdm_queue_sync(o->copyq));
  TRY("collecting the results", collect(o, results));
out:
  if (rc < 0) { /* drain both; the failure is already reported */
    tdm_queue_sync(o->compq);
    tdm_queue_sync(o->copyq);
  }
  /* The events are held until both queues are idle: the header does not say whether a
   * queue_wait keeps its own reference. */
  for (i = 0; i < ncopy; i++)
    tdm_event_release(o->copy_ev[i]);
  for (i = 0; i < ncomp; i++)
    tdm_event_release(o->comp_ev[i]);
  return rc;
}

/* ---- Calibration, timed reps, check -------------------------------------------------------- */

enum { CALIBRATION_REPS = 3 };

static int median_copy(overlap *o, double *median) {
  double t[CALIBRATION_REPS];
  for (int r = 0; r < CALIBRATION_REPS; r++)
    if (run_copy_alone(o, &t[r]) < 0)
      return -1;
  *median = bu_median(t, CALIBRATION_REPS);
  return 0;
}

static int median_compute(overlap *o, double *median) {
  double t[CALIBRATION_REPS];
  for (int r = 0; r < CALIBRATION_REPS; r++)
    if (run_compute_alone(o, o->scratch, &t[r]) < 0)
      return -1;
  *median = bu_median(t, CALIBRATION_REPS);
  return 0;
}

/* Picks the pass count that makes compute about as long as the copy. The first pass reads
 * from memory and later ones from cache, so time is not linear in passes: iterate a few times. */
static int calibrate(overlap *o) {
  double copy, compute, warm;
  o->passes = 1;
  /* Warm-up: the first touch of the slots and the workers' first wake-ups are not timed. */
  if (clear_slots(o) < 0 || run_copy_alone(o, &warm) < 0 ||
      run_compute_alone(o, o->scratch, &warm) < 0)
    return -1;
  if (median_copy(o, &copy) < 0)
    return -1;
  for (int iter = 0; iter < 5; iter++) {
    if (median_compute(o, &compute) < 0)
      return -1;
    progress(o, "calibrating: copy %.2f ms, compute %.2f ms with %d pass(es)", copy * 1e3,
             compute * 1e3, o->passes);
    double want = (double)o->passes * copy / compute + 0.5;
    int next = want < 1.0 ? 1 : want > MAX_PASSES ? MAX_PASSES : (int)want;
    if (next == o->passes)
      break;
    o->passes = next;
  }
  return 0;
}

/* One rep: copy alone, compute alone on the landed data, then serialized and overlapped in an
 * order that alternates from rep to rep, so that drift favours neither. */
static int run_rep(overlap *o, long r, timings *t) {
  double *res = o->results + (size_t)(3 * r) * (size_t)o->opt.chunks;
  size_t stride = (size_t)o->opt.chunks;
  if (clear_slots(o) < 0 || run_copy_alone(o, &t->copy[r]) < 0 ||
      run_compute_alone(o, res, &t->compute[r]) < 0)
    return -1;
  for (int k = 0; k < 2; k++) {
    int serialized = (k + (int)r) % 2 == 0;
    double *out = serialized ? &t->serialized[r] : &t->overlapped[r];
    double *results = res + (serialized ? 1 : 2) * stride;
    if (clear_slots(o) < 0 || run_pipeline(o, serialized, results, out) < 0)
      return -1;
  }
  progress(o, "rep %ld/%ld: copy %.2f ms, compute %.2f ms, serialized %.2f ms, overlapped %.2f ms",
           r + 1, o->opt.reps, t->copy[r] * 1e3, t->compute[r] * 1e3, t->serialized[r] * 1e3,
           t->overlapped[r] * 1e3);
  return 0;
}

/* Compares every checked run's results with the serial host computation from the host data.
 * Returns the number of mismatches. */
static long check_results(const overlap *o) {
  long bad = 0, runs = 3 * o->opt.reps;
  for (long i = 0; i < o->opt.chunks; i++) {
    double ref = chunk_compute(o->host + i * o->n, o->n, o->passes);
    for (long r = 0; r < runs; r++)
      bad += o->results[r * o->opt.chunks + i] != ref;
  }
  return bad;
}

/* ---- Report ------------------------------------------------------------------------------- */

typedef struct figures {
  double copy, compute, serialized, overlapped; /* ms */
  double efficiency, hidden, speedup, gbps;
  long checked, mismatches;
} figures;

static void report_human(const overlap *o, const figures *f) {
  char chunk[32], total[32];
  tool_format_bytes(o->opt.chunk_bytes, chunk, sizeof chunk);
  tool_format_bytes(o->opt.chunk_bytes * (uint64_t)o->opt.chunks, total, sizeof total);
  double nc = (double)o->opt.chunks;
  printf("tandem bench overlap on %s (%s)\n", o->info.id, o->info.name);
  printf("  data     %ld chunks x %s = %s of random floats in pinned host memory,\n"
         "           copied to %ld device slots; median of %ld rep%s\n",
         o->opt.chunks, chunk, total, o->opt.chunks, o->opt.reps, o->opt.reps == 1 ? "" : "s");
  printf("  copy     copy queue: tdm_memcpy H2D of chunk i into slot i, tdm_event_record\n");
  printf("  compute  compute queue: tdm_queue_wait on chunk i's event, then %s doing\n"
         "           %d pass%s of a %d-lane multiply-add reduction over the chunk\n"
         "           (pass count calibrated so that compute takes about as long as the copy)\n\n",
         o->dev ? "an OpenCL kernel on the\n           queue's exported cl_command_queue" : "a host task",
         o->passes, o->passes == 1 ? "" : "es", LANES);
  printf("  copy alone      %9.2f ms   %.3f ms/chunk, %.2f GB/s\n", f->copy, f->copy / nc, f->gbps);
  printf("  compute alone   %9.2f ms   %.3f ms/chunk\n", f->compute, f->compute / nc);
  printf("  serialized      %9.2f ms   copy i+1 waits for compute i: nothing overlaps\n",
         f->serialized);
  printf("  overlapped      %9.2f ms   copies stream ahead while compute follows\n\n",
         f->overlapped);
  printf("  speedup            %6.2fx   serialized / overlapped\n", f->speedup);
  printf("  overlap efficiency %6.2f    max(copy, compute) / overlapped; 1.00 = the shorter side\n"
         "                               fully hidden under the longer one\n",
         f->efficiency);
  printf("  hidden fraction    %6.2f    (serialized - overlapped) / min(copy, compute): the share\n"
         "                               of the shorter side that overlap hid (above 1 when the\n"
         "                               serialized run also paid for its extra hand-offs)\n",
         f->hidden);
  if (f->mismatches == 0)
    printf("  check              ok        all %ld chunk results equal the serial host "
           "computation\n",
           f->checked);
  else
    printf("  check              FAILED    %ld of %ld chunk results differ from the serial host "
           "computation\n",
           f->mismatches, f->checked);
}

/* Returns 0, or -1 when stdout failed. */
static int report_json(const overlap *o, const figures *f) {
  bu_json j;
  bu_json_init(&j, stdout, 1);
  bu_json_object(&j, NULL);
  tool_json_header(&j);
  bu_json_object(&j, "device");
  bu_json_string(&j, "id", o->info.id);
  bu_json_string(&j, "name", o->info.name);
  bu_json_end(&j);
  bu_json_int(&j, "chunks", o->opt.chunks);
  bu_json_uint(&j, "chunk_bytes", o->opt.chunk_bytes);
  bu_json_int(&j, "reps", o->opt.reps);
  bu_json_int(&j, "passes", o->passes);
  bu_json_double(&j, "copy_ms", f->copy, 4);
  bu_json_double(&j, "compute_ms", f->compute, 4);
  bu_json_double(&j, "serialized_ms", f->serialized, 4);
  bu_json_double(&j, "overlapped_ms", f->overlapped, 4);
  bu_json_double(&j, "copy_gb_per_s", f->gbps, 3);
  bu_json_double(&j, "speedup", f->speedup, 4);
  bu_json_double(&j, "overlap_efficiency", f->efficiency, 4);
  bu_json_double(&j, "hidden_fraction", f->hidden, 4);
  bu_json_string(&j, "check", f->mismatches ? "failed" : "ok");
  bu_json_int(&j, "checked_results", f->checked);
  bu_json_int(&j, "mismatches", f->mismatches);
  bu_json_end(&j);
  return bu_json_finish(&j);
}

static void compute_figures(const overlap *o, timings *t, figures *f) {
  size_t r = (size_t)o->opt.reps;
  f->copy = bu_median(t->copy, r) * 1e3;
  f->compute = bu_median(t->compute, r) * 1e3;
  f->serialized = bu_median(t->serialized, r) * 1e3;
  f->overlapped = bu_median(t->overlapped, r) * 1e3;
  double longer = f->copy > f->compute ? f->copy : f->compute;
  double shorter = f->copy > f->compute ? f->compute : f->copy;
  f->efficiency = longer / f->overlapped;
  f->hidden = (f->serialized - f->overlapped) / shorter;
  f->speedup = f->serialized / f->overlapped;
  f->gbps = (double)o->opt.chunk_bytes * (double)o->opt.chunks / (f->copy * 1e-3) / 1e9;
}

/* ---- Setup and the command ----------------------------------------------------------------- */

static const char cmd[] = "bench overlap";

/* Returns 0, 1 after printing the help, or -1 after a usage error. */
static int parse_options(int argc, char **argv, overlap_opts *opt) {
  enum { OPT_DEVICE = TOOL_OPT_LONG, OPT_TRACE, OPT_JSON, OPT_CHUNKS, OPT_CHUNK_BYTES, OPT_REPS };
  static const struct option opts[] = {
      {"device", required_argument, NULL, OPT_DEVICE},
      {"trace", required_argument, NULL, OPT_TRACE},
      {"json", no_argument, NULL, OPT_JSON},
      {"chunks", required_argument, NULL, OPT_CHUNKS},
      {"chunk-bytes", required_argument, NULL, OPT_CHUNK_BYTES},
      {"reps", required_argument, NULL, OPT_REPS},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  const char *v;
  int c, bad = 0;
  *opt = (overlap_opts){NULL, NULL, 0, 32, 5, (size_t)4 << 20};
  while (!bad && (c = tool_getopt(cmd, argc, argv, opts, &v)) != -1) {
    switch (c) {
      case 'h': fputs(overlap_help, stdout); return 1;
      case OPT_DEVICE: opt->device = v; break;
      case OPT_TRACE: opt->trace = v; break;
      case OPT_JSON: opt->json = 1; break;
      case OPT_CHUNKS: bad = tool_parse_count(cmd, "--chunks", v, 1L << 20, &opt->chunks); break;
      case OPT_CHUNK_BYTES:
        bad = tool_parse_size(cmd, "--chunk-bytes", v, &opt->chunk_bytes);
        break;
      case OPT_REPS: bad = tool_parse_count(cmd, "--reps", v, 1000, &opt->reps); break;
      default: bad = -1; break; /* reported */
    }
  }
  if (bad)
    return -1;
  if (opt->chunk_bytes % sizeof(float) != 0) {
    tool_usage_error(cmd, "--chunk-bytes must be a multiple of %zu (the chunks hold floats)",
                     sizeof(float));
    return -1;
  }
  if (opt->chunk_bytes > SIZE_MAX / (size_t)opt->chunks) {
    tool_usage_error(cmd, "--chunks x --chunk-bytes is too large");
    return -1;
  }
  return 0;
}

/* Checks the device can run the compute, makes the queues and memory. */
static int setup(overlap *o, tdm_device *dev) {
  int rc;
  size_t total = o->opt.chunk_bytes * (size_t)o->opt.chunks, nc = (size_t)o->opt.chunks;
  TRY("tdm_device_info_get", tdm_device_info_get(dev, &o->info));
  TRY("tdm_queue_create (copy queue)", tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &o->copyq));
  TRY("tdm_queue_create (compute queue)", tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &o->compq));
  if (!(o->info.caps & TDM_DEVICE_CAP_HOST_MEMORY) &&
      (rc = odev_open(dev, o->compq, LANES, o->opt.chunks, &o->dev)) < 0) {
    fprintf(stderr,
            "tandem: bench overlap on %s: the host cannot read this device's memory, and the\n"
            "tool has a kernel of its own only for OpenCL devices (%s). Use --device cpu:0, or\n"
            "bench-cuda's overlap benchmark for CUDA devices.\n",
            o->info.id, tdm_err_name(rc));
    return rc;
  }
  TRY("tdm_malloc of pinned host memory",
      tdm_malloc(dev, TDM_MEM_PINNED, total, (void **)&o->host));
  TRY("tdm_malloc of device memory", tdm_malloc(dev, TDM_MEM_DEVICE, total, (void **)&o->slots));
  o->n = o->opt.chunk_bytes / sizeof(float);
  o->tasks = calloc(nc, sizeof *o->tasks);
  o->copy_ev = calloc(nc, sizeof *o->copy_ev);
  o->comp_ev = calloc(nc, sizeof *o->comp_ev);
  o->results = calloc(nc * 3 * (size_t)o->opt.reps, sizeof *o->results);
  o->scratch = calloc(nc, sizeof *o->scratch);
  if (!o->tasks || !o->copy_ev || !o->comp_ev || !o->results || !o->scratch) {
    fprintf(stderr, "tandem: bench overlap: out of host memory\n");
    return TDM_ENOMEM;
  }
  fill_random(o->host, o->n * nc);
out:
  return rc;
}

static void teardown(overlap *o) {
  /* Destroying a queue drains it, so the memory is idle before it is freed. */
  if (o->dev) {
    tdm_queue_sync(o->compq);
    odev_close(o->dev);
  }
  if (o->compq)
    tdm_queue_destroy(o->compq);
  if (o->copyq)
    tdm_queue_destroy(o->copyq);
  if (o->slots)
    tdm_free(o->slots);
  if (o->host)
    tdm_free(o->host);
  free(o->tasks);
  free(o->copy_ev);
  free(o->comp_ev);
  free(o->results);
  free(o->scratch);
}

static int measure(overlap *o, figures *f) {
  size_t r = (size_t)o->opt.reps;
  double *buf = calloc(4 * r, sizeof *buf);
  timings t = {.copy = buf, .compute = buf + r, .serialized = buf + 2 * r,
               .overlapped = buf + 3 * r};
  int rc = -1;
  if (!buf) {
    fprintf(stderr, "tandem: bench overlap: out of host memory\n");
    return -1;
  }
  if (calibrate(o) < 0)
    goto out;
  for (long i = 0; i < o->opt.reps; i++)
    if (run_rep(o, i, &t) < 0)
      goto out;
  compute_figures(o, &t, f);
  f->checked = 3 * o->opt.reps * o->opt.chunks;
  f->mismatches = check_results(o);
  rc = 0;
out:
  free(buf);
  return rc;
}

int tool_cmd_overlap(int argc, char **argv) {
  overlap o = {0};
  figures f = {0};
  tdm_device *dev;
  int rc = parse_options(argc, argv, &o.opt);
  if (rc != 0)
    return rc > 0 ? TOOL_OK : TOOL_USAGE;
  /* The trace is an option of the runtime, read at its first init. */
  if ((rc = tool_trace_check(o.opt.trace)) != TOOL_OK)
    return rc;
  if ((rc = tdm_init()) < 0)
    return tool_fail("tdm_init", rc);
  int code = tool_find_device(cmd, o.opt.device, &dev);
  if (code == TOOL_OK) {
    code = TOOL_FAILED;
    if (setup(&o, dev) == 0 && measure(&o, &f) == 0) {
      code = f.mismatches ? TOOL_FAILED : TOOL_OK;
      if (!o.opt.json) {
        report_human(&o, &f);
      } else if (report_json(&o, &f) < 0) {
        fprintf(stderr, "tandem: writing the JSON to stdout failed\n");
        code = TOOL_FAILED;
      }
    }
  }
  teardown(&o);
  tdm_shutdown();
  return code;
}
