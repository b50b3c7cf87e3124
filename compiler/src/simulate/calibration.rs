//! The simulator beside the bench: reads a bench result of the expert-parallel path
//! (`benches/results/*_ep2_uniform*.json` from `moeforge bench --gpus 2`, `*_ep2v_*` from
//! `--ranks 2`; uniform or balanced routing) at run time and predicts each of its cells,
//! with the layer planned as the bench ran it (virtual ranks or a GPU per rank, with or
//! without its shared experts as the file says). Most of the model's constants
//! (`model.rs`) were fitted to the stage and GEMM1/GEMM2 times of the 2026-11-30 files at
//! commits 95bb336 and 22ac107 (benches/results/2026-11-30_simulator_calibration.md has
//! every cell), the dispatch rate and the metadata timing to the 2026-12-01 files at
//! e323b9f, the local GEMM2 epilogue and the combine's rate per lane to virtual ranks
//! (2026-12-04): a few constants for three layers and five token counts, so the fit is not
//! by construction. On the freshest files (two virtual ranks of an H100, 203fd10,
//! 2026-12-07) the overlapped layer time comes within 15% on 15 of 16 cells of uniform and
//! balanced routing; GPT-OSS-120B at 4096 tokens per rank is 20% under on balanced routing
//! and 12-16% under on uniform: the whole tiles' rate is off per layer, and the part-empty
//! tiles' cost is not what `model::tile_cost` charges
//! (benches/results/2026-12-07_balanced_vs_uniform_ranks.md). A row the
//! bench ran as the ranks' fused decode (its `fused_decode`) is predicted as that kernel
//! (fitted to six cells: benches/results/2026-12-04_ep_fused_decode.md). Each rank's call
//! of a uniform file is routed as the bench drew it, from the file's seed
//! (`Routing::Benched`): at a few tokens per rank which experts a rank hits decides the
//! cell; a balanced file's as balanced routing sends it (`Routing::Balanced`). Older files
//! plan differently from the current planner; the decode cells of the plans since 48c8dac
//! are in benches/results/2026-12-04_ep_fused_decode_rings.md (15 of 18 within 15%). Since
//! 5a2c0d9 (2026-12-06) a rank's warp-specialised GEMMs claim their tiles in order, and the
//! simulator takes them so; the files of e323b9f and 6ebe978 measured them dealt by block
//! index, which ran slower where tiles wait on chunks: DeepSeek-V3 at 1024 tokens per rank
//! on two GPUs is predicted 17% under the e323b9f measurement (9% under, modelled dealt).

use std::path::Path;

use serde::Deserialize;

use super::{Options, Routing, Schedule, SimError, Topology, simulate};
use crate::plan::{Plan, Target};

/// One bench file, as far as the simulator reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredFile {
    pub layer: String,
    pub placement: String,
    /// Whether the ranks were virtual ranks on one GPU (`bench --ranks`); files before
    /// 2026-12-04 say so only in `placement`.
    #[serde(default)]
    pub virtual_ranks: Option<bool>,
    /// Whether the bench left the layer's shared experts out; files before 2026-12-04 do
    /// not say, and every expert-parallel bench since 2026-11-30 (59edc4e) did.
    #[serde(default)]
    pub shared_experts_left_out: Option<bool>,
    pub routing: String,
    /// The bench's seed, from which it drew every rank's call (files before 2026-11-30 may
    /// lack it: their cells get the simulator's own uniform draws).
    #[serde(default)]
    pub seed: Option<u64>,
    pub rows: Vec<MeasuredRow>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredRow {
    pub tokens_per_rank: u32,
    pub ranks: u32,
    pub expert_parallel_us: f64,
    /// Whether the expert-parallel call ran the ranks' fused decode (files before
    /// 2026-12-04, b964a21, ran the table).
    #[serde(default)]
    pub fused_decode: bool,
    pub bulk_synchronous_us: f64,
    pub stages: MeasuredStages,
    /// The GEMM stage's kernels on rank 0 (files from 2026-12-01 on).
    #[serde(default)]
    pub gemm_split: Option<MeasuredGemmSplit>,
    /// Every rank's GEMM1 in the same calls, by rank (files from 2026-12-05 on).
    #[serde(default)]
    pub gemm1_per_rank_us: Vec<f64>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredGemmSplit {
    pub gemm1_us: f64,
    pub gemm2_us: f64,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredStages {
    pub dispatch_us: f64,
    pub gemm_us: f64,
    pub combine_us: f64,
}

impl MeasuredFile {
    /// Whether the file's ranks shared one GPU.
    pub fn on_virtual_ranks(&self) -> bool {
        self.virtual_ranks
            .unwrap_or_else(|| self.placement.contains("virtual ranks"))
    }

    /// The known target of the GPU the file was measured on, as its `placement` names it
    /// (`2 virtual ranks on one NVIDIA H200`, `2 x NVIDIA H200`).
    pub fn measured_on(&self) -> Option<Target> {
        Target::known_for_device_name(&self.placement)
    }

    /// Whether the file's layer ran without its shared experts.
    pub fn without_shared_experts(&self) -> bool {
        self.shared_experts_left_out.unwrap_or(true)
    }

    pub fn read(path: &Path) -> Result<Self, SimError> {
        let text = std::fs::read_to_string(path).map_err(|error| {
            SimError::Measured(format!("cannot read {}: {error}", path.display()))
        })?;
        serde_json::from_str(&text)
            .map_err(|error| SimError::Measured(format!("{}: {error}", path.display())))
    }
}

/// A measured cell and the simulator's prediction of it, in microseconds.
#[derive(Clone, Debug)]
pub struct Comparison {
    pub tokens_per_rank: u32,
    /// Expert-parallel layer time: measured, predicted (the plan's own schedule, which on
    /// one node is the topology-aware one).
    pub expert_parallel: (f64, f64),
    /// Whether the measured call ran the ranks' fused decode (and so was predicted as
    /// one; the other columns are the table's, as the bench runs them).
    pub fused_decode: bool,
    /// Bulk-synchronous layer time.
    pub bulk_synchronous: (f64, f64),
    /// Stage times of the bulk-synchronous run: dispatch, GEMMs, combine.
    pub dispatch: (f64, f64),
    pub gemm: (f64, f64),
    pub combine: (f64, f64),
    /// GEMM1 and GEMM2 of the bulk-synchronous run on rank 0, where the file has them.
    pub gemm1: Option<(f64, f64)>,
    pub gemm2: Option<(f64, f64)>,
    /// GEMM1 of the rank whose GEMM1 is slowest (in the measurement and in the prediction,
    /// each its own), where the file times every rank's.
    pub gemm1_slowest: Option<(f64, f64)>,
}

/// Relative error of a prediction against a measurement.
pub fn error(pair: (f64, f64)) -> f64 {
    (pair.1 - pair.0) / pair.0
}

/// Predicts every cell of `measured` with `plan` (planned for the file's ranks) on
/// `topology`.
pub fn compare(
    plan: &Plan,
    topology: &Topology,
    measured: &MeasuredFile,
) -> Result<Vec<Comparison>, SimError> {
    let balanced = match measured.routing.as_str() {
        "uniform" => false,
        "balanced" => true,
        other => {
            return Err(SimError::Measured(format!(
                "the file's routing is `{other}`; only uniform and balanced cells are compared"
            )));
        }
    };
    let us = 1e6;
    measured
        .rows
        .iter()
        .map(|row| {
            let ranks = plan.expert_parallel.as_ref().map_or(1, |ep| ep.ranks);
            if row.ranks != ranks {
                return Err(SimError::RankMismatch {
                    plan: ranks,
                    topology: row.ranks,
                });
            }
            let report = simulate(
                plan,
                topology,
                &Options {
                    tokens_per_rank: row.tokens_per_rank,
                    routing: match (balanced, measured.seed) {
                        (true, _) => Routing::Balanced,
                        (false, Some(seed)) => Routing::Benched {
                            seed,
                            hidden: plan.shape.hidden,
                        },
                        (false, None) => Routing::Uniform,
                    },
                    timeline_ranks: ranks,
                    fused_decode: row.fused_decode,
                },
            )?;
            let of = |schedule: Schedule| report.schedules.iter().find(|s| s.schedule == schedule);
            let (Some(bulk), Some(fine)) = (
                of(Schedule::BulkSynchronous),
                of(Schedule::FineGrainedTopologyAware),
            ) else {
                return Err(SimError::Measured(format!(
                    "the plan deadlocks at {} tokens per rank",
                    row.tokens_per_rank
                )));
            };
            let gemm_predicted = bulk.layer_s - bulk.dispatch_s - bulk.combine_s;
            // Rank 0's kernel spans in the bulk-synchronous run.
            let kernel_s = |label: &str| {
                bulk.timeline
                    .first()
                    .and_then(|lane| lane.kernels.iter().find(|k| k.label == label))
                    .map(|k| k.end - k.start)
            };
            let split = |measured: Option<f64>, label: &str| {
                measured.zip(kernel_s(label)).map(|(m, p)| (m, p * us))
            };
            let slowest_gemm1 = bulk
                .timeline
                .iter()
                .flat_map(|lane| lane.kernels.iter().filter(|k| k.label == "GEMM1"))
                .map(|k| k.end - k.start)
                .reduce(f64::max);
            let measured_slowest = row.gemm1_per_rank_us.iter().copied().reduce(f64::max);
            Ok(Comparison {
                tokens_per_rank: row.tokens_per_rank,
                expert_parallel: (row.expert_parallel_us, fine.layer_s * us),
                fused_decode: row.fused_decode,
                bulk_synchronous: (row.bulk_synchronous_us, bulk.layer_s * us),
                dispatch: (row.stages.dispatch_us, bulk.dispatch_s * us),
                gemm: (row.stages.gemm_us, gemm_predicted * us),
                combine: (row.stages.combine_us, bulk.combine_s * us),
                gemm1: split(row.gemm_split.as_ref().map(|g| g.gemm1_us), "GEMM1"),
                gemm2: split(row.gemm_split.as_ref().map(|g| g.gemm2_us), "GEMM2"),
                gemm1_slowest: measured_slowest
                    .zip(slowest_gemm1)
                    .map(|(m, p)| (m, p * us)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(fields: &str) -> MeasuredFile {
        serde_json::from_str(&format!(
            r#"{{"layer": "l", "placement": "2 virtual ranks on one NVIDIA H200", "routing": "uniform", "rows": []{fields}}}"#
        ))
        .expect("parses")
    }

    /// Older files say where their ranks ran only in `placement`, and left the shared
    /// experts out without saying so; newer ones say both.
    #[test]
    fn a_file_says_where_its_ranks_ran_and_what_it_left_out() {
        let older = file("");
        assert!(older.on_virtual_ranks() && older.without_shared_experts());
        let newer = file(r#", "virtual_ranks": false, "shared_experts_left_out": false"#);
        assert!(!newer.on_virtual_ranks() && !newer.without_shared_experts());
        let mut devices = file("");
        devices.placement = "2 x NVIDIA H200".into();
        assert!(!devices.on_virtual_ranks());
        assert_eq!(devices.measured_on(), Some(Target::h200()));
        devices.placement = "4 virtual ranks on one NVIDIA H100 80GB HBM3".into();
        assert_eq!(devices.measured_on(), Some(Target::h100()));
        devices.placement = "2 x NVIDIA B300".into();
        assert_eq!(devices.measured_on(), None);
    }

    /// A file that times every rank's GEMM1 is compared on its slowest rank against the
    /// prediction's slowest; one without leaves that cell out.
    #[test]
    fn every_ranks_gemm1_is_compared_on_the_slowest() {
        let text = "topology t {\n gpus_per_node = 2\n nodes = 1\n nvlink = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}\nlayer l {\n hidden = 128\n ffn = 256\n experts = 8\n top_k = 2\n max_tokens = 512\n parallel { expert = 2 }\n topology = t\n}\n";
        let module = crate::compile_source("l.moe", text).expect("checks");
        let plan =
            crate::plan::plan(&module.layers[0], &crate::plan::Target::h200()).expect("plans");
        let topology = Topology::of(&module.layers[0].topology);
        let row = |extra: &str| {
            format!(
                r#"{{"tokens_per_rank": 64, "ranks": 2, "expert_parallel_us": 50.0, "bulk_synchronous_us": 60.0, "stages": {{"dispatch_us": 10.0, "gemm_us": 30.0, "combine_us": 5.0}}{extra}}}"#
            )
        };
        let measured = |extra: &str| -> MeasuredFile {
            serde_json::from_str(&format!(
                r#"{{"layer": "l", "placement": "2 x NVIDIA H200", "routing": "uniform", "rows": [{}]}}"#,
                row(extra)
            ))
            .expect("parses")
        };
        let with = compare(
            &plan,
            &topology,
            &measured(r#", "gemm1_per_rank_us": [7.0, 9.0]"#),
        )
        .expect("compares");
        let (slowest, predicted) = with[0].gemm1_slowest.expect("every rank's GEMM1");
        assert_eq!(slowest, 9.0);
        assert!(predicted > 0.0);
        let without = compare(&plan, &topology, &measured("")).expect("compares");
        assert!(without[0].gemm1_slowest.is_none());
    }
}
