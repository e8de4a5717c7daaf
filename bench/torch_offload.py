#!/usr/bin/env python3
"""bench/torch_offload.py: expert offload of a PyTorch MoE model, tandem against accelerate.

Everything runs in one process on one CUDA GPU. The model is transformers' Qwen3MoeForCausalLM shaped like Qwen3-30B-A3B where it matters for
the experts (hidden 2048, 128 experts of 768, top 8, normalized top-k weights; attention as
that model's: 32 query heads and 4 key/value heads of 128), with 8 layers instead of 48 and a
vocabulary of 4096 so that it builds in seconds. Weights are random bf16 (normal, std 0.02,
norms 1), filled on the GPU from --seed, so every configuration computes with the same weights.

Configurations (--configs):
  resident    the whole model on the GPU
  attention-graph
              decode only: the whole model on the GPU with every MoE block's forward
              returning zeros, a decode step in a CUDA graph as the *-graph configurations:
              the step without its routed experts (the attention, norms, embedding and
              head), which the *-graph rows' times are set against
  accelerate  each layer's experts module on "cpu" through accelerate.dispatch_model with a
              device_map (what transformers' from_pretrained(device_map=...) calls): the
              experts' weights stay in pageable host memory and accelerate's hook copies the
              whole module (every expert) to the GPU before each forward of that layer
  tandem0     tandem.torch.offload_experts(model, budget=0): every routed expert streams
  tandem50    tandem.torch.offload_experts(model, budget="50%")
  tandem100   tandem.torch.offload_experts(model, budget="100%"): every expert resident, the
              routing grouped on the device
  tandem0-torchops, tandem50-torchops
              as tandem0 and tandem50 with grouped=False: the experts computed by PyTorch's
              operators one expert at a time instead of libtandem_moe's grouped operations
  tandem0-mapped, tandem50-mapped
              as tandem0 and tandem50 with policy="mapped" (what "auto" now is where the
              experts are grouped): a fixed resident set (the most routed experts of the
              prefills), and decode reads the other experts where they lie in pinned host
              memory, routing on the device (no copy, no host round trip)
  tandem50-lru
              as tandem50 with policy="lru": decode copies missing experts into an LRU cache
  tandem100-graph, tandem50-graph, tandem0-graph
              decode only (no prefill rows): tandem100, tandem50-mapped and tandem0-mapped
              with transformers' StaticCache, a decode step captured once in a CUDA graph
              (torch.cuda.graph, after one eager step) and replayed for every token
  tandem0-host, tandem0-host-graph, tandem50-host-graph
              as tandem0-mapped, tandem0-graph and tandem50-graph with host_share
              (--host-share, 0.5): that share of the experts not resident computed by the
              host CPU in decode while the GPU reads the others in place. --host-share and
              --host-threads take lists: each -host configuration then runs once for every
              share and pool size (TANDEM_MOE_CPU_THREADS; 0 keeps tandem's default), as
              rows named "<config> s<share> t<threads>"

Measured per configuration: prefill of 1 x T random tokens for each T in --prefill (one
forward, no cache, after a warm-up forward; median of --reps), and decode of --decode tokens
(greedy, one token at a time with the KV cache after a prefix of --decode-prefix tokens; the
first decode step is left out of the timing, since it also moves the offload from the prefill
set to the decode cache). Also, once: the peak of one 1 GiB pinned host-to-device copy (best
of 3). Derived: link fraction = expert bytes copied / wall time / that peak; tandem over
accelerate for prefill and decode; for decode, the hit rate (experts resident when routed) and
the bound the link sets at that hit rate = peak / (routed expert bytes per token x (1 - hit
rate)). --trace-decode FILE writes a torch.profiler trace of one decode step of tandem50 and
prints where its time goes (kernels, copies, both, neither); --trace-prefill FILE does the same
for one prefill of tandem0 (the largest) and prints how long the link sat idle and what the GPU
and the host were doing in its longest idle gaps.

Attention is transformers' SDPA with PyTorch's cuDNN backend switched off (--cudnn-sdpa leaves
it on): on the H200 with torch 2.11 that backend spent about 7.7 ms of host time per layer in
every decode step (a graph built again for each new KV length), which made the all-resident
model decode at 12 tok/s and drowned what this benchmark compares. Every configuration runs the
same attention, so the choice moves every row alike.

It reports figures and never passes or fails on them (the goals are printed beside them).
Exits 77 with a message when PyTorch, transformers or a CUDA GPU is missing; a configuration
whose package (accelerate, tandem.torch) is missing is skipped with a note.

  python bench/torch_offload.py --quick                      # smoke run, well under a minute
  python bench/torch_offload.py --json bench/results/h200-torch-offload.json \\
      --trace-decode bench/results/h200-torch-offload-trace.json
"""
import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types

from benchinfo import commit, utc_now, write_json

SKIP = 77
CONFIGS = ("resident", "attention-graph", "accelerate", "tandem0", "tandem50", "tandem100",
           "tandem0-torchops", "tandem50-torchops", "tandem0-mapped", "tandem50-mapped",
           "tandem50-lru", "tandem100-graph", "tandem50-graph", "tandem0-graph", "tandem0-host",
           "tandem0-host-graph", "tandem50-host-graph")
# tandem's configurations: (budget, grouped, policy, decode in a CUDA graph[, host placement])
TANDEM = {"tandem0": (0, None, "auto", False), "tandem50": ("50%", None, "auto", False),
          "tandem100": ("100%", None, "auto", False),
          "tandem0-torchops": (0, False, "auto", False),
          "tandem50-torchops": ("50%", False, "auto", False),
          "tandem0-mapped": (0, None, "mapped", False),
          "tandem50-mapped": ("50%", None, "mapped", False),
          "tandem50-lru": ("50%", None, "lru", False),
          "tandem100-graph": ("100%", None, "auto", True),
          "tandem50-graph": ("50%", None, "mapped", True),
          "tandem0-graph": (0, None, "mapped", True),
          "tandem0-host": (0, None, "mapped", False, True),
          "tandem0-host-graph": (0, None, "mapped", True, True),
          "tandem50-host-graph": ("50%", None, "mapped", True, True)}
PEAK_BYTES = 1 << 30
GOALS = {"prefill_link_fraction": 0.85, "prefill_vs_accelerate": 8.0, "decode_vs_accelerate": 20.0}


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text):
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--expert-size", type=int, default=768, help="an expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prefill", type=int_list, default=[512, 2048], help="token counts, e.g. 512,2048")
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded")
    ap.add_argument("--decode-prefix", type=int, default=64, help="prompt tokens before decode")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="any of " + ",".join(CONFIGS))
    ap.add_argument("--reps", type=int, default=3, help="timed prefill forwards (median)")
    ap.add_argument("--slots", type=int, default=16, help="tandem's staging slots")
    ap.add_argument("--host-share", type=float_list, default=[0.5],
                    help="the -host configurations' host_share: the share of the experts not "
                         "resident that the host CPU computes in decode (a list sweeps it)")
    ap.add_argument("--host-threads", type=int_list, default=[0],
                    help="the -host configurations' CPU pool size (TANDEM_MOE_CPU_THREADS; 0: "
                         "tandem's default, the cores less 4; a list sweeps it)")
    ap.add_argument("--quick", action="store_true",
                    help="a small model and few tokens (a smoke run; overrides the sizes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--trace-decode", default=None, metavar="FILE",
                    help="torch.profiler trace of one decode step of tandem50, and its breakdown")
    ap.add_argument("--trace-prefill", default=None, metavar="FILE",
                    help="torch.profiler trace of one prefill (the largest) of tandem0, with the "
                         "link's idle gaps")
    ap.add_argument("--cudnn-sdpa", action="store_true",
                    help="leave PyTorch's cuDNN attention on (off by default: it rebuilds its "
                         "graph for every new KV length, milliseconds of host time per layer "
                         "and decode step, the same in every configuration)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.experts, args.expert_size, args.top_k = 4, 512, 16, 256, 4
        args.prefill, args.decode, args.decode_prefix, args.reps = [64, 256], 8, 16, 1
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; known: {', '.join(CONFIGS)}")
    if args.decode < 2:
        ap.error("--decode must be at least 2 (the first step is not timed)")
    if not args.host_share or any(not 0 <= x <= 1 for x in args.host_share):
        ap.error("--host-share: shares in [0, 1]")
    if not args.host_threads or any(x < 0 for x in args.host_threads):
        ap.error("--host-threads: counts of at least 0")
    return args


def runs(a):
    """(row name, configuration, host share, CPU pool size) for every row, in order: a -host
    configuration once for each share and pool size (its own name when there is one of each)."""
    out = []
    for name in a.configs:
        if "-host" not in name:
            out.append((name, name, 0.0, 0))
            continue
        one = len(a.host_share) == 1 and len(a.host_threads) == 1
        for share in a.host_share:
            for threads in a.host_threads:
                label = name if one else f"{name} s{share:g} t{threads}"
                out.append((label, name, share, threads))
    return out


def skip(msg):
    print(f"torch_offload: skipped ({msg})")
    sys.exit(SKIP)


# ---- the model ---------------------------------------------------------------------------

def make_config(transformers, a):
    # Attention as Qwen3-30B-A3B's at hidden 2048 (32 heads, 4 KV heads, head_dim 128): one
    # query head per 64 of hidden, one KV head per 8 query heads.
    heads = max(1, a.hidden // 64)
    return transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), head_dim=128,
        moe_intermediate_size=a.expert_size, num_experts=a.experts,
        num_experts_per_tok=a.top_k, norm_topk_prob=True, max_position_embeddings=8192,
        tie_word_embeddings=False)


def build_model(torch, transformers, cfg, seed, device):
    """The model in bf16 on `device`, built without transformers' or torch's weight init (it
    is overwritten at once), then filled from `seed` in module order, so every call gives the
    same weights."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:                               # older transformers: the slow init
        import contextlib
        no_init_weights = contextlib.nullcontext
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), no_init_weights():
            model = transformers.Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def expert_modules(model):
    return [layer.mlp.experts for layer in model.model.layers]


def free(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- configurations ----------------------------------------------------------------------

class Setup:
    """A configuration's model plus what it knows about its copies: `handle` (tandem's) or
    `bytes_per_forward` (accelerate copies every expert of every layer each forward)."""

    def __init__(self, model, handle=None, bytes_per_forward=0, note="", graph=False):
        self.model, self.handle, self.bytes_per_forward, self.note = \
            model, handle, bytes_per_forward, note
        self.graph = graph

    def reset(self):
        if self.handle is not None:
            self.handle.reset_stats()

    def copied(self, forwards):
        if self.handle is not None:
            return self.handle.stats()["bytes_copied"]
        return self.bytes_per_forward * forwards


def setup_resident(torch, transformers, cfg, a):
    return Setup(build_model(torch, transformers, cfg, a.seed, a.device))


def setup_attention(torch, transformers, cfg, a):
    model = build_model(torch, transformers, cfg, a.seed, a.device)
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(lambda block, h: torch.zeros_like(h), layer.mlp)
    return Setup(model, note="every MoE block's forward returns zeros; decode in a CUDA graph",
                 graph=True)


def setup_accelerate(torch, transformers, cfg, a):
    try:
        import accelerate
    except ImportError:
        return None, "accelerate is not installed"
    model = build_model(torch, transformers, cfg, a.seed, a.device)
    # dispatch_model takes the weights of "cpu" modules from where they are, so they move to
    # host memory first (plain pageable tensors, as from_pretrained leaves them).
    for ex in expert_modules(model):
        ex.to("cpu")
    free(torch)
    gpu = torch.device(a.device).index or 0
    dmap = {"model.embed_tokens": gpu, "model.norm": gpu, "model.rotary_emb": gpu, "lm_head": gpu}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
            dmap[f"{p}.{part}"] = gpu
        dmap[f"{p}.mlp.experts"] = "cpu"
    accelerate.dispatch_model(model, device_map=dmap,
                              skip_keys=getattr(model, "_skip_keys_device_placement", None))
    per_forward = cfg.num_hidden_layers * cfg.num_experts * expert_bytes(cfg)
    return Setup(model, bytes_per_forward=per_forward,
                 note=f"accelerate {accelerate.__version__}, dispatch_model, experts on cpu"), None


def setup_tandem(torch, transformers, cfg, a, budget, grouped, policy, graph, host=False,
                 share=0.0):
    try:
        import tandem
        import tandem.torch as tt
    except ImportError as e:
        return None, f"tandem.torch is not importable ({e})"
    if getattr(tandem._tandem, "Streamer", None) is None:
        return None, "this tandem build has no Streamer"
    model = build_model(torch, transformers, cfg, a.seed, a.device)
    share = share if host else 0.0
    handle = tt.offload_experts(model, budget=budget, slots=a.slots, device=a.device,
                                grouped=grouped, policy=policy, host_share=share)
    free(torch)
    path = "grouped operations" if handle.stats().get("grouped") else "PyTorch per expert"
    return Setup(model, handle=handle, note=f"budget {budget!r} = {handle.budget_bytes} bytes, "
                 f"{a.slots} slots, {path}, policy {policy!r}"
                 + (f", host_share {share}" if host else "")
                 + (", decode in a CUDA graph" if graph else ""), graph=graph), None


def expert_bytes(cfg):
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2      # gate, up, down in bf16


# ---- measurements ------------------------------------------------------------------------

def link_peak(torch, device):
    """Bytes/s of one 1 GiB pinned host-to-device copy, best of three."""
    src = torch.empty(PEAK_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(PEAK_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        dst.copy_(src, non_blocking=True)
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1) / 1e3)
    del src, dst
    return PEAK_BYTES / best


def timed(torch, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def tokens(torch, cfg, n, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (1, n), generator=g).to(device)


def measure_prefill(torch, s, cfg, a, peak, trace=None):
    rows = []
    for t in a.prefill:
        ids = tokens(torch, cfg, t, a.seed + t, a.device)
        with torch.no_grad():
            s.model(ids, use_cache=False)                          # warm-up
            walls, copied = [], []
            for _ in range(a.reps):
                s.reset()
                w, _ = timed(torch, lambda: s.model(ids, use_cache=False))
                walls.append(w)
                copied.append(s.copied(1))
        i = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]   # the median
        r = {"tokens": t, "wall_s": walls[i], "tokens_per_s": t / walls[i],
             "walls_s": walls, "expert_bytes_copied": copied[i]}
        if copied[i]:
            r["link_fraction"] = copied[i] / walls[i] / peak
        if s.handle is not None:
            r["stats"] = s.handle.stats()
        rows.append(r)
        if trace is not None and t == max(a.prefill):
            try:
                with torch.no_grad():
                    trace["breakdown"] = traced(torch, "prefill", trace["file"],
                                                lambda: s.model(ids, use_cache=False))
                trace["breakdown"]["tokens"] = t
            except Exception as e:                  # noqa: BLE001 - reported in the output
                traceback.print_exc()
                trace["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    return rows


def timed_steps(torch, s, n, step):
    """The walls of n calls of step() (a decode step and its argmax), the first left out and
    the stats reset after it (it also moves the offload from the prefill set to decode)."""
    walls = []
    for i in range(n):
        if i == 1:
            s.reset()
        w, _ = timed(torch, step)
        if i >= 1:
            walls.append(w)
    return walls


def decode_steps(torch, s, cfg, a, trace=None):
    """Greedy decode of a.decode tokens after a prefix; returns the per-step walls (first
    step excluded) and the stats over those steps."""
    ids = tokens(torch, cfg, a.decode_prefix, a.seed + 1, a.device)
    with torch.no_grad():
        out = s.model(ids, use_cache=True)
        state = {"past": out.past_key_values, "nxt": out.logits[:, -1:].argmax(-1)}

        def step():
            o = s.model(state["nxt"], past_key_values=state["past"], use_cache=True)
            state["past"], state["nxt"] = o.past_key_values, o.logits[:, -1:].argmax(-1)
        walls = timed_steps(torch, s, a.decode, step)
        nxt, past = state["nxt"], state["past"]
        st = s.handle.stats() if s.handle is not None else None
        if trace is not None:
            # A profiler that cannot start (no CUPTI, say) costs the breakdown, not the figures.
            try:
                trace["breakdown"] = trace_step(torch, s, nxt, past, trace["file"])
            except Exception as e:                  # noqa: BLE001 - reported in the output
                traceback.print_exc()
                trace["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    return walls, st


def decode_steps_graph(torch, transformers, s, cfg, a):
    """As decode_steps, with transformers' StaticCache and one CUDA graph of a decode step:
    after the prefix, one eager step on a side stream (which settles the offload's resident
    set), then the capture; every timed step is the mask's update, a replay, the argmax and
    the position's increment. The first replay recomputes the eager step's position. The
    attention mask is as long as the cache (ones where a token is, updated in place), so SDPA
    never attends to the cache's empty slots and the graph reads each step's; a step's is 4-D
    (one query against the cache), which transformers hands to SDPA as it is, where a 2-D one
    is expanded by code that takes another path while a stream is captured."""
    dev = torch.device(a.device)
    ids = tokens(torch, cfg, a.decode_prefix, a.seed + 1, a.device)
    length = a.decode_prefix + a.decode + 2
    cache = transformers.StaticCache(config=cfg, max_cache_len=length)
    mask = torch.zeros(1, length, dtype=torch.long, device=dev)
    mask[:, :a.decode_prefix] = 1
    with torch.no_grad():
        out = s.model(ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(a.decode_prefix, device=dev))
        sid = out.logits[:, -1:].argmax(-1)
        pos = torch.tensor([a.decode_prefix], device=dev)
        mask = mask.bool().view(1, 1, 1, length)
        mask.index_fill_(3, pos, True)

        def forward():
            return s.model(sid, attention_mask=mask, past_key_values=cache, cache_position=pos,
                           use_cache=True).logits
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = forward()

        def step():
            mask.index_fill_(3, pos, True)
            graph.replay()
            sid.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)
        walls = timed_steps(torch, s, a.decode, step)
        st = s.handle.stats() if s.handle is not None else None
    return walls, st


def measure_decode(torch, s, cfg, a, peak, trace=None, transformers=None):
    if s.graph:
        walls, st = decode_steps_graph(torch, transformers, s, cfg, a)
    else:
        walls, st = decode_steps(torch, s, cfg, a, trace)
    n = len(walls)
    moved = st["bytes_copied"] + st.get("bytes_read_in_place", 0) if st else 0
    r = {"tokens": a.decode, "timed_tokens": n, "prefix": a.decode_prefix,
         "tokens_per_s": n / sum(walls), "ms_per_token_median": statistics.median(walls) * 1e3,
         "expert_bytes_copied_per_token": (moved / n if st else s.bytes_per_forward)}
    if st:
        r["expert_bytes_read_in_place_per_token"] = st.get("bytes_read_in_place", 0) / n
        # host placement: the experts' bytes the host CPU read a token (one read a pair)
        r["expert_bytes_on_host_per_token"] = st.get("host_computed_pairs", 0) * \
            expert_bytes(cfg) / n
    if st:
        routed = cfg.num_hidden_layers * cfg.num_experts_per_tok * expert_bytes(cfg)
        miss = 1.0 - st["hit_rate"]
        r.update(hit_rate=st["hit_rate"], routed_expert_bytes_per_token=routed,
                 link_bound_tokens_per_s=(peak / (routed * miss)) if miss > 0 else None,
                 stats=st)
    if r["expert_bytes_copied_per_token"]:
        r["link_fraction"] = r["expert_bytes_copied_per_token"] * r["tokens_per_s"] / peak
    return r


# ---- the host pass alone ------------------------------------------------------------------

PROBE_EXPERTS = (4, 8)        # host experts a layer, one token


def host_probe(torch, s, cfg, device, reps=3):
    """The host's side of a -host row alone, in this process, after its decode: every layer's
    host pass on n distinct experts of one token (n in PROBE_EXPERTS, other experts each rep),
    run two ways with the GPU otherwise idle: "direct", group() and experts() of the CPU table
    called from Python and its queue synced, a layer at a time; and "host_call", the layer's
    pass queued on the second stream after a copy of its routing, as decode queues it, the
    stream synced once after all layers. Figures: expert weights read per second (best of
    reps). Tells the host's own rate from what the pass's place in decode costs it."""
    hx = getattr(s.handle, "_hostx", None)
    k, L, E = cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.num_experts
    b = hx._bufs.get((1, k)) if hx is not None else None
    if b is None:
        return {"error": "no host pass of one token was made"}
    import tandem
    from tandem import _offload as plan
    H, I, eb = cfg.hidden_size, cfg.moe_intermediate_size, expert_bytes(cfg)
    G, wsb = min(E, k), tandem.MoeOps.workspace_bytes(k, H, I)
    b.x.copy_(torch.randn(1, H))
    out = {"expert_bytes": eb, "reps": reps}
    for n in PROBE_EXPERTS:
        if n > k:
            continue
        def routing(rep, layer):
            first = ((rep * L + layer) * n) % max(1, E - n + 1)
            return list(range(first, first + n)) + [-1] * (k - n)
        best_d = best_c = None
        for rep in range(reps):
            t0 = time.perf_counter()
            for layer in range(L):
                b.idx.view(-1).copy_(torch.tensor(routing(rep, layer), dtype=torch.int32))
                hx._ops.group(b.idx.data_ptr(), 1, k, E, hx._wofs[layer].data_ptr(),
                              b.rows.data_ptr(), b.slot.data_ptr(), b.groups.data_ptr())
                hx._ops.experts(b.x.data_ptr(), b.rows.data_ptr(), b.slot.data_ptr(), k,
                                plan.ANYWHERE, b.groups.data_ptr(), G, H, I, b.out.data_ptr(),
                                b.ws.data_ptr(), wsb)
                hx._queue.synchronize()
            d = time.perf_counter() - t0
            best_d = d if best_d is None else min(best_d, d)
            dev = torch.tensor([routing(rep + reps, layer) for layer in range(L)],
                               dtype=torch.int32, device=device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(hx._side):
                for layer in range(L):
                    b.idx.view(-1).copy_(dev[layer], non_blocking=True)
                    hx._side_ops.host_call(hx._ops, b.passes[layer])
            hx._side.synchronize()
            c = time.perf_counter() - t0
            best_c = c if best_c is None else min(best_c, c)
        moved = L * n * eb
        out[str(n)] = {"direct_gbs": moved / best_d / 1e9, "host_call_gbs": moved / best_c / 1e9,
                       "direct_ms_per_layer": best_d / L * 1e3,
                       "host_call_ms_per_layer": best_c / L * 1e3}
    hx.check()
    return out


# ---- the trace of one decode step --------------------------------------------------------

def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def clip(ivs, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in ivs if b > lo and a < hi]


def trace_step(torch, s, nxt, past, path):
    """One more decode step under torch.profiler; writes the Chrome trace to `path` and returns
    the step's wall time split by what the GPU did: kernels only, copies only, both at once,
    neither (the GPU waits for the host: Python, routing, launches, syncs)."""
    return traced(torch, "decode_step", path,
                  lambda: s.model(nxt, past_key_values=past, use_cache=True))


def traced(torch, label, path, fn):
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        with record_function(label):
            fn()
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return breakdown(json.load(f), path, label)


def gaps(busy, lo, hi, min_us):
    """The intervals of [lo, hi] that no interval of `busy` covers, min_us or longer."""
    out, at = [], lo
    for a, b in sorted(busy):
        if a > at and a - at >= min_us:
            out.append((at, a))
        at = max(at, b)
    if hi - at >= min_us:
        out.append((at, hi))
    return out


def during(evs, a, b, top=3):
    """The names of the events that overlap [a, b] most, with the overlap in us."""
    over = {}
    for e in evs:
        o = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
        if o > 0:
            name = e.get("name", "?")[:48]
            over[name] = over.get(name, 0.0) + o
    return [f"{n} ({us:.0f} us)" for n, us in sorted(over.items(), key=lambda kv: -kv[1])[:top]]


def breakdown(doc, path, label="decode_step"):
    """traced()'s figures from a Chrome trace as torch.profiler writes it (times in us): the
    wall split by what the GPU did, and the link's idle gaps of 50 us or more with what the
    GPU's kernels and the host's CUDA calls were doing in the longest ones."""
    evs = [e for e in (doc.get("traceEvents") if isinstance(doc, dict) else doc) or []
           if e.get("ph") == "X" and "dur" in e]
    step = [e for e in evs if e.get("name") == label and e.get("cat") == "user_annotation"]
    if not step:
        return {"error": f"no {label} annotation in the trace"}
    lo, hi = step[0]["ts"], step[0]["ts"] + step[0]["dur"]
    kev = [e for e in evs if e.get("cat") == "kernel"]
    kern = clip([(e["ts"], e["ts"] + e["dur"]) for e in kev], lo, hi)
    cps = [e for e in evs if e.get("cat") == "gpu_memcpy"]
    copy = clip([(e["ts"], e["ts"] + e["dur"]) for e in cps], lo, hi)
    h2d = [e for e in cps if "HtoD" in e.get("name", "")]
    link = clip([(e["ts"], e["ts"] + e["dur"]) for e in h2d], lo, hi)
    wall, k, c, kc = hi - lo, union(kern), union(copy), union(kern + copy)
    launch = [e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    idle = gaps(link, lo, hi, 50.0)
    longest = sorted(idle, key=lambda g: g[0] - g[1])[:8]
    return {
        "label": label,
        "wall_us": wall, "kernels_us": k, "copies_us": c, "both_us": k + c - kc,
        "kernels_only_us": kc - c, "copies_only_us": kc - k, "gpu_idle_us": wall - kc,
        "kernels": len(kern), "copies": len(copy), "h2d_copies": len(h2d),
        "h2d_bytes": sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in h2d),
        "link_busy_us": union(link),
        "link_first_us": min((a for a, _ in link), default=hi) - lo,
        "link_last_us": hi - max((b for _, b in link), default=lo),
        "link_gaps": len(idle), "link_gaps_us": sum(b - a for a, b in idle),
        "link_longest_gaps": [{"at_us": a - lo, "us": b - a, "kernels": during(kev, a, b),
                               "host": during(launch, a, b)} for a, b in longest],
        "cuda_api_calls": len(launch),
        "cuda_api_us": union(clip([(e["ts"], e["ts"] + e["dur"]) for e in launch], lo, hi)),
        "trace": path,
    }


# ---- the run -----------------------------------------------------------------------------

def run_config(row, torch, transformers, cfg, a, peak, doc):
    """One row's figures (row: an entry of runs()); an error in it is reported (with its
    traceback) and the other rows still run."""
    label, name, share, threads = row
    key, before = "TANDEM_MOE_CPU_THREADS", os.environ.get("TANDEM_MOE_CPU_THREADS")
    if threads:                       # read when the process's CPU pool starts (a -host setup)
        os.environ[key] = str(threads)
    try:
        r = measure_config(name, torch, transformers, cfg, a, peak, doc, share)
    except Exception as e:                          # noqa: BLE001 - reported, not hidden
        traceback.print_exc()
        print(f"{label}: FAILED ({type(e).__name__}: {e})")
        free(torch)
        r = {"config": name, "error": f"{type(e).__name__}: {e}"}
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    r.update(config=label, base=name)
    if "-host" in name:
        r.update(host_share=share, cpu_threads=threads or None)
    return r


def measure_config(name, torch, transformers, cfg, a, peak, doc, share=0.0):
    t0 = time.perf_counter()
    if name == "resident":
        s, why = setup_resident(torch, transformers, cfg, a), None
    elif name == "attention-graph":
        s, why = setup_attention(torch, transformers, cfg, a), None
    elif name == "accelerate":
        s, why = setup_accelerate(torch, transformers, cfg, a)
    else:
        s, why = setup_tandem(torch, transformers, cfg, a, *TANDEM[name], share=share)
    if s is None:
        print(f"{name}: skipped ({why})")
        return {"config": name, "skipped": why}
    build_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(a.device)    # the peak while it runs, not while built
    res = {"config": name, "note": s.note, "build_s": build_s}
    try:
        # A trace of one prefill of tandem0 and of one decode step of tandem50, when asked.
        ptrace = {"file": a.trace_prefill} if a.trace_prefill and name == "tandem0" else None
        dtrace = {"file": a.trace_decode} if a.trace_decode and name == "tandem50" else None
        # A graph configuration's prefill is its eager twin's: not measured again.
        res["prefill"] = [] if s.graph else measure_prefill(torch, s, cfg, a, peak, ptrace)
        res["decode"] = measure_decode(torch, s, cfg, a, peak, dtrace, transformers)
        if "-host" in name:
            res["host_probe"] = host_probe(torch, s, cfg, a.device)
        for key, t in (("trace_prefill", ptrace), ("trace_decode", dtrace)):
            if t is not None:
                doc[key] = t["breakdown"]
    finally:
        # restore() frees the streamer and the pinned buffer now, not whenever the cycle
        # between the handle and the blocks it patched is collected.
        if s.handle is not None:
            s.handle.restore()
        res["gpu_mem_peak_bytes"] = torch.cuda.max_memory_allocated(a.device)
        del s
        free(torch)
    return res


def derive(results):
    by = {r["config"]: r for r in results if "prefill" in r}
    d = {}
    acc = by.get("accelerate")
    def ratios(t, u):
        return {"prefill": {str(p["tokens"]): p["tokens_per_s"] / q["tokens_per_s"]
                            for p, q in zip(t["prefill"], u["prefill"])},
                "decode": t["decode"]["tokens_per_s"] / u["decode"]["tokens_per_s"]}

    for label, t in by.items():
        name = t.get("base", label)            # the configuration; label its row
        if name not in TANDEM or name.endswith("-torchops"):
            continue
        tail = label[len(name):]               # a -host row's " s<share> t<threads>"
        d[label] = dv = {}
        if acc is not None and t["prefill"]:
            r = ratios(t, acc)
            dv["prefill_vs_accelerate"] = r["prefill"]
            dv["decode_vs_accelerate"] = r["decode"]
        if "resident" in by:          # against transformers' own all-resident model
            dv["decode_vs_resident"] = ratios(t, by["resident"])["decode"]
        ops = by.get(name + "-torchops")
        if ops is not None:           # libtandem_moe's grouped operations, over PyTorch's
            dv["grouped_vs_torchops"] = ratios(t, ops)
        base = name.rsplit("-", 1)[0]
        if name.endswith("-mapped") and base + "-lru" in by:   # in place over LRU's copies
            dv["decode_vs_" + base + "-lru"] = ratios(t, by[base + "-lru"])["decode"]
        if name.endswith("-graph"):   # the graph over the same handle decoding eagerly
            eager = base if base in ("tandem100", "tandem0-host") else base + "-mapped"
            eager += tail if "-host" in eager else ""
            if eager in by:
                dv["decode_vs_" + eager] = ratios(t, by[eager])["decode"]
        att = by.get("attention-graph")
        if name.endswith("-graph") and att is not None:   # the experts' share of a step
            dv["ms_over_attention_graph"] = t["decode"]["ms_per_token_median"] - \
                att["decode"]["ms_per_token_median"]
        if "-host" in name:           # host placement over the link alone
            twin = name.replace("-host", "") if name.endswith("-graph") else base + "-mapped"
            if twin in by:
                dv["decode_vs_" + twin] = ratios(t, by[twin])["decode"]
    return d


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def report(results, derived, peak, trace, ptrace=None):
    lines = [f"link peak (one {PEAK_BYTES >> 30} GiB pinned H2D copy, best of 3): "
             f"{peak / 1e9:.1f} GB/s", ""]
    w = max([17] + [len(r["config"]) for r in results])       # the config column
    lines.append(f"{'config':<{w}} {'phase':<13} {'tok/s':>10} {'ms':>9} {'GB moved':>10} "
                 f"{'link frac':>9} {'hit rate':>8} {'link bound':>10} {'x accel':>8}")
    for r in results:
        if "prefill" not in r:
            what = "skipped" if "skipped" in r else "FAILED"
            lines.append(f"{r['config']:<{w}} {what}: {r.get('skipped') or r.get('error')}")
            continue
        dv = derived.get(r["config"], {})
        for p in r["prefill"]:
            x = dv.get("prefill_vs_accelerate", {}).get(str(p["tokens"]))
            lines.append(f"{r['config']:<{w}} {'prefill ' + str(p['tokens']):<13} "
                         f"{p['tokens_per_s']:>10.1f} {p['wall_s'] * 1e3:>9.1f} "
                         f"{p['expert_bytes_copied'] / 1e9:>10.2f} "
                         f"{fmt(p.get('link_fraction')):>9} "
                         f"{fmt(p.get('stats', {}).get('hit_rate')):>8} {'':>10} {fmt(x):>8}")
        q = r["decode"]
        lines.append(f"{r['config']:<{w}} {'decode ' + str(q['tokens']):<13} "
                     f"{q['tokens_per_s']:>10.2f} {q['ms_per_token_median']:>9.2f} "
                     f"{q['expert_bytes_copied_per_token'] / 1e9:>10.3f} "
                     f"{fmt(q.get('link_fraction')):>9} {fmt(q.get('hit_rate')):>8} "
                     f"{fmt(q.get('link_bound_tokens_per_s'), '.1f'):>10} "
                     f"{fmt(dv.get('decode_vs_accelerate')):>8}")
    for r in results:
        hp = r.get("host_probe") or {}
        for n in PROBE_EXPERTS:
            q = hp.get(str(n))
            if q:
                lines.append(f"{r['config']:<{w}} host pass alone, {n} experts a layer: direct "
                             f"{q['direct_gbs']:.1f} GB/s ({q['direct_ms_per_layer']:.2f} ms a "
                             f"layer), host_call {q['host_call_gbs']:.1f} GB/s "
                             f"({q['host_call_ms_per_layer']:.2f} ms)")
        if hp.get("error"):
            lines.append(f"{r['config']:<{w}} host pass alone: {hp['error']}")
    lines.append("(decode: tok/s after the first token, ms = median per token, GB per token "
                 "copied or read in place; "
                 "link bound = peak / (routed expert bytes per token x (1 - hit rate)) tok/s)")
    for name, dv in derived.items():
        g = dv.get("grouped_vs_torchops")
        if g:
            pre = ", ".join(f"{t}: {fmt(v)}x" for t, v in g["prefill"].items())
            lines.append(f"{name}: grouped operations over PyTorch's per expert: prefill {pre}; "
                         f"decode {fmt(g['decode'])}x")
        if "decode_vs_resident" in dv:
            lines.append(f"{name}: decode over transformers' all-resident model: "
                         f"{fmt(dv['decode_vs_resident'])}x")
        for k, v in dv.items():
            if k.startswith("decode_vs_tandem"):
                lines.append(f"{name}: decode over {k[len('decode_vs_'):]}: {fmt(v)}x")
    if trace and "wall_us" in trace:
        w = trace["wall_us"] or 1.0
        lines.append("")
        lines.append(f"one tandem50 decode step ({trace['trace']}): {w / 1e3:.2f} ms wall; GPU "
                     f"kernels only {trace['kernels_only_us'] / w:.0%}, copies only "
                     f"{trace['copies_only_us'] / w:.0%}, both {trace['both_us'] / w:.0%}, idle "
                     f"(host-bound) {trace['gpu_idle_us'] / w:.0%}; {trace['kernels']} kernels, "
                     f"{trace['h2d_copies']} H2D copies ({trace['h2d_bytes'] / 1e6:.1f} MB), "
                     f"{trace['cuda_api_calls']} CUDA API calls "
                     f"({trace['cuda_api_us'] / 1e3:.2f} ms)")
    elif trace:
        lines.append(f"trace: {trace.get('error')}")
    if ptrace and "wall_us" in ptrace:
        w = ptrace["wall_us"] or 1.0
        lines.append("")
        lines.append(f"one tandem0 prefill of {ptrace.get('tokens')} ({ptrace['trace']}): "
                     f"{w / 1e3:.2f} ms wall; link busy {ptrace['link_busy_us'] / w:.0%} "
                     f"({ptrace['h2d_copies']} H2D copies, {ptrace['h2d_bytes'] / 1e9:.2f} GB); "
                     f"before the first copy {ptrace['link_first_us'] / 1e3:.2f} ms, after the "
                     f"last {ptrace['link_last_us'] / 1e3:.2f} ms; {ptrace['link_gaps']} gaps "
                     f">= 50 us, {ptrace['link_gaps_us'] / 1e3:.2f} ms in all")
        for g in ptrace["link_longest_gaps"]:
            lines.append(f"  gap at {g['at_us'] / 1e3:7.2f} ms, {g['us']:7.0f} us: kernels "
                         f"{'; '.join(g['kernels']) or 'none'} | host "
                         f"{'; '.join(g['host']) or 'no CUDA call'}")
    elif ptrace:
        lines.append(f"prefill trace: {ptrace.get('error')}")
    return "\n".join(lines)


def summary(results, derived):
    """One line for scripts/gpu-check's summary table."""
    by = {r["config"]: r for r in results if "prefill" in r}
    parts = []
    t0, t50 = by.get("tandem0"), by.get("tandem50")
    if t0:
        p = t0["prefill"][-1]
        x = derived.get("tandem0", {}).get("prefill_vs_accelerate", {}).get(str(p["tokens"]))
        parts.append(f"prefill {p['tokens']} at budget 0: link {fmt(p.get('link_fraction'))} "
                     f"(goal >= {GOALS['prefill_link_fraction']}), {fmt(x, '.1f')}x accelerate "
                     f"(goal >= {GOALS['prefill_vs_accelerate']:g}x)")
    if t50:
        q = t50["decode"]
        x = derived.get("tandem50", {}).get("decode_vs_accelerate")
        parts.append(f"decode at 50%: {q['tokens_per_s']:.1f} tok/s, {fmt(x, '.1f')}x accelerate "
                     f"(goal >= {GOALS['decode_vs_accelerate']:g}x), hit rate "
                     f"{fmt(q.get('hit_rate'))}, link bound "
                     f"{fmt(q.get('link_bound_tokens_per_s'), '.1f')} tok/s")
        g = derived.get("tandem50", {}).get("grouped_vs_torchops")
        if g:
            parts.append(f"grouped over per-expert decode at 50%: {fmt(g['decode'])}x")
    return "; ".join(parts) or "no tandem figures"


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed")
    try:
        import transformers
    except ImportError:
        skip("transformers is not installed")
    if not torch.cuda.is_available():
        skip("PyTorch sees no CUDA GPU")
    if not hasattr(transformers, "Qwen3MoeConfig"):
        skip(f"transformers {transformers.__version__} has no Qwen3MoeConfig")
    torch.cuda.set_device(torch.device(a.device))
    if not a.cudnn_sdpa and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    cfg = make_config(transformers, a)
    eb = expert_bytes(cfg)
    model_desc = {
        "class": "Qwen3MoeForCausalLM", "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size, "experts": cfg.num_experts, "expert_size": a.expert_size,
        "top_k": cfg.num_experts_per_tok, "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size,
        "dtype": "bfloat16", "expert_bytes": eb,
        "experts_total_bytes": eb * cfg.num_experts * cfg.num_hidden_layers,
        "experts_implementation": "transformers' default",
        "attention": "sdpa" + ("" if a.cudnn_sdpa else ", cuDNN backend off"),
    }
    print(f"model: {model_desc['layers']} layers, hidden {cfg.hidden_size}, {cfg.num_experts} "
          f"experts of {a.expert_size} (top {cfg.num_experts_per_tok}), "
          f"{model_desc['experts_total_bytes'] / 1e9:.2f} GB of experts; "
          f"{torch.cuda.get_device_name(a.device)}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    peak = link_peak(torch, a.device)
    doc = {}
    results = []
    for row in runs(a):
        print(f"-- {row[0]}", flush=True)
        results.append(run_config(row, torch, transformers, cfg, a, peak, doc))
    derived = derive(results)
    print()
    print(report(results, derived, peak, doc.get("trace_decode"), doc.get("trace_prefill")))
    line = summary(results, derived)
    print()
    print("summary: " + line)
    if a.json:
        try:
            import accelerate
            acc_v = accelerate.__version__
        except ImportError:
            acc_v = None
        try:
            import tandem
            tdm_v = tandem.__version__
        except ImportError:
            tdm_v = None
        out = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "commit": commit(),
            "device": {"id": a.device, "name": torch.cuda.get_device_name(a.device)},
            "date": utc_now(),
            "python": platform.python_version(),
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                         "transformers": transformers.__version__, "accelerate": acc_v,
                         "tandem": tdm_v},
            "machine": {"hostname": platform.node(), "cores": os.cpu_count()},
            "options": {k: v for k, v in vars(a).items() if k != "json"},
            "model": model_desc,
            "link_peak_bytes_per_s": peak,
            "goals": GOALS,
            "results": results,
            "derived": derived,
            "trace_decode": doc.get("trace_decode"),
            "trace_prefill": doc.get("trace_prefill"),
            "summary": line,
        }
        write_json(a.json, out)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
