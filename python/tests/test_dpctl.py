"""dpctl and dpnp on tandem's SYCL device: sycl:0, Intel's OpenCL CPU runtime under Intel's
SYCL runtime (both installed by scripts/bootstrap; conftest.py points OCL_ICD_VENDORS at
them). Skipped, visibly, without dpctl, dpnp or a sycl:0 device.

The request's scenario first: a user kernel submitted through dpctl's program API (an OpenCL
C kernel, dpctl's submit_async) and never registered; tandem's SequentialOrderManager[q].wait()
covers it, and the host reads the kernel's result right after, through the memory's address
(shared USM: no queue call in between). dpctl's own manager is shown returning early (printed:
how early is a timing, not asserted). Then Queue.adopt and to_dpctl, SyclEvents wherever an
event is taken, __sycl_usm_array_interface__ and DLPack (kDLOneAPI) both ways (dpnp arrays as
copy operands in place, tandem buffers viewed by dpctl and dpnp), a dpnp array copied while a
kernel still writes it, keep-alive of a dropped array, the cached and current queues across
threads, and the package's libtandem-sycl. Random data, never zeros; outputs poisoned with NaN
first.
"""
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import tandem
from tandem import SequentialOrderManager
from conftest import REPO, _sycl_root, assert_same, eventually, random_floats, sycl_version

dpctl = pytest.importorskip("dpctl")
dpnp = pytest.importorskip("dpnp")
import dpctl.memory as dpm  # noqa: E402
import dpctl.program as dpp  # noqa: E402
import dpnp.tensor as dpt  # noqa: E402  (dpctl.tensor, which moved to dpnp in dpctl 0.22)
from dpctl.utils import SequentialOrderManager as DpctlOrderManager  # noqa: E402

import tandem.dpctl as tdp  # noqa: E402

N = 1 << 12
# Each work item runs SPIN dependent multiply-adds: about 0.4 s for the kernel on two cores.
SPIN = int(os.environ.get("TANDEM_SYCL_SPIN", "2000000"))
COMPLETE = dpctl.event_status_type.complete

SLOW_ADD_ONE = """
__kernel void slow_add_one(__global float *a, uint spin) {
  size_t i = get_global_id(0);
  float x = a[i], v = x;
  for (uint k = 0; k < spin; k++) v = v * 0.999f + 0.001f;   /* keeps the device busy */
  a[i] = (v > 1e30f) ? v : x + 1.0f;
}
"""


def _sycl_device():
    try:
        return tandem.Device("sycl:0")
    except tandem.NoDeviceError:
        info = [b for b in tandem.backends() if b["name"] == "sycl"]
        pytest.skip(f"no sycl:0 device (sycl backend: {info}; OCL_ICD_VENDORS="
                    f"{os.environ.get('OCL_ICD_VENDORS')})")


@pytest.fixture
def sycl():
    return _sycl_device()


@pytest.fixture
def dq(sycl):
    """The user's own dpctl queue: in-order, made by dpctl (not tandem) on sycl:0's device."""
    return dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")


@pytest.fixture(scope="module")
def kernel():
    """slow_add_one, built from OpenCL C by dpctl's program API (in the device's default
    context, which every queue here shares)."""
    q = dpctl.SyclQueue(_sycl_device().to_dpctl())
    return dpp.create_program_from_source(q, SLOW_ADD_ONE).get_sycl_kernel("slow_add_one")


def launch(q, kernel, a, spin=SPIN):
    """slow_add_one on a (a dpnp array) through dpctl, asynchronously: user code that tandem
    never hears of. dpctl 0.22's submit() waits for the kernel; submit_async() is its call that
    returns at once (and keeps nothing alive)."""
    return q.submit_async(kernel, [dpm.as_usm_memory(a), ctypes.c_uint(spin)], [a.size])


def host_view(a):
    """A numpy view of a float32 array in shared USM, through its address alone. Take it
    before the work to check: reading a dpnp array's interface waits for its queue."""
    iface = a.__sycl_usm_array_interface__
    ptr = iface["data"][0] + iface.get("offset", 0) * 4
    return np.ctypeslib.as_array((ctypes.c_float * a.size).from_address(ptr))


def shared_array(x, q):
    a = dpnp.asarray(x, usm_type="shared", sycl_queue=q)
    assert a.usm_type == "shared"
    return a


# ---- the request's scenario ------------------------------------------------------------------


def test_scenario_order_manager_covers_unregistered_kernel(dq, kernel, rng):
    x = random_floats(rng, N)
    a = shared_array(x, dq)                     # made by dpnp on the user's queue
    view = host_view(a)
    ev = launch(dq, kernel, a)                  # "user code": never registered
    running = ev.execution_status != COMPLETE
    SequentialOrderManager[dq].wait()
    assert ev.execution_status == COMPLETE, (
        "the order manager's wait returned before the unregistered kernel")
    assert_same(view, x + np.float32(1))        # right after, without the queue
    print(f"kernel running when wait() was called: {running}")


def test_dpctl_own_manager_returns_early(dq, kernel, rng):
    """What the request reports, with the real dpctl: its manager's wait() knows registered
    events only. Reported, not asserted (how early it returns is a timing); dpctl's
    q.submit_barrier().wait() covers the kernel."""
    x = random_floats(rng, N)
    a = shared_array(x, dq)
    view = host_view(a)
    ev = launch(dq, kernel, a)
    start = time.perf_counter()
    DpctlOrderManager[dq].wait()
    took = time.perf_counter() - start
    status = ev.execution_status
    dq.submit_barrier().wait()
    assert_same(view, x + np.float32(1))
    print(f"dpctl's SequentialOrderManager[q].wait() returned after {took:.4f} s with the "
          f"unregistered kernel {status.name}")


# ---- queues -------------------------------------------------------------------------------


def test_to_dpctl_is_the_same_queue(sycl, kernel, rng):
    q = tandem.Queue(sycl)
    d = q.to_dpctl()
    assert isinstance(d, dpctl.SyclQueue) and d == q.to_dpctl() and d.is_in_order
    assert d.sycl_device == sycl.to_dpctl() and sycl.to_dpctl() is sycl.to_dpctl()
    x = random_floats(rng, N)
    a = dpnp.empty(N, dtype="f4", sycl_queue=d)
    q.copy(a, x)                                 # tandem's copy into the dpnp array
    ev = launch(d, kernel, a)                    # dpctl's kernel after it, on the same queue
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a)                               # tandem's copy after the kernel
    q.synchronize()
    assert ev.execution_status == COMPLETE
    assert_same(out, x + np.float32(1))
    assert not tandem.Queue(sycl, in_order=False).to_dpctl().is_in_order
    with pytest.raises(tandem.NotSupportedError):
        tandem.Queue("cpu:0").to_dpctl()


def test_to_dpctl_outlives_the_tandem_queue(sycl, rng):
    """The dpctl queue holds a handle of its own on the native queue: usable after the tandem
    queue is destroyed (tandem's ordering ends there)."""
    q = tandem.Queue(sycl)
    d = q.to_dpctl()
    q.destroy()
    x = random_floats(rng, 1024)
    a = dpnp.asarray(x, sycl_queue=d)
    assert_same(dpnp.asnumpy(a * 2), x * 2)
    with pytest.raises(tandem.HandleError):
        q.to_dpctl()


def test_adopt_dpctl_queue(sycl, dq, kernel, rng):
    q = tandem.Queue.adopt(dq)
    assert q.adopted and q.device is sycl and q.in_order
    assert q.to_dpctl() == dq                    # the same native queue
    x = random_floats(rng, N)
    a = dpnp.asarray(x, sycl_queue=dq)
    ev = launch(dq, kernel, a)                   # dpctl's kernel, then tandem's copy
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a)
    q.synchronize()
    assert ev.execution_status == COMPLETE
    assert_same(out, x + np.float32(1))

    ooo = tandem.Queue.adopt(dpctl.SyclQueue(sycl.to_dpctl()))
    assert not ooo.in_order and ooo.device is sycl
    by_capsule = tandem.Queue.adopt(dq._get_capsule())
    assert by_capsule.to_dpctl() == dq
    dev = sycl.to_dpctl()
    own_context = dpctl.SyclQueue(dpctl.SyclContext([dev]), dev, property="in_order")
    assert own_context.sycl_context != dq.sycl_context
    other = tandem.Queue.adopt(own_context)      # a queue of a context of its own
    assert other.device is sycl and other.to_dpctl() == own_context
    other.record().wait()
    other.synchronize()
    with pytest.raises(tandem.InvalidArgumentError, match="in-order"):
        tandem.Queue.adopt(dq, in_order=False)
    with pytest.raises(tandem.CrossDeviceError):
        tandem.Queue.adopt(dq, device="cpu:0")


def test_host_work_on_an_adopted_queue_of_its_own_context(sycl, rng):
    """dpctl's queues share the device's default context, but a user may make a context of
    their own; tandem/sycl.h says such a queue can be adopted. Host tasks and host copies on it
    wait for gates."""
    dev = sycl.to_dpctl()
    q = tandem.Queue.adopt(dpctl.SyclQueue(dpctl.SyclContext([dev]), dev, property="in_order"))
    done = []
    q.host_task(done.append, 1)
    x = random_floats(rng, 256)
    out = np.full(256, np.nan, np.float32)
    q.copy(out, x)
    q.synchronize()
    assert done == [1]
    assert_same(out, x)


def test_adopted_queue_keeps_its_handle(sycl, rng):
    """Dropping the dpctl object does not end the adopted queue: tandem keeps the capsule's
    handle (and the object) until the tandem queue goes."""
    d = dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")
    q = tandem.Queue.adopt(d)
    del d
    gc.collect()
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", sycl, queue=q)
    out = np.full(N, np.nan, np.float32)
    q.copy(buf, x)
    q.copy(out, buf)
    q.synchronize()
    assert_same(out, x)
    q.destroy()


def test_sycl_events_are_accepted(sycl, dq, kernel, rng):
    x = random_floats(rng, N)
    a = shared_array(x, dq)
    view = host_view(a)
    ev = launch(dq, kernel, a)
    q = tandem.Queue(sycl)                       # another queue
    out = np.full(N, np.nan, np.float32)
    q.copy(out, view, deps=[ev])                 # plain host memory: only ev orders it
    q.synchronize()
    assert_same(out, x + np.float32(1))
    imported = tandem.Event.from_native(ev)
    imported.wait()
    assert imported.done and imported.to_dpctl() is ev
    q.wait(ev)                                   # a device-side wait on a SyclEvent
    marker = q.record().to_dpctl()
    assert isinstance(marker, dpctl.SyclEvent)
    marker.wait()
    assert marker.execution_status == COMPLETE
    with pytest.raises(tandem.NotSupportedError):
        tandem.Queue("cpu:0").record().to_dpctl()


def test_order_manager_takes_dpctl_queues_and_events(sycl, dq, kernel, rng):
    som = SequentialOrderManager[dq]
    assert som is SequentialOrderManager[dq]
    assert som is SequentialOrderManager[dpctl.SyclQueue(dq._get_capsule())]  # same queue
    assert som.tandem_queue is tdp.as_tandem_queue(dq)
    x = random_floats(rng, N)
    a = dpnp.asarray(x, sycl_queue=dq)
    deps = som.submitted_events
    assert all(isinstance(e, dpctl.SyclEvent) for e in deps)
    ev = dq.submit_async(kernel, [dpm.as_usm_memory(a), ctypes.c_uint(SPIN)], [N], dEvents=deps)
    ht = tdp.keep_args_alive(dq, (a,), [ev])
    assert isinstance(ht, dpctl.SyclEvent)
    som.add_event_pair(ht, ev)                   # dpctl's names and events
    som.add_to_both_events([ht], [ev])           # and its lists
    pending = som.submitted_events
    assert all(isinstance(e, dpctl.SyclEvent) for e in pending)
    assert ev.execution_status == COMPLETE or any(e is ev for e in pending)
    som.wait()
    assert som.num_submitted_events == 0 and som.num_host_task_events == 0
    assert_same(dpnp.asnumpy(a), x + np.float32(1))
    with pytest.raises(TypeError):
        SequentialOrderManager[object()]


# ---- arrays -------------------------------------------------------------------------------


def test_dpnp_arrays_are_copy_operands_in_place(sycl, dq, rng):
    """dpnp arrays (through DLPack's oneAPI device, with tandem's queue as the stream) and
    dpnp.tensor arrays are read and written where they are."""
    q = tandem.Queue(sycl)
    x = random_floats(rng, N)
    a = dpnp.full(N, np.nan, dtype="f4", sycl_queue=dq)
    q.copy(a, x)                                 # into the array's own memory
    q.synchronize()
    assert_same(dpnp.asnumpy(a), x)
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a[N // 2:])                      # a view: the interface's offset
    q.synchronize()
    assert_same(out[:N // 2], x[N // 2:])
    assert np.isnan(out[N // 2:]).all()
    u = dpt.asarray(random_floats(rng, N), sycl_queue=dq)  # dpnp.tensor.usm_ndarray
    q.copy(out, u)
    q.synchronize()
    assert_same(out, dpt.asnumpy(u))
    q.fill(a, 0)
    q.synchronize()
    assert not dpnp.asnumpy(a).any()
    with pytest.raises(ValueError, match="contiguous"):
        q.copy(out[: N // 2], a[::2])
    with pytest.raises(tandem.CrossDeviceError):
        tandem.Queue("cpu:0").copy(out, a)


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "out_of_order"])
def test_dpnp_array_copied_while_a_kernel_writes_it(sycl, dq, kernel, rng, in_order):
    """The array's queue still runs a kernel on it when tandem is asked to copy it on another
    queue, with no dependency given: dpnp orders its queue before tandem's on the device
    (__dlpack__(stream=)), so the copy reads the kernel's result without the call blocking
    (reported: whether the kernel still ran when the copy was submitted)."""
    q = tandem.Queue(sycl, in_order=in_order)
    x = random_floats(rng, N)
    a = dpnp.asarray(x, sycl_queue=dq)
    ev = launch(dq, kernel, a)
    running = ev.execution_status != COMPLETE
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a).wait()
    assert_same(out, x + np.float32(1))
    print(f"kernel running when the copy was submitted: {running}")


class USMInterfaceOnly:
    """A producer that speaks dpctl's __sycl_usm_array_interface__ and nothing else: a float32
    view of USM memory from element `offset` on, in dpctl's units (offset and strides count
    elements)."""

    def __init__(self, mem, offset, n, stride=None, readonly=False):
        self._mem = mem
        iface = dict(mem.__sycl_usm_array_interface__)
        iface.update(data=(iface["data"][0], readonly), typestr="<f4", shape=(n,),
                     offset=offset, strides=None if stride is None else (stride,))
        self.__sycl_usm_array_interface__ = iface


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "out_of_order"])
def test_usm_interface_operand(sycl, dq, kernel, rng, in_order):
    """dpctl's USM memory (its interface does not wait) written by a kernel still running on
    the user's queue: tandem's queue waits for that queue (the interface's syclobj) on the
    device, and reads from the offset the interface gives."""
    q = tandem.Queue(sycl, in_order=in_order)
    x = random_floats(rng, N)
    mem = dpm.MemoryUSMDevice(x.nbytes, queue=dq)
    mem.copy_from_host(x.view(np.uint8))
    a = dpnp.ndarray((N,), dtype="f4", buffer=mem)
    ev = dq.submit_async(kernel, [mem, ctypes.c_uint(SPIN)], [N])
    running = ev.execution_status != COMPLETE
    out = np.full(N, np.nan, np.float32)
    q.copy(out, mem)                             # the whole allocation, as bytes
    q.synchronize()
    assert_same(out, x + np.float32(1))
    out[:] = np.nan
    q.copy(out, USMInterfaceOnly(mem, N // 4, N // 2))
    q.synchronize()
    assert_same(out[:N // 2], x[N // 4:N // 4 + N // 2] + np.float32(1))
    assert np.isnan(out[N // 2:]).all()
    y = random_floats(rng, N)
    q.copy(USMInterfaceOnly(mem, 0, N), y)       # written in place
    q.synchronize()
    assert_same(dpnp.asnumpy(a), y)
    q.copy(mem, x)                               # (dpctl.memory's flag means "writable")
    q.synchronize()
    assert_same(dpnp.asnumpy(a), x)
    with pytest.raises(ValueError, match="read-only"):
        q.copy(USMInterfaceOnly(mem, 0, N, readonly=True), x)
    with pytest.raises(ValueError, match="contiguous"):
        q.copy(out, USMInterfaceOnly(mem, 0, N // 2, stride=2))
    with pytest.raises(tandem.CrossDeviceError):
        tandem.Queue("cpu:0").copy(out, mem)
    print(f"kernel running when the copy was submitted: {running}")


class DLPackOnly:
    """A producer that speaks DLPack and nothing else."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_oneapi_dlpack_operand(sycl, dq, kernel, rng):
    q = tandem.Queue(sycl)
    x = random_floats(rng, N)
    a = dpnp.asarray(x, sycl_queue=dq)
    assert a.__dlpack_device__() == (14, sycl.to_dpctl().get_device_id())
    launch(dq, kernel, a)                        # the producer orders it before our queue
    out = np.full(N, np.nan, np.float32)
    q.copy(out, DLPackOnly(a))
    q.synchronize()
    assert_same(out, x + np.float32(1))
    with pytest.raises(tandem.CrossDeviceError):
        tandem.Queue("cpu:0").copy(out, DLPackOnly(a))


def test_buffer_exports_usm_interface_and_dlpack(sycl, rng):
    q = tandem.Queue(sycl)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", sycl, queue=q)
    q.copy(buf, x)
    iface = buf.__sycl_usm_array_interface__
    assert iface["data"] == (buf.ptr, False) and iface["shape"] == (x.nbytes,)
    assert iface["typestr"] == "|u1" and iface["version"] == 1 and iface["strides"] is None
    assert iface["syclobj"] == q.to_dpctl()
    mem = dpm.as_usm_memory(buf)                 # dpctl's view: the same memory
    assert mem._pointer == buf.ptr and mem.get_usm_type() == "device"
    view = dpnp.ndarray((N,), dtype="f4", buffer=mem)
    assert_same(dpnp.asnumpy(view), x)           # on the buffer's queue: after tandem's copy
    assert buf.__dlpack_device__() == (14, sycl.to_dpctl().get_device_id())
    t = dpnp.from_dlpack(buf)
    assert t.__sycl_usm_array_interface__["data"][0] == buf.ptr
    assert_same(dpnp.asnumpy(t).view(np.float32), x)
    del view, mem, t

    pinned = tandem.malloc(64, "pinned", sycl)
    assert dpm.as_usm_memory(pinned).get_usm_type() == "host"
    assert pinned.__dlpack_device__()[0] == 14
    host = tandem.malloc(64, "host", sycl)
    assert not hasattr(host, "__sycl_usm_array_interface__")
    assert host.__dlpack_device__() == (1, 0)
    assert not hasattr(tandem.malloc(64, "device", "cpu:0"), "__sycl_usm_array_interface__")


def test_buffer_dlpack_orders_a_dpctl_consumer_on_the_device(sycl, dq, rng):
    """__dlpack__(stream=q) with a dpctl queue: the call returns at once, and q waits on the
    device for the buffer's queue (here held by a host task until a gate opens)."""
    q = tandem.Queue(sycl)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", sycl, queue=q)
    out = np.full(N, np.nan, np.float32)
    gate = threading.Event()
    try:
        q.host_task(gate.wait, 60)
        q.copy(buf, x)                           # behind the gate
        cap = buf.__dlpack__(stream=dq)
        ev = dq.memcpy_async(out, dpm.as_usm_memory(buf), x.nbytes)
        assert ev.execution_status != COMPLETE, "the consumer did not wait for the buffer"
    finally:
        gate.set()
    ev.wait()
    assert_same(out, x)
    del cap


# ---- tandem.dpctl -------------------------------------------------------------------------


def test_keep_args_alive_of_a_dropped_array(sycl, dq, kernel, rng):
    a = dpnp.asarray(random_floats(rng, N), sycl_queue=dq)
    ref = weakref.ref(a.get_array())             # dpnp arrays take no weak references
    mem = dpm.as_usm_memory(a)                   # now: reading the interface waits for dq
    gate = threading.Event()
    try:
        tdp.as_tandem_queue(dq).host_task(gate.wait, 60)  # dq is held until the gate opens
        ev = dq.submit_async(kernel, [mem, ctypes.c_uint(1000)], [N])  # behind it
        ht = tdp.keep_args_alive(dq, (a,), [ev])
        assert isinstance(ht, dpctl.SyclEvent)
        del a, mem
        gc.collect()
        assert ref() is not None, "the array went while its kernel was pending"
    finally:
        gate.set()
    SequentialOrderManager[dq].wait()
    assert eventually(lambda: ref() is None), "the array is still held after its work"
    q = tandem.Queue(sycl)
    assert isinstance(tdp.keep_args_alive(q, (object(),)), tandem.Event)


def test_cached_and_current_queues_across_threads(sycl):
    c = tdp.cached_queue()
    assert isinstance(c, dpctl.SyclQueue) and c.is_in_order
    assert c is tdp.cached_queue(sycl) is tdp.cached_queue("sycl:0")
    assert c is tdp.cached_queue(sycl.to_dpctl())
    default = tandem.get_default_queue(sycl)
    assert c == default.to_dpctl() and tdp.as_tandem_queue(c) is default  # one native queue
    assert SequentialOrderManager[c].tandem_queue is default
    assert tdp.current_queue() is c and tdp.current_queue(sycl) is c
    mine = dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")
    theirs = dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")
    seen = {}

    def other():
        seen["cached"] = tdp.cached_queue()
        seen["before"] = tdp.current_queue()
        with tdp.use(theirs):
            seen["inside"] = tdp.current_queue(sycl)
            seen["tandem"] = tandem.get_current_queue(sycl)
        seen["after"] = tdp.current_queue()

    with tdp.use(mine) as entered:
        assert entered is mine and tdp.current_queue() is mine
        assert tandem.get_current_queue(sycl) is tdp.as_tandem_queue(mine)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert tdp.current_queue() is mine       # the other thread's use() was its own
        inner = dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")
        with tdp.use(inner):
            assert tdp.current_queue(sycl) is inner
        assert tdp.current_queue() is mine
    assert tdp.current_queue() is c and tandem.get_current_queue(sycl) is default
    assert seen["cached"] is c and seen["before"] is c and seen["after"] is c
    assert seen["inside"] is theirs and seen["tandem"] is tdp.as_tandem_queue(theirs)


def test_set_cached_queue(sycl):
    old = tdp.cached_queue(sycl)
    mine = dpctl.SyclQueue(sycl.to_dpctl(), property="in_order")
    tdp.set_cached_queue(mine)
    try:
        assert tdp.cached_queue() is mine
        got = []
        t = threading.Thread(target=lambda: got.append(tdp.current_queue(sycl)))
        t.start()
        t.join()
        assert got[0] is mine
    finally:
        tdp.set_cached_queue(old)
    assert tdp.cached_queue() is old
    with pytest.raises(TypeError):
        tdp.set_cached_queue(tandem.Queue(sycl))
    with pytest.raises(tandem.NotSupportedError):
        tdp.cached_queue("cpu:0")


def test_cached_queue_out_of_order_by_env(sycl):
    prog = textwrap.dedent("""
        import tandem, tandem.dpctl as t
        q = t.cached_queue()
        print(q.is_in_order, tandem.get_default_queue(t.sycl_device()).in_order)
    """)
    env = dict(os.environ, TANDEM_DEFAULT_QUEUE="out_of_order")
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# ---- the package --------------------------------------------------------------------------


def test_one_sycl_runtime_in_the_process(sycl):
    """dpctl and dpnp bring the intel-sycl-rt wheel into the virtual environment, tandem's
    module links the one scripts/bootstrap installed: pinned to the same version, so that the
    process, which loads libsycl.so.9 once (by its soname), serves both."""
    with open(os.path.join(REPO, "python", "requirements-test.txt")) as f:
        pins = dict(line.split("#")[0].strip().split("==") for line in f if "==" in line)
    assert pins["intel-sycl-rt"] == sycl_version()
    dpctl.SyclQueue(sycl.to_dpctl()).submit_barrier().wait()  # dpctl's runtime in use
    with open("/proc/self/maps") as f:
        loaded = {line.split()[-1] for line in f if "/libsycl.so" in line}
    assert len(loaded) == 1, f"two SYCL runtimes in one process: {loaded}"


def test_package_ships_the_sycl_module(sycl):
    """libtandem-sycl.so is in the package folder, next to libtandem, as the other backend
    modules are; tandem loaded it from there, and it found libsycl through its rpath (the SYCL
    runtime's lib folder), with no loader path set."""
    mod = os.path.join(os.path.dirname(tandem.__file__), "libtandem-sycl.so")
    info = [b for b in tandem.backends() if b["name"] == "sycl"]
    assert os.path.isfile(mod)
    assert info and info[0]["status"] == "TDM_OK" and info[0]["detail"] == mod
    assert "sycl" not in os.environ.get("LD_LIBRARY_PATH", "")
    readelf = shutil.which("readelf")
    if readelf and _sycl_root():
        dyn = subprocess.run([readelf, "-d", mod], capture_output=True, text=True).stdout
        assert os.path.join(_sycl_root(), "lib") in dyn
