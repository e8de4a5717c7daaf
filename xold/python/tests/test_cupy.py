"""CuPy on tandem's CUDA queues (run by scripts/gpu-check; skipped without CuPy or a GPU).

The request's scenario: an array made by CuPy on tandem's queue, a RawKernel launched by
"user code" directly on the exported stream and never registered, then
SequentialOrderManager[q].wait() and a reduction that must see the kernel's result. Also
sync covering CuPy kernels, adoption of CuPy streams, __cuda_array_interface__ and DLPack
round trips, keep-alive of a CuPy array during an async copy, and CuPy events imported into
the order manager. Random data, never zeros; outputs poisoned with NaN first.
"""
import gc
import os
import time
import weakref

import numpy as np
import pytest

import tandem
from tandem import SequentialOrderManager
from conftest import assert_same, random_floats, stall
from gpu import need_cupy, need_event_import

N = 1 << 20
# Each thread runs SPIN dependent multiply-adds: about 0.1 s for the kernel on an H200.
SPIN = int(os.environ.get("TANDEM_CUPY_SPIN", "4000000"))

SLOW_ADD_ONE = r"""
extern "C" __global__ void slow_add_one(float *a, int n, int spin) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = a[i], v = x;
  for (int k = 0; k < spin; k++) v = v * 0.999f + 0.001f;   /* keeps the GPU busy */
  a[i] = (v > 1e30f) ? v : x + 1.0f;
}
"""


@pytest.fixture
def cupy_dev():
    return need_cupy()


def slow_add_one(cp):
    return cp.RawKernel(SLOW_ADD_ONE, "slow_add_one")


def launch(cp, kernel, a, spin=SPIN):
    kernel(((a.size + 255) // 256,), (256,), (a, cp.int32(a.size), cp.int32(spin)))


def external_stream(cp, q):
    version, handle = q.__cuda_stream__()
    assert version == 0 and handle == q.native
    return cp.cuda.ExternalStream(handle)


def test_scenario_order_manager_covers_unregistered_kernel(cupy_dev, rng):
    cp, dev = cupy_dev
    kernel = slow_add_one(cp)
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    with external_stream(cp, q):
        a = cp.asarray(x)                       # made by CuPy on tandem's queue
        launch(cp, kernel, a)                   # "user code": never registered
        ev = cp.cuda.Event(disable_timing=True)
        ev.record()
    running = not ev.done
    SequentialOrderManager[q].wait()
    assert ev.done, "the order manager's wait returned before the unregistered kernel"
    total = float(a.sum(dtype=cp.float64))      # CuPy's own stream, after the wait
    want = float((x.astype(np.float64) + 1).sum())
    assert abs(total - want) <= 1e-6 * max(1.0, abs(want)) * N ** 0.5
    assert_same(cp.asnumpy(a), x + np.float32(1))
    print(f"kernel running when wait() was called: {running}")


def test_synchronize_covers_kernel_and_copy_reads_cupy_array(cupy_dev, rng):
    cp, dev = cupy_dev
    kernel = slow_add_one(cp)
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    with external_stream(cp, q):
        y = cp.asarray(x)
        launch(cp, kernel, y)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record()
    q.synchronize()
    assert ev.done
    out = np.full(N, np.nan, np.float32)
    q.copy(out, y)                              # a CuPy array as the source (CAI)
    q.synchronize()
    assert_same(out, x + np.float32(1))


def test_adopt_cupy_stream(cupy_dev, rng):
    cp, dev = cupy_dev
    kernel = slow_add_one(cp)
    s = cp.cuda.Stream(non_blocking=True)
    q = tandem.Queue.adopt(s if hasattr(s, "__cuda_stream__") else s.ptr, device=dev)
    assert q.native == s.ptr and q.adopted
    x = random_floats(rng, N)
    with s:
        y = cp.asarray(x)
        launch(cp, kernel, y)
    out = np.full(N, np.nan, np.float32)
    q.copy(out, y)                              # follows CuPy's kernel on the stream
    q.synchronize()
    assert_same(out, x + np.float32(1))
    w = random_floats(rng, N)
    with s:
        z = cp.full(N, cp.nan, dtype=cp.float32)
    q.copy(z, w)                                # tandem's copy, then CuPy's kernel
    with s:
        z1 = z + cp.float32(1)
    assert_same(cp.asnumpy(z1, stream=s), w + np.float32(1))
    q.destroy()
    with s:                                     # still CuPy's stream
        twice = y * cp.float32(2)
    s.synchronize()
    assert_same(cp.asnumpy(twice), (x + np.float32(1)) * np.float32(2))


@pytest.mark.parametrize("handle", [0, 1, 2])
def test_adopt_refuses_pseudo_streams(cupy_dev, handle):
    cp, dev = cupy_dev
    with pytest.raises(tandem.InvalidArgumentError):
        tandem.Queue.adopt(handle, device=dev)
    tandem.Queue(dev).synchronize()


def test_cuda_array_interface_round_trip(cupy_dev, rng):
    cp, dev = cupy_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", dev, queue=q)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["stream"] == q.native and cai["data"][0] == buf.ptr
    stall(q, 0.2)
    q.copy(buf, x)
    a = cp.asarray(buf).view(cp.float32)        # CuPy waits for q (the CAI stream)
    assert a.data.ptr == buf.ptr                # the same memory
    assert_same(cp.asnumpy(a), x)
    a *= 2                                      # CuPy's stream
    cp.cuda.get_current_stream().synchronize()
    out = np.full(N, np.nan, np.float32)
    q.copy(out, buf)
    q.synchronize()
    assert_same(out, x * np.float32(2))


@pytest.mark.parametrize("consumer", ["legacy", "non_blocking"])
def test_dlpack_round_trip(cupy_dev, rng, consumer):
    # The legacy default stream is ordered on the host, any other stream on the device; the
    # copy from pageable memory runs on tandem's thread, which a synchronous legacy-stream call
    # waiting for it device-side would block (tandem/cuda.h).
    cp, dev = cupy_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", dev, queue=q)
    assert buf.__dlpack_device__() == (2, dev.native)
    stall(q, 0.2)
    q.copy(buf, x)
    s = cp.cuda.Stream(non_blocking=True) if consumer == "non_blocking" else cp.cuda.Stream.null
    with s:
        a = cp.from_dlpack(buf).view(cp.float32)    # ordered after q's copy
        assert a.data.ptr == buf.ptr
        assert_same(cp.asnumpy(a, stream=s), x)
    with pytest.raises(tandem.BusyError):
        buf.free()                              # a DLPack tensor of it is alive
    # CuPy arrays as copy operands, DLPack-only
    src = cp.asarray(random_floats(rng, N))
    q.copy(buf, src)
    out = np.full(N, np.nan, np.float32)
    q.copy(out, buf)
    q.synchronize()
    assert_same(out, cp.asnumpy(src))


def test_keep_alive_of_cupy_array_during_async_copy(cupy_dev, rng):
    cp, dev = cupy_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    src = cp.asarray(x)
    cp.cuda.get_current_stream().synchronize()
    out = np.full(N, np.nan, np.float32)
    gate = stall(q, 0.3)
    q.copy(out, src)
    try:
        ref = weakref.ref(src)
    except TypeError:
        ref = None
    del src
    gc.collect()
    if ref is not None:
        assert ref() is not None, "the CuPy array was dropped before the copy ran"
    # Memory a dropped array gave back to CuPy's pool would be reused and overwritten here.
    junk = [cp.full(N, -7.0, dtype=cp.float32) for _ in range(4)]
    cp.cuda.get_current_stream().synchronize()
    q.synchronize()
    assert gate.done
    assert_same(out, x)
    del junk


@need_event_import
def test_cupy_events_in_the_order_manager(cupy_dev, rng):
    cp, dev = cupy_dev
    kernel = slow_add_one(cp)
    s = cp.cuda.Stream(non_blocking=True)       # CuPy's own stream, not tandem's
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    with s:
        a = cp.asarray(x)
        launch(cp, kernel, a)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(s)
    som = SequentialOrderManager[q]
    som.add_event(ev)                           # imported: tandem now orders after it
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a, deps=som.submitted_events)
    som.wait()
    assert_same(out, x + np.float32(1))
    q2 = tandem.Queue(dev)
    with s:
        launch(cp, kernel, a, spin=SPIN // 4)
        ev2 = cp.cuda.Event(disable_timing=True)
        ev2.record(s)
    q2.wait(ev2)                                # device-side wait on a CuPy event
    q2.copy(out, a)
    q2.synchronize()
    assert_same(out, (x + np.float32(1)) + np.float32(1))  # two launches, rounded twice
