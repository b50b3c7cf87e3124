# Call I (ready, not yet run): the wgmma GEMMs' epilogue stores with a streaming hint
# (st.global.cs: evict first from L2), streaming_store_probe.patch, against the base build.
# The guess it tests: the no-epilogue probe's gain (call F) is partly the weight lines that
# the intermediate and combine-slot stores no longer evict from L2.
# Build: git worktree add /tmp/wt HEAD; cd /tmp/wt; git apply <this folder>/streaming_store_probe.patch;
# touch compiler/src/lib.rs compiler/src/codegen/mod.rs; cargo build --release -p moeforge;
# strip -o <repo>/.device/probe/stream target/release/moeforge; and the base build as
# .device/base/moeforge (the same commit without the patch).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in "qwen3_30b_a3b 4096" "mixtral_8x7b 4096"; do set -- $spec
  timeout 60 .device/probe/stream run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 48 > /tmp/r.txt 2>&1; echo "stream check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
for round in 1 2; do for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 4096" "gpt_oss_120b 16384" "deepseek_v3 4096"; do set -- $spec; for build in base:.device/base/moeforge stream:.device/probe/stream; do
  timeout 90 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
  echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done
