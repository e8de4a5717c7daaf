/* quant.c: tandem/moe_ops.h's weight types, sized and widened exactly (tdm_moe_dequant_row).
 * Compiled without floating-point contraction (moe/CMakeLists.txt): each value is computed in
 * ggml's f32 operations in its order, so the bits are ggml's. */
#include "quant.h"

size_t tdm_moe_row_bytes(int wtype, int64_t n) {
  int values, bytes;
  tdm_moe__wtype_block(wtype, &values, &bytes);
  if (!values || n <= 0 || n % values) return 0;
  uint64_t blocks = (uint64_t)n / (uint64_t)values;
  if (blocks > SIZE_MAX / (uint64_t)bytes) return 0;
  return (size_t)blocks * (size_t)bytes;
}

size_t tdm_moe_expert_size(tdm_moe_wfmt f, int H, int I) {
  if (f.gu == TDM_MOE_W_Q5_K || f.d == TDM_MOE_W_Q5_K) return 0; /* a projection's type only */
  size_t gu = tdm_moe_row_bytes(f.gu, H), d = tdm_moe_row_bytes(f.d, I);
  if (!gu || !d || I <= 0 || H <= 0) return 0;
  if (gu > SIZE_MAX / 2 / (size_t)I || d > SIZE_MAX / (size_t)H) return 0;
  size_t a = 2 * gu * (size_t)I, b = d * (size_t)H;
  return a > SIZE_MAX - b ? 0 : a + b;
}

int tdm_moe_dequant_row(int wtype, const void *src, float *dst, int64_t n) {
  size_t rb = tdm_moe_row_bytes(wtype, n);
  if (!rb || !src || !dst)
    return tdm_set_error(TDM_EINVAL, 0, "moe dequant_row: type %d, %lld values, src %p, dst %p",
                         wtype, (long long)n, src, (void *)dst);
  const uint8_t *b = src;
  size_t count = (size_t)n;
  switch (wtype) {
  case TDM_MOE_W_F16:
  case TDM_MOE_W_BF16:
    for (size_t i = 0; i < count; i++) {
      uint16_t h;
      memcpy(&h, b + 2 * i, sizeof h);
      dst[i] = wtype == TDM_MOE_W_F16 ? tdm_moe_f16_to_f32(h) : tdm_moe_bf16_to_f32(h);
    }
    break;
  default: /* a block type: tdm_moe_row_bytes knows no other */
    tdm_moe__dequant_blocks(wtype, b, count, dst);
    break;
  }
  return 0;
}
