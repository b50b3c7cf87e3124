#!/usr/bin/env bash
# Per-kernel GPU time (Nsight Compute, each kernel alone, caches flushed) of one-token calls, twice.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-k1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in qwen3_30b_a3b gpt_oss_120b; do
  for round in 1 2; do
    echo "== $m round $round"
    $NCU --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum --csv .device/bin/moeforge run dsl-examples/$m.moe --tokens 1 --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' 'NR>1 {k=$5; sub(/\(.*/,"",k); gsub(/"/,"",$NF); printf "%-34s %-28s %s\n", k, $(NF-2), $NF}'
  done
done
