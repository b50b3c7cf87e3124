//! Layers built in code, for tests that exercise the planner and codegen without the front end.
#![allow(dead_code)]

use moeforge_compiler::ir::*;

pub fn topology() -> Topology {
    Topology {
        name: "h200_node".into(),
        gpus_per_node: 8,
        nodes: 1,
        intra_node: Link {
            bandwidth_bytes_per_s: 450_000_000_000,
            latency_ns: 3_000,
        },
        network: Link {
            bandwidth_bytes_per_s: 50_000_000_000,
            latency_ns: 10_000,
        },
        virtual_ranks: None,
    }
}

pub fn layer(
    name: &str,
    hidden: u32,
    ffn: u32,
    experts: u32,
    top_k: u32,
    activation: Activation,
    max_tokens: u32,
) -> Layer {
    Layer {
        name: name.into(),
        hidden,
        ffn,
        experts,
        top_k,
        activation,
        expert_bias: false,
        dtype: DType::Bf16,
        weight_dtype: DType::Bf16,
        max_tokens,
        shared_experts: None,
        router: None,
        // As many ranks as the checker allows: the most of 8, 4, 2, 1 that divides E.
        parallel: Parallelism {
            expert: ranks(experts),
            data: 1,
            tensor: 1,
        },
        topology: Topology {
            gpus_per_node: ranks(experts),
            ..topology()
        },
        schedule: ScheduleHints::default(),
    }
}

/// Expert-parallel ranks of a generated layer with `experts` experts.
fn ranks(experts: u32) -> u32 {
    [8, 4, 2, 1]
        .into_iter()
        .find(|r| experts.is_multiple_of(*r))
        .unwrap_or(1)
}

/// The real models' routed-expert shapes.
pub fn real_layers() -> Vec<Layer> {
    vec![
        layer("mixtral_8x7b", 4096, 14336, 8, 2, Activation::Swiglu, 16384),
        layer(
            "qwen3_30b_a3b",
            2048,
            768,
            128,
            8,
            Activation::Swiglu,
            16384,
        ),
        layer("deepseek_v3", 7168, 2048, 256, 8, Activation::Swiglu, 16384),
        layer(
            "gpt_oss_120b",
            2880,
            2880,
            128,
            4,
            Activation::Swiglu,
            16384,
        ),
    ]
}
