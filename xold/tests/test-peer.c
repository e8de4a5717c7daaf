/* test-peer.c: two devices of one backend (cuda:0 and cuda:1). Peer copies in both forms (a
 * queue pulling another device's memory, and tdm_memcpy_cross handing the copy to the other
 * device's queue) and device-side waits across devices, whose event is held pending by a
 * cpu:0 host task so that the wait is known to be submitted before its event completes.
 * Skipped when the second device is absent. Random data, checked byte by byte. */
#include "harness.h"

enum { N = 4 << 20, ROUNDS = 6 };

/* The case's device and the next device of the same backend ("cuda:0" -> "cuda:1"). */
static void open_pair(tdm_device **a, tdm_device **b) {
  *a = th_open();
  char id[64];
  size_t len = strcspn(th_device_id, ":");
  snprintf(id, sizeof id, "%.*s:%d", (int)len, th_device_id, atoi(th_device_id + len + 1) + 1);
  int rc = tdm_device_find(id, b);
  if (rc == TDM_ENODEV) TH_SKIP("no second device %s (this case needs two)", id);
  CHECK_OK(rc);
  CHECK(*a != *b);
}

/* q0 (device 0) pulls device 1's memory into its own: a D2D copy whose source is a peer. */
TEST_CASE(peer_pull) {
  uint64_t rng = th_seed();
  tdm_device *d0, *d1;
  open_pair(&d0, &d1);
  tdm_queue *q0, *q1;
  CHECK_OK(tdm_queue_create(d0, TDM_QUEUE_IN_ORDER, &q0));
  CHECK_OK(tdm_queue_create(d1, TDM_QUEUE_IN_ORDER, &q1));
  unsigned char *src, *back, *m0, *m1;
  CHECK_OK(tdm_malloc(d1, TDM_MEM_PINNED, N, (void **)&src));
  CHECK_OK(tdm_malloc(d0, TDM_MEM_PINNED, N, (void **)&back));
  CHECK_OK(tdm_malloc(d0, TDM_MEM_DEVICE, N, (void **)&m0));
  CHECK_OK(tdm_malloc(d1, TDM_MEM_DEVICE, N, (void **)&m1));
  for (int r = 0; r < ROUNDS; r++) {
    th_fill_random(src, N, &rng);
    memset(back, 0, N);
    tdm_event *landed;
    CHECK_OK(tdm_memcpy(q1, m1, src, N, TDM_COPY_H2D, 0, NULL, &landed));
    CHECK_OK(tdm_memcpy(q0, m0, m1, N, TDM_COPY_D2D, 1, &landed, NULL));
    CHECK_OK(tdm_memcpy(q0, back, m0, N, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q0));
    CHECK_MEM_EQ(back, src, N);
    CHECK_OK(tdm_event_release(landed));
  }
  CHECK_OK(tdm_queue_destroy(q0));
  CHECK_OK(tdm_queue_destroy(q1));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(m0));
  CHECK_OK(tdm_free(m1));
  th_close();
}

/* tdm_memcpy_cross from device 0's queue into device 1's memory; device 1's queue reads it
 * back with no explicit wait (the cross copy orders it), both directions in turn. */
TEST_CASE(peer_cross_copy) {
  uint64_t rng = th_seed();
  tdm_device *d0, *d1;
  open_pair(&d0, &d1);
  tdm_queue *q[2];
  CHECK_OK(tdm_queue_create(d0, TDM_QUEUE_IN_ORDER, &q[0]));
  CHECK_OK(tdm_queue_create(d1, TDM_QUEUE_IN_ORDER, &q[1]));
  unsigned char *src, *back, *m[2];
  CHECK_OK(tdm_malloc(d0, TDM_MEM_PINNED, N, (void **)&src));
  CHECK_OK(tdm_malloc(d1, TDM_MEM_PINNED, N, (void **)&back));
  CHECK_OK(tdm_malloc(d0, TDM_MEM_DEVICE, N, (void **)&m[0]));
  CHECK_OK(tdm_malloc(d1, TDM_MEM_DEVICE, N, (void **)&m[1]));
  for (int r = 0; r < ROUNDS; r++) {
    int a = r & 1, b = !a; /* from device a to device b */
    th_fill_random(src, N, &rng);
    memset(back, 0, N);
    CHECK_OK(tdm_memcpy(q[a], m[a], src, N, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy_cross(q[a], q[b], m[b], m[a], N, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q[b], back, m[b], N, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q[b]));
    CHECK_MEM_EQ(back, src, N);
    CHECK_OK(tdm_queue_sync(q[a]));
  }
  CHECK_OK(tdm_queue_destroy(q[0]));
  CHECK_OK(tdm_queue_destroy(q[1]));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(m[0]));
  CHECK_OK(tdm_free(m[1]));
  th_close();
}

/* Device 1's queue waits device-side for an event of device 0's queue that is still pending
 * (device 0 waits for a held cpu:0 task) and then copies what device 0 produced: a wait that
 * did not hold device 1 back would copy zeros. */
TEST_CASE(cross_device_wait) {
  uint64_t rng = th_seed();
  tdm_device *d0, *d1, *cpu;
  open_pair(&d0, &d1);
  CHECK_OK(tdm_device_find("cpu:0", &cpu));
  tdm_queue *q0, *q1, *qc;
  CHECK_OK(tdm_queue_create(d0, TDM_QUEUE_IN_ORDER, &q0));
  CHECK_OK(tdm_queue_create(d1, TDM_QUEUE_IN_ORDER, &q1));
  CHECK_OK(tdm_queue_create(cpu, TDM_QUEUE_IN_ORDER, &qc));
  unsigned char *want = malloc(N), *src, *mid, *back, *m0, *m1;
  CHECK(want);
  th_fill_random(want, N, &rng);
  CHECK_OK(tdm_malloc(d0, TDM_MEM_PINNED, N, (void **)&src));
  CHECK_OK(tdm_malloc(d0, TDM_MEM_PINNED, N, (void **)&mid));
  CHECK_OK(tdm_malloc(d1, TDM_MEM_PINNED, N, (void **)&back));
  CHECK_OK(tdm_malloc(d0, TDM_MEM_DEVICE, N, (void **)&m0));
  CHECK_OK(tdm_malloc(d1, TDM_MEM_DEVICE, N, (void **)&m1));
  memset(src, 0, N);
  memset(mid, 0, N);
  memset(back, 0, N);
  th_gate gate;
  th_gate_init(&gate);
  th_gated_copy fa = {&gate, src, want, N};
  tdm_event *filled, *produced;
  CHECK_OK(tdm_host_task(qc, th_gated_copy_task, &fa, 0, NULL, &filled));
  CHECK_OK(tdm_queue_wait(q0, filled));
  CHECK_OK(tdm_memcpy(q0, m0, src, N, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q0, mid, m0, N, TDM_COPY_D2H, 0, NULL, &produced));
  CHECK_OK(tdm_queue_wait(q1, produced)); /* returns at once: device 0 is held */
  CHECK_OK(tdm_memcpy(q1, m1, mid, N, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q1, back, m1, N, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_RC(tdm_event_query(produced), TDM_EAGAIN);
  th_gate_open(&gate);
  CHECK_OK(tdm_queue_sync(q1));
  CHECK_MEM_EQ(back, want, N);
  CHECK_OK(tdm_queue_sync(q0));
  CHECK_OK(tdm_event_release(filled));
  CHECK_OK(tdm_event_release(produced));
  th_gate_destroy(&gate);
  CHECK_OK(tdm_queue_destroy(q0));
  CHECK_OK(tdm_queue_destroy(q1));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(src));
  CHECK_OK(tdm_free(mid));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(m0));
  CHECK_OK(tdm_free(m1));
  free(want);
  th_close();
}
