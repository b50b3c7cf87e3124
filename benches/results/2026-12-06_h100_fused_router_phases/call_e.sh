# GEMM1 and GEMM2 timelines (entry, end of the wait, exit of every block) of a probe build,
# the layer planned for the H100 (GEMM1 starts as the fused router's blocks finish) and for
# the H200 (GEMM1 resident early beside the router), on this GPU.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256"; do set -- $spec; for tg in h100 h200; do
  timeout 120 .device/probe/moeforge bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed"
  echo "$1 $2 plan=$tg r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
  for k in gemm1 gemm2; do grep "PROBE .*_$k" /tmp/o.txt | tail -2 | sed "s/^PROBE /   /"; done
done; done; done
