//! Shared by the commands that go past the checker: pick the layers of a file and plan them.

use std::path::Path;
use std::process::ExitCode;

use moeforge::compiler;
use moeforge::compiler::plan::{self, Plan, Target};
use moeforge::runtime::gpu::Gpu;
use moeforge::runtime::harness::{BuiltLayer, Session};
use moeforge::runtime::toolkit;

use super::{SourceFile, compile_file, invalid_input, report, usage_error};

/// `--target`: the device a plan is made for.
#[derive(clap::Args)]
pub struct TargetArgs {
    /// Plan for this GPU (h200, h100, a100) rather than the one present; without a GPU the
    /// default is h200.
    #[arg(long, value_name = "GPU", value_parser = parse_target)]
    target: Option<Target>,
}

fn parse_target(name: &str) -> Result<Target, String> {
    Target::named(name).ok_or_else(|| {
        let known: Vec<&str> = Target::known().iter().map(|(n, _)| *n).collect();
        format!(
            "unknown target `{name}`; known targets: {}",
            known.join(", ")
        )
    })
}

impl TargetArgs {
    /// The target chosen with `--target`, else the GPU present, else the H200.
    pub fn resolve(&self) -> Target {
        if let Some(target) = &self.target {
            return target.clone();
        }
        let device = toolkit::driver_available()
            .ok()
            .and_then(|_| Gpu::open(0).ok())
            .and_then(|gpu| gpu.target().ok());
        device.unwrap_or_else(Target::h200)
    }
}

/// Where the ranks of an expert-parallel run live (`--ranks R` or `--gpus G`).
#[derive(Clone, Copy)]
pub struct RankChoice {
    pub ranks: u32,
    pub virtual_ranks: bool,
}

/// Checks `file` and plans its layers (only `layer` when given) for `target`, reporting
/// any error.
pub fn plan_file(file: &Path, layer: Option<&str>, target: &Target) -> Result<Vec<Plan>, ExitCode> {
    plan_file_over(file, layer, target, None)
}

/// [`plan_file`], with the layers' expert-parallel ranks taken from `ranks` when given
/// instead of from the spec.
pub fn plan_file_over(
    file: &Path,
    layer: Option<&str>,
    target: &Target,
    ranks: Option<RankChoice>,
) -> Result<Vec<Plan>, ExitCode> {
    let (source, module) = compile_file(file)?;
    let names: Vec<&str> = module.layers.iter().map(|l| l.name.as_str()).collect();
    let selected: Vec<_> = module
        .layers
        .iter()
        .filter(|l| layer.is_none_or(|name| l.name == name))
        .collect();
    if selected.is_empty() {
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
            layer.topology.nodes = 1;
            layer.topology.gpus_per_node = if choice.virtual_ranks {
                1
            } else {
                choice.ranks
            };
            layer.topology.virtual_ranks = choice.virtual_ranks.then_some(choice.ranks);
        }
        let layer = &layer;
        match plan::plan(layer, target) {
            Ok(plan) => plans.push(plan),
            Err(error) => {
                report_plan_error(&source, &layer.name, &error);
                return Err(invalid_input());
            }
        }
    }
    Ok(plans)
}

/// Reports a layer the planner refused, at the layer's name in `source` (and the refused
/// hint, if any), as the checker reports its errors.
pub fn report_plan_error(source: &SourceFile, layer: &str, error: &plan::PlanError) {
    let text = String::from_utf8_lossy(&source.bytes);
    report(&compiler::plan_diagnostics(
        &source.name,
        &text,
        layer,
        error,
    ));
}

/// Exactly one plan, for commands that run a single layer.
pub fn plan_one(file: &Path, layer: Option<&str>, target: &Target) -> Result<Plan, ExitCode> {
    let mut plans = plan_file(file, layer, target)?;
    if plans.len() > 1 {
        let names: Vec<&str> = plans.iter().map(|p| p.layer.as_str()).collect();
        eprintln!(
            "error: {} has {} layers; pick one with --layer ({})",
            file.display(),
            plans.len(),
            names.join(", ")
        );
        return Err(usage_error());
    }
    Ok(plans.remove(0))
}

/// `--ranks`: only 1 is executable today; a multi-rank spec runs on one GPU, said aloud.
pub fn check_ranks(plan: &Plan, ranks: Option<u32>) -> Result<(), ExitCode> {
    match ranks {
        Some(1) => Ok(()),
        Some(other) => {
            eprintln!(
                "error: --ranks {other}: `run` executes every expert on one GPU (--ranks 1); expert parallelism runs in `bench --ranks R` (virtual ranks) or `bench --gpus G`"
            );
            Err(usage_error())
        }
        None => {
            if plan.shape.spec_ranks > 1 {
                eprintln!(
                    "note: the spec has {} expert-parallel ranks; running all {} experts on one GPU (pass --ranks 1 to say so)",
                    plan.shape.spec_ranks, plan.shape.experts
                );
            }
            Ok(())
        }
    }
}

/// Opens the GPU, compiles `plan`'s kernels and fills random weights (seeded), reporting
/// any failure: a missing GPU or toolkit is a usage error, a layer that fails to build
/// invalid input.
pub fn build_on_gpu(plan: Plan, seed: u64) -> Result<(Session, BuiltLayer), ExitCode> {
    eprintln!(
        "opening the GPU, compiling {} and filling random weights ...",
        plan.layer
    );
    let session = Session::open().map_err(|error| {
        eprintln!("error: {error}");
        usage_error()
    })?;
    let built = session.build(plan, seed).map_err(|error| {
        eprintln!("error: {error}");
        invalid_input()
    })?;
    Ok((session, built))
}
