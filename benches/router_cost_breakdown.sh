#!/usr/bin/env bash
# What a layer's router costs, kernel by kernel (issue 9): one call routed by the layer
# itself and the same call with the router's choices passed in by the caller, each kernel
# alone under Nsight Compute (benches/kernel_breakdown.sh), on the GPU machine from the
# project root after staging:
#   bash benches/router_cost_breakdown.sh MODEL TOKENS
# MODEL names an example with a router in dsl-examples/. x is random (python3 with torch and
# safetensors), the weights are those of seed 7 in every run (the routing the caller passes
# is then the one the router chose); the files go to a temporary folder.
set -euo pipefail
[ $# -eq 2 ] || { sed -n 2,9p "$0" >&2; exit 2; }
model=$1 tokens=$2
moeforge=${MOEFORGE_BINARY:-.device/bin/moeforge}
work=$(mktemp -d "${TMPDIR:-/tmp}/router-cost.XXXXXX")
hidden=$("$moeforge" explain "dsl-examples/$model.moe" | awk '/^  hidden \(H\)/ { print $3; exit }')
[ -n "$hidden" ] || { echo "cannot read the hidden size of $model from explain" >&2; exit 1; }
python3 - "$work" "$tokens" "$hidden" <<'PY'
import sys, torch
from safetensors.torch import save_file
work, tokens, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(7)
save_file({"x": torch.randn(tokens, hidden).to(torch.bfloat16)}, f"{work}/x.safetensors")
PY
"$moeforge" run "dsl-examples/$model.moe" --inputs "$work/x.safetensors" --seed 7 \
  --outputs "$work/routed.safetensors" > /dev/null
python3 - "$work" <<'PY'
import sys
from safetensors.torch import load_file, save_file
work = sys.argv[1]
x = load_file(f"{work}/x.safetensors")["x"]
routed = load_file(f"{work}/routed.safetensors")
save_file({"x": x, "topk_ids": routed["topk_ids"], "topk_weights": routed["topk_weights"]},
          f"{work}/caller_routed.safetensors")
PY
echo "== self-routed"
bash benches/kernel_breakdown.sh "$model" "$work/x.safetensors" --seed 7
echo "== caller-routed, the router's choices"
bash benches/kernel_breakdown.sh "$model" "$work/caller_routed.safetensors" --seed 7
