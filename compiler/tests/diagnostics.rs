//! Snapshot tests of rendered diagnostics: every `diagnostics/NAME.moe` (one per checker
//! rule, named after it) is compiled and its rendered errors are compared with
//! `diagnostics/NAME.stderr`; `diagnostics/plan/` holds files that check but that a planner
//! refuses, rendered with `plan_diagnostics`. `MOEFORGE_BLESS=1 cargo test` rewrites the
//! expectations.

use std::path::{Path, PathBuf};

use moeforge_compiler::plan::{self, Target};
use moeforge_compiler::{compile_bytes, compile_source, compile_source_for, ir, plan_diagnostics};

fn blessing() -> bool {
    std::env::var_os("MOEFORGE_BLESS").is_some_and(|value| value == "1")
}

fn directory() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/diagnostics")
}

/// Compares `rendered` with the snapshot next to `input` (or rewrites it when blessing);
/// a mismatch is described in `mismatches`.
fn compare(input: &Path, name: &str, rendered: &str, mismatches: &mut Vec<String>) {
    let expected_path = input.with_extension("stderr");
    if blessing() {
        std::fs::write(&expected_path, rendered).expect("writable snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
    if expected != rendered {
        mismatches.push(format!(
            "--- {name}: expected\n{expected}\n--- got\n{rendered}"
        ));
    }
}

fn assert_no_mismatches(mismatches: &[String]) {
    assert!(
        mismatches.is_empty(),
        "{}\n(run with MOEFORGE_BLESS=1 to accept)",
        mismatches.join("\n")
    );
}

#[test]
fn rendered_diagnostics_match_their_snapshots() {
    let mut inputs: Vec<_> = std::fs::read_dir(directory())
        .expect("tests/diagnostics exists")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "moe"))
        .collect();
    inputs.sort();
    assert!(inputs.len() >= 30, "one case per rule");
    let mut mismatches = Vec::new();
    for input in inputs {
        let name = format!(
            "tests/diagnostics/{}",
            input.file_name().and_then(|n| n.to_str()).unwrap_or("?")
        );
        let bytes = std::fs::read(&input).expect("readable test input");
        let rendered = match compile_bytes(&name, &bytes) {
            Ok(_) => panic!("{name} must not check"),
            Err(diagnostics) => diagnostics.render(),
        };
        compare(&input, &name, &rendered, &mut mismatches);
    }
    assert_no_mismatches(&mismatches);
}

/// A planner error shown at the layer's name, with the refused hint and what would work
/// there: checked for the H200, the layer is planned for a GPU without wgmma, which refuses
/// a tile only wgmma takes (checked for that GPU, the file is refused at the hint).
#[test]
fn plan_errors_render_at_the_layer_they_are_about() {
    let input = directory().join("plan/plan_refused.moe");
    let name = "tests/diagnostics/plan/plan_refused.moe";
    let text = std::fs::read_to_string(&input).expect("readable test input");
    let module = compile_source(name, &text).expect("the H200 can plan it, so it checks");
    let without_wgmma = Target {
        name: "sm_80 test target".into(),
        arch: "sm_80".into(),
        ..Target::h200()
    };
    let layer = &module.layers[0];
    let error = plan::plan(layer, &without_wgmma).expect_err("mma.sync cannot take the tile");
    let rendered = plan_diagnostics(name, &text, layer, &without_wgmma, &error).render();
    let mut mismatches = Vec::new();
    compare(&input, name, &rendered, &mut mismatches);
    assert_no_mismatches(&mismatches);

    assert!(compile_source_for(name, &text, &without_wgmma).is_err());
    let renamed = ir::Layer {
        name: "no_such_layer".into(),
        ..layer.clone()
    };
    let elsewhere = plan_diagnostics(name, &text, &renamed, &without_wgmma, &error);
    assert_eq!(
        elsewhere.errors[0].span().start,
        0,
        "a missing layer points at the file"
    );
}
