//! Running a planned layer end to end: generate and JIT-compile its kernels, fill random
//! expert weights on the device, upload a workload, run `forward`, and check the result
//! against the CPU reference. Used by `moeforge run`, `moeforge bench` and the GPU tests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, LaunchConfig, PushKernelArg};
use moeforge_compiler::codegen::{self, CodegenError};
use moeforge_compiler::plan::{LayerShape, Plan};
use thiserror::Error;

use crate::aot;
use crate::bf16;
use crate::gpu::{DriverContext, Gpu, GpuError};
use crate::jit::{CompileOptions, CompiledModule, Jit, JitError};
use crate::layer::{ExpertWeights, ForwardArgs, LayerError, MoeLayer};
use crate::reference::{self, HostExpert};
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
}

/// A GPU, the JIT, and the runtime's own fill kernels.
pub struct Session {
    pub gpu: Gpu,
    pub jit: Jit,
    fill_uniform: CudaFunction,
    fill_bits: CudaFunction,
}

/// A layer ready to run, with how its kernels were obtained.
pub struct BuiltLayer {
    pub layer: MoeLayer,
    pub module: CompiledModule,
    /// The module as loaded on the device (the baseline borrows its route kernel).
    pub loaded: Arc<CudaModule>,
    pub compile_seconds: f64,
}

/// A workload on the device plus a poisoned output buffer.
pub struct DeviceWorkload {
    pub tokens: u32,
    pub x: CudaSlice<u16>,
    pub topk_ids: CudaSlice<i32>,
    pub topk_weights: CudaSlice<f32>,
    pub y: CudaSlice<u16>,
}

/// The outcome of comparing one forward call with the CPU reference.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckReport {
    pub tokens: u32,
    /// Tokens whose rows were compared (all of them, or a fresh random sample).
    pub checked_tokens: usize,
    pub relative_error: f64,
    /// Output elements still holding the NaN poison, over the whole output.
    pub unwritten: usize,
}

impl CheckReport {
    /// The bf16 acceptance bound of DESIGN.md.
    pub const TOLERANCE: f64 = 1e-2;

    pub fn passed(&self) -> bool {
        self.unwritten == 0 && self.relative_error < Self::TOLERANCE
    }
}

/// Host copies of experts' (W1, W2), by expert id.
type HostExperts = HashMap<usize, (Vec<u16>, Vec<u16>)>;

const FILL_SOURCE: &str = include_str!("fill.cu");
const FILL_THREADS: u32 = 256;
const FILL_BLOCKS: u32 = 4096;
/// Keeps W2's random stream apart from W1's for the same seed.
const W2_SEED_SALT: u64 = 0x5eed_2222_0000_0001;

impl Session {
    pub fn open() -> Result<Self, HarnessError> {
        let gpu = Gpu::open(0)?;
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
        })
    }

    /// Generates the plan's CUDA unit and compiles it for this GPU (through the disk cache).
    pub fn compile(&self, plan: &Plan) -> Result<(CompiledModule, f64), HarnessError> {
        let started = Instant::now();
        // A plan for another kind of device is an error, never silently recompiled.
        self.gpu.check_target(&plan.target)?;
        let source = codegen::generate(plan)?;
        let module = self
            .jit
            .compile(&source.source, &aot::compile_options(plan))?;
        Ok((module, started.elapsed().as_secs_f64()))
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

    /// Random expert weights on the device, uniform with a fan-in scale.
    pub fn random_weights(&self, shape: &LayerShape, seed: u64) -> Result<ExpertWeights, GpuError> {
        let experts = u64::from(shape.experts);
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
        Ok(ExpertWeights { w1, w2 })
    }

    /// Compiles the plan's kernels, fills random weights and builds the handle.
    pub fn build(&self, plan: Plan, seed: u64) -> Result<BuiltLayer, HarnessError> {
        let (module, compile_seconds) = self.compile(&plan)?;
        let loaded = self.gpu.load(&module)?;
        let weights = self.random_weights(&plan.shape, seed)?;
        let layer = MoeLayer::new(&self.gpu, plan, Arc::clone(&loaded), weights)?;
        Ok(BuiltLayer {
            layer,
            module,
            loaded,
            compile_seconds,
        })
    }

    /// Uploads `workload` and allocates its output, poisoned with NaN.
    pub fn upload(
        &self,
        shape: &LayerShape,
        workload: &Workload,
    ) -> Result<DeviceWorkload, GpuError> {
        let stream = &self.gpu.stream;
        // Zero-length device buffers are not allocatable: keep at least one element.
        let at_least_one = |n: usize| n.max(1);
        let mut x = stream
            .alloc_zeros::<u16>(at_least_one(workload.x.len()))
            .context("allocating x")?;
        let mut topk_ids = stream
            .alloc_zeros::<i32>(at_least_one(workload.topk_ids.len()))
            .context("allocating topk_ids")?;
        let mut topk_weights = stream
            .alloc_zeros::<f32>(at_least_one(workload.topk_weights.len()))
            .context("allocating topk_weights")?;
        if workload.tokens > 0 {
            stream
                .memcpy_htod(&workload.x, &mut x)
                .context("uploading x")?;
            stream
                .memcpy_htod(&workload.topk_ids, &mut topk_ids)
                .context("uploading topk_ids")?;
            stream
                .memcpy_htod(&workload.topk_weights, &mut topk_weights)
                .context("uploading topk_weights")?;
        }
        let y_len = u64::from(workload.tokens) * u64::from(shape.hidden);
        let mut y = stream
            .alloc_zeros::<u16>(at_least_one(y_len as usize))
            .context("allocating y")?;
        self.fill_bits(&mut y, bf16::NAN)?;
        Ok(DeviceWorkload {
            tokens: workload.tokens,
            x,
            topk_ids,
            topk_weights,
            y,
        })
    }

    pub fn forward(&self, layer: &MoeLayer, io: &mut DeviceWorkload) -> Result<(), LayerError> {
        layer.forward(ForwardArgs {
            tokens: io.tokens,
            x: &io.x,
            topk_ids: &io.topk_ids,
            topk_weights: &io.topk_weights,
            y: &mut io.y,
        })
    }

    /// Runs one forward call and compares it with the CPU reference on at most
    /// `sample_tokens` tokens (a fresh random sample drawn with `seed`), and checks that no
    /// output element kept its poison.
    pub fn run_checked(
        &self,
        layer: &MoeLayer,
        workload: &Workload,
        sample_tokens: usize,
        seed: u64,
    ) -> Result<CheckReport, HarnessError> {
        let shape = layer.plan().shape.clone();
        let mut io = self.upload(&shape, workload)?;
        self.forward(layer, &mut io)?;
        layer.take_error()?;
        let y = self.gpu.stream.clone_dtoh(&io.y).context("downloading y")?;
        let hidden = shape.hidden as usize;
        let y = &y[..workload.tokens as usize * hidden];
        let unwritten = y.iter().filter(|&&v| bf16::to_f32(v).is_nan()).count();

        let mut tokens: Vec<usize> = (0..workload.tokens as usize).collect();
        if tokens.len() > sample_tokens {
            let mut rng = SplitMix64::new(seed);
            for i in 0..sample_tokens {
                let j = i + rng.below((tokens.len() - i) as u32) as usize;
                tokens.swap(i, j);
            }
            tokens.truncate(sample_tokens);
        }
        let experts = self.download_experts(layer, &shape, workload, &tokens)?;
        let k = shape.top_k as usize;
        let workers = std::thread::available_parallelism().map_or(4, |n| n.get());
        let chunk = tokens.len().div_ceil(workers).max(1);
        let references: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = tokens
                .chunks(chunk)
                .map(|part| {
                    let shape = &shape;
                    let experts = &experts;
                    scope.spawn(move || {
                        part.iter()
                            .map(|&t| {
                                reference::token_output(
                                    shape,
                                    &workload.x[t * hidden..(t + 1) * hidden],
                                    &workload.topk_ids[t * k..(t + 1) * k],
                                    &workload.topk_weights[t * k..(t + 1) * k],
                                    |e| {
                                        let (w1, w2) = &experts[&e];
                                        HostExpert { w1, w2 }
                                    },
                                )
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("reference worker panicked"))
                .collect()
        });
        let mut got = Vec::with_capacity(tokens.len() * hidden);
        let mut want = Vec::with_capacity(tokens.len() * hidden);
        for (&t, reference) in tokens.iter().zip(&references) {
            got.extend(
                y[t * hidden..(t + 1) * hidden]
                    .iter()
                    .map(|&v| bf16::to_f32(v)),
            );
            want.extend_from_slice(reference);
        }
        let relative_error = if tokens.is_empty() {
            0.0
        } else {
            reference::relative_error(&got, &want)
        };
        Ok(CheckReport {
            tokens: workload.tokens,
            checked_tokens: tokens.len(),
            relative_error,
            unwritten,
        })
    }

    /// The host copies of the experts that the given tokens use.
    fn download_experts(
        &self,
        layer: &MoeLayer,
        shape: &LayerShape,
        workload: &Workload,
        tokens: &[usize],
    ) -> Result<HostExperts, GpuError> {
        let k = shape.top_k as usize;
        let w1_len = shape.w1_rows() as usize * shape.hidden as usize;
        let w2_len = shape.hidden as usize * shape.ffn as usize;
        let mut experts = HashMap::new();
        for &t in tokens {
            for &id in &workload.topk_ids[t * k..(t + 1) * k] {
                let Ok(e) = usize::try_from(id) else { continue };
                if e >= shape.experts as usize || experts.contains_key(&e) {
                    continue;
                }
                let weights = layer.weights();
                let w1 = self
                    .gpu
                    .stream
                    .clone_dtoh(&weights.w1.slice(e * w1_len..(e + 1) * w1_len))
                    .context("downloading W1")?;
                let w2 = self
                    .gpu
                    .stream
                    .clone_dtoh(&weights.w2.slice(e * w2_len..(e + 1) * w2_len))
                    .context("downloading W2")?;
                experts.insert(e, (w1, w2));
            }
        }
        Ok(experts)
    }
}
