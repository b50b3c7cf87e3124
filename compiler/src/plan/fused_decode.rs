//! The fused decode: a regime's smallest calls as one persistent kernel in place of its
//! table (route, GEMM1, GEMM2, combine). A call of a few tokens is mostly ramps: each
//! launch's start, the wait for the one ahead, first loads and a last wave. In the fused
//! kernel every block lays out the call's routing in its own shared memory, GEMM1 tiles
//! come first and count themselves in at their expert, a GEMM2 tile waits only for its own
//! expert's GEMM1 tiles (its first weight stages already loading), and the last GEMM2 tile
//! of each column tile sums that column tile of every token into y. Same tiles, stages and
//! warps as the regime's GEMMs (`compiler/templates/decode_fused.cu`).
//!
//! Planned where the spec asks for it (`fused_decode = N tokens` in `schedule { }`), else
//! for [`DEFAULT_FUSED_DECODE_TOKENS`].

use serde::{Deserialize, Serialize};

use super::ep::{CombineRoute, ExpertParallelPlan, Placement};
use super::launch::{Grid, KernelParam, Launch, LaunchArg, StreamRole};
use super::{
    BufferId, GemmPlan, LayerShape, MmaEngine, Regime, RowLoad, SMEM_RESERVED_PER_BLOCK, Target,
    static_smem_reserved,
};

/// Calls of up to this many tokens run fused where the spec says nothing (0: none). None:
/// measured on one H200 (2026-12-01, `benches/results/2026-12-01_fused_decode_measured.md`)
/// it wins 2-6% at 2-16 tokens on three of the four examples but loses at one token on all
/// four (1-13%), on Qwen3-30B-A3B at two tokens and on Mixtral at most counts, so no one
/// bound serves every layer.
pub const DEFAULT_FUSED_DECODE_TOKENS: u32 = 0;

/// A regime's calls of up to `max_tokens` tokens as one kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedDecode {
    pub max_tokens: u32,
    /// Blocks of the kernel on one SM: as many as both GEMMs' and the shared memory
    /// allow, so that the grid is resident at once (for speed: the blocks claim their
    /// units from a ticket in increasing order, so a GEMM2 tile waits only for tiles that
    /// running blocks hold).
    pub blocks_per_sm: u32,
    /// Rows of the call's routing each block holds: `max_tokens` × slots per token.
    pub max_rows: u32,
    pub launch: Launch,
}

impl FusedDecode {
    /// Whether a call of `tokens` tokens (in its regime) runs this kernel.
    pub fn covers(&self, tokens: u32) -> bool {
        tokens <= self.max_tokens
    }
}

/// Counters of [`BufferId::FusedDecodeCounters`]: per GEMM expert the GEMM1 tiles stored
/// and the GEMM2 tiles that read them, per GEMM2 column tile the tiles stored, then the
/// next work unit's ticket and the blocks done claiming.
pub fn counters_len(shape: &LayerShape, gemm2: &GemmPlan) -> u64 {
    2 * u64::from(shape.gemm_experts()) + u64::from(shape.hidden / gemm2.tile.n) + 2
}

/// The counters the workspace holds for the regimes' fused decodes (the largest need),
/// `None` where no regime has one.
pub fn counters_needed(shape: &LayerShape, regimes: &[Regime]) -> Option<u64> {
    regimes
        .iter()
        .filter(|r| r.fused_decode.is_some())
        .map(|r| counters_len(shape, &r.gemm2))
        .max()
}

/// Static shared memory of the fused kernel: each expert's first row, fill count and two
/// tile schedules (i32 [E' + 1] × 3, [E']), the call's rows (i32 [max_rows]), the block's
/// next unit (i32) and, for a gated shared expert, the call's tokens' gate weights (f32
/// [max_tokens]).
fn static_smem_bytes(shape: &LayerShape, max_tokens: u32, max_rows: u32) -> u32 {
    let gate = if shape.shared_gated { max_tokens } else { 0 };
    static_smem_reserved(4 * (4 * shape.gemm_experts() + 4 + max_rows + gate))
}

/// Whether a fused decode can run a regime's GEMMs (`what`: the regime, for the reason):
/// the first regime, both GEMMs on mma.sync with the same threads.
pub(crate) fn first_regime_on_mma_sync(
    what: &str,
    min_tokens: u32,
    g1: &GemmPlan,
    g2: &GemmPlan,
) -> Result<(), String> {
    if min_tokens != 0 {
        return Err(format!("{what} is not the first"));
    }
    gemms_on_mma_sync(what, g1, g2)
}

/// Whether a fused kernel can run these GEMMs: both on mma.sync with the same threads.
pub(crate) fn gemms_on_mma_sync(what: &str, g1: &GemmPlan, g2: &GemmPlan) -> Result<(), String> {
    if g1.engine != MmaEngine::MmaSync || g2.engine != MmaEngine::MmaSync {
        return Err(format!(
            "{what} runs its GEMMs on {} and {}; the fused decode needs mma.sync for both",
            g1.engine.name(),
            g2.engine.name()
        ));
    }
    if g1.threads() != g2.threads() {
        return Err(format!(
            "{what}'s GEMMs differ in threads per block ({} and {})",
            g1.threads(),
            g2.threads()
        ));
    }
    Ok(())
}

/// A fused decode's first parameters, one GPU's and a rank's alike: x, then each GEMM's
/// weights with its expert biases where the layer has them, then a gated shared expert's
/// gate (whose weights the shared slices' GEMM2 tiles compute in shared memory).
fn input_and_weight_params(shape: &LayerShape) -> Vec<KernelParam> {
    use LaunchArg::*;
    let read = KernelParam::read;
    let bias = |arg| shape.expert_bias.then(|| read(arg));
    [
        Some(read(X)),
        Some(read(W1)),
        bias(W1Bias),
        Some(read(W2)),
        bias(W2Bias),
        shape.shared_gated.then(|| read(SharedExpertGate)),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The fused decode of `regime` (named `kernel`) for calls of up to `tokens` tokens (at
/// most the regime's), where it can run: the layer's first regime, both GEMMs mma.sync with
/// the same threads, GEMM1 gathering its rows, and the grid resident at once. Otherwise the
/// reason it cannot.
pub fn plan_fused_decode(
    target: &Target,
    shape: &LayerShape,
    regime: &Regime,
    kernel: &str,
    early_start: bool,
    tokens: u32,
) -> Result<FusedDecode, String> {
    let (g1, g2) = (&regime.gemm1, &regime.gemm2);
    first_regime_on_mma_sync(
        &format!("regime `{}`", regime.name),
        regime.min_tokens,
        g1,
        g2,
    )?;
    if g1.a_load != RowLoad::Gathered {
        return Err(format!(
            "regime `{}`'s GEMM1 loads x's rows sorted by expert, which the fused decode does not",
            regime.name
        ));
    }
    let max_tokens = tokens.min(regime.max_tokens);
    if max_tokens == 0 {
        return Err("it would cover no call".into());
    }
    let max_rows = max_tokens * shape.slots_per_token();
    let static_smem = static_smem_bytes(shape, max_tokens, max_rows);
    let smem_bytes = g1.smem_bytes.max(g2.smem_bytes);
    // Each resident block also costs the 1 KiB the driver reserves per block.
    let by_smem = target.smem_per_sm / (smem_bytes + static_smem + SMEM_RESERVED_PER_BLOCK);
    let blocks_per_sm = g1.blocks_per_sm.min(g2.blocks_per_sm).min(by_smem);
    if blocks_per_sm == 0 || smem_bytes + static_smem > target.smem_per_block {
        return Err(format!(
            "its {} B of shared memory per block (the larger ring, {max_rows} routing rows) do not fit {}",
            smem_bytes + static_smem,
            target.name
        ));
    }
    let (read, write) = (KernelParam::read, KernelParam::write);
    use BufferId::*;
    use LaunchArg::*;
    let params = input_and_weight_params(shape)
        .into_iter()
        .chain([
            read(TopkIds),
            read(TopkWeights),
            read(Tokens),
            write(Workspace(Intermediate)),
            write(Workspace(CombineSlots)),
            write(Workspace(FusedDecodeCounters)),
            write(Workspace(ErrorWord)),
            write(Y),
        ])
        .collect();
    Ok(FusedDecode {
        max_tokens,
        blocks_per_sm,
        max_rows,
        launch: Launch {
            kernel: kernel.to_string(),
            grid: Grid::Fixed(target.sm_count * blocks_per_sm),
            block_threads: g1.threads(),
            smem_bytes,
            static_smem_bytes: static_smem,
            params,
            stream: StreamRole::Compute,
            early_start,
        },
    })
}

/// Calls of up to this many tokens per rank run a rank's fused decode where the spec says
/// nothing (at most the rank's first regime's calls).
pub const DEFAULT_RANK_FUSED_DECODE_TOKENS: u32 = 32;

/// Counters of [`BufferId::RankFusedCounters`]: per GEMM expert of a rank (its local
/// experts, then the shared slices) the GEMM1 tiles stored and the GEMM2 tiles that read
/// them, then the next work unit's ticket, the blocks done claiming and the blocks done
/// laying out the call's rows.
pub fn rank_counters_len(experts_here: u32) -> u64 {
    2 * u64::from(experts_here) + 3
}

/// Static shared memory of a rank's fused kernel (`compiler/templates/ep.cu`): per own
/// token its destinations (u64) and slot (i32), per destination its slots' tokens and
/// count, the segments' first rows, fill counts and two tile schedules, per source its
/// tokens and every pair's local expert, four i32/f32 per GEMM row, and the block's next
/// unit.
fn rank_static_smem_bytes(
    ranks: u32,
    experts_here: u32,
    top_k: u32,
    max_tokens: u32,
    max_rows: u32,
) -> u32 {
    let segments = experts_here * ranks;
    let sources = ranks + ranks * max_tokens * top_k;
    let ints =
        ranks * max_tokens + ranks + 4 * segments + 3 + max_tokens + sources + 4 * max_rows + 1;
    static_smem_reserved(8 * max_tokens + 4 * ints)
}

/// The sizes a rank's fused decode is planned from.
#[derive(Clone, Debug)]
pub struct RankFusedShape {
    pub ranks: u32,
    pub experts_per_rank: u32,
    /// Rows a source's first receive segment holds (its mailbox).
    pub segment_rows: u32,
    /// Rows of this rank's combine slots.
    pub combine_slot_rows: u64,
    /// SMs the kernel may fill on its device: all of them on a GPU of its own, the rank's
    /// share with virtual ranks (one block each, so that every rank's grid is resident).
    pub sms: u32,
    pub one_per_sm: bool,
}

impl RankFusedShape {
    /// The sizes of `ranks` ranks of `experts_per_rank` experts each, placed as `placement`
    /// says, whose receive segments hold `segment_rows` rows and whose results return by
    /// `combine_route`.
    pub fn new(
        target: &Target,
        shape: &LayerShape,
        ranks: u32,
        experts_per_rank: u32,
        segment_rows: u32,
        combine_route: CombineRoute,
        placement: Placement,
    ) -> Self {
        RankFusedShape {
            ranks,
            experts_per_rank,
            segment_rows,
            combine_slot_rows: match combine_route {
                CombineRoute::PairRows => shape.max_pairs(),
                CombineRoute::RankPartials => u64::from(shape.max_tokens) * u64::from(ranks),
            },
            sms: match placement {
                Placement::Virtual => target.sm_count / ranks,
                Placement::Devices => target.sm_count,
            },
            one_per_sm: placement == Placement::Virtual,
        }
    }

    /// The sizes of `ep`'s ranks.
    pub fn of(target: &Target, shape: &LayerShape, ep: &ExpertParallelPlan) -> Self {
        Self::new(
            target,
            shape,
            ep.ranks,
            ep.experts_per_rank,
            ep.rows_per_segment,
            ep.combine_route,
            ep.placement,
        )
    }
}

/// A rank's fused decode (`compiler/templates/ep.cu`, `ep_fused_decode`) of `regime` for
/// calls of up to `tokens` tokens per rank, where it can run: both GEMMs mma.sync with the
/// same threads, a call of the regime's within `tokens`, the call's mailboxes and rows
/// within the buffers, and the grid resident at once. Otherwise the reason it cannot.
pub fn plan_rank_fused_decode(
    target: &Target,
    shape: &LayerShape,
    rank: &RankFusedShape,
    regime: (&str, u32, u32),
    gemms: (&GemmPlan, &GemmPlan),
    kernel: &str,
    tokens: u32,
) -> Result<FusedDecode, String> {
    let (name, min_tokens, max_tokens) = regime;
    let (g1, g2) = gemms;
    // Any regime may fuse: the runtime runs the fused decode of the regime of the call's
    // largest rank call, on every rank.
    gemms_on_mma_sync(&format!("rank regime `{name}`"), g1, g2)?;
    let max_tokens = tokens.min(max_tokens).min(g1.threads());
    if max_tokens < min_tokens.max(1) {
        return Err("it would cover no call".into());
    }
    if rank.ranks > 64 {
        return Err(format!(
            "{} ranks: a token's destinations are a 64-bit mask",
            rank.ranks
        ));
    }
    if u64::from(max_tokens) * u64::from(shape.top_k) > u64::from(rank.segment_rows)
        || u64::from(max_tokens) * u64::from(shape.slots_per_token()) > rank.combine_slot_rows
    {
        return Err(format!(
            "calls of {max_tokens} tokens do not fit a source's first receive segment or the combine slots"
        ));
    }
    let experts_here = rank.experts_per_rank + shape.shared_slices;
    let max_rows = rank.ranks * max_tokens * shape.top_k.min(rank.experts_per_rank)
        + max_tokens * shape.shared_slices;
    let static_smem =
        rank_static_smem_bytes(rank.ranks, experts_here, shape.top_k, max_tokens, max_rows);
    let smem_bytes = g1.smem_bytes.max(g2.smem_bytes);
    let by_smem = target.smem_per_sm / (smem_bytes + static_smem + SMEM_RESERVED_PER_BLOCK);
    let blocks_per_sm = if rank.one_per_sm {
        1
    } else {
        g1.blocks_per_sm.min(g2.blocks_per_sm).min(by_smem)
    };
    if by_smem == 0 || smem_bytes + static_smem > target.smem_per_block {
        return Err(format!(
            "its {} B of shared memory per block (the larger ring, {max_rows} rows) do not fit {}",
            smem_bytes + static_smem,
            target.name
        ));
    }
    let (read, write, shared) = (KernelParam::read, KernelParam::write, KernelParam::shared);
    use BufferId::*;
    use LaunchArg::*;
    let params = input_and_weight_params(shape)
        .into_iter()
        .chain([
            read(TopkIds),
            read(TopkWeights),
            read(Tokens),
            read(Rank),
            read(Epoch),
            read(Workspace(PeerTable)),
            shared(Workspace(RecvX)),
            shared(Workspace(RecvCounts)),
            shared(Workspace(RecvPair)),
            shared(Workspace(RecvWeight)),
            shared(Workspace(MetaFlags)),
            shared(Workspace(ChunkFlags)),
            write(Workspace(ChunkPieces)),
            shared(Workspace(Credits)),
            write(Workspace(Intermediate)),
            shared(Workspace(CombineSlots)),
            write(Workspace(CombineCounters)),
            write(Workspace(RankFusedCounters)),
            write(Workspace(ErrorWord)),
            write(Y),
        ])
        .collect();
    Ok(FusedDecode {
        max_tokens,
        blocks_per_sm,
        max_rows,
        launch: Launch {
            kernel: kernel.to_string(),
            grid: Grid::Fixed(rank.sms * blocks_per_sm),
            block_threads: g1.threads(),
            smem_bytes,
            static_smem_bytes: static_smem,
            params,
            stream: StreamRole::Compute,
            early_start: false,
        },
    })
}
