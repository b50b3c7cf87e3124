//! `moeforge compile FILE -o DIR`: ahead-of-time output for deployment: the CUDA source of
//! every layer, its PTX (when NVRTC is present) and `plan.json`, which the runtime loads
//! without NVRTC or the language (see `moeforge_runtime::aot`).

use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::runtime::aot;
use moeforge::runtime::jit::{Jit, JitError};

use super::planning::{TargetArgs, plan_file};
use super::{OK, invalid_input, usage_error};

/// Compile a .moe file ahead of time: writes <layer>.cu, <layer>.ptx (when NVRTC is found)
/// and plan.json into DIR, and removes the layer files an earlier compile there left that
/// the new plan.json does not name (unless changed since).
#[derive(clap::Args)]
pub struct Args {
    /// The .moe file to compile.
    file: PathBuf,
    /// Output directory (created if missing).
    #[arg(short, long)]
    out: PathBuf,
    /// Only this layer of the file.
    #[arg(long)]
    layer: Option<String>,
    /// Write the CUDA source and plan only, even when NVRTC is available.
    #[arg(long)]
    no_ptx: bool,
    #[command(flatten)]
    target: TargetArgs,
}

pub fn run(args: &Args) -> ExitCode {
    let plans = match plan_file(&args.file, args.layer.as_deref(), &args.target.resolve()) {
        Ok(plans) => plans,
        Err(status) => return status,
    };
    let jit = if args.no_ptx {
        None
    } else {
        match Jit::from_env() {
            Ok(jit) => Some(jit),
            // No NVRTC here: the source and plan still deploy (the runtime compiles them).
            Err(error @ JitError::Toolkit(_)) => {
                eprintln!("note: writing source and plan only: {error}");
                None
            }
            // A setting the user got wrong: say so rather than leave the PTX out.
            Err(error) => {
                eprintln!("error: {error}");
                return usage_error();
            }
        }
    };
    if jit.is_some() {
        // NVRTC takes seconds a layer (uncached): say what the wait is for.
        let names: Vec<String> = plans
            .iter()
            .map(|plan| format!("`{}`", plan.layer))
            .collect();
        eprintln!("compiling {} with NVRTC ...", names.join(", "));
    }
    let files = match aot::render(&plans, jit.as_ref()) {
        Ok(files) => files,
        Err(error) => {
            eprintln!("error: {}: {error}", args.file.display());
            return invalid_input();
        }
    };
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        eprintln!("error: cannot create {}: {error}", args.out.display());
        return usage_error();
    }
    let earlier = aot::earlier_layer_files(&args.out);
    for file in &files {
        let path = args.out.join(&file.name);
        if let Err(error) = std::fs::write(&path, &file.contents) {
            eprintln!("error: cannot write {}: {error}", path.display());
            return usage_error();
        }
        eprintln!("wrote {}", path.display());
    }
    // An earlier compile's layer files the new plan.json leaves out (another layer, or PTX
    // where this compile wrote none) would sit beside it unused: remove them, unless
    // someone changed them since.
    for earlier in earlier {
        let path = args.out.join(&earlier.name);
        if files.iter().any(|file| file.name == earlier.name) || !path.is_file() {
            continue;
        }
        if !earlier.unchanged_in(&args.out) {
            eprintln!(
                "note: kept {}: an earlier compile's file, not in the new plan.json, changed since it was written",
                path.display()
            );
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => eprintln!(
                "removed {} (an earlier compile's, not in the new plan.json)",
                path.display()
            ),
            Err(error) => eprintln!(
                "warning: cannot remove {}, an earlier compile's file the new plan.json leaves out: {error}",
                path.display()
            ),
        }
    }
    OK
}
