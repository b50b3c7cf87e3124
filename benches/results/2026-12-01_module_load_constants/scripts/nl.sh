#!/usr/bin/env bash
# Every kernel a whole-program module of its own (this build) against the linked image of
# 8cdfb8a (moeforge-8cd): cached loads, then the layer bench interleaved, two rounds.
cd "$(dirname "$0")/.."
mkdir -p $OUT/nl
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  for b in bin/moeforge moeforge-8cd; do
    export MOEFORGE_CACHE_DIR=/tmp/nl-$(basename $b)
    for round in cold cached cached cached; do
      printf "%-14s %-13s %-6s: " $m $(basename $b) $round
      .device/$b run dsl-examples/$m.moe --tokens 1 --seed 7 --check 2>&1 | grep -o "compiled in [0-9.]* s\|loaded into the GPU in [0-9.]* ms ([^)]*)\|PASS\|FAIL\|rror:.*" | tr '\n' ' '; echo
    done
  done
done 2>&1 | tee $OUT/nl/load.txt
for round in 1 2; do
  for m in qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3; do
    for b in moeforge-8cd bin/moeforge; do
      n=$(basename $b); export MOEFORGE_CACHE_DIR=/tmp/nl-$n
      printf "%-13s %-14s r%s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,16,128,1024,4096 --seed 7 --iterations 20 --out $OUT/nl/$n-$m-$round > $OUT/nl/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/nl/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); gsub(/ /,"",$12); printf "T=%s %s/%s  ", $2, $4, $12}'; echo
    done
  done
done 2>&1 | tee $OUT/nl/bench.txt
(cd $OUT && tar czf nl.tgz nl/*-* && rm -rf nl/*-*)
