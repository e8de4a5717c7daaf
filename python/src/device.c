/* device.c: tandem.Device, one compute device ("cpu:0", "cuda:0", "opencl:0", "sycl:0"). The
 * module makes one object per device at import, so the same device is always the same object.
 */
#include "tdmpy.h"

#include <stddef.h>
#include <string.h>

static PyObject *device_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"id", NULL};
  PyObject *id = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:Device", kwlist, &id)) return NULL;
  tdmpy_state *st = tdmpy_state_of_type(tp);
  if (tdmpy_check_live(st) < 0) return NULL;
  return Py_XNewRef(tdmpy_device_arg(st, id));
}

static void device_dealloc(DeviceObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *device_repr(DeviceObject *self) {
  return PyUnicode_FromFormat("<tandem.Device %s: %s>", self->info.id, self->info.name);
}

static PyObject *device_str(DeviceObject *self) { return PyUnicode_FromString(self->info.id); }

static PyObject *get_native(DeviceObject *self, void *closure) {
  void *native;
  if (tdm_device_native(self->dev, &native) < 0) Py_RETURN_NONE;
  if (strcmp(self->info.backend, "cuda") == 0) return PyLong_FromLong(*(int *)native);
  return PyLong_FromVoidPtr(native);
}

static PyObject *get_cl_context(DeviceObject *self, void *closure) {
  tdmpy_state *st = tdmpy_state_of_type(Py_TYPE(self));
  void *native;
  if (strcmp(self->info.backend, "opencl") != 0) {
    PyErr_Format(st->errors[-TDM_ENOTSUP], "%s is not an OpenCL device", self->info.id);
    return NULL;
  }
  int rc = tdm_device_native(self->dev, &native);
  if (rc < 0) return tdmpy_raise(st, rc);
  return PyLong_FromVoidPtr(native);
}

static PyObject *device_to_dpctl(DeviceObject *self, PyObject *unused) {
  return Py_XNewRef(tdmpy_dpctl_device(tdmpy_state_of_type(Py_TYPE(self)), (PyObject *)self));
}

static PyObject *get_str(DeviceObject *self, void *which) {
  return PyUnicode_FromString((const char *)self + (size_t)which);
}

static PyObject *get_is_gpu(DeviceObject *self, void *closure) {
  return PyBool_FromLong(self->info.caps & TDM_DEVICE_CAP_GPU);
}

static PyObject *get_host_memory(DeviceObject *self, void *closure) {
  return PyBool_FromLong(self->info.caps & TDM_DEVICE_CAP_HOST_MEMORY);
}

static PyObject *get_total_memory(DeviceObject *self, void *closure) {
  return PyLong_FromUnsignedLongLong(self->info.total_memory);
}

static PyObject *get_index(DeviceObject *self, void *closure) {
  return PyLong_FromLong(self->info.index);
}

#define INFO_FIELD(f) (void *)(offsetof(DeviceObject, info) + offsetof(tdm_device_info, f))
static PyGetSetDef device_getset[] = {
    {"id", (getter)get_str, NULL,
     "The device's id: \"cpu:0\", \"cuda:1\", \"opencl:0\", \"sycl:0\".", INFO_FIELD(id)},
    {"backend", (getter)get_str, NULL, "\"cpu\", \"cuda\", \"opencl\" or \"sycl\".",
     INFO_FIELD(backend)},
    {"name", (getter)get_str, NULL, "The device's own name.", INFO_FIELD(name)},
    {"index", (getter)get_index, NULL, "The index among all devices.", NULL},
    {"total_memory", (getter)get_total_memory, NULL, "Bytes of device memory.", NULL},
    {"is_gpu", (getter)get_is_gpu, NULL, "True for a GPU or other accelerator.", NULL},
    {"host_memory", (getter)get_host_memory, NULL,
     "True when device memory is host memory (the CPU backend; a SYCL CPU device).", NULL},
    {"native", (getter)get_native, NULL,
     "The native device: the CUDA ordinal, the OpenCL cl_context or the SYCL sycl::context *\n"
     "as an integer, or None.", NULL},
    {"cl_context", (getter)get_cl_context, NULL,
     "The OpenCL cl_context as an integer, for pyopencl.Context.from_int_ptr (OpenCL only).",
     NULL},
    {NULL},
};
#undef INFO_FIELD

static PyMethodDef device_methods[] = {
    {"to_dpctl", (PyCFunction)device_to_dpctl, METH_NOARGS,
     "to_dpctl() -> dpctl.SyclDevice\n--\n\nThe dpctl.SyclDevice of a SYCL device (the same\n"
     "object each time). Needs dpctl."},
    {NULL},
};

static PyType_Slot device_slots[] = {
    {Py_tp_new, device_new},
    {Py_tp_dealloc, device_dealloc},
    {Py_tp_repr, device_repr},
    {Py_tp_str, device_str},
    {Py_tp_getset, device_getset},
    {Py_tp_methods, device_methods},
    {Py_tp_doc, "Device(id=None)\n--\n\n"
                "A compute device: Device(\"cuda:0\"), Device(\"cpu:0\"), or Device() for the\n"
                "default one ($TANDEM_DEVICE, else the first GPU, else cpu:0). The same device\n"
                "is always the same object."},
    {0, NULL},
};

PyType_Spec tdmpy_device_spec = {
    .name = "tandem.Device",
    .basicsize = sizeof(DeviceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = device_slots,
};
