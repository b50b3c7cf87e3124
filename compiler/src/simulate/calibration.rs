//! The simulator beside the bench: reads a bench result of the expert-parallel path
//! (`benches/results/*_ep2_uniform*.json`, written by `moeforge bench --gpus 2`) at run
//! time and predicts each of its cells. Most of the model's constants (`model.rs`) were
//! fitted to the stage and GEMM1/GEMM2 times of the 2026-11-30 files at commits 95bb336
//! and 22ac107 (benches/results/2026-11-30_simulator_calibration.md has every cell), the
//! dispatch rate and the metadata timing to the 2026-12-01 files at e323b9f: a few
//! constants for three layers and five token counts, so the fit is not by construction.
//! Against e323b9f the overlapped layer time comes within 15% on 13 of 15 cells
//! (benches/results/2026-12-01_ep2_at_e323b9f.md). Older files plan differently from the
//! current planner.

use std::path::Path;

use serde::Deserialize;

use super::{Options, Routing, Schedule, SimError, Topology, simulate};
use crate::plan::Plan;

/// One bench file, as far as the simulator reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredFile {
    pub layer: String,
    pub placement: String,
    pub routing: String,
    pub rows: Vec<MeasuredRow>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredRow {
    pub tokens_per_rank: u32,
    pub ranks: u32,
    pub expert_parallel_us: f64,
    pub bulk_synchronous_us: f64,
    pub stages: MeasuredStages,
    /// The GEMM stage's kernels on rank 0 (files from 2026-12-01 on).
    #[serde(default)]
    pub gemm_split: Option<MeasuredGemmSplit>,
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
    /// Bulk-synchronous layer time.
    pub bulk_synchronous: (f64, f64),
    /// Stage times of the bulk-synchronous run: dispatch, GEMMs, combine.
    pub dispatch: (f64, f64),
    pub gemm: (f64, f64),
    pub combine: (f64, f64),
    /// GEMM1 and GEMM2 of the bulk-synchronous run on rank 0, where the file has them.
    pub gemm1: Option<(f64, f64)>,
    pub gemm2: Option<(f64, f64)>,
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
    if measured.routing != "uniform" {
        return Err(SimError::Measured(format!(
            "the file's routing is `{}`; only uniform cells are compared",
            measured.routing
        )));
    }
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
                    routing: Routing::Uniform,
                    timeline_ranks: 1,
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
            Ok(Comparison {
                tokens_per_rank: row.tokens_per_rank,
                expert_parallel: (row.expert_parallel_us, fine.layer_s * us),
                bulk_synchronous: (row.bulk_synchronous_us, bulk.layer_s * us),
                dispatch: (row.stages.dispatch_us, bulk.dispatch_s * us),
                gemm: (row.stages.gemm_us, gemm_predicted * us),
                combine: (row.stages.combine_us, bulk.combine_s * us),
                gemm1: split(row.gemm_split.as_ref().map(|g| g.gemm1_us), "GEMM1"),
                gemm2: split(row.gemm_split.as_ref().map(|g| g.gemm2_us), "GEMM2"),
            })
        })
        .collect()
}
