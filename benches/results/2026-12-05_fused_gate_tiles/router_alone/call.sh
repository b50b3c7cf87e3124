# The fused router alone (Nsight Compute) across each example's fused range, self-routed.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
mkdir -p /tmp/rt
for spec in ${SPECS:-"deepseek_v3 1 16 128 512" "qwen3_30b_a3b 1 64 256" "gpt_oss_120b 1 128 512" "mixtral_8x7b 1 64"}; do
  set -- $spec; m=$1; shift
  for t in "$@"; do
    echo "== $m $t"; timeout 120 bash benches/kernel_breakdown.sh $m $t > /tmp/rt/${m}_$t.txt 2>&1; grep -i "router\|total\|sum" /tmp/rt/${m}_$t.txt | head -4
  done
done
tar czf $OUT/router_alone.tgz -C /tmp/rt .
