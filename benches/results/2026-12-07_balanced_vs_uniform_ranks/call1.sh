#!/usr/bin/env bash
# session 66, call 1 (after the GPU suite): tune --caller-routed on a GPU for the first time; GPT-OSS on two virtual ranks at 2048-8192 tokens per rank and alone at 4096-16384; Nsight Compute of Qwen3 at 4096 (see 2026-12-07_qwen3_4096_kernels.md; the run used `run` without --calls: call1b)
set -u
M=.device/bin/moeforge
date -u
echo "== tune --caller-routed qwen3 128"
timeout 240 $M tune dsl-examples/qwen3_30b_a3b.moe --tokens 128 --caller-routed --seed 7 --cache $OUT/tune_caller.json 2>&1 | tail -25
echo "== explain of the caller-routed cache"
MOEFORGE_TUNING_CACHE=$OUT/tune_caller.json $M explain dsl-examples/qwen3_30b_a3b.moe 2>&1 | grep -i -E "cache|uniform|regime" | head -20
echo "== gpt-oss ranks 2"
timeout 200 $M bench dsl-examples/gpt_oss_120b.moe --ranks 2 --tokens 2048,4096,8192 --seed 7 --iterations 20 --out $OUT 2>&1 | tail -8
echo "== gpt-oss one gpu"
timeout 200 $M bench dsl-examples/gpt_oss_120b.moe --tokens 4096,8192,16384 --seed 7 --iterations 20 --out $OUT/one 2>&1 | tail -8
echo "== ncu qwen3 4096 prefill kernels (serialised, clocks left alone)"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 180 $NCU --clock-control none --kernel-name regex:'qwen3_30b_a3b_(prefill|route|sort|invert|combine)' --launch-skip 7 --launch-count 7 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
  $M run dsl-examples/qwen3_30b_a3b.moe --ranks 1 --tokens 4096 --calls 3 --seed 7 > $OUT/ncu_qwen3_4096.txt 2>&1
echo "ncu rc $?"; grep -E "^  [a-z0-9_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|Achieved Occupancy" $OUT/ncu_qwen3_4096.txt | head -60
