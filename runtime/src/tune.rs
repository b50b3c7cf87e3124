//! `moeforge tune`: times the cost model's best GEMM configurations of each single-GPU
//! regime on the GPU and keeps the fastest as a [`TuningTable`] entry.
//!
//! Per regime, GEMM1's candidates are timed first (GEMM2 at the model's choice), then
//! GEMM2's (GEMM1 at the winner): 2·N layers built instead of N², each a whole layer timed
//! on whole calls, so a candidate's launch, ramp and tail count as they will in use. A
//! candidate is the plan of the layer with one tuning entry naming it, so what is timed is
//! exactly what the planner will build from the entry. GEMMs the spec hints are left as
//! hinted.

use moeforge_compiler::ir::Layer;
use moeforge_compiler::plan::tuning::{
    ChoiceSource, TunedGemm, TunedRegime, TunedShape, TuningTable, ranked_candidates,
    single_gpu_problem,
};
use moeforge_compiler::plan::{self, GemmKind, GemmPlan, Plan, PlanError, Target};

use crate::bench::{BenchError, time_calls, uploaded_inputs};
use crate::harness::Session;
use crate::workload::Routing;

/// How `tune_layer` measures.
#[derive(Clone, Copy, Debug)]
pub struct TuneSettings {
    /// Candidates per GEMM (the cost model's best distinct tiles, its own choice first).
    pub candidates: usize,
    /// Timed calls per token count (after warm-up), median.
    pub iterations: usize,
    pub seed: u64,
}

/// One timed candidate, for progress output.
#[derive(Clone, Debug)]
pub struct CandidateTiming {
    pub regime: String,
    pub gemm: GemmKind,
    /// 1-based position among this GEMM's candidates, and their count.
    pub index: usize,
    pub of: usize,
    pub config: TunedGemm,
    /// The layer's time summed over the regime's timed token counts, µs.
    pub us: f64,
    pub is_model_choice: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(transparent)]
    Plan(Box<PlanError>),
    #[error(transparent)]
    Bench(Box<BenchError>),
    #[error("regime `{regime}` of `{layer}`: {reason}")]
    Candidate {
        layer: String,
        regime: String,
        reason: String,
    },
}

impl From<PlanError> for TuneError {
    fn from(e: PlanError) -> Self {
        TuneError::Plan(Box::new(e))
    }
}

impl From<BenchError> for TuneError {
    fn from(e: BenchError) -> Self {
        TuneError::Bench(Box::new(e))
    }
}

impl From<crate::harness::HarnessError> for TuneError {
    fn from(e: crate::harness::HarnessError) -> Self {
        TuneError::Bench(Box::new(e.into()))
    }
}

/// The token counts a regime is timed at: its largest call and the geometric middle of
/// its range (at least 1 token), so that a configuration fast only at one end does not win.
pub fn timed_tokens(min_tokens: u32, max_tokens: u32) -> Vec<u32> {
    let low = min_tokens.max(1);
    let middle = ((f64::from(low) * f64::from(max_tokens)).sqrt().round() as u32).max(low);
    let mut tokens = vec![middle, max_tokens];
    tokens.dedup();
    tokens
}

/// Tunes every single-GPU regime of `layer` on `session`'s GPU (planned for `target`,
/// which must be that GPU's): one entry per regime. `measured_by` names the build.
pub fn tune_layer(
    session: &Session,
    layer: &Layer,
    target: &Target,
    settings: TuneSettings,
    measured_on: &str,
    measured_by: &str,
    mut progress: impl FnMut(&CandidateTiming),
) -> Result<Vec<TunedRegime>, TuneError> {
    let model = plan::plan(layer, target)?;
    let shape = model.shape.clone();
    let hints = &layer.schedule;
    let mut entries = Vec::new();
    for (index, regime) in model.regimes.iter().enumerate() {
        let tokens = timed_tokens(regime.min_tokens, regime.max_tokens);
        let entry_with = |gemm1: &GemmPlan, gemm2: &GemmPlan| TunedRegime {
            gpu: target.name.clone(),
            shape: TunedShape::of(&shape),
            min_tokens: regime.min_tokens,
            max_tokens: regime.max_tokens,
            gemm1: TunedGemm::of(gemm1),
            gemm2: TunedGemm::of(gemm2),
            timed_tokens: tokens.clone(),
            measured_us: 0.0,
            model_choice_us: 0.0,
            measured_on: measured_on.to_string(),
            measured_by: measured_by.to_string(),
        };
        // Times the layer planned with `entry` for this regime.
        let time = |entry: TunedRegime| -> Result<f64, TuneError> {
            let table = TuningTable {
                entries: vec![entry],
            };
            let candidate = plan::plan_tuned(layer, target, &table)?;
            check_applied(&candidate, index, layer)?;
            time_regime(session, candidate, &tokens, settings)
        };
        let mut gemm1 = regime.gemm1.clone();
        let mut gemm2 = regime.gemm2.clone();
        let mut model_us = None;
        // The time of (gemm1, gemm2) as they stand after the last GEMM tuned.
        let mut chosen_us = None;
        for kind in [GemmKind::Up, GemmKind::Down] {
            let (chosen, hinted) = match kind {
                GemmKind::Up => (&regime.gemm1, hints.gemm1_tile.is_some()),
                GemmKind::Down => (&regime.gemm2, hints.gemm2_tile.is_some()),
            };
            if hinted || hints.stages.is_some() || chosen.source == ChoiceSource::Hint {
                continue;
            }
            let problem = single_gpu_problem(&shape, kind);
            let mut candidates = vec![chosen.clone()];
            candidates.extend(
                ranked_candidates(
                    target,
                    &problem,
                    regime.max_tokens,
                    None,
                    settings.candidates,
                )
                .into_iter()
                .filter(|c| TunedGemm::of(c) != TunedGemm::of(chosen)),
            );
            candidates.truncate(settings.candidates.max(1));
            let mut best: Option<(f64, GemmPlan)> = None;
            for (i, candidate) in candidates.iter().enumerate() {
                let entry = match kind {
                    GemmKind::Up => entry_with(candidate, &gemm2),
                    GemmKind::Down => entry_with(&gemm1, candidate),
                };
                let us = time(entry)?;
                let is_model_choice = i == 0;
                // GEMM1's first candidate runs both GEMMs as the cost model chose them;
                // with GEMM1 hinted, GEMM2's first does.
                if is_model_choice && model_us.is_none() {
                    model_us = Some(us);
                }
                progress(&CandidateTiming {
                    regime: regime.name.clone(),
                    gemm: kind,
                    index: i + 1,
                    of: candidates.len(),
                    config: TunedGemm::of(candidate),
                    us,
                    is_model_choice,
                });
                if best.as_ref().is_none_or(|(fastest, _)| us < *fastest) {
                    best = Some((us, candidate.clone()));
                }
            }
            if let Some((us, winner)) = best {
                chosen_us = Some(us);
                match kind {
                    GemmKind::Up => gemm1 = winner,
                    GemmKind::Down => gemm2 = winner,
                }
            }
        }
        let mut entry = entry_with(&gemm1, &gemm2);
        entry.measured_us = match chosen_us {
            Some(us) => us,
            None => time(entry.clone())?,
        };
        entry.model_choice_us = model_us.unwrap_or(entry.measured_us);
        entries.push(entry);
    }
    Ok(entries)
}

/// The candidate plan took the entry for regime `index` (else the timing would be of the
/// cost model's GEMMs under the candidate's name).
fn check_applied(candidate: &Plan, index: usize, layer: &Layer) -> Result<(), TuneError> {
    let regime = &candidate.regimes[index];
    if regime.tuned.is_some() {
        return Ok(());
    }
    Err(TuneError::Candidate {
        layer: layer.name.clone(),
        regime: regime.name.clone(),
        reason: format!(
            "the planner did not take the candidate: {}",
            candidate.limitations.join("; ")
        ),
    })
}

/// The layer's median time per call, summed over `tokens`, in µs (uniform routing).
fn time_regime(
    session: &Session,
    plan: Plan,
    tokens: &[u32],
    settings: TuneSettings,
) -> Result<f64, TuneError> {
    let shape = plan.shape.clone();
    let built = session.build(plan, settings.seed)?;
    let mut total = 0.0;
    for &t in tokens {
        let mut inputs = uploaded_inputs(session, &shape, t, Routing::Uniform, settings.seed)?;
        total += time_calls::<BenchError>(session, settings.iterations, |i| {
            Ok(session.forward(&built.layer, &mut inputs[i])?)
        })?;
        built.layer.take_error().map_err(BenchError::from)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regime_is_timed_at_its_middle_and_its_largest_call() {
        assert_eq!(timed_tokens(0, 128), vec![11, 128]);
        assert_eq!(timed_tokens(129, 1024), vec![363, 1024]);
        assert_eq!(timed_tokens(1025, 16384), vec![4098, 16384]);
        assert_eq!(timed_tokens(0, 1), vec![1]);
    }
}
