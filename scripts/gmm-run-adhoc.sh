#!/bin/bash
# ad-hoc: build bench-cuda, run grouped (prefill sizes) and ncu on the gm kernels

mkdir -p build-gpu-deps/root
for d in build-gpu-deps/debs/libcjson*.deb; do dpkg -x "$d" build-gpu-deps/root; done
inc=$(pwd)/build-gpu-deps/root/usr/include
so=$(ls "$(pwd)"/build-gpu-deps/root/usr/lib/*/libcjson.so.1* 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "$so")
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DCJSON_INCLUDE_DIR=$inc -DCJSON_LIB=$so > $OUT/cmake.log 2>&1
cmake --build build-gpu -j16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
(cd build-gpu && ctest -R "moe-quant.cuda|moe-ops.cuda.experts" -j4 2>&1 | tail -5)
build-gpu/bench/cuda/bench-cuda --reps 5 --json $OUT/grouped.json grouped 2>&1 | tee $OUT/grouped.txt
timeout 150 ncu --kernel-name-base mangled --kernel-name regex:gm_.*ILi4E --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis build-gpu/bench/cuda/bench-cuda --reps 1 grouped > $OUT/ncu-gm.txt 2>&1
grep -E "gm_|Duration|Registers|Achieved Occ|Throughput|Stall|Issue" $OUT/ncu-gm.txt | head -80
