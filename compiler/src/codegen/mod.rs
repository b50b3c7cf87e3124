//! Codegen: writes a [`Plan`] out as one self-contained CUDA C++ unit (askama templates in
//! `compiler/templates/`).
//!
//! Architecture invariant: the generated source is a pure function of the plan. It makes
//! no decision of its own (every size, tile and entry-point name comes from the plan), it
//! includes no toolkit header, and its output is byte-for-byte stable, so that
//! `kernels-generated/` diffs are reviewable.

mod kernel_unit;

use std::collections::BTreeMap;

use askama::Template;
use thiserror::Error;

pub use kernel_unit::{kernel_guard, kernel_unit_source};

use crate::ir::{Activation, CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT, RouterBias, Scoring};
use crate::plan::ep::{
    COMBINE_LANES, COMM_THREADS, CombineRoute, ExpertParallelPlan, FlagScope, META_THREADS,
    PARTIALS_PER_RELEASE, Placement,
};
use crate::plan::network::NetworkPlan;
use crate::plan::router::{self, GateEngine, GatePlan, RouterPlan};
use crate::plan::{
    Access, BufferId, FusedDecode, GemmPlan, Grid, INVERT_ROWS_THREADS, Launch, LaunchArg,
    MmaEngine, OutputStore, ParamType, Plan, ROUTE_THREADS, Regime, RegimeParts, RowLoad,
    SHARED_GATE_TOKENS_PER_BLOCK, SMEM_ROW_BYTES, SORT_ROWS_THREADS, STATIC_SMEM_GRANULE,
    SmemLayout, TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES, error_code,
};

/// The generated CUDA unit of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// File name for the unit, `<layer>.cu`.
    pub file_name: String,
    pub source: String,
    /// `extern "C"` entry points, in the order they appear in the plan.
    pub entry_points: Vec<String>,
}

#[derive(Debug, Error)]
pub enum CodegenError {
    #[error("template rendering failed: {0}")]
    Template(#[from] askama::Error),
    #[error("the plan launches no kernel `{kernel}`; the plan is inconsistent")]
    MissingLaunch { kernel: String },
    #[error("the plan launches `{kernel}` on {grid}, a grid its template does not index")]
    UnexpectedGrid { kernel: String, grid: String },
    #[error(
        "the plan gives `{kernel}` the parameters ({plan}), but its template body uses ({template}); the plan and the templates disagree"
    )]
    SignatureMismatch {
        kernel: String,
        plan: String,
        template: String,
    },
}

#[derive(Template)]
#[template(path = "layer.cu")]
struct LayerUnit<'a> {
    layer: &'a str,
    arch: &'a str,
    target: &'a str,
    /// The plan's hints not followed, then its limitations: a note each.
    notes: Vec<&'a str>,
    hidden: u32,
    ffn: u32,
    experts: u32,
    top_k: u32,
    shared_slices: u32,
    smem_row_bytes: u32,
    static_smem_granule: u32,
    /// The largest calls, in (token, k) pairs, that a regime runs without its route launch
    /// (0: none).
    block_routing_max_pairs: u32,
    /// The routing entries the regimes launch: one block, or count then place.
    route: Option<EntryUnit>,
    route_count: Option<EntryUnit>,
    route_place: Option<EntryUnit>,
    route_threads: u32,
    /// A rank's shared expert gate launch, where the layer's shared expert is gated.
    shared_gate: Option<EntryUnit>,
    shared_gate_tokens_per_block: u32,
    shared_gated: bool,
    combine: EntryUnit,
    /// The kernels inverting the row order and copying x's rows into it, where a regime
    /// launches them.
    invert_rows: Option<EntryUnit>,
    invert_rows_threads: u32,
    sort_rows: Option<EntryUnit>,
    sort_rows_threads: u32,
    /// Blocks over which the combine spreads one token's row (its launch's grid).
    combine_blocks_per_token: u32,
    error_expert_id: i32,
    error_expert_repeated: i32,
    activation: &'static str,
    activation_fn: String,
    regimes: Vec<RegimeUnit>,
    router: Option<RouterUnit>,
    ep: Option<EpUnit>,
    flag_scope: &'static str,
    spin_limit_cycles: u64,
    error_flag_timeout: i32,
    flag_kind_meta: i32,
    flag_kind_chunk: i32,
    flag_kind_combine: i32,
    flag_kind_credit: i32,
    flag_kind_return: i32,
    flag_kind_expert_rows: i32,
    flag_kind_node_partials: i32,
    flag_kind_arrived: i32,
    /// Whether any regime runs its smallest calls as one fused kernel.
    fused_decode: bool,
    /// Distinct wgmma widths the plan uses (a stage's B rows: one wgmma spans them),
    /// ascending, each guarded by the entry points that use it.
    wgmma_widths: Vec<WgmmaWidth>,
    /// Whether any GEMM runs on the warp-specialised engine.
    warp_specialized: bool,
    tensor_map_bytes: u32,
    tensor_map_align: u32,
}

/// A wgmma width the unit instantiates, and the guard of the entry points that use it.
struct WgmmaWidth {
    n: u32,
    guard: String,
}

impl LayerUnit<'_> {
    /// The guard of the sorted-rows section's constants: its two kernels'.
    fn sort_rows_guard(&self) -> String {
        let kernels: Vec<&str> = [&self.invert_rows, &self.sort_rows]
            .into_iter()
            .flatten()
            .map(|entry| entry.name.as_str())
            .collect();
        kernel_guard(&kernels)
    }

    /// `%0, %1, …` for the accumulator operands of one `wgmma` of width `n`.
    fn wgmma_operands(&self, n: &u32) -> String {
        (0..n / 2)
            .map(|i| format!("%{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `"+f"(d[0]), …` for the same operands.
    fn wgmma_outputs(&self, n: &u32) -> String {
        (0..n / 2)
            .map(|i| format!("\"+f\"(d[{i}])"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An `extern "C"` entry point: its name, its parameter list written from the plan's
/// launch, and the launch's block size and static shared memory.
struct EntryUnit {
    name: String,
    params: String,
    threads: u32,
    static_smem: u32,
    /// Whether a launch of it may start before the kernel ahead of it ends: its body then
    /// waits for that kernel before it reads what that kernel writes
    /// (`start_after_previous_kernel`, or `wait_for_previous_kernel` where it lets the
    /// kernel behind it start only later).
    early_start: bool,
}

/// The blocks per token of the single-GPU combine, as its launches give them: one token's
/// row over `n` blocks (`Grid::TokenTiles` of one token), the only grid its body indexes.
fn combine_blocks_per_token(plan: &Plan) -> Result<u32, CodegenError> {
    let kernel = &plan.combine_kernel;
    let mut grids = plan
        .launches()
        .filter(|l| &l.kernel == kernel)
        .map(|l| l.grid);
    let first = grids.next().ok_or_else(|| CodegenError::MissingLaunch {
        kernel: kernel.clone(),
    })?;
    let unexpected = |grid: Grid| CodegenError::UnexpectedGrid {
        kernel: kernel.clone(),
        grid: format!("{grid:?}"),
    };
    let Grid::TokenTiles {
        tokens_per_tile: 1,
        blocks_per_tile,
    } = first
    else {
        return Err(unexpected(first));
    };
    match grids.find(|&g| g != first) {
        Some(other) => Err(unexpected(other)),
        None => Ok(blocks_per_tile),
    }
}

/// The parameters each template body refers to by name, per kernel role. Codegen refuses a
/// plan whose launch gives a kernel other parameters, so that a plan and the templates can
/// never silently disagree about a signature.
const ROUTE_USES: &[&str] = &[
    "topk_ids",
    "tokens",
    "expert_offsets",
    "row_pair",
    "error_word",
];
const ROUTE_COUNT_USES: &[&str] = &["topk_ids", "tokens", "route_block_counts", "error_word"];
const ROUTE_PLACE_USES: &[&str] = &[
    "topk_ids",
    "tokens",
    "route_block_counts",
    "expert_offsets",
    "row_pair",
    "error_word",
];
const GEMM_UP_USES: &[&str] = &["x", "w1", "expert_offsets", "row_pair", "intermediate"];
const INVERT_ROWS_USES: &[&str] = &["expert_offsets", "row_pair", "pair_row"];
const SORT_ROWS_USES: &[&str] = &["x", "expert_offsets", "row_pair", "pair_row", "sorted_x"];
const GEMM_DOWN_USES: &[&str] = &[
    "intermediate",
    "w2",
    "topk_weights",
    "expert_offsets",
    "row_pair",
    "combine_slots",
];
const COMBINE_USES: &[&str] = &["combine_slots", "topk_ids", "y"];
const ROUTER_USES: &[&str] = &[
    "x",
    "gate_weight",
    "tokens",
    "router_logits",
    "router_tiles_done",
    "routed_ids",
    "routed_weights",
];
/// What a fused router uses beside ROUTER_USES: the routing metadata's buffers.
const ROUTER_ROUTING_USES: &[&str] = &[
    "lays_out_routing",
    "expert_offsets",
    "row_pair",
    "error_word",
];
/// What a router or select entry whose rule has a bias uses beside its list.
const ROUTER_BIAS_USES: &[&str] = &["gate_bias"];
const ROUTER_GATE_USES: &[&str] = &[
    "x",
    "gate_weight",
    "tokens",
    "router_logits",
    "router_tiles_done",
];
/// A warp-specialised gate's: W_gate through its tensor map.
const ROUTER_GATE_WS_USES: &[&str] = &[
    "x",
    "gate_weight_tiles",
    "tokens",
    "router_logits",
    "router_tiles_done",
];
/// What a cluster gate, which selects, uses (beside the bias where the rule has one).
const ROUTER_GATE_CLUSTER_USES: &[&str] = &[
    "x",
    "gate_weight",
    "tokens",
    "router_logits",
    "routed_ids",
    "routed_weights",
];
const ROUTER_SELECT_USES: &[&str] = &["router_logits", "tokens", "routed_ids", "routed_weights"];
const EP_ROUTE_USES: &[&str] = &[
    "topk_ids",
    "topk_weights",
    "tokens",
    "rank",
    "epoch",
    "send_slots",
    "send_counts",
    "peer_table",
    "error_word",
    "credits",
    "metadata_counters",
];
const EP_DISPATCH_USES: &[&str] = &[
    "x",
    "rank",
    "epoch",
    "send_slots",
    "send_counts",
    "chunk_pieces",
    "peer_table",
];
const EP_ARRANGE_USES: &[&str] = &[
    "tokens",
    "rank",
    "epoch",
    "recv_slot",
    "recv_pair",
    "recv_weight",
    "recv_counts",
    "meta_flags",
    "send_slots",
    "segment_offsets",
    "segment_rows",
    "segment_pairs",
    "segment_weights",
    "row_origins",
    "arrange_blocks_done",
    "error_word",
    "peer_table",
];
const EP_GEMM_UP_USES: &[&str] = &[
    "recv_x",
    "x",
    "w1",
    "segment_offsets",
    "segment_rows",
    "chunk_flags",
    "rank",
    "epoch",
    "error_word",
    "intermediate",
];
const EP_GEMM_DOWN_USES: &[&str] = &[
    "intermediate",
    "w2",
    "segment_offsets",
    "segment_pairs",
    "segment_weights",
    "row_origins",
    "peer_table",
    "rank",
    "error_word",
];
const EP_COMBINE_USES: &[&str] = &[
    "topk_ids",
    "tokens",
    "rank",
    "epoch",
    "combine_slots",
    "combine_counters",
    "error_word",
    "y",
];
/// What the expert-parallel kernels use besides, when ranks live on several nodes.
const EP_ROUTE_NETWORK_USES: &[&str] = &[
    "net_send_slot",
    "net_send_pair",
    "net_send_weight",
    "net_send_counts",
    "net_send_mask",
    "net_send_rows",
    "net_ready",
];
const EP_DISPATCH_NETWORK_USES: &[&str] = &[
    "tokens",
    "net_send_mask",
    "net_send_x",
    "net_send_row",
    "net_ready",
    "meta_flags",
    "recv_counts",
    "recv_mask",
    "net_recv_x",
    "net_recv_row",
    "net_arrived",
    "error_word",
];
const EP_COMBINE_NETWORK_USES: &[&str] = &[
    "net_return_x",
    "net_recv_row",
    "net_send_row",
    "net_returned_x",
    "net_return_flags",
    "net_partials_ready",
    "recv_mask",
    "node_partials",
    "node_partials_ready",
];
/// What GEMM2 uses where results return as rank partials: its rows stay here.
const EP_GEMM_DOWN_PARTIALS_USES: &[&str] = &[
    "intermediate",
    "w2",
    "segment_offsets",
    "segment_pairs",
    "segment_weights",
    "rank",
    "error_word",
    "pair_results",
];
/// What computing the shared expert gate's weights uses: a rank's gate launch, and one
/// GPU's GEMM1 besides its own uses.
const SHARED_GATE_USES: &[&str] = &["x", "shared_expert_gate", "tokens", "shared_gate"];
/// What a rank's arrange uses besides where the shared expert is gated (one GPU's GEMM2
/// takes it as `GemmUnit::new` says).
const SHARED_GATE_READERS_USES: &[&str] = &["shared_gate"];
/// What arrange and combine use besides, where results return as rank partials.
const EP_ARRANGE_PARTIALS_USES: &[&str] = &["received_pair_rows", "received_tokens"];
const EP_COMBINE_PARTIALS_USES: &[&str] = &[
    "pair_results",
    "received_pair_rows",
    "received_tokens",
    "segment_pairs",
    "peer_table",
];

/// A kernel's uses: `base`, then `extra` when `with_extra` (its network uses when the
/// plan has a network part, the bias uses when the router's rule has a bias).
fn uses_with(base: &[&'static str], extra: &[&'static str], with_extra: bool) -> Vec<&'static str> {
    let mut uses = base.to_vec();
    if with_extra {
        uses.extend_from_slice(extra);
    }
    uses
}

/// What one parameter holds, for the comment beside it.
fn param_comment(arg: LaunchArg) -> &'static str {
    match arg {
        LaunchArg::X => "[tokens, HIDDEN]",
        LaunchArg::TopkIds | LaunchArg::TopkWeights => "[tokens, TOP_K]",
        LaunchArg::W1 => "[experts here, W1 rows, HIDDEN]",
        LaunchArg::W2 => "[experts here, HIDDEN, FFN]",
        LaunchArg::W1Tiles { .. } => {
            "TMA map of w1: [experts here x W1 rows, HIDDEN], a tile's rows x 64 per box"
        }
        LaunchArg::W2Tiles { .. } => {
            "TMA map of w2: [experts here x HIDDEN, FFN], a tile's rows x 64 per box"
        }
        LaunchArg::IntermediateTiles { .. } => {
            "TMA map of intermediate: [rows, FFN], a tile's rows x 64 per box"
        }
        LaunchArg::SortedXTiles { .. } => {
            "TMA map of sorted_x: [rows, HIDDEN], a tile's rows x 64 per box"
        }
        LaunchArg::Y => "[tokens, HIDDEN]",
        LaunchArg::GateWeight => "[EXPERTS, HIDDEN]: the router's gate",
        LaunchArg::GateWeightTiles { .. } => {
            "TMA map of gate_weight: [EXPERTS, HIDDEN], a tile's experts x 64 per box"
        }
        LaunchArg::GateBias => "[EXPERTS]: the gate's bias",
        LaunchArg::W1Bias => "[EXPERTS, W1 rows]: each expert's GEMM1 bias",
        LaunchArg::W2Bias => "[EXPERTS, HIDDEN]: each expert's GEMM2 bias",
        LaunchArg::SharedExpertGate => "[HIDDEN]: the shared expert gate's weights",
        LaunchArg::Tokens => "tokens in this call",
        LaunchArg::RoutesInBlocks => "1: no route launch ran, each block routes this call",
        LaunchArg::LaysOutRouting => "1: lay out the routing metadata after the select",
        LaunchArg::Rank => "this rank",
        LaunchArg::Epoch => "this call's epoch",
        LaunchArg::Workspace(id) => match id {
            BufferId::ExpertOffsets => "[experts here + 1], workspace",
            BufferId::RowPair => {
                "[tokens * SLOTS_PER_TOKEN], workspace: each row's (token, k) pair"
            }
            BufferId::Intermediate => "[rows, FFN], workspace",
            BufferId::SortedX => "[rows, HIDDEN], workspace: x's rows in the expert-major order",
            BufferId::PairRow => {
                "[tokens * SLOTS_PER_TOKEN], workspace: each pair's row, the inverse of row_pair"
            }
            BufferId::CombineSlots => "[tokens, slots per token, HIDDEN]: see the plan's buffers",
            BufferId::ErrorWord => "[4]: code, then details",
            BufferId::SendSlots => "[RANKS, MAX_TOKENS]: token of each send slot",
            BufferId::SendCounts => "[RANKS]: tokens sent to each rank",
            BufferId::RecvX => "[RANKS * SLOTS, HIDDEN], written by peers",
            BufferId::RecvSlot | BufferId::RecvPair | BufferId::RecvWeight => {
                "[LOCAL_EXPERTS, RANKS, SEGMENT_ROWS], written by peers"
            }
            BufferId::RecvCounts => "[RANKS, LOCAL_EXPERTS + 1], written by peers",
            BufferId::MetaFlags => "[RANKS], written by peers",
            BufferId::ChunkFlags => "[RANKS, CHUNKS], written by peers",
            BufferId::ChunkPieces => "[RANKS, CHUNKS]: pieces of each chunk copied",
            BufferId::ArrangeBlocksDone => "[1]: arrange blocks done with the receive index",
            BufferId::SharedGate => "[tokens]: each token's shared-slice weight",
            BufferId::MetadataCounters => {
                "[EXPERTS + RANKS + 2]: rows and slots reserved, blocks done, errors cleared"
            }
            BufferId::RowOrigins => "[rows]: rank each row came from",
            BufferId::SegmentOffsets => {
                "[LOCAL_EXPERTS * RANKS + 1]: first row of each (expert, source) run"
            }
            BufferId::SegmentRows | BufferId::SegmentPairs | BufferId::SegmentWeights => "[rows]",
            BufferId::CombineCounters => "[MAX_TOKENS], written by peers",
            BufferId::PairResults => "[rows, HIDDEN]: GEMM2's weighted rows, kept here",
            BufferId::ReceivedPairRows => {
                "[RANKS * SLOTS + MAX_TOKENS, SLOTS_PER_TOKEN]: each received token's GEMM rows + 1"
            }
            BufferId::ReceivedTokens => "[RANKS]: tokens each source sent this call",
            BufferId::PeerTable => "[RANKS, PEER_BUFFERS]: peers' addresses",
            BufferId::Credits => "[RANKS], written by peers: epoch each has consumed",
            BufferId::RouterLogits => "[tokens, EXPERTS], workspace",
            BufferId::RouterTilesDone => "[1 + token tiles]: arrival counters, zero between calls",
            BufferId::StreamKPartials => "[2 * gridDim.x, BM * B_ROWS]: partial tiles, stream-K",
            BufferId::StreamKTilesDone => "[tiles]: stream-K arrival counters, zero between calls",
            BufferId::UnitTickets => "[2]: GEMM1's and GEMM2's next work unit, zero between calls",
            BufferId::FusedDecodeCounters => {
                "[2 * GEMM_EXPERTS + HIDDEN / BN + 2]: fused decode counters, zero between calls"
            }
            BufferId::RankFusedCounters => {
                "[2 * (LOCAL_EXPERTS + SHARED_SLICES) + 3]: a rank's fused decode counters, zero between calls"
            }
            BufferId::RoutedIds | BufferId::RoutedWeights => "[tokens, TOP_K], workspace",
            BufferId::RouteBlockCounts => "[gridDim.x, EXPERTS]: each block's pairs per expert",
            BufferId::NetSendX => {
                "[OTHER_NODES * MAX_TOKENS, HIDDEN]: rows staged for each other node, packed per chunk"
            }
            BufferId::NetSendRows => {
                "[OTHER_NODES, CHUNKS]: per other node, rows of each token chunk sent there (staged)"
            }
            BufferId::NetSendRow => {
                "[OTHER_NODES, MAX_TOKENS]: per other node, each visiting token's row in its outbox"
            }
            BufferId::RecvRows => {
                "[OTHER_NODES, CHUNKS]: per rail peer, rows of each chunk of its tokens sent here"
            }
            BufferId::NetRecvX => {
                "[OTHER_NODES * MAX_TOKENS, HIDDEN], written by NCCL's stream: rail peers' rows, packed per chunk"
            }
            BufferId::NetRecvRow => {
                "[OTHER_NODES, MAX_TOKENS]: per rail peer, each visiting token's row in the inbox"
            }
            BufferId::NetArrived => {
                "[OTHER_NODES, CHUNKS], written by NCCL's stream: rail peers' rows arrived"
            }
            BufferId::NetSendMask => {
                "[OTHER_NODES, MAX_TOKENS]: per other node, the ranks there each token visits (staged)"
            }
            BufferId::RecvMask => {
                "[OTHER_NODES, MAX_TOKENS]: per rail peer, the ranks of this node each of its tokens visits"
            }
            BufferId::NodePartials => {
                "[OTHER_NODES * GPUS_PER_NODE * MAX_TOKENS, HIDDEN], written by this node's ranks: partials to sum"
            }
            BufferId::NodePartialsReady => {
                "[GPUS_PER_NODE], written by this node's ranks: epoch their partials were stored in"
            }
            BufferId::NetSendSlot | BufferId::NetSendPair | BufferId::NetSendWeight => {
                "[NETWORK_PEERS, LOCAL_EXPERTS, SEGMENT_ROWS]: receive index staged for NCCL"
            }
            BufferId::NetSendCounts => "[NETWORK_PEERS, LOCAL_EXPERTS + 1]: counts staged for NCCL",
            BufferId::NetReady => {
                "[NETWORK_PEERS + OTHER_NODES * CHUNKS]: epoch each peer's metadata, each node's chunk was staged in"
            }
            BufferId::NetReturnX | BufferId::NetReturnedX => {
                "[OTHER_NODES * MAX_TOKENS, HIDDEN]: node partials for rail peers / from other nodes, at the tokens' rows"
            }
            BufferId::NetPartialsReady => {
                "[3]: combine lanes done storing, done summing partials, then the epoch of the last"
            }
            BufferId::NetReturnFlags => {
                "[OTHER_NODES, CHUNKS], written by NCCL's stream: results arrived"
            }
        },
    }
}

impl EntryUnit {
    /// [`EntryUnit::new`] for a kernel the plan may not launch at all (`None` then).
    fn if_launched(plan: &Plan, kernel: &str, uses: &[&str]) -> Result<Option<Self>, CodegenError> {
        if plan.launches().any(|l| l.kernel == kernel) {
            Self::new(plan, kernel, uses).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The entry point of `kernel` as the plan launches it, checked against the names its
    /// template body uses.
    fn new(plan: &Plan, kernel: &str, uses: &[&str]) -> Result<Self, CodegenError> {
        let launch = find_launch(plan, kernel)?;
        let names: Vec<&str> = launch.params.iter().map(|p| p.arg.name()).collect();
        let mut sorted_plan = names.clone();
        let mut sorted_uses = uses.to_vec();
        sorted_plan.sort_unstable();
        sorted_uses.sort_unstable();
        if sorted_plan != sorted_uses {
            return Err(CodegenError::SignatureMismatch {
                kernel: kernel.to_string(),
                plan: names.join(", "),
                template: uses.join(", "),
            });
        }
        let params = launch
            .params
            .iter()
            .map(|p| {
                let declaration = match (p.arg.param_type(), p.access) {
                    (ParamType::I32, _) => format!("int {}", p.arg.name()),
                    (ParamType::U32, _) => format!("u32 {}", p.arg.name()),
                    (ParamType::TensorMap, _) => {
                        format!("const __grid_constant__ TensorMap {}", p.arg.name())
                    }
                    (ParamType::Pointer(elem), Access::ReadShared) => {
                        format!("const {}* {}", elem.c_type(), p.arg.name())
                    }
                    (ParamType::Pointer(elem), Access::Read) => {
                        format!("const {}* __restrict__ {}", elem.c_type(), p.arg.name())
                    }
                    (ParamType::Pointer(elem), Access::Write) => {
                        format!("{}* __restrict__ {}", elem.c_type(), p.arg.name())
                    }
                };
                (declaration, param_comment(p.arg))
            })
            .collect::<Vec<_>>();
        let count = params.len();
        let params = params
            .into_iter()
            .enumerate()
            .map(|(i, (declaration, comment))| {
                let separator = if i + 1 < count { "," } else { "" };
                format!("{declaration}{separator}  // {comment}")
            })
            .collect::<Vec<_>>()
            .join("\n    ");
        Ok(EntryUnit {
            name: kernel.to_string(),
            params,
            threads: launch.block_threads,
            static_smem: launch.static_smem_bytes,
            early_start: plan.launches().any(|l| l.kernel == kernel && l.early_start),
        })
    }
}

/// The launch of `kernel` in the plan's first regime that runs it (single-GPU or
/// expert-parallel).
fn find_launch<'p>(plan: &'p Plan, kernel: &str) -> Result<&'p Launch, CodegenError> {
    plan.launches()
        .find(|l| l.kernel == kernel)
        .ok_or_else(|| CodegenError::MissingLaunch {
            kernel: kernel.to_string(),
        })
}

struct RegimeUnit {
    /// The regime's heading in the source.
    label: String,
    min_tokens: u32,
    max_tokens: u32,
    gemms: [GemmUnit; 2],
    fused: Option<FusedUnit>,
}

impl RegimeUnit {
    /// The guard of `gemm`'s configuration: its entry point's, and the fused decode's,
    /// which runs both of the regime's GEMMs.
    fn config_guard(&self, gemm: &GemmUnit) -> String {
        let mut kernels = vec![gemm.entry.name.as_str()];
        kernels.extend(self.fused.iter().map(|fused| fused.entry.name.as_str()));
        kernel_guard(&kernels)
    }
}

/// A regime's fused decode entry point: its launch, and what the device template is
/// instantiated with.
struct FusedUnit {
    /// A rank's (`ep_fused_decode`), or one GPU's (`fused_decode`).
    expert_parallel: bool,
    entry: EntryUnit,
    max_tokens: u32,
    blocks_per_sm: u32,
    max_rows: u32,
    /// The expert biases the entry passes (`nullptr` without).
    w1_bias: &'static str,
    w2_bias: &'static str,
    /// A gated shared expert's gate weights the entry passes (`nullptr` without).
    shared_gate: &'static str,
}

/// What a rank's fused decode uses: every parameter its plan gives it.
const RANK_FUSED_USES: &[&str] = &[
    "x",
    "w1",
    "w2",
    "topk_ids",
    "topk_weights",
    "tokens",
    "rank",
    "epoch",
    "peer_table",
    "recv_x",
    "recv_counts",
    "recv_pair",
    "recv_weight",
    "meta_flags",
    "chunk_flags",
    "chunk_pieces",
    "credits",
    "intermediate",
    "combine_slots",
    "combine_counters",
    "rank_fused_counters",
    "error_word",
    "y",
];

impl FusedUnit {
    fn new(plan: &Plan, fused: &FusedDecode, expert_parallel: bool) -> Result<Self, CodegenError> {
        let biases = plan.shape.expert_bias;
        let gated = fused
            .launch
            .params
            .iter()
            .any(|p| p.arg == LaunchArg::SharedExpertGate);
        let gate = LaunchArg::SharedExpertGate.name();
        let bias_uses = [
            biases.then_some(LaunchArg::W1Bias.name()),
            biases.then_some(LaunchArg::W2Bias.name()),
        ];
        let uses: Vec<&str> = if expert_parallel {
            RANK_FUSED_USES
                .iter()
                .copied()
                .chain(bias_uses.into_iter().flatten())
                .chain(gated.then_some(gate))
                .collect()
        } else {
            [
                Some("x"),
                Some("w1"),
                bias_uses[0],
                Some("w2"),
                bias_uses[1],
                gated.then_some(gate),
                Some("topk_ids"),
                Some("topk_weights"),
                Some("tokens"),
                Some("intermediate"),
                Some("combine_slots"),
                Some(BufferId::FusedDecodeCounters.name()),
                Some("error_word"),
                Some("y"),
            ]
            .into_iter()
            .flatten()
            .collect()
        };
        let bias = |name| if biases { name } else { "nullptr" };
        Ok(FusedUnit {
            expert_parallel,
            entry: EntryUnit::new(plan, &fused.launch.kernel, &uses)?,
            max_tokens: fused.max_tokens,
            blocks_per_sm: fused.blocks_per_sm,
            max_rows: fused.max_rows,
            w1_bias: bias("w1_bias"),
            w2_bias: bias("w2_bias"),
            shared_gate: if gated { gate } else { "nullptr" },
        })
    }
}

struct GemmUnit {
    role: &'static str,
    engine: &'static str,
    /// The device template that runs the GEMM.
    function: &'static str,
    /// The name of its config struct: `<regime>_gemm1`.
    config: String,
    /// The config's base: `SingleGpu` or `ExpertParallel`.
    base: &'static str,
    /// The arguments the entry point passes to the device template.
    call_args: String,
    kind: &'static str,
    gated: bool,
    /// Whether the epilogue adds the expert's bias (the launch takes `w1_bias`/`w2_bias`).
    bias: bool,
    n: &'static str,
    kd: &'static str,
    entry: EntryUnit,
    bm: u32,
    bn: u32,
    bk: u32,
    stages: u32,
    warps_m: u32,
    warps_n: u32,
    threads: u32,
    b_rows: u32,
    smem: SmemLayout,
    blocks_per_sm: u32,
    grid: u32,
    /// Blocks per cluster (`__cluster_dims__` where 2) and rows of one weight box.
    cluster: u32,
    b_box_rows: u32,
    /// Whether the A rows come as TMA tiles rather than gathered row by row.
    a_tiles: bool,
    /// Whether a quad trades words to store 16 bytes per lane ([`OutputStore::QuadVectors`]).
    quad_stores: bool,
    /// The mma.sync GEMM2 of a call that starts early: it loads its first weight stages
    /// before it waits for GEMM1 (the entry point then does not wait first).
    weights_before_wait: bool,
    /// One GPU's GEMM1 of a gated shared expert: its warps compute the tokens' shared-slice
    /// weights before its tiles.
    computes_shared_gate: bool,
    /// A single-GPU GEMM1 that starts early and whose GEMM2's blocks fit beside its own:
    /// the largest calls it lets GEMM2 start early for (`Regime::gemm2_early_max_tokens`).
    gemm2_early_max_tokens: Option<u32>,
    /// mma.sync on one GPU: which calls run stream-K (0, 0: none).
    stream_k_max_last_wave: u32,
    stream_k_max_tiles: u32,
    /// mma.sync on one GPU: the largest calls, in (token, k) pairs, routed in the blocks
    /// (0: none).
    block_routing_max_pairs: u32,
    /// Warp-specialised engine: producer threads and the `setmaxnreg` split (0 elsewhere).
    producer_threads: u32,
    producer_registers: u32,
    consumer_registers: u32,
}

/// Which GEMM of which path a `GemmUnit` is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmRole {
    Up,
    Down,
    ExpertParallelUp,
    ExpertParallelDown,
}

impl GemmUnit {
    fn new(
        plan: &Plan,
        regime_name: &str,
        role: GemmRole,
        kernel: &str,
        gemm: &GemmPlan,
    ) -> Result<Self, CodegenError> {
        let up = matches!(role, GemmRole::Up | GemmRole::ExpertParallelUp);
        let (description, suffix, uses, base, call_args) = match role {
            GemmRole::Up => (
                "GEMM1 (x rows gathered or sorted, W1, activation)",
                "gemm1",
                GEMM_UP_USES,
                "SingleGpu",
                "{a_rows}, {weights}, {bias}, SlotWeights{}, expert_offsets, {row_pair}, intermediate, EpContext{}{unit_ticket}{a_tiles}{stream_k}{block_routing}",
            ),
            GemmRole::Down => (
                "GEMM2 (W2, routing weight, combine slot)",
                "gemm2",
                GEMM_DOWN_USES,
                "SingleGpu",
                "{a_rows}, {weights}, {bias}, SlotWeights{topk_weights{shared_gate}}, expert_offsets, row_pair, combine_slots, EpContext{}{unit_ticket}{a_tiles}{stream_k}{block_routing}",
            ),
            GemmRole::ExpertParallelUp => (
                "expert-parallel GEMM1 (received rows once their chunks arrive, W1, activation)",
                "ep_gemm1",
                EP_GEMM_UP_USES,
                "ExpertParallel",
                "recv_x, {weights}, {bias}, SlotWeights{}, segment_offsets, segment_rows, intermediate,\n        ep_gemm1_context(chunk_flags, x, error_word, rank, epoch){unit_ticket}",
            ),
            GemmRole::ExpertParallelDown if rank_partials(plan) => (
                "expert-parallel GEMM2 (W2, routing weight, kept here for the combine's rank partials)",
                "ep_gemm2",
                EP_GEMM_DOWN_PARTIALS_USES,
                "ExpertParallel",
                "intermediate, {weights}, {bias}, SlotWeights{}, segment_offsets, segment_pairs, pair_results,\n        ep_gemm2_context(segment_weights, nullptr, nullptr, error_word, rank){unit_ticket}",
            ),
            GemmRole::ExpertParallelDown => (
                "expert-parallel GEMM2 (W2, routing weight, the origin's combine slot and counter)",
                "ep_gemm2",
                EP_GEMM_DOWN_USES,
                "ExpertParallel",
                "intermediate, {weights}, {bias}, SlotWeights{}, segment_offsets, segment_pairs, nullptr,\n        ep_gemm2_context(segment_weights, row_origins, peer_table, error_word, rank){unit_ticket}",
            ),
        };
        let (kind, n, kd) = if up {
            ("GEMM_UP", "FFN", "HIDDEN")
        } else {
            ("GEMM_DOWN", "HIDDEN", "FFN")
        };
        // The warp-specialised engine reads weights through a tensor map, not a pointer.
        let (pointer, weights) = match (up, gemm.warp_roles.is_some()) {
            (true, false) => ("w1", "w1"),
            (false, false) => ("w2", "w2"),
            (true, true) => ("w1", "&w1_tiles"),
            (false, true) => ("w2", "&w2_tiles"),
        };
        // Every GEMM of a layer with expert biases takes its own (a rank's: its experts').
        let bias_arg = plan.shape.expert_bias.then(|| {
            if up {
                LaunchArg::W1Bias
            } else {
                LaunchArg::W2Bias
            }
            .name()
        });
        // A single-GPU GEMM reads its A rows through a tensor map where the plan loads them
        // as tiles (the engine's last parameter: sorted x for GEMM1, the intermediate for
        // GEMM2), else through the pointer (x gathered by the row table for GEMM1, the
        // intermediate for GEMM2). The expert-parallel GEMMs always gather.
        let a_tiles =
            gemm.a_load == RowLoad::Tiles && matches!(role, GemmRole::Up | GemmRole::Down);
        let (rows, tiles) = if up {
            ("x", LaunchArg::SortedXTiles { box_rows: 0 }.name())
        } else {
            (
                "intermediate",
                LaunchArg::IntermediateTiles { box_rows: 0 }.name(),
            )
        };
        let (a_rows, a_tiles_arg) = if a_tiles {
            ("nullptr", format!(", &{tiles}"))
        } else {
            (rows, String::new())
        };
        // GEMM1 on sorted rows has no row table: its A rows and intermediate rows line up.
        let row_table = !(a_tiles && up);
        // A GEMM whose launch the plan gives the unit tickets claims its work units from its
        // own (GEMM1 the first, GEMM2 the second).
        let tickets = LaunchArg::Workspace(BufferId::UnitTickets);
        let launch = find_launch(plan, kernel)?;
        let claims_units = launch.params.iter().any(|param| param.arg == tickets);
        let unit_ticket_arg = if claims_units {
            format!(", {} + {}", tickets.name(), if up { 0 } else { 1 })
        } else {
            String::new()
        };
        // A GEMM that splits few-tile calls stream-K takes the buffers of partial tiles.
        let stream_k = gemm.stream_k.is_some();
        let stream_k_buffers = [BufferId::StreamKPartials, BufferId::StreamKTilesDone]
            .map(|id| LaunchArg::Workspace(id).name());
        // A GEMM that routes small calls in its blocks takes the call's ids, token count and
        // whether this call routes so (GEMM1 the error word too), after the stream-K
        // buffers (given, if empty).
        let block_routing = gemm.block_routing.is_some();
        let stream_k_arg = if stream_k {
            format!(", StreamKBuffers{{{}}}", stream_k_buffers.join(", "))
        } else if block_routing {
            ", StreamKBuffers{}".to_string()
        } else {
            String::new()
        };
        let block_routing_uses: &[&str] = match (block_routing, up) {
            (false, _) => &[],
            (true, true) => &["topk_ids", "tokens", "routes_in_blocks", "error_word"],
            (true, false) => &["topk_ids", "tokens", "routes_in_blocks"],
        };
        let block_routing_arg = match (block_routing, up) {
            (false, _) => "",
            (true, true) => ", CallRouting{routes_in_blocks != 0, topk_ids, tokens, error_word}",
            (true, false) => ", CallRouting{routes_in_blocks != 0, topk_ids, tokens, nullptr}",
        };
        // One GPU's GEMM2 weighs a gated shared expert's slices by the per-token weights
        // GEMM1 computed.
        let shared_gate = (role == GemmRole::Down && plan.shape.shared_gated)
            .then(|| LaunchArg::Workspace(BufferId::SharedGate).name());
        // One GPU's GEMM1 whose launch writes a gated shared expert's weights computes them
        // before its tiles.
        let computes_shared_gate = role == GemmRole::Up
            && launch
                .params
                .iter()
                .any(|p| p.arg == LaunchArg::Workspace(BufferId::SharedGate));
        let mut uses: Vec<&str> = uses
            .iter()
            .filter(|&&name| row_table || name != "row_pair")
            .map(|&name| {
                if name == pointer {
                    weights.trim_start_matches('&')
                } else if name == rows && a_tiles {
                    tiles
                } else {
                    name
                }
            })
            .chain(bias_arg)
            .chain(shared_gate)
            .chain(stream_k_buffers.into_iter().filter(|_| stream_k))
            .chain(claims_units.then(|| tickets.name()))
            .chain(block_routing_uses.iter().copied())
            .collect();
        if computes_shared_gate {
            for name in SHARED_GATE_USES {
                if !uses.contains(name) {
                    uses.push(name);
                }
            }
        }
        let call_args = call_args
            .replace("{weights}", weights)
            .replace("{bias}", bias_arg.unwrap_or("nullptr"))
            .replace(
                "{shared_gate}",
                &shared_gate.map_or(String::new(), |name| format!(", {name}")),
            )
            .replace("{a_rows}", a_rows)
            .replace("{unit_ticket}", &unit_ticket_arg)
            .replace("{a_tiles}", &a_tiles_arg)
            .replace("{row_pair}", if row_table { "row_pair" } else { "nullptr" })
            .replace("{stream_k}", &stream_k_arg)
            .replace("{block_routing}", block_routing_arg);
        let entry = EntryUnit::new(plan, kernel, &uses)?;
        let weights_before_wait =
            role == GemmRole::Down && gemm.engine == MmaEngine::MmaSync && entry.early_start;
        let gemm2_early_max_tokens = if role == GemmRole::Up {
            plan.regimes
                .iter()
                .find(|regime| regime.gemm1_kernel == kernel)
                .and_then(|regime| regime.gemm2_early_max_tokens(plan.target.smem_per_sm))
        } else {
            None
        };
        Ok(GemmUnit {
            role: description,
            engine: gemm.engine.name(),
            function: match gemm.engine {
                MmaEngine::MmaSync => "grouped_gemm",
                MmaEngine::WgmmaWarpSpecialized => "grouped_gemm_warp_specialized",
            },
            config: format!("{regime_name}_{suffix}"),
            base,
            call_args,
            kind,
            gated: up && plan.shape.activation.is_gated(),
            bias: bias_arg.is_some(),
            n,
            kd,
            entry,
            bm: gemm.tile.m,
            bn: gemm.tile.n,
            bk: gemm.tile.k,
            stages: gemm.stages,
            warps_m: gemm.warps_m,
            warps_n: gemm.warps_n,
            threads: gemm.threads(),
            b_rows: gemm.b_rows,
            smem: gemm.smem,
            blocks_per_sm: gemm.blocks_per_sm,
            grid: gemm.grid_blocks,
            cluster: gemm.cluster,
            b_box_rows: gemm.weight_box_rows(),
            a_tiles,
            quad_stores: gemm.store == OutputStore::QuadVectors,
            weights_before_wait,
            computes_shared_gate,
            gemm2_early_max_tokens,
            stream_k_max_last_wave: gemm.stream_k.map_or(0, |tail| tail.max_last_wave),
            stream_k_max_tiles: gemm.stream_k.map_or(0, |tail| tail.max_tiles),
            block_routing_max_pairs: gemm.block_routing.map_or(0, |routing| routing.max_pairs),
            producer_threads: gemm.warp_roles.map_or(0, |r| 32 * r.producer_warps),
            producer_registers: gemm.warp_roles.map_or(0, |r| r.producer_registers),
            consumer_registers: gemm.warp_roles.map_or(0, |r| r.consumer_registers),
        })
    }
}

/// The device function applying the layer's activation in GEMM1's epilogue.
fn activation_fn(activation: Activation) -> String {
    let fixed = match activation {
        Activation::Swiglu => {
            "__device__ __forceinline__ float activate(float gate, float up) { return silu(gate) * up; }"
        }
        Activation::Geglu => {
            "__device__ __forceinline__ float activate(float gate, float up) { return gelu_tanh(gate) * up; }"
        }
        // Ungated activations ignore `up` (always 0): one signature keeps GEMM1's epilogue uniform.
        Activation::Gelu => {
            "__device__ __forceinline__ float activate(float h, float) { return gelu_tanh(h); }"
        }
        Activation::Relu => {
            "__device__ __forceinline__ float activate(float h, float) { return fmaxf(h, 0.f); }"
        }
        Activation::Silu => {
            "__device__ __forceinline__ float activate(float h, float) { return silu(h); }"
        }
        // As GPT-OSS's reference computes it, in f32: the gate clamped above only, the up
        // projection both ways, and 1 added to the clamped up.
        Activation::ClampedSwiglu => {
            return format!(
                "__device__ __forceinline__ float activate(float gate, float up) {{
    constexpr float SWIGLU_LIMIT = {CLAMPED_SWIGLU_LIMIT:?}f, SWIGLU_ALPHA = {CLAMPED_SWIGLU_ALPHA:?}f;
    gate = fminf(gate, SWIGLU_LIMIT);
    up = fminf(fmaxf(up, -SWIGLU_LIMIT), SWIGLU_LIMIT);
    return __fdividef(gate, 1.0f + __expf(-SWIGLU_ALPHA * gate)) * (up + 1.0f);
}}"
            );
        }
    };
    fixed.to_string()
}

/// A regime's section of the unit: its label, token range and two GEMMs in `roles`.
fn regime_unit(
    plan: &Plan,
    label: String,
    regime: RegimeParts<'_>,
    roles: [GemmRole; 2],
) -> Result<RegimeUnit, CodegenError> {
    let [(gemm1, kernel1), (gemm2, kernel2)] = regime.gemms;
    Ok(RegimeUnit {
        label,
        min_tokens: regime.min_tokens,
        max_tokens: regime.max_tokens,
        gemms: [
            GemmUnit::new(plan, regime.name, roles[0], kernel1, gemm1)?,
            GemmUnit::new(plan, regime.name, roles[1], kernel2, gemm2)?,
        ],
        fused: regime
            .fused_decode
            .map(|fused| FusedUnit::new(plan, fused, roles[0] == GemmRole::ExpertParallelUp))
            .transpose()?,
    })
}

/// The router's section of the unit.
struct RouterUnit {
    /// The rule in words, for the section's heading.
    rule: String,
    scoring: &'static str,
    bias: &'static str,
    groups: u32,
    groups_kept: u32,
    /// Whether the select ranks the groups in shared memory (`router::groups_in_shared_memory`).
    groups_in_smem: bool,
    normalize: bool,
    /// `scale` as a C float literal.
    scale: String,
    normalize_epsilon: String,
    /// What the entries pass as the bias: `gate_bias`, or `nullptr` without one.
    bias_arg: &'static str,
    gates: Vec<GateUnit>,
    /// Whether any gate is warp-specialised (the unit then has the wgmma helpers).
    warp_specialized_gates: bool,
    /// The split routers' select kernel (none when every regime's router is fused).
    select: Option<EntryUnit>,
    select_warps: u32,
}

/// One regime's router entry (the fused router, or the split router's gate) and its gate
/// GEMM's tile.
struct GateUnit {
    fused: bool,
    /// A fused router that started early lets the launch behind it start early too, as
    /// soon as its blocks have waited for the kernel ahead; else that launch starts as
    /// the router's blocks finish (`RouterRegime::gemm1_starts_early`).
    next_starts_early: bool,
    regime: String,
    min_tokens: u32,
    max_tokens: u32,
    config: String,
    entry: EntryUnit,
    bm: u32,
    bn: u32,
    stages: u32,
    warps_m: u32,
    warps_n: u32,
    warps_k: u32,
    /// The most blocks a tile's reduction is split over (at one token tile).
    most_splits: u32,
    threads: u32,
    expert_tiles: u32,
    stage_bytes: u32,
    smem_bytes: u32,
    /// A cluster gate's blocks per cluster (`__cluster_dims__`; it selects its tokens);
    /// 0 for the other gates.
    cluster: u32,
    /// Warp-specialised (wgmma): its producer warpgroup's threads, the bytes of a stage's
    /// x rows (its W_gate rows follow) and where its mbarriers start in the aligned ring.
    warp_specialized: bool,
    producer_threads: u32,
    a_bytes: u32,
    ring_align: u32,
    barrier_offset: u32,
}

/// An f32 as a C float literal that reads back as the same value.
fn float_literal(value: f32) -> String {
    format!("{value:e}f")
}

fn router_unit(plan: &Plan, router_plan: &RouterPlan) -> Result<RouterUnit, CodegenError> {
    let rule = &router_plan.rule;
    let has_bias = rule.bias != RouterBias::None;
    let gates = plan
        .regimes
        .iter()
        .zip(&router_plan.regimes)
        .flat_map(|(regime, router_regime)| {
            router_regime
                .gates
                .iter()
                .enumerate()
                .map(move |(i, gate)| (regime, router_regime, i, gate))
        })
        .map(|(regime, router_regime, i, gate)| {
            let warp_specialized = gate.engine == GateEngine::WarpSpecialized;
            let cluster = match gate.engine {
                GateEngine::Cluster { blocks } => blocks,
                GateEngine::MmaSync | GateEngine::WarpSpecialized => 0,
            };
            let uses: Vec<&str> = if router_regime.fused {
                let bias = if has_bias { ROUTER_BIAS_USES } else { &[] };
                [ROUTER_USES, bias, ROUTER_ROUTING_USES].concat()
            } else if warp_specialized {
                ROUTER_GATE_WS_USES.to_vec()
            } else if cluster > 0 {
                uses_with(ROUTER_GATE_CLUSTER_USES, ROUTER_BIAS_USES, has_bias)
            } else {
                ROUTER_GATE_USES.to_vec()
            };
            let stage_bytes = (gate.tile_tokens + gate.tile_experts) * SMEM_ROW_BYTES;
            let config = if router_regime.fused {
                format!(
                    "{}_gate",
                    router::fused_router_name(&regime.name, &router_regime.gates, gate)
                )
            } else {
                router::split_gate_name(&regime.name, gate)
            };
            Ok(GateUnit {
                fused: router_regime.fused,
                next_starts_early: router_regime.gemm1_starts_early,
                regime: regime.name.clone(),
                min_tokens: gate.min_tokens,
                max_tokens: gate.max_tokens,
                config,
                entry: EntryUnit::new(plan, &router_regime.launches[i].kernel, &uses)?,
                bm: gate.tile_tokens,
                bn: gate.tile_experts,
                stages: gate.stages,
                warps_m: gate.warps_m,
                warps_n: gate.warps_n,
                warps_k: gate.warps_k,
                most_splits: gate.splits(1),
                threads: gate.threads(),
                expert_tiles: gate.expert_tiles,
                stage_bytes,
                smem_bytes: gate.smem_bytes,
                cluster,
                warp_specialized,
                producer_threads: gate.producer_threads(),
                a_bytes: gate.tile_tokens * SMEM_ROW_BYTES,
                ring_align: router::GATE_RING_ALIGN,
                barrier_offset: gate.stages * stage_bytes,
            })
        })
        .collect::<Result<Vec<_>, CodegenError>>()?;
    let select_kernel = router_plan
        .regimes
        .iter()
        .find_map(|regime| regime.select_launch().map(|i| &regime.launches[i]));
    let select_uses = uses_with(ROUTER_SELECT_USES, ROUTER_BIAS_USES, has_bias);
    let select = select_kernel
        .map(|launch| EntryUnit::new(plan, &launch.kernel, &select_uses))
        .transpose()?;
    Ok(RouterUnit {
        rule: router::rule_summary(rule),
        scoring: match rule.scoring {
            Scoring::Softmax => "ROUTER_SOFTMAX",
            Scoring::Sigmoid => "ROUTER_SIGMOID",
            Scoring::TopkSoftmax => "ROUTER_TOPK_SOFTMAX",
        },
        bias: match rule.bias {
            RouterBias::None => "ROUTER_BIAS_NONE",
            RouterBias::Logits => "ROUTER_BIAS_LOGITS",
            RouterBias::ScoreCorrection => "ROUTER_BIAS_SCORE_CORRECTION",
        },
        groups: rule.group_limit.map_or(0, |limit| limit.groups),
        groups_kept: rule.group_limit.map_or(0, |limit| limit.kept),
        groups_in_smem: router::groups_in_shared_memory(rule, plan.shape.experts),
        normalize: rule.normalize,
        scale: float_literal(rule.scale as f32),
        normalize_epsilon: float_literal(router::NORMALIZE_EPSILON),
        bias_arg: if has_bias { "gate_bias" } else { "nullptr" },
        warp_specialized_gates: gates.iter().any(|gate| gate.warp_specialized),
        gates,
        select,
        select_warps: router::SELECT_WARPS,
    })
}

/// One buffer of the peer table: its constant's name and its column.
struct PeerBufferUnit {
    constant: String,
    index: usize,
}

/// The expert-parallel section of the unit.
struct EpUnit {
    ranks: u32,
    placement: &'static str,
    local_experts: u32,
    max_tokens: u32,
    slots: u32,
    segment_rows: u32,
    chunk: u32,
    chunks: u32,
    piece: u32,
    comm_threads: u32,
    meta_threads: u32,
    meta_tile_tokens: u32,
    /// Whether results return as rank partials ([`CombineRoute::RankPartials`]).
    rank_partials: bool,
    /// Whether a call may route itself (the router's launches ahead of `ep_route`).
    routes_itself: bool,
    /// Whether a regime runs its smallest calls as one kernel per rank.
    fused_decode: bool,
    partials_per_release: u32,
    combine_lanes: u32,
    peer_buffers: Vec<PeerBufferUnit>,
    send_order: String,
    receive_order: String,
    route: EntryUnit,
    dispatch: EntryUnit,
    arrange: EntryUnit,
    combine: EntryUnit,
    network: Option<NetworkUnit>,
}

/// The constants of traffic between nodes.
struct NetworkUnit {
    nodes: u32,
    gpus_per_node: u32,
    peers: u32,
}

fn network_unit(network: &NetworkPlan) -> NetworkUnit {
    NetworkUnit {
        nodes: network.nodes,
        gpus_per_node: network.gpus_per_node,
        peers: network.peers_per_rank,
    }
}

/// `{0, 1}, {1, 0}`: a table as a C initializer.
fn c_table<Row, Cell>(rows: impl IntoIterator<Item = Row>) -> String
where
    Row: IntoIterator<Item = Cell>,
    Cell: std::fmt::Display,
{
    rows.into_iter()
        .map(|row| {
            let cells: Vec<String> = row.into_iter().map(|cell| cell.to_string()).collect();
            format!("{{{}}}", cells.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn ep_unit(plan: &Plan, ep: &ExpertParallelPlan) -> Result<EpUnit, CodegenError> {
    let over_network = ep.network.is_some();
    Ok(EpUnit {
        ranks: ep.ranks,
        placement: match ep.placement {
            Placement::Virtual => "virtual ranks on one GPU",
            Placement::Devices => "one GPU per rank",
        },
        local_experts: ep.experts_per_rank,
        max_tokens: plan.shape.max_tokens,
        slots: ep.slots_per_source,
        segment_rows: ep.rows_per_segment,
        chunk: ep.dispatch_chunk,
        chunks: ep.chunks_per_source,
        piece: ep.dispatch_piece,
        comm_threads: COMM_THREADS,
        meta_threads: META_THREADS,
        meta_tile_tokens: ep.metadata_tile_tokens,
        rank_partials: ep.combine_route == CombineRoute::RankPartials,
        routes_itself: ep.routes_itself,
        fused_decode: ep.regimes.iter().any(|r| r.fused_decode.is_some()),
        partials_per_release: PARTIALS_PER_RELEASE,
        combine_lanes: COMBINE_LANES,
        peer_buffers: ep
            .peer_buffers
            .iter()
            .enumerate()
            .map(|(index, id)| PeerBufferUnit {
                constant: format!("PEER_{}", id.name().to_ascii_uppercase()),
                index,
            })
            .collect(),
        send_order: c_table(&ep.send_order),
        receive_order: c_table(&ep.receive_order),
        route: EntryUnit::new(
            plan,
            &ep.route_kernel,
            &uses_with(EP_ROUTE_USES, EP_ROUTE_NETWORK_USES, over_network),
        )?,
        dispatch: EntryUnit::new(
            plan,
            &ep.dispatch_kernel,
            &uses_with(EP_DISPATCH_USES, EP_DISPATCH_NETWORK_USES, over_network),
        )?,
        arrange: EntryUnit::new(
            plan,
            &ep.arrange_kernel,
            &uses_with(
                &uses_with(
                    EP_ARRANGE_USES,
                    EP_ARRANGE_PARTIALS_USES,
                    rank_partials(plan),
                ),
                SHARED_GATE_READERS_USES,
                plan.shape.shared_gated,
            ),
        )?,
        combine: EntryUnit::new(
            plan,
            &ep.combine_kernel,
            &uses_with(
                &uses_with(EP_COMBINE_USES, EP_COMBINE_NETWORK_USES, over_network),
                EP_COMBINE_PARTIALS_USES,
                rank_partials(plan),
            ),
        )?,
        network: ep.network.as_ref().map(network_unit),
    })
}

/// Whether the plan's expert-parallel results return as rank partials.
fn rank_partials(plan: &Plan) -> bool {
    plan.expert_parallel
        .as_ref()
        .is_some_and(|ep| ep.combine_route == CombineRoute::RankPartials)
}

/// Renders the CUDA unit of `plan`.
pub fn generate(plan: &Plan) -> Result<KernelSource, CodegenError> {
    let shape = &plan.shape;
    let unit = LayerUnit {
        layer: &plan.layer,
        arch: &plan.target.arch,
        target: &plan.target.name,
        notes: plan
            .hints_not_honoured
            .iter()
            .chain(&plan.limitations)
            .map(String::as_str)
            .collect(),
        hidden: shape.hidden,
        ffn: shape.ffn,
        experts: shape.experts,
        top_k: shape.top_k,
        shared_slices: shape.shared_slices,
        smem_row_bytes: SMEM_ROW_BYTES,
        static_smem_granule: STATIC_SMEM_GRANULE,
        block_routing_max_pairs: plan
            .regimes
            .iter()
            .filter_map(|regime| regime.block_routing(shape.top_k))
            .map(|routing| routing.max_pairs)
            .max()
            .unwrap_or(0),
        route: EntryUnit::if_launched(plan, &plan.route_kernel, ROUTE_USES)?,
        route_count: EntryUnit::if_launched(plan, &plan.route_count_kernel, ROUTE_COUNT_USES)?,
        route_place: EntryUnit::if_launched(plan, &plan.route_place_kernel, ROUTE_PLACE_USES)?,
        route_threads: ROUTE_THREADS,
        combine: EntryUnit::new(plan, &plan.combine_kernel, COMBINE_USES)?,
        shared_gate: plan
            .shared_gate_kernel
            .as_ref()
            .map(|kernel| EntryUnit::new(plan, kernel, SHARED_GATE_USES))
            .transpose()?,
        shared_gate_tokens_per_block: SHARED_GATE_TOKENS_PER_BLOCK,
        shared_gated: shape.shared_gated,
        invert_rows: EntryUnit::if_launched(plan, &plan.invert_rows_kernel, INVERT_ROWS_USES)?,
        invert_rows_threads: INVERT_ROWS_THREADS,
        sort_rows: EntryUnit::if_launched(plan, &plan.sort_rows_kernel, SORT_ROWS_USES)?,
        sort_rows_threads: SORT_ROWS_THREADS,
        combine_blocks_per_token: combine_blocks_per_token(plan)?,
        error_expert_id: error_code::EXPERT_ID_OUT_OF_RANGE,
        error_expert_repeated: error_code::EXPERT_ID_REPEATED,
        activation: shape.activation.name(),
        activation_fn: activation_fn(shape.activation),
        regimes: regime_units(plan)?,
        router: plan
            .router
            .as_ref()
            .map(|router| router_unit(plan, router))
            .transpose()?,
        ep: plan
            .expert_parallel
            .as_ref()
            .map(|ep| ep_unit(plan, ep))
            .transpose()?,
        flag_scope: plan
            .expert_parallel
            .as_ref()
            .map_or(FlagScope::Gpu, |ep| ep.scope)
            .ptx(),
        spin_limit_cycles: plan.flag_wait_limit.cycles,
        error_flag_timeout: error_code::FLAG_TIMEOUT,
        flag_kind_meta: error_code::flag_kind::META,
        flag_kind_chunk: error_code::flag_kind::CHUNK,
        flag_kind_combine: error_code::flag_kind::COMBINE,
        flag_kind_credit: error_code::flag_kind::CREDIT,
        flag_kind_return: error_code::flag_kind::RETURN,
        flag_kind_expert_rows: error_code::flag_kind::EXPERT_ROWS,
        flag_kind_node_partials: error_code::flag_kind::NODE_PARTIALS,
        flag_kind_arrived: error_code::flag_kind::ARRIVED,
        fused_decode: plan.regimes.iter().any(|r| r.fused_decode.is_some()),
        wgmma_widths: wgmma_widths(plan),
        warp_specialized: all_gemms(plan).any(|(g, _)| g.engine == MmaEngine::WgmmaWarpSpecialized)
            || warp_specialized_gates(plan).next().is_some(),
        tensor_map_bytes: TENSOR_MAP_BYTES,
        tensor_map_align: TENSOR_MAP_ALIGN,
    };
    Ok(KernelSource {
        file_name: format!("{}.cu", plan.symbol),
        source: unit.render()?,
        entry_points: plan.entry_points(),
    })
}

/// The single-GPU regimes, then the expert-parallel ones.
fn regime_units(plan: &Plan) -> Result<Vec<RegimeUnit>, CodegenError> {
    let mut units = plan
        .regimes
        .iter()
        .map(|regime| {
            regime_unit(
                plan,
                format!("Regime `{}`", regime.name),
                regime.parts(),
                [GemmRole::Up, GemmRole::Down],
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(ep) = &plan.expert_parallel {
        for regime in &ep.regimes {
            units.push(regime_unit(
                plan,
                format!(
                    "Rank regime `{}`, expert-parallel (tokens per rank)",
                    regime.name
                ),
                regime.parts(),
                [GemmRole::ExpertParallelUp, GemmRole::ExpertParallelDown],
            )?);
        }
    }
    Ok(units)
}

/// Every GEMM of the plan with its entry point: the single-GPU regimes', then the
/// expert-parallel ones'.
fn all_gemms(plan: &Plan) -> impl Iterator<Item = (&GemmPlan, &String)> {
    let ep_regimes = plan.expert_parallel.iter().flat_map(|ep| &ep.regimes);
    plan.regimes
        .iter()
        .map(Regime::parts)
        .chain(ep_regimes.map(|regime| regime.parts()))
        .flat_map(|parts| parts.gemms)
}

/// The router's warp-specialised gates, which run on the expert GEMMs' wgmma helpers, each
/// with its entry point.
fn warp_specialized_gates(plan: &Plan) -> impl Iterator<Item = (&GatePlan, &String)> {
    plan.router
        .iter()
        .flat_map(|router| &router.regimes)
        .flat_map(|regime| regime.gates.iter().zip(&regime.launches))
        .filter(|(gate, _)| gate.engine == GateEngine::WarpSpecialized)
        .map(|(gate, launch)| (gate, &launch.kernel))
}

/// The wgmma widths the unit instantiates, ascending, each with the entry points that use
/// it: the wgmma GEMMs' weight rows per stage and the warp-specialised gates' experts per
/// tile.
fn wgmma_widths(plan: &Plan) -> Vec<WgmmaWidth> {
    let gemms = all_gemms(plan)
        .filter(|(gemm, _)| gemm.engine.is_wgmma())
        .map(|(gemm, kernel)| (gemm.b_rows, kernel.as_str()));
    let gates =
        warp_specialized_gates(plan).map(|(gate, kernel)| (gate.tile_experts, kernel.as_str()));
    let mut users: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for (n, kernel) in gemms.chain(gates) {
        users.entry(n).or_default().push(kernel);
    }
    users
        .into_iter()
        .map(|(n, kernels)| WgmmaWidth {
            n,
            guard: kernel_guard(&kernels),
        })
        .collect()
}
