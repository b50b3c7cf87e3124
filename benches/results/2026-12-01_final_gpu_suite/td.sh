#!/usr/bin/env bash
# The mma.sync GEMM's merged prologue (and everything since b8313c9 that decode calls run): moeforge-base (b8313c9) against this build, interleaved, two rounds, decode T.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-td
mkdir -p $OUT/td
for round in 1 2; do
  for m in qwen3_30b_a3b deepseek_v3 gpt_oss_120b; do
    for b in moeforge-base bin/moeforge; do
      n=$(basename $b)
      printf "%-14s %-14s %s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,2,4,16,128 --seed 7 --iterations 100 --out $OUT/td/$n-$m-$round > $OUT/td/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/td/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); gsub(/ /,"",$12); printf "T=%s %s (%s)  ", $2, $4, $12}'; echo
    done
  done
  (cd $OUT && tar czf td.tgz td)
done
