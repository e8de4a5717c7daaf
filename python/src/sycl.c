/* sycl.c: the SYCL side of the extension, for dpctl and dpnp: dpctl objects over tandem's
 * native SYCL handles (Queue.to_dpctl, Event.to_dpctl, Device.to_dpctl), dpctl's capsules
 * taken in (Queue.adopt, SyclEvents wherever an event is taken), ordering between tandem's
 * queues and dpctl's, and a Buffer's __sycl_usm_array_interface__. Operands with that
 * interface are read in operand.c, next to __cuda_array_interface__.
 *
 * dpctl's capsules ("SyclQueueRef", "SyclEventRef", "SyclContextRef") point to a C++ handle
 * (sycl::queue, sycl::event, sycl::context) that the capsule owns. dpctl's constructors copy
 * the handle out of a capsule (a SYCL handle copy: the same queue, event or context, reference
 * counted by the runtime) and rename the capsule "used_...". The capsules made here point to
 * tandem's borrowed handle and have no destructor; each goes to a dpctl constructor at once and
 * is dropped, so no pointer to tandem's handle outlives the call. A dpctl object made here
 * therefore stays valid after tandem's queue or event is gone (tandem/sycl.h: the handles are
 * the runtime's); only tandem's ordering ends with the tandem queue.
 */
#include "tdmpy.h"

#include <string.h>

int tdmpy_is_sycl(PyObject *device) {
  return strcmp(((DeviceObject *)device)->info.backend, "sycl") == 0;
}

PyObject *tdmpy_dpctl_new(const char *cls, const char *capname, void *ptr) {
  PyObject *mod = PyImport_ImportModule("dpctl");
  if (!mod) return NULL;
  PyObject *cap = PyCapsule_New(ptr, capname, NULL);
  PyObject *obj = cap ? PyObject_CallMethod(mod, cls, "O", cap) : NULL;
  Py_XDECREF(cap);
  Py_DECREF(mod);
  return obj;
}

static int not_sycl(tdmpy_state *st, PyObject *device, const char *what) {
  PyErr_Format(st->errors[-TDM_ENOTSUP], "%s: %s is not a SYCL device", what,
               ((DeviceObject *)device)->info.id);
  return -1;
}

PyObject *tdmpy_dpctl_queue(tdmpy_state *st, QueueObject *q) {
  if (tdmpy_check_live(st) < 0) return NULL;
  if (!tdmpy_is_sycl(q->device)) return not_sycl(st, q->device, "to_dpctl"), NULL;
  if (!q->q) {
    PyErr_SetString(st->errors[-TDM_EHANDLE], "the queue was destroyed");
    return NULL;
  }
  void *native;
  int rc = tdm_queue_native(q->q, &native);
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_dpctl_new("SyclQueue", "SyclQueueRef", native);
}

PyObject *tdmpy_dpctl_event(tdmpy_state *st, tdm_event *ev) {
  if (tdmpy_check_live(st) < 0) return NULL;
  /* Only an event of a SYCL queue has a sycl::event behind it (an imported one has no queue:
   * Event.to_dpctl gives back the foreign object it came from). */
  tdm_queue *q;
  tdm_device *dev;
  tdm_device_info info;
  int rc = tdm_event_queue(ev, &q);
  if (rc == 0) rc = tdm_queue_device(q, &dev);
  if (rc == 0) rc = tdm_device_info_get(dev, &info);
  if (rc == TDM_ENOTSUP || rc == TDM_EHANDLE || (rc == 0 && strcmp(info.backend, "sycl") != 0)) {
    PyErr_SetString(st->errors[-TDM_ENOTSUP],
                    "to_dpctl: not an event of a SYCL queue (nor imported from a SyclEvent)");
    return NULL;
  }
  if (rc < 0) return tdmpy_raise(st, rc);
  void *native;
  if ((rc = tdm_event_native(ev, &native)) < 0) return tdmpy_raise(st, rc);
  return tdmpy_dpctl_new("SyclEvent", "SyclEventRef", native);
}

PyObject *tdmpy_dpctl_device(tdmpy_state *st, PyObject *device) {
  if (tdmpy_check_live(st) < 0) return NULL;
  if (!tdmpy_is_sycl(device)) return not_sycl(st, device, "to_dpctl"), NULL;
  DeviceObject *d = (DeviceObject *)device;
  PyObject *key = PyLong_FromLong(d->info.index);
  if (!key) return NULL;
  PyObject *found = PyDict_GetItemWithError(st->dpctl_devices, key); /* borrowed */
  if (found || PyErr_Occurred()) {
    Py_DECREF(key);
    return found;
  }
  /* The device of a queue tandem makes on it: the one sycl::device behind the tandem device
   * (the device's context may hold several). */
  tdm_queue *tq;
  void *native = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_queue_create(d->dev, TDM_QUEUE_IN_ORDER, &tq);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    Py_DECREF(key);
    return tdmpy_raise(st, rc);
  }
  char why[256] = "";
  if ((rc = tdm_queue_native(tq, &native)) < 0) snprintf(why, sizeof why, "%s", tdm_last_error());
  PyObject *q = rc == 0 ? tdmpy_dpctl_new("SyclQueue", "SyclQueueRef", native) : NULL;
  Py_BEGIN_ALLOW_THREADS
  tdm_queue_destroy(tq); /* empty: nothing to drain; dpctl's copy keeps the handle */
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    Py_DECREF(key);
    return tdmpy_raise_msg(st, rc, why);
  }
  PyObject *sd = q ? PyObject_GetAttrString(q, "sycl_device") : NULL;
  Py_XDECREF(q);
  if (sd && PyDict_SetItem(st->dpctl_devices, key, sd) < 0) Py_CLEAR(sd);
  Py_DECREF(key);
  Py_XDECREF(sd); /* the dict holds it */
  return sd;
}

int tdmpy_sycl_device_id(tdmpy_state *st, PyObject *device, int *id) {
  PyObject *sd = tdmpy_dpctl_device(st, device); /* borrowed */
  PyObject *n = sd ? PyObject_CallMethod(sd, "get_device_id", NULL) : NULL;
  if (!n) return -1;
  long v = PyLong_AsLong(n);
  Py_DECREF(n);
  if (v == -1 && PyErr_Occurred()) return -1;
  *id = (int)v;
  return 0;
}

int tdmpy_dpctl_capsule(PyObject *obj, const char *name, PyObject **cap, void **ptr) {
  if (PyCapsule_CheckExact(obj)) {
    if (!PyCapsule_IsValid(obj, name)) return 0;
    *cap = Py_NewRef(obj);
  } else {
    PyObject *fn;
    int r = tdmpy_getattr_opt(obj, "_get_capsule", &fn);
    if (r <= 0) return r;
    *cap = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (!*cap) return -1;
    if (!PyCapsule_IsValid(*cap, name)) {
      Py_CLEAR(*cap);
      return 0;
    }
  }
  *ptr = PyCapsule_GetPointer(*cap, name);
  if (!*ptr) {
    Py_CLEAR(*cap);
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_ValueError, "the %s capsule holds a NULL pointer", name);
    return -1;
  }
  return 1;
}

/* waiter.submit_barrier([ev]): later commands of waiter wait for ev on the device. Steals ev. */
static int barrier_on(PyObject *waiter, PyObject *ev) {
  if (!ev) return -1;
  PyObject *r = PyObject_CallMethod(waiter, "submit_barrier", "([O])", ev);
  Py_DECREF(ev);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

int tdmpy_sycl_order(tdmpy_state *st, QueueObject *q, PyObject *producer) {
  PyObject *mine = tdmpy_dpctl_queue(st, q);
  if (!mine) return -1;
  int rc = PyObject_RichCompareBool(mine, producer, Py_EQ);
  if (rc == 0) {
    PyObject *ev = PyObject_CallMethod(producer, "submit_barrier", NULL);
    if (!(q->flags & TDM_QUEUE_OUT_OF_ORDER)) {
      rc = barrier_on(mine, ev); /* in order: every later command comes after it */
    } else if (ev) {
      /* Out of order, tandem runs some commands on the host after their own dependencies
       * only: a barrier of tandem's own makes them wait too. */
      tdm_event *tev;
      int owned;
      rc = tdmpy_event_arg(st, ev, ((DeviceObject *)q->device)->dev, &tev, &owned);
      Py_DECREF(ev);
      if (rc == 0) {
        int trc = tdm_queue_wait(q->q, tev);
        if (owned) tdm_event_release(tev);
        if (trc < 0) rc = (tdmpy_raise(st, trc), -1);
      }
    } else {
      rc = -1;
    }
  }
  Py_DECREF(mine);
  return rc < 0 ? -1 : 0;
}

/* The consumer (a dpctl.SyclQueue) waits, on the device, for the work so far of the buffer's
 * queue: for a tandem marker, which covers tandem's host work too. */
static int sycl_consumer_order(tdmpy_state *st, QueueObject *q, PyObject *consumer) {
  if (!q || !q->q) return 0; /* destroyed: drained */
  PyObject *mine = tdmpy_dpctl_queue(st, q);
  if (!mine) return -1;
  int same = PyObject_RichCompareBool(mine, consumer, Py_EQ);
  Py_DECREF(mine);
  if (same < 0) return -1;
  if (same && !(q->flags & TDM_QUEUE_OUT_OF_ORDER)) return 0;
  tdm_event *ev;
  int rc = tdm_event_record(q->q, &ev);
  if (rc < 0) return tdmpy_raise(st, rc), -1;
  PyObject *sev = tdmpy_dpctl_event(st, ev);
  tdm_event_release(ev); /* the SyclEvent holds its own copy of the handle */
  return barrier_on(consumer, sev);
}

int tdmpy_sycl_order_consumer(tdmpy_state *st, BufferObject *b, PyObject *stream) {
  if (stream == Py_None) return tdmpy_buffer_sync(st, b);
  if (PyLong_Check(stream)) {
    long s = PyLong_AsLong(stream);
    if (s == -1 && !PyErr_Occurred()) return 0; /* the consumer orders itself */
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_BufferError, "__dlpack__: on a SYCL device, stream is None, -1 or "
                      "a dpctl.SyclQueue");
    return -1;
  }
  return sycl_consumer_order(st, (QueueObject *)b->queue, stream);
}

PyObject *tdmpy_sycl_import_device(tdmpy_state *st, tdm_device *dev) {
  PyObject *d = tdmpy_device_object(st, dev);
  if (!d) return NULL;
  if (tdmpy_is_sycl(d)) return d;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->devices); i++)
    if (tdmpy_is_sycl(PyTuple_GET_ITEM(st->devices, i))) return PyTuple_GET_ITEM(st->devices, i);
  PyErr_SetString(st->errors[-TDM_ENODEV], "a SYCL event, but tandem has no SYCL device "
                  "(Intel's OpenCL CPU runtime needs OCL_ICD_VENDORS: tandem/sycl.h)");
  return NULL;
}

/* ---- __sycl_usm_array_interface__ ------------------------------------------------------- */

/* New reference: what a consumer should submit to (the interface's syclobj): the buffer's
 * queue as a dpctl.SyclQueue, after a host wait when that queue is out of order (it has no
 * one order to join); the device's context once the queue is gone (destroying it drained it). */
static PyObject *suai_syclobj(tdmpy_state *st, BufferObject *b) {
  QueueObject *q = (QueueObject *)b->queue;
  if (q && q->q) {
    if (q->flags & TDM_QUEUE_OUT_OF_ORDER && tdmpy_buffer_sync(st, b) < 0) return NULL;
    return tdmpy_dpctl_queue(st, q);
  }
  void *ctx;
  int rc = tdm_device_native(((DeviceObject *)b->device)->dev, &ctx);
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_dpctl_new("SyclContext", "SyclContextRef", ctx);
}

PyObject *tdmpy_buffer_suai(BufferObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  if (!tdmpy_is_sycl(self->device) || self->kind == TDM_MEM_HOST) {
    PyErr_SetString(PyExc_AttributeError,
                    "__sycl_usm_array_interface__: not USM memory of a SYCL device");
    return NULL;
  }
  if (!self->ptr || self->released) {
    PyErr_Format(PyExc_AttributeError, "__sycl_usm_array_interface__: %s",
                 tdmpy_buffer_gone(self));
    return NULL;
  }
  if (tdmpy_check_live(st) < 0) return NULL;
  PyObject *syclobj = suai_syclobj(st, self);
  if (!syclobj) {
    /* hasattr() must say False, not raise, where dpctl is not installed. */
    if (PyErr_ExceptionMatches(PyExc_ImportError)) {
      PyErr_Clear();
      PyErr_SetString(PyExc_AttributeError, "__sycl_usm_array_interface__ needs dpctl (its "
                      "syclobj is a dpctl.SyclQueue)");
    }
    return NULL;
  }
  return Py_BuildValue("{s:(NO),s:(n),s:O,s:s,s:i,s:N,s:i}", "data",
                       PyLong_FromVoidPtr(self->ptr), Py_False, "shape", (Py_ssize_t)self->nbytes,
                       "strides", Py_None, "typestr", "|u1", "version", 1, "syclobj", syclobj,
                       "offset", 0);
}
