#!/usr/bin/env bash
# Side by side on one H200 host: this tree ("new": ubatches of up to 256 tokens route in the
# two-kernel path) against 217a698 ("old": only up to 8 tokens did; `git archive 217a698`
# unpacked into build-ab-old/, which the device call carries). Both built Release for
# architecture 90; the MoE suites on new (ctest -L cuda -R 'moe|streamer'); then `tandem moe`
# (8 layers, Qwen3-30B-A3B shapes, every expert resident) on 512 prefill tokens in ubatches
# of 16, 64 and 256, and a resident decode of 128 tokens, twice each way, interleaved.
# Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=build-ab-old c=217a698
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 200 ctest -L '^cuda$' -R 'moe|streamer' -j 8 --timeout 120 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
echo "tested at $((SECONDS-T0)) s"
base="--preset qwen3-30b-a3b --device cuda:0 --layers 8 --device-budget 100% --cache-policy lru
      --skew 0 --locality 0 --json"
for rep in 1 2; do
  for what in u16 u64 u256 decode; do
    case $what in
      u16) a="--tokens 512 --ubatch 16";; u64) a="--tokens 512 --ubatch 64";;
      u256) a="--tokens 512 --ubatch 256";; decode) a="--tokens 16 --decode 128";;
    esac
    for t in new old; do
      f=$OUT/r/$t-$what-$rep.json
      /tmp/b-$t/tools/tandem moe $base $a > $f 2> ${f%.json}.log
      python3 -c "
import json; r=json.load(open('$f')); x=r['runs'][0]
d=x.get('decode_tokens_per_s')
print('$t $what $rep:', x['name'], '%.1f tok/s' % x['tokens_per_s'], ('decode %.1f tok/s' % d) if d else '', 'check', r.get('check'))"
    done
  done
done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
