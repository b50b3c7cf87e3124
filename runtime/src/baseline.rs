//! The cuBLAS baseline: the unfused MoE pipeline a framework runs without moeforge.
//! Routing metadata comes from the layer's own routing launches ([`MoeLayer::route`], from
//! the plan's table; both sides need it); then the host reads the per-expert counts (a
//! synchronisation, as such pipelines do), permutes the tokens, calls cuBLAS once per
//! non-empty expert for each GEMM, applies SwiGLU, un-permutes with the routing weight and
//! combines.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as cublas_result, sys as cublas_sys};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use moeforge_compiler::ir::Activation;
use moeforge_compiler::plan::{BufferId, Plan};
use thiserror::Error;

use crate::gpu::{DriverContext, GpuError};
use crate::harness::{DeviceWorkload, Session};
use crate::jit::{CompileOptions, JitError};
use crate::layer::{LayerError, MoeLayer};

#[derive(Debug, Error)]
pub enum BaselineError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Jit(#[from] JitError),
    #[error(
        "cuBLAS (libcublas.so.13) was not found; put the CUDA toolkit's lib64 on LD_LIBRARY_PATH"
    )]
    NoCublas,
    #[error("cuBLAS failed while {context}: {message}")]
    Cublas { context: String, message: String },
    #[error("the cuBLAS baseline implements SwiGLU only; this layer uses {0}")]
    Activation(&'static str),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error("the layer's plan has no workspace buffer `{0}` for the baseline to read")]
    MissingWorkspace(&'static str),
    #[error("the route launch left expert offsets the baseline cannot use: {0}")]
    Offsets(String),
}

const SOURCE: &str = include_str!("baseline.cu");
const ROW_THREADS: u32 = 256;

pub struct CublasBaseline {
    blas: CudaBlas,
    gather: CudaFunction,
    swiglu: CudaFunction,
    unpermute: CudaFunction,
    combine: CudaFunction,
    permuted: CudaSlice<u16>,
    hidden_act: CudaSlice<u16>,
    act: CudaSlice<u16>,
    out: CudaSlice<u16>,
    slots: CudaSlice<u16>,
    hidden: u32,
    ffn: u32,
    /// Experts of the grouped GEMMs: the routed ones, then the shared slices.
    gemm_experts: u32,
    top_k: u32,
    /// Combine slots per token: its routed pairs, then its shared slices.
    slots_per_token: u32,
}

/// Calls `gemm(expert, first row, rows)` for every expert with rows, from the expert
/// offsets `[E' + 1]` (routed experts, then shared slices).
fn for_each_expert(
    offsets: &[i32],
    mut gemm: impl FnMut(u64, u64, u32) -> Result<(), BaselineError>,
) -> Result<(), BaselineError> {
    for (e, bounds) in offsets.windows(2).enumerate() {
        let count = (bounds[1] - bounds[0]) as u32;
        if count > 0 {
            gemm(e as u64, bounds[0] as u64, count)?;
        }
    }
    Ok(())
}

fn rows_config(rows: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CublasBaseline {
    pub fn new(session: &Session, plan: &Plan) -> Result<Self, BaselineError> {
        let shape = &plan.shape;
        if shape.activation != Activation::Swiglu {
            return Err(BaselineError::Activation(shape.activation.name()));
        }
        // SAFETY: only dlopens libcublas by name.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(BaselineError::NoCublas);
        }
        let gpu = &session.gpu;
        let stream = &gpu.stream;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| BaselineError::Cublas {
            context: "creating the handle".into(),
            message: format!("{e:?}"),
        })?;
        let compiled = session.jit.compile(
            SOURCE,
            &CompileOptions::new("moeforge_baseline", gpu.arch()?),
        )?;
        let module = gpu.load(&compiled)?;
        let load = |m: &Arc<CudaModule>, name: &str| {
            m.load_function(name).context(format!("loading `{name}`"))
        };
        let pairs = shape.max_pairs() as usize;
        let (h, f) = (shape.hidden as usize, shape.ffn as usize);
        let alloc = |n: usize, what: &str| {
            stream
                .alloc_zeros::<u16>(n.max(1))
                .context(format!("allocating {what}"))
        };
        Ok(CublasBaseline {
            gather: load(&module, "baseline_gather")?,
            swiglu: load(&module, "baseline_swiglu")?,
            unpermute: load(&module, "baseline_unpermute")?,
            combine: load(&module, "baseline_combine")?,
            permuted: alloc(pairs * h, "permuted x")?,
            hidden_act: alloc(pairs * 2 * f, "GEMM1 output")?,
            act: alloc(pairs * f, "activation")?,
            out: alloc(pairs * h, "GEMM2 output")?,
            slots: alloc(pairs * h, "combine slots")?,
            blas,
            hidden: shape.hidden,
            ffn: shape.ffn,
            gemm_experts: shape.gemm_experts(),
            top_k: shape.top_k,
            slots_per_token: shape.slots_per_token(),
        })
    }

    /// `(m, n, k)` and device addresses of A [m, k], B [n, k] and C [n, m], row-major.
    fn gemm(
        &self,
        context: &str,
        (m, n, k): (u32, u32, u32),
        (a, b, c): (u64, u64, u64),
    ) -> Result<(), BaselineError> {
        // Row-major C[n, m] = B[n, k] · A[m, k]ᵀ is column-major C[m, n] = Aᵀ · B.
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: a, b, c point into live buffers holding m·k, n·k and m·n bf16 elements.
        unsafe {
            cublas_result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a as *const _,
                cublas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                b as *const _,
                cublas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                c as *mut _,
                cublas_sys::cudaDataType_t::CUDA_R_16BF,
                m as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| BaselineError::Cublas {
            context: context.to_string(),
            message: format!("{e:?}"),
        })
    }

    /// One forward call (synchronises once, to read the per-expert counts). `layer` routes
    /// the tokens with the plan's routing launch and lends its weights.
    pub fn forward(
        &self,
        session: &Session,
        layer: &MoeLayer,
        io: &mut DeviceWorkload,
    ) -> Result<(), BaselineError> {
        let stream = &session.gpu.stream;
        if io.tokens == 0 {
            return Ok(());
        }
        let address = |s: &CudaSlice<u16>| s.device_ptr(stream).0;
        layer.route(io.args())?;
        let workspace = |id: BufferId| {
            layer
                .workspace_buffer(id)
                .ok_or(BaselineError::MissingWorkspace(id.name()))
        };
        let row_pair = workspace(BufferId::RowPair)?;
        let offsets: Vec<i32> = stream
            .clone_dtoh(workspace(BufferId::ExpertOffsets)?)
            .context("reading expert offsets")?
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        // The offsets size the gathers and cuBLAS's GEMMs: a route that failed (an id out
        // of range) reports it, and the rest must be rows of this call.
        layer.take_error()?;
        let most_rows = io.tokens * self.slots_per_token;
        let (offsets, rows) = match offsets.get(..=self.gemm_experts as usize) {
            Some(used)
                if used.first() == Some(&0)
                    && used.windows(2).all(|w| w[0] <= w[1])
                    && used.last().is_some_and(|&last| last as u32 <= most_rows) =>
            {
                (used, used[used.len() - 1] as u32)
            }
            _ => {
                return Err(BaselineError::Offsets(format!(
                    "not rising from 0 to at most {most_rows} rows over {} experts",
                    self.gemm_experts
                )));
            }
        };
        let weights = layer.weights();
        let (h, f, k) = (self.hidden as i32, self.ffn as i32, self.top_k as i32);
        let slots = self.slots_per_token as i32;
        {
            let mut launch = stream.launch_builder(&self.gather);
            launch
                .arg(&io.x)
                .arg(row_pair)
                .arg(&slots)
                .arg(&h)
                .arg(&self.permuted);
            // SAFETY: one block per routed row; every buffer holds max_pairs rows.
            unsafe { launch.launch(rows_config(rows)) }.context("permuting")?;
        }
        let (w1, w2) = (address(&weights.w1), address(&weights.w2));
        let (permuted, hidden_act, act, out) = (
            address(&self.permuted),
            address(&self.hidden_act),
            address(&self.act),
            address(&self.out),
        );
        let (hu, fu) = (u64::from(self.hidden), u64::from(self.ffn));
        for_each_expert(offsets, |e, start, count| {
            self.gemm(
                "GEMM1",
                (2 * self.ffn, count, self.hidden),
                (
                    w1 + e * 2 * fu * hu * 2,
                    permuted + start * hu * 2,
                    hidden_act + start * 2 * fu * 2,
                ),
            )
        })?;
        {
            let mut launch = stream.launch_builder(&self.swiglu);
            launch.arg(&self.hidden_act).arg(&f).arg(&self.act);
            // SAFETY: one block per routed row.
            unsafe { launch.launch(rows_config(rows)) }.context("activation")?;
        }
        for_each_expert(offsets, |e, start, count| {
            self.gemm(
                "GEMM2",
                (self.hidden, count, self.ffn),
                (
                    w2 + e * hu * fu * 2,
                    act + start * fu * 2,
                    out + start * hu * 2,
                ),
            )
        })?;
        {
            let mut launch = stream.launch_builder(&self.unpermute);
            launch
                .arg(&self.out)
                .arg(row_pair)
                .arg(&io.topk_weights)
                .arg(&slots)
                .arg(&k)
                .arg(&h)
                .arg(&self.slots);
            // SAFETY: one block per routed row.
            unsafe { launch.launch(rows_config(rows)) }.context("un-permuting")?;
        }
        {
            let mut launch = stream.launch_builder(&self.combine);
            launch.arg(&self.slots).arg(&slots).arg(&h).arg(&mut io.y);
            // SAFETY: one block per token.
            unsafe { launch.launch(rows_config(io.tokens)) }.context("combining")?;
        }
        Ok(())
    }
}
