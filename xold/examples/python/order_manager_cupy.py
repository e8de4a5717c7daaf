"""The order manager over foreign work, on a GPU: CuPy makes an array on tandem's queue, user
code launches a kernel directly on the exported stream without registering it, and
SequentialOrderManager[q].wait() still waits for it (a queue-wide marker), so the reduction
after it sees the kernel's result.

    python examples/python/order_manager_cupy.py  (needs CuPy and cuda:0; else it says skipped)
"""
import sys

import tandem
from tandem import SequentialOrderManager


def main() -> int:
    try:
        import cupy as cp
        dev = tandem.Device("cuda:0")
    except (ImportError, tandem.NoDeviceError) as e:
        print(f"order_manager_cupy: skipped ({e})")
        return 0
    add_one = cp.RawKernel(r"""
    extern "C" __global__ void add_one(float *a, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) a[i] += 1.0f;
    }""", "add_one")
    n = 1 << 20
    q = tandem.Queue(dev)                                # in-order, like a CUDA stream
    stream = cp.cuda.ExternalStream(q.__cuda_stream__()[1])
    with stream:
        a = cp.arange(n, dtype=cp.float32)               # CuPy's work on tandem's queue
        add_one(((n + 255) // 256,), (256,), (a, cp.int32(n)))  # never registered
    SequentialOrderManager[q].wait()                     # covers the kernel too
    total = float(a.sum(dtype=cp.float64))               # after the wait: sees the kernel
    want = n * (n - 1) / 2 + n
    ok = abs(total - want) <= 1e-6 * want
    print(f"order_manager_cupy: sum {total:.0f}, expected {want:.0f}: "
          f"{'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
