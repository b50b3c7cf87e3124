#!/usr/bin/env bash
# Two builds of moeforge on the same calls, interleaved, on the GPU machine from the
# project root after staging (bash ../shared/device/stage.sh):
#   bash benches/build_ab.sh BASE_BINARY [ROUNDS]
#   MODELS="qwen3_30b_a3b deepseek_v3" TOKENS=1,16,128 bash benches/build_ab.sh ...
#   NEW_ENV="MOEFORGE_TUNING_CACHE=trial.json" bash benches/build_ab.sh .device/bin/moeforge
#   BENCH_ARGS="--ranks 4" NEW_ENV="CUDA_DEVICE_MAX_CONNECTIONS=32" bash benches/build_ab.sh ...
# The build under test is .device/bin/moeforge, run with NEW_ENV's settings (if any): the
# same binary as base then compares one setting. For each round and example, runs
# `moeforge bench` (with BENCH_ARGS's options, if any) with both builds (base first in odd
# rounds, last in even ones) and prints one line per run: T=caller-routed µs (with
# `--ranks`, the expert-parallel layer's). The bench outputs land in $OUT (the device
# tool's return folder) when set, else benches/results/build_ab/.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,13p "$0" >&2; exit 2; }
base=$1 rounds=${2:-2}
out=${OUT:-benches/results}/build_ab
models=${MODELS:-qwen3_30b_a3b gpt_oss_120b deepseek_v3 mixtral_8x7b}
tokens=${TOKENS:-1,16,128,256}
export MOEFORGE_CACHE_DIR=${MOEFORGE_CACHE_DIR:-/tmp/moeforge-cache-build-ab}
mkdir -p "$out"
for round in $(seq "$rounds"); do
  order="base new"
  [ $((round % 2)) -eq 0 ] && order="new base"
  for m in $models; do
    for b in $order; do
      cmd=(env ${NEW_ENV:-} .device/bin/moeforge)
      [ "$b" = base ] && cmd=("$base")
      run=$out/$b-$m-$round
      mkdir -p "$run"
      # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
      timeout 200 "${cmd[@]}" bench "dsl-examples/$m.moe" --tokens "$tokens" --seed 7 --iterations 30 \
        --out "$run" ${BENCH_ARGS:-} > "$run.txt" 2>&1
      # The layer's column: moeforge's (the fourth field), or the expert-parallel layer's.
      echo "$m $b r$round: $(awk -F'|' '
        /expert-parallel us/ { for (i = 1; i <= NF; i++) if ($i ~ /expert-parallel us/) col = i }
        /^\|[[:space:]]+[0-9]/ { printf "%s=%s ", $2 + 0, $(col ? col : 4) + 0 }' "$run.txt")"
    done
  done
done
