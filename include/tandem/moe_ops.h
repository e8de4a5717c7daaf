/* tandem/moe_ops.h: the compute operations of tandem's MoE library (libtandem_moe), one table
 * per backend: RMSNorm, the router's softmax top-k, one SwiGLU expert on gathered tokens, a
 * group of experts in one submission (with the routing grouped on the device), and the
 * weighted combine. The forward pass of tandem/moe.h is made of them; a program that runs
 * its own MoE layers on tandem queues can call them too (the benchmarks and tests do).
 *
 * Each operation is submitted to a tandem queue in stream order (never blocking the caller)
 * and takes tandem pointers (device memory of the queue's device, unless said otherwise).
 *
 * Data: activations are f32 [T x H] row-major; expert weights are bf16 (uint16_t holding the
 * top half of an f32) laid out per expert as [Wg (I x H) | Wu (I x H) | Wd (H x I)], each
 * row-major, so gate = x Wg^T, up = x Wu^T, out = (silu(gate) * up) Wd^T; expert_q() and
 * experts_q() take them in the same layout in other formats too (F16, GGUF's blocks: see
 * tdm_moe_wfmt). Router weights are bf16 [E x H]. Reductions are deterministic: no atomics; every sum has a fixed order, so a
 * run is bitwise repeatable on one backend.
 *
 * Every entry returns 0 or a negative TDM_E* code, with tdm_last_error() set. Scratch memory
 * an op needs comes from tdm_moe_ops_workspace(). */
#ifndef TANDEM_MOE_OPS_H
#define TANDEM_MOE_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "../tandem.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t tdm_moe_bf16;

/* bf16 <-> f32 on the host (round to nearest even; NaN stays NaN). */
static inline float tdm_moe_bf16_to_f32(tdm_moe_bf16 h) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)h << 16;
  return v.f;
}
static inline tdm_moe_bf16 tdm_moe_f32_to_bf16(float f) {
  union { float f; uint32_t u; } v;
  v.f = f;
  if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu))
    return (tdm_moe_bf16)((v.u >> 16) | 0x40);
  return (tdm_moe_bf16)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 to f32 on the host, exactly (subnormals, infinities and NaN included). */
static inline float tdm_moe_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  union { uint32_t u; float f; } v;
  if (exp == 0x1f) {
    v.u = sign | 0x7f800000u | (man << 13); /* inf, NaN */
  } else if (exp) {
    v.u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) { /* subnormal: man x 2^-24, exact in f32 */
    v.f = (float)man * 5.9604644775390625e-8f; /* 2^-24 */
    v.u |= sign;
  } else {
    v.u = sign;
  }
  return v.f;
}

/* Weight types. F16 and BF16 are 16-bit values. The others are GGUF's block-quantized types
 * as ggml defines them (llama.cpp's Q8_0 and Q4_K_M files, gpt-oss's experts); a row of n
 * values is n / block blocks, so n must be a multiple of the type's block:
 *   TDM_MOE_W_Q8_0   32 values in 34 bytes: an f16 scale d, 32 int8 q; value d q
 *   TDM_MOE_W_Q4_K   256 values in 144 bytes: f16 d and dmin, eight 6-bit scales and mins
 *                    packed in 12 bytes, 4-bit q; value d sc q - dmin m
 *   TDM_MOE_W_Q6_K   256 values in 210 bytes: 6-bit q in 4 + 2 bits, sixteen int8 scales, an
 *                    f16 d; value d sc (q - 32)
 *   TDM_MOE_W_MXFP4  32 values in 17 bytes: an E8M0 exponent e, 32 E2M1 values in nibbles;
 *                    value 2^(e - 127) x the E2M1 value
 *   TDM_MOE_W_Q5_K   256 values in 176 bytes: Q4_K's d, dmin and packed scales and mins, then
 *                    32 bytes of fifth bits and 128 of 4-bit q; value d sc q - dmin m. A
 *                    projection's type only (matmul_q, tdm_moe_dequant_row): no expert
 *                    format takes it (tdm_moe_expert_size is 0), since llama.cpp puts it in
 *                    dense tensors (a Mixtral Q4_K_M file's attention output) */
enum {
  TDM_MOE_W_F16 = 1,
  TDM_MOE_W_BF16 = 2,
  TDM_MOE_W_Q8_0 = 3,
  TDM_MOE_W_Q4_K = 4,
  TDM_MOE_W_Q6_K = 5,
  TDM_MOE_W_MXFP4 = 6,
  TDM_MOE_W_Q5_K = 7
};

/* An expert's weight format: the type of its gate and up rows (of H values each) and the type
 * of its down rows (of I values each); llama.cpp's Q4_K_M files mix Q4_K and Q6_K. An expert
 * in format f is [Wg (I rows) | Wu (I rows) | Wd (H rows)], each row tdm_moe_row_bytes(type,
 * values) bytes, back to back: the bf16 layout above when both are BF16. */
typedef struct tdm_moe_wfmt {
  int gu, d;
} tdm_moe_wfmt;

/* The bytes of a row of n values of type wtype: 0 for an unknown type, n <= 0, or n not a
 * multiple of the type's block. */
TDM_API size_t tdm_moe_row_bytes(int wtype, int64_t n);

/* The bytes of one expert of format f (the layout above): 0 when a row's size is 0, a type is
 * not an expert's (TDM_MOE_W_Q5_K), or the total does not fit in size_t. */
TDM_API size_t tdm_moe_expert_size(tdm_moe_wfmt f, int H, int I);

/* A row of n values of type wtype at src (tdm_moe_row_bytes(wtype, n) bytes, any alignment)
 * widened to f32 into dst, exactly: every value is the one ggml's dequantize_row_* computes
 * (the same f32 operations in the same order). 0, or TDM_EINVAL (with tdm_last_error() set)
 * when tdm_moe_row_bytes(wtype, n) is 0 or a pointer is NULL. */
TDM_API int tdm_moe_dequant_row(int wtype, const void *src, float *dst, int64_t n);

/* One entry of a group of experts (experts() below), in device memory. */
typedef struct tdm_moe_group {
  int64_t w;     /* the expert's weights: wbase + w, in bf16 elements (a multiple of 8 lets
                    GPUs load them 16 bytes at a time) */
  int32_t first; /* its tokens: rows[first + i] and slot[first + i] for i < count */
  int32_t count; /* 0: nothing to compute (the entry is skipped; w and first are not read) */
} tdm_moe_group;

typedef struct tdm_moe_ops {
  const char *name; /* "cpu", "cuda", "opencl" */

  /* Per-queue state (BLAS handles bound to the queue's native stream, ...), for one in-order
   * queue of the table's device; every op is given that queue. close() waits for the queue's
   * work: call it before destroying the queue, never from a host task on it. */
  int (*open)(tdm_queue *q, void **state);
  void (*close)(void *state);

  /* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for t < T. w: f32 [H]. */
  int (*rmsnorm)(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T, int H,
                 float eps);

  /* Router: logits = x Wr^T + bias (f32 [T x E]; bias f32 [E], device memory, or NULL for
   * none); p = softmax(logits); the k largest p per token (ties: the lower expert index
   * first), in descending order, into idx [T x k] (int32) and weights [T x k] (f32) = p / sum
   * of the k chosen p when renorm, else p. */
  int (*router)(void *st, tdm_queue *q, const float *x, const tdm_moe_bf16 *wr, const float *bias,
                int T, int H, int E, int k, int renorm, int32_t *idx, float *weights);

  /* One expert on n gathered tokens: rows[i] (int32, device memory) are token indices into x
   * [T x H]; w the expert's weights (device memory, bf16, layout above); writes
   * out[slot[i]] = SwiGLU expert output (f32 [H]) for each i, where slot[i] (int32, device) is
   * the token's position in the [T*k x H] result buffer. Intermediates live in the workspace
   * (tdm_moe_ops_workspace(n, H, I) bytes at least). */
  int (*expert)(void *st, tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slot,
                int n, const tdm_moe_bf16 *w, int H, int I, float *out, void *workspace,
                size_t workspace_bytes);

  /* A group of experts in one submission, so that the host's cost per layer does not grow
   * with the number of routed experts: for each of the G entries of groups (device memory),
   * the expert whose weights start at wbase + groups[g].w (the layout above) on the tokens
   * rows[first + i], writing out[slot[first + i]] for i < count, as expert() does. rows and
   * slot have n entries (device memory); entries must not name the same slot twice.
   * - Every expert's weights lie in the tandem allocation that holds wbase (the streamer's
   *   slots are one allocation), so one table serves resident and streamed experts alike.
   *   A wbase that lies in no tandem allocation (a small aligned address such as 16) makes
   *   the offsets addresses, unchecked: an entry may then name any memory the device reads,
   *   the caller vouching for it. CUDA reads pinned host memory so, in place, across the
   *   link (decode with host-placed experts and no copy); the CPU reads host memory; OpenCL
   *   names memory by buffer and takes no such table.
   * - An expert's output depends only on its weights and its own tokens, never on the other
   *   entries or G: splitting a layer's experts into groups differently (as they land, say)
   *   gives the same bits.
   * - The table and the token lists are device data, written by earlier commands (group()
   *   below, or a copy), checked when they run. An entry whose range leaves [0, n) (first <
   *   0, count < 0 or first + count > n) or whose weights [wbase + w, wbase + w + 3HI) leave
   *   wbase's allocation is bad, and so is a token whose row lies outside x's allocation or
   *   whose slot lies outside out's (rows and slots are counted from x and out to the end
   *   of their allocations, as expert() does). On a GPU a bad entry is skipped whole and a
   *   bad token alone (its slot is not written; the entry's other tokens are computed). The
   *   CPU table, which runs on the host, fails the command with TDM_ERANGE instead, before
   *   writing anything (reported by the queue's next sync), as its expert() does.
   * - G == 0 or n == 0: nothing to do (0, and the table is not read).
   * - Made for few tokens per expert (decode, small batches): the kernels read each expert's
   *   weights once per few tokens, at the memory's bandwidth; for many tokens per expert
   *   expert() (a GEMM per expert) is faster, unless the table runs that many rows as GEMMs
   *   itself (experts_gemm_rows below). Backends may compute in more precision than
   *   expert(): the two agree within the tolerance of the fp64 reference, not bitwise.
   * Workspace: tdm_moe_ops_workspace(n, H, I) bytes at least. */
  int (*experts)(void *st, tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slot,
                 int n, const tdm_moe_bf16 *wbase, const tdm_moe_group *groups, int G, int H,
                 int I, float *out, void *workspace, size_t workspace_bytes);

  /* The routing grouped on the device, so that it never comes back to the host: from idx
   * [T x k] (router()'s output) and wofs [E] (each expert's weights, as experts() takes
   * them), writes rows and slot [T*k], expert by expert in ascending expert order with each
   * expert's tokens ascending (token t's j-th choice has slot t*k + j), and groups
   * [min(E, T*k)]: one entry per routed expert (an expert with at least one token), in
   * ascending expert order, then entries of count 0. All device memory. An expert's entries
   * are in ascending t*k + j, so a token that names one expert twice has both, j ascending.
   * An index outside [0, E) is dropped: it is in neither rows nor slot, so experts() on this
   * output never writes its slot. What rows and slot hold past the routed entries, and the w
   * and first of the count-0 entries, is unspecified. T * k must fit in int32 (slots are
   * int32); T == 0: nothing to do. */
  int (*group)(void *st, tdm_queue *q, const int32_t *idx, int T, int k, int E,
               const int64_t *wofs, int32_t *rows, int32_t *slot, tdm_moe_group *groups);

  /* Deterministic combine: y[t] += sum_{j<k} weights[t*k+j] * out[t*k+j], j ascending. */
  int (*combine)(void *st, tdm_queue *q, float *y, const float *out, const float *weights, int T,
                 int H, int k);

  /* Optional (NULL where a backend has none; the CUDA table has them): the ops called on the
   * state between graph_begin() and graph_end() are recorded, not run, into a graph that
   * graph_launch() then runs on the queue, in stream order, as one submission, as often as
   * wanted, with the same arguments (pointers included: a graph reads and writes the buffers
   * it was recorded with, their contents as they are when it runs). Recording uses a stream of
   * the state's own, so the queue and everything tandem does on it go on as usual meanwhile
   * (copies, syncs, from any thread); the state's ops are recorded, not run, until
   * graph_end(), and are called from one thread at a time as always. An op that fails while
   * recording fails the recording: graph_end() then returns that error and no graph (the
   * caller drops the recording with graph_end() either way). Misuse (begin twice, end without
   * begin) is TDM_ESTATE. A graph belongs to its state: graph_free() it before close(). */
  int (*graph_begin)(void *st, tdm_queue *q);
  int (*graph_end)(void *st, tdm_queue *q, void **graph);
  int (*graph_launch)(void *st, tdm_queue *q, void *graph);
  void (*graph_free)(void *st, void *graph);

  /* Optional (NULL: the caller copies with tdm_memcpy; the CUDA table has it): n bytes from
   * src, host memory the device reads in place (tandem's pinned memory), to dst (device
   * memory), in stream order, by the device's cores rather than its copy engines. A copy
   * engine's transfer of a few bytes waits behind the large copies other queues have on the
   * link (a decode layer's token lists, tables and host rows, behind expert copies of
   * megabytes: 140-275 us a layer on an H200); the cores' reads do not. For small copies: the
   * cores read over the link at a fraction of a copy engine's rate. Memory the device cannot
   * read in place is copied as tdm_memcpy would. n == 0: nothing. */
  int (*upload)(void *st, tdm_queue *q, void *dst, const void *src, size_t n);

  /* ---- A transformer's other operations, for tandem/model.h: token embedding, projections,
   * RoPE and causal attention over a KV cache. Optional: NULL where a backend has none yet (a
   * model is then TDM_ENOTSUP on its devices). All f32, in stream order, deterministic. ---- */

  /* y[t] = table[ids[t]] (rows of H) for t < T; ids int32 [T], table f32 [V x H]. An id
   * outside [0, V) gives a row of zeros (the caller checks ids before they reach the device). */
  int (*get_rows)(void *st, tdm_queue *q, float *y, const float *table, const int32_t *ids,
                  int T, int H, int V);

  /* y = x w^T + beta y: x f32 [T x K], w f32 [N x K] (a row per output), y f32 [T x N]; beta
   * 0 (y is not read) or 1 (accumulate: a residual). The field's BLAS where a backend has one
   * (OpenBLAS, cuBLAS, CLBlast). */
  int (*matmul)(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T, int K,
                int N, float beta);

  /* RoPE in place on x [T x nh x hd], row t at position pos0 + t: each pair of a head's values
   * (a, b) becomes (a cos - b sin, a sin + b cos) with angle p * freq_scale * base^(-2i/hd) for
   * pair i < hd/2; neox pairs (i, i + hd/2) (rotate-half: Qwen3, Hugging Face's layouts), else
   * adjacent (2i, 2i + 1) (GGUF's llama, whose q and k rows are permuted to match). hd even. */
  int (*rope)(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0, float base,
              float freq_scale, int neox);

  /* Causal attention of T queries at positions pos0 .. pos0 + T - 1: qv [T x nh x hd]; kc and
   * vc the KV cache [ctx x nkv x hd], holding positions 0 .. pos0 + T - 1 (the caller writes
   * this ubatch's keys and values first); query head h reads KV head h / (nh / nkv) (nh a
   * multiple of nkv). out [T x nh x hd] = softmax(q k^T scale) v over the positions up to its
   * own. out must not overlap qv, kc or vc. Sums are f32; CUDA runs 16 queries or more (heads
   * of 64 or 128, buffers 16-byte aligned) on TF32 tensor cores with every operand split in two
   * exact parts, which keeps f32's precision within a few roundings. */
  int (*attention)(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                   const float *vc, int T, int pos0, int nh, int nkv, int hd, float scale);

  /* ---- Weights in 16 bits, as model files keep them, so that a model's dense weights take
   * half the device memory and a decode step reads half the bytes. Optional: NULL where a
   * backend has none (OpenCL for now); a model then widens its weights to f32 when it loads
   * them. wtype is TDM_MOE_W_F16 (IEEE binary16) or TDM_MOE_W_BF16; every such value is exact
   * in f32, and these compute as get_rows() and matmul() on the widened values. ---- */

  /* get_rows() from a 16-bit table [V x H]: y's rows are the table's, widened (bitwise). */
  int (*get_rows_h)(void *st, tdm_queue *q, float *y, const uint16_t *table, int wtype,
                    const int32_t *ids, int T, int H, int V);

  /* matmul() with w [N x K] in 16 bits. A few tokens (decode) run in one pass that reads each
   * weight once and sums each output in a fixed order; more tokens widen w a piece at a time
   * into the workspace (device memory: workspace_bytes, at least 4K; the larger, the fewer
   * pieces) and multiply each piece as matmul() does. Both agree with matmul() on the widened
   * w within f32 rounding. CUDA multiplies the pieces on TF32 tensor cores where the workspace
   * also holds 2 T K floats: x goes in two parts that TF32 holds exactly (22 of f32's 24
   * bits), so the result stays within a few f32 roundings (TANDEM_MOE_CUDA_TF32=0, read at
   * open(), keeps SGEMMs). */
  int (*matmul_h)(void *st, tdm_queue *q, float *y, const float *x, const uint16_t *w,
                  int wtype, int T, int K, int N, float beta, void *workspace,
                  size_t workspace_bytes);

  /* ---- Experts in the weight format their file keeps (tdm_moe_wfmt below), so that a
   * quantized expert crosses the link in its blocks and is widened inside the kernels, never
   * before the copy. Optional: NULL where a backend has none (a model then widens its experts
   * to bf16 when it loads them). Each is expert() or experts() with:
   * - w (wbase) pointing at experts in format fmt (the layout of tdm_moe_wfmt), and groups' w
   *   counting 2-byte units from wbase as before: an expert starts at an even byte;
   * - fmt {BF16, BF16} computing what expert() and experts() compute, bitwise;
   * - the quantized types computing on the values tdm_moe_dequant_row() gives, within f32
   *   rounding (a backend's kernels may fuse the widening's multiply and add), except that a
   *   few-token kernel may round the activations to 16-bit integers in blocks of 32 (each
   *   block's largest value 32767) and dot them with the blocks in integers, as CUDA's
   *   experts_q() does for Q4_K, Q6_K and Q8_0 rows and the CPU's for one or two tokens: a
   *   result is then within about 1e-4 (relative) of the f32 one, and still bitwise
   *   repeatable;
   * - a format the backend lacks, or one whose rows are not whole blocks (H a multiple of
   *   fmt.gu's block, I of fmt.d's), TDM_EINVAL at the call.
   * Workspace: tdm_moe_ops_workspace(n, H, I) bytes, as before. ---- */
  int (*expert_q)(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                  const int32_t *slot, int n, const void *w, tdm_moe_wfmt fmt, int H, int I,
                  float *out, void *workspace, size_t workspace_bytes);
  int (*experts_q)(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                   const int32_t *slot, int n, const void *wbase, tdm_moe_wfmt fmt,
                   const tdm_moe_group *groups, int G, int H, int I, float *out,
                   void *workspace, size_t workspace_bytes);

  /* matmul_h() with w [N x K] in a block type (TDM_MOE_W_Q8_0, _Q4_K, _Q6_K, _MXFP4 or
   * _Q5_K: each row tdm_moe_row_bytes(wtype, K) bytes, back to back, K whole blocks), so that
   * a file's quantized projections and LM head are read in their blocks: computing on the
   * values tdm_moe_dequant_row() gives, within f32 rounding (the CPU's, on one or two tokens
   * of a type but Q5_K, on 16-bit activations as experts_q() may: within about 1e-4). A few
   * tokens (up to 8) read each row once; more widen pieces of w into the workspace (at least
   * K floats), as matmul_h() does (CUDA: on TF32 tensor cores, w's widened values split in two
   * parts as well as x's). Optional: NULL where a backend has none (the CPU, CUDA and OpenCL
   * tables have it), and a model widens such weights to f32 when it loads them. Another type,
   * or K not whole blocks: TDM_EINVAL. */
  int (*matmul_q)(void *st, tdm_queue *q, float *y, const float *x, const void *w, int wtype,
                  int T, int K, int N, float beta, void *workspace, size_t workspace_bytes);

  /* ---- A decode step's attention with its position on the device, so that one recorded
   * graph (graph_begin) serves every step: the position is read from *pos (device int32) when
   * the op runs, not when it is called, clamped to [0, ctx - T] (1 <= T <= ctx) so that no
   * value there makes an op read or write past the caches; the caller keeps it in range.
   * Optional: NULL where a backend has none (a model then runs its steps op by op). ---- */

  /* The T tokens' q, k and v after their projections (qv [T x nh x hd], k and v
   * [T x nkv x hd]), made ready for attention() in one op: each head of qv and of k
   * RMS-normalized with qn and kn (hd weights each; NULL: no norm), as rmsnorm() does a row,
   * then rotated as rope() does at positions *pos .. *pos + T - 1; qv in place, and k's rows
   * and v's into the caches' rows *pos .. (kc and vc [ctx x nkv x hd]); k itself unchanged.
   * The same bits as those ops one after the other at that position. */
  int (*attn_prep_at)(void *st, tdm_queue *q, float *qv, const float *k, const float *v,
                      float *kc, float *vc, const float *qn, const float *kn, int T, int nh,
                      int nkv, int hd, float eps, const int32_t *pos, int ctx, float base,
                      float freq_scale, int neox);
  /* attention() at position *pos: the same bits as attention() with pos0 = *pos. */
  int (*attention_at)(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                      const float *vc, int T, const int32_t *pos, int ctx, int nh, int nkv,
                      int hd, float scale);

  /* Rows in all (n) from which experts() and experts_q() run the table as GEMMs in a few
   * launches (CUDA: two, on tensor cores, the activations and h rounded to bf16 as expert()
   * rounds them); 0 where they stay made for few tokens. From there a model may group a large
   * ubatch's experts as it groups decode's (tandem/moe.h's does; TANDEM_MOE_PREFILL_GROUPED=0
   * turns that off). The choice depends
   * on n alone, so an expert's output still depends on its weights, its own tokens and n,
   * never on the other entries or G. */
  int experts_gemm_rows;

  /* Optional (NULL where a backend has none; every table has it): calls fn(arg)
   * on a host thread in q's stream order: once the work submitted to q before it has
   * completed, with the work submitted after it waiting until it returns. On CUDA it is a host
   * function of the stream (cudaLaunchHostFunc), so a stream being captured into a CUDA graph
   * (graph_begin()'s recording, or a capture of q's stream by other code) records it, and each
   * launch of that graph calls it again; fn must then not call CUDA. On the CPU and OpenCL it
   * is a host task of q. fn cannot fail the queue: it reports through arg (tdm_moe_host_pass
   * does). */
  int (*host_call)(void *st, tdm_queue *q, void (*fn)(void *arg), void *arg);
} tdm_moe_ops;

/* A layer's host-placed experts, as one call of a device queue's host_call(): fn
 * tdm_moe_host_pass_run, arg the pass. The device computes the experts it holds or reads in
 * place while the host computes the others from host memory, both in the device's stream
 * order, and on CUDA inside a graph. A run groups idx [T x k] with wofs [E] on the host
 * table's queue (group(): an index outside [0, E), such as the -1 a device writes for the
 * experts it computes itself, is not the host's, and its slot of out is left as it was), runs
 * experts() on x [T x H] from wbase into out [T*k x H], and waits for that queue. Every buffer
 * is host memory: pinned where the device copies x and idx in before the call and out back
 * after it; rows and slot hold T*k entries, groups min(E, T*k), workspace
 * tdm_moe_ops_workspace(T*k, H, I) bytes at least. The pass is read, never changed, by a run
 * but for its last three fields; it must outlive every call that names it (the graphs that
 * hold one included). */
typedef struct tdm_moe_host_pass {
  const tdm_moe_ops *ops; /* the host's table (a CPU device's), opened as st on q */
  void *st;
  tdm_queue *q;
  const float *x;
  const int32_t *idx;
  int T, k, E, H, I;
  const int64_t *wofs;
  const tdm_moe_bf16 *wbase;
  int32_t *rows, *slot;
  tdm_moe_group *groups;
  float *out;
  void *workspace;
  size_t workspace_bytes;
  /* Written by each run, read once the device's queue has completed it: the runs so far, and
   * the first failure (0: none; else a negative TDM_E* code, its message in failure). A run
   * that fails leaves out's host slots as they are, or part written. */
  long runs;
  int status;
  char failure[256];
} tdm_moe_host_pass;

/* Runs the tdm_moe_host_pass that pass points at (the signature host_call() takes). A table
 * other than a CPU device's fails the run with TDM_EINVAL: a device's would wait for itself.
 * A routing with no index in [0, E) returns at once, touching nothing. */
TDM_API void tdm_moe_host_pass_run(void *pass);

/* The table for the device's backend, or NULL (with tdm_last_error() set) when this build of
 * the library has none for it. Static storage. */
TDM_API const tdm_moe_ops *tdm_moe_ops_for(tdm_device *dev);

/* Workspace bytes expert() needs for up to n tokens, and experts() for n rows in all (the
 * same on every backend); 0 when an argument is not positive or the size does not fit in
 * size_t. */
TDM_API size_t tdm_moe_ops_workspace(int n, int H, int I);

#ifdef __cplusplus
}
#endif

#endif
