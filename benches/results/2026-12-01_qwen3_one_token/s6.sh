#!/usr/bin/env bash
# Qwen3's decode GEMMs with 6 stages (still 2 blocks per SM) in the tuning table: shipped (5, 5) against GEMM1 6 (moeforge-s6) and both 6 (moeforge-s66), interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-s6
mkdir -p $OUT/s6
for round in 1 2; do
  for b in bin/moeforge moeforge-s6 moeforge-s66; do
    n=$(basename $b)
    printf "%-14s %s: " $n $round
    .device/$b bench dsl-examples/qwen3_30b_a3b.moe --tokens 1,2,4,8,16,64,256 --seed 7 --iterations 100 --out $OUT/s6/$n-$round > $OUT/s6/$n-$round.txt 2>&1
    grep -E "^\|\s+[0-9]" $OUT/s6/$n-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
  done
  (cd $OUT && tar czf s6.tgz s6)
done
