//! A schedule simulator: one call of a plan's expert-parallel schedule on the layer's
//! declared topology, as a discrete-event model, for three schedules of the same layer,
//! and across real nodes a fourth, the kernels as built:
//!
//! - **bulk-synchronous**: all-to-all of token rows (the plan's send order, straight to
//!   every destination), a barrier, both GEMMs with every row present, a barrier, an
//!   all-to-all of the weighted result rows back to their origins, the reduce;
//! - **fine-grained, naive order**: every source sends to destinations 0, 1, 2, …; GEMM1
//!   tiles wait for the chunk flags of their rows; GEMM2 stores each row into its origin;
//!   the origin's combine waits for every contribution;
//! - **fine-grained, topology-aware**: the plan's rotated send order; tokens bound for a
//!   remote node cross the network once (to the rank of that node with the sender's local
//!   index) and fan out over NVLink there; results come back the same way, reduced on the
//!   remote node first. Across nodes both GEMMs run as one grid in which a block takes a
//!   GEMM2 tile as soon as GEMM1 has stored its rows, else a GEMM1 tile whose chunks have
//!   arrived (Comet's GEMM-to-GEMM overlap: GEMM2 fills the time GEMM1's blocks would wait
//!   for the network; `benches/results/2026-12-02_simulator_gemm_overlap.md`). This
//!   schedule is the design across nodes: the kernels run its hierarchical exchange but
//!   not this overlap (GEMM2 is a kernel after GEMM1, its phases in receive order). Across
//!   real nodes the first three schedules model results as pair rows (the design's),
//!   whatever the plan's route;
//! - **as built** (across real nodes only; on one node the topology-aware schedule is what
//!   the kernels run): the topology-aware exchange (each other node gets the rows of the
//!   tokens visiting it, as the routed chunk steps move them, none before the host has read
//!   the rows per chunk back: `plan::network::HOST_READBACK_S` after the metadata's
//!   arrival, none where the plan moves whole chunks at the call's bound, whose rows of
//!   every token up to the bound then cross instead of the visiting ones; the host enqueues
//!   the compute kernels after those steps, so arrange waits for it too),
//!   GEMM2 after GEMM1, and results as rank partials stored at the relay of the origin's
//!   rail, summed there once every rank of the node has stored, then the node partials of
//!   the visiting tokens back through NCCL.
//!
//! What it models: per rank, the plan's communication blocks taking work items (chunks of
//! `dispatch_chunk` tokens per destination, or `dispatch_piece` pieces when a call has
//! fewer chunks than blocks) in send order, each moving at most
//! `model::COMM_BLOCK_BYTES_PER_S` (an item for another node: the block stages its rows
//! in this rank's outbox at that rate and goes on, and the network port moves them from
//! there, as NCCL does on the real path); link ports (per rank: NVLink out and in, network
//! out and in) at the topology's bandwidth, with its latency; flag latencies; the GEMM grids
//! of the plan's regime taking tiles in the kernels' order (phase, i.e. the source of a
//! tile's last row in receive order, then expert, column tile, row tile; both GEMMs), a
//! warp-specialised GEMM's next tile going to the block free first (its units claimed in
//! order from a ticket), an mma.sync GEMM's block b taking tiles `b, b + grid, …`; a GEMM1
//! tile starting when its block is free and the chunks of its rows have arrived (in the
//! one grid of the topology-aware schedule across nodes, GEMM1's blocks take both GEMMs'
//! tiles, each at its own GEMM's tile cost, as if one kernel held both tile shapes); tile
//! times from `model::tile_cost`; the reduce at the origin. Residency: whether every block
//! a spin-wait depends on can be resident with the plan's grids (else a [`Deadlock`]), and
//! whether routing fits the plan's capacities (else [`SimError::Overflow`]).
//!
//! The ranks' fused decode (a call the plan's first rank regime fuses, on one node, unless
//! [`Options::fused_decode`] is off) is what the kernels' own two schedules then run: one
//! launch; its grid sends a row per work unit from `model::FUSED_SEND_START_S` after it;
//! each rank lays out its rows a flag latency after the farthest source's launch plus
//! `model::FUSED_LAYOUT_S` and a cost per pair; then the grid takes every GEMM1 tile, then
//! every GEMM2 tile, from one ticket (a GEMM2 tile once its expert's GEMM1 tiles are
//! stored), both GEMMs together no faster than their weights stream from HBM; GEMM2
//! stores rows at their origins (pair rows, whatever the table's route) and the same grid
//! sums each origin's tokens, with no launch between. Fitted to six cells of two virtual
//! ranks (benches/results/2026-12-04_ep_fused_decode.md, within 13%). The
//! bulk-synchronous baseline runs the table, as the bench's does.
//!
//! Granularity: tokens are never simulated one by one. Routing is drawn per token once and
//! reduced to counts (per source and destination, expert, node); a transfer is a work item
//! (a chunk, a piece or a node-aggregated chunk); rows of one (local expert, source)
//! segment are assumed spread evenly over that source's chunks (row i of n needs the chunk
//! holding slot ⌈(i+1)·tokens/n⌉); GEMM tiles are simulated one by one, sharing the
//! readiness of their row tile.
//!
//! What it leaves out: ports are FIFO servers (a transfer takes the later of its block's
//! time and its turn on the sender's egress and the receiver's ingress), not fair sharing;
//! the switch fabric and NIC rails beyond one port per rank; the forwarding of
//! node-aggregated chunks costs the relay's NVLink port but none of its blocks; a wgmma
//! GEMM's tiles share HBM evenly (an mma.sync GEMM's draw on it as a fluid, up to a cap
//! per block, see `model::BLOCK_HBM_BYTES_PER_S`), and no tile slows down under
//! concurrent copies; an origin's results leave a rank as an even stream over the span of
//! GEMM2's tiles holding its rows (so an early source's results leave before GEMM2
//! ends); the router and the previous call (credits)
//! are not modelled (the shared experts are: each rank's slices on its own tokens, after
//! its local experts, ready at once); every kernel launch costs the target's launch
//! overhead once; virtual ranks each get an even share of their GPU (SMs, tensor rate,
//! HBM and L2 bandwidth) throughout, as if they ran every kernel in step; one call is
//! simulated alone, while the bench times calls back to back.

mod engine;
pub(crate) mod model;
mod routing;
mod svg;

pub mod calibration;

use thiserror::Error;

use crate::ir;
use crate::plan::Plan;
use crate::plan::ep::{ExpertParallelPlan, Placement};

pub use routing::{Routing, Traffic};
pub use svg::timeline_svg;

/// Why a simulation could not run.
#[derive(Debug, Error, PartialEq)]
pub enum SimError {
    #[error("layer `{0}` has no expert-parallel plan (one rank): nothing to simulate")]
    NotExpertParallel(String),
    #[error("{tokens} tokens per rank exceed the plan's max_tokens {max}")]
    TooManyTokens { tokens: u32, max: u32 },
    #[error("{0}")]
    Shape(String),
    #[error("the plan has {plan} ranks but the topology provides {topology}")]
    RankMismatch { plan: u32, topology: u32 },
    #[error("routing overflows the plan's capacity: {0}")]
    Overflow(String),
    #[error("measured results: {0}")]
    Measured(String),
}

/// The schedules compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    BulkSynchronous,
    FineGrainedNaive,
    FineGrainedTopologyAware,
    /// Across real nodes, what the kernels as built run (on one node the topology-aware
    /// schedule is that already).
    AsBuilt,
}

impl Schedule {
    pub const ALL: [Schedule; 4] = [
        Schedule::BulkSynchronous,
        Schedule::FineGrainedNaive,
        Schedule::FineGrainedTopologyAware,
        Schedule::AsBuilt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Schedule::BulkSynchronous => "bulk-synchronous",
            Schedule::FineGrainedNaive => "fine-grained, naive order",
            Schedule::FineGrainedTopologyAware => "fine-grained, topology-aware",
            Schedule::AsBuilt => "as built (today's kernels)",
        }
    }
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct Options {
    pub tokens_per_rank: u32,
    pub routing: Routing,
    /// Ranks whose activity is recorded for the timeline (the first ones); 0 for none.
    pub timeline_ranks: u32,
    /// Whether a call the plan's fused decode covers runs it, as the runtime does (else
    /// the table, as with `MOEFORGE_FUSED_DECODE=0`).
    pub fused_decode: bool,
}

/// A spin-wait whose producer cannot be resident.
#[derive(Clone, Debug, PartialEq)]
pub struct Deadlock {
    /// The block that waits, e.g. "rank 0 GEMM1 block 0".
    pub waiting: String,
    /// What it waits for, e.g. "chunk flag 0 of source rank 3".
    pub waits_for: String,
    /// Why the producer never runs.
    pub reason: String,
}

/// Per source rank: its pairs as the simulator moved them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Accounting {
    /// Pairs the source routed (T·K).
    pub pairs_routed: Vec<u64>,
    /// Pairs of the source that became GEMM rows on some rank.
    pub pairs_dispatched: Vec<u64>,
    /// Pairs of the source whose result rows reached its combine.
    pub pairs_combined: Vec<u64>,
    /// (source, destination) pairs whose delivered tokens differ from the tokens sent.
    pub token_mismatches: Vec<(u32, u32)>,
}

/// One span of a rank's timeline, in seconds from the call's start.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub start: f64,
    pub end: f64,
    pub label: String,
}

/// What the recorded ranks did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankTimeline {
    /// Work items of the communication blocks (transfers), labelled with the destination.
    pub comm: Vec<Span>,
    /// Kernels of the compute stream (GEMM1, GEMM2, combine).
    pub kernels: Vec<Span>,
    /// Tiles of the first GEMM block (gaps are waits).
    pub tiles: Vec<Span>,
}

/// One schedule's prediction.
#[derive(Clone, Debug)]
pub struct ScheduleReport {
    pub schedule: Schedule,
    /// From the call's start to the last token's output on the slowest rank.
    pub layer_s: f64,
    /// From the call's start until every token row has arrived where it is computed.
    pub dispatch_s: f64,
    /// From the last GEMM2 tile computed (any rank) to the last token reduced.
    pub combine_s: f64,
    /// The busiest rank's GEMM time (both GEMMs, tiles back to back, no waits).
    pub compute_s: f64,
    /// The busiest rank's egress bytes over the network over its port's bandwidth.
    pub network_s: f64,
    pub accounting: Accounting,
    pub timeline: Vec<RankTimeline>,
}

impl ScheduleReport {
    /// The layer time over the larger of its compute and network times: 1 is a schedule
    /// that hides the one under the other completely.
    pub fn over_bound(&self) -> f64 {
        self.layer_s / self.compute_s.max(self.network_s)
    }
}

/// The simulator's answer for one call.
#[derive(Clone, Debug)]
pub struct Report {
    pub layer: String,
    pub ranks: u32,
    pub nodes: u32,
    pub tokens_per_rank: u32,
    pub routing: Routing,
    /// The regime of the rank kernels that serves this call.
    pub regime: String,
    /// `Some` when some spin-wait can never be satisfied; the schedules are then not run.
    pub deadlock: Option<Deadlock>,
    pub schedules: Vec<ScheduleReport>,
}

impl Report {
    pub fn schedule(&self, schedule: Schedule) -> Option<&ScheduleReport> {
        self.schedules.iter().find(|s| s.schedule == schedule)
    }

    /// How much shorter the topology-aware schedule's dispatch and combine are than the
    /// bulk-synchronous one's, as a fraction of the latter (issue 10's measure of the
    /// exchange); `None` without both schedules.
    pub fn exchange_reduction(&self) -> Option<f64> {
        let exchange = |s: &ScheduleReport| s.dispatch_s + s.combine_s;
        let bulk = exchange(self.schedule(Schedule::BulkSynchronous)?);
        let aware = exchange(self.schedule(Schedule::FineGrainedTopologyAware)?);
        (bulk > 0.0).then(|| 1.0 - aware / bulk)
    }
}

/// The machine the ranks live on.
#[derive(Clone, Debug)]
pub struct Topology {
    pub gpus_per_node: u32,
    pub nodes: u32,
    pub nvlink: ir::Link,
    pub network: ir::Link,
    /// All ranks on one GPU.
    pub virtual_ranks: bool,
}

impl Topology {
    pub fn of(topology: &ir::Topology) -> Self {
        Topology {
            gpus_per_node: topology.gpus_per_node.max(1),
            nodes: topology.nodes.max(1),
            nvlink: topology.intra_node,
            network: topology.network,
            virtual_ranks: topology.virtual_ranks.is_some(),
        }
    }
}

/// One schedule of a simulation run, reported as it ends ([`simulate_reporting`]): a call
/// of many ranks and tokens takes seconds a schedule (1024 ranks at 16384 tokens per rank,
/// over a minute in all). `index` counts from 0 of the `of` schedules run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub schedule: Schedule,
    pub index: usize,
    pub of: usize,
}

/// Simulates one call of `plan` on `topology` with `options`: a pure function.
pub fn simulate(plan: &Plan, topology: &Topology, options: &Options) -> Result<Report, SimError> {
    simulate_reporting(plan, topology, options, |_| {})
}

/// [`simulate`], telling `on_step` each schedule as it ends (for progress on long runs).
pub fn simulate_reporting(
    plan: &Plan,
    topology: &Topology,
    options: &Options,
    mut on_step: impl FnMut(Step),
) -> Result<Report, SimError> {
    let ep = plan
        .expert_parallel
        .as_ref()
        .ok_or_else(|| SimError::NotExpertParallel(plan.layer.clone()))?;
    let provided = if topology.virtual_ranks {
        ep.ranks
    } else {
        topology.gpus_per_node * topology.nodes
    };
    if provided != ep.ranks {
        return Err(SimError::RankMismatch {
            plan: ep.ranks,
            topology: provided,
        });
    }
    let tokens = options.tokens_per_rank;
    let regime_index = ep.regime_index_for(tokens).ok_or(SimError::TooManyTokens {
        tokens,
        max: plan.shape.max_tokens,
    })?;
    let regime = &ep.regimes[regime_index];
    let gpus_per_node = if topology.virtual_ranks {
        ep.ranks
    } else {
        topology.gpus_per_node
    };
    let traffic = Traffic::draw(
        options.routing,
        ep.ranks,
        plan.shape.experts,
        plan.shape.top_k,
        gpus_per_node,
        tokens,
    )?;
    check_capacity(ep, &traffic)?;
    let deadlock = residency(plan, ep, regime_index, tokens);
    let schedules = if deadlock.is_some() {
        Vec::new()
    } else {
        let machine =
            engine::Machine::new(plan, ep, regime, topology, &traffic, options.fused_decode);
        let across_nodes = traffic.nodes() > 1 && !topology.virtual_ranks;
        let to_run: Vec<Schedule> = Schedule::ALL
            .into_iter()
            .filter(|&schedule| schedule != Schedule::AsBuilt || across_nodes)
            .collect();
        let of = to_run.len();
        to_run
            .into_iter()
            .enumerate()
            .map(|(index, schedule)| {
                let report = machine.run(schedule, options.timeline_ranks);
                on_step(Step {
                    schedule,
                    index,
                    of,
                });
                report
            })
            .collect()
    };
    Ok(Report {
        layer: plan.layer.clone(),
        ranks: ep.ranks,
        nodes: traffic.nodes(),
        tokens_per_rank: tokens,
        routing: options.routing,
        regime: regime.name.clone(),
        deadlock,
        schedules,
    })
}

/// Every receive buffer and segment holds what routing puts there, as the kernels check.
fn check_capacity(ep: &ExpertParallelPlan, traffic: &Traffic) -> Result<(), SimError> {
    for destination in 0..ep.ranks {
        let mut rows = 0u64;
        for source in 0..ep.ranks {
            let sent = traffic.tokens_to(source, destination);
            if sent > ep.slots_per_source {
                return Err(SimError::Overflow(format!(
                    "rank {source} sends {sent} tokens to rank {destination}, which keeps {} slots per source",
                    ep.slots_per_source
                )));
            }
            if sent.div_ceil(ep.dispatch_chunk) > ep.chunks_per_source {
                return Err(SimError::Overflow(format!(
                    "rank {source} sends {} chunks to rank {destination}, which has flags for {}",
                    sent.div_ceil(ep.dispatch_chunk),
                    ep.chunks_per_source
                )));
            }
            for local in 0..ep.experts_per_rank {
                let pairs = traffic.pairs_to(source, destination, local);
                if pairs > ep.rows_per_segment {
                    return Err(SimError::Overflow(format!(
                        "rank {source} routes {pairs} pairs to local expert {local} of rank {destination}, whose segment holds {}",
                        ep.rows_per_segment
                    )));
                }
                rows += u64::from(pairs);
            }
        }
        if rows > ep.intermediate_rows {
            return Err(SimError::Overflow(format!(
                "rank {destination} gets {rows} GEMM rows, its intermediate holds {}",
                ep.intermediate_rows
            )));
        }
    }
    Ok(())
}

/// Resident threads per SM on Hopper (and Ampere's A100): bounds how many combine blocks
/// share an SM.
const MAX_THREADS_PER_SM: u32 = 2048;

/// Whether every block a spin-wait depends on can be resident while its waiter spins.
///
/// GEMM1 blocks spin on chunk flags that communication blocks release, and combine blocks
/// on counters that GEMM2 blocks of other ranks release. Per rank one kernel runs at a
/// time on each stream, so a rank has at most its communication blocks (one SM each) and
/// its largest compute grid live. On a rank's own GPU a compute grid needs
/// `grid / blocks_per_sm` SMs; virtual ranks share one GPU whose block scheduler may give
/// each block of a grid its own SM, so there a grid needs as many SMs as it has blocks
/// (the plan's residency argument), for every rank of the device at once. When the device
/// has fewer SMs, the last rank to launch finds them taken by grids that spin on it.
fn residency(
    plan: &Plan,
    ep: &ExpertParallelPlan,
    regime_index: usize,
    tokens: u32,
) -> Option<Deadlock> {
    let regime = &ep.regimes[regime_index];
    let sms = plan.target.sm_count;
    let sms_of = |grid: u32, per_sm: u32| match ep.placement {
        Placement::Virtual => grid,
        Placement::Devices => grid.div_ceil(per_sm.max(1)),
    };
    let (combine_grid, combine_threads) = regime
        .launches
        .iter()
        .find(|launch| launch.kernel == ep.combine_kernel)
        .map_or((0, 1), |launch| {
            (launch.grid.blocks(tokens), launch.block_threads)
        });
    let combine_per_sm = (MAX_THREADS_PER_SM / combine_threads.max(1)).max(1);
    let kernels = [
        (
            "GEMM1",
            regime.gemm1.grid_blocks,
            sms_of(regime.gemm1.grid_blocks, regime.gemm1.blocks_per_sm),
        ),
        (
            "GEMM2",
            regime.gemm2.grid_blocks,
            sms_of(regime.gemm2.grid_blocks, regime.gemm2.blocks_per_sm),
        ),
        (
            "combine",
            combine_grid,
            sms_of(combine_grid, combine_per_sm),
        ),
    ];
    let (kernel, grid, compute) = kernels
        .into_iter()
        .max_by_key(|&(_, _, sms)| sms)
        .unwrap_or(("GEMM1", 0, 0));
    let ranks_per_device = match ep.placement {
        Placement::Virtual => ep.ranks,
        Placement::Devices => 1,
    };
    let needed = ranks_per_device * (regime.comm_blocks + compute);
    if needed <= sms {
        return None;
    }
    let last = ranks_per_device - 1;
    let waits_for = if kernel == "combine" {
        format!("the combine counter of token 0, released by GEMM2 blocks of rank {last}")
    } else {
        format!("chunk flag 0 of source rank {last}, released by a dispatch block of rank {last}")
    };
    Some(Deadlock {
        waiting: format!("rank 0 {kernel} block 0 (a grid of {grid} blocks on {compute} SMs)"),
        waits_for,
        reason: format!(
            "{ranks_per_device} rank(s) per device need {needed} SMs at once ({} communication blocks and {compute} SMs of {kernel} each), the device has {sms}: rank {last}'s producers are never resident",
            regime.comm_blocks
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two GPUs on one node, every token to experts 0 and 1 (both on rank 0): the
    /// bulk-synchronous time is a sum of closed-form stage times.
    #[test]
    fn bulk_synchronous_time_is_the_closed_form_sum() {
        let text = "topology pair {\n gpus_per_node = 2\n nodes = 1\n nvlink = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}\nlayer two {\n hidden = 128\n ffn = 256\n experts = 4\n top_k = 2\n max_tokens = 512\n parallel { expert = 2 }\n topology = pair\n schedule {\n  gemm1.tile = 32x64x64\n  gemm2.tile = 32x64x64\n  stages = 2\n  dispatch_chunk = 16 tokens\n  comm_blocks = 2\n }\n}\n";
        let module = crate::compile_source("two.moe", text).expect("checks");
        let layer = &module.layers[0];
        let plan = crate::plan::plan(layer, &crate::plan::Target::h200()).expect("plans");
        let topology = Topology::of(&layer.topology);
        let tokens = 64;
        let report = simulate(
            &plan,
            &topology,
            &Options {
                tokens_per_rank: tokens,
                routing: Routing::Skewed,
                timeline_ranks: 0,
                fused_decode: true,
            },
        )
        .expect("simulates");
        let bulk = &report.schedules[0];
        assert_eq!(bulk.schedule, Schedule::BulkSynchronous);

        let ep = plan.expert_parallel.as_ref().unwrap();
        // Top-2 of 4 experts over 2 ranks: results return as pair rows.
        assert_eq!(ep.combine_route, crate::plan::ep::CombineRoute::PairRows);
        let regime = &ep.regimes[ep.regime_index_for(tokens).unwrap()];
        let target = &plan.target;
        let launch = target.launch_overhead_s;
        let nvlink = 3e-6;
        let hop = nvlink + model::FLAG_LATENCY_DEVICES_S;
        // Rank 1 sends its 64 tokens to rank 0 as 4 chunks over 2 blocks: two chunks back to
        // back per block, each at one block's rate, a fence (one link latency) between.
        let chunk = 16.0 * 128.0 * 2.0 / model::COMM_BLOCK_BYTES_PER_S;
        // Its route kernel places 64 tokens × 2 pairs in one metadata tile first.
        let started =
            model::METADATA_S + 128.0 * model::METADATA_PAIR_S + model::DISPATCH_KERNEL_START_S;
        let dispatch = started + 2.0 * chunk + nvlink + hop;
        let barrier = hop;
        // Rank 0 computes 2 experts × 128 rows (64 from each rank): GEMM1 4 row tiles × 4
        // column tiles each, GEMM2 4 × 2; every grid has a block per tile.
        let t1 = model::tile_cost(target, &regime.gemm1, 128, [4, 4], 32, regime.gemm1.tile.m).0;
        let t2 = model::tile_cost(target, &regime.gemm2, 256, [4, 2], 16, regime.gemm2.tile.m).0
            + model::gemm2_epilogue_seconds(
                &regime.gemm2,
                ep.combine_route,
                false,
                regime.gemm2.tile.m,
            );
        assert!(regime.gemm1.grid_blocks >= 32 && regime.gemm2.grid_blocks >= 16);
        // Arrange runs after the barrier, each kernel after a launch.
        let gemm1_start = dispatch + barrier + launch + model::ARRANGE_S + launch;
        let gemm2_end = gemm1_start + t1 + launch + t2;
        let combine = model::combine_seconds(
            model::CombineGrid {
                target,
                lanes: regime.combine_lanes(&ep.combine_kernel, tokens),
                one_device: false,
            },
            tokens,
            2,
            128,
        );
        let expected = gemm2_end + barrier + combine;
        assert!(
            (bulk.layer_s - expected).abs() < 1e-12,
            "simulated {} s, closed form {expected} s",
            bulk.layer_s
        );
        assert!((bulk.dispatch_s - (dispatch + barrier)).abs() < 1e-12);
        assert!((bulk.combine_s - (barrier + combine)).abs() < 1e-12);

        // The summary `moeforge simulate` prints: the exchange against bulk-synchronous,
        // and the layer against its larger bound.
        let aware = report
            .schedule(Schedule::FineGrainedTopologyAware)
            .expect("the topology-aware schedule");
        let reduction =
            1.0 - (aware.dispatch_s + aware.combine_s) / (bulk.dispatch_s + bulk.combine_s);
        assert_eq!(report.exchange_reduction(), Some(reduction));
        assert_eq!(
            aware.over_bound(),
            aware.layer_s / aware.compute_s.max(aware.network_s)
        );
    }
}
