/* memory.c: allocation, registration and the registry that resolves any pointer to the
 * allocation holding it, so copies are checked (kind, device, range) before they are queued.
 * The registry is the only one: each entry carries the backend's handle for the allocation
 * (tdm__bmem: OpenCL's cl_mem, the imported flag), which goes back to the backend with every
 * command on that memory, so no backend keeps a registry or queries the driver on a copy. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static tdm__alloc *reg;   /* sorted by base, non-overlapping */
static size_t reg_n, reg_cap;

/* Index of the entry containing p, or -1. Caller holds reg_lock. */
static long find(uintptr_t p) {
  size_t lo = 0, hi = reg_n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (reg[mid].base + reg[mid].size <= p)
      lo = mid + 1;
    else if (reg[mid].base > p)
      hi = mid;
    else
      return (long)mid;
  }
  return -1;
}

/* Erases entry i. Caller holds reg_lock for writing. */
static void reg_erase(size_t i) {
  memmove(&reg[i], &reg[i + 1], (reg_n - i - 1) * sizeof *reg);
  reg_n--;
  atomic_fetch_sub(&tdm__g.n_allocs, 1);
}

static int reg_insert(const tdm__alloc *a) {
  pthread_rwlock_wrlock(&reg_lock);
  if (reg_n == reg_cap) {
    size_t cap = reg_cap ? reg_cap * 2 : 64;
    tdm__alloc *n = tdm__malloc(cap * sizeof *n);
    if (!n) {
      pthread_rwlock_unlock(&reg_lock);
      return tdm__error(TDM_ENOMEM, 0, "no memory to record an allocation");
    }
    if (reg_n) memcpy(n, reg, reg_n * sizeof *n);
    free(reg);
    reg = n;
    reg_cap = cap;
  }
  /* An allocation freed in stream order leaves the registry when its free command completes,
   * after the backend has freed it natively (cudaFreeAsync): in between, the driver may hand
   * its range out again, to this allocation. Such an entry is gone already; it goes now (its
   * free command then finds nothing to remove). Any other overlap is an error. */
  size_t i = 0;
  while (i < reg_n && reg[i].base < a->base) i++;
  if (i > 0 && reg[i - 1].freeing && reg[i - 1].base + reg[i - 1].size > a->base) reg_erase(--i);
  while (i < reg_n && reg[i].freeing && reg[i].base < a->base + a->size) reg_erase(i);
  if ((i < reg_n && reg[i].base < a->base + a->size) ||
      (i > 0 && reg[i - 1].base + reg[i - 1].size > a->base)) {
    pthread_rwlock_unlock(&reg_lock);
    return tdm__error(TDM_EINVAL, 0, "%p overlaps memory tandem already knows",
                      (void *)a->base);
  }
  memmove(&reg[i + 1], &reg[i], (reg_n - i) * sizeof *reg);
  reg[i] = *a;
  reg_n++;
  pthread_rwlock_unlock(&reg_lock);
  atomic_fetch_add(&tdm__g.n_allocs, 1);
  return 0;
}

/* Removes the live entry starting exactly at p; returns it in *out. */
static int reg_remove(uintptr_t p, tdm__alloc *out) {
  pthread_rwlock_wrlock(&reg_lock);
  long i = find(p);
  if (i < 0 || reg[i].base != p || reg[i].freeing) {
    pthread_rwlock_unlock(&reg_lock);
    return tdm__error(TDM_EINVAL, 0, "%p is not the start of a live tandem allocation",
                      (void *)p);
  }
  *out = reg[i];
  reg_erase((size_t)i);
  pthread_rwlock_unlock(&reg_lock);
  return 0;
}

static const char *kind_name(tdm_mem_kind k) {
  switch (k) {
    case TDM_MEM_DEVICE: return "device";
    case TDM_MEM_PINNED: return "pinned host";
    case TDM_MEM_HOST: return "pageable host";
    case TDM_MEM_REGISTERED: return "registered host";
  }
  return "unknown";
}

int tdm_malloc(tdm_device *dev, tdm_mem_kind kind, size_t size, void **ptr) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!ptr) return tdm__error(TDM_EINVAL, 0, "tdm_malloc: ptr is NULL");
  if (size == 0) return tdm__error(TDM_EINVAL, 0, "tdm_malloc: size is 0");
  if (kind != TDM_MEM_DEVICE && kind != TDM_MEM_PINNED && kind != TDM_MEM_HOST)
    return tdm__error(TDM_EINVAL, 0, "tdm_malloc: kind %d cannot be allocated", (int)kind);
  /* Larger than any object can be, or than the device holds: no backend is asked. */
  if (size > PTRDIFF_MAX || (kind == TDM_MEM_DEVICE && dev->info.total_memory &&
                             size > dev->info.total_memory))
    return tdm__error(TDM_ENOMEM, 0, "allocating %zu bytes of %s memory on %s: more than it "
                      "can hold", size, kind_name(kind), dev->info.id);
  void *p = NULL;
  tdm__alloc a = {.size = size, .kind = kind, .dev = dev};
  rc = tdm__b_mem_alloc(dev, kind, size, &p, &a.bm);
  if (rc)
    return tdm__error(rc, tdm_last_native_error(), "allocating %zu bytes of %s memory on %s: %s",
                      size, kind_name(kind), dev->info.id, tdm__last_detail());
  a.base = (uintptr_t)p;
  if ((rc = reg_insert(&a))) {
    tdm__b_mem_free(dev, kind, p, &a.bm);
    return rc;
  }
  *ptr = p;
  return 0;
}

static void release_entry(const tdm__alloc *a) {
  if (a->kind == TDM_MEM_REGISTERED)
    tdm__b_host_unregister(a->dev, (void *)a->base);
  else
    tdm__b_mem_free(a->dev, a->kind, (void *)a->base, &a->bm);
}

int tdm_free(void *ptr) {
  TDM__ENTER();
  if (!ptr) return tdm__error(TDM_EINVAL, 0, "tdm_free: ptr is NULL");
  tdm__alloc a;
  int rc = reg_remove((uintptr_t)ptr, &a);
  if (rc) return rc;
  if (a.kind == TDM_MEM_REGISTERED) {
    reg_insert(&a); /* cannot fail: the slot was just freed */
    return tdm__error(TDM_EINVAL, 0, "%p is registered memory: use tdm_host_unregister", ptr);
  }
  release_entry(&a);
  return 0;
}

int tdm__mem_begin_free(tdm__queue *q, void *ptr, tdm__memref *m) {
  if (!ptr) return tdm__error(TDM_EINVAL, 0, "tdm_free_async: ptr is NULL");
  pthread_rwlock_wrlock(&reg_lock);
  long i = find((uintptr_t)ptr);
  int rc = 0;
  if (i < 0 || reg[i].base != (uintptr_t)ptr || reg[i].freeing)
    rc = tdm__error(TDM_EINVAL, 0, "%p is not the start of a live tandem allocation", ptr);
  else if (reg[i].kind == TDM_MEM_REGISTERED)
    rc = tdm__error(TDM_EINVAL, 0, "%p is registered memory: use tdm_host_unregister", ptr);
  else {
    reg[i].freeing = true;
    /* The free runs on q's backend, which gets the entry's handle only if it made it. */
    bool own = reg[i].dev->be == q->dev->be;
    *m = (tdm__memref){reg[i].kind, own ? reg[i].dev->bindex : -1,
                       own ? reg[i].bm : (tdm__bmem){NULL, 0}, 0};
  }
  pthread_rwlock_unlock(&reg_lock);
  return rc;
}

void tdm__mem_cancel_free(void *ptr) {
  pthread_rwlock_wrlock(&reg_lock);
  long i = find((uintptr_t)ptr);
  if (i >= 0) reg[i].freeing = false;
  pthread_rwlock_unlock(&reg_lock);
}

void tdm__mem_finish_free(void *ptr, bool freed) {
  tdm__alloc a;
  bool found = false;
  pthread_rwlock_wrlock(&reg_lock);
  long i = find((uintptr_t)ptr);
  /* Not there: reg_insert dropped it (its range was handed out again, so it was freed). */
  if (i >= 0 && reg[i].base == (uintptr_t)ptr && reg[i].freeing) {
    a = reg[i];
    reg_erase((size_t)i);
    found = true;
  }
  pthread_rwlock_unlock(&reg_lock);
  if (found && !freed) release_entry(&a);
}

void tdm__mem_free_all(void) {
  pthread_rwlock_wrlock(&reg_lock);
  for (size_t i = 0; i < reg_n; i++) release_entry(&reg[i]);
  atomic_fetch_sub(&tdm__g.n_allocs, (long)reg_n);
  free(reg);
  reg = NULL;
  reg_n = reg_cap = 0;
  pthread_rwlock_unlock(&reg_lock);
}

int tdm_host_register(tdm_device *dev, void *ptr, size_t size) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!ptr || !size) return tdm__error(TDM_EINVAL, 0, "tdm_host_register: empty range");
  if ((uintptr_t)ptr + size < (uintptr_t)ptr)
    return tdm__error(TDM_ERANGE, 0, "tdm_host_register: %p + %zu bytes wraps around the "
                      "address space", ptr, size);
  if ((rc = tdm__b_host_register(dev, ptr, size)))
    return tdm__error(rc, tdm_last_native_error(), "registering %zu bytes at %p on %s: %s",
                      size, ptr, dev->info.id, tdm__last_detail());
  tdm__alloc a = {.base = (uintptr_t)ptr, .size = size, .kind = TDM_MEM_REGISTERED, .dev = dev};
  if ((rc = reg_insert(&a))) tdm__b_host_unregister(dev, ptr);
  return rc;
}

int tdm_host_unregister(void *ptr) {
  TDM__ENTER();
  if (!ptr) return tdm__error(TDM_EINVAL, 0, "tdm_host_unregister: ptr is NULL");
  tdm__alloc a;
  int rc = reg_remove((uintptr_t)ptr, &a);
  if (rc) return rc;
  if (a.kind != TDM_MEM_REGISTERED) {
    reg_insert(&a);
    return tdm__error(TDM_EINVAL, 0, "%p was allocated, not registered: use tdm_free", ptr);
  }
  release_entry(&a);
  return 0;
}

int tdm_mem_query(const void *ptr, tdm_mem_info *info) {
  TDM__ENTER();
  if (!ptr || !info) return tdm__error(TDM_EINVAL, 0, "tdm_mem_query: NULL argument");
  pthread_rwlock_rdlock(&reg_lock);
  long i = find((uintptr_t)ptr);
  tdm_mem_info r = {.kind = TDM_MEM_HOST};
  if (i >= 0 && !reg[i].freeing)
    r = (tdm_mem_info){reg[i].kind, reg[i].dev, (void *)reg[i].base, reg[i].size};
  pthread_rwlock_unlock(&reg_lock);
  *info = r;
  return 0;
}

/* ---- checks before queueing ---- */

typedef struct side {
  const char *role; /* "source", "destination" */
  bool known, device, freeing;
  tdm__alloc a;
} side;

/* Index of the first entry that starts after p (reg_n if none). Caller holds reg_lock. */
static size_t first_after(uintptr_t p) {
  size_t lo = 0, hi = reg_n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (reg[mid].base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The device whose reserved address range [p, p + n) touches, or NULL. */
static tdm_device *in_device_range(uintptr_t p, size_t n) {
  for (int i = 0; i < tdm__g.ndevices; i++) {
    tdm_device *d = &tdm__g.devices[i];
    if (d->range_end && p < d->range_end && p + n > d->range_base) return d;
  }
  return NULL;
}

/* Resolves [p, p + n). Memory tandem does not know is pageable host memory, unless the range
 * runs into an allocation (TDM_ERANGE) or into a backend's reserved device range, where only
 * live allocations are valid (a freed OpenCL pointer, say). Caller holds reg_lock for
 * reading. */
static int resolve(const void *p, size_t n, const char *role, side *s) {
  memset(s, 0, sizeof *s);
  s->role = role;
  uintptr_t u = (uintptr_t)p;
  if (u + n < u)
    return tdm__error(TDM_ERANGE, 0, "%s %p + %zu bytes wraps around the address space", role,
                      p, n);
  long i = find(u);
  if (i < 0) {
    size_t j = first_after(u);
    if (j < reg_n && reg[j].base < u + n)
      return tdm__error(TDM_ERANGE, 0, "%s %p + %zu bytes runs into the %zu-byte allocation at "
                        "%p", role, p, n, reg[j].size, (void *)reg[j].base);
    tdm_device *d = in_device_range(u, n ? n : 1);
    if (d)
      return tdm__error(TDM_EINVAL, 0, "%s %p lies in %s's device address range but in no live "
                        "allocation (freed, or never allocated)", role, p, d->info.id);
    return 0; /* unknown memory is pageable host memory */
  }
  s->known = true;
  s->a = reg[i];
  s->device = reg[i].kind == TDM_MEM_DEVICE;
  if (reg[i].freeing)
    return tdm__error(TDM_EINVAL, 0, "%s %p belongs to memory already given to tdm_free_async",
                      role, p);
  if (u + n > reg[i].base + reg[i].size)
    return tdm__error(TDM_ERANGE, 0, "%s %p + %zu bytes runs past its %zu-byte allocation", role,
                      p, n, reg[i].size);
  return 0;
}

/* Device memory must live on q's device or alt; or, where peer is allowed, on any device of
 * the same backend. */
static int device_ok(const side *s, tdm__queue *q, tdm_device *alt, bool peer) {
  tdm_device *d = s->a.dev;
  if (d == q->dev || d == alt) return 0;
  if (peer && d->be == q->dev->be) return 0;
  return tdm__error(TDM_EXDEV, 0, "%s is memory of %s, but the queue %s is on %s", s->role,
                    d->info.id, q->label, q->dev->info.id);
}

static const char *dir_name(tdm_copy_dir d) {
  static const char *names[] = {"auto", "host-to-device", "device-to-host", "device-to-device",
                                "host-to-host"};
  return (unsigned)d < 5 ? names[d] : "invalid";
}

/* Inlined by force: the copy checks are on every submission of a copy. */
#define TDM__INLINE static inline __attribute__((always_inline))

#define MEMREF_NONE ((tdm__memref){0, -1, {NULL, 0}, 0})

/* What the command tells q's backend about one side: the registry's kind, and the entry's
 * handle and the pointer's offset in it when that backend made the entry (memory of another
 * backend's device reaches it only as host memory). */
TDM__INLINE void memref_of(const side *x, const tdm__queue *q, const void *p, tdm__memref *m) {
  if (!x->known) {
    *m = MEMREF_NONE;
    return;
  }
  bool own = x->a.dev->be == q->dev->be;
  *m = (tdm__memref){x->a.kind, own ? x->a.dev->bindex : -1,
                     own ? x->a.bm : (tdm__bmem){NULL, 0},
                     (size_t)((uintptr_t)p - x->a.base)};
}

TDM__INLINE int check_copy(tdm__queue *q, tdm_device *alt, const side *d, const side *s,
                           tdm_copy_dir *dir) {
  tdm_copy_dir want = s->device ? (d->device ? TDM_COPY_D2D : TDM_COPY_D2H)
                                : (d->device ? TDM_COPY_H2D : TDM_COPY_H2H);
  if (*dir == TDM_COPY_AUTO) *dir = want;
  if ((unsigned)*dir > TDM_COPY_H2H)
    return tdm__error(TDM_EINVAL, 0, "copy direction %d is not a tdm_copy_dir", (int)*dir);
  if (*dir != want)
    return tdm__error(TDM_EDIRECTION, 0, "a %s copy from %s memory to %s memory",
                      dir_name(*dir), s->device ? "device" : "host",
                      d->device ? "device" : "host");
  int rc = 0;
  if (d->device && (rc = device_ok(d, q, alt, false))) return rc;
  if (s->device && (rc = device_ok(s, q, alt, want == TDM_COPY_D2D))) return rc;
  return 0;
}

/* Copies whose ranges overlap are refused on every backend (none of them promises memmove). */
static inline int check_overlap(const void *dst, const void *src, size_t n) {
  uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (d < s + n && s < d + n)
    return tdm__error(TDM_EINVAL, 0, "source %p and destination %p overlap in %zu bytes", src,
                      dst, n);
  return 0;
}

TDM__INLINE int resolve_both(void *dst, const void *src, size_t n, side *d, side *s) {
  if (!dst || !src) return tdm__error(TDM_EINVAL, 0, "memcpy: NULL %s", dst ? "src" : "dst");
  int rc = check_overlap(dst, src, n);
  if (rc) return rc;
  pthread_rwlock_rdlock(&reg_lock);
  rc = resolve(dst, n, "destination", d);
  if (!rc) rc = resolve(src, n, "source", s);
  pthread_rwlock_unlock(&reg_lock);
  return rc;
}

int tdm__mem_check_copy(tdm__queue *q, tdm_device *alt, void *dst, const void *src, size_t n,
                        tdm_copy_dir *dir, tdm__memref *dref, tdm__memref *sref) {
  if (n == 0) { /* a no-op command: its pointers are not looked at */
    if ((unsigned)*dir > TDM_COPY_H2H)
      return tdm__error(TDM_EINVAL, 0, "copy direction %d is not a tdm_copy_dir", (int)*dir);
    *dref = *sref = MEMREF_NONE;
    return 0;
  }
  side d, s;
  int rc = resolve_both(dst, src, n, &d, &s);
  if (rc) return rc;
  memref_of(&d, q, dst, dref);
  memref_of(&s, q, src, sref);
  return check_copy(q, alt, &d, &s, dir);
}

/* A cross-queue copy runs on src_q. Memory of a device of another backend is reachable there
 * only when that device's memory is host memory (the CPU backend's): it is then copied as
 * pageable host memory. */
static int cross_side(tdm__queue *src_q, side *x) {
  if (!x->device || x->a.dev->be == src_q->dev->be) return 0;
  if (!(x->a.dev->info.caps & TDM_DEVICE_CAP_HOST_MEMORY))
    return tdm__error(TDM_ENOTSUP, 0, "the %s is memory of %s, which %s cannot reach (a "
                      "cross-queue copy runs on the source queue); copy on a queue of %s after "
                      "tdm_queue_wait instead", x->role, x->a.dev->info.id, src_q->label,
                      x->a.dev->info.id);
  x->device = false;
  x->known = false;
  return 0;
}

int tdm__mem_check_cross(tdm__queue *src_q, tdm__queue *dst_q, void *dst, const void *src,
                         size_t n, tdm__memref *dref, tdm__memref *sref) {
  *dref = *sref = MEMREF_NONE;
  if (n == 0) return 0;
  side d, s;
  int rc = resolve_both(dst, src, n, &d, &s);
  if (!rc) rc = cross_side(src_q, &d);
  if (!rc) rc = cross_side(src_q, &s);
  if (rc) return rc;
  memref_of(&d, src_q, dst, dref);
  memref_of(&s, src_q, src, sref);
  tdm_copy_dir dir = TDM_COPY_AUTO;
  return check_copy(src_q, dst_q->dev, &d, &s, &dir);
}

int tdm__mem_check_fill(tdm__queue *q, void *dst, size_t n, tdm__memref *dref) {
  *dref = MEMREF_NONE;
  if (n == 0) return 0; /* a no-op command */
  if (!dst) return tdm__error(TDM_EINVAL, 0, "memset: dst is NULL");
  side d;
  pthread_rwlock_rdlock(&reg_lock);
  int rc = resolve(dst, n, "destination", &d);
  pthread_rwlock_unlock(&reg_lock);
  if (rc) return rc;
  memref_of(&d, q, dst, dref);
  return d.device ? device_ok(&d, q, NULL, false) : 0;
}

int tdm_mem_native(const void *ptr, void **native, size_t *offset) {
  TDM__ENTER();
  if (!ptr || !native || !offset) return tdm__error(TDM_EINVAL, 0, "tdm_mem_native: NULL argument");
  pthread_rwlock_rdlock(&reg_lock);
  long i = find((uintptr_t)ptr);
  tdm__alloc a = {0};
  if (i >= 0) a = reg[i];
  pthread_rwlock_unlock(&reg_lock);
  if (i < 0 || a.kind != TDM_MEM_DEVICE)
    return tdm__error(TDM_EINVAL, 0, "%p is not tandem device memory", ptr);
  void *n = NULL;
  size_t off = 0;
  int rc = tdm__b_mem_native(&a, ptr, &n, &off);
  if (rc) return rc;
  *native = n;
  *offset = off;
  return 0;
}

int tdm_mem_import(tdm_device *dev, void *native, size_t size, void **ptr) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!native || !size || !ptr) return tdm__error(TDM_EINVAL, 0, "tdm_mem_import: bad argument");
  void *p = NULL;
  tdm__alloc a = {.size = size, .kind = TDM_MEM_DEVICE, .dev = dev};
  if ((rc = tdm__b_mem_import(dev, native, size, &p, &a.bm))) return rc;
  a.base = (uintptr_t)p;
  if ((rc = reg_insert(&a))) {
    tdm__b_mem_free(dev, TDM_MEM_DEVICE, p, &a.bm);
    return rc;
  }
  *ptr = p;
  return 0;
}
