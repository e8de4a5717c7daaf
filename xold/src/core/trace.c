/* trace.c: TANDEM_TRACE=path records every command's start and end per queue and writes them,
 * at the last shutdown, in the Chrome trace-event format (chrome://tracing, Perfetto): one
 * process per device, one thread per queue, so copy/compute overlap can be seen.
 *
 * Start is when the command began on a host thread (host-executed commands and host tasks);
 * for native device work tandem does not observe the start, so it is the later of its
 * submission and the end of the previous command on the same in-order queue. End is when
 * tandem saw it complete.
 *
 * The file is opened at init, so that one that cannot be written is reported before the run
 * rather than after it (and nothing is recorded for it), and written at the last shutdown. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define TRACE_MAX (1u << 22) /* records kept; later ones are counted, not kept */

typedef struct rec {
  uint64_t start, end;
  const char *op;
  int dev, queue, status;
} rec;

_Atomic bool tdm__tracing;
static pthread_mutex_t trace_mu = PTHREAD_MUTEX_INITIALIZER;
static rec *recs;
static size_t nrecs, caprecs, dropped;
static uint64_t t0;
static FILE *trace_file; /* open from init to the last shutdown */

void tdm__trace_start(void) {
  if (!tdm__g.opts.trace[0]) return;
  if (trace_file) fclose(trace_file); /* left by an init that failed after this */
  trace_file = fopen(tdm__g.opts.trace, "w");
  if (!trace_file) {
    fprintf(stderr, "tandem: cannot write the trace to %s: %s; tracing is off\n",
            tdm__g.opts.trace, strerror(errno));
    return;
  }
  t0 = tdm__now_ns();
  nrecs = dropped = 0;
  atomic_store(&tdm__tracing, true);
}

void tdm__trace_cmd(tdm__cmd *cmd, int status) {
  tdm__queue *q = cmd->ev->q;
  uint64_t end = tdm__now_ns(), start = cmd->t_start;
  if (!start) {
    start = cmd->t_submit;
    if (!(q->flags & TDM_QUEUE_OUT_OF_ORDER) && q->trace_last_end > start) start = q->trace_last_end;
  }
  if (!(q->flags & TDM_QUEUE_OUT_OF_ORDER)) q->trace_last_end = end;
  pthread_mutex_lock(&trace_mu);
  if (nrecs == caprecs && caprecs < TRACE_MAX) {
    size_t cap = caprecs ? caprecs * 2 : 4096;
    rec *n = realloc(recs, cap * sizeof *n);
    if (n) {
      recs = n;
      caprecs = cap;
    }
  }
  if (nrecs < caprecs)
    recs[nrecs++] = (rec){start, end, cmd->ev->op, q->dev->index, q->id, status};
  else
    dropped++;
  pthread_mutex_unlock(&trace_mu);
}

void tdm__trace_flush(void) {
  if (!atomic_exchange(&tdm__tracing, false)) return;
  FILE *f = trace_file;
  trace_file = NULL;
  /* Each event after the first starts with the comma: none trails the last, whether that is
   * a device's name (no command ran) or a command. */
  const char *sep = "";
  fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  for (int d = 0; d < tdm__g.ndevices; d++, sep = ",\n")
    fprintf(f, "%s{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": "
               "{\"name\": \"%s\"}}", sep, d, tdm__g.devices[d].info.id);
  for (size_t i = 0; i < nrecs; i++, sep = ",\n") {
    const rec *r = &recs[i];
    uint64_t s = r->start > t0 ? r->start - t0 : 0, e = r->end > t0 ? r->end - t0 : 0;
    fprintf(f, "%s{\"ph\": \"X\", \"name\": \"%s\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
               "\"dur\": %.3f, \"args\": {\"status\": %d}}", sep,
            r->op ? r->op : "command", r->dev, r->queue, s / 1e3, (e > s ? e - s : 0) / 1e3,
            r->status);
  }
  fprintf(f, "\n], \"otherData\": {\"dropped\": %zu}}\n", dropped);
  if (fclose(f) != 0)
    fprintf(stderr, "tandem: writing the trace to %s failed: %s\n", tdm__g.opts.trace,
            strerror(errno));
  free(recs);
  recs = NULL;
  nrecs = caprecs = 0;
}
