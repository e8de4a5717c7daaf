/* stream.c: the tdm_cpu_stream, the CPU backend's native in-order queue: one worker thread
 * and a FIFO. tandem commands and raw launches by user code share the FIFO, which is why a
 * marker covers work that other code launched. Host tasks run inline on the worker. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "core/internal.h" /* tdm__error: the interop calls below may come before tdm_init */
#include "cpu.h"

#define STREAM_MAGIC 0x43505553u /* "CPUS" */

struct tdm_cpu_stream {
  unsigned magic;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  tdm__cmd *head, *tail;
  bool stop;
  bool idle; /* the worker sleeps on cv (under mu) */
  pthread_t thread;
};

/* A raw launch travels in the FIFO as a command without an event. */
typedef struct raw {
  tdm__cmd cmd; /* first */
  void (*fn)(void *);
  void *arg;
} raw;

static void *worker(void *arg) {
  tdm_cpu_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stop) {
      s->idle = true;
      pthread_cond_wait(&s->cv, &s->mu);
      s->idle = false;
    }
    tdm__cmd *c = s->head;
    if (!c) break; /* stopped and drained */
    s->head = c->next;
    if (!s->head) s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    if (c->ev) {
      tdm__cpu_svc->cmd_run(c);
    } else {
      raw *r = (raw *)c;
      r->fn(r->arg);
      free(r);
    }
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

int tdm__cpu_stream_new(tdm_cpu_stream **out) {
  tdm_cpu_stream *s = calloc(1, sizeof *s);
  if (!s) return TDM_ENOMEM;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  if (pthread_create(&s->thread, NULL, worker, s)) {
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    return TDM_ENOMEM;
  }
  s->magic = STREAM_MAGIC;
  *out = s;
  return 0;
}

/* Runs what is queued, then joins the worker. */
void tdm__cpu_stream_free(tdm_cpu_stream *s) {
  pthread_mutex_lock(&s->mu);
  s->stop = true;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  s->magic = 0;
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

int tdm__cpu_stream_valid(const tdm_cpu_stream *s) { return s && s->magic == STREAM_MAGIC; }

int tdm__cpu_stream_push(tdm_cpu_stream *s, tdm__cmd *cmd) {
  pthread_mutex_lock(&s->mu);
  if (s->stop) {
    pthread_mutex_unlock(&s->mu);
    return TDM_ESTATE;
  }
  cmd->next = NULL;
  if (s->tail)
    s->tail->next = cmd;
  else
    s->head = cmd;
  s->tail = cmd;
  /* Woken after the lock is let go: a worker that shares this CPU then runs without first
   * blocking on the lock its waker still holds. The stream outlives this call (it is freed
   * only once its queue is destroyed, which waits for submissions in progress). */
  bool wake = s->idle;
  s->idle = false;
  pthread_mutex_unlock(&s->mu);
  if (wake) pthread_cond_signal(&s->cv);
  return 0;
}

/* ---- public interop (tandem/cpu.h) ---- */

int tdm_cpu_stream_create(tdm_cpu_stream **out) {
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_cpu_stream_create: out is NULL");
  int rc = tdm__cpu_stream_new(out);
  return rc ? tdm__error(rc, 0, "tdm_cpu_stream_create: cannot start the stream's worker") : 0;
}

int tdm_cpu_stream_destroy(tdm_cpu_stream *s) {
  if (!tdm__cpu_stream_valid(s))
    return tdm__error(TDM_EHANDLE, 0, "tdm_cpu_stream_destroy: %p is not a tdm_cpu_stream",
                      (void *)s);
  tdm__cpu_stream_free(s);
  return 0;
}

int tdm_cpu_stream_launch(tdm_cpu_stream *s, void (*fn)(void *), void *arg) {
  if (!tdm__cpu_stream_valid(s))
    return tdm__error(TDM_EHANDLE, 0, "tdm_cpu_stream_launch: %p is not a tdm_cpu_stream",
                      (void *)s);
  if (!fn) return tdm__error(TDM_EINVAL, 0, "tdm_cpu_stream_launch: fn is NULL");
  raw *r = calloc(1, sizeof *r);
  if (!r) return tdm__error(TDM_ENOMEM, 0, "tdm_cpu_stream_launch: no memory for the launch");
  r->fn = fn;
  r->arg = arg;
  int rc = tdm__cpu_stream_push(s, &r->cmd);
  if (rc) free(r);
  return rc ? tdm__error(rc, 0, "tdm_cpu_stream_launch: the stream is being destroyed") : 0;
}
