# The quantized releases at real layer sizes against transformers (gpt-oss-120b's MXFP4
# layer, then DeepSeek-V3's FP8 one: 22.5 GB once dequantized), the checkpoints kept in
# /tmp/hfw; then `moeforge run` on each kept checkpoint (one token, no check) for its
# "loaded ..." line: how long the loader takes, dequantizing included.
# Run from the repository root after scripts/device-stage.sh.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nproc
start=$(date +%s)
timeout ${LIMIT:-480} python3 benches/hf_reference_check.py --moeforge .device/bin/moeforge \
  --families ${FAMILIES:-gpt_oss_mxfp4,deepseek_v3_fp8} --real-sizes --workdir /tmp/hfw > $OUT/hf_real.txt 2>&1
echo "hf_reference exit $? after $(( $(date +%s) - start )) s"
grep -vE "^\s*$" $OUT/hf_real.txt | grep -v "ExpertsInterface" | head -30
for dir in /tmp/hfw/*; do
  spec=$(ls $dir/*.moe 2>/dev/null | head -1); [ -n "$spec" ] && [ -f $dir/model.safetensors ] || continue
  timeout 120 .device/bin/moeforge run $spec --weights $dir/model.safetensors --tokens 1 2>&1 | grep -E "loaded|error" | head -3
done
