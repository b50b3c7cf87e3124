# Call F: work units claimed in order from a counter (dynamic_units_probe.patch, with the tail
# order of tail_order_probe.patch) against base and both (call D's staging; .device/probe/dyn
# built by scripts/probe-build.sh). Checked first, then one round of the bench cells, then
# Nsight Compute's DRAM bytes of DeepSeek-V3's prefill GEMMs.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
bench() {  # label binary model tokens routing
  timeout 120 $2 bench dsl-examples/$3.moe --tokens $4 --seed 7 --iterations 20 --routing $5 --out /tmp/b > /tmp/o.txt 2>&1 || { echo "$3 $4 $1 failed"; tail -3 /tmp/o.txt; }
  echo "$3 $4 $1: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4 | tr -s ' ')"
}
for spec in "mixtral_8x7b 1100" "deepseek_v3 2100" "qwen3_30b_a3b 4096"; do set -- $spec
  timeout 60 .device/probe/dyn run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 64 > /tmp/r.txt 2>&1
  echo "dyn check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
for spec in "mixtral_8x7b 1024" "deepseek_v3 16384" "qwen3_30b_a3b 4096" "mixtral_8x7b 4096"; do set -- $spec
  bench base .device/probe/base $1 $2 uniform
  bench both .device/probe/both $1 $2 uniform
  bench dyn .device/probe/dyn $1 $2 uniform
done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 100 "$ncu" --clock-control none -k "regex:^deepseek_v3_prefill_gemm[12]$" --launch-count 2 --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  .device/probe/dyn bench dsl-examples/deepseek_v3.moe --tokens 16384 --seed 7 --iterations 1 > /tmp/p.txt 2>&1
awk '/^  [a-z0-9_]+_gemm[12] /{k=$1} k && /^ +[a-z0-9_.]+__[a-z0-9_.]+ /{v[k]=v[k] " " $1 "=" $NF $(NF-1)} END{for(k in v) print "dyn", k, v[k]}' /tmp/p.txt
