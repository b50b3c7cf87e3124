#!/usr/bin/env bash
# Where a large call's GEMMs lose time against the tensor cores' peak: Nsight Compute's
# speed-of-light, tensor-pipe, warp-state and scheduler figures for the two GEMMs of one
# self-routed call, on the GPU machine from the project root after staging:
#   bash benches/gemm_stall_profile.sh MODEL TOKENS [REGIME]
# MODEL names an example in dsl-examples/; REGIME (default prefill) picks the kernels
# `<MODEL>_<REGIME>_gemm1` and `_gemm2`. With ROUTING=uniform|skewed|balanced set, the
# GEMMs profiled are those of the first caller-routed call of `moeforge bench --routing
# ROUTING` instead (balanced: every expert T·K/E rows, no part-empty last row tile).
# Prints one summary line per kernel, then the sections in full. The kernels run
# serialised and replayed once per section pass, so their times are those of a kernel alone
# (benches/kernel_breakdown.sh says more).
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,12p "$0" >&2; exit 2; }
model=$1 tokens=$2 regime=${3:-prefill}
moeforge=${MOEFORGE_BINARY:-.device/bin/moeforge}
export MOEFORGE_CACHE_DIR=${MOEFORGE_CACHE_DIR:-/tmp/moeforge-cache-profile}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine" >&2; exit 1; }
if [ -n "${ROUTING:-}" ]; then invocation=(bench --routing "$ROUTING" --iterations 1); else invocation=(run); fi
report=$(mktemp "${TMPDIR:-/tmp}/moeforge-profile.XXXXXX.txt")
"$ncu" --clock-control none -k "regex:^${model}_${regime}_gemm[12]$" --launch-count 2 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum \
  "$moeforge" "${invocation[@]}" "dsl-examples/$model.moe" --tokens "$tokens" --seed 7 >"$report" 2>&1
status=$?
# One line per kernel: its time, clock, tensor-pipe activity, DRAM and issue figures.
awk -v model="$model" -v tokens="$tokens" '
  /^  [a-z0-9_]+_gemm[12] / { kernel = $1 }
  kernel && /gpu__time_duration.sum/ { time[kernel] = $NF " " $(NF-1) }
  kernel && /sm__cycles_elapsed.avg.per_second/ { clock[kernel] = $NF " " $(NF-1) }
  kernel && /sm__pipe_tensor_op_gmma_cycles_active/ { gmma[kernel] = $NF "%" }
  kernel && /^ +DRAM Throughput/ { dram[kernel] = $NF "%" }
  kernel && /^ +Issue Slots Busy/ { issue[kernel] = $NF "%" }
  END {
    for (k in time)
      printf "%s T=%s %s: %s, clock %s, gmma pipe active %s, DRAM %s, issue slots busy %s\n",
        model, tokens, k, time[k], clock[k], gmma[k], dram[k], issue[k]
  }' "$report"
echo
cat "$report"
rm -f "$report"
exit "$status"
