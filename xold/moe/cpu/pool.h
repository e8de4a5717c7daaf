/* cpu/pool.h: the CPU operations' fork-join pool, for splitting one expert's weight rows
 * between the host's cores (cpu/pool.c).
 *
 * A decode expert is one pass over 3HI bf16 weights (Qwen3-30B-A3B: 9.4 MB) with a dot product
 * per row: one thread reads them at a fraction of the memory's bandwidth, so the rows are
 * split into chunks that every core works on. Each row is still computed whole by one thread,
 * in the same order, so the bits do not depend on the split or on the thread count (as with
 * OpenBLAS's threaded sgemm, which splits M and N, never K).
 *
 * One pool serves the whole process, started by the first pool_acquire() and stopped by the
 * last pool_release() (each CPU op state holds one reference). Several callers may run jobs at
 * once (one per in-order queue): the pool's threads take chunks of whichever job has some left,
 * and each caller works on its own job too, so a job always progresses, even when every pool
 * thread is busy elsewhere or none could be started.
 *
 * Why not tandem's own CPU queues: a chunk is tens of microseconds of work and an expert has
 * two passes with a join between them, so a host task per chunk (a submission, an event and a
 * completion each) and a barrier per pass would cost a sizable share of the expert; the pool
 * hands out a chunk under one lock and its threads spin briefly between passes. It runs only
 * inside a CPU op's host task, so tandem's ordering of that task is unchanged. */
#ifndef TANDEM_MOE_CPU_POOL_H
#define TANDEM_MOE_CPU_POOL_H

#include <stddef.h>

/* fn(arg, chunk, worker) runs once for each chunk in [0, n); worker is in [0, pool_workers()):
 * 0 for the caller, so each worker can own a scratch slot of the job's. */
typedef void (*pool_fn)(void *arg, size_t chunk, int worker);

/* The pool's size by default, the caller included: TANDEM_MOE_CPU_THREADS if it is set to a
 * positive count, else the cores this process may run on (its affinity mask) less `reserve`,
 * at least 1. A reserve keeps cores for threads that must stay on one while the pool works:
 * one preempted with a chunk in hand holds up the whole job for a scheduler time slice
 * (milliseconds, where a job takes a fraction of one). */
int pool_default_size(int reserve);
/* A reference to the pool, starting it with `threads` (the caller included; at least 1) if
 * this is the first; a pool already running keeps its size. Threads that cannot be started
 * only make it smaller (with none, every job runs on its caller). Never fails. */
void pool_acquire(int threads);
/* Drops a reference; the last one stops and joins the threads. No job may be running. */
void pool_release(void);
/* The threads that may run a job's chunks, the caller included (at least 1). */
int pool_workers(void);
/* Runs the n chunks and returns when all are done. From a pool thread (nested): on the
 * caller alone. */
void pool_run(size_t n, pool_fn fn, void *arg);

#endif
