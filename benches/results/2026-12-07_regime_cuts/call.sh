# The tuner's regime cuts on the GPU (session 63): the tune GPU tests, then `moeforge tune`
# with cuts on the layers where earlier tunes saw one end of a regime won by other GEMMs
# (Qwen1.5-MoE-A2.7B's prefill and decode, GPT-OSS-120B's prefill, DeepSeek-V3's decode),
# each into a cache of its own; then each layer benched at its cut regime's calls with that
# cache (shipped entries + the cut) and without it (shipped entries alone), alternating.
# Run from the repository root after scripts/device-stage.sh.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
start=$(date +%s)
[ -d .device/tests ] || tar -xzf .device/tests.tgz -C .device
t=$(ls .device/tests/tune-* | head -1)
(cd "$b" && timeout 150 $PWD/$t --include-ignored --test-threads 1) > $OUT/tune_tests.txt 2>&1
echo "tune tests exit $? at $(( $(date +%s) - start )) s"; grep -E "^test |test result" $OUT/tune_tests.txt
mkdir -p $OUT/caches
for job in ${JOBS:-qwen1_5_moe_a2_7b:1,16384 gpt_oss_120b:16384 deepseek_v3:128}; do
  m=${job%%:*}; tok=${job#*:}
  timeout ${TUNE_LIMIT:-150} moeforge tune dsl-examples/$m.moe --tokens $tok --seed 7 --cache $OUT/caches/$m.json > $OUT/tune_$m.txt 2>&1
  echo "tune $m exit $? at $(( $(date +%s) - start )) s"; grep -E "cut\?|^\| " $OUT/tune_$m.txt
done
echo "== benches"
for job in ${BENCHES:-qwen1_5_moe_a2_7b:1,64,256,1024,4096,16384 gpt_oss_120b:4096,8192,16384 deepseek_v3:64,128,256,512}; do
  m=${job%%:*}; tok=${job#*:}
  [ -f $OUT/caches/$m.json ] || continue
  for round in 1 2; do
    for side in cut shipped; do
      cache=$OUT/caches/$m.json; [ $side = shipped ] && cache=/tmp/none.json
      MOEFORGE_TUNING_CACHE=$cache timeout 120 moeforge bench dsl-examples/$m.moe --tokens $tok --seed 7 > $OUT/bench_${m}_${side}_$round.txt 2>&1
      echo "$m $side $round: $(grep -E '^\| +[0-9]' $OUT/bench_${m}_${side}_$round.txt | cut -d'|' -f2,3,4,12 | tr -s ' ' | tr '\n' ';')"
    done
  done
  echo "$m benched at $(( $(date +%s) - start )) s"
  [ $(( $(date +%s) - start )) -gt ${CALL_LIMIT:-500} ] && { echo "stopping: call limit"; break; }
done
