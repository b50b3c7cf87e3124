# Call J: the streaming-store probe (st.global.cs on the wgmma GEMMs' epilogue stores;
# 2026-12-06_tail_placement/streaming_store_probe.patch) split by GEMM, on large and mid
# cells: base (HEAD, .device/bin/moeforge), stream (both GEMMs), stream_g1 (GEMM1's
# intermediate stores only), stream_g2 (GEMM2's combine-slot stores only). Builds: the
# patch on HEAD in a worktree, then the one branch of wgmma_epilogue reverted for g1/g2;
# cargo build --release -p moeforge; strip -o .device/probe/stream{,_g1,_g2}.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for v in stream_g1 stream_g2; do for spec in "qwen3_30b_a3b 1024" "deepseek_v3 4096"; do set -- $spec
  timeout 60 .device/probe/$v run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 48 > /tmp/r.txt 2>&1; echo "$v check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done; done
for round in 1 2; do
  for spec in "qwen3_30b_a3b 1024" "gpt_oss_120b 1024" "deepseek_v3 1024" "mixtral_8x7b 1024" "gpt_oss_120b 4096" \
              "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 4096" "mixtral_8x7b 16384" "gpt_oss_120b 16384" "deepseek_v3 4096"; do
    set -- $spec
    for build in base:.device/bin/moeforge stream:.device/probe/stream g1:.device/probe/stream_g1 g2:.device/probe/stream_g2; do
      timeout 90 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 20 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
      echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
    done
  done
done
