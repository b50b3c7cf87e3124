//! Every shipped example's kernels compile through NVRTC for sm_90a, and ptxas reports no
//! spills for any of them. Needs NVRTC (skips without it, fails under
//! MOEFORGE_REQUIRE_NVRTC=1); no GPU.

use moeforge_compiler::plan::{self, Target};
use moeforge_runtime::aot;
use moeforge_runtime::jit::{Jit, JitSettings};
use moeforge_runtime::toolkit::nvrtc_for_tests;

mod layers;

#[test]
fn every_example_compiles_for_sm90a_without_spills() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let target = Target::h200();
    let mut checked = 0;
    for layer in layers::examples() {
        let plan = plan::plan(&layer, &target).expect("every example plans");
        let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
        let module = jit
            .compile(&source.source, &aot::compile_options(&plan))
            .expect("NVRTC compiles the example");
        let report = jit
            .ptxas_report(&module.ptx, &plan.target.arch)
            .expect("ptxas -v");
        for entry in &source.entry_points {
            let function = report
                .function(entry)
                .unwrap_or_else(|| panic!("ptxas reports {entry}"));
            assert_eq!(
                (function.spill_stores, function.spill_loads),
                (0, 0),
                "{entry} of {} spills: {function:?}",
                layer.name
            );
            checked += 1;
        }
    }
    println!("{checked} kernels compiled without spills");
    assert!(
        checked >= 7 * 4,
        "every example has at least route, gemm1, gemm2 and combine"
    );
}
