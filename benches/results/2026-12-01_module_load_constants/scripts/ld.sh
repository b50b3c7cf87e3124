#!/usr/bin/env bash
# Module load: sequential against parallel threads (moeforge-probe traces each module's load), cached, 4 models.
# Then Nsight Compute DRAM bytes of the GEMMs at DeepSeek-V3 T=128 and Qwen3 T=1024.
cd "$(dirname "$0")/.."
mkdir -p $OUT/ld
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache-ld
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  .device/moeforge-probe run dsl-examples/$m.moe --tokens 1 --seed 7 > /dev/null 2>&1
  for round in 1 2 3; do
    for par in "" 1; do
      printf "%-14s par=%-1s r%s: " $m "$par" $round
      if [ -n "$par" ]; then export PROBE_PAR=1; else unset PROBE_PAR; fi
      .device/moeforge-probe run dsl-examples/$m.moe --tokens 1 --seed 7 --check 2>&1 | grep -o "PROBE.*\|loaded into the GPU in [0-9.]* ms\|PASS\|FAIL" | tr '\n' ' '; echo
    done
  done
done 2>&1 | tee $OUT/ld/load.txt
unset PROBE_PAR
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for mt in deepseek_v3:128 qwen3_30b_a3b:1024 qwen3_30b_a3b:1; do
  m=${mt%:*}; t=${mt#*:}
  $NCU --clock-control none -k regex:"gemm|combine|route|router" --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv .device/bin/moeforge run dsl-examples/$m.moe --tokens $t --seed 7 2>/dev/null | grep -v "^==" | awk -F'","' -v t=$t 'NR>1 {gsub(/"/,"",$NF); k=$5; sub(/\(.*/,"",k); printf "T=%-6s %-34s %-28s %s\n", t, k, $(NF-2), $NF}'
done 2>&1 | tee $OUT/ld/ncu.txt
