//! Measured GEMM choices: what `moeforge tune` timed fastest on a GPU, per (GPU, layer
//! shape, regime), and how the planner takes them in place of the cost model's.
//!
//! A [`TuningTable`] is data, read from JSON (the user's cache, or entries shipped in the
//! repository). An entry names the regime by its token range as the cost model drew it, or
//! a part of it: where different GEMMs won a regime's small and large calls, the tuner
//! splits it, and entries that tile a regime from its first token count to its last cut it
//! into as many regimes ([`TuningTable::tiling`]). A planner whose model draws other
//! regimes finds no entry for them and falls back to the model, so a stale table can make a
//! plan slower than tuned but never wrong. Schedule hints in the spec win over the table.

use serde::{Deserialize, Serialize};

use super::{
    GemmKind, GemmPlan, GemmProblem, LayerShape, MmaEngine, Target, TileShape, as_cluster_pair,
    cost, costed_candidates, deep_stages_of, ranking_seconds, shape_gemm,
};
use crate::ir::Activation;

/// Where a GEMM's configuration came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceSource {
    /// The cost model's best candidate.
    #[default]
    CostModel,
    /// The spec's schedule hints (`gemm1.tile`, `gemm2.tile`).
    Hint,
    /// An entry of the tuning table: measured fastest on this GPU.
    Tuned,
    /// The cost model's best pair on mma.sync, which a rank's fused decode needs where its
    /// unrestricted best is not (`plan::with_rank_fused_decode_regime`).
    FusedDecode,
}

/// Measured winners, newest last; [`TuningTable::lookup`] takes the last entry that matches.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TuningTable {
    pub entries: Vec<TunedRegime>,
}

/// One regime's measured GEMM configurations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedRegime {
    /// The GPU's name as the target gives it (`Target::name`).
    pub gpu: String,
    pub shape: TunedShape,
    /// The regime's token range as the cost model drew it, or the part of it this entry
    /// holds where the tuner split it.
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// Each GEMM's measured winner; `None` where the tuned spec hinted that GEMM, which
    /// was then not compared (the cost model's choice stands for it).
    pub gemm1: Option<TunedGemm>,
    pub gemm2: Option<TunedGemm>,
    /// The token counts the candidates were timed at, and the layer's summed time there in
    /// µs with these GEMMs and with the cost model's.
    pub timed_tokens: Vec<u32>,
    pub measured_us: f64,
    pub model_choice_us: f64,
    /// Whether those calls routed themselves (the spec has a router: `moeforge tune` since
    /// 2026-12-05, unless `--caller-routed`) rather than running on uniform routing passed
    /// in (entries written before, which have no such field, and caller-routed tunes).
    #[serde(default)]
    pub self_routed: bool,
    /// When and by which build it was measured (`moeforge --version`, commit).
    pub measured_on: String,
    pub measured_by: String,
}

/// What of a layer decides its GEMM problems: an entry applies to layers equal in these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunedShape {
    pub hidden: u32,
    pub ffn: u32,
    pub experts: u32,
    pub top_k: u32,
    pub activation: Activation,
    pub expert_bias: bool,
    pub shared_slices: u32,
    pub max_tokens: u32,
}

impl TunedShape {
    pub fn of(shape: &LayerShape) -> Self {
        TunedShape {
            hidden: shape.hidden,
            ffn: shape.ffn,
            experts: shape.experts,
            top_k: shape.top_k,
            activation: shape.activation,
            expert_bias: shape.expert_bias,
            shared_slices: shape.shared_slices,
            max_tokens: shape.max_tokens,
        }
    }
}

/// One GEMM's configuration as the table keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunedGemm {
    pub engine: MmaEngine,
    pub tile: TileShape,
    pub stages: u32,
    /// Blocks per cluster: 1, or 2 for a pair that multicasts the weight panel.
    pub cluster: u32,
}

impl TunedGemm {
    pub fn of(gemm: &GemmPlan) -> Self {
        TunedGemm {
            engine: gemm.engine,
            tile: gemm.tile,
            stages: gemm.stages,
            cluster: gemm.cluster,
        }
    }

    /// `wgmma-ws 128x256x64, 4 stages, pairs`.
    pub fn describe(&self) -> String {
        format!(
            "{} {}x{}x{}, {} stages{}",
            self.engine.name(),
            self.tile.m,
            self.tile.n,
            self.tile.k,
            self.stages,
            if self.cluster > 1 { ", pairs" } else { "" }
        )
    }
}

impl TunedRegime {
    /// Whether this entry is for that GPU, shape and regime.
    fn is_for(&self, gpu: &str, shape: &TunedShape, min_tokens: u32, max_tokens: u32) -> bool {
        self.gpu == gpu
            && self.shape == *shape
            && self.min_tokens == min_tokens
            && self.max_tokens == max_tokens
    }
}

impl TuningTable {
    /// The entry for this GPU, shape and regime, if any.
    pub fn lookup(
        &self,
        target: &Target,
        shape: &LayerShape,
        min_tokens: u32,
        max_tokens: u32,
    ) -> Option<&TunedRegime> {
        let key = TunedShape::of(shape);
        self.entries
            .iter()
            .rev()
            .find(|e| e.is_for(&target.name, &key, min_tokens, max_tokens))
    }

    /// The entries planning takes for the regime `min_tokens..=max_tokens` of `shape` on
    /// `target`: the one entry of exactly that regime, else the entries that tile it (in
    /// order, each starting one past where the last ended, from its first token count to
    /// its last: the tuner cut it), else none.
    pub fn tiling(
        &self,
        target: &Target,
        shape: &LayerShape,
        min_tokens: u32,
        max_tokens: u32,
    ) -> Vec<&TunedRegime> {
        if let Some(entry) = self.lookup(target, shape, min_tokens, max_tokens) {
            return vec![entry];
        }
        let key = TunedShape::of(shape);
        let mut parts: Vec<&TunedRegime> = self
            .entries
            .iter()
            .filter(|e| {
                e.gpu == target.name
                    && e.shape == key
                    && min_tokens <= e.min_tokens
                    && e.max_tokens <= max_tokens
            })
            .collect();
        parts.sort_by_key(|e| e.min_tokens);
        let mut next = u64::from(min_tokens);
        for part in &parts {
            if u64::from(part.min_tokens) != next || part.max_tokens < part.min_tokens {
                return Vec::new();
            }
            next = u64::from(part.max_tokens) + 1;
        }
        if parts.len() >= 2 && next == u64::from(max_tokens) + 1 {
            parts
        } else {
            Vec::new()
        }
    }

    /// Adds `entry`, dropping every earlier one for the same GPU and shape whose tokens
    /// overlap its regime: where the cost model has moved a regime's boundary, the entries
    /// of the old regimes can no longer be looked up and would only linger.
    pub fn record(&mut self, entry: TunedRegime) {
        self.entries.retain(|e| {
            e.gpu != entry.gpu
                || e.shape != entry.shape
                || e.max_tokens < entry.min_tokens
                || entry.max_tokens < e.min_tokens
        });
        self.entries.push(entry);
    }

    /// This table's entries, then `newer`'s (which win where both have one).
    pub fn merged_with(mut self, newer: &TuningTable) -> TuningTable {
        for entry in &newer.entries {
            self.record(entry.clone());
        }
        self
    }
}

/// `tuned` completed into a plan for `problem` on `target` at `tokens`, or why it cannot
/// be (a table written for another build may name a tile this one refuses).
pub(crate) fn tuned_gemm(
    target: &Target,
    problem: &GemmProblem,
    tuned: &TunedGemm,
    tokens: u32,
) -> Result<GemmPlan, String> {
    let single = shape_gemm(target, problem, tuned.engine, tuned.tile, tuned.stages)?;
    let mut gemm = match tuned.cluster {
        1 => single,
        _ => as_cluster_pair(problem, &single)
            .filter(|pair| pair.cluster == tuned.cluster)
            .ok_or_else(|| format!("{} cannot run as a cluster pair", tuned.describe()))?,
    };
    gemm.estimate = cost::estimate(target, problem, &gemm, tokens);
    gemm.source = ChoiceSource::Tuned;
    Ok(gemm)
}

/// The `count` configurations the cost model ranks best for `problem` at `tokens`, best
/// first, each a distinct (engine, tile, cluster) at its best ring depth, each mma.sync
/// tile of [`TILE_K`](super::TILE_K)-deep stages followed by the same tile with 128-deep
/// ones (the model cannot tell the depths apart; measured, they differ by a few percent
/// either way, and the planner applies the deeper stages only to a regime's final choice):
/// the candidates `moeforge tune` times, up to `2 · count` of them.
pub fn ranked_candidates(
    target: &Target,
    problem: &GemmProblem,
    tokens: u32,
    count: usize,
) -> Vec<GemmPlan> {
    let mut ranked: Vec<GemmPlan> = costed_candidates(target, problem, tokens, None)
        .filter_map(Result::ok)
        .collect();
    ranked.sort_by(|a, b| ranking_seconds(a).total_cmp(&ranking_seconds(b)));
    // Tiles that differ only in ring depth are near neighbours; keep the best ring of each
    // (engine, tile, cluster) so the candidates differ in shape.
    let mut kept: Vec<GemmPlan> = Vec::new();
    for gemm in ranked {
        let seen = kept.iter().any(|k| same_shape(k, &gemm));
        if !seen {
            kept.push(gemm);
        }
        if kept.len() == count {
            break;
        }
    }
    kept.into_iter()
        .flat_map(|gemm| {
            let deep = deep_stages_of(target, problem, &gemm, tokens);
            std::iter::once(gemm).chain(deep)
        })
        .collect()
}

/// Whether two configurations have the same engine, tile and cluster (ring depth aside).
pub fn same_shape(a: &GemmPlan, b: &GemmPlan) -> bool {
    a.engine == b.engine && a.tile == b.tile && a.cluster == b.cluster
}

/// Whether two configurations have the same engine, output tile (rows × columns) and
/// cluster: the same shape but for the depth of their stages.
pub fn same_output_tile(a: &GemmPlan, b: &GemmPlan) -> bool {
    a.engine == b.engine && a.tile.m == b.tile.m && a.tile.n == b.tile.n && a.cluster == b.cluster
}

/// The GEMM problem of `kind` for a single-GPU plan of `shape`.
pub fn single_gpu_problem(shape: &LayerShape, kind: GemmKind) -> GemmProblem {
    GemmProblem::for_layer(shape, kind, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{DEEP_TILE_K, TILE_K, Target};

    fn shape() -> LayerShape {
        LayerShape {
            hidden: 1024,
            ffn: 512,
            experts: 8,
            top_k: 2,
            activation: Activation::Swiglu,
            expert_bias: false,
            max_tokens: 4096,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    fn entry(min: u32, max: u32, m: u32) -> TunedRegime {
        let gemm = TunedGemm {
            engine: MmaEngine::MmaSync,
            tile: TileShape { m, n: 64, k: 64 },
            stages: 4,
            cluster: 1,
        };
        TunedRegime {
            gpu: Target::h200().name,
            shape: TunedShape::of(&shape()),
            min_tokens: min,
            max_tokens: max,
            gemm1: Some(gemm),
            gemm2: Some(gemm),
            timed_tokens: vec![max],
            measured_us: 1.0,
            model_choice_us: 2.0,
            self_routed: false,
            measured_on: "2026-11-30".into(),
            measured_by: "test".into(),
        }
    }

    #[test]
    fn lookup_matches_gpu_shape_and_regime_exactly() {
        let table = TuningTable {
            entries: vec![entry(0, 128, 16), entry(129, 4096, 64)],
        };
        let h200 = Target::h200();
        assert_eq!(
            table
                .lookup(&h200, &shape(), 0, 128)
                .and_then(|e| e.gemm1)
                .map(|g| g.tile.m),
            Some(16)
        );
        assert!(table.lookup(&h200, &shape(), 0, 256).is_none());
        assert!(table.lookup(&Target::h100(), &shape(), 0, 128).is_none());
        let other = LayerShape {
            hidden: 2048,
            ..shape()
        };
        assert!(table.lookup(&h200, &other, 0, 128).is_none());
    }

    #[test]
    fn entries_that_tile_a_regime_split_it_and_no_others_do() {
        let h200 = Target::h200();
        let bounds = |parts: Vec<&TunedRegime>| -> Vec<(u32, u32)> {
            parts.iter().map(|e| (e.min_tokens, e.max_tokens)).collect()
        };
        // Out of order in the table, in order in the tiling.
        let split = TuningTable {
            entries: vec![entry(600, 4096, 128), entry(129, 599, 64)],
        };
        assert_eq!(
            bounds(split.tiling(&h200, &shape(), 129, 4096)),
            [(129, 599), (600, 4096)]
        );
        // An entry of exactly the regime is the regime's, as `lookup` finds it.
        let exact = TuningTable {
            entries: vec![entry(129, 4096, 64)],
        };
        assert_eq!(
            bounds(exact.tiling(&h200, &shape(), 129, 4096)),
            [(129, 4096)]
        );
        // A gap, a part beyond the regime, another GPU: no tiling.
        for entries in [
            vec![entry(129, 500, 64), entry(600, 4096, 128)],
            vec![entry(129, 599, 64), entry(600, 8192, 128)],
            vec![entry(129, 599, 64)],
        ] {
            let table = TuningTable { entries };
            assert!(
                table.tiling(&h200, &shape(), 129, 4096).is_empty(),
                "{table:?}"
            );
        }
        assert!(
            split
                .tiling(&Target::h100(), &shape(), 129, 4096)
                .is_empty()
        );
        // Parts that do not start at the regime's first count (a regime drawn differently).
        assert!(split.tiling(&h200, &shape(), 0, 4096).is_empty());
    }

    #[test]
    fn recording_replaces_the_same_regime_and_merging_prefers_the_newer_table() {
        let mut table = TuningTable::default();
        table.record(entry(0, 128, 16));
        table.record(entry(0, 128, 32));
        assert_eq!(table.entries.len(), 1);
        assert_eq!(table.entries[0].gemm1.map(|g| g.tile.m), Some(32));
        // A regime whose boundary moved replaces the entries it overlaps.
        let mut moved = TuningTable {
            entries: vec![
                entry(0, 128, 16),
                entry(129, 4096, 64),
                entry(4097, 8192, 64),
            ],
        };
        moved.record(entry(0, 256, 32));
        let ranges: Vec<(u32, u32)> = moved
            .entries
            .iter()
            .map(|e| (e.min_tokens, e.max_tokens))
            .collect();
        assert_eq!(ranges, [(4097, 8192), (0, 256)]);
        let shipped = TuningTable {
            entries: vec![entry(0, 128, 16), entry(129, 4096, 64)],
        };
        let merged = shipped.merged_with(&table);
        let h200 = Target::h200();
        assert_eq!(merged.entries.len(), 2);
        assert_eq!(
            merged
                .lookup(&h200, &shape(), 0, 128)
                .and_then(|e| e.gemm1)
                .map(|g| g.tile.m),
            Some(32)
        );
    }

    #[test]
    fn ranked_candidates_are_distinct_shapes_best_first() {
        let target = Target::h200();
        let problem = single_gpu_problem(&shape(), GemmKind::Up);
        let candidates = ranked_candidates(&target, &problem, 1024, 4);
        let shallow: Vec<&GemmPlan> = candidates.iter().filter(|g| g.tile.k == TILE_K).collect();
        assert_eq!(shallow.len(), 4);
        for pair in shallow.windows(2) {
            assert!(ranking_seconds(pair[0]) <= ranking_seconds(pair[1]));
        }
        for (i, a) in candidates.iter().enumerate() {
            assert!(candidates[i + 1..].iter().all(|b| !same_shape(a, b)));
        }
    }

    #[test]
    fn each_mma_sync_candidate_is_followed_by_its_deep_stages() {
        let target = Target::h200();
        let problem = single_gpu_problem(&shape(), GemmKind::Down);
        // Few tokens: the cost model ranks mma.sync tiles first.
        let candidates = ranked_candidates(&target, &problem, 1, 3);
        assert!(candidates.len() > 3, "{}", candidates.len());
        for (i, gemm) in candidates.iter().enumerate() {
            let deep = gemm.tile.k == DEEP_TILE_K;
            assert_eq!(deep, i > 0 && same_output_tile(&candidates[i - 1], gemm));
            if gemm.engine == MmaEngine::MmaSync && !deep {
                let next = candidates.get(i + 1).expect("a deep twin follows");
                assert!(same_output_tile(gemm, next) && next.tile.k == DEEP_TILE_K);
            }
        }
    }

    #[test]
    fn a_tuned_gemm_the_build_refuses_is_an_error_not_a_plan() {
        let target = Target::h200();
        let problem = single_gpu_problem(&shape(), GemmKind::Down);
        let bad = TunedGemm {
            engine: MmaEngine::WgmmaWarpSpecialized,
            tile: TileShape {
                m: 96,
                n: 64,
                k: 64,
            },
            stages: 4,
            cluster: 1,
        };
        assert!(tuned_gemm(&target, &problem, &bad, 128).is_err());
        let good = TunedGemm {
            tile: TileShape {
                m: 64,
                n: 64,
                k: 64,
            },
            ..bad
        };
        let gemm = tuned_gemm(&target, &problem, &good, 128).expect("a plannable tile");
        assert_eq!(gemm.source, ChoiceSource::Tuned);
        assert_eq!(gemm.tile.m, 64);
    }
}
