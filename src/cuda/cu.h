/* cu.h: private pieces shared by the CUDA backend's files. */
#ifndef TANDEM_CU_H
#define TANDEM_CU_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "lfstack.h"

#define CU_OOO_STREAMS 4 /* an out-of-order queue round-robins over this many streams */
#define CU_GATES 4096    /* gate slots per device */

/* A recycled native event. refs: one per holder (the tandem event; the core's wait, unless it
 * borrows the tandem event's: TDM__CMD_WAIT_BORROWED). */
typedef struct cu_event {
  struct cu_event *next; /* first: the free list's link (lfstack.h) */
  cudaEvent_t e;
  _Atomic int refs;
  int dev;
  bool timed;
  int stream;             /* index of the stream it was recorded on (out-of-order queues) */
  struct tdm__bqueue *bq; /* the queue that recorded it; NULL for an import */
  /* native_notify: what to call once the event completes. For an event of an out-of-order
   * queue, the queue's notifier calls it (note_link: the event's place in the notifier's FIFO,
   * then note_next in its stream's pending list). For an import (cuimport.c), the host function
   * that reports its completion or native_notify, whichever comes second, calls it
   * (note_state is their handshake). */
  bool imported;
  _Atomic int note_state;
  void (*note_fn)(void *);
  void *note_arg;
  tdm__workq_item note_link;
  struct cu_event *note_next;
} cu_event;

/* A gate: the stream waits until *host reaches target (cuStreamWaitValue32), or, without stream
 * memory operations, a host function blocks until the gate opens. */
typedef struct cu_gate {
  tdm__waiter w; /* first: a bridge for a dependency of another backend opens it */
  int dev;
  int slot;
  uint32_t target;
  bool open;     /* fallback path, under the device's gate lock */
} cu_gate;

typedef struct cu_device {
  int ordinal;
  char name[128];
  size_t memory;
  bool wait_value;         /* cuStreamWaitValue32 works on this device */
  cudaStream_t internal;   /* allocation, frees and staging: never gated */
  _Atomic(void *) ev_returned; /* event free list: a stack any thread pushes onto (lfstack.h) */
  pthread_mutex_t gate_mu; /* gate slots */
  pthread_cond_t gate_cv;  /* fallback host functions wait here */
  volatile uint32_t *gate_host;
  CUdeviceptr gate_dev;
  uint32_t gate_val[CU_GATES];
  int gate_free[CU_GATES];
  int ngate_free;
  cu_gate gates[CU_GATES];
  /* Imports (cuimport.c), under imp_mu: streams that each carry one pending import at a
   * time, up to CU_IMPORT_STREAMS of them, made on demand; events taken from the free list. */
  pthread_mutex_t imp_mu;
  struct cu_import_stream *imp;
  int nimp;
  int imp_next;
  cu_event *imp_local;
  pthread_mutex_t stage_mu; /* pageable copies: two pinned staging buffers */
  void *stage[2];
  cudaEvent_t stage_done[2];
} cu_device;

struct tdm__bqueue {
  int bdev;
  bool ooo, adopted, timed;
  int nstreams;
  cudaStream_t s[CU_OOO_STREAMS];
  unsigned rr; /* next stream (out-of-order) */
  cu_event *ev_local; /* taken from the device's free list; under the core's submission lock */
  /* Out-of-order queues: the notifier, one thread for all the queue's streams (cusubmit.c).
   * The pending lists and the back-off are its thread's alone. */
  tdm__workq notes;
  cu_event *pend_head[CU_OOO_STREAMS], *pend_tail[CU_OOO_STREAMS];
  int npend;
  unsigned backoff_us;
};

extern const tdm__services *cu_svc;
extern const tdm__backend tdm__cuda_backend;
extern cu_device *cu_devs;
extern int cu_ndevs;

/* Maps a CUDA error, sets the message; sticky errors mean the device is lost. */
int cu_error(cudaError_t err, const char *what);

/* Saves the caller's current device and makes dev current; cu_leave restores it (saved is -1
 * when dev was current already: nothing to restore). */
int cu_enter(int dev, int *saved);
void cu_leave(int saved);

/* With bq's submission lock held (every backend entry that records is called with it). */
cu_event *cu_event_get(struct tdm__bqueue *bq);
/* The same from a list of the caller's (guarded by the caller) refilled from dev's free list. */
cu_event *cu_event_take(cu_event **local, int dev, bool timed);
void cu_event_put(cu_event *ev);
cu_gate *cu_gate_get(int dev);
int cu_gate_enqueue(cu_gate *g, cudaStream_t s);
void cu_gate_open(cu_gate *g);

/* cumem.c */
int cu_mem_init(cu_device *d);
void cu_mem_fini(cu_device *d);
int cu_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm);
void cu_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm);
int cu_host_register(int bdev, void *ptr, size_t size);
void cu_host_unregister(int bdev, void *ptr);
int cu_mem_native(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                  size_t *offset);
int cu_mem_import(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm);
int cu_host_copy(tdm__cmd *cmd);

/* cuimport.c */
#define CU_IMPORT_STREAMS 1024 /* pending imports per device at most */
int cu_event_import(int bdev, void *native, void **handle);
/* native_notify for an imported event. */
int cu_import_notify(cu_event *ev, void (*fn)(void *), void *arg);
/* At shutdown: waits for the import streams and frees them. */
void cu_import_fini(cu_device *d);

/* cusubmit.c */
int cu_submit(tdm__bqueue *bq, tdm__cmd *cmd);
int cu_queue_wait_now(tdm__bqueue *bq, tdm__event *ev);
int cu_native_wait(void *handle, int *native);
void cu_native_release(void *handle);
int cu_native_done(void *handle);
int cu_native_flush(tdm__bqueue *bq, void **handle);
/* Joins the memcpy team, the threads that do the host side of staged copies (at shutdown). */
void cu_memcpy_team_stop(void);
int cu_native_notify(void *handle, void (*fn)(void *), void *arg);
void *cu_native_export(void *handle);
void cu_gate_open_entry(void *gate);
int cu_event_elapsed(void *a, void *b, double *ms);
/* Starts bq's notifier; TDM_ENOMEM (nothing left to stop) if it cannot. */
int cu_notifier_start(struct tdm__bqueue *bq);
void cu_notifier_stop(struct tdm__bqueue *bq);

#endif
