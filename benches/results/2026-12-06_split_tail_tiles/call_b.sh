# Call B: where a part-empty last tile's time goes. Nsight Compute on the two prefill GEMMs of
# the first caller-routed bench call, uniform against balanced routing (every expert T·K/E
# rows, no part-empty tile), HEAD's build (.device/bin/moeforge). One line per kernel.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name --format=csv,noheader
M="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_bytes.sum.per_second,smsp__cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum"
for spec in "deepseek_v3 16384" "qwen3_30b_a3b 4096" "gpt_oss_120b 16384"; do set -- $spec
  for routing in uniform balanced; do
    timeout 200 "$ncu" --clock-control none -k "regex:^$1_prefill_gemm[12]$" --launch-count 2 --metrics $M \
      .device/bin/moeforge bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 1 --routing $routing > /tmp/p.txt 2>&1
    awk -v tag="$1 $2 $routing" '/^  [a-z0-9_]+_gemm[12] /{k=$1} k && /^ +[a-z0-9_.]+__[a-z0-9_.]+ /{v[k]=v[k] " " $1 "=" $NF $(NF-1)} END{for(k in v) print tag, k, v[k]}' /tmp/p.txt | sed 's/gpu__time_duration.sum/time/; s/sm__cycles_elapsed.avg.per_second/clock/; s/sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active/gmma%/; s/smsp__cycles_active.avg.pct_of_peak_sustained_elapsed/smsp_active%/'
    grep -E "^\| +[0-9]+ \|" /tmp/p.txt | cut -d'|' -f2,4 | head -1
  done
done
