//! `moeforge::engine`, the API for engines embedding moeforge. CPU tests: a spec from text,
//! a file or a `moeforge compile` directory plans what the planner plans; every spec error
//! is typed (diagnostics rendered as `moeforge check` renders them); the kernels compile
//! through NVRTC. GPU tests (ignored by default; `cargo test --workspace --
//! --include-ignored` on the GPU machine) build the tiny layer from a checkpoint written
//! in a temp folder, call it on buffers the test owns on its own stream, and compare every
//! output element with the CPU reference on the same weights: on one GPU, and over four
//! virtual ranks that each load their own experts.

use std::path::Path;
use std::sync::Arc;

use moeforge::compiler::compile_source;
use moeforge::compiler::plan::{self, Target};
use moeforge::engine::{
    CheckpointLayer, CudaContext, EngineError, ExpertSet, Family, ForwardArgs, Gpu, HostWeights,
    LayerError, LayerShape, LayerSpec, Weights,
};
use moeforge::runtime::aot;
use moeforge::runtime::checkpoint::write_experts;
use moeforge::runtime::reference;
use moeforge::runtime::toolkit;
use moeforge::runtime::workload::{Routing, Workload};

const TINY: &str = "dsl-examples/tiny.moe";

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn tiny_text() -> String {
    std::fs::read_to_string(repo(TINY)).expect("tiny.moe")
}

#[test]
fn a_spec_from_text_or_file_plans_what_the_planner_plans() {
    let module = compile_source("tiny.moe", &tiny_text()).expect("tiny.moe checks");
    let shipped = moeforge::tuning::shipped().expect("the shipped tuning table");
    let expected =
        plan::plan_tuned(&module.layers[0], &Target::h100(), &shipped).expect("tiny plans");
    let from_text = LayerSpec::from_text("tiny.moe", &tiny_text(), None, &Target::h100())
        .expect("the spec plans");
    assert_eq!(*from_text.plan(), expected);
    assert_eq!(from_text.shape(), &expected.shape);
    let from_file =
        LayerSpec::from_file(repo(TINY), Some("tiny"), &Target::h100()).expect("the file plans");
    assert_eq!(*from_file.plan(), expected);
}

#[test]
fn spec_errors_are_typed() {
    let h200 = Target::h200();
    let bad = tiny_text().replace("hidden = 128", "hidden = 100");
    let Err(EngineError::Spec(diagnostics)) = LayerSpec::from_text("bad.moe", &bad, None, &h200)
    else {
        panic!("a misaligned hidden size is a spec error")
    };
    let rendered = diagnostics.to_string();
    assert!(rendered.contains("bad.moe:"), "{rendered}");
    assert!(rendered.contains("^^^"), "{rendered}");

    // Only the A100 refuses this layer (a wgmma tile): checked for it, an error at the hint.
    let refused =
        std::fs::read_to_string(repo("tests/fixtures/wgmma_only_tile.moe")).expect("the fixture");
    let Err(EngineError::Spec(diagnostics)) =
        LayerSpec::from_text("wgmma_only_tile.moe", &refused, None, &Target::a100())
    else {
        panic!("the A100 cannot run a wgmma tile")
    };
    assert!(
        diagnostics
            .to_string()
            .contains("wgmma_only_tile.moe:18:18")
    );

    let two = format!(
        "{}\n{}",
        tiny_text(),
        tiny_text()
            .replace("layer tiny", "layer tiny2")
            .replace("topology one_gpu", "topology other")
            .replace("topology = one_gpu", "topology = other")
    );
    let err = LayerSpec::from_text("two.moe", &two, None, &h200)
        .err()
        .unwrap();
    assert!(
        matches!(&err, EngineError::SeveralLayers { available, .. } if available == &["tiny", "tiny2"]),
        "{err}"
    );
    let err = LayerSpec::from_text("two.moe", &two, Some("tiny3"), &h200)
        .err()
        .unwrap();
    assert!(
        matches!(&err, EngineError::NoSuchLayer { wanted, .. } if wanted == "tiny3"),
        "{err}"
    );
    assert!(LayerSpec::from_text("two.moe", &two, Some("tiny2"), &h200).is_ok());

    let err = LayerSpec::from_file(repo("no/such.moe"), None, &h200)
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::Read { .. }), "{err}");
    let err = LayerSpec::from_compiled(repo("no/such/dir"), None)
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::Compiled(_)), "{err}");
}

/// The checked-in `moeforge compile` output of the tiny layer: its plan and PTX, with no
/// NVRTC involved.
#[test]
fn a_compiled_directory_gives_its_plan_and_ptx() {
    let spec = LayerSpec::from_compiled(repo("kernels-generated/tiny"), None).expect("loads");
    let (plan, module) =
        aot::load_layer(&repo("kernels-generated/tiny"), None).expect("the directory loads");
    assert_eq!(*spec.plan(), plan);
    let kernels = spec.kernels().expect("the PTX is there");
    assert_eq!(kernels.modules.len(), 1, "a directory holds the unit whole");
    assert_eq!(kernels.modules[0].module.ptx, module.ptx);
}

#[test]
fn kernels_compile_once_through_nvrtc() {
    if toolkit::nvrtc_for_tests().is_none() {
        return;
    }
    let spec = LayerSpec::from_file(repo(TINY), None, &Target::h200()).expect("plans");
    let first = spec.kernels().expect("compiles");
    let ptx: String = first
        .modules
        .iter()
        .map(|m| m.module.ptx.as_str())
        .collect();
    aot::check_ptx_entries(spec.plan(), &ptx).expect("every entry point the plan launches");
    assert!(std::ptr::eq(first, spec.kernels().expect("kept")));
}

/// Random experts of `shape` written as a Qwen3-MoE checkpoint's layer 5 in `dir`; the
/// weights, and the checkpoint layer opened with prefix and family left to detection.
fn tiny_checkpoint(dir: &Path, shape: &LayerShape) -> (HostWeights, Weights) {
    let host = moeforge::runtime::weights::random(shape, 0..shape.experts, 17);
    let file = dir.join("model.safetensors");
    write_experts(&file, Family::Qwen3Moe, "model.layers.5.", shape, &host).expect("written");
    let layer = CheckpointLayer::open(&file, None, None).expect("opens");
    assert_eq!(layer.prefix(), "model.layers.5.");
    (host, Weights::Checkpoint(layer))
}

/// Every output row of `workload` against the CPU reference on `host`'s experts.
fn check_rows(shape: &LayerShape, host: &HostWeights, workload: &Workload, y: &[u16]) {
    let tokens = (0..workload.tokens as usize).collect();
    let want = reference::layer_output(shape, workload, tokens, |e| host.expert(shape, e));
    let comparison = reference::compare(y, &want);
    assert_eq!(
        comparison.out_of_bound, 0,
        "{} of {} elements out of bound; worst {:?}",
        comparison.out_of_bound, comparison.elements, comparison.worst
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn engine_tiny_from_a_checkpoint_on_the_callers_stream_matches_the_reference() {
    let ctx = CudaContext::new(0).expect("a GPU");
    let stream = ctx.new_stream().expect("the caller's stream");
    let gpu = Gpu::with_stream(Arc::clone(&stream));
    let spec = LayerSpec::from_file(repo(TINY), None, &gpu.target().expect("facts"))
        .expect("plans for this GPU");
    let shape = spec.shape().clone();
    let dir = tempfile::tempdir().expect("temp dir");
    let (host, weights) = tiny_checkpoint(dir.path(), &shape);
    let layer = spec.build(&gpu, &weights).expect("builds");

    // The weights on the device are the checkpoint's, bit for bit.
    assert_eq!(stream.clone_dtoh(&layer.weights().w1).expect("w1"), host.w1);
    assert_eq!(stream.clone_dtoh(&layer.weights().w2).expect("w2"), host.w2);

    for tokens in [1u32, 37, shape.max_tokens] {
        let workload = Workload::random(&shape, tokens, Routing::Uniform, u64::from(tokens));
        let x = stream.clone_htod(&workload.x).expect("x");
        let ids = stream.clone_htod(&workload.topk_ids).expect("ids");
        let routing = stream.clone_htod(&workload.topk_weights).expect("weights");
        let mut y = stream
            .alloc_zeros::<u16>(tokens as usize * shape.hidden as usize)
            .expect("y");
        // Repeated, a call of few tokens replays the layer's graph of it on this stream.
        for _ in 0..3 {
            layer
                .forward(ForwardArgs {
                    tokens,
                    x: &x,
                    topk_ids: &ids,
                    topk_weights: &routing,
                    y: &mut y,
                })
                .expect("enqueued");
            layer.take_error().expect("no kernel error");
            check_rows(
                &shape,
                &host,
                &workload,
                &stream.clone_dtoh(&y).expect("y back"),
            );
        }
    }
    assert!(
        layer.kept_call_graphs() >= 1,
        "the repeated small calls replayed graphs on the caller's stream"
    );

    // The legacy default stream cannot be captured: a layer there runs every call's launches.
    let legacy = Gpu::with_stream(ctx.default_stream());
    let on_legacy = spec.build(&legacy, &weights).expect("builds");
    assert!(!on_legacy.replays_call_graphs());
    let workload = Workload::random(&shape, 3, Routing::Uniform, 5);
    let x = stream.clone_htod(&workload.x).expect("x");
    let ids = stream.clone_htod(&workload.topk_ids).expect("ids");
    let routing = stream.clone_htod(&workload.topk_weights).expect("weights");
    let mut y = stream
        .alloc_zeros::<u16>(3 * shape.hidden as usize)
        .expect("y");
    stream.synchronize().expect("inputs uploaded");
    for _ in 0..3 {
        on_legacy
            .forward(ForwardArgs {
                tokens: 3,
                x: &x,
                topk_ids: &ids,
                topk_weights: &routing,
                y: &mut y,
            })
            .expect("enqueued on the legacy default stream");
        on_legacy.take_error().expect("no kernel error");
        check_rows(
            &shape,
            &host,
            &workload,
            &stream.clone_dtoh(&y).expect("y back"),
        );
    }
    assert_eq!(on_legacy.kept_call_graphs(), 0);

    // An expert id out of range is reported, naming the token.
    let workload = Workload::random(&shape, 4, Routing::Uniform, 3);
    let mut ids = workload.topk_ids.clone();
    ids[5] = shape.experts as i32;
    let x = stream.clone_htod(&workload.x).expect("x");
    let ids = stream.clone_htod(&ids).expect("ids");
    let routing = stream.clone_htod(&workload.topk_weights).expect("weights");
    let mut y = stream
        .alloc_zeros::<u16>(4 * shape.hidden as usize)
        .expect("y");
    layer
        .forward(ForwardArgs {
            tokens: 4,
            x: &x,
            topk_ids: &ids,
            topk_weights: &routing,
            y: &mut y,
        })
        .expect("enqueued");
    let err = layer.take_error().unwrap_err();
    assert!(
        matches!(
            err,
            LayerError::ExpertIdOutOfRange {
                token: 2,
                k: 1,
                id: 8,
                experts: 8
            }
        ),
        "{err}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn engine_tiny_over_four_virtual_ranks_loads_each_ranks_experts_and_matches_the_reference() {
    let gpu = Gpu::open(0).expect("a GPU");
    let spec = LayerSpec::from_file(repo(TINY), None, &gpu.target().expect("facts"))
        .expect("plans for this GPU");
    let shape = spec.shape().clone();
    let ranks = spec
        .plan()
        .expert_parallel
        .as_ref()
        .expect("tiny has 4 ranks")
        .ranks;
    assert_eq!(ranks, 4);
    let dir = tempfile::tempdir().expect("temp dir");
    let (host, weights) = tiny_checkpoint(dir.path(), &shape);
    let contexts = vec![Arc::clone(&gpu.ctx); ranks as usize];
    let mut layer = spec
        .build_expert_parallel(&contexts, &weights)
        .expect("builds");
    assert_eq!(
        weights
            .host(&shape, ExpertSet::Rank { rank: 3, ranks })
            .expect("rank 3's experts"),
        host.select(&shape, ExpertSet::Rank { rank: 3, ranks })
            .expect("the same experts")
    );

    let workloads: Vec<Workload> = (0..ranks)
        .map(|r| Workload::random(&shape, 16 + 7 * r, Routing::Uniform, u64::from(r)))
        .collect();
    let mut buffers = Vec::new();
    for (r, w) in workloads.iter().enumerate() {
        let stream = layer.stream(r);
        buffers.push((
            stream.clone_htod(&w.x).expect("x"),
            stream.clone_htod(&w.topk_ids).expect("ids"),
            stream.clone_htod(&w.topk_weights).expect("weights"),
            stream
                .alloc_zeros::<u16>(w.tokens as usize * shape.hidden as usize)
                .expect("y"),
        ));
    }
    layer.synchronize().expect("inputs in place");
    let mut args: Vec<ForwardArgs<'_>> = buffers
        .iter_mut()
        .zip(&workloads)
        .map(|((x, ids, routing, y), w)| ForwardArgs {
            tokens: w.tokens,
            x,
            topk_ids: ids,
            topk_weights: routing,
            y,
        })
        .collect();
    layer.forward(&mut args).expect("enqueued");
    drop(args);
    layer.take_error().expect("no kernel error");
    for (r, ((_, _, _, y), w)) in buffers.iter().zip(&workloads).enumerate() {
        let y = layer.stream(r).clone_dtoh(y).expect("y back");
        check_rows(&shape, &host, w, &y);
    }
}
