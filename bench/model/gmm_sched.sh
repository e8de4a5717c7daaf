#!/usr/bin/env bash
# gmm_sched.sh: a streamed prefill with every expert in host memory (budget 0), Qwen3-30B-A3B's
# shapes, by the way the grouped expert kernels run their tiles (TANDEM_MOE_CUDA_GMM_SCHED:
# grid, counter, auto), against one expert at a time (TANDEM_MOE_PREFILL_GROUPED=0), and by the
# staging slots. One `tandem moe` process a row; each also times the all-resident run. Prints
# a row each: tokens/s of the three runs, the streamed run over the bf16 link bound (its
# expert bytes as bf16 at the link's measured peak) and the bitwise check; the JSONs go to OUT.
#
#   bench/model/gmm_sched.sh TANDEM OUT [LAYERS] [UBATCH] [TYPES] [WAYS] [SLOTS]
#
# DEVICE (default cuda:0). Defaults: 8 layers, ubatch 8192 (8192 tokens in all), types
# "q4_k_m q8_0", ways "grid counter auto one", slots "16 64".
# bench/results/h100-gmm-sched-0e8fcfe/README.md has a run.
set -euo pipefail
T=${1:?usage: gmm_sched.sh TANDEM OUT [LAYERS] [UBATCH] [TYPES] [WAYS] [SLOTS]}
OUT=${2:?usage: gmm_sched.sh TANDEM OUT [LAYERS] [UBATCH] [TYPES] [WAYS] [SLOTS]}
L=${3:-8} U=${4:-8192} TYPES=${5:-q4_k_m q8_0} WAYS=${6:-grid counter auto one} SLOTS=${7:-16 64}
mkdir -p "$OUT"
for ty in $TYPES; do
  for s in $SLOTS; do
    for way in $WAYS; do
      env=(TANDEM_MOE_CUDA_GMM_SCHED="$way")
      [ "$way" != one ] || env=(TANDEM_MOE_PREFILL_GROUPED=0)
      j=$OUT/L$L-u$U-$ty-$way-s$s.json
      env "${env[@]}" timeout 120 "$T" moe --preset qwen3-30b-a3b --device "${DEVICE:-cuda:0}" \
        --layers "$L" --tokens 8192 --ubatch "$U" --device-budget 0 --cache-policy static \
        --experts-type "$ty" --slots "$s" --json > "$j" 2> "${j%.json}.err" ||
        { echo "$ty $way s$s: failed (${j%.json}.err)"; continue; }
      python3 - "$j" "$ty $way slots $s" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
r = {x["name"]: x for x in j["runs"]}
s = r["streamed, overlapped"]
bf16_per_token = s["bytes_copied"] * j["expert_bytes_bf16"] / j["expert_bytes"] / j["tokens"]
over = s["tokens_per_s"] * bf16_per_token / (j["peak_gbps"] * 1e9)
print(sys.argv[2], " ".join("%s %.0f" % (k, v["tokens_per_s"]) for k, v in r.items()),
      "| %.2fx the bf16 link bound" % over, "| check", j["check"])
EOF
    done
  done
done
