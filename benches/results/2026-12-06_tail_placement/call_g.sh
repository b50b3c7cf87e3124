# Call G: the wgmma GEMMs' epilogue rows looked up before the k-loop (new, the build of
# this commit) against 463f0f7 (base): the GPU suite on new, then both builds on the
# large calls of call F, caller-routed | self-routed | on its routing, two rounds.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader
LANES=3 bash scripts/gpu-suite-timed.sh $OUT/logs 8 > $OUT/suite.txt 2>&1; echo "suite exit $? $(grep '^total' $OUT/suite.txt)"
export MOEFORGE_CACHE_DIR=/tmp/jit
for round in 1 2; do for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "qwen3_30b_a3b 1024" "gpt_oss_120b 16384" "deepseek_v3 4096" "mixtral_8x7b 4096"; do set -- $spec; for build in base:.device/base/moeforge new:.device/bin/moeforge; do
  timeout 150 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
  echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done
grep -E "^\| [0-9.]+ \| [a-z_]+ \|" $OUT/suite.txt
