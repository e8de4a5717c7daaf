/* ocl.h: private pieces shared by the OpenCL backend's files. */
#ifndef TANDEM_OCL_H
#define TANDEM_OCL_H

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "backend.h"

typedef struct ocl_device {
  cl_platform_id platform;
  cl_device_id id;
  cl_context ctx;
  cl_command_queue internal; /* for mapping pinned buffers */
  char name[128];
  cl_ulong memory;
  bool ooo;
  bool defer; /* user events hang on this driver: gate on the host instead */
  bool gpu;   /* CL_DEVICE_TYPE_GPU or _ACCELERATOR */
} ocl_device;

/* One command of an out-of-order queue on the native queue: given back when its event
 * completes (clsubmit.c, "depth of out-of-order queues"). */
typedef struct ocl_slot {
  tdm__waiter w; /* first */
  tdm__bqueue *bq;
  struct ocl_slot *next_free;
} ocl_slot;

/* How many commands an out-of-order queue has on the native queue at most. With PoCL a burst
 * of 8000 records takes 0.2 s at 32 and 15 s at 128 (each marker costs the depth squared). */
#define OCL_OOO_DEPTH 32

struct tdm__bqueue {
  cl_command_queue q;
  int bdev;
  bool ooo;
  /* Host-side deferral, for drivers whose user events hang (PoCL's basic driver): a host task
   * or a dependency without a native event holds the queue, and later commands wait in
   * `held` until the blocker is released. Guarded by mu. */
  bool defer;
  pthread_mutex_t mu;
  tdm__cmd *blocker;
  /* Commands accepted but not yet submitted, in order: behind the blocker (deferral, in-order
   * queues), or waiting for a slot (out-of-order queues). Guarded by mu. */
  tdm__cmd *held_head, *held_tail;
  _Atomic int resumes; /* resume() and slot_done() calls due or running; freed only at 0 */
  /* Out-of-order queues: OCL_OOO_DEPTH slots, the free ones on a stack that any thread pushes
   * onto and only a holder of mu pops; nheld counts `held`; drain asks a holder of mu to
   * submit held commands. */
  ocl_slot *slots;
  _Atomic(ocl_slot *) free_slots;
  atomic_int nheld;
  atomic_bool drain;
};

extern const tdm__services *ocl_svc;
extern const tdm__backend tdm__opencl_backend;
extern ocl_device *ocl_devs;
extern int ocl_ndevs;

/* Maps an OpenCL error to a tandem code and sets the message. */
int ocl_error(cl_int err, const char *what);

/* clmem.c: tandem pointers <-> (cl_mem, offset); the cl_mem lives in the core's registry. */
int ocl_mem_init(void);
void ocl_mem_fini(void);
/* The reserved range device buffers take their addresses from. */
int ocl_mem_range(int bdev, uintptr_t *base, size_t *size);
int ocl_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm);
void ocl_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm);
int ocl_mem_native(int bdev, void *base, void *ptr, const tdm__bmem *bm, void **native,
                   size_t *offset);
int ocl_mem_import(int bdev, void *native, size_t size, void **ptr, tdm__bmem *bm);

/* clsubmit.c */
int ocl_submit(tdm__bqueue *bq, tdm__cmd *cmd);
int ocl_native_wait(void *handle, int *native);
int ocl_native_flush(tdm__bqueue *bq, void **handle);
int ocl_queue_wait_now(tdm__bqueue *bq, tdm__event *ev);
void ocl_native_release(void *handle);
int ocl_event_import(int bdev, void *native, void **handle);
int ocl_native_notify(void *handle, void (*fn)(void *), void *arg);
/* At shutdown: joins the thread that watches for failed events, then (once every context is
 * released) frees what it kept. */
void ocl_notices_stop(void);
void ocl_notices_free(void);
void ocl_gate_open(void *gate);

#endif
