#!/usr/bin/env bash
cd "$(dirname "$0")/.."
mkdir -p $OUT/ld4 /tmp/dump
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ld
for m in deepseek_v3 qwen3_30b_a3b; do
  PROBE_DUMP=/tmp/dump .device/moeforge-dump run dsl-examples/$m.moe --tokens 1 --seed 7 > /dev/null 2>&1
done
for m in deepseek_v3 qwen3_30b_a3b; do
  for mode in module library module library; do
    python3 .device/loadprobe2.py $mode /tmp/dump/$m-image.cubin /tmp/dump/$m-module0.cubin
  done
done 2>&1 | tee $OUT/ld4/probe.txt
