/* cuda/gmm.cu: experts() and experts_q() on many tokens an expert (prefill): every entry of the
 * table in two tensor-core launches, gate|up with SwiGLU, then down, each reading the weights
 * in their format (unit32.h), widened to bf16 32 values at a time: Q8_0, Q4_K and Q6_K by each
 * warp into its own operand fragments, in registers; F16, BF16 and MXFP4 into a weight tile in
 * shared memory that the warps then load.
 *
 * A block computes a tile of 64 (or 128) of an entry's tokens against 128 weight rows: gate/up
 * takes 64 gate rows and the 64 up rows of the same outputs, so SwiGLU is applied to the
 * accumulators (a gate fragment and its up fragment hold the same elements), and h leaves as
 * bf16 [n x I] at the entries' token positions; down takes 128 rows of Wd and writes each
 * token's output row at its slot. Activations are bf16, as expert()'s GEMMs have them: a first
 * launch gathers each entry's row of x rounded to bf16 (the workspace's xb [n x H], after h),
 * so that a tile's activations are contiguous rows that the copy engine of each SM
 * (cp.async) brings into shared memory as they lie; sums are f32 (mma.sync m16n8k16 on bf16,
 * its operands loaded by ldmatrix).
 *
 * Tiles of tokens: ceil(n / BM) + G of them cover every entry's tiles (each entry adds at most
 * one partial tile), and a block finds a tile's entry by a warp's scan of the table (device
 * data, read when the kernel runs), so that the host never learns the counts. Three ways to
 * run them (m->gmm_sched, TANDEM_MOE_CUDA_GMM_SCHED): a grid of a block a tile and block of
 * outputs, whose blocks past the last tile return at once; (counter) as many blocks as the
 * GPU holds at once, which take (tile, block of outputs) items from a counter until none is
 * left (gm_next), after a gather of the tiles' rows only, so that a launch for a few experts
 * among a large ubatch's entries (a streamed group) starts no blocks and gathers no rows
 * without a tile; or (auto) the counter for a table of at most GM_AUTO_G entries, else the
 * grid. Each tile is computed the same way in all three. A bad entry (moe_ops.h: rows outside
 * [0, n), weights outside the allocation) counts no tiles and is skipped whole; a token whose
 * row lies outside x's allocation, or whose slot outside out's, has its slot left unwritten. A
 * token's result depends on its expert, its own activations and the type only: the tile it
 * falls in, its neighbours, G and the way the tiles run do not change a bit (each output
 * element is one fragment's sum over K in a fixed order).
 *
 * Each step of KS values (a superblock) of the weight rows is copied into shared memory as it
 * lies, asynchronously (cp.async), a step ahead of the one the tensor cores work on. Q8_0, Q4_K
 * and Q6_K (gm_mainloop_rf): a step's scales are first worked out into a table, a word a row
 * and unit; then each warp widens the 32 values of each of its rows that its mma.sync operand
 * takes from the staged bytes, as it multiplies, so that shared memory carries no widened
 * weights (a weight tile's stores and loads bound the kernels before). The others
 * (gm_mainloop): each 32 values are widened to bf16 into a shared tile while the tensor cores
 * work on the 32 before (two tiles). The activations' 32 values go two 32s ahead, into a ring
 * of GM_NA tiles: one barrier a 32. The 4- and 6-bit types widen two values an
 * instruction in bf16 pairs (a code's bits put into the mantissa of 128.0, 128 taken off, then
 * one fused multiply-add with the sub-block's scale and offset rounded to bf16); Q8_0 through
 * f32 the same way (2^23 + 128 taken off). No integer-to-float conversion is issued: that
 * unit takes 16 a clock on an SM, an eighth of the adds. A step's units are unrolled and a
 * thread's shared addresses computed once (kept). With a shared weight tile, a unit of Q4_K
 * issued 148 instructions a thread and the kernels were bound by the shared memory's
 * bandwidth, 92% busy (bench/results/h100-gmm-mma-f4aa486); in registers, a warp with tokens
 * issues 182 a unit, a warp past the tile's tokens (half of them at 32 tokens an expert)
 * none, and shared memory carries about a third of the bytes. Both ways, a weight's bf16 value
 * and its place in the products are the same, and so are the results. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include "cuda/cuda_ops.h"
#include "cuda/unit32.h"
#include "cuda/widen16.h"

#define GM_BR 128      /* weight rows a tile */
#define GM_THREADS 256 /* 8 warps: BM / 32 along the tokens (BM: 64 or 128 a tile; 2 for Q8_0
                        * and the K-quants), the rest along the rows */
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
  /* Q8_0, Q4_K and Q6_K: each warp widens its weight fragments in registers (gm_mainloop_rf);
   * the others are widened into a shared weight tile (gm_mainloop) */
  static constexpr bool rf = T == TDM_MOE_W_Q8_0 || kq;
  static constexpr int MI = rf ? BM / 32 : 2; /* a warp's 16-token fragments */
  static constexpr int WT = BM / 16 / MI, WR = GM_THREADS / 32 / WT; /* warps along tokens, rows */
  static constexpr int NJ = GM_BR / 16 / WR; /* a warp's 16-row fragments: 2 or 4 */
  static constexpr int TS = 2 * SUBS + 2; /* words a weight row of the scale table (2 a unit) */
  static constexpr int A_TILE = BM * GM_LD, B_TILE = GM_BR * GM_LD; /* bf16 */
  static constexpr int MAIN = rf ? 2 * GM_BR * RBP + 2 * GM_BR * TS * 4 + GM_NA * A_TILE * 2
                                 : 2 * GM_BR * RBP + (GM_NA * A_TILE + 2 * B_TILE) * 2;
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

/* A block's next work item of gate/up or down in counter mode (a tile and a block of outputs,
 * `cols` of them a tile): thread 0 takes the launch's next item from *ctr (zeroed by the
 * gather before it), in tile-major order, so that a tile's blocks of outputs run together
 * (its activations and its expert's weights stay in L2) and a block takes items as it frees,
 * whatever the tiles' sizes. False past the last tile (the same in every thread). */
template <int BM>
static __device__ bool gm_next(unsigned *ctr, unsigned total, int cols,
                               const tdm_moe_group *groups, int G, int n, long long wlimit,
                               long long ebytes, tdm_moe_group *e, int *m0, int *col) {
  __shared__ unsigned item;
  if (threadIdx.x == 0) item = atomicAdd(ctr, 1u);
  __syncthreads();
  const unsigned it = item;
  if (it >= total) return false;
  *col = (int)(it % (unsigned)cols);
  return gm_find<BM>(groups, G, n, wlimit, ebytes, (int)(it / (unsigned)cols), e, m0);
}

/* Starts copying the step at k0 (su units) of the tile's weight rows (rowp, NULL: a row past
 * the weights) into raw, 8 lanes a row (a warp's copy reads 4 rows' 32 consecutive bytes), on
 * 4-byte words: the words that hold the step's bytes, which start sh = 0..3 bytes into the first
 * (sh[r]: MXFP4's 17-byte blocks may start at any byte, the others' at even ones). The words
 * around a row's bytes lie in its allocation: an allocation starts at a multiple of 4, and a
 * word holding one of its bytes is in the page that holds that byte. The caller commits the
 * group; a wait for it and a barrier make the bytes visible. */
template <int T, int BM>
static __device__ __forceinline__ void gm_stage(uint8_t *raw, uint8_t *sh,
                                                const uint8_t *const *rowp, int k0, int su) {
  typedef gm_t<T, BM> t;
  constexpr int NW = (3 + t::RB + 3) / 4; /* words a row at most */
  const size_t off = t::kq ? (size_t)(k0 / 256) * t::RB : (size_t)(k0 / 32) * t::UB;
  const int sb = t::kq ? t::RB : su * t::UB, sub = threadIdx.x & 7;
#pragma unroll
  for (int r = threadIdx.x >> 3; r < GM_BR; r += GM_THREADS / 8) {
    const uint8_t *src = rowp[r];
    if (!src) { /* no bytes; an even offset, for gm_mainloop_rf's loads from the row */
      if (sub == 0) sh[r] = 0;
      continue;
    }
    src += off;
    const int s = (int)((uintptr_t)src & 3), nw = (s + sb + 3) >> 2;
    const uint8_t *from = src - s + 4 * sub;
    const uint32_t dst = smem_u32(raw + r * t::RBP) + 4 * sub;
#pragma unroll
    for (int w = 0; w < NW; w += 8)
      if (w + sub < nw) cp_async4_s(dst + 4 * w, from + 4 * w);
    if (sub == 0) sh[r] = (uint8_t)s;
  }
}

/* A thread's share of a tile's activation copies into a ring tile at base (shared): 16 bytes
 * of tokens tid / 4 + 64 i (i < NR), sz[i] of them read (0 past the tile's mt tokens: zeros);
 * each load() copies the next 32 values of each. */
template <int NR> struct gm_acopy {
  const char *src[NR];
  uint32_t sz[NR], st;
  __device__ __forceinline__ gm_acopy(const __nv_bfloat16 *a, int mt, int K, uint32_t base) {
    const int ar = (int)threadIdx.x >> 2, ac = ((int)threadIdx.x & 3) * 8;
#pragma unroll
    for (int i = 0; i < NR; i++) {
      sz[i] = kept(ar + 64 * i < mt ? 16u : 0u);
      src[i] = (const char *)(sz[i] ? a + (size_t)(ar + 64 * i) * K + ac : a);
    }
    st = kept(base + (ar * GM_LD + ac) * 2);
  }
  __device__ __forceinline__ void load(uint32_t slot) {
#pragma unroll
    for (int i = 0; i < NR; i++) {
      cp_async16_n(st + slot + i * 64 * GM_LD * 2, src[i], sz[i]);
      src[i] += 4 * sz[i]; /* 32 values on */
    }
  }
};

/* The first weight row of a warp's fragment j, from its first row wn: gate/up's fragments j <
 * NJ / 2 are gate rows wn + 16 j, the rest the up rows 64 later (the same outputs); down's are
 * wn + 16 j. */
template <bool GU, int NJ> static __device__ __forceinline__ constexpr int gm_frow(int j) {
  return GU && j >= NJ / 2 ? 64 + 16 * (j - NJ / 2) : 16 * j;
}

/* Where staged step buffer b's bytes of weight row r start, from gm_smem. */
template <int T, int BM>
static __device__ __forceinline__ uint32_t gm_row(const uint8_t sh[2][GM_BR], int b, int r) {
  return (uint32_t)((b * GM_BR + r) * gm_t<T, BM>::RBP) + sh[b][r];
}

/* The main loop over K: acc[i][j][nh] += the tile's tokens wm + 16 i .. + 15 times the weight
 * rows wn + gm_frow(j) + 8 nh .. + 7 of the block's 128 (i < 2, j < NJ, nh < 2), in the
 * accumulators' layout of mma.sync (lane (g, q) = (lane / 4, lane % 4) holds tokens g and g + 8,
 * rows 2q and 2q + 1). a: the tile's mt bf16 activation rows of K values (zeros past them);
 * rowp: the block's weight rows, visible to the block. Iteration g multiplies unit g's tiles,
 * widens unit g + 1 into the other weight tile, and starts the copies of unit g + 2's
 * activations and, where a step ends, of step st + 2's weight rows (into the buffer of step st,
 * whose last unit was widened in the iteration before): one commit group an iteration, so that
 * waiting for all but the latest group before the barrier lands unit g + 1's activations and
 * every step widened from. A step's units are unrolled, so that a unit's offsets in its step
 * are constants; a thread's shared addresses are computed once. */
template <int T, int BM, bool GU>
static __device__ __forceinline__ void gm_mainloop(const __nv_bfloat16 *a, int mt,
                                                   const uint8_t *const *rowp, int K, int wm,
                                                   int wn, float (&acc)[2][gm_t<T, BM>::NJ][2][4]) {
  typedef gm_t<T, BM> t;
  constexpr int NJ = t::NJ, SUBS = t::SUBS, NR = BM / 64;
  constexpr uint32_t A0 = 2 * GM_BR * t::RBP, ATB = t::A_TILE * 2, B0 = A0 + GM_NA * ATB;
  constexpr uint32_t BTB = t::B_TILE * 2;
  __shared__ uint8_t sh[2][GM_BR];
  /* the widening's: row r, half h (a warp's lanes 0-15 take 16 rows' first halves, 16-31
   * their second: the tile's stores meet every bank once a phase) */
  const int tid = threadIdx.x, lane = tid & 31, h = (tid >> 4) & 1;
  const int r = (tid & 15) + 16 * (tid >> 5);
  const uint32_t s0 = smem_u32(gm_smem);
  /* ldmatrix: the tokens' 16 x 16 (lanes 0-15 rows 0-15 at k, 16-31 at k + 8), the weights'
   * two 8-row blocks (lanes 0-7 rows 0-7 at k, 8-15 at k + 8; 16-31 rows 8-15 the same) */
  const uint32_t a_ld = kept(s0 + A0 + ((wm + (lane & 15)) * GM_LD + (lane >> 4) * 8) * 2);
  const uint32_t b_ld = kept(
      s0 + B0 + ((wn + (lane & 7) + ((lane >> 4) << 3)) * GM_LD + ((lane >> 3) & 1) * 8) * 2);
  const uint32_t fill = kept(s0 + B0 + (r * GM_LD + 16 * h) * 2);
  const bool wvalid = rowp[r] != NULL;
  gm_acopy<NR> acp(a, mt, K, s0 + A0);
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
      for (int nh = 0; nh < 2; nh++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[i][j][nh][q] = 0.f;
  const int nsub = K >> 5;
  gm_stage<T, BM>(gm_smem, sh[0], rowp, 0, min(t::KS, K) >> 5);
  acp.load(0);
  cp_async_commit();
  if (nsub > 1) acp.load(ATB);
  if (t::KS < K)
    gm_stage<T, BM>(gm_smem + GM_BR * t::RBP, sh[1], rowp, t::KS, min(t::KS, K - t::KS) >> 5);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  {
    const uint8_t *row = gm_smem + gm_row<T, BM>(sh, 0, r);
    gm_hdr hd;
    if (wvalid) gm_header<T>(row, &hd);
    gm_fill<T>(fill, row, hd, h, wvalid, 0);
  }
  __syncthreads();
  uint32_t ga = 0; /* the ring's tile of unit g, in bytes */
  for (int g0 = 0, st = 0; g0 < nsub; g0 += SUBS, st++) {
    const uint8_t *cur = gm_smem + kept(gm_row<T, BM>(sh, st & 1, r));
    gm_hdr hd;
    if (wvalid) gm_header<T>(cur, &hd);
#pragma unroll
    for (int u = 0; u < SUBS; u++) {
      const int g = g0 + u;
      if (g >= nsub) break; /* a last step of fewer units */
      if (g + 2 < nsub) acp.load(ga == 0 ? 2 * ATB : ga - ATB);
      const int k2 = (g0 + 2 * SUBS) * 32;
      if (u == SUBS - 1 && k2 < K)
        gm_stage<T, BM>(gm_smem + (st & 1) * GM_BR * t::RBP, sh[st & 1], rowp, k2,
                        min(t::KS, K - k2) >> 5);
      cp_async_commit();
      if (wm < mt) { /* a warp past the tile's tokens has none to multiply */
        const uint32_t at = a_ld + ga, bt = b_ld + (u & 1) * BTB;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
          uint32_t fa[2][4];
#pragma unroll
          for (int i = 0; i < 2; i++) ldsm4(fa[i], at + (16 * i * GM_LD + 16 * kk) * 2);
#pragma unroll
          for (int j = 0; j < NJ; j++) {
            uint32_t fb[4];
            ldsm4(fb, bt + (gm_frow<GU, NJ>(j) * GM_LD + 16 * kk) * 2);
#pragma unroll
            for (int i = 0; i < 2; i++) {
              mma_bf16(acc[i][j][0], fa[i], fb[0], fb[1]);
              mma_bf16(acc[i][j][1], fa[i], fb[2], fb[3]);
            }
          }
        }
      }
      if (g + 1 < nsub) {
        if (u < SUBS - 1) {
          gm_fill<T>(fill + ((u + 1) & 1) * BTB, cur, hd, h, wvalid, u + 1);
        } else { /* the next step's first unit */
          const uint8_t *row = gm_smem + gm_row<T, BM>(sh, (st + 1) & 1, r);
          gm_hdr hn;
          if (wvalid) gm_header<T>(row, &hn);
          gm_fill<T>(fill + ((u + 1) & 1) * BTB, row, hn, h, wvalid, 0);
        }
      }
      cp_async_wait<1>(); /* unit g + 1's activations, and every step widened from, landed */
      __syncthreads();    /* this pair of tiles is free; the next is written and visible */
      ga = ga == (GM_NA - 1) * ATB ? 0 : ga + ATB;
    }
  }
  cp_async_wait<0>(); /* nothing lands in the epilogue's shared memory */
}

/* gm_mainloop for Q8_0, Q4_K and Q6_K, with each warp's weight fragments widened in registers
 * (gf_frag) from the staged step, and a warp's MI 16-token fragments (BM / 32: two warps
 * along the tokens, four along the rows). Iteration g multiplies unit g, starts the copies of
 * unit g + 2's activations and, at a step's first unit, of the next step's weight rows (into
 * the buffer of the step before, read to its end in the iteration before), and, at a step's
 * last unit, fills the next step's scale table (its rows landed SUBS - 2 iterations after
 * their copy began). One commit group an iteration, as gm_mainloop. */
template <int T, int BM, bool GU>
static __device__ __forceinline__ void gm_mainloop_rf(
    const __nv_bfloat16 *a, int mt, const uint8_t *const *rowp, int K, int wm, int wn,
    float (&acc)[gm_t<T, BM>::MI][gm_t<T, BM>::NJ][2][4]) {
  typedef gm_t<T, BM> t;
  constexpr int NJ = t::NJ, MI = t::MI, SUBS = t::SUBS, NR = BM / 64;
  static_assert(SUBS >= 3, "a step's rows land SUBS - 2 iterations after their copy");
  constexpr uint32_t TB = 2 * GM_BR * t::RBP, TBB = GM_BR * t::TS * 4;
  constexpr uint32_t A0 = TB + 2 * TBB, ATB = t::A_TILE * 2;
  __shared__ uint8_t sh[2][GM_BR];
  const int tid = threadIdx.x, lane = tid & 31, q = lane & 3, gr = lane >> 2;
  const uint32_t s0 = smem_u32(gm_smem);
  /* 0x43004300, in a register: K's sign bit (0) keeps the compiler from folding it into two
   * logic instructions with one immediate each */
  const uint32_t mc = 0x43004300u | ((uint32_t)K & 0x80000000u);
  const uint32_t a_ld = kept(s0 + A0 + ((wm + (lane & 15)) * GM_LD + (lane >> 4) * 8) * 2);
  gm_acopy<NR> acp(a, mt, K, s0 + A0);
  /* the scale table of step buffer b: row tid / 2, units SUBS / 2 (tid % 2) .. */
  const int tr = tid >> 1, tu = (tid & 1) * (SUBS / 2);
  const bool tvalid = rowp[tr] != NULL;
  auto table = [&](int b) {
    if (!tvalid) return;
    const uint8_t *row = gm_smem + gm_row<T, BM>(sh, b, tr);
    gm_hdr hd;
    gm_header<T>(row, &hd);
    const uint32_t at = s0 + TB + b * TBB + (tr * t::TS + 2 * tu) * 4;
#pragma unroll
    for (int i = 0; i < SUBS / 2; i++) sts_u64(at + 8 * i, gf_scale<T>(row, hd, tu + i));
  };
#pragma unroll
  for (int i = 0; i < MI; i++)
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
      for (int nh = 0; nh < 2; nh++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[i][j][nh][c] = 0.f;
  const int nsub = K >> 5;
  gm_stage<T, BM>(gm_smem, sh[0], rowp, 0, min(t::KS, K) >> 5);
  acp.load(0);
  cp_async_commit();
  if (nsub > 1) acp.load(ATB);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  table(0);
  __syncthreads();
  uint32_t ga = 0;
  for (int g0 = 0, st = 0; g0 < nsub; g0 += SUBS, st++) {
    const int b = st & 1;
    uint32_t rb[NJ][2], tb[NJ][2], w[NJ][2][2];
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
      for (int nh = 0; nh < 2; nh++) {
        const int r = wn + gm_frow<GU, NJ>(j) + 8 * nh + gr;
        rb[j][nh] = s0 + gm_row<T, BM>(sh, b, r) + 2 * q;
        tb[j][nh] = s0 + TB + b * TBB + r * t::TS * 4;
      }
#pragma unroll
    for (int u = 0; u < SUBS; u++) {
      const int g = g0 + u;
      if (g >= nsub) break;
      if (g + 2 < nsub) acp.load(ga == 0 ? 2 * ATB : ga - ATB);
      if (u == 0 && g0 + SUBS < nsub)
        gm_stage<T, BM>(gm_smem + (b ^ 1) * GM_BR * t::RBP, sh[b ^ 1], rowp, (g0 + SUBS) * 32,
                        min(SUBS, nsub - g0 - SUBS));
      cp_async_commit();
      if (wm < mt) { /* a warp past the tile's tokens has none to multiply */
        uint2 e[NJ][2];
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
          for (int nh = 0; nh < 2; nh++) {
            e[j][nh] = lds_u64(tb[j][nh] + 8 * u);
            if (T == TDM_MOE_W_Q4_K && (u & 1) == 0)
#pragma unroll
              for (int kk = 0; kk < 2; kk++)
                w[j][nh][kk] = lds_frag(rb[j][nh] + 16 + 32 * (u >> 1) + 16 * kk);
          }
        const uint32_t at = a_ld + ga;
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
          uint32_t fa[MI][4];
#pragma unroll
          for (int i = 0; i < MI; i++) ldsm4(fa[i], at + (16 * i * GM_LD + 16 * kk) * 2);
#pragma unroll
          for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int nh = 0; nh < 2; nh++) {
              uint32_t fb[2];
              gf_frag<T>(rb[j][nh], e[j][nh], u, kk, mc, w[j][nh][kk], fb);
#pragma unroll
              for (int i = 0; i < MI; i++) mma_bf16(acc[i][j][nh], fa[i], fb[0], fb[1]);
            }
        }
      }
      if (u == SUBS - 1 && g0 + SUBS < nsub) table(b ^ 1);
      cp_async_wait<1>(); /* unit g + 1's activations, and the next step's rows, landed */
      __syncthreads();
      ga = ga == (GM_NA - 1) * ATB ? 0 : ga + ATB;
    }
  }
  cp_async_wait<0>();
}

/* The item of gate/up or down a block takes next: with C (counter), gm_next's; else its own,
 * once (tile blockIdx.x, block of outputs blockIdx.y). */
#define GM_ITEMS(C, ctr, total, cols, e, m0, col)                                            \
  (C ? gm_next<BM>(ctr, total, cols, groups, G, n, wlimit, ebytes, &e, &m0, &col)           \
     : gm_find<BM>(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0))

/* hb[first + m0 + r][n0 + c] = SwiGLU of the tile's gate and up sums, as bf16: item (tile,
 * n0 / 64); warp w takes tokens 32 (w % WT) .. and outputs 8 NJ (w / WT) .. + 8 NJ of both
 * halves (fragments j < NJ / 2 of gate, the rest of up: the same outputs). C: counter mode. */
template <int T, int BM, bool C>
static __global__ void __launch_bounds__(GM_THREADS, gm_t<T, BM>::BLOCKS)
    gm_gate_up_kernel(const __nv_bfloat16 *xb, int n, const uint8_t *wbase, long long wlimit,
                      long long ebytes, const tdm_moe_group *groups, int G, int H, int I,
                      size_t rb, __nv_bfloat16 *hb, unsigned *ctr, unsigned total, int cols) {
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0, col = (int)blockIdx.y;
  while (GM_ITEMS(C, ctr, total, cols, e, m0, col)) {
    typedef gm_t<T, BM> t;
    const int tid = threadIdx.x, warp = tid >> 5, n0 = col * 64;
    const int mt = min(BM, e.count - m0); /* tokens of this tile */
    if (tid < GM_BR) {
      const int o = n0 + (tid & 63); /* gate row o (tid < 64), up row I + o */
      rowp[tid] = o < I ? wbase + 2 * e.w + (size_t)(o + (tid >= 64 ? I : 0)) * rb : NULL;
    }
    __syncthreads();
    constexpr int HJ = t::NJ / 2; /* gate fragments a warp */
    const int wm = (warp % t::WT) * 16 * t::MI, wn = (warp / t::WT) * 16 * HJ;
    float acc[t::MI][t::NJ][2][4];
    const __nv_bfloat16 *a = xb + (size_t)(e.first + m0) * H;
    if constexpr (t::rf)
      gm_mainloop_rf<T, BM, true>(a, mt, rowp, H, wm, wn, acc);
    else
      gm_mainloop<T, BM, true>(a, mt, rowp, H, wm, wn, acc);
    float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
    const int lane = tid & 31, g = lane >> 2, q2 = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < t::MI; i++)
#pragma unroll
      for (int j = 0; j < HJ; j++)
#pragma unroll
        for (int nh = 0; nh < 2; nh++)
#pragma unroll
          for (int q = 0; q < 4; q++) {
            const float gv = acc[i][j][nh][q];
            c[wm + 16 * i + g + 8 * (q >> 1)][wn + 16 * j + 8 * nh + q2 + (q & 1)] =
                gv / (1.f + expf(-gv)) * acc[i][HJ + j][nh][q];
          }
    __syncthreads();
    for (int q = tid; q < BM * 64; q += GM_THREADS) {
      const int r = q >> 6, o = q & 63;
      if (r < mt && n0 + o < I)
        hb[(size_t)(e.first + m0 + r) * I + n0 + o] = __float2bfloat16_rn(c[r][o]);
    }
    if (!C) return;
    __syncthreads(); /* c, rowp and gm_next's cells read: the next item may write them */
  }
}

/* out[slot] row, outputs n0 .. n0 + 127, of the tile's tokens = hb Wd^T: item (tile,
 * n0 / 128); warp w takes tokens 32 (w % WT) .. and outputs 16 NJ (w / WT) .. C: counter
 * mode. */
template <int T, int BM, bool C>
static __global__ void __launch_bounds__(GM_THREADS, gm_t<T, BM>::BLOCKS)
    gm_down_kernel(const __nv_bfloat16 *hb, const int32_t *rows, uint32_t xlimit,
                   const int32_t *slot,
                   uint32_t olimit, int n, const uint8_t *wbase, long long wlimit,
                   long long ebytes, const tdm_moe_group *groups, int G, int H, int I,
                   size_t gu_rb, size_t rb, float *out, unsigned *ctr, unsigned total,
                   int cols) {
  __shared__ const uint8_t *rowp[GM_BR];
  wait_prior_grid();
  tdm_moe_group e;
  int m0, col = (int)blockIdx.y;
  while (GM_ITEMS(C, ctr, total, cols, e, m0, col)) {
    typedef gm_t<T, BM> t;
    const int tid = threadIdx.x, warp = tid >> 5, n0 = col * GM_BR;
    const int mt = min(BM, e.count - m0);
    if (tid < GM_BR) {
      const uint8_t *w = wbase + 2 * e.w + 2 * (size_t)I * gu_rb;
      rowp[tid] = n0 + tid < H ? w + (size_t)(n0 + tid) * rb : NULL;
    }
    __syncthreads();
    const int wm = (warp % t::WT) * 16 * t::MI, wn = (warp / t::WT) * 16 * t::NJ;
    float acc[t::MI][t::NJ][2][4];
    const __nv_bfloat16 *a = hb + (size_t)(e.first + m0) * I;
    if constexpr (t::rf)
      gm_mainloop_rf<T, BM, false>(a, mt, rowp, I, wm, wn, acc);
    else
      gm_mainloop<T, BM, false>(a, mt, rowp, I, wm, wn, acc);
    float(*c)[GM_CLD] = (float(*)[GM_CLD])gm_smem;
    const int lane = tid & 31, g = lane >> 2, q2 = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < t::MI; i++)
#pragma unroll
      for (int j = 0; j < t::NJ; j++)
#pragma unroll
        for (int nh = 0; nh < 2; nh++)
#pragma unroll
          for (int q = 0; q < 4; q++)
            c[wm + 16 * i + g + 8 * (q >> 1)][wn + 16 * j + 8 * nh + q2 + (q & 1)] =
                acc[i][j][nh][q];
    __syncthreads();
    for (int r = warp; r < mt; r += GM_THREADS / 32) {
      const int at = e.first + m0 + r;
      const uint32_t sl = (uint32_t)slot[at];
      if (sl >= olimit || (uint32_t)rows[at] >= xlimit) continue;
      float *dst = out + (size_t)sl * H + n0;
      for (int o = tid & 31; o < GM_BR && n0 + o < H; o += 32) dst[o] = c[r][o];
    }
    if (!C) return;
    __syncthreads(); /* c, rowp and gm_next's cells read: the next item may write them */
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

/* Counter mode's gather: the rows of xb that the table's tiles read, as gm_gather_kernel has
 * them; no other row, so that a group of a few experts among a large ubatch's entries gathers
 * its own. Block (b, c) takes tile b. Before it, the work counters of gate/up and down (ctr[0],
 * ctr[1]) are zeroed: the kernel before this one has completed, and the two after it read them
 * once it has. */
template <int BM>
static __global__ void __launch_bounds__(GM_THREADS)
    gm_gather_tiles_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int n,
                           long long wlimit, long long ebytes, const tdm_moe_group *groups,
                           int G, int H, __nv_bfloat16 *xb, unsigned *ctr) {
  wait_prior_grid();
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2) ctr[threadIdx.x] = 0u;
  const int c = ((int)blockIdx.y * GM_THREADS + (int)threadIdx.x) * 8;
  tdm_moe_group e;
  int m0;
  if (!gm_find<BM>(groups, G, n, wlimit, ebytes, (int)blockIdx.x, &e, &m0)) return;
  const int mt = min(BM, e.count - m0);
#pragma unroll 4
  for (int r = 0; r < mt && c < H; r++) {
    const size_t i = (size_t)(e.first + m0 + r);
    const uint32_t row = (uint32_t)rows[i];
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < xlimit) {
      const float4 *src = (const float4 *)(x + (size_t)row * H + c);
      const float4 a = src[0], b = src[1];
      const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      v = bf16x8(f);
    }
    *(uint4 *)(xb + i * H + c) = v;
  }
}

/* h [n x I] bf16, then xb [n x H] bf16, then counter mode's two work counters */
static size_t xb_at(int n, int I) { return ((size_t)n * I * 2 + 255) / 256 * 256; }
static size_t ctr_at(int n, int H, int I) {
  return xb_at(n, I) + ((size_t)n * H * 2 + 255) / 256 * 256;
}
size_t cuda_gmm_scratch(int n, int H, int I) { return ctr_at(n, H, I) + 256; }

/* Counter mode's blocks of a gate/up or down launch of `total` items: as many as the GPU holds
 * at once, or one an item where fewer (or where the device's size is not known);
 * m->gmm_blocks > 0 caps them further (the tests' way to have each block take many items). */
template <int BM>
static unsigned gm_blocks(const moe_cuda *m, long long total, int type) {
  int per_sm = 2;
  BY_WTYPE(type, per_sm = gm_t<QT, BM>::BLOCKS);
  const long long held = (long long)m->sms * per_sm;
  long long b = held > 0 && held < total ? held : total;
  if (m->gmm_blocks > 0 && m->gmm_blocks < b) b = m->gmm_blocks;
  return b > 0 ? (unsigned)b : 1u;
}

template <int BM>
static cudaError_t gmm_launch(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                              const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                              long long wlimit, long long ebytes, int tg, int td,
                              const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb,
                              size_t d_rb, void *ws, float *out) {
  __nv_bfloat16 *hb = (__nv_bfloat16 *)ws, *xb = (__nv_bfloat16 *)((uint8_t *)ws + xb_at(n, I));
  const unsigned tiles = (unsigned)((n + BM - 1) / BM + G), gu_cols = (unsigned)((I + 63) / 64);
  const unsigned d_cols = (unsigned)((H + 127) / 128);
  const unsigned xc = (unsigned)((H + 8 * GM_THREADS - 1) / (8 * GM_THREADS));
  cudaError_t e;
  if (m->gmm_sched == GM_GRID || (m->gmm_sched == GM_AUTO && G > GM_AUTO_G)) {
    const dim3 x_grid((unsigned)n, xc), gu_grid(tiles, gu_cols), d_grid(tiles, d_cols);
    e = launch_pdl(m, gm_gather_kernel, x_grid, GM_THREADS, 0, x, xlimit, rows, H, xb);
    if (e != cudaSuccess) return e;
    BY_WTYPE(tg, e = launch_pdl(m, gm_gate_up_kernel<QT, BM, false>, gu_grid, GM_THREADS,
                                  gm_t<QT, BM>::SMEM, (const __nv_bfloat16 *)xb, n, wbase,
                                  wlimit, ebytes, groups, G, H, I, gu_rb, hb, (unsigned *)NULL,
                                  0u, 0));
    if (e != cudaSuccess) return e;
    BY_WTYPE(td, e = launch_pdl(m, gm_down_kernel<QT, BM, false>, d_grid, GM_THREADS,
                                  gm_t<QT, BM>::SMEM, (const __nv_bfloat16 *)hb, rows, xlimit,
                                  slot, olimit, n, wbase, wlimit, ebytes, groups, G, H, I, gu_rb,
                                  d_rb, out, (unsigned *)NULL, 0u, 0));
    return e;
  }
  unsigned *ctr = (unsigned *)((uint8_t *)ws + ctr_at(n, H, I));
  const long long gu_total = (long long)tiles * gu_cols, d_total = (long long)tiles * d_cols;
  if (gu_total > INT_MAX || d_total > INT_MAX) return cudaErrorInvalidValue;
  e = launch_pdl(m, gm_gather_tiles_kernel<BM>, dim3(tiles, xc), GM_THREADS, 0, x, xlimit, rows,
                 n, wlimit, ebytes, groups, G, H, xb, ctr);
  if (e != cudaSuccess) return e;
  BY_WTYPE(tg, e = launch_pdl(m, gm_gate_up_kernel<QT, BM, true>,
                                gm_blocks<BM>(m, gu_total, tg), GM_THREADS, gm_t<QT, BM>::SMEM,
                                (const __nv_bfloat16 *)xb, n, wbase, wlimit, ebytes, groups, G,
                                H, I, gu_rb, hb, ctr, (unsigned)gu_total, (int)gu_cols));
  if (e != cudaSuccess) return e;
  BY_WTYPE(td, e = launch_pdl(m, gm_down_kernel<QT, BM, true>, gm_blocks<BM>(m, d_total, td),
                                GM_THREADS, gm_t<QT, BM>::SMEM, (const __nv_bfloat16 *)hb, rows,
                                xlimit, slot, olimit, n, wbase, wlimit, ebytes, groups, G, H, I,
                                gu_rb, d_rb, out, ctr + 1, (unsigned)d_total, (int)d_cols));
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

/* The four kernels of type T (gate/up and down, tiles of 64 and 128) in mode C, their dynamic
 * shared memory allowed. */
template <int T, bool C>
static int gm_preload_type(moe_cuda *m) {
  CK_CUDA(cudaFuncSetAttribute(gm_gate_up_kernel<T, 64, C>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, gm_t<T, 64>::SMEM));
  CK_CUDA(cudaFuncSetAttribute(gm_down_kernel<T, 64, C>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, gm_t<T, 64>::SMEM));
  CK_CUDA(cudaFuncSetAttribute(gm_gate_up_kernel<T, 128, C>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, gm_t<T, 128>::SMEM));
  CK_CUDA(cudaFuncSetAttribute(gm_down_kernel<T, 128, C>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, gm_t<T, 128>::SMEM));
  return 0;
}

int cuda_gmm_preload(moe_cuda *m) {
  static const int types[] = {TDM_MOE_W_Q8_0, TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K,
                              TDM_MOE_W_MXFP4, TDM_MOE_W_BF16, TDM_MOE_W_F16};
  cudaFuncAttributes a;
  CK_CUDA(cudaFuncGetAttributes(&a, (const void *)gm_gather_kernel));
  CK_CUDA(cudaFuncGetAttributes(&a, (const void *)gm_gather_tiles_kernel<64>));
  CK_CUDA(cudaFuncGetAttributes(&a, (const void *)gm_gather_tiles_kernel<128>));
  for (int t : types) {
    BY_WTYPE(t, int rc = gm_preload_type<QT, false>(m);
             if (!rc) rc = gm_preload_type<QT, true>(m);
             if (rc) return rc);
  }
  return 0;
}
