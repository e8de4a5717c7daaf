"""tandem.torch's torch-free half (tandem._offload), on any machine: budget parsing, finding MoE
blocks by structure, the pinned layout of the expert blobs, the fixed-order combine and the
policy of a pass. The modules here are small plain-Python stand-ins with the attribute
structure of transformers' blocks; the real transformers classes, and everything that needs a
GPU, are exercised by test_torch_offload.py."""
import itertools
import random
import sys

import pytest

from tandem import _offload as plan
from tandem._offload import OffloadError, UnsupportedBlockError


class Shaped:
    """A parameter stand-in: only .shape is read."""

    def __init__(self, *shape):
        self.shape = shape


class Module:
    def __init__(self, **children):
        self.__dict__.update(children)


class Experts(Module):
    def __init__(self, e=8, h=64, i=32, **extra):
        super().__init__(gate_up_proj=Shaped(e, 2 * i, h), down_proj=Shaped(e, h, i),
                         act_fn=lambda v: v, **extra)


class Router(Module):
    def __init__(self, e=8, h=64):
        super().__init__(weight=Shaped(e, h), top_k=2)


class Qwen3MoeSparseMoeBlock(Module):
    def __init__(self, e=8, h=64, i=32, experts=None):
        super().__init__(gate=Router(e, h), experts=experts or Experts(e, h, i))


class MixtralSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    pass


class Qwen2MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Supported shape, unsupported type (it also has a shared expert)."""


class DeepseekV3MoE(Qwen3MoeSparseMoeBlock):
    """Supported: its shared experts are added to the routed output by the offloaded forward."""


class GptOssExperts(Module):
    def __init__(self, e=8, h=64, i=32, **extra):
        kw = dict(gate_up_proj=Shaped(e, h, 2 * i), down_proj=Shaped(e, i, h),
                  gate_up_proj_bias=Shaped(e, 2 * i), down_proj_bias=Shaped(e, h),
                  _apply_gate=lambda v: v, is_transposed=True, is_concatenated=False,
                  has_bias=True)
        kw.update(extra)
        super().__init__(**kw)


class GptOssMLP(Module):
    """Transposed, biased experts; the router is called `router`."""

    def __init__(self, e=8, h=64, i=32, experts=None):
        super().__init__(router=Router(e, h), experts=experts or GptOssExperts(e, h, i))


def named(blocks, dense=2):
    """named_modules() of a small model: a root, some dense layers, the blocks and their
    children (which discovery must not take for blocks of their own)."""
    out = [("", Module()), ("model.embed_tokens", Module())]
    for n, b in enumerate(blocks):
        out.append((f"model.layers.{n}", Module()))
        out.append((f"model.layers.{n}.mlp", b))
        out.append((f"model.layers.{n}.mlp.{'router' if hasattr(b, 'router') else 'gate'}",
                    plan.router_of(b)))
        out.append((f"model.layers.{n}.mlp.experts", b.experts))
    out += [(f"model.dense.{n}", Module()) for n in range(dense)]
    return out


# -- budgets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("4096", 4096), ("1KiB", 1024), ("2 MiB", 2 << 20), ("8GiB", 8 << 30), ("1.5GiB", 3 << 29),
    ("1KB", 1000), ("3mb", 3_000_000), ("2GB", 2_000_000_000), ("7b", 7),
])
def test_parse_size(text, want):
    assert plan.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "-1GiB", "1e3", "ten", "8 %"])
def test_parse_size_rejects(text):
    with pytest.raises(OffloadError, match="budget"):
        plan.parse_size(text)


def test_parse_budget_rounds_to_whole_experts_and_caps():
    total, eb = 10 * 1000, 1000
    assert plan.parse_budget("0%", total, eb) == 0
    assert plan.parse_budget(0, total, eb) == 0
    assert plan.parse_budget("25%", total, eb) == 2000       # 2500 bytes hold 2 experts
    assert plan.parse_budget("50%", total, eb) == 5000
    assert plan.parse_budget("100%", total, eb) == total
    assert plan.parse_budget("999", total, eb) == 0          # less than one expert: none
    assert plan.parse_budget(1999, total, eb) == 1000
    assert plan.parse_budget("8GiB", total, eb) == total     # more than every expert
    assert plan.parse_budget("1KB", total, eb) == 1000


@pytest.mark.parametrize("bad", ["101%", "-5%", "x%", "%", None, True, [1], "-3"])
def test_parse_budget_rejects(bad):
    with pytest.raises(OffloadError):
        plan.parse_budget(bad, 10_000, 1000)


def test_staging_and_device_room():
    assert plan.staging_bytes(16, 1000) == 16_000
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(OffloadError, match="staging slot"):
            plan.staging_bytes(bad, 1000)
    plan.check_device_room(budget=5000, staging=2000, free=6000, freeable=1000)
    with pytest.raises(OffloadError, match="staging slots"):
        plan.check_device_room(budget=0, staging=8000, free=6000, freeable=1000)
    with pytest.raises(OffloadError, match="budget"):
        plan.check_device_room(budget=6000, staging=2000, free=6000, freeable=1000)


# -- finding blocks ---------------------------------------------------------------------------

def test_finds_supported_blocks_in_order():
    bs = [Qwen3MoeSparseMoeBlock() for _ in range(3)]
    found = plan.find_moe_blocks(named(bs))
    assert [f.name for f in found] == [f"model.layers.{n}.mlp" for n in range(3)]
    assert [f.module for f in found] == bs
    assert {f.kind for f in found} == {"qwen3_moe"}
    found = plan.find_moe_blocks(named([MixtralSparseMoeBlock()]))
    assert found[0].kind == "mixtral"
    found = plan.find_moe_blocks(named([DeepseekV3MoE(), DeepseekV3MoE()]))
    assert [f.kind for f in found] == ["deepseek_v3"] * 2


def test_unsupported_block_names_its_type():
    bs = [Qwen3MoeSparseMoeBlock(), Qwen2MoeSparseMoeBlock()]
    with pytest.raises(UnsupportedBlockError, match="model.layers.1.mlp.*Qwen2MoeSparseMoeBlock"):
        plan.find_moe_blocks(named(bs))


def test_no_blocks_is_an_error():
    with pytest.raises(OffloadError, match="no MoE block"):
        plan.find_moe_blocks(named([]))


@pytest.mark.parametrize("experts,why", [
    (Module(down_proj=Shaped(8, 64, 32)), "fused"),
    (Module(gate_up_proj=Shaped(8, 64, 64, 1), down_proj=Shaped(8, 64, 32)), "3-D"),
    (Module(gate_up_proj=Shaped(8, 63, 64), down_proj=Shaped(8, 64, 32)), "do not form"),
    (Module(gate_up_proj=Shaped(8, 64, 64), down_proj=Shaped(8, 32, 64)), "do not form"),
    (Experts(is_transposed=True), "is_transposed"),
    (Experts(has_bias=True), "has_bias"),
    (Experts(has_gate=False), "has_gate"),
    (Module(gate_up_proj=Shaped(8, 64, 64), down_proj=Shaped(8, 64, 32)), "act_fn"),
])
def test_misshapen_supported_block(experts, why):
    b = Qwen3MoeSparseMoeBlock(experts=experts)
    with pytest.raises(UnsupportedBlockError, match=why):
        plan.find_moe_blocks(named([b]))


def test_gpt_oss_blocks():
    bs = [GptOssMLP(), GptOssMLP()]
    found = plan.find_moe_blocks(named(bs))
    assert [b.kind for b in found] == ["gpt_oss"] * 2
    assert plan.router_of(bs[0]) is bs[0].router
    assert plan.router_of(Qwen3MoeSparseMoeBlock()).weight.shape == (8, 64)
    gs, ds = plan.canonical_shapes("gpt_oss", (8, 64, 64), (8, 32, 64))
    assert gs == (8, 64, 64) and ds == (8, 64, 32)
    assert plan.canonical_shapes("mixtral", (8, 64, 64), (8, 64, 32)) == ((8, 64, 64),
                                                                          (8, 64, 32))


@pytest.mark.parametrize("experts,why", [
    (GptOssExperts(down_proj=Shaped(8, 64, 32)), "do not form"),       # not transposed
    (GptOssExperts(is_concatenated=True), "is_concatenated"),
    (GptOssExperts(down_proj_bias=Shaped(8, 32)), "down_proj_bias"),
    (GptOssExperts(_apply_gate=None), "_apply_gate"),
])
def test_misshapen_gpt_oss_block(experts, why):
    with pytest.raises(UnsupportedBlockError, match=why):
        plan.find_moe_blocks(named([GptOssMLP(experts=experts)]))


def test_router_shape_checked():
    b = Qwen3MoeSparseMoeBlock()
    b.gate = Router(e=4)
    with pytest.raises(UnsupportedBlockError, match="router weight"):
        plan.find_moe_blocks(named([b]))


def test_uniform_shape():
    shapes = [("a", (8, 64, 64), (8, 64, 32)), ("b", (8, 64, 64), (8, 64, 32))]
    assert plan.uniform_shape(shapes) == (8, 64, 32)
    with pytest.raises(OffloadError, match="b: experts .* differ from a"):
        plan.uniform_shape(shapes[:1] + [("b", (4, 64, 64), (4, 64, 32))])


# -- layout -----------------------------------------------------------------------------------

def strided_index(offset, shape, strides, idx):
    return offset + sum(i * s for i, s in zip(idx, strides))


def test_layout_views_tile_the_buffer_exactly():
    lay = plan.ExpertLayout(layers=3, experts=4, hidden=5, intermediate=3, itemsize=2)
    assert lay.gate_up_elems == 2 * 3 * 5 and lay.down_elems == 5 * 3
    assert lay.expert_bytes == (30 + 15) * 2 and lay.total_bytes == 12 * lay.expert_bytes
    owner = {}
    for layer in range(3):
        for name, (off, shape, strides) in (("gu", lay.gate_up_view(layer)),
                                            ("dn", lay.down_view(layer))):
            for idx in itertools.product(*map(range, shape)):
                pos = strided_index(off, shape, strides, idx)
                assert pos not in owner, f"{name}{idx} of layer {layer} overlaps {owner[pos]}"
                owner[pos] = (layer, name, idx)
                # expert e's blob is [gate_up row-major | down row-major]
                e = idx[0]
                base = lay.key(layer, e) * lay.expert_elems
                if name == "gu":
                    assert pos == base + idx[1] * 5 + idx[2]
                else:
                    assert pos == base + lay.gate_up_elems + idx[1] * 3 + idx[2]
    assert sorted(owner) == list(range(lay.total_bytes // 2))


def test_transposed_layout_views_tile_the_buffer_exactly():
    lay = plan.ExpertLayout(layers=2, experts=3, hidden=5, intermediate=3, itemsize=2,
                            transposed=True)
    assert lay.gate_up_shape == (5, 6) and lay.down_shape == (3, 5)
    owner = {}
    for layer in range(2):
        for name, (off, shape, strides) in (("gu", lay.gate_up_view(layer)),
                                            ("dn", lay.down_view(layer))):
            assert shape[1:] == (lay.gate_up_shape if name == "gu" else lay.down_shape)
            for idx in itertools.product(*map(range, shape)):
                pos = strided_index(off, shape, strides, idx)
                assert pos not in owner
                owner[pos] = (layer, name, idx)
                base = lay.key(layer, idx[0]) * lay.expert_elems   # [H x 2I | I x H]
                want = (base + idx[1] * 6 + idx[2] if name == "gu"
                        else base + lay.gate_up_elems + idx[1] * 5 + idx[2])
                assert pos == want
    assert sorted(owner) == list(range(lay.total_bytes // 2))


def test_layout_keys():
    lay = plan.ExpertLayout(2, 8, 64, 32, 2)
    assert lay.key(1, 3) == 11
    for bad in ((2, 0), (0, 8), (-1, 0)):
        with pytest.raises(IndexError):
            lay.key(*bad)


# -- the combine plan -------------------------------------------------------------------------

def test_segments():
    assert plan.segments([2, 0, 3, 1]) == [(0, 0, 2), (2, 2, 3), (3, 5, 1)]
    assert plan.segments([0, 0]) == []
    with pytest.raises(ValueError):
        plan.segments([1, -1])


def test_combine_is_independent_of_compute_order():
    # Floats whose sum depends on the order they are added in: the per-(token, k) buffer and
    # the fixed k order make the result the same whatever order experts fill it in.
    rng = random.Random(1234)
    ntok, k, nexp = 50, 4, 8
    route = [rng.sample(range(nexp), k) for _ in range(ntok)]
    value = {(t, j): rng.choice([1e16, -1e16, 1.0, 3.0, 1e-3]) * rng.random()
             for t in range(ntok) for j in range(k)}
    results = set()
    for _ in range(20):
        order = list(range(nexp))
        rng.shuffle(order)
        buf = [[None] * k for _ in range(ntok)]
        for e in order:                       # "compute" expert e: fill its own places
            for t in range(ntok):
                for j in range(k):
                    if route[t][j] == e:
                        buf[t][j] = value[(t, j)]
        results.add(tuple(plan.combine(buf, 0.0)))
    assert len(results) == 1
    # and accumulating in compute order instead would not be (the test can tell)
    sums = set()
    for _ in range(20):
        order = list(range(nexp))
        rng.shuffle(order)
        acc = [0.0] * ntok
        for e in order:
            for t in range(ntok):
                for j in range(k):
                    if route[t][j] == e:
                        acc[t] += value[(t, j)]
        sums.add(tuple(acc))
    assert len(sums) > 1


# -- policies ---------------------------------------------------------------------------------

def test_policy_for():
    assert plan.policy_for("auto", tokens=4, batch=4) == "lru"        # decode
    assert plan.policy_for("auto", tokens=64, batch=4) == "static"    # prefill
    assert plan.policy_for("static", 1, 1) == "static"
    assert plan.policy_for("lru", 64, 1) == "lru"
    assert plan.policy_for("mapped", 1, 1) == plan.policy_for("mapped", 64, 1) == "mapped"
    with pytest.raises(OffloadError, match="policy"):
        plan.policy_for("lfu", 1, 1)
    assert plan.is_decode(tokens=4, batch=4) and not plan.is_decode(tokens=5, batch=4)


def test_resident_drift():
    assert plan.resident_drift([1, 2, 3, 4], [4, 3, 2, 1]) == 0.0
    assert plan.resident_drift([1, 2, 3, 4], [1, 2, 5, 6]) == 0.5
    assert plan.resident_drift([], [7]) == 1.0
    assert plan.resident_drift([7], []) == 0.0


def test_resident_keys():
    assert plan.resident_keys([0, 0, 0, 0], 2) == [0, 1]
    assert plan.resident_keys([1, 5, 0, 5], 3) == [1, 3, 0]
    assert plan.resident_keys([1, 2], 0) == []
    assert plan.resident_keys([1, 2], 9) == [1, 0]


def test_host_places():
    # experts() adds 2 * place to ANYWHERE: every key's blob start, in key order
    places = plan.host_places(1 << 20, 3, 96)
    assert [plan.ANYWHERE + 2 * p for p in places] == [(1 << 20) + 96 * k for k in range(3)]


def test_host_keys():
    # 2 layers of 4 experts; key 0 and 5 resident. Layer 0's others by count: 3 (9), 1 (5),
    # 2 (0); layer 1's: 7 (4), 4 (1), 6 (1, a tie broken by index).
    counts = [7, 5, 0, 9, 1, 8, 1, 4]
    assert plan.host_keys(counts, [0, 5], 2, 4, 1.0) == [1, 2, 3, 4, 6, 7]
    assert plan.host_keys(counts, [0, 5], 2, 4, 0.0) == []
    assert plan.host_keys(counts, [0, 5], 2, 4, 0.5) == [1, 4]       # ranks 1 of each layer
    assert plan.host_keys(counts, [0, 5], 2, 4, 0.7) == [1, 2, 4, 6]  # ranks 1 and 2
    assert plan.host_keys(counts, range(8), 2, 4, 1.0) == []          # all resident
    many = plan.host_keys([0] * 128, [], 1, 128, 0.3)                 # the share holds
    assert len(many) == int(128 * 0.3)


def test_import_tandem_does_not_import_torch():
    import subprocess
    code = "import sys, tandem, tandem._offload; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
