/* tandem/model.h: whole Mixture-of-Experts language models from their files (libtandem_model):
 * a GGUF file, or a Hugging Face folder (config.json and safetensors shards), of Qwen3-MoE
 * (`qwen3moe`, Qwen3MoeForCausalLM) or Mixtral (`llama` with experts, MixtralForCausalLM).
 * Token embedding, attention with RoPE and a KV cache on the device, the MoE layers through the
 * expert streamer (tandem/moe.h: placement, cache policy and look-ahead as there), the final
 * norm and the LM head. Token ids in, logits out: no tokenizer (a file's is read past).
 *
 * Weights: the experts go to pinned host memory, one blob per expert, in the file's block
 * format (Q8_0, Q4_K, Q6_K, MXFP4) where the device's table computes it, else in bf16, and
 * reach the device through the streamer; everything else (embedding, attention, norms, LM
 * head) is kept on the device as the file holds it where the backend's operations read that
 * type: F16 or BF16 (CPU, CUDA), and for the projections and the LM head the block types too
 * (CPU); else widened to f32 (dense_f32 below widens them all); norms in f32. Files may hold
 * F32, F16 or BF16 tensors, and GGUF files Q8_0, Q4_K, Q6_K and MXFP4 ones too, widened as
 * ggml widens them: F16 and F32 experts, and block-typed ones where they are widened, are
 * rounded to bf16 (to nearest even), and so are the routers (the MoE operations take bf16
 * routers); the rest is exact. One sequence at a time: a model's calls must not overlap (two
 * models may run at once, on one device or several). */
#ifndef TANDEM_MODEL_API_H
#define TANDEM_MODEL_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../tandem.h"
#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_model tdm_model;

typedef struct tdm_model_config {
  const char *path;      /* a .gguf file, or a folder holding config.json and *.safetensors */
  tdm_device *device;
  int ctx;               /* KV cache positions (0: the model's context, at most 4096); more than
                            the model's own context is TDM_EINVAL */
  int ubatch;            /* the most tokens one device pass takes (0: 512); a longer prompt is
                            run in ubatches of this size */
  /* The MoE layers (tandem/moe.h's fields of the same names): */
  size_t budget_bytes;   /* resident experts on the device */
  bool all_resident;     /* every expert resident */
  tdm_cache_policy policy;
  bool predict;
  int predict_depth;
  int staging_slots;
  tdm_moe_placement placement;
  tdm_device *const *devices; /* expert parallelism: NULL, or ndevices devices, the first being
                            `device`, between which each layer's routed experts are split
                            (tandem/moe.h); attention and the dense weights stay on `device` */
  int ndevices;
  int threads;           /* for reading and converting the weights (0: all cores) */
  bool dense_f32;        /* widen 16-bit and block-typed dense weights to f32 on the device
                            (twice the memory and the bytes a decode step reads, or more; the
                            results of f32 math on the same values) */
  bool experts_bf16;     /* widen the routed experts to bf16 even where the device's table
                            computes them in the file's format (Q8_0, Q4_K, Q6_K, MXFP4; F16
                            experts are widened always): more bytes on the link, the results
                            of the widened values */
  /* Called as the weights load (what: "experts", "dense"; done in [0, 1], rising), so a tool
   * can show progress; NULL: nothing. The experts' reports come from the threads that convert
   * them, one call at a time; the others from the thread in tdm_model_open. */
  void (*progress)(void *user, const char *what, double done);
  void *progress_user;
} tdm_model_config;

/* What a model is, as its file says. Strings are valid while the model is open. */
typedef struct tdm_model_info {
  const char *arch;      /* "qwen3moe" or "mixtral" */
  const char *format;    /* "gguf" or "safetensors" */
  const char *name;      /* the file's own name for the model, or "" */
  int layers, hidden, heads, kv_heads, head_dim, vocab;
  int experts, topk, expert_ffn;
  int ctx_train;         /* the model's context */
  int ctx;               /* the KV cache's positions */
  int ubatch;
  double rope_base, rope_scale, norm_eps;
  bool rope_neox;        /* rotate-half pairs (else adjacent pairs) */
  bool qk_norm;          /* per-head RMSNorm of q and k (Qwen3) */
  bool tied_embeddings;  /* the LM head is the embedding */
  size_t expert_bytes;   /* one expert as it crosses the link: in expert_type (the largest
                            layer's where layers differ) */
  size_t host_bytes;     /* pinned host memory for the experts */
  size_t device_bytes;   /* device memory: dense weights, KV cache, buffers (not the expert slots) */
  const char *weight_type; /* the experts' type in the file: "F32", "F16", "BF16", "Q8_0", ... */
  const char *expert_type; /* the experts' format in host memory and on the link: "BF16"
                              (widened at load), or the file's, gate/up type first and the down
                              projections' after a "+" where they differ ("Q4_K+Q6_K"), the
                              first layer's ("+..." follows where other layers differ).
                              tdm_model_peek: what tdm_model_open would choose on the CPU,
                              valid until the thread's next peek */
  const char *dense_type;  /* the projections' type on the device: "F32", "F16", "BF16",
                              "Q8_0", "Q4_K", "Q6_K" or "MXFP4" (the first layer's query
                              projection's, "+..." after it where another projection or the LM
                              head has another; tdm_model_peek: the file's first query
                              projection's) */
} tdm_model_info;

/* Figures of one tdm_model_eval call, summed over its ubatches. */
typedef struct tdm_model_stats {
  int tokens, ubatches;
  double seconds;        /* wall time of the call */
  double pass_seconds;   /* of which from the first layer to the logits (host clock: the
                            layers' attention and MoE blocks and the LM head, submitted and
                            waited for); the rest is the ids' upload and the embedding */
  tdm_moe_pass_stats moe; /* the MoE passes' figures, summed (seconds fields too) */
  int graph_steps;       /* ubatches that ran as one recorded graph: decode steps (one token
                            and its logits) with every layer on the device (every expert
                            resident), where the backend records graphs (CUDA) and
                            TANDEM_MODEL_GRAPH is not 0; the same bits as op by op */
} tdm_model_stats;

/* Opens the file, checks it (every tensor the architecture needs, with the shapes its metadata
 * gives), loads the weights and sets up the device; reports progress through cfg->progress.
 * A bad file, a missing tensor, an unknown architecture or type, a context longer than the
 * model's, a model larger than host memory: TDM_EINVAL, TDM_ENOTSUP or TDM_ENOMEM with
 * tdm_last_error() naming the file, the tensor and the problem. */
TDM_API int tdm_model_open(const tdm_model_config *cfg, tdm_model **out);
TDM_API void tdm_model_close(tdm_model *m);
/* What a file holds, read from its metadata and tensor table alone (nothing is loaded): the
 * fields of tdm_model_info that do not depend on a device (ctx and ubatch: the defaults
 * tdm_model_open would take; device_bytes 0; name ""). Errors as tdm_model_open's. */
TDM_API int tdm_model_peek(const char *path, tdm_model_info *out);
TDM_API int tdm_model_info_get(const tdm_model *m, tdm_model_info *out);

/* Runs n tokens at the sequence's next positions (pos() .. pos() + n - 1), in ubatches,
 * appending their keys and values to the cache. logits: host f32; NULL for none; else
 * [n x vocab] when all_logits, or [vocab] for the last token only. An id outside [0, vocab),
 * or n past the cache's room (pos() + n > ctx): TDM_EINVAL before anything runs. A failure
 * partway leaves the position where the last complete ubatch left it. */
TDM_API int tdm_model_eval(tdm_model *m, const int32_t *tokens, int n, float *logits,
                           bool all_logits, tdm_model_stats *st);

/* One decode step: token at the next position, as tdm_model_eval(m, &token, 1, ...) with its
 * logits, which *logits points at in the model's own host memory (pinned: where the device
 * wrote them) instead of a copy: vocab floats, valid until the next eval, step, rewind or
 * close. On failure *logits is NULL. The step a decode loop takes, without copying the
 * vocabulary's logits once more each token. */
TDM_API int tdm_model_step(tdm_model *m, int32_t token, const float **logits,
                           tdm_model_stats *st);

/* The sequence's length so far, and a rewind to position pos (0: a new sequence; the cache
 * past pos is forgotten). pos beyond the current position: TDM_EINVAL. */
TDM_API int tdm_model_pos(const tdm_model *m);
TDM_API int tdm_model_rewind(tdm_model *m, int pos);

/* skip true: later evals leave out the MoE blocks (the residual passes them unchanged), so a
 * benchmark can time everything else (attention, the dense projections, the embedding and
 * the LM head) on its own; the logits are then not the model's. false restores them. */
TDM_API int tdm_model_skip_moe(tdm_model *m, bool skip);

/* The MoE layers underneath (their streamer, placement and statistics). */
TDM_API tdm_moe_model *tdm_model_moe(tdm_model *m);

/* The index of the largest of n logits (the lower index on ties): greedy decoding. */
TDM_API int tdm_model_argmax(const float *logits, int n);

#ifdef __cplusplus
}
#endif

#endif
