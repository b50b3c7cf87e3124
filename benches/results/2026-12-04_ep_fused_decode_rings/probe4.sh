#!/usr/bin/env bash
# Deepest rings for the ranks' fused decode: correctness at real sizes, then A/B against the
# previous plans' GEMMs (schedule-hint copies with stages = 3), two virtual ranks.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
m=.device/bin/moeforge
for spec in mixtral_8x7b qwen3_30b_a3b deepseek_v3; do
  for t in 1 32; do
    timeout 120 $m run dsl-examples/$spec.moe --ranks 2 --tokens $t --check --seed 3 2>&1 | grep -E "PASS|FAIL|error" | sed -E 's/: 0 of.*(PASS|FAIL)/: \1/' | cut -c1-120
  done
done
one() {  # spec tokens label [env]
  s=$(date +%s)
  env ${4:-X=1} timeout 200 $m bench "$1" --ranks 2 --tokens "$2" --seed 7 --out "$OUT/ab/$3" > "$OUT/ab_$3.log" 2>&1
  echo "== $3 rc=$? $(( $(date +%s) - s )) s"
  grep -E "^\|  " "$OUT/ab_$3.log" | cut -d'|' -f2,3,4,6,7
}
for r in 1 2; do
  one dsl-examples/mixtral_8x7b.moe 1,8,16,32 mixtral_new_r$r
  one .device/exp/sweep/A.moe 1,8,16,32 mixtral_A_r$r
  one dsl-examples/qwen3_30b_a3b.moe 1,8,32 qwen3_new_r$r
  one .device/exp/sweep/Q3.moe 1,8,32 qwen3_old_r$r
done
one dsl-examples/mixtral_8x7b.moe 1,8,32 mixtral_new_table MOEFORGE_FUSED_DECODE=0
one dsl-examples/deepseek_v3.moe 1,8,32,64 dsv3_new
one .device/exp/sweep/S3.moe 1,8,32,64 dsv3_old
