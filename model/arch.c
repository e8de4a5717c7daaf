/* arch.c: the architectures a model file may hold (Qwen3-MoE and Mixtral) in either format:
 * their hyperparameters, from a GGUF's metadata keys (<arch>.block_count, ...) or a
 * config.json, and their tensors by role, named as llama.cpp's GGUF files name them
 * (blk.N.attn_q.weight) or as Hugging Face's do (model.layers.N.self_attn.q_proj.weight).
 *
 * Two facts of the formats shape what follows. GGUF's `llama` files (Mixtral among them) have
 * their q and k rows permuted by the converter so that RoPE on adjacent pairs gives Hugging
 * Face's rotate-half; `qwen3moe` files are not permuted and use rotate-half. And GGUF keeps a
 * layer's experts in three 3-D tensors ([E x I x H] for gate and up, [E x H x I] for down),
 * where Hugging Face keeps a tensor per expert and projection. */
#include "arch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "safetensors.h"
#include "tandem.h"

/* A shard's split.no and split.count (0 and 1 for a file that is not split); the getters'
 * messages name the file and the key. */
static int split_keys(tdm_gguf *g, uint64_t *no, uint64_t *count) {
  *no = 0;
  *count = 1;
  int rc = tdm_gguf_get_u64(g, "split.count", count);
  if (rc == TDM_ENOENT) return 0;
  if (rc || (rc = tdm_gguf_get_u64(g, "split.no", no))) return rc;
  if (*count < 1 || *count > 99999 || *no >= *count)
    return tdm_set_error(TDM_EINVAL, 0, "%s: shard split.no %llu of split.count %llu",
                         tdm_gguf_path(g), (unsigned long long)*no,
                         (unsigned long long)*count);
  return 0;
}

/* The other shards of a split GGUF whose first shard f->g is open: each named as the first is
 * with its own number, numbered so, of the same count, and no tensor in two of them. */
static int open_shards(mfile *f) {
  uint64_t no, count;
  int rc = split_keys(f->g, &no, &count);
  if (rc || count == 1) return rc;
  char tail[48];
  snprintf(tail, sizeof tail, "-%05llu-of-%05llu.gguf", 1ULL, (unsigned long long)count);
  size_t n = strlen(f->path), t = strlen(tail);
  if (no != 0 || n < t || strcmp(f->path + n - t, tail) != 0)
    return tdm_set_error(TDM_EINVAL, 0, "%s: shard %llu of a GGUF split in %llu: open the "
                         "first, named PREFIX%s", f->path, (unsigned long long)no + 1,
                         (unsigned long long)count, tail);
  f->more = calloc((size_t)count - 1, sizeof *f->more);
  char *path = malloc(n + sizeof tail); /* the prefix, then a tail of t characters */
  if (!f->more || !path) {
    free(path);
    return tdm_set_error(TDM_ENOMEM, 0, "%s: no memory for its %llu shards", f->path,
                         (unsigned long long)count);
  }
  uint64_t tensors = tdm_gguf_tensor_count(f->g), want = 0;
  for (uint64_t i = 1; !rc && i < count; i++) {
    memcpy(path, f->path, n - t);
    snprintf(path + (n - t), t + sizeof tail, "-%05llu-of-%05llu.gguf",
             (unsigned long long)i + 1, (unsigned long long)count);
    tdm_gguf *g = NULL;
    if ((rc = tdm_gguf_open(path, &g))) break; /* its message names the shard's path */
    uint64_t gno, gcount;
    if (!(rc = split_keys(g, &gno, &gcount)) && (gno != i || gcount != count))
      rc = tdm_set_error(TDM_EINVAL, 0, "%s: says it is shard %llu of %llu, not %llu of %llu",
                         path, (unsigned long long)gno + 1, (unsigned long long)gcount,
                         (unsigned long long)i + 1, (unsigned long long)count);
    /* a name the shards before it hold (mfile_find: g is not among them yet) */
    for (size_t k = 0; !rc && k < tdm_gguf_tensor_count(g); k++)
      if (mfile_find(f, tdm_gguf_tensor_at(g, k)->name))
        rc = tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s is in two of its shards (%s)",
                           f->path, tdm_gguf_tensor_at(g, k)->name, path);
    tensors += tdm_gguf_tensor_count(g);
    f->more[f->nmore++] = g; /* closed with the others */
  }
  if (!rc && tdm_gguf_get_u64(f->g, "split.tensors.count", &want) == 0 && want != tensors)
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: split.tensors.count is %llu; its %llu shards hold "
                       "%llu tensors", f->path, (unsigned long long)want,
                       (unsigned long long)count, (unsigned long long)tensors);
  free(path);
  return rc;
}

int mfile_open(mfile *f, const char *path) {
  memset(f, 0, sizeof *f);
  f->path = path;
  size_t n = strlen(path);
  bool gguf = n >= 5 && strcmp(path + n - 5, ".gguf") == 0;
  if (!gguf) { /* not named .gguf: a folder is safetensors, a file is tried as GGUF (its magic) */
    FILE *probe = fopen(path, "rb");
    char magic[4] = {0};
    gguf = probe && fread(magic, 1, 4, probe) == 4 && memcmp(magic, "GGUF", 4) == 0;
    if (probe) fclose(probe);
  }
  if (!gguf) return tdm_st_open(path, &f->s);
  int rc = tdm_gguf_open(path, &f->g);
  if (!rc && (rc = open_shards(f))) mfile_close(f);
  return rc;
}

void mfile_close(mfile *f) {
  if (f->g) tdm_gguf_close(f->g);
  for (int i = 0; i < f->nmore; i++) tdm_gguf_close(f->more[i]);
  free(f->more);
  if (f->s) tdm_st_close(f->s);
  f->g = NULL;
  f->more = NULL;
  f->nmore = 0;
  f->s = NULL;
}

const tdm_mf_tensor *mfile_find(const mfile *f, const char *name) {
  if (!f->g) return tdm_st_tensor_find(f->s, name);
  const tdm_mf_tensor *t = tdm_gguf_tensor_find(f->g, name);
  for (int i = 0; !t && i < f->nmore; i++) t = tdm_gguf_tensor_find(f->more[i], name);
  return t;
}

/* ---- hyperparameters --------------------------------------------------------------------- */

/* A GGUF key "<arch>.<what>" as an integer / a float; missing ones keep *v when optional. */
static int g_int(const mfile *f, const char *arch, const char *what, int *v, bool optional) {
  char key[160];
  uint64_t u;
  snprintf(key, sizeof key, "%s.%s", arch, what);
  int rc = tdm_gguf_get_u64(f->g, key, &u);
  if (rc == TDM_ENOENT && optional) return 0;
  if (rc) return tdm_set_error(rc, 0, "%s: metadata %s: %s", f->path, key, tdm_last_error());
  if (u < 1 || u > INT32_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%s: metadata %s is %llu", f->path, key,
                         (unsigned long long)u);
  *v = (int)u;
  return 0;
}

static int g_f64(const mfile *f, const char *arch, const char *what, double *v) {
  char key[160];
  snprintf(key, sizeof key, "%s.%s", arch, what);
  int rc = tdm_gguf_get_f64(f->g, key, v);
  return rc == TDM_ENOENT ? 0 : rc;
}

static int read_gguf(const mfile *f, hparams *hp) {
  const char *arch = NULL, *name = NULL;
  size_t len;
  int rc = tdm_gguf_get_str(f->g, "general.architecture", &arch, &len);
  if (rc) return tdm_set_error(rc, 0, "%s: no general.architecture", f->path);
  if (tdm_gguf_get_str(f->g, "general.name", &name, &len) == 0)
    snprintf(hp->name, sizeof hp->name, "%s", name);
  if (strcmp(arch, "qwen3moe") == 0) {
    hp->kind = ARCH_QWEN3MOE;
    hp->neox = hp->qk_norm = true;
  } else if (strcmp(arch, "llama") == 0) {
    hp->kind = ARCH_MIXTRAL;
    hp->neox = hp->qk_norm = false;
  } else {
    return tdm_set_error(TDM_ENOTSUP, 0, "%s: architecture %s is not one tandem runs (qwen3moe, "
                         "or llama with experts: Mixtral)", f->path, arch);
  }
  hp->renorm = true; /* both take softmax over the top-k (Qwen3-MoE's norm_topk_prob) */
  hp->rope_base = 10000.0;
  hp->rope_scale = 1.0;
  hp->eps = 1e-5;
  hp->ctx_train = 4096;
  hp->E = 0;
  if ((rc = g_int(f, arch, "block_count", &hp->L, false)) ||
      (rc = g_int(f, arch, "embedding_length", &hp->H, false)) ||
      (rc = g_int(f, arch, "attention.head_count", &hp->nh, false)) ||
      (rc = g_int(f, arch, "context_length", &hp->ctx_train, true)) ||
      (rc = g_int(f, arch, "expert_count", &hp->E, true)))
    return rc;
  if (hp->E == 0)
    return tdm_set_error(TDM_ENOTSUP, 0, "%s: a dense %s model (no %s.expert_count): tandem "
                         "runs Mixture-of-Experts models", f->path, arch, arch);
  hp->nkv = hp->nh;
  hp->hd = hp->H / hp->nh;
  if ((rc = g_int(f, arch, "attention.head_count_kv", &hp->nkv, true)) ||
      (rc = g_int(f, arch, "attention.key_length", &hp->hd, true)) ||
      (rc = g_int(f, arch, "expert_used_count", &hp->k, false)))
    return rc;
  hp->I = 0;
  if (hp->kind == ARCH_QWEN3MOE)
    rc = g_int(f, arch, "expert_feed_forward_length", &hp->I, false);
  else if ((rc = g_int(f, arch, "expert_feed_forward_length", &hp->I, true)) == 0 && !hp->I)
    rc = g_int(f, arch, "feed_forward_length", &hp->I, false);
  if (rc) return rc;
  double factor = 0.0;
  if ((rc = g_f64(f, arch, "rope.freq_base", &hp->rope_base)) ||
      (rc = g_f64(f, arch, "attention.layer_norm_rms_epsilon", &hp->eps)) ||
      (rc = g_f64(f, arch, "rope.scaling.factor", &factor)))
    return rc;
  const char *stype = NULL;
  char key[160];
  snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
  if (tdm_gguf_get_str(f->g, key, &stype, &len) == 0 && strcmp(stype, "none") != 0) {
    if (strcmp(stype, "linear") != 0)
      return tdm_set_error(TDM_ENOTSUP, 0, "%s: RoPE scaling %s (tandem has linear)", f->path,
                           stype);
    if (factor > 0) hp->rope_scale = 1.0 / factor;
  }
  /* the vocabulary: the embedding's rows */
  const tdm_mf_tensor *e = mfile_find(f, "token_embd.weight");
  if (!e || e->ndim != 2)
    return tdm_set_error(TDM_EINVAL, 0, "%s: tensor token_embd.weight is %s", f->path,
                         e ? "not 2-D" : "missing");
  hp->V = e->shape[0] > INT32_MAX ? 0 : (int)e->shape[0];
  hp->tied = mfile_find(f, "output.weight") == NULL;
  return 0;
}

/* A config.json integer / float; a missing optional one keeps *v. */
static int c_int(const mfile *f, const char *key, int *v, bool optional) {
  int64_t i;
  int rc = tdm_st_config_i64(f->s, key, &i);
  if (rc == TDM_ENOENT && optional) return 0;
  if (rc) return tdm_set_error(rc, 0, "%s/config.json: %s: %s", f->path, key, tdm_last_error());
  if (i < 1 || i > INT32_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%s/config.json: %s is %lld", f->path, key,
                         (long long)i);
  *v = (int)i;
  return 0;
}

static int c_f64(const mfile *f, const char *key, double *v) {
  int rc = tdm_st_config_f64(f->s, key, v);
  return rc == TDM_ENOENT ? 0 : rc;
}

static int read_st(const mfile *f, hparams *hp) {
  const char *arch = NULL, *type = NULL;
  int rc = tdm_st_architecture(f->s, &arch);
  if (rc) return tdm_set_error(rc, 0, "%s/config.json: no architectures", f->path);
  bool qwen = strcmp(arch, "Qwen3MoeForCausalLM") == 0;
  if (!qwen && strcmp(arch, "MixtralForCausalLM") != 0)
    return tdm_set_error(TDM_ENOTSUP, 0, "%s/config.json: architecture %s is not one tandem "
                         "runs (Qwen3MoeForCausalLM, MixtralForCausalLM)", f->path, arch);
  hp->kind = qwen ? ARCH_QWEN3MOE : ARCH_MIXTRAL;
  snprintf(hp->name, sizeof hp->name, "%s", arch);
  hp->neox = true; /* Hugging Face's rotate-half, unpermuted */
  hp->qk_norm = qwen;
  hp->renorm = true;
  hp->rope_base = 10000.0;
  hp->rope_scale = 1.0;
  hp->eps = 1e-6;
  hp->ctx_train = 4096;
  int tied = 0;
  if ((rc = c_int(f, "num_hidden_layers", &hp->L, false)) ||
      (rc = c_int(f, "hidden_size", &hp->H, false)) ||
      (rc = c_int(f, "num_attention_heads", &hp->nh, false)) ||
      (rc = c_int(f, "vocab_size", &hp->V, false)) ||
      (rc = c_int(f, "num_experts_per_tok", &hp->k, false)) ||
      (rc = c_int(f, "max_position_embeddings", &hp->ctx_train, true)) ||
      (rc = c_int(f, qwen ? "moe_intermediate_size" : "intermediate_size", &hp->I, false)))
    return rc;
  /* The experts' count: Qwen3-MoE's num_experts, Mixtral's num_local_experts; transformers 5
   * writes num_local_experts for both (num_experts is an alias of it there). */
  const char *ekey = qwen ? "num_experts" : "num_local_experts";
  if (tdm_st_config_i64(f->s, ekey, &(int64_t){0}) == TDM_ENOENT)
    ekey = qwen ? "num_local_experts" : "num_experts";
  if ((rc = c_int(f, ekey, &hp->E, false))) return rc;
  hp->nkv = hp->nh;
  hp->hd = hp->H / hp->nh;
  if ((rc = c_int(f, "num_key_value_heads", &hp->nkv, true)) ||
      (rc = c_int(f, "head_dim", &hp->hd, true)) ||
      (rc = c_f64(f, "rope_theta", &hp->rope_base)) ||
      (rc = c_f64(f, "rms_norm_eps", &hp->eps)))
    return rc;
  /* transformers 5 keeps RoPE's settings in rope_parameters (rope_theta, rope_type, factor),
   * where earlier versions had rope_theta and rope_scaling at the top. */
  bool v5_rope = tdm_st_config_f64(f->s, "rope_theta", &(double){0}) == TDM_ENOENT;
  if (v5_rope && (rc = c_f64(f, "rope_parameters.rope_theta", &hp->rope_base))) return rc;
  if (qwen) {
    int v = 1;
    if (tdm_st_config_bool(f->s, "norm_topk_prob", &v) == 0) hp->renorm = v != 0;
    int64_t step = 1;
    if (tdm_st_config_i64(f->s, "decoder_sparse_step", &step) == 0 && step != 1)
      return tdm_set_error(TDM_ENOTSUP, 0, "%s/config.json: decoder_sparse_step %lld (tandem "
                           "runs models whose every layer is MoE)", f->path, (long long)step);
  }
  if (tdm_st_config_bool(f->s, "tie_word_embeddings", &tied) == 0) hp->tied = tied != 0;
  const char *scaling = v5_rope ? "rope_parameters" : "rope_scaling";
  char key[64];
  snprintf(key, sizeof key, "%s.type", scaling);
  bool typed = tdm_st_config_str(f->s, key, &type) == 0;
  snprintf(key, sizeof key, "%s.rope_type", scaling);
  if (typed || tdm_st_config_str(f->s, key, &type) == 0) {
    double factor = 1.0;
    if (strcmp(type, "linear") != 0 && strcmp(type, "default") != 0)
      return tdm_set_error(TDM_ENOTSUP, 0, "%s/config.json: RoPE scaling %s (tandem has linear)",
                           f->path, type);
    snprintf(key, sizeof key, "%s.factor", scaling);
    if (strcmp(type, "linear") == 0 && c_f64(f, key, &factor) == 0 && factor > 0)
      hp->rope_scale = 1.0 / factor;
  }
  return 0;
}

int arch_read(const mfile *f, hparams *hp) {
  memset(hp, 0, sizeof *hp);
  int rc = f->g ? read_gguf(f, hp) : read_st(f, hp);
  if (rc) return rc;
  int64_t qd = (int64_t)hp->nh * hp->hd, wide = hp->H > hp->I ? hp->H : hp->I;
  if (hp->L < 1 || hp->H < 1 || hp->nh < 1 || hp->nkv < 1 || hp->nh % hp->nkv || hp->hd < 2 ||
      hp->hd % 2 || hp->V < 1 || hp->E < 1 || hp->k < 1 || hp->k > hp->E || hp->I < 1 ||
      hp->L > 4096 || hp->E > 65536 || qd > INT32_MAX / 8 || (int64_t)hp->V * hp->H > INT64_MAX / 8 ||
      (int64_t)3 * hp->H * wide > INT32_MAX || !(hp->rope_base > 0) || !(hp->eps > 0) ||
      !(hp->rope_scale > 0) || !isfinite(hp->rope_base))
    return tdm_set_error(TDM_EINVAL, 0, "%s: hyperparameters that are no model's: %d layers, "
                         "hidden %d, %d heads of %d (%d KV), vocabulary %d, %d experts of %d "
                         "(top %d), RoPE base %g, epsilon %g", f->path, hp->L, hp->H, hp->nh,
                         hp->hd, hp->nkv, hp->V, hp->E, hp->I, hp->k, hp->rope_base, hp->eps);
  return 0;
}
