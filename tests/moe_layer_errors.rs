//! Compile-fail tests of `#[moe_layer]`: each file of `tests/ui/` must fail to compile with
//! exactly the committed `.stderr` (`TRYBUILD=overwrite` rewrites them). One trybuild run
//! for all of them, since each run builds a crate against the facade.
//!
//! trybuild compiles the cases in a crate of its own at `target/tests/trybuild/moeforge/`,
//! and `file = ...` is relative to the crate's manifest: the cases that read a spec file
//! reach the repository through `../../../../`, which holds for the default target
//! directory only. With `CARGO_TARGET_DIR` elsewhere they are skipped, saying so.

use std::path::Path;

/// The cases that read a spec file (`file = "../../../../..."`).
const FILE_CASES: [&str; 3] = [
    "tests/ui/bad_arguments.rs",
    "tests/ui/file_error.rs",
    "tests/ui/plan_refused.rs",
];

/// The cases whose spec is inline.
const INLINE_CASES: [&str; 2] = [
    "tests/ui/inline_check_error.rs",
    "tests/ui/inline_syntax_error.rs",
];

#[test]
fn layer_errors_are_compile_errors_at_the_right_place() {
    // trybuild runs cargo: the GPU machine runs staged test binaries and has none.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    if std::process::Command::new(&cargo)
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!(
            "SKIPPED layer_errors_are_compile_errors_at_the_right_place: no cargo to compile the cases with"
        );
        return;
    }
    let cases = trybuild::TestCases::new();
    for case in INLINE_CASES {
        cases.compile_fail(case);
    }
    let default_target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let target_moved =
        std::env::var_os("CARGO_TARGET_DIR").is_some_and(|dir| Path::new(&dir) != default_target);
    if target_moved {
        eprintln!(
            "SKIPPED {FILE_CASES:?}: CARGO_TARGET_DIR is not {}, so their relative spec paths do not resolve",
            default_target.display()
        );
    } else {
        for case in FILE_CASES {
            cases.compile_fail(case);
        }
    }
}
