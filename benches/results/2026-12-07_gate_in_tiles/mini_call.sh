# A short form of call.sh (set up as it says) for a call of about two minutes: the
# patched build's checks at full size (mid and prefill first, where the patch acts), one
# round of prologue / tiles / none at 1024 and 4096 tokens, then the patched GPU suite in
# what is left of 125 s.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
start=$(date +%s)
spec=dsl-examples/qwen1_5_moe_a2_7b.moe
for t in 300 2100 1 16; do
  moeforge run $spec --ranks 1 --tokens $t --check --seed 7 2>&1 | grep -E "out of bound|error|PASS|FAIL" | head -2
done
echo "checks done at $(( $(date +%s) - start )) s"
sed 's/^    gated = true.*$/    gated = false/' $spec > /tmp/ungated.moe
mkdir -p $OUT/raw
.device/probe/prologue bench $spec --ranks 1 --tokens 1024,4096 --seed 7 > $OUT/raw/prologue.txt 2>&1
moeforge bench $spec --ranks 1 --tokens 1024,4096 --seed 7 > $OUT/raw/tiles.txt 2>&1
moeforge bench /tmp/ungated.moe --ranks 1 --tokens 1024,4096 --seed 7 > $OUT/raw/none.txt 2>&1
echo "benches done at $(( $(date +%s) - start )) s"
for f in $OUT/raw/*.txt; do echo "== $(basename $f)"; grep -E "^\| +[0-9]" $f | cut -d'|' -f2,3,4,12 | head -4; done
left=$(( 125 - ($(date +%s) - start) ))
if [ $left -gt 10 ]; then
  LANES=4 timeout $left bash scripts/gpu-suite-timed.sh $OUT/logs 12 > $OUT/suite.txt 2>&1
  echo "suite exit $? at $(( $(date +%s) - start )) s"; grep -E "^!!|^\| +[0-9.]+ \| [a-z_]+ \| [^0]|^total" $OUT/suite.txt | head -20
else
  echo "no time left for the suite"
fi
