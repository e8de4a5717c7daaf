#!/usr/bin/env bash
# Where a decode layer's time goes on the H200: the moe and tool tests on cuda:0, the host
# expert kernel grouped against single (bench-cpu-expert-gemv), then decode
# with --time-chain (each layer's chain on the compute queue's timestamps) and --time-host at
# 50% twice and at budget 0, each also with TANDEM_MOE_PLACE_BALANCE=1 (a layer's own placement
# balances both sides' finishing times, in-flight copies included, and the look-ahead sizes
# its copies to the link's window) and =2 (the own placement alone), the 50% run with the
# host's share fixed below and above the cost model's, and with every expert on the device.
# Each run a process of its own. Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
(cd /tmp/b && timeout 150 ctest -L '^cuda$' -R 'moe\.|tool' -j 4 > $OUT/r/ctest.log 2>&1;
 grep -E "tests passed|tests failed|\*\*\*Failed" $OUT/r/ctest.log)
# The host expert kernel on one token, grouped (experts(), two pool passes a call) against
# single (expert() per expert), with the pool of 12 the model uses beside a GPU.
TANDEM_MOE_CPU_THREADS=12 timeout 90 /tmp/b/bench/bench-cpu-expert-gemv $OUT/r/gemv-12.json 1 \
  > $OUT/r/gemv-12.txt 2>&1
echo "gemv: $(grep -A4 "grouped us/exp" $OUT/r/gemv-12.txt | paste -sd' ') [$((SECONDS-T0)) s]"
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 60 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --layers 8 \
    --tokens 16 --decode 64 --skew 0 --locality 0 --cache-policy lru --predict "$@" > $OUT/r/$name.txt 2>&1
  echo "$name: $(grep -E "calibrated|host share|decode  |host computed|chain|turnaround|combine  *[0-9]|copied and" $OUT/r/$name.txt | sed 's/^ *//' | paste -sd' ') [$((SECONDS-T0)) s]"
}
moe b50-1 --device-budget 50% --time-chain --time-host
TANDEM_MOE_PLACE_BALANCE=1 moe b50-balance-1 --device-budget 50% --time-chain --time-host
moe b0 --device-budget 0 --time-chain --time-host
TANDEM_MOE_PLACE_BALANCE=1 moe b0-balance --device-budget 0 --time-chain --time-host
TANDEM_MOE_PLACE_BALANCE=2 moe b50-own --device-budget 50% --time-chain --time-host
TANDEM_MOE_PLACE_BALANCE=2 moe b0-own --device-budget 0 --time-chain --time-host
moe b50-share35 --device-budget 50% --time-chain --host-share 0.35
moe b50-share65 --device-budget 50% --time-chain --host-share 0.65
moe b50-device --device-budget 50% --time-chain --placement device
TANDEM_MOE_PLACE_BALANCE=1 moe b50-balance-2 --device-budget 50% --time-chain --time-host
moe b50-2 --device-budget 50% --time-chain --time-host
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
echo "done at $((SECONDS-T0)) s"
