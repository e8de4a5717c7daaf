/* queue.c: tandem.Queue: creation and adoption, submissions (copy, fill, host tasks,
 * keep-alive, record, device-side wait, barrier), synchronize, `with q:`, and the interop
 * protocols (__cuda_stream__, the OpenCL handles, dpctl queues on SYCL devices).
 *
 * A Python host task runs on a tandem thread, which takes the GIL (PyGILState_Ensure) only to
 * run it; tandem calls it without holding any of its locks. Its references are dropped by a
 * keep-alive after it, so they go even when the task never runs (a failed dependency).
 */
#include "tdmpy.h"

#include <stdio.h>
#include <string.h>

#include "structmember.h"

static tdmpy_state *qstate(QueueObject *self) { return tdmpy_state_of_type(Py_TYPE(self)); }

static const char *backend_of(QueueObject *self) {
  return ((DeviceObject *)self->device)->info.backend;
}

static tdm_device *qdev(QueueObject *self) { return ((DeviceObject *)self->device)->dev; }

/* 0 if the queue can be used, else -1 with an error set. */
static int usable(tdmpy_state *st, QueueObject *self) {
  if (tdmpy_check_live(st) < 0) return -1;
  if (!self->q) {
    PyErr_SetString(st->errors[-TDM_EHANDLE], "the queue was destroyed");
    return -1;
  }
  return 0;
}

int tdmpy_queue_check(tdmpy_state *st, PyObject *obj, tdm_queue **out) {
  if (!PyObject_TypeCheck(obj, st->queue_type)) {
    PyErr_Format(PyExc_TypeError, "expected a tandem.Queue, not %.100s", Py_TYPE(obj)->tp_name);
    return -1;
  }
  if (usable(st, (QueueObject *)obj) < 0) return -1;
  *out = ((QueueObject *)obj)->q;
  return 0;
}

PyObject *tdmpy_queue_wrap(tdmpy_state *st, tdm_queue *q, PyObject *device, unsigned flags,
                           int owned, PyObject *adopted) {
  QueueObject *self = PyObject_GC_New(QueueObject, st->queue_type);
  if (!self) {
    if (owned) tdm_queue_destroy(q);
    return NULL;
  }
  self->q = q;
  self->device = Py_NewRef(device);
  self->flags = flags;
  self->owned = owned;
  self->owner = owned ? NULL : "tandem's default";
  self->users = 0;
  self->adopted = Py_XNewRef(adopted);
  self->weakreflist = NULL;
  self->errors = PyList_New(0);
  PyObject_GC_Track(self);
  if (!self->errors) {
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static unsigned make_flags(int in_order, int timing) {
  return (in_order ? TDM_QUEUE_IN_ORDER : TDM_QUEUE_OUT_OF_ORDER) | (timing ? TDM_QUEUE_TIMING : 0);
}

static PyObject *queue_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"device", "in_order", "timing", NULL};
  PyObject *device = Py_None;
  int in_order = 1, timing = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|Opp:Queue", kwlist, &device, &in_order, &timing))
    return NULL;
  tdmpy_state *st = tdmpy_state_of_type(tp);
  if (tdmpy_check_live(st) < 0 || !(device = tdmpy_device_arg(st, device))) return NULL;
  unsigned flags = make_flags(in_order, timing);
  tdm_queue *q;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_queue_create(((DeviceObject *)device)->dev, flags, &q);
  Py_END_ALLOW_THREADS
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_queue_wrap(st, q, device, flags, 1, NULL);
}

/* Destroys the tandem queue (draining it) if this object owns it: 0, or tdm_queue_destroy's
 * error with its message in why (size bytes, may be NULL). Other threads see the object
 * destroyed while the queue drains. A failure may have destroyed the queue (an error it had
 * not reported) or not (refused: from one of its own host tasks, TDM_EDEADLK; a drain that
 * could not be submitted; in a forked child): tandem is asked which, and a queue not gone
 * stays the object's, usable and destroyable later. */
static int destroy_now(tdmpy_state *st, QueueObject *self, char *why, size_t size) {
  tdm_queue *q = self->q;
  self->q = NULL;
  if (!q || !self->owned || !st->live) return 0;
  int rc, live = 0;
  unsigned flags;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_queue_destroy(q);
  if (rc < 0) {
    if (why) snprintf(why, size, "%s", tdm_last_error());
    /* A destroyed queue's handle stays invalid; any other answer (a forked child's) is no
     * sign that it went. */
    live = tdm_queue_flags(q, &flags) != TDM_EHANDLE;
  }
  Py_END_ALLOW_THREADS
  if (live) self->q = q;
  return rc;
}

static int queue_traverse(QueueObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->device);
  Py_VISIT(self->adopted);
  Py_VISIT(self->errors);
  return 0;
}

static int queue_clear(QueueObject *self) {
  Py_CLEAR(self->errors);
  return 0;
}

static void queue_dealloc(QueueObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
  /* Its error has no one to go to; a refused destroy (the last reference dropped by one of
   * the queue's own host tasks) leaves the queue to tdm_shutdown. */
  destroy_now(tdmpy_state_of_type(tp), self, NULL, 0);
  Py_CLEAR(self->adopted); /* after the wrapper is gone */
  Py_CLEAR(self->device);
  queue_clear(self);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *queue_destroy(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (!self->q) Py_RETURN_NONE;
  if (!self->owned) {
    PyErr_Format(st->errors[-TDM_EBUSY], "the queue is %s: it cannot be destroyed here",
                 self->owner);
    return NULL;
  }
  if (self->users > 0) {
    PyErr_Format(st->errors[-TDM_EBUSY], "%zd Streamers or MoeOps use the queue: close them "
                 "first", self->users);
    return NULL;
  }
  char why[512];
  int rc = destroy_now(st, self, why, sizeof why);
  if (self->q) return tdmpy_raise_msg(st, rc, why); /* refused: nothing changed */
  /* Destroyed, with or without an error: forget it as a default (tandem has too). */
  if (tdmpy_uninstall(st, (PyObject *)self) < 0) return NULL;
  Py_CLEAR(self->adopted);
  if (rc < 0) return tdmpy_raise_msg(st, rc, why);
  Py_RETURN_NONE;
}

/* ---- errors of host tasks --------------------------------------------------------------- */

/* The exception being raised, normalized, with its traceback: a new reference. */
static PyObject *fetch_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb && value) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
#endif
}

static void raise_exception(PyObject *exc) {
  PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
}

/* A failed task's exception is kept where the documented API needs it, and nowhere else: by
 * its Event while the program holds that (Event.error, wait(): with the traceback's frames and
 * their local variables), and by the queue when it is the queue's first unreported error (for
 * synchronize()). The queue's list holds at most one entry, (exception, traceback at the
 * failure), so errors handled per event do not pile up until a synchronize(). Once no Event
 * can show it, the queue keeps the exception with that first traceback (not the frames that
 * raising it again from wait() added) and with its frames cleared. */

/* Clears the frames of tb and of the exceptions chained to exc (traceback.clear_frames): their
 * local variables go, the traceback still prints. A frame still running is left. Keeps the
 * exception being raised, if any. */
static void clear_frames(PyObject *exc, PyObject *tb) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *saved = PyErr_GetRaisedException();
#else
  PyObject *saved_type, *saved, *saved_tb;
  PyErr_Fetch(&saved_type, &saved, &saved_tb);
#endif
  Py_XINCREF(tb);
  Py_XINCREF(exc);
  /* The chain is walked a bounded number of links: it may loop. */
  for (int link = 0; link < 64 && (tb || exc); link++) {
    while (tb && tb != Py_None) {
      PyObject *frame = PyObject_GetAttrString(tb, "tb_frame");
      PyObject *r = frame ? PyObject_CallMethod(frame, "clear", NULL) : NULL;
      Py_XDECREF(r);
      Py_XDECREF(frame);
      PyErr_Clear(); /* RuntimeError: a frame still running */
      PyObject *next = PyObject_GetAttrString(tb, "tb_next");
      PyErr_Clear();
      Py_SETREF(tb, next);
    }
    Py_CLEAR(tb);
    PyObject *next = exc ? PyException_GetCause(exc) : NULL;
    if (!next && exc) next = PyException_GetContext(exc);
    Py_XSETREF(exc, next);
    if (exc) tb = PyException_GetTraceback(exc);
  }
  Py_XDECREF(tb);
  Py_XDECREF(exc);
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(saved);
#else
  PyErr_Restore(saved_type, saved, saved_tb);
#endif
}

void tdmpy_task_error_unheld(PyObject *errors, PyObject *exc) {
  if (!errors || PyList_GET_SIZE(errors) == 0) return;
  PyObject *entry = PyList_GET_ITEM(errors, 0); /* borrowed: (exception, traceback) */
  if (PyTuple_GET_ITEM(entry, 0) != exc) return;
  PyObject *tb = PyTuple_GET_ITEM(entry, 1);
  PyException_SetTraceback(exc, tb); /* cannot fail: tb is a traceback or None */
  clear_frames(exc, tb);
}

static PyObject *queue_synchronize(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0) return NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_queue_sync(self->q);
  Py_END_ALLOW_THREADS
  if (rc >= 0) {
    if (PyList_SetSlice(self->errors, 0, PyList_GET_SIZE(self->errors), NULL) < 0) return NULL;
    Py_RETURN_NONE;
  }
  if (rc == TDM_EDEADLK || rc == TDM_EHANDLE || rc == TDM_ENOTINIT || rc == TDM_EFORK ||
      PyList_GET_SIZE(self->errors) == 0)
    return tdmpy_raise(st, rc);
  PyObject *first = Py_NewRef(PyTuple_GET_ITEM(PyList_GET_ITEM(self->errors, 0), 0));
  if (PyList_SetSlice(self->errors, 0, PyList_GET_SIZE(self->errors), NULL) < 0) {
    Py_DECREF(first);
    return NULL;
  }
  if (rc == TDM_ETASK) {
    raise_exception(first); /* the host task's own exception */
  } else {
    tdmpy_raise(st, rc);
    PyObject *exc = fetch_exception();
    if (exc) {
      PyException_SetCause(exc, Py_NewRef(first));
      raise_exception(exc);
      Py_DECREF(exc);
    }
  }
  Py_DECREF(first);
  return NULL;
}

/* ---- host tasks ------------------------------------------------------------------------- */

typedef struct {
  PyObject *fn;     /* owned */
  PyObject *args;   /* owned tuple */
  PyObject *errors; /* owned until the task has run: the queue's list */
  PyObject *cell;   /* owned until the task has run: the Event's list, which no one else
                       holds (its reference count tells whether the Event still exists) */
} host_call;

/* The exception fn raised goes to its Event, if the program still holds that, and to the
 * queue, if the queue has no unreported error yet; see tdmpy_task_error_unheld. */
static int keep_error(host_call *c, PyObject *exc) {
  int event_held = Py_REFCNT(c->cell) > 1;
  if (event_held && PyList_Append(c->cell, exc) < 0) return -1;
  if (PyList_GET_SIZE(c->errors) > 0) return 0;
  PyObject *tb = PyException_GetTraceback(exc);
  PyObject *entry = PyTuple_Pack(2, exc, tb ? tb : Py_None);
  Py_XDECREF(tb);
  int rc = entry ? PyList_Append(c->errors, entry) : -1;
  Py_XDECREF(entry);
  if (rc == 0 && !event_held) tdmpy_task_error_unheld(c->errors, exc);
  return rc;
}

/* Runs on a tandem thread, without tandem locks held. */
static int host_call_run(void *arg) {
  host_call *c = arg;
  if (atomic_load(&tdmpy_python_gone)) return TDM_ETASK;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = 0;
  PyObject *r = PyObject_Call(c->fn, c->args, NULL);
  if (r) {
    Py_DECREF(r);
  } else {
    PyObject *exc = fetch_exception();
    if (exc) {
      if (keep_error(c, exc) < 0) PyErr_WriteUnraisable(c->fn);
      Py_DECREF(exc);
    }
    rc = TDM_ETASK;
  }
  /* Done with them: the Event, alone, now decides how long its exception lives. */
  Py_CLEAR(c->cell);
  Py_CLEAR(c->errors);
  PyGILState_Release(g);
  return rc;
}

/* The keep-alive after the task: drops its references on tandem's release thread. */
static void host_call_free(void *arg) {
  host_call *c = arg;
  if (atomic_load(&tdmpy_python_gone)) return; /* after shutdown: leak, never run Python */
  PyGILState_STATE g = PyGILState_Ensure();
  Py_DECREF(c->fn);
  Py_DECREF(c->args);
  Py_XDECREF(c->errors);
  Py_XDECREF(c->cell);
  PyMem_RawFree(c);
  PyGILState_Release(g);
}

static PyObject *queue_host_task(QueueObject *self, PyObject *args, PyObject *kw) {
  tdmpy_state *st = qstate(self);
  if (PyTuple_GET_SIZE(args) < 1) {
    PyErr_SetString(PyExc_TypeError, "host_task(fn, *args, deps=()) needs fn");
    return NULL;
  }
  PyObject *fn = PyTuple_GET_ITEM(args, 0), *depseq = NULL;
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "host_task: %.100s is not callable", Py_TYPE(fn)->tp_name);
    return NULL;
  }
  if (kw) {
    depseq = PyDict_GetItemString(kw, "deps"); /* borrowed */
    if (PyDict_GET_SIZE(kw) != (depseq ? 1 : 0)) {
      PyErr_SetString(PyExc_TypeError, "host_task takes only deps= as a keyword");
      return NULL;
    }
  }
  if (usable(st, self) < 0) return NULL;
  host_call *c = PyMem_RawMalloc(sizeof *c);
  if (!c) return PyErr_NoMemory();
  c->args = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
  c->cell = PyList_New(0);
  if (!c->args || !c->cell) {
    Py_XDECREF(c->args);
    Py_XDECREF(c->cell);
    PyMem_RawFree(c);
    return NULL;
  }
  c->fn = Py_NewRef(fn);
  c->errors = Py_NewRef(self->errors);
  PyObject *cell = Py_NewRef(c->cell); /* before the task can run: the Event is to come */
  tdmpy_deps d;
  tdm_event *ev = NULL;
  int rc = tdmpy_deps_get(st, depseq, qdev(self), &d);
  if (rc == 0) {
    rc = tdm_host_task(self->q, host_call_run, c, d.n, d.ev, &ev);
    tdmpy_deps_free(&d);
    if (rc < 0) {
      tdmpy_raise(st, rc);
    } else if ((rc = tdm_keep_alive(self->q, host_call_free, c)) < 0) {
      /* The task is submitted, but nothing would free it: leak it rather than free it under
       * a task that may run. */
      tdmpy_raise(st, rc);
      tdm_event_release(ev);
      Py_DECREF(cell);
      return NULL;
    }
  }
  if (rc < 0) {
    Py_DECREF(c->fn);
    Py_DECREF(c->args);
    Py_DECREF(c->errors);
    Py_DECREF(c->cell);
    PyMem_RawFree(c);
    Py_DECREF(cell);
    return NULL;
  }
  PyObject *event = tdmpy_event_new(st, ev, cell, NULL);
  Py_DECREF(cell);
  if (event) ((EventObject *)event)->errors = Py_NewRef(self->errors);
  return event;
}

/* ---- keep-alive, record, wait, barrier -------------------------------------------------- */

static int parse_deps_kw(PyObject *kw, PyObject **deps, const char *what) {
  *deps = NULL;
  if (!kw) return 0;
  *deps = PyDict_GetItemString(kw, "deps"); /* borrowed */
  if (PyDict_GET_SIZE(kw) != (*deps ? 1 : 0)) {
    PyErr_Format(PyExc_TypeError, "%s takes only deps= as a keyword", what);
    return -1;
  }
  return 0;
}

/* Waits for deps on q as a barrier (later work waits too), when there are any. */
static int barrier_deps(tdmpy_state *st, QueueObject *self, PyObject *depseq) {
  tdmpy_deps d;
  if (tdmpy_deps_get(st, depseq, qdev(self), &d) < 0) return -1;
  if (d.n == 0) return 0;
  int rc = tdm_queue_barrier(self->q, d.n, d.ev, NULL);
  tdmpy_deps_free(&d);
  return rc < 0 ? (tdmpy_raise(st, rc), -1) : 0;
}

static PyObject *queue_keep_alive(QueueObject *self, PyObject *args, PyObject *kw) {
  tdmpy_state *st = qstate(self);
  PyObject *depseq;
  if (parse_deps_kw(kw, &depseq, "keep_alive") < 0 || usable(st, self) < 0) return NULL;
  if (barrier_deps(st, self, depseq) < 0) return NULL;
  tdm_event *ev;
  int rc = tdm_event_record(self->q, &ev);
  if (rc < 0) return tdmpy_raise(st, rc);
  tdmpy_hold *h = tdmpy_hold_new();
  if (!h || tdmpy_hold_add(h, args) < 0 || tdmpy_hold_submit(st, self->q, h) < 0) {
    if (h && !PyErr_Occurred()) PyErr_NoMemory();
    tdm_event_release(ev);
    return NULL;
  }
  return tdmpy_event_new(st, ev, NULL, NULL);
}

static PyObject *queue_record(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0) return NULL;
  tdm_event *ev;
  int rc = tdm_event_record(self->q, &ev);
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_event_new(st, ev, NULL, NULL);
}

/* fn(q, ev) for an Event or a foreign event (imported for the call): wait and track. */
static PyObject *queue_with_event(QueueObject *self, PyObject *event,
                                  int (*fn)(tdm_queue *, tdm_event *)) {
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0) return NULL;
  tdm_event *ev;
  int owned;
  if (tdmpy_event_arg(st, event, qdev(self), &ev, &owned) < 0) return NULL;
  int rc = fn(self->q, ev);
  if (owned) tdm_event_release(ev);
  if (rc < 0) return tdmpy_raise(st, rc);
  Py_RETURN_NONE;
}

static PyObject *queue_wait(QueueObject *self, PyObject *event) {
  return queue_with_event(self, event, tdm_queue_wait);
}

static PyObject *queue_barrier(QueueObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"deps", NULL};
  PyObject *depseq = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:barrier", kwlist, &depseq)) return NULL;
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0) return NULL;
  tdmpy_deps d;
  if (tdmpy_deps_get(st, depseq, qdev(self), &d) < 0) return NULL;
  tdm_event *ev;
  int rc = tdm_queue_barrier(self->q, d.n, d.ev, &ev);
  tdmpy_deps_free(&d);
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_event_new(st, ev, NULL, NULL);
}

static PyObject *queue_track(QueueObject *self, PyObject *event) {
  return queue_with_event(self, event, tdm_queue_track);
}

static PyObject *queue_dependencies(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0) return NULL;
  tdm_event *evs[64];
  size_t n;
  int rc = tdm_queue_dependencies(self->q, evs, 64, &n);
  if (rc < 0) return tdmpy_raise(st, rc);
  PyObject *list = PyList_New(0);
  for (size_t i = 0; i < n; i++) {
    PyObject *e = list ? tdmpy_event_new(st, evs[i], NULL, NULL) : NULL;
    if (!e) {
      if (list) evs[i] = NULL; /* tdmpy_event_new released it */
      for (size_t j = i; j < n; j++)
        if (evs[j]) tdm_event_release(evs[j]);
      Py_XDECREF(list);
      return NULL;
    }
    int bad = PyList_Append(list, e);
    Py_DECREF(e);
    if (bad) {
      for (size_t j = i + 1; j < n; j++) tdm_event_release(evs[j]);
      Py_DECREF(list);
      return NULL;
    }
  }
  return list;
}

/* ---- copy and fill ---------------------------------------------------------------------- */

static int size_arg(PyObject *obj, size_t *out, int *given) {
  *given = obj && obj != Py_None;
  if (!*given) return 0;
  Py_ssize_t n = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
  if (n == -1 && PyErr_Occurred()) return -1;
  if (n < 0) {
    PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
    return -1;
  }
  *out = (size_t)n;
  return 0;
}

/* After a copy or fill was submitted (rc) with h holding its operands (NULL: the queue's own
 * buffers, which need no hold): on failure raises and drops h; else h stays alive until the
 * command is done, and the new Event is returned. */
static PyObject *submitted(tdmpy_state *st, QueueObject *self, tdmpy_hold *h, int rc,
                           tdm_event *ev) {
  if (rc < 0) {
    tdmpy_raise(st, rc);
    if (h) tdmpy_hold_drop(h);
    return NULL;
  }
  if (h && tdmpy_hold_submit(st, self->q, h) < 0) {
    tdm_event_release(ev);
    return NULL;
  }
  return tdmpy_event_new(st, ev, NULL, NULL);
}

/* A tandem Buffer whose queue is q needs no hold: freeing it is ordered after q's work
 * (tdmpy_buffer_free_memory), and the Buffer keeps q alive. 1 and the span, or 0. */
static int own_buffer(tdmpy_state *st, QueueObject *q, PyObject *obj, tdmpy_span *out) {
  if (Py_TYPE(obj) != st->buffer_type) return 0;
  BufferObject *b = (BufferObject *)obj;
  if (b->queue != (PyObject *)q || !b->ptr || b->released) return 0;
  out->ptr = b->ptr;
  out->nbytes = b->nbytes;
  return 1;
}

static PyObject *queue_copy(QueueObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dst", "src", "nbytes", "deps", NULL};
  PyObject *dst, *src, *nobj = Py_None, *depseq = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO:copy", kwlist, &dst, &src, &nobj, &depseq))
    return NULL;
  tdmpy_state *st = qstate(self);
  size_t n;
  int given;
  if (usable(st, self) < 0 || size_arg(nobj, &n, &given) < 0) return NULL;
  tdmpy_hold *h = NULL;
  tdmpy_span d, s;
  tdmpy_deps deps = {0};
  if (!own_buffer(st, self, dst, &d) || !own_buffer(st, self, src, &s)) {
    if (!(h = tdmpy_hold_new())) return PyErr_NoMemory();
    if (tdmpy_operand(st, self, dst, 1, h, &d) < 0 || tdmpy_operand(st, self, src, 0, h, &s) < 0)
      goto fail;
  }
  if (tdmpy_deps_get(st, depseq, qdev(self), &deps) < 0) goto fail;
  if (!given) {
    n = s.nbytes;
    if (d.nbytes < n) {
      PyErr_Format(PyExc_ValueError, "copy: the destination holds %zu bytes, the source %zu; "
                   "pass nbytes to copy less", d.nbytes, s.nbytes);
      goto fail;
    }
  } else if (n > d.nbytes || n > s.nbytes) {
    PyErr_Format(PyExc_ValueError, "copy: nbytes=%zu, but the destination holds %zu bytes and "
                 "the source %zu", n, d.nbytes, s.nbytes);
    goto fail;
  }
  tdm_event *ev;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_memcpy(self->q, d.ptr, s.ptr, n, TDM_COPY_AUTO, deps.n, deps.ev, &ev);
  Py_END_ALLOW_THREADS
  tdmpy_deps_free(&deps);
  return submitted(st, self, h, rc, ev);
fail:
  tdmpy_deps_free(&deps);
  if (h) tdmpy_hold_drop(h);
  return NULL;
}

static PyObject *queue_fill(QueueObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dst", "value", "nbytes", "deps", NULL};
  PyObject *dst, *nobj = Py_None, *depseq = NULL;
  int value;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi|OO:fill", kwlist, &dst, &value, &nobj, &depseq))
    return NULL;
  tdmpy_state *st = qstate(self);
  size_t n;
  int given;
  if (usable(st, self) < 0 || size_arg(nobj, &n, &given) < 0) return NULL;
  if (value < 0 || value > 255) {
    PyErr_SetString(PyExc_ValueError, "fill: value is a byte, 0 to 255");
    return NULL;
  }
  tdmpy_hold *h = NULL;
  tdmpy_span d;
  tdmpy_deps deps = {0};
  if (!own_buffer(st, self, dst, &d)) {
    if (!(h = tdmpy_hold_new())) return PyErr_NoMemory();
    if (tdmpy_operand(st, self, dst, 1, h, &d) < 0) goto fail;
  }
  if (tdmpy_deps_get(st, depseq, qdev(self), &deps) < 0) goto fail;
  if (!given) {
    n = d.nbytes;
  } else if (n > d.nbytes) {
    PyErr_Format(PyExc_ValueError, "fill: nbytes=%zu, but the destination holds %zu bytes", n,
                 d.nbytes);
    goto fail;
  }
  tdm_event *ev;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_memset(self->q, d.ptr, value, n, deps.n, deps.ev, &ev);
  Py_END_ALLOW_THREADS
  tdmpy_deps_free(&deps);
  return submitted(st, self, h, rc, ev);
fail:
  tdmpy_deps_free(&deps);
  if (h) tdmpy_hold_drop(h);
  return NULL;
}

/* ---- current queue ---------------------------------------------------------------------- */

static PyObject *queue_enter(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (usable(st, self) < 0 || tdmpy_push_current(st, self) < 0) return NULL;
  return Py_NewRef(self);
}

static PyObject *queue_exit(QueueObject *self, PyObject *args) {
  if (tdmpy_pop_current(qstate(self), self) < 0) return NULL;
  Py_RETURN_FALSE;
}

/* ---- interop ---------------------------------------------------------------------------- */

static PyObject *native_of(tdmpy_state *st, QueueObject *self) {
  if (usable(st, self) < 0) return NULL;
  void *native;
  int rc = tdm_queue_native(self->q, &native);
  if (rc < 0) return tdmpy_raise(st, rc);
  return PyLong_FromVoidPtr(native);
}

static PyObject *queue_cuda_stream(QueueObject *self, PyObject *unused) {
  tdmpy_state *st = qstate(self);
  if (strcmp(backend_of(self), "cuda") != 0) {
    PyErr_Format(st->errors[-TDM_ENOTSUP], "__cuda_stream__: %s is not a CUDA device",
                 ((DeviceObject *)self->device)->info.id);
    return NULL;
  }
  PyObject *h = native_of(st, self);
  if (!h) return NULL;
  return Py_BuildValue("(iN)", 0, h);
}

static PyObject *get_native(QueueObject *self, void *closure) {
  return native_of(qstate(self), self);
}

static PyObject *get_cl(QueueObject *self, void *which) {
  tdmpy_state *st = qstate(self);
  if (strcmp(backend_of(self), "opencl") != 0) {
    PyErr_Format(st->errors[-TDM_ENOTSUP], "%s is not an OpenCL device",
                 ((DeviceObject *)self->device)->info.id);
    return NULL;
  }
  if (which) return PyObject_GetAttrString(self->device, "cl_context");
  return native_of(st, self);
}

static PyObject *get_device(QueueObject *self, void *closure) { return Py_NewRef(self->device); }

static PyObject *get_flag(QueueObject *self, void *which) {
  if (which == (void *)1) return PyBool_FromLong(!(self->flags & TDM_QUEUE_OUT_OF_ORDER));
  if (which == (void *)2) return PyBool_FromLong(self->flags & TDM_QUEUE_TIMING);
  return PyBool_FromLong(self->adopted != NULL);
}

static PyObject *get_destroyed(QueueObject *self, void *closure) {
  return PyBool_FromLong(self->q == NULL);
}

static PyObject *get_handle(QueueObject *self, void *closure) {
  return PyLong_FromVoidPtr(self->q);
}

/* The device an adopted native queue belongs to: the one given, else for a pyopencl queue the
 * OpenCL device whose context it was made in, else the default device. Borrowed. */
static PyObject *adopt_device(tdmpy_state *st, PyObject *device, PyObject *cl_context) {
  if (device != Py_None || !cl_context) return tdmpy_device_arg(st, device);
  void *ctx = PyLong_AsVoidPtr(cl_context);
  if (PyErr_Occurred()) return NULL;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->devices); i++) {
    DeviceObject *d = (DeviceObject *)PyTuple_GET_ITEM(st->devices, i);
    void *native;
    if (strcmp(d->info.backend, "opencl") == 0 && tdm_device_native(d->dev, &native) == 0 &&
        native == ctx)
      return (PyObject *)d;
  }
  PyErr_SetString(st->errors[-TDM_EINVAL], "adopt: the pyopencl queue was not made in the "
                  "context of any tandem device (use Device.cl_context)");
  return NULL;
}

/* A dpctl.SyclQueue, or its "SyclQueueRef" capsule: tandem uses the capsule's sycl::queue, a
 * copy of the dpctl queue's handle (so the same queue), and keeps the capsule (which owns that
 * copy) and obj while it wraps it. Its order is the dpctl queue's unless in_order says;
 * without a device, it goes on the SYCL device the queue belongs to. */
static PyObject *adopt_dpctl(tdmpy_state *st, PyObject *obj, PyObject *cap, void *native,
                             PyObject *device, PyObject *in_order_obj, int timing) {
  int in_order = 1;
  if (in_order_obj != Py_None) {
    in_order = PyObject_IsTrue(in_order_obj);
  } else if (obj != cap) {
    PyObject *v;
    int r = tdmpy_getattr_opt(obj, "is_in_order", &v);
    in_order = r > 0 ? PyObject_IsTrue(v) : r < 0 ? -1 : 1;
    Py_XDECREF(v);
  }
  if (in_order < 0) return NULL;
  unsigned flags = make_flags(in_order, timing);
  if (device != Py_None) {
    if (!(device = tdmpy_device_arg(st, device))) return NULL;
    if (!tdmpy_is_sycl(device)) {
      PyErr_Format(st->errors[-TDM_EXDEV], "adopt: a SYCL queue, but %s is not a SYCL device",
                   ((DeviceObject *)device)->info.id);
      return NULL;
    }
  }
  tdm_queue *q = NULL;
  int rc = TDM_ENODEV;
  char why[512] = "tandem has no SYCL device (Intel's OpenCL CPU runtime needs "
                  "OCL_ICD_VENDORS: tandem/sycl.h)";
  PyObject *found = NULL;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->devices) && !found; i++) {
    PyObject *d = PyTuple_GET_ITEM(st->devices, i);
    if (device != Py_None ? d != device : !tdmpy_is_sycl(d)) continue;
    Py_BEGIN_ALLOW_THREADS
    rc = tdm_queue_adopt(((DeviceObject *)d)->dev, native, flags, &q);
    if (rc < 0) snprintf(why, sizeof why, "%s", tdm_last_error());
    Py_END_ALLOW_THREADS
    if (rc == 0) found = d;
    else if (rc != TDM_EINVAL) break; /* not a question of the device */
  }
  if (!found) return tdmpy_raise_msg(st, rc, why);
  PyObject *keep = obj == cap ? Py_NewRef(cap) : PyTuple_Pack(2, obj, cap);
  if (!keep) {
    Py_BEGIN_ALLOW_THREADS
    tdm_queue_destroy(q);
    Py_END_ALLOW_THREADS
    return NULL;
  }
  PyObject *self = tdmpy_queue_wrap(st, q, found, flags, 1, keep);
  Py_DECREF(keep);
  return self;
}

static PyObject *queue_adopt(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"obj", "device", "in_order", "timing", NULL};
  PyObject *obj, *device = Py_None, *in_order_obj = Py_None;
  int timing = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OOp:adopt", kwlist, &obj, &device,
                                   &in_order_obj, &timing))
    return NULL;
  tdmpy_state *st = tdmpy_state_of_type(tp);
  if (tdmpy_check_live(st) < 0) return NULL;
  PyObject *handle = NULL, *cl_context = NULL, *fn, *tmp, *cap;
  void *sq;
  int r = tdmpy_dpctl_capsule(obj, "SyclQueueRef", &cap, &sq);
  if (r < 0) return NULL;
  if (r) {
    PyObject *self = adopt_dpctl(st, obj, cap, sq, device, in_order_obj, timing);
    Py_DECREF(cap);
    return self;
  }
  int in_order = in_order_obj == Py_None ? 1 : PyObject_IsTrue(in_order_obj);
  if (in_order < 0) return NULL;
  r = tdmpy_getattr_opt(obj, "__cuda_stream__", &fn);
  if (r < 0) return NULL;
  if (r) { /* the CUDA stream protocol: (version, handle) */
    PyObject *pair = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (!pair) return NULL;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
      Py_DECREF(pair);
      PyErr_SetString(PyExc_TypeError, "__cuda_stream__() must return (version, handle)");
      return NULL;
    }
    handle = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
    Py_DECREF(pair);
  } else if (PyLong_Check(obj)) {
    handle = Py_NewRef(obj);
  } else if ((r = tdmpy_getattr_opt(obj, "int_ptr", &handle)) > 0) { /* pyopencl.CommandQueue */
    PyObject *ctx;
    if (tdmpy_getattr_opt(obj, "context", &ctx) <= 0 ||
        tdmpy_getattr_opt(ctx, "int_ptr", &cl_context) <= 0) {
      Py_XDECREF(ctx);
      Py_DECREF(handle);
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "adopt: an object with int_ptr but no context.int_ptr");
      return NULL;
    }
    Py_DECREF(ctx);
    if (in_order_obj == Py_None && tdmpy_getattr_opt(obj, "properties", &tmp) > 0) {
      long props = PyLong_AsLong(tmp);
      Py_DECREF(tmp);
      if (props == -1 && PyErr_Occurred()) PyErr_Clear();
      else in_order = !(props & 1); /* CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE */
    }
    PyErr_Clear();
  } else {
    if (r == 0)
      PyErr_Format(PyExc_TypeError, "adopt takes an object with __cuda_stream__, a "
                   "pyopencl.CommandQueue, a dpctl.SyclQueue or a native handle (int), not "
                   "%.100s",
                   Py_TYPE(obj)->tp_name);
    return NULL;
  }
  void *native = PyLong_AsVoidPtr(handle);
  Py_DECREF(handle);
  if (PyErr_Occurred()) {
    Py_XDECREF(cl_context);
    return NULL;
  }
  device = adopt_device(st, device, cl_context);
  Py_XDECREF(cl_context);
  if (!device) return NULL;
  /* A raw handle is taken on trust, as in C; not on CPU devices, though: nothing in Python
   * makes a tdm_cpu_stream, and tandem would read through whatever pointer it was given. */
  if (strcmp(((DeviceObject *)device)->info.backend, "cpu") == 0) {
    PyErr_SetString(st->errors[-TDM_ENOTSUP], "adopt: CPU devices have no foreign queues to "
                    "adopt (CUDA, OpenCL and SYCL devices do)");
    return NULL;
  }
  unsigned flags = make_flags(in_order, timing);
  tdm_queue *q;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_queue_adopt(((DeviceObject *)device)->dev, native, flags, &q);
  Py_END_ALLOW_THREADS
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_queue_wrap(st, q, device, flags, 1, obj);
}

static PyObject *queue_to_dpctl(QueueObject *self, PyObject *unused) {
  return tdmpy_dpctl_queue(qstate(self), self);
}

static PyObject *queue_repr(QueueObject *self) {
  return PyUnicode_FromFormat("<tandem.Queue %s%s%s%s%s%s%s>",
                              ((DeviceObject *)self->device)->info.id,
                              self->flags & TDM_QUEUE_OUT_OF_ORDER ? " out_of_order" : " in_order",
                              self->flags & TDM_QUEUE_TIMING ? " timing" : "",
                              self->owned ? "" : " (",
                              self->owned ? "" : self->owner,
                              self->owned ? "" : ")",
                              self->q ? "" : " destroyed");
}

static PyMethodDef queue_methods[] = {
    {"synchronize", (PyCFunction)queue_synchronize, METH_NOARGS,
     "synchronize() -> None\n--\n\n"
     "Blocks (without the GIL) until everything submitted to the queue has completed,\n"
     "including work other code put on its native queue (a queue-wide marker). Raises the\n"
     "queue's first error since the last synchronize: a host task's own exception, else a\n"
     "TandemError subclass; the queue stays usable."},
    {"record", (PyCFunction)queue_record, METH_NOARGS,
     "record() -> Event\n--\n\n"
     "A marker: completes when everything submitted so far has, foreign work on the native\n"
     "queue included."},
    {"wait", (PyCFunction)queue_wait, METH_O,
     "wait(event) -> None\n--\n\n"
     "Device-side wait: later work on the queue starts after event completes; returns at once.\n"
     "event: a tandem.Event, or a CuPy, PyTorch or pyopencl event."},
    {"barrier", (PyCFunction)(void (*)(void))queue_barrier, METH_VARARGS | METH_KEYWORDS,
     "barrier(deps=()) -> Event\n--\n\n"
     "Later work waits for deps, or for all earlier work when deps is empty."},
    {"copy", (PyCFunction)(void (*)(void))queue_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(dst, src, nbytes=None, deps=()) -> Event\n--\n\n"
     "Copies nbytes (default: all of src) in stream order; the direction is inferred. dst and\n"
     "src: tandem Buffers, numpy arrays or other buffer-protocol objects (C-contiguous),\n"
     "objects with __cuda_array_interface__ or __dlpack__. Both stay alive until the copy is\n"
     "done; host memory must not be touched until then."},
    {"fill", (PyCFunction)(void (*)(void))queue_fill, METH_VARARGS | METH_KEYWORDS,
     "fill(dst, value, nbytes=None, deps=()) -> Event\n--\n\n"
     "Sets nbytes of dst (default: all) to the byte value, in stream order."},
    {"host_task", (PyCFunction)(void (*)(void))queue_host_task, METH_VARARGS | METH_KEYWORDS,
     "host_task(fn, *args, deps=()) -> Event\n--\n\n"
     "Runs fn(*args) on a tandem thread, with the GIL held, once earlier work (and deps) is\n"
     "done; later work waits for it. An exception it raises becomes the event's .error, and\n"
     "the queue's next synchronize() raises it if it is the queue's first error since the\n"
     "last one. The event keeps the exception, traceback and local variables while it is\n"
     "held; once it is gone, the queue keeps only its first unreported exception, with the\n"
     "traceback's frames cleared (traceback.clear_frames)."},
    {"keep_alive", (PyCFunction)(void (*)(void))queue_keep_alive, METH_VARARGS | METH_KEYWORDS,
     "keep_alive(*objs, deps=()) -> Event\n--\n\n"
     "Holds references to objs until all work submitted so far (and deps) is done; they are\n"
     "dropped on tandem's release thread then. The event completes when that work has. deps\n"
     "become a barrier of the queue."},
    {"dependencies", (PyCFunction)queue_dependencies, METH_NOARGS,
     "dependencies() -> list[Event]\n--\n\n"
     "What a new external submission on the queue must wait on: the order tracker's pending\n"
     "events (tracked ones, and tandem's own recent submissions: on an in-order queue with\n"
     "work pending, one marker this call submits after it)."},
    {"track", (PyCFunction)queue_track, METH_O,
     "track(event) -> None\n--\n\n"
     "Adds an event (tandem's or foreign) to the queue's order tracker."},
    {"destroy", (PyCFunction)queue_destroy, METH_NOARGS,
     "destroy() -> None\n--\n\n"
     "Drains the queue (nothing submitted is lost), then destroys it; later use raises. An\n"
     "adopted native queue is left to its owner. Also done when the object is collected.\n"
     "From one of the queue's own host tasks it raises DeadlockError and the queue stays as\n"
     "it was. An error of the queue's work not yet reported is raised after destroying it."},
    {"adopt", (PyCFunction)(void (*)(void))queue_adopt, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "adopt(obj, device=None, in_order=None, timing=False) -> Queue\n--\n\n"
     "Wraps a native queue: an object with __cuda_stream__ (cupy.cuda.Stream, torch.cuda.Stream,\n"
     "cuda.core streams), a pyopencl.CommandQueue made in tandem's context (its device and\n"
     "in-order property are found from it), a dpctl.SyclQueue of any context (through its\n"
     "\"SyclQueueRef\" capsule, whose sycl::queue is the same queue; its SYCL device and order\n"
     "are found from it), or a raw cudaStream_t / cl_command_queue / sycl::queue * integer\n"
     "(taken on trust, as in C: it must be a live queue of device). obj is kept alive and\n"
     "never destroyed by tandem."},
    {"to_dpctl", (PyCFunction)queue_to_dpctl, METH_NOARGS,
     "to_dpctl() -> dpctl.SyclQueue\n--\n\n"
     "A dpctl.SyclQueue over the queue's native sycl::queue (SYCL devices): the same queue, so\n"
     "kernels submitted to it (dpctl's submit, dpnp operations on it) are ordered with\n"
     "tandem's work, and record(), synchronize() and SequentialOrderManager.wait() cover them.\n"
     "It holds a handle of its own: it stays usable after this queue is destroyed, but\n"
     "tandem's ordering ends with this queue. Needs dpctl."},
    {"__enter__", (PyCFunction)queue_enter, METH_NOARGS,
     "Makes the queue this thread's current queue for its device (CuPy's `with stream:`)."},
    {"__exit__", (PyCFunction)queue_exit, METH_VARARGS, "Restores the previous current queue."},
    {"__cuda_stream__", (PyCFunction)queue_cuda_stream, METH_NOARGS,
     "__cuda_stream__() -> (0, handle)\n--\n\n"
     "The CUDA stream protocol: the queue's cudaStream_t as an integer (CUDA queues)."},
    {NULL},
};

static PyGetSetDef queue_getset[] = {
    {"device", (getter)get_device, NULL, "The queue's Device.", NULL},
    {"in_order", (getter)get_flag, NULL, "True for an in-order queue.", (void *)1},
    {"timing", (getter)get_flag, NULL, "True when its events carry timestamps.", (void *)2},
    {"adopted", (getter)get_flag, NULL, "True for a wrapped foreign native queue.", (void *)3},
    {"destroyed", (getter)get_destroyed, NULL, "True once destroy() has run.", NULL},
    {"native", (getter)get_native, NULL,
     "The native queue as an integer: cudaStream_t, cl_command_queue, sycl::queue *,\n"
     "tdm_cpu_stream *.", NULL},
    {"cl_command_queue", (getter)get_cl, NULL,
     "The cl_command_queue as an integer, for pyopencl.CommandQueue.from_int_ptr (OpenCL).",
     NULL},
    {"cl_context", (getter)get_cl, NULL,
     "The queue's cl_context as an integer, for pyopencl.Context.from_int_ptr (OpenCL).",
     (void *)1},
    {"handle", (getter)get_handle, NULL, "tandem's handle value, for identification.", NULL},
    {NULL},
};

static PyMemberDef queue_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(QueueObject, weakreflist), READONLY},
    {NULL},
};

static PyType_Slot queue_slots[] = {
    {Py_tp_new, queue_new},
    {Py_tp_dealloc, queue_dealloc},
    {Py_tp_traverse, queue_traverse},
    {Py_tp_clear, queue_clear},
    {Py_tp_repr, queue_repr},
    {Py_tp_methods, queue_methods},
    {Py_tp_getset, queue_getset},
    {Py_tp_members, queue_members},
    {Py_tp_doc, "Queue(device=None, in_order=True, timing=False)\n--\n\n"
                "A queue of its own on device (a Device, an id such as \"cuda:0\", or None for\n"
                "the default device): in-order like a CUDA stream, or out-of-order. timing=True\n"
                "makes its events carry timestamps (Event.elapsed)."},
    {0, NULL},
};

PyType_Spec tdmpy_queue_spec = {
    .name = "tandem.Queue",
    .basicsize = sizeof(QueueObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = queue_slots,
};
