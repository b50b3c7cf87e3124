//! `moeforge tune`: times the cost model's best GEMM configurations of each single-GPU
//! regime on the GPU and keeps the fastest as a [`TuningTable`] entry.
//!
//! Per regime, GEMM1's candidates are timed first (GEMM2 at the model's choice), then
//! GEMM2's (GEMM1 at the winner): a layer per candidate of each GEMM instead of one per
//! pair of them, each a whole layer timed on whole calls (self-routed where the spec has a
//! router, unless the tune is told to time caller-routed ones), so a candidate's launch,
//! ramp and tail count as they will in use, the router's kernel ahead of GEMM1 included. A
//! candidate is the plan of the layer with one tuning entry naming it, so what is timed is
//! exactly what the planner will build from the entry. GEMMs the spec hints are left as
//! hinted. A GEMM's candidates are compiled before the first is timed, the current choice
//! first and the others side by side (each is one changed kernel, one NVRTC program: one
//! after another they used one core), then timed one at a time.
//!
//! The sweep's verdicts are then checked with the two layers' calls in turns
//! (`time_regimes_in_turns`), so that clocks drifting over a pass move both alike: where the
//! table planning uses today holds an entry for the regime and the sweep ends elsewhere,
//! that entry stays unless the sweep's choice [`beats`] it so; with no entry in use, a
//! choice off the cost model's GEMMs stands only if it beats them so (a choice that
//! replaces an entry in use is not checked against the cost model's GEMMs again). Where
//! the sweep's fastest GEMMs at one end of a regime are not its choice, they are timed
//! across the regime (`probe_regime`, [`probe_verdict`]): where they win a run at one end,
//! the regime is cut in two (two entries that tile it, which planning turns into two
//! regimes); where they beat the choice over all the probes by the same rule, they replace
//! it for the whole regime; either only if a second pass, in turns with the choice, agrees
//! (a whole-regime verdict that the second pass refuses is not tried as a cut). The cost
//! model's times that bound a loss at any one count ([`MAX_LOSS`]) come from the sweep's
//! pass (or the probes' first), not from the turns.

use moeforge_compiler::ir::Layer;
use moeforge_compiler::plan::tuning::{
    TunedGemm, TunedRegime, TunedShape, TuningTable, ranked_candidates, same_output_tile,
    same_shape, single_gpu_problem,
};
use moeforge_compiler::plan::{self, GemmKind, GemmPlan, Plan, PlanError, Target};

use crate::bench::{BenchError, time_calls, time_calls_in_turns, uploaded_inputs};
use crate::harness::{BuiltLayer, DeviceWorkload, Session};
use crate::jit::CompiledKernels;
use crate::workload::Routing;

/// How `tune_layer` measures.
#[derive(Clone, Debug)]
pub struct TuneSettings {
    /// Candidate tiles per GEMM (the cost model's best distinct tiles, its own choice
    /// first; an mma.sync tile's two stage depths count once).
    pub candidates: usize,
    /// Timed calls per token count (after warm-up), median.
    pub iterations: usize,
    pub seed: u64,
    /// Only the regimes holding one of these token counts are tuned; empty: every regime.
    pub regimes_holding: Vec<u32>,
    /// The entries planning uses today (shipped, then the cache being updated): a regime's
    /// entry there (or the entries that cut it) is timed against the sweep's choice and kept
    /// unless beaten.
    pub in_use: TuningTable,
    /// Whether the tune probes each regime across its range (`probe_regime`): it may then
    /// cut a regime in two where other GEMMs win one end of it, or give it those GEMMs
    /// where they beat its choice over all of it. A cut already in use is timed and kept or
    /// replaced either way.
    pub probe_regimes: bool,
    /// Time calls that pass their own routing (uniform) even where the spec has a router:
    /// for an engine that routes tokens itself. Its calls differ from self-routed ones in
    /// the router's kernel between calls and in whose routing the GEMMs' rows follow, and
    /// the fastest GEMMs can differ with them (`benches/results/2026-12-07_probe_turns.md`:
    /// a cut 1.8% faster self-routed, on the random gate's skewed routing of then, ran 1.1%
    /// slower caller-routed).
    pub caller_routed: bool,
}

impl TuneSettings {
    /// Whether the tune times `layer` on self-routed calls: where its spec has a router, as
    /// such a layer runs by default (every candidate is built with the router's gate
    /// weights, random from the seed), unless [`TuneSettings::caller_routed`]. The router's
    /// kernel between one call's GEMM2 and the next call's GEMM1 changes what the GEMMs
    /// cost in a stream of calls (`benches/results/2026-12-05_h100_mixtral_router.md`).
    pub fn times_self_routed(&self, layer: &Layer) -> bool {
        self.routes_calls(layer.router.is_some())
    }

    /// Whether a timed call routes itself, for a layer with a router (`has_router`) or without.
    fn routes_calls(&self, has_router: bool) -> bool {
        has_router && !self.caller_routed
    }
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
    /// The layer's time at each of the regime's timed token counts, µs; or why this
    /// candidate could not be built or run (it is then left out).
    pub us: Result<Vec<f64>, String>,
    /// This GEMM as the cost model chose it (the first candidate).
    pub is_model_choice: bool,
}

/// An entry in use timed against the sweep's choice, at the regime's timed counts.
#[derive(Clone, Debug)]
pub struct InUseTimes {
    pub entry: Vec<f64>,
    pub choice: Vec<f64>,
    /// `None` where their calls were taken in turns; else why not (the two layers could not
    /// be held at once, say), and the entry was timed alone, beside the sweep's own times
    /// of the choice.
    pub not_in_turns: Option<String>,
}

/// What `tune_layer` reports as it goes.
pub enum TuneEvent<'a> {
    /// A GEMM's candidates are about to be compiled (before any of them is timed).
    Compiling {
        regime: &'a str,
        gemm: GemmKind,
        candidates: usize,
    },
    Candidate(&'a CandidateTiming),
    /// A regime's entry in use today (or a part of the cut in use), where the sweep ended
    /// elsewhere: the times of the plan it gives (with every part, for a cut) and of the
    /// sweep's choice it was judged against, or why the entry's plan could not be built or
    /// run (the sweep's choice then stands), and whether it stays.
    InUse {
        regime: &'a str,
        entry: &'a TunedRegime,
        us: Result<InUseTimes, String>,
        kept: bool,
    },
    /// The sweep's choice for a regime with no entry in use, where it is not the cost
    /// model's: timed again with the cost model's GEMMs, their calls in turns (`us`: the
    /// cost model's times, then the choice's, at the regime's timed counts; or why they
    /// could not be built or run, in which case the sweep's times stand), and whether the
    /// choice still [`beats`] them (else the regime keeps the cost model's GEMMs).
    Confirmed {
        regime: &'a str,
        /// The sweep's choice, GEMM1 and GEMM2.
        gemms: [TunedGemm; 2],
        us: Result<[Vec<f64>; 2], String>,
        stands: bool,
    },
    /// A regime probed across its range (`probe_regime`): the layer's times at `tokens`
    /// with these GEMMs, or why they could not be built or run.
    Probe {
        regime: &'a str,
        role: ProbeRole,
        /// GEMM1 and GEMM2 of the pair timed (for a cut, the alternative's part).
        gemms: [TunedGemm; 2],
        tokens: &'a [u32],
        us: Result<Vec<f64>, String>,
    },
    /// A regime's entries, final: one, or the parts of a cut (lower first; a cut in use
    /// that stays gives its parts with their GEMMs as they were, timed by this tune). The
    /// caller may record them at once, and should record them together: one part alone
    /// tiles nothing.
    Regime(&'a [TunedRegime]),
}

/// Which GEMMs a probe across a regime times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeRole {
    /// The regime's choice after the sweep.
    Chosen,
    /// The cost model's, where the choice differs.
    CostModel,
    /// The sweep's fastest GEMMs at one end of the regime, for the whole of it.
    Alternative,
    /// The second pass: the layer planned with the regime cut at `starts_at`, the
    /// alternative's GEMMs above it (or below it), the choice's on the other side.
    Cut {
        starts_at: u32,
        alternative_above: bool,
    },
    /// The second pass: the alternative for the whole regime again, where it beat the
    /// choice over all the probes of the first.
    AlternativeAgain,
    /// The second pass: the regime's choice again, its calls in turns with the cut's (or
    /// the alternative's).
    ChosenAgain,
}

/// A candidate replaces the current choice only when at least this much faster on
/// average over the timed token counts: the median of a few calls moves by about 1%
/// between builds of the same kernels.
pub const MIN_GAIN: f64 = 0.02;

/// ... and no more than this much slower at any one of them. Without it, a candidate that
/// won on the sum at a regime's largest call lost 3-4% elsewhere in the regime (GPT-OSS,
/// H200, 2026-11-30: measured again by `bench` at 16 and 4096 tokens).
pub const MAX_LOSS: f64 = 0.01;

/// Whether a candidate's times (per timed token count) beat the current choice's, without
/// losing more than [`MAX_LOSS`] at any count against the current choice or against the
/// cost model's own choice: the second bound keeps small losses from adding up as one GEMM's
/// winner is followed by the other's.
pub fn beats(candidate: &[f64], current: &[f64], model_choice: &[f64]) -> bool {
    let ratios = |reference: &[f64]| -> Vec<f64> {
        candidate
            .iter()
            .zip(reference)
            .map(|(c, r)| c / r)
            .collect()
    };
    let against_current = ratios(current);
    let mean = against_current.iter().sum::<f64>() / against_current.len() as f64;
    mean <= 1.0 - MIN_GAIN
        && against_current
            .iter()
            .chain(&ratios(model_choice))
            .all(|&r| r <= 1.0 + MAX_LOSS)
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

/// The token counts a regime is timed at: its smallest call (at least 1 token), the
/// geometric middle of its range and its largest call, so that a configuration fast only
/// at one end does not win.
pub fn timed_tokens(min_tokens: u32, max_tokens: u32) -> Vec<u32> {
    let low = min_tokens.max(1);
    let middle = ((f64::from(low) * f64::from(max_tokens)).sqrt().round() as u32).max(low);
    let mut tokens = vec![low, middle, max_tokens];
    tokens.dedup();
    tokens
}

/// Tunes every single-GPU regime of `layer` on `session`'s GPU (planned for `target`,
/// which must be that GPU's): one entry per regime with a GEMM the spec does not hint.
/// `measured_by` names the build.
pub fn tune_layer(
    session: &Session,
    layer: &Layer,
    target: &Target,
    settings: TuneSettings,
    measured_on: &str,
    measured_by: &str,
    mut report: impl FnMut(TuneEvent<'_>),
) -> Result<Vec<TunedRegime>, TuneError> {
    let model = plan::plan(layer, target)?;
    let shape = model.shape.clone();
    let self_routed = settings.times_self_routed(layer);
    let tunable = |kind| !plan::gemm_hinted(layer, kind);
    let mut entries = Vec::new();
    // The GEMMs the regime below ended with (tuned, else as the model chose them).
    let mut below: Option<(GemmPlan, GemmPlan)> = None;
    for (index, regime) in model.regimes.iter().enumerate() {
        let range = regime.min_tokens..=regime.max_tokens;
        let asked = settings.regimes_holding.is_empty()
            || settings.regimes_holding.iter().any(|t| range.contains(t));
        if !asked {
            below = Some((regime.gemm1.clone(), regime.gemm2.clone()));
            continue;
        }
        let tokens = timed_tokens(regime.min_tokens, regime.max_tokens);
        let entry_with = |gemm1: &GemmPlan, gemm2: &GemmPlan| TunedRegime {
            gpu: target.name.clone(),
            shape: TunedShape::of(&shape),
            min_tokens: regime.min_tokens,
            max_tokens: regime.max_tokens,
            gemm1: tunable(GemmKind::Up).then(|| TunedGemm::of(gemm1)),
            gemm2: tunable(GemmKind::Down).then(|| TunedGemm::of(gemm2)),
            timed_tokens: tokens.clone(),
            measured_us: 0.0,
            model_choice_us: 0.0,
            self_routed,
            measured_on: measured_on.to_string(),
            measured_by: measured_by.to_string(),
        };
        // The layer planned with `entries` for this regime (one, or the parts of a cut).
        let plan_with_entries = |entries: Vec<TunedRegime>| -> Result<Plan, TuneError> {
            let parts = entries.len();
            let candidate = plan::plan_tuned(layer, target, &TuningTable { entries })?;
            check_applied(&candidate, index..index + parts, layer)?;
            Ok(candidate)
        };
        let plan_with = |entry: TunedRegime| plan_with_entries(vec![entry]);
        let (mut gemm1, mut gemm2) = (regime.gemm1.clone(), regime.gemm2.clone());
        // Beside the cost model's best tiles for this regime, the neighbouring regimes'
        // GEMMs (the one below as it ended, the one above as the model chose it): a boundary
        // the model drew can fall on the wrong side of a call (Qwen3-30B-A3B at 1024 tokens,
        // the largest call of its mid regime, ran 3.6% faster on the prefill regime's GEMMs,
        // H200, 2026-12-02).
        let above = model.regimes.get(index + 1);
        let neighbours = |kind: GemmKind| -> Vec<GemmPlan> {
            below
                .iter()
                .map(|(g1, g2)| of_kind(kind, g1, g2))
                .chain(above.map(|r| of_kind(kind, &r.gemm1, &r.gemm2)))
                .cloned()
                .collect()
        };
        // Both GEMMs as the cost model chose them (per timed count), and the current
        // choice, timed.
        let mut model_times: Option<Vec<f64>> = None;
        // The layer's times with both GEMMs as the sweep leaves them (its last GEMM's winner).
        let mut chosen: Option<Vec<f64>> = None;
        // Every candidate that ran, with its times.
        let mut swept: Vec<SweptCandidate> = Vec::new();
        for kind in [GemmKind::Up, GemmKind::Down] {
            if !tunable(kind) {
                continue;
            }
            let current = of_kind(kind, &gemm1, &gemm2).clone();
            let problem = single_gpu_problem(&shape, kind);
            let candidates = candidate_list(
                &current,
                ranked_candidates(target, &problem, regime.max_tokens, settings.candidates),
                settings.candidates,
                neighbours(kind),
            );
            let planned: Vec<Result<Plan, TuneError>> = candidates
                .iter()
                .map(|candidate| {
                    plan_with(match kind {
                        GemmKind::Up => entry_with(candidate, &gemm2),
                        GemmKind::Down => entry_with(&gemm1, candidate),
                    })
                })
                .collect();
            report(TuneEvent::Compiling {
                regime: &regime.name,
                gemm: kind,
                candidates: planned.iter().flatten().count(),
            });
            // Compiled before any is timed: the first (the current choice) alone, then the
            // others side by side. Each of the others differs from the first in this GEMM's
            // kernel alone, one NVRTC program, which one after another left the machine's
            // other cores idle; after the first they find every other kernel in the disk
            // cache rather than each compiling it again at once.
            let mut ready = planned.iter().flatten();
            let mut compiled = session.compile_many(ready.by_ref().take(1));
            compiled.extend(session.compile_many(ready));
            let mut compiled = compiled.into_iter();
            let mut best: Option<(Vec<f64>, GemmPlan)> = None;
            for (i, (candidate, plan)) in candidates.iter().zip(planned).enumerate() {
                let timed = plan.and_then(|plan| {
                    let Some(kernels) = compiled.next() else {
                        unreachable!("compile_many gives one result per plan")
                    };
                    time_regime(session, (plan, kernels?), &tokens, &settings)
                });
                // The current choice must run; another candidate that cannot is left out.
                let us = match timed {
                    Ok(us) => Ok(us),
                    Err(error) if i > 0 => Err(error.to_string()),
                    Err(error) => return Err(error),
                };
                report(TuneEvent::Candidate(&CandidateTiming {
                    regime: regime.name.clone(),
                    gemm: kind,
                    index: i + 1,
                    of: candidates.len(),
                    config: TunedGemm::of(candidate),
                    us: us.clone(),
                    is_model_choice: i == 0,
                }));
                let Ok(us) = us else { continue };
                swept.push(SweptCandidate {
                    kind,
                    gemm: candidate.clone(),
                    us: us.clone(),
                });
                let model = model_times.get_or_insert_with(|| us.clone());
                let wins = match &best {
                    None => true,
                    Some((fastest, _)) => beats(&us, fastest, model),
                };
                if wins {
                    best = Some((us, candidate.clone()));
                }
            }
            if let Some((us, winner)) = best {
                chosen = Some(us);
                match kind {
                    GemmKind::Up => gemm1 = winner,
                    GemmKind::Down => gemm2 = winner,
                }
            }
        }
        let (Some(mut model_times), Some(mut chosen)) = (model_times, chosen) else {
            // Every GEMM is hinted: nothing was compared.
            below = Some((gemm1, gemm2));
            continue;
        };
        // The entry planning uses today (or the parts of a cut), where the sweep
        // ended elsewhere: timed too, in turns with the sweep's choice, and kept unless the
        // choice beats it there as a candidate beats the current choice, so that a re-tune
        // cannot trade a measured choice for one within the noise of it (Qwen3-30B-A3B's
        // mid regime on an H200, 2026-12-06: the sweep's 1.5% margin was under the bar, and
        // it ran 2.5% slower than the shipped entry at 1024 tokens).
        let in_use: Vec<TunedRegime> = settings
            .in_use
            .tiling(target, &shape, regime.min_tokens, regime.max_tokens)
            .into_iter()
            .cloned()
            .collect();
        if !in_use.is_empty() {
            // What planning builds from it (a hinted GEMM stays as hinted, a GEMM the
            // entry leaves out is the cost model's), against what the sweep ended on.
            let planned = plan_with_entries(in_use.clone());
            let differs = in_use.len() > 1
                || planned.as_ref().map_or(true, |plan| {
                    let applied = &plan.regimes[index];
                    !same_pair((&applied.gemm1, &applied.gemm2), (&gemm1, &gemm2))
                });
            if differs {
                let timed = planned.and_then(|plan| {
                    // The GEMMs of its last part: the ones beside the regime above.
                    let last = &plan.regimes[index + in_use.len() - 1];
                    let gemms = (last.gemm1.clone(), last.gemm2.clone());
                    let choice = plan_with(entry_with(&gemm1, &gemm2));
                    let reference = with_kernels(session, plan)?;
                    let ([us, choice_us], not_in_turns) = time_against_choice(
                        session, reference, choice, &chosen, &tokens, &settings,
                    )?;
                    Ok((us, choice_us, not_in_turns, gemms))
                });
                let kept = match &timed {
                    Ok((us, choice_us, _, _)) => !beats(choice_us, us, &model_times),
                    Err(_) => false,
                };
                for part in &in_use {
                    // Shown as it applies: the GEMMs the spec hints are not the entry's.
                    let shown = TunedRegime {
                        gemm1: part.gemm1.filter(|_| tunable(GemmKind::Up)),
                        gemm2: part.gemm2.filter(|_| tunable(GemmKind::Down)),
                        ..part.clone()
                    };
                    report(TuneEvent::InUse {
                        regime: &regime.name,
                        entry: &shown,
                        us: timed
                            .as_ref()
                            .map(|(us, choice_us, not_in_turns, _)| InUseTimes {
                                entry: us.clone(),
                                choice: choice_us.clone(),
                                not_in_turns: not_in_turns.clone(),
                            })
                            .map_err(ToString::to_string),
                        kept,
                    });
                }
                match (kept, timed) {
                    // A cut in use that stays: its entries are the regime's, their GEMMs as
                    // they were, their times this tune's.
                    (true, Ok((us, _, _, last_gemms))) if in_use.len() > 1 => {
                        below = Some(last_gemms);
                        let parts: Vec<TunedRegime> = in_use
                            .into_iter()
                            .map(|part| {
                                let range = part.min_tokens..=part.max_tokens;
                                if !tokens.iter().any(|t| range.contains(t)) {
                                    // It holds none of the timed counts: as it was.
                                    return part;
                                }
                                TunedRegime {
                                    self_routed,
                                    measured_on: measured_on.to_string(),
                                    measured_by: measured_by.to_string(),
                                    ..timed_within(part, &tokens, &us, &model_times)
                                }
                            })
                            .collect();
                        report(TuneEvent::Regime(&parts));
                        entries.extend(parts);
                        continue;
                    }
                    (true, Ok((us, _, _, (in_use_gemm1, in_use_gemm2)))) => {
                        (gemm1, gemm2, chosen) = (in_use_gemm1, in_use_gemm2, us);
                    }
                    (false, Ok((_, choice_us, _, _))) => chosen = choice_us,
                    _ => {}
                }
            }
        } else if !same_pair((&gemm1, &gemm2), (&regime.gemm1, &regime.gemm2)) {
            // No entry in use, and the sweep moved off the cost model's GEMMs: its choice
            // timed again in turns with them, and kept only if it beats them there too.
            let timed = plan_with(entry_with(&regime.gemm1, &regime.gemm2)).and_then(|model| {
                let choice = plan_with(entry_with(&gemm1, &gemm2))?;
                let pair = [
                    with_kernels(session, model)?,
                    with_kernels(session, choice)?,
                ];
                time_regimes_in_turns(session, pair, &tokens, &settings)
            });
            let stands = match &timed {
                Ok([model_us, choice_us]) => beats(choice_us, model_us, model_us),
                // The sweep's own times stand.
                Err(_) => true,
            };
            report(TuneEvent::Confirmed {
                regime: &regime.name,
                gemms: [TunedGemm::of(&gemm1), TunedGemm::of(&gemm2)],
                us: timed
                    .as_ref()
                    .map(Clone::clone)
                    .map_err(ToString::to_string),
                stands,
            });
            if let Ok([model_us, choice_us]) = timed {
                if stands {
                    chosen = choice_us;
                } else {
                    (gemm1, gemm2) = (regime.gemm1.clone(), regime.gemm2.clone());
                    chosen = model_us.clone();
                }
                model_times = model_us;
            }
        }
        let change = if !settings.probe_regimes {
            None
        } else {
            let fused_decode = layer.schedule.fused_decode.unwrap_or(0);
            probe_regime(
                &ProbeContext {
                    session,
                    settings: &settings,
                    regime,
                    model: (&regime.gemm1, &regime.gemm2),
                    whole_up_to: if index == 0 { fused_decode } else { 0 },
                    plan_with_entries: &plan_with_entries,
                    entry_with: &entry_with,
                },
                (&gemm1, &gemm2),
                &swept,
                &mut report,
            )
        };
        if let Some(parts) = change {
            let (new_entries, gemms): (Vec<TunedRegime>, Vec<_>) = parts
                .into_iter()
                .map(|part| (part.entry, part.gemms))
                .unzip();
            below = gemms.into_iter().last();
            report(TuneEvent::Regime(&new_entries));
            entries.extend(new_entries);
            continue;
        }
        below = Some((gemm1.clone(), gemm2.clone()));
        let model_us = model_times.iter().sum::<f64>();
        let chosen_us = chosen.iter().sum::<f64>();
        let unchanged = same_pair((&gemm1, &gemm2), (&regime.gemm1, &regime.gemm2));
        let mut entry = entry_with(&gemm1, &gemm2);
        // The cost model's own choice is one configuration: give it one time.
        entry.measured_us = if unchanged { model_us } else { chosen_us };
        entry.model_choice_us = model_us;
        report(TuneEvent::Regime(std::slice::from_ref(&entry)));
        entries.push(entry);
    }
    Ok(entries)
}

/// The GEMM of `kind` of a regime's two.
fn of_kind<'a>(kind: GemmKind, gemm1: &'a GemmPlan, gemm2: &'a GemmPlan) -> &'a GemmPlan {
    match kind {
        GemmKind::Up => gemm1,
        GemmKind::Down => gemm2,
    }
}

/// What a GEMM's sweep times, in order: the current choice, the cost model's ranked
/// candidates up to `count` output tiles in all (a tile's two stage depths count once),
/// then the neighbouring regimes' GEMMs; each shape once.
fn candidate_list(
    current: &GemmPlan,
    ranked: Vec<GemmPlan>,
    count: usize,
    neighbours: Vec<GemmPlan>,
) -> Vec<GemmPlan> {
    let mut candidates = vec![current.clone()];
    let mut tiles = 1;
    for candidate in ranked.into_iter().filter(|c| !same_shape(c, current)) {
        if !candidates.iter().any(|c| same_output_tile(c, &candidate)) {
            if tiles == count.max(1) {
                break;
            }
            tiles += 1;
        }
        candidates.push(candidate);
    }
    for neighbour in neighbours {
        if !candidates.iter().any(|c| same_shape(c, &neighbour)) {
            candidates.push(neighbour);
        }
    }
    candidates
}

/// The candidate plan took the entries for the regimes `parts` (the regime tuned, or the
/// parts of its cut), else the timing would be of the cost model's GEMMs under the
/// candidate's name.
fn check_applied(
    candidate: &Plan,
    parts: std::ops::Range<usize>,
    layer: &Layer,
) -> Result<(), TuneError> {
    let not_taken = |regime: String| TuneError::Candidate {
        layer: layer.name.clone(),
        regime,
        reason: format!(
            "the planner did not take the candidate: {}",
            candidate.limitations.join("; ")
        ),
    };
    // Fewer regimes than the entries' parts: a cut the planner did not make.
    let Some(regimes) = candidate.regimes.get(parts.clone()) else {
        return Err(not_taken(format!("{} parts", parts.len())));
    };
    match regimes.iter().find(|regime| regime.tuned.is_none()) {
        Some(regime) => Err(not_taken(regime.name.clone())),
        None => Ok(()),
    }
}

/// A GEMM configuration the sweep timed, with the layer's times at the regime's timed
/// token counts.
struct SweptCandidate {
    kind: GemmKind,
    gemm: GemmPlan,
    us: Vec<f64>,
}

/// Token counts a regime is probed at: this many, spaced evenly in the logarithm from its
/// smallest call to its largest.
pub const CUT_PROBES: usize = 7;

/// The fewest probes each part of a cut regime holds: one probe alone could be noise.
pub const MIN_PART_PROBES: usize = 2;

/// The token counts a regime is probed at ([`CUT_PROBES`] of them, fewer where its range
/// holds fewer).
pub fn cut_probes(min_tokens: u32, max_tokens: u32) -> Vec<u32> {
    let low = min_tokens.max(1);
    let ratio = f64::from(max_tokens) / f64::from(low);
    let last = (CUT_PROBES - 1) as f64;
    let mut probes: Vec<u32> = (0..CUT_PROBES)
        .map(|i| (f64::from(low) * ratio.powf(i as f64 / last)).round() as u32)
        .map(|tokens| tokens.clamp(low, max_tokens))
        .collect();
    probes.dedup();
    probes
}

/// Where a regime is cut in two, and which part an alternative pair of GEMMs takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RegimeCut {
    /// The first token count of the upper part.
    pub starts_at: u32,
    /// Whether the alternative takes the upper part (else the lower).
    pub alternative_above: bool,
    /// The alternative's gain over the current choice summed over its part's probes (each
    /// a fraction of the current choice's time).
    pub gain: f64,
}

/// Where to cut a regime probed at `probes` (increasing), given the layer's times there
/// with the regime's current choice, with an alternative and with the cost model's choice:
/// the alternative takes the longest run of probes at either end on which it [`beats`] the
/// current choice, leaving at least [`MIN_PART_PROBES`] on each side (of the two ends, the
/// larger gain); the cut lies at the geometric middle between the run's innermost probe
/// and its neighbour outside the run. `None` where no such run exists, or where the
/// alternative beats the current choice over all the probes (not a cut: [`probe_verdict`]
/// gives it the whole regime).
pub fn cut_point(
    probes: &[u32],
    current: &[f64],
    alternative: &[f64],
    model: &[f64],
) -> Option<RegimeCut> {
    let n = probes.len();
    if n < 2 * MIN_PART_PROBES || beats(alternative, current, model) {
        return None;
    }
    let wins = |run: std::ops::Range<usize>| {
        beats(
            &alternative[run.clone()],
            &current[run.clone()],
            &model[run.clone()],
        )
        .then(|| run.map(|i| 1.0 - alternative[i] / current[i]).sum::<f64>())
    };
    let cut_between = |below: u32, above: u32| {
        let middle = (f64::from(below) * f64::from(above)).sqrt().round() as u32;
        middle.clamp(below + 1, above)
    };
    let above = (MIN_PART_PROBES..=n - MIN_PART_PROBES).find_map(|first| {
        wins(first..n).map(|gain| RegimeCut {
            starts_at: cut_between(probes[first - 1], probes[first]),
            alternative_above: true,
            gain,
        })
    });
    let below = (MIN_PART_PROBES..=n - MIN_PART_PROBES)
        .rev()
        .find_map(|end| {
            wins(0..end).map(|gain| RegimeCut {
                starts_at: cut_between(probes[end - 1], probes[end]),
                alternative_above: false,
                gain,
            })
        });
    match (above, below) {
        (Some(a), Some(b)) if b.gain > a.gain => Some(b),
        (Some(a), _) => Some(a),
        (None, b) => b,
    }
}

/// What a regime's probes say of an alternative pair of GEMMs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ProbeVerdict {
    /// It [`beats`] the current choice over every probe: it takes the whole regime. `gain`
    /// as [`RegimeCut::gain`], over every probe.
    Whole { gain: f64 },
    /// It wins a run at one end ([`cut_point`]).
    Cut(RegimeCut),
}

impl ProbeVerdict {
    /// The alternative's gain over the probes it would take.
    pub fn gain(&self) -> f64 {
        match self {
            ProbeVerdict::Whole { gain } => *gain,
            ProbeVerdict::Cut(cut) => cut.gain,
        }
    }
}

/// The verdict of a regime's probes (as for [`cut_point`]) on an alternative: the whole
/// regime where it [`beats`] the current choice over all of them, else the cut of
/// [`cut_point`], else `None`.
pub fn probe_verdict(
    probes: &[u32],
    current: &[f64],
    alternative: &[f64],
    model: &[f64],
) -> Option<ProbeVerdict> {
    if beats(alternative, current, model) {
        let gain = alternative
            .iter()
            .zip(current)
            .map(|(a, c)| 1.0 - a / c)
            .sum();
        return Some(ProbeVerdict::Whole { gain });
    }
    cut_point(probes, current, alternative, model).map(ProbeVerdict::Cut)
}

/// Whether a cut holds on a second pass of the probes: the layer's times with the regime
/// cut (`cut_layer`: both parts planned, as they will run) beat those with the current
/// choice on the alternative's part (by [`beats`], as [`cut_point`] found it), and are at
/// most [`MAX_LOSS`] slower at every probe of the other part (whose GEMMs are the choice's,
/// but whose router and routing launches are now planned for the part's own range).
pub fn cut_holds(
    cut: &RegimeCut,
    probes: &[u32],
    current: &[f64],
    cut_layer: &[f64],
    model: &[f64],
) -> bool {
    let (alternative_part, choice_part): (Vec<usize>, Vec<usize>) =
        (0..probes.len()).partition(|&i| (probes[i] >= cut.starts_at) == cut.alternative_above);
    let pick =
        |part: &[usize], times: &[f64]| -> Vec<f64> { part.iter().map(|&i| times[i]).collect() };
    !alternative_part.is_empty()
        && beats(
            &pick(&alternative_part, cut_layer),
            &pick(&alternative_part, current),
            &pick(&alternative_part, model),
        )
        && choice_part
            .iter()
            .all(|&i| cut_layer[i] <= current[i] * (1.0 + MAX_LOSS))
}

/// What `probe_regime` needs of the regime being tuned.
struct ProbeContext<'a> {
    session: &'a Session,
    settings: &'a TuneSettings,
    regime: &'a plan::Regime,
    /// The cost model's GEMMs of the regime.
    model: (&'a GemmPlan, &'a GemmPlan),
    /// The calls the regime keeps whole from its first count: those of the spec's
    /// `fused_decode` where the regime is the first (its fused decode serves no more calls
    /// than its first part holds); 0 otherwise.
    whole_up_to: u32,
    plan_with_entries: &'a dyn Fn(Vec<TunedRegime>) -> Result<Plan, TuneError>,
    entry_with: &'a dyn Fn(&GemmPlan, &GemmPlan) -> TunedRegime,
}

/// One part of a regime cut in two (or the whole regime): its entry, and its GEMMs as
/// planned.
struct RegimePart {
    entry: TunedRegime,
    gemms: (GemmPlan, GemmPlan),
}

/// `entry` with its times those of `times` (and `model`'s) at the counts of `tokens` its
/// range holds; as it was where it holds none of them.
fn timed_within(entry: TunedRegime, tokens: &[u32], times: &[f64], model: &[f64]) -> TunedRegime {
    let inside: Vec<usize> = (0..tokens.len())
        .filter(|&i| (entry.min_tokens..=entry.max_tokens).contains(&tokens[i]))
        .collect();
    if inside.is_empty() {
        return entry;
    }
    TunedRegime {
        timed_tokens: inside.iter().map(|&i| tokens[i]).collect(),
        measured_us: inside.iter().map(|&i| times[i]).sum(),
        model_choice_us: inside.iter().map(|&i| model[i]).sum(),
        ..entry
    }
}

/// Whether two pairs of GEMMs are one configuration.
fn same_pair(a: (&GemmPlan, &GemmPlan), b: (&GemmPlan, &GemmPlan)) -> bool {
    TunedGemm::of(a.0) == TunedGemm::of(b.0) && TunedGemm::of(a.1) == TunedGemm::of(b.1)
}

/// The regime cut in two where another pair of GEMMs wins one end of it, or given that pair
/// where it beats the choice over all of it: the pair of the sweep's fastest GEMMs at the regime's largest
/// call, and the pair at its smallest, each timed for the whole regime beside its choice
/// (`chosen`) at [`cut_probes`] and judged by [`probe_verdict`] (the larger gain wins);
/// then a second pass times the layer planned with the change (both parts of a cut, as they
/// will run: a part's router and routing launches follow its own range) and the choice
/// again, their calls in turns ([`time_regimes_in_turns`]). A cut stands where
/// [`cut_holds`], a whole replacement where it [`beats`] the choice again. The regime's new
/// entries (a cut's two parts, lower first, or one), timed at the probes each holds in the
/// second pass, with their GEMMs; `None` where no alternative wins, the second pass does
/// not confirm it, or a probe could not be built or run (the regime then keeps its one
/// entry).
fn probe_regime(
    context: &ProbeContext<'_>,
    chosen: (&GemmPlan, &GemmPlan),
    swept: &[SweptCandidate],
    report: &mut dyn FnMut(TuneEvent<'_>),
) -> Option<Vec<RegimePart>> {
    let regime = context.regime;
    let probes = cut_probes(regime.min_tokens, regime.max_tokens);
    // The sweep timed each candidate at the regime's timed counts: its first and last.
    let fastest_at = |kind: GemmKind, last: bool| {
        swept
            .iter()
            .filter(|c| c.kind == kind)
            .min_by(|a, b| {
                let at = |c: &SweptCandidate| if last { c.us[c.us.len() - 1] } else { c.us[0] };
                at(a).total_cmp(&at(b))
            })
            .map(|c| &c.gemm)
    };
    let mut alternatives: Vec<(GemmPlan, GemmPlan)> = Vec::new();
    for last in [true, false] {
        let gemm1 = fastest_at(GemmKind::Up, last).unwrap_or(chosen.0);
        let gemm2 = fastest_at(GemmKind::Down, last).unwrap_or(chosen.1);
        let listed = alternatives
            .iter()
            .any(|(g1, g2)| same_pair((g1, g2), (gemm1, gemm2)));
        if !listed && !same_pair((gemm1, gemm2), chosen) {
            alternatives.push((gemm1.clone(), gemm2.clone()));
        }
    }
    if alternatives.is_empty() {
        return None;
    }
    let whole = |(gemm1, gemm2): (&GemmPlan, &GemmPlan)| {
        (
            (context.plan_with_entries)(vec![(context.entry_with)(gemm1, gemm2)]),
            [TunedGemm::of(gemm1), TunedGemm::of(gemm2)],
        )
    };
    let (plan, gemms) = whole(chosen);
    let current = probe_one(context, &probes, (ProbeRole::Chosen, plan, gemms), report)?;
    let model_is_chosen = same_pair(context.model, chosen);
    let model = if model_is_chosen {
        current.clone()
    } else {
        let (plan, gemms) = whole(context.model);
        probe_one(
            context,
            &probes,
            (ProbeRole::CostModel, plan, gemms),
            report,
        )?
    };
    let mut best: Option<(ProbeVerdict, (GemmPlan, GemmPlan))> = None;
    for pair in alternatives {
        let (plan, gemms) = whole((&pair.0, &pair.1));
        let Some(us) = probe_one(
            context,
            &probes,
            (ProbeRole::Alternative, plan, gemms),
            report,
        ) else {
            continue;
        };
        let verdict =
            probe_verdict(&probes, &current, &us, &model).filter(|verdict| match verdict {
                ProbeVerdict::Cut(cut) => cut.starts_at > context.whole_up_to,
                ProbeVerdict::Whole { .. } => true,
            });
        if let Some(verdict) = verdict
            && best.as_ref().is_none_or(|(b, _)| verdict.gain() > b.gain())
        {
            best = Some((verdict, pair));
        }
    }
    let (verdict, alternative) = best?;
    let alternative_gemms = [TunedGemm::of(&alternative.0), TunedGemm::of(&alternative.1)];
    let chosen = (chosen.0.clone(), chosen.1.clone());
    let part = |gemms: &(GemmPlan, GemmPlan), min_tokens: u32, max_tokens: u32| {
        let mut entry = (context.entry_with)(&gemms.0, &gemms.1);
        entry.min_tokens = min_tokens;
        entry.max_tokens = max_tokens;
        entry
    };
    // The second pass: the change as it will run and the choice again, their calls in turns.
    let (role, parts) = match verdict {
        ProbeVerdict::Whole { .. } => (
            ProbeRole::AlternativeAgain,
            vec![(alternative, regime.min_tokens, regime.max_tokens)],
        ),
        ProbeVerdict::Cut(cut) => {
            let (lower, upper) = if cut.alternative_above {
                (chosen.clone(), alternative)
            } else {
                (alternative, chosen.clone())
            };
            let role = ProbeRole::Cut {
                starts_at: cut.starts_at,
                alternative_above: cut.alternative_above,
            };
            let parts = vec![
                (lower, regime.min_tokens, cut.starts_at - 1),
                (upper, cut.starts_at, regime.max_tokens),
            ];
            (role, parts)
        }
    };
    let entries: Vec<TunedRegime> = parts
        .iter()
        .map(|(gemms, min_tokens, max_tokens)| part(gemms, *min_tokens, *max_tokens))
        .collect();
    let (plan, gemms) = whole((&chosen.0, &chosen.1));
    let [changed, current_again] = probe_pair(
        context,
        &probes,
        [
            (
                role,
                (context.plan_with_entries)(entries.clone()),
                alternative_gemms,
            ),
            (ProbeRole::ChosenAgain, plan, gemms),
        ],
        report,
    )?;
    let model = if model_is_chosen {
        current_again.clone()
    } else {
        model
    };
    let holds = match verdict {
        ProbeVerdict::Whole { .. } => beats(&changed, &current_again, &model),
        ProbeVerdict::Cut(cut) => cut_holds(&cut, &probes, &current_again, &changed, &model),
    };
    holds.then(|| {
        entries
            .into_iter()
            .zip(parts)
            .map(|(entry, (gemms, _, _))| RegimePart {
                entry: timed_within(entry, &probes, &changed, &model),
                gemms,
            })
            .collect()
    })
}

/// A plan for a probe: its role, the plan (or why there is none), and its GEMMs as shown.
type ProbeRun = (ProbeRole, Result<Plan, TuneError>, [TunedGemm; 2]);

/// A plan timed at the regime's `probes` and reported: its times, or `None` where it could
/// not be built or run.
fn probe_one(
    context: &ProbeContext<'_>,
    probes: &[u32],
    (role, plan, gemms): ProbeRun,
    report: &mut dyn FnMut(TuneEvent<'_>),
) -> Option<Vec<f64>> {
    let us = plan.and_then(|plan| {
        let compiled = with_kernels(context.session, plan)?;
        time_regime(context.session, compiled, probes, context.settings)
    });
    report(TuneEvent::Probe {
        regime: &context.regime.name,
        role,
        gemms,
        tokens: probes,
        us: us.as_ref().map(Clone::clone).map_err(ToString::to_string),
    });
    us.ok()
}

/// Two plans timed at the regime's `probes`, their calls in turns, each reported: their
/// times, or `None` where either could not be built or they could not be run together (a
/// plan that could not be built is reported with its own error, the other as not timed).
fn probe_pair(
    context: &ProbeContext<'_>,
    probes: &[u32],
    runs: [ProbeRun; 2],
    report: &mut dyn FnMut(TuneEvent<'_>),
) -> Option<[Vec<f64>; 2]> {
    let [
        (first_role, first, first_gemms),
        (second_role, second, second_gemms),
    ] = runs;
    let first = first.and_then(|plan| with_kernels(context.session, plan));
    let second = second.and_then(|plan| with_kernels(context.session, plan));
    let (first_us, second_us): (Result<Vec<f64>, String>, Result<Vec<f64>, String>) =
        match (first, second) {
            (Ok(first), Ok(second)) => {
                match time_regimes_in_turns(
                    context.session,
                    [first, second],
                    probes,
                    context.settings,
                ) {
                    Ok([a, b]) => (Ok(a), Ok(b)),
                    Err(error) => {
                        let reason = format!("timed in turns with the other: {error}");
                        (Err(reason.clone()), Err(reason))
                    }
                }
            }
            (first, second) => {
                let untimed = "not timed: the other plan of the pair could not be built";
                let reason = |plan: Result<CompiledPlan, TuneError>| match plan {
                    Ok(_) => untimed.to_string(),
                    Err(error) => error.to_string(),
                };
                (Err(reason(first)), Err(reason(second)))
            }
        };
    for (role, gemms, us) in [
        (first_role, first_gemms, &first_us),
        (second_role, second_gemms, &second_us),
    ] {
        report(TuneEvent::Probe {
            regime: &context.regime.name,
            role,
            gemms,
            tokens: probes,
            us: us.clone(),
        });
    }
    Some([first_us.ok()?, second_us.ok()?])
}

/// The layer's median time per call at each of `tokens`, in µs: self-routed calls where
/// the layer has a router ([`TuneSettings::times_self_routed`]), else calls on uniform
/// routing.
fn time_regime(
    session: &Session,
    (plan, kernels): CompiledPlan,
    tokens: &[u32],
    settings: &TuneSettings,
) -> Result<Vec<f64>, TuneError> {
    let shape = plan.shape.clone();
    let built = session.build_from_kernels(plan, kernels, settings.seed)?;
    let mut times = Vec::with_capacity(tokens.len());
    for &t in tokens {
        let mut inputs = uploaded_inputs(session, &shape, t, Routing::Uniform, settings.seed)?;
        times.push(time_calls::<BenchError>(
            session,
            settings.iterations,
            |i| one_call(session, &built, &mut inputs[i], settings),
        )?);
        built.layer.take_error().map_err(BenchError::from)?;
    }
    Ok(times)
}

/// [`time_regime`] of two plans of one layer, their calls taken in turns at each count
/// (both layers built at once) so that what drifts over a pass (clocks under a power
/// limit) moves both alike: single passes one after the other moved by 2-8% at some
/// prefill counts on an H100 (`benches/results/2026-12-07_regime_cuts.md`).
fn time_regimes_in_turns(
    session: &Session,
    [first, second]: [CompiledPlan; 2],
    tokens: &[u32],
    settings: &TuneSettings,
) -> Result<[Vec<f64>; 2], TuneError> {
    let shape = first.0.shape.clone();
    let first = session.build_from_kernels(first.0, first.1, settings.seed)?;
    let second = session.build_from_kernels(second.0, second.1, settings.seed)?;
    let mut times = [
        Vec::with_capacity(tokens.len()),
        Vec::with_capacity(tokens.len()),
    ];
    for &t in tokens {
        // Each layer its own inputs (the same draws): as its weights, a call's rows are then
        // never in L2 from the other layer's call.
        let upload = || uploaded_inputs(session, &shape, t, Routing::Uniform, settings.seed);
        let (mut first_inputs, mut second_inputs) = (upload()?, upload()?);
        let (first_us, second_us) = time_calls_in_turns::<BenchError>(
            session,
            settings.iterations,
            |i| one_call(session, &first, &mut first_inputs[i], settings),
            |i| one_call(session, &second, &mut second_inputs[i], settings),
        )?;
        for built in [&first, &second] {
            built.layer.take_error().map_err(BenchError::from)?;
        }
        times[0].push(first_us);
        times[1].push(second_us);
    }
    Ok(times)
}

/// A plan with its kernels, compiled (and the seconds that took).
type CompiledPlan = (Plan, (CompiledKernels, f64));

/// `plan` with its kernels, compiled.
fn with_kernels(session: &Session, plan: Plan) -> Result<CompiledPlan, TuneError> {
    let kernels = session.compile(&plan)?;
    Ok((plan, kernels))
}

/// The times at `tokens` of `reference` and of the sweep's `choice`, in that order, their
/// calls in turns, and `None`; where the two cannot be timed together (two layers' weights
/// held at once, or the choice's plan), `reference` timed alone and the sweep's own times
/// of the choice (`swept`) beside it, as before the turns, and why. An error only where
/// `reference` cannot be built or run.
fn time_against_choice(
    session: &Session,
    reference: CompiledPlan,
    choice: Result<Plan, TuneError>,
    swept: &[f64],
    tokens: &[u32],
    settings: &TuneSettings,
) -> Result<([Vec<f64>; 2], Option<String>), TuneError> {
    let together = choice
        .and_then(|choice| with_kernels(session, choice))
        .and_then(|choice| {
            time_regimes_in_turns(session, [reference.clone(), choice], tokens, settings)
        });
    let why_not = match together {
        Ok(times) => return Ok((times, None)),
        Err(error) => error.to_string(),
    };
    let alone = time_regime(session, reference, tokens, settings)?;
    Ok(([alone, swept.to_vec()], Some(why_not)))
}

/// One call of `built` on `inputs`: self-routed where the layer routes itself, unless the
/// tune times caller-routed calls.
fn one_call(
    session: &Session,
    built: &BuiltLayer,
    inputs: &mut DeviceWorkload,
    settings: &TuneSettings,
) -> Result<(), BenchError> {
    if settings.routes_calls(built.layer.routes_itself()) {
        Ok(built.layer.forward_routed(inputs.routed_args())?)
    } else {
        Ok(session.forward(&built.layer, inputs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regime_is_timed_at_its_ends_and_its_middle() {
        assert_eq!(timed_tokens(0, 128), vec![1, 11, 128]);
        assert_eq!(timed_tokens(129, 1024), vec![129, 363, 1024]);
        assert_eq!(timed_tokens(1025, 16384), vec![1025, 4098, 16384]);
        assert_eq!(timed_tokens(0, 1), vec![1]);
    }

    fn small_shape() -> moeforge_compiler::plan::LayerShape {
        moeforge_compiler::plan::LayerShape {
            hidden: 1024,
            ffn: 512,
            experts: 8,
            top_k: 2,
            activation: moeforge_compiler::ir::Activation::Swiglu,
            expert_bias: false,
            max_tokens: 4096,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    #[test]
    fn the_neighbours_gemms_join_the_ranked_candidates_once_each() {
        use moeforge_compiler::ir::TileShape;
        let target = Target::h200();
        let ranked = ranked_candidates(
            &target,
            &single_gpu_problem(&small_shape(), GemmKind::Up),
            1024,
            6,
        );
        assert!(ranked.len() >= 6);
        // At 1024 tokens the three best tiles are wgmma, with no deep twins beside them:
        // the list below takes them in the ranking's order.
        assert!(
            ranked[..3]
                .iter()
                .all(|g| g.engine == moeforge_compiler::plan::MmaEngine::WgmmaWarpSpecialized),
            "{ranked:?}"
        );
        let current = ranked[1].clone();
        let list = candidate_list(
            &current,
            ranked.clone(),
            3,
            vec![ranked[0].clone(), ranked[5].clone()],
        );
        // The current choice first, two ranked ones, then the neighbour not yet listed.
        let tile = |g: &GemmPlan| -> TileShape { g.tile };
        assert_eq!(
            list.iter().map(tile).collect::<Vec<_>>(),
            [&ranked[1], &ranked[0], &ranked[2], &ranked[5]].map(tile)
        );
        assert_eq!(candidate_list(&current, ranked, 1, Vec::new()).len(), 1);
    }

    #[test]
    fn a_tiles_two_stage_depths_count_as_one_candidate() {
        let target = Target::h200();
        // One token: the cost model ranks mma.sync tiles first, each with a deep twin.
        let ranked = ranked_candidates(
            &target,
            &single_gpu_problem(&small_shape(), GemmKind::Up),
            1,
            4,
        );
        let current = ranked[0].clone();
        let list = candidate_list(&current, ranked.clone(), 2, Vec::new());
        let tiles: Vec<&GemmPlan> = list
            .iter()
            .filter(|g| g.tile.k == moeforge_compiler::plan::TILE_K)
            .collect();
        assert_eq!(tiles.len(), 2, "{list:?}");
        let listed = |g: &GemmPlan| list.iter().any(|c| same_shape(c, g));
        for gemm in &ranked {
            let of_a_listed_tile = tiles.iter().any(|t| same_output_tile(t, gemm));
            assert_eq!(listed(gemm), of_a_listed_tile, "{gemm:?}");
        }
        assert!(list.len() > 2, "the tiles' deep stages are listed too");
    }

    #[test]
    fn a_candidate_wins_on_average_without_losing_anywhere() {
        let model = [100.0, 1000.0];
        // 3% faster on average.
        assert!(beats(&[97.0, 970.0], &[100.0, 1000.0], &model));
        // Only 1.5% faster on average.
        assert!(!beats(&[98.5, 985.0], &[100.0, 1000.0], &model));
        // 5% faster on average, but 2% slower at the first count (GPT-OSS's decode entry).
        assert!(!beats(&[102.0, 880.0], &[100.0, 1000.0], &model));
        // 1% slower at one count is noise.
        assert!(beats(&[101.0, 900.0], &[100.0, 1000.0], &model));
    }

    #[test]
    fn a_regime_is_probed_for_a_cut_across_its_range() {
        assert_eq!(
            cut_probes(513, 16384),
            [513, 914, 1628, 2899, 5164, 9198, 16384]
        );
        assert_eq!(cut_probes(0, 64), [1, 2, 4, 8, 16, 32, 64]);
        // A narrow range gives fewer probes, each once.
        assert_eq!(cut_probes(0, 4), [1, 2, 3, 4]);
        assert_eq!(cut_probes(0, 1), [1]);
    }

    #[test]
    fn a_regime_is_cut_where_an_alternative_wins_a_run_at_one_end() {
        let probes = cut_probes(513, 16384);
        let current = [100.0; 7];
        // Faster from the fourth probe on, slower below: cut between 1628 and 2899.
        let upper = [104.0, 103.0, 101.5, 97.0, 95.0, 96.0, 95.0];
        let cut = cut_point(&probes, &current, &upper, &current).expect("a cut");
        assert!(cut.alternative_above);
        assert_eq!(cut.starts_at, 2172);
        assert!((cut.gain - 0.17).abs() < 1e-9, "{cut:?}");
        // Up to 1% slower at a probe is noise: the run reaches down to it.
        let near = [104.0, 103.0, 101.0, 97.0, 95.0, 96.0, 95.0];
        let cut = cut_point(&probes, &current, &near, &current).expect("a cut");
        assert_eq!(cut.starts_at, 1220);
        // Faster at the two smallest calls only: the alternative takes the lower part.
        let lower = [90.0, 95.0, 102.0, 104.0, 104.0, 105.0, 106.0];
        let cut = cut_point(&probes, &current, &lower, &current).expect("a cut");
        assert!(!cut.alternative_above);
        assert_eq!(cut.starts_at, 1220);
        // Slower at the first probe only: the choice keeps two probes all the same.
        let one_loss = [103.0, 95.0, 95.0, 95.0, 95.0, 95.0, 95.0];
        let cut = cut_point(&probes, &current, &one_loss, &current).expect("a cut");
        assert_eq!((cut.starts_at, cut.alternative_above), (1220, true));
        // One probe is not a run; a win everywhere is not a cut; under 2% is no win.
        for alternative in [
            [104.0, 103.0, 102.0, 102.0, 102.0, 102.0, 90.0],
            [97.0; 7],
            [103.0, 103.0, 103.0, 103.0, 99.0, 99.0, 99.0],
        ] {
            assert_eq!(
                cut_point(&probes, &current, &alternative, &current),
                None,
                "{alternative:?}"
            );
        }
        // Too few probes to hold two parts of two.
        assert_eq!(
            cut_point(&probes[..3], &current[..3], &upper[4..], &current[..3]),
            None
        );
    }

    #[test]
    fn a_cut_holds_where_the_cut_layer_wins_its_part_and_keeps_the_other() {
        let probes = cut_probes(513, 16384);
        let current = [100.0; 7];
        let above = RegimeCut {
            starts_at: 2172,
            alternative_above: true,
            gain: 0.17,
        };
        // The alternative's part is the last four probes; the choice's part the first three.
        let holds = [100.5, 99.0, 101.0, 97.0, 95.0, 96.0, 95.0];
        assert!(cut_holds(&above, &probes, &current, &holds, &current));
        // The second pass does not confirm the win ...
        let drifted = [100.0, 100.0, 100.0, 99.0, 99.0, 98.0, 101.5];
        assert!(!cut_holds(&above, &probes, &current, &drifted, &current));
        // ... or the cut costs the choice's part more than noise (its router planned for
        // the part's own range, say).
        let costs_below = [100.0, 102.0, 100.0, 97.0, 95.0, 96.0, 95.0];
        assert!(!cut_holds(
            &above,
            &probes,
            &current,
            &costs_below,
            &current
        ));
        let below = RegimeCut {
            alternative_above: false,
            ..above
        };
        let low = [95.0, 96.0, 97.0, 100.0, 101.0, 100.0, 99.0];
        assert!(cut_holds(&below, &probes, &current, &low, &current));
        assert!(!cut_holds(&below, &probes, &current, &holds, &current));
    }

    #[test]
    fn an_alternative_beating_the_choice_over_all_the_probes_takes_the_whole_regime() {
        let probes = cut_probes(513, 16384);
        let current = [100.0; 7];
        let everywhere = [97.0, 98.0, 100.5, 97.0, 96.0, 97.0, 96.0];
        let Some(ProbeVerdict::Whole { gain }) =
            probe_verdict(&probes, &current, &everywhere, &current)
        else {
            panic!("a whole-regime verdict")
        };
        assert!((gain - 0.185).abs() < 1e-9, "{gain}");
        // Losing more than noise at one probe makes it a cut at most ...
        let upper = [104.0, 103.0, 101.5, 97.0, 95.0, 96.0, 95.0];
        assert!(matches!(
            probe_verdict(&probes, &current, &upper, &current),
            Some(ProbeVerdict::Cut(RegimeCut {
                starts_at: 2172,
                alternative_above: true,
                ..
            }))
        ));
        // ... and it wins nothing where it does not win a run at an end.
        let middle = [103.0, 97.0, 90.0, 90.0, 90.0, 97.0, 103.0];
        assert_eq!(probe_verdict(&probes, &current, &middle, &current), None);
        // A narrow regime (too few probes for a cut) can still be taken whole.
        assert!(matches!(
            probe_verdict(
                &probes[..3],
                &current[..3],
                &everywhere[3..6],
                &current[..3]
            ),
            Some(ProbeVerdict::Whole { .. })
        ));
        // The model's choice bounds it as it bounds any candidate.
        let model = [96.0; 7];
        assert_eq!(probe_verdict(&probes, &current, &everywhere, &model), None);
    }

    #[test]
    fn a_part_takes_the_times_of_the_counts_it_holds() {
        let entry = |min_tokens, max_tokens| TunedRegime {
            gpu: "H100".to_string(),
            shape: TunedShape::of(&small_shape()),
            min_tokens,
            max_tokens,
            gemm1: None,
            gemm2: None,
            timed_tokens: vec![5],
            measured_us: 1.0,
            model_choice_us: 2.0,
            self_routed: false,
            measured_on: "then".to_string(),
            measured_by: "an older build".to_string(),
        };
        let tokens = [1, 11, 128];
        let (us, model) = ([10.0, 20.0, 40.0], [11.0, 22.0, 44.0]);
        let lower = timed_within(entry(0, 24), &tokens, &us, &model);
        assert_eq!(lower.timed_tokens, [1, 11]);
        assert_eq!((lower.measured_us, lower.model_choice_us), (30.0, 33.0));
        let upper = timed_within(entry(25, 128), &tokens, &us, &model);
        assert_eq!(upper.timed_tokens, [128]);
        assert_eq!((upper.measured_us, upper.model_choice_us), (40.0, 44.0));
        // A part holding none of the counts keeps its own times.
        let between = timed_within(entry(12, 127), &tokens, &us, &model);
        assert_eq!(between, entry(12, 127));
    }

    /// Two plans timed in turns each get their own times, in the order they were passed:
    /// the cost model's plan and one whose GEMM1 has a narrow mma.sync tile (several times
    /// slower at 1500 tokens), timed in both orders, and each alone. Only the order of the
    /// times is checked: the suite runs several test processes on one GPU at once, whose
    /// turns on it fall into any of these times.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn two_plans_timed_in_turns_each_get_their_own_times() {
        let source = include_str!("../../tests/fixtures/untuned_small.moe");
        let module =
            moeforge_compiler::compile_source("untuned_small.moe", source).expect("compiles");
        let layer = &module.layers[0];
        let session = Session::open().expect("a GPU session");
        let target = Target::for_device(&session.gpu.facts().expect("device facts"));
        let model = plan::plan(layer, &target).expect("plans");
        let tokens = [1500];
        let regime = model
            .regimes
            .iter()
            .find(|r| (r.min_tokens..=r.max_tokens).contains(&tokens[0]))
            .expect("a regime holds 1500 tokens");
        let narrow: TunedGemm = serde_json::from_value(serde_json::json!({
            "engine": "mma_sync", "tile": { "m": 16, "n": 64, "k": 64 }, "stages": 2, "cluster": 1
        }))
        .expect("a GEMM configuration");
        let entry = TunedRegime {
            gpu: target.name.clone(),
            shape: TunedShape::of(&model.shape),
            min_tokens: regime.min_tokens,
            max_tokens: regime.max_tokens,
            gemm1: Some(narrow),
            gemm2: None,
            timed_tokens: tokens.to_vec(),
            measured_us: 0.0,
            model_choice_us: 0.0,
            self_routed: false,
            measured_on: "test".to_string(),
            measured_by: "test".to_string(),
        };
        let slow = plan::plan_tuned(
            layer,
            &target,
            &TuningTable {
                entries: vec![entry],
            },
        )
        .expect("plans");
        let settings = TuneSettings {
            candidates: 1,
            iterations: 5,
            seed: 7,
            regimes_holding: Vec::new(),
            in_use: TuningTable::default(),
            probe_regimes: false,
            caller_routed: false,
        };
        let compiled = |plan: &Plan| with_kernels(&session, plan.clone()).expect("compiles");
        let in_turns = |first: &Plan, second: &Plan| {
            time_regimes_in_turns(
                &session,
                [compiled(first), compiled(second)],
                &tokens,
                &settings,
            )
            .expect("times both")
        };
        let alone = |plan: &Plan| {
            time_regime(&session, compiled(plan), &tokens, &settings).expect("times")[0]
        };
        let [fast, slow_us] = in_turns(&model, &slow);
        let [slow_again, fast_again] = in_turns(&slow, &model);
        let (fast_alone, slow_alone) = (alone(&model), alone(&slow));
        let times = [
            fast[0],
            slow_us[0],
            slow_again[0],
            fast_again[0],
            fast_alone,
            slow_alone,
        ];
        assert!(
            times.iter().all(|us| us.is_finite() && *us > 0.0),
            "{times:?}"
        );
        // Each order gives each plan its own times, as each runs alone.
        assert!(1.2 * fast[0] < slow_us[0], "{times:?}");
        assert!(1.2 * fast_again[0] < slow_again[0], "{times:?}");
        assert!(1.2 * fast_alone < slow_alone, "{times:?}");
    }

    #[test]
    fn a_caller_routed_tune_times_a_layer_with_a_router_on_the_callers_routing() {
        let layer_of = |name: &str, source: &str| {
            moeforge_compiler::compile_source(name, source)
                .expect("compiles")
                .layers
                .remove(0)
        };
        let routed = layer_of(
            "mixtral_8x7b.moe",
            include_str!("../../dsl-examples/mixtral_8x7b.moe"),
        );
        let unrouted = layer_of(
            "untuned_small.moe",
            include_str!("../../tests/fixtures/untuned_small.moe"),
        );
        let settings = |caller_routed| TuneSettings {
            candidates: 1,
            iterations: 1,
            seed: 1,
            regimes_holding: Vec::new(),
            in_use: TuningTable::default(),
            probe_regimes: false,
            caller_routed,
        };
        assert!(settings(false).times_self_routed(&routed));
        assert!(!settings(true).times_self_routed(&routed));
        assert!(!settings(false).times_self_routed(&unrouted));
        assert!(!settings(true).times_self_routed(&unrouted));
    }

    #[test]
    fn losses_against_the_model_choice_do_not_add_up() {
        // The current choice is already 1% slower than the model's at the first count; a
        // candidate another 1% slower there (2% in all) does not win, however fast elsewhere.
        let model = [100.0, 1000.0];
        let current = [101.0, 900.0];
        assert!(!beats(&[102.0, 700.0], &current, &model));
        assert!(beats(&[101.0, 700.0], &current, &model));
    }
}
