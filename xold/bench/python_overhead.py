#!/usr/bin/env python3
"""bench/python_overhead.py: per-call cost of tandem's Python API, against CuPy's equivalents
measured in the same process where CuPy and a CUDA device are present.

  op         tandem                        CuPy
  record     q.record()                    stream.record()
  wait       q.wait(ev)                    stream.wait_event(ev)     (ev: recorded on another queue)
  copy4      q.copy(b, a, nbytes=4)        cupy.cuda.runtime.memcpyAsync(b, a, 4, D2D, stream)
  with       with q: pass                  with stream: pass

Each figure is the median over --reps repetitions of --iters calls, in microseconds per call;
the queue is synchronized between repetitions (untimed). Reports figures, never passes or
fails on them. JSON (--json FILE) carries the command, commit, device and date.

  python bench/python_overhead.py --device cpu:0 --json bench/results/python-cpu.json
  python bench/python_overhead.py --device cuda:0 --json $OUT/python-overhead.json
"""
import argparse
import os
import platform
import statistics
import sys
import time

import tandem

from benchinfo import commit, utc_now, write_json


def per_call_us(fn, iters, reps, sync):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn(iters)
        t1 = time.perf_counter_ns()
        sync()
        times.append((t1 - t0) / iters / 1000.0)
    return statistics.median(times)


def tandem_ops(dev):
    q = tandem.Queue(dev)
    other = tandem.Queue(dev)
    a = tandem.malloc(4096, "device", dev, queue=q)
    b = tandem.malloc(4096, "device", dev, queue=q)
    q.fill(a, 1)
    ev = other.record()

    def record(n):
        for _ in range(n):
            q.record()

    def wait(n):
        for _ in range(n):
            q.wait(ev)

    def copy4(n):
        for _ in range(n):
            q.copy(b, a, nbytes=4)

    def with_(n):
        for _ in range(n):
            with q:
                pass

    return {"record": record, "wait": wait, "copy4": copy4, "with": with_}, q.synchronize


def cupy_ops(dev):
    try:
        import cupy as cp
    except ImportError:
        return None, None, "CuPy not importable"
    if dev.backend != "cuda":
        return None, None, f"{dev.id} is not a CUDA device"
    cp.cuda.Device(dev.native).use()
    s = cp.cuda.Stream(non_blocking=True)
    other = cp.cuda.Stream(non_blocking=True)
    a = cp.ones(1024, dtype=cp.float32)
    b = cp.empty_like(a)
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(other)
    memcpy = cp.cuda.runtime.memcpyAsync
    d2d = cp.cuda.runtime.memcpyDeviceToDevice

    def record(n):
        for _ in range(n):
            s.record()

    def wait(n):
        for _ in range(n):
            s.wait_event(ev)

    def copy4(n):
        for _ in range(n):
            memcpy(b.data.ptr, a.data.ptr, 4, d2d, s.ptr)

    def with_(n):
        for _ in range(n):
            with s:
                pass

    return ({"record": record, "wait": wait, "copy4": copy4, "with": with_}, s.synchronize,
            f"CuPy {cp.__version__}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="tandem device id (default: tandem's)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    dev = tandem.Device(args.device)
    t_ops, t_sync = tandem_ops(dev)
    c_ops, c_sync, peer = cupy_ops(dev)
    results = []
    print(f"{'op':<8} {'tandem us':>10} {'CuPy us':>10} {'ratio':>7}   ({dev.id}, {peer})")
    for op in ("record", "wait", "copy4", "with"):
        t = per_call_us(t_ops[op], args.iters, args.reps, t_sync)
        c = per_call_us(c_ops[op], args.iters, args.reps, c_sync) if c_ops else None
        r = {"op": op, "tandem_us": round(t, 3)}
        if c is not None:
            r.update(cupy_us=round(c, 3), ratio=round(t / c, 2))
        results.append(r)
        print(f"{op:<8} {t:>10.3f} {c if c is not None else float('nan'):>10.3f} "
              f"{(t / c) if c else float('nan'):>7.2f}")
    doc = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": commit(),
        "device": {"id": dev.id, "name": dev.name, "backend": dev.backend},
        "peer": peer,
        "date": utc_now(),
        "python": platform.python_version(),
        "machine": {"hostname": platform.node(), "cores": os.cpu_count()},
        "options": {"iters": args.iters, "reps": args.reps},
        "results": results,
    }
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
