/* bench-cuda.c: tandem on a CUDA device against the raw CUDA program that does the same work,
 * measured side by side in one run: the options, the device, the run of each sub-benchmark and
 * the JSON result file. The sub-benchmarks live in their own files:
 *   overhead  (overhead.c)  host cost of submit, record and device-side wait vs the CUDA calls
 *   pinned    (pinned.c)    pinned H2D / D2H bandwidth, 4 KiB .. 1 GiB, vs cudaMemcpyAsync
 *   pageable  (pageable.c)  H2D from malloc'd memory vs raw pageable, raw pinned, host memcpy
 *   overlap   (overlap.c)   MoE experts streamed under cuBLAS GEMMs vs a two-stream program
 *   expert    (expert.c)    host and device cost of the MoE expert operation (a diagnostic)
 *   grouped   (grouped.c)   a decode layer's experts grouped in one call against one by one
 * Every GPU result is checked (copies read back and compared on random data, GEMM outputs
 * against an fp64 reference); a failed check or call fails the run (exit 1). Timing never
 * does: goals are printed next to the figures. No cuda:0 device: exit 77 (skipped).
 */
#include "bcuda.h"

#include "measure.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const char usage[] =
    "usage: bench-cuda [options] [overhead|pinned|pageable|overlap|expert|grouped]...\n"
    "\n"
    "Measures tandem's CUDA backend against raw CUDA doing the same work, side by side in one\n"
    "run, interleaved rep by rep; reports medians and ratios. With no names, runs them all\n"
    "(expert: the host and device cost of tandem moe's expert operation; grouped: a decode\n"
    "layer's experts in one grouped call against one by one; figures only).\n"
    "Exit codes: 0 ok, 1 a call or a data check failed, 2 usage error, 77 no CUDA device.\n"
    "\n"
    "options:\n"
    "  --device D      tandem device id (default cuda:0)\n"
    "  --json FILE     also write the results, with command, commit, device and date, to FILE\n"
    "  --reps R        timed repetitions; medians are reported (default 11)\n"
    "  --iters N       overhead: calls per repetition (default 500)\n"
    "  --max-size B    pinned, pageable: largest copy, suffix K/M/G allowed (default 1G)\n"
    "  --threads N     pageable: host memcpy threads (default min(8, CPUs))\n"
    "  --experts N     overlap: experts streamed per pass (default 64)\n"
    "  --tokens T      overlap: tokens per GEMM (default: calibrated so copy ~ compute)\n"
    "  --seed S        seed of the random data (default: from the clock; printed)\n"
    "  --quick         small and fast: --reps 5 --iters 200 --max-size 64M --experts 16\n"
    "  -h, --help      show this help\n";

typedef struct bench {
  const char *name;
  int (*run)(bc_ctx *, bu_json *);
} bench;

static const bench benches[] = {
    {"overhead", bench_overhead},
    {"pinned", bench_pinned},
    {"pageable", bench_pageable},
    {"overlap", bench_overlap},
    {"expert", bench_expert},
    {"grouped", bench_grouped},
};
#define NBENCH (sizeof benches / sizeof benches[0])

typedef struct outcome {
  int selected, ran, ok;
  char *figures; /* the sub-benchmark's JSON object (malloc'd), when ok */
  size_t figures_len;
  char error[512];
} outcome;

/* ---- options ---------------------------------------------------------------------------------- */

static int parse_long(const char *name, const char *s, long lo, long hi, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) {
    fprintf(stderr, "bench-cuda: %s wants a whole number from %ld to %ld, not '%s'\n", name, lo,
            hi, s);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_size(const char *name, const char *s, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  unsigned long long mult = 1;
  if (*end == 'K' || *end == 'k')
    mult = KIB, end++;
  else if (*end == 'M' || *end == 'm')
    mult = MIB, end++;
  else if (*end == 'G' || *end == 'g')
    mult = GIB, end++;
  if (errno || end == s || *end || s[0] == '-' || v == 0 || v > (64ull << 30) / mult ||
      v * mult < 4 * KIB) {
    fprintf(stderr, "bench-cuda: %s wants a size from 4K to 64G (suffix K, M or G), not '%s'\n",
            name, s);
    return -1;
  }
  *out = (size_t)(v * mult);
  return 0;
}

/* 0 to run, 1 after printing help, 2 on a usage error. */
static int parse_options(int argc, char **argv, bc_options *o, outcome *sel) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  *o = (bc_options){"cuda:0", NULL, 11, 500, GIB, cpus > 8 ? 8 : cpus < 1 ? 1 : cpus, 64, 0, 0};
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--quick") == 0) {
      o->reps = 5;
      o->iters = 200;
      o->max_size = 64 * MIB;
      o->experts = 16;
    }
  int any = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(usage, stdout);
      return 1;
    }
    if (strcmp(a, "--quick") == 0)
      continue;
    if (a[0] != '-') {
      size_t b = 0;
      while (b < NBENCH && strcmp(a, benches[b].name) != 0)
        b++;
      if (b == NBENCH) {
        fprintf(stderr, "bench-cuda: unknown benchmark '%s'\n%s", a, usage);
        return 2;
      }
      sel[b].selected = any = 1;
      continue;
    }
    static const char *const with_value[] = {"--device", "--json",    "--reps",    "--iters",
                                             "--max-size", "--threads", "--experts", "--tokens",
                                             "--seed"};
    size_t k = 0;
    while (k < sizeof with_value / sizeof *with_value && strcmp(a, with_value[k]) != 0)
      k++;
    if (k == sizeof with_value / sizeof *with_value) {
      fprintf(stderr, "bench-cuda: unknown option '%s'\n%s", a, usage);
      return 2;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "bench-cuda: option %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    long n;
    int bad = 0;
    if (strcmp(a, "--device") == 0)
      o->device = v;
    else if (strcmp(a, "--json") == 0)
      o->json = v;
    else if (strcmp(a, "--reps") == 0)
      bad = parse_long(a, v, 1, 1000, &o->reps);
    else if (strcmp(a, "--iters") == 0)
      bad = parse_long(a, v, 1, 1000000, &o->iters);
    else if (strcmp(a, "--max-size") == 0)
      bad = parse_size(a, v, &o->max_size);
    else if (strcmp(a, "--threads") == 0)
      bad = parse_long(a, v, 1, 64, &o->threads);
    else if (strcmp(a, "--experts") == 0)
      bad = parse_long(a, v, 1, 4096, &o->experts);
    else if (strcmp(a, "--tokens") == 0) {
      bad = parse_long(a, v, 64, 32768, &o->tokens);
      if (!bad && o->tokens % 64) {
        fprintf(stderr, "bench-cuda: --tokens wants a multiple of 64, not %ld\n", o->tokens);
        bad = -1;
      }
    } else if (!(bad = parse_long(a, v, 1, 0x7fffffffL, &n)))
      o->seed = (uint64_t)n;
    if (bad)
      return 2;
  }
  for (size_t b = 0; !any && b < NBENCH; b++)
    sel[b].selected = 1;
  return 0;
}

/* ---- device ----------------------------------------------------------------------------------- */

/* Why there is no such device, in words: what tandem says of its cuda backend. */
static void explain_missing(const char *id) {
  int n = 0;
  fprintf(stderr, "bench-cuda: no device %s: %s\n", id, tdm_last_error());
  if (tdm_backend_count(&n) < 0)
    return;
  for (int i = 0; i < n; i++) {
    tdm_backend_info b;
    if (tdm_backend_get(i, &b) == 0 && strcmp(b.name, "cuda") == 0) {
      fprintf(stderr, "bench-cuda: tandem's cuda backend: %s, %d devices%s%s\n",
              b.status == 0 ? "loaded" : tdm_err_name(b.status), b.device_count,
              b.detail[0] ? ": " : "", b.detail);
      return;
    }
  }
  fprintf(stderr, "bench-cuda: tandem knows no cuda backend (is libtandem-cuda.so next to "
                  "libtandem.so, or on $TANDEM_BACKEND_PATH?)\n");
}

/* 0, 77 when the device is absent, or 1. */
static int open_device(bc_ctx *c, const char *id) {
  void *native;
  if (tdm_device_find(id, &c->dev) < 0) {
    explain_missing(id);
    return 77;
  }
  if (TDM_CALL(tdm_device_info_get(c->dev, &c->info)) < 0)
    return 1;
  if (strcmp(c->info.backend, "cuda") != 0) {
    fprintf(stderr, "bench-cuda: %s is a %s device, not a CUDA one\n", id, c->info.backend);
    return 1;
  }
  if (TDM_CALL(tdm_device_native(c->dev, &native)) < 0)
    return 1;
  c->ordinal = *(const int *)native;
  /* tandem saves and restores the caller's current device; the raw side works on this one. */
  if (CUDA_CALL(cudaSetDevice(c->ordinal)) < 0 ||
      CUDA_CALL(cudaGetDeviceProperties(&c->prop, c->ordinal)) < 0)
    return 1;
  return 0;
}

/* ---- results ---------------------------------------------------------------------------------- */

static void device_json(bu_json *j, const bc_ctx *c) {
  char bus[32] = "unknown";
  int rt = 0, drv = 0, blas[3] = {0, 0, 0};
  CUDA_CALL(cudaDeviceGetPCIBusId(bus, (int)sizeof bus, c->ordinal));
  CUDA_CALL(cudaRuntimeGetVersion(&rt));
  CUDA_CALL(cudaDriverGetVersion(&drv));
  BLAS_CALL(cublasGetProperty(MAJOR_VERSION, &blas[0]));
  BLAS_CALL(cublasGetProperty(MINOR_VERSION, &blas[1]));
  BLAS_CALL(cublasGetProperty(PATCH_LEVEL, &blas[2]));
  char cc[32], cublas[48];
  snprintf(cc, sizeof cc, "%d.%d", c->prop.major, c->prop.minor);
  snprintf(cublas, sizeof cublas, "%d.%d.%d", blas[0], blas[1], blas[2]);
  bu_json_object(j, "device");
  bu_json_string(j, "id", c->info.id);
  bu_json_string(j, "name", c->prop.name);
  bu_json_string(j, "tandem_name", c->info.name);
  bu_json_int(j, "ordinal", c->ordinal);
  bu_json_string(j, "compute_capability", cc);
  bu_json_int(j, "multiprocessors", c->prop.multiProcessorCount);
  bu_json_uint(j, "total_memory", c->prop.totalGlobalMem);
  bu_json_string(j, "pci_bus_id", bus);
  bu_json_int(j, "cuda_runtime", rt);
  bu_json_int(j, "cuda_driver", drv);
  bu_json_string(j, "cublas", cublas);
  bu_json_end(j);
}

static int write_json(const char *path, const char *command, const bc_ctx *c,
                      const bu_machine *m, const outcome *res) {
  const bc_options *o = c->opt;
  bu_json j;
  if (!bu_json_begin(&j, "bench-cuda", path, command, TANDEM_GIT_COMMIT, tdm_version_string(), m))
    return -1;
  device_json(&j, c);
  bu_json_uint(&j, "seed", c->seed);
  bu_json_object(&j, "options");
  bu_json_int(&j, "reps", o->reps);
  bu_json_int(&j, "iters", o->iters);
  bu_json_uint(&j, "max_size", o->max_size);
  bu_json_int(&j, "threads", o->threads);
  bu_json_int(&j, "experts", o->experts);
  bu_json_int(&j, "tokens", o->tokens);
  bu_json_end(&j);
  bu_json_object(&j, "benchmarks");
  for (size_t b = 0; b < NBENCH; b++) {
    if (!res[b].ran)
      continue;
    bu_json_object(&j, benches[b].name);
    if (res[b].ok) {
      bu_json_string(&j, "status", "ok");
      size_t len = res[b].figures_len; /* without the line break that ends the document */
      while (len && res[b].figures[len - 1] == '\n')
        len--;
      bu_json_raw(&j, "figures", res[b].figures, len);
    } else {
      bu_json_string(&j, "status", "failed");
      bu_json_string(&j, "error", res[b].error);
    }
    bu_json_end(&j);
  }
  bu_json_end(&j);
  return bu_json_close(&j, "bench-cuda", path);
}

/* Runs one sub-benchmark, catching its JSON object in memory. */
static void run_bench(bc_ctx *c, const bench *b, outcome *r) {
  long before = bc_failures();
  FILE *f;
  bc_note_reset();
  r->ran = 1;
  if (!(f = open_memstream(&r->figures, &r->figures_len))) {
    bc_failf("open_memstream: %s", strerror(errno));
  } else {
    bu_json json;
    bu_json_init(&json, f, 2);
    int rc = b->run(c, &json);
    /* A sub-benchmark that failed may leave its object open; its figures are not used. */
    if (rc == 0 && bu_json_finish(&json) < 0)
      bc_failf("%s wrote its JSON wrongly", b->name);
    if (fclose(f) != 0)
      bc_failf("writing %s's JSON to memory failed", b->name);
    r->ok = rc == 0 && bc_failures() == before;
    if (!r->ok && !bc_first_failure()[0])
      bc_failf("%s failed", b->name);
  }
  if (!r->ok)
    snprintf(r->error, sizeof r->error, "%s", bc_first_failure());
}

int main(int argc, char **argv) {
  bc_options opt;
  outcome res[NBENCH] = {{0}};
  bc_ctx c = {.opt = &opt};
  bu_machine m;
  char command[1024];
  int rc = parse_options(argc, argv, &opt, res);
  if (rc)
    return rc == 1 ? 0 : 2;
  bu_join_argv(argc, argv, command, sizeof command);
  bu_machine_get(&m);
  c.seed = opt.seed ? opt.seed : (uint64_t)(bu_seconds() * 1e9) ^ (uint64_t)getpid() << 32;
  if (TDM_CALL(tdm_init()) < 0)
    return 1;
  int code = open_device(&c, opt.device);
  if (code != 0)
    goto out;
  printf("bench-cuda: tandem %s on %s = CUDA device %d, %s (sm_%d%d, %d SMs, %.1f GiB), commit "
         "%s\n",
         tdm_version_string(), c.info.id, c.ordinal, c.prop.name, c.prop.major, c.prop.minor,
         c.prop.multiProcessorCount, (double)c.prop.totalGlobalMem / (double)GIB,
         TANDEM_GIT_COMMIT);
  printf("machine: %s, %s, %ld cores; seed %llu\n", m.hostname, m.cpu, m.cores,
         (unsigned long long)c.seed);
  fflush(stdout);
  double t0 = bu_seconds();
  for (size_t b = 0; b < NBENCH; b++)
    if (res[b].selected)
      run_bench(&c, &benches[b], &res[b]);

  code = 0;
  printf("\nbench-cuda: %.0f s;", bu_seconds() - t0);
  for (size_t b = 0; b < NBENCH; b++)
    if (res[b].ran) {
      printf(" %s %s", benches[b].name, res[b].ok ? "ok" : "FAILED");
      code |= !res[b].ok;
    }
  putchar('\n');
  for (size_t b = 0; b < NBENCH; b++)
    if (res[b].ran && !res[b].ok)
      printf("  %s: %s\n", benches[b].name, res[b].error);
  if (opt.json) {
    if (write_json(opt.json, command, &c, &m, res) < 0)
      code = 1;
    else
      printf("results written to %s\n", opt.json);
  }
  fflush(stdout);
out:
  for (size_t b = 0; b < NBENCH; b++)
    free(res[b].figures);
  tdm_shutdown();
  return code;
}
