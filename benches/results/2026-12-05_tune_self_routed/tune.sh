# Re-tune the four examples on this GPU with the tuner that times self-routed calls and
# 128-deep mma.sync stages; entries into $OUT/tuning.json, the tuner's tables beside them.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
export MOEFORGE_CACHE_DIR=/tmp/jit
start=$(date +%s)
for m in ${MODELS:-qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3}; do
  timeout ${EACH:-170} moeforge tune dsl-examples/$m.moe --candidates ${CANDIDATES:-6} --seed 7 --cache $OUT/tuning.json > $OUT/tune_$m.txt 2>&1 || echo "tune $m failed or cut ($?)"
  echo "$m tuned at $(( $(date +%s) - start )) s"; grep -A8 "^| regime" $OUT/tune_$m.txt
done
