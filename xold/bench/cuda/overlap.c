/* overlap.c: `bench-cuda overlap`: MoE experts streamed to the device on a copy queue while a
 * compute queue runs cuBLAS bf16 GEMMs on the experts already landed, through tandem and through
 * a hand-written two-stream CUDA program, in the same run.
 *
 * An expert is 3 bf16 matrices of 2048x768 (9.4 MB: gate and up 2048->768, down 768->2048, the
 * shape of Qwen3-30B-A3B's experts). --experts of them (64) sit in pinned host memory and go
 * round-robin through 4 device slots. Per expert: copy it into its slot on the copy queue; the
 * compute queue waits for that copy device-side and runs three GEMMs (cublasGemmEx, bf16 in and
 * out, CUBLAS_COMPUTE_32F) for T tokens: G = X Wg, U = X Wu, Y = U Wd; then records an event. A
 * slot is overwritten only after the compute that read it completed: the copy queue waits on
 * that compute's event. Serialized runs make each copy also wait for the previous compute.
 *   tandem: two tandem queues; tdm_memcpy, tdm_queue_wait, tdm_event_record; cuBLAS bound to
 *           the compute queue's native stream (tdm_queue_native + cublasSetStream)
 *   raw:    two non-blocking streams, cudaMemcpyAsync, cudaEventRecord, cudaStreamWaitEvent
 * Timed per pass (all experts, host clock to the sync): copy alone, compute alone, serialized,
 * overlapped, for both sides, rotating order rep by rep. T is calibrated first (raw copy pass
 * against raw compute pass, T scaled until they are within 5%) unless --tokens is given.
 * Reported: each time, the hidden fraction (serialized - overlapped) / min(copy, compute) (goal
 * >= 0.9; it can exceed 1, since a serialized pass also pays every copy-to-compute hand-off),
 * the efficiency max(copy, compute) / overlapped, and tandem's overlapped time over raw's.
 * Check: before timing, each side runs a serialized and an overlapped pass with its slots
 * cleared and the gate outputs poisoned (NaN); then the gate GEMM output of every expert, for
 * 4 tokens (first, last, two inside), is compared with an fp64 CPU reference computed from the
 * host copy of that expert: ||got - ref|| / ||ref|| < 1e-2. A compute that ran before its copy
 * landed would have read another expert's weights (or zeros) and fails it.
 */
#include "bcuda.h"

#include "measure.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define HIDDEN 2048
#define INTER 768
#define MAT_ELEMS ((size_t)HIDDEN * INTER)
#define EXPERT_BYTES (3 * MAT_ELEMS * sizeof(uint16_t)) /* 9,437,184 */
#define NSLOT 4
#define TMIN 64
#define TMAX 32768
#define CHECK_TOKENS 4
#define TOLERANCE 1e-2
#define GOAL_HIDDEN 0.9
#define MAX_CAL 8

enum mode { COPY, COMPUTE, SERIAL, OVERLAP, NMODE };
static const char *const mode_key[NMODE] = {"copy", "compute", "serialized", "overlapped"};

typedef struct side {
  const char *name;
  int tandem;
  unsigned char *host;  /* experts in pinned host memory, experts * EXPERT_BYTES */
  unsigned char *slots; /* NSLOT * EXPERT_BYTES of device memory (a tandem pointer, tandem side) */
  unsigned char *slots_native;
  cublasHandle_t blas; /* bound to the compute stream */
  tdm_queue *qc, *qk;  /* tandem: copy and compute queues */
  cudaStream_t sc, sk; /* raw: copy and compute streams */
  cudaEvent_t landed[NSLOT], done[NSLOT];
} side;

typedef struct ovl {
  bc_ctx *c;
  long ne;
  int tokens;
  uint16_t *x;      /* device, TMAX x HIDDEN row-major: the tokens' activations */
  uint16_t *u, *y;  /* device scratch: TMAX x INTER, TMAX x HIDDEN */
  uint16_t *g;      /* device, ne x tokens x INTER: each expert's gate output; NULL: into u */
  uint16_t *x_host; /* host copy of x */
  uint16_t *g_host; /* pinned: ne x CHECK_TOKENS x INTER read back */
  double *ref;      /* ne x CHECK_TOKENS x INTER */
  cudaStream_t check;
  side s[2]; /* tandem, raw */
} ovl;

/* The tokens checked: the first, the last and two in between. */
static int check_token(int tokens, int j) {
  return j == 0 ? 0 : j == CHECK_TOKENS - 1 ? tokens - 1 : (int)((long)tokens * j / CHECK_TOKENS);
}

/* The three GEMMs of expert e, whose weights are at `slot` (native device pointer), on the
 * stream the side's cuBLAS handle is bound to. Row-major W (K x N) is column-major W^T, so
 * row-major C = A W is column-major C^T = W^T A^T: cuBLAS m = N, n = tokens, k = K. */
static int gemms(ovl *o, side *sd, const unsigned char *slot, long e) {
  const uint16_t *wg = (const uint16_t *)slot, *wu = wg + MAT_ELEMS, *wd = wu + MAT_ELEMS;
  uint16_t *g = o->g ? o->g + (size_t)e * (size_t)o->tokens * INTER : o->u;
  const float one = 1.0f, zero = 0.0f;
  int rc = -1, t = o->tokens;
  CK_BLAS(cublasGemmEx(sd->blas, CUBLAS_OP_N, CUBLAS_OP_N, INTER, t, HIDDEN, &one, wg, CUDA_R_16BF,
                       INTER, o->x, CUDA_R_16BF, HIDDEN, &zero, g, CUDA_R_16BF, INTER,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  CK_BLAS(cublasGemmEx(sd->blas, CUBLAS_OP_N, CUBLAS_OP_N, INTER, t, HIDDEN, &one, wu, CUDA_R_16BF,
                       INTER, o->x, CUDA_R_16BF, HIDDEN, &zero, o->u, CUDA_R_16BF, INTER,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  CK_BLAS(cublasGemmEx(sd->blas, CUBLAS_OP_N, CUBLAS_OP_N, HIDDEN, t, INTER, &one, wd, CUDA_R_16BF,
                       HIDDEN, o->u, CUDA_R_16BF, INTER, &zero, o->y, CUDA_R_16BF, HIDDEN,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  rc = 0;
out:
  return rc;
}

/* ---- one pass over all experts, per side ---------------------------------------------------- */

static int tandem_pass(ovl *o, side *sd, int mode, double *sec) {
  tdm_event *done[NSLOT] = {NULL}, *landed = NULL, *prev = NULL;
  int rc = -1;
  double t0 = bu_seconds();
  for (long e = 0; e < o->ne; e++) {
    int s = (int)(e % NSLOT);
    if (mode != COMPUTE) {
      /* Overlapped: the slot's last reader must be done; serialized: the previous compute. */
      tdm_event *gate = mode == SERIAL ? prev : mode == OVERLAP ? done[s] : NULL;
      if (gate)
        CK_TDM(tdm_queue_wait(sd->qc, gate));
      CK_TDM(tdm_memcpy(sd->qc, sd->slots + (size_t)s * EXPERT_BYTES,
                        sd->host + (size_t)e * EXPERT_BYTES, EXPERT_BYTES, TDM_COPY_H2D, 0, NULL,
                        mode == COPY ? NULL : &landed));
    }
    if (mode == COPY)
      continue;
    if (landed) {
      CK_TDM(tdm_queue_wait(sd->qk, landed));
      CK_TDM(tdm_event_release(landed));
      landed = NULL;
    }
    if (gemms(o, sd, sd->slots_native + (size_t)s * EXPERT_BYTES, e) < 0)
      goto out;
    if (mode != COMPUTE) {
      if (done[s]) {
        tdm_event *old = done[s];
        done[s] = NULL;
        CK_TDM(tdm_event_release(old));
      }
      CK_TDM(tdm_event_record(sd->qk, &done[s]));
      prev = done[s];
    }
  }
  CK_TDM(tdm_queue_sync(sd->qk));
  CK_TDM(tdm_queue_sync(sd->qc));
  *sec = bu_seconds() - t0;
  rc = 0;
out:
  if (landed)
    TDM_CALL(tdm_event_release(landed));
  for (int s = 0; s < NSLOT; s++)
    if (done[s])
      TDM_CALL(tdm_event_release(done[s]));
  return rc;
}

static int raw_pass(ovl *o, side *sd, int mode, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (long e = 0; e < o->ne; e++) {
    int s = (int)(e % NSLOT);
    unsigned char *slot = sd->slots + (size_t)s * EXPERT_BYTES;
    if (mode != COMPUTE) {
      if (mode == OVERLAP && e >= NSLOT)
        CK_CUDA(cudaStreamWaitEvent(sd->sc, sd->done[s], 0));
      if (mode == SERIAL && e >= 1)
        CK_CUDA(cudaStreamWaitEvent(sd->sc, sd->done[(e - 1) % NSLOT], 0));
      CK_CUDA(cudaMemcpyAsync(slot, sd->host + (size_t)e * EXPERT_BYTES, EXPERT_BYTES,
                              cudaMemcpyHostToDevice, sd->sc));
      if (mode != COPY) {
        CK_CUDA(cudaEventRecord(sd->landed[s], sd->sc));
        CK_CUDA(cudaStreamWaitEvent(sd->sk, sd->landed[s], 0));
      }
    }
    if (mode == COPY)
      continue;
    if (gemms(o, sd, slot, e) < 0)
      goto out;
    if (mode != COMPUTE)
      CK_CUDA(cudaEventRecord(sd->done[s], sd->sk));
  }
  CK_CUDA(cudaStreamSynchronize(sd->sk));
  CK_CUDA(cudaStreamSynchronize(sd->sc));
  *sec = bu_seconds() - t0;
  rc = 0;
out:
  return rc;
}

static int pass(ovl *o, side *sd, int mode, double *sec) {
  return sd->tandem ? tandem_pass(o, sd, mode, sec) : raw_pass(o, sd, mode, sec);
}

static int median_pass(ovl *o, side *sd, int mode, int reps, double *sec) {
  double t[9];
  for (int i = 0; i < reps && i < 9; i++)
    if (pass(o, sd, mode, &t[i]) < 0)
      return -1;
  *sec = bu_median(t, (size_t)(reps < 9 ? reps : 9));
  return 0;
}

/* ---- calibration and checks --------------------------------------------------------------- */

typedef struct cal_step {
  int tokens;
  double copy, compute; /* seconds per pass */
} cal_step;

/* Picks o->tokens so that the raw compute pass takes about as long as the raw copy pass. */
static int calibrate(ovl *o, cal_step *steps, int *nsteps) {
  side *raw = &o->s[1];
  double copy, compute;
  int rc = -1;
  *nsteps = 0;
  if (pass(o, raw, COPY, &copy) < 0 || median_pass(o, raw, COPY, 3, &copy) < 0)
    goto out;
  o->tokens = o->c->opt->tokens ? (int)o->c->opt->tokens : 4096;
  for (int i = 0; i < MAX_CAL; i++) {
    if (pass(o, raw, COMPUTE, &compute) < 0 || median_pass(o, raw, COMPUTE, 3, &compute) < 0)
      goto out;
    steps[(*nsteps)++] = (cal_step){o->tokens, copy, compute};
    if (o->c->opt->tokens || fabs(compute / copy - 1.0) < 0.05)
      break;
    long next = lround((double)o->tokens * copy / compute / TMIN) * TMIN;
    next = next < TMIN ? TMIN : next > TMAX ? TMAX : next;
    if (next == o->tokens)
      break;
    o->tokens = (int)next;
  }
  rc = 0;
out:
  return rc;
}

/* The gate output of every expert for the checked tokens, in fp64 from the host copies. */
static void reference(ovl *o) {
  const side *sd = &o->s[0];
  for (long e = 0; e < o->ne; e++) {
    const uint16_t *wg = (const uint16_t *)(sd->host + (size_t)e * EXPERT_BYTES);
    for (int j = 0; j < CHECK_TOKENS; j++) {
      const uint16_t *x = o->x_host + (size_t)check_token(o->tokens, j) * HIDDEN;
      double *r = o->ref + ((size_t)e * CHECK_TOKENS + (size_t)j) * INTER;
      for (int n = 0; n < INTER; n++)
        r[n] = 0.0;
      for (int k = 0; k < HIDDEN; k++) {
        double xk = bc_bf16_to_double(x[k]);
        const uint16_t *w = wg + (size_t)k * INTER;
        for (int n = 0; n < INTER; n++)
          r[n] += xk * bc_bf16_to_double(w[n]);
      }
    }
  }
}

/* Runs one pass of `mode` with the slots cleared and the gate outputs poisoned, then compares
 * the checked outputs with the reference; *max_err gets the worst expert's relative error. */
static int verify(ovl *o, side *sd, int mode, double *max_err) {
  double unused;
  int rc = -1;
  size_t gbytes = (size_t)o->ne * (size_t)o->tokens * INTER * sizeof(uint16_t);
  CK_CUDA(cudaMemsetAsync(o->g, 0xff, gbytes, o->check)); /* bf16 0xffff is a NaN */
  CK_CUDA(cudaMemsetAsync(sd->slots_native, 0, NSLOT * EXPERT_BYTES, o->check));
  CK_CUDA(cudaStreamSynchronize(o->check));
  if (pass(o, sd, mode, &unused) < 0)
    goto out;
  for (long e = 0; e < o->ne; e++)
    for (int j = 0; j < CHECK_TOKENS; j++) {
      size_t at = (size_t)e * (size_t)o->tokens + (size_t)check_token(o->tokens, j);
      CK_CUDA(cudaMemcpyAsync(o->g_host + ((size_t)e * CHECK_TOKENS + (size_t)j) * INTER,
                              o->g + at * INTER, INTER * sizeof(uint16_t), cudaMemcpyDeviceToHost,
                              o->check));
    }
  CK_CUDA(cudaStreamSynchronize(o->check));
  double worst = 0.0;
  long worst_e = 0;
  for (long e = 0; e < o->ne; e++) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < (size_t)CHECK_TOKENS * INTER; i++) {
      size_t at = (size_t)e * CHECK_TOKENS * INTER + i;
      double d = bc_bf16_to_double(o->g_host[at]) - o->ref[at];
      num += d * d;
      den += o->ref[at] * o->ref[at];
    }
    double err = sqrt(num / den);
    if (!(err <= worst)) { /* NaN sticks */
      worst = err;
      worst_e = e;
    }
  }
  if (!(worst <= *max_err))
    *max_err = worst;
  CK(worst < TOLERANCE,
     "check failed: %s %s pass: expert %ld's gate GEMM output is off the fp64 reference by "
     "%.3g (relative, tolerance %.0e)",
     sd->name, mode_key[mode], worst_e, worst, TOLERANCE);
  rc = 0;
out:
  return rc;
}

/* ---- setup and teardown --------------------------------------------------------------------- */

static int setup_side(ovl *o, side *sd) {
  int rc = -1;
  size_t host_bytes = (size_t)o->ne * EXPERT_BYTES;
  if (sd->tandem) {
    void *native;
    CK_TDM(tdm_queue_create(o->c->dev, TDM_QUEUE_IN_ORDER, &sd->qc));
    CK_TDM(tdm_queue_create(o->c->dev, TDM_QUEUE_IN_ORDER, &sd->qk));
    CK_TDM(tdm_malloc(o->c->dev, TDM_MEM_PINNED, host_bytes, (void **)&sd->host));
    CK_TDM(tdm_malloc(o->c->dev, TDM_MEM_DEVICE, NSLOT * EXPERT_BYTES, (void **)&sd->slots));
    CK(sd->slots_native = bc_native(sd->slots), "no native pointer for tandem device memory");
    CK_TDM(tdm_queue_native(sd->qk, &native));
    CK_BLAS(cublasCreate(&sd->blas));
    CK_BLAS(cublasSetStream(sd->blas, (cudaStream_t)native));
  } else {
    CK_CUDA(cudaStreamCreateWithFlags(&sd->sc, cudaStreamNonBlocking));
    CK_CUDA(cudaStreamCreateWithFlags(&sd->sk, cudaStreamNonBlocking));
    for (int s = 0; s < NSLOT; s++) {
      CK_CUDA(cudaEventCreateWithFlags(&sd->landed[s], cudaEventDisableTiming));
      CK_CUDA(cudaEventCreateWithFlags(&sd->done[s], cudaEventDisableTiming));
    }
    CK_CUDA(cudaHostAlloc((void **)&sd->host, host_bytes, cudaHostAllocDefault));
    CK_CUDA(cudaMalloc((void **)&sd->slots, NSLOT * EXPERT_BYTES));
    sd->slots_native = sd->slots;
    CK_BLAS(cublasCreate(&sd->blas));
    CK_BLAS(cublasSetStream(sd->blas, sd->sk));
  }
  rc = 0;
out:
  return rc;
}

static int setup(ovl *o) {
  int rc = -1;
  o->s[0] = (side){.name = "tandem", .tandem = 1};
  o->s[1] = (side){.name = "raw", .tandem = 0};
  if (setup_side(o, &o->s[0]) < 0 || setup_side(o, &o->s[1]) < 0)
    goto out;
  CK_CUDA(cudaStreamCreateWithFlags(&o->check, cudaStreamNonBlocking));
  CK_CUDA(cudaMalloc((void **)&o->x, (size_t)TMAX * HIDDEN * sizeof(uint16_t)));
  CK_CUDA(cudaMalloc((void **)&o->u, (size_t)TMAX * INTER * sizeof(uint16_t)));
  CK_CUDA(cudaMalloc((void **)&o->y, (size_t)TMAX * HIDDEN * sizeof(uint16_t)));
  CK_CUDA(cudaHostAlloc((void **)&o->g_host,
                        (size_t)o->ne * CHECK_TOKENS * INTER * sizeof(uint16_t),
                        cudaHostAllocDefault));
  CK((o->x_host = malloc((size_t)TMAX * HIDDEN * sizeof(uint16_t))) &&
         (o->ref = malloc((size_t)o->ne * CHECK_TOKENS * INTER * sizeof(double))),
     "out of host memory");
  bc_fill_bf16(o->x_host, (size_t)TMAX * HIDDEN, bc_next_seed(o->c));
  bc_fill_bf16((uint16_t *)o->s[0].host, (size_t)o->ne * EXPERT_BYTES / sizeof(uint16_t),
               bc_next_seed(o->c));
  memcpy(o->s[1].host, o->s[0].host, (size_t)o->ne * EXPERT_BYTES);
  CK_CUDA(cudaMemcpyAsync(o->x, o->x_host, (size_t)TMAX * HIDDEN * sizeof(uint16_t),
                          cudaMemcpyHostToDevice, o->check));
  CK_CUDA(cudaStreamSynchronize(o->check));
  rc = 0;
out:
  return rc;
}

static void teardown(ovl *o) {
  for (int i = 0; i < 2; i++) {
    side *sd = &o->s[i];
    if (sd->blas)
      BLAS_CALL(cublasDestroy(sd->blas));
    if (sd->qc)
      TDM_CALL(tdm_queue_destroy(sd->qc));
    if (sd->qk)
      TDM_CALL(tdm_queue_destroy(sd->qk));
    if (sd->tandem) {
      if (sd->host)
        TDM_CALL(tdm_free(sd->host));
      if (sd->slots)
        TDM_CALL(tdm_free(sd->slots));
      continue;
    }
    if (sd->sc)
      CUDA_CALL(cudaStreamDestroy(sd->sc));
    if (sd->sk)
      CUDA_CALL(cudaStreamDestroy(sd->sk));
    for (int s = 0; s < NSLOT; s++) {
      if (sd->landed[s])
        CUDA_CALL(cudaEventDestroy(sd->landed[s]));
      if (sd->done[s])
        CUDA_CALL(cudaEventDestroy(sd->done[s]));
    }
    if (sd->host)
      CUDA_CALL(cudaFreeHost(sd->host));
    if (sd->slots)
      CUDA_CALL(cudaFree(sd->slots));
  }
  if (o->check)
    CUDA_CALL(cudaStreamDestroy(o->check));
  uint16_t *dev[] = {o->x, o->u, o->y, o->g};
  for (int i = 0; i < 4; i++)
    if (dev[i])
      CUDA_CALL(cudaFree(dev[i]));
  if (o->g_host)
    CUDA_CALL(cudaFreeHost(o->g_host));
  free(o->x_host);
  free(o->ref);
}

/* ---- the benchmark -------------------------------------------------------------------------- */

typedef struct side_result {
  double ms[NMODE];
  double hidden, efficiency, copy_gbps, tflops;
} side_result;

static void derive(const ovl *o, side_result *r) {
  double copy = r->ms[COPY], compute = r->ms[COMPUTE];
  double lo = copy < compute ? copy : compute, hi = copy > compute ? copy : compute;
  r->hidden = (r->ms[SERIAL] - r->ms[OVERLAP]) / lo;
  r->efficiency = hi / r->ms[OVERLAP];
  r->copy_gbps = (double)o->ne * (double)EXPERT_BYTES / (copy * 1e-3) / 1e9;
  r->tflops = (double)o->ne * 3.0 * 2.0 * o->tokens * HIDDEN * INTER / (compute * 1e-3) / 1e12;
}

static void side_json(bu_json *json, const char *key, const side_result *r) {
  bu_json_object(json, key);
  for (int m = 0; m < NMODE; m++) {
    char name[32];
    snprintf(name, sizeof name, "%s_ms", mode_key[m]);
    bu_json_double(json, name, r->ms[m], 4);
  }
  bu_json_double(json, "hidden_fraction", r->hidden, 4);
  bu_json_double(json, "efficiency", r->efficiency, 4);
  bu_json_double(json, "copy_gbps", r->copy_gbps, 3);
  bu_json_double(json, "gemm_tflops", r->tflops, 2);
  bu_json_bool(json, "goal_met", r->hidden >= GOAL_HIDDEN);
  bu_json_end(json);
}

int bench_overlap(bc_ctx *c, bu_json *json) {
  ovl o = {.c = c, .ne = c->opt->experts};
  cal_step cal[MAX_CAL];
  side_result res[2];
  int ncal = 0, rc = -1;
  long reps = c->opt->reps;
  double *t = NULL, max_err = 0.0;
  printf("\noverlap: %ld experts of %.1f MB (3 bf16 matrices 2048x768) streamed H2D through %d\n"
         "device slots on a copy queue while cuBLAS bf16 GEMMs (gate, up 2048->768, down\n"
         "768->2048, fp32 accumulation) run on the compute queue; ms per pass, median of %ld reps\n",
         o.ne, EXPERT_BYTES / 1e6, NSLOT, reps);
  fflush(stdout);
  if (setup(&o) < 0 || calibrate(&o, cal, &ncal) < 0)
    goto out;
  printf("  tokens: %d (%s; raw copy %.2f ms, raw compute %.2f ms per pass)\n", o.tokens,
         c->opt->tokens ? "--tokens" : "calibrated", cal[ncal - 1].copy * 1e3,
         cal[ncal - 1].compute * 1e3);
  fflush(stdout);
  CK_CUDA(cudaMalloc((void **)&o.g, (size_t)o.ne * (size_t)o.tokens * INTER * sizeof(uint16_t)));
  reference(&o);
  for (int i = 0; i < 2; i++)
    if (verify(&o, &o.s[i], SERIAL, &max_err) < 0 || verify(&o, &o.s[i], OVERLAP, &max_err) < 0)
      goto out;
  printf("  check: gate GEMM output of all %ld experts x %d tokens vs an fp64 CPU reference,\n"
         "  after serialized and overlapped passes on both sides: max relative error %.2e "
         "(tolerance %.0e): passed\n",
         o.ne, CHECK_TOKENS, max_err, TOLERANCE);
  fflush(stdout);

  /* 8 measurements per rep (side x mode), in an order that rotates rep by rep. */
  CK(t = calloc(2 * NMODE * (size_t)reps, sizeof *t), "out of host memory");
  for (int i = 0; i < 2; i++) /* warm-up of the modes verify did not run */
    for (int m = 0; m < NMODE; m++)
      if (pass(&o, &o.s[i], m, &t[0]) < 0)
        goto out;
  for (long r = 0; r < reps; r++)
    for (int k = 0; k < 2 * NMODE; k++) {
      int which = (int)((r + k) % (2 * NMODE)), i = which / NMODE, m = which % NMODE;
      if (pass(&o, &o.s[i], m, &t[(size_t)which * (size_t)reps + (size_t)r]) < 0)
        goto out;
    }
  for (int i = 0; i < 2; i++) {
    for (int m = 0; m < NMODE; m++)
      res[i].ms[m] = bu_median(&t[(size_t)(i * NMODE + m) * (size_t)reps], (size_t)reps) * 1e3;
    derive(&o, &res[i]);
  }

  printf("  %-7s %9s %9s %11s %11s %7s %6s %9s %9s\n", "", "copy", "compute", "serialized",
         "overlapped", "hidden", "effcy", "copy GB/s", "GEMM TF/s");
  for (int i = 0; i < 2; i++)
    printf("  %-7s %6.2f ms %6.2f ms %8.2f ms %8.2f ms %7.3f %6.3f %9.2f %9.1f\n", o.s[i].name,
           res[i].ms[COPY], res[i].ms[COMPUTE], res[i].ms[SERIAL], res[i].ms[OVERLAP],
           res[i].hidden, res[i].efficiency, res[i].copy_gbps, res[i].tflops);
  double ratio = res[0].ms[OVERLAP] / res[1].ms[OVERLAP];
  printf("  hidden = (serialized - overlapped) / min(copy, compute), goal >= %.2f: tandem %s, "
         "raw %s;\n  effcy = max(copy, compute) / overlapped; tandem overlapped / raw "
         "overlapped: %.3fx\n",
         GOAL_HIDDEN, res[0].hidden >= GOAL_HIDDEN ? "met" : "missed",
         res[1].hidden >= GOAL_HIDDEN ? "met" : "missed", ratio);
  fflush(stdout);

  bu_json_object(json, NULL);
  bu_json_int(json, "experts", o.ne);
  bu_json_int(json, "slots", NSLOT);
  bu_json_uint(json, "expert_bytes", (size_t)EXPERT_BYTES);
  bu_json_int(json, "tokens", o.tokens);
  bu_json_string(json, "tokens_from", c->opt->tokens ? "option" : "calibration");
  bu_json_int(json, "reps", reps);
  bu_json_string(json, "unit", "ms per pass over all experts, median over reps");
  bu_json_array(json, "calibration");
  for (int i = 0; i < ncal; i++) {
    bu_json_object(json, NULL);
    bu_json_int(json, "tokens", cal[i].tokens);
    bu_json_double(json, "raw_copy_ms", cal[i].copy * 1e3, 4);
    bu_json_double(json, "raw_compute_ms", cal[i].compute * 1e3, 4);
    bu_json_end(json);
  }
  bu_json_end(json);
  bu_json_object(json, "check");
  bu_json_string(json, "what", "gate GEMM output vs fp64 CPU reference");
  bu_json_int(json, "experts", o.ne);
  bu_json_int(json, "tokens_per_expert", CHECK_TOKENS);
  bu_json_double(json, "max_rel_error", max_err, -4);
  bu_json_double(json, "tolerance", TOLERANCE, -6);
  bu_json_bool(json, "passed", true);
  bu_json_end(json);
  side_json(json, "tandem", &res[0]);
  side_json(json, "raw", &res[1]);
  bu_json_double(json, "goal_hidden_min", GOAL_HIDDEN, 2);
  bu_json_double(json, "overlapped_ratio_tandem_vs_raw", ratio, 4);
  bu_json_end(json);
  rc = 0;
out:
  free(t);
  teardown(&o);
  return rc;
}
