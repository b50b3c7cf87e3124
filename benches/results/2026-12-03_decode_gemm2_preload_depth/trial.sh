#!/usr/bin/env bash
# Qwen3 decode GEMM2 tile/stage trials from tuning caches, each against the shipped table, same binary.
export MOEFORGE_CACHE_DIR=/tmp/mf-cache
for t in g2_16x64_s5 g2_16x64_s4 g2_16x64_s3; do
  echo "== trial $t"
  MOEFORGE_TUNING_CACHE=.device/trials/$t.json timeout 60 .device/bin/moeforge run dsl-examples/qwen3_30b_a3b.moe --tokens 200 --seed 7 --check 2>&1 | tail -1 | cut -c1-120
  OUT=$OUT/$t MODELS=qwen3_30b_a3b TOKENS=1,2,4,16,128,256 NEW_ENV="MOEFORGE_TUNING_CACHE=.device/trials/$t.json" timeout 170 bash benches/build_ab.sh .device/bin/moeforge 2
done
