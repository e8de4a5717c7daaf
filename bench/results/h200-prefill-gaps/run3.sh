#!/usr/bin/env bash
# Third call: the spread of prefill at ubatch 8192 (gpu-check at 8fbe1ec measured 96.8 ms and
# link 0.910 at 50%, against 92.1-92.2 ms and 0.956-0.961 side by side in the second call).
# This tree with probe3.patch (probe2's prints, plus how many of the events each copy waits for
# were pending at its issue): 8192 at 50% three times and at 0 twice, each a process of its own,
# with --time-link --time-chain, each read by gaps.py. Writes $OUT/results3.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
D=bench/results/h200-prefill-gaps
rm -rf /tmp/src-probe; mkdir -p $OUT/r /tmp/src-probe
tar -c --exclude=./xold --exclude='./build*' --exclude=./.git . | tar -x -C /tmp/src-probe
(cd /tmp/src-probe && patch -p1 < $OLDPWD/$D/probe3.patch > $OUT/r/patch.log) || { cat $OUT/r/patch.log; exit 1; }
(TANDEM_COMMIT=${NEW_COMMIT:-unknown} cmake -S /tmp/src-probe -B /tmp/b-probe3 -DCMAKE_BUILD_TYPE=Release \
   -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
 cmake --build /tmp/b-probe3 -j 16 > $OUT/r/build-probe.log 2>&1) || { tail -20 $OUT/r/build-probe.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
probe() { # name, then tandem moe options
  local name=$1; shift
  TANDEM_PROBE=1 timeout 90 /tmp/b-probe3/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 \
    --layers 8 --tokens 8192 --ubatch 8192 --cache-policy static --json --time-link --time-chain \
    "$@" > $OUT/r/$name.json 2>$OUT/r/$name.err
  python3 $D/gaps.py $OUT/r/$name.err > $OUT/r/gaps-$name.txt 2>&1
  python3 - $OUT/r/$name.json "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = {x["name"]: x for x in r["runs"]}["streamed, overlapped"]
print("%s: link %.3f (peak %.1f GB/s); overlapped %.4f s; link busy %.3f of the run; check %s" % (
      sys.argv[2], r["link_utilization"], r["peak_gbps"], o["seconds"], o["link_busy_fraction"], r["check"]))
PY
  grep -E "^pass|^link busy|^idle inside" $OUT/r/gaps-$name.txt
  sed -n '/^first copies/,+3p' $OUT/r/gaps-$name.txt
  grep -o "^host, on the device's clock: x -1 [-0-9.]*, lead -1 [-0-9.]*, routed 0 [-0-9.]*, rows 0 [-0-9.]*" $OUT/r/gaps-$name.txt
  grep "^layer 0" $OUT/r/gaps-$name.txt
}
for rep in 1 2 3; do probe b50-$rep --device-budget 50%; done
for rep in 1 2; do probe b0-$rep --device-budget 0; done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results3.tar.gz r && rm -rf $OUT/r
