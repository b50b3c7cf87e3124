//! `moeforge compile FILE -o DIR`: ahead-of-time output for deployment: the CUDA source of
//! every layer, its PTX (compiled with NVRTC, which it needs unless `--no-ptx`) and
//! `plan.json`, which the runtime loads without NVRTC or the language (see
//! `moeforge_runtime::aot`). The files go to temporary names first and are renamed into
//! place, `plan.json` last, so a failed write leaves the directory as it was
//! (`aot::write_files`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use moeforge::runtime::aot;
use moeforge::runtime::jit::{Jit, JitError};

use super::planning::{TargetArgs, plan_file};
use super::{OK, invalid_input, usage_error};

/// Compile a .moe file ahead of time: writes <layer>.cu, <layer>.ptx (compiled with NVRTC)
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
    /// Write the CUDA source and plan only, without NVRTC: the runtime refuses the directory
    /// until it is compiled again where NVRTC is installed (and an earlier compile's PTX in
    /// DIR goes with the plan that named it).
    #[arg(long)]
    no_ptx: bool,
    /// Replace files in DIR of the output's names that are not as an earlier compile there
    /// left them (a hand-written `<layer>.cu`, one edited since, a `plan.json` of something
    /// else), which are otherwise kept and the compile refused.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    target: TargetArgs,
}

/// Says which of `files` would replace a file in `dir` that is not as an earlier compile
/// left it (`aot::files_not_from_a_compile`), and refuses the compile if any would.
fn refuse_files_not_ours(dir: &Path, files: &[aot::OutputFile]) -> Result<(), ExitCode> {
    let not_ours = aot::files_not_from_a_compile(dir, files);
    for path in &not_ours {
        eprintln!(
            "error: {} is not as an earlier compile into {} left it (a file of yours, or edited since): the compile would replace it",
            path.display(),
            dir.display()
        );
    }
    if not_ours.is_empty() {
        return Ok(());
    }
    eprintln!("hint: move it, compile into another directory (-o), or pass --force to replace it");
    Err(usage_error())
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
            // The runtime loads a directory only with its PTX: without NVRTC the output
            // would not deploy, so leaving it out is the user's choice, not a fallback.
            Err(error @ JitError::Toolkit(_)) => {
                eprintln!("error: cannot compile the PTX: {error}");
                eprintln!(
                    "hint: install NVRTC as the error says, or pass --no-ptx to write the CUDA source and plan.json alone (the runtime refuses that directory until it is compiled again where NVRTC is installed)"
                );
                return usage_error();
            }
            // A setting the user got wrong: say so rather than leave the PTX out.
            Err(error) => {
                eprintln!("error: {error}");
                return usage_error();
            }
        }
    };
    // The folder before NVRTC's seconds: one that cannot be made fails at once. One made
    // here goes again if nothing is written into it.
    let made_here = !args.out.exists();
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        eprintln!("error: cannot create {}: {error}", args.out.display());
        return usage_error();
    }
    let failed = |status: ExitCode| {
        if made_here {
            // Best effort: only an empty folder is removed.
            let _ = std::fs::remove_dir(&args.out);
        }
        status
    };
    // Files of the user's the output would replace, refused before NVRTC's seconds (the
    // sources are known without it; the PTX names are checked again below).
    match aot::render(&plans, None) {
        Ok(sources) if !args.force => {
            if let Err(status) = refuse_files_not_ours(&args.out, &sources.files) {
                return failed(status);
            }
        }
        Ok(_) => {}
        Err(error) => {
            eprintln!("error: {}: {error}", args.file.display());
            return failed(invalid_input());
        }
    }
    if jit.is_some() {
        // NVRTC takes seconds a layer (uncached): say what the wait is for.
        let names: Vec<String> = plans
            .iter()
            .map(|plan| format!("`{}`", plan.layer))
            .collect();
        eprintln!("compiling {} with NVRTC ...", names.join(", "));
    }
    let output = match aot::render(&plans, jit.as_ref()) {
        Ok(output) => output,
        Err(error) => {
            eprintln!("error: {}: {error}", args.file.display());
            return failed(invalid_input());
        }
    };
    for note in &output.notes {
        eprintln!("note: {note}");
    }
    let files = output.files;
    if !args.force
        && let Err(status) = refuse_files_not_ours(&args.out, &files)
    {
        return failed(status);
    }
    let earlier = aot::earlier_layer_files(&args.out);
    match aot::write_files(&args.out, &files) {
        Ok(notes) => {
            for note in notes {
                eprintln!("note: {note}");
            }
        }
        Err(error) => {
            eprintln!("error: {error}");
            return failed(usage_error());
        }
    }
    for file in &files {
        eprintln!("wrote {}", args.out.join(&file.name).display());
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
