/* expert.c: `bench-cuda expert`: what one MoE expert costs the thread that submits it, with the
 * CUDA backend's expert operation (tandem/moe_ops.h: gather, gate/up GEMM, SwiGLU, down GEMM,
 * scatter on the queue's stream), at Qwen3-30B-A3B's shapes (hidden 2048, expert FFN 768, bf16
 * weights, f32 accumulate) and n gathered tokens per expert (128 and 512: a 2048- and an
 * 8192-token ubatch over 128 experts, top-8).
 *
 * Figures, host microseconds per call (median over reps of CALLS calls back to back):
 *   op, n fixed       every call has n tokens
 *   op, n varies      n uniform in [n/2, 3n/2] (as routing gives, so cuBLAS sees many shapes)
 *   op, copies busy   n fixed, while another tandem queue copies 64 MiB pieces host->device
 *   gemm pair         the two cublasGemmEx calls alone (same shapes, a raw stream and handle),
 *                     n fixed and n varying: the part of the op that is cuBLAS's host work
 * and the device time per op with n fixed (CUDA events around CALLS ops that the host queued
 * behind a long copy, so none waits for the host).
 * A diagnostic, with no goal and no side-by-side ratio: there is no raw program that does the
 * same gather/SwiGLU/scatter without writing its kernels. Checked: the op's output for a few
 * tokens against an fp64 reference on the host (relative error of the row under 1e-2).
 */
#include "bcuda.h"

#include "measure.h"
#include <tandem/moe_ops.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define HID 2048
#define FFN 768
#define CALLS 64
#define GATE_BYTES (256 * MIB) /* the copy the device-time batch is queued behind (~5 ms) */
#define BUSY_BYTES (64 * MIB)
#define BUSY_COPIES 16 /* ~20 ms of copies: longer than CALLS ops take to submit */

typedef struct ex {
  bc_ctx *c;
  int n;                  /* tokens per expert, nominal */
  int ns_fixed[CALLS], ns_vary[CALLS];
  const tdm_moe_ops *ops;
  void *st;
  tdm_queue *q, *cq;      /* compute, and the busy copy queue */
  cudaStream_t s;         /* q's native stream */
  float *x, *out;         /* device: [T x HID], [T x HID] */
  uint16_t *w;            /* device: one expert */
  int32_t *rows, *slots;  /* device: [T] */
  void *ws;
  size_t ws_bytes;
  unsigned char *gate_src, *gate_dst, *busy_src, *busy_dst; /* pinned / device */
  /* the raw GEMM pair */
  cudaStream_t rs;
  cublasHandle_t blas;
  void *blas_ws;
  uint16_t *X;            /* native device bf16 [T x HID] (the inputs' values do not matter) */
  float *GU, *O;          /* native device f32 [T x 2 FFN], [T x HID] */
  /* host copies for the check */
  float *hx;
  uint16_t *hw;
  int32_t *hrows;
  int T;
} ex;

static int T_for(int n) { return 2 * n; } /* tokens in x: rows are drawn from them */

/* ---- the timed batches ---------------------------------------------------------------------- */

static int op_batch(ex *e, const int *ns, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (int i = 0; i < CALLS; i++)
    CK_TDM(e->ops->expert(e->st, e->q, e->x, e->rows, e->slots, ns[i], e->w, HID, FFN, e->out,
                          e->ws, e->ws_bytes));
  *sec = bu_seconds() - t0;
  CK_TDM(tdm_queue_sync(e->q));
  rc = 0;
out:
  return rc;
}

static int op_busy_batch(ex *e, double *sec) {
  int rc = -1;
  for (int i = 0; i < BUSY_COPIES; i++)
    CK_TDM(tdm_memcpy(e->cq, e->busy_dst, e->busy_src, BUSY_BYTES, TDM_COPY_H2D, 0, NULL, NULL));
  if (op_batch(e, e->ns_fixed, sec) < 0)
    goto out;
  CK_TDM(tdm_queue_sync(e->cq));
  rc = 0;
out:
  return rc;
}

/* C = A W^T row-major through column-major cuBLAS, as the op does it (see moe/cuda/ops.cu). */
static int gemm_pair(ex *e, const int *ns, double *sec) {
  int rc = -1;
  const float one = 1.f, zero = 0.f;
  const uint16_t *wgu = bc_native(e->w), *wd = wgu ? wgu + 2 * (size_t)FFN * HID : NULL;
  CK(wgu, "no native pointer for the expert");
  double t0 = bu_seconds();
  for (int i = 0; i < CALLS; i++) {
    CK_BLAS(cublasGemmEx(e->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * FFN, ns[i], HID, &one, wgu,
                         CUDA_R_16BF, HID, e->X, CUDA_R_16BF, HID, &zero, e->GU, CUDA_R_32F,
                         2 * FFN, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK_BLAS(cublasGemmEx(e->blas, CUBLAS_OP_T, CUBLAS_OP_N, HID, ns[i], FFN, &one, wd,
                         CUDA_R_16BF, FFN, e->GU, CUDA_R_16BF, 4 * FFN, &zero, e->O, CUDA_R_32F,
                         HID, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  *sec = bu_seconds() - t0;
  CK_CUDA(cudaStreamSynchronize(e->rs));
  rc = 0;
out:
  return rc;
}

/* Device microseconds per op: CALLS ops queued behind a long copy on the same queue, timed by
 * CUDA events on its stream (user work on tandem's native stream is ordered with its own). */
static int device_time(ex *e, double *us) {
  int rc = -1;
  cudaEvent_t a = NULL, b = NULL;
  CK_CUDA(cudaEventCreate(&a));
  CK_CUDA(cudaEventCreate(&b));
  CK_TDM(tdm_memcpy(e->q, e->gate_dst, e->gate_src, GATE_BYTES, TDM_COPY_H2D, 0, NULL, NULL));
  CK_CUDA(cudaEventRecord(a, e->s));
  for (int i = 0; i < CALLS; i++)
    CK_TDM(e->ops->expert(e->st, e->q, e->x, e->rows, e->slots, e->n, e->w, HID, FFN, e->out,
                          e->ws, e->ws_bytes));
  CK_CUDA(cudaEventRecord(b, e->s));
  CK_TDM(tdm_queue_sync(e->q));
  float ms;
  CK_CUDA(cudaEventElapsedTime(&ms, a, b));
  *us = (double)ms * 1e3 / CALLS;
  rc = 0;
out:
  if (a)
    CUDA_CALL(cudaEventDestroy(a));
  if (b)
    CUDA_CALL(cudaEventDestroy(b));
  return rc;
}

/* ---- the check ------------------------------------------------------------------------------ */

static double rounded_bf16(float f) { return (double)tdm_moe_bf16_to_f32(tdm_moe_f32_to_bf16(f)); }

/* Token i of the gathered set: out[i] (slot i) against fp64 on the host, with the inputs
 * rounded to bf16 as the op rounds them. */
static int check_rows(ex *e) {
  int rc = -1;
  const int picks[] = {0, 1, e->n / 2, e->n - 1};
  float *got = malloc(HID * sizeof *got);
  double *gu = malloc(2 * FFN * sizeof *gu), *ref = malloc(HID * sizeof *ref);
  CK(got && gu && ref, "out of host memory");
  CK_TDM(e->ops->expert(e->st, e->q, e->x, e->rows, e->slots, e->n, e->w, HID, FFN, e->out, e->ws,
                        e->ws_bytes));
  for (size_t p = 0; p < sizeof picks / sizeof *picks; p++) {
    int i = picks[p];
    CK_TDM(tdm_memcpy(e->q, got, e->out + (size_t)i * HID, HID * sizeof *got, TDM_COPY_D2H, 0,
                      NULL, NULL));
    CK_TDM(tdm_queue_sync(e->q));
    const float *xr = e->hx + (size_t)e->hrows[i] * HID;
    for (int j = 0; j < 2 * FFN; j++) {
      double acc = 0;
      for (int k = 0; k < HID; k++)
        acc += rounded_bf16(xr[k]) * tdm_moe_bf16_to_f32(e->hw[(size_t)j * HID + k]);
      gu[j] = acc;
    }
    for (int j = 0; j < FFN; j++)
      gu[j] = gu[j] / (1.0 + exp(-gu[j])) * gu[FFN + j];
    double num = 0, den = 0;
    for (int c = 0; c < HID; c++) {
      const uint16_t *wd = e->hw + 2 * (size_t)FFN * HID + (size_t)c * FFN;
      double acc = 0;
      for (int j = 0; j < FFN; j++)
        acc += gu[j] * tdm_moe_bf16_to_f32(wd[j]);
      num += (got[c] - acc) * (got[c] - acc);
      den += acc * acc;
      ref[c] = acc;
    }
    double rel = sqrt(num / (den > 0 ? den : 1));
    CK(rel < 1e-2 && den > 0, "check failed: expert op, n %d, token %d: relative error %.3g "
       "(got[0] %g, reference %g)", e->n, i, rel, got[0], ref[0]);
  }
  rc = 0;
out:
  free(got);
  free(gu);
  free(ref);
  return rc;
}

/* ---- setup and teardown --------------------------------------------------------------------- */

/* Uniform in (-1, 1). */
static double unit(bc_ctx *c) { return (double)(bc_next_seed(c) >> 11) * 0x1.0p-52 - 1.0; }

static int setup(ex *e) {
  int rc = -1;
  tdm_device *dev = e->c->dev;
  bc_ctx *c = e->c;
  size_t wn = 3 * (size_t)HID * FFN, xn;
  int nmax = e->n + e->n / 2;
  e->T = T_for(e->n);
  xn = (size_t)e->T * HID;
  for (int i = 0; i < CALLS; i++) {
    e->ns_fixed[i] = e->n;
    e->ns_vary[i] = e->n / 2 + (int)(bc_next_seed(c) % (uint64_t)(e->n + 1));
  }
  CK(e->ops = tdm_moe_ops_for(dev), "no MoE operations for %s", e->c->info.id);
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &e->q));
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &e->cq));
  CK_TDM(e->ops->open(e->q, &e->st));
  void *native;
  CK_TDM(tdm_queue_native(e->q, &native));
  e->s = (cudaStream_t)native;
  e->ws_bytes = tdm_moe_ops_workspace(nmax, HID, FFN);
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, xn * sizeof(float), (void **)&e->x));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)nmax * HID * sizeof(float), (void **)&e->out));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, wn * sizeof(uint16_t), (void **)&e->w));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)nmax * sizeof(int32_t), (void **)&e->rows));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)nmax * sizeof(int32_t), (void **)&e->slots));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, e->ws_bytes, &e->ws));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, GATE_BYTES, (void **)&e->gate_src));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, GATE_BYTES, (void **)&e->gate_dst));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, BUSY_BYTES, (void **)&e->busy_src));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, BUSY_BYTES, (void **)&e->busy_dst));
  bc_fill_random(e->gate_src, GATE_BYTES, bc_next_seed(c));
  bc_fill_random(e->busy_src, BUSY_BYTES, bc_next_seed(c));

  /* Random inputs: x uniform in (-1, 1), the expert's weights bf16 of magnitude ~1/sqrt(K). */
  e->hx = malloc(xn * sizeof *e->hx);
  e->hw = malloc(wn * sizeof *e->hw);
  e->hrows = malloc((size_t)nmax * sizeof *e->hrows);
  int32_t *slots = malloc((size_t)nmax * sizeof *slots);
  CK(e->hx && e->hw && e->hrows && slots, "out of host memory");
  for (size_t i = 0; i < xn; i++)
    e->hx[i] = (float)unit(c);
  for (size_t i = 0; i < wn; i++) {
    double scale = i < 2 * (size_t)HID * FFN ? 1.0 / sqrt(HID) : 1.0 / sqrt(FFN);
    e->hw[i] = tdm_moe_f32_to_bf16((float)(scale * unit(c)));
  }
  for (int i = 0; i < nmax; i++) {
    e->hrows[i] = (int32_t)(bc_next_seed(c) % (uint64_t)e->T);
    slots[i] = i;
  }
  rc = bc_upload(e->c, e->q, e->x, e->hx, xn * sizeof *e->hx);
  if (!rc)
    rc = bc_upload(e->c, e->q, e->w, e->hw, wn * sizeof *e->hw);
  if (!rc)
    rc = bc_upload(e->c, e->q, e->rows, e->hrows, (size_t)nmax * sizeof *e->hrows);
  if (!rc)
    rc = bc_upload(e->c, e->q, e->slots, slots, (size_t)nmax * sizeof *slots);
  free(slots);
  if (rc)
    goto out;
  rc = -1;

  CK_CUDA(cudaStreamCreateWithFlags(&e->rs, cudaStreamNonBlocking));
  CK_CUDA(cudaMalloc(&e->blas_ws, 32 * MIB));
  CK_CUDA(cudaMalloc((void **)&e->X, (size_t)nmax * HID * sizeof(uint16_t)));
  CK_CUDA(cudaMalloc((void **)&e->GU, (size_t)nmax * 2 * FFN * sizeof(float)));
  CK_CUDA(cudaMalloc((void **)&e->O, (size_t)nmax * HID * sizeof(float)));
  CK_CUDA(cudaMemset(e->X, 0x3c, (size_t)nmax * HID * sizeof(uint16_t))); /* finite bf16 */
  CK_CUDA(cudaMemset(e->GU, 0x3c, (size_t)nmax * 2 * FFN * sizeof(float)));
  CK_BLAS(cublasCreate(&e->blas));
  CK_BLAS(cublasSetStream(e->blas, e->rs));
  CK_BLAS(cublasSetWorkspace(e->blas, e->blas_ws, 32 * MIB));
  CK_BLAS(cublasSetAtomicsMode(e->blas, CUBLAS_ATOMICS_NOT_ALLOWED));
  rc = 0;
out:
  return rc;
}

static void teardown(ex *e) {
  if (e->st)
    e->ops->close(e->st);
  if (e->q)
    TDM_CALL(tdm_queue_sync(e->q));
  void *mem[] = {e->x, e->out, e->w, e->rows, e->slots, e->ws,
                 e->gate_src, e->gate_dst, e->busy_src, e->busy_dst};
  for (size_t i = 0; i < sizeof mem / sizeof *mem; i++)
    if (mem[i])
      TDM_CALL(tdm_free(mem[i]));
  if (e->q)
    TDM_CALL(tdm_queue_destroy(e->q));
  if (e->cq)
    TDM_CALL(tdm_queue_destroy(e->cq));
  if (e->blas)
    BLAS_CALL(cublasDestroy(e->blas));
  if (e->rs)
    CUDA_CALL(cudaStreamDestroy(e->rs));
  void *raw[] = {e->blas_ws, e->X, e->GU, e->O};
  for (size_t i = 0; i < sizeof raw / sizeof *raw; i++)
    if (raw[i])
      CUDA_CALL(cudaFree(raw[i]));
  free(e->hx);
  free(e->hw);
  free(e->hrows);
}

/* ---- the figures ---------------------------------------------------------------------------- */

enum { OP_FIXED, OP_VARY, OP_BUSY, GEMM_FIXED, GEMM_VARY, NFIG };

static const struct {
  const char *key, *label;
} figures[NFIG] = {
    {"op_fixed_us", "expert op, n fixed"},
    {"op_varying_us", "expert op, n varies"},
    {"op_copies_busy_us", "expert op, n fixed, copies in flight"},
    {"gemm_pair_fixed_us", "2 x cublasGemmEx alone, n fixed"},
    {"gemm_pair_varying_us", "2 x cublasGemmEx alone, n varies"},
};

static int one(ex *e, int fig, double *sec) {
  switch (fig) {
  case OP_FIXED: return op_batch(e, e->ns_fixed, sec);
  case OP_VARY: return op_batch(e, e->ns_vary, sec);
  case OP_BUSY: return op_busy_batch(e, sec);
  case GEMM_FIXED: return gemm_pair(e, e->ns_fixed, sec);
  default: return gemm_pair(e, e->ns_vary, sec);
  }
}

/* Median host microseconds per call of figure fig, after one untimed batch. */
static int measure(ex *e, int fig, double *us) {
  long reps = e->c->opt->reps;
  double *t = calloc((size_t)reps, sizeof *t), warm;
  int rc = -1;
  CK(t, "out of host memory");
  if (one(e, fig, &warm) < 0)
    goto out;
  for (long r = 0; r < reps; r++)
    if (one(e, fig, &t[r]) < 0)
      goto out;
  *us = bu_median(t, (size_t)reps) / CALLS * 1e6;
  rc = 0;
out:
  free(t);
  return rc;
}

static int run_n(bc_ctx *c, int n, bu_json *json) {
  ex e = {.c = c, .n = n};
  double us[NFIG], dev_us = 0;
  int rc = -1;
  if (setup(&e) < 0 || check_rows(&e) < 0)
    goto out;
  for (int f = 0; f < NFIG; f++)
    if (measure(&e, f, &us[f]) < 0)
      goto out;
  if (device_time(&e, &dev_us) < 0)
    goto out;
  printf("  n = %d tokens per expert\n", n);
  for (int f = 0; f < NFIG; f++)
    printf("    %-40s %8.2f us host\n", figures[f].label, us[f]);
  printf("    %-40s %8.2f us device\n", "expert op, n fixed", dev_us);
  bu_json_object(json, NULL);
  bu_json_int(json, "tokens_per_expert", n);
  for (int f = 0; f < NFIG; f++)
    bu_json_double(json, figures[f].key, us[f], 3);
  bu_json_double(json, "op_device_us", dev_us, 3);
  bu_json_end(json);
  fflush(stdout);
  rc = 0;
out:
  teardown(&e);
  return rc;
}

int bench_expert(bc_ctx *c, bu_json *json) {
  static const int ns[] = {128, 512};
  int rc = -1;
  printf("\nexpert: host cost of one MoE expert (hidden %d, FFN %d, bf16), median of %ld reps x "
         "%d calls\n", HID, FFN, c->opt->reps, CALLS);
  bu_json_object(json, NULL);
  bu_json_int(json, "hidden", HID);
  bu_json_int(json, "ffn", FFN);
  bu_json_int(json, "calls", CALLS);
  bu_json_int(json, "reps", c->opt->reps);
  bu_json_string(json, "unit", "microseconds per call, median over reps");
  bu_json_array(json, "results");
  for (size_t i = 0; i < sizeof ns / sizeof *ns; i++)
    if (run_n(c, ns[i], json) < 0)
      goto out;
  rc = 0;
out:
  bu_json_end(json);
  bu_json_end(json);
  return rc;
}
