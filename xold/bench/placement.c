/* placement.c: pinning the benchmark's threads (see placement.h). */
#include "placement.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static const char *const names[PLACE_COUNT] = {"same", "split", "free"};
static const char *const abouts[PLACE_COUNT] = {
    "callers and workers pinned to one CPU: the software path, hand-offs are context switches",
    "callers pinned to one CPU, workers to another: every hand-off wakes the other CPU",
    "threads placed by the scheduler: a hand-off's cost depends on where it put each worker",
};

const char *placement_name(placement p) { return names[p]; }
const char *placement_about(placement p) { return abouts[p]; }

int placement_parse(const char *list, placement *out) {
  int n = 0;
  const char *s = list;
  for (;;) {
    size_t len = strcspn(s, ",");
    int found = -1;
    for (int p = 0; p < PLACE_COUNT; p++)
      if (strlen(names[p]) == len && strncmp(s, names[p], len) == 0)
        found = p;
    if (found < 0 || n == PLACE_COUNT)
      return -1;
    out[n++] = (placement)found;
    if (!s[len])
      return n;
    s += len + 1;
  }
}

int placement_cpus_get(placement p, placement_cpus *out) {
  static cpu_set_t initial;
  static int have_initial;
  if (!have_initial) { /* before any pinning changes the process's own affinity */
    if (sched_getaffinity(0, sizeof initial, &initial) != 0)
      return -1;
    have_initial = 1;
  }
  int first = -1, second = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE && second < 0; cpu++)
    if (CPU_ISSET(cpu, &initial)) {
      if (first < 0)
        first = cpu;
      else
        second = cpu;
    }
  if (p == PLACE_FREE) {
    out->callers = out->workers = initial;
    return 0;
  }
  if (first < 0 || (p == PLACE_SPLIT && second < 0))
    return -1;
  CPU_ZERO(&out->callers);
  CPU_ZERO(&out->workers);
  CPU_SET(first, &out->callers);
  CPU_SET(p == PLACE_SPLIT ? second : first, &out->workers);
  return 0;
}

int placement_pin_self(const cpu_set_t *set) {
  return pthread_setaffinity_np(pthread_self(), sizeof *set, set);
}

static int pin_task(void *arg) { return placement_pin_self(arg) == 0 ? 0 : TDM_ETASK; }

int placement_pin_tandem_worker(tdm_queue *q, const cpu_set_t *set) {
  tdm_event *ev;
  int rc = tdm_host_task(q, pin_task, (void *)set, 0, NULL, &ev);
  int submitted = rc == 0;
  if (submitted)
    rc = tdm_event_wait(ev);
  if (rc < 0) /* reported before the release below could replace tdm_last_error() */
    fprintf(stderr, "bench-runtime: pinning a queue's worker with a host task failed: %s\n",
            tdm_last_error()); /* the message starts with the code's name */
  if (submitted)
    tdm_event_release(ev);
  return rc;
}

typedef struct pin_request {
  const cpu_set_t *set;
  int rc;
  bare_event done;
} pin_request;

static void pin_node(void *arg) {
  pin_request *r = arg;
  r->rc = placement_pin_self(r->set);
  bare_event_set(&r->done);
}

int placement_pin_bare_worker(bare_queue *q, const cpu_set_t *set) {
  pin_request r = {.set = set};
  bare_node node = {NULL, pin_node, &r};
  bare_event_init(&r.done);
  bare_queue_push(q, &node);
  bare_event_wait(&r.done);
  bare_event_destroy(&r.done);
  return r.rc;
}
