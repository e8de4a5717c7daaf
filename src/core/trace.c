/* trace.c: TANDEM_TRACE=path records every command's start and end per queue and writes them,
 * at the last shutdown, in the Chrome trace-event format (chrome://tracing, Perfetto): one
 * process per device, one thread per queue, so copy/compute overlap can be seen.
 *
 * Start is when the command began on a host thread (host-executed commands and host tasks);
 * for native device work tandem does not observe the start, so it is the later of its
 * submission and the end of the previous command on the same in-order queue. End is when
 * tandem saw it complete. */
#include <stdio.h>
#include <stdlib.h>

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

void tdm__trace_start(void) {
  if (!tdm__g.opts.trace[0]) return;
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
  FILE *f = fopen(tdm__g.opts.trace, "w");
  if (!f) {
    fprintf(stderr, "tandem: cannot write the trace to %s\n", tdm__g.opts.trace);
  } else {
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    for (int d = 0; d < tdm__g.ndevices; d++)
      fprintf(f, "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": {\"name\": "
                 "\"%s\"}},\n", d, tdm__g.devices[d].info.id);
    for (size_t i = 0; i < nrecs; i++) {
      const rec *r = &recs[i];
      uint64_t s = r->start > t0 ? r->start - t0 : 0, e = r->end > t0 ? r->end - t0 : 0;
      fprintf(f, "{\"ph\": \"X\", \"name\": \"%s\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
                 "\"dur\": %.3f, \"args\": {\"status\": %d}}%s\n",
              r->op ? r->op : "command", r->dev, r->queue, s / 1e3, (e > s ? e - s : 0) / 1e3,
              r->status, i + 1 < nrecs ? "," : "");
    }
    fprintf(f, "], \"otherData\": {\"dropped\": %zu}}\n", dropped);
    fclose(f);
  }
  free(recs);
  recs = NULL;
  nrecs = caprecs = 0;
}
