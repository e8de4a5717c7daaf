/* tensors.c: a model's tensors by role (arch.h): their names in each format and
 * architecture, and the shape each must have, checked before any byte of it is read. */
#include "arch.h"

#include <stdio.h>
#include <string.h>

#include "tandem.h"

/* Names by role: GGUF (both architectures), Hugging Face Qwen3-MoE, Hugging Face Mixtral.
 * %d is the layer. */
static const char *const names[T_ROLES][3] = {
    [T_EMBD] = {"token_embd.weight", "model.embed_tokens.weight", "model.embed_tokens.weight"},
    [T_OUT_NORM] = {"output_norm.weight", "model.norm.weight", "model.norm.weight"},
    [T_OUTPUT] = {"output.weight", "lm_head.weight", "lm_head.weight"},
    [T_ATTN_NORM] = {"blk.%d.attn_norm.weight", "model.layers.%d.input_layernorm.weight",
                     "model.layers.%d.input_layernorm.weight"},
    [T_WQ] = {"blk.%d.attn_q.weight", "model.layers.%d.self_attn.q_proj.weight",
              "model.layers.%d.self_attn.q_proj.weight"},
    [T_WK] = {"blk.%d.attn_k.weight", "model.layers.%d.self_attn.k_proj.weight",
              "model.layers.%d.self_attn.k_proj.weight"},
    [T_WV] = {"blk.%d.attn_v.weight", "model.layers.%d.self_attn.v_proj.weight",
              "model.layers.%d.self_attn.v_proj.weight"},
    [T_WO] = {"blk.%d.attn_output.weight", "model.layers.%d.self_attn.o_proj.weight",
              "model.layers.%d.self_attn.o_proj.weight"},
    [T_QNORM] = {"blk.%d.attn_q_norm.weight", "model.layers.%d.self_attn.q_norm.weight", NULL},
    [T_KNORM] = {"blk.%d.attn_k_norm.weight", "model.layers.%d.self_attn.k_norm.weight", NULL},
    [T_FFN_NORM] = {"blk.%d.ffn_norm.weight", "model.layers.%d.post_attention_layernorm.weight",
                    "model.layers.%d.post_attention_layernorm.weight"},
    [T_ROUTER] = {"blk.%d.ffn_gate_inp.weight", "model.layers.%d.mlp.gate.weight",
                  "model.layers.%d.block_sparse_moe.gate.weight"},
};

static int column(const mfile *f, const hparams *hp) {
  return f->g ? 0 : hp->kind == ARCH_QWEN3MOE ? 1 : 2;
}

/* The tensor called `name` with the shape {d0, d1} (d1 0: 1-D {d0}), or NULL with the error. */
static const tdm_mf_tensor *shaped(const mfile *f, const char *name, int64_t d0, int64_t d1) {
  const tdm_mf_tensor *t = mfile_find(f, name);
  if (!t) {
    tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s is missing", f->path, name);
    return NULL;
  }
  int nd = d1 ? 2 : 1;
  if (t->ndim != nd || t->shape[0] != d0 || (d1 && t->shape[1] != d1)) {
    char have[96] = "", want[64];
    for (int i = 0, at = 0; i < t->ndim && at < (int)sizeof have - 24; i++)
      at += snprintf(have + at, sizeof have - at, "%s%lld", i ? " x " : "",
                     (long long)t->shape[i]);
    if (d1)
      snprintf(want, sizeof want, "%lld x %lld", (long long)d0, (long long)d1);
    else
      snprintf(want, sizeof want, "%lld", (long long)d0);
    tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s is [%s]; the model's metadata says [%s]",
                  f->path, name, have, want);
    return NULL;
  }
  return t;
}

bool arch_has(const hparams *hp, tensor_role r) {
  if (r == T_QNORM || r == T_KNORM) return hp->qk_norm;
  return r != T_OUTPUT || !hp->tied;
}

const tdm_mf_tensor *arch_tensor(const mfile *f, const hparams *hp, tensor_role r, int l) {
  const char *fmt = names[r][column(f, hp)];
  if (!fmt || !arch_has(hp, r)) {
    tdm_set_error(TDM_EINVAL, 0, "%s: this model has no tensor of role %d", f->path, (int)r);
    return NULL;
  }
  char name[160];
  snprintf(name, sizeof name, fmt, l);
  int64_t qd = (int64_t)hp->nh * hp->hd, kvd = (int64_t)hp->nkv * hp->hd;
  switch (r) {
  case T_EMBD:
  case T_OUTPUT: return shaped(f, name, hp->V, hp->H);
  case T_OUT_NORM:
  case T_ATTN_NORM:
  case T_FFN_NORM: return shaped(f, name, hp->H, 0);
  case T_WQ: return shaped(f, name, qd, hp->H);
  case T_WK:
  case T_WV: return shaped(f, name, kvd, hp->H);
  case T_WO: return shaped(f, name, hp->H, qd);
  case T_QNORM:
  case T_KNORM: return shaped(f, name, hp->hd, 0);
  case T_ROUTER: return shaped(f, name, hp->E, hp->H);
  default: break;
  }
  tdm_set_error(TDM_EINVAL, 0, "%s: no tensor role %d", f->path, (int)r);
  return NULL;
}

/* GGUF: the layer's 3-D tensor {E, rows, cols}, checked. */
static const tdm_mf_tensor *stacked(const mfile *f, const char *name, const hparams *hp,
                                    int64_t rows, int64_t cols) {
  const tdm_mf_tensor *t = mfile_find(f, name);
  if (!t) {
    tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s is missing (GGUF files with a tensor per "
                  "expert, from before 3-D expert tensors, are not read)", f->path, name);
    return NULL;
  }
  if (t->ndim != 3 || t->shape[0] != hp->E || t->shape[1] != rows || t->shape[2] != cols) {
    tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s is not [%d x %lld x %lld] as the model's "
                  "metadata says", f->path, name, hp->E, (long long)rows, (long long)cols);
    return NULL;
  }
  return t;
}

int arch_expert(const mfile *f, const hparams *hp, int l, int e, expert_part parts[3]) {
  char name[160];
  size_t hi = (size_t)hp->H * hp->I;
  if (f->g) {
    static const char *const proj[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (int p = 0; p < 3; p++) {
      snprintf(name, sizeof name, "blk.%d.%s.weight", l, proj[p]);
      parts[p].t = p < 2 ? stacked(f, name, hp, hp->I, hp->H) : stacked(f, name, hp, hp->H, hp->I);
      if (!parts[p].t) return TDM_EINVAL;
      parts[p].first = (size_t)e * hi;
    }
    return 0;
  }
  static const char *const qwen[3] = {"gate_proj", "up_proj", "down_proj"};
  static const char *const mixtral[3] = {"w1", "w3", "w2"};
  for (int p = 0; p < 3; p++) {
    if (hp->kind == ARCH_QWEN3MOE)
      snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, qwen[p]);
    else
      snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l, e,
               mixtral[p]);
    parts[p].t = p < 2 ? shaped(f, name, hp->I, hp->H) : shaped(f, name, hp->H, hp->I);
    if (!parts[p].t) return TDM_EINVAL;
    parts[p].first = 0;
  }
  return 0;
}
