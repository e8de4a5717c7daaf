/* pageable.c: `bench-cuda pageable`: host-to-device copies from pageable (malloc'd) memory.
 *
 * Four contenders, measured in the same run, rep by rep in rotating order, on one pageable
 * source filled with random data (its pages touched before timing):
 *   tandem        tdm_memcpy from the malloc'd source + tdm_queue_sync (tandem stages it
 *                 through its pinned ring in stream order)
 *   raw pageable  cudaMemcpyAsync from the same source on a raw stream + cudaStreamSynchronize
 *   raw pinned    cudaMemcpyAsync from cudaHostAlloc memory (the link's limit)
 *   host memcpy   N threads copying the source into pinned memory (the host's limit for the
 *                 staging step)
 * Sizes 64 MiB and 1 GiB (capped by --max-size). Reported: GB/s (1e9 B/s) of the median times,
 * tandem / raw pageable (goal >= 2x) and tandem / min(raw pinned, host memcpy) (goal >= 0.8x).
 * Checks, once per size and contender before timing (also the warm-up): the destination is
 * cleared, the copy runs, the destination is read back and compared with the source.
 */
#include "bcuda.h"

#include "measure.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define GOAL_VS_PAGEABLE 2.0
#define GOAL_VS_LIMIT 0.8

/* ---- a pool of threads that copy one buffer into another, each a slice -------------------- */

typedef struct pool {
  pthread_t th[64];
  long n; /* threads started */
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  unsigned long gen; /* bumped for each job */
  long remaining;    /* threads still copying the current job */
  int quit;
  unsigned char *dst;
  const unsigned char *src;
  size_t bytes;
} pool;

typedef struct worker_arg {
  pool *p;
  long index;
} worker_arg;

static worker_arg worker_args[64];

static void *worker_main(void *arg) {
  worker_arg *w = arg;
  pool *p = w->p;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->gen == seen && !p->quit)
      pthread_cond_wait(&p->go, &p->mu);
    if (p->quit)
      break;
    seen = p->gen;
    size_t lo = p->bytes * (size_t)w->index / (size_t)p->n;
    size_t hi = p->bytes * (size_t)(w->index + 1) / (size_t)p->n;
    unsigned char *dst = p->dst;
    const unsigned char *src = p->src;
    pthread_mutex_unlock(&p->mu);
    memcpy(dst + lo, src + lo, hi - lo);
    pthread_mutex_lock(&p->mu);
    if (--p->remaining == 0)
      pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static void pool_stop(pool *p) {
  pthread_mutex_lock(&p->mu);
  p->quit = 1;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (long i = 0; i < p->n; i++)
    pthread_join(p->th[i], NULL);
  p->n = 0;
  pthread_cond_destroy(&p->done);
  pthread_cond_destroy(&p->go);
  pthread_mutex_destroy(&p->mu);
}

static int pool_start(pool *p, long n) {
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->go, NULL);
  pthread_cond_init(&p->done, NULL);
  for (p->n = 0; p->n < n; p->n++) {
    worker_args[p->n] = (worker_arg){p, p->n};
    int e = pthread_create(&p->th[p->n], NULL, worker_main, &worker_args[p->n]);
    if (e != 0) {
      bc_failf("pthread_create for host memcpy thread %ld: %s", p->n, strerror(e));
      pool_stop(p);
      return -1;
    }
  }
  return 0;
}

/* Copies bytes from src to dst with every thread of the pool; returns when all are done. */
static void pool_copy(pool *p, unsigned char *dst, const unsigned char *src, size_t bytes) {
  pthread_mutex_lock(&p->mu);
  p->dst = dst;
  p->src = src;
  p->bytes = bytes;
  p->remaining = p->n;
  p->gen++;
  pthread_cond_broadcast(&p->go);
  while (p->remaining > 0)
    pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

/* ---- the contenders --------------------------------------------------------------------------- */

enum { TANDEM, RAW_PAGEABLE, RAW_PINNED, HOST_MEMCPY, NCONT };
static const char *const cont_name[NCONT] = {"tandem", "raw pageable", "raw pinned",
                                             "host memcpy"};
static const char *const cont_key[NCONT] = {"tandem", "raw_pageable", "raw_pinned",
                                            "host_memcpy"};

typedef struct pg {
  bc_ctx *c;
  size_t max, size;
  tdm_queue *q;
  unsigned char *t_dev;
  void *t_dev_native;
  cudaStream_t s, check;
  unsigned char *src;   /* pageable, random */
  unsigned char *chk;   /* pageable, for reading back */
  unsigned char *pin;   /* cudaHostAlloc: raw pinned source, host memcpy destination */
  unsigned char *r_dev; /* cudaMalloc */
  pool pool;
  int pool_started;
} pg;

static int run(pg *g, int who, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  switch (who) {
  case TANDEM:
    CK_TDM(tdm_memcpy(g->q, g->t_dev, g->src, g->size, TDM_COPY_H2D, 0, NULL, NULL));
    CK_TDM(tdm_queue_sync(g->q));
    break;
  case RAW_PAGEABLE:
    CK_CUDA(cudaMemcpyAsync(g->r_dev, g->src, g->size, cudaMemcpyHostToDevice, g->s));
    CK_CUDA(cudaStreamSynchronize(g->s));
    break;
  case RAW_PINNED:
    CK_CUDA(cudaMemcpyAsync(g->r_dev, g->pin, g->size, cudaMemcpyHostToDevice, g->s));
    CK_CUDA(cudaStreamSynchronize(g->s));
    break;
  default:
    pool_copy(&g->pool, g->pin, g->src, g->size);
  }
  *sec = bu_seconds() - t0;
  rc = 0;
out:
  return rc;
}

/* Clears the contender's destination, runs it, and compares what landed with the source. The
 * host memcpy goes first: it leaves the pinned buffer equal to the source, which the raw pinned
 * copy then sends. */
static int verify(pg *g, int who) {
  char what[96], sz[32];
  double unused;
  int rc = -1;
  void *dev = who == TANDEM ? g->t_dev_native : g->r_dev;
  bc_format_size(g->size, sz, sizeof sz);
  snprintf(what, sizeof what, "%s H2D of %s", cont_name[who], sz);
  if (who == HOST_MEMCPY) {
    memset(g->pin, 0, g->size);
    if (run(g, who, &unused) < 0)
      goto out;
    rc = bc_compare(g->pin, g->src, g->size, what);
    goto out;
  }
  CK_CUDA(cudaMemsetAsync(dev, 0, g->size, g->check));
  CK_CUDA(cudaStreamSynchronize(g->check));
  if (run(g, who, &unused) < 0)
    goto out;
  memset(g->chk, 0, g->size);
  CK_CUDA(cudaMemcpyAsync(g->chk, dev, g->size, cudaMemcpyDeviceToHost, g->check));
  CK_CUDA(cudaStreamSynchronize(g->check));
  rc = bc_compare(g->chk, g->src, g->size, what);
out:
  return rc;
}

static int measure_size(pg *g, double gbps[NCONT]) {
  static const int verify_order[NCONT] = {HOST_MEMCPY, RAW_PINNED, RAW_PAGEABLE, TANDEM};
  long reps = g->c->opt->reps;
  double *t = calloc(NCONT * (size_t)reps, sizeof *t);
  int rc = -1;
  CK(t, "out of host memory");
  for (int k = 0; k < NCONT; k++)
    if (verify(g, verify_order[k]) < 0)
      goto out;
  for (long i = 0; i < reps; i++)
    for (int k = 0; k < NCONT; k++) {
      int who = (int)((i + k) % NCONT);
      if (run(g, who, &t[(size_t)who * (size_t)reps + i]) < 0)
        goto out;
    }
  for (int k = 0; k < NCONT; k++)
    gbps[k] = (double)g->size / bu_median(&t[(size_t)k * (size_t)reps], (size_t)reps) / 1e9;
  rc = 0;
out:
  free(t);
  return rc;
}

static int setup(pg *g) {
  int rc = -1;
  CK_TDM(tdm_queue_create(g->c->dev, TDM_QUEUE_IN_ORDER, &g->q));
  CK_TDM(tdm_malloc(g->c->dev, TDM_MEM_DEVICE, g->max, (void **)&g->t_dev));
  CK(g->t_dev_native = bc_native(g->t_dev), "no native pointer for tandem device memory");
  CK_CUDA(cudaStreamCreateWithFlags(&g->s, cudaStreamNonBlocking));
  CK_CUDA(cudaStreamCreateWithFlags(&g->check, cudaStreamNonBlocking));
  CK_CUDA(cudaHostAlloc((void **)&g->pin, g->max, cudaHostAllocDefault));
  CK_CUDA(cudaMalloc((void **)&g->r_dev, g->max));
  CK((g->src = malloc(g->max)) && (g->chk = malloc(g->max)), "out of host memory (2 x %zu B)",
     g->max);
  bc_fill_random(g->src, g->max, bc_next_seed(g->c)); /* touches every page */
  memset(g->chk, 0, g->max);
  if (pool_start(&g->pool, g->c->opt->threads) < 0)
    goto out;
  g->pool_started = 1;
  rc = 0;
out:
  return rc;
}

static void teardown(pg *g) {
  if (g->pool_started)
    pool_stop(&g->pool);
  if (g->q)
    TDM_CALL(tdm_queue_destroy(g->q));
  if (g->t_dev)
    TDM_CALL(tdm_free(g->t_dev));
  if (g->s)
    CUDA_CALL(cudaStreamDestroy(g->s));
  if (g->check)
    CUDA_CALL(cudaStreamDestroy(g->check));
  if (g->pin)
    CUDA_CALL(cudaFreeHost(g->pin));
  if (g->r_dev)
    CUDA_CALL(cudaFree(g->r_dev));
  free(g->src);
  free(g->chk);
}

int bench_pageable(bc_ctx *c, bu_json *json) {
  static const size_t sizes[] = {64 * MIB, GIB};
  pg g = {.c = c};
  int rc = -1;
  for (size_t i = 0; i < 2; i++)
    if (sizes[i] <= c->opt->max_size)
      g.max = sizes[i];
  if (!g.max) {
    printf("\npageable: skipped: --max-size is below the smallest size (64 MiB)\n");
    bu_json_object(json, NULL);
    bu_json_string(json, "skipped", "--max-size below 64 MiB");
    bu_json_end(json);
    return 0;
  }
  printf("\npageable: H2D from malloc'd memory in GB/s (1e9 B/s), median of %ld reps, contenders\n"
         "in rotating order; host memcpy = %ld threads copying the source into pinned memory\n",
         c->opt->reps, c->opt->threads);
  printf("  %9s | %8s %8s %8s %8s | %10s %14s\n", "size", "tandem", "raw pgbl", "raw pin",
         "memcpy", "vs raw pgbl", "vs min(pin,cpy)");
  fflush(stdout);
  if (setup(&g) < 0)
    goto out;
  bu_json_object(json, NULL);
  bu_json_int(json, "reps", c->opt->reps);
  bu_json_int(json, "host_memcpy_threads", g.pool.n);
  bu_json_string(json, "unit", "GB/s (1e9 bytes per second) of the median time");
  bu_json_double(json, "goal_vs_raw_pageable_min", GOAL_VS_PAGEABLE, 1);
  bu_json_double(json, "goal_vs_min_pinned_memcpy_min", GOAL_VS_LIMIT, 1);
  bu_json_array(json, "results");
  for (size_t i = 0; i < 2 && sizes[i] <= g.max; i++) {
    double gbps[NCONT];
    char sz[32];
    g.size = sizes[i];
    if (measure_size(&g, gbps) < 0)
      goto out;
    double limit = gbps[RAW_PINNED] < gbps[HOST_MEMCPY] ? gbps[RAW_PINNED] : gbps[HOST_MEMCPY];
    double vs_pageable = gbps[TANDEM] / gbps[RAW_PAGEABLE], vs_limit = gbps[TANDEM] / limit;
    int met_pageable = vs_pageable >= GOAL_VS_PAGEABLE, met_limit = vs_limit >= GOAL_VS_LIMIT;
    bc_format_size(g.size, sz, sizeof sz);
    printf("  %9s | %8.2f %8.2f %8.2f %8.2f | %9.2fx %13.3fx   goals >= %.1fx: %s, >= %.1fx: %s\n",
           sz, gbps[TANDEM], gbps[RAW_PAGEABLE], gbps[RAW_PINNED], gbps[HOST_MEMCPY], vs_pageable,
           vs_limit, GOAL_VS_PAGEABLE, met_pageable ? "met" : "missed", GOAL_VS_LIMIT,
           met_limit ? "met" : "missed");
    fflush(stdout);
    bu_json_object(json, NULL);
    bu_json_uint(json, "size", g.size);
    for (int k = 0; k < NCONT; k++) {
      char name[32];
      snprintf(name, sizeof name, "%s_gbps", cont_key[k]);
      bu_json_double(json, name, gbps[k], 3);
    }
    bu_json_double(json, "vs_raw_pageable", vs_pageable, 4);
    bu_json_double(json, "vs_min_pinned_memcpy", vs_limit, 4);
    bu_json_bool(json, "goal_vs_raw_pageable_met", met_pageable);
    bu_json_bool(json, "goal_vs_min_pinned_memcpy_met", met_limit);
    bu_json_end(json);
  }
  bu_json_end(json);
  bu_json_end(json);
  rc = 0;
out:
  teardown(&g);
  return rc;
}
