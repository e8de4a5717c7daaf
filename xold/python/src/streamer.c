/* streamer.c: tandem.Streamer, the expert streamer (tandem/streamer.h) for Python: experts
 * in host Buffers, streamed into device slots on the streamer's own copy queues while a
 * compute Queue works; acquire/release, prefetch, schedule, statistics, and views of slots
 * as Buffers.
 *
 * What the object keeps and why:
 * - the compute Queue (counted in its `users`, so destroy() is refused while the C streamer
 *   borrows it) and the host Buffers (counted in their `inflight`, so Buffer.free() defers
 *   the memory until the streamer is closed: it copies from them until then);
 * - per expert, how often this object saw it acquired and the slot pointer it got, so that
 *   close() can refuse while experts are acquired and slot_view() can find the slot;
 * - the Queue objects of `queues` (not owned: they stop working at close) and the slot views
 *   it handed out (ended at release or close, since the slot may then hold another expert
 *   or be freed).
 * A view holds a reference to its Streamer, so a numpy array over a slot keeps the slot's
 * memory allocated; close() is refused while such arrays exist.
 *
 * The GIL is released around every call into the C streamer: they take its lock, submit
 * copies (PoCL's basic driver runs them in the calling thread) and close waits for copies.
 * `busy` counts the calls in progress without the GIL so close() cannot free the streamer
 * under one of them.
 */
#include "tdmpy.h"

#include <string.h>

#include <tandem/streamer.h>

typedef struct {
  PyObject_HEAD
  tdm_streamer *s;        /* NULL once closed */
  PyObject *compute;      /* Queue; NULL once closed */
  PyObject *host;         /* tuple of the host Buffers; NULL once closed */
  int host_held;          /* 1: the host Buffers' inflight counts include this streamer */
  PyObject *queues;       /* (demand, prefetch) Queue objects, made on first use, or NULL */
  const void **ptrs;      /* host pointer of each key (PyMem) */
  int layers, experts;
  size_t expert_bytes;
  int *pins;              /* per key: acquired and not yet released, as seen here */
  const void **slot;      /* per key: the slot pointer of its last acquire */
  PyObject **views;       /* per key: the slot view handed out while acquired, or NULL */
  PyObject *lingering;    /* list: ended views that arrays still export (close waits), or NULL */
  Py_ssize_t pinned;      /* sum of pins */
  Py_ssize_t busy;        /* calls in progress with the GIL released */
} StreamerObject;

static tdmpy_state *sstate(StreamerObject *self) {
  return tdmpy_state_of_type(Py_TYPE(self));
}

static long nkeys(StreamerObject *self) { return (long)self->layers * self->experts; }

static tdm_device *sdev(StreamerObject *self) {
  return ((DeviceObject *)((QueueObject *)self->compute)->device)->dev;
}

/* 0 if the streamer can be used, else -1 with an error set. */
static int usable(tdmpy_state *st, StreamerObject *self) {
  if (tdmpy_check_live(st) < 0) return -1;
  if (!self->s) {
    PyErr_SetString(st->errors[-TDM_ESTATE], "the streamer is closed");
    return -1;
  }
  return 0;
}

/* The key of (layer, e), or -1 with InvalidArgumentError set, as the C calls would say. */
static long key_arg(tdmpy_state *st, StreamerObject *self, int layer, int e) {
  if (layer < 0 || layer >= self->layers || e < 0 || e >= self->experts) {
    PyErr_Format(st->errors[-TDM_EINVAL], "expert %d of layer %d does not exist (%d layers of "
                 "%d experts)", e, layer, self->layers, self->experts);
    return -1;
  }
  return (long)layer * self->experts + e;
}

/* A sequence of ints as a PyMem array (*out NULL when empty); -1 with an error set. */
static int int_array(PyObject *seq, const char *what, int **out, Py_ssize_t *n) {
  *out = NULL;
  *n = 0;
  PyObject *fast = PySequence_Fast(seq, what);
  if (!fast) return -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  if (len > INT_MAX) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "%s: too many items", what);
    return -1;
  }
  int *a = len ? PyMem_Malloc((size_t)len * sizeof *a) : NULL;
  if (len && !a) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < len; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) goto fail;
    if (v < INT_MIN || v > INT_MAX) {
      PyErr_Format(PyExc_OverflowError, "%s: %ld is out of range", what, v);
      goto fail;
    }
    a[i] = (int)v;
  }
  Py_DECREF(fast);
  *out = a;
  *n = len;
  return 0;
fail:
  Py_DECREF(fast);
  PyMem_Free(a);
  return -1;
}

/* ---- creation --------------------------------------------------------------------------- */

/* Whether a host Buffer can be streamed from: pinned memory; on CPU and OpenCL devices, whose
 * copies read any host memory at the same speed, pageable "host" memory too. 0 or -1 with
 * the reason raised. */
static int check_host_buffer(tdmpy_state *st, PyObject *obj, const char *backend, size_t need,
                             Py_ssize_t index) {
  char where[48] = "host";
  if (index >= 0) snprintf(where, sizeof where, "host[%zd]", index);
  if (!PyObject_TypeCheck(obj, st->buffer_type)) {
    PyErr_Format(PyExc_TypeError, "%s must be a tandem.Buffer (tandem.malloc(n, \"pinned\")), "
                 "not %.100s", where, Py_TYPE(obj)->tp_name);
    return -1;
  }
  BufferObject *b = (BufferObject *)obj;
  if (!b->ptr || b->released) {
    PyErr_Format(PyExc_ValueError, "%s: %s", where, tdmpy_buffer_gone(b));
    return -1;
  }
  int host_ok = strcmp(backend, "cuda") != 0;
  if (b->owner || !(b->kind == TDM_MEM_PINNED || (host_ok && b->kind == TDM_MEM_HOST))) {
    PyErr_Format(PyExc_ValueError, "%s: experts are streamed from %s memory, not from %s%s",
                 where, host_ok ? "pinned or host" : "pinned",
                 b->owner ? "a slot view" : b->kind == TDM_MEM_DEVICE ? "device memory"
                                                                      : "pageable host memory",
                 host_ok ? "" : " (a CUDA copy from it would be staged)");
    return -1;
  }
  if (b->nbytes < need) {
    PyErr_Format(PyExc_ValueError, "%s holds %zu bytes, but %zu are needed", where, b->nbytes,
                 need);
    return -1;
  }
  return 0;
}

/* Fills self->host (a tuple of the Buffers) and self->ptrs from `host`: one Buffer of every
 * expert back to back, key-major, or one Buffer per key. */
static int take_host(tdmpy_state *st, StreamerObject *self, PyObject *host, const char *backend) {
  long keys = nkeys(self);
  if (!(self->ptrs = PyMem_Malloc((size_t)keys * sizeof *self->ptrs))) {
    PyErr_NoMemory();
    return -1;
  }
  if (PyObject_TypeCheck(host, st->buffer_type)) {
    if ((size_t)keys > SIZE_MAX / self->expert_bytes) {
      PyErr_SetString(PyExc_OverflowError, "layers * experts * expert_bytes is too large");
      return -1;
    }
    if (check_host_buffer(st, host, backend, (size_t)keys * self->expert_bytes, -1) < 0)
      return -1;
    if (!(self->host = PyTuple_Pack(1, host))) return -1;
    char *base = ((BufferObject *)host)->ptr;
    for (long k = 0; k < keys; k++) self->ptrs[k] = base + (size_t)k * self->expert_bytes;
  } else if (PySequence_Check(host) && !PyUnicode_Check(host) && !PyBytes_Check(host)) {
    PyObject *t = PySequence_Tuple(host);
    if (!t) return -1;
    self->host = t;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++)
      if (!PyObject_TypeCheck(PyTuple_GET_ITEM(t, i), st->buffer_type)) {
        PyErr_Format(PyExc_TypeError, "host[%zd] must be a tandem.Buffer, not %.100s", i,
                     Py_TYPE(PyTuple_GET_ITEM(t, i))->tp_name);
        return -1;
      }
    if (PyTuple_GET_SIZE(t) != keys) {
      PyErr_Format(PyExc_ValueError, "host holds %zd Buffers, but layers * experts = %ld",
                   PyTuple_GET_SIZE(t), keys);
      return -1;
    }
    for (long k = 0; k < keys; k++) {
      PyObject *b = PyTuple_GET_ITEM(t, k);
      if (check_host_buffer(st, b, backend, self->expert_bytes, k) < 0) return -1;
      self->ptrs[k] = ((BufferObject *)b)->ptr;
    }
  } else {
    PyErr_Format(PyExc_TypeError, "host must be a tandem.Buffer holding every expert, or a "
                 "sequence of one Buffer per expert, not %.100s", Py_TYPE(host)->tp_name);
    return -1;
  }
  /* From here the Buffers' memory stays until close() (Buffer.free() waits for it). */
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->host); i++)
    ((BufferObject *)PyTuple_GET_ITEM(self->host, i))->inflight++;
  self->host_held = 1;
  return 0;
}

/* Gives the host Buffers back: a Buffer freed meanwhile goes now. */
static void drop_host(tdmpy_state *st, StreamerObject *self) {
  if (!self->host) return;
  for (Py_ssize_t i = 0; self->host_held && i < PyTuple_GET_SIZE(self->host); i++) {
    BufferObject *b = (BufferObject *)PyTuple_GET_ITEM(self->host, i);
    if (--b->inflight == 0 && b->released) tdmpy_buffer_free_memory(st, b);
  }
  self->host_held = 0;
  Py_CLEAR(self->host);
}

static PyObject *streamer_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"compute", "layers", "experts", "expert_bytes", "host",
                           "budget_bytes", "staging_slots", "policy", "resident",
                           "prefetch_depth", NULL};
  PyObject *compute, *host, *resident = Py_None;
  int layers, experts, staging = 2, depth = 0;
  Py_ssize_t expert_bytes, budget = 0;
  const char *policy = "static";
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OiinO|$nisOi:Streamer", kwlist, &compute, &layers,
                                   &experts, &expert_bytes, &host, &budget, &staging, &policy,
                                   &resident, &depth))
    return NULL;
  tdmpy_state *st = tdmpy_state_of_type(tp);
  tdm_queue *cq;
  if (tdmpy_check_live(st) < 0 || tdmpy_queue_check(st, compute, &cq) < 0) return NULL;
  if (layers <= 0 || experts <= 0 || expert_bytes <= 0 || budget < 0) {
    PyErr_Format(PyExc_ValueError, "layers (%d), experts (%d) and expert_bytes (%zd) must be "
                 "positive, budget_bytes (%zd) not negative", layers, experts, expert_bytes,
                 budget);
    return NULL;
  }
  if ((long)layers * experts > INT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "layers * experts must fit in an int (keys are ints)");
    return NULL;
  }
  tdm_cache_policy pol;
  if (strcmp(policy, "static") == 0) {
    pol = TDM_CACHE_STATIC;
  } else if (strcmp(policy, "lru") == 0) {
    pol = TDM_CACHE_LRU;
  } else {
    PyErr_Format(PyExc_ValueError, "policy must be \"static\" or \"lru\", not \"%s\"", policy);
    return NULL;
  }
  StreamerObject *self = PyObject_GC_New(StreamerObject, tp);
  if (!self) return NULL;
  self->s = NULL;
  self->compute = NULL;
  self->host = self->queues = NULL;
  self->host_held = 0;
  self->ptrs = NULL;
  self->layers = layers;
  self->experts = experts;
  self->expert_bytes = (size_t)expert_bytes;
  self->pins = NULL;
  self->slot = NULL;
  self->views = NULL;
  self->lingering = NULL;
  self->pinned = self->busy = 0;
  PyObject_GC_Track(self);
  int *res = NULL;
  Py_ssize_t nres = 0;
  long keys = nkeys(self);
  const char *backend = ((DeviceObject *)((QueueObject *)compute)->device)->info.backend;
  if (take_host(st, self, host, backend) < 0) goto fail;
  if (resident != Py_None) {
    if (int_array(resident, "resident must be a sequence of keys (layer * experts + e)", &res,
                  &nres) < 0)
      goto fail;
    for (Py_ssize_t i = 0; i < nres; i++)
      if (res[i] < 0 || res[i] >= keys) {
        PyErr_Format(PyExc_ValueError, "resident: key %d does not exist (0 to %ld)", res[i],
                     keys - 1);
        goto fail;
      }
    if (nres && pol != TDM_CACHE_STATIC) {
      PyErr_SetString(PyExc_ValueError, "resident applies to the \"static\" policy only");
      goto fail;
    }
  }
  self->pins = PyMem_Calloc((size_t)keys, sizeof *self->pins);
  self->slot = PyMem_Calloc((size_t)keys, sizeof *self->slot);
  self->views = PyMem_Calloc((size_t)keys, sizeof *self->views);
  if (!self->pins || !self->slot || !self->views) {
    PyErr_NoMemory();
    goto fail;
  }
  tdm_streamer_config cfg = {.compute = cq, .layers = layers, .experts = experts,
                             .expert_bytes = (size_t)expert_bytes, .host = self->ptrs,
                             .budget_bytes = (size_t)budget, .staging_slots = staging,
                             .policy = pol, .resident = res, .nresident = (int)nres,
                             .prefetch_depth = depth};
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_create(&cfg, &self->s);
  Py_END_ALLOW_THREADS
  PyMem_Free(res);
  res = NULL;
  if (rc < 0) {
    self->s = NULL;
    tdmpy_raise(st, rc);
    goto fail;
  }
  self->compute = Py_NewRef(compute);
  ((QueueObject *)compute)->users++;
  return (PyObject *)self;
fail:
  PyMem_Free(res);
  Py_DECREF(self); /* dealloc gives the host Buffers back */
  return NULL;
}

/* ---- closing ---------------------------------------------------------------------------- */

/* Forgets the ended views that no array exports any more; returns how many are left. */
static Py_ssize_t prune_lingering(StreamerObject *self) {
  if (!self->lingering) return 0;
  Py_ssize_t n = PyList_GET_SIZE(self->lingering);
  for (Py_ssize_t i = n - 1; i >= 0; i--)
    if (((BufferObject *)PyList_GET_ITEM(self->lingering, i))->exports == 0 &&
        PyList_SetSlice(self->lingering, i, i + 1, NULL) < 0)
      PyErr_Clear(); /* cannot fail when shrinking; kept listed if it did */
  n = PyList_GET_SIZE(self->lingering);
  if (n == 0) Py_CLEAR(self->lingering);
  return n;
}

/* Ends the expert's view. An array that still reads the slot keeps the view listed, so that
 * close() can refuse to free the memory under it. */
static void end_view(StreamerObject *self, long key) {
  PyObject *v = self->views[key];
  if (!v) return;
  self->views[key] = NULL;
  tdmpy_buffer_end_view((BufferObject *)v);
  if (((BufferObject *)v)->exports > 0) {
    prune_lingering(self);
    if ((!self->lingering && !(self->lingering = PyList_New(0))) ||
        PyList_Append(self->lingering, v) < 0)
      PyErr_Clear(); /* out of memory: only the refusal is lost */
  }
  Py_DECREF(v);
}

/* Whether any array still views a slot. */
static int views_exported(StreamerObject *self) {
  for (long k = 0; k < nkeys(self); k++)
    if (self->views[k] && ((BufferObject *)self->views[k])->exports > 0) return 1;
  return prune_lingering(self) > 0;
}

/* Destroys the C streamer (waiting for its copies) and lets go of everything it used. force:
 * from dealloc, where experts still acquired cannot be released any more. 0, or -1 with an
 * error set when refused or when destroying failed. */
static int close_now(tdmpy_state *st, StreamerObject *self, int force) {
  if (!self->s) return 0;
  if (!force) {
    if (self->busy > 0) {
      PyErr_SetString(st->errors[-TDM_EBUSY], "close: another thread is in a call on the "
                      "streamer");
      return -1;
    }
    if (self->pinned > 0) {
      PyErr_Format(st->errors[-TDM_EBUSY], "close: %zd experts are still acquired: release "
                   "them first", self->pinned);
      return -1;
    }
    if (views_exported(self)) {
      PyErr_SetString(st->errors[-TDM_EBUSY], "close: arrays that view a slot (slot_view) are "
                      "still alive");
      return -1;
    }
  }
  for (long k = 0; self->views && k < nkeys(self); k++) end_view(self, k);
  tdm_streamer *s = self->s;
  self->s = NULL;
  int rc = 0;
  if (st->live) { /* after tandem's shutdown its handles are gone: nothing left to free */
    Py_BEGIN_ALLOW_THREADS
    rc = tdm_streamer_destroy(s);
    Py_END_ALLOW_THREADS
  }
  if (rc < 0) tdmpy_raise(st, rc);
  for (Py_ssize_t i = 0; self->queues && i < 2; i++)
    ((QueueObject *)PyTuple_GET_ITEM(self->queues, i))->q = NULL; /* destroyed with it */
  drop_host(st, self);
  if (self->compute) {
    ((QueueObject *)self->compute)->users--;
    Py_CLEAR(self->compute);
  }
  self->pinned = 0;
  return rc < 0 ? -1 : 0;
}

static int streamer_traverse(StreamerObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->compute);
  Py_VISIT(self->host);
  Py_VISIT(self->queues);
  for (long k = 0; self->views && k < nkeys(self); k++) Py_VISIT(self->views[k]);
  Py_VISIT(self->lingering);
  return 0;
}

/* A cycle through a slot view: the views go (the streamer is unreachable, so nobody uses
 * them); the streamer itself is closed in dealloc. The queues stay: close() must still end
 * them, since code outside the cycle may hold them. */
static int streamer_clear(StreamerObject *self) {
  for (long k = 0; self->views && k < nkeys(self); k++) end_view(self, k);
  Py_CLEAR(self->lingering);
  return 0;
}

static void streamer_dealloc(StreamerObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  tdmpy_state *st = tdmpy_state_of_type(tp);
  PyObject_GC_UnTrack(self);
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *exc = PyErr_GetRaisedException();
#else
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
#endif
  if (close_now(st, self, 1) < 0) PyErr_WriteUnraisable((PyObject *)self);
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(exc);
#else
  PyErr_Restore(et, ev, tb);
#endif
  drop_host(st, self); /* a creation that failed before the streamer existed */
  streamer_clear(self);
  Py_CLEAR(self->queues);
  PyMem_Free(self->ptrs);
  PyMem_Free(self->pins);
  PyMem_Free(self->slot);
  PyMem_Free(self->views);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

/* ---- acquire and release ---------------------------------------------------------------- */

static PyObject *streamer_acquire(StreamerObject *self, PyObject *args) {
  int layer, e;
  if (!PyArg_ParseTuple(args, "ii:acquire", &layer, &e)) return NULL;
  tdmpy_state *st = sstate(self);
  long key;
  if (usable(st, self) < 0 || (key = key_arg(st, self, layer, e)) < 0) return NULL;
  const void *dptr;
  tdm_event *ready = NULL;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_acquire(self->s, layer, e, &dptr, &ready);
  Py_END_ALLOW_THREADS
  self->busy--;
  if (rc < 0) return tdmpy_raise(st, rc);
  /* Another thread's release may have let the expert leave its slot (and come back to another
   * one) before that thread got the GIL back to end its view: a view of another slot is
   * stale, whatever the counts here say. */
  if (self->views[key] && self->slot[key] != dptr) end_view(self, key);
  self->pins[key]++;
  self->pinned++;
  self->slot[key] = dptr;
  PyObject *ev = tdmpy_event_new(st, ready, NULL, NULL); /* takes the reference */
  if (!ev) return NULL; /* the expert stays acquired: release() still undoes it */
  return Py_BuildValue("(NN)", PyLong_FromVoidPtr((void *)dptr), ev);
}

static PyObject *streamer_release(StreamerObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"layer", "e", "done", NULL};
  int layer, e;
  PyObject *done = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|O:release", kwlist, &layer, &e, &done))
    return NULL;
  tdmpy_state *st = sstate(self);
  long key;
  if (usable(st, self) < 0 || (key = key_arg(st, self, layer, e)) < 0) return NULL;
  tdm_event *ev = NULL;
  int owned = 0;
  if (done != Py_None && tdmpy_event_arg(st, done, sdev(self), &ev, &owned) < 0) return NULL;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_release(self->s, layer, e, ev);
  Py_END_ALLOW_THREADS
  self->busy--;
  if (owned) tdm_event_release(ev); /* the streamer took its own reference */
  if (rc < 0) return tdmpy_raise(st, rc);
  self->pinned--;
  if (--self->pins[key] == 0) end_view(self, key);
  Py_RETURN_NONE;
}

static PyObject *streamer_slot_view(StreamerObject *self, PyObject *args) {
  int layer, e;
  if (!PyArg_ParseTuple(args, "ii:slot_view", &layer, &e)) return NULL;
  tdmpy_state *st = sstate(self);
  long key;
  if (usable(st, self) < 0 || (key = key_arg(st, self, layer, e)) < 0) return NULL;
  if (self->pins[key] <= 0) {
    PyErr_Format(st->errors[-TDM_ESTATE], "slot_view: expert %d of layer %d is not acquired",
                 e, layer);
    return NULL;
  }
  if (!self->views[key]) {
    QueueObject *q = (QueueObject *)self->compute;
    self->views[key] = tdmpy_buffer_view(st, (PyObject *)self, (void *)self->slot[key],
                                         self->expert_bytes, q->device, self->compute);
    if (!self->views[key]) return NULL;
  }
  return Py_NewRef(self->views[key]);
}

/* ---- prefetch and schedule -------------------------------------------------------------- */

static PyObject *streamer_prefetch(StreamerObject *self, PyObject *args) {
  int layer;
  PyObject *seq;
  if (!PyArg_ParseTuple(args, "iO:prefetch", &layer, &seq)) return NULL;
  tdmpy_state *st = sstate(self);
  int *ex;
  Py_ssize_t n;
  if (usable(st, self) < 0 ||
      int_array(seq, "prefetch: experts must be a sequence of ints", &ex, &n) < 0)
    return NULL;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_prefetch(self->s, layer, ex, (int)n);
  Py_END_ALLOW_THREADS
  self->busy--;
  PyMem_Free(ex);
  if (rc < 0) return tdmpy_raise(st, rc);
  Py_RETURN_NONE;
}

static PyObject *streamer_schedule(StreamerObject *self, PyObject *args) {
  int layer;
  PyObject *seq;
  if (!PyArg_ParseTuple(args, "iO:schedule", &layer, &seq)) return NULL;
  tdmpy_state *st = sstate(self);
  int *ex;
  Py_ssize_t n;
  if (usable(st, self) < 0 ||
      int_array(seq, "schedule: experts must be a sequence of ints", &ex, &n) < 0)
    return NULL;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_schedule(self->s, layer, ex, (int)n);
  Py_END_ALLOW_THREADS
  self->busy--;
  if (rc < 0) {
    PyMem_Free(ex);
    return tdmpy_raise(st, rc);
  }
  PyObject *list = PyList_New(n);
  for (Py_ssize_t i = 0; list && i < n; i++) {
    PyObject *v = PyLong_FromLong(ex[i]);
    if (!v) Py_CLEAR(list);
    else PyList_SET_ITEM(list, i, v);
  }
  PyMem_Free(ex);
  return list;
}

/* ---- statistics and queues -------------------------------------------------------------- */

static PyObject *streamer_stats(StreamerObject *self, PyObject *unused) {
  tdmpy_state *st = sstate(self);
  if (usable(st, self) < 0) return NULL;
  tdm_streamer_stats s;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS /* the streamer's lock may be held by a call submitting copies */
  rc = tdm_streamer_stats_get(self->s, &s);
  Py_END_ALLOW_THREADS
  self->busy--;
  if (rc < 0) return tdmpy_raise(st, rc);
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i,s:i,s:n}", "acquires",
      (unsigned long long)s.acquires, "hits", (unsigned long long)s.hits, "misses",
      (unsigned long long)s.misses, "resident_hits", (unsigned long long)s.resident_hits,
      "inflight_hits", (unsigned long long)s.inflight_hits, "prefetches",
      (unsigned long long)s.prefetches, "prefetch_hits", (unsigned long long)s.prefetch_hits,
      "prefetch_dropped", (unsigned long long)s.prefetch_dropped, "bytes_copied",
      (unsigned long long)s.bytes_copied, "resident_slots", s.resident_slots, "staging_slots",
      s.staging_slots, "prefetch_depth", s.prefetch_depth, "device_bytes",
      (Py_ssize_t)s.device_bytes);
}

static PyObject *streamer_reset_stats(StreamerObject *self, PyObject *unused) {
  tdmpy_state *st = sstate(self);
  if (usable(st, self) < 0) return NULL;
  int rc;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_streamer_stats_reset(self->s);
  Py_END_ALLOW_THREADS
  self->busy--;
  if (rc < 0) return tdmpy_raise(st, rc);
  Py_RETURN_NONE;
}

static PyObject *get_queues(StreamerObject *self, void *closure) {
  tdmpy_state *st = sstate(self);
  if (usable(st, self) < 0) return NULL;
  if (self->queues) return Py_NewRef(self->queues);
  tdm_queue *qs[2];
  int rc = tdm_streamer_queues(self->s, &qs[0], &qs[1]);
  if (rc < 0) return tdmpy_raise(st, rc);
  PyObject *device = ((QueueObject *)self->compute)->device;
  PyObject *d = tdmpy_queue_wrap(st, qs[0], device, TDM_QUEUE_IN_ORDER, 0, NULL);
  PyObject *p = d ? tdmpy_queue_wrap(st, qs[1], device, TDM_QUEUE_IN_ORDER, 0, NULL) : NULL;
  if (!p) {
    Py_XDECREF(d);
    return NULL;
  }
  ((QueueObject *)d)->owner = "a Streamer's demand copy queue";
  ((QueueObject *)p)->owner = "a Streamer's prefetch copy queue";
  if (!(self->queues = PyTuple_Pack(2, d, p))) {
    Py_DECREF(d);
    Py_DECREF(p);
    return NULL;
  }
  Py_DECREF(d);
  Py_DECREF(p);
  return Py_NewRef(self->queues);
}

static PyObject *get_compute(StreamerObject *self, void *closure) {
  return Py_NewRef(self->compute ? self->compute : Py_None);
}

static PyObject *get_closed(StreamerObject *self, void *closure) {
  return PyBool_FromLong(self->s == NULL);
}

static PyObject *get_int(StreamerObject *self, void *which) {
  if (which == (void *)0) return PyLong_FromLong(self->layers);
  if (which == (void *)1) return PyLong_FromLong(self->experts);
  if (which == (void *)2) return PyLong_FromSize_t(self->expert_bytes);
  return PyLong_FromSsize_t(self->pinned);
}

/* ---- closing, from Python --------------------------------------------------------------- */

static PyObject *streamer_close(StreamerObject *self, PyObject *unused) {
  if (close_now(sstate(self), self, 0) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *streamer_enter(StreamerObject *self, PyObject *unused) {
  if (usable(sstate(self), self) < 0) return NULL;
  return Py_NewRef(self);
}

static PyObject *streamer_exit(StreamerObject *self, PyObject *args) {
  if (close_now(sstate(self), self, 0) < 0) return NULL;
  Py_RETURN_FALSE;
}

static PyObject *streamer_repr(StreamerObject *self) {
  return PyUnicode_FromFormat("<tandem.Streamer %d layers x %d experts of %zu bytes%s>",
                              self->layers, self->experts, self->expert_bytes,
                              self->s ? "" : ", closed");
}

static PyMethodDef streamer_methods[] = {
    {"acquire", (PyCFunction)streamer_acquire, METH_VARARGS,
     "acquire(layer, e) -> (int, Event)\n--\n\n"
     "Makes expert e of layer available on the device: returns the device pointer of its slot\n"
     "(a tandem pointer: on OpenCL not an address; slot_view() gives a Buffer of it) and the\n"
     "Event of the copy into it. The pointer is valid for work submitted to the compute queue\n"
     "after this call (the compute queue waits for the copy on the device; this call never\n"
     "waits) until release(). Every slot acquired: BusyError."},
    {"release", (PyCFunction)(void (*)(void))streamer_release, METH_VARARGS | METH_KEYWORDS,
     "release(layer, e, done=None) -> None\n--\n\n"
     "Unpins the expert: its slot may be overwritten once done completes. done: a tandem\n"
     "Event, a torch.cuda.Event, cupy.cuda.Event or pyopencl.Event, or None for all work\n"
     "submitted to the compute queue so far. Ends the expert's slot view once it is released\n"
     "as often as it was acquired. Not acquired: StateError."},
    {"slot_view", (PyCFunction)streamer_slot_view, METH_VARARGS,
     "slot_view(layer, e) -> Buffer\n--\n\n"
     "The acquired expert's slot as a device Buffer of expert_bytes (its queue the compute\n"
     "queue): Queue.copy and Queue.fill take it, the buffer protocol on devices whose memory\n"
     "is host memory (cpu), __cuda_array_interface__ and DLPack on CUDA. The same object\n"
     "until the expert is released; then (and at close) it ends, and using it raises. Not\n"
     "acquired: StateError."},
    {"prefetch", (PyCFunction)streamer_prefetch, METH_VARARGS,
     "prefetch(layer, experts) -> None\n--\n\n"
     "Starts copying the listed experts of layer that are not on the device, on the prefetch\n"
     "queue, up to prefetch_depth in flight; the rest are dropped (stats()['prefetch_dropped'])."},
    {"schedule", (PyCFunction)streamer_schedule, METH_VARARGS,
     "schedule(layer, experts) -> list[int]\n--\n\n"
     "The experts in the order to compute them so that compute keeps busy while copies land:\n"
     "staged ones first, then the rest with resident ones spread in front of them. A new\n"
     "list, a permutation of experts; the order changes speed, never results."},
    {"stats", (PyCFunction)streamer_stats, METH_NOARGS,
     "stats() -> dict\n--\n\n"
     "The counters since creation or reset_stats(): acquires = hits + misses; hits =\n"
     "resident_hits (on the device, copy complete) + inflight_hits (covered by a copy still in\n"
     "flight); misses (demand copies); prefetches, prefetch_hits, prefetch_dropped;\n"
     "bytes_copied; and the configuration: resident_slots, staging_slots, prefetch_depth,\n"
     "device_bytes."},
    {"reset_stats", (PyCFunction)streamer_reset_stats, METH_NOARGS,
     "reset_stats() -> None\n--\n\nZeroes the counters (not the slots)."},
    {"close", (PyCFunction)streamer_close, METH_NOARGS,
     "close() -> None\n--\n\n"
     "Waits for the streamer's copies (without the GIL) and frees its slots, in the compute\n"
     "queue's order; the host Buffers and the compute queue are let go. Refused (BusyError)\n"
     "while experts are acquired or arrays view a slot. Again: nothing. Also done when the\n"
     "object is collected. Every other method raises StateError afterwards."},
    {"__enter__", (PyCFunction)streamer_enter, METH_NOARGS, "Returns the streamer."},
    {"__exit__", (PyCFunction)streamer_exit, METH_VARARGS, "close()."},
    {NULL},
};

static PyGetSetDef streamer_getset[] = {
    {"queues", (getter)get_queues, NULL,
     "(demand, prefetch): the streamer's copy queues, as Queues it owns: work may be ordered\n"
     "against them (wait, host_task); destroy() is refused, and they stop working at close.",
     NULL},
    {"compute", (getter)get_compute, NULL, "The compute Queue (None once closed).", NULL},
    {"closed", (getter)get_closed, NULL, "True once close() has run.", NULL},
    {"layers", (getter)get_int, NULL, "The number of layers.", (void *)0},
    {"experts", (getter)get_int, NULL, "Experts per layer.", (void *)1},
    {"expert_bytes", (getter)get_int, NULL, "Bytes of one expert.", (void *)2},
    {"acquired", (getter)get_int, NULL, "Experts acquired and not yet released.", (void *)3},
    {NULL},
};

static PyType_Slot streamer_slots[] = {
    {Py_tp_new, streamer_new},
    {Py_tp_dealloc, streamer_dealloc},
    {Py_tp_traverse, streamer_traverse},
    {Py_tp_clear, streamer_clear},
    {Py_tp_repr, streamer_repr},
    {Py_tp_methods, streamer_methods},
    {Py_tp_getset, streamer_getset},
    {Py_tp_doc,
     "Streamer(compute, layers, experts, expert_bytes, host, *, budget_bytes=0,\n"
     "         staging_slots=2, policy=\"static\", resident=None, prefetch_depth=0)\n--\n\n"
     "The expert streamer: keeps a Mixture-of-Experts model's experts in host memory and\n"
     "copies those acquired or prefetched into device slots, on copy queues of its own, while\n"
     "the compute queue works. Expert e of layer l has the key l * experts + e.\n\n"
     "compute: the Queue that reads the experts (in-order or not; e.g. one adopted from\n"
     "  torch.cuda.current_stream()); its device holds the slots.\n"
     "host: one Buffer holding every expert back to back, key-major (expert k at\n"
     "  k * expert_bytes), or a sequence of layers * experts Buffers of at least expert_bytes\n"
     "  each; pinned memory (\"host\" memory too on CPU and OpenCL devices). The streamer\n"
     "  keeps them until close() (Buffer.free() waits for it).\n"
     "budget_bytes: device memory for experts that may stay resident between uses, besides\n"
     "  staging_slots slots that always exist (a budget of 0 streams through them).\n"
     "policy: \"static\" (a fixed resident set: resident, a sequence of keys, best first, or\n"
     "  key order) or \"lru\" (every slot one least-recently-used cache).\n"
     "prefetch_depth: prefetch copies in flight at most (0: staging_slots).\n\n"
     "Thread safe as the C API: an acquire and its release may come from different threads.\n"
     "The GIL is released around every call into the streamer."},
    {0, NULL},
};

PyType_Spec tdmpy_streamer_spec = {
    .name = "tandem.Streamer",
    .basicsize = sizeof(StreamerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = streamer_slots,
};
