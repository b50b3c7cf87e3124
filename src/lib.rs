//! moeforge: a compiler for Mixture-of-Experts layers. This facade re-exports the compiler
//! and the runtime so that a user needs one dependency, and gives two ways to run a layer
//! from a Rust program:
//!
//! - [`engine`]: a layer built at run time from a spec (text, file or `moeforge compile`
//!   directory) and weights (random, host buffers or a safetensors checkpoint), called on
//!   device buffers the program owns, on its stream;
//! - the [`moe_layer`] attribute macro, which plans a layer at compile time, with the
//!   run-time side of its expansion ([`embedded`]).
//!
//! [`tuning`] says where measured GEMM choices (`moeforge tune`) are kept and read.
pub mod embedded;
pub mod engine;
pub mod tuning;

pub use moeforge_compiler as compiler;
pub use moeforge_runtime as runtime;

/// Plans an MoE layer at compile time and turns the annotated function into one returning
/// its handle, `&'static moeforge::embedded::SpecLayer<H, K>` (H the hidden size, K the
/// experts per token).
///
/// The layer is written in the language of `.moe` files, either inline or in a file:
///
/// ```ignore
/// // The spec as a string literal (raw strings keep diagnostics' lines and columns exact).
/// #[moeforge::moe_layer(r#"
///     topology one_gpu { gpus_per_node = 1  intra_node = 450 GB/s, 3 us  network = 50 GB/s, 10 us }
///     layer small { hidden = 128  ffn = 256  experts = 8  top_k = 2  max_tokens = 512  topology = one_gpu }
/// "#)]
/// fn small() {}
///
/// // A file, relative to the crate's Cargo.toml; `layer` picks one of several layers,
/// // `target` plans for another GPU (h200, the default; h100; a100).
/// #[moeforge::moe_layer(file = "dsl-examples/mixtral_8x7b.moe", layer = "mixtral_8x7b", target = "h200")]
/// pub fn mixtral() {}
///
/// let layer = mixtral();
/// assert_eq!(layer.shape().hidden, 4096);
/// let plan = layer.plan()?; // parsed and validated once
/// ```
///
/// The function must be `fn name() {}` (any visibility and attributes): no parameters, no
/// return type, an empty body. At compile time the macro parses, checks and plans the layer
/// with the compiler crate, generates its CUDA unit and, when NVRTC is available to the
/// build (found as the runtime finds it: `CUDA_HOME`, `CUDA_PATH`, `MOEFORGE_NVRTC_WHEEL`,
/// `/usr/local/cuda`), compiles it to PTX. The expansion embeds the plan, the source
/// and the PTX, so a deployed binary needs neither the spec nor NVRTC; without NVRTC at
/// build time it embeds the source and compiles it at first use, saying so once on stderr.
/// A spec file is tracked (`include_bytes!`), so cargo rebuilds when it changes.
///
/// A mistake in the layer is a compile error with the message and hint `moeforge check`
/// gives: for a file, at the `file` argument, with the file's `path:line:column`; inline,
/// at the string literal, with the Rust file's line and column of the offending token
/// (rustc on stable cannot point inside a literal). The function is still emitted as
/// written, so IDEs keep working. See [`embedded`] for what the handle does at run time.
pub use moeforge_macros::moe_layer;
