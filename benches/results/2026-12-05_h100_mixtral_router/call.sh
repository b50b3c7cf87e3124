b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for g in 1 0; do MOEFORGE_CALL_GRAPHS=$g moeforge bench dsl-examples/mixtral_8x7b.moe --tokens 1,2,16 --seed 7 --out /tmp/b > $OUT/bench_graphs$g.txt 2>&1; echo "== graphs $g"; grep -E "^\|  +T|^\| +[0-9]+ \|" $OUT/bench_graphs$g.txt; done
timeout 240 bash benches/router_cost_breakdown.sh mixtral_8x7b 1 > $OUT/breakdown.txt 2>&1; echo "breakdown exit $?"; grep -vE "^==PROF==" $OUT/breakdown.txt | tail -40
