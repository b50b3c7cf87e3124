# The fused router alone (Nsight Compute) with its gate tile forced by an experiment-only
# build (MOEFORGE_EXP_FUSED_TILE=MxN in `router::fused_gate_tile`, not committed).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
mkdir -p /tmp/ft
sweep() { m=$1; tiles=$2; tokens=$3
  for tile in $tiles; do line="$m $tile:"
    for t in $tokens; do
      MOEFORGE_EXP_FUSED_TILE=$tile timeout 60 bash benches/kernel_breakdown.sh $m $t > /tmp/ft/${m}_${tile}_$t.txt 2>&1
      us=$(grep -i "_router " /tmp/ft/${m}_${tile}_$t.txt | awk '{print $2}' | head -1); line="$line T=$t ${us:-?}"
    done; echo "$line"
  done; }
sweep deepseek_v3 "16x32 16x64 16x128 64x32 64x64 64x128 128x64 128x128 64x256" "1 16 128 512"
sweep qwen3_30b_a3b "16x16 16x64 64x64 64x128 128x128" "1 64 256"
sweep gpt_oss_120b "16x16 16x64 64x64 64x128 128x128" "1 128 512"
tar czf $OUT/fused_gate_tiles.tgz -C /tmp/ft .
