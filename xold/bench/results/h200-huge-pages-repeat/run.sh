#!/usr/bin/env bash
# More samples of decode at a 50% budget with the experts' host copy in 2 MiB pages (the
# default) and in 4 KiB pages (TANDEM_MOE_HUGE_PAGES=0), alternating, three of each, then budget
# 0 once each way. Each run a process of its own. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 60 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 64 --skew 0 --locality 0 --cache-policy lru --predict "$@" > $OUT/r/$name.txt 2>&1
  echo "$name: $(grep -E "calibrated|host share|decode  |copied and" $OUT/r/$name.txt | sed 's/^ *//' | paste -sd' ') [$((SECONDS-T0)) s]"
}
for i in 1 2 3; do
  moe b50-huge-$i --device-budget 50%
  TANDEM_MOE_HUGE_PAGES=0 moe b50-4k-$i --device-budget 50%
done
moe b0-huge-1 --device-budget 0
TANDEM_MOE_HUGE_PAGES=0 moe b0-4k-1 --device-budget 0
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
echo "done at $((SECONDS-T0)) s"
