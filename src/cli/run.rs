//! `moeforge run FILE --tokens N [--check] [--ranks R | --gpus G] [--weights PATH]`:
//! compiles a layer and, when a GPU is present, runs it once on fresh random inputs (and
//! with `--check` compares with the CPU reference). With `--ranks R` (virtual ranks on one
//! GPU) or `--gpus G` (one rank per GPU) the layer runs expert-parallel, every rank with
//! its own N tokens. The experts' weights are random, or with `--weights` those of a
//! checkpoint's layer (see [`super::weights`]): loaded and checked on the host first, then
//! every expert uploaded for the single-GPU layer (which the reference reads) and, when
//! expert-parallel, each rank's share read from the checkpoint for that rank. Without a
//! GPU it stops after loading the weights and compiling, and says so.

use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::codegen;
use moeforge::runtime::aot;
use moeforge::runtime::harness::{BuiltLayer, CHECKED_TOKENS, Session};
use moeforge::runtime::jit::Jit;
use moeforge::runtime::toolkit;
use moeforge::runtime::workload::{Routing, Workload, fresh_seed};

use moeforge::runtime::layer::RoutedForwardArgs;

use super::planning::{
    RankChoice, TargetArgs, build_on_gpu_with_gate, note_one_rank, plan_file_over, plan_one,
};
use super::weights::{Loaded, WeightsArgs};
use super::{OK, invalid_input, usage_error};

/// Run a layer on random inputs (fresh per run, seeded), optionally checked against the CPU reference.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file holding the layer.
    file: PathBuf,
    /// Which layer of the file (needed when it has several).
    #[arg(long)]
    layer: Option<String>,
    /// Tokens in the call (at most the layer's max_tokens).
    #[arg(long)]
    tokens: u32,
    /// Compare with the CPU reference (on a random sample of at most --sample tokens).
    #[arg(long)]
    check: bool,
    /// Tokens the reference checks when T is larger (a random sample, reported as such).
    #[arg(long, default_value_t = CHECKED_TOKENS)]
    sample: usize,
    /// How tokens choose experts when the spec has no router (with one, on one GPU, the
    /// layer routes itself: the gate GEMM and the spec's rule choose).
    #[arg(long, value_enum, default_value_t = RoutingArg::Uniform)]
    routing: RoutingArg,
    /// Seed of the random inputs; fresh each run when omitted.
    #[arg(long)]
    seed: Option<u64>,
    /// Expert-parallel ranks as virtual ranks on one GPU (1: every expert on one GPU).
    #[arg(long, conflicts_with = "gpus")]
    ranks: Option<u32>,
    /// Expert-parallel ranks on this many GPUs, one rank each, driven by this process.
    #[arg(long)]
    gpus: Option<u32>,
    #[command(flatten)]
    weights: WeightsArgs,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum RoutingArg {
    /// K distinct experts per token, uniformly.
    Uniform,
    /// Every token's first choice is expert 0.
    Skewed,
}

impl From<RoutingArg> for Routing {
    fn from(arg: RoutingArg) -> Self {
        match arg {
            RoutingArg::Uniform => Routing::Uniform,
            RoutingArg::Skewed => Routing::Skewed,
        }
    }
}

/// Compiles without a GPU: NVRTC only, so that the main job is useful on any machine.
fn compile_only(plan: &moeforge::compiler::plan::Plan, why: &str) -> ExitCode {
    eprintln!("note: {why}; compiling only");
    let source = match codegen::generate(plan) {
        Ok(source) => source,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    let jit = match Jit::from_env() {
        Ok(jit) => jit,
        Err(error) => {
            eprintln!("error: {error}");
            return usage_error();
        }
    };
    let started = std::time::Instant::now();
    match jit.compile(&source.source, &aot::compile_options(plan)) {
        Ok(module) => {
            println!(
                "compiled {} ({} kernels, {} bytes of PTX{}) for {} in {:.2} s; not run: no GPU",
                source.file_name,
                source.entry_points.len(),
                module.ptx.len(),
                if module.cache_hit() {
                    ", from the cache"
                } else {
                    ""
                },
                plan.target.arch,
                started.elapsed().as_secs_f64()
            );
            OK
        }
        Err(error) => {
            eprintln!("error: {error}");
            invalid_input()
        }
    }
}

pub fn run(args: &Args) -> ExitCode {
    let choice = RankChoice::from_flags(args.ranks, args.gpus);
    let plan = match choice {
        Some(choice) => {
            match plan_file_over(
                &args.file,
                args.layer.as_deref(),
                &args.target.resolve(),
                Some(choice),
            ) {
                Ok(mut plans) if plans.len() == 1 => plans.remove(0),
                Ok(_) => {
                    eprintln!(
                        "error: {} has several layers; pick one with --layer",
                        args.file.display()
                    );
                    return usage_error();
                }
                Err(status) => return status,
            }
        }
        None => match plan_one(&args.file, args.layer.as_deref(), &args.target.resolve()) {
            Ok(plan) => plan,
            Err(status) => return status,
        },
    };
    if choice.is_none()
        && let Err(status) = note_one_rank(&plan, args.ranks, args.gpus)
    {
        return status;
    }
    if args.tokens > plan.shape.max_tokens {
        eprintln!(
            "error: --tokens {} exceeds the layer's max_tokens of {}; raise max_tokens in the spec",
            args.tokens, plan.shape.max_tokens
        );
        return usage_error();
    }
    let loaded = match args.weights.load(&plan.shape) {
        Ok(loaded) => loaded,
        Err(status) => return status,
    };
    // A spec with a router routes itself on one GPU: its gate comes from the checkpoint
    // too (random weights come with a random gate). The expert-parallel path takes
    // caller-passed choices.
    let gate = match (&loaded, &plan.router, choice) {
        (Some(loaded), Some(router), None) => match loaded.gate(&plan.shape, &router.rule) {
            Ok(gate) => Some(gate),
            Err(status) => return status,
        },
        _ => None,
    };
    if let Err(error) = toolkit::driver_available() {
        return compile_only(&plan, &error.to_string());
    }
    let seed = fresh_seed(args.seed);
    let shape = plan.shape.clone();
    let regime = plan
        .regime_for(args.tokens)
        .map(|r| r.name.clone())
        .unwrap_or_default();
    let (session, built) =
        match build_on_gpu_with_gate(plan, seed, loaded.as_ref().map(|l| &l.all), gate) {
            Ok(built) => built,
            Err(status) => return status,
        };
    if let Some(choice) = choice {
        return run_expert_parallel(args, choice, &session, &built, loaded.as_ref(), seed);
    }
    drop(loaded);
    let routes_itself = built.layer.routes_itself();
    eprintln!(
        "compiled in {:.2} s{}; running T={} ({} regime, {} routing, seed {seed})",
        built.compile_seconds,
        if built.module.cache_hit() {
            " (cache hit)"
        } else {
            ""
        },
        args.tokens,
        regime,
        if routes_itself {
            "the spec's router's"
        } else {
            routing_name(args.routing)
        }
    );
    // With a router, the workload's own random choices are not used: the layer chooses.
    let workload = Workload::random(&shape, args.tokens, args.routing.into(), seed);
    if args.check {
        let checked = if routes_itself {
            session.run_checked_routed(&built, &workload, args.sample, seed.wrapping_add(1))
        } else {
            session.run_checked(&built, &workload, args.sample, seed.wrapping_add(1))
        };
        match checked {
            Ok(report) => {
                println!(
                    "{} T={}: {report}: {}",
                    built.layer.plan().layer,
                    report.tokens,
                    if report.passed() { "PASS" } else { "FAIL" }
                );
                if report.passed() { OK } else { invalid_input() }
            }
            Err(error) => {
                eprintln!("error: {error}");
                invalid_input()
            }
        }
    } else {
        let result = session
            .upload(&shape, &workload)
            .map_err(|e| e.to_string())
            .and_then(|mut io| {
                let forward = if routes_itself {
                    built.layer.forward_routed(RoutedForwardArgs {
                        tokens: io.tokens,
                        x: &io.x,
                        y: &mut io.y,
                    })
                } else {
                    session.forward(&built.layer, &mut io)
                };
                forward.map_err(|e| e.to_string())
            })
            .and_then(|()| built.layer.take_error().map_err(|e| e.to_string()));
        match result {
            Ok(()) => {
                println!(
                    "{} T={}: ran (pass --check to compare with the CPU reference)",
                    built.layer.plan().layer,
                    args.tokens
                );
                OK
            }
            Err(error) => {
                eprintln!("error: {error}");
                invalid_input()
            }
        }
    }
}

/// The expert-parallel call: every rank runs `--tokens` tokens of its own; with
/// `loaded`, each rank's experts are read from the checkpoint for that rank.
fn run_expert_parallel(
    args: &Args,
    choice: RankChoice,
    session: &Session,
    built: &BuiltLayer,
    loaded: Option<&Loaded>,
    seed: u64,
) -> ExitCode {
    let shape = built.layer.plan().shape.clone();
    let mut ep = match choice.contexts(session).and_then(|contexts| {
        let weights = loaded
            .map(|loaded| loaded.rank_weights(&shape, &contexts))
            .transpose()?;
        choice.build(session, built, &contexts, weights)
    }) {
        Ok(ep) => ep,
        Err(status) => return status,
    };
    let workloads: Vec<Workload> = (0..choice.ranks)
        .map(|r| {
            Workload::random(
                &shape,
                args.tokens,
                args.routing.into(),
                seed ^ u64::from(r),
            )
        })
        .collect();
    eprintln!(
        "running T={} per rank over {} ({} routing, seed {seed})",
        args.tokens,
        choice.placement(&session.gpu.name()),
        routing_name(args.routing)
    );
    let sample = if args.check { args.sample } else { 0 };
    let name = &built.layer.plan().layer;
    match session.run_checked_expert_parallel(
        built,
        &mut ep,
        &workloads,
        sample,
        seed.wrapping_add(1),
    ) {
        Ok(reports) if args.check => {
            let mut passed = true;
            for (r, report) in reports.iter().enumerate() {
                passed &= report.passed();
                println!(
                    "{} rank {r} T={}: {report}: {}",
                    name,
                    report.tokens,
                    if report.passed() { "PASS" } else { "FAIL" }
                );
            }
            if passed { OK } else { invalid_input() }
        }
        Ok(_) => {
            println!(
                "{} T={} on each of {} ranks: ran (pass --check to compare with the CPU reference)",
                name, args.tokens, choice.ranks
            );
            OK
        }
        Err(error) => {
            eprintln!("error: {error}");
            invalid_input()
        }
    }
}

pub fn routing_name(routing: RoutingArg) -> &'static str {
    match routing {
        RoutingArg::Uniform => "uniform",
        RoutingArg::Skewed => "skewed",
    }
}
