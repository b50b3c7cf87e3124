#!/usr/bin/env bash
# Runs the staged GPU suite (.device/run.sh runs this, then its extra command): every test
# executable of .device/tests.tsv with its ignored tests, from its package folder, one test
# at a time; and prints a table of seconds per executable, slowest first, the total (the
# numbers the 90 s rule of the GPU suite is checked against), and the slowest tests
# (libtest's own times, `--report-time`, an unstable option that RUSTC_BOOTSTRAP=1 unlocks
# for a stable build).
#
# Usage, on the GPU machine from the repository root, after scripts/device-stage.sh:
#   [LANES=N] bash scripts/gpu-suite-timed.sh [LOG_DIR [SLOWEST]]
# Each executable's output goes to LOG_DIR/<executable>.log (default: $OUT/logs when OUT is
# set, as on the device tool, else a temporary folder); a failing one's tail is printed.
# LANES=N (default 5) runs up to N executables at once, the slowest known first
# (LONGEST_FIRST): most of a cold suite is NVRTC on one CPU core per executable, and the
# GPU machine has 16. Their tests still run one at a time within each executable; the
# processes share the GPU by time slices, and the JIT cache is safe to share (docs/runtime.md).
# On one H200, cold, the same machine (2026-12-03): 71.1 s with 3 lanes, 131.4 s with 1
# (benches/results/2026-12-03_gpu_suite_lanes.md); on one H100, cold, 16 executables
# (2026-12-07): 93.0 s with 4 lanes, 79.4 s with 5 (another machine each;
# benches/results/2026-12-07_probe_turns.md). LANES=1 runs them one after another.
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
[ -d .device/tests ] || tar -xzf .device/tests.tgz -C .device
# Tests may use paths compiled in on the build machine: make them lead here (as run.sh).
built_at=$(cat .device/root)
[ -e "$built_at" ] || { mkdir -p "$(dirname "$built_at")" && ln -s "$here" "$built_at"; }
target=$(cat .device/target)
[ -e "$target/release" ] || { mkdir -p "$target" && ln -s "$here/.device/bin" "$target/release"; }

lanes=${LANES:-5}
[[ "$lanes" =~ ^[1-9][0-9]*$ ]] || { echo "LANES must be a positive integer, not '$lanes'" >&2; exit 2; }
# The executables of a cold suite that took longest (one H100, 5 lanes, 2026-12-07:
# gpu_layer 67 s, gpu_ep 57, hf_reference 55, gpu_router 53, gpu_ep_routed 29, tune 26,
# gpu_ep_nodes 26, cli 11, run_weights 10), started first.
LONGEST_FIRST="gpu_layer gpu_ep hf_reference gpu_router gpu_ep_routed tune gpu_ep_nodes cli run_weights"

# One executable: its log, and a row "seconds, name, exit status, result" beside it.
run_one() {
  local exe=$1 dir=$2 begin status seconds result
  begin=$(date +%s.%N)
  (cd "$dir" && RUSTC_BOOTSTRAP=1 "$here/.device/tests/$exe" --include-ignored --test-threads=1 \
    -Z unstable-options --report-time) >"$logs/$exe.log" 2>&1
  status=$?
  seconds=$(awk -v a="$begin" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  result=$(grep -E '^test result' "$logs/$exe.log" | tail -1 | sed 's/test result: //; s/; finished.*//')
  printf '%s\t%s\t%s\t%s\n' "$seconds" "${exe%-*}" "$status" "$result" >"$rows_dir/$exe.row"
}

rows_dir=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-suite-rows.XXXXXX")
ordered=$(awk -F'\t' -v first="$LONGEST_FIRST" '
  BEGIN { n = split(first, names, " "); for (i = 1; i <= n; i++) rank[names[i]] = i }
  { name = $1; sub(/-[0-9a-f]+$/, "", name); print ((name in rank) ? rank[name] : 99) "\t" NR "\t" $0 }
' .device/tests.tsv | sort -t$'\t' -k1,1n -k2,2n | cut -f3-)
started=$(date +%s.%N)
while IFS=$'\t' read -r exe dir; do
  while [ "$(jobs -rp | wc -l)" -ge "$lanes" ]; do wait -n; done
  run_one "$exe" "$dir" &
done <<<"$ordered"
wait
failed=0
rows=""
while IFS=$'\t' read -r exe dir; do
  row=$(cat "$rows_dir/$exe.row")
  rows+="$row"$'\n'
  if [ "$(cut -f3 <<<"$row")" != 0 ]; then
    failed=1
    echo "!! $exe failed:"
    tail -30 "$logs/$exe.log"
  fi
done <<<"$ordered"
rm -rf "$rows_dir"
total=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "| seconds | executable | exit | result |"
echo "|---|---|---|---|"
printf '%s' "$rows" | sort -t$'\t' -k1,1 -rn | awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }'
echo "total: $total s with $lanes lane(s) (logs in $logs)"
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
