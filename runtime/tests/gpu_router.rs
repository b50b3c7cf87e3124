//! The router on the GPU against the CPU reference (GPU tests are ignored by default: on
//! the GPU machine run `cargo test -p moeforge-runtime --test gpu_router -- --include-ignored`).
//!
//! Every case runs a call that routes itself (`MoeLayer::forward_routed`) and checks, with
//! `Session::run_checked_routed`:
//! - the gate's logits against `x · W_gateᵀ` on the host, within an f32 summation bound;
//! - the chosen experts, in order, exactly against the reference's choice from the kernel's
//!   own logits (so no f32 rounding of the logits can flip a near-tie);
//! - the weights against the reference's weights of those experts (relative 1e-5);
//! - every output element of the layer against the CPU reference of the layer on the
//!   experts and weights the router chose, and that every element was written.
//!
//! Layers: one per reference rule (Mixtral, Qwen3-MoE without renormalising, DeepSeek-V3
//! with its correction bias and group limit, GPT-OSS with its logit bias, on 62 experts so
//! that the last expert tile is ragged and, E not being whole float4s, its split router's
//! gates run mma.sync and the select kernel rather than in clusters), two whose large
//! calls run the wgmma gate (a sample
//! of each call's tokens checked), and every shipped example with a router scaled down;
//! token counts 1, 7, each regime's first and last count and a ragged one, and each split
//! gate's first and last. A last
//! test gives pairs of experts identical gate rows (and biases), so that every token meets
//! exact ties, which must go to the lower index. Seeds are printed; MOEFORGE_SEED replays.

use std::io::Write;

use moeforge_compiler::ir::{
    Activation, GroupLimit, Layer, Router, RouterBias, Scoring, TileShape,
};
use moeforge_compiler::plan::router::{self, GateEngine};
use moeforge_compiler::plan::{self, Plan, Target};
use moeforge_runtime::gpu::Gpu;
use moeforge_runtime::harness::{BuiltLayer, CHECKED_TOKENS, Session};
use moeforge_runtime::toolkit;
use moeforge_runtime::weights::random_gate;
use moeforge_runtime::workload::{self, Routing, Workload};

mod layers;

fn log(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

fn target() -> Target {
    toolkit::driver_available()
        .ok()
        .and_then(|_| Gpu::open(0).ok())
        .map(|gpu| gpu.target().expect("the device's target"))
        .unwrap_or_else(Target::h200)
}

/// A small layer routed by `router`.
fn routed_layer(name: &str, experts: u32, top_k: u32, router: Router) -> Layer {
    let mut layer = layers::tiny(Activation::Swiglu);
    layer.name = name.to_string();
    layer.hidden = 512;
    layer.ffn = 128;
    layer.experts = experts;
    layer.top_k = top_k;
    layer.max_tokens = 1024;
    layer.router = Some(router);
    layer
}

/// One layer per reference model's rule.
fn rule_layers() -> Vec<Layer> {
    let rule = |scoring, bias, normalize, group_limit, scale| Router {
        scoring,
        bias,
        group_limit,
        normalize,
        scale,
    };
    vec![
        routed_layer(
            "mixtral_rule",
            8,
            2,
            rule(Scoring::Softmax, RouterBias::None, true, None, 1.0),
        ),
        routed_layer(
            "qwen3_rule_unnormalised",
            128,
            8,
            rule(Scoring::Softmax, RouterBias::None, false, None, 1.0),
        ),
        routed_layer(
            "deepseek_v3_rule",
            256,
            8,
            rule(
                Scoring::Sigmoid,
                RouterBias::ScoreCorrection,
                true,
                Some(GroupLimit { groups: 8, kept: 4 }),
                2.5,
            ),
        ),
        // Groups of 20 experts are not whole entries of a warp's lanes: the select ranks
        // them in shared memory (DeepSeek-V3's groups of 32 take warp reductions).
        routed_layer(
            "groups_of_20_rule",
            160,
            6,
            rule(
                Scoring::Sigmoid,
                RouterBias::ScoreCorrection,
                true,
                Some(GroupLimit { groups: 8, kept: 3 }),
                1.0,
            ),
        ),
        {
            // Calls past 1024 tokens (4096 pairs) run a split router.
            let mut layer = routed_layer(
                "gpt_oss_rule",
                62,
                4,
                rule(Scoring::TopkSoftmax, RouterBias::Logits, false, None, 1.0),
            );
            layer.max_tokens = 2048;
            layer
        },
    ]
}

/// Layers whose split routers run the wgmma gate on an H200 (E in whole 16-expert pieces,
/// at least 32 k-tiles a block): Qwen3-MoE's rule on 128 experts over H = 2048 up to 16384
/// tokens (64-token tiles from 4097 tokens, 128-token tiles from 8193) and DeepSeek-V3's
/// on 256 experts over H = 4096 up to 4096 tokens (64-token tiles, the reduction split in
/// two). F = 64 keeps the CPU reference of their large calls short.
fn wgmma_gate_layers() -> Vec<Layer> {
    let mut layers = rule_layers();
    let mut qwen3 = layers.remove(1);
    qwen3.name = "qwen3_rule_wgmma_gate".into();
    qwen3.hidden = 2048;
    qwen3.max_tokens = 16384;
    let mut deepseek = layers.remove(1);
    deepseek.name = "deepseek_v3_rule_wgmma_gate".into();
    deepseek.hidden = 4096;
    deepseek.max_tokens = 4096;
    let mut both = vec![qwen3, deepseek];
    for layer in &mut both {
        layer.ffn = 64;
    }
    both
}

/// Tokens of a wgmma gate layer's call checked against the reference: a sample that
/// reaches every 128-token tile of a 16384-token call with high probability, and keeps the
/// reference of a dozen large calls to seconds.
const WGMMA_GATE_CHECKED_TOKENS: usize = 1024;

/// Token counts of a plan: 1, 7, and each regime's first, last and a ragged count.
fn token_counts(plan: &Plan) -> Vec<u32> {
    let mut counts = vec![1, 7];
    for regime in &plan.regimes {
        let middle = (regime.min_tokens + (regime.max_tokens - regime.min_tokens) / 2) | 1;
        counts.extend([regime.min_tokens.max(1), regime.max_tokens, middle]);
    }
    // Each of a split router's gates at both ends of its calls.
    for gate in plan
        .router
        .iter()
        .flat_map(|r| &r.regimes)
        .flat_map(|r| &r.gates)
    {
        counts.extend([gate.min_tokens.max(1), gate.max_tokens]);
    }
    counts.retain(|&t| t <= plan.shape.max_tokens);
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// Runs every token count of `built` routed by itself, checking at most `checked_tokens`
/// tokens of each call; a line per failing case.
fn check_routed(
    session: &Session,
    built: &BuiltLayer,
    seed: u64,
    checked_tokens: usize,
) -> Vec<String> {
    let plan = built.layer.plan();
    let mut failures = Vec::new();
    for tokens in token_counts(plan) {
        let case_seed = seed ^ (u64::from(tokens) << 20);
        let workload = Workload::random(&plan.shape, tokens, Routing::Uniform, case_seed);
        let label = format!("{} T={tokens}", plan.layer);
        match session.run_checked_routed(built, &workload, checked_tokens, case_seed) {
            Ok(report) => {
                let router_checked = report
                    .router
                    .as_ref()
                    .is_some_and(|r| r.tokens == report.checked_tokens);
                let passed = report.passed() && router_checked;
                log(&format!(
                    "{label}: {report}: {}",
                    if passed { "ok" } else { "FAIL" }
                ));
                if !passed {
                    failures.push(format!("{label}: {report}"));
                }
            }
            Err(error) => {
                log(&format!("{label}: FAIL: {error}"));
                failures.push(format!("{label}: {error}"));
            }
        }
    }
    failures
}

fn check_layers(suite: &str, layers: Vec<Layer>) {
    check_layers_sampled(suite, layers, CHECKED_TOKENS);
}

fn check_layers_sampled(suite: &str, layers: Vec<Layer>, checked_tokens: usize) {
    let seed = fresh_seed();
    log(&format!(
        "{suite}: {} layers, seed {seed} (replay with MOEFORGE_SEED={seed})",
        layers.len()
    ));
    let target = target();
    let plans: Vec<Plan> = layers
        .iter()
        .map(|layer| {
            plan::plan(layer, &target)
                .unwrap_or_else(|e| panic!("{} does not plan: {e}", layer.name))
        })
        .collect();
    let session = Session::open().expect("GPU session");
    let built = session.build_many(plans, seed).expect("build");
    let mut failures = Vec::new();
    for layer in built {
        assert!(
            layer.layer.routes_itself(),
            "{} was built with a random gate",
            layer.layer.plan().layer
        );
        failures.extend(check_routed(&session, &layer, seed, checked_tokens));
    }
    assert!(
        failures.is_empty(),
        "{} failing cases (seed {seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn the_rule_layers_plan_a_router_with_ragged_expert_tiles() {
    let target = Target::h200();
    for layer in rule_layers() {
        let plan = plan::plan(&layer, &target).expect("plans");
        let router = plan.router.expect("a router plan");
        assert_eq!(router.regimes.len(), plan.regimes.len());
        if layer.experts == 62 {
            assert!(
                router
                    .regimes
                    .iter()
                    .flat_map(|r| &r.gates)
                    .all(|g| g.tile_experts * g.expert_tiles > 62),
                "62 experts leave the last expert tile ragged"
            );
        }
    }
}

/// The suites' calls include a split router's gate split over blocks along the reduction
/// (its last blocks sum the parts), one that is not, and cluster gates of several blocks
/// (which select) with a padded expert tile and without, so every path runs on the GPU; and
/// every gate of a router runs, a fused router's of several gates among them.
#[test]
fn the_suites_run_split_gates_split_over_blocks_and_whole() {
    let target = Target::h200();
    let (mut split, mut whole, mut gates_run, mut gates) = (0, 0, 0, 0);
    let (mut clustered, mut clustered_padded, mut fused_ranges) = (0, 0, 0);
    for layer in rule_layers().into_iter().chain(routed_examples()) {
        let plan = plan::plan(&layer, &target).expect("plans");
        let router = plan.router.clone().expect("a router plan");
        let mut run = std::collections::BTreeSet::new();
        for tokens in token_counts(&plan) {
            let index = plan.regime_index_for(tokens).expect("a regime");
            let regime = &router.regimes[index];
            let gate = regime.launches_for(tokens).next().expect("a gate");
            run.insert((index, gate));
            if !regime.fused {
                let plan_of_gate = &regime.gates[gate];
                if plan_of_gate.engine.selects() && plan_of_gate.splits(tokens) > 1 {
                    clustered += 1;
                    if plan_of_gate.tile_experts > layer.experts {
                        clustered_padded += 1;
                    }
                } else if plan_of_gate.splits(tokens) > 1 {
                    split += 1;
                } else {
                    whole += 1;
                }
            }
        }
        gates_run += run.len();
        gates += router.regimes.iter().map(|r| r.gates.len()).sum::<usize>();
        fused_ranges += router
            .regimes
            .iter()
            .filter(|r| r.fused && r.gates.len() > 1)
            .count();
    }
    assert!(
        split > 0 && whole > 0 && clustered > clustered_padded && clustered_padded > 0,
        "split gates over blocks: {split} calls, whole: {whole}, in clusters: {clustered} ({clustered_padded} padded)"
    );
    assert_eq!(gates_run, gates, "routers' gates run by the suites");
    assert!(
        fused_ranges > 0,
        "the suites have a fused router of several gates"
    );
    assert!(gates > 2, "the suites have split routers of several gates");
}

/// Both ways of ranking a group limit's groups run on the GPU: by warp reductions (groups
/// of a multiple of 32 experts) and from each warp's selection values in shared memory.
#[test]
fn the_rule_layers_rank_groups_both_ways() {
    let grouped: Vec<bool> = rule_layers()
        .iter()
        .filter_map(|layer| {
            let rule = layer.router.as_ref().expect("a rule layer has a router");
            rule.group_limit
                .map(|_| router::groups_in_shared_memory(rule, layer.experts))
        })
        .collect();
    assert!(
        grouped.contains(&true) && grouped.contains(&false),
        "group limits ranked in shared memory: {grouped:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn each_rule_routes_as_the_reference_and_the_layer_follows() {
    check_layers("router rules", rule_layers());
}

/// The scaled-down examples with a router, each once: an example whose single-GPU plan
/// runs the same kernels as an earlier one's, with the same router (DeepSeek-V3 at EP = 64
/// against DeepSeek-V3: on one GPU every expert runs here), is left out.
fn routed_examples() -> Vec<Layer> {
    let target = target();
    let mut routed: Vec<(Layer, Plan)> = Vec::new();
    for layer in layers::examples()
        .iter()
        .filter(|layer| layer.router.is_some())
    {
        let mut scaled = layers::scaled_down(layer);
        scaled.name = format!("{}_routed", scaled.name);
        let plan = plan::plan(&scaled, &target)
            .unwrap_or_else(|e| panic!("{} does not plan: {e}", scaled.name));
        let same_as = routed.iter().find(|(earlier, earlier_plan)| {
            earlier.router == scaled.router && layers::same_single_gpu_kernels(earlier_plan, &plan)
        });
        match same_as {
            Some((earlier, _)) => log(&format!(
                "{}: same kernels and router as {} on one GPU; not run twice",
                scaled.name, earlier.name
            )),
            None => routed.push((scaled, plan)),
        }
    }
    routed.into_iter().map(|(layer, _)| layer).collect()
}

/// The wgmma gate layers plan wgmma gates of 64 and 128 tokens by 128 experts and of 64
/// tokens by 256, one of them split over blocks at a call the suite runs.
#[test]
fn the_wgmma_gate_layers_plan_wgmma_gates() {
    let target = Target::h200();
    let mut tiles = std::collections::BTreeSet::new();
    let mut split = false;
    for layer in wgmma_gate_layers() {
        let plan = plan::plan(&layer, &target).expect("plans");
        let router = plan.router.clone().expect("a router plan");
        for tokens in token_counts(&plan) {
            let regime = &router.regimes[plan.regime_index_for(tokens).expect("a regime")];
            if regime.fused {
                continue;
            }
            let gate = &regime.gates[regime.launches_for(tokens).next().expect("a gate")];
            if gate.engine == GateEngine::WarpSpecialized {
                tiles.insert((gate.tile_tokens, gate.tile_experts));
                split |= gate.splits(tokens) > 1;
            }
        }
    }
    assert_eq!(
        tiles.into_iter().collect::<Vec<_>>(),
        [(64, 128), (64, 256), (128, 128)]
    );
    assert!(split, "a wgmma gate split over blocks runs");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wgmma_gates_route_as_the_reference() {
    check_layers_sampled(
        "wgmma gates",
        wgmma_gate_layers(),
        WGMMA_GATE_CHECKED_TOKENS,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn scaled_examples_with_a_router_route_themselves() {
    let examples = routed_examples();
    assert!(examples.len() >= 4, "the examples of the four families");
    check_layers("examples with a router", examples);
}

/// The rule layers with `fused_decode = 16 tokens` on mma.sync tiles: calls of up to 16
/// tokens run the router (which then leaves the routing metadata out), then the fused
/// decode; larger calls the table after the router's metadata.
fn fused_decode_rule_layers() -> Vec<Layer> {
    let tile = TileShape {
        m: 16,
        n: 64,
        k: 64,
    };
    rule_layers()
        .into_iter()
        .map(|mut layer| {
            layer.name = format!("{}_fused", layer.name);
            layer.schedule.gemm1_tile = Some(tile);
            layer.schedule.gemm2_tile = Some(tile);
            layer.schedule.fused_decode = Some(16);
            layer
        })
        .collect()
}

#[test]
fn the_fused_decode_rule_layers_plan_a_fused_decode_and_router() {
    let mut fused_routers = 0;
    for layer in fused_decode_rule_layers() {
        let plan = plan::plan(&layer, &Target::h200()).expect("plans");
        let fused = plan.regimes[0].fused_decode.as_ref();
        assert_eq!(
            fused.map(|f| f.max_tokens),
            Some(16),
            "{}: {:?}",
            layer.name,
            plan.hints_not_honoured
        );
        fused_routers += usize::from(plan.router.as_ref().expect("a router").regimes[0].fused);
    }
    // Both kinds of router run before the fused decode: the fused router (gate, select and
    // metadata in one kernel, here without the metadata) and the split one (gate, select).
    assert!(
        (1..4).contains(&fused_routers),
        "{fused_routers} of 4 first regimes route fused"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_fused_decode_routed_by_the_router_matches_reference() {
    check_layers("router rules, fused decode", fused_decode_rule_layers());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn exact_ties_go_to_the_lower_expert() {
    let seed = fresh_seed();
    log(&format!(
        "router ties: seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let target = target();
    let session = Session::open().expect("GPU session");
    let mut failures = Vec::new();
    for layer in rule_layers() {
        let plan = plan::plan(&layer, &target).expect("plans");
        let rule = plan.router.as_ref().expect("a router").rule;
        // Expert 2j + 1 gets expert 2j's gate row and bias: equal logits, bit for bit (the
        // same products summed in the same order), so every token meets ties.
        let mut gate = random_gate(&plan.shape, rule.bias, seed);
        let hidden = plan.shape.hidden as usize;
        for pair in gate.weight.chunks_exact_mut(2 * hidden) {
            let (even, odd) = pair.split_at_mut(hidden);
            odd.copy_from_slice(even);
        }
        if let Some(bias) = &mut gate.bias {
            for pair in bias.chunks_exact_mut(2) {
                pair[1] = pair[0];
            }
        }
        let experts = session
            .random_weights(&plan.shape, seed)
            .expect("random weights");
        let built = session
            .build_with_weights_and_gate(plan, experts, Some(gate))
            .expect("build");
        failures.extend(check_routed(&session, &built, seed, CHECKED_TOKENS));
    }
    assert!(
        failures.is_empty(),
        "{} failing cases (seed {seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A self-routed call of no tokens launches no router blocks; the route kernel runs in its
/// place, so an error of the call before is cleared, not reported again. The calls after
/// it route as the reference (the router's arrival counters were left at zero).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_self_routed_call_of_no_tokens_clears_an_earlier_error() {
    let seed = fresh_seed();
    log(&format!(
        "router at T = 0: seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let layer = rule_layers().remove(0);
    let session = Session::open().expect("GPU session");
    let plan = plan::plan(&layer, &target()).expect("plans");
    let built = session.build(plan, seed).expect("build");
    let shape = built.layer.plan().shape.clone();
    let mut bad = Workload::random(&shape, 9, Routing::Uniform, seed);
    bad.topk_ids[3] = shape.experts as i32;
    assert!(
        session
            .run_checked(&built, &bad, CHECKED_TOKENS, 1)
            .is_err(),
        "an out-of-range id is reported"
    );
    session
        .run_routed_collect(&built, 0, &[])
        .expect("a self-routed call of no tokens reports no stale error");
    let failures = check_routed(&session, &built, seed, CHECKED_TOKENS);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
