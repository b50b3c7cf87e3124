# Call D: the cluster pairs' odd last m-tile placed beside the pairs that read the same weight
# panels (tail_order_probe.patch) against HEAD, alone and with session 55's gather_a
# (tail_order_gather_a_probe.patch), uniform routing, two rounds; HEAD on balanced routing
# for scale. Checked first; then Nsight Compute's DRAM bytes of the prefill GEMMs, HEAD
# against order. As run: the working tree with tail_order_probe.patch built and staged
# (bash scripts/device-stage.sh: .device/bin/moeforge is "order", with the GPU suite that
# runs first), 07ca280 (HEAD, the same kernels as 694b2c6) built as .device/probe/base, and
# bash scripts/probe-build.sh <this folder>/tail_order_gather_a_probe.patch both.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
bench() {  # label binary model tokens routing
  timeout 120 $2 bench dsl-examples/$3.moe --tokens $4 --seed 7 --iterations 20 --routing $5 --out /tmp/b > /tmp/o.txt 2>&1 || { echo "$3 $4 $1 failed"; tail -3 /tmp/o.txt; }
  echo "$3 $4 $1: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4 | tr -s ' ')"
}
for p in order both; do
  for spec in "mixtral_8x7b 260" "mixtral_8x7b 1100" "deepseek_v3 2100" "gpt_oss_120b 2100" "qwen3_30b_a3b 1100" "qwen3_30b_a3b 4096"; do set -- $spec
    bin=.device/probe/$p; [ $p = order ] && bin=.device/bin/moeforge
    timeout 90 $bin run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 64 > /tmp/r.txt 2>&1
    echo "$p check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
  done
done
for round in 1 2; do
  for spec in "mixtral_8x7b 1024" "mixtral_8x7b 4096" "deepseek_v3 16384" "gpt_oss_120b 16384" "qwen3_30b_a3b 4096"; do
    set -- $spec
    bench "base r$round" .device/probe/base $1 $2 uniform
    bench "order r$round" .device/bin/moeforge $1 $2 uniform
    bench "both r$round" .device/probe/both $1 $2 uniform
    [ $round = 1 ] && bench "base balanced" .device/probe/base $1 $2 balanced
  done
done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in "mixtral_8x7b 1024" "deepseek_v3 16384"; do set -- $spec
  for bin in .device/probe/base .device/bin/moeforge; do
    timeout 200 "$ncu" --clock-control none -k "regex:^$1_(mid|prefill)_gemm[12]$" --launch-count 2 --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      $bin bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 1 > /tmp/p.txt 2>&1
    awk -v tag="$1 $2 $(basename $bin)" '/^  [a-z0-9_]+_gemm[12] /{k=$1} k && /^ +[a-z0-9_.]+__[a-z0-9_.]+ /{v[k]=v[k] " " $1 "=" $NF $(NF-1)} END{for(k in v) print tag, k, v[k]}' /tmp/p.txt | sed 's/ moeforge / order /'
  done
done
