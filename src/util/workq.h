/* workq.h: the one FIFO-and-worker primitive every tandem thread is made of: an intrusive FIFO
 * (each item embeds its link, so pushing never allocates) and the threads that drain it. The
 * core's thread pool and queue executors, the release thread, the CPU backend's streams and
 * the CUDA module's notifiers are all a tdm__workq with a run function.
 *
 * It is compiled into each binary that uses it (libtandem and the CUDA module list
 * src/util/workq.c among their sources) rather than offered through the services table: it
 * is a few dozen lines with no state outside the struct, a module calls it on its hot paths
 * (one indirect call less), and the backend ABI does not have to describe it.
 *
 * Contract:
 * - run(wq, item) is called on a serving thread (the one tdm__workq_start made, or any
 *   thread inside tdm__workq_serve), with no lock of the workq held, once per pushed item.
 *   With one serving thread, items run one at a time in push order; with several, they are
 *   taken in push order and may run concurrently. run may push onto the same workq.
 * - idle(wq), when set, is called on a serving thread, with no lock held, each time it finds
 *   the FIFO empty, before it sleeps or (once stopped) exits; it returns true if it did work,
 *   and the thread then looks at the FIFO again. A thread never sleeps while items are queued
 *   unless the pushers chose not to wake it (below).
 * - Wake-ups: a push wakes one sleeping server if the pusher asks for it, or once
 *   TDM__WORKQ_BATCH items came without a wake-up since a server last went to sleep; the
 *   others sleep on. tdm__workq_kick wakes a server if items are queued. A wake-up is a
 *   condition signal made after the lock is let go (a woken thread sharing the CPU does not
 *   block on its waker's lock at once) and only when a server sleeps: no lost wake-up (the
 *   sleeper count is read under the lock it sleeps on) and no needless signal. A server that
 *   finds nothing to do polls for spin_ns (0 unless its owner sets it before the start) before
 *   it sleeps, so work that comes in bursts (a host queue's tasks, a few hundred microseconds
 *   apart) is not held up by a wake-up each time; an idle function that returns true keeps its
 *   thread awake too (the CUDA notifier polls events that way).
 * - Stop: tdm__workq_stop (or _close, for threads the caller started) lets the servers run
 *   every item already pushed, and any pushed while they drain, and leaves once the FIFO is
 *   empty and every item announced with tdm__workq_expect has come and run.
 * - Lifetime: a push may come from a thread the workq does not know (a driver's callback), and
 *   its wake-up may still be in progress when the item has already run; tdm__workq_fini waits
 *   for wake-ups in progress before destroying the lock. */
#ifndef TANDEM_UTIL_WORKQ_H
#define TANDEM_UTIL_WORKQ_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

/* At most this many items wait for a sleeping server without waking it, so what they hold
 * is returned promptly. */
#define TDM__WORKQ_BATCH 64

/* The link an item embeds; the run function gets it back (TDM__CONTAINER_OF finds the item). */
typedef struct tdm__workq_item {
  struct tdm__workq_item *next;
} tdm__workq_item;

#define TDM__CONTAINER_OF(ptr, type, member) \
  ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

typedef struct tdm__workq tdm__workq;
typedef void (*tdm__workq_run_fn)(tdm__workq *wq, tdm__workq_item *item);
typedef bool (*tdm__workq_idle_fn)(tdm__workq *wq);

struct tdm__workq {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  tdm__workq_item *head, *tail; /* under mu */
  bool stop;                    /* under mu */
  int sleepers;                 /* servers waiting on cv, under mu */
  unsigned unsignaled;          /* pushed without a wake-up since a server went to sleep */
  long expected;                /* announced items not yet run (tdm__workq_expect), under mu */
  _Atomic long signaling;       /* wake-ups in progress (see Lifetime) */
  tdm__workq_run_fn run;
  tdm__workq_idle_fn idle;      /* optional */
  void *ctx;                    /* the owner's, for run and idle */
  bool running;                 /* tdm__workq_start's thread is up; the owner's to read */
  long spin_ns;                 /* an idle server polls this long before it sleeps */
  atomic_bool queued;           /* head != NULL, for polling servers (written under mu) */
  pthread_t thread;
};

/* Makes the lock and condition (once per struct life); the FIFO starts empty and stopped is
 * false. Returns 0 or an errno code. */
int tdm__workq_init(tdm__workq *wq, tdm__workq_run_fn run, tdm__workq_idle_fn idle, void *ctx);
/* Waits for wake-ups in progress, then destroys the lock and condition. No server may be left. */
void tdm__workq_fini(tdm__workq *wq);
/* Empties the FIFO and clears the stop flag (a workq reused after a stop), then starts one
 * serving thread. Returns 0 or an errno code (nothing started). */
int tdm__workq_start(tdm__workq *wq);
/* Stops (see the contract) and joins tdm__workq_start's thread, if it runs. */
void tdm__workq_stop(tdm__workq *wq);
/* Sets the stop flag and wakes every server: for owners that started their own servers. */
void tdm__workq_close(tdm__workq *wq);
/* Serves the workq on the calling thread until it is stopped and drained. */
void tdm__workq_serve(tdm__workq *wq);
/* Appends item; wakes a sleeping server if wake (see the contract). Never fails. */
void tdm__workq_push(tdm__workq *wq, tdm__workq_item *item, bool wake);
/* The same, unless the workq is stopped: then returns false and pushes nothing. */
bool tdm__workq_try_push(tdm__workq *wq, tdm__workq_item *item, bool wake);
/* Wakes a sleeping server if items are queued. */
void tdm__workq_kick(tdm__workq *wq);
/* Whether the FIFO is empty now. */
bool tdm__workq_empty(tdm__workq *wq);
/* Announces n items that will be pushed later (n > 0), or that n of them ran (n < 0): a stop
 * waits for them. */
void tdm__workq_expect(tdm__workq *wq, long n);
/* Items announced and not yet run. */
long tdm__workq_expected(tdm__workq *wq);

#endif /* TANDEM_UTIL_WORKQ_H */
