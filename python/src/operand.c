/* operand.c: what a copy or a fill takes, resolved to a pointer tandem can use, and the
 * "hold" that keeps it alive until the work is done.
 *
 * Operands: tandem Buffers; objects with __cuda_array_interface__ (CuPy, PyTorch, Numba),
 * whose stream the queue then waits for; buffer-protocol objects (numpy arrays); DLPack
 * objects. Foreign CUDA memory is imported into tandem (tdm_mem_import) for as long as copies
 * use it, one import per (address, size), counted in the module state. A hold's references
 * are dropped by a keep-alive release on tandem's release thread, which takes the GIL to do
 * so, unless Python is already gone (then they leak, deliberately).
 */
#include "tdmpy.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum { HOLD_MAX = 2 };

struct tdmpy_hold {
  PyObject *objs;                 /* list of references, or NULL */
  Py_buffer views[HOLD_MAX];      /* buffer-protocol views */
  int nviews;
  BufferObject *bufs[HOLD_MAX];   /* borrowed (objs holds them): their inflight counted */
  int nbufs;
  PyObject *import_keys[HOLD_MAX];/* owned keys of st->imports this hold uses */
  int nimports;
  PyObject *module;               /* owned: keeps the state of import_keys alive */
  tdmpy_state *st;
};

tdmpy_hold *tdmpy_hold_new(void) {
  tdmpy_hold *h = PyMem_RawCalloc(1, sizeof *h);
  return h;
}

int tdmpy_hold_add(tdmpy_hold *h, PyObject *obj) {
  if (!h->objs && !(h->objs = PyList_New(0))) return -1;
  return PyList_Append(h->objs, obj);
}

static void buffer_done(tdmpy_state *st, BufferObject *b) {
  if (--b->inflight == 0 && b->released) tdmpy_buffer_free_memory(st, b);
}

static void import_done(tdmpy_state *st, PyObject *key) {
  PyObject *entry = st->imports ? PyDict_GetItemWithError(st->imports, key) : NULL;
  if (!entry) {
    PyErr_Clear();
    return;
  }
  long uses = PyLong_AsLong(PyList_GET_ITEM(entry, 1)) - 1;
  if (uses > 0) {
    PyObject *n = PyLong_FromLong(uses);
    if (n) PyList_SetItem(entry, 1, n);
    PyErr_Clear();
    return;
  }
  void *p = PyLong_AsVoidPtr(PyList_GET_ITEM(entry, 0));
  if (st->live && p) tdm_free(p); /* forgets the foreign memory, never frees it */
  if (PyDict_DelItem(st->imports, key) < 0) PyErr_Clear();
}

/* With the GIL held. */
void tdmpy_hold_drop(tdmpy_hold *h) {
  for (int i = 0; i < h->nviews; i++) PyBuffer_Release(&h->views[i]);
  for (int i = 0; i < h->nbufs; i++) buffer_done(h->st, h->bufs[i]);
  for (int i = 0; i < h->nimports; i++) {
    import_done(h->st, h->import_keys[i]);
    Py_DECREF(h->import_keys[i]);
  }
  Py_XDECREF(h->objs);
  Py_XDECREF(h->module);
  PyMem_RawFree(h);
}

/* Runs on tandem's release thread. */
static void hold_release(void *arg) {
  if (atomic_load(&tdmpy_python_gone)) return; /* after shutdown: leak, never run Python */
  PyGILState_STATE g = PyGILState_Ensure();
  tdmpy_hold_drop(arg);
  PyGILState_Release(g);
}

int tdmpy_hold_submit(tdmpy_state *st, tdm_queue *q, tdmpy_hold *h) {
  int rc = tdm_keep_alive(q, hold_release, h);
  if (rc < 0) {
    tdmpy_raise(st, rc);
    tdmpy_hold_drop(h);
    return -1;
  }
  return 0;
}

/* ---- operands --------------------------------------------------------------------------- */

static int is_cuda(QueueObject *q) {
  return strcmp(((DeviceObject *)q->device)->info.backend, "cuda") == 0;
}

static int cuda_ordinal(QueueObject *q) {
  PyObject *n = PyObject_GetAttrString(q->device, "native");
  long v = n && PyLong_Check(n) ? PyLong_AsLong(n) : 0;
  Py_XDECREF(n);
  PyErr_Clear();
  return (int)v;
}

/* A pointer into device memory of q's device that tandem may not know: imported (or its
 * import shared) for the hold's lifetime. */
static int use_device_pointer(tdmpy_state *st, QueueObject *q, void *ptr, size_t n,
                              tdmpy_hold *h) {
  tdm_mem_info info;
  if (tdm_mem_query(ptr, &info) == 0 && info.base) return 0; /* tandem's own memory */
  if (!is_cuda(q)) {
    PyErr_SetString(st->errors[-TDM_EXDEV], "a CUDA array on a queue of a non-CUDA device");
    return -1;
  }
  if (h->nimports == HOLD_MAX) {
    PyErr_SetString(PyExc_RuntimeError, "too many foreign operands");
    return -1;
  }
  PyObject *key = Py_BuildValue("(Nn)", PyLong_FromVoidPtr(ptr), (Py_ssize_t)n);
  if (!key) return -1;
  PyObject *entry = PyDict_GetItemWithError(st->imports, key); /* borrowed */
  if (entry) {
    PyObject *uses = PyLong_FromLong(PyLong_AsLong(PyList_GET_ITEM(entry, 1)) + 1);
    if (!uses || PyList_SetItem(entry, 1, uses) < 0) goto fail;
  } else {
    if (PyErr_Occurred()) goto fail;
    void *p;
    int rc = tdm_mem_import(((DeviceObject *)q->device)->dev, ptr, n, &p);
    if (rc < 0) {
      tdmpy_raise(st, rc);
      goto fail;
    }
    entry = Py_BuildValue("[Ni]", PyLong_FromVoidPtr(p), 1);
    if (!entry || PyDict_SetItem(st->imports, key, entry) < 0) {
      Py_XDECREF(entry);
      tdm_free(p);
      goto fail;
    }
    Py_DECREF(entry);
  }
  if (!h->module && !(h->module = Py_XNewRef(PyType_GetModule(Py_TYPE(q))))) goto fail;
  h->import_keys[h->nimports++] = key;
  return 0;
fail:
  Py_DECREF(key);
  return -1;
}

static int buffer_operand(tdmpy_state *st, BufferObject *b, tdmpy_hold *h, tdmpy_span *out) {
  if (!b->ptr || b->released) {
    PyErr_SetString(st->errors[-TDM_EHANDLE], tdmpy_buffer_gone(b));
    return -1;
  }
  if (h->nbufs == HOLD_MAX) {
    PyErr_SetString(PyExc_RuntimeError, "too many buffer operands");
    return -1;
  }
  if (tdmpy_hold_add(h, (PyObject *)b) < 0) return -1;
  b->inflight++;
  h->bufs[h->nbufs++] = b;
  out->ptr = b->ptr;
  out->nbytes = b->nbytes;
  return 0;
}

static Py_ssize_t typestr_itemsize(PyObject *typestr) {
  if (!typestr) {
    PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__ lacks typestr");
    return -1;
  }
  const char *s = PyUnicode_AsUTF8(typestr);
  if (!s) return -1;
  char *end = NULL;
  errno = 0;
  long n = strlen(s) >= 3 ? strtol(s + 2, &end, 10) : 0;
  /* The widest element any array library has is a few dozen bytes; a datetime's unit
   * follows its size ("<M8[ns]"). */
  if (errno || n <= 0 || n > 1024 || (*end && *end != '[')) {
    PyErr_Format(PyExc_ValueError, "unknown typestr %R", typestr);
    return -1;
  }
  return n;
}

/* *n *= dim, refused with ValueError when the product would exceed what one Python object
 * may hold (PY_SSIZE_T_MAX bytes): a size that wraps around is no size at all. */
static int mul_size(size_t *n, size_t dim, const char *what) {
  if (dim && *n > (size_t)PY_SSIZE_T_MAX / dim) {
    PyErr_Format(PyExc_ValueError, "%s: the shape's size in bytes overflows", what);
    return -1;
  }
  *n *= dim;
  return 0;
}

/* __cuda_array_interface__ (version 2 or 3): C-contiguous arrays only. */
static int cai_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, PyObject *cai, int writable,
                       tdmpy_hold *h, tdmpy_span *out) {
  if (!PyDict_Check(cai)) {
    PyErr_SetString(PyExc_TypeError, "__cuda_array_interface__ is not a dict");
    return -1;
  }
  PyObject *data = PyDict_GetItemString(cai, "data"), *shape = PyDict_GetItemString(cai, "shape");
  PyObject *strides = PyDict_GetItemString(cai, "strides");
  PyObject *stream = PyDict_GetItemString(cai, "stream"); /* all borrowed */
  Py_ssize_t itemsize = typestr_itemsize(PyDict_GetItemString(cai, "typestr"));
  if (itemsize < 0) return -1;
  if (!data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || !shape ||
      !PyTuple_Check(shape)) {
    PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__ lacks data or shape");
    return -1;
  }
  int readonly = writable ? PyObject_IsTrue(PyTuple_GET_ITEM(data, 1)) : 0;
  if (readonly < 0) return -1;
  if (readonly) {
    PyErr_SetString(PyExc_ValueError, "the destination array is read-only");
    return -1;
  }
  size_t n = (size_t)itemsize;
  Py_ssize_t nd = PyTuple_GET_SIZE(shape);
  for (Py_ssize_t i = 0; i < nd; i++) {
    size_t d = PyLong_AsSize_t(PyTuple_GET_ITEM(shape, i));
    if (d == (size_t)-1 && PyErr_Occurred()) return -1;
    if (mul_size(&n, d, "__cuda_array_interface__") < 0) return -1;
  }
  if (strides && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd) {
      PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__: strides is not a tuple as "
                      "long as shape");
      return -1;
    }
    /* expect stays within n (checked above) while the array is not empty. */
    Py_ssize_t expect = itemsize;
    for (Py_ssize_t i = nd - 1; n && i >= 0; i--) {
      Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
      Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
      if (PyErr_Occurred()) return -1;
      if (dim > 1 && s != expect) {
        PyErr_SetString(PyExc_ValueError, "copy takes C-contiguous arrays only");
        return -1;
      }
      expect *= dim;
    }
  }
  void *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
  if (PyErr_Occurred()) return -1;
  if (n && use_device_pointer(st, q, ptr, n, h) < 0) return -1;
  if (tdmpy_hold_add(h, obj) < 0) return -1;
  /* The producer's stream: the queue waits for its work so far, on the device. */
  if (stream && stream != Py_None) {
    void *s = PyLong_AsVoidPtr(stream), *mine = NULL;
    if (PyErr_Occurred()) return -1;
    if (q->flags & TDM_QUEUE_OUT_OF_ORDER || tdm_queue_native(q->q, &mine) < 0) mine = NULL;
    if (s != mine && tdmpy_cuda_order(st, cuda_ordinal(q), s, mine) < 0) return -1;
  }
  out->ptr = ptr;
  out->nbytes = n;
  return 0;
}

static int view_operand(PyObject *obj, int writable, tdmpy_hold *h, tdmpy_span *out) {
  if (h->nviews == HOLD_MAX) {
    PyErr_SetString(PyExc_RuntimeError, "too many buffer-protocol operands");
    return -1;
  }
  Py_buffer *v = &h->views[h->nviews];
  if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
    return -1;
  h->nviews++;
  out->ptr = v->buf;
  out->nbytes = (size_t)v->len;
  return 0;
}

/* A DLPack object that has no buffer-protocol or CUDA interface: its capsule is kept (the
 * producer's deleter runs when the hold is dropped). */
static int dlpack_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, tdmpy_hold *h,
                          tdmpy_span *out);

int tdmpy_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, int writable,
                  tdmpy_hold *h, tdmpy_span *out) {
  h->st = st;
  if (PyObject_TypeCheck(obj, st->buffer_type))
    return buffer_operand(st, (BufferObject *)obj, h, out);
  PyObject *cai;
  int r = tdmpy_getattr_opt(obj, "__cuda_array_interface__", &cai);
  if (r < 0) return -1;
  if (r) {
    int rc = cai_operand(st, q, obj, cai, writable, h, out);
    Py_DECREF(cai);
    return rc;
  }
  if (PyObject_CheckBuffer(obj)) return view_operand(obj, writable, h, out);
  PyObject *dl;
  if ((r = tdmpy_getattr_opt(obj, "__dlpack__", &dl)) < 0) return -1;
  if (r) {
    Py_DECREF(dl);
    return dlpack_operand(st, q, obj, h, out);
  }
  PyErr_Format(PyExc_TypeError, "expected a tandem.Buffer, a buffer-protocol object (numpy), "
               "an object with __cuda_array_interface__ or __dlpack__, not %.100s",
               Py_TYPE(obj)->tp_name);
  return -1;
}

/* ---- DLPack consumption ----------------------------------------------------------------- */

typedef struct {
  void *data;
  struct { int32_t device_type, device_id; } device;
  int32_t ndim;
  struct { uint8_t code, bits; uint16_t lanes; } dtype;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} dl_tensor;

static int dlpack_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, tdmpy_hold *h,
                          tdmpy_span *out) {
  PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!dev) return -1;
  int type = -1, id = 0;
  if (!PyTuple_Check(dev) || !PyArg_ParseTuple(dev, "ii", &type, &id)) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "__dlpack_device__() must return (type, id)");
    Py_DECREF(dev);
    return -1;
  }
  Py_DECREF(dev);
  PyObject *cap;
  if (type == 2) { /* kDLCUDA: the producer orders its work before the stream we name */
    if (!is_cuda(q)) {
      PyErr_SetString(st->errors[-TDM_EXDEV], "a CUDA DLPack tensor on a non-CUDA queue");
      return -1;
    }
    void *mine = NULL;
    if (q->flags & TDM_QUEUE_OUT_OF_ORDER || tdm_queue_native(q->q, &mine) < 0) mine = NULL;
    /* An out-of-order queue has no one stream: name the legacy one and wait for it here. */
    PyObject *kw = Py_BuildValue("{s:N}", "stream", PyLong_FromVoidPtr(mine ? mine : (void *)1));
    PyObject *m = kw ? PyObject_GetAttrString(obj, "__dlpack__") : NULL;
    PyObject *empty = m ? PyTuple_New(0) : NULL;
    cap = empty ? PyObject_Call(m, empty, kw) : NULL;
    Py_XDECREF(kw);
    Py_XDECREF(m);
    Py_XDECREF(empty);
    if (cap && !mine && tdmpy_cuda_order(st, cuda_ordinal(q), (void *)1, NULL) < 0) Py_CLEAR(cap);
  } else if (type == 1 || type == 3) { /* kDLCPU, kDLCUDAHost */
    cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
  } else {
    PyErr_Format(PyExc_TypeError, "DLPack device type %d is not supported", type);
    return -1;
  }
  if (!cap) return -1;
  dl_tensor *t = NULL;
  if (PyCapsule_IsValid(cap, "dltensor")) {
    t = PyCapsule_GetPointer(cap, "dltensor"); /* DLManagedTensor: the tensor comes first */
  } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    char *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    /* DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the tensor */
    t = (dl_tensor *)(m + 2 * sizeof(uint32_t) + 2 * sizeof(void *) + sizeof(uint64_t));
  }
  if (!t) {
    Py_DECREF(cap);
    PyErr_SetString(PyExc_TypeError, "__dlpack__ did not return a DLPack capsule");
    return -1;
  }
  size_t n = (t->dtype.bits * (size_t)t->dtype.lanes + 7) / 8;
  if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
    Py_DECREF(cap);
    PyErr_Format(PyExc_ValueError, "DLPack tensor with ndim %d and %s shape", (int)t->ndim,
                 t->shape ? "a" : "no");
    return -1;
  }
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || mul_size(&n, (size_t)t->shape[i], "DLPack tensor") < 0) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "DLPack tensor with a negative dimension (%lld)",
                     (long long)t->shape[i]);
      Py_DECREF(cap);
      return -1;
    }
  }
  /* In elements; within n (checked above) while the tensor is not empty. */
  int64_t expect = 1;
  for (int i = t->ndim - 1; n && t->strides && i >= 0; i--) {
    if (t->shape[i] > 1 && t->strides[i] != expect) {
      Py_DECREF(cap);
      PyErr_SetString(PyExc_ValueError, "copy takes C-contiguous arrays only");
      return -1;
    }
    expect *= t->shape[i];
  }
  void *ptr = (char *)t->data + t->byte_offset;
  int rc = tdmpy_hold_add(h, cap); /* the capsule's destructor calls the producer's deleter */
  Py_DECREF(cap);
  if (rc < 0) return -1;
  if (type == 2 && n && use_device_pointer(st, q, ptr, n, h) < 0) return -1;
  out->ptr = ptr;
  out->nbytes = n;
  return 0;
}
