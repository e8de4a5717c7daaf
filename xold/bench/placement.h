/* placement.h: where the benchmark's threads run. On a small or virtual machine a hand-off
 * costs a few microseconds when the woken thread shares the waker's CPU and tens when it
 * must wake another (idle) CPU, and the scheduler's choice between the two varies from thread
 * to thread and run to run. Comparing tandem with a bare hand-off is only fair when both run
 * under the same placement, so the benchmark pins its callers, tandem's queue workers (from a
 * host task, through the public API) and the bare workers alike.
 */
#ifndef TANDEM_BENCH_PLACEMENT_H
#define TANDEM_BENCH_PLACEMENT_H

#include "bare.h"

#include <sched.h>
#include <tandem.h>

typedef enum placement {
  PLACE_SAME,  /* callers and workers share one CPU: the software path, no cross-CPU wake-up */
  PLACE_SPLIT, /* callers on one CPU, workers on another: every hand-off crosses CPUs */
  PLACE_FREE,  /* the scheduler decides (the process's own affinity) */
  PLACE_COUNT
} placement;

typedef struct placement_cpus {
  cpu_set_t callers, workers;
} placement_cpus;

const char *placement_name(placement p);
/* One line saying what the placement measures. */
const char *placement_about(placement p);
/* Parses "same,split,free" into out[] (at most PLACE_COUNT); returns the count, or -1. */
int placement_parse(const char *list, placement *out);
/* The CPU sets for p, from the process's affinity at the first call. -1 when p needs two
 * CPUs and the process has one. */
int placement_cpus_get(placement p, placement_cpus *out);
/* Pins the calling thread; 0 or an errno value. */
int placement_pin_self(const cpu_set_t *set);
/* Pins q's worker thread by running a host task on it; 0 or a negative TDM_E* code. */
int placement_pin_tandem_worker(tdm_queue *q, const cpu_set_t *set);
/* Pins a bare worker by running a node on it; 0 or an errno value. */
int placement_pin_bare_worker(bare_queue *q, const cpu_set_t *set);

#endif /* TANDEM_BENCH_PLACEMENT_H */
