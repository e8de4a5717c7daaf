"""Copies and fills: every kind of memory and operand, direction inferred, results checked
element by element on random data."""
import numpy as np
import pytest

import tandem
from conftest import assert_same, random_floats, stall

N = 1 << 16


@pytest.mark.parametrize("kind", ["device", "pinned", "host"])
def test_round_trip_numpy(device, rng, kind):
    q = tandem.Queue(device)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, kind, device)
    out = np.full(N, np.nan, np.float32)
    q.copy(buf, x)
    ev = q.copy(out, buf)
    ev.wait()
    assert ev.done and ev.error is None
    assert_same(out, x)


def test_device_to_device_and_partial(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, N)
    a = tandem.malloc(x.nbytes, "device", device)
    b = tandem.malloc(x.nbytes, "device", device)
    out = np.full(N, np.nan, np.float32)
    q.copy(a, x)
    q.copy(b, a)
    q.copy(out, b, nbytes=x.nbytes // 2)
    q.synchronize()
    assert_same(out[: N // 2], x[: N // 2])
    assert np.isnan(out[N // 2:]).all()


def test_fill(device, rng):
    q = tandem.Queue(device)
    value = int(rng.integers(1, 256))
    buf = tandem.malloc(4096, "device", device)
    out = np.zeros(4096, np.uint8)
    q.fill(buf, value)
    q.fill(buf, 0, nbytes=100)
    q.copy(out, buf)
    q.synchronize()
    want = np.full(4096, value, np.uint8)
    want[:100] = 0
    assert_same(out, want)


def test_buffer_protocol_views_without_copy(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, N)
    pinned = tandem.malloc(x.nbytes, "pinned", device)
    view = np.frombuffer(pinned, dtype=np.float32)
    assert view.ctypes.data == pinned.ptr  # the same memory, no copy
    dev = tandem.malloc(x.nbytes, "device", device)
    q.copy(dev, x)
    q.copy(pinned, dev)
    q.synchronize()
    assert_same(view, x)
    view[:] = -x  # writes through the view reach the buffer
    back = np.full(N, np.nan, np.float32)
    q.copy(dev, pinned)
    q.copy(back, dev)
    q.synchronize()
    assert_same(back, -x)


def test_device_memory_protocols(device):
    buf = tandem.malloc(64, "device", device)
    if device.host_memory:  # cpu: device memory is host memory
        assert len(memoryview(buf)) == 64
        assert buf.__dlpack_device__() == (1, 0)
    else:
        with pytest.raises(BufferError):
            memoryview(buf)
        with pytest.raises(BufferError):
            buf.__dlpack_device__()
    assert not hasattr(buf, "__cuda_array_interface__")


def test_dlpack_host_buffer(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, 1024)
    buf = tandem.malloc(x.nbytes, "pinned", device, queue=q)
    q.copy(buf, x)
    view = np.from_dlpack(buf).view(np.float32)  # waits for the copy on buf.queue
    assert_same(view, x)
    with pytest.raises(tandem.BusyError):
        buf.free()
    del view


def test_copy_bytes_and_memoryview(device, rng):
    q = tandem.Queue(device)
    data = bytes(rng.integers(1, 256, 256, dtype=np.uint8))
    dst = bytearray(256)
    buf = tandem.malloc(256, "device", device)
    q.copy(buf, data)
    q.copy(memoryview(dst), buf)
    q.synchronize()
    assert bytes(dst) == data


def test_deps_order_across_queues(device, rng):
    a = tandem.Queue(device)
    b = tandem.Queue(device)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", device)
    out = np.full(N, np.nan, np.float32)
    stall(a, 0.2)
    written = a.copy(buf, x)
    b.copy(out, buf, deps=[written])  # b waits for a's copy on the device
    b.synchronize()
    assert_same(out, x)


def test_out_of_order_queue_with_deps(device, rng):
    q = tandem.Queue(device, in_order=False)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", device)
    out = np.full(N, np.nan, np.float32)
    first = q.copy(buf, x)
    q.copy(out, buf, deps=[first])
    q.synchronize()
    assert_same(out, x)


def test_timing_elapsed(device):
    q = tandem.Queue(device, timing=True)
    start = q.record()
    stall(q, 0.05)
    end = q.record()
    end.wait()
    ms = start.elapsed(end)
    assert ms >= 40.0, ms
    untimed = tandem.Queue(device)
    a, b = untimed.record(), untimed.record()
    b.wait()
    with pytest.raises(tandem.NotSupportedError):
        a.elapsed(b)
    with pytest.raises(TypeError):
        a.elapsed(3)
