/* quant.c: GGUF's block-quantized types, by the file's type ids, widened by libtandem_moe's
 * exact widening (tdm_moe_dequant_row: ggml's values, bit for bit), and named in its types
 * for the experts that stay quantized. */
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
  default: return 0;
  }
}

int tdm_mf_dequant(int type, const void *blocks, size_t nblocks, float *y) {
  int block, bytes;
  if (!tdm_mf_dequant_type(type) || tdm_mf_type_block(type, &block, &bytes) != 0) return -1;
  return tdm_moe_dequant_row(tdm_mf_moe_wtype(type), blocks, y, (int64_t)(nblocks * block)) ? -1
                                                                                            : 0;
}

int tdm_mf_dequant_type(int type) {
  return type == TDM_MF_Q8_0 || type == TDM_MF_Q4_K || type == TDM_MF_Q6_K ||
         type == TDM_MF_MXFP4;
}
