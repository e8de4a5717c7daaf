/* cuda/ops.cu: the CUDA backend's MoE operations (tdm_moe__cuda_ops, a table of
 * tandem/moe_ops.h).
 *
 * Everything runs on the queue's native stream (tdm_queue_native), so it is ordered with the
 * queue's tandem commands and covered by tdm_event_record / tdm_queue_sync. rmsnorm, the
 * router, SwiGLU, gather/scatter and combine are kernels here; the expert GEMMs are cuBLASLt
 * (cuBLAS where cuBLASLt has no algorithm for a shape), on that stream.
 *
 * Determinism: no kernel here adds floats with atomics (group's counts are integer sums in
 * shared memory); every sum has a fixed order that does not depend on timing or on how tokens
 * are grouped into blocks. The expert GEMMs go through cuBLASLt with
 * one plan per shape (descriptors and the algorithm its heuristic picks, made at a shape's
 * first use and kept): the same shape always runs the same algorithm, with the same workspace,
 * so its result is bitwise repeatable for one toolkit and one GPU model (architecture and SM
 * count). A plan's key holds the operands' pointer alignment, so a slot that is less aligned
 * gets a plan of its own rather than an algorithm that needs more. A plan costs the submitting
 * thread a hash lookup and one cublasLtMatmul; cublasGemmEx sets up descriptors and looks up
 * its heuristic cache at every call (`bench-cuda expert` shows the difference). A shape the
 * heuristic has no algorithm for falls back to cublasGemmEx, always, which is just as
 * repeatable: open() binds that handle to one stream, gives it the same workspace
 * (cublasSetWorkspace, so cuBLAS never picks a per-stream pool), keeps the default math mode
 * and disallows atomics.
 *
 * Errors: 0 or a negative TDM_E* code with tandem's message set (tdm_set_error): TDM_EINVAL
 * for arguments; a failing CUDA or cuBLAS call gives TDM_EBACKEND (TDM_ENOMEM when it ran out
 * of memory) with its status as the native error, and is also kept in the state (failed,
 * native) for a debugger. Only tandem's public API and its CUDA interop (tandem/cuda.h) are
 * used: the stream and the device ordinal come from tdm_queue_native and tdm_device_native. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "ops.h" /* moe/ops.h */
#include "tandem/cuda.h"
}

#include "cuda_ops.h"

/* ---- rmsnorm: one block per token; y may alias x ---- */

static __global__ void rmsnorm_kernel(float *y, const float *x, const float *w, int H, float eps) {
  wait_prior_grid();
  __shared__ float part[MOE_WARPS];
  const float *xr = x + (size_t)blockIdx.x * H;
  float *yr = y + (size_t)blockIdx.x * H;
  float acc = 0.f;
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) acc = fmaf(xr[c], xr[c], acc);
  float inv = 1.f / sqrtf(block_sum(acc, part) / (float)H + eps);
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) yr[c] = xr[c] * inv * w[c];
}

/* ---- router ----
 * Two ways to the logits, each followed by router_topk_kernel (one warp per token: the
 * probabilities, then the top k). Small ubatches (T <= ROUTER_SPLIT_T): router_logits_kernel
 * below. Larger ones: router_gemm_kernel, tiles of RG_T tokens by RG_E experts with H in
 * RG_SPLIT consecutive parts, each part one fmaf chain in ascending order of the hidden index
 * (a thread's accumulator), the parts then added in order and the bias last by the top-k
 * kernel. Either way a token's logit does not depend on which tile or block it fell in, only
 * on T's side of ROUTER_SPLIT_T. */

/* a better than b: larger p, or equal p and lower index; NaN ranks lowest. */
static __device__ __forceinline__ bool better(float pa, int ia, float pb, int ib) {
  return pa > pb || (pa == pb && ia < ib);
}

static __device__ void router_token(float *p, unsigned char *taken, int E, int k, int renorm,
                                    int32_t *idx, float *weights) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    mx = fmaxf(mx, p[e]);
    taken[e] = 0;
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    float v = expf(p[e] - mx);
    p[e] = v;
    sum += v;
  }
  sum = __shfl_sync(0xffffffffu, warp_sum(sum), 0);
  for (int e = lane; e < E; e += 32) p[e] = p[e] / sum;
  __syncwarp();

  float chosen = 0.f; /* lane 0: the sum of the chosen p, in the order chosen */
  for (int r = 0; r < k; r++) {
    float bp = -INFINITY;
    int bi = INT_MAX; /* loses to every candidate, so some untaken expert always wins */
    for (int e = lane; e < E; e += 32) {
      if (taken[e]) continue;
      float v = p[e] != p[e] ? -INFINITY : p[e];
      if (better(v, e, bp, bi)) bp = v, bi = e;
    }
    /* The comparison is a total order, so every lane ends with the same winner. */
    for (int o = 16; o > 0; o >>= 1) {
      float op = __shfl_xor_sync(0xffffffffu, bp, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(op, oi, bp, bi)) bp = op, bi = oi;
    }
    if (lane == 0) {
      taken[bi] = 1;
      idx[r] = bi;
      weights[r] = p[bi];
      chosen += p[bi];
    }
    __syncwarp();
  }
  if (renorm && lane == 0)
    for (int r = 0; r < k; r++) weights[r] = weights[r] / chosen;
}

/* ---- expert ----
 * Workspace layout (bytes from the workspace's start; n tokens, H hidden, I intermediate):
 *   [0, 8nI)              GU: f32 [n x 2I], row i = [gate_i (I) | up_i (I)]. SwiGLU then writes
 *                         h (bf16 [n x I]) in place: h row i occupies the first 2I bytes of GU
 *                         row i, so h has a leading dimension of 4I bf16 elements.
 *   [off_o, off_o + 4nH)  off_o = 8nI rounded up to 256: first X, bf16 [n x H] (the gathered
 *                         tokens, 2nH bytes), then O, f32 [n x H] (the down projection). X is
 *                         dead once the gate/up GEMM has run, which precedes the down GEMM in
 *                         stream order.
 * Total off_o + 4nH bytes: within ops.h's n(2I + H) f32 + nH bf16 whenever 2nH >= 255, and
 * well within tdm_moe_ops_workspace(n, H, I), which expert() requires of every backend. */

static size_t round_ws(size_t b) { return (b + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN; }

size_t cuda_expert_off_o(size_t n, size_t I) { return round_ws(8 * n * I); }

/* Indices are device data written by earlier commands, so they are checked only here, against
 * the rows the host saw in the allocations (limit): a bad row gathers zeros and a bad slot is
 * not written, rather than touching memory outside them. A kernel has no way to return
 * TDM_ERANGE as the CPU table does. */
static __global__ void gather_kernel(uint16_t *X, const float *x, const int32_t *rows, int H,
                                     uint32_t limit) {
  uint32_t r = (uint32_t)rows[blockIdx.x];
  const float *src = x + (size_t)r * H;
  uint16_t *dst = X + (size_t)blockIdx.x * H;
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) dst[c] = r < limit ? f32_to_bf16(src[c]) : 0;
}

/* One block per row, in place. h[c] (2 bytes at 2c) overwrites half of gate[c / 2]. In chunk j
 * (c in [jB, jB + B), B = MOE_THREADS) every thread reads its gate[c] and up[c], then the block
 * synchronizes, then writes h[c]: those writes touch gate[jB/2, (j+1)B/2), all of which were
 * read in chunks <= j, before this chunk's barrier, and none of which the next chunk reads
 * (it reads gate[(j+1)B, ...)). No restrict or read-only loads: the row is written here. */
static __global__ void swiglu_kernel(float *GU, int I) {
  float *g = GU + (size_t)blockIdx.x * 2 * I;
  const float *u = g + I;
  uint16_t *h = (uint16_t *)g;
  for (int base = 0; base < I; base += MOE_THREADS) {
    int c = base + threadIdx.x;
    float v = 0.f;
    if (c < I) {
      float gv = g[c];
      v = gv / (1.f + expf(-gv)) * u[c];
    }
    __syncthreads();
    if (c < I) h[c] = f32_to_bf16(v);
  }
}

static __global__ void scatter_kernel(float *out, const float *O, const int32_t *slot, int H,
                                      uint32_t limit) {
  uint32_t s = (uint32_t)slot[blockIdx.x];
  if (s >= limit) return;
  const float *src = O + (size_t)blockIdx.x * H;
  float *dst = out + (size_t)s * H;
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) dst[c] = src[c];
}

/* ---- a group of experts (experts()) ----
 * Matrix-vector shaped: one warp per weight row, a block of MOE_WARPS rows of one entry's
 * expert, the entry in blockIdx.y. A lane reads 8 consecutive weights (16 bytes when the rows
 * allow it) and steps by 256 columns; every token of the entry (GX_NT at a time) is dotted with
 * that row while it is in registers, so the weights are read once per GX_NT tokens. f32
 * activations are read as they are (no bf16 rounding), and h stays f32 in the workspace:
 * h [n x I], row first + i for the entry's i-th token.
 * Order: lane l sums columns 256s + 8l + j, s then j ascending, one fmaf each, then the fixed
 * warp tree: a token's result depends on its expert and its own activations only, not on the
 * chunk it fell in, the other entries or G, and the 16-byte and the scalar loads give the same
 * sums (the scalar path skips the columns past the row's end rather than adding zeros). */
#define GX_UNROLL 4 /* 16-byte loads a lane has in flight per gate or up row before it computes */

/* Two shapes of the same kernels, which give the same bits (a token's sums do not depend on how
 * many tokens share a pass, nor on how many loads a lane batches: it visits the same columns in
 * the same order):
 * - wide: NT = 4 tokens per pass over a weight row and 4 loads a down row; up to 128
 *   registers a thread, so two blocks an SM.
 * - narrow: NT = 2 and 3 loads a down row (Qwen3-30B-A3B's I = 768 in one batch), held to 80
 *   registers, so three blocks an SM: more loads in flight, which these kernels are bound by.
 * experts() takes narrow: on the H200 it was faster at 1, 4 and 16 tokens a layer (32.8, 84.7
 * and 223.5 us against 35.5, 95.3 and 251.3 us, bench/results/h200-gpu-check-b3326f0; with
 * several tokens an entry its second pass over a row finds it in L2).
 * TANDEM_MOE_CUDA_GROUPED=wide or narrow forces one, for measuring them side by side. */
#define GX_NARROW_NT 2
#define GX_NARROW_DOWN_UNROLL 3
#define GX_NARROW_BLOCKS 3
#define GX_WIDE_NT 4
#define GX_WIDE_DOWN_UNROLL 4
#define GX_WIDE_BLOCKS 2
enum { GX_SHAPE_NARROW, GX_SHAPE_WIDE };

static int gx_shape_configured(void) {
  const char *v = getenv("TANDEM_MOE_CUDA_GROUPED");
  return v && strcmp(v, "wide") == 0 ? GX_SHAPE_WIDE : GX_SHAPE_NARROW;
}

/* An entry that names rows outside [0, n) or weights outside wbase's allocation is skipped. */
static __device__ __forceinline__ bool entry_ok(const tdm_moe_group &g, int n, long long wlimit,
                                                long long wsize) {
  return g.count > 0 && g.first >= 0 && (long long)g.first + g.count <= n && g.w >= 0 &&
         g.w <= wlimit - wsize;
}

/* 8 bf16 at p[c..c+8) as raw bits: those below K, zeros after (any alignment). */
static __device__ __forceinline__ uint4 load_raw8_any(const uint16_t *p, int c, int K) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    uint32_t lo = c + 2 * j < K ? p[c + 2 * j] : 0u, hi = c + 2 * j + 1 < K ? p[c + 2 * j + 1] : 0u;
    w[j] = lo | hi << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* VEC: one 16-byte load (p + c 16-byte aligned, c + 8 <= K). */
template <bool VEC>
static __device__ __forceinline__ uint4 load_raw8(const uint16_t *p, int c, int K) {
  return VEC ? __ldg((const uint4 *)(p + c)) : load_raw8_any(p, c, K);
}

static __device__ __forceinline__ void widen8(uint4 u, float v[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    v[2 * j] = __uint_as_float(w[j] << 16);
    v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}

/* 8 f32 values from p[c..c+8) (VEC: two 16-byte loads; else those below K). */
template <bool VEC>
static __device__ __forceinline__ void load_f8(const float *p, int c, int K, float v[8]) {
  if (VEC) {
    float4 a = *(const float4 *)(p + c), b = *(const float4 *)(p + c + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = c + j < K ? p[c + j] : 0.f;
  }
}

/* Gate and up row r of one expert (W: [Wg | Wu | Wd]) on its tokens; h = silu(g) * u. A token
 * whose row lies outside x's allocation is skipped (gx_down_row does not write its slot). Each
 * lane issues GX_UNROLL loads of each row before it uses any, so a warp keeps 4 KiB of weights
 * in flight. */
template <bool VEC, int GX_NT>
static __device__ void gx_gate_up_row(const float *x, uint32_t xlimit, const int32_t *rows,
                                      const tdm_moe_group &g, const uint16_t *W, int H, int I,
                                      int r, float *h) {
  const int lane = threadIdx.x & 31;
  const uint16_t *wg = W + (size_t)r * H, *wu = W + ((size_t)I + r) * H;
  for (int t0 = 0; t0 < g.count; t0 += GX_NT) {
    const int nt = min(GX_NT, g.count - t0);
    const float *xr[GX_NT];
#pragma unroll
    for (int t = 0; t < GX_NT; t++) {
      uint32_t row = t < nt ? (uint32_t)rows[g.first + t0 + t] : xlimit;
      xr[t] = row < xlimit ? x + (size_t)row * H : NULL;
    }
    float ag[GX_NT], au[GX_NT];
#pragma unroll
    for (int t = 0; t < GX_NT; t++) ag[t] = au[t] = 0.f;
    for (int c0 = lane * 8; c0 < H; c0 += 256 * GX_UNROLL) {
      uint4 rg[GX_UNROLL], ru[GX_UNROLL];
#pragma unroll
      for (int u = 0; u < GX_UNROLL; u++)
        if (c0 + 256 * u < H) {
          rg[u] = load_raw8<VEC>(wg, c0 + 256 * u, H);
          ru[u] = load_raw8<VEC>(wu, c0 + 256 * u, H);
        }
#pragma unroll
      for (int u = 0; u < GX_UNROLL; u++) {
        const int c = c0 + 256 * u;
        if (c >= H) break;
        float gv[8], uv[8];
        widen8(rg[u], gv);
        widen8(ru[u], uv);
#pragma unroll
        for (int t = 0; t < GX_NT; t++) {
          if (!xr[t]) continue;
          float xv[8];
          load_f8<VEC>(xr[t], c, H, xv);
#pragma unroll
          for (int j = 0; j < 8; j++)
            if (VEC || c + j < H) {
              ag[t] = fmaf(xv[j], gv[j], ag[t]);
              au[t] = fmaf(xv[j], uv[j], au[t]);
            }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < GX_NT; t++) {
      if (t >= nt) break;
      float gs = warp_sum(ag[t]), us = warp_sum(au[t]);
      if (lane == 0 && xr[t])
        h[((size_t)g.first + t0 + t) * I + r] = gs / (1.f + expf(-gs)) * us;
    }
  }
}

/* Down rows c0 .. c0 + GX_DOWN_ROWS - 1 (those below H) of one expert on its tokens:
 * out[slot][c] = h . Wd[c]. Each h value loaded serves every row of the warp, and each row's
 * sums run in the same order as with one row a warp. A slot outside out's allocation is not
 * written, nor the slot of a token whose row lies outside x's (its h was never written). */
#define GX_DOWN_ROWS 2
template <bool VEC, int GX_NT, int GX_DOWN_UNROLL>
static __device__ void gx_down_rows(const float *h, const int32_t *rows, uint32_t xlimit,
                                    const int32_t *slot, uint32_t olimit, const tdm_moe_group &g,
                                    const uint16_t *Wd, int H, int I, int c0, float *out) {
  const int lane = threadIdx.x & 31, nr = min(GX_DOWN_ROWS, H - c0);
  for (int t0 = 0; t0 < g.count; t0 += GX_NT) {
    const int nt = min(GX_NT, g.count - t0);
    float acc[GX_DOWN_ROWS][GX_NT];
#pragma unroll
    for (int r = 0; r < GX_DOWN_ROWS; r++)
#pragma unroll
      for (int t = 0; t < GX_NT; t++) acc[r][t] = 0.f;
    for (int i0 = lane * 8; i0 < I; i0 += 256 * GX_DOWN_UNROLL) {
      uint4 rw[GX_DOWN_UNROLL][GX_DOWN_ROWS];
#pragma unroll
      for (int u = 0; u < GX_DOWN_UNROLL; u++)
#pragma unroll
        for (int r = 0; r < GX_DOWN_ROWS; r++)
          if (r < nr && i0 + 256 * u < I)
            rw[u][r] = load_raw8<VEC>(Wd + (size_t)(c0 + r) * I, i0 + 256 * u, I);
#pragma unroll
      for (int u = 0; u < GX_DOWN_UNROLL; u++) {
        const int i = i0 + 256 * u;
        if (i >= I) break;
        float wv[GX_DOWN_ROWS][8];
#pragma unroll
        for (int r = 0; r < GX_DOWN_ROWS; r++)
          if (r < nr) widen8(rw[u][r], wv[r]);
#pragma unroll
        for (int t = 0; t < GX_NT; t++) {
          if (t >= nt) break;
          float hv[8];
          load_f8<VEC>(h + ((size_t)g.first + t0 + t) * I, i, I, hv);
#pragma unroll
          for (int r = 0; r < GX_DOWN_ROWS; r++)
            if (r < nr)
#pragma unroll
              for (int j = 0; j < 8; j++)
                if (VEC || i + j < I) acc[r][t] = fmaf(hv[j], wv[r][j], acc[r][t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < GX_NT; t++) {
      if (t >= nt) break;
      uint32_t s = (uint32_t)slot[g.first + t0 + t];
      bool ok = s < olimit && (uint32_t)rows[g.first + t0 + t] < xlimit;
#pragma unroll
      for (int r = 0; r < GX_DOWN_ROWS; r++) {
        if (r >= nr) break;
        float v = warp_sum(acc[r][t]);
        if (lane == 0 && ok) out[(size_t)s * H + c0 + r] = v;
      }
    }
  }
}

/* vec: the host found x, wbase and the workspace 16-byte aligned and H, I multiples of 8; an
 * entry's weights must be too (w a multiple of 8). */
template <int NT, int MINB>
static __global__ void __launch_bounds__(MOE_THREADS, MINB)
    gx_gate_up_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int n,
                      const uint16_t *wbase, long long wlimit, const tdm_moe_group *groups, int H,
                      int I, bool vec, float *h) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int r = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
  if (r >= I || !entry_ok(g, n, wlimit, 3LL * H * I)) return; /* whole warps leave */
  if (vec && (g.w & 7) == 0)
    gx_gate_up_row<true, NT>(x, xlimit, rows, g, wbase + g.w, H, I, r, h);
  else
    gx_gate_up_row<false, NT>(x, xlimit, rows, g, wbase + g.w, H, I, r, h);
}

template <int NT, int DU, int MINB>
static __global__ void __launch_bounds__(MOE_THREADS, MINB)
    gx_down_kernel(const float *h, const int32_t *rows, uint32_t xlimit, const int32_t *slot,
                   uint32_t olimit, int n, const uint16_t *wbase, long long wlimit,
                   const tdm_moe_group *groups, int H, int I, bool vec, float *out) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int c0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * GX_DOWN_ROWS;
  if (c0 >= H || !entry_ok(g, n, wlimit, 3LL * H * I)) return;
  const uint16_t *Wd = wbase + g.w + 2 * (size_t)I * H;
  if (vec && (g.w & 7) == 0)
    gx_down_rows<true, NT, DU>(h, rows, xlimit, slot, olimit, g, Wd, H, I, c0, out);
  else
    gx_down_rows<false, NT, DU>(h, rows, xlimit, slot, olimit, g, Wd, H, I, c0, out);
}

/* ---- the router for small ubatches (T <= ROUTER_SPLIT_T) ----
 * A decode step's few tokens would give router_gemm_kernel a handful of blocks (one block per
 * 8 tokens took 0.3 ms for 16 tokens on the H200, bench/results/h200-decode-kernels). Here the
 * logits are spread over E warps per ROUTER_TOKENS tokens (blockIdx.y: one expert's row each,
 * read 16 bytes at a time, each of the tokens dotted with it, then the fixed warp tree, then
 * the bias), and router_topk_kernel follows. Its logits add up in another order than
 * router_gemm_kernel's, so the two paths may differ in the last bit; which one runs depends
 * on T and E alone. */
static __global__ void router_logits_kernel(const float *x, const uint16_t *wr, const float *bias,
                                            int T, int H, int E, bool vec, float *logits) {
  wait_prior_grid();
  const int lane = threadIdx.x & 31, e = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
  if (e >= E) return;
  const int t0 = blockIdx.y * ROUTER_TOKENS;
  x += (size_t)t0 * H;
  logits += (size_t)t0 * E;
  T = min(ROUTER_TOKENS, T - t0);
  const uint16_t *we = wr + (size_t)e * H;
  float acc[ROUTER_TOKENS];
#pragma unroll
  for (int t = 0; t < ROUTER_TOKENS; t++) acc[t] = 0.f;
  for (int c = lane * 8; c < H; c += 256) {
    float wv[8];
    widen8(vec ? load_raw8<true>(we, c, H) : load_raw8<false>(we, c, H), wv);
#pragma unroll
    for (int t = 0; t < ROUTER_TOKENS; t++) {
      if (t >= T) break;
      float xv[8];
      if (vec)
        load_f8<true>(x + (size_t)t * H, c, H, xv);
      else
        load_f8<false>(x + (size_t)t * H, c, H, xv);
#pragma unroll
      for (int j = 0; j < 8; j++)
        if (c + j < H) acc[t] = fmaf(xv[j], wv[j], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < ROUTER_TOKENS; t++) {
    if (t >= T) break;
    float v = warp_sum(acc[t]);
    if (lane == 0) logits[(size_t)t * E + e] = bias ? v + bias[e] : v;
  }
}

/* One warp (block) per token; shared memory: E floats, then E bytes. The token's logits are
 * the sum of its nparts rows of part (pstride floats apart), in order, plus the bias (NULL:
 * none). */
static __global__ void router_topk_kernel(const float *part, int nparts, size_t pstride,
                                          const float *bias, int E, int k, int renorm,
                                          int32_t *idx, float *weights) {
  wait_prior_grid();
  extern __shared__ float smem[];
  float *p = smem;
  unsigned char *taken = (unsigned char *)(smem + E);
  const size_t t = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += 32) {
    float v = part[t * E + e];
    for (int s = 1; s < nparts; s++) v += part[s * pstride + t * E + e];
    p[e] = bias ? v + bias[e] : v;
  }
  __syncwarp();
  router_token(p, taken, E, k, renorm, idx + t * k, weights + t * k);
}

/* The logits of larger ubatches, in parts: block (ei, ti, s) sums x[t][c] wr[e][c] over c in
 * part s of H (ks values each, a multiple of RG_KC) for its RG_T tokens and RG_E experts,
 * RG_KC values a step through shared memory (x as it is, wr widened to f32; zeros past T, E
 * and H, which add nothing). Thread (tt, ee) = (tid / 16, tid % 16) keeps the four sums of
 * tokens tt, tt + 16 and experts ee, ee + 16. part[s][t][e], T x E floats a part. */
#define RG_T 32
#define RG_E 32
#define RG_KC 32
#define RG_SPLIT 4
static_assert(RG_T == RG_E, "one loop stages a step of x's and of wr's rows");

static __global__ void __launch_bounds__(MOE_THREADS)
    router_gemm_kernel(const float *x, const uint16_t *wr, int T, int H, int E, int ks,
                       float *part) {
  wait_prior_grid();
  __shared__ float xs[RG_T][RG_KC + 1], ws[RG_E][RG_KC + 1];
  const int tid = threadIdx.x, tt = tid >> 4, ee = tid & 15;
  const int e0 = blockIdx.x * RG_E, t0 = blockIdx.y * RG_T, s = blockIdx.z;
  const int c0 = s * ks, c1 = min(H, c0 + ks);
  float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  for (int k0 = c0; k0 < c1; k0 += RG_KC) {
#pragma unroll
    for (int q = 0; q < RG_T * RG_KC / MOE_THREADS; q++) {
      const int i = tid + q * MOE_THREADS, r = i / RG_KC, c = i % RG_KC;
      const bool in = k0 + c < c1;
      xs[r][c] = in && t0 + r < T ? x[(size_t)(t0 + r) * H + k0 + c] : 0.f;
      ws[r][c] = in && e0 + r < E ? bf16_to_f32(wr[(size_t)(e0 + r) * H + k0 + c]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < RG_KC; c++) {
      const float a0 = xs[tt][c], a1 = xs[tt + 16][c], b0 = ws[ee][c], b1 = ws[ee + 16][c];
      acc[0][0] = fmaf(a0, b0, acc[0][0]);
      acc[0][1] = fmaf(a0, b1, acc[0][1]);
      acc[1][0] = fmaf(a1, b0, acc[1][0]);
      acc[1][1] = fmaf(a1, b1, acc[1][1]);
    }
    __syncthreads();
  }
  float *ps = part + (size_t)s * T * E;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int t = t0 + tt + 16 * i, e = e0 + ee + 16 * j;
      if (t < T && e < E) ps[(size_t)t * E + e] = acc[i][j];
    }
}

/* ---- group(): the routing grouped on the device, one block ----
 * The routing is staged in shared memory (when it fits) and counted by expert with shared
 * atomics (sums: their order is no matter); each thread takes a run of consecutive experts,
 * and a scan over the threads' runs gives every routed expert its place among the routed ones
 * and its first entry, so the experts are laid out in ascending order without a serial pass;
 * one warp then places the entries in routing order, so that each expert's tokens come in
 * token order.
 * Every position comes from a count, never from a race: deterministic, and the same layout as
 * the CPU and OpenCL tables give. */
#define GROUP_MAX_E 4096    /* counts and offsets in shared memory: 32 KiB */
#define GROUP_IDX_SHARED 16384 /* routing entries staged in (dynamic) shared memory: 64 KiB */

static __global__ void group_kernel(const int32_t *idx, int T, int k, int E, const int64_t *wofs,
                                    int32_t *rows, int32_t *slot, tdm_moe_group *groups) {
  wait_prior_grid();
  extern __shared__ int group_sidx[]; /* the routing, where it fits (the launch sizes it) */
  __shared__ int cnt[GROUP_MAX_E], first[GROUP_MAX_E];
  __shared__ int run_tok[MOE_THREADS], run_nz[MOE_THREADS];
  const int tk = T * k, tid = threadIdx.x;
  const bool staged = tk <= GROUP_IDX_SHARED;
  if (staged)
    for (int i = tid; i < tk; i += MOE_THREADS) group_sidx[i] = idx[i];
  for (int e = tid; e < E; e += MOE_THREADS) cnt[e] = 0;
  __syncthreads();
  const int32_t *ix = staged ? group_sidx : idx;
  for (int i = tid; i < tk; i += MOE_THREADS) { /* counts are sums: their order is no matter */
    const int e = ix[i];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  /* This thread's run of experts [e0, e1): its entries and its routed experts, then an
   * inclusive scan of both over the threads. */
  const int per = (E + MOE_THREADS - 1) / MOE_THREADS;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int tok = 0, nz = 0;
  for (int e = e0; e < e1; e++) {
    tok += cnt[e];
    nz += cnt[e] != 0;
  }
  run_tok[tid] = tok;
  run_nz[tid] = nz;
  __syncthreads();
  for (int off = 1; off < MOE_THREADS; off <<= 1) {
    int a = tid >= off ? run_tok[tid - off] : 0, b = tid >= off ? run_nz[tid - off] : 0;
    __syncthreads();
    run_tok[tid] += a;
    run_nz[tid] += b;
    __syncthreads();
  }
  int at = run_tok[tid] - tok, g = run_nz[tid] - nz;
  for (int e = e0; e < e1; e++) {
    first[e] = at;
    if (!cnt[e]) continue;
    tdm_moe_group ent;
    ent.w = wofs[e];
    ent.first = at;
    ent.count = cnt[e];
    groups[g++] = ent;
    at += cnt[e];
  }
  /* The entries past the routed experts: empty, after every routed entry. */
  const int G = min(E, tk), routed = run_nz[MOE_THREADS - 1], total = run_tok[MOE_THREADS - 1];
  for (int j = routed + tid; j < G; j += MOE_THREADS) {
    tdm_moe_group ent;
    ent.w = 0;
    ent.first = total;
    ent.count = 0;
    groups[j] = ent;
  }
  __syncthreads();
  /* Warp 0 lays out every entry, 32 of the routing at a time, in order: the lanes that chose
   * one expert (__match_any_sync) take its next places in lane order, and the lowest of them
   * moves the expert's cursor (first[], from here on) past them. */
  if (tid >= 32) return;
  const int lane = tid;
  for (int base = 0; base < tk; base += 32) {
    const int i = base + lane, e = i < tk ? ix[i] : -1;
    const bool ok = e >= 0 && e < E;
    const unsigned same = __match_any_sync(0xffffffffu, ok ? e : -1);
    if (ok) {
      const int at = first[e] + __popc(same & ((1u << lane) - 1u));
      rows[at] = i / k;
      slot[at] = i;
    }
    __syncwarp();
    if (ok && lane == __ffs(same) - 1) first[e] += __popc(same);
    __syncwarp();
  }
}

/* ---- combine: one thread per element of y ---- */

static __global__ void combine_kernel(float *y, const float *out, const float *weights, int H,
                                      int k, size_t total) {
  wait_prior_grid();
  size_t stride = (size_t)gridDim.x * MOE_THREADS;
  for (size_t i = (size_t)blockIdx.x * MOE_THREADS + threadIdx.x; i < total; i += stride) {
    size_t t = i / (size_t)H, c = i % (size_t)H;
    const float *wt = weights + t * k;
    const float *ot = out + t * k * (size_t)H + c;
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc = fmaf(wt[j], ot[(size_t)j * H], acc);
    y[i] += acc;
  }
}

/* ---- upload: host memory the device reads in place, copied by the cores ----
 * The host rewrites the same pinned buffers layer after layer, so every load fetches anew
 * (__ldcv: no line of an earlier kernel's read is reused). */

static __global__ void upload16_kernel(uint4 *dst, const uint4 *src, size_t n) {
  wait_prior_grid();
  size_t stride = (size_t)gridDim.x * MOE_THREADS;
  for (size_t i = (size_t)blockIdx.x * MOE_THREADS + threadIdx.x; i < n; i += stride)
    dst[i] = __ldcv(src + i);
}

static __global__ void upload1_kernel(uint8_t *dst, const uint8_t *src, size_t n) {
  wait_prior_grid();
  size_t stride = (size_t)gridDim.x * MOE_THREADS;
  for (size_t i = (size_t)blockIdx.x * MOE_THREADS + threadIdx.x; i < n; i += stride)
    dst[i] = (uint8_t)__ldcv((const unsigned char *)src + i);
}

/* ---- the table's entries ---- */

/* With m->dev current. cublasDestroy and cudaFree wait for the device first. */
static void plan_free(gemm_plan *p) {
  if (p->op) cublasLtMatmulDescDestroy(p->op);
  if (p->a) cublasLtMatrixLayoutDestroy(p->a);
  if (p->b) cublasLtMatrixLayoutDestroy(p->b);
  if (p->c) cublasLtMatrixLayoutDestroy(p->c);
  free(p);
}

static void release(moe_cuda *m) {
  for (int i = 0; i < PLAN_BUCKETS; i++)
    for (gemm_plan *p = m->plans[i], *next; p; p = next) {
      next = p->next;
      plan_free(p);
    }
  if (m->lt) cublasLtDestroy(m->lt);
  if (m->blas) cublasDestroy(m->blas);
  if (m->ws) cudaFree(m->ws);
  if (m->logits) cudaFree(m->logits);
  if (m->cap) cudaStreamDestroy(m->cap);
  pthread_mutex_destroy(&m->plan_mu);
  free(m);
}

/* The cuBLAS handle, bound to the stream with its own workspace. cublasSetStream resets the
 * workspace to cuBLAS's pool, so the workspace is set after it. */
static int blas_setup(moe_cuda *m) {
  CK_CUDA(cudaMalloc(&m->ws, BLAS_WS_BYTES));
  CK_CUDA(cudaMalloc(&m->logits, (size_t)ROUTER_LOGITS * sizeof(float)));
  CK_BLAS(cublasCreate(&m->blas));
  CK_BLAS(cublasSetStream(m->blas, m->s));
  CK_BLAS(cublasSetWorkspace(m->blas, m->ws, BLAS_WS_BYTES));
  CK_BLAS(cublasSetMathMode(m->blas, CUBLAS_DEFAULT_MATH));
  CK_BLAS(cublasSetAtomicsMode(m->blas, CUBLAS_ATOMICS_NOT_ALLOWED));
  CK_BLAS(cublasSetPointerMode(m->blas, CUBLAS_POINTER_MODE_HOST));
  CK_BLAS(cublasLtCreate(&m->lt));
  return 0;
}

/* Loads every kernel of the module now. Under CUDA's lazy loading (the default since CUDA
 * 12.2) a kernel is loaded at its first launch, and that load waits on the context: launched
 * while the queue's stream is held at one of tandem's gates (a host task, a pageable copy),
 * whose release needs CUDA calls of tandem's executor, the launch never returned (a pageable
 * copy followed by get_rows' first launch hung every time on an H100). cudaFuncGetAttributes
 * loads a kernel without launching it. */
static int preload(moe_cuda *m) {
  const void *k[] = {
      (const void *)rmsnorm_kernel, (const void *)router_gemm_kernel, (const void *)gather_kernel,
      (const void *)swiglu_kernel, (const void *)scatter_kernel,
      (const void *)router_logits_kernel, (const void *)router_topk_kernel,
      (const void *)group_kernel, (const void *)combine_kernel, (const void *)upload16_kernel,
      (const void *)upload1_kernel,
      (const void *)gx_gate_up_kernel<GX_NARROW_NT, GX_NARROW_BLOCKS>,
      (const void *)gx_gate_up_kernel<GX_WIDE_NT, GX_WIDE_BLOCKS>,
      (const void *)gx_down_kernel<GX_NARROW_NT, GX_NARROW_DOWN_UNROLL, GX_NARROW_BLOCKS>,
      (const void *)gx_down_kernel<GX_WIDE_NT, GX_WIDE_DOWN_UNROLL, GX_WIDE_BLOCKS>};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, k[i]));
  }
  /* group's staged routing: past the 48 KiB a kernel has without asking */
  CK_CUDA(cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)(GROUP_IDX_SHARED * sizeof(int))));
  int rc = cuda_xfmr_preload(m);
  return rc ? rc : cuda_quant_preload(m);
}

/* Only in-order queues of CUDA devices: an out-of-order queue spreads its commands over
 * several streams, and these ops would be ordered with only one of them. */
static int cuda_open(tdm_queue *q, void **state) {
  if (!q || !state) return bad_args("open");
  tdm_device *dev;
  tdm_device_info info;
  unsigned flags;
  void *ordinal, *stream;
  int rc;
  if ((rc = tdm_queue_device(q, &dev)) || (rc = tdm_device_info_get(dev, &info)) ||
      (rc = tdm_queue_flags(q, &flags)))
    return rc;
  if (strcmp(info.backend, "cuda") != 0)
    return tdm_set_error(TDM_ENOTSUP, 0, "moe open: %s is not a CUDA device", info.id);
  if (flags & TDM_QUEUE_OUT_OF_ORDER) /* as the CPU table answers */
    return tdm_set_error(TDM_EINVAL, 0, "moe open: the ops need an in-order queue");
  if ((rc = tdm_device_native(dev, &ordinal)) || (rc = tdm_queue_native(q, &stream))) return rc;

  moe_cuda *m = (moe_cuda *)calloc(1, sizeof *m);
  if (!m) return tdm_set_error(TDM_ENOMEM, 0, "moe open: no host memory");
  pthread_mutex_init(&m->plan_mu, NULL);
  m->q = q;
  m->s = m->qs = (cudaStream_t)stream;
  m->dev = *(const int *)ordinal;
  m->gx_shape = gx_shape_configured();
  int saved, major = 0;
  const char *pdl = getenv("TANDEM_MOE_CUDA_PDL");
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, m->dev) != cudaSuccess)
    major = 0;
  cudaGetLastError(); /* a failed query only means no programmatic launches, no TF32 */
  m->pdl = !(pdl && strcmp(pdl, "0") == 0) && major >= 9;
  const char *q16 = getenv("TANDEM_MOE_CUDA_Q16");
  m->q16 = !(q16 && strcmp(q16, "0") == 0);
  const char *tf32 = getenv("TANDEM_MOE_CUDA_TF32"); /* TF32 from Ampere (8.0) on */
  m->tf32 = !(tf32 && strcmp(tf32, "0") == 0) && major >= 8;
  m->tf32_single = m->tf32 && tf32 && strcmp(tf32, "single") == 0;
  const char *bm = getenv("TANDEM_MOE_CUDA_GMM_BM");
  m->gmm_bm = !bm ? 0 : strcmp(bm, "128") == 0 ? 128 : strcmp(bm, "64") == 0 ? 64 : 0;
  const char *sched = getenv("TANDEM_MOE_CUDA_GMM_SCHED");
  m->gmm_sched = !sched                       ? GM_AUTO
                 : strcmp(sched, "counter") == 0 ? GM_COUNTER
                 : strcmp(sched, "grid") == 0    ? GM_GRID
                                                 : GM_AUTO;
  m->gmm_blocks = (int)tdm_moe__env_long("TANDEM_MOE_CUDA_GMM_BLOCKS", 0, INT_MAX, 0);
  if (cudaDeviceGetAttribute(&m->sms, cudaDevAttrMultiProcessorCount, m->dev) != cudaSuccess) {
    m->sms = 0; /* counter mode then starts a block an item */
    cudaGetLastError();
  }
  const char *tca = getenv("TANDEM_MOE_CUDA_TC_ATTENTION");
  m->tc_attention = !(tca && strcmp(tca, "0") == 0) && major >= 8;
  if ((rc = enter(m, &saved))) {
    free(m);
    return rc;
  }
  rc = blas_setup(m);
  if (!rc) rc = preload(m);
  if (rc) release(m);
  leave(m, saved);
  if (!rc) *state = m;
  return rc;
}

/* Call before destroying the queue: it waits for the queue's stream, so the cuBLAS workspace
 * is idle when it is freed. */
static void cuda_close(void *state) {
  moe_cuda *m = (moe_cuda *)state;
  if (!m) return;
  int saved, dev = m->dev;
  int rc = enter(m, &saved);
  if (m->recording) { /* a recording never ended: end it and drop what it holds */
    cudaGraph_t g = NULL;
    if (cudaStreamEndCapture(m->cap, &g) == cudaSuccess && g) cudaGraphDestroy(g);
    cudaGetLastError();
  }
  if (cudaStreamSynchronize(m->qs) != cudaSuccess) cudaGetLastError(); /* nothing to report to */
  release(m);
  if (!rc && saved != dev) cudaSetDevice(saved);
}

static int cuda_rmsnorm(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                        int H, float eps) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || T < 0 || H <= 0 || !(eps >= 0.f)) return bad_args("rmsnorm");
  if (T == 0) return 0;
  if (!y || !x || !w) return bad_args("rmsnorm");
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  /* a launch reports configuration errors at once */
  cudaError_t e = launch_pdl(m, rmsnorm_kernel, T, MOE_THREADS, 0, y, x, w, H, eps);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "rmsnorm_kernel");
  leave(m, saved);
  return rc;
}

static int launch_router(moe_cuda *m, const float *x, const tdm_moe_bf16 *wr, const float *bias,
                         int T, int H, int E, int k, int renorm, int32_t *idx, float *weights) {
  if (E > ROUTER_SMEM / 5) /* p (4 bytes) and taken (1 byte) per expert */
    return tdm_set_error(TDM_EINVAL, 0, "moe router: %d experts need more shared memory than "
                         "the kernel takes", E);
  if (T <= ROUTER_SPLIT_T && (size_t)T * E <= ROUTER_LOGITS) {
    bool vec = H % 8 == 0 && !((uintptr_t)x & 15) && !((uintptr_t)wr & 15);
    const dim3 grid((unsigned)((E + MOE_WARPS - 1) / MOE_WARPS),
                    (unsigned)((T + ROUTER_TOKENS - 1) / ROUTER_TOKENS));
    cudaError_t e = launch_pdl(m, router_logits_kernel, grid, MOE_THREADS, 0, x, wr, bias, T, H,
                               E, vec, m->logits);
    if (e == cudaSuccess)
      e = launch_pdl(m, router_topk_kernel, T, 32, (size_t)E * 5, (const float *)m->logits, 1,
                     (size_t)0, (const float *)NULL, E, k, (int)(renorm != 0), idx, weights);
    return e == cudaSuccess ? 0 : cuda_fail(m, e, "the small-ubatch router kernels");
  }
  /* in chunks of tokens whose parts fit the scratch */
  const int ks = (H + RG_SPLIT * RG_KC - 1) / (RG_SPLIT * RG_KC) * RG_KC;
  const int nparts = (H + ks - 1) / ks;
  const int chunk = (int)(ROUTER_LOGITS / ((size_t)nparts * E));
  for (int t0 = 0; t0 < T; t0 += chunk) {
    const int tc = min(chunk, T - t0);
    const dim3 grid((unsigned)((E + RG_E - 1) / RG_E), (unsigned)((tc + RG_T - 1) / RG_T),
                    (unsigned)nparts);
    cudaError_t e = launch_pdl(m, router_gemm_kernel, grid, MOE_THREADS, 0, x + (size_t)t0 * H,
                               (const uint16_t *)wr, tc, H, E, ks, m->logits);
    if (e == cudaSuccess)
      e = launch_pdl(m, router_topk_kernel, tc, 32, (size_t)E * 5, (const float *)m->logits,
                     nparts, (size_t)tc * E, bias, E, k, (int)(renorm != 0),
                     idx + (size_t)t0 * k, weights + (size_t)t0 * k);
    if (e != cudaSuccess) return cuda_fail(m, e, "the router kernels");
  }
  return 0;
}

static int cuda_router(void *st, tdm_queue *q, const float *x, const tdm_moe_bf16 *wr,
                       const float *bias, int T, int H, int E, int k, int renorm, int32_t *idx,
                       float *weights) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || T < 0 || H <= 0 || E <= 0 || k <= 0 || k > E)
    return bad_args("router");
  if (T == 0) return 0;
  if (!x || !wr || !idx || !weights) return bad_args("router");
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  rc = launch_router(m, x, wr, bias, T, H, E, k, renorm, idx, weights);
  leave(m, saved);
  return rc;
}

/* log2 of the largest power of two (up to 256) that divides p. */
static unsigned align_log2(const void *p) {
  uintptr_t u = (uintptr_t)p | 256;
  return (unsigned)__builtin_ctzll((unsigned long long)u);
}

/* Makes p's descriptors and asks the heuristic for its algorithm. On failure p holds what was
 * made (plan_free releases it). */
static int plan_make(moe_cuda *m, gemm_plan *p) {
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const uint64_t ws = BLAS_WS_BYTES;
  CK_BLAS(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CK_BLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CK_BLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  /* As stored, column-major: W is [K x N] (ld K), A is [K x n] (ld ldb), C is [N x n]. */
  CK_BLAS(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, (uint64_t)p->K, (uint64_t)p->N, p->K));
  CK_BLAS(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, (uint64_t)p->K, (uint64_t)p->n, p->ldb));
  CK_BLAS(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, (uint64_t)p->N, (uint64_t)p->n, p->N));
  cublasLtMatmulPreference_t pref;
  CK_BLAS(cublasLtMatmulPreferenceCreate(&pref));
  /* W, A, then C for both C and D (the output is written in place). */
  const uint32_t al[4] = {1u << (p->align & 15), 1u << (p->align >> 4 & 15),
                          1u << (p->align >> 8 & 15), 1u << (p->align >> 8 & 15)};
  const cublasLtMatmulPreferenceAttributes_t which[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
    st = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]);
  cublasLtMatmulHeuristicResult_t h;
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(m->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &h, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  /* Nothing for this shape (or no heuristic for this configuration): cublasGemmEx runs it. */
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found < 1)) return 0;
  if (st != CUBLAS_STATUS_SUCCESS) return blas_fail(m, st, "cublasLtMatmulAlgoGetHeuristic");
  p->algo = h.algo;
  p->lt = true;
  return 0;
}

/* The plan for a shape, made at its first use. */
static int plan_get(moe_cuda *m, int N, int K, int n, int ldb, unsigned align, gemm_plan **out) {
  unsigned hash = ((unsigned)N * 2654435761u) ^ ((unsigned)K * 40503u) ^ ((unsigned)n * 97u) ^
                  ((unsigned)ldb * 131u) ^ (align * 7u);
  gemm_plan **bucket = &m->plans[hash & (PLAN_BUCKETS - 1)], *p;
  pthread_mutex_lock(&m->plan_mu);
  for (p = *bucket; p; p = p->next)
    if (p->N == N && p->K == K && p->n == n && p->ldb == ldb && p->align == align) break;
  int rc = 0;
  if (!p) {
    p = (gemm_plan *)calloc(1, sizeof *p);
    if (!p) {
      rc = tdm_set_error(TDM_ENOMEM, 0, "moe expert: no host memory for a GEMM plan");
    } else {
      p->N = N;
      p->K = K;
      p->n = n;
      p->ldb = ldb;
      p->align = align;
      if ((rc = plan_make(m, p))) {
        plan_free(p);
        p = NULL;
      } else {
        p->next = *bucket;
        *bucket = p;
      }
    }
  }
  pthread_mutex_unlock(&m->plan_mu);
  *out = p;
  return rc;
}

/* Row-major data through column-major cuBLAS. A row-major [r x c] matrix with row stride ld
 * is, to cuBLAS, a column-major [c x r] matrix with leading dimension ld: its transpose. We
 * want C = A W^T (A: [n x K] row-major, W: [N x K] row-major, C: [n x N] row-major), i.e.
 * C^T = W A^T in column-major terms:
 *   op(A_blas) = W:   W's storage is the column-major [K x N] matrix W^T, so transa = T,
 *                     A_blas = W, lda = K (row stride of W);
 *   op(B_blas) = A^T: A's storage already is the column-major [K x n] matrix A^T, so
 *                     transb = N, B_blas = A, ldb = A's row stride (>= K);
 *   C_blas = C^T:     column-major [N x n] with ldc = N is C row-major [n x N].
 *   m = N, n = n, k = K. */
static int gemm_rows(moe_cuda *m, int ntok, int N, int K, const void *A, int a_stride,
                     const void *W, float *C) {
  const float one = 1.f, zero = 0.f;
  unsigned align = align_log2(W) | align_log2(A) << 4 | align_log2(C) << 8;
  gemm_plan *p;
  int rc = plan_get(m, N, K, ntok, a_stride, align, &p);
  if (rc) return rc;
  if (p->lt) {
    CK_BLAS(cublasLtMatmul(m->lt, p->op, &one, W, p->a, A, p->b, &zero, C, p->c, C, p->c,
                           &p->algo, m->ws, BLAS_WS_BYTES, m->s));
    return 0;
  }
  CK_BLAS(cublasGemmEx(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, ntok, K, &one, W, CUDA_R_16BF, K, A,
                       CUDA_R_16BF, a_stride, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT));
  return 0;
}

/* How many rows of H floats lie between p and the end of the tandem allocation holding it
 * (memory tandem does not know: as many as an int32 index can name; the caller vouches). */
uint32_t cuda_rows_in(const float *p, int H) {
  tdm_mem_info mi;
  size_t rows = (size_t)INT32_MAX + 1;
  if (tdm_mem_query(p, &mi) == 0 && mi.base) {
    size_t left = (size_t)((const char *)mi.base + mi.size - (const char *)p);
    if (left / sizeof(float) / (size_t)H < rows) rows = left / sizeof(float) / (size_t)H;
  }
  return (uint32_t)rows;
}

/* expert()'s GEMMs on bf16 weights: gemm_rows. */
static int gemm_bf16(moe_cuda *m, int ntok, int N, int K, const void *A, int a_stride,
                     const void *W, bool down, float *C, const void *ctx) {
  (void)down, (void)ctx;
  return gemm_rows(m, ntok, N, K, A, a_stride, W, C);
}

int cuda_run_expert_with(moe_cuda *m, const float *x, const int32_t *rows, const int32_t *slot,
                         int n, const void *wgu, const void *wd, int H, int I, float *out,
                         unsigned char *ws, cuda_gemm_fn gemm, const void *ctx) {
  float *GU = (float *)ws;
  uint16_t *X = (uint16_t *)(ws + cuda_expert_off_o((size_t)n, (size_t)I));
  float *O = (float *)X;
  int rc;
  gather_kernel<<<n, MOE_THREADS, 0, m->s>>>(X, x, rows, H, cuda_rows_in(x, H));
  CK_CUDA(cudaGetLastError());
  if ((rc = gemm(m, n, 2 * I, H, X, H, wgu, false, GU, ctx))) return rc; /* GU = X [Wg|Wu]^T */
  swiglu_kernel<<<n, MOE_THREADS, 0, m->s>>>(GU, I);
  CK_CUDA(cudaGetLastError());
  if ((rc = gemm(m, n, H, I, GU, 4 * I, wd, true, O, ctx))) return rc; /* O = h Wd^T */
  scatter_kernel<<<n, MOE_THREADS, 0, m->s>>>(out, O, slot, H, cuda_rows_in(out, H));
  CK_CUDA(cudaGetLastError());
  return 0;
}

int cuda_run_expert(moe_cuda *m, const float *x, const int32_t *rows, const int32_t *slot, int n,
                    const uint16_t *w, int H, int I, float *out, unsigned char *ws) {
  /* [2I x H]: Wg then Wu; then Wd [H x I] */
  return cuda_run_expert_with(m, x, rows, slot, n, w, w + 2 * (size_t)I * H, H, I, out, ws,
                              gemm_bf16, NULL);
}

int cuda_expert(void *st, tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slot,
                int n, const tdm_moe_bf16 *w, int H, int I, float *out, void *workspace,
                size_t workspace_bytes) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || n < 0 || H <= 0 || I <= 0 || I > INT_MAX / 4)
    return bad_args("expert");
  if (n == 0) return 0;
  if (!x || !rows || !slot || !w || !out || !workspace || ((uintptr_t)workspace & 15))
    return bad_args("expert");
  size_t contract = tdm_moe__workspace(n, H, I);
  if (!contract || workspace_bytes < contract ||
      cuda_expert_off_o((size_t)n, (size_t)I) + 4 * (size_t)n * H > workspace_bytes)
    return tdm_set_error(TDM_EINVAL, 0, "moe expert: a workspace of %zu bytes; n=%d H=%d I=%d "
                         "need %zu", workspace_bytes, n, H, I, contract);
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  rc = cuda_run_expert(m, x, rows, slot, n, w, H, I, out, (unsigned char *)workspace);
  leave(m, saved);
  return rc;
}

/* Elements of bf16 from w to the end of the tandem allocation holding it (memory tandem does
 * not know: as many as an int64 offset names; the caller vouches). */
static long long elems_in(const tdm_moe_bf16 *w) {
  tdm_mem_info mi;
  if (tdm_mem_query(w, &mi) == 0 && mi.base)
    return (long long)(((const char *)mi.base + mi.size - (const char *)w) / sizeof *w);
  return LLONG_MAX;
}

int cuda_experts(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                 const int32_t *slot, int n, const tdm_moe_bf16 *wbase,
                 const tdm_moe_group *groups, int G, int H, int I, float *out, void *workspace,
                 size_t workspace_bytes) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || n < 0 || G < 0 || G > 65535 || H <= 0 || I <= 0)
    return bad_args("experts");
  if (n == 0 || G == 0) return 0;
  if (!x || !rows || !slot || !wbase || !groups || !out || !workspace ||
      ((uintptr_t)workspace & 15))
    return bad_args("experts");
  size_t contract = tdm_moe__workspace(n, H, I);
  if (!contract || workspace_bytes < contract)
    return tdm_set_error(TDM_EINVAL, 0, "moe experts: a workspace of %zu bytes; n=%d H=%d I=%d "
                         "need %zu", workspace_bytes, n, H, I, contract);
  bool vec = H % 8 == 0 && I % 8 == 0 && !((uintptr_t)x & 15) && !((uintptr_t)wbase & 15);
  uint32_t xlimit = cuda_rows_in(x, H), olimit = cuda_rows_in(out, H);
  long long wlimit = elems_in(wbase);
  float *h = (float *)workspace;
  bool narrow = m->gx_shape == GX_SHAPE_NARROW;
  const dim3 gu_grid((unsigned)((I + MOE_WARPS - 1) / MOE_WARPS), (unsigned)G);
  const int down_rows = MOE_WARPS * GX_DOWN_ROWS; /* output rows a block */
  const dim3 down_grid((unsigned)((H + down_rows - 1) / down_rows), (unsigned)G);
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  if (cuda_gmm_takes(n, H, I, x) && !((uintptr_t)wbase & 1)) { /* many tokens: gmm.cu */
    const long long wbytes = wlimit > LLONG_MAX / 2 ? LLONG_MAX : 2 * wlimit;
    cudaError_t e = cuda_gmm(m, x, xlimit, rows, slot, olimit, n, (const uint8_t *)wbase, wbytes,
                             6 * (long long)H * I, TDM_MOE_W_BF16, TDM_MOE_W_BF16, groups, G, H,
                             I, 2 * (size_t)H, 2 * (size_t)I, workspace, out);
    rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "the grouped expert GEMMs");
    leave(m, saved);
    return rc;
  }
  const uint16_t *wb = (const uint16_t *)wbase;
  cudaError_t e = launch_pdl(m, narrow ? gx_gate_up_kernel<GX_NARROW_NT, GX_NARROW_BLOCKS>
                                       : gx_gate_up_kernel<GX_WIDE_NT, GX_WIDE_BLOCKS>,
                             gu_grid, MOE_THREADS, 0, x, xlimit, rows, n, wb, wlimit, groups, H,
                             I, vec, h);
  if (e == cudaSuccess)
    e = launch_pdl(m,
                   narrow ? gx_down_kernel<GX_NARROW_NT, GX_NARROW_DOWN_UNROLL, GX_NARROW_BLOCKS>
                          : gx_down_kernel<GX_WIDE_NT, GX_WIDE_DOWN_UNROLL, GX_WIDE_BLOCKS>,
                   down_grid, MOE_THREADS, 0, (const float *)h, rows, xlimit, slot, olimit, n, wb,
                   wlimit, groups, H, I, vec, out);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "the grouped expert kernels");
  leave(m, saved);
  return rc;
}

static int cuda_group(void *st, tdm_queue *q, const int32_t *idx, int T, int k, int E,
                      const int64_t *wofs, int32_t *rows, int32_t *slot, tdm_moe_group *groups) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || T < 0 || k <= 0 || E <= 0 || (T > 0 && k > INT_MAX / T))
    return bad_args("group");
  if (T == 0) return 0;
  if (!idx || !wofs || !rows || !slot || !groups) return bad_args("group");
  if (E > GROUP_MAX_E)
    return tdm_set_error(TDM_EINVAL, 0, "moe group: %d experts; the CUDA kernel takes at most %d",
                         E, GROUP_MAX_E);
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  const size_t smem = (long long)T * k <= GROUP_IDX_SHARED ? (size_t)T * k * sizeof(int) : 0;
  cudaError_t e = launch_pdl(m, group_kernel, 1, MOE_THREADS, smem, idx, T, k, E, wofs, rows,
                             slot, groups);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "group_kernel");
  leave(m, saved);
  return rc;
}

static int cuda_combine(void *st, tdm_queue *q, float *y, const float *out, const float *weights,
                        int T, int H, int k) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || T < 0 || H <= 0 || k <= 0) return bad_args("combine");
  if (T == 0) return 0;
  if (!y || !out || !weights) return bad_args("combine");
  size_t total = (size_t)T * H;
  size_t blocks = (total + MOE_THREADS - 1) / MOE_THREADS;
  if (blocks > (1u << 20)) blocks = 1u << 20; /* the kernel strides over the rest */
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = launch_pdl(m, combine_kernel, (unsigned)blocks, MOE_THREADS, 0, y, out, weights,
                             H, k, total);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "combine_kernel");
  leave(m, saved);
  return rc;
}

/* Host memory the device maps (pinned, or registered as mapped) is read in place by a kernel,
 * 16 bytes a thread where both ends and n allow; any other memory is copied on the stream. */
static int cuda_upload(void *st, tdm_queue *q, void *dst, const void *src, size_t n) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || (n && (!dst || !src))) return bad_args("upload");
  if (n == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaPointerAttributes pa;
  const void *dsrc = NULL;
  if (cudaPointerGetAttributes(&pa, src) == cudaSuccess && pa.type == cudaMemoryTypeHost)
    dsrc = pa.devicePointer;
  else
    cudaGetLastError(); /* not memory CUDA knows: a plain copy */
  cudaError_t e;
  const char *what = "upload";
  if (!dsrc) {
    what = "cudaMemcpyAsync";
    e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, m->s);
  } else if ((uintptr_t)dst % 16 == 0 && (uintptr_t)dsrc % 16 == 0 && n % 16 == 0) {
    size_t v = n / 16, blocks = (v + MOE_THREADS - 1) / MOE_THREADS;
    e = launch_pdl(m, upload16_kernel, (unsigned)(blocks > 1024 ? 1024 : blocks), MOE_THREADS, 0,
                   (uint4 *)dst, (const uint4 *)dsrc, v);
  } else {
    size_t blocks = (n + MOE_THREADS - 1) / MOE_THREADS;
    e = launch_pdl(m, upload1_kernel, (unsigned)(blocks > 1024 ? 1024 : blocks), MOE_THREADS, 0,
                   (uint8_t *)dst, (const uint8_t *)dsrc, n);
  }
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, what);
  leave(m, saved);
  return rc;
}

/* ---- graphs: the ops recorded on a stream of the state's own, then run on the queue ----
 * Recording never touches the queue's stream, so tandem's own work on it (its copies, the
 * events it records and waits for) goes on as usual meanwhile, from any thread: the capture is
 * relaxed, so a call that would synchronize (a tandem sync, say) is not refused for it.
 * cuBLAS's handle follows the recording stream (cuBLASLt calls name m->s themselves);
 * cublasSetStream resets the handle's workspace, so it is set again each time. */

static int blas_bind(moe_cuda *m, cudaStream_t s) {
  CK_BLAS(cublasSetStream(m->blas, s));
  CK_BLAS(cublasSetWorkspace(m->blas, m->ws, BLAS_WS_BYTES));
  return 0;
}

static int cuda_graph_begin(void *st, tdm_queue *q) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q)) return bad_args("graph_begin");
  if (m->recording)
    return tdm_set_error(TDM_ESTATE, 0, "moe graph_begin: this state is already recording");
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = m->cap ? cudaSuccess : cudaStreamCreateWithFlags(&m->cap, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaStreamBeginCapture(m->cap, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    rc = cuda_fail(m, e, "cudaStreamBeginCapture");
  } else if ((rc = blas_bind(m, m->cap))) {
    cudaGraph_t g = NULL;
    if (cudaStreamEndCapture(m->cap, &g) == cudaSuccess && g) cudaGraphDestroy(g);
    blas_bind(m, m->qs);
  } else {
    m->s = m->cap;
    m->recording = true;
    m->rec_failed = 0;
  }
  leave(m, saved);
  return rc;
}

static int cuda_graph_end(void *st, tdm_queue *q, void **graph) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !graph) return bad_args("graph_end");
  if (!m->recording)
    return tdm_set_error(TDM_ESTATE, 0, "moe graph_end: this state is not recording");
  *graph = NULL;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaGraph_t g = NULL;
  cudaError_t e = cudaStreamEndCapture(m->cap, &g);
  m->s = m->qs;
  m->recording = false;
  int brc = blas_bind(m, m->qs);
  if (m->rec_failed) {
    rc = m->rec_failed;
  } else if (e != cudaSuccess) {
    rc = cuda_fail(m, e, "cudaStreamEndCapture");
  } else if (brc) {
    rc = brc;
  } else {
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    if (e != cudaSuccess) rc = cuda_fail(m, e, "cudaGraphInstantiate");
    else *graph = x;
  }
  if (g) cudaGraphDestroy(g);
  leave(m, saved);
  return rc;
}

static int cuda_graph_launch(void *st, tdm_queue *q, void *graph) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !graph || m->recording) return bad_args("graph_launch");
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, m->qs);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "cudaGraphLaunch");
  leave(m, saved);
  return rc;
}

static void cuda_graph_free(void *st, void *graph) {
  moe_cuda *m = (moe_cuda *)st;
  if (!m || !graph) return;
  int saved;
  if (enter(m, &saved)) return;
  cudaGraphExecDestroy((cudaGraphExec_t)graph);
  leave(m, saved);
}

/* A host function of the stream: recorded, not run, while the stream is captured. */
static int cuda_host_call(void *st, tdm_queue *q, void (*fn)(void *), void *arg) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !fn) return bad_args("host_call");
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = cudaLaunchHostFunc(m->s, fn, arg);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "cudaLaunchHostFunc");
  leave(m, saved);
  return rc;
}

extern "C" const tdm_moe_ops tdm_moe__cuda_ops = {
    /* .name = */ "cuda",
    /* .open = */ cuda_open,
    /* .close = */ cuda_close,
    /* .rmsnorm = */ cuda_rmsnorm,
    /* .router = */ cuda_router,
    /* .expert = */ cuda_expert,
    /* .experts = */ cuda_experts,
    /* .group = */ cuda_group,
    /* .combine = */ cuda_combine,
    /* .graph_begin = */ cuda_graph_begin,
    /* .graph_end = */ cuda_graph_end,
    /* .graph_launch = */ cuda_graph_launch,
    /* .graph_free = */ cuda_graph_free,
    /* .upload = */ cuda_upload,
    /* .get_rows = */ cuda_get_rows,
    /* .matmul = */ cuda_matmul,
    /* .rope = */ cuda_rope,
    /* .attention = */ cuda_attention,
    /* .get_rows_h = */ cuda_get_rows_h,
    /* .matmul_h = */ cuda_matmul_h,
    /* .expert_q = */ cuda_expert_q,
    /* .experts_q = */ cuda_experts_q,
    /* .matmul_q = */ cuda_matmul_q,
    /* .attn_prep_at = */ cuda_attn_prep_at,
    /* .attention_at = */ cuda_attention_at,
    /* .experts_gemm_rows = */ CUDA_GMM_MIN_N,
    /* .host_call = */ cuda_host_call,
};

/* The entry libtandem_moe looks up when it loads this module (libtandem_moe-cuda.so). */
extern "C" __attribute__((visibility("default"))) const tdm_moe_ops *tdm_moe_ops_module(int abi) {
  return abi == TDM_MOE__OPS_ABI ? &tdm_moe__cuda_ops : NULL;
}
