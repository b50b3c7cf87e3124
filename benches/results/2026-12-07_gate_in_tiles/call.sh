# The gated shared expert's gate computed in GEMM1's first shared tile (warp-specialised
# regimes) instead of before GEMM1's tiles: gate_in_tiles.patch (session 61; written and
# checked on the CPU; no GPU could be started in sessions 61 and 62 to run it). The staged
# build (.device/bin, the suite) is the patched tree; main without it is the probe
# .device/probe/prologue:
#   git apply benches/results/2026-12-07_gate_in_tiles/gate_in_tiles.patch
#   MOEFORGE_BLESS=1 cargo test --release --test kernels_generated   (and --test cli,
#     -p moeforge-compiler --test diagnostics: the explain and kernel snapshots)
#   cargo build --release --workspace --all-targets && bash scripts/device-stage.sh
#   PROBE_REV=main bash scripts/probe-build.sh - prologue
# (the local branch probe/gate-in-tiles of session 62 holds the patch applied and blessed.)
# The call: with SUITE=1 the patched GPU suite; Qwen1.5-MoE-A2.7B at full size against the
# CPU reference (1, 16, 300, 2100 tokens: every regime, the mid and prefill ones computing
# the gate in their tiles); then the gate's cost in turns, ROUNDS rounds, at TOKENS:
#   prologue  the probe: the gate before GEMM1's tiles,
#   tiles     the patched build,
#   none      the patched build on the same layer with `gated = false`.
# With REAL=1 last, the quantized releases at real sizes
# (2026-12-07_quantized_checkpoints/real_sizes.sh). Run from the repository root.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
start=$(date +%s)
mkdir -p $OUT/raw
if [ "${SUITE:-0}" = 1 ]; then
  LANES=${LANES:-4} bash scripts/gpu-suite-timed.sh $OUT/logs 12 > $OUT/suite.txt 2>&1
  echo "suite exit $? at $(( $(date +%s) - start )) s"; grep -E "^!!|^\| +[0-9.]+ \| [a-z_]+ \| [^0]|^total" $OUT/suite.txt
fi
spec=dsl-examples/qwen1_5_moe_a2_7b.moe
for t in 1 16 300 2100; do
  moeforge run $spec --ranks 1 --tokens $t --check --seed 7 2>&1 | grep -E "out of bound|error|PASS|FAIL" | head -2
done
echo "checks done at $(( $(date +%s) - start )) s"
sed 's/^    gated = true.*$/    gated = false/' $spec > /tmp/ungated.moe
T=${TOKENS:-128,512,1024,4096}
for round in $(seq 1 ${ROUNDS:-3}); do
  .device/probe/prologue bench $spec --ranks 1 --tokens $T --seed 7 > $OUT/raw/prologue_$round.txt 2>&1
  moeforge bench $spec --ranks 1 --tokens $T --seed 7 > $OUT/raw/tiles_$round.txt 2>&1
  moeforge bench /tmp/ungated.moe --ranks 1 --tokens $T --seed 7 > $OUT/raw/none_$round.txt 2>&1
done
echo "benches done at $(( $(date +%s) - start )) s"
for f in $OUT/raw/*.txt; do echo "== $(basename $f)"; grep -E "^\| +[0-9]" $f | cut -d'|' -f2,3,4,12 | head -8; done
(cd $OUT && tar czf raw.tgz raw && rm -rf raw)
if [ "${REAL:-0}" = 1 ]; then
  LIMIT=$(( ${CALL_LIMIT:-560} - ($(date +%s) - start) )) bash benches/results/2026-12-07_quantized_checkpoints/real_sizes.sh
fi
