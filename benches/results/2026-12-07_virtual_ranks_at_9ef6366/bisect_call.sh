# Where DeepSeek-V3's two-virtual-rank slowdown (ab_call.sh: HEAD 4-8% behind 7046353) came
# in: the layer at 4096 tokens per rank with builds between them, each once, in this order.
# Probes: PROBE_REV=REV bash scripts/probe-build.sh - epREV (d27150ba: the ranks' expert
# biases in; 1c50a1fb: the gated shared expert in, before the regime cuts).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for bin in ${BINS:-.device/probe/epd27150ba .device/probe/ep1c50a1fb .device/bin/moeforge .device/probe/ep7046353}; do
  start=$(date +%s); name=$(basename $bin)
  timeout ${BENCH_TIMEOUT:-60} $bin bench dsl-examples/deepseek_v3.moe --ranks 2 --tokens ${TOKENS:-4096} --seed 7 --iterations 20 > $OUT/bisect_$name.txt 2>&1 || echo "rc $?"
  echo "== $name ($(( $(date +%s) - start )) s)"
  grep -E "^\| +[0-9]+ \|" $OUT/bisect_$name.txt | cut -c1-150
done
