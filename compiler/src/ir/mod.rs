//! The checked intermediate representation: what a `.moe` file means once the checker has
//! validated it, resolved its units and applied its defaults.
//!
//! Architecture invariant: every `ir::Layer` satisfies the checker's rules (experts
//! divisible by the expert-parallel degree, top-k in range, sizes aligned, ranks matching the
//! topology). Stages after the checker (planner, codegen, runtime) read it and never
//! re-validate user input. Units are resolved: bandwidths in bytes per second, latencies in
//! nanoseconds, sizes in elements.

use serde::{Deserialize, Serialize};

/// Every size the kernels tile over must be a multiple of this many elements, so that rows
/// are whole 16-byte vectors of bf16 and tiles of 64 columns never straddle a row's end.
pub const SIZE_ALIGNMENT: u32 = 64;

/// A whole checked file: its named topologies and its layers, in source order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Module {
    pub topologies: Vec<Topology>,
    pub layers: Vec<Layer>,
}

/// One MoE layer, ready for the planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    pub name: String,
    /// Model (hidden) size H.
    pub hidden: u32,
    /// Per-expert FFN (intermediate) size F.
    pub ffn: u32,
    /// Number of routed experts E.
    pub experts: u32,
    /// Experts each token is routed to, K.
    pub top_k: u32,
    pub activation: Activation,
    /// Whether each expert adds a bias to both projections: `b1` [E, w1_rows] to GEMM1's
    /// output before the activation, `b2` [E, H] to GEMM2's before the routing weight
    /// (GPT-OSS's `gate_up_proj_bias` and `down_proj_bias`).
    pub expert_bias: bool,
    /// Element type of activations (x, y) and of the intermediate.
    pub dtype: DType,
    /// Element type of the expert weights (bf16 now; fp8 later).
    pub weight_dtype: DType,
    /// Largest number of tokens one rank passes to one call (sizes the workspace).
    pub max_tokens: u32,
    /// Experts every token goes through, outside the routed top-k.
    pub shared_experts: Option<SharedExperts>,
    /// The router, when it is part of the layer; `None` means the caller passes
    /// `topk_ids` and `topk_weights`.
    pub router: Option<Router>,
    pub parallel: Parallelism,
    pub topology: Topology,
    pub schedule: ScheduleHints,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `silu(gate) * up`; W1 holds gate rows then up rows ([2F, H]).
    Swiglu,
    /// `gelu(gate) * up`; W1 as for SwiGLU.
    Geglu,
    /// `gelu(h)` (tanh approximation); W1 is [F, H].
    Gelu,
    /// `max(h, 0)`; W1 is [F, H].
    Relu,
    /// `silu(h)`; W1 is [F, H].
    Silu,
    /// GPT-OSS's SwiGLU: `gate' · sigmoid(ALPHA · gate') · (up' + 1)` with
    /// `gate' = min(gate, LIMIT)` and `up' = clamp(up, −LIMIT, LIMIT)`; W1 as for SwiGLU.
    ClampedSwiglu,
}

/// The clamp of [`Activation::ClampedSwiglu`] (GPT-OSS's `swiglu_limit`).
pub const CLAMPED_SWIGLU_LIMIT: f32 = 7.0;
/// The sigmoid's slope in [`Activation::ClampedSwiglu`] (GPT-OSS's `alpha`).
pub const CLAMPED_SWIGLU_ALPHA: f32 = 1.702;

impl Activation {
    /// Gated activations read two rows of W1 (gate and up) per intermediate column.
    pub fn is_gated(self) -> bool {
        matches!(
            self,
            Activation::Swiglu | Activation::Geglu | Activation::ClampedSwiglu
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Activation::Swiglu => "swiglu",
            Activation::Geglu => "geglu",
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
            Activation::ClampedSwiglu => "clamped_swiglu",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    Bf16,
    /// FP8 E4M3, for weights only (reserved: the checker rejects it until kernels exist).
    Fp8E4m3,
}

impl DType {
    pub fn size_bytes(self) -> u32 {
        match self {
            DType::Bf16 => 2,
            DType::Fp8E4m3 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp8E4m3 => "fp8_e4m3",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedExperts {
    pub count: u32,
    /// FFN size of each shared expert.
    pub ffn: u32,
    /// Whether a token's shared-expert output is scaled by `sigmoid(x[t] · w_gate)` (one
    /// weight vector `[H]` for the whole shared MLP: Qwen2-MoE's `shared_expert_gate`)
    /// rather than taken with weight 1 (DeepSeek-V3).
    #[serde(default)]
    pub gated: bool,
}

/// How the layer chooses each token's experts and their weights from `x · W_gateᵀ` (the
/// logits, one per expert, plus the gate's bias when `bias` is [`RouterBias::Logits`]).
///
/// 1. scores: softmax or sigmoid of the logits, or the logits themselves
///    ([`Scoring::TopkSoftmax`]);
/// 2. selection values: the scores, plus the per-expert correction when `bias` is
///    [`RouterBias::ScoreCorrection`];
/// 3. with a group limit, only the experts of the `kept` groups whose two best selection
///    values sum highest are eligible;
/// 4. the top-k eligible experts by selection value (ties: the lower index first);
/// 5. weights: their scores (uncorrected), or a softmax over their logits
///    ([`Scoring::TopkSoftmax`]); divided by their sum when `normalize`; times `scale`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Router {
    pub scoring: Scoring,
    /// The gate's per-expert bias, if any, and where it is added.
    pub bias: RouterBias,
    /// DeepSeek-V3 style group-limited top-k, if any.
    pub group_limit: Option<GroupLimit>,
    /// Whether the kept top-k scores are renormalised to sum to one (never with
    /// [`Scoring::TopkSoftmax`], whose weights sum to one already).
    pub normalize: bool,
    /// Factor applied to the routing weights after normalisation.
    pub scale: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    /// Softmax over all experts, then top-k (Mixtral, Qwen3-MoE).
    Softmax,
    /// Sigmoid of each logit, then top-k (DeepSeek-V3).
    Sigmoid,
    /// Top-k of the logits, then a softmax over the k chosen (GPT-OSS).
    TopkSoftmax,
}

impl Scoring {
    /// The word the language writes.
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
            Scoring::TopkSoftmax => "topk_softmax",
        }
    }
}

/// The gate's per-expert bias vector `[E]` (f32 on the device), and what it is added to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterBias {
    /// No bias: the logits are `x · W_gateᵀ`.
    None,
    /// Added to the logits, so to both the choice and the weights: a `Linear` gate with a
    /// bias (GPT-OSS's `router.bias`).
    Logits,
    /// Added to the scores for choosing experts only; the weights come from the scores
    /// without it (DeepSeek-V3's `e_score_correction_bias`).
    ScoreCorrection,
}

impl RouterBias {
    /// The word the language writes.
    pub fn name(self) -> &'static str {
        match self {
            RouterBias::None => "none",
            RouterBias::Logits => "logits",
            RouterBias::ScoreCorrection => "score_correction",
        }
    }
}

/// Experts are split into `groups`; only the best `kept` groups are eligible for top-k.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLimit {
    pub groups: u32,
    pub kept: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallelism {
    /// Expert-parallel degree R: experts are spread over R ranks, E/R each.
    pub expert: u32,
    /// Data-parallel degree (reserved; 1 today).
    pub data: u32,
    /// Tensor-parallel degree (reserved; 1 today).
    pub tensor: u32,
}

/// A machine topology, shared by name between layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    pub name: String,
    pub gpus_per_node: u32,
    pub nodes: u32,
    /// The link between GPUs of one node (NVLink).
    pub intra_node: Link,
    /// The network between nodes.
    pub network: Link,
    /// When set, this many logical ranks share one physical GPU (testing the distributed
    /// protocol on one device).
    pub virtual_ranks: Option<u32>,
}

impl Topology {
    /// Number of ranks this topology provides.
    pub fn ranks(&self) -> u32 {
        self.virtual_ranks
            .unwrap_or(self.gpus_per_node * self.nodes)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second in one direction.
    pub bandwidth_bytes_per_s: u64,
    /// One-way latency in nanoseconds.
    pub latency_ns: u64,
}

/// Optional schedule hints; the planner decides whatever is `None`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScheduleHints {
    /// Tile of GEMM1 (gather + W1 + activation): rows, intermediate columns, reduction depth.
    pub gemm1_tile: Option<TileShape>,
    /// Tile of GEMM2 (W2 + routing weight).
    pub gemm2_tile: Option<TileShape>,
    /// Shared-memory pipeline stages of both GEMMs.
    pub stages: Option<u32>,
    /// Tokens per dispatch chunk (multi-rank path).
    pub dispatch_chunk: Option<u32>,
    /// Thread blocks of a fused kernel that communicate (multi-rank path).
    pub comm_blocks: Option<u32>,
    pub traffic_order: Option<TrafficOrder>,
    /// Calls of up to this many tokens run as one persistent kernel (the fused decode of
    /// the first regime, single GPU); 0 for none. Unset, the planner decides.
    #[serde(default)]
    pub fused_decode: Option<u32>,
    /// How long a kernel waits for one flag before it reports a time-out, in
    /// nanoseconds. Unset, the planner's default (about 2 s).
    #[serde(default)]
    pub flag_timeout_ns: Option<u64>,
    /// Across nodes, calls of up to this many tokens per rank move whole token chunks over
    /// the network, sized on the host without reading the rows per chunk back; 0 for none.
    /// Unset, the planner decides.
    #[serde(default)]
    pub whole_chunks: Option<u32>,
}

/// A GEMM tile: `m` rows (tokens) × `n` output columns × `k` reduction depth per stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TileShape {
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrafficOrder {
    /// Nearer destinations first (same GPU, then NVLink, then network).
    NearestFirst,
    /// Source r starts at r+1, r+2, … so that no receiver is hit by all at once.
    Rotate,
    /// Aggregate per remote node, then fan out over NVLink there.
    Hierarchical,
}

impl TrafficOrder {
    pub fn name(self) -> &'static str {
        match self {
            TrafficOrder::NearestFirst => "nearest_first",
            TrafficOrder::Rotate => "rotate",
            TrafficOrder::Hierarchical => "hierarchical",
        }
    }
}

impl Layer {
    /// Rows of W1 per expert: 2F for gated activations, F otherwise.
    pub fn w1_rows(&self) -> u64 {
        let gated = if self.activation.is_gated() { 2 } else { 1 };
        gated * u64::from(self.ffn)
    }

    /// Experts held by each expert-parallel rank.
    pub fn experts_per_rank(&self) -> u32 {
        self.experts / self.parallel.expert
    }

    /// Weight elements of one routed expert (W1 and W2).
    pub fn expert_weight_elems(&self) -> u64 {
        self.w1_rows() * u64::from(self.hidden) + u64::from(self.hidden) * u64::from(self.ffn)
    }
}
