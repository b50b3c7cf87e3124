//! Snapshot tests of syntax trees: every `ast/NAME.moe` is parsed and the tree (with byte
//! spans, comments and syntax errors) is compared with `ast/NAME.ast`.
//! `MOEFORGE_BLESS=1 cargo test` rewrites the expectations.

use std::path::Path;

use moeforge_compiler::parse;

#[test]
fn syntax_trees_match_their_snapshots() {
    let bless = std::env::var_os("MOEFORGE_BLESS").is_some_and(|value| value == "1");
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ast");
    let mut inputs: Vec<_> = std::fs::read_dir(&directory)
        .expect("tests/ast exists")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "moe"))
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty());
    let mut mismatches = Vec::new();
    for input in inputs {
        let text = std::fs::read_to_string(&input).expect("readable test input");
        let tree = format!("{:#?}\n", parse(&text));
        let snapshot = input.with_extension("ast");
        if bless {
            std::fs::write(&snapshot, &tree).expect("writable snapshot");
        } else if std::fs::read_to_string(&snapshot).unwrap_or_default() != tree {
            mismatches.push(format!("{}:\n{tree}", input.display()));
        }
    }
    assert!(
        mismatches.is_empty(),
        "trees changed (MOEFORGE_BLESS=1 to accept):\n{}",
        mismatches.join("\n")
    );
}
