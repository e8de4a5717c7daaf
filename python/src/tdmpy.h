/* tdmpy.h: what the files of the extension module tandem._tandem share: the per-module state,
 * the object layouts of its heap types, and the helpers one file defines for the others.
 *
 * The module is written against tandem's public header only. Every Python object that holds a
 * tandem handle owns exactly what its comment says; every PyObject * field is an owned
 * reference unless marked borrowed.
 */
#ifndef TDMPY_H
#define TDMPY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <tandem.h>

/* Errors TDM_EINVAL (-1) ... TDM_ESTATE (-19): one exception class per code. */
#define TDMPY_NERRORS 20

typedef struct {
  PyTypeObject *device_type; /* owned: the heap types */
  PyTypeObject *queue_type;
  PyTypeObject *event_type;
  PyTypeObject *buffer_type;
  PyTypeObject *streamer_type;
  PyTypeObject *moeops_type;
  PyObject *error;                      /* tandem.TandemError */
  PyObject *errors[TDMPY_NERRORS + 1];  /* [-code]: its subclass; [0] unused */
  PyObject *devices;    /* tuple of Device, by tandem's device index */
  PyObject *defaults;   /* dict: device index -> Queue wrapping the cached default queue */
  PyObject *installed;  /* dict: device index -> Queue installed by set_default_queue */
  PyObject *tls_key;    /* key of this module's stack in each thread's state dict */
  PyObject *imports;    /* dict: (address, size) -> [tandem pointer, uses] of imported memory */
  PyObject *dpctl_devices; /* dict: device index -> dpctl.SyclDevice of a SYCL device */
  int live;             /* 1 between tdm_init and the module's own tdm_shutdown */
} tdmpy_state;

/* Set once the module has shut tandem down at interpreter exit (or the module is freed): a
 * tandem thread that would still run Python code then leaks its references instead. This is
 * process-wide on purpose: tandem's threads reach it without the GIL or a module. */
extern atomic_int tdmpy_python_gone;

typedef struct {
  PyObject_HEAD
  tdm_device *dev; /* tandem's; valid until the last tdm_shutdown */
  tdm_device_info info;
} DeviceObject;

typedef struct {
  PyObject_HEAD
  tdm_queue *q;          /* NULL once destroyed */
  PyObject *device;      /* Device */
  unsigned flags;        /* TDM_QUEUE_* */
  int owned;             /* 1: created or adopted here, destroyed with the object */
  const char *owner;     /* owned == 0: whose queue it is, in words ("tandem's default") */
  Py_ssize_t users;      /* Streamers computing on it: destroy() is refused while any are */
  PyObject *adopted;     /* the foreign queue object kept alive while adopted, or NULL */
  PyObject *errors;      /* list: the first unreported exception of a host task, as one
                            (exception, traceback at the failure) tuple, or empty; shared with
                            the tasks and their Events; synchronize() re-raises and empties it */
  PyObject *weakreflist;
} QueueObject;

typedef struct {
  PyObject_HEAD
  tdm_event *ev;     /* one caller reference, released in dealloc */
  PyObject *cell;    /* list: [exception] once a host task raised, shared with it until it
                        has run; or NULL */
  PyObject *errors;  /* a host task's: its queue's error list (QueueObject.errors); or NULL */
  PyObject *foreign; /* the foreign event this one was imported from, or NULL */
} EventObject;

typedef struct {
  PyObject_HEAD
  void *ptr;          /* NULL once freed */
  size_t nbytes;
  tdm_mem_kind kind;
  PyObject *device;   /* Device */
  PyObject *queue;    /* Queue whose work produces the contents (CAI stream, DLPack sync) */
  Py_ssize_t exports; /* live buffer-protocol views and DLPack capsules */
  Py_ssize_t inflight;/* copies and fills on other queues pending on it (their holds) */
  int released;       /* free() was called: the memory goes once inflight drops to 0 */
  PyObject *owner;    /* whose memory it is when not tandem.malloc's (a Streamer, for a view
                         of a slot): never freed here, and unusable once released */
} BufferObject;

/* getattr that tells "absent" (0) from an error (-1); 1 and a new reference when present. */
static inline int tdmpy_getattr_opt(PyObject *obj, const char *name, PyObject **out) {
  *out = PyObject_GetAttrString(obj, name);
  if (*out) return 1;
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
  PyErr_Clear();
  return 0;
}

/* module.c */
tdmpy_state *tdmpy_state_of_type(PyTypeObject *tp);
/* Raises the exception class of rc with tdm_last_error(); returns NULL. Call it right after
 * the failing tandem call, on the same thread. */
PyObject *tdmpy_raise(tdmpy_state *st, int rc);
/* The same with a message saved earlier (tandem was called since the failing call). */
PyObject *tdmpy_raise_msg(tdmpy_state *st, int rc, const char *msg);
int tdmpy_check_live(tdmpy_state *st);
/* `with q:`: this thread's current-queue stack (tandem's and the module's). */
int tdmpy_push_current(tdmpy_state *st, QueueObject *q);
int tdmpy_pop_current(tdmpy_state *st, QueueObject *q);
/* Forgets q if set_default_queue installed it (q is being destroyed). */
int tdmpy_uninstall(tdmpy_state *st, PyObject *q);
/* Borrowed: the Device object of a tandem device. */
PyObject *tdmpy_device_object(tdmpy_state *st, tdm_device *dev);
/* Borrowed on success: the Device for None (the default device), a Device or an id string. */
PyObject *tdmpy_device_arg(tdmpy_state *st, PyObject *arg);
/* New reference: this thread's current queue for dev (NULL: any device), else the device's
 * default queue. */
PyObject *tdmpy_current_queue(tdmpy_state *st, PyObject *device);

/* device.c */
extern PyType_Spec tdmpy_device_spec;

/* queue.c */
extern PyType_Spec tdmpy_queue_spec;
PyObject *tdmpy_queue_wrap(tdmpy_state *st, tdm_queue *q, PyObject *device, unsigned flags,
                           int owned, PyObject *adopted);
int tdmpy_queue_check(tdmpy_state *st, PyObject *obj, tdm_queue **out);
/* The Event of a failed host task is going, and with it the last way to see exc but through
 * its queue: if exc is the queue's first unreported error (in errors), the queue keeps it
 * with the traceback it had when the task failed, its frames cleared. */
void tdmpy_task_error_unheld(PyObject *errors, PyObject *exc);

/* event.c */
extern PyType_Spec tdmpy_event_spec;
/* Steals ev's reference; cell may be NULL. */
PyObject *tdmpy_event_new(tdmpy_state *st, tdm_event *ev, PyObject *cell, PyObject *foreign);
/* *out: a tandem event for an Event or a foreign event (CuPy, PyTorch, pyopencl); *owned: 1 if
 * the caller must release it (an import). dev: the device a foreign CUDA event belongs to. */
int tdmpy_event_arg(tdmpy_state *st, PyObject *obj, tdm_device *dev, tdm_event **out,
                    int *owned);
/* Dependency lists: an iterable of events converted into a malloc'd array (NULL when empty);
 * tdmpy_deps_free releases the imported ones. */
typedef struct {
  size_t n;
  tdm_event **ev;
  unsigned char *owned;
} tdmpy_deps;
int tdmpy_deps_get(tdmpy_state *st, PyObject *seq, tdm_device *dev, tdmpy_deps *d);
void tdmpy_deps_free(tdmpy_deps *d);

/* buffer.c */
extern PyType_Spec tdmpy_buffer_spec;
PyObject *tdmpy_malloc(tdmpy_state *st, PyObject *args, PyObject *kwargs);
/* Gives a buffer's memory back after its queue's pending work (tdm_free_async); the GIL is
 * held and released inside. A view of another object's memory only forgets it. */
void tdmpy_buffer_free_memory(tdmpy_state *st, BufferObject *self);
/* A new Buffer viewing nbytes at ptr of owner's device memory (kind "device"), its users
 * ordered by queue; the owner ends it with tdmpy_buffer_end_view. */
PyObject *tdmpy_buffer_view(tdmpy_state *st, PyObject *owner, void *ptr, size_t nbytes,
                            PyObject *device, PyObject *queue);
void tdmpy_buffer_end_view(BufferObject *view);
/* Why a buffer cannot be used any more, in words. */
static inline const char *tdmpy_buffer_gone(BufferObject *b) {
  return b->owner ? "the slot view is no longer valid: its expert was released or the "
                    "streamer closed"
                  : "the buffer was freed";
}

/* streamer.c */
extern PyType_Spec tdmpy_streamer_spec;

/* moeops.c */
extern PyType_Spec tdmpy_moeops_spec;

/* operand.c: what a copy or fill can take, resolved to a pointer, and kept alive */
typedef struct tdmpy_hold tdmpy_hold;
typedef struct {
  void *ptr;
  size_t nbytes;
} tdmpy_span;
/* A new hold: the references a submission keeps until the work is done. */
tdmpy_hold *tdmpy_hold_new(void);
/* Resolves obj (Buffer, numpy array or other buffer-protocol object, __cuda_array_interface__,
 * DLPack) on queue self into a span, recording in h what must stay alive. */
int tdmpy_operand(tdmpy_state *st, QueueObject *self, PyObject *obj, int writable,
                  tdmpy_hold *h, tdmpy_span *out);
/* Adds an object reference to h. */
int tdmpy_hold_add(tdmpy_hold *h, PyObject *obj);
/* Hands h to tdm_keep_alive on q (after what was submitted); on failure releases it now. */
int tdmpy_hold_submit(tdmpy_state *st, tdm_queue *q, tdmpy_hold *h);
/* Releases h at once (with the GIL held): nothing was submitted. */
void tdmpy_hold_drop(tdmpy_hold *h);

/* cudaorder.c: stream ordering with CUDA streams tandem does not own (the producer stream of
 * a __cuda_array_interface__, the consumer stream of __dlpack__), through the CUDA driver that
 * the process has already loaded. consumer waits on the device for producer's work so far;
 * consumer NULL: the calling thread waits (without the GIL). Streams 1 and 2 are the legacy
 * and per-thread default streams. -1 with an error set on failure. */
int tdmpy_cuda_order(tdmpy_state *st, int ordinal, void *producer, void *consumer);

/* buffer.c: waits on the host for the buffer's queue's work so far; -1 with an error set. */
int tdmpy_buffer_sync(tdmpy_state *st, BufferObject *self);

/* sycl.c: dpctl and dpnp on SYCL devices (tandem/sycl.h says what the native handles are).
 * dpctl is imported only where one of its objects is met or asked for. */
int tdmpy_is_sycl(PyObject *device);
/* New references: a dpctl.SyclQueue over q's native sycl::queue (a copy of the handle, so the
 * same queue), a dpctl.SyclEvent over ev's native sycl::event. */
PyObject *tdmpy_dpctl_queue(tdmpy_state *st, QueueObject *q);
PyObject *tdmpy_dpctl_event(tdmpy_state *st, tdm_event *ev);
/* New reference: dpctl.<cls>(a capsule named capname over ptr), which copies the handle ptr
 * points to (borrowed: it need only be valid during the call). */
PyObject *tdmpy_dpctl_new(const char *cls, const char *capname, void *ptr);
/* Borrowed: the dpctl.SyclDevice of a SYCL device (cached in the state). */
PyObject *tdmpy_dpctl_device(tdmpy_state *st, PyObject *device);
/* The device's id in DLPack's kDLOneAPI numbering (its index among the SYCL runtime's
 * devices, as dpctl numbers them). */
int tdmpy_sycl_device_id(tdmpy_state *st, PyObject *device, int *id);
/* dpctl's capsule protocol: obj itself if it is a capsule named name, else what
 * obj._get_capsule() returns if it is one. 1 with *cap (new reference; it owns the C++ object
 * *ptr points to) when found, 0 when obj has none (no error set), -1 on error. */
int tdmpy_dpctl_capsule(PyObject *obj, const char *name, PyObject **cap, void **ptr);
/* Later work of q waits, on the device, for the work so far of producer (a dpctl.SyclQueue):
 * a barrier on producer and one on q's native queue that waits for it, as dpctl's own
 * __dlpack__(stream=) does. Nothing when producer is q's native queue. */
int tdmpy_sycl_order(tdmpy_state *st, QueueObject *q, PyObject *producer);
/* __dlpack__(stream=) of a SYCL buffer: None: the host waits for the buffer's queue; -1:
 * nothing; a dpctl.SyclQueue: it waits on the device for the buffer's queue's work so far. */
int tdmpy_sycl_order_consumer(tdmpy_state *st, BufferObject *b, PyObject *stream);
/* Borrowed: a SYCL device to import a foreign sycl::event on: dev's when it is one, else the
 * first (tandem does not know the event's context either way, tandem/sycl.h). */
PyObject *tdmpy_sycl_import_device(tdmpy_state *st, tdm_device *dev);
/* Buffer.__sycl_usm_array_interface__ (USM of a SYCL device). */
PyObject *tdmpy_buffer_suai(BufferObject *self, void *closure);

/* dlpack.c */
PyObject *tdmpy_buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kwargs);
PyObject *tdmpy_buffer_dlpack_device(BufferObject *self, PyObject *unused);

#endif /* TDMPY_H */
