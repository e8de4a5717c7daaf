/* opencl/xfmr.c: a transformer's operations besides the MoE layers for the OpenCL backend (the
 * get_rows, matmul, matmul_q, rope and attention entries of tdm_moe__opencl_ops): kernels of
 * their own, built into ops.c's program (matmul_q's in quant.c's part), and CLBlast's SGEMM for
 * the projections. Submission, deferral and errors are ops.c's (ocl_ops.h); moe/cpu/xfmr.c is
 * the reference for what they compute.
 *
 * Precision. RoPE's angle p * freq_scale * base^(-2i/hd) reaches thousands of radians at long
 * positions, where a float angle is off by ~1e-4 and so are its cos and sin; the CPU computes
 * it in double. Devices need not have doubles, so the kernel computes the angle in float-float
 * arithmetic (pairs hi + lo, ~44 bits): base^(-2/hd) comes from the host in double as such a
 * pair, its i-th power and the products are float-float operations (built on fma's exact
 * products), and the angle is reduced modulo 2 pi (2 pi as three floats) before float cos and
 * sin, whose results the reduced angle's low part corrects. The angle's error is ~1e-13 of
 * it, so each rotated pair is within ~1.5e-7 of float64 RoPE relative to its length (float
 * cos and sin, and the output's rounding) at positions up to 2^24, measured, and ~4e-6 at
 * 2e9. A float angle is off by ~2e-4 rad at position 4096 already.
 *
 * Determinism: get_rows and rope compute each output from its inputs alone; attention is one
 * work-group per (token, head) whose sums have a fixed order (ops.c's banner) and no atomics;
 * CLBlast's SGEMM has a fixed order for fixed shapes. */
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "ocl_ops.h"

/* Appended to ops.c's source (ocl_ops.h): built with its -DMOE_WG, the work-group size. */
const char tdm_moe__ocl_xfmr_source[] =
    "\n"
    "/* ---- xfmr.c: a transformer's other operations ---- */\n"
    "\n"
    "/* (column, token): y[t] = table[ids[t]], or zeros for an id outside [0, V). */\n"
    "__kernel void moe_get_rows(__global float *yb, ulong yo, __global const float *tb,\n"
    "                           ulong tbo, __global const int *ib, ulong io, int H, int V) {\n"
    "  const size_t c = get_global_id(0), t = get_global_id(1);\n"
    "  if (c >= (size_t)H) return;\n"
    "  const int id = ib[io + t];\n"
    "  yb[yo + t * H + c] = id >= 0 && id < V ? tb[tbo + (size_t)id * H + c] : 0.0f;\n"
    "}\n"
    "\n"
    "/* Float-float numbers (hi, lo) for RoPE's angles. Error-free sums and products: nothing\n"
    " * here may be reassociated (OpenCL C never does without -cl-fast-relaxed-math), and\n"
    " * contraction is harmless (the products are fma already). */\n"
    "float2 ff_two_sum(float a, float b) {\n"
    "  const float s = a + b, bb = s - a;\n"
    "  return (float2)(s, (a - (s - bb)) + (b - bb));\n"
    "}\n"
    "\n"
    "float2 ff_fast_sum(float a, float b) { /* |a| >= |b| */\n"
    "  const float s = a + b;\n"
    "  return (float2)(s, b - (s - a));\n"
    "}\n"
    "\n"
    "float2 ff_two_prod(float a, float b) {\n"
    "  const float p = a * b;\n"
    "  return (float2)(p, fma(a, b, -p));\n"
    "}\n"
    "\n"
    "float2 ff_mul(float2 x, float2 y) {\n"
    "  float2 p = ff_two_prod(x.x, y.x);\n"
    "  p.y = fma(x.x, y.y, fma(x.y, y.x, p.y));\n"
    "  return ff_fast_sum(p.x, p.y);\n"
    "}\n"
    "\n"
    "float2 ff_add(float2 x, float2 y) {\n"
    "  float2 s = ff_two_sum(x.x, y.x);\n"
    "  const float2 t = ff_two_sum(x.y, y.y);\n"
    "  s = ff_fast_sum(s.x, s.y + t.x);\n"
    "  return ff_fast_sum(s.x, s.y + t.y);\n"
    "}\n"
    "\n"
    "/* cos and sin of p * fs * r^i, r = base^(-2/hd) in float-float: the power by squaring, the\n"
    " * angle less k 2 pi (k 2 pi as three exact products) into [-pi, pi], where float cos and\n"
    " * sin are accurate, then corrected to first order by the reduced angle's low part. */\n"
    "void moe_rope_angle(long p, int i, float2 r, float fs, float *c, float *s) {\n"
    "  float2 f = (float2)(1.0f, 0.0f);\n"
    "  for (int e = i; e; e >>= 1) {\n"
    "    if (e & 1) f = ff_mul(f, r);\n"
    "    r = ff_mul(r, r);\n"
    "  }\n"
    "  const float ph = (float)p;\n"
    "  const float2 pp = (float2)(ph, (float)(p - (long)ph));\n"
    "  float2 th = ff_mul(ff_mul(pp, f), (float2)(fs, 0.0f));\n"
    "  const float k = rint(th.x * 0x1.45f306p-3f); /* 1 / (2 pi) */\n"
    "  th = ff_add(th, -ff_two_prod(k, 0x1.921fb6p+2f));\n"
    "  th = ff_add(th, -ff_two_prod(k, -0x1.777a5cp-23f));\n"
    "  th = ff_add(th, -ff_two_prod(k, -0x1.ee59dap-48f));\n"
    "  const float cs = cos(th.x), sn = sin(th.x);\n"
    "  *c = cs - sn * th.y;\n"
    "  *s = sn + cs * th.y;\n"
    "}\n"
    "\n"
    "/* One work-item per (pair i, token t), for every head: (a, b) -> (a c - b s, a s + b c),\n"
    " * pairs (i, i + hd/2) when neox, else (2i, 2i + 1). In place. */\n"
    "__kernel void moe_rope(__global float *xb, ulong xo, int T, int nh, int hd, int pos0,\n"
    "                       float r_hi, float r_lo, float fs, int neox) {\n"
    "  const int pairs = hd / 2; /* (half is a type in OpenCL C) */\n"
    "  const size_t gid = get_global_id(0);\n"
    "  if (gid >= (size_t)T * pairs) return;\n"
    "  const int t = (int)(gid / pairs), i = (int)(gid % pairs);\n"
    "  float c, s;\n"
    "  moe_rope_angle((long)pos0 + t, i, (float2)(r_hi, r_lo), fs, &c, &s);\n"
    "  const int i0 = neox ? i : 2 * i, i1 = neox ? i + pairs : 2 * i + 1;\n"
    "  for (int h = 0; h < nh; h++) {\n"
    "    __global float *v = xb + xo + ((size_t)t * nh + h) * hd;\n"
    "    const float a = v[i0], b = v[i1];\n"
    "    v[i0] = a * c - b * s;\n"
    "    v[i1] = a * s + b * c;\n"
    "  }\n"
    "}\n"
    "\n"
    "/* q . k * scale, i ascending. */\n"
    "float moe_attn_score(__local const float *q, __global const float *k, int hd, float scale) {\n"
    "  float d = 0.0f;\n"
    "  for (int i = 0; i < hd; i++) d = fma(q[i], k[i], d);\n"
    "  return d * scale;\n"
    "}\n"
    "\n"
    "/* One work-group per (token t, query head h), over positions 0 .. pos0 + t of KV head\n"
    " * h / (nh / nkv). Two passes, nothing stored per position: the scores' max (each score one\n"
    " * work-item's serial dot product; the max is exact in any order), then, MOE_WG positions at\n"
    " * a time, the weights exp(score - max) (the same scores, computed again) and each output\n"
    " * column's weighted values summed in position order by the work-item that owns the column;\n"
    " * each work-item sums its own weights in order, and a fixed tree sums those. qa: local\n"
    " * memory for 2 hd floats (the query row, then the output row's sums). */\n"
    "__kernel void moe_attention(__global float *ob, ulong oo, __global const float *qb,\n"
    "                            ulong qo, __global const float *kb, ulong ko,\n"
    "                            __global const float *vb, ulong vo, int pos0, int nh, int nkv,\n"
    "                            int hd, float scale, __local float *qa) {\n"
    "  __local float part[MOE_WG];\n"
    "  const int l = (int)get_local_id(0);\n"
    "  const size_t row = get_group_id(0); /* t * nh + h */\n"
    "  const int t = (int)(row / (size_t)nh), h = (int)(row % (size_t)nh);\n"
    "  const int n = pos0 + t + 1, g = h / (nh / nkv);\n"
    "  const size_t kvrow = (size_t)nkv * hd;\n"
    "  __global const float *q = qb + qo + row * hd;\n"
    "  __global const float *k = kb + ko + (size_t)g * hd, *v = vb + vo + (size_t)g * hd;\n"
    "  __local float *qs = qa, *acc = qa + hd;\n"
    "  for (int d = l; d < hd; d += MOE_WG) {\n"
    "    qs[d] = q[d];\n"
    "    acc[d] = 0.0f;\n"
    "  }\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  float top = -INFINITY;\n"
    "  for (int p = l; p < n; p += MOE_WG)\n"
    "    top = fmax(top, moe_attn_score(qs, k + p * kvrow, hd, scale));\n"
    "  part[l] = top;\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (int s = MOE_WG / 2; s > 0; s >>= 1) {\n"
    "    if (l < s) part[l] = fmax(part[l], part[l + s]);\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  top = part[0];\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  float sum = 0.0f;\n"
    "  for (int p0 = 0; p0 < n; p0 += MOE_WG) {\n"
    "    const int p = p0 + l, m = min(MOE_WG, n - p0);\n"
    "    const float w = p < n ? exp(moe_attn_score(qs, k + p * kvrow, hd, scale) - top) : 0.0f;\n"
    "    sum += w;\n"
    "    part[l] = w;\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    for (int d = l; d < hd; d += MOE_WG) {\n"
    "      float a = acc[d];\n"
    "      for (int j = 0; j < m; j++) a = fma(part[j], v[(size_t)(p0 + j) * kvrow + d], a);\n"
    "      acc[d] = a;\n"
    "    }\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  part[l] = sum;\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (int s = MOE_WG / 2; s > 0; s >>= 1) {\n"
    "    if (l < s) part[l] += part[l + s];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  __global float *o = ob + oo + row * hd;\n"
    "  for (int d = l; d < hd; d += MOE_WG) o[d] = acc[d] / part[0];\n"
    "}\n";

/* a * b * c elements, or SIZE_MAX when that overflows (resolve() then refuses it). */
static size_t elems(int a, int b, int c) {
  size_t n = tdm_moe__mul(tdm_moe__mul((size_t)a, (size_t)b), (size_t)c);
  return n ? n : SIZE_MAX;
}

/* ---- get_rows ---------------------------------------------------------------------------- */

typedef struct rows_job {
  clbuf y, table, ids;
  cl_int T, H, V;
} rows_job;

static int run_get_rows(moe_ocl *m, const void *args) {
  const rows_job *a = args;
  karg k[] = {KBUF(a->y), KBUF(a->table), KBUF(a->ids), KVAL(a->H), KVAL(a->V)};
  size_t global[2] = {round_up((size_t)a->H, m->wg), (size_t)a->T}, local[2] = {m->wg, 1};
  return LAUNCH(m, "get_rows", K_GET_ROWS, k, 2, global, local);
}

int tdm_moe__ocl_get_rows(void *st, tdm_queue *q, float *y, const float *table,
                          const int32_t *ids, int T, int H, int V) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "get_rows");
  if (rc) return rc;
  if (!y || !table || !ids || T < 0 || H <= 0 || V <= 0) return tdm_moe__ocl_bad_args("get_rows");
  if (T == 0) return 0;
  rows_job a = {.T = T, .H = H, .V = V};
  if ((rc = tdm_moe__ocl_resolve(m, "get_rows", "y", y, elems(T, H, 1), sizeof(float), &a.y,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "get_rows", "table", table, elems(V, H, 1), sizeof(float),
                                 &a.table, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "get_rows", "ids", ids, (size_t)T, sizeof(int32_t), &a.ids,
                                 NULL)))
    return rc;
  return tdm_moe__ocl_submit(m, run_get_rows, &a, sizeof a);
}

/* ---- matmul ------------------------------------------------------------------------------ */

typedef struct matmul_job {
  clbuf y, x, w;
  size_t T, K, N;
  float beta;
} matmul_job;

/* Row-major y = x w^T + beta y: SGEMM with w transposed, as the CPU table's cblas_sgemm. With
 * beta 0 CLBlast's kernels do not read y. */
static int run_matmul(moe_ocl *m, const void *args) {
  const matmul_job *a = args;
  CLBlastStatusCode st =
      CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, a->T, a->N,
                   a->K, 1.0f, a->x.mem, a->x.off, a->K, a->w.mem, a->w.off, a->K, a->beta,
                   a->y.mem, a->y.off, a->N, &m->cq, NULL);
  return st == CLBlastSuccess ? 0 : tdm_moe__ocl_blast_fail("matmul", "CLBlastSgemm", st);
}

/* CLBlast's GEMM kernels index their buffers with int: a matrix must end within 2^31 - 1
 * elements of its buffer's start. */
static int blast_reach(const char *name, clbuf b, size_t count) {
  if (b.off <= (cl_ulong)INT_MAX && count <= (size_t)INT_MAX - b.off) return 0;
  return tdm_set_error(TDM_EINVAL, 0, "moe matmul: %s ends past 2^31 floats into its buffer, "
                       "where CLBlast cannot address it", name);
}

int tdm_moe__ocl_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                        int K, int N, float beta) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "matmul");
  if (rc) return rc;
  if (!y || !x || !w || T < 0 || K <= 0 || N <= 0 || (beta != 0.0f && beta != 1.0f))
    return tdm_moe__ocl_bad_args("matmul");
  if (T == 0) return 0;
  matmul_job a = {.T = (size_t)T, .K = (size_t)K, .N = (size_t)N, .beta = beta};
  size_t ny = elems(T, N, 1), nx = elems(T, K, 1), nw = elems(N, K, 1);
  if ((rc = tdm_moe__ocl_resolve(m, "matmul", "y", y, ny, sizeof(float), &a.y, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "matmul", "x", x, nx, sizeof(float), &a.x, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "matmul", "w", w, nw, sizeof(float), &a.w, NULL)) ||
      (rc = blast_reach("y", a.y, ny)) || (rc = blast_reach("x", a.x, nx)) ||
      (rc = blast_reach("w", a.w, nw)))
    return rc;
  return tdm_moe__ocl_submit(m, run_matmul, &a, sizeof a);
}

/* ---- matmul_q: a projection in its blocks ------------------------------------------------ */

/* Tokens up to which moe_qmatmul reads each row once for all of them; more widen pieces of w
 * into the workspace for CLBlast's SGEMM, as the CPU's and CUDA's tables do. */
enum { QMM_DIRECT_T = 8 };

typedef struct matmulq_job {
  clbuf y, x, w, ws;
  size_t T, K, N, R; /* R: rows of w a piece (T > QMM_DIRECT_T) */
  cl_ulong rb;
  float beta;
  cl_int wt;
} matmulq_job;

static int run_matmul_q(moe_ocl *m, const void *args) {
  const matmulq_job *a = args;
  cl_int T = (cl_int)a->T, K = (cl_int)a->K, N = (cl_int)a->N, beta = a->beta != 0.0f;
  if (a->T <= QMM_DIRECT_T) {
    karg k[] = {KBUF(a->y), KBUF(a->x), KBUF(a->w), KVAL(a->rb), KVAL(T),
                KVAL(K),    KVAL(N),    KVAL(beta), KVAL(a->wt)};
    size_t global[2] = {round_up(a->N, m->wg), (a->T + 3) / 4};
    return LAUNCH(m, "matmul_q", K_QMATMUL, k, 2, global, NULL);
  }
  for (size_t n0 = 0; n0 < a->N; n0 += a->R) {
    cl_int c = (cl_int)(a->N - n0 < a->R ? a->N - n0 : a->R);
    clbuf src = {a->w.mem, a->w.off + n0 * a->rb};
    karg widen[] = {KBUF(a->ws), KBUF(src), KVAL(a->rb), KVAL(K), KVAL(c), KVAL(a->wt)};
    size_t g[2] = {a->K / 32, (size_t)c};
    int rc = LAUNCH(m, "matmul_q", K_QWIDEN, widen, 2, g, NULL);
    if (rc) return rc;
    CLBlastStatusCode st = CLBlastSgemm(
        CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, a->T, (size_t)c, a->K,
        1.0f, a->x.mem, a->x.off, a->K, a->ws.mem, a->ws.off, a->K, a->beta, a->y.mem,
        a->y.off + n0, a->N, &m->cq, NULL);
    if (st != CLBlastSuccess) return tdm_moe__ocl_blast_fail("matmul_q", "CLBlastSgemm", st);
  }
  return 0;
}

int tdm_moe__ocl_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w,
                          int wtype, int T, int K, int N, float beta, void *ws,
                          size_t ws_bytes) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "matmul_q");
  if (rc) return rc;
  size_t rb = wtype >= TDM_MOE_W_Q8_0 && wtype <= TDM_MOE_W_Q5_K && K % 32 == 0
                  ? tdm_moe_row_bytes(wtype, K)
                  : 0;
  if (!rb)
    return tdm_set_error(TDM_EINVAL, 0, "moe matmul_q: weight type %d with rows of %d values: "
                         "not a block type, or rows that are not whole blocks", wtype, K);
  if (!y || !x || !w || T < 0 || N <= 0 || (beta != 0.0f && beta != 1.0f) ||
      (T > QMM_DIRECT_T && (!ws || ws_bytes / sizeof(float) < (size_t)K)))
    return tdm_moe__ocl_bad_args("matmul_q");
  if (T == 0) return 0;
  matmulq_job a = {.T = (size_t)T, .K = (size_t)K, .N = (size_t)N, .rb = rb, .beta = beta,
                   .wt = wtype};
  size_t ny = elems(T, N, 1), nx = elems(T, K, 1);
  if (T > QMM_DIRECT_T) {
    a.R = ws_bytes / sizeof(float) / (size_t)K;
    if (a.R > (size_t)N) a.R = (size_t)N;
  }
  if ((rc = tdm_moe__ocl_resolve(m, "matmul_q", "y", y, ny, sizeof(float), &a.y, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "matmul_q", "x", x, nx, sizeof(float), &a.x, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "matmul_q", "w", w, rb * (size_t)N, 1, &a.w, NULL)))
    return rc;
  if (T > QMM_DIRECT_T &&
      ((rc = tdm_moe__ocl_resolve(m, "matmul_q", "workspace", ws, a.R * (size_t)K, sizeof(float),
                                  &a.ws, NULL)) ||
       (rc = blast_reach("y", a.y, ny)) || (rc = blast_reach("x", a.x, nx)) ||
       (rc = blast_reach("workspace", a.ws, a.R * (size_t)K))))
    return rc;
  return tdm_moe__ocl_submit(m, run_matmul_q, &a, sizeof a);
}

/* ---- rope -------------------------------------------------------------------------------- */

typedef struct rope_job {
  clbuf x;
  cl_int T, nh, hd, pos0, neox;
  cl_float r_hi, r_lo, fs; /* base^(-2/hd) as a float-float pair; freq_scale */
} rope_job;

static int run_rope(moe_ocl *m, const void *args) {
  const rope_job *a = args;
  karg k[] = {KBUF(a->x),    KVAL(a->T),    KVAL(a->nh), KVAL(a->hd),  KVAL(a->pos0),
              KVAL(a->r_hi), KVAL(a->r_lo), KVAL(a->fs), KVAL(a->neox)};
  size_t global = round_up((size_t)a->T * (size_t)(a->hd / 2), m->wg), local = m->wg;
  return LAUNCH(m, "rope", K_ROPE, k, 1, &global, &local);
}

int tdm_moe__ocl_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0,
                      float base, float freq_scale, int neox) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "rope");
  if (rc) return rc;
  /* Positions are ints: pos0 + T - 1 must be one. */
  if (!x || T < 0 || nh <= 0 || hd <= 0 || hd % 2 || pos0 < 0 || !(base > 0.0f) ||
      !(freq_scale > 0.0f) || (int64_t)pos0 + T > INT32_MAX)
    return tdm_moe__ocl_bad_args("rope");
  if (T == 0) return 0;
  /* The kernel's powers of r give base^(-2i/hd) to float-float precision. */
  double r = pow((double)base, -2.0 / hd);
  rope_job a = {.T = T, .nh = nh, .hd = hd, .pos0 = pos0, .neox = neox != 0,
                .r_hi = (float)r, .fs = freq_scale};
  a.r_lo = (float)(r - (double)a.r_hi);
  if ((rc = tdm_moe__ocl_resolve(m, "rope", "x", x, elems(T, nh, hd), sizeof(float), &a.x, NULL)))
    return rc;
  return tdm_moe__ocl_submit(m, run_rope, &a, sizeof a);
}

/* ---- attention --------------------------------------------------------------------------- */

typedef struct attn_job {
  clbuf out, qv, kc, vc;
  cl_int T, pos0, nh, nkv, hd;
  cl_float scale;
} attn_job;

static int run_attention(moe_ocl *m, const void *args) {
  const attn_job *a = args;
  karg k[] = {KBUF(a->out),  KBUF(a->qv), KBUF(a->kc),  KBUF(a->vc),
              KVAL(a->pos0), KVAL(a->nh), KVAL(a->nkv), KVAL(a->hd),
              KVAL(a->scale), {2 * (size_t)a->hd * sizeof(cl_float), NULL}};
  size_t global = (size_t)a->T * (size_t)a->nh * m->wg, local = m->wg;
  return LAUNCH(m, "attention", K_ATTENTION, k, 1, &global, &local);
}

int tdm_moe__ocl_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                           const float *vc, int T, int pos0, int nh, int nkv, int hd,
                           float scale) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "attention");
  if (rc) return rc;
  if (!out || !qv || !kc || !vc || T < 0 || pos0 < 0 || nh <= 0 || nkv <= 0 || nh % nkv ||
      hd <= 0 || !(scale > 0.0f) || (int64_t)pos0 + T > INT32_MAX)
    return tdm_moe__ocl_bad_args("attention");
  if (T == 0) return 0;
  if (2 * (cl_ulong)hd * sizeof(cl_float) > m->attn_local)
    return tdm_set_error(TDM_EINVAL, 0, "moe attention: heads of %d need more local memory than "
                         "the device's %llu bytes", hd, (unsigned long long)m->attn_local);
  attn_job a = {.T = T, .pos0 = pos0, .nh = nh, .nkv = nkv, .hd = hd, .scale = scale};
  size_t rows = elems(T, nh, hd), cache = elems(pos0 + T, nkv, hd);
  if ((rc = tdm_moe__ocl_resolve(m, "attention", "out", out, rows, sizeof(float), &a.out,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "attention", "qv", qv, rows, sizeof(float), &a.qv, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "attention", "kc", kc, cache, sizeof(float), &a.kc, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "attention", "vc", vc, cache, sizeof(float), &a.vc, NULL)))
    return rc;
  return tdm_moe__ocl_submit(m, run_attention, &a, sizeof a);
}
