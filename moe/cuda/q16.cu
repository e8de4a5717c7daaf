/* cuda/q16.cu: experts_q's decode on Q4_K and Q8_0 (gate, up, down) and Q6_K (down) rows, on
 * 16-bit activations.
 *
 * quant.cu's decode kernels widen every weight to f32 and spend about sixteen instructions a
 * weight: at one token they issue instructions, not bytes (ncu on an H100: issue slots half
 * busy, DRAM 15% busy, bench/results/h100-qdecode-8dc3b50/). Here rows are dotted in
 * integers, as GGUF's blocks are built for: each entry's activations are first rounded to
 * 16-bit integers in blocks of 32 with an f32 scale d (xq16_kernel: d = max |x| / 32767,
 * q = rint(x / d)), and a row's q are dotted with them two at a time (dp2a: two products of a
 * 16-bit and an 8-bit integer and their sum in one instruction); a block's integer sum is then
 * scaled once (Q4_K: d sc dx sum(q xq) - dmin m dx sum(xq)). About one instruction a weight;
 * the activations' rounding is 2^-16 of a block's largest value, far under bf16's. The down
 * rows take the gate/up kernel's f32 output rounded the same way. Q6_K's 6-bit q - 32 are
 * built as signed bytes, four at a time, and scaled each 16 values by its int8 scale.
 *
 * One warp per gate/up row pair, as quant.cu's, or per D16_ROWS down rows, over units of the
 * rows spread across the lanes: a Q4_K or Q6_K superblock takes eight lanes (lanes 8s .. 8s +
 * 7 take superblock 4p + s of pass p, 32 values each), a Q8_0 half block one. Q4_K: lane o
 * of the eight reads 16 bytes of q (16 values of sub-block 2j and the same 16 places of
 * 2j + 1, j = o / 2) and the superblock's 16-byte head (d, dmin, the packed scales). Q6_K:
 * lane o takes places 8(o % 4) .. + 7 of each quarter of half o / 4 (eight bytes of ql twice
 * and of qh once). Q4_K rows are read 16 bytes a load where the expert starts on 16 bytes (the
 * model's arenas do), else four bytes at a time; Q8_0 and Q6_K rows, on 2 bytes, as aligned
 * words. The sums of a lane are in pass order, then the fixed warp tree: deterministic, and a
 * token's result depends on its expert and its own activations only. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/cuda_ops.h"

extern "C" {
#include "tandem/moe_ops.h"
}

#define Q16_NT 2 /* tokens a pass over a row pair dots */

/* Sixteen bytes at p (an even address; 16-byte aligned when a16). */
static __device__ __forceinline__ uint4 ld128(const uint8_t *p, bool a16) {
  if (a16) return __ldg((const uint4 *)p);
  return make_uint4(ld32(p), ld32(p + 4), ld32(p + 8), ld32(p + 12));
}

/* Sixteen bytes at p, an even address, with no branch between lanes: five aligned words
 * (the fifth only where p is not on four bytes, so nothing past p + 16 is read) shifted. */
static __device__ __forceinline__ uint4 ld128_even(const uint8_t *p) {
  const unsigned int *a = (const unsigned int *)((uintptr_t)p & ~(uintptr_t)3);
  const unsigned sh = (unsigned)((uintptr_t)p & 2) * 8; /* 0 or 16 */
  const uint32_t w0 = __ldg(a), w1 = __ldg(a + 1), w2 = __ldg(a + 2), w3 = __ldg(a + 3);
  const uint32_t w4 = sh ? __ldg(a + 4) : 0u;
  return make_uint4(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh),
                    __funnelshift_r(w2, w3, sh), __funnelshift_r(w3, w4, sh));
}

/* ---- activations: blocks of 32 values to 16-bit integers, one warp a block (blockIdx.x the
 * entry e, the warps of blockIdx.y side by side along its row): entry e's row rows[e] of x
 * (zeros where that lies past xlimit rows), or row e when rows is NULL ---- */

static __global__ void __launch_bounds__(MOE_THREADS)
    xq16_kernel(const float *x, uint32_t xlimit, const int32_t *rows, int H, int16_t *xq,
                float2 *xd) {
  wait_prior_grid();
  const int e = blockIdx.x, lane = threadIdx.x & 31;
  const int b = blockIdx.y * MOE_WARPS + (threadIdx.x >> 5);
  if (b >= H / 32) return;
  const uint32_t row = rows ? (uint32_t)rows[e] : (uint32_t)e; /* NULL: entry e's own row */
  const float *xr = row < xlimit ? x + (size_t)row * H : NULL; /* outside: zeros, not read */
  const float v = xr ? xr[32 * b + lane] : 0.f;
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 32767.f;
  const int q = d > 0.f ? __float2int_rn(v / d) : 0;
  int s = q;
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  xq[(size_t)e * H + 32 * b + lane] = (int16_t)q;
  if (lane == 0) xd[(size_t)e * (H / 32) + b] = make_float2(d, d * (float)s);
}

/* ---- Q4_K rows dotted with them ---- */

/* Sub-blocks 2jp and 2jp + 1's 6-bit scales and mins from a Q4_K head h (moe/quant.h's
 * tdm_moe__scale_min_k4 for j = 2jp, 2jp + 1), without a branch. */
static __device__ __forceinline__ void q4k_scales2(uint4 h, int jp, int s[2], int m[2]) {
  const int sh = 16 * (jp & 1);
  const uint32_t y = h.y >> sh, z = h.z >> sh, w = h.w >> sh;
  const bool lo = jp < 2;
#pragma unroll
  for (int k = 0; k < 2; k++) {
    const uint32_t yk = y >> (8 * k), zk = z >> (8 * k), wk = w >> (8 * k);
    s[k] = lo ? (int)(yk & 63) : (int)((wk & 0xF) | ((yk >> 6) & 3) << 4);
    m[k] = lo ? (int)(zk & 63) : (int)(((wk >> 4) & 0xF) | ((zk >> 6) & 3) << 4);
  }
}

/* The lane's part of a Q4_K row's superblock against one token: head h, 16 bytes of q at
 * place o (pair jp = o / 2, half o % 2), the token's 16-bit values of the two sub-blocks at
 * the same places (a, b: 16 each) and their blocks' (d, d sum). The mins' term of a sub-block
 * is added by its half-0 lane only. */
static __device__ __forceinline__ float q4k_dot16(uint4 h, uint4 q, int o, const uint4 a[2],
                                                  const uint4 b[2], float2 da, float2 db) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  const uint32_t xa[8] = {a[0].x, a[0].y, a[0].z, a[0].w, a[1].x, a[1].y, a[1].z, a[1].w};
  const uint32_t xb[8] = {b[0].x, b[0].y, b[0].z, b[0].w, b[1].x, b[1].y, b[1].z, b[1].w};
  int ia = 0, ib = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int lo = (int)(w[i] & 0x0F0F0F0Fu), hi = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
    ia = __dp2a_lo((int)xa[2 * i], lo, ia);
    ia = __dp2a_hi((int)xa[2 * i + 1], lo, ia);
    ib = __dp2a_lo((int)xb[2 * i], hi, ib);
    ib = __dp2a_hi((int)xb[2 * i + 1], hi, ib);
  }
  int s[2], m[2];
  q4k_scales2(h, o >> 1, s, m);
  const float d = __half2float(__ushort_as_half((unsigned short)(h.x & 0xffff)));
  const float dmin = __half2float(__ushort_as_half((unsigned short)(h.x >> 16)));
  float r = d * (float)s[0] * da.x * (float)ia + d * (float)s[1] * db.x * (float)ib;
  if (!(o & 1)) r -= dmin * ((float)m[0] * da.y + (float)m[1] * db.y);
  return r;
}

/* Q8_0: a unit is half a block (16 values), one lane's: its scale d and 16 int8 q. */
static __device__ __forceinline__ void q80_load(const uint8_t *row, int u, float *d, uint4 *w) {
  const uint8_t *b = row + 34 * (size_t)(u >> 1);
  *d = f16_at(b);
  *w = ld128_even(b + 2 + 16 * (u & 1));
}

/* The unit's q against one token's 16-bit values there (xs: the token's row) and its
 * block's scales. */
static __device__ __forceinline__ float q80_dot16(float d, uint4 w, int u, const int16_t *xs,
                                                  const float2 *xd) {
  const uint4 *x = (const uint4 *)(xs + 16 * u);
  const uint4 x0 = x[0], x1 = x[1];
  int acc = __dp2a_lo((int)x0.x, (int)w.x, 0);
  acc = __dp2a_hi((int)x0.y, (int)w.x, acc);
  acc = __dp2a_lo((int)x0.z, (int)w.y, acc);
  acc = __dp2a_hi((int)x0.w, (int)w.y, acc);
  acc = __dp2a_lo((int)x1.x, (int)w.z, acc);
  acc = __dp2a_hi((int)x1.y, (int)w.z, acc);
  acc = __dp2a_lo((int)x1.z, (int)w.w, acc);
  acc = __dp2a_hi((int)x1.w, (int)w.w, acc);
  return d * xd[u >> 1].x * (float)acc;
}

/* Pass p of a gate row wg and an up row wu (a16: both on 16 bytes) for NT tokens' blocks
 * (xq, xd: each token's row). */
template <int NT>
static __device__ __forceinline__ void gu16_pass(const uint8_t *wg, const uint8_t *wu, bool a16,
                                                 int sb, int o, const int16_t *const *xq,
                                                 const float2 *const *xd, float *ag, float *au) {
  const size_t at = 144 * (size_t)sb;
  const uint4 hg = ld128(wg + at, a16), qg = ld128(wg + at + 16 + 16 * o, a16);
  const uint4 hu = ld128(wu + at, a16), qu = ld128(wu + at + 16 + 16 * o, a16);
  const int jp = o >> 1, half = o & 1;
#pragma unroll
  for (int t = 0; t < NT; t++) {
    const uint4 *xa = (const uint4 *)(xq[t] + 256 * sb + 64 * jp + 16 * half);
    const uint4 a[2] = {xa[0], xa[1]}, b[2] = {xa[4], xa[5]}; /* b: 32 values on */
    const float2 da = xd[t][8 * sb + 2 * jp], db = xd[t][8 * sb + 2 * jp + 1];
    ag[t] += q4k_dot16(hg, qg, o, a, b, da, db);
    au[t] += q4k_dot16(hu, qu, o, a, b, da, db);
  }
}

template <int TG, int NT>
static __device__ __forceinline__ void gu16_rows(const uint8_t *wg, const uint8_t *wu, int H,
                                                 const int16_t *const *xq,
                                                 const float2 *const *xd, float *ag, float *au) {
  const int lane = threadIdx.x & 31;
  if (TG == TDM_MOE_W_Q8_0) { /* a lane a unit */
    const int units = H / 16;
#pragma unroll 2
    for (int p = 0; p < (units + 31) / 32; p++) {
      const int u = 32 * p + lane;
      if (u >= units) continue;
      float dg, du;
      uint4 qg, qu;
      q80_load(wg, u, &dg, &qg);
      q80_load(wu, u, &du, &qu);
#pragma unroll
      for (int t = 0; t < NT; t++) {
        ag[t] += q80_dot16(dg, qg, u, xq[t], xd[t]);
        au[t] += q80_dot16(du, qu, u, xq[t], xd[t]);
      }
    }
    return;
  }
  const int o = lane & 7, nsb = H / 256;
  const bool a16 = (((uintptr_t)wg | (uintptr_t)wu) & 15) == 0;
#pragma unroll 2
  for (int p = 0; p < (nsb + 3) / 4; p++) {
    const int sb = 4 * p + (lane >> 3);
    if (sb < nsb) gu16_pass<NT>(wg, wu, a16, sb, o, xq, xd, ag, au);
  }
}

/* The blocks (q: K values a row, d: their scales) of entry g.first + t0 + t for t < Q16_NT,
 * the last of the nt there repeated past them (computed, not written). */
static __device__ __forceinline__ void entry_blocks(const tdm_moe_group &g, int t0, int nt,
                                                    int K, const int16_t *q, const float2 *d,
                                                    const int16_t **xr, const float2 **dr) {
#pragma unroll
  for (int t = 0; t < Q16_NT; t++) {
    const size_t e = (size_t)g.first + t0 + min(t, nt - 1);
    xr[t] = q + e * K;
    dr[t] = d + e * (K / 32);
  }
}

/* Gate/up row r of an entry's Q4_K or Q8_0 (TG) expert for its tokens: h[entry][r] =
 * SiLU(g) u, as quant.cu's gq_gate_up_kernel, on xq16_kernel's blocks of each entry
 * (xq [n x H], xd [n x H / 32]). */
template <int TG>
static __global__ void __launch_bounds__(MOE_THREADS)
    gq16_gate_up_kernel(const int16_t *xq, const float2 *xd, uint32_t xlimit,
                        const int32_t *rows, int n, const uint8_t *wbase, long long wlimit,
                        long long ebytes, const tdm_moe_group *groups, int H, int I, size_t rb,
                        float *h) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int r = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= I || !qentry_ok(g, n, wlimit, ebytes)) return; /* whole warps leave */
  const uint8_t *wg = wbase + 2 * g.w + (size_t)r * rb, *wu = wg + (size_t)I * rb;
  for (int t0 = 0; t0 < g.count; t0 += Q16_NT) {
    const int nt = min(Q16_NT, g.count - t0);
    const int16_t *xr[Q16_NT];
    const float2 *dr[Q16_NT];
    float ag[Q16_NT], au[Q16_NT];
    entry_blocks(g, t0, nt, H, xq, xd, xr, dr);
#pragma unroll
    for (int t = 0; t < Q16_NT; t++) ag[t] = au[t] = 0.f;
    if (nt == 1)
      gu16_rows<TG, 1>(wg, wu, H, xr, dr, ag, au);
    else
      gu16_rows<TG, Q16_NT>(wg, wu, H, xr, dr, ag, au);
#pragma unroll
    for (int t = 0; t < Q16_NT; t++) {
      if (t >= nt) break;
      const bool ok = (uint32_t)rows[g.first + t0 + t] < xlimit;
      const float gs = warp_sum(ag[t]), us = warp_sum(au[t]);
      if (lane == 0 && ok) h[((size_t)g.first + t0 + t) * I + r] = gs / (1.f + expf(-gs)) * us;
    }
  }
}

/* ---- down rows ---- */

/* The lane's part of a Q6_K superblock b against one token: place o (half o / 4, places
 * 8(o % 4) .. + 7 of each quarter), the token's 16-bit values at xs (the half's 128) and its
 * four blocks' scales xd4. Rows start on 2 bytes, so loads are four bytes at most. */
static __device__ __forceinline__ float q6k_dot16(const uint8_t *b, int o, const int16_t *xs,
                                                  const float2 *xd4) {
  const int n = o >> 2, l = 8 * (o & 3);
  const uint32_t ql[2][2] = {{ld32(b + 64 * n + l), ld32(b + 64 * n + l + 4)},
                             {ld32(b + 64 * n + 32 + l), ld32(b + 64 * n + 32 + l + 4)}};
  const uint32_t qh[2] = {ld32(b + 128 + 32 * n + l), ld32(b + 128 + 32 * n + l + 4)};
  const uint32_t sc0 = ld32(b + 192 + 8 * n), sc1 = ld32(b + 196 + 8 * n);
  const float d = f16_at(b + 208);
  float r = 0.f;
#pragma unroll
  for (int k = 0; k < 4; k++) { /* quarter k: values 32k + l .. + 7 of the half */
    const uint4 x = *(const uint4 *)(xs + 32 * k + l);
    const int sl = 4 * (k >> 1), sh = 2 * k;
    int v[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
      v[i] = (int)__vsub4(((ql[k & 1][i] >> sl) & 0x0F0F0F0Fu) |
                              (((qh[i] >> sh) & 0x03030303u) << 4),
                          0x20202020u);
    int acc = __dp2a_lo((int)x.x, v[0], 0);
    acc = __dp2a_hi((int)x.y, v[0], acc);
    acc = __dp2a_lo((int)x.z, v[1], acc);
    acc = __dp2a_hi((int)x.w, v[1], acc);
    const int j = 2 * k + (l >= 16); /* the sub-block's scale, of the half's eight */
    const int sc = (int)(int8_t)((j < 4 ? sc0 : sc1) >> (8 * (j & 3)));
    r += d * (float)sc * xd4[k].x * (float)acc;
  }
  return r;
}

/* Superblock sb of a down row wd of type TD for NT tokens' blocks of h, added to acc. */
template <int TD, int NT>
static __device__ __forceinline__ void d16_unit(const uint8_t *wd, bool a16, int sb, int o,
                                                const int16_t *const *xq,
                                                const float2 *const *xd, float *acc) {
  if (TD == TDM_MOE_W_Q4_K) {
    const size_t at = 144 * (size_t)sb;
    const uint4 h = ld128(wd + at, a16), q = ld128(wd + at + 16 + 16 * o, a16);
    const int jp = o >> 1, half = o & 1;
#pragma unroll
    for (int t = 0; t < NT; t++) {
      const uint4 *xa = (const uint4 *)(xq[t] + 256 * sb + 64 * jp + 16 * half);
      const uint4 a[2] = {xa[0], xa[1]}, b[2] = {xa[4], xa[5]};
      acc[t] += q4k_dot16(h, q, o, a, b, xd[t][8 * sb + 2 * jp], xd[t][8 * sb + 2 * jp + 1]);
    }
  } else if (TD == TDM_MOE_W_Q8_0) { /* sb: the unit (half a block) */
    float d;
    uint4 w;
    q80_load(wd, sb, &d, &w);
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] += q80_dot16(d, w, sb, xq[t], xd[t]);
  } else { /* Q6_K */
    const uint8_t *b = wd + 210 * (size_t)sb;
    const int n = o >> 2;
#pragma unroll
    for (int t = 0; t < NT; t++)
      acc[t] += q6k_dot16(b, o, xq[t] + 256 * sb + 128 * n, xd[t] + 8 * sb + 4 * n);
  }
}

/* A down row has few superblocks (an expert's FFN width I = 768 is three), so a warp takes
 * D16_ROWS rows, back to back in memory: its rows' units (superblocks, eight lanes each; for
 * Q8_0 half blocks, a lane each; nsb a row) are spread over the lanes pass by pass, each
 * added to its row's sums; then one warp tree a row. */
#define D16_ROWS 4

template <int TD, int NT>
static __device__ __forceinline__ void d16_rows(const uint8_t *wd, size_t rb, int nrows,
                                                int nsb, const int16_t *const *xq,
                                                const float2 *const *xd,
                                                float acc[D16_ROWS][Q16_NT]) {
  constexpr int LPU = TD == TDM_MOE_W_Q8_0 ? 1 : 8, UPP = 32 / LPU; /* lanes a unit, units a pass */
  const int lane = threadIdx.x & 31, o = lane % LPU, units = nrows * nsb;
  const bool a16 = (((uintptr_t)wd | rb) & 15) == 0;
#pragma unroll 3
  for (int p = 0; p < (units + UPP - 1) / UPP; p++) {
    const int u = UPP * p + lane / LPU;
    if (u >= units) continue;
    const int r = u / nsb;
    float part[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) part[t] = 0.f;
    d16_unit<TD, NT>(wd + (size_t)r * rb, a16, u - r * nsb, o, xq, xd, part);
#pragma unroll
    for (int k = 0; k < D16_ROWS; k++)
#pragma unroll
      for (int t = 0; t < NT; t++)
        if (k == r) acc[k][t] += part[t];
  }
}

/* Down rows c0 .. c0 + D16_ROWS - 1 of an entry's expert for its tokens: out[slot][c] =
 * h . Wd[c], as quant.cu's gq_down_kernel, on xq16_kernel's blocks of h (hq [n x I],
 * hd [n x I / 32]). */
template <int TD>
static __global__ void __launch_bounds__(MOE_THREADS)
    gq16_down_kernel(const int16_t *hq, const float2 *hd, const int32_t *rows, uint32_t xlimit,
                     const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                     long long wlimit, long long ebytes, const tdm_moe_group *groups, int H,
                     int I, size_t gu_rb, size_t rb, float *out) {
  wait_prior_grid();
  const tdm_moe_group g = groups[blockIdx.y];
  const int c0 = D16_ROWS * (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5));
  const int lane = threadIdx.x & 31;
  if (c0 >= H || !qentry_ok(g, n, wlimit, ebytes)) return;
  const int nrows = min(D16_ROWS, H - c0), nsb = TD == TDM_MOE_W_Q8_0 ? I / 16 : I / 256;
  const uint8_t *wd = wbase + 2 * g.w + 2 * (size_t)I * gu_rb + (size_t)c0 * rb;
  for (int t0 = 0; t0 < g.count; t0 += Q16_NT) {
    const int nt = min(Q16_NT, g.count - t0);
    const int16_t *xr[Q16_NT];
    const float2 *dr[Q16_NT];
    float acc[D16_ROWS][Q16_NT];
    entry_blocks(g, t0, nt, I, hq, hd, xr, dr);
#pragma unroll
    for (int t = 0; t < Q16_NT; t++)
#pragma unroll
      for (int k = 0; k < D16_ROWS; k++) acc[k][t] = 0.f;
    if (nt == 1)
      d16_rows<TD, 1>(wd, rb, nrows, nsb, xr, dr, acc);
    else
      d16_rows<TD, Q16_NT>(wd, rb, nrows, nsb, xr, dr, acc);
#pragma unroll
    for (int t = 0; t < Q16_NT; t++) {
      if (t >= nt) break;
      const uint32_t s = (uint32_t)slot[g.first + t0 + t];
      const bool ok = s < olimit && (uint32_t)rows[g.first + t0 + t] < xlimit;
#pragma unroll
      for (int k = 0; k < D16_ROWS; k++) {
        const float v = warp_sum(acc[k][t]);
        if (lane == 0 && ok && k < nrows) out[(size_t)s * H + c0 + k] = v;
      }
    }
  }
}

static dim3 xq16_grid(int n, int K) {
  return dim3((unsigned)n, (unsigned)((K / 32 + MOE_WARPS - 1) / MOE_WARPS));
}

/* Bytes of the scratch of n entries' blocks of K values. */
static size_t blocks16_bytes(int n, int K) {
  return ((size_t)n * K * sizeof(int16_t) + (size_t)n * (K / 32) * sizeof(float2) + 255) / 256 *
         256;
}

size_t cuda_q16_scratch(int n, int H) { return blocks16_bytes(n, H); }

bool cuda_q16_down_takes(int td) {
  return td == TDM_MOE_W_Q4_K || td == TDM_MOE_W_Q6_K || td == TDM_MOE_W_Q8_0;
}

bool cuda_q16_gate_up_takes(int tg) { return tg == TDM_MOE_W_Q4_K || tg == TDM_MOE_W_Q8_0; }

size_t cuda_q16_down_scratch(int n, int I) { return blocks16_bytes(n, I); }

cudaError_t cuda_down_q16(moe_cuda *m, const float *h, const int32_t *rows, uint32_t xlimit,
                          const int32_t *slot, uint32_t olimit, int n, const uint8_t *wbase,
                          long long wlimit, long long ebytes, int td,
                          const tdm_moe_group *groups, int G, int H, int I, size_t gu_rb,
                          size_t rb, float *out, void *scratch) {
  int16_t *hq = (int16_t *)scratch;
  float2 *hd = (float2 *)(hq + (size_t)n * I);
  cudaError_t e = launch_pdl(m, xq16_kernel, xq16_grid(n, I), MOE_THREADS, 0, h, (uint32_t)n,
                             (const int32_t *)NULL, I, hq, hd);
  if (e != cudaSuccess) return e;
  const int warps = (H + D16_ROWS - 1) / D16_ROWS;
  const dim3 grid((unsigned)((warps + MOE_WARPS - 1) / MOE_WARPS), (unsigned)G);
  if (td == TDM_MOE_W_Q4_K)
    return launch_pdl(m, gq16_down_kernel<TDM_MOE_W_Q4_K>, grid, MOE_THREADS, 0,
                      (const int16_t *)hq, (const float2 *)hd, rows, xlimit, slot, olimit, n,
                      wbase, wlimit, ebytes, groups, H, I, gu_rb, rb, out);
  if (td == TDM_MOE_W_Q8_0)
    return launch_pdl(m, gq16_down_kernel<TDM_MOE_W_Q8_0>, grid, MOE_THREADS, 0,
                      (const int16_t *)hq, (const float2 *)hd, rows, xlimit, slot, olimit, n,
                      wbase, wlimit, ebytes, groups, H, I, gu_rb, rb, out);
  return launch_pdl(m, gq16_down_kernel<TDM_MOE_W_Q6_K>, grid, MOE_THREADS, 0,
                    (const int16_t *)hq, (const float2 *)hd, rows, xlimit, slot, olimit, n,
                    wbase, wlimit, ebytes, groups, H, I, gu_rb, rb, out);
}

cudaError_t cuda_gate_up_q16(moe_cuda *m, const float *x, uint32_t xlimit, const int32_t *rows,
                             int n, const uint8_t *wbase, long long wlimit, long long ebytes,
                             int tg, const tdm_moe_group *groups, int G, int H, int I, size_t rb,
                             float *h, void *scratch) {
  int16_t *xq = (int16_t *)scratch;
  float2 *xd = (float2 *)(xq + (size_t)n * H);
  cudaError_t e = launch_pdl(m, xq16_kernel, xq16_grid(n, H), MOE_THREADS, 0, x, xlimit, rows, H,
                             xq, xd);
  if (e != cudaSuccess) return e;
  const dim3 grid((unsigned)((I + MOE_WARPS - 1) / MOE_WARPS), (unsigned)G);
  if (tg == TDM_MOE_W_Q8_0)
    return launch_pdl(m, gq16_gate_up_kernel<TDM_MOE_W_Q8_0>, grid, MOE_THREADS, 0,
                      (const int16_t *)xq, (const float2 *)xd, xlimit, rows, n, wbase, wlimit,
                      ebytes, groups, H, I, rb, h);
  return launch_pdl(m, gq16_gate_up_kernel<TDM_MOE_W_Q4_K>, grid, MOE_THREADS, 0,
                    (const int16_t *)xq, (const float2 *)xd, xlimit, rows, n, wbase, wlimit,
                    ebytes, groups, H, I, rb, h);
}

int cuda_q16_preload(moe_cuda *m) {
  const void *k[] = {(const void *)xq16_kernel,
                     (const void *)gq16_gate_up_kernel<TDM_MOE_W_Q4_K>,
                     (const void *)gq16_gate_up_kernel<TDM_MOE_W_Q8_0>,
                     (const void *)gq16_down_kernel<TDM_MOE_W_Q4_K>,
                     (const void *)gq16_down_kernel<TDM_MOE_W_Q6_K>,
                     (const void *)gq16_down_kernel<TDM_MOE_W_Q8_0>};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    cudaFuncAttributes a;
    CK_CUDA(cudaFuncGetAttributes(&a, k[i]));
  }
  return 0;
}
