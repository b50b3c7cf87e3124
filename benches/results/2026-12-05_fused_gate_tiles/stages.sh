# The fused router alone (Nsight Compute) with its gate's stages forced by an experiment-only
# build (MOEFORGE_EXP_FUSED_STAGES in `router::gate_stages`, not committed).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
mkdir -p /tmp/fs
sweep() { m=$1; tile=$2; stages=$3; tokens=$4
  for st in $stages; do line="$m $tile $st stages:"
    for t in $tokens; do
      MOEFORGE_EXP_FUSED_TILE=$tile MOEFORGE_EXP_FUSED_STAGES=$st timeout 60 bash benches/kernel_breakdown.sh $m $t > /tmp/fs/${m}_${tile}_${st}_$t.txt 2>&1
      us=$(grep -i "_router " /tmp/fs/${m}_${tile}_${st}_$t.txt | awk '{print $2}' | head -1); line="$line T=$t ${us:-?}"
    done; echo "$line"
  done; }
sweep deepseek_v3 16x32 "2 4" "16 128 512"
sweep gpt_oss_120b 16x16 "2 8" "128 512"
sweep qwen3_30b_a3b 16x16 "2 5" "64 256"
tar czf $OUT/fused_gate_stages.tgz -C /tmp/fs .
