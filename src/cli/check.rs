//! `moeforge check FILE...`: checks `.moe` files and reports every error in each (a layer
//! the planner refuses too), warns of schedule hints a layer's plan does not follow, and
//! notes a file with no layer (which the other commands refuse) and a layer whose plan
//! needs more memory per device than it has. The target is the H200 unless `--target`
//! names another (not the GPU present: a file checks the same on every machine).

use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::ir;
use moeforge::compiler::plan::{self, Target};

use super::planning::{parse_target, report_plan_error};
use super::{OK, compile_file, invalid_input, worst};

/// Check .moe files: report every error (exit 1 if any), print a summary of each valid file,
/// a warning for each schedule hint a layer's plan does not follow, a note for each layer
/// whose buffers would not fit its GPUs (with the max_tokens that fits) and for a file
/// without a layer.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe files to check (`-`: standard input).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Check the schedule hints, ranks and memory for this GPU (h200, h100, a100) [default:
    /// h200, whatever GPU is present, so that a file checks the same on every machine].
    #[arg(long, value_name = "GPU", value_parser = parse_target)]
    target: Option<Target>,
}

pub fn run(args: &Args) -> ExitCode {
    let target = args.target.clone().unwrap_or_else(Target::h200);
    // The shipped tuning entries, not the user's cache: a file checks the same everywhere,
    // and as compile and run plan it on a machine without a cache of its own.
    let tuning = match moeforge::tuning::shipped() {
        Ok(table) => table,
        Err(error) => {
            eprintln!("error: {error}");
            return invalid_input();
        }
    };
    worst(args.files.iter().map(|path| match compile_file(path, &target) {
        Ok((file, module)) => {
            // Every layer planned first: one the planner refuses makes the file not ok.
            let mut plans = Vec::new();
            for layer in &module.layers {
                match plan::plan_tuned(layer, &target, &tuning) {
                    Ok(plan) => plans.push(plan),
                    // What explain and compile would refuse, beyond the checker's rules.
                    Err(error) => report_plan_error(&file, layer, &target, &error),
                }
            }
            if plans.len() < module.layers.len() {
                return invalid_input();
            }
            let layers: Vec<&str> = module
                .layers
                .iter()
                .map(|layer| layer.name.as_str())
                .collect();
            println!(
                "{}: ok ({} topolog{}, {} layer{}{}{})",
                file.name,
                module.topologies.len(),
                if module.topologies.len() == 1 {
                    "y"
                } else {
                    "ies"
                },
                module.layers.len(),
                if module.layers.len() == 1 { "" } else { "s" },
                if layers.is_empty() { "" } else { ": " },
                layers.join(", ")
            );
            if module.layers.is_empty() {
                println!(
                    "  note: no layer: nothing for compile, run or simulate (a file may define only topologies)"
                );
            }
            for (layer, plan) in module.layers.iter().zip(&plans) {
                for hint in &plan.hints_not_honoured {
                    println!("  warning: layer `{}`: {hint}", layer.name);
                }
                if let Some(note) = memory_note(layer, &target) {
                    println!("  note: {note}");
                }
            }
            OK
        }
        Err(status) => status,
    }))
}

/// Where `layer`'s plan on `target` does not fit its devices: what it needs and the
/// max_tokens that fits. Not an error: a spec may describe a machine only to be simulated.
fn memory_note(layer: &ir::Layer, target: &Target) -> Option<String> {
    let problem = plan::memory_problem(layer, target)?;
    Some(format!("layer `{}`: {problem}", layer.name))
}
