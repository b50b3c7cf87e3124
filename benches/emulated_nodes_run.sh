#!/usr/bin/env bash
# On the one-GPU machine, from the project root, after staging (bash scripts/device-stage.sh):
# the path across nodes on emulated nodes (issue 10), in one call:
#   1. the GPU suite (bash .device/run.sh), whose runtime/tests/gpu_ep.rs `emulated_nodes_*`
#      run it: the loopback's copies, rank partials across nodes, the tokens bound, a
#      time-out and the next call;
#   2. per model, the expert-parallel bench on 4 virtual ranks of one node against 4 virtual
#      ranks emulating 2 nodes of 2 GPUs (a copy of the spec with that topology): the same
#      kernels but for the network steps, which the loopback runs as device copies, and
#      results returning as rank partials; what the path across nodes costs on one GPU.
# Results land in $OUT (the device tool's return folder) when set, else in a dated folder
# of benches/results/, packed into all.tgz after each step.
# Usage: bash benches/emulated_nodes_run.sh   (EN_MODELS and EN_TOKENS override the models
# and token counts per rank)
set -uo pipefail
out=${OUT:-benches/results/$(date +%F)_emulated_nodes}
models=${EN_MODELS:-qwen3_30b_a3b mixtral_8x7b}
tokens=${EN_TOKENS:-1,16,128,1024}
mkdir -p "$out"
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . ; fi; }
status=0

started=$(date +%s)
RUST_TEST_NOCAPTURE=1 bash .device/run.sh > "$out/tests.log" 2>&1 || status=1
echo "== GPU suite: $([ $status = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - started )) s"
grep -E "emulated nodes|^!!|panicked|FAILED" "$out/tests.log" | head -30
pack

specs=$(mktemp -d)
trap 'rm -rf "$specs"' EXIT
for model in $models; do
  emulated="$specs/${model}.moe"
  # The spec's topology as two nodes of two GPUs, emulated by four virtual ranks (and its
  # expert parallelism over those four).
  sed -e 's/^  gpus_per_node = [0-9]*$/  gpus_per_node = 2/' \
      -e 's/^  nodes = [0-9]*$/  nodes = 2\n  virtual_ranks = 4/' \
      -e 's/^\(    expert = \)[0-9]*/\14/' \
      "dsl-examples/$model.moe" > "$emulated"
  grep -q "virtual_ranks = 4" "$emulated" || { echo "could not emulate nodes in $model" >&2; status=1; continue; }
  for placement in one_node emulated; do
    spec=$([ $placement = emulated ] && echo "$emulated" || echo "dsl-examples/$model.moe")
    mkdir -p "$out/$placement"
    started=$(date +%s)
    .device/bin/moeforge bench "$spec" --ranks 4 --tokens "$tokens" --seed 7 --out "$out/$placement" \
      > "$out/$placement/bench_$model.log" 2>&1 || status=1
    echo "== $model, 4 virtual ranks, $placement, in $(( $(date +%s) - started )) s"
    grep -E "^\|" "$out/$placement/bench_$model.log"
    pack
  done
done
exit $status
