/* test-conf-copy.c: conformance, copies and memory: every direction and host memory kind at
 * sizes from 1 byte to 256 MiB, pageable copies staged in stream order, zero-byte copies,
 * tdm_mem_query, memset, and cross-queue copies that happen whole or not at all. */
#include "conformance.h"

/* ---- Copies ------------------------------------------------------------------------------ */

/* The host memory kinds a copy may touch. */
enum host_kind { HK_PINNED, HK_PAGEABLE, HK_TDM_HOST, HK_REGISTERED, HK_COUNT };
static const char *const host_kind_name[HK_COUNT] = {"pinned", "malloc", "TDM_MEM_HOST",
                                                     "registered"};

struct hbuf {
  unsigned char *p;
  size_t size;
  enum host_kind kind;
};

static struct hbuf hbuf_alloc(tdm_device *dev, enum host_kind kind, size_t n) {
  struct hbuf b = {NULL, n, kind};
  switch (kind) {
  case HK_PINNED: b.p = dev_alloc(dev, TDM_MEM_PINNED, n); break;
  case HK_TDM_HOST: b.p = dev_alloc(dev, TDM_MEM_HOST, n); break;
  case HK_PAGEABLE: b.p = malloc(n); break;
  case HK_REGISTERED:
    b.size = (n + 4095) / 4096 * 4096;
    b.p = aligned_alloc(4096, b.size);
    CHECK(b.p != NULL);
    CHECK_OK(tdm_host_register(dev, b.p, b.size));
    break;
  default: CHECK(!"bad host kind");
  }
  CHECK(b.p != NULL);
  return b;
}

static void hbuf_free(struct hbuf *b) {
  switch (b->kind) {
  case HK_PINNED:
  case HK_TDM_HOST: CHECK_OK(tdm_free(b->p)); break;
  case HK_PAGEABLE: free(b->p); break;
  case HK_REGISTERED:
    CHECK_OK(tdm_host_unregister(b->p));
    free(b->p);
    break;
  default: break;
  }
  b->p = NULL;
}

/* Offsets into the allocations and untouched guard bytes around every copied range. */
enum { OFF_SRC = 5, OFF_A = 11, OFF_B = 3, OFF_DST = 7, GUARD = 16, FILL_A = 0x5a, FILL_B = 0xa5 };

/* Checks that device buffer d (size total) holds `want` at [off, off+n) and `fill` elsewhere. */
static void check_device_range(tdm_queue *q, tdm_device *dev, const void *d, size_t total,
                               size_t off, const unsigned char *want, size_t n, int fill) {
  unsigned char *back = dev_alloc(dev, TDM_MEM_PINNED, total);
  read_device(q, back, d, total);
  CHECK_MEM_EQ(back + off, want, n);
  for (size_t i = 0; i < total; i++)
    if (i < off || i >= off + n)
      CHECK_MSG(back[i] == fill, "device byte %zu outside the copied range changed", i);
  CHECK_OK(tdm_free(back));
}

/* host(skind) -> device A -> device B -> host(dkind), at unaligned offsets into every buffer;
 * checks the data, the guards, and the copies' event. */
static void copy_round(tdm_device *dev, tdm_queue *q, size_t n, enum host_kind skind,
                       enum host_kind dkind, int use_auto, uint64_t *rng) {
  const size_t size_a = OFF_A + n + GUARD, size_b = OFF_B + n + GUARD;
  struct hbuf src = hbuf_alloc(dev, skind, OFF_SRC + n + GUARD);
  struct hbuf dst = hbuf_alloc(dev, dkind, OFF_DST + n + GUARD);
  unsigned char *dst_before = malloc(dst.size);
  unsigned char *da = dev_alloc(dev, TDM_MEM_DEVICE, size_a);
  unsigned char *db = dev_alloc(dev, TDM_MEM_DEVICE, size_b);
  tdm_event *ev = NULL;
  th_fill_random(src.p, src.size, rng);
  th_fill_random(dst.p, dst.size, rng);
  memcpy(dst_before, dst.p, dst.size);

  CHECK_OK(tdm_memset(q, da, FILL_A, size_a, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, db, FILL_B, size_b, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, da + OFF_A, src.p + OFF_SRC, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_H2D,
                      0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, db + OFF_B, da + OFF_A, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_D2D, 0,
                      NULL, NULL));
  CHECK_OK(tdm_memcpy(q, dst.p + OFF_DST, db + OFF_B, n, use_auto ? TDM_COPY_AUTO : TDM_COPY_D2H,
                      0, NULL, &ev));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_OK(tdm_event_query(ev));
  CHECK_OK(tdm_event_release(ev));

  if (th_first_diff(dst.p + OFF_DST, src.p + OFF_SRC, n) >= 0)
    printf("mismatch: n=%zu src=%s dst=%s %s\n", n, host_kind_name[skind], host_kind_name[dkind],
           use_auto ? "AUTO" : "explicit");
  CHECK_MEM_EQ(dst.p + OFF_DST, src.p + OFF_SRC, n);
  CHECK_MEM_EQ(dst.p, dst_before, OFF_DST);
  CHECK_MEM_EQ(dst.p + OFF_DST + n, dst_before + OFF_DST + n, dst.size - OFF_DST - n);
  check_device_range(q, dev, da, size_a, OFF_A, src.p + OFF_SRC, n, FILL_A);
  check_device_range(q, dev, db, size_b, OFF_B, src.p + OFF_SRC, n, FILL_B);

  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  hbuf_free(&src);
  hbuf_free(&dst);
  free(dst_before);
}

static const size_t copy_sizes[] = {1, 3, 4096, 65537, (1u << 20) + 7};
enum { N_COPY_SIZES = sizeof copy_sizes / sizeof copy_sizes[0] };

static void copy_all_kinds(int use_auto) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  for (int s = 0; s < N_COPY_SIZES; s++)
    for (int sk = 0; sk < HK_COUNT; sk++)
      for (int dk = 0; dk < HK_COUNT; dk++)
        copy_round(dev, q, copy_sizes[s], sk, dk, use_auto, &rng);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

TEST_CASE(copy_explicit) { copy_all_kinds(0); }

TEST_CASE(copy_auto) { copy_all_kinds(1); }

/* H2H between every pair of host kinds, explicit and AUTO. */
TEST_CASE(copy_h2h) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  for (int s = 0; s < N_COPY_SIZES; s++) {
    size_t n = copy_sizes[s];
    for (int sk = 0; sk < HK_COUNT; sk++)
      for (int dk = 0; dk < HK_COUNT; dk++)
        for (int use_auto = 0; use_auto < 2; use_auto++) {
          struct hbuf src = hbuf_alloc(dev, sk, OFF_SRC + n + GUARD);
          struct hbuf dst = hbuf_alloc(dev, dk, OFF_DST + n + GUARD);
          unsigned char *before = malloc(dst.size);
          th_fill_random(src.p, src.size, &rng);
          th_fill_random(dst.p, dst.size, &rng);
          memcpy(before, dst.p, dst.size);
          CHECK_OK(tdm_memcpy(q, dst.p + OFF_DST, src.p + OFF_SRC, n,
                              use_auto ? TDM_COPY_AUTO : TDM_COPY_H2H, 0, NULL, NULL));
          CHECK_OK(tdm_queue_sync(q));
          CHECK_MEM_EQ(dst.p + OFF_DST, src.p + OFF_SRC, n);
          CHECK_MEM_EQ(dst.p, before, OFF_DST);
          CHECK_MEM_EQ(dst.p + OFF_DST + n, before + OFF_DST + n, dst.size - OFF_DST - n);
          hbuf_free(&src);
          hbuf_free(&dst);
          free(before);
        }
  }
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* 256 MiB through pageable and pinned memory in both directions (pageable goes through the
 * staging ring, in stream order). */
TEST_CASE(copy_256mib) {
  const size_t n = (size_t)256 << 20;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *pageable = malloc(n);
  unsigned char *pinned = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n), *db = dev_alloc(dev, TDM_MEM_DEVICE, n);
  CHECK(pageable != NULL);
  th_fill_random(pageable, n, &rng);
  th_fill_random(pinned, n, &rng);
  /* pageable -> A -> B -> pinned */
  CHECK_OK(tdm_memcpy(q, da, pageable, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, db, da, n, TDM_COPY_D2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, pinned, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(pinned, pageable, n);
  /* new data: pinned -> B -> pageable */
  th_fill_random(pinned, n, &rng);
  CHECK_OK(tdm_memcpy(q, db, pinned, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, pageable, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(pageable, pinned, n);
  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  CHECK_OK(tdm_free(pinned));
  free(pageable);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* A large pinned allocation of a size that is no multiple of any page: reported whole by
 * tdm_mem_query from inside it, its last bytes copied both ways, and a copy that runs one byte
 * past its end refused. */
TEST_CASE(pinned_large) {
  const size_t n = ((size_t)64 << 20) + 4097, tail = 3 << 20;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *pinned = dev_alloc(dev, TDM_MEM_PINNED, n), *want = malloc(tail);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, tail);
  CHECK(want != NULL);
  tdm_mem_info info;
  CHECK_OK(tdm_mem_query(pinned + n - 1, &info));
  CHECK_EQ(info.kind, TDM_MEM_PINNED);
  CHECK(info.base == pinned && info.size == n && info.device == dev);
  th_fill_random(pinned + n - tail, tail, &rng);
  memcpy(want, pinned + n - tail, tail);
  CHECK_OK(tdm_memcpy(q, d, pinned + n - tail, tail, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, pinned + n - tail, 0, tail, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, pinned + n - tail, d, tail, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(pinned + n - tail, want, tail);
  CHECK_RC(tdm_memcpy(q, d, pinned + n - tail + 1, tail, TDM_COPY_H2D, 0, NULL, NULL),
           TDM_ERANGE);
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_free(pinned));
  free(want);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* Pageable memory is read and written in stream order, not at call time: a host task placed
 * before an H2D fills the source, and a host task placed after a D2H reads the destination. */
struct pageable_io {
  th_gate gate;
  unsigned char *buf;
  const unsigned char *want;
  size_t n;
  atomic_int ok;
};

static int task_gate_then_fill(void *arg) {
  struct pageable_io *p = arg;
  if (!th_gate_wait(&p->gate, TH_HANG_MS)) return 1;
  memcpy(p->buf, p->want, p->n);
  return 0;
}

static int task_check_pageable(void *arg) {
  struct pageable_io *p = arg;
  atomic_store(&p->ok, memcmp(p->buf, p->want, p->n) == 0 ? 1 : -1);
  return 0;
}

TEST_CASE(copy_pageable_stream_order) {
  const size_t n = (1u << 20) + 7;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *src = malloc(n), *dst = malloc(n), *want = malloc(n);
  unsigned char *out = dev_alloc(dev, TDM_MEM_PINNED, n);
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  CHECK(src && dst && want);
  th_fill_random(src, n, &rng);
  th_fill_random(dst, n, &rng);
  th_fill_random(want, n, &rng);
  struct pageable_io in = {.buf = src, .want = want, .n = n}, back = {.buf = dst, .want = want, .n = n};
  th_gate_init(&in.gate);
  CHECK_OK(tdm_host_task(q, task_gate_then_fill, &in, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, d, src, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, out, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(q, dst, d, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_host_task(q, task_check_pageable, &back, 0, NULL, NULL));
  th_gate_open(&in.gate);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MSG(th_first_diff(out, want, n) < 0, "the pageable source was read at call time");
  CHECK_MSG(atomic_load(&back.ok) == 1, "the D2H into pageable memory had not landed when the "
            "next host task ran");
  CHECK_MEM_EQ(dst, want, n);
  CHECK_OK(tdm_free(out));
  CHECK_OK(tdm_free(d));
  free(src);
  free(dst);
  free(want);
  CHECK_OK(tdm_queue_destroy(q));
  th_gate_destroy(&in.gate);
  th_close();
}

/* n == 0 is a no-op command: its event completes and nothing changes. */
TEST_CASE(copy_zero_bytes) {
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *h = dev_alloc(dev, TDM_MEM_PINNED, 64), *back = dev_alloc(dev, TDM_MEM_PINNED, 64);
  unsigned char before[64];
  void *d = dev_alloc(dev, TDM_MEM_DEVICE, 64);
  th_fill_random(h, 64, &rng);
  memcpy(before, h, 64);
  CHECK_OK(tdm_memset(q, d, 0x77, 64, 0, NULL, NULL));
  tdm_event *e1 = NULL, *e2 = NULL, *e3 = NULL;
  CHECK_OK(tdm_memcpy(q, d, h, 0, TDM_COPY_H2D, 0, NULL, &e1));
  CHECK_OK(tdm_memcpy(q, h, d, 0, TDM_COPY_D2H, 0, NULL, &e2));
  CHECK_OK(tdm_memset(q, d, 0x11, 0, 0, NULL, &e3));
  wait_ok(e1);
  wait_ok(e2);
  wait_ok(e3);
  CHECK_OK(tdm_queue_sync(q));
  CHECK_MEM_EQ(h, before, 64);
  read_device(q, back, d, 64);
  for (int i = 0; i < 64; i++) CHECK_EQ(back[i], 0x77);
  CHECK_OK(tdm_free(h));
  CHECK_OK(tdm_free(back));
  CHECK_OK(tdm_free(d));
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* tdm_mem_query describes every kind of memory. */
TEST_CASE(mem_query) {
  tdm_device *dev = th_open();
  tdm_mem_info info;
  struct hbuf b;
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, 1000);
  CHECK_OK(tdm_mem_query(d + 10, &info));
  CHECK_EQ(info.kind, TDM_MEM_DEVICE);
  CHECK(info.device == dev && info.base == d && info.size == 1000);
  CHECK_OK(tdm_free(d));
  for (int k = 0; k < HK_COUNT; k++) {
    static const tdm_mem_kind expect[HK_COUNT] = {TDM_MEM_PINNED, TDM_MEM_HOST, TDM_MEM_HOST,
                                                  TDM_MEM_REGISTERED};
    b = hbuf_alloc(dev, k, 5000);
    memset(&info, 0, sizeof info);
    CHECK_OK(tdm_mem_query(b.p + 1, &info));
    CHECK_MSG(info.kind == expect[k], "%s memory reported as kind %d", host_kind_name[k],
              (int)info.kind);
    if (k == HK_PAGEABLE) {
      CHECK(info.base == NULL);
    } else {
      CHECK(info.base == b.p);
      CHECK_EQ(info.size, b.size);
    }
    hbuf_free(&b);
  }
  th_close();
}

/* memset of device and host memory at offsets, read back through copies. */
TEST_CASE(memset_ranges) {
  const size_t n = 65537 + 2 * GUARD;
  tdm_device *dev = th_open();
  tdm_queue *q = new_queue(dev, TDM_QUEUE_IN_ORDER);
  unsigned char *d = dev_alloc(dev, TDM_MEM_DEVICE, n);
  unsigned char *want = malloc(n);
  CHECK_OK(tdm_memset(q, d, 0x11, n, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, d + GUARD, 0xc3, n - 2 * GUARD, 0, NULL, NULL));
  CHECK_OK(tdm_memset(q, d + 100, 0x3c, 1, 0, NULL, NULL));
  memset(want, 0xc3, n - 2 * GUARD);
  want[100 - GUARD] = 0x3c;
  check_device_range(q, dev, d, n, GUARD, want, n - 2 * GUARD, 0x11);
  CHECK_OK(tdm_free(d));
  for (int k = 0; k < HK_COUNT; k++) {
    struct hbuf b = hbuf_alloc(dev, k, n);
    memset(b.p, 0x11, n);
    CHECK_OK(tdm_memset(q, b.p + GUARD, 0xc3, n - 2 * GUARD, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(q));
    for (size_t i = 0; i < n; i++)
      CHECK_EQ(b.p[i], (i < GUARD || i >= n - GUARD) ? 0x11 : 0xc3);
    hbuf_free(&b);
  }
  free(want);
  CHECK_OK(tdm_queue_destroy(q));
  th_close();
}

/* ---- Cross-queue copies ------------------------------------------------------------------ */

/* Held back by a gate, then inverts a host buffer that a later H2D on the same queue reads. */
struct invert_arg {
  th_gate gate;
  struct hbuf *buf;
};

static int task_gate_then_invert(void *arg) {
  struct invert_arg *a = arg;
  if (!th_gate_wait(&a->gate, TH_HANG_MS)) return 1;
  for (size_t i = 0; i < a->buf->size; i++) a->buf->p[i] ^= 0xff;
  return 0;
}

/* The cross copy runs after earlier work on the source queue, and the destination queue's
 * later work sees its data: only the destination queue is synced. */
TEST_CASE(memcpy_cross) {
  const size_t n = (1u << 20) + 7;
  uint64_t rng = th_seed();
  tdm_device *dev = th_open();
  tdm_queue *qa = new_queue(dev, TDM_QUEUE_IN_ORDER), *qb = new_queue(dev, TDM_QUEUE_IN_ORDER);
  struct hbuf src = hbuf_alloc(dev, HK_PINNED, n), out = hbuf_alloc(dev, HK_PINNED, n);
  unsigned char *want = malloc(n);
  void *da = dev_alloc(dev, TDM_MEM_DEVICE, n), *db = dev_alloc(dev, TDM_MEM_DEVICE, n);
  th_fill_random(src.p, n, &rng);
  th_fill_random(out.p, n, &rng);
  for (size_t i = 0; i < n; i++) want[i] = src.p[i] ^ 0xff;
  struct invert_arg inv = {.buf = &src};
  th_gate_init(&inv.gate);

  tdm_event *ex = NULL;
  CHECK_OK(tdm_host_task(qa, task_gate_then_invert, &inv, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qa, da, src.p, n, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy_cross(qa, qb, db, da, n, 0, NULL, &ex));
  CHECK_OK(tdm_memcpy(qb, out.p, db, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_RC(tdm_event_query(ex), TDM_EAGAIN);
  th_gate_open(&inv.gate);
  CHECK_OK(tdm_queue_sync(qb));
  CHECK_MEM_EQ(out.p, want, n);
  wait_ok(ex);

  /* Back the other way, with a dependency on a third queue's held-back work. */
  tdm_queue *qc = new_queue(dev, TDM_QUEUE_IN_ORDER);
  th_gate g2;
  th_gate_init(&g2);
  struct flag_task f = {&g2, 0, 0};
  tdm_event *ec = NULL;
  CHECK_OK(tdm_host_task(qc, task_gate_then_done, &f, 0, NULL, &ec));
  /* The copy runs on qb: it must wait for qa's memset of da explicitly (a cross-queue copy
   * orders after the source queue's work and its dependencies, not the destination's). */
  tdm_event *ems = NULL;
  CHECK_OK(tdm_memset(qa, da, 0x42, n, 0, NULL, &ems));
  tdm_event *deps2[2] = {ec, ems};
  CHECK_OK(tdm_memcpy_cross(qb, qa, da, db, n, 2, deps2, &ex));
  CHECK_OK(tdm_event_release(ems));
  CHECK_OK(tdm_host_task(qa, task_record_done, &f, 0, NULL, NULL));
  CHECK_OK(tdm_memcpy(qa, out.p, da, n, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_RC(tdm_event_query(ex), TDM_EAGAIN);
  th_gate_open(&g2);
  CHECK_OK(tdm_queue_sync(qa));
  CHECK_EQ(atomic_load(&f.saw), 1);
  CHECK_MEM_EQ(out.p, want, n);
  wait_ok(ex);
  wait_ok(ec);

  CHECK_OK(tdm_queue_destroy(qa));
  CHECK_OK(tdm_queue_destroy(qb));
  CHECK_OK(tdm_queue_destroy(qc));
  CHECK_OK(tdm_free(da));
  CHECK_OK(tdm_free(db));
  hbuf_free(&src);
  hbuf_free(&out);
  free(want);
  th_gate_destroy(&inv.gate);
  th_gate_destroy(&g2);
  th_close();
}
