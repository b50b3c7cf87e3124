#!/usr/bin/env bash
# The main job on a fresh machine: compiles a shipped example layer through NVRTC and, when
# a GPU is present, runs it on random inputs and checks it against the CPU reference.
# Usage: bash scripts/run-example.sh [FILE] [extra `moeforge run` arguments]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '==> %s\n' "$*"; }
# shellcheck source=scripts/nvrtc-env.sh
source "$ROOT/scripts/nvrtc-env.sh"
file=${1:-dsl-examples/mixtral_8x7b.moe}
shift || true
say "cargo run --release -- run $file --tokens 128 --check $*"
cargo run --release --quiet -- run "$file" --tokens 128 --check "$@"
