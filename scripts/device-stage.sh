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
# 64 MiB the device tool carries. The kept test executables travel packed (.device/tests.tgz,
# about a third of their size: the tree and the unpacked suite together passed 64 MiB on
# 2026-12-05); scripts/gpu-suite-timed.sh (which .device/run.sh runs) unpacks them on the
# GPU machine before it runs the suite.
#
# Usage, from the repository root: bash scripts/device-stage.sh [extra cargo args]
#   STAGE=path/to/stage.sh overrides where shared/device/stage.sh is (default
#   ../shared/device/stage.sh);
#   JIT_CACHE=path/to/jit-cache.tar.xz copies a cache an earlier run of
#   scripts/gpu-suite-cached.sh left (its $OUT/jit-cache.tar.xz) to .device/, where that
#   script looks for it (stage.sh empties .device/ first).
# Then, on the GPU machine: bash .device/run.sh, scripts/gpu-suite-timed.sh (seconds per
# executable and the slowest tests) or scripts/gpu-suite-cached.sh (with that cache).
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
tar -czf .device/tests.tgz -C .device tests
rm -r .device/tests
# shared/device/run.sh runs the executables one after another (their own times in a cold
# five-lane run on an H100 on 2026-12-07 add up to about 370 s); this one runs them
# through scripts/gpu-suite-timed.sh, five at a time (77-79 s cold there), then the extra
# command, as shared/device/run.sh would.
cat > .device/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs the GPU suite scripts/device-stage.sh staged (unpacking it first), several test
# executables at a time (scripts/gpu-suite-timed.sh: LANES, default 5; LANES=1 one after
# another), then the extra command given as arguments (e.g. .device/bin/moeforge bench ...).
# Exit status: non-zero if any test executable or the extra command failed.
cd "$(dirname "$0")/.." || exit 2
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv,noheader
fail=0
logs=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-suite.XXXXXX")
bash scripts/gpu-suite-timed.sh "$logs" || fail=1
# The device tool brings back few files: a failing suite's logs come back as one archive.
if [ "$fail" != 0 ] && [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/suite-logs.tgz" -C "$logs" . && echo "the suite's logs: \$OUT/suite-logs.tgz"
fi
if [ $# -gt 0 ]; then
  echo "== $*"
  "$@" || { echo "!! extra command failed"; fail=1; }
fi
exit $fail
RUN
if [ -n "${JIT_CACHE:-}" ]; then
  cp "$JIT_CACHE" .device/jit-cache.tar.xz
fi
echo "GPU suite: $(wc -l < .device/tests.tsv) test executables kept, ${#dropped[@]} CPU-only left to CI (${dropped[*]}); .device is $(du -sh .device | cut -f1)"
bash scripts/device-carry-size.sh
