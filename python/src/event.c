/* event.c: tandem.Event, and the conversion of foreign events (CuPy, PyTorch, pyopencl, dpctl)
 * into tandem events wherever an event is taken.
 *
 * An Event owns exactly one caller reference of its tandem event (released in dealloc; release
 * never blocks). An Event made by host_task shares a one-slot list with the task: the
 * exception the task raised, which .error returns and wait() re-raises.
 */
#include "tdmpy.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

PyObject *tdmpy_event_new(tdmpy_state *st, tdm_event *ev, PyObject *cell, PyObject *foreign) {
  EventObject *self = PyObject_GC_New(EventObject, st->event_type);
  if (!self) {
    tdm_event_release(ev);
    return NULL;
  }
  self->ev = ev;
  self->cell = Py_XNewRef(cell);
  self->errors = NULL;
  self->foreign = Py_XNewRef(foreign);
  PyObject_GC_Track(self);
  return (PyObject *)self;
}

static int event_traverse(EventObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->cell);
  Py_VISIT(self->errors);
  Py_VISIT(self->foreign);
  return 0;
}

static int event_clear(EventObject *self) {
  if (self->cell && PyList_GET_SIZE(self->cell) > 0)
    tdmpy_task_error_unheld(self->errors, PyList_GET_ITEM(self->cell, 0));
  Py_CLEAR(self->cell);
  Py_CLEAR(self->errors);
  Py_CLEAR(self->foreign);
  return 0;
}

static void event_dealloc(EventObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  tdmpy_state *st = tdmpy_state_of_type(tp);
  PyObject_GC_UnTrack(self);
  if (self->ev && st->live) tdm_event_release(self->ev);
  event_clear(self);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *event_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  PyErr_SetString(PyExc_TypeError, "events come from Queue.record(), Queue.copy() and other "
                  "submissions, or Event.from_native(); they cannot be made directly");
  return NULL;
}

/* The exception the event's work failed with (a new reference), or NULL with none set when
 * it succeeded or is pending. */
static PyObject *event_exception(tdmpy_state *st, EventObject *self, int status) {
  if (status >= 0 || status == TDM_EAGAIN) return NULL;
  if (self->cell && PyList_GET_SIZE(self->cell) > 0)
    return Py_NewRef(PyList_GET_ITEM(self->cell, 0));
  PyObject *cls = -status <= TDMPY_NERRORS ? st->errors[-status] : st->error;
  PyObject *exc = PyObject_CallFunction(cls, "s", tdm_strerror(status));
  if (exc) {
    PyObject *code = PyLong_FromLong(status), *name = PyUnicode_FromString(tdm_err_name(status));
    if (code && name) {
      PyObject_SetAttrString(exc, "code", code);
      PyObject_SetAttrString(exc, "name", name);
    }
    Py_XDECREF(code);
    Py_XDECREF(name);
  }
  return exc;
}

/* Codes that say the query or wait itself failed (a forked child, a stale handle, a wait
 * from the event's own host task, tandem shut down), not the status of the event's work. */
static int call_failed(int rc) {
  return rc == TDM_EHANDLE || rc == TDM_EDEADLK || rc == TDM_EFORK || rc == TDM_ENOTINIT;
}

static int event_status(tdmpy_state *st, EventObject *self, int blocking) {
  if (tdmpy_check_live(st) < 0) return INT_MIN;
  int rc;
  if (!blocking) return tdm_event_query(self->ev);
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_event_wait(self->ev);
  Py_END_ALLOW_THREADS
  return rc;
}

static PyObject *event_wait(EventObject *self, PyObject *unused) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  int rc = event_status(st, self, 1);
  if (rc == INT_MIN) return NULL;
  if (call_failed(rc)) return tdmpy_raise(st, rc);
  if (rc < 0) {
    PyObject *exc = event_exception(st, self, rc);
    if (exc) {
      PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
      Py_DECREF(exc);
    }
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *get_done(EventObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  int rc = event_status(st, self, 0);
  if (rc == INT_MIN) return NULL;
  if (call_failed(rc)) return tdmpy_raise(st, rc);
  return PyBool_FromLong(rc != TDM_EAGAIN);
}

static PyObject *get_error(EventObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  int rc = event_status(st, self, 0);
  if (rc == INT_MIN) return NULL;
  if (call_failed(rc)) return tdmpy_raise(st, rc);
  PyObject *exc = event_exception(st, self, rc);
  if (!exc && !PyErr_Occurred()) Py_RETURN_NONE;
  return exc;
}

static PyObject *get_native(EventObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (tdmpy_check_live(st) < 0) return NULL;
  void *native;
  int rc = tdm_event_native(self->ev, &native);
  if (rc == TDM_ENOTSUP) Py_RETURN_NONE;
  if (rc < 0) return tdmpy_raise(st, rc);
  return PyLong_FromVoidPtr(native);
}

/* A dpctl.SyclEvent: the one the event was imported from, else one over its native sycl::event
 * (a copy of the handle: it stays valid after the Event is gone). */
static PyObject *event_to_dpctl(EventObject *self, PyObject *unused) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (self->foreign) {
    PyObject *cap;
    void *native;
    int r = tdmpy_dpctl_capsule(self->foreign, "SyclEventRef", &cap, &native);
    if (r < 0) return NULL;
    if (r) {
      /* A bare capsule stays its owner's (unconsumed): dpctl copies the event out of a new
       * one over the same pointer, which self->foreign keeps valid. */
      PyObject *ev = cap == self->foreign ? tdmpy_dpctl_new("SyclEvent", "SyclEventRef", native)
                                          : Py_NewRef(self->foreign);
      Py_DECREF(cap);
      return ev;
    }
  }
  return tdmpy_dpctl_event(st, self->ev);
}

static PyObject *get_handle(EventObject *self, void *closure) {
  return PyLong_FromVoidPtr(self->ev);
}

static PyObject *event_elapsed(EventObject *self, PyObject *other) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (tdmpy_check_live(st) < 0) return NULL;
  if (!PyObject_TypeCheck(other, st->event_type)) {
    PyErr_Format(PyExc_TypeError, "elapsed() takes a tandem.Event, not %.100s",
                 Py_TYPE(other)->tp_name);
    return NULL;
  }
  double ms;
  int rc = tdm_event_elapsed(self->ev, ((EventObject *)other)->ev, &ms);
  if (rc < 0) return tdmpy_raise(st, rc);
  return PyFloat_FromDouble(ms);
}

/* ---- foreign events --------------------------------------------------------------------- */

/* A dpctl.SyclEvent (or its "SyclEventRef" capsule): imported on a SYCL device; tandem keeps
 * a copy of the sycl::event, so the capsule goes at once. 1 when obj is one, 0 when not, -1 on
 * error. */
static int sycl_event_arg(tdmpy_state *st, PyObject *obj, tdm_device *dev, tdm_event **out) {
  PyObject *cap;
  void *native;
  int r = tdmpy_dpctl_capsule(obj, "SyclEventRef", &cap, &native);
  if (r <= 0) return r;
#ifdef TDMPY_HAVE_EVENT_IMPORT
  PyObject *d = tdmpy_sycl_import_device(st, dev); /* borrowed */
  int rc = d ? tdm_event_import(((DeviceObject *)d)->dev, native, out) : 0;
  if (rc < 0) tdmpy_raise(st, rc);
  Py_DECREF(cap);
  return d && rc == 0 ? 1 : -1;
#else
  Py_DECREF(cap);
  PyErr_SetString(st->errors[-TDM_ENOTSUP], "importing a dpctl.SyclEvent needs "
                  "tdm_event_import, which this build of tandem lacks");
  return -1;
#endif
}

/* The native handle of a foreign event: pyopencl.Event (.int_ptr), cupy.cuda.Event (.ptr),
 * torch.cuda.Event (.cuda_event), or an integer. -1 with an error set if obj is none of them. */
static int foreign_handle(PyObject *obj, void **native) {
  static const char *attrs[] = {"int_ptr", "ptr", "cuda_event", NULL};
  PyObject *h = NULL;
  if (PyLong_Check(obj)) {
    h = Py_NewRef(obj);
  } else {
    for (int i = 0; attrs[i] && !h; i++)
      if (tdmpy_getattr_opt(obj, attrs[i], &h) < 0) return -1;
  }
  if (!h || !PyLong_Check(h)) {
    Py_XDECREF(h);
    PyErr_Format(PyExc_TypeError, "expected a tandem.Event or an event of CuPy, PyTorch, "
                 "pyopencl or dpctl, not %.100s", Py_TYPE(obj)->tp_name);
    return -1;
  }
  *native = PyLong_AsVoidPtr(h);
  Py_DECREF(h);
  if (PyErr_Occurred()) return -1;
  if (!*native) {
    PyErr_SetString(PyExc_ValueError, "the foreign event's native handle is NULL (an event "
                    "that was never created or recorded)");
    return -1;
  }
  return 0;
}

int tdmpy_event_arg(tdmpy_state *st, PyObject *obj, tdm_device *dev, tdm_event **out,
                    int *owned) {
  if (PyObject_TypeCheck(obj, st->event_type)) {
    *out = ((EventObject *)obj)->ev;
    *owned = 0;
    return 0;
  }
  int r = sycl_event_arg(st, obj, dev, out);
  if (r != 0) {
    *owned = 1;
    return r < 0 ? -1 : 0;
  }
  void *native;
  if (foreign_handle(obj, &native) < 0) return -1;
#ifdef TDMPY_HAVE_EVENT_IMPORT
  /* A pyopencl event names its context: import it on the OpenCL device of that context. */
  PyObject *ctx, *ctx_ptr = NULL;
  r = tdmpy_getattr_opt(obj, "context", &ctx);
  if (r < 0) return -1;
  if (r) {
    r = tdmpy_getattr_opt(ctx, "int_ptr", &ctx_ptr);
    Py_DECREF(ctx);
    if (r < 0) return -1;
  }
  if (ctx_ptr) {
    void *want = PyLong_AsVoidPtr(ctx_ptr);
    Py_DECREF(ctx_ptr);
    if (PyErr_Occurred()) return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->devices); i++) {
      DeviceObject *d = (DeviceObject *)PyTuple_GET_ITEM(st->devices, i);
      void *have;
      if (strcmp(d->info.backend, "opencl") == 0 && tdm_device_native(d->dev, &have) == 0 &&
          have == want)
        dev = d->dev;
    }
  }
  int rc = tdm_event_import(dev, native, out);
  if (rc < 0) return tdmpy_raise(st, rc), -1;
  *owned = 1;
  return 0;
#else
  PyErr_Format(st->errors[-TDM_ENOTSUP],
               "importing a foreign event (%.100s) needs tdm_event_import, which this build "
               "of tandem lacks", Py_TYPE(obj)->tp_name);
  return -1;
#endif
}

int tdmpy_deps_get(tdmpy_state *st, PyObject *seq, tdm_device *dev, tdmpy_deps *d) {
  d->n = 0;
  d->ev = NULL;
  d->owned = NULL;
  if (!seq || seq == Py_None) return 0;
  PyObject *fast = PySequence_Fast(seq, "deps must be a sequence of events");
  if (!fast) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  if (n == 0) {
    Py_DECREF(fast);
    return 0;
  }
  d->ev = PyMem_Malloc(n * sizeof *d->ev);
  d->owned = PyMem_Malloc(n);
  if (!d->ev || !d->owned) {
    Py_DECREF(fast);
    tdmpy_deps_free(d);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    int owned;
    if (tdmpy_event_arg(st, PySequence_Fast_GET_ITEM(fast, i), dev, &d->ev[i], &owned) < 0) {
      Py_DECREF(fast);
      tdmpy_deps_free(d);
      return -1;
    }
    d->owned[i] = (unsigned char)owned;
    d->n++;
  }
  Py_DECREF(fast);
  return 0;
}

void tdmpy_deps_free(tdmpy_deps *d) {
  for (size_t i = 0; i < d->n; i++)
    if (d->owned[i]) tdm_event_release(d->ev[i]);
  PyMem_Free(d->ev);
  PyMem_Free(d->owned);
  d->n = 0;
  d->ev = NULL;
  d->owned = NULL;
}

static PyObject *event_from_native(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"event", "device", NULL};
  PyObject *obj, *device = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:from_native", kwlist, &obj, &device))
    return NULL;
  tdmpy_state *st = tdmpy_state_of_type(tp);
  if (tdmpy_check_live(st) < 0 || !(device = tdmpy_device_arg(st, device))) return NULL;
  if (PyObject_TypeCheck(obj, st->event_type)) return Py_NewRef(obj);
  tdm_event *ev;
  int owned;
  if (tdmpy_event_arg(st, obj, ((DeviceObject *)device)->dev, &ev, &owned) < 0) return NULL;
  return tdmpy_event_new(st, ev, NULL, obj);
}

static PyMethodDef event_methods[] = {
    {"wait", (PyCFunction)event_wait, METH_NOARGS,
     "wait() -> None\n--\n\nBlocks (without the GIL) until the event completes; raises the\n"
     "error its work failed with (a host task's own exception, else a TandemError)."},
    {"elapsed", (PyCFunction)event_elapsed, METH_O,
     "elapsed(other) -> float\n--\n\nMilliseconds from this event to other; both completed and\n"
     "recorded on timing queues of one device (Queue(timing=True))."},
    {"from_native", (PyCFunction)(void (*)(void))event_from_native,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "from_native(event, device=None) -> Event\n--\n\n"
     "A tandem event for a foreign one: cupy.cuda.Event, torch.cuda.Event, pyopencl.Event,\n"
     "dpctl.SyclEvent (imported on a SYCL device: device's, else the first), or a raw\n"
     "cudaEvent_t / cl_event integer, of device (None: the default device)."},
    {"to_dpctl", (PyCFunction)event_to_dpctl, METH_NOARGS,
     "to_dpctl() -> dpctl.SyclEvent\n--\n\n"
     "The event as a dpctl.SyclEvent, for dpctl's and dpnp's dependency lists (events of SYCL\n"
     "queues, and events imported from a SyclEvent: that one is returned). Needs dpctl."},
    {NULL},
};

static PyGetSetDef event_getset[] = {
    {"done", (getter)get_done, NULL,
     "True once the event has completed (with or without error). Raises when its state cannot\n"
     "be known (ForkError in a forked child, HandleError), as wait() does.", NULL},
    {"error", (getter)get_error, NULL,
     "None while pending or after success; else the exception its work failed with. Raises\n"
     "when the event's state cannot be known (ForkError in a forked child), as wait() does.",
     NULL},
    {"native", (getter)get_native, NULL,
     "The native event (cudaEvent_t, cl_event, sycl::event *) as an integer, or None (CPU\n"
     "events).", NULL},
    {"handle", (getter)get_handle, NULL, "tandem's handle value, for identification.", NULL},
    {NULL},
};

static PyType_Slot event_slots[] = {
    {Py_tp_new, event_new},
    {Py_tp_dealloc, event_dealloc},
    {Py_tp_traverse, event_traverse},
    {Py_tp_clear, event_clear},
    {Py_tp_methods, event_methods},
    {Py_tp_getset, event_getset},
    {Py_tp_doc, "An event: completes when the work it marks has completed, and carries that\n"
                "work's status. Returned by Queue.record() and every submission."},
    {0, NULL},
};

PyType_Spec tdmpy_event_spec = {
    .name = "tandem.Event",
    .basicsize = sizeof(EventObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = event_slots,
};
