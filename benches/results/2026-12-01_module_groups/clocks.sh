#!/usr/bin/env bash
# Is Mixtral's 4096-token prefill bimodal because of clocks/power? Six runs, nvidia-smi sampling beside them.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-clocks
.device/bin/moeforge run dsl-examples/mixtral_8x7b.moe --tokens 1 --seed 7 > /dev/null 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 200 > /tmp/smi.log 2>&1 &
smi=$!
for i in 1 2 3 4 5 6; do
  s=$(date +%H:%M:%S.%N | cut -c1-12)
  printf "run %s start %s: " $i $s
  .device/bin/moeforge bench dsl-examples/mixtral_8x7b.moe --tokens 4096 --seed 7 --iterations 50 --out /tmp/cl 2>&1 | grep -E "^\|\s+[0-9]" | cut -c1-80
done
kill $smi
awk -F', ' '{print $1, $2, $4, $5, $6}' /tmp/smi.log | awk 'NR%3==1' | cut -c12- | head -150
