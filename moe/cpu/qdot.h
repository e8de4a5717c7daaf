/* qdot.h: dot products of GGUF block rows (Q8_0, Q4_K, Q6_K, MXFP4; Q5_K, a projection's type
 * only) with f32 activations, on the blocks themselves, for the CPU's few-token expert kernels
 * and matmul_q (ops.c). AVX2 with FMA and F16C, and for Q4_K and MXFP4 AVX-512 where the CPU
 * has it (faster there; Q8_0 and Q6_K were faster in AVX2), chosen once at first use
 * (TANDEM_MOE_CPU_QDOT: 2 so, 3, the default, as 2 with qdot16.c's paths besides; 1 AVX2
 * only; 0 none); where none runs, or the build is not for x86-64, tdm_moe__qdot_ready() is
 * false and ops.c widens each row to f32 first.
 *
 * Each 32 values (a unit: a Q8_0 or MXFP4 block, a Q4_K or Q5_K sub-block, two Q6_K
 * sub-blocks) are widened once into registers, w = s q - m (moe/quant.h's values; Q4_K's and
 * Q5_K's multiply and subtract fused into one rounding), and dotted with every token's
 * activations by fused multiply-adds into that token's own accumulators, in a fixed order: a
 * result is within f32 rounding of the widened row's (not bitwise), and does not depend on the
 * other tokens of its group. The AVX2 and AVX-512 variants sum in different orders, so their
 * bits differ. */
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

/* ---- 16-bit activations (qdot16.c) ----
 * Q8_0, Q4_K, Q6_K and MXFP4 rows dotted in integers with each token's activations rounded
 * to 16-bit integers in blocks of 32 (tdm_moe__x16, once a token and call): within about 1e-5
 * of the f32 dot, not within f32 rounding; bitwise repeatable, and a token's result does not
 * depend on the other tokens. Where the CPU has AVX2 and TANDEM_MOE_CPU_QDOT is 3 (the
 * default). AVX2 only: a Q4_K variant in AVX-512 VNNI was 5-20% slower a thread
 * (bench/results/cpu-qdot16-avx512/). */

/* Whether tdm_moe__qdot16 takes rows of this type on this CPU. */
bool tdm_moe__qdot16_takes(int type);

/* Bytes of one token's prepared activations of K values (K a multiple of 32). */
size_t tdm_moe__x16_bytes(size_t K);

/* Token x (K values) prepared for rows of `type` into dst (tdm_moe__x16_bytes(K) bytes, 32-byte
 * aligned not required). */
void tdm_moe__x16(const float *x, size_t K, int type, void *dst);

/* res[t] = (row of K values of `type` at src) . token t, for t < n, each token prepared by
 * tdm_moe__x16 for this type; K whole blocks. */
void tdm_moe__qdot16(const uint8_t *src, int type, size_t K, const void *const *x, float *res,
                     size_t n);

#endif
