//! The router's plan: how a layer whose spec has a `router { }` section chooses each token's
//! experts and weights from `x` on the GPU. Per single-GPU regime, one of two shapes:
//!
//! - **fused** (a regime whose largest call has at most [`ROUTER_FUSED_MAX_PAIRS`] (token,
//!   k) pairs, and whose later phases' scratch fits a block: [`fused`]): one launch,
//!   `<symbol>_<regime>_router` (where the regime has a gate per token range,
//!   `fused_gates`, the call's `<symbol>_<regime>_router_<m>x<n>`), in place of the
//!   regime's routing-metadata launch, so that a self-routed call runs as many kernels as
//!   a caller-routed one. Its phases, each run by the block the one before leaves last:
//!   1. **gate**, every block: the logits, or its split's partial sums of them (below);
//!   2. **select**, by the block of each token tile that finishes its gate blocks last (a
//!      counter per token tile in `router_tiles_done`): it sums the partial logits in
//!      split order, then one warp per token;
//!   3. **routing metadata**, by the block whose token tile is selected last (a counter
//!      over the token tiles; with one token tile, the selecting block itself): the route
//!      kernel's body on `routed_ids`.
//!
//!   The last block to arrive resets its counter, so the next call starts from zero
//!   without a memset. No block waits for another, so nothing can deadlock whatever the
//!   residency.
//! - **split** (larger calls): the gate for the call's token count (a regime has one per
//!   token range, each with its own tile, `split_gates`:
//!   `<symbol>_<regime>_router_gate_<m>x<n>`, `_wgmma` after it on the warp-specialised
//!   engine) and the select (`<symbol>_router_select`,
//!   one warp per token, [`SELECT_WARPS`] tokens per block over the whole GPU) as two
//!   launches before the whole table; or, where the gate runs in thread-block clusters
//!   ([`GateEngine::Cluster`], `<symbol>_<regime>_router_gate_<m>x<n>_cluster<c>`), the
//!   gate alone, whose clusters select their tokens. A fused router's tails run on
//!   one block per token tile and its routing on one gate block (160 to 256 threads):
//!   measured on an H200 (2026-11-30), at 16384 tokens they cost Qwen3-30B-A3B 170 µs
//!   (185 in a second run) and DeepSeek-V3 146 µs more than the split launches, while at
//!   1 token the fused router saved 3-9 µs.
//!
//! The **gate**: the logits `x · W_gateᵀ` [T, E] in f32, a tiled `mma.sync` GEMM. A block
//! takes a tile of `tile_tokens` tokens by `tile_experts` experts; blocks are numbered
//! token-tile major, the expert tiles of one token tile adjacent, so that the x rows they
//! share are read from HBM once and from L2 by the others. Experts past E (when
//! `tile_experts` does not divide E) and tokens past T are zero-filled on load and never
//! stored. A small tile's block holds `warps_k` groups of warps that split the reduction
//! (each its own ring of stages), summed in group order at the end: at a few tokens the
//! grid has few blocks, and without the split each would have one warp's few loads in
//! flight over all of H. A call whose tiles leave SMs without a block also splits each
//! tile's reduction over blocks ([`GatePlan::k_split`], [`Grid::SplitTokenTiles`]): at one
//! token DeepSeek-V3's 16 expert tiles run as 112 blocks, each loading its share of W_gate
//! before it waits; at 4096 tokens its prefill gate's 64 tiles (128 tokens by 128 experts)
//! run as 128 blocks, where they took 113 µs on 64 (one H200, 2026-12-01). A fused
//! router's select sums the split's partial logits; a split router's gate has the last
//! block of each tile sum them (a counter per tile in `router_tiles_done`), or, in
//! clusters, the cluster's blocks sum them through distributed shared memory, each for
//! its share of the tile's tokens, which it then selects. The **select** applies the rule ([`ir::Router`]: bias, scores, correction, group limit,
//! top-k, weights) and writes `routed_ids` and `routed_weights`, which the table then reads
//! where a caller-routed call passes `topk_ids` and `topk_weights`. On the expert-parallel
//! path each rank runs the same launches on its own tokens, and the expert-parallel kernels
//! read its choices ([`super::ep::ExpertParallelPlan::routes_itself`]).

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use super::launch::{Grid, KSplit, KernelParam, Launch, LaunchArg, StreamRole};
use super::{BufferId, SMEM_ROW_BYTES, Target, static_smem_reserved};
use crate::ir;

/// Added to the sum a normalised weight is divided by, as DeepSeek-V3's reference does
/// (a no-op for any sum above 1e-12).
pub const NORMALIZE_EPSILON: f32 = 1e-20;
/// Pipeline stages of the gate GEMM: enough to keep two k-tiles in flight while one is
/// multiplied; 3 stages of the largest tile take 96 KiB, within every target.
pub const GATE_STAGES: u32 = 3;
/// Most stages of a fused router's gate (a few tokens' calls), which takes more where they
/// fit: its few blocks read all of W_gate, each group of warps a dozen k-tiles in a row, and
/// two in flight leave each group waiting on the memory's latency at every other step.
pub const FUSED_GATE_MAX_STAGES: u32 = 8;
/// Gate tiles the planner considers, as (tokens, experts): rows of 16 to 128 tokens (an
/// mma is 16 rows), 16 to 128 experts (an `ldmatrix.x4` of B covers 16).
const GATE_TILES_TOKENS: [u32; 3] = [128, 64, 16];
const GATE_TILES_EXPERTS: [u32; 4] = [128, 64, 32, 16];
/// A warp's sub-tile: at most 32 tokens by 64 experts (64 accumulators per thread, as the
/// expert GEMMs allow).
const GATE_WARP_TOKENS: u32 = 32;
const GATE_WARP_EXPERTS: u32 = 64;
/// Warps of a gate block once its tile's warps are repeated to split the reduction.
const GATE_BLOCK_WARPS: u32 = 8;
/// Fewest k-tiles a group of warps of a split reduction takes.
const GATE_MIN_K_TILES_PER_GROUP: u32 = 4;
/// Most (token, k) pairs of a regime's largest call for its router to be fused: the fused
/// router's routing runs on one gate block (160 to 256 threads: 16 to 26 pairs each at
/// most here), and its select on one block per token tile (see the module documentation).
pub const ROUTER_FUSED_MAX_PAIRS: u64 = 4096;
/// Tokens one block of the split router's select kernel routes, one warp each.
pub const SELECT_WARPS: u32 = 4;
/// A warp-specialised gate: its producer warpgroup, the alignment of its ring (the
/// 128-byte swizzle's period; dynamic shared memory is only 16-byte aligned, so its layout
/// starts with this much slack), the most stages it keeps, the experts one wgmma covers,
/// and its tiles' token counts (a consumer warpgroup per 64).
pub const GATE_PRODUCER_THREADS: u32 = 128;
pub const GATE_RING_ALIGN: u32 = 1024;
const GATE_WS_MAX_STAGES: u32 = 8;
const GATE_WS_MAX_EXPERTS: u32 = 256;
const GATE_WS_TILES_TOKENS: [u32; 2] = [128, 64];

/// The router of a layer: its rule and, per single-GPU regime, its launches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterPlan {
    pub rule: ir::Router,
    /// Per regime of [`super::Plan::regimes`], in the same order.
    pub regimes: Vec<RouterRegime>,
}

/// The router's launches for one token-count regime.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterRegime {
    /// The gates, each for its own calls, in order of token count, covering the regime
    /// (a fused router's: `fused_gates`; a split router's: `split_gates`).
    pub gates: Vec<GatePlan>,
    /// Fused (one launch: gate, select, routing metadata; in place of the table's route
    /// launch) or split (gate, then select; before the whole table): see the module
    /// documentation.
    pub fused: bool,
    /// Each gate's launch (a fused router's: gate, select and routing metadata), in the
    /// order of `gates`; a split router's select after them.
    pub launches: Vec<Launch>,
    /// Whether the launch behind this router in a self-routed call (GEMM1, or the regime's
    /// fused decode where it runs) may start early beside it, as soon as the router's
    /// blocks have waited for the kernel ahead; false where the router is fused, GEMM1 is
    /// next in the table and the target measured GEMM1 faster started as the router's
    /// blocks finish ([`Target::early_gemm1_behind_fused_router`]): the router's blocks then
    /// never signal `griddepcontrol.launch_dependents`, so the launch behind, still
    /// launched to start early, starts as they exit.
    #[serde(default = "super::target::starts_early_by_default")]
    pub gemm1_starts_early: bool,
}

/// Whether GEMM1 starts early behind a router regime on `target`: not where the router is
/// fused, GEMM1 runs right behind it (no sort of x's rows between them) and the target
/// measured GEMM1 faster started as the router's blocks finish.
pub(super) fn gemm1_starts_early_behind(fused: bool, gemm1_next: bool, target: &Target) -> bool {
    !(fused && gemm1_next) || target.early_gemm1_behind_fused_router
}

/// What the router's planning reads of one regime of the table.
pub(super) struct TableRegime {
    pub name: String,
    pub max_tokens: u32,
    /// Whether GEMM1 is the table's next launch after a fused router (x's rows are not
    /// sorted between them).
    pub gemm1_next: bool,
}

impl RouterRegime {
    /// The launches a call of `tokens` tokens runs, in stream order: the fused router of
    /// its token count, or the split router's gate for it, then the select (unless that
    /// gate selects itself).
    pub fn launches_for(&self, tokens: u32) -> impl Iterator<Item = usize> {
        let gate = self
            .gates
            .iter()
            .position(|gate| tokens <= gate.max_tokens)
            .unwrap_or(self.gates.len() - 1);
        let select =
            (!self.fused && !self.gates[gate].engine.selects()).then_some(self.gates.len());
        std::iter::once(gate).chain(select)
    }

    /// The index in `launches` of a split router's select launch; none where the router
    /// is fused or every gate selects itself.
    pub fn select_launch(&self) -> Option<usize> {
        (!self.fused && self.gates.iter().any(|gate| !gate.engine.selects()))
            .then_some(self.gates.len())
    }
}

/// Which multiply a gate runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateEngine {
    /// `mma.sync` warps, each group of them loading its own ring of stages with
    /// `cp.async`, a block-wide barrier per k-tile: any target, and a fused router's gate.
    #[default]
    MmaSync,
    /// wgmma, warp-specialised as the expert GEMMs' engine (sm_90a): a producer warpgroup
    /// loads each stage (the tile's x rows with `cp.async`, its W_gate rows as one TMA
    /// box) into a ring guarded by mbarriers; a consumer warpgroup per 64 tokens multiplies
    /// them by all the tile's experts, one wgmma per 16 columns of the reduction. A split
    /// router's gates for large calls on such a target (`split_gate_tile`): the mma.sync
    /// gate ran Qwen3-30B-A3B's 16384-token gate at 200 TFLOP/s (44.6 µs, one H200,
    /// 2026-12-02), latency-bound on its three stages and `ldmatrix` traffic.
    WarpSpecialized,
    /// `mma.sync` blocks in thread-block clusters of `blocks` (sm_90 and later): a cluster
    /// takes one token tile across every expert, each block of it one slice of the
    /// reduction (`H / 64 / blocks` k-tiles); the blocks' partial logits meet in
    /// distributed shared memory, summed in block order, and each block then selects its
    /// share of the tile's tokens (no select launch, no partial logits through global
    /// memory, no counter). A split router's gate for calls whose clusters all run at once
    /// and whose blocks' shares are short ([`cluster_gate_choice`]): there the mma.sync
    /// gate (its reduction split over blocks, the parts summed by the tile's last block
    /// alone) and the select kernel took 10.4-13.3 µs at 300-1024 tokens against a floor of
    /// 1-2 (Qwen3-30B-A3B and Mixtral-8x7B, one H200, 2026-12-03).
    Cluster { blocks: u32 },
}

impl GateEngine {
    /// The blocks of a cluster gate's cluster; 1 for the other engines.
    pub fn cluster_blocks(self) -> u32 {
        match self {
            GateEngine::Cluster { blocks } => blocks,
            GateEngine::MmaSync | GateEngine::WarpSpecialized => 1,
        }
    }

    /// Whether the gate's blocks select their tokens themselves (no select launch).
    pub fn selects(self) -> bool {
        matches!(self, GateEngine::Cluster { .. })
    }
}

/// How the gate GEMM is tiled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GatePlan {
    /// The multiply ([`GateEngine`]); it decides the warps, stages and shared memory below.
    #[serde(default)]
    pub engine: GateEngine,
    /// The calls this gate serves: `min_tokens..=max_tokens` tokens.
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// Tokens per tile (rows of x).
    pub tile_tokens: u32,
    /// Experts per tile (rows of W_gate), a multiple of 16.
    pub tile_experts: u32,
    /// Tiles across the experts: `ceil(E / tile_experts)`.
    pub expert_tiles: u32,
    pub warps_m: u32,
    pub warps_n: u32,
    /// Groups of `warps_m × warps_n` warps splitting the reduction: group g takes k-tiles
    /// g, g + warps_k, ...; it divides H / 64. Warp-specialised: `warps_m` is the consumer
    /// warps (four per 64 tokens), `warps_n` and `warps_k` are 1.
    #[serde(default = "one")]
    pub warps_k: u32,
    /// The reduction split over blocks as well ([`gate_k_split`]): a group's
    /// `H / 64 / warps_k` k-tiles over as many blocks as keep the grid within one block
    /// per SM (a call with a block per SM already does not split).
    pub k_split: KSplit,
    pub stages: u32,
    /// Dynamic shared memory: the gate's rings, `warps_k · stages · (tile_tokens +
    /// tile_experts) · 128` bytes, or in a fused router the larger of that and the later
    /// phases' scratch ([`router_scratch_bytes`]), which reuses them. Warp-specialised:
    /// [`GatePlan::warp_specialized_smem`].
    ///
    /// A split tile's blocks write partial logits, one [T, E] slice per block of the split
    /// ([`RouterPlan::logits_floats`]), summed in split order into the first slice (by a
    /// fused router's select, or a split router's last block of the tile). A cluster gate:
    /// [`cluster_gate_layout`].
    pub smem_bytes: u32,
    /// The roofline floor of gate and select at the gate's largest token count.
    pub floor: RouterFloor,
}

fn one() -> u32 {
    1
}

impl GatePlan {
    pub fn threads(&self) -> u32 {
        self.producer_threads() + 32 * self.warps_m * self.warps_n * self.warps_k
    }

    /// The threads that load stages for the others (a warp-specialised gate's producer
    /// warpgroup); none in an mma.sync gate.
    pub fn producer_threads(&self) -> u32 {
        match self.engine {
            GateEngine::MmaSync | GateEngine::Cluster { .. } => 0,
            GateEngine::WarpSpecialized => GATE_PRODUCER_THREADS,
        }
    }

    /// A warp-specialised gate's shared memory: slack to align the ring to the 128-byte
    /// swizzle's 1024-byte period, `stages` stages of the tile's x rows then its W_gate
    /// rows (128 bytes each), then a "full" and an "empty" mbarrier per stage.
    pub fn warp_specialized_smem(tile_tokens: u32, tile_experts: u32, stages: u32) -> u32 {
        GATE_RING_ALIGN + stages * (tile_tokens + tile_experts) * SMEM_ROW_BYTES + 16 * stages
    }

    /// The shared memory of a tile: per group of warps, `stages` rings of x rows then
    /// W_gate rows, 128 bytes each.
    pub fn smem_for(tile_tokens: u32, tile_experts: u32, stages: u32, warps_k: u32) -> u32 {
        warps_k * stages * (tile_tokens + tile_experts) * SMEM_ROW_BYTES
    }

    /// A gate block's shared memory: its rings, or the fused router's scratch when
    /// larger.
    pub fn smem_bytes_for(
        tile_tokens: u32,
        tile_experts: u32,
        stages: u32,
        warps_k: u32,
        fused_scratch: Option<u32>,
    ) -> u32 {
        Self::smem_for(tile_tokens, tile_experts, stages, warps_k).max(fused_scratch.unwrap_or(0))
    }

    /// Token tiles of a call of `tokens` tokens.
    pub fn token_tiles(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.tile_tokens)
    }

    /// The blocks one gate tile's reduction is split over in a call of `tokens` tokens (a
    /// cluster gate's: its cluster, at every call).
    pub fn splits(&self, tokens: u32) -> u32 {
        self.k_split
            .splits(self.token_tiles(tokens.max(1)) * self.expert_tiles)
    }

    /// The [T, E] slices of partial logits a call of `tokens` tokens writes to
    /// `router_logits`: one per block of a tile's split, summed into the first; a cluster
    /// gate sums in distributed shared memory and writes the logits once.
    pub fn logits_slices(&self, tokens: u32) -> u32 {
        if self.engine.selects() {
            1
        } else {
            self.splits(tokens)
        }
    }

    /// For each token-tile count among this gate's calls, its largest call: a call of more
    /// token tiles splits less, so these are the calls whose buffers to size.
    fn largest_calls(&self) -> impl Iterator<Item = u32> + '_ {
        let last = self.max_tokens;
        (self.token_tiles(self.min_tokens.max(1))..=self.token_tiles(last))
            .map(move |tiles| (tiles * self.tile_tokens).min(last))
    }
}

/// Shared memory the select and routing phases reuse from the gate's rings, in bytes:
/// the token tile's logits (f32 × `tile_tokens` × E, summed over the split), the rule's
/// bias (f32 × E, with one) and, with a group limit ranked in shared memory
/// ([`groups_in_shared_memory`]), each warp's selection values (f32 × E), from which a
/// lane sums its group's best two; the routing phase's per-expert counts
/// and offsets (i32 × (2 · GEMM experts + 1)).
pub fn router_scratch_bytes(
    rule: &ir::Router,
    experts: u32,
    gemm_experts: u32,
    warps: u32,
    tile_tokens: u32,
) -> u32 {
    (4 * tile_tokens * experts + bias_bytes(rule, experts) + selection_bytes(rule, experts, warps))
        .max(4 * (2 * gemm_experts + 1))
}

/// The rule's bias in shared memory (f32 × E), with one.
fn bias_bytes(rule: &ir::Router, experts: u32) -> u32 {
    if rule.bias == ir::RouterBias::None {
        0
    } else {
        4 * experts
    }
}

/// A gate's split of its reduction over blocks: each group's `k_tiles / warps_k` k-tiles,
/// over as many blocks as keep the grid within one per SM. A few tokens' grid has one block
/// per expert tile, each reading its W_gate rows over all of H: one SM's loads set its pace
/// (and in a fused router the W_gate rows loaded before the wait cover only the first
/// stages). A larger call whose tiles still leave SMs idle is bound the same way: the
/// gate's time is its waves of blocks times one block's, and one 128 × 128 tile of
/// DeepSeek-V3 takes 112 µs (one H200, 2026-12-01: 113 µs at 4096 tokens on 64 blocks, 207
/// at 16384 on 256).
pub fn gate_k_split(hidden: u32, warps_k: u32, sm_count: u32) -> KSplit {
    KSplit {
        steps: gate_k_tiles(hidden) / warps_k,
        most_blocks: sm_count,
    }
}

/// The groups of warps that split the reduction over `hidden` of a gate tile of
/// `tile_tokens × tile_experts`: as many as fill a block of `GATE_BLOCK_WARPS` warps,
/// each taking at least `GATE_MIN_K_TILES_PER_GROUP` k-tiles, their rings within
/// `smem_per_block`, and a divisor of the k-tiles (every group runs the same number of
/// steps, between the same block-wide barriers).
pub fn gate_warps_k(tile_tokens: u32, tile_experts: u32, hidden: u32, smem_per_block: u32) -> u32 {
    let (warps_m, warps_n) = gate_warps(tile_tokens, tile_experts);
    let k_tiles = gate_k_tiles(hidden);
    let most = (GATE_BLOCK_WARPS / (warps_m * warps_n)).min(k_tiles / GATE_MIN_K_TILES_PER_GROUP);
    (1..=most.max(1))
        .rev()
        .find(|&g| {
            k_tiles.is_multiple_of(g)
                && GatePlan::smem_for(tile_tokens, tile_experts, GATE_STAGES, g) <= smem_per_block
        })
        .unwrap_or(1)
}

/// The gate's k-tiles: 64-column slices of the reduction over `hidden`.
fn gate_k_tiles(hidden: u32) -> u32 {
    hidden / (SMEM_ROW_BYTES / 2)
}

/// The stages of a gate: [`GATE_STAGES`] for a split router's; for a fused router's, one
/// more than a group's k-tiles (all in flight), at most [`FUSED_GATE_MAX_STAGES`], at least
/// `GATE_STAGES`, and as many of those as fit `smem_per_block` ([`gate_warps_k`] chose the
/// groups so that `GATE_STAGES` fit).
pub fn gate_stages(
    fused: bool,
    tile_tokens: u32,
    tile_experts: u32,
    hidden: u32,
    warps_k: u32,
    smem_per_block: u32,
) -> u32 {
    if !fused {
        return GATE_STAGES;
    }
    let group_k_tiles = gate_k_tiles(hidden) / warps_k;
    (GATE_STAGES..=(group_k_tiles + 1).clamp(GATE_STAGES, FUSED_GATE_MAX_STAGES))
        .rev()
        .find(|&s| GatePlan::smem_for(tile_tokens, tile_experts, s, warps_k) <= smem_per_block)
        .unwrap_or(GATE_STAGES)
}

/// What the router costs at least, from the target's ceilings: its FLOPs at its gate
/// engine's rate and the bytes it must move at HBM bandwidth (x read, W_gate read once, the
/// logits written and read back, ids and weights written).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouterFloor {
    pub tokens: u32,
    pub flops: f64,
    pub bytes: f64,
    pub seconds: f64,
}

/// The router's plan for `layer` (`None` without a `router { }` section): its launches for
/// each regime of the table; the shared slices make `gemm_experts` GEMM experts, whose
/// counts a fused router lays out.
pub(super) fn plan_router(
    layer: &ir::Layer,
    target: &Target,
    symbol: &str,
    gemm_experts: u32,
    regimes: &[TableRegime],
) -> Option<RouterPlan> {
    let rule = layer.router?;
    let mut min_tokens = 0;
    let regimes = regimes
        .iter()
        .map(|table| {
            let (name, max_tokens) = (&table.name, table.max_tokens);
            let calls = min_tokens..=max_tokens.max(min_tokens);
            min_tokens = max_tokens + 1;
            let (gates, fused) = gate_plan(layer, target, &rule, gemm_experts, calls);
            let launches = router_launches(
                &rule,
                layer.experts,
                &gates,
                fused,
                symbol,
                name,
                target.has_programmatic_launch(),
            );
            RouterRegime {
                gemm1_starts_early: gemm1_starts_early_behind(fused, table.gemm1_next, target),
                gates,
                fused,
                launches,
            }
        })
        .collect();
    Some(RouterPlan { rule, regimes })
}

impl RouterPlan {
    /// Counters of `router_tiles_done` the calls of every regime need: a fused regime's
    /// largest call, the token tiles selected and then one per token tile; a split
    /// regime's calls that split their gate, one per gate tile (the same counters: one
    /// call runs one gate, and every counter is zero between calls).
    pub fn tiles_done_len(&self) -> u32 {
        self.regimes
            .iter()
            .flat_map(|regime| regime.gates.iter().map(move |gate| (regime.fused, gate)))
            .map(|(fused, gate)| {
                if fused {
                    1 + gate.token_tiles(gate.max_tokens)
                } else if gate.engine.selects() {
                    0
                } else {
                    gate.largest_calls()
                        .filter(|&tokens| gate.splits(tokens) > 1)
                        .map(|tokens| gate.token_tiles(tokens) * gate.expert_tiles)
                        .max()
                        .unwrap_or(0)
                }
            })
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Floats of `router_logits` the calls of every regime up to `max_tokens` need:
    /// [T, E], or a split gate's partial logits, one [T, E] slice per block of its split
    /// (the largest over each gate's calls: a call of more token tiles splits less, so
    /// each token-tile count's largest call is the one to check).
    pub fn logits_floats(&self, experts: u32, max_tokens: u32) -> u64 {
        let split_slices = self
            .regimes
            .iter()
            .flat_map(|regime| &regime.gates)
            .flat_map(|gate| {
                gate.largest_calls()
                    .map(|tokens| u64::from(tokens) * u64::from(gate.logits_slices(tokens)))
            })
            .max()
            .unwrap_or(0);
        split_slices.max(u64::from(max_tokens)) * u64::from(experts)
    }
}

/// The warps of a gate tile: sub-tiles of at most 32 tokens by 64 experts.
pub fn gate_warps(tile_tokens: u32, tile_experts: u32) -> (u32, u32) {
    (
        tile_tokens.div_ceil(GATE_WARP_TOKENS),
        tile_experts.div_ceil(GATE_WARP_EXPERTS),
    )
}

/// Blocks of the gate GEMM for `tokens` tokens.
pub fn gate_blocks(tile_tokens: u32, tile_experts: u32, experts: u32, tokens: u32) -> u32 {
    tokens.div_ceil(tile_tokens) * experts.div_ceil(tile_experts)
}

/// The gate tile for calls of `tokens` tokens: among the tiles whose grid gives at least
/// `fill` blocks at that count, the one that re-reads least from L2 (a call reads
/// `T·E·H·2·(1/tile_tokens + 1/tile_experts)` bytes into shared memory; the larger tile on
/// a tie); when none does (few tokens), the tile with the most blocks, so that W_gate, all
/// that such a call reads, is spread over as many SMs as possible. Expert widths above E
/// (rounded up to 16) are skipped but for the narrowest that covers E.
fn gate_tile(experts: u32, tokens: u32, fill: u32) -> (u32, u32) {
    let widths = gate_tile_widths(experts);
    let candidates: Vec<(u32, u32)> = GATE_TILES_TOKENS
        .into_iter()
        .flat_map(|m| widths.iter().map(move |&n| (m, n)))
        .collect();
    let tokens = tokens.max(1);
    let blocks = |&(m, n): &(u32, u32)| gate_blocks(m, n, experts, tokens);
    // Bytes re-read per FLOP, as an exact fraction: (m + n) / (m · n).
    let rereads = |&(m, n): &(u32, u32)| (u64::from(m + n), u64::from(m * n));
    let fewer_rereads = |a: &(u32, u32), b: &(u32, u32)| {
        let ((sa, pa), (sb, pb)) = (rereads(a), rereads(b));
        (sa * pb)
            .cmp(&(sb * pa))
            .then((b.0 * b.1).cmp(&(a.0 * a.1)))
    };
    let filling = candidates
        .iter()
        .filter(|c| blocks(c) >= fill)
        .min_by(|a, b| fewer_rereads(a, b));
    let most_blocks = || {
        candidates
            .iter()
            .max_by(|a, b| blocks(a).cmp(&blocks(b)).then(fewer_rereads(b, a)))
    };
    filling.or_else(most_blocks).copied().unwrap_or((16, 16))
}

/// The expert widths of gate tiles for `experts` experts: those of `GATE_TILES_EXPERTS`
/// below E (rounded up to 16), and the narrowest that covers it.
fn gate_tile_widths(experts: u32) -> Vec<u32> {
    let covering = experts.next_multiple_of(16);
    let narrowest_covering = GATE_TILES_EXPERTS
        .into_iter()
        .filter(|&w| w >= covering)
        .min();
    GATE_TILES_EXPERTS
        .into_iter()
        .filter(|&w| w < covering || Some(w) == narrowest_covering)
        .collect()
}

/// A fused router's regime tile for a regime whose largest call has `max_tokens` tokens:
/// every SM a block there (`gate_tile`); whether the router is fused is decided on it
/// ([`fused`]), and its gates start from it ([`fused_gate_tile_at`]). Filling the SMs
/// comes before fewer re-reads: taller token tiles re-read less but ran the fused router
/// slower at every count from 16 tokens on (one H100, 2026-12-05: 1.06-3.2x at 16 tokens,
/// 1.04-9.6x from 64 on), its time being in the phases each token tile's last block runs
/// alone
/// (`benches/results/2026-12-05_fused_gate_tiles.md`).
pub fn fused_gate_tile(experts: u32, max_tokens: u32, sm_count: u32) -> (u32, u32) {
    gate_tile(experts, max_tokens, sm_count)
}

/// The gates of a regime of `calls` tokens, and whether its router is fused ([`fused`],
/// decided on the tile that gives every SM a block at the regime's largest call,
/// [`fused_gate_tile`]): a fused router's gates are [`fused_gates`], a split router's
/// [`split_gates`].
fn gate_plan(
    layer: &ir::Layer,
    target: &Target,
    rule: &ir::Router,
    gemm_experts: u32,
    calls: RangeInclusive<u32>,
) -> (Vec<GatePlan>, bool) {
    let tile = fused_gate_tile(layer.experts, *calls.end(), target.sm_count);
    let scratch_of = |tile| {
        gate_scratch(
            rule,
            layer.experts,
            gemm_experts,
            layer.hidden,
            target.smem_per_block,
            tile,
        )
    };
    if fused(
        *calls.end(),
        layer.top_k,
        scratch_of(tile),
        target.smem_per_block,
    ) {
        return (fused_gates(layer, target, calls, tile, scratch_of), true);
    }
    (split_gates(layer, target, rule, calls), false)
}

/// A fused router's gates over `calls`: the tile chosen at each point
/// ([`fused_gate_tile_at`] from `planned`, the tile of the regime's largest call;
/// [`gates_at_points`]), mma.sync with the fused router's scratch. One tile cannot
/// serve a whole decode regime: where its grid passes one wave of blocks (one per SM: a
/// fused gate's deep ring fills an SM's shared memory) a wider expert tile finishes
/// sooner, and below that point it is slower (fewer blocks read W_gate). DeepSeek-V3's
/// fused router alone on one H100 (2026-12-05): 16 x 32 tiles 18.3 / 24.9 / 55.4 µs at
/// 16 / 128 / 512 tokens, 16 x 64 tiles 22.1 / 28.8 / 44.0
/// (`benches/results/2026-12-05_fused_gate_tiles.md`).
fn fused_gates(
    layer: &ir::Layer,
    target: &Target,
    calls: RangeInclusive<u32>,
    planned: (u32, u32),
    scratch_of: impl Fn((u32, u32)) -> u32,
) -> Vec<GatePlan> {
    let fits_block = |tile| scratch_of(tile) <= target.smem_per_block;
    gates_at_points(layer, target, calls, |point| {
        let tile = fused_gate_tile_at(layer.experts, planned, point, target.sm_count, fits_block);
        let layout = mma_sync_gate_layout(tile, layer.hidden, target, Some(scratch_of(tile)));
        ((GateEngine::MmaSync, tile), layout)
    })
}

/// A fused router's gate tile for calls of `tokens` tokens: `planned` where its grid at
/// that count has at most a block per SM (`sm_count`); else, of its token height, the
/// narrowest wider expert tile whose grid does and whose later phases' scratch `fits` a
/// block; else `planned`. Taller token tiles are not considered: they ran the fused router
/// slower at every count from 16 tokens on ([`fused_gate_tile`]).
pub fn fused_gate_tile_at(
    experts: u32,
    planned: (u32, u32),
    tokens: u32,
    sm_count: u32,
    fits: impl Fn((u32, u32)) -> bool,
) -> (u32, u32) {
    let one_wave = |(m, n): (u32, u32)| gate_blocks(m, n, experts, tokens.max(1)) <= sm_count;
    if one_wave(planned) {
        return planned;
    }
    gate_tile_widths(experts)
        .into_iter()
        .filter(|&n| n > planned.1 && one_wave((planned.0, n)) && fits((planned.0, n)))
        .min()
        .map_or(planned, |n| (planned.0, n))
}

/// A split router's gates over `calls`: the engine and tile chosen at each point
/// ([`split_gate_tile`], [`gates_at_points`]). One tile per regime cannot serve it: on one
/// H200 (2026-12-02) Qwen3-30B-A3B's best mma.sync gate tile was 64 × 32 at 2048 tokens
/// (11.6 µs against 24.6 for the tile filling the SMs at 16384), 64 × 64 at 4096 (15.1
/// against 23.1) and 128 × 128 at 16384
/// (`benches/results/2026-12-02_router_early_start_and_gate_tiles.md`).
fn split_gates(
    layer: &ir::Layer,
    target: &Target,
    rule: &ir::Router,
    calls: RangeInclusive<u32>,
) -> Vec<GatePlan> {
    let fill = (target.sm_count * SPLIT_GATE_FILL_TENTHS).div_ceil(10);
    gates_at_points(layer, target, calls, |point| {
        split_gate_tile(layer, rule, target, point, fill)
    })
}

/// A router's gates over `calls`: at each power of two from the smallest call up to the
/// largest (the last point), the engine, tile and layout `choose` gives there; each gate
/// serves the calls from above the previous point up to its own. Neighbouring points with
/// one choice share a gate; a choice that comes back after another extends the latest gate
/// instead (one kernel per choice).
fn gates_at_points(
    layer: &ir::Layer,
    target: &Target,
    calls: RangeInclusive<u32>,
    choose: impl Fn(u32) -> (GateChoice, GateLayout),
) -> Vec<GatePlan> {
    let (first, last) = (*calls.start(), *calls.end());
    let mut choices: Vec<(GateChoice, GateLayout, u32)> = Vec::new();
    let mut point = first.max(1).next_power_of_two().min(last);
    loop {
        let (choice, layout) = choose(point);
        let seen = choices.iter().any(|&(c, _, _)| c == choice);
        match choices.last_mut() {
            Some((_, _, up_to)) if seen => *up_to = point,
            _ => choices.push((choice, layout, point)),
        }
        if point >= last {
            break;
        }
        point = point.saturating_mul(2).min(last);
    }
    let mut min_tokens = first;
    choices
        .into_iter()
        .map(|(choice, layout, max_tokens)| {
            let gate = gate_for(layer, target, choice, layout, min_tokens, max_tokens);
            min_tokens = max_tokens + 1;
            gate
        })
        .collect()
}

/// Whether a split router's gates may run on wgmma ([`GateEngine::WarpSpecialized`]): on a
/// target that has it, for E in whole 16-expert pieces (a TMA box of W_gate rows is then
/// whole 1024-byte swizzle periods).
pub fn wgmma_gate_allowed(experts: u32, target: &Target) -> bool {
    target.has_wgmma() && experts.is_multiple_of(16)
}

/// A gate's engine and tile (tokens, experts).
pub type GateChoice = (GateEngine, (u32, u32));

/// The engine, tile and layout of a split router's gate chosen at a call of `tokens`
/// tokens: the warp-specialised gate where it is allowed, its tiles would give at least
/// `fill` blocks with the reduction split over [`GATE_WS_MOST_SPLITS`] blocks, and each
/// block of the split the grid then has ([`gate_k_split`]) multiplies at least
/// [`GATE_WS_MIN_K_TILES`] k-tiles; else the cluster gate where it is allowed
/// ([`cluster_gate_choice`]); else the mma.sync tile ([`gate_tile`]). A shorter run does
/// not pay for the warp-specialised block's start (barriers, the tensor map, a deeper ring
/// to fill) and the split's partial sums, which the tile's last block adds up after the
/// multiply. On one H200 (2026-12-02, the gate kernel alone, µs, mma.sync → wgmma):
/// Qwen3-30B-A3B 6.4 → 21.3 at 257 tokens (16 splits of 2 k-tiles), 14.5 → 16.8 at 4096 (2
/// of 16), 43.4 → 29.2 at 16384 (32 k-tiles, no split); GPT-OSS-120B 21.4 → 19.5 at 4096
/// (45, no split); DeepSeek-V3 27.5 → 35.9 at 1024 (7 of 16), 67.6 → 42.7 at 4096 (2 of
/// 56), 201.8 → 106.6 at 16384.
fn split_gate_tile(
    layer: &ir::Layer,
    rule: &ir::Router,
    target: &Target,
    tokens: u32,
    fill: u32,
) -> (GateChoice, GateLayout) {
    let (experts, hidden) = (layer.experts, layer.hidden);
    let ws_tile = warp_specialized_gate_tile(experts, tokens, fill);
    let blocks = gate_blocks(ws_tile.0, ws_tile.1, experts, tokens.max(1));
    let splits = gate_k_split(hidden, 1, target.sm_count).splits(blocks);
    if wgmma_gate_allowed(experts, target)
        && blocks * GATE_WS_MOST_SPLITS >= fill
        && gate_k_tiles(hidden) / splits >= GATE_WS_MIN_K_TILES
    {
        let layout = warp_specialized_gate_layout(ws_tile, hidden, target);
        return ((GateEngine::WarpSpecialized, ws_tile), layout);
    }
    // Virtual ranks share one GPU with blocks that spin on flags, one per SM, and a cluster
    // needs several SMs of one GPC free at once, which their residency bound does not
    // promise: pipelined self-routed calls on two virtual ranks of Qwen3-30B-A3B, whose
    // router runs in clusters at 257-1024 tokens, waited out their flags' bound (one H200,
    // 2026-12-04). Blocks alone each need one free SM, which the bound keeps.
    if cluster_gate_allowed(experts, target)
        && layer.topology.virtual_ranks.is_none()
        && let Some(((engine, tile), layout)) =
            cluster_gate_choice(rule, experts, hidden, target, tokens)
    {
        return ((engine, tile), layout);
    }
    let tile = gate_tile(experts, tokens, fill);
    (
        (GateEngine::MmaSync, tile),
        mma_sync_gate_layout(tile, hidden, target, None),
    )
}

/// The split a call's warp-specialised gate tiles must fill the SMs with, and the fewest
/// k-tiles each block must take, for the planner to choose them ([`split_gate_tile`]).
const GATE_WS_MOST_SPLITS: u32 = 2;
const GATE_WS_MIN_K_TILES: u32 = 32;

/// A warp-specialised gate's tile for calls of `tokens` tokens: every expert in one tile
/// (one wgmma of up to [`GATE_WS_MAX_EXPERTS`] columns per k16 step; wider E takes several
/// expert tiles), and 128 tokens where that grid gives `fill` blocks, else 64 (its
/// reduction then split over blocks to fill the SMs: [`gate_k_split`]).
fn warp_specialized_gate_tile(experts: u32, tokens: u32, fill: u32) -> (u32, u32) {
    let tile_experts = experts.min(GATE_WS_MAX_EXPERTS);
    let tokens = tokens.max(1);
    let tile_tokens = GATE_WS_TILES_TOKENS
        .into_iter()
        .find(|&m| gate_blocks(m, tile_experts, experts, tokens) >= fill)
        .unwrap_or(GATE_WS_TILES_TOKENS[GATE_WS_TILES_TOKENS.len() - 1]);
    (tile_tokens, tile_experts)
}

/// The share of SMs, in tenths, a split gate's tile gives a block at the call it is chosen
/// for ([`split_gates`]): 128 blocks on 132 SMs (97%) is what the best measured tiles ran.
const SPLIT_GATE_FILL_TENTHS: u32 = 9;

/// A fused router's scratch with the gate tile `(tile_tokens, tile_experts)` over a
/// reduction of `hidden` ([`router_scratch_bytes`], its warps from the tile).
pub fn gate_scratch(
    rule: &ir::Router,
    experts: u32,
    gemm_experts: u32,
    hidden: u32,
    smem_per_block: u32,
    (tile_tokens, tile_experts): (u32, u32),
) -> u32 {
    let (warps_m, warps_n) = gate_warps(tile_tokens, tile_experts);
    let warps_k = gate_warps_k(tile_tokens, tile_experts, hidden, smem_per_block);
    router_scratch_bytes(
        rule,
        experts,
        gemm_experts,
        warps_m * warps_n * warps_k,
        tile_tokens,
    )
}

/// What a gate's engine and tile make of its warps, stages, split and shared memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateLayout {
    pub warps_m: u32,
    pub warps_n: u32,
    pub warps_k: u32,
    pub k_split: KSplit,
    pub stages: u32,
    pub smem_bytes: u32,
}

/// The layout of a gate of `engine` and tile `(tile_tokens, tile_experts)` for the router
/// `rule` over `experts` experts and a reduction of `hidden` on `target`; a fused router's
/// (mma.sync) with its `scratch`. mma.sync: warps from the tile ([`gate_warps`]), groups
/// splitting the reduction ([`gate_warps_k`]), [`gate_stages`]. Warp-specialised: a
/// consumer warpgroup per 64 tokens, as many stages as fit a block (at most
/// `GATE_WS_MAX_STAGES` and the k-tiles). Cluster: [`cluster_gate_layout`] (`None` where
/// it does not fit a block).
pub fn gate_layout(
    engine: GateEngine,
    tile: (u32, u32),
    (rule, experts, hidden): (&ir::Router, u32, u32),
    target: &Target,
    scratch: Option<u32>,
) -> Option<GateLayout> {
    match engine {
        GateEngine::MmaSync => Some(mma_sync_gate_layout(tile, hidden, target, scratch)),
        GateEngine::WarpSpecialized => Some(warp_specialized_gate_layout(tile, hidden, target)),
        GateEngine::Cluster { blocks } => {
            cluster_gate_layout(rule, experts, hidden, tile, blocks, target)
        }
    }
}

/// An mma.sync gate's layout ([`gate_layout`]).
fn mma_sync_gate_layout(
    (tile_tokens, tile_experts): (u32, u32),
    hidden: u32,
    target: &Target,
    scratch: Option<u32>,
) -> GateLayout {
    let (warps_m, warps_n) = gate_warps(tile_tokens, tile_experts);
    let warps_k = gate_warps_k(tile_tokens, tile_experts, hidden, target.smem_per_block);
    let stages = gate_stages(
        scratch.is_some(),
        tile_tokens,
        tile_experts,
        hidden,
        warps_k,
        target.smem_per_block,
    );
    GateLayout {
        warps_m,
        warps_n,
        warps_k,
        k_split: gate_k_split(hidden, warps_k, target.sm_count),
        stages,
        smem_bytes: GatePlan::smem_bytes_for(tile_tokens, tile_experts, stages, warps_k, scratch),
    }
}

/// A warp-specialised gate's layout ([`gate_layout`]).
fn warp_specialized_gate_layout(
    (tile_tokens, tile_experts): (u32, u32),
    hidden: u32,
    target: &Target,
) -> GateLayout {
    let most = GATE_WS_MAX_STAGES.min(gate_k_tiles(hidden)).max(2);
    let stages = (2..=most)
        .rev()
        .find(|&s| {
            GatePlan::warp_specialized_smem(tile_tokens, tile_experts, s) <= target.smem_per_block
        })
        .unwrap_or(2);
    GateLayout {
        warps_m: tile_tokens / 16,
        warps_n: 1,
        warps_k: 1,
        k_split: gate_k_split(hidden, 1, target.sm_count),
        stages,
        smem_bytes: GatePlan::warp_specialized_smem(tile_tokens, tile_experts, stages),
    }
}

/// Most blocks of a cluster gate's cluster: the portable cluster size.
const GATE_CLUSTER_MAX_BLOCKS: u32 = 8;
/// A cluster gate's tile holds every expert: at most this many (8 warps of 32 tokens by
/// 64 experts hold 64 tokens by 256 experts).
const GATE_CLUSTER_MAX_EXPERTS: u32 = 256;
/// The token counts of a cluster gate's tiles.
const GATE_CLUSTER_TILES_TOKENS: [u32; 4] = [128, 64, 32, 16];
/// A cluster gate's time, as measured on one H200 (2026-12-03, Nsight Compute, the gate
/// kernel alone, `benches/results/2026-12-03_cluster_gate.md`): each wave of clusters
/// takes about 6 µs whatever it loads (start, the first loads' latency, the cluster
/// barriers and the sums in distributed shared memory), plus a block's k-tiles at about
/// 50 GB/s (its few stages in flight), plus about 1.8 µs per round of selects (a token per
/// warp; 128 experts, top-8).
const CLUSTER_GATE_WAVE_SECONDS: f64 = 6e-6;
const CLUSTER_GATE_BLOCK_BYTES_PER_S: f64 = 50e9;
const CLUSTER_GATE_SELECT_ROUND_SECONDS: f64 = 1.8e-6;
/// A cluster gate is chosen only for calls whose clusters all run at once, each block
/// selecting its tokens in at most this many rounds, and whose time by those rates is at
/// most [`CLUSTER_GATE_MOST_SECONDS`]: measured, a second wave of clusters or four rounds
/// of selects made it slower than the mma.sync gate and the select kernel (Qwen3-30B-A3B
/// at 1024-4096 tokens, 12.6-20.0 → 16.9-36.4 µs), which took 10.5 µs or more at every
/// split call measured (12 cells of four examples, 512-4096 tokens).
const CLUSTER_GATE_MOST_SELECT_ROUNDS: u32 = 2;
const CLUSTER_GATE_MOST_SECONDS: f64 = 10e-6;

/// Whether a split router's gate may run in clusters ([`GateEngine::Cluster`]): on a target
/// with thread-block clusters, for E within one tile (`GATE_CLUSTER_MAX_EXPERTS`) in whole
/// 16-byte pieces of f32 (the blocks sum the partial logits four at a time).
pub fn cluster_gate_allowed(experts: u32, target: &Target) -> bool {
    target.has_clusters() && experts <= GATE_CLUSTER_MAX_EXPERTS && experts.is_multiple_of(4)
}

/// A cluster gate's partial logits (f32 × `tile_tokens` × `tile_experts`, which the
/// cluster's blocks read), in bytes. They take the place of the first group's ring once
/// the multiply is done: the groups' own partial sums are read from the other rings.
pub fn cluster_partial_bytes((tile_tokens, tile_experts): (u32, u32)) -> u32 {
    4 * tile_tokens * tile_experts
}

/// A cluster gate's shared memory after its rings (or its partial logits, where larger),
/// in bytes: its own tokens' logits summed over the cluster (f32 × ⌈tile_tokens / blocks⌉
/// × E), the rule's bias (f32 × E, with one) and, with a group limit ranked in shared
/// memory, each warp's selection values (f32 × E).
pub fn cluster_scratch_bytes(
    rule: &ir::Router,
    experts: u32,
    tile_tokens: u32,
    blocks: u32,
    warps: u32,
) -> u32 {
    4 * tile_tokens.div_ceil(blocks) * experts
        + bias_bytes(rule, experts)
        + selection_bytes(rule, experts, warps)
}

/// The layout of a cluster gate of tile `(tile_tokens, tile_experts)` in clusters of
/// `blocks`: warps from the tile ([`gate_warps`], at most `GATE_BLOCK_WARPS`, each a whole
/// number of 16 × 16 pieces: a tile of 80 experts, say, has none), groups of
/// them splitting the block's k-tiles (as many as fill `GATE_BLOCK_WARPS` warps and
/// divide them), and as many stages as keep all of a group's k-tiles in flight, at most
/// [`FUSED_GATE_MAX_STAGES`], at least 2; the rings (or the partial logits, where larger,
/// and those must fit the first group's ring where there are several: [`cluster_partial_bytes`]),
/// then [`cluster_scratch_bytes`]. Two blocks
/// to an SM where such a layout fits half an SM's shared memory (twice the clusters at
/// once: [`Target::clusters_at_once`]), else one. `None` where the tile does not split that
/// way or fit a block.
pub fn cluster_gate_layout(
    rule: &ir::Router,
    experts: u32,
    hidden: u32,
    tile: (u32, u32),
    blocks: u32,
    target: &Target,
) -> Option<GateLayout> {
    let (warps_m, warps_n) = gate_warps(tile.0, tile.1);
    let k_tiles = gate_k_tiles(hidden);
    if warps_m * warps_n > GATE_BLOCK_WARPS
        || !tile.0.is_multiple_of(16 * warps_m)
        || !tile.1.is_multiple_of(16 * warps_n)
        || !(2..=GATE_CLUSTER_MAX_BLOCKS).contains(&blocks)
        || !k_tiles.is_multiple_of(blocks)
    {
        return None;
    }
    let block_k_tiles = k_tiles / blocks;
    let partial = cluster_partial_bytes(tile);
    let smem = |stages: u32, warps_k: u32| {
        let rings = GatePlan::smem_for(tile.0, tile.1, stages, warps_k);
        let first_ring = GatePlan::smem_for(tile.0, tile.1, stages, 1);
        (warps_k == 1 || partial <= first_ring).then(|| {
            rings.max(partial)
                + cluster_scratch_bytes(rule, experts, tile.0, blocks, warps_m * warps_n * warps_k)
        })
    };
    let fits = |stages: u32, warps_k: u32, limit: u32| {
        smem(stages, warps_k).is_some_and(|bytes| bytes <= limit)
    };
    let layout_within = |limit: u32| {
        let warps_k = (1..=GATE_BLOCK_WARPS / (warps_m * warps_n))
            .rev()
            .find(|&g| block_k_tiles.is_multiple_of(g) && fits(2, g, limit))?;
        let most_stages = (block_k_tiles / warps_k + 1).clamp(2, FUSED_GATE_MAX_STAGES);
        let stages = (2..=most_stages).rev().find(|&s| fits(s, warps_k, limit))?;
        Some(GateLayout {
            warps_m,
            warps_n,
            warps_k,
            k_split: KSplit {
                steps: blocks,
                most_blocks: u32::MAX,
            },
            stages,
            smem_bytes: smem(stages, warps_k)?,
        })
    };
    layout_within(half_sm_smem(target)).or_else(|| layout_within(target.smem_per_block))
}

/// The shared memory a block may take for two to fit an SM (each block reserves 1 KiB).
fn half_sm_smem(target: &Target) -> u32 {
    (target.smem_per_sm / 2).saturating_sub(1024)
}

/// The cluster gate for calls of `tokens` tokens ([`GateEngine::Cluster`]), if one
/// serves them: among the tiles of `GATE_CLUSTER_TILES_TOKENS` tokens by every expert
/// (E rounded up to 16; the zero-filled rest is never stored) and the clusters of 2 to 8
/// blocks that split their reduction evenly ([`cluster_gate_layout`]), those whose
/// clusters all run at once ([`Target::clusters_at_once`]) and whose blocks select their
/// tokens in at most `CLUSTER_GATE_MOST_SELECT_ROUNDS` rounds, within
/// `CLUSTER_GATE_MOST_SECONDS` by the measured rates (`CLUSTER_GATE_WAVE_SECONDS` and
/// after); of those, the fastest, fewer blocks on a tie.
pub fn cluster_gate_choice(
    rule: &ir::Router,
    experts: u32,
    hidden: u32,
    target: &Target,
    tokens: u32,
) -> Option<(GateChoice, GateLayout)> {
    let tile_experts = experts.next_multiple_of(16);
    let k_tiles = gate_k_tiles(hidden);
    GATE_CLUSTER_TILES_TOKENS
        .into_iter()
        .flat_map(|m| (2..=GATE_CLUSTER_MAX_BLOCKS).map(move |c| (m, c)))
        .filter_map(|(m, c)| {
            let layout = cluster_gate_layout(rule, experts, hidden, (m, tile_experts), c, target)?;
            let clusters = tokens.max(1).div_ceil(m);
            let blocks_per_sm = if layout.smem_bytes <= half_sm_smem(target) {
                2
            } else {
                1
            };
            let warps = layout.warps_m * layout.warps_n * layout.warps_k;
            let select_rounds = m.div_ceil(c).div_ceil(warps);
            let bytes = f64::from(k_tiles / c * (m + tile_experts) * SMEM_ROW_BYTES);
            let seconds = CLUSTER_GATE_WAVE_SECONDS
                + bytes / CLUSTER_GATE_BLOCK_BYTES_PER_S
                + f64::from(select_rounds) * CLUSTER_GATE_SELECT_ROUND_SECONDS;
            if clusters > target.clusters_at_once(c, blocks_per_sm)
                || select_rounds > CLUSTER_GATE_MOST_SELECT_ROUNDS
                || seconds > CLUSTER_GATE_MOST_SECONDS
            {
                return None;
            }
            let choice = (GateEngine::Cluster { blocks: c }, (m, tile_experts));
            Some((seconds, clusters * c, choice, layout))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, _, choice, layout)| (choice, layout))
}

/// The gate of `engine`, tile `(tile_tokens, tile_experts)` and `layout` for calls of
/// `min_tokens..=max_tokens` tokens.
fn gate_for(
    layer: &ir::Layer,
    target: &Target,
    (engine, tile): GateChoice,
    layout: GateLayout,
    min_tokens: u32,
    max_tokens: u32,
) -> GatePlan {
    GatePlan {
        engine,
        min_tokens,
        max_tokens,
        tile_tokens: tile.0,
        tile_experts: tile.1,
        expert_tiles: layer.experts.div_ceil(tile.1),
        warps_m: layout.warps_m,
        warps_n: layout.warps_n,
        warps_k: layout.warps_k,
        k_split: layout.k_split,
        stages: layout.stages,
        smem_bytes: layout.smem_bytes,
        floor: floor(layer, target, engine, max_tokens),
    }
}

fn floor(layer: &ir::Layer, target: &Target, engine: GateEngine, tokens: u32) -> RouterFloor {
    let (t, h, e, k) = (
        f64::from(tokens),
        f64::from(layer.hidden),
        f64::from(layer.experts),
        f64::from(layer.top_k),
    );
    let flops = 2.0 * t * e * h;
    let bytes = t * h * 2.0 + e * h * 2.0 + 2.0 * t * e * 4.0 + t * k * 8.0;
    let fraction = match engine {
        GateEngine::MmaSync | GateEngine::Cluster { .. } => target.mma_sync_fraction,
        GateEngine::WarpSpecialized => target.wgmma_fraction,
    };
    let seconds = (flops / (target.peak_bf16_flops * fraction)).max(bytes / target.hbm_bytes_per_s);
    RouterFloor {
        tokens,
        flops,
        bytes,
        seconds,
    }
}

/// Whether the router of a regime whose largest call has `max_tokens` tokens is fused: few
/// enough pairs ([`ROUTER_FUSED_MAX_PAIRS`]), and the later phases' `scratch_bytes`
/// ([`router_scratch_bytes`]) within a block's shared memory.
pub fn fused(max_tokens: u32, top_k: u32, scratch_bytes: u32, smem_per_block: u32) -> bool {
    u64::from(max_tokens) * u64::from(top_k) <= ROUTER_FUSED_MAX_PAIRS
        && scratch_bytes <= smem_per_block
}

/// Static shared memory of the split router's select kernel: with a group limit ranked in
/// shared memory, each warp's selection values (f32 × E), from which a lane sums its
/// group's best two.
pub fn select_static_smem_bytes(rule: &ir::Router, experts: u32) -> u32 {
    static_smem_reserved(selection_bytes(rule, experts, SELECT_WARPS))
}

/// The selection values `warps` warps keep for a group limit ranked in shared memory
/// ([`groups_in_shared_memory`]; f32 × E each); none otherwise.
fn selection_bytes(rule: &ir::Router, experts: u32, warps: u32) -> u32 {
    if groups_in_shared_memory(rule, experts) {
        4 * experts * warps
    } else {
        0
    }
}

/// Whether the select ranks a group limit's groups from each warp's selection values in
/// shared memory: where a group is not whole entries of every lane (a lane holds experts
/// lane, lane + 32, ...; groups of a multiple of 32 experts are), so that warp reductions
/// cannot give each group its two best values. DeepSeek-V3's 8 groups of 32 are whole: by
/// reductions its fused router's select of a 16-token tile took 5.8-6.0 µs against 6.1-6.3
/// (one H100, 2026-12-06, `benches/results/2026-12-06_h100_fused_router_phases.md`).
pub fn groups_in_shared_memory(rule: &ir::Router, experts: u32) -> bool {
    rule.group_limit
        .is_some_and(|limit| !(experts / limit.groups).is_multiple_of(32))
}

/// The router's launches of regime `regime` of the layer `symbol` with these gates:
/// fused, one block per (token tile, expert tile, block of the split); or split, one gate
/// block per (token tile, expert tile, block of the split) of each gate (a warp-specialised
/// one reading W_gate through a TMA map, boxes of its tile's experts; a cluster gate one
/// cluster per token tile, which selects), then, unless every gate selects, one select
/// block per [`SELECT_WARPS`] tokens. The fused router starts early where `early_start` says so (it
/// heads a call of early-starting kernels); the split router's launches do not (starting
/// early cost its gate kernel 3-12%, 1 µs at a few hundred tokens, and the calls gained
/// nothing measurable: `benches/results/2026-12-02_router_early_start_and_gate_tiles.md`).
pub(super) fn router_launches(
    rule: &ir::Router,
    experts: u32,
    gates: &[GatePlan],
    fused: bool,
    symbol: &str,
    regime: &str,
    early_start: bool,
) -> Vec<Launch> {
    use BufferId::*;
    use LaunchArg::*;
    let (read, write) = (KernelParam::read, KernelParam::write);
    let bias = (rule.bias != ir::RouterBias::None).then(|| read(GateBias));
    let gate_blocks = |gate: &GatePlan| Grid::SplitTokenTiles {
        tokens_per_tile: gate.tile_tokens,
        blocks_per_tile: gate.expert_tiles,
        k_split: gate.k_split,
    };
    if fused {
        return gates
            .iter()
            .map(|gate| Launch {
                kernel: fused_router_kernel_name(symbol, regime, gates, gate),
                grid: gate_blocks(gate),
                block_threads: gate.threads(),
                smem_bytes: gate.smem_bytes,
                static_smem_bytes: 0,
                stream: StreamRole::Compute,
                early_start,
                params: [read(X), read(GateWeight)]
                    .into_iter()
                    .chain(bias)
                    .chain([
                        read(Tokens),
                        write(Workspace(RouterLogits)),
                        write(Workspace(RouterTilesDone)),
                        write(Workspace(RoutedIds)),
                        write(Workspace(RoutedWeights)),
                        read(LaysOutRouting),
                        write(Workspace(ExpertOffsets)),
                        write(Workspace(RowPair)),
                        write(Workspace(ErrorWord)),
                    ])
                    .collect(),
            })
            .collect();
    }
    let gate_params = |gate: &GatePlan| -> Vec<KernelParam> {
        match gate.engine {
            GateEngine::MmaSync => vec![
                read(X),
                read(GateWeight),
                read(Tokens),
                write(Workspace(RouterLogits)),
                write(Workspace(RouterTilesDone)),
            ],
            GateEngine::WarpSpecialized => vec![
                read(X),
                read(GateWeightTiles {
                    box_rows: gate.tile_experts,
                }),
                read(Tokens),
                write(Workspace(RouterLogits)),
                write(Workspace(RouterTilesDone)),
            ],
            GateEngine::Cluster { .. } => [read(X), read(GateWeight)]
                .into_iter()
                .chain(bias)
                .chain([
                    read(Tokens),
                    write(Workspace(RouterLogits)),
                    write(Workspace(RoutedIds)),
                    write(Workspace(RoutedWeights)),
                ])
                .collect(),
        }
    };
    let needs_select = gates.iter().any(|gate| !gate.engine.selects());
    gates
        .iter()
        .map(|gate| Launch {
            kernel: gate_kernel_name(symbol, regime, gate),
            grid: gate_blocks(gate),
            block_threads: gate.threads(),
            smem_bytes: gate.smem_bytes,
            static_smem_bytes: 0,
            stream: StreamRole::Compute,
            early_start: false,
            params: gate_params(gate),
        })
        .chain(needs_select.then(|| {
            Launch {
                kernel: format!("{symbol}_router_select"),
                grid: Grid::TokenTiles {
                    tokens_per_tile: SELECT_WARPS,
                    blocks_per_tile: 1,
                },
                block_threads: 32 * SELECT_WARPS,
                smem_bytes: 0,
                static_smem_bytes: select_static_smem_bytes(rule, experts),
                stream: StreamRole::Compute,
                early_start: false,
                params: [read(Workspace(RouterLogits))]
                    .into_iter()
                    .chain(bias)
                    .chain([
                        read(Tokens),
                        write(Workspace(RoutedIds)),
                        write(Workspace(RoutedWeights)),
                    ])
                    .collect(),
            }
        }))
        .collect()
}

/// A fused router's kernel: `<symbol>_` and its [`fused_router_name`].
fn fused_router_kernel_name(
    symbol: &str,
    regime: &str,
    gates: &[GatePlan],
    gate: &GatePlan,
) -> String {
    format!("{symbol}_{}", fused_router_name(regime, gates, gate))
}

/// A fused router of regime `regime` by name (its kernel's, less the layer's symbol;
/// codegen names its configuration after it): `<regime>_router` where the regime has one
/// gate, else `<regime>_router_<m>x<n>` for each.
pub fn fused_router_name(regime: &str, gates: &[GatePlan], gate: &GatePlan) -> String {
    if gates.len() == 1 {
        format!("{regime}_router")
    } else {
        format!("{regime}_router_{}x{}", gate.tile_tokens, gate.tile_experts)
    }
}

/// A split router's gate kernel: `<symbol>_` and its [`split_gate_name`].
fn gate_kernel_name(symbol: &str, regime: &str, gate: &GatePlan) -> String {
    format!("{symbol}_{}", split_gate_name(regime, gate))
}

/// A split router's gate of regime `regime` by name (its kernel's, less the layer's
/// symbol; codegen names its configuration so): `<regime>_router_gate_<m>x<n>`, with
/// `_cluster<c>` after it for a cluster gate and `_wgmma` for a warp-specialised one (a
/// regime may have an mma.sync and a wgmma gate of one tile).
pub fn split_gate_name(regime: &str, gate: &GatePlan) -> String {
    let engine = match gate.engine {
        GateEngine::Cluster { blocks } => format!("_cluster{blocks}"),
        GateEngine::WarpSpecialized => "_wgmma".to_string(),
        GateEngine::MmaSync => String::new(),
    };
    format!(
        "{regime}_router_gate_{}x{}{engine}",
        gate.tile_tokens, gate.tile_experts
    )
}

/// The router's rule in one phrase.
pub fn rule_summary(rule: &ir::Router) -> String {
    use ir::{RouterBias, Scoring};
    let bias = match rule.bias {
        RouterBias::None => "",
        RouterBias::Logits => " + bias",
        RouterBias::ScoreCorrection => "",
    };
    let choice = match rule.bias {
        RouterBias::ScoreCorrection => "score + correction bias",
        RouterBias::None | RouterBias::Logits => "score",
    };
    let groups = match rule.group_limit {
        Some(limit) => format!(", among the best {} of {} groups", limit.kept, limit.groups),
        None => String::new(),
    };
    let weights = match (rule.scoring, rule.normalize) {
        (Scoring::TopkSoftmax, _) => "softmax over the chosen logits",
        (_, true) => "chosen scores renormalised",
        (_, false) => "chosen scores",
    };
    format!(
        "scores {}(x · W_gateᵀ{bias}), top-k by {choice}{groups} (ties: lower index), weights {weights} × {}",
        match rule.scoring {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
            Scoring::TopkSoftmax => "",
        },
        rule.scale
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GEMM1 gives up its early start only right behind a fused router, on a target that
    /// measured it faster so; a sort of x's rows between them or a split router keeps it.
    #[test]
    fn gemm1_waits_only_right_behind_a_fused_router_where_measured() {
        let (h100, h200) = (Target::h100(), Target::h200());
        assert!(!gemm1_starts_early_behind(true, true, &h100));
        assert!(gemm1_starts_early_behind(true, false, &h100));
        assert!(gemm1_starts_early_behind(false, true, &h100));
        assert!(gemm1_starts_early_behind(true, true, &h200));
    }
}
