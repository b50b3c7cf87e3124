#!/usr/bin/env bash
# Cached load: this build (kernel constants as enumerators, load timed after a sync) against
# moeforge-probe (f5c5efc kernels, PROBE_SYNC: also timed after a sync). Then DeepSeek-V3's 16
# one-GPU kernels as whole-program modules of their own, compiled by NVRTC from this build's unit.
cd "$(dirname "$0")/.."
mkdir -p $OUT/ld8
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  for b in bin/moeforge moeforge-probe; do
    export MOEFORGE_CACHE_DIR=/tmp/c-$(basename $b)
    for round in cold cached cached cached; do
      printf "%-14s %-15s %-6s: " $m $(basename $b) $round
      PROBE_SYNC=1 .device/$b run dsl-examples/$m.moe --tokens 1 --seed 7 --check 2>&1 | grep -o "compiled in [0-9.]* s\|loaded into the GPU in [0-9.]* ms ([^)]*)\|PASS\|FAIL\|rror.*" | tr '\n' ' '; echo
    done
  done
done 2>&1 | tee $OUT/ld8/load.txt
python3 .device/loadprobe.py all .device/wp/*.cubin | tee -a $OUT/ld8/load.txt
unset MOEFORGE_CACHE_DIR
for b in bin/moeforge moeforge-probe; do
  for m in qwen3_30b_a3b deepseek_v3; do
    printf "%-15s %-14s: " $(basename $b) $m
    .device/$b bench dsl-examples/$m.moe --tokens 1,128 --seed 7 --iterations 30 2>/dev/null | grep -E "^\|\s+[0-9]" | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
  done
done 2>&1 | tee $OUT/ld8/bench.txt
