#!/usr/bin/env bash
# 64-row tiles (mid regime's, as hints) against the tuned regimes at 2048-8192 tokens, Qwen3 and DeepSeek-V3, interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-m64
mkdir -p $OUT/m64
for round in 1 2; do
  for m in qwen3_30b_a3b deepseek_v3; do
    for s in dsl-examples/$m.moe .device/specs/${m}_m64.moe; do
      n=$(basename $s .moe)
      printf "%-20s %s: " $n $round
      .device/bin/moeforge bench $s --tokens 2048,3072,4096,6144,8192 --seed 7 --out $OUT/m64/$n-$round > $OUT/m64/$n-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/m64/$n-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); gsub(/ /,"",$8); printf "T=%s %s %s  ", $2, $4, $8}'; echo
    done
  done
  (cd $OUT && tar czf m64.tgz m64)
done
