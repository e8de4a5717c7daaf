/* moeops.c: tandem.MoeOps, libtandem_moe's operation table (tandem/moe_ops.h) opened on a
 * Queue, for Python code that keeps its tensors elsewhere (PyTorch, CuPy, numpy over tandem
 * Buffers): the router, the grouping of a layer's routing on the device, the grouped experts
 * in bf16 or a file's blocks, the combine, recorded graphs of them, and host passes (a layer's
 * host-placed experts, made on a CPU table and called from a device queue's stream).
 *
 * Every operand is a device pointer given as an integer (tensor.data_ptr(), Buffer.ptr), in
 * the layouts moe_ops.h documents; an op is submitted to the queue in stream order and checked
 * as moe_ops.h says (arguments here, device data when it runs). Like any API on raw pointers
 * (CuPy's runtime calls, ctypes), it cannot tell a pointer to memory of the queue's device
 * from any other integer: memory the op may not touch is the caller's error, and on the CPU,
 * whose ops run on the host, it faults as a bad pointer in C does. The object keeps its Queue (in
 * its `users`, so destroy() is refused while the state is open) and the graphs it recorded,
 * which close() frees before the state. The ops are called with the GIL held: each only
 * submits work, and the state takes calls from one thread at a time.
 */
#include "tdmpy.h"

#include <string.h>

#include <tandem/moe_ops.h>

#define MAX_GRAPHS 256 /* graphs recorded and not freed, at most */
#define MAX_PASSES 1024 /* host passes made, at most */

typedef struct {
  PyObject_HEAD
  const tdm_moe_ops *ops;
  void *st;             /* the opened state; NULL once closed */
  PyObject *queue;      /* Queue; NULL once closed */
  void *graphs[MAX_GRAPHS]; /* recorded, by handle - 1; NULL: free */
  tdm_moe_host_pass **passes; /* host passes made on this (CPU) state, by handle - 1 */
  int npasses;
  PyObject *hosts;          /* list of the MoeOps whose passes host_call() named, kept */
} MoeOpsObject;

static tdmpy_state *mstate(MoeOpsObject *self) { return tdmpy_state_of_type(Py_TYPE(self)); }

static tdm_queue *mqueue(MoeOpsObject *self) { return ((QueueObject *)self->queue)->q; }

/* 0 when the state can take an op, else -1 with an error set. */
static int usable(tdmpy_state *st, MoeOpsObject *self) {
  if (tdmpy_check_live(st) < 0) return -1;
  if (!self->st || !mqueue(self)) {
    PyErr_SetString(st->errors[-TDM_ESTATE], "the MoeOps is closed");
    return -1;
  }
  return 0;
}

/* An op's return code to Python: None, or its exception. */
static PyObject *done(tdmpy_state *st, int rc) {
  if (rc < 0) return tdmpy_raise(st, rc);
  Py_RETURN_NONE;
}

#define P(v) ((void *)(uintptr_t)(v))

/* "O&" converter of a pointer operand: a non-negative integer (negative: OverflowError). */
static int ptr_arg(PyObject *obj, void *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return 0;
  *(unsigned long long *)out = v;
  return 1;
}

static PyObject *moeops_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  tdmpy_state *st = tdmpy_state_of_type(type);
  static char *kwlist[] = {"queue", NULL};
  PyObject *queue;
  tdm_queue *q;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:MoeOps", kwlist, &queue) ||
      tdmpy_check_live(st) < 0 || tdmpy_queue_check(st, queue, &q) < 0)
    return NULL;
  tdm_device *dev = ((DeviceObject *)((QueueObject *)queue)->device)->dev;
  const tdm_moe_ops *ops = tdm_moe_ops_for(dev);
  if (!ops) return tdmpy_raise(st, TDM_ENOTSUP);
  MoeOpsObject *self = (MoeOpsObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->ops = ops;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = ops->open(q, &self->st);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    self->st = NULL;
    Py_DECREF(self);
    return tdmpy_raise(st, rc);
  }
  self->queue = Py_NewRef(queue);
  ((QueueObject *)queue)->users++;
  return (PyObject *)self;
}

/* Frees the graphs, closes the state (which waits for the queue's work) and lets the Queue go. */
static void close_now(tdmpy_state *st, MoeOpsObject *self) {
  if (!self->st) return;
  void *s = self->st;
  self->st = NULL;
  if (st->live) {
    for (int i = 0; i < MAX_GRAPHS; i++)
      if (self->graphs[i]) self->ops->graph_free(s, self->graphs[i]);
    Py_BEGIN_ALLOW_THREADS
    self->ops->close(s);
    Py_END_ALLOW_THREADS
  }
  memset(self->graphs, 0, sizeof self->graphs);
  for (int i = 0; i < self->npasses; i++) PyMem_Free(self->passes[i]);
  PyMem_Free(self->passes);
  self->passes = NULL;
  self->npasses = 0;
  ((QueueObject *)self->queue)->users--;
  Py_CLEAR(self->queue);
  Py_CLEAR(self->hosts);
}

static void moeops_dealloc(MoeOpsObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  close_now(tdmpy_state_of_type(tp), self);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *moeops_close(MoeOpsObject *self, PyObject *unused) {
  (void)unused;
  close_now(mstate(self), self);
  Py_RETURN_NONE;
}

/* ---- the operations ---------------------------------------------------------------------- */

static PyObject *moeops_router(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  unsigned long long x, wr, bias, idx, w;
  int T, H, E, k, renorm;
  if (!PyArg_ParseTuple(args, "O&O&O&iiiipO&O&:router", ptr_arg, &x, ptr_arg, &wr, ptr_arg,
                        &bias, &T, &H, &E, &k, &renorm, ptr_arg, &idx, ptr_arg, &w) ||
      usable(st, self) < 0)
    return NULL;
  return done(st, self->ops->router(self->st, mqueue(self), P(x), P(wr), P(bias), T, H, E, k,
                                    renorm, P(idx), P(w)));
}

static PyObject *moeops_group(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  unsigned long long idx, wofs, rows, slot, groups;
  int T, k, E;
  if (!PyArg_ParseTuple(args, "O&iiiO&O&O&O&:group", ptr_arg, &idx, &T, &k, &E, ptr_arg, &wofs,
                        ptr_arg, &rows, ptr_arg, &slot, ptr_arg, &groups) ||
      usable(st, self) < 0)
    return NULL;
  return done(st, self->ops->group(self->st, mqueue(self), P(idx), T, k, E, P(wofs), P(rows),
                                   P(slot), P(groups)));
}

/* A weight type: moe_ops.h's TDM_MOE_W_* number, or its name ("q4_k"); -1 with an error set. */
static const char *const wtype_names[] = {NULL, "f16", "bf16", "q8_0", "q4_k", "q6_k", "mxfp4"};

static int wtype_arg(tdmpy_state *st, PyObject *obj) {
  if (PyLong_Check(obj)) return (int)PyLong_AsLong(obj);
  const char *name = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
  for (int t = 1; name && t < (int)(sizeof wtype_names / sizeof wtype_names[0]); t++)
    if (strcmp(name, wtype_names[t]) == 0) return t;
  if (!PyErr_Occurred())
    PyErr_Format(st->errors[-TDM_EINVAL], "fmt: %R is not a weight type (f16, bf16, q8_0, q4_k, "
                 "q6_k, mxfp4, or its number)", obj);
  return -1;
}

/* fmt, a (gate_up_type, down_type) pair, into *f; -1 with an error set. */
static int fmt_arg(tdmpy_state *st, PyObject *fmt, tdm_moe_wfmt *f) {
  PyObject *gu, *d;
  if (!PyArg_Parse(fmt, "(OO);fmt: a (gate_up_type, down_type) pair", &gu, &d)) return -1;
  if ((f->gu = wtype_arg(st, gu)) == -1 && PyErr_Occurred()) return -1;
  if ((f->d = wtype_arg(st, d)) == -1 && PyErr_Occurred()) return -1;
  return 0;
}

/* experts(x, rows, slot, n, wbase, groups, G, H, I, out, workspace, workspace_bytes, fmt=None):
 * fmt None (bf16) or (gate_up_type, down_type), tdm_moe_wfmt's, as numbers or names. */
static PyObject *moeops_experts(MoeOpsObject *self, PyObject *args, PyObject *kwargs) {
  tdmpy_state *st = mstate(self);
  static char *kwlist[] = {"x", "rows", "slot", "n", "wbase", "groups", "G", "H", "I", "out",
                           "workspace", "workspace_bytes", "fmt", NULL};
  unsigned long long x, rows, slot, wbase, groups, out, ws;
  int n, G, H, I;
  Py_ssize_t ws_bytes;
  PyObject *fmt = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&O&O&iO&O&iiiO&O&n|O:experts", kwlist,
                                   ptr_arg, &x, ptr_arg, &rows, ptr_arg, &slot, &n, ptr_arg,
                                   &wbase, ptr_arg, &groups, &G, &H, &I, ptr_arg, &out, ptr_arg,
                                   &ws, &ws_bytes, &fmt) ||
      usable(st, self) < 0)
    return NULL;
  if (ws_bytes < 0) return PyErr_Format(PyExc_ValueError, "workspace_bytes < 0");
  if (fmt == Py_None)
    return done(st, self->ops->experts(self->st, mqueue(self), P(x), P(rows), P(slot), n,
                                       P(wbase), P(groups), G, H, I, P(out), P(ws),
                                       (size_t)ws_bytes));
  tdm_moe_wfmt f;
  if (fmt_arg(st, fmt, &f) < 0) return NULL;
  if (!self->ops->experts_q) return tdmpy_raise_msg(st, TDM_ENOTSUP, "this backend's table "
                                                    "has no experts_q()");
  return done(st, self->ops->experts_q(self->st, mqueue(self), P(x), P(rows), P(slot), n,
                                       P(wbase), f, P(groups), G, H, I, P(out), P(ws),
                                       (size_t)ws_bytes));
}

static PyObject *moeops_combine(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  unsigned long long y, out, w;
  int T, H, k;
  if (!PyArg_ParseTuple(args, "O&O&O&iii:combine", ptr_arg, &y, ptr_arg, &out, ptr_arg, &w, &T,
                        &H, &k) ||
      usable(st, self) < 0)
    return NULL;
  return done(st, self->ops->combine(self->st, mqueue(self), P(y), P(out), P(w), T, H, k));
}

/* upload(dst, src, nbytes): moe_ops.h's upload, the device's cores reading pinned host memory
 * in place when the op runs (src must stay as it is until then), so that a small table does
 * not wait behind expert copies on the link. */
static PyObject *moeops_upload(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  unsigned long long dst, src;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "O&O&n:upload", ptr_arg, &dst, ptr_arg, &src, &n) ||
      usable(st, self) < 0)
    return NULL;
  if (n < 0) return PyErr_Format(PyExc_ValueError, "upload: nbytes < 0");
  if (!self->ops->upload)
    return tdmpy_raise_msg(st, TDM_ENOTSUP, "this backend's table has no upload(): copy with "
                           "Queue.copy");
  return done(st, self->ops->upload(self->st, mqueue(self), P(dst), P(src), (size_t)n));
}

/* ---- host passes: a layer's host-placed experts, called from a device's stream ------------- */

/* host_pass(x, idx, T, k, E, wofs, wbase, H, I, rows, slot, groups, out, workspace,
 * workspace_bytes) -> int, on a CPU table: a tdm_moe_host_pass over those host buffers, kept
 * until close(); its handle. */
static PyObject *moeops_host_pass(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  unsigned long long x, idx, wofs, wbase, rows, slot, groups, out, ws;
  int T, k, E, H, I;
  Py_ssize_t ws_bytes;
  if (!PyArg_ParseTuple(args, "O&O&iiiO&O&iiO&O&O&O&O&n:host_pass", ptr_arg, &x, ptr_arg, &idx,
                        &T, &k, &E, ptr_arg, &wofs, ptr_arg, &wbase, &H, &I, ptr_arg, &rows,
                        ptr_arg, &slot, ptr_arg, &groups, ptr_arg, &out, ptr_arg, &ws,
                        &ws_bytes) ||
      usable(st, self) < 0)
    return NULL;
  if (strcmp(self->ops->name, "cpu") != 0)
    return PyErr_Format(st->errors[-TDM_EINVAL], "host_pass: host passes are made on a CPU "
                        "device's MoeOps, not on %s's", self->ops->name);
  if (T <= 0 || k <= 0 || E <= 0 || H <= 0 || I <= 0 || T > INT32_MAX / k || ws_bytes < 0 ||
      !x || !idx || !wofs || !rows || !slot || !groups || !out || !ws)
    return tdmpy_raise_msg(st, TDM_EINVAL, "host_pass: a size out of range or a NULL buffer");
  if ((size_t)ws_bytes < tdm_moe_ops_workspace(T * k, H, I))
    return tdmpy_raise_msg(st, TDM_EINVAL, "host_pass: workspace_bytes is under "
                           "workspace_bytes(T * k, H, I)");
  if (self->npasses == MAX_PASSES)
    return tdmpy_raise_msg(st, TDM_ENOMEM, "host_pass: 1024 passes are made already");
  if (!self->passes && !(self->passes = PyMem_Calloc(MAX_PASSES, sizeof *self->passes)))
    return PyErr_NoMemory();
  tdm_moe_host_pass *p = PyMem_Calloc(1, sizeof *p);
  if (!p) return PyErr_NoMemory();
  *p = (tdm_moe_host_pass){.ops = self->ops, .st = self->st, .q = mqueue(self), .x = P(x),
                           .idx = P(idx), .T = T, .k = k, .E = E, .H = H, .I = I,
                           .wofs = P(wofs), .wbase = P(wbase), .rows = P(rows), .slot = P(slot),
                           .groups = P(groups), .out = P(out), .workspace = P(ws),
                           .workspace_bytes = (size_t)ws_bytes};
  self->passes[self->npasses++] = p;
  return PyLong_FromLong(self->npasses);
}

static tdm_moe_host_pass *pass_of(tdmpy_state *st, MoeOpsObject *self, long h) {
  if (h < 1 || h > self->npasses) {
    PyErr_Format(st->errors[-TDM_EINVAL], "no host pass %ld on this MoeOps", h);
    return NULL;
  }
  return self->passes[h - 1];
}

/* host_call(host, handle): the pass runs as this queue's host call (moe_ops.h's host_call). */
static PyObject *moeops_host_call(MoeOpsObject *self, PyObject *args) {
  tdmpy_state *st = mstate(self);
  PyObject *host;
  long h;
  if (!PyArg_ParseTuple(args, "O!l:host_call", Py_TYPE(self), &host, &h) ||
      usable(st, self) < 0 || usable(st, (MoeOpsObject *)host) < 0)
    return NULL;
  tdm_moe_host_pass *p = pass_of(st, (MoeOpsObject *)host, h);
  if (!p) return NULL;
  if (!self->ops->host_call)
    return tdmpy_raise_msg(st, TDM_ENOTSUP, "this backend's table has no host_call()");
  if (!self->hosts && !(self->hosts = PyList_New(0))) return NULL;
  int kept = PySequence_Contains(self->hosts, host);
  if (kept < 0 || (!kept && PyList_Append(self->hosts, host) < 0)) return NULL;
  return done(st, self->ops->host_call(self->st, mqueue(self), tdm_moe_host_pass_run, p));
}

/* host_pass_status(handle) -> int: the pass's runs so far, once the calls have completed; its
 * first failure, if any, raised as the error it was. */
static PyObject *moeops_host_pass_status(MoeOpsObject *self, PyObject *arg) {
  tdmpy_state *st = mstate(self);
  long h = PyLong_AsLong(arg);
  if ((h == -1 && PyErr_Occurred()) || usable(st, self) < 0) return NULL;
  tdm_moe_host_pass *p = pass_of(st, self, h);
  if (!p) return NULL;
  if (p->status) return tdmpy_raise_msg(st, p->status, p->failure);
  return PyLong_FromLong(p->runs);
}

/* ---- graphs: handles are small integers ---------------------------------------------------- */

static PyObject *moeops_graph_begin(MoeOpsObject *self, PyObject *unused) {
  (void)unused;
  tdmpy_state *st = mstate(self);
  if (usable(st, self) < 0) return NULL;
  if (!self->ops->graph_begin)
    return tdmpy_raise_msg(st, TDM_ENOTSUP, "this backend's table records no graphs");
  return done(st, self->ops->graph_begin(self->st, mqueue(self)));
}

static PyObject *moeops_graph_end(MoeOpsObject *self, PyObject *unused) {
  (void)unused;
  tdmpy_state *st = mstate(self);
  if (usable(st, self) < 0) return NULL;
  if (!self->ops->graph_end)
    return tdmpy_raise_msg(st, TDM_ENOTSUP, "this backend's table records no graphs");
  int h = 0;
  while (h < MAX_GRAPHS && self->graphs[h]) h++;
  void *g = NULL;
  int rc = self->ops->graph_end(self->st, mqueue(self), &g);
  if (rc < 0) return tdmpy_raise(st, rc);
  if (h == MAX_GRAPHS) {
    self->ops->graph_free(self->st, g);
    return tdmpy_raise_msg(st, TDM_ENOMEM, "graph_end: 256 graphs are recorded and not freed");
  }
  self->graphs[h] = g;
  return PyLong_FromLong(h + 1);
}

static void *graph_of(tdmpy_state *st, MoeOpsObject *self, long h) {
  if (h < 1 || h > MAX_GRAPHS || !self->graphs[h - 1]) {
    PyErr_Format(st->errors[-TDM_EINVAL], "no graph %ld: not recorded, or freed", h);
    return NULL;
  }
  return self->graphs[h - 1];
}

static PyObject *moeops_graph_launch(MoeOpsObject *self, PyObject *arg) {
  tdmpy_state *st = mstate(self);
  long h = PyLong_AsLong(arg);
  if ((h == -1 && PyErr_Occurred()) || usable(st, self) < 0) return NULL;
  void *g = graph_of(st, self, h);
  if (!g) return NULL;
  return done(st, self->ops->graph_launch(self->st, mqueue(self), g));
}

static PyObject *moeops_graph_free(MoeOpsObject *self, PyObject *arg) {
  tdmpy_state *st = mstate(self);
  long h = PyLong_AsLong(arg);
  if ((h == -1 && PyErr_Occurred()) || usable(st, self) < 0) return NULL;
  void *g = graph_of(st, self, h);
  if (!g) return NULL;
  self->graphs[h - 1] = NULL;
  self->ops->graph_free(self->st, g);
  Py_RETURN_NONE;
}

/* ---- attributes ---------------------------------------------------------------------------- */

/* expert_bytes(fmt, H, I): one expert's bytes in fmt (tdm_moe_expert_size), 0 for rows that
 * are not whole blocks. */
static PyObject *moeops_expert_bytes(PyObject *cls, PyObject *args) {
  tdmpy_state *st = tdmpy_state_of_type((PyTypeObject *)cls);
  PyObject *fmt;
  int H, I;
  tdm_moe_wfmt f;
  if (!PyArg_ParseTuple(args, "Oii:expert_bytes", &fmt, &H, &I) || fmt_arg(st, fmt, &f) < 0)
    return NULL;
  return PyLong_FromSize_t(tdm_moe_expert_size(f, H, I));
}

static PyObject *moeops_workspace_bytes(PyObject *cls, PyObject *args) {
  (void)cls;
  int n, H, I;
  if (!PyArg_ParseTuple(args, "iii:workspace_bytes", &n, &H, &I)) return NULL;
  return PyLong_FromSize_t(tdm_moe_ops_workspace(n, H, I));
}

/* allocation(ptr) -> (base, nbytes): the tandem allocation that holds ptr (a Streamer's slot,
 * say: experts() takes its experts' weights as offsets from one allocation's base). */
static PyObject *moeops_allocation(PyObject *cls, PyObject *arg) {
  tdmpy_state *st = tdmpy_state_of_type((PyTypeObject *)cls);
  unsigned long long ptr;
  if (!ptr_arg(arg, &ptr) || tdmpy_check_live(st) < 0) return NULL;
  tdm_mem_info mi;
  int rc = tdm_mem_query(P(ptr), &mi);
  if (rc < 0) return tdmpy_raise(st, rc);
  if (!mi.base)
    return PyErr_Format(st->errors[-TDM_ENOENT], "allocation: %p is in no allocation tandem "
                        "knows", P(ptr));
  return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)mi.base, (Py_ssize_t)mi.size);
}

static PyObject *get_name(MoeOpsObject *self, void *c) {
  (void)c;
  return PyUnicode_FromString(self->ops->name);
}

static PyObject *get_gemm_rows(MoeOpsObject *self, void *c) {
  (void)c;
  return PyLong_FromLong(self->ops->experts_gemm_rows);
}

static PyObject *get_has(MoeOpsObject *self, void *c) {
  const tdm_moe_ops *o = self->ops;
  int which = (int)(intptr_t)c;
  return PyBool_FromLong(which == 1   ? o->experts_q != NULL
                         : which == 2 ? o->graph_begin != NULL
                                      : o->host_call != NULL);
}

static PyObject *get_queue(MoeOpsObject *self, void *c) {
  (void)c;
  if (!self->queue) Py_RETURN_NONE;
  return Py_NewRef(self->queue);
}

static PyMethodDef moeops_methods[] = {
    {"router", (PyCFunction)moeops_router, METH_VARARGS,
     "router(x, wr, bias, T, H, E, k, renorm, idx, weights)\n--\n\n"
     "Top-k routing of T tokens x (f32 [T x H]) by wr (bf16 [E x H]) and bias (f32 [E], or 0):\n"
     "idx (int32 [T x k]) and weights (f32 [T x k]), renormalized over the k when renorm."},
    {"group", (PyCFunction)moeops_group, METH_VARARGS,
     "group(idx, T, k, E, wofs, rows, slot, groups)\n--\n\n"
     "Groups the routing by expert on the device: rows and slot (int32 [T*k]) and groups\n"
     "(min(E, T*k) entries of 16 bytes), each entry's weights at wofs[e] (int64 [E], bf16\n"
     "elements from the experts' base)."},
    {"experts", (PyCFunction)(void (*)(void))moeops_experts, METH_VARARGS | METH_KEYWORDS,
     "experts(x, rows, slot, n, wbase, groups, G, H, I, out, workspace, workspace_bytes,\n"
     "        fmt=None)\n--\n\n"
     "The G entries of groups in one submission: out[slot] = SwiGLU expert of x[row]. fmt:\n"
     "None for bf16 experts, or (gate_up_type, down_type) for a file's blocks, each a name\n"
     "('f16', 'bf16', 'q8_0', 'q4_k', 'q6_k', 'mxfp4') or moe_ops.h's number; groups' w then\n"
     "counts 2-byte units from wbase (an expert starts at an even byte). Weights lie in\n"
     "wbase's tandem allocation; a wbase in none (16, say) lets the offsets name any memory\n"
     "the device reads, unchecked (on CUDA, pinned host memory is read in place)."},
    {"combine", (PyCFunction)moeops_combine, METH_VARARGS,
     "combine(y, out, weights, T, H, k)\n--\n\n"
     "y[t] += sum over j < k of weights[t*k + j] * out[t*k + j], j ascending."},
    {"upload", (PyCFunction)moeops_upload, METH_VARARGS,
     "upload(dst, src, nbytes)\n--\n\n"
     "nbytes of pinned host memory at src into device memory at dst, in stream order, read by\n"
     "the device's cores when the op runs (keep src unchanged until then)."},
    {"host_pass", (PyCFunction)moeops_host_pass, METH_VARARGS,
     "host_pass(x, idx, T, k, E, wofs, wbase, H, I, rows, slot, groups, out, workspace,\n"
     "          workspace_bytes) -> int\n--\n\n"
     "On a CPU table: a layer's host-placed experts over host buffers (tdm_moe_host_pass):\n"
     "group() of idx (int32 [T x k]; an index outside [0, E) is not the host's, its slot of\n"
     "out left as it was) with wofs (int64 [E], from wbase), then experts() of x (f32 [T x H])\n"
     "into out (f32 [T*k x H]). Kept until close(), which must wait until no device queue\n"
     "can still call it (nor a graph that holds a call). Returns its handle."},
    {"host_call", (PyCFunction)moeops_host_call, METH_VARARGS,
     "host_call(host, handle)\n--\n\n"
     "Runs host's pass `handle` on a host thread in this queue's stream order: after the\n"
     "work before it, with the work after it waiting. On CUDA a host function of the\n"
     "stream, so a CUDA graph captured from the stream calls it on every replay. host is\n"
     "kept alive as long as this MoeOps."},
    {"host_pass_status", (PyCFunction)moeops_host_pass_status, METH_O,
     "host_pass_status(handle) -> int\n--\n\n"
     "The pass's runs so far (read once its calls have completed); raises the first failure\n"
     "of a run, as the error it was."},
    {"graph_begin", (PyCFunction)moeops_graph_begin, METH_NOARGS,
     "graph_begin()\n--\n\nRecords the ops called from now on instead of running them."},
    {"graph_end", (PyCFunction)moeops_graph_end, METH_NOARGS,
     "graph_end() -> int\n--\n\nEnds a recording; returns the graph's handle."},
    {"graph_launch", (PyCFunction)moeops_graph_launch, METH_O,
     "graph_launch(handle)\n--\n\nRuns a recorded graph on the queue, in stream order."},
    {"graph_free", (PyCFunction)moeops_graph_free, METH_O,
     "graph_free(handle)\n--\n\nFrees a recorded graph."},
    {"close", (PyCFunction)moeops_close, METH_NOARGS,
     "close()\n--\n\nFrees the graphs and closes the state, after the queue's work."},
    {"allocation", (PyCFunction)moeops_allocation, METH_O | METH_CLASS,
     "allocation(ptr) -> (int, int)\n--\n\n"
     "The base and size of the tandem allocation that holds ptr."},
    {"expert_bytes", (PyCFunction)moeops_expert_bytes, METH_VARARGS | METH_CLASS,
     "expert_bytes(fmt, H, I) -> int\n--\n\n"
     "One expert's bytes in fmt ((gate_up_type, down_type)), laid out [Wg | Wu | Wd] by rows;\n"
     "0 where the rows are not whole blocks."},
    {"workspace_bytes", (PyCFunction)moeops_workspace_bytes, METH_VARARGS | METH_STATIC,
     "workspace_bytes(n, H, I) -> int\n--\n\n"
     "The workspace experts() needs for n rows (tdm_moe_ops_workspace)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef moeops_getset[] = {
    {"name", (getter)get_name, NULL, "The table's backend: 'cpu', 'cuda' or 'opencl'.", NULL},
    {"experts_gemm_rows", (getter)get_gemm_rows, NULL,
     "From how many rows experts() runs the table as GEMMs (0: never).", NULL},
    {"has_experts_q", (getter)get_has, NULL, "True where experts() takes fmt.", (void *)1},
    {"has_graphs", (getter)get_has, NULL, "True where graph_begin() records.", (void *)2},
    {"has_host_call", (getter)get_has, NULL, "True where host_call() runs.", (void *)3},
    {"queue", (getter)get_queue, NULL, "The Queue it was opened on (None once closed).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot moeops_slots[] = {
    {Py_tp_new, moeops_new},
    {Py_tp_dealloc, moeops_dealloc},
    {Py_tp_methods, moeops_methods},
    {Py_tp_getset, moeops_getset},
    {Py_tp_doc, "MoeOps(queue)\n--\n\n"
                "libtandem_moe's operations for queue's device, opened on queue\n"
                "(tandem/moe_ops.h)."},
    {0, NULL},
};

PyType_Spec tdmpy_moeops_spec = {
    .name = "tandem.MoeOps",
    .basicsize = sizeof(MoeOpsObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = moeops_slots,
};
