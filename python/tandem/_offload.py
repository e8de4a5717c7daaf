"""The torch-free half of ``tandem.torch.offload_experts``: budget parsing, finding the MoE
blocks of a model by structure, the host layout of the expert blobs, and the plans the forward
follows (which experts a layer needs, in which order results are combined, which policy a pass
uses). Nothing here imports torch, so ``make check`` tests it on a machine without PyTorch
(python/tests/test_offload_plan.py); ``tandem.torch`` does the tensor work on top of it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Tuple

# Block classes whose forward offload_experts knows how to replace: the router is the block's
# `gate` (gpt-oss: `router`), returning logits, weights [T, k] and indices [T, k], and the
# experts are one module with fused 3-D parameters. A block with more than that (Qwen2-MoE's
# shared expert, say) would lose the extra part, so support is by class name as well as by
# structure.
SUPPORTED_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "MixtralSparseMoeBlock": "mixtral",
    # sigmoid routing over groups of experts (its router is kept as it is); its shared experts
    # stay on the device and are added to the routed experts' output, as the block does
    "DeepseekV3MoE": "deepseek_v3",
    # transposed experts (x @ W: gate_up [E, H, 2I] with gate and up interleaved, down
    # [E, I, H]), biases (which stay on the device), its own clamped gate; the block returns
    # (output, router weights)
    "GptOssMLP": "gpt_oss",
}
# Kinds whose experts are transposed, biased and gated by the experts module's own _apply_gate.
TRANSPOSED_KINDS = frozenset({"gpt_oss"})

# A module is taken for an MoE block (supported or not) when it holds a child called `experts`
# (true of every MoE block in transformers); the first such module on a path is the block, and
# its children are not looked at again.

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
    "t": 1000 ** 4, "tb": 1000 ** 4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


class OffloadError(ValueError):
    """offload_experts cannot do what was asked (unsupported block, budget, shapes); the model
    is left unchanged."""


class UnsupportedBlockError(OffloadError):
    """The model has an MoE block whose type offload_experts does not support."""


# A tdm_moe_group's bytes: int64 w, int32 first, int32 count.
GROUP_BYTES = 16
# experts() takes each expert's weights as 2-byte offsets from a base; a base that lies in no
# tandem allocation lets the offsets name any memory the device reads (the streamer's slots,
# pinned host memory), unchecked: tandem.torch's device table names every expert this way.
ANYWHERE = 16


def host_places(host_ptr: int, keys: int, expert_bytes: int) -> List[int]:
    """Each key's place in the pinned host buffer at host_ptr (one blob of expert_bytes a key,
    in key order), as experts() takes it from ANYWHERE: in 2-byte units."""
    return [(host_ptr + key * expert_bytes - ANYWHERE) // 2 for key in range(keys)]


# The streamer's counters that add up over the streamers a handle makes.
COUNTERS = ("acquires", "hits", "resident_hits", "inflight_hits", "misses", "prefetches",
            "prefetch_hits", "prefetch_dropped", "bytes_copied")


def parse_size(text: str) -> int:
    """Bytes from "8GiB", "512 MiB", "1.5GB", "4096" (KB/MB/GB are powers of 1000,
    KiB/MiB/GiB powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise OffloadError(f"budget {text!r}: expected a size such as '8GiB', '500MB', "
                           f"'4096' or a percentage such as '25%'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_budget(budget: Any, total_bytes: int, expert_bytes: int) -> int:
    """Device bytes for resident experts: a size (int bytes or "8GiB"-style string) or "N%" of
    the experts' total bytes. Rounded down to whole experts (a part of an expert holds
    nothing) and capped at the total (more holds nothing more). The staging slots come on top
    of it, so 0 is valid: every expert streams through them."""
    if expert_bytes <= 0:
        raise OffloadError("expert size must be positive")
    if isinstance(budget, bool):
        raise OffloadError(f"budget {budget!r}: expected bytes, a size string or 'N%'")
    if isinstance(budget, (int, float)):
        nbytes = int(budget)
    elif isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            pct = float(budget.strip()[:-1])
        except ValueError:
            raise OffloadError(f"budget {budget!r}: expected a percentage such as '25%'") from None
        if not 0.0 <= pct <= 100.0:
            raise OffloadError(f"budget {budget!r}: a percentage must be between 0% and 100%")
        nbytes = int(total_bytes * pct / 100.0)
    elif isinstance(budget, str):
        nbytes = parse_size(budget)
    else:
        raise OffloadError(f"budget {budget!r}: expected bytes, a size string or 'N%'")
    if nbytes < 0:
        raise OffloadError(f"budget {budget!r} is negative")
    nbytes = min(nbytes, total_bytes)
    return nbytes // expert_bytes * expert_bytes


@dataclass(frozen=True)
class BlockInfo:
    """One MoE block found in the model: its qualified name, the module, and its kind
    (a value of SUPPORTED_BLOCKS)."""
    name: str
    module: Any
    kind: str


def _looks_like_moe(module: Any) -> bool:
    return getattr(module, "experts", None) is not None


def find_moe_blocks(named_modules: Iterable[Tuple[str, Any]]) -> List[BlockInfo]:
    """The model's MoE blocks, in module order (which is layer order for transformers models),
    from ``model.named_modules()``. Raises UnsupportedBlockError naming the first block type
    that is not supported (or not shaped as its type should be), OffloadError when there is
    none at all."""
    blocks: List[BlockInfo] = []
    inside: Optional[str] = None
    for name, module in named_modules:
        if inside is not None and (name == inside or name.startswith(inside + ".")):
            continue
        if not _looks_like_moe(module):
            continue
        inside = name
        tname = type(module).__name__
        kind = SUPPORTED_BLOCKS.get(tname)
        if kind is None:
            raise UnsupportedBlockError(
                f"{name or 'the model'}: MoE block type {tname} is not supported by "
                f"offload_experts (supported: {', '.join(sorted(SUPPORTED_BLOCKS))})")
        problem = structure_problem(module, kind)
        if problem:
            raise UnsupportedBlockError(f"{name}: {tname} is not shaped as expected: {problem}")
        blocks.append(BlockInfo(name, module, kind))
    if not blocks:
        raise OffloadError("the model has no MoE block (looked for modules with an `experts` "
                           f"child; supported: {', '.join(sorted(SUPPORTED_BLOCKS))})")
    return blocks


def router_of(block: Any) -> Any:
    """The block's router module: `gate`, or gpt-oss's `router`."""
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def structure_problem(block: Any, kind: str = "") -> str:
    """What keeps the block's fused expert parameters from being offloaded, or "" when
    nothing: a router (`gate`, or `router` for gpt-oss) with a [E, H] weight, and `experts`
    with gate_up_proj [E, 2I, H], down_proj [E, H, I], gated, unbiased, not transposed,
    concatenated, with an act_fn; or, for the transposed kinds, gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] (interleaved, with biases [E, 2I] and [E, H] and an _apply_gate)."""
    gate, experts = router_of(block), getattr(block, "experts", None)
    transposed = kind in TRANSPOSED_KINDS
    if gate is None or experts is None:
        return (f"expected a router `{'router' if transposed else 'gate'}` and an `experts` "
                "module")
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if gu is None or dn is None:
        return "experts have no fused gate_up_proj / down_proj parameters"
    gs, ds = tuple(gu.shape), tuple(dn.shape)
    if len(gs) != 3 or len(ds) != 3:
        return f"expected 3-D expert parameters, got gate_up_proj {gs}, down_proj {ds}"
    if transposed:
        e, h, two_i = gs
        if two_i % 2 or ds != (e, two_i // 2, h):
            return f"gate_up_proj {gs} and down_proj {ds} do not form [E, H, 2I] / [E, I, H]"
        flags = (("has_gate", True), ("has_bias", True), ("is_transposed", True),
                 ("is_concatenated", False))
    else:
        e, two_i, h = gs
        if two_i % 2 or ds != (e, h, two_i // 2):
            return f"gate_up_proj {gs} and down_proj {ds} do not form [E, 2I, H] / [E, H, I]"
        flags = (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                 ("is_concatenated", True))
    for attr, want in flags:
        if getattr(experts, attr, want) != want:
            return f"experts.{attr} is {getattr(experts, attr)!r}, expected {want!r}"
    if transposed:
        for attr, want in (("gate_up_proj_bias", (e, two_i)), ("down_proj_bias", (e, h))):
            got = tuple(getattr(getattr(experts, attr, None), "shape", ()))
            if got != want:
                return f"experts.{attr} {got}, expected {want}"
        if getattr(experts, "_apply_gate", None) is None:
            return "experts have no _apply_gate"
    elif getattr(experts, "act_fn", None) is None:
        return "experts have no act_fn"
    ws = tuple(getattr(getattr(gate, "weight", None), "shape", ()))
    if ws != (e, h):
        return f"router weight {ws}, expected {(e, h)}"
    return ""


def canonical_shapes(kind: str, gs: Tuple[int, ...], ds: Tuple[int, ...]
                     ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """A block's (gate_up, down) shapes as [E, 2I, H] / [E, H, I], whichever way its kind
    stores them."""
    if kind in TRANSPOSED_KINDS:
        return (gs[0], gs[2], gs[1]), (ds[0], ds[2], ds[1])
    return gs, ds


@dataclass(frozen=True)
class ExpertLayout:
    """Where the experts live in the one pinned host buffer: key = layer * experts + e, expert
    `key` at element key * expert_elems, each one blob [gate_up | down] in the parameters'
    dtype and layout, row-major: (2I x H | H x I), the shapes F.linear takes, or, transposed,
    (H x 2I | I x H), the shapes x @ W takes; either way the device copy is used as it
    lands."""
    layers: int
    experts: int
    hidden: int
    intermediate: int
    itemsize: int
    transposed: bool = False

    @property
    def gate_up_elems(self) -> int:
        return 2 * self.intermediate * self.hidden

    @property
    def down_elems(self) -> int:
        return self.hidden * self.intermediate

    @property
    def expert_elems(self) -> int:
        return self.gate_up_elems + self.down_elems

    @property
    def expert_bytes(self) -> int:
        return self.expert_elems * self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes

    @property
    def gate_up_shape(self) -> Tuple[int, int]:
        """One expert's gate_up matrix as stored."""
        two_i, h = 2 * self.intermediate, self.hidden
        return (h, two_i) if self.transposed else (two_i, h)

    @property
    def down_shape(self) -> Tuple[int, int]:
        """One expert's down matrix as stored."""
        i, h = self.intermediate, self.hidden
        return (i, h) if self.transposed else (h, i)

    def key(self, layer: int, e: int) -> int:
        if not (0 <= layer < self.layers and 0 <= e < self.experts):
            raise IndexError(f"expert ({layer}, {e}) out of range")
        return layer * self.experts + e

    def gate_up_view(self, layer: int) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int]]:
        """(offset, shape, strides) in elements of layer's gate_up_proj ([E, 2I, H], or
        [E, H, 2I] transposed) inside the buffer: a strided view, so the parameter can point
        at the host copy without another."""
        rows, cols = self.gate_up_shape
        return (self.key(layer, 0) * self.expert_elems, (self.experts, rows, cols),
                (self.expert_elems, cols, 1))

    def down_view(self, layer: int) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int]]:
        """(offset, shape, strides) in elements of layer's down_proj ([E, H, I], or [E, I, H]
        transposed)."""
        rows, cols = self.down_shape
        return (self.key(layer, 0) * self.expert_elems + self.gate_up_elems,
                (self.experts, rows, cols), (self.expert_elems, cols, 1))


def uniform_shape(shapes: Sequence[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]
                  ) -> Tuple[int, int, int]:
    """(E, H, I) shared by every block, from (name, gate_up shape, down shape) per block; an
    OffloadError naming the first block that differs (one streamer keys every expert by
    layer * E + e with one expert size)."""
    first = None
    for name, gs, _ in shapes:
        ehi = (gs[0], gs[2], gs[1] // 2)
        if first is None:
            first = (name, ehi)
        elif ehi != first[1]:
            raise OffloadError(f"{name}: experts (E, H, I) = {ehi} differ from {first[0]}'s "
                               f"{first[1]}; offload_experts needs one expert shape")
    if first is None:
        raise OffloadError("no MoE block to offload")
    return first[1]


def staging_bytes(slots: int, expert_bytes: int) -> int:
    """Device bytes the staging slots take: the least the streamer needs, whatever the
    budget."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise OffloadError(f"slots={slots!r}: need at least one staging slot")
    return slots * expert_bytes


def check_device_room(budget: int, staging: int, free: int, freeable: int) -> None:
    """Raises when the device cannot hold the staging slots plus the budget: `free` is what
    the device has free now, `freeable` what offloading the experts gives back."""
    need = budget + staging
    room = free + freeable
    if staging > room:
        raise OffloadError(
            f"the device cannot hold the staging slots: {staging} bytes needed, {room} "
            f"available ({free} free + {freeable} of experts given back); use fewer slots")
    if need > room:
        raise OffloadError(
            f"the device cannot hold the budget: {budget} bytes of resident experts + "
            f"{staging} of staging slots = {need}, {room} available ({free} free + "
            f"{freeable} of experts given back); use a smaller budget")


def segments(counts: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(expert, start, n) for each expert with tokens, in expert order: the rows of the
    expert-sorted (token, k) list that each expert computes. Sorting is stable, so an expert's
    rows keep (token, k) order whatever the order experts are computed in."""
    out, start = [], 0
    for e, n in enumerate(counts):
        n = int(n)
        if n < 0:
            raise ValueError(f"negative token count {n} for expert {e}")
        if n:
            out.append((e, start, n))
        start += n
    return out


def combine(per_slot: Sequence[Sequence[Any]], zero: Any) -> List[Any]:
    """The fixed-order combine: out[t] = ((zero + y[t][0]) + y[t][1]) + ..., k ascending, from
    the per-(token, k) results y. The only place results are added up, so the order experts
    were computed in (which depends on the policy, the budget and what was resident) never
    reaches the sums. tandem.torch does the same with tensors: one sum over the k axis of a
    [tokens, k, hidden] buffer, a reduction whose order is fixed by its shape."""
    out = []
    for row in per_slot:
        acc = zero
        for y in row:
            acc = acc + y
        out.append(acc)
    return out


def policy_for(policy: str, tokens: int, batch: int) -> str:
    """The streamer policy of one pass: "static", "lru" or "mapped" as asked, or under "auto"
    LRU for decode (one new token per sequence) and the static set for prefill (cyclic scans
    over every expert, where LRU evicts what the next layer pass needs). "mapped" is the static
    set for every pass (its decode reads the other experts in place, see tandem.torch, which
    takes "auto" for "mapped" where the experts are grouped, before it asks here)."""
    if policy in ("static", "lru", "mapped"):
        return policy
    if policy == "auto":
        return "lru" if tokens <= batch else "static"
    raise OffloadError(f"policy={policy!r}: expected 'auto', 'static', 'lru' or 'mapped'")


def is_decode(tokens: int, batch: int) -> bool:
    """A pass of one new token per sequence."""
    return tokens <= batch


def resident_drift(current: Sequence[int], wanted: Sequence[int]) -> float:
    """The share of `wanted` (a resident set chosen afresh) that `current` lacks: 0.0 when the
    sets agree, 1.0 when they share nothing (or `current` is empty and `wanted` is not)."""
    if not wanted:
        return 0.0
    have = set(current)
    return sum(1 for k in wanted if k not in have) / len(wanted)


def resident_keys(counts: Sequence[int], n: int) -> List[int]:
    """The n keys to keep resident under the static policy, most routed first (ties by key),
    from per-key routing counts seen so far; with no counts yet, key order."""
    order = sorted(range(len(counts)), key=lambda k: (-counts[k], k))
    return order[:max(0, min(n, len(counts)))]


def host_keys(counts: Sequence[int], resident: Iterable[int], layers: int, experts: int,
              share: float) -> List[int]:
    """The keys the host computes under host placement: in each layer, the experts that are
    not resident, ranked by routing count (most first, ties by index), every one whose rank r
    has floor((r + 1) * share) > floor(r * share), so the host gets about `share` of them,
    spread over the ranking (and so about that share of the routed load)."""
    kept = set(resident)
    out: List[int] = []
    for layer in range(layers):
        base = layer * experts
        others = sorted((k for k in range(base, base + experts) if k not in kept),
                        key=lambda k: (-counts[k], k))
        out += [k for r, k in enumerate(others) if int((r + 1) * share) > int(r * share)]
    return sorted(out)
