#!/usr/bin/env bash
# Cached loads with the driver's default (lazy) module loading against CUDA_MODULE_LOADING=EAGER, interleaved.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-eager
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  .device/bin/moeforge run dsl-examples/$m.moe --tokens 1 --seed 7 > /dev/null 2>&1
  for round in 1 2 3; do
    for mode in default EAGER; do
      printf "%s %s r%s: " $m $mode $round
      if [ $mode = EAGER ]; then export CUDA_MODULE_LOADING=EAGER; else unset CUDA_MODULE_LOADING; fi
      s=$(date +%s%N)
      .device/bin/moeforge run dsl-examples/$m.moe --tokens 1 --seed 7 --check 2>&1 | grep -o "loaded into the GPU in [0-9.]* ms\|PASS\|FAIL" | tr '\n' ' '
      echo "(process $(( ($(date +%s%N) - s) / 1000000 )) ms)"
    done
  done
done
unset CUDA_MODULE_LOADING
