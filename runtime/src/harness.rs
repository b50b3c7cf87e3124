//! Running a planned layer end to end: generate and JIT-compile its kernels, fill random
//! expert weights on the device, upload a workload, run `forward`, and compare every
//! output element with the CPU reference. Used by `moeforge run`, `moeforge bench` and the
//! GPU tests.

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use moeforge_compiler::codegen::{self, CodegenError};
use moeforge_compiler::plan::{BufferId, LayerShape, Plan};
use thiserror::Error;

use crate::aot;
use crate::bf16;
use crate::call_file::CallOutputs;
use crate::checkpoint::HostGate;
use crate::checkpoint::{CheckpointError, ExpertSet};
use crate::ep::EpLayer;
use crate::gpu::{DriverContext, Gpu, GpuError, LoadedKernels};
use crate::ipc::GroupError;
use crate::jit::{CompileOptions, CompiledKernels, CompiledModule, Jit, JitError};
use crate::layer::{
    ExpertBiases, ExpertWeights, ForwardArgs, FromLeWord, LayerError, MoeLayer, RoutedForwardArgs,
    read_words,
};
use crate::process_group::ControlChannel;
use crate::reference::router::{KernelRouting, RouterCheck};
use crate::reference::{self, Comparison, HostExpert, HostExpertBias};
use crate::weights::{
    RANDOM_EXPERT_BIAS_RANGE, copy_experts, random_gate, random_shared_gate, upload_gate,
};
use crate::workload::{SplitMix64, Workload, weight_scale};

#[derive(Debug, Error)]
pub enum HarnessError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Jit(#[from] JitError),
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl HarnessError {
    /// Whether joining a group failed leaving NCCL blocked on a lost peer (a transfer on
    /// this process's stream, or the communicator's set-up on a thread), the communicator
    /// left as it is: the driver's exit-time tear-down would wait for it too, so the
    /// process should leave at once.
    pub fn left_a_transfer_stuck(&self) -> bool {
        let stuck = |network: &crate::network::NetworkError| {
            matches!(
                network,
                crate::network::NetworkError::Unreachable { .. }
                    | crate::network::NetworkError::JoinTimeout { .. }
            )
        };
        match self {
            HarnessError::Layer(LayerError::Group(GroupError::Timeout { .. })) => true,
            HarnessError::Layer(LayerError::Group(GroupError::Network(network)))
            | HarnessError::Layer(LayerError::Network(network)) => stuck(network),
            _ => false,
        }
    }
}

/// A GPU, the JIT, and the runtime's own fill kernels.
///
/// The sessions of one process take turns (each holds `SESSION_TURN` while it lives):
/// expert-parallel kernels spin on flags and need every rank's blocks resident at once,
/// which another session's kernels on the same GPUs would break; tests run in threads.
pub struct Session {
    pub gpu: Gpu,
    pub jit: Jit,
    fill_uniform: CudaFunction,
    fill_bits: CudaFunction,
    _turn: MutexGuard<'static, ()>,
}

/// What loading a layer's kernels did, for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSummary {
    /// Modules the driver loaded (one per kernel the layer launches, or one for the unit).
    pub modules: usize,
}

impl LoadSummary {
    fn of(loaded: &LoadedKernels) -> Self {
        LoadSummary {
            modules: loaded.module_count(),
        }
    }
}

impl fmt::Display for LoadSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.modules {
            1 => f.write_str("1 module"),
            n => write!(f, "{n} modules"),
        }
    }
}

/// Held by the one live [`Session`] of the process.
static SESSION_TURN: Mutex<()> = Mutex::new(());

/// A layer ready to run, with how its kernels were obtained.
pub struct BuiltLayer {
    pub layer: MoeLayer,
    /// The kernels the layer was built from: those one GPU launches when compiled here
    /// (the expert-parallel ones are compiled when such a layer is built from this one),
    /// or the whole unit when given.
    pub module: CompiledKernels,
    /// Codegen and the JIT (NVRTC, or a read of the disk cache).
    pub compile_seconds: f64,
    /// Loading the compiled modules into the GPU's context (`cuModuleLoadData`), once the
    /// device is idle.
    pub load_seconds: f64,
    /// What was loaded.
    pub loaded: LoadSummary,
    /// Host copies of the experts' weights, by expert id, each downloaded from the device
    /// on the first check that needs it and kept for the layer's life. Downloaded rather
    /// than regenerated on the host: the check then uses the very bytes the kernels read,
    /// so a fault in the fill or in a weight's layout cannot be mirrored by a host copy of
    /// the generator; and a hit expert crosses PCIe once per layer, not once per call.
    host_experts: Vec<OnceLock<HostWeights>>,
    /// The router's gate the layer was built with, kept on the host for the reference
    /// (`None`: the layer runs caller-routed calls only).
    host_gate: Option<HostGate>,
}

/// One expert's (W1, W2) on the host, checkpoint layout, its (b1, b2) when the layer has
/// biases, and for a shared slice of a gated shared expert the gate's weights.
struct HostWeights {
    w1: Vec<u16>,
    w2: Vec<u16>,
    biases: Option<(Vec<f32>, Vec<f32>)>,
    shared_gate: Option<Vec<u16>>,
}

impl BuiltLayer {
    /// Downloads the weights of the experts among `ids` that are not on the host yet
    /// (ids outside `0..E` are skipped).
    fn fetch_experts(
        &self,
        stream: &Arc<CudaStream>,
        ids: impl IntoIterator<Item = i32>,
    ) -> Result<(), GpuError> {
        let shape = &self.layer.plan().shape;
        let w1_len = shape.w1_rows() as usize * shape.hidden as usize;
        let w2_len = shape.hidden as usize * shape.ffn as usize;
        let (b1_len, b2_len) = (shape.w1_rows() as usize, shape.hidden as usize);
        let weights = self.layer.weights();
        for id in ids {
            let Some((e, cell)) = usize::try_from(id)
                .ok()
                .and_then(|e| Some((e, self.host_experts.get(e)?)))
            else {
                continue;
            };
            if cell.get().is_some() {
                continue;
            }
            let w1 = stream
                .clone_dtoh(&weights.w1.slice(e * w1_len..(e + 1) * w1_len))
                .context(format!("downloading W1 of expert {e}"))?;
            let w2 = stream
                .clone_dtoh(&weights.w2.slice(e * w2_len..(e + 1) * w2_len))
                .context(format!("downloading W2 of expert {e}"))?;
            let biases = match &weights.biases {
                Some(biases) => Some((
                    stream
                        .clone_dtoh(&biases.b1.slice(e * b1_len..(e + 1) * b1_len))
                        .context(format!("downloading b1 of expert {e}"))?,
                    stream
                        .clone_dtoh(&biases.b2.slice(e * b2_len..(e + 1) * b2_len))
                        .context(format!("downloading b2 of expert {e}"))?,
                )),
                None => None,
            };
            let shared_gate = match &weights.shared_gate {
                Some(gate) if e >= shape.experts as usize => Some(
                    stream
                        .clone_dtoh(gate)
                        .context("downloading the shared expert gate")?,
                ),
                _ => None,
            };
            // A check running at the same time may have filled the cell meanwhile, with
            // the same bytes: keeping either copy is right.
            let _ = cell.set(HostWeights {
                w1,
                w2,
                biases,
                shared_gate,
            });
        }
        Ok(())
    }

    /// Expert `e`'s weights, when a check has downloaded them.
    fn host_expert(&self, e: usize) -> Option<HostExpert<'_>> {
        self.host_experts
            .get(e)
            .and_then(OnceLock::get)
            .map(|w| HostExpert {
                w1: &w.w1,
                w2: &w.w2,
                biases: w.biases.as_ref().map(|(b1, b2)| HostExpertBias { b1, b2 }),
                shared_gate: w.shared_gate.as_deref(),
            })
    }
}

/// A workload on the device plus a poisoned output buffer.
pub struct DeviceWorkload {
    pub tokens: u32,
    pub x: CudaSlice<u16>,
    pub topk_ids: CudaSlice<i32>,
    pub topk_weights: CudaSlice<f32>,
    pub y: CudaSlice<u16>,
}

/// Tokens whose every output element [`Session::run_checked`] compares when the caller
/// has no reason to choose: every token of any call up to this size, a random sample of
/// this many above it. 4096 tokens of a layer with H = 1024, F = 512 and K = 8 are 52 G
/// multiply-adds for the reference, about a second on one core of an AMD EPYC (about 18 G
/// per second with AVX2 and FMA).
pub const CHECKED_TOKENS: usize = 4096;

/// The outcome of comparing one forward call with the CPU reference.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    pub tokens: u32,
    /// Tokens whose every output element was compared: all of them, or (see
    /// [`CheckReport::sampled`]) a fresh random sample.
    pub checked_tokens: usize,
    pub comparison: Comparison,
    /// Output elements still holding the NaN poison, over the whole output.
    pub unwritten: usize,
    /// Wall time of the CPU reference, the check's main cost.
    pub reference_seconds: f64,
    /// For a call that routed itself, how its router compares with the reference.
    pub router: Option<RouterCheck>,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.unwritten == 0
            && self.comparison.out_of_bound == 0
            && self.router.as_ref().is_none_or(RouterCheck::passed)
    }

    /// Whether only a sample of the tokens was compared.
    pub fn sampled(&self) -> bool {
        self.checked_tokens < self.tokens as usize
    }
}

impl fmt::Display for CheckReport {
    /// One line: what was compared, how much was out of bound, the worst element, the
    /// unwritten count.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.comparison;
        write!(
            f,
            "{} of {} elements out of bound (|got - want| <= {} * magnitude + {:.2e}) over {} tokens",
            c.out_of_bound, c.elements, c.tolerance.rtol, c.tolerance.atol, self.checked_tokens
        )?;
        if self.sampled() {
            write!(
                f,
                " (SAMPLED: {} of {} tokens checked)",
                self.checked_tokens, self.tokens
            )?;
        }
        if let Some(w) = &c.worst {
            write!(
                f,
                "; worst token {} column {}: got {} want {} (error {:.2e}, {:.2} of its bound)",
                w.token,
                w.column,
                w.got,
                w.want,
                w.error(),
                w.ratio()
            )?;
        }
        write!(f, "; {} unwritten", self.unwritten)?;
        if let Some(router) = &self.router {
            write!(f, "; {router}")?;
        }
        Ok(())
    }
}

const FILL_SOURCE: &str = include_str!("fill.cu");
const FILL_THREADS: u32 = 256;
const FILL_BLOCKS: u32 = 4096;
/// Keeps W2's random stream apart from W1's for the same seed.
const W2_SEED_SALT: u64 = 0x5eed_2222_0000_0001;
/// Keeps the biases' random stream apart from the weights'.
const BIAS_SEED_SALT: u64 = 0x5eed_b1a5_0000_0001;

impl Session {
    /// A session on GPU 0.
    pub fn open() -> Result<Self, HarnessError> {
        Session::open_device(0)
    }

    /// A session on GPU `ordinal` (a rank process's own GPU, its `LOCAL_RANK`).
    pub fn open_device(ordinal: usize) -> Result<Self, HarnessError> {
        // A session that panicked (a failed test) leaves nothing behind that matters here.
        let turn = SESSION_TURN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gpu = Gpu::open(ordinal)?;
        let jit = Jit::from_env()?;
        let arch = gpu.arch()?;
        let fill = jit.compile(FILL_SOURCE, &CompileOptions::new("moeforge_fill", arch))?;
        let module = gpu.load(&fill)?;
        let load = |name: &str| {
            module
                .load_function(name)
                .context(format!("loading `{name}`"))
        };
        let fill_uniform = load("fill_uniform_bf16")?;
        let fill_bits = load("fill_bits_u16")?;
        Ok(Session {
            gpu,
            jit,
            fill_uniform,
            fill_bits,
            _turn: turn,
        })
    }

    /// Generates the plan's CUDA unit and compiles the kernels a layer on this one GPU
    /// launches ([`Plan::single_gpu_entry_points`]), kernel by kernel side by side (through
    /// the disk cache). The expert-parallel ones are compiled when an expert-parallel layer
    /// is built ([`Session::build_expert_parallel`]).
    pub fn compile(&self, plan: &Plan) -> Result<(CompiledKernels, f64), HarnessError> {
        self.compile_entry_points(plan, plan.single_gpu_entry_points())
    }

    /// The expert-parallel kernels of `built`'s plan ([`Plan::expert_parallel_entry_points`]):
    /// its own module where that is the whole unit (embedded PTX, an AOT directory), else
    /// compiled now.
    fn expert_parallel_kernels<'a>(
        &self,
        built: &'a BuiltLayer,
    ) -> Result<Cow<'a, CompiledKernels>, HarnessError> {
        if built.module.modules.iter().any(|m| m.kernels.is_empty()) {
            return Ok(Cow::Borrowed(&built.module));
        }
        let plan = built.layer.plan();
        let (kernels, _) = self.compile_entry_points(plan, plan.expert_parallel_entry_points())?;
        Ok(Cow::Owned(kernels))
    }

    fn compile_entry_points(
        &self,
        plan: &Plan,
        kernels: Vec<String>,
    ) -> Result<(CompiledKernels, f64), HarnessError> {
        let started = Instant::now();
        // A plan for another kind of device is an error, never silently recompiled.
        self.gpu.check_target(&plan.target)?;
        let source = codegen::generate(plan)?;
        let kernels = self.jit.compile_kernels(
            &source.source,
            &plan.in_compile_order(kernels),
            &aot::compile_options(plan),
        )?;
        Ok((kernels, started.elapsed().as_secs_f64()))
    }

    fn fill_uniform(
        &self,
        out: &mut CudaSlice<u16>,
        seed: u64,
        scale: f32,
    ) -> Result<(), GpuError> {
        let count = out.len() as u64;
        let mut launch = self.gpu.stream.launch_builder(&self.fill_uniform);
        launch.arg(out).arg(&count).arg(&seed).arg(&scale);
        let config = LaunchConfig {
            grid_dim: (FILL_BLOCKS, 1, 1),
            block_dim: (FILL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: fill_uniform_bf16(bf16*, u64, u64, float) writes `count` elements of `out`.
        unsafe { launch.launch(config) }.context("filling weights")?;
        Ok(())
    }

    /// Fills `out` with `bits` (e.g. the NaN poison).
    pub fn fill_bits(&self, out: &mut CudaSlice<u16>, bits: u16) -> Result<(), GpuError> {
        let count = out.len() as u64;
        let mut launch = self.gpu.stream.launch_builder(&self.fill_bits);
        launch.arg(out).arg(&count).arg(&bits);
        let config = LaunchConfig {
            grid_dim: (FILL_BLOCKS, 1, 1),
            block_dim: (FILL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: fill_bits_u16(bf16*, u64, bf16) writes `count` elements of `out`.
        unsafe { launch.launch(config) }.context("filling a buffer")?;
        Ok(())
    }

    /// Random expert weights on the device, uniform with a fan-in scale; the biases, when
    /// the layer has them, drawn on the host (they are small) and uploaded.
    pub fn random_weights(&self, shape: &LayerShape, seed: u64) -> Result<ExpertWeights, GpuError> {
        let experts = u64::from(shape.gemm_experts());
        let w1_len = experts * u64::from(shape.w1_rows()) * u64::from(shape.hidden);
        let w2_len = experts * u64::from(shape.hidden) * u64::from(shape.ffn);
        let stream = &self.gpu.stream;
        // SAFETY: both buffers are filled completely right below, before any read.
        let mut w1 = unsafe { stream.alloc::<u16>(w1_len as usize) }.context("allocating W1")?;
        let mut w2 = unsafe { stream.alloc::<u16>(w2_len as usize) }.context("allocating W2")?;
        self.fill_uniform(&mut w1, seed, weight_scale(shape.hidden))?;
        self.fill_uniform(
            &mut w2,
            seed.rotate_left(32) ^ W2_SEED_SALT,
            weight_scale(shape.ffn),
        )?;
        let biases = if shape.expert_bias {
            let mut rng = SplitMix64::new(seed ^ BIAS_SEED_SALT);
            let mut draw = |len: u64| -> Vec<f32> {
                (0..len)
                    .map(|_| rng.signed() * RANDOM_EXPERT_BIAS_RANGE)
                    .collect()
            };
            let b1 = draw(experts * u64::from(shape.w1_rows()));
            let b2 = draw(experts * u64::from(shape.hidden));
            Some(ExpertBiases {
                b1: stream.clone_htod(&b1).context("uploading b1")?,
                b2: stream.clone_htod(&b2).context("uploading b2")?,
            })
        } else {
            None
        };
        let shared_gate = shape
            .shared_gated
            .then(|| {
                let gate = random_shared_gate(shape, seed);
                stream
                    .clone_htod(&gate)
                    .context("uploading the shared expert gate")
            })
            .transpose()?;
        Ok(ExpertWeights {
            w1,
            w2,
            biases,
            shared_gate,
        })
    }

    /// Compiles the plan's kernels, fills random weights (and, when the spec has a router,
    /// draws a random gate, so that the layer can route itself) and builds the handle.
    pub fn build(&self, plan: Plan, seed: u64) -> Result<BuiltLayer, HarnessError> {
        let compiled = self.compile(&plan)?;
        self.build_from_kernels(plan, compiled, seed)
    }

    /// Compiles the plan's kernels and builds the handle with `weights`, every expert of
    /// the layer on this session's GPU (e.g. [`crate::weights::upload`]ed from a
    /// checkpoint); checks against the CPU reference then read those weights.
    pub fn build_with_weights(
        &self,
        plan: Plan,
        weights: ExpertWeights,
    ) -> Result<BuiltLayer, HarnessError> {
        self.build_with_weights_and_gate(plan, weights, None)
    }

    /// [`Session::build_with_weights`] with the router's gate (e.g. a checkpoint's), so
    /// that the layer can route itself; `None` builds a caller-routed layer.
    pub fn build_with_weights_and_gate(
        &self,
        plan: Plan,
        weights: ExpertWeights,
        gate: Option<HostGate>,
    ) -> Result<BuiltLayer, HarnessError> {
        let (module, compile_seconds) = self.compile(&plan)?;
        self.assemble(plan, module, compile_seconds, weights, gate)
    }

    /// [`Session::build`] for several plans, compiled side by side ([`Session::compile_many`]);
    /// plan `i` gets weights seeded with `seed + i`.
    pub fn build_many(&self, plans: Vec<Plan>, seed: u64) -> Result<Vec<BuiltLayer>, HarnessError> {
        let compiled = self.compile_many(&plans);
        plans
            .into_iter()
            .zip(compiled)
            .zip(0u64..)
            .map(|((plan, compiled), i)| {
                self.build_from_kernels(plan, compiled?, seed.wrapping_add(i))
            })
            .collect()
    }

    /// [`Session::compile`] for several plans, on a thread each: NVRTC runs separate
    /// programs concurrently, and a plan's kernels alone may not fill the machine's cores
    /// (a tuning candidate differs from the layer compiled before it in one kernel). The
    /// results are in `plans`' order.
    pub fn compile_many<'p>(
        &self,
        plans: impl IntoIterator<Item = &'p Plan>,
    ) -> Vec<Result<(CompiledKernels, f64), HarnessError>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = plans
                .into_iter()
                .map(|plan| scope.spawn(move || self.compile(plan)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect()
        })
    }

    /// [`Session::build`] with the plan's kernels already compiled ([`Session::compile`],
    /// [`Session::compile_many`]): fills random weights (and gate) and builds the handle.
    pub fn build_from_kernels(
        &self,
        plan: Plan,
        (module, compile_seconds): (CompiledKernels, f64),
        seed: u64,
    ) -> Result<BuiltLayer, HarnessError> {
        let weights = self.random_weights(&plan.shape, seed)?;
        let gate = random_router_gate(&plan, seed);
        self.assemble(plan, module, compile_seconds, weights, gate)
    }

    /// [`Session::build`] with kernels compiled elsewhere (embedded PTX, an AOT directory):
    /// loads `module`, fills random weights and builds the handle.
    pub fn build_compiled(
        &self,
        plan: Plan,
        module: CompiledModule,
        seed: u64,
    ) -> Result<BuiltLayer, HarnessError> {
        self.build_from_kernels(plan, (CompiledKernels::whole(module), 0.0), seed)
    }

    /// Loads a compiled module and builds the handle with `weights` and, when given, the
    /// router's `gate` (uploaded; the host copy kept for the reference).
    fn assemble(
        &self,
        plan: Plan,
        module: CompiledKernels,
        compile_seconds: f64,
        weights: ExpertWeights,
        gate: Option<HostGate>,
    ) -> Result<BuiltLayer, HarnessError> {
        // The weights' fill or upload may still run on the stream, and a module load waits
        // for the device: without this the fill's time would count as the load's.
        self.gpu.synchronize()?;
        let started = Instant::now();
        let loaded = self
            .gpu
            .load_kernels(&module, &plan.single_gpu_entry_points())?;
        let load_seconds = started.elapsed().as_secs_f64();
        let summary = LoadSummary::of(&loaded);
        let experts = plan.shape.gemm_experts() as usize;
        let device_gate = gate
            .as_ref()
            .map(|gate| upload_gate(&self.gpu.stream, gate))
            .transpose()?;
        let layer = MoeLayer::with_gate(&self.gpu, plan, loaded, weights, device_gate)?;
        Ok(BuiltLayer {
            layer,
            module,
            compile_seconds,
            load_seconds,
            loaded: summary,
            host_experts: (0..experts).map(|_| OnceLock::new()).collect(),
            host_gate: gate,
        })
    }

    /// Uploads `workload` and allocates its output, poisoned with NaN.
    pub fn upload(
        &self,
        shape: &LayerShape,
        workload: &Workload,
    ) -> Result<DeviceWorkload, GpuError> {
        let stream = &self.gpu.stream;
        let (x, y) = self.upload_activations(shape, workload.tokens, &workload.x)?;
        // Zero-length device buffers are not allocatable: keep at least one element.
        let at_least_one = |n: usize| n.max(1);
        let mut topk_ids = stream
            .alloc_zeros::<i32>(at_least_one(workload.topk_ids.len()))
            .context("allocating topk_ids")?;
        let mut topk_weights = stream
            .alloc_zeros::<f32>(at_least_one(workload.topk_weights.len()))
            .context("allocating topk_weights")?;
        if workload.tokens > 0 {
            stream
                .memcpy_htod(&workload.topk_ids, &mut topk_ids)
                .context("uploading topk_ids")?;
            stream
                .memcpy_htod(&workload.topk_weights, &mut topk_weights)
                .context("uploading topk_weights")?;
        }
        Ok(DeviceWorkload {
            tokens: workload.tokens,
            x,
            topk_ids,
            topk_weights,
            y,
        })
    }

    /// Uploads the activations `x` of `tokens` tokens and allocates their output `y`,
    /// poisoned with NaN: `(x, y)`.
    fn upload_activations(
        &self,
        shape: &LayerShape,
        tokens: u32,
        x_host: &[u16],
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>), GpuError> {
        let stream = &self.gpu.stream;
        // Zero-length device buffers are not allocatable: keep at least one element.
        let at_least_one = |n: usize| n.max(1);
        let mut x = stream
            .alloc_zeros::<u16>(at_least_one(x_host.len()))
            .context("allocating x")?;
        if tokens > 0 {
            stream.memcpy_htod(x_host, &mut x).context("uploading x")?;
        }
        let y_len = u64::from(tokens) * u64::from(shape.hidden);
        let mut y = stream
            .alloc_zeros::<u16>(at_least_one(y_len as usize))
            .context("allocating y")?;
        self.fill_bits(&mut y, bf16::NAN)?;
        Ok((x, y))
    }

    /// The expert-parallel layer of `built`'s plan: rank `r` on `contexts[r]` (the
    /// session's context R times for virtual ranks), each with its `E / R` experts copied
    /// from `built`'s weights (so the CPU reference of `built` checks it).
    pub fn build_expert_parallel(
        &self,
        built: &BuiltLayer,
        contexts: &[Arc<CudaContext>],
    ) -> Result<EpLayer, HarnessError> {
        let weights = contexts
            .iter()
            .enumerate()
            .map(|(r, ctx)| self.rank_weights(built, r, contexts.len(), ctx))
            .collect::<Result<Vec<_>, _>>()?;
        self.build_expert_parallel_with(built, contexts, weights)
    }

    /// Rank `r`'s experts of `built` (its `E / ranks` routed ones, then the shared
    /// slices), with their biases where the layer has them, copied onto `ctx`'s device.
    fn rank_weights(
        &self,
        built: &BuiltLayer,
        r: usize,
        ranks: usize,
        ctx: &Arc<CudaContext>,
    ) -> Result<ExpertWeights, HarnessError> {
        let shape = &built.layer.plan().shape;
        // The rank's routed experts, then every shared slice (each rank runs them on its
        // own tokens).
        let mut held = Vec::new();
        for which in ExpertSet::held_by_rank(r as u32, ranks as u32) {
            let range = which.range(shape)?;
            held.push(range.start as usize..range.end as usize);
        }
        Ok(copy_experts(
            &self.gpu.stream,
            &ctx.default_stream(),
            built.layer.weights(),
            shape,
            &held,
        )?)
    }

    /// This process's rank of `built`'s expert-parallel layer when the ranks are processes
    /// (see [`EpLayer::join_group`]): rank `channel.rank()` on this session's GPU with its
    /// `E / R` experts copied from `built` (every rank built `built` from the same seed, so
    /// each holds the whole layer for its CPU reference and keeps its own slice).
    pub fn join_expert_parallel_group(
        &self,
        built: &BuiltLayer,
        channel: ControlChannel,
    ) -> Result<EpLayer, HarnessError> {
        let plan = built.layer.plan();
        let ranks = plan.expert_parallel.as_ref().map_or(1, |ep| ep.ranks);
        if channel.world_size() != ranks {
            return Err(LayerError::from(GroupError::WorldSize {
                world_size: channel.world_size(),
                ranks,
            })
            .into());
        }
        let weights = self.rank_weights(
            built,
            channel.rank() as usize,
            ranks as usize,
            &self.gpu.ctx,
        )?;
        let kernels = self.expert_parallel_kernels(built)?;
        let module = self
            .gpu
            .load_kernels(&kernels, &plan.expert_parallel_entry_points())?;
        let layer = EpLayer::join_group(plan.clone(), &self.gpu.ctx, module, weights, channel)?;
        with_router(built, layer, std::slice::from_ref(&self.gpu.ctx))
    }

    /// The expert-parallel layer of `built`'s plan with the caller's weights: rank `r` on
    /// `contexts[r]` with `weights[r]`, its `E / R` experts on that device (e.g. loaded
    /// from a checkpoint for that rank alone). Checks of its output against the CPU
    /// reference read `built`'s weights, so `built` must hold the same experts.
    pub fn build_expert_parallel_with(
        &self,
        built: &BuiltLayer,
        contexts: &[Arc<CudaContext>],
        weights: Vec<ExpertWeights>,
    ) -> Result<EpLayer, HarnessError> {
        let kernels = self.expert_parallel_kernels(built)?;
        let entry_points = built.layer.plan().expert_parallel_entry_points();
        let mut modules = Vec::with_capacity(contexts.len());
        for ctx in contexts {
            modules.push(if ctx.ordinal() == self.gpu.ctx.ordinal() {
                self.gpu.load_kernels(&kernels, &entry_points)?
            } else {
                Gpu::load_kernels_into(ctx, &kernels, &entry_points)?
            });
        }
        let layer = EpLayer::new(built.layer.plan().clone(), contexts, modules, weights)?;
        with_router(built, layer, contexts)
    }

    /// Runs one expert-parallel call, rank `r` on `workloads[r]`, and checks every rank's
    /// output against the CPU reference (see [`Session::run_checked`]).
    pub fn run_checked_expert_parallel(
        &self,
        built: &BuiltLayer,
        layer: &mut EpLayer,
        workloads: &[Workload],
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<Vec<CheckReport>, HarnessError> {
        self.run_checked_ep_call(built, layer, workloads, max_checked_tokens, seed, |l, a| {
            l.forward(a)
        })
    }

    /// [`Session::run_checked_expert_parallel`] for one call of the bulk-synchronous
    /// variant (the bench's baseline (a)): the same kernels with barriers between stages.
    pub fn run_checked_bulk_synchronous(
        &self,
        built: &BuiltLayer,
        layer: &mut EpLayer,
        workloads: &[Workload],
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<Vec<CheckReport>, HarnessError> {
        self.run_checked_ep_call(built, layer, workloads, max_checked_tokens, seed, |l, a| {
            l.forward_bulk_synchronous(a, None)
        })
    }

    /// One call made by `call`, each rank's output checked against the CPU reference.
    fn run_checked_ep_call(
        &self,
        built: &BuiltLayer,
        layer: &mut EpLayer,
        workloads: &[Workload],
        max_checked_tokens: usize,
        seed: u64,
        call: impl FnOnce(&mut EpLayer, &mut [ForwardArgs<'_>]) -> Result<(), LayerError>,
    ) -> Result<Vec<CheckReport>, HarnessError> {
        let shape = layer.plan().shape.clone();
        let mut inputs = workloads
            .iter()
            .enumerate()
            .map(|(r, w)| upload_poisoned(layer.stream(r), &shape, w))
            .collect::<Result<Vec<_>, _>>()?;
        layer.synchronize()?;
        let mut args: Vec<ForwardArgs<'_>> = inputs.iter_mut().map(DeviceWorkload::args).collect();
        call(layer, &mut args)?;
        layer.take_error()?;
        inputs
            .iter()
            .zip(workloads)
            .enumerate()
            .map(|(r, (io, workload))| {
                let y = layer.stream(r).clone_dtoh(&io.y).context("downloading y")?;
                self.check_output(built, workload, &y, max_checked_tokens, seed)
            })
            .collect()
    }

    /// Runs `calls` expert-parallel calls that route themselves back to back (no host
    /// synchronisation between them, as a serving loop makes them), rank `r` on the
    /// activations `xs[r]` of `tokens[r]` tokens every time, and checks the last on every
    /// rank as [`Session::check_routed`] does: its router's logits and choices against
    /// the CPU router, then its output against the CPU reference on the experts and
    /// weights its router chose.
    #[allow(clippy::too_many_arguments)]
    pub fn run_checked_routed_expert_parallel(
        &self,
        built: &BuiltLayer,
        layer: &mut EpLayer,
        tokens: &[u32],
        xs: &[Vec<u16>],
        calls: usize,
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<Vec<CheckReport>, HarnessError> {
        let shape = layer.plan().shape.clone();
        let mut io = tokens
            .iter()
            .zip(xs)
            .enumerate()
            .map(|(r, (&t, x))| {
                let activations = Workload {
                    tokens: t,
                    x: x.clone(),
                    topk_ids: Vec::new(),
                    topk_weights: Vec::new(),
                };
                upload_poisoned(layer.stream(r), &shape, &activations)
            })
            .collect::<Result<Vec<_>, _>>()?;
        layer.synchronize()?;
        for _ in 0..calls {
            let mut args: Vec<RoutedForwardArgs<'_>> =
                io.iter_mut().map(DeviceWorkload::routed_args).collect();
            layer.forward_routed(&mut args)?;
        }
        layer.take_error()?;
        io.iter()
            .zip(xs)
            .enumerate()
            .map(|(r, (io, x))| {
                let stream = layer.stream(r);
                let y = stream.clone_dtoh(&io.y).context("downloading y")?;
                let (topk_ids, topk_weights) = layer.routed_choices(r, io.tokens)?;
                let logits = layer.workspace_buffer(r, BufferId::RouterLogits).ok_or(
                    LayerError::MissingWorkspace {
                        buffer: BufferId::RouterLogits.name(),
                    },
                )?;
                let outputs = CallOutputs {
                    tokens: io.tokens,
                    y,
                    topk_ids,
                    topk_weights,
                    router_logits: Some(read_words(
                        stream,
                        logits,
                        io.tokens as usize * shape.experts as usize,
                    )?),
                };
                self.check_routed(built, x, &outputs, max_checked_tokens, seed)
            })
            .collect()
    }

    pub fn forward(&self, layer: &MoeLayer, io: &mut DeviceWorkload) -> Result<(), LayerError> {
        layer.forward(io.args())
    }

    /// Runs one forward call and compares every output element of at most
    /// `max_checked_tokens` tokens (all of them when T is not larger, else a random sample
    /// drawn with `seed`, which the report says) with the CPU reference, within
    /// [`reference::Tolerance`]; counts the elements that kept their NaN poison over the
    /// whole output.
    pub fn run_checked(
        &self,
        built: &BuiltLayer,
        workload: &Workload,
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<CheckReport, HarnessError> {
        let outputs = self.run_collect(built, workload)?;
        self.check_output(built, workload, &outputs.y, max_checked_tokens, seed)
    }

    /// Runs one forward call on `workload`, routed by its ids and weights, and downloads
    /// its output (the outputs' routing is the workload's).
    pub fn run_collect(
        &self,
        built: &BuiltLayer,
        workload: &Workload,
    ) -> Result<CallOutputs, HarnessError> {
        let layer = &built.layer;
        let mut io = self.upload(&layer.plan().shape, workload)?;
        self.forward(layer, &mut io)?;
        layer.take_error()?;
        let y = self.gpu.stream.clone_dtoh(&io.y).context("downloading y")?;
        Ok(CallOutputs {
            tokens: workload.tokens,
            y,
            topk_ids: workload.topk_ids.clone(),
            topk_weights: workload.topk_weights.clone(),
            router_logits: None,
        })
    }

    /// Runs one forward call that routes itself on `workload.x` (its ids and weights are
    /// not used) and checks it: the router's logits, choices and weights against the CPU
    /// reference of the router ([`reference::router::compare`]), then every output element
    /// against the CPU reference of the layer on the experts and weights the router chose,
    /// for the same tokens as [`Session::run_checked`].
    pub fn run_checked_routed(
        &self,
        built: &BuiltLayer,
        workload: &Workload,
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<CheckReport, HarnessError> {
        let outputs = self.run_routed_collect(built, workload.tokens, &workload.x)?;
        self.check_routed(built, &workload.x, &outputs, max_checked_tokens, seed)
    }

    /// Runs one forward call that routes itself on `x` ([T, H] bf16 bits) and downloads
    /// its output with the router's logits, choices and weights.
    pub fn run_routed_collect(
        &self,
        built: &BuiltLayer,
        tokens: u32,
        x: &[u16],
    ) -> Result<CallOutputs, HarnessError> {
        let layer = &built.layer;
        let shape = &layer.plan().shape;
        let (x, mut y) = self.upload_activations(shape, tokens, x)?;
        layer.forward_routed(RoutedForwardArgs {
            tokens,
            x: &x,
            y: &mut y,
        })?;
        layer.take_error()?;
        let y = self.gpu.stream.clone_dtoh(&y).context("downloading y")?;
        let t = tokens as usize;
        let (e, k) = (shape.experts as usize, shape.top_k as usize);
        Ok(CallOutputs {
            tokens,
            y,
            topk_ids: self.download_workspace(layer, BufferId::RoutedIds, t * k)?,
            topk_weights: self.download_workspace(layer, BufferId::RoutedWeights, t * k)?,
            router_logits: Some(self.download_workspace(layer, BufferId::RouterLogits, t * e)?),
        })
    }

    /// Checks `outputs` of a call that routed itself on `x` (see
    /// [`Session::run_checked_routed`]).
    pub fn check_routed(
        &self,
        built: &BuiltLayer,
        x: &[u16],
        outputs: &CallOutputs,
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<CheckReport, HarnessError> {
        let plan = built.layer.plan();
        let shape = &plan.shape;
        let rule = plan.router.as_ref().ok_or(LayerError::NoRouter)?.rule;
        let gate = built.host_gate.as_ref().ok_or(LayerError::NoGateWeights)?;
        let logits = outputs
            .router_logits
            .as_deref()
            .ok_or(LayerError::NoRouter)?;
        let t = outputs.tokens as usize;
        let (e, k) = (shape.experts as usize, shape.top_k as usize);
        let tokens = checked_tokens(t, max_checked_tokens, seed);
        let router = reference::router::compare(
            &rule,
            shape.hidden as usize,
            e,
            k,
            x,
            &gate.weight,
            gate.bias.as_deref(),
            &KernelRouting {
                logits,
                topk_ids: &outputs.topk_ids,
                topk_weights: &outputs.topk_weights,
            },
            &tokens,
        );
        let routed = Workload {
            tokens: outputs.tokens,
            x: x.to_vec(),
            topk_ids: outputs.topk_ids.clone(),
            topk_weights: outputs.topk_weights.clone(),
        };
        let mut report = self.check_output(built, &routed, &outputs.y, max_checked_tokens, seed)?;
        report.router = Some(router);
        Ok(report)
    }

    /// The first `elems` elements of workspace buffer `id` of `layer`, as `T` (the plan's
    /// element type of that buffer).
    fn download_workspace<T: FromLeWord>(
        &self,
        layer: &MoeLayer,
        id: BufferId,
        elems: usize,
    ) -> Result<Vec<T>, HarnessError> {
        let buffer = layer
            .workspace_buffer(id)
            .ok_or(LayerError::MissingWorkspace { buffer: id.name() })?;
        Ok(read_words(&self.gpu.stream, buffer, elems)?)
    }

    /// Compares the output `y` of a call on `workload` with the CPU reference (see
    /// [`Session::run_checked`]), the weights taken from `built`.
    pub fn check_output(
        &self,
        built: &BuiltLayer,
        workload: &Workload,
        y: &[u16],
        max_checked_tokens: usize,
        seed: u64,
    ) -> Result<CheckReport, HarnessError> {
        let shape = &built.layer.plan().shape;
        let y = &y[..workload.tokens as usize * shape.hidden as usize];
        let unwritten = y.iter().filter(|&&v| bf16::to_f32(v).is_nan()).count();

        let tokens = checked_tokens(workload.tokens as usize, max_checked_tokens, seed);
        let k = shape.top_k as usize;
        let shared_slices = (shape.experts..shape.gemm_experts()).map(|e| e as i32);
        built.fetch_experts(
            &self.gpu.stream,
            tokens
                .iter()
                .flat_map(|&t| workload.topk_ids[t * k..(t + 1) * k].iter().copied())
                .filter(|&id| (id as u32) < shape.experts)
                .chain(shared_slices),
        )?;
        let started = Instant::now();
        let reference = reference::layer_output(shape, workload, tokens, |e| {
            built
                .host_expert(e)
                .expect("the experts of every checked token were fetched above")
        });
        let reference_seconds = started.elapsed().as_secs_f64();
        Ok(CheckReport {
            tokens: workload.tokens,
            checked_tokens: reference.tokens.len(),
            comparison: reference::compare(y, &reference),
            unwritten,
            reference_seconds,
            router: None,
        })
    }
}

/// `layer` with `built`'s router gate on each of its ranks' devices (`contexts`, one per
/// rank it drives), where its plan routes itself and `built` has a gate; else as it is.
fn with_router(
    built: &BuiltLayer,
    layer: EpLayer,
    contexts: &[Arc<CudaContext>],
) -> Result<EpLayer, HarnessError> {
    let routes = layer
        .plan()
        .expert_parallel
        .as_ref()
        .is_some_and(|ep| ep.routes_itself);
    match &built.host_gate {
        Some(gate) if routes => {
            let gates = contexts
                .iter()
                .map(|ctx| upload_gate(&ctx.default_stream(), gate))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(layer.with_router(gates)?)
        }
        _ => Ok(layer),
    }
}

/// The random gate a layer built on random weights gets when its spec has a router.
fn random_router_gate(plan: &Plan, seed: u64) -> Option<HostGate> {
    plan.router
        .as_ref()
        .map(|router| random_gate(&plan.shape, router.rule.bias, seed))
}

/// `workload` on `stream`'s device, with its output poisoned with NaN from the host (the
/// fill kernels live on the session's device only).
pub fn upload_poisoned(
    stream: &Arc<CudaStream>,
    shape: &LayerShape,
    workload: &Workload,
) -> Result<DeviceWorkload, GpuError> {
    // Zero-length device buffers are not allocatable: keep at least one element.
    let padded = |mut v: Vec<u16>| {
        if v.is_empty() {
            v.push(0);
        }
        v
    };
    let x = stream
        .clone_htod(&padded(workload.x.clone()))
        .context("uploading x")?;
    let mut ids = workload.topk_ids.clone();
    let mut weights = workload.topk_weights.clone();
    if ids.is_empty() {
        ids.push(0);
        weights.push(0.0);
    }
    let topk_ids = stream.clone_htod(&ids).context("uploading topk_ids")?;
    let topk_weights = stream
        .clone_htod(&weights)
        .context("uploading topk_weights")?;
    let y_len = (workload.tokens as usize * shape.hidden as usize).max(1);
    let y = stream
        .clone_htod(&vec![bf16::NAN; y_len])
        .context("allocating y")?;
    Ok(DeviceWorkload {
        tokens: workload.tokens,
        x,
        topk_ids,
        topk_weights,
        y,
    })
}

impl DeviceWorkload {
    /// The arguments of a call that routes itself on this workload's x (its ids and
    /// weights unused) and writes its output.
    pub fn routed_args(&mut self) -> RoutedForwardArgs<'_> {
        RoutedForwardArgs {
            tokens: self.tokens,
            x: &self.x,
            y: &mut self.y,
        }
    }

    /// The forward-call arguments that read this workload and write its output.
    pub fn args(&mut self) -> ForwardArgs<'_> {
        ForwardArgs {
            tokens: self.tokens,
            x: &self.x,
            topk_ids: &self.topk_ids,
            topk_weights: &self.topk_weights,
            y: &mut self.y,
        }
    }
}

/// All of `0..tokens` when there are at most `cap`, else `cap` of them drawn at random
/// with `seed`; in increasing order.
fn checked_tokens(tokens: usize, cap: usize, seed: u64) -> Vec<usize> {
    let mut all: Vec<usize> = (0..tokens).collect();
    if tokens > cap {
        // The first `cap` steps of a Fisher-Yates shuffle.
        let mut rng = SplitMix64::new(seed);
        for i in 0..cap {
            let j = i + rng.below((tokens - i) as u32) as usize;
            all.swap(i, j);
        }
        all.truncate(cap);
        all.sort_unstable();
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_tokens_are_all_up_to_the_cap_then_a_distinct_sample() {
        assert_eq!(checked_tokens(5, 5, 1), vec![0, 1, 2, 3, 4]);
        assert!(checked_tokens(0, 4096, 1).is_empty());
        let sample = checked_tokens(10_000, 300, 7);
        assert_eq!(sample.len(), 300);
        assert!(
            sample.windows(2).all(|w| w[0] < w[1]),
            "sorted and distinct"
        );
        assert!(sample.iter().all(|&t| t < 10_000));
        assert_ne!(
            sample,
            checked_tokens(10_000, 300, 8),
            "the seed picks the sample"
        );
    }
}
