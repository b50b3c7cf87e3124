# Units claimed in order on the expert-parallel path (a rank's warp-specialised GEMMs take
# their units from the rank's tickets), on two virtual ranks of one GPU: `run --check`, then
# HEAD against ec4ced6 (a rank's units dealt by block index), uniform routing, two rounds.
# Build: bash scripts/device-stage.sh, then PROBE_REV=ec4ced6 bash scripts/probe-build.sh -
# epbase. Run with carry [".device"]: bash benches/results/2026-12-06_ep_unit_claims/call.sh
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
nvidia-smi --query-gpu=name --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
for spec in "mixtral_8x7b 1100" "qwen3_30b_a3b 4096" "deepseek_v3 2100" "deepseek_v3 200" "mixtral_8x7b 100"; do set -- $spec
  timeout 120 .device/bin/moeforge run dsl-examples/$1.moe --ranks 2 --tokens $2 --seed 5 --check > /tmp/r.txt 2>&1
  echo "HEAD check $1 ranks 2, $2 per rank: rc $? $(grep -E -o 'PASS|FAIL' /tmp/r.txt | sort | uniq -c | tr -s ' \n' ' ')"
done
bench() {  # label binary model tokens
  timeout 200 $2 bench dsl-examples/$3.moe --ranks 2 --tokens $4 --seed 7 --iterations 20 --out /tmp/b > /tmp/o.txt 2>&1 || { echo "$3 $1 failed"; tail -3 /tmp/o.txt; }
  grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f2,3,7 | sed "s/^/$3 $1 |/" | tr -s ' '
}
for round in 1 2; do
  for spec in "mixtral_8x7b 1024,4096" "qwen3_30b_a3b 1024,4096" "deepseek_v3 1024,4096"; do
    set -- $spec
    bench "base r$round" .device/probe/epbase $1 $2
    bench "HEAD r$round" .device/bin/moeforge $1 $2
  done
done
