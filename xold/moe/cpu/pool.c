/* cpu/pool.c: the CPU operations' fork-join pool (see pool.h for what it is for).
 *
 * Everything a job shares lives under one mutex: chunks are large (tens of weight rows, some
 * hundreds of KB of weights), so a lock per chunk costs nothing next to the chunk, and one lock
 * keeps the bookkeeping obviously right. A job lives on its caller's stack; a pool thread
 * touches it only under the lock, and the caller returns only once every chunk is done, which
 * a thread reports (done++) under the lock as its last use of the job; a caller that saw the
 * count while spinning takes the lock before it returns, so that report is over.
 *
 * Jobs come in bursts (an expert is two jobs with a few microseconds between them, and a layer's
 * host experts follow each other), and waking a sleeping thread costs tens of microseconds
 * against a few hundred for a whole job. So a thread that finds nothing to do, and a caller
 * waiting for its last chunks, first spin for a while (spin_ns) on an atomic that mirrors what
 * they wait for, and only then sleep on the condition variable.
 *
 * Size: what the first pool_acquire() asks for (pool_default_size() for a CPU op state's),
 * at most POOL_MAX; the caller is one of them, so the pool starts one thread fewer. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include "pool.h"
#include "ops.h" /* moe/ops.h: tdm_moe__env_long */

#include <sched.h>

#include <pthread.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { POOL_MAX = 256 };
/* How long an idle thread, and a caller waiting for its last chunks, spin before sleeping:
 * TANDEM_MOE_CPU_SPIN_US microseconds (0: sleep at once), read when the pool starts;
 * SPIN_NS_DEFAULT otherwise. */
#define SPIN_NS_DEFAULT 50000L
#define SPIN_US_MAX 100000L
static long spin_ns = SPIN_NS_DEFAULT;

typedef struct job {
  pool_fn fn;
  void *arg;
  size_t n, next;     /* chunks: in all, handed out */
  atomic_size_t done; /* finished (written under mu; read without it while spinning) */
  struct job *link;   /* the pool's list of jobs with chunks left to hand out */
} job;

static struct {
  pthread_mutex_t life; /* held across pool_acquire() and pool_release(), joins included */
  pthread_mutex_t mu;
  pthread_cond_t work; /* a job was added, or stop */
  pthread_cond_t fin;  /* a job's last chunk finished */
  job *jobs;
  atomic_bool has_jobs; /* jobs != NULL, for spinning threads (written under mu) */
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
  if (first->next == first->n) {
    pool.jobs = first->link;
    atomic_store_explicit(&pool.has_jobs, pool.jobs != NULL, memory_order_relaxed);
  }
  return true;
}

/* Reports a chunk of j finished. With pool.mu held; j may be gone once it is released. */
static void finish(job *j) {
  size_t n = j->n, done = atomic_load_explicit(&j->done, memory_order_relaxed) + 1;
  atomic_store_explicit(&j->done, done, memory_order_release); /* j's caller may now return */
  if (done == n) pthread_cond_broadcast(&pool.fin);
}

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Spins for at most spin_ns until *flag holds (true) or *count reaches n; without the lock.
 * Says whether it did: either way the caller checks again under the lock. */
static bool spin_until(const atomic_bool *flag, const atomic_size_t *count, size_t n) {
  long end = now_ns() + spin_ns;
  for (unsigned i = 1;; i++) {
    if (flag ? atomic_load_explicit(flag, memory_order_relaxed)
             : atomic_load_explicit(count, memory_order_acquire) >= n)
      return true;
    cpu_relax();
    if (i % 64 == 0 && now_ns() > end) return false;
  }
}

static void *worker(void *arg) {
  self = (int)(intptr_t)arg;
  pthread_mutex_lock(&pool.mu);
  while (!pool.stop) {
    job *j;
    size_t c;
    if (!take(&j, &c)) {
      pthread_mutex_unlock(&pool.mu);
      bool found = spin_until(&pool.has_jobs, NULL, 0);
      pthread_mutex_lock(&pool.mu);
      if (!found && !pool.jobs && !pool.stop) pthread_cond_wait(&pool.work, &pool.mu);
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

int pool_default_size(int reserve) {
  long n = tdm_moe__env_long("TANDEM_MOE_CPU_THREADS", 1, LONG_MAX, 0); /* 0: the default */
  if (n == 0) {
    cpu_set_t set;
    n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                     : sysconf(_SC_NPROCESSORS_ONLN);
    n -= reserve > 0 ? reserve : 0;
  }
  return n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : (int)n;
}

/* TANDEM_MOE_CPU_SPIN_US if it is a count of microseconds up to SPIN_US_MAX, else the default. */
static long spin_default(void) {
  return tdm_moe__env_long("TANDEM_MOE_CPU_SPIN_US", 0, SPIN_US_MAX, SPIN_NS_DEFAULT / 1000) *
         1000L;
}

void pool_acquire(int threads) {
  pthread_mutex_lock(&pool.life);
  pthread_mutex_lock(&pool.mu);
  if (pool.users++ == 0) {
    pool.stop = false;
    spin_ns = spin_default();
    int want = (threads < 1 ? 1 : threads > POOL_MAX ? POOL_MAX : threads) - 1;
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
  atomic_init(&j.done, 0);
  job **tail = &pool.jobs;
  while (*tail) tail = &(*tail)->link;
  *tail = &j; /* behind the jobs already running: they finish first */
  atomic_store_explicit(&pool.has_jobs, true, memory_order_relaxed);
  pthread_cond_broadcast(&pool.work);
  /* The caller works on its own job only: another's chunks could keep it past its own end. */
  while (j.next < j.n) {
    size_t c = j.next++;
    if (j.next == j.n) { /* unlink: no thread may take from it any more */
      job **p = &pool.jobs;
      while (*p != &j) p = &(*p)->link;
      *p = j.link;
      atomic_store_explicit(&pool.has_jobs, pool.jobs != NULL, memory_order_relaxed);
    }
    pthread_mutex_unlock(&pool.mu);
    fn(arg, c, 0);
    pthread_mutex_lock(&pool.mu);
    finish(&j);
  }
  if (atomic_load_explicit(&j.done, memory_order_relaxed) < j.n) {
    pthread_mutex_unlock(&pool.mu);
    spin_until(NULL, &j.done, j.n);
    pthread_mutex_lock(&pool.mu);
  }
  while (atomic_load_explicit(&j.done, memory_order_relaxed) < j.n)
    pthread_cond_wait(&pool.fin, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
}
