//! Snapshot tests of rendered diagnostics: every `diagnostics/NAME.moe` (one per checker
//! rule, named after it) is compiled and its rendered errors are compared with
//! `diagnostics/NAME.stderr`. `MOEFORGE_BLESS=1 cargo test` rewrites the expectations.

use std::path::Path;

use moeforge_compiler::compile_bytes;

fn blessing() -> bool {
    std::env::var_os("MOEFORGE_BLESS").is_some_and(|value| value == "1")
}

#[test]
fn rendered_diagnostics_match_their_snapshots() {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/diagnostics");
    let mut inputs: Vec<_> = std::fs::read_dir(&directory)
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
        let expected_path = input.with_extension("stderr");
        if blessing() {
            std::fs::write(&expected_path, &rendered).expect("writable snapshot");
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != rendered {
            mismatches.push(format!(
                "--- {name}: expected\n{expected}\n--- got\n{rendered}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{}\n(run with MOEFORGE_BLESS=1 to accept)",
        mismatches.join("\n")
    );
}
