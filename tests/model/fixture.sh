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
for arch in qwen3moe mixtral; do
  rm -rf "$dir/$arch"
  "$py" "$here/tiny.py" --arch "$arch" --out "$dir/$arch" --router-bf16 --seed 3 --layers 3 \
    >/dev/null
  echo "$prompt" >"$dir/$arch/prompt.txt"
  "$py" "$here/ref_model.py" "$dir/$arch/hf" --tokens "$prompt" -n 6 --out "$dir/$arch/ref.bin"
done
