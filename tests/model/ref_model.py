#!/usr/bin/env python3
"""ref_model.py: the float64 NumPy reference forward pass of Qwen3-MoE and Mixtral, which the
C tests check the engine's logits against. It loads a Hugging Face folder (config.json and
safetensors, read by the small reader below) or a GGUF file (gguf-py's GGUFReader; block
types widened by its gguf.quants, so a file llama.cpp's quantizer wrote runs too), widens
every weight to float64 and runs the models as their definitions say; nothing is fused or
approximated (RoPE angles included, which HF and llama.cpp compute in float32).

usage: ref_model.py MODEL --tokens 1,2,3 [-n N] --out logits.bin
  MODEL is a HF folder (holding config.json) or a .gguf file. The tokens are prefilled in one
  eval, then N tokens (default 0) are decoded greedily (argmax, ties to the lowest id), each
  fed back as one decode step.

logits.bin layout (all little-endian, 24-byte header so the float64 rows are 8-aligned):
  offset 0   8 bytes   magic b"TNDREF01"
  offset 8   int32     vocab           (V)
  offset 12  int32     rows            (R = P + N: one row per prefill position and per step)
  offset 16  int32     prompt tokens   (P)
  offset 20  int32     generated       (N)
  offset 24  float64   logits[R][V]    rows 0..P-1: after prompt token 0..P-1 (causal);
                                       row P+j: after feeding generated token j
  then       int32     generated ids[N]: id j = argmax of row P-1+j
(The last row is the logits after the last generated token, for a test that wants one more.)

As a module: m = load(path); m.eval([ids]) -> float64 [len, V], keeping the KV cache, so
m.eval([a, b]) then m.eval([c]) equals m.eval([a, b, c]) row for row; m.reset() empties it.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

MAGIC = b"TNDREF01"


# ---- reading weights

def bf16_to_f64(bits):
    """bfloat16 bit patterns -> float64: a bf16 is the top half of a float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


ST_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path):
    """name -> float64 array. Format: u64 header length, JSON header, then data; offsets are
    relative to the end of the header."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b, e = h["data_offsets"]
        dt = np.dtype(ST_TYPES[h["dtype"]]).newbyteorder("<")
        a = np.frombuffer(raw, dtype=dt, count=(e - b) // dt.itemsize, offset=8 + n + b)
        a = a.reshape(h["shape"])
        out[name] = bf16_to_f64(a) if h["dtype"] == "BF16" else a.astype(np.float64)
    return out


class Weights(dict):
    """A name -> array map whose take() records what was used, so that a loader can refuse
    files with tensors it did not understand (a wrong name mapping fails loudly)."""

    def take(self, name):
        self.used = getattr(self, "used", set()) | {name}
        return self[name]

    def check_all_used(self, what):
        left = sorted(set(self) - getattr(self, "used", set()))
        if left:
            raise ValueError(f"{what}: tensors not used by the model: {left[:8]}")


def load_hf(d):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    mt = c["model_type"]
    if mt not in ("qwen3_moe", "mixtral"):
        raise ValueError(f"unsupported model_type {mt}")
    # Refuse what this reference does not implement rather than silently ignore it.
    if c.get("rope_scaling") or c.get("attention_bias"):
        raise ValueError("rope_scaling / attention_bias are not implemented")
    if c.get("sliding_window") and c.get("use_sliding_window", mt == "mixtral"):
        raise ValueError("sliding-window attention is not implemented")
    if mt == "qwen3_moe" and (c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers")):
        raise ValueError("dense (mlp_only) layers are not implemented")
    idx = os.path.join(d, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    w = Weights()
    for fn in files:
        w.update(read_safetensors(os.path.join(d, fn)))
    heads = c["num_attention_heads"]
    cfg = dict(arch=mt, vocab=c["vocab_size"], hidden=c["hidden_size"],
               layers=c["num_hidden_layers"], heads=heads,
               kv_heads=c.get("num_key_value_heads", heads),
               head_dim=c.get("head_dim") or c["hidden_size"] // heads,
               top_k=c["num_experts_per_tok"], eps=c["rms_norm_eps"],
               rope_theta=c.get("rope_theta",  # transformers 5: in rope_parameters
                                (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
               rope="neox",  # HF: rotate half
               qk_norm=mt == "qwen3_moe",
               # Mixtral's softmax over the top-k logits = renormalized top-k probabilities
               norm_topk=c.get("norm_topk_prob", False) if mt == "qwen3_moe" else True)
    # transformers 5 writes num_local_experts for Qwen3-MoE too
    cfg["experts"] = c.get("num_experts") or c["num_local_experts"] if mt == "qwen3_moe" \
        else c["num_local_experts"]
    layers = []
    for L in range(cfg["layers"]):
        p = f"model.layers.{L}."
        m, names = (p + "mlp.", ("gate_proj", "up_proj", "down_proj")) if mt == "qwen3_moe" \
            else (p + "block_sparse_moe.", ("w1", "w3", "w2"))
        lay = dict(attn_norm=w.take(p + "input_layernorm.weight"),
                   wq=w.take(p + "self_attn.q_proj.weight"), wk=w.take(p + "self_attn.k_proj.weight"),
                   wv=w.take(p + "self_attn.v_proj.weight"), wo=w.take(p + "self_attn.o_proj.weight"),
                   ffn_norm=w.take(p + "post_attention_layernorm.weight"),
                   router=w.take(m + "gate.weight"))
        if cfg["qk_norm"]:
            lay["q_norm"] = w.take(p + "self_attn.q_norm.weight")
            lay["k_norm"] = w.take(p + "self_attn.k_norm.weight")
        for key, hn in zip(("gate", "up", "down"), names):
            lay[key] = np.stack([w.take(f"{m}experts.{e}.{hn}.weight") for e in range(cfg["experts"])])
        layers.append(lay)
    emb = w.take("model.embed_tokens.weight")
    head = emb if c.get("tie_word_embeddings") else w.take("lm_head.weight")
    top = dict(emb=emb, out_norm=w.take("model.norm.weight"), head=head)
    w.check_all_used(d)
    return Model(cfg, top, layers)


def gguf_tensor(t):
    import gguf
    T = gguf.GGMLQuantizationType
    if t.tensor_type == T.BF16:   # gguf-py hands BF16 over as raw bytes [..., 2*ne0]
        return bf16_to_f64(np.ascontiguousarray(t.data).view("<u2"))
    if t.tensor_type in (T.F32, T.F16, T.F64):
        return np.asarray(t.data, dtype=np.float64)
    if t.tensor_type in gguf.GGML_QUANT_SIZES:   # a block type: the gguf package's widening
        try:
            return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        except NotImplementedError:
            pass
    raise ValueError(f"{t.name}: tensor type {t.tensor_type.name} is not implemented")


def load_gguf(path):
    import gguf
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items()}
    arch = kv["general.architecture"]
    if arch not in ("qwen3moe", "llama"):
        raise ValueError(f"unsupported architecture {arch}")
    g = lambda k, d=None: kv.get(f"{arch}.{k}", d)   # noqa: E731
    if g("expert_count") is None:
        raise ValueError("a llama GGUF without experts (dense) is not implemented")
    heads, hidden = g("attention.head_count"), g("embedding_length")
    hd = g("attention.key_length") or hidden // heads
    if g("rope.dimension_count", hd) != hd:
        raise ValueError("partial RoPE is not implemented")
    cfg = dict(arch=arch, hidden=hidden, layers=g("block_count"), heads=heads,
               kv_heads=g("attention.head_count_kv", heads), head_dim=hd,
               experts=g("expert_count"), top_k=g("expert_used_count"),
               eps=float(g("attention.layer_norm_rms_epsilon")),
               rope_theta=float(g("rope.freq_base", 10000.0)),
               # llama.cpp: qwen3moe uses NEOX RoPE (pairs i, i+d/2) on the weights as HF has
               # them; llama uses normal RoPE (pairs 2i, 2i+1) on q/k rows the converter permuted
               rope="neox" if arch == "qwen3moe" else "norm",
               qk_norm=arch == "qwen3moe",
               # llama.cpp renormalizes the top-k weights for both (hard-coded for qwen3moe)
               norm_topk=bool(g("expert_weights_norm", True)))
    w = Weights({t.name: gguf_tensor(t) for t in r.tensors})
    layers = []
    for L in range(cfg["layers"]):
        b = f"blk.{L}."
        lay = {k: w.take(b + n + ".weight") for k, n in (
            ("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
            ("wo", "attn_output"), ("ffn_norm", "ffn_norm"), ("router", "ffn_gate_inp"),
            ("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps"))}
        if cfg["qk_norm"]:
            lay["q_norm"] = w.take(b + "attn_q_norm.weight")
            lay["k_norm"] = w.take(b + "attn_k_norm.weight")
        layers.append(lay)
    emb = w.take("token_embd.weight")
    cfg["vocab"] = emb.shape[0]
    head = w.take("output.weight") if "output.weight" in w else emb   # absent: tied
    top = dict(emb=emb, out_norm=w.take("output_norm.weight"), head=head)
    w.check_all_used(path)
    return Model(cfg, top, layers)


def load(path):
    if os.path.isdir(path):
        return load_hf(path)
    return load_gguf(path)


# ---- the pieces of the forward pass

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, base, style):
    """x [n, heads, d] at positions pos [n]. Frequency index i (0 <= i < d/2) turns by angle
    pos * base^(-2i/d). "neox" (HF rotate-half) rotates the pair (x[i], x[i+d/2]); "norm"
    (llama.cpp's normal RoPE) rotates the adjacent pair (x[2i], x[2i+1])."""
    d = x.shape[-1]
    ang = np.asarray(pos, dtype=np.float64)[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if style == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def route(h, router, top_k, norm_topk):
    """Router for one token: softmax over all experts, the top_k most probable (ties go to the
    lower index: stable sort), their probabilities renormalized to sum 1 if norm_topk.
    Returns (expert ids, weights)."""
    z = router @ h
    p = np.exp(z - z.max())
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:top_k]
    wts = p[ids]
    return ids, (wts / wts.sum() if norm_topk else wts)


class Model:
    def __init__(self, cfg, top, layers):
        self.cfg, self.top, self.layers = cfg, top, layers
        self.reset()

    def reset(self):
        self.pos = 0
        self.cache = [(np.zeros((0, self.cfg["kv_heads"], self.cfg["head_dim"])),) * 2
                      for _ in self.layers]

    def attention(self, L, lay, h, pos):
        c, n = self.cfg, h.shape[0]
        nh, nkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
        q = (h @ lay["wq"].T).reshape(n, nh, hd)
        k = (h @ lay["wk"].T).reshape(n, nkv, hd)
        v = (h @ lay["wv"].T).reshape(n, nkv, hd)
        if c["qk_norm"]:   # Qwen3: per-head RMSNorm over head_dim, before RoPE
            q, k = rms_norm(q, lay["q_norm"], c["eps"]), rms_norm(k, lay["k_norm"], c["eps"])
        q, k = rope(q, pos, c["rope_theta"], c["rope"]), rope(k, pos, c["rope_theta"], c["rope"])
        K = np.concatenate([self.cache[L][0], k])
        V = np.concatenate([self.cache[L][1], v])
        self.cache[L] = (K, V)
        kpos = np.arange(K.shape[0])
        mask = kpos[None, :] <= pos[:, None]          # causal: key j visible to query at pos >= j
        out = np.empty((n, nh, hd))
        for hh in range(nh):
            g = hh // (nh // nkv)                       # grouped-query: heads share kv head g
            s = q[:, hh, :] @ K[:, g, :].T / np.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh, :] = (s / s.sum(axis=1, keepdims=True)) @ V[:, g, :]
        return out.reshape(n, nh * hd) @ lay["wo"].T

    def moe(self, lay, h):
        c, y = self.cfg, np.zeros_like(h)
        for t in range(h.shape[0]):
            ids, wts = route(h[t], lay["router"], c["top_k"], c["norm_topk"])
            for e, wt in zip(ids, wts):
                act = silu(lay["gate"][e] @ h[t]) * (lay["up"][e] @ h[t])   # SwiGLU
                y[t] += wt * (lay["down"][e] @ act)
        return y

    def eval(self, tokens):
        """Logits [len(tokens), vocab] for tokens at the next positions; extends the cache."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        c = self.cfg
        if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= c["vocab"]:
            raise ValueError("tokens must be a non-empty list of ids below the vocabulary size")
        pos = self.pos + np.arange(tokens.size)
        x = self.top["emb"][tokens]
        for L, lay in enumerate(self.layers):
            x = x + self.attention(L, lay, rms_norm(x, lay["attn_norm"], c["eps"]), pos)
            x = x + self.moe(lay, rms_norm(x, lay["ffn_norm"], c["eps"]))
        self.pos += tokens.size
        return rms_norm(x, self.top["out_norm"], c["eps"]) @ self.top["head"].T

    def generate(self, prompt, n):
        """Prefill prompt, then n greedy steps. Returns (logits [len(prompt)+n, V], ids [n])."""
        rows, ids = [self.eval(prompt)], []
        for _ in range(n):
            ids.append(int(np.argmax(rows[-1][-1])))
            rows.append(self.eval([ids[-1]]))
        return np.concatenate(rows), ids


# ---- the logits file (layout at the top)

def write_logits(path, logits, n_prompt, ids):
    R, V = logits.shape
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<4i", V, R, n_prompt, len(ids)))
        f.write(np.ascontiguousarray(logits, dtype="<f8").tobytes())
        f.write(np.asarray(ids, dtype="<i4").tobytes())


def read_logits(path):
    """-> (logits [R, V] float64, n_prompt, generated ids)."""
    raw = open(path, "rb").read()
    if raw[:8] != MAGIC:
        raise ValueError(f"{path}: not a reference logits file")
    V, R, P, N = struct.unpack_from("<4i", raw, 8)
    logits = np.frombuffer(raw, dtype="<f8", count=R * V, offset=24).reshape(R, V)
    ids = np.frombuffer(raw, dtype="<i4", count=N, offset=24 + 8 * R * V)
    return logits, P, list(ids)


def main(argv=None):
    ap = argparse.ArgumentParser(description="float64 reference logits of a Qwen3-MoE/Mixtral model")
    ap.add_argument("model", help="HF folder or .gguf file")
    ap.add_argument("--tokens", required=True, help="comma-separated prompt ids")
    ap.add_argument("-n", type=int, default=0, help="greedy decode steps after the prompt")
    ap.add_argument("--out", required=True, help="binary logits file (layout in this file's header)")
    a = ap.parse_args(argv)
    prompt = [int(t) for t in a.tokens.split(",") if t.strip()]
    m = load(a.model)
    logits, ids = m.generate(prompt, a.n)
    write_logits(a.out, logits, len(prompt), ids)
    print(f"{a.model}: {m.cfg['arch']}, {logits.shape[0]} rows x {logits.shape[1]}, "
          f"generated {ids}, max |logit| {np.abs(logits).max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
