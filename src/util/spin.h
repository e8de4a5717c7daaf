/* spin.h: the primitives of tandem's bounded busy-waits (a waiter that polls for a while
 * before it sleeps): a polite pause between polls and the monotonic clock that ends the
 * poll; and a lock for short, rarely contended sections. Header-only, so that the core and
 * the backend modules share them without the services table. */
#ifndef TANDEM_UTIL_SPIN_H
#define TANDEM_UTIL_SPIN_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

/* One polite busy-wait step: lets a sibling hyperthread run and saves power. */
static inline void tdm__relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* CLOCK_MONOTONIC in nanoseconds. */
static inline uint64_t tdm__clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A lock for short sections that rarely meet: taking it is one atomic exchange and releasing
 * it a plain store, where a pthread mutex pays an atomic on each side (a submission's lazy
 * list takes it at every record). A waiter polls politely, then yields its CPU to the
 * holder, which may have been preempted. Zero is unlocked. */
typedef struct tdm__spinlock {
  _Atomic int held;
} tdm__spinlock;

static inline void tdm__spin_lock(tdm__spinlock *l) {
  while (atomic_exchange_explicit(&l->held, 1, memory_order_acquire))
    for (int n = 0; atomic_load_explicit(&l->held, memory_order_relaxed); n++)
      if (n < 64)
        tdm__relax();
      else
        sched_yield();
}

static inline void tdm__spin_unlock(tdm__spinlock *l) {
  atomic_store_explicit(&l->held, 0, memory_order_release);
}

#endif
