# DeepSeek-V3 on two virtual ranks ran 8-10% slower at 9ef6366 than the 7046353 file of
# 2026-12-06 (another H100): the two builds in one call, rounds A B A (A = 7046353 built as a
# probe: PROBE_REV=7046353 bash scripts/probe-build.sh - ep7046353; B = HEAD, staged).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
round=0
for bin in .device/probe/ep7046353 .device/bin/moeforge .device/probe/ep7046353; do
  round=$((round + 1)); start=$(date +%s)
  timeout ${BENCH_TIMEOUT:-90} $bin bench dsl-examples/deepseek_v3.moe --ranks 2 --tokens ${TOKENS:-128,4096} --seed 7 --iterations 20 > $OUT/ab_$round.txt 2>&1 || echo "rc $?"
  echo "== round $round $bin ($(( $(date +%s) - start )) s)"
  grep -E "^\| +[0-9]+ \|" $OUT/ab_$round.txt | cut -c1-130
done
