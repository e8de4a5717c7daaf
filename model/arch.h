/* arch.h: inside libtandem_model, a model file of either format (mfile) and what an
 * architecture reads from it (arch.c): the hyperparameters, and the tensors of each layer by
 * role, named as each format names them. Converting a tensor's elements to f32 or bf16 is
 * here too (convert.c), for every type the model can load. */
#ifndef TANDEM_MODEL_ARCH_H
#define TANDEM_MODEL_ARCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "file.h"
#include "tandem/moe_ops.h"

typedef struct tdm_gguf tdm_gguf;
typedef struct tdm_st tdm_st;

/* A model file: a GGUF file or a safetensors folder. A GGUF split into shards (llama.cpp's
 * gguf-split, the gguf package's writer: split.count files named PREFIX-00001-of-0000N.gguf,
 * the metadata in the first) is opened by its first shard's path: g is that shard, more[] the
 * others, and the tensors are found in any of them. */
typedef struct mfile {
  tdm_gguf *g;
  tdm_gguf **more;
  int nmore;
  tdm_st *s;
  const char *path;
} mfile;

int mfile_open(mfile *f, const char *path);
void mfile_close(mfile *f);
const tdm_mf_tensor *mfile_find(const mfile *f, const char *name);

typedef enum { ARCH_QWEN3MOE, ARCH_MIXTRAL } arch_kind;

typedef struct hparams {
  arch_kind kind;
  char name[128];
  int L, H, nh, nkv, hd, V, E, k, I, ctx_train;
  double rope_base, rope_scale, eps;
  bool neox, qk_norm, renorm, tied;
} hparams;

/* The architecture and its hyperparameters, from a GGUF's metadata or a config.json; every
 * count positive and within what the kernels index. */
int arch_read(const mfile *f, hparams *hp);

/* The tensors of a role, found and checked against the hyperparameters' shape (the
 * name, the expected shape and the file's in the message when they differ). */
typedef enum {
  T_EMBD, T_OUT_NORM, T_OUTPUT,                               /* global (layer ignored) */
  T_ATTN_NORM, T_WQ, T_WK, T_WV, T_WO, T_QNORM, T_KNORM,      /* per layer */
  T_FFN_NORM, T_ROUTER,
  T_ROLES
} tensor_role;

/* Whether the model has a tensor of role r (Qwen3's q/k norms; an untied LM head). */
bool arch_has(const hparams *hp, tensor_role r);

/* The tensor of a role in layer l (NULL with the error set when it is missing or its shape is
 * wrong; the optional ones, T_OUTPUT when tied, are NULL without error). */
const tdm_mf_tensor *arch_tensor(const mfile *f, const hparams *hp, tensor_role r, int l);

/* Expert e of layer l, as three views: gate and up [I x H], down [H x I], each an element
 * range of a tensor (GGUF: a slice of the layer's 3-D tensor; safetensors: the expert's own). */
typedef struct expert_part {
  const tdm_mf_tensor *t;
  size_t first; /* in elements */
} expert_part;
int arch_expert(const mfile *f, const hparams *hp, int l, int e, expert_part parts[3]);

/* Elements [first, first + n) of t converted (F32, F16, BF16; other types: TDM_ENOTSUP). */
int convert_f32(const tdm_mf_tensor *t, size_t first, size_t n, float *dst, const char *path);
int convert_bf16(const tdm_mf_tensor *t, size_t first, size_t n, tdm_moe_bf16 *dst,
                 const char *path);

#endif
