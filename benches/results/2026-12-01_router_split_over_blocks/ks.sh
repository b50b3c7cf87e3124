#!/usr/bin/env bash
# Fused router split over blocks + redux select: moeforge-head (77f6bae, the kernels of 315f50e) against this build, interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ks
mkdir -p $OUT/ks
for round in 1 2; do
  for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
    for b in moeforge-head bin/moeforge; do
      n=$(basename $b)
      printf "%-14s %-14s %s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,2,4 --seed 7 --iterations 100 --out $OUT/ks/$n-$m-$round > $OUT/ks/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/ks/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); gsub(/ /,"",$12); printf "T=%s %s (%s)  ", $2, $4, $12}'; echo
    done
  done
done
