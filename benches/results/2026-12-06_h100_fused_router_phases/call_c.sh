# Call C of 2026-12-06 (one H100): the GPU suite, run --check, the router phases of two
# probe builds (.device/probe0: the base, .device/probe: the new router) and ab.sh of the
# base (.device/base) against the new build (.device/bin).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
LANES=3 bash scripts/gpu-suite-timed.sh /tmp/logs 6 2>&1 | tail -24
for m in deepseek_v3 gpt_oss_120b qwen3_30b_a3b mixtral_8x7b; do for t in 1 16 256; do timeout 120 .device/bin/moeforge run dsl-examples/$m.moe --tokens $t --seed 11 --check 2>&1 | grep -E "PASS|FAIL|rror" | sed -e 's/: 0 of .*router over/: router over/; s/ 0 logits out of bound (worst .* of its bound),//; s/, 0 weights out of bound.*: / /' | head -3; done; done
for spec in "deepseek_v3 1 16 256 512" "gpt_oss_120b 1 64 512" "qwen3_30b_a3b 1 16 256" "mixtral_8x7b 64"; do set -- $spec; m=$1; shift; for t in "$@"; do for p in probe0 probe; do
  timeout 120 .device/$p/moeforge bench dsl-examples/$m.moe --tokens $t --seed 7 --iterations 3 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$m $t $p failed"
  grep "PROBE router" /tmp/o.txt | tail -2 | sed "s/^PROBE router/$m $p/; s/waited [^,]*, //"
done; done; done
BUILDS="base:.device/base/moeforge new:.device/bin/moeforge" SPECS="deepseek_v3 16,256,512;gpt_oss_120b 64,512;qwen3_30b_a3b 16,256;mixtral_8x7b 64" ROUNDS=3 ITER=20 bash benches/results/2026-12-06_h100_early_start_by_launch/ab.sh
