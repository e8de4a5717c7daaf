/* pinned.c: `bench-cuda pinned`: pinned host <-> device bandwidth through tandem against raw
 * CUDA, sizes 4 KiB to --max-size (1 GiB) in powers of 4.
 *
 * tandem: tdm_memcpy on a tandem queue from / to TDM_MEM_PINNED memory, then tdm_queue_sync.
 * raw:    cudaMemcpyAsync on a non-blocking stream from / to cudaHostAlloc memory, then
 *         cudaStreamSynchronize.
 * Each repetition times, on the host clock, a batch of copies of one size (enough to move
 * --max-size bytes, at most 1000 copies, each to its own offset) and the sync after it, so that
 * the sync's own latency weighs little from 1 MiB on; tandem and raw
 * alternate which goes first. Reported: GB/s (1e9 bytes/s) of the medians, and the ratio. Goal
 * printed: tandem >= 0.97x raw from 1 MiB on.
 * Checks, per size and side, on random data: device and host destination cleared, the H2D batch,
 * the device read back (raw) and compared with the source; host destination cleared, the D2H
 * batch, compared with the source. These runs are also the warm-up.
 */
#include "bcuda.h"

#include "measure.h"

#include <stdlib.h>
#include <string.h>

#define GOAL_RATIO 0.97
#define GOAL_FROM MIB
#define MAX_COPIES 1000L
#define MIN_SIZE (4 * KIB)

typedef struct side {
  const char *name;
  unsigned char *src, *dst; /* pinned host, max bytes each */
  unsigned char *dev;       /* device, max bytes */
  void *dev_native;
} side;

typedef struct pn {
  bc_ctx *c;
  size_t max;
  size_t size; /* the size being measured, */
  long copies; /* and the number of copies per batch */
  tdm_queue *q;
  cudaStream_t s, check;
  side t, r; /* tandem, raw */
} pn;

/* Copies per batch: they fill the buffers of max bytes, at most MAX_COPIES of them. */
static long copies_for(size_t size, size_t max) {
  size_t k = max / size;
  return k > (size_t)MAX_COPIES ? MAX_COPIES : k < 1 ? 1 : (long)k;
}

/* One batch of p->copies copies of p->size bytes in direction h2d (else d2h), and the sync. */
static int tandem_batch(pn *p, int h2d, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (long i = 0; i < p->copies; i++) {
    size_t off = (size_t)i * p->size;
    if (h2d)
      CK_TDM(tdm_memcpy(p->q, p->t.dev + off, p->t.src + off, p->size, TDM_COPY_H2D, 0, NULL,
                        NULL));
    else
      CK_TDM(tdm_memcpy(p->q, p->t.dst + off, p->t.dev + off, p->size, TDM_COPY_D2H, 0, NULL,
                        NULL));
  }
  CK_TDM(tdm_queue_sync(p->q));
  *sec = bu_seconds() - t0;
  rc = 0;
out:
  return rc;
}

static int raw_batch(pn *p, int h2d, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (long i = 0; i < p->copies; i++) {
    size_t off = (size_t)i * p->size;
    if (h2d)
      CK_CUDA(cudaMemcpyAsync(p->r.dev + off, p->r.src + off, p->size, cudaMemcpyHostToDevice,
                              p->s));
    else
      CK_CUDA(cudaMemcpyAsync(p->r.dst + off, p->r.dev + off, p->size, cudaMemcpyDeviceToHost,
                              p->s));
  }
  CK_CUDA(cudaStreamSynchronize(p->s));
  *sec = bu_seconds() - t0;
  rc = 0;
out:
  return rc;
}

static int batch(pn *p, int tandem, int h2d, double *sec) {
  return tandem ? tandem_batch(p, h2d, sec) : raw_batch(p, h2d, sec);
}

/* Runs one batch each way for a side and checks what landed (see the file's comment). */
static int verify(pn *p, int tandem) {
  side *sd = tandem ? &p->t : &p->r;
  size_t bytes = (size_t)p->copies * p->size;
  char what[96], sz[32];
  double unused;
  int rc = -1;
  bc_format_size(p->size, sz, sizeof sz);
  memset(sd->dst, 0, bytes);
  CK_CUDA(cudaMemsetAsync(sd->dev_native, 0, bytes, p->check));
  CK_CUDA(cudaStreamSynchronize(p->check));
  if (batch(p, tandem, 1, &unused) < 0)
    goto out;
  CK_CUDA(cudaMemcpyAsync(sd->dst, sd->dev_native, bytes, cudaMemcpyDeviceToHost, p->check));
  CK_CUDA(cudaStreamSynchronize(p->check));
  snprintf(what, sizeof what, "%s H2D, %ld copies of %s", sd->name, p->copies, sz);
  if (bc_compare(sd->dst, sd->src, bytes, what) < 0)
    goto out;
  memset(sd->dst, 0, bytes);
  if (batch(p, tandem, 0, &unused) < 0)
    goto out;
  snprintf(what, sizeof what, "%s D2H, %ld copies of %s", sd->name, p->copies, sz);
  rc = bc_compare(sd->dst, sd->src, bytes, what);
out:
  return rc;
}

typedef struct row {
  size_t size;
  long copies;
  double gbps[2][2]; /* [h2d, d2h][tandem, raw] */
} row;

static int measure_size(pn *p, row *r) {
  long reps = p->c->opt->reps;
  double *t = calloc(4 * (size_t)reps, sizeof *t);
  int rc = -1;
  CK(t, "out of host memory");
  if (verify(p, 1) < 0 || verify(p, 0) < 0)
    goto out;
  for (long i = 0; i < reps; i++)
    for (int dir = 0; dir < 2; dir++)
      for (int k = 0; k < 2; k++) {
        int tandem = (i + k) % 2 == 0; /* tandem first on even reps */
        if (batch(p, tandem, dir == 0, &t[((size_t)dir * 2 + !tandem) * (size_t)reps + i]) < 0)
          goto out;
      }
  r->size = p->size;
  r->copies = p->copies;
  for (int dir = 0; dir < 2; dir++)
    for (int s = 0; s < 2; s++)
      r->gbps[dir][s] = (double)p->copies * (double)p->size /
                        bu_median(&t[((size_t)dir * 2 + s) * (size_t)reps], (size_t)reps) / 1e9;
  rc = 0;
out:
  free(t);
  return rc;
}

static int setup(pn *p) {
  int rc = -1;
  tdm_device *dev = p->c->dev;
  p->t.name = "tandem";
  p->r.name = "raw";
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &p->q));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, p->max, (void **)&p->t.src));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, p->max, (void **)&p->t.dst));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, p->max, (void **)&p->t.dev));
  CK(p->t.dev_native = bc_native(p->t.dev), "no native pointer for tandem device memory");
  CK_CUDA(cudaStreamCreateWithFlags(&p->s, cudaStreamNonBlocking));
  CK_CUDA(cudaStreamCreateWithFlags(&p->check, cudaStreamNonBlocking));
  CK_CUDA(cudaHostAlloc((void **)&p->r.src, p->max, cudaHostAllocDefault));
  CK_CUDA(cudaHostAlloc((void **)&p->r.dst, p->max, cudaHostAllocDefault));
  CK_CUDA(cudaMalloc((void **)&p->r.dev, p->max));
  p->r.dev_native = p->r.dev;
  bc_fill_random(p->t.src, p->max, bc_next_seed(p->c));
  memcpy(p->r.src, p->t.src, p->max);
  rc = 0;
out:
  return rc;
}

static void teardown(pn *p) {
  if (p->q)
    TDM_CALL(tdm_queue_destroy(p->q));
  unsigned char *tandem_mem[] = {p->t.src, p->t.dst, p->t.dev};
  for (int i = 0; i < 3; i++)
    if (tandem_mem[i])
      TDM_CALL(tdm_free(tandem_mem[i]));
  if (p->s)
    CUDA_CALL(cudaStreamDestroy(p->s));
  if (p->check)
    CUDA_CALL(cudaStreamDestroy(p->check));
  if (p->r.src)
    CUDA_CALL(cudaFreeHost(p->r.src));
  if (p->r.dst)
    CUDA_CALL(cudaFreeHost(p->r.dst));
  if (p->r.dev)
    CUDA_CALL(cudaFree(p->r.dev));
}

int bench_pinned(bc_ctx *c, bu_json *json) {
  pn p = {.c = c, .max = c->opt->max_size};
  row rows[16];
  int nrows = 0, rc = -1;
  double min_ratio[2] = {0, 0};
  int goal_rows = 0;
  printf("\npinned: pinned host <-> device bandwidth in GB/s (1e9 B/s), host clock around a batch\n"
         "of copies and the sync, median of %ld reps; raw = cudaMemcpyAsync on a raw stream\n",
         c->opt->reps);
  printf("  %9s %6s | %8s %8s %7s | %8s %8s %7s\n", "size", "copies", "H2D tdm", "raw", "ratio",
         "D2H tdm", "raw", "ratio");
  fflush(stdout);
  if (setup(&p) < 0)
    goto out;
  for (size_t size = MIN_SIZE; size <= p.max && nrows < 16; size *= 4) {
    row *r = &rows[nrows];
    char sz[32];
    p.size = size;
    p.copies = copies_for(size, p.max);
    if (measure_size(&p, r) < 0)
      goto out;
    nrows++;
    bc_format_size(size, sz, sizeof sz);
    double ratio[2] = {r->gbps[0][0] / r->gbps[0][1], r->gbps[1][0] / r->gbps[1][1]};
    printf("  %9s %6ld | %8.2f %8.2f %6.3fx | %8.2f %8.2f %6.3fx\n", sz, r->copies, r->gbps[0][0],
           r->gbps[0][1], ratio[0], r->gbps[1][0], r->gbps[1][1], ratio[1]);
    fflush(stdout);
    if (size >= GOAL_FROM) {
      for (int d = 0; d < 2; d++)
        if (!goal_rows || ratio[d] < min_ratio[d])
          min_ratio[d] = ratio[d];
      goal_rows++;
    }
  }
  int met = goal_rows && min_ratio[0] >= GOAL_RATIO && min_ratio[1] >= GOAL_RATIO;
  if (goal_rows)
    printf("  goal >= %.2fx from 1 MiB: H2D min %.3fx, D2H min %.3fx: %s\n", GOAL_RATIO,
           min_ratio[0], min_ratio[1], met ? "met" : "missed");
  else
    printf("  goal >= %.2fx from 1 MiB: no size measured reaches 1 MiB\n", GOAL_RATIO);

  bu_json_object(json, NULL);
  bu_json_int(json, "reps", c->opt->reps);
  bu_json_uint(json, "batch_bytes_max", p.max);
  bu_json_int(json, "max_copies", MAX_COPIES);
  bu_json_string(json, "unit", "GB/s (1e9 bytes per second) of the median batch time");
  bu_json_array(json, "results");
  for (int i = 0; i < nrows; i++) {
    const row *r = &rows[i];
    bu_json_object(json, NULL);
    bu_json_uint(json, "size", r->size);
    bu_json_int(json, "copies", r->copies);
    bu_json_double(json, "h2d_tandem_gbps", r->gbps[0][0], 3);
    bu_json_double(json, "h2d_raw_gbps", r->gbps[0][1], 3);
    bu_json_double(json, "h2d_ratio", r->gbps[0][0] / r->gbps[0][1], 4);
    bu_json_double(json, "d2h_tandem_gbps", r->gbps[1][0], 3);
    bu_json_double(json, "d2h_raw_gbps", r->gbps[1][1], 3);
    bu_json_double(json, "d2h_ratio", r->gbps[1][0] / r->gbps[1][1], 4);
    bu_json_end(json);
  }
  bu_json_end(json);
  bu_json_double(json, "goal_ratio_min", GOAL_RATIO, 2);
  bu_json_uint(json, "goal_from_size", (size_t)GOAL_FROM);
  if (goal_rows) {
    bu_json_double(json, "h2d_min_ratio", min_ratio[0], 4);
    bu_json_double(json, "d2h_min_ratio", min_ratio[1], 4);
    bu_json_bool(json, "goal_met", met);
  } else {
    bu_json_null(json, "h2d_min_ratio");
    bu_json_null(json, "d2h_min_ratio");
    bu_json_null(json, "goal_met");
  }
  bu_json_end(json);
  rc = 0;
out:
  teardown(&p);
  return rc;
}
