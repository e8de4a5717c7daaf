#!/usr/bin/env bash
# quantized.sh: tandem on files that llama.cpp's own quantizer typed. For each architecture
# (qwen3moe, mixtral) and llama-quantize type (Q4_K_M, Q5_K_M, Q8_0 by default): a tiny random
# model in f32 (tests/model/tiny.py, router values bf16 holds, so that no engine's rounding of
# the router flips a near-tie), quantized by build-peer/cpu/bin/llama-quantize, then the float64
# reference on the quantized file (tests/model/ref_model.py, its blocks widened by the gguf
# package's gguf.quants), tandem's logits (`tandem run --logits`) and llama.cpp's
# (bench/peer/llama_logits) on the same file, each held to the reference by
# bench/peer/compare_logits.py. Prints a table; exit status 1 when tandem's worst row exceeds
# TOL (default 1e-3; TOL_BF16, 1e-2, where tandem widened the experts to bf16: Q5_K_M's, for
# which it has no expert kernels) or its greedy ids differ from the reference's.
#
#   scripts/peer-llama build cpu            # llama-quantize and llama_logits, once
#   bench/peer/quantized.sh [OUT_DIR]       # default /tmp/tandem-quantized
#
# Environment: PY (a python with numpy and gguf; default build-venv/bin/python), TANDEM (the
# tool; default build/tools/tandem), DEVICE (default cpu:0), TYPES, ARCHS, TOL, SHAPE (tiny.py's
# size arguments).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${1:-/tmp/tandem-quantized}
PY=${PY:-$ROOT/build-venv/bin/python}
TANDEM=${TANDEM:-$ROOT/build/tools/tandem}
DEVICE=${DEVICE:-cpu:0}
TYPES=${TYPES:-Q4_K_M Q5_K_M Q8_0}
ARCHS=${ARCHS:-qwen3moe mixtral}
TOL=${TOL:-1e-3}
TOL_BF16=${TOL_BF16:-1e-2}
SHAPE=${SHAPE:---layers 2 --hidden 512 --heads 8 --kv-heads 2 --head-dim 64 --experts 8 --top-k 2 --moe-ffn 512 --vocab 512}
BIN=$ROOT/build-peer/cpu/bin
TOKENS=5,17,200,33,1,99,42,7,128,64,3,250,9
for f in "$BIN/llama-quantize" "$BIN/llama_logits" "$TANDEM"; do
  [ -x "$f" ] || { echo "quantized.sh: no $f (scripts/peer-llama build cpu; make build)" >&2; exit 77; }
done
mkdir -p "$OUT"
worst() { "$PY" "$ROOT/bench/peer/compare_logits.py" "$1" "$2" --quiet 2>&1 | tail -1 || true; }
status=0
printf '%-9s %-7s %-16s %-16s %-10s %-10s %s\n' arch type "tandem experts" "tandem dense" \
  tandem llama.cpp "greedy ids"
for arch in $ARCHS; do
  src=$OUT/$arch-f32
  [ -f "$src/model.gguf" ] || "$PY" "$ROOT/tests/model/tiny.py" --arch "$arch" --out "$src" --seed 5 \
      --experts-dtype f32 --router-bf16 $SHAPE > /dev/null
  for type in $TYPES; do
    q=$OUT/$arch-$type.gguf
    LD_LIBRARY_PATH=$BIN "$BIN/llama-quantize" "$src/model.gguf" "$q" "$type" > "$q.log" 2>&1
    "$PY" "$ROOT/tests/model/ref_model.py" "$q" --tokens "$TOKENS" -n 6 --out "$q.ref" > /dev/null
    w=$("$TANDEM" run -m "$q" --tokens "$TOKENS" -n 6 --device "$DEVICE" --logits "$q.tandem" 2>&1 |
        sed -n 's/^weights: //p')
    LD_LIBRARY_PATH=$BIN "$BIN/llama_logits" "$q" --tokens "$TOKENS" -n 6 --out "$q.llama" > /dev/null 2>&1
    t=$(worst "$q.tandem" "$q.ref") l=$(worst "$q.llama" "$q.ref")
    te=$(sed -n 's/.*max relative error \([^ ]*\).*/\1/p' <<<"$t")
    le=$(sed -n 's/.*max relative error \([^ ]*\).*/\1/p' <<<"$l")
    ids=same
    grep -q "generated ids same" <<<"$t" || ids="tandem differs"
    grep -q "generated ids same" <<<"$l" || ids="$ids; llama.cpp differs"
    we=$(sed -n 's/.*, in \([^)]*\)).*/\1/p' <<<"$w") wd=$(sed -n 's/.*dense \([^ ]*\).*/\1/p' <<<"$w")
    printf '%-9s %-7s %-16s %-16s %-10s %-10s %s\n' "$arch" "$type" "$we" "$wd" "$te" "$le" "$ids"
    tol=$TOL
    [ "$we" != BF16 ] || tol=$TOL_BF16
    if [ -z "$te" ] || [ "${ids%%;*}" != same ] ||
       ! "$PY" -c "import sys; sys.exit(float('$te') > float('$tol'))"; then
      status=1
    fi
  done
done
exit $status
