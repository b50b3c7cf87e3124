#!/usr/bin/env bash
# On a GPU machine with several GPUs, from the project root, after staging
# (bash ../shared/device/stage.sh): everything the expert-parallel issues ask of such a
# machine, in one call, in the order that keeps the most if the call is cut short:
#   1. every staged test executable with its GPU tests (gpu_ep and gpu_multiprocess take
#      their rank counts from the GPUs present);
#   2. per model, the expert-parallel bench over all GPUs (moeforge, its bulk-synchronous
#      variant (a), the NCCL pipeline (b)), then the torch pipeline (c) by python3;
#   3. the ranks' fused decode against the table it replaces (benches/ep_fused_ab.sh);
#   4. the simulator's predictions beside each bench result;
#   5. with EP_AB_BINARY (another build's moeforge, e.g. a probe from
#      scripts/probe-build.sh), per model its bench and this build's, one after the other,
#      twice, at EP_AB_TOKENS (default 1024,4096): an A/B of the two builds on one machine.
# Results land in $OUT (the device tool's return folder) when set, else in a dated folder
# of benches/results/, and are packed into all.tgz after each step (the device tool
# returns only a few files).
# Usage: bash benches/ep_device_run.sh [GPUS]   (default: every GPU nvidia-smi lists)
# EP_MODELS and EP_TOKENS override the models and token counts.
set -uo pipefail
# NVLink multicast stays off, also for the programs started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-benches/results/$(date +%F)_ep_device_run}
gpus=${1:-$(nvidia-smi --list-gpus | wc -l)}
models=${EP_MODELS:-mixtral_8x7b qwen3_30b_a3b deepseek_v3}
tokens=${EP_TOKENS:-1,16,128,1024,4096}
mkdir -p "$out"
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . ; fi; }
status=0
echo "== $gpus GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"

started=$(date +%s)
RUST_TEST_NOCAPTURE=1 bash .device/run.sh > "$out/tests.log" 2>&1 || status=1
echo "== tests: $([ $status = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - started )) s"
grep -E "^!!|panicked|FAILED" "$out/tests.log" | head -20
pack

for model in $models; do
  started=$(date +%s)
  .device/bin/moeforge bench "dsl-examples/$model.moe" --gpus "$gpus" --tokens "$tokens" --seed 7 \
    --out "$out" > "$out/bench_$model.log" 2>&1 || status=1
  echo "== $model bench in $(( $(date +%s) - started )) s"
  grep -E "^\|" "$out/bench_$model.log"
  pack
  python3 benches/ep_torch_baseline.py --model "$model" --ranks "$gpus" --tokens "$tokens" --seed 7 \
    --out "$out" > "$out/torch_$model.log" 2>&1 || status=1
  grep -E "^\| $model" "$out/torch_$model.log"
  pack
done

# 3. The ranks' fused decode against the table it replaces at small counts (the benches
# above run it for calls of up to 32 tokens per rank).
echo "== fused decode against the table"
OUT=$out bash benches/ep_fused_ab.sh --gpus "$gpus" 1 > "$out/fused_ab.log" 2>&1 || status=1
cat "$out/fused_ab.log"
pack

for result in "$out"/*_ep"$gpus"_uniform_at_*.json; do
  [ -e "$result" ] || continue
  model=$(basename "$result" | sed -E 's/^[0-9-]+_(.*)_ep[0-9]+_uniform_at_.*$/\1/')
  echo "== simulated $model"
  .device/bin/moeforge simulate "dsl-examples/$model.moe" --measured "$result" 2>&1 | tail -8 || status=1
done
pack

if [ -n "${EP_AB_BINARY:-}" ]; then
  echo "== A/B: $EP_AB_BINARY (A) against this build (B), ${EP_AB_TOKENS:-1024,4096} tokens per rank"
  for round in 1 2; do
    for model in $models; do
      for build in A B; do
        binary=.device/bin/moeforge
        [ "$build" = A ] && binary=$EP_AB_BINARY
        log="$out/ab_${build}_${model}_$round.log"
        "$binary" bench "dsl-examples/$model.moe" --gpus "$gpus" --tokens "${EP_AB_TOKENS:-1024,4096}" \
          --seed 7 --out "$out/ab_$build" > "$log" 2>&1 || status=1
        grep -E "^\| +[0-9]+ \|" "$log" | cut -d'|' -f2,3,7 | sed "s/^/$model $build round $round |/"
      done
    done
  done
  pack
fi
exit "$status"
