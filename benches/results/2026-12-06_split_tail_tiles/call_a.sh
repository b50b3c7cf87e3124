# Call A: an expert's last row tile of at most 64 rows multiplied by both consumer warpgroups,
# each taking half the tile's columns (split_tail_probe.patch), against HEAD, where one
# warpgroup multiplies it and the other waits. Build: the patch on HEAD in a worktree, cargo
# build --release -p moeforge, strip -o .device/probe/split; base is .device/bin/moeforge.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
# Token counts where many experts' rows fit one tile of at most 64 rows (split) and many not.
for spec in "qwen3_30b_a3b 1100" "qwen3_30b_a3b 4096" "mixtral_8x7b 300" "mixtral_8x7b 4100" "deepseek_v3 2100" "gpt_oss_120b 2100" "gpt_oss_120b 16384"; do set -- $spec
  timeout 90 .device/probe/split run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 64 > /tmp/r.txt 2>&1; echo "split check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
for round in 1 2; do
  for spec in "qwen3_30b_a3b 1100" "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 1024" "mixtral_8x7b 4096" "mixtral_8x7b 16384" \
              "deepseek_v3 2100" "deepseek_v3 4096" "deepseek_v3 16384" "gpt_oss_120b 4096" "gpt_oss_120b 16384"; do
    set -- $spec
    for build in base:.device/bin/moeforge split:.device/probe/split; do
      timeout 90 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 20 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
      echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
    done
  done
done
