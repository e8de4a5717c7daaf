"""A CPU-only pipeline: chunks of random data flow host -> device -> host through two queues
that wait for each other on the device; a host task per chunk checks the result, and
keep-alive holds each chunk's source array until its copy is done, so the loop can drop it.

    python examples/python/pipeline_cpu.py        (runs on cpu:0; exit status 0 when correct)
"""
import numpy as np

import tandem

CHUNKS, N = 8, 1 << 16


def main() -> int:
    dev = tandem.Device("cpu:0")
    upload = tandem.Queue(dev)       # copies in
    work = tandem.Queue(dev)         # copies out and checks
    rng = np.random.default_rng()
    dbuf = [tandem.malloc(N * 4, "device", dev) for _ in range(CHUNKS)]
    out = [tandem.malloc(N * 4, "pinned", dev) for _ in range(CHUNKS)]
    checked = []

    def check(i, want):              # a host task: runs on a tandem thread after the copy back
        got = np.frombuffer(out[i], np.float32)
        checked.append(bool(np.array_equal(got, want)))

    for i in range(CHUNKS):
        x = rng.standard_normal(N).astype(np.float32)
        landed = upload.copy(dbuf[i], x)     # x stays alive until this copy is done
        work.wait(landed)                    # device-side: returns at once
        work.copy(out[i], dbuf[i])
        work.host_task(check, i, x.copy())
        upload.keep_alive(x)                 # explicit, too: dropped once the copy is done
        del x
    work.synchronize()                       # raises a host task's exception, if any
    ok = len(checked) == CHUNKS and all(checked)
    print(f"pipeline: {sum(checked)} of {CHUNKS} chunks correct")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
