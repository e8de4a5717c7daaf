/* cpu/qdot_x86.h: the AVX2 helpers that qdot.c (f32 activations) and qdot16.c (16-bit ones)
 * both read block rows with. x86-64 with GCC or Clang only; each helper is compiled for AVX2,
 * FMA and F16C and inlined into its caller, which must be compiled for them too. */
#ifndef TANDEM_MOE_CPU_QDOT_X86_H
#define TANDEM_MOE_CPU_QDOT_X86_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QDOT_TARGET __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* The binary16 at p (any alignment), exactly. */
QDOT_TARGET float f16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

QDOT_TARGET float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The MXFP4 block at b (17 bytes: the E8M0 exponent, then 32 codes as nibbles, values 0-15
 * low, 16-31 high): its codes as 32 signed bytes in order, twice E2M1's value from a byte
 * table (code 8 is +0), and *d the scale that undoes the doubling, 2^(e - 128) (e < 2: the
 * subnormal f32 of it), so that value = *d * byte. */
QDOT_TARGET __m256i mxfp4_block(const uint8_t *b, float *d) {
  const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
  memcpy(d, &bits, sizeof *d);
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1)), n4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, n4));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), n4));
  return _mm256_set_m128i(hi, lo);
}

/* Quarter c (of 8: half c / 4, quarter c % 4 of it) of the Q6_K block at b as 32 signed
 * bytes q - 32 (moe/quant.h's layout). */
QDOT_TARGET __m256i q6k_quarter(const uint8_t *b, int c) {
  const int half = c >> 2, quarter = c & 3;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (quarter & 1)));
  __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
  ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((quarter >> 1) * 4)), nib);
  qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter)),
                        _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
}

#endif
