//! moeforge's compiler: turns an MoE layer description into a plan and CUDA source.
//!
//! The stages, each in its own module with a typed boundary:
//! - [`ir`]: the checked layer (the checker's output, every later stage's input).
//! - [`plan`]: tiles, regimes, buffers and the launch table, chosen by a cost model.
//! - [`codegen`]: the plan written out as one CUDA C++ unit.
pub mod codegen;
pub mod ir;
pub mod plan;
