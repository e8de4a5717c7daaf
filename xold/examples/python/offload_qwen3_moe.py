"""Expert offload for a Qwen3-MoE model with tandem's streamer: the experts live in pinned host
memory, a quarter of them may stay on the GPU, and the rest stream in as the router picks
them. The model here is built from a config with random weights, so nothing is downloaded; a
real checkpoint works the same way (AutoModelForCausalLM.from_pretrained(..., dtype=bf16) on
the GPU, then offload_experts). Prints the generated tokens' agreement with the all-resident
run and the streamer's statistics. Without PyTorch, transformers or a CUDA GPU it says so and
exits 0."""
import sys


def main() -> int:
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"offload_qwen3_moe: skipped ({e.name} is not installed)")
        return 0
    if not torch.cuda.is_available():
        print("offload_qwen3_moe: skipped (PyTorch sees no CUDA GPU)")
        return 0
    import tandem
    if getattr(tandem._tandem, "Streamer", None) is None:
        print("offload_qwen3_moe: skipped (this tandem build has no Streamer)")
        return 0
    import tandem.torch

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_experts=32, num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, vocab_size=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
    gen = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)

    # The reference: the same code path with every expert resident.
    with tandem.torch.offload_experts(model, budget="100%"), torch.no_grad():
        want = model.generate(prompt, **gen)

    # A quarter of the experts' bytes on the GPU; prefill uses the static set, decode LRU.
    with tandem.torch.offload_experts(model, budget="25%", slots=8) as handle:
        with torch.no_grad():
            got = model.generate(prompt, **gen)
        st = handle.stats()
    same = torch.equal(got, want)
    print(f"offloaded blocks: {len(handle.blocks)}, expert {handle.expert_bytes} bytes, "
          f"budget {st['budget_bytes']} bytes")
    print(f"generated tokens equal to the all-resident run: {same}")
    print(f"acquires {st['acquires']}, hit rate {st['hit_rate']:.2f} (resident when routed), "
          f"bytes copied {st['bytes_copied']}, link utilization {st['link_utilization']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
