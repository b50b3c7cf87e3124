//! The launch table: which kernels one forward call runs, in stream order, with their
//! grids, shared memory and parameter lists. Codegen writes every entry point's parameter
//! list from [`Launch::params`]; the runtime binds the same list to buffers. Nothing else
//! states a kernel's signature.

use serde::{Deserialize, Serialize};

use super::{
    BufferId, COMBINE_THREADS, ElemType, GemmPlan, INVERT_ROWS_THREADS, LayerShape, ROUTE_THREADS,
    RowLoad, SORT_ROWS_THREADS, combine_blocks_per_token, static_smem_reserved,
};

/// One kernel launch of the forward call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub kernel: String,
    pub grid: Grid,
    pub block_threads: u32,
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
    /// Static shared memory the kernel declares, in bytes (asserted in the generated code).
    pub static_smem_bytes: u32,
    /// The kernel's parameters, in order.
    pub params: Vec<KernelParam>,
    /// The stream of its rank it runs on.
    #[serde(default)]
    pub stream: StreamRole,
    /// Whether it may start before the kernel ahead of it in the stream has finished
    /// (programmatic stream serialization, sm_90): its blocks start as SMs free up, and
    /// wait for that kernel and its memory (`griddepcontrol.wait`) before they read
    /// anything it writes (the mma.sync GEMM2 and the fused router first load weights
    /// and what older kernels wrote; the others wait first), then let the next kernel
    /// start early too. The single-GPU forward's kernels do, so that a call's launches
    /// overlap their ramps; a decode call is mostly ramps.
    #[serde(default)]
    pub early_start: bool,
}

/// Which of a rank's streams a launch goes to. Expert-parallel calls move data on one and
/// compute on the other, so that a rank computes while it still sends; the streams
/// synchronise only through flags within a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamRole {
    #[default]
    Compute,
    Comm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grid {
    /// A fixed number of blocks.
    Fixed(u32),
    /// `blocks_per_tile` blocks per tile of `tokens_per_tile` tokens of the call (the last
    /// tile ragged).
    TokenTiles {
        tokens_per_tile: u32,
        blocks_per_tile: u32,
    },
    /// As `TokenTiles`, each tile's blocks repeated for the split of a reduction over
    /// blocks that `k_split` gives for the call's count of token tiles (block `b` of a
    /// tile: piece `b / splits` of the tile, split `b % splits`).
    SplitTokenTiles {
        tokens_per_tile: u32,
        blocks_per_tile: u32,
        k_split: KSplit,
    },
}

impl Grid {
    /// The blocks of a call of `tokens` tokens; saturating, so that a grid no GPU could
    /// launch (a hand-edited plan's) stays too large for the checks against the SMs
    /// instead of wrapping.
    pub fn blocks(self, tokens: u32) -> u32 {
        match self {
            Grid::Fixed(n) => n,
            Grid::TokenTiles {
                tokens_per_tile,
                blocks_per_tile,
            } => tokens
                .div_ceil(tokens_per_tile.max(1))
                .saturating_mul(blocks_per_tile),
            Grid::SplitTokenTiles {
                tokens_per_tile,
                blocks_per_tile,
                k_split,
            } => {
                let unsplit = tokens
                    .div_ceil(tokens_per_tile.max(1))
                    .saturating_mul(blocks_per_tile);
                unsplit.saturating_mul(k_split.splits(unsplit))
            }
        }
    }
}

/// How a kernel splits a reduction of `steps` equal steps over blocks as well: over as
/// many blocks as keep the grid within `most_blocks` (one per SM: the split is there to
/// put more SMs' loads in flight), a divisor of `steps` so that every block takes the same
/// steps. A call with more tiles splits less; the kernel reads the split from its grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KSplit {
    pub steps: u32,
    pub most_blocks: u32,
}

impl KSplit {
    /// The splits of a grid of `unsplit_blocks` blocks: the largest divisor of `steps`
    /// that keeps the grid within `most_blocks`; at least 1.
    pub fn splits(self, unsplit_blocks: u32) -> u32 {
        (1..=self.steps)
            .rev()
            .find(|&s| {
                self.steps.is_multiple_of(s)
                    && u64::from(unsplit_blocks) * u64::from(s) <= u64::from(self.most_blocks)
            })
            .unwrap_or(1)
    }
}

/// One parameter of a kernel: what the runtime passes, and whether the kernel writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelParam {
    pub arg: LaunchArg,
    pub access: Access,
}

/// Whether a kernel only reads a buffer (a `const` pointer) or also writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
    /// Read while other ranks write it (flags, received data): no `__restrict__`, so the
    /// compiler never reads it through the non-coherent cache.
    ReadShared,
}

/// What the runtime passes for a kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaunchArg {
    /// bf16 [T, H] input activations.
    X,
    /// i32 [T, K] expert ids.
    TopkIds,
    /// f32 [T, K] routing weights.
    TopkWeights,
    /// bf16 [E, w1_rows, H].
    W1,
    /// bf16 [E, H, F].
    W2,
    /// A TMA tensor map over W1 seen as one bf16 matrix of `E · w1_rows` rows by H columns:
    /// boxes of `box_rows` rows (a tile's columns, or half of them) by 64 columns (128
    /// bytes), 128-byte swizzle. Passed by
    /// value (`__grid_constant__`) to the warp-specialised GEMM's producer.
    W1Tiles {
        box_rows: u32,
    },
    /// The same over W2, `E · H` rows by F columns.
    W2Tiles {
        box_rows: u32,
    },
    /// A TMA tensor map over the intermediate workspace buffer, its rows by F columns:
    /// boxes of `box_rows` rows (a tile's) by 64 columns, 128-byte swizzle. GEMM2's A
    /// rows where the plan loads them as tiles ([`super::RowLoad::Tiles`]).
    IntermediateTiles {
        box_rows: u32,
    },
    /// The same over [`BufferId::SortedX`], its rows by H columns: GEMM1's A rows where
    /// the plan loads them as tiles.
    SortedXTiles {
        box_rows: u32,
    },
    /// f32 [E, w1_rows]: each expert's bias on GEMM1's output (gate columns, then up
    /// columns, as W1's rows), added before the activation.
    W1Bias,
    /// f32 [E, H]: each expert's bias on GEMM2's output, added before the routing weight.
    W2Bias,
    /// bf16 `[H]`: the shared expert gate's weights (a gated shared expert only): a token's
    /// shared slices weigh `sigmoid(x[t] · w)`.
    SharedExpertGate,
    /// bf16 [T, H] output.
    Y,
    /// bf16 [E, H]: the router's gate weights.
    GateWeight,
    /// A TMA tensor map over the gate weights, E rows by H columns: boxes of `box_rows`
    /// rows (a gate tile's experts) by 64 columns, 128-byte swizzle. A warp-specialised
    /// gate's producer loads W_gate through it.
    GateWeightTiles {
        box_rows: u32,
    },
    /// f32 `[E]`: the router's per-expert bias (added to the logits or to the selection
    /// scores, as the rule says).
    GateBias,
    /// The token count T of the call, as i32.
    Tokens,
    /// 1 where the call runs without a route launch and the GEMMs' blocks route it
    /// ([`super::BlockRouting`]), else 0; as i32. One value for both GEMMs of the call.
    RoutesInBlocks,
    /// 1 where a fused router lays out the call's routing metadata after its select (the
    /// call runs the regime's table and its GEMMs do not route it in their blocks), else
    /// 0 (the fused decode or the GEMMs' blocks route it, or the expert-parallel kernels
    /// do); as i32.
    LaysOutRouting,
    /// This rank's index, as i32.
    Rank,
    /// The call's epoch (a counter the runtime raises every call), as u32: flags compare
    /// against it, so consecutive calls need no reset.
    Epoch,
    Workspace(BufferId),
}

/// The C type of a kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    /// A device pointer to elements of this type (`.u64` in PTX).
    Pointer(ElemType),
    /// A 32-bit signed integer passed by value (`.u32` in PTX).
    I32,
    /// A 32-bit unsigned integer passed by value (`.u32` in PTX).
    U32,
    /// A TMA tensor map (`CUtensorMap`, 128 bytes aligned to 64) passed by value.
    TensorMap,
}

/// Bytes of a tensor map parameter, and its alignment.
pub const TENSOR_MAP_BYTES: u32 = 128;
pub const TENSOR_MAP_ALIGN: u32 = 64;

impl LaunchArg {
    /// The parameter's name in the generated source and in `explain`.
    pub fn name(self) -> &'static str {
        match self {
            LaunchArg::X => "x",
            LaunchArg::TopkIds => "topk_ids",
            LaunchArg::TopkWeights => "topk_weights",
            LaunchArg::W1 => "w1",
            LaunchArg::W2 => "w2",
            LaunchArg::W1Tiles { .. } => "w1_tiles",
            LaunchArg::W2Tiles { .. } => "w2_tiles",
            LaunchArg::IntermediateTiles { .. } => "intermediate_tiles",
            LaunchArg::SortedXTiles { .. } => "sorted_x_tiles",
            LaunchArg::W1Bias => "w1_bias",
            LaunchArg::W2Bias => "w2_bias",
            LaunchArg::SharedExpertGate => "shared_expert_gate",
            LaunchArg::Y => "y",
            LaunchArg::GateWeight => "gate_weight",
            LaunchArg::GateWeightTiles { .. } => "gate_weight_tiles",
            LaunchArg::GateBias => "gate_bias",
            LaunchArg::Tokens => "tokens",
            LaunchArg::RoutesInBlocks => "routes_in_blocks",
            LaunchArg::LaysOutRouting => "lays_out_routing",
            LaunchArg::Rank => "rank",
            LaunchArg::Epoch => "epoch",
            LaunchArg::Workspace(id) => id.name(),
        }
    }

    pub fn param_type(self) -> ParamType {
        match self {
            LaunchArg::X
            | LaunchArg::W1
            | LaunchArg::W2
            | LaunchArg::Y
            | LaunchArg::GateWeight
            | LaunchArg::SharedExpertGate => ParamType::Pointer(ElemType::Bf16),
            LaunchArg::TopkIds => ParamType::Pointer(ElemType::I32),
            LaunchArg::TopkWeights
            | LaunchArg::GateBias
            | LaunchArg::W1Bias
            | LaunchArg::W2Bias => ParamType::Pointer(ElemType::F32),
            LaunchArg::Tokens
            | LaunchArg::RoutesInBlocks
            | LaunchArg::LaysOutRouting
            | LaunchArg::Rank => ParamType::I32,
            LaunchArg::Epoch => ParamType::U32,
            LaunchArg::W1Tiles { .. }
            | LaunchArg::W2Tiles { .. }
            | LaunchArg::IntermediateTiles { .. }
            | LaunchArg::SortedXTiles { .. }
            | LaunchArg::GateWeightTiles { .. } => ParamType::TensorMap,
            LaunchArg::Workspace(id) => ParamType::Pointer(id.elem()),
        }
    }
}

impl KernelParam {
    pub(super) fn read(arg: LaunchArg) -> Self {
        KernelParam {
            arg,
            access: Access::Read,
        }
    }

    pub(super) fn write(arg: LaunchArg) -> Self {
        KernelParam {
            arg,
            access: Access::Write,
        }
    }

    pub(super) fn shared(arg: LaunchArg) -> Self {
        KernelParam {
            arg,
            access: Access::ReadShared,
        }
    }
}

/// Static shared memory of the routing kernel: per-expert counts and offsets (i32), as
/// reserved.
pub fn route_static_smem_bytes(experts: u32) -> u32 {
    static_smem_reserved(4 * (2 * experts + 1))
}

/// Static shared memory of the routing over several blocks: the count launch's per-expert
/// counts of routed experts (i32 [E]); the place launch's per-expert pairs before this
/// block, next rows and offsets (i32 [E'], [E'], [E' + 1]), E' with the shared slices.
pub fn route_count_static_smem_bytes(routed_experts: u32) -> u32 {
    static_smem_reserved(4 * routed_experts)
}
pub fn route_place_static_smem_bytes(experts: u32) -> u32 {
    static_smem_reserved(4 * (3 * experts + 1))
}

/// How a regime lays out its routing metadata.
#[derive(Clone, Copy, Debug)]
pub enum RouteLaunches<'a> {
    /// One block walks every pair.
    OneBlock(&'a str),
    /// `blocks` blocks each take a slice of the pairs: `count` counts each slice's pairs per
    /// expert, `place` sums the counts and places each slice from its own start in every
    /// expert.
    Blocks {
        count: &'a str,
        place: &'a str,
        blocks: u32,
    },
}

/// The entry points one forward call launches, in stream order.
pub struct ForwardKernels<'a> {
    pub route: RouteLaunches<'a>,
    /// Launched after the routing, in this order, where GEMM1 loads its A rows as tiles.
    pub invert_rows: &'a str,
    pub sort_rows: &'a str,
    pub gemm1: &'a str,
    pub gemm2: &'a str,
    pub combine: &'a str,
}

/// How a GEMM kernel reads its weights: through a tensor map (warp-specialised engine,
/// boxes of [`GemmPlan::weight_box_rows`]) or a plain pointer.
pub fn weight_param(gemm: &GemmPlan, up: bool) -> KernelParam {
    let box_rows = gemm.weight_box_rows();
    KernelParam::read(match (gemm.warp_roles.is_some(), up) {
        (true, true) => LaunchArg::W1Tiles { box_rows },
        (true, false) => LaunchArg::W2Tiles { box_rows },
        (false, true) => LaunchArg::W1,
        (false, false) => LaunchArg::W2,
    })
}

/// The invert kernel's parameters: the call's row count (from the expert offsets) and row
/// order, and the inverse it writes.
pub(super) fn invert_rows_params() -> Vec<KernelParam> {
    use BufferId::*;
    use LaunchArg::*;
    vec![
        KernelParam::read(Workspace(ExpertOffsets)),
        KernelParam::read(Workspace(RowPair)),
        KernelParam::write(Workspace(PairRow)),
    ]
}

/// The sort kernel's parameters: x, the call's row count, the row order and its inverse,
/// and the sorted rows it writes.
pub(super) fn sort_rows_params() -> Vec<KernelParam> {
    use BufferId::*;
    use LaunchArg::*;
    vec![
        KernelParam::read(X),
        KernelParam::read(Workspace(ExpertOffsets)),
        KernelParam::read(Workspace(RowPair)),
        KernelParam::read(Workspace(PairRow)),
        KernelParam::write(Workspace(SortedX)),
    ]
}

/// How the single-GPU GEMM1 reads its A rows: as TMA tiles of x sorted into the
/// expert-major order, or gathered from x through the routing's row table (`row_pair`, the
/// second parameter then).
fn gemm1_rows_params(gemm: &GemmPlan) -> [Option<KernelParam>; 2] {
    match gemm.a_load {
        RowLoad::Tiles => [
            Some(KernelParam::read(LaunchArg::SortedXTiles {
                box_rows: gemm.tile.m,
            })),
            None,
        ],
        RowLoad::Gathered => [
            Some(KernelParam::read(LaunchArg::X)),
            Some(KernelParam::read(LaunchArg::Workspace(BufferId::RowPair))),
        ],
    }
}

/// How the single-GPU GEMM2 reads the intermediate rows: as TMA tiles or by pointer.
fn gemm2_rows_param(gemm: &GemmPlan) -> KernelParam {
    KernelParam::read(match gemm.a_load {
        RowLoad::Tiles => LaunchArg::IntermediateTiles {
            box_rows: gemm.tile.m,
        },
        RowLoad::Gathered => LaunchArg::Workspace(BufferId::Intermediate),
    })
}

/// The routing launches of a regime (`experts` routed, `gemm_experts` with the shared
/// slices).
fn route_launches(
    route: RouteLaunches<'_>,
    experts: u32,
    gemm_experts: u32,
    early_start: bool,
) -> Vec<Launch> {
    use BufferId::*;
    use LaunchArg::*;
    let (read, write) = (KernelParam::read, KernelParam::write);
    let launch =
        |kernel: &str, blocks: u32, static_smem_bytes: u32, params: Vec<KernelParam>| Launch {
            kernel: kernel.to_string(),
            grid: Grid::Fixed(blocks),
            block_threads: ROUTE_THREADS,
            smem_bytes: 0,
            static_smem_bytes,
            stream: StreamRole::Compute,
            early_start,
            params,
        };
    match route {
        RouteLaunches::OneBlock(kernel) => vec![launch(
            kernel,
            1,
            route_static_smem_bytes(gemm_experts),
            vec![
                read(TopkIds),
                read(Tokens),
                write(Workspace(ExpertOffsets)),
                write(Workspace(RowPair)),
                write(Workspace(ErrorWord)),
            ],
        )],
        RouteLaunches::Blocks {
            count,
            place,
            blocks,
        } => vec![
            launch(
                count,
                blocks,
                route_count_static_smem_bytes(experts),
                vec![
                    read(TopkIds),
                    read(Tokens),
                    write(Workspace(RouteBlockCounts)),
                    write(Workspace(ErrorWord)),
                ],
            ),
            launch(
                place,
                blocks,
                route_place_static_smem_bytes(gemm_experts),
                vec![
                    read(TopkIds),
                    read(Tokens),
                    read(Workspace(RouteBlockCounts)),
                    write(Workspace(ExpertOffsets)),
                    write(Workspace(RowPair)),
                    write(Workspace(ErrorWord)),
                ],
            ),
        ],
    }
}

/// Tokens (a warp each) per block of a rank's shared expert gate launch.
pub const SHARED_GATE_TOKENS_PER_BLOCK: u32 = 8;

/// A rank's launch that computes each of its tokens' shared-slice weight,
/// `sigmoid(x[t] · w_gate)`, into [`BufferId::SharedGate`] (a warp per token, the grid's
/// warps taking the tokens in turn, so any grid covers the call), on the compute stream
/// right before arrange, which reads them (on as many blocks as arrange, within the rank's
/// compute SMs as every kernel beside spin-waits must be). It starts the ordinary way: it
/// overwrites the weights the previous call's arrange may still be reading. One GPU has no
/// such launch: its GEMM1 computes the weights ([`shared_gate_params`]).
pub(crate) fn shared_gate_launch(kernel: &str, grid: Grid) -> Launch {
    use BufferId::*;
    use LaunchArg::*;
    Launch {
        kernel: kernel.to_string(),
        grid,
        block_threads: 32 * SHARED_GATE_TOKENS_PER_BLOCK,
        smem_bytes: 0,
        static_smem_bytes: 0,
        stream: StreamRole::Compute,
        early_start: false,
        params: vec![
            KernelParam::read(X),
            KernelParam::read(SharedExpertGate),
            KernelParam::read(Tokens),
            KernelParam::write(Workspace(SharedGate)),
        ],
    }
}

/// What one GPU's GEMM1 takes besides its own parameters (`gemm1`) for a gated shared
/// expert: x and the token count where it lacks them, the gate's weights, and the buffer of
/// the tokens' shared-slice weights, which its warps write before its tiles (a warp per
/// token, spread over the blocks first) and GEMM2 reads once GEMM1 is done. x's rows are
/// read there anyway, so no launch of its own.
pub(crate) fn shared_gate_params(gemm1: &[KernelParam]) -> Vec<KernelParam> {
    use LaunchArg::*;
    let lacks = |arg| gemm1.iter().all(|param| param.arg != arg);
    [X, Tokens]
        .into_iter()
        .filter(|&arg| lacks(arg))
        .map(KernelParam::read)
        .chain([
            KernelParam::read(SharedExpertGate),
            KernelParam::write(Workspace(BufferId::SharedGate)),
        ])
        .collect()
}

/// The stream-K buffers a single-GPU GEMM takes where its plan splits few-tile calls.
fn stream_k_params(gemm: &GemmPlan) -> Vec<KernelParam> {
    if gemm.stream_k.is_none() {
        return Vec::new();
    }
    vec![
        KernelParam::write(LaunchArg::Workspace(BufferId::StreamKPartials)),
        KernelParam::write(LaunchArg::Workspace(BufferId::StreamKTilesDone)),
    ]
}

/// The ticket a warp-specialised GEMM claims its work units from (both GEMMs' tickets:
/// GEMM1 takes the first, GEMM2 the second), on one GPU or a rank.
pub(crate) fn unit_ticket_params(gemm: &GemmPlan) -> Vec<KernelParam> {
    if !gemm.claims_units() {
        return Vec::new();
    }
    vec![KernelParam::write(LaunchArg::Workspace(
        BufferId::UnitTickets,
    ))]
}

/// What a single-GPU GEMM that routes small calls in its blocks takes for it: the call's
/// ids and token count, whether this call routes so; GEMM1, the first kernel of such a
/// call, also the error word (its block 0 clears it and reports ids out of range).
fn block_routing_params(gemm: &GemmPlan, up: bool) -> Vec<KernelParam> {
    if gemm.block_routing.is_none() {
        return Vec::new();
    }
    let mut params = vec![
        KernelParam::read(LaunchArg::TopkIds),
        KernelParam::read(LaunchArg::Tokens),
        KernelParam::read(LaunchArg::RoutesInBlocks),
    ];
    if up {
        params.push(KernelParam::write(LaunchArg::Workspace(
            BufferId::ErrorWord,
        )));
    }
    params
}

/// The launches of one forward call of a regime of a layer of `shape` (its routed experts
/// and the shared slices; with expert biases the GEMMs take them too); with `early_start`
/// each may start before the previous one ends.
pub fn launch_table(
    kernels: ForwardKernels<'_>,
    shape: &LayerShape,
    g1: &GemmPlan,
    g2: &GemmPlan,
    early_start: bool,
) -> Vec<Launch> {
    use BufferId::*;
    use LaunchArg::*;
    let (read, write) = (KernelParam::read, KernelParam::write);
    let bias = |arg| shape.expert_bias.then(|| read(arg));
    let mut launches = route_launches(
        kernels.route,
        shape.experts,
        shape.gemm_experts(),
        early_start,
    );
    let [a_rows, row_table] = gemm1_rows_params(g1);
    if g1.a_load == RowLoad::Tiles {
        let per_token = |kernel: &str, block_threads, static_smem_bytes, params| Launch {
            kernel: kernel.to_string(),
            grid: Grid::TokenTiles {
                tokens_per_tile: 1,
                blocks_per_tile: 1,
            },
            block_threads,
            smem_bytes: 0,
            static_smem_bytes,
            stream: StreamRole::Compute,
            early_start,
            params,
        };
        launches.extend([
            per_token(
                kernels.invert_rows,
                INVERT_ROWS_THREADS,
                0,
                invert_rows_params(),
            ),
            // The sort's static shared memory: the token's rows (i32 [slots per token]).
            per_token(
                kernels.sort_rows,
                SORT_ROWS_THREADS,
                static_smem_reserved(4 * shape.slots_per_token()),
                sort_rows_params(),
            ),
        ]);
    }
    let mut gemm1_params: Vec<KernelParam> = [a_rows, Some(weight_param(g1, true)), bias(W1Bias)]
        .into_iter()
        .chain([Some(read(Workspace(ExpertOffsets))), row_table])
        .flatten()
        .chain([write(Workspace(Intermediate))])
        .chain(stream_k_params(g1))
        .chain(unit_ticket_params(g1))
        .chain(block_routing_params(g1, true))
        .collect();
    if shape.shared_gated {
        let gate = shared_gate_params(&gemm1_params);
        gemm1_params.extend(gate);
    }
    launches.extend([
        Launch {
            kernel: kernels.gemm1.to_string(),
            grid: Grid::Fixed(g1.grid_blocks),
            block_threads: g1.threads(),
            smem_bytes: g1.smem_bytes,
            static_smem_bytes: g1.smem.static_bytes,
            stream: StreamRole::Compute,
            early_start,
            params: gemm1_params,
        },
        Launch {
            kernel: kernels.gemm2.to_string(),
            grid: Grid::Fixed(g2.grid_blocks),
            block_threads: g2.threads(),
            smem_bytes: g2.smem_bytes,
            static_smem_bytes: g2.smem.static_bytes,
            stream: StreamRole::Compute,
            early_start,
            params: [gemm2_rows_param(g2), weight_param(g2, false)]
                .into_iter()
                .chain(bias(W2Bias))
                .chain(shape.shared_gated.then(|| read(Workspace(SharedGate))))
                .chain([
                    read(TopkWeights),
                    read(Workspace(ExpertOffsets)),
                    read(Workspace(RowPair)),
                    write(Workspace(CombineSlots)),
                ])
                .chain(stream_k_params(g2))
                .chain(unit_ticket_params(g2))
                .chain(block_routing_params(g2, false))
                .collect(),
        },
        Launch {
            kernel: kernels.combine.to_string(),
            grid: Grid::TokenTiles {
                tokens_per_tile: 1,
                blocks_per_tile: combine_blocks_per_token(shape.hidden),
            },
            block_threads: COMBINE_THREADS,
            smem_bytes: 0,
            static_smem_bytes: 0,
            stream: StreamRole::Compute,
            early_start,
            params: vec![read(Workspace(CombineSlots)), read(TopkIds), write(Y)],
        },
    ]);
    launches
}
