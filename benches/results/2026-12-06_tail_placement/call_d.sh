# Call D: the GPU suite cold with 4 lanes, then with 3 (each its own empty JIT cache), and
# where 32-row GEMM1 tiles start to pay in the decode regime: Mixtral-8x7B at 32 and 48
# tokens, Qwen3-30B-A3B at 128 and 192 (16, 64 and 256 are call C's), both plans.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader
for lanes in 4 3; do
  MOEFORGE_CACHE_DIR=/tmp/suite_cache_$lanes LANES=$lanes bash scripts/gpu-suite-timed.sh $OUT/logs$lanes 12 > $OUT/suite_lanes$lanes.txt 2>&1
  echo "lanes $lanes: exit $? $(grep '^total' $OUT/suite_lanes$lanes.txt)"
done
export MOEFORGE_CACHE_DIR=/tmp/jit
here=benches/results/2026-12-06_tail_placement
for round in 1 2; do for spec in "mixtral_8x7b 32" "mixtral_8x7b 48" "qwen3_30b_a3b 128" "qwen3_30b_a3b 192"; do set -- $spec; for file in shipped:dsl-examples/$1.moe rows32:$here/$1_gemm1_32rows.moe; do for tg in h100 h200; do
  timeout 120 .device/bin/moeforge bench ${file#*:} --tokens $2 --seed 7 --iterations 20 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed"
  echo "$1 $2 ${file%%:*} plan=$tg r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done; done
for lanes in 4 3; do grep -E "^\| [0-9.]+ \| [a-z_]+ \|" $OUT/suite_lanes$lanes.txt | head -6; done
