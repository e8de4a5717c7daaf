/* cpu/pool.c: the CPU operations' fork-join pool (see pool.h for what it is for).
 *
 * Everything a job shares lives under one mutex: chunks are large (tens of weight rows, some
 * hundreds of KB of weights), so a lock per chunk costs nothing next to the chunk, and one lock
 * keeps the bookkeeping obviously right. A job lives on its caller's stack; a pool thread
 * touches it only under the lock, and the caller unlinks it only once every chunk is done, which
 * a thread reports (done++) under the lock after its last use of the job.
 *
 * Size: TANDEM_MOE_CPU_THREADS if set to a positive count, else the cores online, at most
 * POOL_MAX; the caller is one of them, so the pool starts one thread fewer. */
#include "pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

enum { POOL_MAX = 256 };

typedef struct job {
  pool_fn fn;
  void *arg;
  size_t n, next, done; /* chunks: in all, handed out, finished */
  struct job *link;     /* the pool's list of jobs with chunks left to hand out */
} job;

static struct {
  pthread_mutex_t life; /* held across pool_acquire() and pool_release(), joins included */
  pthread_mutex_t mu;
  pthread_cond_t work; /* a job was added, or stop */
  pthread_cond_t fin;  /* a job's last chunk finished */
  job *jobs;
  pthread_t th[POOL_MAX];
  int nth; /* threads started */
  int users;
  bool stop;
} pool = {.life = PTHREAD_MUTEX_INITIALIZER,
          .mu = PTHREAD_MUTEX_INITIALIZER,
          .work = PTHREAD_COND_INITIALIZER,
          .fin = PTHREAD_COND_INITIALIZER};

/* Which worker this thread is (0: not a pool thread). */
static _Thread_local int self;

/* Takes a chunk of the first job that has one, unlinking a job once its last is handed out.
 * With pool.mu held. */
static bool take(job **j, size_t *chunk) {
  job *first = pool.jobs;
  if (!first) return false;
  *j = first;
  *chunk = first->next++;
  if (first->next == first->n) pool.jobs = first->link;
  return true;
}

/* Reports a chunk of j finished. With pool.mu held; j may be gone once it is released. */
static void finish(job *j) {
  if (++j->done == j->n) pthread_cond_broadcast(&pool.fin);
}

static void *worker(void *arg) {
  self = (int)(intptr_t)arg;
  pthread_mutex_lock(&pool.mu);
  while (!pool.stop) {
    job *j;
    size_t c;
    if (!take(&j, &c)) {
      pthread_cond_wait(&pool.work, &pool.mu);
      continue;
    }
    pthread_mutex_unlock(&pool.mu);
    j->fn(j->arg, c, self);
    pthread_mutex_lock(&pool.mu);
    finish(j);
  }
  pthread_mutex_unlock(&pool.mu);
  return NULL;
}

static int configured_size(void) {
  const char *env = getenv("TANDEM_MOE_CPU_THREADS");
  long n = 0;
  if (env && *env) {
    char *end;
    n = strtol(env, &end, 10);
    if (*end || n < 1) n = 0; /* not a positive count: the default */
  }
  if (n == 0) n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : (int)n;
}

void pool_acquire(void) {
  pthread_mutex_lock(&pool.life);
  pthread_mutex_lock(&pool.mu);
  if (pool.users++ == 0) {
    pool.stop = false;
    int want = configured_size() - 1;
    for (pool.nth = 0; pool.nth < want; pool.nth++)
      if (pthread_create(&pool.th[pool.nth], NULL, worker, (void *)(intptr_t)(pool.nth + 1)))
        break; /* a smaller pool */
  }
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&pool.life);
}

void pool_release(void) {
  pthread_mutex_lock(&pool.life);
  pthread_mutex_lock(&pool.mu);
  int n = 0;
  if (pool.users > 0 && --pool.users == 0) {
    pool.stop = true;
    pthread_cond_broadcast(&pool.work);
    n = pool.nth;
  }
  pthread_mutex_unlock(&pool.mu);
  /* Joined outside mu, which the threads need to see stop, and inside life, so that a
   * pool_acquire() meanwhile waits rather than start threads into pool.th. */
  for (int i = 0; i < n; i++) pthread_join(pool.th[i], NULL);
  if (n) {
    pthread_mutex_lock(&pool.mu);
    pool.nth = 0;
    pthread_mutex_unlock(&pool.mu);
  }
  pthread_mutex_unlock(&pool.life);
}

int pool_workers(void) {
  pthread_mutex_lock(&pool.mu);
  int n = pool.nth + 1;
  pthread_mutex_unlock(&pool.mu);
  return n;
}

void pool_run(size_t n, pool_fn fn, void *arg) {
  if (n == 0) return;
  pthread_mutex_lock(&pool.mu);
  if (self || pool.nth == 0 || n == 1) {
    pthread_mutex_unlock(&pool.mu);
    for (size_t c = 0; c < n; c++) fn(arg, c, self);
    return;
  }
  job j = {.fn = fn, .arg = arg, .n = n};
  job **tail = &pool.jobs;
  while (*tail) tail = &(*tail)->link;
  *tail = &j; /* behind the jobs already running: they finish first */
  pthread_cond_broadcast(&pool.work);
  /* The caller works on its own job only: another's chunks could keep it past its own end. */
  while (j.next < j.n) {
    size_t c = j.next++;
    if (j.next == j.n) { /* unlink: no thread may take from it any more */
      job **p = &pool.jobs;
      while (*p != &j) p = &(*p)->link;
      *p = j.link;
    }
    pthread_mutex_unlock(&pool.mu);
    fn(arg, c, 0);
    pthread_mutex_lock(&pool.mu);
    finish(&j);
  }
  while (j.done < j.n) pthread_cond_wait(&pool.fin, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
}
