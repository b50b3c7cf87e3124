//! `moeforge run FILE (--tokens N | --inputs FILE) [--check] [--outputs FILE]
//! [--ranks R | --gpus G] [--weights PATH]`: compiles a layer and, when a GPU is present,
//! runs it once on fresh random inputs, or on those of an `--inputs` file (see
//! [`super::call_file`]), and with `--check` compares with the CPU reference; `--outputs`
//! writes what the call produced. With `--ranks R` (virtual ranks on one
//! GPU) or `--gpus G` (one rank per GPU) the layer runs expert-parallel, every rank with
//! its own N tokens. The experts' weights are random, or with `--weights` those of a
//! checkpoint's layer (see [`super::weights`]): loaded and checked on the host first, then
//! every expert uploaded for the single-GPU layer (which the reference reads) and, when
//! expert-parallel, each rank's share read from the checkpoint for that rank. Without a
//! GPU it stops after loading the weights and compiling with NVRTC, and says so (without
//! NVRTC, after loading, with the toolkit error: exit 2).
//!
//! Launched as one rank of a group of processes (`RANK`, `WORLD_SIZE`, ... set; see
//! [`super::group`]), it runs its own rank's `--tokens N` tokens and, with `--check`,
//! compares its own output with the CPU reference (random weights only).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use moeforge::compiler::codegen;
use moeforge::runtime::aot;
use moeforge::runtime::call_file::GivenRouting;
use moeforge::runtime::ep::EpLayer;
use moeforge::runtime::harness::{BuiltLayer, CHECKED_TOKENS, CheckReport, HarnessError, Session};
use moeforge::runtime::jit::Jit;
use moeforge::runtime::process_group::LaunchEnv;
use moeforge::runtime::toolkit;
use moeforge::runtime::workload::{Routing, Workload, fresh_seed};

use super::call_file;
use super::group;
use super::planning::{
    RankChoice, TargetArgs, build_on_gpu_with_gate, note_one_rank, plan_file_over, plan_one,
};
use super::weights::{Loaded, WeightsArgs};
use super::{OK, invalid_input, usage_error};

/// Run a layer on random inputs (fresh per run, seeded) or those of a file, optionally checked against the CPU reference.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file holding the layer.
    file: PathBuf,
    /// Which layer of the file (needed when it has several).
    #[arg(long)]
    layer: Option<String>,
    /// Tokens in the call (at most the layer's max_tokens), drawn at random; required
    /// unless --inputs gives them.
    #[arg(long, required_unless_present = "inputs", conflicts_with = "inputs")]
    tokens: Option<u32>,
    /// Run on the inputs in a safetensors file instead of random ones: `x` [tokens, hidden]
    /// BF16 and, optionally, the caller's routing `topk_ids` [tokens, top_k] I32 with
    /// `topk_weights` [tokens, top_k] F32 (without them the spec's router chooses). One GPU
    /// only (no --ranks or --gpus above 1).
    #[arg(long, value_name = "FILE", conflicts_with = "routing")]
    inputs: Option<PathBuf>,
    /// Write what the call produced to a safetensors file: `y` [tokens, hidden] BF16, the
    /// routing used (`topk_ids` I32, `topk_weights` F32) and, when the layer routed itself,
    /// `router_logits` [tokens, experts] F32. Like --inputs, on one GPU only.
    #[arg(long, value_name = "FILE")]
    outputs: Option<PathBuf>,
    /// Compare with the CPU reference (on a random sample of at most --sample tokens).
    #[arg(long)]
    check: bool,
    /// Tokens the reference checks when T is larger (a random sample, reported as such).
    #[arg(long, default_value_t = CHECKED_TOKENS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    sample: usize,
    /// How tokens choose experts when the spec has no router (with one, the layer routes
    /// itself, on one GPU and on expert-parallel ranks: the gate GEMM and the spec's rule
    /// choose).
    #[arg(long, value_enum, default_value_t = RoutingArg::Uniform)]
    routing: RoutingArg,
    /// Seed of the random inputs; fresh each run when omitted.
    #[arg(long)]
    seed: Option<u64>,
    /// Expert-parallel ranks as virtual ranks on one GPU (1: every expert on one GPU).
    #[arg(long, conflicts_with = "gpus")]
    ranks: Option<u32>,
    /// Expert-parallel ranks on this many GPUs, one rank each, driven by this process (or,
    /// launched as a group of rank processes, the ranks of the group: WORLD_SIZE).
    #[arg(long)]
    gpus: Option<u32>,
    /// Fault injection for tests of a group of rank processes: this rank exits after
    /// joining the group, before its call, as a process that died would.
    #[arg(long, hide = true)]
    exit_before_call: bool,
    /// Fault injection for tests of a group of rank processes: at this call (counted from
    /// one) this rank enqueues nothing that sends, as a peer that stopped would, and its
    /// peers' transfers with it never finish.
    #[arg(long, hide = true, value_name = "CALL")]
    stop_sending_at_call: Option<u32>,
    /// Calls in a row on the same inputs, as one rank of a group of rank processes (flags
    /// carry the epoch: no call needs a reset); with --check the first and the last are
    /// compared with the CPU reference, and every call's kernel errors are read.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    calls: u32,
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
    /// Token t's pairs go to experts t·K, t·K + 1, … (mod E): every expert gets T·K/E rows
    /// (±1), the best case for filling row tiles.
    Balanced,
}

impl From<RoutingArg> for Routing {
    fn from(arg: RoutingArg) -> Self {
        match arg {
            RoutingArg::Uniform => Routing::Uniform,
            RoutingArg::Skewed => Routing::Skewed,
            RoutingArg::Balanced => Routing::Balanced,
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
    match jit.compile_kernels(
        &source.source,
        &plan.entry_points_in_compile_order(),
        &aot::compile_options(plan),
    ) {
        Ok(kernels) => {
            println!(
                "compiled {} ({} kernels, kernel by kernel; {} bytes of PTX{}) for {} in {:.2} s; not run: no GPU",
                source.file_name,
                source.entry_points.len(),
                kernels.ptx_bytes(),
                if kernels.cache_hit() {
                    ", from the cache"
                } else {
                    ""
                },
                plan.target.arch,
                started.elapsed().as_secs_f64()
            );
            for note in kernels.notes() {
                eprintln!("note: {note}");
            }
            OK
        }
        Err(error) => {
            eprintln!("error: {error}");
            invalid_input()
        }
    }
}

pub fn run(args: &Args) -> ExitCode {
    match group::launched(args.ranks) {
        Ok(Some(env)) => return run_as_rank(args, &env),
        Ok(None) => {}
        Err(status) => return status,
    }
    if args.calls > 1 {
        eprintln!(
            "error: --calls runs a rank of a group of rank processes (RANK, WORLD_SIZE, ... set); one process makes one call"
        );
        return usage_error();
    }
    let choice = RankChoice::from_flags(args.ranks, args.gpus);
    if choice.is_some() && (args.inputs.is_some() || args.outputs.is_some()) {
        eprintln!(
            "error: --inputs and --outputs run the layer on one GPU; drop --ranks and --gpus (or pass --ranks 1)"
        );
        return usage_error();
    }
    let plan = match choice {
        Some(choice) => {
            match plan_file_over(
                &args.file,
                args.layer.as_deref(),
                &args.target.resolve(),
                Some(choice),
                false,
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
    let inputs = match &args.inputs {
        Some(path) => match call_file::read(path, &plan.shape, plan.router.is_some()) {
            Ok(inputs) => Some(inputs),
            Err(status) => return status,
        },
        None => None,
    };
    let tokens = match (&inputs, args.tokens) {
        (Some(inputs), _) => inputs.tokens,
        (None, Some(tokens)) if tokens > plan.shape.max_tokens => {
            eprintln!(
                "error: --tokens {tokens} exceeds the layer's max_tokens of {}; raise max_tokens in the spec",
                plan.shape.max_tokens
            );
            return usage_error();
        }
        (None, Some(tokens)) => tokens,
        (None, None) => {
            eprintln!("error: pass --tokens N or --inputs FILE");
            return usage_error();
        }
    };
    let rule = plan.router.as_ref().map(|router| &router.rule);
    let loaded = match args.weights.load(&plan.shape, rule) {
        Ok(loaded) => loaded,
        Err(status) => return status,
    };
    // A spec with a router routes itself, on one GPU and on expert-parallel ranks: its
    // gate comes from the checkpoint too (random weights come with a random gate).
    let gate = match (&loaded, &plan.router) {
        (Some(loaded), Some(router)) => match loaded.gate(&plan.shape, &router.rule) {
            Ok(gate) => Some(gate),
            Err(status) => return status,
        },
        _ => None,
    };
    if let Err(error) = toolkit::driver_available() {
        if let Some(path) = &args.outputs {
            eprintln!("note: {} is not written: nothing runs", path.display());
        }
        return compile_only(&plan, &error.to_string());
    }
    let seed = fresh_seed(args.seed);
    let shape = plan.shape.clone();
    let regime = plan
        .regime_for(tokens)
        .map(|r| r.name.clone())
        .unwrap_or_default();
    let (session, built) =
        match build_on_gpu_with_gate(plan, seed, loaded.as_ref().map(|l| &l.all), gate) {
            Ok(built) => built,
            Err(status) => return status,
        };
    if let Some(choice) = choice {
        return run_expert_parallel(
            args,
            tokens,
            choice,
            &session,
            &built,
            loaded.as_ref(),
            seed,
        );
    }
    drop(loaded);
    // The call's activations, and the caller's routing unless the layer routes itself:
    // that of the inputs file when it holds one, else random (with a router, the layer
    // chooses).
    let (x, caller_routing) = match inputs {
        Some(inputs) => (inputs.x, inputs.routing),
        None => {
            let workload = Workload::random(&shape, tokens, args.routing.into(), seed);
            let routing = (!built.layer.routes_itself()).then_some(GivenRouting {
                topk_ids: workload.topk_ids,
                topk_weights: workload.topk_weights,
            });
            (workload.x, routing)
        }
    };
    let routing_said = match (&caller_routing, &args.inputs) {
        (None, _) => "the spec's router's",
        (Some(_), Some(_)) => "the inputs'",
        (Some(_), None) => routing_name(args.routing),
    };
    eprintln!(
        "compiled in {:.2} s{}, loaded into the GPU in {:.1} ms ({}); running T={tokens} ({regime} regime, {routing_said} routing, seed {seed})",
        built.compile_seconds,
        if built.module.cache_hit() {
            " (cache hit)"
        } else {
            ""
        },
        built.load_seconds * 1e3,
        built.loaded,
    );
    let caller_workload = caller_routing.map(|routing| Workload {
        tokens,
        x: x.clone(),
        topk_ids: routing.topk_ids,
        topk_weights: routing.topk_weights,
    });
    let outputs = match &caller_workload {
        Some(workload) => session.run_collect(&built, workload),
        None => session.run_routed_collect(&built, tokens, &x),
    };
    let outputs = match outputs {
        Ok(outputs) => outputs,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    if let Some(path) = &args.outputs
        && let Err(status) = call_file::write(path, &shape, &outputs)
    {
        return status;
    }
    if !args.check {
        println!(
            "{} T={tokens}: ran (pass --check to compare with the CPU reference)",
            built.layer.plan().layer,
        );
        return OK;
    }
    let check_seed = seed.wrapping_add(1);
    let checked = match &caller_workload {
        Some(workload) => {
            session.check_output(&built, workload, &outputs.y, args.sample, check_seed)
        }
        None => session.check_routed(&built, &x, &outputs, args.sample, check_seed),
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
}

/// The expert-parallel call: every rank runs `--tokens` tokens of its own; with
/// `loaded`, each rank's experts are read from the checkpoint for that rank.
fn run_expert_parallel(
    args: &Args,
    tokens: u32,
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
    // Every rank passes `tokens`: across emulated nodes the loopback moves what they fill.
    if let Err(error) = ep.bound_tokens(Some(tokens)) {
        eprintln!("error: {error}");
        return invalid_input();
    }
    let workloads: Vec<Workload> = (0..choice.ranks)
        .map(|r| Workload::random(&shape, tokens, args.routing.into(), seed ^ u64::from(r)))
        .collect();
    eprintln!(
        "running T={tokens} per rank over {} ({} routing, seed {seed})",
        choice.placement(&session.gpu.name()),
        ranks_routing(args, &ep)
    );
    let sample = if args.check { args.sample } else { 0 };
    let outcome = run_expert_parallel_call(
        session,
        built,
        &mut ep,
        &workloads,
        sample,
        seed.wrapping_add(1),
    );
    match outcome {
        Ok(reports) => report_ranks(args, &ep, built, &reports),
        Err(error) => {
            eprintln!("error: {error}");
            invalid_input()
        }
    }
}

/// Prints each rank's check (or that the call ran), naming ranks as the layer does.
fn report_ranks(
    args: &Args,
    ep: &EpLayer,
    built: &BuiltLayer,
    reports: &[CheckReport],
) -> ExitCode {
    let name = &built.layer.plan().layer;
    let mut passed = true;
    for (r, report) in reports.iter().enumerate() {
        let rank = ep.rank_index(r);
        if args.check {
            passed &= report.passed();
            println!(
                "{name} rank {rank} T={}: {report}: {}",
                report.tokens,
                if report.passed() { "PASS" } else { "FAIL" }
            );
        } else {
            println!(
                "{name} rank {rank} T={}: ran (pass --check to compare with the CPU reference)",
                report.tokens
            );
        }
    }
    if passed { OK } else { invalid_input() }
}

/// `run` as one rank of a group of rank processes: its own `--tokens` tokens, checked
/// against the CPU reference with `--check`.
fn run_as_rank(args: &Args, env: &LaunchEnv) -> ExitCode {
    if args.inputs.is_some() || args.outputs.is_some() || args.weights.given() {
        eprintln!(
            "error: --inputs, --outputs and --weights are not supported by rank processes yet; run them in one process (--gpus G)"
        );
        return usage_error();
    }
    let plan = match group::plan(
        &args.file,
        args.layer.as_deref(),
        &args.target.resolve(),
        args.gpus,
        env,
    ) {
        Ok(plan) => plan,
        Err(status) => return status,
    };
    // A rank that cannot take part leaves the group, rather than leave its peers waiting.
    let Some(tokens) = args.tokens else {
        return group::leave_without_taking_part(
            env,
            &plan,
            "pass --tokens N (this rank's tokens)",
        );
    };
    if tokens > plan.shape.max_tokens {
        let why = format!(
            "--tokens {tokens} exceeds the layer's max_tokens of {}; raise max_tokens in the spec",
            plan.shape.max_tokens
        );
        return group::leave_without_taking_part(env, &plan, &why);
    }
    if let Err(error) = toolkit::driver_available() {
        return group::leave_without_taking_part(env, &plan, &format!("needs a GPU: {error}"));
    }
    let shape = plan.shape.clone();
    let group::RankBuilt {
        session,
        built,
        mut ep,
        seed,
    } = match group::start(
        env,
        plan,
        fresh_seed(args.seed),
        &format!("--calls {}", args.calls),
    ) {
        Ok(rank) => rank,
        Err(status) => return status,
    };
    // The ranks' most tokens: across nodes, NCCL moves what the largest call can fill.
    if let Err(error) = ep.bound_tokens(Some(tokens)) {
        eprintln!("error: rank {}: {error}", env.rank);
        return invalid_input();
    }
    if args.exit_before_call {
        eprintln!(
            "rank {}: exiting before the call (--exit-before-call)",
            env.rank
        );
        std::process::exit(3);
    }
    let workload = Workload::random(
        &shape,
        tokens,
        args.routing.into(),
        seed ^ u64::from(env.rank),
    );
    eprintln!(
        "rank {} of {} on GPU {} ({}): running T={tokens} ({} routing, seed {seed})",
        env.rank,
        env.world_size,
        env.local_rank,
        session.gpu.name(),
        ranks_routing(args, &ep)
    );
    let sample = if args.check { args.sample } else { 0 };
    let started = Instant::now();
    let mut outcome = Ok(Vec::new());
    for call in 1..=args.calls {
        // The first and the last call are checked; those between only for kernel errors.
        let checked = if call == 1 || call == args.calls {
            sample
        } else {
            0
        };
        if args.stop_sending_at_call == Some(call) {
            eprintln!(
                "rank {}: call {call} sends nothing (--stop-sending-at-call)",
                env.rank
            );
            ep.withhold_sends_once(0);
        }
        outcome = run_expert_parallel_call(
            &session,
            &built,
            &mut ep,
            std::slice::from_ref(&workload),
            checked,
            seed.wrapping_add(1),
        );
        match &outcome {
            Ok(reports) if call < args.calls && !reports.iter().all(|r| r.passed()) => break,
            Ok(_) if call % CALLS_PER_PROGRESS_LINE == 0 => {
                eprintln!("rank {}: call {call} of {} done", env.rank, args.calls);
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    match outcome {
        Ok(reports) => report_ranks(args, &ep, &built, &reports),
        Err(error) => {
            eprintln!(
                "error: rank {} (after {:.1} s): {error}",
                env.rank,
                started.elapsed().as_secs_f64()
            );
            group::exit_if_network_abandoned(&ep);
            invalid_input()
        }
    }
}

/// Whose routing the expert-parallel calls run: the spec's router's, where the layer routes
/// itself, else `--routing`'s.
fn ranks_routing(args: &Args, ep: &EpLayer) -> &'static str {
    if ep.routes_itself() {
        "the spec's router's"
    } else {
        routing_name(args.routing)
    }
}

/// One expert-parallel call on the ranks' `workloads`, checked on `sample` tokens per rank:
/// routed by each rank's router on the workloads' x where the layer routes itself, else by
/// the workloads' choices.
fn run_expert_parallel_call(
    session: &Session,
    built: &BuiltLayer,
    ep: &mut EpLayer,
    workloads: &[Workload],
    sample: usize,
    seed: u64,
) -> Result<Vec<CheckReport>, HarnessError> {
    if !ep.routes_itself() {
        return session.run_checked_expert_parallel(built, ep, workloads, sample, seed);
    }
    let counts: Vec<u32> = workloads.iter().map(|w| w.tokens).collect();
    let xs: Vec<Vec<u16>> = workloads.iter().map(|w| w.x.clone()).collect();
    session.run_checked_routed_expert_parallel(built, ep, &counts, &xs, 1, sample, seed)
}

/// A rank making many calls says how far it got every this many (tests of a peer lost
/// mid-run wait for such a line).
const CALLS_PER_PROGRESS_LINE: u32 = 100;

pub fn routing_name(routing: RoutingArg) -> &'static str {
    match routing {
        RoutingArg::Uniform => "uniform",
        RoutingArg::Skewed => "skewed",
        RoutingArg::Balanced => "balanced",
    }
}
