#!/usr/bin/env python3
"""bench/cuda_gate_probe.py: what the CUDA driver does while a stream waits at a gate.

tandem's CUDA backend holds a queue's stream at a gate (cuStreamWaitValue32 on a mapped host
word) while its own thread runs a host task or a pageable copy. This probe measures, with no
tandem involved, two facts the Python package and include/tandem/cuda.h rely on:

  1. which runtime calls wait for a gated non-blocking stream (those that wait for the whole
     device do: a Python host task waiting for the GIL then deadlocks with a thread that makes
     such a call holding the GIL);
  2. whether a synchronous pageable copy on a stream that waits for the gate blocks another
     thread's unrelated CUDA calls (on the legacy default stream it does, on a non-blocking
     stream it does not).

A watchdog opens the gate after --hold seconds, so nothing hangs. Reports figures, never passes
or fails on them. Needs the CUDA runtime (libcudart.so.13 or --cudart) and a GPU.

  python3 bench/cuda_gate_probe.py [--cudart PATH] [--hold 2] [--json FILE]
"""
import argparse
import ctypes
import os
import platform
import sys
import threading
import time

from benchinfo import commit, utc_now, write_json

P = ctypes.c_void_p


class Cuda:
    def __init__(self, cudart):
        self.rt = ctypes.CDLL(cudart)
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.cu.cuStreamWaitValue32_v2.argtypes = [P, ctypes.c_uint64, ctypes.c_uint32,
                                                   ctypes.c_uint]
        self.check(self.rt.cudaSetDevice(0), "cudaSetDevice")
        self.flag = P()  # mapped, portable: the gate word the stream polls
        self.check(self.rt.cudaHostAlloc(ctypes.byref(self.flag), ctypes.c_size_t(64), 3),
                   "cudaHostAlloc")
        ctypes.memset(self.flag, 0, 64)
        self.dflag = P()
        self.check(self.rt.cudaHostGetDevicePointer(ctypes.byref(self.dflag), self.flag, 0),
                   "cudaHostGetDevicePointer")

    @staticmethod
    def check(rc, what):
        if rc:
            raise RuntimeError(f"{what} failed with {rc}")

    def stream(self, non_blocking=True):
        s = P()
        self.check(self.rt.cudaStreamCreateWithFlags(ctypes.byref(s), 1 if non_blocking else 0),
                   "cudaStreamCreateWithFlags")
        return s

    def close_gate(self, stream):
        ctypes.c_uint32.from_address(self.flag.value).value = 0
        self.check(self.cu.cuStreamWaitValue32_v2(stream, self.dflag.value, 1, 0),
                   "cuStreamWaitValue32")

    def open_gate(self):
        ctypes.c_uint32.from_address(self.flag.value).value = 1


def timed(fn):
    t = time.monotonic()
    rc = fn()
    return rc, (time.monotonic() - t) * 1000.0


def calls_that_wait(c, hold):
    """Part 1: each call made while a non-blocking stream waits at the gate."""
    size = ctypes.c_size_t(1 << 20)
    mem = P()
    calls = [
        ("cudaStreamCreateWithFlags(non-blocking)",
         lambda: c.rt.cudaStreamCreateWithFlags(ctypes.byref(P()), 1)),
        ("cudaStreamCreate(blocking)", lambda: c.rt.cudaStreamCreate(ctypes.byref(P()))),
        ("cudaEventCreate", lambda: c.rt.cudaEventCreate(ctypes.byref(P()))),
        ("cudaMalloc(1 MiB)", lambda: c.rt.cudaMalloc(ctypes.byref(mem), size)),
        ("cudaFree", lambda: c.rt.cudaFree(mem)),
        ("cudaHostAlloc(1 MiB)", lambda: c.rt.cudaHostAlloc(ctypes.byref(P()), size, 0)),
        ("cudaStreamSynchronize(legacy)", lambda: c.rt.cudaStreamSynchronize(P(1))),
        ("cudaDeviceSynchronize", lambda: c.rt.cudaDeviceSynchronize()),
    ]
    out = []
    for name, fn in calls:
        s = c.stream()
        c.close_gate(s)
        opened = threading.Event()
        timer = threading.Timer(hold, lambda: (c.open_gate(), opened.set()))
        timer.start()
        rc, ms = timed(fn)
        timer.cancel()
        c.open_gate()
        c.rt.cudaStreamSynchronize(s)
        c.rt.cudaStreamDestroy(s)
        waited = ms >= hold * 1000.0 * 0.9
        out.append({"call": name, "rc": rc, "ms": round(ms, 3), "waited_for_gate": waited})
        print(f"  {name:<42} {ms:9.1f} ms{'  waited for the gate' if waited else ''}",
              flush=True)
    return out


def sync_copy_blocks_others(c, hold, legacy):
    """Part 2: a pageable D2H copy on a gated stream; another thread times unrelated calls."""
    n = 1 << 20
    dev, dev2, pinned = P(), P(), P()
    c.check(c.rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n)), "cudaMalloc")
    c.check(c.rt.cudaMalloc(ctypes.byref(dev2), ctypes.c_size_t(n)), "cudaMalloc")
    c.check(c.rt.cudaHostAlloc(ctypes.byref(pinned), ctypes.c_size_t(n), 1), "cudaHostAlloc")
    pageable = ctypes.create_string_buffer(n)
    s = P(1) if legacy else c.stream()
    other = c.stream()
    ev = P()
    c.check(c.rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2), "cudaEventCreate")
    c.close_gate(s)
    probes = [
        ("cudaEventRecord(other stream)", lambda: c.rt.cudaEventRecord(ev, other)),
        ("cudaMemcpyAsync(pinned->device, other stream)",
         lambda: c.rt.cudaMemcpyAsync(dev2, pinned, ctypes.c_size_t(n), 1, other)),
        ("cudaStreamSynchronize(other stream)", lambda: c.rt.cudaStreamSynchronize(other)),
    ]
    results = []

    def probe():
        time.sleep(0.2)
        for name, fn in probes:
            rc, ms = timed(fn)
            results.append({"call": name, "rc": rc, "ms": round(ms, 3),
                            "blocked": ms >= (hold - 0.2) * 1000.0 * 0.9})
        c.open_gate()

    watchdog = threading.Timer(hold, c.open_gate)
    watchdog.start()
    worker = threading.Thread(target=probe)
    worker.start()
    rc, ms = timed(lambda: c.rt.cudaMemcpyAsync(pageable, dev, ctypes.c_size_t(n), 2, s))
    worker.join()
    watchdog.cancel()
    c.rt.cudaDeviceSynchronize()
    where = "legacy default stream" if legacy else "non-blocking stream"
    print(f"  pageable D2H copy on the {where}, behind the gate: returned after {ms:.1f} ms",
          flush=True)
    for r in results:
        print(f"    other thread: {r['call']:<46} {r['ms']:9.1f} ms"
              f"{'  blocked until the gate opened' if r['blocked'] else ''}", flush=True)
    for p in (dev, dev2):
        c.rt.cudaFree(p)
    c.rt.cudaFreeHost(pinned)
    return {"stream": where, "copy_ms": round(ms, 3), "other_thread": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cudart", default="libcudart.so.13")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds the gate stays closed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        c = Cuda(args.cudart)
    except (OSError, RuntimeError) as e:
        print(f"cuda_gate_probe: skipped ({e})")
        return 77
    name = ctypes.create_string_buffer(256)
    c.cu.cuDeviceGetName(name, 256, 0)
    print(f"device 0: {name.value.decode(errors='replace')}", flush=True)
    print("1. calls made while a non-blocking stream waits at a gate", flush=True)
    part1 = calls_that_wait(c, args.hold)
    print("2. a synchronous pageable copy behind the gate, and another thread's calls", flush=True)
    part2 = [sync_copy_blocks_others(c, args.hold, legacy) for legacy in (True, False)]
    doc = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": commit(),
        "date": utc_now(),
        "machine": {"hostname": platform.node()},
        "device": name.value.decode(errors="replace"),
        "hold_s": args.hold,
        "calls_while_gated": part1,
        "sync_copy_behind_gate": part2,
    }
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
