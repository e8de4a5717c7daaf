#!/usr/bin/env python3
"""ref_selftest.py: checks the float64 reference (ref_model.py) and the tiny-model writer
(tiny.py) against each other and against hand computations, in a few seconds:

  1. For each configuration below (both architectures, several dtypes, tied and untied heads,
     GQA and MQA, a q dim unlike hidden), tiny.py writes one model as a HF folder and as a
     GGUF; both load, and give the same logits over a prefill and a greedy decode (relative
     1e-12) and the same generated ids. This proves the HF <-> GGUF name mapping, the expert
     stacking and, for Mixtral, llama.cpp's q/k permutation against normal (adjacent-pair)
     RoPE. As a negative control, the Mixtral GGUF run with rotate-half RoPE must differ.
  2. Prefilling a sequence at once equals feeding it token by token and in uneven chunks
     through the KV cache (relative 1e-12).
  3. RoPE of a vector at position 1 (and 0) equals an explicit cos/sin rotation of its pairs,
     both pairings; the permutation commutes with RoPE as the converter relies on.
  4. The router picks the lower index on a tie and renormalizes the top-k, by hand; bf16
     rounding (to nearest even) and widening, by hand.
  5. The hand-written safetensors shards read back identically through the safetensors
     package (where numpy can hold the dtype), and the GGUF holds the intended tensor types.

usage: ref_selftest.py [-v]     exit 0 if all pass, 1 otherwise (each mismatch is printed)
"""
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_model  # noqa: E402
import tiny  # noqa: E402

TOL = 1e-12
# (name, arch, seed, options for tiny.write_tiny)
CONFIGS = [
    ("qwen3moe-default", "qwen3moe", 1, {}),
    ("mixtral-default", "mixtral", 2, {}),
    # eps 2^-20 is exact in the GGUF's float32 key, so this pair must agree to rounding only
    # (with 1e-6 the two files' eps differ by 2.5e-9 relative, worth ~1e-13 in the logits)
    ("qwen3moe-bf16-tied-qdim96", "qwen3moe", 3,
     dict(dtype="bf16", tied=True, head_dim=24, layers=3, eps=2.0 ** -20)),
    ("mixtral-f16-mqa-tied", "mixtral", 4,
     dict(dtype="f16", experts_dtype="f16", heads=8, kv_heads=1, head_dim=8, tied=True)),
    ("mixtral-bf16-f32experts-mha", "mixtral", 5,
     dict(dtype="bf16", experts_dtype="f32", kv_heads=4, top_k=3)),
]

failures = []
verbose = "-v" in sys.argv


def check(ok, what):
    """`what` states the property checked and the value found."""
    if not ok:
        failures.append(what)
        print("FAIL:", what)
    elif verbose:
        print("ok:  ", what)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def check_rope_by_hand():
    d, base = 8, 10000.0
    x = np.arange(1, d + 1, dtype=np.float64)
    for pos in (0, 1):
        for style in ("neox", "norm"):
            want = x.copy()
            for i in range(d // 2):
                th = pos * base ** (-2.0 * i / d)
                a, b = (i, i + d // 2) if style == "neox" else (2 * i, 2 * i + 1)
                want[a] = x[a] * math.cos(th) - x[b] * math.sin(th)
                want[b] = x[a] * math.sin(th) + x[b] * math.cos(th)
            got = ref_model.rope(x.reshape(1, 1, d), np.array([pos]), base, style).reshape(d)
            check(np.allclose(got, want, rtol=0, atol=1e-15),
                  f"rope {style} pos {pos} = explicit rotation: got {got}, want {want}")
    # At position 1 pair 0 turns by exactly 1 radian: (x0, x4) -> (cos1 - 5 sin1, sin1 + 5 cos1)
    got = ref_model.rope(x.reshape(1, 1, d), np.array([1]), base, "neox").reshape(d)
    check(abs(got[0] - (math.cos(1) - 5 * math.sin(1))) < 1e-15, "rope neox pair 0 by 1 rad")
    # The converter's permutation: normal RoPE of permuted rows = permuted rotate-half RoPE,
    # at many positions, for q with several heads (rows of W are what is permuted).
    rng = np.random.default_rng(0)
    nh, hd = 3, 16
    W = rng.standard_normal((nh * hd, 5))
    h = rng.standard_normal(5)
    pos = np.arange(7) * 13
    a = ref_model.rope(np.tile(tiny.llama_permute(W, nh) @ h, (7, 1)).reshape(7, nh, hd), pos, 1e4, "norm")
    b = ref_model.rope(np.tile(W @ h, (7, 1)).reshape(7, nh, hd), pos, 1e4, "neox")
    pb = np.stack([tiny.llama_permute(r.reshape(nh * hd, 1), nh).reshape(nh, hd) for r in b])
    check(np.allclose(a, pb, rtol=0, atol=1e-12), "permute + normal RoPE == permuted rotate-half RoPE")
    # ... and spelled out: new row 2i = old row i, new row 2i+1 = old row i + hd/2, per head
    P = tiny.llama_permute(np.arange(nh * hd).reshape(-1, 1), nh).reshape(-1)
    want = [hh * hd + (i // 2 if i % 2 == 0 else hd // 2 + i // 2) for hh in range(nh) for i in range(hd)]
    check(list(P) == want, f"llama_permute row order, head 0: {list(P[:hd])}")


def check_router_by_hand():
    R = np.eye(4)                          # logits = h itself
    ids, w = ref_model.route(np.array([1.0, 2.0, 2.0, 0.5]), R, 2, True)
    check(list(ids) == [1, 2] and np.allclose(w, [0.5, 0.5]), f"router tie goes to the lower index: {ids} {w}")
    ids, w = ref_model.route(np.array([0.0, math.log(3.0), 0.0, math.log(2.0)]), R, 2, True)
    check(list(ids) == [1, 3] and np.allclose(w, [0.6, 0.4], rtol=0, atol=1e-15), f"router renormalized top-2 (3:2): {ids} {w}")
    ids, w = ref_model.route(np.array([0.0, math.log(3.0), 0.0, math.log(2.0)]), R, 2, False)
    check(np.allclose(w, [3 / 7, 2 / 7], rtol=0, atol=1e-15), f"router top-2 without renormalizing: {w}")


def check_bf16_by_hand():
    # Halfway cases round to the even mantissa: 1 + 2^-8 -> 1, 1 + 3*2^-8 -> 1 + 2^-6;
    # just above halfway rounds up. The bit patterns are those of bfloat16 (top half of f32).
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -2.5], np.float32)
    got = [int(b) for b in tiny.bf16_bits(x)]
    check(got == [0x3F80, 0x3F82, 0x3F81, 0xC020], f"bf16 rounding to nearest even: {[hex(g) for g in got]}")
    check(list(ref_model.bf16_to_f64(np.array(got, np.uint16))) == [1.0, 1.015625, 1.0078125, -2.5],
          "bf16 widening by a 16-bit shift")


def check_files(d, name, opts):
    try:
        import safetensors.numpy
    except ImportError:
        return
    hfd = os.path.join(d, "hf")
    with open(os.path.join(hfd, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    check(len(shards) == 2, f"{name}: 2 shards in the index ({len(shards)})")
    for s in shards:
        mine = ref_model.read_safetensors(os.path.join(hfd, s))
        same, bf16 = [], 0
        with safetensors.safe_open(os.path.join(hfd, s), framework="numpy") as f:
            check(set(f.keys()) == set(mine), f"{name}/{s}: the package lists the same names")
            for k in f.keys():
                if f.get_slice(k).get_dtype() == "BF16":   # numpy has no bfloat16
                    bf16 += 1
                else:
                    same.append(np.array_equal(f.get_tensor(k).astype(np.float64), mine[k]))
        check(all(same), f"{name}/{s}: the package reads the same values "
                         f"({sum(same)}/{len(same)} equal, {bf16} BF16 left to our reader)")
    import gguf
    T = gguf.GGMLQuantizationType
    want = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}
    for t in gguf.GGUFReader(os.path.join(d, "model.gguf")).tensors:
        if t.name.endswith(("norm.weight", "ffn_gate_inp.weight")):
            w = T.F32
        elif "_exps" in t.name:
            w = want[opts.get("experts_dtype", "bf16")]
        else:
            w = want[opts.get("dtype", "f32")]
        check(t.tensor_type == w, f"{name}: GGUF {t.name} is {t.tensor_type.name}, want {w.name}")


def check_model(tmp, name, arch, seed, opts):
    d = os.path.join(tmp, name)
    meta = tiny.write_tiny(d, arch, seed, **opts)
    check_files(d, name, opts)
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, meta["vocab"], 7)]
    hf, gg = ref_model.load(os.path.join(d, "hf")), ref_model.load(os.path.join(d, "model.gguf"))
    for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "top_k"):
        check(hf.cfg[k] == gg.cfg[k] == meta[k], f"{name}: {k} hf {hf.cfg[k]} gguf {gg.cfg[k]} meta {meta[k]}")
    lh, ih = hf.generate(prompt, 6)
    lg, ig = gg.generate(prompt, 6)
    r = rel(lg, lh)
    tol = 1e-14 if opts.get("eps") == 2.0 ** -20 else TOL
    check(r <= tol, f"{name}: HF and GGUF logits agree, relative {r:.3g} (tolerance {tol:g})")
    check(ih == ig, f"{name}: HF and GGUF generate the same ids: {ih}, {ig}")
    # Logits must be O(1) and informative, or the comparison proves little.
    check(0.3 < np.abs(lh).max() < 30, f"{name}: max |logit| in (0.3, 30): {np.abs(lh).max():.3g}")
    # Negative control for the permutation: the llama GGUF with rotate-half RoPE is wrong.
    if arch == "mixtral":
        gg.cfg["rope"] = "neox"
        gg.reset()
        bad = rel(gg.eval(prompt), lh[: len(prompt)])
        gg.cfg["rope"] = "norm"
        check(bad > 1e-3, f"{name}: the GGUF with rotate-half RoPE differs (relative {bad:.3g})")
    # The KV cache: all at once vs one by one vs uneven chunks, on the HF model and the GGUF.
    seq = prompt + ih
    for m, src in ((hf, "hf"), (gg, "gguf")):
        m.reset()
        whole = m.eval(seq)
        m.reset()
        steps = np.concatenate([m.eval([t]) for t in seq])
        m.reset()
        chunks = np.concatenate([m.eval(seq[a:b]) for a, b in ((0, 3), (3, 4), (4, 9), (9, len(seq)))])
        r1, r2 = rel(steps, whole), rel(chunks, whole)
        check(r1 <= TOL and r2 <= TOL, f"{name}/{src}: one prefill = token by token (relative "
                                       f"{r1:.3g}) = uneven chunks ({r2:.3g})")
        r3 = rel(whole, lh)
        check(r3 <= TOL, f"{name}/{src}: one prefill = generate()'s rows (relative {r3:.3g})")
    # The CLI and the logits file round-trip.
    out = os.path.join(d, "logits.bin")
    run_cli(os.path.join(d, "model.gguf"), prompt, out)
    lf, P, ids = ref_model.read_logits(out)
    check(P == len(prompt) and ids == ih and rel(lf, lh) <= TOL and lf.shape == (13, meta["vocab"]),
          f"{name}: the CLI's logits file reads back (P {P}, ids {ids}, shape {lf.shape})")
    top2 = np.sort(lh, axis=1)[:, -2:]
    print(f"{name}: hf~gguf {r:.1e}, generated {ih}, max|logit| {np.abs(lh).max():.2f}, "
          f"smallest top-1 margin {np.min(top2[:, 1] - top2[:, 0]):.2e}")


def run_cli(model, prompt, out):
    """ref_model.py's command line, its one-line summary shown only with -v."""
    import contextlib
    import io
    argv = [model, "--tokens", ",".join(map(str, prompt)), "-n", "6", "--out", out]
    sink = sys.stdout if verbose else io.StringIO()
    with contextlib.redirect_stdout(sink):
        ref_model.main(argv)


def main():
    t0 = time.time()
    check_rope_by_hand()
    check_router_by_hand()
    check_bf16_by_hand()
    with tempfile.TemporaryDirectory(prefix="tandem-ref-") as tmp:
        for cfg in CONFIGS:
            try:
                check_model(tmp, *cfg)
            except Exception as e:   # a crash is a failure of this config, not of the script
                import traceback
                traceback.print_exc()
                check(False, f"{cfg[0]}: {type(e).__name__}: {e}")
    print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s), {time.time() - t0:.2f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
