/* moe-fixture.h: what the suites of the MoE op tables (test-moe-ops.c, test-xfmr-ops.c,
 * test-moe-quant.c) share: the device's table opened on an in-order queue, device memory in
 * and out, and random distinct indices. A device without a table is skipped (77). Include
 * after harness.h. */
#ifndef TANDEM_TESTS_MOE_FIXTURE_H
#define TANDEM_TESTS_MOE_FIXTURE_H

#include <tandem/moe_ops.h>

typedef struct fixture {
  tdm_device *dev;
  tdm_queue *q;
  const tdm_moe_ops *ops;
  void *st;
  uint64_t rng;
} fixture;

TH_HELPER fixture setup(void) {
  fixture f = {0};
  f.dev = th_open();
  f.ops = tdm_moe_ops_for(f.dev);
  if (!f.ops) TH_SKIP("no MoE op table for the %s backend", th_backend_of(f.dev));
  CHECK_OK(tdm_queue_create(f.dev, TDM_QUEUE_IN_ORDER, &f.q));
  CHECK_OK(f.ops->open(f.q, &f.st));
  f.rng = th_seed();
  return f;
}

TH_HELPER void teardown(fixture *f) {
  f->ops->close(f->st);
  CHECK_OK(tdm_queue_destroy(f->q));
  th_close();
}

TH_HELPER void *alloc(fixture *f, tdm_mem_kind kind, size_t n) {
  void *p = NULL;
  CHECK_OK(tdm_malloc(f->dev, kind, n, &p));
  CHECK(p != NULL);
  return p;
}

/* A device buffer holding a copy of n bytes of host data (queued; the queue orders it). */
TH_HELPER void *upload(fixture *f, const void *host, size_t n) {
  void *d = alloc(f, TDM_MEM_DEVICE, n);
  CHECK_OK(tdm_memcpy(f->q, d, host, n, TDM_COPY_H2D, 0, NULL, NULL));
  return d;
}

/* n bytes of device memory into host memory, waited for. */
TH_HELPER void download(fixture *f, void *host, const void *dev, size_t n) {
  CHECK_OK(tdm_memcpy(f->q, host, dev, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(f->q));
}

/* m distinct values of [0, n) in random order, into dst. */
TH_HELPER void pick_distinct(fixture *f, int n, int m, int32_t *dst) {
  int32_t *all = malloc((size_t)n * sizeof *all);
  CHECK(all != NULL && m <= n);
  for (int i = 0; i < n; i++) all[i] = i;
  for (int i = 0; i < m; i++) {
    int j = i + (int)th_rand_below(&f->rng, (uint64_t)(n - i));
    int32_t t = all[i];
    all[i] = all[j];
    all[j] = t;
    dst[i] = all[i];
  }
  free(all);
}

#endif
