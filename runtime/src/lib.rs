//! moeforge's runtime: finds the CUDA toolkit, compiles generated kernels through NVRTC
//! (or loads them ahead-of-time compiled), owns device buffers and launches a layer.

pub mod aot;
pub mod baseline;
pub mod bench;
pub mod bf16;
pub mod call_file;
mod call_graphs;
pub mod checkpoint;
pub mod ep;
pub mod gpu;
pub mod harness;
pub mod ipc;
pub mod jit;
pub mod layer;
mod loopback;
pub mod nccl_pipeline;
pub mod network;
pub mod peers;
pub mod process_group;
pub mod reference;
mod tensor_map;
pub mod toolkit;
pub mod tune;
pub mod weights;
pub mod workload;

/// An environment variable's value as the runtime's settings read it: `None` when it is
/// unset. A value that is not UTF-8 comes back converted lossily (U+FFFD for the bad
/// bytes), so that the setting's parser refuses it by name rather than taking it for unset.
pub fn env_value(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}
