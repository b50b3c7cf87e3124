# Call B: every GEMM1 block's SM, entry, exit and tiles (block_dump_probe.patch, every
# fourth GEMM1 launch), the layer planned for the H100 (GEMM1 after the router) and for the
# H200 (GEMM1 resident early beside it). Rows: BLK call block smid entry exit tiles tail
# (us from the first block's wait end).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256"; do set -- $spec; for tg in h100 h200; do
  timeout 120 .device/probe/p3 bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --target $tg --out /tmp/b > $OUT/$1_$2_$tg.txt 2>&1 || echo "$1 $2 $tg failed"
  echo "$1 $2 plan=$tg: $(grep -E "^\| +[0-9]+ \|" $OUT/$1_$2_$tg.txt | cut -d'|' -f4,12,15 | tr -s ' ') $(grep -c ^BLK $OUT/$1_$2_$tg.txt) rows"
done; done
