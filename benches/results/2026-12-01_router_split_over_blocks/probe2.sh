#!/usr/bin/env bash
# Where the fused router's time goes at one token after the split over blocks: the router kernel whole (old and new), and builds that return after the gate's arrival (v1), after the sum (v2), after select (v3); Nsight Compute, two runs each.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-probe
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in deepseek_v3 qwen3_30b_a3b; do
  for b in moeforge-head bin/moeforge moeforge-probe-v3 moeforge-probe-v2 moeforge-probe-v1; do
    printf "%-18s %-14s router us:" $(basename $b) $m
    for i in 1 2; do
      $NCU --clock-control none -k regex:router --metrics gpu__time_duration.sum --csv .device/$b run dsl-examples/$m.moe --tokens 1 --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' 'NR>1 {gsub(/"/,"",$NF); gsub(/,/,"",$NF); printf " %.1f", $NF/1000}'
    done
    echo
  done
done
