# Call F: what the wgmma GEMMs' epilogue costs on the critical path of large calls: the
# shipped build against noepi (no_epilogue_probe.patch: the warp-specialised GEMMs store
# nothing; their results are wrong, their time is what the tensor cores and loads take),
# and each kernel of the shipped build's Qwen3-30B-A3B call at 4096 and 16384 tokens alone.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "gpt_oss_120b 16384" "deepseek_v3 4096" "mixtral_8x7b 4096"; do set -- $spec; for build in bin:.device/bin/moeforge noepi:.device/probe/noepi; do
  timeout 150 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
  echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done
for t in 4096 16384; do timeout 120 bash benches/kernel_breakdown.sh qwen3_30b_a3b $t 2>&1 | tail -14; done
