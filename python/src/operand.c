/* operand.c: what a copy or a fill takes, resolved to a pointer tandem can use, and the
 * "hold" that keeps it alive until the work is done.
 *
 * Operands: tandem Buffers; objects with __cuda_array_interface__ (CuPy, PyTorch, Numba),
 * whose stream the queue then waits for; objects with __sycl_usm_array_interface__ (dpctl's
 * USM memory; dpnp's arrays go through DLPack, see tdmpy_operand), whose queue the queue then
 * waits for; buffer-protocol objects (numpy arrays); DLPack objects (CPU, CUDA and oneAPI
 * devices). Foreign device memory (CUDA pointers, USM) is imported into tandem
 * (tdm_mem_import) for as long as copies use it, one import per (address, size), counted in
 * the module state: used in place, never copied. A hold's references are dropped by a
 * keep-alive release on tandem's release thread, which takes the GIL to do so, unless Python
 * is already gone (then they leak, deliberately).
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

static int is_sycl(QueueObject *q) { return tdmpy_is_sycl(q->device); }

static int cuda_ordinal(QueueObject *q) {
  PyObject *n = PyObject_GetAttrString(q->device, "native");
  long v = n && PyLong_Check(n) ? PyLong_AsLong(n) : 0;
  Py_XDECREF(n);
  PyErr_Clear();
  return (int)v;
}

/* A pointer into device memory of q's device (a CUDA pointer, or USM of a SYCL device's
 * context) that tandem may not know: imported (or its import shared) for the hold's lifetime.
 * ours: whether q's device is of the memory's backend (what says which memory, else). */
static int use_device_pointer(tdmpy_state *st, QueueObject *q, void *ptr, size_t n,
                              tdmpy_hold *h, int ours, const char *what) {
  tdm_mem_info info;
  if (tdm_mem_query(ptr, &info) == 0 && info.base) return 0; /* tandem's own memory */
  if (!ours) {
    PyErr_SetString(st->errors[-TDM_EXDEV], what);
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

static Py_ssize_t typestr_itemsize(PyObject *typestr, const char *what) {
  if (!typestr) {
    PyErr_Format(PyExc_ValueError, "%s lacks typestr", what);
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

/* What the CUDA and the SYCL USM array interfaces share: data (pointer, read-only), shape,
 * strides (C-contiguous only; in bytes, or in elements as dpctl's interface has them),
 * typestr. *ptr, *n (bytes) and *itemsize. */
static int array_interface(PyObject *iface, const char *what, int writable, int in_elements,
                           void **ptr, size_t *n, Py_ssize_t *itemsize) {
  if (!PyDict_Check(iface)) {
    PyErr_Format(PyExc_TypeError, "%s is not a dict", what);
    return -1;
  }
  PyObject *data = PyDict_GetItemString(iface, "data"), *shape = PyDict_GetItemString(iface, "shape");
  PyObject *strides = PyDict_GetItemString(iface, "strides"); /* all borrowed */
  if ((*itemsize = typestr_itemsize(PyDict_GetItemString(iface, "typestr"), what)) < 0) return -1;
  if (!data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || !shape ||
      !PyTuple_Check(shape)) {
    PyErr_Format(PyExc_ValueError, "%s lacks data or shape", what);
    return -1;
  }
  int readonly = writable ? PyObject_IsTrue(PyTuple_GET_ITEM(data, 1)) : 0;
  if (readonly < 0) return -1;
  if (readonly) {
    PyErr_SetString(PyExc_ValueError, "the destination array is read-only");
    return -1;
  }
  *n = (size_t)*itemsize;
  Py_ssize_t nd = PyTuple_GET_SIZE(shape);
  for (Py_ssize_t i = 0; i < nd; i++) {
    size_t d = PyLong_AsSize_t(PyTuple_GET_ITEM(shape, i));
    if (d == (size_t)-1 && PyErr_Occurred()) return -1;
    if (mul_size(n, d, what) < 0) return -1;
  }
  if (strides && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd) {
      PyErr_Format(PyExc_ValueError, "%s: strides is not a tuple as long as shape", what);
      return -1;
    }
    /* expect stays within n (checked above) while the array is not empty. */
    Py_ssize_t expect = in_elements ? 1 : *itemsize;
    for (Py_ssize_t i = nd - 1; *n && i >= 0; i--) {
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
  *ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(data, 0));
  return PyErr_Occurred() ? -1 : 0;
}

/* __cuda_array_interface__ (version 2 or 3): C-contiguous arrays only. */
static int cai_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, PyObject *cai, int writable,
                       tdmpy_hold *h, tdmpy_span *out) {
  void *ptr;
  size_t n;
  Py_ssize_t itemsize;
  if (array_interface(cai, "__cuda_array_interface__", writable, 0, &ptr, &n, &itemsize) < 0)
    return -1;
  if (n && use_device_pointer(st, q, ptr, n, h, is_cuda(q),
                              "a CUDA array on a queue of a non-CUDA device") < 0)
    return -1;
  if (tdmpy_hold_add(h, obj) < 0) return -1;
  /* The producer's stream: the queue waits for its work so far, on the device. */
  PyObject *stream = PyDict_GetItemString(cai, "stream"); /* borrowed */
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

/* The syclobj of a SYCL USM array: when it is a queue (dpctl.SyclQueue), its device must be
 * q's, and q waits on the device for its work so far (the array's producer works there:
 * dpnp's compute follows data). A context, or anything else dpctl accepts there, says no
 * more than tdm_mem_import checks: that the memory is USM of the device's context. */
static int suai_syclobj(tdmpy_state *st, QueueObject *q, PyObject *syclobj) {
  if (!is_sycl(q)) return 0; /* tandem's own memory (a Buffer's): tandem orders its copies */
  if (!syclobj || syclobj == Py_None || PyUnicode_Check(syclobj) || PyCapsule_CheckExact(syclobj))
    return 0;
  PyObject *dev;
  int r = tdmpy_getattr_opt(syclobj, "sycl_device", &dev);
  if (r <= 0) return r;
  PyObject *mine = tdmpy_dpctl_device(st, q->device); /* borrowed */
  int same = mine ? PyObject_RichCompareBool(dev, mine, Py_EQ) : -1;
  if (same == 0)
    PyErr_Format(st->errors[-TDM_EXDEV], "a SYCL USM array of %R on a queue of %s", dev,
                 ((DeviceObject *)q->device)->info.id);
  Py_DECREF(dev);
  if (same <= 0) return -1;
  PyObject *fn;
  if ((r = tdmpy_getattr_opt(syclobj, "submit_barrier", &fn)) <= 0) return r;
  Py_DECREF(fn);
  return tdmpy_sycl_order(st, q, syclobj);
}

/* __sycl_usm_array_interface__ (version 1, dpctl's): data is the start of the allocation,
 * offset and strides count elements; C-contiguous arrays only. */
static int suai_operand(tdmpy_state *st, QueueObject *q, PyObject *obj, PyObject *suai,
                        int writable, tdmpy_hold *h, tdmpy_span *out) {
  static const char what[] = "__sycl_usm_array_interface__";
  void *ptr;
  size_t n;
  Py_ssize_t itemsize;
  /* data[1] is a read-only flag (dpctl's specification), except in dpctl.memory's own objects,
   * whose flag is documented as always "writable" (True). */
  if (strncmp(Py_TYPE(obj)->tp_name, "dpctl.memory.", 13) == 0) writable = 0;
  if (array_interface(suai, what, writable, 1, &ptr, &n, &itemsize) < 0) return -1;
  PyObject *version = PyDict_GetItemString(suai, "version"); /* borrowed, as below */
  long v = version ? PyLong_AsLong(version) : 0;
  if (v != 1) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_ValueError, "%s: version %ld (1 is the one there is)", what, v);
    return -1;
  }
  PyObject *offset = PyDict_GetItemString(suai, "offset");
  if (offset && offset != Py_None) {
    Py_ssize_t off = PyLong_AsSsize_t(offset);
    if (off == -1 && PyErr_Occurred()) return -1;
    if (off < 0 || (size_t)off > (size_t)PY_SSIZE_T_MAX / (size_t)itemsize) {
      PyErr_Format(PyExc_ValueError, "%s: offset %zd", what, off);
      return -1;
    }
    ptr = (char *)ptr + (size_t)off * (size_t)itemsize;
  }
  if (n && use_device_pointer(st, q, ptr, n, h, is_sycl(q),
                              "a SYCL USM array on a queue of a non-SYCL device") < 0)
    return -1;
  if (tdmpy_hold_add(h, obj) < 0) return -1;
  if (n && suai_syclobj(st, q, PyDict_GetItemString(suai, "syclobj")) < 0) return -1;
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
  /* dpnp's arrays (dpnp.ndarray, dpnp.tensor.usm_ndarray) define both the SYCL USM interface
   * and DLPack, and their interface waits on the host for the array's queue (dpnp 0.20: "must
   * wait for content of the memory to finalize"). Through DLPack, with this queue as the
   * stream, the producer orders its work before this queue on the device instead, and the
   * call does not block. Looked up on the type, so the interface is not read. */
  PyObject *tp = (PyObject *)Py_TYPE(obj);
  if (PyObject_HasAttrString(tp, "__sycl_usm_array_interface__") &&
      PyObject_HasAttrString(tp, "__dlpack__"))
    return dlpack_operand(st, q, obj, h, out);
  PyObject *suai;
  if ((r = tdmpy_getattr_opt(obj, "__sycl_usm_array_interface__", &suai)) < 0) return -1;
  if (r) {
    int rc = suai_operand(st, q, obj, suai, writable, h, out);
    Py_DECREF(suai);
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
               "an object with __cuda_array_interface__, __sycl_usm_array_interface__ or "
               "__dlpack__, not %.100s",
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
  } else if (type == 14) { /* kDLOneAPI: the producer orders its work before the queue we name */
    if (!is_sycl(q)) {
      PyErr_SetString(st->errors[-TDM_EXDEV], "a oneAPI DLPack tensor on a non-SYCL queue");
      return -1;
    }
    int mine;
    if (tdmpy_sycl_device_id(st, q->device, &mine) < 0) return -1;
    if (id != mine) {
      PyErr_Format(st->errors[-TDM_EXDEV], "a oneAPI DLPack tensor of SYCL device %d on a "
                   "queue of %s (SYCL device %d)", id, ((DeviceObject *)q->device)->info.id,
                   mine);
      return -1;
    }
    PyObject *stream = tdmpy_dpctl_queue(st, q);
    PyObject *kw = stream ? Py_BuildValue("{s:N}", "stream", stream) : NULL;
    PyObject *m = kw ? PyObject_GetAttrString(obj, "__dlpack__") : NULL;
    PyObject *empty = m ? PyTuple_New(0) : NULL;
    cap = empty ? PyObject_Call(m, empty, kw) : NULL;
    Py_XDECREF(kw);
    Py_XDECREF(m);
    Py_XDECREF(empty);
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
  if ((type == 2 || type == 14) && n && use_device_pointer(st, q, ptr, n, h, 1, NULL) < 0)
    return -1;
  out->ptr = ptr;
  out->nbytes = n;
  return 0;
}
