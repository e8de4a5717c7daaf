/* test-moe-ops.c: the MoE op tables (tandem/moe_ops.h) against an fp64 reference written here.
 *
 * Each case uploads random inputs (never zero, seed printed) into device memory, runs one op
 * on the device's table, reads the result back into pinned memory and compares it with a
 * double-precision reference that uses the same bf16-rounded weights, converted exactly. The
 * measure is ||got - ref|| / ||ref|| over everything an op wrote, under 1e-4 for these f32
 * paths. The router is checked against the device's own routing: where two probabilities are
 * closer than rounding can separate, either order is right, so only positions whose
 * neighbours are at least ROUTE_TIE apart must match the reference. `expert_few_tokens` covers
 * decode sizes, on both sides of the CPU's direct bf16 path threshold. `deterministic` runs the
 * expert repeatedly, on one queue and on two at once, and wants bitwise equal output;
 * `ordered_after_host_task` wants ops queued behind a slow host task to wait for it;
 * `bad_args` and `alloc_faults` check the error paths; `expert_on_host` runs the CPU's expert()
 * on the device's pinned memory between device-side waits, as host placement does;
 * `expert_threads_agree` wants the CPU's few-token expert bitwise the same whatever its pool's
 * size. A device without a table is skipped (77).
 *
 * The grouped ops: `experts_ref` runs experts() on tables of experts with 0 to 20 tokens, held
 * at distinct offsets of one weight allocation, with H, I and offsets on and off the 8-element
 * grid, against the same fp64 reference (slots no entry names keep the sentinel);
 * `experts_split` wants the same bits from one call, from one call per entry and from the table
 * reversed; `experts_match_expert` compares experts() with expert() on each entry's tokens
 * (within REL_TOL: a GPU may compute the grouped path in more precision); `group_ref` checks
 * group()'s rows, slot and table against a host reference, with and without indices out of
 * [0, E); `group_then_experts` feeds one into the other, router-free, and again behind a slow
 * host task, bitwise the same; `experts_shapes_agree` checks that the CUDA grouped kernels' two
 * shapes give the same bits; `grouped_bad_args` and `experts_device_data` check argument
 * errors and bad table entries, rows and slots (skipped on a GPU, TDM_ERANGE from the sync on
 * the CPU). `host_pass` runs a layer's host-placed experts (tdm_moe_host_pass) as the device
 * queue's host_call(), between the device's copies, against the same reference. A table that
 * lacks experts() or group() (the op
 * tables gain them one backend at a time) skips these cases visibly (77), so the suite stays
 * green until every table has them.
 */
#include "harness.h"
#include "moe-fixture.h"

#include <math.h>

#include <tandem/moe_ops.h>

/* The CPU computes in f32 from bf16 weights (1e-4 holds); GPU backends feed bf16 activations
 * to their matrix units, and bf16 work is held to 1e-2 against the fp64 reference. */
#define REL_TOL (strcmp(th_backend_of_current(), "cpu") == 0 ? 1e-4 : 1e-2)
#define ROUTE_TIE 1e-5

/* ---- Fixture: moe-fixture.h ---------------------------------------------------------- */

/* ---- Random data ------------------------------------------------------------------------- */

/* Uniform magnitude in [0.1, 1) * scale, random sign: never zero. */
static float rnd(uint64_t *s, float scale) {
  uint64_t r = th_rand(s);
  float mag = 0.1f + 0.9f * (float)(r >> 40) / (float)(1u << 24);
  return (r & 1 ? -mag : mag) * scale;
}

static float *rnd_f32(fixture *f, size_t n, float scale) {
  float *p = alloc(f, TDM_MEM_PINNED, n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = rnd(&f->rng, scale);
  return p;
}

static tdm_moe_bf16 *rnd_bf16(fixture *f, size_t n, float scale) {
  tdm_moe_bf16 *p = alloc(f, TDM_MEM_PINNED, n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = tdm_moe_f32_to_bf16(rnd(&f->rng, scale));
  return p;
}

/* pick_distinct() (moe-fixture.h), in pinned memory. */
static int32_t *rnd_distinct(fixture *f, int n, int m) {
  int32_t *out = alloc(f, TDM_MEM_PINNED, (size_t)m * sizeof *out);
  pick_distinct(f, n, m, out);
  return out;
}

/* ---- Comparison -------------------------------------------------------------------------- */

typedef struct errsum {
  double diff2, ref2;
} errsum;

static void err_add(errsum *e, const char *what, size_t at, float got, double ref) {
  if (!isfinite(got)) th_fail(__FILE__, __LINE__, "%s[%zu] is %g", what, at, got);
  e->diff2 += (got - ref) * (got - ref);
  e->ref2 += ref * ref;
}

static const char *th_backend_of_current(void) {
  static char backend[16];
  if (!backend[0]) snprintf(backend, sizeof backend, "%.*s", (int)strcspn(th_device_id, ":"),
                            th_device_id);
  return backend;
}

static double err_check(const errsum *e, const char *what) {
  CHECK(e->ref2 > 0.0);
  double rel = sqrt(e->diff2 / e->ref2);
  printf("%s: relative error %.3e (limit %.0e)\n", what, rel, (double)REL_TOL);
  CHECK_MSG(rel < REL_TOL, "%s: relative error %.3e", what, rel);
  return rel;
}

/* ---- rmsnorm ----------------------------------------------------------------------------- */

TEST_CASE(rmsnorm_ref) {
  enum { T = 37, H = 300 };
  const float eps = 1e-6f;
  fixture f = setup();
  float *x = rnd_f32(&f, (size_t)T * H, 3.0f), *w = rnd_f32(&f, H, 1.0f);
  float *y = alloc(&f, TDM_MEM_PINNED, (size_t)T * H * sizeof *y);
  float *dx = upload(&f, x, (size_t)T * H * sizeof *x), *dw = upload(&f, w, H * sizeof *w);
  float *dy = alloc(&f, TDM_MEM_DEVICE, (size_t)T * H * sizeof *dy);

  CHECK_OK(f.ops->rmsnorm(f.st, f.q, dy, dx, dw, T, H, eps));
  download(&f, y, dy, (size_t)T * H * sizeof *y);

  errsum e = {0};
  for (int t = 0; t < T; t++) {
    double ss = 0.0;
    for (int h = 0; h < H; h++) ss += (double)x[t * H + h] * x[t * H + h];
    double r = 1.0 / sqrt(ss / H + eps);
    for (int h = 0; h < H; h++)
      err_add(&e, "y", (size_t)t * H + h, y[t * H + h], x[t * H + h] * r * w[h]);
  }
  err_check(&e, "rmsnorm");

  /* In place (y == x) is the same computation. */
  CHECK_OK(f.ops->rmsnorm(f.st, f.q, dx, dx, dw, T, H, eps));
  float *y2 = alloc(&f, TDM_MEM_PINNED, (size_t)T * H * sizeof *y2);
  download(&f, y2, dx, (size_t)T * H * sizeof *y2);
  CHECK_MEM_EQ(y2, y, (size_t)T * H * sizeof *y);

  tdm_free(dx); tdm_free(dw); tdm_free(dy); tdm_free(x); tdm_free(w); tdm_free(y); tdm_free(y2);
  teardown(&f);
}

/* ---- router ------------------------------------------------------------------------------ */

/* Reference probabilities of one token, in double. */
static void ref_probs(const float *x, const tdm_moe_bf16 *wr, const float *bias, int H, int E,
                      double *p) {
  double m = -INFINITY, sum = 0.0;
  for (int e = 0; e < E; e++) {
    double l = bias ? bias[e] : 0.0;
    for (int h = 0; h < H; h++) l += (double)x[h] * tdm_moe_bf16_to_f32(wr[(size_t)e * H + h]);
    p[e] = l;
    if (l > m) m = l;
  }
  for (int e = 0; e < E; e++) sum += (p[e] = exp(p[e] - m));
  for (int e = 0; e < E; e++) p[e] /= sum;
}

/* order[0..E): experts by descending p, ties to the lower index. */
static void ref_order(const double *p, int E, int *order) {
  for (int e = 0; e < E; e++) order[e] = e;
  for (int i = 1; i < E; i++) { /* insertion sort: stable, so equal p keep index order */
    int v = order[i], j = i;
    while (j > 0 && p[order[j - 1]] < p[v]) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = v;
  }
}

/* Runs the router once and checks it; returns how many positions were too close to call. */
static int check_router(fixture *f, int T, int H, int E, int k, int renorm, int with_bias) {
  float *x = rnd_f32(f, (size_t)T * H, 1.0f);
  tdm_moe_bf16 *wr = rnd_bf16(f, (size_t)E * H, 4.0f / sqrtf((float)H));
  float *bias = with_bias ? rnd_f32(f, E, 0.5f) : NULL;
  int32_t *idx = alloc(f, TDM_MEM_PINNED, (size_t)T * k * sizeof *idx);
  float *wts = alloc(f, TDM_MEM_PINNED, (size_t)T * k * sizeof *wts);
  float *dx = upload(f, x, (size_t)T * H * sizeof *x);
  tdm_moe_bf16 *dwr = upload(f, wr, (size_t)E * H * sizeof *wr);
  float *dbias = with_bias ? upload(f, bias, E * sizeof *bias) : NULL;
  int32_t *didx = alloc(f, TDM_MEM_DEVICE, (size_t)T * k * sizeof *didx);
  float *dwts = alloc(f, TDM_MEM_DEVICE, (size_t)T * k * sizeof *dwts);

  CHECK_OK(f->ops->router(f->st, f->q, dx, dwr, dbias, T, H, E, k, renorm, didx, dwts));
  download(f, idx, didx, (size_t)T * k * sizeof *idx);
  download(f, wts, dwts, (size_t)T * k * sizeof *wts);

  double *p = malloc((size_t)E * sizeof *p);
  int *order = malloc((size_t)E * sizeof *order);
  CHECK(p && order);
  errsum e = {0};
  int close_calls = 0;
  for (int t = 0; t < T; t++) {
    const int32_t *ti = idx + (size_t)t * k;
    const float *tw = wts + (size_t)t * k;
    ref_probs(x + (size_t)t * H, wr, bias, H, E, p);
    ref_order(p, E, order);
    double chosen = 0.0;
    for (int j = 0; j < k; j++) {
      CHECK_MSG(ti[j] >= 0 && ti[j] < E, "token %d: idx[%d] = %d", t, j, ti[j]);
      for (int i = 0; i < j; i++) CHECK_MSG(ti[i] != ti[j], "token %d: expert %d twice", t, ti[j]);
      chosen += p[ti[j]];
    }
    for (int j = 0; j < k; j++) {
      /* The device's own routing: its experts, the reference's probabilities. */
      err_add(&e, "weights", (size_t)t * k + j, tw[j], p[ti[j]] / (renorm ? chosen : 1.0));
      /* Descending, ties to the lower index, by the device's own numbers. */
      if (j > 0) {
        CHECK_MSG(tw[j - 1] >= tw[j], "token %d: weights not descending at %d", t, j);
        CHECK_MSG(tw[j - 1] > tw[j] || ti[j - 1] < ti[j], "token %d: tie at %d not by index",
                  t, j);
      }
      int clear = (j == 0 || p[order[j - 1]] - p[order[j]] >= ROUTE_TIE) &&
                  (j + 1 == E || p[order[j]] - p[order[j + 1]] >= ROUTE_TIE);
      if (!clear) {
        close_calls++;
        continue;
      }
      CHECK_MSG(ti[j] == order[j], "token %d position %d: expert %d, reference %d (p %.9f)", t,
                j, ti[j], order[j], p[order[j]]);
    }
  }
  printf("router T=%d E=%d k=%d renorm=%d bias=%d: %d of %d positions too close to call\n", T,
         E, k, renorm, with_bias, close_calls, T * k);
  err_check(&e, renorm ? "router weights (renormalized)" : "router weights");

  free(p); free(order);
  tdm_free(x); tdm_free(wr); tdm_free(idx); tdm_free(wts); tdm_free(dx); tdm_free(dwr);
  tdm_free(didx); tdm_free(dwts);
  if (with_bias) {
    tdm_free(bias);
    tdm_free(dbias);
  }
  return close_calls;
}

TEST_CASE(router_ref) {
  enum { T = 96, H = 192, E = 40, K = 6 };
  fixture f = setup();
  int close_calls = check_router(&f, T, H, E, K, 1, 0);
  close_calls += check_router(&f, T, H, E, K, 0, 1);
  /* k == E: every expert, so the order is all that is checked. */
  close_calls += check_router(&f, 8, 64, 5, 5, 1, 1);
  /* Decode sizes, with H a multiple of 8 and not. CUDA computes the logits of up to 64 tokens
   * in a kernel of their own (8 tokens a block row: these and 40 below), and larger ubatches in
   * one block per 8 tokens (96 above, 300 below). */
  close_calls += check_router(&f, 1, 256, 128, 8, 1, 1);
  close_calls += check_router(&f, 3, 300, 128, 8, 0, 0);
  close_calls += check_router(&f, 40, H, E, K, 0, 1);
  close_calls += check_router(&f, 300, H, E, K, 1, 1);
  /* CUDA's larger ubatches: H in parts of 96 (the last of 12), tiles of 32 tokens and experts
   * cut short; then more tokens than its scratch holds the parts of (4096 at H = 64, E = 128:
   * two launches). */
  close_calls += check_router(&f, 100, 300, 40, 8, 1, 1);
  close_calls += check_router(&f, 4200, 64, 128, 8, 1, 0);
  /* Near ties are rare at these scales; many would mean the check compared almost nothing. */
  const int positions = 2 * T * K + 8 * 5 + 1 * 8 + 3 * 8 + 40 * K + 300 * K + 100 * 8 + 4200 * 8;
  CHECK_MSG(close_calls < positions / 10, "%d near ties of %d positions", close_calls,
            positions);
  teardown(&f);
}

/* ---- expert ------------------------------------------------------------------------------ */

static double silu(double g) { return g / (1.0 + exp(-g)); }

/* The expert's output for one token, in double. */
static void ref_expert(const float *x, const tdm_moe_bf16 *w, int H, int I, double *h,
                       double *out) {
  const tdm_moe_bf16 *wg = w, *wu = w + (size_t)I * H, *wd = w + 2 * (size_t)I * H;
  for (int i = 0; i < I; i++) {
    double g = 0.0, u = 0.0;
    for (int c = 0; c < H; c++) {
      g += (double)x[c] * tdm_moe_bf16_to_f32(wg[(size_t)i * H + c]);
      u += (double)x[c] * tdm_moe_bf16_to_f32(wu[(size_t)i * H + c]);
    }
    h[i] = silu(g) * u;
  }
  for (int c = 0; c < H; c++) {
    double s = 0.0;
    for (int i = 0; i < I; i++) s += h[i] * tdm_moe_bf16_to_f32(wd[(size_t)c * I + i]);
    out[c] = s;
  }
}

/* One expert problem on the device: inputs uploaded, output buffer and workspace allocated. */
typedef struct expert_case {
  int T, H, I, n, k;
  float *x;                 /* pinned [T x H] */
  tdm_moe_bf16 *w;              /* pinned, 3HI */
  int32_t *rows, *slot;     /* pinned [n] */
  float *dx, *dout;         /* device */
  tdm_moe_bf16 *dw;
  int32_t *drows, *dslot;
  void *ws;
  size_t ws_bytes;
} expert_case;

static const float SENTINEL = 12345.0f;

static expert_case expert_setup(fixture *f, int T, int H, int I, int n, int k) {
  expert_case c = {.T = T, .H = H, .I = I, .n = n, .k = k};
  c.x = rnd_f32(f, (size_t)T * H, 1.0f);
  /* Weights scaled so that gate, up and the output stay of order one. */
  size_t hi = (size_t)H * I;
  c.w = rnd_bf16(f, 3 * hi, 1.0f);
  for (size_t i = 0; i < 3 * hi; i++) {
    float s = i < 2 * hi ? 2.0f / sqrtf((float)H) : 2.0f / sqrtf((float)I);
    c.w[i] = tdm_moe_f32_to_bf16(tdm_moe_bf16_to_f32(c.w[i]) * s);
  }
  c.rows = rnd_distinct(f, T, n);
  c.slot = rnd_distinct(f, T * k, n);
  c.dx = upload(f, c.x, (size_t)T * H * sizeof *c.x);
  c.dw = upload(f, c.w, 3 * hi * sizeof *c.w);
  c.drows = upload(f, c.rows, (size_t)n * sizeof *c.rows);
  c.dslot = upload(f, c.slot, (size_t)n * sizeof *c.slot);
  c.dout = alloc(f, TDM_MEM_DEVICE, (size_t)T * k * H * sizeof *c.dout);
  c.ws_bytes = tdm_moe_ops_workspace(n, H, I);
  CHECK(c.ws_bytes > 0 && c.ws_bytes % 256 == 0);
  c.ws = alloc(f, TDM_MEM_DEVICE, c.ws_bytes);
  CHECK_OK(tdm_queue_sync(f->q));
  return c;
}

static void expert_teardown(expert_case *c) {
  tdm_free(c->x); tdm_free(c->w); tdm_free(c->rows); tdm_free(c->slot); tdm_free(c->dx);
  tdm_free(c->dw); tdm_free(c->drows); tdm_free(c->dslot); tdm_free(c->dout); tdm_free(c->ws);
}

/* Fills the device output with the sentinel, runs the expert on (q, st), reads the result. */
static void expert_run(fixture *f, tdm_queue *q, void *st, expert_case *c, void *ws,
                       float *result) {
  size_t rows = (size_t)c->T * c->k * c->H;
  for (size_t i = 0; i < rows; i++) result[i] = SENTINEL;
  CHECK_OK(tdm_memcpy(q, c->dout, result, rows * sizeof *result, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(f->ops->expert(st, q, c->dx, c->drows, c->dslot, c->n, c->dw, c->H, c->I, c->dout,
                          ws, c->ws_bytes));
  CHECK_OK(tdm_memcpy(q, result, c->dout, rows * sizeof *result, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(q));
}

/* Compares every token's row of got (the output of c's expert) with ref_expert; rows no slot
 * names must still hold the sentinel. */
static double compare_expert(expert_case *c, const float *got, const char *what) {
  const int H = c->H, I = c->I;
  double *h = malloc(I * sizeof *h), *ref = malloc(H * sizeof *ref);
  char *written = calloc((size_t)c->T * c->k, 1);
  CHECK(h && ref && written);
  errsum e = {0};
  for (int i = 0; i < c->n; i++) {
    ref_expert(c->x + (size_t)c->rows[i] * H, c->w, H, I, h, ref);
    written[c->slot[i]] = 1;
    for (int j = 0; j < H; j++)
      err_add(&e, "out", (size_t)c->slot[i] * H + j, got[(size_t)c->slot[i] * H + j], ref[j]);
  }
  double rel = err_check(&e, what);
  for (int s = 0; s < c->T * c->k; s++)
    if (!written[s])
      for (int j = 0; j < H; j++)
        CHECK_MSG(got[(size_t)s * H + j] == SENTINEL, "out[%d][%d] written", s, j);
  free(h); free(ref); free(written);
  return rel;
}

/* Runs the expert of c and compares its output with the reference. */
static void check_expert(fixture *f, expert_case *c, const char *what) {
  float *got = alloc(f, TDM_MEM_PINNED, (size_t)c->T * c->k * c->H * sizeof *got);
  expert_run(f, f->q, f->st, c, c->ws, got);
  compare_expert(c, got, what);
  tdm_free(got);
}

TEST_CASE(expert_ref) {
  enum { T = 50, H = 160, I = 272, N = 37, K = 2 };
  fixture f = setup();
  expert_case c = expert_setup(&f, T, H, I, N, K);
  check_expert(&f, &c, "expert");
  expert_teardown(&c);
  teardown(&f);
}

/* The CPU computes an expert of at most this many tokens straight from the bf16 weights
 * (moe/cpu/ops.c, GEMV_MAX_N), and a larger one with sgemm. */
#define CPU_GEMV_MAX_N 8

/* Few tokens (decode), on both sides of the CPU's threshold; other backends run the same
 * sizes. H and I are not multiples of the CPU path's 32 lanes, so the tails are covered too.
 * The CPU's tolerance (REL_TOL, 1e-4) holds with room: each f32 dot product of K <= 300 terms
 * has a relative error of at most about K * 2^-24 = 2e-5 in the worst case (sqrt(K) * 2^-24 =
 * 1e-6 typically) and two of them are chained through silu, while a wrong row, lane or tail in
 * either projection moves the result by order one. */
TEST_CASE(expert_few_tokens) {
  enum { T = 12, H = 300, I = 200, K = 2 };
  const int ns[] = {1, 2, 3, CPU_GEMV_MAX_N, CPU_GEMV_MAX_N + 1};
  fixture f = setup();
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    char what[32];
    snprintf(what, sizeof what, "expert n=%d", ns[i]);
    expert_case c = expert_setup(&f, T, H, I, ns[i], K);
    check_expert(&f, &c, what);
    expert_teardown(&c);
  }
  teardown(&f);
}

/* The CPU table splits a few-token expert's weight rows between a pool of threads
 * (moe/cpu/pool.c, sized by TANDEM_MOE_CPU_THREADS when the first CPU op state starts it): a
 * row is computed whole by one thread, so the output must be bitwise the same with no pool
 * (1), the default (the cores) and more threads than cores (5). Shapes large enough to be
 * split into many chunks; every run against the fp64 reference too. Other tables have no
 * pool: skipped. */
TEST_CASE(expert_threads_agree) {
  enum { T = 12, H = 512, I = 384, K = 2 };
  static const char *const sizes[] = {"1", "5"};
  const int ns[] = {1, 3, CPU_GEMV_MAX_N};
  fixture f = setup();
  if (strcmp(f.ops->name, "cpu") != 0) {
    teardown(&f);
    TH_SKIP("only the CPU table splits experts between threads");
  }
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    expert_case c = expert_setup(&f, T, H, I, ns[i], K);
    const size_t bytes = (size_t)T * K * H * sizeof(float);
    float *base = alloc(&f, TDM_MEM_PINNED, bytes), *got = alloc(&f, TDM_MEM_PINNED, bytes);
    char what[48];
    snprintf(what, sizeof what, "expert n=%d, default pool", ns[i]);
    expert_run(&f, f.q, f.st, &c, c.ws, base);
    compare_expert(&c, base, what);
    /* The fixture's state is the only CPU state: closing it stops the pool, and the next
     * open starts one of the size the variable now says. */
    f.ops->close(f.st);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      CHECK(setenv("TANDEM_MOE_CPU_THREADS", sizes[s], 1) == 0);
      CHECK_OK(f.ops->open(f.q, &f.st));
      expert_run(&f, f.q, f.st, &c, c.ws, got);
      f.ops->close(f.st);
      CHECK_MSG(memcmp(got, base, bytes) == 0, "expert n=%d: %s threads differ from the default",
                ns[i], sizes[s]);
    }
    CHECK(unsetenv("TANDEM_MOE_CPU_THREADS") == 0);
    CHECK_OK(f.ops->open(f.q, &f.st));
    tdm_free(base);
    tdm_free(got);
    expert_teardown(&c);
  }
  printf("expert: bitwise equal with 1, the default and 5 pool threads\n");
  teardown(&f);
}

/* Host placement's data path (tandem/moe.h, placement AUTO or HOST): the CPU table's expert()
 * on a queue of cpu:0 reads the device's pinned memory in place (the weights, the token lists,
 * and activations that a device-to-host copy on the device's queue has just written) and
 * writes pinned output that the device's queue then copies in; the two queues are joined by
 * device-side waits both ways. Every token's row against the fp64 reference, at the CPU's
 * tolerance (the CPU computes it whichever device is under test). */
/* The CPU's table opened on a queue of its own: the host of host placement. Skips without. */
typedef struct host_side {
  tdm_device *dev;
  const tdm_moe_ops *ops;
  tdm_queue *q;
  void *st;
} host_side;

static host_side host_open(void) {
  host_side h = {0};
  CHECK_OK(tdm_device_find("cpu:0", &h.dev));
  h.ops = tdm_moe_ops_for(h.dev);
  if (!h.ops) TH_SKIP("no CPU MoE op table: %s", tdm_last_error());
  CHECK_OK(tdm_queue_create(h.dev, TDM_QUEUE_IN_ORDER, &h.q));
  CHECK_OK(h.ops->open(h.q, &h.st));
  return h;
}

static void host_close(host_side *h) {
  h->ops->close(h->st);
  CHECK_OK(tdm_queue_destroy(h->q));
}

TEST_CASE(expert_on_host) {
  enum { T = 12, H = 300, I = 200, K = 2 };
  const int ns[] = {1, 3, CPU_GEMV_MAX_N + 1};
  fixture f = setup();
  host_side hs = host_open();
  const tdm_moe_ops *hops = hs.ops;
  tdm_queue *hq = hs.q;
  void *hst = hs.st;
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    int n = ns[i];
    expert_case c = expert_setup(&f, T, H, I, n, K);
    size_t out_floats = (size_t)T * K * H;
    float *xh = alloc(&f, TDM_MEM_PINNED, (size_t)T * H * sizeof *xh);
    float *outh = alloc(&f, TDM_MEM_PINNED, out_floats * sizeof *outh);
    float *got = alloc(&f, TDM_MEM_PINNED, out_floats * sizeof *got);
    void *hws;
    CHECK_OK(tdm_malloc(hs.dev, TDM_MEM_DEVICE, c.ws_bytes, &hws));
    for (size_t j = 0; j < out_floats; j++) outh[j] = SENTINEL;
    /* The device's whole buffer goes back and forth, so unwritten rows keep the sentinel. */
    CHECK_OK(tdm_memcpy(f.q, c.dout, outh, out_floats * sizeof *outh, TDM_COPY_H2D, 0, NULL,
                        NULL));
    tdm_event *x_ready, *host_done;
    CHECK_OK(tdm_memcpy(f.q, xh, c.dx, (size_t)T * H * sizeof *xh, TDM_COPY_D2H, 0, NULL,
                        &x_ready));
    CHECK_OK(tdm_queue_wait(hq, x_ready));
    CHECK_OK(hops->expert(hst, hq, xh, c.rows, c.slot, n, c.w, H, I, outh, hws, c.ws_bytes));
    CHECK_OK(tdm_event_record(hq, &host_done));
    CHECK_OK(tdm_queue_wait(f.q, host_done));
    CHECK_OK(tdm_memcpy(f.q, c.dout, outh, out_floats * sizeof *outh, TDM_COPY_H2D, 0, NULL,
                        NULL));
    CHECK_OK(tdm_memcpy(f.q, got, c.dout, out_floats * sizeof *got, TDM_COPY_D2H, 0, NULL,
                        NULL));
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK_OK(tdm_event_release(x_ready));
    CHECK_OK(tdm_event_release(host_done));
    char what[48];
    snprintf(what, sizeof what, "expert on the host, n=%d", n);
    double rel = compare_expert(&c, got, what);
    CHECK_MSG(rel < 1e-4, "%s: relative error %.3e over the CPU's 1e-4", what, rel);
    CHECK_OK(tdm_free(hws));
    tdm_free(xh);
    tdm_free(outh);
    tdm_free(got);
    expert_teardown(&c);
  }
  host_close(&hs);
  teardown(&f);
}

/* ---- experts: a group of experts in one submission --------------------------------------- */

enum { MAX_G = 24 }; /* entries of a test's table, experts of its routing */

/* Cases of the grouped ops skip, visibly, on a table that does not have them yet. */
static void need_op(const fixture *f, int present, const char *op) {
  if (!present) TH_SKIP("the %s table has no %s() yet", f->ops->name, op);
}

/* G experts' weights in one allocation, each at its own offset (in bf16 elements) in a random
 * order, with random gaps between them: multiples of 8 when `aligned` (given that 3HI is one),
 * else the first gap is odd, so at least one expert starts off the 8-element grid. Gaps hold
 * random values too, so reading past an expert shows. Returns pinned weights of *elems
 * elements and fills offs[G]. */
static tdm_moe_bf16 *place_experts(fixture *f, int G, int H, int I, int aligned, int64_t *offs,
                                   size_t *elems) {
  const size_t hi = (size_t)H * I;
  int32_t order[MAX_G];
  CHECK(G > 0 && G <= MAX_G);
  pick_distinct(f, G, G, order);
  size_t at = 0;
  for (int i = 0; i < G; i++) {
    size_t gap = 8 * th_rand_below(&f->rng, 4);
    if (!aligned) gap += i == 0 ? 1 + 2 * th_rand_below(&f->rng, 4) : th_rand_below(&f->rng, 8);
    offs[order[i]] = (int64_t)(at + gap);
    at += gap + 3 * hi;
  }
  *elems = at + 8;
  tdm_moe_bf16 *w = rnd_bf16(f, *elems, 1.0f);
  /* Scaled as expert_setup does, so that gate, up and the output stay of order one. */
  for (int g = 0; g < G; g++) {
    if (aligned) CHECK(offs[g] % 8 == 0);
    tdm_moe_bf16 *e = w + offs[g];
    for (size_t i = 0; i < 3 * hi; i++) {
      float s = i < 2 * hi ? 2.0f / sqrtf((float)H) : 2.0f / sqrtf((float)I);
      e[i] = tdm_moe_f32_to_bf16(tdm_moe_bf16_to_f32(e[i]) * s);
    }
  }
  if (!aligned) CHECK(offs[order[0]] % 8 != 0);
  return w;
}

/* A grouped problem on the device: G experts in one weight allocation; entry g computes
 * counts[g] distinct tokens of x [T x H] into distinct slots of out [T*k x H]. The entries'
 * token ranges tile [0, n) in a random order, so first does not follow g. */
typedef struct group_case {
  int T, H, I, k, n, G;
  float *x;              /* pinned [T x H] */
  tdm_moe_bf16 *w;       /* pinned, w_elems: expert g at offs[g] */
  size_t w_elems;
  int64_t offs[MAX_G];
  tdm_moe_group *groups; /* pinned [G] */
  int32_t *rows, *slot;  /* pinned [n] */
  float *dx, *dout;      /* device */
  tdm_moe_bf16 *dw;
  tdm_moe_group *dgroups;
  int32_t *drows, *dslot;
  void *ws;
  size_t ws_bytes;
} group_case;

static group_case group_setup(fixture *f, int T, int H, int I, int k, const int *counts, int G,
                              int aligned) {
  group_case c = {.T = T, .H = H, .I = I, .k = k, .G = G};
  CHECK(G > 0 && G <= MAX_G);
  for (int g = 0; g < G; g++) {
    CHECK(counts[g] >= 0 && counts[g] <= T);
    c.n += counts[g];
  }
  CHECK(c.n > 0 && c.n <= T * k);
  c.x = rnd_f32(f, (size_t)T * H, 1.0f);
  c.w = place_experts(f, G, H, I, aligned, c.offs, &c.w_elems);
  c.groups = alloc(f, TDM_MEM_PINNED, (size_t)G * sizeof *c.groups);
  c.rows = alloc(f, TDM_MEM_PINNED, (size_t)c.n * sizeof *c.rows);
  c.slot = alloc(f, TDM_MEM_PINNED, (size_t)c.n * sizeof *c.slot);
  int32_t order[MAX_G];
  pick_distinct(f, G, G, order);
  pick_distinct(f, T * k, c.n, c.slot);
  int first = 0;
  for (int i = 0; i < G; i++) {
    int g = order[i];
    c.groups[g] = (tdm_moe_group){.w = c.offs[g], .first = first, .count = counts[g]};
    pick_distinct(f, T, counts[g], c.rows + first);
    first += counts[g];
  }
  c.dx = upload(f, c.x, (size_t)T * H * sizeof *c.x);
  c.dw = upload(f, c.w, c.w_elems * sizeof *c.w);
  c.dgroups = upload(f, c.groups, (size_t)G * sizeof *c.groups);
  c.drows = upload(f, c.rows, (size_t)c.n * sizeof *c.rows);
  c.dslot = upload(f, c.slot, (size_t)c.n * sizeof *c.slot);
  c.dout = alloc(f, TDM_MEM_DEVICE, (size_t)T * k * H * sizeof *c.dout);
  c.ws_bytes = tdm_moe_ops_workspace(c.n, H, I);
  CHECK(c.ws_bytes > 0);
  c.ws = alloc(f, TDM_MEM_DEVICE, c.ws_bytes);
  CHECK_OK(tdm_queue_sync(f->q));
  return c;
}

static void group_teardown(group_case *c) {
  tdm_free(c->x); tdm_free(c->w); tdm_free(c->groups); tdm_free(c->rows); tdm_free(c->slot);
  tdm_free(c->dx); tdm_free(c->dw); tdm_free(c->dgroups); tdm_free(c->drows);
  tdm_free(c->dslot); tdm_free(c->dout); tdm_free(c->ws);
}

/* out [slots x H] on the device set to the sentinel (`host` is pinned scratch of that size). */
static void fill_sentinel(fixture *f, float *dout, float *host, size_t slots, int H) {
  for (size_t i = 0; i < slots * H; i++) host[i] = SENTINEL;
  CHECK_OK(tdm_memcpy(f->q, dout, host, slots * H * sizeof *host, TDM_COPY_H2D, 0, NULL, NULL));
}

static void experts_call(fixture *f, group_case *c, const tdm_moe_group *dgroups, int G) {
  CHECK_OK(f->ops->experts(f->st, f->q, c->dx, c->drows, c->dslot, c->n, c->dw, dgroups, G,
                           c->H, c->I, c->dout, c->ws, c->ws_bytes));
}

/* The whole table in one call; result [T*k x H] pinned. */
static void experts_run(fixture *f, group_case *c, float *result) {
  size_t slots = (size_t)c->T * c->k;
  fill_sentinel(f, c->dout, result, slots, c->H);
  experts_call(f, c, c->dgroups, c->G);
  download(f, result, c->dout, slots * c->H * sizeof *result);
}

/* Every named slot of `got` against the fp64 reference; every other slot keeps the sentinel. */
static void check_experts(group_case *c, const float *got, const char *what) {
  const int H = c->H, I = c->I;
  double *h = malloc(I * sizeof *h), *ref = malloc(H * sizeof *ref);
  char *written = calloc((size_t)c->T * c->k, 1);
  CHECK(h && ref && written);
  errsum e = {0};
  for (int g = 0; g < c->G; g++)
    for (int i = c->groups[g].first; i < c->groups[g].first + c->groups[g].count; i++) {
      ref_expert(c->x + (size_t)c->rows[i] * H, c->w + c->groups[g].w, H, I, h, ref);
      written[c->slot[i]] = 1;
      for (int j = 0; j < H; j++)
        err_add(&e, "out", (size_t)c->slot[i] * H + j, got[(size_t)c->slot[i] * H + j], ref[j]);
    }
  err_check(&e, what);
  for (int s = 0; s < c->T * c->k; s++)
    if (!written[s])
      for (int j = 0; j < H; j++)
        CHECK_MSG(got[(size_t)s * H + j] == SENTINEL, "%s: out[%d][%d] written", what, s, j);
  free(h); free(ref); free(written);
}

/* Token counts of the grouped cases: experts with no tokens, one, a few, both sides of the
 * CPU's direct-path threshold (CPU_GEMV_MAX_N) and many. */
static const int GROUP_COUNTS[] = {3, 0, CPU_GEMV_MAX_N + 1, 1, 20, 0, CPU_GEMV_MAX_N, 2};
enum { GROUP_G = sizeof GROUP_COUNTS / sizeof GROUP_COUNTS[0] };

TEST_CASE(experts_ref) {
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL, "experts");
  /* H and I off the 8 grid with offsets off it too, then both on it. */
  const struct { int H, I, aligned; } shapes[] = {{300, 200, 0}, {256, 128, 1}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    enum { T = 24, K = 4 };
    char what[64];
    snprintf(what, sizeof what, "experts H=%d I=%d aligned=%d", shapes[s].H, shapes[s].I,
             shapes[s].aligned);
    group_case c = group_setup(&f, T, shapes[s].H, shapes[s].I, K, GROUP_COUNTS, GROUP_G,
                               shapes[s].aligned);
    float *got = alloc(&f, TDM_MEM_PINNED, (size_t)T * K * c.H * sizeof *got);
    experts_run(&f, &c, got);
    check_experts(&c, got, what);
    tdm_free(got);
    group_teardown(&c);
  }
  teardown(&f);
}

/* Token counts all on the CPU's direct path, for more entries than the CPU table fuses into
 * one pair of passes (16): its fused path, batch after batch. */
static const int FEW_COUNTS[] = {1, 2, 0, 1, CPU_GEMV_MAX_N, 1, 3, 1, 1, 2, 0, 1, 1, 4,
                                 1, 1, 2, 1, 1, 1, 5, 1};
enum { FEW_G = sizeof FEW_COUNTS / sizeof FEW_COUNTS[0] };

/* The same problem as one call of G entries, as G calls of one entry, and with the table
 * reversed: bitwise equal, since an expert's output may not depend on the other entries. Once
 * with the mixed counts, once with every entry on few tokens (FEW_COUNTS). */
static void experts_split_counts(const int *counts, int G, int T);
TEST_CASE(experts_split) {
  experts_split_counts(GROUP_COUNTS, GROUP_G, 24);
  experts_split_counts(FEW_COUNTS, FEW_G, 10);
}

static void experts_split_counts(const int *counts, int G, int T) {
  enum { H = 300, I = 200, K = 4 };
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL, "experts");
  group_case c = group_setup(&f, T, H, I, K, counts, G, 0);
  const size_t slots = (size_t)T * K, bytes = slots * H * sizeof(float);
  float *whole = alloc(&f, TDM_MEM_PINNED, bytes), *one = alloc(&f, TDM_MEM_PINNED, bytes);
  float *reversed = alloc(&f, TDM_MEM_PINNED, bytes);

  experts_run(&f, &c, whole);
  check_experts(&c, whole, "experts, whole table");

  fill_sentinel(&f, c.dout, one, slots, H);
  for (int g = 0; g < c.G; g++) experts_call(&f, &c, c.dgroups + g, 1);
  download(&f, one, c.dout, bytes);
  CHECK_MEM_EQ(one, whole, bytes);

  tdm_moe_group *rev = alloc(&f, TDM_MEM_PINNED, (size_t)c.G * sizeof *rev);
  for (int g = 0; g < c.G; g++) rev[g] = c.groups[c.G - 1 - g];
  tdm_moe_group *drev = upload(&f, rev, (size_t)c.G * sizeof *rev);
  fill_sentinel(&f, c.dout, reversed, slots, H);
  experts_call(&f, &c, drev, c.G);
  download(&f, reversed, c.dout, bytes);
  CHECK_MEM_EQ(reversed, whole, bytes);
  printf("experts: whole table, %d one-entry calls and the table reversed are bitwise equal\n",
         c.G);

  tdm_free(whole); tdm_free(one); tdm_free(reversed); tdm_free(rev); tdm_free(drev);
  group_teardown(&c);
  teardown(&f);
}

/* experts() against expert() on each entry's expert and tokens: within REL_TOL of each other,
 * not bitwise (a GPU may compute the grouped path in more precision). */
TEST_CASE(experts_match_expert) {
  enum { T = 24, H = 300, I = 200, K = 4 };
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL, "experts");
  group_case c = group_setup(&f, T, H, I, K, GROUP_COUNTS, GROUP_G, 0);
  const size_t slots = (size_t)T * K, bytes = slots * H * sizeof(float);
  float *grouped = alloc(&f, TDM_MEM_PINNED, bytes), *single = alloc(&f, TDM_MEM_PINNED, bytes);

  experts_run(&f, &c, grouped);
  fill_sentinel(&f, c.dout, single, slots, H);
  for (int g = 0; g < c.G; g++) {
    const tdm_moe_group *e = &c.groups[g];
    if (e->count == 0) continue;
    CHECK_OK(f.ops->expert(f.st, f.q, c.dx, c.drows + e->first, c.dslot + e->first, e->count,
                           c.dw + e->w, H, I, c.dout, c.ws, c.ws_bytes));
  }
  download(&f, single, c.dout, bytes);

  errsum e = {0};
  for (size_t i = 0; i < slots * H; i++) {
    if (single[i] == SENTINEL) {
      CHECK_MSG(grouped[i] == SENTINEL, "out[%zu][%zu] written by experts() only", i / H, i % H);
      continue;
    }
    err_add(&e, "out", i, grouped[i], single[i]);
  }
  err_check(&e, "experts() against expert()");

  tdm_free(grouped); tdm_free(single);
  group_teardown(&c);
  teardown(&f);
}

/* The CUDA table's two shapes of the grouped kernels (narrow: two tokens a pass; wide: four),
 * forced by TANDEM_MOE_CUDA_GROUPED when an op state is opened, give the same bits, on entries
 * of one token up to many, with weights on and off the 16-byte grid. Other tables ignore the
 * variable: there the case checks that two op states agree bitwise. */
TEST_CASE(experts_shapes_agree) {
  enum { T = 24, K = 4 };
  static const char *const shape[2] = {"narrow", "wide"};
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL, "experts");
  const struct { int H, I, aligned; } dims[] = {{256, 128, 1}, {300, 200, 0}};
  for (size_t d = 0; d < sizeof dims / sizeof dims[0]; d++) {
    group_case c = group_setup(&f, T, dims[d].H, dims[d].I, K, GROUP_COUNTS, GROUP_G,
                               dims[d].aligned);
    const size_t slots = (size_t)T * K, bytes = slots * c.H * sizeof(float);
    float *got[2];
    for (int s = 0; s < 2; s++) {
      char what[64];
      snprintf(what, sizeof what, "experts, %s kernels, H=%d I=%d", shape[s], c.H, c.I);
      CHECK(setenv("TANDEM_MOE_CUDA_GROUPED", shape[s], 1) == 0);
      void *st = NULL;
      CHECK_OK(f.ops->open(f.q, &st));
      got[s] = alloc(&f, TDM_MEM_PINNED, bytes);
      fill_sentinel(&f, c.dout, got[s], slots, c.H);
      CHECK_OK(f.ops->experts(st, f.q, c.dx, c.drows, c.dslot, c.n, c.dw, c.dgroups, c.G, c.H,
                              c.I, c.dout, c.ws, c.ws_bytes));
      download(&f, got[s], c.dout, bytes);
      f.ops->close(st);
      check_experts(&c, got[s], what);
    }
    CHECK(unsetenv("TANDEM_MOE_CUDA_GROUPED") == 0);
    CHECK_MEM_EQ(got[0], got[1], bytes);
    tdm_free(got[0]);
    tdm_free(got[1]);
    group_teardown(&c);
  }
  printf("experts: the narrow and wide kernels' outputs are bitwise equal\n");
  teardown(&f);
}

/* ---- group: the routing grouped on the device --------------------------------------------- */

/* What group() must write, by a different method than a counting sort: for each expert in
 * ascending order, a scan of idx in ascending t*k + j. Returns the routed entries in *routed
 * and the number of routed experts. */
static int ref_group(const int32_t *idx, int T, int k, int E, const int64_t *wofs, int32_t *rows,
                     int32_t *slot, tdm_moe_group *groups, int *routed) {
  int at = 0, ng = 0;
  for (int e = 0; e < E; e++) {
    int first = at;
    for (int p = 0; p < T * k; p++)
      if (idx[p] == e) {
        rows[at] = p / k;
        slot[at] = p;
        at++;
      }
    if (at > first) groups[ng++] = (tdm_moe_group){.w = wofs[e], .first = first,
                                                   .count = at - first};
  }
  *routed = at;
  return ng;
}

/* Random routing as the router gives it: each token's k experts distinct. */
static void rnd_routing(fixture *f, int T, int k, int E, int32_t *idx) {
  for (int t = 0; t < T; t++) pick_distinct(f, E, k, idx + (size_t)t * k);
}

/* Runs group() on idx (pinned, T*k) and checks rows, slot and groups against ref_group. */
static void check_group(fixture *f, const int32_t *idx, int T, int k, int E, const int64_t *wofs,
                        const int64_t *dwofs, const char *what) {
  const int n = T * k, G = n < E ? n : E;
  int32_t *didx = upload(f, idx, (size_t)n * sizeof *idx);
  int32_t *rows = alloc(f, TDM_MEM_PINNED, (size_t)n * sizeof *rows);
  int32_t *slot = alloc(f, TDM_MEM_PINNED, (size_t)n * sizeof *slot);
  tdm_moe_group *groups = alloc(f, TDM_MEM_PINNED, (size_t)G * sizeof *groups);
  int32_t *drows = alloc(f, TDM_MEM_DEVICE, (size_t)n * sizeof *drows);
  int32_t *dslot = alloc(f, TDM_MEM_DEVICE, (size_t)n * sizeof *dslot);
  tdm_moe_group *dgroups = alloc(f, TDM_MEM_DEVICE, (size_t)G * sizeof *dgroups);
  int32_t *rrows = malloc((size_t)n * sizeof *rrows), *rslot = malloc((size_t)n * sizeof *rslot);
  tdm_moe_group *rgroups = malloc((size_t)G * sizeof *rgroups);
  CHECK(rrows && rslot && rgroups);
  /* Outputs start as 0x5a bytes, so that an entry left unwritten cannot pass for a count 0. */
  CHECK_OK(tdm_memset(f->q, dgroups, 0x5a, (size_t)G * sizeof *dgroups, 0, NULL, NULL));
  CHECK_OK(tdm_memset(f->q, drows, 0x5a, (size_t)n * sizeof *drows, 0, NULL, NULL));
  CHECK_OK(tdm_memset(f->q, dslot, 0x5a, (size_t)n * sizeof *dslot, 0, NULL, NULL));

  CHECK_OK(f->ops->group(f->st, f->q, didx, T, k, E, dwofs, drows, dslot, dgroups));
  download(f, rows, drows, (size_t)n * sizeof *rows);
  download(f, slot, dslot, (size_t)n * sizeof *slot);
  download(f, groups, dgroups, (size_t)G * sizeof *groups);

  int routed = 0, ng = ref_group(idx, T, k, E, wofs, rrows, rslot, rgroups, &routed);
  for (int i = 0; i < routed; i++) {
    CHECK_MSG(rows[i] == rrows[i] && slot[i] == rslot[i],
              "%s: entry %d is row %d slot %d, reference row %d slot %d", what, i, rows[i],
              slot[i], rrows[i], rslot[i]);
  }
  for (int g = 0; g < G; g++) {
    const tdm_moe_group *got = &groups[g];
    if (g >= ng) {
      CHECK_MSG(got->count == 0, "%s: groups[%d].count = %d past the %d routed experts", what,
                g, got->count, ng);
      continue;
    }
    CHECK_MSG(got->w == rgroups[g].w && got->first == rgroups[g].first &&
                  got->count == rgroups[g].count,
              "%s: groups[%d] = {%lld, %d, %d}, reference {%lld, %d, %d}", what, g,
              (long long)got->w, got->first, got->count, (long long)rgroups[g].w,
              rgroups[g].first, rgroups[g].count);
  }
  printf("%s: T=%d k=%d E=%d, %d entries in %d routed experts\n", what, T, k, E, routed, ng);

  free(rrows); free(rslot); free(rgroups);
  tdm_free(didx); tdm_free(rows); tdm_free(slot); tdm_free(groups); tdm_free(drows);
  tdm_free(dslot); tdm_free(dgroups);
}

/* E = 16 has more entries than experts at 40 tokens; E = 600 fewer, and more experts than a
 * block has threads (several to a thread where the table splits them); at 600 tokens a
 * prefill's table, staged in shared memory on the CUDA table, and at 4200 more entries than
 * it stages (16384). */
TEST_CASE(group_ref) {
  enum { K = 4 };
  const int Es[] = {16, 600};
  const int Ts[] = {1, 5, 40, 600, 4200};
  fixture f = setup();
  need_op(&f, f.ops->group != NULL, "group");
  for (size_t ei = 0; ei < sizeof Es / sizeof Es[0]; ei++) {
    const int E = Es[ei];
    /* Offsets past 2^32 elements: w must stay 64-bit all the way. */
    int64_t *wofs = alloc(&f, TDM_MEM_PINNED, (size_t)E * sizeof *wofs);
    for (int e = 0; e < E; e++)
      wofs[e] = (int64_t)(th_rand(&f.rng) >> 24) + (e % 3 == 0 ? (int64_t)1 << 33 : 0);
    int64_t *dwofs = upload(&f, wofs, (size_t)E * sizeof *wofs);
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
      const int T = Ts[i];
      int32_t *idx = alloc(&f, TDM_MEM_PINNED, (size_t)T * K * sizeof *idx);
      rnd_routing(&f, T, K, E, idx);
      check_group(&f, idx, T, K, E, wofs, dwofs, "group");
      /* Indices out of [0, E) are dropped; the rest is as without them. */
      int32_t at[2];
      pick_distinct(&f, T * K, 2, at);
      idx[at[0]] = E;
      idx[at[1]] = -1;
      check_group(&f, idx, T, K, E, wofs, dwofs, "group, indices dropped");
      tdm_free(idx);
    }
    tdm_free(wofs);
    tdm_free(dwofs);
  }
  teardown(&f);
}

/* group() feeding experts() with no host round trip: every slot t*k + j holds expert
 * idx[t*k + j] on token t, by the fp64 reference; a dropped index's slot is not written. */
static int slow_task(void *arg) {
  (void)arg;
  th_sleep_ms(50);
  return 0;
}

TEST_CASE(group_then_experts) {
  enum { E = 16, K = 4, H = 300, I = 200 };
  const int Ts[] = {5, 40};
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL && f.ops->group != NULL, "experts and group");
  int64_t *wofs = alloc(&f, TDM_MEM_PINNED, E * sizeof *wofs);
  size_t w_elems = 0;
  tdm_moe_bf16 *w = place_experts(&f, E, H, I, 0, wofs, &w_elems);
  tdm_moe_bf16 *dw = upload(&f, w, w_elems * sizeof *w);
  int64_t *dwofs = upload(&f, wofs, E * sizeof *wofs);
  double *h = malloc(I * sizeof *h), *ref = malloc(H * sizeof *ref);
  CHECK(h && ref);
  for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
    const int T = Ts[i], n = T * K, G = n < E ? n : E;
    float *x = rnd_f32(&f, (size_t)T * H, 1.0f);
    int32_t *idx = alloc(&f, TDM_MEM_PINNED, (size_t)n * sizeof *idx);
    rnd_routing(&f, T, K, E, idx);
    const int dropped = (int)th_rand_below(&f.rng, (uint64_t)n);
    idx[dropped] = E + 3;
    float *got = alloc(&f, TDM_MEM_PINNED, (size_t)n * H * sizeof *got);
    float *dx = upload(&f, x, (size_t)T * H * sizeof *x);
    int32_t *didx = upload(&f, idx, (size_t)n * sizeof *idx);
    int32_t *drows = alloc(&f, TDM_MEM_DEVICE, (size_t)n * sizeof *drows);
    int32_t *dslot = alloc(&f, TDM_MEM_DEVICE, (size_t)n * sizeof *dslot);
    tdm_moe_group *dgroups = alloc(&f, TDM_MEM_DEVICE, (size_t)G * sizeof *dgroups);
    float *dout = alloc(&f, TDM_MEM_DEVICE, (size_t)n * H * sizeof *dout);
    size_t ws_bytes = tdm_moe_ops_workspace(n, H, I);
    void *ws = alloc(&f, TDM_MEM_DEVICE, ws_bytes);
    fill_sentinel(&f, dout, got, (size_t)n, H);

    CHECK_OK(f.ops->group(f.st, f.q, didx, T, K, E, dwofs, drows, dslot, dgroups));
    CHECK_OK(f.ops->experts(f.st, f.q, dx, drows, dslot, n, dw, dgroups, G, H, I, dout, ws,
                            ws_bytes));
    download(&f, got, dout, (size_t)n * H * sizeof *got);

    errsum e = {0};
    for (int s = 0; s < n; s++) {
      const float *o = got + (size_t)s * H;
      if (s == dropped) {
        for (int j = 0; j < H; j++)
          CHECK_MSG(o[j] == SENTINEL, "dropped slot %d: out[%d] written", s, j);
        continue;
      }
      ref_expert(x + (size_t)(s / K) * H, w + wofs[idx[s]], H, I, h, ref);
      for (int j = 0; j < H; j++) err_add(&e, "out", (size_t)s * H + j, o[j], ref[j]);
    }
    char what[64];
    snprintf(what, sizeof what, "group then experts, T=%d", T);
    err_check(&e, what);

    /* Again behind a slow host task, with the routing copied in after it and the old table
     * wiped: group() and experts() wait for both (a driver that gates host work on the host,
     * as PoCL's basic one does, holds them back), and give the same bits. */
    float *again = alloc(&f, TDM_MEM_PINNED, (size_t)n * H * sizeof *again);
    fill_sentinel(&f, dout, again, (size_t)n, H);
    CHECK_OK(tdm_memset(f.q, dgroups, 0, (size_t)G * sizeof *dgroups, 0, NULL, NULL));
    CHECK_OK(tdm_host_task(f.q, slow_task, NULL, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(f.q, didx, idx, (size_t)n * sizeof *idx, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(f.ops->group(f.st, f.q, didx, T, K, E, dwofs, drows, dslot, dgroups));
    CHECK_OK(f.ops->experts(f.st, f.q, dx, drows, dslot, n, dw, dgroups, G, H, I, dout, ws,
                            ws_bytes));
    download(&f, again, dout, (size_t)n * H * sizeof *again);
    CHECK_MEM_EQ(again, got, (size_t)n * H * sizeof *got);
    tdm_free(again);

    tdm_free(x); tdm_free(idx); tdm_free(got); tdm_free(dx); tdm_free(didx); tdm_free(drows);
    tdm_free(dslot); tdm_free(dgroups); tdm_free(dout); tdm_free(ws);
  }
  free(h); free(ref);
  tdm_free(w); tdm_free(dw); tdm_free(wofs); tdm_free(dwofs);
  teardown(&f);
}

/* ---- host_call: a layer's host-placed experts in the device's stream order --------------- */

typedef struct after_pass {
  const tdm_moe_host_pass *p;
  long runs_seen;
} after_pass;

static int note_runs(void *arg) {
  after_pass *a = arg;
  a->runs_seen = a->p->runs;
  return 0;
}

/* As a device would run a layer whose experts e % 3 == 0 the host computes: x goes to pinned
 * memory (a copy on the device's queue), the pass runs as the queue's host call behind a slow
 * host task, the host's slots come back to the device and are read from there. Those slots
 * hold their expert's output by the fp64 reference, every other slot keeps the sentinel; a
 * second call gives the same bits, work after a call sees it done, and a pass that fails
 * (T = 0) records its error without failing the queue. Tables without host_call skip. */
TEST_CASE(host_pass) {
  enum { E = 12, K = 4, H = 96, I = 64, T = 3, N = T * K, G = N < E ? N : E };
  fixture f = setup();
  if (!f.ops->host_call) TH_SKIP("the %s table has no host_call()", f.ops->name);
  host_side hs = host_open();
  const tdm_moe_ops *hops = hs.ops;
  tdm_queue *hq = hs.q;
  void *hst = hs.st;

  int64_t *wofs = alloc(&f, TDM_MEM_PINNED, E * sizeof *wofs);
  size_t w_elems = 0;
  tdm_moe_bf16 *w = place_experts(&f, E, H, I, 0, wofs, &w_elems);
  float *x = rnd_f32(&f, (size_t)T * H, 1.0f);
  int32_t *idx = alloc(&f, TDM_MEM_PINNED, N * sizeof *idx);
  int32_t *hidx = alloc(&f, TDM_MEM_PINNED, N * sizeof *hidx);
  rnd_routing(&f, T, K, E, idx);
  idx[0] = 0; /* at least one host expert */
  int host_slots = 0;
  for (int s = 0; s < N; s++) {
    hidx[s] = idx[s] % 3 == 0 ? idx[s] : -1;
    host_slots += hidx[s] >= 0;
  }
  CHECK(host_slots > 0 && host_slots < N);
  float *dx = upload(&f, x, (size_t)T * H * sizeof *x);
  float *dout = alloc(&f, TDM_MEM_DEVICE, (size_t)N * H * sizeof *dout);
  float *xh = alloc(&f, TDM_MEM_PINNED, (size_t)T * H * sizeof *xh);
  float *outh = alloc(&f, TDM_MEM_PINNED, (size_t)N * H * sizeof *outh);
  float *got = alloc(&f, TDM_MEM_PINNED, (size_t)N * H * sizeof *got);
  float *again = alloc(&f, TDM_MEM_PINNED, (size_t)N * H * sizeof *again);
  size_t ws_bytes = tdm_moe_ops_workspace(N, H, I);
  tdm_moe_host_pass p = {.ops = hops, .st = hst, .q = hq, .x = xh, .idx = hidx, .T = T,
                         .k = K, .E = E, .H = H, .I = I, .wofs = wofs, .wbase = w,
                         .rows = malloc(N * sizeof(int32_t)), .slot = malloc(N * sizeof(int32_t)),
                         .groups = malloc(G * sizeof(tdm_moe_group)), .out = outh,
                         .workspace = malloc(ws_bytes), .workspace_bytes = ws_bytes};
  CHECK(p.rows && p.slot && p.groups && p.workspace);

  for (int round = 0; round < 2; round++) {
    float *result = round ? again : got;
    for (size_t i = 0; i < (size_t)N * H; i++) outh[i] = SENTINEL;
    CHECK_OK(tdm_memset(f.q, xh, 0, (size_t)T * H * sizeof *xh, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(f.q));
    after_pass seen = {.p = &p, .runs_seen = -1};
    CHECK_OK(tdm_host_task(f.q, slow_task, NULL, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(f.q, xh, dx, (size_t)T * H * sizeof *xh, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(f.ops->host_call(f.st, f.q, tdm_moe_host_pass_run, &p));
    CHECK_OK(tdm_host_task(f.q, note_runs, &seen, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(f.q, dout, outh, (size_t)N * H * sizeof *outh, TDM_COPY_H2D, 0, NULL,
                        NULL));
    download(&f, result, dout, (size_t)N * H * sizeof *result);
    CHECK_MSG(p.status == 0, "the pass failed: %s", p.failure);
    CHECK(p.runs == round + 1 && seen.runs_seen == round + 1);
  }
  errsum e = {0};
  double *h = malloc(I * sizeof *h), *ref = malloc(H * sizeof *ref);
  CHECK(h && ref);
  for (int s = 0; s < N; s++) {
    const float *o = got + (size_t)s * H;
    if (hidx[s] < 0) {
      for (int j = 0; j < H; j++)
        CHECK_MSG(o[j] == SENTINEL, "slot %d (the device's expert %d): out[%d] written", s,
                  idx[s], j);
      continue;
    }
    ref_expert(x + (size_t)(s / K) * H, w + wofs[hidx[s]], H, I, h, ref);
    for (int j = 0; j < H; j++) err_add(&e, "host out", (size_t)s * H + j, o[j], ref[j]);
  }
  double rel = err_check(&e, "host pass");
  CHECK_MSG(rel < 1e-4, "host pass: relative error %.3e over the CPU's 1e-4", rel);
  CHECK_MEM_EQ(again, got, (size_t)N * H * sizeof *got);
  printf("host pass: %d of %d slots on the host\n", host_slots, N);

  /* Recorded into a graph (tables that record them): not run while recorded, run by each
   * launch, the same bits. */
  if (f.ops->graph_begin) {
    void *g = NULL;
    for (size_t i = 0; i < (size_t)N * H; i++) outh[i] = SENTINEL;
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK_OK(f.ops->graph_begin(f.st, f.q));
    CHECK_OK(f.ops->host_call(f.st, f.q, tdm_moe_host_pass_run, &p));
    CHECK_OK(f.ops->graph_end(f.st, f.q, &g));
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK(p.runs == 2);
    for (int launch = 0; launch < 2; launch++) CHECK_OK(f.ops->graph_launch(f.st, f.q, g));
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK_MSG(p.runs == 4 && p.status == 0, "runs %ld, status %d", p.runs, p.status);
    for (int s = 0; s < N; s++)
      if (hidx[s] >= 0)
        CHECK_MEM_EQ(outh + (size_t)s * H, got + (size_t)s * H, H * sizeof *outh);
    f.ops->graph_free(f.st, g);
  }

  /* A routing that gives the host nothing: counted, nothing written. */
  for (int s = 0; s < N; s++) hidx[s] = -1;
  for (size_t i = 0; i < (size_t)N * H; i++) outh[i] = SENTINEL;
  long before = p.runs;
  CHECK_OK(f.ops->host_call(f.st, f.q, tdm_moe_host_pass_run, &p));
  CHECK_OK(tdm_queue_sync(f.q));
  CHECK(p.runs == before + 1 && p.status == 0);
  for (size_t i = 0; i < (size_t)N * H; i++) CHECK_MSG(outh[i] == SENTINEL, "out[%zu]", i);

  /* A pass that cannot run records why; the queue goes on. */
  tdm_moe_host_pass bad = p;
  bad.T = 0, bad.runs = 0, bad.status = 0;
  CHECK_OK(f.ops->host_call(f.st, f.q, tdm_moe_host_pass_run, &bad));
  CHECK_OK(tdm_queue_sync(f.q));
  CHECK(bad.runs == 1 && bad.status == TDM_EINVAL && strstr(bad.failure, "T 0") != NULL);
  bad = p;
  bad.ops = f.ops, bad.runs = 0, bad.status = 0;
  if (strcmp(f.ops->name, "cpu") != 0) {
    CHECK_OK(f.ops->host_call(f.st, f.q, tdm_moe_host_pass_run, &bad));
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK(bad.runs == 1 && bad.status == TDM_EINVAL);
  }
  CHECK_RC(f.ops->host_call(f.st, f.q, NULL, &p), TDM_EINVAL);
  CHECK_RC(f.ops->host_call(f.st, hq, tdm_moe_host_pass_run, &p), TDM_EINVAL);

  free(h); free(ref); free(p.rows); free(p.slot); free(p.groups); free(p.workspace);
  tdm_free(wofs); tdm_free(w); tdm_free(x); tdm_free(idx); tdm_free(hidx); tdm_free(dx);
  tdm_free(dout); tdm_free(xh); tdm_free(outh); tdm_free(got); tdm_free(again);
  host_close(&hs);
  teardown(&f);
}

/* ---- Grouped ops: arguments and device data ---------------------------------------------- */

TEST_CASE(grouped_bad_args) {
  enum { T = 6, H = 16, I = 24, K = 2, E = 4 };
  const int counts[] = {2, 3};
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL && f.ops->group != NULL, "experts and group");
  const tdm_moe_ops *o = f.ops;
  group_case c = group_setup(&f, T, H, I, K, counts, 2, 1);
  int32_t *didx = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(int32_t));
  int64_t *dwofs = alloc(&f, TDM_MEM_DEVICE, E * sizeof(int64_t));
  int32_t *ibuf = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(int32_t));
  tdm_moe_group *gbuf = alloc(&f, TDM_MEM_DEVICE, E * sizeof(tdm_moe_group));
  const int n = c.n;

  /* experts(): workspace too small or missing, NULL pointers, negative sizes. */
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes - 1), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      NULL, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, NULL, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, NULL, c.dslot, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, NULL, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, NULL, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, NULL, 2, H, I, c.dout, c.ws,
                      c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, I, NULL,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, -1, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, -1, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, 0, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, 0, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);

  /* group(): NULL pointers, sizes out of range, T*k past int32. */
  CHECK_RC(o->group(f.st, f.q, NULL, T, K, E, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, K, E, NULL, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, K, E, dwofs, NULL, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, K, E, dwofs, ibuf, NULL, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, K, E, dwofs, ibuf, ibuf, NULL), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, -1, K, E, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, 0, E, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, T, K, 0, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_RC(o->group(f.st, f.q, didx, 1 << 30, 4, E, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);

  /* The state of another queue. */
  tdm_queue *q2 = NULL;
  CHECK_OK(tdm_queue_create(f.dev, TDM_QUEUE_IN_ORDER, &q2));
  CHECK_RC(o->experts(f.st, q2, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 2, H, I, c.dout,
                      c.ws, c.ws_bytes), TDM_EINVAL);
  CHECK_RC(o->group(f.st, q2, didx, T, K, E, dwofs, ibuf, ibuf, gbuf), TDM_EINVAL);
  CHECK_OK(tdm_queue_destroy(q2));

  /* Nothing to do is not an error, and needs no workspace. */
  CHECK_OK(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, n, c.dw, c.dgroups, 0, H, I, c.dout,
                      NULL, 0));
  CHECK_OK(o->experts(f.st, f.q, c.dx, c.drows, c.dslot, 0, c.dw, c.dgroups, 2, H, I, c.dout,
                      NULL, 0));
  CHECK_OK(o->group(f.st, f.q, didx, 0, K, E, dwofs, ibuf, ibuf, gbuf));
  CHECK_OK(tdm_queue_sync(f.q));

  /* The queue still computes. */
  float *got = alloc(&f, TDM_MEM_PINNED, (size_t)T * K * H * sizeof *got);
  experts_run(&f, &c, got);
  check_experts(&c, got, "experts after bad arguments");

  tdm_free(got); tdm_free(didx); tdm_free(dwofs); tdm_free(ibuf); tdm_free(gbuf);
  group_teardown(&c);
  teardown(&f);
}

/* Bad device data for experts(). Token positions run from -1 to n (rows and slot are passed
 * one entry into arrays of n + 2), and x and out one row into their allocations, so that every
 * index a wrong implementation could follow is readable and names a slot of its own:
 *   positions 0-2, 3-4   two good entries, and a third of count 0 whose first and w are
 *                        garbage (count 0: they are not read);
 *   5-6                  an entry whose second row is -1 (x's row -1 exists, but is outside);
 *   7-8                  an entry whose second slot is -1 (out's row -1 likewise);
 *   9                    an entry whose weights end one element past wbase's allocation;
 *   10                   an entry whose weights start 8 elements before it;
 *   11-12                an entry with first + count = n + 1;
 *   -1                   an entry with first = -1;
 *   (none)               an entry with count = -1.
 * On a GPU, one call with all of them: the good entries and the good tokens of the entries
 * with a bad token (positions 5 and 7) are right, and every other row of out's allocation
 * keeps the sentinel. On the CPU each bad entry, with the good ones, fails the sync with
 * TDM_ERANGE and writes nothing; the good entries then run on the same queue. */
enum { DD_T = 8, DD_H = 44, DD_I = 20, DD_K = 2, DD_N = 12, DD_SLOTS = DD_T * DD_K };

typedef struct dd_case {
  int64_t offs[2];
  size_t w_elems;
  tdm_moe_bf16 *w, *dw;
  float *x, *dx;          /* x: T + 1 rows, passed from row 1 */
  int32_t *rows, *slot;   /* pinned, N + 2 entries: position p at index p + 1 */
  int32_t *drows, *dslot;
  tdm_moe_group *table, *dtable;
  float *got, *dout;      /* out: SLOTS + 1 rows, passed from row 1 */
  void *ws;
  size_t ws_bytes;
} dd_case;

/* Runs the first `ntable` entries of c->table; returns the sync's code, the whole of out's
 * allocation in c->got. */
static int dd_run(fixture *f, dd_case *c, int ntable) {
  const size_t out_bytes = (DD_SLOTS + 1) * DD_H * sizeof(float);
  fill_sentinel(f, c->dout, c->got, DD_SLOTS + 1, DD_H);
  CHECK_OK(tdm_memcpy(f->q, c->dtable, c->table, (size_t)ntable * sizeof *c->table,
                      TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(f->ops->experts(f->st, f->q, c->dx + DD_H, c->drows + 1, c->dslot + 1, DD_N, c->dw,
                           c->dtable, ntable, DD_H, DD_I, c->dout + DD_H, c->ws, c->ws_bytes));
  int rc = TH_CALL(tdm_queue_sync(f->q));
  if (rc) printf("the sync says %s\n", tdm_last_error());
  CHECK_OK(tdm_memcpy(f->q, c->got, c->dout, out_bytes, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(f->q));
  return rc;
}

/* The tokens at positions pos[i] (computed with the expert at offset wofs[i]) are right in
 * c->got; every other row of out's allocation, row -1 included, keeps the sentinel. */
static void dd_check(dd_case *c, const int *pos, const int64_t *wofs, int ntok, const char *what) {
  double h[DD_I], ref[DD_H];
  char written[DD_SLOTS + 1] = {0};
  errsum e = {0};
  for (int i = 0; i < ntok; i++) {
    const int p = pos[i], s = c->slot[p + 1];
    ref_expert(c->x + (size_t)(c->rows[p + 1] + 1) * DD_H, c->w + wofs[i], DD_H, DD_I, h, ref);
    written[s + 1] = 1;
    for (int j = 0; j < DD_H; j++)
      err_add(&e, "out", (size_t)s * DD_H + j, c->got[(size_t)(s + 1) * DD_H + j], ref[j]);
  }
  err_check(&e, what);
  for (int s = 0; s < DD_SLOTS + 1; s++)
    if (!written[s])
      for (int j = 0; j < DD_H; j++)
        CHECK_MSG(c->got[(size_t)s * DD_H + j] == SENTINEL, "%s: out[%d][%d] written", what,
                  s - 1, j);
}

TEST_CASE(experts_device_data) {
  enum { NGOOD = 3, NBAD = 7 };
  const size_t hi = (size_t)DD_H * DD_I;
  fixture f = setup();
  need_op(&f, f.ops->experts != NULL, "experts");
  dd_case c = {0};
  c.w = place_experts(&f, 2, DD_H, DD_I, 0, c.offs, &c.w_elems);
  c.x = rnd_f32(&f, (DD_T + 1) * DD_H, 1.0f);
  c.rows = alloc(&f, TDM_MEM_PINNED, (DD_N + 2) * sizeof *c.rows);
  c.slot = alloc(&f, TDM_MEM_PINNED, (DD_N + 2) * sizeof *c.slot);
  for (int p = 0; p < DD_N + 2; p++) c.rows[p] = (int32_t)th_rand_below(&f.rng, DD_T);
  pick_distinct(&f, DD_SLOTS, DD_N + 2, c.slot);
  c.rows[6 + 1] = -1;
  c.slot[8 + 1] = -1;
  c.table = alloc(&f, TDM_MEM_PINNED, (NGOOD + NBAD) * sizeof *c.table);
  c.dw = upload(&f, c.w, c.w_elems * sizeof *c.w);
  c.dx = upload(&f, c.x, (DD_T + 1) * DD_H * sizeof *c.x);
  c.drows = upload(&f, c.rows, (DD_N + 2) * sizeof *c.rows);
  c.dslot = upload(&f, c.slot, (DD_N + 2) * sizeof *c.slot);
  c.dtable = alloc(&f, TDM_MEM_DEVICE, (NGOOD + NBAD) * sizeof *c.dtable);
  c.got = alloc(&f, TDM_MEM_PINNED, (DD_SLOTS + 1) * DD_H * sizeof *c.got);
  c.dout = alloc(&f, TDM_MEM_DEVICE, (DD_SLOTS + 1) * DD_H * sizeof *c.dout);
  c.ws_bytes = tdm_moe_ops_workspace(DD_N, DD_H, DD_I);
  c.ws = alloc(&f, TDM_MEM_DEVICE, c.ws_bytes);

  const int64_t o0 = c.offs[0], o1 = c.offs[1];
  const tdm_moe_group bad[NBAD] = {
      {o0, 5, 2}, {o1, 7, 2}, {(int64_t)(c.w_elems - 3 * hi + 1), 9, 1}, {-8, 10, 1},
      {o0, 11, 2}, {o1, -1, 1}, {o0, 0, -1}};
  const char *bad_what[NBAD] = {"row -1", "slot -1", "weights past the end",
                                "weights before the start", "first + count = n + 1",
                                "first = -1", "count = -1"};
  c.table[0] = (tdm_moe_group){o0, 0, 3};
  c.table[1] = (tdm_moe_group){o1, 3, 2};
  c.table[2] = (tdm_moe_group){INT64_MIN + 5, -1000, 0};
  const int good_pos[] = {0, 1, 2, 3, 4, 5, 7};
  const int64_t good_w[] = {o0, o0, o0, o1, o1, o0, o1};

  if (strcmp(th_backend_of(f.dev), "cpu") == 0) {
    for (int b = 0; b < NBAD; b++) {
      c.table[NGOOD] = bad[b];
      printf("%s: ", bad_what[b]);
      CHECK_MSG(dd_run(&f, &c, NGOOD + 1) == TDM_ERANGE,
                "%s: the sync did not fail with TDM_ERANGE", bad_what[b]);
      for (size_t i = 0; i < (DD_SLOTS + 1) * DD_H; i++)
        CHECK_MSG(c.got[i] == SENTINEL, "%s: out written by a failed command", bad_what[b]);
    }
    CHECK_STATUS(dd_run(&f, &c, NGOOD), 0);
    dd_check(&c, good_pos, good_w, 5, "good entries after the failures");
  } else {
    for (int b = 0; b < NBAD; b++) c.table[NGOOD + b] = bad[b];
    CHECK_STATUS(dd_run(&f, &c, NGOOD + NBAD), 0);
    dd_check(&c, good_pos, good_w, 7, "good entries and tokens among bad ones");
  }

  tdm_free(c.w); tdm_free(c.dw); tdm_free(c.x); tdm_free(c.dx); tdm_free(c.rows);
  tdm_free(c.slot); tdm_free(c.drows); tdm_free(c.dslot); tdm_free(c.table); tdm_free(c.dtable);
  tdm_free(c.got); tdm_free(c.dout); tdm_free(c.ws);
  teardown(&f);
}

/* ---- upload ------------------------------------------------------------------------------ */

/* upload(), where a table has it (CUDA): bytes from pinned memory land at the destination
 * exactly, at sizes and offsets on and off the 16-byte grid; the same pinned bytes rewritten
 * and uploaded again land anew (nothing stale is read); memory the device cannot read in
 * place (plain malloc) is copied all the same; n == 0 writes nothing; a NULL pointer is
 * TDM_EINVAL. */
TEST_CASE(upload_bytes) {
  fixture f = setup();
  need_op(&f, f.ops->upload != NULL, "upload");
  enum { MAX = 70000 };
  const struct { size_t n, src_off, dst_off; } cases[] = {
      {1, 0, 0}, {16, 0, 0}, {17, 3, 5}, {4096, 0, 0}, {8192, 16, 32}, {MAX - 40, 7, 1}};
  unsigned char *src = alloc(&f, TDM_MEM_PINNED, MAX), *got = alloc(&f, TDM_MEM_PINNED, MAX);
  unsigned char *pageable = malloc(MAX), *dev = alloc(&f, TDM_MEM_DEVICE, MAX);
  CHECK(pageable != NULL);
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
    for (int round = 0; round < 2; round++) {
      size_t n = cases[c].n, so = cases[c].src_off, d0 = cases[c].dst_off;
      for (size_t i = 0; i < MAX; i++) src[i] = (unsigned char)th_rand(&f.rng);
      memset(got, 0xa5, MAX);
      CHECK_OK(tdm_memcpy(f.q, dev, got, MAX, TDM_COPY_H2D, 0, NULL, NULL));
      CHECK_OK(f.ops->upload(f.st, f.q, dev + d0, src + so, n));
      download(&f, got, dev, MAX);
      CHECK_MSG(memcmp(got + d0, src + so, n) == 0, "%zu bytes (round %d) differ", n, round);
      for (size_t i = 0; i < MAX; i++)
        if (i < d0 || i >= d0 + n) CHECK_MSG(got[i] == 0xa5, "byte %zu outside written", i);
    }
  for (size_t i = 0; i < MAX; i++) pageable[i] = (unsigned char)th_rand(&f.rng);
  CHECK_OK(f.ops->upload(f.st, f.q, dev, pageable, 1000));
  download(&f, got, dev, 1000);
  CHECK(memcmp(got, pageable, 1000) == 0);
  memset(got, 0x5a, MAX);
  CHECK_OK(tdm_memcpy(f.q, dev, got, 16, TDM_COPY_H2D, 0, NULL, NULL));
  CHECK_OK(f.ops->upload(f.st, f.q, dev, src, 0));
  download(&f, got, dev, 16);
  CHECK(got[0] == 0x5a && got[15] == 0x5a);
  CHECK_STATUS(f.ops->upload(f.st, f.q, NULL, src, 8), TDM_EINVAL);
  CHECK_STATUS(f.ops->upload(f.st, f.q, dev, NULL, 8), TDM_EINVAL);
  free(pageable);
  tdm_free(src); tdm_free(got); tdm_free(dev);
  teardown(&f);
}

/* ---- combine ----------------------------------------------------------------------------- */

TEST_CASE(combine_ref) {
  enum { T = 33, H = 200, K = 3 };
  fixture f = setup();
  float *y = rnd_f32(&f, (size_t)T * H, 1.0f), *out = rnd_f32(&f, (size_t)T * K * H, 2.0f);
  float *wts = rnd_f32(&f, (size_t)T * K, 1.0f);
  float *got = alloc(&f, TDM_MEM_PINNED, (size_t)T * H * sizeof *got);
  float *dy = upload(&f, y, (size_t)T * H * sizeof *y);
  float *dout = upload(&f, out, (size_t)T * K * H * sizeof *out);
  float *dwts = upload(&f, wts, (size_t)T * K * sizeof *wts);

  CHECK_OK(f.ops->combine(f.st, f.q, dy, dout, dwts, T, H, K));
  download(&f, got, dy, (size_t)T * H * sizeof *got);

  errsum e = {0};
  for (int t = 0; t < T; t++)
    for (int c = 0; c < H; c++) {
      double s = 0.0;
      for (int j = 0; j < K; j++)
        s += (double)wts[t * K + j] * out[((size_t)t * K + j) * H + c];
      err_add(&e, "y", (size_t)t * H + c, got[t * H + c], y[t * H + c] + s);
    }
  err_check(&e, "combine");

  tdm_free(y); tdm_free(out); tdm_free(wts); tdm_free(got); tdm_free(dy); tdm_free(dout);
  tdm_free(dwts);
  teardown(&f);
}

/* ---- Determinism ------------------------------------------------------------------------- */

/* The expert twice on one queue, then on two queues at once (each with its own workspace):
 * bitwise equal every time. Shapes large enough that a threaded BLAS uses its threads. */
TEST_CASE(deterministic) {
  enum { T = 80, H = 512, I = 1024, N = 64, K = 2, ROUNDS = 3 };
  fixture f = setup();
  expert_case c = expert_setup(&f, T, H, I, N, K);
  size_t bytes = (size_t)T * K * H * sizeof(float);
  float *first = alloc(&f, TDM_MEM_PINNED, bytes), *again = alloc(&f, TDM_MEM_PINNED, bytes);
  float *other = alloc(&f, TDM_MEM_PINNED, bytes);

  expert_run(&f, f.q, f.st, &c, c.ws, first);
  for (size_t i = 0; i < bytes / sizeof(float); i++) CHECK(isfinite(first[i]));
  expert_run(&f, f.q, f.st, &c, c.ws, again);
  CHECK_MEM_EQ(again, first, bytes);

  tdm_queue *q2 = NULL;
  void *st2 = NULL;
  CHECK_OK(tdm_queue_create(f.dev, TDM_QUEUE_IN_ORDER, &q2));
  CHECK_OK(f.ops->open(q2, &st2));
  void *ws2 = alloc(&f, TDM_MEM_DEVICE, c.ws_bytes);
  float *dout2 = alloc(&f, TDM_MEM_DEVICE, bytes);
  for (int r = 0; r < ROUNDS; r++) {
    memset(again, 0, bytes);
    memset(other, 0, bytes);
    CHECK_OK(tdm_memset(f.q, c.dout, 0, bytes, 0, NULL, NULL));
    CHECK_OK(tdm_memset(q2, dout2, 0, bytes, 0, NULL, NULL));
    CHECK_OK(f.ops->expert(f.st, f.q, c.dx, c.drows, c.dslot, N, c.dw, H, I, c.dout, c.ws,
                           c.ws_bytes));
    CHECK_OK(f.ops->expert(st2, q2, c.dx, c.drows, c.dslot, N, c.dw, H, I, dout2, ws2,
                           c.ws_bytes));
    CHECK_OK(tdm_memcpy(f.q, again, c.dout, bytes, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(q2, other, dout2, bytes, TDM_COPY_D2H, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(f.q));
    CHECK_OK(tdm_queue_sync(q2));
    /* Only the slots were written this time; the rest is zero on both. */
    for (int i = 0; i < N; i++) {
      size_t at = (size_t)c.slot[i] * H;
      CHECK_MEM_EQ(again + at, first + at, H * sizeof(float));
      CHECK_MEM_EQ(other + at, first + at, H * sizeof(float));
    }
  }
  printf("expert n=%d H=%d I=%d: %d runs on one queue and %d pairs on two queues, bitwise "
         "equal\n", N, H, I, 2 + ROUNDS, ROUNDS);

  f.ops->close(st2);
  CHECK_OK(tdm_queue_destroy(q2));
  tdm_free(ws2); tdm_free(dout2); tdm_free(first); tdm_free(again); tdm_free(other);
  expert_teardown(&c);
  teardown(&f);
}

/* ---- Order after host work --------------------------------------------------------------- */

static int sleep_task(void *arg) {
  th_sleep_ms((long)(intptr_t)arg);
  return 0;
}

/* Ops submitted behind a slow host task and the copy that gives them their input (which a
 * driver gating host work on the host, such as PoCL's basic one, holds back) still run after
 * both: the result is bitwise the one without the task. Two in-place rmsnorms and a combine,
 * so ops also stay in order among themselves. */
TEST_CASE(ordered_after_host_task) {
  enum { T = 16, H = 96 };
  fixture f = setup();
  size_t bytes = (size_t)T * H * sizeof(float);
  float *x = rnd_f32(&f, (size_t)T * H, 2.0f), *w = rnd_f32(&f, H, 1.0f);
  float *ones = rnd_f32(&f, T, 1.0f);
  float *want = alloc(&f, TDM_MEM_PINNED, bytes), *got = alloc(&f, TDM_MEM_PINNED, bytes);
  float *dw = upload(&f, w, H * sizeof *w), *dones = upload(&f, ones, T * sizeof *ones);
  float *dx = alloc(&f, TDM_MEM_DEVICE, bytes), *dy = alloc(&f, TDM_MEM_DEVICE, bytes);

  for (int pass = 0; pass < 2; pass++) {
    CHECK_OK(tdm_memset(f.q, dx, 0, bytes, 0, NULL, NULL));
    CHECK_OK(tdm_memset(f.q, dy, 0, bytes, 0, NULL, NULL));
    CHECK_OK(tdm_queue_sync(f.q));
    if (pass == 1) CHECK_OK(tdm_host_task(f.q, sleep_task, (void *)(intptr_t)100, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(f.q, dx, x, bytes, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(f.ops->rmsnorm(f.st, f.q, dx, dx, dw, T, H, 1e-6f));
    CHECK_OK(f.ops->rmsnorm(f.st, f.q, dx, dx, dw, T, H, 1e-6f));
    CHECK_OK(f.ops->combine(f.st, f.q, dy, dx, dones, T, H, 1));
    download(&f, pass ? got : want, dy, bytes);
  }
  for (size_t i = 0; i < (size_t)T * H; i++) CHECK(want[i] != 0.0f);
  CHECK_MEM_EQ(got, want, bytes);

  tdm_free(x); tdm_free(w); tdm_free(ones); tdm_free(want); tdm_free(got); tdm_free(dw);
  tdm_free(dones); tdm_free(dx); tdm_free(dy);
  teardown(&f);
}

/* ---- Graphs ------------------------------------------------------------------------------ */

/* rmsnorm then combine into y, directly or as a recorded graph. */
static void norm_combine(fixture *f, float *dx, const float *dw, float *dy, const float *dones,
                         int T, int H) {
  CHECK_OK(f->ops->rmsnorm(f->st, f->q, dx, dx, dw, T, H, 1e-6f));
  CHECK_OK(f->ops->combine(f->st, f->q, dy, dx, dones, T, H, 1));
}

/* A recorded graph runs nothing while it is recorded, then each launch computes what the ops
 * compute directly, bitwise, on the buffers' contents at that time; misuse is refused. Tables
 * that cannot record (NULL graph entries) skip visibly. */
TEST_CASE(graph_replay) {
  enum { T = 6, H = 96 };
  fixture f = setup();
  if (!f.ops->graph_begin) TH_SKIP("the %s table records no graphs", f.ops->name);
  size_t bytes = (size_t)T * H * sizeof(float);
  float *x1 = rnd_f32(&f, (size_t)T * H, 2.0f), *x2 = rnd_f32(&f, (size_t)T * H, 3.0f);
  float *w = rnd_f32(&f, H, 1.0f), *ones = rnd_f32(&f, T, 1.0f);
  float *want1 = alloc(&f, TDM_MEM_PINNED, bytes), *want2 = alloc(&f, TDM_MEM_PINNED, bytes);
  float *got = alloc(&f, TDM_MEM_PINNED, bytes);
  float *dw = upload(&f, w, H * sizeof *w), *dones = upload(&f, ones, T * sizeof *ones);
  float *dx = alloc(&f, TDM_MEM_DEVICE, bytes), *dy = alloc(&f, TDM_MEM_DEVICE, bytes);

  /* Directly, for both inputs. */
  const float *xs[2] = {x1, x2};
  float *wants[2] = {want1, want2};
  for (int i = 0; i < 2; i++) {
    CHECK_OK(tdm_memset(f.q, dy, 0, bytes, 0, NULL, NULL));
    CHECK_OK(tdm_memcpy(f.q, dx, xs[i], bytes, TDM_COPY_H2D, 0, NULL, NULL));
    norm_combine(&f, dx, dw, dy, dones, T, H);
    download(&f, wants[i], dy, bytes);
  }
  CHECK(memcmp(want1, want2, bytes) != 0);

  /* Recorded: nothing runs, and the queue's own work goes on meanwhile. */
  void *g = NULL;
  CHECK_OK(tdm_memset(f.q, dy, 0, bytes, 0, NULL, NULL));
  CHECK_OK(tdm_queue_sync(f.q));
  CHECK_OK(f.ops->graph_begin(f.st, f.q));
  CHECK_RC(f.ops->graph_begin(f.st, f.q), TDM_ESTATE);
  norm_combine(&f, dx, dw, dy, dones, T, H);
  CHECK_OK(tdm_memcpy(f.q, dx, x1, bytes, TDM_COPY_H2D, 0, NULL, NULL));
  download(&f, got, dy, bytes);
  for (size_t i = 0; i < (size_t)T * H; i++) CHECK_MSG(got[i] == 0.0f, "y[%zu] written", i);
  CHECK_OK(f.ops->graph_end(f.st, f.q, &g));
  CHECK(g != NULL);
  CHECK_RC(f.ops->graph_end(f.st, f.q, &g), TDM_ESTATE); /* not recording: g is left alone */
  CHECK(g != NULL);

  /* Launched on each input in turn: the direct results, bitwise. */
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < 2; i++) {
      CHECK_OK(tdm_memset(f.q, dy, 0, bytes, 0, NULL, NULL));
      CHECK_OK(tdm_memcpy(f.q, dx, xs[i], bytes, TDM_COPY_H2D, 0, NULL, NULL));
      CHECK_OK(f.ops->graph_launch(f.st, f.q, g));
      download(&f, got, dy, bytes);
      CHECK_MEM_EQ(got, wants[i], bytes);
    }
  f.ops->graph_free(f.st, g);

  tdm_free(x1); tdm_free(x2); tdm_free(w); tdm_free(ones); tdm_free(want1); tdm_free(want2);
  tdm_free(got); tdm_free(dw); tdm_free(dones); tdm_free(dx); tdm_free(dy);
  teardown(&f);
}

/* ---- Argument checks --------------------------------------------------------------------- */

TEST_CASE(bad_args) {
  enum { T = 4, H = 8, I = 16, E = 4 };
  fixture f = setup();
  expert_case c = expert_setup(&f, T, H, I, T, 1);
  const tdm_moe_ops *o = f.ops;
  float *buf = alloc(&f, TDM_MEM_DEVICE, (size_t)T * E * H * sizeof(float));
  int32_t *ibuf = alloc(&f, TDM_MEM_DEVICE, (size_t)T * E * sizeof(int32_t));

  /* Workspace too small; k out of range; missing pointers; the state of another queue. */
  CHECK_RC(o->expert(f.st, f.q, c.dx, c.drows, c.dslot, T, c.dw, H, I, c.dout, c.ws,
                     c.ws_bytes - 1), TDM_EINVAL);
  CHECK_RC(o->router(f.st, f.q, c.dx, c.dw, NULL, T, H, E, E + 1, 1, ibuf, buf), TDM_EINVAL);
  CHECK_RC(o->router(f.st, f.q, c.dx, c.dw, NULL, T, H, E, 0, 1, ibuf, buf), TDM_EINVAL);
  CHECK_RC(o->rmsnorm(f.st, f.q, buf, NULL, buf, T, H, 1e-6f), TDM_EINVAL);
  CHECK_RC(o->combine(f.st, f.q, buf, buf, NULL, T, H, 1), TDM_EINVAL);
  tdm_queue *q2 = NULL;
  CHECK_OK(tdm_queue_create(f.dev, TDM_QUEUE_IN_ORDER, &q2));
  CHECK_RC(o->combine(f.st, q2, buf, buf, buf, T, H, 1), TDM_EINVAL);
  CHECK_OK(tdm_queue_destroy(q2));
  /* Nothing to do is not an error. */
  CHECK_OK(o->expert(f.st, f.q, c.dx, c.drows, c.dslot, 0, c.dw, H, I, c.dout, c.ws, 0));
  CHECK_OK(o->combine(f.st, f.q, buf, buf, buf, 0, H, 1));
  CHECK_OK(tdm_queue_sync(f.q));

  /* The CPU table checks device-side indices against tandem's allocation bounds when the task
   * runs: the failure comes from the sync, and the queue stays usable. */
  if (strcmp(th_backend_of(f.dev), "cpu") == 0) {
    int32_t bad = T * 1000;
    CHECK_OK(tdm_memcpy(f.q, c.drows, &bad, sizeof bad, TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(o->expert(f.st, f.q, c.dx, c.drows, c.dslot, T, c.dw, H, I, c.dout, c.ws,
                       c.ws_bytes));
    CHECK_RC(tdm_queue_sync(f.q), TDM_ERANGE);
    printf("bad row: %s\n", tdm_last_error());
    /* The op's own words reach the sync, after the failed task's name. */
    CHECK_MSG(strstr(tdm_last_error(), "failed: moe expert: rows[0] = 4000 outside x"),
              "message: %s", tdm_last_error());
    CHECK_OK(tdm_memcpy(f.q, c.drows, c.rows, T * sizeof(int32_t), TDM_COPY_H2D, 0, NULL, NULL));
    CHECK_OK(o->expert(f.st, f.q, c.dx, c.drows, c.dslot, T, c.dw, H, I, c.dout, c.ws,
                       c.ws_bytes));
    CHECK_OK(tdm_queue_sync(f.q));
  }

  tdm_free(buf); tdm_free(ibuf);
  expert_teardown(&c);
  teardown(&f);
}

/* ---- Allocation failures ----------------------------------------------------------------- */

/* Fails the nth host allocation, for n = 0, 1, ... until a run goes through untouched: each
 * failure is TDM_ENOMEM, from the call or from the sync, and the run after it still computes
 * the right answer (a leak shows in the sanitizer builds). */
static void count_call(void *arg) { ++*(int *)arg; }

TEST_CASE(alloc_faults) {
  enum { T = 12, H = 32, I = 48, E = 6, K = 2 };
  int calls = 0; /* host_call()s that ran */
  /* The CPU table allocates through tandem's fault hook; GPU tables allocate once, at open. */
  if (strcmp(th_backend_of_current(), "cpu") != 0)
    TH_SKIP("%s's MoE operations make no host allocations per call", th_device_id);
  fixture f = setup();
  expert_case c = expert_setup(&f, T, H, I, T, 1);
  size_t bytes = (size_t)T * H * sizeof(float);
  float *want = alloc(&f, TDM_MEM_PINNED, bytes), *got = alloc(&f, TDM_MEM_PINNED, bytes);
  int32_t *didx = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(int32_t));
  float *dwts = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(float));
  /* The router's output grouped, then computed by experts() (every expert with c's weights). */
  const int grouped = f.ops->experts && f.ops->group, G = E < T * K ? E : T * K;
  int64_t *dwofs = alloc(&f, TDM_MEM_DEVICE, E * sizeof(int64_t));
  int32_t *drows = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(int32_t));
  int32_t *dslot = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * sizeof(int32_t));
  tdm_moe_group *dgroups = alloc(&f, TDM_MEM_DEVICE, (size_t)G * sizeof(tdm_moe_group));
  float *dout = alloc(&f, TDM_MEM_DEVICE, (size_t)T * K * H * sizeof(float));
  size_t ws_bytes = tdm_moe_ops_workspace(T * K, H, I);
  void *ws = alloc(&f, TDM_MEM_DEVICE, ws_bytes);
  CHECK_OK(tdm_memset(f.q, dwofs, 0, E * sizeof(int64_t), 0, NULL, NULL));
  expert_run(&f, f.q, f.st, &c, c.ws, want);

  int failures = 0;
  for (long nth = 0;; nth++) {
    CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC, nth, TDM_ENOMEM));
    int rc = f.ops->expert(f.st, f.q, c.dx, c.drows, c.dslot, T, c.dw, H, I, c.dout, c.ws,
                           c.ws_bytes);
    if (rc == 0)
      rc = f.ops->router(f.st, f.q, c.dx, c.dw, NULL, T, H, E, K, 1, didx, dwts);
    if (rc == 0 && grouped)
      rc = f.ops->group(f.st, f.q, didx, T, K, E, dwofs, drows, dslot, dgroups);
    if (rc == 0 && grouped)
      rc = f.ops->experts(f.st, f.q, c.dx, drows, dslot, T * K, c.dw, dgroups, G, H, I, dout,
                          ws, ws_bytes);
    if (rc == 0) rc = f.ops->host_call(f.st, f.q, count_call, &calls);
    int sync = tdm_queue_sync(f.q);
    int fired = tdm_fault_fired();
    CHECK_OK(tdm_fault_inject(TDM_FAULT_ALLOC, -1, 0));
    if (!fired) {
      CHECK_OK(rc);
      CHECK_OK(sync);
      break;
    }
    failures++;
    CHECK_MSG((rc == 0 || rc == TDM_ENOMEM) && (sync == 0 || sync == TDM_ENOMEM),
              "fault %ld: call %s, sync %s", nth, tdm_err_name(rc), tdm_err_name(sync));
    CHECK(nth < 1000);
  }
  printf("%d allocation failures injected, %d host calls ran\n", failures, calls);
  CHECK(failures > 0 && calls > 0);
  expert_run(&f, f.q, f.st, &c, c.ws, got);
  CHECK_MEM_EQ(got, want, bytes);

  tdm_free(want);
  tdm_free(got);
  tdm_free(didx);
  tdm_free(dwts);
  tdm_free(dwofs); tdm_free(drows); tdm_free(dslot); tdm_free(dgroups); tdm_free(dout);
  tdm_free(ws);
  expert_teardown(&c);
  teardown(&f);
}
