#!/usr/bin/env bash
# Runs the whole test suite. Needs NVRTC: uses a CUDA toolkit if one is found
# (CUDA_HOME, CUDA_PATH, /usr/local/cuda), else installs the pinned pip wheels into
# .venv/ at the repository root (once). Tests that need NVRTC then must run, not skip
# (MOEFORGE_REQUIRE_NVRTC=1). Safe to run again: an installed .venv/ is reused.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CUDA_VERSION_PIN="13.0.88"
WHEELS="nvidia-cuda-nvrtc==$CUDA_VERSION_PIN nvidia-cuda-nvcc==$CUDA_VERSION_PIN nvidia-nvvm==$CUDA_VERSION_PIN nvidia-cuda-crt==$CUDA_VERSION_PIN"
VENV="$ROOT/.venv"
STAMP="$VENV/.moeforge-nvrtc-$CUDA_VERSION_PIN"

say() { printf '==> %s\n' "$*"; }

has_toolkit() {
    local root
    for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        [ -n "$root" ] || continue
        for lib in lib64 lib targets/x86_64-linux/lib; do
            if [ -f "$root/$lib/libnvrtc.so.13" ]; then
                say "using the CUDA toolkit at $root"
                return 0
            fi
        done
    done
    return 1
}

if ! has_toolkit; then
    if [ -f "$STAMP" ]; then
        say "reusing NVRTC $CUDA_VERSION_PIN wheels in $VENV"
    else
        say "no CUDA toolkit found: installing NVRTC $CUDA_VERSION_PIN wheels into $VENV"
        if [ ! -x "$VENV/bin/python" ]; then
            python3 -m venv "$VENV"
        fi
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet $WHEELS
        touch "$STAMP"
    fi
    export MOEFORGE_NVRTC_WHEEL="$VENV"
    say "MOEFORGE_NVRTC_WHEEL=$MOEFORGE_NVRTC_WHEEL"
fi

export MOEFORGE_REQUIRE_NVRTC=1
say "MOEFORGE_REQUIRE_NVRTC=1 (tests that need NVRTC fail instead of skipping)"

# Formatting differences are reported, not fatal, unless MOEFORGE_STRICT_FMT=1.
if cargo fmt --version >/dev/null 2>&1; then
    say "cargo fmt --all --check"
    if ! cargo fmt --all --check >/dev/null; then
        if [ "${MOEFORGE_STRICT_FMT:-0}" = 1 ]; then
            cargo fmt --all --check
        fi
        say "warning: some files are not formatted; run \`cargo fmt --all\`"
    fi
else
    say "rustfmt not installed: skipping the format check"
fi

say "cargo test --workspace"
cargo test --workspace
say "all tests passed"
