/* moe.h: a stack of Mixture-of-Experts layers, x += MoE(RMSNorm(x)), whose routed experts live
 * in pinned host memory and reach the device through the expert streamer. Used by
 * `tandem moe` and the MoE tests. */
#ifndef TANDEM_MOE_H
#define TANDEM_MOE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe/ops.h"
#include "tandem.h"
#include "tandem/streamer.h"

typedef struct moe_preset {
  const char *name;
  int hidden, experts, topk, ffn, layers;
  int shared, shared_ffn; /* always-active experts per layer, and their FFN width */
  bool renorm;            /* top-k weights renormalized to sum to 1 */
  const char *note;
} moe_preset;

extern const moe_preset moe_presets[];
extern const int moe_npresets;
const moe_preset *moe_preset_find(const char *name);

typedef struct moe_config {
  const moe_preset *preset;
  int layers;              /* 0: the preset's */
  tdm_device *device;
  uint64_t seed;
  double skew;             /* Zipf exponent of expert popularity */
  double locality;         /* correlation of successive decode tokens, in [0, 1) */
  int max_tokens;          /* the largest ubatch forward() will be given */
  size_t budget_bytes;     /* resident experts on the device (all: everything resident) */
  bool all_resident;       /* every expert resident: the reference run */
  int staging_slots;
  tdm_cache_policy policy;
  int threads;             /* for filling the weights (0: all cores) */
} moe_config;

typedef struct moe_model moe_model;

/* Generates the weights (bf16, seeded, in parallel) in pinned host memory and sets up the
 * device side. Host memory too small, a budget that cannot hold an expert...: an error with
 * the reason in tdm_last_error(). */
int moe_model_create(const moe_config *cfg, moe_model **out);
void moe_model_destroy(moe_model *m);

size_t moe_expert_bytes(const moe_preset *p);
size_t moe_host_bytes(const moe_preset *p, int layers);

/* The synthetic input of n tokens starting at `pos`: prefill tokens are independent; decode
 * tokens follow each other with the configured locality. Host f32 [n x H]. */
void moe_make_input(const moe_model *m, float *x, int n, uint64_t pos, bool decode);

typedef struct moe_pass_stats {
  double seconds;           /* wall time of the pass, host clock */
  uint64_t bytes_copied, acquires, hits, misses;
  int experts_computed;     /* expert GEMM groups run (routed, non-empty) */
} moe_pass_stats;

/* Runs every layer on a ubatch of T tokens: x (host f32 [T x H]) in, y out. overlap false makes
 * copies and compute alternate (one staging slot is used, no copy runs ahead). */
int moe_forward(moe_model *m, const float *x, float *y, int T, bool overlap, moe_pass_stats *st);

tdm_streamer *moe_streamer(moe_model *m);

#endif
