//! moeforge's compiler: turns an MoE layer description into a plan and CUDA source.
//!
//! The stages, each in its own module with a typed boundary:
//! - [`ir`]: the checked layer (the checker's output, every later stage's input).
pub mod ir;
