//! The command line: one file per command, dispatched from [`run`].
//!
//! Exit status: 0 when every file is fine, 1 when some input is invalid (diagnostics on
//! stderr), 2 for usage errors, files that cannot be read and output that cannot be written
//! (`main`'s panic hook). Nothing here panics on input.
//! To add a command: add a file with an `Args` struct and a `run`, a variant to [`Command`]
//! and a line to [`run`].

mod bench;
mod call_file;
mod check;
mod compile;
mod explain;
mod fmt;
mod group;
mod planning;
mod run;
mod simulate;
mod tune;
mod weights;

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moeforge::compiler::plan::Target;
use moeforge::compiler::{self, Diagnostics, ir};

/// moeforge: compiles Mixture-of-Experts layer descriptions (`.moe` files) to CUDA kernels.
#[derive(Parser)]
#[command(name = "moeforge", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Check(check::Args),
    Explain(explain::Args),
    Fmt(fmt::Args),
    Compile(compile::Args),
    Run(run::Args),
    Bench(bench::Args),
    Simulate(simulate::Args),
    Tune(tune::Args),
}

/// Parses the command line and runs the command.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => check::run(&args),
        Command::Explain(args) => explain::run(&args),
        Command::Fmt(args) => fmt::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Tune(args) => tune::run(&args),
    }
}

/// Every file's input is valid.
const OK: ExitCode = ExitCode::SUCCESS;
/// Some input is invalid; its diagnostics are on stderr.
fn invalid_input() -> ExitCode {
    ExitCode::from(1)
}
/// The command line is wrong or a file cannot be read.
fn usage_error() -> ExitCode {
    ExitCode::from(2)
}

/// A file read from disk, named as the user wrote it.
struct SourceFile {
    name: String,
    bytes: Vec<u8>,
}

/// The file name that stands for standard input (`moeforge check -`).
const STDIN: &str = "-";

/// Reads `path` (standard input for [`STDIN`]), or reports why it cannot be read.
fn read_file(path: &Path) -> Result<SourceFile, ExitCode> {
    if path == Path::new(STDIN) {
        let mut bytes = Vec::new();
        return match std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes) {
            Ok(_) => Ok(SourceFile {
                name: "<stdin>".to_string(),
                bytes,
            }),
            Err(error) => {
                eprintln!("error: cannot read standard input: {error}");
                Err(usage_error())
            }
        };
    }
    let name = path.display().to_string();
    std::fs::read(path)
        .map(|bytes| SourceFile {
            name: name.clone(),
            bytes,
        })
        .map_err(|error| {
            eprintln!("error: cannot read {name}: {error}");
            usage_error()
        })
}

/// Prints diagnostics to stderr.
fn report(diagnostics: &Diagnostics) {
    diagnostics
        .emit_to_stderr(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none());
    let count = diagnostics.errors.len();
    eprintln!(
        "error: {} has {count} error{}",
        diagnostics.file_name,
        if count == 1 { "" } else { "s" }
    );
}

/// Reads and checks one file, its schedule hints and ranks against what the planner can do
/// on `target`; `Err` carries the exit status after reporting.
fn compile_file(path: &Path, target: &Target) -> Result<(SourceFile, ir::Module), ExitCode> {
    let file = read_file(path)?;
    match compiler::compile_bytes_for(&file.name, &file.bytes, target) {
        Ok(module) => Ok((file, module)),
        Err(diagnostics) => {
            report(&diagnostics);
            Err(invalid_input())
        }
    }
}

/// A count and its noun, in the plural unless the count is one ("1 token", "2 nodes").
fn counted(count: impl Into<u64>, noun: &str) -> String {
    let count = count.into();
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
}

/// The worst of several exit statuses (usage errors over invalid input over success).
fn worst(statuses: impl IntoIterator<Item = ExitCode>) -> ExitCode {
    let mut worst = OK;
    for status in statuses {
        if status == usage_error() || (status == invalid_input() && worst == OK) {
            worst = status;
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::counted;

    #[test]
    fn a_count_of_one_takes_the_singular() {
        assert_eq!(counted(1u32, "token"), "1 token");
        assert_eq!(counted(0u32, "node"), "0 nodes");
        assert_eq!(counted(2u32, "shared expert"), "2 shared experts");
    }
}
