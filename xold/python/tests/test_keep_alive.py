"""Keep-alive: references dropped only once the work submitted before is done."""
import gc
import weakref

import numpy as np
import pytest

import tandem
from conftest import assert_same, eventually, random_floats, stall


class Payload:
    """A host array that a weakref can watch."""

    def __init__(self, arr):
        self.arr = arr

    def __buffer__(self, flags):  # Python 3.12+: the buffer protocol in Python
        return memoryview(self.arr)


def test_copy_keeps_its_source_alive(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, 1 << 16)
    src = x.copy()
    dev = tandem.malloc(x.nbytes, "device", device)
    out = np.full(x.size, np.nan, np.float32)
    dropped = []
    gate = stall(q, 0.3)
    copied = q.copy(dev, src)
    ref = weakref.ref(src, lambda r: dropped.append(copied.done))
    del src
    gc.collect()
    assert ref() is not None and not dropped, "dropped before the copy ran"
    q.copy(out, dev)
    q.synchronize()
    assert gate.done
    assert eventually(lambda: dropped), "never dropped"
    assert dropped == [True], "the weakref callback fired before the copy completed"
    assert_same(out, x)


def test_keep_alive_objects(device):
    q = tandem.Queue(device)
    fired = []

    class Obj:
        pass

    a, b = Obj(), Obj()
    gate = stall(q, 0.2)
    ka = q.keep_alive(a, b)
    refs = [weakref.ref(o, lambda r: fired.append(gate.done)) for o in (a, b)]
    del a, b
    gc.collect()
    assert all(r() is not None for r in refs) and not fired
    ka.wait()
    assert eventually(lambda: len(fired) == 2)
    assert fired == [True, True]


def test_keep_alive_with_deps(device):
    a = tandem.Queue(device)
    b = tandem.Queue(device)
    fired = []

    class Obj:
        pass

    o = Obj()
    gate = stall(a, 0.2)
    ka = b.keep_alive(o, deps=[gate])
    ref = weakref.ref(o, lambda r: fired.append(gate.done))
    del o
    gc.collect()
    assert ref() is not None
    ka.wait()
    assert eventually(lambda: fired) and fired == [True]


def test_buffer_freed_after_pending_copy(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, 1 << 14)
    out = np.full(x.size, np.nan, np.float32)
    buf = tandem.malloc(x.nbytes, "device", device)
    stall(q, 0.2)
    q.copy(buf, x)
    q.copy(out, buf)
    buf.free()  # the memory goes once the copies are done
    q.synchronize()
    assert_same(out, x)


@pytest.mark.parametrize("how", ["free", "del"])
def test_own_queue_buffers_outlive_pending_copies(device, rng, how):
    # Buffers of q used on q take no hold: their memory goes after q's pending work instead.
    q = tandem.Queue(device)
    x = random_floats(rng, 1 << 14)
    a = tandem.malloc(x.nbytes, "pinned", queue=q)
    b = tandem.malloc(x.nbytes, "pinned", queue=q)
    out = tandem.malloc(x.nbytes, "pinned", queue=q)
    q.copy(a, x)
    q.synchronize()
    stall(q, 0.2)
    q.copy(b, a)
    q.fill(a, 0x7F)
    q.copy(out, b)
    if how == "free":
        a.free()
        b.free()
    else:
        del a, b
        gc.collect()
    # Memory given back at once would be handed out again here and overwritten by the host.
    junk = [tandem.malloc(x.nbytes, "pinned", queue=q) for _ in range(4)]
    for j in junk:
        np.frombuffer(j, dtype=np.uint8)[:] = 0xFF
    q.synchronize()
    assert_same(np.frombuffer(out, dtype=np.float32), x)
