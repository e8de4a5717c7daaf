"""st_fixture.py: writes the tiny Hugging Face model folder that tests/test-safetensors.c reads.

Usage: st_fixture.py OUTDIR

OUTDIR gets a config.json shaped like a small Qwen3MoeForCausalLM's, its weights in two shards
with a model.safetensors.index.json (F32, F16 and BF16 tensors, seeded random values), and
expected.json: what the C reader must find there (each tensor's name, dtype, shape, shard and the
FNV-1a 64 checksum of its bytes, and the config's values). Both shards are written by the pinned
safetensors package: the first through safetensors.numpy.save_file; the second through the
package's own serializer (safetensors.serialize_file with TensorSpec), since numpy has no
bfloat16 and safetensors.numpy cannot take one: its BF16 tensors are given as their uint16 bit
patterns with dtype "bfloat16". Exit status 77 (skipped) where numpy or safetensors is missing.
"""
import json
import os
import sys

try:
    import numpy as np
    from safetensors import TensorSpec, serialize_file
    from safetensors.numpy import save_file
except ImportError as e:  # the tests that need the folder skip as well
    print(f"SKIP: {e}")
    sys.exit(77)

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "moe_intermediate_size": 12,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "rope_scaling": None,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def layer_shapes(layer: int):
    """(name, shape) of one decoder layer's tensors, as Qwen3MoeForCausalLM names them."""
    c = CONFIG
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    ffn = c["moe_intermediate_size"]
    p = f"model.layers.{layer}."
    out = [
        (p + "input_layernorm.weight", [h]),
        (p + "post_attention_layernorm.weight", [h]),
        (p + "self_attn.q_proj.weight", [q, h]),
        (p + "self_attn.k_proj.weight", [kv, h]),
        (p + "self_attn.v_proj.weight", [kv, h]),
        (p + "self_attn.o_proj.weight", [h, q]),
        (p + "self_attn.q_norm.weight", [hd]),
        (p + "self_attn.k_norm.weight", [hd]),
        (p + "mlp.gate.weight", [c["num_experts"], h]),
    ]
    for e in range(c["num_experts"]):
        out += [
            (p + f"mlp.experts.{e}.gate_proj.weight", [ffn, h]),
            (p + f"mlp.experts.{e}.up_proj.weight", [ffn, h]),
            (p + f"mlp.experts.{e}.down_proj.weight", [h, ffn]),
        ]
    return out


def dtype_for(name: str, shard: int) -> str:
    """Norms and the router in F32 (as checkpoints often keep them); the matrices in F16 in the
    first shard and BF16 in the second."""
    if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
        return "F32"
    return "F16" if shard == 0 else "BF16"


def values(rng, dtype: str, shape):
    """The array to write: for BF16, float32 values' upper 16 bits, as uint16."""
    a = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "F32":
        return a
    if dtype == "F16":
        return a.astype(np.float16)
    return (a.view(np.uint32) >> 16).astype(np.uint16)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(out):  # a rerun leaves no stale shard behind
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(out, f))

    rng = np.random.default_rng(20240601)
    c = CONFIG
    plan = [  # (shard, name, shape)
        (0, "model.embed_tokens.weight", [c["vocab_size"], c["hidden_size"]]),
        *[(0, n, s) for n, s in layer_shapes(0)],
        *[(1, n, s) for n, s in layer_shapes(1)],
        (1, "model.norm.weight", [c["hidden_size"]]),
        (1, "lm_head.weight", [c["vocab_size"], c["hidden_size"]]),
    ]
    arrays = [{}, {}]
    expected = []
    for shard, name, shape in plan:
        dtype = dtype_for(name, shard)
        a = np.ascontiguousarray(values(rng, dtype, shape))
        arrays[shard][name] = (dtype, a)
        expected.append({"name": name, "dtype": dtype, "shape": shape, "shard": SHARDS[shard],
                         "bytes": a.nbytes, "fnv1a64": f"{fnv1a64(a.tobytes()):016x}"})

    save_file({n: a for n, (_, a) in arrays[0].items()}, os.path.join(out, SHARDS[0]),
              metadata={"format": "pt"})
    specs = {n: TensorSpec(dtype="bfloat16" if d == "BF16" else a.dtype.name, shape=list(a.shape),
                           data_ptr=a.ctypes.data, data_len=a.nbytes)
             for n, (d, a) in arrays[1].items()}
    serialize_file(specs, os.path.join(out, SHARDS[1]), metadata={"format": "pt"})

    weight_map = {t["name"]: t["shard"] for t in sorted(expected, key=lambda t: t["name"])}
    index = {"metadata": {"total_size": sum(t["bytes"] for t in expected)},
             "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"tensors": expected, "config": CONFIG}, f, indent=1)
    print(f"wrote {len(expected)} tensors in {len(SHARDS)} shards to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
