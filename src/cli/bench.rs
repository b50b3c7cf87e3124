//! `moeforge bench FILE --tokens 1,16,128`: per token count, the median CUDA-event time of
//! the layer next to the cuBLAS baseline measured in the same run, with the roofline floor;
//! prints a table and writes JSON and Markdown to `benches/results/DATE_LAYER_..._at_COMMIT.*`
//! (the commit the binary was built from, so that two builds run on one day keep both).
//!
//! Launched as a group of rank processes (`RANK`, `WORLD_SIZE`, ... set; see
//! [`super::group`]), every rank times its calls and rank 0 prints each token count's
//! slowest rank and every rank's time (no files, no baselines).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use moeforge::compiler::plan::Plan;
use moeforge::runtime::bench::{
    BenchRow, BenchSettings, ExpertParallelRow, PIPELINED_PASSES, bench_expert_parallel,
    bench_group_rank, bench_layer,
};
use moeforge::runtime::layer::EarlyStarts;
use moeforge::runtime::nccl_pipeline::NcclPipeline;
use moeforge::runtime::peers::{PeerReport, run_peers};
use moeforge::runtime::process_group::LaunchEnv;
use moeforge::runtime::toolkit;
use moeforge::runtime::workload::fresh_seed;
use serde::Serialize;

use super::group;
use super::planning::{
    RankChoice, TargetArgs, build_on_gpu, note_one_rank, plan_file_over, plan_one, token_counts,
};
use super::run::{RoutingArg, routing_name};
use super::{OK, invalid_input, usage_error};

/// Benchmark a layer on the GPU: against the cuBLAS per-expert baseline on one GPU (with
/// `--peers`, also the PyTorch and Triton pipelines), or over `--ranks`/`--gpus` against
/// its bulk-synchronous variant, the NCCL pipeline and the one-GPU layer.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file holding the layer.
    file: PathBuf,
    /// Which layer of the file (needed when it has several).
    #[arg(long)]
    layer: Option<String>,
    /// Token counts (per rank with --ranks or --gpus), comma separated [default:
    /// 1,16,128,1024,4096,16384; those above the layer's max_tokens are replaced by
    /// max_tokens].
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Timed calls per token count (after 6 warm-up calls: each of 3 input sets twice).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// How the random tokens choose their experts.
    #[arg(long, value_enum, default_value_t = RoutingArg::Uniform)]
    routing: RoutingArg,
    /// Seed of the random inputs and weights (the report names it); fresh each run when
    /// omitted.
    #[arg(long)]
    seed: Option<u64>,
    /// Expert-parallel ranks as virtual ranks on one GPU (1: every expert on one GPU).
    #[arg(long, conflicts_with = "gpus")]
    ranks: Option<u32>,
    /// Expert-parallel ranks on this many GPUs, one rank each, driven by this process (or,
    /// launched as a group of rank processes, the ranks of the group: WORLD_SIZE).
    #[arg(long)]
    gpus: Option<u32>,
    #[command(flatten)]
    target: TargetArgs,
    /// Where the JSON and Markdown results go.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// Also time the in-run peers on the same routing (one GPU): the PyTorch pipeline and
    /// a vLLM-style Triton fused-MoE pair, with and without its alignment, by `python3`
    /// (with torch and triton).
    #[arg(long, conflicts_with_all = ["ranks", "gpus"])]
    peers: bool,
}

#[derive(Serialize)]
struct BenchReport<'a> {
    layer: &'a str,
    date: String,
    gpu: String,
    commit: &'static str,
    routing: &'static str,
    /// The seed of the random inputs (`--seed` replays them).
    seed: u64,
    baseline_note: Option<String>,
    rows: &'a [BenchRow],
    /// The in-run peers (`--peers`), or why they did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    peers: Option<PeerReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peers_note: Option<String>,
}

/// Today's date (UTC) as YYYY-MM-DD, from the civil-from-days algorithm.
pub(super) fn utc_date() -> String {
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

/// moeforge beside the in-run peers, per token count, with the peers' versions and notes.
fn peers_table(rows: &[BenchRow], report: &PeerReport) -> String {
    let us = |v: Option<f64>| v.map_or("-".to_string(), |us| format!("{us:.1}"));
    let mut table = format!(
        "In-run peers on the same routing (torch {}, triton {}; torch pipeline GEMMs: {}; the peers run the shared experts as moeforge does, no expert biases and no router; the peers are timed back to back, as moeforge's back-to-back column):\n\n| T | moeforge us | back-to-back us | floor us | of floor | cuBLAS us | torch us | triton us | triton w/o align us | fastest peer / moeforge | fastest peer / back-to-back | triton block | agree |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        report.torch, report.triton, report.gemm_backend
    );
    for row in rows {
        let peer = report.row(row.tokens);
        let fastest = peer.and_then(|p| {
            [p.torch_us, p.triton_us, p.triton_no_align_us]
                .into_iter()
                .flatten()
                .reduce(f64::min)
        });
        let over = |ours: Option<f64>| match (fastest, ours) {
            (Some(theirs), Some(ours)) => format!("{:.2}x", theirs / ours),
            _ => "-".to_string(),
        };
        let _ = writeln!(
            table,
            "| {} | {:.1} | {} | {:.1} | {:.0}% | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.tokens,
            row.moeforge_us,
            us(row.back_to_back_us),
            row.roofline.floor_us,
            row.fraction_of_floor * 100.0,
            us(row.cublas_us),
            us(peer.and_then(|p| p.torch_us)),
            us(peer.and_then(|p| p.triton_us)),
            us(peer.and_then(|p| p.triton_no_align_us)),
            over(Some(row.moeforge_us)),
            over(row.back_to_back_us),
            peer.and_then(|p| p.triton_config.clone())
                .unwrap_or_else(|| "-".to_string()),
            peer.and_then(|p| p.agree)
                .map_or("-".to_string(), |e| format!("{e:.0e}")),
        );
    }
    for note in &report.notes {
        let _ = writeln!(table, "\nnote: {note}");
    }
    table
}

fn header() -> String {
    "|     T | regime  | moeforge us | TFLOP/s |   GB/s | floor us | of floor | cuBLAS us | speed-up | agree | self-routed us | its floor us | graph us | on its routing us | back-to-back us |".to_string()
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
    let us = |v: Option<f64>| v.map_or("-".to_string(), |us| format!("{us:.1}"));
    format!(
        "| {:>5} | {:<7} | {:>11.1} | {:>7.1} | {:>6.0} | {:>8.1} | {:>7.0}% | {:>9} | {:>8} | {:>5} | {:>14} | {:>12} | {:>8} | {:>17} | {:>15} |",
        row.tokens,
        row.regime,
        row.moeforge_us,
        row.tflops,
        row.gbps,
        row.roofline.floor_us,
        row.fraction_of_floor * 100.0,
        cublas,
        speedup,
        agree,
        us(row.self_routed_us),
        us(row.self_routed_floor_us),
        us(row.graph_us),
        us(row.on_its_routing_us),
        us(row.back_to_back_us)
    )
}

pub fn run(args: &Args) -> ExitCode {
    match group::launched(args.ranks) {
        Ok(Some(env)) => return bench_as_rank(args, &env),
        Ok(None) => {}
        Err(status) => return status,
    }
    let choice = RankChoice::from_flags(args.ranks, args.gpus);
    if let Some(choice) = choice {
        return run_expert_parallel(args, choice);
    }
    let plan = match plan_one(&args.file, args.layer.as_deref(), &args.target.resolve()) {
        Ok(plan) => plan,
        Err(status) => return status,
    };
    if let Err(status) = note_one_rank(&plan, args.ranks, args.gpus) {
        return status;
    }
    let tokens = match check_settings(args, &plan) {
        Ok(tokens) => tokens,
        Err(status) => return status,
    };
    let seed = fresh_seed(args.seed);
    let layer_name = plan.layer.clone();
    let (session, built) = match build_on_gpu(plan, seed, None) {
        Ok(built) => built,
        Err(status) => return status,
    };
    let gpu = session.gpu.name();
    println!(
        "{layer_name} on {gpu}, {} routing, median of {} calls, seed {seed}",
        routing_name(args.routing),
        args.iterations
    );
    match built.layer.early_starts() {
        EarlyStarts::All => {}
        EarlyStarts::None => {
            println!("note: MOEFORGE_EARLY_START=0: every kernel launched the ordinary way")
        }
        only => println!(
            "note: MOEFORGE_EARLY_START={}: only those kinds of launch start early where the plan says so",
            only.describe()
        ),
    }
    if !built.layer.routes_in_blocks() {
        println!("note: MOEFORGE_BLOCK_ROUTING=0: every call runs its route launch");
    }
    if !built.layer.replays_call_graphs() {
        println!(
            "note: MOEFORGE_CALL_GRAPHS=0 (or a plan without call graphs): every call runs its launches"
        );
    }
    println!("{}", header());
    let outcome = bench_layer(
        &session,
        &built,
        &tokens,
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
    if let Some(reason) = built.layer.call_graph_failure() {
        println!(
            "note: capturing a repeated call into a CUDA graph failed ({reason}); the calls after it ran their launches"
        );
    }
    let (peers, peers_note) = if args.peers {
        eprintln!("running the in-run peers (python3: torch pipeline, Triton pair) ...");
        match run_peers(
            &built.layer.plan().shape,
            &tokens,
            args.routing.into(),
            seed,
            args.iterations,
        ) {
            Ok(report) => (Some(report), None),
            Err(error) => {
                println!("peers not run: {error}");
                (None, Some(error.to_string()))
            }
        }
    } else {
        (None, None)
    };
    let peers_table = peers.as_ref().map(|report| peers_table(&rows, report));
    if let Some(table) = &peers_table {
        println!("\n{table}");
    }
    let report = BenchReport {
        layer: &layer_name,
        date: utc_date(),
        gpu,
        commit: env!("MOEFORGE_COMMIT"),
        routing: routing_name(args.routing),
        seed,
        baseline_note,
        rows: &rows,
        peers,
        peers_note,
    };
    let stem = format!(
        "{}_{}_{}_at_{}",
        report.date,
        layer_name,
        report.routing,
        short_commit()
    );
    let target = &built.layer.plan().target;
    let mut markdown = format!(
        "# {layer_name} on {} ({}, commit {}, {} routing)\n\nFloor = max(FLOPs / {:.0} TFLOP/s, bytes / {:.1} TB/s) (the {} target's ceilings); bytes = weights of the experts hit (the shared experts' too) + activations in and out. Self-routed: the router on the GPU, then the layer on its choices (not the table's routing); its floor adds the gate GEMM.\n\n{}\n|{}|\n",
        report.gpu,
        report.date,
        report.commit,
        report.routing,
        target.peak_bf16_flops / 1e12,
        target.hbm_bytes_per_s / 1e12,
        target.name,
        header(),
        "---|"
            .repeat(header().matches('|').count() - 1)
            .trim_end_matches('|')
    );
    for row in &rows {
        let _ = writeln!(markdown, "{}", table_row(row));
    }
    if let Some(table) = &peers_table {
        let _ = writeln!(markdown, "\n{table}");
    }
    let json = match serde_json::to_string_pretty(&report) {
        Ok(json) => json,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    write_results(&args.out, &stem, &json, &markdown)
}

/// Whether the expert-parallel bench over `choice` leaves a layer's shared experts out of
/// every path it compares: over GPUs, where its NCCL pipeline (baseline b), which runs none,
/// is compared too. Virtual ranks, where baseline (b) does not run, keep them (and a gated
/// shared expert's gate).
fn leaves_out_shared_experts(choice: RankChoice) -> bool {
    !choice.virtual_ranks
}

/// `bench --ranks R` / `--gpus G`: the expert-parallel layer against the same tokens on one
/// GPU with every expert.
fn run_expert_parallel(args: &Args, choice: RankChoice) -> ExitCode {
    let mut plans = match plan_file_over(
        &args.file,
        args.layer.as_deref(),
        &args.target.resolve(),
        Some(choice),
        leaves_out_shared_experts(choice),
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
    let tokens = match check_settings(args, &plan) {
        Ok(tokens) => tokens,
        Err(status) => return status,
    };
    let seed = fresh_seed(args.seed);
    let layer_name = plan.layer.clone();
    let (session, built) = match build_on_gpu(plan, seed, None) {
        Ok(built) => built,
        Err(status) => return status,
    };
    let contexts = match choice.contexts(&session) {
        Ok(contexts) => contexts,
        Err(status) => return status,
    };
    let mut ep = match choice.build(&session, &built, &contexts, None) {
        Ok(ep) => ep,
        Err(status) => return status,
    };
    // Baseline (b) runs on real GPUs only (NCCL puts one rank per device).
    let (mut nccl, nccl_note) = if choice.virtual_ranks {
        (
            None,
            Some("not run on virtual ranks: NCCL runs one rank per GPU".to_string()),
        )
    } else {
        match NcclPipeline::new(&session, &built, &contexts) {
            Ok(pipeline) => (Some(pipeline), None),
            Err(error) => {
                eprintln!("note: baseline (b), the NCCL pipeline, is left out: {error}");
                (None, Some(error.to_string()))
            }
        }
    };
    let placement = choice.placement(&session.gpu.name());
    println!(
        "{layer_name}, expert-parallel over {placement}, {} routing, median of {PIPELINED_PASSES} passes of {} pipelined calls, seed {seed}",
        routing_name(args.routing),
        args.iterations
    );
    let header = "| T per rank | expert-parallel us | floor us | (a) bulk-synchronous us | dispatch us (rank 0: metadata / rows) | GEMMs us (rank 0: arrange / GEMM1 / GEMM2) | combine us | hidden | (b) NCCL pipeline us | (b) dispatch / GEMMs / combine us | same tokens on one GPU us | dispatch GB/s (blocks) | self-routed us (on its routing; routers alone) |";
    let format_row = |row: &ExpertParallelRow| {
        format!(
            "| {:>10} | {:>18} | {:>8.1} | {:>23.1} | {:>37} | {:>41} | {:>10.1} | {:>5.0}% | {:>20} | {:>33} | {:>25} | {:>22} | {:>46} |",
            row.tokens_per_rank,
            format!(
                "{:.1}{}",
                row.expert_parallel_us,
                if row.fused_decode { " (fused)" } else { "" }
            ),
            row.floor_us,
            row.bulk_synchronous_us,
            format!(
                "{:.1} ({:.1} / {:.1})",
                row.stages.dispatch_us, row.dispatch_split.metadata_us, row.dispatch_split.rows_us
            ),
            format!(
                "{:.1} ({:.1} / {:.1} / {:.1})",
                row.stages.gemm_us,
                row.gemm_split.arrange_us,
                row.gemm_split.gemm1_us,
                row.gemm_split.gemm2_us
            ),
            row.stages.combine_us,
            row.hidden_share * 100.0,
            row.nccl_us.map_or("-".to_string(), |us| format!("{us:.1}")),
            row.nccl_stages.map_or("-".to_string(), |s| format!(
                "{:.1} / {:.1} / {:.1}",
                s.dispatch_us, s.gemm_us, s.combine_us
            )),
            row.one_gpu_us
                .map_or("above max_tokens".to_string(), |us| format!("{us:.1}")),
            format!("{:.1} ({})", row.dispatch_gb_per_s, row.dispatch_blocks),
            match (
                row.self_routed_us,
                row.on_its_routing_us,
                row.routers_alone_us
            ) {
                (Some(routed), Some(given), Some(alone)) => {
                    format!("{routed:.1} ({given:.1}; {alone:.1})")
                }
                _ => "no router".to_string(),
            }
        )
    };
    println!("{header}");
    let rows = match bench_expert_parallel(
        &session,
        &built,
        &mut ep,
        nccl.as_mut(),
        &BenchSettings {
            token_counts: &tokens,
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
        "{date}_{layer_name}_ep{}{}_{}_at_{}",
        choice.ranks,
        if choice.virtual_ranks { "v" } else { "" },
        routing_name(args.routing),
        short_commit()
    );
    let mut markdown = format!(
        "# {layer_name}, expert-parallel over {placement} ({date}, commit {})\n\nExpert-parallel and bulk-synchronous times are wall time per call over pipelined calls, the median of {PIPELINED_PASSES} passes (host launches included), the two schedules' passes taken in turns. Bulk-synchronous is baseline (a): the same kernels with every rank waiting for every rank between stages; its stages (dispatch = metadata + token rows, also split by kernel on rank 0, the rest being the stage's barrier; GEMMs = arrange + both GEMMs, GEMM2 storing into the origins' combine slots, also split by kernel on rank 0, GEMM2 until every rank's GEMMs are done; combine = the reduce at the origin) are timed alone with CUDA events on rank 0 after barriers. Hidden = (dispatch + GEMMs + combine - expert-parallel) / (dispatch + combine). Floor = the busiest rank's roofline floor (its pairs' GEMM work at peak, its hit experts' weights at HBM rate). One-GPU time is moeforge's single-GPU kernels on all ranks' tokens (CUDA events). Dispatch GB/s = the busiest sender's bytes of token rows to other ranks (each token once per destination rank) over the dispatch stage's time: one way, barrier included; in brackets the communication blocks that dispatched them (the plan's for the call's regime: a `*_long` regime gives the dispatch only as many as hide it behind GEMM1's local tiles). Baseline (b) is NCCL all-to-all (one row per (token, k) pair, counts known on the host), moeforge's single-GPU layer on each rank's experts, NCCL all-to-all back and a sum over k; its call time is wall time over pipelined calls (median of {PIPELINED_PASSES} passes), its phases are medians of event-timed runs between barriers. Self-routed (where the layer has a router): the overlapped call with each rank's router choosing its tokens' experts first, timed as the expert-parallel column; in brackets the same call given those choices by the caller, so the difference is what the routers cost, and every rank's router alone, pipelined the same way. (fused): the expert-parallel and self-routed calls ran the ranks' fused decode, one kernel per rank (`MOEFORGE_FUSED_DECODE=0` runs the table); baseline (a) and the stage times always run the table.{}\n\n{header}\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        env!("MOEFORGE_COMMIT"),
        nccl_note.as_ref().map_or(String::new(), |note| format!(
            " Baseline (b) is left out: {note}."
        ))
    );
    for row in &rows {
        let _ = writeln!(markdown, "{}", format_row(row));
    }
    let json = serde_json::json!({
        "layer": layer_name,
        "date": date,
        "placement": placement,
        // What `moeforge simulate --measured` plans the file's cells with.
        "virtual_ranks": choice.virtual_ranks,
        "shared_experts_left_out": leaves_out_shared_experts(choice),
        "commit": env!("MOEFORGE_COMMIT"),
        "routing": routing_name(args.routing),
        "seed": seed,
        "nccl_pipeline_note": nccl_note,
        "rows": rows,
    });
    write_results(&args.out, &stem, &json.to_string(), &markdown)
}

/// The commit in result file names (7 hex digits, `-dirty` kept): runs of two builds on
/// one day keep both files.
fn short_commit() -> String {
    let commit = env!("MOEFORGE_COMMIT");
    let (hash, dirty) = match commit.strip_suffix("-dirty") {
        Some(hash) => (hash, "-dirty"),
        None => (commit, ""),
    };
    format!("{}{dirty}", hash.get(..7).unwrap_or(hash))
}

/// Writes `<stem>.json` and `<stem>.md` into `out` (created if needed) and says so.
fn write_results(out: &Path, stem: &str, json: &str, markdown: &str) -> ExitCode {
    if let Err(error) = std::fs::create_dir_all(out)
        .and_then(|()| std::fs::write(out.join(format!("{stem}.json")), json))
        .and_then(|()| std::fs::write(out.join(format!("{stem}.md")), markdown))
    {
        eprintln!("error: cannot write results to {}: {error}", out.display());
        return usage_error();
    }
    eprintln!("wrote {}/{stem}.json and .md", out.display());
    OK
}

/// `bench` as one rank of a group of rank processes: the overlapped call only, per token
/// count every rank's mean call time, printed by rank 0.
fn bench_as_rank(args: &Args, env: &LaunchEnv) -> ExitCode {
    if args.peers {
        eprintln!(
            "error: --peers times single-GPU peers; it does not run as a rank of a group (RANK/WORLD_SIZE are set): run `moeforge bench FILE --peers` alone"
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
    if let Err(error) = toolkit::driver_available() {
        return group::leave_without_taking_part(env, &plan, &format!("needs a GPU: {error}"));
    }
    let Ok(tokens) = check_settings(args, &plan) else {
        return group::leave_without_taking_part(env, &plan, "its settings are refused (above)");
    };
    let shape = plan.shape.clone();
    let mut rank = match group::start(
        env,
        plan,
        fresh_seed(args.seed),
        &format!(
            "--tokens {} --iterations {} --routing {}",
            tokens
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
            args.iterations,
            routing_name(args.routing)
        ),
    ) {
        Ok(rank) => rank,
        Err(status) => return status,
    };
    let settings = BenchSettings {
        token_counts: &tokens,
        routing: args.routing.into(),
        iterations: args.iterations,
        seed: rank.seed,
    };
    let leader = env.rank == 0;
    if leader {
        println!(
            "{} over {} rank processes ({}), {} routing, mean of {} calls, seed {}",
            rank.built.layer.plan().layer,
            env.world_size,
            rank.session.gpu.name(),
            routing_name(args.routing),
            args.iterations,
            rank.seed
        );
        let ranks: String = (0..env.world_size)
            .map(|r| format!(" rank {r} us |"))
            .collect();
        println!("| tokens | layer us (slowest rank) |{ranks}");
    }
    let outcome = bench_group_rank(&mut rank.ep, &shape, &settings, |row| {
        if leader {
            let ranks: String = row
                .per_rank_us
                .iter()
                .map(|us| format!(" {us:>10.1} |"))
                .collect();
            println!("| {:>6} | {:>23.1} |{ranks}", row.tokens, row.layer_us);
        }
    });
    match outcome {
        Ok(_) => OK,
        Err(error) => {
            eprintln!("error: rank {}: {error}", env.rank);
            group::exit_if_network_abandoned(&rank.ep);
            invalid_input()
        }
    }
}

/// The token counts `bench` runs at ([`token_counts`]).
const DEFAULT_TOKENS: [u32; 6] = [1, 16, 128, 1024, 4096, 16384];

/// The token counts to run (refusing those above the layer's max_tokens); refuses zero
/// iterations and a machine without a GPU, saying so.
fn check_settings(args: &Args, plan: &Plan) -> Result<Vec<u32>, ExitCode> {
    let tokens = token_counts(
        args.tokens.as_deref(),
        &DEFAULT_TOKENS,
        0,
        plan.shape.max_tokens,
    )?;
    if args.iterations == 0 {
        eprintln!("error: --iterations must be at least 1");
        return Err(usage_error());
    }
    if let Err(error) = toolkit::driver_available() {
        eprintln!("error: bench needs a GPU: {error}");
        return Err(usage_error());
    }
    Ok(tokens)
}
