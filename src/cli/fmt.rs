//! `moeforge fmt FILE...`: rewrites `.moe` files in canonical form, keeping comments.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use moeforge::compiler;

use super::{OK, STDIN, invalid_input, read_file, report, usage_error, worst};

/// Format .moe files in canonical form (in place by default; comments are kept).
#[derive(clap::Args)]
pub struct Args {
    /// The .moe files to format (`-`: standard input, printed formatted to stdout).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Change nothing; exit 1 and name each file that is not formatted.
    #[arg(long, conflicts_with = "stdout")]
    check: bool,
    /// Print the formatted text to stdout instead of rewriting the files.
    #[arg(long)]
    stdout: bool,
}

pub fn run(args: &Args) -> ExitCode {
    worst(args.files.iter().map(|path| format_one(path, args)))
}

fn format_one(path: &Path, args: &Args) -> ExitCode {
    let file = match read_file(path) {
        Ok(file) => file,
        Err(status) => return status,
    };
    let formatted = match compiler::decode(&file.name, &file.bytes)
        .and_then(|text| compiler::format_source(&file.name, text))
    {
        Ok(formatted) => formatted,
        Err(diagnostics) => {
            report(&diagnostics);
            return invalid_input();
        }
    };
    // Standard input has no file to rewrite: its formatted text goes to stdout.
    if args.stdout || (path == Path::new(STDIN) && !args.check) {
        print!("{formatted}");
        return OK;
    }
    if formatted.as_bytes() == file.bytes {
        return OK;
    }
    if args.check {
        eprintln!(
            "{} is not formatted (run `moeforge fmt {}`)",
            file.name, file.name
        );
        return invalid_input();
    }
    match std::fs::write(path, formatted) {
        Ok(()) => {
            eprintln!("formatted {}", file.name);
            OK
        }
        Err(error) => {
            eprintln!("error: cannot write {}: {error}", file.name);
            usage_error()
        }
    }
}
