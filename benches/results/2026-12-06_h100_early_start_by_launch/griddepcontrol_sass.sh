#!/usr/bin/env bash
# What `griddepcontrol.wait` and `griddepcontrol.launch_dependents` become in SASS on sm_90a
# (whether a waiting block sleeps or polls): a two-line kernel through nvcc and cuobjdump.
# On the GPU machine: bash benches/results/2026-12-06_h100_early_start_by_launch/griddepcontrol_sass.sh
set -euo pipefail
d=$(mktemp -d)
cat > "$d/k.cu" <<'CU'
extern "C" __global__ void waits(float* out) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    out[threadIdx.x] = 1.f;
}
extern "C" __global__ void waits_then_signals(float* out) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    out[threadIdx.x] = 1.f;
}
CU
PATH=/usr/local/cuda/bin:$PATH
nvcc -arch=sm_90a -cubin -o "$d/k.cubin" "$d/k.cu"
cuobjdump --dump-sass "$d/k.cubin" | grep -E "Function|^\s+/\*[0-9a-f]{4}\*/" | sed 's/ *\/\* 0x[0-9a-f]* \*\///'
