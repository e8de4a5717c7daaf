"""tandem.torch: expert offload for PyTorch Mixture-of-Experts models (transformers' Qwen3-MoE,
Mixtral, DeepSeek-V3 and gpt-oss blocks), with tandem's expert streamer under them.

    handle = tandem.torch.offload_experts(model, budget="25%", device="cuda:0")
    out = model.generate(...)          # experts stream from pinned host memory
    handle.stats(); handle.restore()

What offload_experts does, in order, so that an error at any step leaves the model as it was
(it checks everything, then allocates, then swaps):
1. finds the MoE blocks (modules with an ``experts`` child) and checks each is a supported type
   with the fused 3-D parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
   (gpt-oss: [E, H, 2I] and [E, I, H], with biases, which stay on the device), all blocks
   with the same E, H, I and dtype; any other block type is an error naming it;
2. sizes the device side: the budget (``"8GiB"``-style sizes, plain bytes, or ``"N%"`` of the
   experts' total bytes, rounded down to whole experts) is device memory for experts that may
   stay resident; ``slots`` staging slots of one expert each come on top of it and always
   exist, so a budget of 0 streams every expert through them. The device must hold the budget
   plus the staging slots, counting the expert memory the offload gives back, else an error;
3. copies every expert into one pinned host buffer, one contiguous blob per expert in the
   parameters' dtype, laid out [gate_up (2I x H) | down (H x I)] (what F.linear takes;
   gpt-oss's transposed [H x 2I | I x H], what x @ W takes), so a slot is used as it lands,
   keyed layer * E + e over the offloaded blocks in module order;
4. points each expert parameter at its strided view of that buffer (so it now lives on the
   CPU, in pinned memory, without a second host copy), creates one streamer for all blocks and
   replaces each block's forward. If the streamer cannot be created, the parameters go back.

The replaced forward of a block: the block's own router runs on the GPU (so routing is exactly
transformers'); the (token, k) pairs are sorted by expert on the GPU and the per-expert counts
reach the host in one small copy per layer; the streamer orders the routed experts so the GPU
computes those already on the device while the others land (Streamer.schedule); under the
static policy every copy the layer needs starts at once on the prefetch queue, as soon as the
routing is known, and under LRU (where a prefetch could evict a cached expert the layer still
needs) the acquires run ahead of compute, a window of slots - 1 experts, so demand copies
overlap the experts before them. Once a layer's experts are queued, the next block's experts
as its router predicts them from this block's input (the predictor rides in the same count
copy) are prefetched, so their copies run while this layer computes. Each expert comes as a device
pointer plus a device-side wait on the compute stream, is computed on PyTorch's current stream
of the pass (tandem's compute queue is a torch stream the handle owns, adopted by tandem; the
caller's stream and it wait for each other device-side around the block) and is released right
after its last kernel, so its slot is reused only once that work completes.

The grouped path (the default where the experts allow it: bf16, SwiGLU with SiLU, no biases;
grouped=False turns it off; a pass of more than 64 rows an expert, a long prefill, takes the
per-expert path, whose GEMMs are the faster there) computes a layer's routed experts with
libtandem_moe's operations (tandem.MoeOps on the handle's queue) instead of PyTorch's
operators per expert: the block's
router still runs in PyTorch, then group() sorts the (token, k) pairs by expert on the device,
experts() computes every routed expert's gate/up and down in one launch each (on the streamer's
slots, as the C engine does) and combine() sums over k in f32, in a fixed order. With every
expert resident (budget "100%") the experts' places are on the device and nothing comes back to
the host: a layer is a handful of launches. Otherwise the counts come back as on the per-expert
path, the routed experts are acquired in index order a window of staging slots at a time, and
each window is one experts() call on its slice of the grouped table. An expert's rows are the
same whatever the windows, so the results are bitwise the same at every budget and policy (and
differ from the per-expert path's within rounding: other kernels).

Results are bitwise independent of the policy, the budget and the order experts are computed
in: an expert's weighted output goes to its own rows of an expert-sorted buffer (inputs and
routing weights are gathered in that order once, so an expert's are slices), the buffer goes
back to (token, k) order in one copy, and the block output is summed from it afterwards, in an
order fixed by the buffer's shape, never accumulated in compute order. An expert always
computes the same rows, in the same order, with the same kernels, wherever its weights came
from. The all-resident reference is this same code path with a budget of "100%". The combine
is one sum over k of the weighted outputs, kept in the dtype the weighting gives (float32 under
Mixtral's float32 routing weights), rounded to the hidden dtype once, as transformers'
grouped_mm experts do; against transformers' own forward the difference is within bf16
rounding (other GEMM kernels, other summation order).

Policies: "static" keeps a fixed set resident (the most routed experts seen so far, else key
order), which suits prefill's scans over every expert; "lru" makes every slot one LRU cache,
which suits decode. "auto" (the default) is "mapped" where the grouped path computes the
experts, else LRU for decode passes (one token per sequence) and the static set for prefill.
The streamer's policy is fixed at creation, so switching recreates the streamer (resident
experts are loaded again); results never change. "mapped" (grouped path only) keeps the
static set for every pass; prefill streams the other experts
through the staging slots, and a decode pass reads them where they lie in the pinned host
buffer, inside the expert kernels, across the link: nothing is copied, acquired or sent back
to the host, so decode is a handful of launches a layer, as with every expert resident. The
first decode pass after a prefill chooses the set again from the counts seen so far when more
than a tenth of it has changed (the resident experts are loaded again, once). In-place reads
suit a few sequences: the grouped kernels read an expert's weights again for every few
tokens (bench/moe_inplace.py measures them against a copy).

CUDA graphs: where every block takes the device table (budget "100%", or policy "mapped"
decoding), a pass only submits work on PyTorch's current stream and never waits for the
device, so a decode step can be captured (torch.cuda.graph with capture_error_mode=
"thread_local", since tandem's own threads may query the device meanwhile, and transformers'
StaticCache; run one eager step first, which settles the resident set) and replayed for each
token. The graph reads the handle's table, which is rewritten in place whenever the set
changes, so it stays valid until restore(). Replays count in stats() (device_routed_pairs and
hits), not in busy_s or device_routed_layers. Under torch.compile (transformers' generate()
with a static cache compiles the decode step in mode "reduce-overhead", which records CUDA
graphs) a block's routed experts are one custom op, tandem::offloaded_experts, so the compiled
step holds them whole. A pass that would copy experts while a graph is captured raises
OffloadError instead (policy "mapped" or budget "100%" decode in graphs); one that would
choose the resident set again keeps it, and the next eager decode pass chooses it.

Host placement (host_share > 0, policy "mapped"): a decode pass computes that share of each
layer's experts that are not resident on the host CPU, from the pinned buffer, with
libtandem_moe's CPU kernels, while the GPU reads the others in place, so the host's memory
bandwidth adds to the link's. The host's work is a host function of a second stream, joined
device-side, so a CUDA graph holds it too (tandem/_host_experts.py). Its results differ from
the all-resident run within f32 rounding (other kernels); host_computed_pairs in stats()
counts its pairs.

restore() puts the original parameter objects back on the devices they were on at offload time
(new device memory, the same Parameter objects, so references held elsewhere stay valid), puts
the original forwards back and frees the streamer and the pinned buffer. If the device cannot
hold the parameters again, restore() raises and the model stays offloaded and working.

Limits: inference only (expert outputs carry no gradient); one CUDA device; a handle's forwards
are serialized by a lock; do not change expert parameters while offloaded (the streamer copies
from the pinned buffer they point at). Importing this module needs PyTorch; ``import tandem``
never imports it.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import types
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

import tandem

from . import _offload as plan
from ._grouped import GroupedPath
from ._host_experts import HostExperts, adopt
from ._offload import OffloadError, UnsupportedBlockError

__all__ = ["offload_experts", "OffloadHandle", "OffloadError", "UnsupportedBlockError"]

# The grouped path takes a pass of at most this many (token, k) rows an expert on average;
# more go through PyTorch's operators per expert, whose GEMMs are the faster there: on an H100
# (bench/results/h100-torch-offload-6c41590/) grouped was 1.27x at 32 rows an expert (a 512-
# token prefill of 128 experts, top 8) and 0.51x at 128.
_GROUPED_ROWS = 64

# Under policy "mapped", a decode pass after a prefill chooses the resident set again when more
# than this share of the set the counts now ask for is not resident.
_DRIFT = 0.1



class _DeviceBytes:
    """A streamer slot as CUDA Array Interface v3 bytes, so torch.as_tensor views it without
    a copy. No stream: the compute stream already waits for the slot's copy device-side."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
            "version": 3, "stream": None,
        }


def offload_experts(model: Any, budget: Union[str, int] = "8GiB", policy: str = "auto",
                    slots: int = 16, device: str = "cuda:0", *,
                    prefetch_depth: int = 0, lookahead: bool = True,
                    grouped: Optional[bool] = None, host_share: float = 0.0
                    ) -> "OffloadHandle":
    """Moves the expert weights of `model`'s MoE blocks into pinned host memory and streams
    them to `device` on demand (see the module's docstring). `budget`: device bytes for
    resident experts ("8GiB", "500MB", an int, or "25%" of the experts' bytes); `policy`:
    "auto", "static", "lru" or "mapped" (see the module's docstring); `slots`: staging slots
    (one expert each) besides the budget; `prefetch_depth`: prefetch copies in flight at most
    (0: as many as staging slots); `lookahead`: prefetch the next block's experts as its
    router, applied to this block's input, predicts them; `grouped`: compute a layer's
    experts with libtandem_moe's grouped operations (tandem.MoeOps: one launch per
    projection) rather than PyTorch's operators per expert; None (the default) where the
    experts allow it (bf16, SwiGLU with SiLU, no biases), True insists (an OffloadError where
    they do not); `host_share`: under policy "mapped", the share of each layer's experts that
    are not resident that decode passes compute on the host CPU while the GPU reads the
    others in place (0, the default: none; see "Host placement" in the module's docstring).
    Returns an OffloadHandle. Raises OffloadError (UnsupportedBlockError for a block type it
    does not know) or a tandem/torch error, with the model unchanged."""
    plan.policy_for(policy, 1, 1)          # reject a bad policy before anything else
    if not torch.cuda.is_available():
        raise OffloadError("offload_experts needs a CUDA device; PyTorch sees none")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise OffloadError(f"device={device!r}: offload_experts computes on a CUDA device")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    blocks = plan.find_moe_blocks(model.named_modules())
    if any(getattr(b.module, "_tandem_offload", None) is not None for b in blocks):
        raise OffloadError("the model's experts are offloaded already; restore() first")
    transposed = {b.kind in plan.TRANSPOSED_KINDS for b in blocks}
    if len(transposed) != 1:
        raise OffloadError("the model mixes transposed (gpt-oss) and other MoE blocks")
    shapes = [(b.name,) + plan.canonical_shapes(b.kind, tuple(b.module.experts.gate_up_proj.shape),
                                                tuple(b.module.experts.down_proj.shape))
              for b in blocks]
    e, h, i = plan.uniform_shape(shapes)
    dtypes = {(b.module.experts.gate_up_proj.dtype, b.module.experts.down_proj.dtype)
              for b in blocks}
    if len(dtypes) != 1 or len(set(next(iter(dtypes)))) != 1:
        raise OffloadError(f"the expert parameters have more than one dtype: "
                           f"{sorted(map(str, dtypes))}")
    dtype = next(iter(dtypes))[0]
    for b in blocks:
        rdev = plan.router_of(b.module).weight.device
        if rdev != dev:
            raise OffloadError(f"{b.name}: the router is on {rdev}, not on {dev}; the rest of "
                               f"the model must be on the device that computes the experts")
    layout = plan.ExpertLayout(len(blocks), e, h, i, torch.empty((), dtype=dtype).element_size(),
                               transposed=transposed.pop())
    budget_bytes = plan.parse_budget(budget, layout.total_bytes, layout.expert_bytes)
    staging = plan.staging_bytes(slots, layout.expert_bytes)
    free, _ = torch.cuda.mem_get_info(dev)
    on_dev = sum(p.numel() * p.element_size() for b in blocks
                 for p in (b.module.experts.gate_up_proj, b.module.experts.down_proj)
                 if p.device == dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    plan.check_device_room(budget_bytes, staging, free, on_dev + max(0, cached))
    why = _why_not_grouped(blocks, dtype)
    if grouped and why:
        raise OffloadError(f"grouped=True: {why}")
    if policy == "mapped" and (why or grouped is False):
        raise OffloadError("policy='mapped' reads experts in place with libtandem_moe's grouped "
                           f"operations: {why or 'grouped=False'}")
    if policy == "auto" and grouped is not False and not why:
        policy = "mapped"   # decode without copies or host round trips, and graph-capturable
    if not 0.0 <= host_share <= 1.0:
        raise OffloadError(f"host_share={host_share!r}: a share of the experts, in [0, 1]")
    if host_share and policy != "mapped":
        raise OffloadError(f"host_share needs policy 'mapped' (decode passes on the device "
                           f"table); the policy is {policy!r}")
    return OffloadHandle(blocks, layout, dtype, dev, budget_bytes, slots, policy,
                         prefetch_depth, lookahead, grouped is not False and not why,
                         host_share)


def _why_not_grouped(blocks: List[plan.BlockInfo], dtype: torch.dtype) -> str:
    """Why libtandem_moe's grouped experts cannot compute these blocks ('' where they can):
    they take bf16 weights and compute SwiGLU with SiLU, without biases."""
    if dtype != torch.bfloat16:
        return f"the experts are {dtype}, and the grouped operations take bfloat16"
    for b in blocks:
        if b.kind in plan.TRANSPOSED_KINDS:
            return (f"{b.name}: its experts are transposed, biased and gated by their own "
                    f"clamped _apply_gate, which the grouped operations do not compute")
        ex = b.module.experts
        act = getattr(ex, "act_fn", None)
        silu = act is F.silu or isinstance(act, torch.nn.SiLU) or \
            type(act).__name__ in ("SiLU", "SiLUActivation")
        # transformers gives every experts class a _apply_gate: its default (act(gate) * up on
        # the halves) is SwiGLU; a class's own (gpt-oss's clamped one) is not
        gate = getattr(type(ex), "_apply_gate", None)
        custom = gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"
        if custom or not silu:
            return f"{b.name}: its experts' activation is not SwiGLU with SiLU"
        if any(getattr(ex, a, None) is not None for a in ("gate_up_proj_bias", "down_proj_bias")):
            return f"{b.name}: its experts have biases"
    if not hasattr(tandem, "MoeOps"):
        return "this tandem build has no MoeOps"
    return ""


class OffloadHandle(GroupedPath):
    """What offload_experts returns: stats(), reset_stats(), restore(); a context manager
    that restores on exit."""

    def __init__(self, blocks: List[plan.BlockInfo], layout: plan.ExpertLayout,
                 dtype: torch.dtype, device: torch.device, budget_bytes: int, slots: int,
                 policy: str, prefetch_depth: int, lookahead: bool = True,
                 grouped: bool = False, host_share: float = 0.0) -> None:
        self._blocks = blocks
        self._layout = layout
        self._dtype = dtype
        self._device = device
        self.budget_bytes = budget_bytes
        self.slots = slots
        self.policy = policy
        self._prefetch_depth = prefetch_depth
        self._lookahead = lookahead
        self._lock = threading.Lock()
        self._streamer: Any = None
        self._streamer_policy: Optional[str] = None
        self._views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._carry = dict.fromkeys(plan.COUNTERS, 0)
        self._busy_s = 0.0
        self._peak: Optional[float] = None
        self._key_counts = [0] * (layout.layers * layout.experts)
        self._restored = False
        self._all_resident = budget_bytes >= layout.total_bytes
        self._ops: Any = None          # tandem.MoeOps on the queue, for the grouped path
        self._ws: Optional[torch.Tensor] = None
        self._wbase: Optional[int] = None     # the streamer's slots' allocation
        # The device table (every expert resident, or policy "mapped"): each expert's place
        # from plan.ANYWHERE, [layers, experts] on the device. One tensor for the handle's life,
        # rewritten in place, so a CUDA graph that reads it stays valid.
        self._wofs: Optional[torch.Tensor] = None
        self._table_ok = False         # _wofs names this streamer's places
        self._residents: List[int] = []       # the static set, keys
        self._prefilled = False        # counts came in since the set was chosen
        self._device_routed = 0        # layers grouped on the device, routing never on the host
        # Routed (token, k) pairs by key in device-routed passes, and the resident mask they
        # are scored against; folded into _dev_pairs/_dev_hits (and _key_counts) on the host.
        self._dev_counts: Optional[torch.Tensor] = None
        self._resident_mask: Optional[torch.Tensor] = None
        self._dev_pairs = self._dev_hits = 0
        self._hostx: Optional[HostExperts] = None   # host placement (host_share)
        tdev = tandem.Device(f"cuda:{device.index}")

        # Allocate and fill everything before the model changes.
        # The stream is made before any tandem work is queued (README: PyTorch's first stream
        # of a process may wait for the whole device with the GIL held).
        self._stream = torch.cuda.Stream(device)
        self._queue = adopt(self._stream)
        if grouped:
            self._ops = tandem.MoeOps(self._queue)
            self._dev_counts = torch.zeros(layout.layers, layout.experts, dtype=torch.int64,
                                           device=device)
        if host_share and not self._all_resident:
            try:
                self._hostx = HostExperts(layout, device, host_share)
            except tandem.TandemError as e:
                self._close_ops()
                raise OffloadError(f"host_share: the host cannot compute experts: {e}") from e
        # This block's routed counts, then the next block's predicted ones: one copy a layer.
        self._counts = torch.empty(2 * layout.experts, dtype=torch.int64, pin_memory=True)
        self._counts_ready = torch.cuda.Event()
        self._host = tandem.malloc(layout.total_bytes, "pinned", tdev)
        if self._hostx is not None:
            self._hostx.bind(self._host.ptr)
        flat = torch.frombuffer(self._host, dtype=torch.uint8).view(dtype)
        views = []
        for layer, b in enumerate(blocks):
            ex = b.module.experts
            for p, (off, shape, strides) in ((ex.gate_up_proj, layout.gate_up_view(layer)),
                                             (ex.down_proj, layout.down_view(layer))):
                v = flat.as_strided(shape, strides, off)
                v.copy_(p.data)
                views.append((p, v))
        del flat

        # Swap: parameters to their host views (their device memory goes back to the
        # caching allocator, and from it to the device for the slots), then the streamer, then
        # the forwards. If the streamer cannot be made, the parameters go back where they were.
        self._originals = [(p, p.data.device) for p, _ in views]
        with torch.no_grad():
            for p, v in views:
                p.data = v
        del views
        try:
            if any(d == device for _, d in self._originals):
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            self._ensure_policy(plan.policy_for(policy, 2, 1))
        except BaseException:
            with torch.no_grad():
                for p, d in self._originals:
                    p.data = _copy_to(p.data, d)
            self._close_streamer()
            self._close_ops()
            self._release_host()
            raise
        self._id = next(_IDS)
        _LIVE[self._id] = self
        if hasattr(torch, "library") and hasattr(torch.library, "custom_op"):
            _experts_op()      # registered now, not while torch.compile traces a forward
        self._saved_forwards: List[Tuple[Any, Optional[Any]]] = []
        for layer, b in enumerate(blocks):
            self._saved_forwards.append((b.module, b.module.__dict__.get("forward")))
            b.module.forward = types.MethodType(_make_forward(self, layer), b.module)
            b.module._tandem_offload = self

    # -- public ---------------------------------------------------------------------------

    @property
    def blocks(self) -> List[str]:
        """Qualified names of the offloaded blocks, in layer order."""
        return [b.name for b in self._blocks]

    @property
    def expert_bytes(self) -> int:
        return self._layout.expert_bytes

    def stats(self) -> Dict[str, Any]:
        """The streamer's counters since offload or reset_stats(), and:
        - device_routed_layers: layer passes grouped on the device (every expert resident, or
          policy "mapped" decoding), whose routing never reached the host; their routed
          (token, k) pairs, device_routed_pairs, of which device_routed_hits named a resident
          expert; bytes_read_in_place: an expert's bytes for each other pair (read across the
          link where it lies; exact for one sequence, an upper bound for a batch, where an
          expert is read once for several tokens), but for host_computed_pairs, those the
          host computed (host_share). Replays of a CUDA graph count too;
        - hit_rate: experts already resident when routed, over acquires plus device-routed
          pairs (copies in flight are not hits);
        - grouped: whether the grouped path computes the experts;
        - link_utilization: bytes copied and read in place / time spent in the offloaded
          blocks' forwards (busy_s; not counting graph replays), over the peak of one large
          pinned host-to-device copy measured once in this process."""
        with self._lock:
            st: Dict[str, Any] = dict(self._carry)
            if self._streamer is not None:
                cur = self._streamer.stats()
                for k, v in cur.items():
                    st[k] = st.get(k, 0) + v if k in plan.COUNTERS else v
            pairs, hits = self._device_pairs()
            acq = st.get("acquires", 0) + pairs
            res = st.get("resident_hits", st.get("hits", 0) - st.get("inflight_hits", 0)) + hits
            st["hit_rate"] = res / acq if acq else 1.0 if self._device_routed else 0.0
            st["device_routed_layers"] = self._device_routed
            st["device_routed_pairs"] = pairs
            st["device_routed_hits"] = hits
            on_host = self._hostx.host_pairs() if self._hostx is not None else 0
            st["host_computed_pairs"] = on_host
            st["bytes_read_in_place"] = (pairs - hits - on_host) * self._layout.expert_bytes
            st["grouped"] = self._ops is not None
            st["busy_s"] = self._busy_s
            st["budget_bytes"] = self.budget_bytes
            st["policy"] = self._streamer_policy
            util = 0.0
            moved = st.get("bytes_copied", 0) + st["bytes_read_in_place"]
            if moved and self._busy_s > 0:
                util = moved / self._busy_s / self._link_peak()
            st["link_utilization"] = util
            return st

    def _device_pairs(self) -> Tuple[int, int]:
        """Device-routed (token, k) pairs and resident hits among them, folded and current."""
        pairs, hits = self._dev_pairs, self._dev_hits
        if self._dev_counts is not None and self._resident_mask is not None:
            pairs += int(self._dev_counts.sum())
            hits += int((self._dev_counts * self._resident_mask).sum())
        return pairs, hits

    def _fold_device_counts(self) -> None:
        """Device-routed counts into the host's totals (and the per-key counts that choose a
        static set), before the resident mask changes."""
        if self._dev_counts is None or self._resident_mask is None:
            return
        self._dev_pairs, self._dev_hits = self._device_pairs()
        per_key = self._dev_counts.reshape(-1).tolist()
        for key, n in enumerate(per_key):
            self._key_counts[key] += n
        self._dev_counts.zero_()

    def reset_stats(self) -> None:
        with self._lock:
            if self._streamer is not None:
                self._streamer.reset_stats()
            self._carry = dict.fromkeys(plan.COUNTERS, 0)
            self._busy_s = 0.0
            self._device_routed = 0
            self._fold_device_counts()       # the per-key counts stay: they choose sets
            self._dev_pairs = self._dev_hits = 0
            if self._hostx is not None:
                self._hostx.reset()

    def restore(self) -> None:
        """Original parameters (same objects, on their devices of offload time) and forwards
        back; streamer and pinned memory freed. Raises, leaving the model offloaded, if the
        device cannot hold the parameters again."""
        with self._lock:
            if self._restored:
                return
            back = [(p, _copy_to(p.data, d)) for p, d in self._originals]  # may raise
            self._stream.synchronize()
            with torch.no_grad():
                for p, t in back:
                    p.data = t
            del back
            for module, fwd in self._saved_forwards:
                if fwd is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = fwd
                module.__dict__.pop("_tandem_offload", None)
            _LIVE.pop(self._id, None)
            self._close_streamer()
            self._close_ops()
            self._release_host()
            self._restored = True

    def _release_host(self) -> None:
        try:
            self._host.free()
        except (BufferError, tandem.TandemError):
            pass   # a view of it is still alive somewhere: freed with the last one
        self._host = None

    def __enter__(self) -> "OffloadHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    # -- the streamer ---------------------------------------------------------------------

    def _ensure_policy(self, policy: str, decode: bool = False) -> None:
        if self._all_resident:
            policy = "static"    # nothing to decide: every expert stays where it was loaded
        if policy == self._streamer_policy:
            if policy == "mapped" and decode and self._prefilled:
                self._rechoose()
            return
        self._open_streamer(policy)

    def _open_streamer(self, policy: str) -> None:
        self._close_streamer()
        kw: Dict[str, Any] = dict(budget_bytes=self.budget_bytes, staging_slots=self.slots,
                                  policy="static" if policy == "mapped" else policy,
                                  prefetch_depth=self._prefetch_depth)
        self._residents = []
        if policy in ("static", "mapped"):
            self._residents = self._wanted_residents()
            kw["resident"] = self._residents
        lay = self._layout
        self._streamer = _streamer_type()(self._queue, lay.layers, lay.experts,
                                          lay.expert_bytes, self._host, **kw)
        self._streamer_policy = policy
        self._prefilled = False
        if self._ops is not None and (self._all_resident or policy == "mapped"):
            self._learn_places()

    def _rechoose(self) -> None:
        """Policy "mapped", a decode pass after a prefill: the static set again from the counts
        seen so far, where it has drifted more than _DRIFT (the streamer is made again, its
        resident experts loaded again)."""
        self._prefilled = False
        if plan.resident_drift(self._residents, self._wanted_residents()) > _DRIFT:
            # A CUDA graph replayed on any stream may still read the old places.
            torch.cuda.synchronize(self._device)
            self._open_streamer("mapped")

    def _wanted_residents(self) -> List[int]:
        """The static set the counts seen so far (device-routed ones folded in) ask for."""
        self._fold_device_counts()
        return plan.resident_keys(self._key_counts,
                                  self.budget_bytes // self._layout.expert_bytes)

    def _close_streamer(self) -> None:
        if self._streamer is None:
            return
        for k, v in self._streamer.stats().items():
            if k in plan.COUNTERS:
                self._carry[k] = self._carry.get(k, 0) + v
        self._stream.synchronize()
        self._streamer.close()
        self._streamer = None
        self._streamer_policy = None
        self._views.clear()   # the slots' addresses die with the streamer
        self._wbase = None
        self._table_ok = False

    def _close_ops(self) -> None:
        if self._hostx is not None:
            self._hostx.close()      # after the second stream's work
            self._hostx = None
        if self._ops is not None:
            self._ops.close()      # after the queue's work
            self._ops = None
        self._ws = None

    def _slot(self, ptr: int) -> Tuple[torch.Tensor, torch.Tensor]:
        v = self._views.get(ptr)
        if v is None:
            lay = self._layout
            raw = torch.as_tensor(_DeviceBytes(ptr, lay.expert_bytes), device=self._device)
            w = raw.view(self._dtype)
            v = (w[:lay.gate_up_elems].view(*lay.gate_up_shape),
                 w[lay.gate_up_elems:].view(*lay.down_shape))
            self._views[ptr] = v
        return v

    def _link_peak(self) -> float:
        """Bytes/s of one 256 MiB pinned host-to-device copy, best of three."""
        if self._peak is None:
            n = 256 << 20
            src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            dst = torch.empty(n, dtype=torch.uint8, device=self._device)
            best = float("inf")
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(self._stream):
                    a.record()
                    dst.copy_(src, non_blocking=True)
                    b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            self._peak = n / best
        return self._peak

    # -- the forward ----------------------------------------------------------------------

    def _block_forward(self, layer: int, block: Any, hidden_states: torch.Tensor) -> Any:
        """The replaced forward: the block's own router, the routed experts (_experts_pass),
        then what the block adds (DeepSeek-V3's shared experts, gpt-oss's tuple). Under
        torch.compile the routed experts are one custom op (tandem::offloaded_experts), so
        a compiled step, and a CUDA graph of it, holds them whole."""
        bsz, seq, hdim = hidden_states.shape
        jitter = getattr(block, "jitter_noise", 0)
        if block.training and jitter > 0:      # as MixtralSparseMoeBlock does
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        x = hidden_states.reshape(-1, hdim)
        _, weights, index = plan.router_of(block)(x)
        if _compiling():
            out = _experts_op()(x, weights, index, self._id, layer, bsz)
        else:
            out = self._experts_pass(layer, x, weights, index, bsz)
        out = out.reshape(bsz, seq, hdim)
        shared = getattr(block, "shared_experts", None)
        if shared is not None:   # DeepSeek-V3: on the caller's stream, added as the block does
            out = out + shared(hidden_states)
        if self._blocks[layer].kind == "gpt_oss":
            return out, weights    # as GptOssMLP: (output, router weights)
        return out

    def _experts_pass(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                      index: torch.Tensor, bsz: int) -> torch.Tensor:
        """The block's routed experts, [tokens, H] in x's dtype, under the handle's lock."""
        with self._lock:
            if self._restored:
                raise OffloadError("this offload handle was restored")
            t0 = time.perf_counter()
            try:
                return self._experts_locked(layer, x, weights, index, bsz)
            finally:
                self._busy_s += time.perf_counter() - t0

    def _experts_locked(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                        index: torch.Tensor, bsz: int) -> torch.Tensor:
        ntok, topk = index.shape
        decode = plan.is_decode(ntok, bsz)
        policy = plan.policy_for(self.policy, ntok, bsz)
        grouped = self._ops is not None and ntok * topk <= _GROUPED_ROWS * self._layout.experts
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            why = self._not_capturable(policy, decode, grouped)
            if why:
                raise OffloadError(f"a CUDA graph cannot hold this offloaded pass: {why}")
        if self._hostx is not None and layer == 0 and not capturing:
            try:
                self._hostx.check()    # a host pass of an earlier step that failed
            except tandem.TandemError as e:
                raise OffloadError(f"a host pass of the experts failed: {e}") from e
        caller = torch.cuda.current_stream(self._device)
        stream = self._stream
        stream.wait_stream(caller)
        with torch.cuda.stream(stream), torch.no_grad():
            # On the handle's stream: what it allocates to keep (tables, the host's buffers)
            # comes from PyTorch's own pool, not from the private pool into which
            # torch.compile's CUDA graphs route the caller's stream while they warm up (which
            # refuses a tensor that outlives the step). While a graph is captured the resident
            # set stays as it is (choosing it again makes the streamer again, which waits for
            # the device); the next eager decode pass does it.
            self._ensure_policy(policy, decode and not capturing)
            if grouped and self._table_ok and (self._all_resident or decode):
                out = self._experts_device(layer, x, weights, index)
            elif grouped:
                out = self._experts_grouped(layer, x, weights, index, ntok, topk)
            else:
                out = self._experts(layer, self._blocks[layer].module.experts, x, weights,
                                    index, ntok, topk)
        caller.wait_stream(stream)
        out.record_stream(caller)
        return out

    def _not_capturable(self, policy: str, decode: bool, grouped: bool) -> str:
        """Why a pass would not only submit work (so a CUDA graph being captured cannot hold
        it), or "": it must take the device table, with no streamer to make first."""
        if not (grouped and (self._all_resident or (policy == "mapped" and decode))):
            return ("only the grouped experts with every expert resident, or policy 'mapped' "
                    "decoding, run without waiting for the host; this pass copies experts")
        if not self._all_resident and policy != self._streamer_policy:
            return "the streamer must be made for this policy first; run one pass eagerly"
        return ""

    def _route(self, layer: int, x: torch.Tensor, index: torch.Tensor,
               topk: int) -> Tuple[List[int], List[int]]:
        """The layer's per-expert token counts, and the next block's experts as its router
        predicts them from this block's input (most tokens first), in the layer's one
        device-to-host copy and wait."""
        lay = self._layout
        flat = index.reshape(-1)
        # scatter_add_, not bincount: bincount on CUDA waits for the device to size its output.
        both = torch.zeros(2 * lay.experts, dtype=torch.int64, device=x.device)
        both[:lay.experts].scatter_add_(0, flat, torch.ones_like(flat))
        nxt_gate = plan.router_of(self._blocks[layer + 1].module) \
            if self._lookahead and layer + 1 < lay.layers else None
        if nxt_gate is not None:
            # The predictor: the next block's router weights (and bias, gpt-oss's) applied to
            # this block's input (top-k of the logits is top-k of the softmax). A wrong guess
            # costs copies, never results; the router module is not called, so no hook sees it.
            bias = getattr(nxt_gate, "bias", None)
            logits = F.linear(x, nxt_gate.weight, bias if isinstance(bias, torch.Tensor) else None)
            guess = torch.topk(logits, topk, dim=-1).indices.reshape(-1)
            both[lay.experts:].scatter_add_(0, guess, torch.ones_like(guess))
        self._counts.copy_(both, non_blocking=True)
        self._counts_ready.record()
        self._counts_ready.synchronize()               # the layer's one device-to-host wait
        counts = self._counts.tolist()
        predicted = sorted((e for e in range(lay.experts) if counts[lay.experts + e]),
                           key=lambda e: -counts[lay.experts + e])
        counts = counts[:lay.experts]
        base = layer * lay.experts
        for e, n in enumerate(counts):
            self._key_counts[base + e] += n
        self._prefilled = True
        return counts, predicted

    def _experts(self, layer: int, experts: Any, x: torch.Tensor, weights: torch.Tensor,
                 index: torch.Tensor, ntok: int, topk: int) -> torch.Tensor:
        s = self._streamer
        flat = index.reshape(-1)
        rows = torch.argsort(flat, stable=True)        # (token, k) positions, by expert
        tokens = torch.div(rows, topk, rounding_mode="floor")
        counts, predicted = self._route(layer, x, index, topk)
        segs = {e: (start, n) for e, start, n in plan.segments(counts)}
        order = list(s.schedule(layer, list(segs)))
        if self._streamer_policy in ("static", "mapped"):
            # Every copy this layer needs starts now, on the prefetch queue (up to its depth):
            # under the static policy they land in staging slots and never evict a resident
            # expert. Under LRU a prefetch could evict a cached expert this layer still needs,
            # so there the acquires below copy on demand, running ahead of compute.
            s.prefetch(layer, order)
        # One gather for every expert's input rows and routing weights, in expert order, so an
        # expert's inputs and outputs are slices (views) and it costs its own kernels only.
        # Its weighted rows land in the dtype that output has (float32 under Mixtral's float32
        # routing weights, as in transformers) and go back to (token, k) order once, below.
        xs = x[tokens]
        ws = weights.reshape(-1)[rows].unsqueeze(1)
        ys_sorted = torch.empty(ntok * topk, x.shape[1], device=x.device,
                                dtype=torch.promote_types(x.dtype, weights.dtype))
        gate = getattr(experts, "_apply_gate", None)
        act = getattr(experts, "act_fn", None)
        # Transposed experts (gpt-oss) multiply as x @ W and add their biases (on the device).
        tr = self._layout.transposed
        gu_bias = getattr(experts, "gate_up_proj_bias", None) if tr else None
        dn_bias = getattr(experts, "down_proj_bias", None) if tr else None
        # Acquires run ahead of compute (so demand copies overlap the experts before them),
        # at most `window` held at once, fewer than the staging slots.
        window = max(1, self.slots - 1)
        held: Deque[Tuple[int, int]] = collections.deque()
        nxt, busy = 0, -1
        try:
            for e in order:
                while nxt < len(order) and len(held) < window:
                    try:
                        held.append((order[nxt], s.acquire(layer, order[nxt])[0]))
                    except tandem.BusyError:
                        if not held:
                            raise
                        break          # every slot pinned: compute the ones held first
                    nxt += 1
                _, ptr = held.popleft()
                busy = e
                gu, dn = self._slot(ptr)
                start, n = segs[e]
                end = start + n
                if tr:                  # as transformers' GptOssExperts: x @ W + b
                    h = xs[start:end] @ gu + gu_bias[e]
                else:
                    h = F.linear(xs[start:end], gu)
                if gate is not None:
                    h = gate(h)
                else:
                    g, u = h.chunk(2, dim=-1)
                    h = act(g) * u
                y = h @ dn + dn_bias[e] if tr else F.linear(h, dn)
                torch.mul(y, ws[start:end], out=ys_sorted[start:end])
                s.release(layer, e)              # after the expert's last kernel
                busy = -1
        finally:
            for he in [busy] * (busy >= 0) + [he for he, _ in held]:   # only after an error
                s.release(layer, he)
        if predicted:
            s.prefetch(layer + 1, predicted)     # most tokens first
        # The fixed-order combine: one reduction over k, the same shape every time, whatever
        # order the experts ran in (transformers' grouped_mm path sums the same way).
        ys = torch.empty_like(ys_sorted).index_copy_(0, rows, ys_sorted)
        del ys_sorted
        return ys.view(ntok, topk, -1).sum(dim=1).to(x.dtype)


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of t on device, even where t is already there (a view of the pinned
    buffer must not outlive it)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def _make_forward(handle: OffloadHandle, layer: int) -> Any:
    def forward(block: Any, hidden_states: torch.Tensor) -> Any:
        return handle._block_forward(layer, block, hidden_states)
    return forward


# Live handles by id, for the custom op (which takes plain ints): weak, so a handle that is
# never restored is still collected.
_LIVE: "weakref.WeakValueDictionary[int, OffloadHandle]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_OP: Any = None


def _compiling() -> bool:
    comp = getattr(torch, "compiler", None)
    return bool(comp is not None and hasattr(comp, "is_compiling") and comp.is_compiling())


def _experts_op() -> Any:
    """tandem::offloaded_experts(x, weights, index, handle, layer, batch) -> [tokens, H]: a
    block's routed experts as one opaque operator for torch.compile, registered at first use.
    Its fake tensor is x's shape and dtype."""
    global _OP
    if _OP is None:
        @torch.library.custom_op("tandem::offloaded_experts", mutates_args=())
        def offloaded_experts(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                              handle: int, layer: int, batch: int) -> torch.Tensor:
            h = _LIVE.get(handle)
            if h is None:
                raise OffloadError("the offload handle of this compiled model was restored")
            return h._experts_pass(layer, x, weights, index, batch)

        @offloaded_experts.register_fake
        def _(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, handle: int,
              layer: int, batch: int) -> torch.Tensor:
            return torch.empty_like(x)

        _OP = offloaded_experts
    return _OP


def _streamer_type() -> Any:
    st = getattr(tandem, "Streamer", None) or getattr(tandem._tandem, "Streamer", None)
    if st is None:
        raise OffloadError("this tandem build has no Streamer (tandem._tandem.Streamer)")
    return st
