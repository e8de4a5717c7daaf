/* test-conf-import.c: conformance, imported native events (tdm_event_import): a native event
 * of other code, pending, completed or failed, orders tandem's work like one of its own; CPU
 * devices refuse imports. The native events come from tests/conf-native.h. */
#include "conformance.h"
#include "conf-native.h"


/* Live objects come back to the baseline: the last references may be dropped on tandem's
 * threads just after the waits the test made return. */
static void check_stats_back(const tdm_stats *base) {
  tdm_stats now;
  for (int waited = 0;; waited++) {
    CHECK_OK(tdm_stats_get(&now));
    if (now.events == base->events && now.pending == base->pending &&
        now.queues == base->queues && now.allocations == base->allocations)
      return;
    CHECK_MSG(waited < TH_HANG_MS, "stats: %ld events, %ld pending, %ld queues, %ld allocations; "
              "baseline %ld, %ld, %ld, %ld", now.events, now.pending, now.queues,
              now.allocations, base->events, base->pending, base->queues, base->allocations);
    th_sleep_ms(1);
  }
}

/* A CPU device refuses imports; returns whether dev is one (and the case is over). */
static int import_cpu_refuses(tdm_device *dev, enum native_kind kind) {
  if (kind != NATIVE_NONE) return 0;
  int dummy = 0;
  tdm_event *ev = (tdm_event *)(uintptr_t)0x5e;
  CHECK_RC(tdm_event_import(dev, &dummy, &ev), TDM_ENOTSUP);
  CHECK(ev == (tdm_event *)(uintptr_t)0x5e);
  th_close();
  return 1;
}

/* OpenCL: the event of a command that other code enqueued on its own queue in the device's
 * context (as pyopencl does), imported: a tandem copy that depends on it reads what the
 * command wrote. */
static void import_foreign_command(tdm_device *dev, tdm_queue *q, size_t n, uint64_t *rng) {
#ifdef TANDEM_TEST_OPENCL
  cl_device_id id;
  cl_context ctx = device_context(dev);
  CHECK_CL(clGetContextInfo(ctx, CL_CONTEXT_DEVICES, sizeof id, &id, NULL));
  cl_int err = CL_SUCCESS;
  cl_command_queue uq = clCreateCommandQueue(ctx, id, 0, &err);
  CHECK_MSG(uq && err == CL_SUCCESS, "clCreateCommandQueue: %d", err);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *back = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *mem = NULL;
  size_t off = 0;
  th_fill_random(src, n, rng);
  memset(back, 0, n);
  CHECK_OK(tdm_mem_native(d, &mem, &off));
  cl_event wev = NULL;
  CHECK_CL(clEnqueueWriteBuffer(uq, (cl_mem)mem, CL_FALSE, off, n, src, 0, NULL, &wev));
  tdm_event *imp = NULL;
  CHECK_OK(tdm_event_import(dev, wev, &imp));
  CHECK_CL(clReleaseEvent(wev)); /* tandem holds its own references */
  CHECK_OK(tdm_memcpy(q, back, d, n, TDM_COPY_D2H, 1, &imp, NULL));
  CHECK_OK(tdm_event_release(imp));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(back, src, n);
  CHECK_CL(clFinish(uq));
  CHECK_CL(clReleaseCommandQueue(uq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
#else
  (void)dev, (void)q, (void)n, (void)rng;
#endif
}

struct import_task {
  tdm_event *imp;
  atomic_int ran, saw_done;
};

static int task_check_import(void *arg) {
  struct import_task *t = arg;
  atomic_store(&t->saw_done, tdm_event_query(t->imp) == 0);
  atomic_fetch_add(&t->ran, 1);
  return 0;
}

static void check_device_holds(tdm_queue *q, unsigned char *back, const void *d,
                               const unsigned char *want, size_t n) {
  read_device(q, back, d, n);
  CHECK_MEM_EQ(back, want, n);
}

/* An imported native event in a dependency list, a device-side wait, a host task of cpu:0
 * (the bridge between backends) and a tracker: all of them wait until the test completes the
 * native event, then the data arrives. A second import of the same event is released while
 * pending; an import of an event that already completed completes at once, whatever other
 * imports are still pending. */
TEST_CASE(import_event) {
  const size_t n = (1u << 20) + 3;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  if (import_cpu_refuses(dev, kind)) return;
  tdm_device *cpu = NULL;
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));

  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *q3 = new_queue(dev, TDM_QUEUE_IN_ORDER), *q4 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *cq = new_queue(cpu, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *src2 = dev_alloc(dev, TDM_MEM_PINNED, n);
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, n), *pattern = malloc(n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *d2 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);
  th_fill_random(src2, n, &rng);
  memset(pattern, 0x5a, n);
  CHECK_OK(tdm_memset(q3, d, 0x5a, n, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q3, d2, 0x5a, n, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q3));

  struct native_ev a;
  native_pending(dev, kind, &a);
  void *orig = a.ev;
  tdm_event *imp = NULL, *imp2 = NULL;
  CHECK_OK(tdm_event_import(dev, a.ev, &imp));
  CHECK_OK(tdm_event_import(dev, a.ev, &imp2));
  CHECK(imp != NULL && imp2 != NULL && imp != imp2);
  native_after_import(&a);
  void *exported = NULL;
  CHECK_OK(tdm_event_native(imp, &exported));
  native_check_export(&a, exported, orig);
  tdm_queue *owner = NULL;
  CHECK_RC(tdm_event_queue(imp, &owner), TDM_ENOTSUP);
  CHECK(owner == NULL);

  tdm_event *copy_ev = NULL, *wait_ev = NULL, *task_ev = NULL;
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 1, &imp2, &copy_ev));
  CHECK_OK(tdm_event_release(imp2)); /* tandem keeps what the copy needs */
  CHECK_RC(tdm_event_release(imp2), TDM_EHANDLE);
  CHECK_OK(tdm_queue_wait(q2, imp));
  CHECK_OK(tdm_memcpy(q2, d2, src2, n, TDM_COPY_H2D, 0, NULL, &wait_ev));
  struct import_task t = {.imp = imp};
  CHECK_OK(tdm_host_task(cq, task_check_import, &t, 1, &imp, &task_ev));
  CHECK_OK(tdm_queue_track(q4, imp));
  tdm_event *deps[4] = {NULL};
  size_t ndeps = 0;
  CHECK_OK(tdm_queue_dependencies(q4, deps, 4, &ndeps));
  CHECK_EQ(ndeps, 1);
  CHECK(deps[0] == imp);
  CHECK_OK(tdm_event_release(deps[0]));

  /* Another import, of an event that has completed: it does not wait behind the first. */
  struct native_ev b;
  native_completed(dev, kind, &b);
  tdm_event *imp_b = NULL;
  CHECK_OK(tdm_event_import(dev, b.ev, &imp_b));
  CHECK_OK(tdm_event_wait(imp_b));
  CHECK_OK(tdm_event_release(imp_b));
  native_free(&b);

  th_sleep_ms(50); /* makes a wrong order likelier to show; the checks do not depend on it */
  CHECK_RC(tdm_event_query(imp), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(copy_ev), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(wait_ev), TDM_EAGAIN);
  CHECK_RC(tdm_event_query(task_ev), TDM_EAGAIN);
  CHECK_EQ(atomic_load(&t.ran), 0);
  check_device_holds(q3, back, d, pattern, n); /* nothing arrived */
  check_device_holds(q3, back, d2, pattern, n);

  native_complete(&a, 0);
  CHECK_OK(tdm_event_wait(imp));
  CHECK_OK(tdm_event_wait(copy_ev));
  CHECK_OK(tdm_event_wait(wait_ev));
  CHECK_OK(tdm_event_wait(task_ev));
  CHECK_EQ(atomic_load(&t.ran), 1);
  CHECK_EQ(atomic_load(&t.saw_done), 1);
  check_device_holds(q, back, d, src, n);
  check_device_holds(q2, back, d2, src2, n);
  CHECK_OK(tdm_queue_sync(q4));
  if (kind == NATIVE_OPENCL) import_foreign_command(dev, q, n, &rng);

  CHECK_OK(tdm_event_release(copy_ev));
  CHECK_OK(tdm_event_release(wait_ev));
  CHECK_OK(tdm_event_release(task_ev));
  CHECK_OK(tdm_event_release(imp));
  CHECK_RC(tdm_event_release(imp), TDM_EHANDLE);
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(q2));
  CHECK_OK(tdm_queue_destroy(q3));
  CHECK_OK(tdm_queue_destroy(q4));
  CHECK_OK(tdm_queue_destroy(cq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(src2));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(d2));
  free(pattern);
  native_free_queue(&a);
  check_stats_back(&base);
  native_free(&a);
  th_close();
}

/* A native event that reports a failure (an OpenCL user event set below 0) fails its import
 * with TDM_EBACKEND and the native status; what depends on it, on the same device or through
 * the bridge to cpu:0, completes with TDM_EDEP without running; the queues stay usable. */
TEST_CASE(import_event_failed) {
  const size_t n = 65537;
  const int status = -1234;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  if (kind != NATIVE_OPENCL) TH_SKIP("only an OpenCL event can report a failure");
  tdm_device *cpu = NULL;
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER), *q2 = new_queue(dev, TDM_QUEUE_IN_ORDER);
  tdm_queue *cq = new_queue(cpu, TDM_QUEUE_IN_ORDER);
  unsigned char *src = dev_alloc(dev, TDM_MEM_PINNED, n), *back = dev_alloc(dev, TDM_MEM_PINNED, n);
  unsigned char *back2 = dev_alloc(dev, TDM_MEM_PINNED, n);
  /* Native work queued behind the failure may still run (tandem reports it TDM_EDEP all the
   * same), so no two queues touch the same memory. */
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n), *d2 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  void *d3 = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src, n, &rng);

  struct native_ev a;
  native_pending(dev, kind, &a);
  tdm_event *imp = NULL, *copy_ev = NULL, *after_ev = NULL, *wait_ev = NULL, *task_ev = NULL;
  CHECK_OK(tdm_event_import(dev, a.ev, &imp));
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 1, &imp, &copy_ev));
  CHECK_OK(tdm_memset(q, d, 0, n, 0, NULL, &after_ev)); /* behind the failure in queue order */
  CHECK_OK(tdm_queue_wait(q2, imp));
  CHECK_OK(tdm_memset(q2, d2, 0, n, 0, NULL, &wait_ev));
  struct import_task t = {.imp = imp};
  CHECK_OK(tdm_host_task(cq, task_check_import, &t, 1, &imp, &task_ev));
  tdm_queue *qo = NULL;
  tdm_event *ooo_ev = NULL;
  if (has_cap(dev, TDM_DEVICE_CAP_OUT_OF_ORDER)) {
    qo = new_queue(dev, TDM_QUEUE_OUT_OF_ORDER);
    CHECK_OK(tdm_memcpy(qo, back2, d3, n, TDM_COPY_D2H, 1, &imp, &ooo_ev));
  }
  CHECK_RC(tdm_event_query(imp), TDM_EAGAIN);

  native_complete(&a, status);
  CHECK_RC(tdm_event_wait(imp), TDM_EBACKEND);
  CHECK_EQ(tdm_last_native_error(), status);
  CHECK_RC(tdm_event_wait(copy_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(after_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(wait_ev), TDM_EDEP);
  CHECK_RC(tdm_event_wait(task_ev), TDM_EDEP);
  CHECK_EQ(atomic_load(&t.ran), 0);
  if (qo) {
    CHECK_RC(tdm_event_wait(ooo_ev), TDM_EDEP);
    CHECK_OK(tdm_event_release(ooo_ev));
    CHECK_RC(tdm_queue_destroy(qo), TDM_EDEP);
  }
  CHECK_RC(tdm_queue_sync(q), TDM_EDEP);
  CHECK_RC(tdm_queue_sync(q2), TDM_EDEP);
  CHECK_RC(tdm_queue_sync(cq), TDM_EDEP);

  /* Reported and cleared: the queues work again. */
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  check_device_holds(q, back, d, src, n);
  CHECK_OK(tdm_host_task(cq, task_count, &t.ran, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(cq));
  CHECK_EQ(atomic_load(&t.ran), 1);
  CHECK_OK(tdm_queue_sync(q2));

  tdm_event *evs[] = {imp, copy_ev, after_ev, wait_ev, task_ev};
  for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++) CHECK_OK(tdm_event_release(evs[i]));
  CHECK_OK(tdm_queue_destroy(q));
  CHECK_OK(tdm_queue_destroy(q2));
  CHECK_OK(tdm_queue_destroy(cq));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(back2));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(d2));
  CHECK_OK(tdm_free(d3));
  check_stats_back(&base);
  native_free(&a);
  th_close();
}

/* Bad arguments, an OpenCL event of another context, injected faults (each a clean error that
 * leaves nothing behind, until the import succeeds) and a lost device. */
TEST_CASE(import_event_errors) {
  int dummy = 0;
  tdm_event *const sentinel = (tdm_event *)(uintptr_t)0x5e;
  tdm_event *ev = sentinel;
  CHECK_RC(tdm_event_import(NULL, &dummy, &ev), TDM_ENOTINIT);
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  CHECK_RC(tdm_event_import(dev, NULL, &ev), TDM_EINVAL);
  CHECK_RC(tdm_event_import(dev, &dummy, NULL), TDM_EINVAL);
  CHECK_RC(tdm_event_import(NULL, &dummy, &ev), TDM_EINVAL);
  CHECK_RC(tdm_event_import((tdm_device *)&dummy, &dummy, &ev), TDM_EHANDLE);
  CHECK(ev == sentinel);
  if (import_cpu_refuses(dev, kind)) return;

#ifdef TANDEM_TEST_OPENCL
  if (kind == NATIVE_OPENCL) {
    cl_device_id id;
    CHECK_CL(clGetContextInfo(device_context(dev), CL_CONTEXT_DEVICES, sizeof id, &id, NULL));
    cl_int err = CL_SUCCESS;
    cl_context other = clCreateContext(NULL, 1, &id, NULL, NULL, &err);
    CHECK_MSG(other && err == CL_SUCCESS, "clCreateContext: %d", err);
    cl_event foreign = clCreateUserEvent(other, &err);
    CHECK_MSG(foreign && err == CL_SUCCESS, "clCreateUserEvent: %d", err);
    CHECK_RC(tdm_event_import(dev, foreign, &ev), TDM_EXDEV);
    CHECK(ev == sentinel);
    CHECK_CL(clSetUserEventStatus(foreign, CL_COMPLETE));
    CHECK_CL(clReleaseEvent(foreign));
    CHECK_CL(clReleaseContext(other));
  }
#endif

  tdm_stats base;
  CHECK_OK(tdm_stats_get(&base));
  static const unsigned kinds[] = {TDM_FAULT_ALLOC, TDM_FAULT_BACKEND,
                                   TDM_FAULT_ALLOC | TDM_FAULT_BACKEND};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    for (long nth = 0;; nth++) {
      CHECK_MSG(nth < 1000, "the import never succeeded");
      struct native_ev c;
      native_completed(dev, kind, &c);
      ev = sentinel;
      CHECK_OK(tdm_fault_inject(kinds[k], nth, 0));
      int rc = tdm_event_import(dev, c.ev, &ev);
      int fired = tdm_fault_fired();
      CHECK_OK(tdm_fault_inject(0, -1, 0));
      if (rc == 0) {
        CHECK(!fired);
        CHECK_OK(tdm_event_wait(ev));
        CHECK_OK(tdm_event_release(ev));
      } else {
        CHECK(fired);
        CHECK_MSG(rc == TDM_ENOMEM || rc == TDM_EBACKEND, "injected fault %ld gave %s", nth,
                  tdm_err_name(rc));
        CHECK(ev == sentinel);
      }
      check_stats_back(&base);
      native_free(&c);
      if (rc == 0) break;
    }
  }

  /* A backend call that reports a lost device marks it lost, as a real one would. */
  struct native_ev c;
  native_completed(dev, kind, &c);
  ev = sentinel;
  CHECK_OK(tdm_fault_inject(TDM_FAULT_BACKEND, 0, TDM_EDEVLOST));
  CHECK_RC(tdm_event_import(dev, c.ev, &ev), TDM_EDEVLOST);
  CHECK_OK(tdm_fault_inject(0, -1, 0));
  CHECK_RC(tdm_event_import(dev, c.ev, &ev), TDM_EDEVLOST);
  CHECK(ev == sentinel);
  native_free(&c);
  th_close();
}

/* ---- Native work behind a device-side wait ----------------------------------------------
 * tdm_queue_wait orders the native queue itself: a marker that other code enqueues on
 * tdm_queue_native() after the wait completes only once the awaited event has (tandem.h).
 * The awaited event is a host task's, held back by a gate; on an in-order native queue it is
 * waited for without a command of tandem's. CPU devices have no native marker to enqueue;
 * devices with TDM_DEVICE_CAP_HOST_DEFERRAL hold such a wait in tandem instead (tandem/opencl.h):
 * both skip. */
TEST_CASE(wait_orders_native_work) {
  tdm_device *dev = th_open();
  enum native_kind kind = native_kind_of(dev);
  if (kind == NATIVE_NONE) TH_SKIP("%s has no native marker for other code to enqueue",
                                   th_backend_of(dev));
  if (has_cap(dev, TDM_DEVICE_CAP_HOST_DEFERRAL))
    TH_SKIP("host-side deferral holds a wait for a host task in tandem, not on the native queue");
  tdm_queue *qa = new_queue(dev, TDM_QUEUE_IN_ORDER), *qb = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate gate;
  th_gate_init(&gate);
  tdm_event *ea = NULL;
  CHECK_OK(tdm_host_task(qa, task_wait_gate, &gate, 0, NULL, &ea));
  CHECK_OK(tdm_queue_wait(qb, ea));
  struct native_mark m;
  native_mark_enqueue(qb, kind, &m);
  th_sleep_ms(50); /* makes a wrong order likelier to show; the checks do not depend on it */
  int pending = native_mark_pending(&m);
  CHECK_RC(tdm_event_query(ea), TDM_EAGAIN);
  th_gate_open(&gate);
  int done = native_mark_finish(&m);
  CHECK_MSG(pending, "native work enqueued after tdm_queue_wait completed before the event it "
                     "waited for");
  CHECK(done);
  wait_ok(ea);
  CHECK_OK(tdm_queue_sync(qb));
  CHECK_OK(tdm_queue_destroy(qa));
  CHECK_OK(tdm_queue_destroy(qb));
  th_gate_destroy(&gate);
  th_close();
}
