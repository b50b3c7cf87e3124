//! The layer on the GPU against the CPU reference, every output element of every token
//! (GPU tests are ignored by default: on the GPU machine run
//! `cargo test --workspace -- --include-ignored`).
//!
//! The default suite runs, each on token counts taken from its plan (every regime's first
//! and last count and a ragged count inside it, plus 0, 1 and 7) under uniform and skewed
//! routing, and once per regime with empty experts (the first, a middle and the last):
//! - a tiny layer of every activation;
//! - a GPT-OSS-style layer (clamped SwiGLU, expert biases) whose W1 is scaled up so that
//!   pre-activations cross the clamps on both sides;
//! - a non-gated activation pinned on wgmma and one pinned on mma.sync (schedule hints;
//!   the test asserts the engine the plan chose);
//! - a gated layer with a shared expert whose GEMM1 loads x's rows sorted by expert as TMA
//!   tiles (the sort kernel first);
//! - every example scaled down to hidden ≤ 1024, FFN ≤ 512 and max_tokens ≤ 4096 (same
//!   experts, top-K and activation), whose plans run both engines over three regimes.
//!
//! The full-size examples run with `MOEFORGE_GPU_SWEEP=1` (minutes; tokens above 4096 are
//! sampled). Each case prints one line straight to stderr, past the harness's capture;
//! every test draws fresh random data from a seed it prints, which MOEFORGE_SEED replays.

use std::io::Write;
use std::sync::OnceLock;

use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::sys::CUstreamCaptureMode;
use moeforge_compiler::ir::{Activation, CLAMPED_SWIGLU_LIMIT, Layer, SharedExperts, TileShape};
use moeforge_compiler::plan::{self, GemmPlan, MmaEngine, Plan, Regime, RowLoad, Target};
use moeforge_runtime::bf16;
use moeforge_runtime::checkpoint::HostWeights;
use moeforge_runtime::gpu::Gpu;
use moeforge_runtime::harness::{BuiltLayer, CHECKED_TOKENS, HarnessError, Session};
use moeforge_runtime::layer::{LayerError, RoutedForwardArgs};
use moeforge_runtime::toolkit;
use moeforge_runtime::weights;
use moeforge_runtime::workload::{self, Routing, Workload};

mod layers;

const ACTIVATIONS: [Activation; 6] = [
    Activation::Swiglu,
    Activation::ClampedSwiglu,
    Activation::Geglu,
    Activation::Gelu,
    Activation::Relu,
    Activation::Silu,
];

/// A small odd token count besides each regime's own counts.
const ODD_TOKENS: u32 = 7;

/// Writes one line to the process's stderr directly: the test harness captures only the
/// `print!` family, so the GPU log shows every case and every skip, passing or not.
fn log(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// MOEFORGE_SEED replays a failure; otherwise a fresh seed.
fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

/// Plans for the GPU present, as the CLI does: its target read from the device, or the
/// H200 (the documented default) where there is none, for the CPU tests of this file.
fn plan_for_device(layer: &Layer) -> Plan {
    static TARGET: OnceLock<Target> = OnceLock::new();
    let target = TARGET.get_or_init(|| {
        let device = toolkit::driver_available()
            .ok()
            .and_then(|_| Gpu::open(0).ok())
            .map(|gpu| gpu.target().expect("the device's target"));
        device.unwrap_or_else(Target::h200)
    });
    plan::plan(layer, target).unwrap_or_else(|e| panic!("{} does not plan: {e}", layer.name))
}

/// An odd count strictly inside the regime, near its middle: no multiple of any tile's
/// rows (those are multiples of 16), so the last tile of an expert that takes every token
/// is ragged. `None` when the regime has no count inside.
fn ragged_tokens(regime: &Regime) -> Option<u32> {
    let middle = (regime.min_tokens + (regime.max_tokens - regime.min_tokens) / 2) | 1;
    let inside = regime.min_tokens < middle && middle < regime.max_tokens;
    inside.then(|| {
        assert!(
            !middle.is_multiple_of(regime.gemm1.tile.m)
                && !middle.is_multiple_of(regime.gemm2.tile.m),
            "{middle} tokens fill whole tiles"
        );
        middle
    })
}

/// The (tokens, routing) cases of a plan, in increasing token order.
fn cases(plan: &Plan) -> Vec<(u32, Routing)> {
    let max = plan.shape.max_tokens;
    let mut counts: Vec<u32> = [0, 1, ODD_TOKENS]
        .into_iter()
        .filter(|&t| t <= max)
        .collect();
    let mut ragged = Vec::new();
    for regime in &plan.regimes {
        counts.extend([regime.min_tokens, regime.max_tokens]);
        // The last call the fused decode takes, and the first the table takes after it.
        if let Some(fused) = &regime.fused_decode {
            counts.extend([fused.max_tokens, fused.max_tokens + 1]);
        }
        // The last call the GEMMs' blocks route, and the first the route launch routes.
        if let Some(routing) = regime.block_routing(plan.shape.top_k) {
            let last = routing.max_tokens(plan.shape.top_k);
            counts.extend(
                [last, last + 1]
                    .into_iter()
                    .filter(|&t| t <= regime.max_tokens),
            );
        }
        ragged.extend(ragged_tokens(regime));
    }
    counts.extend(&ragged);
    counts.sort_unstable();
    counts.dedup();
    let mut cases = Vec::new();
    for t in counts {
        cases.extend([(t, Routing::Uniform), (t, Routing::Skewed)]);
        if ragged.contains(&t) && Routing::EmptyExperts.fits(&plan.shape) {
            cases.push((t, Routing::EmptyExperts));
        }
    }
    cases
}

fn gemm_name(gemm: &GemmPlan) -> String {
    format!("{} {}x{}", gemm.engine.name(), gemm.tile.m, gemm.tile.n)
}

/// Runs every case of one built layer; returns a line per failing case.
fn check_layer(session: &Session, built: &BuiltLayer, seed: u64) -> Vec<String> {
    check_cases(session, built, seed, cases(built.layer.plan()))
}

/// Runs `cases` of one built layer, then one call too many tokens; returns a line per
/// failing case.
fn check_cases(
    session: &Session,
    built: &BuiltLayer,
    seed: u64,
    cases: Vec<(u32, Routing)>,
) -> Vec<String> {
    let plan = built.layer.plan();
    let shape = &plan.shape;
    let mut failures = Vec::new();
    for (tokens, routing) in cases {
        let case_seed = seed ^ (u64::from(tokens) << 20) ^ routing as u64;
        let workload = Workload::random(shape, tokens, routing, case_seed);
        let regime = plan
            .regime_for(tokens)
            .expect("the regimes cover 0..=max_tokens");
        let label = format!(
            "{} T={tokens} {routing:?} [{}: gemm1 {}, gemm2 {}]",
            plan.layer,
            regime.name,
            gemm_name(&regime.gemm1),
            gemm_name(&regime.gemm2)
        );
        match session.run_checked(built, &workload, CHECKED_TOKENS, case_seed) {
            Ok(report) => {
                let worst = report.comparison.worst.map_or("-".to_string(), |w| {
                    format!("{:.2e} ({:.2} of bound)", w.error(), w.ratio())
                });
                let every_element = report.comparison.elements
                    == report.checked_tokens as u64 * u64::from(shape.hidden);
                let passed = report.passed() && every_element;
                log(&format!(
                    "{label}: worst {worst}, {} elements, {} out of bound, {} unwritten{}, reference {:.2} s: {}",
                    report.comparison.elements,
                    report.comparison.out_of_bound,
                    report.unwritten,
                    if report.sampled() { ", SAMPLED" } else { "" },
                    report.reference_seconds,
                    if passed { "ok" } else { "FAIL" }
                ));
                if !passed {
                    let partial = if every_element {
                        ""
                    } else {
                        " (not every element of the checked tokens was compared)"
                    };
                    failures.push(format!("{label}: {report}{partial}"));
                }
            }
            Err(error) => {
                log(&format!("{label}: FAIL: {error}"));
                failures.push(format!("{label}: {error}"));
            }
        }
    }
    // One token more than the layer takes is refused before anything runs.
    let over = shape.max_tokens + 1;
    let workload = Workload::random(shape, over, Routing::Uniform, seed);
    match session.run_checked(built, &workload, CHECKED_TOKENS, seed) {
        Err(HarnessError::Layer(LayerError::TooManyTokens { .. })) => {}
        other => failures.push(format!(
            "{} T={over}: expected a max_tokens error, got {other:?}",
            plan.layer
        )),
    }
    failures
}

/// Builds every plan (compiles on parallel threads), runs every case of each, and fails
/// with the list of failing cases.
fn check_plans(suite: &str, plans: Vec<Plan>) {
    let seed = fresh_seed();
    log(&format!(
        "{suite}: {} layers, seed {seed} (replay with MOEFORGE_SEED={seed})",
        plans.len()
    ));
    let session = Session::open().expect("GPU session");
    let built = session.build_many(plans, seed).expect("build");
    let mut failures = Vec::new();
    // Each layer (with its host copies of the weights) is dropped once checked.
    for layer in built {
        log(&format!(
            "{}: compiled in {:.1} s ({:?})",
            layer.layer.plan().layer,
            layer.compile_seconds,
            layer.module.cache()
        ));
        // A layer on one GPU compiles only the kernels it launches.
        let mut compiled: Vec<&String> = layer
            .module
            .modules
            .iter()
            .flat_map(|m| &m.kernels)
            .collect();
        compiled.sort();
        let single = layer.layer.plan().single_gpu_entry_points();
        let mut launched: Vec<&String> = single.iter().collect();
        launched.sort();
        if compiled != launched {
            failures.push(format!(
                "{}: compiled {compiled:?}, launches {launched:?}",
                layer.layer.plan().layer
            ));
        }
        failures.extend(check_layer(&session, &layer, seed));
    }
    assert!(
        failures.is_empty(),
        "{suite}: {} failing cases (seed {seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The plans of `layers`, one per distinct set of kernels, and a note for each left out:
/// a layer that differs from an earlier one only in names and spec ranks (all experts run
/// on one GPU either way) would run the same code again.
fn distinct_plans(layers: impl IntoIterator<Item = Layer>) -> (Vec<Plan>, Vec<String>) {
    let mut plans: Vec<Plan> = Vec::new();
    let mut notes = Vec::new();
    for layer in layers {
        let plan = plan_for_device(&layer);
        match plans
            .iter()
            .find(|p| layers::same_single_gpu_kernels(p, &plan))
        {
            Some(same) => notes.push(format!(
                "{}: same kernels as {} (names and spec ranks aside); not run twice",
                plan.layer, same.layer
            )),
            None => plans.push(plan),
        }
    }
    (plans, notes)
}

fn scaled_example_plans() -> (Vec<Plan>, Vec<String>) {
    distinct_plans(layers::examples().iter().map(layers::scaled_down))
}

/// The pinned layers and the engine each must run on.
fn pinned_plans() -> Vec<(Plan, MmaEngine)> {
    let wgmma = layers::pinned(
        Activation::Gelu,
        TileShape {
            m: 64,
            n: 128,
            k: 64,
        },
        4,
    );
    // 128-row tiles in cluster pairs; GEMM2's single n-tile (hidden 128) gives every
    // expert with an odd count of m-tiles a unit whose second block has no rows.
    let wgmma_pairs = layers::pinned(
        Activation::Gelu,
        TileShape {
            m: 128,
            n: 128,
            k: 64,
        },
        4,
    );
    let mma_sync = layers::pinned(
        Activation::Silu,
        TileShape {
            m: 32,
            n: 64,
            k: 64,
        },
        3,
    );
    [
        (wgmma, MmaEngine::WgmmaWarpSpecialized),
        (wgmma_pairs, MmaEngine::WgmmaWarpSpecialized),
        (mma_sync, MmaEngine::MmaSync),
    ]
    .into_iter()
    .map(|(layer, engine)| (plan_for_device(&layer), engine))
    .collect()
}

/// The layer whose GEMM1 loads x's rows sorted by expert as tiles (`layers::sorted_rows`).
fn sorted_rows_plan() -> Plan {
    plan_for_device(&layers::sorted_rows())
}

fn engines(plans: &[Plan]) -> Vec<MmaEngine> {
    plans
        .iter()
        .flat_map(|p| &p.regimes)
        .flat_map(|r| [r.gemm1.engine, r.gemm2.engine])
        .collect()
}

/// The layers the fused decode's GPU tests run with `fused_decode = 16 tokens`: four
/// scaled examples (a shared expert; expert biases and the clamped SwiGLU; a gated shared
/// expert, whose shared-slice tiles compute the gate) and the tiny layer on mma.sync tiles
/// (its GEMM2 would otherwise run on wgmma, where there is no fused decode).
fn fused_decode_layers() -> Vec<Layer> {
    let examples = layers::examples();
    let mut chosen: Vec<Layer> = [
        "qwen3_30b_a3b",
        "deepseek_v3",
        "gpt_oss_120b",
        "qwen1_5_moe_a2_7b",
    ]
    .into_iter()
    .map(|name| {
        let layer = examples
            .iter()
            .find(|l| l.name == name)
            .expect("the example");
        layers::scaled_down(layer)
    })
    .collect();
    let mut tiny = layers::tiny(Activation::Swiglu);
    tiny.name = "tiny_swiglu_fused".into();
    let tile = TileShape {
        m: 16,
        n: 64,
        k: 64,
    };
    tiny.schedule.gemm1_tile = Some(tile);
    tiny.schedule.gemm2_tile = Some(tile);
    chosen.push(tiny);
    for layer in &mut chosen {
        layer.schedule.fused_decode = Some(16);
    }
    chosen
}

/// What the default suite means to cover, checked on the plans (no GPU needed): a planner
/// change that quietly moved these layers off an engine or out of their regimes would
/// otherwise leave the GPU tests passing while testing less.
#[test]
fn default_suite_plans_cover_what_the_suite_claims() {
    let deep = deep_k_plans();
    assert!(
        deep.iter().any(
            |p| p.shape.hidden % plan::DEEP_TILE_K != 0 && p.shape.ffn % plan::DEEP_TILE_K != 0
        ),
        "a deep-k layer whose last stages are half full"
    );
    for plan in deep {
        for regime in &plan.regimes {
            for gemm in [&regime.gemm1, &regime.gemm2] {
                assert_eq!(
                    (gemm.engine, gemm.tile.k),
                    (MmaEngine::MmaSync, plan::DEEP_TILE_K),
                    "{}",
                    plan.layer
                );
            }
        }
    }
    for (plan, engine) in pinned_plans() {
        assert!(
            !plan.shape.activation.is_gated(),
            "{}: pinned layers test non-gated activations",
            plan.layer
        );
        for regime in &plan.regimes {
            assert_eq!(regime.gemm1.engine, engine, "{} gemm1", plan.layer);
            assert_eq!(regime.gemm2.engine, engine, "{} gemm2", plan.layer);
        }
    }
    for layer in fused_decode_layers() {
        let plan = plan_for_device(&layer);
        let covered = plan.regimes[0].fused_decode.as_ref().map(|f| f.max_tokens);
        assert!(
            covered.is_some_and(|tokens| tokens >= 9),
            "{}: a fused decode of at least 9 tokens, got {covered:?}: {:?}",
            layer.name,
            plan.hints_not_honoured
        );
    }
    let (scaled, _) = scaled_example_plans();
    assert!(
        scaled.len() >= 5,
        "the examples give distinct scaled layers"
    );
    // Calls routed in the GEMMs' blocks, and by the route launch after them in one regime.
    assert!(
        scaled.iter().any(|p| p.regimes.iter().any(|r| r
            .block_routing(p.shape.top_k)
            .is_some_and(|routing| routing.max_tokens(p.shape.top_k) < r.max_tokens))),
        "a regime whose small calls route in the GEMMs' blocks and larger ones by the route launch"
    );
    let used = engines(&scaled);
    assert!(used.contains(&MmaEngine::WgmmaWarpSpecialized) && used.contains(&MmaEngine::MmaSync));
    assert!(scaled.iter().any(|p| p.regimes.len() >= 3));
    // Cluster pairs on both GEMMs (GEMM1's gate and up boxes, GEMM2's two halves), and over
    // an odd count of n-tiles (a unit whose second block has no rows).
    let pinned: Vec<Plan> = pinned_plans().into_iter().map(|(plan, _)| plan).collect();
    let pairs: Vec<(&GemmPlan, u32)> = scaled
        .iter()
        .chain(&pinned)
        .flat_map(|p| p.regimes.iter().map(move |r| (p, r)))
        .flat_map(|(p, r)| [(&r.gemm1, p.shape.ffn), (&r.gemm2, p.shape.hidden)])
        .filter(|(g, _)| g.cluster > 1)
        .collect();
    assert!(
        pairs.iter().any(|(g, _)| g.b_rows > g.tile.n),
        "a gated GEMM1 in cluster pairs"
    );
    assert!(
        pairs.iter().any(|(g, _)| g.b_rows == g.tile.n),
        "a GEMM2 in cluster pairs"
    );
    assert!(
        pairs.iter().any(|(g, n)| (n / g.tile.n) % 2 == 1),
        "cluster pairs over an odd count of n-tiles"
    );
    let sorted = sorted_rows_plan();
    assert!(
        sorted.shape.shared_slices > 0
            && sorted
                .regimes
                .iter()
                .all(|r| r.gemm1.a_load == RowLoad::Tiles),
        "{}: every regime sorts x's rows, shared slices among them",
        sorted.layer
    );
    for plan in &scaled {
        assert!(plan.shape.max_tokens <= CHECKED_TOKENS as u32);
        assert!(
            plan.regimes.iter().filter_map(ragged_tokens).count() >= plan.regimes.len().min(2),
            "{}: ragged counts in its regimes",
            plan.layer
        );
        assert!(
            cases(plan).iter().any(|&(_, r)| r == Routing::EmptyExperts),
            "{}: a case with empty experts",
            plan.layer
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_layers_match_reference_for_every_activation() {
    let plans = ACTIVATIONS
        .map(|a| plan_for_device(&layers::tiny(a)))
        .to_vec();
    check_plans("tiny layers", plans);
}

/// Shared experts run as always-hit experts in the same grouped GEMMs: the reference adds
/// their MLP to every token, so leaving them out (or weighting them) fails the check. A
/// gated shared expert's slices weigh sigmoid(x · w_gate) per token (computed by GEMM1's
/// warps before its tiles, read by GEMM2's epilogue), on both GEMM engines; weight 1 there
/// would fail the check too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_layers_with_a_shared_expert_match_reference() {
    let mut gated_wgmma = layers::tiny_with_gated_shared_expert(Activation::Swiglu);
    gated_wgmma.name = "tiny_gated_shared_wgmma".into();
    gated_wgmma.max_tokens = 4096;
    let plans: Vec<Plan> = [Activation::Swiglu, Activation::Gelu]
        .map(|a| plan_for_device(&layers::tiny_with_shared_expert(a)))
        .into_iter()
        .chain([
            plan_for_device(&layers::tiny_with_gated_shared_expert(Activation::Swiglu)),
            plan_for_device(&gated_wgmma),
        ])
        .collect();
    assert!(plans.iter().all(|p| p.shape.shared_slices == 2));
    assert_eq!(plans.iter().filter(|p| p.shape.shared_gated).count(), 2);
    assert!(
        plans.iter().any(|p| p.shape.shared_gated
            && p.regimes
                .iter()
                .any(|r| r.gemm2.engine == MmaEngine::WgmmaWarpSpecialized)),
        "a gated layer's GEMM2 runs on the warp-specialised engine"
    );
    check_plans("tiny layers with a shared expert", plans);
}

/// A token's row over two combine blocks, the second of 64 columns (hidden 1088 = 1024 +
/// 64): the scaled examples stay at hidden 1024 or less, one block per token.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_row_over_several_combine_blocks_matches_reference() {
    let mut layer = layers::tiny(Activation::Swiglu);
    layer.name = "tiny_wide_rows".into();
    layer.hidden = 1088;
    let plan = plan_for_device(&layer);
    let combine = plan.regimes[0]
        .launches
        .iter()
        .find(|l| l.kernel == plan.combine_kernel)
        .expect("the regime combines");
    assert_eq!(
        combine.grid,
        plan::Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile: 2
        }
    );
    check_plans("a row over two combine blocks", vec![plan]);
}

/// The clamps of GPT-OSS's activation, in the order [`clamp_witnesses`] reports them.
const CLAMPS: [&str; 3] = ["gate > 7", "up > 7", "up < -7"];

/// For each clamp (gate above, up above, up below), the first (token, column) of
/// `workload` on `host`'s experts whose pre-activation (bias added) crosses it, or `None`
/// where none does. The scan stops once every clamp has one: the test needs a crossing of
/// each, and counting every crossing (each W1 row of each pair, on one thread) took 73 s
/// over the test's 25 cases on the CPU build machine, most of the test's time.
fn clamp_witnesses(
    shape: &plan::LayerShape,
    host: &HostWeights,
    workload: &Workload,
) -> [Option<(usize, usize)>; 3] {
    let (hidden, ffn, k) = (
        shape.hidden as usize,
        shape.ffn as usize,
        shape.top_k as usize,
    );
    let limit = CLAMPED_SWIGLU_LIMIT;
    let mut witnesses = [None; 3];
    for (pair, &e) in workload.topk_ids.iter().enumerate() {
        if witnesses.iter().all(Option::is_some) {
            break;
        }
        let expert = host.expert(shape, e as usize);
        let biases = expert.biases.expect("the layer has biases");
        let t = pair / k;
        let x: Vec<f32> = workload.x[t * hidden..(t + 1) * hidden]
            .iter()
            .map(|&v| bf16::to_f32(v))
            .collect();
        let dot = |row: usize| -> f32 {
            let w = &expert.w1[row * hidden..(row + 1) * hidden];
            w.iter()
                .zip(&x)
                .map(|(&w, &x)| bf16::to_f32(w) * x)
                .sum::<f32>()
                + biases.b1[row]
        };
        for f in 0..ffn {
            let (gate, up) = (dot(f), dot(ffn + f));
            for (witness, crossed) in
                witnesses
                    .iter_mut()
                    .zip([gate > limit, up > limit, up < -limit])
            {
                if crossed && witness.is_none() {
                    *witness = Some((t, f));
                }
            }
        }
    }
    witnesses
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt_oss_style_layer_with_clamps_and_biases_matches_reference() {
    let seed = fresh_seed();
    log(&format!("gpt-oss-style layer: seed {seed}"));
    let gpt_oss = layers::examples()
        .into_iter()
        .find(|l| l.name == "gpt_oss_120b")
        .expect("the gpt_oss_120b example");
    assert_eq!(gpt_oss.activation, Activation::ClampedSwiglu);
    assert!(gpt_oss.expert_bias);
    let layer = layers::scaled_down(&gpt_oss);
    let plan = plan_for_device(&layer);
    let shape = plan.shape.clone();
    // W1 16 times its fan-in scale: gate and up pre-activations of about ±9 (one standard
    // deviation), so that many cross the clamps at ±7, on both sides for up.
    let mut host = weights::random(&shape, 0..shape.experts, seed);
    for w in &mut host.w1 {
        *w = bf16::from_f32(16.0 * bf16::to_f32(*w));
    }
    let session = Session::open().expect("a GPU session");
    let device_weights = weights::upload(&session.gpu.stream, &host).expect("uploading weights");
    let built = session
        .build_with_weights(plan.clone(), device_weights)
        .expect("building the layer");
    let mut failures = Vec::new();
    for (tokens, routing) in cases(&plan) {
        let case_seed = seed ^ (u64::from(tokens) << 20) ^ routing as u64;
        let workload = Workload::random(&shape, tokens, routing, case_seed);
        let witnesses = clamp_witnesses(&shape, &host, &workload);
        if tokens > 0 {
            let missed: Vec<&str> = CLAMPS
                .iter()
                .zip(&witnesses)
                .filter(|(_, w)| w.is_none())
                .map(|(clamp, _)| *clamp)
                .collect();
            assert!(
                missed.is_empty(),
                "T={tokens}: the pre-activations must cross every clamp; none crosses {missed:?}"
            );
        }
        let report = session
            .run_checked(&built, &workload, CHECKED_TOKENS, case_seed)
            .expect("running the layer");
        log(&format!(
            "gpt-oss-style T={tokens} {routing:?} first (token, column) past {CLAMPS:?}: {witnesses:?}: {report}"
        ));
        if !report.passed() {
            failures.push(format!("T={tokens} {routing:?}: {report}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn non_gated_activations_pinned_on_each_engine_match_reference() {
    let pinned = pinned_plans();
    for (plan, engine) in &pinned {
        for regime in &plan.regimes {
            assert_eq!(
                (regime.gemm1.engine, regime.gemm2.engine),
                (*engine, *engine),
                "{} must run on {}",
                plan.layer,
                engine.name()
            );
        }
    }
    check_plans(
        "pinned engines",
        pinned.into_iter().map(|(plan, _)| plan).collect(),
    );
}

/// Layers pinned to mma.sync stages 128 deep (256-byte shared-memory rows): gated and not,
/// one m-tile of 16 and one of 32 rows, and a gated one whose reductions (H = 192 for GEMM1,
/// F = 320 for GEMM2) end half way through their last stage.
fn deep_k_plans() -> Vec<Plan> {
    [
        (Activation::Swiglu, 16, 64, None),
        (Activation::Silu, 32, 64, None),
        (Activation::Swiglu, 16, 64, Some((192, 320))),
    ]
    .into_iter()
    .map(|(activation, m, n, ragged)| {
        let mut layer = layers::pinned(
            activation,
            TileShape {
                m,
                n,
                k: plan::DEEP_TILE_K,
            },
            3,
        );
        if let Some((hidden, ffn)) = ragged {
            layer.name.push_str("_ragged_k");
            (layer.hidden, layer.ffn) = (hidden, ffn);
        }
        plan_for_device(&layer)
    })
    .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn deep_k_tiles_on_mma_sync_match_reference() {
    check_plans("deep k-tiles", deep_k_plans());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm1_on_rows_sorted_by_expert_matches_reference() {
    check_plans("sorted rows", vec![sorted_rows_plan()]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_example_scaled_down_matches_reference() {
    let (plans, notes) = scaled_example_plans();
    for note in &notes {
        log(note);
    }
    let used = engines(&plans);
    assert!(
        used.contains(&MmaEngine::WgmmaWarpSpecialized) && used.contains(&MmaEngine::MmaSync),
        "the scaled examples run both engines"
    );
    check_plans("scaled-down examples", plans);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_example_at_full_size_matches_reference_in_the_sweep() {
    if std::env::var("MOEFORGE_GPU_SWEEP").as_deref() != Ok("1") {
        log(
            "SKIPPED every_example_at_full_size_matches_reference_in_the_sweep: the full-size \
             examples take minutes; set MOEFORGE_GPU_SWEEP=1 to run them",
        );
        return;
    }
    let (plans, notes) = distinct_plans(layers::examples());
    for note in &notes {
        log(note);
    }
    check_plans("full-size examples", plans);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_range_expert_id_is_reported_with_its_token() {
    let session = Session::open().expect("GPU session");
    // The fused decode's routing in every block; on the tiny layer pinned to mma.sync tiles
    // (the fused layer without its fused decode), GEMM1's blocks routing a small call and
    // the route kernel a larger one; and the plain tiny layer as the device plans it (on
    // the H200 its GEMM2 runs on wgmma, so the route kernel routes it).
    let fused = fused_decode_layers().pop().expect("the tiny fused layer");
    let mut pinned = fused.clone();
    pinned.name = "tiny_swiglu_pinned".into();
    pinned.schedule.fused_decode = Some(0);
    let tiny = layers::tiny(Activation::Swiglu);
    for (layer, tokens, in_blocks) in [
        (fused, 9, Some(true)),
        (pinned.clone(), 9, Some(true)),
        (pinned, 65, Some(false)),
        (tiny, 9, None),
    ] {
        let plan = plan_for_device(&layer);
        let regime = plan.regime_for(tokens).expect("a regime");
        assert_eq!(
            regime
                .fused_decode
                .as_ref()
                .is_some_and(|f| f.covers(tokens)),
            layer.schedule.fused_decode.is_some_and(|n| n >= tokens),
            "{}: the hinted layer runs {tokens} tokens fused",
            layer.name
        );
        if let Some(in_blocks) = in_blocks {
            assert_eq!(
                regime.routes_in_blocks(tokens, plan.shape.top_k),
                in_blocks,
                "{} at {tokens} tokens: routed in the GEMMs' blocks",
                layer.name
            );
        }
        log(&format!(
            "{} at {tokens} tokens: routed in the GEMMs' blocks: {}",
            layer.name,
            regime.routes_in_blocks(tokens, plan.shape.top_k)
        ));
        let built = session.build(plan, 3).expect("build");
        let shape = built.layer.plan().shape.clone();
        let mut workload = Workload::random(&shape, tokens, Routing::Uniform, fresh_seed());
        workload.topk_ids[5 * 2 + 1] = shape.experts as i32 + 3;
        match session.run_checked(&built, &workload, CHECKED_TOKENS, 1) {
            Err(HarnessError::Layer(LayerError::ExpertIdOutOfRange {
                token,
                k,
                id,
                experts,
            })) => {
                assert_eq!(
                    (token, k, id, experts),
                    (5, 1, shape.experts as i32 + 3, shape.experts)
                );
            }
            other => panic!("expected an out-of-range error, got {other:?}"),
        }
        // The next call with valid ids succeeds: the error word does not stick.
        let valid = Workload::random(&shape, tokens, Routing::Uniform, fresh_seed());
        let report = session
            .run_checked(&built, &valid, CHECKED_TOKENS, 1)
            .expect("valid call after an error");
        assert!(report.passed(), "{report}");
        // A negative id is out of range too.
        workload.topk_ids[5 * 2 + 1] = -1;
        assert!(matches!(
            session.run_checked(&built, &workload, CHECKED_TOKENS, 1),
            Err(HarnessError::Layer(LayerError::ExpertIdOutOfRange {
                token: 5,
                k: 1,
                id: -1,
                ..
            }))
        ));
    }
}

/// A layer whose largest regime routes over several blocks (count, then place), with a
/// shared expert: every case against the reference, then an id out of range in that
/// regime, reported with its token, and a valid call after it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn routing_over_several_blocks_matches_reference_and_reports_bad_ids() {
    let mut layer = layers::tiny_with_shared_expert(Activation::Swiglu);
    layer.name = "tiny_shared_routed_over_blocks".into();
    layer.max_tokens = 9000;
    let plan = plan_for_device(&layer);
    let top = plan.regimes.last().expect("a regime");
    assert!(
        top.launches
            .iter()
            .any(|l| l.kernel == plan.route_count_kernel),
        "{} tokens route over several blocks",
        top.max_tokens
    );
    check_plans("routing over several blocks", vec![plan.clone()]);

    let session = Session::open().expect("GPU session");
    let built = session.build(plan, 3).expect("build");
    let shape = built.layer.plan().shape.clone();
    let tokens = shape.max_tokens - 3;
    let mut workload = Workload::random(&shape, tokens, Routing::Uniform, fresh_seed());
    let bad = (tokens - 500) as usize;
    workload.topk_ids[bad * 2 + 1] = -7;
    match session.run_checked(&built, &workload, CHECKED_TOKENS, 1) {
        Err(HarnessError::Layer(LayerError::ExpertIdOutOfRange { token, k, id, .. })) => {
            assert_eq!((token as usize, k, id), (bad, 1, -7));
        }
        other => panic!("expected an out-of-range error, got {other:?}"),
    }
    let valid = Workload::random(&shape, tokens, Routing::Skewed, fresh_seed());
    let report = session
        .run_checked(&built, &valid, CHECKED_TOKENS, 1)
        .expect("valid call after an error");
    assert!(report.passed(), "{report}");
}

/// One call of `built` on `workload`, eager and then captured into a CUDA graph and
/// replayed three times (each into a poisoned y): the eager output, then the replayed one.
fn eager_and_replayed(
    session: &Session,
    built: &BuiltLayer,
    workload: &Workload,
    self_routed: bool,
) -> (Vec<u16>, Vec<u16>) {
    let shape = built.layer.plan().shape.clone();
    let stream = &session.gpu.stream;
    let call = |io: &mut moeforge_runtime::harness::DeviceWorkload| {
        if self_routed {
            built.layer.forward_routed(RoutedForwardArgs {
                tokens: io.tokens,
                x: &io.x,
                y: &mut io.y,
            })
        } else {
            session.forward(&built.layer, io)
        }
    };
    let mut eager = session.upload(&shape, workload).expect("upload");
    call(&mut eager).expect("eager forward");
    built.layer.take_error().expect("no kernel error");
    let eager_y = stream.clone_dtoh(&eager.y).expect("download");

    let mut captured = session.upload(&shape, workload).expect("upload");
    stream.synchronize().expect("sync before capture");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    call(&mut captured).expect("forward under capture");
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("end capture")
        .expect("a graph with the forward's launches");
    for _ in 0..3 {
        session
            .fill_bits(&mut captured.y, bf16::NAN)
            .expect("poison");
        graph.launch().expect("replay");
    }
    built.layer.take_error().expect("no kernel error");
    (eager_y, stream.clone_dtoh(&captured.y).expect("download"))
}

/// `forward` and `forward_routed` enqueue work only: stream capture fails on any host
/// synchronisation, and a graph replayed three times must produce exactly what the eager
/// call produced. Cases: a scaled example caller-routed and routing itself (its router
/// then the table), a layer whose GEMM1 reads x's rows sorted by expert, and the fused
/// decode caller-routed and after the router.
#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_is_graph_capturable_and_replays_identically() {
    let layer = layers::examples()
        .into_iter()
        .find(|l| l.name == "qwen3_30b_a3b")
        .expect("the Qwen3-30B example");
    let mut fused = layers::scaled_down(&layer);
    fused.name = format!("{}_fused", fused.name);
    fused.schedule.fused_decode = Some(16);
    let session = Session::open().expect("GPU session");
    let seed = fresh_seed();
    log(&format!(
        "graph capture: seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let mut failures = Vec::new();
    let mut self_routed_cases = 0;
    for (plan, tokens, runs_fused) in [
        (plan_for_device(&layers::scaled_down(&layer)), 300, false),
        (sorted_rows_plan(), 300, false),
        (plan_for_device(&fused), 4, true),
    ] {
        let built = session.build(plan, seed).expect("build");
        let name = built.layer.plan().layer.clone();
        assert_eq!(
            built.layer.runs_fused(tokens),
            runs_fused,
            "{name} T={tokens}: the path this case is for (is MOEFORGE_FUSED_DECODE=0 set?)"
        );
        let shape = built.layer.plan().shape.clone();
        let workload = Workload::random(&shape, tokens, Routing::Uniform, seed);
        let mut modes = vec![false];
        if built.layer.routes_itself() {
            modes.push(true);
        }
        for self_routed in modes {
            self_routed_cases += usize::from(self_routed);
            let (eager, replayed) = eager_and_replayed(&session, &built, &workload, self_routed);
            if eager != replayed {
                failures.push(format!(
                    "{name} T={tokens}{}{}: graph replay differs from the eager call",
                    if self_routed { " self-routed" } else { "" },
                    if runs_fused { " (fused decode)" } else { "" },
                ));
            }
        }
    }
    assert_eq!(
        self_routed_cases, 2,
        "both scaled Qwen3 layers route themselves, so their self-routed calls ran"
    );
    assert!(
        failures.is_empty(),
        "graph capture (seed {seed}):\n{}",
        failures.join("\n")
    );
}

/// The layer's own graphs of repeated small calls (`Plan::call_graph_max_tokens`): a call
/// runs its launches the first time, is captured into a graph the second time and replays
/// it after, each time writing exactly what the first wrote (y poisoned before each call);
/// another buffer is another call, a call past the plan's bound or inside the caller's own
/// capture keeps no graph, and a self-routed call is a call of its own.
#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_small_calls_replay_a_graph_of_their_launches() {
    let layer = layers::examples()
        .into_iter()
        .find(|l| l.name == "qwen3_30b_a3b")
        .expect("the Qwen3-30B example");
    let plan = plan_for_device(&layers::scaled_down(&layer));
    let bound = plan.call_graph_max_tokens;
    assert!(
        bound >= 4 && bound < plan.shape.max_tokens,
        "the scaled Qwen3 plan graphs calls of 4 tokens but not of max_tokens (bound {bound})"
    );
    let session = Session::open().expect("GPU session");
    let seed = fresh_seed();
    log(&format!(
        "call graphs: seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let built = session.build(plan, seed).expect("build");
    let layer = &built.layer;
    let shape = layer.plan().shape.clone();
    let stream = &session.gpu.stream;
    // The host's time to enqueue the latest call, µs: logged for calls 1 (launches), 2
    // (capture and instantiation) and 3 (replay), not asserted.
    let enqueue_us = std::cell::Cell::new(0.0);
    let run = |io: &mut moeforge_runtime::harness::DeviceWorkload, self_routed: bool| {
        session.fill_bits(&mut io.y, bf16::NAN).expect("poison");
        stream.synchronize().expect("poisoned");
        let started = std::time::Instant::now();
        if self_routed {
            layer
                .forward_routed(RoutedForwardArgs {
                    tokens: io.tokens,
                    x: &io.x,
                    y: &mut io.y,
                })
                .expect("self-routed forward");
        } else {
            session.forward(layer, io).expect("forward");
        }
        enqueue_us.set(started.elapsed().as_secs_f64() * 1e6);
        layer.take_error().expect("no kernel error");
        stream.clone_dtoh(&io.y).expect("download")
    };

    let workload = Workload::random(&shape, 4, Routing::Uniform, seed);
    let mut io = session.upload(&shape, &workload).expect("upload");
    let first = run(&mut io, false);
    let mut enqueued = vec![enqueue_us.get()];
    assert_eq!(
        layer.kept_call_graphs(),
        0,
        "a call seen once keeps no graph"
    );
    for call in 2..=4 {
        assert!(
            run(&mut io, false) == first,
            "call {call} of 4 tokens (graph captured at call 2, replayed after) wrote another y than call 1"
        );
        enqueued.push(enqueue_us.get());
        assert_eq!(
            layer.kept_call_graphs(),
            1,
            "call {call}: one graph kept (is MOEFORGE_CALL_GRAPHS=0 set?)"
        );
    }

    log(&format!(
        "call graphs: host time to enqueue calls 1 (launches), 2 (capture), 3 and 4 (replays): {:.1}, {:.1}, {:.1}, {:.1} us",
        enqueued[0], enqueued[1], enqueued[2], enqueued[3]
    ));

    let mut other = session.upload(&shape, &workload).expect("upload");
    assert!(
        run(&mut other, false) == first,
        "the same call on other buffers"
    );
    assert_eq!(
        layer.kept_call_graphs(),
        1,
        "other buffers: a call seen once"
    );
    assert!(run(&mut other, false) == first, "its repeat, captured");
    assert_eq!(
        layer.kept_call_graphs(),
        2,
        "other buffers: their own graph"
    );

    if layer.routes_itself() {
        let routed = run(&mut io, true);
        for _ in 0..2 {
            assert!(
                run(&mut io, true) == routed,
                "a repeated self-routed call wrote another y"
            );
        }
        assert_eq!(layer.kept_call_graphs(), 3, "the self-routed call's graph");
    }
    let kept = layer.kept_call_graphs();

    stream.synchronize().expect("sync before capture");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    for _ in 0..2 {
        session
            .forward(layer, &mut other)
            .expect("forward under capture");
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("end capture")
        .expect("the caller's graph holds the forward's launches");
    assert_eq!(
        layer.kept_call_graphs(),
        kept,
        "calls inside the caller's capture keep no graph of their own"
    );
    session.fill_bits(&mut other.y, bf16::NAN).expect("poison");
    graph.launch().expect("replay the caller's graph");
    layer.take_error().expect("no kernel error");
    assert!(
        stream.clone_dtoh(&other.y).expect("download") == first,
        "the caller's graph of two calls wrote another y"
    );

    let large = Workload::random(&shape, bound + 1, Routing::Uniform, seed);
    let mut large_io = session.upload(&shape, &large).expect("upload");
    let large_first = run(&mut large_io, false);
    for _ in 0..2 {
        assert!(run(&mut large_io, false) == large_first);
    }
    assert_eq!(
        layer.kept_call_graphs(),
        kept,
        "calls of {} tokens, past the plan's bound, keep no graph",
        bound + 1
    );
}

/// The fused decode on [`fused_decode_layers`]: every case of the sweep matches the CPU
/// reference, and the counters go back to zero in every call, so a call repeated many
/// times gives the same output each time. Where the layer without its fused decode is one
/// that [`every_example_scaled_down_matches_reference`] checks (the same table kernels),
/// only the calls up to the first past the fused decode are checked here.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_decode_matches_reference_and_repeats_identically() {
    let session = Session::open().expect("GPU session");
    let seed = fresh_seed();
    log(&format!(
        "fused decode: seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let (scaled_suite, _) = scaled_example_plans();
    let plans: Vec<Plan> = fused_decode_layers().iter().map(plan_for_device).collect();
    let mut failures = Vec::new();
    for built in session.build_many(plans, seed).expect("build") {
        let plan = built.layer.plan();
        let name = plan.layer.clone();
        let fused = plan.regimes[0]
            .fused_decode
            .clone()
            .expect("the first regime has a fused decode");
        assert!(
            built.layer.runs_fused(1) && built.layer.runs_fused(fused.max_tokens),
            "{name}: the calls run the fused decode (is MOEFORGE_FUSED_DECODE=0 set?)"
        );
        let mut unfused = plan.clone();
        unfused.regimes[0].fused_decode = None;
        let checked_elsewhere = scaled_suite
            .iter()
            .any(|p| layers::same_single_gpu_kernels(p, &unfused));
        if checked_elsewhere {
            log(&format!(
                "{name}: its table runs the kernels of the scaled-down suite's layer; calls of up to {} tokens checked here",
                fused.max_tokens + 1
            ));
        }
        let cases = cases(plan)
            .into_iter()
            .filter(|&(tokens, _)| !checked_elsewhere || tokens <= fused.max_tokens + 1)
            .collect();
        failures.extend(check_cases(&session, &built, seed, cases));
        let shape = plan.shape.clone();
        for tokens in [1, fused.max_tokens] {
            let workload =
                Workload::random(&shape, tokens, Routing::Skewed, seed ^ u64::from(tokens));
            let stream = &session.gpu.stream;
            let mut io = session.upload(&shape, &workload).expect("upload");
            session.forward(&built.layer, &mut io).expect("first call");
            let first = stream.clone_dtoh(&io.y).expect("download");
            for call in 1..=40 {
                session.fill_bits(&mut io.y, bf16::NAN).expect("poison");
                session.forward(&built.layer, &mut io).expect("call");
                built.layer.take_error().expect("no kernel error");
                let again = stream.clone_dtoh(&io.y).expect("download");
                if first != again {
                    failures.push(format!(
                        "{name} T={tokens}: call {call} differs from the first"
                    ));
                    break;
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "fused decode: {} failing cases (seed {seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Tiles of one grouped GEMM for a call's routing: each expert's rows in `bm`-row tiles
/// (a shared slice has a row per token), times the GEMM's n-tiles (what the kernel's tile
/// schedule counts); and the most rows a routed expert has.
fn call_tiles(
    workload: &Workload,
    shape: &plan::LayerShape,
    gemm: &GemmPlan,
    n: u32,
) -> (u32, u32) {
    let mut rows = vec![0u32; shape.experts as usize];
    for &id in &workload.topk_ids {
        rows[id as usize] += 1;
    }
    let most_routed = rows.iter().copied().max().unwrap_or(0);
    rows.extend((0..shape.shared_slices).map(|_| workload.tokens));
    let m_tiles: u32 = rows.iter().map(|r| r.div_ceil(gemm.tile.m)).sum();
    (m_tiles * (n / gemm.tile.n), most_routed)
}

/// A call that splits stream-K: its tokens, its tiles and the seed of its routing.
type SplitCall = (u32, u32, u64);

/// Calls whose last wave of whole tiles is short run stream-K (each block a run of k-tiles,
/// a split tile summed and stored by its last block) where the tiles are large enough for
/// it to pay and every routed expert's rows fit one m-tile. Layers of 32 experts pinned to
/// 16x64 mma.sync tiles, with a deep GEMM1 (hidden 4096, FFN 1024; once more with a shared
/// expert, whose slices are GEMM experts with a row per token) and with a wide GEMM2
/// (hidden 2048, FFN 2048), each at the first token counts whose routing splits that GEMM
/// within its first wave and after full waves (the tiles counted here from the routing, so
/// the test knows the split ran), match the CPU reference, and a second run of each call
/// writes the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_that_split_stream_k_match_reference() {
    let tile = TileShape {
        m: 16,
        n: 64,
        k: 64,
    };
    let seed = fresh_seed();
    let mut failures = Vec::new();
    let mut runs: Vec<(Plan, Vec<SplitCall>)> = Vec::new();
    for (hidden, ffn, shared, up) in [
        (4096, 1024, false, true),
        (4096, 1024, true, true),
        (2048, 2048, false, false),
    ] {
        let mut layer = layers::pinned(Activation::Swiglu, tile, 5);
        layer.name = format!(
            "stream_k_{hidden}x{ffn}{}",
            if shared { "_shared" } else { "" }
        );
        (layer.hidden, layer.ffn, layer.experts) = (hidden, ffn, 32);
        if shared {
            layer.shared_experts = Some(SharedExperts {
                count: 1,
                ffn,
                gated: false,
            });
        }
        let plan = plan_for_device(&layer);
        let shape = &plan.shape;
        let split_tiles = |t: u32, routing_seed: u64| {
            let regime = plan.regime_for(t).expect("the regimes cover every count");
            let (gemm, n) = if up {
                (&regime.gemm1, shape.ffn)
            } else {
                (&regime.gemm2, shape.hidden)
            };
            let routing = Workload::random(shape, t, Routing::Uniform, routing_seed);
            let (tiles, most_routed) = call_tiles(&routing, shape, gemm, n);
            gemm.runs_stream_k(f64::from(tiles), f64::from(most_routed))
                .then_some((tiles, tiles > gemm.grid_blocks))
        };
        // A split within the first wave, then one after full waves: with every routed
        // expert's rows within one m-tile, a split after full waves needs a narrow range of
        // hit experts, so counts are tried smallest first, with a few routings each (one
        // routing of each count found none for some seeds). Past `tile.m · E / K` tokens
        // some expert has more rows than one m-tile, so no count beyond splits; drawing
        // those calls' activations (up to 4096 x 4096 values each) took minutes.
        let most_splitting = (tile.m * shape.experts / shape.top_k).min(shape.max_tokens);
        let mut chosen = Vec::new();
        for after_full_waves in [false, true] {
            let found = (1..=most_splitting)
                .flat_map(|t| (0..8u64).map(move |draw| (t, seed ^ u64::from(t) ^ (draw << 40))))
                .find_map(|(t, routing_seed)| {
                    split_tiles(t, routing_seed)
                        .filter(|&(_, more)| more == after_full_waves)
                        .map(|(tiles, _)| (t, tiles, routing_seed))
                });
            match found {
                Some(call) => chosen.push(call),
                None => failures.push(format!(
                    "{}: no call splits {} {}",
                    plan.layer,
                    if up { "GEMM1" } else { "GEMM2" },
                    if after_full_waves {
                        "after full waves"
                    } else {
                        "within one wave"
                    }
                )),
            }
        }
        log(&format!(
            "{}: (tokens, tiles, routing seed) of the calls that split: {chosen:?}",
            plan.layer
        ));
        runs.push((plan, chosen));
    }
    let session = Session::open().expect("GPU session");
    for (plan, chosen) in runs {
        let shape = plan.shape.clone();
        let built = session
            .build_many(vec![plan], seed)
            .expect("build")
            .remove(0);
        for (tokens, tiles, routing_seed) in chosen {
            let workload = Workload::random(&shape, tokens, Routing::Uniform, routing_seed);
            let first = session
                .run_collect(&built, &workload)
                .expect("the call runs");
            let report = session
                .check_output(&built, &workload, &first.y, CHECKED_TOKENS, seed)
                .expect("the check runs");
            let label = format!(
                "{} T={tokens} ({tiles} tiles split, routing seed {routing_seed})",
                built.layer.plan().layer
            );
            log(&format!("{label}: {report}"));
            if !report.passed() {
                failures.push(format!("{label}: {report}"));
            }
            // The route places rows in atomic order; the split must not depend on it.
            for call in 1..=20 {
                let again = session
                    .run_collect(&built, &workload)
                    .expect("the call runs");
                if again.y != first.y {
                    failures.push(format!(
                        "{label}: call {call} wrote other bits than the first"
                    ));
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
