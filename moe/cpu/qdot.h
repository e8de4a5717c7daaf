/* qdot.h: dot products of GGUF block rows (Q8_0, Q4_K, Q6_K, MXFP4) with f32 activations, on
 * the blocks themselves, for the CPU's few-token expert kernels (ops.c). AVX2 with FMA (which
 * every AVX-512 CPU has), chosen once at first use; where the CPU lacks them, or the build is
 * not for x86-64, tdm_moe__qdot_ready() is false and ops.c widens each row to f32 first.
 *
 * Each 32 values (a unit: a Q8_0 or MXFP4 block, a Q4_K sub-block, two Q6_K sub-blocks) are
 * dotted as integers widened to f32, and scaled once: sum (s q - m) x = s (sum q x) - m (sum x),
 * so a value's scale is not multiplied in 32 times. The values are those of
 * tdm_moe_dequant_row() and the sums f32, so a result is within f32 rounding of the widened
 * row's (not bitwise: the products are grouped differently). Each token has its own
 * accumulators, in a fixed order: a token's result does not depend on the others in its group. */
#ifndef TANDEM_MOE_CPU_QDOT_H
#define TANDEM_MOE_CPU_QDOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Whether tdm_moe__qdot runs on this CPU. */
bool tdm_moe__qdot_ready(void);

/* res[t] = (row of K values of block type `type` at src) . x[t], for t < n; K whole blocks;
 * any n (groups of four tokens, each reading the row again, from cache). */
void tdm_moe__qdot(const uint8_t *src, int type, size_t K, const float *const *x, float *res,
                   size_t n);

#endif
