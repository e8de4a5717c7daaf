/* cuda/xfmr.cu: a transformer's operations besides the MoE layers for the CUDA backend (the
 * get_rows, matmul, rope and attention entries of tdm_moe__cuda_ops), on the queue's stream
 * like cuda/ops.cu's. The projections are cuBLAS SGEMM in full f32 (the handle's default math
 * mode: no TF32), deterministic as that handle is set up (cuda/ops.cu, blas_setup). RoPE takes
 * its angles in double, as the CPU table does. Attention is a kernel of its own: one block per
 * (token, head), each warp an online softmax over a fixed stride of the positions, the warps'
 * partial results combined in a fixed order: no atomics, the same bits every run; a prefill's
 * many queries (heads of 64 or 128) take a tiled kernel that loads each tile of the cache once
 * for 32 queries. attn_prep_at (q and k's norms and RoPE, and the cache's new rows, in one
 * kernel) and attention_at read the position from device memory as they run, so that a decode
 * step recorded once as a graph serves every position. Weights in
 * 16 bits (get_rows_h, matmul_h) are widened as they are read: decode's few tokens by a
 * one-pass kernel of its own, more by pieces widened to f32 for SGEMM. */
#include <math.h>
#include <stdint.h>

#include <cuda_fp16.h>

#include "cuda_ops.h"

#define ATT_WARPS 8       /* warps per (token, head) block */
#define ATT_MAX_HD 256    /* head sizes up to this: a lane holds up to 8 of a row's values */
#define ATT_PER_LANE (ATT_MAX_HD / 32)

/* ---- get_rows ---------------------------------------------------------------------------- */

static __global__ void get_rows_kernel(float *y, const float *table, const int32_t *ids, int H,
                                       int V) {
  wait_prior_grid();
  int32_t id = ids[blockIdx.x];
  float *yr = y + (size_t)blockIdx.x * H;
  bool ok = id >= 0 && id < V;
  const float *tr = table + (ok ? (size_t)id * H : 0);
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) yr[c] = ok ? tr[c] : 0.f;
}

int cuda_get_rows(void *st, tdm_queue *q, float *y, const float *table, const int32_t *ids,
                  int T, int H, int V) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !y || !table || !ids || T < 0 || H <= 0 || V <= 0)
    return bad_args("get_rows");
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = launch_pdl(m, get_rows_kernel, T, MOE_THREADS, 0, y, table, ids, H, V);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "get_rows_kernel");
  leave(m, saved);
  return rc;
}

/* ---- matmul: y [T x N] = x [T x K] w^T + beta y, row-major ------------------------------ */

/* In cuBLAS's column-major terms y^T (N x T) = w (N x K as the K x N column-major w^T,
 * transposed) times x^T (K x T). */
int cuda_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T, int K,
                int N, float beta) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !y || !x || !w || T < 0 || K <= 0 || N <= 0 ||
      (beta != 0.f && beta != 1.f))
    return bad_args("matmul");
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  const float one = 1.f;
  cublasStatus_t s = cublasSgemm(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w, K, x, K,
                                 &beta, y, N);
  rc = s == CUBLAS_STATUS_SUCCESS ? 0 : blas_fail(m, s, "cublasSgemm");
  leave(m, saved);
  return rc;
}

/* attn_prep_at and attention_at: *dpos as the kernel runs, clamped to [0, ctx - T]; pos0
 * itself for rope and attention (dpos NULL). */
static __device__ __forceinline__ int pos_at(const int32_t *dpos, int pos0, int ctx, int T) {
  if (!dpos) return pos0;
  int p = *dpos;
  return p < 0 ? 0 : p > ctx - T ? ctx - T : p;
}

/* ---- rope: one block per (token, head), a thread per pair -------------------------------- */

/* Pair i of a head of hd values at v, rotated for position p (times freq_scale): rope_kernel's
 * and attn_prep_kernel's one computation. */
static __device__ __forceinline__ void rope_pair(float *v, int i, int hd, double p, double base,
                                                 int neox) {
  double s, c;
  sincos(p * pow(base, -2.0 * i / hd), &s, &c);
  int half = hd / 2, i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  float x0 = v[i0], x1 = v[i1], fc = (float)c, fs = (float)s;
  v[i0] = x0 * fc - x1 * fs;
  v[i1] = x0 * fs + x1 * fc;
}

static __global__ void rope_kernel(float *x, int nh, int hd, int pos0, double base,
                                   double freq_scale, int neox) {
  wait_prior_grid();
  int t = blockIdx.x / nh, half = hd / 2;
  float *v = x + (size_t)blockIdx.x * hd;
  double p = (double)(pos0 + t) * freq_scale;
  for (int i = threadIdx.x; i < half; i += blockDim.x) rope_pair(v, i, hd, p, base, neox);
}

int cuda_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0, float base,
              float freq_scale, int neox) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !x || T < 0 || nh <= 0 || hd <= 0 || hd % 2 || pos0 < 0 ||
      !(base > 0.f) || !(freq_scale > 0.f) || (long long)T * nh > INT32_MAX)
    return bad_args("rope");
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  int threads = hd / 2 < MOE_THREADS ? (hd / 2 + 31) / 32 * 32 : MOE_THREADS;
  cudaError_t e = launch_pdl(m, rope_kernel, T * nh, threads, 0, x, nh, hd, pos0, (double)base,
                             (double)freq_scale, (int)(neox != 0));
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "rope_kernel");
  leave(m, saved);
  return rc;
}

/* ---- attn_prep_at: a block per (token, head) of q and of k ------------------------------- */

/* Block (t, j): q's head j (j < nh), in place, or k's head j - nh, into kc at row *dpos + t
 * (and v's head beside it into vc): the row in shared memory, RMS-normalized as rmsnorm_kernel
 * does a row (MOE_THREADS threads summed by block_sum: the same bits) where w is given, then
 * its pairs rotated by rope_pair. hd <= ATT_MAX_HD <= MOE_THREADS. */
static __global__ void __launch_bounds__(MOE_THREADS)
    attn_prep_kernel(float *qv, const float *k, const float *v, float *kc, float *vc,
                     const float *qn, const float *kn, int T, int nh, int nkv, int hd, float eps,
                     const int32_t *dpos, int ctx, double base, double freq_scale, int neox) {
  wait_prior_grid();
  __shared__ float row[ATT_MAX_HD], part[MOE_WARPS];
  const int pos0 = pos_at(dpos, 0, ctx, T), heads = nh + nkv;
  const int t = blockIdx.x / heads, j = blockIdx.x % heads, c = threadIdx.x;
  const size_t kvrow = (size_t)(pos0 + t) * nkv * hd;
  const float *src, *w;
  float *dst;
  if (j < nh) {
    src = dst = qv + ((size_t)t * nh + j) * hd;
    w = qn;
  } else {
    const size_t at = ((size_t)t * nkv + (j - nh)) * hd, to = kvrow + (size_t)(j - nh) * hd;
    src = k + at;
    dst = kc + to;
    w = kn;
    if (c < hd) vc[to + c] = v[at + c];
  }
  const float x = c < hd ? src[c] : 0.f;
  if (w) {
    const float inv = 1.f / sqrtf(block_sum(fmaf(x, x, 0.f), part) / (float)hd + eps);
    if (c < hd) row[c] = x * inv * w[c];
  } else if (c < hd) {
    row[c] = x;
  }
  __syncthreads();
  if (c < hd / 2) rope_pair(row, c, hd, (double)(pos0 + t) * freq_scale, base, neox);
  __syncthreads();
  if (c < hd) dst[c] = row[c];
}

int cuda_attn_prep_at(void *st, tdm_queue *q, float *qv, const float *k, const float *v,
                      float *kc, float *vc, const float *qn, const float *kn, int T, int nh,
                      int nkv, int hd, float eps, const int32_t *pos, int ctx, float base,
                      float freq_scale, int neox) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !qv || !k || !v || !kc || !vc || !pos || T < 1 || T > ctx ||
      nh <= 0 || nkv <= 0 || hd <= 0 || hd % 2 || !(eps >= 0.f) || !(base > 0.f) ||
      !(freq_scale > 0.f) || (long long)T * (nh + nkv) > INT32_MAX)
    return bad_args("attn_prep_at");
  if (hd > ATT_MAX_HD)
    return tdm_set_error(TDM_ENOTSUP, 0, "moe attn_prep_at: heads of %d values (the CUDA "
                         "kernel takes up to %d)", hd, ATT_MAX_HD);
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = launch_pdl(m, attn_prep_kernel, T * (nh + nkv), MOE_THREADS, 0, qv, k, v, kc,
                             vc, qn, kn, T, nh, nkv, hd, eps, pos, ctx, (double)base,
                             (double)freq_scale, (int)(neox != 0));
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "attn_prep_kernel");
  leave(m, saved);
  return rc;
}

/* ---- attention --------------------------------------------------------------------------- */

/* Block (t, h): query row t of head h against cache positions 0 .. pos0 + t. Warp w takes
 * positions w, w + ATT_WARPS, ...; lane l holds the row's elements l, l + 32, ... */
static __global__ void attention_kernel(float *out, const float *qv, const float *kc,
                                        const float *vc, int nh, int nkv, int hd, int pos0,
                                        const int32_t *dpos, int ctx, float scale) {
  wait_prior_grid();
  pos0 = pos_at(dpos, pos0, ctx, (int)gridDim.x / nh);
  __shared__ float wm[ATT_WARPS], wl[ATT_WARPS], wo[ATT_WARPS][ATT_MAX_HD];
  int t = blockIdx.x / nh, h = blockIdx.x % nh, g = h / (nh / nkv);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n = pos0 + t + 1;
  size_t kvrow = (size_t)nkv * hd;
  const float *qr = qv + (size_t)blockIdx.x * hd;
  float qreg[ATT_PER_LANE], o[ATT_PER_LANE];
  for (int j = 0; j < ATT_PER_LANE; j++) {
    int i = lane + 32 * j;
    qreg[j] = i < hd ? qr[i] * scale : 0.f;
    o[j] = 0.f;
  }
  float mx = -INFINITY, l = 0.f;
  for (int p = warp; p < n; p += ATT_WARPS) {
    const float *k = kc + (size_t)p * kvrow + (size_t)g * hd;
    float d = 0.f;
    for (int j = 0; j < ATT_PER_LANE; j++) {
      int i = lane + 32 * j;
      if (i < hd) d = fmaf(qreg[j], k[i], d);
    }
    for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
    float nm = fmaxf(mx, d), corr = expf(mx - nm), e = expf(d - nm);
    const float *v = vc + (size_t)p * kvrow + (size_t)g * hd;
    l = l * corr + e;
    for (int j = 0; j < ATT_PER_LANE; j++) {
      int i = lane + 32 * j;
      o[j] = o[j] * corr + (i < hd ? e * v[i] : 0.f);
    }
    mx = nm;
  }
  if (lane == 0) {
    wm[warp] = mx;
    wl[warp] = l;
  }
  for (int j = 0; j < ATT_PER_LANE; j++) {
    int i = lane + 32 * j;
    if (i < hd) wo[warp][i] = o[j];
  }
  __syncthreads();
  /* the warps' parts, in warp order: a warp with no position has mx = -inf and weighs 0 */
  float M = -INFINITY;
  for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, wm[w]);
  float L = 0.f;
  for (int w = 0; w < ATT_WARPS; w++) L += wm[w] == -INFINITY ? 0.f : wl[w] * expf(wm[w] - M);
  float *orow = out + (size_t)blockIdx.x * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float acc = 0.f;
    for (int w = 0; w < ATT_WARPS; w++)
      if (wm[w] != -INFINITY) acc += wo[w][i] * expf(wm[w] - M);
    orow[i] = acc / L;
  }
}

/* Prefill's many queries: a block takes FA_Q queries of one head (FA_Q / FA_WARPS a warp)
 * and walks the cache FA_K positions at a time, each tile of keys and values loaded once into
 * shared memory for all of them. A warp's lane j scores position j of the tile against the
 * warp's queries (float4 reads: the keys' rows padded by 4 floats, so that lanes meet no bank
 * twice), the online softmax takes the tile's maximum and sum across the lanes, and lane l
 * accumulates values l * HD/32 .. of each query's output over the tile's positions in order.
 * One order of operations for every run: the same bits each time. */
#define FA_Q 32
#define FA_K 32
#define FA_WARPS 8
#define FA_QPW (FA_Q / FA_WARPS) /* queries a warp */
#define FA_MIN_T 16              /* fewer queries take attention_kernel */

static constexpr size_t fa_smem(int hd) {
  return ((size_t)FA_Q * hd + (size_t)FA_K * (hd + 4) + (size_t)FA_K * hd) * sizeof(float);
}

template <int HD>
static __global__ void attention_tiled_kernel(float *out, const float *qv, const float *kc,
                                              const float *vc, int T, int nh, int nkv, int pos0,
                                              const int32_t *dpos, int ctx, float scale) {
  wait_prior_grid();
  pos0 = pos_at(dpos, pos0, ctx, T);
  constexpr int VPL = HD / 32, KS = HD + 4;
  extern __shared__ float4 fa_smem_f4[];
  float *Qs = (float *)fa_smem_f4, *Ks = Qs + FA_Q * HD, *Vs = Ks + FA_K * KS;
  int h = blockIdx.y, g = h / (nh / nkv), t0 = blockIdx.x * FA_Q;
  int nq = T - t0 < FA_Q ? T - t0 : FA_Q;
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  size_t qrow = (size_t)nh * HD, kvrow = (size_t)nkv * HD;
  for (int i = threadIdx.x; i < FA_Q * HD; i += blockDim.x) {
    int r = i / HD, d = i % HD;
    Qs[i] = r < nq ? qv[(size_t)(t0 + r) * qrow + (size_t)h * HD + d] * scale : 0.f;
  }
  float m[FA_QPW], l[FA_QPW], o[FA_QPW][VPL];
#pragma unroll
  for (int r = 0; r < FA_QPW; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int v = 0; v < VPL; v++) o[r][v] = 0.f;
  }
  int last = pos0 + t0 + nq - 1; /* the block's last position */
  for (int p0 = 0; p0 <= last; p0 += FA_K) {
    __syncthreads(); /* the last tile's readers are done (and Qs is written, the first time) */
    for (int i = threadIdx.x; i < FA_K * HD; i += blockDim.x) {
      int j = i / HD, d = i % HD, p = p0 + j;
      bool in = p <= last;
      Ks[j * KS + d] = in ? kc[(size_t)p * kvrow + (size_t)g * HD + d] : 0.f;
      Vs[j * HD + d] = in ? vc[(size_t)p * kvrow + (size_t)g * HD + d] : 0.f;
    }
    __syncthreads();
    float sc[FA_QPW];
#pragma unroll
    for (int r = 0; r < FA_QPW; r++) sc[r] = 0.f;
    const float4 *k4 = (const float4 *)(Ks + lane * KS);
#pragma unroll 4
    for (int d4 = 0; d4 < HD / 4; d4++) {
      float4 k = k4[d4];
#pragma unroll
      for (int r = 0; r < FA_QPW; r++) {
        float4 q = ((const float4 *)(Qs + (warp * FA_QPW + r) * HD))[d4];
        sc[r] = fmaf(q.x, k.x, fmaf(q.y, k.y, fmaf(q.z, k.z, fmaf(q.w, k.w, sc[r]))));
      }
    }
    float pr[FA_QPW];
#pragma unroll
    for (int r = 0; r < FA_QPW; r++) {
      int qi = warp * FA_QPW + r;
      bool valid = qi < nq && p0 + lane <= pos0 + t0 + qi;
      float sv = valid ? sc[r] : -INFINITY, mt = sv;
      for (int off = 16; off > 0; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
      float nm = fmaxf(m[r], mt);
      float corr = nm == -INFINITY ? 1.f : expf(m[r] - nm);
      float e = valid ? expf(sv - nm) : 0.f, sum = e;
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[r] = l[r] * corr + sum;
      m[r] = nm;
#pragma unroll
      for (int v = 0; v < VPL; v++) o[r][v] *= corr;
      pr[r] = e;
    }
    for (int j = 0; j < FA_K; j++) {
      float vv[VPL];
#pragma unroll
      for (int v = 0; v < VPL; v++) vv[v] = Vs[j * HD + lane * VPL + v];
#pragma unroll
      for (int r = 0; r < FA_QPW; r++) {
        float pj = __shfl_sync(0xffffffffu, pr[r], j);
#pragma unroll
        for (int v = 0; v < VPL; v++) o[r][v] = fmaf(pj, vv[v], o[r][v]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < FA_QPW; r++) {
    int qi = warp * FA_QPW + r;
    if (qi >= nq) continue;
    float *orow = out + (size_t)(t0 + qi) * qrow + (size_t)h * HD + lane * VPL;
#pragma unroll
    for (int v = 0; v < VPL; v++) orow[v] = o[r][v] / l[r];
  }
}

template <int HD>
static cudaError_t attention_tiled(moe_cuda *m, float *out, const float *qv, const float *kc,
                                   const float *vc, int T, int pos0, const int32_t *dpos,
                                   int ctx, int nh, int nkv, float scale) {
  dim3 grid((unsigned)((T + FA_Q - 1) / FA_Q), (unsigned)nh);
  return launch_pdl(m, attention_tiled_kernel<HD>, grid, FA_WARPS * 32, fa_smem(HD), out, qv, kc,
                    vc, T, nh, nkv, pos0, dpos, ctx, scale);
}

/* ---- prefill attention on TF32 tensor cores ----
 * attention_tiled's online softmax over tiles of the cache, with both products (scores, and
 * probabilities times values) as mma.sync m16n8k8 on TF32. Each operand goes in two parts that
 * TF32 holds exactly (hi, and lo = the rest: 22 bits together, as the projections' split) and
 * each product as three (lo hi + hi lo + hi hi), so that the result keeps f32's precision
 * within a few roundings. A block takes MA_Q queries of one head, a warp 16 of them; the cache
 * goes MA_K positions a step through shared memory, in a ring of two stages that cp.async fills
 * one step ahead of the one the tensor cores read; each row is padded by 4 floats, so that a
 * fragment's 32 loads meet 32 banks. A warp's scores stay in its registers, in the layout of
 * PTX's accumulators (thread (g, t) = (lane / 4, lane % 4) holds rows g and g + 8, columns 2t
 * and 2t + 1 of each 8), and are the left operand of the product with the values where they
 * lie: a step's 8 positions are taken in the order 0, 2, 4, 6, 1, 3, 5, 7, the order in which
 * the values' rows are read. Blocks go last queries first: with the causal mask they have the
 * most positions to read, and the short ones fill the tail. One order of operations for every
 * run: the same bits each time. */
#define MA_Q 64
#define MA_K 32
#define MA_WARPS (MA_Q / 16)

template <int HD> static constexpr size_t ma_smem() {
  return (size_t)(MA_Q + 4 * MA_K) * (HD + 4) * sizeof(float);
}

/* c += a b, a 16 x 8 (row), b 8 x 8 (column), f32 sums */
static __device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4],
                                                const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

/* tf32_round's bits in two instructions instead of its eight, for every finite v that does not
 * round past f32's largest value, as attention's operands (scaled queries, the cache,
 * probabilities) are: an infinity stays one, but a finite v that rounds past becomes one
 * (tf32_round cuts it instead), and so may a NaN. */
static __device__ __forceinline__ uint32_t tf32_bits(float v) {
  return (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
}

static __device__ __forceinline__ void split2(float v, uint32_t *hi, uint32_t *lo) {
  *hi = tf32_bits(v);
  *lo = tf32_bits(v - __uint_as_float(*hi));
}

/* c += a b with a and b in two parts each: the small products first; or, unsplit (S false:
 * lo unset), the one product. */
template <bool S>
static __device__ __forceinline__ void mma3(float c[4], const uint32_t ah[4], const uint32_t al[4],
                                            const uint32_t bh[2], const uint32_t bl[2]) {
  if (S) {
    mma_tf32(c, al, bh);
    mma_tf32(c, ah, bl);
  }
  mma_tf32(c, ah, bh);
}

/* split2, or with S false v rounded to TF32 alone (lo left unset). */
template <bool S>
static __device__ __forceinline__ void part2(float v, uint32_t *hi, uint32_t *lo) {
  if (S)
    split2(v, hi, lo);
  else
    *hi = tf32_bits(v);
}

/* Starts copying the cache's positions p0 .. p0 + MA_K - 1 (zeros past last) into Ks and Vs. */
template <int HD>
static __device__ __forceinline__ void ma_load(float *Ks, float *Vs, const float *kc,
                                               const float *vc, size_t kvrow, int kvh, int p0,
                                               int last) {
  constexpr int LD = HD + 4, V4 = HD / 4;
  for (int i = threadIdx.x; i < MA_K * V4; i += MA_WARPS * 32) {
    const int j = i / V4, d = (i % V4) * 4, p = p0 + j;
    const bool in = p <= last;
    const size_t at = in ? (size_t)p * kvrow + (size_t)kvh * HD + d : 0;
    cp_async16(Ks + j * LD + d, kc + at, in);
    cp_async16(Vs + j * LD + d, vc + at, in);
  }
  cp_async_commit();
}

template <int HD, bool S>
static __global__ void __launch_bounds__(MA_WARPS * 32)
    attention_mma_kernel(float *out, const float *qv, const float *kc, const float *vc, int T,
                         int nh, int nkv, int pos0, const int32_t *dpos, int ctx, float scale) {
  wait_prior_grid();
  pos0 = pos_at(dpos, pos0, ctx, T);
  constexpr int LD = HD + 4, NT = HD / 8, V4 = HD / 4;
  extern __shared__ float4 ma_smem_f4[];
  float *Qs = (float *)ma_smem_f4, *ring = Qs + MA_Q * LD; /* stage s: K, then V */
  const int h = blockIdx.y, kvh = h / (nh / nkv);
  const int t0 = (int)(gridDim.x - 1 - blockIdx.x) * MA_Q;
  const int nq = T - t0 < MA_Q ? T - t0 : MA_Q;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const size_t qrow = (size_t)nh * HD, kvrow = (size_t)nkv * HD;
  const int r0 = warp * 16, last = pos0 + t0 + nq - 1;
  ma_load<HD>(ring, ring + MA_K * LD, kc, vc, kvrow, kvh, 0, last);
  for (int i = threadIdx.x; i < MA_Q * V4; i += MA_WARPS * 32) {
    const int r = i / V4, d = (i % V4) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < nq) {
      v = *(const float4 *)(qv + (size_t)(t0 + r) * qrow + (size_t)h * HD + d);
      v.x *= scale, v.y *= scale, v.z *= scale, v.w *= scale;
    }
    *(float4 *)(Qs + r * LD + d) = v;
  }
  const bool va = r0 + g < nq, vb = r0 + g + 8 < nq; /* rows g and g + 8 are queries */
  const int pa = pos0 + t0 + r0 + g, pb = pa + 8;    /* ... at these positions */
  const int wlast = r0 < nq ? pos0 + t0 + (r0 + 15 < nq ? r0 + 15 : nq - 1) : -1;
  float o[NT][4], ma = -INFINITY, mb = -INFINITY, la = 0.f, lb = 0.f;
#pragma unroll
  for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  for (int p0 = 0, st = 0; p0 <= last; p0 += MA_K, st ^= 1) {
    const float *Ks = ring + 2 * st * MA_K * LD, *Vs = Ks + MA_K * LD;
    if (p0 + MA_K <= last) {
      float *nk = ring + 2 * (st ^ 1) * MA_K * LD;
      ma_load<HD>(nk, nk + MA_K * LD, kc, vc, kvrow, kvh, p0 + MA_K, last);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads(); /* this step's tile landed for every thread (and Qs is written) */
    if (p0 <= wlast) { /* else every position of the tile is after the warp's queries */
      float sc[MA_K / 8][4];
#pragma unroll
      for (int j = 0; j < MA_K / 8; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll 4
      for (int k0 = 0; k0 < HD; k0 += 8) {
        uint32_t ah[4], al[4];
        const float *qa = Qs + (r0 + g) * LD + k0 + t, *qb = qa + 8 * LD;
        part2<S>(qa[0], &ah[0], &al[0]);
        part2<S>(qb[0], &ah[1], &al[1]);
        part2<S>(qa[4], &ah[2], &al[2]);
        part2<S>(qb[4], &ah[3], &al[3]);
#pragma unroll
        for (int j = 0; j < MA_K / 8; j++) {
          uint32_t bh[2], bl[2];
          const float *kr = Ks + (8 * j + g) * LD + k0 + t;
          part2<S>(kr[0], &bh[0], &bl[0]);
          part2<S>(kr[4], &bh[1], &bl[1]);
          mma3<S>(sc[j], ah, al, bh, bl);
        }
      }
      /* the causal mask, then the online softmax of rows g (a) and g + 8 (b) across the quad */
      float xa = -INFINITY, xb = -INFINITY;
#pragma unroll
      for (int j = 0; j < MA_K / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int p = p0 + 8 * j + 2 * t + e;
          if (!va || p > pa) sc[j][e] = -INFINITY;
          if (!vb || p > pb) sc[j][2 + e] = -INFINITY;
          xa = fmaxf(xa, sc[j][e]);
          xb = fmaxf(xb, sc[j][2 + e]);
        }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, off));
        xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, off));
      }
      const float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);
      const float ca = na == -INFINITY ? 1.f : expf(ma - na);
      const float cb = nb == -INFINITY ? 1.f : expf(mb - nb);
      float sa = 0.f, sb = 0.f;
#pragma unroll
      for (int j = 0; j < MA_K / 8; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          sc[j][e] = sc[j][e] == -INFINITY ? 0.f : expf(sc[j][e] - na);
          sc[j][2 + e] = sc[j][2 + e] == -INFINITY ? 0.f : expf(sc[j][2 + e] - nb);
          sa += sc[j][e];
          sb += sc[j][2 + e];
        }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        sa += __shfl_xor_sync(0xffffffffu, sa, off);
        sb += __shfl_xor_sync(0xffffffffu, sb, off);
      }
      la = la * ca + sa;
      lb = lb * cb + sb;
      ma = na;
      mb = nb;
#pragma unroll
      for (int n = 0; n < NT; n++) {
        o[n][0] *= ca, o[n][1] *= ca;
        o[n][2] *= cb, o[n][3] *= cb;
      }
      /* o += P V: P's fragment is the scores' registers (columns 2t, 2t + 1 as t, t + 4) */
#pragma unroll
      for (int j = 0; j < MA_K / 8; j++) {
        uint32_t ah[4], al[4];
        part2<S>(sc[j][0], &ah[0], &al[0]);
        part2<S>(sc[j][2], &ah[1], &al[1]);
        part2<S>(sc[j][1], &ah[2], &al[2]);
        part2<S>(sc[j][3], &ah[3], &al[3]);
        const float *v0 = Vs + (8 * j + 2 * t) * LD + g, *v1 = v0 + LD;
#pragma unroll
        for (int n = 0; n < NT; n++) {
          uint32_t bh[2], bl[2];
          part2<S>(v0[8 * n], &bh[0], &bl[0]);
          part2<S>(v1[8 * n], &bh[1], &bl[1]);
          mma3<S>(o[n], ah, al, bh, bl);
        }
      }
    }
    __syncthreads(); /* every reader of this stage is done before the next step refills it */
  }
  float *oa = out + (size_t)(t0 + r0 + g) * qrow + (size_t)h * HD + 2 * t, *ob = oa + 8 * qrow;
#pragma unroll
  for (int n = 0; n < NT; n++) {
    if (va) *(float2 *)(oa + 8 * n) = make_float2(o[n][0] / la, o[n][1] / la);
    if (vb) *(float2 *)(ob + 8 * n) = make_float2(o[n][2] / lb, o[n][3] / lb);
  }
}

template <int HD>
static cudaError_t attention_mma(moe_cuda *m, float *out, const float *qv, const float *kc,
                                 const float *vc, int T, int pos0, const int32_t *dpos, int ctx,
                                 int nh, int nkv, float scale) {
  dim3 grid((unsigned)((T + MA_Q - 1) / MA_Q), (unsigned)nh);
  if (m->tf32_single)
    return launch_pdl(m, attention_mma_kernel<HD, false>, grid, MA_WARPS * 32, ma_smem<HD>(), out,
                      qv, kc, vc, T, nh, nkv, pos0, dpos, ctx, scale);
  return launch_pdl(m, attention_mma_kernel<HD, true>, grid, MA_WARPS * 32, ma_smem<HD>(), out,
                    qv, kc, vc, T, nh, nkv, pos0, dpos, ctx, scale);
}

static int attention_launch(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                            const float *vc, int T, int pos0, const int32_t *dpos, int ctx,
                            int nh, int nkv, int hd, float scale, const char *op) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !out || !qv || !kc || !vc || T < 0 || pos0 < 0 || nh <= 0 ||
      nkv <= 0 || nh % nkv || hd <= 0 || !(scale > 0.f) || (long long)pos0 + T > INT32_MAX ||
      (long long)T * nh > INT32_MAX || (dpos && (T < 1 || T > ctx)))
    return bad_args(op);
  if (hd > ATT_MAX_HD)
    return tdm_set_error(TDM_ENOTSUP, 0, "moe attention: heads of %d values (the CUDA kernel "
                         "takes up to %d)", hd, ATT_MAX_HD);
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e;
  const bool mma = m->tc_attention && T >= FA_MIN_T &&
                   !(((uintptr_t)out | (uintptr_t)qv | (uintptr_t)kc | (uintptr_t)vc) & 15);
  if (mma && hd == 128)
    e = attention_mma<128>(m, out, qv, kc, vc, T, pos0, dpos, ctx, nh, nkv, scale);
  else if (mma && hd == 64)
    e = attention_mma<64>(m, out, qv, kc, vc, T, pos0, dpos, ctx, nh, nkv, scale);
  else if (T >= FA_MIN_T && hd == 128)
    e = attention_tiled<128>(m, out, qv, kc, vc, T, pos0, dpos, ctx, nh, nkv, scale);
  else if (T >= FA_MIN_T && hd == 64)
    e = attention_tiled<64>(m, out, qv, kc, vc, T, pos0, dpos, ctx, nh, nkv, scale);
  else
    e = launch_pdl(m, attention_kernel, T * nh, ATT_WARPS * 32, 0, out, qv, kc, vc, nh, nkv, hd,
                   pos0, dpos, ctx, scale);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "attention_kernel");
  leave(m, saved);
  return rc;
}

int cuda_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                   const float *vc, int T, int pos0, int nh, int nkv, int hd, float scale) {
  return attention_launch(st, q, out, qv, kc, vc, T, pos0, NULL, 0, nh, nkv, hd, scale,
                          "attention");
}

int cuda_attention_at(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                      const float *vc, int T, const int32_t *pos, int ctx, int nh, int nkv,
                      int hd, float scale) {
  if (!pos) return bad_args("attention_at");
  return attention_launch(st, q, out, qv, kc, vc, T, 0, pos, ctx, nh, nkv, hd, scale,
                          "attention_at");
}

/* ---- 16-bit weights: get_rows_h, matmul_h ------------------------------------------------ */

static __device__ __forceinline__ float widen(uint16_t v, int wtype) {
  return wtype == TDM_MOE_W_F16 ? __half2float(__ushort_as_half(v))
                                : __uint_as_float((uint32_t)v << 16);
}

static __global__ void get_rows_h_kernel(float *y, const uint16_t *table, int wtype,
                                         const int32_t *ids, int H, int V) {
  wait_prior_grid();
  int32_t id = ids[blockIdx.x];
  float *yr = y + (size_t)blockIdx.x * H;
  bool ok = id >= 0 && id < V;
  const uint16_t *tr = table + (ok ? (size_t)id * H : 0);
  for (int c = threadIdx.x; c < H; c += MOE_THREADS) yr[c] = ok ? widen(tr[c], wtype) : 0.f;
}

int cuda_get_rows_h(void *st, tdm_queue *q, float *y, const uint16_t *table, int wtype,
                    const int32_t *ids, int T, int H, int V) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !y || !table || !ids || T < 0 || H <= 0 || V <= 0 ||
      (wtype != TDM_MOE_W_F16 && wtype != TDM_MOE_W_BF16))
    return bad_args("get_rows_h");
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  cudaError_t e = launch_pdl(m, get_rows_h_kernel, T, MOE_THREADS, 0, y, table, wtype, ids, H, V);
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "get_rows_h_kernel");
  leave(m, saved);
  return rc;
}

#define GEMV_MAX_T 8 /* matmul_h's one-pass kernel takes up to this many tokens */
#define GEMV_ROWS MOE_WARPS /* output rows per block: a warp each */

/* Row n of y's TT tokens: the warp's lanes stride over the row's K weights, 8 at a time
 * (16-byte loads) where vec says K and the pointers allow, each lane keeping TT sums; the
 * lanes' sums then meet in a fixed butterfly. Each weight is read once for every token. */
template <int TT>
static __global__ void gemv_h_kernel(float *y, const float *x, const uint16_t *w, int wtype,
                                     int K, int N, int beta, int vec) {
  wait_prior_grid();
  int lane = threadIdx.x % 32, n = blockIdx.x * GEMV_ROWS + threadIdx.x / 32;
  if (n >= N) return;
  const uint16_t *wr = w + (size_t)n * K;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; t++) acc[t] = 0.f;
  if (vec) {
#pragma unroll 4
    for (int k = lane * 8; k < K; k += 256) {
      uint4 raw = *(const uint4 *)(wr + k);
      const uint16_t *h = (const uint16_t *)&raw;
      float wf[8];
#pragma unroll
      for (int j = 0; j < 8; j++) wf[j] = widen(h[j], wtype);
#pragma unroll
      for (int t = 0; t < TT; t++) {
        const float4 *xr = (const float4 *)(x + (size_t)t * K + k);
        float4 a = xr[0], b = xr[1];
        float s = acc[t];
        s = fmaf(wf[0], a.x, s); s = fmaf(wf[1], a.y, s);
        s = fmaf(wf[2], a.z, s); s = fmaf(wf[3], a.w, s);
        s = fmaf(wf[4], b.x, s); s = fmaf(wf[5], b.y, s);
        s = fmaf(wf[6], b.z, s); s = fmaf(wf[7], b.w, s);
        acc[t] = s;
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      float wf = widen(wr[k], wtype);
#pragma unroll
      for (int t = 0; t < TT; t++) acc[t] = fmaf(wf, x[(size_t)t * K + k], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < TT; t++) {
    float v = acc[t];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) {
      float *yo = y + (size_t)t * N + n;
      *yo = beta ? *yo + v : v;
    }
  }
}

static __global__ void widen_kernel(float *dst, const uint16_t *src, size_t n, int wtype) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = widen(src[i], wtype);
}

static cudaError_t widen_h(moe_cuda *m, const void *w, int wtype, size_t n0, size_t c, int K,
                           float *dst) {
  size_t n = c * (size_t)K;
  unsigned blocks = (unsigned)((n + MOE_THREADS - 1) / MOE_THREADS);
  widen_kernel<<<blocks < 4096 ? blocks : 4096, MOE_THREADS, 0, m->s>>>(
      dst, (const uint16_t *)w + n0 * (size_t)K, n, wtype);
  return cudaGetLastError();
}

/* ---- prefill's projections: widened pieces of w, times x on tensor cores ----
 * TF32 keeps 11 of an f32's 24 significant bits. So that the product keeps f32's precision,
 * x is split once into two parts that TF32 holds exactly, hi = x rounded to 11 bits and lo =
 * the rest rounded the same (22 bits together), and w likewise where its widened values are
 * not TF32 already (a block type's; 16-bit values are: 11 or 8 bits, with f32's range). A piece
 * of y is then w_hi x_lo + w_lo x_hi + w_hi x_hi (smallest first, each a GEMM with f32 sums,
 * w_lo x_lo left out): within a few f32 roundings of an SGEMM, at tensor-core speed, where
 * SGEMM on the CUDA cores took most of a prefill pass's dense time. */

/* hi may be x itself (a widened piece split in place). A value that is not finite goes to hi
 * whole, so that it reaches y as in an SGEMM. */
static __global__ void tf32_split_kernel(float *hi, float *lo, const float *x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float v = x[i], h = tf32_round(v);
    hi[i] = h;
    lo[i] = isfinite(v) ? tf32_round(v - h) : 0.f;
  }
}

static cudaError_t tf32_split(moe_cuda *m, float *hi, float *lo, const float *x, size_t n) {
  unsigned blocks = (unsigned)((n + MOE_THREADS - 1) / MOE_THREADS);
  tf32_split_kernel<<<blocks < 4096 ? blocks : 4096, MOE_THREADS, 0, m->s>>>(hi, lo, x, n);
  return cudaGetLastError();
}

/* y [T x c] (row stride ldy) = x [T x K] w^T + beta y, w [c x K], in cuBLAS's column-major
 * terms as cuda_matmul's; TF32 tensor cores where tf32, else SGEMM. */
static int gemm32(moe_cuda *m, bool tf32, const float *w, const float *x, float *y, int c, int T,
                  int K, int ldy, float beta) {
  const float one = 1.f;
  cublasStatus_t s = cublasGemmEx(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, c, T, K, &one, w,
                                  CUDA_R_32F, K, x, CUDA_R_32F, K, &beta, y, CUDA_R_32F, ldy,
                                  tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT);
  return s == CUBLAS_STATUS_SUCCESS ? 0 : blas_fail(m, s, "cublasGemmEx");
}

int cuda_widened_gemm(moe_cuda *m, widen_rows_fn widen, const void *w, int wtype, bool exact,
                      float *y, const float *x, int T, int K, int N, float beta, void *ws,
                      size_t ws_bytes) {
  const size_t wsf = ws_bytes / sizeof(float), tk = (size_t)T * K, wrow = exact ? 1 : 2;
  /* The workspace: x's two parts [T x K] each, then R rows of w (and as many of w_lo). With
   * too little room for both parts and a row, or TF32 off, pieces of w are SGEMMs on x; with
   * TF32 single, one TF32 GEMM each on x and w as they are. */
  const bool split = m->tf32 && !m->tf32_single && wsf >= 2 * tk + wrow * (size_t)K;
  float *xhi = (float *)ws, *xlo = xhi + (split ? tk : 0), *wf = xlo + (split ? tk : 0);
  size_t R = (wsf - (split ? 2 * tk : 0)) / (split ? wrow : 1) / (size_t)K;
  if (R > (size_t)N) R = (size_t)N;
  float *wlo = wf + R * (size_t)K;
  cudaError_t e = split ? tf32_split(m, xhi, xlo, x, tk) : cudaSuccess;
  if (e != cudaSuccess) return cuda_fail(m, e, "tf32_split_kernel");
  int rc = 0;
  for (size_t n0 = 0; !rc && n0 < (size_t)N; n0 += R) {
    const int c = (int)((size_t)N - n0 < R ? (size_t)N - n0 : R);
    if ((e = widen(m, w, wtype, n0, (size_t)c, K, wf)) != cudaSuccess)
      return cuda_fail(m, e, "widening a piece of weights");
    if (!split) {
      rc = gemm32(m, m->tf32_single, wf, x, y + n0, c, T, K, N, beta);
      continue;
    }
    if (!exact && (e = tf32_split(m, wf, wlo, wf, (size_t)c * K)) != cudaSuccess)
      return cuda_fail(m, e, "tf32_split_kernel");
    rc = gemm32(m, true, wf, xlo, y + n0, c, T, K, N, beta);
    if (!rc && !exact) rc = gemm32(m, true, wlo, xhi, y + n0, c, T, K, N, 1.f);
    if (!rc) rc = gemm32(m, true, wf, xhi, y + n0, c, T, K, N, 1.f);
  }
  return rc;
}

static cudaError_t gemv_h(moe_cuda *m, float *y, const float *x, const uint16_t *w, int wtype,
                          int T, int K, int N, int beta) {
  int vec = K % 8 == 0 && ((uintptr_t)x | (uintptr_t)w) % 16 == 0;
  dim3 grid((unsigned)((N + GEMV_ROWS - 1) / GEMV_ROWS)), block(MOE_THREADS);
  switch (T) {
#define GEMV_CASE(n)                                                                         \
  case n: return launch_pdl(m, gemv_h_kernel<n>, grid, block, 0, y, x, w, wtype, K, N, beta, \
                            vec);
    GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4)
    GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
#undef GEMV_CASE
  }
  return cudaErrorInvalidValue;
}

int cuda_matmul_h(void *st, tdm_queue *q, float *y, const float *x, const uint16_t *w, int wtype,
                  int T, int K, int N, float beta, void *ws, size_t ws_bytes) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !y || !x || !w || T < 0 || K <= 0 || N <= 0 ||
      (beta != 0.f && beta != 1.f) || (wtype != TDM_MOE_W_F16 && wtype != TDM_MOE_W_BF16) ||
      (T > GEMV_MAX_T && (!ws || ws_bytes / sizeof(float) < (size_t)K)))
    return bad_args("matmul_h");
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  if (T <= GEMV_MAX_T) {
    cudaError_t e = gemv_h(m, y, x, w, wtype, T, K, N, beta != 0.f);
    rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "gemv_h_kernel");
    leave(m, saved);
    return rc;
  }
  rc = cuda_widened_gemm(m, widen_h, w, wtype, true, y, x, T, K, N, beta, ws, ws_bytes);
  leave(m, saved);
  return rc;
}

int cuda_xfmr_preload(moe_cuda *m) {
  const void *k[] = {(const void *)get_rows_kernel, (const void *)rope_kernel,
                     (const void *)attention_kernel, (const void *)get_rows_h_kernel,
                     (const void *)widen_kernel, (const void *)gemv_h_kernel<1>,
                     (const void *)gemv_h_kernel<2>, (const void *)gemv_h_kernel<3>,
                     (const void *)gemv_h_kernel<4>, (const void *)gemv_h_kernel<5>,
                     (const void *)gemv_h_kernel<6>, (const void *)gemv_h_kernel<7>,
                     (const void *)gemv_h_kernel<8>, (const void *)attention_tiled_kernel<64>,
                     (const void *)attention_tiled_kernel<128>, (const void *)attn_prep_kernel,
                     (const void *)tf32_split_kernel,
                     (const void *)attention_mma_kernel<64, true>,
                     (const void *)attention_mma_kernel<128, true>,
                     (const void *)attention_mma_kernel<64, false>,
                     (const void *)attention_mma_kernel<128, false>};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, k[i]));
  }
  /* the tiled attention's shared memory: past the 48 KiB a kernel has without asking */
  CK_CUDA(cudaFuncSetAttribute(attention_tiled_kernel<128>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fa_smem(128)));
  CK_CUDA(cudaFuncSetAttribute(attention_tiled_kernel<64>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fa_smem(64)));
  CK_CUDA(cudaFuncSetAttribute(attention_mma_kernel<128, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ma_smem<128>()));
  CK_CUDA(cudaFuncSetAttribute(attention_mma_kernel<64, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ma_smem<64>()));
  CK_CUDA(cudaFuncSetAttribute(attention_mma_kernel<128, false>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ma_smem<128>()));
  CK_CUDA(cudaFuncSetAttribute(attention_mma_kernel<64, false>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ma_smem<64>()));
  return 0;
}
