//! Embedding moeforge in an inference engine: build a layer from its spec and its weights,
//! then call it on device buffers the engine owns, on the engine's stream.
//!
//! 1. A [`LayerSpec`] is one layer of a `.moe` spec, checked and planned for a target:
//!    from text ([`LayerSpec::from_text`]), a file ([`LayerSpec::from_file`]) or a
//!    directory written by `moeforge compile` ([`LayerSpec::from_compiled`], which needs
//!    no NVRTC at run time).
//! 2. [`Weights`] says where the routed experts' weights come from: random (seeded),
//!    host buffers the engine holds in the kernels' layout ([`HostWeights`]), or one layer
//!    of a safetensors checkpoint ([`CheckpointLayer::open`]: Mixtral, Qwen3-MoE,
//!    Qwen2-MoE, DeepSeek-V3 or GPT-OSS tensor names, the layer picked by its prefix such
//!    as `model.layers.3.`; bf16, or FP8 and MXFP4 as the published releases store them,
//!    dequantized on loading).
//! 3. [`LayerSpec::build`] compiles the kernels (NVRTC, kernel by kernel on every core,
//!    through the disk cache; once per spec), loads them on a [`Gpu`], uploads the
//!    weights and returns the runtime's [`MoeLayer`]. [`Gpu::with_stream`] wraps the
//!    engine's own stream, so that the layer's launches are ordered with the engine's
//!    work; [`Gpu::open`] makes a new one.
//! 4. [`MoeLayer::forward`] takes [`ForwardArgs`]: `x` [T, H] bf16, `topk_ids` [T, K] i32,
//!    `topk_weights` [T, K] f32 and `y` [T, H] bf16, device buffers the engine allocated
//!    on the layer's device. It enqueues the plan's launches and returns without
//!    synchronising (a call can be captured in a CUDA graph). [`MoeLayer::take_error`]
//!    synchronises the stream and reports what the kernels recorded (an expert id out of
//!    range, naming the token) as a typed [`LayerError`].
//!
//! [`LayerSpec::build_expert_parallel`] builds the expert-parallel layer of a spec with
//! several ranks instead ([`EpLayer`]: one context per rank, the same one repeated for
//! virtual ranks on one GPU), each rank loading only its own experts; its ranks run on
//! streams of their own ([`EpLayer::stream`]).
//!
//! ```no_run
//! use std::path::Path;
//!
//! use moeforge::engine::{CheckpointLayer, CudaContext, ForwardArgs, Gpu, LayerSpec, Weights};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let stream = CudaContext::new(0)?.new_stream()?; // the engine's stream
//! let gpu = Gpu::with_stream(stream.clone());
//! let spec = LayerSpec::from_file("dsl-examples/tiny.moe", None, &gpu.target()?)?;
//! // The experts of the checkpoint's only MoE layer; its family read off the tensor names.
//! let weights = Weights::Checkpoint(CheckpointLayer::open(Path::new("tiny.safetensors"), None, None)?);
//! let layer = spec.build(&gpu, &weights)?;
//!
//! let (tokens, hidden, top_k) = (16, spec.shape().hidden as usize, spec.shape().top_k as usize);
//! let x = stream.alloc_zeros::<u16>(tokens * hidden)?; // bf16 bits
//! let topk_ids = stream.clone_htod(&vec![0i32; tokens * top_k])?;
//! let topk_weights = stream.clone_htod(&vec![0.5f32; tokens * top_k])?;
//! let mut y = stream.alloc_zeros::<u16>(tokens * hidden)?;
//! layer.forward(ForwardArgs {
//!     tokens: tokens as u32,
//!     x: &x,
//!     topk_ids: &topk_ids,
//!     topk_weights: &topk_weights,
//!     y: &mut y,
//! })?;
//! layer.take_error()?; // synchronises
//! # Ok(())
//! # }
//! ```
//!
//! Everything here is the runtime's ([`moeforge_runtime`]); this module picks the layer,
//! chains the steps and re-exports what an engine names.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use moeforge_compiler::codegen::{self, CodegenError};
use moeforge_compiler::{Diagnostics, compile_bytes_for, plan_diagnostics};
use moeforge_runtime::aot::{self, AotError};
use moeforge_runtime::jit::{CompiledKernels, Jit, JitError};
use moeforge_runtime::weights::{upload, upload_gate, upload_parts};
use thiserror::Error;

pub use moeforge_compiler::plan::{LayerShape, Plan, Target};
pub use moeforge_runtime::checkpoint::{
    Checkpoint, CheckpointError, CheckpointLayer, ExpertSet, Family, HostWeights,
};
pub use moeforge_runtime::ep::EpLayer;
pub use moeforge_runtime::gpu::{CudaContext, Gpu, GpuError, LoadedKernels};
pub use moeforge_runtime::layer::{ExpertWeights, ForwardArgs, LayerError, MoeLayer};
pub use moeforge_runtime::weights::Weights;

/// Why a layer cannot be specified, built or run.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The spec does not check, or the planner refused the layer: every error rendered
    /// with file, line, column, caret and hint, as `moeforge check` prints them.
    #[error("{0}")]
    Spec(Box<Diagnostics>),
    #[error("{spec} has no layer `{wanted}` (it has: {})", available.join(", "))]
    NoSuchLayer {
        spec: String,
        wanted: String,
        available: Vec<String>,
    },
    #[error("{spec} defines no layer")]
    NoLayer { spec: String },
    #[error("{spec} has {} layers; name one ({})", available.len(), available.join(", "))]
    SeveralLayers {
        spec: String,
        available: Vec<String>,
    },
    #[error(transparent)]
    Tuning(#[from] crate::tuning::TuningError),
    #[error(transparent)]
    Compiled(#[from] AotError),
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    #[error(transparent)]
    Jit(Box<JitError>),
    #[error(transparent)]
    Weights(#[from] CheckpointError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Layer(#[from] LayerError),
}

impl From<JitError> for EngineError {
    fn from(error: JitError) -> Self {
        EngineError::Jit(Box::new(error))
    }
}

/// One layer of a spec, checked and planned for a target, and its kernels once compiled.
pub struct LayerSpec {
    plan: Plan,
    kernels: OnceLock<CompiledKernels>,
}

impl LayerSpec {
    /// Checks the spec `text` (`name` is the file name its diagnostics show) and plans
    /// its layer `layer` (needed when it defines several) for `target`; use
    /// [`Gpu::target`] for the GPU at hand, or [`Target::h200`] and its siblings.
    pub fn from_text(
        name: &str,
        text: &str,
        layer: Option<&str>,
        target: &Target,
    ) -> Result<Self, EngineError> {
        Self::plan_bytes(name, text.as_bytes(), layer, target)
    }

    /// [`LayerSpec::from_text`] for the `.moe` file at `path`.
    pub fn from_file(
        path: impl AsRef<Path>,
        layer: Option<&str>,
        target: &Target,
    ) -> Result<Self, EngineError> {
        let name = path.as_ref().display().to_string();
        let bytes = std::fs::read(path.as_ref()).map_err(|source| EngineError::Read {
            path: name.clone(),
            source,
        })?;
        Self::plan_bytes(&name, &bytes, layer, target)
    }

    /// Layer `layer` (needed when there are several) of a directory `moeforge compile`
    /// wrote: its plan and PTX, checked against each other (see [`aot::load_layer`]), so
    /// that building needs no NVRTC. The plan's target is the one it was compiled for.
    pub fn from_compiled(dir: impl AsRef<Path>, layer: Option<&str>) -> Result<Self, EngineError> {
        let (plan, module) = aot::load_layer(dir.as_ref(), layer)?;
        Ok(LayerSpec {
            plan,
            kernels: OnceLock::from(CompiledKernels::whole(module)),
        })
    }

    fn plan_bytes(
        name: &str,
        bytes: &[u8],
        layer: Option<&str>,
        target: &Target,
    ) -> Result<Self, EngineError> {
        let module =
            compile_bytes_for(name, bytes, target).map_err(|d| EngineError::Spec(Box::new(d)))?;
        let available: Vec<String> = module.layers.iter().map(|l| l.name.clone()).collect();
        let chosen = match layer {
            Some(wanted) => module
                .layers
                .iter()
                .find(|l| l.name == wanted)
                .ok_or_else(|| EngineError::NoSuchLayer {
                    spec: name.to_owned(),
                    wanted: wanted.to_owned(),
                    available: available.clone(),
                })?,
            None => match module.layers.as_slice() {
                [only] => only,
                [] => {
                    return Err(EngineError::NoLayer {
                        spec: name.to_owned(),
                    });
                }
                _ => {
                    return Err(EngineError::SeveralLayers {
                        spec: name.to_owned(),
                        available,
                    });
                }
            },
        };
        // The shipped tuning entries, not the user's cache: a program embedding moeforge
        // plans the same on every machine of the same GPU.
        let tuning = crate::tuning::shipped()?;
        let plan =
            moeforge_compiler::plan::plan_tuned(chosen, target, &tuning).map_err(|error| {
                let text = String::from_utf8_lossy(bytes);
                EngineError::Spec(Box::new(plan_diagnostics(
                    name, &text, chosen, target, &error,
                )))
            })?;
        Ok(LayerSpec {
            plan,
            kernels: OnceLock::new(),
        })
    }

    /// The plan: tiles, regimes, buffers and launches (`moeforge::compiler::plan::describe`
    /// prints it as `moeforge explain` does).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The layer's sizes: H, F, E, K, the activation, max tokens per call and ranks.
    pub fn shape(&self) -> &LayerShape {
        &self.plan.shape
    }

    /// The compiled kernels: the one module of a `moeforge compile` directory, or the
    /// generated source compiled through NVRTC (found as `docs/runtime.md` says, with its
    /// disk cache) kernel by kernel on every core on first use, and kept.
    pub fn kernels(&self) -> Result<&CompiledKernels, EngineError> {
        if let Some(kernels) = self.kernels.get() {
            return Ok(kernels);
        }
        let source = codegen::generate(&self.plan)?;
        let kernels = Jit::from_env()?.compile_kernels(
            &source.source,
            &self.plan.entry_points_in_compile_order(),
            &aot::compile_options(&self.plan),
        )?;
        // Two threads may both compile; the modules are the same, so either is right.
        Ok(self.kernels.get_or_init(|| kernels))
    }

    /// The single-GPU layer on `gpu`, every expert there, launching on `gpu.stream`:
    /// refuses a GPU of another kind than the plan's target (before compiling), reads
    /// `weights` on the host (a checkpoint's every tensor checked: name, shape, dtype),
    /// uploads them and builds the handle. A spec with several ranks runs all its experts
    /// on this one GPU. When the spec has a router, its gate comes from `weights` too
    /// (drawn, or the checkpoint's gate tensors), so that the layer can route itself
    /// ([`MoeLayer::forward_routed`]); [`Weights::Host`] holds experts only, and such a
    /// layer runs caller-routed calls.
    pub fn build(&self, gpu: &Gpu, weights: &Weights) -> Result<MoeLayer, EngineError> {
        gpu.check_target(&self.plan.target)?;
        let host = weights.host(&self.plan.shape, ExpertSet::All)?;
        let gate = match &self.plan.router {
            Some(router) => weights.gate(&self.plan.shape, &router.rule)?,
            None => None,
        };
        let module = gpu.load_kernels(self.kernels()?, &self.plan.single_gpu_entry_points())?;
        let experts = upload(&gpu.stream, &host)?;
        drop(host);
        let gate = gate
            .map(|gate| upload_gate(&gpu.stream, &gate))
            .transpose()?;
        Ok(MoeLayer::with_gate(
            gpu,
            self.plan.clone(),
            module,
            experts,
            gate,
        )?)
    }

    /// The expert-parallel layer over the spec's R ranks: rank `r` on `contexts[r]` (R
    /// contexts; the same one R times for virtual ranks on one GPU) with only its `E / R`
    /// experts, read from `weights` for that rank alone ([`ExpertSet::Rank`]). Its
    /// [`EpLayer::forward`] takes each rank's [`ForwardArgs`] on that rank's device;
    /// [`EpLayer::take_error`] reports the first rank's kernel error. When the spec has a
    /// router, every rank gets its gate from `weights` too, so that the calls can route
    /// themselves ([`EpLayer::forward_routed`]), as [`LayerSpec::build`] says.
    pub fn build_expert_parallel(
        &self,
        contexts: &[Arc<CudaContext>],
        weights: &Weights,
    ) -> Result<EpLayer, EngineError> {
        let ranks = self
            .plan
            .expert_parallel
            .as_ref()
            .ok_or(LayerError::NotExpertParallel)?
            .ranks;
        if contexts.len() != ranks as usize {
            return Err(LayerError::RankCount {
                ranks,
                given: contexts.len(),
            }
            .into());
        }
        let kernels = self.kernels()?;
        let entry_points = self.plan.expert_parallel_entry_points();
        let mut modules = Vec::with_capacity(contexts.len());
        let mut experts = Vec::with_capacity(contexts.len());
        for (rank, ctx) in (0..ranks).zip(contexts) {
            let stream = ctx.default_stream();
            Gpu::with_stream(Arc::clone(&stream)).check_target(&self.plan.target)?;
            modules.push(Gpu::load_kernels_into(ctx, kernels, &entry_points)?);
            let parts = weights.rank_parts(&self.plan.shape, rank, ranks)?;
            experts.push(upload_parts(&stream, &parts)?);
        }
        let gate = match &self.plan.router {
            Some(router) => weights.gate(&self.plan.shape, &router.rule)?,
            None => None,
        };
        let layer = EpLayer::new(self.plan.clone(), contexts, modules, experts)?;
        let Some(gate) = gate else {
            return Ok(layer);
        };
        let gates = contexts
            .iter()
            .map(|ctx| upload_gate(&ctx.default_stream(), &gate))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(layer.with_router(gates)?)
    }
}
