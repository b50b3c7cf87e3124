//! `moeforge check FILE...`: checks `.moe` files and reports every error in each, and notes
//! a file with no layer (which the other commands refuse) and a layer whose plan on the H200
//! (the checker's target) needs more memory per device than it has.

use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::ir;
use moeforge::compiler::plan::{self, Target};

use super::{OK, compile_file, worst};

/// Check .moe files: report every error (exit 1 if any), print a summary of each valid file,
/// a note for each layer whose buffers would not fit its GPUs (with the max_tokens that
/// fits) and for a file without a layer.
#[derive(clap::Args)]
pub struct Args {
    /// The .moe files to check.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

pub fn run(args: &Args) -> ExitCode {
    worst(args.files.iter().map(|path| match compile_file(path) {
        Ok((file, module)) => {
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
            for layer in &module.layers {
                if let Some(note) = memory_note(layer) {
                    println!("  note: {note}");
                }
            }
            OK
        }
        Err(status) => status,
    }))
}

/// Where `layer`'s plan on the H200 does not fit its devices: what it needs and the
/// max_tokens that fits. Not an error: a spec may describe a machine only to be simulated.
fn memory_note(layer: &ir::Layer) -> Option<String> {
    let problem = plan::memory_problem(layer, &Target::h200())?;
    Some(format!("layer `{}`: {problem}", layer.name))
}
