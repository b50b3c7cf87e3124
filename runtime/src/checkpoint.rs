//! Routed-expert weights of one MoE layer, read from a model's safetensors checkpoint.
//!
//! [`Checkpoint::open`] memory-maps one `.safetensors` file, or a folder of shards (with
//! `model.safetensors.index.json` when there is one), and reads every header. Then
//! [`Checkpoint::load_experts`] finds one layer's expert tensors by the names a model
//! [`Family`] uses in its published Hugging Face checkpoints (under a layer prefix such
//! as `model.layers.3.`), checks each tensor's shape and dtype, and copies them once into
//! the layout the kernels read ([`HostWeights`], uploaded as
//! [`crate::layer::ExpertWeights`], and [`crate::reference::HostExpert`] per expert): `w1`
//! [E, 2F, H], expert-major, each expert's F gate rows then its F up rows; `w2` [E, H, F].
//! Those are the per-expert checkpoints' own `[out, in]` matrices, so their copy
//! concatenates and never transposes (GPT-OSS's fused tensors are transposed: below). Values become
//! bf16 bits (`u16`); f16 and f32 tensors are rounded to bf16 on the way.
//!
//! Quantized releases are dequantized once, on the host, to the same bf16 layout (the
//! kernels multiply bf16): an FP8 E4M3 matrix (DeepSeek-V3's release; Qwen3's `-FP8`
//! ones) times its block scales `<name>_scale_inv` (f32, one per block of 128 x 128, or
//! of `quantization_config.weight_block_size` in the `config.json` beside the weights),
//! and GPT-OSS's MXFP4 experts (`gate_up_proj_blocks` and `_scales`, `down_proj_blocks`
//! and `_scales`: FP4 E2M1 codes, 32 to an E8M0 scale). Each element is its code's value
//! times its scale in f32, rounded to bf16, as the model's reference dequantizes it.
//!
//! [`CheckpointLayer::open`] picks the layer and the naming for the caller: a given layer
//! prefix (with or without its final dot) and family, or, when either is left out, the
//! only ones the checkpoint's tensor names show ([`Checkpoint::expert_layers`],
//! [`Checkpoint::detect`]); several candidates, or none, are typed errors that list what
//! the checkpoint holds. [`write_experts`] writes host weights back under a family's
//! names, for tests, examples and tools that make small checkpoints.
//!
//! [`Checkpoint::load_gate`] reads the router's gate of the layer ([`HostGate`]: the
//! weight [E, H] as bf16 bits and, when the spec's rule has one, the bias `[E]` as f32), by
//! the family's names: `block_sparse_moe.gate.weight` (Mixtral), `mlp.gate.weight`
//! (Qwen3-MoE, DeepSeek-V3, with `mlp.gate.e_score_correction_bias`), `mlp.router.weight`
//! and `mlp.router.bias` (GPT-OSS). A `bias = logits` rule reads `<gate>.bias`, a
//! `bias = score_correction` rule `<gate>.e_score_correction_bias`, whatever the family.
//!
//! GPT-OSS stores its experts fused, one tensor per projection for all experts, with
//! biases: `mlp.experts.gate_up_proj` [E, H, 2F] (gate and up columns interleaved),
//! `down_proj` [E, F, H], `gate_up_proj_bias` and `down_proj_bias`; they are
//! de-interleaved and transposed into the same W1 and W2 and the biases into
//! [`HostBiases`], from its dequantized (bf16) checkpoints, or from the MXFP4 release's
//! blocks of the transposed matrices (below).
//!
//! A layer with shared experts (DeepSeek-V3: `mlp.shared_experts.gate_proj`, `up_proj`,
//! `down_proj`, one MLP of FFN `n_shared_experts · moe_intermediate_size`) gets them as
//! the experts after the routed ones, cut into slices of the routed FFN (the always-hit
//! experts the kernels run, [`LayerShape::shared_slices`]); families without shared
//! experts refuse a spec that has them.
//!
//! It is not an uploader: the buffers stay on the host.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::Mmap;
use moeforge_compiler::ir::{Activation, RouterBias};
use moeforge_compiler::plan::LayerShape;
use safetensors::tensor::{Dtype, Metadata, SafeTensorError, SafeTensors, TensorView};
use serde::Deserialize;
use thiserror::Error;

use crate::bf16;
use crate::reference::{HostExpert, HostExpertBias};

/// The name of the shard index a sharded Hugging Face checkpoint carries.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The model's configuration beside its weights, which says how FP8 weights are blocked.
pub const CONFIG_FILE: &str = "config.json";
/// FP8 weights' scale blocks (rows, columns) where no `config.json` says: DeepSeek-V3's.
pub const DEFAULT_FP8_BLOCK: [usize; 2] = [128, 128];

/// Quantized weights of at least this many elements (an FP8 matrix, or a layer's MXFP4
/// experts) are dequantized by as many threads as there are cores (fewer cost less than
/// starting them).
const PARALLEL_DEQUANTIZE_ELEMENTS: usize = 1 << 20;

/// The threads to dequantize `elements` codes with: every core for a large tensor, else one.
fn dequantize_threads(elements: usize) -> usize {
    if elements < PARALLEL_DEQUANTIZE_ELEMENTS {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The part of a model's `config.json` the loader reads.
#[derive(Deserialize)]
struct ModelConfig {
    quantization_config: Option<QuantizationConfig>,
}

#[derive(Deserialize)]
struct QuantizationConfig {
    weight_block_size: Option<[usize; 2]>,
}

/// The model family whose tensor names to read; the caller says which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `{prefix}block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down).
    Mixtral,
    /// `{prefix}mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, and no shared experts.
    Qwen3Moe,
    /// The same expert names as Qwen3-MoE, and a gated shared expert:
    /// `mlp.shared_expert.gate_proj/up_proj/down_proj.weight` and
    /// `mlp.shared_expert_gate.weight` [1, H] (Qwen1.5-MoE, Qwen2-MoE).
    Qwen2Moe,
    /// The same expert names as Qwen3-MoE, with shared experts
    /// `mlp.shared_experts.gate_proj/up_proj/down_proj.weight` (one ungated MLP) and a router
    /// that adds `mlp.gate.e_score_correction_bias` (DeepSeek-V3; DeepSeek-V2 has the shared
    /// experts only, and is read by the same names).
    DeepseekV3,
    /// Fused `{prefix}mlp.experts.gate_up_proj` [E, H, 2F] and `down_proj`, with biases.
    GptOss,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Mixtral,
        Family::Qwen3Moe,
        Family::Qwen2Moe,
        Family::DeepseekV3,
        Family::GptOss,
    ];

    /// The expert activation the family's reference code computes.
    pub fn activation(self) -> Activation {
        match self {
            Family::GptOss => Activation::ClampedSwiglu,
            Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::DeepseekV3 => {
                Activation::Swiglu
            }
        }
    }

    /// Whether the family's experts add a bias to both projections.
    pub fn expert_bias(self) -> bool {
        self == Family::GptOss
    }

    /// The module whose `experts.{e}.` hold each expert's tensors under `prefix`
    /// (`model.layers.3.mlp.experts.`), or `None` for a family that stores all experts
    /// fused in one tensor per projection (GPT-OSS: see [`FusedNames`]).
    fn experts_module(self, prefix: &str) -> Option<String> {
        let base = match self {
            Family::Mixtral => "block_sparse_moe",
            Family::Qwen3Moe | Family::Qwen2Moe | Family::DeepseekV3 => "mlp",
            Family::GptOss => return None,
        };
        Some(format!("{prefix}{base}.experts."))
    }

    /// Expert `e`'s (gate, up, down) tensor names, or `None` for a family that stores all
    /// experts fused in one tensor per projection (GPT-OSS: see [`FusedNames`]).
    fn expert_names(self, prefix: &str, e: u32) -> Option<[String; 3]> {
        let module = self.experts_module(prefix)?;
        let projections = match self {
            Family::Mixtral => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        Some(projections.map(|p| format!("{module}{e}.{p}.weight")))
    }

    /// The (gate, up, down) tensors of the shared experts under `prefix`, one MLP of FFN
    /// `count · ffn` ([S·F, H], [S·F, H], [H, S·F]), or `None` for a family without them.
    fn shared_names(self, prefix: &str) -> Option<[String; 3]> {
        match self {
            Family::DeepseekV3 => Some(
                ["gate_proj", "up_proj", "down_proj"]
                    .map(|p| format!("{prefix}mlp.shared_experts.{p}.weight")),
            ),
            Family::Qwen2Moe => Some(
                ["gate_proj", "up_proj", "down_proj"]
                    .map(|p| format!("{prefix}mlp.shared_expert.{p}.weight")),
            ),
            Family::Mixtral | Family::Qwen3Moe | Family::GptOss => None,
        }
    }

    /// The shared expert gate's tensor under `prefix` ([1, H]), for a family whose shared
    /// expert is gated.
    fn shared_gate_name(self, prefix: &str) -> Option<String> {
        (self == Family::Qwen2Moe).then(|| format!("{prefix}mlp.shared_expert_gate.weight"))
    }

    /// Refuses a layer of `shape` whose expert math is not the family's.
    fn check_layer(self, shape: &LayerShape) -> Result<(), CheckpointError> {
        if shape.activation != self.activation() {
            return Err(CheckpointError::Activation {
                family: self,
                activation: shape.activation,
            });
        }
        if shape.expert_bias != self.expert_bias() {
            return Err(CheckpointError::ExpertBias {
                family: self,
                spec: shape.expert_bias,
            });
        }
        if shape.shared_slices > 0 && self.shared_names("").is_none() {
            return Err(CheckpointError::NoSharedExperts { family: self });
        }
        let gated = self.shared_gate_name("").is_some();
        if shape.shared_slices > 0 && shape.shared_gated != gated {
            return Err(CheckpointError::SharedGate {
                family: self,
                gated,
            });
        }
        Ok(())
    }

    /// The module holding the router's gate under `prefix` (its tensors are
    /// `<module>.weight` and the biases).
    fn gate_module(self, prefix: &str) -> String {
        match self {
            Family::Mixtral => format!("{prefix}block_sparse_moe.gate"),
            Family::Qwen3Moe | Family::Qwen2Moe | Family::DeepseekV3 => {
                format!("{prefix}mlp.gate")
            }
            Family::GptOss => format!("{prefix}mlp.router"),
        }
    }

    /// The gate's bias tensor a rule with `bias` reads, if any.
    fn gate_bias_name(self, prefix: &str, bias: RouterBias) -> Option<String> {
        let module = self.gate_module(prefix);
        match bias {
            RouterBias::None => None,
            RouterBias::Logits => Some(format!("{module}.bias")),
            RouterBias::ScoreCorrection => Some(format!("{module}.e_score_correction_bias")),
        }
    }

    /// The tensors under `prefix` that show the family's naming ([`Marker`]).
    fn marker(self, prefix: &str) -> Marker {
        let bias = format!("{prefix}mlp.gate.e_score_correction_bias");
        let shared_experts = format!("{prefix}mlp.shared_experts.gate_proj.weight");
        let shared_gate = format!("{prefix}mlp.shared_expert_gate.weight");
        let expert_0 = vec![format!("{prefix}mlp.experts.0.gate_proj.weight")];
        let (experts, with_one_of, without) = match self {
            Family::Mixtral => (
                vec![format!("{prefix}block_sparse_moe.experts.0.w1.weight")],
                Vec::new(),
                Vec::new(),
            ),
            Family::Qwen3Moe => (
                expert_0,
                Vec::new(),
                vec![bias, shared_experts, shared_gate],
            ),
            Family::Qwen2Moe => (expert_0, vec![shared_gate], vec![bias]),
            // DeepSeek-V2 has the shared experts without the correction bias.
            Family::DeepseekV3 => (expert_0, vec![bias, shared_experts], Vec::new()),
            Family::GptOss => (
                vec![
                    format!("{prefix}mlp.experts.gate_up_proj"),
                    format!("{prefix}mlp.experts.gate_up_proj_blocks"),
                ],
                Vec::new(),
                Vec::new(),
            ),
        };
        Marker {
            experts,
            with_one_of,
            without,
        }
    }
}

/// How [`Checkpoint::detect`] tells a family's naming under a layer prefix: one of
/// `experts` (expert 0's gate projection, or GPT-OSS's fused tensor), which families with
/// the same expert names share, told apart by the layer's other tensors: at least one
/// of `with_one_of` (when not empty) and none of `without`.
struct Marker {
    experts: Vec<String>,
    with_one_of: Vec<String>,
    without: Vec<String>,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Mixtral => "Mixtral",
            Family::Qwen3Moe => "Qwen3-MoE",
            Family::Qwen2Moe => "Qwen2-MoE",
            Family::DeepseekV3 => "DeepSeek-V3",
            Family::GptOss => "GPT-OSS",
        })
    }
}

/// Which experts to load: all of them (the routed ones, then the shared slices, as the
/// single-GPU kernels number them), the routed experts of one expert-parallel rank
/// (expert `e` belongs to rank `e / (E / ranks)`, as the kernels place them), or the
/// shared slices alone (every rank runs them on its own tokens, after its routed experts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSet {
    All,
    Rank { rank: u32, ranks: u32 },
    SharedSlices,
}

impl ExpertSet {
    /// What expert-parallel rank `rank` of `ranks` holds, in the order its kernels number
    /// them: its routed experts, then the shared slices (empty without shared experts).
    pub fn held_by_rank(rank: u32, ranks: u32) -> [ExpertSet; 2] {
        [ExpertSet::Rank { rank, ranks }, ExpertSet::SharedSlices]
    }

    /// The expert ids of this set in a layer of `shape`; a rank that does not name an
    /// equal share is an error.
    pub fn range(self, shape: &LayerShape) -> Result<Range<u32>, CheckpointError> {
        let experts = shape.experts;
        match self {
            ExpertSet::All => Ok(0..shape.gemm_experts()),
            ExpertSet::SharedSlices => Ok(experts..shape.gemm_experts()),
            ExpertSet::Rank { rank, ranks } => {
                if ranks == 0 || !experts.is_multiple_of(ranks) || rank >= ranks {
                    return Err(CheckpointError::Rank {
                        rank,
                        ranks,
                        experts,
                    });
                }
                let local = experts / ranks;
                Ok(rank * local..(rank + 1) * local)
            }
        }
    }
}

/// One layer's routed-expert weights on the host, in the kernels' layout, bf16 bits.
#[derive(Clone, Debug, PartialEq)]
pub struct HostWeights {
    /// The experts held, in order; `w1` and `w2` start with `experts.start`.
    pub experts: Range<u32>,
    /// [experts, w1_rows, H]: each expert's gate rows, then its up rows.
    pub w1: Vec<u16>,
    /// [experts, H, F].
    pub w2: Vec<u16>,
    /// The experts' biases, exactly when the layer has them (`expert_bias = true`).
    pub biases: Option<HostBiases>,
    /// `[H]`: the shared expert gate's weights, exactly when these experts hold the shared
    /// slices of a layer whose shared expert is gated ([`HostWeights::holds_shared_gate`]).
    pub shared_gate: Option<Vec<u16>>,
}

/// The biases of some experts on the host, f32: `b1` [experts, w1_rows] (each expert's
/// gate columns, then its up columns, as W1's rows), `b2` [experts, H].
#[derive(Clone, Debug, PartialEq)]
pub struct HostBiases {
    pub b1: Vec<f32>,
    pub b2: Vec<f32>,
}

impl HostWeights {
    /// Whether experts `experts` of a layer of `shape` come with the shared expert gate's
    /// weights: they hold the shared slices (the first one) of a gated shared expert.
    pub fn holds_shared_gate(shape: &LayerShape, experts: &Range<u32>) -> bool {
        shape.shared_gated && experts.contains(&shape.experts)
    }

    /// Elements of one expert's W1 and W2 in a layer of `shape`.
    fn expert_lens(shape: &LayerShape) -> (usize, usize) {
        let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
        (shape.w1_rows() as usize * hidden, hidden * ffn)
    }

    /// Elements of one expert's b1 and b2 in a layer of `shape`.
    fn bias_lens(shape: &LayerShape) -> (usize, usize) {
        (shape.w1_rows() as usize, shape.hidden as usize)
    }

    /// The `local`-th expert held (expert `experts.start + local`), as the CPU reference
    /// reads it.
    ///
    /// # Panics
    ///
    /// Where `local` is not below the count of experts held, or the buffers are not of a
    /// layer of `shape` ([`HostWeights::check`] says which), as indexing past a slice does.
    pub fn expert(&self, shape: &LayerShape, local: usize) -> HostExpert<'_> {
        let (w1, w2) = Self::expert_lens(shape);
        let (b1, b2) = Self::bias_lens(shape);
        let shared_slice = self.experts.start as usize + local >= shape.experts as usize;
        HostExpert {
            w1: &self.w1[local * w1..(local + 1) * w1],
            w2: &self.w2[local * w2..(local + 1) * w2],
            biases: self.biases.as_ref().map(|b| HostExpertBias {
                b1: &b.b1[local * b1..(local + 1) * b1],
                b2: &b.b2[local * b2..(local + 1) * b2],
            }),
            shared_gate: self.shared_gate.as_deref().filter(|_| shared_slice),
        }
    }

    /// Checks that `w1` and `w2` (and the biases, exactly when the layer has them) hold
    /// `experts` experts of a layer of `shape`.
    pub fn check(&self, shape: &LayerShape) -> Result<(), CheckpointError> {
        let count = self.experts.len();
        let (w1, w2) = Self::expert_lens(shape);
        let (b1, b2) = Self::bias_lens(shape);
        let biases = match (&self.biases, shape.expert_bias) {
            (Some(biases), true) => vec![
                ("b1", biases.b1.len(), count * b1),
                ("b2", biases.b2.len(), count * b2),
            ],
            (None, false) => Vec::new(),
            (_, spec) => return Err(CheckpointError::HostBiases { spec }),
        };
        let shared_gate = match (
            &self.shared_gate,
            Self::holds_shared_gate(shape, &self.experts),
        ) {
            (Some(gate), true) => Some(("shared expert gate", gate.len(), shape.hidden as usize)),
            (None, false) => None,
            (_, needed) => return Err(CheckpointError::HostSharedGate { needed }),
        };
        for (what, got, expected) in [
            ("w1", self.w1.len(), count * w1),
            ("w2", self.w2.len(), count * w2),
        ]
        .into_iter()
        .chain(biases)
        .chain(shared_gate)
        {
            if got != expected {
                return Err(CheckpointError::HostSize {
                    what,
                    experts: count,
                    expected,
                    got,
                });
            }
        }
        Ok(())
    }

    /// A copy of the experts `which` of a layer of `shape` (all of them, or one rank's
    /// share), which these weights must hold.
    pub fn select(
        &self,
        shape: &LayerShape,
        which: ExpertSet,
    ) -> Result<HostWeights, CheckpointError> {
        self.check(shape)?;
        let wanted = which.range(shape)?;
        if wanted.start < self.experts.start || wanted.end > self.experts.end {
            return Err(CheckpointError::HostExperts {
                held: self.experts.clone(),
                wanted,
            });
        }
        let (w1, w2) = Self::expert_lens(shape);
        let (b1, b2) = Self::bias_lens(shape);
        let local = (wanted.start - self.experts.start) as usize
            ..(wanted.end - self.experts.start) as usize;
        Ok(HostWeights {
            w1: self.w1[local.start * w1..local.end * w1].to_vec(),
            w2: self.w2[local.start * w2..local.end * w2].to_vec(),
            biases: self.biases.as_ref().map(|b| HostBiases {
                b1: b.b1[local.start * b1..local.end * b1].to_vec(),
                b2: b.b2[local.start * b2..local.end * b2].to_vec(),
            }),
            shared_gate: self
                .shared_gate
                .clone()
                .filter(|_| Self::holds_shared_gate(shape, &wanted)),
            experts: wanted,
        })
    }
}

/// One layer's router gate on the host: `weight` [E, H] bf16 bits, and the bias `[E]` in
/// f32 when the spec's rule has one (whatever dtype the checkpoint stores it in).
#[derive(Clone, Debug, PartialEq)]
pub struct HostGate {
    pub weight: Vec<u16>,
    pub bias: Option<Vec<f32>>,
}

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is not a safetensors file: {source}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
    #[error("{} is not a safetensors shard index (expected {{\"weight_map\": {{tensor: file}}}}): {source}", path.display())]
    Index {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{} is a JSON file (a shard index or a model configuration), not weights; the checkpoint is the folder holding it and the shards",
        path.display()
    )]
    JsonFile { path: PathBuf },
    #[error(
        "{} is cut short: it holds {size} bytes, but its header places tensor data up to byte {needed}",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        size: u64,
        needed: u64,
    },
    #[error("{} holds no `*.safetensors` file", path.display())]
    NoShards { path: PathBuf },
    #[error(
        "{} names shard {} for tensor `{tensor}`, but {}",
        index.display(),
        shard.display(),
        if *folder { "that is a folder, not a file" } else { "that file is not there" }
    )]
    MissingShard {
        index: PathBuf,
        tensor: String,
        shard: PathBuf,
        /// Whether a folder stands where the shard should be.
        folder: bool,
    },
    #[error("{} names shard {} for tensor `{tensor}`, but that shard does not hold it", index.display(), shard.display())]
    IndexMismatch {
        index: PathBuf,
        tensor: String,
        shard: PathBuf,
    },
    #[error("tensor `{tensor}` is in both {} and {}", first.display(), second.display())]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("tensor `{tensor}` ({family} naming, shape {expected:?}) is not in the checkpoint; {}", match nearest {
        Some(name) => format!("the nearest name it holds is `{name}` (is the family or the layer prefix wrong?)"),
        None => "it holds no tensor".to_owned(),
    })]
    MissingTensor {
        tensor: String,
        family: Family,
        expected: Vec<usize>,
        nearest: Option<String>,
    },
    #[error("the checkpoint holds no routed-expert tensor named as a known family names them \
             (Mixtral: `<prefix>block_sparse_moe.experts.0.w1.weight`; Qwen3-MoE, Qwen2-MoE and DeepSeek-V3: \
             `<prefix>mlp.experts.0.gate_proj.weight`; GPT-OSS: `<prefix>mlp.experts.gate_up_proj`){}",
             match (count, example) {
                 (_, None) => String::new(),
                 (1, Some(name)) => format!("; it holds one tensor, `{name}`"),
                 (count, Some(name)) => format!("; it holds {count} tensors, the first `{name}`"),
             })]
    NoExpertLayers {
        count: usize,
        example: Option<String>,
    },
    #[error(
        "no layer's routed experts are named under the prefix `{prefix}`; {}",
        list_layers(layers)
    )]
    NoExpertsUnderPrefix { prefix: String, layers: Vec<String> },
    #[error("the checkpoint holds the routed experts of {} layers ({}); the layer prefix must say which", layers.len(), quoted(layers))]
    SeveralLayers { layers: Vec<String> },
    #[error("the tensors under `{prefix}` are named as {} name them; the family must say which", families.iter().map(ToString::to_string).collect::<Vec<_>>().join(" and "))]
    SeveralFamilies {
        prefix: String,
        families: Vec<Family>,
    },
    #[error(
        "the family given is {given}, whose experts under `{prefix}` would be named like `{expected}`, \
         but the checkpoint names them as {} does",
        named_as.iter().map(ToString::to_string).collect::<Vec<_>>().join(" or ")
    )]
    GivenFamilyMismatch {
        prefix: String,
        given: Family,
        /// The tensor that would show the given family's naming (expert 0's gate
        /// projection, or GPT-OSS's fused tensor).
        expected: String,
        /// The families [`Checkpoint::detect`] reports under the prefix.
        named_as: Vec<Family>,
    },
    #[error("{what} holds {got} elements; {experts} experts of the layer need {expected}")]
    HostSize {
        what: &'static str,
        experts: usize,
        expected: usize,
        got: usize,
    },
    #[error(
        "the layer's spec says `expert_bias = {spec}`, but the host weights {}",
        if *spec { "hold no biases: give `biases` (b1 and b2 of every expert)" } else { "hold biases: drop them, or set `expert_bias = true` in the spec" }
    )]
    HostBiases { spec: bool },
    #[error(
        "{}",
        if *needed { "the host weights hold the shared slices of a layer whose shared expert is gated (`gated = true`), but no shared expert gate: give `shared_gate` ([H] bf16), or drop `gated = true` from the spec" } else { "the host weights hold a shared expert gate, which only experts holding the shared slices of a gated shared expert take: drop it, or set `gated = true` in the spec's `shared_experts { }`" }
    )]
    HostSharedGate { needed: bool },
    #[error("the host weights hold experts {}..{}, not experts {}..{}", held.start, held.end, wanted.start, wanted.end)]
    HostExperts {
        held: Range<u32>,
        wanted: Range<u32>,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("tensor `{tensor}` has shape {found:?}; the layer needs {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{tensor}` is {found:?}; the loader reads it as {readable}")]
    Dtype {
        tensor: String,
        found: Dtype,
        /// What the tensor is, which says the dtypes it may have.
        readable: ReadableDtypes,
    },
    #[error(
        "tensor `{tensor}` is F8_E4M3, but its block scales `{scales}` (shape {expected:?}) are not in the checkpoint"
    )]
    MissingScales {
        tensor: String,
        scales: String,
        expected: Vec<usize>,
    },
    #[error("{} is not a model configuration (JSON): {source}", path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{} gives `quantization_config.weight_block_size` a zero", path.display())]
    BlockSize { path: PathBuf },
    #[error(
        "{family} experts {} biases, but the layer's spec says `expert_bias = {spec}`; set `expert_bias = {}`",
        if Family::expert_bias(*family) { "add" } else { "have no" },
        Family::expert_bias(*family)
    )]
    ExpertBias { family: Family, spec: bool },
    #[error("{family} experts compute {}, but the layer's activation is {}", Family::activation(*family).name(), activation.name())]
    Activation {
        family: Family,
        activation: Activation,
    },
    #[error(
        "{family} checkpoints hold no shared experts, but the layer's spec has a `shared_experts {{ }}` section; remove it, or name the family whose layer this is"
    )]
    NoSharedExperts { family: Family },
    #[error(
        "{family} checkpoints {}, but the layer's spec says {}; {}",
        if *gated { "gate their shared expert (`mlp.shared_expert_gate`)" } else { "have an ungated shared expert" },
        if *gated { "no `gated = true`" } else { "`gated = true`" },
        if *gated { "set `gated = true` in its `shared_experts { }`" } else { "drop `gated = true`, or name the family whose layer this is" }
    )]
    SharedGate { family: Family, gated: bool },
    #[error(
        "the checkpoint names {named} expert{} under `{module}` ({family} naming){}",
        if *named == 1 { "" } else { "s" },
        match missing {
            Some(e) => format!("; the spec's layer has `experts = {spec}`, and expert {e} is not there"),
            None => format!(", numbered up to {highest}; the spec's layer has `experts = {spec}`"),
        }
    )]
    ExpertCount {
        /// The module the experts are named under (`model.layers.3.mlp.experts.`).
        module: String,
        family: Family,
        /// How many distinct experts it names.
        named: usize,
        /// The highest expert number it names.
        highest: u32,
        /// The first expert asked for that it does not name, when it names no expert past
        /// the spec's count.
        missing: Option<u32>,
        spec: u32,
    },
    #[error("rank {rank} of {ranks} does not name an equal share of {experts} experts")]
    Rank { rank: u32, ranks: u32, experts: u32 },
}

/// The dtypes the loader reads a tensor in, by what the tensor is (a
/// [`CheckpointError::Dtype`] says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadableDtypes {
    /// An expert's, the shared experts' or the router's matrix: BF16, F16, F32, or F8_E4M3
    /// with its block scales.
    Matrix,
    /// GPT-OSS's fused expert matrices: BF16, F16 or F32 (its quantized release stores
    /// MXFP4 blocks and scales under other names).
    FusedMatrix,
    /// A bias or FP8 block scales, read as f32: F32, BF16 or F16.
    Values,
    /// GPT-OSS's MXFP4 blocks (two FP4 codes a byte) and E8M0 scales: U8.
    Mxfp4,
}

impl fmt::Display for ReadableDtypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReadableDtypes::Matrix => {
                "BF16, F16, F32, or F8_E4M3 with `<name>_scale_inv` block scales"
            }
            ReadableDtypes::FusedMatrix => {
                "BF16, F16 or F32 (the MXFP4 release is read from `_blocks` and `_scales` tensors in its place)"
            }
            ReadableDtypes::Values => "F32, BF16 or F16 values",
            ReadableDtypes::Mxfp4 => "U8 (MXFP4 codes, two a byte, or E8M0 scales)",
        })
    }
}

/// One memory-mapped `.safetensors` file and its parsed header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Self, CheckpointError> {
        let io_error = |source| CheckpointError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        // SAFETY: the map is only read. Like every reader of a memory-mapped checkpoint,
        // this assumes nobody truncates or rewrites the file while the checkpoint is open.
        let map = unsafe { Mmap::map(&file) }.map_err(io_error)?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|source| {
            match (&source, covered_len(&map)) {
                (SafeTensorError::MetadataIncompleteBuffer, Some(needed))
                    if needed > map.len() as u64 =>
                {
                    CheckpointError::Truncated {
                        path: path.to_owned(),
                        size: map.len() as u64,
                        needed,
                    }
                }
                _ => CheckpointError::Format {
                    path: path.to_owned(),
                    source,
                },
            }
        })?;
        Ok(Shard {
            path: path.to_owned(),
            map,
            header_len,
            metadata,
        })
    }

    fn names(&self) -> impl Iterator<Item = String> + '_ {
        self.metadata.tensors().into_keys()
    }
}

/// The bytes a safetensors file `bytes` must hold for its header to describe it: the
/// header and every tensor's data up to the last offset it names; `None` where the
/// header does not parse. Tells a file cut short from one with bytes left over, which
/// the safetensors crate reports alike.
fn covered_len(bytes: &[u8]) -> Option<u64> {
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let header = bytes.get(8..8usize.checked_add(usize::try_from(header_len).ok()?)?)?;
    let entries: HashMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let data_end = entries
        .values()
        .filter_map(|entry| entry.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    8u64.checked_add(header_len)?.checked_add(data_end)
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

/// A file an open checkpoint reads tensors from.
enum ShardFile {
    Mapped(Shard),
    /// A shard the index names that is not there: reading one of its tensors is
    /// [`CheckpointError::MissingShard`], so that the layers in the shards that are there
    /// load from a partial download.
    Absent {
        index: PathBuf,
        path: PathBuf,
        /// Whether a folder stands where the shard should be.
        folder: bool,
    },
}

/// The tensors of a checkpoint: one file, or a folder of shards.
pub struct Checkpoint {
    shards: Vec<ShardFile>,
    /// Every tensor name, and the shard in `shards` that holds it.
    names: BTreeMap<String, usize>,
    /// The folder whose `config.json` may say the FP8 weights' block size.
    folder: PathBuf,
    /// That block size, read at the first FP8 tensor.
    fp8_block: OnceLock<[usize; 2]>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file (a `.json` file is [`CheckpointError::JsonFile`]:
    /// the index or configuration of a folder), or a folder. In a folder with
    /// [`INDEX_FILE`], every shard the index names that is there must hold the tensors it
    /// names (one that is not is an error only when a tensor of it is read); without one,
    /// every `*.safetensors` file in it is a shard (folders so named are skipped) and no
    /// tensor may be in two of them. Maps the files and reads their headers, not their
    /// data.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let io_error = |source| CheckpointError::Io {
            path: path.to_owned(),
            source,
        };
        if !path.metadata().map_err(io_error)?.is_dir() {
            if path
                .extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("json"))
            {
                return Err(CheckpointError::JsonFile {
                    path: path.to_owned(),
                });
            }
            let shard = Shard::open(path)?;
            let names = shard.names().map(|n| (n, 0)).collect();
            let folder = path.parent().unwrap_or(Path::new("")).to_owned();
            return Ok(Checkpoint::new(
                vec![ShardFile::Mapped(shard)],
                names,
                folder,
            ));
        }
        let index = path.join(INDEX_FILE);
        if index.exists() {
            return Self::open_indexed(path, &index);
        }
        let mut files = Vec::new();
        for entry in std::fs::read_dir(path).map_err(io_error)? {
            let file = entry.map_err(io_error)?.path();
            if file.extension().is_some_and(|x| x == "safetensors") && file.is_file() {
                files.push(file);
            }
        }
        if files.is_empty() {
            return Err(CheckpointError::NoShards {
                path: path.to_owned(),
            });
        }
        files.sort();
        let mut shards = Vec::with_capacity(files.len());
        let mut names = BTreeMap::new();
        for file in files {
            let shard = Shard::open(&file)?;
            for name in shard.names() {
                if let Some(&first) = names.get(&name) {
                    let first: &Shard = &shards[first];
                    return Err(CheckpointError::DuplicateTensor {
                        tensor: name,
                        first: first.path.clone(),
                        second: file,
                    });
                }
                names.insert(name, shards.len());
            }
            shards.push(shard);
        }
        let shards = shards.into_iter().map(ShardFile::Mapped).collect();
        Ok(Checkpoint::new(shards, names, path.to_owned()))
    }

    fn new(shards: Vec<ShardFile>, names: BTreeMap<String, usize>, folder: PathBuf) -> Self {
        Checkpoint {
            shards,
            names,
            folder,
            fp8_block: OnceLock::new(),
        }
    }

    fn open_indexed(dir: &Path, index: &Path) -> Result<Self, CheckpointError> {
        let text = std::fs::read_to_string(index).map_err(|source| CheckpointError::Io {
            path: index.to_owned(),
            source,
        })?;
        let parsed: IndexFile =
            serde_json::from_str(&text).map_err(|source| CheckpointError::Index {
                path: index.to_owned(),
                source,
            })?;
        let mut shards: Vec<ShardFile> = Vec::new();
        let mut by_file: HashMap<String, usize> = HashMap::new();
        let mut names = BTreeMap::new();
        for (tensor, file) in parsed.weight_map {
            let at = match by_file.get(&file) {
                Some(&at) => at,
                None => {
                    let path = dir.join(&file);
                    shards.push(if path.is_file() {
                        ShardFile::Mapped(Shard::open(&path)?)
                    } else {
                        ShardFile::Absent {
                            index: index.to_owned(),
                            folder: path.is_dir(),
                            path,
                        }
                    });
                    by_file.insert(file, shards.len() - 1);
                    shards.len() - 1
                }
            };
            if let ShardFile::Mapped(shard) = &shards[at]
                && shard.metadata.info(&tensor).is_none()
            {
                return Err(CheckpointError::IndexMismatch {
                    index: index.to_owned(),
                    tensor,
                    shard: shard.path.clone(),
                });
            }
            names.insert(tensor, at);
        }
        Ok(Checkpoint::new(shards, names, dir.to_owned()))
    }

    /// Every tensor name the checkpoint holds, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// The families whose expert tensors are named under `prefix` (expert 0's gate
    /// projection, or GPT-OSS's fused tensor). Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 share
    /// expert names, told apart by the layer's other tensors: DeepSeek-V3 is reported
    /// when `{prefix}mlp.gate.e_score_correction_bias` or the shared experts
    /// `{prefix}mlp.shared_experts.gate_proj.weight` are there (DeepSeek-V2 has the
    /// latter only), Qwen2-MoE when `{prefix}mlp.shared_expert_gate.weight` is (and no
    /// correction bias), Qwen3-MoE when none of them is. A report, not a choice: loading
    /// still takes the family from the caller.
    pub fn detect(&self, prefix: &str) -> Vec<Family> {
        let held = |name: &String| self.names.contains_key(name);
        Family::ALL
            .into_iter()
            .filter(|family| {
                let marker = family.marker(prefix);
                marker.experts.iter().any(held)
                    && (marker.with_one_of.is_empty() || marker.with_one_of.iter().any(held))
                    && !marker.without.iter().any(held)
            })
            .collect()
    }

    /// The layer prefixes under which some family's routed experts are named (expert 0's
    /// gate projection, or GPT-OSS's fused tensor, as [`Checkpoint::detect`] looks for
    /// them), in natural order: `model.layers.2.` before `model.layers.10.`.
    pub fn expert_layers(&self) -> Vec<String> {
        let mut prefixes = BTreeSet::new();
        for family in Family::ALL {
            for marker in family.marker("").experts {
                prefixes.extend(
                    self.names
                        .keys()
                        .filter_map(|name| name.strip_suffix(marker.as_str()))
                        .map(str::to_owned),
                );
            }
        }
        let mut layers: Vec<String> = prefixes.into_iter().collect();
        layers.sort_by_cached_key(|prefix| natural_key(prefix));
        layers
    }

    /// Loads the experts `which` of the layer under `prefix` (e.g. `model.layers.3.`),
    /// named as `family` names them, sized by `shape` (H, F, E and the activation, which
    /// must be the family's), into the kernels' layout.
    pub fn load_experts(
        &self,
        family: Family,
        prefix: &str,
        shape: &LayerShape,
        which: ExpertSet,
    ) -> Result<HostWeights, CheckpointError> {
        family.check_layer(shape)?;
        let experts = which.range(shape)?;
        if family.expert_names(prefix, 0).is_none() {
            return self.load_fused_experts(family, prefix, shape, experts);
        }
        let routed = experts.start..experts.end.min(shape.experts);
        self.check_expert_count(family, prefix, shape, routed.clone())?;
        let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
        let matrix = hidden * ffn;
        let count = experts.len();
        let mut w1 = vec![0u16; count * 2 * matrix];
        let mut w2 = vec![0u16; count * matrix];
        for (local, e) in routed.clone().enumerate() {
            let Some([gate, up, down]) = family.expert_names(prefix, e) else {
                unreachable!("a family names every expert or none");
            };
            let w1_expert = &mut w1[local * 2 * matrix..(local + 1) * 2 * matrix];
            let (gate_rows, up_rows) = w1_expert.split_at_mut(matrix);
            self.read_bf16(family, prefix, &gate, &[ffn, hidden], gate_rows)?;
            self.read_bf16(family, prefix, &up, &[ffn, hidden], up_rows)?;
            let w2_expert = &mut w2[local * matrix..(local + 1) * matrix];
            self.read_bf16(family, prefix, &down, &[hidden, ffn], w2_expert)?;
        }
        if experts.end > shape.experts {
            let first = routed.len();
            self.load_shared_slices(
                family,
                prefix,
                shape,
                &mut w1[first * 2 * matrix..],
                &mut w2[first * matrix..],
            )?;
        }
        let shared_gate = match family.shared_gate_name(prefix) {
            Some(name) if HostWeights::holds_shared_gate(shape, &experts) => {
                let mut gate = vec![0u16; hidden];
                self.read_bf16(family, prefix, &name, &[1, hidden], &mut gate)?;
                Some(gate)
            }
            _ => None,
        };
        Ok(HostWeights {
            experts,
            w1,
            w2,
            biases: None,
            shared_gate,
        })
    }

    /// Refuses a layer whose checkpoint, under `family`'s per-expert names, names experts
    /// past the spec's count (the count is wrong: loading would drop the others unsaid) or
    /// lacks one of the routed experts `wanted` (a shard missing, or the count wrong); a
    /// file holding one rank's experts loads for that rank. A layer naming none is let
    /// through: the first tensor looked for then names the nearest name held (a wrong
    /// family or prefix). GPT-OSS's fused tensors carry the count in their shape.
    fn check_expert_count(
        &self,
        family: Family,
        prefix: &str,
        shape: &LayerShape,
        wanted: Range<u32>,
    ) -> Result<(), CheckpointError> {
        let Some(module) = family.experts_module(prefix) else {
            return Ok(());
        };
        let named: BTreeSet<u32> = self
            .names
            .range(module.clone()..)
            .map(|(name, _)| name)
            .take_while(|name| name.starts_with(&module))
            .filter_map(|name| name[module.len()..].split_once('.')?.0.parse().ok())
            .collect();
        let Some(&highest) = named.last() else {
            return Ok(());
        };
        let spec = shape.experts;
        if highest >= spec {
            return Err(CheckpointError::ExpertCount {
                module,
                family,
                named: named.len(),
                highest,
                missing: None,
                spec,
            });
        }
        let Some(missing) = wanted.clone().find(|e| !named.contains(e)) else {
            return Ok(());
        };
        Err(CheckpointError::ExpertCount {
            module,
            family,
            named: named.len(),
            highest,
            missing: Some(missing),
            spec,
        })
    }

    /// The shared experts of the layer under `prefix`, one MLP of FFN S·F, cut into the S
    /// slices of FFN F the kernels run as always-hit experts: slice s takes gate and up
    /// rows s·F.. and down columns s·F.. (an MLP is the sum of its slices' MLPs).
    fn load_shared_slices(
        &self,
        family: Family,
        prefix: &str,
        shape: &LayerShape,
        w1: &mut [u16],
        w2: &mut [u16],
    ) -> Result<(), CheckpointError> {
        let Some([gate, up, down]) = family.shared_names(prefix) else {
            return Err(CheckpointError::NoSharedExperts { family });
        };
        let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
        let (slices, matrix) = (shape.shared_slices as usize, hidden * ffn);
        let total = slices * ffn;
        let mut gate_rows = vec![0u16; total * hidden];
        let mut up_rows = vec![0u16; total * hidden];
        let mut down_rows = vec![0u16; hidden * total];
        self.read_bf16(family, prefix, &gate, &[total, hidden], &mut gate_rows)?;
        self.read_bf16(family, prefix, &up, &[total, hidden], &mut up_rows)?;
        self.read_bf16(family, prefix, &down, &[hidden, total], &mut down_rows)?;
        for s in 0..slices {
            let w1_slice = &mut w1[s * 2 * matrix..(s + 1) * 2 * matrix];
            w1_slice[..matrix].copy_from_slice(&gate_rows[s * matrix..(s + 1) * matrix]);
            w1_slice[matrix..].copy_from_slice(&up_rows[s * matrix..(s + 1) * matrix]);
            let w2_slice = &mut w2[s * matrix..(s + 1) * matrix];
            for (out, row) in w2_slice
                .chunks_exact_mut(ffn)
                .zip(down_rows.chunks_exact(total))
            {
                out.copy_from_slice(&row[s * ffn..(s + 1) * ffn]);
            }
        }
        Ok(())
    }

    /// GPT-OSS's fused experts (see [`FusedNames`]), re-laid-out once: `gate_up_proj`'s
    /// even columns become W1's gate rows and its odd columns the up rows (transposed:
    /// the checkpoint multiplies `x @ gate_up_proj`), `down_proj` [E, F, H] becomes W2
    /// [E, H, F], and the biases split the same way. Only the experts asked for are read.
    fn load_fused_experts(
        &self,
        family: Family,
        prefix: &str,
        shape: &LayerShape,
        experts: Range<u32>,
    ) -> Result<HostWeights, CheckpointError> {
        let names = FusedNames::new(prefix);
        let (e_all, hidden, ffn) = (
            shape.experts as usize,
            shape.hidden as usize,
            shape.ffn as usize,
        );
        self.check_fused_expert_count(family, prefix, &names, shape)?;
        let matrices = if self.holds_mxfp4(&names) {
            FusedMatrices::Mxfp4 {
                gate_up: self.mxfp4(
                    family,
                    prefix,
                    &names.gate_up_blocks,
                    &names.gate_up_scales,
                    [e_all, 2 * ffn, hidden],
                )?,
                down: self.mxfp4(
                    family,
                    prefix,
                    &names.down_blocks,
                    &names.down_scales,
                    [e_all, hidden, ffn],
                )?,
            }
        } else {
            FusedMatrices::Bf16 {
                gate_up: self.tensor(family, prefix, &names.gate_up, &[e_all, hidden, 2 * ffn])?,
                down: self.tensor(family, prefix, &names.down, &[e_all, ffn, hidden])?,
            }
        };
        let gate_up_bias = self.tensor(family, prefix, &names.gate_up_bias, &[e_all, 2 * ffn])?;
        let down_bias = self.tensor(family, prefix, &names.down_bias, &[e_all, hidden])?;
        let count = experts.len();
        let matrix = hidden * ffn;
        let mut w1 = vec![0u16; count * 2 * matrix];
        let mut w2 = vec![0u16; count * matrix];
        let mut b1 = vec![0f32; count * 2 * ffn];
        let mut b2 = vec![0f32; count * hidden];
        let mut fused = Vec::new();
        let mut fused_bias = vec![0f32; 2 * ffn];
        for (local, e) in experts.clone().enumerate() {
            let e = e as usize;
            if let FusedMatrices::Bf16 { gate_up, down } = &matrices {
                fused.resize(2 * matrix, 0);
                let w1_expert = &mut w1[local * 2 * matrix..(local + 1) * 2 * matrix];
                gate_up.expert_bf16(&names.gate_up, e, &mut fused)?;
                for (h, row) in fused.chunks_exact(2 * ffn).enumerate() {
                    for (f, pair) in row.chunks_exact(2).enumerate() {
                        w1_expert[f * hidden + h] = pair[0];
                        w1_expert[(ffn + f) * hidden + h] = pair[1];
                    }
                }
                let transposed = &mut fused[..matrix];
                down.expert_bf16(&names.down, e, transposed)?;
                let w2_expert = &mut w2[local * matrix..(local + 1) * matrix];
                for (f, row) in transposed.chunks_exact(hidden).enumerate() {
                    for (h, &v) in row.iter().enumerate() {
                        w2_expert[h * ffn + f] = v;
                    }
                }
            }
            gate_up_bias.expert_f32(&names.gate_up_bias, e, &mut fused_bias)?;
            let b1_expert = &mut b1[local * 2 * ffn..(local + 1) * 2 * ffn];
            for (f, pair) in fused_bias.chunks_exact(2).enumerate() {
                b1_expert[f] = pair[0];
                b1_expert[ffn + f] = pair[1];
            }
            down_bias.expert_f32(
                &names.down_bias,
                e,
                &mut b2[local * hidden..(local + 1) * hidden],
            )?;
        }
        // Last, once every tensor has been found readable: the long part.
        if let FusedMatrices::Mxfp4 { gate_up, down } = &matrices {
            dequantize_mxfp4_experts([gate_up, down], &experts, [hidden, ffn], &mut w1, &mut w2);
        }
        Ok(HostWeights {
            experts,
            w1,
            w2,
            biases: Some(HostBiases { b1, b2 }),
            shared_gate: None,
        })
    }

    /// Whether GPT-OSS's experts named `names` are its MXFP4 release's: blocks, and no bf16
    /// `gate_up_proj` beside them.
    /// Refuses fused experts (GPT-OSS) whose first dimension, the expert count, is not the
    /// spec's `experts`, as [`CheckpointError::ExpertCount`] (the shape check would name
    /// only the tensor's shape).
    fn check_fused_expert_count(
        &self,
        family: Family,
        prefix: &str,
        names: &FusedNames,
        shape: &LayerShape,
    ) -> Result<(), CheckpointError> {
        let first = if self.holds_mxfp4(names) {
            &names.gate_up_blocks
        } else {
            &names.gate_up
        };
        let held = self
            .names
            .get(first)
            .and_then(|&at| match &self.shards[at] {
                ShardFile::Mapped(shard) => shard.metadata.info(first)?.shape.first().copied(),
                ShardFile::Absent { .. } => None,
            });
        let Some(held) = held.and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0) else {
            return Ok(());
        };
        if held == shape.experts {
            return Ok(());
        }
        Err(CheckpointError::ExpertCount {
            module: format!("{prefix}mlp.experts."),
            family,
            named: held as usize,
            highest: held - 1,
            missing: (held < shape.experts).then_some(held),
            spec: shape.experts,
        })
    }

    fn holds_mxfp4(&self, names: &FusedNames) -> bool {
        !self.names.contains_key(&names.gate_up) && self.names.contains_key(&names.gate_up_blocks)
    }

    /// The MXFP4 tensor whose codes are `blocks` and scales `scales`, holding `experts`
    /// matrices [rows, cols] (see [`Mxfp4Tensor`]).
    fn mxfp4(
        &self,
        family: Family,
        prefix: &str,
        blocks: &str,
        scales: &str,
        [experts, rows, cols]: [usize; 3],
    ) -> Result<Mxfp4Tensor<'_>, CheckpointError> {
        let groups = cols.div_ceil(MXFP4_BLOCK);
        let bytes = |name: &str, shape: &[usize]| {
            let tensor = self.tensor(family, prefix, name, shape)?;
            match tensor.dtype {
                Dtype::U8 => Ok(tensor.bytes),
                found => Err(CheckpointError::Dtype {
                    tensor: name.to_owned(),
                    found,
                    readable: ReadableDtypes::Mxfp4,
                }),
            }
        };
        Ok(Mxfp4Tensor {
            blocks: bytes(blocks, &[experts, rows, groups, MXFP4_BLOCK / 2])?,
            scales: bytes(scales, &[experts, rows, groups])?,
            rows,
            cols,
        })
    }

    /// Loads the router's gate of the layer under `prefix`, named as `family` names it,
    /// sized by `shape` (W_gate [E, H]), with the bias a rule with `bias` adds (`[E]`, read
    /// as f32).
    pub fn load_gate(
        &self,
        family: Family,
        prefix: &str,
        shape: &LayerShape,
        bias: RouterBias,
    ) -> Result<HostGate, CheckpointError> {
        let (hidden, experts) = (shape.hidden as usize, shape.experts as usize);
        let mut weight = vec![0u16; experts * hidden];
        let name = format!("{}.weight", family.gate_module(prefix));
        self.read_bf16(family, prefix, &name, &[experts, hidden], &mut weight)?;
        let bias = match family.gate_bias_name(prefix, bias) {
            Some(name) => {
                let tensor = self.tensor(family, prefix, &name, &[experts])?;
                let mut values = vec![0f32; experts];
                to_f32(tensor.dtype, tensor.bytes, &mut values).map_err(|found| {
                    CheckpointError::Dtype {
                        tensor: name.clone(),
                        found,
                        readable: ReadableDtypes::Values,
                    }
                })?;
                Some(values)
            }
            None => None,
        };
        Ok(HostGate { weight, bias })
    }

    /// Reads tensor `name`, which must have shape `expected`, into `out` as bf16 bits; an
    /// FP8 matrix is dequantized with its block scales ([`Checkpoint::read_fp8`]).
    fn read_bf16(
        &self,
        family: Family,
        prefix: &str,
        name: &str,
        expected: &[usize],
        out: &mut [u16],
    ) -> Result<(), CheckpointError> {
        let tensor = self.tensor(family, prefix, name, expected)?;
        if tensor.dtype == Dtype::F8_E4M3 && expected.len() == 2 {
            return self.read_fp8(
                family,
                prefix,
                name,
                [expected[0], expected[1]],
                &tensor,
                out,
            );
        }
        to_bf16(tensor.dtype, tensor.bytes, out).map_err(|found| CheckpointError::Dtype {
            tensor: name.to_owned(),
            found,
            readable: ReadableDtypes::Matrix,
        })
    }

    /// Dequantizes `weight`, the F8_E4M3 matrix `name` [rows, cols], into `out` as bf16
    /// bits: element (r, c) is its FP8 value times `<name>_scale_inv`[r / B0, c / B1], in
    /// f32, rounded to nearest even, as DeepSeek-V3's and the `-FP8` Qwen3 releases
    /// define them (blocks B0 x B1 of [`Checkpoint::fp8_block`]; the scales cover a last,
    /// partial block of rows or columns as a whole one).
    fn read_fp8(
        &self,
        family: Family,
        prefix: &str,
        name: &str,
        [rows, cols]: [usize; 2],
        weight: &RawTensor<'_>,
        out: &mut [u16],
    ) -> Result<(), CheckpointError> {
        let [block_rows, block_cols] = self.fp8_block()?;
        let scales_name = format!("{name}_scale_inv");
        let scale_shape = [rows.div_ceil(block_rows), cols.div_ceil(block_cols)];
        if !self.names.contains_key(&scales_name) {
            return Err(CheckpointError::MissingScales {
                tensor: name.to_owned(),
                scales: scales_name,
                expected: scale_shape.to_vec(),
            });
        }
        let scales = self.tensor(family, prefix, &scales_name, &scale_shape)?;
        let mut scale = vec![0f32; scale_shape[0] * scale_shape[1]];
        to_f32(scales.dtype, scales.bytes, &mut scale).map_err(|found| CheckpointError::Dtype {
            tensor: scales_name.clone(),
            found,
            readable: ReadableDtypes::Values,
        })?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let values = fp8_e4m3_values();
        // Per row of blocks, each block's table of the 256 codes' bf16 values (code value
        // times the block's scale, rounded): each element is then one lookup. Blocks of
        // fewer elements than a table has entries convert each element instead.
        let tabled = block_rows * block_cols >= values.len();
        let dequantize = |first_row: usize, out: &mut [u16], codes: &[u8]| {
            let mut tables = vec![[0u16; 256]; if tabled { scale_shape[1] } else { 0 }];
            let mut tables_of = None;
            for (r, (row_out, row)) in out
                .chunks_exact_mut(cols)
                .zip(codes.chunks_exact(cols))
                .enumerate()
            {
                let block_row = (first_row + r) / block_rows;
                let row_scales = &scale[block_row * scale_shape[1]..][..scale_shape[1]];
                let blocks = row_out
                    .chunks_mut(block_cols)
                    .zip(row.chunks(block_cols))
                    .zip(row_scales);
                if !tabled {
                    for ((block_out, block_codes), &block_scale) in blocks {
                        for (o, &bits) in block_out.iter_mut().zip(block_codes) {
                            *o = bf16::from_f32(values[usize::from(bits)] * block_scale);
                        }
                    }
                    continue;
                }
                if tables_of != Some(block_row) {
                    for (table, &block_scale) in tables.iter_mut().zip(row_scales) {
                        for (entry, &value) in table.iter_mut().zip(values.iter()) {
                            *entry = bf16::from_f32(value * block_scale);
                        }
                    }
                    tables_of = Some(block_row);
                }
                for (((block_out, block_codes), _), table) in blocks.zip(&tables) {
                    for (o, &bits) in block_out.iter_mut().zip(block_codes) {
                        *o = table[usize::from(bits)];
                    }
                }
            }
        };
        // A layer of DeepSeek-V3 is 11 G codes: split large matrices by rows over the cores.
        let threads = dequantize_threads(rows * cols);
        if threads == 1 {
            dequantize(0, out, weight.bytes);
            return Ok(());
        }
        let rows_each = rows.div_ceil(threads);
        std::thread::scope(|scope| {
            for (part, (out, codes)) in out
                .chunks_mut(rows_each * cols)
                .zip(weight.bytes.chunks(rows_each * cols))
                .enumerate()
            {
                scope.spawn(move || dequantize(part * rows_each, out, codes));
            }
        });
        Ok(())
    }

    /// The block size of FP8 weights' scales: `quantization_config.weight_block_size` of
    /// the `config.json` beside the checkpoint, or 128 x 128 (DeepSeek-V3's) without one.
    fn fp8_block(&self) -> Result<[usize; 2], CheckpointError> {
        if let Some(&block) = self.fp8_block.get() {
            return Ok(block);
        }
        let path = self.folder.join(CONFIG_FILE);
        let block = match std::fs::read_to_string(&path) {
            Err(source) if source.kind() == io::ErrorKind::NotFound => DEFAULT_FP8_BLOCK,
            Err(source) => return Err(CheckpointError::Io { path, source }),
            Ok(text) => {
                let config: ModelConfig =
                    serde_json::from_str(&text).map_err(|source| CheckpointError::Config {
                        path: path.clone(),
                        source,
                    })?;
                match config.quantization_config.and_then(|q| q.weight_block_size) {
                    None => DEFAULT_FP8_BLOCK,
                    Some([0, _] | [_, 0]) => {
                        return Err(CheckpointError::BlockSize { path });
                    }
                    Some(block) => block,
                }
            }
        };
        Ok(*self.fp8_block.get_or_init(|| block))
    }

    /// Tensor `name`'s dtype and bytes, checked to have shape `expected`.
    fn tensor(
        &self,
        family: Family,
        prefix: &str,
        name: &str,
        expected: &[usize],
    ) -> Result<RawTensor<'_>, CheckpointError> {
        let Some(&at) = self.names.get(name) else {
            return Err(CheckpointError::MissingTensor {
                tensor: name.to_owned(),
                family,
                expected: expected.to_vec(),
                nearest: self.nearest(name, prefix),
            });
        };
        let shard = match &self.shards[at] {
            ShardFile::Mapped(shard) => shard,
            ShardFile::Absent {
                index,
                path,
                folder,
            } => {
                return Err(CheckpointError::MissingShard {
                    index: index.clone(),
                    tensor: name.to_owned(),
                    shard: path.clone(),
                    folder: *folder,
                });
            }
        };
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                tensor: name.to_owned(),
                family,
                expected: expected.to_vec(),
                nearest: None,
            })?;
        if info.shape != expected {
            return Err(CheckpointError::Shape {
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                found: info.shape.clone(),
            });
        }
        let (start, end) = info.data_offsets;
        // The header was validated: the offsets lie inside the file after the header.
        let base = 8 + shard.header_len;
        Ok(RawTensor {
            dtype: info.dtype,
            bytes: &shard.map[base + start..base + end],
        })
    }

    /// The held name that shares the longest start with `wanted`, preferring names
    /// under `prefix` (the first in order among equals).
    fn nearest(&self, wanted: &str, prefix: &str) -> Option<String> {
        let common = |name: &str| {
            wanted
                .bytes()
                .zip(name.bytes())
                .take_while(|(a, b)| a == b)
                .count()
        };
        self.names
            .keys()
            .max_by_key(|name| {
                (
                    name.starts_with(prefix),
                    common(name),
                    std::cmp::Reverse(*name),
                )
            })
            .cloned()
    }
}

/// A tensor's dtype and little-endian bytes, inside a memory-mapped shard.
struct RawTensor<'a> {
    dtype: Dtype,
    bytes: &'a [u8],
}

impl RawTensor<'_> {
    /// Expert `e`'s `out.len()` elements of a tensor whose first dimension is the expert,
    /// as bf16 bits.
    fn expert_bf16(&self, name: &str, e: usize, out: &mut [u16]) -> Result<(), CheckpointError> {
        to_bf16(self.dtype, self.expert_bytes(e, out.len()), out).map_err(|found| {
            CheckpointError::Dtype {
                tensor: name.to_owned(),
                found,
                readable: ReadableDtypes::FusedMatrix,
            }
        })
    }

    /// The same as f32.
    fn expert_f32(&self, name: &str, e: usize, out: &mut [f32]) -> Result<(), CheckpointError> {
        to_f32(self.dtype, self.expert_bytes(e, out.len()), out).map_err(|found| {
            CheckpointError::Dtype {
                tensor: name.to_owned(),
                found,
                readable: ReadableDtypes::Values,
            }
        })
    }

    /// The bytes of expert `e`'s `elems` elements. The shape was checked, so they lie
    /// inside the tensor.
    fn expert_bytes(&self, e: usize, elems: usize) -> &[u8] {
        let size = self.dtype.bitsize() / 8;
        &self.bytes[e * elems * size..(e + 1) * elems * size]
    }
}

/// GPT-OSS's fused expert matrices: bf16 (as transformers' `GptOssExperts` holds them), or
/// MXFP4 (the published release).
enum FusedMatrices<'a> {
    Bf16 {
        gate_up: RawTensor<'a>,
        down: RawTensor<'a>,
    },
    Mxfp4 {
        gate_up: Mxfp4Tensor<'a>,
        down: Mxfp4Tensor<'a>,
    },
}

/// Dequantizes `experts` of GPT-OSS's MXFP4 `[gate_up, down]` into W1 (each expert's gate
/// rows, then its up rows) and W2, the experts spread over the cores (gpt-oss-120b's layer
/// is 3.2 G codes). The quantized matrices are stored [out, in], the bf16 tensors'
/// transposes: gate_up's row r is the bf16 tensor's column r (even: gate, odd: up).
fn dequantize_mxfp4_experts(
    [gate_up, down]: [&Mxfp4Tensor<'_>; 2],
    experts: &Range<u32>,
    [hidden, ffn]: [usize; 2],
    w1: &mut [u16],
    w2: &mut [u16],
) {
    let matrix = hidden * ffn;
    if matrix == 0 {
        return;
    }
    let threads = dequantize_threads(experts.len() * 3 * matrix);
    let each = experts.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (part, (w1_part, w2_part)) in w1
            .chunks_mut(each * 2 * matrix)
            .zip(w2.chunks_mut(each * matrix))
            .enumerate()
        {
            scope.spawn(move || {
                let pairs = w1_part
                    .chunks_exact_mut(2 * matrix)
                    .zip(w2_part.chunks_exact_mut(matrix));
                for (i, (w1_expert, w2_expert)) in pairs.enumerate() {
                    let e = experts.start as usize + part * each + i;
                    // gate_up's rows alternate gate and up (its transpose's columns).
                    gate_up.dequantize(e, w1_expert, |r| (r % 2) * ffn + r / 2);
                    down.dequantize(e, w2_expert, |h| h);
                }
            });
        }
    });
}

/// Values an MXFP4 scale covers: one block of 32 FP4 codes, 16 bytes.
const MXFP4_BLOCK: usize = 32;

/// An MXFP4 tensor of GPT-OSS's release: per expert a matrix [rows, cols] stored as
/// `blocks` [E, rows, G, 16] (two FP4 E2M1 codes a byte, the low nibble first: columns
/// 32g + 2b and 32g + 2b + 1) and `scales` [E, rows, G] (E8M0), G = ceil(cols / 32).
/// Element (r, c) is its code's value times its block's scale, rounded to bf16 (exact
/// unless it leaves bf16's range), as transformers' `convert_moe_packed_tensors` computes
/// (but for a scale byte of 0xff, the OCP format's NaN, which gives NaN here where
/// transformers' `ldexp` gives an infinity: no release holds one).
struct Mxfp4Tensor<'a> {
    blocks: &'a [u8],
    scales: &'a [u8],
    rows: usize,
    cols: usize,
}

impl Mxfp4Tensor<'_> {
    /// Writes expert `e`'s matrix into `out` as bf16 bits, its row r as row `row_of(r)`
    /// of `out` ([_, cols]). Each element is a lookup in its block's scale's table
    /// ([`mxfp4_values`]), and each row is written in order.
    fn dequantize(&self, e: usize, out: &mut [u16], row_of: impl Fn(usize) -> usize) {
        let groups = self.cols.div_ceil(MXFP4_BLOCK);
        let per_expert = self.rows * groups;
        let scales = &self.scales[e * per_expert..(e + 1) * per_expert];
        let blocks =
            &self.blocks[e * per_expert * MXFP4_BLOCK / 2..(e + 1) * per_expert * MXFP4_BLOCK / 2];
        let tables = mxfp4_values();
        let row_bytes = groups * MXFP4_BLOCK / 2;
        for (r, (row_scales, row_blocks)) in scales
            .chunks_exact(groups)
            .zip(blocks.chunks_exact(row_bytes))
            .enumerate()
        {
            let dest = &mut out[row_of(r) * self.cols..][..self.cols];
            let row = dest
                .chunks_mut(MXFP4_BLOCK)
                .zip(row_scales)
                .zip(row_blocks.chunks_exact(MXFP4_BLOCK / 2));
            for ((values, &scale), block) in row {
                let table = &tables[usize::from(scale)];
                for (pair, &byte) in values.chunks_mut(2).zip(block) {
                    pair[0] = table[usize::from(byte & 0xf)];
                    if let Some(high) = pair.get_mut(1) {
                        *high = table[usize::from(byte >> 4)];
                    }
                }
            }
        }
    }
}

/// The names of GPT-OSS's fused expert tensors under a layer prefix, as the dequantized
/// (bf16) checkpoints and transformers' `GptOssExperts` name them.
struct FusedNames {
    /// [E, H, 2F]: `x @ gate_up_proj[e]` gives gate (even columns) and up (odd columns).
    gate_up: String,
    /// [E, 2F], interleaved as `gate_up`'s columns.
    gate_up_bias: String,
    /// [E, F, H]: `glu @ down_proj[e]`.
    down: String,
    /// [E, H].
    down_bias: String,
    /// What the quantized release stores instead of `gate_up` and `down`: MXFP4 blocks
    /// and scales of their transposes ([`Mxfp4Tensor`]).
    gate_up_blocks: String,
    gate_up_scales: String,
    down_blocks: String,
    down_scales: String,
}

impl FusedNames {
    fn new(prefix: &str) -> Self {
        let name = |suffix: &str| format!("{prefix}mlp.experts.{suffix}");
        FusedNames {
            gate_up: name("gate_up_proj"),
            gate_up_bias: name("gate_up_proj_bias"),
            down: name("down_proj"),
            down_bias: name("down_proj_bias"),
            gate_up_blocks: name("gate_up_proj_blocks"),
            gate_up_scales: name("gate_up_proj_scales"),
            down_blocks: name("down_proj_blocks"),
            down_scales: name("down_proj_scales"),
        }
    }
}

/// How a checkpoint stores a layer's expert matrices ([`CheckpointLayer::storage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertStorage {
    /// BF16, F16 or F32, read as bf16.
    Plain,
    /// FP8 E4M3 with block scales (of this size, where `config.json` could be read),
    /// dequantized on loading.
    Fp8 { block: Option<[usize; 2]> },
    /// GPT-OSS's MXFP4 blocks and scales, dequantized on loading.
    Mxfp4,
}

impl fmt::Display for ExpertStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpertStorage::Plain => f.write_str("bf16 (or f16, f32)"),
            ExpertStorage::Fp8 {
                block: Some([rows, cols]),
            } => {
                write!(
                    f,
                    "FP8 E4M3 with {rows} x {cols} block scales, dequantized to bf16"
                )
            }
            ExpertStorage::Fp8 { block: None } => {
                f.write_str("FP8 E4M3 with block scales, dequantized to bf16")
            }
            ExpertStorage::Mxfp4 => f.write_str("MXFP4, dequantized to bf16"),
        }
    }
}

/// One layer of an open checkpoint: the prefix its tensors are named under and the
/// family whose names they use, each given by the caller or read off the tensor names.
pub struct CheckpointLayer {
    checkpoint: Checkpoint,
    path: PathBuf,
    prefix: String,
    family: Family,
    prefix_detected: bool,
    family_detected: bool,
}

impl CheckpointLayer {
    /// Opens the checkpoint at `path` (see [`Checkpoint::open`]) and picks one layer of it.
    ///
    /// `prefix` names the layer (`model.layers.3.`; the final dot may be left out). Without
    /// it, the checkpoint must hold the routed experts of exactly one layer
    /// ([`Checkpoint::expert_layers`]), else [`CheckpointError::SeveralLayers`] or
    /// [`CheckpointError::NoExpertLayers`]. A prefix under which no tensor is named is
    /// [`CheckpointError::NoExpertsUnderPrefix`], listing the layers there are. `family`
    /// names the tensors; without it, the family [`Checkpoint::detect`] reports under the
    /// prefix (none: `NoExpertsUnderPrefix`; several: [`CheckpointError::SeveralFamilies`]).
    /// A given family whose expert names are not under the prefix while another family's
    /// are is [`CheckpointError::GivenFamilyMismatch`] (a wrong family, not a wrong spec:
    /// its activation would be checked first). Otherwise it is taken as given (families
    /// with the same expert names are not second-guessed), and a wrong one fails at
    /// loading, naming the tensor it looked for and the nearest name the checkpoint holds.
    pub fn open(
        path: &Path,
        prefix: Option<&str>,
        family: Option<Family>,
    ) -> Result<Self, CheckpointError> {
        let checkpoint = Checkpoint::open(path)?;
        let prefix_detected = prefix.is_none();
        let prefix = match prefix {
            Some(given) => {
                let prefix = if given.is_empty() || given.ends_with('.') {
                    given.to_owned()
                } else {
                    format!("{given}.")
                };
                if !checkpoint.names().any(|name| name.starts_with(&prefix)) {
                    return Err(CheckpointError::NoExpertsUnderPrefix {
                        prefix,
                        layers: checkpoint.expert_layers(),
                    });
                }
                prefix
            }
            None => {
                let mut layers = checkpoint.expert_layers();
                match layers.len() {
                    0 => {
                        return Err(CheckpointError::NoExpertLayers {
                            count: checkpoint.names.len(),
                            example: checkpoint.names().next().map(str::to_owned),
                        });
                    }
                    1 => layers.remove(0),
                    _ => return Err(CheckpointError::SeveralLayers { layers }),
                }
            }
        };
        let family_detected = family.is_none();
        let family = match family {
            Some(given) => {
                let expected = given.marker(&prefix).experts;
                let named = expected
                    .iter()
                    .any(|name| checkpoint.names.contains_key(name));
                let named_as = checkpoint.detect(&prefix);
                if !named && !named_as.is_empty() {
                    return Err(CheckpointError::GivenFamilyMismatch {
                        prefix,
                        given,
                        expected: expected.into_iter().next().unwrap_or_default(),
                        named_as,
                    });
                }
                given
            }
            None => match checkpoint.detect(&prefix).as_slice() {
                [family] => *family,
                [] => {
                    return Err(CheckpointError::NoExpertsUnderPrefix {
                        layers: checkpoint.expert_layers(),
                        prefix,
                    });
                }
                several => {
                    return Err(CheckpointError::SeveralFamilies {
                        families: several.to_vec(),
                        prefix,
                    });
                }
            },
        };
        Ok(CheckpointLayer {
            checkpoint,
            path: path.to_owned(),
            prefix,
            family,
            prefix_detected,
            family_detected,
        })
    }

    /// Loads the experts `which` of a layer of `shape` (see [`Checkpoint::load_experts`]).
    pub fn load(
        &self,
        shape: &LayerShape,
        which: ExpertSet,
    ) -> Result<HostWeights, CheckpointError> {
        self.checkpoint
            .load_experts(self.family, &self.prefix, shape, which)
    }

    /// Loads the router's gate of a layer of `shape` with the bias a rule with `bias`
    /// adds (see [`Checkpoint::load_gate`]).
    pub fn load_gate(
        &self,
        shape: &LayerShape,
        bias: RouterBias,
    ) -> Result<HostGate, CheckpointError> {
        self.checkpoint
            .load_gate(self.family, &self.prefix, shape, bias)
    }

    /// How the checkpoint stores the layer's expert matrices (read off expert 0's gate
    /// projection, or GPT-OSS's fused tensors), for reports: the loader reads each
    /// tensor as it finds it.
    pub fn storage(&self) -> ExpertStorage {
        let checkpoint = &self.checkpoint;
        let dtype = |name: &str| {
            let ShardFile::Mapped(shard) = &checkpoint.shards[*checkpoint.names.get(name)?] else {
                return None;
            };
            Some(shard.metadata.info(name)?.dtype)
        };
        match self.family.expert_names(&self.prefix, 0) {
            Some([gate, ..]) if dtype(&gate) == Some(Dtype::F8_E4M3) => ExpertStorage::Fp8 {
                block: checkpoint.fp8_block().ok(),
            },
            Some(_) => ExpertStorage::Plain,
            None => {
                if checkpoint.holds_mxfp4(&FusedNames::new(&self.prefix)) {
                    ExpertStorage::Mxfp4
                } else {
                    ExpertStorage::Plain
                }
            }
        }
    }

    /// Notes on the layer's tensors that a layer of `shape` whose router adds
    /// `router_bias` leaves unread: shared experts, when the spec has none, and the
    /// router's score correction or logits bias, when its rule does not add it. Running
    /// without them is legitimate (an engine may compute the shared experts itself), so
    /// these are notes to show, not errors. `router_bias` is `None` for a spec without a
    /// router: the caller routes, and the gate's tensors are none of the layer's concern.
    pub fn unused_tensors(
        &self,
        shape: &LayerShape,
        router_bias: Option<RouterBias>,
    ) -> Vec<String> {
        let names = &self.checkpoint.names;
        let mut notes = Vec::new();
        // `mlp.shared_experts.` (DeepSeek), `mlp.shared_expert.` and `_gate` (Qwen2-MoE).
        let shared_module = format!("{}mlp.shared_expert", self.prefix);
        let shared: Vec<String> = names
            .range(shared_module.clone()..)
            .map(|(name, _)| name)
            .take_while(|name| name.starts_with(&shared_module))
            .cloned()
            .collect();
        if shape.shared_slices == 0 && !shared.is_empty() {
            notes.push(format!(
                "the layer's shared experts ({}) are not read: the spec has no `shared_experts {{ }}`, \
                 so the layer computes its routed experts only",
                quoted(&shared)
            ));
        }
        if let Some(bias) = router_bias {
            for (kind, unread) in [
                (RouterBias::ScoreCorrection, "score_correction"),
                (RouterBias::Logits, "logits"),
            ] {
                let Some(name) = self.family.gate_bias_name(&self.prefix, kind) else {
                    continue;
                };
                if bias != kind && names.contains_key(&name) {
                    notes.push(format!(
                        "the router's bias `{name}` is not read: the spec's router has no \
                         `bias = {unread}`, so it chooses experts without it"
                    ));
                }
            }
        }
        notes
    }

    /// The file or folder the checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The layer prefix, with its final dot (or empty).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn family(&self) -> Family {
        self.family
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }
}

impl fmt::Display for CheckpointLayer {
    /// ``layer `model.layers.0.` (the only one), Qwen3-MoE naming (detected), of PATH``.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layer `{}`{}, {} naming{}, of {}",
            self.prefix,
            if self.prefix_detected {
                " (the only one)"
            } else {
                ""
            },
            self.family,
            if self.family_detected {
                " (detected)"
            } else {
                ""
            },
            self.path.display()
        )
    }
}

/// Writes `weights`, experts of a layer of `shape`, to a new `.safetensors` file at
/// `path`, bf16, each expert's gate, up and down projections named as `family` names them
/// under `prefix`: what [`Checkpoint::load_experts`] reads back bit for bit. For tests,
/// examples and tools that make small checkpoints; the whole file is built in memory.
pub fn write_experts(
    path: &Path,
    family: Family,
    prefix: &str,
    shape: &LayerShape,
    weights: &HostWeights,
) -> Result<(), CheckpointError> {
    write_layer(path, family, prefix, shape, weights, None)
}

/// [`write_experts`], plus the router's gate when given: its weight, and its bias under
/// the name a rule with `bias` reads ([`Checkpoint::load_gate`] reads them back: the
/// weight bit for bit, the bias as the f32 it is written in).
pub fn write_layer(
    path: &Path,
    family: Family,
    prefix: &str,
    shape: &LayerShape,
    weights: &HostWeights,
    gate: Option<(&HostGate, RouterBias)>,
) -> Result<(), CheckpointError> {
    family.check_layer(shape)?;
    weights.check(shape)?;
    let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
    let matrix = hidden * ffn;
    let bytes = |bits: &[u16]| -> Vec<u8> { bits.iter().flat_map(|b| b.to_le_bytes()).collect() };
    let f32_bytes =
        |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
    let mut tensors: Vec<NamedTensor> = Vec::new();
    let mut f32_tensors: Vec<NamedTensor> = Vec::new();
    match (family.expert_names(prefix, 0), &weights.biases) {
        (Some(_), _) => {
            let routed = weights.experts.start..weights.experts.end.min(shape.experts);
            for (local, e) in routed.clone().enumerate() {
                let Some([gate, up, down]) = family.expert_names(prefix, e) else {
                    unreachable!("a family names every expert or none");
                };
                let w1 = &weights.w1[local * 2 * matrix..(local + 1) * 2 * matrix];
                tensors.push((gate, vec![ffn, hidden], bytes(&w1[..matrix])));
                tensors.push((up, vec![ffn, hidden], bytes(&w1[matrix..])));
                let w2 = &weights.w2[local * matrix..(local + 1) * matrix];
                tensors.push((down, vec![hidden, ffn], bytes(w2)));
            }
            if weights.experts.end > shape.experts {
                tensors.extend(shared_tensors(
                    family,
                    prefix,
                    shape,
                    weights,
                    routed.len(),
                )?);
            }
            // `check` above: the gate is there exactly when the shared slices of a gated
            // shared expert are, and `check_layer` that the family gates it.
            if let (Some(name), Some(gate)) = (
                family.shared_gate_name(prefix),
                weights.shared_gate.as_deref(),
            ) {
                tensors.push((name, vec![1, hidden], bytes(gate)));
            }
        }
        // GPT-OSS: the inverse of `load_fused_experts`, every expert of the layer in one
        // tensor per projection (the biases in f32, which it reads back exactly).
        (None, Some(biases)) => {
            let all = 0..shape.experts;
            if weights.experts != all {
                return Err(CheckpointError::HostExperts {
                    held: weights.experts.clone(),
                    wanted: all,
                });
            }
            let names = FusedNames::new(prefix);
            let count = weights.experts.len();
            let mut gate_up = vec![0u16; count * 2 * matrix];
            let mut gate_up_bias = vec![0f32; count * 2 * ffn];
            let mut down = vec![0u16; count * matrix];
            for e in 0..count {
                let w1 = &weights.w1[e * 2 * matrix..(e + 1) * 2 * matrix];
                let fused = &mut gate_up[e * 2 * matrix..(e + 1) * 2 * matrix];
                for f in 0..ffn {
                    for h in 0..hidden {
                        fused[h * 2 * ffn + 2 * f] = w1[f * hidden + h];
                        fused[h * 2 * ffn + 2 * f + 1] = w1[(ffn + f) * hidden + h];
                    }
                    gate_up_bias[e * 2 * ffn + 2 * f] = biases.b1[e * 2 * ffn + f];
                    gate_up_bias[e * 2 * ffn + 2 * f + 1] = biases.b1[e * 2 * ffn + ffn + f];
                }
                let w2 = &weights.w2[e * matrix..(e + 1) * matrix];
                for h in 0..hidden {
                    for f in 0..ffn {
                        down[e * matrix + f * hidden + h] = w2[h * ffn + f];
                    }
                }
            }
            tensors.push((names.gate_up, vec![count, hidden, 2 * ffn], bytes(&gate_up)));
            tensors.push((names.down, vec![count, ffn, hidden], bytes(&down)));
            f32_tensors.push((
                names.gate_up_bias,
                vec![count, 2 * ffn],
                f32_bytes(&gate_up_bias),
            ));
            f32_tensors.push((names.down_bias, vec![count, hidden], f32_bytes(&biases.b2)));
        }
        (None, None) => {
            return Err(CheckpointError::HostBiases { spec: true });
        }
    }
    if let Some((gate, bias)) = gate {
        let experts = shape.experts as usize;
        let name = format!("{}.weight", family.gate_module(prefix));
        tensors.push((name, vec![experts, hidden], bytes(&gate.weight)));
        if let (Some(name), Some(values)) = (family.gate_bias_name(prefix, bias), &gate.bias) {
            let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            f32_tensors.push((name, vec![experts], data));
        }
    }
    let write_error = |source| CheckpointError::Write {
        path: path.to_owned(),
        source,
    };
    let typed = tensors
        .iter()
        .map(|t| (Dtype::BF16, t))
        .chain(f32_tensors.iter().map(|t| (Dtype::F32, t)));
    let views = typed
        .map(|(dtype, (name, dims, data))| {
            TensorView::new(dtype, dims.clone(), data).map(|view| (name.as_str(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| write_error(io::Error::other(e)))?;
    let file = safetensors::serialize(views, None).map_err(|e| write_error(io::Error::other(e)))?;
    std::fs::write(path, file).map_err(write_error)
}

/// A tensor to write: its name, shape and little-endian bytes.
type NamedTensor = (String, Vec<usize>, Vec<u8>);

/// The shared experts' (gate, up, down) tensors of `weights`, whose slices start at its
/// `first`-th expert: the inverse of [`Checkpoint::load_shared_slices`].
fn shared_tensors(
    family: Family,
    prefix: &str,
    shape: &LayerShape,
    weights: &HostWeights,
    first: usize,
) -> Result<Vec<NamedTensor>, CheckpointError> {
    let Some([gate, up, down]) = family.shared_names(prefix) else {
        return Err(CheckpointError::NoSharedExperts { family });
    };
    let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
    let (slices, matrix) = (shape.shared_slices as usize, hidden * ffn);
    let total = slices * ffn;
    let (mut gate_rows, mut up_rows) = (Vec::new(), Vec::new());
    let mut down_rows = vec![0u16; hidden * total];
    for s in 0..slices {
        let w1 = &weights.w1[(first + s) * 2 * matrix..(first + s + 1) * 2 * matrix];
        gate_rows.extend_from_slice(&w1[..matrix]);
        up_rows.extend_from_slice(&w1[matrix..]);
        let w2 = &weights.w2[(first + s) * matrix..(first + s + 1) * matrix];
        for (row, slice_row) in down_rows.chunks_exact_mut(total).zip(w2.chunks_exact(ffn)) {
            row[s * ffn..(s + 1) * ffn].copy_from_slice(slice_row);
        }
    }
    let bytes = |bits: &[u16]| -> Vec<u8> { bits.iter().flat_map(|b| b.to_le_bytes()).collect() };
    Ok(vec![
        (gate, vec![total, hidden], bytes(&gate_rows)),
        (up, vec![total, hidden], bytes(&up_rows)),
        (down, vec![hidden, total], bytes(&down_rows)),
    ])
}

/// Up to eight names, quoted, and how many more there are.
fn quoted(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// The end of [`CheckpointError::NoExpertsUnderPrefix`]'s message: where experts are.
fn list_layers(layers: &[String]) -> String {
    match layers {
        [] => "the checkpoint holds no routed-expert tensor named as a known family names them"
            .to_owned(),
        [one] => format!("the only layer with routed experts is `{one}`"),
        several => format!("the layers with routed experts are {}", quoted(several)),
    }
}

/// Orders names with their digit runs compared as numbers (`layers.2.` before `layers.10.`).
fn natural_key(name: &str) -> Vec<(String, Option<u64>)> {
    let mut key = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let text_end = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (text, tail) = rest.split_at(text_end);
        let digits_end = tail
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (digits, tail) = tail.split_at(digits_end);
        key.push((text.to_owned(), digits.parse().ok()));
        rest = tail;
    }
    key
}

/// Converts little-endian `bytes` of `dtype` (BF16, F16 or F32) into `out`, bf16 bits,
/// rounding to nearest even; `Err(dtype)` for any other dtype. `bytes` holds exactly
/// `out.len()` elements (the caller checked the shape).
pub fn to_bf16(dtype: Dtype, bytes: &[u8], out: &mut [u16]) -> Result<(), Dtype> {
    match dtype {
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_f32(f16_to_f32(u16::from_le_bytes([b[0], b[1]])));
            }
        }
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        other => return Err(other),
    }
    Ok(())
}

/// Converts little-endian `bytes` of `dtype` (F32, BF16 or F16: every value exact in f32)
/// into `out`; `Err(dtype)` for any other dtype. `bytes` holds exactly `out.len()`
/// elements (the caller checked the shape).
pub fn to_f32(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> Result<(), Dtype> {
    match dtype {
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        other => return Err(other),
    }
    Ok(())
}

/// The f32 value of every FP8 E4M3 bit pattern (`float8_e4m3fn`: bias 7, no infinities,
/// S.1111.111 NaN, largest 448), indexed by the byte.
fn fp8_e4m3_values() -> &'static [f32; 256] {
    static VALUES: OnceLock<[f32; 256]> = OnceLock::new();
    VALUES.get_or_init(|| std::array::from_fn(|bits| fp8_e4m3_to_f32(bits as u8)))
}

/// Per E8M0 scale byte, the 16 FP4 E2M1 codes' values times that scale, rounded to bf16.
fn mxfp4_values() -> &'static [[u16; 16]; 256] {
    static VALUES: OnceLock<[[u16; 16]; 256]> = OnceLock::new();
    VALUES.get_or_init(|| {
        std::array::from_fn(|scale| {
            let scale = e8m0_to_f32(scale as u8);
            std::array::from_fn(|code| bf16::from_f32(FP4_E2M1_VALUES[code] * scale))
        })
    })
}

/// FP8 E4M3 (`float8_e4m3fn`) to f32, exactly.
pub fn fp8_e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((bits >> 3) & 0xf);
    let mantissa = f32::from(bits & 0x7);
    sign * match exponent {
        0xf if mantissa == 7.0 => f32::NAN,
        // Subnormal: mantissa · 2^-9.
        0 => mantissa * f32::powi(2.0, -9),
        e => (1.0 + mantissa / 8.0) * f32::powi(2.0, e - 7),
    }
}

/// An MXFP4 block's scale (E8M0: 2^(bits - 127); 0xff is NaN), exactly.
pub fn e8m0_to_f32(bits: u8) -> f32 {
    match bits {
        0 => f32::from_bits(1 << 22),
        0xff => f32::NAN,
        b => f32::from_bits(u32::from(b) << 23),
    }
}

/// The values of FP4 E2M1 codes, indexed by the 4-bit code (sign in bit 3).
pub const FP4_E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// IEEE half to f32, exactly (every f16 value is an f32 value).
fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exponent = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match (exponent, mantissa) {
        (0, 0) => 0,
        // Subnormal: mantissa · 2^-24, exact in f32.
        (0, m) => (m as f32 * f32::powi(2.0, -24)).to_bits(),
        (0x1f, m) => 0x7f80_0000 | (m << 13),
        (e, m) => ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(sign | magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_that_overflow_are_no_safetensors_not_a_panic() {
        assert_eq!(covered_len(&[0xFF; 32]), None);
        let header =
            br#"{"t":{"dtype":"BF16","shape":[1],"data_offsets":[0,18446744073709551615]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        assert_eq!(covered_len(&bytes), None, "data past every u64 size");
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("ff.safetensors");
        std::fs::write(&path, [0xFF; 32]).expect("written");
        let error = Checkpoint::open(&path)
            .err()
            .expect("not a safetensors file");
        assert!(matches!(error, CheckpointError::Format { .. }), "{error}");
    }

    #[test]
    fn f16_converts_exactly() {
        let cases: [(u16, f32); 8] = [
            (0x0000, 0.0),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x7bff, 65504.0),
            (0x0001, 5.960_464_5e-8),
            (0x03ff, 6.097_555e-5),
            (0xfc00, f32::NEG_INFINITY),
        ];
        for (bits, value) in cases {
            assert_eq!(f16_to_f32(bits), value, "{bits:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn fp8_and_e8m0_codes_convert_exactly() {
        let cases: [(u8, f32); 10] = [
            (0x00, 0.0),
            (0x38, 1.0),
            (0x3c, 1.5),
            (0x40, 2.0),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0x01, 0.001_953_125),
            (0x07, 0.013_671_875),
            (0x08, 0.015_625),
            (0x77, 240.0),
        ];
        for (bits, value) in cases {
            assert_eq!(fp8_e4m3_to_f32(bits), value, "{bits:#04x}");
            assert_eq!(fp8_e4m3_values()[bits as usize], value);
        }
        assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
        assert_eq!(fp8_e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        // Every other code is a number, increasing with the code.
        let positive: Vec<f32> = (0..0x7f).map(fp8_e4m3_to_f32).collect();
        assert!(positive.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(120), 0.007_812_5);
        assert_eq!(e8m0_to_f32(0), f32::powi(2.0, -127));
        assert_eq!(e8m0_to_f32(254), f32::powi(2.0, 127));
        assert!(e8m0_to_f32(255).is_nan());
    }
}
