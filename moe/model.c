/* model.c: the MoE model of `tandem moe`: presets with real shapes, seeded bf16 weights
 * generated in parallel into pinned host memory, a synthetic but realistic router (expert
 * popularity follows a Zipf law through a per-layer logit bias; decode tokens are correlated),
 * and the forward pass, whose routed experts come through the expert streamer.
 *
 * Two ways through a layer's routed experts, chosen by the ubatch's size only (so the
 * all-resident reference and a streamed run always take the same one, and their outputs stay
 * bitwise equal):
 * - a large ubatch (more than GROUPED_MAX_T tokens), where the table runs that many rows as
 *   GEMMs (experts_gemm_rows: CUDA), runs experts() as decode does below, the ready experts a
 *   group (never on the host); with every expert resident it routes on the device as decode
 *   does (up to DEVICE_ROUTED_ROWS routing entries), else on the host; elsewhere, or with
 *   TANDEM_MOE_PREFILL_GROUPED=0, expert() per routed expert, a GEMM each, in the streamer's
 *   order, each as its weights land;
 * - a small one (decode) runs experts(): a group of experts per submission, so the host's cost
 *   no longer grows with the experts routed. When every expert is resident the routing never
 *   comes back to the host (group() on the device, then one group of the whole layer), and
 *   where the op table can record (CUDA) a pass's layers are recorded once per ubatch size and
 *   then run as one submission; else
 *   the host groups the tokens, submits the experts that are on the device as one group and
 *   each expert still landing with the ready ones behind it as the next.
 * In that last case, with placement AUTO or HOST, experts that are neither on the device nor
 * on their way may be computed by the host CPU from their pinned copies instead (all of them,
 * or the share a cost model calibrated at creation gives), on host queues joined to the
 * compute queue by device-side waits, while the link copies the rest. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cpu/pool.h"
#include "ops.h"
#include "quant.h"
#include "tandem/moe.h"

const tdm_moe_preset tdm_moe_presets[] = {
    {"tiny", 256, 16, 4, 128, 4, 1, 128, true, "small enough for two CPU cores"},
    {"qwen3-30b-a3b", 2048, 128, 8, 768, 48, 0, 0, true, "Qwen3-30B-A3B"},
    {"qwen3-235b-a22b", 4096, 128, 8, 1536, 94, 0, 0, true, "Qwen3-235B-A22B"},
    {"deepseek-v3", 7168, 256, 8, 2048, 58, 1, 2048, true,
     "DeepSeek-V3's 58 MoE layers; routed by softmax top-k (its sigmoid group routing is not modeled)"},
    {"mixtral-8x7b", 4096, 8, 2, 14336, 32, 0, 0, true, "Mixtral-8x7B"},
};
const int tdm_moe_npresets = (int)(sizeof tdm_moe_presets / sizeof tdm_moe_presets[0]);

const tdm_moe_preset *tdm_moe_preset_find(const char *name) {
  for (int i = 0; i < tdm_moe_npresets; i++)
    if (strcmp(tdm_moe_presets[i].name, name) == 0) return &tdm_moe_presets[i];
  return NULL;
}

size_t tdm_moe_expert_bytes(const tdm_moe_preset *p) { return (size_t)3 * p->hidden * p->ffn * 2; }

size_t tdm_moe_expert_stride(const tdm_moe_preset *p, tdm_moe_wfmt f) {
  if (f.gu == 0 && f.d == 0) return tdm_moe_expert_bytes(p);
  size_t b = tdm_moe_expert_size(f, p->hidden, p->ffn);
  return b && b <= SIZE_MAX - 15 ? (b + 15) / 16 * 16 : 0;
}

size_t tdm_moe_host_bytes(const tdm_moe_preset *p, int layers) {
  return tdm_moe_expert_bytes(p) * (size_t)p->experts * (size_t)layers;
}

/* Ubatches of at most this many tokens compute their experts in groups (experts()); larger
 * ones run a GEMM per expert. At 32 tokens and top-8 of 128 experts an expert averages two
 * tokens: matrix-vector work, which the grouped kernels do at the weights' bandwidth. */
#define GROUPED_MAX_T 32
#define DEVICE_ROUTED_ROWS 16384 /* the most routing entries (T k) a device-routed pass sorts */
#define PREFILL_GROUP 8 /* experts a large ubatch's group waits for, where one is landing */

/* time_chain's markers in a layer, in the order the compute queue passes them. */
enum { CHAIN_ROUTED, CHAIN_STARTED, CHAIN_DEVICE, CHAIN_JOINED, CHAIN_COMBINED, CHAIN_MARKS };

struct tdm_moe_model {
  tdm_moe_config cfg;
  tdm_moe_preset p;
  int L, H, E, k, I;
  size_t ebytes;              /* one routed expert's bytes (tdm_moe_expert_stride) */
  tdm_moe_wfmt *fmt;          /* [L]: each layer's routed experts' format (bf16: {BF16, BF16}) */
  bool quant;                 /* a format is not bf16: the ops' expert_q() and experts_q() */
  float eps;                  /* the RMSNorm's epsilon */
  const tdm_moe_ops *ops;
  void *ops_state;
  tdm_queue *q;
  tdm_moe_bf16 *host_experts;     /* pinned: L * E experts (a shard's: the first device's) */
  void *host_map;                 /* host_experts' mapping when registered (host_experts_alloc) */
  size_t host_map_bytes;
  const void **host_ptrs;     /* per key */
  /* expert parallelism (cfg.ndevices > 1: "the other devices' share of a layer" below) */
  int ndev, dev_index;        /* the devices, and this model's index among them (0: the first) */
  tdm_moe_model **shards;     /* the first's: the other devices' models, [ndev - 1] */
  tdm_moe_model *first;       /* a shard's: the first device's model, whose host copy it reads */
  bool peer;                  /* a shard's: of the first's backend, so peer copies reach it */
  bool staged;                /* the first's: a shard is not a peer (xw_h carries the input) */
  float *part;                /* device [maxT x H]: a shard's partial sum; the first's landing */
  float *part_h;              /* pinned: a shard's partial sum on its way (not peer) */
  float *xw_h;                /* pinned, the first's: xn [maxT x H], then wts [maxT x k] */
  tdm_event **part_ready;     /* the first's: [ndev - 1], each shard's partial of the layer */
  int *unreleased, nunreleased; /* [L x E]: keys whose release failed, still pinned (retried) */
  bool unsettled;             /* a pass's end could not wait for its queues (drain) */
  const unsigned char *owners; /* [L x E]: each key's device (the first's table, shared) */
  unsigned char *own_buf, *fixed; /* the first's: that table; keys held in a device's static
                              resident set (fixed to it) */
  uint64_t *load;             /* the first's: tokens routed to each key since the last
                              tdm_moe_rebalance (or creation) */
  tdm_streamer *streamer;
  /* device side, per layer */
  tdm_moe_bf16 *router;           /* L x E x H */
  float *bias, *norm;         /* L x E, L x H */
  tdm_moe_bf16 *shared;           /* L x shared experts, resident */
  size_t shared_bytes;
  int *rank;                  /* L x E: popularity rank of each expert (0: most popular) */
  /* per ubatch (device) */
  int maxT;
  float *x, *xn, *out, *wts, *out_shared, *ones;
  int32_t *idx, *rows, *slots, *iota, *pidx; /* pidx: the predictor's routing, pdepth layers */
  int pdepth;                 /* layers the look-ahead predicts (0: no predictor) */
  float *pwts;
  void *ws;
  size_t ws_bytes;
  /* control plane (pinned host) */
  int32_t *idx_h, *rows_h, *slots_h, *pidx_h;
  /* grouped experts: rows and slots are one buffer (one copy each way), laid out per pass */
  int32_t *rs, *rs_h;
  tdm_moe_group *groups, *groups_h; /* E entries each: one layer's groups */
  const tdm_moe_bf16 *wbase;  /* the streamer's slots (one allocation), once seen */
  bool device_routed;         /* every expert resident: grouped ubatches route on the device */
  long prefill_from;          /* rows in all from which a large ubatch's experts run in groups
                               * (the table's experts_gemm_rows; TANDEM_MOE_PREFILL_GROUPED=0:
                               * never, =N: from N rows on any table); 0: never */
  int route_T;                /* the largest ubatch a device-routed pass takes */
  int64_t *wofs;              /* device [L x E]: each expert's weights from wbase */
  int32_t *idx_all, *idx_all_h; /* device-routed passes: [L x route_T x k] */
  void *graphs[GROUPED_MAX_T + 1]; /* device-routed passes recorded once per ubatch size, where
                                      the op table can record (graph_begin) */
  float *x_h;                 /* pinned: a ubatch's activations, in and out */
  int *scratch;               /* 3 x E: per-expert counts, offsets, order */
  int *fill;                  /* E: group()'s cursors */
  /* host placement (cfg.placement AUTO or HOST; all NULL under DEVICE) */
  tdm_moe_placement_info place;
  tdm_device *place_host_dev; /* the host device (cfg.host, or cpu:0) */
  const tdm_moe_ops *hops;    /* the host device's (CPU) table */
  int nhq;
  tdm_queue **hq;             /* nhq in-order queues of the host device */
  /* time_host: per layer and host queue used, a timed event before its first host expert and
   * the join's event after its last, in pairs (end NULL until the join); harvested and released
   * at the end of each pass. Room for L * nhq pairs; span_base: the current layer's first. */
  tdm_event **spans;
  int nspans, span_base;
  /* time_chain: timed markers on the compute queue, the pass's start (chain[0]) and CHAIN_MARKS
   * per layer (chain[1 + CHAIN_MARKS * l + mark]); harvested and released after each pass */
  tdm_event **chain;
  void **hstate, **hws;       /* per host queue: its op state and workspace */
  size_t hws_bytes;
  float *xn_h, *out_h;        /* pinned: a layer's xn, and the host experts' outputs by slot */
  int *hsel, *hwhere;         /* E: a layer's host experts; the routed experts' whereabouts */
  tdm_moe_group *hgroups;     /* E: a layer's host experts as experts() tables, one a queue */
  bool pool_held;             /* a reference to the CPU table's pool, sized for the model */
  double join_experts;        /* AUTO: the host join's round trip in experts' time (place()) */
  double carry;               /* AUTO: what rounding left over at the last layer's placement */
  uint32_t pass;              /* tdm_moe_forward's count, for ahead */
  int lead_n, lead_T;         /* the last host-routed pass: its last layer's routed experts,
                                 and its tokens (pass_lead) */
  uint32_t *ahead;            /* L x E: the pass whose look-ahead left (l, e) to the device while
                                 not on it (its copy was then on its way or was to be made) */
  unsigned char *slot_host;   /* Tg x k: the slots the host experts wrote */
  bool cores_upload;          /* small uploads by the op table's upload() where it has one
                                 (TANDEM_MOE_UPLOAD, 1 by default) */
  /* the pass underway (pass_start to pass_finish) */
  bool in_pass, pass_overlap, pass_on_device;
  int pass_T;
  double pass_t0;
  tdm_streamer_stats pass_s0;
};

static double now_s(void);

/* ---- deterministic random numbers ---- */

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in (-1, 1): cheap, and enough for synthetic weights. */
static float unit(uint64_t *s) { return (float)((double)(splitmix(s) >> 11) * 0x1.0p-52 - 1.0); }

static float gauss(uint64_t *s) {
  double u1 = ((double)(splitmix(s) >> 11) + 0.5) * 0x1.0p-53;
  double u2 = (double)(splitmix(s) >> 11) * 0x1.0p-53;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---- weights, filled in parallel: thread t fills experts t, t + n, ... ---- */

typedef struct fill_job {
  tdm_moe_model *m;
  int t, n;
  int rc;        /* a source's first error, and its message (set on the job's thread) */
  char why[512];
} fill_job;

static void put_f16(uint8_t *p, uint16_t h) { memcpy(p, &h, sizeof h); }

static void fill_expert(const tdm_moe_model *m, tdm_moe_bf16 *w, uint64_t seed) {
  uint64_t s = seed;
  size_t hi = (size_t)m->H * m->I;
  float a = 1.0f / sqrtf((float)m->H), b = 1.0f / sqrtf((float)m->I);
  for (size_t i = 0; i < 2 * hi; i++) w[i] = tdm_moe_f32_to_bf16(a * unit(&s)); /* Wg, Wu */
  for (size_t i = 2 * hi; i < 3 * hi; i++) w[i] = tdm_moe_f32_to_bf16(b * unit(&s)); /* Wd */
}

/* A synthetic row of K values of a type other than bf16, its values spread over about (-a, a)
 * as fill_expert's are: F16 values drawn as fill_expert draws them; for a block type, random
 * quants under scales that put their largest near a. */
static uint8_t *fill_row_q(uint8_t *p, int type, int K, float a, uint64_t *s) {
  if (type == TDM_MOE_W_F16) {
    for (int k = 0; k < K; k++, p += 2) {
      float v = a * unit(s);
      put_f16(p, (uint16_t)(tdm_moe__f16_of(fabsf(v)) | (v < 0 ? 0x8000u : 0u)));
    }
    return p;
  }
  int values, bytes;
  tdm_moe__wtype_block(type, &values, &bytes);
  for (int b = 0; b < K / values; b++, p += bytes) {
    for (int i = 0; i < bytes; i += 8) {
      uint64_t r = splitmix(s);
      memcpy(p + i, &r, bytes - i < 8 ? (size_t)(bytes - i) : 8);
    }
    switch (type) {
    case TDM_MOE_W_Q8_0: put_f16(p, tdm_moe__f16_of(a / 127.0f)); break;
    case TDM_MOE_W_Q4_K: /* value d sc q - dmin m, in about (-a, 2a) */
      put_f16(p, tdm_moe__f16_of(2.0f * a / (63.0f * 15.0f)));
      put_f16(p + 2, tdm_moe__f16_of(a / 63.0f));
      break;
    case TDM_MOE_W_Q6_K: /* int8 scales of 64..127 */
      for (int i = 192; i < 208; i++) p[i] = (uint8_t)(64 | (p[i] & 63));
      put_f16(p + 208, tdm_moe__f16_of(a / (127.0f * 32.0f)));
      break;
    default: /* MXFP4: 2^(e - 127) x 6 about a */
      p[0] = (uint8_t)(127 + (int)floorf(log2f(a / 6.0f)));
      break;
    }
  }
  return p;
}

/* An expert of format f (not bf16). */
static void fill_expert_q(const tdm_moe_model *m, tdm_moe_wfmt f, uint8_t *w, uint64_t seed) {
  uint64_t s = seed;
  float a = 1.0f / sqrtf((float)m->H), b = 1.0f / sqrtf((float)m->I);
  for (int r = 0; r < 2 * m->I; r++) w = fill_row_q(w, f.gu, m->H, a, &s);
  for (int r = 0; r < m->H; r++) w = fill_row_q(w, f.d, m->I, b, &s);
}

static void *fill_main(void *arg) {
  fill_job *j = arg;
  tdm_moe_model *m = j->m;
  const tdm_moe_source *src = m->cfg.source;
  for (long key = j->t; !j->rc && key < (long)m->L * m->E; key += j->n) {
    uint8_t *w = (uint8_t *)m->host_experts + (size_t)key * m->ebytes;
    uint64_t seed = m->cfg.seed * 1000003u + (uint64_t)key;
    if (src) {
      j->rc = src->expert(src->user, (int)(key / m->E), (int)(key % m->E), w);
      if (j->rc) { /* the message without its code's name, which tdm_set_error adds back */
        const char *msg = tdm_last_error(), *name = tdm_err_name(j->rc);
        size_t n = strlen(name);
        if (strncmp(msg, name, n) == 0 && strncmp(msg + n, ": ", 2) == 0) msg += n + 2;
        snprintf(j->why, sizeof j->why, "%s", msg);
      }
    } else {
      tdm_moe_wfmt f = m->fmt[key / m->E];
      if (f.gu == TDM_MOE_W_BF16 && f.d == TDM_MOE_W_BF16)
        fill_expert(m, (tdm_moe_bf16 *)(void *)w, seed);
      else
        fill_expert_q(m, f, w, seed);
    }
  }
  return NULL;
}

static int fill_parallel(tdm_moe_model *m) {
  int n = m->cfg.threads > 0 ? m->cfg.threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 1) n = 1;
  if (n > 64) n = 64;
  pthread_t th[64];
  fill_job jobs[64];
  for (int t = 0; t < n; t++) jobs[t] = (fill_job){.m = m, .t = t, .n = n};
  /* Job t fills experts t, t + n, ...: the jobs whose thread did not start run here. */
  int started = 0;
  while (started < n && pthread_create(&th[started], NULL, fill_main, &jobs[started]) == 0)
    started++;
  for (int t = started; t < n; t++) fill_main(&jobs[t]);
  for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < n; t++)
    if (jobs[t].rc) return tdm_set_error(jobs[t].rc, 0, "%s", jobs[t].why);
  return 0;
}

/* ---- setup ---- */

/* Syncs q. A sync that fails may not have waited (its own command could not be queued: an
 * allocation or the backend failed), while the next pass rewrites host buffers that the
 * queue's work may still read or write: it is tried again, a few times, until one returns 0
 * (the queue's errors are cleared by the first). Returns the first failure; m->unsettled says
 * whether no try returned 0, which the next pass then settles first (settle()). */
static int drain_done(tdm_moe_model *m, tdm_queue *q, bool *done) {
  int rc = tdm_queue_sync(q);
  *done = rc == 0;
  for (int i = 0; i < 3 && !*done; i++) *done = tdm_queue_sync(q) == 0;
  if (!*done) m->unsettled = true;
  return rc;
}

static int drain(tdm_moe_model *m, tdm_queue *q) {
  bool done;
  return drain_done(m, q, &done);
}

/* Frees host memory that a copy submitted on m->q reads, once the queue is done with it: the
 * queue drained, else a stream-ordered free. Returns drain's code. */
static int free_after(tdm_moe_model *m, void *host) {
  bool done;
  int rc = drain_done(m, m->q, &done);
  if (done) {
    tdm_free(host);
  } else if (tdm_free_async(m->q, host, 0, NULL, NULL) != 0) {
    /* kept: the copy may still read it */
  }
  return rc;
}

static int upload(tdm_moe_model *m, void *dst, const void *src, size_t n) {
  void *stage;
  int rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, n, &stage);
  if (rc) return rc;
  memcpy(stage, src, n);
  rc = tdm_memcpy(m->q, dst, stage, n, TDM_COPY_H2D, 0, NULL, NULL);
  if (rc) {
    tdm_free(stage);
    return rc;
  }
  return free_after(m, stage);
}

static int dev_alloc(tdm_moe_model *m, size_t n, void *out) {
  return tdm_malloc(m->cfg.device, TDM_MEM_DEVICE, n ? n : 1, (void **)out);
}

static int setup_small_weights(tdm_moe_model *m) {
  size_t nr = (size_t)m->L * m->E * m->H;
  tdm_moe_bf16 *r = malloc(nr * sizeof *r);
  float *bias = malloc((size_t)m->L * m->E * sizeof *bias);
  float *norm = malloc((size_t)m->L * m->H * sizeof *norm);
  m->rank = malloc((size_t)m->L * m->E * sizeof *m->rank);
  int rc = (r && bias && norm && m->rank) ? 0 : tdm_set_error(TDM_ENOMEM, 0, "no host memory");
  const tdm_moe_source *src = m->cfg.source;
  /* A real model's: its routers and norms, no bias, experts ranked by index. */
  for (int l = 0; !rc && src && l < m->L; l++) {
    rc = src->router(src->user, l, r + (size_t)l * m->E * m->H);
    if (!rc) rc = src->norm(src->user, l, norm + (size_t)l * m->H);
    for (int e = 0; e < m->E; e++) {
      bias[(size_t)l * m->E + e] = 0.0f;
      m->rank[(size_t)l * m->E + e] = e;
    }
  }
  uint64_t s = m->cfg.seed ^ 0x5eedu;
  for (size_t i = 0; !rc && !src && i < nr; i++)
    r[i] = tdm_moe_f32_to_bf16(gauss(&s) / sqrtf((float)m->H));
  for (int l = 0; !rc && !src && l < m->L; l++) {
    /* A random popularity order per layer; the expert of rank r gets a logit bias of
     * -skew * ln(r + 1), so its routing probability falls like (r + 1)^-skew. */
    int *rk = m->rank + (size_t)l * m->E;
    for (int e = 0; e < m->E; e++) rk[e] = e;
    for (int e = m->E - 1; e > 0; e--) {
      int j = (int)(splitmix(&s) % (uint64_t)(e + 1)), t = rk[e];
      rk[e] = rk[j];
      rk[j] = t;
    }
    for (int e = 0; e < m->E; e++)
      bias[(size_t)l * m->E + e] = (float)(-m->cfg.skew * log((double)rk[e] + 1.0));
    for (int h = 0; h < m->H; h++) norm[(size_t)l * m->H + h] = 1.0f + 0.1f * unit(&s);
  }
  if (!rc) rc = dev_alloc(m, nr * sizeof *r, &m->router);
  if (!rc) rc = dev_alloc(m, (size_t)m->L * m->E * sizeof(float), &m->bias);
  if (!rc) rc = dev_alloc(m, (size_t)m->L * m->H * sizeof(float), &m->norm);
  if (!rc) rc = upload(m, m->router, r, nr * sizeof *r);
  if (!rc) rc = upload(m, m->bias, bias, (size_t)m->L * m->E * sizeof(float));
  if (!rc) rc = upload(m, m->norm, norm, (size_t)m->L * m->H * sizeof(float));
  if (!rc && m->p.shared) {
    /* Shared experts are always active: resident on the device, outside the budget. */
    tdm_moe_preset sp = m->p;
    sp.ffn = m->p.shared_ffn;
    size_t sb = tdm_moe_expert_bytes(&sp), n = (size_t)m->L * m->p.shared;
    m->shared_bytes = sb * n;
    tdm_moe_bf16 *h = malloc(m->shared_bytes);
    rc = h ? dev_alloc(m, m->shared_bytes, &m->shared) : tdm_set_error(TDM_ENOMEM, 0, "no memory");
    tdm_moe_model tmp = *m;
    tmp.I = m->p.shared_ffn;
    for (size_t i = 0; !rc && i < n; i++)
      fill_expert(&tmp, h + i * (sb / 2), m->cfg.seed * 7919u + i + 1);
    if (!rc) rc = upload(m, m->shared, h, m->shared_bytes);
    free(h);
  }
  free(r);
  free(bias);
  free(norm);
  return rc;
}

/* The streamer's staging slots: the configuration's, else 16, or 64 where a ubatch may hold
 * more than 4096 tokens: such a ubatch's streamed experts run in groups of those that have
 * landed, and 16 slots kept the groups too small to fill a GPU (Q4_K_M experts of Qwen3-30B-A3B
 * at 8192 tokens: 1.33x the tokens/s with 64, bench/results/h100-gmm-sched-0e8fcfe). */
enum { STAGING_SLOTS = 16, STAGING_SLOTS_LARGE = 64, LARGE_UBATCH = 4096 };
static int staging_slots(const tdm_moe_model *m) {
  if (m->cfg.staging_slots > 0) return m->cfg.staging_slots;
  return m->cfg.max_tokens > LARGE_UBATCH ? STAGING_SLOTS_LARGE : STAGING_SLOTS;
}

/* Expert parallelism: the device that computes expert e of layer l (the first's table). */
static int owner(const tdm_moe_model *m, int l, int e) {
  return m->owners[(size_t)l * m->E + e];
}

/* The first's table at creation: a layer's experts dealt out by popularity rank in snake
 * order (ranks 0..n-1 to devices 0..n-1, the next n back from n-1 to 0, and so on), so that
 * the devices' expected loads come out about even under any skew; a real model's experts,
 * whose popularity is not known when it loads, are ranked by index. tdm_moe_rebalance deals
 * them out again by the load measured since. */
static int setup_owners(tdm_moe_model *m) {
  size_t keys = (size_t)m->L * m->E;
  m->own_buf = malloc(keys);
  m->fixed = calloc(keys, 1);
  m->load = calloc(keys, sizeof *m->load);
  if (!m->own_buf || !m->fixed || !m->load) return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  for (size_t key = 0; key < keys; key++) {
    int n = m->ndev, r = m->rank[key], pos = r % n;
    m->own_buf[key] = (unsigned char)((r / n) % 2 == 0 ? pos : n - 1 - pos);
  }
  m->owners = m->own_buf;
  return 0;
}

/* Whether this model's device computes expert e of layer l (all of them, alone). */
static bool owns(const tdm_moe_model *m, int l, int e) {
  return m->ndev <= 1 || owner(m, l, e) == m->dev_index;
}

/* order[0..n) of layer l with the experts of other devices left out, in order; their count. */
static int owned_only(const tdm_moe_model *m, int l, int *order, int n) {
  int kept = 0;
  for (int i = 0; i < n; i++)
    if (owns(m, l, order[i])) order[kept++] = order[i];
  return kept;
}

/* Whether a ubatch of T tokens runs its experts in groups (experts()), not one by one: a
 * small one always; a large one where the table computes many rows as GEMMs. */
static bool grouped(const tdm_moe_model *m, int T) {
  return T <= GROUPED_MAX_T || (m->prefill_from > 0 && (long)T * m->k >= m->prefill_from);
}

/* Whether a pass of T tokens routes on the device: every expert resident, one device, and a
 * grouped ubatch of at most DEVICE_ROUTED_ROWS rows (group() sorts them in one block). */
static bool routes_on_device(const tdm_moe_model *m, int T) {
  return m->device_routed && T <= m->route_T && grouped(m, T);
}

static int setup_buffers(tdm_moe_model *m) {
  int T = m->maxT, Imax = m->I > m->p.shared_ffn ? m->I : m->p.shared_ffn;
  size_t th = (size_t)T * m->H * sizeof(float), tk = (size_t)T * m->k;
  int Tg = T < GROUPED_MAX_T ? T : GROUPED_MAX_T; /* the largest small ubatch */
  size_t tgk = (size_t)Tg * m->k;
  /* One workspace serves both ways: expert() on up to T tokens, experts() on the largest
   * grouped ubatch's rows. */
  size_t ws1 = tdm_moe_ops_workspace(T, m->H, Imax);
  size_t ws2 = tdm_moe_ops_workspace(grouped(m, T) ? (int)tk : (int)tgk, m->H, m->I);
  m->ws_bytes = ws1 > ws2 ? ws1 : ws2;
  int rc = ws1 && ws2 ? 0 : tdm_set_error(TDM_EINVAL, 0, "a ubatch of %d tokens is too large", T);
  if (!rc) rc = dev_alloc(m, th, &m->x);
  if (!rc) rc = dev_alloc(m, th, &m->xn);
  if (!rc) rc = dev_alloc(m, tk * m->H * sizeof(float), &m->out);
  if (!rc) rc = dev_alloc(m, tk * sizeof(float), &m->wts);
  if (!rc) rc = dev_alloc(m, tk * sizeof(int32_t), &m->idx);
  if (!rc) rc = dev_alloc(m, 2 * tk * sizeof(int32_t), &m->rs);
  if (!rc) rc = dev_alloc(m, (size_t)m->E * sizeof(tdm_moe_group), &m->groups);
  if (!rc) rc = dev_alloc(m, m->ws_bytes, &m->ws);
  if (!rc) rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, tk * sizeof(int32_t), (void **)&m->idx_h);
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, 2 * tk * sizeof(int32_t), (void **)&m->rs_h);
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, (size_t)m->E * sizeof(tdm_moe_group),
                    (void **)&m->groups_h);
  if (!rc) rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, th, (void **)&m->x_h);
  if (!rc && (!(m->scratch = malloc((size_t)m->E * 3 * sizeof *m->scratch)) ||
              !(m->fill = malloc((size_t)m->E * sizeof *m->fill)) ||
              !(m->unreleased = malloc((size_t)m->L * m->E * sizeof *m->unreleased))))
    rc = tdm_set_error(TDM_ENOMEM, 0, "no memory");
  if (!rc && m->pdepth) {
    size_t ptk = (size_t)m->pdepth * tk;
    rc = dev_alloc(m, ptk * sizeof(int32_t), &m->pidx);
    if (!rc) rc = dev_alloc(m, tk * sizeof(float), &m->pwts);
    if (!rc)
      rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, ptk * sizeof(int32_t), (void **)&m->pidx_h);
  }
  if (!rc && m->ndev > 1) {
    rc = dev_alloc(m, th, &m->part);
    if (!rc && m->first && !m->peer)
      rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, th, (void **)&m->part_h);
    if (!rc && !m->first)
      rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, th + tk * sizeof(float), (void **)&m->xw_h);
  }
  if (!rc && (m->p.shared || (m->ndev > 1 && !m->first))) { /* ones: a partial's weights */
    if (m->p.shared) rc = dev_alloc(m, th, &m->out_shared);
    if (!rc) rc = dev_alloc(m, (size_t)T * sizeof(float), &m->ones);
    if (!rc) rc = dev_alloc(m, (size_t)T * sizeof(int32_t), &m->iota);
    float *ones = malloc((size_t)T * sizeof *ones);
    int32_t *iota = malloc((size_t)T * sizeof *iota);
    if (!rc && (!ones || !iota)) rc = tdm_set_error(TDM_ENOMEM, 0, "no memory");
    for (int t = 0; !rc && t < T; t++) {
      ones[t] = 1.0f;
      iota[t] = t;
    }
    if (!rc) rc = upload(m, m->ones, ones, (size_t)T * sizeof(float));
    if (!rc) rc = upload(m, m->iota, iota, (size_t)T * sizeof(int32_t));
    free(ones);
    free(iota);
  }
  return rc;
}

static bool same_fmt(tdm_moe_wfmt a, tdm_moe_wfmt b) { return a.gu == b.gu && a.d == b.d; }

/* A table's experts() on layer l's routed experts' weights: experts_q() in their format where it is
 * not bf16. */
static int run_experts(const tdm_moe_model *m, int l, const tdm_moe_ops *ops, void *st,
                       tdm_queue *q, const float *x, const int32_t *rows, const int32_t *slots,
                       int n, const void *wbase, const tdm_moe_group *groups, int G, float *out,
                       void *ws, size_t ws_bytes) {
  if (m->quant)
    return ops->experts_q(st, q, x, rows, slots, n, wbase, m->fmt[l], groups, G, m->H, m->I,
                          out, ws, ws_bytes);
  return ops->experts(st, q, x, rows, slots, n, wbase, groups, G, m->H, m->I, out, ws, ws_bytes);
}

/* Expert weights w as an offset from the streamer's slots (one allocation, whose start is
 * learnt from the first expert seen), as experts() takes them. */
static int weights_offset(tdm_moe_model *m, const void *w, int64_t *off) {
  tdm_mem_info mi;
  int rc = m->wbase ? 0 : tdm_mem_query(w, &mi);
  if (rc) return rc;
  if (!m->wbase) m->wbase = mi.base;
  *off = (const tdm_moe_bf16 *)w - m->wbase;
  return 0;
}

/* Every expert is resident, in a slot that never changes: their places, as offsets from the
 * slots' allocation, go to the device once (acquiring each expert once to learn it), so a
 * grouped ubatch's routing can be grouped there and never come back to the host; and room for
 * each layer's routing of the largest ubatch that routes there (kept for the pass's figures). */
static int setup_device_routing(tdm_moe_model *m) {
  long keys = (long)m->L * m->E;
  int64_t *wofs = NULL;
  int T = m->maxT < GROUPED_MAX_T ? m->maxT : GROUPED_MAX_T;
  if (grouped(m, m->maxT)) T = m->maxT < DEVICE_ROUTED_ROWS / m->k ? m->maxT
                                                                  : DEVICE_ROUTED_ROWS / m->k;
  size_t all = (size_t)m->L * T * m->k * sizeof(int32_t);
  int rc = dev_alloc(m, all, &m->idx_all);
  if (!rc) rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, all, (void **)&m->idx_all_h);
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, (size_t)keys * sizeof *wofs, (void **)&wofs);
  if (!rc) rc = dev_alloc(m, (size_t)keys * sizeof *wofs, &m->wofs);
  for (long key = 0; !rc && key < keys; key++) {
    const void *w;
    int l = (int)(key / m->E), e = (int)(key % m->E);
    if ((rc = tdm_streamer_acquire(m->streamer, l, e, &w, NULL))) break;
    rc = weights_offset(m, w, &wofs[key]);
    int rr = tdm_streamer_release(m->streamer, l, e, NULL);
    if (!rc) rc = rr;
  }
  bool copying = false;
  if (!rc) copying = !(rc = tdm_memcpy(m->q, m->wofs, wofs, (size_t)keys * sizeof *wofs,
                                       TDM_COPY_H2D, 0, NULL, NULL));
  if (copying)
    rc = free_after(m, wofs);
  else if (wofs)
    tdm_free(wofs);
  if (!rc) {
    m->device_routed = true;
    m->route_T = T;
  }
  return rc;
}

static int setup_streamer(tdm_moe_model *m) {
  long keys = (long)m->L * m->E;
  m->host_ptrs = malloc((size_t)keys * sizeof *m->host_ptrs);
  int *resident = malloc((size_t)keys * sizeof *resident);
  if (!m->host_ptrs || !resident) {
    free(resident);
    return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  }
  size_t per = m->ebytes / sizeof(tdm_moe_bf16);
  for (long key = 0; key < keys; key++) m->host_ptrs[key] = m->host_experts + (size_t)key * per;
  /* The static resident set: the most popular experts of every layer first (of this device's
   * share of them, with several devices). */
  long n = 0;
  for (int r = 0; r < m->E; r++)
    for (int l = 0; l < m->L; l++)
      for (int e = 0; e < m->E; e++)
        if (m->rank[(size_t)l * m->E + e] == r && owns(m, l, e)) resident[n++] = l * m->E + e;
  /* A budget that holds every expert (of its share) leaves a policy nothing to decide: all are
   * loaded at creation and stay (the static policy), whatever policy was asked for. */
  bool all = m->cfg.all_resident || m->cfg.budget_bytes / m->ebytes >= (size_t)n;
  if (m->ndev > 1 && (all || m->cfg.policy == TDM_CACHE_STATIC)) { /* held for good: fixed */
    unsigned char *fixed = m->first ? m->first->fixed : m->fixed;
    size_t held = all ? (size_t)n : m->cfg.budget_bytes / m->ebytes;
    for (long i = 0; i < n && (size_t)i < held; i++) fixed[resident[i]] = 1;
  }
  tdm_streamer_config sc = {
      .compute = m->q,
      .layers = m->L,
      .experts = m->E,
      .expert_bytes = m->ebytes,
      .host = m->host_ptrs,
      .budget_bytes = all ? (size_t)n * m->ebytes : m->cfg.budget_bytes,
      .staging_slots = staging_slots(m),
      .policy = all ? TDM_CACHE_STATIC : m->cfg.policy,
      .resident = resident,
      .nresident = (int)n,
      .prefetch_depth = m->cfg.prefetch_depth > 0 ? m->cfg.prefetch_depth
                        : m->cfg.policy == TDM_CACHE_STATIC ? m->E
                                                            : 0,
      .time_copies = m->cfg.time_link,
  };
  int rc = tdm_streamer_create(&sc, &m->streamer);
  free(resident);
  /* The resident set is copied on the streamer's prefetch queue: a model is ready when it has
   * landed, so no pass is timed with that load inside it. */
  tdm_queue *prefetch = NULL;
  if (!rc && !(rc = tdm_streamer_queues(m->streamer, NULL, &prefetch))) rc = tdm_queue_sync(prefetch);
  if (!rc && all && m->ndev <= 1) rc = setup_device_routing(m);
  return rc;
}

/* ---- host placement: the host's queues and buffers, and the cost model ---- */

/* The placement fields of a configuration, checked before anything is allocated. */
static int check_placement(const tdm_moe_config *cfg) {
  if (cfg->placement != TDM_MOE_PLACE_DEVICE && cfg->placement != TDM_MOE_PLACE_AUTO &&
      cfg->placement != TDM_MOE_PLACE_HOST)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: placement %d is not "
                         "TDM_MOE_PLACE_DEVICE, _AUTO or _HOST", (int)cfg->placement);
  if (cfg->host_queues < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: %d host queues (0: one, or a "
                         "positive count)", cfg->host_queues);
  if (!(cfg->host_share >= 0 && cfg->host_share <= 1))
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: host share %g is outside [0, 1]",
                         cfg->host_share);
  if (cfg->host_share > 0 && cfg->placement != TDM_MOE_PLACE_AUTO)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: a host share (%g) applies to "
                         "placement AUTO only", cfg->host_share);
  if (cfg->host) {
    tdm_device_info info;
    int rc = tdm_device_info_get(cfg->host, &info);
    if (rc) return rc;
    /* The CPU table's tasks dereference their pointers: only a CPU device computes on the
     * pinned copies in place. */
    if (strcmp(info.backend, "cpu") != 0 || !(info.caps & TDM_DEVICE_CAP_HOST_MEMORY))
      return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: the host device %s is not a "
                           "CPU device (backend %s)", info.id, info.backend);
  }
  return 0;
}

/* ---- the cost model: the link and the host, alone and at once ----
 * A streamed expert costs the link its bytes; a host expert costs the host its weights' bytes
 * read once (one token). Both come out of the host's memory, the copies by DMA and the host
 * experts by the cores, so each side is measured alone and then both at once: the share comes
 * from the figures at once, which is how decode runs them. Copies go on a queue of their own
 * into a scratch expert and host experts write slots of a scratch block of the host device's
 * memory, so nothing of the streamer or the model is touched. Every expert read is a different
 * one (round-robin over the pinned experts), so its bytes come from memory, as in a pass. */
/* Each figure is the best of CAL_TRIALS measurements of a few milliseconds: a moment of other
 * work on the host (seen on the H200's: 21-24 GB/s for the host alone in two processes, 43-52
 * in the others, the share halved with it) lowers one trial, not the figure. */
enum { CAL_LINK = 8, CAL_HOST_MIN = 8, CAL_HOST_MAX = 64, CAL_TRIALS = 3 };
#define HOST_GAIN_MIN 1.05
/* Cores the host experts' pool leaves, by default, beside a device that needs feeding: one for
 * the submitting thread and one for each of the device queues whose executors watch the device
 * meanwhile (the compute queue and the streamer's two copy queues); CUDA's default scheduling
 * has them spin while they wait. With the pool on those cores too, a preempted pool thread
 * held up its expert by a time slice: on the H200's 16-core host, single experts that take
 * 0.18 ms took 1 to 6 ms, and decode at budget 0 ran at 88.7 tok/s with 16 threads against
 * 126.8 with 12. */
#define HOST_RESERVE 4

typedef struct calib {
  tdm_moe_model *m;
  tdm_queue *lq;          /* the link's queue */
  void *dscratch;         /* an expert on the device */
  int32_t *rows, *slot;   /* the host's token lists: [cap], every row 0, slot i for entry i */
  tdm_moe_group *groups;  /* [cap]: the host calls' tables */
  float *x, *out;         /* the host's token [H] and outputs [cap x H] */
  int cap;                /* host experts one cal_experts() call may submit */
  long next;              /* the next expert to read */
} calib;

/* n copies of distinct experts on the link's queue. */
static int cal_copies(calib *c, int n) {
  long keys = (long)c->m->L * c->m->E;
  int rc = 0;
  for (int i = 0; !rc && i < n; i++)
    rc = tdm_memcpy(c->lq, c->dscratch, c->m->host_ptrs[c->next++ % keys], c->m->ebytes,
                    TDM_COPY_H2D, 0, NULL, NULL);
  return rc;
}

/* n (at most cap) host experts on one token, as decode submits them: experts() calls of g
 * experts each (the last one fewer), round-robin over the host queues, every expert writing a
 * slot of its own. */
static int cal_experts(calib *c, int n, int g) {
  tdm_moe_model *m = c->m;
  long keys = (long)m->L * m->E;
  int rc = 0;
  for (int base = 0, call = 0; !rc && base < n; base += g, call++) {
    int cnt = n - base < g ? n - base : g, j = call % m->nhq;
    for (int i = 0; i < cnt; i++) {
      long key;
      do /* one call computes one format: layer 0's, and the layers that share it */
        key = c->next++ % keys;
      while (!same_fmt(m->fmt[key / m->E], m->fmt[0]));
      const tdm_moe_bf16 *w = m->host_ptrs[key];
      c->groups[base + i] =
          (tdm_moe_group){.w = (int64_t)(w - m->host_experts), .first = i, .count = 1};
    }
    rc = run_experts(m, 0, m->hops, m->hstate[j], m->hq[j], c->x, c->rows + base, c->slot + base,
                     cnt, m->host_experts, c->groups + base, cnt, c->out, m->hws[j],
                     m->hws_bytes);
  }
  return rc;
}

/* Waits for every host queue; returns the first error (and clears each queue's). */
static int sync_host_queues(tdm_moe_model *m) {
  int rc = 0;
  for (int j = 0; j < m->nhq; j++) {
    int src = drain(m, m->hq[j]);
    if (!rc) rc = src;
  }
  return rc;
}

/* Polls the link's queue and every host queue until all are done, noting when each side
 * finished (seconds from t0). */
static int cal_finish(calib *c, double t0, double *t_link, double *t_host) {
  tdm_moe_model *m = c->m;
  int nq = m->nhq, rc = 0, left = nq + 1;
  tdm_event **ev = calloc((size_t)nq + 1, sizeof *ev);
  if (!ev) return tdm_set_error(TDM_ENOMEM, 0, "no memory for the cost model");
  for (int j = 0; !rc && j < nq; j++) rc = tdm_event_record(m->hq[j], &ev[j]);
  if (!rc) rc = tdm_event_record(c->lq, &ev[nq]);
  int host_left = nq;
  while (!rc && left > 0) {
    for (int j = 0; !rc && j <= nq; j++) {
      if (!ev[j]) continue;
      int st = tdm_event_query(ev[j]);
      if (st == TDM_EAGAIN) continue;
      rc = st;
      tdm_event_release(ev[j]);
      ev[j] = NULL;
      left--;
      if (j == nq) *t_link = now_s() - t0;
      else if (--host_left == 0) *t_host = now_s() - t0;
    }
    if (!rc && left > 0) nanosleep(&(struct timespec){.tv_nsec = 10000}, NULL);
  }
  for (int j = 0; j <= nq; j++)
    if (ev[j]) {
      (void)tdm_event_wait(ev[j]);
      tdm_event_release(ev[j]);
    }
  free(ev);
  if (!rc) rc = sync_host_queues(m);
  if (!rc) rc = tdm_queue_sync(c->lq);
  return rc;
}

static double gbs(double bytes, double t) { return t > 0 ? bytes / t / 1e9 : 0.0; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The host join's round trip, median of CAL_JOIN: what a layer's host experts add to its
 * critical path besides their own time. The compute queue waits (device-side) for a host
 * queue's event, then runs a decode token's RMSNorm and router and copies the routing back,
 * which the host waits for: the steps between one layer's last host expert and the next
 * layer's first (the combine aside). The copies for the next layer run meanwhile, so the host
 * side pays this and the link does not. */
enum { CAL_JOIN = 15 };
static int norm_route(tdm_moe_model *m, int l, int T, int32_t *idx);
static int cal_join(tdm_moe_model *m, double *seconds) {
  double t[CAL_JOIN];
  size_t xb = (size_t)m->H * sizeof(float);
  for (int h = 0; h < m->H; h++) m->x_h[h] = 1.0f / (float)(h + 1);
  int rc = tdm_memcpy(m->q, m->x, m->x_h, xb, TDM_COPY_H2D, 0, NULL, NULL);
  if (!rc) rc = tdm_queue_sync(m->q);
  for (int i = 0; !rc && i < CAL_JOIN; i++) {
    double t0 = now_s();
    tdm_event *host = NULL, *routed = NULL;
    rc = tdm_event_record(m->hq[0], &host);
    if (!rc) rc = tdm_queue_wait(m->q, host);
    if (host) tdm_event_release(host);
    if (!rc) rc = norm_route(m, 0, 1, m->idx);
    if (!rc)
      rc = tdm_memcpy(m->q, m->idx_h, m->idx, (size_t)m->k * sizeof(int32_t), TDM_COPY_D2H, 0,
                      NULL, &routed);
    if (!rc) rc = tdm_event_wait(routed);
    if (routed) tdm_event_release(routed);
    t[i] = now_s() - t0;
  }
  if (rc) return rc;
  qsort(t, CAL_JOIN, sizeof *t, cmp_double);
  *seconds = t[CAL_JOIN / 2];
  return 0;
}

/* The share the figures at once give (tandem/moe.h): splitting a layer's non-resident bytes so
 * that both sides finish together moves them at host + link GB/s; copying them all, at the
 * link's alone. Only a split that beats the link alone by HOST_GAIN_MIN is worth the host's
 * per-layer join. */
static double model_share(const tdm_moe_placement_info *pi) {
  double sum = pi->host_gbs_shared + pi->link_gbs_shared;
  return sum > HOST_GAIN_MIN * pi->link_gbs ? pi->host_gbs_shared / sum : 0.0;
}

/* The host experts a queue gets in a decode layer at a share: of a token's top-k, the part
 * the budget leaves off the device (as with a router that picks every expert alike), on each
 * host queue; rounded, at least 1, at most top-k. */
static int decode_group(const tdm_moe_model *m, double share) {
  double keys = (double)m->L * m->E, held = (double)m->cfg.budget_bytes / (double)m->ebytes;
  double off = m->cfg.all_resident || held >= keys ? 0.0 : 1.0 - held / keys;
  long g = lround(share * m->k * off / m->nhq);
  return g < 1 ? 1 : g > m->k ? m->k : (int)g;
}

/* n rounded up to a multiple of g. */
static int whole_calls(int n, int g) { return (n + g - 1) / g * g; }

/* Both sides alone, then at once, with host calls of g experts (pi's figures are replaced). */
static int cal_measure(calib *c, int g, tdm_moe_placement_info *pi) {
  double eb = (double)c->m->ebytes;
  int rc = 0, nh = whole_calls(c->m->nhq * g > CAL_HOST_MIN ? c->m->nhq * g : CAL_HOST_MIN, g);
  pi->link_gbs = pi->host_gbs = pi->link_gbs_shared = pi->host_gbs_shared = 0;
  for (int trial = 0; !rc && trial < CAL_TRIALS; trial++) {
    double t0 = now_s();
    rc = cal_copies(c, CAL_LINK);
    if (!rc) rc = tdm_queue_sync(c->lq);
    double link = rc ? 0.0 : gbs(CAL_LINK * eb, now_s() - t0);
    t0 = now_s();
    if (!rc) rc = cal_experts(c, nh, g);
    if (!rc) rc = sync_host_queues(c->m);
    double host = rc ? 0.0 : gbs(nh * eb, now_s() - t0);
    if (link > pi->link_gbs) pi->link_gbs = link;
    if (host > pi->host_gbs) pi->host_gbs = host;
  }
  /* At once, sized so that both sides would take about as long alone; the trial that moved
   * the most bytes in all gives both figures, so they describe the same moment. */
  if (!rc) {
    nh = pi->link_gbs > 0 ? (int)lround(CAL_LINK * pi->host_gbs / pi->link_gbs) : CAL_HOST_MIN;
    nh = nh > CAL_HOST_MAX ? CAL_HOST_MAX / g * g : whole_calls(nh, g);
    if (nh < g) nh = g;
  }
  for (int trial = 0; !rc && trial < CAL_TRIALS; trial++) {
    double tl = 0, th = 0, t0 = now_s();
    rc = cal_copies(c, CAL_LINK);
    if (!rc) rc = cal_experts(c, nh, g);
    if (!rc) rc = cal_finish(c, t0, &tl, &th);
    double link = rc ? 0.0 : gbs(CAL_LINK * eb, tl), host = rc ? 0.0 : gbs(nh * eb, th);
    if (link + host > pi->link_gbs_shared + pi->host_gbs_shared) {
      pi->link_gbs_shared = link;
      pi->host_gbs_shared = host;
    }
  }
  return rc;
}

/* The figures, measured with host calls of as many experts as decode will group at the share
 * they give: first at the share given (HOST: 1, AUTO's model: a half), then, when the share
 * so measured groups a different count, again at that count (grouped calls compute faster, so
 * single experts would underrate the host). */
static int calibrate(tdm_moe_model *m, tdm_moe_placement_info *pi) {
  int nq = m->nhq, H = m->H, rc;
  calib c = {.m = m, .cap = nq * m->k > CAL_HOST_MAX ? nq * m->k : CAL_HOST_MAX};
  size_t ints = (size_t)c.cap * (2 * sizeof(int32_t) + sizeof(tdm_moe_group));
  rc = tdm_queue_create(m->cfg.device, TDM_QUEUE_IN_ORDER, &c.lq);
  if (!rc) rc = dev_alloc(m, m->ebytes, &c.dscratch);
  if (!rc)
    rc = tdm_malloc(m->place_host_dev, TDM_MEM_DEVICE,
                    ints + (size_t)(c.cap + 1) * H * sizeof(float), (void **)&c.groups);
  if (!rc) {
    c.rows = (int32_t *)(c.groups + c.cap);
    c.slot = c.rows + c.cap;
    c.x = (float *)(c.slot + c.cap);
    c.out = c.x + H;
    for (int i = 0; i < c.cap; i++) {
      c.rows[i] = 0;
      c.slot[i] = i;
    }
    for (int h = 0; h < H; h++) c.x[h] = 1.0f / (float)(h + 1);
  }
  /* Warm-up: a copy, and an expert on every host queue (their pools and workspaces). */
  if (!rc) rc = cal_copies(&c, 1);
  if (!rc) rc = cal_experts(&c, nq, 1);
  if (!rc) rc = tdm_queue_sync(c.lq);
  if (!rc) rc = sync_host_queues(m);
  bool model = m->cfg.placement == TDM_MOE_PLACE_AUTO && !(m->cfg.host_share > 0);
  double given = m->cfg.placement == TDM_MOE_PLACE_HOST ? 1.0 : model ? 0.5 : m->cfg.host_share;
  int g = decode_group(m, given);
  if (!rc) rc = cal_measure(&c, g, pi);
  int again = !rc && model && model_share(pi) > 0 ? decode_group(m, model_share(pi)) : g;
  if (again != g) {
    g = again;
    rc = cal_measure(&c, g, pi);
  }
  pi->host_group = g;
  double join = 0;
  if (!rc && !(rc = cal_join(m, &join))) pi->host_join_us = 1e6 * join;
  /* After a failure work may still be queued: the host queues are drained and the link's
   * queue destroyed (which drains it) before what they use is freed. */
  if (rc) (void)sync_host_queues(m);
  if (c.lq) tdm_queue_destroy(c.lq);
  if (c.groups) tdm_free(c.groups);
  if (c.dscratch) tdm_free(c.dscratch);
  return rc;
}

/* The host device's queues, op states and workspaces, the pinned buffers host experts read
 * and write, and the cost model. */
static int setup_host(tdm_moe_model *m) {
  int rc = 0, Tg = m->maxT < GROUPED_MAX_T ? m->maxT : GROUPED_MAX_T;
  size_t tk = (size_t)Tg * m->k;
  m->place_host_dev = m->cfg.host;
  if (!m->place_host_dev && (rc = tdm_device_find("cpu:0", &m->place_host_dev))) return rc;
  if (!(m->hops = tdm_moe_ops_for(m->place_host_dev))) return TDM_ENOTSUP; /* says why */
  if (m->quant && !m->hops->experts_q)
    return tdm_set_error(TDM_ENOTSUP, 0, "the host's %s MoE table computes bf16 experts only",
                         m->hops->name);
  /* The CPU table's pool, sized before any of its op states starts it: beside a device that
   * needs feeding, the cores less HOST_RESERVE. The model holds a reference to it until
   * destroy_host(), so that its size is the model's for as long as the model lives. */
  tdm_device_info dinfo;
  if ((rc = tdm_device_info_get(m->cfg.device, &dinfo))) return rc;
  bool beside = !(dinfo.caps & TDM_DEVICE_CAP_HOST_MEMORY);
  pool_acquire(m->cfg.host_threads > 0 ? m->cfg.host_threads
                                       : pool_default_size(beside ? HOST_RESERVE : 0));
  m->pool_held = true;
  int n = m->cfg.host_queues > 0 ? m->cfg.host_queues : 1;
  m->nhq = n < 1 ? 1 : n > 256 ? 256 : n;
  m->hq = calloc((size_t)m->nhq, sizeof *m->hq);
  m->hstate = calloc((size_t)m->nhq, sizeof *m->hstate);
  m->hws = calloc((size_t)m->nhq, sizeof *m->hws);
  m->hsel = malloc((size_t)m->E * sizeof *m->hsel);
  m->hwhere = malloc((size_t)m->E * sizeof *m->hwhere);
  m->hgroups = malloc((size_t)m->E * sizeof *m->hgroups);
  m->slot_host = malloc(tk);
  m->ahead = calloc((size_t)m->L * m->E, sizeof *m->ahead);
  if (m->cfg.time_host) m->spans = calloc((size_t)m->L * m->nhq * 2, sizeof *m->spans);
  if (!m->hq || !m->hstate || !m->hws || !m->hsel || !m->hwhere || !m->hgroups ||
      !m->slot_host || !m->ahead ||
      (m->cfg.time_host && !m->spans))
    return tdm_set_error(TDM_ENOMEM, 0, "no memory for %d host queues", m->nhq);
  /* A layer's host experts are one experts() call a queue over the layer's Tg * k token
   * entries (an expert alone has at most Tg: a token picks it once). */
  m->hws_bytes = tdm_moe_ops_workspace(Tg * m->k, m->H, m->I);
  for (int j = 0; !rc && j < m->nhq; j++) {
    rc = tdm_queue_create(m->place_host_dev,
                          TDM_QUEUE_IN_ORDER | (m->cfg.time_host ? TDM_QUEUE_TIMING : 0),
                          &m->hq[j]);
    if (!rc) rc = m->hops->open(m->hq[j], &m->hstate[j]);
    if (!rc) rc = tdm_malloc(m->place_host_dev, TDM_MEM_DEVICE, m->hws_bytes, &m->hws[j]);
  }
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, (size_t)Tg * m->H * sizeof(float),
                    (void **)&m->xn_h);
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, tk * m->H * sizeof(float), (void **)&m->out_h);
  tdm_moe_placement_info *pi = &m->place;
  if (!rc) rc = calibrate(m, pi);
  if (!rc) {
    pi->placement = m->cfg.placement;
    pi->host_queues = m->nhq;
    pi->host_threads = pool_workers();
    pi->host_share = model_share(pi);
    /* The join in experts: a layer that puts h of its n non-resident experts on the host takes
     * h * th + join there and (n - h) * tl on the link (th, tl: an expert's time on each side,
     * at once); they finish together at h = share * n - join / (th + tl). */
    double per = pi->host_gbs_shared > 0 && pi->link_gbs_shared > 0
                     ? (double)m->ebytes / 1e9 / pi->host_gbs_shared +
                           (double)m->ebytes / 1e9 / pi->link_gbs_shared
                     : 0.0;
    m->join_experts = pi->host_share > 0 && per > 0 ? pi->host_join_us / 1e6 / per : 0.0;
    pi->host_share_model = pi->host_share;
    if (m->cfg.host_share > 0) { /* given: taken as it is */
      pi->host_share = m->cfg.host_share;
      m->join_experts = 0.0;
    }
  }
  return rc;
}

/* Host queues are drained (close() waits for a queue's work) before their buffers go. */
static void destroy_host(tdm_moe_model *m) {
  for (int j = 0; m->hq && j < m->nhq; j++) {
    if (m->hstate && m->hstate[j]) m->hops->close(m->hstate[j]);
    if (m->hq[j]) tdm_queue_sync(m->hq[j]);
    if (m->hws && m->hws[j]) tdm_free(m->hws[j]);
    if (m->hq[j]) tdm_queue_destroy(m->hq[j]);
  }
  if (m->pool_held) pool_release();
  if (m->xn_h) tdm_free(m->xn_h);
  if (m->out_h) tdm_free(m->out_h);
  free(m->hq);
  free(m->hstate);
  free(m->hws);
  free(m->hsel);
  free(m->hwhere);
  free(m->hgroups);
  free(m->slot_host);
  free(m->ahead);
  free(m->spans);
}

int tdm_moe_placement_get(const tdm_moe_model *m, tdm_moe_placement_info *out) {
  if (!m || !out) return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_placement_get: m or out is NULL");
  *out = m->place;
  return 0;
}

/* The experts' pinned host copy. Beside a CUDA device, in 2 MiB pages where the kernel gives
 * them (madvise(MADV_HUGEPAGE) on an aligned anonymous mapping), registered with tandem: the
 * host experts read it from many threads at once, and with 4 KiB pages each thread's stream
 * stops at every page for a translation (two levels of them in a virtual machine) and for the
 * hardware prefetcher, which does not cross pages. TANDEM_MOE_HUGE_PAGES=0, another backend,
 * or a mapping or registration that fails: tdm_malloc's pinned memory, as before. */
enum { HUGE_PAGE = 2 << 20 };

static bool huge_pages_wanted(const tdm_moe_model *m) {
  if (tdm_moe__env_long("TANDEM_MOE_HUGE_PAGES", 0, 1, 1) == 0) return false;
  tdm_device_info info;
  return tdm_device_info_get(m->cfg.device, &info) == 0 && strcmp(info.backend, "cuda") == 0;
}

static int host_experts_alloc(tdm_moe_model *m, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  if (huge_pages_wanted(m)) {
    size_t len = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE + HUGE_PAGE;
    char *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map != MAP_FAILED) {
      char *p = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
      (void)madvise(p, len - (size_t)(p - map), MADV_HUGEPAGE); /* a hint: 4 KiB pages else */
      if (tdm_host_register(m->cfg.device, p, bytes) == 0) {
        m->host_map = map;
        m->host_map_bytes = len;
        m->host_experts = (tdm_moe_bf16 *)p;
        return 0;
      }
      munmap(map, len);
    }
  }
#endif
  return tdm_malloc(m->cfg.device, TDM_MEM_PINNED, bytes, (void **)&m->host_experts);
}

static void host_experts_free(tdm_moe_model *m) {
  if (!m->host_experts) return;
  if (m->host_map) {
    (void)tdm_host_unregister(m->host_experts);
    munmap(m->host_map, m->host_map_bytes);
  } else {
    tdm_free(m->host_experts);
  }
  m->host_experts = NULL;
}

/* A caller's shape, checked before any size is computed from it: every count positive and
 * within what a model has, and the products the kernels index with (a weight matrix, a
 * ubatch's rows across the widest dimension, for each of the top-k) within an int. */
static int check_shape(const tdm_moe_config *cfg) {
  const tdm_moe_preset *p = cfg->preset;
  int layers = cfg->layers > 0 ? cfg->layers : p->layers;
  if (p->hidden < 1 || p->ffn < 1 || p->experts < 1 || p->topk < 1 || p->topk > p->experts ||
      layers < 1 || layers > 4096 || p->experts > 65536 || p->shared < 0 || p->shared > 64 ||
      (p->shared && p->shared_ffn < 1) || cfg->max_tokens > (1 << 20))
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: the shape of %s is not a model's "
                         "(hidden %d, ffn %d, experts %d, top-k %d, layers %d, shared %d x %d, "
                         "max tokens %d)", p->name ? p->name : "the preset", p->hidden, p->ffn,
                         p->experts, p->topk, layers, p->shared, p->shared_ffn,
                         cfg->max_tokens);
  int64_t wide = p->hidden > p->ffn ? p->hidden : p->ffn;
  if (p->shared_ffn > wide) wide = p->shared_ffn;
  if (p->experts > wide) wide = p->experts;
  if ((int64_t)3 * p->hidden * wide > INT32_MAX ||
      (int64_t)cfg->max_tokens * wide * p->topk > INT32_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: %s is too large for its "
                         "kernels' indices (hidden %d, ffn %d, %d tokens of top-%d)",
                         p->name ? p->name : "the preset", p->hidden, p->ffn, cfg->max_tokens,
                         p->topk);
  return 0;
}

/* Each layer's expert format (cfg's layer_fmt, else its expert_fmt, else bf16), and the bytes
 * an expert takes: the largest layer's, since the streamer's slots are of one size. */
static int set_formats(tdm_moe_model *m, const tdm_moe_config *cfg) {
  const tdm_moe_wfmt bf16 = {TDM_MOE_W_BF16, TDM_MOE_W_BF16};
  if (!(m->fmt = malloc((size_t)m->L * sizeof *m->fmt)))
    return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  for (int l = 0; l < m->L; l++) {
    tdm_moe_wfmt f = cfg->layer_fmt ? cfg->layer_fmt[l] : cfg->expert_fmt;
    if (!f.gu && !f.d) f = bf16;
    size_t b = same_fmt(f, bf16) ? tdm_moe_expert_bytes(&m->p) : tdm_moe_expert_stride(&m->p, f);
    if (!b)
      return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: layer %d's experts in format "
                           "{%d, %d}: not a format, or %s's rows (%d and %d values) are not "
                           "whole blocks of it", l, f.gu, f.d, m->p.name, m->H, m->I);
    m->fmt[l] = f;
    m->quant |= !same_fmt(f, bf16);
    if (b > m->ebytes) m->ebytes = b;
  }
  return 0;
}

/* TANDEM_MOE_PREFILL_GROUPED: unset or 1, the table's experts_gemm_rows; 0, never; N > 1,
 * from N rows in all on any table (so that a table with no GEMM path, the CPU's, runs and
 * tests the grouped prefill too). */
static long prefill_from(const tdm_moe_model *m) {
  const char *v = getenv("TANDEM_MOE_PREFILL_GROUPED");
  char *end = NULL;
  long n = v && *v ? strtol(v, &end, 10) : 1;
  if (v && *v && (*end || n < 0)) n = 1; /* not a count: the default */
  return n != 1 ? n : m->ops ? m->ops->experts_gemm_rows : 0;
}

/* The model of one device: the first (first NULL, index 0), or device `index` of cfg->devices,
 * which reads first's host copy of the experts. */
static int model_create(const tdm_moe_config *cfg, tdm_moe_model *first, int index,
                        tdm_moe_model **out) {
  tdm_moe_model *m = calloc(1, sizeof *m);
  if (!m) return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  m->cfg = *cfg;
  m->ndev = cfg->ndevices > 1 ? cfg->ndevices : 1;
  m->dev_index = index;
  m->first = first;
  m->p = *cfg->preset;
  m->L = cfg->layers > 0 ? cfg->layers : m->p.layers;
  m->H = m->p.hidden;
  m->E = m->p.experts;
  m->k = m->p.topk;
  m->I = m->p.ffn;
  int rc = set_formats(m, cfg);
  m->maxT = cfg->max_tokens;
  m->eps = cfg->norm_eps > 0 ? cfg->norm_eps : 1e-6f;
  m->pdepth = !cfg->predict || first ? 0 : cfg->predict_depth > 0 ? cfg->predict_depth : 1;
  if (cfg->predict_depth < 0 || cfg->predict_depth > TDM_MOE_PREDICT_DEPTH_MAX)
    rc = tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: a predict depth of %d (0 to %d)",
                       cfg->predict_depth, TDM_MOE_PREDICT_DEPTH_MAX);
  if (!rc && cfg->budget_bytes && cfg->budget_bytes < m->ebytes && !cfg->all_resident)
    rc = tdm_set_error(TDM_EINVAL, 0, "a device budget of %zu bytes cannot hold one %zu-byte "
                       "expert of %s", cfg->budget_bytes, m->ebytes, m->p.name);
  size_t host = m->ebytes * (size_t)m->E * (size_t)m->L;
  uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  if (!rc && !first && host > phys / 10 * 8)
    rc = tdm_set_error(TDM_ENOMEM, 0, "%s with %d layers needs %.1f GiB of pinned host memory "
                    "for its experts; this machine has %.1f GiB (at most 80%% of it is taken)%s",
                    m->p.name, m->L, host / 1073741824.0, phys / 1073741824.0,
                    cfg->source ? "" : ": use --layers to run fewer");
  if (!rc) rc = check_placement(cfg);
  if (!rc && cfg->source && (m->p.shared || !cfg->source->expert || !cfg->source->router ||
                             !cfg->source->norm))
    rc = tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: a weight source needs its three "
                       "functions, and a preset without shared experts");
  if (!rc && !(cfg->norm_eps >= 0))
    rc = tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: a norm epsilon of %g", cfg->norm_eps);
  if (!rc && !(m->ops = tdm_moe_ops_for(cfg->device)))
    rc = TDM_ENOTSUP; /* tdm_moe_ops_for's message says why (no BLAS, a module that failed) */
  if (!rc && m->quant && (!m->ops->expert_q || !m->ops->experts_q))
    rc = tdm_set_error(TDM_ENOTSUP, 0, "the %s MoE table computes bf16 experts only (no "
                       "expert_q/experts_q): widen the experts to bf16 to run there",
                       m->ops->name);
  if (!rc && cfg->time_chain &&
      !(m->chain = calloc(1 + (size_t)CHAIN_MARKS * m->L, sizeof *m->chain)))
    rc = tdm_set_error(TDM_ENOMEM, 0, "no memory for the chain's markers");
  if (!rc)
    rc = tdm_queue_create(cfg->device,
                          TDM_QUEUE_IN_ORDER | (cfg->time_chain ? TDM_QUEUE_TIMING : 0), &m->q);
  if (!rc) rc = m->ops->open(m->q, &m->ops_state);
  if (!rc && first) {
    tdm_device_info a, b;
    m->host_experts = first->host_experts;
    rc = tdm_device_info_get(cfg->device, &a);
    if (!rc) rc = tdm_device_info_get(first->cfg.device, &b);
    m->peer = !rc && strcmp(a.backend, b.backend) == 0;
  }
  if (!rc && !first) rc = host_experts_alloc(m, host);
  if (rc == TDM_ENOMEM && !m->host_experts && m->q)
    tdm_set_error(TDM_ENOMEM, 0, "cannot pin %.1f GiB of host memory for the experts",
               host / 1073741824.0);
  if (!rc && !first) rc = fill_parallel(m);
  if (!rc) rc = setup_small_weights(m);
  if (!rc && m->ndev > 1 && !first) rc = setup_owners(m);
  if (first) m->owners = first->owners;
  m->prefill_from = prefill_from(m);
  if (!rc) rc = setup_buffers(m);
  if (!rc) rc = setup_streamer(m);
  if (!rc && cfg->placement != TDM_MOE_PLACE_DEVICE) rc = setup_host(m);
  m->cores_upload = m->ops && m->ops->upload && tdm_moe__env_long("TANDEM_MOE_UPLOAD", 0, 1, 1);
  if (rc) {
    tdm_moe_model_destroy(m);
    return rc;
  }
  *out = m;
  return 0;
}

/* cfg's devices (expert parallelism), checked: several, devices[0] the model's device, no
 * device twice, placement DEVICE, no chain timing (it follows one queue). */
static int check_devices(const tdm_moe_config *cfg) {
  if (!cfg->devices && cfg->ndevices <= 1) return 0;
  const char *why = NULL;
  if (!cfg->devices || cfg->ndevices < 2 || cfg->ndevices > TDM_MOE_DEVICES_MAX)
    why = "devices: NULL, or 2 to TDM_MOE_DEVICES_MAX of them";
  else if (cfg->devices[0] != cfg->device)
    why = "devices[0] must be the model's device";
  else if (cfg->placement != TDM_MOE_PLACE_DEVICE)
    why = "host placement with several devices";
  else if (cfg->time_chain)
    why = "time_chain with several devices";
  for (int i = 0; !why && i < cfg->ndevices; i++)
    for (int j = 0; !why && j < i; j++)
      if (!cfg->devices[i] || cfg->devices[i] == cfg->devices[j])
        why = "devices: each one once, none NULL";
  return why ? tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: %s (%d given)", why,
                             cfg->ndevices)
             : 0;
}

int tdm_moe_model_create(const tdm_moe_config *cfg, tdm_moe_model **out) {
  if (!cfg || !cfg->preset || !cfg->device || !out || cfg->max_tokens < 1)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_model_create: bad configuration");
  int rc = check_shape(cfg);
  if (!rc) rc = check_devices(cfg);
  tdm_moe_model *m = NULL;
  if (!rc) rc = model_create(cfg, NULL, 0, &m);
  if (!rc && m->ndev > 1 &&
      (!(m->shards = calloc((size_t)m->ndev - 1, sizeof *m->shards)) ||
       !(m->part_ready = calloc((size_t)m->ndev - 1, sizeof *m->part_ready))))
    rc = tdm_set_error(TDM_ENOMEM, 0, "no memory");
  for (int d = 1; !rc && d < (m ? m->ndev : 0); d++) {
    tdm_moe_config sc = *cfg;
    sc.device = cfg->devices[d];
    rc = model_create(&sc, m, d, &m->shards[d - 1]);
    if (!rc) m->staged = m->staged || !m->shards[d - 1]->peer;
  }
  if (rc) {
    tdm_moe_model_destroy(m);
    return rc;
  }
  *out = m;
  return 0;
}

void tdm_moe_model_destroy(tdm_moe_model *m) {
  if (!m) return;
  for (int d = 0; m->shards && d < m->ndev - 1; d++) { /* they read the host copy */
    tdm_moe_model_destroy(m->shards[d]);
    if (m->part_ready && m->part_ready[d]) tdm_event_release(m->part_ready[d]);
  }
  free(m->shards);
  free(m->part_ready);
  if (m->q) tdm_queue_sync(m->q);
  destroy_host(m);
  if (m->streamer) tdm_streamer_destroy(m->streamer);
  if (m->q) tdm_queue_sync(m->q);
  void *dev[] = {m->router, m->bias,  m->norm,   m->shared,   m->x,         m->xn,
                 m->out,    m->wts,   m->idx,    m->rs,       m->ws,        m->out_shared,
                 m->ones,   m->iota,  m->idx_h,  m->rs_h,     m->pidx,
                 m->pwts,   m->pidx_h, m->x_h,   m->groups,   m->groups_h,  m->wofs,
                 m->idx_all, m->idx_all_h, m->part, m->part_h, m->xw_h};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
    if (dev[i]) tdm_free(dev[i]);
  if (!m->first) host_experts_free(m);
  for (int t = 0; t <= GROUPED_MAX_T; t++)
    if (m->graphs[t]) m->ops->graph_free(m->ops_state, m->graphs[t]);
  if (m->ops_state) m->ops->close(m->ops_state);
  if (m->q) tdm_queue_destroy(m->q);
  free(m->host_ptrs);
  free(m->rank);
  free(m->scratch);
  free(m->fill);
  free(m->unreleased);
  free(m->own_buf);
  free(m->fixed);
  free(m->load);
  free(m->chain);
  free(m->fmt);
  free(m);
}

tdm_streamer *tdm_moe_streamer(tdm_moe_model *m) { return m->streamer; }

tdm_streamer *tdm_moe_streamer_at(tdm_moe_model *m, int device) {
  if (!m || device < 0 || device >= m->ndev) return NULL;
  return device ? m->shards[device - 1]->streamer : m->streamer;
}

/* Per layer: the keys fixed in a resident set stay where they are; the others go, most loaded
 * first (ties: the more popular), each to the device with the least load so far (ties: the
 * fewer experts, then the lower index). The measured loads start again from 0. */
int tdm_moe_rebalance(tdm_moe_model *m) {
  if (!m) return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_rebalance: m is NULL");
  if (m->in_pass)
    return tdm_set_error(TDM_ESTATE, 0, "tdm_moe_rebalance: a MoE pass is underway");
  if (m->ndev <= 1) return 0;
  int E = m->E, *order = m->scratch + 2 * E;
  for (int l = 0; l < m->L; l++) {
    const uint64_t *load = m->load + (size_t)l * E;
    const int *rank = m->rank + (size_t)l * E;
    unsigned char *own = m->own_buf + (size_t)l * E;
    uint64_t dl[TDM_MOE_DEVICES_MAX] = {0};
    int cnt[TDM_MOE_DEVICES_MAX] = {0}, nf = 0;
    for (int e = 0; e < E; e++) {
      if (m->fixed[(size_t)l * E + e]) {
        dl[own[e]] += load[e];
        cnt[own[e]]++;
      } else {
        int i = nf++; /* insertion, most loaded first, then by rank */
        while (i > 0 && (load[order[i - 1]] < load[e] ||
                         (load[order[i - 1]] == load[e] && rank[order[i - 1]] > rank[e]))) {
          order[i] = order[i - 1];
          i--;
        }
        order[i] = e;
      }
    }
    for (int i = 0; i < nf; i++) {
      int best = 0;
      for (int d = 1; d < m->ndev; d++)
        if (dl[d] < dl[best] || (dl[d] == dl[best] && cnt[d] < cnt[best])) best = d;
      own[order[i]] = (unsigned char)best;
      dl[best] += load[order[i]];
      cnt[best]++;
    }
  }
  memset(m->load, 0, (size_t)m->L * E * sizeof *m->load);
  return 0;
}

void tdm_moe_make_input(const tdm_moe_model *m, float *x, int n, uint64_t pos, bool decode) {
  uint64_t s = m->cfg.seed * 31u + (decode ? 0xdec0de : 0) + (decode ? 0 : pos);
  double a = decode ? m->cfg.locality : 0.0, b = sqrt(1.0 - a * a);
  for (int t = 0; t < n; t++) {
    float *row = x + (size_t)t * m->H;
    for (int h = 0; h < m->H; h++) {
      float z = gauss(&s);
      row[h] = (t > 0 && decode) ? (float)(a * row[h - m->H] + b * z) : z;
    }
  }
}

/* ---- the forward pass ---- */

/* Uploads of at most this many bytes go by the op table's upload() where it has one: a
 * layer's token lists up to ubatches of 8192 tokens (64 bytes a token), and the input of up to
 * 128 (8 KiB a token for Qwen3-30B-A3B). */
#define UPLOAD_SMALL_MAX (1024 * 1024)

/* A small copy from pinned memory to the device, on the compute queue: by the device's cores
 * where the op table can (upload()), so that a layer's token lists, group tables and host rows
 * never wait behind the streamer's expert copies on the link; else tdm_memcpy. The copy
 * engines take copies in the order they were queued, whatever the queue: a prefill layer's
 * token lists queued as a copy waited for the next layer's look-ahead, up to 16 expert copies
 * (2.8 ms on the H200), and the layer's computes, which free the staging slots, with them. */
static int upload_small(tdm_moe_model *m, void *dst, const void *src, size_t n) {
  if (m->cores_upload && n <= UPLOAD_SMALL_MAX)
    return m->ops->upload(m->ops_state, m->q, dst, src, n);
  return tdm_memcpy(m->q, dst, src, n, TDM_COPY_H2D, 0, NULL, NULL);
}

/* Releases an acquired expert. A release that fails leaves it pinned (tdm_streamer_release),
 * which would hold its slot for good: the key is kept and released again at the end of the
 * pass (pass_finish), once the queue has synced, and at the next pass's start if that fails
 * too. */
static int expert_release(tdm_moe_model *m, int l, int e, tdm_event *done) {
  int rc = tdm_streamer_release(m->streamer, l, e, done);
  if (rc && m->nunreleased < m->L * m->E) m->unreleased[m->nunreleased++] = l * m->E + e;
  return rc;
}

/* The releases that failed, again (the queue is synced: no event is needed). The first
 * failure is returned; what fails again stays for the next try. */
static int release_again(tdm_moe_model *m) {
  int rc = 0, k = 0;
  for (int i = 0; i < m->nunreleased; i++) {
    int key = m->unreleased[i];
    int rr = tdm_streamer_release(m->streamer, key / m->E, key % m->E, NULL);
    if (rr) m->unreleased[k++] = key;
    if (!rc) rc = rr;
  }
  m->nunreleased = k;
  return rc;
}

/* time_chain: a timed marker on the compute queue, layer l's `mark` (l < 0: the pass's start). */
static int chain_mark(tdm_moe_model *m, int l, int mark) {
  if (!m->chain) return 0;
  tdm_event **e = &m->chain[l < 0 ? 0 : 1 + (size_t)CHAIN_MARKS * l + mark];
  if (*e) tdm_event_release(*e); /* a layer marked twice keeps its last */
  *e = NULL;
  int rc = tdm_event_record(m->q, e);
  if (rc) *e = NULL;
  return rc;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Groups the tokens of each expert (rows: token index, slots: t*k + j), in token order. */
static void group(tdm_moe_model *m, int T, int *count, int *offset) {
  int E = m->E, k = m->k;
  memset(count, 0, (size_t)E * sizeof *count);
  for (int i = 0; i < T * k; i++) count[m->idx_h[i]]++;
  offset[0] = 0;
  for (int e = 1; e < E; e++) offset[e] = offset[e - 1] + count[e - 1];
  int *fill = m->fill;
  memcpy(fill, offset, (size_t)E * sizeof *fill);
  for (int t = 0; t < T; t++)
    for (int j = 0; j < k; j++) {
      int e = m->idx_h[t * k + j], at = fill[e]++;
      m->rows_h[at] = t;
      m->slots_h[at] = t * k + j;
    }
}

/* Layer l's RMSNorm (x into xn) and router (top-k into idx, weights into wts). */
static int norm_route(tdm_moe_model *m, int l, int T, int32_t *idx) {
  int H = m->H, E = m->E, rc;
  if ((rc = m->ops->rmsnorm(m->ops_state, m->q, m->xn, m->x, m->norm + (size_t)l * H, T, H,
                            m->eps)))
    return rc;
  return m->ops->router(m->ops_state, m->q, m->xn, m->router + (size_t)l * E * H,
                        m->bias + (size_t)l * E, T, H, E, m->k, m->p.renorm, idx, m->wts);
}

/* The layers after l that its look-ahead predicts: pdepth, as far as there are any. */
static int predicted_layers(const tdm_moe_model *m, int l) {
  return m->L - 1 - l < m->pdepth ? m->L - 1 - l : m->pdepth;
}

/* RMSNorm and the router, then the control plane: this layer's routing lands in pinned memory
 * and the host waits for that small copy only, never for the whole device; then the tokens
 * are grouped per expert and the groups go back to the device. The predictor (the next
 * layer's router on this layer's input) is queued after the routing's copy and before the
 * wait, so its answer lands while this layer's experts compute without delaying the routing;
 * *predicted is its copy's event (NULL without one). Where
 * experts may be placed on the host, xn comes back before the routing too: once the host has
 * the routing it has xn, and the host experts start at once, with no wait on the device. */
static int layer_route(tdm_moe_model *m, int l, int T, tdm_moe_pass_stats *st, int *count,
                       int *offset, tdm_event **predicted) {
  const tdm_moe_ops *ops = m->ops;
  void *os = m->ops_state;
  int H = m->H, E = m->E, k = m->k, rc;
  *predicted = NULL;
  if ((rc = norm_route(m, l, T, m->idx))) return rc;
  if (m->place.placement != TDM_MOE_PLACE_DEVICE && T <= GROUPED_MAX_T &&
      (rc = tdm_memcpy(m->q, m->xn_h, m->xn, (size_t)T * H * sizeof(float), TDM_COPY_D2H, 0, NULL,
                       NULL)))
    return rc;
  tdm_event *routed;
  if ((rc = tdm_memcpy(m->q, m->idx_h, m->idx, (size_t)T * k * sizeof(int32_t), TDM_COPY_D2H, 0,
                       NULL, &routed)))
    return rc;
  if ((rc = chain_mark(m, l, CHAIN_ROUTED))) {
    tdm_event_release(routed);
    return rc;
  }
  /* The predictor goes behind the routing's copy: the host waits for the routing alone. It
   * routes this layer's input through the routers of the next pdepth layers (as far as there
   * are any), into pidx one layer after the other, and copies them back at once. */
  int nd = predicted_layers(m, l);
  size_t tk = (size_t)T * k;
  for (int d = 1; !rc && d <= nd; d++)
    rc = ops->router(os, m->q, m->xn, m->router + (size_t)(l + d) * E * H,
                     m->bias + (size_t)(l + d) * E, T, H, E, k, m->p.renorm,
                     m->pidx + (d - 1) * tk, m->pwts);
  if (!rc && nd > 0)
    rc = tdm_memcpy(m->q, m->pidx_h, m->pidx, nd * tk * sizeof(int32_t), TDM_COPY_D2H, 0, NULL,
                    predicted);
  if (rc) {
    tdm_event_release(routed);
    return rc;
  }
  double w0 = now_s();
  rc = tdm_event_wait(routed);
  st->wait_seconds += now_s() - w0;
  tdm_event_release(routed);
  if (rc) return rc;
  group(m, T, count, offset);
  /* rows and slots, back to back: one copy */
  return upload_small(m, m->rs, m->rs_h, 2 * (size_t)T * k * sizeof(int32_t));
}

/* Routed experts, most popular first: order[0..n) gets the experts with tokens that this
 * model's device computes, by rank; *routed, how many experts have tokens in all. */
static int layer_order(const tdm_moe_model *m, int l, const int *count, int *order, int *routed) {
  int E = m->E, n = 0;
  for (int e = 0; e < E; e++) order[e] = -1;
  for (int e = 0; e < E; e++) order[m->rank[(size_t)l * E + e]] = count[e] ? e : -1;
  for (int r = 0; r < E; r++)
    if (order[r] >= 0) order[n++] = order[r];
  *routed = n;
  return owned_only(m, l, order, n);
}

/* The routed experts order[0..n), in the streamer's order: what it staged ahead first, then
 * the copies, with the experts held on the device computed while each lands. Both runs,
 * overlapped and serialized, take the same order. */
static int layer_experts(tdm_moe_model *m, int l, bool overlap, tdm_moe_pass_stats *st,
                         const int *count, const int *offset, int *order, int n) {
  int rc;
  if ((rc = tdm_streamer_schedule(m->streamer, l, order, n))) return rc;
  tdm_queue *demand = NULL;
  tdm_streamer_queues(m->streamer, &demand, NULL);
  if (overlap && (rc = tdm_streamer_prefetch(m->streamer, l, order, n))) return rc;
  if ((rc = chain_mark(m, l, CHAIN_STARTED))) return rc;
  for (int i = 0; i < n; i++) {
    int e = order[i];
    const void *w;
    double t0 = now_s();
    if ((rc = tdm_streamer_acquire(m->streamer, l, e, &w, NULL))) return rc;
    double t1 = now_s();
    rc = m->quant ? m->ops->expert_q(m->ops_state, m->q, m->xn, m->rows + offset[e],
                                     m->slots + offset[e], count[e], w, m->fmt[l], m->H, m->I,
                                     m->out, m->ws, m->ws_bytes)
                  : m->ops->expert(m->ops_state, m->q, m->xn, m->rows + offset[e],
                                   m->slots + offset[e], count[e], w, m->H, m->I, m->out, m->ws,
                                   m->ws_bytes);
    double t2 = now_s();
    st->ops_seconds += t2 - t1;
    st->streamer_seconds += t1 - t0;
    /* Overlapped, the streamer records the compute's end itself, and only for a slot that
     * can be overwritten. Serialized, the next copy waits for this compute. */
    tdm_event *done = NULL;
    if (!rc && !overlap) rc = tdm_event_record(m->q, &done);
    int rr = expert_release(m, l, e, done);
    if (!rc) rc = rr;
    if (!rc && !overlap) rc = tdm_queue_wait(demand, done);
    if (done) tdm_event_release(done);
    if (rc) return rc;
    /* Keep the copy queue fed: prefetch what comes next, as far as the depth allows. */
    if (overlap && i + 1 < n &&
        (rc = tdm_streamer_prefetch(m->streamer, l, order + i + 1, n - i - 1)))
      return rc;
    st->streamer_seconds += now_s() - t2;
    st->experts_computed++;
  }
  return chain_mark(m, l, CHAIN_DEVICE);
}

/* The batch of acquired experts b[0..nb) as one group: their table entries (at `at` in this
 * layer's table, so no entry the device may still read is overwritten) go to the device, the
 * group is computed, and each expert is released: overlapped, the streamer records the
 * compute's end itself, and only for a slot that can be overwritten; serialized, the next copy
 * waits for this compute. */
/* After a failure: the acquired experts b[0..nb) unpinned, uncomputed; their slots are free
 * after whatever was queued. The failure being reported is the first one, so a release's own
 * is dropped. */
static void batch_release(tdm_moe_model *m, int l, const int *b, int nb) {
  for (int i = 0; i < nb; i++) {
    int rr = expert_release(m, l, b[i], NULL);
    (void)rr;
  }
}

static int group_flush(tdm_moe_model *m, int l, int T, bool overlap, tdm_moe_pass_stats *st,
                       const int *b, int nb, int at) {
  int rc;
  double t0 = now_s();
  if ((rc = upload_small(m, m->groups + at, m->groups_h + at, (size_t)nb * sizeof *m->groups_h)) ||
      (rc = run_experts(m, l, m->ops, m->ops_state, m->q, m->xn, m->rows, m->slots, T * m->k,
                        m->wbase, m->groups + at, nb, m->out, m->ws, m->ws_bytes))) {
    batch_release(m, l, b, nb);
    return rc;
  }
  double t1 = now_s();
  st->ops_seconds += t1 - t0;
  tdm_event *done = NULL;
  tdm_queue *demand = NULL;
  if (!overlap && !(rc = tdm_event_record(m->q, &done)) &&
      !(rc = tdm_streamer_queues(m->streamer, &demand, NULL)))
    rc = tdm_queue_wait(demand, done);
  for (int i = 0; i < nb; i++) {
    int rr = expert_release(m, l, b[i], done);
    if (!rc) rc = rr;
  }
  if (done) tdm_event_release(done);
  st->streamer_seconds += now_s() - t1;
  st->experts_computed += nb;
  return rc;
}

/* Placement of the routed experts order[0..n) of layer l (in the streamer's order): the host
 * candidates are those neither on the device nor on their way. HOST takes every candidate;
 * AUTO takes the share the cost model gives of the layer's non-resident experts (candidates
 * and copies in flight), less the host join's round trip in experts (join_experts), so that
 * both sides finish them at about the same time, rounded with the remainder carried from
 * layer to layer (the look-ahead uses the carry and leaves it), at most every candidate, and the
 * last ones in the order: their copies would start last. The host's experts go to
 * host[0..*nh) in order; order keeps the device's, in order, *n of them.
 * The look-ahead (ahead: predicting layer l) places the predicted experts by the same rule and
 * marks those it leaves to the device while they are not on it: their copies start now. At
 * any later placement of the layer (its own, or another look-ahead's, with a look-ahead deeper
 * than one layer), an expert so marked this pass whose copy has since landed still counts as
 * non-resident: else the share would be taken of fewer experts than the first split, and the
 * experts it left to the host would go back to the link, a few more at each placement. */
static int place(tdm_moe_model *m, int l, int *order, int *n, int *host, int *nh,
                 int *candidates, bool ahead) {
  int ncand = 0, ninflight = 0, nlanded = 0, *where = m->hwhere;
  uint32_t *mark = m->ahead + (size_t)l * m->E;
  *nh = *candidates = 0;
  for (int i = 0; i < *n; i++) {
    if ((where[i] = tdm_streamer_where(m->streamer, l, order[i])) < 0) return where[i];
    ncand += where[i] == TDM_EXPERT_ABSENT;
    ninflight += where[i] == TDM_EXPERT_INFLIGHT;
    nlanded += where[i] == TDM_EXPERT_READY && mark[order[i]] == m->pass;
  }
  int want = ncand;
  if (m->place.placement == TDM_MOE_PLACE_AUTO) {
    double exact = m->place.host_share * (ncand + ninflight + nlanded) - m->join_experts;
    want = (int)floor(exact + m->carry + 0.5);
    if (want > ncand) want = ncand;
    if (want < 0) want = 0;
    /* What rounding gave or took is carried to the layer placed next, so that the host's
     * part over many layers is the share, not what rounding each layer's few experts makes
     * of it (0.52 of 4 is 2, of 5 is 3, and a run's split went with the layers' counts). */
    if (!ahead) m->carry = fmin(1.0, fmax(-1.0, exact + m->carry - want));
  }
  /* Mark the last `want` candidates (where = -1), then split the order. */
  for (int i = *n - 1, left = want; i >= 0 && left > 0; i--)
    if (where[i] == TDM_EXPERT_ABSENT) {
      where[i] = -1;
      left--;
    }
  int kept = 0;
  for (int i = 0; i < *n; i++) {
    if (where[i] == -1) {
      host[(*nh)++] = order[i];
      continue;
    }
    if (ahead && where[i] != TDM_EXPERT_READY) mark[order[i]] = m->pass;
    order[kept++] = order[i];
  }
  *n = kept;
  *candidates = ncand;
  return 0;
}

/* The host experts host[0..nh) of layer l, submitted before the device's: dealt round-robin to
 * the host queues, each queue's as one call of the CPU table's experts() (which splits the
 * rows of all of them between the pool's threads pass by pass, so the pool joins twice a
 * layer, not twice an expert), from their pinned weights and xn_h (which layer_route() copied
 * back ahead of the routing the host has waited for), writing out_h at their tokens' slots.
 * What the host queues read stays put until they are done, ordered by events:
 * - xn_h is written next by the next layer's copy, which the compute queue runs after
 *   host_join()'s waits for this layer's host queues;
 * - rows_h and slots_h (the token lists group() built) are rewritten by the host thread only
 *   after it has waited for the next routing's copy (layer_route), which the in-order compute
 *   queue also runs after those waits, so only once every host expert of this layer is done;
 *   the next pass regroups after tdm_moe_forward's final sync, which covers them too;
 * - out_h is written next by the next layer's host experts, which the host thread submits only
 *   after it has waited for the next routing's copy, which the compute queue runs after this
 *   layer's copies out of out_h;
 * - hgroups, the tables, are rewritten by the next layer's host_submit, after that same wait.
 * Under TSan these are happens-before edges through tandem's events, not through timing. */
static int host_submit(tdm_moe_model *m, int l, int T, const int *count, const int *offset,
                       const int *host, int nh) {
  int rc = 0, used = nh < m->nhq ? nh : m->nhq;
  if (m->spans) { /* time_host: each queue's start, before its first expert */
    m->span_base = m->nspans;
    for (int j = 0; !rc && j < used; j++) {
      tdm_event **pair = m->spans + 2 * (size_t)m->nspans++;
      pair[1] = NULL;
      rc = tdm_event_record(m->hq[j], &pair[0]);
      if (rc) pair[0] = NULL;
    }
  }
  tdm_moe_group *g = m->hgroups;
  for (int j = 0; !rc && j < used; j++) {
    tdm_moe_group *table = g;
    for (int i = j; i < nh; i += m->nhq) {
      const tdm_moe_bf16 *w = m->host_ptrs[(size_t)l * m->E + host[i]];
      *g++ = (tdm_moe_group){.w = (int64_t)(w - m->host_experts), .first = offset[host[i]],
                             .count = count[host[i]]};
    }
    rc = run_experts(m, l, m->hops, m->hstate[j], m->hq[j], m->xn_h, m->rows_h, m->slots_h,
                     T * m->k, m->host_experts, table, (int)(g - table), m->out_h, m->hws[j],
                     m->hws_bytes);
  }
  return rc;
}

/* The join: the compute queue waits (device-side) for each host queue used, then copies the
 * rows the host experts wrote into out, runs of adjacent slots at once, ahead of the combine. */
static int host_join(tdm_moe_model *m, int l, int T, const int *count, const int *offset,
                     const int *host, int nh) {
  int rc = 0, used = nh < m->nhq ? nh : m->nhq, n = T * m->k;
  for (int j = 0; !rc && j < used; j++) {
    tdm_event *done;
    if (!(rc = tdm_event_record(m->hq[j], &done))) {
      rc = tdm_queue_wait(m->q, done);
      if (m->spans) /* time_host: kept as the end of this queue's span */
        m->spans[2 * (size_t)(m->span_base + j) + 1] = done;
      else
        tdm_event_release(done);
    }
  }
  if (!rc) rc = chain_mark(m, l, CHAIN_JOINED);
  memset(m->slot_host, 0, (size_t)n);
  for (int i = 0; i < nh; i++)
    for (int t = 0; t < count[host[i]]; t++) m->slot_host[m->slots_h[offset[host[i]] + t]] = 1;
  size_t row = (size_t)m->H * sizeof(float);
  for (int a = 0; !rc && a < n; a++) {
    if (!m->slot_host[a]) continue;
    int b = a;
    while (b + 1 < n && m->slot_host[b + 1]) b++;
    rc = upload_small(m, (char *)m->out + a * row, (char *)m->out_h + a * row,
                      (size_t)(b - a + 1) * row);
    a = b;
  }
  return rc;
}

/* A small ubatch's routed experts order[0..n) in groups (experts()), in the streamer's order:
 * the experts on the device go as one group, submitted before anything waits for a copy; each
 * expert still landing closes the group before it and opens the next, which the ready experts
 * behind it join. The compute queue waits for a copy only in the group that needs it. */
static int layer_experts_grouped(tdm_moe_model *m, int l, int T, bool overlap,
                                 tdm_moe_pass_stats *st, const int *count, const int *offset,
                                 int *order, int n) {
  int rc, at = 0, nb = 0, *batch = m->fill; /* group()'s cursors are free again */
  /* at most half the staging slots: the copies go on into the others while a group computes */
  int half = staging_slots(m) / 2 > 1 ? staging_slots(m) / 2 : 1;
  int prefill_group = PREFILL_GROUP < half ? PREFILL_GROUP : half;
  int nh = 0, *host = m->hsel, candidates = 0;
  if ((rc = tdm_streamer_schedule(m->streamer, l, order, n))) return rc;
  /* Host experts first, so the host works while the device's copies and compute go on; the
   * device's list (order) no longer names them, so nothing prefetches or acquires them. */
  if (m->place.placement != TDM_MOE_PLACE_DEVICE && T <= GROUPED_MAX_T) {
    if ((rc = place(m, l, order, &n, host, &nh, &candidates, false))) return rc;
    st->host_candidates += (uint64_t)candidates;
    double h0 = now_s();
    if (nh && (rc = host_submit(m, l, T, count, offset, host, nh))) return rc;
    st->ops_seconds += now_s() - h0;
  }
  if (overlap && (rc = tdm_streamer_prefetch(m->streamer, l, order, n))) return rc;
  if ((rc = chain_mark(m, l, CHAIN_STARTED))) return rc;
  for (int i = 0; !rc && i < n; i++) {
    int e = order[i];
    /* Serialized, every expert is a group of its own, so each copy follows the compute
     * before it, as in the ungrouped baseline. A large ubatch's group that an expert still
     * landing would end goes on until it holds prefill_group experts: a group of one fills
     * few of the GPU's multiprocessors, and a few experts' copies take longer than computing
     * them together. */
    if (nb > 0 && (!overlap || (tdm_streamer_ready(m->streamer, l, e) != 1 &&
                                (T <= GROUPED_MAX_T || nb >= prefill_group)))) {
      if ((rc = group_flush(m, l, T, overlap, st, batch, nb, at))) return rc;
      at += nb;
      nb = 0;
    }
    double t0 = now_s();
    const void *w;
    if ((rc = tdm_streamer_acquire(m->streamer, l, e, &w, NULL))) break;
    batch[nb++] = e;
    tdm_moe_group *g = &m->groups_h[at + nb - 1];
    *g = (tdm_moe_group){.first = offset[e], .count = count[e]};
    rc = weights_offset(m, w, &g->w);
    /* Keep the copy queue fed: prefetch what comes next, as far as the depth allows. */
    if (!rc && overlap && i + 1 < n)
      rc = tdm_streamer_prefetch(m->streamer, l, order + i + 1, n - i - 1);
    st->streamer_seconds += now_s() - t0;
  }
  if (rc) {
    batch_release(m, l, batch, nb);
    return rc; /* host experts already queued finish on their own; forward drains them */
  }
  if (nb && (rc = group_flush(m, l, T, overlap, st, batch, nb, at))) return rc;
  if ((rc = chain_mark(m, l, CHAIN_DEVICE))) return rc;
  if (nh) {
    rc = host_join(m, l, T, count, offset, host, nh);
    st->host_experts += (uint64_t)nh;
    st->experts_computed += nh;
  }
  return rc;
}

/* The next layers' experts, streamed ahead while this layer finishes: the predicted ones of the
 * next pdepth layers, each once, layer by layer (the serialized baseline copies nothing
 * ahead); or, in prefill (a ubatch that touched n of this layer's experts, nearly all), the
 * next layer's most popular ones, into the staging slots this layer frees while its last
 * experts compute and its routing travels. */
/* Prefetches order[0..n) of layer l, where a small ubatch places experts on the host: then
 * only those the placement would leave to the device (the same rule as the layer's own, on
 * what is known now), so that no copy is made for an expert the host will compute. */
static int lookahead_prefetch(tdm_moe_model *m, int l, int T, int *order, int n) {
  int rc, nh, candidates;
  n = owned_only(m, l, order, n);
  if (n && T <= GROUPED_MAX_T && m->place.placement != TDM_MOE_PLACE_DEVICE &&
      ((rc = tdm_streamer_schedule(m->streamer, l, order, n)) ||
       (rc = place(m, l, order, &n, m->hsel, &nh, &candidates, true))))
    return rc;
  return n ? tdm_streamer_prefetch(m->streamer, l, order, n) : 0;
}

/* Every expert of layer l prefetched in rank order, most popular first (where a ubatch is
 * expected to route nearly all of them; the streamer skips those on the device). */
static int rank_prefetch(tdm_moe_model *m, int l, int T, int *order) {
  int E = m->E;
  for (int e = 0; e < E; e++) order[m->rank[(size_t)l * E + e]] = e;
  return lookahead_prefetch(m, l, T, order, E);
}

static int layer_lookahead(tdm_moe_model *m, int l, int T, bool overlap, tdm_moe_pass_stats *st,
                           tdm_event *predicted, int n, int *count, int *order) {
  int E = m->E, k = m->k, rc;
  if (predicted) {
    double p0 = now_s();
    rc = tdm_event_wait(predicted);
    st->wait_seconds += now_s() - p0;
    tdm_event_release(predicted);
    if (rc) return rc;
    /* The predicted layers in order, so that their copies queue in the order they are needed. */
    int nd = predicted_layers(m, l);
    for (int d = 1; overlap && d <= nd; d++) {
      const int32_t *p = m->pidx_h + (size_t)(d - 1) * T * k;
      int np = 0;
      memset(count, 0, (size_t)E * sizeof *count);
      for (int i = 0; i < T * k; i++)
        if (!count[p[i]]++) order[np++] = p[i];
      if ((rc = lookahead_prefetch(m, l + d, T, order, np))) return rc;
    }
    return 0;
  }
  if (overlap && l + 1 < m->L && n >= E - E / 8) return rank_prefetch(m, l + 1, T, order);
  return 0;
}

/* The shared experts (every token, resident), then the routed experts' weighted sum. */
static int layer_combine(tdm_moe_model *m, int l, int T) {
  const tdm_moe_ops *ops = m->ops;
  void *os = m->ops_state;
  int H = m->H, rc;
  for (int j = 0; j < m->p.shared; j++) {
    size_t sb = (size_t)3 * H * m->p.shared_ffn;
    const tdm_moe_bf16 *w = m->shared + ((size_t)l * m->p.shared + j) * sb;
    if ((rc = ops->expert(os, m->q, m->xn, m->iota, m->iota, T, w, H, m->p.shared_ffn,
                          m->out_shared, m->ws, m->ws_bytes)) ||
        (rc = ops->combine(os, m->q, m->x, m->out_shared, m->ones, T, H, 1)))
      return rc;
  }
  return ops->combine(os, m->q, m->x, m->out, m->wts, T, H, m->k);
}

/* One layer of a small ubatch with every expert resident, all on the device: nothing comes
 * back to the host and nothing waits; the routing is kept (idx_all) for the pass's figures. */
static int layer_device(tdm_moe_model *m, int l, int T) {
  const tdm_moe_ops *ops = m->ops;
  void *os = m->ops_state;
  int E = m->E, k = m->k, G = E < T * k ? E : T * k, rc;
  int32_t *idx = m->idx_all + (size_t)l * T * k;
  if ((rc = norm_route(m, l, T, idx)) ||
      (rc = ops->group(os, m->q, idx, T, k, E, m->wofs + (size_t)l * E, m->rows, m->slots,
                       m->groups)) ||
      (rc = run_experts(m, l, ops, os, m->q, m->xn, m->rows, m->slots, T * k, m->wbase, m->groups,
                        G, m->out, m->ws, m->ws_bytes)))
    return rc;
  return layer_combine(m, l, T);
}

/* Every layer of a device-routed pass. Where the op table can record, the layers of a ubatch
 * size are recorded once, the first time, and from then on run as one submission: the same
 * kernels on the same buffers, so the same bits, for a fraction of the host's time. */
static int device_layers(tdm_moe_model *m, int T) {
  const tdm_moe_ops *ops = m->ops;
  int rc = 0;
  if (!ops->graph_begin || T > GROUPED_MAX_T) {
    for (int l = 0; !rc && l < m->L; l++) rc = layer_device(m, l, T);
    return rc;
  }
  if (!m->graphs[T]) {
    if ((rc = ops->graph_begin(m->ops_state, m->q))) return rc;
    for (int l = 0; !rc && l < m->L; l++) rc = layer_device(m, l, T);
    void *g = NULL;
    int erc = ops->graph_end(m->ops_state, m->q, &g);
    if (rc || erc) {
      if (g) ops->graph_free(m->ops_state, g);
      return rc ? rc : erc;
    }
    m->graphs[T] = g;
  }
  return ops->graph_launch(m->ops_state, m->q, m->graphs[T]);
}

/* The experts of a device-routed pass, from its routing (read back after the pass): every one
 * was resident, so each routed expert of a layer counts as one acquire that hit. */
static void count_device_routed(tdm_moe_model *m, int T, tdm_moe_pass_stats *st) {
  int *seen = m->fill, k = m->k;
  for (int l = 0; l < m->L; l++) {
    memset(seen, 0, (size_t)m->E * sizeof *seen);
    const int32_t *idx = m->idx_all_h + (size_t)l * T * k;
    for (int i = 0; i < T * k; i++)
      if (idx[i] >= 0 && idx[i] < m->E && !seen[idx[i]]++) st->experts_computed++;
  }
  st->acquires = st->hits = st->resident_hits = (uint64_t)st->experts_computed;
  st->device_routed_layers = (uint64_t)m->L;
}

/* ---- expert parallelism: the other devices' share of a layer ----
 * The first device routes; then each other device (a shard) gets the layer's normalized input
 * and weights, by a peer copy or through the first's pinned xw_h, and the token lists the host
 * grouped, computes its experts into its own out (zeroed first: the other devices' slots stay
 * zero, so the weighted sum over k is its experts' part alone, in the same order) and sums
 * them into part. The first device zeroes its own out likewise, combines its share into x,
 * and adds each shard's part after a device-side wait, in device order. Every buffer a layer
 * hands on is free again when the next layer's routing reaches the host: that routing follows
 * the first device's combine, which follows every shard's part. */

static int shard_layer(tdm_moe_model *s, tdm_moe_model *m, int l, int T, bool overlap,
                       tdm_moe_pass_stats *st, const int *count, const int *offset,
                       tdm_event *in, tdm_event **ready) {
  size_t xb = (size_t)T * s->H * sizeof(float), tk = (size_t)T * s->k;
  const float *wts_h = m->xw_h + (size_t)m->maxT * m->H;
  int rc = tdm_queue_wait(s->q, in);
  if (!rc)
    rc = s->peer ? tdm_memcpy(s->q, s->xn, m->xn, xb, TDM_COPY_D2D, 0, NULL, NULL)
                 : tdm_memcpy(s->q, s->xn, m->xw_h, xb, TDM_COPY_H2D, 0, NULL, NULL);
  if (!rc)
    rc = s->peer ? tdm_memcpy(s->q, s->wts, m->wts, tk * sizeof(float), TDM_COPY_D2D, 0, NULL, NULL)
                 : tdm_memcpy(s->q, s->wts, wts_h, tk * sizeof(float), TDM_COPY_H2D, 0, NULL, NULL);
  if (!rc) {
    memcpy(s->rs_h, m->rs_h, 2 * tk * sizeof(int32_t));
    rc = upload_small(s, s->rs, s->rs_h, 2 * tk * sizeof(int32_t));
  }
  if (!rc) rc = tdm_memset(s->q, s->out, 0, tk * s->H * sizeof(float), 0, NULL, NULL);
  int *order = s->scratch + 2 * s->E, routed = 0, n = layer_order(s, l, count, order, &routed);
  if (!rc)
    rc = grouped(s, T) ? layer_experts_grouped(s, l, T, overlap, st, count, offset, order, n)
                       : layer_experts(s, l, overlap, st, count, offset, order, n);
  /* no predictor here: a prefill's next layer, by rank, as on the first device */
  if (!rc) rc = layer_lookahead(s, l, T, overlap, st, NULL, routed, s->scratch, order);
  if (!rc) rc = tdm_memset(s->q, s->part, 0, xb, 0, NULL, NULL);
  if (!rc) rc = s->ops->combine(s->ops_state, s->q, s->part, s->out, s->wts, T, s->H, s->k);
  if (!rc && !s->peer)
    rc = tdm_memcpy(s->q, s->part_h, s->part, xb, TDM_COPY_D2H, 0, NULL, NULL);
  if (!rc) rc = tdm_event_record(s->q, ready);
  return rc;
}

/* Layer l's share of every shard, once the first device has routed it; then the first
 * device's own out zeroed. */
static int shards_layer(tdm_moe_model *m, int l, int T, bool overlap, tdm_moe_pass_stats *st,
                        const int *count, const int *offset) {
  size_t xb = (size_t)T * m->H * sizeof(float), tk = (size_t)T * m->k;
  int rc = 0;
  if (m->staged) {
    rc = tdm_memcpy(m->q, m->xw_h, m->xn, xb, TDM_COPY_D2H, 0, NULL, NULL);
    if (!rc)
      rc = tdm_memcpy(m->q, m->xw_h + (size_t)m->maxT * m->H, m->wts, tk * sizeof(float),
                      TDM_COPY_D2H, 0, NULL, NULL);
  }
  tdm_event *in = NULL;
  if (!rc) rc = tdm_event_record(m->q, &in);
  for (int d = 0; !rc && d < m->ndev - 1; d++) {
    if (m->part_ready[d]) tdm_event_release(m->part_ready[d]);
    m->part_ready[d] = NULL;
    rc = shard_layer(m->shards[d], m, l, T, overlap, st, count, offset, in, &m->part_ready[d]);
  }
  if (in) tdm_event_release(in);
  if (!rc) rc = tdm_memset(m->q, m->out, 0, tk * m->H * sizeof(float), 0, NULL, NULL);
  return rc;
}

/* The shards' parts added into x, in device order, each after a device-side wait. */
static int shards_join(tdm_moe_model *m, int T) {
  size_t xb = (size_t)T * m->H * sizeof(float);
  int rc = 0;
  for (int d = 0; !rc && d < m->ndev - 1; d++) {
    tdm_moe_model *s = m->shards[d];
    rc = tdm_queue_wait(m->q, m->part_ready[d]);
    if (!rc)
      rc = s->peer ? tdm_memcpy(m->q, m->part, s->part, xb, TDM_COPY_D2D, 0, NULL, NULL)
                   : tdm_memcpy(m->q, m->part, s->part_h, xb, TDM_COPY_H2D, 0, NULL, NULL);
    if (!rc) rc = m->ops->combine(m->ops_state, m->q, m->x, m->part, m->ones, T, m->H, 1);
  }
  return rc;
}

/* One layer, x += MoE(RMSNorm(x)), submitted on the compute queue. */
static int layer(tdm_moe_model *m, int l, int T, bool overlap, tdm_moe_pass_stats *st, int *count,
                 int *offset, int *order) {
  tdm_event *predicted = NULL;
  int rc = layer_route(m, l, T, st, count, offset, &predicted), n = 0, routed = 0;
  for (int e = 0; !rc && m->load && e < m->E; e++) m->load[(size_t)l * m->E + e] += count[e];
  if (!rc && m->shards) rc = shards_layer(m, l, T, overlap, st, count, offset);
  if (!rc) {
    n = layer_order(m, l, count, order, &routed);
    if (l == m->L - 1) {
      m->lead_n = routed;
      m->lead_T = T;
    }
    rc = grouped(m, T)
             ? layer_experts_grouped(m, l, T, overlap, st, count, offset, order, n)
             : layer_experts(m, l, overlap, st, count, offset, order, n);
  }
  /* time_chain: a layer without host experts joins as its device's experts end */
  if (!rc && m->chain && !m->chain[1 + (size_t)CHAIN_MARKS * l + CHAIN_JOINED])
    rc = chain_mark(m, l, CHAIN_JOINED);
  if (rc) {
    if (predicted) tdm_event_release(predicted);
    return rc;
  }
  if ((rc = layer_lookahead(m, l, T, overlap, st, predicted, routed, count, order)) ||
      (rc = layer_combine(m, l, T)) || (m->shards && (rc = shards_join(m, T))))
    return rc;
  return chain_mark(m, l, CHAIN_COMBINED);
}

/* time_host: the pass's spans (every one complete: the pass has synced, or drained the host
 * queues after a failure), summed into host_busy_seconds, and their events released. A span
 * whose layer failed before its join has no end and counts nothing. */
static void harvest_spans(tdm_moe_model *m, tdm_moe_pass_stats *st) {
  for (int i = 0; i < m->nspans; i++) {
    tdm_event **pair = m->spans + 2 * (size_t)i;
    double ms;
    if (pair[0] && pair[1] && tdm_event_elapsed(pair[0], pair[1], &ms) == 0)
      st->host_busy_seconds += ms / 1e3;
    for (int k = 0; k < 2; k++)
      if (pair[k]) tdm_event_release(pair[k]);
  }
  m->nspans = 0;
}

/* time_chain: the pass's markers (complete: the pass has synced) as intervals between
 * successive ones, summed over layers into the chain_* figures, and released. Only a pass that
 * succeeded is summed; a failed one may have left a layer without some of its markers. */
static void harvest_chain(tdm_moe_model *m, tdm_moe_pass_stats *st, bool ok) {
  size_t n = 1 + (size_t)CHAIN_MARKS * m->L;
  double *sum[CHAIN_MARKS] = {&st->chain_route_seconds, &st->chain_submit_seconds,
                              &st->chain_device_seconds, &st->chain_join_seconds,
                              &st->chain_combine_seconds};
  for (int l = 0; ok && l < m->L; l++) {
    tdm_event **at = m->chain + 1 + (size_t)CHAIN_MARKS * l;
    tdm_event *prev = l ? at[-1] : m->chain[0];
    for (int k = 0; k < CHAIN_MARKS; k++) {
      double ms;
      if (prev && at[k] && tdm_event_elapsed(prev, at[k], &ms) == 0) *sum[k] += ms / 1e3;
      prev = at[k];
    }
  }
  for (size_t i = 0; i < n; i++)
    if (m->chain[i]) {
      tdm_event_release(m->chain[i]);
      m->chain[i] = NULL;
    }
}

/* The look-ahead across passes: a large ubatch expected to route nearly every expert of layer
 * 0 starts that layer's copies in rank order as soon as its input is on its way, before it is
 * routed (some 3 ms of a ubatch of 8192 tokens on the H200, the link otherwise idle), as
 * layer_lookahead starts a next layer's. The previous pass's last layer stands in for the
 * layer before: one at least as large that routed fewer than 7/8 of the experts says no, one
 * at most as large that routed more says yes. Without such a pass (a prompt's first ubatch,
 * or one larger than any before, after a sparser one), a ubatch with 4 routings an expert
 * (T * k >= 4 E) is taken to route nearly all: a uniform router misses an expert then with
 * probability e^-4, under 2%, and a skewed one still routes its tail a few times at such
 * sizes. A wrong guess costs at most the staging slots' copies, of the layer's most popular
 * experts. Small ubatches and serialized passes wait for the routing. */
static bool lead_expected(const tdm_moe_model *m, int T) {
  int E = m->E;
  bool covered = m->lead_n >= E - E / 8;
  if (m->lead_T >= T) return covered;
  if (m->lead_T && covered) return true;
  return (long)T * m->k >= 4L * E;
}

static int pass_lead(tdm_moe_model *m, int T, bool overlap, int *order) {
  if (!overlap || T <= GROUPED_MAX_T || !lead_expected(m, T)) return 0;
  return rank_prefetch(m, 0, T, order);
}

/* The start of a pass of T tokens whose input is in m->x or on its way there: the buffers laid
 * out for T, the streamer's counts taken, the next layer's look-ahead started. */
static int pass_start(tdm_moe_model *m, int T, bool overlap, bool on_device, tdm_moe_pass_stats *st) {
  memset(st, 0, sizeof *st);
  m->pass++;
  /* rows then slots, back to back for this ubatch's size */
  m->rows = m->rs;
  m->slots = m->rs + (size_t)T * m->k;
  m->rows_h = m->rs_h;
  m->slots_h = m->rs_h + (size_t)T * m->k;
  m->in_pass = true;
  m->pass_T = T;
  m->pass_overlap = overlap;
  m->pass_on_device = on_device;
  int *count = m->scratch, rc = release_again(m); /* a failed pass's leftovers, if any */
  if (!rc && !on_device) rc = pass_lead(m, T, overlap, count + 2 * m->E);
  if (!rc && !on_device) rc = chain_mark(m, -1, 0);
  for (int d = 0; !rc && m->shards && d < m->ndev - 1; d++) {
    tdm_moe_model *s = m->shards[d];
    tdm_moe_pass_stats ss;
    tdm_streamer_stats_get(s->streamer, &s->pass_s0);
    s->pass_t0 = m->pass_t0;
    rc = pass_start(s, T, overlap, false, &ss);
  }
  return rc;
}

/* The end of a pass: the queue synced, the figures gathered; rc the pass's first error. */
static int pass_finish(tdm_moe_model *m, int rc, tdm_moe_pass_stats *st) {
  int T = m->pass_T;
  bool on_device = m->pass_on_device;
  m->in_pass = false;
  if (!rc && on_device)
    rc = tdm_memcpy(m->q, m->idx_all_h, m->idx_all, (size_t)m->L * T * m->k * sizeof(int32_t),
                    TDM_COPY_D2H, 0, NULL, NULL);
  double w0 = now_s();
  int src = drain(m, m->q);
  /* A pass that failed may have left host experts running that the compute queue never
   * joined: they finish before the pass returns, so the next one can reuse their buffers. */
  if (rc) (void)sync_host_queues(m);
  if (m->spans) harvest_spans(m, st);
  if (m->chain) harvest_chain(m, st, !rc && !src);
  st->wait_seconds += now_s() - w0;
  if (!rc) rc = src;
  int rr = release_again(m); /* the queue is synced: no pass of it holds these */
  if (!rc) rc = rr;
  st->seconds = now_s() - m->pass_t0;
  tdm_streamer_stats s1, *s0 = &m->pass_s0;
  tdm_streamer_stats_get(m->streamer, &s1);
  st->bytes_copied = s1.bytes_copied - s0->bytes_copied;
  st->link_busy_seconds = s1.link_busy_seconds - s0->link_busy_seconds;
  st->acquires = s1.acquires - s0->acquires;
  st->hits = s1.hits - s0->hits;
  st->misses = s1.misses - s0->misses;
  st->resident_hits = s1.resident_hits - s0->resident_hits;
  st->inflight_hits = s1.inflight_hits - s0->inflight_hits;
  st->demand_misses = st->misses;
  if (!rc && on_device) count_device_routed(m, T, st);
  for (int d = 0; m->shards && d < m->ndev - 1; d++) { /* after the first: it waits for them */
    tdm_moe_model *s = m->shards[d];
    if (!s->in_pass) continue;
    tdm_moe_pass_stats ss;
    int src2 = pass_finish(s, rc, &ss);
    if (!rc && src2) rc = src2;
    st->bytes_copied += ss.bytes_copied;
    st->link_busy_seconds += ss.link_busy_seconds;
    st->acquires += ss.acquires;
    st->hits += ss.hits;
    st->misses += ss.misses;
    st->resident_hits += ss.resident_hits;
    st->inflight_hits += ss.inflight_hits;
    st->demand_misses += ss.demand_misses;
  }
  return rc;
}

/* Before a pass writes its host buffers: the queues an earlier pass's end could not wait for
 * (drain), waited for now; while that still fails, no pass runs. */
static int settle(tdm_moe_model *m) {
  for (int d = 0; d < m->ndev; d++) {
    tdm_moe_model *x = d ? m->shards[d - 1] : m;
    if (!x->unsettled) continue;
    int rc = tdm_queue_sync(x->q);
    for (int j = 0; !rc && j < x->nhq; j++) rc = tdm_queue_sync(x->hq[j]);
    if (rc) {
      char why[256];
      snprintf(why, sizeof why, "%s", tdm_last_error());
      return tdm_set_error(rc, 0, "the last MoE pass's work could not be waited for, nor can "
                           "it now (%s)", why);
    }
    x->unsettled = false;
  }
  return 0;
}

static int check_ubatch(const tdm_moe_model *m, int T) {
  if (m->in_pass)
    return tdm_set_error(TDM_ESTATE, 0, "a MoE pass is underway (tdm_moe_pass_end ends it)");
  if (T < 1 || T > m->maxT)
    return tdm_set_error(TDM_EINVAL, 0, "a ubatch of %d tokens (this model takes 1 to %d)", T,
                         m->maxT);
  return 0;
}

int tdm_moe_forward(tdm_moe_model *m, const float *x, float *y, int T, bool overlap, tdm_moe_pass_stats *st) {
  int rc = check_ubatch(m, T);
  if (!rc) rc = settle(m);
  if (rc) return rc;
  size_t bytes = (size_t)T * m->H * sizeof(float);
  float *xh = m->x_h;
  memcpy(xh, x, bytes);
  bool on_device = routes_on_device(m, T);
  tdm_streamer_stats_get(m->streamer, &m->pass_s0);
  m->pass_t0 = now_s();
  /* Every expert resident: nothing else is on the link, so the copy engines take the input.
   * Else the input goes first, so that routing layer 0 waits for no expert's copy. */
  rc = on_device ? tdm_memcpy(m->q, m->x, xh, bytes, TDM_COPY_H2D, 0, NULL, NULL)
                 : upload_small(m, m->x, xh, bytes);
  int prc = pass_start(m, T, overlap, on_device, st);
  if (!rc) rc = prc;
  int *count = m->scratch;
  if (!rc && on_device) rc = device_layers(m, T);
  for (int l = 0; !rc && !on_device && l < m->L; l++)
    rc = layer(m, l, T, overlap, st, count, count + m->E, count + 2 * m->E);
  if (!rc) rc = tdm_memcpy(m->q, xh, m->x, bytes, TDM_COPY_D2H, 0, NULL, NULL);
  rc = pass_finish(m, rc, st);
  if (!rc) memcpy(y, xh, bytes);
  return rc;
}

tdm_queue *tdm_moe_queue(const tdm_moe_model *m) { return m ? m->q : NULL; }

float *tdm_moe_activations(const tdm_moe_model *m) { return m ? m->x : NULL; }

const tdm_moe_ops *tdm_moe_model_ops(const tdm_moe_model *m, void **state) {
  if (state) *state = m ? m->ops_state : NULL;
  return m ? m->ops : NULL;
}

bool tdm_moe_pass_on_device(const tdm_moe_model *m) {
  return m && m->in_pass && m->pass_on_device;
}

int tdm_moe_pass_begin(tdm_moe_model *m, int T, bool overlap, tdm_moe_pass_stats *st) {
  if (!m || !st) return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_pass_begin: NULL argument");
  int rc = check_ubatch(m, T);
  if (!rc) rc = settle(m);
  if (rc) return rc;
  tdm_streamer_stats_get(m->streamer, &m->pass_s0);
  m->pass_t0 = now_s();
  rc = pass_start(m, T, overlap, routes_on_device(m, T), st);
  if (rc) (void)pass_finish(m, rc, st);
  return rc;
}

int tdm_moe_pass_layer(tdm_moe_model *m, int l, tdm_moe_pass_stats *st) {
  if (!m || !st) return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_pass_layer: NULL argument");
  if (!m->in_pass) return tdm_set_error(TDM_ESTATE, 0, "tdm_moe_pass_layer: no pass underway");
  if (l < 0 || l >= m->L)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_pass_layer: layer %d of %d", l, m->L);
  int *count = m->scratch;
  if (m->pass_on_device) return layer_device(m, l, m->pass_T);
  return layer(m, l, m->pass_T, m->pass_overlap, st, count, count + m->E, count + 2 * m->E);
}

int tdm_moe_pass_end(tdm_moe_model *m, int rc, tdm_moe_pass_stats *st) {
  if (!m || !st) return tdm_set_error(TDM_EINVAL, 0, "tdm_moe_pass_end: NULL argument");
  if (!m->in_pass) return tdm_set_error(TDM_ESTATE, 0, "tdm_moe_pass_end: no pass underway");
  return pass_finish(m, rc, st);
}
