# Call A: where the partial last wave of a mma.sync GEMM's whole tiles runs, and whether
# claiming it one tile per SM (TailDeal, tail_holder_probe.patch) removes the early start's
# cost. Builds: bin (shipped, tiles dealt by block index), p0 (census_probe.patch: the
# shipped deal with each block's SM and tail tiles recorded; the last block prints the
# census), p1 (both patches), p2 (tail_holder_probe.patch alone, for timing).
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
log=${OUT:-/tmp}/call_a.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee $log
echo "== correctness (p1: the census must count every tail tile each call; p2: --check)" | tee -a $log
for spec in "mixtral_8x7b 64 uniform" "mixtral_8x7b 16 skewed" "qwen3_30b_a3b 256 uniform" "qwen3_30b_a3b 37 skewed" "deepseek_v3 128 uniform" "gpt_oss_120b 64 uniform"; do set -- $spec
  timeout 120 .device/probe/p2 run dsl-examples/$1.moe --tokens $2 --routing $3 --seed 5 --check > /tmp/r.txt 2>&1; echo "p2 check $1 $2 $3: rc $? $(tail -3 /tmp/r.txt | tr "\n" " " | cut -c1-300)" | tee -a $log
done
echo "== census (p0 shipped deal, p1 holder deal), last 2 calls" | tee -a $log
for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256" "deepseek_v3 128"; do set -- $spec; for build in p0 p1; do for tg in h100 h200; do
  timeout 120 .device/probe/$build bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed" | tee -a $log
  echo "$1 $2 $build plan=$tg: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')" | tee -a $log
  for k in gemm1 gemm2; do grep "PROBE .*_$k" /tmp/o.txt | tail -4 | sed "s/^PROBE /   /" | tee -a $log; done
done; done; done
echo "== timing, us per call: caller-routed | self-routed | on its routing" | tee -a $log
for round in 1 2; do for spec in "mixtral_8x7b 64" "qwen3_30b_a3b 256" "mixtral_8x7b 16" "deepseek_v3 128"; do set -- $spec; for build in bin:.device/bin/moeforge p2:.device/probe/p2; do for tg in h100 h200; do
  timeout 120 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 20 --target $tg --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 $tg failed" | tee -a $log
  echo "$1 $2 ${build%%:*} plan=$tg r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')" | tee -a $log
done; done; done; done
