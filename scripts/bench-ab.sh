#!/usr/bin/env bash
# Compares two builds of moeforge on one layer, interleaved: A, B, B, A, A, B, ... so that
# the GPU's drift between runs (clocks, heat: up to 5% on large calls on an H200) falls on
# both builds alike instead of on the change. Prints, per token count, each run's layer time
# (caller-routed, µs) and the medians.
#
# Usage, on the GPU machine from the repository root:
#   bash scripts/bench-ab.sh A_BINARY B_BINARY FILE.moe [TOKENS] [ROUNDS]
# TOKENS defaults to 1,128,4096 and ROUNDS to 3. Each run is one `moeforge bench` call
# (which also writes its results under benches/results/, as usual); full outputs go to
# $OUT/ab (or a temporary folder).
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
a=$1
b=$2
file=$3
tokens=${4:-1,128,4096}
rounds=${5:-3}
logs=${OUT:+$OUT/ab}
logs=${logs:-$(mktemp -d "${TMPDIR:-/tmp}/moeforge-ab.XXXXXX")}
mkdir -p "$logs"

# One run: "T us" lines from the bench table (its third column is moeforge's time).
run() {
  local binary=$1 log=$2
  "$binary" bench "$file" --tokens "$tokens" --seed 7 > "$log" 2>&1 || {
    echo "!! $binary bench failed; the end of $log:" >&2
    tail -20 "$log" >&2
    exit 1
  }
  awk -F'|' '$2 ~ /^ *[0-9]+ *$/ { gsub(/ /, "", $2); gsub(/ /, "", $4); print $2, $4 }' "$log"
}

results=$(mktemp)
for round in $(seq 1 "$rounds"); do
  # A, B in odd rounds and B, A in even ones: whichever build runs second in a round finds
  # the GPU warmer (on 20 ms calls that measured 1-2% against it, 2026-11-30).
  order="A B"
  [ $((round % 2)) = 0 ] && order="B A"
  for side in $order; do
    binary=$a
    [ "$side" = B ] && binary=$b
    echo "round $round: $side ($binary)" >&2
    run "$binary" "$logs/$side-$round.txt" | sed "s/^/$side /" >> "$results"
  done
done

echo "$(basename "$file" .moe): A = $a, B = $b, $rounds interleaved rounds"
echo "| T | A runs (us) | B runs (us) | A median | B median | B vs A |"
echo "|---|---|---|---|---|---|"
for t in ${tokens//,/ }; do
  a_runs=$(awk -v t="$t" '$1 == "A" && $2 == t { print $3 }' "$results" | sort -n)
  b_runs=$(awk -v t="$t" '$1 == "B" && $2 == t { print $3 }' "$results" | sort -n)
  median() { awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
  a_median=$(echo "$a_runs" | median)
  b_median=$(echo "$b_runs" | median)
  change=$(awk -v a="$a_median" -v b="$b_median" 'BEGIN { printf "%+.1f%%", (b / a - 1) * 100 }')
  echo "| $t | $(echo $a_runs | tr ' ' '/') | $(echo $b_runs | tr ' ' '/') | $a_median | $b_median | $change |"
done
rm -f "$results"
