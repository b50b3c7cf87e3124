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
    exit_quietly_on_a_closed_pipe();
    cli::run()
}

/// `moeforge check … | head` closes the pipe early: end the process as other command-line
/// tools do (the default action of SIGPIPE), instead of panicking in the next `println!`
/// (Rust ignores SIGPIPE before `main`, so writes fail with EPIPE).
#[cfg(unix)]
fn exit_quietly_on_a_closed_pipe() {
    const SIGPIPE: i32 = 13;
    const SIG_DFL: usize = 0;
    unsafe extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
    }
    // SAFETY: restores the default disposition of one signal before any other thread exists;
    // SIGPIPE is 13 on Linux and macOS.
    unsafe { signal(SIGPIPE, SIG_DFL) };
}

#[cfg(not(unix))]
fn exit_quietly_on_a_closed_pipe() {}
