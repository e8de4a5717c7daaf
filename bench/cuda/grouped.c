/* grouped.c: `bench-cuda grouped`: a decode-shaped MoE layer's routed experts computed by the
 * grouped operation (tandem/moe_ops.h experts(): one table, two kernels) against the same
 * experts through expert() one by one (five launches each), at Qwen3-30B-A3B's shapes (hidden
 * 2048, expert FFN 768, bf16 weights), top-8, for ubatches of 1, 4, 16, 256 and 1024 tokens;
 * then the grouped operation on experts in GGUF's block formats (experts_q(): Q8_0, Q4_K,
 * Q4_K_M's Q4_K with Q6_K down rows, MXFP4), for 1 and 4 tokens grouped only, and for 256 and
 * 1024 (prefill: 32 and 128 tokens an expert, as a pp512 and a pp4096 of 128 experts give;
 * the table runs as GEMMs on CUDA) against expert_q() one by one too.
 *
 * The experts come from a pool of POOL experts in one allocation (POOL x 9.4 MB, far larger
 * than the L2 cache), and every call of a batch routes to other experts, so each call reads its
 * weights from device memory, as a layer of a real model does.
 *
 * Figures per ubatch size:
 *   host us per layer      submitting the layer's experts (the grouped call, or one expert()
 *                          per routed expert)
 *   device us per layer    CALLS layers queued behind a long copy, timed by CUDA events
 *   weights GB/s           distinct experts' weight bytes / device time
 *   of copy bandwidth      that against a device-to-device copy of the pool in the same run
 *                          (which reads and writes every byte: 2 x bytes / time)
 * Checked: grouped output for a few tokens against fp64 on the host (relative error of the
 * row under 1e-3: the grouped kernels keep activations in f32), on the values
 * tdm_moe_dequant_row() gives for a block format. A block format's experts are random bytes
 * with their scales set to moderate values (a block's d, dmin or exponent), so every value is
 * finite and the layer's values stay of order one.
 */
#include "bcuda.h"

#include "measure.h"
#include <tandem/moe_ops.h>

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define HID 2048
#define FFN 768
#define TOPK 8
#define POOL 64   /* experts in device memory: 604 MB */
#define CALLS 32  /* layers per timed batch, each routed to other experts */
#define TMAX 1024 /* the largest ubatch: prefill-sized (its table runs as GEMMs on CUDA) */
#define GATE_BYTES (256 * MIB)

typedef struct gx {
  bc_ctx *c;
  int T;
  const tdm_moe_ops *ops;
  void *st;
  tdm_queue *q;
  cudaStream_t s;
  tdm_moe_wfmt fmt;       /* the experts' format ({BF16, BF16}: experts()) */
  size_t ebytes;          /* one expert's bytes in it */
  unsigned char *pool;    /* device: POOL experts */
  float *x, *out;         /* device: [TMAX x HID], [TMAX * TOPK x HID] */
  int32_t *rs;            /* device: CALLS x (rows | slots), each TMAX * TOPK */
  tdm_moe_group *groups;  /* device: CALLS x TMAX * TOPK entries */
  void *ws;
  size_t ws_bytes;
  unsigned char *gate_src, *gate_dst;
  /* host copies */
  float *hx;
  unsigned char *hw;      /* the first expert only (the check uses a call that routes to it) */
  int32_t *hrs;
  tdm_moe_group *hgroups;
  int ng[CALLS];          /* entries per call */
} gx;

static bool is_bf16(const gx *g) { return g->fmt.gu == TDM_MOE_W_BF16 && g->fmt.d == g->fmt.gu; }

/* Call i's routing: every token picks TOPK distinct experts of the pool; the tokens are grouped
 * expert by expert (the order group() gives). Call 0 routes token 0 to expert 0 first. */
static void route(gx *g, int i) {
  int T = g->T, n = T * TOPK, count[POOL] = {0}, first[POOL], idx[TMAX * TOPK];
  for (int t = 0; t < T; t++)
    for (int j = 0; j < TOPK; j++) {
      int e;
      bool dup;
      do {
        e = (i == 0 && t == 0 && j == 0) ? 0 : (int)(bc_next_seed(g->c) % POOL);
        dup = false;
        for (int jj = 0; jj < j; jj++)
          dup |= idx[t * TOPK + jj] == e;
      } while (dup);
      idx[t * TOPK + j] = e;
      count[e]++;
    }
  int32_t *rows = g->hrs + (size_t)i * 2 * TMAX * TOPK, *slots = rows + TMAX * TOPK;
  tdm_moe_group *grp = g->hgroups + (size_t)i * TMAX * TOPK;
  int at = 0, ng = 0;
  for (int e = 0; e < POOL; e++) {
    first[e] = at;
    if (count[e])
      grp[ng++] = (tdm_moe_group){.w = (int64_t)e * (int64_t)(g->ebytes / 2), .first = at,
                                  .count = count[e]};
    at += count[e];
  }
  for (int k = 0; k < n; k++) {
    int e = idx[k];
    rows[first[e]] = k / TOPK;
    slots[first[e]] = k;
    first[e]++;
  }
  g->ng[i] = ng;
}

static int grouped_call(gx *g, int i) {
  const int32_t *rows = g->rs + (size_t)i * 2 * TMAX * TOPK, *slots = rows + TMAX * TOPK;
  const tdm_moe_group *grp = g->groups + (size_t)i * TMAX * TOPK;
  if (is_bf16(g))
    return TDM_CALL(g->ops->experts(g->st, g->q, g->x, rows, slots, g->T * TOPK,
                                    (const tdm_moe_bf16 *)g->pool, grp, g->ng[i], HID, FFN,
                                    g->out, g->ws, g->ws_bytes));
  return TDM_CALL(g->ops->experts_q(g->st, g->q, g->x, rows, slots, g->T * TOPK, g->pool, g->fmt,
                                    grp, g->ng[i], HID, FFN, g->out, g->ws, g->ws_bytes));
}

static int single_calls(gx *g, int i) {
  const int32_t *rows = g->rs + (size_t)i * 2 * TMAX * TOPK, *slots = rows + TMAX * TOPK;
  const tdm_moe_group *grp = g->hgroups + (size_t)i * TMAX * TOPK;
  for (int k = 0; k < g->ng[i]; k++) {
    const int32_t *r = rows + grp[k].first, *s = slots + grp[k].first;
    int rc = is_bf16(g) ? TDM_CALL(g->ops->expert(g->st, g->q, g->x, r, s, grp[k].count,
                                                  (const tdm_moe_bf16 *)g->pool + grp[k].w,
                                                  HID, FFN, g->out, g->ws, g->ws_bytes))
                        : TDM_CALL(g->ops->expert_q(g->st, g->q, g->x, r, s, grp[k].count,
                                                    g->pool + 2 * grp[k].w, g->fmt, HID, FFN,
                                                    g->out, g->ws, g->ws_bytes));
    if (rc < 0)
      return -1;
  }
  return 0;
}

/* CALLS layers: host seconds to submit them, and (device) CUDA-event seconds when the batch
 * was queued behind a long copy so that the device never waits for the host. */
static int batch(gx *g, bool grouped, bool timed_device, double *host_s, double *dev_s) {
  int rc = -1;
  cudaEvent_t a = NULL, b = NULL;
  if (timed_device) {
    CK_CUDA(cudaEventCreate(&a));
    CK_CUDA(cudaEventCreate(&b));
    CK_TDM(tdm_memcpy(g->q, g->gate_dst, g->gate_src, GATE_BYTES, TDM_COPY_H2D, 0, NULL, NULL));
    CK_CUDA(cudaEventRecord(a, g->s));
  }
  double t0 = bu_seconds();
  for (int i = 0; i < CALLS; i++)
    if ((grouped ? grouped_call(g, i) : single_calls(g, i)) < 0)
      goto out;
  *host_s = bu_seconds() - t0;
  if (timed_device)
    CK_CUDA(cudaEventRecord(b, g->s));
  CK_TDM(tdm_queue_sync(g->q));
  if (timed_device) {
    float ms;
    CK_CUDA(cudaEventElapsedTime(&ms, a, b));
    *dev_s = ms * 1e-3;
  }
  rc = 0;
out:
  if (a)
    CUDA_CALL(cudaEventDestroy(a));
  if (b)
    CUDA_CALL(cudaEventDestroy(b));
  return rc;
}

/* Medians over reps: host and device microseconds per layer. */
static int measure(gx *g, bool grouped, double *host_us, double *dev_us) {
  long reps = g->c->opt->reps;
  double *h = calloc((size_t)reps, sizeof *h), *d = calloc((size_t)reps, sizeof *d), x, y;
  int rc = -1;
  CK(h && d, "out of host memory");
  if (batch(g, grouped, false, &x, &y) < 0)
    goto out;
  for (long r = 0; r < reps; r++)
    if (batch(g, grouped, false, &h[r], &y) < 0 || batch(g, grouped, true, &x, &d[r]) < 0)
      goto out;
  *host_us = bu_median(h, (size_t)reps) / CALLS * 1e6;
  *dev_us = bu_median(d, (size_t)reps) / CALLS * 1e6;
  rc = 0;
out:
  free(h);
  free(d);
  return rc;
}

/* Device-to-device copy bandwidth over the pool (reads and writes every byte), GB/s. */
static int copy_bandwidth(gx *g, double *gbs) {
  int rc = -1;
  size_t bytes = (size_t)POOL / 2 * g->ebytes;
  const char *src = bc_native(g->pool);
  cudaEvent_t a = NULL, b = NULL;
  CK(src, "no native pointer for the pool");
  CK_CUDA(cudaEventCreate(&a));
  CK_CUDA(cudaEventCreate(&b));
  double best = 0;
  for (long r = 0; r <= g->c->opt->reps; r++) {
    CK_CUDA(cudaEventRecord(a, g->s));
    CK_CUDA(cudaMemcpyAsync((void *)(src + bytes), src, bytes, cudaMemcpyDeviceToDevice, g->s));
    CK_CUDA(cudaEventRecord(b, g->s));
    CK_CUDA(cudaEventSynchronize(b));
    float ms;
    CK_CUDA(cudaEventElapsedTime(&ms, a, b));
    double v = 2.0 * bytes / (ms * 1e-3) / 1e9;
    if (r > 0 && v > best)
      best = v;
  }
  *gbs = best;
  rc = 0;
out:
  if (a)
    CUDA_CALL(cudaEventDestroy(a));
  if (b)
    CUDA_CALL(cudaEventDestroy(b));
  return rc;
}

/* Call 0's first entry is expert 0 with token 0 first: its output row against fp64. */
static int check(gx *g) {
  int rc = -1;
  float got[HID];
  double *h = malloc(FFN * sizeof *h);
  float *wf = malloc(3 * (size_t)HID * FFN * sizeof *wf); /* the first expert, widened */
  CK(h && wf, "out of host memory");
  size_t gu_rb = tdm_moe_row_bytes(g->fmt.gu, HID), d_rb = tdm_moe_row_bytes(g->fmt.d, FFN);
  for (int r = 0; r < 2 * FFN; r++)
    CK_TDM(tdm_moe_dequant_row(g->fmt.gu, g->hw + r * gu_rb, wf + (size_t)r * HID, HID));
  for (int r = 0; r < HID; r++)
    CK_TDM(tdm_moe_dequant_row(g->fmt.d, g->hw + 2 * FFN * gu_rb + r * d_rb,
                               wf + 2 * (size_t)FFN * HID + (size_t)r * FFN, FFN));
  const tdm_moe_group *grp = g->hgroups;
  CK(grp[0].w == 0 && g->hrs[0] == 0, "call 0 does not start with expert 0, token 0");
  int32_t slot = g->hrs[TMAX * TOPK];
  if (grouped_call(g, 0) < 0)
    goto out;
  CK_TDM(tdm_memcpy(g->q, got, g->out + (size_t)slot * HID, sizeof got, TDM_COPY_D2H, 0, NULL,
                    NULL));
  CK_TDM(tdm_queue_sync(g->q));
  const float *wg = wf, *wu = wg + (size_t)FFN * HID, *wd = wu + (size_t)FFN * HID;
  for (int i = 0; i < FFN; i++) {
    double a = 0, b = 0;
    for (int c = 0; c < HID; c++) {
      a += (double)g->hx[c] * wg[(size_t)i * HID + c];
      b += (double)g->hx[c] * wu[(size_t)i * HID + c];
    }
    h[i] = a / (1.0 + exp(-a)) * b;
  }
  double num = 0, den = 0;
  for (int c = 0; c < HID; c++) {
    double s = 0;
    for (int i = 0; i < FFN; i++)
      s += h[i] * wd[(size_t)c * FFN + i];
    num += (got[c] - s) * (got[c] - s);
    den += s * s;
  }
  double rel = sqrt(num / (den > 0 ? den : 1));
  /* f32 activations in the decode kernels; bf16 (as expert()'s) where the table runs GEMMs,
   * where a random Q4_K expert's block offsets (d q - m: terms that cancel) lose up to about
   * 1.2e-2 of the row (seen once in an H100 run) */
  const int gemm = g->ops->experts_gemm_rows;
  const double limit = gemm > 0 && g->T * TOPK >= gemm ? 2e-2 : 1e-3;
  CK(rel < limit && den > 0, "check failed: grouped experts {%d, %d}, T %d: relative error %.3g",
     g->fmt.gu, g->fmt.d, g->T, rel);
  rc = 0;
out:
  free(h);
  free(wf);
  return rc;
}

/* Random blocks of type t for a row of n values at p, with moderate scales (see the top). */
static void fix_blocks(int t, unsigned char *p, int n) {
  static const struct { int t, values, bytes, at; uint16_t f16; } fix[] = {
      {TDM_MOE_W_Q8_0, 32, 34, 0, 0x1400},    /* d = 2^-10 */
      {TDM_MOE_W_Q4_K, 256, 144, 0, 0x0C00},  /* d = 2^-12 (and dmin below) */
      {TDM_MOE_W_Q6_K, 256, 210, 208, 0x0400}, /* d = 2^-14 */
  };
  if (t == TDM_MOE_W_MXFP4) {
    for (int b = 0; b < n / 32; b++)
      p[17 * b] = 121; /* 2^-6 */
    return;
  }
  for (size_t i = 0; i < sizeof fix / sizeof *fix; i++) {
    if (fix[i].t != t)
      continue;
    for (int b = 0; b < n / fix[i].values; b++) {
      unsigned char *blk = p + (size_t)b * fix[i].bytes + fix[i].at;
      memcpy(blk, &fix[i].f16, 2);
      if (t == TDM_MOE_W_Q4_K)
        memcpy(blk + 2, &fix[i].f16, 2);
    }
  }
}

static void fill_expert(gx *g) {
  if (is_bf16(g)) {
    /* Weights of magnitude ~1/sqrt(K), so the layer's values stay of order one. */
    uint16_t *w = (uint16_t *)g->hw;
    size_t en = 3 * (size_t)HID * FFN;
    bc_fill_bf16(w, en, bc_next_seed(g->c));
    for (size_t i = 0; i < en; i++) {
      double s = i < 2 * (size_t)HID * FFN ? 8.0 / sqrt(HID) : 8.0 / sqrt(FFN);
      w[i] = tdm_moe_f32_to_bf16((float)(bc_bf16_to_double(w[i]) * s / 2));
    }
    return;
  }
  size_t gu_rb = tdm_moe_row_bytes(g->fmt.gu, HID), d_rb = tdm_moe_row_bytes(g->fmt.d, FFN);
  bc_fill_random(g->hw, g->ebytes, bc_next_seed(g->c));
  for (int r = 0; r < 2 * FFN; r++)
    fix_blocks(g->fmt.gu, g->hw + r * gu_rb, HID);
  for (int r = 0; r < HID; r++)
    fix_blocks(g->fmt.d, g->hw + 2 * FFN * gu_rb + r * d_rb, FFN);
}

/* Every expert of the pool holds the same random weights (hw, kept on the host for the
 * check): which expert a call reads changes where its bytes come from, not their values. */
static int setup(gx *g) {
  int rc = -1;
  bc_ctx *c = g->c;
  tdm_device *dev = c->dev;
  size_t rsn = (size_t)CALLS * 2 * TMAX * TOPK,
         gn = (size_t)CALLS * TMAX * TOPK;
  CK(g->ops = tdm_moe_ops_for(dev), "no MoE operations for %s", c->info.id);
  CK(g->ops->experts && g->ops->experts_q, "the %s table has no grouped operation", c->info.id);
  g->ebytes = tdm_moe_expert_size(g->fmt, HID, FFN);
  CK(g->ebytes % 16 == 0, "an expert of format {%d, %d} is %zu bytes", g->fmt.gu, g->fmt.d,
     g->ebytes);
  CK_TDM(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &g->q));
  CK_TDM(g->ops->open(g->q, &g->st));
  void *native;
  CK_TDM(tdm_queue_native(g->q, &native));
  g->s = (cudaStream_t)native;
  g->ws_bytes = tdm_moe_ops_workspace(TMAX * TOPK, HID, FFN);
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, POOL * g->ebytes, (void **)&g->pool));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, TMAX * HID * sizeof(float), (void **)&g->x));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, TMAX * TOPK * HID * sizeof(float), (void **)&g->out));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, rsn * sizeof(int32_t), (void **)&g->rs));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, gn * sizeof(tdm_moe_group), (void **)&g->groups));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, g->ws_bytes, &g->ws));
  CK_TDM(tdm_malloc(dev, TDM_MEM_PINNED, GATE_BYTES, (void **)&g->gate_src));
  CK_TDM(tdm_malloc(dev, TDM_MEM_DEVICE, GATE_BYTES, (void **)&g->gate_dst));
  bc_fill_random(g->gate_src, GATE_BYTES, bc_next_seed(c));
  g->hx = malloc(TMAX * HID * sizeof *g->hx);
  g->hw = malloc(g->ebytes);
  g->hrs = calloc(rsn, sizeof *g->hrs);
  g->hgroups = calloc(gn, sizeof *g->hgroups);
  CK(g->hx && g->hw && g->hrs && g->hgroups, "out of host memory");
  for (size_t i = 0; i < (size_t)TMAX * HID; i++)
    g->hx[i] = (float)((double)(bc_next_seed(c) >> 11) * 0x1.0p-52 - 1.0);
  fill_expert(g);
  for (int e = 0; e < POOL; e++)
    if (bc_upload(g->c, g->q, g->pool + (size_t)e * g->ebytes, g->hw, g->ebytes) < 0)
      goto out;
  for (int i = 0; i < CALLS; i++)
    route(g, i);
  if (bc_upload(g->c, g->q, g->x, g->hx, TMAX * HID * sizeof *g->hx) < 0 ||
      bc_upload(g->c, g->q, g->rs, g->hrs, rsn * sizeof *g->hrs) < 0 ||
      bc_upload(g->c, g->q, g->groups, g->hgroups, gn * sizeof *g->hgroups) < 0)
    goto out;
  rc = 0;
out:
  return rc;
}

static void teardown(gx *g) {
  if (g->st)
    g->ops->close(g->st);
  void *mem[] = {g->pool, g->x, g->out, g->rs, g->groups, g->ws, g->gate_src, g->gate_dst};
  for (size_t i = 0; i < sizeof mem / sizeof *mem; i++)
    if (mem[i])
      TDM_CALL(tdm_free(mem[i]));
  if (g->q)
    TDM_CALL(tdm_queue_destroy(g->q));
  free(g->hx);
  free(g->hw);
  free(g->hrs);
  free(g->hgroups);
}

static const char *fmt_name(tdm_moe_wfmt f) {
  static const struct { int gu, d; const char *name; } names[] = {
      {TDM_MOE_W_BF16, TDM_MOE_W_BF16, "bf16"}, {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0, "q8_0"},
      {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K, "q4_k"}, {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K, "q4_k+q6_k"},
      {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4, "mxfp4"}};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++)
    if (names[i].gu == f.gu && names[i].d == f.d)
      return names[i].name;
  return "?";
}

/* One ubatch size in one format: grouped, and (bf16 only) one by one. */
static int run_T(bc_ctx *c, tdm_moe_wfmt fmt, int T, double copy_gbs, bu_json *json) {
  gx g = {.c = c, .T = T, .fmt = fmt};
  double gh, gd, sh = 0, sd = 0;
  int rc = -1;
  bool single = is_bf16(&g) || T > 16;
  if (setup(&g) < 0 || check(&g) < 0 || measure(&g, true, &gh, &gd) < 0 ||
      (single && measure(&g, false, &sh, &sd) < 0))
    goto out;
  long experts = 0;
  for (int i = 0; i < CALLS; i++)
    experts += g.ng[i];
  double per_layer = (double)experts / CALLS;
  double bytes = per_layer * g.ebytes;
  double g_gbs = bytes / (gd * 1e-6) / 1e9, s_gbs = single ? bytes / (sd * 1e-6) / 1e9 : 0;
  printf("  %-9s %2d tokens (%.1f experts a layer): grouped %7.1f us host %7.1f us device "
         "(%6.0f GB/s, %.2f of copy)", fmt_name(fmt), T, per_layer, gh, gd, g_gbs,
         g_gbs / copy_gbs);
  if (single)
    printf("; one by one %7.1f us host %7.1f us device (%6.0f GB/s)", sh, sd, s_gbs);
  printf("\n");
  bu_json_object(json, NULL);
  bu_json_string(json, "format", fmt_name(fmt));
  bu_json_int(json, "tokens", T);
  bu_json_double(json, "experts_per_layer", per_layer, 2);
  bu_json_double(json, "expert_bytes", (double)g.ebytes, 0);
  bu_json_double(json, "grouped_host_us", gh, 3);
  bu_json_double(json, "grouped_device_us", gd, 3);
  bu_json_double(json, "grouped_weights_gbs", g_gbs, 1);
  bu_json_double(json, "grouped_of_copy_bandwidth", g_gbs / copy_gbs, 3);
  if (single) {
    bu_json_double(json, "single_host_us", sh, 3);
    bu_json_double(json, "single_device_us", sd, 3);
    bu_json_double(json, "single_weights_gbs", s_gbs, 1);
    bu_json_double(json, "host_ratio_single_over_grouped", sh / gh, 3);
    bu_json_double(json, "device_ratio_single_over_grouped", sd / gd, 3);
  }
  bu_json_end(json);
  fflush(stdout);
  rc = 0;
out:
  teardown(&g);
  return rc;
}

int bench_grouped(bc_ctx *c, bu_json *json) {
  static const struct { tdm_moe_wfmt fmt; int Ts[5]; } runs[] = {
      {{TDM_MOE_W_BF16, TDM_MOE_W_BF16}, {1, 4, 16, 256, TMAX}},
      {{TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0}, {1, 4, 256, TMAX, 0}},
      {{TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K}, {1, 4, 256, TMAX, 0}},
      {{TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}, {1, 4, 256, TMAX, 0}},
      {{TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4}, {1, 4, 0}},
  };
  int rc = -1;
  double copy_gbs = 0;
  printf("\ngrouped: a layer's routed experts (hidden %d, FFN %d, top-%d; bf16, then "
         "block formats), grouped against one by one (bf16, and block formats from 256 "
         "tokens), median of %ld reps x %d layers\n",
         HID, FFN, TOPK, c->opt->reps, CALLS);
  {
    gx g = {.c = c, .T = 1, .fmt = {TDM_MOE_W_BF16, TDM_MOE_W_BF16}};
    int ok = setup(&g) == 0 && copy_bandwidth(&g, &copy_gbs) == 0;
    teardown(&g);
    if (!ok)
      return -1;
  }
  printf("  device-to-device copy: %.0f GB/s (reads + writes)\n", copy_gbs);
  bu_json_object(json, NULL);
  bu_json_int(json, "hidden", HID);
  bu_json_int(json, "ffn", FFN);
  bu_json_int(json, "topk", TOPK);
  bu_json_int(json, "pool_experts", POOL);
  bu_json_int(json, "layers_per_batch", CALLS);
  bu_json_int(json, "reps", c->opt->reps);
  bu_json_double(json, "copy_gbs", copy_gbs, 1);
  bu_json_array(json, "results");
  for (size_t r = 0; r < sizeof runs / sizeof *runs; r++)
    for (int i = 0; i < 5 && runs[r].Ts[i]; i++)
      if (run_T(c, runs[r].fmt, runs[r].Ts[i], copy_gbs, json) < 0)
        goto out;
  rc = 0;
out:
  bu_json_end(json);
  bu_json_end(json);
  return rc;
}
