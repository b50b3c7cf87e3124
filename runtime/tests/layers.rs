//! Layers for the GPU tests: every shipped example (dsl-examples/), and tiny layers built in
//! code for the activations no example uses.
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
