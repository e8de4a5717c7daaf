/* sidebyside.h: what the per-backend call-cost benchmarks (bench-opencl, bench-sycl) share: a
 * table of figures, each measured through tandem and through the raw calls it stands for,
 * interleaved rep by rep (bu_interleaved), with the median time per call, the ratio and its
 * goal printed and written to JSON, and the same command-line options. A benchmark program
 * keeps its own context (passed through as void *), its raw side and its JSON header. */
#ifndef TANDEM_BENCH_SIDEBYSIDE_H
#define TANDEM_BENCH_SIDEBYSIDE_H

#include "measure.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One figure: each side makes `iters` calls and times them (returns < 0 after reporting). */
typedef struct sbs_bench {
  const char *key;   /* JSON name */
  const char *label; /* human name */
  const char *tandem_call, *raw_call;
  int (*tandem)(void *ctx, double *seconds);
  int (*raw)(void *ctx, double *seconds);
} sbs_bench;

typedef struct sbs_result {
  double tandem_us, raw_us, ratio; /* per call, medians over reps */
} sbs_result;

typedef struct sbs_side_arg {
  void *ctx;
  const sbs_bench *b;
} sbs_side_arg;

static inline int sbs_side(void *p, int baseline, double *seconds) {
  sbs_side_arg *a = (sbs_side_arg *)p;
  return baseline ? a->b->raw(a->ctx, seconds) : a->b->tandem(a->ctx, seconds);
}

static inline int sbs_run(const char *prog, void *ctx, long iters, const sbs_bench *b, long reps,
                          sbs_result *r) {
  sbs_side_arg a = {ctx, b};
  double t, rt;
  int rc = bu_interleaved(&a, sbs_side, NULL, reps, &t, &rt);
  if (rc == -2) fprintf(stderr, "%s: out of host memory\n", prog);
  if (rc < 0) return -1;
  r->tandem_us = t / (double)iters * 1e6;
  r->raw_us = rt / (double)iters * 1e6;
  r->ratio = r->tandem_us / r->raw_us;
  return 0;
}

static inline void sbs_print_columns(void) {
  printf("  %-42s %10s %10s %8s\n", "benchmark", "tandem", "raw", "ratio");
}

static inline void sbs_print_row(const sbs_bench *b, const sbs_result *r, double goal) {
  printf("  %-42s %7.3f us %7.3f us %7.2fx   goal <= %.2fx: %s\n", b->label, r->tandem_us,
         r->raw_us, r->ratio, goal, r->ratio <= goal ? "met" : "missed");
  fflush(stdout);
}

/* The figures as the array "results" of the object open in j. */
static inline void sbs_write_results(bu_json *j, const sbs_bench *b, const sbs_result *r, size_t n,
                                     double goal) {
  bu_json_array(j, "results");
  for (size_t i = 0; i < n; i++) {
    bu_json_object(j, NULL);
    bu_json_string(j, "name", b[i].key);
    bu_json_string(j, "description", b[i].label);
    bu_json_string(j, "tandem_call", b[i].tandem_call);
    bu_json_string(j, "raw_call", b[i].raw_call);
    bu_json_double(j, "tandem_us", r[i].tandem_us, 4);
    bu_json_double(j, "raw_us", r[i].raw_us, 4);
    bu_json_double(j, "ratio", r[i].ratio, 4);
    bu_json_double(j, "goal_ratio", goal, 2);
    bu_json_bool(j, "goal_met", r[i].ratio <= goal);
    bu_json_end(j);
  }
  bu_json_end(j);
}

/* Every figure of the table in turn, each row printed as it is measured; 0, or -1 (reported). */
static inline int sbs_run_all(const char *prog, void *ctx, long iters, const sbs_bench *b,
                              size_t n, long reps, sbs_result *r, double goal) {
  for (size_t i = 0; i < n; i++) {
    if (sbs_run(prog, ctx, iters, &b[i], reps, &r[i]) < 0) return -1;
    sbs_print_row(&b[i], &r[i], goal);
  }
  return 0;
}

typedef struct sbs_options {
  const char *device, *json;
  long reps, iters;
} sbs_options;

static inline int sbs_parse_long(const char *prog, const char *name, const char *s, long max,
                                  long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 1 || v > max) {
    fprintf(stderr, "%s: %s wants a whole number from 1 to %ld, not '%s'\n", prog, name, max, s);
    return -1;
  }
  *out = v;
  return 0;
}

/* --device D, --json FILE, --reps R (default 31), --iters N (default 1000), -h. 0 to run, 1
 * after printing help, 2 on a usage error. */
static inline int sbs_parse_options(const char *prog, const char *usage, const char *device,
                                    int argc, char **argv, sbs_options *o) {
  *o = (sbs_options){device, NULL, 31, 1000};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(usage, stdout);
      return 1;
    }
    if (strcmp(a, "--device") && strcmp(a, "--json") && strcmp(a, "--reps") &&
        strcmp(a, "--iters")) {
      fprintf(stderr, "%s: unknown option '%s'\n%s", prog, a, usage);
      return 2;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "%s: option %s needs a value\n", prog, a);
      return 2;
    }
    const char *v = argv[++i];
    if (strcmp(a, "--device") == 0)
      o->device = v;
    else if (strcmp(a, "--json") == 0)
      o->json = v;
    else if (sbs_parse_long(prog, a, v, strcmp(a, "--reps") == 0 ? 1000 : 1000000,
                            strcmp(a, "--reps") == 0 ? &o->reps : &o->iters) < 0)
      return 2;
  }
  return 0;
}

#endif /* TANDEM_BENCH_SIDEBYSIDE_H */
