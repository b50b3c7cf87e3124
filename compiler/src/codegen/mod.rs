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
use crate::plan::{
    Access, BufferId, GemmPlan, Launch, LaunchArg, MmaEngine, ParamType, Plan, Regime,
    SMEM_ROW_BYTES, STATIC_SMEM_GRANULE, SmemLayout, error_code,
};

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
    #[error("the plan launches no kernel `{kernel}`; the plan is inconsistent")]
    MissingLaunch { kernel: String },
    #[error(
        "the plan gives `{kernel}` the parameters ({plan}), but its template body uses ({template}); the plan and the templates disagree"
    )]
    SignatureMismatch {
        kernel: String,
        plan: String,
        template: String,
    },
}

#[derive(Template)]
#[template(path = "layer.cu")]
struct LayerUnit<'a> {
    layer: &'a str,
    arch: &'a str,
    target: &'a str,
    limitations: &'a [String],
    hidden: u32,
    ffn: u32,
    experts: u32,
    top_k: u32,
    smem_row_bytes: u32,
    static_smem_granule: u32,
    route: EntryUnit,
    combine: EntryUnit,
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

/// An `extern "C"` entry point: its name, its parameter list written from the plan's
/// launch, and the launch's block size and static shared memory.
struct EntryUnit {
    name: String,
    params: String,
    threads: u32,
    static_smem: u32,
}

/// The parameters each template body refers to by name, per kernel role. Codegen refuses a
/// plan whose launch gives a kernel other parameters, so that a plan and the templates can
/// never silently disagree about a signature.
const ROUTE_USES: &[&str] = &[
    "topk_ids",
    "tokens",
    "expert_offsets",
    "row_pair",
    "error_word",
];
const GEMM_UP_USES: &[&str] = &["x", "w1", "expert_offsets", "row_pair", "intermediate"];
const GEMM_DOWN_USES: &[&str] = &[
    "intermediate",
    "w2",
    "topk_weights",
    "expert_offsets",
    "row_pair",
    "combine_slots",
];
const COMBINE_USES: &[&str] = &["combine_slots", "topk_ids", "y"];

/// What one parameter holds, for the comment beside it.
fn param_comment(arg: LaunchArg) -> &'static str {
    match arg {
        LaunchArg::X => "[tokens, HIDDEN]",
        LaunchArg::TopkIds | LaunchArg::TopkWeights => "[tokens, TOP_K]",
        LaunchArg::W1 => "[EXPERTS, W1 rows, HIDDEN]",
        LaunchArg::W2 => "[EXPERTS, HIDDEN, FFN]",
        LaunchArg::Y => "[tokens, HIDDEN]",
        LaunchArg::Tokens => "tokens in this call",
        LaunchArg::Workspace(BufferId::ExpertOffsets) => "[EXPERTS + 1], workspace",
        LaunchArg::Workspace(BufferId::RowPair) => "[tokens * TOP_K], workspace",
        LaunchArg::Workspace(BufferId::Intermediate) => "[tokens * TOP_K, FFN], workspace",
        LaunchArg::Workspace(BufferId::CombineSlots) => "[tokens * TOP_K, HIDDEN], workspace",
        LaunchArg::Workspace(BufferId::ErrorWord) => "[4]: code, token, k, value",
    }
}

impl EntryUnit {
    /// The entry point of `kernel` as the plan launches it, checked against the names its
    /// template body uses.
    fn new(plan: &Plan, kernel: &str, uses: &[&str]) -> Result<Self, CodegenError> {
        let launch = find_launch(plan, kernel)?;
        let names: Vec<&str> = launch.params.iter().map(|p| p.arg.name()).collect();
        let mut sorted_plan = names.clone();
        let mut sorted_uses = uses.to_vec();
        sorted_plan.sort_unstable();
        sorted_uses.sort_unstable();
        if sorted_plan != sorted_uses {
            return Err(CodegenError::SignatureMismatch {
                kernel: kernel.to_string(),
                plan: names.join(", "),
                template: uses.join(", "),
            });
        }
        let params = launch
            .params
            .iter()
            .map(|p| {
                let declaration = match (p.arg.param_type(), p.access) {
                    (ParamType::I32, _) => format!("int {}", p.arg.name()),
                    (ParamType::Pointer(elem), Access::Read) => {
                        format!("const {}* __restrict__ {}", elem.c_type(), p.arg.name())
                    }
                    (ParamType::Pointer(elem), Access::Write) => {
                        format!("{}* __restrict__ {}", elem.c_type(), p.arg.name())
                    }
                };
                (declaration, param_comment(p.arg))
            })
            .collect::<Vec<_>>();
        let count = params.len();
        let params = params
            .into_iter()
            .enumerate()
            .map(|(i, (declaration, comment))| {
                let separator = if i + 1 < count { "," } else { "" };
                format!("{declaration}{separator}  // {comment}")
            })
            .collect::<Vec<_>>()
            .join("\n    ");
        Ok(EntryUnit {
            name: kernel.to_string(),
            params,
            threads: launch.block_threads,
            static_smem: launch.static_smem_bytes,
        })
    }
}

/// The launch of `kernel` in the plan's first regime that runs it.
fn find_launch<'p>(plan: &'p Plan, kernel: &str) -> Result<&'p Launch, CodegenError> {
    plan.regimes
        .iter()
        .flat_map(|r| &r.launches)
        .find(|l| l.kernel == kernel)
        .ok_or_else(|| CodegenError::MissingLaunch {
            kernel: kernel.to_string(),
        })
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
    engine: &'static str,
    /// The device template that runs the GEMM.
    function: &'static str,
    /// The name of its config struct: `<regime>_gemm1`.
    config: String,
    kind: &'static str,
    gated: bool,
    n: &'static str,
    kd: &'static str,
    entry: EntryUnit,
    bm: u32,
    bn: u32,
    bk: u32,
    stages: u32,
    warps_m: u32,
    warps_n: u32,
    threads: u32,
    b_rows: u32,
    smem: SmemLayout,
    blocks_per_sm: u32,
    grid: u32,
}

impl GemmUnit {
    fn new(
        plan: &Plan,
        regime: &Regime,
        up: bool,
        kernel: &str,
        gemm: &GemmPlan,
    ) -> Result<Self, CodegenError> {
        let (role, config, kind, n, kd, uses) = if up {
            (
                "GEMM1 (gather, W1, activation)",
                format!("{}_gemm1", regime.name),
                "GEMM_UP",
                "FFN",
                "HIDDEN",
                GEMM_UP_USES,
            )
        } else {
            (
                "GEMM2 (W2, routing weight, combine slot)",
                format!("{}_gemm2", regime.name),
                "GEMM_DOWN",
                "HIDDEN",
                "FFN",
                GEMM_DOWN_USES,
            )
        };
        let entry = EntryUnit::new(plan, kernel, uses)?;
        Ok(GemmUnit {
            role,
            up,
            engine: gemm.engine.name(),
            function: match gemm.engine {
                MmaEngine::MmaSync => "grouped_gemm",
                MmaEngine::Wgmma => "grouped_gemm_wgmma",
            },
            config,
            kind,
            gated: up && plan.shape.activation.is_gated(),
            n,
            kd,
            entry,
            bm: gemm.tile.m,
            bn: gemm.tile.n,
            bk: gemm.tile.k,
            stages: gemm.stages,
            warps_m: gemm.warps_m,
            warps_n: gemm.warps_n,
            threads: gemm.threads(),
            b_rows: gemm.b_rows,
            smem: gemm.smem,
            blocks_per_sm: gemm.blocks_per_sm,
            grid: gemm.grid_blocks,
        })
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

fn regime_unit(plan: &Plan, regime: &Regime) -> Result<RegimeUnit, CodegenError> {
    Ok(RegimeUnit {
        name: regime.name.clone(),
        min_tokens: regime.min_tokens,
        max_tokens: regime.max_tokens,
        gemms: [
            GemmUnit::new(plan, regime, true, &regime.gemm1_kernel, &regime.gemm1)?,
            GemmUnit::new(plan, regime, false, &regime.gemm2_kernel, &regime.gemm2)?,
        ],
    })
}

/// Renders the CUDA unit of `plan`.
pub fn generate(plan: &Plan) -> Result<KernelSource, CodegenError> {
    let shape = &plan.shape;
    let unit = LayerUnit {
        layer: &plan.layer,
        arch: &plan.target.arch,
        target: &plan.target.name,
        limitations: &plan.limitations,
        hidden: shape.hidden,
        ffn: shape.ffn,
        experts: shape.experts,
        top_k: shape.top_k,
        smem_row_bytes: SMEM_ROW_BYTES,
        static_smem_granule: STATIC_SMEM_GRANULE,
        route: EntryUnit::new(plan, &plan.route_kernel, ROUTE_USES)?,
        combine: EntryUnit::new(plan, &plan.combine_kernel, COMBINE_USES)?,
        error_expert_id: error_code::EXPERT_ID_OUT_OF_RANGE,
        activation: shape.activation.name(),
        activation_fn: activation_fn(shape.activation),
        regimes: plan
            .regimes
            .iter()
            .map(|regime| regime_unit(plan, regime))
            .collect::<Result<_, _>>()?,
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
