#!/usr/bin/env python3
"""tiny.py: writes a tiny random Qwen3-MoE or Mixtral model, from one seed, in both file formats
the model layer reads, so that the C tests can load either and compare its logits against
ref_model.py (the float64 reference):

  DIR/hf/          a Hugging Face folder: config.json, two safetensors shards and
                   model.safetensors.index.json, with the names and layouts of
                   Qwen3MoeForCausalLM / MixtralForCausalLM
  DIR/model.gguf   the same weights as llama.cpp's converter lays them out: arch `qwen3moe`,
                   or arch `llama` with experts for Mixtral (q and k rows permuted, see
                   llama_permute), experts stacked into 3-D ffn_*_exps tensors
  DIR/meta.json    the shapes, dtypes and seed

usage: tiny.py --arch qwen3moe|mixtral --out DIR [--seed N] [--layers L]
               [--dtype f32|f16|bf16|q8_0|q4_k_m]
               [--experts-dtype f32|f16|bf16|q8_0|mxfp4|q4_k_m|q5_k]
               [--tied] [--vocab V] [--hidden H] [--heads N]
               [--kv-heads N] [--head-dim D] [--experts E] [--top-k K] [--moe-ffn I] [--ctx C]
               [--rope-theta T] [--eps E] [--shard-tensors N]

Every weight is drawn once, rounded once to the dtype it is stored in, and written to both
files from those same values; where llama.cpp keeps a tensor in F32 (norms, the router) the
GGUF holds the rounded value widened, exactly as its converter would. So the two files describe
bit-identical models and ref_model.py must give the same logits from either.

The block types go to the GGUF as blocks and to the safetensors as their values in F32 (a
Hugging Face folder holds no GGUF blocks). q8_0 is quantized here with power-of-two block
scales, mxfp4 by the gguf package (whose scales are powers of two too): every value is then a
bf16 value, which is what tandem computes experts in, so the logits still compare closely.
q4_k_m mixes the types as llama.cpp's Q4_K_M files do: Q4_K gate and up projections, and down
projections in Q6_K in even layers and Q4_K in odd ones (it needs --hidden and --moe-ffn
multiples of 256). The gguf package has no quantizer for these, so this file has its own
(plain round-to-nearest under the block's largest scale, not llama.cpp's search); the values
are what gguf.quants.dequantize makes of its blocks, and are not bf16 values. --dtype q4_k_m
types every tensor as llama.cpp's quantizer types a Q4_K_M file (q4_k_m_type: Mixtral's
attention output in Q5_K, its k and v in Q8_0, Q5_0, Q5_1 and Q8_0 where a row is no whole
number of 256 values), Q5_K by this file's quantizer and the 32-value types by the package's.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

# Defaults per architecture. q dim = heads * head_dim (64, = hidden here; --head-dim can make
# it differ, as it does in the real Qwen3 models). Qwen3's `ffn` is the dense intermediate_size
# that no layer uses (every layer is MoE); it differs from moe_ffn so that a loader reading the
# wrong key fails. Mixtral has only experts: its intermediate_size is the expert size.
DEFAULTS = {
    "qwen3moe": dict(vocab=256, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=4,
                     moe_ffn=32, ffn=96, layers=2, ctx=256, rope_theta=1e6, eps=1e-6),
    "mixtral": dict(vocab=256, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                    moe_ffn=32, ffn=32, layers=2, ctx=256, rope_theta=1e4, eps=1e-6),
}
DTYPES = ("f32", "f16", "bf16")
# block types, GGUF only (F32 values in the safetensors); q4_k_m is a mix of them
QTYPES = ("q8_0", "mxfp4", "q4_k", "q6_k", "q5_k", "q4_0", "q4_1", "q5_0", "q5_1")
KTYPES = ("q4_k", "q6_k", "q5_k")
# types whose blocks the file gets as they were made (quantizing their values again need not
# give the same blocks): (values, bytes) a block
KEPT = {"q4_k": (256, 144), "q6_k": (256, 210), "q5_k": (256, 176), "q4_0": (32, 18),
        "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24)}


# ---- rounding and encoding: values are kept as float32 arrays holding exactly representable
# ---- values of the storage dtype, and turned into bytes only when written.

def bf16_bits(a):
    """float32 -> uint16 upper halves, rounded to nearest even (NaN is not expected here)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def q8_0_blocks(a):
    """Q8_0 blocks (uint8 rows of 34-byte blocks) of a [.., K] array, K a multiple of 32, with
    each block's scale the power of two 2^ceil(log2(amax / 127)) (0 for an all-zero block):
    d q is then exact in bf16, and quantizing the dequantized values gives the same blocks."""
    x = np.asarray(a, dtype=np.float32)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 127.0)), 0)
    d = np.where(amax > 0, np.exp2(e), 0).astype(np.float32)
    q = np.where(d[:, None] > 0, np.round(blocks / np.where(d > 0, d, 1)[:, None]), 0)
    q = np.clip(q, -127, 127).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          q.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def f16_round(a):
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def k_affine(x, top):
    """Q4_K's and Q5_K's grid of blocks x [n, 256]: per sub-block of 32 an affine grid of
    values 0..top from its minimum (at most 0) to its maximum, its scale and minimum in 6 bits
    under the block's f16 d and dmin. Returns the blocks' first 16 bytes [n, 16] (d, dmin and
    ggml's packing of the scales and minimums) and the values [n, 8, 32] (uint8)."""
    sub = x.reshape(-1, 8, 32)
    mn = np.minimum(sub.min(axis=2), 0.0)
    sc = (sub.max(axis=2) - mn) / float(top)
    d = f16_round(np.maximum(sc.max(axis=1), 1e-8) / 63.0)
    dmin = f16_round(np.maximum((-mn).max(axis=1), 1e-8) / 63.0)
    isc = np.clip(np.round(sc / d[:, None]), 1, 63).astype(np.int64)
    imn = np.clip(np.round(-mn / dmin[:, None]), 0, 63).astype(np.int64)
    step = (d[:, None] * isc)[:, :, None]
    q = np.clip(np.round((sub + (dmin[:, None] * imn)[:, :, None]) / step), 0, top)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    for i in range(4):  # ggml's packing of eight 6-bit scales and mins into 12 bytes
        scales[:, i] = isc[:, i] | ((isc[:, i + 4] >> 4) << 6)
        scales[:, i + 4] = imn[:, i] | ((imn[:, i + 4] >> 4) << 6)
        scales[:, i + 8] = (isc[:, i + 4] & 15) | ((imn[:, i + 4] & 15) << 4)
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), scales], axis=1)
    return head, q.astype(np.uint8)


def q4_k_quantize(x):
    """Q4_K blocks [n, 144] of blocks x [n, 256]: k_affine's grid with 4-bit values."""
    head, q = k_affine(x, 15)
    q = q.reshape(-1, 4, 2, 32)  # [block, 64-chunk, low/high nibble, 32]
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def q6_k_quantize(x):
    """Q6_K blocks [n, 210] of blocks x [n, 256]: per sub-block of 16 a symmetric 6-bit grid
    (-32..31) under an int8 scale, under the block's f16 d."""
    sub = x.reshape(-1, 16, 16)
    sc = np.abs(sub).max(axis=2) / 31.0
    d = f16_round(np.maximum(sc.max(axis=1), 1e-8) / 127.0)
    isc = np.clip(np.round(sc / d[:, None]), 1, 127).astype(np.int64)
    q = np.clip(np.round(sub / (d[:, None] * isc)[:, :, None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, 32]
    # per half: ql = quarters 0 | 2 (low nibbles), then 1 | 3; qh = the four quarters' top bits
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) |
          ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, isc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)


def q5_k_quantize(x):
    """Q5_K blocks [n, 176] of blocks x [n, 256]: k_affine's grid with 5-bit values, the fifth
    bits of sub-blocks 2c and 2c + 1 in bits 2c and 2c + 1 of qh."""
    head, q = k_affine(x, 31)                       # q: [block, sub-block, 32]
    lo = (q & 15).reshape(-1, 4, 2, 32)
    qs = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(-1, 128)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j, :] >> 4) << j).astype(np.uint8)
    return np.concatenate([head, qh, qs], axis=1)


def gguf_qtype(dtype):
    import gguf
    return gguf.GGMLQuantizationType[dtype.upper()]


# Kept types' blocks by their values' bytes: quantizing the dequantized values of a block again
# need not give the same block, so the file gets the blocks the values came from.
_KBLOCKS = {}


def kept_blocks(a, dtype):
    x = np.asarray(a, dtype=np.float32)
    n, nb = KEPT[dtype]
    flat = x.reshape(-1, n)
    out = np.empty((flat.shape[0], nb), dtype=np.uint8)
    for i, row in enumerate(flat):
        out[i] = _KBLOCKS[(dtype, row.tobytes())]
    return out.reshape(*x.shape[:-1], x.shape[-1] // n * nb)


def q_blocks(a, dtype):
    import gguf
    if dtype == "q8_0":
        return q8_0_blocks(a)
    if dtype in KEPT:
        return kept_blocks(a, dtype)
    return gguf.quants.quantize(np.asarray(a, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)


def dequant(blocks, dtype):
    import gguf
    return gguf.quants.dequantize(blocks, gguf_qtype(dtype)).astype(np.float32)


def kept_round(a, dtype):
    """a quantized to a kept type: the values of its blocks (which _KBLOCKS keeps). The K types
    by this file's quantizers, the 32-value ones by the gguf package's."""
    import gguf
    x = np.asarray(a, dtype=np.float32)
    n = KEPT[dtype][0]
    if x.shape[-1] % n:
        raise ValueError(f"{dtype} rows of {x.shape[-1]} values: not a multiple of {n}")
    flat = x.reshape(-1, n)
    if dtype in KTYPES:
        blocks = {"q4_k": q4_k_quantize, "q6_k": q6_k_quantize, "q5_k": q5_k_quantize}[dtype](flat)
    else:
        blocks = gguf.quants.quantize(flat, gguf_qtype(dtype)).reshape(flat.shape[0], -1)
    vals = dequant(blocks, dtype).reshape(flat.shape)
    for v, b in zip(vals, blocks):
        _KBLOCKS[(dtype, v.tobytes())] = b
    return vals.reshape(x.shape)


def round_to(a, dtype):
    a = np.asarray(a, dtype=np.float32)
    if dtype in KEPT:
        return kept_round(a, dtype)
    if dtype in QTYPES:
        return dequant(q_blocks(a, dtype), dtype)
    if dtype == "f16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return bf16_to_f32(bf16_bits(a))
    return a


def encode(a, dtype):
    """Storage array for a value array already rounded to dtype (bf16: uint16 bit patterns;
    block types: their values, F32, as the safetensors hold them)."""
    if dtype in QTYPES:
        return a.astype(np.float32)
    if dtype == "f16":
        return a.astype(np.float16)
    if dtype == "bf16":
        return bf16_bits(a)
    return a.astype(np.float32)


# ---- the permutation llama.cpp's converter applies to q and k of `llama` models.
# HF rotates pairs (i, i + d/2) of each head ("rotate half"); llama.cpp's normal RoPE rotates
# adjacent pairs (2i, 2i+1) with the same frequency index i. Interleaving each head's two halves
# (new row 2i = old row i, new row 2i+1 = old row d/2 + i) makes the two agree: the rotated
# q and k come out permuted the same way within each head, and q.k is unchanged.

def llama_permute(w, n_head):
    """Rows of w [n_head*d, in] regrouped per head as (2, d/2) -> (d/2, 2)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- llama.cpp's Q4_K_M mix: the type its quantizer (llama-quant.cpp) gives each tensor of a
# Q4_K_M file, for the dense weights as well as the experts. Norms and routers stay F32.

def more_bits(i, n):
    """llama.cpp's layers that get more bits: the first and last eighths, and every third."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(kind, layer, layers, experts, ncols, tied=False):
    """kind: embd, output, attn_q, attn_k, attn_v, attn_output, gate, up or down (experts);
    ncols: the row's length (values), whose blocks must fit: a K type falls back to Q5_0 (from
    Q4_K), Q5_1 (from Q5_K) or Q8_0 (from Q6_K) where a row is no whole number of 256, as the
    quantizer does."""
    if kind == "output" or (kind == "embd" and tied):
        return "q6_k" if ncols % 256 == 0 else "q8_0"
    t = "q4_k"
    if kind == "attn_v":
        t = "q8_0" if experts == 8 else "q6_k" if more_bits(layer, layers) else "q4_k"
    elif kind == "attn_k" and experts == 8:
        t = "q8_0"
    elif kind == "attn_output" and experts == 8:
        t = "q5_k"
    elif kind == "down" and more_bits(layer, layers):
        t = "q6_k"
    if ncols % 256:
        t = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}.get(t, t)
    if ncols % 32:
        t = "f16"
    return t


# ---- the random model, as HF names -> (values, storage dtype)

def make_weights(arch, cfg, seed, dtype, experts_dtype, tied, router_bf16=False):
    rng = np.random.default_rng(seed)
    H, hd, I, E = cfg["hidden"], cfg["head_dim"], cfg["moe_ffn"], cfg["experts"]
    qd, kvd = cfg["heads"] * hd, cfg["kv_heads"] * hd
    w = {}

    def lin(name, out_dim, in_dim, dt=dtype):
        # normal / sqrt(fan_in): every projection keeps O(1) activations, so logits are O(1)
        w[name] = (round_to(rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim), dt), dt)

    # Norms and routers, which llama.cpp keeps in F32, are never block types: with a block
    # dtype for the rest they are F32.
    plain = dtype if dtype in DTYPES else "f32"
    L_all = cfg["layers"]

    def dt(kind, layer, ncols):
        """A dense projection's dtype: llama.cpp's Q4_K_M mix under dtype q4_k_m."""
        if dtype != "q4_k_m":
            return dtype
        return q4_k_m_type(kind, layer, L_all, E, ncols, tied)

    def router(name):
        # router_bf16: values bf16 holds exactly, whatever the file's type, for engines that
        # compute routers in bf16 (tandem's MoE operations): the same routing as the reference
        lin(name, E, H, plain)
        if router_bf16:
            w[name] = (round_to(round_to(w[name][0], "bf16"), plain), plain)

    def norm(name, n):
        # near 1, never 0: a dropped or misapplied norm still shows in the logits
        w[name] = (round_to(1.0 + 0.1 * rng.standard_normal(n), plain), plain)

    def edt(kind, layer):
        """An expert projection's dtype: with dtype q4_k_m, llama.cpp's mix; with experts_dtype
        q4_k_m alone, Q6_K down projections in even layers; else experts_dtype."""
        if dtype == "q4_k_m":
            return q4_k_m_type(kind, layer, L_all, E, I if kind == "down" else H)
        if experts_dtype != "q4_k_m":
            return experts_dtype
        return "q6_k" if kind == "down" and layer % 2 == 0 else "q4_k"

    # The embedding is scaled like a projection too: as a tied head its logits stay O(1), and
    # the input token does not dominate the residual stream (greedy would just repeat it).
    lin("model.embed_tokens.weight", cfg["vocab"], H, dt("embd", 0, H))
    for L in range(cfg["layers"]):
        p = f"model.layers.{L}."
        norm(p + "input_layernorm.weight", H)
        lin(p + "self_attn.q_proj.weight", qd, H, dt("attn_q", L, H))
        lin(p + "self_attn.k_proj.weight", kvd, H, dt("attn_k", L, H))
        lin(p + "self_attn.v_proj.weight", kvd, H, dt("attn_v", L, H))
        lin(p + "self_attn.o_proj.weight", H, qd, dt("attn_output", L, qd))
        if arch == "qwen3moe":
            norm(p + "self_attn.q_norm.weight", hd)
            norm(p + "self_attn.k_norm.weight", hd)
        norm(p + "post_attention_layernorm.weight", H)
        if arch == "qwen3moe":
            router(p + "mlp.gate.weight")
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                lin(q + "gate_proj.weight", I, H, edt("gate", L))
                lin(q + "up_proj.weight", I, H, edt("up", L))
                lin(q + "down_proj.weight", H, I, edt("down", L))
        else:
            router(p + "block_sparse_moe.gate.weight")
            for e in range(E):
                q = f"{p}block_sparse_moe.experts.{e}."
                lin(q + "w1.weight", I, H, edt("gate", L))   # gate
                lin(q + "w3.weight", I, H, edt("up", L))     # up
                lin(q + "w2.weight", H, I, edt("down", L))   # down
    norm("model.norm.weight", H)
    if not tied:
        lin("lm_head.weight", cfg["vocab"], H, dt("output", 0, H))
    return w


# ---- safetensors, written by hand: the safetensors package's numpy API has no bfloat16.
# Layout: u64 little-endian header length N, N bytes of JSON (space-padded to a multiple of 8),
# then the tensors' bytes; data_offsets are relative to the end of the header.

ST_DTYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
ST_DTYPE.update({q: "F32" for q in QTYPES})


def write_safetensors(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (vals, dt) in tensors.items():
        e = encode(vals, dt)
        b = e.astype(e.dtype.newbyteorder("<"), copy=False).tobytes()   # little-endian, C order
        header[name] = {"dtype": ST_DTYPE[dt], "shape": list(vals.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj)
        for b in blobs:
            f.write(b)
    return off


def write_hf(d, arch, cfg, weights, dtype, tied, hf_config="v4"):
    os.makedirs(d, exist_ok=True)
    torch_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16",
                   "q8_0": "float32", "q4_k_m": "float32"}[dtype]
    c = dict(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
             num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
             num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
             num_experts_per_tok=cfg["top_k"], rms_norm_eps=cfg["eps"],
             rope_theta=cfg["rope_theta"], max_position_embeddings=cfg["ctx"],
             tie_word_embeddings=tied, rope_scaling=None, sliding_window=None,
             attention_bias=False, attention_dropout=0.0, hidden_act="silu",
             initializer_range=0.02, output_router_logits=False, router_aux_loss_coef=0.001,
             use_cache=True, bos_token_id=cfg["vocab"] - 2, eos_token_id=cfg["vocab"] - 1,
             torch_dtype=torch_dtype)
    if arch == "qwen3moe":
        c.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 moe_intermediate_size=cfg["moe_ffn"], num_experts=cfg["experts"],
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 use_sliding_window=False, max_window_layers=cfg["layers"])
    else:
        c.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                 num_local_experts=cfg["experts"], router_jitter_noise=0.0)
    if hf_config == "v5":
        # transformers 5's layout: the experts' count as num_local_experts for every
        # architecture, RoPE's settings in rope_parameters.
        c["num_local_experts"] = c.pop("num_local_experts", None) or c.pop("num_experts")
        c["rope_parameters"] = dict(rope_theta=c.pop("rope_theta"), rope_type="default")
        del c["rope_scaling"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    # Two shards, split halfway through the name list (a layer may straddle them, as in real
    # checkpoints), and the index that maps each name to its shard.
    names = list(weights)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    wmap, total = {}, 0
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        total += write_safetensors(os.path.join(d, fn), {n: weights[n] for n in part})
        wmap.update({n: fn for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)


# ---- GGUF, with gguf-py's writer, names and layouts as llama.cpp's converter writes them

def gpt2_vocab(n):
    """A small byte-level-BPE-looking vocabulary (strings in GPT-2's byte-to-unicode alphabet),
    two merges and two control tokens at the end: present so that readers learn to skip it."""
    alphabet = [c for c in range(ord("!"), ord("~") + 1)] + \
               [c for c in range(0xA1, 0xAD)] + [c for c in range(0xAE, 0x100)]
    extra = [c for c in range(256) if c not in alphabet]
    chars = [chr(c) for c in alphabet] + [chr(256 + i) for i in range(len(extra))]
    body = n - 4
    tokens = chars[:body] + [f"<tok{i}>" for i in range(max(0, body - len(chars)))]
    tokens += ["ab", "cd", "<|endoftext|>", "<|im_end|>"]
    types = [1] * (n - 2) + [3, 3]   # 1 NORMAL, 3 CONTROL
    return tokens, types, ["a b", "c d"]


def add_metadata(w, ga, name, cfg, layers, ffn, dtype):
    """A GGUF's keys as llama.cpp's converter writes them (ga: its architecture, "qwen3moe" or
    "llama"), and a placeholder gpt2 tokenizer. Also bench/model/big_gguf.py's."""
    w.add_name(name)
    # llama_ftype ALL_F32, MOSTLY_F16, MOSTLY_BF16, MOSTLY_Q8_0, MOSTLY_Q4_K_M
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_k_m": 15}[dtype])
    w.add_vocab_size(cfg["vocab"])
    w.add_block_count(layers)
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_expert_count(cfg["experts"])
    w.add_expert_used_count(cfg["top_k"])
    if ga == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_ffn"])
    tokens, types, merges = gpt2_vocab(cfg["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["vocab"] - 2)
    w.add_eos_token_id(cfg["vocab"] - 1)


def write_gguf(path, arch, cfg, weights, dtype, experts_dtype, tied, shard_tensors=0):
    import gguf
    T = gguf.GGMLQuantizationType
    gtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}
    gtype.update({q: gguf_qtype(q) for q in QTYPES})
    ga = "qwen3moe" if arch == "qwen3moe" else "llama"
    # shard_tensors > 0: shards of that many tensors (PATH-00001-of-0000N.gguf, ...), as
    # llama.cpp's gguf-split writes them, the metadata in the first
    w = gguf.GGUFWriter(path, ga, split_max_tensors=shard_tensors)
    add_metadata(w, ga, f"tiny-{arch}", cfg, cfg["layers"], cfg["ffn"], dtype)

    def put(name, vals, dt):
        if dt in QTYPES:  # the blocks of the values (quantizing them again is exact)
            blocks = q_blocks(vals, dt)
            assert np.array_equal(dequant(blocks, dt).reshape(vals.shape), vals), name
            w.add_tensor(name, blocks, raw_dtype=gtype[dt])  # shape from the blocks' bytes
            return
        enc = encode(vals, dt)
        w.add_tensor(name, enc, raw_dtype=gtype[dt] if dt == "bf16" else None)

    def hf(name):
        return weights[name][0]

    def ty(name):  # the dtype it was rounded to
        return weights[name][1]

    put("token_embd.weight", hf("model.embed_tokens.weight"), ty("model.embed_tokens.weight"))
    for L in range(cfg["layers"]):
        p, b = f"model.layers.{L}.", f"blk.{L}."
        q, k = hf(p + "self_attn.q_proj.weight"), hf(p + "self_attn.k_proj.weight")
        if ga == "llama":
            q, k = llama_permute(q, cfg["heads"]), llama_permute(k, cfg["kv_heads"])
        put(b + "attn_norm.weight", hf(p + "input_layernorm.weight"), "f32")
        put(b + "attn_q.weight", q, ty(p + "self_attn.q_proj.weight"))
        put(b + "attn_k.weight", k, ty(p + "self_attn.k_proj.weight"))
        put(b + "attn_v.weight", hf(p + "self_attn.v_proj.weight"),
            ty(p + "self_attn.v_proj.weight"))
        put(b + "attn_output.weight", hf(p + "self_attn.o_proj.weight"),
            ty(p + "self_attn.o_proj.weight"))
        if ga == "qwen3moe":
            put(b + "attn_q_norm.weight", hf(p + "self_attn.q_norm.weight"), "f32")
            put(b + "attn_k_norm.weight", hf(p + "self_attn.k_norm.weight"), "f32")
        put(b + "ffn_norm.weight", hf(p + "post_attention_layernorm.weight"), "f32")
        if ga == "qwen3moe":
            m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        else:
            m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        put(b + "ffn_gate_inp.weight", hf(m + "gate.weight"), "f32")   # router stays F32
        for gname, hname in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            # [E, I, H] for gate/up and [E, H, I] for down (numpy order; GGUF ne is reversed)
            stack = np.stack([hf(f"{m}experts.{e}.{hname}.weight") for e in range(cfg["experts"])])
            put(f"{b}{gname}.weight", stack, weights[f"{m}experts.0.{hname}.weight"][1])
    put("output_norm.weight", hf("model.norm.weight"), "f32")
    if not tied:
        put("output.weight", hf("lm_head.weight"), ty("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny(out, arch, seed=0, dtype="f32", experts_dtype="bf16", tied=False,
               router_bf16=False, hf_config="v4", shard_tensors=0, **over):
    """Writes out/hf, out/model.gguf and out/meta.json; returns the meta dict."""
    if arch not in DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(DEFAULTS)}")
    cfg = dict(DEFAULTS[arch])
    for k, v in over.items():
        if v is not None:
            if k not in cfg:
                raise ValueError(f"unknown shape key {k}")
            cfg[k] = v
    if arch == "mixtral":
        cfg["ffn"] = cfg["moe_ffn"]
    if cfg["heads"] % cfg["kv_heads"] or cfg["head_dim"] % 2 or cfg["top_k"] > cfg["experts"]:
        raise ValueError("need heads % kv_heads == 0, an even head_dim, top_k <= experts")
    if cfg["vocab"] < 8:
        raise ValueError("vocab must be at least 8")
    os.makedirs(out, exist_ok=True)
    weights = make_weights(arch, cfg, seed, dtype, experts_dtype, tied, router_bf16)
    write_hf(os.path.join(out, "hf"), arch, cfg, weights, dtype, tied, hf_config)
    write_gguf(os.path.join(out, "model.gguf"), arch, cfg, weights, dtype, experts_dtype, tied,
               shard_tensors)
    first = sorted(f for f in os.listdir(out) if f.startswith("model-00001-of-"))
    meta = dict(arch=arch, seed=seed, dtype=dtype, experts_dtype=experts_dtype, tied=tied,
                norm_topk_prob=True, hf="hf",
                gguf=first[0] if shard_tensors and first else "model.gguf", **cfg)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=sorted(DEFAULTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPES + ("q8_0", "q4_k_m"), default="f32",
                    help="non-expert weights (f32); q4_k_m: every tensor as llama.cpp's "
                         "quantizer types a Q4_K_M file, the experts too")
    ap.add_argument("--experts-dtype", choices=DTYPES + ("q8_0", "mxfp4", "q4_k_m", "q5_k"),
                    default="bf16",
                    help="experts (bf16)")
    ap.add_argument("--tied", action="store_true", help="no lm_head/output: the embedding is the head")
    ap.add_argument("--router-bf16", action="store_true",
                    help="router values bf16 holds exactly (stored in their file type)")
    for key in ("layers", "vocab", "hidden", "heads", "kv_heads", "head_dim", "experts",
                "top_k", "moe_ffn", "ctx"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    ap.add_argument("--rope-theta", type=float, dest="rope_theta")
    ap.add_argument("--hf-config", choices=("v4", "v5"), default="v4",
                    help="config.json as transformers 4 writes it (v4), or 5 (v5: "
                         "num_local_experts, rope_parameters)")
    ap.add_argument("--eps", type=float)
    ap.add_argument("--shard-tensors", type=int, default=0,
                    help="the GGUF in shards of this many tensors (model-00001-of-0000N.gguf, "
                         "...), as llama.cpp's gguf-split writes them")
    a = vars(ap.parse_args(argv))
    meta = write_tiny(a.pop("out"), a.pop("arch"), a.pop("seed"), a.pop("dtype"),
                      a.pop("experts_dtype"), a.pop("tied"), a.pop("router_bf16"),
                      a.pop("hf_config"), a.pop("shard_tensors"), **a)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
