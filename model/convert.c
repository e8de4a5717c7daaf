/* convert.c: a tensor's elements as f32 (exact from F32, F16 and BF16, and from the block types
 * Q8_0, Q4_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 and Q5_K as ggml widens them: quant.c) or as
 * bf16 (exact from BF16, rounded to nearest even from the others), for the weights a model
 * loads. Other quantized types are refused by name. */
#include <stdbool.h>
#include <string.h>

#include "arch.h"
#include "tandem.h"

/* Elements [first, first + n) of t: a type the library widens, within the tensor, and for a
 * block type whole blocks (first and n multiples of the block: the model's ranges are rows or
 * experts, whose sizes the shape checks have tied to the tensor's). */
static int check_range(const tdm_mf_tensor *t, size_t first, size_t n, const char *path) {
  bool plain = t->type == TDM_MF_F32 || t->type == TDM_MF_F16 || t->type == TDM_MF_BF16;
  if (!plain && !tdm_mf_dequant_type(t->type))
    return tdm_set_error(TDM_ENOTSUP, 0, "%s: tensor %s is %s; tandem loads F32, F16, BF16, "
                         "Q8_0, Q4_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 and Q5_K tensors",
                         path, t->name, tdm_mf_type_name(t->type));
  int block = 1, bytes = 0;
  tdm_mf_type_block(t->type, &block, &bytes);
  if (first % (size_t)block || n % (size_t)block)
    return tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s (%s): elements [%zu, %zu) are not whole "
                         "blocks of %d", path, t->name, tdm_mf_type_name(t->type), first,
                         first + n, block);
  size_t have = t->bytes / (size_t)bytes * (size_t)block; /* whole blocks' elements */
  if (first > have || n > have - first)
    return tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s: elements [%zu, %zu) of %zu", path,
                         t->name, first, first + n, have);
  return 0;
}

/* A block type's elements [first, first + n) (whole blocks, checked) into dst. */
static void dequant(const tdm_mf_tensor *t, size_t first, size_t n, float *dst) {
  int block = 1, bytes = 0;
  tdm_mf_type_block(t->type, &block, &bytes);
  const uint8_t *b = (const uint8_t *)t->data + first / (size_t)block * (size_t)bytes;
  tdm_mf_dequant(t->type, b, n / (size_t)block, dst);
}

int convert_f32(const tdm_mf_tensor *t, size_t first, size_t n, float *dst, const char *path) {
  int rc = check_range(t, first, n, path);
  if (rc) return rc;
  if (tdm_mf_dequant_type(t->type)) {
    dequant(t, first, n, dst);
    return 0;
  }
  if (t->type == TDM_MF_F32) {
    memcpy(dst, (const float *)t->data + first, n * sizeof(float));
    return 0;
  }
  const uint16_t *src = (const uint16_t *)t->data + first;
  if (t->type == TDM_MF_F16)
    for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_f16_to_f32(src[i]);
  else
    for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_bf16_to_f32(src[i]);
  return 0;
}

int convert_bf16(const tdm_mf_tensor *t, size_t first, size_t n, tdm_moe_bf16 *dst,
                 const char *path) {
  int rc = check_range(t, first, n, path);
  if (rc) return rc;
  if (tdm_mf_dequant_type(t->type)) { /* widened a piece at a time, then rounded */
    enum { PIECE = 4096 }; /* a multiple of every block size */
    float buf[PIECE];
    for (size_t at = 0; at < n; at += PIECE) {
      size_t c = n - at < PIECE ? n - at : PIECE;
      dequant(t, first + at, c, buf);
      for (size_t i = 0; i < c; i++) dst[at + i] = tdm_moe_f32_to_bf16(buf[i]);
    }
  } else if (t->type == TDM_MF_BF16) {
    memcpy(dst, (const uint16_t *)t->data + first, n * sizeof(uint16_t));
  } else if (t->type == TDM_MF_F16) {
    const uint16_t *src = (const uint16_t *)t->data + first;
    for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_f32_to_bf16(tdm_moe_f16_to_f32(src[i]));
  } else {
    const float *src = (const float *)t->data + first;
    for (size_t i = 0; i < n; i++) dst[i] = tdm_moe_f32_to_bf16(src[i]);
  }
  return 0;
}
