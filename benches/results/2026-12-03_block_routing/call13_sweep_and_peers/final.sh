#!/usr/bin/env bash
export MOEFORGE_CACHE_DIR=/tmp/mf-cache-final
out=${OUT:-/tmp}; mkdir -p $out/peers
TOKENS=$(seq -s, 1 1 20),63,64,65,127,128,129 bash benches/graph_replay_sweep.sh .device/bin/moeforge 2>&1 | tail -6
for m in qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3; do
  timeout 150 .device/bin/moeforge bench dsl-examples/$m.moe --tokens 1,16 --seed 7 --peers --out $out/peers > $out/peers/$m.txt 2>&1
  echo "== $m"; grep -E '^\|' $out/peers/$m.txt | head -8
done
