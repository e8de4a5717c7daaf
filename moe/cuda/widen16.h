/* cuda/widen16.h: a staged row of a block format (unit32.h's, in shared memory) widened to
 * bf16 for gmm.cu's tensor cores, with no integer-to-float conversion: 16 values at a time into
 * a shared weight tile (gm_fill: every type), or straight into a warp's mma.sync operand
 * fragments (gf_frag: Q8_0, Q4_K, Q6_K, with gf_scale's table of a step's scales); and the
 * ldmatrix and mma.sync calls themselves. A weight gets the same bf16 value either way. */
#ifndef TANDEM_MOE_CUDA_WIDEN16_H
#define TANDEM_MOE_CUDA_WIDEN16_H
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/unit32.h"

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

/* The 16 bytes at p (shared memory, an even address) as 4 words: a word a load where p is a
 * multiple of 4 (a step's rows are, where their expert and row size are), else two halves. */
static __device__ __forceinline__ void lds16(const uint8_t *p, uint32_t w[4]) {
  if (((uintptr_t)p & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = *(const uint32_t *)(p + 4 * i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = u_w<false>(p + 4 * i);
  }
}

/* What a staged K-quant superblock's units share, read once a step (a thread's scale bytes
 * from 16-byte loads, not a byte a unit): Q4_K's d and dmin (w[0]) and 12 bytes of packed 6-bit
 * scales and mins (w[1..3]); Q6_K's 16 8-bit scales (w[0..3]) and d. */
struct gm_hdr {
  uint32_t w[4];
  float d;
};

template <int T>
static __device__ __forceinline__ void gm_header(const uint8_t *b, gm_hdr *hd) {
  if (T == TDM_MOE_W_Q4_K) {
    lds16(b, hd->w);
  } else if (T == TDM_MOE_W_Q6_K) {
    lds16(b + 192, hd->w);
    hd->d = u_f16<false>(b + 208);
  }
}

/* Unit u's scale d sc and offset dmin m of a staged Q4_K superblock's header hd (the 6-bit sc
 * and m of tdm_moe__scale_min_k4, byte by byte). */
static __device__ __forceinline__ void q4k_unit_scale(const gm_hdr &hd, int u, float *d1,
                                                      float *m1) {
  const uint32_t *sc = hd.w + 1;
  uint32_t is, im;
  if (u < 4) {
    is = (sc[0] >> (8 * u)) & 63;
    im = (sc[1] >> (8 * u)) & 63;
  } else {
    const int k = 8 * (u - 4);
    is = ((sc[2] >> k) & 0xF) | (((sc[0] >> (k + 6)) & 3) << 4);
    im = ((sc[2] >> (k + 4)) & 0xF) | (((sc[1] >> (k + 6)) & 3) << 4);
  }
  const float d = __half2float(__ushort_as_half((unsigned short)(hd.w[0] & 0xFFFF)));
  const float dmin = __half2float(__ushort_as_half((unsigned short)(hd.w[0] >> 16)));
  *d1 = d * small_f(is);
  *m1 = dmin * small_f(im);
}

/* Half h (values 16h .. 16h + 15) of unit u of a staged Q4_K superblock b (even address, in
 * shared memory; hd its header): d sc q - dmin m as bf16, the scale and offset rounded to bf16
 * first and the product and difference rounded once. */
static __device__ __forceinline__ void q4k_half_bf16(const uint8_t *b, const gm_hdr &hd, int u,
                                                     int h, uint32_t p[8]) {
  float d1, m1;
  q4k_unit_scale(hd, u, &d1, &m1);
  const __nv_bfloat162 s = __float2bfloat162_rn(d1), nm = __float2bfloat162_rn(-m1);
  const __nv_bfloat162 base = __float2bfloat162_rn(128.f);
  uint32_t qw[4];
  lds16(b + 16 + 32 * (u >> 1) + 16 * h, qw);
  const int shift = (u & 1) * 4;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = (qw[i] >> shift) & 0x0F0F0F0Fu;
    __nv_bfloat162 lo, hi;
    magic4(w, &lo, &hi);
    p[2 * i] = bf2_bits(__hfma2(__hsub2(lo, base), s, nm));
    p[2 * i + 1] = bf2_bits(__hfma2(__hsub2(hi, base), s, nm));
  }
}

/* The same for a staged Q6_K superblock: d sc (q - 32), d sc rounded to bf16 first (sc: byte
 * 8 (u / 4) + 2 (u % 4) + h of the scales). */
static __device__ __forceinline__ void q6k_half_bf16(const uint8_t *b, const gm_hdr &hd, int u,
                                                     int h, uint32_t p[8]) {
  const int hh = u >> 2, qq = u & 3;
  const uint8_t *ql = b + 64 * hh + 32 * (qq & 1) + 16 * h, *qh = b + 128 + 32 * hh + 16 * h;
  const uint32_t sw = hd.w[2 * hh + (qq >> 1)] >> (16 * (qq & 1) + 8 * h);
  const float d = hd.d * (float)(int8_t)(sw & 0xFF);
  const __nv_bfloat162 s = __float2bfloat162_rn(d), base = __float2bfloat162_rn(160.f);
  const int sl = (qq >> 1) * 4, sh = 2 * qq;
  uint32_t lw[4], hw[4];
  lds16(ql, lw);
  lds16(qh, hw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = ((lw[i] >> sl) & 0x0F0F0F0Fu) | (((hw[i] >> sh) & 0x03030303u) << 4);
    __nv_bfloat162 lo, hi;
    magic4(w, &lo, &hi);
    p[2 * i] = bf2_bits(__hmul2(__hsub2(lo, base), s));
    p[2 * i + 1] = bf2_bits(__hmul2(__hsub2(hi, base), s));
  }
}

/* The same for a staged Q8_0 block's half: d q, through f32 (2^23 + 128 + q taken off). */
static __device__ __forceinline__ void q80_half_bf16(const uint8_t *b, int h, uint32_t p[8]) {
  const float d = u_f16<false>(b);
  uint32_t qw[4];
  lds16(b + 2 + 16 * h, qw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const uint32_t w = qw[i] ^ 0x80808080u;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      v[j] = (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | j)) - 8388736.f) * d;
    p[2 * i] = bf2_bits(__floats2bfloat162_rn(v[0], v[1]));
    p[2 * i + 1] = bf2_bits(__floats2bfloat162_rn(v[2], v[3]));
  }
}

/* 16 bytes into shared memory at a shared window address. */
static __device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

/* Half h of unit s of the staged step at row (this thread's weight row; !wvalid: zeros) into
 * its 16 places of the weight tile at bd (a shared window address), as bf16. */
template <int T>
static __device__ __forceinline__ void gm_fill(uint32_t bd, const uint8_t *row, const gm_hdr &hd,
                                               int h, bool wvalid, int s) {
  if (!wvalid) {
    sts128(bd, make_uint4(0u, 0u, 0u, 0u));
    sts128(bd + 16, make_uint4(0u, 0u, 0u, 0u));
    return;
  }
  uint32_t p[8];
  if (T == TDM_MOE_W_Q4_K) {
    q4k_half_bf16(row, hd, s, h, p);
  } else if (T == TDM_MOE_W_Q6_K) {
    q6k_half_bf16(row, hd, s, h, p);
  } else if (T == TDM_MOE_W_Q8_0) {
    q80_half_bf16(row + 34 * s, h, p);
  } else {
    float v[16];
    unit16<T, false>(row, s, h, v);
    sts128(bd, bf16x8(v));
    sts128(bd + 16, bf16x8(v + 8));
    return;
  }
  sts128(bd, make_uint4(p[0], p[1], p[2], p[3]));
  sts128(bd + 16, make_uint4(p[4], p[5], p[6], p[7]));
}

/* ---- the tensor cores: ldmatrix and mma.sync on bf16 ---- */

/* Four 8 x 8 matrices of 16-bit values: lane l gives the address of row l % 8 of matrix l / 8
 * and gets its share of each, in r[0..3]. */
static __device__ __forceinline__ void ldsm4(uint32_t r[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

/* c += a b: a 16 x 16 (row), b 16 x 8 (column), bf16, f32 sums. */
static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                                uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* ---- Q8_0, Q4_K and Q6_K: weight fragments widened in registers ----
 * Each warp widens its own fragments of mma.sync's right operand (thread (g, q) = (lane / 4,
 * lane % 4) of an 8-row block holds row g's values 2q, 2q + 1 and 2q + 8, 2q + 9 of each 16)
 * straight from the staged step, with no weight tile in between: shared memory then carries
 * only the staged bytes, the activations and a table of each step's scales. The values are
 * gm_fill's, in the same places of the same products: the results are the same bits. */

static __device__ __forceinline__ uint32_t lds_u16(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

static __device__ __forceinline__ uint2 lds_u64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

static __device__ __forceinline__ void sts_u64(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1,%2};" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

/* A thread's 4 bytes of a staged 16: bytes 2q, 2q + 8, 2q + 1, 2q + 9 of the 16 at p, in this
 * order (p + 2q even). */
static __device__ __forceinline__ uint32_t lds_frag(uint32_t p) {
  return __byte_perm(lds_u16(p), lds_u16(p + 8), 0x5140);
}

/* Unit u's scale entry of the staged superblock or block row b (hd its header), as the
 * fragments take them: Q4_K's d sc and -dmin m, each as a bf16 pair of itself; Q6_K's d sc of
 * the unit's two halves, the same; Q8_0's d as f32. */
template <int T>
static __device__ __forceinline__ uint2 gf_scale(const uint8_t *b, const gm_hdr &hd, int u) {
  if (T == TDM_MOE_W_Q4_K) {
    float d1, m1;
    q4k_unit_scale(hd, u, &d1, &m1);
    return make_uint2(bf2_bits(__float2bfloat162_rn(d1)), bf2_bits(__float2bfloat162_rn(-m1)));
  } else if (T == TDM_MOE_W_Q6_K) {
    const int i = u >> 1; /* u may be known only when the kernel runs: no index into hd.w */
    const uint32_t wi = i & 2 ? (i & 1 ? hd.w[3] : hd.w[2]) : (i & 1 ? hd.w[1] : hd.w[0]);
    const uint32_t sw = wi >> (16 * (u & 1));
    return make_uint2(bf2_bits(__float2bfloat162_rn(hd.d * (float)(int8_t)(sw & 0xFF))),
                      bf2_bits(__float2bfloat162_rn(hd.d * (float)(int8_t)((sw >> 8) & 0xFF))));
  } else {
    return make_uint2(__float_as_uint(u_f16<false>(b + 34 * u)), 0u);
  }
}

/* bf16 pairs (128 + c) of the 4- or 6-bit codes in bytes 0 and 2 of w (lo) and 1 and 3 (hi),
 * after w >> sft and the mask m (0x000F000F for 4 bits, 0x00FF00FF for codes already cut); mc:
 * 0x43004300 in a register, so that each pair is one three-input logic instruction. */
static __device__ __forceinline__ void magic_pair(uint32_t w, int sft, uint32_t m, uint32_t mc,
                                                  uint32_t *lo, uint32_t *hi) {
  *lo = ((w >> sft) & m) | mc;
  *hi = ((w >> (sft + 8)) & m) | mc;
}

/* The fragment (b[0]: values 2q, 2q + 1; b[1]: 2q + 8, 2q + 9) of values 16 kk .. + 15 of
 * unit u of the staged row at rb - 2q (rb: a shared window address), e its scale entry, mc
 * magic_pair's; w: Q4_K's bytes of the unit pair (lds_frag at even u, kept for the odd one). */
template <int T>
static __device__ __forceinline__ void gf_frag(uint32_t rb, uint2 e, int u, int kk, uint32_t mc,
                                               uint32_t w, uint32_t b[2]) {
  const __nv_bfloat162 base = __float2bfloat162_rn(T == TDM_MOE_W_Q6_K ? 160.f : 128.f);
  uint32_t lo, hi;
  if (T == TDM_MOE_W_Q4_K) {
    magic_pair(w, (u & 1) * 4, 0x000F000Fu, mc, &lo, &hi);
    const __nv_bfloat162 s2 = *(const __nv_bfloat162 *)&e.x, nm2 = *(const __nv_bfloat162 *)&e.y;
    b[0] = bf2_bits(__hfma2(__hsub2(*(const __nv_bfloat162 *)&lo, base), s2, nm2));
    b[1] = bf2_bits(__hfma2(__hsub2(*(const __nv_bfloat162 *)&hi, base), s2, nm2));
  } else if (T == TDM_MOE_W_Q6_K) {
    const int hh = u >> 2, qq = u & 3;
    const uint32_t wl = lds_frag(rb + 64 * hh + 32 * (qq & 1) + 16 * kk);
    const uint32_t wh = lds_frag(rb + 128 + 32 * hh + 16 * kk);
    const uint32_t c = ((wl >> ((qq >> 1) * 4)) & 0x0F0F0F0Fu) |
                       (((wh >> (2 * qq)) & 0x03030303u) << 4);
    magic_pair(c, 0, 0x00FF00FFu, mc, &lo, &hi);
    const __nv_bfloat162 s2 = *(const __nv_bfloat162 *)(kk ? &e.y : &e.x);
    b[0] = bf2_bits(__hmul2(__hsub2(*(const __nv_bfloat162 *)&lo, base), s2));
    b[1] = bf2_bits(__hmul2(__hsub2(*(const __nv_bfloat162 *)&hi, base), s2));
  } else { /* Q8_0: d q through f32, as q80_half_bf16 */
    const float d = __uint_as_float(e.x);
    const uint32_t x = lds_frag(rb + 34 * u + 2 + 16 * kk) ^ 0x80808080u;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      v[j] = (__uint_as_float(__byte_perm(x, 0x4B000000u, 0x7540 | j)) - 8388736.f) * d;
    b[0] = bf2_bits(__floats2bfloat162_rn(v[0], v[2]));
    b[1] = bf2_bits(__floats2bfloat162_rn(v[1], v[3]));
  }
}

#endif
