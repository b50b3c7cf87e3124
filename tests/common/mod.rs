//! Helpers shared by the tests of the `moeforge` binary.

use std::process::{Command, Output};

/// Runs the `moeforge` binary with `args` from the repository root.
pub fn moeforge(args: &[&str]) -> Output {
    moeforge_with_env(args, &[])
}

/// [`moeforge`] with `vars` added to its environment.
// Not every test crate that includes this module launches rank processes.
#[allow(dead_code)]
pub fn moeforge_with_env(args: &[&str], vars: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        // Plans from the cost model and the shipped entries only, whatever the machine's
        // user has tuned (a test that tunes sets its own cache).
        .env(
            "MOEFORGE_TUNING_CACHE",
            "/nonexistent/moeforge-tests/tuning.json",
        )
        .envs(vars.iter().copied())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the moeforge binary runs")
}
