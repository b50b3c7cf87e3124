# Fresh files of today's kernels on two virtual ranks of one GPU, for the simulator's
# calibration (issue 10: `moeforge simulate M.moe --measured FILE.json`). SUITE=1 first runs
# the GPU suite (.device/run.sh). MODELS: the examples to bench (default the four of the
# 24-cell table). Build: bash scripts/device-stage.sh. Run with carry [".device"]:
#   SUITE=1 MODELS="qwen3_30b_a3b mixtral_8x7b" bash benches/results/2026-12-07_virtual_ranks_at_9ef6366/call.sh
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.sm,power.limit --format=csv,noheader
if [ "${SUITE:-0}" = 1 ]; then
  start=$(date +%s)
  bash .device/run.sh > $OUT/suite.log 2>&1; echo "suite rc $? in $(( $(date +%s) - start )) s"
  grep -E "^test result|^!!|panicked|lanes|wall" $OUT/suite.log | awk '{print $1,$2,$3,$4,$5,$6,$NF}' | sort | uniq -c
fi
for m in ${MODELS:-qwen3_30b_a3b mixtral_8x7b deepseek_v3 gpt_oss_120b}; do
  start=$(date +%s)
  timeout ${BENCH_TIMEOUT:-200} .device/bin/moeforge bench dsl-examples/$m.moe --ranks 2 --tokens ${TOKENS:-128,1024,4096} --seed 7 --iterations 20 --out $OUT > $OUT/$m.txt 2>&1 || echo "bench $m rc $?"
  echo "== $m ($(( $(date +%s) - start )) s)"
  grep -E "^\| +[0-9]+ \|" $OUT/$m.txt | cut -c1-120
done
