#!/usr/bin/env bash
# Each kernel of one self-routed call alone (Nsight Compute: gpu__time_duration, and the SM
# clock it ran at), with its share of their sum, on the GPU machine from the project root
# after staging (bash ../shared/device/stage.sh):
#   bash benches/kernel_breakdown.sh MODEL TOKENS [more `moeforge run` arguments]
#   bash benches/kernel_breakdown.sh MODEL INPUTS.safetensors [...]  (the call of an inputs file)
#   MOEFORGE_BINARY=path/to/moeforge bash benches/kernel_breakdown.sh ...  (another build)
# MODEL names an example in dsl-examples/. The kernels run serialised, each after a pause:
# power-limited GEMMs run faster here than in a stream of calls (see
# benches/results/2026-12-02_large_call_breakdown_and_three_misses.md).
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,8p "$0" >&2; exit 2; }
model=$1 tokens=$2
shift 2
moeforge=${MOEFORGE_BINARY:-.device/bin/moeforge}
export MOEFORGE_CACHE_DIR=${MOEFORGE_CACHE_DIR:-/tmp/moeforge-cache-breakdown}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine" >&2; exit 1; }
case $tokens in
  *.safetensors) call=(--inputs "$tokens") ;;
  *) call=(--tokens "$tokens" --seed 7) ;;
esac
"$ncu" --clock-control none -k "regex:^$model" \
  --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second --csv \
  "$moeforge" run "dsl-examples/$model.moe" "${call[@]}" "$@" 2>/dev/null |
python3 -c '
import collections, csv, sys
model, tokens = sys.argv[1:3]
lines = sys.stdin.read().splitlines()
# moeforge prints its own line first; the table starts at its header.
start = next((i for i, line in enumerate(lines) if line.startswith("\"ID\"")), None)
if start is None:
    sys.exit("no kernel was profiled: " + " | ".join(lines[-3:]))
micros, hertz = collections.OrderedDict(), {}
for row in csv.DictReader(lines[start:]):
    kernel, value = row["Kernel Name"], float(row["Metric Value"].replace(",", ""))
    if row["Metric Name"].startswith("gpu__time_duration"):
        micros[kernel] = micros.get(kernel, 0.0) + value / 1000
    else:
        hertz[kernel] = value
total = sum(micros.values())
print(f"{model} T={tokens}: {total:.1f} us in {len(micros)} kernels")
for kernel, us in micros.items():
    print(f"  {kernel:<48} {us:9.1f} us {100 * us / total:5.1f}%  {hertz.get(kernel, 0) / 1e9:.2f} GHz")
' "$model" "$tokens"
