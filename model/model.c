/* model.c: a whole model (tandem/model.h): the file opened and checked, the dense weights
 * converted to f32 on the device, the experts handed to the MoE layers (tandem/moe.h) as a
 * weight source, which puts them in pinned host memory for the streamer; then the forward
 * pass, ubatch by ubatch, on the MoE model's compute queue: embedding, and per layer the
 * attention (RMSNorm, q/k/v projections, Qwen3's per-head norms, RoPE, the keys and values
 * written straight into the cache, causal attention, the output projection added to the
 * residual), then the layer's MoE block from tdm_moe_pass_layer(); the final norm and the LM
 * head last. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arch.h"
#include "tandem/model.h"

/* Dense weights cross to the device through a pinned buffer of this size, a piece at a time. */
#define STAGE_BYTES ((size_t)32 << 20)
/* The most device memory 16-bit weights are widened into for a prefill's projections (the
 * workspace holds a ubatch's x twice besides: a backend may split it for its GEMMs). */
#define WIDEN_BYTES ((size_t)64 << 20)

/* A dense weight on the device: f32, or in 16 bits as the file keeps it (wtype
 * TDM_MOE_W_F16 or TDM_MOE_W_BF16) where the backend's table has the 16-bit operations. */
typedef struct dweight {
  void *p;
  int wtype; /* 0: f32 */
} dweight;

typedef struct layer_w {
  float *attn_norm, *qn, *kn;
  dweight wq, wk, wv, wo;
  dweight wqkv; /* wq, wk and wv in one allocation, where they share a type (upload_qkv) */
  float *kc, *vc; /* the KV cache: [ctx x nkv*hd] each */
} layer_w;

struct tdm_model {
  tdm_model_config cfg;
  mfile f;
  hparams hp;
  char format[16];
  const char *wtype;
  tdm_moe_wfmt *efmt;            /* [L]: the experts' formats as the file keeps them; NULL:
                                    widened to bf16 */
  char etype[32];                /* tdm_model_info's expert_type */
  char dtype[16];                /* and its dense_type */
  int ctx, U, pos;
  bool skip_moe;                 /* tdm_model_skip_moe */
  size_t device_bytes;
  const tdm_moe_ops *ops;
  void *ops_state;               /* the MoE model's (tdm_moe_model_ops): one state records both */
  tdm_moe_model *moe;
  tdm_queue *q;
  dweight embd, output;
  float *out_norm;
  layer_w *lw;
  void *widen;                   /* matmul_h's workspace (NULL when every weight is f32) */
  size_t widen_bytes, widen_need; /* its size; the largest 16-bit weight's f32 bytes */
  bool dense16;                  /* some dense weight is kept in 16 bits */
  float *xn, *qb, *att, *logits; /* per ubatch: [U x H], [U x qd] (a step: q, k, v), [U x qd],
                                    [U x V] */
  int32_t *ids;
  int32_t *ids_h;
  float *logits_h;
  /* decode steps (attention_step, step_graph): whether the table has the ops that read the
   * position on the device; the step's position and token id, on the device and pinned ([0]
   * position, [1] id); the recorded steps, with the MoE layers and without
   * (tdm_model_skip_moe) */
  bool stepper;
  int32_t *step, *step_h;
  void *graph[2];
  bool graph_off;                /* no graphs: the backend lacks them, TANDEM_MODEL_GRAPH=0, or
                                    a recording failed */
  void *stage;
  /* progress, from the threads that load the experts */
  pthread_mutex_t progress_mu;
  atomic_long experts_done;
  atomic_int progress_pct;       /* the last percentage reported (under progress_mu to change) */
  tdm_moe_preset preset;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void progress(tdm_model *m, const char *what, double done) {
  if (m->cfg.progress) m->cfg.progress(m->cfg.progress_user, what, done);
}

/* ---- the experts' format ----------------------------------------------------------------- */

/* An expert's format as the file keeps it ({gate and up type, down type}), or {0, 0} where the
 * MoE layers take it widened to bf16: F32, a type they have no kernels for, gate and up of
 * different types, rows that are not whole blocks; and F16, which is bf16's size on the link,
 * so that it runs on the bf16 kernels, the tuned ones (rounded to bf16 at load). */
static tdm_moe_wfmt file_fmt(const hparams *hp, const expert_part parts[3]) {
  int g = tdm_mf_moe_wtype(parts[0].t->type), u = tdm_mf_moe_wtype(parts[1].t->type);
  tdm_moe_wfmt f = {g, tdm_mf_moe_wtype(parts[2].t->type)};
  if (f.gu == TDM_MOE_W_F16 || f.d == TDM_MOE_W_F16) return (tdm_moe_wfmt){0, 0};
  return g && g == u && tdm_moe_expert_size(f, hp->H, hp->I) ? f : (tdm_moe_wfmt){0, 0};
}

/* Each layer's expert format into *out (L entries, malloc'd; NULL: every expert is widened to
 * bf16): the file's, where `native` (the device's table computes experts in their format, and
 * the configuration does not ask for bf16) and every layer has one; else bf16. name (cap
 * bytes) gets tdm_model_info's expert_type. */
static int choose_formats(const mfile *f, const hparams *hp, bool native, tdm_moe_wfmt **out,
                          char *name, size_t cap) {
  *out = NULL;
  snprintf(name, cap, "BF16");
  if (!native || hp->L <= 0) return 0;
  tdm_moe_wfmt *fm = malloc((size_t)hp->L * sizeof *fm);
  if (!fm) return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  bool mixed = false;
  for (int l = 0; l < hp->L; l++) {
    expert_part parts[3];
    int rc = arch_expert(f, hp, l, 0, parts);
    if (rc) {
      free(fm);
      return rc;
    }
    fm[l] = file_fmt(hp, parts);
    if (!fm[l].gu) {
      free(fm);
      return 0;
    }
    mixed |= fm[l].gu != fm[0].gu || fm[l].d != fm[0].d;
  }
  static const char *const names[] = {"?", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "MXFP4"};
  snprintf(name, cap, "%s%s%s%s", names[fm[0].gu], fm[0].d != fm[0].gu ? "+" : "",
           fm[0].d != fm[0].gu ? names[fm[0].d] : "", mixed ? "+..." : "");
  *out = fm;
  return 0;
}

/* The bytes one expert takes in host memory and on the link: the largest layer's. */
static size_t expert_stride(const hparams *hp, const tdm_moe_wfmt *fm) {
  size_t eb = (size_t)3 * hp->H * hp->I * sizeof(tdm_moe_bf16);
  if (!fm) return eb;
  tdm_moe_preset p = {.hidden = hp->H, .ffn = hp->I};
  size_t most = 0;
  for (int l = 0; l < hp->L; l++) {
    size_t b = tdm_moe_expert_stride(&p, fm[l]);
    if (b > most) most = b;
  }
  return most;
}

/* ---- the MoE layers' weight source ------------------------------------------------------- */

/* Expert e of layer l copied as the file keeps it (format fm) to dst. */
static int copy_expert(tdm_model *m, int l, int e, const expert_part parts[3], tdm_moe_wfmt fm,
                       uint8_t *dst) {
  const hparams *hp = &m->hp;
  for (int p = 0; p < 3; p++) {
    const tdm_mf_tensor *t = parts[p].t;
    int wt = p < 2 ? fm.gu : fm.d, block, bytes;
    if (tdm_mf_moe_wtype(t->type) != wt || tdm_mf_type_block(t->type, &block, &bytes) != 0)
      return tdm_set_error(TDM_EINVAL, 0, "%s: %s: expert %d of layer %d is %s, the layer's "
                           "first expert is not", m->f.path, t->name, e, l,
                           tdm_mf_type_name(t->type));
    size_t n = p < 2 ? tdm_moe_row_bytes(wt, hp->H) * hp->I : tdm_moe_row_bytes(wt, hp->I) * hp->H;
    size_t at = parts[p].first / (size_t)block * (size_t)bytes;
    if (at > t->bytes || n > t->bytes - at)
      return tdm_set_error(TDM_EINVAL, 0, "%s: %s: expert %d of layer %d lies past the "
                           "tensor's %zu bytes", m->f.path, t->name, e, l, t->bytes);
    memcpy(dst, (const uint8_t *)t->data + at, n);
    tdm_mf_release(t, at, n);
    dst += n;
  }
  return 0;
}

static int src_expert(void *user, int l, int e, void *dst) {
  tdm_model *m = user;
  expert_part parts[3];
  size_t hi = (size_t)m->hp.H * m->hp.I;
  int rc = arch_expert(&m->f, &m->hp, l, e, parts);
  if (!rc && m->efmt) rc = copy_expert(m, l, e, parts, m->efmt[l], dst);
  for (int p = 0; !rc && !m->efmt && p < 3; p++) {
    rc = convert_bf16(parts[p].t, parts[p].first, hi, (tdm_moe_bf16 *)dst + p * hi, m->f.path);
    if (!rc) { /* the file's copy is not kept beside the pinned one */
      int block = 1, bytes = 0;
      tdm_mf_type_block(parts[p].t->type, &block, &bytes);
      tdm_mf_release(parts[p].t, parts[p].first / (size_t)block * (size_t)bytes,
                     hi / (size_t)block * (size_t)bytes);
    }
  }
  long done = atomic_fetch_add(&m->experts_done, 1) + 1, all = (long)m->hp.L * m->hp.E;
  int pct = (int)(done * 100 / all);
  if (m->cfg.progress && pct > atomic_load(&m->progress_pct)) {
    pthread_mutex_lock(&m->progress_mu); /* one report at a time, in order */
    if (pct > atomic_load(&m->progress_pct)) {
      atomic_store(&m->progress_pct, pct);
      progress(m, "experts", (double)done / all);
    }
    pthread_mutex_unlock(&m->progress_mu);
  }
  return rc;
}

static int src_router(void *user, int l, tdm_moe_bf16 *dst) {
  tdm_model *m = user;
  const tdm_mf_tensor *t = arch_tensor(&m->f, &m->hp, T_ROUTER, l);
  return t ? convert_bf16(t, 0, (size_t)m->hp.E * m->hp.H, dst, m->f.path) : TDM_EINVAL;
}

static int src_norm(void *user, int l, float *dst) {
  tdm_model *m = user;
  const tdm_mf_tensor *t = arch_tensor(&m->f, &m->hp, T_FFN_NORM, l);
  return t ? convert_f32(t, 0, (size_t)m->hp.H, dst, m->f.path) : TDM_EINVAL;
}

/* ---- dense weights and buffers on the device --------------------------------------------- */

static int dev_alloc(tdm_model *m, size_t bytes, void *out) {
  int rc = tdm_malloc(m->cfg.device, TDM_MEM_DEVICE, bytes ? bytes : 1, (void **)out);
  if (!rc) m->device_bytes += bytes;
  return rc;
}

/* A projection of a block type (Q8_0, Q4_K, Q6_K, MXFP4, Q5_K) to the device as the file keeps it,
 * where the table multiplies such weights (matmul_q): its type, else 0. */
static int block_kept(const tdm_model *m, tensor_role r, const tdm_mf_tensor *t) {
  int wt = tdm_mf_moe_wtype(t->type);
  if (r == T_EMBD || m->cfg.dense_f32 || !m->ops->matmul_q || wt < TDM_MOE_W_Q8_0 ||
      t->ndim != 2 || !tdm_moe_row_bytes(wt, t->shape[1]) ||
      tdm_moe_row_bytes(wt, t->shape[1]) * (size_t)t->shape[0] > t->bytes)
    return 0;
  return wt;
}

/* How a tensor goes to the device: in f32, or (keep, a projection or the embedding) as the
 * file holds it where the table reads that type: 16 bits (F16, BF16: get_rows_h and matmul_h),
 * or a projection's blocks (matmul_q); the configuration's dense_f32 asks for f32. */
typedef struct wplan {
  const tdm_mf_tensor *t; /* NULL: a role the model does not have */
  bool keep16;
  int qt;                 /* the block type kept, or 0 */
  int wtype;              /* dweight.wtype */
  size_t n, bytes;        /* values, and bytes on the device */
} wplan;

static int plan_w(tdm_model *m, tensor_role r, int l, bool keep, wplan *p) {
  *p = (wplan){0};
  if (!arch_has(&m->hp, r)) return 0;
  const tdm_mf_tensor *t = arch_tensor(&m->f, &m->hp, r, l);
  if (!t) return TDM_EINVAL;
  p->t = t;
  p->keep16 = keep && !m->cfg.dense_f32 && m->ops->matmul_h && m->ops->get_rows_h &&
              (t->type == TDM_MF_F16 || t->type == TDM_MF_BF16);
  p->qt = keep ? block_kept(m, r, t) : 0;
  p->n = (size_t)tdm_mf_elements(t);
  p->bytes = p->qt ? tdm_moe_row_bytes(p->qt, t->shape[1]) * (size_t)t->shape[0]
                   : p->n * (p->keep16 ? 2 : sizeof(float));
  p->wtype = p->qt ? p->qt : !p->keep16 ? 0 : t->type == TDM_MF_F16 ? TDM_MOE_W_F16 : TDM_MOE_W_BF16;
  if (p->keep16 && p->n > t->bytes / 2)
    return tdm_set_error(TDM_EINVAL, 0, "%s: tensor %s holds %zu bytes for %zu elements",
                         m->f.path, t->name, t->bytes, p->n);
  return 0;
}

/* The planned tensor into dst (device memory of p->bytes), through the staging buffer. */
static int fill_w(tdm_model *m, const wplan *p, void *dst) {
  const tdm_mf_tensor *t = p->t;
  bool raw = p->keep16 || p->qt; /* the file's bytes as they are */
  size_t size = p->keep16 ? 2 : p->qt ? 1 : sizeof(float), per = STAGE_BYTES / size;
  size_t count = p->qt ? p->bytes : p->n; /* in units of size */
  int rc = 0;
  for (size_t at = 0; !rc && at < count; at += per) {
    size_t c = count - at < per ? count - at : per;
    if (raw)
      memcpy(m->stage, (const uint8_t *)t->data + at * size, c * size);
    else
      rc = convert_f32(t, at, c, m->stage, m->f.path);
    if (!rc && !(rc = tdm_memcpy(m->q, (char *)dst + at * size, m->stage, c * size,
                                 TDM_COPY_H2D, 0, NULL, NULL)))
      rc = tdm_queue_sync(m->q); /* the stage is reused next */
  }
  if (!rc) tdm_mf_release(t, 0, t->bytes); /* on the device now */
  if (!rc && raw) {
    m->dense16 = true;
    if (p->n * sizeof(float) > m->widen_need) m->widen_need = p->n * sizeof(float);
  }
  return rc;
}

/* A planned tensor into an allocation of its own; a role the model does not have (p->t NULL)
 * leaves dst->p NULL. */
static int upload_planned(tdm_model *m, const wplan *p, dweight *dst) {
  *dst = (dweight){0};
  if (!p->t) return 0;
  dst->wtype = p->wtype;
  int rc = dev_alloc(m, p->bytes, &dst->p);
  return rc ? rc : fill_w(m, p, dst->p);
}

/* A tensor of role r (layer l) to the device, as plan_w says. */
static int upload_w(tdm_model *m, tensor_role r, int l, bool keep, dweight *dst) {
  wplan p;
  *dst = (dweight){0};
  int rc = plan_w(m, r, l, keep, &p);
  return rc ? rc : upload_planned(m, &p, dst);
}

/* Layer l's q, k and v projections: in one allocation, q's rows then k's then v's, where the
 * three are kept in one type (w->wqkv, which a decode step multiplies in one pass; wq, wk and wv
 * point into it), else each in its own. */
static int upload_qkv(tdm_model *m, int l, layer_w *w) {
  static const tensor_role role[3] = {T_WQ, T_WK, T_WV};
  dweight *d[3] = {&w->wq, &w->wk, &w->wv};
  wplan p[3];
  int rc = 0;
  for (int i = 0; !rc && i < 3; i++) rc = plan_w(m, role[i], l, true, &p[i]);
  if (rc) return rc;
  bool one = p[0].t && p[1].t && p[2].t && p[0].wtype == p[1].wtype &&
             p[1].wtype == p[2].wtype;
  if (!one) {
    for (int i = 0; !rc && i < 3; i++) rc = upload_planned(m, &p[i], d[i]);
    return rc;
  }
  w->wqkv.wtype = p[0].wtype;
  if ((rc = dev_alloc(m, p[0].bytes + p[1].bytes + p[2].bytes, &w->wqkv.p))) return rc;
  size_t at = 0;
  for (int i = 0; !rc && i < 3; i++) {
    *d[i] = (dweight){(char *)w->wqkv.p + at, p[i].wtype};
    rc = fill_w(m, &p[i], d[i]->p);
    at += p[i].bytes;
  }
  return rc;
}

/* A small f32 tensor (a norm's weights): always f32. */
static int upload(tdm_model *m, tensor_role r, int l, float **dst) {
  dweight d;
  int rc = upload_w(m, r, l, false, &d);
  *dst = d.p;
  return rc;
}

static int load_dense(tdm_model *m) {
  const hparams *hp = &m->hp;
  int rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, STAGE_BYTES, &m->stage);
  if (!rc) rc = upload_w(m, T_EMBD, 0, true, &m->embd);
  if (!rc) rc = upload(m, T_OUT_NORM, 0, &m->out_norm);
  if (!rc) rc = upload_w(m, T_OUTPUT, 0, true, &m->output);
  if (!rc && !m->output.p) m->output = m->embd; /* tied */
  size_t kvd = (size_t)hp->nkv * hp->hd, cache = (size_t)m->ctx * kvd * sizeof(float);
  for (int l = 0; !rc && l < hp->L; l++) {
    layer_w *w = &m->lw[l];
    if ((rc = upload(m, T_ATTN_NORM, l, &w->attn_norm)) ||
        (rc = upload_qkv(m, l, w)) || (rc = upload_w(m, T_WO, l, true, &w->wo)) ||
        (rc = upload(m, T_QNORM, l, &w->qn)) ||
        (rc = upload(m, T_KNORM, l, &w->kn)) || (rc = dev_alloc(m, cache, &w->kc)) ||
        (rc = dev_alloc(m, cache, &w->vc)))
      break;
    progress(m, "dense", (double)(l + 1) / hp->L);
  }
  if (m->stage) tdm_free(m->stage);
  m->stage = NULL;
  if (!rc && m->dense16) { /* matmul_h's workspace for prefill's pieces, and x's two parts */
    size_t qd = (size_t)hp->nh * hp->hd, kmax = qd > (size_t)hp->H ? qd : (size_t)hp->H;
    m->widen_bytes = m->widen_need < WIDEN_BYTES ? m->widen_need : WIDEN_BYTES;
    m->widen_bytes += 2 * (size_t)m->U * kmax * sizeof(float);
    rc = dev_alloc(m, m->widen_bytes, &m->widen);
  }
  return rc;
}

/* An environment switch: on unless set to 0. */
static bool env_on(const char *name) {
  const char *v = getenv(name);
  return !v || strcmp(v, "0") != 0;
}

static int setup_buffers(tdm_model *m) {
  const hparams *hp = &m->hp;
  size_t U = (size_t)m->U, qd = (size_t)hp->nh * hp->hd;
  int rc = dev_alloc(m, U * hp->H * sizeof(float), &m->xn);
  size_t qkv = qd + 2 * (size_t)hp->nkv * hp->hd; /* a step's q, k and v */
  if (!rc) rc = dev_alloc(m, (U * qd > qkv ? U * qd : qkv) * sizeof(float), &m->qb);
  if (!rc) rc = dev_alloc(m, U * qd * sizeof(float), &m->att);
  if (!rc) rc = dev_alloc(m, U * hp->V * sizeof(float), &m->logits);
  if (!rc) rc = dev_alloc(m, U * sizeof(int32_t), &m->ids);
  if (!rc) rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, U * sizeof(int32_t), (void **)&m->ids_h);
  if (!rc)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, U * hp->V * sizeof(float),
                    (void **)&m->logits_h);
  const tdm_moe_ops *o = m->ops;
  m->stepper = o->attn_prep_at && o->attention_at;
  m->graph_off = !m->stepper || !o->graph_begin || !env_on("TANDEM_MODEL_GRAPH");
  if (!rc && m->stepper) rc = dev_alloc(m, 2 * sizeof(int32_t), &m->step);
  if (!rc && m->stepper)
    rc = tdm_malloc(m->cfg.device, TDM_MEM_PINNED, 2 * sizeof(int32_t), (void **)&m->step_h);
  return rc;
}

/* ---- open / close ------------------------------------------------------------------------ */

static int check_config(const tdm_model_config *cfg, const hparams *hp, const char *path) {
  if (cfg->ctx < 0 || cfg->ubatch < 0)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_model_open: a context of %d and a ubatch of %d",
                         cfg->ctx, cfg->ubatch);
  if (cfg->ctx > hp->ctx_train)
    return tdm_set_error(TDM_EINVAL, 0, "%s: a context of %d positions is longer than the "
                         "model's %d", path, cfg->ctx, hp->ctx_train);
  return 0;
}

static int open_moe(tdm_model *m) {
  const hparams *hp = &m->hp;
  m->preset = (tdm_moe_preset){.name = hp->kind == ARCH_QWEN3MOE ? "qwen3moe" : "mixtral",
                               .hidden = hp->H, .experts = hp->E, .topk = hp->k,
                               .ffn = hp->I, .layers = hp->L, .renorm = hp->renorm};
  static const tdm_moe_source src = {.expert = src_expert, .router = src_router,
                                     .norm = src_norm};
  tdm_moe_source *s = malloc(sizeof *s);
  if (!s) return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  *s = src;
  s->user = m;
  const tdm_model_config *c = &m->cfg;
  tdm_moe_config mc = {.preset = &m->preset, .device = c->device, .max_tokens = m->U,
                       .budget_bytes = c->budget_bytes, .all_resident = c->all_resident,
                       .policy = c->policy, .predict = c->predict,
                       .predict_depth = c->predict_depth, .staging_slots = c->staging_slots,
                       .placement = c->placement, .devices = c->devices,
                       .ndevices = c->ndevices, .threads = c->threads, .source = s,
                       .norm_eps = (float)hp->eps, .layer_fmt = m->efmt};
  int rc = tdm_moe_model_create(&mc, &m->moe);
  free(s);
  return rc;
}

/* A projection's type on the device, by its dweight.wtype. */
static const char *dense_name(int wtype) {
  static const char *const names[] = {"F32",  "F16",  "BF16",  "Q8_0",
                                      "Q4_K", "Q6_K", "MXFP4", "Q5_K"};
  return wtype >= 0 && wtype <= TDM_MOE_W_Q5_K ? names[wtype] : "?";
}

/* tdm_model_info's dense_type into m->dtype: the first layer's query projection's type on the
 * device, "+..." after it where another projection or the LM head has another (a llama.cpp
 * Q4_K_M file's Q6_K head, a Mixtral's Q8_0 k and v and its Q5_K output widened to f32). */
static void dense_mix(tdm_model *m) {
  int first = m->lw[0].wq.wtype;
  bool mixed = m->output.wtype != first; /* tied: the embedding's, as the device keeps it */
  for (int l = 0; l < m->hp.L; l++) {
    const layer_w *w = &m->lw[l];
    mixed |= w->wq.wtype != first || w->wk.wtype != first || w->wv.wtype != first ||
             w->wo.wtype != first;
  }
  snprintf(m->dtype, sizeof m->dtype, "%s%s", dense_name(first), mixed ? "+..." : "");
}

int tdm_model_open(const tdm_model_config *cfg, tdm_model **out) {
  if (!cfg || !cfg->path || !cfg->device || !out)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_model_open: NULL argument");
  tdm_model *m = calloc(1, sizeof *m);
  if (!m) return tdm_set_error(TDM_ENOMEM, 0, "no memory");
  m->cfg = *cfg;
  atomic_init(&m->progress_pct, -1);
  pthread_mutex_init(&m->progress_mu, NULL);
  int rc = mfile_open(&m->f, cfg->path);
  if (!rc) rc = arch_read(&m->f, &m->hp);
  if (!rc) rc = check_config(cfg, &m->hp, cfg->path);
  if (!rc) {
    snprintf(m->format, sizeof m->format, "%s", m->f.g ? "gguf" : "safetensors");
    m->ctx = cfg->ctx ? cfg->ctx : m->hp.ctx_train < 4096 ? m->hp.ctx_train : 4096;
    m->U = cfg->ubatch ? cfg->ubatch : 512;
    if (m->U > m->ctx) m->U = m->ctx;
    if (!(m->lw = calloc((size_t)m->hp.L, sizeof *m->lw)))
      rc = tdm_set_error(TDM_ENOMEM, 0, "no memory");
  }
  if (!rc) {
    expert_part parts[3]; /* the experts' tensors are checked before the MoE layers load them */
    for (int l = 0; !rc && l < m->hp.L; l++) rc = arch_expert(&m->f, &m->hp, l, 0, parts);
    m->wtype = rc ? "?" : tdm_mf_type_name(parts[0].t->type);
  }
  if (!rc && !(m->ops = tdm_moe_ops_for(cfg->device))) rc = TDM_ENOTSUP;
  if (!rc && (!m->ops->get_rows || !m->ops->matmul || !m->ops->rope || !m->ops->attention))
    rc = tdm_set_error(TDM_ENOTSUP, 0, "%s: tandem's %s operations have no attention yet",
                       cfg->path, m->ops->name);
  if (!rc)
    rc = choose_formats(&m->f, &m->hp,
                        !cfg->experts_bf16 && m->ops->expert_q && m->ops->experts_q, &m->efmt,
                        m->etype, sizeof m->etype);
  if (!rc) rc = open_moe(m);
  if (!rc) {
    m->q = tdm_moe_queue(m->moe);
    m->ops = tdm_moe_model_ops(m->moe, &m->ops_state);
  }
  if (!rc) rc = load_dense(m);
  if (!rc) dense_mix(m);
  if (!rc) rc = setup_buffers(m);
  if (rc) {
    tdm_model_close(m);
    return rc;
  }
  *out = m;
  return 0;
}

void tdm_model_close(tdm_model *m) {
  if (!m) return;
  if (m->q) (void)tdm_queue_sync(m->q);
  for (int i = 0; i < 2; i++)
    if (m->graph[i]) m->ops->graph_free(m->ops_state, m->graph[i]);
  void *bufs[] = {m->embd.p, m->out_norm, m->output.p != m->embd.p ? m->output.p : NULL,
                  m->xn, m->qb, m->att, m->logits, m->ids, m->ids_h, m->logits_h, m->stage,
                  m->widen, m->step, m->step_h};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) tdm_free(bufs[i]);
  for (int l = 0; m->lw && l < m->hp.L; l++) {
    const layer_w *lw = &m->lw[l];
    bool one = lw->wqkv.p != NULL;
    void *w[] = {lw->attn_norm, one ? lw->wqkv.p : lw->wq.p, one ? NULL : lw->wk.p,
                 one ? NULL : lw->wv.p, lw->wo.p, lw->qn, lw->kn, lw->kc, lw->vc};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
      if (w[i]) tdm_free(w[i]);
  }
  tdm_moe_model_destroy(m->moe); /* and the ops state, which is its */
  mfile_close(&m->f);
  pthread_mutex_destroy(&m->progress_mu);
  free(m->lw);
  free(m->efmt);
  free(m);
}

int tdm_model_info_get(const tdm_model *m, tdm_model_info *out) {
  if (!m || !out) return tdm_set_error(TDM_EINVAL, 0, "tdm_model_info_get: NULL argument");
  const hparams *hp = &m->hp;
  size_t eb = expert_stride(hp, m->efmt);
  *out = (tdm_model_info){
      .arch = hp->kind == ARCH_QWEN3MOE ? "qwen3moe" : "mixtral", .format = m->format,
      .name = hp->name, .layers = hp->L, .hidden = hp->H, .heads = hp->nh,
      .kv_heads = hp->nkv, .head_dim = hp->hd, .vocab = hp->V, .experts = hp->E,
      .topk = hp->k, .expert_ffn = hp->I, .ctx_train = hp->ctx_train, .ctx = m->ctx,
      .ubatch = m->U, .rope_base = hp->rope_base, .rope_scale = hp->rope_scale,
      .norm_eps = hp->eps, .rope_neox = hp->neox, .qk_norm = hp->qk_norm,
      .tied_embeddings = hp->tied, .expert_bytes = eb,
      .host_bytes = eb * (size_t)hp->E * (size_t)hp->L, .device_bytes = m->device_bytes,
      .weight_type = m->wtype, .expert_type = m->etype,
      .dense_type = m->dtype};
  return 0;
}

int tdm_model_peek(const char *path, tdm_model_info *out) {
  if (!path || !out) return tdm_set_error(TDM_EINVAL, 0, "tdm_model_peek: NULL argument");
  mfile f;
  hparams hp;
  expert_part parts[3];
  int rc = mfile_open(&f, path);
  if (!rc) rc = arch_read(&f, &hp);
  if (!rc) rc = arch_expert(&f, &hp, 0, 0, parts);
  const tdm_mf_tensor *wq = rc ? NULL : arch_tensor(&f, &hp, T_WQ, 0);
  if (!rc && !wq) rc = TDM_EINVAL;
  tdm_moe_wfmt *fm = NULL;
  static _Thread_local char etype[32]; /* valid until the thread's next peek */
  if (!rc) rc = choose_formats(&f, &hp, true, &fm, etype, sizeof etype);
  if (!rc) {
    size_t eb = expert_stride(&hp, fm);
    int ctx = hp.ctx_train < 4096 ? hp.ctx_train : 4096;
    *out = (tdm_model_info){
        .arch = hp.kind == ARCH_QWEN3MOE ? "qwen3moe" : "mixtral",
        .format = f.g ? "gguf" : "safetensors", .name = "", .layers = hp.L, .hidden = hp.H,
        .heads = hp.nh, .kv_heads = hp.nkv, .head_dim = hp.hd, .vocab = hp.V,
        .experts = hp.E, .topk = hp.k, .expert_ffn = hp.I, .ctx_train = hp.ctx_train,
        .ctx = ctx, .ubatch = ctx < 512 ? ctx : 512, .rope_base = hp.rope_base,
        .rope_scale = hp.rope_scale, .norm_eps = hp.eps, .rope_neox = hp.neox,
        .qk_norm = hp.qk_norm, .tied_embeddings = hp.tied, .expert_bytes = eb,
        .host_bytes = eb * (size_t)hp.E * (size_t)hp.L,
        .weight_type = tdm_mf_type_name(parts[0].t->type), .expert_type = etype,
        .dense_type = tdm_mf_type_name(wq->type)};
  }
  free(fm);
  mfile_close(&f);
  return rc;
}

int tdm_model_pos(const tdm_model *m) { return m ? m->pos : 0; }

int tdm_model_rewind(tdm_model *m, int pos) {
  if (!m || pos < 0 || pos > m->pos)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_model_rewind: position %d (the sequence has %d)",
                         pos, m ? m->pos : 0);
  m->pos = pos; /* what the cache holds past pos is overwritten before it is read again */
  return 0;
}

tdm_moe_model *tdm_model_moe(tdm_model *m) { return m ? m->moe : NULL; }

int tdm_model_skip_moe(tdm_model *m, bool skip) {
  if (!m) return tdm_set_error(TDM_EINVAL, 0, "tdm_model_skip_moe: NULL model");
  m->skip_moe = skip;
  return 0;
}

int tdm_model_argmax(const float *logits, int n) {
  int best = 0;
  for (int i = 1; i < n; i++)
    if (logits[i] > logits[best]) best = i;
  return best;
}

/* ---- the forward pass -------------------------------------------------------------------- */

/* y = x w^T + beta y, w in f32, 16 bits or a block type. */
static int matmul(tdm_model *m, float *y, const float *x, const dweight *w, int T, int K, int N,
                  float beta) {
  if (!w->wtype) return m->ops->matmul(m->ops_state, m->q, y, x, w->p, T, K, N, beta);
  if (w->wtype >= TDM_MOE_W_Q8_0)
    return m->ops->matmul_q(m->ops_state, m->q, y, x, w->p, w->wtype, T, K, N, beta, m->widen,
                            m->widen_bytes);
  return m->ops->matmul_h(m->ops_state, m->q, y, x, w->p, w->wtype, T, K, N, beta, m->widen,
                          m->widen_bytes);
}

/* Layer l's attention on the ubatch of T tokens at pos0, x += Attn(RMSNorm(x)): this ubatch's
 * keys and values go straight into the cache rows pos0 .. pos0 + T - 1. */
static int attention(tdm_model *m, int l, int T, int pos0, float *x) {
  const hparams *hp = &m->hp;
  const tdm_moe_ops *o = m->ops;
  void *s = m->ops_state;
  const layer_w *w = &m->lw[l];
  int qd = hp->nh * hp->hd, kvd = hp->nkv * hp->hd, rc;
  float *k = w->kc + (size_t)pos0 * kvd, *v = w->vc + (size_t)pos0 * kvd;
  float eps = (float)hp->eps, base = (float)hp->rope_base, fs = (float)hp->rope_scale;
  if ((rc = o->rmsnorm(s, m->q, m->xn, x, w->attn_norm, T, hp->H, eps)) ||
      (rc = matmul(m, m->qb, m->xn, &w->wq, T, hp->H, qd, 0.0f)) ||
      (rc = matmul(m, k, m->xn, &w->wk, T, hp->H, kvd, 0.0f)) ||
      (rc = matmul(m, v, m->xn, &w->wv, T, hp->H, kvd, 0.0f)))
    return rc;
  if (hp->qk_norm &&
      ((rc = o->rmsnorm(s, m->q, m->qb, m->qb, w->qn, T * hp->nh, hp->hd, eps)) ||
       (rc = o->rmsnorm(s, m->q, k, k, w->kn, T * hp->nkv, hp->hd, eps))))
    return rc;
  if ((rc = o->rope(s, m->q, m->qb, T, hp->nh, hp->hd, pos0, base, fs, hp->neox)) ||
      (rc = o->rope(s, m->q, k, T, hp->nkv, hp->hd, pos0, base, fs, hp->neox)) ||
      (rc = o->attention(s, m->q, m->att, m->qb, w->kc, w->vc, T, pos0, hp->nh, hp->nkv, hp->hd,
                         (float)(1.0 / sqrt((double)hp->hd)))))
    return rc;
  return matmul(m, x, m->att, &w->wo, T, qd, hp->H, 1.0f);
}

/* Layer l's attention for a decode step's one token, its position read on the device from
 * m->step[0]: q, k and v into m->qb back to back (one pass over wqkv where the layer has it),
 * then attn_prep_at (q and k's norms, RoPE, the cache's new row) and attention_at: five ops
 * where attention() takes ten, and none of them depends on the position when it is called. */
static int attention_step(tdm_model *m, int l, float *x) {
  const hparams *hp = &m->hp;
  const tdm_moe_ops *o = m->ops;
  void *s = m->ops_state;
  const layer_w *w = &m->lw[l];
  int qd = hp->nh * hp->hd, kvd = hp->nkv * hp->hd, H = hp->H, rc;
  float *q = m->qb, *k = q + qd, *v = k + kvd, eps = (float)hp->eps;
  if ((rc = o->rmsnorm(s, m->q, m->xn, x, w->attn_norm, 1, H, eps))) return rc;
  if (w->wqkv.p)
    rc = matmul(m, q, m->xn, &w->wqkv, 1, H, qd + 2 * kvd, 0.0f);
  else if (!(rc = matmul(m, q, m->xn, &w->wq, 1, H, qd, 0.0f)) &&
           !(rc = matmul(m, k, m->xn, &w->wk, 1, H, kvd, 0.0f)))
    rc = matmul(m, v, m->xn, &w->wv, 1, H, kvd, 0.0f);
  if (rc ||
      (rc = o->attn_prep_at(s, m->q, q, k, v, w->kc, w->vc, hp->qk_norm ? w->qn : NULL,
                            hp->qk_norm ? w->kn : NULL, 1, hp->nh, hp->nkv, hp->hd, eps, m->step,
                            m->ctx, (float)hp->rope_base, (float)hp->rope_scale, hp->neox)) ||
      (rc = o->attention_at(s, m->q, m->att, q, w->kc, w->vc, 1, m->step, m->ctx, hp->nh,
                            hp->nkv, hp->hd, (float)(1.0 / sqrt((double)hp->hd)))))
    return rc;
  return matmul(m, x, m->att, &w->wo, 1, qd, H, 1.0f);
}

static void add_stats(tdm_moe_pass_stats *sum, const tdm_moe_pass_stats *p) {
  sum->seconds += p->seconds;
  sum->wait_seconds += p->wait_seconds;
  sum->ops_seconds += p->ops_seconds;
  sum->streamer_seconds += p->streamer_seconds;
  sum->bytes_copied += p->bytes_copied;
  sum->acquires += p->acquires;
  sum->hits += p->hits;
  sum->misses += p->misses;
  sum->experts_computed += p->experts_computed;
  sum->resident_hits += p->resident_hits;
  sum->inflight_hits += p->inflight_hits;
  sum->demand_misses += p->demand_misses;
  sum->host_experts += p->host_experts;
  sum->device_routed_layers += p->device_routed_layers;
  sum->host_candidates += p->host_candidates;
  sum->link_busy_seconds += p->link_busy_seconds;
  sum->host_busy_seconds += p->host_busy_seconds;
}

/* The ubatch's embeddings: T token ids on the device in, the activations' rows out. */
static int embed(tdm_model *m, const int32_t *ids, int T) {
  const hparams *hp = &m->hp;
  float *x = tdm_moe_activations(m->moe);
  if (m->embd.wtype)
    return m->ops->get_rows_h(m->ops_state, m->q, x, m->embd.p, m->embd.wtype, ids, T, hp->H,
                              hp->V);
  return m->ops->get_rows(m->ops_state, m->q, x, m->embd.p, ids, T, hp->H, hp->V);
}

/* Every layer of a pass underway, and the logits of rows [first, T) into m->logits (none when
 * first == T); step: a decode step's (attention_step). */
static int layers(tdm_model *m, int T, int first, bool step, tdm_moe_pass_stats *ps) {
  const hparams *hp = &m->hp;
  float *x = tdm_moe_activations(m->moe);
  int rc = 0, rows = T - first;
  for (int l = 0; !rc && l < hp->L; l++) {
    rc = step ? attention_step(m, l, x) : attention(m, l, T, m->pos, x);
    if (!rc && !m->skip_moe) rc = tdm_moe_pass_layer(m->moe, l, ps);
  }
  if (!rc && rows > 0 &&
      !(rc = m->ops->rmsnorm(m->ops_state, m->q, m->xn, x + (size_t)first * hp->H, m->out_norm,
                             rows, hp->H, (float)hp->eps)))
    rc = matmul(m, m->logits, m->xn, &m->output, rows, hp->H, hp->V, 0.0f);
  return rc;
}

/* A decode step with every layer on the device (tdm_moe_pass_on_device) as one submission:
 * the step's embedding, layers and LM head recorded once as a graph, the position and token
 * read from m->step as it runs, then replayed each step: the same kernels on the same buffers
 * as the step op by op, so the same bits, without the host launching each kernel. A recording
 * that fails turns graphs off for the model (the step then runs op by op, and a device fault
 * shows itself there). */
static int step_graph(tdm_model *m, tdm_moe_pass_stats *ps, bool *ran) {
  const tdm_moe_ops *o = m->ops;
  void **g = &m->graph[m->skip_moe];
  *ran = false;
  if (!*g) {
    int rc = o->graph_begin(m->ops_state, m->q), erc = 0;
    if (!rc) {
      rc = embed(m, m->step + 1, 1);
      if (!rc) rc = layers(m, 1, 0, true, ps);
      erc = o->graph_end(m->ops_state, m->q, g);
    }
    if (rc || erc) {
      if (*g) o->graph_free(m->ops_state, *g);
      *g = NULL;
      m->graph_off = true;
      tdm_clear_error();
      return 0;
    }
  }
  *ran = true;
  return o->graph_launch(m->ops_state, m->q, *g);
}

/* One ubatch: T tokens at the current position; the logits of its rows [first, T) into
 * m->logits_h (none when first == T). A decode step (one token and its logits) takes its
 * position and id on the device (m->step), so that it can run as a graph. */
static int ubatch(tdm_model *m, const int32_t *tokens, int T, int first, tdm_model_stats *st) {
  const hparams *hp = &m->hp;
  tdm_moe_pass_stats ps;
  bool step = T == 1 && first == 0 && m->stepper;
  int rc;
  if (step) {
    m->step_h[0] = m->pos;
    m->step_h[1] = tokens[0];
    rc = m->ops->upload ? m->ops->upload(m->ops_state, m->q, m->step, m->step_h, 8)
                        : tdm_memcpy(m->q, m->step, m->step_h, 8, TDM_COPY_H2D, 0, NULL, NULL);
  } else {
    memcpy(m->ids_h, tokens, (size_t)T * sizeof *tokens);
    rc = tdm_memcpy(m->q, m->ids, m->ids_h, (size_t)T * sizeof(int32_t), TDM_COPY_H2D, 0, NULL,
                    NULL);
    if (!rc) rc = embed(m, m->ids, T);
  }
  if (rc) { /* no pass begun: the queue still holds this ubatch's first commands */
    (void)tdm_queue_sync(m->q);
    return rc;
  }
  double t0 = now_s();
  if ((rc = tdm_moe_pass_begin(m->moe, T, true, &ps))) return rc;
  bool ran = false;
  if (step && !m->graph_off && tdm_moe_pass_on_device(m->moe)) rc = step_graph(m, &ps, &ran);
  if (ran && !rc) st->graph_steps++;
  if (!rc && !ran && step) rc = embed(m, m->step + 1, 1);
  if (!rc && !ran) rc = layers(m, T, first, step, &ps);
  if (!rc && first < T)
    rc = tdm_memcpy(m->q, m->logits_h, m->logits, (size_t)(T - first) * hp->V * sizeof(float),
                    TDM_COPY_D2H, 0, NULL, NULL);
  rc = tdm_moe_pass_end(m->moe, rc, &ps);
  st->pass_seconds += now_s() - t0;
  add_stats(&st->moe, &ps);
  if (!rc) m->pos += T;
  return rc;
}

/* tdm_model_eval, and with view (tdm_model_step: n == 1) the logits left in m->logits_h for
 * the caller to read there. */
static int eval(tdm_model *m, const int32_t *tokens, int n, float *logits, bool all_logits,
                tdm_model_stats *st, const float **view, const char *fn) {
  tdm_model_stats local;
  if (!st) st = &local;
  memset(st, 0, sizeof *st);
  if (!m || (!tokens && n) || n < 0)
    return tdm_set_error(TDM_EINVAL, 0, "%s: NULL argument or a negative count", fn);
  if (n > m->ctx - m->pos)
    return tdm_set_error(TDM_EINVAL, 0, "%s: %d more tokens at position %d would pass the "
                         "cache's %d positions", fn, n, m->pos, m->ctx);
  for (int i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= m->hp.V)
      return tdm_set_error(TDM_EINVAL, 0, "%s: token %d is id %d, outside the vocabulary "
                           "[0, %d)", fn, i, tokens[i], m->hp.V);
  double t0 = now_s();
  int rc = 0;
  size_t V = (size_t)m->hp.V;
  for (int at = 0; !rc && at < n; at += m->U) {
    int T = n - at < m->U ? n - at : m->U;
    bool last = at + T == n;
    int first = view ? 0 : !logits ? T : all_logits ? 0 : last ? T - 1 : T;
    rc = ubatch(m, tokens + at, T, first, st);
    if (!rc && first < T && !view) {
      float *dst = all_logits ? logits + (size_t)at * V : logits;
      memcpy(dst, m->logits_h, (size_t)(T - first) * V * sizeof(float));
    }
    if (!rc) st->ubatches++;
  }
  if (view) *view = rc ? NULL : m->logits_h;
  st->tokens = n;
  st->seconds = now_s() - t0;
  return rc;
}

int tdm_model_eval(tdm_model *m, const int32_t *tokens, int n, float *logits, bool all_logits,
                   tdm_model_stats *st) {
  return eval(m, tokens, n, logits, all_logits, st, NULL, "tdm_model_eval");
}

int tdm_model_step(tdm_model *m, int32_t token, const float **logits, tdm_model_stats *st) {
  if (!logits) return tdm_set_error(TDM_EINVAL, 0, "tdm_model_step: NULL argument");
  *logits = NULL;
  return eval(m, &token, 1, NULL, false, st, logits, "tdm_model_step");
}
