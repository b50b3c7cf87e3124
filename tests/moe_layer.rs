//! `#[moe_layer]` expansions against the compiler and the runtime: the macro-built tiny
//! layer carries the planner's constants, plan and source; its embedded PTX passes the
//! AOT entry check and loads with NVRTC hidden; a layer built without PTX compiles at first
//! use; a handle whose type disagrees with its plan, or PTX of another layer, is refused.
//! The GPU test (ignored by default; `cargo test --workspace -- --include-ignored` on the
//! GPU machine) runs the macro-built tiny layer against the CPU reference.

use moeforge::compiler::plan::{self, Plan, Target};
use moeforge::compiler::{codegen, compile_source};
use moeforge::embedded::{
    Artifacts, EmbeddedError, KernelOrigin, Routing, Shape, SpecLayer, Tokens,
};
use moeforge::moe_layer;
use moeforge::runtime::aot;
use moeforge::runtime::harness::{CHECKED_TOKENS, Session};
use moeforge::runtime::jit::Jit;
use moeforge::runtime::layer::ExpertWeights;
use moeforge::runtime::workload::{self, Workload};

#[moe_layer(file = "dsl-examples/tiny.moe")]
fn tiny() {}

/// An inline spec, in a raw string: a single-GPU layer of another shape.
#[moe_layer(
    r#"
    topology one_gpu {
      gpus_per_node = 1
      nvlink = 450 GB/s, 3 us
      network = 50 GB/s, 10 us
    }
    layer inline_small {
      hidden = 256
      ffn = 128
      experts = 4
      top_k = 1
      activation = relu
      max_tokens = 64
      topology = one_gpu
    }
    "#,
    target = "a100"
)]
pub(crate) fn inline_small() {}

/// The tiny layer planned by the compiler directly, as the CLI plans it for the H200.
fn planned_tiny() -> Plan {
    let text = include_str!("../dsl-examples/tiny.moe");
    let module = compile_source("tiny.moe", text).expect("tiny.moe checks");
    plan::plan(&module.layers[0], &Target::h200()).expect("tiny plans for the H200")
}

fn nvrtc_required() -> bool {
    std::env::var("MOEFORGE_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn the_tiny_layer_carries_the_planners_constants_plan_and_source() {
    let expected = planned_tiny();
    let layer = tiny();
    let shape = &expected.shape;
    assert_eq!(
        *layer.shape(),
        Shape {
            hidden: shape.hidden,
            ffn: shape.ffn,
            experts: shape.experts,
            top_k: shape.top_k,
            max_tokens: shape.max_tokens,
            shared_slices: shape.shared_slices,
            w1_rows: shape.w1_rows(),
        }
    );
    assert_eq!(SpecLayer::<128, 2>::HIDDEN, shape.hidden as usize);
    assert_eq!(SpecLayer::<128, 2>::TOP_K, shape.top_k as usize);
    let _: &'static SpecLayer<128, 2> = layer;
    assert_eq!(layer.name(), "tiny");
    assert_eq!(layer.spec(), "dsl-examples/tiny.moe");
    assert_eq!(layer.target_name(), expected.target.name);
    assert_eq!(
        *layer.plan().expect("the embedded plan reads back"),
        expected
    );
    assert_eq!(
        layer.source(),
        codegen::generate(&expected).expect("codegen").source
    );
    assert!(
        std::ptr::eq(layer.plan().unwrap(), layer.plan().unwrap()),
        "the plan is parsed once"
    );
}

#[test]
fn an_inline_spec_plans_for_the_target_it_names() {
    let layer = inline_small();
    let plan = layer.plan().expect("the embedded plan reads back");
    assert_eq!(plan.layer, "inline_small");
    assert_eq!(plan.target.arch, Target::a100().arch);
    assert_eq!(layer.shape().w1_rows, 128, "relu is not gated: F rows");
    assert_eq!(layer.spec(), file!());
}

#[test]
fn the_embedded_ptx_passes_the_aot_check_and_needs_no_nvrtc() {
    let layer = tiny();
    let Some(ptx) = layer.ptx() else {
        assert!(
            !nvrtc_required(),
            "MOEFORGE_REQUIRE_NVRTC=1 but the macro embedded no PTX: NVRTC was not found at build time"
        );
        eprintln!("SKIPPED: the build had no NVRTC, so no PTX is embedded");
        return;
    };
    let plan = layer.plan().expect("plan");
    aot::check_ptx_entries(plan, ptx).expect("every entry point matches the plan");
    let kernels = layer.kernels().expect("the embedded PTX loads");
    assert_eq!(kernels.origin, KernelOrigin::Embedded);
    assert_eq!(kernels.module.ptx, ptx);
    assert_eq!(kernels.module.arch, plan.target.arch);
}

/// Runs [`embedded_kernels_load_in_this_process`] in a child with every way to NVRTC
/// that the environment gives taken away: the variables unset, and the test binary copied
/// to a temporary folder and run there, so that no `.venv/` above it or its working
/// directory is found. Loading the embedded kernels must then still work.
#[test]
fn the_embedded_kernels_load_with_nvrtc_hidden() {
    if tiny().ptx().is_none() {
        assert!(
            !nvrtc_required(),
            "no PTX embedded although NVRTC is required"
        );
        eprintln!("SKIPPED: the build had no NVRTC, so no PTX is embedded");
        return;
    }
    let dir = std::env::temp_dir().join(format!("moeforge-nvrtc-hidden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    let exe = dir.join("moe_layer_test");
    std::fs::copy(std::env::current_exe().expect("test binary"), &exe)
        .expect("copy the test binary");
    let output = std::process::Command::new(&exe)
        .args([
            "--exact",
            "embedded_kernels_load_in_this_process",
            "--include-ignored",
            "--nocapture",
        ])
        .current_dir(&dir)
        .env_remove("MOEFORGE_NVRTC_WHEEL")
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("VIRTUAL_ENV")
        .env("MOEFORGE_HIDE_NVRTC_CHILD", "1")
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let output = output.expect("the copied test binary runs");
    let log = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "child failed:\n{log}");
    assert!(log.contains("1 passed"), "the child ran no test:\n{log}");
    eprintln!("{log}");
}

/// The child of [`the_embedded_kernels_load_with_nvrtc_hidden`]; does nothing elsewhere.
#[test]
#[ignore = "run by the_embedded_kernels_load_with_nvrtc_hidden in a child process"]
fn embedded_kernels_load_in_this_process() {
    if std::env::var_os("MOEFORGE_HIDE_NVRTC_CHILD").is_none() {
        return;
    }
    match Jit::from_env() {
        Ok(jit) => eprintln!(
            "note: NVRTC is still found, at {} (a toolkit in a standard place or python3's site-packages); the load below does not use it",
            jit.toolkit().root.display()
        ),
        Err(_) => eprintln!("NVRTC hidden: Jit::from_env fails here"),
    }
    let kernels = tiny()
        .kernels()
        .expect("embedded kernels load without NVRTC");
    assert_eq!(kernels.origin, KernelOrigin::Embedded);
}

/// The tiny layer's artifacts as the macro would write them without NVRTC (no PTX), or
/// with `ptx` in their place.
fn tiny_artifacts(
    plan_json: &'static str,
    source: &'static str,
    ptx: Option<&'static str>,
) -> Artifacts {
    Artifacts {
        layer: "tiny",
        spec: "dsl-examples/tiny.moe",
        target: "NVIDIA H200",
        shape: *tiny().shape(),
        plan_json,
        source,
        ptx,
    }
}

fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

#[test]
fn without_embedded_ptx_the_source_is_compiled_at_first_use() {
    if Jit::from_env().is_err() {
        assert!(!nvrtc_required(), "MOEFORGE_REQUIRE_NVRTC=1 but no NVRTC");
        eprintln!("SKIPPED: no NVRTC");
        return;
    }
    let plan = planned_tiny();
    let plan_json = leak(serde_json::to_string(&plan).expect("plan serialises"));
    let source = leak(codegen::generate(&plan).expect("codegen").source);
    let layer = SpecLayer::<128, 2>::new(tiny_artifacts(plan_json, source, None));
    let kernels = layer.kernels().expect("compiled at first use");
    assert_eq!(kernels.origin, KernelOrigin::CompiledAtFirstUse);
    aot::check_ptx_entries(&plan, &kernels.module.ptx).expect("entries match the plan");
}

#[test]
fn a_handle_refuses_a_plan_of_another_shape_and_ptx_of_another_layer() {
    let plan = planned_tiny();
    let plan_json = leak(serde_json::to_string(&plan).expect("plan serialises"));
    let source = leak(codegen::generate(&plan).expect("codegen").source);

    let wrong_width = SpecLayer::<64, 2>::new(tiny_artifacts(plan_json, source, None));
    assert!(matches!(
        wrong_width.plan(),
        Err(EmbeddedError::TypeMismatch {
            what: "hidden",
            planned: 128,
            typed: 64,
            ..
        })
    ));

    // The routing kernel's entry point with a parameter missing.
    let route = &plan.route_kernel;
    let ptx = leak(format!(
        ".visible .entry {route}(\n\t.param .u64 {route}_param_0\n)\n{{\n}}\n"
    ));
    let wrong_ptx = SpecLayer::<128, 2>::new(tiny_artifacts(plan_json, source, Some(ptx)));
    match wrong_ptx.kernels() {
        Err(EmbeddedError::PtxMismatch { kernel, .. }) => assert_eq!(&kernel, route),
        Err(other) => panic!("expected a PTX mismatch, got {other}"),
        Ok(_) => panic!("PTX of another layer was accepted"),
    }
}

/// MOEFORGE_SEED replays a failure; otherwise a fresh seed.
fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_macro_built_tiny_layer_matches_the_cpu_reference() {
    let seed = fresh_seed();
    eprintln!("seed {seed} (MOEFORGE_SEED={seed} replays)");
    let session = Session::open().expect("a GPU and NVRTC");
    let layer = tiny();
    let built = layer
        .build_random(&session, seed)
        .expect("the tiny layer builds");
    let shape = built.layer.plan().shape.clone();
    for (i, tokens) in [0, 1, 7, 100, shape.max_tokens].into_iter().enumerate() {
        for routing in [workload::Routing::Uniform, workload::Routing::Skewed] {
            let call_seed = seed.wrapping_add(i as u64);
            let workload = Workload::random(&shape, tokens, routing, call_seed);
            let report = session
                .run_checked(&built, &workload, CHECKED_TOKENS, call_seed)
                .expect("the call runs");
            eprintln!("tiny T = {tokens} {routing:?}: {report}");
            assert!(report.passed(), "T = {tokens} {routing:?}: {report}");
        }
    }

    // The typed path (`SpecLayer::build`, `Layer::forward` on `Tokens`/`Routing`) on the
    // same weights, checked against the same reference.
    let stream = &session.gpu.stream;
    let weights = ExpertWeights {
        w1: stream
            .clone_dtod(&built.layer.weights().w1)
            .expect("copy W1"),
        w2: stream
            .clone_dtod(&built.layer.weights().w2)
            .expect("copy W2"),
        biases: None,
        shared_gate: None,
    };
    let typed = layer
        .build(&session.gpu, weights)
        .expect("typed layer builds");
    let workload = Workload::random(&shape, 37, workload::Routing::Uniform, seed);
    let mut io = session.upload(&shape, &workload).expect("upload");
    let x = Tokens::<128>::new(io.x.clone(), io.tokens).expect("x");
    let routing = Routing::<2>::new(io.topk_ids.clone(), io.topk_weights.clone(), io.tokens)
        .expect("routing");
    let mut y = Tokens::<128>::new(io.y.clone(), io.tokens).expect("y");
    typed.forward(&x, &routing, &mut y).expect("forward");
    typed.take_error().expect("no kernel error");
    io.y = y.into_data();
    let y = stream.clone_dtoh(&io.y).expect("download y");
    let report = session
        .check_output(&built, &workload, &y, CHECKED_TOKENS, seed)
        .expect("check");
    eprintln!("tiny typed T = 37: {report}");
    assert!(report.passed(), "typed forward: {report}");
}
