/* buffer.c: tandem.Buffer, memory from tandem.malloc: the buffer protocol on host-accessible
 * memory (host, pinned, and device memory of devices whose memory is host memory),
 * __cuda_array_interface__ (version 3) on CUDA device memory, and on SYCL devices
 * __sycl_usm_array_interface__ (sycl.c) on USM (device and pinned). DLPack is in dlpack.c.
 *
 * Freeing: free() refuses while views or DLPack capsules are alive. The memory is given back
 * with tdm_free_async on the buffer's queue, so work on that queue (copies and fills there take
 * no hold) finishes first; work on other queues holds the buffer (counted in `inflight`) and
 * the memory goes when the last of it is done. Collecting the object frees it too.
 */
#include "tdmpy.h"

#include <string.h>

static const struct {
  const char *name;
  tdm_mem_kind kind;
} kinds[] = {{"device", TDM_MEM_DEVICE}, {"pinned", TDM_MEM_PINNED}, {"host", TDM_MEM_HOST}};

static const char *kind_name(tdm_mem_kind k) {
  for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++)
    if (kinds[i].kind == k) return kinds[i].name;
  return "?";
}

PyObject *tdmpy_malloc(tdmpy_state *st, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"nbytes", "kind", "device", "queue", NULL};
  Py_ssize_t nbytes;
  const char *kname = "device";
  PyObject *device = Py_None, *queue = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "n|sOO:malloc", kwlist, &nbytes, &kname, &device,
                                   &queue))
    return NULL;
  if (tdmpy_check_live(st) < 0) return NULL;
  if (nbytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "malloc: nbytes must be positive");
    return NULL;
  }
  tdm_mem_kind kind = 0;
  for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++)
    if (strcmp(kname, kinds[i].name) == 0) kind = kinds[i].kind;
  if (!kind) {
    PyErr_Format(PyExc_ValueError, "malloc: kind must be 'device', 'pinned' or 'host', not %R",
                 PyTuple_GET_SIZE(args) > 1 ? PyTuple_GET_ITEM(args, 1) : Py_None);
    return NULL;
  }
  tdm_queue *tq;
  if (queue != Py_None) {
    if (tdmpy_queue_check(st, queue, &tq) < 0) return NULL;
    if (device == Py_None) device = ((QueueObject *)queue)->device;
  }
  if (!(device = tdmpy_device_arg(st, device))) return NULL;
  if (queue == Py_None) {
    if (!(queue = tdmpy_current_queue(st, device))) return NULL;
  } else {
    Py_INCREF(queue);
  }
  if (((QueueObject *)queue)->device != device) {
    Py_DECREF(queue);
    PyErr_SetString(st->errors[-TDM_EXDEV], "malloc: the queue is of another device");
    return NULL;
  }
  void *ptr;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_malloc(((DeviceObject *)device)->dev, kind, (size_t)nbytes, &ptr);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    Py_DECREF(queue);
    return tdmpy_raise(st, rc);
  }
  BufferObject *b = PyObject_GC_New(BufferObject, st->buffer_type);
  if (!b) {
    Py_DECREF(queue);
    tdm_free(ptr);
    return NULL;
  }
  b->ptr = ptr;
  b->nbytes = (size_t)nbytes;
  b->kind = kind;
  b->device = Py_NewRef(device);
  b->queue = queue; /* the reference taken above */
  b->exports = b->inflight = 0;
  b->released = 0;
  b->owner = NULL;
  PyObject_GC_Track(b);
  return (PyObject *)b;
}

PyObject *tdmpy_buffer_view(tdmpy_state *st, PyObject *owner, void *ptr, size_t nbytes,
                            PyObject *device, PyObject *queue) {
  BufferObject *b = PyObject_GC_New(BufferObject, st->buffer_type);
  if (!b) return NULL;
  b->ptr = ptr;
  b->nbytes = nbytes;
  b->kind = TDM_MEM_DEVICE;
  b->device = Py_NewRef(device);
  b->queue = Py_NewRef(queue);
  b->exports = b->inflight = 0;
  b->released = 0;
  b->owner = Py_NewRef(owner);
  PyObject_GC_Track(b);
  return (PyObject *)b;
}

/* Copies already submitted with the view keep the pointer they were given; nothing new
 * can start from it. */
void tdmpy_buffer_end_view(BufferObject *view) {
  view->ptr = NULL;
  view->released = 1;
}

static PyObject *buffer_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  PyErr_SetString(PyExc_TypeError, "buffers come from tandem.malloc()");
  return NULL;
}

static int buffer_traverse(BufferObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->device);
  Py_VISIT(self->queue);
  Py_VISIT(self->owner);
  return 0;
}

/* Gives the memory back, ordered after the work of the buffer's queue: copies and fills on
 * that queue take no hold (queue.c), so its pending work may still use the memory. At once
 * when the queue is gone (destroying it drained it) or cannot take the free (its device is
 * lost, and its work with it). */
void tdmpy_buffer_free_memory(tdmpy_state *st, BufferObject *self) {
  void *p = self->ptr;
  self->ptr = NULL;
  if (!p || !st->live || self->owner) return;
  QueueObject *q = (QueueObject *)self->queue;
  tdm_queue *tq = q ? q->q : NULL;
  Py_BEGIN_ALLOW_THREADS
  if (!tq || tdm_free_async(tq, p, 0, NULL, NULL) < 0) tdm_free(p);
  Py_END_ALLOW_THREADS
}

/* A buffer in a garbage cycle gives its memory back while it still knows its queue. */
static int buffer_clear(BufferObject *self) {
  if (self->inflight == 0 && self->exports == 0)
    tdmpy_buffer_free_memory(tdmpy_state_of_type(Py_TYPE(self)), self);
  Py_CLEAR(self->queue);
  Py_CLEAR(self->owner);
  return 0;
}

static void buffer_dealloc(BufferObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  tdmpy_buffer_free_memory(tdmpy_state_of_type(tp), self);
  Py_CLEAR(self->queue);
  Py_CLEAR(self->device);
  Py_CLEAR(self->owner);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *buffer_free(BufferObject *self, PyObject *unused) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (self->released) Py_RETURN_NONE;
  if (self->exports > 0) {
    PyErr_Format(st->errors[-TDM_EBUSY], "free: %zd views or DLPack tensors of the buffer are "
                 "still alive", self->exports);
    return NULL;
  }
  self->released = 1;
  if (self->inflight == 0) tdmpy_buffer_free_memory(st, self);
  Py_RETURN_NONE;
}

static int host_accessible(BufferObject *self) {
  return self->kind != TDM_MEM_DEVICE ||
         (((DeviceObject *)self->device)->info.caps & TDM_DEVICE_CAP_HOST_MEMORY);
}

static int buffer_getbuffer(BufferObject *self, Py_buffer *view, int flags) {
  if (!self->ptr || self->released) {
    PyErr_SetString(PyExc_BufferError, tdmpy_buffer_gone(self));
    return -1;
  }
  if (!host_accessible(self)) {
    PyErr_Format(PyExc_BufferError, "device memory of %s is not host memory: use "
                 "__cuda_array_interface__, DLPack, or copy it to a host buffer",
                 ((DeviceObject *)self->device)->info.id);
    return -1;
  }
  if (PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, (Py_ssize_t)self->nbytes, 0, flags) < 0)
    return -1;
  self->exports++;
  return 0;
}

static void buffer_releasebuffer(BufferObject *self, Py_buffer *view) { self->exports--; }

/* Waits on the host (without the GIL) for the buffer's queue's work so far. */
int tdmpy_buffer_sync(tdmpy_state *st, BufferObject *self) {
  QueueObject *q = (QueueObject *)self->queue;
  if (!q || !q->q) return 0; /* destroyed: drained */
  tdm_event *ev;
  int rc = tdm_event_record(q->q, &ev);
  if (rc == 0) {
    Py_BEGIN_ALLOW_THREADS
    rc = tdm_event_wait(ev);
    Py_END_ALLOW_THREADS
    tdm_event_release(ev);
  }
  return rc < 0 ? (tdmpy_raise(st, rc), -1) : 0;
}

static PyObject *get_cai(BufferObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  DeviceObject *d = (DeviceObject *)self->device;
  if (self->kind != TDM_MEM_DEVICE || strcmp(d->info.backend, "cuda") != 0) {
    PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__: not CUDA device memory");
    return NULL;
  }
  if (!self->ptr || self->released) {
    PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__: the buffer was freed");
    return NULL;
  }
  if (tdmpy_check_live(st) < 0) return NULL;
  QueueObject *q = (QueueObject *)self->queue;
  void *stream = NULL;
  if (q->q && !(q->flags & TDM_QUEUE_OUT_OF_ORDER) && tdm_queue_native(q->q, &stream) < 0)
    stream = NULL;
  if (!stream && tdmpy_buffer_sync(st, self) < 0) return NULL; /* no stream to name: wait */
  PyObject *sv = stream ? PyLong_FromVoidPtr(stream) : Py_NewRef(Py_None);
  return Py_BuildValue("{s:(n),s:s,s:(NO),s:O,s:i,s:N}", "shape", (Py_ssize_t)self->nbytes,
                       "typestr", "|u1", "data", PyLong_FromVoidPtr(self->ptr), Py_False,
                       "strides", Py_None, "version", 3, "stream", sv);
}

static PyObject *get_ptr(BufferObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (!self->ptr || self->released) {
    PyErr_SetString(st->errors[-TDM_EHANDLE], tdmpy_buffer_gone(self));
    return NULL;
  }
  return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *get_cl_mem(BufferObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  DeviceObject *d = (DeviceObject *)self->device;
  if (self->kind != TDM_MEM_DEVICE || strcmp(d->info.backend, "opencl") != 0) {
    PyErr_Format(st->errors[-TDM_ENOTSUP], "cl_mem: not OpenCL device memory");
    return NULL;
  }
  if (!self->ptr || self->released) {
    PyErr_SetString(st->errors[-TDM_EHANDLE], tdmpy_buffer_gone(self));
    return NULL;
  }
  void *native;
  size_t offset;
  int rc = tdm_mem_native(self->ptr, &native, &offset);
  if (rc < 0) return tdmpy_raise(st, rc);
  return PyLong_FromVoidPtr(native);
}

static PyObject *get_nbytes(BufferObject *self, void *closure) {
  return PyLong_FromSize_t(self->nbytes);
}

static PyObject *get_kind(BufferObject *self, void *closure) {
  return PyUnicode_FromString(kind_name(self->kind));
}

static PyObject *get_obj(BufferObject *self, void *which) {
  PyObject *o = which ? self->queue : self->device;
  return Py_NewRef(o ? o : Py_None);
}

static PyObject *get_released(BufferObject *self, void *closure) {
  return PyBool_FromLong(self->released);
}

static Py_ssize_t buffer_length(BufferObject *self) { return (Py_ssize_t)self->nbytes; }

static PyObject *buffer_repr(BufferObject *self) {
  return PyUnicode_FromFormat("<tandem.Buffer %zu bytes of %s memory on %s%s%s>", self->nbytes,
                              kind_name(self->kind), ((DeviceObject *)self->device)->info.id,
                              self->owner ? ", a slot view" : "",
                              self->released ? (self->owner ? ", ended" : ", freed") : "");
}

static PyMethodDef buffer_methods[] = {
    {"free", (PyCFunction)buffer_free, METH_NOARGS,
     "free() -> None\n--\n\n"
     "Frees the memory (once copies that use it are done); later use raises. Refused while\n"
     "buffer views (numpy arrays) or DLPack tensors of it are alive."},
    {"__dlpack__", (PyCFunction)(void (*)(void))tdmpy_buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "A DLPack capsule of the bytes (uint8). On CUDA, stream is the consumer's stream: it\n"
     "waits on the device for the buffer's queue (-1: no ordering; None: the legacy stream).\n"
     "On SYCL, stream is the consumer's dpctl.SyclQueue, which waits on the device the same\n"
     "way (-1: no ordering; None: the host waits)."},
    {"__dlpack_device__", (PyCFunction)tdmpy_buffer_dlpack_device, METH_NOARGS,
     "__dlpack_device__() -> (device_type, device_id)\n--\n\n(2, ordinal) for CUDA device "
     "memory, (14, SYCL device index) for USM of a SYCL\ndevice (kDLOneAPI: device and pinned "
     "memory, as dpctl numbers devices), (1, 0) for other\nhost-accessible memory."},
    {NULL},
};

static PyGetSetDef buffer_getset[] = {
    {"ptr", (getter)get_ptr, NULL, "The address (a tandem pointer) as an integer.", NULL},
    {"cl_mem", (getter)get_cl_mem, NULL,
     "The cl_mem holding the buffer, as an integer for pyopencl.Buffer.from_int_ptr (OpenCL\n"
     "device memory). tandem's OpenCL pointers are not addresses.", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "The size in bytes.", NULL},
    {"kind", (getter)get_kind, NULL, "'device', 'pinned' or 'host'.", NULL},
    {"device", (getter)get_obj, NULL, "The Device it was allocated on.", NULL},
    {"queue", (getter)get_obj, NULL,
     "The queue whose work its users synchronize with (the CAI stream, __dlpack__).", (void *)1},
    {"released", (getter)get_released, NULL, "True once free() was called.", NULL},
    {"__cuda_array_interface__", (getter)get_cai, NULL,
     "CUDA Array Interface v3 (CUDA device memory): uint8 bytes, its stream the queue's.", NULL},
    {"__sycl_usm_array_interface__", (getter)tdmpy_buffer_suai, NULL,
     "dpctl's SYCL USM array interface v1 (device and pinned memory of SYCL devices): uint8\n"
     "bytes, its syclobj the buffer's queue as a dpctl.SyclQueue (the same native queue, so\n"
     "work a consumer submits there follows the queue's; an out-of-order queue is waited for\n"
     "on the host first). dpnp.asarray(buf) views the memory without a copy. Needs dpctl.",
     NULL},
    {NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_new, buffer_new},
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_traverse, buffer_traverse},
    {Py_tp_clear, buffer_clear},
    {Py_tp_repr, buffer_repr},
    {Py_tp_methods, buffer_methods},
    {Py_tp_getset, buffer_getset},
    {Py_sq_length, buffer_length},
    {Py_bf_getbuffer, buffer_getbuffer},
    {Py_bf_releasebuffer, buffer_releasebuffer},
    {Py_tp_doc, "Memory from tandem.malloc(nbytes, kind, device). Host and pinned buffers\n"
                "support the buffer protocol (numpy.frombuffer views them without a copy);\n"
                "CUDA device buffers expose __cuda_array_interface__ and DLPack; SYCL device\n"
                "and pinned buffers __sycl_usm_array_interface__ and DLPack (kDLOneAPI)."},
    {0, NULL},
};

PyType_Spec tdmpy_buffer_spec = {
    .name = "tandem.Buffer",
    .basicsize = sizeof(BufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = buffer_slots,
};
