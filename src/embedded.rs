//! Layers embedded in a binary by [`#[moe_layer]`](crate::moe_layer): what the macro's
//! expansion refers to at run time.
//!
//! The macro plans the layer at compile time and writes a function returning a
//! `&'static SpecLayer<H, K>` holding the plan (JSON), the generated CUDA source and, when
//! NVRTC was available to the build, the PTX compiled from it. At run time:
//!
//! - [`SpecLayer::plan`] parses and validates the embedded plan once (thread safe,
//!   `OnceLock`); [`SpecLayer::shape`] gives the layer's constants without any parsing.
//! - [`SpecLayer::kernels`] gives the compiled module once: the embedded PTX after checking
//!   every entry point the plan launches against it ([`aot::check_ptx_entries`], the check
//!   AOT directories get), so no NVRTC or toolkit is needed; or, when the build had no
//!   NVRTC, the source compiled through NVRTC at first use, said once on stderr.
//! - [`SpecLayer::build`] loads the kernels on a GPU with the caller's expert weights and
//!   returns a [`Layer<H, K>`], whose `forward` takes [`Tokens<H>`] and [`Routing<K>`]:
//!   device buffers whose row widths the layer's type fixes, so that passing one layer's
//!   activations to a layer of another hidden size does not compile.
//!
//! The GPU work is the runtime's [`MoeLayer`]; nothing here re-derives a plan decision.

use std::sync::{Arc, Once, OnceLock};

use cudarc::driver::{CudaSlice, CudaStream};
use moeforge_compiler::plan::{Plan, PlanInvalid};
use moeforge_runtime::aot;
use moeforge_runtime::gpu::{DriverContext, Gpu, GpuError, LoadedKernels};
use moeforge_runtime::harness::{BuiltLayer, HarnessError, Session};
use moeforge_runtime::jit::{CacheOutcome, CompiledModule, Jit, JitError};
use moeforge_runtime::layer::{ExpertWeights, ForwardArgs, LayerError, MoeLayer};
use thiserror::Error;

/// Why an embedded layer cannot be loaded, built or run.
#[derive(Debug, Error)]
pub enum EmbeddedError {
    #[error(
        "the plan embedded for layer `{layer}` cannot be read back ({source}); rebuild the crate with the same moeforge version"
    )]
    PlanJson {
        layer: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("the plan embedded for layer `{layer}` is invalid: {source}")]
    InvalidPlan {
        layer: &'static str,
        #[source]
        source: PlanInvalid,
    },
    #[error(
        "the plan embedded for layer `{layer}` has {what} = {planned}, but its handle's type says {typed}; rebuild the crate"
    )]
    TypeMismatch {
        layer: &'static str,
        what: &'static str,
        planned: u64,
        typed: u64,
    },
    #[error(
        "the PTX embedded for layer `{layer}`: entry point `{kernel}` {problem}; the PTX does not belong to this plan, rebuild the crate"
    )]
    PtxMismatch {
        layer: &'static str,
        kernel: String,
        problem: String,
    },
    #[error(
        "layer `{layer}` was built without NVRTC, so its kernels are compiled at first use, and that needs NVRTC: {source}"
    )]
    Jit {
        layer: &'static str,
        #[source]
        source: Box<JitError>,
    },
    #[error("{what} holds {got} elements but {tokens} tokens of width {width} need {needed}")]
    BufferTooSmall {
        what: &'static str,
        tokens: u32,
        width: usize,
        needed: u64,
        got: usize,
    },
    #[error("x has {x} tokens, routing {routing}, y {y}: one forward call takes one token count")]
    TokenCounts { x: u32, routing: u32, y: u32 },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Harness(Box<HarnessError>),
}

impl From<HarnessError> for EmbeddedError {
    fn from(error: HarnessError) -> Self {
        EmbeddedError::Harness(Box::new(error))
    }
}

/// The sizes the layer's kernels are specialised to, as the planner fixed them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub hidden: u32,
    pub ffn: u32,
    pub experts: u32,
    pub top_k: u32,
    pub max_tokens: u32,
    /// The shared experts as always-hit experts of FFN `ffn`: the weights hold
    /// `experts + shared_slices` experts, these last.
    pub shared_slices: u32,
    /// Rows of W1 per expert: 2 × ffn for gated activations, ffn otherwise.
    pub w1_rows: u32,
}

/// What the macro embeds: everything a deployed binary needs to run the layer.
pub struct Artifacts {
    /// The layer's name in the spec.
    pub layer: &'static str,
    /// Where the spec came from (a `.moe` path, or the Rust file of an inline spec).
    pub spec: &'static str,
    /// The name of the target the plan was made for.
    pub target: &'static str,
    pub shape: Shape,
    /// The plan, serialised with serde_json.
    pub plan_json: &'static str,
    /// The CUDA unit generated from the plan.
    pub source: &'static str,
    /// PTX compiled from `source` at build time, when NVRTC was available there.
    pub ptx: Option<&'static str>,
}

/// How a layer's kernels were obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// The PTX embedded at build time, checked against the plan; no NVRTC involved.
    Embedded,
    /// The embedded source, compiled through NVRTC at first use.
    CompiledAtFirstUse,
}

/// A compiled module and how it was obtained.
pub struct Kernels {
    pub module: CompiledModule,
    pub origin: KernelOrigin,
}

/// The handle `#[moe_layer]` functions return: a layer planned at compile time whose
/// activations have `H` columns and whose routing has `K` experts per token. Built lazily
/// and thread safe: the plan and the kernels are made once, on first use.
pub struct SpecLayer<const H: usize, const K: usize> {
    artifacts: Artifacts,
    plan: OnceLock<Plan>,
    kernels: OnceLock<Kernels>,
    first_use_note: Once,
}

impl<const H: usize, const K: usize> SpecLayer<H, K> {
    /// The hidden size: the width of `x` and `y` rows.
    pub const HIDDEN: usize = H;
    /// Experts per token: the width of `topk_ids` and `topk_weights` rows.
    pub const TOP_K: usize = K;

    /// The handle of `artifacts` (what the macro writes into a `static`).
    pub const fn new(artifacts: Artifacts) -> Self {
        SpecLayer {
            artifacts,
            plan: OnceLock::new(),
            kernels: OnceLock::new(),
            first_use_note: Once::new(),
        }
    }

    /// The layer's name in the spec.
    pub fn name(&self) -> &'static str {
        self.artifacts.layer
    }

    /// Where the spec came from.
    pub fn spec(&self) -> &'static str {
        self.artifacts.spec
    }

    /// The name of the target the plan was made for (e.g. `NVIDIA H200`).
    pub fn target_name(&self) -> &'static str {
        self.artifacts.target
    }

    /// The layer's sizes, available without parsing anything.
    pub fn shape(&self) -> &Shape {
        &self.artifacts.shape
    }

    /// The generated CUDA source.
    pub fn source(&self) -> &'static str {
        self.artifacts.source
    }

    /// The PTX compiled at build time, if NVRTC was available there.
    pub fn ptx(&self) -> Option<&'static str> {
        self.artifacts.ptx
    }

    /// The plan, parsed from the embedded JSON and validated on first use.
    pub fn plan(&self) -> Result<&Plan, EmbeddedError> {
        if let Some(plan) = self.plan.get() {
            return Ok(plan);
        }
        let layer = self.artifacts.layer;
        let plan: Plan = serde_json::from_str(self.artifacts.plan_json)
            .map_err(|source| EmbeddedError::PlanJson { layer, source })?;
        plan.validate()
            .map_err(|source| EmbeddedError::InvalidPlan { layer, source })?;
        let shape = &plan.shape;
        for (what, planned, typed) in [
            ("hidden", shape.hidden, H),
            ("top_k", shape.top_k, K),
            ("ffn", shape.ffn, self.artifacts.shape.ffn as usize),
            (
                "experts",
                shape.experts,
                self.artifacts.shape.experts as usize,
            ),
            (
                "max_tokens",
                shape.max_tokens,
                self.artifacts.shape.max_tokens as usize,
            ),
        ] {
            if planned as usize != typed {
                return Err(EmbeddedError::TypeMismatch {
                    layer,
                    what,
                    planned: u64::from(planned),
                    typed: typed as u64,
                });
            }
        }
        // Two threads may both get here; they parse the same text, so either copy is right.
        Ok(self.plan.get_or_init(|| plan))
    }

    /// The compiled kernels, made on first use: the embedded PTX, checked against the plan,
    /// or (when the build had no NVRTC) the source compiled through NVRTC, said once on
    /// stderr.
    pub fn kernels(&self) -> Result<&Kernels, EmbeddedError> {
        if let Some(kernels) = self.kernels.get() {
            return Ok(kernels);
        }
        let plan = self.plan()?;
        let layer = self.artifacts.layer;
        let kernels = match self.artifacts.ptx {
            Some(ptx) => {
                aot::check_ptx_entries(plan, ptx).map_err(|(kernel, problem)| {
                    EmbeddedError::PtxMismatch {
                        layer,
                        kernel,
                        problem,
                    }
                })?;
                Kernels {
                    module: CompiledModule {
                        name: plan.symbol.clone(),
                        arch: plan.target.arch.clone(),
                        ptx: ptx.to_string(),
                        cubin: None,
                        log: String::new(),
                        key: String::new(),
                        cache: CacheOutcome::Disabled,
                        notes: Vec::new(),
                    },
                    origin: KernelOrigin::Embedded,
                }
            }
            None => {
                self.first_use_note.call_once(|| {
                    eprintln!(
                        "moeforge: layer `{layer}` was built without NVRTC; compiling its kernels now (build with NVRTC available to embed them)"
                    );
                });
                let jit = Jit::from_env().map_err(|source| EmbeddedError::Jit {
                    layer,
                    source: Box::new(source),
                })?;
                let module = jit
                    .compile(self.artifacts.source, &aot::compile_options(plan))
                    .map_err(|source| EmbeddedError::Jit {
                        layer,
                        source: Box::new(source),
                    })?;
                Kernels {
                    module,
                    origin: KernelOrigin::CompiledAtFirstUse,
                }
            }
        };
        // As for the plan: a thread that compiled the same module meanwhile may have won.
        Ok(self.kernels.get_or_init(|| kernels))
    }

    /// The layer on `gpu` with the caller's expert weights (checkpoint layout, see
    /// [`ExpertWeights`]); refuses a GPU of another kind than the plan's target.
    pub fn build(&self, gpu: &Gpu, weights: ExpertWeights) -> Result<Layer<H, K>, EmbeddedError> {
        let module = LoadedKernels::whole(gpu.load(&self.kernels()?.module)?);
        let layer = MoeLayer::new(gpu, self.plan()?.clone(), module, weights)?;
        Ok(Layer { inner: layer })
    }

    /// The layer with random weights (seeded) in a test harness session, ready for
    /// [`Session::run_checked`] against the CPU reference.
    pub fn build_random(&self, session: &Session, seed: u64) -> Result<BuiltLayer, EmbeddedError> {
        let module = self.kernels()?.module.clone();
        Ok(session.build_compiled(self.plan()?.clone(), module, seed)?)
    }
}

/// A built layer whose activations are `H` wide and whose routing is `K` wide.
pub struct Layer<const H: usize, const K: usize> {
    inner: MoeLayer,
}

impl<const H: usize, const K: usize> Layer<H, K> {
    /// Enqueues one forward call, `y = layer(x, routing)`, on the layer's stream; does not
    /// synchronise (see [`MoeLayer::forward`]). Every buffer must hold the same token
    /// count; kernel-side errors are read by [`Layer::take_error`].
    pub fn forward(
        &self,
        x: &Tokens<H>,
        routing: &Routing<K>,
        y: &mut Tokens<H>,
    ) -> Result<(), EmbeddedError> {
        if x.tokens != routing.tokens || y.tokens != x.tokens {
            return Err(EmbeddedError::TokenCounts {
                x: x.tokens,
                routing: routing.tokens,
                y: y.tokens,
            });
        }
        self.inner.forward(ForwardArgs {
            tokens: x.tokens,
            x: &x.data,
            topk_ids: &routing.ids,
            topk_weights: &routing.weights,
            y: &mut y.data,
        })?;
        Ok(())
    }

    /// Synchronises and reports an error the kernels recorded (see [`MoeLayer::take_error`]).
    pub fn take_error(&self) -> Result<(), EmbeddedError> {
        Ok(self.inner.take_error()?)
    }

    /// The runtime's layer handle underneath.
    pub fn inner(&self) -> &MoeLayer {
        &self.inner
    }
}

fn check_len(
    what: &'static str,
    got: usize,
    tokens: u32,
    width: usize,
) -> Result<(), EmbeddedError> {
    let needed = u64::from(tokens) * width as u64;
    if (got as u64) < needed {
        return Err(EmbeddedError::BufferTooSmall {
            what,
            tokens,
            width,
            needed,
            got,
        });
    }
    Ok(())
}

/// Token rows of width `H` on the device, bf16 (as `u16` bits), row-major: `x` or `y`.
pub struct Tokens<const H: usize> {
    tokens: u32,
    data: CudaSlice<u16>,
}

impl<const H: usize> Tokens<H> {
    /// `tokens` rows held in `data`, which must hold at least `tokens × H` elements.
    pub fn new(data: CudaSlice<u16>, tokens: u32) -> Result<Self, EmbeddedError> {
        check_len("the token buffer", data.len(), tokens, H)?;
        Ok(Tokens { tokens, data })
    }

    /// `tokens` rows of zeros on `stream` (one element at least: the driver allocates no
    /// empty buffer).
    pub fn zeros(stream: &Arc<CudaStream>, tokens: u32) -> Result<Self, EmbeddedError> {
        let len = (tokens as usize * H).max(1);
        let data = stream
            .alloc_zeros::<u16>(len)
            .context(format!("allocating {tokens} token rows"))?;
        Ok(Tokens { tokens, data })
    }

    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    pub fn data(&self) -> &CudaSlice<u16> {
        &self.data
    }

    pub fn into_data(self) -> CudaSlice<u16> {
        self.data
    }
}

/// The router's choice for each token, on the device: `K` expert ids (i32) and `K` weights
/// (f32) per token, row-major.
pub struct Routing<const K: usize> {
    tokens: u32,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
}

impl<const K: usize> Routing<K> {
    /// `tokens` rows of ids and weights, each buffer holding at least `tokens × K`.
    pub fn new(
        ids: CudaSlice<i32>,
        weights: CudaSlice<f32>,
        tokens: u32,
    ) -> Result<Self, EmbeddedError> {
        check_len("topk_ids", ids.len(), tokens, K)?;
        check_len("topk_weights", weights.len(), tokens, K)?;
        Ok(Routing {
            tokens,
            ids,
            weights,
        })
    }

    pub fn tokens(&self) -> u32 {
        self.tokens
    }
}
