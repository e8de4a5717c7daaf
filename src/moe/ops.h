/* ops.h: the few compute operations the MoE forward pass needs, one table per backend. Each
 * operation is submitted to a tandem queue in stream order (never blocking the caller) and
 * takes tandem pointers (device memory of the queue's device, unless said otherwise).
 *
 * Data: activations are f32 [T x H] row-major; expert weights are bf16 (uint16_t holding the
 * top half of an f32) laid out per expert as [Wg (I x H) | Wu (I x H) | Wd (H x I)], each
 * row-major, so gate = x Wg^T, up = x Wu^T, out = (silu(gate) * up) Wd^T. Router weights are
 * bf16 [E x H]. Reductions are deterministic: no atomics; every sum has a fixed order, so a
 * run is bitwise repeatable on one backend.
 *
 * Every entry returns 0 or a negative TDM_E* code (and sets tdm_last_error() through the
 * public API it calls). Scratch memory an op needs comes from moe_ops_workspace(). */
#ifndef TANDEM_MOE_OPS_H
#define TANDEM_MOE_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "tandem.h"

typedef uint16_t moe_bf16;

/* bf16 <-> f32 on the host (round to nearest even; NaN stays NaN). */
static inline float moe_bf16_to_f32(moe_bf16 h) {
  union { uint32_t u; float f; } v = {(uint32_t)h << 16};
  return v.f;
}
static inline moe_bf16 moe_f32_to_bf16(float f) {
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu)) return (moe_bf16)((v.u >> 16) | 0x40);
  return (moe_bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

typedef struct moe_ops moe_ops;

struct moe_ops {
  const char *name; /* "cpu", "cuda", "opencl" */

  /* Per-queue state (BLAS handles bound to the queue's native stream, ...). */
  int (*open)(tdm_queue *q, void **state);
  void (*close)(void *state);

  /* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for t < T. w: f32 [H]. */
  int (*rmsnorm)(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T, int H,
                 float eps);

  /* Router: logits = x Wr^T + bias (f32 [T x E]; bias f32 [E], device memory, or NULL for
   * none); p = softmax(logits); the k largest p per token (ties: the lower expert index
   * first), in descending order, into idx [T x k] (int32) and weights [T x k] (f32) = p / sum
   * of the k chosen p when renorm, else p. */
  int (*router)(void *st, tdm_queue *q, const float *x, const moe_bf16 *wr, const float *bias,
                int T, int H, int E, int k, int renorm, int32_t *idx, float *weights);

  /* One expert on n gathered tokens: rows[i] (int32, device memory) are token indices into x
   * [T x H]; w the expert's weights (device memory, bf16, layout above); writes
   * out[slot[i]] = SwiGLU expert output (f32 [H]) for each i, where slot[i] (int32, device) is
   * the token's position in the [T*k x H] result buffer. Intermediates live in the workspace
   * (at least n x (2I + H) f32 plus n x H bf16). */
  int (*expert)(void *st, tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slot,
                int n, const moe_bf16 *w, int H, int I, float *out, void *workspace,
                size_t workspace_bytes);

  /* Deterministic combine: y[t] += sum_{j<k} weights[t*k+j] * out[t*k+j], j ascending. */
  int (*combine)(void *st, tdm_queue *q, float *y, const float *out, const float *weights, int T,
                 int H, int k);
};

/* The table for the device's backend, or NULL if none is built. Exported from libtandem for
 * the white-box tests, though not part of the public API. */
TDM_API const moe_ops *moe_ops_for(tdm_device *dev);

/* Workspace bytes expert() needs for up to n tokens. */
TDM_API size_t moe_ops_workspace(int n, int H, int I);

#endif
