#!/usr/bin/env bash
# The warp-specialised GEMMs skip the multiply of a consumer warpgroup with no rows in the tile: moeforge-base (b8313c9) against this build, interleaved, two rounds, large T.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-wg
mkdir -p $OUT/wg
for round in 1 2; do
  for m in deepseek_v3 qwen3_30b_a3b gpt_oss_120b mixtral_8x7b; do
    for b in moeforge-base bin/moeforge; do
      n=$(basename $b)
      printf "%-14s %-14s %s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1024,4096,16384 --seed 7 --out $OUT/wg/$n-$m-$round > $OUT/wg/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/wg/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
    done
  done
  (cd $OUT && tar czf wg.tgz wg)
done
