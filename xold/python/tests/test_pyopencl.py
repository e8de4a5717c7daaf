"""pyopencl, a released client nobody here wrote, on tandem's OpenCL backend (PoCL):
1. a kernel on tandem's exported queue, writing a buffer tandem allocated: synchronize and
   the order manager's wait() cover it, though it was never registered;
2. tandem adopts a queue pyopencl made, and orders its own copy after pyopencl's kernel;
3. on an out-of-order queue, the dependencies tandem hands out make a pyopencl kernel wait
   for tandem's earlier copy;
4. pyopencl events are accepted wherever an event is.
"""
import numpy as np
import pytest

import tandem
from tandem import SequentialOrderManager
from conftest import assert_same, random_floats

cl = pytest.importorskip("pyopencl")

N = 1 << 20
SRC = """
__kernel void slow_affine(__global const float *x, __global float *y, int spin) {
  size_t i = get_global_id(0);
  float v = x[i];
  for (int k = 0; k < spin; k++) v = v * 0.999f + 0.001f;   /* keeps the device busy */
  y[i] = 2.0f * x[i] + 1.0f + 0.0f * v;
}
"""


@pytest.fixture
def ctx(opencl):
    return cl.Context.from_int_ptr(opencl.cl_context)


@pytest.fixture
def prg(ctx):
    return cl.Program(ctx, SRC).build()


def cl_buffer(buf):
    """The cl_mem behind a tandem device buffer (tandem pointers are not addresses)."""
    return cl.Buffer.from_int_ptr(buf.cl_mem)


@pytest.fixture
def data(rng, ctx):
    x = random_floats(rng, N)
    xbuf = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=x)
    return x, (2 * x + 1).astype(np.float32), xbuf


def read_back(q, buf):
    out = np.full(N, np.nan, np.float32)
    q.copy(out, buf)
    q.synchronize()
    return out


def test_synchronize_covers_kernel(opencl, prg, data):
    x, want, xbuf = data
    q = tandem.Queue(opencl)
    assert q.cl_context == opencl.cl_context
    cq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)
    y = tandem.malloc(N * 4, "device", opencl)
    evt = prg.slow_affine(cq, (N,), None, xbuf, cl_buffer(y), np.int32(2000))
    q.synchronize()
    assert evt.command_execution_status == cl.command_execution_status.COMPLETE
    assert_same(read_back(q, y), want)


def test_order_manager_sees_unregistered_kernel(opencl, prg, data):
    x, want, xbuf = data
    q = tandem.Queue(opencl)
    cq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)
    y = tandem.malloc(N * 4, "device", opencl)
    som = SequentialOrderManager[q]
    evt = prg.slow_affine(cq, (N,), None, xbuf, cl_buffer(y), np.int32(2000))  # not registered
    som.wait()
    assert evt.command_execution_status == cl.command_execution_status.COMPLETE
    assert_same(read_back(q, y), want)


def test_adopt_orders_after_kernel(opencl, ctx, prg, data):
    x, want, xbuf = data
    cq = cl.CommandQueue(ctx)
    q = tandem.Queue.adopt(cq)
    assert q.device is opencl and q.adopted and q.in_order
    assert q.cl_command_queue == cq.int_ptr
    y = tandem.malloc(N * 4, "device", opencl)
    prg.slow_affine(cq, (N,), None, xbuf, cl_buffer(y), np.int32(2000))
    assert_same(read_back(q, y), want)  # tandem's copy follows the kernel on the queue
    q.destroy()
    cq.finish()  # still pyopencl's, and usable
    other = cl.CommandQueue(cl.Context(devices=ctx.devices))
    with pytest.raises(tandem.InvalidArgumentError):
        tandem.Queue.adopt(other)  # another context
    with pytest.raises(tandem.InvalidArgumentError):
        tandem.Queue.adopt(other.int_ptr, device=opencl)


def test_adopt_out_of_order_queue(opencl, ctx):
    props = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
    try:
        cq = cl.CommandQueue(ctx, properties=props)
    except cl.Error:
        pytest.skip("the device has no out-of-order queues")
    q = tandem.Queue.adopt(cq)
    assert not q.in_order
    q.synchronize()


def test_out_of_order_dependencies(opencl, prg, data):
    x, want, xbuf = data
    q = tandem.Queue(opencl, in_order=False)
    cq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)
    xin = tandem.malloc(N * 4, "device", opencl)
    y = tandem.malloc(N * 4, "device", opencl)
    q.copy(xin, x)
    deps = SequentialOrderManager[q].submitted_events
    waits = [cl.Event.from_int_ptr(e.native) for e in deps if e.native]
    # deps may be empty when the copy already completed (PoCL's basic driver runs it inline)
    prg.slow_affine(cq, (N,), None, cl_buffer(xin), cl_buffer(y), np.int32(10), wait_for=waits)
    cq.finish()
    assert_same(read_back(q, y), want)


@pytest.mark.skipif(not tandem._tandem.has_event_import,
                    reason="this libtandem has no tdm_event_import")
def test_pyopencl_events_are_accepted(opencl, prg, data):
    x, want, xbuf = data
    q = tandem.Queue(opencl)
    other = tandem.Queue(opencl)
    cq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)
    y = tandem.malloc(N * 4, "device", opencl)
    evt = prg.slow_affine(cq, (N,), None, xbuf, cl_buffer(y), np.int32(2000))
    out = np.full(N, np.nan, np.float32)
    other.wait(evt)  # a device-side wait on pyopencl's event
    other.copy(out, y)
    other.synchronize()
    assert_same(out, want)
    som = SequentialOrderManager[q]
    som.add_event(evt)
    ev = tandem.Event.from_native(evt, opencl)
    ev.wait()
    assert ev.done and ev.error is None
    som.wait()
