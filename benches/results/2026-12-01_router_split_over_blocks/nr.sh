#!/usr/bin/env bash
# What the route kernel costs a caller-routed decode call: a probe build whose route kernel returns at once when the metadata already holds a call of this size (the bench's calls repeat), against this build, interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-nr
mkdir -p $OUT/nr
for round in 1 2; do
  for m in qwen3_30b_a3b gpt_oss_120b mixtral_8x7b; do
    for b in moeforge-probe-noroute bin/moeforge; do
      n=$(basename $b)
      printf "%-22s %-14s %s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,2,4,16 --seed 7 --iterations 100 --out $OUT/nr/$n-$m-$round > $OUT/nr/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/nr/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
    done
  done
done
