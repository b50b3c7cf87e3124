# Where the router's per-call cost in `bench` exceeds its kernel's own time (Nsight Compute
# found the GEMMs of the two calls equal and the router 14-28 us): the same bench with CUDA
# graphs of repeated calls off, early start off, and both off, against the default, two
# rounds. Columns: T, caller-routed us, self-routed us, on its routing us, then self-routed
# minus on its routing. SETTINGS overrides the settings: "graphs early_start;..." with
# MOEFORGE_EARLY_START's values (1, 0 or kinds of launch: "1 1;1 router,gemm2,combine").
# SPECS: "model T,T;model T", ROUNDS, ITER.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for round in $(seq ${ROUNDS:-2}); do
  IFS=';' read -ra settings <<< "${SETTINGS:-1 1;0 1;1 0;0 0}"
  for setting in "${settings[@]}"; do
    IFS=';' read -ra specs <<< "${SPECS:-deepseek_v3 16,192,256;gpt_oss_120b 512}"
    for spec in "${specs[@]}"; do
      set -- $setting $spec
      MOEFORGE_CALL_GRAPHS=$1 MOEFORGE_EARLY_START=$2 timeout 150 moeforge bench dsl-examples/$3.moe --tokens $4 --seed 7 --iterations ${ITER:-15} --out /tmp/b > "$OUT/${3}_g$1_e${2//,/+}_$round.txt" 2>&1 || echo "bench $3 failed ($?)"
      echo "-- $3 graphs=$1 early_start=$2 round $round"
      grep -E "^\| +[0-9]+ \|" "$OUT/${3}_g$1_e${2//,/+}_$round.txt" | cut -d'|' -f2,4,12,15 | awk -F'|' '{ printf "%s|%s|%s|%s| %.1f\n", $1, $2, $3, $4, $3 - $4 }'
    done
  done
done
(cd $OUT && tar -czf benches.tgz *.txt && rm *.txt)
