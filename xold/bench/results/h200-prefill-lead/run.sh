#!/usr/bin/env bash
# Side by side on one H200 host: this tree ("new": layer 0's copies start with a prefill pass,
# pass_lead) against 3a53815 ("old", in xold/). The moe, streamer and tool tests on cuda:0
# (new); then prefill over 8 layers (Qwen3-30B-A3B shapes, --tokens 8192, static policy) at
# ubatch 8192 and budgets 50% (twice each way), 25% and 0, and at ubatch 2048 and 50%, new and
# old interleaved; then new at 8192 and 50% with --time-link (the link's busy share and rate
# by the device's clock). Each run a process of its own. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=xold c=3a53815
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 120 ctest -L '^cuda$' -R 'moe|streamer|tool' -j 4 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
moe() { # tree, name, then tandem moe options
  local t=$1 name=$2; shift 2
  timeout 90 /tmp/b-$t/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 8192 --cache-policy static --json "$@" > $OUT/r/$t-$name.json 2>>$OUT/r/moe.err
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
echo "== prefill at $((SECONDS-T0)) s"
for rep in 1 2; do for t in new old; do moe $t u8192-b50-$rep --ubatch 8192 --device-budget 50%; done; done
for b in 25 0; do for t in new old; do moe $t u8192-b$b --ubatch 8192 --device-budget $b%; done; done
for t in new old; do moe $t u2048-b50 --ubatch 2048 --device-budget 50%; done
moe new u8192-b50-timed --ubatch 8192 --device-budget 50% --time-link
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
