#!/usr/bin/env bash
# The host's memory against its expert kernel, on the H200's host: bench-cpu-expert-gemv (the
# CPU table's few-token expert op, and a plain multi-threaded read of the same weights with 1 to
# all cores) with the op's pool at 8, 12 and 16 threads; then decode at budget 0 and 50% with
# 12 host threads (the default), with 16, and with 16 and TANDEM_CUDA_BLOCKING_SYNC=1 (the
# device queues' executors sleep in their waits instead of spinning, leaving their cores to the
# pool). Each run a process of its own; OpenBLAS single-threaded in the gemv bench, so that its
# threads do not spin beside the op it is interleaved with. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
lscpu > $OUT/r/lscpu.txt 2>&1; grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA|L3" $OUT/r/lscpu.txt
for t in 8 12 16; do
  OPENBLAS_NUM_THREADS=1 TANDEM_MOE_CPU_THREADS=$t timeout 120 /tmp/b/bench/bench-cpu-expert-gemv $OUT/r/gemv-$t.json 3 \
    > $OUT/r/gemv-$t.txt 2>&1
  echo "gemv pool $t: $(grep -E 'read bandwidth with' $OUT/r/gemv-$t.txt)"
  grep -E '^ +[1248] ' $OUT/r/gemv-$t.txt
  echo "[$((SECONDS-T0)) s]"
done
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 60 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 64 --skew 0 --locality 0 --cache-policy lru --predict "$@" > $OUT/r/$name.txt 2>&1
  echo "$name: $(grep -E "calibrated|host share|decode  |copied and" $OUT/r/$name.txt | sed 's/^ *//' | paste -sd' ') [$((SECONDS-T0)) s]"
}
moe b0-t12 --device-budget 0
moe b0-t16 --device-budget 0 --host-threads 16
TANDEM_CUDA_BLOCKING_SYNC=1 moe b0-t16-bs --device-budget 0 --host-threads 16
TANDEM_CUDA_BLOCKING_SYNC=1 moe b0-t12-bs --device-budget 0
moe b50-t12 --device-budget 50%
TANDEM_CUDA_BLOCKING_SYNC=1 moe b50-t16-bs --device-budget 50% --host-threads 16
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
echo "done at $((SECONDS-T0)) s"
