#!/usr/bin/env bash
# Whole-program modules with the combine's loads hoisted (this build) against 8cdfb8a's linked image:
# the combine and router kernels alone (Nsight Compute), then the layer bench, order alternating.
cd "$(dirname "$0")/.."
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p $OUT/nl3
for mt in qwen3_30b_a3b:1 qwen3_30b_a3b:16 gpt_oss_120b:1 mixtral_8x7b:16 deepseek_v3:128; do
  m=${mt%:*}; t=${mt#*:}
  for b in moeforge-8cd bin/moeforge; do
    n=$(basename $b); export MOEFORGE_CACHE_DIR=/tmp/nl-$n
    $NCU --clock-control none -k regex:"combine|router" --metrics gpu__time_duration.sum --csv .device/$b run dsl-examples/$m.moe --tokens $t --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' -v n=$n -v t=$t 'NR>1 {gsub(/"/,"",$NF); k=$5; sub(/\(.*/,"",k); printf "%-13s T=%-4s %-34s %s\n", n, t, k, $NF}'
  done
done 2>&1 | tee $OUT/nl3/ncu.txt
for round in 1 2; do
  order="moeforge-8cd bin/moeforge"; [ $round = 2 ] && order="bin/moeforge moeforge-8cd"
  for m in qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3; do
    for b in $order; do
      n=$(basename $b); export MOEFORGE_CACHE_DIR=/tmp/nl-$n
      printf "%-13s %-14s r%s: " $n $m $round
      .device/$b bench dsl-examples/$m.moe --tokens 1,16,128 --seed 7 --iterations 50 > $OUT/nl3/$n-$m-$round.txt 2>&1
      grep -E "^\|\s+[0-9]" $OUT/nl3/$n-$m-$round.txt | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$4); printf "T=%s %s  ", $2, $4}'; echo
    done
  done
done 2>&1 | tee $OUT/nl3/bench.txt
