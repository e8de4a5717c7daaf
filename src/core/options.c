/* options.c: every environment option tandem reads, in one table, read at the first init.
 * Bad values are reported on stderr and replaced by the default. TANDEM_BACKENDS and
 * TANDEM_DEVICE name backends and devices, so modules.c checks them once every backend is in. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

typedef enum { OPT_LONG, OPT_STRING, OPT_QUEUE } opt_type;

typedef struct opt_def {
  const char *name;
  opt_type type;
  long def, min, max;
  size_t offset;
  size_t size; /* strings */
  const char *doc;
} opt_def;

#define OFF(f) offsetof(tdm__options, f)

static const opt_def opt_table[] = {
    {"TANDEM_DEVICE", OPT_STRING, 0, 0, 0, OFF(device), sizeof(((tdm__options *)0)->device),
     "default device id (cpu:0, cuda:0...)"},
    {"TANDEM_DEFAULT_QUEUE", OPT_QUEUE, 0, 0, 0, OFF(default_flags), 0,
     "in_order or out_of_order: flags of the cached default queues"},
    {"TANDEM_CPU_DEVICES", OPT_LONG, 1, 1, 16, OFF(cpu_devices), 0, "number of CPU devices"},
    {"TANDEM_CPU_POOL_THREADS", OPT_LONG, 0, 1, 256, OFF(cpu_pool_threads), 0,
     "threads for out-of-order CPU queues (0: max(4, cores))"},
    {"TANDEM_TRACKER_CAPACITY", OPT_LONG, 64, 2, 1 << 20, OFF(tracker_capacity), 0,
     "order-tracker entries per queue before they collapse"},
    {"TANDEM_BACKEND_PATH", OPT_STRING, 0, 0, 0, OFF(backend_path),
     sizeof(((tdm__options *)0)->backend_path), "colon-separated folders with backend modules"},
    {"TANDEM_OPENCL_DEFER", OPT_LONG, -1, -1, 1, OFF(opencl_defer), 0,
     "OpenCL host-task gates: 1 on the host, 0 with user events, -1 (default) by driver"},
    {"TANDEM_CUDA_BLOCKING_SYNC", OPT_LONG, 0, 0, 1, OFF(cuda_blocking_sync), 0,
     "1: tandem's threads wait for CUDA events asleep (cudaEventBlockingSync), not spinning"},
    {"TANDEM_TRACE", OPT_STRING, 0, 0, 0, OFF(trace), sizeof(((tdm__options *)0)->trace),
     "file to write a Chrome trace of every command to, at the last shutdown"},
    {"TANDEM_EXIT_WAIT_MS", OPT_LONG, 2000, 0, 600000, OFF(exit_wait_ms), 0,
     "returning from main without tdm_shutdown: ms to wait for submitted work first"},
    {"TANDEM_SPIN_US", OPT_LONG, 20, 0, 100000, OFF(spin_us), 0,
     "us a host wait, and a CPU queue's idle worker, poll before they sleep"},
    {"TANDEM_BACKENDS", OPT_STRING, 0, 0, 0, OFF(backends), sizeof(((tdm__options *)0)->backends),
     "comma-separated backends to load (cpu,opencl,cuda); all when unset"},
};

static long parse_long(const opt_def *d, const char *v) {
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || end == v || *end || x < d->min || x > d->max) {
    fprintf(stderr, "tandem: ignoring %s=%s (expected an integer in [%ld, %ld])\n", d->name, v,
            d->min, d->max);
    return d->def;
  }
  return x;
}

void tdm__options_load(tdm__options *o) {
  memset(o, 0, sizeof *o);
  for (size_t i = 0; i < sizeof opt_table / sizeof opt_table[0]; i++) {
    const opt_def *d = &opt_table[i];
    const char *v = getenv(d->name);
    char *field = (char *)o + d->offset;
    switch (d->type) {
      case OPT_LONG:
        *(long *)field = (v && *v) ? parse_long(d, v) : d->def;
        break;
      case OPT_STRING:
        if (v && strlen(v) >= d->size) { /* cut, it would name something else */
          fprintf(stderr, "tandem: ignoring %s (%zu bytes, longer than the %zu it may have)\n",
                  d->name, strlen(v), d->size - 1);
          v = NULL;
        }
        snprintf(field, d->size, "%s", v ? v : "");
        break;
      case OPT_QUEUE:
        *(unsigned *)field = TDM_QUEUE_IN_ORDER;
        if (v && *v) {
          if (strcmp(v, "out_of_order") == 0)
            *(unsigned *)field = TDM_QUEUE_OUT_OF_ORDER;
          else if (strcmp(v, "in_order") != 0)
            fprintf(stderr, "tandem: ignoring %s=%s (expected in_order or out_of_order)\n",
                    d->name, v);
        }
        break;
    }
  }
  if (o->cpu_pool_threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    o->cpu_pool_threads = n > 4 ? n : 4;
  }
}

long tdm__option_long(const char *name, long def) {
  for (size_t i = 0; i < sizeof opt_table / sizeof opt_table[0]; i++)
    if (strcmp(opt_table[i].name, name) == 0 && opt_table[i].type == OPT_LONG)
      return *(const long *)((const char *)&tdm__g.opts + opt_table[i].offset);
  return def;
}

bool tdm__backend_allowed(const char *name) {
  const char *list = tdm__g.opts.backends;
  if (!*list) return true;
  size_t n = strlen(name);
  for (const char *p = list; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len == n && strncmp(p, name, n) == 0) return true;
    if (!end) break;
    p = end + 1;
  }
  return false;
}
