/* measure.h: the small pieces every tandem measurement shares (the benchmarks of bench/ and the
 * tool's `tandem bench overlap` and `tandem moe`): a monotonic clock, the median, and what
 * result files carry: the command, the commit, the machine and the date, written with the JSON
 * writer of json.h. Not part of any library: a helper of the programs in bench/ and tools/.
 *
 * Static inline, apart from json.c (the library tandem-util: link it). Needs _GNU_SOURCE (the
 * build defines it) for gethostname and gmtime_r.
 */
#ifndef TANDEM_UTIL_MEASURE_H
#define TANDEM_UTIL_MEASURE_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "json.h"

#ifndef TANDEM_GIT_COMMIT
#define TANDEM_GIT_COMMIT "unknown"
#endif

/* Seconds on the monotonic clock: only differences mean anything. */
static inline double bu_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int bu__cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0..n); sorts v in place. n == 0 gives 0. */
static inline double bu_median(double *v, size_t n) {
  if (n == 0)
    return 0.0;
  qsort(v, n, sizeof *v, bu__cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* One side of a side-by-side figure: tandem (baseline 0) or what it is compared with
 * (baseline 1); times one repetition into *seconds; returns < 0 on failure. */
typedef int (*bu_side_fn)(void *arg, int baseline, double *seconds);

/* One untimed warm-up round of each side (then warmed(arg), if given), then reps rounds of
 * both, alternating which goes first rep by rep. *tandem and *base get the medians in
 * seconds. Returns 0, -1 when a side failed, -2 when out of host memory. */
static inline int bu_interleaved(void *arg, bu_side_fn side, void (*warmed)(void *arg),
                                 long reps, double *tandem, double *base) {
  double *t = (double *)calloc(2 * (size_t)reps, sizeof *t), *bt = t + reps, warm;
  int rc = -1;
  if (!t)
    return -2;
  if (side(arg, 0, &warm) < 0 || side(arg, 1, &warm) < 0)
    goto out;
  if (warmed)
    warmed(arg);
  for (long i = 0; i < reps; i++) {
    int tandem_first = i % 2 == 0;
    if ((tandem_first && side(arg, 0, &t[i]) < 0) || side(arg, 1, &bt[i]) < 0 ||
        (!tandem_first && side(arg, 0, &t[i]) < 0))
      goto out;
  }
  *tandem = bu_median(t, (size_t)reps);
  *base = bu_median(bt, (size_t)reps);
  rc = 0;
out:
  free(t);
  return rc;
}

/* Joins argv with spaces into buf (truncated to size), for the "command" field of results. */
static inline void bu_join_argv(int argc, char **argv, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < argc && used + 1 < size; i++) {
    int n = snprintf(buf + used, size - used, "%s%s", i ? " " : "", argv[i]);
    if (n < 0)
      break;
    used += (size_t)n;
  }
}

/* The current UTC time as ISO 8601, "2026-11-30T06:14:00Z". */
static inline void bu_utc_date(char *buf, size_t size) {
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(buf, size, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

typedef struct bu_machine {
  char hostname[256];
  char cpu[256]; /* "model name" from /proc/cpuinfo, or "unknown" */
  long cores;    /* online logical CPUs */
} bu_machine;

static inline void bu_machine_get(bu_machine *m) {
  if (gethostname(m->hostname, sizeof m->hostname) != 0)
    strcpy(m->hostname, "unknown");
  m->hostname[sizeof m->hostname - 1] = '\0';
  strcpy(m->cpu, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (f) {
    char line[512];
    while (fgets(line, sizeof line, f)) {
      const char *colon = strchr(line, ':');
      if (strncmp(line, "model name", 10) != 0 || !colon)
        continue;
      colon++;
      while (*colon == ' ' || *colon == '\t')
        colon++;
      snprintf(m->cpu, sizeof m->cpu, "%s", colon);
      m->cpu[strcspn(m->cpu, "\n")] = '\0';
      break;
    }
    fclose(f);
  }
  m->cores = sysconf(_SC_NPROCESSORS_ONLN);
}

/* Writes the machine as an object member `key` (NULL in an array). */
static inline void bu_machine_json(bu_json *j, const char *key, const bu_machine *m) {
  bu_json_object(j, key);
  bu_json_string(j, "hostname", m->hostname);
  bu_json_string(j, "cpu", m->cpu);
  bu_json_int(j, "cores", m->cores);
  bu_json_end(j);
}

/* What every result carries, as members of the object open in j: the command, the commit,
 * the date, tandem's version and the machine. */
static inline void bu_json_header(bu_json *j, const char *command, const char *commit,
                                  const char *version, const bu_machine *m) {
  char date[32];
  bu_utc_date(date, sizeof date);
  bu_json_string(j, "command", command);
  bu_json_string(j, "commit", commit);
  bu_json_string(j, "date", date);
  bu_json_string(j, "tandem_version", version);
  bu_machine_json(j, "machine", m);
}

/* Opens a result file, writing through j, and starts it: the top-level object and the
 * header; the caller goes on with its own members and ends with bu_json_close. NULL (and a
 * message on stderr) if the file cannot be opened. */
static inline FILE *bu_json_begin(bu_json *j, const char *prog, const char *path,
                                  const char *command, const char *commit, const char *version,
                                  const bu_machine *m) {
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
    return NULL;
  }
  bu_json_init(j, f, 2);
  bu_json_object(j, NULL);
  bu_json_header(j, command, commit, version, m);
  return f;
}

/* Ends the top-level object of a file from bu_json_begin and closes the file. 0, or -1 (and a
 * message on stderr) when writing it failed. */
static inline int bu_json_close(bu_json *j, const char *prog, const char *path) {
  int err = 0;
  bu_json_end(j);
  errno = 0;
  if (bu_json_finish(j) < 0) err = errno ? errno : EIO;
  if (fclose(j->f) != 0 && !err) err = errno;
  if (err) {
    fprintf(stderr, "%s: writing %s failed: %s\n", prog, path, strerror(err));
    return -1;
  }
  return 0;
}

#endif /* TANDEM_UTIL_MEASURE_H */
