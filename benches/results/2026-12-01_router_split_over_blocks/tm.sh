#!/usr/bin/env bash
# The select by the whole block at one token (RouterTeam): moeforge-preteam (d2cc47b) against this build, interleaved, two rounds.
cd "$(dirname "$0")/.."
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-tm
mkdir -p $OUT/tm
for round in 1 2; do
  for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
    for b in moeforge-preteam bin/moeforge; do
      n=$(basename $b)
      printf "%-16s %-14s %s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,2,4 --seed 7 --iterations 100 --out $OUT/tm/$n-$m-$round > $OUT/tm/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/tm/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); gsub(/ /,"",$12); printf "T=%s %s (%s)  ", $2, $4, $12}'; echo
    done
  done
  (cd $OUT && tar czf tm.tgz tm)
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in deepseek_v3 qwen3_30b_a3b; do
  for b in moeforge-preteam bin/moeforge; do
    printf "%-16s %-14s router us (ncu):" $(basename $b) $m
    for i in 1 2; do
      $NCU --clock-control none -k regex:router --metrics gpu__time_duration.sum --csv .device/$b run dsl-examples/$m.moe --tokens 1 --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' 'NR>1 {gsub(/"/,"",$NF); gsub(/,/,"",$NF); printf " %.1f", $NF/1000}'
    done
    echo
  done
done
