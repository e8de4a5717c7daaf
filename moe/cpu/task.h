/* cpu/task.h: how the CPU operations submit (cpu/task.c): each op is a host task on the
 * queue's worker thread, its arguments copied into a heap block headed by a `task`, freed by a
 * keep-alive on the same queue (see task.c for why). Shared by the MoE operations (cpu/ops.c)
 * and the transformer's (cpu/xfmr.c). */
#ifndef TANDEM_MOE_CPU_TASK_H
#define TANDEM_MOE_CPU_TASK_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/moe_ops.h"

/* open() binds the state to one in-order queue; every op checks it is given that queue. */
typedef struct cpu_state {
  tdm_queue *q;
} cpu_state;

/* ---- Submission -------------------------------------------------------------------------- */

/* The head of every op's argument block. refs: one for the task, one for the submitter's
 * keep-alive (see task_submit). */
typedef struct task {
  int (*body)(const struct task *t);
  atomic_int refs;
} task;

/* Queues t (allocated by tdm_moe__task_alloc, body set) on q; frees it on failure. */
int tdm_moe__task_submit(tdm_queue *q, task *t);
/* host_call()'s body for the tables whose host calls are host tasks (the CPU's, OpenCL's):
 * fn(arg) as a host task of q, its block freed as an op's. */
int tdm_moe__host_call_task(tdm_queue *q, void (*fn)(void *), void *arg);
/* 0 when st was opened on q, else TDM_EINVAL naming op. */
int tdm_moe__check_state(void *st, tdm_queue *q, const char *op);
/* TDM_EINVAL: "moe <op>: NULL pointer or size out of range". */
int tdm_moe__bad_args(const char *op);
/* `size` bytes of host memory, or NULL with the error set (tandem's fault hook sees it). */
void *tdm_moe__host_alloc(size_t size);
void *tdm_moe__task_alloc(size_t size, const char *op);
/* Rows of `width` floats between p and the end of its tandem allocation (SIZE_MAX: unknown). */
size_t tdm_moe__rows_available(const float *p, int width);

/* The transformer's operations (cpu/xfmr.c), entries of tdm_moe__cpu_ops. */
int tdm_moe__cpu_get_rows(void *st, tdm_queue *q, float *y, const float *table,
                          const int32_t *ids, int T, int H, int V);
/* dst[0..n) = the 16-bit values of src widened (wtype TDM_MOE_W_F16: by F16C where the CPU has
 * it; TDM_MOE_W_BF16: a shift), exactly (cpu/ops.c). */
void tdm_moe__cpu_widen16(float *dst, const uint16_t *src, size_t n, int wtype);
/* matmul_h's and matmul_q's few-token path (cpu/ops.c, beside the experts' row kernels):
 * y [T x N] = x [T x K] w^T (+ y when beta), w's rows (16-bit or a block type) widened one at
 * a time, or dotted on their blocks (qdot.h), with every token's row, the rows split between
 * the pool's workers (each row whole by one). T <= 8. */
int tdm_moe__cpu_gemvw(float *y, const float *x, const void *w, int wtype, size_t T, size_t K,
                       size_t N, int beta);
int tdm_moe__cpu_get_rows_h(void *st, tdm_queue *q, float *y, const uint16_t *table, int wtype,
                            const int32_t *ids, int T, int H, int V);
int tdm_moe__cpu_matmul_h(void *st, tdm_queue *q, float *y, const float *x, const uint16_t *w,
                          int wtype, int T, int K, int N, float beta, void *ws,
                          size_t ws_bytes);
int tdm_moe__cpu_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w,
                          int wtype, int T, int K, int N, float beta, void *ws, size_t ws_bytes);
int tdm_moe__cpu_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                        int K, int N, float beta);
int tdm_moe__cpu_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0,
                      float base, float freq_scale, int neox);
int tdm_moe__cpu_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                           const float *vc, int T, int pos0, int nh, int nkv, int hd,
                           float scale);
int tdm_moe__cpu_attn_prep_at(void *st, tdm_queue *q, float *qv, const float *k, const float *v,
                              float *kc, float *vc, const float *qn, const float *kn, int T,
                              int nh, int nkv, int hd, float eps, const int32_t *pos, int ctx,
                              float base, float freq_scale, int neox);
int tdm_moe__cpu_attention_at(void *st, tdm_queue *q, float *out, const float *qv,
                              const float *kc, const float *vc, int T, const int32_t *pos,
                              int ctx, int nh, int nkv, int hd, float scale);
/* One row of rmsnorm (cpu/ops.c), for the fused ops of cpu/xfmr.c. */
void tdm_moe__cpu_rmsnorm_row(float *y, const float *x, const float *w, int H, float eps);

#endif
