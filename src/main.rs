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
    report_unwritable_output();
    cli::run()
}

/// Output that cannot be written (a full disk, `> /dev/full`) makes `println!` panic, with
/// a message that starts "failed printing to stdout" (or stderr): say that in one line and
/// exit with the usage-error status instead of a panic report and status 101.
fn report_unwritable_output() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to std") {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: {message}");
            std::process::exit(2);
        }
        default_hook(info);
    }));
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
