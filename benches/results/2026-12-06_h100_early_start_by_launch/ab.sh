#!/usr/bin/env bash
# Builds of moeforge on the same calls, in turns (in BUILDS' order in odd rounds, reversed
# in even ones; by default base = .device/base/moeforge, new = .device/bin/moeforge).
# Prints per call: model, T, build, round, caller-routed µs, self-routed µs, on its
# routing µs, self-routed minus on its routing. On the GPU machine after staging:
#   [SPECS="model T,T;..."] [ROUNDS=3] [ITER=20] [BUILDS="name:binary ..."] \
#     bash benches/results/2026-12-06_h100_early_start_by_launch/ab.sh
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
out=$(mktemp -d /tmp/ab.XXXXXX)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for round in $(seq ${ROUNDS:-3}); do
  order=${BUILDS:-base:.device/base/moeforge new:.device/bin/moeforge}
  [ $((round % 2)) -eq 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
  IFS=';' read -ra specs <<< "${SPECS:-mixtral_8x7b 16,64;qwen3_30b_a3b 16,128,256;deepseek_v3 16,128,512;gpt_oss_120b 64,512}"
  for spec in "${specs[@]}"; do
    set -- $spec
    for named in $order; do
      build=${named%%:*} bin=${named#*:}
      f=$out/${1}_${build}_$round.txt
      timeout 200 $bin bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations ${ITER:-20} --out /tmp/b > "$f" 2>&1 || echo "bench $1 $build failed ($?)"
      grep -E "^\| +[0-9]+ \|" "$f" | cut -d'|' -f2,4,12,15 | awk -F'|' -v m=$1 -v b=$build -v r=$round '{ printf "%s %d %s r%s | %s | %s | %s | %.1f\n", m, $1, b, r, $2, $3, $4, $3 - $4 }'
    done
  done
done
(cd "$out" && tar -czf "${OUT:-/tmp}/ab.tgz" *.txt)
