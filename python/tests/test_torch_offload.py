"""tandem.torch.offload_experts on transformers' real Qwen3-MoE and Mixtral classes (run by
scripts/gpu-check; skipped without PyTorch, transformers, a GPU or tandem.Streamer): tiny
random-weight models, whose offloaded logits must be bitwise equal to the all-resident run for
every budget and policy and close to transformers' own forward, on both paths (libtandem_moe's
grouped operations, and PyTorch's operators per expert); greedy generation token for
token, policy "mapped" (decode reading host-placed experts in place) included; a decode step
captured in a CUDA graph and replayed, equal to the eager steps; stats; and errors
(unsupported block, too little device memory) that leave the model unchanged. The torch-free
parts are tested everywhere by test_offload_plan.py."""
import pytest

import tandem
from gpu import need_torch

BUDGETS = [0, "25%", "50%", "100%"]
ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
POLICIES = ["static", "lru", "auto"]


@pytest.fixture(scope="module")
def env():
    torch, dev = need_torch()
    transformers = pytest.importorskip("transformers")
    if getattr(tandem, "Streamer", None) is None and \
            getattr(tandem._tandem, "Streamer", None) is None:
        pytest.skip("this tandem build has no Streamer")
    import tandem.torch as tt
    return torch, transformers, tt


def tiny(transformers, torch, arch, layers=3, seed=0, attn="eager"):
    """A random-weight model small enough to run in well under a second, in bf16 on cuda:0.
    Qwen3-MoE with top-4 routing, so the fixed-order combine adds more than two outputs.
    `layers` MoE layers (DeepSeek-V3 has a dense one before them)."""
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                  attn_implementation=attn)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32,
                                          num_experts=8, num_experts_per_tok=4,
                                          norm_topk_prob=True, head_dim=16, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8,
                                         num_experts_per_tok=2, **common)
        cls = transformers.MixtralForCausalLM
    elif arch == "gpt_oss":  # transposed, biased experts; sliding and full attention layers
        cfg = transformers.GptOssConfig(intermediate_size=32, num_local_experts=8,
                                        num_experts_per_tok=2, head_dim=16, **common)
        cls = transformers.GptOssForCausalLM
    else:  # DeepSeek-V3: a dense first layer, then `layers` MoE layers with a shared expert,
        # sigmoid routing over 2 groups of 4 experts (1 group chosen), MLA attention
        common.update(num_hidden_layers=layers + 1, num_key_value_heads=4)
        cfg = transformers.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32,
                                            n_routed_experts=8, num_experts_per_tok=2,
                                            n_shared_experts=1, n_group=2, topk_group=1,
                                            first_k_dense_replace=1, kv_lora_rank=16,
                                            q_lora_rank=None, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=16, **common)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    # Larger expert weights than the default init, so routing and outputs are not all alike.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("experts" in name or ".gate." in name or ".router." in name) and \
                    p.dtype.is_floating_point:
                p.normal_(0.0, 0.2)
    return model


def per_expert_only(tt, model, arch, grouped):
    """gpt-oss's experts (transposed, biased, a clamped gate) take PyTorch's operators per
    expert: grouped=True and policy "mapped" are clear errors that leave the model as it was.
    True where the caller asked for the grouped path there (nothing more to test)."""
    if arch != "gpt_oss":
        return False
    before = snapshot(model)
    for kw in (dict(grouped=True), dict(policy="mapped")):
        with pytest.raises(tt.OffloadError, match="transposed"):
            tt.offload_experts(model, budget="100%", **kw)
        assert snapshot(model) == before
    return bool(grouped)


def tokens(torch, batch=2, seq=24, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g).cuda()


def logits(torch, model, ids):
    with torch.no_grad():
        out = model(ids).logits
    torch.cuda.synchronize()
    return out


def snapshot(model):
    """What offload must not change when it raises: each parameter's object, device and data
    pointer, and which modules have a forward of their own."""
    return ([(n, id(p), p.device, p.data_ptr()) for n, p in model.named_parameters()],
            [n for n, m in model.named_modules() if "forward" in m.__dict__])


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layers", [1, 3])
def test_close_to_transformers(env, arch, layers, grouped, record_property):
    # Other GEMM kernels and summation order than transformers' own experts: equal within
    # bf16 rounding. With one MoE layer the routing is transformers' exactly; past the first,
    # a router input that differs in its last bit may flip a near tie in top-k, so the
    # largest difference is reported (in the JUnit XML) and asserted on the first only.
    torch, transformers, tt = env
    model = tiny(transformers, torch, arch, layers=layers)
    if per_expert_only(tt, model, arch, grouped):
        return
    ids = tokens(torch)
    ref = logits(torch, model, ids)                          # transformers' own forward
    with tt.offload_experts(model, budget="100%", policy="static", grouped=grouped) as h:
        got = logits(torch, model, ids)
        assert h.stats()["grouped"] == grouped
    diff = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    tag = f"{arch}_{layers}_layers{'_grouped' if grouped else ''}"
    record_property(f"max_abs_diff_{tag}", diff)
    record_property(f"max_abs_logit_{tag}", scale)
    print(f"{tag}: largest |offloaded - transformers| = {diff:.3g} (logits up to {scale:.3g})")
    assert diff == diff and diff < float("inf")
    if layers == 1:
        assert diff <= 2 ** -6 * scale, f"{arch}: {diff} off transformers' forward"
    assert torch.equal(logits(torch, model, ids), ref), "restore() changed the model"


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_bitwise_for_every_budget_and_policy(env, arch, grouped):
    # Each path against its own all-resident run (the grouped operations and PyTorch's
    # per-expert operators are other kernels: equal within rounding, not bitwise).
    torch, transformers, tt = env
    model = tiny(transformers, torch, arch)
    if per_expert_only(tt, model, arch, grouped):
        return
    ids = tokens(torch)
    ref = logits(torch, model, ids)
    with tt.offload_experts(model, budget="100%", policy="static", grouped=grouped) as h:
        resident = logits(torch, model, ids)                 # the all-resident run
        h.reset_stats()
        assert torch.equal(logits(torch, model, ids), resident)
        st = h.stats()
        # grouped: every layer's routing stays on the device, and nothing is acquired
        assert (st["device_routed_layers"] > 0) == grouped, st
        assert (st["acquires"] > 0 or grouped) and st["hit_rate"] == 1.0, st
    for budget in BUDGETS:
        for policy in POLICIES + ["mapped"] * grouped:
            h = tt.offload_experts(model, budget=budget, policy=policy, slots=3,
                                   grouped=grouped)
            try:
                for _ in range(2):                           # cold, then with a warm cache
                    got = logits(torch, model, ids)
                    assert torch.equal(got, resident), f"{arch} budget {budget} {policy}"
                st = h.stats()
                assert st["acquires"] > 0 or (grouped and budget == "100%")
                if budget == 0:                              # everything streams
                    assert st["bytes_copied"] > 0 and st["hit_rate"] < 1.0, st
            finally:
                h.restore()
    for kw in (dict(slots=1), dict(lookahead=False), dict(prefetch_depth=1)):
        with tt.offload_experts(model, budget="25%", grouped=grouped, **kw):
            assert torch.equal(logits(torch, model, ids), resident), f"{arch} {kw}"
    assert torch.equal(logits(torch, model, ids), ref), "restore() changed the model"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_token_for_token(env, arch):
    torch, transformers, tt = env
    model = tiny(transformers, torch, arch)
    ids = tokens(torch, batch=1, seq=8)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)

    def generate():
        with torch.no_grad():
            return model.generate(ids, **kw)

    with tt.offload_experts(model, budget="100%", policy="static"):
        want = generate()
    for budget in BUDGETS:
        for policy in ("auto", "lru", "mapped")[:2 + (arch != "gpt_oss")]:
            # auto: mapped where the experts are grouped, else static then LRU; mapped
            # (grouped experts only): decode reads host experts in place
            with tt.offload_experts(model, budget=budget, slots=2, policy=policy) as h:
                got = generate()
                st, blocks = h.stats(), len(h.blocks)
            assert torch.equal(got, want), f"{arch} budget {budget} {policy}: {got} != {want}"
            assert got.shape[1] == ids.shape[1] + 32
            assert st["acquires"] > 0 or st["device_routed_layers"] > 0
            if policy == "mapped":           # 31 decode steps grouped on the device
                k = model.config.num_experts_per_tok
                rows = 31 + (ids.shape[1] if budget == "100%" else 0)   # and the prompt's
                assert st["device_routed_layers"] == (31 + (budget == "100%")) * blocks, st
                assert st["device_routed_pairs"] == rows * blocks * k, st
                if budget == 0:
                    assert st["device_routed_hits"] == 0 and st["bytes_read_in_place"] > 0, st


@pytest.mark.parametrize("budget,policy,share", [("100%", "auto", 0), ("50%", "mapped", 0),
                                                 (0, "mapped", 0), (0, "mapped", 0.5),
                                                 ("50%", "mapped", 1.0)])
def test_decode_step_in_a_cuda_graph(env, budget, policy, share):
    # Where every block takes the device table, a decode step submits work and never waits:
    # it is captured once (after an eager step, with transformers' StaticCache) and replayed;
    # the replays give the all-resident graph's logits bitwise, the logits of a forward over
    # the whole sequence without a cache (the model restored) within rounding, and count in
    # the stats. With host placement the graph holds the host's experts too (a host function
    # of a second stream), within rounding of the all-resident graph.
    torch, transformers, tt = env
    # SDPA: transformers' eager attention builds its mask from a host scalar, which a capture
    # refuses
    model = tiny(transformers, torch, "qwen3_moe", attn="sdpa")
    ids = tokens(torch, batch=1, seq=8)
    steps, dev = 6, torch.device("cuda")

    def decode(h):
        """The logits of each replayed step, and the token each step was fed."""
        # A static cache wants a mask as long as the cache (ones where a token is), else SDPA
        # may decode over its empty slots too. A step's is 4-D (its one query against the
        # cache's slots), which transformers passes to SDPA as it is: a 2-D one is made into
        # a 4-D one by code that takes another path while a stream is captured. Updated in
        # place, so a graph reads each step's.
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        mask = torch.zeros(1, 32, dtype=torch.long, device=dev)
        mask[:, :ids.shape[1]] = 1
        out, fed = [], []
        with torch.no_grad():
            lg = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(ids.shape[1], device=dev)).logits
            sid = lg[:, -1:].argmax(-1)
            pos = torch.tensor([ids.shape[1]], device=dev)
            mask = mask.bool().view(1, 1, 1, 32)

            def step():
                return model(sid, attention_mask=mask, past_key_values=cache,
                             cache_position=pos, use_cache=True).logits
            mask.index_fill_(3, pos, True)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()      # the eager step: the first pass of this shape makes its buffers
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                glg = step()
            h.reset_stats()
            for _ in range(steps):
                mask.index_fill_(3, pos, True)
                fed.append(sid.clone())
                graph.replay()
                out.append(glg.clone())
                sid.copy_(glg[:, -1:].argmax(-1))
                pos.add_(1)
            torch.cuda.synchronize()
            return out, fed

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    with tt.offload_experts(model, budget="100%", policy="auto", slots=2) as h:
        resident, _ = decode(h)
    with tt.offload_experts(model, budget=budget, policy=policy, slots=2,
                            host_share=share) as h:
        got, fed = decode(h)
        st = h.stats()
    with torch.no_grad():     # the model as it was: every step's logits in one forward
        whole = model(torch.cat([ids] + fed, dim=1), use_cache=False).logits
    for i, (g, r) in enumerate(zip(got, resident)):
        if share:             # the host's f32 against the GPU's kernels
            assert rel(g, r) < 2e-2, f"budget {budget}: step {i}: {rel(g, r)}"
        else:
            assert torch.equal(g, r), f"budget {budget}: step {i} differs from all resident"
        want = whole[:, ids.shape[1] + i:ids.shape[1] + i + 1]
        assert rel(g, want) < 3e-2, f"budget {budget}: step {i} against no cache: {rel(g, want)}"
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert st["device_routed_pairs"] == steps * layers * k, st
    if budget == 0:
        assert st["device_routed_hits"] == 0 and st["bytes_read_in_place"] > 0, st
    elif budget == "100%":
        assert st["device_routed_hits"] == st["device_routed_pairs"], st
    assert (st["host_computed_pairs"] > 0) == bool(share), st
    if share == 1.0:    # every expert not resident is the host's: nothing read in place
        assert st["bytes_read_in_place"] == 0, st


@pytest.mark.parametrize("budget", [0, "50%"])
def test_host_share_close_to_resident(env, budget):
    # Decode passes (one token a sequence) with a share of the experts computed by the host:
    # f32 on the CPU against the GPU's kernels, so close to the all-resident run, not bitwise;
    # the host's pairs are counted and are not read in place. Prefill stays on the GPU.
    torch, transformers, tt = env
    model = tiny(transformers, torch, "qwen3_moe")
    ids = tokens(torch)
    one = ids[:, :1]
    with tt.offload_experts(model, budget="100%", policy="static"):
        want, want_pre = logits(torch, model, one), logits(torch, model, ids)
    for share in (0.5, 1.0):
        with tt.offload_experts(model, budget=budget, slots=2, host_share=share) as h:
            h.reset_stats()
            got = logits(torch, model, one)
            st = h.stats()
            assert torch.equal(logits(torch, model, ids), want_pre), "prefill changed"
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, f"budget {budget} share {share}: relative error {err}"
        assert st["host_computed_pairs"] > 0, st
        moved = st["device_routed_pairs"] - st["device_routed_hits"] - st["host_computed_pairs"]
        assert st["bytes_read_in_place"] == moved * h.expert_bytes, st
        if share == 1.0:
            assert st["bytes_read_in_place"] == 0, st


def test_host_share_errors_leave_the_model(env):
    torch, transformers, tt = env
    model = tiny(transformers, torch, "qwen3_moe")
    before = snapshot(model)
    for kw, why in ((dict(host_share=1.5), "in \\[0, 1\\]"),
                    (dict(host_share=0.5, policy="lru"), "policy 'mapped'"),
                    (dict(host_share=0.5, grouped=False), "policy 'mapped'")):
        with pytest.raises(tt.OffloadError, match=why):
            tt.offload_experts(model, budget=0, **kw)
        assert snapshot(model) == before


@pytest.mark.timeout(300)    # compiling the step takes longer than the suite's per-test limit
def test_generate_with_a_static_cache_compiles_the_step(env):
    # transformers compiles the decode step (torch.compile, mode "reduce-overhead": CUDA
    # graphs) when generate() runs with a static cache; the offloaded experts are one custom
    # op there, which a graph holds under policy "mapped". Same tokens as the eager run.
    torch, transformers, tt = env
    pytest.importorskip("triton")
    model = tiny(transformers, torch, "qwen3_moe", attn="sdpa")
    ids = tokens(torch, batch=1, seq=8)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with tt.offload_experts(model, budget="50%", policy="mapped", slots=2) as h:
        with torch.no_grad():
            want = model.generate(ids, disable_compile=True, **kw)
            h.reset_stats()
            got = model.generate(ids, **kw)
            again = model.generate(ids, **kw)      # replays
        st = h.stats()
    assert torch.equal(got, want) and torch.equal(again, want), (got, want)
    assert st["device_routed_pairs"] >= 2 * 11 * len(h.blocks), st


def test_restore_gives_back_the_same_parameters(env):
    torch, transformers, tt = env
    model = tiny(transformers, torch, "mixtral")
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    own_forward = snapshot(model)[1]
    h = tt.offload_experts(model, budget="50%")
    ex = model.model.layers[0].mlp.experts
    assert ex.gate_up_proj.device.type == "cpu"              # in the pinned buffer
    assert h.blocks == [f"model.layers.{n}.mlp" for n in range(3)]
    with pytest.raises(tt.OffloadError, match="offloaded already"):
        tt.offload_experts(model)
    h.restore()
    h.restore()                                              # twice is harmless
    for n, p in model.named_parameters():
        obj, data = before[n]
        assert p is obj and p.device.type == "cuda" and torch.equal(p, data), n
    assert snapshot(model)[1] == own_forward


def test_unsupported_block_raises_and_leaves_the_model(env):
    torch, transformers, tt = env
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=64,
                                      moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=2, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128)
    model = transformers.Qwen2MoeForCausalLM(cfg).cuda().eval()
    snap = snapshot(model)
    with pytest.raises(tt.UnsupportedBlockError, match="Qwen2MoeSparseMoeBlock"):
        tt.offload_experts(model)
    assert snapshot(model) == snap
    dense = transformers.Qwen3Config(hidden_size=64, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128)
    with pytest.raises(tt.OffloadError, match="no MoE block"):
        tt.offload_experts(transformers.Qwen3ForCausalLM(dense).cuda())


def test_too_little_device_memory_raises_and_leaves_the_model(env):
    torch, transformers, tt = env
    model = tiny(transformers, torch, "qwen3_moe")
    ids = tokens(torch)
    ref = logits(torch, model, ids)
    snap = snapshot(model)
    free, _ = torch.cuda.mem_get_info()
    ebytes = (2 * 32 * 64 + 64 * 32) * 2
    with pytest.raises(tt.OffloadError, match="staging slots"):
        tt.offload_experts(model, slots=2 * free // ebytes)
    for bad in ("101%", "lots", -1):
        with pytest.raises(tt.OffloadError, match="budget"):
            tt.offload_experts(model, budget=bad)
    with pytest.raises(tt.OffloadError, match="policy"):
        tt.offload_experts(model, policy="lfu")
    with pytest.raises(tt.OffloadError, match="staging slot"):
        tt.offload_experts(model, slots=0)
    assert snapshot(model) == snap
    assert torch.equal(logits(torch, model, ids), ref)


def test_grouped_needs_bf16_experts(env):
    torch, transformers, tt = env
    model = tiny(transformers, torch, "mixtral").float()
    ids = tokens(torch)
    ref = logits(torch, model, ids)
    snap = snapshot(model)
    with pytest.raises(tt.OffloadError, match="grouped=True"):
        tt.offload_experts(model, grouped=True)
    assert snapshot(model) == snap
    with tt.offload_experts(model, budget="50%") as h:  # grouped=None: the per-expert path
        got = logits(torch, model, ids)
        assert not h.stats()["grouped"]
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
