//! moeforge's runtime: finds the CUDA toolkit, compiles generated kernels through NVRTC
//! (or loads them ahead-of-time compiled), owns device buffers and launches a layer.

pub mod jit;
pub mod toolkit;
