//! The `moeforge` command-line tool. Parses the command line and hands it to [`cli`].
mod cli;

fn main() -> std::process::ExitCode {
    cli::run()
}
