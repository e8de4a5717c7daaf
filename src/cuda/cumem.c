/* cumem.c: CUDA memory. Device memory comes from the device's stream-ordered pool, so a
 * stream-ordered free is cudaFreeAsync; pinned memory from cudaHostAlloc; registration with
 * cudaHostRegister. Pageable copies are staged through two pinned buffers on the device's
 * internal stream, by the queue's executor, after earlier work on the queue: in stream order,
 * never at call time. The host side of a staged copy runs on up to eight threads. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cu.h"

#define STAGE_BYTES (8u << 20)
#define COPY_THREADS_MAX 8 /* one host thread cannot keep up with the link; eight nearly can */

/* ---- host copies over a few persistent threads (pageable memory to or from staging) ----
 * The executor posts a job and copies the first slice itself; the helpers, started on first
 * use, spin briefly for the next job (a staged copy posts one every few hundred microseconds)
 * and then sleep. One job at a time (staging on several devices at once takes turns). */

/* A polite busy-wait step. */
static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

typedef struct copy_pool {
  pthread_mutex_t use_mu;        /* one job at a time */
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  _Atomic unsigned gen;          /* bumped per job */
  _Atomic int remaining;         /* helpers still copying the current job */
  int nthreads;                  /* helpers + the caller; 0 until started, 1 if none started */
  bool stop;
  unsigned start_gen;            /* gen when the helpers were started: their first "seen" */
  char *dst;
  const char *src;
  size_t n, per;
  pthread_t th[COPY_THREADS_MAX];
  int index[COPY_THREADS_MAX];
} copy_pool;

static copy_pool pool = {.use_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
                         .go = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static void copy_slice(int i) {
  size_t off = (size_t)i * pool.per;
  if (off < pool.n)
    memcpy(pool.dst + off, pool.src + off, pool.n - off < pool.per ? pool.n - off : pool.per);
}

static void *helper_main(void *arg) {
  int i = *(int *)arg;
  /* Not the current gen: a job may have been posted before this thread got to run. */
  unsigned seen = pool.start_gen;
  for (;;) {
    /* Spin a little (about 100 us) before sleeping: the next chunk usually comes soon. */
    for (int k = 0; k < 20000 && atomic_load_explicit(&pool.gen, memory_order_acquire) == seen; k++)
      relax();
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.gen) == seen && !pool.stop) pthread_cond_wait(&pool.go, &pool.mu);
    bool stop = pool.stop;
    pthread_mutex_unlock(&pool.mu);
    if (stop) return NULL;
    seen = atomic_load(&pool.gen);
    copy_slice(i);
    if (atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_acq_rel) == 1) {
      pthread_mutex_lock(&pool.mu);
      pthread_cond_signal(&pool.done);
      pthread_mutex_unlock(&pool.mu);
    }
  }
}

/* Starts the helpers once; called with use_mu held. */
static void pool_start(void) {
  if (pool.nthreads) return;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int want = cpus >= COPY_THREADS_MAX ? COPY_THREADS_MAX : (cpus > 1 ? (int)cpus : 1);
  pool.nthreads = 1;
  pool.start_gen = atomic_load(&pool.gen);
  for (int i = 1; i < want; i++) {
    pool.index[i] = i;
    if (pthread_create(&pool.th[i], NULL, helper_main, &pool.index[i])) break;
    pool.nthreads++;
  }
}

static void pool_stop(void) {
  pthread_mutex_lock(&pool.use_mu);
  pthread_mutex_lock(&pool.mu);
  pool.stop = true;
  pthread_cond_broadcast(&pool.go);
  pthread_mutex_unlock(&pool.mu);
  for (int i = 1; i < pool.nthreads; i++) pthread_join(pool.th[i], NULL);
  pool.nthreads = 0;
  pool.stop = false;
  pthread_mutex_unlock(&pool.use_mu);
}

/* memcpy over the pool for large blocks; called with use_mu held. */
static void par_memcpy(void *dst, const void *src, size_t n) {
  if (n < ((size_t)1 << 20) || pool.nthreads < 2) {
    memcpy(dst, src, n);
    return;
  }
  int t = pool.nthreads;
  pool.dst = dst;
  pool.src = src;
  pool.n = n;
  pool.per = ((n + (size_t)t - 1) / (size_t)t + 4095) & ~(size_t)4095; /* t slices cover n */
  atomic_store(&pool.remaining, t - 1);
  pthread_mutex_lock(&pool.mu);
  atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
  pthread_cond_broadcast(&pool.go);
  pthread_mutex_unlock(&pool.mu);
  copy_slice(0);
  for (int k = 0; k < 20000 && atomic_load_explicit(&pool.remaining, memory_order_acquire); k++)
    relax();
  pthread_mutex_lock(&pool.mu);
  while (atomic_load(&pool.remaining)) pthread_cond_wait(&pool.done, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
}

void cu_copy_pool_stop(void) { pool_stop(); }

int cu_mem_init(cu_device *d) {
  for (int i = 0; i < 2; i++) {
    cudaError_t e = cudaHostAlloc(&d->stage[i], STAGE_BYTES, cudaHostAllocPortable);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d->stage_done[i], cudaEventDisableTiming);
    if (e != cudaSuccess) return cu_error(e, "allocating the pageable-copy staging buffers");
  }
  return 0;
}

void cu_mem_fini(cu_device *d) {
  for (int i = 0; i < 2; i++) {
    if (d->stage[i]) cudaFreeHost(d->stage[i]);
    if (d->stage_done[i]) cudaEventDestroy(d->stage_done[i]);
  }
}

int cu_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm) {
  if (kind == TDM_MEM_HOST) {
    void *p = malloc(size);
    if (!p) return cu_svc->error(TDM_ENOMEM, 0, "cannot allocate %zu bytes", size);
    *ptr = p;
    return 0;
  }
  int saved, rc = cu_enter(bdev, &saved);
  if (rc) return rc;
  void *p = NULL;
  cudaError_t e;
  if (kind == TDM_MEM_PINNED) {
    e = cudaHostAlloc(&p, size, cudaHostAllocPortable);
  } else {
    /* From the pool on the internal stream, made visible to every stream by the sync. */
    e = cudaMallocAsync(&p, size, cu_devs[bdev].internal);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cu_devs[bdev].internal);
  }
  rc = e == cudaSuccess ? 0 : cu_error(e, kind == TDM_MEM_PINNED ? "cudaHostAlloc" : "cudaMallocAsync");
  cu_leave(saved);
  if (!rc) *ptr = p;
  return rc;
}

/* Imported device memory is flagged in the core's registry entry (TDM__BMEM_IMPORTED), which
 * comes back here: it belongs to other code and is only forgotten. */
void cu_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm) {
  if (kind == TDM_MEM_HOST) {
    free(ptr);
    return;
  }
  if (bm->flags & TDM__BMEM_IMPORTED) return;
  int saved;
  if (cu_enter(bdev, &saved)) return;
  if (kind == TDM_MEM_PINNED)
    cudaFreeHost(ptr);
  else
    cudaFreeAsync(ptr, cu_devs[bdev].internal); /* the caller vouched nothing uses it */
  cu_leave(saved);
}

int cu_host_register(int bdev, void *ptr, size_t size) {
  int saved, rc = cu_enter(bdev, &saved);
  if (rc) return rc;
  cudaError_t e = cudaHostRegister(ptr, size, cudaHostRegisterPortable);
  rc = e == cudaSuccess ? 0 : cu_error(e, "cudaHostRegister");
  cu_leave(saved);
  return rc;
}

void cu_host_unregister(int bdev, void *ptr) {
  int saved;
  if (cu_enter(bdev, &saved)) return;
  cudaHostUnregister(ptr);
  cu_leave(saved);
}

int cu_mem_native(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                  size_t *offset) {
  *native = ptr;
  *offset = 0;
  return 0;
}

int cu_mem_import(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, native);
  if (e != cudaSuccess) return cu_error(e, "cudaPointerGetAttributes on imported memory");
  if (a.type != cudaMemoryTypeDevice || a.device != cu_devs[bdev].ordinal)
    return cu_svc->error(TDM_EINVAL, 0, "%p is not device memory of CUDA device %d", native,
                         cu_devs[bdev].ordinal);
  *ptr = native;
  return 0;
}

/* A copy with pageable host memory on one side, run by the executor once earlier work on the
 * queue is done (the queue's stream is held at a gate meanwhile): chunks go through the two
 * staging buffers on the device's internal stream, the host memcpy of one chunk overlapping the
 * DMA of the other. Host-to-host copies are a memmove. */
int cu_host_copy(tdm__cmd *cmd) {
  char *dst = cmd->u.copy.dst;
  const char *src = cmd->u.copy.src;
  size_t n = cmd->u.copy.n;
  /* The core's registry says which side is device memory and on which device: no pointer
   * queries on this path. */
  const tdm__memref *dm = &cmd->u.copy.d, *sm = &cmd->u.copy.s;
  bool to_dev = dm->kind == TDM_MEM_DEVICE, from_dev = sm->kind == TDM_MEM_DEVICE;
  if (!to_dev && !from_dev) {
    memmove(dst, src, n);
    return 0;
  }
  int bdev = to_dev ? dm->bdev : sm->bdev;
  if (bdev < 0 || bdev >= cu_ndevs)
    return cu_svc->error(TDM_EINVAL, 0, "device memory of no known CUDA device");
  cu_device *d = &cu_devs[bdev];
  int saved, rc = cu_enter(bdev, &saved);
  if (rc) return rc;
  pthread_mutex_lock(&d->stage_mu);
  pthread_mutex_lock(&pool.use_mu);
  pool_start();
  cudaError_t e = cudaSuccess;
  if (to_dev) {
    for (size_t off = 0, k = 0; off < n && e == cudaSuccess; off += STAGE_BYTES, k++) {
      size_t len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
      int b = (int)(k & 1);
      e = cudaEventSynchronize(d->stage_done[b]); /* its previous DMA has drained */
      if (e != cudaSuccess) break;
      par_memcpy(d->stage[b], src + off, len);
      e = cudaMemcpyAsync(dst + off, d->stage[b], len, cudaMemcpyHostToDevice, d->internal);
      if (e == cudaSuccess) e = cudaEventRecord(d->stage_done[b], d->internal);
    }
  } else {
    /* Device to pageable: DMA chunk k+1 while the host copies chunk k out. */
    size_t chunks = (n + STAGE_BYTES - 1) / STAGE_BYTES;
    for (size_t k = 0; k <= chunks && e == cudaSuccess; k++) {
      if (k < chunks) {
        size_t off = k * STAGE_BYTES, len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
        e = cudaMemcpyAsync(d->stage[k & 1], src + off, len, cudaMemcpyDeviceToHost, d->internal);
        if (e == cudaSuccess) e = cudaEventRecord(d->stage_done[k & 1], d->internal);
      }
      if (k > 0 && e == cudaSuccess) {
        size_t j = k - 1, off = j * STAGE_BYTES, len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
        e = cudaEventSynchronize(d->stage_done[j & 1]);
        if (e == cudaSuccess) par_memcpy(dst + off, d->stage[j & 1], len);
      }
    }
  }
  pthread_mutex_unlock(&pool.use_mu);
  if (e == cudaSuccess) e = cudaStreamSynchronize(d->internal);
  pthread_mutex_unlock(&d->stage_mu);
  rc = e == cudaSuccess ? 0 : cu_error(e, "staging a pageable copy");
  cu_leave(saved);
  return rc;
}
