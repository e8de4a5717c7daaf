#!/usr/bin/env bash
# Fourth call: prefill at ubatch 8192 as scripts/gpu-moe runs it (gpu-check at 8fbe1ec: 96.8
# ms and link 0.910 at 50%, 188.0 ms at 0, against 93.7-94.0 and 184.2-184.3 in the third
# call). This tree built as gpu-check builds it (build-gpu) and with probe3.patch; then
# `GPU_MOE_UBATCHES=8192 GPU_MOE_DECODE=0 scripts/gpu-moe build-gpu 8` (budgets 0, 25%, 50%),
# then the probe build through gpu-moe at 50% and at 0 with TANDEM_PROBE=1 and
# GPU_MOE_EXTRA="--time-link --time-chain" (its stderr, the
# probe's prints, go to moe.log), each read by gaps.py. Writes $OUT/results4.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
D=bench/results/h200-prefill-gaps
rm -rf /tmp/src-probe; mkdir -p $OUT/r /tmp/src-probe
tar -c --exclude=./xold --exclude='./build*' --exclude=./.git . | tar -x -C /tmp/src-probe
(cd /tmp/src-probe && patch -p1 < $OLDPWD/$D/probe3.patch > $OUT/r/patch.log) || { cat $OUT/r/patch.log; exit 1; }
for t in plain probe; do
  src=.; b=build-gpu; [ $t = probe ] && src=/tmp/src-probe b=/tmp/b-probe3
  (TANDEM_COMMIT=${NEW_COMMIT:-unknown} cmake -S $src -B $b -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build $b -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
mkdir -p $OUT/r/plain
OUT=$OUT/r/plain GPU_MOE_UBATCHES=8192 GPU_MOE_DECODE=0 scripts/gpu-moe build-gpu 8
echo "== probe at $((SECONDS-T0)) s"
for b in 50% 0; do
  n=probe-b${b%\%}
  mkdir -p $OUT/r/$n
  TANDEM_PROBE=1 OUT=$OUT/r/$n GPU_MOE_UBATCHES=8192 GPU_MOE_BUDGETS=$b GPU_MOE_DECODE=0 \
    GPU_MOE_EXTRA="--time-link --time-chain" scripts/gpu-moe /tmp/b-probe3 8 2>&1 | tail -2
  python3 $D/gaps.py $OUT/r/$n/moe.log > $OUT/r/$n/gaps.txt 2>&1
  grep -E "^pass|^link busy|^idle inside" $OUT/r/$n/gaps.txt
  sed -n '/^first copies/,+2p' $OUT/r/$n/gaps.txt
  grep -o "^host, on the device's clock: x -1 [-0-9.]*, lead -1 [-0-9.]*, routed 0 [-0-9.]*, rows 0 [-0-9.]*" $OUT/r/$n/gaps.txt
  gzip -9 $OUT/r/$n/moe.log
done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results4.tar.gz r && rm -rf $OUT/r
