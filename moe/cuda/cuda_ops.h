/* cuda/cuda_ops.h: what the CUDA operations' two files share (cuda/ops.cu: the MoE
 * operations; cuda/xfmr.cu: a transformer's others): the per-queue state, launching as a
 * programmatic dependent, error reporting, the current device, and device helpers. */
#ifndef TANDEM_MOE_CUDA_OPS_H
#define TANDEM_MOE_CUDA_OPS_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>

extern "C" {
#include "ops.h" /* moe/ops.h */
#include "tandem/cuda.h"
}

#define MOE_THREADS 256 /* threads per block for every kernel here (a power of two) */
#define MOE_WARPS (MOE_THREADS / 32)
#define ROUTER_TOKENS 8   /* tokens per small-ubatch router block: a weight row serves them all */
#define ROUTER_SMEM 49152 /* the top-k kernel's dynamic shared memory (5 bytes an expert) */
#define ROUTER_SPLIT_T 64 /* ubatches of at most this many tokens: router_logits_kernel, when
                           * T x E logits fit the scratch */
#define ROUTER_LOGITS (1 << 20) /* the logits' scratch, floats (4 MiB; larger ubatches: parts) */
#define BLAS_WS_BYTES (32u << 20) /* cuBLAS's recommended workspace on Hopper */
#define WS_ALIGN 256

/* ---- programmatic dependent launch ----
 * The kernels of a small ubatch's layer (rmsnorm, the small-ubatch router, group, the grouped
 * experts, combine; and a transformer's: embedding, the few-token projections, attn_prep,
 * RoPE, attention) are short, and between two of them the GPU drains one grid before it
 * launches the next. On Hopper and later they are launched as programmatic dependents
 * (launch_pdl): the next grid may be scheduled while the one before finishes, and each of
 * these kernels begins with wait_prior_grid(), which returns once the grid before it has
 * completed and its writes are visible; so what a kernel reads and writes is ordered exactly
 * as without it, and only the launch overlaps. Work that is not such a kernel (a copy, an
 * event, a cuBLAS GEMM) is ordered as always. TANDEM_MOE_CUDA_PDL=0 turns it off (read at
 * open()), to measure it. */
static __device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Hash buckets of the GEMM plan cache (a power of two). The cache holds one plan per shape
 * the state has run: two GEMMs per expert width, times the token counts seen (at most the
 * largest ubatch): a few thousand small plans at most; close() frees them. */
#define PLAN_BUCKETS 1024

/* C = A W^T for one shape (see gemm_rows): cuBLASLt's descriptors and algorithm. */
typedef struct gemm_plan {
  struct gemm_plan *next; /* in its bucket */
  int N, K, n, ldb;
  unsigned align;         /* the alignments of W, A and C (log2, 4 bits each) */
  bool lt;                /* false: the heuristic had nothing; cublasGemmEx runs this shape */
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
} gemm_plan;

/* gmm.cu's ways to run its tiles (moe_cuda.gmm_sched) */
enum { GM_GRID = 0, GM_COUNTER = 1, GM_AUTO = 2, GM_AUTO_G = 32 };

typedef struct moe_cuda {
  tdm_queue *q;        /* the queue open() bound the state to */
  cudaStream_t s;      /* where ops launch: the queue's stream, or cap while recording */
  cudaStream_t qs;     /* the queue's native stream */
  cudaStream_t cap;    /* graph recording: a stream of the state's own, made at first use */
  bool recording;      /* between graph_begin and graph_end */
  int rec_failed;      /* a CUDA or cuBLAS failure while recording: its code (graph_end's) */
  int dev;             /* its device ordinal */
  cublasHandle_t blas; /* bound to s, with ws as its workspace */
  cublasLtHandle_t lt; /* the plans' handle; its calls name s and ws themselves */
  void *ws;            /* cuBLAS's workspace: cudaMalloc'd (256-byte aligned, as it requires) */
  float *logits;       /* the router's logits or their parts: ROUTER_LOGITS floats */
  int gx_shape;        /* experts()'s kernels: GX_SHAPE_NARROW unless forced at open() */
  bool pdl;            /* launch_pdl() launches as programmatic dependents (open() decides) */
  bool q16;            /* Q4_K gate/up decode on 16-bit activations (q16.cu); open() decides */
  bool tf32;           /* prefill's projections on TF32 tensor cores, x and w split (xfmr.cu) */
  bool tc_attention;   /* prefill's attention on TF32 tensor cores, operands split (xfmr.cu) */
  int gmm_bm;          /* gmm.cu's tokens a tile: 64, 128, or 0 (by the weights' types and the
                        * table's tokens an entry); TANDEM_MOE_CUDA_GMM_BM, read at open
                        * (default 0, auto) */
  int gmm_sched;       /* how gmm.cu runs its tiles (TANDEM_MOE_CUDA_GMM_SCHED, read at open):
                        * GM_GRID, GM_COUNTER, or GM_AUTO (the default: counter for a table of
                        * at most GM_AUTO_G entries, a streamed group; else grid) */
  int sms;             /* the device's multiprocessors (0: not known) */
  int gmm_blocks;      /* counter mode's blocks a launch at most (TANDEM_MOE_CUDA_GMM_BLOCKS, the
                        * tests' way to have a block take many items; 0: as the GPU holds) */
  bool tf32_single;    /* TANDEM_MOE_CUDA_TF32=single: prefill's projections and tensor-core
                        * attention take one TF32 product of unsplit operands (11 significant
                        * bits each, f32 sums), not three */
  pthread_mutex_t plan_mu;            /* the plan cache: ops from several threads are allowed */
  gemm_plan *plans[PLAN_BUCKETS];
  const char *failed;  /* the last CUDA or cuBLAS call that failed */
  int native;          /* and its status */
} moe_cuda;

/* Launches kernel k (one that begins with wait_prior_grid()) on the state's stream, as a
 * programmatic dependent of the work before it when m->pdl. Returns the launch's status. */
template <typename... P, typename... A>
static cudaError_t launch_pdl(const moe_cuda *m, void (*k)(P...), dim3 grid, dim3 block,
                              size_t smem, A... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = m->s;
  cfg.attrs = &attr;
  cfg.numAttrs = m->pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, k, args...);
}

/* ---- errors and the current device ---- */

static inline int cuda_fail(moe_cuda *m, cudaError_t e, const char *what) {
  m->failed = what;
  m->native = (int)e;
  int rc = tdm_set_error(e == cudaErrorMemoryAllocation ? TDM_ENOMEM : TDM_EBACKEND, (int)e,
                         "moe cuda: %s failed: %s", what, cudaGetErrorString(e));
  if (m->recording && !m->rec_failed) m->rec_failed = rc;
  return rc;
}

static inline int blas_fail(moe_cuda *m, cublasStatus_t st, const char *what) {
  m->failed = what;
  m->native = (int)st;
  int rc = tdm_set_error(st == CUBLAS_STATUS_ALLOC_FAILED ? TDM_ENOMEM : TDM_EBACKEND, (int)st,
                         "moe cuda: %s failed with cuBLAS status %d", what, (int)st);
  if (m->recording && !m->rec_failed) m->rec_failed = rc;
  return rc;
}

static inline int bad_args(const char *op) {
  return tdm_set_error(TDM_EINVAL, 0, "moe %s: bad arguments (NULL pointer, size out of range, "
                       "or a state opened on another queue)", op);
}

#define CK_CUDA(call)                                      \
  do {                                                     \
    cudaError_t e_ = (call);                               \
    if (e_ != cudaSuccess) return cuda_fail(m, e_, #call); \
  } while (0)

#define CK_BLAS(call)                                                \
  do {                                                               \
    cublasStatus_t s_ = (call);                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS) return blas_fail(m, s_, #call); \
  } while (0)

/* Makes m->dev current, saving the caller's device; leave() restores it. */
static inline int enter(moe_cuda *m, int *saved) {
  cudaError_t e = cudaGetDevice(saved);
  if (e != cudaSuccess) return cuda_fail(m, e, "cudaGetDevice");
  if (*saved == m->dev) return 0;
  e = cudaSetDevice(m->dev);
  return e == cudaSuccess ? 0 : cuda_fail(m, e, "cudaSetDevice");
}

static inline void leave(moe_cuda *m, int saved) {
  if (saved != m->dev) cudaSetDevice(saved);
}

/* Every op checks that it runs on the queue its state was opened for: the cuBLAS handle is
 * bound to that queue's stream. */
static inline int check_queue(moe_cuda *m, tdm_queue *q) { return m && q == m->q ? 0 : -1; }

/* ---- device helpers ---- */

static __device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}

/* The same rounding as tdm_moe_f32_to_bf16 on the host: nearest even, NaN stays a (quiet) NaN. */
static __device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* v rounded to TF32 (11 significant bits, f32's range: the 13 low bits to nearest, ties away;
 * one that would round to infinity is cut instead), as a float whose low bits are zero, so that
 * a tensor core takes it exactly. Infinities and NaN stay as they are. */
static __device__ __forceinline__ float tf32_round(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7f800000u) == 0x7f800000u) return v;
  uint32_t r = (u + 0x1000u) & 0xffffe000u;
  return __uint_as_float((r & 0x7f800000u) == 0x7f800000u ? u & 0xffffe000u : r);
}

/* A shared variable's address in the shared window (what ldmatrix and cp.async take). */
static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* Asynchronous copies from global to shared memory (sm_80 on; gmm.cu, xfmr.cu): dst a shared
 * window address, or a shared variable (cp_async16). */
static __device__ __forceinline__ void cp_async4_s(uint32_t dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
#endif
}

/* 16 bytes from src, n of them read (16, or 0 for zeros: nothing is read then, but src must
 * still be a global address). */
static __device__ __forceinline__ void cp_async16_n(uint32_t dst, const void *src, uint32_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
#endif
}

/* v, kept in a register: the compiler may not compute it again where it is used (a thread's
 * addresses, computed once before a loop). */
static __device__ __forceinline__ uint32_t kept(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

/* cp_async16_n to a shared variable, zeros where !valid. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
  cp_async16_n(smem_u32(dst), src, valid ? 16u : 0u);
}

static __device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

/* Waits until at most N of this thread's latest groups are still copying. */
template <int N> static __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

/* Weights in a file's format, read where they lie (quant.cu, q16.cu). */
static __device__ __forceinline__ uint16_t ld16(const uint8_t *p) { /* p even */
  return __ldg((const unsigned short *)p);
}

static __device__ __forceinline__ float f16_at(const uint8_t *p) {
  return __half2float(__ushort_as_half(ld16(p)));
}

/* Four bytes at p, an even address (an expert starts at an even byte; most start at a multiple
 * of 16, and are read four bytes a load). */
static __device__ __forceinline__ uint32_t ld32(const uint8_t *p) {
  if (((uintptr_t)p & 3) == 0) return __ldg((const unsigned int *)p);
  return (uint32_t)ld16(p) | (uint32_t)ld16(p + 2) << 16;
}

/* An entry of experts_q's table whose rows leave [0, n) or whose expert (ebytes from byte 2w)
 * leaves the weights' allocation (wlimit bytes from wbase) is skipped. */
static __device__ __forceinline__ bool qentry_ok(const tdm_moe_group &g, int n, long long wlimit,
                                                 long long ebytes) {
  return g.count > 0 && g.first >= 0 && (long long)g.first + g.count <= n && g.w >= 0 &&
         2 * g.w <= wlimit - ebytes;
}

/* Fixed-order warp sum: lane 0 holds the result. */
static __device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

/* The sum of every thread's v over a block of MOE_THREADS threads, in a fixed order (each
 * warp's sum, then the warps' in warp order): every thread gets it. part: MOE_WARPS floats of
 * shared memory; every thread of the block calls it (it syncs the block twice). */
static __device__ __forceinline__ float block_sum(float v, float *part) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < MOE_WARPS; w++) s += part[w];
  __syncthreads(); /* part may be written again */
  return s;
}


/* What cuda/quant.cu takes from cuda/ops.cu: the bf16 entries (the {BF16, BF16} format is
 * theirs), expert()'s GEMM path on bf16 weights (its workspace as expert() lays it out: gate|up
 * at 0, the gathered rows and the output at cuda_expert_off_o(n, I), 4nH bytes), and the rows of
 * H floats from p to the end of its allocation. */
int cuda_expert(void *st, tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slot,
                int n, const tdm_moe_bf16 *w, int H, int I, float *out, void *workspace,
                size_t workspace_bytes);
int cuda_experts(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                 const int32_t *slot, int n, const tdm_moe_bf16 *wbase,
                 const tdm_moe_group *groups, int G, int H, int I, float *out, void *workspace,
                 size_t workspace_bytes);
int cuda_run_expert(moe_cuda *m, const float *x, const int32_t *rows, const int32_t *slot, int n,
                    const uint16_t *w, int H, int I, float *out, unsigned char *ws);
/* expert()'s path with GEMMs of the caller's: C [ntok x N] (f32) = A W^T, A bf16 rows of
 * a_stride elements (K used), W the gate|up weights (N = 2I) or, when down, the down weights
 * (N = H), as the caller keeps them (ctx: its own). */
typedef int (*cuda_gemm_fn)(moe_cuda *m, int ntok, int N, int K, const void *A, int a_stride,
                            const void *W, bool down, float *C, const void *ctx);
int cuda_run_expert_with(moe_cuda *m, const float *x, const int32_t *rows, const int32_t *slot,
                         int n, const void *wgu, const void *wd, int H, int I, float *out,
                         unsigned char *ws, cuda_gemm_fn gemm, const void *ctx);
size_t cuda_expert_off_o(size_t n, size_t I);
uint32_t cuda_rows_in(const float *p, int H);

/* Experts in their file's format (cuda/quant.cu), entries of tdm_moe__cuda_ops. */
int cuda_expert_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                  const int32_t *slot, int n, const void *w, tdm_moe_wfmt fmt, int H, int I,
                  float *out, void *workspace, size_t workspace_bytes);
int cuda_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w, int wtype,
                  int T, int K, int N, float beta, void *ws, size_t ws_bytes);
int cuda_experts_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                   const int32_t *slot, int n, const void *wbase, tdm_moe_wfmt fmt,
                   const tdm_moe_group *groups, int G, int H, int I, float *out,
                   void *workspace, size_t workspace_bytes);

/* The transformer's operations (cuda/xfmr.cu), entries of tdm_moe__cuda_ops; and the loading
 * of their kernels at open() (see preload in cuda/ops.cu). */
int cuda_xfmr_preload(moe_cuda *m);
int cuda_quant_preload(moe_cuda *m); /* cuda/quant.cu's kernels (and q16.cu's) */
/* cuda/q16.cu: experts_q's gate/up on Q4_K or Q8_0 rows (tg) and down on Q4_K, Q6_K or Q8_0
 * rows (td) with 16-bit activations, and the scratch each takes (256-byte multiples). */
size_t cuda_q16_scratch(int n, int H);
bool cuda_q16_gate_up_takes(int tg);
bool cuda_q16_down_takes(int td);
size_t cuda_q16_down_scratch(int n, int I);
cudaError_t cuda_down_q16(moe_cuda *m, const float *h, const int32_t *rows, uint32_t xlimit,
                          const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                          long long wlimit, long long ebytes, int td,
                          const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb,
                          size_t rb, float *out, void *scratch);
cudaError_t cuda_gate_up_q16(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                             int n, const uint8_t *wbase, long long wlimit, long long ebytes,
                             int tg, const tdm_moe_group *groups, int G, int H, int I, size_t rb,
                             float *h, void *scratch);
int cuda_q16_preload(moe_cuda *m);
/* cuda/gmm.cu: experts() and experts_q() on at least CUDA_GMM_MIN_N rows in all (prefill), the
 * whole table in two tensor-core launches after a gather of the entries' activations (types tg
 * for gate/up, td for down, any of moe_ops.h; ws: the workspace, whose first
 * cuda_gmm_scratch() bytes it takes, less than tdm_moe__workspace's); whether it takes a
 * call's shape. */
#define CUDA_GMM_MIN_N 257
bool cuda_gmm_takes(int n, int H, int I, const float *x);
cudaError_t cuda_gmm(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                     const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                     long long wlimit, long long ebytes, int tg, int td,
                     const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb, size_t d_rb,
                     void *ws, float *out);
size_t cuda_gmm_scratch(int n, int H, int I);
int cuda_gmm_preload(moe_cuda *m);
int cuda_get_rows(void *st, tdm_queue *q, float *y, const float *table, const int32_t *ids,
                  int T, int H, int V);
int cuda_get_rows_h(void *st, tdm_queue *q, float *y, const uint16_t *table, int wtype,
                    const int32_t *ids, int T, int H, int V);
/* Prefill's projections (matmul_h, matmul_q on many tokens): y [T x N] = x [T x K] w^T + beta
 * y with w widened to f32 a piece of rows at a time into the workspace by widen (rows
 * [n0, n0 + c) into dst, on m->s), each piece multiplied on TF32 tensor cores with x and w
 * split for f32's precision (exact: w's widened values are TF32 already), or as SGEMMs where
 * m->tf32 is off or the workspace cannot hold x's parts. Inside enter() / leave(). */
typedef cudaError_t (*widen_rows_fn)(moe_cuda *m, const void *w, int wtype, size_t n0, size_t c,
                                     int K, float *dst);
int cuda_widened_gemm(moe_cuda *m, widen_rows_fn widen, const void *w, int wtype, bool exact,
                      float *y, const float *x, int T, int K, int N, float beta, void *ws,
                      size_t ws_bytes);
int cuda_matmul_h(void *st, tdm_queue *q, float *y, const float *x, const uint16_t *w, int wtype,
                  int T, int K, int N, float beta, void *ws, size_t ws_bytes);
int cuda_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T, int K,
                int N, float beta);
int cuda_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0, float base,
              float freq_scale, int neox);
int cuda_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                   const float *vc, int T, int pos0, int nh, int nkv, int hd, float scale);
int cuda_attn_prep_at(void *st, tdm_queue *q, float *qv, const float *k, const float *v,
                      float *kc, float *vc, const float *qn, const float *kn, int T, int nh,
                      int nkv, int hd, float eps, const int32_t *pos, int ctx, float base,
                      float freq_scale, int neox);
int cuda_attention_at(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                      const float *vc, int T, const int32_t *pos, int ctx, int nh, int nkv,
                      int hd, float scale);

#endif
