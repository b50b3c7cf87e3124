#!/usr/bin/env bash
# The router's gate kernel alone (Nsight Compute, gpu__time_duration), in self-routed
# calls of four examples at token counts across the split routers' gates, on the GPU
# machine from the project root after staging (bash ../shared/device/stage.sh):
#   bash benches/router_gate_sweep.sh [MOEFORGE_BINARY]
# MODELS and TOKENS (space-separated) narrow the sweep. KERNELS (a regular expression,
# default router_gate) chooses the kernels timed; with several kernels per call (e.g.
# KERNELS='router_(gate|select)': the gate and the select, which a cluster gate does
# itself) the figure is the sum of each kernel's last run. Compare against
# benches/results/2026-12-02_router_early_start_and_gate_tiles.md.
set -uo pipefail
moeforge=${1:-.device/bin/moeforge}
export MOEFORGE_CACHE_DIR=${MOEFORGE_CACHE_DIR:-/tmp/moeforge-cache-gate-sweep}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine" >&2; exit 1; }
for m in ${MODELS:-deepseek_v3 qwen3_30b_a3b gpt_oss_120b mixtral_8x7b}; do
  printf "%-14s %s us:" "$m" "${KERNELS:-router_gate}"
  for t in ${TOKENS:-257 512 1024 2048 4096 8192 16384}; do
    us=$("$ncu" --clock-control none -k "regex:${KERNELS:-router_gate}" --metrics gpu__time_duration.sum --csv \
      "$moeforge" run "dsl-examples/$m.moe" --tokens "$t" --seed 7 2>/dev/null | grep -v '^==' |
      awk -F'","' 'NR == 1 { for (i = 1; i <= NF; i++) if ($i ~ /Kernel Name/) k = i }
        NR > 1 { gsub(/"/, "", $NF); gsub(/,/, "", $NF); last[$k] = $NF }
        END { for (name in last) { sum += last[name]; n++ } if (n) printf "%.1f", sum / 1000; else printf "-" }')
    printf " T=%s:%s" "$t" "$us"
  done
  echo
done
