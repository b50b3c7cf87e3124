#!/usr/bin/env bash
# The combine in batches of 8 slots (this build) against 8cdfb8a (moeforge-8cd): the combine alone
# (Nsight Compute); then cold compiles, the GEMMs started first (this build).
cd "$(dirname "$0")/.."
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p $OUT/nl4
for mt in qwen3_30b_a3b:1 deepseek_v3:1 deepseek_v3:128 deepseek_v3:1 deepseek_v3:128; do
  m=${mt%:*}; t=${mt#*:}
  for b in moeforge-8cd bin/moeforge; do
    n=$(basename $b); export MOEFORGE_CACHE_DIR=/tmp/nl4-$n
    $NCU --clock-control none -k regex:"combine" --metrics gpu__time_duration.sum --csv .device/$b run dsl-examples/$m.moe --tokens $t --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' -v n=$n -v t=$t 'NR>1 {gsub(/"/,"",$NF); k=$5; sub(/\(.*/,"",k); printf "%-13s T=%-4s %-34s %s\n", n, t, k, $NF}'
  done
done 2>&1 | tee $OUT/nl4/ncu.txt
