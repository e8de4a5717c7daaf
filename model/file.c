/* file.c: the element types that model files share (file.h): each type's name and block
 * layout, one table, and a tensor's element count. */
#include "file.h"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

/* ggml's block sizes (ggml-common.h's block_* structs). They match the gguf Python package's
 * GGML_QUANT_SIZES except for Q8_1, which the package gives as 40 bytes (two f32 scales, an old
 * layout) where ggml's block_q8_1 has two f16 ones: 36. ggml is what reads the files. */
static const struct type_info {
  int type;
  const char *name;
  int block, bytes;
} types[] = {
    {TDM_MF_F32, "F32", 1, 4},         {TDM_MF_F16, "F16", 1, 2},
    {TDM_MF_BF16, "BF16", 1, 2},       {TDM_MF_F64, "F64", 1, 8},
    {TDM_MF_I8, "I8", 1, 1},           {TDM_MF_I16, "I16", 1, 2},
    {TDM_MF_I32, "I32", 1, 4},         {TDM_MF_I64, "I64", 1, 8},
    {TDM_MF_Q4_0, "Q4_0", 32, 18},     {TDM_MF_Q4_1, "Q4_1", 32, 20},
    {TDM_MF_Q5_0, "Q5_0", 32, 22},     {TDM_MF_Q5_1, "Q5_1", 32, 24},
    {TDM_MF_Q8_0, "Q8_0", 32, 34},     {TDM_MF_Q8_1, "Q8_1", 32, 36},
    {TDM_MF_Q2_K, "Q2_K", 256, 84},    {TDM_MF_Q3_K, "Q3_K", 256, 110},
    {TDM_MF_Q4_K, "Q4_K", 256, 144},   {TDM_MF_Q5_K, "Q5_K", 256, 176},
    {TDM_MF_Q6_K, "Q6_K", 256, 210},   {TDM_MF_Q8_K, "Q8_K", 256, 292},
    {TDM_MF_MXFP4, "MXFP4", 32, 17},
};

static const struct type_info *find(int type) {
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (types[i].type == type) return &types[i];
  return NULL;
}

int tdm_mf_type_block(int type, int *block, int *bytes) {
  const struct type_info *t = find(type);
  if (!t) return -1;
  if (block) *block = t->block;
  if (bytes) *bytes = t->bytes;
  return 0;
}

const char *tdm_mf_type_name(int type) {
  const struct type_info *t = find(type);
  return t ? t->name : "?";
}

/* The readers have checked that the product fits in int64_t; a tensor built by hand with a
 * shape that overflows gets -1 rather than a wrapped count. */
int64_t tdm_mf_elements(const tdm_mf_tensor *t) {
  int64_t n = 1;
  if (!t || t->ndim < 0 || t->ndim > TDM_MF_MAX_DIMS) return -1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) return -1;
    if (t->shape[i] != 0 && n > INT64_MAX / t->shape[i]) return -1;
    n *= t->shape[i];
  }
  return n;
}

/* The whole pages inside the range: the mapping is private and read-only, so dropping them
 * loses nothing (a later read maps them from the file again). */
void tdm_mf_release(const tdm_mf_tensor *t, size_t first, size_t bytes) {
  long ps = sysconf(_SC_PAGESIZE);
  if (!t || !t->data || ps <= 0 || first > t->bytes || bytes > t->bytes - first) return;
  uintptr_t a = (uintptr_t)t->data + first, b = a + bytes, page = (uintptr_t)ps;
  a = (a + page - 1) / page * page;
  b = b / page * page;
  if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
}
