//! `moeforge tune FILE`: times the cost model's best GEMM configurations of each regime of
//! a layer on this GPU and stores the fastest in the tuning cache (see
//! [`moeforge::tuning`]), which every later plan of the same layer on this GPU uses.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::plan::tuning::TunedGemm;
use moeforge::compiler::plan::{self, GemmKind, Target};
use moeforge::runtime::harness::Session;
use moeforge::runtime::tune::{
    CUT_PROBES, MAX_LOSS, MIN_GAIN, MIN_PART_PROBES, ProbeRole, TuneEvent, TuneSettings, tune_layer,
};
use moeforge::runtime::workload::fresh_seed;
use moeforge::tuning;

use super::bench::utc_date;
use super::planning::{TargetArgs, one_layer};
use super::{OK, compile_file, invalid_input, usage_error};

/// Measure candidate GEMM configurations of a layer on the GPU; the fastest per regime go
/// to the tuning cache, which planning on this GPU then uses.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file holding the layer.
    file: PathBuf,
    /// Which layer of the file (needed when it has several).
    #[arg(long)]
    layer: Option<String>,
    /// Candidate tiles timed per GEMM and regime (the cost model's choice and its next best;
    /// an mma.sync tile with 64- and with 128-deep stages), besides the neighbouring regimes'
    /// choices, which are always timed too.
    #[arg(long, default_value_t = 3)]
    candidates: usize,
    /// Timed calls per token count (after 6 warm-up calls: each of 3 input sets twice), median.
    #[arg(long, default_value_t = 10)]
    iterations: usize,
    /// Seed of the random inputs and weights; fresh each run when omitted.
    #[arg(long)]
    seed: Option<u64>,
    /// The tuning table to update (default: the cache, see `moeforge::tuning`).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Tune only the regimes holding these token counts (each is still timed at its own
    /// smallest, middle and largest call); the cache's other entries stay as they are.
    /// Default: every regime.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Skip the probes across each regime: make no new cut (a regime cut in two where other
    /// GEMMs are fastest at one end of it adds a regime's kernels to the layer: two GEMMs,
    /// and the router's where the spec has one), and give no regime those GEMMs where they
    /// beat its choice over the whole of it (the sweep's choice still stands or falls as
    /// without the probes). A cut already in use is still timed, and stays unless beaten.
    #[arg(long)]
    keep_regimes: bool,
    /// Time calls that pass their own routing (uniform) even where the spec has a router,
    /// for an engine that routes tokens itself; by default such a layer's calls route
    /// themselves, as it runs unless told otherwise. The fastest GEMMs can differ between
    /// the two (the rows each expert gets, the router's kernel between calls); the entries
    /// say which calls they were timed on (`moeforge explain`).
    #[arg(long)]
    caller_routed: bool,
}

/// Times per timed call, as the tune prints them.
fn joined(us: &[f64]) -> String {
    let each: Vec<String> = us.iter().map(|t| format!("{t:.1}")).collect();
    each.join(" / ")
}

/// What a new choice must be to replace the current one, as the tune says it.
fn winning_rule() -> String {
    format!(
        "both {:.0}% faster on average and at most {:.0}% slower at every timed call",
        MIN_GAIN * 100.0,
        MAX_LOSS * 100.0
    )
}

pub fn run(args: &Args) -> ExitCode {
    if args.candidates == 0 || args.iterations == 0 {
        eprintln!("error: --candidates and --iterations count from 1");
        return usage_error();
    }
    // The hints are checked for the GPU the tune will measure on.
    let (_, module) = match compile_file(&args.file, &TargetArgs::present()) {
        Ok(compiled) => compiled,
        Err(status) => return status,
    };
    let layer = match one_layer(&args.file, &module, args.layer.as_deref()) {
        Ok(layer) => layer,
        Err(status) => return status,
    };
    if [GemmKind::Up, GemmKind::Down]
        .into_iter()
        .all(|kind| plan::gemm_hinted(layer, kind))
    {
        println!(
            "nothing to tune: the spec of `{}` hints both GEMMs (their tiles, or the stages); the hints stand",
            layer.name
        );
        return OK;
    }
    if let Some(&beyond) = args.tokens.iter().find(|&&t| t > layer.max_tokens) {
        eprintln!(
            "error: --tokens {beyond} is beyond the {} tokens `{}` is planned for (max_tokens)",
            layer.max_tokens, layer.name
        );
        return usage_error();
    }
    let cache = match args.cache.clone().map_or_else(tuning::cache_path, Ok) {
        Ok(path) => path,
        Err(error) => {
            eprintln!("error: {error}");
            return usage_error();
        }
    };
    // Read before measuring: a cache that cannot be updated should not cost minutes of GPU.
    // What planning with this cache uses today (the shipped entries, then its own; none
    // with MOEFORGE_TUNING=off) is timed against each regime's new choice.
    let in_use = match tuning::load(&cache).and_then(|cached| tuning::planning_with(&cached)) {
        Ok(table) => table,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    let session = match Session::open() {
        Ok(session) => session,
        Err(error) => {
            eprintln!("error: {error}");
            return usage_error();
        }
    };
    let target = match session.gpu.facts() {
        Ok(facts) => Target::for_device(&facts),
        Err(error) => {
            eprintln!("error: {error}");
            return usage_error();
        }
    };
    let settings = TuneSettings {
        candidates: args.candidates,
        iterations: args.iterations,
        seed: fresh_seed(args.seed),
        regimes_holding: args.tokens.clone(),
        in_use,
        probe_regimes: !args.keep_regimes,
        caller_routed: args.caller_routed,
    };
    let routing_note = if settings.times_self_routed(layer) {
        " (self-routed: the spec has a router)"
    } else if layer.router.is_some() {
        " (caller-routed, on uniform routing passed in: the spec's router is not run)"
    } else {
        " (on uniform routing)"
    };
    let which = if args.tokens.is_empty() {
        String::new()
    } else {
        let tokens: Vec<String> = args.tokens.iter().map(u32::to_string).collect();
        format!(" (only the regimes holding T = {})", tokens.join(", "))
    };
    let probes = if args.keep_regimes {
        "; no probes across the regimes (no new cut, no whole-regime change from them)".to_string()
    } else {
        format!(
            "; then, where other GEMMs were fastest at one end of a regime, both pairs timed at {CUT_PROBES} calls across it: the regime cut in two where those GEMMs win a run of that end so, leaving at least {MIN_PART_PROBES} calls on each side, or given them where they beat its choice over all of them so, if a second pass timing the layer so changed and the choice again, their calls in turns, agrees"
        )
    };
    eprintln!(
        "tuning `{}`{which} on {}: {} candidate tiles per GEMM and regime (an mma.sync tile at both stage depths) and the neighbouring regimes' GEMMs, each a whole layer timed{routing_note} at its regime's smallest, middle and largest call ({} calls each, median; a winner is {:.0}% faster on average and at most {:.0}% slower at any of them, than the current choice and than the cost model's; an entry in use for the regime, or else the cost model's GEMMs, timed again in turns with the choice, stays unless beaten so there){probes}",
        layer.name,
        target.name,
        args.candidates,
        args.iterations,
        MIN_GAIN * 100.0,
        MAX_LOSS * 100.0
    );
    let mut done = 0usize;
    let mut saved = Ok(());
    let gemm_name = |gemm: GemmKind| match gemm {
        GemmKind::Up => "gemm1",
        GemmKind::Down => "gemm2",
    };
    let report = |event: TuneEvent<'_>| match event {
        TuneEvent::Compiling {
            regime,
            gemm,
            candidates,
        } => {
            eprintln!(
                "        {regime:<13} {}: compiling {candidates} candidates",
                gemm_name(gemm)
            );
            let _ = std::io::stderr().flush();
        }
        TuneEvent::Candidate(t) => {
            done += 1;
            let gemm = gemm_name(t.gemm);
            let outcome = match &t.us {
                Ok(us) => format!("{} us", joined(us)),
                Err(reason) => format!("left out: {reason}"),
            };
            eprintln!(
                "  [{done:>3}] {:<13} {gemm} {}/{}  {:<36} {outcome}{}",
                t.regime,
                t.index,
                t.of,
                t.config.describe(),
                if t.is_model_choice {
                    "  (as the cost model chose it)"
                } else {
                    ""
                }
            );
            let _ = std::io::stderr().flush();
        }
        TuneEvent::InUse {
            regime,
            entry,
            us,
            kept,
        } => {
            let gemms: Vec<String> = [("gemm1", entry.gemm1), ("gemm2", entry.gemm2)]
                .into_iter()
                .filter_map(|(name, gemm)| Some(format!("{name} {}", gemm?.describe())))
                .collect();
            let outcome = match us {
                Ok(times) => {
                    let verdict = if kept {
                        format!("kept: the new choice is not {}", winning_rule())
                    } else {
                        "replaced".to_string()
                    };
                    let how = match &times.not_in_turns {
                        None => "in turns".to_string(),
                        Some(reason) => format!(
                            "the entry alone, beside the sweep's times: not in turns ({reason})"
                        ),
                    };
                    format!(
                        "{} us against the new choice's {} us ({how}; {verdict})",
                        joined(&times.entry),
                        joined(&times.choice)
                    )
                }
                Err(reason) => format!("left out: {reason}"),
            };
            eprintln!(
                "        {regime:<13} in use ({}..={} tokens; {}, {}): {}  {outcome}",
                entry.min_tokens,
                entry.max_tokens,
                entry.measured_by,
                entry.measured_on,
                gemms.join(", ")
            );
            let _ = std::io::stderr().flush();
        }
        TuneEvent::Confirmed {
            regime,
            gemms: [gemm1, gemm2],
            us,
            stands,
        } => {
            let outcome = match us {
                Ok([model_us, choice_us]) => {
                    let verdict = if stands {
                        "it stands".to_string()
                    } else {
                        format!(
                            "the cost model's GEMMs stay: the choice is not {}",
                            winning_rule()
                        )
                    };
                    format!(
                        "{} us against the cost model's {} us  ({verdict})",
                        joined(&choice_us),
                        joined(&model_us)
                    )
                }
                Err(reason) => format!("not timed ({reason}): the sweep's times stand"),
            };
            eprintln!(
                "        {regime:<13} again, in turns with the cost model's: gemm1 {}, gemm2 {}  {outcome}",
                gemm1.describe(),
                gemm2.describe()
            );
            let _ = std::io::stderr().flush();
        }
        TuneEvent::Probe {
            regime,
            role,
            gemms: [gemm1, gemm2],
            tokens,
            us,
        } => {
            let role = match role {
                ProbeRole::Chosen => "its choice".to_string(),
                ProbeRole::CostModel => "cost model".to_string(),
                ProbeRole::Alternative => "other end".to_string(),
                ProbeRole::AlternativeAgain => "other end again".to_string(),
                ProbeRole::Cut {
                    starts_at,
                    alternative_above: true,
                } => format!("cut at {starts_at}, from there"),
                ProbeRole::Cut { starts_at, .. } => format!("cut at {starts_at}, below it"),
                ProbeRole::ChosenAgain => "its choice again".to_string(),
            };
            let outcome = match us {
                Ok(us) => {
                    let each: Vec<String> = tokens
                        .iter()
                        .zip(&us)
                        .map(|(t, us)| format!("{t}: {us:.1}"))
                        .collect();
                    format!("{} us", each.join(", "))
                }
                Err(reason) => format!("left out: {reason}"),
            };
            eprintln!(
                "        {regime:<13} probe {role:<24} gemm1 {}, gemm2 {}  {outcome}",
                gemm1.describe(),
                gemm2.describe()
            );
            let _ = std::io::stderr().flush();
        }
        // Saved as each regime ends, so that an interrupted run keeps what it measured.
        TuneEvent::Regime(entries) => {
            if saved.is_ok() {
                saved = tuning::update(&cache, entries);
            }
        }
    };
    let measured_by = format!(
        "moeforge {} at {}",
        env!("CARGO_PKG_VERSION"),
        env!("MOEFORGE_COMMIT")
    );
    let result = tune_layer(
        &session,
        layer,
        &target,
        settings,
        &utc_date(),
        &measured_by,
        report,
    );
    let entries = match result {
        Ok(entries) => entries,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    if let Err(error) = saved {
        eprintln!("error: {error}");
        return invalid_input();
    }
    println!(
        "| regime's tokens | timed at T | gemm1 | gemm2 | tuned us | cost model's us | speed-up |"
    );
    println!("|---|---|---|---|---|---|---|");
    let gemm = |g: Option<TunedGemm>| g.map_or("(hinted)".to_string(), |g| g.describe());
    for entry in &entries {
        let tokens: Vec<String> = entry.timed_tokens.iter().map(u32::to_string).collect();
        println!(
            "| {}..={} | {} | {} | {} | {:.1} | {:.1} | {:.2}x |",
            entry.min_tokens,
            entry.max_tokens,
            tokens.join(", "),
            gemm(entry.gemm1),
            gemm(entry.gemm2),
            entry.measured_us,
            entry.model_choice_us,
            entry.model_choice_us / entry.measured_us
        );
    }
    println!("wrote {} entries to {}", entries.len(), cache.display());
    OK
}
