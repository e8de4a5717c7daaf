#!/bin/sh
# fixture.sh PYTHON DIR: the model suite's files (tests/test-model.c): for Qwen3-MoE and
# Mixtral, a tiny random model written both as GGUF and as a safetensors folder (tiny.py, with
# routers bf16 holds exactly, as tandem's MoE operations compute them), a prompt, and the
# float64 reference's logits for it and for greedy decoding after it (ref_model.py). Without
# the Python environment or its packages it writes nothing, and the suite skips.
set -e
py=$1
dir=$2
here=$(dirname "$0")
if ! "$py" -c 'import numpy, gguf, safetensors' 2>/dev/null; then
  echo "fixture: no Python with numpy, gguf and safetensors at $py: the model tests skip"
  exit 0
fi
prompt=5,17,200,33,1,99,42,7,128,64,3,250,9
# name, then tiny.py's arguments: f32 dense weights and bf16 experts (what tandem computes in,
# exactly), an F16 file and a BF16 one with a tied LM head, whose dense weights tandem keeps
# in 16 bits or widens to f32 (exactly either way), and GGUF block types: a Q8_0 file (every
# projection and expert), MXFP4 experts, and Q4_K_M's mix of Q4_K and Q6_K experts (rows of
# 256 values and more), which tandem computes in their blocks where the device's table can;
# every tensor typed as llama.cpp's quantizer types a Q4_K_M file (Mixtral: attention output
# in Q5_K, k and v in Q8_0; Qwen3-MoE with 16 experts: attention output in Q5_0, its rows of
# 64 values being no whole 256-value block); Q5_K experts (a Q5_K_M file's), which tandem
# widens to bf16 at load; a Q8_0 file in four shards of 12 tensors (model-00001-of-00004.gguf,
# ..., as llama.cpp's gguf-split writes them); last, a Qwen3-MoE folder whose config.json is
# laid out as transformers 5 writes it.
models="qwen3moe:--arch qwen3moe
mixtral:--arch mixtral
qwen3moe-f16:--arch qwen3moe --dtype f16 --seed 5
mixtral-bf16:--arch mixtral --dtype bf16 --tied --seed 7
qwen3moe-q8_0:--arch qwen3moe --dtype q8_0 --experts-dtype q8_0 --seed 9
mixtral-mxfp4:--arch mixtral --experts-dtype mxfp4 --seed 11
qwen3moe-q4_k_m:--arch qwen3moe --experts-dtype q4_k_m --hidden 256 --moe-ffn 256 --seed 13
mixtral-llama-q4_k_m:--arch mixtral --dtype q4_k_m --hidden 256 --moe-ffn 256 --head-dim 64 --seed 17
qwen3moe-llama-q4_k_m:--arch qwen3moe --dtype q4_k_m --hidden 256 --moe-ffn 256 --experts 16 --seed 19
qwen3moe-q5_k:--arch qwen3moe --experts-dtype q5_k --hidden 256 --moe-ffn 256 --seed 21
qwen3moe-shards:--arch qwen3moe --dtype q8_0 --experts-dtype q8_0 --shard-tensors 12 --seed 25
qwen3moe-v5:--arch qwen3moe --hf-config v5 --seed 15"
echo "$models" | while IFS=: read -r name args; do
  rm -rf "${dir:?}/$name"
  # shellcheck disable=SC2086
  "$py" "$here/tiny.py" --out "$dir/$name" --router-bf16 --seed 3 --layers 3 $args >/dev/null
  echo "$prompt" >"$dir/$name/prompt.txt"
  "$py" "$here/ref_model.py" "$dir/$name/hf" --tokens "$prompt" -n 6 --out "$dir/$name/ref.bin"
done
# Bad input: experts of a type tandem neither computes in nor widens (layer 1's down
# projections in Q3_K, random blocks), which a model must refuse, naming the file, the tensor
# and the type.
rm -rf "${dir:?}/qwen3moe-q3_k"
mkdir -p "$dir/qwen3moe-q3_k"
"$py" "$here/retype.py" "$dir/qwen3moe-q4_k_m/model.gguf" "$dir/qwen3moe-q3_k/model.gguf" \
  blk.1.ffn_down_exps Q3_K
