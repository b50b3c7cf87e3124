#!/usr/bin/env bash
# On the one-GPU machine, from the project root, after staging (bash scripts/device-stage.sh):
# whole chunks against the routed rows across nodes (issue 10), on 4 virtual ranks
# emulating 2 nodes of 2 GPUs (a copy of each model's spec with that topology, as
# benches/emulated_nodes_run.sh makes it). "planned" is the spec as the planner takes it
# (whole chunks at the small bounds `explain` names under `whole chunks`), "routed" the same
# spec with `whole_chunks = 0` (every call reads its rows per chunk back). Both builds' runs
# alternate, ROUNDS rounds; one line per (model, variant, round) with the expert-parallel
# layer's µs per T, then the raw bench outputs under $OUT (or a dated folder).
# Usage: bash benches/whole_chunks_ab.sh   (MODELS, TOKENS and ROUNDS override)
set -uo pipefail
out=${OUT:-benches/results/$(date +%F)_whole_chunks_ab}
models=${MODELS:-qwen3_30b_a3b mixtral_8x7b}
tokens=${TOKENS:-1,16,128}
rounds=${ROUNDS:-2}
mkdir -p "$out"
specs=$(mktemp -d)
trap 'rm -rf "$specs"' EXIT
status=0
for m in $models; do
  sed -e 's/^  gpus_per_node = [0-9]*$/  gpus_per_node = 2/' \
      -e 's/^  nodes = [0-9]*$/  nodes = 2\n  virtual_ranks = 4/' \
      -e 's/^\(    expert = \)[0-9]*/\14/' \
      "dsl-examples/$m.moe" > "$specs/$m-planned.moe"
  # The layer is the file's last item: its closing brace gets a schedule section first.
  sed '$ s/^}$/  schedule {\n    whole_chunks = 0\n  }\n}/' "$specs/$m-planned.moe" > "$specs/$m-routed.moe"
  grep -q "virtual_ranks = 4" "$specs/$m-planned.moe" && grep -q "whole_chunks = 0" "$specs/$m-routed.moe" \
    || { echo "could not make the emulated specs of $m" >&2; status=1; continue; }
  .device/bin/moeforge explain "$specs/$m-planned.moe" | grep "whole chunks" | cut -c1-160
done
for round in $(seq "$rounds"); do
  order="planned routed"
  [ $((round % 2)) -eq 0 ] && order="routed planned"
  for m in $models; do
    for v in $order; do
      [ -f "$specs/$m-$v.moe" ] || continue
      run=$out/$v-$m-$round
      mkdir -p "$run"
      timeout 200 .device/bin/moeforge bench "$specs/$m-$v.moe" --ranks 4 --tokens "$tokens" \
        --seed 7 --iterations 30 --out "$run" > "$run.txt" 2>&1 || status=1
      echo "$m $v r$round: $(awk -F'|' '
        /expert-parallel us/ { for (i = 1; i <= NF; i++) if ($i ~ /expert-parallel us/) col = i }
        /^\|[[:space:]]+[0-9]/ && col { printf "%s=%s ", $2 + 0, $col + 0 }' "$run.txt")"
    done
  done
done
exit $status
