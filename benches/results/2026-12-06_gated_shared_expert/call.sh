# Device calls for the gated shared expert (Qwen2-MoE's shared_expert_gate), sessions 59-60:
# the GPU suite, Qwen1.5-MoE-A2.7B at full size against the CPU reference (one GPU and 4
# virtual ranks), then what the gate costs a call on one GPU, in turns, ROUNDS rounds:
#   launch  the gate as a launch of its own ahead of each call (5b89da7, the probe build
#           .device/probe/gatelaunch: PROBE_REV=5b89da7 bash scripts/probe-build.sh - gatelaunch;
#           skipped where that probe is absent: with both probes the tree passes run's 64 MiB),
#   loop    GEMM1's warps computing it before its tiles, a dependent load per 16 bytes
#           (275a20f: PROBE_REV=275a20f bash scripts/probe-build.sh - gemm1loop; skipped
#           where that probe is absent),
#   gemm1   the same with four loads in flight per lane (this build),
#   none    the same layer with `gated = false` (this build): the floor the gate adds to.
# Neither runs a fused decode (off on one GPU unless the spec asks). Then, with RANK_BENCH=1,
# on 4 virtual ranks (which keep the shared expert from 2026-12-07 on; before, the bench left
# it out, gate and all): this build's table (MOEFORGE_FUSED_DECODE=0) against its fused
# decode, which computes the gate in its shared-slice tiles.
# SUITE=0 and CHECKS=0 leave out the suite and the full-size checks.
# Run from the repository root after scripts/device-stage.sh and the probe builds.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
mkdir -p $OUT/raw
if [ "${SUITE:-1}" = 1 ]; then
  LANES=${LANES:-3} bash scripts/gpu-suite-timed.sh $OUT/logs 12 2>&1 | tail -22
fi
spec=dsl-examples/qwen1_5_moe_a2_7b.moe
if [ "${CHECKS:-1}" = 1 ]; then
for t in 1 16 300 2100; do
  moeforge run $spec --ranks 1 --tokens $t --check --seed 7 2>&1 | grep -E "out of bound|expert|error|PASS|FAIL" | head -3
done
for t in 1 200; do
  moeforge run $spec --ranks 4 --tokens $t --check --seed 7 2>&1 | grep -E "out of bound|expert|error|PASS|FAIL" | head -6
done
fi
sed 's/^    gated = true.*$/    gated = false/' $spec > /tmp/ungated.moe
grep -c "gated = false" /tmp/ungated.moe
T=${TOKENS:-1,16,128,1024,4096}
for round in $(seq 1 ${ROUNDS:-2}); do
  if [ -x .device/probe/gatelaunch ]; then
    .device/probe/gatelaunch bench $spec --ranks 1 --tokens $T --seed 7 > $OUT/raw/launch_$round.txt 2>&1
  fi
  if [ -x .device/probe/gemm1loop ]; then
    .device/probe/gemm1loop bench $spec --ranks 1 --tokens $T --seed 7 > $OUT/raw/loop_$round.txt 2>&1
  fi
  moeforge bench $spec --ranks 1 --tokens $T --seed 7 > $OUT/raw/gemm1_$round.txt 2>&1
  moeforge bench /tmp/ungated.moe --ranks 1 --tokens $T --seed 7 > $OUT/raw/none_$round.txt 2>&1
done
if [ "${RANK_BENCH:-0}" = 1 ]; then
  MOEFORGE_FUSED_DECODE=0 moeforge bench $spec --ranks 4 --tokens 1,8,32 --seed 7 > $OUT/raw/ranks_table.txt 2>&1
  moeforge bench $spec --ranks 4 --tokens 1,8,32 --seed 7 > $OUT/raw/ranks_fused.txt 2>&1
fi
for f in $OUT/raw/*.txt; do echo "== $(basename $f)"; grep -E "^\| +[0-9]" $f | cut -d'|' -f2,3,4,7,12,13 | head -12; done
