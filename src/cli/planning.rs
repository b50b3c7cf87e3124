//! Shared by the commands that go past the checker: pick the layers of a file and plan them.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use moeforge::compiler::plan::tuning::TuningTable;
use moeforge::compiler::plan::{self, Plan, Target};
use moeforge::compiler::{self, ir};
use moeforge::runtime::checkpoint::{HostGate, HostWeights};
use moeforge::runtime::ep::EpLayer;
use moeforge::runtime::gpu::CudaContext;
use moeforge::runtime::gpu::Gpu;
use moeforge::runtime::harness::{BuiltLayer, Session};
use moeforge::runtime::layer::ExpertWeights;
use moeforge::runtime::toolkit;
use moeforge::runtime::weights::upload;

use super::{SourceFile, compile_file, counted, invalid_input, report, usage_error};

/// `--target`: the device a plan is made for.
#[derive(clap::Args)]
pub struct TargetArgs {
    /// Plan for this GPU (h200, h100, a100) rather than the one present; without a GPU the
    /// default is h200.
    #[arg(long, value_name = "GPU", value_parser = parse_target)]
    target: Option<Target>,
}

pub fn parse_target(name: &str) -> Result<Target, String> {
    Target::named(name).ok_or_else(|| {
        let known: Vec<&str> = Target::known().iter().map(|(n, _)| *n).collect();
        format!(
            "unknown target `{name}`; known targets: {}",
            known.join(", ")
        )
    })
}

impl TargetArgs {
    /// The target chosen with `--target`, if one was.
    pub fn chosen(&self) -> Option<Target> {
        self.target.clone()
    }

    /// The target chosen with `--target`, else the GPU present, else the H200. Where a
    /// driver is present but its first GPU cannot be opened or read, says so on stderr
    /// before it plans for the H200.
    pub fn resolve(&self) -> Target {
        self.chosen().unwrap_or_else(TargetArgs::present)
    }

    /// The GPU present, else the H200 (see [`TargetArgs::resolve`]).
    pub fn present() -> Target {
        if toolkit::driver_available().is_err() {
            return Target::h200();
        }
        match Gpu::open(0).and_then(|gpu| gpu.target()) {
            Ok(target) => target,
            Err(error) => {
                eprintln!(
                    "note: the CUDA driver is present but GPU 0 could not be read ({error}); planning for the H200 (`--target` chooses)"
                );
                Target::h200()
            }
        }
    }
}

/// Where the ranks of an expert-parallel run live (`--ranks R` or `--gpus G`).
#[derive(Clone, Copy)]
pub struct RankChoice {
    pub ranks: u32,
    pub virtual_ranks: bool,
}

impl RankChoice {
    /// From `--ranks R` (virtual ranks on one GPU) or `--gpus G` (one rank per GPU); `None`
    /// for one rank (every expert on one GPU).
    pub fn from_flags(ranks: Option<u32>, gpus: Option<u32>) -> Option<Self> {
        match (ranks, gpus) {
            (Some(ranks), None) if ranks > 1 => Some(RankChoice {
                ranks,
                virtual_ranks: true,
            }),
            (None, Some(gpus)) if gpus > 1 => Some(RankChoice {
                ranks: gpus,
                virtual_ranks: false,
            }),
            _ => None,
        }
    }

    /// Where the ranks run, for messages.
    pub fn placement(self, gpu: &str) -> String {
        if self.virtual_ranks {
            format!("{} virtual ranks on one {gpu}", self.ranks)
        } else {
            format!("{} x {gpu}", self.ranks)
        }
    }

    /// Each rank's context: the session's GPU for every virtual rank, or GPU r for rank r.
    pub fn contexts(self, session: &Session) -> Result<Vec<Arc<CudaContext>>, ExitCode> {
        let mut contexts = vec![Arc::clone(&session.gpu.ctx)];
        for rank in 1..self.ranks as usize {
            if self.virtual_ranks {
                contexts.push(Arc::clone(&session.gpu.ctx));
            } else {
                contexts.push(Gpu::open_context(rank).map_err(|error| {
                    eprintln!("error: --gpus {}: {error}", self.ranks);
                    usage_error()
                })?);
            }
        }
        Ok(contexts)
    }

    /// Builds `built`'s expert-parallel layer over the chosen ranks: each rank's experts
    /// copied from `built`, or `weights[r]` for rank `r` when given.
    pub fn build(
        self,
        session: &Session,
        built: &BuiltLayer,
        contexts: &[Arc<CudaContext>],
        weights: Option<Vec<ExpertWeights>>,
    ) -> Result<EpLayer, ExitCode> {
        match weights {
            None => session.build_expert_parallel(built, contexts),
            Some(weights) => session.build_expert_parallel_with(built, contexts, weights),
        }
        .map_err(|error| {
            eprintln!("error: {error}");
            invalid_input()
        })
    }
}

/// Checks `file` and plans its layers (only `layer` when given) for `target`, reporting
/// any error.
pub fn plan_file(file: &Path, layer: Option<&str>, target: &Target) -> Result<Vec<Plan>, ExitCode> {
    plan_file_over(file, layer, target, None, false)
}

/// [`plan_file`], with the layers' expert-parallel ranks taken from `ranks` when given
/// instead of from the spec; with `leave_out_shared` (the expert-parallel bench, whose NCCL
/// pipeline does not run shared experts) the layers' shared experts are left out, said on
/// stderr.
pub fn plan_file_over(
    file: &Path,
    layer: Option<&str>,
    target: &Target,
    ranks: Option<RankChoice>,
    leave_out_shared: bool,
) -> Result<Vec<Plan>, ExitCode> {
    let (source, module) = compile_file(file, target)?;
    let selected = selected_layers(file, &module, layer)?;
    let tuning = planning_table()?;
    let mut plans = Vec::new();
    for layer in selected {
        let mut layer = layer.clone();
        if let Some(choice) = ranks {
            if choice.ranks == 0 || !layer.experts.is_multiple_of(choice.ranks) {
                eprintln!(
                    "error: {} ranks do not split the {} experts of `{}` evenly",
                    choice.ranks, layer.experts, layer.name
                );
                return Err(usage_error());
            }
            layer.parallel.expert = choice.ranks;
            // A spec whose topology already has these virtual ranks keeps it: its nodes,
            // if several, are emulated on the one GPU.
            if !(choice.virtual_ranks && layer.topology.virtual_ranks == Some(choice.ranks)) {
                layer.topology.nodes = 1;
                layer.topology.gpus_per_node = if choice.virtual_ranks {
                    1
                } else {
                    choice.ranks
                };
                layer.topology.virtual_ranks = choice.virtual_ranks.then_some(choice.ranks);
            }
        }
        // Every path the bench compares computes the same layer.
        if leave_out_shared && let Some(shared) = layer.shared_experts.take() {
            eprintln!(
                "note: the NCCL pipeline (baseline b) does not run shared experts: this bench leaves out the {} of FFN {} of `{}` on every path it compares",
                counted(shared.count, "shared expert"),
                shared.ffn,
                layer.name
            );
        }
        let plan = plan_layer(&source, &layer, target, &tuning).inspect_err(|_| {
            if let Some(choice) = ranks {
                let flag = if choice.virtual_ranks { "--ranks" } else { "--gpus" };
                eprintln!(
                    "note: the layer was planned over {flag} {} in place of its spec's ranks: pass fewer",
                    choice.ranks
                );
            }
        })?;
        plans.push(plan);
    }
    Ok(plans)
}

/// `layer` planned for `target` with `tuning`, or the error reported against `source`.
fn plan_layer(
    source: &SourceFile,
    layer: &ir::Layer,
    target: &Target,
    tuning: &TuningTable,
) -> Result<Plan, ExitCode> {
    plan::plan_tuned(layer, target, tuning).map_err(|error| {
        report_plan_error(source, layer, target, &error);
        invalid_input()
    })
}

/// The tuning table planning uses (see [`moeforge::tuning`]), or the reason it cannot be
/// read, reported.
pub fn planning_table() -> Result<TuningTable, ExitCode> {
    moeforge::tuning::for_planning().map_err(|error| {
        eprintln!("error: {error}");
        invalid_input()
    })
}

/// The layers of `module` (from `file`) a command takes: `layer` alone when given, else
/// all; none is a usage error, reported.
fn selected_layers<'a>(
    file: &Path,
    module: &'a ir::Module,
    layer: Option<&str>,
) -> Result<Vec<&'a ir::Layer>, ExitCode> {
    let selected: Vec<_> = module
        .layers
        .iter()
        .filter(|l| layer.is_none_or(|name| l.name == name))
        .collect();
    if selected.is_empty() {
        let names: Vec<&str> = module.layers.iter().map(|l| l.name.as_str()).collect();
        match layer {
            Some(name) => eprintln!(
                "error: {} has no layer `{name}` (it has: {})",
                file.display(),
                names.join(", ")
            ),
            None => eprintln!("error: {} defines no layer", file.display()),
        }
        return Err(usage_error());
    }
    Ok(selected)
}

/// Exactly one layer of `module` (from `file`), for commands that take one: `layer`, or
/// the file's only one.
pub fn one_layer<'a>(
    file: &Path,
    module: &'a ir::Module,
    layer: Option<&str>,
) -> Result<&'a ir::Layer, ExitCode> {
    let selected = selected_layers(file, module, layer)?;
    if selected.len() > 1 {
        return Err(several_layers(
            file,
            selected.iter().map(|l| l.name.as_str()),
        ));
    }
    Ok(selected[0])
}

/// Reports that a command taking one layer was given a file of several, naming them.
fn several_layers<'a>(file: &Path, names: impl Iterator<Item = &'a str>) -> ExitCode {
    let names: Vec<&str> = names.collect();
    eprintln!(
        "error: {} has {} layers; pick one with --layer ({})",
        file.display(),
        names.len(),
        names.join(", ")
    );
    usage_error()
}

/// Reports a layer the planner refused, at the layer's name in `source` (and the refused
/// hint, if any), as the checker reports its errors.
pub fn report_plan_error(
    source: &SourceFile,
    layer: &ir::Layer,
    target: &Target,
    error: &plan::PlanError,
) {
    let text = String::from_utf8_lossy(&source.bytes);
    report(&compiler::plan_diagnostics(
        &source.name,
        &text,
        layer,
        target,
        error,
    ));
}

/// Exactly one plan, for commands that run a single layer.
pub fn plan_one(file: &Path, layer: Option<&str>, target: &Target) -> Result<Plan, ExitCode> {
    let mut plans = plan_file(file, layer, target)?;
    if plans.len() > 1 {
        return Err(several_layers(file, plans.iter().map(|p| p.layer.as_str())));
    }
    Ok(plans.remove(0))
}

/// One rank (`--ranks 1`, `--gpus 1` or neither): a multi-rank spec runs every expert on
/// one GPU, said aloud.
pub fn note_one_rank(plan: &Plan, ranks: Option<u32>, gpus: Option<u32>) -> Result<(), ExitCode> {
    match ranks.or(gpus) {
        Some(0) => {
            eprintln!("error: --ranks and --gpus count from 1");
            Err(usage_error())
        }
        Some(_) => Ok(()),
        None => {
            if plan.shape.spec_ranks > 1 {
                eprintln!(
                    "note: the spec has {} expert-parallel ranks; running all {} experts on one GPU (pass --ranks R for virtual ranks, --gpus G for G GPUs, or --ranks 1 to say so)",
                    plan.shape.spec_ranks, plan.shape.experts
                );
            }
            Ok(())
        }
    }
}

/// Opens the GPU, compiles `plan`'s kernels and fills random weights (seeded), or uploads
/// `weights` (every expert) when given, reporting any failure: a missing GPU or toolkit is
/// a usage error, a layer that fails to build invalid input.
pub fn build_on_gpu(
    plan: Plan,
    seed: u64,
    weights: Option<&HostWeights>,
) -> Result<(Session, BuiltLayer), ExitCode> {
    build_on_gpu_with_gate(plan, seed, weights, None)
}

/// [`build_on_gpu`] with the router's gate read from the checkpoint beside its experts
/// (`gate` is used only with `weights`; random weights come with a random gate when the
/// spec has a router).
pub fn build_on_gpu_with_gate(
    plan: Plan,
    seed: u64,
    weights: Option<&HostWeights>,
    gate: Option<HostGate>,
) -> Result<(Session, BuiltLayer), ExitCode> {
    build_on_device(0, plan, seed, weights, gate)
}

/// [`build_on_gpu`] with random weights on GPU `ordinal` (a rank process's own GPU).
pub fn build_on_gpu_on(
    ordinal: usize,
    plan: Plan,
    seed: u64,
) -> Result<(Session, BuiltLayer), ExitCode> {
    build_on_device(ordinal, plan, seed, None, None)
}

fn build_on_device(
    ordinal: usize,
    plan: Plan,
    seed: u64,
    weights: Option<&HostWeights>,
    gate: Option<HostGate>,
) -> Result<(Session, BuiltLayer), ExitCode> {
    eprintln!(
        "opening the GPU, compiling {} and {} ...",
        plan.layer,
        if weights.is_some() {
            "uploading the checkpoint's weights"
        } else {
            "filling random weights"
        }
    );
    let session = Session::open_device(ordinal).map_err(|error| {
        eprintln!("error: {error}");
        usage_error()
    })?;
    let failed = |error: &dyn std::fmt::Display| {
        eprintln!("error: {error}");
        invalid_input()
    };
    let built = match weights {
        None => session.build(plan, seed).map_err(|e| failed(&e))?,
        Some(host) => {
            let experts = upload(&session.gpu.stream, host).map_err(|e| failed(&e))?;
            session
                .build_with_weights_and_gate(plan, experts, gate)
                .map_err(|e| failed(&e))?
        }
    };
    // Cache entries or dumps the JIT could not write, entries it replaced: the layer runs,
    // but the next one compiles again.
    for note in built.module.notes() {
        eprintln!("note: {note}");
    }
    Ok((session, built))
}

/// The token counts a command runs at: those `--tokens` gave (`given`), each refused with a
/// usage error where it is above the layer's `max_tokens` or below `least`; else the
/// command's `defaults` up to `max_tokens`, with `max_tokens` itself where a default passed
/// it (said on stderr), so that a small layer runs with the defaults too.
pub fn token_counts(
    given: Option<&[u32]>,
    defaults: &[u32],
    least: u32,
    max_tokens: u32,
) -> Result<Vec<u32>, ExitCode> {
    let Some(given) = given else {
        let mut counts: Vec<u32> = defaults
            .iter()
            .copied()
            .filter(|&t| t <= max_tokens)
            .collect();
        if counts.len() < defaults.len() {
            counts.push(max_tokens);
            counts.dedup();
            let shown: Vec<String> = counts.iter().map(u32::to_string).collect();
            eprintln!(
                "note: the layer's max_tokens is {max_tokens}: the default token counts are {}",
                shown.join(",")
            );
        }
        return Ok(counts);
    };
    if let Some(&too_many) = given.iter().find(|&&t| t > max_tokens) {
        eprintln!("error: --tokens {too_many} exceeds the layer's max_tokens of {max_tokens}");
        return Err(usage_error());
    }
    if let Some(&too_few) = given.iter().find(|&&t| t < least) {
        eprintln!(
            "error: --tokens {too_few}: this command needs at least {} a call",
            counted(least, "token")
        );
        return Err(usage_error());
    }
    Ok(given.to_vec())
}
