//! `moeforge explain FILE`: prints the checked layers of a file in readable form, with the
//! numbers derived from them (experts per rank, weight bytes, FLOPs per token), then each
//! layer's plan for the target (`plan::describe`: regimes, tiles, launches, buffers), and
//! the topologies no layer uses; exit status 1 when a layer cannot be planned.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::ir;
use moeforge::compiler::plan;

use super::planning::{TargetArgs, planning_table, report_plan_error};
use super::{OK, compile_file, invalid_input};

/// Explain a .moe file: every checked layer with all its sizes, defaults applied, units
/// resolved, and derived numbers (experts per rank, weight bytes, FLOPs per token), then
/// its plan (regimes, tiles, launches, the expert-parallel and network parts, limitations).
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file to explain.
    file: PathBuf,
    #[command(flatten)]
    target: TargetArgs,
}

pub fn run(args: &Args) -> ExitCode {
    let target = args.target.resolve();
    match compile_file(&args.file, &target) {
        Ok((source, module)) => {
            let tuning = match planning_table() {
                Ok(table) => table,
                Err(status) => return status,
            };
            let mut unplannable = Vec::new();
            let mut text: Vec<String> = module
                .layers
                .iter()
                .map(|layer| {
                    let plan = match plan::plan_tuned(layer, &target, &tuning) {
                        Ok(plan) => plan::describe(&plan),
                        Err(error) => {
                            let text = format!("plan: none ({error})\n");
                            unplannable.push((layer, error));
                            text
                        }
                    };
                    explain_layer(layer) + &plan
                })
                .collect();
            // Topologies no layer uses would otherwise go unexplained.
            let unused = module.topologies.iter().filter(|topology| {
                !module
                    .layers
                    .iter()
                    .any(|layer| layer.topology.name == topology.name)
            });
            text.extend(unused.map(explain_topology));
            if text.is_empty() {
                eprintln!(
                    "note: {} defines no layer or topology to explain",
                    args.file.display()
                );
            }
            print!("{}", text.join("\n"));
            for (layer, error) in &unplannable {
                report_plan_error(&source, layer, &target, error);
            }
            if unplannable.is_empty() {
                OK
            } else {
                invalid_input()
            }
        }
        Err(status) => status,
    }
}

/// One layer, one fact per line; `write!` into a `String` cannot fail.
fn explain_layer(layer: &ir::Layer) -> String {
    let mut out = String::new();
    let (h, f, e, k) = (layer.hidden, layer.ffn, layer.experts, layer.top_k);
    let _ = writeln!(out, "layer {}", layer.name);
    let _ = writeln!(out, "  hidden (H)           {h}");
    let _ = writeln!(out, "  ffn (F)              {f} per expert");
    let _ = writeln!(out, "  experts (E)          {e}, each token to top_k = {k}");
    let gating = if layer.activation.is_gated() {
        "gated: W1 holds gate rows then up rows"
    } else {
        "not gated"
    };
    let _ = writeln!(
        out,
        "  activation           {} ({gating})",
        layer.activation.name()
    );
    if layer.expert_bias {
        let _ = writeln!(
            out,
            "  expert biases        b1 [E, {}] before the activation, b2 [E, H] before the routing weight (f32)",
            layer.w1_rows()
        );
    }
    let _ = writeln!(
        out,
        "  dtype                {} activations, {} weights",
        layer.dtype.name(),
        layer.weight_dtype.name()
    );
    let _ = writeln!(
        out,
        "  max_tokens           {} per rank per call",
        layer.max_tokens
    );
    match &layer.shared_experts {
        Some(shared) => {
            let _ = writeln!(
                out,
                "  shared experts       {} of ffn {}{}",
                shared.count,
                shared.ffn,
                if shared.gated {
                    ", gated: each token's shared output times sigmoid(x · w_gate), w_gate [H]"
                } else {
                    ""
                }
            );
        }
        None => {
            let _ = writeln!(out, "  shared experts       none");
        }
    }
    match &layer.router {
        Some(router) => {
            let scoring = match router.scoring {
                ir::Scoring::Softmax => "softmax over all experts, then top-k",
                ir::Scoring::Sigmoid => "sigmoid scores, then top-k",
                ir::Scoring::TopkSoftmax => "top-k of the logits, then softmax over the k",
            };
            let bias = match router.bias {
                ir::RouterBias::None => "",
                ir::RouterBias::Logits => "; gate bias added to the logits",
                ir::RouterBias::ScoreCorrection => {
                    "; score-correction bias for the choice only (weights from the uncorrected scores)"
                }
            };
            let groups = match router.group_limit {
                Some(limit) => format!(
                    ", {} groups of {} experts, best {} kept ({} experts eligible)",
                    limit.groups,
                    e / limit.groups,
                    limit.kept,
                    u64::from(limit.kept) * u64::from(e / limit.groups)
                ),
                None => String::new(),
            };
            let normalize = match (router.scoring, router.normalize) {
                (ir::Scoring::TopkSoftmax, _) => "summing to one",
                (_, true) => "renormalised",
                (_, false) => "not renormalised",
            };
            let _ = writeln!(
                out,
                "  router               {scoring}{bias}{groups}; top-k weights {normalize}, scaled by {}",
                router.scale
            );
        }
        None => {
            let _ = writeln!(
                out,
                "  router               none (the caller passes topk_ids and topk_weights)"
            );
        }
    }
    let parallel = &layer.parallel;
    let _ = writeln!(
        out,
        "  parallel             expert {} ({} per rank), data {}, tensor {}",
        parallel.expert,
        experts(layer.experts_per_rank()),
        parallel.data,
        parallel.tensor
    );
    out.push_str(&topology_lines(&layer.topology, "  topology             "));
    let _ = writeln!(out, "  schedule             {}", schedule(&layer.schedule));

    let element = u64::from(layer.weight_dtype.size_bytes());
    let expert_bytes = layer.expert_weight_elems() * element;
    let _ = writeln!(out, "  derived");
    let _ = writeln!(
        out,
        "    W1 per expert      [{}, {h}] ({} elements)",
        layer.w1_rows(),
        layer.w1_rows() * u64::from(h)
    );
    let _ = writeln!(
        out,
        "    W2 per expert      [{h}, {f}] ({} elements)",
        u64::from(h) * u64::from(f)
    );
    let _ = writeln!(out, "    weights per expert {}", bytes(expert_bytes));
    let _ = writeln!(
        out,
        "    weights per rank   {} ({})",
        bytes(expert_bytes * u64::from(layer.experts_per_rank())),
        experts(layer.experts_per_rank())
    );
    let _ = writeln!(
        out,
        "    weights in total   {}",
        bytes(expert_bytes * u64::from(e))
    );
    if let Some(shared) = &layer.shared_experts {
        let gated = if layer.activation.is_gated() { 3 } else { 2 };
        let shared_bytes =
            gated * u64::from(shared.ffn) * u64::from(h) * element * u64::from(shared.count);
        let _ = writeln!(
            out,
            "    shared weights     {} (on every rank)",
            bytes(shared_bytes)
        );
    }
    let flops = 2 * layer.expert_weight_elems() * u64::from(k);
    let _ = writeln!(
        out,
        "    FLOPs per token    {flops} (routed experts, forward)"
    );
    let token_bytes = u64::from(h) * u64::from(layer.dtype.size_bytes());
    let _ = writeln!(
        out,
        "    bytes per token    {} per row of x or y",
        bytes(token_bytes)
    );
    let _ = writeln!(
        out,
        "    x per call         {} at max_tokens",
        bytes(token_bytes * u64::from(layer.max_tokens))
    );
    out
}

/// "1 expert", "8 experts".
fn experts(count: u32) -> String {
    format!("{count} expert{}", if count == 1 { "" } else { "s" })
}

/// A topology no layer of the file uses.
fn explain_topology(topology: &ir::Topology) -> String {
    format!(
        "topology (used by no layer)\n{}",
        topology_lines(topology, "  ")
    )
}

/// The topology's name, ranks and links, the first line starting with `lead`.
fn topology_lines(topology: &ir::Topology, lead: &str) -> String {
    let mut out = String::new();
    let placement = match topology.virtual_ranks {
        Some(ranks) if topology.nodes > 1 => format!(
            "{ranks} virtual ranks on one GPU, emulating {} nodes × {} GPUs",
            topology.nodes, topology.gpus_per_node
        ),
        Some(ranks) => format!("{ranks} virtual ranks on one GPU"),
        None => format!(
            "{} node{} × {} GPU{} = {} rank{}",
            topology.nodes,
            if topology.nodes == 1 { "" } else { "s" },
            topology.gpus_per_node,
            if topology.gpus_per_node == 1 { "" } else { "s" },
            topology.ranks(),
            if topology.ranks() == 1 { "" } else { "s" }
        ),
    };
    let _ = writeln!(out, "{lead}{}: {placement}", topology.name);
    let _ = writeln!(out, "    nvlink             {}", link(&topology.intra_node));
    let _ = writeln!(out, "    network            {}", link(&topology.network));
    out
}

fn link(link: &ir::Link) -> String {
    format!(
        "{}, {}",
        bandwidth(link.bandwidth_bytes_per_s),
        latency(link.latency_ns)
    )
}

/// Bytes per second in the largest decimal unit that shows them exactly or to 3 digits.
fn bandwidth(bytes_per_s: u64) -> String {
    format!("{}/s", decimal(bytes_per_s, &["B", "KB", "MB", "GB", "TB"]))
}

fn latency(ns: u64) -> String {
    let mut value = ns as f64;
    let mut unit = "ns";
    for next in ["us", "ms", "s"] {
        if value < 1000.0 {
            break;
        }
        value /= 1000.0;
        unit = next;
    }
    format!("{} {unit}", trim(value))
}

fn bytes(count: u64) -> String {
    if count < 1000 {
        return format!("{count} B");
    }
    let binary = {
        let mut value = count as f64;
        let mut unit = "B";
        for next in ["KiB", "MiB", "GiB", "TiB"] {
            if value < 1024.0 {
                break;
            }
            value /= 1024.0;
            unit = next;
        }
        format!("{} {unit}", trim(value))
    };
    format!(
        "{count} B = {} = {binary}",
        decimal(count, &["B", "KB", "MB", "GB", "TB"])
    )
}

fn decimal(count: u64, units: &[&str]) -> String {
    let mut value = count as f64;
    let mut unit = units[0];
    for next in &units[1..] {
        if value < 1000.0 {
            break;
        }
        value /= 1000.0;
        unit = next;
    }
    format!("{} {unit}", trim(value))
}

/// A number with at most 2 decimals, trailing zeros removed.
fn trim(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn schedule(hints: &ir::ScheduleHints) -> String {
    let mut parts = Vec::new();
    let tile = |tile: &ir::TileShape| format!("{}x{}x{}", tile.m, tile.n, tile.k);
    if let Some(t) = &hints.gemm1_tile {
        parts.push(format!("gemm1.tile {}", tile(t)));
    }
    if let Some(t) = &hints.gemm2_tile {
        parts.push(format!("gemm2.tile {}", tile(t)));
    }
    if let Some(stages) = hints.stages {
        parts.push(format!("stages {stages}"));
    }
    if let Some(chunk) = hints.dispatch_chunk {
        parts.push(format!("dispatch_chunk {chunk} tokens"));
    }
    if let Some(blocks) = hints.comm_blocks {
        parts.push(format!("comm_blocks {blocks}"));
    }
    if let Some(order) = hints.traffic_order {
        parts.push(format!("traffic {}", order.name()));
    }
    match hints.fused_decode {
        Some(0) => parts.push("fused_decode off".into()),
        Some(tokens) => parts.push(format!("fused_decode {tokens} tokens")),
        None => {}
    }
    if let Some(ns) = hints.flag_timeout_ns {
        parts.push(format!("flag_timeout {} ms", ns as f64 / 1e6));
    }
    match hints.whole_chunks {
        Some(0) => parts.push("whole_chunks off".into()),
        Some(tokens) => parts.push(format!("whole_chunks {tokens} tokens")),
        None => {}
    }
    if parts.is_empty() {
        "no hints (the planner chooses everything)".into()
    } else {
        format!("{} (the planner chooses the rest)", parts.join(", "))
    }
}
