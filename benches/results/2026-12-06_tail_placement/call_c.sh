# Call C: the GPU suite, timed (its slowest tests listed), then whether GEMM1's early-start
# cost follows its 16-row tiles (an expert's two m-tiles of one n-tile read the same
# weights on two blocks, an L2 hit only where the two run at the same time near each
# other): the shipped layer against the same with `gemm1.tile = 32x64x128`, each planned
# for the H100 (GEMM1 after the router) and the H200 (GEMM1 resident early beside it).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
LANES=3 bash scripts/gpu-suite-timed.sh $OUT/logs 30 > $OUT/suite.txt 2>&1; echo "suite exit $?"
here=benches/results/2026-12-06_tail_placement
for round in 1 2; do for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256" "mixtral_8x7b 16"; do set -- $spec; for file in shipped:dsl-examples/$1.moe rows32:$here/$1_gemm1_32rows.moe; do for tg in h100 h200; do
  timeout 120 .device/bin/moeforge bench ${file#*:} --tokens $2 --seed 7 --iterations 20 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed"
  echo "$1 $2 ${file%%:*} plan=$tg r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done; done
grep -E "^\|" $OUT/suite.txt | head -60
