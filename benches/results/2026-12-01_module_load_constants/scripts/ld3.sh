#!/usr/bin/env bash
cd "$(dirname "$0")/.."
mkdir -p $OUT/ld3 /tmp/dump
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ld
for m in deepseek_v3 qwen3_30b_a3b gpt_oss_120b; do
  PROBE_DUMP=/tmp/dump .device/moeforge-dump run dsl-examples/$m.moe --tokens 1 --seed 7 > /dev/null 2>&1
done
ls -la /tmp/dump
for m in deepseek_v3 qwen3_30b_a3b gpt_oss_120b; do
  for mode in plain bigalloc library; do
    python3 .device/loadprobe.py $mode /tmp/dump/$m-image.cubin /tmp/dump/$m-module0.cubin
  done
  CUDA_MODULE_LOADING=EAGER python3 .device/loadprobe.py plain /tmp/dump/$m-image.cubin /tmp/dump/$m-module0.cubin | sed 's/^/EAGER /'
  CUDA_MODULE_LOADING=LAZY python3 .device/loadprobe.py plain /tmp/dump/$m-image.cubin /tmp/dump/$m-module0.cubin | sed 's/^/LAZY /'
done 2>&1 | tee $OUT/ld3/probe.txt
cp /tmp/dump/deepseek_v3-image.cubin $OUT/ld3/
