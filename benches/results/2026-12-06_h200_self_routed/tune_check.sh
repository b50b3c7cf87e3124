# The H200's shipped tuning re-tuned on self-routed calls (the tuner of the forty-eighth
# session), then every regime whose entry changed benched with the shipped entries (an
# empty cache) and with the new one, two rounds in turns. Columns of the bench lines: T,
# caller-routed us, self-routed us, on its routing us. Entries into $OUT/tuning.json.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
here=benches/results/2026-12-06_h200_self_routed
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
models=${MODELS:-qwen3_30b_a3b gpt_oss_120b mixtral_8x7b deepseek_v3}
mkdir -p /tmp/tc; start=$(date +%s)
for m in $models; do
  timeout ${EACH:-170} moeforge tune dsl-examples/$m.moe --candidates ${CANDIDATES:-6} --seed 7 --cache /tmp/tc/$m.json > $OUT/tune_$m.txt 2>&1 || echo "tune $m failed or cut ($?)"
  echo "$m tuned at $(( $(date +%s) - start )) s"
done
python3 - "$OUT/tuning.json" $models <<'PY'
import json, sys
entries = []
for m in sys.argv[2:]:
    try: entries += json.load(open(f"/tmp/tc/{m}.json"))["entries"]
    except (OSError, ValueError): pass
json.dump({"entries": entries}, open(sys.argv[1], "w"), indent=2)
PY
python3 $here/changed.py tuning/shipped.json /tmp/tc $models > /tmp/changed.txt
echo "-- changed regimes: $(wc -l < /tmp/changed.txt)"
for round in 1 2; do
 for mode in shipped new; do
  while read -r m tokens; do
   cache=/tmp/none.json; [ $mode = new ] && cache=/tmp/tc/$m.json
   [ $(( $(date +%s) - start )) -gt ${BUDGET:-540} ] && { echo "out of time: $m $tokens $mode round $round not benched"; continue; }
   MOEFORGE_TUNING_CACHE=$cache timeout 120 moeforge bench dsl-examples/$m.moe --tokens $tokens --seed 7 --iterations ${ITER:-20} --out /tmp/b > /tmp/bench_${m}_${tokens}_${mode}_$round.txt 2>&1 || echo "bench $m failed ($?)"
   echo "== $m $mode round $round"; grep -E "^\| +[0-9]+ \|" /tmp/bench_${m}_${tokens}_${mode}_$round.txt | cut -d'|' -f2,4,12,15
  done < /tmp/changed.txt
 done
done
(cd /tmp && tar -czf $OUT/bench.tgz bench_*.txt 2>/dev/null)
