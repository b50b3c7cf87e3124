# Session 67, the one device call: the L2 throughput of Qwen3-30B-A3B's prefill GEMMs at 4096 tokens broken down by unit, and
# both GEMMs with half of their A-row loads skipped, and with all of them after a block's
# first tile (probes halfa and noa: results wrong, times not); then Qwen3's kernels alone at 1
# tokens (benches/kernel_breakdown.sh).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $gpu"
mkdir -p /tmp/n
run_args="run dsl-examples/qwen3_30b_a3b.moe --ranks 1 --tokens 4096 --seed 7"
ncu --clock-control none -k regex:prefill_gemm -c 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
  --metrics breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum,lts__t_requests.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed_op_ldgsts.sum,lts__t_sectors_srcunit_tex.sum,lts__t_requests_srcunit_tex.sum \
  moeforge $run_args > /tmp/n/ncu_l2.txt 2>&1
echo "ncu rc $?"
for bin in moeforge .device/probe/halfa .device/probe/noa; do
  ncu --clock-control none -k regex:prefill_gemm -c 2 --section SpeedOfLight \
    --metrics lts__t_sectors.sum,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second $bin $run_args > /tmp/n/tmp.txt 2>&1
  echo "== $bin" >> /tmp/n/ablate.txt; cat /tmp/n/tmp.txt >> /tmp/n/ablate.txt
  echo "== $(basename $bin)"; grep -E '^  [a-z0-9_]+_gemm|^ +(Duration|L2 Cache Throughput|DRAM Throughput|lts__t_sectors.sum|dram__bytes_read.sum|sm__cycles_elapsed.avg.per_second)' /tmp/n/tmp.txt | awk '/gemm/{print $1; next}{print "   "$1" "$2" "$3"="$NF}' | tr '\n' ' '; echo
done
for t in 1; do bash benches/kernel_breakdown.sh qwen3_30b_a3b $t > /tmp/n/breakdown_$t.txt 2>&1; done
tar czf $OUT/l2.tgz -C /tmp/n .
cat /tmp/n/breakdown_1.txt
grep -E "prefill_gemm|lts__|dram__|Duration|ldgsts|L2 Cache Throughput" /tmp/n/ncu_l2.txt | head -70
