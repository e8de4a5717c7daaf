#!/usr/bin/env bash
# Second call: token lists of up to 1 MiB by the cores. Prefill at ubatch 8192 and a 50% budget (8 layers, Qwen3-30B-A3B shapes, static policy):
# where the link is idle, and the lead without a previous pass. Builds this tree ("new": a
# large ubatch leads with layer 0's copies also as a process's first such pass, T*k >= 4E,
# after its input's upload), b94a6b5 ("old", in xold/: the lead without a previous pass, token lists over 256 KiB by the copy engines), and "probe": this tree with probe2.patch
# (prints every expert copy's device interval and the chain markers under TANDEM_PROBE=1).
# Then: the moe, streamer and tool tests on cuda:0 (new); the probe at 8192 / 50% with
# --time-link --time-chain, read by gaps.py; new and old interleaved at 8192 / 50% (twice),
# 25%, 0, and 2048 / 50%; new with 32 staging slots. Each run a process of its own.
# Writes $OUT/results2.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
D=bench/results/h200-prefill-gaps
rm -rf /tmp/src-probe; mkdir -p $OUT/r /tmp/src-probe
tar -c --exclude=./xold --exclude='./build*' --exclude=./.git . | tar -x -C /tmp/src-probe
(cd /tmp/src-probe && patch -p1 < $OLDPWD/$D/probe2.patch > $OUT/r/patch.log) || { cat $OUT/r/patch.log; exit 1; }
for t in new old probe; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=xold c=b94a6b5; [ $t = probe ] && src=/tmp/src-probe
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 6 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 150 ctest -L '^cuda$' -R 'moe|streamer|tool' -j 4 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
echo "tested at $((SECONDS-T0)) s"
moe() { # tree, name, then tandem moe options
  local t=$1 name=$2; shift 2
  timeout 90 /tmp/b-$t/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 8192 --cache-policy static --json "$@" > $OUT/r/$t-$name.json 2>$OUT/r/$t-$name.err
  python3 - $OUT/r/$t-$name.json "$t $name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "FAILED", e); sys.exit(0)
runs = {x["name"]: x for x in r["runs"]}
o, s = runs["streamed, overlapped"], runs["streamed, serialized"]
busy = "" if o.get("link_busy_fraction") is None else "; link busy %.3f of the run at %.1f GB/s" % (
    o["link_busy_fraction"], o["link_busy_gbs"])
print("%s: link %.3f (peak %.1f GB/s); overlapped %.4f s, serialized %.4f s, %.2f GB copied; check %s%s" % (
      sys.argv[2], r["link_utilization"], r["peak_gbps"], o["seconds"], s["seconds"],
      o["bytes_copied"] / 1e9, r["check"], busy))
PY
}
TANDEM_PROBE=1 moe probe u8192-b50 --ubatch 8192 --device-budget 50% --time-link --time-chain
python3 $D/gaps.py $OUT/r/probe-u8192-b50.err > $OUT/r/gaps2-u8192-b50.txt 2>&1
head -64 $OUT/r/gaps2-u8192-b50.txt; grep "idle inside" $OUT/r/gaps2-u8192-b50.txt
echo "== prefill at $((SECONDS-T0)) s"
for rep in 1 2; do for t in new old; do moe $t u8192-b50-$rep --ubatch 8192 --device-budget 50%; done; done
for b in 25 0; do for t in new old; do moe $t u8192-b$b --ubatch 8192 --device-budget $b%; done; done
for t in new old; do moe $t u2048-b50 --ubatch 2048 --device-budget 50%; done
for t in new old; do moe $t u2048-b0 --ubatch 2048 --device-budget 0; done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results2.tar.gz r && rm -rf $OUT/r
