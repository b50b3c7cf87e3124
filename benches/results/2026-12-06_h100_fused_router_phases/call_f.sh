# Calls 12-13 of 2026-12-06 (one H100). Tiles dealt by block index (static, the shipped build) against whole tiles claimed from a
# ticket after each block's first (dynamic, a probe build), each with the layer planned for
# the H100 (GEMM1 starts as the fused router's blocks finish) and for the H200 (GEMM1
# resident early beside the router), on this GPU. Columns: caller-routed, self-routed, on
# its routing (us per call).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256" "mixtral_8x7b 16"; do set -- $spec; for build in static:.device/bin/moeforge dynamic:.device/probe/moeforge; do for tg in h100 h200; do
  timeout 120 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 20 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed"
  echo "$1 $2 ${build%%:*} plan=$tg r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done; done
