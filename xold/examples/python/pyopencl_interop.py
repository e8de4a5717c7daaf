"""pyopencl and tandem share one OpenCL context: a pyopencl kernel runs on tandem's queue,
writing memory tandem allocated, and tandem's order manager waits for it although it was
never registered; then tandem adopts a queue pyopencl made.

    python examples/python/pyopencl_interop.py    (needs opencl:0, e.g. PoCL, and pyopencl)
"""
import sys

import numpy as np

import tandem
from tandem import SequentialOrderManager

SRC = """
__kernel void affine(__global const float *x, __global float *y) {
  size_t i = get_global_id(0);
  y[i] = 2.0f * x[i] + 1.0f;
}
"""


def main() -> int:
    try:
        import pyopencl as cl
        dev = tandem.Device("opencl:0")
    except (ImportError, tandem.NoDeviceError) as e:
        print(f"pyopencl_interop: skipped ({e})")
        return 0
    ctx = cl.Context.from_int_ptr(dev.cl_context)        # tandem's context
    prg = cl.Program(ctx, SRC).build()
    n = 1 << 20
    x = np.random.default_rng().standard_normal(n).astype(np.float32)

    q = tandem.Queue(dev)
    cq = cl.CommandQueue.from_int_ptr(q.cl_command_queue)  # the same native queue
    xd = tandem.malloc(x.nbytes, "device", dev)
    yd = tandem.malloc(x.nbytes, "device", dev)
    q.copy(xd, x)
    # "User code": a kernel enqueued directly on the native queue, never registered.
    prg.affine(cq, (n,), None, cl.Buffer.from_int_ptr(xd.cl_mem),
               cl.Buffer.from_int_ptr(yd.cl_mem))
    SequentialOrderManager[q].wait()                     # a queue-wide marker covers it
    y = np.empty_like(x)
    q.copy(y, yd)
    q.synchronize()
    ok = np.array_equal(y, 2 * x + 1)

    own = cl.CommandQueue(ctx)                           # pyopencl's own queue, adopted
    adopted = tandem.Queue.adopt(own)
    z = np.empty_like(x)
    prg.affine(own, (n,), None, cl.Buffer.from_int_ptr(yd.cl_mem),
               cl.Buffer.from_int_ptr(xd.cl_mem))
    adopted.copy(z, xd)                                  # ordered after the kernel
    adopted.synchronize()
    ok = ok and np.array_equal(z, 2 * y + 1)
    print(f"pyopencl_interop: {'ok' if ok else 'WRONG RESULTS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
