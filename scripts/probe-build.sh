#!/usr/bin/env bash
# Builds a probe: the moeforge binary of this checkout's HEAD with a patch applied, stripped
# into .device/probe/NAME for the GPU machine (`run` with `carry: [".device"]`), beside the
# HEAD build that scripts/device-stage.sh puts in .device/bin/. The patch is applied to a
# scratch worktree of HEAD (so uncommitted changes here do not leak in; its files are all
# new, so the templates askama compiles in are rebuilt), built with its own target folder
# (kept between runs: the dependencies build once), and the worktree removed. A probe is
# never committed; its patch is kept beside its results.
#
# Usage, from the repository root: bash scripts/probe-build.sh PATCH NAME
#   PROBE_TARGET_DIR overrides the target folder (default /tmp/moeforge-probe-target).
# Stage first (scripts/device-stage.sh empties .device/), then build the probes.
set -euo pipefail

if [ $# -ne 2 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
[ -f "$1" ] || { echo "no patch at $1" >&2; exit 2; }
patch=$(realpath "$1")
name=$2
cd "$(git rev-parse --show-toplevel)"
target=${PROBE_TARGET_DIR:-/tmp/moeforge-probe-target}
worktree=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-probe.XXXXXX")
rmdir "$worktree"
trap 'git worktree remove --force "$worktree" 2>/dev/null || true' EXIT

git worktree add --quiet --detach "$worktree" HEAD
git -C "$worktree" apply "$patch"
echo "==> building $name: HEAD ($(git rev-parse --short HEAD)) + $(basename "$patch")"
(cd "$worktree" && CARGO_TARGET_DIR=$target cargo build --release -p moeforge --quiet)
mkdir -p .device/probe
strip -o ".device/probe/$name" "$target/release/moeforge"
echo "==> .device/probe/$name ($(du -h ".device/probe/$name" | cut -f1))"
