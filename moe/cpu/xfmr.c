/* cpu/xfmr.c: a transformer's operations besides the MoE layers for the CPU backend (the
 * get_rows, matmul, rope and attention entries of tdm_moe__cpu_ops; get_rows_h and matmul_h for
 * 16-bit weights and matmul_q for block types: a few tokens' rows dotted directly on the pool,
 * more widened a piece at a time for sgemm; attn_prep_at and attention_at, which read the
 * position when the task runs): host tasks on the queue's worker, as cpu/ops.c's are. The
 * projections are OpenBLAS sgemm; attention splits its
 * (token, head) pairs between the pool's threads (cpu/pool.h), each pair computed whole by one
 * thread in a fixed order, so the bits do not depend on the split. */
#include "ops.h" /* moe/ops.h */
#include "pool.h"
#include "task.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#undef I /* <complex.h>'s, as in cpu/ops.c */

/* ---- get_rows ---------------------------------------------------------------------------- */

typedef struct rows_args {
  task t; /* first */
  float *y;
  const float *table;
  const int32_t *ids;
  int T, H, V;
} rows_args;

static int rows_body(const task *t) {
  const rows_args *a = (const rows_args *)t;
  size_t row = (size_t)a->H * sizeof(float);
  for (int i = 0; i < a->T; i++) {
    int32_t id = a->ids[i];
    float *y = a->y + (size_t)i * a->H;
    if (id >= 0 && id < a->V)
      memcpy(y, a->table + (size_t)id * a->H, row);
    else
      memset(y, 0, row);
  }
  return 0;
}

int tdm_moe__cpu_get_rows(void *st, tdm_queue *q, float *y, const float *table,
                          const int32_t *ids, int T, int H, int V) {
  int rc = tdm_moe__check_state(st, q, "get_rows");
  if (rc) return rc;
  if (!y || !table || !ids || T < 0 || H <= 0 || V <= 0) return tdm_moe__bad_args("get_rows");
  if (T == 0) return 0;
  rows_args *a = tdm_moe__task_alloc(sizeof *a, "get_rows");
  if (!a) return TDM_ENOMEM;
  *a = (rows_args){.t.body = rows_body, .y = y, .table = table, .ids = ids, .T = T, .H = H,
                   .V = V};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- matmul ------------------------------------------------------------------------------ */

typedef struct matmul_args {
  task t; /* first */
  float *y;
  const float *x, *w;
  int T, K, N;
  float beta;
} matmul_args;

static int matmul_body(const task *t) {
  const matmul_args *a = (const matmul_args *)t;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->T, a->N, a->K, 1.0f, a->x, a->K, a->w,
              a->K, a->beta, a->y, a->N);
  return 0;
}

int tdm_moe__cpu_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                        int K, int N, float beta) {
  int rc = tdm_moe__check_state(st, q, "matmul");
  if (rc) return rc;
  if (!y || !x || !w || T < 0 || K <= 0 || N <= 0 || (beta != 0.0f && beta != 1.0f))
    return tdm_moe__bad_args("matmul");
  if (T == 0) return 0;
  matmul_args *a = tdm_moe__task_alloc(sizeof *a, "matmul");
  if (!a) return TDM_ENOMEM;
  *a = (matmul_args){.t.body = matmul_body, .y = y, .x = x, .w = w, .T = T, .K = K, .N = N,
                     .beta = beta};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- 16-bit weights: get_rows_h, matmul_h ------------------------------------------------ */

static int bad_wtype(int wtype) { return wtype != TDM_MOE_W_F16 && wtype != TDM_MOE_W_BF16; }

typedef struct rows_h_args {
  task t; /* first */
  float *y;
  const uint16_t *table;
  const int32_t *ids;
  int wtype, T, H, V;
} rows_h_args;

static int rows_h_body(const task *t) {
  const rows_h_args *a = (const rows_h_args *)t;
  for (int i = 0; i < a->T; i++) {
    int32_t id = a->ids[i];
    float *y = a->y + (size_t)i * a->H;
    if (id >= 0 && id < a->V)
      tdm_moe__cpu_widen16(y, a->table + (size_t)id * a->H, (size_t)a->H, a->wtype);
    else
      memset(y, 0, (size_t)a->H * sizeof *y);
  }
  return 0;
}

int tdm_moe__cpu_get_rows_h(void *st, tdm_queue *q, float *y, const uint16_t *table, int wtype,
                            const int32_t *ids, int T, int H, int V) {
  int rc = tdm_moe__check_state(st, q, "get_rows_h");
  if (rc) return rc;
  if (!y || !table || !ids || T < 0 || H <= 0 || V <= 0 || bad_wtype(wtype))
    return tdm_moe__bad_args("get_rows_h");
  if (T == 0) return 0;
  rows_h_args *a = tdm_moe__task_alloc(sizeof *a, "get_rows_h");
  if (!a) return TDM_ENOMEM;
  *a = (rows_h_args){.t.body = rows_h_body, .y = y, .table = table, .ids = ids, .wtype = wtype,
                     .T = T, .H = H, .V = V};
  return tdm_moe__task_submit(q, &a->t);
}

typedef struct matmul_w_args {
  task t; /* first */
  float *y;
  const float *x;
  const uint8_t *w;
  float *ws;
  size_t ws_floats;
  int wtype, T, K, N;
  float beta;
} matmul_w_args;

/* Few tokens: each weight row read once and dotted with all of them (cpu/ops.c). More: pieces
 * of w's rows widened into the workspace, each an sgemm into y's columns of them. */
enum { GEMVW_MAX_T = 8 };

static int matmul_w_body(const task *t) {
  const matmul_w_args *a = (const matmul_w_args *)t;
  if (a->T <= GEMVW_MAX_T)
    return tdm_moe__cpu_gemvw(a->y, a->x, a->w, a->wtype, (size_t)a->T, (size_t)a->K,
                              (size_t)a->N, a->beta != 0.0f);
  size_t K = (size_t)a->K, N = (size_t)a->N, R = a->ws_floats / K;
  size_t rb = (size_t)tdm_moe_row_bytes(a->wtype, a->K);
  if (R > N) R = N;
  for (size_t n0 = 0; n0 < N; n0 += R) {
    size_t c = N - n0 < R ? N - n0 : R;
    if (a->wtype == TDM_MOE_W_F16 || a->wtype == TDM_MOE_W_BF16)
      tdm_moe__cpu_widen16(a->ws, (const uint16_t *)(const void *)(a->w + n0 * rb), c * K,
                           a->wtype);
    else
      for (size_t r = 0; r < c; r++)
        tdm_moe_dequant_row(a->wtype, a->w + (n0 + r) * rb, a->ws + r * K, a->K);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->T, (int)c, a->K, 1.0f, a->x, a->K,
                a->ws, a->K, a->beta, a->y + n0, a->N);
  }
  return 0;
}

static int matmul_w(void *st, tdm_queue *q, float *y, const float *x, const void *w, int wtype,
                    int T, int K, int N, float beta, void *ws, size_t ws_bytes,
                    const char *op) {
  int rc = tdm_moe__check_state(st, q, op);
  if (rc) return rc;
  if (!y || !x || !w || T < 0 || K <= 0 || N <= 0 || (beta != 0.0f && beta != 1.0f) ||
      !tdm_moe_row_bytes(wtype, K) || !ws || ws_bytes / sizeof(float) < (size_t)K)
    return tdm_moe__bad_args(op);
  if (T == 0) return 0;
  matmul_w_args *a = tdm_moe__task_alloc(sizeof *a, op);
  if (!a) return TDM_ENOMEM;
  *a = (matmul_w_args){.t.body = matmul_w_body, .y = y, .x = x, .w = w, .ws = ws,
                       .ws_floats = ws_bytes / sizeof(float), .wtype = wtype, .T = T, .K = K,
                       .N = N, .beta = beta};
  return tdm_moe__task_submit(q, &a->t);
}

int tdm_moe__cpu_matmul_h(void *st, tdm_queue *q, float *y, const float *x, const uint16_t *w,
                          int wtype, int T, int K, int N, float beta, void *ws,
                          size_t ws_bytes) {
  if (bad_wtype(wtype)) return tdm_moe__bad_args("matmul_h");
  return matmul_w(st, q, y, x, w, wtype, T, K, N, beta, ws, ws_bytes, "matmul_h");
}

int tdm_moe__cpu_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w,
                          int wtype, int T, int K, int N, float beta, void *ws,
                          size_t ws_bytes) {
  if (wtype < TDM_MOE_W_Q8_0 || wtype > TDM_MOE_W_Q5_K)
    return tdm_set_error(TDM_EINVAL, 0, "moe matmul_q: weight type %d is not a block type",
                         wtype);
  return matmul_w(st, q, y, x, w, wtype, T, K, N, beta, ws, ws_bytes, "matmul_q");
}

/* ---- rope -------------------------------------------------------------------------------- */

/* attn_prep_at and attention_at: *pos as the queue reaches the op, clamped to [0, ctx - T];
 * pos0 itself for rope and attention (pos NULL). */
static int pos_at(const int32_t *pos, int pos0, int ctx, int T) {
  if (!pos) return pos0;
  int p = *pos;
  return p < 0 ? 0 : p > ctx - T ? ctx - T : p;
}

/* One token's nheads heads of hd values at x, rotated for position p. */
static void rope_token(float *x, int nheads, int hd, int p, float base, float freq_scale,
                       int neox) {
  int half = hd / 2;
  double pf = (double)p * freq_scale;
  for (int i = 0; i < half; i++) {
    /* the angle in double: at long positions a float angle loses the low bits */
    double th = pf * pow((double)base, -2.0 * i / hd);
    float c = (float)cos(th), s = (float)sin(th);
    for (int h = 0; h < nheads; h++) {
      float *v = x + (size_t)h * hd;
      int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      float x0 = v[i0], x1 = v[i1];
      v[i0] = x0 * c - x1 * s;
      v[i1] = x0 * s + x1 * c;
    }
  }
}

typedef struct rope_args {
  task t; /* first */
  float *x;
  int T, nh, hd, pos0, neox;
  float base, freq_scale;
} rope_args;

static int rope_body(const task *t) {
  const rope_args *a = (const rope_args *)t;
  for (int r = 0; r < a->T; r++)
    rope_token(a->x + (size_t)r * a->nh * a->hd, a->nh, a->hd, a->pos0 + r, a->base,
               a->freq_scale, a->neox);
  return 0;
}

int tdm_moe__cpu_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0,
                      float base, float freq_scale, int neox) {
  int rc = tdm_moe__check_state(st, q, "rope");
  if (rc) return rc;
  if (!x || T < 0 || nh <= 0 || hd <= 0 || hd % 2 || pos0 < 0 || !(base > 0.0f) ||
      !(freq_scale > 0.0f))
    return tdm_moe__bad_args("rope");
  if (T == 0) return 0;
  rope_args *a = tdm_moe__task_alloc(sizeof *a, "rope");
  if (!a) return TDM_ENOMEM;
  *a = (rope_args){.t.body = rope_body, .x = x, .T = T, .nh = nh, .hd = hd, .pos0 = pos0,
                   .neox = neox != 0, .base = base, .freq_scale = freq_scale};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- attn_prep_at ------------------------------------------------------------------------ */

typedef struct prep_args {
  task t; /* first */
  float *qv, *kc, *vc;
  const float *k, *v, *qn, *kn;
  const int32_t *pos;
  int T, nh, nkv, hd, ctx, neox;
  float eps, base, freq_scale;
} prep_args;

static int prep_body(const task *t) {
  const prep_args *a = (const prep_args *)t;
  int pos0 = pos_at(a->pos, 0, a->ctx, a->T), hd = a->hd;
  size_t kvd = (size_t)a->nkv * hd;
  for (int r = 0; r < a->T; r++) {
    float *q = a->qv + (size_t)r * a->nh * hd, *kr = a->kc + (size_t)(pos0 + r) * kvd;
    memcpy(kr, a->k + (size_t)r * kvd, kvd * sizeof(float));
    memcpy(a->vc + (size_t)(pos0 + r) * kvd, a->v + (size_t)r * kvd, kvd * sizeof(float));
    for (int h = 0; a->qn && h < a->nh; h++)
      tdm_moe__cpu_rmsnorm_row(q + (size_t)h * hd, q + (size_t)h * hd, a->qn, hd, a->eps);
    for (int h = 0; a->kn && h < a->nkv; h++)
      tdm_moe__cpu_rmsnorm_row(kr + (size_t)h * hd, kr + (size_t)h * hd, a->kn, hd, a->eps);
    rope_token(q, a->nh, hd, pos0 + r, a->base, a->freq_scale, a->neox);
    rope_token(kr, a->nkv, hd, pos0 + r, a->base, a->freq_scale, a->neox);
  }
  return 0;
}

int tdm_moe__cpu_attn_prep_at(void *st, tdm_queue *q, float *qv, const float *k, const float *v,
                              float *kc, float *vc, const float *qn, const float *kn, int T,
                              int nh, int nkv, int hd, float eps, const int32_t *pos, int ctx,
                              float base, float freq_scale, int neox) {
  int rc = tdm_moe__check_state(st, q, "attn_prep_at");
  if (rc) return rc;
  if (!qv || !k || !v || !kc || !vc || !pos || T < 1 || T > ctx || nh <= 0 || nkv <= 0 ||
      hd <= 0 || hd % 2 || !(eps >= 0.0f) || !(base > 0.0f) || !(freq_scale > 0.0f))
    return tdm_moe__bad_args("attn_prep_at");
  prep_args *a = tdm_moe__task_alloc(sizeof *a, "attn_prep_at");
  if (!a) return TDM_ENOMEM;
  *a = (prep_args){.t.body = prep_body, .qv = qv, .kc = kc, .vc = vc, .k = k, .v = v, .qn = qn,
                   .kn = kn, .pos = pos, .T = T, .nh = nh, .nkv = nkv, .hd = hd, .ctx = ctx,
                   .neox = neox != 0, .eps = eps, .base = base, .freq_scale = freq_scale};
  return tdm_moe__task_submit(q, &a->t);
}

/* ---- attention --------------------------------------------------------------------------- */

typedef struct attn_args {
  task t; /* first */
  float *out;
  const float *qv, *kc, *vc;
  const int32_t *pos; /* attention_at: the position on the device (NULL: pos0) */
  int T, pos0, ctx, nh, nkv, hd;
  float scale;
  float *scores; /* pool_workers() x (pos0 + T), while the task runs */
} attn_args;

/* One (token, head) pair: scores over positions 0 .. pos0 + t, softmax, the weighted values. */
static void attn_pair(void *arg, size_t chunk, int worker) {
  const attn_args *a = arg;
  int t = (int)(chunk / (size_t)a->nh), h = (int)(chunk % (size_t)a->nh);
  int n = a->pos0 + t + 1, g = h / (a->nh / a->nkv), hd = a->hd;
  size_t kvrow = (size_t)a->nkv * hd;
  const float *qr = a->qv + ((size_t)t * a->nh + h) * hd;
  float *s = a->scores + (size_t)worker * (size_t)(a->pos0 + a->T), mx = -INFINITY;
  for (int p = 0; p < n; p++) {
    const float *k = a->kc + (size_t)p * kvrow + (size_t)g * hd;
    float d = 0.0f;
    for (int i = 0; i < hd; i++) d += qr[i] * k[i];
    s[p] = d * a->scale;
    if (s[p] > mx) mx = s[p];
  }
  double sum = 0.0;
  for (int p = 0; p < n; p++) {
    s[p] = expf(s[p] - mx);
    sum += s[p];
  }
  float inv = (float)(1.0 / sum), *o = a->out + ((size_t)t * a->nh + h) * hd;
  for (int i = 0; i < hd; i++) o[i] = 0.0f;
  for (int p = 0; p < n; p++) {
    const float *v = a->vc + (size_t)p * kvrow + (size_t)g * hd;
    float w = s[p] * inv;
    for (int i = 0; i < hd; i++) o[i] += w * v[i];
  }
}

static int attn_body(const task *t) {
  attn_args *a = (attn_args *)t;
  a->pos0 = pos_at(a->pos, a->pos0, a->ctx, a->T);
  size_t per = (size_t)a->pos0 + (size_t)a->T;
  a->scores = malloc((size_t)pool_workers() * per * sizeof(float));
  if (!a->scores)
    return tdm_set_error(TDM_ENOMEM, 0, "moe attention: no host memory for the scores");
  pool_run((size_t)a->T * (size_t)a->nh, attn_pair, a);
  free(a->scores);
  a->scores = NULL;
  return 0;
}

static int attn_submit(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                       const float *vc, int T, int pos0, const int32_t *pos, int ctx, int nh,
                       int nkv, int hd, float scale, const char *op) {
  int rc = tdm_moe__check_state(st, q, op);
  if (rc) return rc;
  if (!out || !qv || !kc || !vc || T < 0 || pos0 < 0 || nh <= 0 || nkv <= 0 || nh % nkv ||
      hd <= 0 || !(scale > 0.0f) || (int64_t)pos0 + T > INT32_MAX ||
      (pos && (T < 1 || T > ctx)))
    return tdm_moe__bad_args(op);
  if (T == 0) return 0;
  attn_args *a = tdm_moe__task_alloc(sizeof *a, op);
  if (!a) return TDM_ENOMEM;
  *a = (attn_args){.t.body = attn_body, .out = out, .qv = qv, .kc = kc, .vc = vc, .pos = pos,
                   .T = T, .pos0 = pos0, .ctx = ctx, .nh = nh, .nkv = nkv, .hd = hd,
                   .scale = scale};
  return tdm_moe__task_submit(q, &a->t);
}

int tdm_moe__cpu_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                           const float *vc, int T, int pos0, int nh, int nkv, int hd,
                           float scale) {
  return attn_submit(st, q, out, qv, kc, vc, T, pos0, NULL, 0, nh, nkv, hd, scale, "attention");
}

int tdm_moe__cpu_attention_at(void *st, tdm_queue *q, float *out, const float *qv,
                              const float *kc, const float *vc, int T, const int32_t *pos,
                              int ctx, int nh, int nkv, int hd, float scale) {
  if (!pos) return tdm_moe__bad_args("attention_at");
  return attn_submit(st, q, out, qv, kc, vc, T, 0, pos, ctx, nh, nkv, hd, scale,
                     "attention_at");
}
