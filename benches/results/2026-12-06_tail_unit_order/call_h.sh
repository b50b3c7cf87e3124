# Call H (ready, not yet run): units claimed in order AS BUILT (f137259 and after) on the GPU.
# The GPU suite first, then `run --check` at tail-heavy token counts, then HEAD against
# 694b2c6 (units dealt by block index), uniform routing, two rounds, and HEAD on balanced
# routing once. About 8 minutes of device time; on an H200 or an H100 (say which).
# Build: bash scripts/device-stage.sh (HEAD and its tests into .device/), then
# PROBE_REV=694b2c6 bash scripts/probe-build.sh - base. Run with carry [".device"]:
# bash benches/results/2026-12-06_tail_unit_order/call_h.sh
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
nvidia-smi --query-gpu=name --format=csv,noheader
bash .device/run.sh > /tmp/suite.log 2>&1; echo "GPU suite: rc $?"; grep -E "^test result|FAILED|panicked" /tmp/suite.log | sort | uniq -c
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
for spec in "mixtral_8x7b 260" "mixtral_8x7b 1100" "mixtral_8x7b 4100" "deepseek_v3 2100" "gpt_oss_120b 2100" "gpt_oss_120b 16384" "qwen3_30b_a3b 1100" "qwen3_30b_a3b 4096"; do set -- $spec
  timeout 90 .device/bin/moeforge run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 64 > /tmp/r.txt 2>&1
  echo "HEAD check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
bench() {  # label binary model tokens routing
  timeout 120 $2 bench dsl-examples/$3.moe --tokens $4 --seed 7 --iterations 20 --routing $5 --out /tmp/b > /tmp/o.txt 2>&1 || { echo "$3 $4 $1 failed"; tail -3 /tmp/o.txt; }
  echo "$3 $4 $1: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
}
for round in 1 2; do
  for spec in "mixtral_8x7b 1024" "mixtral_8x7b 4096" "mixtral_8x7b 16384" "deepseek_v3 4096" "deepseek_v3 16384" "gpt_oss_120b 4096" "gpt_oss_120b 16384" "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384"; do
    set -- $spec
    bench "base r$round" .device/probe/base $1 $2 uniform
    bench "HEAD r$round" .device/bin/moeforge $1 $2 uniform
    [ $round = 1 ] && bench "HEAD balanced" .device/bin/moeforge $1 $2 balanced
  done
done
