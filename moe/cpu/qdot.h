/* qdot.h: dot products of GGUF block rows (Q8_0, Q4_K, Q6_K, MXFP4) with f32 activations, on
 * the blocks themselves, for the CPU's few-token expert kernels and matmul_q (ops.c). AVX2 with
 * FMA and F16C, and for Q4_K and MXFP4 AVX-512 where the CPU has it (faster there; Q8_0 and
 * Q6_K were faster in AVX2), chosen once at first use (TANDEM_MOE_CPU_QDOT: 2, the default,
 * so; 1 AVX2 only; 0 none); where none runs, or the build is not for x86-64,
 * tdm_moe__qdot_ready() is false and ops.c widens each row to f32 first.
 *
 * Each 32 values (a unit: a Q8_0 or MXFP4 block, a Q4_K sub-block, two Q6_K sub-blocks) are
 * widened once into registers, w = s q - m (moe/quant.h's values; Q4_K's multiply and subtract
 * fused into one rounding), and dotted with every token's activations by fused multiply-adds
 * into that token's own accumulators, in a fixed order: a result is within f32 rounding of the
 * widened row's (not bitwise), and does not depend on the other tokens of its group. The AVX2
 * and AVX-512 variants sum in different orders, so their bits differ. */
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
