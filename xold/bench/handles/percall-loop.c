/* percall-loop.c: the per-call cost of a record (tdm_event_record + tdm_event_release) and of
 * a device-side wait for a pending event of another queue (tdm_queue_wait), in a form that
 * callgrind can count: each loop is a function of its own, so --toggle-collect=<loop> gives
 * the instructions of its calls on the calling thread. On an OpenCL device it also runs the
 * raw calls they stand for (clEnqueueMarkerWithWaitList + clReleaseEvent,
 * clEnqueueBarrierWithWaitList on a pending event), on queues of its own in the context tandem
 * exports. bench/results/pocl-percall-instructions.json holds the figures and how they were taken.
 *
 * Build (not part of the CMake build; it needs only the installed headers and libtandem):
 *   cc -O2 -g -Iinclude bench/handles/percall-loop.c -Lbuild -ltandem -lOpenCL \
 *      -Wl,-rpath,$PWD/build -o build/percall-loop
 * Run: build/percall-loop DEVICE [N], e.g. opencl:0 or cpu:0; N calls per loop. */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <tandem.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NOINLINE __attribute__((noinline))

static atomic_int open_gate;

/* Holds a queue until main opens the gate, so the events recorded behind it stay pending. */
static int hold(void *arg) {
  (void)arg;
  const struct timespec nap = {0, 20000};
  while (!atomic_load(&open_gate)) nanosleep(&nap, NULL);
  return 0;
}

NOINLINE static int tandem_records(tdm_queue *q, long n) {
  for (long i = 0; i < n; i++) {
    tdm_event *ev;
    if (tdm_event_record(q, &ev) || tdm_event_release(ev)) return -1;
  }
  return 0;
}

NOINLINE static int tandem_waits(tdm_queue *q, tdm_event **ev, long n) {
  for (long i = 0; i < n; i++)
    if (tdm_queue_wait(q, ev[i])) return -1;
  return 0;
}

/* The same calls, untimed: the first pass grows the queue's pools of commands and events to
 * n (every wait is pending, so none comes back before the pass ends), as the first repetition
 * of a benchmark does. Written apart from tandem_waits so that callgrind tells them apart
 * (and walks backwards, so the compiler does not fold the two into one). */
NOINLINE static int warm_waits(tdm_queue *q, tdm_event **ev, long n) {
  for (long i = n - 1; i >= 0; i--)
    if (tdm_queue_wait(q, ev[i])) return -1;
  return 0;
}

NOINLINE static int raw_records(cl_command_queue q, long n) {
  for (long i = 0; i < n; i++) {
    cl_event ev;
    if (clEnqueueMarkerWithWaitList(q, 0, NULL, &ev) != CL_SUCCESS) return -1;
    clReleaseEvent(ev);
  }
  return 0;
}

NOINLINE static int raw_waits(cl_command_queue q, cl_event *ev, long n) {
  for (long i = 0; i < n; i++)
    if (clEnqueueBarrierWithWaitList(q, 1, &ev[i], NULL) != CL_SUCCESS) return -1;
  return 0;
}

/* The same calls, untimed, for the first batch, which grows the queue's pools. */
NOINLINE static int warm_records(tdm_queue *q, long n) {
  for (long i = n - 1; i >= 0; i--) {
    tdm_event *ev;
    if (tdm_event_record(q, &ev) || tdm_event_release(ev)) return -1;
  }
  return 0;
}

/* Records and releases in batches of 500 with a sync after each, as bench-cuda overhead does,
 * after three untimed batches. */
static int tandem_record_phase(tdm_queue *q, long n) {
  for (int i = 0; i < 3; i++)
    if (warm_records(q, 500) || tdm_queue_sync(q)) return -1;
  for (long done = 0; done < n; done += 500) {
    if (tandem_records(q, n - done < 500 ? n - done : 500) || tdm_queue_sync(q)) return -1;
  }
  return 0;
}

/* B waits for n pending events of A (held behind a host task); warm: the untimed pass. */
static int tandem_wait_phase(tdm_queue *a, tdm_queue *b, long n, bool warm) {
  tdm_event **ev = calloc((size_t)n, sizeof *ev);
  if (!ev) return -1;
  atomic_store(&open_gate, 0);
  int rc = tdm_host_task(a, hold, NULL, 0, NULL, NULL);
  long k = 0;
  for (; !rc && k < n; k++) rc = tdm_event_record(a, &ev[k]);
  if (!rc) rc = warm ? warm_waits(b, ev, n) : tandem_waits(b, ev, n);
  atomic_store(&open_gate, 1);
  for (long i = 0; i < k; i++) tdm_event_release(ev[i]);
  free(ev);
  if (tdm_queue_sync(a) || tdm_queue_sync(b)) rc = -1;
  return rc;
}

static int raw_phases(tdm_device *d, long n) {
  cl_context cx;
  cl_device_id dev;
  if (tdm_device_native(d, (void **)&cx) ||
      clGetContextInfo(cx, CL_CONTEXT_DEVICES, sizeof dev, &dev, NULL) != CL_SUCCESS)
    return -1;
  cl_int err;
  cl_command_queue a = clCreateCommandQueue(cx, dev, 0, &err);
  cl_command_queue b = a ? clCreateCommandQueue(cx, dev, 0, &err) : NULL;
  cl_event gate = b ? clCreateUserEvent(cx, &err) : NULL;
  cl_event *ev = calloc((size_t)n, sizeof *ev);
  int rc = gate && ev ? 0 : -1;
  for (long done = 0; !rc && done < n; done += 500)
    rc = raw_records(a, n - done < 500 ? n - done : 500) || clFinish(a) != CL_SUCCESS ? -1 : 0;
  long k = 0;
  for (; !rc && k < n; k++)
    if (clEnqueueMarkerWithWaitList(a, 1, &gate, &ev[k]) != CL_SUCCESS) rc = -1;
  if (!rc) clFlush(a); /* once, as tandem flushes the producer of a cross-queue wait */
  if (!rc) rc = raw_waits(b, ev, n);
  if (gate) {
    clSetUserEventStatus(gate, CL_COMPLETE);
    clReleaseEvent(gate);
  }
  for (long i = 0; i < k; i++) clReleaseEvent(ev[i]);
  free(ev);
  if (b) {
    clFinish(b);
    clReleaseCommandQueue(b);
  }
  if (a) {
    clFinish(a);
    clReleaseCommandQueue(a);
  }
  return rc;
}

int main(int argc, char **argv) {
  const char *id = argc > 1 ? argv[1] : "cpu:0";
  long n = argc > 2 ? atol(argv[2]) : 10000;
  tdm_device *d;
  tdm_queue *a, *b;
  if (n < 1 || tdm_init() || tdm_device_find(id, &d) || tdm_queue_create(d, 0, &a) ||
      tdm_queue_create(d, 0, &b)) {
    fprintf(stderr, "percall-loop: %s\n", tdm_last_error());
    return 1;
  }
  int rc = tandem_record_phase(a, n) || tandem_wait_phase(a, b, n, true) ||
           tandem_wait_phase(a, b, n, false);
  if (!rc && strncmp(id, "opencl:", 7) == 0) rc = raw_phases(d, n);
  if (rc) fprintf(stderr, "percall-loop: failed: %s\n", tdm_last_error());
  tdm_queue_destroy(b);
  tdm_queue_destroy(a);
  return (tdm_shutdown() || rc) ? 2 : 0;
}
