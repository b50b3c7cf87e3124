#!/usr/bin/env bash
# Cached module load with and without waiting for the weight fill first (moeforge-probe traces each module's load).
cd "$(dirname "$0")/.."
mkdir -p $OUT/ld2
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ld
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  .device/moeforge-probe run dsl-examples/$m.moe --tokens 1 --seed 7 > /dev/null 2>&1
  for round in 1 2 3; do
    for mode in plain sync twice; do
      unset PROBE_SYNC PROBE_TWICE
      [ $mode != plain ] && export PROBE_SYNC=1
      [ $mode = twice ] && export PROBE_TWICE=1
      printf "%-14s %-5s r%s: " $m $mode $round
      .device/moeforge-probe run dsl-examples/$m.moe --tokens 1 --seed 7 --check 2>&1 | grep -o "PROBE.*\|loaded into the GPU in [0-9.]* ms\|PASS\|FAIL" | tr '\n' ' '; echo
    done
  done
done 2>&1 | tee $OUT/ld2/load.txt
