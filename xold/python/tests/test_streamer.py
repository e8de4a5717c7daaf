"""tandem.Streamer: experts streamed from host Buffers into device slots. Every acquired slot
is copied back through the compute queue and compared element by element with the expert's
random data; the statistics are checked after sequences that force each outcome (a resident
hit, an in-flight hit behind a gated copy queue, a miss); errors, closing and the lifetime of
the host Buffers."""
import gc
import threading

import numpy as np
import pytest

import tandem
from conftest import assert_same, random_floats

LAYERS, EXPERTS = 3, 4
FLOATS = 2048  # floats per expert
EB = FLOATS * 4  # expert bytes
KEYS = LAYERS * EXPERTS

STAT_KEYS = {"acquires", "hits", "misses", "resident_hits", "inflight_hits", "prefetches",
             "prefetch_hits", "prefetch_dropped", "bytes_copied", "resident_slots",
             "staging_slots", "prefetch_depth", "device_bytes"}


def make_host(device, rng, kind="pinned"):
    """One Buffer with every expert back to back, key-major, and the data it holds."""
    data = random_floats(rng, KEYS * FLOATS).reshape(KEYS, FLOATS)
    host = tandem.malloc(data.nbytes, kind, device)
    np.frombuffer(host, np.float32)[:] = data.ravel()
    return host, data


def read_slot(s, q, layer, e):
    """Acquires the expert, copies its slot back through the compute queue, releases it
    (alternately after a tandem event and after all compute work) and returns the floats."""
    ptr, ready = s.acquire(layer, e)
    assert isinstance(ready, tandem.Event)
    view = s.slot_view(layer, e)
    assert view.ptr == ptr and view.nbytes == EB and view.queue is q
    out = np.full(FLOATS, np.nan, np.float32)
    done = q.copy(out, view)
    s.release(layer, e, done if (layer + e) % 2 else None)
    q.synchronize()
    assert ready.done and ready.error is None
    return out


def check_stats(s, resident, inflight, misses):
    st = s.stats()
    assert set(st) == STAT_KEYS
    assert (st["resident_hits"], st["inflight_hits"], st["misses"]) == (resident, inflight, misses)
    assert st["hits"] == resident + inflight
    assert st["acquires"] == resident + inflight + misses
    return st


@pytest.mark.parametrize("policy", ["static", "lru"])
@pytest.mark.parametrize("budget", [0, 5, KEYS])  # in experts: none, some, all
def test_every_expert_round_trips(device, rng, policy, budget):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    with tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=budget * EB,
                         staging_slots=2, policy=policy) as s:
        for rep in range(2):
            for layer in range(LAYERS):
                for e in range(EXPERTS):
                    assert_same(read_slot(s, q, layer, e), data[layer * EXPERTS + e])
        st = s.stats()
        assert st["acquires"] == 2 * KEYS
        assert st["hits"] + st["misses"] == st["acquires"]
        assert st["device_bytes"] == (budget + 2) * EB
        if policy == "static" and budget == KEYS:
            assert st["misses"] == 0 and st["bytes_copied"] == 0  # all resident from creation
        if budget == 0:
            assert st["misses"] == 2 * KEYS  # every change of expert copies again
        assert s.acquired == 0
    assert s.closed


def test_host_as_one_buffer_per_expert(device, rng):
    q = tandem.Queue(device)
    data = random_floats(rng, KEYS * FLOATS).reshape(KEYS, FLOATS)
    bufs = []
    for k in range(KEYS):
        b = tandem.malloc(EB + 64 * (k % 2), "pinned" if k % 3 else "host", device)
        np.frombuffer(b, np.float32)[:FLOATS] = data[k]
        bufs.append(b)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, bufs, budget_bytes=2 * EB, policy="lru")
    for k in reversed(range(KEYS)):
        assert_same(read_slot(s, q, k // EXPERTS, k % EXPERTS), data[k])
    s.close()
    s.close()  # again: nothing


def test_stats_resident_inflight_miss(device, rng):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=2 * EB, staging_slots=2,
                        policy="lru", prefetch_depth=2)
    demand, prefetch = s.queues
    check_stats(s, 0, 0, 0)
    # A miss, then, once the copy queues are drained, a resident hit.
    assert_same(read_slot(s, q, 1, 2), data[1 * EXPERTS + 2])
    check_stats(s, 0, 0, 1)
    demand.synchronize()
    prefetch.synchronize()
    assert_same(read_slot(s, q, 1, 2), data[1 * EXPERTS + 2])
    check_stats(s, 1, 0, 1)
    # A prefetch held back behind a gate on the prefetch queue: acquired before it can land.
    gate = threading.Event()
    held = prefetch.host_task(gate.wait, 30)
    s.prefetch(2, [3])
    ptr, ready = s.acquire(2, 3)
    assert not ready.done
    st = check_stats(s, 1, 1, 1)
    assert st["prefetches"] == 1 and st["prefetch_hits"] == 1
    out = np.full(FLOATS, np.nan, np.float32)
    q.copy(out, s.slot_view(2, 3))  # the compute queue waits for the copy on the device
    s.release(2, 3)
    gate.set()
    q.synchronize()
    held.wait()
    assert_same(out, data[2 * EXPERTS + 3])
    # The same with an earlier demand copy: released and acquired again before it lands.
    gate = threading.Event()
    held = demand.host_task(gate.wait, 30)
    s.acquire(0, 1)
    s.release(0, 1)
    ptr, ready = s.acquire(0, 1)
    assert not ready.done
    check_stats(s, 1, 2, 2)
    q.copy(out, s.slot_view(0, 1))
    s.release(0, 1, q.record())
    gate.set()
    q.synchronize()
    held.wait()
    assert_same(out, data[0 * EXPERTS + 1])
    st = s.stats()
    assert st["bytes_copied"] == 3 * EB
    s.reset_stats()
    check_stats(s, 0, 0, 0)
    s.close()


def test_schedule_and_prefetch(device, rng):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=EB, staging_slots=2,
                        resident=[0], prefetch_depth=1)
    s.prefetch(0, [2, 3])  # depth 1: one copy, one dropped
    st = s.stats()
    assert st["prefetches"] == 1 and st["prefetch_dropped"] == 1
    order = [3, 2, 1, 0]
    got = s.schedule(0, order)
    assert got is not order and order == [3, 2, 1, 0]
    assert sorted(got) == [0, 1, 2, 3]
    assert got[0] == 2  # the staged expert comes first
    assert s.schedule(1, []) == []
    for e in got:
        assert_same(read_slot(s, q, 0, e), data[e])
    s.close()


def test_errors(device, rng):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    with pytest.raises(TypeError):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, np.zeros(KEYS * FLOATS, np.float32))
    with pytest.raises(TypeError):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, [host] * (KEYS - 1) + [object()])
    with pytest.raises(TypeError):
        tandem.Streamer("not a queue", LAYERS, EXPERTS, EB, host)
    with pytest.raises(ValueError, match="bytes"):
        tandem.Streamer(q, LAYERS + 1, EXPERTS, EB, host)  # too small for every expert
    with pytest.raises(ValueError, match="layers \\* experts"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, [host] * 3)
    small = tandem.malloc(EB - 4, "pinned", device)
    with pytest.raises(ValueError, match=r"host\[1\]"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, [host, small] + [host] * (KEYS - 2))
    with pytest.raises(ValueError, match="device memory"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, tandem.malloc(KEYS * EB, "device", device))
    with pytest.raises(ValueError, match="policy"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, host, policy="lfu")
    with pytest.raises(ValueError, match="resident"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=EB, resident=[KEYS])
    with pytest.raises(ValueError):
        tandem.Streamer(q, 0, EXPERTS, EB, host)
    with pytest.raises(tandem.InvalidArgumentError, match="staging slot"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, host, staging_slots=0)
    with pytest.raises(tandem.InvalidArgumentError, match="cannot hold"):
        tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=EB // 2)

    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, staging_slots=1)
    for bad in [(LAYERS, 0), (0, EXPERTS), (-1, 0)]:
        with pytest.raises(tandem.InvalidArgumentError, match="does not exist"):
            s.acquire(*bad)
    with pytest.raises(tandem.InvalidArgumentError):
        s.prefetch(0, [EXPERTS])
    with pytest.raises(tandem.InvalidArgumentError):
        s.schedule(0, [0, EXPERTS])
    with pytest.raises(tandem.StateError):
        s.release(0, 0)  # never acquired
    with pytest.raises(tandem.StateError):
        s.slot_view(0, 0)
    s.acquire(0, 0)
    with pytest.raises(tandem.BusyError):
        s.acquire(0, 1)  # the one slot is pinned
    with pytest.raises(tandem.BusyError):
        s.close()  # an expert is acquired
    with pytest.raises(tandem.BusyError):
        q.destroy()  # the streamer computes on it
    demand, prefetch = s.queues
    assert s.queues == (demand, prefetch)
    with pytest.raises(tandem.BusyError):
        demand.destroy()  # the streamer's
    view = s.slot_view(0, 0)
    assert s.slot_view(0, 0) is view
    s.release(0, 0)
    assert view.released
    with pytest.raises(tandem.HandleError, match="slot view"):
        q.copy(np.zeros(FLOATS, np.float32), view)
    assert s.stats()["acquires"] == 1
    s.close()
    assert s.closed and s.compute is None
    for call in [lambda: s.acquire(0, 0), lambda: s.release(0, 0), lambda: s.prefetch(0, [1]),
                 lambda: s.schedule(0, [1]), s.stats, s.reset_stats, lambda: s.queues,
                 lambda: s.slot_view(0, 0)]:
        with pytest.raises(tandem.StateError, match="closed"):
            call()
    with pytest.raises(tandem.HandleError):
        demand.synchronize()  # gone with the streamer
    demand.destroy()  # nothing to do any more
    s.close()
    q.destroy()  # nobody borrows it now


def test_host_buffers_kept_alive(device, rng):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    extra = tandem.malloc(EB, "pinned", device)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, policy="lru")
    host.free()  # deferred: the streamer still copies from it
    assert host.released
    del host
    gc.collect()
    for k in range(KEYS):
        assert_same(read_slot(s, q, k // EXPERTS, k % EXPERTS), data[k])
    bufs = [tandem.malloc(EB, "pinned", device) for _ in range(KEYS)]
    for k, b in enumerate(bufs):
        np.frombuffer(b, np.float32)[:] = data[k]
    s2 = tandem.Streamer(q, LAYERS, EXPERTS, EB, bufs)
    del bufs, b
    gc.collect()
    assert_same(read_slot(s2, q, 2, 1), data[2 * EXPERTS + 1])
    s.close()
    s2.close()
    extra.free()


def test_slot_view_on_host_memory_devices(cpu, rng):
    q = tandem.Queue(cpu)
    host, data = make_host(cpu, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host)
    s.acquire(1, 1)
    q.synchronize()
    arr = np.frombuffer(s.slot_view(1, 1), np.float32)  # the slot itself, no copy
    assert_same(arr, data[EXPERTS + 1])
    s.release(1, 1)
    with pytest.raises(tandem.BusyError, match="view a slot"):
        s.close()  # the array still reads the slot's memory
    del arr
    s.close()


def test_dealloc_with_experts_acquired(device, rng):
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host)
    s.acquire(0, 0)
    demand, _ = s.queues
    del s
    gc.collect()
    with pytest.raises(tandem.HandleError):
        demand.record()
    q.synchronize()
    q.destroy()


def test_release_after_pyopencl_event(opencl, rng):
    """A foreign event as `done`: the slot's reuse waits for a pyopencl marker on the compute
    queue, and the expert read before it is intact."""
    cl = pytest.importorskip("pyopencl")
    q = tandem.Queue(opencl)
    host, data = make_host(opencl, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, staging_slots=1)
    clq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)
    outs = []
    for k in range(3):
        s.acquire(0, k)
        out = np.full(FLOATS, np.nan, np.float32)
        q.copy(out, s.slot_view(0, k))
        outs.append(out)
        s.release(0, k, cl.enqueue_marker(clq))  # the next acquire reuses the one slot
    q.synchronize()
    for k in range(3):
        assert_same(outs[k], data[k])
    assert s.stats()["misses"] == 3
    s.close()


def test_threads_share_a_streamer(device, rng):
    """Four threads acquire, read and release experts at once (one slot each at most, so no
    acquire is refused); every read sees its expert and every acquire is counted once."""
    q = tandem.Queue(device)
    host, data = make_host(device, rng)
    s = tandem.Streamer(q, LAYERS, EXPERTS, EB, host, staging_slots=4, policy="lru")
    seeds = rng.integers(0, 1 << 31, 4)
    errors = []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(20):
                k = int(r.integers(0, KEYS))
                s.acquire(k // EXPERTS, k % EXPERTS)
                out = np.full(FLOATS, np.nan, np.float32)
                done = q.copy(out, s.slot_view(k // EXPERTS, k % EXPERTS))
                s.release(k // EXPERTS, k % EXPERTS, done)
                done.wait()
                assert_same(out, data[k])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(int(sd),)) for sd in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    st = s.stats()
    assert st["acquires"] == 80 and st["hits"] + st["misses"] == 80
    s.close()


def test_out_of_order_compute_queue(device, rng):
    q = tandem.Queue(device, in_order=False)
    host, data = make_host(device, rng)
    with tandem.Streamer(q, LAYERS, EXPERTS, EB, host, budget_bytes=3 * EB, staging_slots=1,
                         policy="lru") as s:
        for k in [5, 0, 11, 5, 7, 0, 3]:
            assert_same(read_slot(s, q, k // EXPERTS, k % EXPERTS), data[k])
        assert s.stats()["acquires"] == 7
