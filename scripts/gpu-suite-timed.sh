#!/usr/bin/env bash
# Runs the staged GPU suite as .device/run.sh does (every test executable of
# .device/tests.tsv with its ignored tests, from its package folder, one test at a time) and
# prints a table of seconds per executable, slowest first, the total (the numbers the 90 s
# rule of the GPU suite is checked against), and the slowest tests (libtest's own times,
# `--report-time`, an unstable option that RUSTC_BOOTSTRAP=1 unlocks for a stable build).
#
# Usage, on the GPU machine from the repository root, after scripts/device-stage.sh:
#   bash scripts/gpu-suite-timed.sh [LOG_DIR [SLOWEST]]
# Each executable's output goes to LOG_DIR/<executable>.log (default: $OUT/logs when OUT is
# set, as on the device tool, else a temporary folder); a failing one's tail is printed.
# Exit status: 1 if any executable failed.
set -uo pipefail

here=$(pwd)
logs=${1:-${OUT:+$OUT/logs}}
slowest=${2:-20}
logs=${logs:-$(mktemp -d "${TMPDIR:-/tmp}/moeforge-suite.XXXXXX")}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$here/.device/bin:$PATH
# Tests may use paths compiled in on the build machine: make them lead here (as run.sh).
built_at=$(cat .device/root)
[ -e "$built_at" ] || { mkdir -p "$(dirname "$built_at")" && ln -s "$here" "$built_at"; }
target=$(cat .device/target)
[ -e "$target/release" ] || { mkdir -p "$target" && ln -s "$here/.device/bin" "$target/release"; }

failed=0
rows=""
started=$(date +%s.%N)
while IFS=$'\t' read -r exe dir; do
  begin=$(date +%s.%N)
  (cd "$dir" && RUSTC_BOOTSTRAP=1 "$here/.device/tests/$exe" --include-ignored --test-threads=1 \
    -Z unstable-options --report-time) >"$logs/$exe.log" 2>&1
  status=$?
  seconds=$(awk -v a="$begin" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  result=$(grep -E '^test result' "$logs/$exe.log" | tail -1 | sed 's/test result: //; s/; finished.*//')
  rows+="$seconds"$'\t'"${exe%-*}"$'\t'"$status"$'\t'"$result"$'\n'
  if [ "$status" -ne 0 ]; then
    failed=1
    echo "!! $exe failed:"
    tail -30 "$logs/$exe.log"
  fi
done < .device/tests.tsv
total=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "| seconds | executable | exit | result |"
echo "|---|---|---|---|"
printf '%s' "$rows" | sort -t$'\t' -k1,1 -rn | awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }'
echo "total: $total s (logs in $logs)"
# A test's "ok <1.23s>" may follow lines the test logged: it belongs to the last test named.
echo
echo "| seconds | slowest tests |"
echo "|---|---|"
for log in "$logs"/*.log; do
  awk -v exe="$(basename "$log" .log)" '
    /^test [^ ]+ \.\.\. / { name = $2 }
    match($0, /(ok|FAILED) <[0-9.]+s>/) {
      seconds = substr($0, RSTART, RLENGTH); gsub(/^(ok|FAILED) <|s>$/, "", seconds)
      sub(/-[0-9a-f]+$/, "", exe); print seconds "\t" exe "::" name
    }' "$log"
done | sort -t$'\t' -k1,1 -rn | head -n "$slowest" | awk -F'\t' '{ printf "| %s | %s |\n", $1, $2 }'
exit $failed
