/* sycl-native.h: what the tests do with SYCL objects as other code would (dpctl, llama.cpp's
 * SYCL backend), in C: tests/sycl-native.cpp holds the sycl:: calls. Built into the test
 * programs when the SYCL backend is (TANDEM_TEST_SYCL). Pointers are sycl::queue *,
 * sycl::event * and sycl::context * as tandem/sycl.h exchanges them. Each function returns
 * 0 on success, else prints the runtime's words and returns -1 (or NULL). */
#ifndef TANDEM_TESTS_SYCL_NATIVE_H
#define TANDEM_TESTS_SYCL_NATIVE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A barrier other code enqueues on a queue (no events: after everything before it). */
void *tsy_barrier(void *queue);
/* 1 pending, 0 complete, -1 error. */
int tsy_event_pending(void *event);
/* Waits; 0 if it completed without error. */
int tsy_event_wait(void *event);
void tsy_event_free(void *event);
/* USM of another owner, in the context. */
void *tsy_malloc_device(void *context, size_t n);
void tsy_free(void *context, void *p);
/* A queue of other code on the context's first device (in-order unless ooo), and its end. */
void *tsy_queue_new(void *context, int ooo);
void tsy_queue_free(void *queue);
/* The request's slow kernel, as llama.cpp's SYCL backend would launch one: an OpenCL C kernel
 * through the OpenCL interop that spins for about `spins` iterations per work-item, then
 * writes value + i into dst[i] for n ints (USM). Returns its event. */
void *tsy_slow_fill(void *queue, int *dst, size_t n, int value, long spins);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_TESTS_SYCL_NATIVE_H */
