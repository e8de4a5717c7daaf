#!/usr/bin/env bash
# Side by side on one H200 host: this tree ("new": the host calibrated in grouped calls,
# host_group; the lazy list under a spinlock) against fbdb4f6 ("old", in xold/). The CUDA
# suite on the new tree; bench-cuda overhead new, old, new, old; decode (8 layers, Qwen3-30B-A3B
# shapes, uniform router, batch 1, 128 tokens, look-ahead, placement auto) at budget 0 and 50%,
# new and old interleaved, twice each; budget 0 with the share given as 0.55, 0.60 and 0.65
# (new); every expert resident (new), twice. Each run a process of its own. Writes
# $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=xold c=fbdb4f6
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 150 ctest -L '^cuda$' -j 4 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
echo "== overhead (new, old, new, old) at $((SECONDS-T0)) s"
i=0
for t in new old new old; do
  i=$((i+1))
  timeout 40 /tmp/b-$t/bench/cuda/bench-cuda --json $OUT/r/overhead-$t-$i.json overhead > /dev/null 2>&1
  python3 - $OUT/r/overhead-$t-$i.json $t <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["benchmarks"]["overhead"]["figures"]["results"]
print(sys.argv[2], "  ".join("%s %.3f/%.3f us %.3fx" % (x["name"], x["tandem_us"], x["raw_us"], x["ratio"]) for x in d))
PY
done
moe() { # tree, name, then tandem moe options
  local t=$1 name=$2; shift 2
  timeout 90 /tmp/b-$t/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 128 --skew 0 --locality 0 --cache-policy lru --json "$@" > $OUT/r/$t-$name.json 2>>$OUT/r/moe.err
  python3 - $OUT/r/$t-$name.json "$t $name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "FAILED", e); sys.exit(0)
o = [x for x in r["runs"] if x["name"] == "streamed, overlapped"][0]
print("%s: decode %.1f tok/s; share %.3f (group %s; host %.1f/%.1f, link %.1f/%.1f GB/s alone/at once); "
      "host experts %d, %.1f MB copied a token; bounds split %s best %s; check %s" % (
      sys.argv[2], o["decode_tokens_per_s"], r.get("host_share", 0), r.get("host_group"),
      r.get("host_gbs", 0), r.get("host_gbs_shared", 0), r.get("link_gbs", 0), r.get("link_gbs_shared", 0),
      o.get("decode_host_experts", 0), o["decode_bytes_per_token"] / 1e6,
      r.get("decode_split_bound_tokens_per_s"), r.get("decode_best_split_bound_tokens_per_s"), r["check"]))
PY
}
echo "== decode at $((SECONDS-T0)) s"
for rep in 1 2; do
  for b in 0 50; do
    for t in new old; do moe $t b$b-$rep --device-budget $b% --predict --placement auto; done
  done
done
for s in 0.55 0.60 0.65; do moe new b0-share$s --device-budget 0 --predict --placement auto --host-share $s; done
for rep in 1 2; do moe new resident-$rep --device-budget 100%; done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
