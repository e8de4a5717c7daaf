/* conf-native.h: native events for tests/test-conf-import.c, made with the SDK of the case's
 * backend where the build has it (TANDEM_TEST_OPENCL, TANDEM_TEST_CUDA; otherwise the cases
 * skip on that backend). */
#ifndef TANDEM_TESTS_CONF_NATIVE_H
#define TANDEM_TESTS_CONF_NATIVE_H

#include "conformance.h"

#ifdef TANDEM_TEST_OPENCL
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#endif
#ifdef TANDEM_TEST_CUDA
#include <cuda_runtime.h>
#endif
#ifdef TANDEM_TEST_SYCL
#include "sycl-native.h"
#endif

/* A native event that the test completes when it chooses:
 * - OpenCL: a user event in the device's context (tdm_device_native's);
 * - CUDA: an event recorded on a tandem queue's stream behind a host task that waits for a
 *   gate: tandem holds the stream on the device until the task has run, so the event is
 *   pending, with no kernel and no timing involved, until the test opens the gate.
 * - SYCL: as CUDA, a barrier enqueued on a tandem queue's sycl::queue behind such a task.
 * CPU devices have no native events (tdm_event_import: TDM_ENOTSUP). */
enum native_kind { NATIVE_NONE, NATIVE_OPENCL, NATIVE_CUDA, NATIVE_SYCL };

struct native_ev {
  enum native_kind kind;
  void *ev;     /* the cl_event, cudaEvent_t or sycl::event *; NULL once the test gave it up */
  th_gate gate; /* CUDA, SYCL: the host task holding gq waits for it */
  tdm_queue *gq;
};

TH_HELPER enum native_kind native_kind_of(tdm_device *dev) {
  const char *b = th_backend_of(dev);
  if (strcmp(b, "opencl") == 0) {
#ifdef TANDEM_TEST_OPENCL
    return NATIVE_OPENCL;
#else
    TH_SKIP("this build has no OpenCL headers for the test");
#endif
  }
  if (strcmp(b, "cuda") == 0) {
#ifdef TANDEM_TEST_CUDA
    return NATIVE_CUDA;
#else
    TH_SKIP("this build has no CUDA runtime for the test");
#endif
  }
  if (strcmp(b, "sycl") == 0) {
#ifdef TANDEM_TEST_SYCL
    return NATIVE_SYCL;
#else
    TH_SKIP("this build has no SYCL runtime for the test");
#endif
  }
  return NATIVE_NONE;
}

#ifdef TANDEM_TEST_OPENCL
#define CHECK_CL(call) CHECK_MSG((call) == CL_SUCCESS, "%s failed", #call)
TH_HELPER cl_context device_context(tdm_device *dev) {
  void *ctx = NULL;
  CHECK_OK(tdm_device_native(dev, &ctx));
  return (cl_context)ctx;
}
#endif
#ifdef TANDEM_TEST_CUDA
#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t th_e_ = (call);                                                               \
    CHECK_MSG(th_e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(th_e_));              \
  } while (0)
#endif

/* A native event that stays pending until native_complete. */
TH_HELPER void native_pending(tdm_device *dev, enum native_kind kind, struct native_ev *n) {
  memset(n, 0, sizeof *n);
  n->kind = kind;
#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    cl_int err = CL_SUCCESS;
    n->ev = clCreateUserEvent(device_context(dev), &err);
    CHECK_MSG(n->ev && err == CL_SUCCESS, "clCreateUserEvent: %d", err);
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (kind == NATIVE_CUDA) {
    th_gate_init(&n->gate);
    n->gq = new_queue(dev, TDM_QUEUE_IN_ORDER);
    CHECK_OK(tdm_host_task(n->gq, task_wait_gate, &n->gate, 0, NULL, NULL));
    void *s = NULL;
    CHECK_OK(tdm_queue_native(n->gq, &s));
    cudaEvent_t e;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(e, (cudaStream_t)s));
    CHECK(cudaEventQuery(e) == cudaErrorNotReady);
    n->ev = e;
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (kind == NATIVE_SYCL) {
    th_gate_init(&n->gate);
    n->gq = new_queue(dev, TDM_QUEUE_IN_ORDER);
    CHECK_OK(tdm_host_task(n->gq, task_wait_gate, &n->gate, 0, NULL, NULL));
    void *s = NULL;
    CHECK_OK(tdm_queue_native(n->gq, &s));
    CHECK((n->ev = tsy_barrier(s)) != NULL);
    CHECK(tsy_event_pending(n->ev) == 1);
  }
#endif
  (void)dev;
}

/* Completes it; status < 0 makes it fail (OpenCL only: a CUDA event cannot report a failure
 * without a fault that breaks the whole context). */
TH_HELPER void native_complete(struct native_ev *n, int status) {
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL)
    CHECK_CL(clSetUserEventStatus((cl_event)n->ev, status < 0 ? status : CL_COMPLETE));
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    CHECK(status == 0);
    th_gate_open(&n->gate);
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (n->kind == NATIVE_SYCL) {
    CHECK(status == 0);
    th_gate_open(&n->gate);
  }
#endif
  (void)status;
}

/* CUDA: destroys the queue that held the event back (counted in tdm_stats_get). */
TH_HELPER void native_free_queue(struct native_ev *n) {
  if (n->gq) {
    CHECK_OK(tdm_queue_destroy(n->gq));
    th_gate_destroy(&n->gate);
    n->gq = NULL;
  }
}

TH_HELPER void native_free(struct native_ev *n) {
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL && n->ev) {
    /* tandem gives back every reference it took once its event is freed (the last one from
     * a thread of its own, soon after). */
    cl_uint refs = 0;
    for (int waited = 0;; waited++) {
      CHECK_CL(clGetEventInfo((cl_event)n->ev, CL_EVENT_REFERENCE_COUNT, sizeof refs, &refs,
                              NULL));
      if (refs == 1 || waited >= TH_HANG_MS) break;
      th_sleep_ms(1);
    }
    CHECK_EQ(refs, 1);
    CHECK_CL(clReleaseEvent((cl_event)n->ev));
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    if (n->ev) CHECK_CUDA(cudaEventDestroy((cudaEvent_t)n->ev));
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (n->kind == NATIVE_SYCL && n->ev) tsy_event_free(n->ev);
#endif
  native_free_queue(n);
  n->ev = NULL;
}

/* A native event that has already completed. */
TH_HELPER void native_completed(tdm_device *dev, enum native_kind kind, struct native_ev *n) {
  memset(n, 0, sizeof *n);
  n->kind = kind;
#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    native_pending(dev, kind, n);
    native_complete(n, 0);
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (kind == NATIVE_CUDA) {
    tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
    void *s = NULL;
    CHECK_OK(tdm_queue_native(q, &s));
    cudaEvent_t e;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(e, (cudaStream_t)s));
    CHECK_CUDA(cudaEventSynchronize(e));
    CHECK_OK(tdm_queue_destroy(q));
    n->ev = e;
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (kind == NATIVE_SYCL) {
    tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
    void *s = NULL;
    CHECK_OK(tdm_queue_native(q, &s));
    CHECK((n->ev = tsy_barrier(s)) != NULL);
    CHECK(tsy_event_wait(n->ev) == 0);
    CHECK_OK(tdm_queue_destroy(q));
  }
#endif
  (void)dev;
}

/* After the import: on CUDA the caller may re-record its event and destroy it at once; the
 * import still stands for the work recorded into it before (the gated stream). */
TH_HELPER void native_after_import(struct native_ev *n) {
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) {
    cudaStream_t idle;
    CHECK_CUDA(cudaStreamCreateWithFlags(&idle, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventRecord((cudaEvent_t)n->ev, idle));
    CHECK_CUDA(cudaEventSynchronize((cudaEvent_t)n->ev)); /* the re-recorded event completes */
    CHECK_CUDA(cudaEventDestroy((cudaEvent_t)n->ev));
    CHECK_CUDA(cudaStreamDestroy(idle));
    n->ev = NULL;
  }
#endif
  (void)n;
}

/* What tdm_event_native gives for an import of n, while n's work is pending. */
TH_HELPER void native_check_export(const struct native_ev *n, void *exported, void *orig) {
  CHECK(exported != NULL);
#ifdef TANDEM_TEST_OPENCL
  if (n->kind == NATIVE_OPENCL) CHECK(exported == orig); /* the caller's own cl_event */
#endif
#ifdef TANDEM_TEST_CUDA
  if (n->kind == NATIVE_CUDA) /* tandem's own event, for the same (pending) work */
    CHECK(cudaEventQuery((cudaEvent_t)exported) == cudaErrorNotReady);
#endif
#ifdef TANDEM_TEST_SYCL
  if (n->kind == NATIVE_SYCL) /* tandem's copy of the caller's sycl::event */
    CHECK(tsy_event_pending(exported) == 1);
#endif
  (void)n;
  (void)orig;
}

/* A marker that other code enqueues on a tandem queue's native queue (tdm_queue_native): a
 * cl_event of clEnqueueMarkerWithWaitList, or a cudaEvent_t recorded on the stream. */
struct native_mark {
  enum native_kind kind;
  void *ev;
};

TH_HELPER void native_mark_enqueue(tdm_queue *q, enum native_kind kind, struct native_mark *m) {
  memset(m, 0, sizeof *m);
  m->kind = kind;
  void *nq = NULL;
  CHECK_OK(tdm_queue_native(q, &nq));
#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    cl_event e = NULL;
    CHECK_CL(clEnqueueMarkerWithWaitList((cl_command_queue)nq, 0, NULL, &e));
    CHECK_CL(clFlush((cl_command_queue)nq));
    m->ev = e;
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (kind == NATIVE_CUDA) {
    cudaEvent_t e = NULL;
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(e, (cudaStream_t)nq));
    m->ev = e;
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (kind == NATIVE_SYCL) CHECK((m->ev = tsy_barrier(nq)) != NULL);
#endif
  (void)nq;
}

/* Whether the marker has yet to complete. */
TH_HELPER int native_mark_pending(const struct native_mark *m) {
#ifdef TANDEM_TEST_OPENCL
  if (m->kind == NATIVE_OPENCL) {
    cl_int st = CL_COMPLETE;
    CHECK_CL(clGetEventInfo((cl_event)m->ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st,
                            NULL));
    return st > CL_COMPLETE;
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (m->kind == NATIVE_CUDA) return cudaEventQuery((cudaEvent_t)m->ev) == cudaErrorNotReady;
#endif
#ifdef TANDEM_TEST_SYCL
  if (m->kind == NATIVE_SYCL) return tsy_event_pending(m->ev) == 1;
#endif
  (void)m;
  return 0;
}

/* Waits for the marker and frees it; returns whether it completed without error. */
TH_HELPER int native_mark_finish(struct native_mark *m) {
  int ok = 0;
#ifdef TANDEM_TEST_OPENCL
  if (m->kind == NATIVE_OPENCL && m->ev) {
    cl_event e = (cl_event)m->ev;
    ok = clWaitForEvents(1, &e) == CL_SUCCESS;
    CHECK_CL(clReleaseEvent(e));
  }
#endif
#ifdef TANDEM_TEST_CUDA
  if (m->kind == NATIVE_CUDA && m->ev) {
    ok = cudaEventSynchronize((cudaEvent_t)m->ev) == cudaSuccess;
    CHECK_CUDA(cudaEventDestroy((cudaEvent_t)m->ev));
  }
#endif
#ifdef TANDEM_TEST_SYCL
  if (m->kind == NATIVE_SYCL && m->ev) {
    ok = tsy_event_wait(m->ev) == 0;
    tsy_event_free(m->ev);
  }
#endif
  m->ev = NULL;
  return ok;
}

#endif /* TANDEM_TESTS_CONF_NATIVE_H */
