//! The layer on the GPU against the CPU reference (run on the GPU machine:
//! `cargo test -- --include-ignored`). Every case draws fresh random data; the seed is
//! printed so that a failure can be replayed with MOEFORGE_SEED.

use cudarc::driver::sys::CUgraphInstantiate_flags;
use cudarc::driver::sys::CUstreamCaptureMode;
use moeforge_compiler::ir::{Activation, Layer};
use moeforge_compiler::plan::{self, Target};
use moeforge_runtime::bf16;
use moeforge_runtime::harness::{HarnessError, Session};
use moeforge_runtime::layer::LayerError;
use moeforge_runtime::workload::{self, Routing, Workload};

mod layers;

const TOKEN_COUNTS: [u32; 6] = [0, 1, 7, 128, 1000, 4096];
const SAMPLE_TOKENS: usize = 64;

/// MOEFORGE_SEED replays a failure; otherwise a fresh seed.
fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

/// Every token count and both routings on one layer; T above max_tokens must be refused.
fn check_layer(layer: &Layer) {
    let seed = fresh_seed();
    println!("layer {} seed {seed}", layer.name);
    let session = Session::open().expect("GPU session");
    let plan = plan::plan(layer, &Target::h200()).expect("plan");
    let built = session.build(plan, seed).expect("build");
    let shape = built.layer.plan().shape.clone();
    for tokens in TOKEN_COUNTS {
        for routing in [Routing::Uniform, Routing::Skewed] {
            let workload = Workload::random(&shape, tokens, routing, seed ^ u64::from(tokens));
            let result =
                session.run_checked(&built, &workload, SAMPLE_TOKENS, seed.wrapping_add(1));
            if tokens > shape.max_tokens {
                assert!(
                    matches!(
                        result,
                        Err(HarnessError::Layer(LayerError::TooManyTokens { .. }))
                    ),
                    "{} T={tokens}: expected a max_tokens error, got {result:?}",
                    layer.name
                );
                continue;
            }
            let report = result.expect("forward");
            println!("  T={tokens:5} {routing:?}: {report}");
            assert!(
                report.passed(),
                "{} T={tokens} {routing:?}: {report:?}",
                layer.name
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_layers_match_reference_for_every_activation() {
    for activation in [
        Activation::Swiglu,
        Activation::Geglu,
        Activation::Gelu,
        Activation::Relu,
        Activation::Silu,
    ] {
        check_layer(&layers::tiny(activation));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_example_matches_reference() {
    for layer in layers::examples() {
        check_layer(&layer);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_range_expert_id_is_reported_with_its_token() {
    let layer = layers::tiny(Activation::Swiglu);
    let session = Session::open().expect("GPU session");
    let built = session
        .build(plan::plan(&layer, &Target::h200()).expect("plan"), 3)
        .expect("build");
    let shape = built.layer.plan().shape.clone();
    let mut workload = Workload::random(&shape, 9, Routing::Uniform, fresh_seed());
    workload.topk_ids[5 * 2 + 1] = shape.experts as i32 + 3;
    match session.run_checked(&built, &workload, 64, 1) {
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
    let valid = Workload::random(&shape, 9, Routing::Uniform, fresh_seed());
    let report = session
        .run_checked(&built, &valid, 64, 1)
        .expect("valid call after an error");
    assert!(report.passed(), "{report}");
    // A negative id is out of range too.
    workload.topk_ids[5 * 2 + 1] = -1;
    assert!(matches!(
        session.run_checked(&built, &workload, 64, 1),
        Err(HarnessError::Layer(LayerError::ExpertIdOutOfRange {
            token: 5,
            k: 1,
            id: -1,
            ..
        }))
    ));
}

/// `forward` enqueues work only: stream capture fails on any host synchronisation, and
/// the replayed graph must produce exactly what the eager call produced.
#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_is_graph_capturable_and_replays_identically() {
    let layer = layers::examples()
        .into_iter()
        .find(|l| l.name == "qwen3_30b_a3b")
        .expect("the Qwen3-30B example");
    let session = Session::open().expect("GPU session");
    let built = session
        .build(plan::plan(&layer, &Target::h200()).expect("plan"), 5)
        .expect("build");
    let shape = built.layer.plan().shape.clone();
    let workload = Workload::random(&shape, 300, Routing::Uniform, fresh_seed());
    let stream = &session.gpu.stream;

    let mut eager = session.upload(&shape, &workload).expect("upload");
    session
        .forward(&built.layer, &mut eager)
        .expect("eager forward");
    let eager_y = stream.clone_dtoh(&eager.y).expect("download");

    let mut captured = session.upload(&shape, &workload).expect("upload");
    stream.synchronize().expect("sync before capture");
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    session
        .forward(&built.layer, &mut captured)
        .expect("forward under capture");
    let graph = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .expect("end capture")
        .expect("a graph with the forward's launches");
    session
        .fill_bits(&mut captured.y, bf16::NAN)
        .expect("poison");
    graph.launch().expect("replay");
    built.layer.take_error().expect("no kernel error");
    let replay_y = stream.clone_dtoh(&captured.y).expect("download");
    assert_eq!(
        eager_y, replay_y,
        "graph replay differs from the eager call"
    );
}
