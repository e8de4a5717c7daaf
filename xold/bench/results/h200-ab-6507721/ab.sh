#!/usr/bin/env bash
# Side by side on one machine: this tree ("new") against 98fa8d5 ("old", in xold/).
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=xold c=98fa8d5
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/build-$t.log 2>&1 || { tail -20 $OUT/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
echo "== overhead (new, old, new, old)"
for t in new old new old; do echo "-- $t"; timeout 40 /tmp/b-$t/bench/cuda/bench-cuda --json $OUT/overhead-$t-$RANDOM.json overhead 2>&1 | grep -E "submit|record|wait|round trip"; done
echo "== ctest -L cuda (new) at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 170 ctest -L '^cuda$' -j 4 > $OUT/ctest.log 2>&1; grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" $OUT/ctest.log | head -20)
echo "== exit tests repeated (new) at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 90 ctest -L '^cuda$' -R '^exit' --repeat until-fail:20 --output-on-failure > $OUT/ctest-exit.log 2>&1; grep -c "Passed" $OUT/ctest-exit.log; grep -A30 "Failed" $OUT/ctest-exit.log | head -40)
row() { # tree, budget percent, run number
  local b=/tmp/b-$1/tools/tandem f=$OUT/moe-$1-$2-$3.json
  timeout 90 $b moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 --json --tokens 16 --decode 128 \
    --device-budget ${2}% --cache-policy lru --skew 0 --locality 0 --predict --placement auto > $f 2>>$OUT/moe.err
  python3 - "$f" "$1" "$2" "$3" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = [x for x in r["runs"] if x["name"] == "streamed, overlapped"][0]
print("%s budget %s%% #%s: decode %.1f tok/s, token p50 %.2f p90 %.2f ms, %.1f MB copied + %.1f MB host a token, "
      "host experts %d of %d, check %s; bounds split %s best %s" % (
      sys.argv[2], sys.argv[3], sys.argv[4], o["decode_tokens_per_s"], o["decode_token_ms_p50"],
      o["decode_token_ms_p90"], o["decode_bytes_per_token"] / 1e6, (r.get("decode_host_bytes_per_token") or 0) / 1e6,
      o["decode_host_experts"], o["decode_acquires"] + o["decode_host_experts"], r["check"],
      r.get("decode_split_bound_tokens_per_s"), r.get("decode_best_split_bound_tokens_per_s")))
PY
}
echo "== decode, 8 layers, uniform router, batch 1, 128 tokens, --placement auto at $((SECONDS-T0)) s"
row new 0 1; row old 0 1; row new 0 2; row old 0 2; row new 0 3; row old 0 3
row new 50 1; row old 50 1
echo "done at $((SECONDS-T0)) s"
cd $OUT && tar czf /tmp/results.tar.gz --exclude='build-*.log' . && rm -f ./*.json ./*.log ./*.err && mv /tmp/results.tar.gz . && ls
