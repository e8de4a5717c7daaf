/* cuda/quant.cu: experts in their file's format on CUDA (expert_q() and experts_q() of
 * tandem/moe_ops.h): GGUF's Q8_0, Q4_K, Q6_K and MXFP4 blocks, and F16, read as they crossed
 * the link and widened inside the kernels ({BF16, BF16} is experts()'s and expert()'s own).
 *
 * The prefill kernels read every type in units of 32 values (unit32.h). Every value, there and
 * in the decode kernels, is computed in moe/quant.h's f32 operations and order (the compiler
 * may fuse Q4_K's d sc q - dmin m into one rounding), so a weight is the value
 * tdm_moe_dequant_row gives within that rounding.
 *
 * experts_q (decode, small ubatches): as experts() on bf16, one warp per weight row of an
 * entry's expert (blockIdx.y the entry). The row is read 256 values at a time with the lanes
 * side by side (lane8: each lane 8 values of the chunk's blocks, so a warp's loads of the
 * blocks and of the activations are contiguous), widened into registers and dotted with every
 * token (NT at a time), f32 fmaf in a fixed order per lane, then the fixed warp tree: a
 * token's result depends on its expert and its own activations only. (Reading a unit of 32
 * values a lane, two bytes a load, made these kernels slower than the bf16 ones on 2-3x the
 * bytes: bench/results/h200-quant-9854c0c/.)
 *
 * experts_q on CUDA_GMM_MIN_N rows or more (a prefill's table) is gmm.cu's: the whole table in
 * two tensor-core launches that read the blocks themselves.
 *
 * expert_q (prefill, many tokens an expert) runs expert()'s path (gather to bf16, gate|up,
 * SwiGLU, down, scatter) with one of two GEMMs, both on bf16 operands with f32 sums:
 * - widen (the default): the expert is widened to bf16 into the workspace (one warp a row),
 *   then expert()'s cuBLASLt GEMMs run on it, as on a bf16 expert;
 * - fused (TANDEM_MOE_CUDA_QGEMM=fused, read at each call): qgemm_kernel reads the blocks
 *   itself, widening a 64-row, 32-value tile of the weights into shared memory per step of
 *   its tensor-core (WMMA) loop; no bf16 copy of the expert is written.
 * bf16 rounding of the widened weights, as of the activations, is the precision of either.
 * Which is faster for a shape is a measurement's to say (scripts/gpu-check runs both). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <mma.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_ops.h"
#include "cuda/unit32.h"

extern "C" {
#include "tandem/moe_ops.h"
}

/* ---- experts_q: the grouped kernels ---- */


#define GQ_NT 2 /* tokens a pass over a row dots with its widened values */

/* The decode kernels read a row 256 values (a chunk) at a time, the warp's lanes side by side:
 * lane l takes 8 of a chunk's values, laid out in the row as R runs of L consecutive values, S
 * apart, from p0 (lane8 below), so that a warp's loads of a chunk's blocks, and of the
 * activations, are contiguous across lanes (a few wide loads a chunk, not two bytes a lane). */
template <int T> struct qlay { enum { R = 1, L = 8, S = 0 }; };     /* F16, Q8_0 */
template <> struct qlay<TDM_MOE_W_Q4_K> { enum { R = 2, L = 4, S = 32 }; };
template <> struct qlay<TDM_MOE_W_Q5_K> { enum { R = 2, L = 4, S = 32 }; };
template <> struct qlay<TDM_MOE_W_MXFP4> { enum { R = 2, L = 4, S = 16 }; };
template <> struct qlay<TDM_MOE_W_Q6_K> { enum { R = 4, L = 2, S = 32 }; };


/* Lane `lane`'s 8 values of chunk c of a row of K values of type T, in moe/quant.h's f32
 * operations: v[L r + e] is the value at p0 + S r + e. Returns p0, or -1 where the lane's
 * values lie past K (a row of Q8_0, MXFP4 or F16 whose length is not a multiple of 256); with
 * Check false the caller knows the chunk is whole (c < K / 256), and no test is made. */
template <int T, bool Check = true>
static __device__ __forceinline__ int lane8(const uint8_t *row, int c, int lane, int K,
                                            float v[8]) {
  if (T == TDM_MOE_W_Q4_K) {
    const uint8_t *b = row + 144 * (size_t)c;
    const int pr = lane >> 3, i = 4 * (lane & 7);
    float d1[2], m1[2];
#pragma unroll
    for (int h = 0; h < 2; h++) q4k_scale<true>(b, 2 * pr + h, &d1[h], &m1[h]);
    const uint32_t q = ld32(b + 16 + 32 * pr + i);
#pragma unroll
    for (int e = 0; e < 4; e++) {
      v[e] = d1[0] * (float)((q >> (8 * e)) & 0xF) - m1[0];
      v[4 + e] = d1[1] * (float)((q >> (8 * e + 4)) & 0xF) - m1[1];
    }
    return 256 * c + 64 * pr + i;
  } else if (T == TDM_MOE_W_Q5_K) { /* Q4_K's lanes, with bits 2 pr and 2 pr + 1 of qh */
    const uint8_t *b = row + 176 * (size_t)c;
    const int pr = lane >> 3, i = 4 * (lane & 7);
    float d1[2], m1[2];
#pragma unroll
    for (int h = 0; h < 2; h++) q4k_scale<true>(b, 2 * pr + h, &d1[h], &m1[h]);
    const uint32_t q = ld32(b + 48 + 32 * pr + i), qh = ld32(b + 16 + i) >> (2 * pr);
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const uint32_t hb = qh >> (8 * e);
      v[e] = d1[0] * (float)(((q >> (8 * e)) & 0xF) | (hb & 1) << 4) - m1[0];
      v[4 + e] = d1[1] * (float)(((q >> (8 * e + 4)) & 0xF) | (hb & 2) << 3) - m1[1];
    }
    return 256 * c + 64 * pr + i;
  } else if (T == TDM_MOE_W_Q6_K) {
    const uint8_t *b = row + 210 * (size_t)c;
    const int h = lane >> 4, i = 2 * (lane & 15);
    const uint16_t lo0 = ld16(b + 64 * h + i), lo1 = ld16(b + 64 * h + 32 + i);
    const uint16_t hi = ld16(b + 128 + 32 * h + i);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * h;
    const float d = f16_at(b + 208);
#pragma unroll
    for (int qq = 0; qq < 4; qq++) { /* quarter qq: values 32 qq + i, + 1 of the half */
      const float ds = d * (float)__ldg(sc + 2 * qq + (i >= 16));
      const uint16_t lo = (qq & 1) ? lo1 : lo0;
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int q = (((lo >> (8 * e)) >> ((qq >> 1) * 4)) & 0xF) |
                      ((((hi >> (8 * e)) >> (2 * qq)) & 3) << 4);
        v[2 * qq + e] = ds * (float)(int8_t)(q - 32);
      }
    }
    return 256 * c + 128 * h + i;
  } else if (T == TDM_MOE_W_Q8_0) {
    const int bk = 8 * c + (lane >> 2), m = lane & 3;
    if (Check && 32 * bk >= K) return -1;
    const uint8_t *b = row + 34 * (size_t)bk;
    const float d = f16_at(b);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const uint16_t q = ld16(b + 2 + 8 * m + e);
      v[e] = (float)(int8_t)(q & 0xff) * d;
      v[e + 1] = (float)(int8_t)(q >> 8) * d;
    }
    return 32 * bk + 8 * m;
  } else if (T == TDM_MOE_W_MXFP4) {
    const int bk = 8 * c + (lane >> 2), m = lane & 3;
    if (Check && 32 * bk >= K) return -1;
    const uint8_t *b = row + 17 * (size_t)bk;
    const uint32_t ex = __ldg(b);
    const float d = __uint_as_float(ex < 2 ? 0x00200000u << ex : (ex - 1) << 23);
    const uint32_t kv = 0xC8643210u; /* E2M1 doubled by the low 3 bits of a code; bit 3 the sign */
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const uint32_t q = __ldg(b + 1 + 4 * m + e);
      const float lo = (float)((kv >> (4 * (q & 7))) & 15);
      const float hi = (float)((kv >> (4 * ((q >> 4) & 7))) & 15);
      v[e] = ((q & 8) ? -lo : lo) * d;
      v[4 + e] = ((q & 0x80) ? -hi : hi) * d;
    }
    return 32 * bk + 4 * m;
  } else { /* TDM_MOE_W_F16 */
    const int p0 = 256 * c + 8 * lane;
    if (Check && p0 >= K) return -1;
    const uint8_t *p = row + 2 * (size_t)p0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const uint32_t w = ld32(p + 4 * e);
      v[2 * e] = __half2float(__ushort_as_half((unsigned short)(w & 0xffff)));
      v[2 * e + 1] = __half2float(__ushort_as_half((unsigned short)(w >> 16)));
    }
    return p0;
  }
}

/* acc += the lane's 8 values dotted with the activations at xr, in ascending order. */
template <int T>
static __device__ __forceinline__ float dot8(const float *xr, int p0, const float v[8],
                                             float acc) {
  constexpr int R = qlay<T>::R, L = qlay<T>::L, S = qlay<T>::S;
#pragma unroll
  for (int r = 0; r < R; r++) {
    const float *xp = xr + p0 + S * r;
    float xs[L];
    if (L == 8) {
      const float4 a = *(const float4 *)xp, b = *(const float4 *)(xp + 4);
      const float t[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < L; e++) xs[e] = t[e];
    } else if (L == 4) {
      const float4 a = *(const float4 *)xp;
      const float t[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int e = 0; e < L; e++) xs[e] = t[e];
    } else {
      const float2 a = *(const float2 *)xp;
      const float t[2] = {a.x, a.y};
#pragma unroll
      for (int e = 0; e < L; e++) xs[e] = t[e];
    }
#pragma unroll
    for (int e = 0; e < L; e++) acc = fmaf(xs[e], v[L * r + e], acc);
  }
  return acc;
}

/* The chunk loops below run a row's whole chunks unrolled U at a time (no test between them,
 * so that the loads of U chunks are in flight together: one chunk a warp leaves the kernel
 * waiting on memory at one token), then the row's last, partial chunk with its test. The
 * order of every lane's sums is the chunk order either way. Two at a time: on an H100, 1, 2
 * and 4 were within 10% of each other, 2 the fastest for four of five formats
 * (bench/results/h100-qdecode-8dc3b50/unroll*-9d9222d.json). */
static constexpr int GQ_UNROLL = 2;

/* One chunk c of a gate row wg and an up row wu, dotted with NT tokens' activations xr. */
template <int T, int NT, bool Check>
static __device__ __forceinline__ void gu_chunk(const uint8_t *wg, const uint8_t *wu, int c,
                                                int lane, int H, const float *const *xr,
                                                float *ag, float *au) {
  float gv[8], uv[8];
  const int p0 = lane8<T, Check>(wg, c, lane, H, gv);
  if (Check && p0 < 0) return;
  lane8<T, false>(wu, c, lane, H, uv);
#pragma unroll
  for (int t = 0; t < NT; t++) {
    ag[t] = dot8<T>(xr[t], p0, gv, ag[t]);
    au[t] = dot8<T>(xr[t], p0, uv, au[t]);
  }
}

template <int T, int NT>
static __device__ __forceinline__ void gu_rows(const uint8_t *wg, const uint8_t *wu, int lane,
                                               int H, const float *const *xr, float *ag,
                                               float *au) {
  const int whole = H / 256;
#pragma unroll GQ_UNROLL
  for (int c = 0; c < whole; c++) gu_chunk<T, NT, false>(wg, wu, c, lane, H, xr, ag, au);
  if (whole * 256 < H) gu_chunk<T, NT, true>(wg, wu, whole, lane, H, xr, ag, au);
}

/* One chunk k of a down row wd, dotted with NT tokens' hidden rows hr. */
template <int T, int NT, bool Check>
static __device__ __forceinline__ void d_chunk(const uint8_t *wd, int k, int lane, int I,
                                               const float *const *hr, float *acc) {
  float wv[8];
  const int p0 = lane8<T, Check>(wd, k, lane, I, wv);
  if (Check && p0 < 0) return;
#pragma unroll
  for (int t = 0; t < NT; t++) acc[t] = dot8<T>(hr[t], p0, wv, acc[t]);
}

template <int T, int NT>
static __device__ __forceinline__ void d_row(const uint8_t *wd, int lane, int I,
                                             const float *const *hr, float *acc) {
  const int whole = I / 256;
#pragma unroll GQ_UNROLL
  for (int k = 0; k < whole; k++) d_chunk<T, NT, false>(wd, k, lane, I, hr, acc);
  if (whole * 256 < I) d_chunk<T, NT, true>(wd, whole, lane, I, hr, acc);
}

/* Gate/up row r of an entry's expert for its tokens, GQ_NT at a time: h[entry][r] = SiLU(g) u.
 * A token whose row lies outside x's allocation is not written; it is dotted with row 0
 * instead (at least one of the pair's rows is in x then), so the chunk loop has no test. */
template <int T>
static __global__ void __launch_bounds__(MOE_THREADS)
    gq_gate_up_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int n,
                      const uint8_t *wbase, long long wlimit, long long ebytes,
                      const tdm_moe_group *groups, int H, int I, size_t rb, float *h) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int r = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= I || !qentry_ok(g, n, wlimit, ebytes)) return; /* whole warps leave */
  const uint8_t *wg = wbase + 2 * g.w + (size_t)r * rb, *wu = wg + (size_t)I * rb;
  for (int t0 = 0; t0 < g.count; t0 += GQ_NT) {
    const int nt = min(GQ_NT, g.count - t0);
    const float *xr[GQ_NT];
    bool ok[GQ_NT], any = false;
    float ag[GQ_NT], au[GQ_NT];
#pragma unroll
    for (int t = 0; t < GQ_NT; t++) {
      const uint32_t row = t < nt ? (uint32_t)rows[g.first + t0 + t] : xlimit;
      ok[t] = row < xlimit;
      any |= ok[t];
      xr[t] = ok[t] ? x + (size_t)row * H : x;
      ag[t] = au[t] = 0.f;
    }
    if (!any) continue;
    if (nt == 1)
      gu_rows<T, 1>(wg, wu, lane, H, xr, ag, au);
    else
      gu_rows<T, GQ_NT>(wg, wu, lane, H, xr, ag, au);
#pragma unroll
    for (int t = 0; t < GQ_NT; t++) {
      if (t >= nt) break;
      float gs = warp_sum(ag[t]), us = warp_sum(au[t]);
      if (lane == 0 && ok[t]) h[((size_t)g.first + t0 + t) * I + r] = gs / (1.f + expf(-gs)) * us;
    }
  }
}

/* Down row c of an entry's expert: out[slot][c] = h . Wd[c], for its tokens (a slot outside
 * out's allocation, or a token whose row lies outside x's, is not written). */
template <int T>
static __global__ void __launch_bounds__(MOE_THREADS)
    gq_down_kernel(const float *h, const int32_t *rows, uint32_t xlimit, const int32_t *slot,
                   uint32_t olimit, int n, const uint8_t *wbase, long long wlimit,
                   long long ebytes, const tdm_moe_group *groups, int H, int I, size_t gu_rb,
                   size_t rb, float *out) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int c = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (c >= H || !qentry_ok(g, n, wlimit, ebytes)) return;
  const uint8_t *wd = wbase + 2 * g.w + 2 * (size_t)I * gu_rb + (size_t)c * rb;
  for (int t0 = 0; t0 < g.count; t0 += GQ_NT) {
    const int nt = min(GQ_NT, g.count - t0);
    const float *hr[GQ_NT];
    float acc[GQ_NT];
#pragma unroll
    for (int t = 0; t < GQ_NT; t++) {
      hr[t] = h + ((size_t)g.first + t0 + min(t, nt - 1)) * I;
      acc[t] = 0.f;
    }
    if (nt == 1)
      d_row<T, 1>(wd, lane, I, hr, acc);
    else
      d_row<T, GQ_NT>(wd, lane, I, hr, acc);
#pragma unroll
    for (int t = 0; t < GQ_NT; t++) {
      if (t >= nt) break;
      uint32_t s = (uint32_t)slot[g.first + t0 + t];
      bool ok = s < olimit && (uint32_t)rows[g.first + t0 + t] < xlimit;
      float v = warp_sum(acc[t]);
      if (lane == 0 && ok) out[(size_t)s * H + c] = v;
    }
  }
}

/* ---- expert_q: widened to bf16, then expert()'s GEMMs ---- */

/* Rows [0, nrows) of K values of type T at w (rb bytes each) into bf16 rows at dst, one warp a
 * row. */
template <int T>
static __global__ void __launch_bounds__(MOE_THREADS)
    widen_rows_kernel(const uint8_t *w, size_t rb, int nrows, int K, uint16_t *dst) {
  const int r = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= nrows) return;
  const uint8_t *row = w + (size_t)r * rb;
  uint16_t *out = dst + (size_t)r * K;
  for (int u = lane; u < K / 32; u += 32) {
    float v[32];
    unit32<T>(row, u, v);
    uint4 *o = (uint4 *)(out + 32 * u);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      uint32_t p[4];
#pragma unroll
      for (int i = 0; i < 4; i++)
        p[i] = f32_to_bf16(v[8 * k + 2 * i]) | (uint32_t)f32_to_bf16(v[8 * k + 2 * i + 1]) << 16;
      o[k] = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
}

/* ---- expert_q's fused GEMM ---- */

#define QG_BM 64 /* tokens a block */
#define QG_BN 64 /* weight rows (outputs) a block */
#define QG_PAD 8 /* bf16 of padding a shared row: 80 bytes, off the banks' period */

/* C [n x N] (f32, row stride N) = A W^T: A bf16 [n x K] (rows of lda elements), W N rows of K
 * values of type T (rb bytes each). 128 threads: warp w computes the 32 x 32 tile of tokens
 * (w / 2) 32.. and rows (w % 2) 32.. of the block's 64 x 64, in 16 x 16 WMMA fragments; per
 * step of 32 along K, threads 0..63 widen one weight row's unit each into shared memory and
 * every thread loads 16 of A's values. */
template <int T>
static __global__ void __launch_bounds__(128)
    qgemm_kernel(const uint16_t *A, int lda, int n, const uint8_t *W, size_t rb, int N, int K,
                 float *C) {
  using namespace nvcuda;
  __shared__ __align__(32) __nv_bfloat16 As[QG_BM][32 + QG_PAD];
  __shared__ __align__(32) __nv_bfloat16 Bs[QG_BN][32 + QG_PAD];
  __shared__ __align__(32) float Cs[QG_BM][QG_BN + 4];
  const int tid = threadIdx.x, warp = tid >> 5;
  const int m0 = blockIdx.y * QG_BM, n0 = blockIdx.x * QG_BN;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.f);
  for (int k0 = 0; k0 < K; k0 += 32) {
    { /* A: token row tid / 2, values 16 (tid % 2) .. + 16 (zeros past n) */
      const int r = tid >> 1, c = (tid & 1) * 16;
      uint16_t *dst = (uint16_t *)&As[r][c];
      if (m0 + r < n) {
        const uint16_t *src = A + (size_t)(m0 + r) * lda + k0 + c;
#pragma unroll
        for (int j = 0; j < 16; j++) dst[j] = src[j];
      } else {
#pragma unroll
        for (int j = 0; j < 16; j++) dst[j] = 0;
      }
    }
    if (tid < QG_BN) { /* B: weight row n0 + tid, unit k0 / 32 (zeros past N) */
      float v[32];
      if (n0 + tid < N)
        unit32<T>(W + (size_t)(n0 + tid) * rb, k0 >> 5, v);
      else
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = 0.f;
      uint16_t *dst = (uint16_t *)&Bs[tid][0];
#pragma unroll
      for (int j = 0; j < 32; j++) dst[j] = f32_to_bf16(v[j]);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 32; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], &As[wm + 16 * i][kk], 32 + QG_PAD);
#pragma unroll
      for (int j = 0; j < 2; j++) wmma::load_matrix_sync(b[j], &Bs[wn + 16 * j][kk], 32 + QG_PAD);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++)
      wmma::store_matrix_sync(&Cs[wm + 16 * i][wn + 16 * j], acc[i][j], QG_BN + 4,
                              wmma::mem_row_major);
  __syncthreads();
  for (int e = tid; e < QG_BM * QG_BN; e += 128) {
    const int r = e / QG_BN, c = e % QG_BN;
    if (m0 + r < n && n0 + c < N) C[(size_t)(m0 + r) * N + n0 + c] = Cs[r][c];
  }
}

/* What expert_q's fused GEMMs need to know of the expert: the types and rows' bytes. */
typedef struct qgemm_ctx {
  tdm_moe_wfmt fmt;
  size_t gu_rb, d_rb;
} qgemm_ctx;

static int gemm_fused(moe_cuda *m, int ntok, int N, int K, const void *A, int a_stride,
                      const void *W, bool down, float *C, const void *ctx) {
  const qgemm_ctx *q = (const qgemm_ctx *)ctx;
  const int t = down ? q->fmt.d : q->fmt.gu;
  const size_t rb = down ? q->d_rb : q->gu_rb;
  const uint16_t *a = (const uint16_t *)A;
  const uint8_t *w = (const uint8_t *)W;
  const dim3 grid((unsigned)((N + QG_BN - 1) / QG_BN), (unsigned)((ntok + QG_BM - 1) / QG_BM));
  BY_QTYPE(t, qgemm_kernel<QT><<<grid, 128, 0, m->s>>>(a, a_stride, ntok, w, rb, N, K, C));
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : cuda_fail(m, e, "the fused quantized expert GEMM");
}

/* TANDEM_MOE_CUDA_QGEMM=fused: expert_q's GEMMs read the blocks (qgemm_kernel). */
static bool qgemm_fused(void) {
  const char *v = getenv("TANDEM_MOE_CUDA_QGEMM");
  return v && strcmp(v, "fused") == 0;
}

/* ---- dispatch ---- */

/* Whether the CUDA kernels take type t for rows of K values: a type of moe_ops.h, K a
 * multiple of its block and of 32. */
static bool type_ok(int t, int K) {
  return t != TDM_MOE_W_BF16 && tdm_moe_row_bytes(t, K) && K % 32 == 0;
}

static bool is_bf16(tdm_moe_wfmt f) { return f.gu == TDM_MOE_W_BF16 && f.d == TDM_MOE_W_BF16; }

static int check_fmt(tdm_moe_wfmt fmt, int H, int I, const char *op) {
  if (type_ok(fmt.gu, H) && type_ok(fmt.d, I) && tdm_moe_expert_size(fmt, H, I)) return 0;
  return tdm_set_error(TDM_EINVAL, 0,
                       "moe %s: weight format {%d, %d} with H=%d, I=%d: a type the CUDA table "
                       "lacks, or rows that are not whole blocks (and multiples of 32)", op,
                       fmt.gu, fmt.d, H, I);
}

/* Bytes from w to the end of the tandem allocation holding it (memory tandem does not know:
 * as many as a long long names; the caller vouches). */
static long long bytes_in(const void *w) {
  tdm_mem_info mi;
  if (tdm_mem_query(w, &mi) == 0 && mi.base)
    return (long long)((const char *)mi.base + mi.size - (const char *)w);
  return LLONG_MAX;
}

int cuda_experts_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                   const int32_t *slot, int n, const void *wbase, tdm_moe_wfmt fmt,
                   const tdm_moe_group *groups, int G, int H, int I, float *out,
                   void *workspace, size_t workspace_bytes) {
  if (is_bf16(fmt))
    return cuda_experts(st, q, x, rows, slot, n, (const tdm_moe_bf16 *)wbase, groups, G, H, I,
                        out, workspace, workspace_bytes);
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || n < 0 || G < 0 || G > 65535 || H <= 0 || I <= 0)
    return bad_args("experts");
  int rc = check_fmt(fmt, H, I, "experts");
  if (rc) return rc;
  if (n == 0 || G == 0) return 0;
  if (!x || !rows || !slot || !wbase || !groups || !out || !workspace ||
      ((uintptr_t)workspace & 15) || ((uintptr_t)x & 15) || ((uintptr_t)wbase & 1))
    return bad_args("experts");
  size_t contract = tdm_moe__workspace(n, H, I);
  if (!contract || workspace_bytes < contract)
    return tdm_set_error(TDM_EINVAL, 0, "moe experts: a workspace of %zu bytes; n=%d H=%d I=%d "
                         "need %zu", workspace_bytes, n, H, I, contract);
  uint32_t xlimit = cuda_rows_in(x, H), olimit = cuda_rows_in(out, H);
  long long wlimit = bytes_in(wbase), ebytes = (long long)tdm_moe_expert_size(fmt, H, I);
  size_t gu_rb = tdm_moe_row_bytes(fmt.gu, H), d_rb = tdm_moe_row_bytes(fmt.d, I);
  float *h = (float *)workspace;
  const uint8_t *wb = (const uint8_t *)wbase;
  const dim3 gu_grid((unsigned)((I + MOE_WARPS - 1) / MOE_WARPS), (unsigned)G);
  const dim3 down_grid((unsigned)((H + MOE_WARPS - 1) / MOE_WARPS), (unsigned)G);
  int saved;
  if ((rc = enter(m, &saved))) return rc;
  cudaError_t e;
  if (cuda_gmm_takes(n, H, I, x)) { /* many tokens (prefill): gmm.cu */
    e = cuda_gmm(m, x, xlimit, rows, slot, olimit, n, wb, wlimit, ebytes, fmt.gu, fmt.d, groups,
                 G, H, I, gu_rb, d_rb, workspace, out);
    rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "the grouped quantized expert GEMMs");
    leave(m, saved);
    return rc;
  }
  /* Q4_K or Q8_0 gate/up rows and Q4_K, Q6_K or Q8_0 down rows on 16-bit activations
   * (q16.cu): their scratch after h (the workspace's contract leaves far more room than these
   * take) */
  unsigned char *ws = (unsigned char *)workspace;
  const size_t q16_at = ((size_t)n * I * sizeof(float) + 255) / 256 * 256,
               d16_at = q16_at + cuda_q16_scratch(n, H);
  const bool fits = d16_at + cuda_q16_down_scratch(n, I) <= workspace_bytes;
  if (cuda_q16_gate_up_takes(fmt.gu) && m->q16 && fits)
    e = cuda_gate_up_q16(m, x, xlimit, rows, n, wb, wlimit, ebytes, fmt.gu, groups, G, H, I,
                         gu_rb, h, ws + q16_at);
  else
    BY_QTYPE(fmt.gu, e = launch_pdl(m, gq_gate_up_kernel<QT>, gu_grid, MOE_THREADS, 0, x,
                                    xlimit, rows, n, wb, wlimit, ebytes, groups, H, I, gu_rb,
                                    h));
  if (e == cudaSuccess && cuda_q16_down_takes(fmt.d) && m->q16 && fits)
    e = cuda_down_q16(m, h, rows, xlimit, slot, olimit, n, wb, wlimit, ebytes, fmt.d, groups, G,
                      H, I, gu_rb, d_rb, out, ws + d16_at);
  else if (e == cudaSuccess)
    BY_QTYPE(fmt.d, e = launch_pdl(m, gq_down_kernel<QT>, down_grid, MOE_THREADS, 0,
                                   (const float *)h, rows, xlimit, slot, olimit, n, wb, wlimit,
                                   ebytes, groups, H, I, gu_rb, d_rb, out));
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "the quantized grouped expert kernels");
  leave(m, saved);
  return rc;
}

/* Rows of one type widened to bf16 (widen_rows_kernel). */
static cudaError_t widen_rows(moe_cuda *m, int t, const uint8_t *w, size_t rb, int nrows, int K,
                              uint16_t *dst) {
  const dim3 grid((unsigned)((nrows + MOE_WARPS - 1) / MOE_WARPS));
  BY_QTYPE(t, widen_rows_kernel<QT><<<grid, MOE_THREADS, 0, m->s>>>(w, rb, nrows, K, dst));
  return cudaGetLastError();
}

int cuda_expert_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                  const int32_t *slot, int n, const void *w, tdm_moe_wfmt fmt, int H, int I,
                  float *out, void *workspace, size_t workspace_bytes) {
  if (is_bf16(fmt))
    return cuda_expert(st, q, x, rows, slot, n, (const tdm_moe_bf16 *)w, H, I, out, workspace,
                       workspace_bytes);
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || n < 0 || H <= 0 || I <= 0 || I > INT_MAX / 4) return bad_args("expert");
  int rc = check_fmt(fmt, H, I, "expert");
  if (rc) return rc;
  if (n == 0) return 0;
  if (!x || !rows || !slot || !w || !out || !workspace || ((uintptr_t)workspace & 15) ||
      ((uintptr_t)w & 1))
    return bad_args("expert");
  /* expert()'s layout, then the widened expert (3HI bf16, 16-byte aligned) after its output */
  size_t contract = tdm_moe__workspace(n, H, I);
  size_t at = (cuda_expert_off_o((size_t)n, (size_t)I) + 4 * (size_t)n * H + 255) / 256 * 256;
  if (!contract || workspace_bytes < contract || at + 6 * (size_t)H * I > workspace_bytes)
    return tdm_set_error(TDM_EINVAL, 0, "moe expert: a workspace of %zu bytes; n=%d H=%d I=%d "
                         "need %zu", workspace_bytes, n, H, I, contract);
  unsigned char *ws = (unsigned char *)workspace;
  uint16_t *wide = (uint16_t *)(ws + at);
  const uint8_t *wb = (const uint8_t *)w;
  size_t gu_rb = tdm_moe_row_bytes(fmt.gu, H), d_rb = tdm_moe_row_bytes(fmt.d, I);
  int saved;
  if ((rc = enter(m, &saved))) return rc;
  if (qgemm_fused()) {
    const qgemm_ctx ctx = {fmt, gu_rb, d_rb};
    rc = cuda_run_expert_with(m, x, rows, slot, n, wb, wb + 2 * (size_t)I * gu_rb, H, I, out,
                              ws, gemm_fused, &ctx);
    leave(m, saved);
    return rc;
  }
  cudaError_t e = widen_rows(m, fmt.gu, wb, gu_rb, 2 * I, H, wide);
  if (e == cudaSuccess)
    e = widen_rows(m, fmt.d, wb + 2 * (size_t)I * gu_rb, d_rb, H, I, wide + 2 * (size_t)I * H);
  rc = e == cudaSuccess ? cuda_run_expert(m, x, rows, slot, n, wide, H, I, out, ws)
                        : cuda_fail(m, e, "widening a quantized expert");
  leave(m, saved);
  return rc;
}

/* ---- matmul_q: a projection in its blocks (the experts' block types and Q5_K) ----
 * A few tokens (decode) read each row once, as experts_q's decode kernels read an expert's
 * rows: a warp a row, 256 values at a time with the lanes side by side (lane8), dotted with
 * every token in a fixed order, then the fixed warp tree. More tokens widen pieces of w to f32
 * in the workspace (a warp a row, 32 values a lane at a time) and multiply each piece with
 * SGEMM, as matmul_h does. */

#define MQ_MAX_T 8 /* tokens the one-pass kernel takes */

/* Row `row` of K values dotted with NT tokens' activations (x, K apart; tokens past nt read
 * the last one's, and are not written), the whole chunks unrolled as experts_q's are. */
template <int T, int NT, bool Check>
static __device__ __forceinline__ void mq_chunk(const uint8_t *row, int c, int lane, int K,
                                                const float *x, int nt, float *acc) {
  float v[8];
  const int p0 = lane8<T, Check>(row, c, lane, K, v);
  if (Check && p0 < 0) return;
#pragma unroll
  for (int t = 0; t < NT; t++) acc[t] = dot8<T>(x + (size_t)min(t, nt - 1) * K, p0, v, acc[t]);
}

template <int T, int NT>
static __device__ __forceinline__ void mq_row(float *y, const float *x, const uint8_t *row,
                                              int nt, int K, int N, int n, int beta) {
  const int lane = threadIdx.x & 31, whole = K / 256;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; t++) acc[t] = 0.f;
#pragma unroll GQ_UNROLL
  for (int c = 0; c < whole; c++) mq_chunk<T, NT, false>(row, c, lane, K, x, nt, acc);
  if (whole * 256 < K) mq_chunk<T, NT, true>(row, whole, lane, K, x, nt, acc);
#pragma unroll
  for (int t = 0; t < NT; t++) {
    if (t >= nt) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) {
      float *yo = y + (size_t)t * N + n;
      *yo = beta ? *yo + s : s;
    }
  }
}

template <int T>
static __global__ void __launch_bounds__(MOE_THREADS)
    mq_gemv_kernel(float *y, const float *x, const uint8_t *w, size_t rb, int nt, int K, int N,
                   int beta) {
  wait_prior_grid();
  const int n = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  const uint8_t *row = w + (size_t)n * rb;
  if (nt == 1)
    mq_row<T, 1>(y, x, row, nt, K, N, n, beta);
  else if (nt == 2)
    mq_row<T, 2>(y, x, row, nt, K, N, n, beta);
  else if (nt <= 4)
    mq_row<T, 4>(y, x, row, nt, K, N, n, beta);
  else
    mq_row<T, MQ_MAX_T>(y, x, row, nt, K, N, n, beta);
}

template <int T>
static __global__ void __launch_bounds__(MOE_THREADS)
    mq_widen_kernel(const uint8_t *w, size_t rb, int nrows, int K, float *dst) {
  const int r = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= nrows) return;
  const uint8_t *row = w + (size_t)r * rb;
  float4 *out = (float4 *)(dst + (size_t)r * K);
  for (int u = lane; u < K / 32; u += 32) {
    float v[32];
    unit32<T>(row, u, v);
#pragma unroll
    for (int k = 0; k < 8; k++)
      out[8 * u + k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
}

static cudaError_t widen_q(moe_cuda *m, const void *w, int wtype, size_t n0, size_t c, int K,
                           float *dst) {
  const size_t rb = tdm_moe_row_bytes(wtype, K);
  const uint8_t *wb = (const uint8_t *)w + n0 * rb;
  const dim3 grid((unsigned)((c + MOE_WARPS - 1) / MOE_WARPS));
  BY_MQTYPE(wtype, mq_widen_kernel<QT><<<grid, MOE_THREADS, 0, m->s>>>(wb, rb, (int)c, K, dst));
  return cudaGetLastError();
}

int cuda_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w, int wtype,
                  int T, int K, int N, float beta, void *ws, size_t ws_bytes) {
  moe_cuda *m = (moe_cuda *)st;
  if (wtype < TDM_MOE_W_Q8_0 || wtype > TDM_MOE_W_Q5_K || !type_ok(wtype, K))
    return tdm_set_error(TDM_EINVAL, 0, "moe matmul_q: weight type %d with rows of %d values: "
                         "not a block type, or rows that are not whole blocks", wtype, K);
  if (check_queue(m, q) || !y || !x || !w || T < 0 || N <= 0 || (beta != 0.f && beta != 1.f) ||
      ((uintptr_t)x & 15) || ((uintptr_t)ws & 15) ||
      (T > MQ_MAX_T && (!ws || ws_bytes / sizeof(float) < (size_t)K)))
    return bad_args("matmul_q");
  if (T == 0) return 0;
  const size_t rb = tdm_moe_row_bytes(wtype, K);
  const uint8_t *wb = (const uint8_t *)w;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  if (T <= MQ_MAX_T) {
    const dim3 grid((unsigned)((N + MOE_WARPS - 1) / MOE_WARPS));
    cudaError_t e;
    BY_MQTYPE(wtype, e = launch_pdl(m, mq_gemv_kernel<QT>, grid, MOE_THREADS, 0, y, x, wb, rb, T,
                                   K, N, (int)(beta != 0.f)));
    rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "mq_gemv_kernel");
    leave(m, saved);
    return rc;
  }
  rc = cuda_widened_gemm(m, widen_q, w, wtype, false, y, x, T, K, N, beta, ws, ws_bytes);
  leave(m, saved);
  return rc;
}

/* Loads this file's kernels at open(), every type's, as preload in cuda/ops.cu does its own. */
template <int T>
static int quant_preload_type(moe_cuda *m) {
  const void *k[] = {(const void *)gq_gate_up_kernel<T>, (const void *)gq_down_kernel<T>,
                     (const void *)widen_rows_kernel<T>, (const void *)qgemm_kernel<T>,
                     (const void *)mq_gemv_kernel<T>, (const void *)mq_widen_kernel<T>};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, k[i]));
  }
  return 0;
}

int cuda_quant_preload(moe_cuda *m) {
  int rc = quant_preload_type<TDM_MOE_W_Q8_0>(m);
  if (!rc) rc = quant_preload_type<TDM_MOE_W_Q4_K>(m);
  if (!rc) rc = quant_preload_type<TDM_MOE_W_Q6_K>(m);
  if (!rc) rc = quant_preload_type<TDM_MOE_W_MXFP4>(m);
  if (!rc) rc = quant_preload_type<TDM_MOE_W_F16>(m);
  if (!rc) { /* Q5_K: matmul_q's kernels only, a projection's type */
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, (const void *)mq_gemv_kernel<TDM_MOE_W_Q5_K>));
    CK_CUDA(cudaFuncGetAttributes(&a, (const void *)mq_widen_kernel<TDM_MOE_W_Q5_K>));
  }
  if (!rc) rc = cuda_q16_preload(m);
  return rc ? rc : cuda_gmm_preload(m);
}
