//! moeforge's runtime: finds the CUDA toolkit, compiles generated kernels through NVRTC
//! (or loads them ahead-of-time compiled), owns device buffers and launches a layer.

pub mod jit;
pub mod toolkit;
pub mod bf16;
pub mod gpu;
pub mod layer;
pub mod reference;
pub mod workload;
pub mod harness;
pub mod baseline;
pub mod bench;
pub mod aot;
