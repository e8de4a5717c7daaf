/* bcuda.h: what the sub-benchmarks of bench-cuda share: the run's context (tandem device, its
 * CUDA ordinal and properties, options), checked calls into CUDA, cuBLAS and tandem, random
 * data that is never all zeros, and the entry points of the sub-benchmarks.
 *
 * Every CUDA, cuBLAS and tandem call goes through CUDA_CALL / BLAS_CALL / TDM_CALL (or the CK_
 * forms, which jump to the function's `out` label on failure). A failure is reported on stderr
 * with the call, file and line and the native error, counted, and kept as the run's note so the
 * JSON says what went wrong. A failed data check is reported the same way (bc_failf).
 */
#ifndef TANDEM_BCUDA_H
#define TANDEM_BCUDA_H

#include <tandem.h>
#include <tandem/cuda.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "json.h"

#define GIB ((size_t)1 << 30)
#define MIB ((size_t)1 << 20)
#define KIB ((size_t)1 << 10)

typedef struct bc_options {
  const char *device; /* "cuda:0" */
  const char *json;   /* NULL: no JSON file */
  long reps;          /* timed repetitions; medians are reported */
  long iters;         /* overhead: calls per repetition */
  size_t max_size;    /* pinned and pageable: the largest copy */
  long threads;       /* pageable: host memcpy threads */
  long experts;       /* overlap: experts streamed per pass */
  long tokens;        /* overlap: 0 = calibrate */
  uint64_t seed;
} bc_options;

typedef struct bc_ctx {
  const bc_options *opt;
  tdm_device *dev;
  tdm_device_info info;
  int ordinal;               /* the CUDA device behind dev */
  struct cudaDeviceProp prop;
  uint64_t seed;             /* advanced by every sub-benchmark that draws random data */
} bc_ctx;

/* ---- checked calls --------------------------------------------------------------------- */

/* Each returns 0, or -1 after reporting the failure. */
int bc__cuda(cudaError_t e, const char *call, const char *file, int line);
int bc__blas(cublasStatus_t s, const char *call, const char *file, int line);
int bc__tdm(int rc, const char *call, const char *file, int line);

#define CUDA_CALL(call) bc__cuda((call), #call, __FILE__, __LINE__)
#define BLAS_CALL(call) bc__blas((call), #call, __FILE__, __LINE__)
#define TDM_CALL(call) bc__tdm((call), #call, __FILE__, __LINE__)

#define CK_CUDA(call)                                                                              \
  do {                                                                                             \
    if (CUDA_CALL(call) < 0)                                                                       \
      goto out;                                                                                    \
  } while (0)
#define CK_BLAS(call)                                                                              \
  do {                                                                                             \
    if (BLAS_CALL(call) < 0)                                                                       \
      goto out;                                                                                    \
  } while (0)
#define CK_TDM(call)                                                                               \
  do {                                                                                             \
    if (TDM_CALL(call) < 0)                                                                        \
      goto out;                                                                                    \
  } while (0)
/* A checked condition that is not a call (a data check, an allocation). */
#define CK(cond, ...)                                                                              \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      bc_failf(__VA_ARGS__);                                                                       \
      goto out;                                                                                    \
    }                                                                                              \
  } while (0)

/* Reports a failure in words (printf format), counted like a failed call. */
void bc_failf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Failures reported so far, and the first one's message ("" if none). */
long bc_failures(void);
const char *bc_first_failure(void);
/* Starts a new note: bc_first_failure() forgets earlier failures (the count keeps them). */
void bc_note_reset(void);

/* ---- memory and data ------------------------------------------------------------------- */

/* The native device pointer behind tandem device memory (tdm_mem_native), for raw CUDA and
 * cuBLAS calls on it. NULL after reporting a failure. */
void *bc_native(const void *tandem_ptr);

/* Fills n bytes with pseudo-random data from seed (splitmix64). */
void bc_fill_random(void *p, size_t n, uint64_t seed);
/* Fills n bf16 values with random finite numbers of magnitude in [2^-7, 2), either sign. */
void bc_fill_bf16(uint16_t *p, size_t n, uint64_t seed);
static inline double bc_bf16_to_double(uint16_t h) {
  union {
    uint32_t u;
    float f;
  } v = {(uint32_t)h << 16};
  return (double)v.f;
}
/* 0 when a and b hold the same n bytes; else reports where they first differ (as `what`) and
 * returns -1. */
int bc_compare(const void *got, const void *want, size_t n, const char *what);
/* A new seed for the next data set of a sub-benchmark. */
uint64_t bc_next_seed(bc_ctx *c);
/* Copies n bytes of host data into tandem memory dst through a pinned staging buffer on q, and
 * waits for it: 0, or -1 after reporting the failure. */
int bc_upload(bc_ctx *c, tdm_queue *q, void *dst, const void *src, size_t n);

/* Bytes as "4 KiB", "1 GiB". */
void bc_format_size(size_t n, char *buf, size_t size);

/* ---- sub-benchmarks ------------------------------------------------------------------------ */

/* Each measures, prints its table to stdout, and writes one JSON object (its figures) with
 * json, whose top-level value it is. 0 when everything ran and every check passed; -1
 * otherwise (already reported; the object may then be incomplete, and is not used). */
int bench_overhead(bc_ctx *c, bu_json *json);
int bench_pinned(bc_ctx *c, bu_json *json);
int bench_pageable(bc_ctx *c, bu_json *json);
int bench_overlap(bc_ctx *c, bu_json *json);
int bench_expert(bc_ctx *c, bu_json *json);
int bench_grouped(bc_ctx *c, bu_json *json);

#endif /* TANDEM_BCUDA_H */
