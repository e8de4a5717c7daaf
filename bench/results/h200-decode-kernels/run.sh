#!/usr/bin/env bash
# Where a resident decode step's device time goes: every kernel of `tandem moe` (8 layers,
# Qwen3-30B-A3B shapes, every expert resident, uniform router), timed one by one by Nsight
# Compute (gpu__time_duration, clocks left alone), against the step time of the same run
# without the profiler. Writes $OUT/{moe.json,ncu.csv,kernels.txt}.
export PATH=$PATH:/usr/local/cuda/bin:$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -1)
T0=$SECONDS
cmake -S . -B /tmp/b -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null 2>&1
cmake --build /tmp/b -j 16 > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "built at $((SECONDS-T0)) s"
args="--preset qwen3-30b-a3b --device cuda:0 --layers 8 --tokens 16 --device-budget 100%
      --cache-policy lru --skew 0 --locality 0"
/tmp/b/tools/tandem moe $args --decode 128 --json > $OUT/moe.json 2> $OUT/moe.log
python3 -c "
import json; r=json.load(open('$OUT/moe.json'))
for x in r['runs']: print(x['name'], x.get('decode_tokens_per_s'), x.get('decode_token_ms_p50'))"
which ncu || { echo "no ncu"; exit 1; }
timeout 300 ncu --clock-control none --graph-profiling node --csv --print-units base \
  --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size -c 3000 \
  /tmp/b/tools/tandem moe $args --decode 4 > $OUT/ncu.csv 2> $OUT/ncu.log
echo "profiled at $((SECONDS-T0)) s"
python3 - $OUT/ncu.csv > $OUT/kernels.txt <<'P'
import csv, sys, statistics, re
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; data = rows[1:]
ix = {h: i for i, h in enumerate(head)}
k = {}
for r in data:
    key = (r[ix['ID']], re.sub(r'\(.*', '', r[ix['Kernel Name']]))
    k.setdefault(key, {})[r[ix['Metric Name']]] = r[ix['Metric Value']]
agg = {}
for (i, name), m in k.items():
    g = m.get('launch__grid_size', '?')
    agg.setdefault((name, g), []).append(float(m.get('gpu__time_duration.sum', 'nan').replace(',', '')) / 1e3)
print('%-60s %8s %6s %10s %10s' % ('kernel', 'grid', 'n', 'median us', 'total us'))
for (name, g), v in sorted(agg.items(), key=lambda a: -sum(a[1])):
    print('%-60s %8s %6d %10.2f %10.1f' % (name[:60], g, len(v), statistics.median(v), sum(v)))
P
head -40 $OUT/kernels.txt
echo "done at $((SECONDS-T0)) s"
