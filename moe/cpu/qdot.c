/* cpu/qdot.c: block rows dotted with f32 activations, AVX2 and AVX-512 (qdot.h). */
#include "qdot.h"

#include <pthread.h>

#include "ops.h"   /* moe/ops.h: tdm_moe__env_long */
#include "quant.h" /* moe/quant.h */

#if defined(__x86_64__) && defined(__GNUC__)
#include "qdot_x86.h"

/* What runs: TANDEM_MOE_CPU_QDOT (read once) 0 none (ops.c widens the rows first), 1 AVX2,
 * 2 AVX-512 where the CPU has it, 3 (the default) as 2 with every type's rows on 16-bit
 * activations (qdot16.c); each only where the CPU has it. */
static bool ok, ok512, ok16;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void check_cpu(void) {
  __builtin_cpu_init();
  long want = tdm_moe__env_long("TANDEM_MOE_CPU_QDOT", 0, 3, 3);
  ok = want >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
       __builtin_cpu_supports("f16c");
  ok512 = ok && want >= 2 && __builtin_cpu_supports("avx512f") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  ok16 = ok && want >= 3;
}

bool tdm_moe__qdot_ready(void) {
  pthread_once(&once, check_cpu);
  return ok;
}

bool tdm_moe__qdot16_takes(int type) {
  pthread_once(&once, check_cpu);
  return ok16 && (type == TDM_MOE_W_Q8_0 || type == TDM_MOE_W_Q4_K || type == TDM_MOE_W_Q6_K ||
                  type == TDM_MOE_W_MXFP4);
}

/* A unit of 32 values: q[4] (values 8i .. 8i + 7 as f32 integers), their scales (s[0] for
 * q[0], q[1]; s[1] for q[2], q[3]) and the offset m (value = s q - m). */
typedef struct unit {
  __m256 q[4];
  float s[2], m;
} unit;

/* The 32 bytes at v (signed when sign) as four vectors of 8 f32. */
QDOT_TARGET void bytes_to_f32(__m256i v, int sign, __m256 q[4]) {
  __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(part[i]) : _mm256_cvtepu8_epi32(part[i]));
}

/* Unit u (values 32u .. 32u + 31) of a row of type t at src, as quant.h's functions define
 * the values. */
QDOT_TARGET void load_unit(const uint8_t *src, int t, size_t u, unit *un) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  un->m = 0.0f;
  if (t == TDM_MOE_W_Q8_0) {
    const uint8_t *b = src + 34 * u;
    un->s[0] = un->s[1] = f16(b);
    bytes_to_f32(_mm256_loadu_si256((const __m256i *)(b + 2)), 1, un->q);
  } else if (t == TDM_MOE_W_Q4_K || t == TDM_MOE_W_Q5_K) {
    /* sub-block j's nibbles; Q5_K's fifth bits are bit j of each of qh's 32 bytes */
    const int q5 = t == TDM_MOE_W_Q5_K, j = (int)(u & 7);
    const uint8_t *b = src + (q5 ? 176 : 144) * (u >> 3);
    uint8_t sc, m;
    tdm_moe__scale_min_k4(j, b + 4, &sc, &m);
    un->s[0] = un->s[1] = f16(b) * sc;
    un->m = f16(b + 2) * m;
    __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * (j >> 1)));
    if (j & 1) raw = _mm256_srli_epi16(raw, 4);
    raw = _mm256_and_si256(raw, nib);
    if (q5) {
      const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                           _mm256_set1_epi8(1));
      raw = _mm256_or_si256(raw, _mm256_slli_epi16(bit, 4));
    }
    bytes_to_f32(raw, 0, un->q);
  } else if (t == TDM_MOE_W_Q6_K) {
    const uint8_t *b = src + 210 * (u >> 3);
    const int c = (int)(u & 7);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * (c >> 2) + 2 * (c & 3);
    const float d = f16(b + 208);
    un->s[0] = d * sc[0];
    un->s[1] = d * sc[1];
    bytes_to_f32(q6k_quarter(b, c), 1, un->q);
  } else { /* TDM_MOE_W_MXFP4 */
    float d;
    bytes_to_f32(mxfp4_block(src + 17 * u, &d), 1, un->q);
    un->s[0] = un->s[1] = d;
  }
}

/* Pair p (sub-blocks 2p, 2p + 1: 64 values) of the Q4_K block at b, whose d and dmin are given:
 * each sub-block's scale d sc and negated offset -(dmin m), and its 32 nibbles as bytes (the
 * pair's 32 bytes' low nibbles, then their high ones). Both variants read Q4_K through it. */
QDOT_TARGET void q4k_pair(const uint8_t *b, int p, float d, float dmin, float sc[2],
                          float nm[2], __m256i nibbles[2]) {
  for (int h = 0; h < 2; h++) {
    uint8_t s, m;
    tdm_moe__scale_min_k4(2 * p + h, b + 4, &s, &m);
    sc[h] = d * s;
    nm[h] = -(dmin * m);
  }
  const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * p));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  nibbles[0] = _mm256_and_si256(raw, nib);
  nibbles[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
}

/* T tokens (a constant after inlining): each unit's values widened once into registers,
 * w = s q - m (one rounding where the CPU fuses it, as CUDA's kernels may), and dotted with
 * every token's 32 activations into that token's accumulators: NA of them a token, unit
 * vector i into accumulator i % NA, so the adds of a token do not wait on each other. */
QDOT_TARGET void group(const uint8_t *src, int t, size_t K, const float *const *x, float *res,
                       int T) {
  enum { MAXA = 4 };
  const int NA = T <= 2 ? 4 : 2;
  __m256 acc[4][MAXA];
  for (int i = 0; i < T; i++)
    for (int a = 0; a < NA; a++) acc[i][a] = _mm256_setzero_ps();
  if (t == TDM_MOE_W_Q4_K) { /* a block at a time: its scales once, two units a load */
    for (size_t blk = 0; blk < K / 256; blk++) {
      const uint8_t *b = src + 144 * blk;
      const float d = f16(b), dmin = f16(b + 2);
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        float sc[2], nm[2];
        __m256i nibbles[2];
        q4k_pair(b, p, d, dmin, sc, nm, nibbles);
        __m256 q[2][4], w[8];
        bytes_to_f32(nibbles[0], 0, q[0]);
        bytes_to_f32(nibbles[1], 0, q[1]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
          const __m256 sv = _mm256_set1_ps(sc[h]), mv = _mm256_set1_ps(nm[h]);
#pragma GCC unroll 4
          for (int k = 0; k < 4; k++) w[4 * h + k] = _mm256_fmadd_ps(q[h][k], sv, mv);
        }
#pragma GCC unroll 4
        for (int i = 0; i < T; i++) {
          const float *xp = x[i] + 256 * blk + 64 * p;
#pragma GCC unroll 8
          for (int k = 0; k < 8; k++)
            acc[i][k % NA] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xp + 8 * k), acc[i][k % NA]);
        }
      }
    }
  }
  for (size_t u = 0; t != TDM_MOE_W_Q4_K && u < K / 32; u++) {
    unit un;
    load_unit(src, t, u, &un);
    __m256 w[4];
    const __m256 s0 = _mm256_set1_ps(un.s[0]), s1 = _mm256_set1_ps(un.s[1]);
    if (t == TDM_MOE_W_Q4_K || t == TDM_MOE_W_Q5_K) {
      const __m256 nm = _mm256_set1_ps(-un.m);
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++) w[k] = _mm256_fmadd_ps(un.q[k], s0, nm);
    } else {
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(un.q[k], k < 2 ? s0 : s1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < T; i++) {
      const float *xp = x[i] + 32 * u;
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++)
        acc[i][k % NA] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xp + 8 * k), acc[i][k % NA]);
    }
  }
  for (int i = 0; i < T; i++) {
    __m256 sum = acc[i][0];
    for (int a = 1; a < NA; a++) sum = _mm256_add_ps(sum, acc[i][a]);
    res[i] = hsum(sum);
  }
}

/* The body of a variant's entry: GROUP (group or group512) over every token in groups of four,
 * with the type and the group's size constants in each call, so that each inlined copy is
 * specialized for them. */
#define GROUP_CALL(GROUP, T, N) GROUP(src, T, K, x + i, res + i, N)
#define TOKENS_OF(GROUP, T)                                                                   \
  do {                                                                                        \
    size_t i = 0;                                                                             \
    for (; i + 4 <= n; i += 4) GROUP_CALL(GROUP, T, 4);                                       \
    if (n - i == 3) GROUP_CALL(GROUP, T, 3);                                                  \
    if (n - i == 2) GROUP_CALL(GROUP, T, 2);                                                  \
    if (n - i == 1) GROUP_CALL(GROUP, T, 1);                                                  \
  } while (0)
#define BY_TYPE(GROUP)                                                                        \
  switch (type) {                                                                             \
  case TDM_MOE_W_Q8_0: TOKENS_OF(GROUP, TDM_MOE_W_Q8_0); break;                               \
  case TDM_MOE_W_Q4_K: TOKENS_OF(GROUP, TDM_MOE_W_Q4_K); break;                               \
  case TDM_MOE_W_Q6_K: TOKENS_OF(GROUP, TDM_MOE_W_Q6_K); break;                               \
  case TDM_MOE_W_Q5_K: TOKENS_OF(GROUP, TDM_MOE_W_Q5_K); break;                               \
  default: TOKENS_OF(GROUP, TDM_MOE_W_MXFP4); break;                                          \
  }

/* ---- the AVX-512 variant, for Q4_K and MXFP4: the same units, sixteen values a vector ---- */

#define QDOT512                                                                               \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) static inline

/* 16 unsigned bytes as 16 f32. */
QDOT512 __m512 bytes16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

/* Block u of an MXFP4 row: w[0], w[1] its 32 values, a code's value from a table of the 16
 * (code 8 is +0), times the block's scale. */
QDOT512 void mxfp4_512(const uint8_t *src, size_t u, __m512 w[2]) {
  const uint8_t *b = src + 17 * u;
  const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
  float d;
  memcpy(&d, &bits, sizeof d);
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  const __m512 dv = _mm512_set1_ps(d);
  w[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo), table), dv);
  w[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi), table), dv);
}

/* group() with sixteen lanes, for Q4_K and MXFP4 (t): NA accumulators a token, vector k of a
 * unit into k % NA. */
QDOT512 void group512(const uint8_t *src, int t, size_t K, const float *const *x, float *res,
                      int T) {
  const int NA = T <= 2 ? 4 : 2;
  __m512 acc[4][4];
  for (int i = 0; i < T; i++)
    for (int a = 0; a < NA; a++) acc[i][a] = _mm512_setzero_ps();
  if (t == TDM_MOE_W_Q4_K) {
    for (size_t blk = 0; blk < K / 256; blk++) {
      const uint8_t *b = src + 144 * blk;
      const float d = f16(b), dmin = f16(b + 2);
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        float sc[2], nm[2];
        __m256i q[2];
        q4k_pair(b, p, d, dmin, sc, nm, q);
        __m512 w[4];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
          const __m512 sv = _mm512_set1_ps(sc[h]), mv = _mm512_set1_ps(nm[h]);
          w[2 * h] = _mm512_fmadd_ps(bytes16(_mm256_castsi256_si128(q[h])), sv, mv);
          w[2 * h + 1] = _mm512_fmadd_ps(bytes16(_mm256_extracti128_si256(q[h], 1)), sv, mv);
        }
#pragma GCC unroll 4
        for (int i = 0; i < T; i++) {
          const float *xp = x[i] + 256 * blk + 64 * p;
#pragma GCC unroll 4
          for (int k = 0; k < 4; k++)
            acc[i][k % NA] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(xp + 16 * k), acc[i][k % NA]);
        }
      }
    }
  }
  for (size_t u = 0; t == TDM_MOE_W_MXFP4 && u < K / 32; u++) {
    __m512 w[2];
    mxfp4_512(src, u, w);
#pragma GCC unroll 4
    for (int i = 0; i < T; i++) {
      const float *xp = x[i] + 32 * u;
      const int a = (int)(u % (size_t)(NA / 2)) * 2;
      acc[i][a] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xp), acc[i][a]);
      acc[i][a + 1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xp + 16), acc[i][a + 1]);
    }
  }
  for (int i = 0; i < T; i++) {
    __m512 sum = acc[i][0];
    for (int a = 1; a < NA; a++) sum = _mm512_add_ps(sum, acc[i][a]);
    res[i] = _mm512_reduce_add_ps(sum);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), noinline)) static void
qdot512(const uint8_t *src, int type, size_t K, const float *const *x, float *res, size_t n) {
  if (type == TDM_MOE_W_Q4_K)
    TOKENS_OF(group512, TDM_MOE_W_Q4_K);
  else
    TOKENS_OF(group512, TDM_MOE_W_MXFP4);
}

/* AVX-512 where check_cpu found it, for Q4_K and MXFP4 rows; AVX2 for Q8_0 and Q6_K, and for
 * all where the CPU has no AVX-512. On a two-core Xeon a thread dotted Q4_K and MXFP4 rows as
 * fast or faster with sixteen lanes, and Q8_0 and Q6_K rows 1.3-1.6x faster with eight
 * (bench/results/cpu-qdot-d5929af/). */
__attribute__((target("avx2,fma,f16c"))) void tdm_moe__qdot(const uint8_t *src, int type,
                                                           size_t K, const float *const *x,
                                                           float *res, size_t n) {
  if (ok512 && (type == TDM_MOE_W_Q4_K || type == TDM_MOE_W_MXFP4)) {
    qdot512(src, type, K, x, res, n);
    return;
  }
  BY_TYPE(group)
}

#else /* not x86-64: ops.c widens the rows */

bool tdm_moe__qdot_ready(void) { return false; }

bool tdm_moe__qdot16_takes(int type) {
  (void)type;
  return false;
}

void tdm_moe__qdot(const uint8_t *src, int type, size_t K, const float *const *x, float *res,
                   size_t n) {
  (void)src, (void)type, (void)K, (void)x, (void)res, (void)n;
}

#endif
