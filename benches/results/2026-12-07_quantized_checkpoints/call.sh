# Session 61's first device call: the quantized checkpoints (DeepSeek-V3's FP8 and gpt-oss's
# MXFP4 releases, dequantized on loading) against transformers first, then the gated shared
# expert's call (2026-12-06_gated_shared_expert/call.sh: the GPU suite with LANES lanes,
# which runs every hf_reference family again, and the gate's cost, ROUNDS rounds, with
# RANK_BENCH=1 the ranks' fused decode against their table).
# Run from the repository root after scripts/device-stage.sh.
set -u
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/jit
start=$(date +%s)
timeout 200 python3 benches/hf_reference_check.py --moeforge .device/bin/moeforge \
  --families ${FAMILIES:-deepseek_v3_fp8,gpt_oss_mxfp4,deepseek_v3,gpt_oss} > $OUT/hf_quantized.txt 2>&1
echo "hf_reference exit $? after $(( $(date +%s) - start )) s"
grep -E "^\||FAILED|agree|Error|error" $OUT/hf_quantized.txt | head -30
bash benches/results/2026-12-06_gated_shared_expert/call.sh
