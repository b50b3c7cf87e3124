//! Codegen: writes a [`Plan`] out as one self-contained CUDA C++ unit (askama templates in
//! `compiler/templates/`).
//!
//! Architecture invariant: the generated source is a pure function of the plan. It makes
//! no decision of its own (every size, tile and entry-point name comes from the plan), it
//! includes no toolkit header, and its output is byte-for-byte stable, so that
//! `kernels-generated/` diffs are reviewable.

use askama::Template;
use thiserror::Error;

use crate::ir::Activation;
use crate::plan::{COMBINE_THREADS, GemmPlan, MmaEngine, Plan, ROUTE_THREADS, Regime, error_code};

/// The generated CUDA unit of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// File name for the unit, `<layer>.cu`.
    pub file_name: String,
    pub source: String,
    /// `extern "C"` entry points, in the order they appear in the plan.
    pub entry_points: Vec<String>,
}

#[derive(Debug, Error)]
pub enum CodegenError {
    #[error("template rendering failed: {0}")]
    Template(#[from] askama::Error),
}

#[derive(Template)]
#[template(path = "layer.cu")]
struct LayerUnit<'a> {
    layer: &'a str,
    route_kernel: &'a str,
    combine_kernel: &'a str,
    arch: &'a str,
    limitations: &'a [String],
    hidden: u32,
    ffn: u32,
    experts: u32,
    top_k: u32,
    gated: bool,
    route_threads: u32,
    combine_threads: u32,
    error_expert_id: i32,
    activation: &'static str,
    activation_fn: &'static str,
    regimes: Vec<RegimeUnit>,
    /// Distinct wgmma widths (tile columns) the plan uses, ascending.
    wgmma_widths: Vec<u32>,
}

impl LayerUnit<'_> {
    /// `%0, %1, …` for the accumulator operands of one `wgmma` of width `n`.
    fn wgmma_operands(&self, n: &u32) -> String {
        (0..n / 2)
            .map(|i| format!("%{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `"+f"(d[0]), …` for the same operands.
    fn wgmma_outputs(&self, n: &u32) -> String {
        (0..n / 2)
            .map(|i| format!("\"+f\"(d[{i}])"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

struct RegimeUnit {
    name: String,
    min_tokens: u32,
    max_tokens: u32,
    gemms: [GemmUnit; 2],
}

struct GemmUnit {
    role: &'static str,
    up: bool,
    wgmma: bool,
    engine: &'static str,
    entry: String,
    bm: u32,
    bn: u32,
    stages: u32,
    warps_m: u32,
    warps_n: u32,
    threads: u32,
    blocks_per_sm: u32,
    grid: u32,
    smem: u32,
}

impl GemmUnit {
    fn new(role: &'static str, up: bool, entry: &str, gemm: &GemmPlan) -> Self {
        GemmUnit {
            role,
            up,
            wgmma: gemm.engine == MmaEngine::Wgmma,
            engine: gemm.engine.name(),
            entry: entry.to_string(),
            bm: gemm.tile.m,
            bn: gemm.tile.n,
            stages: gemm.stages,
            warps_m: gemm.warps_m,
            warps_n: gemm.warps_n,
            threads: gemm.threads(),
            blocks_per_sm: gemm.blocks_per_sm,
            grid: gemm.grid_blocks,
            smem: gemm.smem_bytes,
        }
    }
}

/// The device function applying the layer's activation in GEMM1's epilogue.
fn activation_fn(activation: Activation) -> &'static str {
    match activation {
        Activation::Swiglu => {
            "__device__ __forceinline__ float activate(float gate, float up) { return silu(gate) * up; }"
        }
        Activation::Geglu => {
            "__device__ __forceinline__ float activate(float gate, float up) { return gelu_tanh(gate) * up; }"
        }
        // Ungated activations ignore `up` (always 0): one signature keeps GEMM1's epilogue uniform.
        Activation::Gelu => {
            "__device__ __forceinline__ float activate(float h, float) { return gelu_tanh(h); }"
        }
        Activation::Relu => {
            "__device__ __forceinline__ float activate(float h, float) { return fmaxf(h, 0.f); }"
        }
        Activation::Silu => {
            "__device__ __forceinline__ float activate(float h, float) { return silu(h); }"
        }
    }
}

fn regime_unit(regime: &Regime) -> RegimeUnit {
    RegimeUnit {
        name: regime.name.clone(),
        min_tokens: regime.min_tokens,
        max_tokens: regime.max_tokens,
        gemms: [
            GemmUnit::new(
                "GEMM1 (gather, W1, activation)",
                true,
                &regime.gemm1_kernel,
                &regime.gemm1,
            ),
            GemmUnit::new(
                "GEMM2 (W2, routing weight, combine slot)",
                false,
                &regime.gemm2_kernel,
                &regime.gemm2,
            ),
        ],
    }
}

/// Renders the CUDA unit of `plan`.
pub fn generate(plan: &Plan) -> Result<KernelSource, CodegenError> {
    let shape = &plan.shape;
    let unit = LayerUnit {
        layer: &plan.layer,
        route_kernel: &plan.route_kernel,
        combine_kernel: &plan.combine_kernel,
        arch: &plan.target.arch,
        limitations: &plan.limitations,
        hidden: shape.hidden,
        ffn: shape.ffn,
        experts: shape.experts,
        top_k: shape.top_k,
        gated: shape.activation.is_gated(),
        route_threads: ROUTE_THREADS,
        combine_threads: COMBINE_THREADS,
        error_expert_id: error_code::EXPERT_ID_OUT_OF_RANGE,
        activation: shape.activation.name(),
        activation_fn: activation_fn(shape.activation),
        regimes: plan.regimes.iter().map(regime_unit).collect(),
        wgmma_widths: wgmma_widths(plan),
    };
    Ok(KernelSource {
        file_name: format!("{}.cu", plan.symbol),
        source: unit.render()?,
        entry_points: plan.entry_points(),
    })
}

fn wgmma_widths(plan: &Plan) -> Vec<u32> {
    let mut widths: Vec<u32> = plan
        .regimes
        .iter()
        .flat_map(|r| [&r.gemm1, &r.gemm2])
        .filter(|g| g.engine == MmaEngine::Wgmma)
        .map(|g| g.tile.n)
        .collect();
    widths.sort_unstable();
    widths.dedup();
    widths
}
