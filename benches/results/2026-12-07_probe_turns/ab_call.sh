# Session 64: a tuning cache against the shipped table, one binary, interleaved runs
# (scripts/bench-ab.sh): A plans with the shipped entries only, B with CACHE over them.
# Usage, on the GPU machine from the repository root after scripts/device-stage.sh:
#   CACHE=benches/results/2026-12-07_probe_turns/deepseek_v3_h100_tuned.json \
#     bash benches/results/2026-12-07_probe_turns/ab_call.sh MODEL TOKENS [ROUNDS]
set -eu
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
cache=$(cd "$(dirname "$CACHE")" && pwd)/$(basename "$CACHE")
mkdir -p /tmp/ab
printf '#!/bin/sh\nMOEFORGE_TUNING_CACHE=/tmp/ab/none.json exec %s "$@"\n' "$PWD/.device/bin/moeforge" > /tmp/ab/shipped
printf '#!/bin/sh\nMOEFORGE_TUNING_CACHE=%s exec %s "$@"\n' "$cache" "$PWD/.device/bin/moeforge" > /tmp/ab/tuned
chmod +x /tmp/ab/shipped /tmp/ab/tuned
bash scripts/bench-ab.sh /tmp/ab/shipped /tmp/ab/tuned dsl-examples/$1.moe "$2" "${3:-3}"
