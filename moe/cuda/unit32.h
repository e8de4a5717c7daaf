/* cuda/unit32.h: a row of a file's weight format read 32 values at a time (a Q8_0 or MXFP4
 * block; a Q4_K or Q5_K sub-block: its 6-bit scale and min, and one nibble of 32 bytes (Q5_K:
 * and a bit of 32 more); a quarter of a Q6_K half-block; 32 F16 or BF16 values), in
 * moe/quant.h's f32 operations and order (the compiler may fuse d sc q - dmin m into one
 * rounding), so that a weight is the value tdm_moe_dequant_row gives within that rounding; and
 * BY_QTYPE, a body compiled for each block type. The prefill kernels of cuda/quant.cu and
 * cuda/gmm.cu read their weights this way. */
#ifndef TANDEM_MOE_CUDA_UNIT32_H
#define TANDEM_MOE_CUDA_UNIT32_H
#include "cuda/cuda_ops.h"

extern "C" {
#include "tandem/moe_ops.h"
}

/* The loads of unit32 from global memory (G: read-only path, rows at even addresses) or from
 * shared memory (rows staged at 4-byte multiples). */
template <bool G> static __device__ __forceinline__ uint32_t u_b(const uint8_t *p) {
  if (G) return __ldg(p);
  return *p;
}
template <bool G> static __device__ __forceinline__ uint32_t u_h(const uint8_t *p) {
  if (G) return ld16(p);
  return *(const uint16_t *)p;
}
template <bool G> static __device__ __forceinline__ uint32_t u_w(const uint8_t *p) {
  if (G) return ld32(p);
  return u_h<false>(p) | u_h<false>(p + 2) << 16;
}
template <bool G> static __device__ __forceinline__ float u_f16(const uint8_t *p) {
  return __half2float(__ushort_as_half((unsigned short)u_h<G>(p)));
}

/* (float)v for v < 2^23, without the conversion unit (16 a clock on an SM, an eighth of the
 * adds): v in the mantissa of 2^23. */
static __device__ __forceinline__ float small_f(uint32_t v) {
  return __uint_as_float(0x4B000000u | v) - 8388608.f;
}

/* Sub-block j's scale d sc and offset dmin m of the Q4_K block at b (its 6-bit sc and m from
 * the 12 packed bytes, as moe/quant.h's tdm_moe__scale_min_k4). */
template <bool G>
static __device__ __forceinline__ void q4k_scale(const uint8_t *b, int j, float *d1, float *m1) {
  const uint8_t *sc = b + 4;
  uint32_t s, m;
  if (j < 4) {
    s = u_b<G>(sc + j) & 63;
    m = u_b<G>(sc + j + 4) & 63;
  } else {
    s = (u_b<G>(sc + j + 4) & 0xF) | ((u_b<G>(sc + j - 4) >> 6) << 4);
    m = (u_b<G>(sc + j + 4) >> 4) | ((u_b<G>(sc + j) >> 6) << 4);
  }
  *d1 = u_f16<G>(b) * small_f(s);
  *m1 = u_f16<G>(b + 2) * small_f(m);
}

/* Half h (values 32u + 16h .. + 15) of unit u of a row of type T at row (an even address; in
 * shared memory where G is false) into v. */
template <int T, bool G = true>
static __device__ __forceinline__ void unit16(const uint8_t *row, int u, int h, float v[16]) {
  if (T == TDM_MOE_W_Q8_0) {
    const uint8_t *b = row + 34 * (size_t)u;
    const float d = u_f16<G>(b);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const uint32_t q = u_h<G>(b + 2 + 16 * h + j);
      v[j] = (float)(int8_t)(q & 0xff) * d;
      v[j + 1] = (float)(int8_t)(q >> 8) * d;
    }
  } else if (T == TDM_MOE_W_Q4_K) {
    const uint8_t *b = row + 144 * (size_t)(u >> 3);
    const int j = u & 7;
    float d1, m1;
    q4k_scale<G>(b, j, &d1, &m1);
    const uint8_t *q = b + 16 + 32 * (j >> 1) + 16 * h;
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
      const uint32_t w = u_h<G>(q + l);
      v[l] = d1 * (float)((w >> shift) & 0xF) - m1;
      v[l + 1] = d1 * (float)((w >> (8 + shift)) & 0xF) - m1;
    }
  } else if (T == TDM_MOE_W_Q5_K) { /* Q4_K's sub-block, bit j of qh's bytes its fifth bits */
    const uint8_t *b = row + 176 * (size_t)(u >> 3);
    const int j = u & 7;
    float d1, m1;
    q4k_scale<G>(b, j, &d1, &m1);
    const uint8_t *q = b + 48 + 32 * (j >> 1) + 16 * h, *qh = b + 16 + 16 * h;
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
      const uint32_t w = u_h<G>(q + l), hb = u_h<G>(qh + l) >> j;
      v[l] = d1 * (float)(((w >> shift) & 0xF) | (hb & 1) << 4) - m1;
      v[l + 1] = d1 * (float)(((w >> (8 + shift)) & 0xF) | ((hb >> 8) & 1) << 4) - m1;
    }
  } else if (T == TDM_MOE_W_Q6_K) {
    const uint8_t *b = row + 210 * (size_t)(u >> 3);
    const int j = u & 7, hh = j >> 2, qq = j & 3;
    const uint8_t *ql = b + 64 * hh + 32 * (qq & 1) + 16 * h, *qh = b + 128 + 32 * hh + 16 * h;
    const uint8_t *sc = b + 192 + 8 * hh + 2 * qq + h;
    const float d = u_f16<G>(b + 208) * (float)(int8_t)u_b<G>(sc);
    const int sl = (qq >> 1) * 4, sh = 2 * qq;
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
      const uint32_t lo = u_h<G>(ql + l), hi = u_h<G>(qh + l);
#pragma unroll
      for (int k = 0; k < 2; k++) {
        int q = (((lo >> (8 * k)) >> sl) & 0xF) | ((((hi >> (8 * k)) >> sh) & 3) << 4);
        v[l + k] = d * (float)(int8_t)(q - 32);
      }
    }
  } else if (T == TDM_MOE_W_MXFP4) {
    const uint8_t *b = row + 17 * (size_t)u;
    const uint32_t e = u_b<G>(b);
    const float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    /* E2M1 doubled, by the code's low 3 bits: 0 1 2 3 4 6 8 12 (a nibble each); bit 3 is the
     * sign. Half 0 is the 16 bytes' low nibbles, half 1 their high ones. */
    const uint32_t kv = 0xC8643210u;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const uint32_t q = u_b<G>(b + 1 + j) >> (4 * h);
      const float m = (float)((kv >> (4 * (q & 7))) & 15);
      v[j] = ((q & 8) ? -m : m) * d;
    }
  } else if (T == TDM_MOE_W_BF16) {
    const uint8_t *p = row + 64 * (size_t)u + 32 * h;
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const uint32_t w = u_w<G>(p + 2 * j);
      v[j] = __uint_as_float(w << 16);
      v[j + 1] = __uint_as_float(w & 0xffff0000u);
    }
  } else { /* TDM_MOE_W_F16 */
    const uint8_t *p = row + 64 * (size_t)u + 32 * h;
#pragma unroll
    for (int j = 0; j < 16; j++) v[j] = u_f16<G>(p + 2 * j);
  }
}

/* Unit u (values 32u .. 32u + 31) of a row of type T into v: its two halves. */
template <int T, bool G = true>
static __device__ __forceinline__ void unit32(const uint8_t *row, int u, float v[32]) {
  unit16<T, G>(row, u, 0, v);
  unit16<T, G>(row, u, 1, v + 16);
}

/* BODY compiled for each type the kernels take, with QT the type, and run for t (the callers
 * checked it: anything else is F16): BY_QTYPE the experts' block types and F16; BY_WTYPE BF16
 * too; BY_MQTYPE (matmul_q's kernels) Q5_K too, a projection's type only. */
#define QTYPE_CASE(T, ...)  \
  case T: {                 \
    constexpr int QT = T;   \
    __VA_ARGS__;            \
  } break;
#define QTYPE_BLOCKS(...)                      \
  QTYPE_CASE(TDM_MOE_W_Q8_0, __VA_ARGS__)      \
  QTYPE_CASE(TDM_MOE_W_Q4_K, __VA_ARGS__)      \
  QTYPE_CASE(TDM_MOE_W_Q6_K, __VA_ARGS__)      \
  QTYPE_CASE(TDM_MOE_W_MXFP4, __VA_ARGS__)
#define QTYPE_ELSE_F16(...)               \
  default: {                              \
    constexpr int QT = TDM_MOE_W_F16;     \
    __VA_ARGS__;                          \
  } break;
#define BY_QTYPE(t, ...)                                                 \
  switch (t) { QTYPE_BLOCKS(__VA_ARGS__) QTYPE_ELSE_F16(__VA_ARGS__) }
#define BY_MQTYPE(t, ...)                                                                \
  switch (t) {                                                                           \
    QTYPE_BLOCKS(__VA_ARGS__) QTYPE_CASE(TDM_MOE_W_Q5_K, __VA_ARGS__)                   \
    QTYPE_ELSE_F16(__VA_ARGS__)                                                          \
  }
#define BY_WTYPE(t, ...)                                                                 \
  switch (t) {                                                                           \
    QTYPE_BLOCKS(__VA_ARGS__) QTYPE_CASE(TDM_MOE_W_BF16, __VA_ARGS__)                   \
    QTYPE_ELSE_F16(__VA_ARGS__)                                                          \
  }

#endif
