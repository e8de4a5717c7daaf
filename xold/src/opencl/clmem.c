/* clmem.c: OpenCL memory behind tandem's pointers. Device allocations get addresses from a
 * reserved, inaccessible range and are never reused, so any pointer resolves to one cl_mem and
 * an offset (for user kernels and CLBlast). Pinned host memory is a CL_MEM_ALLOC_HOST_PTR
 * buffer mapped for the host. The cl_mem of every allocation is kept in the core's registry
 * entry (tdm__bmem.handle) and comes back with each command and call, so this file keeps no
 * table of its own: only the range's next free address. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ocl.h"

static pthread_mutex_t range_mu = PTHREAD_MUTEX_INITIALIZER;
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
  pthread_mutex_lock(&range_mu);
  if (range_base) munmap((void *)range_base, range_end - range_base);
  range_base = range_next = range_end = 0;
  pthread_mutex_unlock(&range_mu);
}

/* A fresh address range; ranges are never reused, so a stale pointer never aliases. */
static uintptr_t new_range(size_t size) {
  pthread_mutex_lock(&range_mu);
  size_t span = (size + 4095) & ~(size_t)4095;
  uintptr_t p = 0;
  if (span >= size && range_end - range_next >= span) {
    p = range_next;
    range_next += span;
  }
  pthread_mutex_unlock(&range_mu);
  return p;
}

static int device_buffer(cl_mem mem, size_t size, void **ptr, tdm__bmem *bm) {
  uintptr_t p = new_range(size);
  if (!p) return ocl_svc->error(TDM_ENOMEM, 0, "OpenCL address range exhausted");
  bm->handle = mem;
  *ptr = (void *)p;
  return 0;
}

int ocl_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm) {
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
    int rc = device_buffer(mem, size, ptr, bm);
    if (rc) clReleaseMemObject(mem);
    return rc;
  }
  void *host = clEnqueueMapBuffer(d->internal, mem, CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, size,
                                  0, NULL, NULL, &err);
  if (!host) {
    clReleaseMemObject(mem);
    return ocl_error(err, "clEnqueueMapBuffer");
  }
  bm->handle = mem;
  *ptr = host;
  return 0;
}

void ocl_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm) {
  if (kind == TDM_MEM_HOST) {
    free(ptr);
    return;
  }
  cl_mem mem = bm->handle;
  if (!mem) return;
  if (kind == TDM_MEM_PINNED) {
    clEnqueueUnmapMemObject(ocl_devs[bdev].internal, mem, ptr, 0, NULL, NULL);
    clFinish(ocl_devs[bdev].internal);
  }
  /* The runtime keeps the object until commands using it have completed. An import was
   * retained by ocl_mem_import, so it is released the same way. */
  clReleaseMemObject(mem);
}

int ocl_mem_native(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                   size_t *offset) {
  if (!bm->handle) return ocl_svc->error(TDM_EINVAL, 0, "%p is not an OpenCL buffer", ptr);
  *native = bm->handle;
  *offset = (uintptr_t)ptr - (uintptr_t)base;
  return 0;
}

int ocl_mem_import(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm) {
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
  int rc = device_buffer(mem, size, ptr, bm);
  if (rc) clReleaseMemObject(mem);
  return rc;
}
