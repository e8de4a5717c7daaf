#!/usr/bin/env bash
# Side by side on one H200 host: this tree ("new": group() by a scan over the block's threads)
# against 6a11f4e ("old": thread 0 lays the routed experts out alone; `git archive 6a11f4e`
# unpacked into build-ab-old/, which the device call carries). Both built Release for
# architecture 90; the MoE suites on new (ctest -L cuda -R 'moe|streamer'); then `tandem moe`
# with every expert resident (8 layers, Qwen3-30B-A3B shapes, uniform router, 128 decode
# tokens) four times each way, interleaved; then Nsight Compute on new's group_kernel.
# Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=build-ab-old c=6a11f4e
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 200 ctest -L '^cuda$' -R 'moe|streamer' -j 8 --timeout 120 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
echo "tested at $((SECONDS-T0)) s"
args="--preset qwen3-30b-a3b --device cuda:0 --layers 8 --tokens 16 --decode 128
      --device-budget 100% --cache-policy lru --skew 0 --locality 0 --json"
for rep in 1 2 3 4; do
  for t in new old; do
    /tmp/b-$t/tools/tandem moe $args > $OUT/r/$t-$rep.json 2> $OUT/r/$t-$rep.log
    python3 -c "
import json; r=json.load(open('$OUT/r/$t-$rep.json')); x=r['runs'][0]
print('$t $rep:', x['name'], x['decode_tokens_per_s'], 'tok/s, median token', x['decode_token_ms_p50'], 'ms')"
  done
done
echo "timed at $((SECONDS-T0)) s"
timeout 120 ncu --clock-control none --csv --print-units base -k regex:group_kernel \
  --metrics gpu__time_duration.sum -c 60 /tmp/b-new/tools/tandem moe $args > $OUT/r/ncu-new.csv 2>&1
python3 - $OUT/r/ncu-new.csv <<'P'
import csv, sys, statistics
v = [float(r[-1].replace(',', '')) / 1e3 for r in csv.reader(open(sys.argv[1]))
     if len(r) > 10 and r[-1].replace(',', '').replace('.', '').isdigit()]
print('group_kernel under ncu: %d launches, median %.2f us' % (len(v), statistics.median(v)) if v else 'no ncu figures')
P
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
