/* test-moe-quant.c: experts in their file's weight format (tandem/moe_ops.h's expert_q() and
 * experts_q(); GGUF's Q8_0, Q4_K, Q6_K and MXFP4 blocks, and F16 and BF16) against an fp64
 * reference written here.
 *
 * Each expert's blocks are random (scales never zero, values spread over the type's range),
 * so that a wrong nibble, scale or block stride moves the result. The reference widens them
 * with tdm_moe_dequant_row(), which tests/test-gguf.c holds bit for bit to the gguf package's
 * own gguf.quants, and computes the expert in double. The measure is ||got - ref|| / ||ref||
 * over every slot an op wrote, as in test-moe-ops.c: under 1e-4 on the CPU (f32 from the same
 * values), 1e-2 on a GPU (bf16 activations into its matrix units). Slots no entry names keep
 * a sentinel. `experts_q_ref` runs tables of experts on 0 to 20 tokens each (both sides of the
 * CPU's direct-path threshold of 8) in every format, Q4_K_M's mix of Q4_K and Q6_K among them;
 * `expert_q_ref` the single-expert entry; `bf16_matches_experts` wants experts_q() in {BF16,
 * BF16} bitwise equal to experts(); `experts_q_grid` and `experts_q_counter` CUDA's grouped
 * prefill kernels run each way; `row_sizes` and `bad_args` the sizes and the errors;
 * `matmul_q_ref` a projection in each block type, Q5_K among them (a projection's type only).
 * A table without expert_q() / experts_q() (or matmul_q()) skips, visibly (77).
 */
#include "harness.h"
#include "moe-fixture.h"

#include <math.h>

#include <tandem/moe_ops.h>

#define REL_TOL (tol_scale * (strcmp(f->ops->name, "cpu") == 0 ? 1e-4 : 1e-2))
/* REL_TOL's factor for a case whose activations a 16-bit rounding handles worse than usual. */
static double tol_scale = 1.0;

/* setup() with, when need_q, a table that has expert_q() and experts_q() (else skipped). */
static fixture setup_q(int need_q) {
  fixture f = setup();
  if (need_q && (!f.ops->expert_q || !f.ops->experts_q)) {
    const char *name = f.ops->name;
    teardown(&f);
    TH_SKIP("the %s table has no expert_q() / experts_q() yet", name);
  }
  return f;
}

/* ---- Random blocks ----------------------------------------------------------------------- */

/* A positive normal f32 as IEEE binary16 bits, rounded to nearest. */
static uint16_t f16_bits(float v) {
  int e;
  float m = frexpf(v, &e); /* v = m 2^e, m in [0.5, 1) */
  int mant = (int)lrintf((2.0f * m - 1.0f) * 1024.0f), exp = e - 1;
  if (mant == 1024) mant = 0, exp++;
  CHECK(exp >= -14 && exp <= 15);
  return (uint16_t)(((exp + 15) << 10) | mant);
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, sizeof v); }

/* A row of K values of type t at dst (tdm_moe_row_bytes(t, K) bytes), random, its values of
 * root mean square about 1 / sqrt(K) so that a dot product with a unit row is of order one. */
static void rnd_row(fixture *f, int t, int K, uint8_t *dst) {
  uint64_t *s = &f->rng;
  float unit = 1.0f / sqrtf((float)K);
  switch (t) {
  case TDM_MOE_W_F16:
  case TDM_MOE_W_BF16:
    for (int k = 0; k < K; k++) {
      float v = unit * (0.2f + 1.6f * (float)th_rand_below(s, 1000) / 1000.0f);
      uint16_t b = t == TDM_MOE_W_F16 ? f16_bits(v) : tdm_moe_f32_to_bf16(v);
      put16(dst + 2 * k, (uint16_t)(b | (th_rand(s) & 1 ? 0x8000u : 0)));
    }
    return;
  case TDM_MOE_W_Q8_0:
    for (int b = 0; b < K / 32; b++, dst += 34) {
      put16(dst, f16_bits(unit / 73.0f * (0.5f + (float)th_rand_below(s, 100) / 100.0f)));
      for (int j = 0; j < 32; j++) dst[2 + j] = (uint8_t)(th_rand_below(s, 255) - 127 + 256);
    }
    return;
  case TDM_MOE_W_Q4_K:
  case TDM_MOE_W_Q5_K: { /* d, dmin, then random scales and q (Q5_K: qh's fifth bits too) */
    const int bytes = t == TDM_MOE_W_Q4_K ? 144 : 176;
    for (int b = 0; b < K / 256; b++, dst += bytes) {
      float d = unit / 220.0f * (0.5f + (float)th_rand_below(s, 100) / 100.0f);
      put16(dst, f16_bits(d));
      put16(dst + 2, f16_bits(d * (1.0f + (float)th_rand_below(s, 400) / 100.0f)));
      for (int j = 4; j < bytes; j++) dst[j] = (uint8_t)th_rand(s);
    }
    return;
  }
  case TDM_MOE_W_Q6_K:
    for (int b = 0; b < K / 256; b++, dst += 210) {
      for (int j = 0; j < 192; j++) dst[j] = (uint8_t)th_rand(s);
      for (int j = 192; j < 208; j++) /* int8 scales, never 0 */
        dst[j] = (uint8_t)((1 + th_rand_below(s, 127)) * (th_rand(s) & 1 ? 1 : -1) + 256);
      put16(dst + 208, f16_bits(unit / 200.0f * (0.5f + (float)th_rand_below(s, 100) / 100.0f)));
    }
    return;
  case TDM_MOE_W_MXFP4: {
    int e0 = 127 - (int)lrintf(log2f(3.0f * sqrtf((float)K)));
    for (int b = 0; b < K / 32; b++, dst += 17) {
      dst[0] = (uint8_t)(e0 - 1 + (int)th_rand_below(s, 3));
      for (int j = 1; j < 17; j++) dst[j] = (uint8_t)th_rand(s);
    }
    return;
  }
  default: CHECK_MSG(0, "type %d", t);
  }
}

/* ---- Problems ---------------------------------------------------------------------------- */

enum { MAX_G = 8, TOPK = 4 };
/* Tokens of a case's x (24; more for the cases of many rows). */
static int T = 24;

/* G experts in format fmt, back to back at 16-byte steps in one allocation; entry g computes
 * counts[g] distinct tokens of x [T x H] into distinct slots of out [T*TOPK x H]. */
typedef struct qcase {
  int H, I, n, G;
  tdm_moe_wfmt fmt;
  size_t ebytes, stride, wbytes;
  float *x;              /* pinned [T x H] */
  uint8_t *w;            /* pinned, wbytes */
  float *wide;           /* host: G x 3HI, the widened experts */
  tdm_moe_group *groups; /* pinned [G] */
  int32_t *rows, *slot;  /* pinned [n] */
  float *dx, *dout, *got;
  uint8_t *dw;
  tdm_moe_group *dgroups;
  int32_t *drows, *dslot;
  void *ws;
  size_t ws_bytes;
} qcase;

static const float SENTINEL = 12345.0f;

/* Bytes added to the stride between experts (0: each starts on 16 bytes; 2: every other one
 * starts 2 bytes past, as an expert may, on an even byte). */
static size_t skew;

static qcase qcase_setup(fixture *f, tdm_moe_wfmt fmt, int H, int I, const int *counts, int G) {
  qcase c = {.H = H, .I = I, .G = G, .fmt = fmt};
  CHECK(G > 0 && G <= MAX_G);
  for (int g = 0; g < G; g++) c.n += counts[g];
  c.ebytes = tdm_moe_expert_size(fmt, H, I);
  CHECK(c.ebytes > 0);
  c.stride = (c.ebytes + 15) / 16 * 16 + skew;
  c.wbytes = c.stride * (size_t)G;
  c.x = alloc(f, TDM_MEM_PINNED, (size_t)T * H * sizeof *c.x);
  for (size_t i = 0; i < (size_t)T * H; i++)
    c.x[i] = (0.1f + (float)th_rand_below(&f->rng, 900) / 1000.0f) * (th_rand(&f->rng) & 1 ? 1 : -1);
  c.w = alloc(f, TDM_MEM_PINNED, c.wbytes);
  memset(c.w, 0xA5, c.wbytes); /* the gaps: reading one shows */
  size_t hi = (size_t)H * I, gu = tdm_moe_row_bytes(fmt.gu, H), d = tdm_moe_row_bytes(fmt.d, I);
  c.wide = malloc((size_t)G * 3 * hi * sizeof *c.wide);
  CHECK(c.wide != NULL);
  for (int g = 0; g < G; g++) {
    uint8_t *e = c.w + (size_t)g * c.stride;
    float *wd = c.wide + (size_t)g * 3 * hi;
    for (int r = 0; r < 2 * I; r++) {
      rnd_row(f, fmt.gu, H, e + (size_t)r * gu);
      CHECK_OK(tdm_moe_dequant_row(fmt.gu, e + (size_t)r * gu, wd + (size_t)r * H, H));
    }
    for (int r = 0; r < H; r++) {
      rnd_row(f, fmt.d, I, e + 2 * I * gu + (size_t)r * d);
      CHECK_OK(tdm_moe_dequant_row(fmt.d, e + 2 * I * gu + (size_t)r * d,
                                   wd + 2 * hi + (size_t)r * I, I));
    }
  }
  c.groups = alloc(f, TDM_MEM_PINNED, (size_t)G * sizeof *c.groups);
  c.rows = alloc(f, TDM_MEM_PINNED, (size_t)c.n * sizeof *c.rows);
  c.slot = alloc(f, TDM_MEM_PINNED, (size_t)c.n * sizeof *c.slot);
  pick_distinct(f, T * TOPK, c.n, c.slot);
  for (int g = 0, first = 0; g < G; first += counts[g], g++) {
    c.groups[g] = (tdm_moe_group){.w = (int64_t)((size_t)g * c.stride / 2), .first = first,
                                  .count = counts[g]};
    pick_distinct(f, T, counts[g], c.rows + first);
  }
  c.dx = upload(f, c.x, (size_t)T * H * sizeof *c.x);
  c.dw = upload(f, c.w, c.wbytes);
  c.dgroups = upload(f, c.groups, (size_t)G * sizeof *c.groups);
  c.drows = upload(f, c.rows, (size_t)c.n * sizeof *c.rows);
  c.dslot = upload(f, c.slot, (size_t)c.n * sizeof *c.slot);
  c.dout = alloc(f, TDM_MEM_DEVICE, (size_t)T * TOPK * H * sizeof *c.dout);
  c.got = alloc(f, TDM_MEM_PINNED, (size_t)T * TOPK * H * sizeof *c.got);
  c.ws_bytes = tdm_moe_ops_workspace(c.n, H, I);
  c.ws = alloc(f, TDM_MEM_DEVICE, c.ws_bytes);
  CHECK_OK(tdm_queue_sync(f->q));
  return c;
}

static void qcase_teardown(qcase *c) {
  tdm_free(c->x); tdm_free(c->w); free(c->wide); tdm_free(c->groups); tdm_free(c->rows);
  tdm_free(c->slot); tdm_free(c->dx); tdm_free(c->dw); tdm_free(c->dgroups);
  tdm_free(c->drows); tdm_free(c->dslot); tdm_free(c->dout); tdm_free(c->got); tdm_free(c->ws);
}

/* out set to the sentinel on the device; the result read back into c->got after `run`. */
static void sentinel(fixture *f, qcase *c) {
  size_t n = (size_t)T * TOPK * c->H;
  for (size_t i = 0; i < n; i++) c->got[i] = SENTINEL;
  CHECK_OK(tdm_memcpy(f->q, c->dout, c->got, n * sizeof *c->got, TDM_COPY_H2D, 0, NULL, NULL));
}

static void read_back(fixture *f, qcase *c) {
  size_t n = (size_t)T * TOPK * c->H;
  CHECK_OK(tdm_memcpy(f->q, c->got, c->dout, n * sizeof *c->got, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(f->q));
}

static double silu(double g) { return g / (1.0 + exp(-g)); }

/* Token positions check_entries leaves out (nonzero: a bad token, whose slot keeps the
 * sentinel), or NULL. */
static const unsigned char *skip_pos;

/* Entries [g0, g1) of c's table against the fp64 reference on the widened weights; every slot
 * no entry of them names keeps the sentinel. */
static void check_entries(fixture *f, const qcase *c, int g0, int g1, const char *what) {
  const int H = c->H, I = c->I;
  const size_t hi = (size_t)H * I;
  double *h = malloc((size_t)I * sizeof *h), diff2 = 0.0, ref2 = 0.0;
  char *written = calloc((size_t)T * TOPK, 1);
  CHECK(h != NULL && written != NULL);
  for (int g = g0; g < g1; g++) {
    const float *w = c->wide + (size_t)g * 3 * hi;
    for (int i = c->groups[g].first; i < c->groups[g].first + c->groups[g].count; i++) {
      if (skip_pos && skip_pos[i]) continue;
      const float *x = c->x + (size_t)c->rows[i] * H;
      for (int r = 0; r < I; r++) {
        double gate = 0.0, up = 0.0;
        for (int k = 0; k < H; k++) {
          gate += (double)x[k] * w[(size_t)r * H + k];
          up += (double)x[k] * w[hi + (size_t)r * H + k];
        }
        h[r] = silu(gate) * up;
      }
      written[c->slot[i]] = 1;
      const float *got = c->got + (size_t)c->slot[i] * H;
      for (int r = 0; r < H; r++) {
        double s = 0.0;
        for (int k = 0; k < I; k++) s += h[k] * w[2 * hi + (size_t)r * I + k];
        CHECK_MSG(isfinite(got[r]), "%s: out[%d][%d] = %g", what, c->slot[i], r, got[r]);
        diff2 += (got[r] - s) * (got[r] - s);
        ref2 += s * s;
      }
    }
  }
  free(h);
  CHECK(ref2 > 0.0);
  double rel = sqrt(diff2 / ref2);
  printf("%s: relative error %.3e (limit %.0e)\n", what, rel, REL_TOL);
  CHECK_MSG(rel < REL_TOL, "%s: relative error %.3e", what, rel);
  for (int s = 0; s < T * TOPK; s++)
    if (!written[s])
      for (int r = 0; r < H; r++)
        CHECK_MSG(c->got[(size_t)s * H + r] == SENTINEL, "%s: out[%d][%d] written", what, s, r);
  free(written);
}

static const char *type_name(int t) {
  static const char *const names[] = {"?",    "F16",  "BF16",  "Q8_0",
                                      "Q4_K", "Q6_K", "MXFP4", "Q5_K"};
  return t >= 1 && t <= 7 ? names[t] : "?";
}

/* Every format the header names, Q4_K_M's mix among them. */
static const tdm_moe_wfmt FORMATS[] = {
    {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0}, {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K},
    {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}, {TDM_MOE_W_Q6_K, TDM_MOE_W_Q6_K},
    {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4}, {TDM_MOE_W_F16, TDM_MOE_W_F16},
    {TDM_MOE_W_BF16, TDM_MOE_W_BF16}, {TDM_MOE_W_Q8_0, TDM_MOE_W_Q6_K}};
enum { NFORMATS = sizeof FORMATS / sizeof FORMATS[0] };

/* Token counts: none, one, a few, both sides of the CPU's direct path (8), many. */
static const int COUNTS[] = {3, 0, 9, 1, 20, 8, 2};
enum { NCOUNTS = sizeof COUNTS / sizeof COUNTS[0] };

/* Every entry on few tokens: the CPU fuses such a table's experts into one pair of passes. */
static const int FEW[] = {1, 2, 0, 8, 1, 3};
enum { NFEW = sizeof FEW / sizeof FEW[0] };

/* experts_q() on the case's table, every slot it names against fp64; the case is freed. */
static void experts_q_case(fixture *f, qcase *c, const char *what) {
  sentinel(f, c);
  CHECK_OK(f->ops->experts_q(f->st, f->q, c->dx, c->drows, c->dslot, c->n, c->dw, c->fmt,
                             c->dgroups, c->G, c->H, c->I, c->dout, c->ws, c->ws_bytes));
  read_back(f, c);
  check_entries(f, c, 0, c->G, what);
  qcase_teardown(c);
}

TEST_CASE(experts_q_ref) {
  fixture f0 = setup_q(1), *f = &f0;
  for (int i = 0; i < 2 * NFORMATS; i++) {
    const int few = i >= NFORMATS;
    const tdm_moe_wfmt fmt = FORMATS[i % NFORMATS];
    char what[64];
    snprintf(what, sizeof what, "experts_q {%s, %s}%s", type_name(fmt.gu), type_name(fmt.d),
             few ? " few" : "");
    qcase c = few ? qcase_setup(f, fmt, 256, 512, FEW, NFEW)
                  : qcase_setup(f, fmt, 256, 512, COUNTS, NCOUNTS);
    experts_q_case(f, &c, what);
  }
  teardown(f);
}

/* Many rows in all (more than a GPU's experts_gemm_rows, where CUDA runs the table as
 * tensor-core GEMMs in tiles of 64 tokens): entries of 0, 1, 63, 64, 65 and up to 96 tokens
 * (one tile, one and a bit, a tile and a half), 384 rows, every format, with H 768 (gate/up
 * in three steps of 256 values: a step copied while the one before it runs, into the buffer
 * of the one before that) and I 256, against fp64; then the types of 32-value blocks with rows
 * that end in part of a 256-value step (H 1312, I 288) and every other expert 2 bytes off
 * 16. */
/* Entries of many rows: none, one, a tile less one, a tile, a tile and one, and more; 384 in
 * all, one per slot of T = 96 tokens of top-4. */
static const int MANY[] = {65, 0, 96, 1, 63, 64, 45, 50};
enum { NMANY = sizeof MANY / sizeof MANY[0] };

TEST_CASE(experts_q_many) {
  fixture f0 = setup_q(1), *f = &f0;
  static const tdm_moe_wfmt partial[] = {{TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0},
                                         {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4},
                                         {TDM_MOE_W_F16, TDM_MOE_W_F16},
                                         {TDM_MOE_W_BF16, TDM_MOE_W_BF16}};
  enum { NP = sizeof partial / sizeof partial[0] };
  T = 96;
  for (int i = 0; i < NFORMATS + NP; i++) {
    const int odd = i >= NFORMATS;
    const tdm_moe_wfmt fmt = odd ? partial[i - NFORMATS] : FORMATS[i];
    char what[64];
    snprintf(what, sizeof what, "experts_q {%s, %s} many%s", type_name(fmt.gu),
             type_name(fmt.d), odd ? ", partial steps" : "");
    skew = odd ? 2 : 0;
    qcase c = qcase_setup(f, fmt, odd ? 1312 : 768, odd ? 288 : 256, MANY, NMANY);
    CHECK(f->ops->experts_gemm_rows == 0 || c.n >= f->ops->experts_gemm_rows);
    experts_q_case(f, &c, what);
  }
  skew = 0;
  T = 24;
  teardown(f);
}

/* The grouped prefill kernels run each way (CUDA: TANDEM_MOE_CUDA_GMM_SCHED; the default,
 * auto, takes the counter for the small tables of the other cases): a grid of a block a tile,
 * and the counter with each block taking many work items (TANDEM_MOE_CUDA_GMM_BLOCKS=2), on
 * every entry of the table and then on its last NMANY - 3 entries alone, as a streamed group
 * of a few experts runs among a ubatch's entries: every token right, no other slot written. */
static void sched_case(const char *sched, const char *blocks) {
  CHECK(setenv("TANDEM_MOE_CUDA_GMM_SCHED", sched, 1) == 0);
  CHECK(setenv("TANDEM_MOE_CUDA_GMM_BLOCKS", blocks, 1) == 0);
  fixture f0 = setup_q(1), *f = &f0;
  CHECK(unsetenv("TANDEM_MOE_CUDA_GMM_SCHED") == 0);
  CHECK(unsetenv("TANDEM_MOE_CUDA_GMM_BLOCKS") == 0);
  if (strcmp(f->ops->name, "cuda") != 0) {
    const char *name = f->ops->name;
    teardown(f);
    TH_SKIP("the ways to run tiles are the CUDA table's (the %s table has no grid)", name);
  }
  static const tdm_moe_wfmt fmts[] = {{TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K},
                                      {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0},
                                      {TDM_MOE_W_BF16, TDM_MOE_W_BF16}};
  T = 96;
  for (int i = 0; i < 6; i++) {
    const tdm_moe_wfmt fmt = fmts[i % 3];
    const int g0 = i < 3 ? 0 : 3;
    char what[80];
    snprintf(what, sizeof what, "experts_q {%s, %s} %s, entries %d..", type_name(fmt.gu),
             type_name(fmt.d), sched, g0);
    qcase c = qcase_setup(f, fmt, 512, 256, MANY, NMANY);
    sentinel(f, &c);
    CHECK_OK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, c.fmt,
                               c.dgroups + g0, c.G - g0, c.H, c.I, c.dout, c.ws, c.ws_bytes));
    read_back(f, &c);
    check_entries(f, &c, g0, c.G, what);
    qcase_teardown(&c);
  }
  T = 24;
  teardown(f);
}

TEST_CASE(experts_q_grid) { sched_case("grid", "0"); }
TEST_CASE(experts_q_counter) { sched_case("counter", "2"); }

/* Bad device data among many rows (moe_ops.h): after the case's good entries, one whose
 * weights end past the allocation, one with first + count = n + 1 and one with count -1; a
 * good entry's token whose row is x's last row + 1, another's whose slot is out's last + 1.
 * On a GPU the good tokens are right and nothing else is written; the CPU fails the sync with
 * TDM_ERANGE. */
TEST_CASE(experts_q_many_bad_data) {
  fixture f0 = setup_q(1), *f = &f0;
  enum { NG = NMANY, NB = 3 };
  T = 96;
  const tdm_moe_wfmt fmt = {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K};
  qcase c = qcase_setup(f, fmt, 256, 256, MANY, NG);
  unsigned char *skip = calloc((size_t)c.n, 1);
  CHECK(skip != NULL);
  const int bad_row = c.groups[2].first + 70, bad_slot = c.groups[0].first + 3;
  c.rows[bad_row] = T;
  c.slot[bad_slot] = T * TOPK;
  skip[bad_row] = skip[bad_slot] = 1;
  CHECK_OK(tdm_memcpy(f->q, c.drows, c.rows, (size_t)c.n * sizeof *c.rows, TDM_COPY_H2D, 0,
                      NULL, NULL));
  CHECK_OK(tdm_memcpy(f->q, c.dslot, c.slot, (size_t)c.n * sizeof *c.slot, TDM_COPY_H2D, 0,
                      NULL, NULL));
  tdm_moe_group *table = alloc(f, TDM_MEM_PINNED, (NG + NB) * sizeof *table);
  memcpy(table, c.groups, NG * sizeof *table);
  table[NG] = (tdm_moe_group){.w = (int64_t)(c.wbytes / 2), .first = 0, .count = 2};
  table[NG + 1] = (tdm_moe_group){.w = 0, .first = c.n - 1, .count = 2};
  table[NG + 2] = (tdm_moe_group){.w = 0, .first = 0, .count = -1};
  tdm_moe_group *dtable = upload(f, table, (NG + NB) * sizeof *table);
  sentinel(f, &c);
  CHECK_OK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, c.fmt, dtable,
                             NG + NB, c.H, c.I, c.dout, c.ws, c.ws_bytes));
  int rc = TH_CALL(tdm_queue_sync(f->q));
  if (strcmp(f->ops->name, "cpu") == 0) {
    CHECK_MSG(rc == TDM_ERANGE, "the CPU's sync gave %d, not TDM_ERANGE", rc);
  } else {
    CHECK_OK(rc);
    read_back(f, &c);
    skip_pos = skip;
    check_entries(f, &c, 0, NG, "experts_q many, among bad data");
    skip_pos = NULL;
  }
  free(skip);
  tdm_free(table);
  tdm_free(dtable);
  qcase_teardown(&c);
  T = 24;
  teardown(f);
}

/* Rows longer than a decode kernel's unrolled run of 256-value chunks, and (the types of
 * 32-value blocks) rows that end in part of a chunk: H 1312 = 5 chunks and 32 values, I 288;
 * every other expert 2 bytes off a 16-byte boundary. */
TEST_CASE(experts_q_long_rows) {
  fixture f0 = setup_q(1), *f = &f0;
  skew = 2;
  static const tdm_moe_wfmt fmts[] = {{TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0},
                                      {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4},
                                      {TDM_MOE_W_F16, TDM_MOE_W_F16},
                                      {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K},
                                      {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K}};
  for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++) {
    const int k = fmts[i].gu == TDM_MOE_W_Q4_K; /* 256-value blocks: whole chunks */
    char what[64];
    snprintf(what, sizeof what, "experts_q {%s, %s} long rows", type_name(fmts[i].gu),
             type_name(fmts[i].d));
    qcase c = qcase_setup(f, fmts[i], k ? 1280 : 1312, k ? 512 : 288, FEW, NFEW);
    experts_q_case(f, &c, what);
  }
  skew = 0;
  teardown(f);
}

/* Activations a decode kernel may round in blocks of 32 (moe_ops.h): per token, a block of
 * zeros, a block with one value 100 times the others, and a block of values near 1e-30 (its
 * scale subnormal), against fp64. The outlier's block keeps its other values to 1/65534 of
 * the outlier: the CPU's 16-bit path measured 5-9e-5 here (f32: 2e-7), so the limit is ten
 * times the usual. */
TEST_CASE(experts_q_uneven_x) {
  fixture f0 = setup_q(1), *f = &f0;
  tol_scale = 10.0;
  static const tdm_moe_wfmt fmts[] = {{TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0},
                                      {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K},
                                      {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K}};
  for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++) {
    char what[64];
    snprintf(what, sizeof what, "experts_q {%s, %s} uneven x", type_name(fmts[i].gu),
             type_name(fmts[i].d));
    qcase c = qcase_setup(f, fmts[i], 512, 256, FEW, NFEW);
    for (int t = 0; t < T; t++) {
      float *x = c.x + (size_t)t * c.H;
      for (int k = 0; k < 32; k++) {
        x[k] = 0.0f;
        x[64 + k] *= 1e-30f;
      }
      x[32 + t % 32] *= 100.0f;
    }
    CHECK_OK(tdm_memcpy(f->q, c.dx, c.x, (size_t)T * c.H * sizeof *c.x, TDM_COPY_H2D, 0, NULL,
                        NULL));
    experts_q_case(f, &c, what);
  }
  tol_scale = 1.0;
  teardown(f);
}

/* expert_q() on one expert of a table, with few tokens and with many; on CUDA with each of
 * its prefill GEMMs (TANDEM_MOE_CUDA_QGEMM: the widened expert through cuBLASLt, and the
 * fused kernel that reads the blocks). */
TEST_CASE(expert_q_ref) {
  fixture f0 = setup_q(1), *f = &f0;
  static const int counts[] = {20, 3};
  const int modes = strcmp(f->ops->name, "cuda") == 0 ? 2 : 1;
  for (int i = 0; i < NFORMATS * modes; i++)
    for (int g = 0; g < 2; g++) {
      const int fused = i >= NFORMATS;
      if (fused)
        setenv("TANDEM_MOE_CUDA_QGEMM", "fused", 1);
      else
        unsetenv("TANDEM_MOE_CUDA_QGEMM");
      char what[80];
      snprintf(what, sizeof what, "expert_q {%s, %s} n=%d%s", type_name(FORMATS[i % NFORMATS].gu),
               type_name(FORMATS[i % NFORMATS].d), counts[g], fused ? " fused" : "");
      qcase c = qcase_setup(f, FORMATS[i % NFORMATS], 512, 256, counts, 2);
      sentinel(f, &c);
      CHECK_OK(f->ops->expert_q(f->st, f->q, c.dx, c.drows + c.groups[g].first,
                                c.dslot + c.groups[g].first, counts[g],
                                c.dw + (size_t)g * c.stride, c.fmt, c.H, c.I, c.dout, c.ws,
                                c.ws_bytes));
      read_back(f, &c);
      check_entries(f, &c, g, g + 1, what);
      qcase_teardown(&c);
    }
  teardown(f);
}

/* {BF16, BF16} is experts()'s format: the same bits from either entry. */
TEST_CASE(bf16_matches_experts) {
  fixture f0 = setup_q(1), *f = &f0;
  if (!f->ops->experts) TH_SKIP("the %s table has no experts()", f->ops->name);
  qcase c = qcase_setup(f, (tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, 256, 512, COUNTS,
                        NCOUNTS);
  size_t n = (size_t)T * TOPK * c.H;
  float *first = malloc(n * sizeof *first);
  CHECK(first != NULL);
  sentinel(f, &c);
  CHECK_OK(f->ops->experts(f->st, f->q, c.dx, c.drows, c.dslot, c.n,
                           (const tdm_moe_bf16 *)(const void *)c.dw, c.dgroups, c.G, c.H, c.I,
                           c.dout, c.ws, c.ws_bytes));
  read_back(f, &c);
  memcpy(first, c.got, n * sizeof *first);
  sentinel(f, &c);
  CHECK_OK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, c.fmt, c.dgroups,
                             c.G, c.H, c.I, c.dout, c.ws, c.ws_bytes));
  read_back(f, &c);
  CHECK_MSG(memcmp(first, c.got, n * sizeof *first) == 0, "experts_q differs from experts");
  free(first);
  qcase_teardown(&c);
  teardown(f);
}

/* The sizes of rows and experts, and the exact widening's argument errors: device-free. */
TEST_CASE(row_sizes) {
  fixture f0 = setup_q(0), *f = &f0;
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q8_0, 64) == 68);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q4_K, 512) == 288);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q6_K, 256) == 210);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_MXFP4, 96) == 51);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_BF16, 7) == 14 && tdm_moe_row_bytes(TDM_MOE_W_F16, 7) == 14);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q8_0, 48) == 0);  /* not whole blocks */
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q4_K, 128) == 0);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q8_0, 0) == 0 && tdm_moe_row_bytes(TDM_MOE_W_Q8_0, -32) == 0);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q5_K, 512) == 352);
  CHECK(tdm_moe_row_bytes(TDM_MOE_W_Q5_K, 32) == 0);
  CHECK(tdm_moe_row_bytes(0, 32) == 0 && tdm_moe_row_bytes(8, 32) == 0);
  /* Q4_K_M's mix: gate and up rows of Q4_K, down rows of Q6_K. */
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}, 2048, 768) ==
        2 * 768 * 8 * 144 + 2048 * 3 * 210);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, 300, 200) ==
        3 * 300 * 200 * 2);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}, 2048, 100) == 0);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0}, 0, 64) == 0);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q8_0, 9}, 64, 64) == 0);
  /* Q5_K is a projection's type (matmul_q), no expert's */
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q5_K, TDM_MOE_W_Q5_K}, 256, 256) == 0);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_Q4_K, TDM_MOE_W_Q5_K}, 256, 256) == 0);
  CHECK(tdm_moe_expert_size((tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, INT32_MAX - 1,
                            INT32_MAX - 1) == 0); /* past size_t */
  float y[64];
  uint8_t b[68] = {0};
  CHECK(tdm_moe_dequant_row(TDM_MOE_W_Q8_0, b, y, 48) == TDM_EINVAL);
  CHECK(tdm_moe_dequant_row(TDM_MOE_W_Q8_0, NULL, y, 64) == TDM_EINVAL);
  CHECK(tdm_moe_dequant_row(TDM_MOE_W_Q8_0, b, NULL, 64) == TDM_EINVAL);
  CHECK(tdm_moe_dequant_row(99, b, y, 64) == TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "type 99") != NULL);
  /* Q8_0 with d = 1.0 (f16 0x3c00): the values are the int8s themselves. */
  put16(b, 0x3c00);
  put16(b + 34, 0x3800); /* 0.5 */
  for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(j - 16 + 256), b[36 + j] = (uint8_t)j;
  CHECK_OK(tdm_moe_dequant_row(TDM_MOE_W_Q8_0, b, y, 64));
  for (int j = 0; j < 32; j++) CHECK(y[j] == (float)(j - 16) && y[32 + j] == 0.5f * (float)j);
  teardown(f);
}

/* Formats a table lacks, or rows that are not whole blocks: TDM_EINVAL at the call, nothing
 * queued. On the CPU an entry whose quantized expert runs past the weights' allocation fails
 * the command with TDM_ERANGE (reported by the sync), out untouched; a GPU skips it. */
TEST_CASE(bad_args) {
  fixture f0 = setup_q(1), *f = &f0;
  static const int counts[] = {2, 3};
  tdm_moe_wfmt q8 = {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0};
  qcase c = qcase_setup(f, q8, 256, 256, counts, 2);
  const tdm_moe_wfmt bad[] = {{0, TDM_MOE_W_Q8_0}, {TDM_MOE_W_Q8_0, 99}, {-1, -1},
                              {TDM_MOE_W_Q5_K, TDM_MOE_W_Q5_K}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, bad[i], c.dgroups,
                            c.G, c.H, c.I, c.dout, c.ws, c.ws_bytes) == TDM_EINVAL);
    CHECK(f->ops->expert_q(f->st, f->q, c.dx, c.drows, c.dslot, 2, c.dw, bad[i], c.H, c.I,
                           c.dout, c.ws, c.ws_bytes) == TDM_EINVAL);
  }
  /* Q4_K rows are 256 values: H = 256 fits, I = 96 does not (with a workspace that does). */
  tdm_moe_wfmt q4 = {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K};
  CHECK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, q4, c.dgroups, c.G,
                          c.H, 96, c.dout, c.ws, c.ws_bytes) == TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "whole blocks") != NULL);
  CHECK(f->ops->expert_q(f->st, f->q, c.dx, c.drows, c.dslot, 2, c.dw, q4, 96, c.I, c.dout, c.ws,
                         c.ws_bytes) == TDM_EINVAL);
  CHECK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, NULL, q8, c.dgroups, c.G,
                          c.H, c.I, c.dout, c.ws, c.ws_bytes) == TDM_EINVAL);
  CHECK_OK(tdm_queue_sync(f->q));
  if (strcmp(f->ops->name, "cpu") == 0) {
    /* The second expert moved half a stride on: its blocks run past the allocation. */
    c.groups[1].w += (int64_t)(c.stride / 4);
    CHECK_OK(tdm_memcpy(f->q, c.dgroups, c.groups, 2 * sizeof *c.groups, TDM_COPY_H2D, 0, NULL,
                        NULL));
    sentinel(f, &c);
    CHECK_OK(f->ops->experts_q(f->st, f->q, c.dx, c.drows, c.dslot, c.n, c.dw, q8, c.dgroups,
                               c.G, c.H, c.I, c.dout, c.ws, c.ws_bytes));
    CHECK(tdm_queue_sync(f->q) == TDM_ERANGE);
    CHECK(strstr(tdm_last_error(), "leave wbase's allocation") != NULL);
  }
  qcase_teardown(&c);
  teardown(f);
}

/* ---- matmul_q: a projection in its blocks ------------------------------------------------ */

/* y = x w^T + beta y with w [N x K] in block type t, against float64 on the widened w; ws_rows:
 * the rows of w the workspace holds (more tokens than decode are widened in pieces). */
static void check_matmul_q(fixture *f, int t, int nt, int K, int N, float beta, int ws_rows) {
  size_t rb = tdm_moe_row_bytes(t, K), nx = (size_t)nt * K, ny = (size_t)nt * N;
  uint8_t *w = alloc(f, TDM_MEM_PINNED, rb * (size_t)N);
  float *wide = malloc((size_t)N * K * sizeof *wide), *y = malloc(ny * sizeof *y);
  float *x = alloc(f, TDM_MEM_PINNED, nx * sizeof *x), *y0 = alloc(f, TDM_MEM_PINNED, ny * 4);
  CHECK(wide && y);
  for (int n = 0; n < N; n++) {
    rnd_row(f, t, K, w + (size_t)n * rb);
    CHECK_OK(tdm_moe_dequant_row(t, w + (size_t)n * rb, wide + (size_t)n * K, K));
  }
  for (size_t i = 0; i < nx; i++)
    x[i] = (0.1f + (float)th_rand_below(&f->rng, 900) / 1000.0f) * (th_rand(&f->rng) & 1 ? 1 : -1);
  for (size_t i = 0; i < ny; i++) y0[i] = beta == 0.0f ? NAN : (float)th_rand_below(&f->rng, 100);
  float *dx = upload(f, x, nx * sizeof *x), *dy = upload(f, y0, ny * sizeof *y0);
  uint8_t *dw = upload(f, w, rb * (size_t)N);
  size_t ws_bytes = (size_t)ws_rows * K * sizeof(float);
  void *ws = alloc(f, TDM_MEM_DEVICE, ws_bytes);
  CHECK_OK(f->ops->matmul_q(f->st, f->q, dy, dx, dw, t, nt, K, N, beta, ws, ws_bytes));
  CHECK_OK(tdm_memcpy(f->q, y, dy, ny * sizeof *y, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(f->q));
  double d2 = 0.0, r2 = 0.0;
  for (int i = 0; i < nt; i++)
    for (int n = 0; n < N; n++) {
      double ref = beta == 0.0f ? 0.0 : y0[(size_t)i * N + n];
      for (int k = 0; k < K; k++) ref += (double)x[(size_t)i * K + k] * wide[(size_t)n * K + k];
      double got = y[(size_t)i * N + n];
      CHECK_MSG(isfinite(got), "matmul_q %s: y[%d][%d] = %g", type_name(t), i, n, got);
      d2 += (got - ref) * (got - ref);
      r2 += ref * ref;
    }
  double rel = sqrt(d2 / r2);
  printf("matmul_q %s T=%d K=%d N=%d beta=%g, %d rows a piece: relative error %.3e\n",
         type_name(t), nt, K, N, (double)beta, ws_rows, rel);
  /* f32's precision, but for the CPU's 16-bit activations (REL_TOL is the experts' bf16) */
  double tol = strcmp(f->ops->name, "cpu") == 0 ? 1e-4 : 1e-5;
  CHECK_MSG(rel < tol, "matmul_q %s T=%d: relative error %.3e", type_name(t), nt, rel);
  tdm_free(w); tdm_free(x); tdm_free(y0); tdm_free(dx); tdm_free(dy); tdm_free(dw);
  tdm_free(ws); free(wide); free(y);
}

/* Every block type, decode's few tokens (rows read once) and prefill's pieces (the workspace
 * holding all of w, or a few rows: the last piece short; with room for x's parts or not), beta
 * 0 and 1, within f32's precision (the CPU's: 16-bit activations). A table without it
 * skips; one with it refuses a type that is not a block type and rows not whole blocks. */
TEST_CASE(matmul_q_ref) {
  fixture f0 = setup_q(0), *f = &f0;
  if (!f->ops->matmul_q) {
    const char *name = f->ops->name;
    teardown(f);
    TH_SKIP("the %s table has no matmul_q(): a model widens block-typed projections to f32",
            name);
  }
  static const int types[] = {TDM_MOE_W_Q8_0, TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K, TDM_MOE_W_MXFP4,
                              TDM_MOE_W_Q5_K};
  static const int shapes[][4] = {{1, 512, 70, 70},  {5, 256, 33, 33}, {8, 512, 40, 40},
                                  {13, 256, 37, 5},  {30, 512, 64, 64}, {1, 1280, 9, 9},
                                  {3, 1280, 9, 9},
                                  /* room for x's two parts besides w's: CUDA's TF32 pieces,
                                   * all of w or 7 rows (with w's second parts), or none */
                                  {40, 512, 64, 2 * 40 + 2 * 64}, {40, 512, 64, 2 * 40 + 2 * 7},
                                  {40, 512, 64, 2 * 40 + 1}};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
      for (int b = 0; b < 2; b++)
        check_matmul_q(f, types[i], shapes[s][0], shapes[s][1], shapes[s][2], (float)b,
                       shapes[s][3]);
  /* rows that end in part of a 256-value chunk (32-value blocks only) */
  check_matmul_q(f, TDM_MOE_W_Q8_0, 2, 1312, 9, 0.0f, 9);
  check_matmul_q(f, TDM_MOE_W_MXFP4, 1, 1312, 9, 1.0f, 9);
  float *buf = alloc(f, TDM_MEM_DEVICE, 64 * 256 * sizeof(float));
  CHECK(f->ops->matmul_q(f->st, f->q, buf, buf, buf, TDM_MOE_W_F16, 1, 256, 8, 0.0f, buf,
                         4096) == TDM_EINVAL);
  CHECK(f->ops->matmul_q(f->st, f->q, buf, buf, buf, TDM_MOE_W_Q4_K, 1, 96, 8, 0.0f, buf,
                         4096) == TDM_EINVAL);
  CHECK(f->ops->matmul_q(f->st, f->q, buf, buf, buf, TDM_MOE_W_Q8_0, 1, 64, 8, 0.5f, buf,
                         4096) == TDM_EINVAL);
  CHECK_OK(tdm_queue_sync(f->q));
  tdm_free(buf);
  teardown(f);
}
