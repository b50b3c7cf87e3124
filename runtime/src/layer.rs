//! A layer handle: the plan's kernels loaded on one GPU, the experts' weights, and a
//! workspace allocated once. `forward` enqueues the plan's launch table on the stream and
//! returns: no host synchronisation, so a call can be captured in a CUDA graph. A small call
//! that repeats (same tokens and buffers) is captured into a graph by the layer itself and
//! replayed from it after (`call_graphs`), which saves the host's launch latency.
//!
//! Kernel-side errors (an expert id out of range) land in the error word; [`MoeLayer::take_error`]
//! synchronises, reads it and turns it into a typed error naming the token.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use moeforge_compiler::ir::RouterBias;
use moeforge_compiler::plan::{
    BufferId, Launch, LaunchArg, LayerShape, Plan, PlanInvalid, RouterPlan, error_code,
};
use thiserror::Error;

use crate::call_graphs::{CallGraphs, CallKey};
use crate::gpu::{DriverContext, Gpu, GpuError, LoadedKernels};
use crate::tensor_map::{TensorMap, weight_map_shape};

#[derive(Debug, Error)]
pub enum LayerError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    InvalidPlan(#[from] PlanInvalid),
    #[error(
        "the compiled module has no kernel `{name}` that the plan launches; regenerate and recompile the layer"
    )]
    MissingKernel { name: String },
    #[error(
        "the plan has no expert-parallel part (the spec has one rank, or the plan's limitations say why its layer cannot run expert-parallel); use the single-GPU layer"
    )]
    NotExpertParallel,
    #[error("the plan has {ranks} ranks but {given} were given")]
    RankCount { ranks: u32, given: usize },
    #[error("rank {rank} was asked of a layer that drives {ranks} rank(s) in this process")]
    NoSuchRank { rank: usize, ranks: usize },
    #[error(transparent)]
    Group(#[from] crate::ipc::GroupError),
    #[error(transparent)]
    Network(#[from] crate::network::NetworkError),
    #[error(
        "the plan's ranks span {nodes} nodes through NCCL: run them as rank processes (`moeforge run`/`bench` under a launcher; `EpLayer::join_group`), or emulate the nodes on one GPU with `virtual_ranks` set to the topology's GPU count"
    )]
    AcrossNodes { nodes: u32 },
    #[error(
        "the plan emulates {nodes} nodes with virtual ranks of one GPU, which one process drives (`EpLayer::new`, `--ranks`), not a group of rank processes"
    )]
    EmulatedNodesInGroup { nodes: u32 },
    #[error("{network}{}", kernel_note(.kernel.as_deref()))]
    NetworkStalled {
        network: crate::network::NetworkError,
        /// What this rank's kernels reported meanwhile (a wait for the lost peer's rows).
        kernel: Option<Box<LayerError>>,
    },
    #[error(
        "the bulk-synchronous schedule's barriers are stream events of one process; run it with every rank in one process (--gpus G), not as a group of rank processes"
    )]
    BulkSynchronousInGroup,
    #[error(
        "{wait}{others}: a peer stopped or never sent; the layer restarted its exchange, so the next call starts clean"
    )]
    FlagTimeout {
        wait: FlagWait,
        /// The other ranks' waits that timed out in the same call: the one that stopped
        /// first is often not the first rank.
        others: OtherWaits,
    },
    #[error(
        "the plan gives a single-GPU launch the multi-rank argument `{arg}`; run it with the expert-parallel layer"
    )]
    MultiRankArg { arg: &'static str },
    #[error(
        "the plan gives an expert-parallel launch the argument `{arg}`, which the expert-parallel layer does not provide (it takes the caller's routing)"
    )]
    SingleGpuArg { arg: &'static str },
    #[error(
        "the peer table has {bytes} bytes of addresses for a buffer of {expected}: a rank's row is short or missing (an internal error)"
    )]
    PeerTableSize { bytes: usize, expected: usize },
    #[error("the plan launches a kernel with workspace buffer `{buffer}`, which it does not list")]
    MissingWorkspace { buffer: &'static str },
    #[error(
        "{tokens} tokens exceed the layer's max_tokens of {max}; raise `max_tokens` in the spec or split the call"
    )]
    TooManyTokens { tokens: u32, max: u32 },
    #[error(
        "rank {rank} is passed {tokens} tokens, more than the {bound} the ranks agreed on for their calls (EpLayer::bound_tokens); agree on a larger bound first"
    )]
    BeyondTokensBound { rank: u32, tokens: u32, bound: u32 },
    #[error(
        "a rank's tokens bound came over the control channel as {bytes} bytes instead of 4: the ranks run different builds of moeforge"
    )]
    TokensBoundMessage { bytes: usize },
    #[error("{what} holds {got} elements but the layer needs {expected}")]
    Shape {
        what: &'static str,
        expected: u64,
        got: u64,
    },
    #[error(
        "topk_ids[{token}, {k}] = {id} is not an expert of this layer (valid ids are 0..{experts}); that pair was skipped"
    )]
    ExpertIdOutOfRange {
        token: i32,
        k: i32,
        id: i32,
        experts: u32,
    },
    #[error(
        "topk_ids[{token}, {k}] = {id} repeats an expert an earlier choice of the same token names; the expert-parallel layer takes each token to an expert once, so that pair was skipped (give each token distinct experts)"
    )]
    ExpertIdRepeated { token: i32, k: i32, id: i32 },
    #[error("{var}={value:?} is not understood: expected {expected}")]
    InvalidEnv {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("a kernel reported unknown error code {code} (details {details:?})")]
    UnknownKernelError { code: i32, details: [i32; 3] },
    #[error(
        "the layer's spec says `expert_bias = {spec}`, but the weights {}; {}",
        if *spec { "hold no expert biases" } else { "hold expert biases" },
        if *spec { "give each expert's b1 and b2 (a checkpoint's, or random ones)" } else { "drop them, or set `expert_bias = true` in the spec" }
    )]
    ExpertBias { spec: bool },
    #[error(
        "the layer's spec {}, but the weights {}; {}",
        if *spec { "gates its shared expert (`gated = true`)" } else { "has no gated shared expert" },
        if *spec { "hold no shared expert gate" } else { "hold one" },
        if *spec { "give its [H] weights (a checkpoint's `shared_expert_gate`, or random ones)" } else { "drop it, or set `gated = true` in the spec's `shared_experts { }`" }
    )]
    SharedGate { spec: bool },
    #[error("the plan passes `{arg}` as a tensor map, which it is not")]
    NotATensorMap { arg: &'static str },
    #[error(
        "the layer's spec has no `router {{ }}` section: pass topk_ids and topk_weights to `forward`, or add a router to the spec"
    )]
    NoRouter,
    #[error(
        "the layer was built without the router's gate weights: build it with them (a checkpoint's gate tensors, or random ones) to let it route itself"
    )]
    NoGateWeights,
    #[error(
        "the router's rule {rule} a gate bias, but {given}; give the bias the spec's `bias = ...` names, or change the spec"
    )]
    GateBias {
        rule: &'static str,
        given: &'static str,
    },
    #[error(
        "the driver refused a TMA tensor map over {what} ({rows} x {columns} bf16, boxes of {box_rows} rows): {result}; the plan's tile does not suit this driver or device"
    )]
    TensorMap {
        what: &'static str,
        rows: u64,
        columns: u64,
        box_rows: u32,
        result: String,
    },
}

/// The experts' weights on the device, checkpoint layout: `w1` [E', w1_rows, H] (gate
/// rows then up rows when gated), `w2` [E', H, F], bf16; and their biases exactly when
/// the spec says `expert_bias = true`. On one GPU E' is the routed experts, then the
/// shared slices ([`LayerShape::gemm_experts`]); on an expert-parallel rank, its routed
/// experts, then the shared slices.
pub struct ExpertWeights {
    pub w1: CudaSlice<u16>,
    pub w2: CudaSlice<u16>,
    pub biases: Option<ExpertBiases>,
    /// `[H]` bf16: the shared expert gate's weights, exactly when the spec's shared expert
    /// is gated (`gated = true`; every rank holds them whole).
    pub shared_gate: Option<CudaSlice<u16>>,
}

/// Each expert's biases on the device, f32: `b1` [E, w1_rows] on GEMM1's output (gate
/// columns then up columns, as W1's rows), `b2` [E, H] on GEMM2's.
pub struct ExpertBiases {
    pub b1: CudaSlice<f32>,
    pub b2: CudaSlice<f32>,
}

impl ExpertWeights {
    /// Checks that the buffers hold `experts` experts of `shape`.
    pub(crate) fn check(&self, shape: &LayerShape, experts: u32) -> Result<(), LayerError> {
        let experts = u64::from(experts);
        check_len(
            "w1",
            self.w1.len(),
            experts * u64::from(shape.w1_rows()) * u64::from(shape.hidden),
        )?;
        check_len(
            "w2",
            self.w2.len(),
            experts * u64::from(shape.hidden) * u64::from(shape.ffn),
        )?;
        match &self.biases {
            Some(biases) if shape.expert_bias => {
                check_len("b1", biases.b1.len(), experts * u64::from(shape.w1_rows()))?;
                check_len("b2", biases.b2.len(), experts * u64::from(shape.hidden))?;
            }
            None if !shape.expert_bias => {}
            _ => {
                return Err(LayerError::ExpertBias {
                    spec: shape.expert_bias,
                });
            }
        }
        match &self.shared_gate {
            Some(gate) if shape.shared_gated => {
                check_len("shared expert gate", gate.len(), u64::from(shape.hidden))
            }
            None if !shape.shared_gated => Ok(()),
            _ => Err(LayerError::SharedGate {
                spec: shape.shared_gated,
            }),
        }
    }

    /// The device address of the shared expert gate's weights, null without them (where
    /// [`ExpertWeights::check`] passed, exactly when no launch takes them).
    pub(crate) fn shared_gate_pointer(&self, stream: &CudaStream) -> u64 {
        self.shared_gate
            .as_ref()
            .map_or(0, |gate| ptr(gate, stream))
    }

    /// The device address of GEMM1's biases `b1` (`gemm1`) or GEMM2's `b2`, null without
    /// biases (where [`ExpertWeights::check`] passed, exactly when no launch takes them).
    pub(crate) fn bias_pointer(&self, gemm1: bool, stream: &CudaStream) -> u64 {
        self.biases
            .as_ref()
            .map_or(0, |b| ptr(if gemm1 { &b.b1 } else { &b.b2 }, stream))
    }
}

/// The router's gate on the device: `weight` [E, H] bf16 and, when the rule has a bias
/// (`bias = logits | score_correction`), `bias` `[E]` f32.
pub struct GateWeights {
    pub weight: CudaSlice<u16>,
    pub bias: Option<CudaSlice<f32>>,
}

impl GateWeights {
    /// Checks that the weights hold the gate of `shape` with a bias exactly when `router`
    /// asks for one.
    pub(crate) fn check(&self, shape: &LayerShape, router: &RouterPlan) -> Result<(), LayerError> {
        check_len(
            "gate weight",
            self.weight.len(),
            u64::from(shape.experts) * u64::from(shape.hidden),
        )?;
        match (&self.bias, router.rule.bias != RouterBias::None) {
            (Some(bias), true) => check_len("gate bias", bias.len(), u64::from(shape.experts)),
            (None, false) => Ok(()),
            (None, true) => Err(LayerError::GateBias {
                rule: "has",
                given: "none was given",
            }),
            (Some(_), false) => Err(LayerError::GateBias {
                rule: "has no",
                given: "one was given",
            }),
        }
    }
}

/// The inputs and output of one forward call that routes itself, on the device.
pub struct RoutedForwardArgs<'a> {
    pub tokens: u32,
    /// bf16 [T, H].
    pub x: &'a CudaSlice<u16>,
    /// bf16 [T, H], written completely.
    pub y: &'a mut CudaSlice<u16>,
}

/// Where a call's expert choices come from.
#[derive(Clone, Copy)]
enum Routing<'a> {
    /// The caller's `topk_ids` [T, K] and `topk_weights` [T, K].
    Caller {
        topk_ids: &'a CudaSlice<i32>,
        topk_weights: &'a CudaSlice<f32>,
    },
    /// The router's launches, whose `routed_ids` and `routed_weights` the table then reads.
    Router,
}

/// The inputs and output of one forward call, on the device.
pub struct ForwardArgs<'a> {
    pub tokens: u32,
    /// bf16 [T, H].
    pub x: &'a CudaSlice<u16>,
    /// i32 [T, K].
    pub topk_ids: &'a CudaSlice<i32>,
    /// f32 [T, K].
    pub topk_weights: &'a CudaSlice<f32>,
    /// bf16 [T, H], written completely.
    pub y: &'a mut CudaSlice<u16>,
}

impl ForwardArgs<'_> {
    /// Checks that every buffer holds `tokens` rows of a layer with `hidden` columns and
    /// `top_k` experts per token.
    pub(crate) fn check(&self, hidden: u32, top_k: u32) -> Result<(), LayerError> {
        let t = u64::from(self.tokens);
        check_len("x", self.x.len(), t * u64::from(hidden))?;
        check_len("topk_ids", self.topk_ids.len(), t * u64::from(top_k))?;
        check_len(
            "topk_weights",
            self.topk_weights.len(),
            t * u64::from(top_k),
        )?;
        check_len("y", self.y.len(), t * u64::from(hidden))
    }
}

/// A launch's function and what to pass for each of its parameters.
type BoundLaunch = (CudaFunction, Vec<Binding>);

pub struct MoeLayer {
    plan: Plan,
    stream: Arc<CudaStream>,
    /// Per regime, each launch of its table (same order), then its fused decode's.
    regime_kernels: Vec<Vec<BoundLaunch>>,
    /// Per regime, the router's launches (empty without a router or its gate weights).
    router_kernels: Vec<Vec<BoundLaunch>>,
    workspace: Vec<(BufferId, CudaSlice<u8>)>,
    weights: ExpertWeights,
    gate: Option<GateWeights>,
    /// The tensor maps that launches pass (`Binding::TensorMap`).
    tensor_maps: Vec<(LaunchArg, TensorMap)>,
    /// Which of the launches the plan marks `early_start` start early
    /// (`MOEFORGE_EARLY_START`: all, none, or those of some kinds, to measure what starting
    /// early changes), and, for some kinds, the kernels of those.
    early_starts: EarlyStarts,
    early_kernels: HashSet<String>,
    /// Whether calls the plan's fused decode covers run it; `MOEFORGE_FUSED_DECODE=0` runs
    /// the table instead.
    fused_decode: bool,
    /// Whether calls the plan routes in the GEMMs' blocks do so; `MOEFORGE_BLOCK_ROUTING=0`
    /// runs their route launch instead.
    block_routing: bool,
    /// Graphs of the plan's repeated small calls; `MOEFORGE_CALL_GRAPHS=0` keeps none.
    call_graphs: CallGraphs,
    _module: LoadedKernels,
}

/// A switch that is on unless the variable `var`, read through `lookup`, says 0: unset,
/// empty or `1` leaves it on; anything else is an error quoting `expected`.
fn switch_from(
    lookup: impl Fn(&str) -> Option<String>,
    var: &'static str,
    expected: &'static str,
) -> Result<bool, LayerError> {
    match lookup(var).as_deref() {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(LayerError::InvalidEnv {
            var,
            value: other.to_string(),
            expected,
        }),
    }
}

/// Which of the plan's early starts a layer keeps (`MOEFORGE_EARLY_START`): all of them
/// (unset, empty or `1`), none (`0`: launched the ordinary way, the kernels' waits are then
/// no-ops), or only those of the launches of some kinds (a comma-separated list, as
/// `gemm2,combine`), to measure one launch at a time what starting early changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EarlyStarts {
    All,
    None,
    Only(Vec<LaunchKind>),
}

/// The kinds of a single-GPU call's launches, as `MOEFORGE_EARLY_START` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    /// The routing metadata (`route`, or `route_count` and `route_place`).
    Route,
    /// The router's launches (a fused router, or gate and select).
    Router,
    Gemm1,
    Gemm2,
    Combine,
    /// The prefill's row order (`invert_rows`, `sort_rows`).
    Rows,
    /// A regime's fused decode kernel.
    Fused,
}

impl LaunchKind {
    const ALL: [LaunchKind; 7] = [
        LaunchKind::Route,
        LaunchKind::Router,
        LaunchKind::Gemm1,
        LaunchKind::Gemm2,
        LaunchKind::Combine,
        LaunchKind::Rows,
        LaunchKind::Fused,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LaunchKind::Route => "route",
            LaunchKind::Router => "router",
            LaunchKind::Gemm1 => "gemm1",
            LaunchKind::Gemm2 => "gemm2",
            LaunchKind::Combine => "combine",
            LaunchKind::Rows => "rows",
            LaunchKind::Fused => "fused",
        }
    }

    /// The kind of `plan`'s launch of `kernel` (`None` for a kernel of no single-GPU call).
    pub fn of(plan: &Plan, kernel: &str) -> Option<LaunchKind> {
        if plan.is_route_kernel(kernel) {
            return Some(LaunchKind::Route);
        }
        if kernel == plan.combine_kernel {
            return Some(LaunchKind::Combine);
        }
        if kernel == plan.invert_rows_kernel || kernel == plan.sort_rows_kernel {
            return Some(LaunchKind::Rows);
        }
        for regime in &plan.regimes {
            if kernel == regime.gemm1_kernel {
                return Some(LaunchKind::Gemm1);
            }
            if kernel == regime.gemm2_kernel {
                return Some(LaunchKind::Gemm2);
            }
            if regime
                .fused_decode
                .as_ref()
                .is_some_and(|fused| fused.launch.kernel == kernel)
            {
                return Some(LaunchKind::Fused);
            }
        }
        plan.router
            .iter()
            .flat_map(|router| router.regimes.iter().flat_map(|regime| &regime.launches))
            .any(|launch| launch.kernel == kernel)
            .then_some(LaunchKind::Router)
    }
}

impl EarlyStarts {
    /// Whether a launch of `kind` that the plan starts early does so.
    pub fn keeps(&self, kind: LaunchKind) -> bool {
        match self {
            EarlyStarts::All => true,
            EarlyStarts::None => false,
            EarlyStarts::Only(kinds) => kinds.contains(&kind),
        }
    }

    /// The value of `MOEFORGE_EARLY_START` that says this.
    pub fn describe(&self) -> String {
        match self {
            EarlyStarts::All => "1".into(),
            EarlyStarts::None => "0".into(),
            EarlyStarts::Only(kinds) => kinds
                .iter()
                .map(|kind| kind.name())
                .collect::<Vec<_>>()
                .join(","),
        }
    }
}

/// `MOEFORGE_EARLY_START` (see [`EarlyStarts`]).
fn early_starts_from(lookup: impl Fn(&str) -> Option<String>) -> Result<EarlyStarts, LayerError> {
    const VAR: &str = "MOEFORGE_EARLY_START";
    const EXPECTED: &str = "1 (the plan's early starts, the default), 0 (none) or a comma-separated list of the kinds of launch that keep theirs: route, router, gemm1, gemm2, combine, rows, fused";
    let value = match lookup(VAR) {
        None => return Ok(EarlyStarts::All),
        Some(value) => value,
    };
    match value.as_str() {
        "" | "1" => return Ok(EarlyStarts::All),
        "0" => return Ok(EarlyStarts::None),
        _ => {}
    }
    let invalid = || LayerError::InvalidEnv {
        var: VAR,
        value: value.clone(),
        expected: EXPECTED,
    };
    let mut kinds = Vec::new();
    for name in value.split(',').map(str::trim) {
        let kind = LaunchKind::ALL
            .into_iter()
            .find(|kind| kind.name() == name)
            .ok_or_else(invalid)?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Ok(EarlyStarts::Only(kinds))
}

/// `MOEFORGE_BLOCK_ROUTING`: `0` runs the route launch of the calls the plan routes in the
/// GEMMs' blocks, to measure what leaving it out changes.
fn block_routing_from(lookup: impl Fn(&str) -> Option<String>) -> Result<bool, LayerError> {
    switch_from(
        lookup,
        "MOEFORGE_BLOCK_ROUTING",
        "1 (small calls routed in the GEMMs' blocks, the default) or 0 (by the route launch)",
    )
}

/// `MOEFORGE_FUSED_DECODE`: `0` runs a regime's table where the plan would run its fused
/// decode kernel, to measure what fusing changes.
pub(crate) fn fused_decode_from(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<bool, LayerError> {
    switch_from(
        lookup,
        "MOEFORGE_FUSED_DECODE",
        "1 (the plan's fused decode, the default) or 0 (the table's launches)",
    )
}

/// `MOEFORGE_CALL_GRAPHS`: `0` runs every call's launches, also where the plan replays a
/// repeated call as a graph, to measure what the graphs change.
fn call_graphs_from(lookup: impl Fn(&str) -> Option<String>) -> Result<bool, LayerError> {
    switch_from(
        lookup,
        "MOEFORGE_CALL_GRAPHS",
        "1 (repeated small calls replayed as CUDA graphs, the default) or 0 (never)",
    )
}

/// Where a kernel parameter's value comes from, resolved once in [`MoeLayer::new`].
#[derive(Clone, Copy)]
enum Binding {
    X,
    TopkIds,
    TopkWeights,
    Y,
    Tokens,
    RoutesInBlocks,
    LaysOutRouting,
    W1,
    W2,
    W1Bias,
    W2Bias,
    SharedExpertGate,
    GateWeight,
    GateBias,
    /// The workspace buffer at this position of `MoeLayer::workspace`.
    Workspace(usize),
    /// The tensor map at this position of `MoeLayer::tensor_maps`.
    TensorMap(usize),
}

pub(crate) fn ptr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // Event tracking is off on moeforge's context, so the guard has nothing to record.
    let (address, _guard) = slice.device_ptr(stream);
    address
}

pub(crate) fn check_len(what: &'static str, got: usize, expected: u64) -> Result<(), LayerError> {
    if (got as u64) < expected {
        return Err(LayerError::Shape {
            what,
            expected,
            got: got as u64,
        });
    }
    Ok(())
}

/// One kernel parameter's value.
pub(crate) enum ArgValue {
    Pointer(u64),
    Int(i32),
    TensorMap(TensorMap),
}

/// Enqueues `function` on `stream` with `values` as its parameters, in order; with
/// `early_start` it may start before the kernel ahead of it in the stream has finished
/// (the plan's `Launch::early_start`: the kernel waits for that one itself).
///
/// # Safety
/// The kernel's parameter list must be `values`' types in this order, and every buffer
/// and count must hold what the kernel indexes (what `cudarc`'s launch requires).
pub(crate) unsafe fn launch_with(
    stream: &CudaStream,
    function: &CudaFunction,
    config: LaunchConfig,
    values: &[ArgValue],
    early_start: bool,
) -> Result<(), DriverError> {
    if early_start {
        // SAFETY: passed on from the caller.
        return unsafe { launch_early_start(stream, function, config, values) };
    }
    let mut builder = stream.launch_builder(function);
    for value in values {
        match value {
            ArgValue::Pointer(p) => builder.arg(p),
            ArgValue::Int(i) => builder.arg(i),
            ArgValue::TensorMap(map) => builder.arg(map),
        };
    }
    // SAFETY: the caller vouches for the parameter list and the buffers.
    unsafe { builder.launch(config) }.map(|_| ())
}

/// `launch_with` through `cuLaunchKernelEx` with programmatic stream serialization allowed
/// (cudarc's launch builder sets no launch attributes).
///
/// # Safety
/// As `launch_with`.
unsafe fn launch_early_start(
    stream: &CudaStream,
    function: &CudaFunction,
    config: LaunchConfig,
    values: &[ArgValue],
) -> Result<(), DriverError> {
    // The driver reads each parameter through its pointer during the call.
    let mut params: Vec<*mut std::ffi::c_void> = values
        .iter()
        .map(|value| match value {
            ArgValue::Pointer(p) => p as *const u64 as *mut std::ffi::c_void,
            ArgValue::Int(i) => i as *const i32 as *mut std::ffi::c_void,
            ArgValue::TensorMap(map) => map as *const TensorMap as *mut std::ffi::c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute is a valid value of the C union; the fields that
    // matter are set next.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let launch_config = sys::CUlaunchConfig {
        gridDimX: config.grid_dim.0,
        gridDimY: config.grid_dim.1,
        gridDimZ: config.grid_dim.2,
        blockDimX: config.block_dim.0,
        blockDimY: config.block_dim.1,
        blockDimZ: config.block_dim.2,
        sharedMemBytes: config.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: `params` points at `values`, which outlive the call; the caller vouches for
    // the parameter list and the buffers.
    unsafe {
        sys::cuLaunchKernelEx(
            &launch_config,
            function.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// The tensor maps that launches pass (over one set of expert weights, and over the
/// intermediate rows and sorted x on one GPU), each encoded once.
pub(crate) struct WeightTensorMaps<'a> {
    pub shape: &'a LayerShape,
    /// Experts the weights hold (all of them, or a rank's).
    pub experts: u32,
    pub weights: &'a ExpertWeights,
    /// The router's gate weights, where the layer has them (a warp-specialised gate reads
    /// them through a map).
    pub gate_weight: Option<&'a CudaSlice<u16>>,
    pub stream: &'a CudaStream,
    pub maps: Vec<(LaunchArg, TensorMap)>,
}

impl WeightTensorMaps<'_> {
    /// The position in `maps` of the map `arg` (a `W1Tiles`/`W2Tiles` argument) needs,
    /// encoding it on first use.
    pub(crate) fn position(&mut self, arg: LaunchArg) -> Result<usize, LayerError> {
        if let LaunchArg::GateWeightTiles { box_rows } = arg {
            return self.position_or_encode(arg, |maps| {
                let gate = maps.gate_weight.ok_or(LayerError::NoGateWeights)?;
                TensorMap::bf16_rows(
                    "the gate weights",
                    ptr(gate, maps.stream),
                    u64::from(maps.shape.experts),
                    u64::from(maps.shape.hidden),
                    box_rows,
                )
            });
        }
        self.position_or_encode(arg, |maps| {
            let (what, matrix) = match arg {
                LaunchArg::W1Tiles { .. } => ("w1", &maps.weights.w1),
                _ => ("w2", &maps.weights.w2),
            };
            let (rows, columns, box_rows) = weight_map_shape(arg, maps.shape, maps.experts)
                .ok_or(LayerError::NotATensorMap { arg: arg.name() })?;
            TensorMap::bf16_rows(what, ptr(matrix, maps.stream), rows, columns, box_rows)
        })
    }

    /// The position in `maps` of the map over the workspace buffer `memory` that `arg` (an
    /// `IntermediateTiles` argument, bf16 rows of F columns, or a `SortedXTiles` one, rows
    /// of H) needs, encoding it on first use.
    fn position_over_rows(
        &mut self,
        arg: LaunchArg,
        memory: &CudaSlice<u8>,
    ) -> Result<usize, LayerError> {
        let (what, box_rows, width) = match arg {
            LaunchArg::IntermediateTiles { box_rows } => {
                ("the intermediate rows", box_rows, self.shape.ffn)
            }
            LaunchArg::SortedXTiles { box_rows } => {
                ("the sorted rows of x", box_rows, self.shape.hidden)
            }
            _ => return Err(LayerError::NotATensorMap { arg: arg.name() }),
        };
        self.position_or_encode(arg, |maps| {
            let columns = u64::from(width);
            TensorMap::bf16_rows(
                what,
                ptr(memory, maps.stream),
                memory.len() as u64 / (2 * columns),
                columns,
                box_rows,
            )
        })
    }

    /// The position of `arg`'s map in `maps`, which `encode` makes the first time.
    fn position_or_encode(
        &mut self,
        arg: LaunchArg,
        encode: impl FnOnce(&Self) -> Result<TensorMap, LayerError>,
    ) -> Result<usize, LayerError> {
        if let Some(position) = self.maps.iter().position(|(a, _)| *a == arg) {
            return Ok(position);
        }
        let map = encode(self)?;
        self.maps.push((arg, map));
        Ok(self.maps.len() - 1)
    }
}

impl MoeLayer {
    /// Builds the handle: validates the plan and checks it was made for this device, finds
    /// every kernel the plan launches in `module`, raises their shared-memory limits,
    /// checks the weights' sizes and allocates the workspace.
    ///
    /// Without gate weights the layer runs caller-routed calls only ([`MoeLayer::forward`]).
    pub fn new(
        gpu: &Gpu,
        plan: Plan,
        module: LoadedKernels,
        weights: ExpertWeights,
    ) -> Result<Self, LayerError> {
        Self::with_gate(gpu, plan, module, weights, None)
    }

    /// [`MoeLayer::new`] with the router's gate weights, so that the layer can also route
    /// itself ([`MoeLayer::forward_routed`]); the plan must have a router and `gate` its
    /// weight and (exactly when the rule says) bias.
    pub fn with_gate(
        gpu: &Gpu,
        plan: Plan,
        module: LoadedKernels,
        weights: ExpertWeights,
        gate: Option<GateWeights>,
    ) -> Result<Self, LayerError> {
        plan.validate()?;
        gpu.check_target(&plan.target)?;
        let early_starts = early_starts_from(crate::env_value)?;
        let early_kernels = plan
            .single_gpu_entry_points()
            .into_iter()
            .filter(|kernel| {
                LaunchKind::of(&plan, kernel).is_some_and(|kind| early_starts.keeps(kind))
            })
            .collect();
        let fused_decode = fused_decode_from(crate::env_value)?;
        let block_routing = block_routing_from(crate::env_value)?;
        let call_graphs_on = call_graphs_from(crate::env_value)?;
        // Not tried on the legacy default stream (a null handle), which synchronises
        // implicitly with the context's other blocking streams: calls there run as before.
        let legacy_stream = gpu.stream.cu_stream().is_null();
        let call_graphs = CallGraphs::new(
            &gpu.stream,
            if call_graphs_on && !legacy_stream {
                plan.call_graph_max_tokens
            } else {
                0
            },
        )?;
        let shape = &plan.shape;
        // The shared slices are experts of the grouped GEMMs too, after the routed ones.
        weights.check(shape, shape.gemm_experts())?;
        if let Some(gate) = &gate {
            let router = plan.router.as_ref().ok_or(LayerError::NoRouter)?;
            gate.check(shape, router)?;
        }

        let mut workspace = Vec::new();
        for buffer in &plan.workspace {
            let bytes = buffer.bytes() as usize;
            let slice = gpu.stream.alloc_zeros::<u8>(bytes.max(1)).context(format!(
                "allocating workspace `{}` ({bytes} bytes)",
                buffer.id.name()
            ))?;
            workspace.push((buffer.id, slice));
        }

        // Each distinct entry point is loaded (and its shared-memory limit raised) once.
        let mut loaded: Vec<(String, CudaFunction)> = Vec::new();
        let mut tensor_maps = WeightTensorMaps {
            shape,
            experts: shape.gemm_experts(),
            weights: &weights,
            gate_weight: gate.as_ref().map(|gate| &gate.weight),
            stream: &gpu.stream,
            maps: Vec::new(),
        };
        let mut bind_table = |launches: &[Launch]| -> Result<Vec<BoundLaunch>, LayerError> {
            launches
                .iter()
                .map(|launch| {
                    let bindings = launch
                        .params
                        .iter()
                        .map(|param| bind(param.arg, &workspace, &mut tensor_maps))
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok((load_kernel(&module, &mut loaded, launch)?, bindings))
                })
                .collect()
        };
        let regime_kernels = plan
            .regimes
            .iter()
            .map(|regime| bind_table(&regime.all_launches().cloned().collect::<Vec<_>>()))
            .collect::<Result<Vec<_>, _>>()?;
        // The router's kernels are loaded only when the layer can run them.
        let router_kernels = match (&plan.router, &gate) {
            (Some(router), Some(_)) => router
                .regimes
                .iter()
                .map(|regime| bind_table(&regime.launches))
                .collect::<Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        let tensor_maps = tensor_maps.maps;
        Ok(MoeLayer {
            plan,
            stream: gpu.stream.clone(),
            regime_kernels,
            router_kernels,
            workspace,
            weights,
            gate,
            tensor_maps,
            early_starts,
            early_kernels,
            fused_decode,
            block_routing,
            call_graphs,
            _module: module,
        })
    }

    /// Whether the calls the plan routes in the GEMMs' blocks do so (unless
    /// `MOEFORGE_BLOCK_ROUTING=0`, which runs their route launch instead).
    pub fn routes_in_blocks(&self) -> bool {
        self.block_routing
    }

    /// Whether a call of `tokens` tokens runs the plan's fused decode (unless
    /// `MOEFORGE_FUSED_DECODE=0`) rather than its regime's table.
    pub fn runs_fused(&self, tokens: u32) -> bool {
        self.fused_decode
            && self
                .plan
                .regime_for(tokens)
                .and_then(|regime| regime.fused_decode.as_ref())
                .is_some_and(|fused| fused.covers(tokens))
    }

    /// CUDA graphs of repeated calls the layer keeps now ([`Plan::call_graph_max_tokens`]).
    pub fn kept_call_graphs(&self) -> usize {
        self.call_graphs.kept()
    }

    /// Why capturing a repeated call into a CUDA graph failed, if it did: the layer then
    /// runs every call's launches, as with `MOEFORGE_CALL_GRAPHS=0` (the graphs it holds
    /// still replay). The calls themselves ran.
    pub fn call_graph_failure(&self) -> Option<String> {
        self.call_graphs.failure()
    }

    /// Whether the layer replays repeated calls of up to the plan's
    /// [`Plan::call_graph_max_tokens`] tokens as CUDA graphs: unless
    /// `MOEFORGE_CALL_GRAPHS=0`, the plan's bound is 0, or the layer launches on the legacy
    /// default stream (not tried there).
    pub fn replays_call_graphs(&self) -> bool {
        self.call_graphs.max_tokens() > 0
    }

    /// Which of the launches the plan marks `early_start` start early
    /// (`MOEFORGE_EARLY_START`).
    pub fn early_starts(&self) -> &EarlyStarts {
        &self.early_starts
    }

    /// Whether the layer can route its tokens itself: its spec has a router and it was
    /// built with the gate weights.
    pub fn routes_itself(&self) -> bool {
        !self.router_kernels.is_empty()
    }

    pub fn gate(&self) -> Option<&GateWeights> {
        self.gate.as_ref()
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn weights(&self) -> &ExpertWeights {
        &self.weights
    }

    /// Enqueues one forward call on the layer's stream, with the caller's expert choices.
    /// Does not synchronise.
    pub fn forward(&self, args: ForwardArgs<'_>) -> Result<(), LayerError> {
        let routing = Routing::Caller {
            topk_ids: args.topk_ids,
            topk_weights: args.topk_weights,
        };
        self.enqueue(args.tokens, args.x, args.y, routing, CallPart::Whole)
    }

    /// Enqueues one forward call that routes itself: the router's launches choose each
    /// token's experts and weights from `x` (into the workspace's `routed_ids` and
    /// `routed_weights`, [`MoeLayer::workspace_buffer`]), a fused router lays out the
    /// routing metadata too, then the regime's table runs on them; a call the fused decode
    /// covers runs it instead, and the fused router leaves the metadata to it. Does not
    /// synchronise.
    pub fn forward_routed(&self, args: RoutedForwardArgs<'_>) -> Result<(), LayerError> {
        if self.plan.router.is_none() {
            return Err(LayerError::NoRouter);
        }
        if !self.routes_itself() {
            return Err(LayerError::NoGateWeights);
        }
        self.enqueue(
            args.tokens,
            args.x,
            args.y,
            Routing::Router,
            CallPart::Whole,
        )
    }

    /// Enqueues only the plan's routing launches for a call ([`Plan::is_route_kernel`]):
    /// expert offsets and the expert-major row order land in the workspace
    /// ([`MoeLayer::workspace_buffer`]), also for the calls a forward call routes in the
    /// GEMMs' blocks instead. What an unfused pipeline shares with moeforge.
    pub fn route(&self, args: ForwardArgs<'_>) -> Result<(), LayerError> {
        let routing = Routing::Caller {
            topk_ids: args.topk_ids,
            topk_weights: args.topk_weights,
        };
        self.enqueue(args.tokens, args.x, args.y, routing, CallPart::RoutingOnly)
    }

    /// The workspace buffer `id` on the device (bytes; the plan gives its element type).
    pub fn workspace_buffer(&self, id: BufferId) -> Option<&CudaSlice<u8>> {
        self.workspace
            .iter()
            .find(|(b, _)| *b == id)
            .map(|(_, s)| s)
    }

    /// Enqueues the launches of `part` of the call's regime, in the table's order; a
    /// self-routed call runs the router's launches first, a fused router in place of the
    /// route launch. A whole call that the regime routes in the GEMMs' blocks
    /// ([`Regime::routes_in_blocks`]) runs no route launch. A whole call of few tokens that
    /// repeats replays a CUDA graph of these launches instead (`call_graphs`).
    fn enqueue(
        &self,
        tokens: u32,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<u16>,
        routing: Routing<'_>,
        part: CallPart,
    ) -> Result<(), LayerError> {
        let shape = &self.plan.shape;
        if tokens > shape.max_tokens {
            return Err(LayerError::TooManyTokens {
                tokens,
                max: shape.max_tokens,
            });
        }
        let t = u64::from(tokens);
        check_len("x", x.len(), t * u64::from(shape.hidden))?;
        check_len("y", y.len(), t * u64::from(shape.hidden))?;
        let stream = &self.stream;
        let (topk_ids, topk_weights) = match routing {
            Routing::Caller {
                topk_ids,
                topk_weights,
            } => {
                let pairs = t * u64::from(shape.top_k);
                check_len("topk_ids", topk_ids.len(), pairs)?;
                check_len("topk_weights", topk_weights.len(), pairs)?;
                (ptr(topk_ids, stream), ptr(topk_weights, stream))
            }
            Routing::Router => {
                let routed = |id: BufferId| {
                    self.workspace_buffer(id)
                        .map(|buffer| ptr(buffer, stream))
                        .ok_or(LayerError::MissingWorkspace { buffer: id.name() })
                };
                (
                    routed(BufferId::RoutedIds)?,
                    routed(BufferId::RoutedWeights)?,
                )
            }
        };
        let index = self
            .plan
            .regime_index_for(tokens)
            .ok_or(LayerError::TooManyTokens {
                tokens,
                max: shape.max_tokens,
            })?;
        let call = CallValues {
            tokens,
            routes_in_blocks: false,
            lays_out_routing: false,
            x: ptr(x, stream),
            y: ptr(y, stream),
            topk_ids,
            topk_weights,
        };
        let self_routed = matches!(routing, Routing::Router);
        let launches = |on: &CudaStream| self.launch_call(on, index, call, self_routed, part);
        if part == CallPart::RoutingOnly {
            return launches(stream);
        }
        let key = CallKey {
            tokens,
            x: call.x,
            y: call.y,
            topk_ids: call.topk_ids,
            topk_weights: call.topk_weights,
            self_routed,
        };
        self.call_graphs.run(stream, key, launches)
    }

    /// Enqueues `part` of a call of regime `index` on `on` (the layer's stream, or the
    /// stream a graph of the call is captured from) as [`MoeLayer::enqueue`] describes.
    fn launch_call(
        &self,
        on: &CudaStream,
        index: usize,
        mut call: CallValues,
        self_routed: bool,
        part: CallPart,
    ) -> Result<(), LayerError> {
        let shape = &self.plan.shape;
        let tokens = call.tokens;
        let regime = &self.plan.regimes[index];

        // A fused router lays out the routing metadata and clears the error word as the
        // route kernel does, except for calls the fused decode or the GEMMs' blocks route
        // (`Regime::router_metadata_left_out_max_tokens`), which do both. At T = 0 its
        // grid is empty and the route kernel (or the fused decode, or GEMM1's blocks)
        // runs instead, so that a stale error of an earlier call is not reported.
        if self_routed
            && tokens > 0
            && let (Some(router), Some(kernels)) =
                (&self.plan.router, self.router_kernels.get(index))
        {
            let regime = &router.regimes[index];
            // Where a fused router leaves the metadata out, the table's route launch runs
            // if the table runs and does not route the call in the GEMMs' blocks.
            let left_out =
                self.plan.regimes[index].router_metadata_left_out_max_tokens(shape.top_k);
            call.lays_out_routing = regime.fused && tokens > left_out;
            for launch in regime.launches_for(tokens) {
                self.launch(on, &regime.launches[launch], &kernels[launch], &call)?;
            }
        }
        // The bound launches are the table's, then the fused decode's.
        let bound = &self.regime_kernels[index];
        if part == CallPart::Whole
            && self.fused_decode
            && let Some(fused) = regime.fused_decode.as_ref().filter(|f| f.covers(tokens))
        {
            return self.launch(on, &fused.launch, &bound[regime.launches.len()], &call);
        }
        // A call of few pairs leaves its route launch out and the GEMMs' blocks route it
        // (a fused router has left the metadata out for it).
        call.routes_in_blocks = part == CallPart::Whole
            && self.block_routing
            && !call.lays_out_routing
            && regime.routes_in_blocks(tokens, shape.top_k);
        for (launch, bound) in regime.launches.iter().zip(bound) {
            let is_route = self.plan.is_route_kernel(&launch.kernel);
            let replaced = call.lays_out_routing && launch.kernel == self.plan.route_kernel;
            let left_out = is_route && call.routes_in_blocks;
            let wanted = match part {
                CallPart::Whole => !replaced && !left_out,
                CallPart::RoutingOnly => is_route,
            };
            if wanted {
                self.launch(on, launch, bound, &call)?;
            }
        }
        Ok(())
    }

    /// Enqueues one launch with the call's values on `on`; a launch whose grid is empty
    /// (blocks per token at T = 0) is skipped.
    fn launch(
        &self,
        on: &CudaStream,
        launch: &Launch,
        (function, bindings): &BoundLaunch,
        call: &CallValues,
    ) -> Result<(), LayerError> {
        let blocks = launch.grid.blocks(call.tokens);
        if blocks == 0 {
            return Ok(());
        }
        let stream = &self.stream;
        let values: Vec<ArgValue> = bindings
            .iter()
            .map(|binding| match *binding {
                Binding::X => ArgValue::Pointer(call.x),
                Binding::TopkIds => ArgValue::Pointer(call.topk_ids),
                Binding::TopkWeights => ArgValue::Pointer(call.topk_weights),
                Binding::W1 => ArgValue::Pointer(ptr(&self.weights.w1, stream)),
                Binding::W2 => ArgValue::Pointer(ptr(&self.weights.w2, stream)),
                // `new` checked that the weights hold biases exactly when the plan's
                // launches take them.
                Binding::W1Bias => ArgValue::Pointer(self.weights.bias_pointer(true, stream)),
                Binding::W2Bias => ArgValue::Pointer(self.weights.bias_pointer(false, stream)),
                Binding::SharedExpertGate => {
                    ArgValue::Pointer(self.weights.shared_gate_pointer(stream))
                }
                // Router launches are bound only when the gate (and a bias the rule
                // takes) was given: `with_gate` checked both.
                Binding::GateWeight => {
                    ArgValue::Pointer(self.gate.as_ref().map_or(0, |g| ptr(&g.weight, stream)))
                }
                Binding::GateBias => ArgValue::Pointer(
                    self.gate
                        .as_ref()
                        .and_then(|g| g.bias.as_ref())
                        .map_or(0, |b| ptr(b, stream)),
                ),
                Binding::Y => ArgValue::Pointer(call.y),
                Binding::Tokens => ArgValue::Int(call.tokens as i32),
                Binding::RoutesInBlocks => ArgValue::Int(i32::from(call.routes_in_blocks)),
                Binding::LaysOutRouting => ArgValue::Int(i32::from(call.lays_out_routing)),
                Binding::Workspace(i) => ArgValue::Pointer(ptr(&self.workspace[i].1, stream)),
                Binding::TensorMap(i) => ArgValue::TensorMap(self.tensor_maps[i].1),
            })
            .collect();
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (launch.block_threads, 1, 1),
            shared_mem_bytes: launch.smem_bytes,
        };
        // SAFETY: codegen wrote this kernel's parameter list from `launch.params` (its
        // types from `LaunchArg::param_type`: a pointer per buffer, an i32 for tokens, a
        // tensor map by value over weights or a workspace buffer this layer owns), and the
        // AOT loader checks the PTX entry against the same list; `new` validated the plan
        // and checked the weights and gate, and `enqueue` checked every buffer of the call
        // to hold what the kernel indexes (the routed ids and weights are workspace buffers
        // of `max_tokens` rows).
        unsafe {
            launch_with(
                on,
                function,
                config,
                &values,
                launch.early_start
                    && (self.early_starts == EarlyStarts::All
                        || self.early_kernels.contains(&launch.kernel)),
            )
        }
        .context(format!("launching `{}`", launch.kernel))?;
        Ok(())
    }

    /// Waits for the stream, then reads and clears the error word of the last call.
    pub fn take_error(&self) -> Result<(), LayerError> {
        // A validated plan's workspace holds every buffer, the error word included.
        let Some(word) = self.workspace_buffer(BufferId::ErrorWord) else {
            return Ok(());
        };
        kernel_error(
            read_error_word(&self.stream, word)?,
            self.plan.shape.experts,
        )
    }
}

/// Which launches of a call [`MoeLayer::enqueue`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CallPart {
    /// The whole forward call.
    Whole,
    /// Only its routing launches ([`MoeLayer::route`]).
    RoutingOnly,
}

/// The device values of one call that launches read.
#[derive(Clone, Copy)]
struct CallValues {
    tokens: u32,
    /// Whether the call runs without its route launch, the GEMMs' blocks routing it.
    routes_in_blocks: bool,
    /// Whether its fused router lays out the routing metadata.
    lays_out_routing: bool,
    x: u64,
    y: u64,
    topk_ids: u64,
    topk_weights: u64,
}

/// The function of `launch`, loaded from `module` on first use (its shared-memory limit
/// raised), else the one `loaded` holds.
pub(crate) fn load_kernel(
    module: &LoadedKernels,
    loaded: &mut Vec<(String, CudaFunction)>,
    launch: &Launch,
) -> Result<CudaFunction, LayerError> {
    if let Some((_, function)) = loaded.iter().find(|(name, _)| *name == launch.kernel) {
        return Ok(function.clone());
    }
    let function = module
        .load_function(&launch.kernel)
        .map_err(|_| LayerError::MissingKernel {
            name: launch.kernel.clone(),
        })?;
    if launch.smem_bytes > 0 {
        function
            .set_attribute(
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                launch.smem_bytes as i32,
            )
            .context(format!(
                "raising the shared-memory limit of `{}`",
                launch.kernel
            ))?;
    }
    loaded.push((launch.kernel.clone(), function.clone()));
    Ok(function)
}

/// Waits for `stream` and reads an error word: code, then three details.
pub(crate) fn read_error_word(
    stream: &Arc<CudaStream>,
    word: &CudaSlice<u8>,
) -> Result<[i32; 4], LayerError> {
    let bytes = stream.clone_dtoh(word).context("reading the error word")?;
    let mut values = [0i32; 4];
    for (value, c) in values.iter_mut().zip(bytes.chunks_exact(4)) {
        *value = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(values)
}

/// A value of four little-endian bytes, as the kernels store `i32` and `f32` buffers.
pub(crate) trait FromLeWord {
    fn from_le_word(bytes: [u8; 4]) -> Self;
}
impl FromLeWord for i32 {
    fn from_le_word(bytes: [u8; 4]) -> Self {
        i32::from_le_bytes(bytes)
    }
}
impl FromLeWord for f32 {
    fn from_le_word(bytes: [u8; 4]) -> Self {
        f32::from_le_bytes(bytes)
    }
}

/// The first `count` four-byte values of the workspace buffer `buffer`, read on `stream`
/// (only those bytes cross to the host).
pub(crate) fn read_words<T: FromLeWord>(
    stream: &Arc<CudaStream>,
    buffer: &CudaSlice<u8>,
    count: usize,
) -> Result<Vec<T>, GpuError> {
    let wanted_bytes = count
        .checked_mul(4)
        .filter(|&bytes| bytes <= buffer.len())
        .ok_or(GpuError::ShortBuffer {
            wanted: count,
            bytes: buffer.len(),
        })?;
    let bytes = stream
        .clone_dtoh(&buffer.slice(..wanted_bytes))
        .context("reading back a workspace buffer")?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| T::from_le_word([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The typed error an error word holds (`Ok` for none), for a layer of `experts` experts.
pub(crate) fn kernel_error(word: [i32; 4], experts: u32) -> Result<(), LayerError> {
    let [code, a, b, c] = word;
    match code {
        0 => Ok(()),
        error_code::EXPERT_ID_OUT_OF_RANGE => Err(LayerError::ExpertIdOutOfRange {
            token: a,
            k: b,
            id: c,
            experts,
        }),
        error_code::EXPERT_ID_REPEATED => Err(LayerError::ExpertIdRepeated {
            token: a,
            k: b,
            id: c,
        }),
        error_code::FLAG_TIMEOUT => Err(LayerError::FlagTimeout {
            wait: FlagWait {
                rank: a,
                kind: flag_kind_name(b >> 24),
                index: b & 0xff_ffff,
                target: c as u32,
            },
            others: OtherWaits::default(),
        }),
        code => Err(LayerError::UnknownKernelError {
            code,
            details: [a, b, c],
        }),
    }
}

/// One bounded wait that ran out: which rank waited for which flag to reach what (an
/// epoch for flags and credits, a count for combine counters and for the fused decode's
/// GEMM1 tiles of an expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagWait {
    pub rank: i32,
    pub kind: &'static str,
    pub index: i32,
    pub target: u32,
}

impl std::fmt::Display for FlagWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} waited too long for the {} {} to reach {}",
            self.rank, self.kind, self.index, self.target
        )
    }
}

/// The further waits of one call that timed out, listed after the first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OtherWaits(pub Vec<FlagWait>);

impl std::fmt::Display for OtherWaits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for wait in &self.0 {
            write!(f, "; {wait}")?;
        }
        Ok(())
    }
}

/// The kernels' error beside a stalled network transfer, for its message.
fn kernel_note(kernel: Option<&LayerError>) -> String {
    match kernel {
        None => String::new(),
        // The wait alone: no exchange restarts after a stall.
        Some(LayerError::FlagTimeout { wait, others }) => format!("; meanwhile {wait}{others}"),
        Some(error) => format!("; meanwhile {error}"),
    }
}

fn flag_kind_name(kind: i32) -> &'static str {
    match kind {
        error_code::flag_kind::META => "metadata flag of source",
        error_code::flag_kind::CHUNK => "dispatch chunk flag",
        error_code::flag_kind::COMBINE => "combine counter of token",
        error_code::flag_kind::CREDIT => "credit of destination",
        error_code::flag_kind::RETURN => "node results (rail peer · chunks + token chunk)",
        error_code::flag_kind::NODE_PARTIALS => "node partials stored by rank",
        error_code::flag_kind::ARRIVED => {
            "rows arrived from rail peer (rail peer · chunks + token chunk)"
        }
        error_code::flag_kind::EXPERT_ROWS => "fused decode: GEMM1 rows of expert",
        _ => "unknown flag",
    }
}

/// What to pass for `arg`: a caller's buffer, the weights (or a tensor map over them), the
/// token count, or a workspace buffer (which must exist).
fn bind(
    arg: LaunchArg,
    workspace: &[(BufferId, CudaSlice<u8>)],
    tensor_maps: &mut WeightTensorMaps<'_>,
) -> Result<Binding, LayerError> {
    let slot = |id: BufferId| {
        workspace
            .iter()
            .position(|(b, _)| *b == id)
            .ok_or(LayerError::MissingWorkspace { buffer: id.name() })
    };
    Ok(match arg {
        LaunchArg::X => Binding::X,
        LaunchArg::TopkIds => Binding::TopkIds,
        LaunchArg::TopkWeights => Binding::TopkWeights,
        LaunchArg::W1 => Binding::W1,
        LaunchArg::W2 => Binding::W2,
        LaunchArg::W1Bias => Binding::W1Bias,
        LaunchArg::W2Bias => Binding::W2Bias,
        LaunchArg::SharedExpertGate => Binding::SharedExpertGate,
        LaunchArg::GateWeight => Binding::GateWeight,
        LaunchArg::GateBias => Binding::GateBias,
        LaunchArg::Y => Binding::Y,
        LaunchArg::Tokens => Binding::Tokens,
        LaunchArg::RoutesInBlocks => Binding::RoutesInBlocks,
        LaunchArg::LaysOutRouting => Binding::LaysOutRouting,
        LaunchArg::Rank | LaunchArg::Epoch => {
            return Err(LayerError::MultiRankArg { arg: arg.name() });
        }
        LaunchArg::W1Tiles { .. }
        | LaunchArg::W2Tiles { .. }
        | LaunchArg::GateWeightTiles { .. } => Binding::TensorMap(tensor_maps.position(arg)?),
        LaunchArg::IntermediateTiles { .. } => {
            let memory = &workspace[slot(BufferId::Intermediate)?].1;
            Binding::TensorMap(tensor_maps.position_over_rows(arg, memory)?)
        }
        LaunchArg::SortedXTiles { .. } => {
            let memory = &workspace[slot(BufferId::SortedX)?].1;
            Binding::TensorMap(tensor_maps.position_over_rows(arg, memory)?)
        }
        LaunchArg::Workspace(id) => Binding::Workspace(slot(id)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    type SwitchFrom = fn(&dyn Fn(&str) -> Option<String>) -> Result<bool, LayerError>;

    /// `MOEFORGE_FUSED_DECODE` and `MOEFORGE_BLOCK_ROUTING`: on unless the variable says 0.
    #[test]
    fn switches_are_on_unless_their_variable_says_0() {
        let switches: [(&str, SwitchFrom); 2] = [
            ("MOEFORGE_FUSED_DECODE", |lookup| fused_decode_from(lookup)),
            ("MOEFORGE_BLOCK_ROUTING", |lookup| {
                block_routing_from(lookup)
            }),
        ];
        for (var, switch) in switches {
            let with = |value: Option<&str>| {
                switch(&|name| {
                    assert_eq!(name, var);
                    value.map(str::to_string)
                })
            };
            assert!(with(None).expect("unset"));
            assert!(with(Some("")).expect("empty"));
            assert!(with(Some("1")).expect("1"));
            assert!(!with(Some("0")).expect("0"));
            assert!(matches!(
                with(Some("off")),
                Err(LayerError::InvalidEnv { var: v, .. }) if v == var
            ));
        }
    }

    /// `MOEFORGE_EARLY_START`: all, none, or the named kinds (each once, in the order
    /// given); anything else is an error naming the kinds.
    #[test]
    fn early_starts_are_all_none_or_the_kinds_named() {
        let with = |value: Option<&str>| {
            early_starts_from(|name| {
                assert_eq!(name, "MOEFORGE_EARLY_START");
                value.map(str::to_string)
            })
        };
        for all in [None, Some(""), Some("1")] {
            assert_eq!(with(all).expect("all"), EarlyStarts::All);
        }
        assert_eq!(with(Some("0")).expect("none"), EarlyStarts::None);
        let only = with(Some("gemm2, combine,gemm2")).expect("a list");
        assert_eq!(
            only,
            EarlyStarts::Only(vec![LaunchKind::Gemm2, LaunchKind::Combine])
        );
        assert!(only.keeps(LaunchKind::Combine) && !only.keeps(LaunchKind::Gemm1));
        assert_eq!(only.describe(), "gemm2,combine");
        for bad in ["off", "gemm3", "gemm1,", "0,gemm1"] {
            assert!(
                matches!(
                    with(Some(bad)),
                    Err(LayerError::InvalidEnv { expected, .. }) if expected.contains("router")
                ),
                "{bad}"
            );
        }
    }

    /// Every launch of a layer with a router on one GPU has a kind `MOEFORGE_EARLY_START`
    /// can name, the table's, the router's and the fused decodes' alike.
    #[test]
    fn every_single_gpu_launch_has_a_kind() {
        for example in ["deepseek_v3", "gpt_oss_120b", "qwen3_30b_a3b"] {
            let path = format!(
                "{}/../dsl-examples/{example}.moe",
                env!("CARGO_MANIFEST_DIR")
            );
            let text = std::fs::read_to_string(&path).expect("a shipped example");
            let module = moeforge_compiler::compile_source(&path, &text).expect("checks");
            let plan = moeforge_compiler::plan::plan(
                &module.layers[0],
                &moeforge_compiler::plan::Target::h200(),
            )
            .expect("plans");
            let kinds: Vec<LaunchKind> = plan
                .single_gpu_entry_points()
                .iter()
                .map(|kernel| {
                    LaunchKind::of(&plan, kernel)
                        .unwrap_or_else(|| panic!("{example}: `{kernel}` has no kind"))
                })
                .collect();
            for kind in [
                LaunchKind::Router,
                LaunchKind::Gemm1,
                LaunchKind::Gemm2,
                LaunchKind::Combine,
            ] {
                assert!(kinds.contains(&kind), "{example}: no {kind:?} launch");
            }
        }
    }

    #[test]
    fn error_words_become_typed_errors_naming_the_pair() {
        assert!(kernel_error([0; 4], 8).is_ok());
        let out_of_range = kernel_error([error_code::EXPERT_ID_OUT_OF_RANGE, 5, 1, 9], 8);
        assert!(matches!(
            out_of_range,
            Err(LayerError::ExpertIdOutOfRange {
                token: 5,
                k: 1,
                id: 9,
                experts: 8
            })
        ));
        let repeated = kernel_error([error_code::EXPERT_ID_REPEATED, 3, 2, 4], 8);
        let Err(
            error @ LayerError::ExpertIdRepeated {
                token: 3,
                k: 2,
                id: 4,
            },
        ) = repeated
        else {
            panic!("a repeated id is its own error: {repeated:?}");
        };
        assert!(error.to_string().contains("topk_ids[3, 2] = 4 repeats"));
    }
}
