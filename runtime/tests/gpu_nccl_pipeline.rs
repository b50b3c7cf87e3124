//! Baseline (b), the NCCL pipeline, on two GPUs against the CPU reference: tiny layers of a
//! gated and a plain activation and a scaled-down Qwen3-30B, uniform and skewed routing,
//! several token counts per rank, every output element of every rank compared. Skipped,
//! with the reason printed, where NCCL or a second GPU is missing. Run on the GPU machine:
//! `cargo test -- --include-ignored`.

use std::io::Write;

use moeforge_compiler::ir::{Activation, Layer};
use moeforge_compiler::plan::{self, LayerShape};
use moeforge_runtime::gpu::Gpu;
use moeforge_runtime::harness::{
    BuiltLayer, CHECKED_TOKENS, DeviceWorkload, Session, upload_poisoned,
};
use moeforge_runtime::layer::ForwardArgs;
use moeforge_runtime::nccl_pipeline::{NcclPipeline, NcclPipelineError, Phase, nccl_available};
use moeforge_runtime::workload::{self, Routing, Workload};

mod layers;

const RANKS: usize = 2;

/// One line per case, straight to stderr so the GPU log shows it without --nocapture.
fn say(line: String) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn fresh_seed() -> u64 {
    let given = std::env::var("MOEFORGE_SEED")
        .ok()
        .map(|s| s.parse().expect("MOEFORGE_SEED must be an integer"));
    workload::fresh_seed(given)
}

/// `layer` with every expert on one GPU: the pipeline takes its weights from this layer and
/// the CPU reference checks against them.
fn on_one_gpu(layer: &Layer) -> Layer {
    let mut layer = layer.clone();
    layer.parallel.expert = 1;
    layer.topology.gpus_per_node = 1;
    layer.topology.nodes = 1;
    layer.topology.virtual_ranks = None;
    layer
}

/// Token counts per rank: none, one on alternate ranks, one everywhere, ragged, full.
fn token_counts(max: u32) -> Vec<Vec<u32>> {
    vec![
        vec![0; RANKS],
        (0..RANKS as u32).map(|r| (r % 2).min(max)).collect(),
        vec![1.min(max); RANKS],
        (0..RANKS as u32).map(|r| (77 + 13 * r).min(max)).collect(),
        vec![max; RANKS],
    ]
}

/// Runs one call of `workloads` and checks every rank's output; with `timed`, also times
/// every phase and checks the output the timed calls left.
fn check_call(
    session: &Session,
    built: &BuiltLayer,
    pipeline: &mut NcclPipeline,
    workloads: &[Workload],
    label: &str,
    seed: u64,
    timed: bool,
) {
    let shape = built.layer.plan().shape.clone();
    let ids: Vec<&[i32]> = workloads.iter().map(|w| &w.topk_ids[..]).collect();
    pipeline.set_routing(&ids).expect("routing");
    let mut inputs: Vec<DeviceWorkload> = workloads
        .iter()
        .enumerate()
        .map(|(r, w)| upload_poisoned(pipeline.stream(r), &shape, w))
        .collect::<Result<_, _>>()
        .expect("upload");
    let mut args: Vec<ForwardArgs<'_>> = inputs.iter_mut().map(DeviceWorkload::args).collect();
    pipeline
        .forward(&mut args)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    pipeline
        .take_error()
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    if timed {
        for phase in [Phase::Call, Phase::Dispatch, Phase::Gemms, Phase::Combine] {
            let mut times = pipeline.time(phase, &mut args, 5).expect("timing");
            times.sort_by(f64::total_cmp);
            say(format!(
                "{label} {phase:?}: median {:.1} us of {} runs",
                times[times.len() / 2] * 1e6,
                times.len()
            ));
            assert!(times.iter().all(|&t| t > 0.0), "{phase:?}: {times:?}");
        }
        pipeline
            .take_error()
            .unwrap_or_else(|e| panic!("{label} after timing: {e}"));
    }
    drop(args);
    for (r, (io, workload)) in inputs.iter().zip(workloads).enumerate() {
        let y = pipeline.stream(r).clone_dtoh(&io.y).expect("download y");
        let report = session
            .check_output(built, workload, &y, CHECKED_TOKENS, seed)
            .expect("check");
        say(format!("{label} rank {r} T={}: {report}", workload.tokens));
        assert!(report.passed(), "{label} rank {r}: {report}");
    }
}

/// A call before any routing, and a call whose token counts differ from the routing's, are
/// typed errors raised before anything is enqueued.
fn refuses_unrouted_calls(pipeline: &mut NcclPipeline, shape: &LayerShape) {
    let workloads: Vec<Workload> = (0..RANKS as u64)
        .map(|r| Workload::random(shape, 2, Routing::Uniform, r))
        .collect();
    let mut inputs: Vec<DeviceWorkload> = workloads
        .iter()
        .enumerate()
        .map(|(r, w)| upload_poisoned(pipeline.stream(r), shape, w))
        .collect::<Result<_, _>>()
        .expect("upload");
    let mut args: Vec<ForwardArgs<'_>> = inputs.iter_mut().map(DeviceWorkload::args).collect();
    let error = pipeline.forward(&mut args).expect_err("no routing yet");
    assert!(matches!(error, NcclPipelineError::NoRouting), "{error}");
    let one_token = &workloads[0].topk_ids[..shape.top_k as usize];
    pipeline.set_routing(&[one_token; RANKS]).expect("routing");
    let error = pipeline
        .forward(&mut args)
        .expect_err("2 tokens routed as 1");
    assert!(
        matches!(
            error,
            NcclPipelineError::RoutingMismatch {
                rank: 0,
                given: 2,
                routed: 1
            }
        ),
        "{error}"
    );
    say(format!("refused: {error}"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_gpus_match_reference() {
    if let Err(reason) = nccl_available() {
        say(format!("SKIPPED two_gpus_match_reference: {reason}"));
        return;
    }
    // NVLink multicast stays off on the project's machines; the pipeline refuses to start
    // without this setting.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: this binary's only test, before it starts any thread or NCCL.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let seed = fresh_seed();
    let session = Session::open().expect("GPU session");
    let second = match Gpu::open_context(1) {
        Ok(ctx) => ctx,
        Err(reason) => {
            say(format!("SKIPPED two_gpus_match_reference: {reason}"));
            return;
        }
    };
    say(format!(
        "NCCL pipeline on {RANKS} GPUs, seed {seed} (replay with MOEFORGE_SEED={seed})"
    ));
    let qwen = layers::examples()
        .into_iter()
        .find(|l| l.name == "qwen3_30b_a3b")
        .expect("the Qwen3-30B example");
    let contexts = [session.gpu.ctx.clone(), second];
    for layer in [
        layers::tiny(Activation::Swiglu),
        layers::tiny(Activation::Gelu),
        layers::scaled_down(&qwen),
    ] {
        let layer = on_one_gpu(&layer);
        let target = session.gpu.target().expect("the device's target");
        let plan = plan::plan(&layer, &target).unwrap_or_else(|e| panic!("{}: {e}", layer.name));
        let built = session.build(plan, seed).expect("build");
        let mut pipeline =
            NcclPipeline::new(&session, &built, &contexts).expect("the NCCL pipeline");
        let shape = built.layer.plan().shape.clone();
        refuses_unrouted_calls(&mut pipeline, &shape);
        for counts in token_counts(shape.max_tokens) {
            for routing in [Routing::Uniform, Routing::Skewed] {
                let workloads: Vec<Workload> = counts
                    .iter()
                    .enumerate()
                    .map(|(r, &t)| {
                        Workload::random(&shape, t, routing, seed ^ (u64::from(t) << 8) ^ r as u64)
                    })
                    .collect();
                let label = format!("{} T={counts:?} {routing:?}", layer.name);
                let timed = counts[0] == shape.max_tokens && routing == Routing::Uniform;
                check_call(
                    &session,
                    &built,
                    &mut pipeline,
                    &workloads,
                    &label,
                    seed,
                    timed,
                );
            }
        }
    }
}
