//! Expert parallelism on one node: how R ranks exchange tokens and results for one layer.
//!
//! Each rank owns `E / R` experts (contiguous placement). One call runs, per rank:
//! 1. **metadata**: for every destination, the rank counts its (token, expert) pairs there,
//!    writes the destination's receive index (which received slot, which origin pair, which
//!    routing weight, per local expert) and counts, then releases one flag at the
//!    destination;
//! 2. **dispatch**: token rows travel into the destination's receive buffer, each token
//!    once per destination however many of its experts live there, `dispatch_chunk`
//!    tokens at a time, each chunk followed by a release of its own flag;
//! 3. **GEMM1** tiles over local experts, each expert's rows local first, then sources in
//!    arrival order, acquire the flags of exactly the chunks their rows sit in;
//! 4. **GEMM2** either stores each weighted row straight into the origin rank's combine
//!    slot and releases the origin's per-token counter (pair rows), or keeps its rows here
//!    (rank partials, [`CombineRoute`]);
//! 5. **combine**: with rank partials it first sums each received token's rows here into
//!    one partial, stored at the origin with a release of its counter; then, at the
//!    origin, it waits for each token's counter and sums its K slots in k order (or its
//!    ranks' partials in rank order).
//!
//! Flags carry the call's epoch, so consecutive calls need no reset. This module decides the
//! numbers (chunk size, communication blocks, capacities, traffic order, residency); it is
//! plan data that `explain` prints.

use serde::{Deserialize, Serialize};

use super::launch::{
    KernelParam, StreamRole, shared_gate_launch, unit_ticket_params, weight_param,
};
use super::network::{self, NetworkPlan, Route};
use super::{
    Buffer, BufferId, COMBINE_THREADS, FusedDecode, GemmKind, GemmPlan, GemmProblem, Grid, HintKey,
    HintProblem, Launch, LaunchArg, LayerShape, PlanError, RegimeChoice, RegimeParts, Target,
    choose_regimes, cost, fused_decode, shared_gate_buffer, shared_gate_kernel,
    static_smem_reserved, unit_tickets, with_deepest_ring, with_rank_fused_decode_regime,
};
use crate::ir::{self, TrafficOrder};

/// Where the ranks of a plan live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// All ranks on one GPU, each with its own buffers and streams (tests the protocol).
    Virtual,
    /// One GPU per rank, driven by one process with peer access between the GPUs.
    Devices,
}

impl Placement {
    /// Where `topology`'s ranks live: virtual ranks (on one GPU, or emulating nodes) or a
    /// GPU each.
    pub fn of(topology: &ir::Topology) -> Self {
        if topology.virtual_ranks.is_some() {
            Placement::Virtual
        } else {
            Placement::Devices
        }
    }
}

/// How GEMM2's weighted rows travel back to the ranks their tokens came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CombineRoute {
    /// GEMM2's epilogue stores each pair's row into the origin's slot for its (token, k)
    /// and releases the origin's counter: nothing runs between GEMM2 and the combine, and
    /// a token's every pair crosses the link.
    PairRows,
    /// GEMM2 keeps its rows here; the combine first sums each received token's rows (in k
    /// order) into one partial per (token, rank), stored at the origin, which then sums R
    /// partials. A token crosses back once per rank it visited, for one more read of every
    /// row here.
    RankPartials,
}

/// Rank partials are chosen where a visited rank holds at least this many of a token's
/// pairs on average, halving the result rows on the link or better. Measured on two
/// H200s (2026-11-30, Qwen3-30B-A3B, 4096 tokens per rank): GEMM2 took 459 µs storing its
/// rows at their origins and 299 µs storing every row locally.
const RANK_PARTIALS_MIN_PAIRS: f64 = 2.0;

/// The expected pairs of a token on a rank that holds at least one of its experts, under
/// uniform routing (K distinct experts of E, E/R per rank).
pub fn pairs_per_visited_rank(experts: u32, ranks: u32, top_k: u32) -> f64 {
    let (e, local) = (f64::from(experts), f64::from(experts / ranks));
    // P(none of the K choices on a given rank) = Π (E - E/R - i) / (E - i).
    let missed: f64 = (0..top_k)
        .map(|i| ((e - local - f64::from(i)) / (e - f64::from(i))).max(0.0))
        .product();
    (f64::from(top_k) / f64::from(ranks)) / (1.0 - missed)
}

/// How results return, and why.
fn combine_route(layer: &ir::Layer, ranks: u32, over_network: bool) -> (CombineRoute, String) {
    if over_network {
        return (
            CombineRoute::RankPartials,
            "rank partials: across nodes a relay sums its node's rank partials of a token into one node partial, which crosses the network once; pair rows would send a network origin every slot of each token (its top_k and shared slices')"
                .to_string(),
        );
    }
    let pairs = pairs_per_visited_rank(layer.experts, ranks, layer.top_k);
    if pairs >= RANK_PARTIALS_MIN_PAIRS {
        (
            CombineRoute::RankPartials,
            format!(
                "rank partials: a visited rank holds {pairs:.2} of a token's pairs under uniform routing, so {pairs:.2}x fewer result rows travel back to the origin, for one more read of each row here"
            ),
        )
    } else {
        (
            CombineRoute::PairRows,
            format!(
                "pair rows: a visited rank holds {pairs:.2} of a token's pairs under uniform routing (rank partials from {RANK_PARTIALS_MIN_PAIRS}), too few to pay for a pass after GEMM2"
            ),
        )
    }
}

/// The memory scope flags are released and acquired at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlagScope {
    /// `.gpu`: every rank on one device.
    Gpu,
    /// `.sys`: peers on other devices.
    Sys,
}

impl FlagScope {
    pub fn ptx(self) -> &'static str {
        match self {
            FlagScope::Gpu => "gpu",
            FlagScope::Sys => "sys",
        }
    }
}

/// The expert-parallel part of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertParallelPlan {
    pub ranks: u32,
    pub placement: Placement,
    pub experts_per_rank: u32,
    pub scope: FlagScope,
    /// Tokens per dispatch chunk: the unit a flag releases and a GEMM tile waits for.
    pub dispatch_chunk: u32,
    /// Why this chunk size.
    pub chunk_reason: String,
    /// The fewest tokens a dispatch work item copies: a power of two dividing the chunk. A
    /// call with fewer chunks than communication blocks splits its chunks into pieces (down
    /// to this) so that every block copies; larger calls copy whole chunks.
    pub dispatch_piece: u32,
    /// Token slots a rank keeps per source: a source may send every one of its
    /// `max_tokens` tokens to one destination, each once.
    pub slots_per_source: u32,
    /// Chunks per source at `slots_per_source`.
    pub chunks_per_source: u32,
    /// Rows one (local expert, source) segment may hold: every token of the source.
    pub rows_per_segment: u32,
    /// Rows of the intermediate a rank may hold: `R · max_tokens · min(K, E / R)`.
    pub intermediate_rows: u64,
    /// How GEMM2's rows return to their origins, and why.
    pub combine_route: CombineRoute,
    pub combine_reason: String,
    /// Thread blocks that move data (per rank), and why.
    pub comm_blocks: u32,
    pub comm_reason: String,
    /// SMs each rank's compute kernels may fill: the rest stay free for the communication
    /// blocks of every rank on the device, so every spin-wait's producer is resident.
    pub compute_sms: u32,
    /// How the residency bound was met.
    pub residency: String,
    pub traffic: TrafficOrder,
    /// Per source rank, the destinations in the order it sends to them (itself first: its
    /// own rows are ready soonest and need no link).
    pub send_order: Vec<Vec<u32>>,
    /// Per destination rank, the sources in the order its GEMM tiles take their rows
    /// (itself first, then by when each source reaches it in its own send order).
    pub receive_order: Vec<Vec<u32>>,
    /// Traffic between nodes (NCCL), when ranks live on several; `None` on one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPlan>,
    /// The buffers each rank allocates (sizes per rank).
    pub workspace: Vec<Buffer>,
    /// The buffers peers write, in the order of each rank's row of the peer table.
    pub peer_buffers: Vec<BufferId>,
    /// Tokens per tile of the metadata kernel: each tile's (token, k) pairs are counted,
    /// reserved and staged in the block's shared memory (see [`METADATA_TILE_PAIRS`]).
    pub metadata_tile_tokens: u32,
    /// Entry points shared by every regime.
    pub route_kernel: String,
    pub dispatch_kernel: String,
    pub arrange_kernel: String,
    pub combine_kernel: String,
    /// The regimes of one rank, by tokens per rank: its GEMMs and launches.
    pub regimes: Vec<ExpertParallelRegime>,
    /// Whether a call may route itself (the layer has a router): each rank then runs, on
    /// its own tokens, the launches of the layer's router ([`super::Plan::router`]) for the
    /// single-GPU regime of its token count, on its compute stream ahead of the call's
    /// kernels on both streams, and the expert-parallel kernels read the choices from its
    /// `routed_ids` and `routed_weights`. A fused router there lays out no routing
    /// metadata (`lays_out_routing` = 0): these kernels route. Its blocks wait for no other
    /// block and take the place of the rank's compute blocks in the residency bound; on
    /// virtual ranks no gate runs in clusters, which need several free SMs at once.
    pub routes_itself: bool,
}

impl ExpertParallelRegime {
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
            tuned: None,
            fused_decode: self.fused_decode.as_ref(),
            expert_parallel: true,
        }
    }

    /// The table's launches, then the fused decode's (which a call of up to its
    /// `max_tokens` tokens per rank runs instead, on every rank).
    pub fn all_launches(&self) -> impl Iterator<Item = &Launch> {
        self.launches
            .iter()
            .chain(self.fused_decode.iter().map(|fused| &fused.launch))
    }

    /// Whether calls of at most `tokens` tokens per rank run the fused decode.
    pub fn fuses(&self, tokens: u32) -> bool {
        self.fused_decode
            .as_ref()
            .is_some_and(|fused| fused.covers(tokens))
    }

    /// Token lanes (`COMBINE_THREADS` threads each) of `combine_kernel`'s grid at a call of
    /// `tokens` tokens per rank: 0 where this regime launches no such kernel.
    pub fn combine_lanes(&self, combine_kernel: &str, tokens: u32) -> u32 {
        self.launches
            .iter()
            .find(|launch| launch.kernel == combine_kernel)
            .map_or(0, |launch| {
                launch.grid.blocks(tokens) * (launch.block_threads / COMBINE_THREADS)
            })
    }
}

impl ExpertParallelPlan {
    /// The position in `regimes` of the regime serving `tokens` tokens on a rank (`None`
    /// above max_tokens).
    pub fn regime_index_for(&self, tokens: u32) -> Option<usize> {
        self.regimes
            .iter()
            .position(|r| r.min_tokens <= tokens && tokens <= r.max_tokens)
    }
}

/// One regime's expert-parallel kernels on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertParallelRegime {
    /// `decode`, `mid` or `prefill`, as the single-GPU regimes are named, or `<name>_long`
    /// for a regime's longer calls that dispatch on fewer communication blocks.
    pub name: String,
    /// The tokens per rank of the calls it serves.
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// GEMM plans for a rank's problem (its experts, every source's rows) on its compute
    /// SMs.
    pub gemm1: GemmPlan,
    pub gemm2: GemmPlan,
    pub gemm1_kernel: String,
    pub gemm2_kernel: String,
    /// Dispatch blocks of this regime (at most the plan's `comm_blocks`), and why.
    pub comm_blocks: u32,
    pub comm_reason: String,
    /// SMs its compute kernels fill: the rank's SMs less `comm_blocks`.
    pub compute_sms: u32,
    /// The launches of one call on one rank, in order per stream.
    pub launches: Vec<Launch>,
    /// Its smallest calls as one persistent kernel per rank, in place of `launches` (a
    /// call runs it on every rank or on none).
    #[serde(default)]
    pub fused_decode: Option<FusedDecode>,
}

/// The buffers that carry the exchange's state from one call to the next: flags compare
/// against the epoch, counters return to zero, the error word holds the last error. After
/// a time-out they disagree between ranks; zeroing them on every rank (and starting the
/// epochs again at 1) is a fresh start.
pub const EXCHANGE_STATE: [BufferId; 15] = [
    BufferId::MetaFlags,
    BufferId::ChunkFlags,
    BufferId::ChunkPieces,
    BufferId::ArrangeBlocksDone,
    BufferId::MetadataCounters,
    BufferId::CombineCounters,
    BufferId::Credits,
    BufferId::ErrorWord,
    BufferId::NetReady,
    BufferId::NetArrived,
    BufferId::NetReturnFlags,
    BufferId::NetPartialsReady,
    BufferId::NodePartialsReady,
    BufferId::ReceivedPairRows,
    BufferId::RankFusedCounters,
];

/// The buffers peers write, as they appear in each rank's row of the peer table.
pub const PEER_BUFFERS: [BufferId; 10] = [
    BufferId::RecvX,
    BufferId::RecvSlot,
    BufferId::RecvPair,
    BufferId::RecvWeight,
    BufferId::RecvCounts,
    BufferId::MetaFlags,
    BufferId::ChunkFlags,
    BufferId::CombineSlots,
    BufferId::CombineCounters,
    BufferId::Credits,
];

/// The buffers peers of this node write across nodes too: the relays' inboxes of the
/// node's partials.
const NODE_PEER_BUFFERS: [BufferId; 2] = [BufferId::NodePartials, BufferId::NodePartialsReady];

/// The peer table's buffers, with the relays' when ranks span nodes.
fn peer_buffers(over_network: bool) -> Vec<BufferId> {
    PEER_BUFFERS
        .into_iter()
        .chain(NODE_PEER_BUFFERS.into_iter().filter(|_| over_network))
        .collect()
}

/// Rank partials a combine block stores before it releases them, a thread each: their
/// system-scope fences then wait together rather than one after another.
pub const PARTIALS_PER_RELEASE: u32 = 8;

/// Threads of a block of the metadata and arrange kernels.
pub const META_THREADS: u32 = 512;
/// The most (token, k) pairs of a metadata tile: its shared arrays hold 8 bytes per pair, so
/// 2048 pairs take 16 KB, and a tile's rows per expert are long enough runs to write side
/// by side (8 per expert at DeepSeek-V3's 256 experts and 8 choices).
pub const METADATA_TILE_PAIRS: u32 = 2048;
/// Token lanes of a combine block, each `COMBINE_THREADS` threads reducing a token at a
/// time; the combine runs one block per compute SM (persistent, looping over tokens). Four
/// lanes per SM, as four blocks of one lane each were on a rank's own GPU until 2026-12-04:
/// eight were tried for the rank partials' pass and gained nothing once measured in
/// alternating runs (Qwen3-30B-A3B at 4096 tokens per rank on two H200s, 2026-11-30: 810 /
/// 828 µs with four, 834 / 844 with eight). Virtual ranks and ranks beside NCCL, whose
/// grids keep to one block per SM (see `residency`), had one lane per SM then: two
/// virtual ranks' combine stages moved 8-14 GB/s per lane
/// (benches/results/2026-12-04_simulator_virtual_ranks.md).
pub const COMBINE_LANES: u32 = 4;

/// SM-driven stores through NVLink measured on the two-H200 machine (2026-11-29): blocks
/// of 512 threads storing 16 bytes each, against GB/s one way.
const MEASURED_STORE_RATES: [(u32, f64); 3] = [(16, 323.0), (66, 345.0), (132, 365.0)];
/// The smallest dispatch work item copies about this many bytes: few enough that a
/// 128-token call of a 7168-wide layer has a piece for each of 24 blocks. (Every piece
/// ends with a fence that waits for its stores to land across the link: measured
/// 2026-11-30, copying whole 64-token chunks as 2-token pieces halved the dispatch rate
/// at T = 4096, so only calls with too few chunks are split.)
const PIECE_BYTES: u64 = 32 * 1024;
/// Communication blocks are the fewest that reach this share of the best measured rate.
const COMM_RATE_SHARE: f64 = 0.85;
/// Threads of a communication block.
pub const COMM_THREADS: u32 = 512;
/// A chunk should take at least this many flag latencies to move, so that the release
/// after it costs a small share of its time.
const CHUNK_LATENCIES: f64 = 2.0;
/// Measured release→acquire latency of a flag across the two H200s (1.3 µs).
const FLAG_LATENCY_S: f64 = 1.3e-6;

/// The expert-parallel plan of `layer` over `ranks` ranks living as `placement` says;
/// `None` for one rank. `router_buffers`: the buffers of the layer's planned router (none
/// without one), which each rank then holds to route its own tokens. `flag_wait_seconds`:
/// the plan's bound on one flag wait (the network's host wait bound counts two).
#[allow(clippy::too_many_arguments)]
pub fn plan_expert_parallel(
    layer: &ir::Layer,
    target: &Target,
    ranks: u32,
    placement: Placement,
    symbol: &str,
    shape: &LayerShape,
    router_buffers: Vec<Buffer>,
    flag_wait_seconds: f64,
) -> Result<Option<ExpertParallelPlan>, PlanError> {
    if ranks <= 1 {
        return Ok(None);
    }
    let hints = &layer.schedule;
    let row_bytes = f64::from(layer.hidden) * 2.0;
    let (link_bytes_per_s, scope) = match placement {
        // Virtual ranks move data within one device's memory.
        Placement::Virtual => (target.hbm_bytes_per_s / 2.0, FlagScope::Gpu),
        Placement::Devices => (
            layer.topology.intra_node.bandwidth_bytes_per_s as f64,
            FlagScope::Sys,
        ),
    };
    // Across nodes a chunk is also one NCCL transfer: it should take a few of the
    // network's latencies too (on emulated nodes as well, so that they plan as real ones).
    let network_link = (layer.topology.nodes > 1).then(|| {
        let network = &layer.topology.network;
        (
            network.bandwidth_bytes_per_s as f64,
            network.latency_ns as f64 * 1e-9,
        )
    });
    let (dispatch_chunk, chunk_reason) = match hints.dispatch_chunk {
        Some(chunk) => (chunk, "the spec's `dispatch_chunk`".to_string()),
        None => {
            let link_bytes = link_bytes_per_s * FLAG_LATENCY_S * CHUNK_LATENCIES;
            let network_bytes = network_link.map_or(0.0, |(bandwidth, latency)| {
                bandwidth * latency * CHUNK_LATENCIES
            });
            let tokens = (link_bytes.max(network_bytes) / row_bytes).clamp(16.0, 256.0) as u32;
            let chunk = 1 << (31 - tokens.leading_zeros());
            let mut reason = format!(
                "a chunk of {chunk} rows ({} KB) takes about {CHUNK_LATENCIES} flag latencies ({:.1} us) at {:.0} GB/s",
                u64::from(chunk) * u64::from(layer.hidden) * 2 / 1000,
                FLAG_LATENCY_S * 1e6,
                link_bytes_per_s / 1e9
            );
            if let Some((bandwidth, latency)) = network_link {
                reason.push_str(&format!(
                    ", and {CHUNK_LATENCIES} network latencies ({:.0} us) at the network's {:.0} GB/s",
                    latency * 1e6,
                    bandwidth / 1e9
                ));
            }
            (chunk, reason)
        }
    };
    let dispatch_piece = dispatch_piece(dispatch_chunk, u64::from(layer.hidden) * 2);
    let rank_sms = fitting_rank_sms(layer, target, ranks, placement)?;
    let sms_per_rank = rank_sms.per_rank;
    let compute_sms = rank_sms.compute();
    // NCCL's kernels need SMs of their own: GEMM1 blocks may spin until a transfer lands.
    let nccl_sms = rank_sms.network;
    let (comm_blocks, comm_reason) = rank_sms.comm;
    let network = network::plan_network(layer, shape, ranks, dispatch_chunk, flag_wait_seconds);
    let one_per_sm = placement == Placement::Virtual || network.is_some();
    // The metadata kernel runs on at most as many blocks as the dispatch, before it.
    let comm_slots = comm_blocks;
    let residency = residency(
        placement,
        ranks,
        comm_slots,
        nccl_sms,
        compute_sms,
        target.sm_count,
    );
    let traffic = hints.traffic_order.unwrap_or(TrafficOrder::Rotate);
    let (send_order, receive_order) = match &network {
        None => rotated_orders(ranks),
        Some(network) => network_orders(network, ranks),
    };
    let max_tokens = layer.max_tokens;
    let experts_per_rank = layer.experts / ranks;
    let chunks_per_source = max_tokens.div_ceil(dispatch_chunk);
    // Every source's pairs, each once, plus a row per own token for each shared slice.
    let intermediate_rows =
        u64::from(ranks) * u64::from(max_tokens) * u64::from(layer.top_k.min(experts_per_rank))
            + u64::from(max_tokens) * u64::from(shape.shared_slices);
    let (combine_route, combine_reason) = combine_route(layer, ranks, network.is_some());
    let sizes = Sizes {
        combine_route,
        ranks,
        experts: layer.experts,
        experts_per_rank,
        top_k: layer.top_k,
        metadata_tile_tokens: (METADATA_TILE_PAIRS / layer.top_k).max(1),
        shared_slices: shape.shared_slices,
        slots: max_tokens,
        chunks: chunks_per_source,
        segment_rows: max_tokens,
        rows: intermediate_rows,
    };
    let kernels = [
        format!("{symbol}_ep_route"),
        format!("{symbol}_ep_dispatch"),
        format!("{symbol}_ep_arrange"),
        format!("{symbol}_ep_combine"),
    ];
    // A rank computes T·K pairs (from every source) over E/R experts: as many rows per
    // expert as one GPU at R·T tokens. Its GEMMs are chosen for that problem, on its
    // compute SMs, with their own token ranges. Every rank also runs the shared slices on
    // its own tokens, after its routed experts.
    let rank_shape = LayerShape {
        experts: experts_per_rank,
        ..shape.clone()
    };
    let rank_target = Target {
        sm_count: compute_sms,
        ..target.clone()
    };
    let rank_fused_shape = fused_decode::RankFusedShape::new(
        target,
        shape,
        ranks,
        experts_per_rank,
        sizes.segment_rows,
        combine_route,
        placement,
    );
    let gemm1_problem = GemmProblem::for_layer(&rank_shape, GemmKind::Up, ranks);
    let gemm2_problem = GemmProblem::for_layer(&rank_shape, GemmKind::Down, ranks);
    // Across nodes NCCL carries part of the exchange, which the fused kernel does not.
    let fused_tokens = match network {
        Some(_) => 0,
        None => hints
            .fused_decode
            .unwrap_or(fused_decode::DEFAULT_RANK_FUSED_DECODE_TOKENS),
    };
    let shared_gate_kernel = shared_gate_kernel(symbol, shape);
    let regime = |choice: &RegimeChoice, name: String, tokens: [u32; 2], comm: (u32, String)| {
        let (regime_comm_blocks, comm_reason) = comm;
        let compute_sms = sms_per_rank
            .saturating_sub(regime_comm_blocks + nccl_sms)
            .max(1);
        let (mut gemm1, mut gemm2) = (choice.gemm1.clone(), choice.gemm2.clone());
        let plan_fused = |gemm1: &GemmPlan, gemm2: &GemmPlan| {
            (fused_tokens > 0)
                .then(|| {
                    fused_decode::plan_rank_fused_decode(
                        target,
                        shape,
                        &rank_fused_shape,
                        (&name, tokens[0], tokens[1]),
                        (gemm1, gemm2),
                        &format!("{symbol}_{name}_ep_fused"),
                        fused_tokens,
                    )
                    .ok()
                })
                .flatten()
        };
        let mut fused = plan_fused(&gemm1, &gemm2);
        // A fused decode of one block per SM gives both GEMMs the deepest rings that fit
        // beside its tables (unless the spec sets the stages).
        if let Some(one) = fused.as_ref().filter(|f| f.blocks_per_sm == 1)
            && hints.stages.is_none()
        {
            let reserved = one.launch.static_smem_bytes;
            let deep1 = with_deepest_ring(&rank_target, &gemm1_problem, &gemm1, reserved);
            let deep2 = with_deepest_ring(&rank_target, &gemm2_problem, &gemm2, reserved);
            if let Some(deep) = plan_fused(&deep1, &deep2) {
                (gemm1, gemm2, fused) = (deep1, deep2, Some(deep));
            }
        }
        for (gemm, problem) in [(&mut gemm1, &gemm1_problem), (&mut gemm2, &gemm2_problem)] {
            gemm.grid_blocks = compute_blocks(one_per_sm, compute_sms, gemm.blocks_per_sm);
            // Estimated at this regime's largest call, on its SMs.
            let regime_target = Target {
                sm_count: compute_sms,
                ..target.clone()
            };
            gemm.estimate = cost::estimate(&regime_target, problem, gemm, tokens[1]);
        }
        let gemm1_kernel = format!("{symbol}_{name}_ep_gemm1");
        let gemm2_kernel = format!("{symbol}_{name}_ep_gemm2");
        let launches = launch_table(
            &kernels,
            shared_gate_kernel.as_deref(),
            [&gemm1_kernel, &gemm2_kernel],
            [&gemm1, &gemm2],
            &sizes,
            shape.expert_bias,
            network.is_some(),
            &KernelBlocks {
                metadata: tokens[1]
                    .div_ceil(sizes.metadata_tile_tokens)
                    .clamp(1, regime_comm_blocks.max(1)),
                dispatch: regime_comm_blocks,
                arrange: compute_blocks(one_per_sm, compute_sms, 1),
                combine: compute_sms,
            },
        );
        ExpertParallelRegime {
            name,
            min_tokens: tokens[0],
            max_tokens: tokens[1],
            gemm1,
            gemm2,
            gemm1_kernel,
            gemm2_kernel,
            comm_blocks: regime_comm_blocks,
            comm_reason,
            compute_sms,
            launches,
            fused_decode: fused,
        }
    };
    let build_regimes = |choices: Vec<RegimeChoice>| {
        let mut ep_regimes = Vec::new();
        for choice in choices {
            let split = match (placement, hints.comm_blocks) {
                (Placement::Devices, None) => {
                    hiding_comm_blocks(layer, ranks, comm_blocks, &choice, |t| {
                        cost::estimate(&rank_target, &gemm1_problem, &choice.gemm1, t).seconds
                    })
                }
                _ => None,
            };
            let plans = || (comm_blocks, "the plan's".to_string());
            match split {
                Some(split) if split.from_tokens > choice.min_tokens => {
                    let below = [choice.min_tokens, split.from_tokens - 1];
                    let tail = [split.from_tokens, choice.max_tokens];
                    let short = (
                        comm_blocks,
                        format!(
                            "the plan's: below {} tokens GEMM1's tiles on local rows are too few to hide a dispatch on fewer",
                            split.from_tokens
                        ),
                    );
                    ep_regimes.push(regime(&choice, choice.name.clone(), below, short));
                    let name = format!("{}_long", choice.name);
                    ep_regimes.push(regime(&choice, name, tail, (split.blocks, split.reason)));
                }
                Some(split) => {
                    let tokens = [choice.min_tokens, choice.max_tokens];
                    ep_regimes.push(regime(
                        &choice,
                        choice.name.clone(),
                        tokens,
                        (split.blocks, split.reason),
                    ));
                }
                None => {
                    let tokens = [choice.min_tokens, choice.max_tokens];
                    ep_regimes.push(regime(&choice, choice.name.clone(), tokens, plans()));
                }
            }
        }
        ep_regimes
    };
    // The regimes with those drawn for the fused decode, unless one of those cannot fuse
    // (its rings and routing tables do not fit, or its grid is not resident): then the
    // cost model's regimes as they are.
    let cost_model = choose_regimes(layer, &rank_target, &rank_shape, ranks)?;
    let drawn = build_regimes(with_rank_fused_decode_regime(
        layer,
        &rank_target,
        &rank_shape,
        ranks,
        cost_model.clone(),
        fused_tokens,
    ));
    let ep_regimes = if drawn.iter().any(|r| {
        r.gemm1.source == super::tuning::ChoiceSource::FusedDecode && r.fused_decode.is_none()
    }) {
        build_regimes(cost_model)
    } else {
        drawn
    };
    let [
        route_kernel,
        dispatch_kernel,
        arrange_kernel,
        combine_kernel,
    ] = kernels;
    let peer_buffers = peer_buffers(network.is_some());
    let mut plan = ExpertParallelPlan {
        ranks,
        placement,
        experts_per_rank,
        scope,
        dispatch_chunk,
        chunk_reason,
        dispatch_piece,
        slots_per_source: max_tokens,
        chunks_per_source,
        rows_per_segment: max_tokens,
        intermediate_rows,
        combine_route,
        combine_reason,
        comm_blocks,
        comm_reason,
        compute_sms,
        residency,
        traffic,
        send_order,
        receive_order,
        routes_itself: !router_buffers.is_empty(),
        workspace: Vec::new(),
        network,
        peer_buffers,
        metadata_tile_tokens: sizes.metadata_tile_tokens,
        route_kernel,
        dispatch_kernel,
        arrange_kernel,
        combine_kernel,
        regimes: ep_regimes,
    };
    plan.workspace = plan.expected_workspace(shape, router_buffers);
    Ok(Some(plan))
}

impl ExpertParallelPlan {
    /// The workspace of one rank as planning makes it from this plan's sizes, `shape` and
    /// `router_buffers` (the single-GPU workspace's router buffers, which each rank holds
    /// too): what a plan read from outside must hold exactly, since the kernels index its
    /// buffers by those sizes.
    pub(crate) fn expected_workspace(
        &self,
        shape: &LayerShape,
        router_buffers: impl IntoIterator<Item = Buffer>,
    ) -> Vec<Buffer> {
        let sizes = Sizes {
            combine_route: self.combine_route,
            ranks: self.ranks,
            experts: shape.experts,
            experts_per_rank: self.experts_per_rank,
            top_k: shape.top_k,
            metadata_tile_tokens: self.metadata_tile_tokens,
            shared_slices: shape.shared_slices,
            slots: self.slots_per_source,
            chunks: self.chunks_per_source,
            segment_rows: self.rows_per_segment,
            rows: self.intermediate_rows,
        };
        workspace(shape, &sizes, self.network.as_ref())
            .into_iter()
            .chain(shared_gate_buffer(shape))
            .chain(rank_fused_counters(shape, &sizes, &self.regimes))
            .chain(unit_tickets(
                self.regimes.iter().flat_map(|r| [&r.gemm1, &r.gemm2]),
            ))
            .chain(router_buffers)
            .collect()
    }
}

/// The sizes the expert-parallel buffers are made of.
struct Sizes {
    combine_route: CombineRoute,
    ranks: u32,
    experts: u32,
    experts_per_rank: u32,
    top_k: u32,
    metadata_tile_tokens: u32,
    /// The shared experts' slices, which every rank runs on its own tokens.
    shared_slices: u32,
    slots: u32,
    chunks: u32,
    segment_rows: u32,
    rows: u64,
}

/// The buffers of one rank (with the network's outboxes, inboxes and flags when ranks
/// live on several nodes).
fn workspace(shape: &LayerShape, sizes: &Sizes, network: Option<&NetworkPlan>) -> Vec<Buffer> {
    let r = u64::from(sizes.ranks);
    let local = u64::from(sizes.experts_per_rank);
    let slots = u64::from(sizes.slots);
    let segments = local * r;
    let max_tokens = u64::from(shape.max_tokens);
    let buffer = |id: BufferId, elems: u64, purpose: &str| Buffer {
        id,
        elem: id.elem(),
        elems,
        purpose: purpose.to_string(),
    };
    let mut buffers = vec![
        buffer(
            BufferId::SendSlots,
            r * max_tokens,
            "per destination, the token of each send slot",
        ),
        buffer(BufferId::SendCounts, r, "tokens sent to each destination"),
        buffer(
            BufferId::RecvX,
            r * slots * u64::from(shape.hidden),
            "received token rows, a segment per source",
        ),
        buffer(
            BufferId::RecvSlot,
            segments * u64::from(sizes.segment_rows),
            "per (local expert, source): each pair's slot",
        ),
        buffer(
            BufferId::RecvPair,
            segments * u64::from(sizes.segment_rows),
            "per (local expert, source): each pair at its origin",
        ),
        buffer(
            BufferId::RecvWeight,
            segments * u64::from(sizes.segment_rows),
            "per (local expert, source): each pair's routing weight",
        ),
        buffer(
            BufferId::RecvCounts,
            r * (local + 1),
            "per source: pairs per local expert, tokens sent",
        ),
        buffer(
            BufferId::MetaFlags,
            r,
            "per source: epoch of the metadata received",
        ),
        buffer(
            BufferId::ChunkFlags,
            r * u64::from(sizes.chunks),
            "per source chunk: epoch it arrived in",
        ),
        buffer(
            BufferId::ChunkPieces,
            r * u64::from(sizes.chunks),
            "per destination chunk: pieces copied in this call",
        ),
        buffer(
            BufferId::ArrangeBlocksDone,
            1,
            "arrange blocks done with this call's receive index",
        ),
        buffer(
            BufferId::MetadataCounters,
            u64::from(shape.experts) + r + 2,
            "metadata rows per expert, slots per destination, blocks done, errors cleared",
        ),
        buffer(
            BufferId::SegmentOffsets,
            (local + u64::from(sizes.shared_slices)) * r + 1,
            "first GEMM row of each (local expert or shared slice, source) run",
        ),
        buffer(
            BufferId::RowOrigins,
            sizes.rows,
            "origin rank of each GEMM row",
        ),
        buffer(
            BufferId::SegmentRows,
            sizes.rows,
            "received row of each GEMM row",
        ),
        buffer(
            BufferId::SegmentPairs,
            sizes.rows,
            "origin pair of each GEMM row",
        ),
        buffer(
            BufferId::SegmentWeights,
            sizes.rows,
            "routing weight of each GEMM row",
        ),
        buffer(
            BufferId::Intermediate,
            sizes.rows * u64::from(shape.ffn),
            "GEMM1 output after the activation",
        ),
        match sizes.combine_route {
            CombineRoute::PairRows => buffer(
                BufferId::CombineSlots,
                shape.max_pairs() * u64::from(shape.hidden),
                "weighted expert outputs of this rank's pairs (and shared slices), stored by the ranks that computed them",
            ),
            // Across nodes only this node's ranks store here; other nodes' come back as
            // node partials through the network.
            CombineRoute::RankPartials => buffer(
                BufferId::CombineSlots,
                max_tokens
                    * network.map_or(r, |n| u64::from(n.gpus_per_node))
                    * u64::from(shape.hidden),
                "per own token and rank of this node, the sum of its weighted expert outputs there, stored by that rank",
            ),
        },
        buffer(
            BufferId::CombineCounters,
            max_tokens,
            "per token: columns of its slots stored so far",
        ),
        buffer(
            BufferId::Credits,
            r,
            "per destination: last epoch whose metadata it consumed",
        ),
        buffer(
            BufferId::PeerTable,
            r * peer_buffers(network.is_some()).len() as u64,
            "every rank's addresses of the buffers peers write",
        ),
        buffer(
            BufferId::ErrorWord,
            4,
            "first kernel-side error of the call: code and details",
        ),
    ];
    if sizes.combine_route == CombineRoute::RankPartials {
        let slots_per_token = u64::from(sizes.top_k + sizes.shared_slices);
        buffers.extend([
            buffer(
                BufferId::PairResults,
                sizes.rows * u64::from(shape.hidden),
                "GEMM2's weighted row of each GEMM row, until the combine sums them per token",
            ),
            buffer(
                BufferId::ReceivedPairRows,
                (r * slots + max_tokens) * slots_per_token,
                "per received token, the GEMM row + 1 of each of its pairs here",
            ),
            buffer(
                BufferId::ReceivedTokens,
                r,
                "per source, tokens received in this call",
            ),
        ]);
    }
    if let Some(network) = network {
        let peers = u64::from(network.peers_per_rank);
        let nodes = u64::from(network.other_nodes());
        let hidden = u64::from(shape.hidden);
        let node_rows = nodes * max_tokens * hidden;
        buffers.extend([
            buffer(
                BufferId::NetSendX,
                node_rows,
                "per other node, the rows of this rank's tokens visiting it, packed per token chunk (staged)",
            ),
            buffer(
                BufferId::NetSendRows,
                nodes * u64::from(sizes.chunks),
                "per other node and token chunk, the rows of it this rank sends there",
            ),
            buffer(
                BufferId::NetSendRow,
                nodes * max_tokens,
                "per other node and token of this rank visiting it, the token's row in its outbox",
            ),
            buffer(
                BufferId::NetSendSlot,
                peers * local * u64::from(sizes.segment_rows),
                "per network peer and local expert of its, each pair's slot (staged)",
            ),
            buffer(
                BufferId::NetSendPair,
                peers * local * u64::from(sizes.segment_rows),
                "per network peer and local expert of its, each pair here (staged)",
            ),
            buffer(
                BufferId::NetSendWeight,
                peers * local * u64::from(sizes.segment_rows),
                "per network peer and local expert of its, each pair's routing weight (staged)",
            ),
            buffer(
                BufferId::NetSendCounts,
                peers * (local + 1),
                "per network peer, pairs per local expert of its, then this rank's tokens (staged)",
            ),
            buffer(
                BufferId::NetSendMask,
                nodes * max_tokens,
                "per other node and token, the ranks there it visits (staged for the rail peer)",
            ),
            buffer(
                BufferId::RecvMask,
                nodes * max_tokens,
                "per rail peer and token of its, the ranks of this node it visits",
            ),
            buffer(
                BufferId::RecvRows,
                nodes * u64::from(sizes.chunks),
                "per rail peer and chunk of its tokens, the rows of it the rail peer sends here",
            ),
            buffer(
                BufferId::NetRecvX,
                node_rows,
                "per rail peer, the rows of its tokens visiting this node, packed per chunk as sent",
            ),
            buffer(
                BufferId::NetRecvRow,
                nodes * max_tokens,
                "per rail peer and token of its visiting this node, the token's row in the inbox",
            ),
            buffer(
                BufferId::NetArrived,
                nodes * u64::from(sizes.chunks),
                "per rail peer and token chunk, the epoch its rows arrived in",
            ),
            buffer(
                BufferId::NetReady,
                network.ready_flags(),
                "per network peer the epoch its metadata was staged in, per other node each chunk's",
            ),
            buffer(
                BufferId::NodePartials,
                nodes * u64::from(network.gpus_per_node) * max_tokens * hidden,
                "per rail peer and rank of this node, that rank's partial row of each of the rail peer's tokens",
            ),
            buffer(
                BufferId::NodePartialsReady,
                u64::from(network.gpus_per_node),
                "per rank of this node, the epoch it stored its partials here in",
            ),
            buffer(
                BufferId::NetReturnX,
                node_rows,
                "per rail peer, this node's partial row of each of its tokens visiting it, at the token's inbox row",
            ),
            buffer(
                BufferId::NetReturnedX,
                node_rows,
                "per other node, its partial row of each of this rank's tokens visiting it, at the token's outbox row",
            ),
            buffer(
                BufferId::NetReturnFlags,
                nodes * u64::from(sizes.chunks),
                "per other node and token chunk, the epoch its results arrived in",
            ),
            buffer(
                BufferId::NetPartialsReady,
                3,
                "combine lanes done storing rank partials and summing node partials, then the epoch of the last",
            ),
        ]);
    }
    buffers
}

/// The counters of the rank's fused decode, where a regime has one.
fn rank_fused_counters(
    shape: &LayerShape,
    sizes: &Sizes,
    regimes: &[ExpertParallelRegime],
) -> Option<Buffer> {
    regimes.iter().any(|r| r.fused_decode.is_some()).then(|| {
        let id = BufferId::RankFusedCounters;
        Buffer {
            id,
            elem: id.elem(),
            elems: fused_decode::rank_counters_len(sizes.experts_per_rank + shape.shared_slices),
            purpose: "the fused decode's GEMM1 tiles stored and read per expert, ticket, blocks done, blocks laid out".to_string(),
        }
    })
}

/// The largest power of two of rows, at most the chunk (itself a power of two or not),
/// dividing it, whose bytes stay within [`PIECE_BYTES`]; at least one row.
fn dispatch_piece(chunk: u32, row_bytes: u64) -> u32 {
    let mut piece = 1;
    while chunk.is_multiple_of(piece * 2) && u64::from(piece * 2) * row_bytes <= PIECE_BYTES {
        piece *= 2;
    }
    piece
}

/// Fewer communication blocks for the longer calls of a regime, on GPUs of their own.
struct CommSplit {
    /// The calls of at least this many tokens (per rank) take `blocks`.
    from_tokens: u32,
    blocks: u32,
    reason: String,
}

/// The fewest communication blocks (from one per destination up to the plan's `default`)
/// whose dispatch of a call (every token to every peer, at
/// [`PLANNED_COMM_BLOCK_BYTES_PER_S`] a block) takes no longer than GEMM1's tiles on local
/// rows, which run first and hide it,
/// for every call of the regime from some token count on (probed at powers of two and the
/// regime's ends); the SMs this frees compute. Their share of GEMM1's tiles: the expected
/// whole row tiles of local rows under uniform routing ([`expected_whole_tiles`]), none
/// while that is below [`MIN_LOCAL_TILES_PER_EXPERT`]. `None` when no count of the regime
/// hides a dispatch on fewer.
fn hiding_comm_blocks(
    layer: &ir::Layer,
    ranks: u32,
    default: u32,
    choice: &RegimeChoice,
    gemm1_seconds: impl Fn(u32) -> f64,
) -> Option<CommSplit> {
    let bm = f64::from(choice.gemm1.tile.m);
    // A call of `tokens`: the bytes it dispatches and the seconds of its local tiles, if any.
    let hiding = |tokens: u32| -> Option<(f64, f64)> {
        let rows_per_source = f64::from(tokens) * f64::from(layer.top_k) / f64::from(layer.experts);
        let all_tiles = (rows_per_source * f64::from(ranks) / bm).ceil();
        let local_tiles = expected_whole_tiles(rows_per_source, bm);
        let bytes = f64::from(tokens) * f64::from(layer.hidden) * 2.0 * f64::from(ranks - 1);
        (local_tiles >= MIN_LOCAL_TILES_PER_EXPERT)
            .then(|| (bytes, gemm1_seconds(tokens) * local_tiles / all_tiles))
    };
    let needed = |tokens: u32| {
        hiding(tokens).map(|(bytes, seconds)| {
            let blocks = (bytes / (seconds * PLANNED_COMM_BLOCK_BYTES_PER_S)).ceil() as u32;
            blocks.max(ranks.min(default))
        })
    };
    let probes: Vec<u32> = std::iter::once(choice.min_tokens)
        .chain(
            std::iter::successors(Some(1u32), |t| t.checked_mul(2))
                .skip_while(|&t| t <= choice.min_tokens)
                .take_while(|&t| t < choice.max_tokens),
        )
        .chain(std::iter::once(choice.max_tokens))
        .collect();
    let (first, blocks) = (0..probes.len()).find_map(|first| {
        let blocks = probes[first..]
            .iter()
            .map(|&t| needed(t))
            .try_fold(0u32, |most, n| n.map(|n| most.max(n)))?;
        (blocks < default).then_some((first, blocks))
    })?;
    let (bytes, seconds) = hiding(choice.max_tokens)?;
    Some(CommSplit {
        from_tokens: probes[first],
        blocks,
        reason: format!(
            "the fewest that move every token to every peer within GEMM1's tiles on local rows, which run first, for every call of {} to {} tokens (at {}: {:.1} MB in {:.0} us)",
            probes[first],
            choice.max_tokens,
            choice.max_tokens,
            bytes / 1e6,
            seconds * 1e6
        ),
    })
}

/// Bytes per second the planner counts on per communication block when it sizes a
/// regime's dispatch to hide behind GEMM1's local tiles ([`hiding_comm_blocks`]): 14 GB/s,
/// fitted on 2026-11-30 to dispatches of 16 and 24 blocks, where the link, not the block,
/// sets the pace. Fewer blocks each move about twice that (25-31 GB/s with 2, 4 and 9
/// blocks on two H200s, 2026-12-01: `simulate::model::COMM_BLOCK_BYTES_PER_S`), so this
/// sizing is conservative; the still fewer blocks the faster rate would give are not
/// measured yet.
const PLANNED_COMM_BLOCK_BYTES_PER_S: f64 = 14.0e9;

/// Below this many whole local row tiles per expert (expected), local tiles are too few
/// to count on for hiding a dispatch.
const MIN_LOCAL_TILES_PER_EXPERT: f64 = 0.25;

/// The expected number of whole row tiles of `bm` rows in a run of rows whose count is
/// Poisson with mean `mean` (one source's rows of one expert under uniform routing):
/// Σ_{j ≥ 1} P(rows ≥ j·bm), each tail from the normal approximation (continuity
/// corrected). Measured 2026-11-30 on DeepSeek-V3 at 4096 tokens per rank (a mean of
/// exactly one 128-row tile): counting the mean's tiles (1) where the expectation is
/// about 0.5 left a third of the dispatch exposed.
fn expected_whole_tiles(mean: f64, bm: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    let deviation = mean.sqrt();
    (1..)
        .map(|j| f64::from(j) * bm)
        .take_while(|&rows| rows <= mean + 8.0 * deviation + bm)
        .map(|rows| 0.5 * erfc((rows - 0.5 - mean) / (deviation * std::f64::consts::SQRT_2)))
        .sum()
}

/// The complementary error function (Abramowitz and Stegun 7.1.26; absolute error below
/// 1.5e-7), enough for a planner's estimate.
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let tail = poly * (-z * z).exp();
    if x >= 0.0 { tail } else { 2.0 - tail }
}

/// Blocks of a compute kernel that fits `per_sm` blocks on an SM. On a rank's own GPU, the
/// grid fills its compute SMs. Virtual ranks share one GPU, whose block scheduler places a
/// block on any SM with room, not on "its rank's" SMs: a grid of more blocks than SMs could
/// spread over every SM and leave no empty one for a peer rank's GEMM block, which needs
/// a whole SM. The same holds across nodes for NCCL's CTAs, which GEMM1 and combine wait
/// on and which need most of an SM's registers. One block per compute SM (`one_per_sm`)
/// keeps the count argument of [`residency`] exact.
fn compute_blocks(one_per_sm: bool, compute_sms: u32, per_sm: u32) -> u32 {
    if one_per_sm {
        compute_sms
    } else {
        compute_sms * per_sm
    }
}

/// How a rank's SMs divide: its share of the device, the blocks it gives to communication
/// and the SMs it keeps for the network; compute gets the rest, and needs at least one.
pub(crate) struct RankSms {
    /// SMs a rank's blocks may fill: the device's, or a virtual rank's share of it.
    pub per_rank: u32,
    /// Communication blocks, and why that many.
    pub comm: (u32, String),
    /// SMs kept for the network: NCCL's CTAs, or the loopback's copies on emulated nodes.
    pub network: u32,
}

impl RankSms {
    pub(crate) fn of(layer: &ir::Layer, target: &Target, ranks: u32, placement: Placement) -> Self {
        let per_rank = match placement {
            Placement::Virtual => target.sm_count / ranks.max(1),
            Placement::Devices => target.sm_count,
        };
        let comm = match layer.schedule.comm_blocks {
            Some(blocks) => (blocks, "the spec's `comm_blocks`".to_string()),
            None => {
                let best = MEASURED_STORE_RATES
                    .iter()
                    .map(|&(_, rate)| rate)
                    .fold(0.0, f64::max);
                let (blocks, rate) = MEASURED_STORE_RATES
                    .iter()
                    .copied()
                    .find(|&(_, rate)| rate >= COMM_RATE_SHARE * best)
                    .unwrap_or(MEASURED_STORE_RATES[0]);
                // Virtual ranks share one device: a quarter of each rank's SMs at most.
                let blocks = match placement {
                    Placement::Virtual => blocks.min((per_rank / 4).max(1)),
                    Placement::Devices => blocks,
                };
                (
                    blocks,
                    format!(
                        "the fewest measured that reach {:.0}% of the best peer-store rate ({rate:.0} of {best:.0} GB/s with {} blocks)",
                        COMM_RATE_SHARE * 100.0,
                        MEASURED_STORE_RATES[0].0
                    ),
                )
            }
        };
        RankSms {
            per_rank,
            comm,
            network: network::network_sms(&layer.topology).0,
        }
    }

    /// SMs left for the rank's compute kernels (0: the rank does not fit).
    pub(crate) fn compute(&self) -> u32 {
        self.per_rank.saturating_sub(self.comm.0 + self.network)
    }

    /// The most communication blocks that leave one SM for compute (0: none does).
    fn most_comm_blocks(&self) -> u32 {
        self.per_rank.saturating_sub(self.network + 1)
    }

    /// Why no SM is left for compute, in words.
    pub(crate) fn shortfall(&self, ranks: u32, placement: Placement) -> String {
        let sms = |count: u32| format!("{count} SM{}", if count == 1 { "" } else { "s" });
        let share = match placement {
            Placement::Virtual => format!(
                "each of {ranks} virtual ranks gets {} of the device",
                sms(self.per_rank)
            ),
            Placement::Devices => format!("a rank has its device's {}", sms(self.per_rank)),
        };
        let network = if self.network > 0 {
            format!(", {} kept for the network", self.network)
        } else {
            String::new()
        };
        format!(
            "{share}: {} for communication{network} and at least 1 for compute do not fit",
            self.comm.0
        )
    }
}

/// Whether `layer`'s ranks fit `target` with their communication blocks (the spec's, else
/// the planner's), the network's SMs and at least one compute SM each; refused as
/// [`PlanError::RanksDoNotFit`] with the most virtual ranks that would.
pub fn ranks_fit(layer: &ir::Layer, target: &Target) -> Result<(), PlanError> {
    match planned_ranks(layer) {
        Some(ranks) => {
            fitting_rank_sms(layer, target, ranks, Placement::of(&layer.topology)).map(drop)
        }
        None => Ok(()),
    }
}

/// How `ranks` ranks of `layer` divide their SMs on `target`, or [`ranks_fit`]'s refusal
/// where no compute SM is left.
fn fitting_rank_sms(
    layer: &ir::Layer,
    target: &Target,
    ranks: u32,
    placement: Placement,
) -> Result<RankSms, PlanError> {
    let sms = RankSms::of(layer, target, ranks, placement);
    if sms.compute() > 0 {
        return Ok(sms);
    }
    Err(PlanError::RanksDoNotFit {
        layer: layer.name.clone(),
        target: target.name.clone(),
        reason: sms.shortfall(ranks, placement),
        // One communication and one compute SM each, beside the network's.
        most_virtual_ranks: target.sm_count / (2 + sms.network),
    })
}

/// The most communication blocks that leave each of `layer`'s ranks an SM for compute on
/// `target` (`None` without expert-parallel kernels; 0 where even one does not).
pub fn most_comm_blocks(layer: &ir::Layer, target: &Target) -> Option<u32> {
    let ranks = planned_ranks(layer)?;
    Some(RankSms::of(layer, target, ranks, Placement::of(&layer.topology)).most_comm_blocks())
}

/// The ranks whose expert-parallel kernels a plan of `layer` would have: none for one rank.
fn planned_ranks(layer: &ir::Layer) -> Option<u32> {
    let ranks = layer.parallel.expert;
    (ranks > 1).then_some(ranks)
}

/// The `comm_blocks` hint's problem on `target`: it leaves a rank no SM for compute where
/// fewer blocks would not (with none that fits, the ranks do not fit whatever the hint:
/// [`plan_expert_parallel`] refuses the layer).
pub(crate) fn comm_blocks_problem(layer: &ir::Layer, target: &Target) -> Option<HintProblem> {
    let blocks = layer.schedule.comm_blocks?;
    let ranks = planned_ranks(layer)?;
    let placement = Placement::of(&layer.topology);
    let sms = RankSms::of(layer, target, ranks, placement);
    let most = sms.most_comm_blocks();
    (blocks > most && most >= 1).then(|| HintProblem {
        key: HintKey::CommBlocks,
        hint: format!("comm_blocks = {blocks}"),
        reason: sms.shortfall(ranks, placement),
    })
}

/// Why no spin-wait can wait for a block that never runs. Per rank, one kernel runs at a
/// time on each stream (the next call's communication waits for this call's compute), so
/// at most `comm_slots` + `compute_sms` blocks of a rank are live at once. Every block fits
/// on an empty SM; with all live blocks of every rank on the device at most the SM count,
/// a waiting block is always placed, whichever kernels spin.
fn residency(
    placement: Placement,
    ranks: u32,
    comm_slots: u32,
    nccl_sms: u32,
    compute_sms: u32,
    sm_count: u32,
) -> String {
    match placement {
        Placement::Virtual if nccl_sms > 0 => format!(
            "{ranks} ranks per device × ({comm_slots} communication + {compute_sms} compute blocks live at most + {nccl_sms} SM kept free for the loopback's copies) = {} of {sm_count} SMs, one block per SM in every waiting grid: a block waiting to start always finds an empty SM",
            ranks * (comm_slots + compute_sms + nccl_sms)
        ),
        Placement::Virtual => format!(
            "{ranks} ranks per device × ({comm_slots} communication + {compute_sms} compute blocks live at most) = {} of {sm_count} SMs, one block per SM in every waiting grid: a block waiting to start always finds an empty SM",
            ranks * (comm_slots + compute_sms)
        ),
        Placement::Devices if nccl_sms > 0 => format!(
            "1 rank per device: {comm_slots} communication + {nccl_sms} NCCL CTAs (its communicator's maxCTAs) + {compute_sms} compute blocks live at most = {} of {sm_count} SMs, one block per SM in every compute grid: NCCL's CTAs, which GEMM1 and combine wait for, always find an empty SM",
            comm_slots + nccl_sms + compute_sms
        ),
        Placement::Devices => format!(
            "1 rank per device: {comm_slots} communication + {compute_sms} compute SMs = {} of {sm_count} SMs; the compute grids fill their SMs, and a communication block fits beside them",
            comm_slots + compute_sms
        ),
    }
}

/// Every rank sends to itself first, then to `r+1, r+2, …` (so that no receiver is hit by
/// every source at once); a destination's GEMM rows take sources in the order they reach it.
fn rotated_orders(ranks: u32) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let send_order = (0..ranks)
        .map(|source| (0..ranks).map(|step| (source + step) % ranks).collect())
        .collect();
    let receive_order = (0..ranks)
        .map(|destination| {
            // Source s reaches this destination at step (destination - s) mod R.
            let mut sources: Vec<u32> = (0..ranks).collect();
            sources.sort_by_key(|&s| (destination + ranks - s) % ranks);
            sources
        })
        .collect();
    (send_order, receive_order)
}

/// Across nodes: a rank stages its rows for network peers first (their path is the
/// longest: staging, then NCCL), then stores into its node's peers, each group rotated
/// from the rank itself. GEMM rows take the rank's own first, then its node's peers (in
/// the order they reach it), then network sources (they arrive last, through NCCL), in
/// the order they reach it too: by where it stands in each source's send order. Rotated
/// from each rank and skipping its own node, node n sends to nodes n+1, n+2, …, so node
/// m hears from node m−1 first and from m+1 last; taking network sources in the
/// destination's own send order instead (m+1 first) put the last to arrive first, and
/// GEMM1's tiles, taken in that order, waited for it (`moeforge simulate` of
/// DeepSeek-V3 at EP = 64: the remote rows' tiles idle until the whole dispatch was in).
fn network_orders(network: &NetworkPlan, ranks: u32) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let rotated_from = |rank: u32, route: Route| -> Vec<u32> {
        (1..ranks)
            .map(|step| (rank + step) % ranks)
            .filter(|&peer| network.route(rank, peer) == route)
            .collect()
    };
    let send_order: Vec<Vec<u32>> = (0..ranks)
        .map(|source| {
            let mut order = vec![source];
            order.extend(rotated_from(source, Route::Network));
            order.extend(rotated_from(source, Route::Link));
            order
        })
        .collect();
    let receive_order = (0..ranks)
        .map(|destination| {
            // A node peer s reaches this destination after its network peers, at its
            // position among s's node peers; a network source at its position among the
            // source's network peers (ties: the nearer in rotation first).
            let rotation = |s: u32| (destination + ranks - s) % ranks;
            let mut node_peers = rotated_from(destination, Route::Link);
            node_peers.sort_by_key(|&s| rotation(s));
            let mut network_sources = rotated_from(destination, Route::Network);
            network_sources.sort_by_key(|&s| {
                let position = send_order[s as usize]
                    .iter()
                    .position(|&d| d == destination)
                    .unwrap_or(ranks as usize);
                (position, rotation(s))
            });
            let mut order = vec![destination];
            order.extend(node_peers);
            order.extend(network_sources);
            order
        })
        .collect();
    (send_order, receive_order)
}

/// Grids of the kernels besides the GEMMs.
struct KernelBlocks {
    /// A block per metadata tile of the regime's largest call, at most one per dispatch
    /// block.
    metadata: u32,
    dispatch: u32,
    /// One block per compute SM: the layout of a call's rows is a short kernel between
    /// the metadata and GEMM1, so it takes every SM the GEMMs will.
    arrange: u32,
    combine: u32,
}

/// The metadata kernel's shared arrays: per expert its tile rows, start and base (the
/// start one longer), per destination its tile slots and base, per pair a slot (4 bytes),
/// a rank and a staged index (2 bytes each), and the last-block flag.
fn metadata_static_smem(sizes: &Sizes) -> u32 {
    let pairs = sizes.metadata_tile_tokens * sizes.top_k;
    static_smem_reserved(4 * (3 * sizes.experts + 1) + 8 * sizes.ranks + 8 * pairs + 4)
}

/// Parameters a kernel takes only in some plans (ranks on several nodes, results as rank
/// partials): `params` where `taken`, else none.
fn params_if(taken: bool, params: Vec<KernelParam>) -> Vec<KernelParam> {
    if taken { params } else { Vec::new() }
}

/// The launches of one call on one rank: metadata and dispatch on the communication
/// stream; the shared expert gate (where it is gated), arrange, the GEMMs (with the rank's
/// expert biases where the layer has them) and combine on the compute stream.
#[allow(clippy::too_many_arguments)]
fn launch_table(
    kernels: &[String; 4],
    shared_gate: Option<&str>,
    gemm_kernels: [&String; 2],
    gemms: [&GemmPlan; 2],
    sizes: &Sizes,
    expert_bias: bool,
    over_network: bool,
    blocks: &KernelBlocks,
) -> Vec<Launch> {
    use BufferId::*;
    use LaunchArg::*;
    let (read, write, shared) = (KernelParam::read, KernelParam::write, KernelParam::shared);
    let [route, dispatch, arrange, combine] = kernels;
    let partials = sizes.combine_route == CombineRoute::RankPartials;
    let bias = |arg| params_if(expert_bias, vec![read(arg)]);
    let launch =
        |kernel: &String, grid: u32, threads: u32, stream, static_smem, smem, params| Launch {
            kernel: kernel.clone(),
            grid: Grid::Fixed(grid),
            block_threads: threads,
            smem_bytes: smem,
            static_smem_bytes: static_smem,
            params,
            stream,
            early_start: false,
        };
    let [g1, g2] = gemms;
    let mut launches = vec![
        launch(
            route,
            blocks.metadata,
            META_THREADS,
            StreamRole::Comm,
            metadata_static_smem(sizes),
            0,
            vec![
                read(TopkIds),
                read(TopkWeights),
                read(Tokens),
                read(Rank),
                read(Epoch),
                write(Workspace(SendSlots)),
                write(Workspace(SendCounts)),
                read(Workspace(PeerTable)),
                write(Workspace(ErrorWord)),
                shared(Workspace(Credits)),
                write(Workspace(MetadataCounters)),
            ]
            .into_iter()
            .chain(params_if(
                over_network,
                vec![
                    write(Workspace(NetSendSlot)),
                    write(Workspace(NetSendPair)),
                    write(Workspace(NetSendWeight)),
                    write(Workspace(NetSendCounts)),
                    write(Workspace(NetSendMask)),
                    write(Workspace(NetSendRows)),
                    write(Workspace(NetReady)),
                ],
            ))
            .collect(),
        ),
        launch(
            dispatch,
            blocks.dispatch,
            COMM_THREADS,
            StreamRole::Comm,
            0,
            0,
            vec![
                read(X),
                read(Rank),
                read(Epoch),
                read(Workspace(SendSlots)),
                read(Workspace(SendCounts)),
                write(Workspace(ChunkPieces)),
                read(Workspace(PeerTable)),
            ]
            .into_iter()
            .chain(params_if(
                over_network,
                vec![
                    read(Tokens),
                    read(Workspace(NetSendMask)),
                    write(Workspace(NetSendX)),
                    write(Workspace(NetSendRow)),
                    write(Workspace(NetReady)),
                    shared(Workspace(MetaFlags)),
                    shared(Workspace(RecvCounts)),
                    shared(Workspace(RecvMask)),
                    shared(Workspace(NetRecvX)),
                    write(Workspace(NetRecvRow)),
                    shared(Workspace(NetArrived)),
                    write(Workspace(ErrorWord)),
                ],
            ))
            .collect(),
        ),
    ];
    // The shared expert gate's weights of this rank's tokens, ready for arrange, which
    // gives them to the shared slices' rows.
    launches
        .extend(shared_gate.map(|kernel| shared_gate_launch(kernel, Grid::Fixed(blocks.arrange))));
    launches.extend([
        launch(
            arrange,
            blocks.arrange,
            META_THREADS,
            StreamRole::Compute,
            static_smem_reserved(
                4 * ((sizes.experts_per_rank + sizes.shared_slices) * sizes.ranks + 1) + 4 + 4,
            ),
            0,
            vec![
                read(Tokens),
                read(Rank),
                read(Epoch),
                shared(Workspace(RecvSlot)),
                shared(Workspace(RecvPair)),
                shared(Workspace(RecvWeight)),
                shared(Workspace(RecvCounts)),
                shared(Workspace(MetaFlags)),
                read(Workspace(SendSlots)),
                write(Workspace(SegmentOffsets)),
                write(Workspace(SegmentRows)),
                write(Workspace(SegmentPairs)),
                write(Workspace(SegmentWeights)),
                write(Workspace(RowOrigins)),
                write(Workspace(ArrangeBlocksDone)),
                write(Workspace(ErrorWord)),
                read(Workspace(PeerTable)),
            ]
            .into_iter()
            .chain(params_if(
                partials,
                vec![
                    write(Workspace(ReceivedPairRows)),
                    write(Workspace(ReceivedTokens)),
                ],
            ))
            .chain(params_if(
                shared_gate.is_some(),
                vec![read(Workspace(SharedGate))],
            ))
            .collect(),
        ),
        launch(
            gemm_kernels[0],
            g1.grid_blocks,
            g1.threads(),
            StreamRole::Compute,
            g1.smem.static_bytes,
            g1.smem_bytes,
            vec![shared(Workspace(RecvX)), read(X), weight_param(g1, true)]
                .into_iter()
                .chain(bias(W1Bias))
                .chain([
                    read(Workspace(SegmentOffsets)),
                    read(Workspace(SegmentRows)),
                    shared(Workspace(ChunkFlags)),
                    read(Rank),
                    read(Epoch),
                    write(Workspace(ErrorWord)),
                    write(Workspace(Intermediate)),
                ])
                .chain(unit_ticket_params(g1))
                .collect(),
        ),
        launch(
            gemm_kernels[1],
            g2.grid_blocks,
            g2.threads(),
            StreamRole::Compute,
            g2.smem.static_bytes,
            g2.smem_bytes,
            [read(Workspace(Intermediate)), weight_param(g2, false)]
                .into_iter()
                .chain(bias(W2Bias))
                .chain(if partials {
                    vec![
                        read(Workspace(SegmentOffsets)),
                        read(Workspace(SegmentPairs)),
                        read(Workspace(SegmentWeights)),
                        read(Rank),
                        write(Workspace(ErrorWord)),
                        write(Workspace(PairResults)),
                    ]
                } else {
                    vec![
                        read(Workspace(SegmentOffsets)),
                        read(Workspace(SegmentPairs)),
                        read(Workspace(SegmentWeights)),
                        read(Workspace(RowOrigins)),
                        read(Workspace(PeerTable)),
                        read(Rank),
                        write(Workspace(ErrorWord)),
                    ]
                })
                .chain(unit_ticket_params(g2))
                .collect(),
        ),
        launch(
            combine,
            blocks.combine,
            COMBINE_THREADS * COMBINE_LANES,
            StreamRole::Compute,
            // Each lane's pending releases' source, token and received row.
            if partials {
                static_smem_reserved(3 * 4 * PARTIALS_PER_RELEASE * COMBINE_LANES)
            } else {
                0
            },
            0,
            vec![
                read(TopkIds),
                read(Tokens),
                read(Rank),
                read(Epoch),
                shared(Workspace(CombineSlots)),
                write(Workspace(CombineCounters)),
                write(Workspace(ErrorWord)),
                write(Y),
            ]
            .into_iter()
            .chain(params_if(
                over_network,
                vec![
                    write(Workspace(NetReturnX)),
                    shared(Workspace(NetRecvRow)),
                    shared(Workspace(NetSendRow)),
                    shared(Workspace(NetReturnedX)),
                    shared(Workspace(NetReturnFlags)),
                    write(Workspace(NetPartialsReady)),
                    shared(Workspace(RecvMask)),
                    shared(Workspace(NodePartials)),
                    shared(Workspace(NodePartialsReady)),
                ],
            ))
            .chain(params_if(
                partials,
                vec![
                    read(Workspace(PairResults)),
                    write(Workspace(ReceivedPairRows)),
                    read(Workspace(ReceivedTokens)),
                    read(Workspace(SegmentPairs)),
                    read(Workspace(PeerTable)),
                ],
            ))
            .collect(),
        ),
    ]);
    launches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erfc_matches_known_values() {
        for (x, want) in [
            (0.0, 1.0),
            (1.0, 0.157_299_2),
            (-1.0, 1.842_700_8),
            (3.0, 2.209e-5),
        ] {
            assert!(
                (erfc(x) - want).abs() < 2e-7,
                "erfc({x}) = {} want {want}",
                erfc(x)
            );
        }
    }

    #[test]
    fn whole_tiles_of_poisson_rows() {
        // A mean of one tile: about half the runs reach it.
        let one = expected_whole_tiles(128.0, 128.0);
        assert!((0.45..0.56).contains(&one), "{one}");
        // Far above: about mean / bm less a half tile.
        let many = expected_whole_tiles(4096.0, 128.0);
        assert!((31.3..31.7).contains(&many), "{many}");
        // Far below: none.
        assert!(expected_whole_tiles(10.0, 128.0) < 1e-9);
        assert_eq!(expected_whole_tiles(0.0, 128.0), 0.0);
    }
}
