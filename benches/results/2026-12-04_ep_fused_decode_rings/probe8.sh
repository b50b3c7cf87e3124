#!/usr/bin/env bash
# Expert-major tiles in the ranks' fused decode: gpu_ep, checks at real sizes, A/B by
# MOEFORGE_FUSED_DECODE (table unchanged) on two virtual ranks.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
built_at=$(cat .device/root); [ -e "$built_at" ] || { mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"; }
if [ -f .device/target ]; then t=$(cat .device/target); [ -e "$t/release" ] || { mkdir -p "$t" && ln -s "$PWD/.device/bin" "$t/release"; }; fi
exe=$(grep -m1 '^gpu_ep' .device/tests.tsv | cut -f1); dir=$(grep -m1 '^gpu_ep' .device/tests.tsv | cut -f2)
bash -c "cd $dir && $PWD/.device/tests/$exe --include-ignored --test-threads=1" 2>&1 | grep -E "test result|FAILED|panicked"
for spec in mixtral_8x7b qwen3_30b_a3b; do for t in 8 32; do
  timeout 120 .device/bin/moeforge run dsl-examples/$spec.moe --ranks 2 --tokens $t --check --seed 3 2>&1 | grep -E "PASS|FAIL|error" | sed -E 's/: 0 of.*(PASS|FAIL)/: \1/' | cut -c1-120
done; done
EP_MODELS="mixtral_8x7b qwen3_30b_a3b" EP_TOKENS=1,8,16,32 bash benches/ep_fused_ab.sh --ranks 2 1
