/* clmem.c: OpenCL memory behind tandem's pointers. Device allocations get addresses from a
 * reserved, inaccessible range and are never reused, so any pointer resolves to one cl_mem and
 * an offset (for user kernels and, later, CLBlast). Pinned host memory is a
 * CL_MEM_ALLOC_HOST_PTR buffer mapped for the host. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ocl.h"

static pthread_rwlock_t lock = PTHREAD_RWLOCK_INITIALIZER;
static ocl_buf *bufs; /* sorted by base */
static size_t nbufs, capbufs;
static uintptr_t range_base, range_next, range_end;

int ocl_mem_init(void) {
  /* Address space only: PROT_NONE and unreserved, so it costs no memory. */
  for (size_t sz = (size_t)1 << 42; sz >= (size_t)1 << 34; sz >>= 2) {
    void *p = mmap(NULL, sz, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      range_base = range_next = (uintptr_t)p;
      range_end = range_base + sz;
      return 0;
    }
  }
  return ocl_svc->error(TDM_ENOMEM, 0, "cannot reserve an address range for OpenCL buffers");
}

int ocl_mem_range(int bdev, uintptr_t *base, size_t *size) {
  (void)bdev; /* one range serves every device */
  *base = range_base;
  *size = range_end - range_base;
  return 0;
}

void ocl_mem_fini(void) {
  pthread_rwlock_wrlock(&lock);
  if (range_base) munmap((void *)range_base, range_end - range_base);
  range_base = range_next = range_end = 0;
  free(bufs);
  bufs = NULL;
  nbufs = capbufs = 0;
  pthread_rwlock_unlock(&lock);
}

static long find_locked(uintptr_t p) {
  size_t lo = 0, hi = nbufs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (bufs[mid].base + bufs[mid].size <= p)
      lo = mid + 1;
    else if (bufs[mid].base > p)
      hi = mid;
    else
      return (long)mid;
  }
  return -1;
}

bool ocl_mem_find(const void *p, ocl_buf *out) {
  pthread_rwlock_rdlock(&lock);
  long i = find_locked((uintptr_t)p);
  if (i >= 0) *out = bufs[i];
  pthread_rwlock_unlock(&lock);
  return i >= 0;
}

static int insert(const ocl_buf *b) {
  pthread_rwlock_wrlock(&lock);
  if (nbufs == capbufs) {
    size_t cap = capbufs ? capbufs * 2 : 64;
    ocl_buf *n = realloc(bufs, cap * sizeof *n);
    if (!n) {
      pthread_rwlock_unlock(&lock);
      return ocl_svc->error(TDM_ENOMEM, 0, "no memory to record an OpenCL buffer");
    }
    bufs = n;
    capbufs = cap;
  }
  size_t i = 0;
  while (i < nbufs && bufs[i].base < b->base) i++;
  memmove(&bufs[i + 1], &bufs[i], (nbufs - i) * sizeof *bufs);
  bufs[i] = *b;
  nbufs++;
  pthread_rwlock_unlock(&lock);
  return 0;
}

static bool take(uintptr_t base, ocl_buf *out) {
  pthread_rwlock_wrlock(&lock);
  long i = find_locked(base);
  bool ok = i >= 0 && bufs[i].base == base;
  if (ok) {
    *out = bufs[i];
    memmove(&bufs[i], &bufs[i + 1], (nbufs - (size_t)i - 1) * sizeof *bufs);
    nbufs--;
  }
  pthread_rwlock_unlock(&lock);
  return ok;
}

/* A fresh address range; ranges are never reused, so a stale pointer never aliases. */
static uintptr_t new_range(size_t size) {
  pthread_rwlock_wrlock(&lock);
  size_t span = (size + 4095) & ~(size_t)4095;
  uintptr_t p = 0;
  if (span >= size && range_end - range_next >= span) {
    p = range_next;
    range_next += span;
  }
  pthread_rwlock_unlock(&lock);
  return p;
}

static int device_buffer(int bdev, cl_mem mem, size_t size, bool imported, void **ptr) {
  uintptr_t p = new_range(size);
  if (!p) return ocl_svc->error(TDM_ENOMEM, 0, "OpenCL address range exhausted");
  ocl_buf b = {.base = p, .size = size, .mem = mem, .bdev = bdev, .kind = TDM_MEM_DEVICE,
               .imported = imported};
  int rc = insert(&b);
  if (rc) return rc;
  *ptr = (void *)p;
  return 0;
}

int ocl_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr) {
  ocl_device *d = &ocl_devs[bdev];
  cl_int err;
  if (kind == TDM_MEM_HOST) {
    void *p = malloc(size);
    if (!p) return ocl_svc->error(TDM_ENOMEM, 0, "cannot allocate %zu bytes", size);
    *ptr = p;
    return 0;
  }
  cl_mem_flags flags = CL_MEM_READ_WRITE | (kind == TDM_MEM_PINNED ? CL_MEM_ALLOC_HOST_PTR : 0);
  cl_mem mem = clCreateBuffer(d->ctx, flags, size, NULL, &err);
  if (!mem && err == CL_INVALID_BUFFER_SIZE) /* too large for one buffer: out of memory */
    return ocl_svc->error(TDM_ENOMEM, err, "%zu bytes are more than one OpenCL buffer can hold",
                          size);
  if (!mem) return ocl_error(err, "clCreateBuffer");
  if (kind == TDM_MEM_DEVICE) {
    int rc = device_buffer(bdev, mem, size, false, ptr);
    if (rc) clReleaseMemObject(mem);
    return rc;
  }
  void *host = clEnqueueMapBuffer(d->internal, mem, CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, size,
                                  0, NULL, NULL, &err);
  if (!host) {
    clReleaseMemObject(mem);
    return ocl_error(err, "clEnqueueMapBuffer");
  }
  ocl_buf b = {.base = (uintptr_t)host, .size = size, .mem = mem, .bdev = bdev,
               .kind = TDM_MEM_PINNED};
  int rc = insert(&b);
  if (rc) {
    clEnqueueUnmapMemObject(d->internal, mem, host, 0, NULL, NULL);
    clFinish(d->internal);
    clReleaseMemObject(mem);
    return rc;
  }
  *ptr = host;
  return 0;
}

void ocl_mem_free(int bdev, tdm_mem_kind kind, void *ptr) {
  if (kind == TDM_MEM_HOST) {
    free(ptr);
    return;
  }
  ocl_buf b;
  if (!take((uintptr_t)ptr, &b)) return;
  if (b.kind == TDM_MEM_PINNED) {
    clEnqueueUnmapMemObject(ocl_devs[b.bdev].internal, b.mem, ptr, 0, NULL, NULL);
    clFinish(ocl_devs[b.bdev].internal);
  }
  /* The runtime keeps the object until commands using it have completed. */
  clReleaseMemObject(b.mem);
}

int ocl_mem_native(int bdev, void *base, void *ptr, void **native, size_t *offset) {
  ocl_buf b;
  if (!ocl_mem_find(ptr, &b))
    return ocl_svc->error(TDM_EINVAL, 0, "%p is not an OpenCL buffer", ptr);
  *native = b.mem;
  *offset = (uintptr_t)ptr - b.base;
  return 0;
}

int ocl_mem_import(int bdev, void *native, size_t size, void **ptr) {
  cl_mem mem = native;
  cl_context ctx;
  size_t real = 0;
  cl_int err = clGetMemObjectInfo(mem, CL_MEM_CONTEXT, sizeof ctx, &ctx, NULL);
  if (err == CL_SUCCESS) err = clGetMemObjectInfo(mem, CL_MEM_SIZE, sizeof real, &real, NULL);
  if (err != CL_SUCCESS) return ocl_error(err, "clGetMemObjectInfo on the imported cl_mem");
  if (ctx != ocl_devs[bdev].ctx)
    return ocl_svc->error(TDM_EINVAL, 0, "the cl_mem belongs to another context than opencl:%d's",
                          bdev);
  if (size > real)
    return ocl_svc->error(TDM_ERANGE, 0, "import of %zu bytes from a %zu-byte cl_mem", size, real);
  clRetainMemObject(mem);
  int rc = device_buffer(bdev, mem, size, true, ptr);
  if (rc) clReleaseMemObject(mem);
  return rc;
}
