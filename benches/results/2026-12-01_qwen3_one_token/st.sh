#!/usr/bin/env bash
# Deeper rings for Qwen3's decode GEMMs: the shipped spec, its decode tiles hinted with 5 stages (the same kernels), and with 8 (1 block per SM), interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-st
mkdir -p $OUT/st
for round in 1 2; do
  for s in dsl-examples/qwen3_30b_a3b.moe .device/specs/qwen3_30b_a3b_s5.moe .device/specs/qwen3_30b_a3b_s8.moe; do
    n=$(basename $s .moe)
    printf "%-20s %s: " $n $round
    .device/bin/moeforge bench $s --tokens 1,2,4,8,16,64 --seed 7 --iterations 100 --out $OUT/st/$n-$round > $OUT/st/$n-$round.txt 2>&1
    grep -E "^\|\s+[0-9]" $OUT/st/$n-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
  done
  (cd $OUT && tar czf st.tgz st)
done
