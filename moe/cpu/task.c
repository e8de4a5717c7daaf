/* cpu/task.c: the CPU operations' submission (cpu/task.h).
 *
 * Argument blocks are freed by a keep-alive on the same queue, not by the task itself: a task
 * whose predecessor failed completes with TDM_EDEP without running, and could not free its
 * block. */
#include "task.h"

#include <stdint.h>
#include <stdlib.h>

static void task_drop(task *t) {
  if (atomic_fetch_sub(&t->refs, 1) == 1) free(t);
}

static int task_run(void *arg) {
  task *t = arg;
  int rc = t->body(t);
  task_drop(t);
  return rc;
}

/* The keep-alive fires once the task has completed or been skipped, so it frees the block
 * whatever the count says. */
static void task_release(void *arg) { free(arg); }

/* Queues t (allocated by the caller, body set) on q; frees it on failure. */
int tdm_moe__task_submit(tdm_queue *q, task *t) {
  atomic_init(&t->refs, 2);
  int rc = tdm_host_task(q, task_run, t, 0, NULL, NULL);
  if (rc) {
    free(t);
    return rc;
  }
  /* The task is queued, so the op has been submitted whatever happens next. If the keep-alive
   * cannot be queued (out of memory), the task and this call share the block instead; it leaks
   * only if the task is then also skipped. */
  if (tdm_keep_alive(q, task_release, t) != 0) task_drop(t);
  return 0;
}

typedef struct host_call_args {
  task t;
  void (*fn)(void *);
  void *arg;
} host_call_args;

static int host_call_body(const task *t) {
  const host_call_args *a = (const host_call_args *)t;
  a->fn(a->arg);
  return 0;
}

int tdm_moe__host_call_task(tdm_queue *q, void (*fn)(void *), void *arg) {
  if (!fn) return tdm_moe__bad_args("host_call");
  host_call_args *a = tdm_moe__task_alloc(sizeof *a, "host_call");
  if (!a) return TDM_ENOMEM;
  *a = (host_call_args){.t.body = host_call_body, .fn = fn, .arg = arg};
  return tdm_moe__task_submit(q, &a->t);
}

int tdm_moe__check_state(void *st, tdm_queue *q, const char *op) {
  if (st && q && ((cpu_state *)st)->q == q) return 0;
  return tdm_set_error(TDM_EINVAL, 0, "moe %s: the state was not opened on this queue", op);
}

int tdm_moe__bad_args(const char *op) {
  return tdm_set_error(TDM_EINVAL, 0, "moe %s: NULL pointer or size out of range", op);
}

/* `size` bytes of host memory (an argument block, the state), or NULL with the error set.
 * tandem's fault hook sees it, so a test can fail it as it fails tandem's own allocations. */
void *tdm_moe__host_alloc(size_t size) {
  return tdm_fault_point(TDM_FAULT_ALLOC) ? NULL : malloc(size);
}

void *tdm_moe__task_alloc(size_t size, const char *op) {
  void *p = tdm_moe__host_alloc(size);
  if (!p) tdm_set_error(TDM_ENOMEM, 0, "moe %s: no host memory for %zu bytes", op, size);
  return p;
}

/* How many rows of `width` floats fit between p and the end of the tandem allocation holding
 * it; SIZE_MAX when tandem does not know the memory (then the caller vouches for it). */
size_t tdm_moe__rows_available(const float *p, int width) {
  tdm_mem_info mi;
  if (tdm_mem_query(p, &mi) != 0 || !mi.base) return SIZE_MAX;
  size_t left = (size_t)((const char *)mi.base + mi.size - (const char *)p);
  return left / ((size_t)width * sizeof(float));
}

