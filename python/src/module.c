/* module.c: the module tandem._tandem: its per-module state (multi-phase init), the exception
 * classes, the default and current queues, and tandem's lifecycle (tdm_init when the module is
 * executed, tdm_shutdown at interpreter exit or when the module is freed).
 */
#include "tdmpy.h"

#include <string.h>

atomic_int tdmpy_python_gone;

static PyModuleDef tdmpy_module;

tdmpy_state *tdmpy_state_of_type(PyTypeObject *tp) {
  return (tdmpy_state *)PyType_GetModuleState(tp);
}

static tdmpy_state *state_of(PyObject *module) {
  return (tdmpy_state *)PyModule_GetState(module);
}

/* ---- errors ---------------------------------------------------------------------------- */

static const struct {
  int code;
  const char *name;
  const char *doc;
} error_classes[TDMPY_NERRORS] = {
    {TDM_EINVAL, "InvalidArgumentError", "TDM_EINVAL: an invalid argument."},
    {TDM_ENOMEM, "OutOfMemoryError", "TDM_ENOMEM: out of host or device memory."},
    {TDM_ENODEV, "NoDeviceError", "TDM_ENODEV: no such device."},
    {TDM_EHANDLE, "HandleError", "TDM_EHANDLE: an invalid, destroyed or foreign handle."},
    {TDM_ERANGE, "RangeError", "TDM_ERANGE: a range past the end of an allocation."},
    {TDM_EDIRECTION, "DirectionError", "TDM_EDIRECTION: a copy direction the memory does not allow."},
    {TDM_EXDEV, "CrossDeviceError", "TDM_EXDEV: objects of different devices."},
    {TDM_EDEP, "DependencyError", "TDM_EDEP: a dependency failed, so the command did not run."},
    {TDM_EDEADLK, "DeadlockError", "TDM_EDEADLK: the call would wait for itself."},
    {TDM_EDEVLOST, "DeviceLostError", "TDM_EDEVLOST: the device is lost."},
    {TDM_ENOTSUP, "NotSupportedError", "TDM_ENOTSUP: not supported by this backend, device or build."},
    {TDM_EBACKEND, "BackendError", "TDM_EBACKEND: the native backend reported an error."},
    {TDM_ETASK, "HostTaskError", "TDM_ETASK: a host task failed."},
    {TDM_EFORK, "ForkError", "TDM_EFORK: tandem cannot be used in a forked child."},
    {TDM_ENOTINIT, "NotInitializedError", "TDM_ENOTINIT: tandem is not initialized (or was shut down at exit)."},
    {TDM_EAGAIN, "NotReadyError", "TDM_EAGAIN: not complete yet."},
    {TDM_EBUSY, "BusyError", "TDM_EBUSY: the object is in use."},
    {TDM_EVERSION, "VersionError", "TDM_EVERSION: version mismatch."},
    {TDM_ESTATE, "StateError", "TDM_ESTATE: not valid in the object's current state."},
    {TDM_ENOENT, "NotFoundError", "TDM_ENOENT: no such file, key or entry."},
};

PyObject *tdmpy_raise(tdmpy_state *st, int rc) {
  return tdmpy_raise_msg(st, rc, tdm_last_error()); /* before anything else can call tandem */
}

PyObject *tdmpy_raise_msg(tdmpy_state *st, int rc, const char *msg) {
  PyObject *cls = (rc < 0 && -rc <= TDMPY_NERRORS) ? st->errors[-rc] : st->error;
  PyObject *exc = PyObject_CallFunction(cls, "s", msg && *msg ? msg : tdm_strerror(rc));
  if (!exc) return NULL;
  PyObject *code = PyLong_FromLong(rc);                  /* owned */
  PyObject *name = PyUnicode_FromString(tdm_err_name(rc)); /* owned */
  int bad = !code || !name || PyObject_SetAttrString(exc, "code", code) < 0 ||
            PyObject_SetAttrString(exc, "name", name) < 0;
  Py_XDECREF(code);
  Py_XDECREF(name);
  if (!bad) PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

int tdmpy_check_live(tdmpy_state *st) {
  if (st->live) return 0;
  PyErr_SetString(st->errors[-TDM_ENOTINIT],
                  "tandem was shut down at interpreter exit; no more work can be submitted");
  return -1;
}

static int add_error_classes(PyObject *m, tdmpy_state *st) {
  PyObject *dict = Py_BuildValue("{s:i,s:s}", "code", 0, "name", "TDM_UNKNOWN");
  if (!dict) return -1;
  st->error = PyErr_NewExceptionWithDoc(
      "tandem.TandemError",
      "Base class of every error tandem reports. .code is the negative TDM_E* code, .name its\n"
      "name (\"TDM_EINVAL\"), and the message is tdm_last_error() of the failing call.",
      NULL, dict);
  Py_DECREF(dict);
  if (!st->error || PyModule_AddObjectRef(m, "TandemError", st->error) < 0) return -1;
  for (int i = 0; i < TDMPY_NERRORS; i++) {
    int code = error_classes[i].code;
    char qual[64];
    snprintf(qual, sizeof qual, "tandem.%s", error_classes[i].name);
    dict = Py_BuildValue("{s:i,s:s}", "code", code, "name", tdm_err_name(code));
    if (!dict) return -1;
    PyObject *cls = PyErr_NewExceptionWithDoc(qual, error_classes[i].doc, st->error, dict);
    Py_DECREF(dict);
    if (!cls) return -1;
    st->errors[-code] = cls; /* owned by the state */
    if (PyModule_AddObjectRef(m, error_classes[i].name, cls) < 0) return -1;
  }
  return 0;
}

/* ---- devices --------------------------------------------------------------------------- */

PyObject *tdmpy_device_object(tdmpy_state *st, tdm_device *dev) {
  tdm_device_info info;
  int rc = tdm_device_info_get(dev, &info);
  if (rc < 0) return tdmpy_raise(st, rc);
  if (info.index < 0 || info.index >= PyTuple_GET_SIZE(st->devices)) {
    PyErr_SetString(st->error, "device index out of range");
    return NULL;
  }
  return PyTuple_GET_ITEM(st->devices, info.index);
}

PyObject *tdmpy_device_arg(tdmpy_state *st, PyObject *arg) {
  if (arg && PyObject_TypeCheck(arg, st->device_type)) return arg;
  const char *id = NULL;
  if (arg && arg != Py_None) {
    if (!PyUnicode_Check(arg)) {
      PyErr_Format(PyExc_TypeError, "device must be a tandem.Device, an id such as "
                   "\"cuda:0\", or None, not %.100s", Py_TYPE(arg)->tp_name);
      return NULL;
    }
    if (!(id = PyUnicode_AsUTF8(arg))) return NULL;
  }
  tdm_device *dev;
  int rc = tdm_device_find(id, &dev);
  if (rc < 0) return tdmpy_raise(st, rc);
  return tdmpy_device_object(st, dev);
}

static int make_devices(tdmpy_state *st) {
  int n, rc = tdm_device_count(&n);
  if (rc < 0) return tdmpy_raise(st, rc), -1;
  st->devices = PyTuple_New(n);
  if (!st->devices) return -1;
  for (int i = 0; i < n; i++) {
    DeviceObject *d = PyObject_New(DeviceObject, st->device_type);
    if (!d) return -1;
    PyTuple_SET_ITEM(st->devices, i, (PyObject *)d);
    if ((rc = tdm_device_get(i, &d->dev)) < 0 || (rc = tdm_device_info_get(d->dev, &d->info)) < 0)
      return tdmpy_raise(st, rc), -1;
  }
  return 0;
}

static PyObject *devices(PyObject *m, PyObject *unused) {
  tdmpy_state *st = state_of(m);
  if (tdmpy_check_live(st) < 0) return NULL;
  return PySequence_List(st->devices);
}

/* ---- default and current queues -------------------------------------------------------- */

static PyObject *default_queue(tdmpy_state *st, PyObject *device) {
  DeviceObject *d = (DeviceObject *)device;
  PyObject *key = PyLong_FromLong(d->info.index);
  if (!key) return NULL;
  PyObject *q = PyDict_GetItemWithError(st->installed, key); /* borrowed */
  if (q || PyErr_Occurred()) {
    Py_DECREF(key);
    return Py_XNewRef(q);
  }
  tdm_queue *tq;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_default_queue(d->dev, &tq); /* the first call creates it */
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    Py_DECREF(key);
    return tdmpy_raise(st, rc);
  }
  q = PyDict_GetItemWithError(st->defaults, key);
  if (q && ((QueueObject *)q)->q == tq) {
    Py_DECREF(key);
    return Py_NewRef(q);
  }
  if (PyErr_Occurred()) {
    Py_DECREF(key);
    return NULL;
  }
  unsigned flags = 0;
  tdm_queue_flags(tq, &flags);
  q = tdmpy_queue_wrap(st, tq, device, flags, 0, NULL);
  if (q && PyDict_SetItem(st->defaults, key, q) < 0) Py_CLEAR(q);
  Py_DECREF(key);
  return q;
}

/* This thread's stack of queues entered with `with q:` (a list in its thread-state dict);
 * borrowed, or NULL without an error when create is 0 and there is none. */
static PyObject *thread_stack(tdmpy_state *st, int create) {
  PyObject *tdict = PyThreadState_GetDict(); /* borrowed */
  if (!tdict) {
    if (create) PyErr_SetString(PyExc_RuntimeError, "no thread state dictionary");
    return NULL;
  }
  PyObject *stack = PyDict_GetItemWithError(tdict, st->tls_key);
  if (stack || PyErr_Occurred() || !create) return stack;
  stack = PyList_New(0);
  if (!stack) return NULL;
  int rc = PyDict_SetItem(tdict, st->tls_key, stack);
  Py_DECREF(stack); /* the thread dict holds it */
  return rc < 0 ? NULL : stack;
}

int tdmpy_push_current(tdmpy_state *st, QueueObject *q) {
  PyObject *stack = thread_stack(st, 1);
  if (!stack) return -1;
  int rc = tdm_current_queue_push(q->q);
  if (rc < 0) return tdmpy_raise(st, rc), -1;
  if (PyList_Append(stack, (PyObject *)q) < 0) {
    tdm_current_queue_pop();
    return -1;
  }
  return 0;
}

int tdmpy_pop_current(tdmpy_state *st, QueueObject *q) {
  PyObject *stack = thread_stack(st, 0);
  Py_ssize_t n = stack ? PyList_GET_SIZE(stack) : 0;
  if (n == 0 || PyList_GET_ITEM(stack, n - 1) != (PyObject *)q) {
    if (!PyErr_Occurred())
      PyErr_SetString(st->errors[-TDM_ESTATE],
                      "leaving a queue that is not this thread's current one");
    return -1;
  }
  tdm_current_queue_pop();
  return PyList_SetSlice(stack, n - 1, n, NULL);
}

PyObject *tdmpy_current_queue(tdmpy_state *st, PyObject *device) {
  PyObject *stack = thread_stack(st, 0);
  if (!stack && PyErr_Occurred()) return NULL;
  for (Py_ssize_t i = stack ? PyList_GET_SIZE(stack) - 1 : -1; i >= 0; i--) {
    QueueObject *q = (QueueObject *)PyList_GET_ITEM(stack, i);
    if (!device || q->device == device) return Py_NewRef(q);
  }
  if (!device) device = tdmpy_device_arg(st, Py_None);
  return device ? default_queue(st, device) : NULL;
}

static PyObject *get_current_queue(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"device", NULL};
  PyObject *device = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:get_current_queue", kwlist, &device))
    return NULL;
  tdmpy_state *st = state_of(m);
  if (tdmpy_check_live(st) < 0) return NULL;
  if (device != Py_None && !(device = tdmpy_device_arg(st, device))) return NULL;
  return tdmpy_current_queue(st, device == Py_None ? NULL : device);
}

static PyObject *get_default_queue(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"device", NULL};
  PyObject *device = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:get_default_queue", kwlist, &device))
    return NULL;
  tdmpy_state *st = state_of(m);
  if (tdmpy_check_live(st) < 0 || !(device = tdmpy_device_arg(st, device))) return NULL;
  return default_queue(st, device);
}

static PyObject *set_default_queue(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"device", "queue", NULL};
  PyObject *device, *queue;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:set_default_queue", kwlist, &device, &queue))
    return NULL;
  tdmpy_state *st = state_of(m);
  if (tdmpy_check_live(st) < 0 || !(device = tdmpy_device_arg(st, device))) return NULL;
  DeviceObject *d = (DeviceObject *)device;
  tdm_queue *tq = NULL;
  if (queue != Py_None) {
    if (tdmpy_queue_check(st, queue, &tq) < 0) return NULL;
    if (((QueueObject *)queue)->device != device) {
      PyErr_SetString(st->errors[-TDM_EXDEV], "set_default_queue: the queue is of another device");
      return NULL;
    }
  }
  int rc = tdm_default_queue_set(d->dev, tq);
  if (rc < 0) return tdmpy_raise(st, rc);
  PyObject *key = PyLong_FromLong(d->info.index);
  if (!key) return NULL;
  if (queue != Py_None)
    rc = PyDict_SetItem(st->installed, key, queue);
  else
    rc = PyDict_DelItem(st->installed, key) < 0 && PyErr_ExceptionMatches(PyExc_KeyError)
             ? (PyErr_Clear(), 0)
             : 0;
  Py_DECREF(key);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

/* Called by a Queue being destroyed: if it is installed anywhere, forget it. */
int tdmpy_uninstall(tdmpy_state *st, PyObject *queue) {
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(st->installed, &pos, &key, &value))
    if (value == queue) return PyDict_DelItem(st->installed, key);
  return 0;
}

/* ---- lifecycle -------------------------------------------------------------------------- */

/* Drains every queue and shuts tandem down, with the GIL released so host tasks and
 * keep-alive releases still pending can run their Python code; after it no tandem thread
 * exists, so no Python callable runs any more. */
static void shutdown_now(tdmpy_state *st) {
  if (!st->live) return;
  st->live = 0;
  Py_BEGIN_ALLOW_THREADS
  tdm_shutdown();
  Py_END_ALLOW_THREADS
  atomic_store(&tdmpy_python_gone, 1);
}

static PyObject *shutdown(PyObject *m, PyObject *unused) {
  shutdown_now(state_of(m));
  Py_RETURN_NONE;
}

static PyObject *malloc_fn(PyObject *m, PyObject *args, PyObject *kw) {
  return tdmpy_malloc(state_of(m), args, kw);
}

static PyObject *backends(PyObject *m, PyObject *unused) {
  tdmpy_state *st = state_of(m);
  int n, rc = tdm_backend_count(&n);
  if (rc < 0) return tdmpy_raise(st, rc);
  PyObject *list = PyList_New(0);
  for (int i = 0; list && i < n; i++) {
    tdm_backend_info b;
    if ((rc = tdm_backend_get(i, &b)) < 0) {
      Py_DECREF(list);
      return tdmpy_raise(st, rc);
    }
    PyObject *item = Py_BuildValue("{s:s,s:s,s:i,s:s}", "name", b.name, "status",
                                   tdm_err_name(b.status), "devices", b.device_count, "detail",
                                   b.detail);
    if (!item || PyList_Append(list, item) < 0) Py_CLEAR(list);
    Py_XDECREF(item);
  }
  return list;
}

static PyMethodDef module_methods[] = {
    {"devices", devices, METH_NOARGS,
     "devices() -> list[Device]\n--\n\nEvery device tandem found, in tandem's order."},
    {"backends", backends, METH_NOARGS,
     "backends() -> list[dict]\n--\n\nThe backends tandem knows of, loaded or not, and why not."},
    {"get_current_queue", (PyCFunction)(void (*)(void))get_current_queue,
     METH_VARARGS | METH_KEYWORDS,
     "get_current_queue(device=None) -> Queue\n--\n\n"
     "This thread's current queue for device (the innermost `with q:` whose queue is of that\n"
     "device; device None: the innermost of any device), else the device's default queue\n"
     "(device None: the default device's)."},
    {"get_default_queue", (PyCFunction)(void (*)(void))get_default_queue,
     METH_VARARGS | METH_KEYWORDS,
     "get_default_queue(device=None) -> Queue\n--\n\n"
     "The device's default queue: the one installed with set_default_queue, else tandem's\n"
     "cached queue, made on first use as $TANDEM_DEFAULT_QUEUE says (in_order unless\n"
     "out_of_order). The same object each time until the default changes."},
    {"set_default_queue", (PyCFunction)(void (*)(void))set_default_queue,
     METH_VARARGS | METH_KEYWORDS,
     "set_default_queue(device, queue) -> None\n--\n\n"
     "Installs the program's own queue as the device's default (None: back to tandem's cached\n"
     "queue). The queue stays alive while installed. Code that fetched the old default keeps a\n"
     "valid queue, but a different one: its work is not ordered with work on the new default."},
    {"malloc", (PyCFunction)(void (*)(void))malloc_fn, METH_VARARGS | METH_KEYWORDS,
     "malloc(nbytes, kind='device', device=None, queue=None) -> Buffer\n--\n\n"
     "Allocates nbytes of 'device', 'pinned' or 'host' memory on device (None: the queue's\n"
     "device, else the default device). queue (default: the current queue of that device) is\n"
     "the queue whose work the buffer's users synchronize with (__cuda_array_interface__'s\n"
     "stream, __dlpack__)."},
    {"_shutdown", shutdown, METH_NOARGS,
     "_shutdown()\n--\n\nDrains every queue and shuts tandem down (registered with atexit)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m) {
  tdmpy_state *st = state_of(m);
  if (add_error_classes(m, st) < 0) return -1;
#define ADD_TYPE(field, spec, name)                                                   \
  do {                                                                                \
    st->field = (PyTypeObject *)PyType_FromModuleAndSpec(m, &(spec), NULL);           \
    if (!st->field || PyModule_AddObjectRef(m, name, (PyObject *)st->field) < 0)      \
      return -1;                                                                      \
  } while (0)
  ADD_TYPE(device_type, tdmpy_device_spec, "Device");
  ADD_TYPE(queue_type, tdmpy_queue_spec, "Queue");
  ADD_TYPE(event_type, tdmpy_event_spec, "Event");
  ADD_TYPE(buffer_type, tdmpy_buffer_spec, "Buffer");
  ADD_TYPE(streamer_type, tdmpy_streamer_spec, "Streamer");
  ADD_TYPE(moeops_type, tdmpy_moeops_spec, "MoeOps");
#undef ADD_TYPE
  if (!(st->defaults = PyDict_New()) || !(st->installed = PyDict_New()) ||
      !(st->imports = PyDict_New()) || !(st->dpctl_devices = PyDict_New()) ||
      !(st->tls_key = PyUnicode_FromFormat("tandem._tandem.current.%p", (void *)m)))
    return -1;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = tdm_init();
  Py_END_ALLOW_THREADS
  if (rc < 0) return tdmpy_raise(st, rc), -1;
  st->live = 1;
  atomic_store(&tdmpy_python_gone, 0);
  if (make_devices(st) < 0) return -1;
  if (PyModule_AddStringConstant(m, "tandem_version", tdm_version_string()) < 0) return -1;
#ifdef TDMPY_HAVE_EVENT_IMPORT
  PyObject *has_import = Py_True;
#else
  PyObject *has_import = Py_False;
#endif
  if (PyModule_AddObjectRef(m, "has_event_import", has_import) < 0) return -1;
  return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
  tdmpy_state *st = state_of(m);
  Py_VISIT(st->device_type);
  Py_VISIT(st->queue_type);
  Py_VISIT(st->event_type);
  Py_VISIT(st->buffer_type);
  Py_VISIT(st->streamer_type);
  Py_VISIT(st->moeops_type);
  Py_VISIT(st->error);
  for (int i = 1; i <= TDMPY_NERRORS; i++) Py_VISIT(st->errors[i]);
  Py_VISIT(st->devices);
  Py_VISIT(st->defaults);
  Py_VISIT(st->installed);
  Py_VISIT(st->imports);
  Py_VISIT(st->dpctl_devices);
  return 0;
}

static int module_clear(PyObject *m) {
  tdmpy_state *st = state_of(m);
  Py_CLEAR(st->installed);
  Py_CLEAR(st->defaults);
  Py_CLEAR(st->imports);
  Py_CLEAR(st->dpctl_devices);
  Py_CLEAR(st->devices);
  Py_CLEAR(st->tls_key);
  for (int i = 1; i <= TDMPY_NERRORS; i++) Py_CLEAR(st->errors[i]);
  Py_CLEAR(st->error);
  Py_CLEAR(st->streamer_type);
  Py_CLEAR(st->moeops_type);
  Py_CLEAR(st->buffer_type);
  Py_CLEAR(st->event_type);
  Py_CLEAR(st->queue_type);
  Py_CLEAR(st->device_type);
  return 0;
}

/* Without the atexit hook (the module freed before exit): no Python code may run on tandem's
 * threads from here on, so their references leak, and tandem is shut down. */
static void module_free(void *m) {
  tdmpy_state *st = state_of((PyObject *)m);
  if (st && st->live) {
    atomic_store(&tdmpy_python_gone, 1);
    st->live = 0;
    Py_BEGIN_ALLOW_THREADS
    tdm_shutdown();
    Py_END_ALLOW_THREADS
  }
  module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* Host tasks take the GIL with PyGILState_Ensure, which knows one interpreter only. */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static PyModuleDef tdmpy_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tandem._tandem",
    .m_doc = "The C extension of the tandem package: tandem's public API for Python.",
    .m_size = sizeof(tdmpy_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__tandem(void) { return PyModuleDef_Init(&tdmpy_module); }
