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
