# Call H: GEMM1's epilogue staged in shared memory and stored by the producer's spare warps
# while the consumers multiply the next tile (staged, staged_epilogue_probe.patch: the ring
# one stage shorter, its last stage the buffer), against the shipped build (base, 463f0f7)
# and the ring one stage shorter alone (ringonly). First run --check of staged.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in "qwen3_30b_a3b 4096" "mixtral_8x7b 1024" "mixtral_8x7b 128" "gpt_oss_120b 4096" "deepseek_v3 4096"; do set -- $spec
  timeout 60 .device/probe/staged run dsl-examples/$1.moe --tokens $2 --seed 5 --check --sample 48 > /tmp/r.txt 2>&1; echo "staged check $1 $2: rc $? $(grep -o '[0-9]* of [0-9]* elements out of bound' /tmp/r.txt)"
done
for round in 1 2; do for spec in "qwen3_30b_a3b 4096" "qwen3_30b_a3b 16384" "mixtral_8x7b 4096" "deepseek_v3 4096"; do set -- $spec; for build in base:.device/base/moeforge staged:.device/probe/staged ringonly:.device/probe/ringonly; do
  timeout 60 ${build#*:} bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations 10 --out /tmp/b > /tmp/o.txt 2>&1 || echo "$1 $2 failed"
  echo "$1 $2 ${build%%:*} r$round: $(grep -E "^\| +[0-9]+ \|" /tmp/o.txt | cut -d'|' -f4,12,15 | tr -s ' ')"
done; done; done
