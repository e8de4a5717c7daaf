#!/usr/bin/env python3
"""hf_check.py: tandem against transformers' own Qwen3MoeForCausalLM and MixtralForCausalLM.

usage: hf_check.py TANDEM_TOOL DEVICE WORKDIR

For each architecture: a tiny model made by transformers from a config (random weights, seeded;
the routers' and experts' values rounded to what bf16 holds, since tandem keeps them in bf16),
written with save_pretrained; transformers' float32 logits for a prompt and greedy decoding
after it; then `tandem run -m <folder> --tokens ... -n N --logits FILE --device DEVICE` on the
same folder. Every row up to the first generated id the two disagree on (a near tie can flip
one) must agree within 1e-3 of the row's largest logit. Exit 0 when both agree, 77 when torch
or transformers is missing (skipped), 1 otherwise.
"""
import os
import struct
import subprocess
import sys

import numpy as np

PROMPT = [5, 17, 200, 33, 1, 99, 42, 7, 128, 64, 3, 250, 9]
DECODE = 6
TOL = 1e-3


def tiny(arch):
    import transformers as tf
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
    if arch == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=4, norm_topk_prob=True, rope_theta=1e6,
                                decoder_sparse_step=1, mlp_only_layers=[], **common)
        return tf.Qwen3MoeForCausalLM(cfg)
    cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                           rope_theta=1e4, sliding_window=None, **common)
    return tf.MixtralForCausalLM(cfg)


def bf16_exact(model):
    """Routers and experts rounded to bf16 values (kept in float32)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts" in name or name.endswith("gate.weight") or ".gate." in name:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def hf_logits(model):
    import torch
    ids, rows = list(PROMPT), []
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].double().numpy()
        rows.extend(out)
        gen = []
        for _ in range(DECODE):
            gen.append(int(np.argmax(rows[-1])))
            ids.append(gen[-1])
            rows.append(model(torch.tensor([ids])).logits[0, -1].double().numpy())
    return np.array(rows), gen


def read_logits(path):
    raw = open(path, "rb").read()
    V, R, P, N = struct.unpack_from("<4i", raw, 8)
    rows = np.frombuffer(raw, dtype="<f8", count=R * V, offset=24).reshape(R, V)
    ids = list(np.frombuffer(raw, dtype="<i4", count=N, offset=24 + 8 * R * V))
    return rows, ids


def check(arch, tool, device, work):
    import torch
    torch.manual_seed(7)
    model = tiny(arch).float().eval()
    bf16_exact(model)
    folder = os.path.join(work, f"hf-{arch}")
    model.save_pretrained(folder, safe_serialization=True)
    want, want_gen = hf_logits(model)
    out = os.path.join(work, f"tandem-{arch}.bin")
    cmd = [tool, "run", "-m", folder, "--tokens", ",".join(map(str, PROMPT)), "-n", str(DECODE),
           "--logits", out, "--device", device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        names = sorted(os.listdir(folder))
        print(f"{arch}: tandem failed ({r.returncode}): {r.stderr.strip()}\n  folder: {names}")
        return False
    got, got_gen = read_logits(out)
    agree = 0
    while agree < DECODE and got_gen[agree] == want_gen[agree]:
        agree += 1
    rows = len(PROMPT) + agree  # rows fed the same tokens on both sides
    worst = 0.0
    for i in range(rows):
        err = np.max(np.abs(got[i] - want[i])) / max(1.0, np.max(np.abs(want[i])))
        worst = max(worst, err)
    ok = worst <= TOL and rows >= len(PROMPT)
    print(f"{arch}: transformers {__import__('transformers').__version__} vs tandem on {device}: "
          f"{rows} rows, worst relative error {worst:.2e} (tolerance {TOL}); generated "
          f"transformers {want_gen} tandem {got_gen} -> {'ok' if ok else 'MISMATCH'}")
    return ok


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        return 77
    tool, device, work = sys.argv[1:]
    listed = subprocess.run([tool, "devices"], capture_output=True, text=True).stdout
    if f" {device} " not in listed:
        print(f"skipped: no {device}")
        return 77
    os.makedirs(work, exist_ok=True)
    ok = all([check(a, tool, device, work) for a in ("qwen3moe", "mixtral")])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
