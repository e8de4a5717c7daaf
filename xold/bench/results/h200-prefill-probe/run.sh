#!/usr/bin/env bash
# Prefill's link at ubatch 8192 and a 50% budget (8 layers, Qwen3-30B-A3B shapes, static
# policy), where gpu-check measured 0.86-0.90 against 0.95-0.97 elsewhere: the run as gpu-moe
# makes it, with a Chrome trace of every command (--trace); with 32 and 64 staging slots; and
# over 16 layers (whether the loss is a layer's or a pass's). Each a process of its own.
# Writes $OUT/results.tar.gz.
export PATH=$PATH:/usr/local/cuda/bin
T0=$SECONDS
mkdir -p $OUT/r
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/r/cmake.log 2>&1
cmake --build /tmp/b -j 16 > $OUT/r/build.log 2>&1 || { tail -20 $OUT/r/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
moe() { # name, then tandem moe options
  local name=$1; shift
  timeout 120 /tmp/b/tools/tandem moe --preset qwen3-30b-a3b --device cuda:0 --tokens 8192 \
    --ubatch 8192 --device-budget 50% --cache-policy static --json "$@" > $OUT/r/$name.json 2>>$OUT/r/moe.err
  python3 - $OUT/r/$name.json "$name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "FAILED", e); sys.exit(0)
runs = {x["name"]: x for x in r["runs"]}
o, s, a = runs["streamed, overlapped"], runs["streamed, serialized"], runs["all resident"]
print("%s: link %.3f; overlapped %.4f s, serialized %.4f s, resident %.4f s, copy at peak %.4f s; "
      "%.2f GB copied; host waits %.4f s; check %s" % (sys.argv[2], r["link_utilization"], o["seconds"],
      s["seconds"], a["seconds"], r["copy_seconds_at_peak"], o["bytes_copied"] / 1e9,
      o["host_wait_seconds"], r["check"]))
PY
  echo "  [$((SECONDS-T0)) s]"
}
moe l8-trace --layers 8 --trace $OUT/r/trace-l8.json
moe l8 --layers 8
moe l8-slots32 --layers 8 --slots 32
moe l8-slots64 --layers 8 --slots 64
moe l16 --layers 16
echo "done at $((SECONDS-T0)) s"
tar -C $OUT -czf $OUT/results.tar.gz r && rm -rf $OUT/r
