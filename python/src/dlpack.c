/* dlpack.c: DLPack export of tandem.Buffer (__dlpack__, __dlpack_device__), legacy
 * ("dltensor") and versioned ("dltensor_versioned", DLPack 1.0) capsules. Memory of a SYCL
 * device is kDLOneAPI (USM, whose device id is the SYCL runtime's index of the device, as
 * dpctl numbers it), even on a CPU device where it is host memory too.
 *
 * The structures follow dlpack.h (DLPack 1.0, whose ABI is fixed); they are declared here so
 * the extension needs no header of another project. A capsule holds a reference to the
 * Buffer and counts as an export (free() refuses meanwhile). The consumer's deleter may run
 * on any thread, without the GIL: it takes the GIL to drop the reference, unless Python is
 * already gone (then the reference leaks, deliberately).
 */
#include "tdmpy.h"

#include <string.h>

enum { kDLCPU = 1, kDLCUDA = 2, kDLOneAPI = 14 };
enum { kDLUInt = 1 };

typedef struct {
  int32_t device_type, device_id;
} DLDevice;
typedef struct {
  uint8_t code, bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
typedef struct {
  uint32_t major, minor;
} DLPackVersion;
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* What a capsule owns: the managed tensor and its one-element shape and strides, in one block.
 * Strides are given though DLPack allows NULL for compact tensors: dpctl's importer (dpnp
 * 0.20's too) reads them unconditionally. */
typedef struct {
  union {
    DLManagedTensor legacy;
    DLManagedTensorVersioned versioned;
  } m;
  int64_t shape[1], strides[1];
  BufferObject *buffer; /* owned */
} export_block;

static void drop_block(export_block *b) {
  if (!atomic_load(&tdmpy_python_gone)) {
    PyGILState_STATE g = PyGILState_Ensure();
    b->buffer->exports--;
    Py_DECREF(b->buffer);
    PyGILState_Release(g);
  }
  PyMem_RawFree(b);
}

static void legacy_deleter(DLManagedTensor *self) { drop_block(self->manager_ctx); }
static void versioned_deleter(DLManagedTensorVersioned *self) { drop_block(self->manager_ctx); }

/* An unconsumed capsule (still named "dltensor" / "dltensor_versioned") frees its tensor. */
static void capsule_destructor(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    m->deleter(m);
  } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    m->deleter(m);
  }
}

static int dl_device_of(tdmpy_state *st, BufferObject *self, DLDevice *out) {
  DeviceObject *d = (DeviceObject *)self->device;
  if (self->kind == TDM_MEM_DEVICE && strcmp(d->info.backend, "cuda") == 0) {
    void *native;
    int rc = tdm_device_native(d->dev, &native);
    if (rc < 0) return tdmpy_raise(st, rc), -1;
    out->device_type = kDLCUDA;
    out->device_id = *(int *)native;
    return 0;
  }
  if (self->kind != TDM_MEM_HOST && tdmpy_is_sycl(self->device)) { /* USM: device or host */
    out->device_type = kDLOneAPI;
    return tdmpy_sycl_device_id(st, self->device, &out->device_id);
  }
  if (self->kind != TDM_MEM_DEVICE || (d->info.caps & TDM_DEVICE_CAP_HOST_MEMORY)) {
    out->device_type = kDLCPU;
    out->device_id = 0;
    return 0;
  }
  PyErr_Format(PyExc_BufferError, "device memory of %s cannot be exported with DLPack",
               d->info.id);
  return -1;
}

PyObject *tdmpy_buffer_dlpack_device(BufferObject *self, PyObject *unused) {
  DLDevice dev;
  if (dl_device_of(tdmpy_state_of_type(Py_TYPE(self)), self, &dev) < 0) return NULL;
  return Py_BuildValue("(ii)", dev.device_type, dev.device_id);
}

/* Orders the consumer after the buffer's queue: on the device for a CUDA consumer stream,
 * else on the host. The legacy default stream (None, 0 and 1 name it) is ordered on the host
 * too: a synchronous call on it (CuPy's asnumpy, PyTorch's .cpu()) waiting device-side for a
 * command tandem runs on the host (a pageable copy) would block every thread's CUDA calls, the
 * tandem thread's among them, until that command is done: a deadlock (tandem/cuda.h). */
static int order_for_consumer(tdmpy_state *st, BufferObject *self, DLDevice dev,
                              PyObject *stream) {
  if (dev.device_type == kDLOneAPI) return tdmpy_sycl_order_consumer(st, self, stream);
  if (stream != Py_None) {
    long s = PyLong_AsLong(stream);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s == -1) return 0; /* the consumer orders itself */
  }
  if (dev.device_type != kDLCUDA) {
    if (stream != Py_None) {
      PyErr_SetString(PyExc_BufferError, "__dlpack__: stream must be None for host memory");
      return -1;
    }
    return tdmpy_buffer_sync(st, self);
  }
  void *consumer = stream == Py_None ? NULL : PyLong_AsVoidPtr(stream);
  if (PyErr_Occurred()) return -1;
  if (consumer == NULL || consumer == (void *)1) return tdmpy_buffer_sync(st, self);
  QueueObject *q = (QueueObject *)self->queue;
  void *mine = NULL;
  if (!q->q) return 0;
  if (q->flags & TDM_QUEUE_OUT_OF_ORDER || tdm_queue_native(q->q, &mine) < 0)
    return tdmpy_buffer_sync(st, self);
  if (mine == consumer) return 0;
  return tdmpy_cuda_order(st, dev.device_id, mine, consumer);
}

PyObject *tdmpy_buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
  PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO:__dlpack__", kwlist, &stream, &max_version,
                                   &dl_device, &copy))
    return NULL;
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (tdmpy_check_live(st) < 0) return NULL;
  if (!self->ptr || self->released) {
    PyErr_SetString(PyExc_BufferError, tdmpy_buffer_gone(self));
    return NULL;
  }
  DLDevice dev;
  if (dl_device_of(st, self, &dev) < 0) return NULL;
  if (copy == Py_True) {
    PyErr_SetString(PyExc_BufferError, "__dlpack__: copy=True is not supported (views only)");
    return NULL;
  }
  if (dl_device != Py_None) {
    int t, id;
    if (!PyTuple_Check(dl_device)) {
      PyErr_SetString(PyExc_TypeError, "__dlpack__: dl_device must be a tuple (type, id)");
      return NULL;
    }
    if (!PyArg_ParseTuple(dl_device, "ii", &t, &id)) return NULL;
    if (t != dev.device_type || id != dev.device_id) {
      PyErr_SetString(PyExc_BufferError, "__dlpack__: dl_device differs from the buffer's");
      return NULL;
    }
  }
  int versioned = 0;
  if (max_version != Py_None) {
    int major, minor;
    if (!PyTuple_Check(max_version)) {
      PyErr_SetString(PyExc_TypeError, "__dlpack__: max_version must be a tuple (major, minor)");
      return NULL;
    }
    if (!PyArg_ParseTuple(max_version, "ii", &major, &minor)) return NULL;
    versioned = major >= 1;
  }
  if (order_for_consumer(st, self, dev, stream) < 0) return NULL;

  export_block *b = PyMem_RawCalloc(1, sizeof *b);
  if (!b) return PyErr_NoMemory();
  b->shape[0] = (int64_t)self->nbytes;
  b->strides[0] = 1;
  b->buffer = (BufferObject *)Py_NewRef(self);
  DLTensor *t = versioned ? &b->m.versioned.dl_tensor : &b->m.legacy.dl_tensor;
  t->data = self->ptr;
  t->device = dev;
  t->ndim = 1;
  t->dtype = (DLDataType){kDLUInt, 8, 1};
  t->shape = b->shape;
  t->strides = b->strides;
  t->byte_offset = 0;
  PyObject *cap;
  if (versioned) {
    b->m.versioned.version = (DLPackVersion){1, 0};
    b->m.versioned.manager_ctx = b;
    b->m.versioned.deleter = versioned_deleter;
    cap = PyCapsule_New(&b->m.versioned, "dltensor_versioned", capsule_destructor);
  } else {
    b->m.legacy.manager_ctx = b;
    b->m.legacy.deleter = legacy_deleter;
    cap = PyCapsule_New(&b->m.legacy, "dltensor", capsule_destructor);
  }
  if (!cap) {
    Py_DECREF(self);
    PyMem_RawFree(b);
    return NULL;
  }
  self->exports++;
  return cap;
}
