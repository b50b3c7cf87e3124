//! `moeforge compile FILE -o DIR`: ahead-of-time output for deployment: the CUDA source of
//! every layer, its PTX (when NVRTC is present) and `plan.json`, which the runtime loads
//! without NVRTC or the language.

use std::path::PathBuf;
use std::process::ExitCode;

use moeforge::compiler::codegen;
use moeforge::runtime::aot;
use moeforge::runtime::jit::{CompileOptions, Jit};

use super::planning::plan_file;
use super::{OK, invalid_input, usage_error};

/// Compile a .moe file ahead of time: writes <layer>.cu, <layer>.ptx (when NVRTC is found)
/// and plan.json into DIR.
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
}

pub fn run(args: &Args) -> ExitCode {
    let plans = match plan_file(&args.file, args.layer.as_deref()) {
        Ok(plans) => plans,
        Err(status) => return status,
    };
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        eprintln!("error: cannot create {}: {error}", args.out.display());
        return usage_error();
    }
    let jit = if args.no_ptx {
        None
    } else {
        match Jit::from_env() {
            Ok(jit) => Some(jit),
            Err(error) => {
                eprintln!("note: writing source and plan only: {error}");
                None
            }
        }
    };
    let write = |name: &str, bytes: &[u8]| -> Result<(), ExitCode> {
        let path = args.out.join(name);
        std::fs::write(&path, bytes).map_err(|error| {
            eprintln!("error: cannot write {}: {error}", path.display());
            usage_error()
        })?;
        eprintln!("wrote {}", path.display());
        Ok(())
    };
    for plan in &plans {
        let source = match codegen::generate(plan) {
            Ok(source) => source,
            Err(error) => {
                eprintln!("error: {}: {error}", plan.layer);
                return invalid_input();
            }
        };
        if let Err(status) = write(&source.file_name, source.source.as_bytes()) {
            return status;
        }
        if let Some(jit) = &jit {
            let options = CompileOptions::new(plan.symbol.clone(), plan.target.arch.clone()).flag("-std=c++17");
            match jit.compile(&source.source, &options) {
                Ok(module) => {
                    if let Err(status) = write(&aot::ptx_file_name(plan), module.ptx.as_bytes()) {
                        return status;
                    }
                }
                Err(error) => {
                    eprintln!("error: {}: {error}", plan.layer);
                    return invalid_input();
                }
            }
        }
    }
    let json = match serde_json::to_string_pretty(&plans) {
        Ok(json) => json + "\n",
        Err(error) => {
            eprintln!("error: cannot serialise the plans: {error}");
            return invalid_input();
        }
    };
    match write(aot::PLAN_FILE, json.as_bytes()) {
        Ok(()) => OK,
        Err(status) => status,
    }
}
