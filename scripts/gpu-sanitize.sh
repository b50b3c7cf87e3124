#!/usr/bin/env bash
# Runs shipped example layers under compute-sanitizer (memcheck, then racecheck) on the GPU
# machine, each checked against the CPU reference: one GPU, virtual ranks (2 and 4,
# skewed routing), two self-routed layers (the fused router), a self-routed layer on two
# virtual ranks (each rank's router, then the exchange on its choices) and two calls small
# enough for the ranks' fused decode (tiny on 4 ranks, Qwen3-30B-A3B on 2, self-routed),
# and the tiny layer on emulated nodes (the loopback's copies): two nodes of two virtual
# ranks, and of four (a copy of its spec; routed chunks through relays of a node of four).
# Full-size Mixtral-8x7B on two virtual ranks runs from a copy of its spec with
# `flag_timeout = 600_000 ms`: racecheck slows the exchange's kernels far past the default
# bound on one flag wait (about 2 s), which would report a time-out, not a hazard.
# DESIGN.md asks both tools to be clean. compute-sanitizer reads the device only where the machine allows it
# (device/KINDS.md: Firecracker yes, gVisor no).
#
# Usage, on the GPU machine from the repository root, with `moeforge` on PATH (staged by
# shared/device/stage.sh into .device/bin):
#   bash scripts/gpu-sanitize.sh
# Prints one line per (tool, case) with the tool's summary; exit status 1 if any case
# failed its check or the tool reported an error or a hazard.
set -uo pipefail

cases=(
  "dsl-examples/tiny.moe --ranks 1 --tokens 77"
  "dsl-examples/tiny.moe --ranks 2 --tokens 77"
  "dsl-examples/tiny.moe --ranks 4 --tokens 300 --routing skewed"
  "dsl-examples/tiny_emulated_nodes.moe --ranks 4 --tokens 77 --routing skewed"
  "TWO_NODES_OF_FOUR --ranks 8 --tokens 300 --routing skewed"
  "dsl-examples/qwen3_30b_a3b.moe --ranks 1 --tokens 16"
  "dsl-examples/gpt_oss_120b.moe --ranks 1 --tokens 3"
  "dsl-examples/qwen3_30b_a3b.moe --ranks 2 --tokens 40"
  "dsl-examples/tiny.moe --ranks 4 --tokens 9"
  "dsl-examples/qwen3_30b_a3b.moe --ranks 2 --tokens 5"
  "LONG_WAIT_MIXTRAL --ranks 2 --tokens 8"
  "LONG_WAIT_MIXTRAL --ranks 2 --tokens 64"
)
long_wait_mixtral=$(mktemp --suffix=.moe)
two_nodes_of_four=$(mktemp --suffix=.moe)
trap 'rm -f "$long_wait_mixtral" "$two_nodes_of_four"' EXIT
sed -e 's/gpus_per_node = 2/gpus_per_node = 4/; s/virtual_ranks = 4 /virtual_ranks = 8 /; s/expert = 4 /expert = 8 /' \
  dsl-examples/tiny_emulated_nodes.moe >"$two_nodes_of_four"
grep -q "virtual_ranks = 8 " "$two_nodes_of_four" || { echo "could not make two nodes of four from the tiny emulated spec" >&2; exit 1; }
# The layer is the file's last item: its closing brace gets a schedule section first.
sed '$ s/^}$/  schedule {\n    flag_timeout = 600_000 ms\n  }\n}/' dsl-examples/mixtral_8x7b.moe >"$long_wait_mixtral"
grep -q "flag_timeout" "$long_wait_mixtral" || { echo "could not add flag_timeout to the Mixtral spec" >&2; exit 1; }
failed=0
for tool in memcheck racecheck; do
  for case in "${cases[@]}"; do
    started=$(date +%s)
    # shellcheck disable=SC2046 # each case is a list of arguments
    out=$(timeout 1200 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      moeforge run $(sed "s|LONG_WAIT_MIXTRAL|$long_wait_mixtral|; s|TWO_NODES_OF_FOUR|$two_nodes_of_four|" <<<"$case") --check --seed 5 2>&1)
    status=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" <<<"$out" | tail -1)
    checks=$(grep -c "PASS" <<<"$out")
    echo "== $tool $case: exit $status, $checks PASS, $(( $(date +%s) - started )) s: $summary"
    if [ "$status" -ne 0 ]; then
      failed=1
      tail -20 <<<"$out"
    fi
  done
done
exit $failed
