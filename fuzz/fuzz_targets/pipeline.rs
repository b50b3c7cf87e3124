//! Fuzzes what `check`, `explain`, `compile` (up to the CUDA source) and `simulate` do with a
//! file that checks: every layer is planned for the H200 (a refusal is a typed error, never
//! a panic), a plan the planner returns passes its own validation and generates CUDA, and
//! a plan with ranks simulates a short call. The checker's valid inputs are where the
//! planner's arithmetic meets odd sizes, hints and topologies a user may write.
//!
//! Run from `fuzz/` (seed the corpus with the examples first):
//! `mkdir -p corpus/pipeline && cp ../dsl-examples/*.moe corpus/pipeline/ &&
//!  RUSTC_BOOTSTRAP=1 cargo fuzz run pipeline -- -dict=moe.dict -max_len=4096 -timeout=20 -max_total_time=600`
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeforge_compiler::plan::{self, Target};
use moeforge_compiler::simulate::{self, Options, Routing};
use moeforge_compiler::{codegen, compile_bytes};

/// Ranks past this are left unsimulated: 1024 ranks take seconds, which would starve the
/// fuzzer without reaching new planner code.
const MAX_SIMULATED_RANKS: u32 = 64;

fuzz_target!(|bytes: &[u8]| {
    let Ok(module) = compile_bytes("fuzz.moe", bytes) else { return };
    let target = Target::h200();
    for layer in &module.layers {
        let _ = plan::memory_problem(layer, &target);
        let _ = plan::hint_problems(layer, &target);
        let Ok(plan) = plan::plan(layer, &target) else { continue };
        if let Err(invalid) = plan.validate() {
            panic!("layer `{}`: the planner's own plan fails validation: {invalid}", layer.name);
        }
        let _ = plan::describe(&plan);
        if let Err(error) = codegen::generate(&plan) {
            panic!("layer `{}`: a validated plan does not generate: {error}", layer.name);
        }
        if plan.shape.spec_ranks > 1 && plan.shape.spec_ranks <= MAX_SIMULATED_RANKS {
            let options = Options {
                tokens_per_rank: plan.shape.max_tokens.min(16),
                routing: Routing::Uniform,
                timeline_ranks: 0,
                fused_decode: true,
            };
            let _ = simulate::simulate(&plan, &simulate::Topology::of(&layer.topology), &options);
        }
    }
});
