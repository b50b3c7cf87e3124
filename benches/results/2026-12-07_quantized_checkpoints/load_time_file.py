# Writes a safetensors file of one layer at full size, in a release's storage, with random
# (gpt_oss: MXFP4 codes) or constant values, for timing `moeforge run --weights` on the host
# without a model hub: python3 load_time_file.py gpt_oss|qwen3_fp8|qwen3_bf16 PATH, then
# moeforge run dsl-examples/gpt_oss_120b.moe (or qwen3_30b_a3b.moe) --weights PATH --tokens 1.
# Standard library only (no numpy on the development machine).
import json, os, sys
kind, path = sys.argv[1], sys.argv[2]
P = "model.layers.0."
tensors = []  # (name, dtype, shape, byte source)
def add(name, dtype, shape, fill):
    n = 1
    for d in shape: n *= d
    size = n * {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
    tensors.append((name, dtype, shape, size, fill))
if kind == "gpt_oss":
    E, H, F = 128, 2880, 2880
    add(P + "mlp.experts.gate_up_proj_blocks", "U8", [E, 2 * F, H // 32, 16], "random")
    add(P + "mlp.experts.gate_up_proj_scales", "U8", [E, 2 * F, H // 32], 127)
    add(P + "mlp.experts.down_proj_blocks", "U8", [E, H, F // 32, 16], "random")
    add(P + "mlp.experts.down_proj_scales", "U8", [E, H, F // 32], 127)
    add(P + "mlp.experts.gate_up_proj_bias", "BF16", [E, 2 * F], 0)
    add(P + "mlp.experts.down_proj_bias", "BF16", [E, H], 0)
    add(P + "mlp.router.weight", "BF16", [E, H], 0)
    add(P + "mlp.router.bias", "BF16", [E], 0)
elif kind == "qwen3_fp8":
    E, H, F = 128, 2048, 768
    for e in range(E):
        for proj, shape in (("gate_proj", [F, H]), ("up_proj", [F, H]), ("down_proj", [H, F])):
            add(P + f"mlp.experts.{e}.{proj}.weight", "F8_E4M3", shape, 0x38)
            add(P + f"mlp.experts.{e}.{proj}.weight_scale_inv", "F32",
                [(shape[0] + 127) // 128, (shape[1] + 127) // 128], 0)
    add(P + "mlp.gate.weight", "BF16", [E, H], 0)
elif kind == "qwen3_bf16":
    E, H, F = 128, 2048, 768
    for e in range(E):
        for proj, shape in (("gate_proj", [F, H]), ("up_proj", [F, H]), ("down_proj", [H, F])):
            add(P + f"mlp.experts.{e}.{proj}.weight", "BF16", shape, 0x3c)
    add(P + "mlp.gate.weight", "BF16", [E, H], 0)
header, offset = {}, 0
for name, dtype, shape, size, fill in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
    offset += size
blob = json.dumps(header).encode()
blob += b" " * (-len(blob) % 8)
with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little")); f.write(blob)
    chunk = 1 << 24
    for name, dtype, shape, size, fill in tensors:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n) if fill == "random" else bytes([fill]) * n)
            left -= n
print(path, offset / 1e9, "GB")
