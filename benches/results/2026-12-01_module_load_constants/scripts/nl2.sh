#!/usr/bin/env bash
# Kernel by kernel (Nsight Compute): whole-program modules (this build) against 8cdfb8a's linked image.
cd "$(dirname "$0")/.."
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p $OUT/nl2
for mt in qwen3_30b_a3b:1 qwen3_30b_a3b:16 mixtral_8x7b:16 gpt_oss_120b:1 deepseek_v3:128; do
  m=${mt%:*}; t=${mt#*:}
  for rep in 1 2; do
    for b in moeforge-8cd bin/moeforge; do
      n=$(basename $b); export MOEFORGE_CACHE_DIR=/tmp/nl-$n
      $NCU --clock-control none -k regex:"gemm|route|router|combine" --metrics gpu__time_duration.sum --csv .device/$b run dsl-examples/$m.moe --tokens $t --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' -v n=$n -v t=$t -v r=$rep 'NR>1 {gsub(/"/,"",$NF); k=$5; sub(/\(.*/,"",k); printf "%-13s r%s T=%-4s %-34s %s\n", n, r, t, k, $NF}'
    done
  done
done 2>&1 | tee $OUT/nl2/ncu.txt
