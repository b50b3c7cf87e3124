#!/usr/bin/env bash
# The fused decode against the launch table, on the GPU machine, from the project root
# after staging (bash ../shared/device/stage.sh):
#   bash benches/fused_decode_ab.sh [BASELINE_BINARY]
# For the four examples, each with `fused_decode = 16 tokens` added to its schedule, benches
# T = 1, 2, 4, 8, 16, 17 with the fused decode (MOEFORGE_FUSED_DECODE=1) and with the same
# plan's table (MOEFORGE_FUSED_DECODE=0), and, given a baseline binary, the shipped spec on
# it; interleaved, two rounds. Prints one line per run (T=caller-routed/self-routed µs).
# The table arm's self-routed time is not quite the plain table's: a fused router leaves the
# metadata out for calls the fused decode covers, so the table arm runs the route launch
# after it; compare self-routed times against the baseline build.
# The bench outputs land in $OUT (the device tool's return folder) when set, else
# benches/results/fused_decode_ab/.
set -uo pipefail
out=${OUT:-benches/results}/fused_decode_ab
baseline=${1:-}
export MOEFORGE_CACHE_DIR=${MOEFORGE_CACHE_DIR:-/tmp/moeforge-cache-fused-ab}
specs=$(mktemp -d)
mkdir -p "$out"
models="qwen3_30b_a3b gpt_oss_120b deepseek_v3 mixtral_8x7b"
for m in $models; do
  if grep -q "^  schedule {" "dsl-examples/$m.moe"; then
    sed 's/^  schedule {/  schedule {\n    fused_decode = 16 tokens/' "dsl-examples/$m.moe" > "$specs/$m.moe"
  else
    sed 's/^  topology = h200_node/  topology = h200_node\n  schedule { fused_decode = 16 tokens }/' "dsl-examples/$m.moe" > "$specs/$m.moe"
  fi
done
builds="fused table"
[ -n "$baseline" ] && builds="$builds baseline"
for round in 1 2; do
  for m in $models; do
    for b in $builds; do
      case $b in
        fused) cmd=.device/bin/moeforge; spec=$specs/$m.moe; switch=1 ;;
        table) cmd=.device/bin/moeforge; spec=$specs/$m.moe; switch=0 ;;
        baseline) cmd=$baseline; spec=dsl-examples/$m.moe; switch=1 ;;
      esac
      run=$out/$b-$m-$round
      mkdir -p "$run"
      MOEFORGE_FUSED_DECODE=$switch timeout 100 "$cmd" bench "$spec" --tokens 1,2,4,8,16,17 \
        --seed 7 --iterations 50 --out "$run" > "$run.txt" 2>&1
      echo "$m $b r$round: $(grep -E '^\|\s+[0-9]' "$run.txt" | awk -F'|' '{printf "%s=%s/%s ", $2+0, $4+0, $12+0}')"
    done
  done
done
rm -rf "$specs"
