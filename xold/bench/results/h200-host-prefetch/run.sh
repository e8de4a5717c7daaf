#!/usr/bin/env bash
# How far the host's expert kernel should prefetch, on the H200's host: bench-cpu-expert-gemv
# (1 GiB of experts; the plain read with 1, 12 and 16 threads prefetching 1-64 KiB ahead, and
# the op with a pool of 12) with TANDEM_MOE_CPU_PREFETCH_KB at 4 (the default), 16 and 64;
# then decode at budget 0 and 50% with each. Each run a process of its own; OpenBLAS
# single-threaded in the gemv bench. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
for kb in 4 16 64; do
  OPENBLAS_NUM_THREADS=1 TANDEM_MOE_CPU_THREADS=12 TANDEM_MOE_CPU_PREFETCH_KB=$kb timeout 120 \
    /tmp/b/bench/bench-cpu-expert-gemv $OUT/r/gemv-kb$kb.json 1 > $OUT/r/gemv-kb$kb.txt 2>&1
  echo "gemv prefetch $kb KiB [$((SECONDS-T0)) s]"
  grep -E 'read bandwidth|^ +[1248] ' $OUT/r/gemv-kb$kb.txt
done
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 60 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 64 --skew 0 --locality 0 --cache-policy lru --predict "$@" > $OUT/r/$name.txt 2>&1
  echo "$name: $(grep -E "calibrated|host share|decode  |copied and" $OUT/r/$name.txt | sed 's/^ *//' | paste -sd' ') [$((SECONDS-T0)) s]"
}
for kb in 4 16 64; do
  TANDEM_MOE_CPU_PREFETCH_KB=$kb moe b0-kb$kb --device-budget 0
  TANDEM_MOE_CPU_PREFETCH_KB=$kb moe b50-kb$kb --device-budget 50%
done
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
echo "done at $((SECONDS-T0)) s"
