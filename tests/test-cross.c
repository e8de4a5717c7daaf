/* test-cross.c: device-side waits across backends. A queue of the device under test waits for
 * work on a cpu:0 queue and the other way round; tandem bridges the wait (a gate the event's
 * completion opens) without blocking the submitting thread. Registered for GPU backends (label
 * cuda-cpu for cuda:0) and OpenCL (both PoCL drivers). Random data, checked byte by byte. */
#include "harness.h"

enum { N = 1 << 20 };

struct check_arg {
  const unsigned char *got, *want;
  atomic_int ran;
};

static int check_task(void *p) {
  struct check_arg *a = p;
  CHECK_MEM_EQ(a->got, a->want, N);
  atomic_store(&a->ran, 1);
  return 0;
}

static tdm_device *cpu_device(tdm_device *dev) {
  tdm_device *cpu;
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  CHECK(cpu != dev);
  return cpu;
}

/* The device's queue waits for a host task on cpu:0 that fills the source of its copy; the
 * host task is held back until every submission has returned. The copy's source and the way
 * back are pinned memory of `owner`: the device's own, or cpu:0's, which to the device's
 * backend is host memory it never pinned. The copy must still read it in queue order, after
 * the wait (CUDA had taken cpu:0's for its own pinned memory, and cudaMemcpyAsync read it at
 * once, before the task had filled it); and cpu:0's way back is seen by a cpu:0 host task
 * that waits for the device's copy into it. */
static void gated_copy_through(tdm_device *dev, tdm_device *cpu, tdm_device *owner) {
  uint64_t rng = th_seed();
  tdm_queue *qd, *qc;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &qd));
  CHECK_OK(tdm_queue_create(cpu, TDM_QUEUE_IN_ORDER, &qc));
  unsigned char *want = malloc(N), *src, *back, *d;
  CHECK(want != NULL);
  th_fill_random(want, N, &rng);
  CHECK_OK(tdm_malloc(owner, TDM_MEM_PINNED, N, (void **)&src));
  CHECK_OK(tdm_malloc(owner, TDM_MEM_PINNED, N, (void **)&back));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, N, (void **)&d));
  memset(src, 0, N);
  memset(back, 0, N);
  th_gate gate;
  th_gate_init(&gate);
  th_gated_copy fa = {&gate, src, want, N};
  tdm_event *filled, *copied = NULL;
  CHECK_OK(tdm_host_task(qc, th_gated_copy_task, &fa, 0, NULL, &filled));
  CHECK_OK(tdm_queue_wait(qd, filled)); /* returns at once: the task is still held */
  CHECK_OK(tdm_memcpy(qd, d, src, N, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qd, back, d, N, TDM_COPY_D2H, 0, NULL, owner == cpu ? &copied : NULL));
  struct check_arg ca = {back, want, 0};
  if (copied) {
    CHECK_OK(tdm_queue_wait(qc, copied));
    CHECK_OK(tdm_host_task(qc, check_task, &ca, 0, NULL, NULL));
  } else {
    CHECK_RC(tdm_event_query(filled), TDM_EAGAIN);
  }
  th_gate_open(&gate);
  if (copied) {
    CHECK_OK(tdm_queue_sync(qc));
    CHECK(atomic_load(&ca.ran) == 1);
    CHECK_OK(tdm_event_release(copied));
  }
  CHECK_OK(tdm_queue_sync(qd));
  CHECK_MEM_EQ(back, want, N);
  CHECK_OK(tdm_event_release(filled));
  CHECK_OK(tdm_queue_destroy(qd));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  th_gate_destroy(&gate);
  free(want);
}

TEST_CASE(device_waits_for_cpu_task) {
  tdm_device *dev = th_open();
  gated_copy_through(dev, cpu_device(dev), dev);
  th_close();
}

TEST_CASE(device_copies_cpu_pinned_in_order) {
  tdm_device *dev = th_open(), *cpu = cpu_device(dev);
  gated_copy_through(dev, cpu, cpu);
  th_close();
}

/* A cpu:0 host task depends on the device's copies (a dependency list across backends) and
 * sees their result; a failed device-side wait would let it run early and see zeros. */
TEST_CASE(cpu_task_waits_for_device_copies) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open(), *cpu = cpu_device(dev);
  tdm_queue *qd, *qc;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &qd));
  CHECK_OK(tdm_queue_create(cpu, TDM_QUEUE_IN_ORDER, &qc));
  unsigned char *src, *back, *d;
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, N, (void **)&src));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_PINNED, N, (void **)&back));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, N, (void **)&d));
  th_fill_random(src, N, &rng);
  memset(back, 0, N);
  for (int round = 0; round < 8; round++) {
    tdm_event *landed;
    CHECK_OK(tdm_memcpy(qd, d, src, N, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(qd, back, d, N, TDM_COPY_D2H, 0, NULL, &landed));
    struct check_arg ca = {back, src, 0};
    tdm_event *checked;
    CHECK_OK(tdm_host_task(qc, check_task, &ca, 1, &landed, &checked));
    CHECK_OK(tdm_event_wait(checked));
    CHECK_EQ(atomic_load(&ca.ran), 1);
    CHECK_OK(tdm_event_release(landed));
    CHECK_OK(tdm_event_release(checked));
    CHECK_OK(tdm_queue_sync(qd));
    memset(back, 0, N);
    src[round] ^= 0x5a; /* a different pattern every round */
  }
  CHECK_OK(tdm_queue_destroy(qd));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  th_close();
}

/* A failure on cpu:0 reaches the device's queue through the bridge: its later commands
 * complete with TDM_EDEP and sync reports it once. */
static int fail_task(void *p) { return TDM_EINVAL; }

TEST_CASE(failure_crosses_backends) {
  tdm_device *dev = th_open(), *cpu = cpu_device(dev);
  tdm_queue *qd, *qc;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &qd));
  CHECK_OK(tdm_queue_create(cpu, TDM_QUEUE_IN_ORDER, &qc));
  tdm_event *bad, *after;
  CHECK_OK(tdm_host_task(qc, fail_task, NULL, 0, NULL, &bad));
  CHECK_OK(tdm_queue_wait(qd, bad));
  CHECK_OK(tdm_event_record(qd, &after));
  CHECK_RC(tdm_event_wait(bad), TDM_EINVAL);
  CHECK_RC(tdm_queue_sync(qd), TDM_EDEP);
  CHECK_OK(tdm_queue_sync(qd));
  CHECK_RC(tdm_queue_sync(qc), TDM_EINVAL);
  CHECK_OK(tdm_event_release(bad));
  CHECK_OK(tdm_event_release(after));
  CHECK_OK(tdm_queue_destroy(qd));
  CHECK_OK(tdm_queue_destroy(qc));
  th_close();
}

/* tdm_memcpy_cross between the device's memory and cpu:0's: with the copy on the device's
 * queue, cpu:0's memory is host memory to it and the data arrives both ways; with the copy on
 * cpu:0's queue, the CPU cannot reach the device's memory: TDM_ENOTSUP, nothing submitted. */
TEST_CASE(cross_copy_cpu_memory) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open(), *cpu = cpu_device(dev);
  tdm_queue *qd, *qc;
  CHECK_OK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &qd));
  CHECK_OK(tdm_queue_create(cpu, TDM_QUEUE_IN_ORDER, &qc));
  unsigned char *want = malloc(N), *c1, *c2, *d;
  CHECK(want != NULL);
  th_fill_random(want, N, &rng);
  CHECK_OK(tdm_malloc(cpu, TDM_MEM_DEVICE, N, (void **)&c1));
  CHECK_OK(tdm_malloc(cpu, TDM_MEM_DEVICE, N, (void **)&c2));
  CHECK_OK(tdm_malloc(dev, TDM_MEM_DEVICE, N, (void **)&d));
  memcpy(c1, want, N);
  memset(c2, 0, N);
  /* Host to device, then device to host, both on the device's queue; cpu:0's queue waits. */
  CHECK_OK(tdm_memcpy_cross(qd, qd, d, c1, N, 0, NULL, NULL));
  tdm_event *back = NULL;
  CHECK_OK(tdm_memcpy_cross(qd, qc, c2, d, N, 0, NULL, &back));
  CHECK_OK(tdm_queue_sync(qc)); /* cpu:0's queue waited for the copy */
  CHECK_OK(tdm_event_query(back));
  CHECK_MEM_EQ(c2, want, N);
  /* On cpu:0's queue, either way round: not reachable, unless the device's memory is host
   * memory (a SYCL CPU device), which cpu:0 then copies as pageable host memory. */
  tdm_event *eo = (tdm_event *)(uintptr_t)0x5e;
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(dev, &info));
  if (info.caps & TDM_DEVICE_CAP_HOST_MEMORY) {
    memset(c2, 0, N);
    CHECK_OK(tdm_memcpy_cross(qc, qd, d, c1, N, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy_cross(qc, qd, c2, d, N, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(qc));
    CHECK_MEM_EQ(c2, want, N);
  } else {
    CHECK_RC(tdm_memcpy_cross(qc, qd, d, c1, N, 0, NULL, &eo), TDM_ENOTSUP);
    CHECK_RC(tdm_memcpy_cross(qc, qd, c2, d, N, 0, NULL, &eo), TDM_ENOTSUP);
  }
  CHECK(eo == (tdm_event *)(uintptr_t)0x5e);
  CHECK_OK(tdm_queue_sync(qc));
  CHECK_OK(tdm_queue_sync(qd));
  CHECK_OK(tdm_event_release(back));
  CHECK_OK(tdm_queue_destroy(qd));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(c1));
  CHECK_OK(tdm_free(c2));
  CHECK_OK(tdm_free(d));
  free(want);
  th_close();
}
