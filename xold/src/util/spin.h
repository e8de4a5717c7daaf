/* spin.h: the two primitives of tandem's bounded busy-waits (a waiter that polls for a while
 * before it sleeps): a polite pause between polls and the monotonic clock that ends the
 * poll. Header-only, so that the core and the backend modules share them without the
 * services table. */
#ifndef TANDEM_UTIL_SPIN_H
#define TANDEM_UTIL_SPIN_H

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

#endif
