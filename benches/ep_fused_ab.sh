#!/usr/bin/env bash
# The ranks' fused decode against the table it replaces, same binary
# (MOEFORGE_FUSED_DECODE=1 / 0), in interleaved rounds: the expert-parallel bench of each
# model at small token counts per rank, the two ways in turns.
# Usage, on the GPU machine from the repository root, after staging:
#   bash benches/ep_fused_ab.sh [--ranks R | --gpus G] [ROUNDS]
# (default --ranks 2, 2 rounds); EP_MODELS and EP_TOKENS override the models
# (qwen3_30b_a3b deepseek_v3) and token counts (1,8,32). Each bench's table rows are
# printed (T, layer µs, floor µs, dispatch GB/s, self-routed µs) under a header naming the
# round, model and way; the bench files land in $OUT/fused_ab (or a dated folder of
# benches/results/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
placement=(--ranks 2)
if [ $# -ge 2 ] && { [ "$1" = --ranks ] || [ "$1" = --gpus ]; }; then placement=("$1" "$2"); shift 2; fi
rounds=${1:-2}
models=${EP_MODELS:-qwen3_30b_a3b deepseek_v3}
tokens=${EP_TOKENS:-1,8,32}
moeforge=${MOEFORGE:-.device/bin/moeforge}
out=${OUT:-benches/results/$(date +%F)_ep_fused_ab}/fused_ab
status=0
for round in $(seq 1 "$rounds"); do
  for model in $models; do
    for fused in 1 0; do
      echo "== round $round $model $([ $fused = 1 ] && echo fused || echo table)"
      MOEFORGE_FUSED_DECODE=$fused timeout 300 "$moeforge" bench "dsl-examples/$model.moe" "${placement[@]}" \
        --tokens "$tokens" --seed 7 --out "$out/r${round}_f${fused}" > /tmp/ep_fused_ab.log 2>&1 || status=1
      grep -E "^\|  " /tmp/ep_fused_ab.log | cut -d'|' -f2,3,4,13,14
    done
  done
done
exit $status
