#!/usr/bin/env bash
# How long the host computes experts during decode, and at what rate while it does, on the
# H200: the moe and tool tests on cuda:0, then decode with --time-host (the host experts' queue
# timed) at 50% twice and budget 0 twice, and once at 50% untimed beside them. Each run a
# process of its own. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b && timeout 150 ctest -L '^cuda$' -R 'moe\.|tool' -j 4 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed" $OUT/r/ctest.log)
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 60 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 64 --skew 0 --locality 0 --cache-policy lru --predict "$@" > $OUT/r/$name.txt 2>&1
  echo "$name: $(grep -E "calibrated|host share|decode  |host computed|copied and" $OUT/r/$name.txt | sed 's/^ *//' | paste -sd' ') [$((SECONDS-T0)) s]"
}
moe b50-timed-1 --device-budget 50% --time-host
moe b50-untimed --device-budget 50%
moe b0-timed-1 --device-budget 0 --time-host
moe b50-timed-2 --device-budget 50% --time-host
moe b0-timed-2 --device-budget 0 --time-host
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
echo "done at $((SECONDS-T0)) s"
