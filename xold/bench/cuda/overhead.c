/* overhead.c: `bench-cuda overhead`: what a tandem call costs on the host on top of the raw CUDA
 * call it stands for, on streams of the same device, with the same sizes.
 *
 *   submit  tdm_memcpy of 4 bytes pinned->device, no out event   vs  cudaMemcpyAsync
 *   record  tdm_event_record + tdm_event_release                  vs  cudaEventRecord (one event,
 *                                                                     re-recorded, no timing)
 *   wait    tdm_queue_wait on queue B for an event of queue A      vs  cudaStreamWaitEvent
 *           that is still pending (A is busy with 4 copies of 256 MiB, about 20 ms; whether
 *           it still was at the end of the loop is reported)
 *   wait    the same on an event that has completed (the queue was synced)
 *   sync    4-byte copy then tdm_queue_sync                        vs  cudaMemcpyAsync +
 *           (a round trip; reported, no goal)                          cudaStreamSynchronize
 *
 * Each repetition times `iters` calls back to back on the host clock, then drains the queue
 * untimed; tandem and raw alternate which goes first, rep by rep. Medians per call and their
 * ratio are reported, with each figure's goal (the largest ratio that meets it):
 *   submit 1.10x, and a wait on a completed event 1.10x: a copy and a wait that is no command
 *     at all have little for tandem to add;
 *   record 2.0x: a record also makes the event that the host can query, wait for and chain
 *     across backends, and tracks it (issue 15);
 *   wait on a pending event 1.5x: a command, tracked, whose event the queue keeps (issue 15).
 * Each side has its own memory (tdm_malloc / cudaHostAlloc + cudaMalloc). After every
 * repetition of the copies the 4 bytes on the device are read back and compared with the value
 * the host wrote for that repetition (random, never zero).
 */
#include "bcuda.h"

#include "measure.h"

#include <stdlib.h>
#include <string.h>

/* The goals, per figure (above). */
#define GOAL_SUBMIT 1.10
#define GOAL_RECORD 2.0
#define GOAL_WAIT_PENDING 1.5
#define GOAL_WAIT_COMPLETED 1.10
#define GATE_BYTES (256 * MIB)
#define GATE_COPIES 4 /* of GATE_BYTES each, before the gate event: about 20 ms at 55 GB/s */
#define SMALL 4096 /* the small buffers; the copies use their first 4 bytes */

typedef struct oh {
  bc_ctx *c;
  long iters;
  uint32_t value; /* what the copies of the current repetition carry */
  /* tandem side */
  tdm_queue *qa, *qb;
  unsigned char *t_pin, *t_dev, *t_gate_src, *t_gate_dst;
  void *t_dev_native;
  /* raw side */
  cudaStream_t sa, sb, check;
  cudaEvent_t rec, gate;
  unsigned char *r_pin, *r_dev, *r_gate_src, *r_gate_dst;
  uint32_t *readback; /* pinned, for the checks */
  long pending[2];    /* wait: repetitions whose event was still pending at the end, per side */
} oh;

/* A new value for the next repetition's copies: random and never zero. */
static void next_value(oh *o) {
  do
    o->value = (uint32_t)bc_next_seed(o->c);
  while (o->value == 0);
}

/* Reads 4 bytes of device memory back and compares them with the repetition's value. */
static int check_value(oh *o, const void *dev_native, const char *side) {
  int rc = -1;
  *o->readback = 0;
  CK_CUDA(cudaMemcpyAsync(o->readback, dev_native, 4, cudaMemcpyDeviceToHost, o->check));
  CK_CUDA(cudaStreamSynchronize(o->check));
  CK(*o->readback == o->value, "check failed: %s 4-byte copies: device holds 0x%08x, want 0x%08x",
     side, *o->readback, o->value);
  rc = 0;
out:
  return rc;
}

/* ---- the two sides of each figure: time o->iters calls ------------------------------------ */

static int tandem_submit(oh *o, double *sec) {
  int rc = -1;
  next_value(o);
  memcpy(o->t_pin, &o->value, 4);
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_TDM(tdm_memcpy(o->qa, o->t_dev, o->t_pin, 4, TDM_COPY_H2D, 0, NULL, NULL));
  *sec = bu_seconds() - t0;
  CK_TDM(tdm_queue_sync(o->qa));
  rc = check_value(o, o->t_dev_native, "tandem");
out:
  return rc;
}

static int raw_submit(oh *o, double *sec) {
  int rc = -1;
  next_value(o);
  memcpy(o->r_pin, &o->value, 4);
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_CUDA(cudaMemcpyAsync(o->r_dev, o->r_pin, 4, cudaMemcpyHostToDevice, o->sa));
  *sec = bu_seconds() - t0;
  CK_CUDA(cudaStreamSynchronize(o->sa));
  rc = check_value(o, o->r_dev, "raw");
out:
  return rc;
}

static int tandem_record(oh *o, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++) {
    tdm_event *ev;
    CK_TDM(tdm_event_record(o->qa, &ev));
    CK_TDM(tdm_event_release(ev));
  }
  *sec = bu_seconds() - t0;
  CK_TDM(tdm_queue_sync(o->qa));
  rc = 0;
out:
  return rc;
}

static int raw_record(oh *o, double *sec) {
  int rc = -1;
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_CUDA(cudaEventRecord(o->rec, o->sa));
  *sec = bu_seconds() - t0;
  CK_CUDA(cudaStreamSynchronize(o->sa));
  rc = 0;
out:
  return rc;
}

static int tandem_wait(oh *o, double *sec) {
  int rc = -1;
  tdm_event *gate = NULL;
  for (int i = 0; i < GATE_COPIES; i++)
    CK_TDM(tdm_memcpy(o->qa, o->t_gate_dst, o->t_gate_src, GATE_BYTES, TDM_COPY_H2D, 0, NULL,
                      NULL));
  CK_TDM(tdm_event_record(o->qa, &gate));
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_TDM(tdm_queue_wait(o->qb, gate));
  *sec = bu_seconds() - t0;
  int q = tdm_event_query(gate);
  if (q < 0 && q != TDM_EAGAIN && bc__tdm(q, "tdm_event_query(gate)", __FILE__, __LINE__) < 0)
    goto out;
  o->pending[0] += q == TDM_EAGAIN;
  CK_TDM(tdm_queue_sync(o->qb));
  CK_TDM(tdm_queue_sync(o->qa));
  rc = 0;
out:
  if (gate)
    TDM_CALL(tdm_event_release(gate));
  return rc;
}

static int raw_wait(oh *o, double *sec) {
  int rc = -1;
  for (int i = 0; i < GATE_COPIES; i++)
    CK_CUDA(cudaMemcpyAsync(o->r_gate_dst, o->r_gate_src, GATE_BYTES, cudaMemcpyHostToDevice,
                            o->sa));
  CK_CUDA(cudaEventRecord(o->gate, o->sa));
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_CUDA(cudaStreamWaitEvent(o->sb, o->gate, 0));
  *sec = bu_seconds() - t0;
  cudaError_t q = cudaEventQuery(o->gate);
  if (q != cudaErrorNotReady && bc__cuda(q, "cudaEventQuery(gate)", __FILE__, __LINE__) < 0)
    goto out;
  o->pending[1] += q == cudaErrorNotReady;
  CK_CUDA(cudaStreamSynchronize(o->sb));
  CK_CUDA(cudaStreamSynchronize(o->sa));
  rc = 0;
out:
  return rc;
}

/* A wait on an event that has completed: some implementations take a shortcut, some a slow
 * path, and it is the common case of a consumer that runs late. */
static int tandem_wait_done(oh *o, double *sec) {
  int rc = -1;
  tdm_event *ev = NULL;
  CK_TDM(tdm_event_record(o->qa, &ev));
  CK_TDM(tdm_queue_sync(o->qa));
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_TDM(tdm_queue_wait(o->qb, ev));
  *sec = bu_seconds() - t0;
  CK_TDM(tdm_queue_sync(o->qb));
  rc = 0;
out:
  if (ev)
    TDM_CALL(tdm_event_release(ev));
  return rc;
}

static int raw_wait_done(oh *o, double *sec) {
  int rc = -1;
  CK_CUDA(cudaEventRecord(o->gate, o->sa));
  CK_CUDA(cudaStreamSynchronize(o->sa));
  double t0 = bu_seconds();
  for (long i = 0; i < o->iters; i++)
    CK_CUDA(cudaStreamWaitEvent(o->sb, o->gate, 0));
  *sec = bu_seconds() - t0;
  CK_CUDA(cudaStreamSynchronize(o->sb));
  rc = 0;
out:
  return rc;
}

/* Round trips are slower: a tenth as many per repetition. */
static long round_trips(const oh *o) { return o->iters / 10 > 10 ? o->iters / 10 : 10; }

static int tandem_sync(oh *o, double *sec) {
  int rc = -1;
  next_value(o);
  memcpy(o->t_pin, &o->value, 4);
  double t0 = bu_seconds();
  for (long i = 0; i < round_trips(o); i++) {
    CK_TDM(tdm_memcpy(o->qa, o->t_dev, o->t_pin, 4, TDM_COPY_H2D, 0, NULL, NULL));
    CK_TDM(tdm_queue_sync(o->qa));
  }
  *sec = bu_seconds() - t0;
  rc = check_value(o, o->t_dev_native, "tandem");
out:
  return rc;
}

static int raw_sync(oh *o, double *sec) {
  int rc = -1;
  next_value(o);
  memcpy(o->r_pin, &o->value, 4);
  double t0 = bu_seconds();
  for (long i = 0; i < round_trips(o); i++) {
    CK_CUDA(cudaMemcpyAsync(o->r_dev, o->r_pin, 4, cudaMemcpyHostToDevice, o->sa));
    CK_CUDA(cudaStreamSynchronize(o->sa));
  }
  *sec = bu_seconds() - t0;
  rc = check_value(o, o->r_dev, "raw");
out:
  return rc;
}

typedef struct figure {
  const char *key, *label;
  int (*tandem)(oh *, double *);
  int (*raw)(oh *, double *);
  double goal; /* the largest ratio that meets the figure's goal; 0: it has none */
  int sync;    /* calls per repetition: round_trips() instead of iters */
} figure;

static const figure figures[] = {
    {"submit_copy_4b", "submit: 4 B pinned->device copy, no event", tandem_submit, raw_submit,
     GOAL_SUBMIT, 0},
    {"record", "record: marker + release", tandem_record, raw_record, GOAL_RECORD, 0},
    {"wait", "device-side wait on a pending event", tandem_wait, raw_wait, GOAL_WAIT_PENDING, 0},
    {"wait_completed", "device-side wait on a completed event", tandem_wait_done, raw_wait_done,
     GOAL_WAIT_COMPLETED, 0},
    {"sync_round_trip", "round trip: 4 B copy + queue sync", tandem_sync, raw_sync, 0, 1},
};
#define NFIG (sizeof figures / sizeof figures[0])

typedef struct result {
  double tandem_us, raw_us, ratio;
} result;

typedef struct side_arg {
  oh *o;
  const figure *f;
} side_arg;

static int side(void *p, int baseline, double *seconds) {
  side_arg *a = p;
  return baseline ? a->f->raw(a->o, seconds) : a->f->tandem(a->o, seconds);
}

/* Counts the timed repetitions only. */
static void warmed(void *p) {
  oh *o = ((side_arg *)p)->o;
  o->pending[0] = o->pending[1] = 0;
}

static int measure(oh *o, const figure *f, result *r) {
  side_arg a = {o, f};
  double t, rt;
  int rc = bu_interleaved(&a, side, warmed, o->c->opt->reps, &t, &rt);
  CK(rc != -2, "out of host memory");
  if (rc < 0)
    goto out;
  double calls = (double)(f->sync ? round_trips(o) : o->iters);
  r->tandem_us = t / calls * 1e6;
  r->raw_us = rt / calls * 1e6;
  r->ratio = r->tandem_us / r->raw_us;
out:
  return rc;
}

/* ---- setup and teardown --------------------------------------------------------------------- */

static int setup(oh *o) {
  int rc = -1;
  tdm_device *dev = o->c->dev;
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &o->qa));
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &o->qb));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, SMALL, (void **)&o->t_pin));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, SMALL, (void **)&o->t_dev));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, GATE_BYTES, (void **)&o->t_gate_src));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, GATE_BYTES, (void **)&o->t_gate_dst));
  CK(o->t_dev_native = bc_native(o->t_dev), "no native pointer for tandem device memory");

  CK_CUDA(cudaStreamCreateWithFlags(&o->sa, cudaStreamNonBlocking));
  CK_CUDA(cudaStreamCreateWithFlags(&o->sb, cudaStreamNonBlocking));
  CK_CUDA(cudaStreamCreateWithFlags(&o->check, cudaStreamNonBlocking));
  CK_CUDA(cudaEventCreateWithFlags(&o->rec, cudaEventDisableTiming));
  CK_CUDA(cudaEventCreateWithFlags(&o->gate, cudaEventDisableTiming));
  CK_CUDA(cudaHostAlloc((void **)&o->r_pin, SMALL, cudaHostAllocDefault));
  CK_CUDA(cudaMalloc((void **)&o->r_dev, SMALL));
  CK_CUDA(cudaHostAlloc((void **)&o->r_gate_src, GATE_BYTES, cudaHostAllocDefault));
  CK_CUDA(cudaMalloc((void **)&o->r_gate_dst, GATE_BYTES));
  CK_CUDA(cudaHostAlloc((void **)&o->readback, sizeof *o->readback, cudaHostAllocDefault));
  /* The gate copies' content does not matter, but is not left uninitialized. */
  bc_fill_random(o->t_gate_src, GATE_BYTES, bc_next_seed(o->c));
  memcpy(o->r_gate_src, o->t_gate_src, GATE_BYTES);
  rc = 0;
out:
  return rc;
}

static void teardown(oh *o) {
  if (o->qa)
    TDM_CALL(tdm_queue_destroy(o->qa));
  if (o->qb)
    TDM_CALL(tdm_queue_destroy(o->qb));
  unsigned char *tandem_mem[] = {o->t_pin, o->t_dev, o->t_gate_src, o->t_gate_dst};
  for (size_t i = 0; i < sizeof tandem_mem / sizeof *tandem_mem; i++)
    if (tandem_mem[i])
      TDM_CALL(tdm_free(tandem_mem[i]));
  cudaStream_t streams[] = {o->sa, o->sb, o->check};
  for (size_t i = 0; i < 3; i++)
    if (streams[i])
      CUDA_CALL(cudaStreamDestroy(streams[i]));
  if (o->rec)
    CUDA_CALL(cudaEventDestroy(o->rec));
  if (o->gate)
    CUDA_CALL(cudaEventDestroy(o->gate));
  if (o->r_pin)
    CUDA_CALL(cudaFreeHost(o->r_pin));
  if (o->r_gate_src)
    CUDA_CALL(cudaFreeHost(o->r_gate_src));
  if (o->readback)
    CUDA_CALL(cudaFreeHost(o->readback));
  if (o->r_dev)
    CUDA_CALL(cudaFree(o->r_dev));
  if (o->r_gate_dst)
    CUDA_CALL(cudaFree(o->r_gate_dst));
}

int bench_overhead(bc_ctx *c, bu_json *json) {
  oh o = {.c = c, .iters = c->opt->iters};
  result res[NFIG];
  int rc = -1;
  printf("\noverhead: host time per call, median of %ld reps x %ld calls (round trips: %ld);\n"
         "raw = the CUDA call it stands for, on a stream of the same device\n",
         c->opt->reps, o.iters, round_trips(&o));
  printf("  %-44s %11s %11s %8s\n", "call", "tandem", "raw", "ratio");
  fflush(stdout);
  if (setup(&o) < 0)
    goto out;
  bu_json_object(json, NULL);
  bu_json_int(json, "iterations", o.iters);
  bu_json_int(json, "round_trips", round_trips(&o));
  bu_json_int(json, "reps", c->opt->reps);
  bu_json_string(json, "unit", "microseconds per call, median over reps");
  bu_json_array(json, "results");
  for (size_t i = 0; i < NFIG; i++) {
    const figure *f = &figures[i];
    if (measure(&o, f, &res[i]) < 0)
      goto out;
    printf("  %-44s %8.3f us %8.3f us %7.3fx", f->label, res[i].tandem_us, res[i].raw_us,
           res[i].ratio);
    if (f->goal > 0)
      printf("   goal <= %.2fx: %s", f->goal, res[i].ratio <= f->goal ? "met" : "missed");
    bu_json_object(json, NULL);
    bu_json_string(json, "name", f->key);
    bu_json_string(json, "description", f->label);
    bu_json_double(json, "tandem_us", res[i].tandem_us, 4);
    bu_json_double(json, "raw_us", res[i].raw_us, 4);
    bu_json_double(json, "ratio", res[i].ratio, 4);
    if (f->goal > 0) {
      bu_json_double(json, "goal_ratio_max", f->goal, 2);
      bu_json_bool(json, "goal_met", res[i].ratio <= f->goal);
    }
    if (f->tandem == tandem_wait) {
      /* A wait on a completed event may take a shortcut; say whether this one was pending. */
      printf("   (event pending at the end: tandem %ld/%ld, raw %ld/%ld reps)", o.pending[0],
             c->opt->reps, o.pending[1], c->opt->reps);
      bu_json_int(json, "pending_reps_tandem", o.pending[0]);
      bu_json_int(json, "pending_reps_raw", o.pending[1]);
    }
    bu_json_end(json);
    putchar('\n');
    fflush(stdout);
  }
  bu_json_end(json);
  bu_json_end(json);
  rc = 0;
out:
  teardown(&o);
  return rc;
}
