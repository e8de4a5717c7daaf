/* cuda/xfmr.cu: a transformer's operations besides the MoE layers for the CUDA backend (the
 * get_rows, matmul, rope and attention entries of tdm_moe__cuda_ops), on the queue's stream
 * like cuda/ops.cu's. The projections are cuBLAS SGEMM in full f32 (the handle's default math
 * mode: no TF32), deterministic as that handle is set up (cuda/ops.cu, blas_setup). RoPE takes
 * its angles in double, as the CPU table does. Attention is a kernel of its own: one block per
 * (token, head), each warp an online softmax over a fixed stride of the positions, the warps'
 * partial results combined in a fixed order: no atomics, the same bits every run. */
#include <math.h>
#include <stdint.h>

#include "cuda_ops.h"

#define ATT_WARPS 8       /* warps per (token, head) block */
#define ATT_MAX_HD 256    /* head sizes up to this: a lane holds up to 8 of a row's values */
#define ATT_PER_LANE (ATT_MAX_HD / 32)

/* ---- get_rows ---------------------------------------------------------------------------- */

static __global__ void get_rows_kernel(float *y, const float *table, const int32_t *ids, int H,
                                       int V) {
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
  get_rows_kernel<<<T, MOE_THREADS, 0, m->s>>>(y, table, ids, H, V);
  cudaError_t e = cudaGetLastError();
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

/* ---- rope: one block per (token, head), a thread per pair -------------------------------- */

static __global__ void rope_kernel(float *x, int nh, int hd, int pos0, double base,
                                   double freq_scale, int neox) {
  int t = blockIdx.x / nh, half = hd / 2;
  float *v = x + (size_t)blockIdx.x * hd;
  double p = (double)(pos0 + t) * freq_scale;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(p * pow(base, -2.0 * i / hd), &s, &c);
    int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    float x0 = v[i0], x1 = v[i1], fc = (float)c, fs = (float)s;
    v[i0] = x0 * fc - x1 * fs;
    v[i1] = x0 * fs + x1 * fc;
  }
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
  rope_kernel<<<T * nh, threads, 0, m->s>>>(x, nh, hd, pos0, (double)base, (double)freq_scale,
                                            neox != 0);
  cudaError_t e = cudaGetLastError();
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "rope_kernel");
  leave(m, saved);
  return rc;
}

/* ---- attention --------------------------------------------------------------------------- */

/* Block (t, h): query row t of head h against cache positions 0 .. pos0 + t. Warp w takes
 * positions w, w + ATT_WARPS, ...; lane l holds the row's elements l, l + 32, ... */
static __global__ void attention_kernel(float *out, const float *qv, const float *kc,
                                        const float *vc, int nh, int nkv, int hd, int pos0,
                                        float scale) {
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

int cuda_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                   const float *vc, int T, int pos0, int nh, int nkv, int hd, float scale) {
  moe_cuda *m = (moe_cuda *)st;
  if (check_queue(m, q) || !out || !qv || !kc || !vc || T < 0 || pos0 < 0 || nh <= 0 ||
      nkv <= 0 || nh % nkv || hd <= 0 || !(scale > 0.f) || (long long)pos0 + T > INT32_MAX ||
      (long long)T * nh > INT32_MAX)
    return bad_args("attention");
  if (hd > ATT_MAX_HD)
    return tdm_set_error(TDM_ENOTSUP, 0, "moe attention: heads of %d values (the CUDA kernel "
                         "takes up to %d)", hd, ATT_MAX_HD);
  if (T == 0) return 0;
  int saved, rc = enter(m, &saved);
  if (rc) return rc;
  attention_kernel<<<T * nh, ATT_WARPS * 32, 0, m->s>>>(out, qv, kc, vc, nh, nkv, hd, pos0,
                                                        scale);
  cudaError_t e = cudaGetLastError();
  rc = e == cudaSuccess ? 0 : cuda_fail(m, e, "attention_kernel");
  leave(m, saved);
  return rc;
}

int cuda_xfmr_preload(moe_cuda *m) {
  const void *k[] = {(const void *)get_rows_kernel, (const void *)rope_kernel,
                     (const void *)attention_kernel};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, k[i]));
  }
  return 0;
}
