/* moe.c: `tandem moe`: MoE layers whose experts stream from pinned host memory through the
 * expert streamer while the compute queue works. It runs the same prefill (and decode) three
 * ways in one process: all experts resident (the reference output and the compute-only time),
 * streamed and overlapped, and streamed serialized; then it reports tokens/s, bytes copied,
 * link utilization against a raw pinned copy measured at start-up, the hidden fraction, where
 * the routed experts were found (resident, covered by a copy in flight, demand miss), the
 * staging slots, and whether the streamed output is bitwise equal to the all-resident output
 * (within a relative tolerance when experts were computed on the host, --placement); for
 * decode, the bytes copied per token and the bound the link sets from them. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <tandem.h>
#include <tandem/moe.h>
#include <tandem/streamer.h>

#include "measure.h"
#include "tool.h"

static const char moe_help[] =
    "usage: tandem moe [--preset P] [--device D] [--devices D,D..] [--layers N] [--tokens T]\n"
    "                  [--ubatch U]\n"
    "                  [--decode N] [--device-budget B] [--cache-policy static|lru] [--slots N]\n"
    "                  [--prefetch-depth N] [--skew S] [--locality R] [--seed N] [--predict]\n"
    "                  [--predict-depth D] [--experts-type T]\n"
    "                  [--placement auto|device|host] [--host-share S] [--host-queues N]\n"
    "                  [--host-threads N] [--time-link] [--time-host] [--time-chain]\n"
    "                  [--rebalance] [--no-overlap] [--no-check] [--json] [--trace FILE]\n"
    "\n"
    "Runs a stack of MoE layers, x += MoE(RMSNorm(x)), with the routed experts in pinned host\n"
    "memory, streamed to the device on copy queues while the compute queue works. The same\n"
    "work runs all-resident (the reference), streamed and overlapped, and streamed serialized;\n"
    "each run is timed after an untimed warm-up (for the first run of the process, its whole\n"
    "workload). The table reports tokens/s, the time the host waited for the device, bytes\n"
    "copied, where the routed experts were found (resident: a cache hit; in flight: covered\n"
    "by a copy already on its way; miss: copied on demand), link utilization, hidden\n"
    "fraction, the host's time per expert, the experts computed on the host, and the check\n"
    "of the streamed output against the all-resident one (bitwise; within a relative L2\n"
    "tolerance when experts were computed on the host). With --decode, the decode line gives\n"
    "the bytes copied per decode token and the bound the link sets from them (peak / bytes\n"
    "per token); with experts on the host, also the bytes the host read and the bounds the\n"
    "calibrated link and host rates set from both (this run's split and the best one).\n"
    "\n"
    "  --preset P         tiny (default), qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3,\n"
    "                     mixtral-8x7b. The large presets hold tens to hundreds of GiB of\n"
    "                     experts: use --layers to run fewer layers so they fit in host memory\n"
    "  --device D         cpu:0, cuda:0, ... (default: the default device)\n"
    "  --devices LIST     expert parallelism: each layer's routed experts dealt out between\n"
    "                     these devices (2 to 8, comma-separated, e.g. cuda:0,cuda:1) by\n"
    "                     popularity, for even loads, each streaming its share on its own copy\n"
    "                     queues; the first (which is --device, or replaces it) routes and\n"
    "                     adds the others' partial sums. Placement device (its default then);\n"
    "                     the budget and slots are each device's; the link utilization uses\n"
    "                     the devices' peaks summed, and each device's is printed too; the\n"
    "                     check takes a tolerance (the sums group the experts by device)\n"
    "  --rebalance        with --devices: run the whole workload once, untimed, then deal\n"
    "                     the experts out again by the load it measured\n"
    "  --layers N         layers to run (default: the preset's)\n"
    "  --tokens T         prefill tokens (default 256)\n"
    "  --ubatch U         tokens per forward pass, at most T (default: min(T, 2048))\n"
    "  --decode N         decode N tokens one at a time after the prefill (default 0)\n"
    "  --device-budget B  device memory for resident experts: bytes (8GiB) or a percentage of\n"
    "                     all experts (25%); 0 keeps nothing resident (default 0)\n"
    "  --cache-policy C   static: the most popular experts stay resident (prefill); lru: every\n"
    "                     slot is one LRU cache (decode). Default static\n"
    "  --slots N          staging slots besides the budget (default 16, or 64 where --ubatch\n"
    "                     is over 4096)\n"
    "  --prefetch-depth N prefetch copies in flight at most (default: static, a layer's\n"
    "                     experts; lru, the staging slots)\n"
    "  --skew S           Zipf exponent of expert popularity (default 1.0)\n"
    "  --locality R       correlation of successive decode tokens, 0..0.99 (default 0.8)\n"
    "  --seed N           weights and inputs (default 1)\n"
    "  --experts-type T   the routed experts' format in host memory, on the link and in the\n"
    "                     kernels: bf16 (default), f16, q8_0, q4_k, q6_k, mxfp4 (GGUF's\n"
    "                     blocks, random), or q4_k_m (Q4_K gate and up, Q6_K down); every\n"
    "                     block type needs the preset's sizes to be whole blocks (256 values\n"
    "                     for the K types)\n"
    "  --predict          look ahead: layer L+1's router on layer L's input picks experts to\n"
    "                     prefetch while layer L computes (decode)\n"
    "  --predict-depth D  with --predict (which it implies), predict layers L+1 .. L+D from\n"
    "                     layer L's input and prefetch their experts in layer order, so\n"
    "                     copies stay queued while the host computes (default 1, at most 16)\n"
    "  --placement P      where a decode-sized ubatch (32 tokens at most) computes its routed\n"
    "                     experts that are neither on the device nor on their way: device\n"
    "                     copies them there; host computes them all on the host CPU from\n"
    "                     their pinned copies; auto (default) a share of them on the host, set\n"
    "                     by a cost model calibrated at start-up so the host and the link\n"
    "                     finish together (the all-resident reference always uses device)\n"
    "  --host-share S     with --placement auto, compute this share (0 < S <= 1) of a\n"
    "                     layer's non-resident experts on the host instead of the cost\n"
    "                     model's (which is still calibrated and reported)\n"
    "  --host-queues N    host experts run on N queues of cpu:0 (default 1)\n"
    "  --host-threads N   each host expert's rows are split between N threads (default:\n"
    "                     TANDEM_MOE_CPU_THREADS if set, else the cores less 4 beside a GPU,\n"
    "                     left to the threads that feed it)\n"
    "  --time-link        time every expert copy on the device and report how long the link\n"
    "                     was busy during decode (the copy queues then complete eagerly)\n"
    "  --time-host        time the host experts on the host queues and report how long the\n"
    "                     host computed experts during decode (those queues then complete\n"
    "                     eagerly)\n"
    "  --time-chain       time each decode layer's chain on the compute queue and report,\n"
    "                     per layer, how long the routing took to come back, the host's\n"
    "                     turnaround, the device's experts, the wait for the host's, and\n"
    "                     the combine (that queue then completes eagerly)\n"
    "  --no-overlap       run only the serialized pass (copy and compute alternate)\n"
    "  --no-check         skip the all-resident reference run and the bitwise check\n"
    "  --json             print JSON on stdout instead of the table\n"
    "  --trace FILE       write a Chrome trace of every command to FILE\n"
    "  -h, --help         show this help\n";

typedef struct moe_opts {
  const char *preset, *device, *devices, *trace, *etype;
  tdm_moe_wfmt fmt;
  long layers, tokens, ubatch, decode, slots, depth, seed;
  double skew, locality, budget_pct, host_share;
  size_t budget_bytes;
  long host_queues, host_threads, predict_depth;
  int policy, serialized_only, check, json, predict, placement, placement_given, time_link,
      time_host, time_chain, rebalance;
} moe_opts;

static int parse_double(const char *s, double lo, double hi, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= lo && v <= hi)) return -1;
  *out = v;
  return 0;
}

/* Reports a usage error for `tandem moe` and yields -1, parse()'s code for one. */
#define USAGE(...) (tool_usage_error("moe", __VA_ARGS__), -1)

/* --device-budget: bytes (8GiB), 0, or a percentage of all experts (25%). */
static int parse_budget(const char *v, moe_opts *o) {
  size_t len = strlen(v);
  o->budget_pct = -1;
  o->budget_bytes = 0;
  if (len && v[len - 1] == '%') {
    char num[32];
    snprintf(num, sizeof num, "%.*s", (int)(len - 1), v);
    if (parse_double(num, 0, 100, &o->budget_pct))
      return USAGE("--device-budget wants 0..100%%, not '%s'", v);
    return 0;
  }
  if (strcmp(v, "0") == 0) return 0;
  return tool_parse_size("moe", "--device-budget", v, &o->budget_bytes);
}

/* --experts-type: a name of the table below. */
static int parse_etype(const char *v, moe_opts *o) {
  static const struct {
    const char *name;
    tdm_moe_wfmt fmt;
  } types[] = {{"bf16", {TDM_MOE_W_BF16, TDM_MOE_W_BF16}}, {"f16", {TDM_MOE_W_F16, TDM_MOE_W_F16}},
               {"q8_0", {TDM_MOE_W_Q8_0, TDM_MOE_W_Q8_0}}, {"q4_k", {TDM_MOE_W_Q4_K, TDM_MOE_W_Q4_K}},
               {"q6_k", {TDM_MOE_W_Q6_K, TDM_MOE_W_Q6_K}},
               {"mxfp4", {TDM_MOE_W_MXFP4, TDM_MOE_W_MXFP4}},
               {"q4_k_m", {TDM_MOE_W_Q4_K, TDM_MOE_W_Q6_K}}};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (strcmp(v, types[i].name) == 0) {
      o->etype = types[i].name;
      o->fmt = types[i].fmt;
      return 0;
    }
  return USAGE("--experts-type is bf16, f16, q8_0, q4_k, q6_k, mxfp4 or q4_k_m, not '%s'", v);
}

enum {
  OPT_PRESET = TOOL_OPT_LONG, OPT_DEVICE, OPT_LAYERS, OPT_TOKENS, OPT_UBATCH, OPT_DECODE,
  OPT_BUDGET, OPT_POLICY, OPT_SLOTS, OPT_DEPTH, OPT_SKEW, OPT_LOCALITY, OPT_SEED, OPT_PREDICT,
  OPT_NO_OVERLAP, OPT_NO_CHECK, OPT_JSON, OPT_TRACE, OPT_PLACEMENT, OPT_HOST_QUEUES,
  OPT_HOST_THREADS, OPT_HOST_SHARE, OPT_PREDICT_DEPTH, OPT_TIME_LINK,
  OPT_TIME_HOST, OPT_TIME_CHAIN, OPT_EXPERTS_TYPE, OPT_DEVICES, OPT_REBALANCE
};

static const struct option moe_options[] = {
    {"preset", required_argument, NULL, OPT_PRESET},
    {"device", required_argument, NULL, OPT_DEVICE},
    {"devices", required_argument, NULL, OPT_DEVICES},
    {"rebalance", no_argument, NULL, OPT_REBALANCE},
    {"layers", required_argument, NULL, OPT_LAYERS},
    {"tokens", required_argument, NULL, OPT_TOKENS},
    {"ubatch", required_argument, NULL, OPT_UBATCH},
    {"decode", required_argument, NULL, OPT_DECODE},
    {"device-budget", required_argument, NULL, OPT_BUDGET},
    {"cache-policy", required_argument, NULL, OPT_POLICY},
    {"slots", required_argument, NULL, OPT_SLOTS},
    {"prefetch-depth", required_argument, NULL, OPT_DEPTH},
    {"skew", required_argument, NULL, OPT_SKEW},
    {"locality", required_argument, NULL, OPT_LOCALITY},
    {"seed", required_argument, NULL, OPT_SEED},
    {"predict", no_argument, NULL, OPT_PREDICT},
    {"predict-depth", required_argument, NULL, OPT_PREDICT_DEPTH},
    {"time-link", no_argument, NULL, OPT_TIME_LINK},
    {"time-host", no_argument, NULL, OPT_TIME_HOST},
    {"time-chain", no_argument, NULL, OPT_TIME_CHAIN},
    {"no-overlap", no_argument, NULL, OPT_NO_OVERLAP},
    {"no-check", no_argument, NULL, OPT_NO_CHECK},
    {"json", no_argument, NULL, OPT_JSON},
    {"trace", required_argument, NULL, OPT_TRACE},
    {"placement", required_argument, NULL, OPT_PLACEMENT},
    {"host-queues", required_argument, NULL, OPT_HOST_QUEUES},
    {"host-threads", required_argument, NULL, OPT_HOST_THREADS},
    {"host-share", required_argument, NULL, OPT_HOST_SHARE},
    {"experts-type", required_argument, NULL, OPT_EXPERTS_TYPE},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* One option with a value (or a flag) into o: 0, or -1 after reporting a usage error. */
static int parse_option(int c, const char *v, moe_opts *o) {
  static const char cmd[] = "moe";
  switch (c) {
    case OPT_PRESET: o->preset = v; return 0;
    case OPT_DEVICE: o->device = v; return 0;
    case OPT_DEVICES: o->devices = v; return 0;
    case OPT_REBALANCE: o->rebalance = 1; return 0;
    case OPT_TRACE: o->trace = v; return 0;
    case OPT_JSON: o->json = 1; return 0;
    case OPT_NO_OVERLAP: o->serialized_only = 1; return 0;
    case OPT_NO_CHECK: o->check = 0; return 0;
    case OPT_PREDICT: o->predict = 1; return 0;
    case OPT_TIME_LINK: o->time_link = 1; return 0;
    case OPT_TIME_HOST: o->time_host = 1; return 0;
    case OPT_TIME_CHAIN: o->time_chain = 1; return 0;
    case OPT_PREDICT_DEPTH:
      o->predict = 1;
      return tool_parse_count(cmd, "--predict-depth", v, TDM_MOE_PREDICT_DEPTH_MAX,
                              &o->predict_depth);
    case OPT_LAYERS: return tool_parse_count(cmd, "--layers", v, 1000, &o->layers);
    case OPT_TOKENS: return tool_parse_count(cmd, "--tokens", v, 1 << 20, &o->tokens);
    case OPT_UBATCH: return tool_parse_count(cmd, "--ubatch", v, 1 << 16, &o->ubatch);
    case OPT_DECODE: return tool_parse_count(cmd, "--decode", v, 1 << 20, &o->decode);
    case OPT_SLOTS: return tool_parse_count(cmd, "--slots", v, 4096, &o->slots);
    case OPT_DEPTH: return tool_parse_count(cmd, "--prefetch-depth", v, 1 << 16, &o->depth);
    case OPT_SEED: return tool_parse_count(cmd, "--seed", v, 1L << 40, &o->seed);
    case OPT_SKEW:
      if (parse_double(v, 0, 10, &o->skew))
        return USAGE("--skew wants a number in [0, 10], not '%s'", v);
      return 0;
    case OPT_LOCALITY:
      if (parse_double(v, 0, 0.99, &o->locality))
        return USAGE("--locality wants a number in [0, 0.99], not '%s'", v);
      return 0;
    case OPT_POLICY:
      if (strcmp(v, "static") == 0) o->policy = TDM_CACHE_STATIC;
      else if (strcmp(v, "lru") == 0) o->policy = TDM_CACHE_LRU;
      else return USAGE("--cache-policy is static or lru, not '%s'", v);
      return 0;
    case OPT_BUDGET: return parse_budget(v, o);
    case OPT_EXPERTS_TYPE: return parse_etype(v, o);
    case OPT_HOST_QUEUES: return tool_parse_count(cmd, "--host-queues", v, 256, &o->host_queues);
    case OPT_HOST_THREADS:
      return tool_parse_count(cmd, "--host-threads", v, 256, &o->host_threads);
    case OPT_HOST_SHARE:
      if (parse_double(v, 0, 1, &o->host_share) || o->host_share == 0)
        return USAGE("--host-share wants a number in (0, 1], not '%s'", v);
      return 0;
    case OPT_PLACEMENT:
      o->placement_given = 1;
      if (strcmp(v, "auto") == 0) o->placement = TDM_MOE_PLACE_AUTO;
      else if (strcmp(v, "device") == 0) o->placement = TDM_MOE_PLACE_DEVICE;
      else if (strcmp(v, "host") == 0) o->placement = TDM_MOE_PLACE_HOST;
      else return USAGE("--placement is auto, device or host, not '%s'", v);
      return 0;
    default: return -1; /* reported */
  }
}

/* Returns 0, 1 after printing the help, or -1 after a usage error. */
static int parse(int argc, char **argv, moe_opts *o) {
  *o = (moe_opts){.preset = "tiny", .tokens = 256, .slots = 0, .seed = 1, .skew = 1.0,
                  .locality = 0.8, .budget_pct = -1, .check = 1,
                  .placement = TDM_MOE_PLACE_AUTO, .etype = "bf16",
                  .fmt = {TDM_MOE_W_BF16, TDM_MOE_W_BF16}};
  const char *v;
  int c, bad = 0;
  while (!bad && (c = tool_getopt("moe", argc, argv, moe_options, &v)) != -1) {
    if (c == 'h') {
      fputs(moe_help, stdout);
      return 1;
    }
    bad = parse_option(c, v, o);
  }
  if (bad) return -1;
  if (!tdm_moe_preset_find(o->preset)) {
    char list[256] = "";
    for (int i = 0; i < tdm_moe_npresets; i++) {
      strncat(list, i ? ", " : "", sizeof list - strlen(list) - 1);
      strncat(list, tdm_moe_presets[i].name, sizeof list - strlen(list) - 1);
    }
    return USAGE("unknown preset '%s' (one of: %s)", o->preset, list);
  }
  /* A pass holds at most the whole prefill: a larger --ubatch would size the model and the
   * warm-up pass for rows the output buffers do not have. */
  if (!o->ubatch) o->ubatch = 2048;
  if (o->ubatch > o->tokens) o->ubatch = o->tokens;
  if (o->rebalance && !o->devices) return USAGE("--rebalance needs --devices");
  if (o->devices && !o->placement_given) o->placement = TDM_MOE_PLACE_DEVICE;
  if (o->devices && o->placement != TDM_MOE_PLACE_DEVICE)
    return USAGE("--devices computes every routed expert on a device: --placement device only");
  if (o->host_share > 0 && o->placement != TDM_MOE_PLACE_AUTO)
    return USAGE("--host-share applies to --placement auto only");
  if (!tdm_moe_expert_stride(tdm_moe_preset_find(o->preset), o->fmt))
    return USAGE("--experts-type %s: %s's experts (rows of %d and %d values) are not whole "
                 "blocks of it", o->etype, o->preset, tdm_moe_preset_find(o->preset)->hidden,
                 tdm_moe_preset_find(o->preset)->ffn);
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The link's peak: one large pinned host-to-device copy, timed in this process. */
int tool_measure_link(tdm_device *dev, double *gbps) {
  size_t n = (size_t)256 << 20;
  tdm_device_info info;
  tdm_device_info_get(dev, &info);
  if (info.caps & TDM_DEVICE_CAP_HOST_MEMORY) n = (size_t)64 << 20;
  void *h = NULL, *d = NULL;
  tdm_queue *q = NULL;
  int rc = tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &q);
  if (!rc) rc = tdm_malloc(dev, TDM_MEM_PINNED, n, &h);
  if (!rc) rc = tdm_malloc(dev, TDM_MEM_DEVICE, n, &d);
  if (!rc) memset(h, 0x5a, n);
  double best = 0;
  for (int rep = 0; !rc && rep < 4; rep++) {
    double t0 = now_s();
    rc = tdm_memcpy(q, d, h, n, TDM_COPY_H2D, 0, NULL, NULL);
    if (!rc) rc = tdm_queue_sync(q);
    double g = n / (now_s() - t0) / 1e9;
    if (rep > 0 && g > best) best = g; /* the first copy warms up */
  }
  if (h) tdm_free(h);
  if (d) tdm_free(d);
  if (q) tdm_queue_destroy(q);
  *gbps = best;
  return rc;
}

/* Where a run's routed experts were found (tdm_moe_pass_stats's definitions, summed). */
typedef struct found {
  uint64_t acquires, resident, inflight, misses, host, bytes;
} found;

typedef struct run {
  const char *name;
  double seconds, tokens_per_s;
  found all;             /* the whole run */
  double wait_seconds;   /* the host waiting for the device (routing results, final sync) */
  double ops_seconds, streamer_seconds; /* host time in expert operations, in the streamer */
  long experts;          /* experts computed */
  uint64_t device_routed; /* layers whose routing stayed on the device */
  double link_busy;      /* the link had a copy on it (--time-link), seconds, the whole run */
  double decode_seconds; /* the decode part alone */
  double decode_link_busy; /* of which the link had a copy on it (--time-link), seconds */
  double decode_host_busy; /* and the host queues computed experts (--time-host), seconds */
  double decode_chain[5];  /* --time-chain: decode's layers' chain, seconds (route, submit,
                              device, join, combine: tdm_moe_pass_stats' chain_*) */
  found decode;
  double *token_s;       /* each decode token's pass, seconds (o->decode of them, or NULL) */
  double token_ms[3];    /* their median, 90th percentile and maximum, ms (after the run) */
  int ok;                /* the check passed (1), failed (0), or none ran (-1) */
  const char *check;     /* which: "bitwise", "rel_l2" (experts on the host), or NULL */
  double rel_l2;         /* ||y - yref|| / ||yref|| over the whole output (NAN: no check) */
  int ndev;              /* --devices: how many, and the expert bytes each one's link carried */
  uint64_t dev_bytes[TDM_MOE_DEVICES_MAX];
} run;

/* The share of acquires n is (0 when there were none). */
static double rate(uint64_t n, const found *f) {
  return f->acquires ? (double)n / f->acquires : 0.0;
}

static void progress(const char *what, long done, long total) {
  if (!isatty(2)) return;
  int width = 30, fill = total ? (int)(width * done / total) : width;
  fprintf(stderr, "\r  %-22s [", what);
  for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
  fprintf(stderr, "] %ld/%ld", done, total);
  if (done == total) fputc('\n', stderr);
  fflush(stderr);
}

/* A run keeps the pass's counts whole, so its shares weigh every acquire alike. */
static void add_found(found *f, const tdm_moe_pass_stats *st) {
  f->acquires += st->acquires;
  f->resident += st->resident_hits;
  f->inflight += st->inflight_hits;
  f->misses += st->demand_misses;
  f->host += st->host_experts;
  f->bytes += st->bytes_copied;
}

/* Adds one pass's statistics to a run (a decode pass also to its decode part). */
static void add_pass(run *r, const tdm_moe_pass_stats *st, bool decode) {
  r->seconds += st->seconds;
  r->wait_seconds += st->wait_seconds;
  r->ops_seconds += st->ops_seconds;
  r->streamer_seconds += st->streamer_seconds;
  r->experts += st->experts_computed;
  r->device_routed += st->device_routed_layers;
  add_found(&r->all, st);
  r->link_busy += st->link_busy_seconds;
  if (decode) {
    r->decode_seconds += st->seconds;
    r->decode_link_busy += st->link_busy_seconds;
    r->decode_host_busy += st->host_busy_seconds;
    r->decode_chain[0] += st->chain_route_seconds;
    r->decode_chain[1] += st->chain_submit_seconds;
    r->decode_chain[2] += st->chain_device_seconds;
    r->decode_chain[3] += st->chain_join_seconds;
    r->decode_chain[4] += st->chain_combine_seconds;
    add_found(&r->decode, st);
  }
}

/* The prefill of o->tokens in ubatches, then the decode, outputs in y; statistics summed into
 * r when r is set (a timed run), else discarded (a warm-up). */
static int workload(tdm_moe_model *m, const moe_opts *o, int H, bool overlap, const char *name,
                    float *x, float *y, run *r) {
  tdm_moe_pass_stats st;
  long passes = (o->tokens + o->ubatch - 1) / o->ubatch, steps = passes + o->decode;
  int rc = 0;
  for (long p = 0; !rc && p < passes; p++) {
    long t0 = p * o->ubatch, T = o->tokens - t0 < o->ubatch ? o->tokens - t0 : o->ubatch;
    tdm_moe_make_input(m, x, (int)T, (uint64_t)t0, false);
    rc = tdm_moe_forward(m, x, y + (size_t)t0 * H, (int)T, overlap, &st);
    if (r) add_pass(r, &st, false);
    progress(name, p + 1, steps);
  }
  /* Decode: one token at a time; successive inputs are correlated (--locality). */
  float *xd = x + (size_t)o->ubatch * H;
  if (!rc && o->decode) tdm_moe_make_input(m, xd, (int)o->decode, 0, true);
  for (long t = 0; !rc && t < o->decode; t++) {
    rc = tdm_moe_forward(m, xd + (size_t)t * H, y + (size_t)(o->tokens + t) * H, 1, overlap, &st);
    if (r) add_pass(r, &st, true);
    if (r && r->token_s) r->token_s[t] = st.seconds;
    progress(name, passes + t + 1, steps);
  }
  return rc;
}

/* The decode tokens' latency: median, 90th percentile (nearest rank) and maximum, in ms.
 * Sorts token_s in place. */
static void token_latency(run *r, long n) {
  if (!r->token_s || n < 1) return;
  qsort(r->token_s, (size_t)n, sizeof *r->token_s, bu__cmp_double);
  r->token_ms[0] = 1e3 * r->token_s[(n - 1) / 2];
  r->token_ms[1] = 1e3 * r->token_s[(long)ceil(0.9 * n) - 1];
  r->token_ms[2] = 1e3 * r->token_s[n - 1];
}

/* One timed run after an untimed warm-up. The first run of a process warms up with its whole
 * workload, the very inputs it then times: first-time costs (the BLAS library's algorithm
 * choice for every expert's token count, kernel loading, clocks, first touches) land in no
 * timed pass, whichever run comes first, and the runs after it, on the same inputs, find them
 * paid. Later runs warm up with one short pass. */
static int do_run(tdm_moe_model *m, const moe_opts *o, int H, bool overlap, const char *name,
                  bool first, float *x, float *y, run *r) {
  memset(r, 0, sizeof *r);
  r->name = name;
  /* Without room for the latencies the run goes on without them. */
  if (o->decode) r->token_s = calloc((size_t)o->decode, sizeof *r->token_s);
  int rc;
  if (first) {
    char label[64];
    snprintf(label, sizeof label, "%s (warm-up)", name);
    rc = workload(m, o, H, overlap, label, x, y, NULL);
  } else {
    tdm_moe_pass_stats st;
    /* x and y hold at least ubatch rows: parse() keeps ubatch <= tokens. */
    int warm = o->ubatch < 32 ? (int)o->ubatch : 32;
    tdm_moe_make_input(m, x, warm, 1u << 30, false);
    rc = tdm_moe_forward(m, x, y, warm, overlap, &st);
  }
  for (int d = 0; !rc && tdm_moe_streamer_at(m, d); d++)
    tdm_streamer_stats_reset(tdm_moe_streamer_at(m, d));
  if (!rc) rc = workload(m, o, H, overlap, name, x, y, r);
  for (int d = 0; !rc && o->devices && tdm_moe_streamer_at(m, d); d++) { /* each link's part */
    tdm_streamer_stats ds;
    if (tdm_streamer_stats_get(tdm_moe_streamer_at(m, d), &ds) == 0)
      r->dev_bytes[d] = ds.bytes_copied;
    r->ndev = d + 1;
  }
  r->tokens_per_s = (o->tokens + o->decode) / r->seconds;
  if (!rc) token_latency(r, o->decode);
  return rc;
}

/* One `tandem moe` invocation: the options, the device and model shape, the buffers, and the
 * runs made so far (all resident, streamed overlapped, streamed serialized). */
typedef struct session {
  moe_opts o;
  const tdm_moe_preset *p;
  tdm_device *dev;
  tdm_device *devs[TDM_MOE_DEVICES_MAX]; /* --devices, devs[0] == dev */
  int ndevs;
  double peaks[TDM_MOE_DEVICES_MAX];     /* --devices: each one's link, GB/s (peak: their sum) */
  tdm_device_info info;
  tdm_moe_config cfg;
  long layers;
  size_t ebytes, all, budget, H, total;
  double peak;
  float *x, *yref, *y; /* yref: the all-resident output, NULL when there is no check */
  run runs[3];
  int nruns;
  tdm_streamer_stats ss; /* the streamed model's, after its runs */
  tdm_moe_placement_info place; /* the streamed model's placement and its calibration */
} session;

/* What the runs show: the link utilization, the hidden fraction and the overlap efficiency
 * (NAN when they cannot be told), and whether every checked output matched. */
typedef struct figures {
  const run *res, *ovl, *ser, *main_run;
  double link, copy_s, hidden, efficiency;
  bool all_ok;
} figures;

/* --device, or --devices' list (whose first is then the model's device). */
static int find_devices(session *s) {
  int code = tool_find_devices("moe", s->o.device, s->o.devices, s->devs, TDM_MOE_DEVICES_MAX,
                               &s->ndevs);
  s->dev = s->devs[0];
  return code;
}

/* The device, the budget, the link's peak, the model's configuration and the activations. */
static int session_setup(session *s) {
  const moe_opts *o = &s->o;
  int rc, code;
  s->p = tdm_moe_preset_find(o->preset);
  s->layers = o->layers ? o->layers : s->p->layers;
  s->ebytes = tdm_moe_expert_stride(s->p, o->fmt);
  s->all = s->ebytes * (size_t)s->p->experts * (size_t)s->layers;
  s->budget = o->budget_pct >= 0 ? (size_t)(s->all * (o->budget_pct / 100.0)) : o->budget_bytes;
  /* A percentage rounds up to one expert; a byte count below one is the user's to fix. */
  if (o->budget_pct > 0 && s->budget < s->ebytes) s->budget = s->ebytes;
  if ((code = find_devices(s)) != TOOL_OK) return code;
  if ((rc = tdm_device_info_get(s->dev, &s->info))) return tool_fail("tdm_device_info_get", rc);
  s->peak = 0;
  for (int d = 0; d < (s->ndevs ? s->ndevs : 1); d++) { /* several: both links together */
    double peak;
    if ((rc = tool_measure_link(s->ndevs ? s->devs[d] : s->dev, &peak)))
      return tool_fail("measuring the link", rc);
    s->peaks[d] = peak;
    s->peak += peak;
  }
  s->cfg = (tdm_moe_config){.preset = s->p, .layers = (int)s->layers, .device = s->dev,
                            .seed = (uint64_t)o->seed, .skew = o->skew, .locality = o->locality,
                            .max_tokens = (int)o->ubatch, .budget_bytes = s->budget,
                            .staging_slots = (int)o->slots, .prefetch_depth = (int)o->depth,
                            .policy = o->policy, .predict = o->predict != 0,
                            .predict_depth = (int)o->predict_depth,
                            .time_link = o->time_link != 0,
                            .time_host = o->time_host != 0,
                            .time_chain = o->time_chain != 0,
                            .placement = (tdm_moe_placement)o->placement,
                            .host_queues = (int)o->host_queues,
                            .host_threads = (int)o->host_threads,
                            .host_share = o->host_share, .expert_fmt = o->fmt,
                            .devices = s->ndevs ? s->devs : NULL, .ndevices = s->ndevs};
  s->H = (size_t)s->p->hidden;
  s->total = (size_t)(o->tokens + o->decode);
  s->x = malloc(((size_t)o->ubatch + o->decode) * s->H * sizeof *s->x);
  s->y = malloc(s->total * s->H * sizeof *s->y);
  s->yref = o->check ? malloc(s->total * s->H * sizeof *s->yref) : NULL;
  if (!s->x || !s->y || (o->check && !s->yref)) {
    fprintf(stderr, "tandem: no host memory for %zu tokens of activations\n", s->total);
    return TOOL_FAILED;
  }
  return TOOL_OK;
}

/* The reference: every expert resident, nothing streamed. When it cannot run, there is no
 * check (yref is dropped), and the streamed runs still go on. */
static void run_reference(session *s) {
  tdm_moe_config cfg = s->cfg;
  tdm_moe_model *m = NULL;
  cfg.all_resident = true;
  cfg.devices = NULL; /* the first device alone */
  cfg.ndevices = 0;
  cfg.placement = TDM_MOE_PLACE_DEVICE; /* the reference computes everything on the device */
  cfg.host_share = 0;
  cfg.time_chain = false; /* its decode routes on the device: no chain to time */
  int rc = tdm_moe_model_create(&cfg, &m);
  if (!rc) {
    rc = do_run(m, &s->o, (int)s->H, true, "all resident", true, s->x, s->yref,
                &s->runs[s->nruns]);
    s->runs[s->nruns++].ok = -1; /* the reference itself */
    tdm_moe_model_destroy(m);
  }
  if (rc) {
    fprintf(stderr, "tandem: the all-resident reference could not run (%s); no check\n",
            tdm_last_error()); /* the message starts with the code's name */
    free(s->yref);
    s->yref = NULL;
    free(s->runs[0].token_s);
    s->nruns = 0;
  }
}

/* The check's tolerance when experts were computed on the host: ||y - yref|| / ||yref|| over
 * the whole output. Both sides compute y = x + sum of experts from the same bf16 weights and
 * f32 activations, accumulating in f32, but in different orders (the device's grouped kernel
 * against the CPU's lanes), so each dot product of length K (H or I, 128 to 7168) differs by
 * about sqrt(K) ulps of f32 (2^-24 each): 1e-6 to 1e-5 relative; the layers add these up (x
 * += MoE(x): L of them, at most a few times 1e-4 for the deepest preset). 1e-3 leaves that
 * a margin and still catches a host expert computed wrong, or written to the wrong slot,
 * which moves its tokens' rows by the size of an expert's output. A top-k choice that flips
 * on a near-tie between the two orders would also exceed it; on these shapes that takes a
 * logit gap below about 1e-5, which the runs here have not met. */
#define HOST_TOL 1e-3

/* The check of a run against the reference: bitwise when every expert was computed on the
 * device (same kernels, deterministic reductions), within HOST_TOL when some were not. */
static void check_run(const session *s, run *r) {
  size_t n = s->total * s->H;
  double d = 0, ref = 0;
  for (size_t i = 0; i < n; i++) {
    double a = (double)s->y[i] - s->yref[i];
    d += a * a;
    ref += (double)s->yref[i] * s->yref[i];
  }
  r->rel_l2 = ref > 0 ? sqrt(d / ref) : sqrt(d);
  if (r->all.host || s->ndevs) {
    r->check = "rel_l2";
    r->ok = r->rel_l2 <= HOST_TOL;
  } else {
    r->check = "bitwise";
    r->ok = memcmp(s->y, s->yref, n * sizeof *s->y) == 0;
  }
}

/* The streamed runs, overlapped then serialized (or serialized alone), on one model. */
static int run_streamed(session *s) {
  tdm_moe_model *m = NULL;
  int rc;
  if ((rc = tdm_moe_model_create(&s->cfg, &m))) return tool_fail("creating the model", rc);
  /* The static resident set starts loading at creation, on the prefetch queue; it is no part
   * of any pass, so let it land first: a timed pass then finds it resident, not in flight. */
  tdm_queue *prefetch = NULL;
  if (!(rc = tdm_streamer_queues(tdm_moe_streamer(m), NULL, &prefetch)))
    rc = tdm_queue_sync(prefetch);
  if (rc) {
    tdm_moe_model_destroy(m);
    return tool_fail("loading the resident experts", rc);
  }
  /* --rebalance: the whole workload once, untimed, then the experts dealt out again by the
   * load it measured */
  if (s->o.rebalance &&
      ((rc = workload(m, &s->o, (int)s->H, true, "rebalance (measuring)", s->x, s->y, NULL)) ||
       (rc = tdm_moe_rebalance(m)))) {
    tdm_moe_model_destroy(m);
    return tool_fail("rebalancing the experts", rc);
  }
  const bool modes[2] = {true, false};
  for (int k = s->o.serialized_only ? 1 : 0; !rc && k < 2; k++) {
    run *r = &s->runs[s->nruns];
    rc = do_run(m, &s->o, (int)s->H, modes[k],
                modes[k] ? "streamed, overlapped" : "streamed, serialized", s->nruns == 0, s->x,
                s->y, r);
    if (rc) {
      free(r->token_s); /* not counted in nruns */
      tool_fail("the forward pass", rc);
      break;
    }
    r->ok = -1;
    r->rel_l2 = NAN;
    if (s->yref) check_run(s, r);
    s->nruns++;
  }
  if (!rc) tdm_streamer_stats_get(tdm_moe_streamer(m), &s->ss);
  if (!rc) tdm_moe_placement_get(m, &s->place);
  tdm_moe_model_destroy(m);
  return rc;
}

static figures compute_figures(const session *s) {
  figures f = {.hidden = NAN, .efficiency = NAN, .all_ok = true};
  if (s->yref && s->runs[0].name && strcmp(s->runs[0].name, "all resident") == 0)
    f.res = &s->runs[0];
  for (int i = 0; i < s->nruns; i++) {
    if (strstr(s->runs[i].name, "overlapped")) f.ovl = &s->runs[i];
    if (strstr(s->runs[i].name, "serialized")) f.ser = &s->runs[i];
    if (s->runs[i].ok == 0) f.all_ok = false;
  }
  f.main_run = f.ovl ? f.ovl : f.ser;
  f.link = f.main_run->all.bytes / f.main_run->seconds / 1e9 / s->peak;
  f.copy_s = f.main_run->all.bytes / (s->peak * 1e9);
  /* hidden: how much of the shorter side the overlap hid, against the serialized pass (none
   * when nothing was copied: nothing to hide); efficiency: how close the overlapped pass came
   * to the longer side alone (copy at the link's peak, or the all-resident pass). */
  if (f.ovl && f.ser && f.res) {
    double shorter = f.copy_s < f.res->seconds ? f.copy_s : f.res->seconds;
    if (shorter > 0) f.hidden = (f.ser->seconds - f.ovl->seconds) / shorter;
  }
  if (f.ovl && f.res)
    f.efficiency = (f.copy_s > f.res->seconds ? f.copy_s : f.res->seconds) / f.ovl->seconds;
  return f;
}

/* Where the experts were found, as counts and shares of the acquires, under names that start
 * with `prefix`. hit_rate is resident or in flight (the name older scripts read); the cache hit
 * rate is resident_hit_rate. */
static void json_found(bu_json *j, const char *prefix, const found *f) {
  char key[64];
#define KEY(name) (snprintf(key, sizeof key, "%s%s", prefix, name), key)
  bu_json_double(j, KEY("hit_rate"), rate(f->resident + f->inflight, f), 4);
  bu_json_double(j, KEY("resident_hit_rate"), rate(f->resident, f), 4);
  bu_json_double(j, KEY("inflight_hit_rate"), rate(f->inflight, f), 4);
  bu_json_double(j, KEY("miss_rate"), rate(f->misses, f), 4);
  bu_json_uint(j, KEY("acquires"), f->acquires);
  bu_json_uint(j, KEY("resident_hits"), f->resident);
  bu_json_uint(j, KEY("inflight_hits"), f->inflight);
  bu_json_uint(j, KEY("demand_misses"), f->misses);
  bu_json_uint(j, KEY("host_experts"), f->host);
#undef KEY
}

/* --time-chain: the chain's parts, in the order a layer passes them (tdm_moe_pass_stats). */
static const char *const chain_names[5] = {"route", "submit", "device", "join", "combine"};

/* A decode layer's mean chain part i, microseconds (NAN without decode or the chain timed). */
static double chain_us(const run *r, long decode, long layers, int i) {
  return decode > 0 && layers > 0 && r->decode_seconds > 0 && r->decode_chain[0] > 0
             ? 1e6 * r->decode_chain[i] / (double)(decode * layers)
             : NAN;
}

static void json_run(bu_json *j, const run *r, long decode, long layers, bool link_timed,
                     bool host_timed) {
  bu_json_object(j, NULL);
  bu_json_string(j, "name", r->name);
  bu_json_double(j, "seconds", r->seconds, 6);
  bu_json_double(j, "host_wait_seconds", r->wait_seconds, 6);
  bu_json_double(j, "host_ops_seconds", r->ops_seconds, 6);
  bu_json_double(j, "host_streamer_seconds", r->streamer_seconds, 6);
  bu_json_int(j, "experts", r->experts);
  bu_json_uint(j, "device_routed_layers", r->device_routed);
  bu_json_double(j, "tokens_per_s", r->tokens_per_s, 3);
  bu_json_uint(j, "bytes_copied", r->all.bytes);
  if (r->ndev) { /* --devices: what each device's link carried */
    bu_json_array(j, "device_bytes_copied");
    for (int d = 0; d < r->ndev; d++) bu_json_uint(j, NULL, r->dev_bytes[d]);
    bu_json_end(j);
  }
  /* --time-link: the share of the run the link had a copy on it, and its GB/s meanwhile
   * (null otherwise, and the rate also when nothing was copied) */
  bu_json_double(j, "link_busy_fraction",
                 link_timed && r->seconds > 0 ? r->link_busy / r->seconds : NAN, 4);
  bu_json_double(j, "link_busy_gbs",
                 link_timed && r->link_busy > 0 ? (double)r->all.bytes / r->link_busy / 1e9 : NAN,
                 3);
  json_found(j, "", &r->all);
  bu_json_double(j, "decode_tokens_per_s", r->decode_seconds > 0 ? decode / r->decode_seconds : 0.0,
                 3);
  json_found(j, "decode_", &r->decode);
  if (r->token_s) {
    bu_json_double(j, "decode_token_ms_p50", r->token_ms[0], 4);
    bu_json_double(j, "decode_token_ms_p90", r->token_ms[1], 4);
    bu_json_double(j, "decode_token_ms_max", r->token_ms[2], 4);
  }
  bu_json_uint(j, "decode_bytes_copied", r->decode.bytes);
  bu_json_double(j, "decode_bytes_per_token", decode ? (double)r->decode.bytes / decode : 0.0, 1);
  /* --time-link: the share of decode's time the link had a copy on it (null otherwise) */
  bu_json_double(j, "decode_link_busy_fraction",
                 link_timed && r->decode_seconds > 0 ? r->decode_link_busy / r->decode_seconds
                                                     : NAN, 4);
  /* --time-host: the share of decode's time the host queues computed experts (null otherwise) */
  bu_json_double(j, "decode_host_busy_fraction",
                 host_timed && r->decode_seconds > 0 ? r->decode_host_busy / r->decode_seconds
                                                     : NAN, 4);
  /* --time-chain: a decode layer's mean chain, microseconds (null without it, or for the
   * all-resident run, whose decode routes on the device) */
  if (isnan(chain_us(r, decode, layers, 0))) {
    bu_json_null(j, "decode_chain_us");
  } else {
    bu_json_object(j, "decode_chain_us");
    for (int i = 0; i < 5; i++) bu_json_double(j, chain_names[i], chain_us(r, decode, layers, i), 2);
    bu_json_end(j);
  }
  if (r->ok < 0) bu_json_null(j, "matches_resident");
  else bu_json_bool(j, "matches_resident", r->ok);
  if (r->check) bu_json_string(j, "check", r->check);
  else bu_json_null(j, "check");
  bu_json_double(j, "rel_l2", r->rel_l2, -6);
  bu_json_end(j);
}

/* Decode at batch 1 moves every byte it copies once per token, so the link bounds it at
 * peak / (bytes copied per decode token): what was copied, prefetches included, not a figure
 * derived from a hit rate (a copy in flight is still a copy). NAN when decode copied nothing
 * (or did not run): then the link sets no bound. */
static double decode_bound(const session *s, const run *r) {
  if (!s->o.decode || !r->decode.bytes) return NAN;
  return s->peak * 1e9 / ((double)r->decode.bytes / s->o.decode);
}

/* The expert weights the host read per decode token (0 without host experts). */
static double decode_host_bytes(const session *s, const run *r) {
  return s->o.decode ? (double)r->decode.host * (double)s->ebytes / s->o.decode : 0.0;
}

/* Decode with experts on the host moves two streams: the bytes copied over the link and the
 * expert weights the host reads. At the calibrated rates (each side's rate with the other busy
 * where both carry bytes, else its rate alone), a token takes at least the slower side's time
 * for the bytes this run gave each (*split); the best split of the same bytes takes their sum
 * over the two rates at once, or one side alone if that is faster (*best). NAN for both when
 * no decode expert ran on the host or a rate is unknown. */
static void decode_bounds_both(const session *s, const run *r, double *split, double *best) {
  const tdm_moe_placement_info *pi = &s->place;
  *split = *best = NAN;
  if (!s->o.decode || !r->decode.host || pi->link_gbs_shared <= 0 || pi->host_gbs_shared <= 0 ||
      pi->link_gbs <= 0 || pi->host_gbs <= 0)
    return;
  double copied = (double)r->decode.bytes / s->o.decode;
  double hosted = decode_host_bytes(s, r);
  double tl = copied / ((hosted > 0 ? pi->link_gbs_shared : pi->link_gbs) * 1e9);
  double th = hosted / ((copied > 0 ? pi->host_gbs_shared : pi->host_gbs) * 1e9);
  *split = 1.0 / (tl > th ? tl : th);
  double alone = pi->link_gbs > pi->host_gbs ? pi->link_gbs : pi->host_gbs;
  double shared = pi->link_gbs_shared + pi->host_gbs_shared;
  *best = (shared > alone ? shared : alone) * 1e9 / (copied + hosted);
}

static const char *placement_name(tdm_moe_placement p) {
  return p == TDM_MOE_PLACE_AUTO ? "auto" : p == TDM_MOE_PLACE_HOST ? "host" : "device";
}

/* The results as one JSON object on stdout; TOOL_FAILED when writing it failed. */
static int print_json(const session *s, const figures *f) {
  const moe_opts *o = &s->o;
  const run *mr = f->main_run;
  double bound = decode_bound(s, mr);
  bu_json j;
  bu_json_init(&j, stdout, 2);
  bu_json_object(&j, NULL);
  tool_json_header(&j);
  bu_json_string(&j, "preset", s->p->name);
  bu_json_string(&j, "device", s->info.id);
  bu_json_string(&j, "device_name", s->info.name);
  bu_json_int(&j, "layers", s->layers);
  bu_json_int(&j, "tokens", o->tokens);
  bu_json_int(&j, "ubatch", o->ubatch);
  bu_json_int(&j, "decode", o->decode);
  bu_json_double(&j, "skew", o->skew, -6);
  bu_json_double(&j, "locality", o->locality, -6);
  bu_json_string(&j, "policy", o->policy == TDM_CACHE_LRU ? "lru" : "static");
  bu_json_bool(&j, "predict", o->predict);
  bu_json_bool(&j, "time_link", o->time_link);
  bu_json_bool(&j, "time_host", o->time_host);
  bu_json_bool(&j, "time_chain", o->time_chain);
  bu_json_int(&j, "predict_depth", o->predict ? (o->predict_depth ? (int)o->predict_depth : 1) : 0);
  bu_json_uint(&j, "budget_bytes", s->budget);
  bu_json_int(&j, "staging_slots", s->ss.staging_slots);
  bu_json_int(&j, "resident_slots", s->ss.resident_slots);
  bu_json_int(&j, "prefetch_depth", s->ss.prefetch_depth);
  bu_json_uint(&j, "expert_bytes", s->ebytes);
  bu_json_string(&j, "experts_type", o->etype);
  bu_json_uint(&j, "expert_bytes_bf16", tdm_moe_expert_bytes(s->p)); /* the bf16 link bound's */
  bu_json_double(&j, "peak_gbps", s->peak, 3);
  bu_json_array(&j, "devices"); /* expert parallelism: the devices, or only the device */
  for (int d = 0; d < (s->ndevs ? s->ndevs : 1); d++) {
    tdm_device_info di;
    if (tdm_device_info_get(s->ndevs ? s->devs[d] : s->dev, &di) == 0)
      bu_json_string(&j, NULL, di.id);
  }
  bu_json_end(&j);
  bu_json_bool(&j, "rebalanced", o->rebalance != 0); /* --rebalance */
  bu_json_array(&j, "device_peak_gbps"); /* each one's link (peak_gbps: their sum) */
  for (int d = 0; d < (s->ndevs ? s->ndevs : 1); d++) bu_json_double(&j, NULL, s->peaks[d], 3);
  bu_json_end(&j);
  bu_json_string(&j, "placement", placement_name(s->place.placement));
  bu_json_int(&j, "host_queues", s->place.host_queues);
  bu_json_int(&j, "host_threads", s->place.host_threads);
  bu_json_int(&j, "host_group", s->place.host_group);
  bu_json_double(&j, "host_join_us", s->place.host_join_us, 2);
  bu_json_double(&j, "link_gbs", s->place.link_gbs, 3);
  bu_json_double(&j, "host_gbs", s->place.host_gbs, 3);
  bu_json_double(&j, "link_gbs_shared", s->place.link_gbs_shared, 3);
  bu_json_double(&j, "host_gbs_shared", s->place.host_gbs_shared, 3);
  bu_json_double(&j, "host_share", s->place.host_share, 4);
  bu_json_double(&j, "host_share_model", s->place.host_share_model, 4);
  bu_json_double(&j, "host_tolerance", HOST_TOL, -6);
  bu_json_array(&j, "runs");
  for (int i = 0; i < s->nruns; i++) json_run(&j, &s->runs[i], o->decode, s->layers, o->time_link != 0,
                                            o->time_host != 0);
  bu_json_end(&j);
  bu_json_double(&j, "link_utilization", f->link, 4);
  if (mr->ndev) { /* --devices: each link, expert bytes it carried / wall time / its peak */
    bu_json_array(&j, "device_link_utilization");
    for (int d = 0; d < mr->ndev; d++)
      bu_json_double(&j, NULL, (double)mr->dev_bytes[d] / mr->seconds / 1e9 / s->peaks[d], 4);
    bu_json_end(&j);
  }
  bu_json_double(&j, "hidden_fraction", f->hidden, 4);
  bu_json_double(&j, "overlap_efficiency", f->efficiency, 4);
  bu_json_double(&j, "copy_seconds_at_peak", f->copy_s, 6);
  bu_json_double(&j, "decode_bytes_per_token",
                 o->decode ? (double)mr->decode.bytes / o->decode : NAN, 1);
  bu_json_double(&j, "decode_bound_tokens_per_s", bound, 3);
  double split, best;
  decode_bounds_both(s, mr, &split, &best);
  bu_json_double(&j, "decode_host_bytes_per_token", o->decode ? decode_host_bytes(s, mr) : NAN, 1);
  bu_json_double(&j, "decode_split_bound_tokens_per_s", split, 3);
  bu_json_double(&j, "decode_best_split_bound_tokens_per_s", best, 3);
  bu_json_string(&j, "check", s->yref ? (f->all_ok ? "ok" : "FAILED") : "skipped");
  bu_json_end(&j);
  if (bu_json_finish(&j) < 0) {
    fprintf(stderr, "tandem: writing the JSON to stdout failed\n");
    return TOOL_FAILED;
  }
  return TOOL_OK;
}

/* The table's head: the setting, then one line per run. */
static void print_runs(const session *s) {
  const moe_opts *o = &s->o;
  char b1[32], b2[32];
  printf("\non %s (%s): %ld prefill tokens in ubatches of %ld, %ld decode tokens\n", s->info.id,
         s->info.name, o->tokens, o->ubatch, o->decode);
  tool_format_bytes(s->budget, b1, sizeof b1);
  tool_format_bytes(s->ss.device_bytes, b2, sizeof b2);
  printf("  routing    Zipf skew %.2f, decode locality %.2f, policy %s\n", o->skew, o->locality,
         o->policy == TDM_CACHE_LRU ? "lru" : "static");
  printf("  device     budget %s (%d resident slots) + %d staging slots = %s; prefetch "
         "depth %d\n", b1, s->ss.resident_slots, s->ss.staging_slots, b2, s->ss.prefetch_depth);
  printf("  link       %.2f GB/s peak (one large pinned copy, this process%s)\n", s->peak,
         s->ndevs ? "; the devices' links together" : "");
  if (s->ndevs) printf("  devices    %s: each layer's routed experts dealt out by popularity\n",
                       o->devices);
  if (s->place.placement == TDM_MOE_PLACE_DEVICE)
    printf("  placement  device: every routed expert is computed on the device\n\n");
  else {
    const tdm_moe_placement_info *pi = &s->place;
    printf("  placement  %s: %d host queues, %d threads; calibrated link %.2f GB/s, host %.2f "
           "GB/s of expert weights alone\n             (%d a call), %.2f and %.2f GB/s at once; "
           "host share %.2f of a layer's non-resident experts,\n             ",
           placement_name(pi->placement), pi->host_queues, pi->host_threads, pi->link_gbs,
           pi->host_gbs, pi->host_group, pi->link_gbs_shared, pi->host_gbs_shared,
           pi->host_share);
    if (s->o.host_share > 0)
      printf("as given (the cost model's: %.2f, less %.1f us of join)\n\n", pi->host_share_model,
             pi->host_join_us);
    else
      printf("less %.1f us of join%s\n\n", pi->host_join_us,
             pi->placement == TDM_MOE_PLACE_HOST ? " (host: all of them)" : "");
  }
  printf("  %-22s %10s %12s %12s %12s %9s %9s %7s %7s %8s\n", "run", "time", "host waits",
         "tokens/s", "copied", "resident", "in flight", "miss", "host", "output");
  for (int i = 0; i < s->nruns; i++) {
    const run *r = &s->runs[i];
    /* Shares of the experts computed: acquires (the three device columns) plus host. */
    found all = r->all;
    all.acquires += all.host;
    tool_format_bytes(r->all.bytes, b1, sizeof b1);
    printf("  %-22s %8.1f ms %9.1f ms %12.1f %12s %8.1f%% %8.1f%% %6.1f%% %6.1f%% %8s\n",
           r->name, r->seconds * 1e3, r->wait_seconds * 1e3, r->tokens_per_s, b1,
           100 * rate(all.resident, &all), 100 * rate(all.inflight, &all),
           100 * rate(all.misses, &all), 100 * rate(all.host, &all),
           r->ok < 0 ? "-" : !r->ok ? "DIFFERS" : r->all.host ? "close" : "equal");
  }
  printf("  (routed experts: resident = on the device when routed, a cache hit; in flight = "
         "covered by a copy\n   already on its way; miss = copied on demand; host = computed "
         "on the host, not copied)\n");
}

/* The decode part: measured tokens/s beside the bound the link sets from the bytes actually
 * copied per token, and where its routed experts were found. */
static void print_decode(const session *s, const run *mr) {
  const found *d = &mr->decode;
  double bound = decode_bound(s, mr);
  printf("  decode             %.1f tokens/s measured; ", s->o.decode / mr->decode_seconds);
  if (!isnan(bound))
    printf("the link bounds it at %.1f tokens/s (peak / %.2f MB copied per decode token)\n",
           bound, (double)d->bytes / s->o.decode / 1e6);
  else
    printf("nothing copied during decode, so the link sets no bound\n");
  if (s->o.time_link && mr->decode_seconds > 0)
    printf("                     the link had a copy on it %.2f of the decode time (device "
           "timestamps: %.1f GB/s while busy)\n", mr->decode_link_busy / mr->decode_seconds,
           mr->decode_link_busy > 0 ? (double)d->bytes / mr->decode_link_busy / 1e9 : 0.0);
  if (s->o.time_host && mr->decode_seconds > 0)
    printf("                     the host computed experts %.2f of the decode time (host "
           "queues' timestamps: %.1f GB/s while busy)\n", mr->decode_host_busy / mr->decode_seconds,
           mr->decode_host_busy > 0
               ? decode_host_bytes(s, mr) * s->o.decode / mr->decode_host_busy / 1e9
               : 0.0);
  if (!isnan(chain_us(mr, s->o.decode, s->layers, 0)))
    printf("                     a layer's chain (compute queue's timestamps, mean): routing "
           "back %.1f us,\n                     host turnaround %.1f us, device's experts %.1f "
           "us, waiting for the host's %.1f us,\n                     combine %.1f us\n",
           chain_us(mr, s->o.decode, s->layers, 0), chain_us(mr, s->o.decode, s->layers, 1),
           chain_us(mr, s->o.decode, s->layers, 2), chain_us(mr, s->o.decode, s->layers, 3),
           chain_us(mr, s->o.decode, s->layers, 4));
  if (mr->token_s)
    printf("                     a token takes %.3f ms (median), %.3f ms (90th percentile), "
           "%.3f ms at most\n", mr->token_ms[0], mr->token_ms[1], mr->token_ms[2]);
  printf("                     routed experts: %.1f%% resident, %.1f%% in flight, %.1f%% demand "
         "misses (%s run)\n", 100 * rate(d->resident, d), 100 * rate(d->inflight, d),
         100 * rate(d->misses, d), mr->name);
  if (d->host) {
    double split, best;
    decode_bounds_both(s, mr, &split, &best);
    printf("                     and %llu experts computed on the host besides those %llu on "
           "the device\n", (unsigned long long)d->host, (unsigned long long)d->acquires);
    if (!isnan(split))
      printf("                     %.1f MB copied and %.1f MB read by the host a token: at the "
             "calibrated rates\n                     at most %.1f tokens/s with this split, %.1f "
             "with the best\n", (double)d->bytes / s->o.decode / 1e6,
             decode_host_bytes(s, mr) / 1e6, split, best);
  }
  if (mr->device_routed)
    printf("                     every expert resident: the routing of %llu layer passes stayed "
           "on the device\n", (unsigned long long)mr->device_routed);
}

/* The figures under the table. */
static void print_figures(const session *s, const figures *f) {
  const run *mr = f->main_run;
  printf("\n  link utilization   %.2f   expert bytes copied / wall time / peak\n", f->link);
  for (int d = 0; d < mr->ndev; d++)
    printf("    device %d's link %.2f   the bytes it copied / wall time / its peak (%.1f GB/s)\n",
           d, (double)mr->dev_bytes[d] / mr->seconds / 1e9 / s->peaks[d], s->peaks[d]);
  if (s->o.time_link && mr->seconds > 0 && mr->link_busy > 0)
    printf("                     the link had a copy on it %.2f of the %s run (device "
           "timestamps: %.1f GB/s while busy)\n", mr->link_busy / mr->seconds, mr->name,
           (double)mr->all.bytes / mr->link_busy / 1e9);
  if (!isnan(f->hidden)) {
    printf("  hidden fraction    %.2f   (serialized - overlapped) / min(copy, compute)",
           f->hidden);
    /* A shorter side of a few percent of the run is within the runs' timing noise. */
    double shorter = f->copy_s < f->res->seconds ? f->copy_s : f->res->seconds;
    if (shorter < 0.05 * f->ovl->seconds)
      printf("; the shorter side is %.1f%% of the run, within timing noise",
             100 * shorter / f->ovl->seconds);
    printf("\n");
  }
  if (!isnan(f->efficiency))
    printf("  overlap efficiency %.2f   max(copy at peak, all-resident time) / overlapped\n",
           f->efficiency);
  if (f->ovl && f->ser)
    printf("  speed-up           %.2fx  serialized / overlapped\n",
           f->ser->seconds / f->ovl->seconds);
  if (mr->experts)
    printf("  host per expert    %.1f us in expert operations + %.1f us in the streamer (%s run; "
           "the host waited %.0f%% of the time)\n",
           1e6 * mr->ops_seconds / mr->experts, 1e6 * mr->streamer_seconds / mr->experts,
           mr->name, 100 * mr->wait_seconds / mr->seconds);
  if (s->o.decode && mr->decode_seconds > 0) print_decode(s, mr);
  if (!s->yref) {
    printf("  check              skipped\n");
    return;
  }
  /* Which check ran for each streamed run: bitwise, or the tolerance with host experts. */
  for (int i = 0; i < s->nruns; i++) {
    const run *r = &s->runs[i];
    if (!r->check) continue;
    printf("  check              %s: %s", r->ok ? "ok" : "FAILED", r->name);
    if (strcmp(r->check, "bitwise") == 0)
      printf(" %s the all-resident output bitwise\n", r->ok ? "equals" : "differs from");
    else
      printf(" has ||y - yref|| / ||yref|| = %.2e %s %.0e (%s)\n", r->rel_l2,
             r->ok ? "<=" : ">", HOST_TOL,
             s->ndevs ? "summed by device" : "experts computed on the host");
  }
}

int tool_cmd_moe(int argc, char **argv) {
  session s = {0};
  int prc = parse(argc, argv, &s.o);
  if (prc) return prc > 0 ? TOOL_OK : TOOL_USAGE;
  int rc = tool_trace_check(s.o.trace);
  if (rc != TOOL_OK) return rc;
  if ((rc = tdm_init()) < 0) return tool_fail("tdm_init", rc);
  int code = session_setup(&s);
  if (code == TOOL_OK && !s.o.json) {
    printf("tandem moe: %s (%s), %ld layers, %zu-byte experts, %.2f GiB of experts in pinned "
           "host memory\n", s.p->name, s.p->note, s.layers, s.ebytes, s.all / 1073741824.0);
    fflush(stdout);
  }
  if (code == TOOL_OK && s.o.check) run_reference(&s);
  if (code == TOOL_OK && run_streamed(&s)) code = TOOL_FAILED;
  if (code == TOOL_OK) {
    figures f = compute_figures(&s);
    if (s.o.json) {
      code = print_json(&s, &f);
    } else {
      print_runs(&s);
      print_figures(&s, &f);
    }
    if (code == TOOL_OK && s.yref && !f.all_ok) code = TOOL_FAILED;
  }
  for (int i = 0; i < s.nruns; i++) free(s.runs[i].token_s);
  free(s.x);
  free(s.y);
  free(s.yref);
  tdm_shutdown();
  return code;
}
