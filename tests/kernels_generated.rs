//! `kernels-generated/` is the AOT output (`moeforge compile`) of every example, checked in.
//! This test regenerates it and fails on any difference; `MOEFORGE_BLESS=1` rewrites it.
//! PTX is compared when NVRTC is present (always in CI, which sets MOEFORGE_REQUIRE_NVRTC=1).

use std::path::Path;

use moeforge::compiler::plan::{self, Target};
use moeforge::runtime::aot;
use moeforge::runtime::jit::{Jit, JitSettings};
use moeforge::runtime::toolkit::nvrtc_for_tests;

#[test]
fn kernels_generated_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bless = std::env::var("MOEFORGE_BLESS").is_ok_and(|v| v == "1");
    let jit = nvrtc_for_tests()
        .map(|tk| Jit::new(tk, JitSettings::from_env().expect("JIT settings")).expect("JIT"));
    let mut examples: Vec<_> = std::fs::read_dir(root.join("dsl-examples"))
        .expect("dsl-examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "moe"))
        .collect();
    examples.sort();
    let mut stale = Vec::new();
    for example in &examples {
        let text = std::fs::read_to_string(example).expect("readable example");
        let module = moeforge::compiler::compile_source(&example.display().to_string(), &text)
            .expect("example checks");
        let plans: Vec<_> = module
            .layers
            .iter()
            .map(|l| plan::plan(l, &Target::h200()).expect("example plans"))
            .collect();
        let files = aot::render(&plans, jit.as_ref()).expect("AOT output");
        let dir = root
            .join("kernels-generated")
            .join(example.file_stem().expect("file name"));
        for file in files {
            let path = dir.join(&file.name);
            if bless {
                std::fs::create_dir_all(&dir).expect("create kernels-generated/<example>");
                std::fs::write(&path, &file.contents).expect("write");
            } else if std::fs::read(&path).ok().as_deref() != Some(&file.contents[..]) {
                stale.push(path.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "kernels-generated/ is stale: {}\nregenerate with MOEFORGE_BLESS=1 cargo test --test kernels_generated",
        stale.join(", ")
    );
}

/// A deployment loads the AOT directory without the language: the plan read back from
/// `plan.json` matches the one the compiler makes, and the PTX holds every entry point.
#[test]
fn aot_directory_loads_without_the_language() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("dsl-examples/tiny.moe")).expect("tiny.moe");
    let module = moeforge::compiler::compile_source("tiny.moe", &text).expect("tiny checks");
    let planned = plan::plan(&module.layers[0], &Target::h200()).expect("tiny plans");
    let (loaded, compiled) =
        aot::load_layer(&root.join("kernels-generated/tiny"), None).expect("AOT directory loads");
    // Estimates are floats that JSON need not round-trip exactly; everything that drives
    // execution must.
    assert_eq!(loaded.shape, planned.shape);
    assert_eq!(loaded.workspace, planned.workspace);
    for (l, p) in loaded.regimes.iter().zip(&planned.regimes) {
        assert_eq!(
            (&l.launches, l.gemm1.tile, l.gemm2.tile),
            (&p.launches, p.gemm1.tile, p.gemm2.tile)
        );
    }
    assert_eq!(loaded.regimes.len(), planned.regimes.len());
    for entry in planned.entry_points() {
        assert!(
            compiled.ptx.contains(&format!(".entry {entry}(")),
            "{entry} in the PTX"
        );
    }
    let missing = aot::load_layer(&root.join("kernels-generated/tiny"), Some("nope"));
    assert!(matches!(missing, Err(aot::AotError::NoSuchLayer { .. })));
}
