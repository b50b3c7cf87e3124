b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
mkdir -p $OUT/fill
for m in deepseek_v3 qwen3_30b_a3b mixtral_8x7b gpt_oss_120b; do
  for r in uniform balanced; do
    moeforge bench dsl-examples/$m.moe --tokens 1024,4096,16384 --routing $r --seed 7 --out $OUT/fill > $OUT/fill/${m}_$r.txt 2>&1 || echo "bench $m $r failed"
  done
done
for f in $OUT/fill/*.txt; do echo "== $f"; grep -E "^\| *(1024|4096|16384) " $f | head -3; done
bash scripts/gpu-suite-timed.sh > $OUT/suite.txt 2>&1; echo "suite exit $?"; tail -25 $OUT/suite.txt
