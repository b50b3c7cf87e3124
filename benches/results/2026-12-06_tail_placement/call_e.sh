# Call E: the partial last wave claimed by whichever blocks finish first (tt,
# ../2026-12-06_h100_fused_router_phases/tail_ticket_probe.patch: full waves dealt by
# block index, the last wave's tiles from a ticket, any block), against the shipped deal
# (bin); the H100 plan, and Mixtral-8x7B at 64 tokens in the early plan too. Then GEMM1
# with 32-row tiles at two blocks per SM (`gemm1.tile = 32x64x64  stages = 5`).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in "mixtral_8x7b 64" "mixtral_8x7b 16" "qwen3_30b_a3b 256" "qwen3_30b_a3b 37" "deepseek_v3 128" "gpt_oss_120b 64"; do set -- $spec
  timeout 120 .device/probe/tt run dsl-examples/$1.moe --tokens $2 --seed 5 --check > /tmp/r.txt 2>&1; echo "tt check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
here=benches/results/2026-12-06_tail_placement
for round in 1 2; do for spec in "mixtral_8x7b 64 h100" "mixtral_8x7b 64 h200" "mixtral_8x7b 16 h100" "mixtral_8x7b 32 h100" "qwen3_30b_a3b 256 h100" "qwen3_30b_a3b 128 h100" "deepseek_v3 128 h100"; do set -- $spec; for build in bin:.device/bin/moeforge tt:.device/probe/tt; do
  timeout 120 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 20 --target $3 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $3 failed"
  echo "$1 $2 ${build%%:*} plan=$3 r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done
for round in 1 2; do for spec in "mixtral_8x7b 16" "mixtral_8x7b 32" "mixtral_8x7b 64" "qwen3_30b_a3b 128" "qwen3_30b_a3b 256"; do set -- $spec
  timeout 120 .device/bin/moeforge bench $here/$1_gemm1_32rows_2per_sm.moe --tokens $2 --seed 7 --iterations 20 --target h100 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
  echo "$1 $2 rows32x2 plan=h100 r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done
