//! The whole pipeline on generated `.moe` files, as a user could write them: every key of
//! the language drawn over its documented range (and a little past it), through the checker,
//! the planner (for each known target: `--target h200|h100|a100`), the plan's own
//! validation, `explain`'s description, codegen and, where the layer has ranks, the
//! simulator. A spec may be refused at any stage, with a typed error;
//! nothing may panic, and a plan the planner returns must validate and generate.
//!
//! The cases run here are few (CI's budget); `PROPTEST_CASES=20000 cargo test --release
//! --test whole_pipeline` explores further. `fuzz/fuzz_targets/pipeline.rs` feeds the same
//! stages arbitrary bytes.

use moeforge_compiler::plan::{self, Target};
use moeforge_compiler::simulate::{self, Options, Routing, SimError};
use moeforge_compiler::{codegen, compile_source, compile_source_for, plan_diagnostics};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Ranks past this are left unsimulated (1024 ranks take seconds a call).
const MAX_SIMULATED_RANKS: u32 = 64;

/// A topology block: one node of 1-8 GPUs, several nodes, or virtual ranks (on one GPU or
/// emulating the nodes), with its rank count.
fn topology() -> impl Strategy<Value = (String, u32)> {
    (
        prop::sample::select(vec![1u32, 2, 3, 4, 8]),
        prop::sample::select(vec![1u32, 1, 2, 3, 4, 8]),
        0u32..3,
        prop::sample::select(vec![2u32, 4, 8, 16, 33, 44, 45, 66, 67, 128]),
    )
        .prop_map(|(gpus, nodes, virtual_kind, virtual_count)| {
            let (virtual_line, ranks) = match virtual_kind {
                // Emulated nodes: a virtual rank per GPU of the topology.
                1 if nodes > 1 => (format!("virtual_ranks = {}\n", gpus * nodes), gpus * nodes),
                // Virtual ranks on one GPU.
                2 if gpus * nodes == 1 => (format!("virtual_ranks = {virtual_count}\n"), virtual_count),
                _ => (String::new(), gpus * nodes),
            };
            (
                format!(
                    "topology machine {{\n  gpus_per_node = {gpus}\n  nodes = {nodes}\n  {virtual_line}  nvlink = 450 GB/s, 3 us\n  network = 50 GB/s, 10 us\n}}\n"
                ),
                ranks,
            )
        })
}

/// A router section (or none), valid for `experts` experts most of the time.
fn router(experts: u32) -> impl Strategy<Value = String> {
    let groups: Vec<u32> = (1..=experts.min(16))
        .filter(|&g| experts.is_multiple_of(g))
        .collect();
    (
        0u32..5,
        0u32..3,
        prop::sample::select(groups),
        0u32..4,
        any::<bool>(),
        prop::sample::select(vec!["1.0", "2.5", "0.5", "16"]),
    )
        .prop_map(move |(scoring, bias, groups, kept, normalize, scale)| {
            let mut lines = Vec::new();
            match scoring {
                0 => return String::new(),
                1 => lines.push("scoring = softmax".to_string()),
                2 => lines.push("scoring = sigmoid".to_string()),
                _ => lines.push("scoring = topk_softmax".to_string()),
            }
            lines.push(format!(
                "bias = {}",
                ["none", "logits", "score_correction"][bias as usize]
            ));
            if groups > 1 {
                lines.push(format!("groups = {groups}"));
                lines.push(format!("groups_kept = {}", (kept + 1).min(groups)));
            }
            if scoring < 3 {
                lines.push(format!("normalize = {normalize}"));
            }
            lines.push(format!("scale = {scale}"));
            format!("  router {{\n    {}\n  }}\n", lines.join("\n    "))
        })
}

/// Schedule hints, each set about a third of the time; tiles include some the target
/// cannot run (the planner must refuse them with a reason, not fail later).
fn schedule() -> impl Strategy<Value = String> {
    let tiles = vec![
        "16x64x64",
        "32x64x64",
        "64x64x64",
        "64x128x64",
        "128x128x64",
        "128x256x64",
        "256x128x64",
        "128x64x128",
        "48x64x64",
        "16x16x16",
        "256x256x64",
    ];
    (
        prop::option::weighted(0.3, prop::sample::select(tiles.clone())),
        prop::option::weighted(0.3, prop::sample::select(tiles)),
        prop::option::weighted(0.3, 2u32..=8),
        prop::option::weighted(0.3, prop::sample::select(vec![1u32, 7, 16, 64, 256, 4096])),
        prop::option::weighted(0.3, 1u32..=8),
        prop::option::weighted(0.3, 0usize..3),
        prop::option::weighted(0.3, prop::sample::select(vec![0u32, 1, 8, 32, 64])),
        prop::option::weighted(
            0.2,
            prop::sample::select(vec!["1 ms", "200 ms", "600000 ms"]),
        ),
    )
        .prop_map(
            |(gemm1, gemm2, stages, chunk, comm, traffic, fused, timeout)| {
                let mut lines = Vec::new();
                if let Some(tile) = gemm1 {
                    lines.push(format!("gemm1.tile = {tile}"));
                }
                if let Some(tile) = gemm2 {
                    lines.push(format!("gemm2.tile = {tile}"));
                }
                if let Some(stages) = stages {
                    lines.push(format!("stages = {stages}"));
                }
                if let Some(chunk) = chunk {
                    lines.push(format!("dispatch_chunk = {chunk} tokens"));
                }
                if let Some(comm) = comm {
                    lines.push(format!("comm_blocks = {comm}"));
                }
                if let Some(traffic) = traffic {
                    lines.push(format!(
                        "traffic = {}",
                        ["nearest_first", "rotate", "hierarchical"][traffic]
                    ));
                }
                if let Some(fused) = fused {
                    lines.push(format!("fused_decode = {fused} tokens"));
                }
                if let Some(timeout) = timeout {
                    lines.push(format!("flag_timeout = {timeout}"));
                }
                if lines.is_empty() {
                    String::new()
                } else {
                    format!("  schedule {{\n    {}\n  }}\n", lines.join("\n    "))
                }
            },
        )
}

/// A whole file: a topology and one layer whose expert count the ranks divide.
fn spec() -> impl Strategy<Value = String> {
    (
        topology(),
        prop_oneof![
            prop::sample::select(vec![64u32, 128, 192, 1024, 2880, 4096, 7168]),
            (1u32..=256).prop_map(|n| 64 * n),
        ],
        prop_oneof![
            prop::sample::select(vec![64u32, 128, 320, 768, 1536, 2048, 2880]),
            (1u32..=128).prop_map(|n| 64 * n),
        ],
        prop::sample::select(vec![1u32, 2, 4, 8, 16, 32, 64, 128, 256, 1024]),
        prop::sample::select(vec![1u32, 1, 2, 4, 8]),
        prop::sample::select(vec!["swiglu", "clamped_swiglu", "geglu", "gelu", "relu", "silu"]),
        any::<bool>(),
        prop::sample::select(vec![1u32, 2, 17, 128, 512, 4096, 16384, 100_000]),
        prop::option::weighted(0.3, (1u32..=2, 1u32..=2, any::<bool>())),
    )
        .prop_flat_map(
            |((topology, ranks), hidden, ffn, experts, top_k, activation, bias, max_tokens, shared)| {
                // The ranks must divide the experts: take the smallest multiple of the ranks
                // at or above the drawn count.
                let experts = experts.div_ceil(ranks) * ranks;
                let top_k = top_k.min(experts);
                let shared_text = shared
                    .map(|(count, times, gated)| {
                        format!(
                            "  shared_experts {{\n    count = {count}\n    ffn = {}\n    gated = {gated}\n  }}\n",
                            ffn * times
                        )
                    })
                    .unwrap_or_default();
                (router(experts), schedule()).prop_map(move |(router, schedule)| {
                    format!(
                        "{topology}\nlayer generated {{\n  hidden = {hidden}\n  ffn = {ffn}\n  experts = {experts}\n  top_k = {top_k}\n  activation = {activation}\n  expert_bias = {bias}\n  max_tokens = {max_tokens}\n{shared_text}{router}  parallel {{\n    expert = {ranks}\n  }}\n  topology = machine\n{schedule}}}\n"
                    )
                })
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_stage_refuses_with_a_typed_error_or_passes_on(
        text in spec(),
        tokens in prop::sample::select(vec![0u32, 1, 16, 300, 2048]),
        routing in 0u32..3,
        target in prop::sample::select(vec!["h200", "h100", "a100"]),
    ) {
        let module = match compile_source("generated.moe", &text) {
            Ok(module) => module,
            Err(diagnostics) => {
                prop_assert!(!diagnostics.render().is_empty());
                return Ok(());
            }
        };
        let target = Target::named(target).expect("a known target");
        for layer in &module.layers {
            let _ = plan::memory_problem(layer, &target);
            let _ = plan::hint_problems(layer, &target);
            let plan = match plan::plan(layer, &target) {
                Ok(plan) => plan,
                Err(error) => {
                    // The checker refuses on the H200 what the planner refuses for hints and
                    // rank residency there.
                    let checked_already = matches!(
                        error,
                        plan::PlanError::ImpossibleHint { .. } | plan::PlanError::RanksDoNotFit { .. }
                    );
                    prop_assert!(
                        target.name != Target::h200().name || !checked_already,
                        "checked, but the planner refuses it on the H200: {error}\n{text}"
                    );
                    // Checked for the target itself, the file is refused.
                    prop_assert!(
                        !checked_already || compile_source_for("generated.moe", &text, &target).is_err(),
                        "checked for the {}, but the planner refuses it there: {error}\n{text}",
                        target.name
                    );
                    let diagnostics = plan_diagnostics("generated.moe", &text, layer, &target, &error);
                    prop_assert!(!diagnostics.render().is_empty());
                    continue;
                }
            };
            if let Err(invalid) = plan.validate() {
                prop_assert!(false, "the planner's own plan fails validation: {invalid}\n{text}");
            }
            prop_assert!(!plan::describe(&plan).is_empty());
            if let Err(error) = codegen::generate(&plan) {
                prop_assert!(false, "a validated plan does not generate: {error}\n{text}");
            }
            let ranks = plan.shape.spec_ranks;
            if ranks > 1 && ranks <= MAX_SIMULATED_RANKS {
                simulates_every_pair_once(&plan, layer, tokens, routing, &text)?;
            }
        }
    }
}

/// A validated plan simulates without deadlock, and in every schedule each source's pairs
/// are dispatched and combined exactly once, in finite, non-negative time.
fn simulates_every_pair_once(
    plan: &plan::Plan,
    layer: &moeforge_compiler::ir::Layer,
    tokens: u32,
    routing: u32,
    text: &str,
) -> Result<(), TestCaseError> {
    let tokens = tokens.min(plan.shape.max_tokens);
    // Grouped as the router limits the groups, where it does.
    let limit = layer.router.and_then(|router| router.group_limit);
    let routing = match (routing, limit) {
        (0, _) => Routing::Uniform,
        (1, _) | (_, None) => Routing::Skewed,
        (_, Some(limit)) => Routing::GroupLimited {
            groups: limit.groups,
            kept: limit.kept,
        },
    };
    let options = Options {
        tokens_per_rank: tokens,
        routing,
        timeline_ranks: 0,
        fused_decode: true,
    };
    let topology = simulate::Topology::of(&layer.topology);
    let report = match simulate::simulate(plan, &topology, &options) {
        Ok(report) => report,
        // Expert biases leave the plan without expert-parallel kernels (a limitation).
        Err(SimError::NotExpertParallel(_)) => return Ok(()),
        Err(error) => {
            return Err(TestCaseError::fail(format!(
                "a validated plan does not simulate: {error}\n{text}"
            )));
        }
    };
    prop_assert!(
        report.deadlock.is_none(),
        "a validated plan deadlocks: {:?}\n{text}",
        report.deadlock
    );
    let routed = u64::from(tokens) * u64::from(plan.shape.top_k);
    for schedule in &report.schedules {
        let a = &schedule.accounting;
        prop_assert_eq!(
            &a.pairs_routed,
            &vec![routed; report.ranks as usize],
            "{}",
            text
        );
        prop_assert_eq!(
            &a.pairs_dispatched,
            &a.pairs_routed,
            "{:?}\n{}",
            schedule.schedule,
            text
        );
        prop_assert_eq!(
            &a.pairs_combined,
            &a.pairs_routed,
            "{:?}\n{}",
            schedule.schedule,
            text
        );
        prop_assert!(
            a.token_mismatches.is_empty(),
            "{:?}\n{}",
            schedule.schedule,
            text
        );
        for time in [schedule.layer_s, schedule.dispatch_s, schedule.combine_s] {
            prop_assert!(
                time.is_finite() && time >= 0.0,
                "{:?}: {time}\n{text}",
                schedule.schedule
            );
        }
    }
    Ok(())
}
