/* tandem/cpu.h: interop with the CPU backend's native queue, the tdm_cpu_stream.
 *
 * A tdm_cpu_stream is what a CUDA stream is to the CUDA backend: one worker thread running work
 * in FIFO order. tdm_queue_native() on an in-order cpu queue returns its stream; user code can
 * launch its own functions on it (the CPU analogue of launching a kernel on a stream), and
 * tandem's markers and tdm_queue_sync() cover that work. A stream made here can be adopted
 * with tdm_queue_adopt().
 *
 * In a child forked after a stream or tdm_init() was made, each call returns TDM_EFORK: the
 * stream's worker thread stayed in the parent (a stream copied into the child is never freed
 * there).
 */
#ifndef TANDEM_CPU_H
#define TANDEM_CPU_H

#include "../tandem.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_cpu_stream tdm_cpu_stream;

/* The caller owns the stream; destroy it after every queue adopting it is destroyed. */
TDM_API TDM_NODISCARD int tdm_cpu_stream_create(tdm_cpu_stream **out);
/* Runs what is queued, joins the worker and frees the stream. */
TDM_API int tdm_cpu_stream_destroy(tdm_cpu_stream *s);
/* Queues fn(arg) to run on the stream's worker after everything queued before it. No event,
 * no error tracking: like a raw kernel launch. */
TDM_API TDM_NODISCARD int tdm_cpu_stream_launch(tdm_cpu_stream *s, void (*fn)(void *), void *arg);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CPU_H */
