//! Layers for the GPU tests: every shipped example (dsl-examples/) and scaled-down copies of
//! them, and tiny layers built in code for the activations no example uses and for pinning
//! a GEMM engine with schedule hints.
// Shared by several test binaries, each of which uses part of it.
#![allow(dead_code)]

use moeforge_compiler::ir::*;

/// Every layer of every `.moe` file in dsl-examples/, in file-name order.
pub fn examples() -> Vec<Layer> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../dsl-examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("dsl-examples/ is readable")
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "moe"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).expect("example is readable");
            let name = path.display().to_string();
            match moeforge_compiler::compile_source(&name, &text) {
                Ok(module) => module.layers,
                Err(diagnostics) => panic!("{name} does not check:\n{}", diagnostics.render()),
            }
        })
        .collect()
}

/// Largest hidden size, FFN size and token count of [`scaled_down`] layers.
pub const SCALED_HIDDEN: u32 = 1024;
pub const SCALED_FFN: u32 = 512;
pub const SCALED_MAX_TOKENS: u32 = 4096;

/// `layer` with the same experts, top-K, activation and schedule hints, but hidden, FFN
/// and max_tokens brought under [`SCALED_HIDDEN`], [`SCALED_FFN`] and
/// [`SCALED_MAX_TOKENS`], so that its kernels and the CPU reference run in seconds.
/// Named `<name>_scaled` when anything changed.
pub fn scaled_down(layer: &Layer) -> Layer {
    let mut scaled = layer.clone();
    scaled.hidden = shrink(layer.hidden, SCALED_HIDDEN);
    scaled.ffn = shrink(layer.ffn, SCALED_FFN);
    scaled.max_tokens = layer.max_tokens.min(SCALED_MAX_TOKENS);
    // The shared experts keep their number of routed-FFN slices.
    if let Some(shared) = &mut scaled.shared_experts
        && shared.ffn.is_multiple_of(layer.ffn)
    {
        shared.ffn = shared.ffn / layer.ffn * scaled.ffn;
    }
    if scaled != *layer {
        scaled.name = format!("{}_scaled", layer.name);
    }
    scaled
}

/// `size` (a multiple of 64) divided by the smallest divisor of its count of 64-wide
/// blocks that brings it to at most `limit`: an odd block count (gpt-oss's 45 × 64) stays
/// odd, so that tile widths the full size cannot use stay out of the scaled plan too.
pub fn shrink(size: u32, limit: u32) -> u32 {
    assert_eq!(size % 64, 0, "layer sizes are multiples of 64");
    let blocks = size / 64;
    (1..=blocks)
        .filter(|d| blocks.is_multiple_of(*d))
        .map(|d| size / d)
        .find(|&s| s <= limit)
        .unwrap_or(64)
}

/// A small layer (H = 128, F = 256, 8 experts, top-2) with `activation`.
pub fn tiny(activation: Activation) -> Layer {
    let link = Link {
        bandwidth_bytes_per_s: 450_000_000_000,
        latency_ns: 3_000,
    };
    Layer {
        name: format!("tiny_{}", activation.name()),
        hidden: 128,
        ffn: 256,
        experts: 8,
        top_k: 2,
        activation,
        expert_bias: false,
        dtype: DType::Bf16,
        weight_dtype: DType::Bf16,
        max_tokens: 1000,
        shared_experts: None,
        router: None,
        parallel: Parallelism {
            expert: 1,
            data: 1,
            tensor: 1,
        },
        topology: Topology {
            name: "one_gpu".into(),
            gpus_per_node: 1,
            nodes: 1,
            intra_node: link,
            network: link,
            virtual_ranks: None,
        },
        schedule: ScheduleHints::default(),
    }
}

/// The tiny layer with one shared expert of FFN 2F: two always-hit slices beside the
/// routed experts.
pub fn tiny_with_shared_expert(activation: Activation) -> Layer {
    let mut layer = tiny(activation);
    layer.name = format!("tiny_shared_{}", activation.name());
    layer.shared_experts = Some(SharedExperts {
        count: 1,
        ffn: 2 * layer.ffn,
        gated: false,
    });
    layer
}

/// [`tiny_with_shared_expert`] with the shared expert gated (Qwen2-MoE's): each token's
/// shared slices weigh `sigmoid(x · w_gate)`, computed by a launch of its own.
pub fn tiny_with_gated_shared_expert(activation: Activation) -> Layer {
    let mut layer = tiny_with_shared_expert(activation);
    layer.name = format!("tiny_gated_shared_{}", activation.name());
    if let Some(shared) = &mut layer.shared_experts {
        shared.gated = true;
    }
    layer
}

/// A tiny layer with both GEMMs hinted to `tile` and `stages`, up to 4096 tokens (so that
/// each expert's rows span many tiles). The planner puts a hinted tile on wgmma where
/// that engine can take it, else on mma.sync; the tests assert which one it chose.
pub fn pinned(activation: Activation, tile: TileShape, stages: u32) -> Layer {
    let mut layer = tiny(activation);
    layer.name = format!(
        "pinned_{}_{}x{}x{}_s{stages}",
        activation.name(),
        tile.m,
        tile.n,
        tile.k
    );
    layer.max_tokens = 4096;
    layer.schedule = ScheduleHints {
        gemm1_tile: Some(tile),
        gemm2_tile: Some(tile),
        stages: Some(stages),
        ..ScheduleHints::default()
    };
    layer
}

/// A tiny gated layer with a shared expert whose FFN is wide enough (2560) that the planner
/// sorts x's rows for GEMM1 (`RowLoad::Tiles` on sorted x) on an H200 and on an H100 (whose
/// slower HBM makes the sort's copy dearer: it sorts from an FFN of about 1980 up, the
/// H200 from about 1380), on hinted 128-row tiles in cluster pairs, up to 4096 tokens.
pub fn sorted_rows() -> Layer {
    let mut layer = tiny_with_shared_expert(Activation::Swiglu);
    layer.name = "sorted_rows_swiglu".into();
    layer.ffn = 2560;
    layer.shared_experts = Some(SharedExperts {
        count: 1,
        ffn: layer.ffn,
        gated: false,
    });
    layer.max_tokens = 4096;
    let tile = TileShape {
        m: 128,
        n: 128,
        k: 64,
    };
    layer.schedule = ScheduleHints {
        gemm1_tile: Some(tile),
        gemm2_tile: Some(tile),
        stages: Some(4),
        ..ScheduleHints::default()
    };
    layer
}

/// Whether two plans run the same kernels on one GPU: the same shape (the spec's ranks
/// aside: all experts run on one GPU either way) and the same GEMMs in the same regimes.
pub fn same_single_gpu_kernels(
    a: &moeforge_compiler::plan::Plan,
    b: &moeforge_compiler::plan::Plan,
) -> bool {
    let mut shape = b.shape.clone();
    shape.spec_ranks = a.shape.spec_ranks;
    a.shape == shape
        && a.regimes.len() == b.regimes.len()
        && a.regimes.iter().zip(&b.regimes).all(|(x, y)| {
            (x.min_tokens, x.max_tokens, &x.gemm1, &x.gemm2)
                == (y.min_tokens, y.max_tokens, &y.gemm1, &y.gemm2)
        })
}
