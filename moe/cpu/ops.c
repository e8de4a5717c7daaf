/* cpu/ops.c: the MoE operations for the CPU backend (tdm_moe__cpu_ops).
 *
 * On the CPU backend device memory is host memory, so each op is a host task that runs on the
 * queue's worker thread in stream order. The call checks what it can see at once (sizes,
 * pointers, the workspace size), copies its arguments into a heap block and returns; the task
 * reads device memory (indices, activations) only when it runs, since earlier commands on the
 * queue may still be writing it.
 *
 * Argument blocks are freed by a keep-alive on the same queue, not by the task itself: a task
 * whose predecessor failed completes with TDM_EDEP without running, and could not free its
 * block. Argument errors return TDM_EINVAL at once, with a message; a failure inside a task
 * (an index out of range, no memory for scratch) becomes the task's status.
 *
 * GEMMs are OpenBLAS sgemm in f32 on weights converted from bf16 (exactly) into the workspace;
 * OpenBLAS 0.3.21 has no bf16 GEMM. On determinism: we leave OpenBLAS's own threading as the
 * program configured it (calling openblas_set_num_threads() would change process-wide state
 * that belongs to the program). Its threaded sgemm (driver/level3/level3_thread.c) splits only
 * the M and N dimensions between threads; every thread runs the whole K reduction in the same
 * blocked order, and the split is a pure function of (M, N, K, thread count). Concurrent
 * callers (two tandem queues) wait for free threads rather than getting fewer. So for fixed
 * shapes, CPU and OPENBLAS_NUM_THREADS the output is bitwise repeatable; the `deterministic`
 * case of tests/test-moe-ops.c checks it at shapes large enough to be threaded, with two
 * queues running experts at once. A token's result may still depend on n (which tile it falls
 * in), so comparisons must use the same per-expert batches.
 *
 * An expert with few tokens (n <= GEMV_MAX_N, decode) skips the conversion and the GEMMs: each
 * bf16 weight row is widened once into a small f32 buffer and dotted with every token's row
 * (expert_gemv), so the weights are read once instead of being written out and read back as f32
 * twice their size. Its dot products run in a fixed lane order that does not depend on n or on
 * the thread count, so a token's result there is the same whatever else is in its batch.
 *
 * experts() is one host task that checks its whole table (entries, weight ranges, rows,
 * slots) and then computes each entry exactly as expert() computes that expert on those
 * tokens, so the two agree bitwise and an entry's bits never depend on the rest of the table.
 * group() is one host task doing a counting sort of the routing by expert.
 *
 * Every other reduction (rmsnorm, softmax, top-k, combine) is a plain loop in a fixed order.
 */
#include "ops.h" /* moe/ops.h */
#include "pool.h"
#include "qdot.h"
#include "quant.h" /* moe/quant.h */
#include "task.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* OpenBLAS's cblas.h pulls in <complex.h>, whose macro I would rewrite every "I" (the expert's
 * intermediate size) after it; C11 7.3.1 lets a program undefine it. ops.h comes first for the
 * same reason. */
#include <cblas.h>
#undef I

static void bf16_to_f32(float *dst, const tdm_moe_bf16 *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_bf16_to_f32(src[i]);
}

/* ---- open / close ------------------------------------------------------------------------ */

static int cpu_open(tdm_queue *q, void **state) {
  tdm_device *dev;
  tdm_device_info info;
  unsigned flags;
  int rc;
  if (!q || !state) return tdm_set_error(TDM_EINVAL, 0, "moe open: NULL argument");
  if ((rc = tdm_queue_device(q, &dev)) || (rc = tdm_device_info_get(dev, &info)) ||
      (rc = tdm_queue_flags(q, &flags)))
    return rc;
  /* The tasks dereference device pointers, which only host-memory devices allow. */
  if (!(info.caps & TDM_DEVICE_CAP_HOST_MEMORY))
    return tdm_set_error(TDM_ENOTSUP, 0, "moe open: %s is not a host-memory (CPU) device", info.id);
  /* Ops take no dependency lists: on an out-of-order queue they would not be ordered. */
  if (flags & TDM_QUEUE_OUT_OF_ORDER)
    return tdm_set_error(TDM_EINVAL, 0, "moe open: the ops need an in-order queue");
  cpu_state *s = tdm_moe__task_alloc(sizeof *s, "open");
  if (!s) return TDM_ENOMEM;
  s->q = q;
  *state = s;
  pool_acquire(pool_default_size(0));
  return 0;
}

/* Waits for the queue's work (a marker, whose status is ignored: the queue keeps its first
 * error for whoever syncs it), so that no op of this state still runs on the pool. */
static void cpu_close(void *state) {
  cpu_state *s = state;
  tdm_event *done;
  if (tdm_event_record(s->q, &done) == 0) {
    (void)tdm_event_wait(done);
    (void)tdm_event_release(done);
  }
  pool_release();
  free(s);
}

/* ---- rmsnorm ----------------------------------------------------------------------------- */

typedef struct rmsnorm_args {
  task t; /* first */
  float *y;
  const float *x, *w;
  int T, H;
  float eps;
} rmsnorm_args;

void tdm_moe__cpu_rmsnorm_row(float *y, const float *x, const float *w, int H, float eps) {
  double ss = 0.0; /* double: exact enough that H never matters, and still a fixed order */
  for (int h = 0; h < H; h++) ss += (double)x[h] * x[h];
  float scale = (float)(1.0 / sqrt(ss / H + eps));
  for (int h = 0; h < H; h++) y[h] = x[h] * scale * w[h];
}

static int rmsnorm_body(const task *t) {
  const rmsnorm_args *a = (const rmsnorm_args *)t;
  for (int r = 0; r < a->T; r++)
    tdm_moe__cpu_rmsnorm_row(a->y + (size_t)r * a->H, a->x + (size_t)r * a->H, a->w, a->H,
                             a->eps);
  return 0;
}

static int cpu_rmsnorm(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                       int H, float eps) {
  int rc = tdm_moe__check_state(st, q, "rmsnorm");
  if (rc) return rc;
  if (!y || !x || !w || T < 0 || H <= 0 || !(eps >= 0.0f)) return tdm_moe__bad_args("rmsnorm");
  if (T == 0) return 0;
  rmsnorm_args *a = tdm_moe__task_alloc(sizeof *a, "rmsnorm");
  if (!a) return TDM_ENOMEM;
  *a = (rmsnorm_args){.t.body = rmsnorm_body, .y = y, .x = x, .w = w, .T = T, .H = H,
                      .eps = eps};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- router ------------------------------------------------------------------------------ */

typedef struct router_args {
  task t; /* first */
  const float *x;
  const tdm_moe_bf16 *wr;
  const float *bias; /* or NULL */
  int T, H, E, k, renorm;
  int32_t *idx;
  float *weights;
} router_args;

/* p[0..E) holds logits on entry, probabilities on return. */
static void softmax(float *p, int E) {
  float m = p[0], sum = 0.0f;
  for (int e = 1; e < E; e++)
    if (p[e] > m) m = p[e];
  for (int e = 0; e < E; e++) {
    p[e] = expf(p[e] - m);
    sum += p[e];
  }
  for (int e = 0; e < E; e++) p[e] /= sum;
}

static int chosen(const int32_t *idx, int j, int e) {
  for (int i = 0; i < j; i++)
    if (idx[i] == e) return 1;
  return 0;
}

/* The k largest of p, descending; strict '>' over ascending e keeps the lower index on ties. */
static void top_k(const float *p, int E, int k, int renorm, int32_t *idx, float *w) {
  float sum = 0.0f;
  for (int j = 0; j < k; j++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      if (chosen(idx, j, e)) continue;
      if (best < 0 || p[e] > p[best]) best = e;
    }
    idx[j] = best;
    w[j] = p[best];
    sum += p[best];
  }
  if (renorm)
    for (int j = 0; j < k; j++) w[j] /= sum;
}

static int router_body(const task *t) {
  const router_args *a = (const router_args *)t;
  /* Scratch is taken here, not at submission, so that layers queued ahead do not all hold it. */
  float *wr = tdm_moe__host_alloc((size_t)a->E * a->H * sizeof *wr);
  float *logits = tdm_moe__host_alloc((size_t)a->T * a->E * sizeof *logits);
  if (!wr || !logits) {
    free(wr);
    free(logits);
    return TDM_ENOMEM;
  }
  bf16_to_f32(wr, a->wr, (size_t)a->E * a->H);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->T, a->E, a->H, 1.0f, a->x, a->H, wr,
              a->H, 0.0f, logits, a->E);
  for (int r = 0; r < a->T; r++) {
    float *p = logits + (size_t)r * a->E;
    if (a->bias)
      for (int e = 0; e < a->E; e++) p[e] += a->bias[e];
    softmax(p, a->E);
    top_k(p, a->E, a->k, a->renorm, a->idx + (size_t)r * a->k, a->weights + (size_t)r * a->k);
  }
  free(wr);
  free(logits);
  return 0;
}

static int cpu_router(void *st, tdm_queue *q, const float *x, const tdm_moe_bf16 *wr,
                      const float *bias, int T, int H, int E, int k, int renorm, int32_t *idx,
                      float *weights) {
  int rc = tdm_moe__check_state(st, q, "router");
  if (rc) return rc;
  if (!x || !wr || !idx || !weights || T < 0 || H <= 0 || E <= 0 || k <= 0 || k > E)
    return tdm_moe__bad_args("router");
  if (T == 0) return 0;
  router_args *a = tdm_moe__task_alloc(sizeof *a, "router");
  if (!a) return TDM_ENOMEM;
  *a = (router_args){.t.body = router_body, .x = x, .wr = wr, .bias = bias, .T = T, .H = H,
                     .E = E, .k = k, .renorm = renorm != 0, .idx = idx, .weights = weights};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- expert: arguments ------------------------------------------------------------------- */

/* Workspace layout of the sgemm path, each region starting on a 256-byte boundary, all within
 * tdm_moe_ops_workspace(n, H, I): the expert's weights in f32 [Wg | Wu | Wd] (3HI), the gathered
 * rows (n x H, reused for the output rows), then gate|up side by side (n x 2I), h = silu(gate)
 * * up overwriting the gate half. */
static size_t round256(size_t b) { return (b + 255) / 256 * 256; }

typedef struct expert_args {
  task t; /* first */
  const float *x;
  const int32_t *rows, *slot;
  int n, H, I;
  const uint8_t *w;
  tdm_moe_wfmt fmt;
  float *out;
  float *ws;
  size_t x_rows, out_rows; /* bounds of x and out, from tdm_mem_query */
} expert_args;

/* ---- expert, few tokens: bf16 rows dotted directly ---------------------------------------- */

/* Tokens up to which the direct path beats convert + sgemm (bench/cpu-expert-gemv.c measures
 * both). Past it the GEMMs' reuse of each weight across tokens wins. */
enum { GEMV_MAX_N = 8 };

/* Independent f32 accumulators per dot product: two AVX-512 or four AVX2 registers per token,
 * so that successive adds into one register do not wait on each other's latency. */
enum { LANES = 32 };

/* x86-64 builds get AVX-512 and AVX2 clones of the kernel, chosen once at load by the CPU
 * (GCC/Clang function multiversioning); everything else, and older CPUs, the baseline one. The
 * loops are plain C either way. Not under ThreadSanitizer: the loader runs the clones' resolver
 * before TSan's runtime is up, and every program linking the library crashed at start. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GEMV_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define GEMV_TSAN 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(GEMV_TSAN)
#define GEMV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define GEMV_CLONES
#endif

/* The helpers below must be inlined into each clone to be compiled for its instruction set. */
#if defined(__GNUC__)
#define INLINE inline __attribute__((always_inline))
#else
#define INLINE inline
#endif

/* bf16 is the top half of an f32, so widening is a 16-bit shift (exact). */
static inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* How far ahead of the row being widened the expert's weights are prefetched, in bytes:
 * TANDEM_MOE_CPU_PREFETCH_KB KiB (0 to PREFETCH_KB_MAX; 0: none), read once, else
 * PREFETCH_KB_DEFAULT. Without any, a row's load only starts once its dot products are done,
 * and a one-token expert read its weights at about 0.65 of the thread's read bandwidth; with
 * 4 KiB (one Qwen3-30B-A3B gate row) at about 0.85 on a two-core machine
 * (bench/cpu-expert-gemv.c). A thread's read rate is bound by the lines it has in flight, so a
 * host whose memory is far (a VM, many sockets) wants more. */
enum { PREFETCH_KB_DEFAULT = 4, PREFETCH_KB_MAX = 1024 };

static size_t prefetch_bytes;
static pthread_once_t prefetch_once = PTHREAD_ONCE_INIT;

static void prefetch_init(void) {
  prefetch_bytes = (size_t)tdm_moe__env_long("TANDEM_MOE_CPU_PREFETCH_KB", 0, PREFETCH_KB_MAX,
                                             PREFETCH_KB_DEFAULT) * 1024;
}

#if defined(__GNUC__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3) /* read, keep in all levels */
#else
#define PREFETCH(p) ((void)(p))
#endif

/* The first `ahead` bytes of a chunk [p, end), prefetched as it starts, so that its first
 * rows do not wait for memory while the prefetches inside widen_row get `ahead` in front. */
static INLINE void prefetch_start(const void *from, const void *to, size_t ahead) {
  const uint8_t *p = from, *end = to;
  const uint8_t *stop = (size_t)(end - p) < ahead ? end : p + ahead;
  for (; p < stop; p += 64) PREFETCH(p);
}

/* f16 widened: eight at a time by F16C where the CPU has it (checked once, in
 * tdm_moe__cpu_gemv16), else one at a time by moe_ops.h's exact bit manipulation. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) static void widen_f16_f16c(float *dst, const uint16_t *src,
                                                               size_t n) {
  size_t full = n - n % 8;
  for (size_t i = 0; i < full; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  for (size_t i = full; i < n; i++) dst[i] = tdm_moe_f16_to_f32(src[i]);
}
static int f16c_ok;
static pthread_once_t f16c_once = PTHREAD_ONCE_INIT;
static void f16c_init(void) {
  __builtin_cpu_init();
  f16c_ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#endif

static void widen_f16(float *dst, const uint16_t *src, size_t n) {
#ifdef HAVE_F16C_PATH
  if (f16c_ok) {
    widen_f16_f16c(dst, src, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_f16_to_f32(src[i]);
}

/* Whichever widen_f16 takes: F16C's, where the CPU has it. Before its first use. */
static void f16_ready(void) {
#ifdef HAVE_F16C_PATH
  pthread_once(&f16c_once, f16c_init);
#endif
}

void tdm_moe__cpu_widen16(float *dst, const uint16_t *src, size_t n, int wtype) {
  if (wtype == TDM_MOE_W_F16) {
    f16_ready();
    widen_f16(dst, src, n);
  } else {
    for (size_t i = 0; i < n; i++) dst[i] = bf16_bits_to_f32(src[i]);
  }
}

/* dst[0..K) = src widened (bf16, or f16 when f16: f16_ready() first); blocks of LANES so the
 * compiler vectorizes without a cost model. Each block (one 64-byte line of 16-bit values)
 * prefetches the line `ahead` values further on, unless that passes end, the end of the chunk
 * being computed. */
static INLINE void widen_row(float *restrict dst, const uint16_t *restrict src, size_t K,
                             const uint16_t *end, size_t ahead, int f16) {
  size_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    if (ahead && (size_t)(end - (src + k)) > ahead) PREFETCH(src + k + ahead);
    if (f16)
      widen_f16(dst + k, src + k, LANES);
    else
      for (size_t l = 0; l < LANES; l++) dst[k + l] = bf16_bits_to_f32(src[k + l]);
  }
  if (f16)
    widen_f16(dst + k, src + k, K - k);
  else
    for (; k < K; k++) dst[k] = bf16_bits_to_f32(src[k]);
}

/* A row of K values of a block type (rb bytes at src) widened into dst, block by block, as
 * quant.h defines them. The row's lines `ahead` bytes further on are prefetched as it starts,
 * unless they pass end. */
static INLINE void widen_qrow(float *restrict dst, const uint8_t *restrict src, size_t K,
                              int type, size_t rb, const uint8_t *end, size_t ahead) {
  if (ahead)
    for (size_t o = 0; o < rb; o += 64)
      if ((size_t)(end - (src + o)) > ahead) PREFETCH(src + o + ahead);
  tdm_moe__dequant_blocks(type, src, K, dst);
}

/* A weight row of any type (rb bytes at src) widened into dst; ahead and end in bytes. */
static INLINE void widen_any(float *restrict dst, const uint8_t *restrict src, size_t K,
                             int type, size_t rb, const uint8_t *end, size_t ahead) {
  if (type == TDM_MOE_W_BF16 || type == TDM_MOE_W_F16)
    widen_row(dst, (const uint16_t *)(const void *)src, K,
              (const uint16_t *)(const void *)end, ahead / 2, type == TDM_MOE_W_F16);
  else
    widen_qrow(dst, src, K, type, rb, end, ahead);
}

/* res[t] = sum a[k] * x[t][k] in f32 for the T tokens (T a constant after inlining), one pass
 * over a: each a[k] loaded once serves all T. For every token, lane l sums k = l mod LANES in
 * ascending k, the tail adds in order, then the lanes add in ascending order: a fixed order
 * that does not depend on T, so a token's result is the same whichever group it falls in. */
static INLINE void dot_rows(const float *restrict a, const float *const *x, float *res, size_t K,
                            int T) {
  float acc[4][LANES] = {{0}};
  size_t k = 0;
  for (; k + LANES <= K; k += LANES)
    for (int t = 0; t < T; t++)
      for (size_t l = 0; l < LANES; l++) acc[t][l] += a[k + l] * x[t][k + l];
  for (int t = 0; t < T; t++) {
    float s = 0.0f;
    for (size_t j = k; j < K; j++) s += a[j] * x[t][j];
    for (size_t l = 0; l < LANES; l++) s += acc[t][l];
    res[t] = s;
  }
}

/* dot_rows for any n, in groups of up to four tokens (the accumulators of four fill half the
 * vector registers of AVX-512 and AVX2, so a group costs no spills there). */
static INLINE void dot_tokens(const float *restrict a, const float *const *x, float *res,
                              size_t K, size_t n) {
  size_t t = 0;
  for (; t + 4 <= n; t += 4) dot_rows(a, x + t, res + t, K, 4);
  switch (n - t) {
  case 3: dot_rows(a, x + t, res + t, K, 3); break;
  case 2: dot_rows(a, x + t, res + t, K, 2); break;
  case 1: dot_rows(a, x + t, res + t, K, 1); break;
  default: break;
  }
}

/* A weight row (rb bytes at src) dotted with n tokens: on its blocks (qdot.h) where qdot says
 * so, else widened into the row buffer and dotted from there. The row's lines `ahead` bytes
 * further on are prefetched either way, unless they pass end. */
static INLINE void dot_any(float *restrict row, const uint8_t *restrict src, size_t K, int type,
                           size_t rb, bool qdot, const uint8_t *end, size_t ahead,
                           const float *const *x, float *res, size_t n) {
  if (!qdot) {
    widen_any(row, src, K, type, rb, end, ahead);
    dot_tokens(row, x, res, K, n);
    return;
  }
  if (ahead)
    for (size_t o = 0; o < rb; o += 64)
      if ((size_t)(end - (src + o)) > ahead) PREFETCH(src + o + ahead);
  tdm_moe__qdot(src, type, K, x, res, n);
}

/* A block row dotted with n tokens' 16-bit activations (qdot.h), its lines prefetched as
 * dot_any's. */
static INLINE void dot_16(const uint8_t *restrict src, size_t K, int type, size_t rb,
                          const uint8_t *end, size_t ahead, const void *const *x16, float *res,
                          size_t n) {
  if (ahead)
    for (size_t o = 0; o < rb; o += 64)
      if ((size_t)(end - (src + o)) > ahead) PREFETCH(src + o + ahead);
  tdm_moe__qdot16(src, type, K, x16, res, n);
}

/* The expert for n <= GEMV_MAX_N tokens, its rows split between the pool's workers (pool.h)
 * in chunks of `chunk` rows: first the 2I rows of [Wg; Wu] into gu (token t's [gate | up] at
 * gu + t*2I), then, once all are done and the caller has applied SiLU, the H rows of Wd into
 * the outputs. Each weight row is read from memory once, widened into the worker's row buffer
 * (L1-sized, rows + worker * row_stride floats) and dotted with every token's row from there.
 * A row is computed whole by one worker, so the bits do not depend on the split. */
typedef struct gemv_job {
  const float *const *xs; /* n: token t's input row (H) */
  const float *const *hs; /* n: token t's SiLU(gate) * up (I), for the down rows */
  float *const *out;      /* n: token t's output row (H) */
  size_t n, H, I, chunk;
  const uint8_t *w;         /* the expert's weights, in format fmt */
  tdm_moe_wfmt fmt;
  size_t gu_rb, d_rb;       /* bytes of a gate or up row, and of a down row */
  bool qdot_gu, qdot_d;     /* rows dotted on their blocks (qdot.h), not widened first */
  bool q16_gu, q16_d;       /* ... in integers, on 16-bit activations (x16, h16) */
  const void *x16[GEMV_MAX_N], *h16[GEMV_MAX_N]; /* the tokens' xs and hs prepared so */
  size_t ahead;             /* prefetch distance in bytes (prefetch_bytes) */
  float *gu, *rows;
  size_t row_stride;
} gemv_job;

GEMV_CLONES
static void gemv_gate_up(void *arg, size_t c, int worker) {
  const gemv_job *j = arg;
  float res[GEMV_MAX_N];
  float *row = j->rows + (size_t)worker * j->row_stride;
  size_t r1 = (c + 1) * j->chunk < 2 * j->I ? (c + 1) * j->chunk : 2 * j->I;
  const uint8_t *end = j->w + r1 * j->gu_rb;
  if (j->ahead) prefetch_start(j->w + c * j->chunk * j->gu_rb, end, j->ahead);
  for (size_t r = c * j->chunk; r < r1; r++) {
    if (j->q16_gu)
      dot_16(j->w + r * j->gu_rb, j->H, j->fmt.gu, j->gu_rb, end, j->ahead, j->x16, res, j->n);
    else
      dot_any(row, j->w + r * j->gu_rb, j->H, j->fmt.gu, j->gu_rb, j->qdot_gu, end, j->ahead,
              j->xs, res, j->n);
    for (size_t t = 0; t < j->n; t++) j->gu[t * 2 * j->I + r] = res[t];
  }
}

GEMV_CLONES
static void gemv_down(void *arg, size_t c, int worker) {
  const gemv_job *j = arg;
  float res[GEMV_MAX_N];
  float *row = j->rows + (size_t)worker * j->row_stride;
  const uint8_t *wd = j->w + 2 * j->I * j->gu_rb;
  size_t c1 = (c + 1) * j->chunk < j->H ? (c + 1) * j->chunk : j->H;
  const uint8_t *end = wd + c1 * j->d_rb;
  if (j->ahead) prefetch_start(wd + c * j->chunk * j->d_rb, end, j->ahead);
  for (size_t r = c * j->chunk; r < c1; r++) {
    if (j->q16_d)
      dot_16(wd + r * j->d_rb, j->I, j->fmt.d, j->d_rb, end, j->ahead, j->h16, res, j->n);
    else
      dot_any(row, wd + r * j->d_rb, j->I, j->fmt.d, j->d_rb, j->qdot_d, end, j->ahead, j->hs,
              res, j->n);
    for (size_t t = 0; t < j->n; t++) j->out[t][r] = res[t];
  }
}

/* Chunks of `rows` rows for `workers`: about four a worker, so that one slow to start does
 * not hold the others up, and at least GEMV_CHUNK_MIN rows, so that a chunk is worth handing
 * out (a row of Qwen3-30B-A3B is 4 KiB of weights). */
enum { GEMV_CHUNK_MIN = 16 };
static size_t gemv_chunk(size_t rows, int workers) {
  size_t c = (rows + 4 * (size_t)workers - 1) / (4 * (size_t)workers);
  return c < GEMV_CHUNK_MIN ? GEMV_CHUNK_MIN : c;
}

/* An expert smaller than this (bf16 weights) runs on its caller alone: handing it out would
 * cost more than it saves. */
enum { GEMV_POOL_MIN_WEIGHTS = 64 * 1024 };

/* One pass over rows, fn over chunks of *chunk rows (set here): on the pool, or on the caller
 * alone. */
static void gemv_pass(int workers, size_t rows, pool_fn fn, void *job, size_t *chunk) {
  *chunk = gemv_chunk(rows, workers);
  size_t chunks = (rows + *chunk - 1) / *chunk;
  if (workers > 1)
    pool_run(chunks, fn, job);
  else
    for (size_t c = 0; c < chunks; c++) fn(job, c, 0);
}

/* SwiGLU in place on n tokens' [gate | up] rows of 2I floats: gate becomes SiLU(gate) * up. */
static void swiglu_rows(float *gu, size_t n, size_t I) {
  for (size_t t = 0; t < n; t++) {
    float *g = gu + t * 2 * I;
    const float *u = g + I;
    for (size_t k = 0; k < I; k++) g[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
  }
}

static bool is_block(int t) { return t != TDM_MOE_W_BF16 && t != TDM_MOE_W_F16; }

/* Block rows dotted on their blocks where the CPU can (qdot.h; TANDEM_MOE_CPU_QDOT=0: never),
 * else widened first. */
static bool qdot_on(void) { return tdm_moe__qdot_ready(); }

/* The gemv_job of an expert at w in format fmt (chunk left to the pass). */
static gemv_job gemv_job_of(const uint8_t *w, tdm_moe_wfmt fmt, size_t H, size_t I) {
  pthread_once(&prefetch_once, prefetch_init);
  if (fmt.gu == TDM_MOE_W_F16 || fmt.d == TDM_MOE_W_F16) f16_ready();
  bool q = qdot_on();
  return (gemv_job){.H = H, .I = I, .w = w, .fmt = fmt,
                    .gu_rb = tdm_moe_row_bytes(fmt.gu, (int64_t)H),
                    .d_rb = tdm_moe_row_bytes(fmt.d, (int64_t)I), .ahead = prefetch_bytes,
                    .qdot_gu = q && is_block(fmt.gu), .qdot_d = q && is_block(fmt.d),
                    .q16_gu = tdm_moe__qdot16_takes(fmt.gu),
                    .q16_d = tdm_moe__qdot16_takes(fmt.d)};
}

/* Bytes of a job's 16-bit activations for n tokens (qdot.h), 256-byte multiples. */
static size_t x16_need(size_t n, size_t H, size_t I) {
  return round256(n * tdm_moe__x16_bytes(H)) + round256(n * tdm_moe__x16_bytes(I));
}

/* Tokens up to which rows run on 16-bit activations: one thread dotted a Q4_K expert 1.4x
 * faster so at one token, and 1.2x slower at four, whose f32 path widens each weight once for
 * all of them (bench/results/cpu-qdot16-*). */
enum { Q16_MAX_N = 2 };

/* The job's tokens' xs prepared for its gate/up rows into mem (x16_need's bytes; its hs after
 * SwiGLU by prepare_h16 into the rest): without room, or with more than Q16_MAX_N tokens, its
 * rows stay on f32 activations. */
static void prepare_x16(gemv_job *j, unsigned char *mem) {
  if (!mem || j->n > Q16_MAX_N) {
    j->q16_gu = j->q16_d = false;
    return;
  }
  for (size_t t = 0; j->q16_gu && t < j->n; t++) {
    j->x16[t] = mem + t * tdm_moe__x16_bytes(j->H);
    tdm_moe__x16(j->xs[t], j->H, j->fmt.gu, (void *)j->x16[t]);
  }
  mem += round256(j->n * tdm_moe__x16_bytes(j->H));
  for (size_t t = 0; j->q16_d && t < j->n; t++) j->h16[t] = mem + t * tdm_moe__x16_bytes(j->I);
}

static void prepare_h16(gemv_job *j) {
  for (size_t t = 0; j->q16_d && t < j->n; t++)
    tdm_moe__x16(j->hs[t], j->I, j->fmt.d, (void *)j->h16[t]);
}

/* xs, out as in gemv_job; rows: `slots` row buffers of row_stride floats; gu: n x 2I floats;
 * mem: x16_need(n, H, I) bytes for 16-bit activations (NULL: none). */
static void expert_gemv(const float *const *xs, float *const *out, size_t n, const uint8_t *w,
                        tdm_moe_wfmt fmt, size_t H, size_t I, float *rows, size_t row_stride,
                        size_t slots, float *gu, unsigned char *mem) {
  int workers = pool_workers();
  if ((size_t)workers > slots || 3 * H * I < GEMV_POOL_MIN_WEIGHTS) workers = 1;
  const float *hs[GEMV_MAX_N];
  for (size_t t = 0; t < n; t++) hs[t] = gu + t * 2 * I;
  gemv_job j = gemv_job_of(w, fmt, H, I);
  j.xs = xs, j.hs = hs, j.out = out, j.n = n, j.gu = gu, j.rows = rows, j.row_stride = row_stride;
  prepare_x16(&j, mem);
  gemv_pass(workers, 2 * I, gemv_gate_up, &j, &j.chunk);
  swiglu_rows(gu, n, I);
  prepare_h16(&j);
  gemv_pass(workers, H, gemv_down, &j, &j.chunk);
}

/* ---- matmul_h and matmul_q, few tokens: weight rows dotted directly ------------------------ */

typedef struct gemvw_job {
  const float *const *xs; /* n token rows of K */
  float *y;               /* [n x N] */
  const uint8_t *w;       /* [N x K], rows of rb bytes in type wtype */
  size_t n, K, N, rb, chunk, ahead;
  int wtype, beta;
  bool qdot;              /* block rows dotted on their blocks (qdot.h) */
  bool q16;               /* ... in integers, on the tokens' 16-bit activations x16 */
  const void *x16[GEMV_MAX_N];
  float *rows;            /* a row buffer of K floats per worker */
} gemvw_job;

GEMV_CLONES
static void gemvw_rows(void *arg, size_t c, int worker) {
  const gemvw_job *j = arg;
  float res[GEMV_MAX_N];
  float *row = j->rows + (size_t)worker * j->K;
  size_t r1 = (c + 1) * j->chunk < j->N ? (c + 1) * j->chunk : j->N;
  const uint8_t *end = j->w + r1 * j->rb;
  if (j->ahead) prefetch_start(j->w + c * j->chunk * j->rb, end, j->ahead);
  for (size_t r = c * j->chunk; r < r1; r++) {
    if (j->q16)
      dot_16(j->w + r * j->rb, j->K, j->wtype, j->rb, end, j->ahead, j->x16, res, j->n);
    else
      dot_any(row, j->w + r * j->rb, j->K, j->wtype, j->rb, j->qdot, end, j->ahead, j->xs, res,
              j->n);
    for (size_t t = 0; t < j->n; t++) {
      float *yo = j->y + t * j->N + r;
      *yo = j->beta ? *yo + res[t] : res[t];
    }
  }
}

int tdm_moe__cpu_gemvw(float *y, const float *x, const void *w, int wtype, size_t T, size_t K,
                       size_t N, int beta) {
  int workers = pool_workers();
  if (N * K < GEMV_POOL_MIN_WEIGHTS) workers = 1;
  const bool q16 = T <= Q16_MAX_N && tdm_moe__qdot16_takes(wtype);
  const size_t x16b = q16 ? tdm_moe__x16_bytes(K) : 0;
  float *rows = malloc((size_t)workers * K * sizeof *rows + T * x16b);
  if (!rows) return tdm_set_error(TDM_ENOMEM, 0, "moe matmul: no memory for row buffers");
  const float *xs[GEMV_MAX_N];
  for (size_t t = 0; t < T && t < GEMV_MAX_N; t++) xs[t] = x + t * K;
  pthread_once(&prefetch_once, prefetch_init);
  if (wtype == TDM_MOE_W_F16) f16_ready();
  gemvw_job j = {.xs = xs, .y = y, .w = w, .n = T, .K = K, .N = N,
                 .rb = tdm_moe_row_bytes(wtype, (int64_t)K), .ahead = prefetch_bytes,
                 .wtype = wtype, .beta = beta, .qdot = is_block(wtype) && qdot_on(),
                 .q16 = q16, .rows = rows};
  for (size_t t = 0; q16 && t < T; t++) {
    j.x16[t] = (unsigned char *)(rows + (size_t)workers * K) + t * x16b;
    tdm_moe__x16(x + t * K, K, wtype, (void *)j.x16[t]);
  }
  gemv_pass(workers, N, gemvw_rows, &j, &j.chunk);
  free(rows);
  return 0;
}

/* Up to GEMV_FUSE experts on few tokens each, both passes over all of them at once: the gate
 * and up rows of every expert, then (SiLU applied) the down rows of every expert, so the pool
 * joins twice for the lot rather than twice an expert, and its threads, which finish a pass
 * chunk by chunk, idle at one tail instead of one per pass and expert. Each row is computed
 * as expert_gemv computes it, so the bits are the same. jobs[g] as expert_gemv makes them
 * (chunk set here); workers > 1. */
enum { GEMV_FUSE = 16 };
typedef struct gemv_fused {
  gemv_job *jobs;
  size_t first[GEMV_FUSE + 1]; /* job g's chunks are [first[g], first[g + 1]) of the pass */
  int njobs;
  pool_fn fn;
} gemv_fused;

static void fused_chunk(void *arg, size_t c, int worker) {
  const gemv_fused *f = arg;
  int lo = 0, hi = f->njobs - 1; /* the job whose chunks hold c */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (f->first[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  f->fn(&f->jobs[lo], c - f->first[lo], worker);
}

static void fused_pass(gemv_fused *f, size_t rows, pool_fn fn, int workers) {
  size_t chunk = gemv_chunk(rows, workers), per = (rows + chunk - 1) / chunk;
  for (int g = 0; g < f->njobs; g++) {
    f->jobs[g].chunk = chunk;
    f->first[g] = (size_t)g * per;
  }
  f->first[f->njobs] = (size_t)f->njobs * per;
  f->fn = fn;
  pool_run(f->first[f->njobs], fused_chunk, f);
}

static void experts_gemv_fused(gemv_job *jobs, int njobs, size_t H, size_t I, int workers) {
  gemv_fused f = {.jobs = jobs, .njobs = njobs};
  fused_pass(&f, 2 * I, gemv_gate_up, workers);
  for (int g = 0; g < njobs; g++) {
    swiglu_rows(jobs[g].gu, jobs[g].n, I);
    prepare_h16(&jobs[g]);
  }
  fused_pass(&f, H, gemv_down, workers);
}

/* ---- expert ------------------------------------------------------------------------------ */

/* The expert at src, in format fmt, widened into w (3HI floats, the bf16 layout), row by row
 * as the few-token kernels widen them (for sgemm, many tokens an expert). */
GEMV_CLONES
static void widen_expert(float *w, const uint8_t *src, tdm_moe_wfmt fmt, size_t H, size_t I) {
  if (fmt.gu == TDM_MOE_W_BF16 && fmt.d == TDM_MOE_W_BF16) {
    bf16_to_f32(w, (const tdm_moe_bf16 *)(const void *)src, 3 * H * I);
    return;
  }
  if (fmt.gu == TDM_MOE_W_F16 || fmt.d == TDM_MOE_W_F16) f16_ready();
  size_t gu_rb = tdm_moe_row_bytes(fmt.gu, (int64_t)H), d_rb = tdm_moe_row_bytes(fmt.d, (int64_t)I);
  const uint8_t *end = src + 2 * I * gu_rb + H * d_rb;
  for (size_t r = 0; r < 2 * I; r++, src += gu_rb) widen_any(w + r * H, src, H, fmt.gu, gu_rb, end, 0);
  for (size_t r = 0; r < H; r++, src += d_rb)
    widen_any(w + 2 * H * I + r * I, src, I, fmt.d, d_rb, end, 0);
}

/* The expert at w on n tokens whose indices are known to be in range: what expert() computes,
 * and experts() for each entry of its table, so that the two give the same bits. */
static void expert_compute(const float *x, const int32_t *rows, const int32_t *slot, size_t n,
                           const uint8_t *wts, tdm_moe_wfmt fmt, size_t H, size_t I, float *out,
                           float *ws) {
  if (n <= GEMV_MAX_N) {
    /* Workspace, in the sgemm path's layout, so tdm_moe_ops_workspace() covers it: a row
     * buffer per worker in the region of the f32 weights (3HI floats hold 3 min(H, I) buffers
     * of max(H, I); with fewer than the pool's workers the expert runs on its caller alone),
     * and gate|up where the sgemm path keeps it. Outputs go straight to their slots: the
     * inputs are all read before the first output is written, so x and out may even
     * overlap. */
    const float *xs[GEMV_MAX_N];
    float *outs[GEMV_MAX_N];
    for (size_t i = 0; i < n; i++) {
      xs[i] = x + (size_t)rows[i] * H;
      outs[i] = out + (size_t)slot[i] * H;
    }
    size_t stride = round256((H > I ? H : I) * sizeof(float)) / sizeof(float);
    size_t region = round256(3 * H * I * sizeof(float)) / sizeof(float);
    float *gu = ws + region + round256(n * H * sizeof(float)) / sizeof(float);
    /* 16-bit activations at the region's end, the row buffers before them */
    size_t need = x16_need(n, H, I) / sizeof(float);
    unsigned char *mem = need + stride <= region ? (unsigned char *)(ws + region - need) : NULL;
    size_t slots = (mem ? region - need : region) / stride;
    expert_gemv(xs, outs, n, wts, fmt, H, I, ws, stride, slots, gu, mem);
    return;
  }
  float *w = ws;
  float *xo = (float *)((char *)w + round256(3 * H * I * sizeof(float)));
  float *gu = (float *)((char *)xo + round256(n * H * sizeof(float)));
  const float *wd = w + 2 * H * I;

  widen_expert(w, wts, fmt, H, I);
  for (size_t i = 0; i < n; i++) memcpy(xo + i * H, x + (size_t)rows[i] * H, H * sizeof(float));
  /* Wg and Wu are adjacent, so [gate | up] = X [Wg; Wu]^T is one GEMM of width 2I. */
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, 2 * (int)I, (int)H, 1.0f, xo,
              (int)H, w, (int)H, 0.0f, gu, 2 * (int)I);
  swiglu_rows(gu, n, I);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)H, (int)I, 1.0f, gu,
              2 * (int)I, wd, (int)I, 0.0f, xo, (int)H);
  for (size_t i = 0; i < n; i++)
    memcpy(out + (size_t)slot[i] * H, xo + i * H, H * sizeof(float));
}

static int expert_body(const task *t) {
  const expert_args *a = (const expert_args *)t;
  /* Indices are device data written by earlier commands, so they are checked only now; the
   * message reaches whoever learns of the failure (the queue's sync quotes it). */
  for (size_t i = 0; i < (size_t)a->n; i++) {
    if (a->rows[i] < 0 || (size_t)a->rows[i] >= a->x_rows)
      return tdm_set_error(TDM_ERANGE, 0, "moe expert: rows[%zu] = %d outside x", i,
                           (int)a->rows[i]);
    if (a->slot[i] < 0 || (size_t)a->slot[i] >= a->out_rows)
      return tdm_set_error(TDM_ERANGE, 0, "moe expert: slot[%zu] = %d outside out", i,
                           (int)a->slot[i]);
  }
  expert_compute(a->x, a->rows, a->slot, (size_t)a->n, a->w, a->fmt, (size_t)a->H, (size_t)a->I,
                 a->out, a->ws);
  return 0;
}

/* Whether fmt is one the CPU computes with rows of H and I values: 0, or TDM_EINVAL. */
static int check_fmt(tdm_moe_wfmt fmt, int H, int I, const char *op) {
  if (tdm_moe_expert_size(fmt, H, I)) return 0;
  return tdm_set_error(TDM_EINVAL, 0,
                       "moe %s: weight format {%d, %d} with H=%d, I=%d: a type the CPU lacks, or "
                       "rows that are not whole blocks", op, fmt.gu, fmt.d, H, I);
}

/* The workspace check of expert() and experts(). */
static int check_workspace(const void *ws, size_t bytes, int n, int H, int I, const char *op) {
  size_t need = tdm_moe_ops_workspace(n, H, I);
  if (ws && need && bytes >= need && (uintptr_t)ws % sizeof(float) == 0) return 0;
  return tdm_set_error(TDM_EINVAL, 0,
                       "moe %s: workspace %p of %zu bytes; n=%d H=%d I=%d need %zu, aligned", op,
                       ws, bytes, n, H, I, need);
}

static int cpu_expert_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                        const int32_t *slot, int n, const void *w, tdm_moe_wfmt fmt, int H, int I,
                        float *out, void *workspace, size_t workspace_bytes) {
  int rc = tdm_moe__check_state(st, q, "expert");
  if (rc) return rc;
  if (!x || !rows || !slot || !w || !out || n < 0 || H <= 0 || I <= 0) return tdm_moe__bad_args("expert");
  if ((rc = check_fmt(fmt, H, I, "expert"))) return rc;
  if (n == 0) return 0;
  if ((rc = check_workspace(workspace, workspace_bytes, n, H, I, "expert"))) return rc;
  expert_args *a = tdm_moe__task_alloc(sizeof *a, "expert");
  if (!a) return TDM_ENOMEM;
  *a = (expert_args){.t.body = expert_body, .x = x, .rows = rows, .slot = slot, .n = n, .H = H,
                     .I = I, .w = w, .fmt = fmt, .out = out, .ws = workspace,
                     .x_rows = tdm_moe__rows_available(x, H), .out_rows = tdm_moe__rows_available(out, H)};
  return tdm_moe__task_submit(q, &a->t);
}

static int cpu_expert(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                      const int32_t *slot, int n, const tdm_moe_bf16 *w, int H, int I, float *out,
                      void *workspace, size_t workspace_bytes) {
  return cpu_expert_q(st, q, x, rows, slot, n, w, (tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16},
                      H, I, out, workspace, workspace_bytes);
}

/* ---- experts: a group of experts from a device table ------------------------------------ */

typedef struct experts_args {
  task t; /* first */
  const float *x;
  const int32_t *rows, *slot;
  int n, G, H, I;
  const uint8_t *wbase;
  tdm_moe_wfmt fmt;
  const tdm_moe_group *groups;
  float *out;
  float *ws;
  size_t x_rows, out_rows; /* bounds of x and out, from tdm_mem_query */
  int64_t w_lo, w_hi;      /* the w whose expert lies in wbase's allocation: [w_lo, w_hi] */
} experts_args;

/* The table is checked whole before anything is computed, so that a bad entry fails the
 * command with out untouched. The message says which entry; tandem keeps it with the failed
 * host task, so the queue's sync quotes it after naming the task. */
static int experts_check(const experts_args *a) {
  for (int g = 0; g < a->G; g++) {
    const tdm_moe_group e = a->groups[g];
    if (e.count == 0) continue;
    if (e.first < 0 || e.count < 0 || (int64_t)e.first + e.count > a->n)
      return tdm_set_error(TDM_ERANGE, 0, "moe experts: entry %d: first %d, count %d, n %d", g,
                           (int)e.first, (int)e.count, a->n);
    if (e.w < a->w_lo || e.w > a->w_hi)
      return tdm_set_error(TDM_ERANGE, 0,
                           "moe experts: entry %d: weights at %lld leave wbase's allocation", g,
                           (long long)e.w);
    for (int i = e.first; i < e.first + e.count; i++) {
      if (a->rows[i] < 0 || (size_t)a->rows[i] >= a->x_rows)
        return tdm_set_error(TDM_ERANGE, 0, "moe experts: entry %d: rows[%d] = %d outside x", g,
                             i, (int)a->rows[i]);
      if (a->slot[i] < 0 || (size_t)a->slot[i] >= a->out_rows)
        return tdm_set_error(TDM_ERANGE, 0, "moe experts: entry %d: slot[%d] = %d outside out",
                             g, i, (int)a->slot[i]);
    }
  }
  return 0;
}

/* Whether experts_body may fuse the table's experts (experts_gemv_fused): the pool has
 * workers to split them, each expert is on few tokens (the direct path), and all their
 * [gate | up] rows fit where expert_compute keeps one expert's (the entries name no token
 * twice, so their counts add up to at most n). */
static bool experts_fusable(const experts_args *a, int workers, size_t slots) {
  if (workers < 2 || (size_t)workers > slots ||
      3 * (size_t)a->H * a->I < GEMV_POOL_MIN_WEIGHTS)
    return false;
  size_t total = 0;
  for (int g = 0; g < a->G; g++) {
    if (a->groups[g].count > GEMV_MAX_N) return false;
    total += (size_t)a->groups[g].count;
  }
  return total <= (size_t)a->n;
}

/* Bytes at the row-buffer region's end that a fused batch's 16-bit activations take at most
 * (x16_need of each of up to GEMV_FUSE experts on n tokens in all). */
static size_t fused_x16_reserve(size_t n, size_t H, size_t I) {
  return x16_need(n, H, I) + 2 * GEMV_FUSE * 256;
}

/* The table's experts in batches of up to GEMV_FUSE, each batch fused: the workspace's row
 * buffers serve every batch, each expert's [gate | up] gets its own rows after them, and its
 * 16-bit activations (mem: fused_x16_reserve's bytes, or NULL) its own part of mem. */
static void experts_fused(const experts_args *a, int workers, size_t stride, size_t region,
                          unsigned char *mem) {
  size_t H = (size_t)a->H, I = (size_t)a->I;
  const float *xs[GEMV_FUSE][GEMV_MAX_N], *hs[GEMV_FUSE][GEMV_MAX_N];
  float *outs[GEMV_FUSE][GEMV_MAX_N];
  gemv_job jobs[GEMV_FUSE];
  int g = 0;
  while (g < a->G) {
    int nj = 0;
    float *gu = a->ws + region;
    unsigned char *m16 = mem;
    for (; g < a->G && nj < GEMV_FUSE; g++) {
      const tdm_moe_group e = a->groups[g];
      if (e.count == 0) continue;
      for (int i = 0; i < e.count; i++) {
        xs[nj][i] = a->x + (size_t)a->rows[e.first + i] * H;
        outs[nj][i] = a->out + (size_t)a->slot[e.first + i] * H;
        hs[nj][i] = gu + (size_t)i * 2 * I;
      }
      jobs[nj] = gemv_job_of(a->wbase + 2 * e.w, a->fmt, H, I);
      jobs[nj].xs = xs[nj], jobs[nj].hs = hs[nj], jobs[nj].out = outs[nj];
      jobs[nj].n = (size_t)e.count, jobs[nj].gu = gu, jobs[nj].rows = a->ws;
      jobs[nj].row_stride = stride;
      prepare_x16(&jobs[nj], m16);
      if (m16) m16 += x16_need((size_t)e.count, H, I);
      gu += (size_t)e.count * 2 * I;
      nj++;
    }
    if (nj) experts_gemv_fused(jobs, nj, H, I, workers);
  }
}

static int experts_body(const task *t) {
  const experts_args *a = (const experts_args *)t;
  int rc = experts_check(a);
  if (rc) return rc;
  /* expert_compute's layout of the workspace: row buffers in the region of 3HI floats */
  size_t H = (size_t)a->H, I = (size_t)a->I;
  size_t stride = round256((H > I ? H : I) * sizeof(float)) / sizeof(float);
  size_t region = round256(3 * H * I * sizeof(float)) / sizeof(float);
  int workers = pool_workers();
  size_t need = fused_x16_reserve((size_t)a->n, H, I) / sizeof(float);
  unsigned char *mem = need + stride <= region ? (unsigned char *)(a->ws + region - need) : NULL;
  if (experts_fusable(a, workers, (mem ? region - need : region) / stride)) {
    experts_fused(a, workers, stride, region, mem);
    return 0;
  }
  for (int g = 0; g < a->G; g++) {
    const tdm_moe_group e = a->groups[g];
    if (e.count == 0) continue;
    expert_compute(a->x, a->rows + e.first, a->slot + e.first, (size_t)e.count,
                   a->wbase + 2 * e.w, a->fmt, (size_t)a->H, (size_t)a->I, a->out, a->ws);
  }
  return 0;
}

/* The offsets w (in 2-byte units from wbase) at which an expert of `bytes` bytes lies inside
 * the tandem allocation holding wbase; every offset when tandem does not know the memory (the
 * caller vouches for it, as for rows_available). */
static void weight_range(const void *wbase, size_t bytes, int64_t *lo, int64_t *hi) {
  tdm_mem_info mi;
  *lo = INT64_MIN;
  *hi = INT64_MAX;
  if (tdm_mem_query(wbase, &mi) != 0 || !mi.base) return;
  size_t before = (size_t)((const char *)wbase - (const char *)mi.base);
  int64_t room = (int64_t)(mi.size - before) - (int64_t)bytes; /* bytes past wbase to spare */
  *lo = -(int64_t)(before / 2);
  *hi = room >= 0 ? room / 2 : -((1 - room) / 2); /* floor(room / 2): below lo, nothing fits */
}

static int cpu_experts_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                         const int32_t *slot, int n, const void *wbase, tdm_moe_wfmt fmt,
                         const tdm_moe_group *groups, int G, int H, int I, float *out,
                         void *workspace, size_t workspace_bytes) {
  int rc = tdm_moe__check_state(st, q, "experts");
  if (rc) return rc;
  if (!x || !rows || !slot || !wbase || !groups || !out || n < 0 || G < 0 || H <= 0 || I <= 0)
    return tdm_moe__bad_args("experts");
  if ((rc = check_fmt(fmt, H, I, "experts"))) return rc;
  if (n == 0 || G == 0) return 0;
  /* Each entry runs as expert() on its count <= n tokens, in the space expert() needs for n. */
  if ((rc = check_workspace(workspace, workspace_bytes, n, H, I, "experts"))) return rc;
  experts_args *a = tdm_moe__task_alloc(sizeof *a, "experts");
  if (!a) return TDM_ENOMEM;
  *a = (experts_args){.t.body = experts_body, .x = x, .rows = rows, .slot = slot, .n = n,
                      .G = G, .H = H, .I = I, .wbase = wbase, .fmt = fmt, .groups = groups,
                      .out = out, .ws = workspace, .x_rows = tdm_moe__rows_available(x, H),
                      .out_rows = tdm_moe__rows_available(out, H)};
  weight_range(wbase, tdm_moe_expert_size(fmt, H, I), &a->w_lo, &a->w_hi);
  return tdm_moe__task_submit(q, &a->t);
}

static int cpu_experts(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                       const int32_t *slot, int n, const tdm_moe_bf16 *wbase,
                       const tdm_moe_group *groups, int G, int H, int I, float *out,
                       void *workspace, size_t workspace_bytes) {
  return cpu_experts_q(st, q, x, rows, slot, n, wbase,
                       (tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, groups, G, H, I, out,
                       workspace, workspace_bytes);
}

/* ---- group: the routing grouped into a table -------------------------------------------- */

typedef struct group_args {
  task t; /* first */
  const int32_t *idx;
  int T, k, E;
  const int64_t *wofs;
  int32_t *rows, *slot;
  tdm_moe_group *groups;
  int32_t next[]; /* [E]: per expert, its count, then where its next entry goes */
} group_args;

/* A counting sort of the T*k choices by expert. Scanning them in ascending t*k + j keeps each
 * expert's entries in that order, as the header promises. */
static int group_body(const task *t) {
  const group_args *a = (const group_args *)t;
  const int n = a->T * a->k, E = a->E;
  int32_t *next = ((group_args *)t)->next; /* the task's own scratch, in its argument block */
  memset(next, 0, (size_t)E * sizeof *next);
  for (int p = 0; p < n; p++)
    if (a->idx[p] >= 0 && a->idx[p] < E) next[a->idx[p]]++;
  int at = 0, ng = 0;
  for (int e = 0; e < E; e++) {
    int count = next[e];
    next[e] = at;
    if (count == 0) continue;
    a->groups[ng++] = (tdm_moe_group){.w = a->wofs[e], .first = at, .count = count};
    at += count;
  }
  for (int p = 0; p < n; p++) {
    int32_t e = a->idx[p];
    if (e < 0 || e >= E) continue; /* dropped */
    int32_t i = next[e]++;
    a->rows[i] = p / a->k;
    a->slot[i] = p;
  }
  /* The rest of the table: empty entries that point past the routed ones. */
  for (int g = ng, G = n < E ? n : E; g < G; g++)
    a->groups[g] = (tdm_moe_group){.w = 0, .first = at, .count = 0};
  return 0;
}

static int cpu_group(void *st, tdm_queue *q, const int32_t *idx, int T, int k, int E,
                     const int64_t *wofs, int32_t *rows, int32_t *slot, tdm_moe_group *groups) {
  int rc = tdm_moe__check_state(st, q, "group");
  if (rc) return rc;
  if (!idx || !wofs || !rows || !slot || !groups || T < 0 || k <= 0 || E <= 0 ||
      (int64_t)T * k > INT32_MAX)
    return tdm_moe__bad_args("group");
  if (T == 0) return 0;
  /* The counters live in the argument block: one allocation per call, as every op here. */
  group_args *a = tdm_moe__task_alloc(sizeof *a + (size_t)E * sizeof a->next[0], "group");
  if (!a) return TDM_ENOMEM;
  *a = (group_args){.t.body = group_body, .idx = idx, .T = T, .k = k, .E = E, .wofs = wofs,
                    .rows = rows, .slot = slot, .groups = groups};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- combine ----------------------------------------------------------------------------- */

typedef struct combine_args {
  task t; /* first */
  float *y;
  const float *out, *weights;
  int T, H, k;
} combine_args;

static int combine_body(const task *t) {
  const combine_args *a = (const combine_args *)t;
  const size_t H = (size_t)a->H, k = (size_t)a->k;
  for (size_t r = 0; r < (size_t)a->T; r++) {
    float *y = a->y + r * H;
    const float *wt = a->weights + r * k;
    for (size_t h = 0; h < H; h++) {
      float s = 0.0f;
      for (size_t j = 0; j < k; j++) s += wt[j] * a->out[(r * k + j) * H + h];
      y[h] += s;
    }
  }
  return 0;
}

static int cpu_combine(void *st, tdm_queue *q, float *y, const float *out, const float *weights,
                       int T, int H, int k) {
  int rc = tdm_moe__check_state(st, q, "combine");
  if (rc) return rc;
  if (!y || !out || !weights || T < 0 || H <= 0 || k <= 0) return tdm_moe__bad_args("combine");
  if (T == 0) return 0;
  combine_args *a = tdm_moe__task_alloc(sizeof *a, "combine");
  if (!a) return TDM_ENOMEM;
  *a = (combine_args){.t.body = combine_body, .y = y, .out = out, .weights = weights, .T = T,
                      .H = H, .k = k};
  return tdm_moe__task_submit(q, &a->t);
}

static int cpu_host_call(void *st, tdm_queue *q, void (*fn)(void *), void *arg) {
  int rc = tdm_moe__check_state(st, q, "host_call");
  return rc ? rc : tdm_moe__host_call_task(q, fn, arg);
}

const tdm_moe_ops tdm_moe__cpu_ops = {
    .name = "cpu",
    .open = cpu_open,
    .close = cpu_close,
    .rmsnorm = cpu_rmsnorm,
    .router = cpu_router,
    .expert = cpu_expert,
    .experts = cpu_experts,
    .expert_q = cpu_expert_q,
    .experts_q = cpu_experts_q,
    .group = cpu_group,
    .combine = cpu_combine,
    .get_rows = tdm_moe__cpu_get_rows,
    .matmul = tdm_moe__cpu_matmul,
    .get_rows_h = tdm_moe__cpu_get_rows_h,
    .matmul_h = tdm_moe__cpu_matmul_h,
    .matmul_q = tdm_moe__cpu_matmul_q,
    .rope = tdm_moe__cpu_rope,
    .attention = tdm_moe__cpu_attention,
    .attn_prep_at = tdm_moe__cpu_attn_prep_at,
    .attention_at = tdm_moe__cpu_attention_at,
    .host_call = cpu_host_call,
};
