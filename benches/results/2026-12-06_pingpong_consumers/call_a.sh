# Call A: two consumer warpgroups on alternate tiles (ping-pong, pingpong_probe.patch) against
# the shipped cooperative schedule (both warpgroups on one tile), one binary: the probe's
# planner makes every single-GPU wgmma GEMM whose whole tile fits one warpgroup's registers
# (rows x B rows <= 16384) ping-pong when MOEFORGE_PROBE_PINGPONG is set, and plans exactly
# as HEAD otherwise. Layers: the shipped examples (their mid regimes' 64-row tiles become
# ping-pong; the prefill regimes' 128 x 256-B-row tiles do not fit and stay) and *_pp128.moe
# (the same with gemm1.tile = 128x64x64, gemm2.tile = 128x128x64 hinted: 128-row tiles of
# 128 B rows, cooperative or ping-pong). Build: /tmp/wt with the patch, cargo build --release
# -p moeforge, strip -o .device/probe/pingpong; *_pp128.moe in .device/probe/.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
P=.device/probe/pingpong
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
check() {  # env-prefix file tokens
  env $1 timeout 90 $P run $2 --tokens $3 --seed 5 --check --sample 48 > /tmp/r.txt 2>&1
  echo "check $1 $(basename $2) $3: rc $? $(tail -2 /tmp/r.txt | tr '\n' ' ' | cut -c1-240)"
}
for spec in "dsl-examples/qwen3_30b_a3b.moe 1024" "dsl-examples/gpt_oss_120b.moe 1024" "dsl-examples/mixtral_8x7b.moe 200" \
            ".device/probe/qwen3_30b_a3b_pp128.moe 4096" ".device/probe/mixtral_8x7b_pp128.moe 4096" \
            ".device/probe/deepseek_v3_pp128.moe 4096" ".device/probe/gpt_oss_120b_pp128.moe 3000"; do
  set -- $spec; check MOEFORGE_PROBE_PINGPONG=1 $1 $2
done
bench() {  # label env-prefix file tokens
  env $2 timeout 120 $P bench $3 --tokens $4 --seed 7 --iterations 20 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $(basename $3) $4 failed: $(tail -2 /tmp/o.txt)"
  echo "$(basename $3 .moe) $4 $1: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
}
for round in 1 2; do
  for spec in "dsl-examples/qwen3_30b_a3b.moe 1024" "dsl-examples/qwen3_30b_a3b.moe 512" "dsl-examples/gpt_oss_120b.moe 1024" \
              "dsl-examples/deepseek_v3.moe 1024" "dsl-examples/mixtral_8x7b.moe 256"; do
    set -- $spec
    bench "coop r$round" X=0 $1 $2; bench "ping r$round" MOEFORGE_PROBE_PINGPONG=1 $1 $2
  done
  for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 4096" "deepseek_v3 4096" "gpt_oss_120b 16384"; do
    set -- $spec
    bench "shipped r$round" X=0 dsl-examples/$1.moe $2
    bench "coop128 r$round" X=0 .device/probe/$1_pp128.moe $2
    bench "ping128 r$round" MOEFORGE_PROBE_PINGPONG=1 .device/probe/$1_pp128.moe $2
  done
done
