#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/run-example.sh: makes NVRTC available. Uses a CUDA
# toolkit if one is found (CUDA_HOME, CUDA_PATH, /usr/local/cuda), else installs the
# pinned pip wheels into .venv/ at the repository root (once) and points moeforge at them.
# Expects ROOT (the repository root) to be set.

CUDA_VERSION_PIN="13.0.88"
WHEELS="nvidia-cuda-nvrtc==$CUDA_VERSION_PIN nvidia-cuda-nvcc==$CUDA_VERSION_PIN nvidia-nvvm==$CUDA_VERSION_PIN nvidia-cuda-crt==$CUDA_VERSION_PIN"
VENV="$ROOT/.venv"
STAMP="$VENV/.moeforge-nvrtc-$CUDA_VERSION_PIN"

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

