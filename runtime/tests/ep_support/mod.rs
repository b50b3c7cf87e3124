//! Helpers of the expert-parallel GPU tests (gpu_ep, gpu_ep_nodes, gpu_ep_routed): the layers
//! they split over ranks (virtual, one GPU each, or emulating nodes), their plans and builds
//! on this session's GPU, the token-count cases, and the checks of every rank's output (and
//! router, where the ranks route themselves) against the CPU reference.
// Shared by several test binaries, each of which uses part of it.
#![allow(dead_code)]

use std::io::Write;
use std::sync::Arc;

use moeforge_compiler::ir::{Activation, Layer};
use moeforge_compiler::plan::{self, Plan};
use moeforge_runtime::ep::EpLayer;
use moeforge_runtime::harness::{BuiltLayer, CHECKED_TOKENS, CheckReport, Session};
use moeforge_runtime::workload::{self, Routing, Workload};

use crate::layers;

/// One line per case, straight to stderr so the GPU log shows it without --nocapture.
pub fn say(line: String) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// Says each rank's report of `case` and asserts that every rank passed.
pub fn assert_every_rank_passed(case: &str, reports: &[CheckReport]) {
    for (r, report) in reports.iter().enumerate() {
        say(format!("{case}, rank {r}: {report}"));
        assert!(report.passed(), "{case}, rank {r}: {report}");
    }
}

pub fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

/// `layer` split over `ranks` expert-parallel ranks, virtual (one GPU) or one GPU each.
pub fn over_ranks(layer: &Layer, ranks: u32, virtual_ranks: bool) -> Layer {
    let mut layer = layer.clone();
    layer.name = format!(
        "{}_ep{ranks}{}",
        layer.name,
        if virtual_ranks { "v" } else { "" }
    );
    layer.parallel.expert = ranks;
    layer.topology.gpus_per_node = if virtual_ranks { 1 } else { ranks };
    layer.topology.nodes = 1;
    layer.topology.virtual_ranks = virtual_ranks.then_some(ranks);
    layer
}

/// `layer` over `ranks` virtual ranks emulating `nodes` nodes of `ranks / nodes` GPUs: the
/// kernels of real nodes, their network steps run by the loopback as device copies.
pub fn over_emulated_nodes(layer: &Layer, ranks: u32, nodes: u32) -> Layer {
    let mut layer = over_ranks(layer, ranks, true);
    layer.name = format!("{}_n{nodes}", layer.name);
    layer.topology.nodes = nodes;
    layer.topology.gpus_per_node = ranks / nodes;
    layer
}

/// `layer` with every call across nodes moving the routed rows (`whole_chunks = 0`): the
/// tiny layers' whole chunks cost less than the host's read-back at every bound.
pub fn routed_rows_only(layer: &Layer) -> Layer {
    let mut layer = layer.clone();
    layer.name = format!("{}_routed", layer.name);
    layer.schedule.whole_chunks = Some(0);
    layer
}

/// The tiny layer with a shared expert and top-4 routing: over 2 ranks a visited rank
/// holds about 2 of a token's pairs, so its results return as rank partials, shared
/// slices included (the tiny layers' top-2 return as pair rows).
pub fn tiny_shared_top4() -> Layer {
    let mut layer = layers::tiny_with_shared_expert(Activation::Swiglu);
    layer.name = "tiny_shared_top4".into();
    layer.top_k = 4;
    layer
}

/// [`tiny_shared_top4`] with GPT-OSS's expert math (expert biases, the clamped SwiGLU): its
/// rank partials carry each pair's `b2` times its weight.
pub fn tiny_biased_top4() -> Layer {
    let mut layer = tiny_shared_top4();
    layer.name = "tiny_biased_top4".into();
    layer.activation = Activation::ClampedSwiglu;
    layer.expert_bias = true;
    layer
}

pub fn plan_for(session: &Session, layer: &Layer) -> Plan {
    let target = session.gpu.target().expect("the device's target");
    let plan = plan::plan(layer, &target).unwrap_or_else(|e| panic!("{}: {e}", layer.name));
    assert!(
        plan.expert_parallel.is_some(),
        "{} plans expert parallelism",
        layer.name
    );
    plan
}

/// `layer` built with weights of `seed`, and its expert-parallel ranks all on this session's
/// GPU (virtual ranks, or emulated nodes).
pub fn on_this_gpu(session: &Session, layer: &Layer, seed: u64) -> (BuiltLayer, EpLayer) {
    let built = session
        .build(plan_for(session, layer), seed)
        .expect("build");
    let contexts = vec![Arc::clone(&session.gpu.ctx); layer.parallel.expert as usize];
    let ep = session
        .build_expert_parallel(&built, &contexts)
        .expect("expert-parallel layer");
    (built, ep)
}

/// Token counts per rank for one case: the same kind of count on every rank, varied a
/// little per rank so that ranks send unequal amounts.
pub fn token_counts(max: u32, ranks: usize) -> Vec<Vec<u32>> {
    vec![
        vec![0; ranks],
        (0..ranks as u32).map(|r| (r % 2).min(max)).collect(),
        (0..ranks as u32).map(|r| (77 + 13 * r).min(max)).collect(),
        vec![max; ranks],
    ]
}

/// Every token-count case and both routings on `layer`: each rank's output against the
/// reference.
pub fn check_expert_parallel(
    session: &Session,
    built: &BuiltLayer,
    ep: &mut EpLayer,
    label: &str,
    seed: u64,
) {
    let shape = built.layer.plan().shape.clone();
    if let Some(plan) = &built.layer.plan().expert_parallel {
        say(format!(
            "{label}: results return as {:?}",
            plan.combine_route
        ));
    }
    let ranks = ep.ranks();
    for counts in token_counts(shape.max_tokens, ranks) {
        for routing in [Routing::Uniform, Routing::Skewed] {
            let workloads: Vec<Workload> = counts
                .iter()
                .enumerate()
                .map(|(r, &t)| {
                    Workload::random(&shape, t, routing, seed ^ (u64::from(t) << 8) ^ r as u64)
                })
                .collect();
            let reports = session
                .run_checked_expert_parallel(built, ep, &workloads, CHECKED_TOKENS, seed)
                .unwrap_or_else(|e| {
                    panic!(
                        "{label} T={counts:?} {routing:?}: {e}; every rank's error word: {:?}",
                        ep.error_words()
                    )
                });
            for (r, report) in reports.iter().enumerate() {
                say(format!(
                    "{label} rank {r} T={} {routing:?}: {report}",
                    counts[r]
                ));
                assert!(
                    report.passed(),
                    "{label} rank {r} T={} {routing:?}: {report}",
                    counts[r]
                );
            }
        }
    }
}

/// Each `(layer, ranks)` of `cases` over that many virtual ranks, built (compiled together,
/// so that NVRTC compiles the layers on parallel threads) with its expert-parallel layer.
pub fn build_on_virtual_ranks(
    session: &Session,
    cases: &[(Layer, u32)],
    seed: u64,
) -> Vec<(Layer, BuiltLayer, EpLayer)> {
    let on_virtual_ranks: Vec<Layer> = cases
        .iter()
        .map(|(layer, ranks)| over_ranks(layer, *ranks, true))
        .collect();
    let plans: Vec<Plan> = on_virtual_ranks
        .iter()
        .map(|l| plan_for(session, l))
        .collect();
    let built = session.build_many(plans, seed).expect("build");
    on_virtual_ranks
        .into_iter()
        .zip(built)
        .map(|(layer, built)| {
            let contexts = vec![Arc::clone(&session.gpu.ctx); layer.parallel.expert as usize];
            let ep = session
                .build_expert_parallel(&built, &contexts)
                .expect("expert-parallel layer");
            (layer, built, ep)
        })
        .collect()
}

/// The most tokens per rank a call of `plan` runs fused (its first rank regime's fused
/// decode), if any.
pub fn fused_max_tokens(plan: &Plan) -> Option<u32> {
    plan.expert_parallel
        .as_ref()?
        .regimes
        .first()?
        .fused_decode
        .as_ref()
        .map(|fused| fused.max_tokens)
}

/// Tokens per rank and call that the self-routed test checks (a sample beyond): the
/// reference of four ranks' full calls of the scaled DeepSeek-V3 would take most of the
/// suite's time.
pub const SELF_ROUTED_CHECKED_TOKENS: usize = 256;

/// Every token-count case of `built` on `ep`, routed by its ranks' routers, as one call;
/// then, at the largest count of every regime (each runs its own router launches), calls
/// back to back as a serving loop makes them, the last one checked (a router of the next
/// call must not overwrite the choices a call still reads). Each rank's router against the
/// CPU router, its output against the reference on its router's choices.
pub fn check_self_routed(
    session: &Session,
    built: &BuiltLayer,
    ep: &mut EpLayer,
    label: &str,
    seed: u64,
) {
    let shape = built.layer.plan().shape.clone();
    let ranks = ep.ranks();
    // Back to back also at the most tokens the rank's fused decode covers.
    let fused = fused_max_tokens(built.layer.plan());
    let cases: Vec<(Vec<u32>, usize)> = token_counts(shape.max_tokens, ranks)
        .into_iter()
        .map(|counts| (counts, 1))
        .chain(
            built
                .layer
                .plan()
                .regimes
                .iter()
                .map(|regime| regime.max_tokens.min(shape.max_tokens))
                .chain(fused)
                .map(|t| (vec![t; ranks], PIPELINED_SELF_ROUTED_CALLS)),
        )
        .collect();
    for (counts, calls) in cases {
        let xs: Vec<Vec<u16>> = counts
            .iter()
            .enumerate()
            .map(|(r, &t)| {
                let case = seed ^ (u64::from(t) << 8) ^ r as u64;
                Workload::random(&shape, t, Routing::Uniform, case).x
            })
            .collect();
        let reports = session
            .run_checked_routed_expert_parallel(
                built,
                ep,
                &counts,
                &xs,
                calls,
                SELF_ROUTED_CHECKED_TOKENS,
                seed,
            )
            .unwrap_or_else(|e| {
                panic!(
                    "{label} T={counts:?}, {calls} calls: {e}; every rank's error word: {:?}",
                    ep.error_words()
                )
            });
        for (r, report) in reports.iter().enumerate() {
            let case = format!(
                "{label} rank {r} T={} self-routed, the last of {calls} calls",
                counts[r]
            );
            say(format!("{case}: {report}"));
            let router_checked = report
                .router
                .as_ref()
                .is_some_and(|router| router.tokens == report.checked_tokens);
            assert!(report.passed() && router_checked, "{case}: {report}");
        }
    }
}

/// Self-routed calls `check_self_routed` makes back to back per regime.
pub const PIPELINED_SELF_ROUTED_CALLS: usize = 20;

/// Rank 1 of `ep` silent for one call (fault injection: it sends nothing): its peers' waits
/// time out within the wait bound, the call's error names a rank and a flag, and the next
/// call, with every rank sending, is right again. `label` names the case in the log.
pub fn check_silent_rank_times_out(
    session: &Session,
    built: &BuiltLayer,
    ep: &mut EpLayer,
    label: &str,
    seed: u64,
) {
    let shape = built.layer.plan().shape.clone();
    let workloads: Vec<Workload> = (0..ep.ranks() as u32)
        .map(|r| Workload::random(&shape, 40 + r, Routing::Uniform, seed + u64::from(r)))
        .collect();
    ep.withhold_sends_once(1);
    let started = std::time::Instant::now();
    let error = session
        .run_checked_expert_parallel(built, ep, &workloads, 0, seed)
        .expect_err("a call with a silent rank fails");
    let waited = started.elapsed().as_secs_f64();
    say(format!(
        "{label}silent rank 1: after {waited:.2} s: {error}"
    ));
    let message = error.to_string();
    assert!(
        message.contains("waited too long") && message.contains("rank"),
        "{message}"
    );
    assert!(waited < 30.0, "the time-out took {waited:.1} s");
    let reports = session
        .run_checked_expert_parallel(built, ep, &workloads, CHECKED_TOKENS, seed)
        .expect("the call after the time-out");
    assert_every_rank_passed(&format!("{label}after the time-out"), &reports);
}
