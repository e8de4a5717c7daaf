/* test-model.c: whole models from their files (tandem/model.h) against the float64 NumPy
 * reference (tests/model/ref_model.py) on tiny random Qwen3-MoE and Mixtral models written by
 * tests/model/tiny.py both as GGUF and as a safetensors folder: the logits of every prompt
 * position and of every decode step (fed the reference's own greedy tokens) within a stated
 * tolerance; streamed runs bitwise equal to the all-resident one; bad input refused. The
 * fixture (tests/model/fixture.sh) writes the models and the references into
 * $TANDEM_TEST_MODEL_DIR; without it the cases are skipped. */
#include "harness.h"

#include <tandem/model.h>
#include <tandem/moe_ops.h>

#include <math.h>
#include <sys/stat.h>

/* Relative to the row's largest reference logit (at least 1): f32 and float64 on the same
 * weights (the experts and the router are bf16-exact in the files) differ by ~1e-5. */
#define TOLERANCE 1e-3

typedef struct ref {
  int V, P, N;
  double *logits; /* (P + N) x V */
  int32_t *prompt, *gen;
} ref;

static const char *model_dir(void) {
  const char *d = getenv("TANDEM_TEST_MODEL_DIR");
  if (!d || !*d) {
    printf("skipped: TANDEM_TEST_MODEL_DIR is not set (the model fixture did not run)\n");
    exit(77);
  }
  char probe[1024];
  snprintf(probe, sizeof probe, "%s/mixtral/ref.bin", d);
  if (access(probe, R_OK) != 0) {
    printf("skipped: %s is missing (the fixture found no Python with gguf and safetensors)\n",
           probe);
    exit(77);
  }
  return d;
}

/* The reference's file (ref_model.py's layout: magic, V, rows, P, N, f64 rows, int32 ids) and
 * the prompt it was run on (prompt.txt: the ids, comma-separated). */
static void ref_load(const char *arch, ref *r) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s/ref.bin", model_dir(), arch);
  FILE *f = fopen(path, "rb");
  CHECK_MSG(f != NULL, "cannot open %s", path);
  char magic[8];
  int32_t hdr[4];
  CHECK(fread(magic, 1, 8, f) == 8 && memcmp(magic, "TNDREF01", 8) == 0);
  CHECK(fread(hdr, sizeof(int32_t), 4, f) == 4);
  r->V = hdr[0];
  r->P = hdr[2];
  r->N = hdr[3];
  CHECK(hdr[1] == r->P + r->N && r->V > 0 && r->P > 0 && r->N >= 0);
  size_t n = (size_t)hdr[1] * r->V;
  r->logits = malloc(n * sizeof(double));
  r->gen = malloc(((size_t)r->N + 1) * sizeof(int32_t));
  r->prompt = malloc((size_t)r->P * sizeof(int32_t));
  CHECK(r->logits && r->gen && r->prompt);
  CHECK(fread(r->logits, sizeof(double), n, f) == n);
  CHECK(fread(r->gen, sizeof(int32_t), (size_t)r->N, f) == (size_t)r->N);
  fclose(f);
  snprintf(path, sizeof path, "%s/%s/prompt.txt", model_dir(), arch);
  f = fopen(path, "r");
  CHECK_MSG(f != NULL, "cannot open %s", path);
  for (int i = 0; i < r->P; i++) CHECK(fscanf(f, i ? ",%d" : "%d", &r->prompt[i]) == 1);
  fclose(f);
}

static void ref_free(ref *r) {
  free(r->logits);
  free(r->gen);
  free(r->prompt);
}

static tdm_model *open_model(tdm_device *dev, const char *arch, const char *which,
                             const tdm_model_config *extra) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s/%s", model_dir(), arch, which);
  tdm_model_config cfg = extra ? *extra : (tdm_model_config){0};
  cfg.path = path;
  cfg.device = dev;
  cfg.threads = 2;
  tdm_model *m = NULL;
  CHECK_OK(tdm_model_open(&cfg, &m));
  return m;
}

/* Prompt (all logits), then the reference's tokens one at a time: (P + N) x V logits. */
static float *run(tdm_model *m, const ref *r) {
  float *out = malloc((size_t)(r->P + r->N) * r->V * sizeof(float));
  CHECK(out != NULL);
  CHECK_OK(tdm_model_eval(m, r->prompt, r->P, out, true, NULL));
  for (int j = 0; j < r->N; j++)
    CHECK_OK(tdm_model_eval(m, &r->gen[j], 1, out + (size_t)(r->P + j) * r->V, false, NULL));
  return out;
}

static void compare(const char *what, const float *got, const ref *r) {
  for (int row = 0; row < r->P + r->N; row++) {
    const double *want = r->logits + (size_t)row * r->V;
    const float *have = got + (size_t)row * r->V;
    double scale = 1.0, err = 0.0;
    int at = 0;
    for (int v = 0; v < r->V; v++) scale = fmax(scale, fabs(want[v]));
    for (int v = 0; v < r->V; v++)
      if (fabs(have[v] - want[v]) > err) {
        err = fabs(have[v] - want[v]);
        at = v;
      }
    CHECK_MSG(err <= TOLERANCE * scale, "%s: row %d (%s), logit %d: %.6g, reference %.6g "
              "(error %.3g > %.3g)", what, row, row < r->P ? "prompt" : "decode", at, have[at],
              want[at], err, TOLERANCE * scale);
  }
  /* greedy: the reference's tokens, wherever its top two are further apart than the error */
  for (int j = 0; j < r->N; j++) {
    const float *row = got + (size_t)(r->P - 1 + j) * r->V;
    const double *want = r->logits + (size_t)(r->P - 1 + j) * r->V;
    double second = -INFINITY;
    for (int v = 0; v < r->V; v++)
      if (v != r->gen[j]) second = fmax(second, want[v]);
    if (want[r->gen[j]] - second > 0.05)
      CHECK_MSG(tdm_model_argmax(row, r->V) == r->gen[j], "%s: decode step %d chose %d, the "
                "reference %d", what, j, tdm_model_argmax(row, r->V), r->gen[j]);
  }
}

/* Runs m (run()) against the reference, says so, and closes it. */
static void check_and_close(tdm_model *m, const ref *r, const char *what) {
  float *got = run(m, r);
  compare(what, got, r);
  printf("%s: within %.0e of the reference\n", what, TOLERANCE);
  free(got);
  tdm_model_close(m);
}

/* dense: the file's dense type ("F32", "F16", "BF16", "Q8_0"; "Q4_K+...": Q4_K query
 * projections among others, tdm_model_info's dense_type); experts: the format its
 * experts stay in where the device's table computes experts in their file's format
 * (expert_q), tdm_model_info's expert_type. A 16-bit dense type stays 16-bit on a table with
 * the 16-bit operations, a block type in its blocks on a table with matmul_q, and either is
 * also run widened (dense_f32); experts in a format other than bf16 are also run widened to
 * bf16 (experts_bf16): every run within tolerance. */
static void against_reference(const char *arch, const char *which, const char *dense,
                              const char *experts) {
  tdm_device *dev = th_open();
  ref r;
  ref_load(arch, &r);
  bool half = strcmp(dense, "F16") == 0 || strcmp(dense, "BF16") == 0;
  bool wide = half || strcmp(dense, "F32") != 0; /* a type the device may keep */
  const tdm_moe_ops *ops = tdm_moe_ops_for(dev);
  bool keeps = ops && (half ? ops->matmul_h && ops->get_rows_h : ops->matmul_q != NULL);
  bool native = ops && ops->expert_q && ops->experts_q && strcmp(experts, "BF16") != 0;
  /* Q4_K and Q6_K values are not bf16 values: widened to bf16, the experts are another model's
   * (rounding them flips routing choices near ties), so only their own format is compared. */
  bool bf16_exact = strstr(experts, "_K") == NULL;
  if (!native && !bf16_exact)
    TH_SKIP("the %s table has no expert_q(): it would widen the %s experts to bf16, which "
            "rounds them (not the reference's model)", ops ? ops->name : "?", experts);
  for (int run_i = 0; run_i < 3; run_i++) {
    int f32 = run_i == 1, ebf16 = run_i == 2;
    if ((f32 && !wide) || (ebf16 && (!native || !bf16_exact))) continue;
    tdm_model_config all = {.all_resident = true, .dense_f32 = f32, .experts_bf16 = ebf16};
    tdm_model *m = open_model(dev, arch, which, &all);
    tdm_model_info info;
    CHECK_OK(tdm_model_info_get(m, &info));
    CHECK_EQ(info.vocab, r.V);
    const char *want = wide && keeps && !f32 ? dense : "F32";
    CHECK_MSG(strcmp(info.dense_type, want) == 0, "%s %s: dense weights %s on the device, not %s",
              arch, which, info.dense_type, want);
    want = native && !ebf16 ? experts : "BF16";
    CHECK_MSG(strcmp(info.expert_type, want) == 0, "%s %s: experts %s, not %s", arch, which,
              info.expert_type, want);
    char what[128];
    snprintf(what, sizeof what, "%s %s (dense %s, experts %s)", arch, which, info.dense_type,
             info.expert_type);
    check_and_close(m, &r, what);
  }
  ref_free(&r);
  th_close();
}

/* F32 experts are widened to bf16 (the tests' fixtures hold bf16 values in them). */
TEST_CASE(qwen3moe_gguf) { against_reference("qwen3moe", "model.gguf", "F32", "BF16"); }
TEST_CASE(qwen3moe_safetensors) { against_reference("qwen3moe", "hf", "F32", "BF16"); }
TEST_CASE(mixtral_gguf) { against_reference("mixtral", "model.gguf", "F32", "BF16"); }
TEST_CASE(mixtral_safetensors) { against_reference("mixtral", "hf", "F32", "BF16"); }
/* F16 dense weights (embedding, attention, LM head): kept in 16 bits, and widened. */
TEST_CASE(qwen3moe_f16_gguf) { against_reference("qwen3moe-f16", "model.gguf", "F16", "BF16"); }
TEST_CASE(qwen3moe_f16_safetensors) {
  against_reference("qwen3moe-f16", "hf", "F16", "BF16");
}
/* config.json as transformers 5 writes it: num_local_experts for Qwen3-MoE's experts, RoPE's
 * base in rope_parameters (1e6 here, which the old default 1e4 would get wrong). */
TEST_CASE(qwen3moe_v5_config_safetensors) {
  against_reference("qwen3moe-v5", "hf", "F32", "BF16");
}
/* BF16 dense weights and a tied LM head (the embedding's 16-bit table read by both). */
TEST_CASE(mixtral_bf16_tied_gguf) {
  against_reference("mixtral-bf16", "model.gguf", "BF16", "BF16");
}
TEST_CASE(mixtral_bf16_tied_safetensors) {
  against_reference("mixtral-bf16", "hf", "BF16", "BF16");
}
/* GGUF block types (tiny.py): a Q8_0 file, projections, embedding, LM head and experts;
 * Mixtral with MXFP4 experts; and Q4_K_M's experts, Q4_K with Q6_K down projections in every
 * other layer (so the layers' formats differ), whose values bf16 does not hold: run in
 * their format only. */
TEST_CASE(qwen3moe_q8_0_gguf) {
  against_reference("qwen3moe-q8_0", "model.gguf", "Q8_0", "Q8_0");
}
TEST_CASE(mixtral_mxfp4_gguf) {
  against_reference("mixtral-mxfp4", "model.gguf", "F32", "MXFP4");
}
TEST_CASE(qwen3moe_q4_k_m_gguf) {
  against_reference("qwen3moe-q4_k_m", "model.gguf", "F32", "Q4_K+Q6_K+...");
}
/* Every tensor typed as llama.cpp's quantizer types a Q4_K_M file (tiny.py's q4_k_m_type):
 * Mixtral's attention output in Q5_K (matmul_q on the CPU and CUDA) and k and v in Q8_0; Qwen3-MoE's attention output in
 * Q5_0 (rows of 64 values: its fallback from Q4_K); the dense projections in Q4_K, the LM head
 * in Q6_K, the experts Q4_K with Q6_K down projections in the last layer. */
TEST_CASE(mixtral_llama_q4_k_m_gguf) {
  against_reference("mixtral-llama-q4_k_m", "model.gguf", "Q4_K+...", "Q4_K+...");
}
TEST_CASE(qwen3moe_llama_q4_k_m_gguf) {
  against_reference("qwen3moe-llama-q4_k_m", "model.gguf", "Q4_K+...", "Q4_K+...");
}
/* Q5_K experts (a Q5_K_M file's), for which no table has kernels: widened to bf16 at load,
 * they run as another model's (bf16 does not hold their values), so the logits are held to
 * the reference within a looser bound: a gross error (a misread block) still shows. */
TEST_CASE(qwen3moe_q5_k_experts_widened) {
  tdm_device *dev = th_open();
  ref r;
  ref_load("qwen3moe-q5_k", &r);
  tdm_model_config all = {.all_resident = true};
  tdm_model *m = open_model(dev, "qwen3moe-q5_k", "model.gguf", &all);
  tdm_model_info info;
  CHECK_OK(tdm_model_info_get(m, &info));
  CHECK_MSG(strcmp(info.expert_type, "BF16") == 0, "experts %s, not BF16", info.expert_type);
  float *got = run(m, &r);
  double worst = 0.0;
  for (int row = 0; row < r.P + r.N; row++) { /* run() feeds the reference's tokens */
    const double *want = r.logits + (size_t)row * r.V;
    double scale = 1.0, err = 0.0;
    for (int v = 0; v < r.V; v++) scale = fmax(scale, fabs(want[v]));
    for (int v = 0; v < r.V; v++) {
      CHECK(isfinite(got[(size_t)row * r.V + v]));
      err = fmax(err, fabs(got[(size_t)row * r.V + v] - want[v]) / scale);
    }
    worst = fmax(worst, err);
  }
  printf("qwen3moe-q5_k: experts widened to bf16, worst row %.2e of the reference\n", worst);
  CHECK_MSG(worst <= 2e-2, "worst row %.3g of the reference", worst);
  free(got);
  tdm_model_close(m);
  ref_free(&r);
  th_close();
}

/* A GGUF in four shards (llama.cpp's gguf-split layout), opened by its first. */
TEST_CASE(qwen3moe_shards_gguf) {
  against_reference("qwen3moe-shards", "model-00001-of-00004.gguf", "Q8_0", "Q8_0");
}

static void copy_file(const char *from, const char *to) {
  FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
  CHECK_MSG(in && out, "copying %s to %s", from, to);
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, in)) > 0) CHECK(fwrite(buf, 1, n, out) == n);
  fclose(in);
  CHECK(fclose(out) == 0);
}

/* A split file opened by another shard than the first, a shard missing, and a shard in
 * another's place: each an error that names the file to look at. */
TEST_CASE(shards_bad_input) {
  tdm_device *dev = th_open();
  char dir[1024], from[1200], to[1200];
  tdm_model *m = NULL;
  tdm_model_config cfg = {.device = dev, .path = from};
  snprintf(from, sizeof from, "%s/qwen3moe-shards/model-00002-of-00004.gguf", model_dir());
  CHECK_RC(tdm_model_open(&cfg, &m), TDM_EINVAL);
  CHECK_MSG(m == NULL && strstr(tdm_last_error(), "model-00002-of-00004.gguf") &&
                strstr(tdm_last_error(), "open the first"), "%s", tdm_last_error());
  /* a folder of this process's own (the suite's devices run at once) */
  snprintf(dir, sizeof dir, "%s/qwen3moe-shards/bad-%d", model_dir(), (int)getpid());
  CHECK(mkdir(dir, 0755) == 0);
  for (int i = 1; i <= 3; i++) {
    snprintf(from, sizeof from, "%s/qwen3moe-shards/model-%05d-of-00004.gguf", model_dir(), i);
    snprintf(to, sizeof to, "%s/model-%05d-of-00004.gguf", dir, i);
    copy_file(from, to);
  }
  cfg.path = to;
  snprintf(to, sizeof to, "%s/model-00001-of-00004.gguf", dir);
  CHECK_RC(tdm_model_open(&cfg, &m), TDM_ENOENT);
  CHECK_MSG(m == NULL && strstr(tdm_last_error(), "model-00004-of-00004.gguf"), "%s",
            tdm_last_error());
  snprintf(from, sizeof from, "%s/model-00003-of-00004.gguf", dir);
  snprintf(to, sizeof to, "%s/model-00004-of-00004.gguf", dir);
  copy_file(from, to);
  snprintf(to, sizeof to, "%s/model-00001-of-00004.gguf", dir);
  CHECK_RC(tdm_model_open(&cfg, &m), TDM_EINVAL);
  CHECK_MSG(m == NULL && strstr(tdm_last_error(), "model-00004-of-00004.gguf") &&
                strstr(tdm_last_error(), "shard 3 of 4, not 4 of 4"), "%s", tdm_last_error());
  for (int i = 1; i <= 4; i++) {
    snprintf(to, sizeof to, "%s/model-%05d-of-00004.gguf", dir, i);
    remove(to);
  }
  CHECK(rmdir(dir) == 0);
  th_close();
}

/* Streamed at budgets 0, 25% and 50% of the experts: the same bits as all resident. */
static void streamed(const char *arch) {
  tdm_device *dev = th_open();
  ref r;
  ref_load(arch, &r);
  tdm_model_config all = {.all_resident = true};
  tdm_model *m = open_model(dev, arch, "model.gguf", &all);
  tdm_model_info info;
  CHECK_OK(tdm_model_info_get(m, &info));
  float *want = run(m, &r);
  tdm_model_close(m);
  const double shares[] = {0.0, 0.25, 0.5};
  for (int i = 0; i < 3; i++) {
    tdm_model_config c = {.budget_bytes = (size_t)(info.host_bytes * shares[i])};
    if (c.budget_bytes && c.budget_bytes < info.expert_bytes) c.budget_bytes = info.expert_bytes;
    m = open_model(dev, arch, "model.gguf", &c);
    float *got = run(m, &r);
    size_t n = (size_t)(r.P + r.N) * r.V;
    CHECK_MSG(memcmp(got, want, n * sizeof(float)) == 0, "budget %.0f%%: not the all-resident "
              "run's bits", shares[i] * 100);
    free(got);
    tdm_model_close(m);
  }
  free(want);
  ref_free(&r);
  th_close();
}

TEST_CASE(streamed_equals_resident) { streamed("qwen3moe"); }

/* Expert parallelism: the routed experts split between this device and a second one
 * (th_open_pair: cuda:1 beside cuda:0 where there is one, else opencl:0 beside cpu:0, else
 * cpu:0), attention on the first; all
 * resident and streamed at budget 0, within tolerance of the float64 reference, and greedy. */
TEST_CASE(expert_parallel) {
  const char *second_id;
  tdm_device *dev, *second = th_open_pair(&dev, &second_id);
  if (!second) TH_SKIP("no second device %s beside %s", second_id, th_device_id);
  ref r;
  ref_load("qwen3moe", &r);
  tdm_device *both[2] = {dev, second};
  for (int resident = 0; resident < 2; resident++) {
    tdm_model_config c = {.all_resident = resident, .devices = both, .ndevices = 2};
    char what[128];
    snprintf(what, sizeof what, "qwen3moe on %s and %s, %s", th_device_id, second_id,
             resident ? "all resident" : "budget 0");
    check_and_close(open_model(dev, "qwen3moe", "model.gguf", &c), &r, what);
  }
  ref_free(&r);
  th_close();
}
/* Experts that cross the link in their blocks, two formats in one model. */
TEST_CASE(streamed_equals_resident_q4_k_m) { streamed("qwen3moe-q4_k_m"); }

/* Prompt and decode as run() does, the decode steps' graph_steps summed into *graphed. */
static float *run_counted(tdm_model *m, const ref *r, int *graphed) {
  float *out = malloc((size_t)(r->P + r->N) * r->V * sizeof(float));
  CHECK(out != NULL);
  tdm_model_stats st;
  CHECK_OK(tdm_model_eval(m, r->prompt, r->P, out, true, &st));
  CHECK_EQ(st.graph_steps, 0);
  *graphed = 0;
  for (int j = 0; j < r->N; j++) {
    CHECK_OK(tdm_model_eval(m, &r->gen[j], 1, out + (size_t)(r->P + j) * r->V, false, &st));
    *graphed += st.graph_steps;
  }
  return out;
}

/* Decode steps with every expert resident run as one recorded graph where the backend records
 * graphs: every step of the sequence, the first recording it; the same bits as the steps op by
 * op (TANDEM_MODEL_GRAPH=0), at every position, again after a rewind (the graph replayed at
 * positions it ran before), and with the MoE blocks left out (a graph of its own). */
TEST_CASE(decode_graph_equals_ops) {
  tdm_device *dev = th_open();
  ref r;
  ref_load("qwen3moe", &r);
  CHECK(r.N >= 2);
  tdm_model_config all = {.all_resident = true};
  const tdm_moe_ops *ops = tdm_moe_ops_for(dev);
  bool graphs = ops && ops->graph_begin && ops->attn_prep_at && ops->attention_at;
  size_t n = (size_t)(r.P + r.N) * r.V, V = (size_t)r.V;
  float *out[2], *skip_logits[2];
  for (int off = 0; off < 2; off++) {
    if (off) CHECK(setenv("TANDEM_MODEL_GRAPH", "0", 1) == 0);
    tdm_model *m = open_model(dev, "qwen3moe", "model.gguf", &all);
    if (off) CHECK(unsetenv("TANDEM_MODEL_GRAPH") == 0);
    int graphed;
    out[off] = run_counted(m, &r, &graphed);
    CHECK_EQ(graphed, graphs && !off ? r.N : 0);
    /* rewound to the prompt's end: the steps again (tdm_model_step: the logits where the
     * model keeps them), the same bits */
    CHECK_OK(tdm_model_rewind(m, r.P));
    float *again = malloc(V * sizeof(float));
    CHECK(again != NULL);
    for (int j = 0; j < r.N; j++) {
      const float *view = again;
      CHECK_OK(tdm_model_step(m, r.gen[j], &view, NULL));
      CHECK(view != NULL && view != again);
      CHECK_MSG(memcmp(view, out[off] + (size_t)(r.P + j) * V, V * sizeof(float)) == 0,
                "graphs %s: step %d after a rewind is not the first run's", off ? "off" : "on",
                j);
    }
    const float *none = again; /* refused: the token, the pointer */
    CHECK_RC(tdm_model_step(m, r.V, &none, NULL), TDM_EINVAL);
    CHECK(none == NULL);
    CHECK_RC(tdm_model_step(m, 0, NULL, NULL), TDM_EINVAL);
    /* one more step without the MoE blocks */
    CHECK_OK(tdm_model_rewind(m, r.P));
    CHECK_OK(tdm_model_skip_moe(m, true));
    skip_logits[off] = malloc(V * sizeof(float));
    CHECK(skip_logits[off] != NULL);
    CHECK_OK(tdm_model_eval(m, &r.gen[0], 1, skip_logits[off], false, NULL));
    CHECK_OK(tdm_model_skip_moe(m, false));
    free(again);
    tdm_model_close(m);
  }
  CHECK_MSG(memcmp(out[0], out[1], n * sizeof(float)) == 0,
            "decode with graphs is not decode op by op, bitwise");
  CHECK_MSG(memcmp(skip_logits[0], skip_logits[1], V * sizeof(float)) == 0,
            "a step without the MoE blocks: graphs and ops differ");
  printf("%s: %d decode steps %s; the same bits op by op\n", ops ? ops->name : "?", r.N,
         graphs ? "each one graph" : "op by op (no graphs on this backend)");
  for (int i = 0; i < 2; i++) {
    free(out[i]);
    free(skip_logits[i]);
  }
  ref_free(&r);
  th_close();
}

/* A prompt in ubatches of 3 gives the logits of one pass, within the tolerance (a ubatch's
 * size changes the GEMMs' blocking), and rewinding replays a sequence exactly. */
TEST_CASE(ubatches_and_rewind) {
  tdm_device *dev = th_open();
  ref r;
  ref_load("mixtral", &r);
  tdm_model_config small = {.ubatch = 3};
  tdm_model *m = open_model(dev, "mixtral", "model.gguf", &small);
  float *got = run(m, &r);
  compare("mixtral in ubatches of 3", got, &r);
  CHECK_EQ(tdm_model_pos(m), r.P + r.N);
  CHECK_OK(tdm_model_rewind(m, 0));
  float *again = run(m, &r);
  CHECK(memcmp(got, again, (size_t)(r.P + r.N) * r.V * sizeof(float)) == 0);
  free(got);
  free(again);
  tdm_model_close(m);
  ref_free(&r);
  th_close();
}

TEST_CASE(bad_input) {
  tdm_device *dev = th_open();
  char path[1024];
  tdm_model *m = NULL;
  tdm_model_config cfg = {.device = dev, .path = path};
  /* no such file; a context longer than the model's */
  snprintf(path, sizeof path, "%s/none.gguf", model_dir());
  CHECK(tdm_model_open(&cfg, &m) < 0 && m == NULL);
  CHECK(strstr(tdm_last_error(), "none.gguf") != NULL);
  snprintf(path, sizeof path, "%s/qwen3moe/model.gguf", model_dir());
  cfg.ctx = 1 << 20;
  CHECK_RC(tdm_model_open(&cfg, &m), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "longer than the model") != NULL);
  /* ids outside the vocabulary, and past the cache, refused before anything runs */
  cfg.ctx = 8;
  CHECK_OK(tdm_model_open(&cfg, &m));
  int32_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  ids[2] = -1;
  CHECK_RC(tdm_model_eval(m, ids, 3, NULL, false, NULL), TDM_EINVAL);
  ids[2] = 1 << 30;
  CHECK_RC(tdm_model_eval(m, ids, 3, NULL, false, NULL), TDM_EINVAL);
  ids[2] = 3;
  CHECK_RC(tdm_model_eval(m, ids, 9, NULL, false, NULL), TDM_EINVAL);
  CHECK_EQ(tdm_model_pos(m), 0);
  CHECK_OK(tdm_model_eval(m, ids, 8, NULL, false, NULL));
  CHECK_RC(tdm_model_rewind(m, 9), TDM_EINVAL);
  tdm_model_close(m);
  m = NULL;
  /* a truncated file: an error naming it, never a crash */
  char cut[1024];
  snprintf(cut, sizeof cut, "%s/qwen3moe/cut.gguf", model_dir());
  FILE *in = fopen(path, "rb"), *out = fopen(cut, "wb");
  CHECK(in && out);
  char buf[4096];
  size_t n = fread(buf, 1, sizeof buf, in);
  CHECK(fwrite(buf, 1, n, out) == n);
  fclose(in);
  fclose(out);
  cfg.path = cut;
  cfg.ctx = 0;
  CHECK(tdm_model_open(&cfg, &m) < 0 && m == NULL);
  CHECK_MSG(strstr(tdm_last_error(), "cut.gguf") != NULL, "%s", tdm_last_error());
  remove(cut);
  /* experts of a type tandem neither computes in nor widens (tests/model/retype.py: Q3_K) */
  snprintf(path, sizeof path, "%s/qwen3moe-q3_k/model.gguf", model_dir());
  cfg.path = path;
  CHECK_RC(tdm_model_open(&cfg, &m), TDM_ENOTSUP);
  CHECK(m == NULL);
  const char *why = tdm_last_error();
  CHECK_MSG(strstr(why, "qwen3moe-q3_k/model.gguf") && strstr(why, "blk.1.ffn_down_exps") &&
                strstr(why, "Q3_K") && !strstr(why, "TDM_ENOTSUP: TDM_ENOTSUP"),
            "%s", why);
  th_close();
}

/* Mutants of a valid GGUF, the fixture `name` (truncations, byte flips, 8-byte fields
 * overwritten with huge or small values) opened as models: each loads and runs a token, or is
 * refused with a message naming the file; never a crash (the ASan build runs this too). The
 * CPU runs `many` of them, other devices a fifteenth. */
static void mutants(tdm_device *dev, const char *name, int many) {
  char path[1024], mut[1024];
  snprintf(path, sizeof path, "%s/%s/model.gguf", model_dir(), name);
  /* one file a process: the suite's devices run at once */
  snprintf(mut, sizeof mut, "%s/%s/mutant-%d.gguf", model_dir(), name, (int)getpid());
  FILE *f = fopen(path, "rb");
  CHECK(f != NULL);
  CHECK(fseek(f, 0, SEEK_END) == 0);
  long size = ftell(f);
  CHECK(size > 0 && fseek(f, 0, SEEK_SET) == 0);
  unsigned char *good = malloc((size_t)size), *bad = malloc((size_t)size);
  CHECK(good && bad && fread(good, 1, (size_t)size, f) == (size_t)size);
  fclose(f);
  uint64_t rng = th_seed();
  /* The file is read the same way on every device: many mutants on the CPU, where a model
   * opens in milliseconds; a few where opening builds a device's kernels. */
  tdm_device_info di;
  CHECK_OK(tdm_device_info_get(dev, &di));
  int loaded = 0, refused = 0, n = strcmp(di.backend, "cpu") == 0 ? many : many / 15;
  if (getenv("TANDEM_TEST_MODEL_MUTANTS")) n = atoi(getenv("TANDEM_TEST_MODEL_MUTANTS"));
  for (int i = 0; i < n; i++) {
    memcpy(bad, good, (size_t)size);
    size_t len = (size_t)size;
    /* most of a GGUF's structure is in its first few KiB: mutate there mostly */
    size_t head = (size_t)size < 65536 ? (size_t)size : 65536;
    switch (th_rand_below(&rng, 3)) {
    case 0: len = th_rand_below(&rng, (uint64_t)size); break;
    case 1:
      for (int k = 0; k < 4; k++) bad[th_rand_below(&rng, head)] ^= (unsigned char)(1u << th_rand_below(&rng, 8));
      break;
    default: {
      size_t at = th_rand_below(&rng, head - 8);
      uint64_t v = th_rand_below(&rng, 2) ? UINT64_MAX - th_rand_below(&rng, 16) : th_rand_below(&rng, 4);
      memcpy(bad + at, &v, 8);
    }
    }
    FILE *o = fopen(mut, "wb");
    CHECK(o && fwrite(bad, 1, len, o) == len && fclose(o) == 0);
    tdm_model_config cfg = {.path = mut, .device = dev, .threads = 1, .ctx = 8};
    tdm_model *m = NULL;
    int rc = tdm_model_open(&cfg, &m);
    if (rc == 0) {
      int32_t id = 1;
      float *logits = malloc(4096 * sizeof(float));
      tdm_model_info info;
      CHECK_OK(tdm_model_info_get(m, &info));
      if (info.vocab <= 4096) CHECK_OK(tdm_model_eval(m, &id, 1, logits, false, NULL));
      free(logits);
      tdm_model_close(m);
      loaded++;
    } else {
      CHECK_MSG(m == NULL, "a failed open set the model");
      CHECK_MSG(strstr(tdm_last_error(), "mutant-") || rc == TDM_ENOMEM,
                "mutant %d: %s says nothing of the file", i, tdm_last_error());
      refused++;
    }
  }
  remove(mut);
  printf("%s: %d mutants: %d loaded and ran, %d refused with a message\n", name, n, loaded,
         refused);
  free(good);
  free(bad);
}

/* The plain file, and one whose tensors mix the block types of a llama.cpp Q4_K_M file (Q4_K,
 * Q5_K, Q6_K, Q8_0 and F32), so that a mutated type or size lands among them. */
TEST_CASE(mutants) {
  tdm_device *dev = th_open();
  mutants(dev, "qwen3moe", 300);
  mutants(dev, "mixtral-llama-q4_k_m", 150);
  th_close();
}

/* tdm_model_peek reads what tdm_model_open would report, loading nothing. */
TEST_CASE(peek_matches_open) {
  tdm_device *dev = th_open();
  const char *which[] = {"qwen3moe/model.gguf", "qwen3moe/hf", "mixtral/model.gguf", "mixtral/hf"};
  for (int i = 0; i < 4; i++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", model_dir(), which[i]);
    tdm_model_info a, b;
    CHECK_OK(tdm_model_peek(path, &a));
    tdm_model_config cfg = {.path = path, .device = dev, .threads = 1};
    tdm_model *m = NULL;
    CHECK_OK(tdm_model_open(&cfg, &m));
    CHECK_OK(tdm_model_info_get(m, &b));
    CHECK(strcmp(a.arch, b.arch) == 0 && strcmp(a.format, b.format) == 0);
    CHECK(a.layers == b.layers && a.hidden == b.hidden && a.heads == b.heads &&
          a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.vocab == b.vocab &&
          a.experts == b.experts && a.topk == b.topk && a.expert_ffn == b.expert_ffn &&
          a.ctx == b.ctx && a.ubatch == b.ubatch && a.host_bytes == b.host_bytes &&
          a.expert_bytes == b.expert_bytes && a.tied_embeddings == b.tied_embeddings &&
          a.rope_neox == b.rope_neox && a.qk_norm == b.qk_norm);
    CHECK(strcmp(a.weight_type, b.weight_type) == 0);
    tdm_model_close(m);
  }
  tdm_model_info none;
  CHECK(tdm_model_peek("/nonexistent/m.gguf", &none) < 0);
  CHECK_RC(tdm_model_peek(NULL, &none), TDM_EINVAL);
  th_close();
}
