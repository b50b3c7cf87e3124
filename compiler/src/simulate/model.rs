//! The numbers the simulator runs on: rates and overheads, each named with where it comes
//! from. Constants are baked here (not read at run time) so that [`super::simulate`] stays a
//! pure function; `calibration.rs` prints the predictions beside the measurements they were
//! fitted against: benches/results/2026-11-30_*_ep2_uniform_at_95bb336.json and, at 4096
//! tokens per rank, 2026-11-30_{deepseek_v3,qwen3_30b_a3b}_ep2_uniform_t4096_at_22ac107.json
//! (the dispatch rate and the metadata timing are later, fitted to 2026-12-01 files: see
//! [`COMM_BLOCK_BYTES_PER_S`] and [`METADATA_S`]). The errors per cell after
//! the fit are in benches/results/2026-11-30_simulator_calibration.md, and against the
//! later measurements in 2026-12-01_simulator_vs_rank_partials.md and
//! 2026-12-01_ep2_at_e323b9f.md.

use crate::plan::ep::CombineRoute;
use crate::plan::{GemmPlan, MmaEngine, Target};

/// Bytes per second one communication block moves (gather a token row from HBM, store it
/// into the peer, fence at the end of each piece), below the link's own cap (the ports, at
/// [`NVLINK_STORE_EFFICIENCY`]). Fitted to the dispatch stages of the `*_long` regimes at
/// 4096 tokens per rank on two H200s (benches/results/2026-12-01_ep2_at_e323b9f/): 2, 4 and
/// 9 blocks (Mixtral-8x7B, DeepSeek-V3, Qwen3-30B-A3B) moved 31, 27 and 25 GB/s each, and
/// 1024 tokens of Mixtral on 2 blocks 28 GB/s each. The earlier fit, 14 GB/s, came from
/// dispatches of 16 and 24 blocks, where the link sets the pace; the planner still sizes
/// its regimes with that one (`plan::ep`'s `PLANNED_COMM_BLOCK_BYTES_PER_S`).
pub const COMM_BLOCK_BYTES_PER_S: f64 = 28.0e9;
/// From a call's start to its metadata flags (the route kernel: counts and receive index
/// at every destination, then one release each), for a block with few pairs: the route
/// kernel took 14.0, 17.5 and 18.4 us (DeepSeek-V3, Qwen3-30B-A3B, Mixtral-8x7B) at one
/// token per rank on two H200s (benches/results/2026-12-01_ep2_at_e323b9f/, rank 0's
/// split of the dispatch stage), a launch included.
pub const METADATA_S: f64 = 16e-6;
/// What the route kernel's busiest block adds per (token, k) pair it places: at 4096
/// tokens per rank it took 50.1, 26.8 and 44.5 us in the same files, its blocks placing
/// 8192, 4096 and 4096 pairs each (2.3 to 6.4 ns a pair; 4 between them).
pub const METADATA_PAIR_S: f64 = 4e-9;
/// From the metadata flags to the dispatch kernel's first copy: its launch behind the route
/// kernel and the split of the work. The dispatch kernel of a one-token call took 10.4 to
/// 10.9 us in the files above, for a copy of a few microseconds.
pub const DISPATCH_KERNEL_START_S: f64 = 8e-6;
/// The arrange kernel (its blocks lay out GEMM rows per local expert after every
/// source's metadata arrived), launch excluded: the bulk-synchronous GEMM stages of
/// benches/results/2026-11-30_*_ep2_uniform_at_95bb336.json time it at 11.3 to 13.7 us on
/// rank 0 from the barrier (16.7 once), a launch included; 12 less the target's 4.
pub const ARRANGE_S: f64 = 8e-6;
/// The ranks' fused decode: from its launch to its first row sent (each block first finds
/// its tokens' destinations, blocks 0..R-2 hand a peer their ids).
pub const FUSED_SEND_START_S: f64 = 3e-6;
/// The fused decode's layout, after the last source's ids arrived: staging them in shared
/// memory and placing the rows, a fixed part and a part per (token, k) pair of every
/// source (one warp places the rows).
pub const FUSED_LAYOUT_S: f64 = 8e-6;
pub const FUSED_LAYOUT_PAIR_S: f64 = 10e-9;
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
/// The combine (reduce) kernel's fixed part (launch and the counters' wait are in the
/// schedule). With [`COMBINE_TOKEN_BYTES_PER_S`] fitted to the combine stages (a barrier
/// included) of one and sixteen tokens per rank in the current EP2 files
/// (benches/results/2026-11-30_*_ep2_uniform_at_95bb336.json): 8.3, 9.1 and 19.4 us for
/// Mixtral, Qwen3 and DeepSeek-V3 at one token.
pub const COMBINE_FIXED_S: f64 = 2e-6;
/// One token lane (`COMBINE_THREADS` threads of a combine block) reduces one token (K slots
/// and the output row) at a time, at about this rate: a token's bytes at it are the floor
/// of a combine however few tokens there are, and a grid of `n` lanes moves at most `n`
/// times it. DeepSeek-V3's token (9 rows of 14 KB) takes 11 us longer than Mixtral's (3
/// rows of 8 KB) at one token per rank in the files above: about 10 GB/s. The same from the
/// other end: on two virtual ranks (one H200, 2026-12-04,
/// `2026-12-04_simulator_virtual_ranks.md`, a lane per block then) each rank's combine grid
/// was 50 lanes, and its partials' pass and reduce at 4096 tokens per rank moved 8, 11 and
/// 14 GB/s per lane (Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B).
pub const COMBINE_TOKEN_BYTES_PER_S: f64 = 10e9;
/// Share of the copy bandwidth the reduce reaches reading K slots and writing one row per
/// token: the combine stages from 1024 to 4096 tokens per rank in the files above grow by
/// 0.27 to 0.37 us per MB (DeepSeek-V3 to Mixtral), 0.75 of 4.3 TB/s between them.
pub const COMBINE_HBM_EFFICIENCY: f64 = 0.75;
/// Share of HBM bandwidth a GEMM's tiles reach together when bound by loading weights: the
/// mma.sync GEMM1 of the decode cells (1 to 128 tokens per rank) in the files above, every
/// local expert's weights read once, ran at 0.91 to 0.97 of 4.3 TB/s (DeepSeek-V3 at 16 and
/// 128, Mixtral at 16); the rest of those cells is [`TILE_OVERHEAD_S`].
pub const GEMM_HBM_EFFICIENCY: f64 = 0.95;
/// The fraction of the target's engine rate (`Target::mma_sync_fraction`,
/// `wgmma_fraction`) moeforge's expert-parallel GEMM tiles reach on one SM. The mma.sync
/// GEMMs of the measured cells are all bound by HBM, so its scale is the earlier fit
/// (2026-11-30_*_ep2_uniform.json) unchanged. The wgmma engine reaches the target's full
/// fraction (0.75 of peak per SM) with 128-row tiles and with 64-row ones alike: GEMM1 of
/// Mixtral at 4096 tokens per rank (7168 tiles of 128x256 on 130 SMs in 3445 us) and of
/// DeepSeek-V3 at 1024 (2944 tiles of 64x256 on 116 SMs in 2043 us) both give 0.72 to
/// 0.75; a least-squares fit of both GEMMs over the 14 cells from 16 tokens on gives 1.0.
pub const GEMM_MMA_SYNC_SCALE: f64 = 0.60;
pub const GEMM_WGMMA_SCALE: f64 = 1.0;
/// Per mma.sync tile, outside its main loop: the prologue filling the pipeline, the
/// epilogue and the tile bookkeeping (fitted with [`GEMM_HBM_EFFICIENCY`] to the decode
/// cells). The warp-specialised wgmma engine has none: its producer warp loads the next
/// tile's stages while the consumers finish the last, so loads and math overlap across
/// tiles; what it does not hide is [`GEMM2_EPILOGUE_BYTES_PER_S`].
pub const TILE_OVERHEAD_S: f64 = 3e-6;
/// Bytes per second one block's GEMM2 epilogue stores when half of its rows go to
/// another GPU: it scales each result row by its routing weight and scatters it to the
/// origin's combine slot, after its tile's main loop (not overlapped with it). Fitted to
/// GEMM2 of the files above (least squares with the constants above over the cells from 16
/// tokens on); decisive where GEMM2's depth is short: Qwen3-30B-A3B at 4096 tokens per rank
/// (ffn 768) took 571 us for about 2300 tiles of 128x256 on 123 SMs, 2.6 times its math.
/// 4.7 GB/s over 123 to 130 blocks is 600 GB/s, half of it remote: about NVLink's 365 GB/s
/// of SM stores. (Those kernels stored 4 bytes per lane; not measured across GPUs since
/// the 16-byte stores.)
pub const GEMM2_EPILOGUE_BYTES_PER_S: f64 = 4.7e9;
/// The same where every row stays on the device: rank partials (GEMM2 keeps its rows on
/// its rank), and every route on virtual ranks (the origin's combine slots are on the same
/// GPU). Fitted to GEMM2 on two virtual ranks at 1024 and 4096 tokens per rank (one H200,
/// 2026-12-04, the 16-byte stores: `2026-12-04_simulator_virtual_ranks.md`), Qwen3-30B-A3B
/// and DeepSeek-V3: 24, 48 and 96 GB/s leave −2 to +27%, −6 to +15% and −9 to +9%; the
/// 4-byte stores of 2026-11-30 had fitted 12 (two H200s, c1e28e0).
pub const GEMM2_LOCAL_EPILOGUE_BYTES_PER_S: f64 = 48e9;
/// Share of HBM bandwidth the rank partials' pass reaches, reading each received token's
/// rows and writing its partial (to the origin, over NVLink for another GPU's): fitted to
/// the combine stages of Qwen3-30B-A3B and DeepSeek-V3 at 4096 tokens per rank on two
/// H200s (c1e28e0, 2026-11-30: 121 and 436 µs; 0.45 and 0.40 each).
pub const PARTIALS_HBM_EFFICIENCY: f64 = 0.42;
/// The same where every rank is on one GPU (virtual ranks): the partials stay in the
/// device's memory and their releases are `.gpu`-scope. Fitted to the combine stages of
/// Qwen3-30B-A3B and DeepSeek-V3 at 1024 and 4096 tokens per rank on two virtual ranks (one
/// H200, 2026-12-04, the four-lane combine): 0.42, 0.6 and 0.75 leave +20 to +57%, −9 to
/// +21% and −23 to +4%.
pub const PARTIALS_HBM_EFFICIENCY_ONE_DEVICE: f64 = 0.6;

/// Seconds one block of `gemm` spends on a tile of reduction depth `depth`, whose expert's
/// weights are shared by `m_tiles` row tiles and whose rows by `n_tiles` column tiles (each
/// loads its share from HBM, the rest hits L2), when the GEMM has `tiles` tiles: the busy
/// blocks (the grid, or fewer when there are fewer tiles) share HBM evenly (an mma.sync
/// block loads at least at [`BLOCK_HBM_BYTES_PER_S`], the GEMM bounded by [`hbm_seconds`]
/// of all its bytes instead), and share the engines of the SMs they sit on: a block never
/// computes faster than one SM. The tile holds `rows` rows: an expert's last row tile is
/// partly empty. Its loads are a whole tile's (its stages pass through shared memory all
/// the same: one H100, 2026-12-05, every expert given exactly T·K/E rows ran GPT-OSS-120B at
/// 16384 tokens in 0.83 of the time of uniform routing, which adds 13% row tiles,
/// `benches/results/2026-12-05_tile_fill.md`); its multiplies are a whole tile's on the
/// mma.sync engine, but the warp-specialised engine's consumer warpgroups without rows skip
/// theirs (since 2f41ad9), so only the warpgroups with rows count: this took the two
/// virtual ranks' Qwen3-30B-A3B at 1024 tokens per rank from +20% to +12% of its
/// measurement (one H100, 7046353; `benches/results/2026-12-07_simulator_partial_tiles.md`).
/// Also the tile's share of HBM bytes, which [`hbm_seconds`] turns into the GEMM's floor
/// over all its tiles.
pub fn tile_cost(
    target: &Target,
    gemm: &GemmPlan,
    depth: u32,
    [m_tiles, n_tiles]: [u32; 2],
    tiles: u32,
    rows: u32,
) -> (f64, f64) {
    let concurrent = f64::from(gemm.grid_blocks.min(tiles).max(1));
    let (fraction, overhead) = match gemm.engine {
        MmaEngine::MmaSync => (
            target.mma_sync_fraction * GEMM_MMA_SYNC_SCALE,
            TILE_OVERHEAD_S,
        ),
        MmaEngine::WgmmaWarpSpecialized => (target.wgmma_fraction * GEMM_WGMMA_SCALE, 0.0),
    };
    let sharing = concurrent.max(f64::from(target.sm_count));
    let multiplied_rows = match gemm.engine {
        MmaEngine::MmaSync => gemm.tile.m,
        MmaEngine::WgmmaWarpSpecialized => rows
            .clamp(1, gemm.tile.m)
            .div_ceil(CONSUMER_ROWS)
            .saturating_mul(CONSUMER_ROWS)
            .min(gemm.tile.m),
    };
    let flops = 2.0 * f64::from(multiplied_rows) * f64::from(gemm.b_rows) * f64::from(depth);
    let compute = flops / (target.peak_bf16_flops * fraction / sharing);
    let a_bytes = f64::from(gemm.tile.m) * f64::from(depth) * 2.0 / f64::from(n_tiles.max(1));
    let b_bytes = f64::from(gemm.b_rows) * f64::from(depth) * 2.0 / f64::from(m_tiles.max(1));
    let share = target.hbm_bytes_per_s * GEMM_HBM_EFFICIENCY / concurrent;
    let rate = match gemm.engine {
        MmaEngine::MmaSync => BLOCK_HBM_BYTES_PER_S.max(share),
        MmaEngine::WgmmaWarpSpecialized => share,
    };
    let memory = (a_bytes + b_bytes) / rate;
    (compute.max(memory) + overhead, a_bytes + b_bytes)
}

/// Rows of a tile each consumer warpgroup of the warp-specialised engine multiplies
/// (`wgmma` m64: `warps_m` is the tile's rows over 16, a warpgroup four warps).
const CONSUMER_ROWS: u32 = 64;

/// Bytes per second one mma.sync GEMM block loads from HBM at most, however few blocks are
/// busy (its ring keeps about 90 KiB of loads in flight over about a microsecond). Its
/// tiles' loads are fluid: a block whose neighbours are done takes their share, and the
/// GEMM's floor is [`hbm_seconds`] of all its bytes. With a fixed share of HBM per block
/// instead, the last partial round of tiles ran as slowly as a full one: the decode cells
/// came out 13% (DeepSeek-V3) and 54% (Qwen3-30B-A3B) over the c1e28e0 measurements at
/// 128 tokens per rank, now +5% both. The wgmma engine keeps the fixed share: made fluid
/// too, its tiles at 1024 tokens per rank (nearer compute-bound, where loads and math
/// overlap less than `max` assumes) went from 0% to −16% for DeepSeek-V3.
pub const BLOCK_HBM_BYTES_PER_S: f64 = 100e9;

/// Seconds HBM needs for `bytes` at the GEMMs' share of it: no GEMM ends sooner after it
/// starts, however its tiles fall on its blocks.
pub fn hbm_seconds(target: &Target, bytes: f64) -> f64 {
    bytes / (target.hbm_bytes_per_s * GEMM_HBM_EFFICIENCY)
}

/// Seconds one block of GEMM2 spends storing the weighted result rows of a tile holding
/// `rows` rows after its main loop, into their origins' combine slots or (rank partials)
/// here (an mma.sync tile's is in its [`TILE_OVERHEAD_S`]); `one_device`: every rank on
/// one GPU (virtual ranks), so no row crosses a link. An expert's last row tile is partly
/// empty, and its epilogue stores only the rows it has (as [`tile_cost`] counts only the
/// multiplies of its warpgroups with rows).
pub fn gemm2_epilogue_seconds(
    gemm: &GemmPlan,
    route: CombineRoute,
    one_device: bool,
    rows: u32,
) -> f64 {
    let rate = match route {
        CombineRoute::PairRows if !one_device => GEMM2_EPILOGUE_BYTES_PER_S,
        CombineRoute::PairRows | CombineRoute::RankPartials => GEMM2_LOCAL_EPILOGUE_BYTES_PER_S,
    };
    match gemm.engine {
        MmaEngine::MmaSync => 0.0,
        MmaEngine::WgmmaWarpSpecialized => {
            f64::from(rows.min(gemm.tile.m)) * f64::from(gemm.b_rows) * 2.0 / rate
        }
    }
}

/// The combine kernel's token lanes and the rank's share of the device they run on;
/// `one_device`: every rank on that device (virtual ranks).
#[derive(Clone, Copy, Debug)]
pub struct CombineGrid<'a> {
    pub target: &'a Target,
    pub lanes: u32,
    pub one_device: bool,
}

/// Seconds of the reduce at an origin of `tokens` tokens of `hidden` columns, `slots`
/// rows summed each (its K slots, or its ranks' partials).
pub fn combine_seconds(grid: CombineGrid, tokens: u32, slots: u32, hidden: u32) -> f64 {
    reduce_seconds(
        grid,
        f64::from(tokens),
        f64::from(slots),
        hidden,
        COMBINE_HBM_EFFICIENCY,
    )
}

/// Seconds of a rank's rank-partials pass: its `rows` GEMM2 rows read and one partial row
/// written per received token, at the reduce's rates.
pub fn partials_seconds(grid: CombineGrid, tokens: u32, rows: u64, hidden: u32) -> f64 {
    let rows_per_token = rows as f64 / f64::from(tokens.max(1));
    reduce_seconds(
        grid,
        f64::from(tokens),
        rows_per_token,
        hidden,
        if grid.one_device {
            PARTIALS_HBM_EFFICIENCY_ONE_DEVICE
        } else {
            PARTIALS_HBM_EFFICIENCY
        },
    )
}

/// `tokens` rows written, each the sum of `rows_per_token` rows read, at `efficiency` of
/// HBM bandwidth or what the grid's lanes move, whichever is less.
fn reduce_seconds(
    grid: CombineGrid,
    tokens: f64,
    rows_per_token: f64,
    hidden: u32,
    efficiency: f64,
) -> f64 {
    let token_bytes = (rows_per_token + 1.0) * f64::from(hidden) * 2.0;
    let rate = (grid.target.hbm_bytes_per_s * efficiency)
        .min(f64::from(grid.lanes.max(1)) * COMBINE_TOKEN_BYTES_PER_S);
    COMBINE_FIXED_S + token_bytes / COMBINE_TOKEN_BYTES_PER_S + tokens * token_bytes / rate
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::plan;

    /// A partly empty tile of the warp-specialised engine multiplies only with its
    /// warpgroups that hold rows; its loads are a whole tile's; an mma.sync tile costs the
    /// same whatever its rows.
    #[test]
    fn a_partly_empty_tile_multiplies_only_its_warpgroups_rows() {
        let source = "topology one {\n gpus_per_node = 1\n nodes = 1\n intra_node = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}\nlayer l {\n hidden = 7168\n ffn = 2048\n experts = 16\n top_k = 2\n max_tokens = 16384\n topology = one\n}\n";
        let module = crate::compile_source("l.moe", source).expect("compiles");
        let target = Target::h200();
        let layer_plan = plan(&module.layers[0], &target).expect("plans");
        let wide = layer_plan
            .regimes
            .iter()
            .map(|r| &r.gemm1)
            .find(|g| g.engine == MmaEngine::WgmmaWarpSpecialized && g.tile.m == 128)
            .expect("a 128-row warp-specialised GEMM1");
        // Few tiles on many blocks: each tile has an SM's engines, and the multiply bounds it.
        let cost = |gemm: &GemmPlan, rows| tile_cost(&target, gemm, 7168, [1, 1], 1, rows);
        let (full, full_bytes) = cost(wide, 128);
        let (one_row, one_row_bytes) = cost(wide, 1);
        let (two_warpgroups, _) = cost(wide, 65);
        assert_eq!(full_bytes, one_row_bytes);
        assert!(
            (one_row / full - 0.5).abs() < 0.01,
            "{one_row} against {full}"
        );
        assert_eq!(two_warpgroups, full);
        let narrow = layer_plan
            .regimes
            .iter()
            .map(|r| &r.gemm1)
            .find(|g| g.engine == MmaEngine::MmaSync)
            .expect("an mma.sync GEMM1");
        assert_eq!(cost(narrow, 1), cost(narrow, narrow.tile.m));
    }

    /// A large reduce on a small grid is bound by its lanes, on a large one by HBM; a
    /// one-token reduce costs about the same on both.
    #[test]
    fn a_combine_moves_at_most_its_lanes_rate() {
        let target = Target::h200();
        let grid = |lanes| CombineGrid {
            target: &target,
            lanes,
            one_device: false,
        };
        let (small, large) = (grid(50), grid(464));
        let hbm_bound = 4096.0 * 9.0 * 2048.0 * 2.0 / (target.hbm_bytes_per_s * 0.75);
        let on_large = combine_seconds(large, 4096, 8, 2048);
        assert!(on_large < 1.1 * hbm_bound + 10e-6, "{on_large}");
        let on_small = combine_seconds(small, 4096, 8, 2048);
        let lanes_bound = 4096.0 * 9.0 * 2048.0 * 2.0 / (50.0 * COMBINE_TOKEN_BYTES_PER_S);
        assert!(on_small > lanes_bound, "{on_small} against {lanes_bound}");
        let one_token = |grid| combine_seconds(grid, 1, 8, 2048);
        assert!((one_token(small) - one_token(large)).abs() < 0.1e-6);
    }
}
