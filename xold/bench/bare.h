/* bare.h: the baseline every runtime benchmark is measured against: the least a runtime could
 * do with pthreads alone. A bare queue is a worker thread consuming a mutex/condvar FIFO of
 * caller-owned nodes; a bare event is a flag under a mutex with a condvar to sleep on. Neither
 * side spins, as tandem does not. Nodes are preallocated by the caller, so the baseline does no
 * allocation at all: it is the floor, not a rival design.
 */
#ifndef TANDEM_BENCH_BARE_H
#define TANDEM_BENCH_BARE_H

#include <pthread.h>

typedef struct bare_node {
  struct bare_node *next;
  void (*fn)(void *arg); /* runs on the worker */
  void *arg;
} bare_node;

typedef struct bare_queue {
  pthread_mutex_t mu;
  pthread_cond_t nonempty;
  bare_node *head, *tail;
  int stop;
  pthread_t worker;
} bare_queue;

typedef struct bare_event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
} bare_event;

/* Starts the worker; 0 or an errno value. */
int bare_queue_start(bare_queue *q);
/* Runs what is queued, then joins the worker. */
void bare_queue_stop(bare_queue *q);
/* Appends n (which must stay valid until its fn has started) and wakes the worker. */
void bare_queue_push(bare_queue *q, bare_node *n);

void bare_event_init(bare_event *e);
void bare_event_destroy(bare_event *e);
/* Marks e done and wakes its waiters. Takes a bare_event * as void * to serve as a node fn. */
void bare_event_set(void *e);
/* Sleeps until e is done. */
void bare_event_wait(bare_event *e);
/* Sleeps until e is done, then makes it pending again for the next round. */
void bare_event_wait_reset(bare_event *e);

#endif /* TANDEM_BENCH_BARE_H */
