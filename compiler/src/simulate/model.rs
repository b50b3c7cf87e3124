//! The numbers the simulator runs on: rates and overheads, each named with where it comes
//! from. Constants are baked here (not read at run time) so that [`super::simulate`] stays a
//! pure function; `calibration.rs` prints the predictions beside the measurements they were
//! fitted against (benches/results/2026-11-30_*_ep2_uniform.json).

use crate::plan::{GemmPlan, MmaEngine, Target};

/// Bytes per second one communication block moves (gather a token row from HBM, store it
/// into the peer, fence at the end of each piece). Fitted to the dispatch stage times of
/// benches/results/2026-11-30_{deepseek_v3,mixtral_8x7b,qwen3_30b_a3b}_ep2_uniform.json
/// between T = 1024 and 4096 per rank: the extra time per extra row copied (to the peer and
/// into the rank's own receive buffer), times the plan's communication blocks (24, 16, 16),
/// over the row's bytes gives 13 to 14.5 GB/s per block for rows of 14, 8 and 4 KB alike.
pub const COMM_BLOCK_BYTES_PER_S: f64 = 14.0e9;
/// From a call's start to its first dispatch block copying: two launches, the metadata
/// kernel (counts and receive index at every destination) and its flags. The dispatch
/// stage of one token per rank took 41.4, 32.9 and 35.8 us in the same three files, of
/// which a few microseconds are the copy itself.
pub const DISPATCH_START_S: f64 = 30e-6;
/// The arrange kernel (one block lays out GEMM rows per local expert after every source's
/// metadata arrived). Not measured alone; a small share of the GEMM stage at T = 1.
pub const ARRANGE_S: f64 = 5e-6;
/// SM-driven stores reach this share of NVLink's declared bandwidth: 365 GB/s measured
/// with 132 blocks against the 450 GB/s of NVLink 4 (DESIGN.md, 2026-11-29).
pub const NVLINK_STORE_EFFICIENCY: f64 = 365.0 / 450.0;
/// Share of the network's declared bandwidth one transfer stream reaches. Not measured here
/// (no network on the machines): NCCL all-to-all reached 295 of 394 GB/s of the copy
/// engine over NVLink (DESIGN.md), the same share is assumed for the network.
pub const NETWORK_EFFICIENCY: f64 = 295.0 / 394.0;
/// Release on one GPU to acquire on another: 1.3 us measured one way (DESIGN.md).
pub const FLAG_LATENCY_DEVICES_S: f64 = 1.3e-6;
/// Release to acquire between two blocks of one GPU: 0.8 us measured (DESIGN.md).
pub const FLAG_LATENCY_ONE_GPU_S: f64 = 0.8e-6;
/// The combine (reduce) kernel's fixed part: the combine stage of one token per rank took
/// 16.1, 8.4 and 8.6 us (the three EP2 files above); launch and the wait for the counters.
pub const COMBINE_FIXED_S: f64 = 10e-6;
/// Share of the copy bandwidth the reduce reaches reading K slots and writing one row per
/// token: DeepSeek-V3's combine stage at 4096 tokens per rank took 169 us for 0.5 GB
/// (deepseek_v3_ep2 file above).
pub const COMBINE_HBM_EFFICIENCY: f64 = 0.7;
/// Share of HBM bandwidth a GEMM's tiles reach together when bound by loading weights;
/// tuned by hand with the three numbers below against the GEMM stage times of the EP2
/// files above, a compromise across the three models (`moeforge simulate --measured`
/// prints what is left: within 20% for DeepSeek-V3 and Mixtral from 16 tokens per rank,
/// up to 40% low for Qwen3-30B-A3B, whose small tiles the model makes too cheap).
pub const GEMM_HBM_EFFICIENCY: f64 = 0.80;
/// The fraction of the target's engine rate (`Target::mma_sync_fraction`,
/// `wgmma_fraction`) moeforge's expert-parallel GEMM tiles reach; tuned as above, mainly
/// on the compute-bound cells (1024 and 4096 tokens per rank).
pub const GEMM_MMA_SYNC_SCALE: f64 = 0.60;
pub const GEMM_WGMMA_SCALE: f64 = 0.75;
/// Per tile, outside its main loop: the prologue filling the pipeline, the epilogue and
/// the tile bookkeeping. Tuned with the three numbers above.
pub const TILE_OVERHEAD_S: f64 = 3.0e-6;

/// Seconds one block of `gemm` spends on a tile of reduction depth `depth`, whose expert's
/// weights are shared by `m_tiles` row tiles and whose rows by `n_tiles` column tiles (each
/// loads its share from HBM, the rest hits L2), when the GEMM has `tiles` tiles: the busy blocks (the grid, or fewer when there
/// are fewer tiles) share the SMs' engines and HBM evenly.
pub fn tile_seconds(
    target: &Target,
    gemm: &GemmPlan,
    depth: u32,
    [m_tiles, n_tiles]: [u32; 2],
    tiles: u32,
) -> f64 {
    let concurrent = f64::from(gemm.grid_blocks.min(tiles).max(1));
    let fraction = match gemm.engine {
        MmaEngine::MmaSync => target.mma_sync_fraction * GEMM_MMA_SYNC_SCALE,
        // As the planner's cost model: one warpgroup per SM leaves the tensor cores idle
        // half the time.
        MmaEngine::WgmmaWarpSpecialized => {
            let warpgroups = f64::from(gemm.blocks_per_sm * gemm.tile.m / 64);
            target.wgmma_fraction * GEMM_WGMMA_SCALE * (warpgroups / 2.0).min(1.0)
        }
    };
    let flops = 2.0 * f64::from(gemm.tile.m) * f64::from(gemm.b_rows) * f64::from(depth);
    let compute = flops / (target.peak_bf16_flops * fraction / concurrent);
    let a_bytes = f64::from(gemm.tile.m) * f64::from(depth) * 2.0 / f64::from(n_tiles.max(1));
    let b_bytes = f64::from(gemm.b_rows) * f64::from(depth) * 2.0 / f64::from(m_tiles.max(1));
    let memory = (a_bytes + b_bytes) / (target.hbm_bytes_per_s * GEMM_HBM_EFFICIENCY / concurrent);
    compute.max(memory) + TILE_OVERHEAD_S
}

/// Seconds of the reduce at an origin of `tokens` tokens of `hidden` columns, `top_k`
/// slots each.
pub fn combine_seconds(target: &Target, tokens: u32, top_k: u32, hidden: u32) -> f64 {
    let bytes = f64::from(tokens) * f64::from(top_k + 1) * f64::from(hidden) * 2.0;
    COMBINE_FIXED_S + bytes / (target.hbm_bytes_per_s * COMBINE_HBM_EFFICIENCY)
}
