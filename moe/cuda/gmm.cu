/* cuda/gmm.cu: experts() and experts_q() on many tokens an expert (prefill): every entry of the
 * table in two tensor-core launches, gate|up with SwiGLU, then down, each reading the weights
 * in their format (unit32.h), widened to bf16 a 32-value step at a time in shared memory.
 *
 * A block computes a tile of 64 of an entry's tokens against 128 weight rows: gate/up takes
 * 64 gate rows and the 64 up rows of the same outputs, so SwiGLU is applied to the
 * accumulators (a gate fragment and its up fragment hold the same elements), and h leaves as
 * f32 [n x I] at the entries' token positions; down takes 128 rows of Wd and writes each
 * token's output row at its slot. Activations are rounded to bf16 on their way into shared
 * memory (x, then h), as expert()'s GEMMs have them; sums are f32 (WMMA 16 x 16 x 16).
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
 * Each step stages the next 32 values while the tensor cores work on the current ones (two
 * shared buffers, one barrier a step). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <mma.h>
#include <stdint.h>

#include "cuda/cuda_ops.h"
#include "cuda/unit32.h"

#define GM_BM 64  /* tokens a tile */
#define GM_BR 128 /* weight rows a tile */
#define GM_LD 40  /* bf16 a shared row: 32 values and 8 of padding (80 bytes, off the banks) */
#define GM_CLD (GM_BR + 4) /* floats a row of the epilogue's tile */
#define GM_MIN_BLOCKS 4    /* blocks an SM should hold: 128 registers a thread at most */

/* A step of K for type T: KS values (a superblock of the K-quants, 8 blocks of Q8_0 or MXFP4,
 * 128 F16 or BF16), staged RB bytes a row (UB a 32-value unit where the units are separate),
 * RBP apart in shared memory (4-byte multiples of an odd count: off the banks). */
template <int T> struct gm_t {
  static constexpr bool kq = T == TDM_MOE_W_Q4_K || T == TDM_MOE_W_Q6_K;
  static constexpr int KS = T == TDM_MOE_W_F16 || T == TDM_MOE_W_BF16 ? 128 : 256;
  static constexpr int UB = T == TDM_MOE_W_Q8_0 ? 34 : T == TDM_MOE_W_MXFP4 ? 17 : 64;
  static constexpr int RB = T == TDM_MOE_W_Q4_K ? 144 : T == TDM_MOE_W_Q6_K ? 210 : KS / 32 * UB;
  static constexpr int W = (RB + 3) / 4;
  static constexpr int RBP = 4 * (W % 2 ? W : W + 1);
  static constexpr int TILES = (GM_BM + GM_BR) * GM_LD * 2; /* the bf16 tiles' bytes */
  static constexpr int C = GM_BM * GM_CLD * 4;              /* the epilogue's */
  static constexpr int SMEM = GM_BR * RBP + TILES > C ? GM_BR * RBP + TILES : C;
};

extern __shared__ __align__(128) uint8_t gm_smem[];

/* The tile `tile` of the table's tiles (entries in order, ceil(count / GM_BM) each; bad
 * entries none): its entry and first token, by warp 0's scan, 32 entries a round; false past
 * the last tile. Every thread of the block calls it. */
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
        if (qentry_ok(e, n, wlimit, ebytes)) t = (e.count + GM_BM - 1) / GM_BM;
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
        m_at = (tile - __shfl_sync(0xffffffffu, lo, src)) * GM_BM;
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

static __device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  return (uint32_t)f32_to_bf16(lo) | (uint32_t)f32_to_bf16(hi) << 16;
}

/* The step at k0 (su units) of the tile's weight rows (rowp, NULL: a row past the weights),
 * staged as they lie, a warp a row at a time, its lanes on consecutive words. */
template <int T>
static __device__ __forceinline__ void gm_stage(uint8_t *raw, const uint8_t *const *rowp, int k0,
                                                int su) {
  typedef gm_t<T> t;
  const size_t off = t::kq ? (size_t)(k0 / 256) * t::RB : (size_t)(k0 / 32) * t::UB;
  const int sb = t::kq ? t::RB : su * t::UB, nw = sb >> 2, lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < GM_BR; r += 4) {
    const uint8_t *src = rowp[r];
    if (!src) continue;
    src += off;
    uint8_t *dst = raw + r * t::RBP;
    for (int w = lane; w < nw; w += 32) *(uint32_t *)(dst + 4 * w) = ld32(src + 4 * w);
    if ((sb & 2) && lane == 0) *(uint16_t *)(dst + 4 * nw) = ld16(src + 4 * nw);
  }
}

typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> gm_acc;

/* The main loop over K: acc[i][j] += A's rows wm + 16 i (i < 2) times the weight rows
 * brow[j] .. + 16 (j < 4) of the block's 128, both 16 wide. arow: this thread's activation row
 * (token tid / 2, its values 16 (tid % 2) .. of each 32; NULL: zeros); rowp: the block's weight
 * rows (this thread's is rowp[tid]), visible to the block. Each step of KS values stages the
 * rows' bytes in shared memory (coalesced), then widens them 32 values at a time, a thread a
 * row, into the bf16 tile the tensor cores read. */
template <int T>
static __device__ __forceinline__ void gm_mainloop(const float *arow, const uint8_t *const *rowp,
                                                   int K, int wm, const int brow[4],
                                                   gm_acc acc[2][4]) {
  using namespace nvcuda;
  typedef gm_t<T> t;
  uint8_t *raw = gm_smem;
  __nv_bfloat16(*ta)[GM_LD] = (__nv_bfloat16(*)[GM_LD])(gm_smem + GM_BR * t::RBP);
  __nv_bfloat16(*tb)[GM_LD] = ta + GM_BM;
  const int tid = threadIdx.x;
  const bool wvalid = rowp[tid] != NULL;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[i][j], 0.f);
  for (int k0 = 0; k0 < K; k0 += t::KS) {
    const int su = min(t::KS, K - k0) >> 5;
    gm_stage<T>(raw, rowp, k0, su);
    __syncthreads();
    for (int s = 0; s < su; s++) {
      float a[16], v[32];
      if (arow) {
        const float *src = arow + k0 + 32 * s + (tid & 1) * 16;
#pragma unroll
        for (int j = 0; j < 16; j += 4) {
          const float4 q = *(const float4 *)(src + j);
          a[j] = q.x, a[j + 1] = q.y, a[j + 2] = q.z, a[j + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; j++) a[j] = 0.f;
      }
      if (wvalid)
        unit32<T, false>(raw + tid * t::RBP, s, v);
      else
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = 0.f;
      __syncthreads(); /* the tiles are free */
      uint4 *ad = (uint4 *)&ta[tid >> 1][(tid & 1) * 16];
#pragma unroll
      for (int j = 0; j < 2; j++)
        ad[j] = make_uint4(bf16x2(a[8 * j], a[8 * j + 1]), bf16x2(a[8 * j + 2], a[8 * j + 3]),
                           bf16x2(a[8 * j + 4], a[8 * j + 5]), bf16x2(a[8 * j + 6], a[8 * j + 7]));
      uint4 *bd = (uint4 *)&tb[tid][0];
#pragma unroll
      for (int j = 0; j < 4; j++)
        bd[j] = make_uint4(bf16x2(v[8 * j], v[8 * j + 1]), bf16x2(v[8 * j + 2], v[8 * j + 3]),
                           bf16x2(v[8 * j + 4], v[8 * j + 5]), bf16x2(v[8 * j + 6], v[8 * j + 7]));
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < 32; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
        for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], &ta[wm + 16 * i][kk], GM_LD);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, &tb[brow[j]][kk], GM_LD);
#pragma unroll
          for (int i = 0; i < 2; i++) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
        }
      }
    }
  }
  __syncthreads(); /* the epilogue's tile overlays the staging */
}

/* h[first + m0 + r][n0 + c] = SwiGLU of the tile's gate and up sums: block (tile, n0 / 64);
 * warp w takes tokens 32 (w / 2) .. and outputs 32 (w % 2) .. of both halves. */
template <int T>
static __global__ void __launch_bounds__(128, GM_MIN_BLOCKS)
    gm_gate_up_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int n,
                      const uint8_t *wbase, long long wlimit, long long ebytes,
                      const tdm_moe_group *groups, int G, int H, int I, size_t rb, float *h) {
  using namespace nvcuda;
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0;
  if (!gm_find(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0)) return;
  const int tid = threadIdx.x, warp = tid >> 5, n0 = (int)blockIdx.y * 64;
  const int mt = min(GM_BM, e.count - m0); /* tokens of this tile */
  const float *arow = NULL;
  if ((tid >> 1) < mt) {
    const uint32_t r = (uint32_t)rows[e.first + m0 + (tid >> 1)];
    if (r < xlimit) arow = x + (size_t)r * H;
  }
  const int o = n0 + (tid & 63); /* gate row o (tid < 64), up row I + o */
  rowp[tid] = o < I ? wbase + 2 * e.w + (size_t)(o + (tid >= 64 ? I : 0)) * rb : NULL;
  __syncthreads();
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const int brow[4] = {wn, wn + 16, 64 + wn, 64 + wn + 16};
  gm_acc acc[2][4];
  gm_mainloop<T>(arow, rowp, H, wm, brow, acc);
  float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
      for (int t = 0; t < acc[i][j].num_elements; t++) {
        const float g = acc[i][j].x[t];
        acc[i][j].x[t] = g / (1.f + expf(-g)) * acc[i][j + 2].x[t];
      }
      wmma::store_matrix_sync(&c[wm + 16 * i][wn + 16 * j], acc[i][j], GM_CLD,
                              wmma::mem_row_major);
    }
  __syncthreads();
  for (int q = tid; q < GM_BM * 64; q += 128) {
    const int r = q >> 6, col = q & 63;
    if (r < mt && n0 + col < I) h[(size_t)(e.first + m0 + r) * I + n0 + col] = c[r][col];
  }
}

/* out[slot] row, outputs n0 .. n0 + 127, of the tile's tokens = h Wd^T: block (tile,
 * n0 / 128); warp w takes tokens 32 (w / 2) .. and outputs 64 (w % 2) .. */
template <int T>
static __global__ void __launch_bounds__(128, GM_MIN_BLOCKS)
    gm_down_kernel(const float *h, const int32_t *rows, uint32_t xlimit, const int32_t *slot,
                   uint32_t olimit, int n, const uint8_t *wbase, long long wlimit,
                   long long ebytes, const tdm_moe_group *groups, int G, int H, int I,
                   size_t gu_rb, size_t rb, float *out) {
  using namespace nvcuda;
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0;
  if (!gm_find(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0)) return;
  const int tid = threadIdx.x, warp = tid >> 5, n0 = (int)blockIdx.y * GM_BR;
  const int mt = min(GM_BM, e.count - m0);
  const float *arow = (tid >> 1) < mt ? h + (size_t)(e.first + m0 + (tid >> 1)) * I : NULL;
  const uint8_t *w = wbase + 2 * e.w + 2 * (size_t)I * gu_rb;
  rowp[tid] = n0 + tid < H ? w + (size_t)(n0 + tid) * rb : NULL;
  __syncthreads();
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
  const int brow[4] = {wn, wn + 16, wn + 32, wn + 48};
  gm_acc acc[2][4];
  gm_mainloop<T>(arow, rowp, I, wm, brow, acc);
  float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
      wmma::store_matrix_sync(&c[wm + 16 * i][wn + 16 * j], acc[i][j], GM_CLD,
                              wmma::mem_row_major);
  __syncthreads();
  for (int r = warp; r < mt; r += 4) {
    const int at = e.first + m0 + r;
    const uint32_t sl = (uint32_t)slot[at];
    if (sl >= olimit || (uint32_t)rows[at] >= xlimit) continue;
    float *dst = out + (size_t)sl * H + n0;
    for (int col = tid & 31; col < GM_BR && n0 + col < H; col += 32) dst[col] = c[r][col];
  }
}

/* BODY compiled for every type the kernels take (a type of moe_ops.h; the caller checked). */
#define GM_CASE(T, ...)   \
  case T: {               \
    constexpr int QT = T; \
    __VA_ARGS__;          \
  } break;
#define BY_GM_TYPE(t, ...)                 \
  switch (t) {                             \
    GM_CASE(TDM_MOE_W_Q8_0, __VA_ARGS__)   \
    GM_CASE(TDM_MOE_W_Q4_K, __VA_ARGS__)   \
    GM_CASE(TDM_MOE_W_Q6_K, __VA_ARGS__)   \
    GM_CASE(TDM_MOE_W_MXFP4, __VA_ARGS__)  \
    GM_CASE(TDM_MOE_W_BF16, __VA_ARGS__)   \
  default: {                               \
    constexpr int QT = TDM_MOE_W_F16;      \
    __VA_ARGS__;                           \
  } break;                                 \
  }

bool cuda_gmm_takes(int n, int H, int I, const float *x) {
  return n >= CUDA_GMM_MIN_N && H % 32 == 0 && I % 32 == 0 && !((uintptr_t)x & 15) &&
         (long long)n / GM_BM + 1 < INT_MAX / 2;
}

cudaError_t cuda_gmm(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                     const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                     long long wlimit, long long ebytes, int tg, int td,
                     const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb, size_t d_rb,
                     float *h, float *out) {
  const unsigned tiles = (unsigned)((n + GM_BM - 1) / GM_BM + G);
  const dim3 gu_grid(tiles, (unsigned)((I + 63) / 64)), d_grid(tiles, (unsigned)((H + 127) / 128));
  cudaError_t e;
  BY_GM_TYPE(tg, e = launch_pdl(m, gm_gate_up_kernel<QT>, gu_grid, 128, gm_t<QT>::SMEM, x, xlimit,
                                rows, n, wbase, wlimit, ebytes, groups, G, H, I, gu_rb, h));
  if (e != cudaSuccess) return e;
  BY_GM_TYPE(td, e = launch_pdl(m, gm_down_kernel<QT>, d_grid, 128, gm_t<QT>::SMEM, (const float *)h, rows,
                                xlimit, slot, olimit, n, wbase, wlimit, ebytes, groups, G, H, I,
                                gu_rb, d_rb, out));
  return e;
}

int cuda_gmm_preload(moe_cuda *m) {
  static const int types[] = {TDM_MOE_W_Q8_0, TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K,
                              TDM_MOE_W_MXFP4, TDM_MOE_W_BF16, TDM_MOE_W_F16};
  for (int t : types) {
    BY_GM_TYPE(t, CK_CUDA(cudaFuncSetAttribute(gm_gate_up_kernel<QT>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               gm_t<QT>::SMEM));
               CK_CUDA(cudaFuncSetAttribute(gm_down_kernel<QT>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            gm_t<QT>::SMEM)));
  }
  return 0;
}
