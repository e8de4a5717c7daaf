#!/usr/bin/env python3
"""bench/moe_inplace.py: libtandem_moe's grouped experts reading bf16 weights in place from
pinned host memory (across the link, no copy), against the same call on device memory and
against copying the experts first.

One CUDA device, through PyTorch (for buffers and timing) and tandem.MoeOps on a torch stream
tandem adopts. E experts of Qwen3-30B-A3B's shape (hidden 2048, intermediate 768) lie in one
pinned buffer and in one device buffer with the same bits; for each T in --tokens, T tokens
route to k distinct random experts each, and experts() runs on the table whose entries name
the device copy, then the pinned one (a base in no tandem allocation: offsets are
addresses). Reported per T: ms per call (CUDA events, mean of --reps), the experts' bytes
over that time, whether both outputs are bitwise equal, and the time of one pinned copy of
k experts' bytes. It reports figures and never fails on them; exits 77 without PyTorch, a CUDA
GPU or tandem.MoeOps.

  python bench/moe_inplace.py --json out.json
"""
import argparse
import sys

from benchinfo import commit, utc_now, write_json

SKIP = 77
ANYWHERE = 16   # a base in no tandem allocation


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-size", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        import torch
        import tandem
    except ImportError as e:
        print(f"moe_inplace: skipped ({e})")
        return SKIP
    if not torch.cuda.is_available() or not hasattr(tandem, "MoeOps"):
        print("moe_inplace: skipped (no CUDA GPU for PyTorch, or no tandem.MoeOps)")
        return SKIP
    H, I, E, k = a.hidden, a.expert_size, a.experts, a.top_k
    eb = 3 * H * I * 2
    dev = torch.device("cuda:0")
    stream = torch.cuda.Stream(dev)
    ops = tandem.MoeOps(tandem.Queue.adopt(stream))
    host = tandem.malloc(E * eb, "pinned", tandem.Device("cuda:0"))
    hflat = torch.frombuffer(host, dtype=torch.uint8).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    hflat.copy_(torch.randn(hflat.numel(), generator=gen, dtype=torch.bfloat16) * 0.02)
    dflat = hflat.to(dev)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(a.reps):
            fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / a.reps / 1e3

    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        n, G = T * k, min(E, T * k)
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        idx = idx.to(torch.int32).to(dev)
        x = torch.randn(T, H, generator=gen).to(dev)
        wsb = tandem.MoeOps.workspace_bytes(n, H, I)
        ws = torch.empty(max(wsb, 256), dtype=torch.uint8, device=dev)
        routed = int(torch.unique(idx).numel())
        r = {"tokens": T, "routed_experts": routed, "routed_bytes": routed * eb}
        outs = {}
        for name, base in (("device", dflat.data_ptr()), ("pinned", hflat.data_ptr())):
            wofs = torch.tensor([(base + e * eb - ANYWHERE) // 2 for e in range(E)],
                                dtype=torch.int64, device=dev)
            rws, slot = (torch.empty(n, dtype=torch.int32, device=dev) for _ in range(2))
            groups = torch.empty(G * 16, dtype=torch.uint8, device=dev)
            out = torch.zeros(n, H, device=dev)

            def call():
                stream.wait_stream(torch.cuda.current_stream(dev))
                ops.group(idx.data_ptr(), T, k, E, wofs.data_ptr(), rws.data_ptr(),
                          slot.data_ptr(), groups.data_ptr())
                ops.experts(x.data_ptr(), rws.data_ptr(), slot.data_ptr(), n, ANYWHERE,
                            groups.data_ptr(), G, H, I, out.data_ptr(), ws.data_ptr(), wsb)
                torch.cuda.current_stream(dev).wait_stream(stream)
            t = timed(call)
            outs[name] = out.clone()
            r[f"{name}_ms"] = t * 1e3
            r[f"{name}_gb_per_s"] = routed * eb / t / 1e9
        r["bitwise_equal"] = bool(torch.equal(outs["device"], outs["pinned"]))
        src = hflat[: routed * eb // 2]
        dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
        t = timed(lambda: dst.copy_(src, non_blocking=True))
        r["copy_ms"] = t * 1e3
        r["copy_gb_per_s"] = routed * eb / t / 1e9
        r["inplace_over_copy"] = r["copy_ms"] / r["pinned_ms"]
        rows.append(r)
        print(f"T={T:3d}: {routed} experts; device {r['device_ms']:.3f} ms "
              f"({r['device_gb_per_s']:.0f} GB/s), in place from pinned {r['pinned_ms']:.3f} ms "
              f"({r['pinned_gb_per_s']:.1f} GB/s), a copy of them {r['copy_ms']:.3f} ms "
              f"({r['copy_gb_per_s']:.1f} GB/s); bitwise equal: {r['bitwise_equal']}")
    ops.close()
    if a.json:
        write_json(a.json, {"command": " ".join(["python3"] + sys.argv), "commit": commit(),
                            "date": utc_now(), "device": torch.cuda.get_device_name(dev),
                            "options": vars(a), "results": rows})
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
