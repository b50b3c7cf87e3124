#!/usr/bin/env bash
# One GPU, decode: shipped table vs opt-in fused decode (tuned GEMMs, 2/SM) vs fused with
# deep rings (16x..x128 tiles at 5 stages, 1/SM) vs the table with those deep GEMMs.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
one() {  # spec label
  s=$(date +%s)
  timeout 150 .device/bin/moeforge bench "$1" --tokens 1,4,16 --seed 7 --out "$OUT/s/$2" > "$OUT/s_$2.log" 2>&1
  echo "== $2 rc=$? $(( $(date +%s) - s )) s"
  grep -E "^\|  +[0-9]" "$OUT/s_$2.log" | cut -d'|' -f2-6 | head -3
}
for r in 1 2; do
  one dsl-examples/qwen3_30b_a3b.moe qwen3_r$r
  for v in q_f16 q_f16d q_d; do one .device/exp/single/$v.moe ${v}_r$r; done
done
one dsl-examples/gpt_oss_120b.moe gptoss
for v in g_f16 g_f16d g_d; do one .device/exp/single/$v.moe $v; done
