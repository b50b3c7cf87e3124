//! `--weights PATH [--layer-prefix PREFIX] [--family FAMILY]`: a layer's routed experts
//! from a safetensors checkpoint instead of random ones. Opens and loads on the host (so
//! every name, shape and dtype is checked before any GPU work, and on machines without
//! one), reports what was picked, and turns each loader error into a message, a hint that
//! names the flag to change, and an exit status.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use moeforge::compiler::ir::Router;
use moeforge::compiler::plan::LayerShape;
use moeforge::runtime::checkpoint::{
    CheckpointError, CheckpointLayer, ExpertSet, ExpertStorage, Family, HostGate, HostWeights,
    INDEX_FILE, ReadableDtypes,
};
use moeforge::runtime::gpu::CudaContext;
use moeforge::runtime::layer::ExpertWeights;
use moeforge::runtime::weights::upload_parts;

use super::{invalid_input, usage_error};

/// Where the experts' weights come from.
#[derive(clap::Args)]
pub struct WeightsArgs {
    /// Run on the routed experts of a safetensors checkpoint: a `.safetensors` file, or a
    /// folder of shards (with `model.safetensors.index.json` when it has one). Random
    /// weights without it.
    #[arg(long, value_name = "PATH")]
    weights: Option<PathBuf>,
    /// The layer of the checkpoint, by the prefix of its tensor names (`model.layers.3.`);
    /// needed when the checkpoint holds the experts of several layers.
    #[arg(long, value_name = "PREFIX", requires = "weights")]
    layer_prefix: Option<String>,
    /// The tensor naming of the checkpoint; read off the tensor names when omitted.
    #[arg(long, value_enum, requires = "weights")]
    family: Option<FamilyArg>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum FamilyArg {
    /// `block_sparse_moe.experts.N.w1/w3/w2.weight`.
    Mixtral,
    /// `mlp.experts.N.gate_proj/up_proj/down_proj.weight`, without shared experts.
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
    /// As Qwen3-MoE, with a gated shared expert: `mlp.shared_expert.*` and
    /// `mlp.shared_expert_gate.weight` (Qwen1.5-MoE, Qwen2-MoE).
    #[value(name = "qwen2-moe")]
    Qwen2Moe,
    /// As Qwen3-MoE, with shared experts `mlp.shared_experts.*` and
    /// `mlp.gate.e_score_correction_bias` (DeepSeek-V3; DeepSeek-V2 has no bias).
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// Fused `mlp.experts.gate_up_proj` and `down_proj`, with biases (or the MXFP4
    /// release's `_blocks` and `_scales`, dequantized on loading).
    #[value(name = "gpt-oss")]
    GptOss,
}

impl From<Family> for FamilyArg {
    fn from(family: Family) -> Self {
        match family {
            Family::Mixtral => FamilyArg::Mixtral,
            Family::Qwen3Moe => FamilyArg::Qwen3Moe,
            Family::Qwen2Moe => FamilyArg::Qwen2Moe,
            Family::DeepseekV3 => FamilyArg::DeepseekV3,
            Family::GptOss => FamilyArg::GptOss,
        }
    }
}

/// `family`'s value of `--family`.
fn family_flag(family: Family) -> String {
    use clap::ValueEnum as _;
    FamilyArg::from(family)
        .to_possible_value()
        .map_or_else(|| family.to_string(), |value| value.get_name().to_owned())
}

impl From<FamilyArg> for Family {
    fn from(arg: FamilyArg) -> Self {
        match arg {
            FamilyArg::Mixtral => Family::Mixtral,
            FamilyArg::Qwen3Moe => Family::Qwen3Moe,
            FamilyArg::Qwen2Moe => Family::Qwen2Moe,
            FamilyArg::DeepseekV3 => Family::DeepseekV3,
            FamilyArg::GptOss => Family::GptOss,
        }
    }
}

/// Expert weights (as the kernels' bf16) from which `run` says it is loading before it
/// starts: a real layer's experts take seconds to read, longer to dequantize.
const LOAD_NOTICE_BYTES: u64 = 1_000_000_000;

/// Bytes of a layer's expert matrices as bf16: W1 [w1_rows, H] and W2 [H, F] of every
/// routed expert and shared slice.
fn expert_bytes(shape: &LayerShape) -> u64 {
    let rows = u64::from(shape.w1_rows()) + u64::from(shape.ffn);
    u64::from(shape.gemm_experts()) * rows * u64::from(shape.hidden) * 2
}

/// A checkpoint's layer, opened, and every one of its experts read on the host.
pub struct Loaded {
    pub layer: CheckpointLayer,
    pub all: HostWeights,
}

impl WeightsArgs {
    /// Whether `--weights` was given.
    pub fn given(&self) -> bool {
        self.weights.is_some()
    }

    /// `None` without `--weights`; else the checkpoint's layer and all its experts for a
    /// layer of `shape` whose router (if any) follows `router`, said on stderr with a
    /// warning for each tensor of the layer the spec leaves unread, or the exit status
    /// after reporting why not.
    pub fn load(
        &self,
        shape: &LayerShape,
        router: Option<&Router>,
    ) -> Result<Option<Loaded>, ExitCode> {
        let Some(path) = &self.weights else {
            return Ok(None);
        };
        let started = Instant::now();
        let layer = CheckpointLayer::open(
            path,
            self.layer_prefix.as_deref(),
            self.family.map(Family::from),
        )
        .map_err(|error| report(&error))?;
        let bf16_bytes = expert_bytes(shape);
        if bf16_bytes >= LOAD_NOTICE_BYTES {
            eprintln!(
                "loading {:.1} GB of expert weights (as bf16) from {layer}...",
                bf16_bytes as f64 / 1e9
            );
        }
        let all = layer
            .load(shape, ExpertSet::All)
            .map_err(|error| report(&error))?;
        let shared = match shape.shared_slices {
            0 => String::new(),
            slices => format!(
                " and its shared experts ({slices} slices of FFN {})",
                shape.ffn
            ),
        };
        let stored = match layer.storage() {
            ExpertStorage::Plain => String::new(),
            quantized => format!(" ({quantized})"),
        };
        eprintln!(
            "loaded the {} routed experts{shared} of {layer} in {:.2} s{stored}",
            shape.experts,
            started.elapsed().as_secs_f64()
        );
        for note in layer.unused_tensors(shape, router.map(|rule| rule.bias)) {
            eprintln!("warning: {note}");
        }
        Ok(Some(Loaded { layer, all }))
    }
}

impl Loaded {
    /// The router's gate of the layer, for a spec whose router follows `rule` (with the
    /// bias the rule adds), said on stderr, or the exit status after reporting why not.
    pub fn gate(&self, shape: &LayerShape, rule: &Router) -> Result<HostGate, ExitCode> {
        let gate = self
            .layer
            .load_gate(shape, rule.bias)
            .map_err(|error| report(&error))?;
        eprintln!(
            "loaded the router's gate{} of {}",
            if gate.bias.is_some() {
                " and its bias"
            } else {
                ""
            },
            self.layer
        );
        Ok(gate)
    }

    /// Rank `r`'s experts (its routed share, then the shared slices every rank runs), read
    /// from the checkpoint for that rank alone and uploaded to `contexts[r]`.
    pub fn rank_weights(
        &self,
        shape: &LayerShape,
        contexts: &[Arc<CudaContext>],
    ) -> Result<Vec<ExpertWeights>, ExitCode> {
        let ranks = contexts.len() as u32;
        (0..ranks)
            .zip(contexts)
            .map(|(rank, ctx)| {
                let parts = ExpertSet::held_by_rank(rank, ranks)
                    .into_iter()
                    .map(|which| self.layer.load(shape, which))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| report(&error))?;
                upload_parts(&ctx.default_stream(), &parts).map_err(|error| {
                    eprintln!("error: {error}");
                    invalid_input()
                })
            })
            .collect()
    }
}

/// Prints `error` and its hint; returns the exit status: 2 when a flag is wrong or the
/// path cannot be read, 1 when the checkpoint does not hold the layer the spec describes.
fn report(error: &CheckpointError) -> ExitCode {
    eprintln!("error: {error}");
    if let Some(hint) = hint(error) {
        eprintln!("hint: {hint}");
    }
    match error {
        CheckpointError::Io { .. }
        | CheckpointError::JsonFile { .. }
        | CheckpointError::NoShards { .. }
        | CheckpointError::NoExpertsUnderPrefix { .. }
        | CheckpointError::SeveralLayers { .. }
        | CheckpointError::SeveralFamilies { .. }
        | CheckpointError::GivenFamilyMismatch { .. }
        | CheckpointError::Rank { .. } => usage_error(),
        _ => invalid_input(),
    }
}

/// The values of `--family`, for hints.
const FAMILIES: &str = "mixtral, qwen3-moe, qwen2-moe, deepseek-v3, gpt-oss";

fn hint(error: &CheckpointError) -> Option<String> {
    Some(match error {
        CheckpointError::JsonFile { path } => format!(
            "pass the folder: --weights {}",
            path.parent()
                .filter(|folder| !folder.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
                .display()
        ),
        CheckpointError::Truncated { .. } => {
            "the download may be incomplete: fetch the file again (its size should match the one the model's page lists)"
                .to_owned()
        }
        CheckpointError::Format { .. } => {
            "--weights reads safetensors files (`*.safetensors`); is the file as it was published (neither cut \
             short nor with bytes after its data), and not a PyTorch `.bin` or `.pt` checkpoint (which must be \
             converted)?"
                .to_owned()
        }
        CheckpointError::MissingShard { shard, .. } => format!(
            "the download may be incomplete: fetch {} (the layers whose shards are all there load without it)",
            shard.file_name().map_or_else(|| shard.display().to_string(), |name| name.to_string_lossy().into_owned())
        ),
        CheckpointError::Io { .. } | CheckpointError::NoShards { .. } => format!(
            "--weights takes a .safetensors file, or a folder of `*.safetensors` shards (with {INDEX_FILE} when sharded)"
        ),
        CheckpointError::NoExpertLayers { .. } => {
            format!(
                "is it the checkpoint of an MoE model of one of the families moeforge reads ({FAMILIES})? \
                 Their experts are stored one tensor per expert and projection (`experts.N.w1.weight`, \
                 `experts.N.gate_proj.weight`), or fused per layer as GPT-OSS does \
                 (`mlp.experts.gate_up_proj`, plain or MXFP4 `_blocks` and `_scales`)"
            )
        }
        CheckpointError::NoExpertsUnderPrefix { layers, .. } if layers.is_empty() => {
            format!("is it the checkpoint of an MoE model of one of the families moeforge reads ({FAMILIES})?")
        }
        CheckpointError::NoExpertsUnderPrefix { layers, .. } if layers.len() == 1 => format!(
            "pass --layer-prefix {}, or leave --layer-prefix out: it is the only layer",
            layers[0]
        ),
        CheckpointError::NoExpertsUnderPrefix { .. } | CheckpointError::SeveralLayers { .. } => {
            "pass one of those layers' prefixes with --layer-prefix".to_owned()
        }
        CheckpointError::SeveralFamilies { .. } => {
            format!("say which with --family ({FAMILIES})")
        }
        CheckpointError::GivenFamilyMismatch { named_as, .. } => {
            let flags: Vec<String> = named_as
                .iter()
                .map(|family| format!("`--family {}`", family_flag(*family)))
                .collect();
            match flags.as_slice() {
                [one] => format!("pass {one}, or leave --family out: it is read off the tensor names"),
                several => format!("pass {}", several.join(" or ")),
            }
        }
        CheckpointError::MissingTensor { tensor, .. } if !tensor.contains(".experts.") => {
            "check --layer-prefix, --family and the spec's `router { bias = ... }`: the router's gate is \
             `block_sparse_moe.gate.weight` (Mixtral), `mlp.gate.weight` (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3; \
             `bias = score_correction` reads `mlp.gate.e_score_correction_bias`), `mlp.router.weight` \
             (GPT-OSS; `bias = logits` reads `mlp.router.bias`)"
                .to_owned()
        }
        CheckpointError::MissingTensor { .. } => {
            "check --layer-prefix and --family: Mixtral names experts `block_sparse_moe.experts.N.w1/w3/w2.weight`, \
             Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 `mlp.experts.N.gate_proj/up_proj/down_proj.weight`, GPT-OSS \
             `mlp.experts.gate_up_proj` and `down_proj` (all experts in one tensor each)"
                .to_owned()
        }
        CheckpointError::ExpertCount {
            highest,
            missing: None,
            ..
        } => format!(
            "set `experts = {}` in the spec, as the model's config.json does (num_local_experts, num_experts \
             or n_routed_experts)",
            u64::from(*highest) + 1
        ),
        CheckpointError::ExpertCount { named, .. } => format!(
            "is a shard of the checkpoint missing (an incomplete download)? If the model has {named} routed \
             experts, set `experts = {named}` in the spec"
        ),
        CheckpointError::Shape {
            expected, found, ..
        } if expected.iter().rev().eq(found.iter()) => {
            "the tensor is stored transposed: the loader reads the checkpoints' own [out, in] matrices \
             (gate and up [ffn, hidden], down [hidden, ffn]) as Hugging Face saves them"
                .to_owned()
        }
        CheckpointError::Shape { tensor, .. } if tensor.contains(".shared_expert") => {
            "the shared experts are one MLP of FFN `count · ffn` (the spec's `shared_experts { }`): make that the \
             model's shared intermediate size, as its config.json gives it (DeepSeek: n_shared_experts · \
             moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size)"
                .to_owned()
        }
        CheckpointError::Shape { .. } => {
            "the checkpoint's layer has other sizes than the spec: set `hidden`, `ffn` and `experts` as the model's \
             config.json does (hidden_size, the experts' intermediate size, the number of routed experts)"
                .to_owned()
        }
        CheckpointError::Dtype { readable, .. } => match readable {
            ReadableDtypes::Matrix => {
                "convert the tensor to bf16; quantized releases are read as published (FP8 E4M3 with \
                 `_scale_inv` block scales, GPT-OSS's MXFP4 `_blocks` with `_scales`)"
            }
            ReadableDtypes::FusedMatrix => {
                "convert the tensor to bf16, or use GPT-OSS's published MXFP4 release (`gate_up_proj_blocks` \
                 and `_scales`, `down_proj_blocks` and `_scales`), which is dequantized on loading"
            }
            ReadableDtypes::Values => "convert the tensor to f32 (or bf16), as the model's release stores it",
            ReadableDtypes::Mxfp4 => {
                "GPT-OSS's MXFP4 release stores its blocks and scales as U8; convert the experts to bf16 \
                 (`gate_up_proj`, `down_proj`) if this file quantizes them otherwise"
            }
        }
        .to_owned(),
        CheckpointError::MissingScales { .. } => {
            "the loader reads FP8 matrices with block scales beside them (`<name>_scale_inv`, as DeepSeek-V3's \
             and Qwen3's FP8 releases keep them), not per-tensor scales (`weight_scale`); or is a shard missing?"
                .to_owned()
        }
        CheckpointError::Config { .. } | CheckpointError::BlockSize { .. } => {
            "the loader reads `quantization_config.weight_block_size` there (FP8 checkpoints); fix or remove the file"
                .to_owned()
        }
        CheckpointError::Activation { family, .. } => format!(
            "set `activation = {}` in the spec, as the model computes",
            family.activation().name()
        ),
        CheckpointError::ExpertBias { family, .. } => format!(
            "set `expert_bias = {}` in the spec, as the model computes",
            family.expert_bias()
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use moeforge::compiler::ir::Activation;

    use super::*;

    #[test]
    fn the_hints_name_every_family() {
        use clap::ValueEnum as _;
        let names: Vec<String> = FamilyArg::value_variants()
            .iter()
            .filter_map(|family| family.to_possible_value())
            .map(|value| value.get_name().to_string())
            .collect();
        assert_eq!(FAMILIES, names.join(", "));
    }

    #[test]
    fn expert_bytes_count_both_matrices_of_every_routed_expert_and_shared_slice() {
        // DeepSeek-V3: 256 routed experts and one shared slice of 3 x 7168 x 2048 bf16 each.
        let shape = LayerShape {
            hidden: 7168,
            ffn: 2048,
            experts: 256,
            top_k: 8,
            activation: Activation::Swiglu,
            expert_bias: false,
            max_tokens: 1,
            shared_slices: 1,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
        };
        assert_eq!(expert_bytes(&shape), 257 * 3 * 7168 * 2048 * 2);
        let ungated = LayerShape {
            activation: Activation::Gelu,
            ..shape
        };
        assert_eq!(expert_bytes(&ungated), 257 * 2 * 7168 * 2048 * 2);
    }
}
