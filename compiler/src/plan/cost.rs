//! The analytic cost model that picks tiles (documented in `docs/planner.md`).
//!
//! For a token count T it assumes uniform routing: `P = T·K` (token, expert) rows over E
//! experts, of which `E·(1 − (1 − 1/E)^P)` are hit. A tile plan then costs the larger of
//! - compute: waves of tiles over `SMs × blocks per SM`, each tile doing `2·BM·B_rows·Kd`
//!   FLOPs (padded rows included) at the SM's share of the engine's rate (`mma.sync` or
//!   wgmma, each a measured or assumed fraction of the peak); a stream-K call (few tiles,
//!   [`GemmPlan::runs_stream_k`]) has no partial last wave, loads on every block with a
//!   k-tile and pays [`STREAM_K_MEETING_S`] for its partial sums;
//! - memory: the bytes that must come from HBM (weights of hit experts once, activations in
//!   and out) over the bandwidth the grid can sustain, which is the lesser of HBM
//!   bandwidth and what its in-flight pipeline stages cover (Little's law, 1 µs latency);
//! - L2 traffic: every tile loads its A rows and B rows for the whole reduction, so small
//!   tiles re-read the weights once per m-tile and the activations once per n-tile (a
//!   cluster pair of m-tiles reads its weight rows once for both); those bytes over the
//!   L2-to-SM bandwidth;
//!
//! plus `IMPERFECT_OVERLAP` of the lesser of compute and memory, plus one launch. The
//! model ranks candidates; it does not promise times.

use serde::{Deserialize, Serialize};

use super::{GemmPlan, GemmProblem, MmaEngine, STREAM_K_MEETING_S, Target};

/// The share of the lesser of compute and memory time that does not hide under the
/// greater: a GEMM near the balance point runs slower than either alone. A lead fitted on
/// the H200 (2026-11-30): with 0 the model called Qwen3-30B-A3B's and DeepSeek-V3's GEMMs
/// at 1024 tokens memory-bound whatever the tile, and kept mma.sync tiles that ran 16-24%
/// slower than 64-row wgmma tiles.
const IMPERFECT_OVERLAP: f64 = 0.5;

/// Memory latency the pipeline stages must cover, seconds.
const MEMORY_LATENCY_S: f64 = 1e-6;

/// What the cost model predicts for one GEMM at one token count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GemmEstimate {
    pub tokens: u32,
    pub tiles: f64,
    pub waves: f64,
    pub compute_seconds: f64,
    pub memory_seconds: f64,
    pub l2_seconds: f64,
    pub seconds: f64,
}

/// Expected number of distinct experts hit by `pairs` uniform draws over `experts`.
pub fn expected_hit_experts(experts: u32, pairs: u64) -> f64 {
    let e = f64::from(experts);
    e * (1.0 - (1.0 - 1.0 / e).powf(pairs as f64))
}

/// The chance that an expert gets more than `rows` rows when its rows are Poisson around
/// `mean_rows` (uniform routing of many tokens over many experts); 1 where `mean_rows` is
/// too large for the sum (beyond about 700).
pub fn rows_beyond(mean_rows: f64, rows: u32) -> f64 {
    let mut term = (-mean_rows).exp();
    if term == 0.0 {
        return 1.0;
    }
    let mut at_most = term;
    for r in 1..=rows {
        term *= mean_rows / f64::from(r);
        at_most += term;
    }
    (1.0 - at_most).max(0.0)
}

/// The share of the wgmma rate a block with one consumer warpgroup (a 64-row tile)
/// reaches against two: alone, it leaves the tensor cores idle while it waits on a stage
/// or stores a tile. A lead: on the H200 (2026-11-30) 64-row tiles beat the cost model's
/// mma.sync picks by 16-24% at 1024 tokens (Qwen3-30B-A3B, DeepSeek-V3) and lost to
/// 128-row tiles by 24-42% at 4096.
const ONE_CONSUMER_WARPGROUP_SHARE: f64 = 0.85;

/// How close a wgmma of width `n` comes to the rate of the widest (256): each m64nNk16
/// reads 64 rows of A beside N rows of B from shared memory, so narrow widths spend more
/// shared-memory bandwidth per FLOP (at 64 the operands alone about fill it). The
/// FLOP-per-byte ratio `n / (n + 64)` relative to width 256's; a lead, not measured.
fn wgmma_width_efficiency(n: u32) -> f64 {
    let ratio = |n: f64| n / (n + 64.0);
    ratio(f64::from(n)) / ratio(256.0)
}

/// The work of one expert's tiles (`m_tiles` x `n_tiles`) in block slots: tiles a block
/// runs (a cluster pair's unit fills two slots, even where its second block has no rows)
/// and stage rows read from L2 (a pair of m-tiles shares one read of the weight rows).
struct ExpertWork {
    block_tiles: f64,
    l2_rows: f64,
}

impl ExpertWork {
    fn of(gemm: &GemmPlan, m_tiles: f64, n_tiles: f64) -> Self {
        Self::of_tiles(gemm.tile.m, gemm.b_rows, gemm.cluster, m_tiles, n_tiles)
    }

    fn of_tiles(bm: u32, b_rows: u32, cluster: u32, m_tiles: f64, n_tiles: f64) -> Self {
        let (bm, b_rows) = (f64::from(bm), f64::from(b_rows));
        if cluster == 1 {
            let tiles = m_tiles * n_tiles;
            return ExpertWork {
                block_tiles: tiles,
                l2_rows: tiles * (bm + b_rows),
            };
        }
        let paired = (m_tiles / 2.0).floor() * n_tiles;
        let split = (m_tiles % 2.0) * (n_tiles / 2.0).ceil();
        ExpertWork {
            block_tiles: 2.0 * (paired + split),
            l2_rows: paired * (2.0 * bm + b_rows) + split * 2.0 * (bm + b_rows),
        }
    }
}

pub fn estimate(
    target: &Target,
    problem: &GemmProblem,
    gemm: &GemmPlan,
    tokens: u32,
) -> GemmEstimate {
    let routed_pairs = u64::from(tokens) * u64::from(problem.top_k);
    let routed_hit = expected_hit_experts(problem.experts, routed_pairs).max(1.0);
    let rows_per_hit = routed_pairs as f64 / routed_hit;
    let m_tiles = (rows_per_hit / f64::from(gemm.tile.m)).ceil().max(1.0);
    // Every token is a row of each always-hit expert (the shared slices).
    let always = f64::from(problem.always_hit);
    let always_m_tiles = (f64::from(tokens) / f64::from(gemm.tile.m)).ceil().max(1.0);
    let n_tiles = f64::from(problem.n / gemm.tile.n);
    let routed = ExpertWork::of(gemm, m_tiles, n_tiles);
    let shared = ExpertWork::of(gemm, always_m_tiles, n_tiles);
    let tiles = routed_hit * routed.block_tiles + always * shared.block_tiles;
    let l2_rows = routed_hit * routed.l2_rows + always * shared.l2_rows;
    let hit = routed_hit + always;
    let pairs = routed_pairs + u64::from(tokens) * u64::from(problem.always_hit);

    let concurrent = f64::from(target.sm_count * gemm.blocks_per_sm);
    // Stream-K deals the call's k-tiles evenly over every block: no partial last wave, and
    // every block keeps its stages in flight. (Uniform routing: the hit experts' rows
    // taken as even.)
    let stream_k = gemm.runs_stream_k(tiles, rows_per_hit.ceil());
    let waves = if stream_k {
        tiles / concurrent
    } else {
        (tiles / concurrent).ceil()
    };
    let fraction = match gemm.engine {
        MmaEngine::MmaSync => target.mma_sync_fraction,
        MmaEngine::WgmmaWarpSpecialized => {
            let consumers = if gemm.tile.m >= 128 {
                1.0
            } else {
                ONE_CONSUMER_WARPGROUP_SHARE
            };
            target.wgmma_fraction * consumers * wgmma_width_efficiency(gemm.tile.n)
        }
    };
    let block_rate = target.peak_bf16_flops * fraction / concurrent;
    let tile_flops = 2.0 * f64::from(gemm.tile.m) * f64::from(gemm.b_rows) * f64::from(problem.k);
    let compute_seconds = waves * tile_flops / block_rate;

    let weight_bytes = hit * f64::from(problem.weight_rows()) * f64::from(problem.k) * 2.0;
    let activation_bytes = pairs as f64 * (f64::from(problem.k) + f64::from(problem.n)) * 2.0;
    let stage_bytes = f64::from((gemm.tile.m + gemm.b_rows) * gemm.tile.k * 2);
    let loading_blocks = if stream_k {
        // Every block with a k-tile of the call.
        concurrent.min(tiles * f64::from(problem.k.div_ceil(gemm.tile.k)))
    } else {
        concurrent.min(tiles)
    };
    let in_flight = loading_blocks * f64::from(gemm.stages - 1) * stage_bytes;
    let bandwidth = target.hbm_bytes_per_s.min(in_flight / MEMORY_LATENCY_S);
    let memory_seconds = (weight_bytes + activation_bytes) / bandwidth;
    let l2_seconds = l2_rows * f64::from(problem.k) * 2.0 / target.l2_bytes_per_s;

    GemmEstimate {
        tokens,
        tiles,
        waves,
        compute_seconds,
        memory_seconds,
        l2_seconds,
        seconds: compute_seconds.max(memory_seconds).max(l2_seconds)
            + IMPERFECT_OVERLAP * compute_seconds.min(memory_seconds)
            + target.launch_overhead_s
            + if stream_k { STREAM_K_MEETING_S } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::{ExpertWork, rows_beyond};

    #[test]
    fn rows_beyond_is_the_poisson_tail() {
        // 1 - P(X <= rows) for X ~ Poisson(mean), summed by hand elsewhere.
        for (mean, rows, tail) in [
            (8.0, 16, 0.003_718),
            (13.0, 16, 0.164_507),
            (16.0, 16, 0.434_038),
            (28.0, 32, 0.194_933),
        ] {
            let got = rows_beyond(mean, rows);
            assert!(
                (got - tail).abs() < 1e-5,
                "Poisson({mean}) past {rows}: {got}"
            );
        }
        assert_eq!(rows_beyond(0.0, 16), 0.0);
        assert_eq!(rows_beyond(800.0, 32), 1.0, "too large a mean for the sum");
    }

    #[test]
    fn a_block_alone_reads_each_tile_once() {
        let work = ExpertWork::of_tiles(128, 256, 1, 3.0, 4.0);
        assert_eq!(work.block_tiles, 12.0);
        assert_eq!(work.l2_rows, 12.0 * (128.0 + 256.0));
    }

    #[test]
    fn a_pair_shares_the_weight_rows_of_two_m_tiles() {
        // 4 m-tiles x 3 n-tiles: 6 units of two m-tiles, each reading its weights once.
        let work = ExpertWork::of_tiles(128, 256, 2, 4.0, 3.0);
        assert_eq!(work.block_tiles, 12.0);
        assert_eq!(work.l2_rows, 6.0 * (2.0 * 128.0 + 256.0));
        assert!(work.l2_rows < ExpertWork::of_tiles(128, 256, 1, 4.0, 3.0).l2_rows);
    }

    #[test]
    fn an_odd_last_m_tile_goes_two_n_tiles_at_a_time_with_an_empty_slot() {
        // 3 m-tiles x 3 n-tiles: 3 pair units, then the last m-tile's 3 n-tiles in 2 units
        // (the second block of the last has no rows): 10 slots for 9 tiles.
        let work = ExpertWork::of_tiles(128, 256, 2, 3.0, 3.0);
        assert_eq!(work.block_tiles, 10.0);
        assert_eq!(
            work.l2_rows,
            3.0 * (2.0 * 128.0 + 256.0) + 2.0 * 2.0 * (128.0 + 256.0)
        );
    }
}
