#!/usr/bin/env bash
# Side by side on one H200 host: this tree ("new": quiet commands join the lazy list, one in
# 16 with a native event of its own) against b65dd89 ("old": quiet commands go to the queue's
# executor; `git archive b65dd89` unpacked into build-ab-old/, which the device call carries).
# Both built Release for architecture 90; the CUDA suite on new (ctest -L cuda); then
# `bench-cuda overhead` six times each way, interleaved, each a process of its own.
# Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
for t in new old; do
  src=. c=${NEW_COMMIT:-unknown}; [ $t = old ] && src=build-ab-old c=b65dd89
  (TANDEM_COMMIT=$c cmake -S $src -B /tmp/b-$t -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
   cmake --build /tmp/b-$t -j 8 > $OUT/r/build-$t.log 2>&1 || { tail -20 $OUT/r/build-$t.log; exit 1; }) &
done
wait
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b-new && timeout 200 ctest -L '^cuda$' -j 8 --timeout 120 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed|Timeout" $OUT/r/ctest.log | head -20)
echo "tested at $((SECONDS-T0)) s"
for rep in 1 2 3 4 5 6; do
  for t in new old; do
    /tmp/b-$t/bench/cuda/bench-cuda --json $OUT/r/$t-$rep.json overhead > $OUT/r/$t-$rep.txt 2>&1
    grep -E '^  (submit|record|device-side wait on a pending)' $OUT/r/$t-$rep.txt | cut -c1-80 |
      tr -s ' ' | sed "s/^/$t $rep:/"
  done
done
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
