#!/usr/bin/env bash
# Grouped (HEAD) vs ungrouped (e323b9f) whole-program GEMMs: layer time at 4096 (and 1), interleaved.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ab
for round in 1 2; do
  for m in mixtral_8x7b deepseek_v3; do
    for b in moeforge-e323b9f bin/moeforge; do
      printf "%s %s %s: " $b $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,4096 --seed 7 --iterations 20 --out /tmp/ab 2>&1 | grep -E "^\|\s+[0-9]" | cut -c1-40 | tr '\n' ' '; echo
    done
  done
done
