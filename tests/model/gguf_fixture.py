"""gguf_fixture.py: writes the GGUF file that tests/test-gguf.c reads, with the gguf package
(the writer llama.cpp's converters use), and a JSON sidecar saying what the reader must find.

    gguf_fixture.py <output folder>

writes <folder>/gguf-fixture.gguf and <folder>/gguf-fixture.json. The file is small but varied:
every metadata value type, arrays of numbers, strings, bools and arrays, a 5000-token
vocabulary, a qwen3moe-shaped set of tensors in F32, F16 and BF16 (3D expert tensors among
them), a 4D tensor, integer tensors and a Q8_0 one, with a data alignment of 64 (not the
default 32). Beside them, quant-fixture.bin: random blocks of Q8_0, Q4_K, Q6_K, MXFP4, Q4_0,
Q4_1, Q5_0, Q5_1 and Q5_K (edge scales among them) and the package's dequantization of each
(gguf.quants), which the model library's own must match bit for bit. Without the gguf package it writes nothing and exits 77
(skipped), and the C cases that need the files skip too.

The sidecar holds integers as decimal strings (JSON numbers are doubles, which lose u64s),
floats as numbers (Python writes them so that they read back exactly), and each tensor's
FNV-1a 64 of its bytes as hex. It also lists the gguf package's block sizes, to be compared
with the C reader's table.
"""

import json
import os
import sys

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT
except ImportError:
    gguf = None

NAME = "gguf-fixture"
ALIGNMENT = 64
N_TOKENS = 5000
N_LAYERS, N_EXPERTS, HIDDEN, FF = 2, 4, 16, 8


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def tokens() -> list[str]:
    """Varied token strings: ASCII, byte-level pieces, multi-byte UTF-8, one empty."""
    out = ["<unk>", "<s>", "</s>", ""]
    pieces = ["Ġthe", "ing", "Ġ", "é", "日本", "🙂", "\t", "a b", '"q"', "\\"]
    for i in range(len(out), N_TOKENS):
        out.append(f"{pieces[i % len(pieces)]}{i}")
    return out


class Fixture:
    """Adds to the writer and records, in the same order, what the reader must find."""

    def __init__(self, writer):
        self.w = writer
        self.kv = [{"key": "general.architecture", "type": "string", "value": "qwen3moe"}]
        self.tensors = []

    def scalar(self, key, vtype, value):
        self.w.add_key_value(key, value, vtype)
        name = TYPE_NAMES[vtype]
        if vtype == VT.FLOAT32:
            value = float(np.float32(value))  # what a float32 holds
        elif vtype not in (VT.FLOAT64, VT.STRING, VT.BOOL):
            value = str(value)
        self.kv.append({"key": key, "type": name, "value": value})

    def array(self, key, elem, values):
        self.w.add_key_value(key, values, VT.ARRAY, sub_type=elem)
        if elem == VT.FLOAT32:
            values = [float(np.float32(v)) for v in values]
        elif elem in (VT.ARRAY,):
            values = [[str(x) for x in v] for v in values]
        elif elem not in (VT.FLOAT64, VT.STRING, VT.BOOL):
            values = [str(v) for v in values]
        self.kv.append({"key": key, "type": "array", "elem_type": TYPE_NAMES[elem],
                        "count": len(values), "values": values})

    def tensor(self, name, array, qtype, shape):
        """shape: the logical shape, outermost first; array: the bytes as written."""
        self.w.add_tensor(name, array, raw_dtype=qtype)
        self.tensors.append({"name": name, "type": int(qtype), "type_name": qtype.name,
                             "shape": list(shape), "bytes": int(array.nbytes),
                             "fnv1a": fnv1a64(array.tobytes())})


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, rounded to nearest even (numpy has no bfloat16)."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def build(path: str) -> dict:
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(path, "qwen3moe")
    f = Fixture(w)
    w.add_custom_alignment(ALIGNMENT)
    f.kv.append({"key": "general.alignment", "type": "u32", "value": str(ALIGNMENT)})

    f.scalar("general.name", VT.STRING, "tandem test fixture")
    f.scalar("qwen3moe.block_count", VT.UINT32, N_LAYERS)
    f.scalar("qwen3moe.embedding_length", VT.UINT32, HIDDEN)
    f.scalar("qwen3moe.expert_feed_forward_length", VT.UINT32, FF)
    f.scalar("qwen3moe.expert_count", VT.UINT32, N_EXPERTS)
    f.scalar("qwen3moe.expert_used_count", VT.UINT32, 2)
    f.scalar("qwen3moe.rope.freq_base", VT.FLOAT32, 1000000.0)
    f.scalar("qwen3moe.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-6)
    # Every value type, at values that test the conversions' edges.
    f.scalar("test.u8", VT.UINT8, 200)
    f.scalar("test.i8", VT.INT8, -100)
    f.scalar("test.u16", VT.UINT16, 60000)
    f.scalar("test.i16", VT.INT16, -30000)
    f.scalar("test.u32", VT.UINT32, 4000000000)
    f.scalar("test.i32", VT.INT32, -2000000000)
    f.scalar("test.u64", VT.UINT64, 2**63 + 5)  # does not fit in int64
    f.scalar("test.i64", VT.INT64, -(2**62) - 3)
    f.scalar("test.f32", VT.FLOAT32, 0.1)
    f.scalar("test.f64", VT.FLOAT64, 3.141592653589793)
    f.scalar("test.bool_true", VT.BOOL, True)
    f.scalar("test.bool_false", VT.BOOL, False)
    f.scalar("test.string", VT.STRING, "héllo, 日本 🙂")
    f.scalar("test.empty_string", VT.STRING, "")
    f.array("test.array_i32", VT.INT32, [3, -1, 2**31 - 1, -(2**31)])
    f.array("test.array_u8", VT.UINT8, [0, 1, 255])
    f.array("test.array_u64", VT.UINT64, [1, 2**64 - 1])
    f.array("test.array_i64", VT.INT64, [-(2**63), 2**63 - 1])
    f.array("test.array_f32", VT.FLOAT32, [0.5, -2.25, 1e-3])
    f.array("test.array_f64", VT.FLOAT64, [1.0 / 3.0, -1e300])
    f.array("test.array_bool", VT.BOOL, [True, False, True])
    f.array("test.array_str", VT.STRING, ["a", "", "héllo"])
    f.array("test.array_nested", VT.ARRAY, [[1, 2], [3]])
    f.array("qwen3moe.per_layer", VT.INT32, list(range(10, 10 + N_LAYERS)))
    f.scalar("tokenizer.ggml.model", VT.STRING, "gpt2")
    toks = tokens()
    f.array("tokenizer.ggml.tokens", VT.STRING, toks)
    f.array("tokenizer.ggml.token_type", VT.INT32, [1 + i % 3 for i in range(N_TOKENS)])

    def rnd(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    f.tensor("token_embd.weight", rnd(32, HIDDEN), QT.F32, (32, HIDDEN))
    f.tensor("output_norm.weight", rnd(HIDDEN), QT.F32, (HIDDEN,))
    for i in range(N_LAYERS):
        b = f"blk.{i}"
        f.tensor(f"{b}.attn_norm.weight", rnd(HIDDEN), QT.F32, (HIDDEN,))
        f.tensor(f"{b}.attn_q.weight", rnd(HIDDEN, HIDDEN).astype(np.float16), QT.F16,
                 (HIDDEN, HIDDEN))
        f.tensor(f"{b}.ffn_gate_inp.weight", rnd(N_EXPERTS, HIDDEN), QT.F32,
                 (N_EXPERTS, HIDDEN))
        f.tensor(f"{b}.ffn_gate_exps.weight", bf16_bits(rnd(N_EXPERTS, FF, HIDDEN)), QT.BF16,
                 (N_EXPERTS, FF, HIDDEN))
        f.tensor(f"{b}.ffn_down_exps.weight", rnd(N_EXPERTS, HIDDEN, FF).astype(np.float16),
                 QT.F16, (N_EXPERTS, HIDDEN, FF))
    q = gguf.quants.quantize(rnd(N_EXPERTS, FF, 64), QT.Q8_0)  # uint8, rows of 2 blocks
    f.tensor("blk.0.ffn_up_exps.weight", q, QT.Q8_0, (N_EXPERTS, FF, 64))
    f.tensor("test.four_d", rnd(2, 3, 4, 5), QT.F32, (2, 3, 4, 5))
    f.tensor("test.i32", np.arange(-3, 4, dtype=np.int32), QT.I32, (7,))
    f.tensor("test.i8", np.arange(-16, 17, dtype=np.int8), QT.I8, (33,))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    sizes = {t.name: list(GGML_SIZE) for t, GGML_SIZE in gguf.GGML_QUANT_SIZES.items()}
    return {"file": os.path.basename(path), "version": 3, "alignment": ALIGNMENT,
            "kv": f.kv, "tensors": f.tensors, "block_sizes": sizes,
            "type_numbers": {t.name: int(t) for t in gguf.GGML_QUANT_SIZES}}


def check(path: str, side: dict) -> None:
    """The package's own reader must see the keys and tensors in the sidecar's order."""
    r = gguf.GGUFReader(path)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    want = [kv["key"] for kv in side["kv"]]
    if keys != want:
        raise SystemExit(f"gguf_fixture: keys written {keys}, sidecar has {want}")
    names = [t.name for t in r.tensors]
    if names != [t["name"] for t in side["tensors"]]:
        raise SystemExit(f"gguf_fixture: tensors written {names} differ from the sidecar's")


TYPE_NAMES = {}

# ---- quant-fixture.bin: random blocks of each block type the model library widens, and the
# gguf package's own dequantization of them (gguf.quants), for test-gguf's
# dequant_matches_package. Layout (little-endian): magic "TNDQNT01", i32 sections; each: i32
# type, i32 blocks, the blocks' bytes, then blocks x block-size f32 values.

def f16_bytes(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qt, n: int, rng) -> np.ndarray:
    """n blocks of qt: random quants, random finite scales, the first blocks at the edges
    (all-zero scales; the largest, smallest normal and a subnormal f16 scale; E8M0 exponents
    0, 1, 2, 127, 254 and 255)."""
    size = gguf.GGML_QUANT_SIZES[qt][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scale = (rng.standard_normal(n) * 0.05).astype(np.float16)
    edges = np.array([0.0, 65504.0, -6.1035e-05, 6e-08, 1.0], dtype=np.float16)
    scale[: len(edges)] = edges
    if qt == QT.Q8_0:
        b[:, 0:2] = f16_bytes(scale)
    elif qt in (QT.Q4_K, QT.Q5_K):
        b[:, 0:2] = f16_bytes(scale)
        b[:, 2:4] = f16_bytes(np.roll(scale, 1))
        b[0, 4:16] = 0
    elif qt in (QT.Q4_0, QT.Q5_0):
        b[:, 0:2] = f16_bytes(scale)
    elif qt in (QT.Q4_1, QT.Q5_1):
        b[:, 0:2] = f16_bytes(scale)
        b[:, 2:4] = f16_bytes(np.roll(scale, 2))
    elif qt == QT.Q6_K:
        b[:, 208:210] = f16_bytes(scale)
        b[0, 192:208] = 0
    elif qt == QT.MXFP4:
        b[: 6, 0] = [0, 1, 2, 127, 254, 255]
    return b


def write_quant_fixture(path: str) -> None:
    rng = np.random.default_rng(12345)
    types = [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.MXFP4, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q5_K]
    with open(path, "wb") as fp:
        fp.write(b"TNDQNT01")
        fp.write(np.array([len(types)], dtype="<i4").tobytes())
        for qt in types:
            n = 64
            blocks = random_blocks(qt, n, rng)
            with np.errstate(over="ignore"):  # E8M0 255 with the largest values: infinity
                values = gguf.quants.dequantize(blocks.reshape(-1), qt).astype("<f4")
            block = gguf.GGML_QUANT_SIZES[qt][0]
            assert values.size == n * block, (qt, values.shape)
            fp.write(np.array([int(qt), n], dtype="<i4").tobytes())
            fp.write(blocks.tobytes())
            fp.write(values.tobytes())


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    gguf_path = os.path.join(out, NAME + ".gguf")
    json_path = os.path.join(out, NAME + ".json")
    for p in (gguf_path, json_path):
        if os.path.exists(p):
            os.remove(p)
    if gguf is None:
        print("SKIP: no gguf package (or numpy) in this Python; the cases that need the "
              "fixture skip")
        return 77
    TYPE_NAMES.update({VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16",
                       VT.UINT32: "u32", VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool",
                       VT.STRING: "string", VT.ARRAY: "array", VT.UINT64: "u64",
                       VT.INT64: "i64", VT.FLOAT64: "f64"})
    os.makedirs(out, exist_ok=True)
    # Written aside and renamed, so that a test never reads half a file.
    side = build(gguf_path + ".tmp")
    check(gguf_path + ".tmp", side)
    side["file"] = NAME + ".gguf"
    with open(json_path + ".tmp", "w", encoding="utf-8") as fp:
        json.dump(side, fp, ensure_ascii=False, indent=1)
    os.replace(json_path + ".tmp", json_path)
    quant_path = os.path.join(out, "quant-fixture.bin")
    write_quant_fixture(quant_path + ".tmp")
    os.replace(quant_path + ".tmp", quant_path)
    os.replace(gguf_path + ".tmp", gguf_path)
    print(f"gguf_fixture: wrote {gguf_path} ({os.path.getsize(gguf_path)} bytes) and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
