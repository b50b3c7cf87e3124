#!/usr/bin/env bash
# On the GPU machine, from the project root, after staging (bash ../shared/device/stage.sh):
# every test executable with the GPU tests (their per-case numbers printed), then the bench
# of the four models. Results land in $OUT (the device tool's return folder) when
# set, else benches/results/.
set -uo pipefail
out=${OUT:-benches/results}
export RUST_TEST_NOCAPTURE=1
bash .device/run.sh 2>&1 | tee "$out/tests.log" | grep -E "^(== |!!|  T=|layer |test result|thread|.*panicked)"
status=${PIPESTATUS[0]}
for model in ${BENCH_MODELS:-mixtral_8x7b qwen3_30b_a3b deepseek_v3 gpt_oss_120b}; do
  .device/bin/moeforge bench "dsl-examples/$model.moe" --ranks 1 --out "$out" || status=1
done
exit "$status"
