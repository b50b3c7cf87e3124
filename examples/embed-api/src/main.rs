//! An inference engine's use of `moeforge::engine`, on the repository's tiny layer:
//!
//! 1. the layer from its spec file (`dsl-examples/tiny.moe`, or the file given as the first
//!    argument), planned for the GPU present or, without one, for the H200; its plan printed;
//! 2. random experts written as a Qwen3-MoE checkpoint's `model.layers.0.` in a temp folder
//!    (standing in for a model's files), then opened with the layer prefix and the family
//!    read off the tensor names, and every tensor checked against the layer's sizes;
//! 3. with a GPU: the layer built on a stream of the program's own, one forward call on
//!    device buffers the program allocated, `take_error`, and every output element
//!    compared with the CPU reference on the same weights. Without one it says so.
//!
//! `cargo run -p embed-api` (add `--release` on a GPU machine).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use moeforge::compiler::plan::describe;
use moeforge::engine::{
    CheckpointLayer, ExpertSet, Family, ForwardArgs, Gpu, HostWeights, LayerSpec, MoeLayer, Target,
    Weights,
};
use moeforge::runtime::checkpoint::write_experts;
use moeforge::runtime::reference;
use moeforge::runtime::weights;
use moeforge::runtime::workload::{Routing, Workload};

/// Tokens of the forward call: odd, so that the last row tile is ragged.
const TOKENS: u32 = 100;

fn main() -> ExitCode {
    let spec_path = std::env::args_os().nth(1).map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dsl-examples/tiny.moe"),
        PathBuf::from,
    );
    let checkpoint_dir =
        std::env::temp_dir().join(format!("moeforge-embed-api-{}", std::process::id()));
    let result = run(&spec_path, &checkpoint_dir);
    // The folder may not exist when the run stopped before writing it.
    let _ = std::fs::remove_dir_all(&checkpoint_dir);
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The three steps; `Ok(false)` when the output disagrees with the reference.
fn run(spec_path: &Path, checkpoint_dir: &Path) -> Result<bool, Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0);
    let target = match &gpu {
        Ok(gpu) => gpu.target()?,
        Err(error) => {
            println!("no GPU here ({error}); planning for the H200");
            Target::h200()
        }
    };
    let spec = LayerSpec::from_file(spec_path, None, &target)?;
    println!("{}", describe(spec.plan()));

    let shape = spec.shape();
    std::fs::create_dir_all(checkpoint_dir)?;
    let file = checkpoint_dir.join("model.safetensors");
    let written = weights::random(shape, 0..shape.experts, 1);
    write_experts(&file, Family::Qwen3Moe, "model.layers.0.", shape, &written)?;
    let layer = CheckpointLayer::open(&file, None, None)?;
    println!("checkpoint: {layer}");
    let weights = Weights::Checkpoint(layer);
    let host = weights.host(shape, ExpertSet::All)?;
    println!(
        "its {} experts match the layer (W1 {} and W2 {} bf16 values)",
        host.experts.len(),
        host.w1.len(),
        host.w2.len()
    );

    let Ok(gpu) = gpu else {
        println!("not running the layer: no GPU");
        return Ok(true);
    };
    // The engine's own stream: the layer's launches are ordered with its other work there.
    let engine = Gpu::with_stream(gpu.ctx.new_stream()?);
    let moe = spec.build(&engine, &weights)?;
    forward_and_check(&engine, &moe, &host)
}

/// One forward call on buffers the program owns, checked against the CPU reference.
fn forward_and_check(
    gpu: &Gpu,
    moe: &MoeLayer,
    host: &HostWeights,
) -> Result<bool, Box<dyn std::error::Error>> {
    let shape = &moe.plan().shape;
    let workload = Workload::random(shape, TOKENS, Routing::Uniform, 2);
    let stream = Arc::clone(&gpu.stream);
    let x = stream.clone_htod(&workload.x)?;
    let topk_ids = stream.clone_htod(&workload.topk_ids)?;
    let topk_weights = stream.clone_htod(&workload.topk_weights)?;
    let mut y = stream.alloc_zeros::<u16>(TOKENS as usize * shape.hidden as usize)?;
    moe.forward(ForwardArgs {
        tokens: TOKENS,
        x: &x,
        topk_ids: &topk_ids,
        topk_weights: &topk_weights,
        y: &mut y,
    })?;
    moe.take_error()?;
    let y = stream.clone_dtoh(&y)?;

    let want = reference::layer_output(shape, &workload, (0..TOKENS as usize).collect(), |e| {
        host.expert(shape, e)
    });
    let comparison = reference::compare(&y, &want);
    let passed = comparison.out_of_bound == 0;
    println!(
        "{} T={TOKENS} on {}: {} of {} elements out of bound: {}",
        moe.plan().layer,
        gpu.name(),
        comparison.out_of_bound,
        comparison.elements,
        if passed { "PASS" } else { "FAIL" }
    );
    Ok(passed)
}
