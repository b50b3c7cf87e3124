b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
mkdir -p /tmp/t
start=$(date +%s)
for m in qwen3_30b_a3b mixtral_8x7b gpt_oss_120b deepseek_v3; do
  timeout ${PER_MODEL:-250} moeforge bench dsl-examples/$m.moe --tokens ${TOKENS} --seed 7 --peers --out /tmp/t > /tmp/t/${m}${TAG}.txt 2>&1 || echo "bench $m failed or cut ($?)"
  echo "$m done at $(( $(date +%s) - start )) s"
done
tar czf $OUT/table${TAG}.tgz -C /tmp/t .
for m in qwen3_30b_a3b mixtral_8x7b gpt_oss_120b deepseek_v3; do echo "== $m"; grep -A8 "^| T | moeforge us" /tmp/t/${m}${TAG}.txt | grep -E "^\| [0-9]" | cut -d'|' -f2-10; done
