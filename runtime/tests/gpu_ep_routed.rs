//! Expert parallelism that routes itself, on virtual ranks, against the CPU reference: each
//! rank's router chooses its own tokens' experts (checked against the CPU router) and every
//! rank's output matches the reference on those choices, call by call and back to back.
//! Split from gpu_ep so that the GPU suite runs it in a lane of its own. Run on the GPU
//! machine: `cargo test -- --include-ignored`.

use moeforge_compiler::ir::Layer;
use moeforge_compiler::plan;
use moeforge_runtime::harness::Session;

mod ep_support;
mod layers;

use ep_support::*;

/// Calls that route themselves on virtual ranks: each rank's router chooses its own tokens'
/// experts (its logits, choices and weights against the CPU router), and every rank's
/// output matches the reference on the experts and weights its router chose. The scaled
/// examples with a router and an expert-parallel plan ([`self_routed_cases`]).
#[test]
#[ignore = "needs a CUDA GPU"]
fn self_routed_virtual_ranks_match_reference() {
    let seed = fresh_seed();
    say(format!(
        "self-routed expert parallelism on virtual ranks, seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let session = Session::open().expect("GPU session");
    let cases = self_routed_cases();
    for (layer, built, mut ep) in build_on_virtual_ranks(&session, &cases, seed) {
        assert!(ep.routes_itself(), "{} routes itself", layer.name);
        check_self_routed(&session, &built, &mut ep, &layer.name, seed);
    }
}

/// The scaled examples with a router and an expert-parallel plan, with their virtual ranks:
/// DeepSeek-V3 (sigmoid, group limit, correction bias, a shared expert) on 4, Qwen3-30B-A3B
/// (softmax, renormalised), Mixtral-8x7B (8 experts), GPT-OSS-120B (the gate's bias on the
/// logits, expert biases) and Qwen1.5-MoE-A2.7B (softmax not renormalised, a gated shared
/// expert, whose small calls run the ranks' fused decode with the gate) on 2.
fn self_routed_cases() -> Vec<(Layer, u32)> {
    let examples = layers::examples();
    let scaled = |name: &str| {
        layers::scaled_down(
            examples
                .iter()
                .find(|l| l.name == name)
                .unwrap_or_else(|| panic!("the {name} example")),
        )
    };
    vec![
        (scaled("deepseek_v3"), 4),
        (scaled("qwen3_30b_a3b"), 2),
        (scaled("mixtral_8x7b"), 2),
        (scaled("gpt_oss_120b"), 2),
        (scaled("qwen1_5_moe_a2_7b"), 2),
    ]
}

/// CPU: every self-routed case plans its ranks with a router on the H200, validly, and the
/// gated one fuses its ranks' small calls (so the GPU test covers the gate there).
#[test]
fn self_routed_cases_plan_a_router_on_their_ranks() {
    for (layer, ranks) in self_routed_cases() {
        let layer = over_ranks(&layer, ranks, true);
        let plan = plan::plan(&layer, &plan::Target::h200())
            .unwrap_or_else(|e| panic!("{}: {e}", layer.name));
        plan.validate()
            .unwrap_or_else(|e| panic!("{}: {e}", layer.name));
        assert!(
            plan.router.is_some() && plan.expert_parallel.is_some(),
            "{}",
            layer.name
        );
        if plan.shape.shared_gated {
            assert!(fused_max_tokens(&plan).is_some(), "{}", layer.name);
        }
    }
    assert!(
        self_routed_cases()
            .iter()
            .any(|(layer, _)| layer.shared_experts.is_some_and(|shared| shared.gated)),
        "a gated shared expert among the cases"
    );
}
