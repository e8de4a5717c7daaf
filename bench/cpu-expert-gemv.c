/* cpu-expert-gemv.c: the CPU MoE expert op for a few tokens (decode), its direct bf16 path
 * against the convert + sgemm path it replaced, and both against this machine's read bandwidth.
 *
 * Shape: one Qwen3-30B-A3B expert (H = 2048, I = 768; 9.4 MB of bf16 weights). Enough distinct
 * expert blobs that together they are several times the last-level cache, each used once per
 * pass, so every pass reads its weights from memory as decode does. For n = 1, 2, 4, 8 tokens:
 *   new   the CPU table's expert op (tdm_moe_ops_for), all blobs queued on one cpu:0 queue;
 *   old   the previous implementation on this thread: widen the whole blob to f32, sgemm for
 *         [gate | up], silu * up, sgemm for down (as moe/cpu/ops.c did before);
 *   read  a vectorizable sum over the same blobs: what one thread can read from memory, and
 *         what 1, 2, 4, ... threads up to the cores can (each its contiguous share of the
 *         blobs), so the op's rate can be set against the memory's with the pool's threads
 *         (TANDEM_MOE_CPU_THREADS sets the pool's size; all cores by default).
 * Times are medians of interleaved passes, per expert. It reports figures and never fails on
 * them. Results: bench/results/cpu-expert-gemv.json (or the path given); a second argument
 * sets the GiB of expert blobs (1.5 by default: more than this machine's 480 MiB L3).
 * Last, the block formats (expert_q, experts_q: bf16, Q8_0, Q4_K with Q6_K down rows as Q4_K_M
 * files have them, Q4_K, Q6_K, MXFP4) on the same memory, each against the read bandwidth of
 * all the cores; a third argument `formats` runs the read bandwidth and that part alone.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tandem.h>
#include <tandem/moe_ops.h>

#include <cblas.h>
#undef I /* <complex.h>'s, from cblas.h */

#include "json.h"
#include "measure.h"

#ifndef TANDEM_GIT_COMMIT
#define TANDEM_GIT_COMMIT "unknown"
#endif

enum { H = 2048, I = 768, MAX_N = 8, REPS = 5 };
static const int NS[] = {1, 2, 4, 8};

typedef struct bench {
  tdm_device *dev;
  tdm_queue *q;
  const tdm_moe_ops *ops;
  void *st;
  size_t blobs;     /* distinct experts */
  tdm_moe_bf16 *w;  /* blobs x 3HI */
  float *x;         /* MAX_N x H, tokens */
  int32_t *rows, *slot;
  float *out_new, *out_old; /* MAX_N x H */
  void *ws;         /* the op's workspace for MAX_N */
  size_t ws_bytes;
  float *wf, *gu;   /* the old path's f32 weights (3HI) and gate|up (MAX_N x 2I) */
  int n;
  int G;                    /* the grouped rows: experts a call */
  int32_t *zrows;           /* MAX_N zeros: every entry's token is x's first row */
  tdm_moe_group *groups;    /* blobs entries: blob e, first e % G, one token */
  volatile uint64_t sink;
} bench;

static size_t blob_len(void) { return 3 * (size_t)H * I; }

/* The op over every blob, then one sync. */
static int run_new(bench *b, double *seconds) {
  double t0 = bu_seconds();
  for (size_t e = 0; e < b->blobs; e++)
    if (b->ops->expert(b->st, b->q, b->x, b->rows, b->slot, b->n, b->w + e * blob_len(), H, I,
                       b->out_new, b->ws, b->ws_bytes) != 0)
      return -1;
  if (tdm_queue_sync(b->q) != 0) return -1;
  *seconds = bu_seconds() - t0;
  return 0;
}

/* The previous expert body, for one blob (the tokens' rows are already contiguous). */
static void old_expert(bench *b, const tdm_moe_bf16 *w) {
  const size_t hi = (size_t)H * I;
  for (size_t i = 0; i < 3 * hi; i++) b->wf[i] = tdm_moe_bf16_to_f32(w[i]);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b->n, 2 * I, H, 1.0f, b->x, H, b->wf, H,
              0.0f, b->gu, 2 * I);
  for (int t = 0; t < b->n; t++) {
    float *g = b->gu + (size_t)t * 2 * I;
    const float *u = g + I;
    for (int j = 0; j < I; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b->n, H, I, 1.0f, b->gu, 2 * I,
              b->wf + 2 * hi, I, 0.0f, b->out_old, H);
}

static int run_old(bench *b, double *seconds) {
  double t0 = bu_seconds();
  for (size_t e = 0; e < b->blobs; e++) old_expert(b, b->w + e * blob_len());
  *seconds = bu_seconds() - t0;
  return 0;
}

/* The read: each of n threads sums its contiguous share of the blobs as 64-bit words in 8
 * independent lanes (loads and adds, nothing else), optionally prefetching ahead; the time is
 * from a barrier all have passed to the last one's end. */
enum { MAX_READ_THREADS = 256 };
typedef struct reader {
  const uint64_t *p;
  size_t words, ahead; /* ahead: words prefetched in front of the sum (0: none) */
  pthread_barrier_t *start;
  double end;
  uint64_t sum;
} reader;

static void *reader_main(void *arg) {
  reader *r = arg;
  uint64_t acc[8] = {0};
  pthread_barrier_wait(r->start);
  for (size_t i = 0; i + 8 <= r->words; i += 8) {
    if (r->ahead && i + r->ahead < r->words) __builtin_prefetch(r->p + i + r->ahead, 0, 3);
    for (int l = 0; l < 8; l++) acc[l] += r->p[i + l];
  }
  r->end = bu_seconds();
  for (int l = 0; l < 8; l++) r->sum += acc[l];
  return NULL;
}

static int run_read_threads(bench *b, int n, size_t ahead_bytes, double *seconds) {
  const uint64_t *p = (const uint64_t *)b->w;
  size_t words = b->blobs * blob_len() * sizeof *b->w / sizeof *p, share = words / (size_t)n;
  reader r[MAX_READ_THREADS];
  pthread_t th[MAX_READ_THREADS];
  pthread_barrier_t start;
  if (pthread_barrier_init(&start, NULL, (unsigned)n + 1) != 0) return -1;
  int started = 0;
  for (; started < n; started++) {
    r[started] = (reader){.p = p + (size_t)started * share, .words = share,
                          .ahead = ahead_bytes / sizeof *p, .start = &start};
    if (pthread_create(&th[started], NULL, reader_main, &r[started]) != 0) break;
  }
  if (started < n) { /* the barrier cannot be passed now: nothing was measured */
    fprintf(stderr, "bench-cpu-expert-gemv: could not start %d reader threads\n", n);
    exit(1);
  }
  pthread_barrier_wait(&start);
  double t0 = bu_seconds(), end = t0;
  uint64_t s = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    if (r[i].end > end) end = r[i].end;
    s += r[i].sum;
  }
  pthread_barrier_destroy(&start);
  b->sink = s;
  *seconds = end - t0;
  return 0;
}

/* Bytes per second of the read with n threads, `ahead` bytes of prefetch: one warm-up pass,
 * then the median of REPS. */
static double read_rate(bench *b, int n, size_t ahead) {
  double t[REPS], warm;
  run_read_threads(b, n, ahead, &warm);
  for (int r = 0; r < REPS; r++) run_read_threads(b, n, ahead, &t[r]);
  return (double)(b->blobs * blob_len() * sizeof *b->w) / bu_median(t, REPS);
}

/* One token through every blob, G blobs a call: experts() with a table of G entries, each
 * writing its own slot, or (single) expert() per blob into the same slots. The last call's
 * outputs are in out_new (grouped) and out_old (single). */
static int run_grouped(bench *b, int single, double *seconds) {
  int G = b->G, rc = 0;
  double t0 = bu_seconds();
  for (size_t e = 0; !rc && e + (size_t)G <= b->blobs; e += (size_t)G) {
    if (!single) {
      rc = b->ops->experts(b->st, b->q, b->x, b->zrows, b->slot, G, b->w, b->groups + e, G, H, I,
                           b->out_new, b->ws, b->ws_bytes);
      continue;
    }
    for (int i = 0; !rc && i < G; i++)
      rc = b->ops->expert(b->st, b->q, b->x, b->zrows, b->slot + i, 1,
                          b->w + (e + (size_t)i) * blob_len(), H, I, b->out_old, b->ws,
                          b->ws_bytes);
  }
  if (rc || tdm_queue_sync(b->q) != 0) return -1;
  *seconds = bu_seconds() - t0;
  return 0;
}

static int side_grouped(void *arg, int baseline, double *seconds) {
  return run_grouped(arg, baseline, seconds);
}

static int side(void *arg, int baseline, double *seconds) {
  bench *b = arg;
  return baseline ? run_old(b, seconds) : run_new(b, seconds);
}

static float rnd(uint64_t *s, float scale) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  float mag = 0.1f + 0.9f * (float)(*s >> 40) / (float)(1u << 24);
  return (*s >> 33 & 1 ? -mag : mag) * scale;
}

/* ---- Experts in their file's block formats (expert_q / experts_q), on the same memory ----
 * The bf16 blobs' bytes, refilled with random blocks of one format at a time: random bytes,
 * then each block's scale fields set to a small finite value, so no value is a NaN or a
 * subnormal. GB/s count the blocks' own bytes (what a host expert reads from memory). */
typedef struct qformat {
  const char *name;
  tdm_moe_wfmt fmt;
} qformat;

static const qformat QFORMATS[] = {
    {"bf16", {TDM_MOE_W_BF16, TDM_MOE_W_BF16}}, {"q8_0", {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0}},
    {"q4_k+q6_k", {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}}, {"q4_k", {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K}},
    {"q6_k", {TDM_MOE_W_Q6_K, TDM_MOE_W_Q6_K}}, {"mxfp4", {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4}}};

/* Sets the scale fields of the blocks of a row of `bytes` bytes of type t. */
static void fix_scales(uint8_t *p, size_t bytes, int t) {
  static const uint8_t f16_small[2] = {0x00, 0x14}; /* 2^-10 */
  size_t bb = tdm_moe_row_bytes(t, t == TDM_MOE_W_Q8_0 || t == TDM_MOE_W_MXFP4 ? 32 : 256);
  for (size_t o = 0; t != TDM_MOE_W_BF16 && o + bb <= bytes; o += bb) {
    uint8_t *blk = p + o;
    if (t == TDM_MOE_W_Q8_0) memcpy(blk, f16_small, 2);
    if (t == TDM_MOE_W_Q4_K) memcpy(blk, f16_small, 2), memcpy(blk + 2, f16_small, 2);
    if (t == TDM_MOE_W_Q6_K) memcpy(blk + bb - 2, f16_small, 2);
    if (t == TDM_MOE_W_MXFP4) blk[0] = 120; /* 2^-7 */
  }
}

static void fill_quant(uint8_t *w, size_t blobs, size_t stride, tdm_moe_wfmt f, uint64_t *seed) {
  size_t gu_rb = tdm_moe_row_bytes(f.gu, H), d_rb = tdm_moe_row_bytes(f.d, I);
  for (size_t e = 0; e < blobs; e++) {
    uint8_t *p = w + e * stride;
    for (size_t i = 0; i < stride; i += 8) {
      *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t v = *seed >> 1 & 0x3f7f3f7f3f7f3f7full; /* bf16 and f16 pairs stay finite */
      memcpy(p + i, &v, stride - i < 8 ? stride - i : 8);
    }
    for (size_t r = 0; r < 2 * (size_t)I; r++) fix_scales(p + r * gu_rb, gu_rb, f.gu);
    for (size_t r = 0; r < (size_t)H; r++) fix_scales(p + 2 * I * gu_rb + r * d_rb, d_rb, f.d);
  }
}

/* n tokens through every blob (expert_q per blob), or one token through G blobs a call
 * (experts_q); one sync at the end. */
static int run_quant(bench *b, const uint8_t *w, size_t blobs, size_t stride, tdm_moe_wfmt f,
                     int G, double *seconds) {
  int rc = 0;
  double t0 = bu_seconds();
  if (G == 0)
    for (size_t e = 0; !rc && e < blobs; e++)
      rc = b->ops->expert_q(b->st, b->q, b->x, b->rows, b->slot, b->n, w + e * stride, f, H, I,
                            b->out_new, b->ws, b->ws_bytes);
  for (size_t e = 0; G && !rc && e + (size_t)G <= blobs; e += (size_t)G)
    rc = b->ops->experts_q(b->st, b->q, b->x, b->zrows, b->slot, G, w, f, b->groups + e, G, H,
                           I, b->out_new, b->ws, b->ws_bytes);
  if (rc || tdm_queue_sync(b->q) != 0) return -1;
  *seconds = bu_seconds() - t0;
  return 0;
}

/* Seconds per expert: one warm-up pass, then the median of REPS. */
static int quant_rate(bench *b, const uint8_t *w, size_t blobs, size_t stride, tdm_moe_wfmt f,
                      int G, double *per_expert) {
  double t[REPS], warm;
  if (run_quant(b, w, blobs, stride, f, G, &warm) != 0) return -1;
  for (int r = 0; r < REPS; r++)
    if (run_quant(b, w, blobs, stride, f, G, &t[r]) != 0) return -1;
  size_t done = G ? blobs / (size_t)G * (size_t)G : blobs;
  *per_expert = bu_median(t, REPS) / (double)done;
  return 0;
}

#define TRY(what, call)                                                                       \
  do {                                                                                        \
    if ((call) != 0) {                                                                        \
      fprintf(stderr, "bench-cpu-expert-gemv: %s: %s\n", what, tdm_last_error());            \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "bench/results/cpu-expert-gemv.json";
  double gib = argc > 2 ? atof(argv[2]) : 1.5;
  bool formats_only = argc > 3 && strcmp(argv[3], "formats") == 0;
  if (argc > 4 || (argc > 3 && !formats_only) || !(gib > 0.0)) {
    fprintf(stderr, "usage: bench-cpu-expert-gemv [RESULT.json] [GiB of experts, default 1.5] "
                    "[formats]\n");
    return 2;
  }
  bench b = {0};
  TRY("tdm_init", tdm_init());
  TRY("tdm_device_find", tdm_device_find("cpu:0", &b.dev));
  b.ops = tdm_moe_ops_for(b.dev);
  if (!b.ops) {
    fprintf(stderr, "bench-cpu-expert-gemv: no CPU MoE operations: %s\n", tdm_last_error());
    return 1;
  }
  TRY("tdm_queue_create", tdm_queue_create(b.dev, TDM_QUEUE_IN_ORDER, &b.q));
  TRY("open", b.ops->open(b.q, &b.st));

  b.blobs = (size_t)(gib * (1u << 30) / (blob_len() * sizeof *b.w));
  if (b.blobs < 1) b.blobs = 1;
  size_t hi = (size_t)H * I;
  b.ws_bytes = tdm_moe_ops_workspace(MAX_N, H, I);
  TRY("tdm_malloc", tdm_malloc(b.dev, TDM_MEM_DEVICE, b.blobs * blob_len() * sizeof *b.w,
                               (void **)&b.w));
  TRY("tdm_malloc", tdm_malloc(b.dev, TDM_MEM_DEVICE, b.ws_bytes, &b.ws));
  b.x = malloc(MAX_N * H * sizeof *b.x);
  b.rows = malloc(MAX_N * sizeof *b.rows);
  b.slot = malloc(MAX_N * sizeof *b.slot);
  b.out_new = malloc(MAX_N * H * sizeof *b.out_new);
  b.out_old = malloc(MAX_N * H * sizeof *b.out_old);
  b.wf = malloc(3 * hi * sizeof *b.wf);
  b.gu = malloc(MAX_N * 2 * I * sizeof *b.gu);
  b.zrows = calloc(MAX_N, sizeof *b.zrows);
  b.groups = malloc(b.blobs * sizeof *b.groups);
  if (!b.x || !b.rows || !b.slot || !b.out_new || !b.out_old || !b.wf || !b.gu || !b.zrows ||
      !b.groups) {
    fprintf(stderr, "bench-cpu-expert-gemv: out of memory\n");
    return 1;
  }
  /* Weights scaled as a trained model's roughly are, so gate and up stay of order one. */
  uint64_t seed = 12345;
  for (size_t i = 0; i < b.blobs * blob_len(); i++) {
    size_t at = i % blob_len();
    float s = at < 2 * hi ? 2.0f / 45.25f : 2.0f / 27.71f; /* 2/sqrt(H), 2/sqrt(I) */
    b.w[i] = tdm_moe_f32_to_bf16(rnd(&seed, s));
  }
  for (size_t i = 0; i < (size_t)MAX_N * H; i++) b.x[i] = rnd(&seed, 1.0f);
  for (int t = 0; t < MAX_N; t++) b.rows[t] = b.slot[t] = t;

  bu_machine m;
  bu_machine_get(&m);
  char command[512];
  bu_join_argv(argc, argv, command, sizeof command);
  const char *blas_threads = getenv("OPENBLAS_NUM_THREADS");
  double blob_mb = blob_len() * sizeof *b.w / 1e6;
  printf("bench-cpu-expert-gemv: H=%d I=%d, %zu experts of %.2f MB (%.2f GiB), %d passes; "
         "OPENBLAS_NUM_THREADS=%s\n",
         H, I, b.blobs, blob_mb, b.blobs * blob_mb * 1e6 / (1u << 30), REPS,
         blas_threads ? blas_threads : "(unset)");

  /* Read bandwidth with 1, 2, 4, ... threads, and the cores: what one thread reads (the op's
   * figures are set against it), and the memory's rate with many readers. */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores < 1) cores = 1;
  if (cores > MAX_READ_THREADS) cores = MAX_READ_THREADS;
  int nthr[16], nt = 0;
  for (int t = 1; t < cores && nt < 15; t *= 2) nthr[nt++] = t;
  if (cores >= 12 && nt < 15 && nthr[nt - 1] < 12) nthr[nt++] = 12; /* the model's pool on 16 */
  nthr[nt++] = (int)cores;
  double thr_bw[16];
  printf("  read bandwidth (8-lane sum) with threads:");
  for (int i = 0; i < nt; i++) {
    thr_bw[i] = read_rate(&b, nthr[i], 0);
    printf(" %d: %.1f GB/s%s", nthr[i], thr_bw[i] / 1e9, i + 1 < nt ? "," : "\n");
  }
  double read_bw = thr_bw[0]; /* one thread */
  /* And with a software prefetch this far in front of each thread's sum: whether a thread's
   * rate is bound by the lines it has in flight (then prefetching further helps) or the
   * memory's by all of them. */
  enum { NPF = 4 };
  static const int pf_kb[NPF] = {1, 4, 16, 64};
  int pf_thr[3] = {1, nthr[nt - 1] >= 12 ? 12 : nthr[nt - 1], nthr[nt - 1]};
  double pf_bw[3][NPF];
  for (int i = 0; i < 3; i++) {
    if (formats_only) { /* not measured: zeros in the JSON */
      for (int k = 0; k < NPF; k++) pf_bw[i][k] = 0.0;
      continue;
    }
    printf("  read bandwidth, %d threads, prefetching:", pf_thr[i]);
    for (int k = 0; k < NPF; k++) {
      pf_bw[i][k] = read_rate(&b, pf_thr[i], (size_t)pf_kb[k] * 1024);
      printf(" %d KiB ahead: %.1f GB/s%s", pf_kb[k], pf_bw[i][k] / 1e9, k + 1 < NPF ? "," : "\n");
    }
  }
  const char *pf_env = getenv("TANDEM_MOE_CPU_PREFETCH_KB");
  printf("  the op prefetches TANDEM_MOE_CPU_PREFETCH_KB=%s\n\n", pf_env ? pf_env : "(unset)");
  if (!formats_only)
    printf("  %2s %12s %12s %8s %12s %10s %10s\n", "n", "new us/exp", "old us/exp", "old/new",
           "new GB/s", "of read", "rel diff");

  bu_json j;
  if (!bu_json_begin(&j, "bench-cpu-expert-gemv", path, command, TANDEM_GIT_COMMIT,
                     tdm_version_string(), &m))
    return 1;
  bu_json_int(&j, "H", H);
  bu_json_int(&j, "I", I);
  bu_json_int(&j, "experts", (long long)b.blobs);
  bu_json_double(&j, "expert_mb", blob_mb, 4);
  bu_json_int(&j, "passes", REPS);
  bu_json_string(&j, "openblas_num_threads", blas_threads ? blas_threads : "unset");
  bu_json_double(&j, "read_gb_per_s", read_bw / 1e9, 3);
  const char *pool_threads = getenv("TANDEM_MOE_CPU_THREADS");
  bu_json_string(&j, "moe_cpu_threads", pool_threads ? pool_threads : "unset");
  bu_json_string(&j, "moe_cpu_prefetch_kb", pf_env ? pf_env : "unset");
  bu_json_array(&j, "read_prefetch");
  for (int i = 0; i < 3; i++)
    for (int k = 0; k < NPF; k++) {
      bu_json_object(&j, NULL);
      bu_json_int(&j, "threads", pf_thr[i]);
      bu_json_int(&j, "prefetch_kb", pf_kb[k]);
      bu_json_double(&j, "read_gb_per_s", pf_bw[i][k] / 1e9, 3);
      bu_json_end(&j);
    }
  bu_json_end(&j);
  bu_json_array(&j, "read_threads");
  for (int i = 0; i < nt; i++) {
    bu_json_object(&j, NULL);
    bu_json_int(&j, "threads", nthr[i]);
    bu_json_double(&j, "read_gb_per_s", thr_bw[i] / 1e9, 3);
    bu_json_end(&j);
  }
  bu_json_end(&j);
  bu_json_array(&j, "rows");
  for (size_t k = 0; !formats_only && k < sizeof NS / sizeof NS[0]; k++) {
    b.n = NS[k];
    double tn, to;
    if (bu_interleaved(&b, side, NULL, REPS, &tn, &to) != 0) {
      fprintf(stderr, "bench-cpu-expert-gemv: n=%d failed: %s\n", b.n, tdm_last_error());
      return 1;
    }
    tn /= (double)b.blobs;
    to /= (double)b.blobs;
    /* Both outputs are of the last blob: the paths agree to f32 rounding. */
    double d2 = 0, r2 = 0;
    for (size_t i = 0; i < (size_t)b.n * H; i++) {
      double d = (double)b.out_new[i] - b.out_old[i];
      d2 += d * d;
      r2 += (double)b.out_old[i] * b.out_old[i];
    }
    double rel = r2 > 0 ? sqrt(d2 / r2) : 0.0, new_bw = blob_mb * 1e6 / tn;
    printf("  %2d %12.1f %12.1f %8.2f %12.2f %10.2f %10.1e\n", b.n, tn * 1e6, to * 1e6, to / tn,
           new_bw / 1e9, new_bw / read_bw, rel);
    bu_json_object(&j, NULL);
    bu_json_int(&j, "n", b.n);
    bu_json_double(&j, "new_us_per_expert", tn * 1e6, 2);
    bu_json_double(&j, "old_us_per_expert", to * 1e6, 2);
    bu_json_double(&j, "old_over_new", to / tn, 3);
    bu_json_double(&j, "new_weight_gb_per_s", new_bw / 1e9, 3);
    bu_json_double(&j, "new_over_read_bandwidth", new_bw / read_bw, 3);
    bu_json_double(&j, "relative_difference", rel, -3);
    bu_json_end(&j);
  }
  bu_json_end(&j);
  /* One token, G experts a call: experts(), whose passes cover all G at once (the pool joins
   * twice a call), against expert() per expert (twice an expert); outputs bitwise equal. */
  if (!formats_only)
    printf("\n  %2s %14s %14s %10s %12s %8s\n", "G", "grouped us/exp", "single us/exp",
           "single/grp", "grouped GB/s", "equal");
  bu_json_array(&j, "grouped");
  static const int GS[] = {2, 4, 8};
  for (size_t k = 0; !formats_only && k < sizeof GS / sizeof GS[0] && (size_t)GS[k] <= b.blobs;
       k++) {
    b.G = GS[k];
    for (size_t e = 0; e < b.blobs; e++)
      b.groups[e] = (tdm_moe_group){.w = (int64_t)(e * blob_len()), .first = (int32_t)(e % b.G),
                                    .count = 1};
    double tg, ts;
    if (bu_interleaved(&b, side_grouped, NULL, REPS, &tg, &ts) != 0) {
      fprintf(stderr, "bench-cpu-expert-gemv: G=%d failed: %s\n", b.G, tdm_last_error());
      return 1;
    }
    size_t done = b.blobs / (size_t)b.G * (size_t)b.G;
    tg /= (double)done;
    ts /= (double)done;
    bool equal = memcmp(b.out_new, b.out_old, (size_t)b.G * H * sizeof *b.out_new) == 0;
    printf("  %2d %14.1f %14.1f %10.3f %12.2f %8s\n", b.G, tg * 1e6, ts * 1e6, ts / tg,
           blob_mb / 1e3 / tg, equal ? "yes" : "NO");
    bu_json_object(&j, NULL);
    bu_json_int(&j, "experts_per_call", b.G);
    bu_json_double(&j, "grouped_us_per_expert", tg * 1e6, 2);
    bu_json_double(&j, "single_us_per_expert", ts * 1e6, 2);
    bu_json_double(&j, "single_over_grouped", ts / tg, 3);
    bu_json_double(&j, "grouped_weight_gb_per_s", blob_mb / 1e3 / tg, 3);
    bu_json_bool(&j, "bitwise_equal", equal);
    bu_json_end(&j);
  }
  bu_json_end(&j);
  /* The block formats: one token (expert_q), 4 tokens, and 8 experts of one token a call
   * (experts_q), each set against the read bandwidth of all the cores (the pool's). */
  if (b.ops->expert_q && b.ops->experts_q) {
    double all_bw = thr_bw[nt - 1], bf16_mb = blob_mb;
    size_t bytes = b.blobs * blob_len() * sizeof *b.w;
    printf("\n  block formats, against %.1f GB/s read by %d threads:\n", all_bw / 1e9,
           nthr[nt - 1]);
    printf("  %-10s %8s %10s %10s %10s %10s %10s %10s\n", "format", "MB/exp", "n=1 us",
           "n=4 us", "G=8 us", "n=1 GB/s", "of read", "bf16-eq");
    bu_json_array(&j, "formats");
    for (size_t k = 0; k < sizeof QFORMATS / sizeof QFORMATS[0]; k++) {
      const qformat *qf = &QFORMATS[k];
      size_t stride = (tdm_moe_expert_size(qf->fmt, H, I) + 15) / 16 * 16;
      size_t blobs = bytes / stride;
      fill_quant((uint8_t *)b.w, blobs, stride, qf->fmt, &seed);
      tdm_moe_group *g = realloc(b.groups, blobs * sizeof *g);
      if (!g) {
        fprintf(stderr, "bench-cpu-expert-gemv: out of memory\n");
        return 1;
      }
      b.groups = g;
      for (size_t e = 0; e < blobs; e++)
        b.groups[e] = (tdm_moe_group){.w = (int64_t)(e * stride / 2), .first = (int32_t)(e % 8),
                                      .count = 1};
      double t1, t4, tg;
      b.n = 1;
      int rc = quant_rate(&b, (const uint8_t *)b.w, blobs, stride, qf->fmt, 0, &t1);
      b.n = 4;
      rc = rc ? rc : quant_rate(&b, (const uint8_t *)b.w, blobs, stride, qf->fmt, 0, &t4);
      b.n = 1;
      rc = rc ? rc : quant_rate(&b, (const uint8_t *)b.w, blobs, stride, qf->fmt, 8, &tg);
      if (rc) {
        fprintf(stderr, "bench-cpu-expert-gemv: %s failed: %s\n", qf->name, tdm_last_error());
        return 1;
      }
      double mb = stride / 1e6, gbs = mb / 1e3 / t1;
      printf("  %-10s %8.2f %10.1f %10.1f %10.1f %10.2f %10.2f %10.2f\n", qf->name, mb, t1 * 1e6,
             t4 * 1e6, tg * 1e6, gbs, gbs * 1e9 / all_bw, bf16_mb / 1e3 / t1);
      bu_json_object(&j, NULL);
      bu_json_string(&j, "format", qf->name);
      bu_json_double(&j, "expert_mb", mb, 4);
      bu_json_double(&j, "us_per_expert_n1", t1 * 1e6, 2);
      bu_json_double(&j, "us_per_expert_n4", t4 * 1e6, 2);
      bu_json_double(&j, "us_per_expert_grouped8", tg * 1e6, 2);
      bu_json_double(&j, "block_gb_per_s_n1", gbs, 3);
      bu_json_double(&j, "block_over_read_all_threads", gbs * 1e9 / all_bw, 3);
      bu_json_double(&j, "bf16_equivalent_gb_per_s_n1", bf16_mb / 1e3 / t1, 3);
      bu_json_end(&j);
    }
    bu_json_end(&j);
  }
  if (bu_json_close(&j, "bench-cpu-expert-gemv", path) != 0) return 1;
  printf("\n  wrote %s\n", path);

  b.ops->close(b.st);
  TRY("tdm_queue_destroy", tdm_queue_destroy(b.q));
  tdm_free(b.w);
  tdm_free(b.ws);
  free(b.x); free(b.rows); free(b.slot); free(b.out_new); free(b.out_old); free(b.wf);
  free(b.gu); free(b.zrows); free(b.groups);
  tdm_shutdown();
  return 0;
}
