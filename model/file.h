/* file.h: inside libtandem_model, what a model file's readers (gguf.c, safetensors.c) give the
 * rest of the library: the file's tensors as views into its memory-mapped bytes, each checked
 * against the file's length before it is handed out, and its metadata read by key. Both
 * formats meet here so that the architectures (arch.c) read either the same way. */
#ifndef TANDEM_MODEL_FILE_H
#define TANDEM_MODEL_FILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. The numbers are GGUF's ggml_type values, so the GGUF reader keeps them as
 * they are; safetensors' dtypes map onto the same ones. A type the library cannot compute in
 * yet (the quantized ones) is still read and described: its name and its block layout. */
typedef enum tdm_mf_type {
  TDM_MF_F32 = 0,
  TDM_MF_F16 = 1,
  TDM_MF_Q4_0 = 2,
  TDM_MF_Q4_1 = 3,
  TDM_MF_Q5_0 = 6,
  TDM_MF_Q5_1 = 7,
  TDM_MF_Q8_0 = 8,
  TDM_MF_Q8_1 = 9,
  TDM_MF_Q2_K = 10,
  TDM_MF_Q3_K = 11,
  TDM_MF_Q4_K = 12,
  TDM_MF_Q5_K = 13,
  TDM_MF_Q6_K = 14,
  TDM_MF_Q8_K = 15,
  TDM_MF_I8 = 24,
  TDM_MF_I16 = 25,
  TDM_MF_I32 = 26,
  TDM_MF_I64 = 27,
  TDM_MF_F64 = 28,
  TDM_MF_BF16 = 30,
  TDM_MF_MXFP4 = 39,
} tdm_mf_type;

/* A type's block: `block` elements take `bytes` bytes (1 and the element's size for plain
 * types). Returns 0, or -1 for a number that is no type this library knows. */
int tdm_mf_type_block(int type, int *block, int *bytes);
const char *tdm_mf_type_name(int type); /* "F32", "Q4_K", ...; "?" when unknown */

#define TDM_MF_MAX_DIMS 4

/* One tensor of a file. shape is row-major, outermost first: a GGUF tensor whose ne is
 * {H, I, E} has shape {E, I, H}, as safetensors writes the same array. data points into the
 * mapping (valid while the file is open) and spans bytes = the elements' size in the type. */
typedef struct tdm_mf_tensor {
  const char *name;
  int type;
  int ndim;
  int64_t shape[TDM_MF_MAX_DIMS];
  const void *data;
  size_t bytes;
} tdm_mf_tensor;

/* The number of elements of t (the product of its shape). */
int64_t tdm_mf_elements(const tdm_mf_tensor *t);

/* Block-quantized types widened to f32 exactly as ggml widens them (quant.c): whether type is
 * one of them (Q8_0, Q4_K, Q6_K and MXFP4, which libtandem_moe also computes in; Q5_K, which
 * it computes in as a projection's type only; Q4_0, Q4_1, Q5_0 and Q5_1, which a model widens
 * as it loads them), and nblocks whole blocks of it at `blocks` into y (nblocks x the type's
 * block of values): 0, or -1 for another type. */
int tdm_mf_dequant_type(int type);
int tdm_mf_dequant(int type, const void *blocks, size_t nblocks, float *y);

/* The tandem/moe_ops.h weight type (TDM_MOE_W_*) of a file's type: F16, BF16 and the
 * block-quantized ones above; 0 for the others (F32 among them). */
int tdm_mf_moe_wtype(int type);

/* Bytes [first, first + bytes) of t's data are no longer needed: the whole pages among them
 * leave the process's memory (a model's experts, once copied to pinned memory, are not held
 * twice). Reading them again later still works. Out of range: nothing. */
void tdm_mf_release(const tdm_mf_tensor *t, size_t first, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif
