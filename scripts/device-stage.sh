#!/usr/bin/env bash
# Stages the GPU suite for the GPU machine: shared/device/stage.sh copies the release
# binaries and every test executable into .device/, then this keeps only what runs GPU
# code there:
#   - test executables with ignored tests (`#[ignore = "needs a CUDA GPU"]`);
#   - those whose tests run the `moeforge` binary, which runs a layer when a GPU is present
#     (RUN_A_GPU_WHEN_PRESENT below);
#   - the `moeforge` binary.
# The other test executables are CPU tests, which CI runs (`.ci/run`): on the GPU machine
# they took device time (examples_compile alone 72 s of NVRTC on 2026-12-03) and room in the
# 64 MiB the device tool carries.
#
# Usage, from the repository root: bash scripts/device-stage.sh [extra cargo args]
#   STAGE=path/to/stage.sh overrides where shared/device/stage.sh is (default
#   ../shared/device/stage.sh).
# Then, on the GPU machine: bash .device/run.sh, or bash scripts/gpu-suite-timed.sh.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
stage=${STAGE:-../shared/device/stage.sh}
[ -f "$stage" ] || { echo "no $stage: set STAGE to shared/device/stage.sh" >&2; exit 2; }
RUN_A_GPU_WHEN_PRESENT="cli run_inputs run_weights"

bash "$stage" "$@"

kept=$(mktemp)
dropped=()
while IFS=$'\t' read -r exe dir; do
  name=${exe%-*}
  ignored=$(cd "$dir" && "$root/.device/tests/$exe" --list --ignored 2>/dev/null | grep -c ': test$' || true)
  if [ "$ignored" -gt 0 ] || [[ " $RUN_A_GPU_WHEN_PRESENT " == *" $name "* ]]; then
    printf '%s\t%s\n' "$exe" "$dir" >> "$kept"
  else
    rm -f ".device/tests/$exe"
    dropped+=("$name")
  fi
done < .device/tests.tsv
mv "$kept" .device/tests.tsv
find .device/bin -type f ! -name moeforge -delete
echo "GPU suite: $(wc -l < .device/tests.tsv) test executables kept, ${#dropped[@]} CPU-only left to CI (${dropped[*]}); .device is $(du -sh .device | cut -f1)"
