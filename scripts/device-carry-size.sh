#!/usr/bin/env bash
# Prints how much a device call with `carry: [".device"]` sends (the files git tracks, the
# untracked ones it does not ignore, and .device/) against the device tool's 64 MiB, and
# warns when it is over: such a call is refused before any machine starts. Over, drop what
# the call does not run (.device/tests.tgz when it runs no tests, older probes).
# Usage, from the repository root: bash scripts/device-carry-size.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
staged=$( [ -d .device ] && du -sb .device | cut -f1 || echo 0)
total=$((tree + staged))
mib() { echo "$(( ($1 + 1024 * 1024 - 1) / (1024 * 1024) )) MiB"; }
echo "a device call carries $(mib "$total") of 64 (the tree $(mib "$tree"), .device $(mib "$staged"))"
if [ "$total" -gt "$limit" ]; then
  echo "warning: over the device tool's 64 MiB; the call would be refused. Largest in .device:" >&2
  du -ab .device 2>/dev/null | sort -rn | sed -n '2,5p' | while read -r bytes path; do echo "  $(mib "$bytes")  $path" >&2; done
fi
