# GPT-OSS-120B's expert biases on the expert-parallel path (session 58): the GPU suite,
# `run --ranks 2 --check` of the full-size layer at counts that run the ranks' fused decode
# and each rank regime (self-routed: the spec has a router), then `bench --ranks 2` (virtual ranks of
# one GPU) with its baselines. Build: bash scripts/device-stage.sh. Run with carry
# [".device"]: bash benches/results/2026-12-06_gpt_oss_ranks/call.sh
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
start=$(date +%s)
bash .device/run.sh > $OUT/suite.log 2>&1; echo "suite rc $? in $(( $(date +%s) - start )) s"
grep -E "^test result|^!!|panicked" $OUT/suite.log | awk '{print $1,$2,$3,$4,$5,$6,$NF}' | sort | uniq -c
grep -E "gpt_oss.*rank [0-9]" $OUT/suite.log | head -12
for t in 1 20 200 2100; do
  timeout 150 .device/bin/moeforge run dsl-examples/gpt_oss_120b.moe --ranks 2 --tokens $t --seed 5 --check --sample 64 > /tmp/r.txt 2>&1
  echo "check gpt_oss ranks 2, $t per rank (self-routed): rc $? $(grep -E -o 'PASS|FAIL' /tmp/r.txt | sort | uniq -c | tr -s ' \n' ' ')"
  grep -iE "error|fused" /tmp/r.txt | head -3
done
timeout 200 .device/bin/moeforge bench dsl-examples/gpt_oss_120b.moe --ranks 2 --tokens 1,16,128,1024,4096 --seed 7 --iterations 20 --out $OUT > $OUT/bench.txt 2>&1 || echo "bench rc $?"
grep -E "^\| +[0-9]+ \|" $OUT/bench.txt
