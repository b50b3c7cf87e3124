#!/usr/bin/env bash
# session 66, call 2: two virtual ranks, balanced against uniform routing, same machine
set -u
M=.device/bin/moeforge
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
date -u
for m in gpt_oss_120b qwen3_30b_a3b mixtral_8x7b deepseek_v3; do
  for r in balanced uniform; do
    echo "== $m $r"
    timeout 150 $M bench dsl-examples/$m.moe --ranks 2 --tokens 1024,4096 --routing $r --seed 7 --iterations 20 --out $OUT 2>&1 | grep -E "^\|" | cut -d'|' -f2-8
  done
done
date -u
