# Call E: Nsight Compute on the prefill GEMMs of Qwen3-30B-A3B at 4096 and Mixtral-8x7B at
# 4096 tokens (uniform routing, one bench call), base / order / both as in call D (same
# staging): time, DRAM read, L2 hit rate, L2-to-SM bytes.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in "qwen3_30b_a3b 4096" "mixtral_8x7b 4096"; do set -- $spec
  for p in base order both; do
    bin=.device/probe/$p; [ $p = order ] && bin=.device/bin/moeforge
    timeout 120 "$ncu" --clock-control none -k "regex:^$1_prefill_gemm[12]$" --launch-count 2 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,l1tex__m_xbar2l1tex_read_bytes.sum \
      $bin bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 1 > /tmp/p.txt 2>&1
    awk -v tag="$1 $2 $p" '/^  [a-z0-9_]+_gemm[12] /{k=$1} k && /^ +[a-z0-9_.]+__[a-z0-9_.]+ /{v[k]=v[k] " " $1 "=" $NF $(NF-1)} END{for(k in v) print tag, k, v[k]}' /tmp/p.txt | sed 's/gpu__time_duration.sum/time/; s/dram__bytes_read.sum/dram/; s/lts__t_sector_hit_rate.pct/l2hit/; s/l1tex__m_xbar2l1tex_read_bytes.sum/l2_to_sm/'
  done
done
