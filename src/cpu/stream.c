/* stream.c: the tdm_cpu_stream, the CPU backend's native in-order queue: one worker thread
 * and a FIFO. tandem commands and raw launches by user code share the FIFO, which is why a
 * marker covers work that other code launched. Host tasks run inline on the worker. */
#include <stdbool.h>
#include <stdlib.h>

#include "core/internal.h" /* tdm__error: the interop calls below may come before tdm_init */
#include "cpu.h"

#define STREAM_MAGIC 0x43505553u /* "CPUS" */

/* The worker is a workq (util/workq.h) with one thread: commands run in push order. */
struct tdm_cpu_stream {
  unsigned magic;
  tdm__workq wq;
};

/* A raw launch travels in the FIFO as a command without an event. */
typedef struct raw {
  tdm__cmd cmd; /* first */
  void (*fn)(void *);
  void *arg;
} raw;

static void run_one(tdm__workq *wq, tdm__workq_item *it) {
  tdm__cmd *c = TDM__CONTAINER_OF(it, tdm__cmd, link);
  if (c->ev) {
    tdm__cpu_svc->cmd_run(c);
  } else {
    raw *r = (raw *)c;
    r->fn(r->arg);
    free(r);
  }
}

int tdm__cpu_stream_new(tdm_cpu_stream **out) {
  tdm_cpu_stream *s = calloc(1, sizeof *s);
  if (!s) return TDM_ENOMEM;
  if (tdm__workq_init(&s->wq, run_one, NULL, s)) {
    free(s);
    return TDM_ENOMEM;
  }
  /* Host tasks come in bursts (a layer's host experts, say): between them the worker polls
   * for TANDEM_SPIN_US before it sleeps (0 before the first init: it sleeps at once). */
  s->wq.spin_ns = tdm__option_long("TANDEM_SPIN_US", 0) * 1000L;
  if (tdm__workq_start(&s->wq)) {
    tdm__workq_fini(&s->wq);
    free(s);
    return TDM_ENOMEM;
  }
  s->magic = STREAM_MAGIC;
  *out = s;
  return 0;
}

/* Runs what is queued, then joins the worker. */
void tdm__cpu_stream_free(tdm_cpu_stream *s) {
  tdm__workq_stop(&s->wq);
  s->magic = 0;
  tdm__workq_fini(&s->wq);
  free(s);
}

int tdm__cpu_stream_valid(const tdm_cpu_stream *s) { return s && s->magic == STREAM_MAGIC; }

/* Every push wakes a sleeping worker: the stream's work is what the queue waits for. The
 * stream outlives this call (it is freed only once its queue is destroyed, which waits for
 * submissions in progress). */
int tdm__cpu_stream_push(tdm_cpu_stream *s, tdm__cmd *cmd) {
  return tdm__workq_try_push(&s->wq, &cmd->link, true) ? 0 : TDM_ESTATE;
}

/* ---- public interop (tandem/cpu.h) ---- */

/* A forked child has the stream's memory but not its worker thread: nothing would run, and a
 * destroy would wait for ever. */
static int forked(const char *call) {
  tdm__fork_guard();
  if (!atomic_load(&tdm__forked)) return 0;
  return tdm__error(TDM_EFORK, 0, "%s in a child forked after the stream or tdm_init was made; "
                    "its threads belong to the parent", call);
}

int tdm_cpu_stream_create(tdm_cpu_stream **out) {
  int rc = forked("tdm_cpu_stream_create");
  if (rc) return rc;
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_cpu_stream_create: out is NULL");
  rc = tdm__cpu_stream_new(out);
  return rc ? tdm__error(rc, 0, "tdm_cpu_stream_create: cannot start the stream's worker") : 0;
}

int tdm_cpu_stream_destroy(tdm_cpu_stream *s) {
  int rc = forked("tdm_cpu_stream_destroy");
  if (rc) return rc;
  if (!tdm__cpu_stream_valid(s))
    return tdm__error(TDM_EHANDLE, 0, "tdm_cpu_stream_destroy: %p is not a tdm_cpu_stream",
                      (void *)s);
  tdm__cpu_stream_free(s);
  return 0;
}

int tdm_cpu_stream_launch(tdm_cpu_stream *s, void (*fn)(void *), void *arg) {
  int rc = forked("tdm_cpu_stream_launch");
  if (rc) return rc;
  if (!tdm__cpu_stream_valid(s))
    return tdm__error(TDM_EHANDLE, 0, "tdm_cpu_stream_launch: %p is not a tdm_cpu_stream",
                      (void *)s);
  if (!fn) return tdm__error(TDM_EINVAL, 0, "tdm_cpu_stream_launch: fn is NULL");
  raw *r = calloc(1, sizeof *r);
  if (!r) return tdm__error(TDM_ENOMEM, 0, "tdm_cpu_stream_launch: no memory for the launch");
  r->fn = fn;
  r->arg = arg;
  rc = tdm__cpu_stream_push(s, &r->cmd);
  if (rc) free(r);
  return rc ? tdm__error(rc, 0, "tdm_cpu_stream_launch: the stream is being destroyed") : 0;
}
