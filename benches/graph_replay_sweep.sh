#!/usr/bin/env bash
# Whether a call writes the same bits every time, over many token counts: `moeforge bench`
# checks the caller-routed call replayed from a CUDA graph against the same call run
# eagerly, bit for bit, and stops with an error at the first count that differs. On the
# GPU machine from the project root after staging (bash ../shared/device/stage.sh):
#   bash benches/graph_replay_sweep.sh [BINARY]
#   MODELS="qwen3_30b_a3b" TOKENS=$(seq -s, 100 1 300) bash benches/graph_replay_sweep.sh
# Found stream-K's dependence on the route's atomic row order (2026-12-02,
# benches/results/2026-12-02_stream_k_determinism.md); about 20 s for the four examples.
# Exit status: non-zero if any example's sweep failed.
set -uo pipefail
binary=${1:-.device/bin/moeforge}
models=${MODELS:-qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3}
tokens=${TOKENS:-$(seq -s, 2 7 256)}
out=${OUT:-benches/results}/graph_replay_sweep
mkdir -p "$out"
fail=0
for m in $models; do
  timeout 300 "$binary" bench "dsl-examples/$m.moe" --tokens "$tokens" --seed 7 --iterations 3 > "$out/$m.txt" 2>&1
  rc=$?
  counts=$(grep -cE '^\| +[0-9]+ \|' "$out/$m.txt")
  echo "$m: rc=$rc, $counts counts passed $(grep -m1 -E '^error' "$out/$m.txt")"
  [ $rc -eq 0 ] || fail=1
done
exit $fail
