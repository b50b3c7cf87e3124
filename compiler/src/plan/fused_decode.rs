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

use super::launch::{Grid, KernelParam, Launch, LaunchArg, StreamRole};
use super::{
    BufferId, GemmPlan, LayerShape, MmaEngine, Regime, RowLoad, Target, static_smem_reserved,
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
/// tile schedules (i32 [E' + 1] × 3, [E']), the call's rows (i32 [max_rows]) and the
/// block's next unit (i32).
fn static_smem_bytes(shape: &LayerShape, max_rows: u32) -> u32 {
    static_smem_reserved(4 * (4 * shape.gemm_experts() + 4 + max_rows))
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
    if regime.min_tokens != 0 {
        return Err(format!("regime `{}` is not the first", regime.name));
    }
    if g1.engine != MmaEngine::MmaSync || g2.engine != MmaEngine::MmaSync {
        return Err(format!(
            "regime `{}` runs its GEMMs on {} and {}; the fused decode needs mma.sync for both",
            regime.name,
            g1.engine.name(),
            g2.engine.name()
        ));
    }
    if g1.threads() != g2.threads() {
        return Err(format!(
            "regime `{}`'s GEMMs differ in threads per block ({} and {})",
            regime.name,
            g1.threads(),
            g2.threads()
        ));
    }
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
    let static_smem = static_smem_bytes(shape, max_rows);
    let smem_bytes = g1.smem_bytes.max(g2.smem_bytes);
    // Each resident block also costs the 1 KiB the driver reserves per block.
    let by_smem = target.smem_per_sm / (smem_bytes + static_smem + 1024);
    let blocks_per_sm = g1.blocks_per_sm.min(g2.blocks_per_sm).min(by_smem);
    if blocks_per_sm == 0 || smem_bytes + static_smem > target.smem_per_block {
        return Err(format!(
            "its {} B of shared memory per block (the larger ring, {max_rows} routing rows) do not fit {}",
            smem_bytes + static_smem,
            target.name
        ));
    }
    let (read, write) = (KernelParam::read, KernelParam::write);
    let bias = |arg| shape.expert_bias.then(|| read(arg));
    use BufferId::*;
    use LaunchArg::*;
    let params = [
        Some(read(X)),
        Some(read(W1)),
        bias(W1Bias),
        Some(read(W2)),
        bias(W2Bias),
    ]
    .into_iter()
    .flatten()
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
