/* cpu/qdot16.c: Q8_0, Q4_K, Q6_K and MXFP4 rows dotted in integers with 16-bit activations
 * (qdot.h).
 *
 * qdot.c widens every weight to f32 before its multiply-add: for Q4_K that is most of the
 * work, and a thread dotted Q4_K rows at half the rate it reads memory
 * (bench/results/cpu-qdot-d5929af/). Here each token's activations are rounded once a call to
 * 16-bit integers in blocks of 32 (d = max |x| / 32767, q = rint(x / d), and d times the
 * block's sum of q kept beside d), and a row's integers are multiplied with them sixteen at a
 * time (vpmaddwd: sixteen 16-bit products summed in pairs into eight 32-bit lanes); each
 * block's 32-bit sums are scaled once, in f32, by the weights' scale times d. Q4_K's nibbles
 * are masked straight out of 16-bit lanes, low and high nibble of even and of odd bytes, so a
 * Q4_K row's activations are kept with the even places of a block first, then the odd ones;
 * the other types keep them in order. The rounding is at most 2^-16 of a block's largest
 * value: a dot is within about 1e-5 of the f32 one, not within f32 rounding. Sums run in a
 * fixed order (two accumulators a token, joined last), so results are bitwise repeatable. */
#include "qdot.h"

#include <math.h>

#include "quant.h" /* moe/quant.h */

/* One token's prepared activations: K int16, then K / 32 pairs (d, d * sum of the block's q). */
size_t tdm_moe__x16_bytes(size_t K) { return K * sizeof(int16_t) + K / 32 * 2 * sizeof(float); }

void tdm_moe__x16(const float *x, size_t K, int type, void *dst) {
  int16_t *q = (int16_t *)dst;
  float *ds = (float *)(q + K);
  const int split = type == TDM_MOE_W_Q4_K; /* even places first, then odd */
  for (size_t b = 0; b < K / 32; b++) {
    const float *xb = x + 32 * b;
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
    const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
      const int v = (int)lrintf(xb[i] * inv);
      const int at = split ? (i & 1) * 16 + (i >> 1) : i;
      q[32 * b + (size_t)at] = (int16_t)v;
      sum += v;
    }
    ds[2 * b] = d;
    ds[2 * b + 1] = d * (float)sum;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include "qdot_x86.h"

/* 32 signed bytes at w against 32 int16 at x: eight 32-bit partial sums of the first 16
 * values (m[0]) and of the last 16 (m[1]). */
QDOT_TARGET void dot_s8(__m256i w, const int16_t *x, __m256i m[2]) {
  const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
  const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
  m[0] = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
  m[1] = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

/* T tokens (a constant after inlining): acc[i][0..1] token i's f32 sums, off[i] its Q4_K
 * mins' part (subtracted last). */
QDOT_TARGET void group16(const uint8_t *src, int t, size_t K, const void *const *xv, float *res,
                        int T) {
  __m256 acc[4][2];
  float off[4];
  const int16_t *xq[4];
  const float *xd[4];
  for (int i = 0; i < T; i++) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    off[i] = 0.0f;
    xq[i] = (const int16_t *)xv[i];
    xd[i] = (const float *)(xq[i] + K);
  }
  if (t == TDM_MOE_W_Q4_K) {
    const __m256i m4 = _mm256_set1_epi16(0x000F);
    for (size_t blk = 0; blk < K / 256; blk++) {
      const uint8_t *b = src + 144 * blk;
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; j++) tdm_moe__scale_min_k4(j, b + 4, &sc[j], &mn[j]);
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        const __m256i r = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * p));
        const __m256i a0 = _mm256_and_si256(r, m4);
        const __m256i a1 = _mm256_and_si256(_mm256_srli_epi16(r, 8), m4);
        const __m256i a2 = _mm256_and_si256(_mm256_srli_epi16(r, 4), m4);
        const __m256i a3 = _mm256_srli_epi16(r, 12);
        const size_t u = 8 * blk + 2 * (size_t)p; /* sub-blocks u (low nibbles), u + 1 (high) */
#pragma GCC unroll 4
        for (int i = 0; i < T; i++) {
          const int16_t *xa = xq[i] + 32 * u;
          const __m256i ma = _mm256_add_epi32(
              _mm256_madd_epi16(a0, _mm256_loadu_si256((const __m256i *)xa)),
              _mm256_madd_epi16(a1, _mm256_loadu_si256((const __m256i *)(xa + 16))));
          const __m256i mb = _mm256_add_epi32(
              _mm256_madd_epi16(a2, _mm256_loadu_si256((const __m256i *)(xa + 32))),
              _mm256_madd_epi16(a3, _mm256_loadu_si256((const __m256i *)(xa + 48))));
          const float *da = xd[i] + 2 * u;
          acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ma),
                                      _mm256_set1_ps(d * sc[2 * p] * da[0]), acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mb),
                                      _mm256_set1_ps(d * sc[2 * p + 1] * da[2]), acc[i][1]);
          off[i] += dmin * ((float)mn[2 * p] * da[1] + (float)mn[2 * p + 1] * da[3]);
        }
      }
    }
  } else if (t == TDM_MOE_W_Q8_0 || t == TDM_MOE_W_MXFP4) { /* a block of 32 a step */
    for (size_t u = 0; u < K / 32; u++) {
      float d;
      __m256i w;
      if (t == TDM_MOE_W_Q8_0) {
        d = f16(src + 34 * u);
        w = _mm256_loadu_si256((const __m256i *)(src + 34 * u + 2));
      } else {
        w = mxfp4_block(src + 17 * u, &d);
      }
#pragma GCC unroll 4
      for (int i = 0; i < T; i++) {
        __m256i m[2];
        dot_s8(w, xq[i] + 32 * u, m);
        acc[i][u & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(m[0], m[1])),
                                        _mm256_set1_ps(d * xd[i][2 * u]), acc[i][u & 1]);
      }
    }
  } else { /* TDM_MOE_W_Q6_K: a quarter (32 values; scales of its first and last 16) a step */
    for (size_t blk = 0; blk < K / 256; blk++) {
      const uint8_t *b = src + 210 * blk;
      const int8_t *sc = (const int8_t *)(b + 192);
      const float d = f16(b + 208);
#pragma GCC unroll 2
      for (int c = 0; c < 8; c++) {
        const __m256i w = q6k_quarter(b, c);
        const float s0 = d * sc[8 * (c >> 2) + 2 * (c & 3)],
                    s1 = d * sc[8 * (c >> 2) + 2 * (c & 3) + 1];
        const size_t u = 8 * blk + (size_t)c;
#pragma GCC unroll 4
        for (int i = 0; i < T; i++) {
          __m256i m[2];
          dot_s8(w, xq[i] + 32 * u, m);
          const float dx = xd[i][2 * u];
          acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[0]), _mm256_set1_ps(s0 * dx), acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[1]), _mm256_set1_ps(s1 * dx), acc[i][1]);
        }
      }
    }
  }
  for (int i = 0; i < T; i++) res[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1])) - off[i];
}

#define G16(TY, N) group16(src, TY, K, x + i, res + i, N)
#define TOKENS16(TY)                          \
  do {                                        \
    size_t i = 0;                             \
    for (; i + 4 <= n; i += 4) G16(TY, 4);    \
    if (n - i == 3) G16(TY, 3);               \
    if (n - i == 2) G16(TY, 2);               \
    if (n - i == 1) G16(TY, 1);               \
  } while (0)

__attribute__((target("avx2,fma,f16c"))) void tdm_moe__qdot16(const uint8_t *src, int type,
                                                             size_t K, const void *const *x,
                                                             float *res, size_t n) {
  if (type == TDM_MOE_W_Q4_K)
    TOKENS16(TDM_MOE_W_Q4_K);
  else if (type == TDM_MOE_W_Q8_0)
    TOKENS16(TDM_MOE_W_Q8_0);
  else if (type == TDM_MOE_W_MXFP4)
    TOKENS16(TDM_MOE_W_MXFP4);
  else
    TOKENS16(TDM_MOE_W_Q6_K);
}

#else /* not x86-64: tdm_moe__qdot16_takes() is false */

void tdm_moe__qdot16(const uint8_t *src, int type, size_t K, const void *const *x, float *res,
                     size_t n) {
  (void)src, (void)type, (void)K, (void)x, (void)res, (void)n;
}

#endif
