//! moeforge: a compiler for Mixture-of-Experts layers. This facade re-exports the compiler
//! and the runtime so that a user needs one dependency.
pub use moeforge_compiler as compiler;
pub use moeforge_runtime as runtime;
