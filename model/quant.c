/* quant.c: GGUF's block-quantized types widened to f32 exactly as ggml defines them (ggml's
 * dequantize_row_* in ggml-quants.c, and the gguf package's gguf.quants, which the tests
 * compare with): Q8_0, Q4_K, Q6_K and MXFP4, the types of llama.cpp's Q8_0 and Q4_K_M files
 * and of gpt-oss's experts. Each value is computed in the same f32 operations, in the same
 * order, as there (this file is compiled without floating-point contraction, so no multiply
 * and add fuse where ggml's reference code does not), so the values are the same bits. */
#include <string.h>

#include "file.h"
#include "tandem/moe_ops.h" /* tdm_moe_f16_to_f32 */

static float f16_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h); /* little-endian, as GGUF files are */
  return tdm_moe_f16_to_f32(h);
}

/* Q8_0: 32 values = d (f16) x q (int8). 34 bytes. */
static void q8_0(const uint8_t *b, float *y) {
  float d = f16_at(b);
  const int8_t *qs = (const int8_t *)(b + 2);
  for (int j = 0; j < 32; j++) y[j] = qs[j] * d;
}

/* Q4_K's 6-bit scale and min of sub-block j from the 12 packed bytes. */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/* Q4_K: 256 values in 8 sub-blocks of 32, value = d sc q - dmin m with 6-bit sc and m. Layout:
 * d, dmin (f16), scales[12], qs[128] (low nibbles: the first 32 of 64, high: the next). 144 bytes. */
static void q4_k(const uint8_t *b, float *y) {
  float d = f16_at(b), min = f16_at(b + 2);
  const uint8_t *scales = b + 4, *q = b + 16;
  int is = 0;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, &sc, &m);
    float d1 = d * sc, m1 = min * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    float d2 = d * sc, m2 = min * m;
    for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

/* Q6_K: 256 values in 16 sub-blocks of 16, value = d sc q with int8 sc and 6-bit q - 32.
 * Layout: ql[128] (low 4 bits), qh[64] (high 2), scales[16] (int8), d (f16). 210 bytes. */
static void q6_k(const uint8_t *b, float *y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t *sc = (const int8_t *)(b + 192);
  float d = f16_at(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; l++) {
      int is = l / 16;
      int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * sc[is + 0] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

/* MXFP4: 32 values = 2^(e - 128) x (twice an E2M1 value), e an E8M0 exponent (2^(e - 128) is
 * half the block's scale: the table holds doubled values). Layout: e, qs[16] (value j in the
 * low nibble of qs[j], value j + 16 in its high nibble). 17 bytes. */
static void mxfp4(const uint8_t *b, float *y) {
  static const int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  uint8_t e = b[0];
  uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23; /* 2^(e - 128) */
  float d;
  memcpy(&d, &bits, sizeof d);
  for (int j = 0; j < 16; j++) {
    y[j] = kv[b[1 + j] & 0x0F] * d;
    y[j + 16] = kv[b[1 + j] >> 4] * d;
  }
}

int tdm_mf_dequant(int type, const void *blocks, size_t nblocks, float *y) {
  void (*fn)(const uint8_t *, float *);
  int block, bytes;
  switch (type) {
  case TDM_MF_Q8_0: fn = q8_0; break;
  case TDM_MF_Q4_K: fn = q4_k; break;
  case TDM_MF_Q6_K: fn = q6_k; break;
  case TDM_MF_MXFP4: fn = mxfp4; break;
  default: return -1;
  }
  tdm_mf_type_block(type, &block, &bytes);
  const uint8_t *b = blocks;
  for (size_t i = 0; i < nblocks; i++) fn(b + i * (size_t)bytes, y + i * (size_t)block);
  return 0;
}

int tdm_mf_dequant_type(int type) {
  return type == TDM_MF_Q8_0 || type == TDM_MF_Q4_K || type == TDM_MF_Q6_K ||
         type == TDM_MF_MXFP4;
}
