/* quant.h: inside libtandem_moe, GGUF's block-quantized weight types (tandem/moe_ops.h's
 * TDM_MOE_W_Q8_0, _Q4_K, _Q6_K, _MXFP4, _Q5_K) widened to f32 as ggml defines them (its
 * dequantize_row_* in ggml-quants.c; the gguf package's gguf.quants, which the tests compare
 * with). One definition of each block, inline, for two users:
 * - quant.c, the exact widening (tdm_moe_dequant_row), compiled without floating-point
 *   contraction, so each value is ggml's bits;
 * - cpu/ops.c, the expert kernels, which widen a row at a time into a buffer the size of L1 and
 *   dot it with the tokens, compiled for each instruction set they are cloned for (where the
 *   compiler may fuse a multiply and an add: Q4_K's d sc q - dmin m, within one rounding).
 * All little-endian, as GGUF files are. */
#ifndef TANDEM_MOE_QUANT_H
#define TANDEM_MOE_QUANT_H

#include <stdint.h>
#include <string.h>

#include "tandem/moe_ops.h"

#if defined(__GNUC__)
#define QUANT_INLINE static inline __attribute__((always_inline))
#else
#define QUANT_INLINE static inline
#endif

QUANT_INLINE float tdm_moe__f16_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return tdm_moe_f16_to_f32(h);
}

/* A positive f32 in binary16's normal range as its bits, rounded to nearest (a scale for
 * synthetic blocks; clamped to the range). */
QUANT_INLINE uint16_t tdm_moe__f16_of(float v) {
  union { float f; uint32_t u; } b = {v};
  int32_t e = (int32_t)((b.u >> 23) & 0xff) - 127 + 15;
  uint32_t man = (b.u & 0x7fffffu) + 0x1000u; /* rounded at the 13th bit */
  if (man & 0x800000u) man = 0, e++;
  if (e < 1) return 0x0400u;   /* the smallest normal */
  if (e > 30) return 0x7bffu;  /* the largest */
  return (uint16_t)((uint32_t)e << 10 | man >> 13);
}

/* Q8_0: 32 values = d (f16) x q (int8). 34 bytes. */
QUANT_INLINE void tdm_moe__q8_0(const uint8_t *restrict b, float *restrict y) {
  float d = tdm_moe__f16_at(b);
  const int8_t *qs = (const int8_t *)(b + 2);
  for (int j = 0; j < 32; j++) y[j] = qs[j] * d;
}

/* Q4_K's 6-bit scale and min of sub-block j from the 12 packed bytes. */
QUANT_INLINE void tdm_moe__scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/* Sub-blocks is and is + 1 of a Q4_K or Q5_K block (its d and min given): their scales d sc
 * and offsets min m, as ggml computes them. */
QUANT_INLINE void tdm_moe__k4_pair(const uint8_t *scales, int is, float d, float min,
                                   float dm[4]) {
  uint8_t sc, m;
  tdm_moe__scale_min_k4(is + 0, scales, &sc, &m);
  dm[0] = d * sc, dm[1] = min * m;
  tdm_moe__scale_min_k4(is + 1, scales, &sc, &m);
  dm[2] = d * sc, dm[3] = min * m;
}

/* Q4_K: 256 values in 8 sub-blocks of 32, value = d sc q - dmin m with 6-bit sc and m. Layout:
 * d, dmin (f16), scales[12], qs[128] (low nibbles: the first 32 of 64, high: the next). 144
 * bytes. */
QUANT_INLINE void tdm_moe__q4_k(const uint8_t *restrict b, float *restrict y) {
  float d = tdm_moe__f16_at(b), min = tdm_moe__f16_at(b + 2);
  const uint8_t *scales = b + 4, *q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    float dm[4];
    tdm_moe__k4_pair(scales, is, d, min, dm);
    for (int l = 0; l < 32; l++) y[j + l] = dm[0] * (q[l] & 0xF) - dm[1];
    for (int l = 0; l < 32; l++) y[j + 32 + l] = dm[2] * (q[l] >> 4) - dm[3];
  }
}

/* Q5_K: 256 values in 8 sub-blocks of 32, value = d sc q - dmin m as Q4_K's, with 5-bit q.
 * Layout: d, dmin (f16), scales[12] (packed as Q4_K's), qh[32], qs[128]; sub-blocks 2c and
 * 2c + 1 take the low and the high nibbles of qs[32c .. 32c + 31], and bits 2c and 2c + 1 of
 * qh[0 .. 31] as their fifth bits. 176 bytes. */
QUANT_INLINE void tdm_moe__q5_k(const uint8_t *restrict b, float *restrict y) {
  float d = tdm_moe__f16_at(b), min = tdm_moe__f16_at(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    float dm[4];
    tdm_moe__k4_pair(scales, is, d, min, dm);
    for (int l = 0; l < 32; l++)
      y[j + l] = dm[0] * (float)((q[l] & 0xF) | ((qh[l] >> is) & 1) << 4) - dm[1];
    for (int l = 0; l < 32; l++)
      y[j + 32 + l] = dm[2] * (float)((q[l] >> 4) | ((qh[l] >> (is + 1)) & 1) << 4) - dm[3];
  }
}

/* Q6_K: 256 values in 16 sub-blocks of 16, value = d sc q with int8 sc and 6-bit q - 32.
 * Layout: ql[128] (low 4 bits), qh[64] (high 2), scales[16] (int8), d (f16). 210 bytes. Per
 * half of 128 values, quarter k (32 values) takes ql's first or second 32 bytes (k odd), their
 * low or high nibbles (k >= 2), and bits 2k, 2k + 1 of qh; its two sub-blocks' scales are
 * sc[2k], sc[2k + 1]. Written sub-block by sub-block so that the loops vectorize; each value
 * is (d sc) q, ggml's operations. */
QUANT_INLINE void tdm_moe__q6_k(const uint8_t *restrict b, float *restrict y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t *sc = (const int8_t *)(b + 192);
  const float d = tdm_moe__f16_at(b + 208);
  for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128)
    for (int k = 0; k < 8; k++) { /* sub-block k of the half: quarter k / 2, its half k % 2 */
      const int quarter = k >> 1, at = (k & 1) * 16;
      const uint8_t *lo = ql + 32 * (quarter & 1) + at, *hi = qh + at;
      const unsigned sl = (unsigned)(quarter >> 1) * 4, sh = 2u * (unsigned)quarter;
      const float ds = d * sc[k];
      for (int l = 0; l < 16; l++)
        y[16 * k + l] =
            ds * (float)((int)(((lo[l] >> sl) & 0xFu) | (((hi[l] >> sh) & 3u) << 4)) - 32);
    }
}

/* MXFP4: 32 values = 2^(e - 128) x (twice an E2M1 value), e an E8M0 exponent (2^(e - 128) is
 * half the block's scale: the table holds doubled values). Layout: e, qs[16] (value j in the
 * low nibble of qs[j], value j + 16 in its high nibble). 17 bytes. */
QUANT_INLINE void tdm_moe__mxfp4(const uint8_t *restrict b, float *restrict y) {
  uint8_t e = b[0];
  uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23; /* 2^(e - 128) */
  float d;
  memcpy(&d, &bits, sizeof d);
  /* the doubled E2M1 value of code c as f32 bits, built rather than looked up (so that the
   * loops vectorize): m = c & 7 is 0, 1, or (1 + (m & 1) / 2) 2^(m >> 1); bit 3 the sign, never
   * on 0 (ggml's table holds +0 there). Low nibbles are values 0..15, high ones 16..31. */
  for (int h = 0; h < 2; h++)
    for (int j = 0; j < 16; j++) {
      const unsigned c = ((unsigned)b[1 + j] >> (4 * h)) & 0xFu, m = c & 7;
      uint32_t v = m == 0 ? 0u : m == 1 ? 0x3f800000u : (127u + (m >> 1)) << 23 | (m & 1u) << 22;
      v |= m ? (c & 8u) << 28 : 0u;
      float f;
      memcpy(&f, &v, sizeof f);
      y[16 * h + j] = f * d;
    }
}

/* K values of a block type (whole blocks) at src into y, block by block. */
QUANT_INLINE void tdm_moe__dequant_blocks(int type, const uint8_t *restrict src, size_t K,
                                          float *restrict y) {
  switch (type) {
  case TDM_MOE_W_Q8_0:
    for (size_t k = 0; k < K; k += 32, src += 34) tdm_moe__q8_0(src, y + k);
    break;
  case TDM_MOE_W_Q4_K:
    for (size_t k = 0; k < K; k += 256, src += 144) tdm_moe__q4_k(src, y + k);
    break;
  case TDM_MOE_W_Q6_K:
    for (size_t k = 0; k < K; k += 256, src += 210) tdm_moe__q6_k(src, y + k);
    break;
  case TDM_MOE_W_Q5_K:
    for (size_t k = 0; k < K; k += 256, src += 176) tdm_moe__q5_k(src, y + k);
    break;
  default: /* TDM_MOE_W_MXFP4: the callers checked the type */
    for (size_t k = 0; k < K; k += 32, src += 17) tdm_moe__mxfp4(src, y + k);
    break;
  }
}

/* A type's block: values and bytes (0 and 0 for a type that is not one of the table's). */
QUANT_INLINE void tdm_moe__wtype_block(int wtype, int *values, int *bytes) {
  switch (wtype) {
  case TDM_MOE_W_F16:
  case TDM_MOE_W_BF16: *values = 1, *bytes = 2; return;
  case TDM_MOE_W_Q8_0: *values = 32, *bytes = 34; return;
  case TDM_MOE_W_Q4_K: *values = 256, *bytes = 144; return;
  case TDM_MOE_W_Q6_K: *values = 256, *bytes = 210; return;
  case TDM_MOE_W_MXFP4: *values = 32, *bytes = 17; return;
  case TDM_MOE_W_Q5_K: *values = 256, *bytes = 176; return;
  default: *values = 0, *bytes = 0; return;
  }
}

#endif
