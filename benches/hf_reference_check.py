#!/usr/bin/env python3
"""moeforge against the reference implementation: Hugging Face transformers' MoE blocks.

Per model family, on one CUDA GPU:

1. builds the family's sparse MoE block from transformers (a small random configuration,
   and with --real-sizes also one at the sizes of a real layer), in bf16, with weights
   drawn uniform in +-sqrt(3 / fan_in) from --seed (GPT-OSS's and DeepSeek-V3's extra
   terms drawn as "Drawn weights" below says);
2. saves its router gate (and the gate's bias), experts (and shared experts, and their
   gate) as safetensors under the tensor names of the family's published checkpoints for
   one layer (`model.layers.0.`), which is what `moeforge run --weights` reads
   (transformers 5 keeps the experts fused in 3-D parameters; Mixtral's, Qwen3-MoE's,
   Qwen2-MoE's and DeepSeek-V3's checkpoints, and this file, keep one tensor per expert
   and projection; GPT-OSS's keep the fused tensors, which this file saves as the block
   holds them);
3. writes a matching `.moe` spec (the family's `router { }` rule, activation, expert
   biases and shared experts, `gated` where their gate weighs them);
4. runs the block on random x [T, H] (uniform in +-1, bf16), records its output y and its
   router's logits, chosen experts and weights;
5. runs `moeforge run SPEC --weights CKPT --inputs FILE --outputs FILE --check` twice on
   the same x (side by side for the small configuration): once routing itself (the
   spec's router on the GPU), once with the reference's chosen experts and weights passed
   in (so the experts' arithmetic is compared on every token, whatever the router did);
6. compares, and prints one table row per case; exits 1 when a case fails, 77 when it
   cannot run (no torch, transformers, safetensors or CUDA device), else 0.

Before moeforge runs, the script checks itself on the reference: the router's returned
logits must be x W^T (+ the router bias) recomputed here; the script's own statement of
the family's rule (`route`, in f32 on those logits) must choose the reference's experts
(up to near-ties as below) with its weights (within the weight bound); the layer's formula
in f32 from the saved weights (`f32_layer`) must be within the output bound of the
reference's y (`ref vs f32`); and the terms that set a family apart must have acted on
this input (DeepSeek-V3: the correction bias and the group limit each change some token's
choice; GPT-OSS: the router bias changes some choice, and some pre-activations reach the
clamp; Qwen2-MoE: the shared expert gate's weights span at least SHARED_GATE_SPREAD (0.25)
over the tokens, so that neither its absence, nor a closed gate, nor one token's weight on
another's row would pass). A failure there is the script's (or transformers' layout
changed) and fails the case, saying which.

Tolerances (bf16 everywhere; `ulp` below is bf16's, a relative 2^-8 to 2^-7):

* Chosen experts. The reference computes the router logits with a bf16 Linear (f32
  accumulation, the result rounded to bf16, so each logit is off by up to 2^-8 of its
  magnitude); moeforge keeps them in f32. Two experts whose logits are within 2 * 2^-8 of
  their magnitude may therefore swap places at the top-k boundary. A token's chosen set
  may differ from the reference's only when every expert in the difference has a
  reference selection value within TIE_RTOL * max(|value|, |K-th value|) + TIE_ATOL of the
  reference's K-th best (TIE_RTOL = 2^-6: twice that worst case; TIE_ATOL = 1e-3 for the
  f32 accumulation order near zero). The selection values are the logits for Mixtral,
  Qwen3-MoE and Qwen2-MoE (softmax keeps their order) and GPT-OSS (its logits include the
  router bias); for DeepSeek-V3 they are sigmoid(logit) + e_score_correction_bias, and
  with its group limit the chosen set must be the top-k, up to that tolerance, of the
  experts of some kept-group set that the reference's group scores allow up to the same
  tolerance (every group scored beyond it above the kept-th best is kept, none beyond it
  below). DeepSeek-V3's reference computes its logits in f32 (its router upcasts), so
  there the tolerance is loose: expect no flips. Such a token is a "tie flip", reported
  and left out of the routed output comparison (its output is a different sum); any other
  difference fails.
* Routing weights of agreeing experts: |w_moeforge - w_ref| <= 2^-5 * w_ref + 2^-9. The
  weights are softmax values of logits that differ by up to 2^-8 relative (the reference's
  bf16 logits), which moves a renormalised weight by up to about 2 * 2^-8 * |logit| of
  itself (2^-5 covers logits up to 4 in magnitude; these configurations stay below 3;
  GPT-OSS's softmax over its k chosen logits moves the same way), and Qwen3-MoE's,
  Qwen2-MoE's and GPT-OSS's references round their weights to bf16 (2^-9 absolute below
  1). DeepSeek-V3's weights (normalised sigmoid scores times routed_scaling_factor, up to
  2.5) come from f32 logits on both sides, far inside the relative bound.
* Outputs: |y_moeforge - y_ref| <= atol + rtol * |y_ref| element-wise, with
  rtol = 2^-6 and atol = 2^-5 * rms(y_ref) when moeforge is given the reference's
  routing. The reference rounds to bf16 after the gate/up GEMM, the activation, the
  product, the down GEMM, the weighting and each of the K accumulations (index_add_ in
  bf16); moeforge accumulates in f32 and rounds the intermediate and the result. Where one
  expert dominates an element that is a few ulps of relative error, under rtol (about 4
  half-ulps); the intermediate's roundings add up in the down projection as noise of about
  2^-9 * rms(y) per rounding, whose tail over 10^5 elements stays under 2^-6 * rms, half
  of atol. GPT-OSS's reference rounds more often (after each bias add and each step of the
  clamped SwiGLU: about twice the intermediate roundings of SwiGLU); DeepSeek-V3's adds its
  shared MLP's bf16 output to the bf16 routed sum (one more rounding of y, and the shared
  MLP's own); Qwen2-MoE's does the same after weighing that output by its gate, rounded
  twice more (the sigmoid of the gate's bf16 logit, and the product, each to bf16: a few
  ulps of the shared term, the order of its own roundings). All three stayed within the
  same bound in dry runs of the reference side on a CPU (seed 7; cuBLAS rounds its GEMMs'
  sums the same way but accumulates in another order): `ref vs f32` 0.62 (small) and 0.81
  (gpt-oss-120b's sizes) for GPT-OSS, 0.66 (small) and 0.78 (DeepSeek-V3's H, F, K and
  groups with 32 experts; its 256 do not fit that machine) for DeepSeek-V3 (2026-11-30,
  torch 2.15, transformers 5.24); 0.64 (small) and 0.67 (Qwen1.5-MoE-A2.7B's sizes) for
  Qwen2-MoE (2026-12-06, torch 2.15, transformers 5.25). If the reference's own rounding
  ever exceeds the bound the case fails saying so, not silently.
  When moeforge routes itself the weights may differ as above, so the bound is
  doubled (rtol = 2^-5, atol = 2^-4 * rms).
  Given the reference's routing, moeforge is held to that bound against the layer's
  formula computed in f32 from the same bf16 weights (`given vs f32`), the reference is
  checked against the same (`ref vs f32`: the script read the weights right), and the two
  are held to twice the bound against each other (`given vs ref (2x)`): each rounds in
  its own places, so their distance is up to the sum of their distances from the f32
  formula. Measured 2026-11-30 at Qwen3-30B-A3B's real sizes (K = 8 bf16 accumulations in
  the reference): the reference alone reached 0.88 of the bound, and moeforge against the
  reference 1.03 of one bound, which is why a single bound between the two was too tight.

Drawn weights. transformers initialises DeepSeek-V3's e_score_correction_bias to zeros,
and uniform +-sqrt(3 / fan_in) weights keep GPT-OSS's pre-activations far from its clamp,
so either term could be wrong unseen. DeepSeek-V3's correction bias is drawn uniform in
+-CORRECTION_BOUND (0.1, against sigmoid scores of spread about 0.14), kept in f32 as its
checkpoints keep it. GPT-OSS's gate_up_proj is drawn GPT_OSS_GATE_UP_WIDTH (7) times wider
(pre-activations of rms about 4: some 4% of gates and 8% of ups pass the clamp at 7), its
expert biases uniform in +-EXPERT_BIAS_BOUND (1) and its router bias in
+-ROUTER_BIAS_BOUND (0.5); its 3-D weights take fan_in from their middle dimension
([E, in, out]). Qwen2-MoE's shared expert gate [1, H] is drawn as every weight (fan_in H):
its logits x w_g^T have an rms of about 0.58 on this x, so the gate weighs the tokens'
shared MLP outputs by about 0.13 to 0.87, which acts as the self-check requires.

Quantized checkpoints. DeepSeek-V3's release stores its experts (routed and shared) in
FP8 E4M3 with a f32 scale per 128 x 128 block (`<name>_scale_inv`), gpt-oss's its experts in
MXFP4 (`_blocks` and `_scales`); moeforge dequantizes both to bf16 on loading. The cases
`deepseek_v3_fp8` and `gpt_oss_mxfp4` quantize the block's expert weights as those releases
do, write the quantized tensors under the releases' names, and put the values they code
(code times scale, rounded to bf16) back into the block, so the reference computes with
exactly what the checkpoint holds; every tolerance is then the bf16 cases'. A loader that
read the codes, blocks, scales or nibbles wrongly would be off by far more.

Model families: Mixtral (MixtralSparseMoeBlock: softmax, top-k, renormalise), Qwen3-MoE
(Qwen3MoeSparseMoeBlock: softmax, top-k, renormalised when norm_topk_prob, checked both
ways), Qwen2-MoE (Qwen2MoeSparseMoeBlock: Qwen3-MoE's router, not renormalised, as in
Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B, plus one shared MLP of FFN
shared_expert_intermediate_size whose output is weighed per token by
sigmoid(x shared_expert_gate^T), the gate a [1, H] Linear without bias; moeforge cuts the
shared MLP into slices of the routed FFN: two in the small case, four at
Qwen1.5-MoE-A2.7B's sizes), DeepSeek-V3 (DeepseekV3MoE: sigmoid, e_score_correction_bias
choosing, group-limited top-k over n_group groups keeping topk_group, normalised, times
routed_scaling_factor 2.5, plus the shared MLP of FFN n_shared_experts *
moe_intermediate_size, ungated; its small case has two shared experts, so moeforge cuts
the shared MLP into two slices, the real one one) and GPT-OSS (GptOssMLP: router Linear
with a bias, top-k of its logits, softmax over the k; experts with biases and the clamped
SwiGLU; the fused gate_up_proj [E, H, 2F] interleaves gate and up columns).

Usage (on the GPU machine, from the repository root):

    cargo build --release
    python3 benches/hf_reference_check.py --moeforge target/release/moeforge [--real-sizes]

`--device cpu` runs the reference side on the CPU (a dry run of the script itself: the
moeforge binary still needs a GPU, so its runs fail there unless --moeforge names a
stand-in); the default, and the check, is `cuda`.
"""

import argparse
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback

SKIP_EXIT = 77

TIE_RTOL = 2.0**-6
TIE_ATOL = 1e-3
WEIGHT_RTOL = 2.0**-5
WEIGHT_ATOL = 2.0**-9
GIVEN_RTOL = 2.0**-6
GIVEN_ATOL_PER_RMS = 2.0**-5
ROUTED_RTOL = 2.0**-5
ROUTED_ATOL_PER_RMS = 2.0**-4

# DeepSeek-V3's `normalize` divides by the sum plus this (moeforge's NORMALIZE_EPSILON).
NORMALIZE_EPSILON = 1e-20
# GPT-OSS's clamped SwiGLU, as moeforge's `clamped_swiglu` fixes it; a block whose
# constants differ fails the case.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
# Draws that make the extra terms act (see "Drawn weights" above).
CORRECTION_BOUND = 0.1
GPT_OSS_GATE_UP_WIDTH = 7.0
EXPERT_BIAS_BOUND = 1.0
ROUTER_BIAS_BOUND = 0.5
# Qwen2-MoE's shared expert gate must weigh the tokens' shared MLP outputs at least this
# far apart (its sigmoid lies in (0, 1)), or it could pass unchecked: absent (weight 1),
# closed (weight 0), or one token's weight applied to another's row.
SHARED_GATE_SPREAD = 0.25

PREFIX = "model.layers.0."


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int
    ffn: int
    experts: int
    top_k: int
    groups: int = 0  # DeepSeek-V3's n_group (0: no group limit)
    groups_kept: int = 0  # its topk_group
    # One shared MLP of FFN shared * ffn: DeepSeek-V3's n_shared_experts, Qwen2-MoE's
    # shared_expert_intermediate_size / moe_intermediate_size (0: none).
    shared: int = 0

    def __post_init__(self):
        # The router's outputs are told apart by their last dimension (E or K).
        assert self.experts != self.top_k, self
        assert 0 < self.top_k <= self.experts, self
        if self.groups:
            assert self.experts % self.groups == 0, self
            assert 0 < self.groups_kept <= self.groups, self
            assert self.groups_kept * (self.experts // self.groups) >= self.top_k, self


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: how to build its block, and how its checkpoints name the tensors."""

    name: str
    moeforge_family: str  # `moeforge run --family`
    small: Sizes
    real: Sizes  # a real model's layer
    real_model: str
    normalize: bool = True
    # The router's scoring: softmax (over all experts, then top-k), sigmoid (DeepSeek-V3:
    # with the score correction choosing and the group limit), topk_softmax (GPT-OSS).
    scoring: str = "softmax"
    scale: float = 1.0  # routed_scaling_factor
    # How the checkpoint stores the experts: "" bf16; "fp8" (DeepSeek-V3's release: F8_E4M3
    # with 128 x 128 block scales) or "mxfp4" (gpt-oss's release): see "Quantized
    # checkpoints" in the docstring.
    quantization: str = ""
    # Set when moeforge cannot compute the family's block yet: why.
    skip_reason: str = ""

    def __post_init__(self):
        # Qwen2-MoE's block always builds its shared MLP.
        assert not self.shared_gated or (self.small.shared and self.real.shared), self

    @property
    def gpt_oss(self):
        return self.moeforge_family == "gpt-oss"

    @property
    def deepseek(self):
        return self.moeforge_family == "deepseek-v3"

    @property
    def shared_gated(self):
        """Whether the shared MLP's output is weighed per token by sigmoid(x w_g^T), w_g its
        gate's weights [1, H] (Qwen2-MoE's shared_expert_gate)."""
        return self.moeforge_family == "qwen2-moe"

    @property
    def shared_module(self):
        """The shared MLP's attribute in the block, which is also its name under `mlp.` in
        the published checkpoints."""
        return "shared_expert" if self.moeforge_family == "qwen2-moe" else "shared_experts"

    def router_module(self, block):
        return block.router if self.gpt_oss else block.gate

    def gate_names(self):
        """The router's (weight, bias) names in the published checkpoints; no bias: None."""
        if self.moeforge_family == "mixtral":
            return (f"{PREFIX}block_sparse_moe.gate.weight", None)
        if self.gpt_oss:
            return (f"{PREFIX}mlp.router.weight", f"{PREFIX}mlp.router.bias")
        if self.deepseek:
            return (f"{PREFIX}mlp.gate.weight", f"{PREFIX}mlp.gate.e_score_correction_bias")
        return (f"{PREFIX}mlp.gate.weight", None)

    def expert_names(self, e):
        """Expert e's (gate, up, down) projection names in the published checkpoints."""
        assert not self.gpt_oss, "GPT-OSS's checkpoints fuse the experts (fused_names)"
        if self.moeforge_family == "mixtral":
            base = f"{PREFIX}block_sparse_moe.experts.{e}"
            return (f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight")
        base = f"{PREFIX}mlp.experts.{e}"
        return (f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight")

    def shared_names(self):
        """The shared MLP's (gate, up, down) names (DeepSeek-V3, Qwen2-MoE)."""
        base = f"{PREFIX}mlp.{self.shared_module}"
        return (f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight")

    def shared_gate_name(self):
        """The shared expert gate's weight [1, H] (Qwen2-MoE)."""
        assert self.shared_gated, self.name
        return f"{PREFIX}mlp.shared_expert_gate.weight"

    def fused_names(self):
        """GPT-OSS's fused expert tensors, named as transformers' GptOssExperts names its
        parameters: gate_up_proj [E, H, 2F], gate_up_proj_bias [E, 2F], down_proj [E, F, H],
        down_proj_bias [E, H]."""
        base = f"{PREFIX}mlp.experts"
        return {
            "gate_up_proj": f"{base}.gate_up_proj",
            "gate_up_proj_bias": f"{base}.gate_up_proj_bias",
            "down_proj": f"{base}.down_proj",
            "down_proj_bias": f"{base}.down_proj_bias",
        }

    def module_expert_names(self):
        """The (gate, up, down) Linear names of a per-expert module (transformers 4)."""
        if self.moeforge_family == "mixtral":
            return ("w1", "w3", "w2")
        return ("gate_proj", "up_proj", "down_proj")

    def build(self, sizes, device):
        """The transformers block at `sizes`, on `device` in bf16, eval mode."""
        import torch

        if self.moeforge_family == "mixtral":
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

            config = MixtralConfig(
                hidden_size=sizes.hidden,
                intermediate_size=sizes.ffn,
                num_local_experts=sizes.experts,
                num_experts_per_tok=sizes.top_k,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
                router_jitter_noise=0.0,
            )
            block_class = MixtralSparseMoeBlock
        elif self.deepseek:
            from transformers import DeepseekV3Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

            config = DeepseekV3Config(
                hidden_size=sizes.hidden,
                intermediate_size=sizes.ffn,  # the dense layers' MLP: not built here
                moe_intermediate_size=sizes.ffn,
                n_routed_experts=sizes.experts,
                num_experts_per_tok=sizes.top_k,
                n_shared_experts=sizes.shared,
                n_group=sizes.groups,
                topk_group=sizes.groups_kept,
                norm_topk_prob=self.normalize,
                routed_scaling_factor=self.scale,
                hidden_act="silu",
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
            block_class = DeepseekV3MoE
        elif self.gpt_oss:
            from transformers import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

            config = GptOssConfig(
                hidden_size=sizes.hidden,
                intermediate_size=sizes.ffn,
                num_local_experts=sizes.experts,
                num_experts_per_tok=sizes.top_k,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
            block_class = GptOssMLP
        elif self.moeforge_family == "qwen2-moe":
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

            config = Qwen2MoeConfig(
                hidden_size=sizes.hidden,
                moe_intermediate_size=sizes.ffn,
                intermediate_size=sizes.ffn,  # the dense layers' MLP: not built here
                shared_expert_intermediate_size=sizes.shared * sizes.ffn,
                num_experts=sizes.experts,
                num_experts_per_tok=sizes.top_k,
                norm_topk_prob=self.normalize,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
            block_class = Qwen2MoeSparseMoeBlock
        else:
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

            config = Qwen3MoeConfig(
                hidden_size=sizes.hidden,
                moe_intermediate_size=sizes.ffn,
                intermediate_size=sizes.ffn,
                num_experts=sizes.experts,
                num_experts_per_tok=sizes.top_k,
                norm_topk_prob=self.normalize,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=4,
            )
            block_class = Qwen3MoeSparseMoeBlock
        # Built in bf16 (parameters made f32 on purpose stay f32 until the cast below): half
        # the memory of building in f32, 22.5 GB rather than 45 at DeepSeek-V3's real sizes.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                block = block_class(config)
        finally:
            torch.set_default_dtype(previous)
        block = block.to(torch.bfloat16).eval()
        if self.gpt_oss:
            alpha, limit = getattr(block.experts, "alpha", None), getattr(block.experts, "limit", None)
            if (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
                raise RuntimeError(
                    f"GptOssExperts has alpha {alpha}, limit {limit}; moeforge's clamped_swiglu "
                    f"computes alpha {SWIGLU_ALPHA}, limit {SWIGLU_LIMIT}"
                )
        return block

    def spec(self, layer, sizes, max_tokens):
        if self.scoring == "softmax":
            normalize = "true" if self.normalize else "false"
            router = f"""    scoring = softmax
    normalize = {normalize}"""
        elif self.scoring == "sigmoid":
            normalize = "true" if self.normalize else "false"
            router = f"""    scoring = sigmoid
    bias = score_correction
    groups = {sizes.groups}
    groups_kept = {sizes.groups_kept}
    normalize = {normalize}
    scale = {self.scale!r}"""
        elif self.scoring == "topk_softmax":
            router = """    scoring = topk_softmax
    bias = logits"""
        else:
            raise AssertionError(self.scoring)
        extra = ""
        if self.gpt_oss:
            extra += "  activation = clamped_swiglu\n  expert_bias = true\n"
        else:
            extra += "  activation = swiglu\n"
        if sizes.shared:
            gated = "    gated = true\n" if self.shared_gated else ""
            extra += f"""
  shared_experts {{
    count = 1
    ffn = {sizes.shared * sizes.ffn}
{gated}  }}
"""
        return f"""# Written by benches/hf_reference_check.py: {self.name}, hidden {sizes.hidden}, ffn {sizes.ffn},
# {sizes.experts} experts, top {sizes.top_k}; weights in the checkpoint next to this file.

topology one_gpu {{
  gpus_per_node = 1
  nvlink = 450 GB/s, 3 us
  network = 50 GB/s, 10 us
}}

layer {layer} {{
  hidden = {sizes.hidden}
  ffn = {sizes.ffn}
  experts = {sizes.experts}
  top_k = {sizes.top_k}
{extra}  max_tokens = {max_tokens}

  router {{
{router}
  }}
  topology = one_gpu
}}
"""


# Small sizes keep 2F != H and F != H, so that a fused expert tensor's orientation is
# unambiguous (GPT-OSS's real F = H = 2880: its layout is read by name, not by shape).
FAMILIES = [
    Family(
        name="mixtral",
        moeforge_family="mixtral",
        small=Sizes(hidden=256, ffn=384, experts=8, top_k=2),
        real=Sizes(hidden=4096, ffn=14336, experts=8, top_k=2),
        real_model="Mixtral-8x7B",
    ),
    Family(
        name="qwen3_moe",
        moeforge_family="qwen3-moe",
        small=Sizes(hidden=256, ffn=192, experts=16, top_k=4),
        real=Sizes(hidden=2048, ffn=768, experts=128, top_k=8),
        real_model="Qwen3-30B-A3B",
    ),
    Family(
        name="qwen3_moe_unnormalized",
        moeforge_family="qwen3-moe",
        small=Sizes(hidden=256, ffn=192, experts=16, top_k=4),
        real=Sizes(hidden=2048, ffn=768, experts=128, top_k=8),
        real_model="Qwen3-30B-A3B with norm_topk_prob false",
        normalize=False,
    ),
    Family(
        name="qwen2_moe",
        moeforge_family="qwen2-moe",
        small=Sizes(hidden=256, ffn=192, experts=16, top_k=4, shared=2),
        real=Sizes(hidden=2048, ffn=1408, experts=60, top_k=4, shared=4),
        real_model="Qwen1.5-MoE-A2.7B",
        normalize=False,
    ),
    Family(
        name="deepseek_v3",
        moeforge_family="deepseek-v3",
        small=Sizes(hidden=256, ffn=192, experts=16, top_k=4, groups=4, groups_kept=2, shared=2),
        real=Sizes(hidden=7168, ffn=2048, experts=256, top_k=8, groups=8, groups_kept=4, shared=1),
        real_model="DeepSeek-V3",
        scoring="sigmoid",
        scale=2.5,
    ),
    Family(
        name="gpt_oss",
        moeforge_family="gpt-oss",
        small=Sizes(hidden=256, ffn=192, experts=16, top_k=4),
        real=Sizes(hidden=2880, ffn=2880, experts=128, top_k=4),
        real_model="gpt-oss-120b",
        normalize=False,
        scoring="topk_softmax",
    ),
]
# The same blocks with their experts stored as the published releases store them.
FAMILIES += [
    dataclasses.replace(next(f for f in FAMILIES if f.name == base), name=f"{base}_{quantization}",
                        quantization=quantization)
    for base, quantization in (("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4"))
]

# DeepSeek-V3's FP8 release: E4M3 codes (largest 448) in blocks of 128 x 128 of each
# [out, in] matrix, each block's f32 scale beside it as `<name>_scale_inv`.
FP8_BLOCK = 128
FP8_MAX = 448.0
# gpt-oss's MXFP4 release: 32 FP4 E2M1 codes (magnitudes below, sign in bit 3) per E8M0
# scale 2^(s - 127), along the input dimension of each [out, in] expert matrix.
MXFP4_BLOCK = 32
FP4_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@dataclasses.dataclass
class Row:
    case: str
    tokens: int = 0
    agree: str = ""
    tie_flips: int = 0
    weight_error: float = 0.0
    routed: str = ""
    given: str = ""
    given_vs_reference: str = ""
    reference_itself: str = ""
    verdict: str = "FAIL"
    notes: list = dataclasses.field(default_factory=list)
    info: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Expert:
    """One expert's projections as the layer's formula reads them: gate and up [F, H],
    down [H, F], and its biases (b_gate, b_up [F], b_down [H]) or None; for a gated shared
    MLP (Qwen2-MoE), output_gate w_g [1, H], which weighs its output by sigmoid(x w_g^T)."""

    gate: object
    up: object
    down: object
    b_gate: object = None
    b_up: object = None
    b_down: object = None
    output_gate: object = None


def import_prerequisites(device):
    """torch, transformers and safetensors, or why not (the check then skips)."""
    try:
        import safetensors.torch  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as error:
        return f"python3 lacks {error.name}: pip install torch transformers safetensors"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return ""


def expect_shape(what, tensor, shape):
    if tuple(tensor.shape) != tuple(shape):
        raise RuntimeError(f"{what} has shape {tuple(tensor.shape)}; expected {tuple(shape)}")


def initialise(family, block, sizes, seed):
    """Every parameter uniform in +-sqrt(3 / fan_in) (transformers 5 leaves them empty);
    GPT-OSS's and DeepSeek-V3's extra terms as the docstring's "Drawn weights" says."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in block.named_parameters():
            if family.gpt_oss and name in ("experts.gate_up_proj_bias", "experts.down_proj_bias"):
                parameter.uniform_(-EXPERT_BIAS_BOUND, EXPERT_BIAS_BOUND)
                continue
            if family.gpt_oss and name == "router.bias":
                parameter.uniform_(-ROUTER_BIAS_BOUND, ROUTER_BIAS_BOUND)
                continue
            fan_in, width = parameter.shape[-1], 1.0
            if family.gpt_oss and parameter.dim() == 3:
                fan_in = parameter.shape[1]  # [E, in, out]: `x @ W`
            if family.gpt_oss and name == "experts.gate_up_proj":
                width = GPT_OSS_GATE_UP_WIDTH
            bound = width * math.sqrt(3.0 / fan_in)
            parameter.uniform_(-bound, bound)
        if family.deepseek:
            gate = block.gate
            expect_shape("gate.e_score_correction_bias", gate.e_score_correction_bias, (sizes.experts,))
            device = gate.e_score_correction_bias.device
            # Kept in f32, as DeepSeek-V3 keeps it (block.to(bf16) rounded the buffer).
            gate.e_score_correction_bias = torch.empty(
                sizes.experts, dtype=torch.float32, device=device
            ).uniform_(-CORRECTION_BOUND, CORRECTION_BOUND)


def expert_tensors(family, block, sizes):
    """Per expert, an Expert read from the block whichever way this transformers version
    stores them: GPT-OSS's fused [E, H, 2F] with interleaved gate (even) and up (odd)
    columns and [E, F, H] down, with biases; the others' fused 3-D parameters (gate rows
    then up rows, as transformers 5's experts chunk them) or one module per expert."""
    experts = block.experts
    e, h, f = sizes.experts, sizes.hidden, sizes.ffn
    if family.gpt_oss:
        expect_shape("experts.gate_up_proj", experts.gate_up_proj, (e, h, 2 * f))
        expect_shape("experts.gate_up_proj_bias", experts.gate_up_proj_bias, (e, 2 * f))
        expect_shape("experts.down_proj", experts.down_proj, (e, f, h))
        expect_shape("experts.down_proj_bias", experts.down_proj_bias, (e, h))
        gate_up, gate_up_bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
        down, down_bias = experts.down_proj.detach(), experts.down_proj_bias.detach()
        return [
            Expert(
                gate=gate_up[i][:, 0::2].T,
                up=gate_up[i][:, 1::2].T,
                down=down[i].T,
                b_gate=gate_up_bias[i][0::2],
                b_up=gate_up_bias[i][1::2],
                b_down=down_bias[i],
            )
            for i in range(e)
        ]
    gate_up = getattr(experts, "gate_up_proj", None)
    if gate_up is not None and gate_up.dim() == 3:
        down = experts.down_proj
        if tuple(gate_up.shape) == (e, 2 * f, h):
            fused = gate_up
        elif tuple(gate_up.shape) == (e, h, 2 * f):
            fused = gate_up.transpose(1, 2)
        else:
            raise RuntimeError(f"gate_up_proj has shape {tuple(gate_up.shape)}; expected [E, 2F, H]")
        if tuple(down.shape) == (e, h, f):
            downs = down
        elif tuple(down.shape) == (e, f, h):
            downs = down.transpose(1, 2)
        else:
            raise RuntimeError(f"down_proj has shape {tuple(down.shape)}; expected [E, H, F]")
        fused, downs = fused.detach(), downs.detach()
        result = [Expert(fused[i, :f], fused[i, f:], downs[i]) for i in range(e)]
    else:
        gate, up, down = family.module_expert_names()
        result = [
            Expert(getattr(m, gate).weight.detach(), getattr(m, up).weight.detach(),
                   getattr(m, down).weight.detach())
            for m in experts
        ]
    if len(result) != e:
        raise RuntimeError(f"the block holds {len(result)} experts; expected {e}")
    for i, x in enumerate(result):
        expect_shape(f"expert {i}'s gate", x.gate, (f, h))
        expect_shape(f"expert {i}'s up", x.up, (f, h))
        expect_shape(f"expert {i}'s down", x.down, (h, f))
    return result


def shared_tensors(family, block, sizes):
    """The shared MLP (DeepSeek-V3's, Qwen2-MoE's with its gate) as one Expert of FFN
    shared * ffn, or None."""
    if not sizes.shared:
        return None
    module = family.shared_module
    shared = getattr(block, module)
    total = sizes.shared * sizes.ffn
    output_gate = None
    if family.shared_gated:
        gate = block.shared_expert_gate
        expect_shape("shared_expert_gate.weight", gate.weight, (1, sizes.hidden))
        if gate.bias is not None:
            raise RuntimeError("shared_expert_gate has a bias; moeforge's shared expert gate has none")
        output_gate = gate.weight.detach()
    expert = Expert(shared.gate_proj.weight.detach(), shared.up_proj.weight.detach(),
                    shared.down_proj.weight.detach(), output_gate=output_gate)
    expect_shape(f"{module}.gate_proj", expert.gate, (total, sizes.hidden))
    expect_shape(f"{module}.up_proj", expert.up, (total, sizes.hidden))
    expect_shape(f"{module}.down_proj", expert.down, (sizes.hidden, total))
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(shared, name).bias is not None:
            raise RuntimeError(f"{module}.{name} has a bias; moeforge's shared experts have none")
    return expert


def checkpoint_tensors(family, block, sizes, experts, shared):
    """The layer's tensors under the family's checkpoint names."""
    import torch

    router = family.router_module(block)
    weight_name, bias_name = family.gate_names()
    expect_shape("the router's weight", router.weight, (sizes.experts, sizes.hidden))
    tensors = {weight_name: router.weight.detach()}
    if family.deepseek:
        bias = router.e_score_correction_bias
        if bias.dtype != torch.float32:
            raise RuntimeError(f"e_score_correction_bias is {bias.dtype}; the script keeps it f32")
        tensors[bias_name] = bias.detach()
    elif family.gpt_oss:
        expect_shape("router.bias", router.bias, (sizes.experts,))
        tensors[bias_name] = router.bias.detach()
    else:
        assert bias_name is None
        if getattr(router, "bias", None) is not None:
            raise RuntimeError(f"{family.name}'s router has a bias, which its rule does not read")
    if family.gpt_oss:
        for attribute, name in family.fused_names().items():
            tensors[name] = getattr(block.experts, attribute).detach()
    else:
        for e, expert in enumerate(experts):
            for name, tensor in zip(family.expert_names(e), (expert.gate, expert.up, expert.down)):
                tensors[name] = tensor
    if shared is not None:
        for name, tensor in zip(family.shared_names(), (shared.gate, shared.up, shared.down)):
            tensors[name] = tensor
        if family.shared_gated:
            tensors[family.shared_gate_name()] = shared.output_gate
    return {k: v.contiguous().cpu() for k, v in tensors.items()}


def fp8_round_trip(weight):
    """Quantizes the bf16 matrix `weight` [R, C] as DeepSeek-V3's release does (per block of
    FP8_BLOCK x FP8_BLOCK: scale = amax / 448, codes = E4M3(w / scale)) and writes the
    values they code back into it (code * scale in f32, rounded to bf16), so the reference
    block computes with what the checkpoint holds. Returns (codes [R, C] float8_e4m3fn,
    scale_inv [ceil(R / 128), ceil(C / 128)] f32)."""
    import torch

    rows, cols = weight.shape
    b = FP8_BLOCK
    sr, sc = -(-rows // b), -(-cols // b)
    padded = torch.zeros(sr * b, sc * b, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(sr, b, sc, b)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    spread = scale[:, None, :, None]
    codes = (blocks / spread).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = (codes.float() * spread).view(sr * b, sc * b)[:rows, :cols]
    weight.copy_(values.to(torch.bfloat16))
    return codes.view(sr * b, sc * b)[:rows, :cols].contiguous(), scale.contiguous()


def mxfp4_round_trip(matrices):
    """Quantizes the bf16 matrices `matrices` [E, R, C] (C a multiple of 32) as gpt-oss's
    release does (per 32 values along C: scale 2^ceil(log2(amax / 6)), each value to the
    nearest E2M1 code of value / scale) and writes the values they code back into them.
    Returns (blocks [E, R, C / 32, 16] uint8, two codes a byte, the even column's in the
    low nibble; scales [E, R, C / 32] uint8, the exponent plus 127)."""
    import torch

    count, rows, cols = matrices.shape
    assert cols % MXFP4_BLOCK == 0, (matrices.shape, "MXFP4 blocks are whole")
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32, device=matrices.device)
    all_blocks, all_scales = [], []
    for e in range(count):  # one expert at a time: the nearest-code search is 8x the matrix
        values = matrices[e].float().reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
        amax = values.abs().amax(dim=-1)
        exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP4_MAGNITUDES[-1])),
                               torch.full_like(amax, -127.0)).clamp(-127, 127)
        scaled = values / torch.exp2(exponent)[..., None]
        index = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
        negative = scaled < 0
        dequantized = torch.where(negative, -magnitudes[index], magnitudes[index])
        matrices[e].copy_((dequantized * torch.exp2(exponent)[..., None]).reshape(rows, cols)
                          .to(torch.bfloat16))
        codes = (index | (negative.long() << 3)).to(torch.uint8)
        all_blocks.append(codes[..., 0::2] | (codes[..., 1::2] << 4))
        all_scales.append((exponent + 127).to(torch.uint8))
    return torch.stack(all_blocks).contiguous(), torch.stack(all_scales).contiguous()


def check_against_transformers_mxfp4(attribute, parameter, blocks, scales):
    """The release's format as transformers reads it: its own dequantizer
    (`convert_moe_packed_tensors`, which gpt-oss's quantized checkpoints load through) must
    give back exactly the values written into the block, so that the layout this script
    writes (and moeforge reads) is the published one, not one this project made up twice.
    Where this transformers has no such function, the check is skipped, saying so."""
    import torch

    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as error:
        print(f"(info) MXFP4 layout not checked against transformers: {error}")
        return
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    if tuple(theirs.shape) != tuple(parameter.shape) or not torch.equal(theirs.to(parameter.device), parameter):
        raise RuntimeError(f"transformers' convert_moe_packed_tensors reads this script's MXFP4 {attribute} "
                           "as other values than it wrote: the script's layout is not the release's")


def quantize(family, block, experts, shared):
    """For a family whose checkpoint is quantized: quantizes its expert matrices in place
    (the Experts are views of the block's parameters, so the block, the Experts and the
    f32 formula all see the dequantized values) and returns the checkpoint's tensors that
    replace the bf16 ones (None: a bf16 tensor the quantized checkpoint does not hold)."""
    import torch

    replaced = {}
    with torch.no_grad():
        if family.quantization == "fp8":
            named = [(name, tensor) for e, expert in enumerate(experts)
                     for name, tensor in zip(family.expert_names(e), (expert.gate, expert.up, expert.down))]
            if shared is not None:
                named += list(zip(family.shared_names(), (shared.gate, shared.up, shared.down)))
            for name, tensor in named:
                replaced[name], replaced[f"{name}_scale_inv"] = fp8_round_trip(tensor)
        elif family.quantization == "mxfp4":
            # The release stores the [out, in] matrices: gate_up_proj [E, H, 2F] and
            # down_proj [E, F, H] transposed.
            names = family.fused_names()
            for attribute in ("gate_up_proj", "down_proj"):
                parameter = getattr(block.experts, attribute)
                blocks, scales = mxfp4_round_trip(parameter.transpose(1, 2))
                check_against_transformers_mxfp4(attribute, parameter, blocks, scales)
                replaced[names[attribute]] = None
                replaced[f"{names[attribute]}_blocks"] = blocks
                replaced[f"{names[attribute]}_scales"] = scales
        else:
            assert not family.quantization, family.quantization
    return {k: (None if v is None else v.cpu()) for k, v in replaced.items()}


def reference_routing(family, sizes, gate_output):
    """(logits [T, E] f32, ids [T, K] int64, weights [T, K] f32) of the block's router:
    its own outputs (transformers 5 routers return all three), or computed from its logits
    by `route` as transformers 4's Mixtral and Qwen3-MoE blocks do."""
    if isinstance(gate_output, tuple):
        # Told apart by dtype and shape rather than by position.
        def one(what, keep):
            found = [t for t in gate_output if keep(t)]
            if len(found) != 1:
                shapes = [(tuple(t.shape), str(t.dtype)) for t in gate_output]
                raise RuntimeError(
                    f"the router returned {shapes}: cannot tell its {what} (this transformers "
                    "version's router differs from the one the script was written for)"
                )
            return found[0]

        ids = one("chosen experts", lambda t: not t.is_floating_point())
        logits = one("logits [T, E]", lambda t: t.is_floating_point() and t.shape[-1] == sizes.experts)
        weights = one("weights [T, K]", lambda t: t.is_floating_point() and t.shape[-1] == sizes.top_k)
        expect_shape("the router's chosen experts", ids, (ids.shape[0], sizes.top_k))
        return logits.float(), ids.long(), weights.float()
    if family.scoring != "softmax":
        raise RuntimeError(
            f"{family.name}'s router returned one tensor: the script reads transformers 5's "
            "routers, which return logits, weights and choices"
        )
    logits = gate_output
    ids, weights = route(family, sizes, logits.float(), None)
    return logits.float(), ids, weights.to(logits.dtype).float()


def route(family, sizes, logits, correction):
    """The family's rule, in f32 on `logits` [T, E] (with GPT-OSS's router bias already in
    them; `correction` [E] is DeepSeek-V3's e_score_correction_bias): (ids, weights) [T, K]."""
    import torch

    k = sizes.top_k
    logits = logits.float()
    if family.scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if family.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif family.scoring == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif family.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = selection_values(family, logits, correction)
        if sizes.groups:
            tokens = logits.shape[0]
            grouped = choice.view(tokens, sizes.groups, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            kept = best.topk(sizes.groups_kept, dim=-1).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, k, dim=-1).indices
        weights = scores.gather(1, ids)
        if family.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORMALIZE_EPSILON)
    else:
        raise AssertionError(family.scoring)
    return ids, weights * family.scale


def selection_values(family, logits, correction):
    """What the rule's top-k ranks: the logits (softmax keeps their order; GPT-OSS's include
    its router bias), or DeepSeek-V3's sigmoid(logits) + correction."""
    if family.scoring == "sigmoid":
        return logits.float().sigmoid() + correction.float()
    return logits.float()


def near(a, b):
    return abs(a - b) <= TIE_RTOL * max(abs(a), abs(b)) + TIE_ATOL


def group_choice_allowed(values, chosen, sizes):
    """Whether `chosen` (K distinct experts) is the top-K of `values` (one token's selection
    values, a list) within the experts of some kept-group set, up to the tie tolerance:
    every group scored beyond the tolerance above the kept-th best group score is kept,
    no group beyond it below is, and no expert of the kept groups left out is beyond the
    tolerance above the lowest chosen one."""
    size = len(values) // sizes.groups
    members = [values[g * size:(g + 1) * size] for g in range(sizes.groups)]
    scores = [sum(sorted(m, reverse=True)[:2]) for m in members]
    boundary = sorted(scores, reverse=True)[sizes.groups_kept - 1]
    must = {g for g, s in enumerate(scores) if s > boundary and not near(s, boundary)}
    allowed = {g for g, s in enumerate(scores) if s >= boundary or near(s, boundary)}
    used = {e // size for e in chosen}
    if not used <= allowed:
        return False
    kept = must | used
    if len(kept) > sizes.groups_kept:
        return False
    # Fill up with the allowed groups whose best expert is lowest: the most lenient choice.
    rest = sorted(allowed - kept, key=lambda g: max(members[g]))
    kept |= set(rest[: sizes.groups_kept - len(kept)])
    low = min(values[e] for e in chosen)
    return all(
        values[e] <= low or near(values[e], low)
        for g in kept
        for e in range(g * size, (g + 1) * size)
        if e not in chosen
    )


def compare_choices(sizes, values, ours, theirs):
    """Per token, whether `ours` [T, K] chose `theirs`' experts (as sets), and else whether
    the difference is a near-tie of `values` [T, E] (the reference's selection values):
    (agreeing bool [T] tensor, tie-flip count, tokens beyond the tolerance)."""
    import torch

    tokens, k = theirs.shape
    kth = values.sort(dim=-1, descending=True).values[:, k - 1].tolist()
    agreeing = torch.zeros(tokens, dtype=torch.bool)
    ours_list, theirs_list = ours.tolist(), theirs.tolist()
    flips, beyond = 0, []
    for t in range(tokens):
        mine, reference = set(ours_list[t]), set(theirs_list[t])
        if mine == reference and len(mine) == k:
            agreeing[t] = True
            continue
        row = values[t].tolist()
        if len(mine) != k or not all(0 <= e < sizes.experts for e in mine):
            ok = False
        elif sizes.groups:
            ok = group_choice_allowed(row, mine, sizes)
        else:
            ok = all(near(row[e], kth[t]) for e in mine ^ reference)
        if ok:
            flips += 1
        else:
            beyond.append(t)
    return agreeing.to(ours.device), flips, beyond


def describe_token(t, values, ours, theirs):
    return (
        f"token {t}: moeforge {ours[t].tolist()}, reference {theirs[t].tolist()}, reference "
        f"selection values {[round(v, 4) for v in values[t].tolist()]}"
    )


def f32_layer(family, x, experts, ids, weights, shared):
    """The layer's formula in f32 from the bf16 weights:
    sum_k w_k (W2 act(G x + b_g, U x + b_u) + b_2) (+ the shared MLP, weight 1, or
    sigmoid(x w_g^T) where gated), act SwiGLU silu(g) * u or GPT-OSS's clamped SwiGLU.
    Also (pre-activations that reached the clamp, pre-activations) of the gates and of the
    ups, for GPT-OSS."""
    import torch

    def expert_output(h, expert, clamps):
        g, u = h @ expert.gate.float().T, h @ expert.up.float().T
        if expert.b_gate is not None:
            g, u = g + expert.b_gate.float(), u + expert.b_up.float()
        if family.gpt_oss:
            clamps[0] += int((g > SWIGLU_LIMIT).sum().item())
            clamps[1] += int((u.abs() > SWIGLU_LIMIT).sum().item())
            clamps[2] += g.numel()
            g = g.clamp(max=SWIGLU_LIMIT)
            u = u.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
            a = g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)
        else:
            a = torch.nn.functional.silu(g) * u
        out = a @ expert.down.float().T
        if expert.b_down is not None:
            out = out + expert.b_down.float()
        return out

    xf = x.float()
    y = torch.zeros_like(xf)
    clamps = [0, 0, 0]
    for e, expert in enumerate(experts):
        rows, slots = torch.where(ids == e)
        if rows.numel() == 0:
            continue
        out = expert_output(xf[rows], expert, clamps)
        y.index_add_(0, rows, out * weights[rows, slots, None].float())
    if shared is not None:
        out = expert_output(xf, shared, [0, 0, 0])
        if shared.output_gate is not None:
            out = out * torch.sigmoid(xf @ shared.output_gate.float().T)
        y += out
    return y, clamps


def bound_ratio(got, want, rtol, atol_per_rms):
    """(max |got - want|, the largest error as a fraction of its bound, elements over)."""
    got, want = got.float(), want.float()
    atol = atol_per_rms * want.pow(2).mean().sqrt()
    error = (got - want).abs()
    bound = atol + rtol * want.abs()
    ratio = error / bound
    return error.max().item(), ratio.max().item(), int((ratio > 1).sum().item())


def run_moeforge(moeforge, spec, checkpoint, family, seed, row, runs, at_once):
    """Runs `moeforge run SPEC --inputs IN --outputs OUT --check` for each (what, IN, OUT) of
    `runs`; True when every run passed, else notes each failure. With `at_once` the runs
    go side by side (each process's start, CUDA set-up and checkpoint load take seconds,
    and a small case's calls are short); a real size's layer is run one process at a time,
    as it is held in host and GPU memory by each."""
    done = []

    def finish(what, command, process):
        stdout, stderr = process.communicate()
        done.append((what, command, process.returncode, stdout, stderr))

    started = []
    for what, inputs, outputs in runs:
        command = [
            moeforge, "run", spec, "--weights", checkpoint, "--layer-prefix", PREFIX,
            "--family", family.moeforge_family, "--inputs", inputs, "--outputs", outputs,
            "--check", "--seed", str(seed),
        ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if at_once:
            started.append((what, command, process))
        else:
            finish(what, command, process)
    for what, command, process in started:
        finish(what, command, process)
    ok = True
    for what, command, returncode, stdout, stderr in done:
        if returncode != 0 or "PASS" not in stdout:
            row.notes.append(f"{what}: `{' '.join(command)}` exited {returncode}:\n{stdout}{stderr}")
            ok = False
    return ok


def self_checks(family, sizes, x, router, logits, ids, weights, correction, shared, row):
    """The script against the reference before moeforge runs (see the docstring); False
    with a note when one fails."""
    import torch

    # The router's returned logits must be x W^T (+ bias): else the tuple was misread.
    expected = x.float() @ router.weight.float().T
    if family.gpt_oss:
        expected = expected + router.bias.float()
    worst = (logits - expected).abs().max().item()
    if worst > 2.0**-6 * expected.abs().max().item() + TIE_ATOL:
        row.notes.append(
            f"the router's returned [T, E] tensor is not its logits x W^T{' + b' if family.gpt_oss else ''} "
            f"(off by up to {worst:.3g}): the script misreads this transformers version's router"
        )
        return False

    values = selection_values(family, logits, correction)
    mine, mine_weights = route(family, sizes, logits, correction)
    agreeing, _, beyond = compare_choices(sizes, values, mine, ids)
    if beyond:
        row.notes.append(
            f"the script's statement of the rule (`route`) chose other experts than the "
            f"reference on {len(beyond)} tokens beyond the tie tolerance; "
            + describe_token(beyond[0], values, mine, ids)
        )
        return False
    rows = agreeing.nonzero().flatten()
    if rows.numel():
        w_mine = mine_weights[rows].gather(1, mine[rows].argsort(dim=-1))
        w_ref = weights[rows].gather(1, ids[rows].argsort(dim=-1))
        over = int(((w_mine - w_ref).abs() > WEIGHT_RTOL * w_ref + WEIGHT_ATOL).sum().item())
        if over:
            row.notes.append(
                f"the script's statement of the rule (`route`) gives {over} weights beyond "
                f"the weight bound from the reference's (max error "
                f"{(w_mine - w_ref).abs().max().item():.3g})"
            )
            return False

    # The terms that set the family apart must have acted on this input.
    def changed(other_ids):
        a = other_ids.sort(dim=-1).values
        b = ids.sort(dim=-1).values
        return int((a != b).any(dim=-1).sum().item())

    checks = []
    if family.deepseek:
        checks.append(("e_score_correction_bias", route(family, sizes, logits, torch.zeros_like(correction))[0]))
        ungrouped = dataclasses.replace(sizes, groups=0, groups_kept=0)
        checks.append(("the group limit", route(family, ungrouped, logits, correction)[0]))
    if family.gpt_oss:
        checks.append(("the router bias", route(family, sizes, expected - router.bias.float(), None)[0]))
    for what, other in checks:
        count = changed(other)
        row.info.append(f"{what} changes the choice of {count} of {ids.shape[0]} tokens")
        if count == 0:
            row.notes.append(
                f"{what} changed no token's choice: the check could not tell it from its absence"
            )
            return False
    if family.shared_gated:
        gate = torch.sigmoid(x.float() @ shared.output_gate.float().T)
        low, high = gate.min().item(), gate.max().item()
        row.info.append(f"the shared expert gate weighs the shared MLP by {low:.2f} to {high:.2f}")
        if high - low < SHARED_GATE_SPREAD:
            row.notes.append(
                f"the shared expert gate spans less than {SHARED_GATE_SPREAD} over the tokens: "
                "the check could not tell it from a constant weight (1: its absence)"
            )
            return False
    return True


def check_case(family, sizes, label, args, workdir):
    try:
        return run_case(family, sizes, label, args, workdir)
    finally:
        import torch

        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def run_case(family, sizes, label, args, workdir):
    from safetensors.torch import save_file

    device = args.device
    row = Row(case=f"{family.name} ({label})", tokens=args.tokens)
    folder = os.path.join(workdir, f"{family.name}_{label}")
    os.makedirs(folder, exist_ok=True)
    block = family.build(sizes, device)
    initialise(family, block, sizes, args.seed)
    experts = expert_tensors(family, block, sizes)
    shared = shared_tensors(family, block, sizes)
    router = family.router_module(block)
    correction = router.e_score_correction_bias.detach() if family.deepseek else None

    quantized = quantize(family, block, experts, shared)
    tensors = checkpoint_tensors(family, block, sizes, experts, shared)
    for name, tensor in quantized.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    checkpoint = os.path.join(folder, "model.safetensors")
    save_file(tensors, checkpoint)
    try:
        return compare(family, sizes, args, folder, block, experts, shared, router, correction,
                       checkpoint, row, label)
    finally:
        if not args.workdir:  # the real sizes' checkpoints are large: one at a time on disk
            os.remove(checkpoint)


def compare(family, sizes, args, folder, block, experts, shared, router, correction, checkpoint,
            row, label):
    import torch
    from safetensors.torch import load_file, save_file

    device = args.device
    spec = os.path.join(folder, f"{family.name}.moe")
    with open(spec, "w") as file:
        file.write(family.spec(f"{family.name}_{label}", sizes, max(args.tokens, 1)))

    torch.manual_seed(args.seed + 1)
    x = (torch.rand(args.tokens, sizes.hidden, device=device) * 2 - 1).to(torch.bfloat16)
    captured = []
    hook = router.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        out = block(x.view(1, args.tokens, sizes.hidden))
    hook.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the router ran {len(captured)} times in one forward; expected once")
    y_ref = (out[0] if isinstance(out, tuple) else out).reshape(args.tokens, sizes.hidden)
    logits, ids, weights = reference_routing(family, sizes, captured[0])
    expect_shape("the reference's logits", logits, (args.tokens, sizes.experts))
    expect_shape("the reference's chosen experts", ids, (args.tokens, sizes.top_k))
    expect_shape("the reference's weights", weights, (args.tokens, sizes.top_k))

    with torch.no_grad():
        if not self_checks(family, sizes, x, router, logits, ids, weights, correction, shared, row):
            return row
        # The saved tensors must reproduce the block, or the comparison below means nothing.
        y_f32, clamps = f32_layer(family, x, experts, ids, weights, shared)
    if family.gpt_oss:
        gates, ups, total = clamps
        row.info.append(
            f"the clamp at {SWIGLU_LIMIT} cut {gates} of {total} gates ({100 * gates / total:.1f}%) "
            f"and {ups} ups ({100 * ups / total:.1f}%)"
        )
        if gates == 0 or ups == 0:
            row.notes.append("the clamp of the gates or the ups was never reached: it went unchecked")
            return row
    _, ratio, over = bound_ratio(y_ref, y_f32, GIVEN_RTOL, GIVEN_ATOL_PER_RMS)
    row.reference_itself = f"{ratio:.2f}"
    if over:
        row.notes.append(
            f"the reference is {over} elements beyond the bound from the f32 formula of the "
            "saved weights: the script read the block's weights wrongly, or the bound is "
            "tighter than the reference's own rounding"
        )
        return row

    routed_in = os.path.join(folder, "inputs_routed.safetensors")
    given_in = os.path.join(folder, "inputs_given.safetensors")
    save_file({"x": x.cpu()}, routed_in)
    save_file(
        {
            "x": x.cpu(),
            "topk_ids": ids.to(torch.int32).cpu().contiguous(),
            "topk_weights": weights.float().cpu().contiguous(),
        },
        given_in,
    )
    save_file({"y": y_ref.contiguous().cpu(), "router_logits": logits.cpu().contiguous()},
              os.path.join(folder, "reference.safetensors"))
    routed_out = os.path.join(folder, "outputs_routed.safetensors")
    given_out = os.path.join(folder, "outputs_given.safetensors")
    runs = [("routing itself", routed_in, routed_out),
            ("given the reference's routing", given_in, given_out)]
    if not run_moeforge(args.moeforge, spec, checkpoint, family, args.seed, row, runs,
                        at_once=label == "small"):
        return row

    routed = load_file(routed_out, device=device)
    given = load_file(given_out, device=device)
    for what, outputs in (("routing itself", routed), ("given the reference's routing", given)):
        for name, shape in (("y", (args.tokens, sizes.hidden)),
                            ("topk_ids", (args.tokens, sizes.top_k)),
                            ("topk_weights", (args.tokens, sizes.top_k))):
            if name not in outputs:
                raise RuntimeError(f"moeforge's outputs ({what}) lack {name}: it wrote {sorted(outputs)}")
            expect_shape(f"moeforge's {name} ({what})", outputs[name], shape)
    passed = True

    # Chosen experts, as sets per token; a difference only at a near-tie is a tie flip.
    values = selection_values(family, logits, correction)
    ours = routed["topk_ids"].long()
    agreeing, row.tie_flips, beyond = compare_choices(sizes, values, ours, ids)
    row.agree = f"{int(agreeing.sum().item())}/{args.tokens}"
    if beyond:
        passed = False
        row.notes.append(
            f"{len(beyond)} tokens chose other experts beyond the tie tolerance; "
            + describe_token(beyond[0], values, ours, ids)
        )

    # Weights of the agreeing tokens, matched by expert.
    rows = agreeing.nonzero().flatten()
    if rows.numel():
        order_ours = ours[rows].argsort(dim=-1)
        order_ref = ids[rows].argsort(dim=-1)
        w_ours = routed["topk_weights"][rows].gather(1, order_ours)
        w_ref = weights[rows].gather(1, order_ref)
        error = (w_ours - w_ref).abs()
        row.weight_error = error.max().item()
        over = int((error > WEIGHT_RTOL * w_ref + WEIGHT_ATOL).sum().item())
        if over:
            passed = False
            row.notes.append(f"{over} routing weights out of bound")

        _, ratio, over = bound_ratio(routed["y"][rows], y_ref[rows], ROUTED_RTOL, ROUTED_ATOL_PER_RMS)
        row.routed = f"{ratio:.2f}"
        if over:
            passed = False
            row.notes.append(f"routing itself: {over} output elements out of bound")
    else:
        passed = False
        row.notes.append("no token chose the reference's experts: the routed output went unchecked")

    # moeforge was given the reference's routing: it must have used it.
    if not torch.equal(given["topk_ids"].long(), ids) or not torch.equal(given["topk_weights"].float(), weights.float()):
        passed = False
        row.notes.append("given the reference's routing, moeforge's outputs report another routing")

    # moeforge and the reference each round bf16 their own way, so each is held to the
    # bound against the f32 formula, and the two to twice the bound against each other.
    _, ratio, over = bound_ratio(given["y"], y_f32, GIVEN_RTOL, GIVEN_ATOL_PER_RMS)
    row.given = f"{ratio:.2f}"
    if over:
        passed = False
        row.notes.append(
            f"given the reference's routing: {over} output elements beyond the bound from the f32 formula"
        )
    _, ratio, over = bound_ratio(given["y"], y_ref, 2 * GIVEN_RTOL, 2 * GIVEN_ATOL_PER_RMS)
    row.given_vs_reference = f"{ratio:.2f}"
    if over:
        passed = False
        row.notes.append(
            f"given the reference's routing: {over} output elements beyond twice the bound from the reference"
        )
    row.verdict = "PASS" if passed else "FAIL"
    return row


def print_table(rows):
    header = ("case", "tokens", "experts agree", "tie flips", "max weight err",
              "routed err/bound", "given vs f32", "given vs ref (2x)", "ref vs f32", "verdict")
    cells = [header] + [
        (r.case, str(r.tokens), r.agree, str(r.tie_flips), f"{r.weight_error:.2e}",
         r.routed, r.given, r.given_vs_reference, r.reference_itself, r.verdict)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for line in cells:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    for r in rows:
        for line in r.info:
            print(f"{r.case}: (info) {line}")
        for note in r.notes:
            print(f"{r.case}: {note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moeforge", default=os.environ.get("MOEFORGE_BIN", "target/release/moeforge"),
                        help="the moeforge binary (default: $MOEFORGE_BIN, else target/release/moeforge)")
    parser.add_argument("--families", default=",".join(f.name for f in FAMILIES),
                        help="comma-separated families to check (default: all)")
    parser.add_argument("--real-sizes", action="store_true",
                        help="also check each family at the sizes of a real model's layer")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per case (default 512)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", help="keep the checkpoints, specs and tensors here (default: a temp folder)")
    parser.add_argument("--device", default="cuda",
                        help="torch device of the reference side (default cuda; cpu for a dry run of the script)")
    args = parser.parse_args()

    known = {f.name: f for f in FAMILIES}
    wanted = [name for name in args.families.split(",") if name]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(known)}")
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    why_not = import_prerequisites(args.device)
    if why_not:
        print(f"SKIPPED: {why_not}")
        return SKIP_EXIT
    if not os.access(args.moeforge, os.X_OK):
        print(f"error: {args.moeforge} is not an executable moeforge binary (build it, or pass --moeforge)")
        return 2

    import torch
    import transformers

    # The f32 formula and DeepSeek-V3's f32 router must be f32, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{where}, seed {args.seed}")
    with tempfile.TemporaryDirectory(prefix="moeforge-hf-") as scratch:
        workdir = args.workdir or scratch
        rows, skipped = [], []
        for family in (known[name] for name in wanted):
            if family.skip_reason:
                skipped.append(f"SKIPPED {family.name}: {family.skip_reason}")
                continue
            cases = [("small", family.small)]
            if args.real_sizes:
                cases.append((re.sub(r"\W+", "_", family.real_model), family.real))
            for label, sizes in cases:
                try:
                    rows.append(check_case(family, sizes, label, args, workdir))
                except Exception as error:  # one case's failure must not hide the others
                    row = Row(case=f"{family.name} ({label})", tokens=args.tokens)
                    row.notes.append(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
                    rows.append(row)
        print_table(rows)
        for line in skipped:
            print(line)
    failed = [r.case for r in rows if r.verdict != "PASS"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print(f"all {len(rows)} cases agree with transformers" + (f"; {len(skipped)} families skipped" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
