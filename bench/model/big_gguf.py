"""big_gguf.py: writes a GGUF file with a real model's shapes and random weights, tensor by
tensor (a 16-layer Qwen3-30B-A3B is 10 GB in F16: nothing is held whole), for the whole-model
benchmarks (`tandem bench -m` against llama.cpp's llama-bench on the same file).

usage: big_gguf.py --shape qwen3-30b-a3b|mixtral-8x7b --layers L --out FILE
                   [--dtype f16|bf16|q4_k_m] [--experts f16|bf16|q8_0|q4_k_m] [--seed N]

The metadata and tensor names are those of tests/model/tiny.py (llama.cpp's own), and so is
the vocabulary's form (a gpt2 tokenizer of placeholder tokens). The values are uniform with
each projection's fan-in scale, drawn from a pool of random numbers at random offsets: the
file's bytes are random for every purpose a benchmark has, and writing it is bound by the
disk, not the generator. The router is F32 and bf16-exact (tandem computes routers in bf16),
the norms F32 near 1.

--experts q8_0 or q4_k_m stores the experts in GGUF's blocks (the rest stays in --dtype): random
bytes with scales set so that the values keep about the fan-in scale (Q8_0: d = s / 127; Q4_K:
d and dmin of s / 472 and s / 63; Q6_K: positive int8 scales under d = s / 4064). q4_k_m is
a mix: Q4_K gate and up, Q6_K down in even layers and Q4_K in odd ones. --dtype q4_k_m types
every tensor as llama.cpp's quantizer types a Q4_K_M file (tiny.q4_k_m_type: the embedding and
the projections in Q4_K, the LM head and some layers' v and expert down projections in Q6_K,
Mixtral's attention output in Q5_K and its k and v in Q8_0), as a file a user quantized with
llama.cpp would hold (Q5_K: d and dmin of s / 976 and s / 63).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "model"))
import tiny  # noqa: E402  (its metadata, vocabulary and bf16 rounding)

SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", vocab=151936, hidden=2048, heads=32, kv_heads=4,
                          head_dim=128, experts=128, top_k=8, moe_ffn=768, ctx=40960,
                          rope_theta=1e6, eps=1e-6),
    "mixtral-8x7b": dict(arch="llama", vocab=32000, hidden=4096, heads=32, kv_heads=8,
                         head_dim=128, experts=8, top_k=2, moe_ffn=14336, ctx=32768,
                         rope_theta=1e6, eps=1e-5),
}
POOL = 1 << 26


class Source:
    """Random values in [-1, 1) from a pool, at random offsets (and random bytes, the pool's)."""

    def __init__(self, seed, dtype):
        self.rng = np.random.default_rng(seed)
        self.pool = (self.rng.random(POOL, dtype=np.float32) * 2 - 1)
        self.dtype = dtype

    def bytes(self, n):
        raw = self.pool.view(np.uint8)
        out = np.empty(n, dtype=np.uint8)
        at = 0
        while at < n:
            c = min(n - at, raw.size // 2)
            o = int(self.rng.integers(0, raw.size - c))
            out[at:at + c] = raw[o:o + c]
            at += c
        return out

    def take(self, shape, scale):
        n = int(np.prod(shape))
        out = np.empty(n, dtype=np.float32)
        at = 0
        while at < n:
            c = min(n - at, POOL // 2)
            o = int(self.rng.integers(0, POOL - c))
            np.multiply(self.pool[o:o + c], scale, out=out[at:at + c])
            at += c
        return out.reshape(shape)


def f16_bytes(v):
    return np.asarray(v, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(src, qtype, rows, cols, scale):
    """[rows, cols / block * bytes] uint8: random blocks of qtype (q8_0, q4_k, q5_k, q6_k)."""
    block, nbytes = {"q8_0": (32, 34), "q4_k": (256, 144), "q5_k": (256, 176),
                     "q6_k": (256, 210)}[qtype]
    n = rows * (cols // block)
    b = src.bytes(n * nbytes).reshape(n, nbytes)
    if qtype == "q8_0":
        b[:, 0:2] = f16_bytes(np.full(n, scale / 127.0))
    elif qtype in ("q4_k", "q5_k"):
        top = 15 if qtype == "q4_k" else 31
        b[:, 0:2] = f16_bytes(np.full(n, 2.0 * scale / (63 * top)))
        b[:, 2:4] = f16_bytes(np.full(n, scale / 63.0))
    else:
        b[:, 192:208] = 64 | (b[:, 192:208] & 63)
        b[:, 208:210] = f16_bytes(np.full(n, scale / (127.0 * 32)))
    return b.reshape(rows, (cols // block) * nbytes)


def expert_qtype(experts, name, layer):
    """A q4_k_m expert tensor's block type (the even layers' mix), else experts' own."""
    if experts != "q4_k_m":
        return experts
    return "q6_k" if "down" in name and layer % 2 == 0 else "q4_k"


KINDS = {"token_embd": "embd", "output": "output", "attn_q": "attn_q", "attn_k": "attn_k",
         "attn_v": "attn_v", "attn_output": "attn_output", "ffn_gate_exps": "gate",
         "ffn_up_exps": "up", "ffn_down_exps": "down"}


def tensor_qtype(a, cfg, L, name, kind, shape):
    """The block type a tensor is written in, or None (F32, or --dtype's 16 bits)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if a.dtype == "q4_k_m" and kind in ("dense", "expert"):
        role = KINDS[name.split(".")[-2]]
        return tiny.q4_k_m_type(role, layer, L, cfg["experts"], shape[-1])
    if kind == "expert":
        return expert_qtype(a.experts or a.dtype, name, layer)
    return None


def plan(cfg, L):
    """(name, numpy shape, kind, fan_in) in file order; kind: dense, expert, norm, router."""
    H, hd, E, I, V = cfg["hidden"], cfg["head_dim"], cfg["experts"], cfg["moe_ffn"], cfg["vocab"]
    qd, kvd = cfg["heads"] * hd, cfg["kv_heads"] * hd
    t = [("token_embd.weight", (V, H), "dense", H)]
    for l in range(L):
        b = f"blk.{l}."
        t += [(b + "attn_norm.weight", (H,), "norm", 0),
              (b + "attn_q.weight", (qd, H), "dense", H),
              (b + "attn_k.weight", (kvd, H), "dense", H),
              (b + "attn_v.weight", (kvd, H), "dense", H),
              (b + "attn_output.weight", (H, qd), "dense", qd)]
        if cfg["arch"] == "qwen3moe":
            t += [(b + "attn_q_norm.weight", (hd,), "norm", 0),
                  (b + "attn_k_norm.weight", (hd,), "norm", 0)]
        t += [(b + "ffn_norm.weight", (H,), "norm", 0),
              (b + "ffn_gate_inp.weight", (E, H), "router", H),
              (b + "ffn_gate_exps.weight", (E, I, H), "expert", H),
              (b + "ffn_up_exps.weight", (E, I, H), "expert", H),
              (b + "ffn_down_exps.weight", (E, H, I), "expert", I)]
    t += [("output_norm.weight", (H,), "norm", 0), ("output.weight", (V, H), "dense", H)]
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", choices=("f16", "bf16", "q4_k_m"), default="f16",
                    help="f16 or bf16; q4_k_m: every tensor as llama.cpp types a Q4_K_M file")
    ap.add_argument("--experts", choices=("f16", "bf16", "q8_0", "q4_k_m"), default=None,
                    help="the experts' type (default: --dtype)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=0,
                    help="another vocabulary size than the shape's (to see what the LM head and "
                    "its logits cost a step)")
    a = ap.parse_args(argv)
    import gguf
    cfg, L = dict(SHAPES[a.shape]), a.layers
    if a.vocab:
        cfg["vocab"] = a.vocab
    if a.dtype == "q4_k_m" and a.experts not in (None, "q4_k_m"):
        ap.error("--dtype q4_k_m types the experts too")
    T = gguf.GGMLQuantizationType
    QT = {"q8_0": (T.Q8_0, 32, 34), "q4_k": (T.Q4_K, 256, 144), "q5_k": (T.Q5_K, 256, 176),
          "q6_k": (T.Q6_K, 256, 210)}
    wtype = T.BF16 if a.dtype == "bf16" else T.F16
    w = gguf.GGUFWriter(a.out, cfg["arch"])
    tiny.add_metadata(w, cfg["arch"], f"{a.shape}-{L}L-random", cfg, L, cfg["moe_ffn"], a.dtype)
    tensors = plan(cfg, L)
    f32 = lambda kind: kind in ("norm", "router")  # noqa: E731
    for name, shape, kind, _ in tensors:
        n = int(np.prod(shape))
        qt = tensor_qtype(a, cfg, L, name, kind, shape)
        if qt in QT:
            gt, block, nbytes = QT[qt]
            byte_shape = (*shape[:-1], shape[-1] // block * nbytes)  # uint8 data: rows of bytes
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n // block * nbytes,
                              raw_dtype=gt)
        elif f32(kind):
            w.add_tensor_info(name, shape, np.dtype(np.float32), n * 4)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float16) if a.dtype != "bf16"
                              else np.dtype(np.uint16), n * 2,
                              raw_dtype=wtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    src = Source(a.seed, a.dtype)
    t0, done = time.time(), 0
    for name, shape, kind, fan in tensors:
        qt = tensor_qtype(a, cfg, L, name, kind, shape)
        if qt in QT:
            data = random_blocks(src, qt, int(np.prod(shape[:-1])), shape[-1], np.sqrt(3.0 / fan))
            w.write_tensor_data(data)
            done += data.nbytes
            continue
        if kind == "norm":
            v = 1.0 + 0.1 * src.take(shape, 1.0)
        else:
            v = src.take(shape, np.sqrt(3.0 / fan))
        if kind == "router":
            v = tiny.round_to(v, "bf16").astype(np.float32)
        if f32(kind):
            data = v.astype(np.float32)
        elif a.dtype != "bf16":
            data = v.astype(np.float16)
        else:
            data = tiny.bf16_bits(v)
        w.write_tensor_data(data)
        done += data.nbytes
        if sys.stderr.isatty() or name.endswith("ffn_down_exps.weight"):
            print(f"\r  {done / 2**30:6.1f} GiB written ({time.time() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    w.close()
    print(f"\n{a.out}: {a.shape}, {L} layers, {done / 2**30:.2f} GiB of tensors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
