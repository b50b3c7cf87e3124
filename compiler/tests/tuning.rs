//! The planner with a tuning table: entries replace the cost model's GEMMs of the regime
//! they name, hints win over them, and an entry this build cannot plan is reported.

mod common;

use moeforge_compiler::codegen;
use moeforge_compiler::ir::{Activation, TileShape};
use moeforge_compiler::plan::tuning::{
    ChoiceSource, TunedGemm, TunedRegime, TunedShape, TuningTable,
};
use moeforge_compiler::plan::{MmaEngine, Plan, Target, plan, plan_tuned};

fn layer() -> moeforge_compiler::ir::Layer {
    let mut layer = common::layer("tuned", 2048, 768, 64, 8, Activation::Swiglu, 4096);
    layer.parallel.expert = 1;
    layer.topology.gpus_per_node = 1;
    layer
}

fn entry_for(plan: &Plan, regime: usize, gemm1: TunedGemm, gemm2: TunedGemm) -> TunedRegime {
    let r = &plan.regimes[regime];
    TunedRegime {
        gpu: plan.target.name.clone(),
        shape: TunedShape::of(&plan.shape),
        min_tokens: r.min_tokens,
        max_tokens: r.max_tokens,
        gemm1: Some(gemm1),
        gemm2: Some(gemm2),
        timed_tokens: vec![r.max_tokens],
        measured_us: 10.0,
        model_choice_us: 12.0,
        self_routed: false,
        measured_on: "2026-11-30".into(),
        measured_by: "test".into(),
    }
}

fn mma(m: u32, n: u32, stages: u32) -> TunedGemm {
    TunedGemm {
        engine: MmaEngine::MmaSync,
        tile: TileShape { m, n, k: 64 },
        stages,
        cluster: 1,
    }
}

/// A GEMM no build plans: 48 rows are not a wgmma tile, and too many accumulators or no
/// warp layout on mma.sync for this width.
fn unplannable_gemm() -> TunedGemm {
    TunedGemm {
        engine: MmaEngine::WgmmaWarpSpecialized,
        tile: TileShape {
            m: 48,
            n: 256,
            k: 64,
        },
        stages: 4,
        cluster: 1,
    }
}

#[test]
fn an_entry_replaces_the_gemms_of_its_regime_only() {
    let target = Target::h200();
    let model = plan(&layer(), &target).expect("plans");
    assert!(model.regimes.len() >= 2);
    let table = TuningTable {
        entries: vec![entry_for(&model, 0, mma(32, 64, 4), mma(16, 128, 3))],
    };
    let tuned = plan_tuned(&layer(), &target, &table).expect("plans with the table");
    let first = &tuned.regimes[0];
    assert_eq!(
        first.gemm1.tile,
        TileShape {
            m: 32,
            n: 64,
            k: 64
        }
    );
    assert_eq!(first.gemm1.stages, 4);
    assert_eq!(
        first.gemm2.tile,
        TileShape {
            m: 16,
            n: 128,
            k: 64
        }
    );
    assert_eq!(first.gemm1.source, ChoiceSource::Tuned);
    assert!(first.tuned.is_some());
    // The launches follow the tuned GEMMs (threads and shared memory of the new tiles).
    let gemm1_launch = first
        .launches
        .iter()
        .find(|l| l.kernel == first.gemm1_kernel)
        .expect("a GEMM1 launch");
    assert_eq!(gemm1_launch.smem_bytes, first.gemm1.smem_bytes);
    assert_eq!(gemm1_launch.block_threads, first.gemm1.threads());
    // The other regimes keep the cost model's choice.
    for (tuned, model) in tuned.regimes.iter().zip(&model.regimes).skip(1) {
        assert_eq!(tuned.gemm1, model.gemm1);
        assert_eq!(tuned.gemm2, model.gemm2);
        assert!(tuned.tuned.is_none());
    }
    tuned.validate().expect("a valid plan");
    assert!(moeforge_compiler::plan::describe(&tuned).contains("tuned  the tuning table's GEMMs"));
}

#[test]
fn an_entry_for_another_gpu_or_regime_changes_nothing() {
    let target = Target::h200();
    let model = plan(&layer(), &target).expect("plans");
    let mut other_gpu = entry_for(&model, 0, mma(32, 64, 4), mma(16, 128, 3));
    other_gpu.gpu = "NVIDIA H100 SXM".into();
    let mut other_range = entry_for(&model, 0, mma(32, 64, 4), mma(16, 128, 3));
    other_range.max_tokens += 1;
    let table = TuningTable {
        entries: vec![other_gpu, other_range],
    };
    let tuned = plan_tuned(&layer(), &target, &table).expect("plans");
    assert_eq!(tuned.regimes, model.regimes);
}

#[test]
fn a_hint_wins_over_the_table() {
    let target = Target::h200();
    let mut hinted = layer();
    hinted.schedule.gemm2_tile = Some(TileShape {
        m: 64,
        n: 128,
        k: 64,
    });
    let model = plan(&hinted, &target).expect("plans");
    let table = TuningTable {
        entries: vec![entry_for(&model, 0, mma(32, 64, 4), mma(16, 128, 3))],
    };
    let tuned = plan_tuned(&hinted, &target, &table).expect("plans");
    assert_eq!(tuned.regimes[0].gemm1.source, ChoiceSource::Tuned);
    assert_eq!(tuned.regimes[0].gemm2.source, ChoiceSource::Hint);
    assert_eq!(tuned.regimes[0].gemm2, model.regimes[0].gemm2);
}

#[test]
fn an_entry_without_gemms_is_not_a_tuned_regime() {
    let target = Target::h200();
    let model = plan(&layer(), &target).expect("plans");
    let mut empty = entry_for(&model, 0, mma(32, 64, 4), mma(16, 128, 3));
    empty.gemm1 = None;
    empty.gemm2 = None;
    let tuned = plan_tuned(
        &layer(),
        &target,
        &TuningTable {
            entries: vec![empty],
        },
    )
    .expect("plans");
    assert_eq!(tuned.regimes, model.regimes);
}

#[test]
fn an_entry_this_build_cannot_plan_is_reported_and_left_out() {
    let target = Target::h200();
    let model = plan(&layer(), &target).expect("plans");
    let impossible = unplannable_gemm();
    let table = TuningTable {
        entries: vec![entry_for(&model, 0, impossible, mma(16, 128, 3))],
    };
    let tuned = plan_tuned(&layer(), &target, &table).expect("plans");
    assert_eq!(tuned.regimes, model.regimes);
    assert!(
        tuned
            .limitations
            .iter()
            .any(|l| l.contains("tuning table") && l.contains("gemm1")),
        "{:?}",
        tuned.limitations
    );
}

/// What the JIT compiles per entry point ([`codegen::kernel_unit_source`]) changes, between
/// a plan and the same plan with one regime tuned, for that regime's GEMMs only: a tuning
/// candidate or an edited tile compiles two modules again, not the layer's every kernel.
/// On Qwen3-30B-A3B's example, which has a router (split gates, wgmma gates), expert
/// parallelism and warp-specialised GEMMs in its other regimes.
#[test]
fn a_tuned_regime_changes_only_its_gemms_kernel_units() {
    let path = format!(
        "{}/../dsl-examples/qwen3_30b_a3b.moe",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("the example exists");
    let module = moeforge_compiler::compile_source(&path, &text).expect("the example checks");
    let layer = &module.layers[0];
    let target = Target::h200();
    let model = plan(layer, &target).expect("plans");
    let table = TuningTable {
        entries: vec![entry_for(&model, 0, mma(32, 128, 4), mma(16, 64, 5))],
    };
    let tuned = plan_tuned(layer, &target, &table).expect("plans with the table");
    assert_ne!(tuned.regimes[0].gemm1, model.regimes[0].gemm1);
    assert_ne!(tuned.regimes[0].gemm2, model.regimes[0].gemm2);
    let source = |plan: &Plan| codegen::generate(plan).expect("codegen");
    let (before, after) = (source(&model), source(&tuned));
    assert_eq!(before.entry_points, after.entry_points);
    assert!(before.source != after.source);
    let changed: Vec<&String> = before
        .entry_points
        .iter()
        .filter(|kernel| {
            let only = std::slice::from_ref(*kernel);
            codegen::kernel_unit_source(&before.source, only)
                != codegen::kernel_unit_source(&after.source, only)
        })
        .collect();
    let regime = &model.regimes[0];
    assert_eq!(changed, [&regime.gemm1_kernel, &regime.gemm2_kernel]);
    // Each unit is the kernel's share: another regime's GEMM is not in it.
    let unit = codegen::kernel_unit_source(
        &before.source,
        std::slice::from_ref(&model.regimes[1].gemm1_kernel),
    );
    assert!(unit.contains(&model.regimes[1].gemm1_kernel));
    assert!(!unit.contains(&regime.gemm1_kernel));
    assert!(unit.len() < before.source.len());
}

/// Entries that tile a regime (the tuner found other GEMMs fastest at its large calls than
/// at its small ones) cut it into as many regimes, each with its entry's GEMMs, kernels of
/// its own and its share of the token counts; the generated source has them all.
#[test]
fn entries_that_tile_a_regime_cut_it_into_regimes() {
    let target = Target::h200();
    let model = plan(&layer(), &target).expect("plans");
    let last = model.regimes.len() - 1;
    let regime = &model.regimes[last];
    let cut = regime.min_tokens + (regime.max_tokens - regime.min_tokens) / 2;
    let mut lower = entry_for(&model, last, mma(32, 64, 4), mma(16, 128, 3));
    lower.max_tokens = cut;
    let mut upper = entry_for(&model, last, mma(64, 64, 3), mma(32, 128, 3));
    upper.min_tokens = cut + 1;
    let table = TuningTable {
        entries: vec![upper, lower],
    };
    let tuned = plan_tuned(&layer(), &target, &table).expect("plans with the table");
    tuned.validate().expect("a valid plan");
    assert_eq!(tuned.regimes.len(), model.regimes.len() + 1);
    assert_eq!(tuned.regimes[..last], model.regimes[..last]);
    let parts = &tuned.regimes[last..];
    let bounds: Vec<(u32, u32)> = parts.iter().map(|r| (r.min_tokens, r.max_tokens)).collect();
    assert_eq!(
        bounds,
        [(regime.min_tokens, cut), (cut + 1, regime.max_tokens)]
    );
    let names: Vec<&str> = parts.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [format!("{}_1", regime.name), format!("{}_2", regime.name)]
    );
    assert_eq!((parts[0].gemm1.tile.m, parts[1].gemm1.tile.m), (32, 64));
    assert_eq!((parts[0].gemm2.tile.m, parts[1].gemm2.tile.m), (16, 32));
    assert!(parts.iter().all(|r| r.tuned.is_some()
        && r.gemm1.source == ChoiceSource::Tuned
        && r.gemm2.source == ChoiceSource::Tuned));
    let generated = codegen::generate(&tuned).expect("codegen");
    for part in parts {
        for kernel in [&part.gemm1_kernel, &part.gemm2_kernel] {
            assert!(generated.entry_points.contains(kernel), "{kernel}");
        }
    }
    assert_ne!(parts[0].gemm1_kernel, parts[1].gemm1_kernel);
    // Half of the parts is no tiling: the regime stays whole, on the cost model's GEMMs.
    let half = TuningTable {
        entries: vec![table.entries[1].clone()],
    };
    assert_eq!(
        plan_tuned(&layer(), &target, &half).expect("plans").regimes,
        model.regimes
    );
    // A part this build cannot plan: no cut at all, and the plan says why.
    let mut unplannable = table.clone();
    unplannable.entries[0].gemm1 = Some(unplannable_gemm());
    let whole = plan_tuned(&layer(), &target, &unplannable).expect("plans");
    assert_eq!(whole.regimes, model.regimes);
    assert!(
        whole
            .limitations
            .iter()
            .any(|l| l.contains(&format!("cut of regime `{}`", regime.name))),
        "{:?}",
        whole.limitations
    );
}
