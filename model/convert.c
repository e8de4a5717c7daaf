/* convert.c: a tensor's elements as f32 (exact from F32, F16 and BF16) or as bf16 (exact from
 * BF16, rounded to nearest even from F32 and F16), for the weights a model loads. Quantized
 * types are refused by name until the kernels read their blocks. */
#include <string.h>

#include "arch.h"
#include "tandem.h"

static int check_range(const tdm_mf_tensor *t, size_t first, size_t n, const char *path) {
  if (t->type != TDM_MF_F32 && t->type != TDM_MF_F16 && t->type != TDM_MF_BF16)
    return tdm_set_error(TDM_ENOTSUP, 0, "%s: tensor %s is %s; tandem loads F32, F16 and BF16 "
                         "tensors", path, t->name, tdm_mf_type_name(t->type));
  size_t size = t->type == TDM_MF_F32 ? 4 : 2;
  if (first > t->bytes / size || n > t->bytes / size - first)
    return tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s: elements [%zu, %zu) of %zu", path,
                         t->name, first, first + n, t->bytes / size);
  return 0;
}

int convert_f32(const tdm_mf_tensor *t, size_t first, size_t n, float *dst, const char *path) {
  int rc = check_range(t, first, n, path);
  if (rc) return rc;
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
  if (t->type == TDM_MF_BF16) {
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
