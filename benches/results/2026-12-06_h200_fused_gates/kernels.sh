# DeepSeek-V3's self-routed call against the same call on the router's own choices, kernel
# by kernel (Nsight Compute, kernels serialised, gpu__time_duration): where does the
# router's per-call cost in `bench` (30-120 us on an H200) go beyond the router kernel's
# own time? One input set per T (x from seed 7), written as safetensors, run self-routed
# with --outputs, then run again with its topk_ids and topk_weights as the caller's.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
m=${MODEL:-deepseek_v3}; hidden=${HIDDEN:-7168}
for t in ${TOKENS:-16 256}; do
  python3 - $t $hidden <<'PY'
import sys, torch
from safetensors.torch import save_file
t, hidden = int(sys.argv[1]), int(sys.argv[2])
x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
save_file({"x": x}, f"/tmp/x{t}.safetensors")
PY
  moeforge run dsl-examples/$m.moe --inputs /tmp/x$t.safetensors --outputs /tmp/o$t.safetensors --seed 7 > /dev/null || echo "run $t failed"
  python3 - $t <<'PY'
import sys
from safetensors.torch import load_file, save_file
t = sys.argv[1]
x, o = load_file(f"/tmp/x{t}.safetensors"), load_file(f"/tmp/o{t}.safetensors")
save_file({"x": x["x"], "topk_ids": o["topk_ids"], "topk_weights": o["topk_weights"]}, f"/tmp/xr{t}.safetensors")
print(f"T={t}: experts hit {o['topk_ids'].unique().numel()}, most rows of one expert {o['topk_ids'].flatten().bincount().max().item()}")
PY
  for mode in self caller; do
    input=/tmp/x$t.safetensors; [ $mode = caller ] && input=/tmp/xr$t.safetensors
    echo "-- $m T=$t $mode-routed: kernel us"
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
      moeforge run dsl-examples/$m.moe --inputs $input --seed 7 2>/dev/null |
      awk -F'","' '/gpu__time_duration/ { gsub(/"/, "", $NF); gsub(/,/, "", $NF); n[$5]++; printf "  %-44s %9.1f\n", $5, $NF / 1000; s += $NF / 1000 } END { printf "  %-44s %9.1f\n", "sum", s }'
  done
done
