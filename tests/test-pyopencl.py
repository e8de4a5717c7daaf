#!/usr/bin/env python3
"""test-pyopencl.py: pyopencl as an external client of tandem's OpenCL backend.

pyopencl (a released package nobody here wrote) works in tandem's exported context:
1. it enqueues a kernel on tandem's exported queue, writing a buffer tandem allocated; tandem's
   sync must cover it (the kernel's event is complete right after tdm_queue_sync returns);
2. tandem adopts a queue pyopencl created and orders its own copy after pyopencl's kernel;
3. on an out-of-order tandem queue, the dependency list tandem hands out makes a pyopencl
   kernel wait for tandem's earlier copy.
Results are checked element by element on random data. Usage: test-pyopencl.py LIBTANDEM CASE
Exit 77 (skipped) when there is no opencl:0 device or pyopencl is missing.
"""
import ctypes as C
import sys

try:
    import numpy as np
    import pyopencl as cl
except ImportError as e:  # reported as skipped, visibly
    print(f"SKIP: pyopencl unavailable: {e}")
    sys.exit(77)

LIB, CASE = sys.argv[1], sys.argv[2]
tdm = C.CDLL(LIB)
P, VP, SZ = C.POINTER, C.c_void_p, C.c_size_t
for name, args in {
    "tdm_init": [], "tdm_device_find": [C.c_char_p, P(VP)], "tdm_device_native": [VP, P(VP)],
    "tdm_queue_create": [VP, C.c_uint, P(VP)], "tdm_queue_adopt": [VP, VP, C.c_uint, P(VP)],
    "tdm_queue_native": [VP, P(VP)], "tdm_queue_destroy": [VP], "tdm_queue_sync": [VP],
    "tdm_malloc": [VP, C.c_int, SZ, P(VP)], "tdm_free": [VP],
    "tdm_mem_native": [VP, P(VP), P(SZ)],
    "tdm_memcpy": [VP, VP, VP, SZ, C.c_int, SZ, P(VP), P(VP)],
    "tdm_queue_dependencies": [VP, P(VP), SZ, P(SZ)], "tdm_event_native": [VP, P(VP)],
    "tdm_event_release": [VP], "tdm_shutdown": [],
}.items():
    getattr(tdm, name).argtypes = args
    getattr(tdm, name).restype = C.c_int
tdm.tdm_last_error.restype = C.c_char_p
MEM_DEVICE, MEM_PINNED = 1, 2
COPY_H2D, COPY_D2H = 1, 2
QUEUE_OOO = 1


def ok(rc, what):
    if rc < 0:
        print(f"FAIL: {what} -> {rc}: {tdm.tdm_last_error().decode()}")
        sys.exit(1)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)


ok(tdm.tdm_init(), "tdm_init")
dev = VP()
if tdm.tdm_device_find(b"opencl:0", C.byref(dev)) < 0:
    print("SKIP: no opencl:0 device")
    sys.exit(77)
ctx_ptr = VP()
ok(tdm.tdm_device_native(dev, C.byref(ctx_ptr)), "tdm_device_native")
ctx = cl.Context.from_int_ptr(ctx_ptr.value)

N = 1 << 20
rng = np.random.default_rng(int.from_bytes(__import__("os").urandom(4), "little"))
SRC = """
__kernel void slow_affine(__global const float *x, __global float *y, int spin) {
  size_t i = get_global_id(0);
  float v = x[i];
  for (int k = 0; k < spin; k++) v = v * 0.999f + 0.001f;   /* keeps the device busy */
  y[i] = 2.0f * x[i] + 1.0f + 0.0f * v;
}
"""
prg = cl.Program(ctx, SRC).build()


def tandem_buffer(nbytes):
    p, mem, off = VP(), VP(), SZ()
    ok(tdm.tdm_malloc(dev, MEM_DEVICE, nbytes, C.byref(p)), "tdm_malloc")
    ok(tdm.tdm_mem_native(p, C.byref(mem), C.byref(off)), "tdm_mem_native")
    check(off.value == 0, "offset of an allocation's first byte is 0")
    return p, cl.Buffer.from_int_ptr(mem.value)


def read_back(q, p, nbytes):
    host = VP()
    ok(tdm.tdm_malloc(dev, MEM_PINNED, nbytes, C.byref(host)), "tdm_malloc pinned")
    ok(tdm.tdm_memcpy(q, host, p, nbytes, COPY_D2H, 0, None, None), "tdm_memcpy D2H")
    ok(tdm.tdm_queue_sync(q), "tdm_queue_sync")
    out = np.ctypeslib.as_array(C.cast(host, P(C.c_float)), shape=(nbytes // 4,)).copy()
    ok(tdm.tdm_free(host), "tdm_free")
    return out


x = rng.standard_normal(N).astype(np.float32)
expect = 2.0 * x + 1.0
xbuf = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=x)

if CASE == "sync_covers_kernel":
    q, qn = VP(), VP()
    ok(tdm.tdm_queue_create(dev, 0, C.byref(q)), "tdm_queue_create")
    ok(tdm.tdm_queue_native(q, C.byref(qn)), "tdm_queue_native")
    cq = cl.CommandQueue.from_int_ptr(qn.value)
    y, ybuf = tandem_buffer(N * 4)
    evt = prg.slow_affine(cq, (N,), None, xbuf, ybuf, np.int32(2000))
    ok(tdm.tdm_queue_sync(q), "tdm_queue_sync")
    check(evt.command_execution_status == cl.command_execution_status.COMPLETE,
          "tdm_queue_sync returned before pyopencl's kernel on the same queue completed")
    got = read_back(q, y, N * 4)
    check(np.array_equal(got, expect.astype(np.float32)), "kernel output differs")
    ok(tdm.tdm_free(y), "tdm_free")
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy")

elif CASE == "adopt_orders_after_kernel":
    cq = cl.CommandQueue(ctx)
    q = VP()
    ok(tdm.tdm_queue_adopt(dev, VP(cq.int_ptr), 0, C.byref(q)), "tdm_queue_adopt")
    y, ybuf = tandem_buffer(N * 4)
    prg.slow_affine(cq, (N,), None, xbuf, ybuf, np.int32(2000))
    got = read_back(q, y, N * 4)  # tandem's copy on the adopted queue follows the kernel
    check(np.array_equal(got, expect.astype(np.float32)), "copy did not follow the kernel")
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy")
    cq.finish()  # the queue is still pyopencl's and usable
    ok(tdm.tdm_free(y), "tdm_free")
    other = cl.Context(devices=ctx.devices)
    foreign = cl.CommandQueue(other)
    rc = tdm.tdm_queue_adopt(dev, VP(foreign.int_ptr), 0, C.byref(q))
    check(rc == -1, f"adopting a queue of another context gave {rc}, not TDM_EINVAL")

elif CASE == "ooo_dependencies":
    q, qn = VP(), VP()
    ok(tdm.tdm_queue_create(dev, QUEUE_OOO, C.byref(q)), "tdm_queue_create OOO")
    ok(tdm.tdm_queue_native(q, C.byref(qn)), "tdm_queue_native")
    cq = cl.CommandQueue.from_int_ptr(qn.value)
    src, xdev = VP(), None
    ok(tdm.tdm_malloc(dev, MEM_PINNED, N * 4, C.byref(src)), "tdm_malloc pinned")
    C.memmove(src, x.ctypes.data, N * 4)
    xin, xinbuf = tandem_buffer(N * 4)
    y, ybuf = tandem_buffer(N * 4)
    ok(tdm.tdm_memcpy(q, xin, src, N * 4, COPY_H2D, 0, None, None), "tdm_memcpy H2D")
    deps, n = (VP * 8)(), SZ()
    ok(tdm.tdm_queue_dependencies(q, deps, 8, C.byref(n)), "tdm_queue_dependencies")
    # n may be 0 when the copy has already completed (PoCL's basic driver runs it inline)
    waits = []
    for i in range(n.value):
        ne = VP()
        ok(tdm.tdm_event_native(deps[i], C.byref(ne)), "tdm_event_native")
        waits.append(cl.Event.from_int_ptr(ne.value))
    prg.slow_affine(cq, (N,), None, xinbuf, ybuf, np.int32(10), wait_for=waits)
    cq.finish()
    for i in range(n.value):
        ok(tdm.tdm_event_release(deps[i]), "tdm_event_release")
    got = read_back(q, y, N * 4)
    check(np.array_equal(got, expect.astype(np.float32)), "kernel ran before tandem's copy")
    for p in (src, xin, y):
        ok(tdm.tdm_free(p), "tdm_free")
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy")
else:
    print(f"unknown case {CASE}")
    sys.exit(2)

ok(tdm.tdm_shutdown(), "tdm_shutdown")
print(f"PASS {CASE}")
