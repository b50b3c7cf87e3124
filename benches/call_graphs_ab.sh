#!/usr/bin/env bash
# What the layer's own graphs of repeated small calls change (`Plan::call_graph_max_tokens`):
# `moeforge bench` with them (the default) and with MOEFORGE_CALL_GRAPHS=0, one binary,
# interleaved (off, on, on, off, ...) so that the GPU's drift falls on both alike. Prints,
# per model and token count, each run's per-call, self-routed, bench-captured graph and
# back-to-back times (µs), then the medians.
#
# Usage, on the GPU machine from the repository root, after scripts/device-stage.sh:
#   bash benches/call_graphs_ab.sh [TOKENS [ROUNDS [MODELS...]]]
# TOKENS defaults to 1,16,128, ROUNDS to 2, MODELS to the four single-GPU examples. Full
# outputs go to $OUT/call_graphs_ab.tar.gz (or a temporary folder's logs).
set -euo pipefail

tokens=${1:-1,16,128}
rounds=${2:-2}
shift $(($# < 2 ? $# : 2))
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
binary=.device/bin/moeforge
logs=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-call-graphs.XXXXXX")
rows=$logs/rows.tsv

# One run: "model graphs T per-call self-routed graph back-to-back" rows from the table.
run() {
  local model=$1 graphs=$2 round=$3 log=$logs/${1}_graphs${2}_round${3}.txt
  MOEFORGE_CALL_GRAPHS=$graphs "$binary" bench "dsl-examples/$model.moe" --tokens "$tokens" \
    --seed 7 --ranks 1 --out "$logs/results" >"$log" 2>&1 || {
    echo "!! $model bench (MOEFORGE_CALL_GRAPHS=$graphs) failed; the end of $log:" >&2
    tail -20 "$log" >&2
    exit 1
  }
  awk -F'|' -v m="$model" -v g="$graphs" '
    NR == 1 || !header { for (i = 1; i <= NF; i++) { c = $i; gsub(/^ +| +$/, "", c); col[c] = i }
                         if ("graph us" in col) { header = 1; width = NF }; next }
    $2 ~ /^ *[0-9]+ *$/ && NF == width {
      v = ""
      split("T,moeforge us,self-routed us,graph us,back-to-back us", names, ",")
      for (n = 1; n <= 5; n++) {
        c = (names[n] in col) ? $(col[names[n]]) : "-"; gsub(/ /, "", c); v = v "\t" c
      }
      print m "\t" g v
    }' "$log" >>"$rows"
}

for model in "${models[@]}"; do
  for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) -eq 1 ]; then order="0 1"; else order="1 0"; fi
    for graphs in $order; do
      run "$model" "$graphs" "$round"
    done
  done
done

echo "per run (µs): model, MOEFORGE_CALL_GRAPHS, T, per call, self-routed, bench's graph, back to back"
sort -t"$(printf '\t')" -k1,1 -k3,3n -k2,2n "$rows"
echo
echo "| model | T | per call: eager → graphs | self-routed: eager → graphs | bench's graph (eager / graphs runs) | back to back: eager → graphs |"
echo "|---|---|---|---|---|---|"
python3 - "$rows" <<'EOF'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    model, graphs, t, *values = line.rstrip("\n").split("\t")
    runs[(model, int(t), graphs)].append([float(v) if v not in ("", "-") else float("nan") for v in values])
def med(model, t, graphs, i):
    return statistics.median(r[i] for r in runs[(model, t, graphs)])
for model, t in sorted({(m, t) for m, t, _ in runs}, key=lambda k: (k[0], k[1])):
    cells = []
    for i in range(4):
        off, on = med(model, t, "0", i), med(model, t, "1", i)
        cells.append(f"{off:.1f} / {on:.1f}" if i == 2 else f"{off:.1f} → {on:.1f} ({on - off:+.1f})")
    print(f"| {model} | {t} | " + " | ".join(cells) + " |")
EOF
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/call_graphs_ab.tar.gz" -C "$logs" .
fi
