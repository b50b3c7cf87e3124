//! The `moeforge` command-line tool. Parses the command line and hands it to [`cli`].
mod cli;

fn main() -> std::process::ExitCode {
    // NVLink multicast stays off in everything moeforge starts (NCCL reads this when the
    // bench's NCCL baseline creates communicators): on a shared host it can take the GPUs
    // out of service.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: the first thing `main` does, before any other thread exists.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    cli::run()
}
