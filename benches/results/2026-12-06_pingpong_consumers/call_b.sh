# Call B: call A again after its failure (every ping-pong launch failed: a warpgroup skipping
# the other's tile waited for its stages' "full" barriers up to a ring ahead, and a parity
# wait cannot tell phases apart two apart), with the warpgroups now taking turns at the
# k-loop (named barriers). *_pp64.moe: the shipped layers with 64-row tiles hinted
# (gemm1.tile = 64x128x64, gemm2.tile = 64x256x64; GPT-OSS 64x96x64 and 64x192x64: its mid
# regime's), one warpgroup per tile either way, cooperative (one consumer warpgroup) or
# ping-pong (two). Build as in call_a.sh.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
P=.device/probe/pingpong
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
check() {  # env-prefix file tokens
  env $1 timeout 90 $P run $2 --tokens $3 --seed 5 --check --sample 48 > /tmp/r.txt 2>&1
  echo "check $1 $(basename $2) $3: rc $? $(tail -2 /tmp/r.txt | tr '\n' ' ' | cut -c1-240)"
}
for spec in "dsl-examples/qwen3_30b_a3b.moe 1024" "dsl-examples/gpt_oss_120b.moe 1024" "dsl-examples/mixtral_8x7b.moe 200" \
            ".device/probe/qwen3_30b_a3b_pp128.moe 4096" ".device/probe/qwen3_30b_a3b_pp64.moe 4096" \
            ".device/probe/mixtral_8x7b_pp64.moe 4096" ".device/probe/deepseek_v3_pp64.moe 4096" ".device/probe/gpt_oss_120b_pp64.moe 3000"; do
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
  bench "ping128 r$round" MOEFORGE_PROBE_PINGPONG=1 .device/probe/qwen3_30b_a3b_pp128.moe 4096
  for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 4096" "deepseek_v3 4096" "gpt_oss_120b 16384"; do
    set -- $spec
    bench "shipped r$round" X=0 dsl-examples/$1.moe $2
    bench "coop64 r$round" X=0 .device/probe/$1_pp64.moe $2
    bench "ping64 r$round" MOEFORGE_PROBE_PINGPONG=1 .device/probe/$1_pp64.moe $2
  done
done
