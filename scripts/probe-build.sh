#!/usr/bin/env bash
# Builds a probe: the moeforge binary of this checkout's HEAD (or another commit) with a
# patch applied, stripped into .device/probe/NAME for the GPU machine (`run` with `carry:
# [".device"]`), beside the HEAD build that scripts/device-stage.sh puts in .device/bin/.
# The patch is applied to a scratch worktree (so uncommitted changes here do not leak in;
# its files are all new, so the templates askama compiles in are rebuilt), built with its
# own target folder (kept between runs: the dependencies build once), and the worktree
# removed. A probe is never committed; its patch is kept beside its results.
#
# Usage, from the repository root: bash scripts/probe-build.sh PATCH NAME
#   PATCH `-` builds without a patch (a baseline of another commit, with PROBE_REV);
#   PROBE_REV builds that commit instead of HEAD (e.g. the commit before a change, to time
#   it against HEAD in one call); PROBE_TARGET_DIR overrides the target folder (default
#   /tmp/moeforge-probe-target).
# Stage first (scripts/device-stage.sh empties .device/), then build the probes.
set -euo pipefail

if [ $# -ne 2 ]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
patch=
if [ "$1" != - ]; then
  [ -f "$1" ] || { echo "no patch at $1" >&2; exit 2; }
  patch=$(realpath "$1")
fi
name=$2
cd "$(git rev-parse --show-toplevel)"
rev=$(git rev-parse --verify --quiet "${PROBE_REV:-HEAD}^{commit}") || { echo "no commit ${PROBE_REV:-HEAD}" >&2; exit 2; }
target=${PROBE_TARGET_DIR:-/tmp/moeforge-probe-target}
worktree=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-probe.XXXXXX")
rmdir "$worktree"
trap 'git worktree remove --force "$worktree" 2>/dev/null || true' EXIT

git worktree add --quiet --detach "$worktree" "$rev"
[ -z "$patch" ] || git -C "$worktree" apply "$patch"
echo "==> building $name: $(git rev-parse --short "$rev")${patch:+ + $(basename "$patch")}"
(cd "$worktree" && CARGO_TARGET_DIR=$target cargo build --release -p moeforge --quiet)
mkdir -p .device/probe
strip -o ".device/probe/$name" "$target/release/moeforge"
echo "==> .device/probe/$name ($(du -h ".device/probe/$name" | cut -f1))"
bash scripts/device-carry-size.sh
