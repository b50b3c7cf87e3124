//! Helpers shared by the tests of the `moeforge` binary.

use std::process::{Command, Output};

/// Runs the `moeforge` binary with `args` from the repository root.
pub fn moeforge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the moeforge binary runs")
}
