# Call C (ready, not yet run): how much of a part-empty tile's cost is its A box. The TMA
# A box is a tile's 128 rows whatever rows it has, so a tail of 8 rows reads 120 rows it
# never uses (the next expert's); GEMMs that gather their A rows (Qwen3-30B-A3B's GEMM1)
# zero-fill them without reading. skip_tail_a_probe.patch (timing only: its results are
# WRONG) loads no A rows at all into a tile of at most 64 rows, bounding what a box of the
# tail's rows would save. gather_tail_a_probe.patch is a candidate fix with correct results:
# such a tile gathers its A rows by pointer with cp.async (rows past its own zero-filled,
# never read), as the gathering GEMMs do; the GEMMs that take A as tiles get the rows' pointer
# too. Against HEAD, uniform routing, and HEAD on balanced routing (no part-empty tiles: the
# whole tail cost) for scale; gather_a checked first. Then call_b.sh's profile.
# Build: bash scripts/device-stage.sh (HEAD's binary to .device/bin/moeforge), then
# bash scripts/probe-build.sh <this folder>/skip_tail_a_probe.patch skip_a and
# bash scripts/probe-build.sh <this folder>/gather_tail_a_probe.patch gather_a; the tests
# the stage packs (.device/tests.tgz) can go to keep the carry small. About 7 minutes of
# device time.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
bench() {  # label binary model tokens routing
  timeout 120 $2 bench dsl-examples/$3.moe --tokens $4 --seed 7 --iterations 20 --routing $5 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$3 $4 $1 failed"
  echo "$3 $4 $1: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4 | tr -s ' ')"
}
for spec in "mixtral_8x7b 260" "mixtral_8x7b 1100" "deepseek_v3 2100" "gpt_oss_120b 2100" "qwen3_30b_a3b 1100" "qwen3_30b_a3b 4096"; do set -- $spec
  timeout 90 .device/probe/gather_a run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 64 > /tmp/r.txt 2>&1
  echo "gather_a check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
for round in 1 2; do
  for spec in "deepseek_v3 16384" "gpt_oss_120b 16384" "mixtral_8x7b 1024" "mixtral_8x7b 4096" "qwen3_30b_a3b 4096"; do
    set -- $spec
    bench "base r$round" .device/bin/moeforge $1 $2 uniform
    bench "skip_a r$round" .device/probe/skip_a $1 $2 uniform
    bench "gather_a r$round" .device/probe/gather_a $1 $2 uniform
    [ $round = 1 ] && bench "base balanced" .device/bin/moeforge $1 $2 balanced
  done
done
bash benches/results/2026-12-06_split_tail_tiles/call_b.sh
