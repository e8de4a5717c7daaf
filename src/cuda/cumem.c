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
#include "util/spin.h"

#define STAGE_BYTES (8u << 20)
#define COPY_THREADS_MAX 8 /* one host thread cannot keep up with the link; eight nearly can */

/* ---- the memcpy team: host copies over persistent threads (pageable memory and staging) ----
 * A fork-join team, not a FIFO: the executor posts a job and copies the first slice itself,
 * and each helper copies one slice of the same job. The helpers, started on first use, spin
 * briefly for the next job (a staged copy posts one every few hundred microseconds) and then
 * sleep. One job at a time (staging on several devices at once takes turns). */

typedef struct memcpy_team {
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
} memcpy_team;

static memcpy_team team = {.use_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
                           .go = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

static void copy_slice(int i) {
  size_t off = (size_t)i * team.per;
  if (off < team.n)
    memcpy(team.dst + off, team.src + off, team.n - off < team.per ? team.n - off : team.per);
}

static void *helper_main(void *arg) {
  int i = *(int *)arg;
  /* Not the current gen: a job may have been posted before this thread got to run. */
  unsigned seen = team.start_gen;
  for (;;) {
    /* Spin a little (about 100 us) before sleeping: the next chunk usually comes soon. */
    for (int k = 0; k < 20000 && atomic_load_explicit(&team.gen, memory_order_acquire) == seen; k++)
      tdm__relax();
    pthread_mutex_lock(&team.mu);
    while (atomic_load(&team.gen) == seen && !team.stop) pthread_cond_wait(&team.go, &team.mu);
    bool stop = team.stop;
    pthread_mutex_unlock(&team.mu);
    if (stop) return NULL;
    seen = atomic_load(&team.gen);
    copy_slice(i);
    if (atomic_fetch_sub_explicit(&team.remaining, 1, memory_order_acq_rel) == 1) {
      pthread_mutex_lock(&team.mu);
      pthread_cond_signal(&team.done);
      pthread_mutex_unlock(&team.mu);
    }
  }
}

/* Starts the helpers once; called with use_mu held. */
static void team_start(void) {
  if (team.nthreads) return;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int want = cpus >= COPY_THREADS_MAX ? COPY_THREADS_MAX : (cpus > 1 ? (int)cpus : 1);
  team.nthreads = 1;
  team.start_gen = atomic_load(&team.gen);
  for (int i = 1; i < want; i++) {
    team.index[i] = i;
    if (pthread_create(&team.th[i], NULL, helper_main, &team.index[i])) break;
    team.nthreads++;
  }
}

static void team_stop(void) {
  pthread_mutex_lock(&team.use_mu);
  pthread_mutex_lock(&team.mu);
  team.stop = true;
  pthread_cond_broadcast(&team.go);
  pthread_mutex_unlock(&team.mu);
  for (int i = 1; i < team.nthreads; i++) pthread_join(team.th[i], NULL);
  team.nthreads = 0;
  team.stop = false;
  pthread_mutex_unlock(&team.use_mu);
}

/* memcpy split over the team for large blocks; called with use_mu held. */
static void par_memcpy(void *dst, const void *src, size_t n) {
  if (n < ((size_t)1 << 20) || team.nthreads < 2) {
    memcpy(dst, src, n);
    return;
  }
  int t = team.nthreads;
  team.dst = dst;
  team.src = src;
  team.n = n;
  team.per = ((n + (size_t)t - 1) / (size_t)t + 4095) & ~(size_t)4095; /* t slices cover n */
  atomic_store(&team.remaining, t - 1);
  pthread_mutex_lock(&team.mu);
  atomic_fetch_add_explicit(&team.gen, 1, memory_order_release);
  pthread_cond_broadcast(&team.go);
  pthread_mutex_unlock(&team.mu);
  copy_slice(0);
  for (int k = 0; k < 20000 && atomic_load_explicit(&team.remaining, memory_order_acquire); k++)
    tdm__relax();
  pthread_mutex_lock(&team.mu);
  while (atomic_load(&team.remaining)) pthread_cond_wait(&team.done, &team.mu);
  pthread_mutex_unlock(&team.mu);
}

void cu_memcpy_team_stop(void) { team_stop(); }

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
  pthread_mutex_lock(&team.use_mu);
  team_start();
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
  pthread_mutex_unlock(&team.use_mu);
  if (e == cudaSuccess) e = cudaStreamSynchronize(d->internal);
  pthread_mutex_unlock(&d->stage_mu);
  rc = e == cudaSuccess ? 0 : cu_error(e, "staging a pageable copy");
  cu_leave(saved);
  return rc;
}
