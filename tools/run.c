/* run.c: `tandem run` (a prompt of token ids through a whole model from its file, then greedy
 * decoding) and `tandem bench -m` (prefill and decode rates in llama-bench's rows: pp512,
 * tg32, tokens/s with its spread, one row per device budget), on tandem/model.h. */
#include "tool.h"

#include "measure.h" /* bu_seconds */

#include <tandem/model.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char run_help[] =
    "usage: tandem run -m FILE [--tokens IDS | -p N] [-n N] [--device D] [--device-budget B]\n"
    "                  [--ctx N] [--ubatch N] [--placement P] [--experts-bf16] [--dense-f32]\n"
    "                  [--seed S] [--json]\n"
    "                  [--logits FILE]\n"
    "\n"
    "Runs a prompt through a whole MoE model (a GGUF file, or a Hugging Face folder with\n"
    "config.json and safetensors) with its experts streamed from host memory, then decodes\n"
    "greedily. Token ids in, token ids out: no tokenizer.\n"
    "\n"
    "  -m, --model FILE     the model: a .gguf file or a safetensors folder\n"
    "  --tokens IDS         the prompt, comma-separated token ids\n"
    "  -p, --prompt N       a prompt of N pseudo-random ids instead (default 32)\n"
    "  -n, --decode N       tokens to generate (default 16)\n"
    "  --device D           the device (default: $TANDEM_DEVICE, else the first)\n"
    "  --devices LIST       expert parallelism: each layer's routed experts dealt out between\n"
    "                       these devices (2 to 8, e.g. cuda:0,cuda:1), attention and the\n"
    "                       dense weights on the first (which is --device, or replaces it);\n"
    "                       placement device (its default then); the budget is each device's\n"
    "  --device-budget B    device memory for resident experts: bytes (8GiB), or a share of\n"
    "                       all experts (50%); 0 streams every expert (default 0)\n"
    "  --ctx N              KV cache positions (default: prompt + decode)\n"
    "  --ubatch N           the most tokens a device pass takes (default 512)\n"
    "  --placement P        where a decode step computes the experts the device does not\n"
    "                       hold: auto (a share on the host CPU, from pinned memory, while\n"
    "                       the link copies the rest; the default), device (copy them all)\n"
    "                       or host (compute them all on the host)\n"
    "  --experts-bf16       widen the experts to bf16 at load even where the device computes\n"
    "                       them in the file's format (Q8_0, Q4_K, Q6_K, MXFP4): more bytes\n"
    "                       on the link, for comparing\n"
    "  --dense-f32          widen the embedding, projections and LM head to f32 at load even\n"
    "                       where the device reads them as the file keeps them (F16, BF16,\n"
    "                       and on the CPU Q8_0, Q4_K, Q6_K, MXFP4): more bytes, for comparing\n"
    "  --seed S             the pseudo-random prompt's seed (default 1)\n"
    "  --json               print the results as JSON on stdout\n"
    "  --logits FILE        write every prompt position's logits and every decode step's\n"
    "                       (the last generated token's included) to FILE, float64, in the\n"
    "                       layout of tests/model/ref_model.py (magic TNDREF01)\n"
    "  -h, --help           show this help\n";

static const char bench_help[] =
    "usage: tandem bench -m FILE [-p LIST] [-n LIST] [--device-budget LIST] [-r N]\n"
    "                    [--device D] [--ubatch N] [--placement P] [--experts-bf16]\n"
    "                    [--dense-f32] [--json]\n"
    "\n"
    "Prefill (ppN: N prompt tokens in ubatches) and decode (tgN: N tokens one at a time from an\n"
    "empty cache) rates of a whole model, in tokens per second, the mean and standard\n"
    "deviation over repetitions after one warm-up, as llama-bench prints them; with the\n"
    "expert bytes each test moved over the link (GB/s, and against the link's measured peak\n"
    "in --json), and the share of its time a run without the MoE blocks takes (attention,\n"
    "the dense projections, the embedding and the LM head).\n"
    "\n"
    "  -m, --model FILE       the model: a .gguf file or a safetensors folder\n"
    "  -p, --prompt LIST      prompt lengths (default 512)\n"
    "  -n, --decode LIST      decode lengths (default 32; 0 for none)\n"
    "  --device-budget LIST   budgets, each bytes or a share of all experts (default 0)\n"
    "  -r, --repetitions N    timed runs of each test (default 3)\n"
    "  --device D, --devices LIST, --ubatch N, --placement P, --experts-bf16,\n"
    "  --dense-f32, --json    as for 'tandem run'\n"
    "  -h, --help             show this help\n";

enum { MAX_LIST = 16 };

typedef struct run_opts {
  const char *model, *device, *devices, *tokens, *logits;
  tdm_device *devs[TDM_MOE_DEVICES_MAX]; /* --devices (ndevs of them), found at run time */
  int ndevs;
  bool placement_given;
  long prompt[MAX_LIST], decode[MAX_LIST];
  int nprompt, ndecode;
  double budget_pct[MAX_LIST]; /* < 0: budget_bytes[i] */
  size_t budget_bytes[MAX_LIST];
  int nbudget;
  long ctx, ubatch, seed, reps;
  int json;
  tdm_moe_placement placement;
  bool experts_bf16, dense_f32;
} run_opts;

enum { OPT_DEVICE = TOOL_OPT_LONG, OPT_BUDGET, OPT_CTX, OPT_UBATCH, OPT_SEED, OPT_JSON,
       OPT_TOKENS, OPT_MODEL, OPT_PROMPT, OPT_DECODE, OPT_REPS, OPT_LOGITS, OPT_PLACEMENT,
       OPT_EXPERTS_BF16, OPT_DENSE_F32, OPT_DEVICES };

static const struct option run_options[] = {
    {"model", required_argument, NULL, OPT_MODEL},
    {"tokens", required_argument, NULL, OPT_TOKENS},
    {"prompt", required_argument, NULL, OPT_PROMPT},
    {"decode", required_argument, NULL, OPT_DECODE},
    {"repetitions", required_argument, NULL, OPT_REPS},
    {"logits", required_argument, NULL, OPT_LOGITS},
    {"device", required_argument, NULL, OPT_DEVICE},
    {"devices", required_argument, NULL, OPT_DEVICES},
    {"device-budget", required_argument, NULL, OPT_BUDGET},
    {"ctx", required_argument, NULL, OPT_CTX},
    {"ubatch", required_argument, NULL, OPT_UBATCH},
    {"seed", required_argument, NULL, OPT_SEED},
    {"placement", required_argument, NULL, OPT_PLACEMENT},
    {"experts-bf16", no_argument, NULL, OPT_EXPERTS_BF16},
    {"dense-f32", no_argument, NULL, OPT_DENSE_F32},
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* -m, -p, -n, -r are short forms: map them onto the long options before getopt sees them. */
static void short_forms(int argc, char **argv) {
  static char m[] = "--model", p[] = "--prompt", n[] = "--decode", r[] = "--repetitions";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--") == 0) break;
    if (strcmp(argv[i], "-m") == 0) argv[i] = m;
    else if (strcmp(argv[i], "-p") == 0) argv[i] = p;
    else if (strcmp(argv[i], "-n") == 0) argv[i] = n;
    else if (strcmp(argv[i], "-r") == 0) argv[i] = r;
  }
}

/* A comma-separated list of counts (zero allowed when zero_ok). */
static int parse_list(const char *cmd, const char *name, const char *v, long *out, int *n,
                      bool zero_ok) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", v);
  *n = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (*n == MAX_LIST) return tool_usage_error(cmd, "%s takes at most %d values", name, MAX_LIST), -1;
    if (zero_ok && strcmp(tok, "0") == 0) {
      out[(*n)++] = 0;
      continue;
    }
    if (tool_parse_count(cmd, name, tok, 1 << 20, &out[*n])) return -1;
    (*n)++;
  }
  if (!*n) return tool_usage_error(cmd, "%s wants a value", name), -1;
  return 0;
}

/* --device-budget: a list of bytes, 0, or percentages of all experts. */
static int parse_budgets(const char *cmd, const char *v, run_opts *o) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", v);
  o->nbudget = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (o->nbudget == MAX_LIST)
      return tool_usage_error(cmd, "--device-budget takes at most %d values", MAX_LIST), -1;
    int i = o->nbudget++;
    size_t len = strlen(tok);
    o->budget_pct[i] = -1;
    o->budget_bytes[i] = 0;
    if (len && tok[len - 1] == '%') {
      char *end;
      tok[len - 1] = 0;
      double p = strtod(tok, &end);
      if (end == tok || *end || !(p >= 0 && p <= 100))
        return tool_usage_error(cmd, "--device-budget wants 0..100%%, not '%s%%'", tok), -1;
      o->budget_pct[i] = p;
    } else if (strcmp(tok, "0") != 0 &&
               tool_parse_size(cmd, "--device-budget", tok, &o->budget_bytes[i])) {
      return -1;
    }
  }
  return o->nbudget ? 0 : (tool_usage_error(cmd, "--device-budget wants a value"), -1);
}

static int parse(const char *cmd, int argc, char **argv, run_opts *o) {
  const char *v;
  int c;
  short_forms(argc, argv);
  while ((c = tool_getopt(cmd, argc, argv, run_options, &v)) != -1) {
    switch (c) {
    case 'h': fputs(strcmp(cmd, "run") == 0 ? run_help : bench_help, stdout); return 1;
    case OPT_MODEL: o->model = v; break;
    case OPT_TOKENS: o->tokens = v; break;
    case OPT_DEVICE: o->device = v; break;
    case OPT_DEVICES: o->devices = v; break;
    case OPT_JSON: o->json = 1; break;
    case OPT_LOGITS: o->logits = v; break;
    case OPT_PROMPT:
      if (parse_list(cmd, "--prompt", v, o->prompt, &o->nprompt, false)) return -1;
      break;
    case OPT_DECODE:
      if (parse_list(cmd, "--decode", v, o->decode, &o->ndecode, true)) return -1;
      break;
    case OPT_BUDGET:
      if (parse_budgets(cmd, v, o)) return -1;
      break;
    case OPT_CTX: if (tool_parse_count(cmd, "--ctx", v, 1 << 20, &o->ctx)) return -1; break;
    case OPT_UBATCH: if (tool_parse_count(cmd, "--ubatch", v, 1 << 16, &o->ubatch)) return -1; break;
    case OPT_SEED: if (tool_parse_count(cmd, "--seed", v, 1L << 40, &o->seed)) return -1; break;
    case OPT_REPS: if (tool_parse_count(cmd, "--repetitions", v, 1000, &o->reps)) return -1; break;
    case OPT_EXPERTS_BF16: o->experts_bf16 = true; break;
    case OPT_DENSE_F32: o->dense_f32 = true; break;
    case OPT_PLACEMENT:
      o->placement_given = true;
      if (strcmp(v, "auto") == 0) o->placement = TDM_MOE_PLACE_AUTO;
      else if (strcmp(v, "device") == 0) o->placement = TDM_MOE_PLACE_DEVICE;
      else if (strcmp(v, "host") == 0) o->placement = TDM_MOE_PLACE_HOST;
      else return tool_usage_error(cmd, "--placement is auto, device or host, not '%s'", v), -1;
      break;
    default: return -1;
    }
  }
  if (!o->model) return tool_usage_error(cmd, "-m FILE is required"), -1;
  if (o->devices && !o->placement_given) o->placement = TDM_MOE_PLACE_DEVICE;
  if (o->devices && o->placement != TDM_MOE_PLACE_DEVICE)
    return tool_usage_error(cmd, "--devices computes every routed expert on a device: "
                            "--placement device only"), -1;
  if (strcmp(cmd, "run") == 0 && (o->nprompt > 1 || o->ndecode > 1 || o->nbudget > 1))
    return tool_usage_error(cmd, "tandem run takes one prompt, decode and budget"), -1;
  if (o->tokens && o->nprompt) return tool_usage_error(cmd, "--tokens or -p, not both"), -1;
  if (o->logits && strcmp(cmd, "run") != 0)
    return tool_usage_error(cmd, "--logits is tandem run's"), -1;
  return 0;
}

/* ---- loading, with progress on stderr ---------------------------------------------------- */

static void show_progress(void *user, const char *what, double done) {
  (void)user;
  if (!isatty(2)) return;
  fprintf(stderr, "\r  loading %-8s %3d%%", what, (int)(done * 100 + 0.5));
  if (done >= 1.0) fputc('\n', stderr);
  fflush(stderr);
}

/* Opens the model with budget i of o (a share of the experts' bytes, which the file's
 * metadata gives: tdm_model_peek). */
static int open_model(const run_opts *o, tdm_device *dev, int i, int ctx, tdm_model **m) {
  tdm_model_config cfg = {.path = o->model, .device = dev, .ctx = ctx, .ubatch = (int)o->ubatch,
                          .predict = true, .placement = o->placement,
                          .experts_bf16 = o->experts_bf16, .dense_f32 = o->dense_f32,
                          .devices = o->ndevs ? o->devs : NULL, .ndevices = o->ndevs,
                          .progress = show_progress};
  int rc = 0;
  if (o->nbudget && o->budget_pct[i] < 0) cfg.budget_bytes = o->budget_bytes[i];
  if (o->nbudget && o->budget_pct[i] > 0) {
    tdm_model_info info;
    if (!(rc = tdm_model_peek(o->model, &info))) {
      size_t all = o->experts_bf16 ? (size_t)3 * info.hidden * info.expert_ffn * 2 *
                                         (size_t)info.experts * (size_t)info.layers
                                   : info.host_bytes;
      cfg.budget_bytes = (size_t)(all * (o->budget_pct[i] / 100.0));
      if (cfg.budget_bytes < info.expert_bytes) cfg.budget_bytes = info.expert_bytes;
    }
  }
  fprintf(stderr, "tandem: loading %s\n", o->model);
  double t0 = bu_seconds();
  if (!rc) rc = tdm_model_open(&cfg, m);
  if (!rc) fprintf(stderr, "tandem: loaded in %.1f s\n", bu_seconds() - t0);
  return rc ? tool_fail("loading the model", rc) : TOOL_OK;
}

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void random_ids(int32_t *ids, int n, int vocab, uint64_t seed) {
  for (int i = 0; i < n; i++) ids[i] = (int32_t)(splitmix(&seed) % (uint64_t)vocab);
}


/* --logits: ref_model.py's layout (magic, V, rows, prompt, generated; float64 rows; the
 * generated ids), little-endian as this machine is. 0, or -1 after saying why. */
static int write_logits(const char *path, const float *rows, int np, int nd, int V,
                        const int32_t *ids) {
  FILE *f = fopen(path, "wb");
  int32_t hdr[4] = {V, np + nd, np, nd};
  bool ok = f && fwrite("TNDREF01", 1, 8, f) == 8 && fwrite(hdr, sizeof hdr, 1, f) == 1;
  for (size_t i = 0; ok && i < ((size_t)np + nd) * V; i++) {
    double d = rows[i];
    ok = fwrite(&d, sizeof d, 1, f) == 1;
  }
  ok = ok && fwrite(ids, sizeof *ids, (size_t)nd, f) == (size_t)nd;
  if (f && fclose(f) != 0) ok = false;
  if (!ok) fprintf(stderr, "tandem: cannot write the logits to '%s'\n", path);
  return ok ? 0 : -1;
}

static void print_ids(FILE *f, const int32_t *ids, int n) {
  for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? " " : "", ids[i]);
  fputc('\n', f);
}

static void json_info(bu_json *j, const tdm_model_info *in) {
  bu_json_object(j, "model");
  bu_json_string(j, "arch", in->arch);
  bu_json_string(j, "format", in->format);
  bu_json_string(j, "name", in->name);
  bu_json_string(j, "expert_type", in->weight_type);
  bu_json_string(j, "experts_as", in->expert_type); /* on the link and in the kernels */
  bu_json_uint(j, "expert_bytes", in->expert_bytes);
  bu_json_string(j, "dense_type", in->dense_type);
  bu_json_int(j, "layers", in->layers);
  bu_json_int(j, "hidden", in->hidden);
  bu_json_int(j, "heads", in->heads);
  bu_json_int(j, "kv_heads", in->kv_heads);
  bu_json_int(j, "head_dim", in->head_dim);
  bu_json_int(j, "vocab", in->vocab);
  bu_json_int(j, "experts", in->experts);
  bu_json_int(j, "topk", in->topk);
  bu_json_int(j, "expert_ffn", in->expert_ffn);
  bu_json_int(j, "ctx", in->ctx);
  bu_json_int(j, "ubatch", in->ubatch);
  bu_json_uint(j, "host_bytes", in->host_bytes);
  bu_json_uint(j, "device_bytes", in->device_bytes);
  bu_json_end(j);
}

int tool_cmd_run(int argc, char **argv) {
  run_opts o = {.seed = 1, .reps = 1, .placement = TDM_MOE_PLACE_AUTO};
  int prc = parse("run", argc, argv, &o);
  if (prc) return prc > 0 ? TOOL_OK : TOOL_USAGE;
  int np = o.nprompt ? (int)o.prompt[0] : 32, nd = o.ndecode ? (int)o.decode[0] : 16;
  int32_t *prompt = NULL;
  if (o.tokens) { /* the ids: digits and commas */
    np = 1;
    for (const char *c = o.tokens; *c; c++) np += *c == ',';
    if (!(prompt = malloc((size_t)np * sizeof *prompt))) return tool_fail("malloc", TDM_ENOMEM);
    char *end;
    const char *at = o.tokens;
    for (int i = 0; i < np; i++) {
      long v = strtol(at, &end, 10);
      if (end == at || (*end && *end != ',') || v < 0 || v > INT32_MAX) {
        free(prompt);
        return tool_usage_error("run", "--tokens wants comma-separated ids, not '%s'", o.tokens);
      }
      prompt[i] = (int32_t)v;
      at = end + 1;
    }
  }
  int rc = tdm_init();
  if (rc) return tool_fail("tdm_init", rc);
  int code = tool_find_devices("run", o.device, o.devices, o.devs, TDM_MOE_DEVICES_MAX,
                               &o.ndevs);
  tdm_device *dev = o.devs[0];
  tdm_model *m = NULL;
  if (code == TOOL_OK) code = open_model(&o, dev, 0, o.ctx ? (int)o.ctx : np + nd, &m);
  tdm_model_info info;
  int32_t *out = malloc(((size_t)nd + 1) * sizeof *out);
  float *logits = NULL, *rows = NULL; /* rows: --logits's, (np + nd) x vocab */
  double t_pre = 0, t_dec = 0;
  tdm_model_stats st, sum = {0};
  if (code == TOOL_OK) {
    tdm_model_info_get(m, &info);
    logits = malloc((size_t)info.vocab * sizeof *logits);
    if (o.logits) rows = malloc(((size_t)np + nd) * info.vocab * sizeof *rows);
    if (!out || !logits || (o.logits && !rows)) code = tool_fail("malloc", TDM_ENOMEM);
  }
  if (code == TOOL_OK && !prompt) {
    if (!(prompt = malloc((size_t)np * sizeof *prompt))) code = tool_fail("malloc", TDM_ENOMEM);
    else random_ids(prompt, np, info.vocab, (uint64_t)o.seed);
  }
  size_t V = code == TOOL_OK ? (size_t)info.vocab : 0;
  if (code == TOOL_OK && (rc = tdm_model_eval(m, prompt, np, rows ? rows : logits, rows != NULL,
                                              &st)))
    code = tool_fail("the prompt", rc);
  if (code == TOOL_OK && rows) memcpy(logits, rows + (size_t)(np - 1) * V, V * sizeof *logits);
  t_pre = st.seconds;
  const float *cur = logits; /* the logits the next token is chosen from */
  for (int i = 0; code == TOOL_OK && i < nd; i++) {
    out[i] = tdm_model_argmax(cur, info.vocab);
    if (i + 1 == nd && !rows) break; /* the last one need not be run */
    if ((rc = tdm_model_step(m, out[i], &cur, &st))) code = tool_fail("decoding", rc);
    if (rows && cur) memcpy(rows + ((size_t)np + i) * V, cur, V * sizeof *cur);
    if (i + 1 < nd) t_dec += st.seconds;
    sum.moe.bytes_copied += st.moe.bytes_copied;
  }
  if (code == TOOL_OK && rows && write_logits(o.logits, rows, np, nd, (int)V, out))
    code = TOOL_FAILED;
  if (code == TOOL_OK) {
    double pre = np / t_pre, dec = nd > 1 ? (nd - 1) / t_dec : 0;
    if (o.json) {
      bu_json j;
      bu_json_init(&j, stdout, 2);
      bu_json_object(&j, NULL);
      tool_json_header(&j);
      json_info(&j, &info);
      bu_json_string(&j, "device", o.device ? o.device : "");
      bu_json_string(&j, "devices", o.devices); /* --devices as given, or null */
      bu_json_array(&j, "prompt");
      for (int i = 0; i < np; i++) bu_json_int(&j, NULL, prompt[i]);
      bu_json_end(&j);
      bu_json_array(&j, "generated");
      for (int i = 0; i < nd; i++) bu_json_int(&j, NULL, out[i]);
      bu_json_end(&j);
      bu_json_double(&j, "prefill_tokens_per_s", pre, 2);
      bu_json_double(&j, "decode_tokens_per_s", dec, 2);
      bu_json_end(&j);
      if (bu_json_finish(&j) < 0) code = TOOL_FAILED;
    } else {
      printf("model: %s (%s, %s), %d layers, %d experts (top %d), vocabulary %d\n", o.model,
             info.arch, info.format, info.layers, info.experts, info.topk, info.vocab);
      if (o.devices) printf("devices: %s, each layer's routed experts dealt out\n", o.devices);
      printf("weights: experts %s (%.2f MiB each, in %s), dense %s on the device\n",
             info.weight_type, info.expert_bytes / 1048576.0, info.expert_type, info.dense_type);
      printf("prompt (%d): ", np);
      print_ids(stdout, prompt, np);
      printf("generated (%d): ", nd);
      print_ids(stdout, out, nd);
      printf("prefill: %.2f tokens/s (%d tokens in %.3f s)\n", pre, np, t_pre);
      if (nd > 1) printf("decode:  %.2f tokens/s (%d tokens in %.3f s)\n", dec, nd - 1, t_dec);
    }
  }
  tdm_model_close(m);
  free(prompt);
  free(out);
  free(logits);
  free(rows);
  tdm_shutdown();
  return code;
}

/* ---- tandem bench -m ----------------------------------------------------------------------- */

typedef struct bench_row {
  char test[32];
  double budget_share;  /* of all experts' bytes */
  double mean, sd;      /* tokens per second */
  double link_gbs;      /* expert bytes copied over the timed runs / their time */
  double host_experts;  /* routed experts computed on the host, a token (placement) */
  double non_moe_share; /* a run without the MoE blocks / a whole run: attention and the other
                           dense work's share of a step */
  double graph_share;   /* of the timed ubatches, those run as one recorded graph */
  double wait_share;    /* of the timed evals' time, the host waiting for the device at the
                           passes' ends (the rest: submitting, copies and the host's own work) */
  tdm_moe_placement_info place; /* the placement's calibration at this budget (all 0 where
                                   nothing was calibrated) */
} bench_row;

/* What bench_once adds up over a run's evals. */
typedef struct bench_sums {
  uint64_t bytes;        /* expert bytes copied */
  uint64_t host;         /* experts computed on the host */
  uint64_t ubatches, graphs;
  double seconds, wait;  /* the evals' time, and the passes' waits for the device */
} bench_sums;

/* One timed run of test (pp: n prompt tokens; tg: n decode steps) from an empty cache, its
 * evals' figures added to *sum. */
static int bench_once(tdm_model *m, bool pp, int n, int vocab, uint64_t seed, double *seconds,
                      bench_sums *sum) {
  int32_t *ids = malloc((size_t)n * sizeof *ids);
  float *logits = malloc((size_t)vocab * sizeof *logits);
  int rc = ids && logits ? tdm_model_rewind(m, 0) : TDM_ENOMEM;
  tdm_model_stats st;
  if (!rc) random_ids(ids, n, vocab, seed);
  double t0 = bu_seconds();
  const float *view;
  for (int i = 0; !rc && i < (pp ? 1 : n); i++)
    if (!(rc = pp ? tdm_model_eval(m, ids, n, logits, false, &st)
                  : tdm_model_step(m, ids[i], &view, &st))) {
      sum->bytes += st.moe.bytes_copied;
      sum->host += st.moe.host_experts;
      sum->ubatches += (uint64_t)st.ubatches;
      sum->graphs += (uint64_t)st.graph_steps;
      sum->seconds += st.seconds;
      sum->wait += st.moe.wait_seconds;
    }
  *seconds = bu_seconds() - t0;
  free(ids);
  free(logits);
  return rc;
}

static int bench_test(tdm_model *m, const run_opts *o, bool pp, int n, int vocab, bench_row *r) {
  double s, tsum = 0, sq = 0, busy = 0, bare = 0;
  bench_sums sum = {0}, ignored = {0};
  int rc = bench_once(m, pp, pp ? n : 1, vocab, 7, &s, &ignored); /* warm-up */
  for (int i = 0; !rc && i < o->reps; i++) {
    if ((rc = bench_once(m, pp, n, vocab, (uint64_t)(i + 11), &s, &sum))) break;
    double tps = n / s;
    busy += s;
    tsum += tps;
    sq += tps * tps;
  }
  /* the same run without the MoE blocks, once */
  if (!rc && !(rc = tdm_model_skip_moe(m, true)))
    rc = bench_once(m, pp, n, vocab, 11, &bare, &ignored);
  tdm_model_skip_moe(m, false);
  snprintf(r->test, sizeof r->test, "%s%d", pp ? "pp" : "tg", n);
  r->mean = tsum / o->reps;
  r->sd = o->reps > 1 ? sqrt(fmax(0.0, (sq - tsum * tsum / o->reps) / (o->reps - 1))) : 0.0;
  r->link_gbs = busy > 0 ? sum.bytes / busy / 1e9 : 0;
  r->host_experts = (double)sum.host / ((double)n * o->reps);
  r->non_moe_share = busy > 0 ? bare / (busy / o->reps) : 0;
  r->graph_share = sum.ubatches ? (double)sum.graphs / (double)sum.ubatches : 0;
  r->wait_share = sum.seconds > 0 ? sum.wait / sum.seconds : 0;
  return rc;
}

int tool_cmd_model_bench(int argc, char **argv) {
  run_opts o = {.seed = 1, .reps = 3, .placement = TDM_MOE_PLACE_AUTO};
  int prc = parse("bench", argc, argv, &o);
  if (prc) return prc > 0 ? TOOL_OK : TOOL_USAGE;
  if (!o.nprompt) o.prompt[o.nprompt++] = 512;
  if (!o.ndecode) o.decode[o.ndecode++] = 32;
  if (!o.nbudget) o.nbudget = 1;
  long ctx = 1;
  for (int i = 0; i < o.nprompt; i++) ctx = o.prompt[i] > ctx ? o.prompt[i] : ctx;
  for (int i = 0; i < o.ndecode; i++) ctx = o.decode[i] > ctx ? o.decode[i] : ctx;
  int rc = tdm_init();
  if (rc) return tool_fail("tdm_init", rc);
  int code = tool_find_devices("bench", o.device, o.devices, o.devs, TDM_MOE_DEVICES_MAX,
                               &o.ndevs);
  tdm_device *dev = o.devs[0];
  bench_row rows[MAX_LIST * 2 * MAX_LIST];
  int nrows = 0;
  tdm_model_info info = {0};
  tdm_device_info dinfo = {0};
  double peak = 0;
  if (code == TOOL_OK) tdm_device_info_get(dev, &dinfo);
  if (code == TOOL_OK && !(dinfo.caps & TDM_DEVICE_CAP_HOST_MEMORY) &&
      (rc = tool_measure_link(dev, &peak)))
    code = tool_fail("measuring the link", rc);
  if (!o.json && code == TOOL_OK) {
    printf("| model | budget | test | t/s | link GB/s | not MoE |\n"
           "| --- | ---: | ---: | ---: | ---: | ---: |\n");
    fflush(stdout);
  }
  for (int b = 0; code == TOOL_OK && b < o.nbudget; b++) {
    tdm_model *m = NULL;
    if ((code = open_model(&o, dev, b, (int)ctx, &m)) != TOOL_OK) break;
    tdm_model_info_get(m, &info);
    double share = o.budget_pct[b] >= 0 ? o.budget_pct[b] / 100.0
                   : info.host_bytes ? (double)o.budget_bytes[b] / info.host_bytes : 0;
    tdm_moe_placement_info place = {0}; /* all 0 where nothing was calibrated */
    tdm_moe_model *mm = tdm_model_moe(m);
    if (!mm || tdm_moe_placement_get(mm, &place)) memset(&place, 0, sizeof place);
    for (int t = 0; code == TOOL_OK && t < o.nprompt + o.ndecode; t++) {
      bool pp = t < o.nprompt;
      int n = (int)(pp ? o.prompt[t] : o.decode[t - o.nprompt]);
      if (!n) continue;
      bench_row *r = &rows[nrows];
      r->budget_share = share > 1 ? 1 : share;
      r->place = place;
      if ((rc = bench_test(m, &o, pp, n, info.vocab, r))) {
        code = tool_fail(pp ? "prefill" : "decode", rc);
        break;
      }
      nrows++;
      if (o.json) /* progress: the table goes to stdout at the end */
        fprintf(stderr, "tandem bench: %s at a %.0f%% budget: %.2f ± %.2f tokens/s\n", r->test,
                r->budget_share * 100, r->mean, r->sd);
      if (!o.json) {
        printf("| %s %s %dL | %.0f%% | %s | %.2f ± %.2f | %.1f | %.0f%% |\n", info.arch,
               info.weight_type, info.layers, r->budget_share * 100, r->test, r->mean, r->sd,
               r->link_gbs, r->non_moe_share * 100);
        fflush(stdout);
      }
    }
    tdm_model_close(m);
  }
  if (code == TOOL_OK && o.json) {
    bu_json j;
    bu_json_init(&j, stdout, 3);
    bu_json_object(&j, NULL);
    tool_json_header(&j);
    json_info(&j, &info);
    bu_json_string(&j, "device", dinfo.name);
    bu_json_string(&j, "devices", o.devices); /* --devices as given, or null */
    bu_json_int(&j, "repetitions", o.reps);
    bu_json_string(&j, "placement", o.placement == TDM_MOE_PLACE_AUTO     ? "auto"
                                    : o.placement == TDM_MOE_PLACE_HOST ? "host"
                                                                        : "device");
    bu_json_double(&j, "link_peak_gbs", peak, 3);
    bu_json_array(&j, "rows");
    for (int i = 0; i < nrows; i++) {
      bu_json_object(&j, NULL);
      bu_json_string(&j, "test", rows[i].test);
      bu_json_double(&j, "budget_share", rows[i].budget_share, 3);
      bu_json_double(&j, "tokens_per_s", rows[i].mean, 3);
      bu_json_double(&j, "tokens_per_s_sd", rows[i].sd, 3);
      bu_json_double(&j, "link_gbs", rows[i].link_gbs, 3);
      bu_json_double(&j, "link_utilization", peak > 0 ? rows[i].link_gbs / peak : 0, 3);
      bu_json_double(&j, "non_moe_share", rows[i].non_moe_share, 3);
      bu_json_double(&j, "host_experts_per_token", rows[i].host_experts, 2);
      bu_json_double(&j, "graph_share", rows[i].graph_share, 3);
      bu_json_double(&j, "wait_share", rows[i].wait_share, 3);
      /* the host's and the link's calibrated GB/s of expert bytes (the host's: the blocks
       * read), alone and at once, and the share of non-resident experts put on the host */
      bu_json_double(&j, "host_gbs", rows[i].place.host_gbs, 2);
      bu_json_double(&j, "host_gbs_shared", rows[i].place.host_gbs_shared, 2);
      bu_json_double(&j, "link_gbs_alone", rows[i].place.link_gbs, 2);
      bu_json_double(&j, "link_gbs_shared", rows[i].place.link_gbs_shared, 2);
      bu_json_double(&j, "host_share", rows[i].place.host_share, 3);
      bu_json_int(&j, "host_threads", rows[i].place.host_threads);
      bu_json_end(&j);
    }
    bu_json_end(&j);
    bu_json_end(&j);
    if (bu_json_finish(&j) < 0) code = TOOL_FAILED;
  }
  tdm_shutdown();
  return code;
}
