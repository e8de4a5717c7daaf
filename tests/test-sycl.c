/* test-sycl.c: the requests' scenarios on the SYCL backend, with SYCL objects made as other code
 * makes them (tests/sycl-native.cpp): an OpenCL C kernel launched through the interop, as
 * llama.cpp's SYCL backend launches its kernels, and queues and USM of other code, as dpctl
 * and dpnp make them.
 *
 * The kernels spin long enough (hundreds of milliseconds) that "the host was not blocked" is
 * seen as "the kernel was still running when the call returned"; a machine slow enough to
 * finish it first makes that check inconclusive (printed), never a pass by timing. */
#include "conformance.h"
#include "sycl-native.h"

enum { N = 4096, VALUE = 1000 };
static const long SPINS = 1L << 17; /* per work-item: about half a second on a CPU device */

static void *native_queue(tdm_queue *q) {
  void *nq = NULL;
  CHECK_OK(tdm_queue_native(q, &nq));
  CHECK(nq != NULL);
  return nq;
}

static void check_filled(const int *h) {
  for (int i = 0; i < N; i++)
    CHECK_MSG(h[i] == VALUE + i, "element %d is %d, the kernel wrote %d", i, h[i], VALUE + i);
}

/* Two backend instances on one device get two queues, not one shared; a slow kernel on the
 * first (launched on its native queue, as a backend's own kernels are) and a copy on the second
 * ordered after it by a device-side wait: the copy reads the kernel's result, and neither the
 * record nor the wait blocked the host. */
TEST_CASE(two_instances_overlap) {
  tdm_device *dev = th_open();
  tdm_queue *compute = new_queue(dev, TDM_QUEUE_IN_ORDER), *copy = new_queue(dev, 0);
  CHECK(native_queue(compute) != native_queue(copy));
  int *d = dev_alloc(dev, TDM_MEM_DEVICE, N * sizeof(int));
  int *h = dev_alloc(dev, TDM_MEM_PINNED, N * sizeof(int));
  memset(h, 0, N * sizeof(int));
  void *kernel = tsy_slow_fill(native_queue(compute), d, N, VALUE, SPINS);
  CHECK(kernel != NULL);
  tdm_event *done;
  CHECK_OK(tdm_event_record(compute, &done)); /* covers the kernel tandem never saw */
  CHECK_OK(tdm_queue_wait(copy, done));
  tdm_event *copied;
  CHECK_OK(tdm_memcpy(copy, h, d, N * sizeof(int), TDM_COPY_D2H, 0, NULL, &copied));
  int running = tsy_event_pending(kernel);
  CHECK(running >= 0);
  printf("the kernel was %s when the wait and the copy had been submitted\n",
         running ? "still running (the host was not blocked)" : "done already (inconclusive)");
  CHECK_OK(tdm_event_wait(copied));
  CHECK(tsy_event_pending(kernel) == 0);
  check_filled(h);
  CHECK_OK(tdm_event_release(copied));
  CHECK_OK(tdm_event_release(done));
  CHECK(tsy_event_wait(kernel) == 0);
  tsy_event_free(kernel);
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_queue_destroy(compute));
  CHECK_OK(tdm_queue_destroy(copy));
  th_close();
}

/* The dpctl user's scenario: a queue of other code, adopted; a kernel submitted to it
 * directly and never registered with tandem; tdm_queue_sync still returns only after it, and
 * the host reads its result at once. Also the order manager's view: the dependencies tandem
 * names for the queue cover it. */
TEST_CASE(adopted_queue_sync_covers_foreign_kernel) {
  tdm_device *dev = th_open();
  void *ctx = NULL;
  CHECK_OK(tdm_device_native(dev, &ctx));
  for (int ooo = 0; ooo < 2; ooo++) {
    void *fq = tsy_queue_new(ctx, ooo);
    CHECK(fq != NULL);
    tdm_queue *q;
    CHECK_OK(tdm_queue_adopt(dev, fq, ooo ? TDM_QUEUE_OUT_OF_ORDER : 0, &q));
    CHECK(native_queue(q) == fq);
    int *u = tsy_malloc_device(ctx, N * sizeof(int)); /* dpnp's array, say */
    int *h = dev_alloc(dev, TDM_MEM_PINNED, N * sizeof(int));
    void *mem = NULL;
    CHECK_OK(tdm_mem_import(dev, u, N * sizeof(int), &mem));
    CHECK(mem == u);
    void *kernel = tsy_slow_fill(fq, u, N, VALUE, SPINS);
    CHECK(kernel != NULL);
    CHECK_OK(tdm_queue_sync(q));
    CHECK_MSG(tsy_event_pending(kernel) == 0, "tdm_queue_sync returned before the kernel ended");
    /* tandem's copy of the foreign USM, ordered after the kernel by the sync above, and the
     * kernel's result read at once. */
    CHECK_OK(tdm_memcpy(q, h, mem, N * sizeof(int), TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    check_filled(h);
    /* A second unregistered kernel: a marker recorded after it completes after it. */
    void *k2 = tsy_slow_fill(fq, u, N, VALUE + 1, SPINS / 4);
    tdm_event *m;
    CHECK_OK(tdm_event_record(q, &m));
    CHECK_OK(tdm_event_wait(m));
    CHECK_OK(tdm_event_release(m));
    CHECK_MSG(tsy_event_pending(k2) == 0, "the marker completed before the kernel");
    CHECK(tsy_event_wait(kernel) == 0 && tsy_event_wait(k2) == 0);
    tsy_event_free(kernel);
    tsy_event_free(k2);
    CHECK_OK(tdm_free(mem)); /* forgotten, not freed: the USM is its owner's */
    CHECK_OK(tdm_queue_destroy(q));
    tsy_free(ctx, u);
    tsy_queue_free(fq);
    CHECK_OK(tdm_free(h));
  }
  th_close();
}

/* A foreign sycl::event (dpctl's SyclEvent) imported: a tandem queue waits for it on the
 * device, and the caller may free its own copy at once. */
TEST_CASE(import_foreign_kernel_event) {
  tdm_device *dev = th_open();
  void *ctx = NULL;
  CHECK_OK(tdm_device_native(dev, &ctx));
  void *fq = tsy_queue_new(ctx, 0);
  int *u = tsy_malloc_device(ctx, N * sizeof(int));
  int *h = dev_alloc(dev, TDM_MEM_PINNED, N * sizeof(int));
  void *mem;
  CHECK_OK(tdm_mem_import(dev, u, N * sizeof(int), &mem));
  void *kernel = tsy_slow_fill(fq, u, N, VALUE, SPINS / 2);
  tdm_event *ev;
  CHECK_OK(tdm_event_import(dev, kernel, &ev));
  tsy_event_free(kernel); /* the caller's copy may go at once: tandem keeps its own */
  tdm_queue *q = new_queue(dev, 0);
  CHECK_OK(tdm_queue_wait(q, ev));
  CHECK_OK(tdm_memcpy(q, h, mem, N * sizeof(int), TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  check_filled(h);
  CHECK_OK(tdm_event_release(ev));
  CHECK_OK(tdm_free(mem));
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_queue_destroy(q));
  tsy_free(ctx, u);
  tsy_queue_free(fq);
  th_close();
}
