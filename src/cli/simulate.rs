//! `moeforge simulate FILE`: predicts one call of a layer's expert-parallel schedule on
//! its declared topology (the compiler's `simulate` module) for three schedules (four
//! across nodes: the kernels as built too), and
//! optionally draws its timeline or compares it with a bench result.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use moeforge::compiler::plan;
use moeforge::compiler::simulate::{self, Options, Routing, Schedule, Step, calibration};

use super::planning::{TargetArgs, one_layer, report_plan_error, token_counts};
use super::{OK, compile_file, counted, invalid_input, usage_error};

/// The token counts per rank `simulate` runs at ([`token_counts`]).
const DEFAULT_TOKENS: [u32; 5] = [1, 16, 128, 1024, 4096];

/// Simulate a layer's expert-parallel schedule: layer time, dispatch and combine latency of
/// bulk-synchronous, fine-grained (naive order) and fine-grained (topology-aware) exchange,
/// and across real nodes of the kernels as built.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file.
    file: PathBuf,
    /// The layer to simulate (needed when the file has several).
    #[arg(long)]
    layer: Option<String>,
    /// Tokens per rank per call, comma-separated [default: 1,16,128,1024,4096; those above
    /// the layer's max_tokens are replaced by max_tokens].
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// How tokens pick experts: uniform (seeded random), skewed (every token to experts
    /// 0..top_k, the worst case), grouped (within --groups-kept of --groups equal groups
    /// of experts, as DeepSeek-V3's router limits them) or balanced (token t's pairs to
    /// experts t·K, t·K + 1, … mod E on every rank, as `bench --routing balanced`).
    #[arg(long, value_enum, default_value_t = RoutingArg::Uniform)]
    routing: RoutingArg,
    /// Grouped routing: the experts' groups (default: the layer's router's group limit).
    #[arg(long, value_name = "G")]
    groups: Option<u32>,
    /// Grouped routing: the groups each token keeps (default: the layer's router's).
    #[arg(long, value_name = "K")]
    groups_kept: Option<u32>,
    /// Expert-parallel ranks instead of the spec's, each on a GPU of its own (virtual ranks
    /// too); nodes grow to hold them (`gpus_per_node` from the spec's topology).
    #[arg(long)]
    ranks: Option<u32>,
    /// Write an SVG timeline of the topology-aware schedule at the first token count.
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// A bench result of uniform or balanced routing (`benches/results/*_ep2_uniform*.json`,
    /// `*_ep2v_balanced*.json`, ...) to print the predictions beside; the layer is planned as
    /// the bench ran it: over the file's ranks (one GPU each, or virtual ranks on one GPU),
    /// with or without its shared experts as the file says, each rank's call routed as the
    /// bench drew it (uniform: from the file's seed), for the GPU the file was measured on
    /// where it names a known one (`--target` overrides). Its token counts, routing and ranks
    /// are the file's: it takes none of those options, nor `--svg`.
    #[arg(
        long,
        value_name = "JSON",
        conflicts_with_all = ["tokens", "routing", "groups", "groups_kept", "ranks", "svg"]
    )]
    measured: Option<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RoutingArg {
    Uniform,
    Skewed,
    Grouped,
    Balanced,
}

/// Routed pairs (ranks × tokens per rank × top_k) from which a call's simulation shows its
/// progress: 1024 ranks at 1024 tokens per rank and top_k 8 (8.4 million) took 13 s on a
/// two-core machine (2026-12-07), about a second per 700 000 pairs.
const LONG_SIMULATION_PAIRS: u64 = 2_000_000;

/// Ranks drawn in the SVG timeline.
const SVG_RANKS: u32 = 8;

pub fn run(args: &Args) -> ExitCode {
    let measured = match &args.measured {
        Some(path) => match calibration::MeasuredFile::read(path) {
            Ok(file) => Some(file),
            Err(error) => {
                eprintln!("error: {error}");
                return usage_error();
            }
        },
        None => None,
    };
    // Predictions set beside measurements are made for the GPU that measured them.
    let measured_on = measured.as_ref().and_then(|m| m.measured_on());
    let target = match (args.target.chosen(), measured_on) {
        (Some(chosen), _) => chosen,
        (None, Some(measured_on)) => {
            eprintln!(
                "note: predicting for {}, the GPU the measurements ran on (--target chooses another)",
                measured_on.name
            );
            measured_on
        }
        (None, None) => args.target.resolve(),
    };
    let (source, module) = match compile_file(&args.file, &target) {
        Ok(compiled) => compiled,
        Err(status) => return status,
    };
    let mut layer = match one_layer(&args.file, &module, args.layer.as_deref()) {
        Ok(layer) => layer.clone(),
        Err(status) => return status,
    };
    if let (Some(path), Some(file)) = (&args.measured, &measured)
        && file.layer != layer.name
    {
        eprintln!(
            "error: {} measured layer `{}`, not `{}` of {}: pass the spec that file was benched from",
            path.display(),
            file.layer,
            layer.name,
            args.file.display()
        );
        return usage_error();
    }
    let ranks = args.ranks.or(measured
        .as_ref()
        .and_then(|m| m.rows.first().map(|row| row.ranks)));
    if let Some(ranks) = ranks {
        if ranks < 2 || !layer.experts.is_multiple_of(ranks) {
            eprintln!(
                "error: --ranks {ranks}: need at least 2 ranks that split the {} experts evenly",
                layer.experts
            );
            return usage_error();
        }
        layer.parallel.expert = ranks;
        if measured.as_ref().is_some_and(|m| m.on_virtual_ranks()) {
            layer.topology.gpus_per_node = 1;
            layer.topology.nodes = 1;
            layer.topology.virtual_ranks = Some(ranks);
        } else {
            let per_node = layer.topology.gpus_per_node.clamp(1, ranks);
            layer.topology.gpus_per_node = per_node;
            layer.topology.nodes = ranks.div_ceil(per_node);
            layer.topology.virtual_ranks = None;
        }
    }
    // Predict what the bench ran.
    if measured
        .as_ref()
        .is_some_and(|m| m.without_shared_experts())
        && let Some(shared) = layer.shared_experts.take()
    {
        eprintln!(
            "note: the bench result ran without the {} of `{}`; so does the simulation",
            counted(shared.count, "shared expert"),
            layer.name
        );
    }
    let plan = match plan::plan(&layer, &target) {
        Ok(plan) => plan,
        Err(error) => {
            report_plan_error(&source, &layer, &target, &error);
            return invalid_input();
        }
    };
    if plan.expert_parallel.is_none() {
        eprintln!(
            "error: layer `{}` has one expert-parallel rank: no exchange to simulate; pass --ranks R (R ≥ 2 dividing its {} experts) or set `parallel {{ expert = R }}` in the spec",
            layer.name, layer.experts
        );
        return usage_error();
    }
    let topology = simulate::Topology::of(&layer.topology);
    if let Some(measured) = &measured {
        return print_comparison(&plan, &topology, measured);
    }
    let limit = layer.router.and_then(|router| router.group_limit);
    let routing = match args.routing {
        RoutingArg::Uniform => Routing::Uniform,
        RoutingArg::Skewed => Routing::Skewed,
        RoutingArg::Balanced => Routing::Balanced,
        RoutingArg::Grouped => {
            let groups = args.groups.or(limit.map(|l| l.groups));
            let kept = args.groups_kept.or(limit.map(|l| l.kept));
            let (Some(groups), Some(kept)) = (groups, kept) else {
                eprintln!(
                    "error: --routing grouped needs --groups and --groups-kept: layer `{}` has no router with a group limit to take them from",
                    layer.name
                );
                return usage_error();
            };
            if let Some(why) = Routing::group_limit_error(layer.experts, layer.top_k, groups, kept)
            {
                eprintln!("error: --routing grouped: {why}");
                return usage_error();
            }
            Routing::GroupLimited { groups, kept }
        }
    };
    if args.routing != RoutingArg::Grouped && (args.groups.is_some() || args.groups_kept.is_some())
    {
        eprintln!("error: --groups and --groups-kept go with --routing grouped");
        return usage_error();
    }
    let token_list = match token_counts(
        args.tokens.as_deref(),
        &DEFAULT_TOKENS,
        1,
        plan.shape.max_tokens,
    ) {
        Ok(tokens) => tokens,
        Err(status) => return status,
    };
    if let Some(path) = args.svg.as_deref() {
        let folder = path.parent().filter(|f| !f.as_os_str().is_empty());
        let why_not = if path.is_dir() {
            Some(format!("{} is a folder: name the SVG file", path.display()))
        } else {
            folder
                .filter(|f| !f.is_dir())
                .map(|f| format!("the folder {} does not exist", f.display()))
        };
        if let Some(why_not) = why_not {
            eprintln!("error: --svg: {why_not}");
            return usage_error();
        }
    }
    for (i, &tokens) in token_list.iter().enumerate() {
        let options = Options {
            tokens_per_rank: tokens,
            routing,
            timeline_ranks: if i == 0 && args.svg.is_some() {
                SVG_RANKS
            } else {
                0
            },
            fused_decode: true,
        };
        let started = Instant::now();
        let planned_ranks = plan.expert_parallel.as_ref().map_or(1, |ep| ep.ranks);
        let pairs = u64::from(planned_ranks) * u64::from(tokens) * u64::from(plan.shape.top_k);
        let long = pairs >= LONG_SIMULATION_PAIRS;
        if long {
            eprintln!(
                "simulating {} at {} per rank on {} ({pairs} routed pairs: a few seconds per schedule) ...",
                layer.name,
                counted(tokens, "token"),
                counted(planned_ranks, "rank"),
            );
        }
        let step = |step: Step| {
            if long {
                eprintln!(
                    "  {} of {} schedules simulated ({:.1} s): {}",
                    step.index + 1,
                    step.of,
                    started.elapsed().as_secs_f64(),
                    step.schedule.name()
                );
            }
        };
        let report = match simulate::simulate_reporting(&plan, &topology, &options, step) {
            Ok(report) => report,
            Err(error) => {
                eprintln!("error: {}: {error}", layer.name);
                return invalid_input();
            }
        };
        let seconds = started.elapsed().as_secs_f64();
        let placement = if topology.virtual_ranks && topology.nodes > 1 {
            // Emulated nodes' network steps are copies on the one GPU too.
            format!(
                "virtual ranks on one GPU (emulating {}: all their traffic simulated on the one GPU; `--ranks {}` puts them on GPUs of their own)",
                counted(topology.nodes, "node"),
                report.ranks
            )
        } else if topology.virtual_ranks {
            "virtual ranks on one GPU".to_string()
        } else {
            format!("ranks on {}", counted(report.nodes, "node"))
        };
        println!(
            "{}: {} {placement}, {} per rank, {} routing, regime {} (simulated in {seconds:.2} s)",
            report.layer,
            report.ranks,
            counted(tokens, "token"),
            report.routing.name(),
            report.regime
        );
        if let Some(deadlock) = &report.deadlock {
            println!(
                "  DEADLOCK: {} waits for {}: {}",
                deadlock.waiting, deadlock.waits_for, deadlock.reason
            );
            return invalid_input();
        }
        println!(
            "  {:30} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "schedule", "layer us", "dispatch us", "combine us", "compute us", "network us"
        );
        for s in &report.schedules {
            println!(
                "  {:30} {:12.1} {:12.1} {:12.1} {:12.1} {:12.1}",
                s.schedule.name(),
                s.layer_s * 1e6,
                s.dispatch_s * 1e6,
                s.combine_s * 1e6,
                s.compute_s * 1e6,
                s.network_s * 1e6
            );
        }
        if let (Some(reduction), Some(aware)) = (
            report.exchange_reduction(),
            report.schedule(Schedule::FineGrainedTopologyAware),
        ) {
            println!(
                "  the topology-aware exchange (dispatch + combine) is {:.0}% shorter than the bulk-synchronous one; its layer takes {:.2}x max(compute, network)",
                reduction * 100.0,
                aware.over_bound()
            );
        }
        if let (Some(built), Some(aware)) = (
            report.schedule(Schedule::AsBuilt),
            report.schedule(Schedule::FineGrainedTopologyAware),
        ) {
            println!(
                "  as built, the layer takes {:.2}x the topology-aware design's: the same hierarchical exchange and routed chunks, but GEMM2 runs after GEMM1 and the node partials leave once the relay has every rank's (the design overlaps GEMM2 with GEMM1 and streams results)",
                built.layer_s / aware.layer_s
            );
        }
        if i == 0
            && let Some(path) = &args.svg
            && let Some(schedule) = report
                .schedules
                .iter()
                .find(|s| s.schedule == Schedule::FineGrainedTopologyAware)
        {
            let title = format!("{} at {tokens} tokens per rank", report.layer);
            if let Err(error) = std::fs::write(path, simulate::timeline_svg(&title, schedule)) {
                eprintln!("error: cannot write {}: {error}", path.display());
                return usage_error();
            }
        }
    }
    OK
}

/// Every cell of a bench result beside the prediction, with the error.
fn print_comparison(
    plan: &plan::Plan,
    topology: &simulate::Topology,
    measured: &calibration::MeasuredFile,
) -> ExitCode {
    let cells = match calibration::compare(plan, topology, measured) {
        Ok(cells) => cells,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    println!(
        "{} on {} ({} routing): measured / predicted us (error)",
        measured.layer, measured.placement, measured.routing
    );
    // Files from 2026-12-05 on time every rank's GEMM1 too.
    let per_rank = cells.iter().any(|c| c.gemm1_slowest.is_some());
    println!(
        "| T per rank | expert-parallel | bulk-synchronous | dispatch stage | GEMM stage | combine stage | GEMM1, rank 0 | GEMM2, rank 0 |{}",
        if per_rank {
            " GEMM1, slowest rank |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---|---|---|---|---|---|{}",
        if per_rank { "---|" } else { "" }
    );
    let cell = |pair: (f64, f64)| {
        format!(
            "{:.1} / {:.1} ({:+.0}%)",
            pair.0,
            pair.1,
            calibration::error(pair) * 100.0
        )
    };
    let split = |pair: Option<(f64, f64)>| pair.map_or_else(|| "-".to_string(), cell);
    for c in &cells {
        let expert_parallel = format!(
            "{}{}",
            cell(c.expert_parallel),
            if c.fused_decode { " (fused)" } else { "" }
        );
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |{}",
            c.tokens_per_rank,
            expert_parallel,
            cell(c.bulk_synchronous),
            cell(c.dispatch),
            cell(c.gemm),
            cell(c.combine),
            split(c.gemm1),
            split(c.gemm2),
            if per_rank {
                format!(" {} |", split(c.gemm1_slowest))
            } else {
                String::new()
            }
        );
    }
    OK
}
