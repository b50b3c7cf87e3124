# The regime cuts with the second pass (session 63, call 9): the tune GPU tests, then each
# layer tuned again (cuts allowed) into a cache of its own, to see which cuts the second
# pass keeps. Run from the repository root after scripts/device-stage.sh.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
tg=$(cat .device/target); [ -e "$tg/release" ] || { mkdir -p "$tg" && ln -s "$PWD/.device/bin" "$tg/release"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
start=$(date +%s)
mkdir -p /tmp/o
[ -d .device/tests ] || tar -xzf .device/tests.tgz -C .device
t=$(ls .device/tests/tune-* | head -1)
(cd "$b" && timeout 150 $PWD/$t --include-ignored --test-threads 1) > /tmp/o/tune_tests.txt 2>&1
echo "tune tests exit $? at $(( $(date +%s) - start )) s"; grep -E "test result" /tmp/o/tune_tests.txt
for job in ${JOBS:-deepseek_v3:128 qwen1_5_moe_a2_7b:1,16384 gpt_oss_120b:16384 mixtral_8x7b:128,16384}; do
  m=${job%%:*}; tok=${job#*:}
  timeout ${TUNE_LIMIT:-120} moeforge tune dsl-examples/$m.moe --tokens $tok --seed 7 --cache /tmp/o/$m.json > /tmp/o/tune_$m.txt 2>&1
  echo "tune $m exit $? at $(( $(date +%s) - start )) s"; grep -E "cut\?|^\| [0-9]" /tmp/o/tune_$m.txt | cut -c1-80
done
tar czf $OUT/confirm.tgz -C /tmp/o .
