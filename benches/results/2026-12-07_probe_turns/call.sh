# Session 64: the tuner's comparisons with their calls in turns. SUITE=N first runs the GPU
# suite with N lanes (cold on a fresh machine); TESTS=1 (default) the runtime's GPU unit test
# of the paired timing and the tune GPU tests; then each layer of JOBS (MODEL:TOKENS, TOKENS
# `all` for every regime, or
# MODEL:TOKENS:off to tune as if no entry were in use, MOEFORGE_TUNING=off) tuned ROUNDS
# times (probes allowed) into caches of its own, to see whether the verdicts repeat.
# CALLER=1 tunes caller-routed calls (`tune --caller-routed`, since session 65).
# Run from the repository root after scripts/device-stage.sh.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
tg=$(cat .device/target); [ -e "$tg/release" ] || { mkdir -p "$tg" && ln -s "$PWD/.device/bin" "$tg/release"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
start=$(date +%s)
mkdir -p /tmp/o
[ -d .device/tests ] || tar -xzf .device/tests.tgz -C .device
if [ -n "${SUITE:-}" ]; then
  LANES=$SUITE bash scripts/gpu-suite-timed.sh /tmp/o/logs > /tmp/o/suite.txt 2>&1
  echo "suite exit $? at $(( $(date +%s) - start )) s"; head -20 /tmp/o/suite.txt | cut -c1-110
fi
if [ "${TESTS-1}" = 1 ]; then
  for exe in moeforge_runtime tune; do
    t=$PWD/$(ls .device/tests/$exe-* | head -1)
    (cd "$b" && timeout 150 $t --include-ignored --test-threads 1) > /tmp/o/${exe}_tests.txt 2>&1
    echo "$exe tests exit $? at $(( $(date +%s) - start )) s"; grep -E "test result|FAILED|panicked" /tmp/o/${exe}_tests.txt | head -5
  done
fi
for job in ${JOBS:-mixtral_8x7b:16384}; do
  m=${job%%:*}; rest=${job#*:}; tok=${rest%%:*}; tuning=on
  [ "$rest" != "$tok" ] && tuning=${rest#*:}
  tokens="--tokens $tok"; [ "$tok" = all ] && tokens=""
  calls=""; [ "${CALLER:-0}" = 1 ] && { calls="--caller-routed"; tuning=${tuning}_caller; }
  for round in $(seq 1 ${ROUNDS:-2}); do
    MOEFORGE_TUNING=${tuning%_caller} timeout ${TUNE_LIMIT:-150} moeforge tune dsl-examples/$m.moe $tokens --seed 7 $calls --cache /tmp/o/${m}_${tuning}_$round.json > /tmp/o/tune_${m}_${tuning}_$round.txt 2>&1
    echo "tune $m (tuning $tuning) round $round exit $? at $(( $(date +%s) - start )) s"
    grep -E " probe | in use | in turns |^\| [0-9]" /tmp/o/tune_${m}_${tuning}_$round.txt | cut -c1-240
  done
done
tar czf $OUT/probe_turns.tgz -C /tmp/o .
