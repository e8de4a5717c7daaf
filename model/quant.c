/* quant.c: GGUF's block-quantized types, by the file's type ids, widened to f32 exactly as ggml
 * widens them (its dequantize_row_*; the gguf package's gguf.quants, which the tests compare
 * with bit for bit), and named in libtandem_moe's types for the experts that stay quantized.
 * - Q8_0, Q4_K, Q6_K, MXFP4 and Q5_K: libtandem_moe's widening (tdm_moe_dequant_row), the
 *   same code as its kernels' references (Q5_K's are a projection's only: matmul_q; Q5_K
 *   experts are widened to bf16, as libtandem_moe has no expert format with it);
 * - Q4_0, Q4_1, Q5_0 and Q5_1: here. libtandem_moe has no kernels for them, so a model takes
 *   them for its dense weights only (widened as it loads them), where llama.cpp's mixes put
 *   them: Q5_0 and Q5_1 where a row is no whole number of 256-value blocks (llama.cpp's
 *   quantizer falls back from Q4_K and Q5_K), the 32-value types in the files of those names.
 * Compiled without floating-point contraction (model/CMakeLists.txt): each value is computed
 * in ggml's f32 operations in its order. All little-endian, as GGUF files are. */
#include <stdbool.h>
#include <string.h>

#include "file.h"
#include "tandem/moe_ops.h"

int tdm_mf_moe_wtype(int type) {
  switch (type) {
  case TDM_MF_F16: return TDM_MOE_W_F16;
  case TDM_MF_BF16: return TDM_MOE_W_BF16;
  case TDM_MF_Q8_0: return TDM_MOE_W_Q8_0;
  case TDM_MF_Q4_K: return TDM_MOE_W_Q4_K;
  case TDM_MF_Q6_K: return TDM_MOE_W_Q6_K;
  case TDM_MF_MXFP4: return TDM_MOE_W_MXFP4;
  case TDM_MF_Q5_K: return TDM_MOE_W_Q5_K;
  default: return 0;
  }
}

static float f16_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return tdm_moe_f16_to_f32(h);
}

/* The 32-value types: a scale d (f16), for Q4_1 and Q5_1 an offset m (f16), for Q5_0 and
 * Q5_1 a 32-bit word of fifth bits (bit j: value j's), then 16 bytes of nibbles (value j in
 * the low nibble of byte j, value j + 16 in its high nibble). Value = (q - 8) d (Q4_0),
 * q d + m (Q4_1), (q - 16) d (Q5_0), q d + m (Q5_1), q holding its fifth bit as bit 4. */
static void q32(int type, const uint8_t *b, float *y) {
  const bool offset = type == TDM_MF_Q4_1 || type == TDM_MF_Q5_1;
  const bool five = type == TDM_MF_Q5_0 || type == TDM_MF_Q5_1;
  const float d = f16_at(b), m = offset ? f16_at(b + 2) : 0.0f;
  const uint8_t *p = b + (offset ? 4 : 2);
  uint32_t qh = 0;
  if (five) {
    memcpy(&qh, p, sizeof qh);
    p += 4;
  }
  const int bias = offset ? 0 : five ? 16 : 8;
  for (int j = 0; j < 16; j++) {
    int lo = p[j] & 0xF, hi = p[j] >> 4;
    if (five) {
      lo |= (int)((qh >> j) & 1u) << 4;
      hi |= (int)((qh >> (j + 16)) & 1u) << 4;
    }
    if (offset) {
      y[j] = (float)lo * d + m;
      y[j + 16] = (float)hi * d + m;
    } else {
      y[j] = (float)(lo - bias) * d;
      y[j + 16] = (float)(hi - bias) * d;
    }
  }
}

int tdm_mf_dequant(int type, const void *blocks, size_t nblocks, float *y) {
  int block, bytes;
  if (!tdm_mf_dequant_type(type) || tdm_mf_type_block(type, &block, &bytes) != 0) return -1;
  if (tdm_mf_moe_wtype(type))
    return tdm_moe_dequant_row(tdm_mf_moe_wtype(type), blocks, y, (int64_t)(nblocks * block))
               ? -1
               : 0;
  const uint8_t *b = blocks;
  for (size_t i = 0; i < nblocks; i++, b += bytes, y += block) q32(type, b, y);
  return 0;
}

int tdm_mf_dequant_type(int type) {
  switch (type) {
  case TDM_MF_Q8_0: case TDM_MF_Q4_K: case TDM_MF_Q6_K: case TDM_MF_MXFP4:
  case TDM_MF_Q4_0: case TDM_MF_Q4_1: case TDM_MF_Q5_0: case TDM_MF_Q5_1: case TDM_MF_Q5_K:
    return 1;
  default: return 0;
  }
}
