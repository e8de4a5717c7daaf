/* raw.h: the raw side of bench-sycl, the DPC++ calls tandem's SYCL backend stands for, made on
 * queues of the benchmark's own in tandem's context (raw.cpp). Each loop function makes n calls
 * back to back and returns 0, or -1 after printing the runtime's words. */
#ifndef TANDEM_BENCH_SYCL_RAW_H
#define TANDEM_BENCH_SYCL_RAW_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct raw raw;

/* Two in-order queues (A, B) on the context's first device, a USM host source and a USM device
 * destination of span bytes each, and room for n events. */
raw *raw_open(void *sycl_context, size_t span, long n);
void raw_close(raw *r);
/* n copies of `bytes` host -> device, cycling through the span; no event kept. */
int raw_submit(raw *r, long n, size_t bytes);
/* n barriers with no events on A (markers), each event dropped at once. */
int raw_record(raw *r, long n);
/* Untimed: n barriers on A kept as events; held: A first runs a host task that waits for
 * raw_open_gate (so they stay pending), else they are waited for (complete). */
int raw_prepare_waits(raw *r, long n, int held);
/* Timed: B makes a barrier on each kept event (ext_oneapi_submit_barrier({e})). */
int raw_waits(raw *r, long n);
void raw_open_gate(raw *r);
/* n times: a copy of `bytes`, then A.wait(). */
int raw_round_trips(raw *r, long n, size_t bytes);
/* Both queues idle, kept events dropped. */
int raw_drain(raw *r);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_BENCH_SYCL_RAW_H */
