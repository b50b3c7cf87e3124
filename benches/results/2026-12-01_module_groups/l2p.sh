#!/usr/bin/env bash
# cp.async with an L2 prefetch-size hint (L2::128B, L2::256B) against none, memory-bound cells, interleaved.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-l2p
for round in 1 2; do
  for m in "qwen3_30b_a3b 1,16,128" "mixtral_8x7b 1,16,128" "deepseek_v3 16,128" "gpt_oss_120b 1,16,128"; do
    set -- $m
    for b in bin/moeforge moeforge-l2p128 moeforge-l2p256; do
      printf "%-16s %-14s r%s: " ${b#*/} $1 $round
      .device/$b bench dsl-examples/$1.moe --tokens $2 --seed 7 --out /tmp/l2p 2>&1 | grep -E "^\|\s+[0-9]" | awk -F'|' '{printf "T=%s %s  ", $2+0, $4+0}'; echo
    done
  done
done
