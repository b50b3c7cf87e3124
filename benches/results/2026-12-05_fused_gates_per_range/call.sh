# A fused router's gate per token range (issue 9): the GPU suite, then the fused router
# alone (Nsight Compute, router kernels only) and the layer per call (`bench`), base
# build (.device/base/moeforge: one gate per fused regime; its bench with the self-routed
# timing in turns, as here) against this one, on the calls
# around the point where the new gates take over. Run from the repository root on the GPU
# machine after scripts/device-stage.sh and copying the base binary to .device/base/.
# ALONE and STREAM override the calls: "model T T ...;model T ..." and "model T,T;...".
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
# Where the new gates take over: DeepSeek-V3 above 256 tokens on an H100 (its decode regime
# ends at 512), above 128 on an H200 (ends at 256); GPT-OSS-120B above 256 on both.
ds="128 256 512"; ds_stream="16,256,512"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then ds="128 192 256"; ds_stream="16,192,256"; fi
if [ -z "${SKIP_SUITE:-}" ]; then
  LANES=3 bash scripts/gpu-suite-timed.sh $OUT/logs 5 2>&1 | grep -E "^\| [0-9]|total"
  (cd $OUT && tar -czf logs.tgz logs && rm -r logs)
fi
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "== router alone (µs, gpu__time_duration)"
IFS=';' read -ra alone <<< "${ALONE:-deepseek_v3 $ds;gpt_oss_120b 256 512}"
IFS=';' read -ra stream <<< "${STREAM:-deepseek_v3 $ds_stream;gpt_oss_120b 256,512}"
for spec in "${alone[@]}"; do
  set -- $spec; m=$1; shift
  for t in "$@"; do
    for build in base new; do
      bin=.device/bin/moeforge; [ $build = base ] && bin=.device/base/moeforge
      us=$("$ncu" --clock-control none -k regex:router --metrics gpu__time_duration.sum --csv \
        "$bin" run dsl-examples/$m.moe --tokens $t --seed 7 2>/dev/null |
        awk -F'","' '/gpu__time_duration/ { gsub(/"/, "", $NF); gsub(/,/, "", $NF); printf "%s(%s) ", $NF / 1000, $5 }')
      echo "$m T=$t $build: $us"
    done
  done
done
echo "== per call from an idle GPU (µs, median): T | caller-routed | self-routed | on its routing (the last two in turns)"
for round in $(seq ${ROUNDS:-2}); do
  order="base new"; [ $round = 2 ] && order="new base"
  for spec in "${stream[@]}"; do
    set -- $spec
    for build in $order; do
      bin=.device/bin/moeforge; [ $build = base ] && bin=.device/base/moeforge
      timeout 200 "$bin" bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations ${ITER:-15} --out /tmp/b > $OUT/${1}_${build}_$round.txt 2>&1 || echo "bench $1 $build failed ($?)"
      echo "-- $1 $build round $round"; grep -E "^\| +[0-9]+ \|" $OUT/${1}_${build}_$round.txt | cut -d'|' -f2,4,12,15
    done
  done
done
