//! The planner: turns a checked [`ir::Layer`] and a [`Target`] into a [`Plan`], the single
//! source of truth that codegen and the runtime read.
//!
//! Architecture invariant: every decision (tile shapes, pipeline depth, warps, grid sizes,
//! buffer sizes, which kernel runs for which token count, the argument list of each launch)
//! is made here and recorded in the `Plan`. Codegen writes it out; the runtime binds
//! buffers by the names the plan gives and launches what the table says. Neither
//! re-derives anything. The plan is a pure function of the layer and the target.
//!
//! The cost model behind the tile choice is in [`cost`] and documented in
//! `docs/planner.md`.

pub mod cost;
mod describe;
pub mod ep;
pub mod fused_decode;
mod launch;
pub mod memory;
pub mod network;
pub mod router;
pub mod target;
pub mod tuning;
mod validate;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::ir::{self, Activation, TileShape};
pub use cost::GemmEstimate;
pub use describe::describe;
use ep::ExpertParallelRegime;
pub use fused_decode::FusedDecode;
pub use launch::{
    Access, Grid, KernelParam, Launch, LaunchArg, ParamType, SHARED_GATE_TOKENS_PER_BLOCK,
    StreamRole, TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES,
};
pub use router::{GatePlan, RouterPlan, RouterRegime};
pub use target::{DeviceFacts, Target};
pub use validate::PlanInvalid;

/// Reduction depth of one pipeline stage. The kernels swizzle 128-byte shared-memory rows
/// (64 bf16); the mma.sync engine also takes [`DEEP_TILE_K`].
pub const TILE_K: u32 = 64;
/// Bytes of one shared-memory row of a stage: `TILE_K` bf16.
pub const SMEM_ROW_BYTES: u32 = TILE_K * 2;
/// The mma.sync engine's deeper stage: 256-byte rows (two swizzled 128-byte halves), so
/// each weight row is read 256 contiguous bytes at a time. Streaming weight rows so ran
/// 1.6-1.8% faster than 128 bytes at a time on the decode GEMMs' shapes (a load probe on
/// one H200, 2026-12-02, `benches/results/2026-12-02_ring_across_tiles.md`).
pub const DEEP_TILE_K: u32 = 2 * TILE_K;
/// ptxas reserves static shared memory in pieces of this many bytes.
pub const STATIC_SMEM_GRANULE: u32 = 128;

/// `bytes` of static shared memory as a block reserves them.
pub fn static_smem_reserved(bytes: u32) -> u32 {
    bytes.div_ceil(STATIC_SMEM_GRANULE) * STATIC_SMEM_GRANULE
}

/// The period of wgmma's 128-byte swizzle: its stage ring starts on this boundary.
const WGMMA_RING_ALIGN: u32 = 1024;
/// Alignment of the dynamic shared memory the mma.sync ring starts at.
const MMA_SYNC_RING_ALIGN: u32 = 128;
/// Threads of a routing kernel's block.
pub const ROUTE_THREADS: u32 = 1024;
/// Pairs each block of the routing over several blocks takes, at a regime's largest call.
pub const ROUTE_PAIRS_PER_BLOCK: u64 = 4096;
/// Regimes whose largest call has more (token, k) pairs than this route over several
/// blocks (count, then place: `launch::RouteLaunches::Blocks`). One block's shared-memory
/// atomics and scattered row stores took Qwen3-30B-A3B's route 11 µs at 1024 tokens, 37 µs
/// at 4096 and 138 µs at 16384 (Nsight Compute, one H200, 2026-11-30). Over blocks, layer
/// time measured (same device call, 4 rounds): Qwen3 −2.5% at 1024 tokens (8192 pairs, 2
/// blocks), GPT-OSS −1.2% at 2048, DeepSeek-V3 −14.6% at 2048 (16384 pairs, 4 blocks:
/// 7488 → 6397 µs; its kernels alone sum to 6.5-6.7 ms in both builds, so the one-block
/// route cost the stream about 0.9 ms more than its 21 µs, not explained).
pub const ROUTE_ONE_BLOCK_MAX_PAIRS: u64 = 4096;
// A fused router takes the place of the one-block route, so only regimes that route on one
// block may fuse it.
const _: () = assert!(router::ROUTER_FUSED_MAX_PAIRS <= ROUTE_ONE_BLOCK_MAX_PAIRS);
/// Threads of a combine block.
pub const COMBINE_THREADS: u32 = 128;
/// Threads of a block of the sort kernel (one block per token, each thread copying 16 bytes
/// of its row at a time to each of the token's rows).
pub const SORT_ROWS_THREADS: u32 = 256;
/// Threads of a block of the kernel inverting the row order (one block per token's worth
/// of rows, a thread per row).
pub const INVERT_ROWS_THREADS: u32 = 32;
/// Columns of a token's output row one single-GPU combine block sums: one 16-byte vector
/// of 8 columns per thread. A token's row is spread over blocks rather than looped over by
/// one: at a few tokens a block that walked all of H (7 steps for DeepSeek-V3) took 20 µs
/// of one SM, latency-bound, while the GPU idled (Nsight Compute, one H200, 2026-12-01).
pub const COMBINE_COLUMNS_PER_BLOCK: u32 = COMBINE_THREADS * 8;

/// Blocks of the single-GPU combine per token of a layer of hidden size `hidden`.
pub fn combine_blocks_per_token(hidden: u32) -> u32 {
    hidden.div_ceil(COMBINE_COLUMNS_PER_BLOCK)
}
/// Largest number of experts the routing kernel's shared-memory tables hold.
pub const MAX_EXPERTS: u32 = 1024;
/// Largest number of shared-expert slices (always-hit experts of the routed FFN size).
pub const MAX_SHARED_SLICES: u32 = 64;
/// Largest number of (token, k) pairs in one call: the kernels index pairs, rows and
/// expert offsets with 32-bit `int`.
pub const MAX_PAIRS: u64 = i32::MAX as u64;

/// How long a kernel waits for one flag (another block's or rank's release) before it
/// records a time-out naming the wait, instead of hanging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlagWaitLimit {
    /// GPU clock cycles (`clock64`): what the kernels compare against.
    pub cycles: u64,
    /// Whether the spec's `flag_timeout` set it; else the planner's default.
    pub hinted: bool,
}

/// The default bound: about two seconds at the H200's 1.98 GHz. No correct call waits
/// this long for one flag; a sanitizer's run may (the `flag_timeout` hint).
const DEFAULT_FLAG_WAIT_CYCLES: u64 = 4_000_000_000;

impl Default for FlagWaitLimit {
    fn default() -> Self {
        FlagWaitLimit {
            cycles: DEFAULT_FLAG_WAIT_CYCLES,
            hinted: false,
        }
    }
}

impl FlagWaitLimit {
    /// `layer`'s bound on `target`: its `flag_timeout` at the target's clock, else the
    /// default.
    pub fn of(layer: &ir::Layer, target: &Target) -> Self {
        match layer.schedule.flag_timeout_ns {
            Some(ns) => FlagWaitLimit {
                cycles: (ns as f64 * target.clock_hz / 1e9).round() as u64,
                hinted: true,
            },
            None => FlagWaitLimit::default(),
        }
    }

    /// The bound in seconds at `target`'s clock.
    pub fn seconds(&self, target: &Target) -> f64 {
        self.cycles as f64 / target.clock_hz
    }
}

/// A complete execution plan for one layer on one target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The layer's name in the spec.
    pub layer: String,
    /// C identifier prefix of every generated entry point.
    pub symbol: String,
    /// Entry point of the routing kernel of one block (regimes with few pairs; a fused
    /// router takes its place in a self-routed call).
    pub route_kernel: String,
    /// Entry points of the routing over several blocks (regimes with many pairs): count the
    /// pairs per expert in each block's slice, then place them.
    pub route_count_kernel: String,
    pub route_place_kernel: String,
    /// Entry point of the combine kernel (shared by every regime).
    pub combine_kernel: String,
    /// Entry points of the kernels that copy x's rows into the expert-major order
    /// ([`BufferId::SortedX`]), launched by the regimes whose GEMM1 loads A as tiles: the
    /// inverse of the row order ([`BufferId::PairRow`]), then the copy, token by token.
    pub invert_rows_kernel: String,
    pub sort_rows_kernel: String,
    /// Entry point of a rank's shared expert gate launch, ahead of its arrange, for a layer
    /// whose shared expert is gated ([`LayerShape::shared_gated`]) and whose spec has
    /// expert-parallel ranks; `None` for other layers. (One GPU's GEMM1 computes the gate
    /// itself, before its tiles.)
    #[serde(default)]
    pub shared_gate_kernel: Option<String>,
    pub target: Target,
    pub shape: LayerShape,
    /// Device buffers the runtime allocates once per layer handle.
    pub workspace: Vec<Buffer>,
    /// Token-count regimes in increasing order; each covers `min_tokens..=max_tokens`.
    pub regimes: Vec<Regime>,
    /// How the ranks exchange tokens and results, when the spec has more than one.
    pub expert_parallel: Option<ep::ExpertParallelPlan>,
    /// How the layer routes its tokens itself, when the spec has a router.
    pub router: Option<RouterPlan>,
    /// Single-GPU calls of 1 to this many tokens that repeat (the same token count, routing
    /// mode and buffers) replay a CUDA graph of their launches, which the runtime captures
    /// at the second such call: a graph launch reaches the GPU sooner than the call's
    /// separate launches ([`CALL_GRAPH_MAX_TOKENS`]). 0 (plans written before it): none.
    #[serde(default)]
    pub call_graph_max_tokens: u32,
    /// The bound on every flag wait of the plan's kernels.
    #[serde(default)]
    pub flag_wait_limit: FlagWaitLimit,
    /// The spec's schedule hints this plan does not follow, and what runs instead: a hint
    /// the planner cannot use is an error (`hint_problems`), these are hints the layer as
    /// planned has no use for or cannot give in full. `moeforge check` warns of them. Left
    /// out of `plan.json` when empty, so that directories compiled before it still load.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hints_not_honoured: Vec<String>,
    /// What this plan leaves out of the layer, stated so nobody assumes otherwise.
    pub limitations: Vec<String>,
}

/// The sizes every kernel is specialised to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerShape {
    pub hidden: u32,
    pub ffn: u32,
    pub experts: u32,
    pub top_k: u32,
    pub activation: Activation,
    /// Each expert adds `b1` [E, w1_rows] before the activation and `b2` [E, H] before the
    /// routing weight (f32 on the device); the GEMMs then take them as launch arguments.
    #[serde(default)]
    pub expert_bias: bool,
    pub max_tokens: u32,
    /// The shared experts as always-hit experts of FFN `ffn` each, `count · ffn_shared /
    /// ffn` of them (an MLP of FFN n·F is the sum of n MLPs of FFN F): experts `E..E + S`
    /// of the grouped GEMMs, every token's slots `K..K + S`, routing weight 1.
    #[serde(default)]
    pub shared_slices: u32,
    /// The shared slices' rows of token t are weighted by `sigmoid(x[t] · w_gate)`, the
    /// shared expert gate's (one `[H]` vector, [`LaunchArg::SharedExpertGate`]), rather
    /// than by 1: one GPU's GEMM1 computes them before its tiles, a rank's gate launch
    /// before arrange ([`BufferId::SharedGate`]).
    #[serde(default)]
    pub shared_gated: bool,
    /// Expert-parallel ranks of the spec.
    pub spec_ranks: u32,
    /// Ranks the single-GPU tables run on: always 1 (every expert on one GPU); the
    /// expert-parallel kernels for `spec_ranks` are in [`Plan::expert_parallel`].
    pub executed_ranks: u32,
}

impl LayerShape {
    fn of(layer: &ir::Layer) -> Self {
        LayerShape {
            hidden: layer.hidden,
            ffn: layer.ffn,
            experts: layer.experts,
            top_k: layer.top_k,
            activation: layer.activation,
            expert_bias: layer.expert_bias,
            max_tokens: layer.max_tokens,
            shared_slices: layer
                .shared_experts
                .map_or(0, |shared| shared.count * shared.ffn / layer.ffn),
            shared_gated: layer.shared_experts.is_some_and(|shared| shared.gated),
            spec_ranks: layer.parallel.expert,
            executed_ranks: 1,
        }
    }

    /// Rows of W1 per expert: 2F for gated activations, F otherwise.
    pub fn w1_rows(&self) -> u32 {
        if self.activation.is_gated() {
            2 * self.ffn
        } else {
            self.ffn
        }
    }

    /// Experts of the grouped GEMMs: the routed ones, then the shared slices.
    pub fn gemm_experts(&self) -> u32 {
        self.experts + self.shared_slices
    }

    /// Combine slots of one token: its K routed pairs, then one per shared slice.
    pub fn slots_per_token(&self) -> u32 {
        self.top_k + self.shared_slices
    }

    /// Largest number of combine slots (GEMM rows) in one call: `max_tokens` times
    /// [`Self::slots_per_token`].
    pub fn max_pairs(&self) -> u64 {
        u64::from(self.max_tokens) * u64::from(self.slots_per_token())
    }
}

/// A workspace buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufferId,
    pub elem: ElemType,
    pub elems: u64,
    pub purpose: String,
}

impl Buffer {
    pub fn bytes(&self) -> u64 {
        self.elems * self.elem.size_bytes()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferId {
    /// i32 [E+1]: start row of each expert in the expert-major row order (expert-parallel:
    /// of each local expert, [E/R + 1]).
    ExpertOffsets,
    /// i32 [T·K]: for each row of the expert-major order, its (token, k) pair `t·K + k`.
    RowPair,
    /// bf16 [T·K, F]: activation output of GEMM1, rows in expert-major order.
    Intermediate,
    /// bf16 [T·K, H]: x's rows in the expert-major order (row p holds the token of
    /// `row_pair[p]`), for a GEMM1 that loads its A rows as TMA tiles
    /// ([`RowLoad::Tiles`]).
    SortedX,
    /// i32 [T·K]: the inverse of `row_pair`, each (token, k) pair's row in the expert-major
    /// order, so that the sort reads each token's row of x once. A pair the routing left
    /// out keeps an earlier call's entry, which the sort recognises (its row's `row_pair`
    /// names another pair).
    PairRow,
    /// bf16 [T·K, H]: GEMM2 output scaled by the routing weight, one slot per (token, k).
    /// Expert-parallel, by peers: per own token, a slot per (token, k) where results
    /// travel as pair rows, or a slot per rank where they travel as rank partials
    /// ([`ep::CombineRoute`]).
    CombineSlots,
    /// i32 `[4]`: error code, token, k, offending value (first error of the call wins).
    ErrorWord,
    /// i32 [route blocks, E]: the routing over several blocks' count of each block's pairs
    /// per expert.
    RouteBlockCounts,
    // Expert parallelism (per rank; "by peers" buffers are written by other ranks).
    /// i32 [R, max_tokens]: per destination, the local token in each send slot.
    SendSlots,
    /// i32 `[R]`: tokens this call sends to each destination.
    SendCounts,
    /// bf16 [R · slots, H], by peers: received token rows, one segment per source.
    RecvX,
    /// i32 [E/R · R · rows per segment], by peers: per (local expert, source), the
    /// received slot of each pair.
    RecvSlot,
    /// i32, as `RecvSlot`, by peers: each pair's index `t·K + k` at its origin.
    RecvPair,
    /// f32, as `RecvSlot`, by peers: each pair's routing weight.
    RecvWeight,
    /// i32 [R, E/R + 1], by peers: per source, pairs per local expert, then tokens sent.
    RecvCounts,
    /// u32 `[R]`, by peers: per source, the epoch whose metadata has arrived.
    MetaFlags,
    /// u32 [R · chunks per source], by peers: per source chunk, the epoch it arrived in.
    ChunkFlags,
    /// u32 [R · chunks per source]: per destination chunk, the pieces of it copied so far
    /// in this call (the last copier releases the chunk and puts the count back to zero).
    ChunkPieces,
    /// i32 [E/R · R + 1]: the first GEMM row of each (local expert, source) run, sources in
    /// receive order, then the end (the GEMMs' tile schedule orders tiles by source).
    SegmentOffsets,
    /// u32 `[1]`: blocks of the arrange kernel done with this call's receive index (the last
    /// one returns the sources' credits and puts the count back to zero).
    ArrangeBlocksDone,
    /// u32 [E + R + 2]: the metadata kernel's rows reserved per expert and send slots per
    /// destination in this call, its blocks done (the last block publishes the counts and
    /// puts all three back to zero), then the last epoch whose error word it cleared.
    MetadataCounters,
    /// i32 `[rows]`: per GEMM row, the rank its pair came from (where its result goes).
    RowOrigins,
    /// i32 `[rows]`: per GEMM row, its row of `recv_x` (`source · slots + slot`).
    SegmentRows,
    /// i32 `[rows]`: per GEMM row, its pair at the origin.
    SegmentPairs,
    /// f32 `[rows]`: per GEMM row, its routing weight.
    SegmentWeights,
    /// u32 `[max_tokens]`, by peers: per local token, columns of its slots stored so far.
    CombineCounters,
    /// bf16 [rows, H]: per GEMM row, GEMM2's weighted row, kept here until the combine sums
    /// each received token's rows into one partial for its origin (rank partials only).
    PairResults,
    /// i32 [R · slots + max_tokens, K + shared slices]: per received token (its row of
    /// `recv_x`, `source · slots + slot`, or `R · slots + token` for this rank's own), the
    /// GEMM row + 1 of each of its pairs here, 0 where none (rank partials only; the
    /// combine puts them back to 0).
    ReceivedPairRows,
    /// i32 `[R]`: per source, the tokens it sent this rank in this call (this rank's own: the
    /// call's tokens), copied by the arrange kernel (rank partials only).
    ReceivedTokens,
    /// u32 `[R]`, by peers: per destination, the last epoch whose metadata from this rank it
    /// has consumed; this rank writes a destination's receive index only after that.
    Credits,
    /// u64 [R · peer buffers]: every rank's addresses of the buffers peers write.
    PeerTable,
    // Expert parallelism across nodes (per rank; P = the rank's peers on other nodes, N =
    // the other nodes, one rail peer on each, G = GPUs per node).
    /// bf16 [N · max_tokens · H]: per other node, the rows of this rank's tokens visiting it,
    /// packed per token chunk (a chunk's rows from the chunk's first index on, in token
    /// order; NCCL sends them to the rail peer there).
    NetSendX,
    /// u32 [N · chunks per source]: per other node and token chunk, the rows of it this rank
    /// sends there (the route's counts: the metadata step carries them to the rail peer, and
    /// the host sizes each chunk's NCCL transfers by them).
    NetSendRows,
    /// i32 [N · max_tokens]: per other node and token of this rank visiting it, the token's
    /// row in `NetSendX` (and of its node partial in `NetReturnedX`).
    NetSendRow,
    /// i32 [P · E/R · rows per segment]: per network peer and local expert of its, each
    /// pair's slot, staged as `RecvSlot` would hold it there.
    NetSendSlot,
    /// i32, as `NetSendSlot`: each pair's index `t·K + k` here.
    NetSendPair,
    /// f32, as `NetSendSlot`: each pair's routing weight.
    NetSendWeight,
    /// i32 [P, E/R + 1]: per network peer, pairs per local expert of its, then this rank's
    /// tokens (rows across nodes sit at their token's index).
    NetSendCounts,
    /// u32 [N · max_tokens]: per other node and token of this rank, a bit per rank of that
    /// node the token visits (its local index): the visit mask, staged for the rail peer.
    NetSendMask,
    /// u32, as `NetSendMask`: per rail peer (its node's slot) and token of its, the ranks of
    /// this node the token visits; this rank forwards the token's row to them and sums
    /// their partials of it.
    RecvMask,
    /// u32, as `NetSendRows`: per rail peer (its node's slot) and chunk of its tokens, the
    /// rows of it the rail peer sends here.
    RecvRows,
    /// bf16, as `NetSendX`: per rail peer, the rows of its tokens visiting this node, packed
    /// per chunk as it staged them (this rank copies each to the ranks of its node the token
    /// visits, itself too).
    NetRecvX,
    /// i32, as `NetSendRow`: per rail peer and token of its visiting this node, the token's
    /// row in `NetRecvX` (and of its node partial in `NetReturnX`).
    NetRecvRow,
    /// u32 [N · chunks per source]: per rail peer and token chunk, the epoch its rows arrived
    /// in (the network stream releases it; this rank's dispatch then forwards them).
    NetArrived,
    /// u32 [P + N · chunks per source]: per network peer, the epoch its metadata was
    /// staged in, then per other node each token chunk's (the network stream waits on them).
    NetReady,
    /// bf16 [N · G · max_tokens · H], by the node's ranks: per rail peer (its node's slot)
    /// and rank of this node (its local index), that rank's partial row of each of the rail
    /// peer's tokens it received; this rank sums those of a token into its node partial.
    NodePartials,
    /// u32 `[G]`, by the node's ranks: per rank of this node, the epoch in which it stored
    /// its partials in `NodePartials`.
    NodePartialsReady,
    /// bf16 [N · max_tokens · H]: per rail peer, the node partial of each of its tokens
    /// visiting this node, at the token's row of `NetRecvX` (results across nodes return
    /// reduced per node, packed as the rows came; NCCL sends them).
    NetReturnX,
    /// bf16, as `NetReturnX`: per other node, its node partial of each of this rank's tokens
    /// visiting it, at the token's row of `NetSendX`.
    NetReturnedX,
    /// u32 [N · chunks per source]: per other node and token chunk, the epoch its results
    /// arrived in.
    NetReturnFlags,
    /// u32 `[3]`: the combine's token lanes done storing this call's rank partials for
    /// network origins, lanes done summing node partials, then the epoch in which the
    /// last of them was (the network stream waits on it before it sends them).
    NetPartialsReady,
    // The router (a spec with `router { }`).
    /// f32 [T, E]: the gate's logits `x · W_gateᵀ`, without bias.
    RouterLogits,
    /// u32 [1 + token tiles]: how many token tiles the router has selected, then per token
    /// tile how many of its gate tiles are done; the last arrival resets each to 0.
    RouterTilesDone,
    /// i32 [T·K]: the experts the router chose; a self-routed call passes it as `topk_ids`.
    RoutedIds,
    /// f32 [T·K]: their routing weights; passed as `topk_weights`.
    RoutedWeights,
    // Stream-K (single-GPU mma.sync GEMMs, calls whose last wave is short: [`GemmPlan::stream_k`]).
    /// f32 [2 · grid, BM · B rows], the largest such GEMM's: per block, the partial sums of
    /// the tiles it covers only in part (its first, then its last), in the threads' order.
    StreamKPartials,
    /// u32 [the most tiles a split call has]: per tile, the blocks done with their part of
    /// its reduction; the last one sums the parts, stores the tile and resets the count to 0.
    StreamKTilesDone,
    /// u32 [2 · E' + H / BN of GEMM2 + 2]: the fused decode's counters, zero between calls (see
    /// [`fused_decode::counters_len`]).
    FusedDecodeCounters,
    /// u32 `[2]`: the next work unit of the warp-specialised GEMM1, then GEMM2 (one GPU's, or
    /// a rank's), each pair (or block) claiming its units in order; a launch's last claim
    /// resets its ticket to 0 (zero between calls). See [`MmaEngine::WgmmaWarpSpecialized`].
    UnitTickets,
    /// u32 [2 · (E/R + shared slices) + 3]: a rank's fused decode's counters, zero between
    /// calls (see [`fused_decode::rank_counters_len`]).
    RankFusedCounters,
    /// f32 `[max_tokens]`: per token of the call (a rank's own), the weight of its shared
    /// slices' rows, `sigmoid(x[t] · w_gate)` (a gated shared expert only,
    /// [`LayerShape::shared_gated`]).
    SharedGate,
}

impl BufferId {
    /// The element type the kernels read and write the buffer as.
    pub fn elem(self) -> ElemType {
        match self {
            BufferId::ExpertOffsets
            | BufferId::RowPair
            | BufferId::PairRow
            | BufferId::ErrorWord
            | BufferId::RouteBlockCounts
            | BufferId::SendSlots
            | BufferId::SendCounts
            | BufferId::RecvSlot
            | BufferId::RecvPair
            | BufferId::RecvCounts
            | BufferId::RowOrigins
            | BufferId::SegmentOffsets
            | BufferId::SegmentRows
            | BufferId::SegmentPairs
            | BufferId::RoutedIds
            | BufferId::ReceivedPairRows
            | BufferId::ReceivedTokens
            | BufferId::NetSendSlot
            | BufferId::NetSendPair
            | BufferId::NetSendCounts
            | BufferId::NetSendRow
            | BufferId::NetRecvRow => ElemType::I32,
            BufferId::NetSendMask
            | BufferId::RecvMask
            | BufferId::NetSendRows
            | BufferId::RecvRows => ElemType::U32,
            BufferId::Intermediate
            | BufferId::SortedX
            | BufferId::CombineSlots
            | BufferId::PairResults
            | BufferId::RecvX
            | BufferId::NetSendX
            | BufferId::NetRecvX
            | BufferId::NetReturnX
            | BufferId::NetReturnedX
            | BufferId::NodePartials => ElemType::Bf16,
            BufferId::RecvWeight
            | BufferId::NetSendWeight
            | BufferId::SegmentWeights
            | BufferId::RouterLogits
            | BufferId::RoutedWeights
            | BufferId::SharedGate
            | BufferId::StreamKPartials => ElemType::F32,
            BufferId::MetaFlags
            | BufferId::ChunkFlags
            | BufferId::ChunkPieces
            | BufferId::ArrangeBlocksDone
            | BufferId::MetadataCounters
            | BufferId::CombineCounters
            | BufferId::Credits
            | BufferId::RouterTilesDone
            | BufferId::StreamKTilesDone
            | BufferId::UnitTickets
            | BufferId::FusedDecodeCounters
            | BufferId::RankFusedCounters
            | BufferId::NetReady
            | BufferId::NetArrived
            | BufferId::NetReturnFlags
            | BufferId::NetPartialsReady
            | BufferId::NodePartialsReady => ElemType::U32,
            BufferId::PeerTable => ElemType::U64,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BufferId::ExpertOffsets => "expert_offsets",
            BufferId::RowPair => "row_pair",
            BufferId::Intermediate => "intermediate",
            BufferId::SortedX => "sorted_x",
            BufferId::PairRow => "pair_row",
            BufferId::CombineSlots => "combine_slots",
            BufferId::ErrorWord => "error_word",
            BufferId::RouteBlockCounts => "route_block_counts",
            BufferId::SendSlots => "send_slots",
            BufferId::SendCounts => "send_counts",
            BufferId::RecvX => "recv_x",
            BufferId::RecvSlot => "recv_slot",
            BufferId::RecvPair => "recv_pair",
            BufferId::RecvWeight => "recv_weight",
            BufferId::RecvCounts => "recv_counts",
            BufferId::MetaFlags => "meta_flags",
            BufferId::ChunkFlags => "chunk_flags",
            BufferId::ChunkPieces => "chunk_pieces",
            BufferId::ArrangeBlocksDone => "arrange_blocks_done",
            BufferId::MetadataCounters => "metadata_counters",
            BufferId::RowOrigins => "row_origins",
            BufferId::SegmentOffsets => "segment_offsets",
            BufferId::SegmentRows => "segment_rows",
            BufferId::SegmentPairs => "segment_pairs",
            BufferId::SegmentWeights => "segment_weights",
            BufferId::CombineCounters => "combine_counters",
            BufferId::PairResults => "pair_results",
            BufferId::ReceivedPairRows => "received_pair_rows",
            BufferId::ReceivedTokens => "received_tokens",
            BufferId::PeerTable => "peer_table",
            BufferId::Credits => "credits",
            BufferId::RouterLogits => "router_logits",
            BufferId::RouterTilesDone => "router_tiles_done",
            BufferId::RoutedIds => "routed_ids",
            BufferId::RoutedWeights => "routed_weights",
            BufferId::NetSendX => "net_send_x",
            BufferId::NetSendSlot => "net_send_slot",
            BufferId::NetSendPair => "net_send_pair",
            BufferId::NetSendWeight => "net_send_weight",
            BufferId::NetSendCounts => "net_send_counts",
            BufferId::NetSendMask => "net_send_mask",
            BufferId::RecvMask => "recv_mask",
            BufferId::NetSendRows => "net_send_rows",
            BufferId::NetSendRow => "net_send_row",
            BufferId::RecvRows => "recv_rows",
            BufferId::NetRecvX => "net_recv_x",
            BufferId::NetRecvRow => "net_recv_row",
            BufferId::NetArrived => "net_arrived",
            BufferId::NetReady => "net_ready",
            BufferId::NodePartials => "node_partials",
            BufferId::NodePartialsReady => "node_partials_ready",
            BufferId::NetReturnX => "net_return_x",
            BufferId::NetReturnedX => "net_returned_x",
            BufferId::NetReturnFlags => "net_return_flags",
            BufferId::NetPartialsReady => "net_partials_ready",
            BufferId::StreamKPartials => "stream_k_partials",
            BufferId::StreamKTilesDone => "stream_k_tiles_done",
            BufferId::UnitTickets => "unit_tickets",
            BufferId::FusedDecodeCounters => "fused_decode_counters",
            BufferId::RankFusedCounters => "rank_fused_counters",
            BufferId::SharedGate => "shared_gate",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ElemType {
    Bf16,
    F32,
    I32,
    U32,
    U64,
}

impl ElemType {
    /// The element's type in the generated CUDA source.
    pub fn c_type(self) -> &'static str {
        match self {
            ElemType::Bf16 => "bf16_t",
            ElemType::F32 => "float",
            ElemType::I32 => "int",
            ElemType::U32 => "u32",
            ElemType::U64 => "u64",
        }
    }

    pub fn size_bytes(self) -> u64 {
        match self {
            ElemType::Bf16 => 2,
            ElemType::F32 | ElemType::I32 | ElemType::U32 => 4,
            ElemType::U64 => 8,
        }
    }
}

/// Error codes a kernel writes into the error word; the runtime turns them into typed errors.
pub mod error_code {
    /// `topk_ids[t, k]` is outside `0..E`.
    pub const EXPERT_ID_OUT_OF_RANGE: i32 = 1;
    /// A spin-wait passed its bound: details are the waiting rank, the flag (its kind in
    /// the top byte, see [`flag_kind`], its index below) and the epoch waited for.
    pub const FLAG_TIMEOUT: i32 = 2;
    /// On the expert-parallel path, `topk_ids[t, k]` repeats an expert of an earlier `k`
    /// of the same token (a segment of the receive index holds each token once).
    pub const EXPERT_ID_REPEATED: i32 = 3;

    /// The kinds of flag a time-out names.
    pub mod flag_kind {
        /// A source's metadata flag (index: the source rank).
        pub const META: i32 = 1;
        /// A dispatch chunk (index: source · chunks per source + chunk).
        pub const CHUNK: i32 = 2;
        /// A token's combine counter (index: the token).
        pub const COMBINE: i32 = 3;
        /// A destination's credit (index: the destination rank).
        pub const CREDIT: i32 = 4;
        /// Node partials from another node (index: the rail peer there that returns them ·
        /// chunks per source + the token chunk).
        pub const RETURN: i32 = 5;
        /// The GEMM1 rows of an expert in the fused decode (index: the expert).
        pub const EXPERT_ROWS: i32 = 6;
        /// A rank of this node's partials for the network origins this rank relays for
        /// (index: the rank).
        pub const NODE_PARTIALS: i32 = 7;
        /// A chunk of rows from a rail peer on another node, for this rank to relay (index:
        /// the rail peer · chunks per source + the token chunk).
        pub const ARRIVED: i32 = 8;
    }
}

/// One token-count range and the kernels that serve it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Regime {
    /// `decode`, `mid` or `prefill` (`all` when it is the only one; a rank's extra regimes
    /// `small` and `large`): used in entry-point names.
    pub name: String,
    pub min_tokens: u32,
    pub max_tokens: u32,
    pub gemm1: GemmPlan,
    pub gemm2: GemmPlan,
    /// Entry points of this regime's two GEMMs.
    pub gemm1_kernel: String,
    pub gemm2_kernel: String,
    /// The launches of one forward call, in stream order.
    pub launches: Vec<Launch>,
    /// The tuning table's entry its GEMMs came from, if they did.
    #[serde(default)]
    pub tuned: Option<tuning::TunedRegime>,
    /// Its smallest calls as one persistent kernel, in place of `launches`.
    #[serde(default)]
    pub fused_decode: Option<FusedDecode>,
}

impl Regime {
    /// How its calls of few pairs run without a route launch, each GEMM block routing the
    /// call itself: where both GEMMs can (mma.sync on one GPU) and a call of the regime can
    /// be that small.
    pub fn block_routing(&self, top_k: u32) -> Option<BlockRouting> {
        match (self.gemm1.block_routing, self.gemm2.block_routing) {
            (Some(up), Some(down)) if up == down && up.covers(self.min_tokens, top_k) => Some(up),
            _ => None,
        }
    }

    /// The largest calls for which a fused router leaves out the routing metadata: those
    /// the fused decode or the GEMMs' blocks route themselves (0: none).
    pub fn router_metadata_left_out_max_tokens(&self, top_k: u32) -> u32 {
        let fused = self
            .fused_decode
            .as_ref()
            .map_or(0, |fused| fused.max_tokens);
        let blocks = self
            .block_routing(top_k)
            .map_or(0, |routing| routing.max_tokens(top_k).min(self.max_tokens));
        fused.max(blocks)
    }

    /// Whether a call of `tokens` tokens runs without its route launch, routed in the
    /// GEMMs' blocks.
    pub fn routes_in_blocks(&self, tokens: u32, top_k: u32) -> bool {
        self.block_routing(top_k)
            .is_some_and(|routing| routing.covers(tokens, top_k))
    }

    /// The table's launches, then the fused decode's (which a call of up to its
    /// `max_tokens` tokens runs instead).
    pub fn all_launches(&self) -> impl Iterator<Item = &Launch> {
        self.launches
            .iter()
            .chain(self.fused_decode.iter().map(|fused| &fused.launch))
    }

    /// Whether GEMM1 loads x's rows from a copy sorted by expert, which the sort launches
    /// make between the routing and GEMM1.
    pub fn sorts_x_rows(&self) -> bool {
        self.gemm1.a_load == RowLoad::Tiles
    }

    /// The largest calls whose GEMM2 starts early beside GEMM1, where GEMM2's blocks would
    /// otherwise sit beside GEMM1's from its start: a GEMM2 block fits an SM's shared
    /// memory (`smem_per_sm` bytes; registers are not counted) beside GEMM1's resident
    /// blocks (mma.sync GEMMs, both started early). Larger calls start GEMM2 as GEMM1's
    /// blocks finish (GEMM1 does not signal it). `None`: no such limit (GEMM2's blocks
    /// enter only as GEMM1's leave, or every call of the regime is within the bound).
    /// GEMM1 reads the call's token count only where it can route a call in its blocks,
    /// so only such a GEMM1 has the limit. On an H100 DeepSeek-V3's decode GEMM1 holds one
    /// 123 KB block per SM, and GEMM2 started early cost 0.3-1.6% from 192 tokens on while
    /// it saved 0.3-2% at 1-16 (`benches/results/2026-12-06_h100_early_start_by_launch.md`).
    pub fn gemm2_early_max_tokens(&self, smem_per_sm: u32) -> Option<u32> {
        let early = |kernel: &str| {
            self.launches
                .iter()
                .any(|launch| launch.kernel == kernel && launch.early_start)
        };
        let beside = self.gemm1.engine == MmaEngine::MmaSync
            && self.gemm2.engine == MmaEngine::MmaSync
            && self.gemm1.block_routing.is_some()
            && early(&self.gemm1_kernel)
            && early(&self.gemm2_kernel)
            && self.gemm1.blocks_per_sm * self.gemm1.smem.resident_bytes()
                + self.gemm2.smem.resident_bytes()
                <= smem_per_sm;
        beside
            .then_some(GEMM2_BESIDE_GEMM1_MAX_TOKENS)
            .filter(|&tokens| (self.min_tokens..self.max_tokens).contains(&tokens))
    }
}

/// The largest calls whose GEMM2 starts early where its blocks fit beside GEMM1's
/// ([`Regime::gemm2_early_max_tokens`]): on an H100, DeepSeek-V3's GEMM2 started early was
/// level with starting at GEMM1's end at 64 and 128 tokens and cost from 192 on.
pub const GEMM2_BESIDE_GEMM1_MAX_TOKENS: u32 = 128;

/// A regime's parts as `describe` and `validate` read them, single-GPU or expert-parallel.
pub(crate) struct RegimeParts<'a> {
    pub name: &'a str,
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// GEMM1 and GEMM2, each with its entry point.
    pub gemms: [(&'a GemmPlan, &'a String); 2],
    pub launches: &'a [Launch],
    /// The tuning table's entry the GEMMs came from.
    pub tuned: Option<&'a tuning::TunedRegime>,
    /// Its smallest calls as one kernel.
    pub fused_decode: Option<&'a FusedDecode>,
    /// Whether it is a rank's regime of the expert-parallel path.
    pub expert_parallel: bool,
}

impl Regime {
    pub(crate) fn parts(&self) -> RegimeParts<'_> {
        RegimeParts {
            name: &self.name,
            min_tokens: self.min_tokens,
            max_tokens: self.max_tokens,
            gemms: [
                (&self.gemm1, &self.gemm1_kernel),
                (&self.gemm2, &self.gemm2_kernel),
            ],
            launches: &self.launches,
            tuned: self.tuned.as_ref(),
            fused_decode: self.fused_decode.as_ref(),
            expert_parallel: false,
        }
    }
}

/// The tensor-core instruction family a GEMM is written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MmaEngine {
    /// `mma.sync` m16n8k16 per warp, `ldmatrix` from shared memory (any sm_80+).
    MmaSync,
    /// `wgmma` m64nNk16 from shared-memory descriptors in consumer warpgroups (64 rows
    /// each), fed by a producer warpgroup (TMA for weights, cp.async for gathered rows)
    /// through a ring of stages guarded by mbarriers, registers split with `setmaxnreg`
    /// (sm_90a). Its blocks (pairs) claim their work units in order from a ticket
    /// ([`BufferId::UnitTickets`], one GPU's or a rank's) rather than by block index: the
    /// units running at any moment stay a contiguous run, so the tiles that read one weight
    /// panel or one expert's rows run together and read them once from DRAM. Dealt by block
    /// index, blocks drifted apart over a large call's waves (an expert's part-empty last
    /// tile costs what a full one does, or not), and measured on an H100 (2026-12-06,
    /// uniform routing) claiming took DeepSeek-V3's prefill GEMM1 at 16384 tokens from 43 to
    /// 25 GB of DRAM reads and 15.4 to 12.2 ms, and 1-11% off the large uniform calls
    /// (`benches/results/2026-12-06_tail_unit_order.md`); on two virtual ranks, 16-26% off
    /// DeepSeek-V3's calls (`benches/results/2026-12-06_ep_unit_claims.md`).
    WgmmaWarpSpecialized,
}

impl MmaEngine {
    pub fn name(self) -> &'static str {
        match self {
            MmaEngine::MmaSync => "mma.sync",
            MmaEngine::WgmmaWarpSpecialized => "wgmma-ws",
        }
    }

    /// Whether the engine issues `wgmma` (and needs its shared-memory layout and widths).
    pub fn is_wgmma(self) -> bool {
        matches!(self, MmaEngine::WgmmaWarpSpecialized)
    }

    /// Whether the engine's kernels take stages `k` deep: [`TILE_K`] on both (wgmma's
    /// 128-byte swizzle), [`DEEP_TILE_K`] on mma.sync.
    pub fn takes_tile_k(self, k: u32) -> bool {
        k == TILE_K || (self == MmaEngine::MmaSync && k == DEEP_TILE_K)
    }
}

/// The roles of a warp-specialised block: one producer warpgroup that loads stages, the
/// consumer warpgroups (`warps_m / 4`) that multiply, and the register file split between
/// them with `setmaxnreg` (0: the split is left to the compiler).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarpRoles {
    pub producer_warps: u32,
    pub producer_registers: u32,
    pub consumer_registers: u32,
}

/// Registers a producer warpgroup keeps after `setmaxnreg.dec`: it only computes addresses
/// and issues copies. ptxas 13.0 spills 4 bytes at 40 in Mixtral's expert-parallel GEMM1
/// (whose producer also waits for dispatch chunks) and none at 48 in any shipped example.
const PRODUCER_REGISTERS: u32 = 48;
/// The most registers a thread can hold.
const MAX_REGISTERS_PER_THREAD: u32 = 256;

impl WarpRoles {
    /// One producer warpgroup beside `consumer_warpgroups`, one block per SM: the producer
    /// gives up what it does not need and the consumers share it. With one consumer
    /// warpgroup the compiler's cap (255 at 256 threads) is already enough: no split.
    fn one_block_per_sm(consumer_warpgroups: u32) -> Self {
        let producer_warps = 4;
        let threads = 128 * (1 + consumer_warpgroups);
        let cap = (65_536 / threads).min(MAX_REGISTERS_PER_THREAD) / 8 * 8;
        let (producer_registers, consumer_registers) = if cap >= MAX_REGISTERS_PER_THREAD - 8 {
            (0, 0)
        } else {
            let freed = cap - PRODUCER_REGISTERS;
            let consumer =
                (cap + freed / consumer_warpgroups).min(MAX_REGISTERS_PER_THREAD) / 8 * 8;
            (PRODUCER_REGISTERS, consumer)
        };
        WarpRoles {
            producer_warps,
            producer_registers,
            consumer_registers,
        }
    }
}

/// Which calls of a GEMM run stream-K: those whose last wave of whole tiles (the tiles
/// left after the full waves over the grid) has 1 to `max_last_wave` tiles, up to
/// `max_tiles` tiles in all (the size of the arrival counters), and in which every routed
/// expert's rows fit one m-tile. The last condition keeps a call's result the same from
/// one call to the next: stream-K splits a tile's k-loop where the tile's place in the
/// call puts it, and the route places a routed expert's rows in atomic order, so a row
/// that could land in either of two m-tiles was summed in two ways (found on one H200,
/// 2026-12-02: Qwen3-30B-A3B at 163-219 tokens replayed from a CUDA graph wrote other
/// bits than the same call run eagerly; every output was within the reference's bound).
///
/// Dealt whole, a wave of n tiles of b bytes takes about max(n·b / HBM, b / one block's
/// rate): a short last wave streams at a few blocks' pace while the rest idle. Split, the
/// call's bytes stream at the HBM rate, plus [`STREAM_K_MEETING_S`] for the partial sums'
/// write, fence, count and read. So a last wave of n tiles pays to split while
/// b / rate − n·b / HBM exceeds that. Fitted on one H200 (2026-12-01, decode GEMMs at one
/// token, Nsight Compute; tile bytes here are the weight rows', the A rows add an eighth
/// or a fifth): it gained 11 µs on DeepSeek-V3's GEMM1 (288 tiles of 1.8 MB on 264 blocks:
/// a last wave of 24) and 7 µs on Mixtral's GEMM2 (64 tiles of 3.7 MB on 264), and lost
/// 3-7 µs where the last wave streams at the HBM rate anyway (Qwen3-30B-A3B's 96 and 128
/// tiles of 0.2-0.5 MB, GPT-OSS's 180 of 0.4-0.7 MB, DeepSeek-V3's GEMM2 and Mixtral's
/// GEMM1, last waves of 480 and 184).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamKTail {
    pub max_last_wave: u32,
    pub max_tiles: u32,
}

/// What meeting in a split tile costs a stream-K GEMM, seconds (see [`StreamKTail`]).
pub const STREAM_K_MEETING_S: f64 = 5e-6;
/// The latency one block's ring of loads in flight covers, seconds: a block with
/// `(stages − 1) · stage bytes` in flight streams that much per this long (Mixtral's decode
/// GEMM2 at one token, 64 blocks alone with 74 KB each in flight: 50 GB/s a block).
const ONE_BLOCK_LOAD_LATENCY_S: f64 = 1.5e-6;
/// Stream-K splits calls of up to this many waves of tiles; above, a short last wave
/// weighs little.
const STREAM_K_MAX_WAVES: u32 = 8;

impl StreamKTail {
    /// The calls that pay to split for a GEMM of `tile_bytes` per tile (A and B rows over
    /// the reduction) with `in_flight` bytes of loads per block on `grid` blocks; `None`
    /// where none does.
    pub fn of(target: &Target, grid: u32, tile_bytes: u64, in_flight: u64) -> Option<Self> {
        let block_rate = in_flight as f64 / ONE_BLOCK_LOAD_LATENCY_S;
        let tile = tile_bytes as f64;
        // n < HBM / rate − meeting · HBM / b
        let limit = target.hbm_bytes_per_s / block_rate
            - STREAM_K_MEETING_S * target.hbm_bytes_per_s / tile;
        let max_last_wave = (limit.ceil() - 1.0).clamp(0.0, f64::from(grid - 1)) as u32;
        (max_last_wave > 0).then_some(StreamKTail {
            max_last_wave,
            max_tiles: STREAM_K_MAX_WAVES * grid,
        })
    }

    /// Whether a call of `tiles` tiles on `grid` blocks splits, given whether every routed
    /// expert's rows fit one m-tile.
    pub fn splits(self, tiles: u32, grid: u32, routed_rows_fit_one_m_tile: bool) -> bool {
        let last_wave = tiles % grid;
        tiles <= self.max_tiles
            && last_wave >= 1
            && last_wave <= self.max_last_wave
            && routed_rows_fit_one_m_tile
    }
}

/// Calls of at most this many (token, k) pairs run without a route launch on one GPU where
/// both GEMMs of their regime are mma.sync: each GEMM block lays out the call's routing
/// in its own shared memory (`route_in_block`, `compiler/templates/routing.cu`), rows in
/// pair order. The route launch's ramp and the wait for it sit on a decode call's critical
/// path: GEMM1 cannot ask for a weight before it knows its experts. Measured on one H200
/// (2026-12-03, caller-routed, against the route launch): one-token calls 5-7% faster for
/// Qwen3-30B-A3B and GPT-OSS-120B, 1-2% for DeepSeek-V3 and Mixtral-8x7B; 2-4 tokens 2-3%
/// (Qwen3, GPT-OSS); larger calls 2-3 µs (`benches/results/2026-12-03_block_routing.md`).
pub const BLOCK_ROUTING_MAX_PAIRS: u32 = 128;

/// How a single-GPU mma.sync GEMM routes the calls of at most `max_pairs` (token, k)
/// pairs itself, in each block (see [`BLOCK_ROUTING_MAX_PAIRS`]): its static shared
/// memory holds the tables for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRouting {
    pub max_pairs: u32,
}

impl BlockRouting {
    /// Whether a call of `tokens` tokens routes in the blocks.
    pub fn covers(self, tokens: u32, top_k: u32) -> bool {
        u64::from(tokens) * u64::from(top_k) <= u64::from(self.max_pairs)
    }

    /// The most tokens a call it covers has.
    pub fn max_tokens(self, top_k: u32) -> u32 {
        self.max_pairs / top_k.max(1)
    }

    /// Ints of the tables a block of a GEMM of `problem` routes in: each GEMM expert's first
    /// row (E' + 1), fill counts (E'), the row table (every pair, and every token once per
    /// shared slice). `block_routing_ints` in `gemm.cu` says the same.
    pub fn table_ints(self, problem: &GemmProblem) -> u32 {
        let gemm_experts = problem.experts + problem.always_hit;
        2 * gemm_experts + 1 + self.max_pairs + self.max_tokens(problem.top_k) * problem.always_hit
    }
}

/// How one grouped GEMM is tiled and launched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmPlan {
    pub engine: MmaEngine,
    pub tile: TileShape,
    pub stages: u32,
    /// The warps that multiply. mma.sync: warps along rows and columns; wgmma: 4 warps per
    /// 64 rows, 1 along columns.
    pub warps_m: u32,
    pub warps_n: u32,
    /// The warp-specialised engine's producer and register split (`None` on the others).
    pub warp_roles: Option<WarpRoles>,
    /// Rows of B loaded per tile: 2·n for the gated GEMM1 (gate and up), n otherwise.
    pub b_rows: u32,
    /// How a stage's A rows are loaded.
    pub a_load: RowLoad,
    /// How the epilogue writes its output rows.
    pub store: OutputStore,
    /// Dynamic shared memory of one block (`smem.dynamic_bytes`), what the launch asks for.
    pub smem_bytes: u32,
    /// Where everything sits in shared memory; codegen writes these numbers out.
    pub smem: SmemLayout,
    pub blocks_per_sm: u32,
    /// Persistent grid: blocks launched, each looping over tiles (a multiple of `cluster`).
    pub grid_blocks: u32,
    /// Stream-K: which calls split the k-loops of all their tiles evenly over the grid,
    /// each block a contiguous run of k-tiles, rather than dealing whole tiles round robin;
    /// a tile split between blocks is summed and stored by the last of them. Single-GPU
    /// mma.sync GEMMs whose tiles are large enough for it to pay (`None` elsewhere).
    #[serde(default)]
    pub stream_k: Option<StreamKTail>,
    /// Which calls its blocks route themselves, without a route launch (single-GPU
    /// mma.sync GEMMs; `None` elsewhere).
    #[serde(default)]
    pub block_routing: Option<BlockRouting>,
    /// Blocks per thread-block cluster: 1, or 2 for a warp-specialised pair that works on
    /// two tiles of one weight panel at a time, each block loading half of the panel's
    /// stage and multicasting it to both (see [`CLUSTER_PAIR`]).
    pub cluster: u32,
    /// The cost model's estimate at the regime's representative token count.
    pub estimate: GemmEstimate,
    /// Whether the cost model, a schedule hint or the tuning table chose it.
    #[serde(default)]
    pub source: tuning::ChoiceSource,
}

impl GemmPlan {
    pub fn threads(&self) -> u32 {
        let producer_warps = self.warp_roles.map_or(0, |roles| roles.producer_warps);
        32 * (self.warps_m * self.warps_n + producer_warps)
    }

    /// Whether this GEMM claims its work units in order from a ticket
    /// ([`BufferId::UnitTickets`], in one GPU's workspace or a rank's): the
    /// warp-specialised engine does (see [`MmaEngine::WgmmaWarpSpecialized`]).
    pub fn claims_units(&self) -> bool {
        self.engine == MmaEngine::WgmmaWarpSpecialized
    }

    /// Whether this GEMM can run as a cluster pair: a warp-specialised tile of two consumer
    /// warpgroups (128 rows), a persistent grid of whole pairs, and a weight panel that
    /// splits into two boxes (gate and up, or halves on the swizzle's 8-row period).
    pub fn can_pair(&self) -> bool {
        self.engine == MmaEngine::WgmmaWarpSpecialized
            && self.tile.m == 128
            && self.grid_blocks.is_multiple_of(CLUSTER_PAIR)
            && (self.b_rows > self.tile.n || self.tile.n.is_multiple_of(2 * 8))
    }

    /// Whether a call with `tiles` tiles, whose routed experts have at most
    /// `most_routed_rows` rows each, runs stream-K.
    pub fn runs_stream_k(&self, tiles: f64, most_routed_rows: f64) -> bool {
        self.stream_k.is_some_and(|tail| {
            tail.splits(
                tiles.round() as u32,
                self.grid_blocks,
                most_routed_rows <= f64::from(self.tile.m),
            )
        })
    }

    /// Floats of [`BufferId::StreamKPartials`] this GEMM needs (0 without stream-K): two
    /// partial tiles per block.
    pub fn stream_k_partial_floats(&self) -> u64 {
        self.stream_k.map_or(0, |_| {
            2 * u64::from(self.grid_blocks) * u64::from(self.tile.m) * u64::from(self.b_rows)
        })
    }

    /// Rows of one TMA box of weights: a stage's B rows come in two boxes when the gated
    /// GEMM1 loads gate and up rows, or when a cluster pair splits the panel between its
    /// blocks; one box otherwise.
    pub fn weight_box_rows(&self) -> u32 {
        if self.b_rows > self.tile.n || self.cluster == 1 {
            self.tile.n
        } else {
            self.tile.n / 2
        }
    }
}

/// How a GEMM block loads the A rows of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowLoad {
    /// Row by row with `cp.async`, through the tile's row-source table: GEMM1 gathers its
    /// tokens' rows of x where the planner does not sort them (`gemm1_row_load`), and
    /// every expert-parallel GEMM reads rows where they arrived. (Gathering by TMA instead,
    /// a box of one row per producer thread, was measured 19-81% slower than both ways on
    /// the four examples' prefill GEMM1s: the TMA unit takes about 20 cycles per box, so 128
    /// boxes per stage outlast the stage's multiply; one H200, 2026-12-02.)
    Gathered,
    /// As TMA boxes of the tile's `BM` consecutive expert-major rows on the warp-specialised
    /// engine: the single-GPU GEMM2's from the intermediate, and the single-GPU GEMM1's where
    /// `gemm1_row_load` sorts them, from [`BufferId::SortedX`] (x's rows copied into that
    /// order by the invert and sort kernels): one copy per stage by one thread, where the
    /// gather costs the producer warps a `cp.async` per 16 bytes and the consumers a proxy
    /// fence per stage. Measured without any A loads,
    /// Mixtral-8x7B's GEMM2 at 4096 tokens ran 26% faster (1.20 against 1.63 ms, Nsight
    /// Compute, one H200, 2026-11-30); with A loaded only on the ring's first pass, GEMM1
    /// ran 13-24% faster (DeepSeek-V3 and Mixtral at 4096 tokens, Qwen3-30B-A3B and
    /// GPT-OSS-120B at 16384; 2026-12-01).
    Tiles,
}

/// How a GEMM's epilogue writes its output rows from the accumulators, where each lane of
/// a quad holds two adjacent columns of every 8-column block of one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputStore {
    /// Each lane stores its two columns (4 bytes) of each block.
    Pairs,
    /// The quad first trades words (four shuffles per four blocks), so that each lane stores
    /// one block's 8 columns (16 bytes) and a quad 64 consecutive bytes of the row; the
    /// warp-specialised GEMM2, whose epilogue is one multiply per pair (on the
    /// expert-parallel path too, into the origin's combine slots: checked on virtual ranks,
    /// not yet measured across GPUs). Measured on one H200
    /// (Nsight Compute, 2026-11-30): Qwen3-30B-A3B's GEMM2 836 → 717 µs at 16384 tokens
    /// and 135 → 116 µs at 1024, DeepSeek-V3's 2.76 → 2.62 ms at 4096. The gated GEMM1,
    /// whose epilogue is an activation per pair, got 2-6% slower with it, so it keeps pairs.
    QuadVectors,
}

/// Blocks in a cluster pair. The pair walks a list of work units: two m-tiles of one
/// weight panel (each block loads half of every stage's B rows and multicasts it to both,
/// so each block reads `BM + B_rows / 2` rows from L2 instead of `BM + B_rows`), or, for an
/// expert with an odd count of m-tiles, its last m-tile's n-tiles two at a time (no
/// sharing; the second block of a unit past the last n-tile has no rows), each right after
/// the pairs' units of its two n-tiles, so that it reads their weight panels from L2.
pub const CLUSTER_PAIR: u32 = 2;

/// The shared-memory layout of one GEMM block. Dynamic memory is
/// `[align slack][stage 0 .. stage S-1][row sources: i32 × BM][stage barriers]`, the ring
/// starting on a `ring_align` boundary, the barriers (warp-specialised engine only: a
/// "full" and an "empty" mbarrier per stage) 8-byte aligned; static memory is the
/// tile-start table, i32 × (E + 1), then the tables a block routes a call in where it
/// does ([`BlockRouting::table_ints`]). The generated code asserts that its own layout
/// adds up to these numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmemLayout {
    /// Bytes of one row of a stage (the tile's k bf16, swizzled in 16-byte chunks).
    pub row_bytes: u32,
    /// Bytes of the A rows of one stage (`BM` rows).
    pub a_bytes: u32,
    /// Bytes of one stage: `BM + b_rows` rows.
    pub stage_bytes: u32,
    /// Boundary the stage ring starts on inside dynamic shared memory.
    pub ring_align: u32,
    /// Bytes reserved in front of the ring to reach that boundary.
    pub align_slack: u32,
    /// Offset of the row-source table from the start of the ring: `stages · stage_bytes`.
    pub row_source_offset: u32,
    /// Offset of the stage barriers from the start of the ring: `row_source_offset + 4·BM`.
    pub barrier_offset: u32,
    /// `align_slack + barrier_offset + 16·stages +` [`unit_slot_bytes`] (warp-specialised)
    /// or `align_slack + barrier_offset` (no barriers).
    pub dynamic_bytes: u32,
    /// The static tile-start table, `4·(groups + 1)` bytes (a group per expert, or per
    /// (source, local expert) on the expert-parallel path), and the routing tables (4 bytes
    /// per int), as reserved (rounded up to [`STATIC_SMEM_GRANULE`]).
    pub static_bytes: u32,
}

impl SmemLayout {
    /// The layout of a block whose tile table covers `tile_groups` groups of rows, with
    /// `routing_ints` ints of routing tables.
    pub fn new(
        engine: MmaEngine,
        tile: TileShape,
        b_rows: u32,
        stages: u32,
        tile_groups: u32,
        routing_ints: u32,
    ) -> Self {
        let row_bytes = tile.k * 2;
        let stage_bytes = (tile.m + b_rows) * row_bytes;
        // Each ring moves up to its boundary at run time, within a full period of slack
        // whatever alignment the allocation really gets: declared 128-byte aligned, only 16
        // bytes are guaranteed, and kernels once linked from relocatable objects got no more
        // (measured on the H200, 2026-12-01: mma.sync GEMMs 20-26% slower when their ring
        // started there).
        let ring_align = if engine.is_wgmma() {
            WGMMA_RING_ALIGN
        } else {
            MMA_SYNC_RING_ALIGN
        };
        let align_slack = ring_align;
        let barrier_bytes = match engine {
            MmaEngine::WgmmaWarpSpecialized => 16 * stages + unit_slot_bytes(stages),
            MmaEngine::MmaSync => 0,
        };
        let row_source_offset = stages * stage_bytes;
        let barrier_offset = row_source_offset + 4 * tile.m;
        SmemLayout {
            row_bytes,
            a_bytes: tile.m * row_bytes,
            stage_bytes,
            ring_align,
            align_slack,
            row_source_offset,
            barrier_offset,
            dynamic_bytes: align_slack + barrier_offset + barrier_bytes,
            static_bytes: static_smem_reserved(4 * (tile_groups + 1 + routing_ints)),
        }
    }

    /// Everything one block holds in shared memory.
    pub fn total_bytes(&self) -> u32 {
        self.dynamic_bytes + self.static_bytes
    }

    /// What a resident block of this layout takes of its SM's shared memory: its own, and
    /// what the driver reserves per block.
    pub fn resident_bytes(&self) -> u32 {
        self.total_bytes() + SMEM_RESERVED_PER_BLOCK
    }
}

/// Shared memory the driver reserves for each resident block, bytes.
pub const SMEM_RESERVED_PER_BLOCK: u32 = 1024;

/// Bytes after the stage barriers of a warp-specialised block of `stages` stages: the slots
/// through which a pair's claimed work units reach every thread of both blocks, an mbarrier
/// each, then the units. `stages + 1` slots: a producer can run at most `stages` k-tiles,
/// so at most `stages` units, ahead of the slowest reader, whatever a unit's k-tiles.
pub fn unit_slot_bytes(stages: u32) -> u32 {
    (stages + 1) * (8 + 4)
}

/// A schedule hint of the spec, named as the language writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HintKey {
    Gemm1Tile,
    Gemm2Tile,
    Stages,
    CommBlocks,
}

impl HintKey {
    pub fn name(self) -> &'static str {
        match self {
            HintKey::Gemm1Tile => "gemm1.tile",
            HintKey::Gemm2Tile => "gemm2.tile",
            HintKey::Stages => "stages",
            HintKey::CommBlocks => "comm_blocks",
        }
    }
}

/// Why one schedule hint cannot be planned on a target.
#[derive(Clone, Debug, PartialEq)]
pub struct HintProblem {
    pub key: HintKey,
    /// The hint as written, e.g. `gemm1.tile = 64x96x64`.
    pub hint: String,
    pub reason: String,
}

#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    #[error(
        "layer `{layer}`: {experts} experts exceed the {max} the routing kernel supports; split the layer"
    )]
    TooManyExperts {
        layer: String,
        experts: u32,
        max: u32,
    },
    #[error("layer `{layer}`: schedule hint `{}` cannot be used on {target}: {}", problem.hint, problem.reason)]
    ImpossibleHint {
        layer: String,
        target: String,
        problem: HintProblem,
    },
    #[error("layer `{layer}`: no tile fits {what}: {reason}")]
    NoFeasibleTile {
        layer: String,
        what: String,
        reason: String,
    },
    #[error("layer `{layer}`: its ranks do not fit the {target}: {reason}")]
    RanksDoNotFit {
        layer: String,
        target: String,
        reason: String,
        /// The most virtual ranks that fit this target with one communication block each.
        most_virtual_ranks: u32,
    },
}

/// Which of the two grouped GEMMs a tile is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKind {
    /// Gather x, multiply by W1, apply the activation.
    Up,
    /// Multiply by W2, scale by the routing weight, store to the combine slot.
    Down,
}

impl GemmKind {
    fn hint_key(self) -> HintKey {
        match self {
            GemmKind::Up => HintKey::Gemm1Tile,
            GemmKind::Down => HintKey::Gemm2Tile,
        }
    }
}

/// The problem one grouped GEMM solves, independent of tiling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmProblem {
    pub kind: GemmKind,
    pub experts: u32,
    pub top_k: u32,
    /// Experts every token hits besides its top-k: the shared slices on one GPU.
    pub always_hit: u32,
    /// Output columns (F for GEMM1, H for GEMM2).
    pub n: u32,
    /// Reduction depth (H for GEMM1, F for GEMM2).
    pub k: u32,
    /// Whether B carries two rows (gate, up) per output column.
    pub gated: bool,
    /// Runs of rows per expert the tile schedule orders tiles by: 1 on one GPU; on a rank
    /// of the expert-parallel path, one per source rank (tiles on rows already here first).
    pub row_phases: u32,
}

impl GemmProblem {
    /// Runs of rows the tile schedule counts: one per expert (routed or always hit) and
    /// row phase.
    pub fn row_groups(&self) -> u32 {
        (self.experts + self.always_hit) * self.row_phases
    }

    /// How an mma.sync GEMM of this problem routes small calls in its blocks: on one GPU,
    /// where a call of one token fits [`BLOCK_ROUTING_MAX_PAIRS`].
    pub fn block_routing(&self, engine: MmaEngine) -> Option<BlockRouting> {
        (engine == MmaEngine::MmaSync
            && self.row_phases == 1
            && self.top_k <= BLOCK_ROUTING_MAX_PAIRS)
            .then_some(BlockRouting {
                max_pairs: BLOCK_ROUTING_MAX_PAIRS,
            })
    }

    /// Rows of one expert's weight matrix: N, or gate and up rows (2·N) when gated.
    pub fn weight_rows(&self) -> u32 {
        if self.gated { 2 * self.n } else { self.n }
    }

    pub(crate) fn for_layer(shape: &LayerShape, kind: GemmKind, row_phases: u32) -> Self {
        let (n, k, gated) = match kind {
            GemmKind::Up => (shape.ffn, shape.hidden, shape.activation.is_gated()),
            GemmKind::Down => (shape.hidden, shape.ffn, false),
        };
        GemmProblem {
            kind,
            experts: shape.experts,
            top_k: shape.top_k,
            always_hit: shape.shared_slices,
            n,
            k,
            gated,
            row_phases,
        }
    }
}

/// Makes the plan of `layer` for `target`.
pub fn plan(layer: &ir::Layer, target: &Target) -> Result<Plan, PlanError> {
    plan_tuned(layer, target, &tuning::TuningTable::default())
}

/// [`plan`], with each single-GPU regime's GEMMs taken from `tuning` where it has an entry
/// for this GPU, shape and regime and the spec hints nothing for that GEMM. An entry this
/// build cannot plan is left out, and the plan's limitations say so. Where the target's
/// devices cannot hold the plan, its limitations say so too, with the largest
/// `max_tokens` that would fit ([`memory::memory_problem`]).
pub fn plan_tuned(
    layer: &ir::Layer,
    target: &Target,
    tuning: &tuning::TuningTable,
) -> Result<Plan, PlanError> {
    let mut plan = plan_as_sized(layer, target, tuning)?;
    if let Some(problem) = memory_problem_of(&plan, layer, tuning) {
        plan.limitations.push(problem.to_string());
    }
    Ok(plan)
}

/// Whether the devices of `layer`'s plan for `target` can hold it (see
/// [`memory::memory_problem`]); `None` where they can, or where the layer does not plan.
pub fn memory_problem(layer: &ir::Layer, target: &Target) -> Option<memory::MemoryProblem> {
    let tuning = tuning::TuningTable::default();
    let plan = plan_as_sized(layer, target, &tuning).ok()?;
    memory_problem_of(&plan, layer, &tuning)
}

/// [`memory::memory_problem`] of `plan`, made of `layer` with `tuning`.
fn memory_problem_of(
    plan: &Plan,
    layer: &ir::Layer,
    tuning: &tuning::TuningTable,
) -> Option<memory::MemoryProblem> {
    memory::memory_problem(plan, |max_tokens| {
        let mut sized = layer.clone();
        sized.max_tokens = max_tokens;
        plan_as_sized(&sized, &plan.target, tuning)
    })
}

/// [`plan_tuned`], its buffers sized by the layer's `max_tokens` whether or not they fit.
fn plan_as_sized(
    layer: &ir::Layer,
    target: &Target,
    tuning: &tuning::TuningTable,
) -> Result<Plan, PlanError> {
    if layer.experts > MAX_EXPERTS {
        return Err(PlanError::TooManyExperts {
            layer: layer.name.clone(),
            experts: layer.experts,
            max: MAX_EXPERTS,
        });
    }
    if let Some(problem) = hint_problems(layer, target).into_iter().next() {
        return Err(PlanError::ImpossibleHint {
            layer: layer.name.clone(),
            target: target.name.clone(),
            problem,
        });
    }
    let shape = LayerShape::of(layer);
    let symbol = c_identifier(&layer.name);
    let route_kernel = format!("{symbol}_route");
    let route_count_kernel = format!("{symbol}_route_count");
    let route_place_kernel = format!("{symbol}_route_place");
    let combine_kernel = format!("{symbol}_combine");
    let invert_rows_kernel = format!("{symbol}_invert_rows");
    let sort_rows_kernel = format!("{symbol}_sort_rows");
    let mut regimes = Vec::new();
    let mut most_route_blocks = 1;
    let mut limitations = Vec::new();
    let mut hints_not_honoured = Vec::new();
    let choices = choose_regimes(layer, target, &shape, 1)?;
    let tuned_choices = tuned_regimes(layer, choices, tuning, target, &shape, &mut limitations);
    for (mut choice, tuned) in tuned_choices {
        choice.gemm1.a_load = gemm1_row_load(target, &shape, &choice.gemm1);
        let gemm1_kernel = format!("{symbol}_{}_gemm1", choice.name);
        let gemm2_kernel = format!("{symbol}_{}_gemm2", choice.name);
        let route_blocks = route_blocks(
            u64::from(choice.max_tokens) * u64::from(shape.top_k),
            target,
        );
        most_route_blocks = most_route_blocks.max(route_blocks);
        let launches = launch::launch_table(
            launch::ForwardKernels {
                route: if route_blocks == 1 {
                    launch::RouteLaunches::OneBlock(&route_kernel)
                } else {
                    launch::RouteLaunches::Blocks {
                        count: &route_count_kernel,
                        place: &route_place_kernel,
                        blocks: route_blocks,
                    }
                },
                invert_rows: &invert_rows_kernel,
                sort_rows: &sort_rows_kernel,
                gemm1: &gemm1_kernel,
                gemm2: &gemm2_kernel,
                combine: &combine_kernel,
            },
            &shape,
            &choice.gemm1,
            &choice.gemm2,
            target.has_programmatic_launch(),
        );
        let fused_kernel = format!("{symbol}_{}_fused", choice.name);
        let mut regime = Regime {
            name: choice.name,
            min_tokens: choice.min_tokens,
            max_tokens: choice.max_tokens,
            gemm1: choice.gemm1,
            gemm2: choice.gemm2,
            gemm1_kernel,
            gemm2_kernel,
            launches,
            tuned,
            fused_decode: None,
        };
        let asked = layer.schedule.fused_decode;
        let tokens = asked.unwrap_or(fused_decode::DEFAULT_FUSED_DECODE_TOKENS);
        if tokens > 0 && regimes.is_empty() {
            match fused_decode::plan_fused_decode(
                target,
                &shape,
                &regime,
                &fused_kernel,
                target.has_programmatic_launch(),
                tokens,
            ) {
                Ok(fused) => {
                    if fused.max_tokens < tokens && asked.is_some() {
                        hints_not_honoured.push(format!(
                            "the spec's fused_decode = {tokens} tokens is beyond regime `{}`: calls of up to {} tokens run fused",
                            regime.name, fused.max_tokens
                        ));
                    }
                    regime.fused_decode = Some(fused);
                }
                Err(reason) if asked.is_some() => hints_not_honoured.push(format!(
                    "the spec asks for a fused decode of up to {tokens} tokens, which this plan cannot give ({reason}): those calls run the regime's table"
                )),
                Err(_) => {}
            }
        }
        regimes.push(regime);
    }

    let table_regimes: Vec<router::TableRegime> = regimes
        .iter()
        .map(|r| router::TableRegime {
            name: r.name.clone(),
            max_tokens: r.max_tokens,
            gemm1_next: !r.sorts_x_rows(),
        })
        .collect();
    let router = router::plan_router(layer, target, &symbol, shape.gemm_experts(), &table_regimes);
    let stream_k = StreamKSpace::of(regimes.iter().flat_map(|r| [&r.gemm1, &r.gemm2]));
    let workspace = workspace(
        &shape,
        most_route_blocks,
        sorts_x_rows(&regimes),
        router
            .as_ref()
            .map(|router| RouterSpace::of(router, &shape)),
        stream_k,
        fused_decode::counters_needed(&shape, &regimes),
        unit_tickets(regimes.iter().flat_map(|r| [&r.gemm1, &r.gemm2])),
    );

    let placement = ep::Placement::of(&layer.topology);
    // A rank routes its own tokens into its own copies of the router's buffers (the
    // workspace holds them exactly when the layer has a router).
    let router_buffers = workspace
        .iter()
        .filter(|buffer| ROUTER_BUFFERS.contains(&buffer.id))
        .cloned()
        .collect();
    let flag_wait_limit = FlagWaitLimit::of(layer, target);
    let expert_parallel = ep::plan_expert_parallel(
        layer,
        target,
        layer.parallel.expert,
        placement,
        &symbol,
        &shape,
        router_buffers,
        flag_wait_limit.seconds(target),
    )?;
    if let Some(ep) = &expert_parallel {
        // A spec that asks for the fused decode where the ranks' first regime cannot run
        // one is told why (the table runs those calls).
        let asked = layer.schedule.fused_decode.filter(|&tokens| tokens > 0);
        let first = ep.regimes.first();
        if let (Some(tokens), Some(regime)) = (asked, first)
            && regime.fused_decode.is_none()
        {
            let reason = if ep.network.is_some() {
                "its ranks span several nodes (real or emulated), and the network steps carry part of that exchange".to_string()
            } else {
                fused_decode::plan_rank_fused_decode(
                    target,
                    &shape,
                    &fused_decode::RankFusedShape::of(target, &shape, ep),
                    (&regime.name, regime.min_tokens, regime.max_tokens),
                    (&regime.gemm1, &regime.gemm2),
                    "",
                    tokens,
                )
                .err()
                .unwrap_or_default()
            };
            hints_not_honoured.push(format!(
                "the spec's fused_decode = {tokens} tokens: the expert-parallel ranks run no fused decode, {reason}; the table runs those calls"
            ));
        }
    }
    hints_not_honoured.extend(exchange_hints_unused(layer, expert_parallel.as_ref()));
    if expert_parallel.is_some() {
        limitations.push(format!(
            "the spec asks for {} expert-parallel ranks: the expert-parallel kernels (below) run them, through the runtime's EpLayer or `moeforge bench --ranks/--gpus`; the single-GPU kernels run all {} experts on one GPU",
            layer.parallel.expert, layer.experts
        ));
    }
    if let Some(ep) = &expert_parallel
        && let Some(network) = &ep.network
    {
        let network_buffers: u64 = ep
            .workspace
            .iter()
            .filter(|b| b.id.name().starts_with("net_"))
            .map(Buffer::bytes)
            .sum();
        let carrier = match network.transport {
            network::NetworkTransport::Nccl => "NCCL",
            network::NetworkTransport::Loopback => {
                "the loopback's device copies (emulated nodes: the steps NCCL would run)"
            }
        };
        let sizing = if network.whole_chunks_up_to >= shape.max_tokens {
            "every call moves whole chunks, sized on the host (no host wait for the routing, a few bytes more than the routed rows)".to_string()
        } else {
            format!(
                "above the whole-chunks bound ({} tokens) the host waits once per call (while the communication kernels run) for the rows per chunk read back after the metadata step, sizes the rows' and results' transfers by them and enqueues the compute kernels after the rows' transfers (a device-initiated transport would need no wait; calls within the bound move whole chunks, sized on the host)",
                network.whole_chunks_up_to
            )
        };
        limitations.push(format!(
            "ranks on other nodes exchange through {carrier}, whose counts must be on the host while the routing is on the device: {sizing}; a rank's call moves at most {} across the network (the receive index to its {} network peers; rows and node partials to its {} rail peers, one per other node, should every token visit every node) at a bound of max_tokens, the default until the ranks agree on a smaller one, and at most {} at one token; the network's outboxes and inboxes take {} per rank",
            describe::decimal_bytes(network.call_bytes),
            network.peers_per_rank,
            network.other_nodes(),
            describe::decimal_bytes(network.bytes_per_call(ep, &shape, 1)),
            describe::decimal_bytes(network_buffers)
        ));
    }

    let call_graph_max_tokens = CALL_GRAPH_MAX_TOKENS.min(shape.max_tokens);
    let shared_gate_kernel = expert_parallel
        .as_ref()
        .and_then(|_| shared_gate_kernel(&symbol, &shape));
    Ok(Plan {
        layer: layer.name.clone(),
        symbol,
        route_kernel,
        route_count_kernel,
        route_place_kernel,
        combine_kernel,
        invert_rows_kernel,
        sort_rows_kernel,
        shared_gate_kernel,
        target: target.clone(),
        shape,
        workspace,
        regimes,
        expert_parallel,
        router,
        call_graph_max_tokens,
        flag_wait_limit,
        hints_not_honoured,
        limitations,
    })
}

/// The spec's hints on the exchange between ranks that its plan `ep` has no use for: every
/// one where the layer has one rank (no exchange), and `whole_chunks`, which sizes the
/// network's transfers, where the ranks share a node.
fn exchange_hints_unused(layer: &ir::Layer, ep: Option<&ep::ExpertParallelPlan>) -> Vec<String> {
    let hints = &layer.schedule;
    match ep {
        None => {
            let written: Vec<String> = [
                (hints.dispatch_chunk.is_some(), "dispatch_chunk"),
                (hints.comm_blocks.is_some(), "comm_blocks"),
                (hints.traffic_order.is_some(), "traffic"),
                (hints.whole_chunks.is_some(), "whole_chunks"),
            ]
            .into_iter()
            .filter(|(set, _)| *set)
            .map(|(_, key)| format!("`{key}`"))
            .collect();
            if written.is_empty() {
                return Vec::new();
            }
            vec![format!(
                "the spec's {} shape{} the exchange between expert-parallel ranks, which a layer of one rank has none of: {} effect over ranks (`parallel {{ expert = R }}`, or `--ranks`/`--gpus` of run, bench and simulate)",
                written.join(", "),
                if written.len() == 1 { "s" } else { "" },
                if written.len() == 1 { "it takes" } else { "they take" },
            )]
        }
        Some(ep) if ep.network.is_none() && hints.whole_chunks.is_some() => vec![
            "the spec's `whole_chunks` sizes the transfers between nodes, and its ranks share one node: it has no effect".to_string(),
        ],
        Some(_) => Vec::new(),
    }
}

/// The largest calls whose repeats a layer replays as a CUDA graph
/// ([`Plan::call_graph_max_tokens`]). A graph saves the host's launch latency, 1.4-6.3 µs
/// per call from an idle GPU (H200, 2026-12-03, `benches/results/2026-12-03_call_graphs.md`):
/// 4-9% of a one-token call, 0.5-2% of a 128-token one (Qwen3-30B-A3B, 290 µs). Larger
/// calls gain nothing measurable, and their token counts seldom repeat.
pub const CALL_GRAPH_MAX_TOKENS: u32 = 256;

/// Blocks of the routing launches of a regime whose largest call has `pairs` pairs: one up
/// to [`ROUTE_ONE_BLOCK_MAX_PAIRS`], else one per [`ROUTE_PAIRS_PER_BLOCK`], at least two
/// and at most one per SM (where the target has two or more).
pub fn route_blocks(pairs: u64, target: &Target) -> u32 {
    if pairs <= ROUTE_ONE_BLOCK_MAX_PAIRS {
        1
    } else {
        let blocks = pairs
            .div_ceil(ROUTE_PAIRS_PER_BLOCK)
            .min(u64::from(target.sm_count));
        u32::try_from(blocks).unwrap_or(target.sm_count).max(2)
    }
}

/// What the stream-K GEMMs of a plan share: one buffer of partial tiles and one of arrival
/// counters, each as large as its largest user needs (the GEMMs of a call run one after
/// another, so none holds them while another does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct StreamKSpace {
    partial_floats: u64,
    tile_counters: u64,
}

impl StreamKSpace {
    fn of<'a>(gemms: impl IntoIterator<Item = &'a GemmPlan>) -> Self {
        gemms
            .into_iter()
            .fold(StreamKSpace::default(), |space, gemm| StreamKSpace {
                partial_floats: space.partial_floats.max(gemm.stream_k_partial_floats()),
                tile_counters: space
                    .tile_counters
                    .max(gemm.stream_k.map_or(0, |tail| u64::from(tail.max_tiles))),
            })
    }
}

/// Whether any regime's GEMM1 loads x's rows sorted by expert (the workspace then holds
/// them, and the row order's inverse).
fn sorts_x_rows(regimes: &[Regime]) -> bool {
    regimes.iter().any(Regime::sorts_x_rows)
}

/// The router's own buffers: its logits, arrival counters and choices (an expert-parallel
/// rank that routes itself holds them too).
pub const ROUTER_BUFFERS: [BufferId; 4] = [
    BufferId::RouterLogits,
    BufferId::RouterTilesDone,
    BufferId::RoutedIds,
    BufferId::RoutedWeights,
];

/// What a router's buffers hold at most: its arrival counters and its (partial) logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RouterSpace {
    tiles_done: u32,
    logits_floats: u64,
}

impl RouterSpace {
    fn of(router: &RouterPlan, shape: &LayerShape) -> Self {
        RouterSpace {
            tiles_done: router.tiles_done_len(),
            logits_floats: router.logits_floats(shape.experts, shape.max_tokens),
        }
    }
}

/// Entry point of a rank's shared expert gate launch, for a layer whose shared expert is
/// gated.
pub(crate) fn shared_gate_kernel(symbol: &str, shape: &LayerShape) -> Option<String> {
    shape.shared_gated.then(|| format!("{symbol}_shared_gate"))
}

/// The buffer of each token's shared-slice weight, for a layer whose shared expert is
/// gated (one GPU's tokens, or a rank's own).
pub(crate) fn shared_gate_buffer(shape: &LayerShape) -> Option<Buffer> {
    shape.shared_gated.then(|| Buffer {
        id: BufferId::SharedGate,
        elem: BufferId::SharedGate.elem(),
        elems: u64::from(shape.max_tokens),
        purpose: "per token, sigmoid(x · shared expert gate): its shared slices' weight".into(),
    })
}

/// The device buffers a layer of this shape needs, sized for `max_tokens`, with the counts
/// of the routing over `route_blocks` blocks where that is more than one; with `sorted_x`,
/// x's rows in the expert-major order for a GEMM1 that loads them as tiles; with a router,
/// the router's logits, counters and choices too; with stream-K GEMMs, their partial tiles
/// and counters; with a fused decode, its `fused_counters` counters; with warp-specialised
/// GEMMs, their `unit_tickets` ([`unit_tickets`]); with a gated shared expert, its tokens'
/// weights ([`shared_gate_buffer`]).
fn workspace(
    shape: &LayerShape,
    route_blocks: u32,
    sorted_x: bool,
    router: Option<RouterSpace>,
    stream_k: StreamKSpace,
    fused_counters: Option<u64>,
    unit_tickets: Option<Buffer>,
) -> Vec<Buffer> {
    let max_pairs = shape.max_pairs();
    let mut buffers = vec![
        Buffer {
            id: BufferId::ExpertOffsets,
            elem: BufferId::ExpertOffsets.elem(),
            elems: u64::from(shape.gemm_experts()) + 1,
            purpose: "start row of each expert (routed, then shared slices) in the expert-major row order".into(),
        },
        Buffer {
            id: BufferId::RowPair,
            elem: BufferId::RowPair.elem(),
            elems: max_pairs,
            purpose: "combine slot (token, k) of each expert-major row".into(),
        },
        Buffer {
            id: BufferId::Intermediate,
            elem: BufferId::Intermediate.elem(),
            elems: max_pairs * u64::from(shape.ffn),
            purpose: "GEMM1 output after the activation".into(),
        },
        Buffer {
            id: BufferId::CombineSlots,
            elem: BufferId::CombineSlots.elem(),
            elems: max_pairs * u64::from(shape.hidden),
            purpose: "GEMM2 output times routing weight, one slot per (token, k) and per (token, shared slice)".into(),
        },
        Buffer {
            id: BufferId::ErrorWord,
            elem: BufferId::ErrorWord.elem(),
            elems: 4,
            purpose: "first kernel-side error of the call: code, token, k, value".into(),
        },
    ];
    buffers.extend(shared_gate_buffer(shape));
    if sorted_x {
        buffers.extend([
            Buffer {
                id: BufferId::PairRow,
                elem: BufferId::PairRow.elem(),
                elems: max_pairs,
                purpose: "expert-major row of each (token, k) pair, the inverse of row_pair".into(),
            },
            Buffer {
                id: BufferId::SortedX,
                elem: BufferId::SortedX.elem(),
                elems: max_pairs * u64::from(shape.hidden),
                purpose: "x's rows in the expert-major row order, GEMM1's A rows as TMA tiles"
                    .into(),
            },
        ]);
    }
    if route_blocks > 1 {
        buffers.push(Buffer {
            id: BufferId::RouteBlockCounts,
            elem: BufferId::RouteBlockCounts.elem(),
            elems: u64::from(route_blocks) * u64::from(shape.experts),
            purpose: "per routing block, its pairs per expert (the routing over several blocks)"
                .into(),
        });
    }
    if let Some(router) = router {
        buffers.extend([
            Buffer {
                id: BufferId::RouterLogits,
                elem: BufferId::RouterLogits.elem(),
                elems: router.logits_floats,
                purpose: "the router's gate logits x · W_gateᵀ [T, E] (a split gate's partial logits first, a [T, E] slice per block of its split, summed into the first)".into(),
            },
            Buffer {
                id: BufferId::RouterTilesDone,
                elem: BufferId::RouterTilesDone.elem(),
                elems: u64::from(router.tiles_done),
                purpose: "the router's arrival counters: a fused router's token tiles selected (with several), then gate blocks done per token tile; a split router's gate blocks done per tile of a split call (zero between calls)".into(),
            },
            Buffer {
                id: BufferId::RoutedIds,
                elem: BufferId::RoutedIds.elem(),
                elems: max_pairs,
                purpose: "the experts the router chose (topk_ids of a self-routed call)".into(),
            },
            Buffer {
                id: BufferId::RoutedWeights,
                elem: BufferId::RoutedWeights.elem(),
                elems: max_pairs,
                purpose: "their routing weights (topk_weights of a self-routed call)".into(),
            },
        ]);
    }
    if stream_k.tile_counters > 0 {
        buffers.extend([
            Buffer {
                id: BufferId::StreamKPartials,
                elem: BufferId::StreamKPartials.elem(),
                elems: stream_k.partial_floats,
                purpose: "stream-K: each block's partial sums of the tiles it shares with others"
                    .into(),
            },
            Buffer {
                id: BufferId::StreamKTilesDone,
                elem: BufferId::StreamKTilesDone.elem(),
                elems: stream_k.tile_counters,
                purpose: "stream-K: per tile, the blocks done with their part (zero between calls)"
                    .into(),
            },
        ]);
    }
    if let Some(counters) = fused_counters {
        buffers.push(Buffer {
            id: BufferId::FusedDecodeCounters,
            elem: BufferId::FusedDecodeCounters.elem(),
            elems: counters,
            purpose: "the fused decode's counters: per expert GEMM1 tiles stored and GEMM2 tiles that read them, per GEMM2 column tile the tiles stored, the next unit's ticket and the blocks done claiming (zero between calls)".into(),
        });
    }
    buffers.extend(unit_tickets);
    buffers
}

/// The tickets GEMMs claim their work units from, where any of `gemms` (one GPU's, or
/// a rank's) claims (index 0 GEMM1's, 1 GEMM2's).
pub(crate) fn unit_tickets<'a>(mut gemms: impl Iterator<Item = &'a GemmPlan>) -> Option<Buffer> {
    gemms.any(GemmPlan::claims_units).then(|| Buffer {
        id: BufferId::UnitTickets,
        elem: BufferId::UnitTickets.elem(),
        elems: 2,
        purpose: "the next work unit of the warp-specialised GEMM1 and GEMM2, claimed in order (zero between calls)".into(),
    })
}

impl Plan {
    /// Whether `kernel` lays out a single-GPU call's routing metadata: the one-block route,
    /// or the count or place launch of the routing over several blocks.
    pub fn is_route_kernel(&self, kernel: &str) -> bool {
        kernel == self.route_kernel
            || kernel == self.route_count_kernel
            || kernel == self.route_place_kernel
    }

    /// The regime that serves a call with `tokens` tokens (`None` above `max_tokens`).
    pub fn regime_for(&self, tokens: u32) -> Option<&Regime> {
        self.regime_index_for(tokens).map(|i| &self.regimes[i])
    }

    /// The position in `regimes` of [`Plan::regime_for`]'s regime.
    pub fn regime_index_for(&self, tokens: u32) -> Option<usize> {
        self.regimes
            .iter()
            .position(|r| r.min_tokens <= tokens && tokens <= r.max_tokens)
    }

    /// Every launch of every regime: the single-GPU tables, then the router's, then the
    /// expert-parallel ones.
    pub fn launches(&self) -> impl Iterator<Item = &Launch> {
        let router_launches = self
            .router
            .iter()
            .flat_map(|router| router.regimes.iter().flat_map(|r| &r.launches));
        let ep_launches = self.expert_parallel.iter().flat_map(|ep| {
            ep.regimes
                .iter()
                .flat_map(ExpertParallelRegime::all_launches)
        });
        self.regimes
            .iter()
            .flat_map(Regime::all_launches)
            .chain(router_launches)
            .chain(ep_launches)
    }

    /// The entry points of the generated unit, in a stable order: the single-GPU kernels,
    /// then the router's, then the expert-parallel ones.
    pub fn entry_points(&self) -> Vec<String> {
        distinct_kernels(self.launches())
    }

    /// The entry points a layer on one GPU launches: its tables and the router's.
    pub fn single_gpu_entry_points(&self) -> Vec<String> {
        let router_launches = self
            .router
            .iter()
            .flat_map(|router| router.regimes.iter().flat_map(|r| &r.launches));
        distinct_kernels(
            self.regimes
                .iter()
                .flat_map(Regime::all_launches)
                .chain(router_launches),
        )
    }

    /// Every GEMM of every regime and its kernel: the single-GPU regimes' GEMM1 and GEMM2,
    /// then the expert-parallel ones'.
    pub fn gemm_kernels(&self) -> impl Iterator<Item = (&GemmPlan, &String)> {
        self.regime_gemms().flatten()
    }

    /// [`Plan::entry_points`], the GEMMs first: a JIT that compiles kernels side by side
    /// should start those, which take longest (DeepSeek-V3's: 0.4-0.8 s each, the other
    /// kernels 0.2-0.7 s, one core of the CPU machine, 2026-12-01).
    pub fn entry_points_in_compile_order(&self) -> Vec<String> {
        self.in_compile_order(self.entry_points())
    }

    /// `kernels` (entry points of this plan) reordered for the JIT, the GEMMs first (see
    /// [`Plan::entry_points_in_compile_order`]), otherwise in their order.
    pub fn in_compile_order(&self, mut kernels: Vec<String>) -> Vec<String> {
        kernels.sort_by_key(|kernel| !self.gemm_kernels().any(|(_, gemm)| gemm == kernel));
        kernels
    }

    /// Each regime's GEMM1 and GEMM2 with their kernels: the single-GPU regimes, then the
    /// expert-parallel ones.
    fn regime_gemms(&self) -> impl Iterator<Item = [(&GemmPlan, &String); 2]> {
        let ep_regimes = self.expert_parallel.iter().flat_map(|ep| {
            ep.regimes
                .iter()
                .map(|r| [(&r.gemm1, &r.gemm1_kernel), (&r.gemm2, &r.gemm2_kernel)])
        });
        self.regimes
            .iter()
            .map(|r| [(&r.gemm1, &r.gemm1_kernel), (&r.gemm2, &r.gemm2_kernel)])
            .chain(ep_regimes)
    }

    /// The entry points one rank of the expert-parallel layer launches (none without an
    /// expert-parallel plan).
    /// The kernels an expert-parallel layer loads: its own, then, where its calls may
    /// route themselves, the router's.
    pub fn expert_parallel_entry_points(&self) -> Vec<String> {
        let router = self
            .router
            .iter()
            .filter(|_| {
                self.expert_parallel
                    .as_ref()
                    .is_some_and(|ep| ep.routes_itself)
            })
            .flat_map(|router| router.regimes.iter().flat_map(|r| &r.launches));
        distinct_kernels(
            self.expert_parallel
                .iter()
                .flat_map(|ep| {
                    ep.regimes
                        .iter()
                        .flat_map(ExpertParallelRegime::all_launches)
                })
                .chain(router),
        )
    }
}

/// The kernels of `launches`, each once, in order of first launch.
fn distinct_kernels<'a>(launches: impl Iterator<Item = &'a Launch>) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for launch in launches {
        if !names.contains(&launch.kernel) {
            names.push(launch.kernel.clone());
        }
    }
    names
}

fn regime_name(index: usize, count: usize) -> &'static str {
    match (index, count) {
        (0, 1) => "all",
        (0, _) => "decode",
        (i, n) if i + 1 == n => "prefill",
        _ => "mid",
    }
}

fn same_config(a: &GemmPlan, b: &GemmPlan) -> bool {
    a.engine == b.engine
        && a.tile == b.tile
        && a.stages == b.stages
        && a.warps_m == b.warps_m
        && a.warps_n == b.warps_n
        && a.cluster == b.cluster
        && a.a_load == b.a_load
        && a.store == b.store
}

/// A run of probes with one configuration: first and last probe, GEMM1 and GEMM2.
type ProbeGroup = (u32, u32, GemmPlan, GemmPlan);

/// Bounds the number of regimes (each costs compile time) by repeatedly joining two
/// neighbouring runs of probes into one, running whichever of their two configurations
/// costs less over the joined range: the join that adds least to the summed relative
/// slowdown of every probe against its own best configuration (both GEMMs, ranked as
/// candidates are). A short run whose tiles win by much (small tiles at a few tokens) stays; a run
/// whose neighbour's tiles do nearly as well goes.
fn merge_to_at_most(
    mut groups: Vec<ProbeGroup>,
    limit: usize,
    probes: &[u32],
    target: &Target,
    problems: [&GemmProblem; 2],
) -> Vec<ProbeGroup> {
    // As candidates are ranked: the estimate, one block per SM penalised.
    let seconds = |group: &ProbeGroup, tokens: u32| {
        cost::estimate(target, problems[0], &group.2, tokens).seconds * ranking_factor(&group.2)
            + cost::estimate(target, problems[1], &group.3, tokens).seconds
                * ranking_factor(&group.3)
    };
    // Each probe's time with its own best configuration.
    let best: Vec<(u32, f64)> = probes
        .iter()
        .filter_map(|&t| {
            let own = groups.iter().find(|g| g.0 <= t && t <= g.1)?;
            Some((t, seconds(own, t)))
        })
        .collect();
    // Summed relative slowdown of running `group`'s configuration over `first..=last`.
    let slowdown = |group: &ProbeGroup, first: u32, last: u32| -> f64 {
        best.iter()
            .filter(|&&(t, _)| first <= t && t <= last)
            .map(|&(t, own)| seconds(group, t) / own - 1.0)
            .sum()
    };
    while groups.len() > limit {
        // (added slowdown, left run of the pair, whether the right run's tiles serve both)
        let join = (0..groups.len() - 1)
            .flat_map(|i| [(i, false), (i, true)])
            .map(|(i, keep_right)| {
                let (left, right) = (&groups[i], &groups[i + 1]);
                let kept = if keep_right { right } else { left };
                let added = slowdown(kept, left.0, right.1)
                    - slowdown(left, left.0, left.1)
                    - slowdown(right, right.0, right.1);
                (added, i, keep_right)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let Some((_, i, keep_right)) = join else {
            break;
        };
        let right = groups.remove(i + 1);
        let left = &mut groups[i];
        let last = right.1;
        if keep_right {
            *left = (left.0, last, right.2, right.3);
        } else {
            left.1 = last;
        }
    }
    groups
}

/// Warp layout for a tile: 8 warps for large tiles, 4 for small ones, each warp owning a
/// sub-tile whose rows are a multiple of 16 (one mma) and columns a multiple of 16 (one
/// `ldmatrix.x4` of B).
fn warp_layout(tile: TileShape) -> Option<(u32, u32)> {
    let (wm, wn) = match tile.m {
        16 => (1, 4),
        32 => (2, 2),
        64 => (2, 4),
        _ => (4, 2),
    };
    let fits = tile.m.is_multiple_of(16 * wm) && tile.n.is_multiple_of(16 * wn);
    fits.then_some((wm, wn))
}

/// Accumulator floats per thread above which a tile is not considered (register pressure:
/// more spills on `mma.sync` with the fragments and addresses it also keeps).
const MAX_ACCUMULATORS_PER_THREAD: u32 = 64;
/// The same bound for wgmma, whose warpgroups keep no A or B fragments in registers.
const MAX_WGMMA_ACCUMULATORS_PER_THREAD: u32 = 128;
/// The widest `wgmma` (bf16 operands): m64n256k16. The warp-specialised engine multiplies a
/// stage's B rows (gate and up rows together, for a gated GEMM1) in one `wgmma`, so its
/// `b_rows` is at most this (the accumulator cap above implies it: 64 · b_rows / 128).
pub const MAX_WGMMA_WIDTH: u32 = 256;
const _: () = assert!(64 * MAX_WGMMA_WIDTH / 128 == MAX_WGMMA_ACCUMULATORS_PER_THREAD);

/// Checks a candidate tile and completes it into a `GemmPlan` (without estimate).
fn shape_gemm(
    target: &Target,
    problem: &GemmProblem,
    engine: MmaEngine,
    tile: TileShape,
    stages: u32,
) -> Result<GemmPlan, String> {
    if !engine.takes_tile_k(tile.k) {
        return Err(match engine {
            MmaEngine::MmaSync => format!(
                "the reduction depth must be {TILE_K} or {DEEP_TILE_K} (stage rows of 128 or 256 bytes)"
            ),
            MmaEngine::WgmmaWarpSpecialized => format!(
                "the reduction depth must be {TILE_K} (wgmma's swizzle takes 128-byte rows)"
            ),
        });
    }
    if !tile.m.is_multiple_of(16) || tile.m == 0 || tile.m > 256 {
        return Err("rows must be a multiple of 16 between 16 and 256".into());
    }
    if tile.n == 0 || !problem.n.is_multiple_of(tile.n) {
        return Err(format!(
            "columns must divide the output width {}",
            problem.n
        ));
    }
    // mma.sync's last 128-deep stage may be half full (its loads past K zero-fill).
    let depth_unit = match engine {
        MmaEngine::MmaSync => TILE_K,
        MmaEngine::WgmmaWarpSpecialized => tile.k,
    };
    if !problem.k.is_multiple_of(depth_unit) {
        return Err(format!(
            "the reduction length {} is not a multiple of {}",
            problem.k, depth_unit
        ));
    }
    if !(MIN_STAGES..=MAX_STAGES).contains(&stages) {
        return Err(format!(
            "pipeline stages must be between {MIN_STAGES} and {MAX_STAGES}"
        ));
    }
    let b_rows = if problem.gated { 2 * tile.n } else { tile.n };
    let (warps_m, warps_n, max_accumulators) = match engine {
        MmaEngine::MmaSync => {
            let (wm, wn) = warp_layout(tile)
                .ok_or_else(|| "no warp layout divides this tile into 16×16 pieces".to_string())?;
            (wm, wn, MAX_ACCUMULATORS_PER_THREAD)
        }
        MmaEngine::WgmmaWarpSpecialized => {
            if !target.has_wgmma() {
                return Err(format!("{} has no wgmma", target.arch));
            }
            if !tile.m.is_multiple_of(64) || tile.m > 128 {
                return Err("wgmma tiles have 64 or 128 rows (one warpgroup per 64)".into());
            }
            if !tile.n.is_multiple_of(16) || tile.n > MAX_WGMMA_WIDTH {
                return Err("wgmma tiles have at most 256 columns, a multiple of 16".into());
            }
            if stages < 3 {
                return Err("wgmma keeps one group in flight: it needs at least 3 stages".into());
            }
            // One warpgroup (4 warps) per 64 rows.
            (tile.m / 16, 1, MAX_WGMMA_ACCUMULATORS_PER_THREAD)
        }
    };
    let warp_roles = (engine == MmaEngine::WgmmaWarpSpecialized)
        .then(|| WarpRoles::one_block_per_sm(tile.m / 64));
    let multiplying_threads = 32 * warps_m * warps_n;
    let accumulators = tile.m * b_rows / multiplying_threads;
    if accumulators > max_accumulators {
        return Err(format!(
            "{accumulators} accumulators per thread exceed {max_accumulators} with {} (register spills)",
            engine.name()
        ));
    }
    let block_routing = problem.block_routing(engine);
    let routing_ints = block_routing.map_or(0, |routing| routing.table_ints(problem));
    let smem = SmemLayout::new(
        engine,
        tile,
        b_rows,
        stages,
        problem.row_groups(),
        routing_ints,
    );
    if smem.total_bytes() > target.smem_per_block {
        return Err(format!(
            "{} bytes of shared memory ({stages} stages of {} B, row table, {} B of {}) exceed the {} a block may use",
            smem.total_bytes(),
            smem.stage_bytes,
            smem.static_bytes,
            if block_routing.is_some() {
                "tile and routing tables"
            } else {
                "tile table"
            },
            target.smem_per_block,
        ));
    }
    let smem_bytes = smem.dynamic_bytes;
    let blocks_per_sm = if warp_roles.is_some() {
        // The register split assumes the block has the SM's register file to itself.
        1
    } else {
        // Registers: accumulators plus about 72 for fragments, addresses and loop state
        // (64 left a 32x64 GEMM2 tile 8 bytes of spills as relocatable code).
        let regs_per_thread = (accumulators + 72).min(255);
        let by_regs = 65_536 / (regs_per_thread * multiplying_threads);
        let by_smem = target.smem_per_sm / smem.resident_bytes();
        by_regs.min(by_smem).clamp(1, 8)
    };
    // GEMM2's rows on one GPU are the intermediate's, already expert-major; whether GEMM1's
    // are sorted so first is the regime's call (`gemm1_row_load`).
    let a_load = if engine == MmaEngine::WgmmaWarpSpecialized
        && problem.kind == GemmKind::Down
        && problem.row_phases == 1
    {
        RowLoad::Tiles
    } else {
        RowLoad::Gathered
    };
    let store = if engine == MmaEngine::WgmmaWarpSpecialized && problem.kind == GemmKind::Down {
        OutputStore::QuadVectors
    } else {
        OutputStore::Pairs
    };
    let grid_blocks = target.sm_count * blocks_per_sm;
    let stream_k = if engine == MmaEngine::MmaSync && problem.row_phases == 1 {
        let tile_bytes = u64::from(tile.m + b_rows) * u64::from(problem.k) * 2;
        let in_flight = u64::from(stages - 1) * u64::from(smem.stage_bytes);
        StreamKTail::of(target, grid_blocks, tile_bytes, in_flight)
    } else {
        None
    };
    Ok(GemmPlan {
        engine,
        tile,
        stages,
        warps_m,
        warps_n,
        warp_roles,
        b_rows,
        a_load,
        store,
        smem_bytes,
        smem,
        blocks_per_sm,
        grid_blocks,
        stream_k,
        block_routing,
        cluster: 1,
        estimate: GemmEstimate::default(),
        source: tuning::ChoiceSource::CostModel,
    })
}

/// `gemm` as a cluster pair, where that can run ([`GemmPlan::can_pair`], sm_90a, which has
/// clusters) on one GPU (the expert-parallel grids leave SMs to communication and need not
/// pair up).
fn as_cluster_pair(problem: &GemmProblem, gemm: &GemmPlan) -> Option<GemmPlan> {
    (problem.row_phases == 1 && gemm.can_pair()).then(|| GemmPlan {
        cluster: CLUSTER_PAIR,
        ..gemm.clone()
    })
}

/// Fewest and most pipeline stages a GEMM may have.
pub const MIN_STAGES: u32 = 2;
pub const MAX_STAGES: u32 = 8;
/// Stages of a hinted tile when the spec sets no `stages`.
const DEFAULT_HINTED_STAGES: u32 = 4;

/// A hinted tile completed into a plan: on warp-specialised wgmma where that engine can take
/// the tile, else on mma.sync; the reason given is wgmma's when both refuse and the target
/// has wgmma.
fn hinted_gemm(
    target: &Target,
    problem: &GemmProblem,
    tile: TileShape,
    stages: Option<u32>,
) -> Result<GemmPlan, String> {
    let stages = stages.unwrap_or(DEFAULT_HINTED_STAGES);
    let wgmma = shape_gemm(
        target,
        problem,
        MmaEngine::WgmmaWarpSpecialized,
        tile,
        stages,
    );
    wgmma.or_else(|wgmma_reason| {
        shape_gemm(target, problem, MmaEngine::MmaSync, tile, stages).map_err(|mma_reason| {
            if target.has_wgmma() && wgmma_reason != mma_reason {
                format!("on wgmma, {wgmma_reason}; on mma.sync, {mma_reason}")
            } else {
                mma_reason
            }
        })
    })
}

/// Every configuration the cost model compares for `problem` (with `stages`, only that
/// ring depth), estimated at `tokens`, in a stable order: per candidate tile and ring, the
/// cluster pair first (where the model cannot tell them apart, the configuration that
/// reads less from L2 wins the tie), then the single block; or why the tile and ring
/// cannot be planned.
fn costed_candidates<'a>(
    target: &'a Target,
    problem: &'a GemmProblem,
    tokens: u32,
    stages: Option<u32>,
) -> impl Iterator<Item = Result<GemmPlan, String>> + 'a {
    costed_tiles(target, problem, candidate_tiles(), tokens, stages)
}

/// [`costed_candidates`] over the engine and tile pairs `tiles`.
fn costed_tiles<'a>(
    target: &'a Target,
    problem: &'a GemmProblem,
    tiles: impl Iterator<Item = (MmaEngine, TileShape)> + 'a,
    tokens: u32,
    stages: Option<u32>,
) -> impl Iterator<Item = Result<GemmPlan, String>> + 'a {
    tiles.flat_map(move |(engine, tile)| {
        let depths = stages.map_or_else(|| stage_choices(engine, tile), |s| vec![s]);
        depths.into_iter().flat_map(move |depth| {
            match shape_gemm(target, problem, engine, tile, depth) {
                Ok(single) => as_cluster_pair(problem, &single)
                    .into_iter()
                    .chain(std::iter::once(single))
                    .map(|mut gemm| {
                        gemm.estimate = cost::estimate(target, problem, &gemm, tokens);
                        Ok(gemm)
                    })
                    .collect::<Vec<_>>(),
                Err(reason) => vec![Err(reason)],
            }
        })
    })
}

/// The candidate tiles the cost model compares when no tile is hinted, in a stable order.
fn candidate_tiles() -> impl Iterator<Item = (MmaEngine, TileShape)> {
    let candidates: [(MmaEngine, &'static [u32], &'static [u32]); 2] = [
        (MmaEngine::MmaSync, &[16, 32, 64, 128], &[64, 128]),
        (
            MmaEngine::WgmmaWarpSpecialized,
            &[64, 128],
            &[64, 96, 128, 160, 192, 256],
        ),
    ];
    candidates.into_iter().flat_map(|(engine, rows, columns)| {
        rows.iter().flat_map(move |&m| {
            columns
                .iter()
                .map(move |&n| (engine, TileShape { m, n, k: TILE_K }))
        })
    })
}

/// The stage counts the cost model tries for `tile` when `stages` is not hinted: a few for
/// engines whose blocks share an SM (more stages, fewer blocks), up to the reduction depth
/// of [`MMA_SYNC_DEEPEST_RING`] stages of [`TILE_K`]; as many as fit for the
/// warp-specialised engine, alone on its SM, whose ring is all that hides memory latency.
/// Deepest first, so that the deepest ring wins a tie.
fn stage_choices(engine: MmaEngine, tile: TileShape) -> Vec<u32> {
    match engine {
        MmaEngine::MmaSync => {
            let deepest = (MMA_SYNC_DEEPEST_RING * TILE_K).div_ceil(tile.k).max(3);
            (3..=deepest).rev().collect()
        }
        MmaEngine::WgmmaWarpSpecialized => (3..=MAX_STAGES).rev().collect(),
    }
}

/// The deepest ring the cost model tries for mma.sync blocks, in stages of [`TILE_K`].
const MMA_SYNC_DEEPEST_RING: u32 = 5;

/// How much slower than its estimate an mma.sync configuration runs per stage its ring has
/// below [`MMA_SYNC_DEEPEST_RING`], when choosing between candidates. The estimates of a
/// memory-bound GEMM's rings differ only by the wave rounding of a compute term that is
/// not its bound, so a shallow ring with more blocks per SM won by a hair; measured, the
/// deeper ring streams the weights faster. DeepSeek-V3's decode GEMM1 (16x64 tiles,
/// Nsight Compute on one H200, 2026-11-30, same routing): 5 stages at 2 blocks per SM
/// read HBM at 4.33 TB/s (128 tokens) and 4.41 (16 tokens), 4 stages at 3 per SM at 4.26
/// and 4.20, 3 stages at 4 per SM at 4.25 (128 tokens). Its GEMM2: 5 stages at 4 per SM
/// 4.34, 3 stages at 7 per SM 4.30.
const SHALLOW_RING_PENALTY_PER_STAGE: f64 = 0.02;

/// How much slower an mma.sync tile with [`TILE_K`]-deep stages runs than with
/// [`DEEP_TILE_K`]-deep ones, in proportion to the share of its estimate that is the memory
/// stream: its weight rows arrive 128 bytes at a time instead of 256 (see
/// [`with_deep_stages`]). On one H200 (2026-12-02, `benches/results/2026-12-02_deep_k_tiles.md`)
/// a load probe streamed the decode GEMMs' weights 1.6-1.8% slower so (GEMM1 shapes; 0.4%
/// for GEMM2's), and whole decode layers ran 0.4-2.4% slower (about 1%).
const SHORT_ROW_PENALTY: f64 = 0.015;

/// How much slower than its estimate a configuration of one block per SM runs, when
/// choosing between candidates: alone on its SM, a block exposes its own prologue, its
/// barriers and its epilogue, which a second block would cover. Measured on the two-H200
/// machine (2026-11-30, expert-parallel GEMMs of the same tile shape): Qwen3-30B-A3B at
/// 128 tokens per rank took 481 us at one 128x64 wgmma block per SM against 243 us at two
/// (the NCCL baseline's single-GPU kernels), DeepSeek-V3 at 1024 tokens per rank 7617 us
/// at one 32x128 mma.sync block per SM against 6393 us at two.
const ONE_BLOCK_PER_SM_PENALTY: f64 = 1.15;

/// The schedule hints of `layer` that cannot be planned on `target`, each with its reason.
/// The checker reports these (with the hint's span) against the default target; [`plan`]
/// refuses a layer that has any on its own target. Empty when every hint can be used.
pub fn hint_problems(layer: &ir::Layer, target: &Target) -> Vec<HintProblem> {
    let shape = LayerShape::of(layer);
    let hints = &layer.schedule;
    let mut problems = Vec::new();
    if let Some(stages) = hints.stages
        && !(MIN_STAGES..=MAX_STAGES).contains(&stages)
    {
        // Every tile would fail for the same reason: say it once, at the stages hint.
        problems.push(HintProblem {
            key: HintKey::Stages,
            hint: format!("stages = {stages}"),
            reason: format!("pipeline stages must be between {MIN_STAGES} and {MAX_STAGES}"),
        });
        return problems;
    }
    for kind in [GemmKind::Up, GemmKind::Down] {
        let problem = GemmProblem::for_layer(&shape, kind, 1);
        let hinted_tile = match kind {
            GemmKind::Up => hints.gemm1_tile,
            GemmKind::Down => hints.gemm2_tile,
        };
        match (hinted_tile, hints.stages) {
            (Some(tile), _) => {
                if let Err(reason) = hinted_gemm(target, &problem, tile, hints.stages) {
                    problems.push(HintProblem {
                        key: kind.hint_key(),
                        hint: format!(
                            "{} = {}x{}x{}",
                            kind.hint_key().name(),
                            tile.m,
                            tile.n,
                            tile.k
                        ),
                        reason,
                    });
                }
            }
            (None, Some(stages)) => {
                let mut last_reason = None;
                let feasible = candidate_tiles().any(|(engine, tile)| {
                    shape_gemm(target, &problem, engine, tile, stages)
                        .map_err(|reason| last_reason = Some(reason))
                        .is_ok()
                });
                if !feasible {
                    problems.push(HintProblem {
                        key: HintKey::Stages,
                        hint: format!("stages = {stages}"),
                        reason: format!(
                            "no tile of {} fits with {stages} stages ({})",
                            kind.hint_key().name().trim_end_matches(".tile"),
                            last_reason.unwrap_or_default()
                        ),
                    });
                }
            }
            (None, None) => {}
        }
    }
    problems.extend(ep::comm_blocks_problem(layer, target));
    problems
}

impl PlanError {
    /// What to change in the spec, where the error alone does not say.
    pub fn advice(&self) -> Option<String> {
        match self {
            PlanError::RanksDoNotFit {
                target,
                most_virtual_ranks,
                ..
            } => Some(format!(
                "at most {most_virtual_ranks} virtual ranks fit the {target} (each needs an SM \
                 for communication and one for compute): give the layer fewer ranks \
                 (`parallel {{ expert = ... }}` and the topology's `virtual_ranks`)"
            )),
            _ => None,
        }
    }
}

/// The GEMMs chosen for one range of token counts, before the launches that run them.
#[derive(Clone)]
pub(crate) struct RegimeChoice {
    pub name: String,
    pub min_tokens: u32,
    pub max_tokens: u32,
    pub gemm1: GemmPlan,
    pub gemm2: GemmPlan,
}

/// Whether the spec's schedule hints fix the GEMM of `kind` (its tile, or every GEMM's
/// stages): the tuning table then leaves it alone, and `moeforge tune` does not time it.
pub fn gemm_hinted(layer: &ir::Layer, kind: GemmKind) -> bool {
    let hints = &layer.schedule;
    let tile = match kind {
        GemmKind::Up => hints.gemm1_tile,
        GemmKind::Down => hints.gemm2_tile,
    };
    tile.is_some() || hints.stages.is_some()
}

/// The share of a two-warpgroup (128-row) warp-specialised GEMM1's time that gathering its
/// A rows costs, and loading them as tiles of sorted x saves. Measured on one H200
/// (2026-12-01, Nsight Compute, GEMM1 alone, gathered against tiles): Mixtral-8x7B at 4096
/// tokens 10.3%, Qwen3-30B-A3B at 16384 6.8%, GPT-OSS-120B at 16384 15.5%, DeepSeek-V3
/// at 4096 0.6%. One-warpgroup (64-row) tiles saved nothing (Qwen3-30B-A3B and
/// DeepSeek-V3 at 1024 tokens), so they keep gathering.
const GATHERED_ROWS_SHARE: f64 = 0.10;

/// How the single-GPU GEMM1 `gemm` loads its A rows: as TMA tiles of x sorted into the
/// expert-major order ([`BufferId::SortedX`]) where, per row, the gather it saves
/// ([`GATHERED_ROWS_SHARE`] of the row's multiply time at the wgmma rate) outweighs the
/// sort kernel's copy of the row (read and written at the HBM rate); gathered otherwise.
/// Measured layers (one H200, 2026-12-01): sorted, Mixtral-8x7B −3 to −11% at 1024-16384
/// tokens, GPT-OSS-120B −2 to −4% at 4096 and up to −16% at 16384, DeepSeek-V3 −1% at 4096
/// and −4% at 16384; Qwen3-30B-A3B, whose rows carry a sixth of the multiply per byte,
/// +3 to +6% (its 537 MB copy at 16384 tokens took 240 µs against 94 µs saved). The sort
/// kernel looks a token's rows up a thread each, so a token of more rows than its threads
/// (a top_k in the hundreds) gathers.
fn gemm1_row_load(target: &Target, shape: &LayerShape, gemm: &GemmPlan) -> RowLoad {
    if shape.slots_per_token() > SORT_ROWS_THREADS {
        return RowLoad::Gathered;
    }
    let problem = GemmProblem::for_layer(shape, GemmKind::Up, 1);
    let two_warpgroups = gemm.engine == MmaEngine::WgmmaWarpSpecialized && gemm.tile.m >= 128;
    let multiply_seconds = 2.0 * f64::from(problem.k) * f64::from(problem.weight_rows())
        / (target.peak_bf16_flops * target.wgmma_fraction);
    let copy_seconds = 2.0 * 2.0 * f64::from(problem.k) / target.hbm_bytes_per_s;
    if two_warpgroups && GATHERED_ROWS_SHARE * multiply_seconds > copy_seconds {
        RowLoad::Tiles
    } else {
        RowLoad::Gathered
    }
}

/// The cost model's regimes `choices` with the tuning table's GEMMs taken in, each with the
/// entry it took (`None` where none applies, or the entry's GEMMs are all hinted): a
/// regime takes its entry, or is cut into the parts the table's entries tile it into
/// (where the tuner found other GEMMs fastest at its small and large calls), each part
/// taking its entry and named after the regime and its place (`prefill_1`, `prefill_2`).
/// An entry this build cannot plan leaves its regime on the cost model's choice, and a
/// cut is all or nothing: one such part leaves the regime whole; `limitations` says why.
fn tuned_regimes(
    layer: &ir::Layer,
    choices: Vec<RegimeChoice>,
    tuning: &tuning::TuningTable,
    target: &Target,
    shape: &LayerShape,
    limitations: &mut Vec<String>,
) -> Vec<(RegimeChoice, Option<tuning::TunedRegime>)> {
    let mut regimes = Vec::new();
    for choice in choices {
        let entries = tuning.tiling(target, shape, choice.min_tokens, choice.max_tokens);
        let cut = entries.len() > 1;
        let mut parts = Vec::with_capacity(entries.len());
        let mut unplannable = None;
        for (i, entry) in entries.into_iter().enumerate() {
            let mut part = RegimeChoice {
                name: if cut {
                    format!("{}_{}", choice.name, i + 1)
                } else {
                    choice.name.clone()
                },
                min_tokens: entry.min_tokens,
                max_tokens: entry.max_tokens,
                ..choice.clone()
            };
            match apply_tuned(layer, target, shape, &mut part, entry) {
                Ok(taken) => parts.push((part, taken.then(|| entry.clone()))),
                Err(reason) => {
                    unplannable = Some((part.name, reason));
                    break;
                }
            }
        }
        match unplannable {
            Some((part, reason)) => {
                limitations.push(if cut {
                    format!(
                        "the tuning table's cut of regime `{}` on {} cannot be used by this build (part `{part}`: {reason}): the regime stays whole, on the cost model's choice",
                        choice.name, target.name
                    )
                } else {
                    format!(
                        "the tuning table's entry for regime `{}` on {} cannot be used by this build ({reason}): the cost model's choice stands",
                        choice.name, target.name
                    )
                });
                regimes.push((choice, None));
            }
            None if parts.is_empty() => regimes.push((choice, None)),
            None => regimes.extend(parts),
        }
    }
    regimes
}

/// Takes `entry`'s GEMMs into `choice`, each it has and the spec does not hint; all or
/// nothing. Whether any was taken.
fn apply_tuned(
    layer: &ir::Layer,
    target: &Target,
    shape: &LayerShape,
    choice: &mut RegimeChoice,
    entry: &tuning::TunedRegime,
) -> Result<bool, String> {
    let tokens = choice.max_tokens;
    let take = |kind: GemmKind, tuned: Option<tuning::TunedGemm>, name: &str| match tuned
        .filter(|_| !gemm_hinted(layer, kind))
    {
        Some(tuned) => {
            let problem = tuning::single_gpu_problem(shape, kind);
            tuning::tuned_gemm(target, &problem, &tuned, tokens)
                .map(Some)
                .map_err(|reason| format!("{name}: {reason}"))
        }
        None => Ok(None),
    };
    let gemm1 = take(GemmKind::Up, entry.gemm1, "gemm1")?;
    let gemm2 = take(GemmKind::Down, entry.gemm2, "gemm2")?;
    let taken = gemm1.is_some() || gemm2.is_some();
    if let Some(gemm) = gemm1 {
        choice.gemm1 = gemm;
    }
    if let Some(gemm) = gemm2 {
        choice.gemm2 = gemm;
    }
    Ok(taken)
}

/// The regimes of a layer of `shape` on `target`: token counts 1, 2, 4, … up to
/// max_tokens are probed; the best configuration at each probe decides the regime that
/// probe falls in, consecutive probes with the same choice merge, and at most three
/// regimes remain. Each regime's estimates are at its largest token count.
pub(crate) fn choose_regimes(
    layer: &ir::Layer,
    target: &Target,
    shape: &LayerShape,
    row_phases: u32,
) -> Result<Vec<RegimeChoice>, PlanError> {
    let up = GemmProblem::for_layer(shape, GemmKind::Up, row_phases);
    let down = GemmProblem::for_layer(shape, GemmKind::Down, row_phases);
    let hints = &layer.schedule;
    let mut probes: Vec<u32> = std::iter::successors(Some(1u32), |t| t.checked_mul(2))
        .take_while(|&t| t < shape.max_tokens)
        .collect();
    probes.push(shape.max_tokens);

    let mut groups: Vec<ProbeGroup> = Vec::new();
    for &tokens in &probes {
        let g1 = choose_gemm(layer, target, &up, hints.gemm1_tile, hints.stages, tokens)?;
        let g2 = choose_gemm(layer, target, &down, hints.gemm2_tile, hints.stages, tokens)?;
        match groups.last_mut() {
            Some(last) if same_config(&last.2, &g1) && same_config(&last.3, &g2) => {
                last.1 = tokens;
            }
            _ => groups.push((tokens, tokens, g1, g2)),
        }
    }
    let groups = merge_to_at_most(groups, 3, &probes, target, [&up, &down]);
    let count = groups.len();
    let mut next_min = 0;
    Ok(groups
        .into_iter()
        .enumerate()
        .map(|(i, (_, max, mut gemm1, mut gemm2))| {
            gemm1.estimate = cost::estimate(target, &up, &gemm1, max);
            gemm2.estimate = cost::estimate(target, &down, &gemm2, max);
            // A hinted ring depth counts stages of the hinted (or 64-deep) tile.
            let (gemm1, gemm2) = if hints.stages.is_some() {
                (gemm1, gemm2)
            } else {
                (
                    with_deep_stages(target, &up, gemm1, max),
                    with_deep_stages(target, &down, gemm2, max),
                )
            };
            let min_tokens = next_min;
            next_min = max + 1;
            RegimeChoice {
                name: regime_name(i, count).to_string(),
                min_tokens,
                max_tokens: max,
                gemm1,
                gemm2,
            }
        })
        .collect())
}

/// `gemm` on the deepest ring (at most [`MAX_STAGES`] stages) whose shared memory, with
/// `reserved` bytes of static shared memory beside it and the driver's 1 KiB, still fits a
/// block on an SM of `target`: for a kernel that runs one block per SM whatever its rings
/// (a rank's fused decode), where a deeper ring streams the weights faster at no cost in
/// blocks. `gemm` itself where no deeper ring fits. Measured on two virtual ranks of one
/// H200 (fused decodes at 1-32 tokens per rank, 2026-12-04,
/// `benches/results/2026-12-04_ep_fused_decode_rings.md`): in a sweep by schedule hints
/// each step deeper was faster (Qwen3-30B-A3B 3 → 4 → 5 stages of 128 −2 to −5%,
/// DeepSeek-V3 3 → 5 −6%, Mixtral-8x7B 3 → 4 −2 to −11%); with the deepest rings the calls
/// took 8-17% (Qwen3-30B-A3B) and 12% (DeepSeek-V3) less. On one GPU, whose kernels run two
/// blocks per SM or more, deeper rings gained nothing (same file).
pub(crate) fn with_deepest_ring(
    target: &Target,
    problem: &GemmProblem,
    gemm: &GemmPlan,
    reserved: u32,
) -> GemmPlan {
    (gemm.stages + 1..=MAX_STAGES)
        .rev()
        .filter_map(|stages| shape_gemm(target, problem, gemm.engine, gemm.tile, stages).ok())
        .find(|deep| {
            deep.cluster == gemm.cluster
                && deep.smem_bytes + reserved <= target.smem_per_block
                && deep.smem_bytes + reserved + SMEM_RESERVED_PER_BLOCK <= target.smem_per_sm
        })
        .map(|deep| GemmPlan {
            source: gemm.source,
            ..deep
        })
        .unwrap_or_else(|| gemm.clone())
}

/// The rank regimes `choices` (from [`choose_regimes`]) with regimes drawn for a rank's
/// fused decode of calls of up to `tokens` tokens, where the spec hints neither GEMM: the
/// calls are cut into a span of 16-row tiles and one of 32-row tiles
/// ([`fused_decode_tile_rows`], which also ends the fused decode's reach), each served by
/// the cost model's first regime where its GEMMs fuse with those rows, else by the pair of
/// mma.sync GEMMs with equal threads, 256-byte stage rows and those rows that ranks best at
/// the span's largest call; the regimes above start after them, and all are renamed in
/// order. `choices` unchanged where the first regime serves every span. On two virtual
/// ranks of one H200 (Mixtral-8x7B, 2026-12-04) its decode fused this way ran 380-842 µs
/// at 1-32 tokens per rank against 523-1129 as the cost model's table
/// (`benches/results/2026-12-04_ep_fused_decode_rings.md`), and 32-row tiles took another
/// 17% off 32 tokens (`benches/results/2026-12-04_fused_decode_tile_rows.md`).
pub(crate) fn with_rank_fused_decode_regime(
    layer: &ir::Layer,
    target: &Target,
    shape: &LayerShape,
    row_phases: u32,
    choices: Vec<RegimeChoice>,
    tokens: u32,
) -> Vec<RegimeChoice> {
    let hints = &layer.schedule;
    if tokens == 0 || hints.gemm1_tile.is_some() || hints.gemm2_tile.is_some() {
        return choices;
    }
    // The cost model's first regime, where it can fuse.
    let Some(first) = choices.first() else {
        return choices;
    };
    let first_fused =
        fused_decode::first_regime_on_mma_sync("", first.min_tokens, &first.gemm1, &first.gemm2)
            .is_ok()
            .then(|| [first.gemm1.clone(), first.gemm2.clone()]);
    // The fused decode reaches as far as 32-row tiles hold the rows (larger tiles were not
    // measured); larger calls run the cost model's regimes.
    let up = GemmProblem::for_layer(shape, GemmKind::Up, row_phases);
    let rows_by_calls: Vec<u32> = (1..=tokens.min(shape.max_tokens))
        .map_while(|calls| fused_decode_tile_rows(&up, calls))
        .collect();
    let tokens = rows_by_calls.len() as u32;
    if tokens == 0 {
        return choices;
    }
    // The pair of mma.sync GEMMs with equal threads that ranks best at `calls` tokens
    // among tiles of 256-byte rows and [`fused_decode_tile_rows`] rows.
    let best_pair_at = |calls: u32| -> Option<[GemmPlan; 2]> {
        let on_mma_sync = |kind: GemmKind| -> Vec<GemmPlan> {
            let problem = GemmProblem::for_layer(shape, kind, row_phases);
            let rows = fused_decode_tile_rows(&problem, calls).unwrap_or(32);
            let tiles = candidate_tiles()
                .filter(|&(engine, tile)| engine == MmaEngine::MmaSync && tile.m == rows)
                .map(|(engine, tile)| {
                    let deep = TileShape {
                        k: DEEP_TILE_K,
                        ..tile
                    };
                    (engine, deep)
                });
            costed_tiles(target, &problem, tiles, calls, hints.stages)
                .filter_map(Result::ok)
                .collect()
        };
        let (ups, downs) = (on_mma_sync(GemmKind::Up), on_mma_sync(GemmKind::Down));
        ups.iter()
            .flat_map(|up| {
                downs
                    .iter()
                    .filter(move |down| down.threads() == up.threads())
                    .map(move |down| (up, down))
            })
            .min_by(|a, b| {
                let seconds = |(up, down): (&GemmPlan, &GemmPlan)| {
                    ranking_seconds(up) + ranking_seconds(down)
                };
                seconds(*a).total_cmp(&seconds(*b))
            })
            .map(|(up, down)| {
                [up, down].map(|gemm| GemmPlan {
                    source: tuning::ChoiceSource::FusedDecode,
                    ..gemm.clone()
                })
            })
    };
    let fused = |min_tokens: u32, max_tokens: u32, [gemm1, gemm2]: [GemmPlan; 2]| RegimeChoice {
        name: String::new(),
        min_tokens,
        max_tokens,
        gemm1,
        gemm2,
    };
    // The calls up to the last that keeps one token's tile rows, then the rest: each span
    // runs the first regime's GEMMs where they fuse with its rows, else a pair drawn here.
    let last_small = rows_by_calls
        .iter()
        .take_while(|&&rows| rows == rows_by_calls[0])
        .count() as u32;
    let spans = if last_small < tokens {
        vec![(0, last_small), (last_small + 1, tokens)]
    } else {
        vec![(0, tokens)]
    };
    let pair_for = |max_tokens: u32| -> Option<[GemmPlan; 2]> {
        let rows = fused_decode_tile_rows(&up, max_tokens);
        match &first_fused {
            Some(pair) if pair.iter().all(|gemm| Some(gemm.tile.m) == rows) => Some(pair.clone()),
            _ => best_pair_at(max_tokens),
        }
    };
    let mut fused_regimes = Vec::new();
    for (min_tokens, max_tokens) in spans {
        let Some(pair) = pair_for(max_tokens) else {
            return choices;
        };
        fused_regimes.push(fused(min_tokens, max_tokens, pair));
    }
    // Where the first regime serves every span, it stays as the cost model drew it (its
    // fused decode covers them).
    if fused_regimes
        .iter()
        .all(|regime| regime.gemm1.source != tuning::ChoiceSource::FusedDecode)
    {
        return choices;
    }
    let above = choices
        .into_iter()
        .filter(|choice| choice.max_tokens > tokens)
        .map(|choice| RegimeChoice {
            min_tokens: choice.min_tokens.max(tokens + 1),
            ..choice
        });
    let regimes: Vec<RegimeChoice> = fused_regimes.into_iter().chain(above).collect();
    // At most three regimes came in; with the two drawn here, five have names of their own.
    let count = regimes.len();
    regimes
        .into_iter()
        .enumerate()
        .map(|(i, choice)| RegimeChoice {
            name: match (i, count) {
                (1, 4 | 5) => "small",
                (2, 4 | 5) => "mid",
                (3, 5) => "large",
                _ => regime_name(i, count),
            }
            .to_string(),
            ..choice
        })
        .collect()
}

/// The rows of a rank's fused-decode tile for calls of `calls` tokens: the fewer of 16 and
/// 32 that hold a hit expert's rows but in [`FUSED_DECODE_SPILL`] of its calls under
/// uniform routing (an expert's rows taken as Poisson around `calls · K / E`): past that,
/// too many experts stream their weights twice, for a second m-tile. `None` where 32 do not
/// (larger tiles were not measured).
fn fused_decode_tile_rows(problem: &GemmProblem, calls: u32) -> Option<u32> {
    let mean_rows = f64::from(calls) * f64::from(problem.top_k) / f64::from(problem.experts);
    [16, 32]
        .into_iter()
        .find(|&rows| cost::rows_beyond(mean_rows, rows) <= FUSED_DECODE_SPILL)
}

/// The share of a hit expert's calls whose rows may spill past one fused-decode tile
/// ([`fused_decode_tile_rows`]). Where 16- and 32-row tiles cross, measured on one H200
/// (Mixtral-8x7B's fused decode, virtual ranks, 2026-12-04,
/// `benches/results/2026-12-04_fused_decode_tile_rows.md`): at a mean of 9-12 rows per
/// expert (1-10% spill past 16) 32-row tiles ran 1-9% slower, at 16 (43%) 17% faster, at
/// 22 (two ranks of one expert each: 32 rows spill 2%) 40% faster.
const FUSED_DECODE_SPILL: f64 = 0.2;

fn choose_gemm(
    layer: &ir::Layer,
    target: &Target,
    problem: &GemmProblem,
    hinted_tile: Option<TileShape>,
    hinted_stages: Option<u32>,
    tokens: u32,
) -> Result<GemmPlan, PlanError> {
    if let Some(tile) = hinted_tile {
        // `plan` has already refused hints that `hint_problems` reports.
        let mut gemm = hinted_gemm(target, problem, tile, hinted_stages).map_err(|reason| {
            PlanError::ImpossibleHint {
                layer: layer.name.clone(),
                target: target.name.clone(),
                problem: HintProblem {
                    key: problem.kind.hint_key(),
                    hint: format!(
                        "{} = {}x{}x{}",
                        problem.kind.hint_key().name(),
                        tile.m,
                        tile.n,
                        tile.k
                    ),
                    reason,
                },
            }
        })?;
        gemm.estimate = cost::estimate(target, problem, &gemm, tokens);
        // A hint names the tile; whether blocks pair up is still the model's call.
        if let Some(mut pair) = as_cluster_pair(problem, &gemm) {
            pair.estimate = cost::estimate(target, problem, &pair, tokens);
            if ranking_seconds(&pair) <= ranking_seconds(&gemm) {
                gemm = pair;
            }
        }
        gemm.source = tuning::ChoiceSource::Hint;
        return Ok(gemm);
    }
    let mut best: Option<GemmPlan> = None;
    let mut last_reason = String::from("no candidate tiles");
    for candidate in costed_candidates(target, problem, tokens, hinted_stages) {
        match candidate {
            Ok(gemm) => {
                let better = best
                    .as_ref()
                    .is_none_or(|b| ranking_seconds(&gemm) < ranking_seconds(b) * 0.999);
                if better {
                    best = Some(gemm);
                }
            }
            Err(reason) => last_reason = reason,
        }
    }
    best.ok_or_else(|| PlanError::NoFeasibleTile {
        layer: layer.name.clone(),
        what: problem
            .kind
            .hint_key()
            .name()
            .trim_end_matches(".tile")
            .to_string(),
        reason: last_reason,
    })
}

/// What candidates are ranked by: the estimate, with [`ONE_BLOCK_PER_SM_PENALTY`] on
/// configurations of one block per SM and [`SHALLOW_RING_PENALTY_PER_STAGE`] on shallow
/// mma.sync rings (see [`with_deep_stages`] for the depth of their stages).
fn ranking_seconds(gemm: &GemmPlan) -> f64 {
    gemm.estimate.seconds * ranking_factor(gemm)
}

fn ranking_factor(gemm: &GemmPlan) -> f64 {
    // A warp-specialised block overlaps its own loads, waits and epilogue.
    let alone = if gemm.blocks_per_sm == 1 && gemm.warp_roles.is_none() {
        ONE_BLOCK_PER_SM_PENALTY
    } else {
        1.0
    };
    let shallow = match gemm.engine {
        MmaEngine::MmaSync => {
            // The ring's depth counts in reduction length: 3 stages of 128 hold more than 5
            // of 64.
            let missing =
                (MMA_SYNC_DEEPEST_RING * TILE_K).saturating_sub(gemm.stages * gemm.tile.k) / TILE_K;
            1.0 + SHALLOW_RING_PENALTY_PER_STAGE * f64::from(missing)
        }
        MmaEngine::WgmmaWarpSpecialized => 1.0,
    };
    alone * shallow
}

/// `chosen`, or its tile with [`DEEP_TILE_K`]-deep stages where that ranks within
/// [`SHORT_ROW_PENALTY`] (times the share of the estimate that is the memory stream) of it
/// at `tokens`. The depth refines a regime's chosen mma.sync tile once the regimes are
/// drawn: the cost model cannot tell the depths apart (same tile, same bytes), and compared
/// as equals at every probe they split regimes on near-ties alone.
fn with_deep_stages(
    target: &Target,
    problem: &GemmProblem,
    chosen: GemmPlan,
    tokens: u32,
) -> GemmPlan {
    if chosen.source == tuning::ChoiceSource::Hint || chosen.estimate.seconds <= 0.0 {
        return chosen;
    }
    let streaming = (chosen.estimate.memory_seconds / chosen.estimate.seconds).min(1.0);
    let allowed = ranking_seconds(&chosen) * (1.0 + SHORT_ROW_PENALTY * streaming);
    deep_stages_of(target, problem, &chosen, tokens)
        .filter(|deep| ranking_seconds(deep) <= allowed)
        .unwrap_or(chosen)
}

/// The mma.sync tile of `gemm` with [`DEEP_TILE_K`]-deep stages at its best ring by the
/// cost model at `tokens`, where `gemm` is an mma.sync tile of [`TILE_K`]-deep stages and
/// the deeper stages can be planned.
pub(crate) fn deep_stages_of(
    target: &Target,
    problem: &GemmProblem,
    gemm: &GemmPlan,
    tokens: u32,
) -> Option<GemmPlan> {
    if gemm.engine != MmaEngine::MmaSync || gemm.tile.k != TILE_K {
        return None;
    }
    let tile = TileShape {
        k: DEEP_TILE_K,
        ..gemm.tile
    };
    stage_choices(MmaEngine::MmaSync, tile)
        .into_iter()
        .filter_map(|stages| shape_gemm(target, problem, MmaEngine::MmaSync, tile, stages).ok())
        .map(|mut deep| {
            deep.estimate = cost::estimate(target, problem, &deep, tokens);
            deep
        })
        .min_by(|a, b| ranking_seconds(a).total_cmp(&ranking_seconds(b)))
}

/// A C identifier made from a layer name: letters, digits and `_`, not starting with a digit.
pub fn c_identifier(name: &str) -> String {
    let mut ident: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if ident.is_empty() || ident.starts_with(|c: char| c.is_ascii_digit()) {
        ident.insert_str(0, "moe_");
    }
    ident
}
