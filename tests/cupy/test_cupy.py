#!/usr/bin/env python3
"""test_cupy.py: CuPy as an external client of tandem's CUDA backend.

CuPy (a released package nobody here wrote) works on tandem's streams:
1. sync_covers_kernel: a deliberately slow CuPy kernel runs on tandem's exported stream
   (cupy.cuda.ExternalStream); right after tdm_queue_sync returns, a CuPy event recorded after
   the kernel is done, and the kernel's output, copied back by tandem (tdm_mem_import of the
   CuPy array, tdm_memcpy D2H on the same queue), equals 2x + 1 element by element;
2. adopt_orders_after_kernel: tandem adopts a stream CuPy created and orders its own D2H copy of
   a CuPy array after CuPy's slow kernel on it; the other way round, a CuPy kernel on that
   stream reads what tandem's H2D copy wrote; after the wrapper is destroyed, the stream is still
   CuPy's and usable;
3. adopt_refuses_pseudo_streams: adopting cupy.cuda.Stream.null (0), cudaStreamLegacy (1) or
   cudaStreamPerThread (2) is refused with TDM_EINVAL and writes no queue.
Random data (never zeros), outputs poisoned with NaN first. Usage: test_cupy.py LIBTANDEM CASE
Exit 77 (skipped) when CuPy, a CUDA GPU or tandem's cuda:0 device is missing.
"""
import ctypes as C
import os
import sys

if len(sys.argv) != 3:
    print(__doc__)
    sys.exit(2)
LIB, CASE = sys.argv[1], sys.argv[2]
CASES = ("sync_covers_kernel", "adopt_orders_after_kernel", "adopt_refuses_pseudo_streams")
if CASE not in CASES:
    print(f"unknown case {CASE}; cases: {', '.join(CASES)}")
    sys.exit(2)

try:
    import numpy as np
    import cupy as cp
except ImportError as e:  # reported as skipped, visibly
    print(f"SKIP: CuPy unavailable: {e}")
    sys.exit(77)
try:
    if cp.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device")
except Exception as e:  # cupy raises CUDARuntimeError when there is no driver or GPU
    print(f"SKIP: CuPy sees no CUDA GPU: {e}")
    sys.exit(77)

tdm = C.CDLL(LIB)
P, VP, SZ = C.POINTER, C.c_void_p, C.c_size_t
for name, args in {
    "tdm_init": [], "tdm_device_find": [C.c_char_p, P(VP)], "tdm_device_native": [VP, P(VP)],
    "tdm_queue_create": [VP, C.c_uint, P(VP)], "tdm_queue_adopt": [VP, VP, C.c_uint, P(VP)],
    "tdm_queue_native": [VP, P(VP)], "tdm_queue_destroy": [VP], "tdm_queue_sync": [VP],
    "tdm_malloc": [VP, C.c_int, SZ, P(VP)], "tdm_free": [VP],
    "tdm_mem_import": [VP, VP, SZ, P(VP)],
    "tdm_memcpy": [VP, VP, VP, SZ, C.c_int, SZ, P(VP), P(VP)],
    "tdm_backend_count": [P(C.c_int)], "tdm_shutdown": [],
}.items():
    getattr(tdm, name).argtypes = args
    getattr(tdm, name).restype = C.c_int
tdm.tdm_last_error.restype = C.c_char_p
tdm.tdm_err_name.argtypes = [C.c_int]
tdm.tdm_err_name.restype = C.c_char_p
MEM_PINNED = 2
COPY_H2D, COPY_D2H = 1, 2
EINVAL = -1


class BackendInfo(C.Structure):  # tdm_backend_info
    _fields_ = [("name", C.c_char * 16), ("status", C.c_int), ("device_count", C.c_int),
                ("detail", C.c_char * 256)]


tdm.tdm_backend_get.argtypes = [C.c_int, P(BackendInfo)]
tdm.tdm_backend_get.restype = C.c_int


def ok(rc, what):
    if rc < 0:
        msg = tdm.tdm_last_error().decode()  # before any other tandem call
        print(f"FAIL: {what} -> {tdm.tdm_err_name(rc).decode()}: {msg}")
        sys.exit(1)


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}")
        sys.exit(1)


def cuda_backend_status():
    n = C.c_int()
    if tdm.tdm_backend_count(C.byref(n)) < 0:
        return "unknown"
    for i in range(n.value):
        b = BackendInfo()
        if tdm.tdm_backend_get(i, C.byref(b)) == 0 and b.name == b"cuda":
            return (f"status {tdm.tdm_err_name(b.status).decode()}, {b.device_count} devices, "
                    f"{b.detail.decode(errors='replace')}")
    return "not known to tandem"


ok(tdm.tdm_init(), "tdm_init")
dev = VP()
if tdm.tdm_device_find(b"cuda:0", C.byref(dev)) < 0:
    print(f"SKIP: no cuda:0 device: {tdm.tdm_last_error().decode()} "
          f"(cuda backend: {cuda_backend_status()})")
    sys.exit(77)
native = VP()
ok(tdm.tdm_device_native(dev, C.byref(native)), "tdm_device_native")
ordinal = C.cast(native, P(C.c_int)).contents.value
cp.cuda.Device(ordinal).use()

N = 1 << 20
NBYTES = N * 4
# Each thread runs SPIN dependent multiply-adds: about 0.1 s for the whole kernel on an H200.
SPIN = int(os.environ.get("TANDEM_CUPY_SPIN", "4000000"))
seed = int.from_bytes(os.urandom(4), "little")
rng = np.random.default_rng(seed)
print(f"{CASE}: cuda:0 is CUDA device {ordinal}, CuPy {cp.__version__}, seed {seed}")

# v stays between min(x, 1) and max(x, 1), so y is always 2x + 1; the compiler cannot know
# that, so it must run the loop.
slow_affine = cp.ElementwiseKernel(
    "float32 x, int32 spin", "float32 y",
    """
    float v = x;
    for (int k = 0; k < spin; k++) v = v * 0.999f + 0.001f;
    y = (v > 1e30f) ? v : 2.0f * x + 1.0f;
    """,
    "tandem_slow_affine")


def random_floats():
    x = rng.standard_normal(N).astype(np.float32)
    x[x == 0] = 0.5  # never zeros
    return x


def pinned(nbytes):
    p = VP()
    ok(tdm.tdm_malloc(dev, MEM_PINNED, nbytes, C.byref(p)), "tdm_malloc pinned")
    return p, np.ctypeslib.as_array(C.cast(p, P(C.c_float)), shape=(nbytes // 4,))


def imported(arr):
    p = VP()
    ok(tdm.tdm_mem_import(dev, VP(arr.data.ptr), arr.nbytes, C.byref(p)), "tdm_mem_import")
    return p


def read_back(q, p, host, view, before_sync=None):
    """D2H of NBYTES from tandem pointer p on q into pinned host (view: its numpy view), then
    sync; returns a numpy copy. The pinned buffer is allocated before any kernel is launched,
    since allocating or freeing pinned memory may wait for the device."""
    view[:] = np.nan
    ok(tdm.tdm_memcpy(q, host, p, NBYTES, COPY_D2H, 0, None, None), "tdm_memcpy D2H")
    if before_sync:
        before_sync()
    ok(tdm.tdm_queue_sync(q), "tdm_queue_sync after the D2H copy")
    return view.copy()


def same(got, want, what):
    bad = np.flatnonzero(got != want)  # NaN != NaN, so unwritten (poisoned) elements count
    check(bad.size == 0, f"{what}: {bad.size} of {want.size} elements differ, the first at "
          f"{bad[0] if bad.size else -1}: got {got[bad[0]] if bad.size else 0!r}, "
          f"want {want[bad[0]] if bad.size else 0!r}")


def release_cupy_memory():
    cp.get_default_memory_pool().free_all_blocks()


if CASE == "sync_covers_kernel":
    q, qn = VP(), VP()
    ok(tdm.tdm_queue_create(dev, 0, C.byref(q)), "tdm_queue_create")
    ok(tdm.tdm_queue_native(q, C.byref(qn)), "tdm_queue_native")
    check(qn.value not in (None, 1, 2), f"tdm_queue_native gave a pseudo-stream {qn.value}")
    stream = cp.cuda.ExternalStream(qn.value)
    x_host = random_floats()
    expect = x_host * np.float32(2) + np.float32(1)
    host, view = pinned(NBYTES)
    with stream:
        x = cp.asarray(x_host)
        y = cp.full(N, cp.nan, dtype=cp.float32)
        slow_affine(x, np.int32(SPIN), y)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream)
    running = not ev.done
    ok(tdm.tdm_queue_sync(q), "tdm_queue_sync")
    check(ev.done, "tdm_queue_sync returned before CuPy's kernel on tandem's stream completed")
    if not running:
        print("NOTE: the kernel had already finished before tdm_queue_sync was called, so this "
              "run does not show that sync waits for it; raise TANDEM_CUPY_SPIN")
    yp = imported(y)
    same(read_back(q, yp, host, view), expect, "CuPy kernel output read back by tandem")
    ok(tdm.tdm_free(yp), "tdm_free of the imported CuPy array")
    ok(tdm.tdm_free(host), "tdm_free pinned")
    stream.synchronize()
    del x, y, ev
    release_cupy_memory()
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy")
    print(f"kernel still running when tdm_queue_sync was called: {'yes' if running else 'no'}")

elif CASE == "adopt_orders_after_kernel":
    s = cp.cuda.Stream(non_blocking=True)
    q = VP()
    ok(tdm.tdm_queue_adopt(dev, VP(s.ptr), 0, C.byref(q)), "tdm_queue_adopt of a CuPy stream")
    qn = VP()
    ok(tdm.tdm_queue_native(q, C.byref(qn)), "tdm_queue_native")
    check(qn.value == s.ptr, f"the adopted queue exports {qn.value}, not CuPy's stream {s.ptr}")
    # CuPy's kernel, then tandem's copy of its output, on one stream and no host wait between.
    x_host = random_floats()
    expect = x_host * np.float32(2) + np.float32(1)
    host, view = pinned(NBYTES)
    src, src_view = pinned(NBYTES)
    with s:
        x = cp.asarray(x_host)
        y = cp.full(N, cp.nan, dtype=cp.float32)
    yp = imported(y)
    with s:
        slow_affine(x, np.int32(SPIN), y)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(s)
    state = {}
    got = read_back(q, yp, host, view, lambda: state.update(running=not ev.done))
    same(got, expect, "tandem's copy did not follow CuPy's kernel on the stream")
    print(f"kernel still running when tandem's copy was submitted: "
          f"{'yes' if state['running'] else 'no (raise TANDEM_CUPY_SPIN)'}")
    # tandem's copy, then a CuPy kernel reading what it wrote.
    w_host = random_floats()
    src_view[:] = w_host
    with s:
        z = cp.full(N, cp.nan, dtype=cp.float32)
    zp = imported(z)
    ok(tdm.tdm_memcpy(q, zp, src, NBYTES, COPY_H2D, 0, None, None), "tdm_memcpy H2D")
    with s:
        z1 = z + cp.float32(1)
    z1_host = cp.asnumpy(z1, stream=s)
    s.synchronize()
    same(z1_host, w_host + np.float32(1), "CuPy's kernel did not follow tandem's copy")
    for p in (yp, zp, src, host):
        ok(tdm.tdm_free(p), "tdm_free")
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy of the adopted queue")
    # The stream is still CuPy's: tandem must not have destroyed it.
    with s:
        twice = y * cp.float32(2)
    s.synchronize()
    same(cp.asnumpy(twice), expect * np.float32(2), "CuPy's stream after the wrapper was destroyed")
    del x, y, z, z1, twice, ev
    release_cupy_memory()

elif CASE == "adopt_refuses_pseudo_streams":
    ptds = getattr(cp.cuda.Stream, "ptds", None)
    pseudo = [
        (cp.cuda.Stream.null.ptr, "cupy.cuda.Stream.null"),
        (1, "cudaStreamLegacy"),
        (ptds.ptr if ptds is not None else 2, "cudaStreamPerThread"),
    ]
    check(pseudo[0][0] == 0, f"cupy.cuda.Stream.null.ptr is {pseudo[0][0]}, expected 0")
    check(pseudo[2][0] == 2, f"CuPy's per-thread default stream is {pseudo[2][0]}, expected 2")
    for ptr, what in pseudo:
        q = VP()
        rc = tdm.tdm_queue_adopt(dev, VP(ptr), 0, C.byref(q))
        msg = tdm.tdm_last_error().decode()  # before any other tandem call
        check(rc == EINVAL, f"adopting {what} ({ptr}) gave {tdm.tdm_err_name(rc).decode()} "
              f"({msg}), not TDM_EINVAL")
        check(not q.value, f"adopting {what} failed but wrote a queue")
        print(f"adopting {what} ({ptr}) refused: {msg}")
    # tandem is still fine after the refusals.
    q = VP()
    ok(tdm.tdm_queue_create(dev, 0, C.byref(q)), "tdm_queue_create after the refusals")
    ok(tdm.tdm_queue_sync(q), "tdm_queue_sync")
    ok(tdm.tdm_queue_destroy(q), "tdm_queue_destroy")

ok(tdm.tdm_shutdown(), "tdm_shutdown")
print(f"PASS {CASE}")
