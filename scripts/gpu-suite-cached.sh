#!/usr/bin/env bash
# Runs the staged GPU suite (.device/run.sh, staged by scripts/device-stage.sh) with the
# NVRTC cache an earlier run left, and keeps this run's cache for the next one.
#
# A fresh GPU machine has an empty cache, so each test executable compiles its layers
# through NVRTC first (the layers of gpu_layer, gpu_router and gpu_ep alone took 104 s of
# NVRTC time, one layer after another, on the CPU machine on 2026-11-30). The cache is
# keyed by a hash of the source, the options, the NVRTC version and build, and the architecture
# (docs/runtime.md), so an entry of an earlier run serves only the very same kernels;
# changed kernels are compiled as before. What the suite runs and checks is unchanged.
#
# Usage, on the GPU machine from the repository root:
#   bash scripts/gpu-suite-cached.sh [ARCHIVE [EXTRA COMMAND...]]
# The extra command goes to .device/run.sh, which runs it after the tests. ARCHIVE
# (default .device/jit-cache.tar.xz) is a cache this script wrote before; a missing or
# unreadable one means a cold cache. The cache after the run is written to
# $OUT/jit-cache.tar.xz when OUT is set (the device tool's output folder), else next to
# ARCHIVE as jit-cache.next.tar.xz. Copy it into .device/ after staging for the next run
# (43 of the suite's modules took 42 MB, 2.3 MB as .tar.xz, on 2026-11-30).
# Exit status: that of .device/run.sh.
set -uo pipefail

archive=${1:-.device/jit-cache.tar.xz}
shift $(( $# > 0 ))
cache=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-suite-cache.XXXXXX")
if [ -f "$archive" ]; then
  if tar -xJf "$archive" -C "$cache"; then
    echo "== JIT cache from $archive: $(find "$cache" -name '*.mfjit' | wc -l) modules"
  else
    echo "== $archive is unreadable: running with a cold JIT cache"
  fi
else
  echo "== no $archive: running with a cold JIT cache"
fi

started=$(date +%s)
MOEFORGE_CACHE_DIR=$cache bash .device/run.sh "$@"
status=$?
echo "== GPU suite: $(( $(date +%s) - started )) s, exit status $status"

saved=${OUT:+$OUT/jit-cache.tar.xz}
saved=${saved:-$(dirname "$archive")/jit-cache.next.tar.xz}
if [ -d "$cache/jit" ] && tar -cJf "$saved" -C "$cache" jit; then
  echo "== JIT cache for the next run: $saved ($(du -h "$saved" | cut -f1))"
fi
rm -rf "$cache"
exit $status
