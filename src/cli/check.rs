//! `moeforge check FILE...`: checks `.moe` files and reports every error in each.

use std::path::PathBuf;
use std::process::ExitCode;

use super::{OK, compile_file, worst};

/// Check .moe files: report every error (exit 1 if any), print a summary of each valid file.
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
            OK
        }
        Err(status) => status,
    }))
}
