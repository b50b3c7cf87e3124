//! `moeforge bench FILE --tokens 1,16,128`: per token count, the median CUDA-event time of
//! the layer next to the cuBLAS baseline measured in the same run, with the roofline floor;
//! prints a table and writes JSON and Markdown to `benches/results/`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::runtime::bench::{
    BenchRow, BenchSettings, ExpertParallelRow, bench_expert_parallel, bench_layer,
};
use moeforge::runtime::gpu::Gpu;
use moeforge::runtime::toolkit;
use moeforge::runtime::workload::fresh_seed;
use serde::Serialize;

use super::planning::{
    RankChoice, TargetArgs, build_on_gpu, check_ranks, plan_file_over, plan_one,
};
use super::run::{RoutingArg, routing_name};
use super::{OK, invalid_input, usage_error};

/// Benchmark a layer against the cuBLAS per-expert baseline on the GPU.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file holding the layer.
    file: PathBuf,
    /// Which layer of the file (needed when it has several).
    #[arg(long)]
    layer: Option<String>,
    /// Token counts, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,16,128,1024,4096,16384"
    )]
    tokens: Vec<u32>,
    /// Timed calls per token count (after 3 warm-up calls).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    #[arg(long, value_enum, default_value_t = RoutingArg::Uniform)]
    routing: RoutingArg,
    #[arg(long)]
    seed: Option<u64>,
    /// Expert-parallel ranks as virtual ranks on one GPU (1: every expert on one GPU).
    #[arg(long, conflicts_with = "gpus")]
    ranks: Option<u32>,
    /// Expert-parallel ranks on this many GPUs, one rank each, driven by this process.
    #[arg(long)]
    gpus: Option<u32>,
    #[command(flatten)]
    target: TargetArgs,
    /// Where the JSON and Markdown results go.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
}

#[derive(Serialize)]
struct BenchReport<'a> {
    layer: &'a str,
    date: String,
    gpu: String,
    commit: &'static str,
    routing: &'static str,
    baseline_note: Option<String>,
    rows: &'a [BenchRow],
}

/// Today's date (UTC) as YYYY-MM-DD, from the civil-from-days algorithm.
fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

fn header() -> String {
    "|     T | regime  | moeforge us | TFLOP/s |   GB/s | floor us | of floor | cuBLAS us | speed-up | agree |".to_string()
}

fn table_row(row: &BenchRow) -> String {
    let cublas = row
        .cublas_us
        .map_or("-".to_string(), |us| format!("{us:.1}"));
    let speedup = row.cublas_us.map_or("-".to_string(), |us| {
        format!("{:.2}x", us / row.moeforge_us)
    });
    let agree = row
        .cublas_agreement
        .map_or("-".to_string(), |e| format!("{e:.0e}"));
    format!(
        "| {:>5} | {:<7} | {:>11.1} | {:>7.1} | {:>6.0} | {:>8.1} | {:>7.0}% | {:>9} | {:>8} | {:>5} |",
        row.tokens,
        row.regime,
        row.moeforge_us,
        row.tflops,
        row.gbps,
        row.roofline.floor_us,
        row.fraction_of_floor * 100.0,
        cublas,
        speedup,
        agree
    )
}

pub fn run(args: &Args) -> ExitCode {
    let choice = match (args.ranks, args.gpus) {
        (Some(ranks), None) if ranks > 1 => Some(RankChoice {
            ranks,
            virtual_ranks: true,
        }),
        (None, Some(gpus)) if gpus > 1 => Some(RankChoice {
            ranks: gpus,
            virtual_ranks: false,
        }),
        _ => None,
    };
    if let Some(choice) = choice {
        return run_expert_parallel(args, choice);
    }
    let plan = match plan_one(&args.file, args.layer.as_deref(), &args.target.resolve()) {
        Ok(plan) => plan,
        Err(status) => return status,
    };
    if let Err(status) = check_ranks(&plan, args.ranks) {
        return status;
    }
    if let Some(&too_many) = args.tokens.iter().find(|&&t| t > plan.shape.max_tokens) {
        eprintln!(
            "error: --tokens {too_many} exceeds the layer's max_tokens of {}",
            plan.shape.max_tokens
        );
        return usage_error();
    }
    if args.iterations == 0 {
        eprintln!("error: --iterations must be at least 1");
        return usage_error();
    }
    if let Err(error) = toolkit::driver_available() {
        eprintln!("error: bench needs a GPU: {error}");
        return usage_error();
    }
    let seed = fresh_seed(args.seed);
    let layer_name = plan.layer.clone();
    let (session, built) = match build_on_gpu(plan, seed) {
        Ok(built) => built,
        Err(status) => return status,
    };
    let gpu = session.gpu.name();
    println!(
        "{layer_name} on {gpu}, {} routing, median of {} calls, seed {seed}",
        routing_name(args.routing),
        args.iterations
    );
    println!("{}", header());
    let outcome = bench_layer(
        &session,
        &built,
        &args.tokens,
        args.routing.into(),
        args.iterations,
        seed,
        |row| {
            println!("{}", table_row(row));
        },
    );
    let (rows, baseline_note) = match outcome {
        Ok(result) => result,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    if let Some(note) = &baseline_note {
        println!("baseline not run: {note}");
    }
    let report = BenchReport {
        layer: &layer_name,
        date: utc_date(),
        gpu,
        commit: env!("MOEFORGE_COMMIT"),
        routing: routing_name(args.routing),
        baseline_note,
        rows: &rows,
    };
    let stem = format!("{}_{}_{}", report.date, layer_name, report.routing);
    let mut markdown = format!(
        "# {layer_name} on {} ({}, commit {}, {} routing)\n\nFloor = max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s); bytes = weights of the experts hit + activations in and out.\n\n{}\n|{}|\n",
        report.gpu,
        report.date,
        report.commit,
        report.routing,
        header(),
        "---|".repeat(10).trim_end_matches('|')
    );
    for row in &rows {
        let _ = writeln!(markdown, "{}", table_row(row));
    }
    let json = match serde_json::to_string_pretty(&report) {
        Ok(json) => json,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    if let Err(error) = std::fs::create_dir_all(&args.out)
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.json")), json))
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.md")), markdown))
    {
        eprintln!(
            "error: cannot write results to {}: {error}",
            args.out.display()
        );
        return usage_error();
    }
    eprintln!("wrote {}/{stem}.json and .md", args.out.display());
    OK
}

/// `bench --ranks R` / `--gpus G`: the expert-parallel layer against the same tokens on one
/// GPU with every expert.
fn run_expert_parallel(args: &Args, choice: RankChoice) -> ExitCode {
    let mut plans = match plan_file_over(
        &args.file,
        args.layer.as_deref(),
        &args.target.resolve(),
        Some(choice),
    ) {
        Ok(plans) => plans,
        Err(status) => return status,
    };
    if plans.len() != 1 {
        eprintln!(
            "error: {} has several layers; pick one with --layer",
            args.file.display()
        );
        return usage_error();
    }
    let plan = plans.remove(0);
    if args.iterations == 0 {
        eprintln!("error: --iterations must be at least 1");
        return usage_error();
    }
    let seed = fresh_seed(args.seed);
    let layer_name = plan.layer.clone();
    let (session, built) = match build_on_gpu(plan, seed) {
        Ok(built) => built,
        Err(status) => return status,
    };
    let mut contexts = vec![std::sync::Arc::clone(&session.gpu.ctx)];
    for rank in 1..choice.ranks as usize {
        if choice.virtual_ranks {
            contexts.push(std::sync::Arc::clone(&session.gpu.ctx));
        } else {
            match Gpu::open_context(rank) {
                Ok(ctx) => contexts.push(ctx),
                Err(error) => {
                    eprintln!("error: --gpus {}: {error}", choice.ranks);
                    return usage_error();
                }
            }
        }
    }
    let mut ep = match session.build_expert_parallel(&built, &contexts) {
        Ok(ep) => ep,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    let placement = if choice.virtual_ranks {
        format!(
            "{} virtual ranks on one {}",
            choice.ranks,
            session.gpu.name()
        )
    } else {
        format!("{} x {}", choice.ranks, session.gpu.name())
    };
    println!(
        "{layer_name}, expert-parallel over {placement}, {} routing, mean of {} pipelined calls, seed {seed}",
        routing_name(args.routing),
        args.iterations
    );
    let header =
        "| T per rank | expert-parallel us | same tokens on one GPU us | rows crossing GB/s |";
    println!("{header}");
    let format_row = |row: &ExpertParallelRow| {
        format!(
            "| {:>10} | {:>18.1} | {:>25} | {:>18.1} |",
            row.tokens_per_rank,
            row.expert_parallel_us,
            row.one_gpu_us
                .map_or("above max_tokens".to_string(), |us| format!("{us:.1}")),
            row.crossed_gb_per_s
        )
    };
    let rows = match bench_expert_parallel(
        &session,
        &built,
        &mut ep,
        &BenchSettings {
            token_counts: &args.tokens,
            routing: args.routing.into(),
            iterations: args.iterations,
            seed,
        },
        |row| println!("{}", format_row(row)),
    ) {
        Ok(rows) => rows,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    let date = utc_date();
    let stem = format!(
        "{date}_{layer_name}_ep{}{}_{}",
        choice.ranks,
        if choice.virtual_ranks { "v" } else { "" },
        routing_name(args.routing)
    );
    let mut markdown = format!(
        "# {layer_name}, expert-parallel over {placement} ({date}, commit {})\n\nExpert-parallel time is wall time per call over pipelined calls (host launches included); one-GPU time is moeforge's single-GPU kernels on all ranks' tokens (CUDA events).\n\n{header}\n|---|---|---|---|\n",
        env!("MOEFORGE_COMMIT")
    );
    for row in &rows {
        let _ = writeln!(markdown, "{}", format_row(row));
    }
    let json = serde_json::json!({
        "layer": layer_name,
        "date": date,
        "placement": placement,
        "commit": env!("MOEFORGE_COMMIT"),
        "routing": routing_name(args.routing),
        "rows": rows,
    });
    if let Err(error) = std::fs::create_dir_all(&args.out)
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.json")), json.to_string()))
        .and_then(|()| std::fs::write(args.out.join(format!("{stem}.md")), markdown))
    {
        eprintln!(
            "error: cannot write results to {}: {error}",
            args.out.display()
        );
        return usage_error();
    }
    eprintln!("wrote {}/{stem}.json and .md", args.out.display());
    OK
}
