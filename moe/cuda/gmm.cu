/* cuda/gmm.cu: experts() and experts_q() on many tokens an expert (prefill): every entry of the
 * table in two tensor-core launches, gate|up with SwiGLU, then down, each reading the weights
 * in their format (unit32.h), widened to bf16 a 32-value step at a time in shared memory.
 *
 * A block computes a tile of 64 of an entry's tokens against 128 weight rows: gate/up takes
 * 64 gate rows and the 64 up rows of the same outputs, so SwiGLU is applied to the
 * accumulators (a gate fragment and its up fragment hold the same elements), and h leaves as
 * bf16 [n x I] at the entries' token positions; down takes 128 rows of Wd and writes each
 * token's output row at its slot. Activations are bf16, as expert()'s GEMMs have them: a first
 * launch gathers each entry's row of x rounded to bf16 (the workspace's xb [n x H], after h),
 * so that a tile's activations are contiguous rows that the copy engine of each SM
 * (cp.async) brings into shared memory as they lie; sums are f32 (WMMA 16 x 16 x 16).
 *
 * The grid's x runs over tiles of tokens: ceil(n / 64) + G of them cover every entry's tiles
 * (each entry adds at most one partial tile), and a block finds its entry by a warp's scan of
 * the table (device data, read when the kernel runs), so that the host never learns the
 * counts. A bad entry (moe_ops.h: rows outside [0, n), weights outside the allocation) counts
 * no tiles and is skipped whole; a token whose row lies outside x's allocation, or whose slot
 * outside out's, has its slot left unwritten. A token's result depends on its expert, its own
 * activations and the type only: the tile it falls in, its neighbours and G do not change a bit
 * (each output element is one fragment's sum over K in a fixed order).
 *
 * Each step of KS values (a superblock) of the weight rows is copied into shared memory as it
 * lies, asynchronously (cp.async), a step ahead of the one the tensor cores work on; each 32
 * values of it are widened from there to bf16 while the tensor cores work on the 32 before
 * (two shared buffers of each). The activations' 32 values go the same way two 32s ahead, into
 * a ring of GM_NA tiles: one barrier a 32. The 4- and 6-bit types widen two values an
 * instruction in bf16 pairs (a code's bits put into the mantissa of 128.0, 128 taken off, then
 * one fused multiply-add with the sub-block's scale and offset rounded to bf16); Q8_0 through
 * f32 the same way (2^23 + 128 taken off). No integer-to-float conversion is issued: that
 * unit takes 16 a clock on an SM, an eighth of the adds. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <mma.h>
#include <stdint.h>

#include "cuda/cuda_ops.h"
#include "cuda/unit32.h"

#define GM_BR 128      /* weight rows a tile */
#define GM_THREADS 256 /* 8 warps: BM / 32 along the tokens (BM: 64 or 128 a tile), the rest
                        * along the rows */
#define GM_LD 40       /* bf16 a shared row: 32 values and 8 of padding (80 bytes, off the banks) */
#define GM_CLD (GM_BR + 4) /* floats a row of the epilogue's tile */
#define GM_NA 3            /* activation tiles in flight: the one in use and two copying */

/* A step of K for type T: KS values (a superblock of the K-quants, 8 blocks of Q8_0 or MXFP4,
 * 128 F16 or BF16), staged RB bytes a row (UB a 32-value unit where the units are separate),
 * RBP apart in shared memory (4-byte multiples of an odd count: off the banks; room for the
 * 1-3 bytes before a row that does not start at a multiple of 4, copied with it), twice; then
 * GM_NA bf16 activation tiles (tokens) and two weight tiles (rows). */
template <int T, int BM> struct gm_t {
  static constexpr bool kq = T == TDM_MOE_W_Q4_K || T == TDM_MOE_W_Q6_K;
  static constexpr int KS = T == TDM_MOE_W_F16 || T == TDM_MOE_W_BF16 ? 128 : 256;
  static constexpr int UB = T == TDM_MOE_W_Q8_0 ? 34 : T == TDM_MOE_W_MXFP4 ? 17 : 64;
  static constexpr int RB = T == TDM_MOE_W_Q4_K ? 144 : T == TDM_MOE_W_Q6_K ? 210 : KS / 32 * UB;
  static constexpr int W = (RB + 3 + 3) / 4;
  static constexpr int RBP = 4 * (W % 2 ? W : W + 1);
  static constexpr int SUBS = KS / 32; /* 32-value units a step */
  static constexpr int WT = BM / 32, WR = GM_THREADS / 32 / WT; /* warps along tokens, rows */
  static constexpr int NJ = GM_BR / 16 / WR; /* a warp's 16-row fragments: 2 or 4 */
  static constexpr int A_TILE = BM * GM_LD, B_TILE = GM_BR * GM_LD; /* bf16 */
  static constexpr int MAIN = 2 * GM_BR * RBP + (GM_NA * A_TILE + 2 * B_TILE) * 2;
  static constexpr int C = BM * GM_CLD * 4; /* the epilogue's */
  static constexpr int SMEM = MAIN > C ? MAIN : C;
  /* an SM's (228 KiB; a 128-token tile's 64 accumulators a thread want 2) */
  static constexpr int BLOCKS = SMEM <= 74 * 1024 && BM == 64 ? 3 : 2;
};

extern __shared__ __align__(128) uint8_t gm_smem[];

/* The tile `tile` of the table's tiles (entries in order, ceil(count / BM) each; bad
 * entries none): its entry and first token, by warp 0's scan, 32 entries a round; false past
 * the last tile. Every thread of the block calls it. */
template <int BM>
static __device__ bool gm_find(const tdm_moe_group *groups, int G, int n, long long wlimit,
                               long long ebytes, int tile, tdm_moe_group *eg, int *m0) {
  __shared__ int found_g, found_m0;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int before = 0, g_at = -1, m_at = 0;
    for (int base = 0; base < G && g_at < 0; base += 32) {
      const int g = base + lane;
      int t = 0;
      if (g < G) {
        const tdm_moe_group e = groups[g];
        if (qentry_ok(e, n, wlimit, ebytes)) t = (e.count + BM - 1) / BM;
      }
      int incl = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int lo = before + incl - t;
      const unsigned hit = __ballot_sync(0xffffffffu, t > 0 && tile >= lo && tile < lo + t);
      if (hit) {
        const int src = __ffs(hit) - 1;
        g_at = base + src;
        m_at = (tile - __shfl_sync(0xffffffffu, lo, src)) * BM;
      }
      before += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      found_g = g_at;
      found_m0 = m_at;
    }
  }
  __syncthreads();
  if (found_g < 0) return false;
  *eg = groups[found_g];
  *m0 = found_m0;
  return true;
}

/* Eight floats as bf16 (rounded to nearest even), 16 bytes. */
static __device__ __forceinline__ uint4 bf16x8(const float *f) {
  uint32_t p[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    p[i] = *(const uint32_t *)&b;
  }
  return make_uint4(p[0], p[1], p[2], p[3]);
}

/* Starts copying the step at k0 (su units) of the tile's weight rows (rowp, NULL: a row past
 * the weights) into raw, a warp a row at a time, its lanes on consecutive 4-byte words: the
 * words that hold the step's bytes, which start sh = 0..3 bytes into the first (sh[r]: MXFP4's
 * 17-byte blocks may start at any byte, the others' at even ones). The words around a row's
 * bytes lie in its allocation: an allocation starts at a multiple of 4, and a word holding one
 * of its bytes is in the page that holds that byte. The caller commits the group; a wait for
 * it and a barrier make the bytes visible. */
template <int T, int BM>
static __device__ __forceinline__ void gm_stage(uint8_t *raw, uint8_t *sh,
                                                const uint8_t *const *rowp, int k0, int su) {
  typedef gm_t<T, BM> t;
  const size_t off = t::kq ? (size_t)(k0 / 256) * t::RB : (size_t)(k0 / 32) * t::UB;
  const int sb = t::kq ? t::RB : su * t::UB, lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < GM_BR; r += GM_THREADS / 32) {
    const uint8_t *src = rowp[r];
    if (!src) continue;
    src += off;
    const int s = (int)((uintptr_t)src & 3), nw = (s + sb + 3) >> 2;
    const uint8_t *from = src - s;
    uint8_t *dst = raw + r * t::RBP;
    for (int w = lane; w < nw; w += 32) cp_async4(dst + 4 * w, from + 4 * w);
    if (lane == 0) sh[r] = (uint8_t)s;
  }
}

/* Starts copying the tile's activations of the 32 values at k0 into tile: this thread's 16
 * bytes (values 8 (tid % 4) ..) of tokens tid / 4, + 64, .. of the mt bf16 rows of K values at
 * a (zeros past them). */
template <int BM>
static __device__ __forceinline__ void gm_load_a(__nv_bfloat16 *tile, const __nv_bfloat16 *a,
                                                 int mt, int K, int k0) {
  const int c = (threadIdx.x & 3) * 8;
#pragma unroll
  for (int r = threadIdx.x >> 2; r < BM; r += GM_THREADS / 4)
    cp_async16(tile + r * GM_LD + c, r < mt ? a + (size_t)r * K + k0 + c : a, r < mt);
}

/* ---- a row's 16 values as bf16 pairs, with no integer-to-float conversion ---- */

/* Four 4- or 6-bit codes (a byte each, < 128) as two bf16 pairs of 128 + code. */
static __device__ __forceinline__ void magic4(uint32_t q, __nv_bfloat162 *lo,
                                              __nv_bfloat162 *hi) {
  const uint32_t a = __byte_perm(q, 0x43434343u, 0x4140), b = __byte_perm(q, 0x43434343u, 0x4342);
  *lo = *(const __nv_bfloat162 *)&a;
  *hi = *(const __nv_bfloat162 *)&b;
}

static __device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) {
  return *(const uint32_t *)&v;
}

/* Half h (values 16h .. 16h + 15) of unit u of a staged Q4_K superblock b (even address, in
 * shared memory): d sc q - dmin m as bf16, the scale and offset rounded to bf16 first and the
 * product and difference rounded once. */
static __device__ __forceinline__ void q4k_half_bf16(const uint8_t *b, int u, int h,
                                                     uint32_t p[8]) {
  float d1, m1;
  q4k_scale<false>(b, u, &d1, &m1);
  const __nv_bfloat162 s = __float2bfloat162_rn(d1), nm = __float2bfloat162_rn(-m1);
  const __nv_bfloat162 base = __float2bfloat162_rn(128.f);
  const uint8_t *q = b + 16 + 32 * (u >> 1) + 16 * h;
  const int shift = (u & 1) * 4;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = (u_w<false>(q + 4 * i) >> shift) & 0x0F0F0F0Fu;
    __nv_bfloat162 lo, hi;
    magic4(w, &lo, &hi);
    p[2 * i] = bf2_bits(__hfma2(__hsub2(lo, base), s, nm));
    p[2 * i + 1] = bf2_bits(__hfma2(__hsub2(hi, base), s, nm));
  }
}

/* The same for a staged Q6_K superblock: d sc (q - 32), d sc rounded to bf16 first. */
static __device__ __forceinline__ void q6k_half_bf16(const uint8_t *b, int u, int h,
                                                     uint32_t p[8]) {
  const int hh = u >> 2, qq = u & 3;
  const uint8_t *ql = b + 64 * hh + 32 * (qq & 1) + 16 * h, *qh = b + 128 + 32 * hh + 16 * h;
  const float d = u_f16<false>(b + 208) * (float)(int8_t)u_b<false>(b + 192 + 8 * hh + 2 * qq + h);
  const __nv_bfloat162 s = __float2bfloat162_rn(d), base = __float2bfloat162_rn(160.f);
  const int sl = (qq >> 1) * 4, sh = 2 * qq;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = ((u_w<false>(ql + 4 * i) >> sl) & 0x0F0F0F0Fu) |
                       (((u_w<false>(qh + 4 * i) >> sh) & 0x03030303u) << 4);
    __nv_bfloat162 lo, hi;
    magic4(w, &lo, &hi);
    p[2 * i] = bf2_bits(__hmul2(__hsub2(lo, base), s));
    p[2 * i + 1] = bf2_bits(__hmul2(__hsub2(hi, base), s));
  }
}

/* The same for a staged Q8_0 block's half: d q, through f32 (2^23 + 128 + q taken off). */
static __device__ __forceinline__ void q80_half_bf16(const uint8_t *b, int h, uint32_t p[8]) {
  const float d = u_f16<false>(b);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = u_w<false>(b + 2 + 16 * h + 4 * i) ^ 0x80808080u;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      v[j] = (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | j)) - 8388736.f) * d;
    p[2 * i] = bf2_bits(__floats2bfloat162_rn(v[0], v[1]));
    p[2 * i + 1] = bf2_bits(__floats2bfloat162_rn(v[2], v[3]));
  }
}

/* Half h of unit s of the staged step of this thread's weight row (row tid / 2, half tid % 2,
 * staged sh[row] bytes into its place; !wvalid: zeros) into the weight tile, as bf16. */
template <int T, int BM>
static __device__ __forceinline__ void gm_fill(__nv_bfloat16 *tile, const uint8_t *raw,
                                               const uint8_t *sh, bool wvalid, int s) {
  typedef gm_t<T, BM> t;
  const int tid = threadIdx.x, h = tid & 1;
  uint4 *bd = (uint4 *)(tile + (tid >> 1) * GM_LD + h * 16);
  if (!wvalid) {
    bd[0] = bd[1] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const uint8_t *row = raw + (tid >> 1) * t::RBP + sh[tid >> 1];
  uint32_t p[8];
  if (T == TDM_MOE_W_Q4_K) {
    q4k_half_bf16(row, s, h, p);
  } else if (T == TDM_MOE_W_Q6_K) {
    q6k_half_bf16(row, s, h, p);
  } else if (T == TDM_MOE_W_Q8_0) {
    q80_half_bf16(row + 34 * s, h, p);
  } else {
    float v[16];
    unit16<T, false>(row, s, h, v);
    const uint4 a = bf16x8(v), b = bf16x8(v + 8);
    bd[0] = a;
    bd[1] = b;
    return;
  }
  bd[0] = make_uint4(p[0], p[1], p[2], p[3]);
  bd[1] = make_uint4(p[4], p[5], p[6], p[7]);
}

typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> gm_acc;

/* Buffer b of the staged steps. */
template <int T, int BM> static __device__ __forceinline__ uint8_t *gm_raw(int b) {
  return gm_smem + b * GM_BR * gm_t<T, BM>::RBP;
}

/* The main loop over K: acc[i][j] += A's rows wm + 16 i times the weight rows brow[j] .. + 16
 * of the block's 128 (i < 2, j < NJ). a: the tile's mt bf16 activation rows of K values (zeros
 * past them); rowp: the block's weight rows, visible to the block. Iteration g multiplies unit
 * g's tiles, widens unit g + 1 into the other weight tile, and starts the copies of unit g +
 * 2's activations and, where a step ends, of step st + 1's weight rows (into the buffer of
 * step st - 1, whose last unit was widened in the iteration before): one commit group an
 * iteration, so that waiting for all but the latest group before the barrier lands unit g +
 * 1's activations and every step widened from. */
template <int T, int BM>
static __device__ __forceinline__ void gm_mainloop(const __nv_bfloat16 *a, int mt,
                                                   const uint8_t *const *rowp, int K, int wm,
                                                   const int *brow,
                                                   gm_acc acc[2][gm_t<T, BM>::NJ]) {
  using namespace nvcuda;
  typedef gm_t<T, BM> t;
  __shared__ uint8_t sh[2][GM_BR];
  __nv_bfloat16 *at = (__nv_bfloat16 *)(gm_smem + 2 * GM_BR * t::RBP);
  __nv_bfloat16 *bt = at + GM_NA * t::A_TILE;
  const bool wvalid = rowp[threadIdx.x >> 1] != NULL;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < t::NJ; j++) wmma::fill_fragment(acc[i][j], 0.f);
  const int nsub = K >> 5;
  gm_stage<T, BM>(gm_raw<T, BM>(0), sh[0], rowp, 0, min(t::KS, K) >> 5);
  gm_load_a<BM>(at, a, mt, K, 0);
  cp_async_commit();
  if (nsub > 1) gm_load_a<BM>(at + t::A_TILE, a, mt, K, 32);
  if (t::KS < K) gm_stage<T, BM>(gm_raw<T, BM>(1), sh[1], rowp, t::KS, min(t::KS, K - t::KS) >> 5);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  gm_fill<T, BM>(bt, gm_raw<T, BM>(0), sh[0], wvalid, 0);
  __syncthreads();
  for (int g = 0, ga = 0; g < nsub; g++, ga = ga + 1 == GM_NA ? 0 : ga + 1) {
    if (g + 2 < nsub) {
      const int to = ga + 2 >= GM_NA ? ga + 2 - GM_NA : ga + 2;
      gm_load_a<BM>(at + to * t::A_TILE, a, mt, K, 32 * (g + 2));
    }
    const int kx = (g + 1) * 32, st = kx / t::KS;
    if (kx % t::KS == 0 && kx + t::KS < K)
      gm_stage<T, BM>(gm_raw<T, BM>((st + 1) & 1), sh[(st + 1) & 1], rowp, kx + t::KS,
                      min(t::KS, K - kx - t::KS) >> 5);
    cp_async_commit();
    const __nv_bfloat16 *ta = at + ga * t::A_TILE, *tb = bt + (g & 1) * t::B_TILE;
    if (wm < mt) { /* a warp past the tile's tokens has none to multiply */
#pragma unroll
      for (int kk = 0; kk < 32; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
        for (int i = 0; i < 2; i++)
          wmma::load_matrix_sync(fa[i], ta + (wm + 16 * i) * GM_LD + kk, GM_LD);
#pragma unroll
        for (int j = 0; j < t::NJ; j++) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, tb + brow[j] * GM_LD + kk, GM_LD);
#pragma unroll
          for (int i = 0; i < 2; i++) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        }
      }
    }
    if (g + 1 < nsub)
      gm_fill<T, BM>(bt + ((g + 1) & 1) * t::B_TILE, gm_raw<T, BM>(st & 1), sh[st & 1], wvalid,
                     (kx % t::KS) >> 5);
    cp_async_wait<1>(); /* unit g + 1's activations, and every step widened from, landed */
    __syncthreads();    /* this pair of tiles is free; the next is written and visible */
  }
  cp_async_wait<0>(); /* nothing lands in the epilogue's shared memory */
}

/* hb[first + m0 + r][n0 + c] = SwiGLU of the tile's gate and up sums, as bf16: block (tile,
 * n0 / 64); warp w takes tokens 32 (w % WT) .. and outputs 8 NJ (w / WT) .. + 8 NJ of both
 * halves (fragments j < NJ / 2 of gate, the rest of up: the same outputs). */
template <int T, int BM>
static __global__ void __launch_bounds__(GM_THREADS, gm_t<T, BM>::BLOCKS)
    gm_gate_up_kernel(const __nv_bfloat16 *xb, int n, const uint8_t *wbase, long long wlimit,
                      long long ebytes, const tdm_moe_group *groups, int G, int H, int I,
                      size_t rb, __nv_bfloat16 *hb) {
  using namespace nvcuda;
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0;
  if (!gm_find<BM>(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0)) return;
  typedef gm_t<T, BM> t;
  const int tid = threadIdx.x, warp = tid >> 5, n0 = (int)blockIdx.y * 64;
  const int mt = min(BM, e.count - m0); /* tokens of this tile */
  if (tid < GM_BR) {
    const int o = n0 + (tid & 63); /* gate row o (tid < 64), up row I + o */
    rowp[tid] = o < I ? wbase + 2 * e.w + (size_t)(o + (tid >= 64 ? I : 0)) * rb : NULL;
  }
  __syncthreads();
  constexpr int HJ = t::NJ / 2; /* gate fragments a warp */
  const int wm = (warp % t::WT) * 32, wn = (warp / t::WT) * 16 * HJ;
  int brow[t::NJ];
#pragma unroll
  for (int j = 0; j < HJ; j++) brow[j] = wn + 16 * j, brow[HJ + j] = 64 + wn + 16 * j;
  gm_acc acc[2][t::NJ];
  gm_mainloop<T, BM>(xb + (size_t)(e.first + m0) * H, mt, rowp, H, wm, brow, acc);
  float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < HJ; j++) {
#pragma unroll
      for (int q = 0; q < acc[i][j].num_elements; q++) {
        const float g = acc[i][j].x[q];
        acc[i][j].x[q] = g / (1.f + expf(-g)) * acc[i][HJ + j].x[q];
      }
      wmma::store_matrix_sync(&c[wm + 16 * i][wn + 16 * j], acc[i][j], GM_CLD,
                              wmma::mem_row_major);
    }
  __syncthreads();
  for (int q = tid; q < BM * 64; q += GM_THREADS) {
    const int r = q >> 6, col = q & 63;
    if (r < mt && n0 + col < I)
      hb[(size_t)(e.first + m0 + r) * I + n0 + col] = __float2bfloat16_rn(c[r][col]);
  }
}

/* out[slot] row, outputs n0 .. n0 + 127, of the tile's tokens = hb Wd^T: block (tile,
 * n0 / 128); warp w takes tokens 32 (w % WT) .. and outputs 16 NJ (w / WT) .. */
template <int T, int BM>
static __global__ void __launch_bounds__(GM_THREADS, gm_t<T, BM>::BLOCKS)
    gm_down_kernel(const __nv_bfloat16 *hb, const int32_t *rows, uint32_t xlimit,
                   const int32_t *slot,
                   uint32_t olimit, int n, const uint8_t *wbase, long long wlimit,
                   long long ebytes, const tdm_moe_group *groups, int G, int H, int I,
                   size_t gu_rb, size_t rb, float *out) {
  using namespace nvcuda;
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0;
  if (!gm_find<BM>(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0)) return;
  typedef gm_t<T, BM> t;
  const int tid = threadIdx.x, warp = tid >> 5, n0 = (int)blockIdx.y * GM_BR;
  const int mt = min(BM, e.count - m0);
  if (tid < GM_BR) {
    const uint8_t *w = wbase + 2 * e.w + 2 * (size_t)I * gu_rb;
    rowp[tid] = n0 + tid < H ? w + (size_t)(n0 + tid) * rb : NULL;
  }
  __syncthreads();
  const int wm = (warp % t::WT) * 32, wn = (warp / t::WT) * 16 * t::NJ;
  int brow[t::NJ];
#pragma unroll
  for (int j = 0; j < t::NJ; j++) brow[j] = wn + 16 * j;
  gm_acc acc[2][t::NJ];
  gm_mainloop<T, BM>(hb + (size_t)(e.first + m0) * I, mt, rowp, I, wm, brow, acc);
  float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < t::NJ; j++)
      wmma::store_matrix_sync(&c[wm + 16 * i][wn + 16 * j], acc[i][j], GM_CLD,
                              wmma::mem_row_major);
  __syncthreads();
  for (int r = warp; r < mt; r += GM_THREADS / 32) {
    const int at = e.first + m0 + r;
    const uint32_t sl = (uint32_t)slot[at];
    if (sl >= olimit || (uint32_t)rows[at] >= xlimit) continue;
    float *dst = out + (size_t)sl * H + n0;
    for (int col = tid & 31; col < GM_BR && n0 + col < H; col += 32) dst[col] = c[r][col];
  }
}

bool cuda_gmm_takes(int n, int H, int I, const float *x) {
  return n >= CUDA_GMM_MIN_N && H % 32 == 0 && I % 32 == 0 && !((uintptr_t)x & 15) &&
         (long long)n / 64 + 1 < INT_MAX / 2;
}

/* xb [n x H] = entry i's row rows[i] of x rounded to bf16 (zeros where it lies past xlimit):
 * block (i, c), 8 values a thread. */
static __global__ void __launch_bounds__(GM_THREADS)
    gm_gather_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int H,
                     __nv_bfloat16 *xb) {
  wait_prior_grid();
  const int c = ((int)blockIdx.y * GM_THREADS + (int)threadIdx.x) * 8;
  if (c >= H) return;
  const size_t i = blockIdx.x;
  const uint32_t r = (uint32_t)rows[i];
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (r < xlimit) {
    const float4 *src = (const float4 *)(x + (size_t)r * H + c);
    const float4 a = src[0], b = src[1];
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    v = bf16x8(f);
  }
  *(uint4 *)(xb + i * H + c) = v;
}

size_t cuda_gmm_scratch(int n, int H, int I) {
  return ((size_t)n * I * 2 + 255) / 256 * 256 + (size_t)n * H * 2;
}

template <int BM>
static cudaError_t gmm_launch(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                              const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                              long long wlimit, long long ebytes, int tg, int td,
                              const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb,
                              size_t d_rb, void *ws, float *out) {
  __nv_bfloat16 *hb = (__nv_bfloat16 *)ws;
  __nv_bfloat16 *xb = (__nv_bfloat16 *)((uint8_t *)ws + ((size_t)n * I * 2 + 255) / 256 * 256);
  const unsigned tiles = (unsigned)((n + BM - 1) / BM + G);
  const dim3 x_grid((unsigned)n, (unsigned)((H + 8 * GM_THREADS - 1) / (8 * GM_THREADS)));
  const dim3 gu_grid(tiles, (unsigned)((I + 63) / 64)), d_grid(tiles, (unsigned)((H + 127) / 128));
  cudaError_t e = launch_pdl(m, gm_gather_kernel, x_grid, GM_THREADS, 0, x, xlimit, rows, H, xb);
  if (e != cudaSuccess) return e;
  BY_WTYPE(tg, e = launch_pdl(m, gm_gate_up_kernel<QT, BM>, gu_grid, GM_THREADS,
                                gm_t<QT, BM>::SMEM, (const __nv_bfloat16 *)xb, n, wbase, wlimit,
                                ebytes, groups, G, H, I, gu_rb, hb));
  if (e != cudaSuccess) return e;
  BY_WTYPE(td, e = launch_pdl(m, gm_down_kernel<QT, BM>, d_grid, GM_THREADS,
                                gm_t<QT, BM>::SMEM, (const __nv_bfloat16 *)hb, rows, xlimit,
                                slot, olimit, n, wbase, wlimit, ebytes, groups, G, H, I, gu_rb,
                                d_rb, out));
  return e;
}

/* Tiles of 128 tokens where m->gmm_bm says so (TANDEM_MOE_CUDA_GMM_BM=128), or, by default
 * (auto), where both projections' weights are K-quants and the entries average 96 tokens or
 * more: each tile widens its experts' weights once, so a large ubatch's experts take half the
 * widening, which won for Q4_K and Q6_K at 128 tokens an expert and lost for Q8_0, BF16 and
 * F16 (bench/results/h100-prefill-profile-57fe784, h100-prefill-router-5493d72). */
cudaError_t cuda_gmm(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                     const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                     long long wlimit, long long ebytes, int tg, int td,
                     const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb, size_t d_rb,
                     void *ws, float *out) {
  const bool kq = (tg == TDM_MOE_W_Q4_K || tg == TDM_MOE_W_Q6_K) &&
                  (td == TDM_MOE_W_Q4_K || td == TDM_MOE_W_Q6_K);
  const bool big = m->gmm_bm == 128 || (m->gmm_bm == 0 && kq && (long long)n >= 96LL * G);
  if (big)
    return gmm_launch<128>(m, x, xlimit, rows, slot, olimit, n, wbase, wlimit, ebytes, tg, td,
                           groups, G, H, I, gu_rb, d_rb, ws, out);
  return gmm_launch<64>(m, x, xlimit, rows, slot, olimit, n, wbase, wlimit, ebytes, tg, td,
                        groups, G, H, I, gu_rb, d_rb, ws, out);
}

int cuda_gmm_preload(moe_cuda *m) {
  static const int types[] = {TDM_MOE_W_Q8_0, TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K,
                              TDM_MOE_W_MXFP4, TDM_MOE_W_BF16, TDM_MOE_W_F16};
  cudaFuncAttributes a;
  CK_CUDA(cudaFuncGetAttributes(&a, (const void *)gm_gather_kernel));
  for (int t : types) {
    BY_WTYPE(t, CK_CUDA(cudaFuncSetAttribute(gm_gate_up_kernel<QT, 64>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               gm_t<QT, 64>::SMEM));
               CK_CUDA(cudaFuncSetAttribute(gm_down_kernel<QT, 64>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            gm_t<QT, 64>::SMEM));
               CK_CUDA(cudaFuncSetAttribute(gm_gate_up_kernel<QT, 128>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            gm_t<QT, 128>::SMEM));
               CK_CUDA(cudaFuncSetAttribute(gm_down_kernel<QT, 128>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            gm_t<QT, 128>::SMEM)));
  }
  return 0;
}
