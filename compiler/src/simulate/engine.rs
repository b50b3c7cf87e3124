//! The event loop and the per-rank GEMM walk behind [`super::simulate`].

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

use super::model::{self, COMM_BLOCK_BYTES_PER_S};
use super::{Accounting, RankTimeline, Schedule, ScheduleReport, Span, Topology, Traffic};
use crate::plan::ep::{CombineRoute, ExpertParallelPlan, ExpertParallelRegime};
use crate::plan::network::HOST_READBACK_S;
use crate::plan::{FusedDecode, Plan, Target};

/// The kind of path between two ranks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Local,
    NvLink,
    Network,
}

/// Where a work item goes.
#[derive(Clone, Copy)]
enum To {
    Rank(u32),
    /// Every rank of `node`, through `relay` there.
    Node {
        node: u32,
        relay: u32,
    },
}

/// A work item of a communication block: token rows of `origin`, ending at `pos_end` in
/// its send slots to the destination (or node).
#[derive(Clone, Copy)]
struct Item {
    to: To,
    origin: u32,
    rows: u32,
    pos_end: u32,
}

/// Ports as FIFO servers: per rank and class, egress and ingress.
struct Ports {
    free: Vec<f64>,
    bytes: Vec<f64>,
}

const OUT: usize = 0;
const IN: usize = 1;

impl Ports {
    fn new(ranks: u32) -> Self {
        Ports {
            free: vec![0.0; ranks as usize * 4],
            bytes: vec![0.0; ranks as usize * 4],
        }
    }

    fn index(rank: u32, class: Class, direction: usize) -> usize {
        let class = usize::from(class == Class::Network);
        (rank as usize * 2 + class) * 2 + direction
    }

    fn reserve(&mut self, index: usize, start: f64, bytes: f64, bandwidth: f64) -> f64 {
        let begin = self.free[index].max(start);
        self.free[index] = begin + bytes / bandwidth;
        self.bytes[index] += bytes;
        self.free[index]
    }
}

/// An event time, ordered for a min-heap.
#[derive(Clone, Copy, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> Ordering {
        other.0.total_cmp(&self.0)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A communication block of `rank` is free.
    BlockFree { rank: u32 },
    /// A relay forwards part of a node chunk of `origin` to `destination`.
    Forward {
        relay: u32,
        origin: u32,
        destination: u32,
        rows: u32,
        pos_end: u32,
    },
}

/// Per phase `p`, the row tiles of `bm` rows of one expert whose last row is in phase `p`
/// or before, its rows `phase_rows` per phase (as the kernels' `m_tiles_done`: whole tiles,
/// or all of them once no later phase has rows).
fn row_tiles_done(phase_rows: &[u32], bm: u32) -> Vec<u32> {
    let total: u32 = phase_rows.iter().sum();
    let mut rows = 0u32;
    phase_rows
        .iter()
        .map(|&n| {
            rows += n;
            if rows == total {
                total.div_ceil(bm)
            } else {
                rows / bm
            }
        })
        .collect()
}

/// How a rank's GEMM2 follows its GEMM1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gemm2Start {
    /// A kernel of its own once GEMM1 has ended, its phases in receive order, as the
    /// kernels run it.
    AfterGemm1,
    /// In one grid with GEMM1, each tile once GEMM1 has stored its rows
    /// ([`Machine::gemms_together`]).
    WithGemm1,
    /// The ranks' fused decode: one grid of this many blocks takes every GEMM1 tile, then
    /// every GEMM2 tile, from one ticket ([`Machine::gemms_fused`]).
    Fused { blocks: u32 },
}

/// A GEMM1 tile: its expert (in tile order), row tile, when its rows have arrived and how
/// long it takes.
struct Tile1 {
    expert: usize,
    m: u32,
    ready: f64,
    duration: f64,
}

/// A GEMM2 tile: its expert, rows `row0..row1` of the expert, and how long it takes (its
/// epilogue included).
struct Tile2 {
    expert: usize,
    row0: u32,
    row1: u32,
    duration: f64,
}

impl Tile2 {
    /// Widens the store window, `begin..end`, of every source whose rows the tile holds
    /// (`phase_rows`: its expert's rows per phase, sources in `order`).
    fn store(
        &self,
        results: &mut [Option<(f64, f64)>],
        order: &[u32],
        phase_rows: &[u32],
        begin: f64,
        end: f64,
    ) {
        let mut phase_start = 0;
        for (p, &n) in phase_rows.iter().enumerate() {
            let phase_end = phase_start + n;
            if n > 0 && phase_start < self.row1 && self.row0 < phase_end {
                let slot = &mut results[order[p] as usize];
                *slot = Some(slot.map_or((begin, end), |(first, last)| {
                    (first.min(begin), last.max(end))
                }));
            }
            phase_start = phase_end;
        }
    }
}

/// Where HBM, not the tiles, sets the end of work that began at `start` (its tiles done by
/// `tiles_end`, the work by `end`), every tile ran that much slower: a time of the tiles,
/// stretched to match.
fn stretch(start: f64, tiles_end: f64, end: f64) -> impl Fn(f64) -> f64 {
    let factor = if tiles_end > start {
        (end - start) / (tiles_end - start)
    } else {
        1.0
    };
    move |t| start + (t - start) * factor
}

/// The store windows of `results`, stretched as [`stretch`] says.
fn stretch_results(results: &mut [Option<(f64, f64)>], start: f64, tiles_end: f64, end: f64) {
    let stretched = stretch(start, tiles_end, end);
    for slot in results.iter_mut().flatten() {
        *slot = (stretched(slot.0), stretched(slot.1));
    }
}

/// A GEMM grid's blocks, handed tiles in the kernels' order as the kernels take them:
/// where the GEMM `claims` its units in order from a ticket
/// ([`crate::plan::GemmPlan::claims_units`]), the block free first (the lowest index on a
/// tie, so the first wave is dealt as by index); else block `id % grid`. (A kernel's
/// producer claims its next unit up to a ring of k-tiles before its block is free; the
/// model hands it out when the block is free.)
struct GridBlocks {
    claims: bool,
    free_at: Vec<f64>,
    /// Claiming: the blocks by when they are free, the earliest first.
    by_time: BinaryHeap<(Time, Reverse<usize>)>,
}

impl GridBlocks {
    fn new(claims: bool, blocks: u32, start: f64) -> Self {
        let blocks = blocks.max(1) as usize;
        let by_time = if claims {
            (0..blocks).map(|b| (Time(start), Reverse(b))).collect()
        } else {
            BinaryHeap::new()
        };
        GridBlocks {
            claims,
            free_at: vec![start; blocks],
            by_time,
        }
    }

    /// The block that takes tile `id`, and when it is free; the caller then says until
    /// when it is busy ([`GridBlocks::busy_until`]).
    fn take(&mut self, id: usize) -> (usize, f64) {
        let b = if self.claims {
            self.by_time.pop().map_or(0, |(_, Reverse(b))| b)
        } else {
            id % self.free_at.len()
        };
        (b, self.free_at[b])
    }

    fn busy_until(&mut self, b: usize, end: f64) {
        self.free_at[b] = end;
        if self.claims {
            self.by_time.push((Time(end), Reverse(b)));
        }
    }

    /// When the last block is done, or `floor` if later.
    fn done(&self, floor: f64) -> f64 {
        self.free_at.iter().copied().fold(floor, f64::max)
    }
}

/// Draws a tile of block `block` on `lane`, which shows block 0's.
fn record_tile(
    lane: &mut Option<&mut RankTimeline>,
    block: usize,
    start: f64,
    end: f64,
    label: &str,
) {
    if block == 0
        && let Some(lane) = lane.as_deref_mut()
    {
        lane.tiles.push(Span {
            start,
            end,
            label: label.into(),
        });
    }
}

/// When one rank's GEMMs end, and when GEMM2 stores each origin's results.
struct GemmEnds {
    start2: f64,
    end2: f64,
    /// The bytes both GEMMs load from HBM.
    hbm_bytes: f64,
    /// Per origin rank: when GEMM2's first tile holding its rows starts and its last one
    /// ends (`None`: none of its rows are here).
    results: Vec<Option<(f64, f64)>>,
}

impl GemmEnds {
    /// The ends, GEMM1's span (`gemm1`) and GEMM2's drawn as kernels on `lane`.
    fn recorded(
        lane: Option<&mut RankTimeline>,
        [start1, end1]: [f64; 2],
        start2: f64,
        end2: f64,
        hbm_bytes: f64,
        results: Vec<Option<(f64, f64)>>,
    ) -> Self {
        if let Some(lane) = lane {
            let span = |start, end, label: &str| Span {
                start,
                end,
                label: label.into(),
            };
            lane.kernels.push(span(start1, end1, "GEMM1"));
            lane.kernels.push(span(start2, end2, "GEMM2"));
        }
        GemmEnds {
            start2,
            end2,
            hbm_bytes,
            results,
        }
    }
}

/// What a run of the communication blocks produced.
struct CommResult {
    /// Per (origin, destination): (end position, arrival time) of each delivered item.
    arrivals: Vec<Vec<(u32, f64)>>,
    last_arrival: f64,
}

/// For users of one resource who start together and load `bytes` each, sharing it evenly
/// while they run: how many times an even part each one gets over its run (a user ends
/// when `Σ_r min(b_r, b_d)` has been moved, so `n · b_d / Σ_r min(b_r, b_d)`; 1 for even
/// loads and for a user with nothing to load).
fn processor_shares(bytes: &[f64]) -> Vec<f64> {
    let users = bytes.len() as f64;
    bytes
        .iter()
        .map(|&mine| {
            let before_mine: f64 = bytes.iter().map(|&other| other.min(mine)).sum();
            if before_mine > 0.0 {
                users * mine / before_mine
            } else {
                1.0
            }
        })
        .collect()
}

/// What one rank has of `target`: all of it on a GPU of its own; for `ranks` virtual ranks
/// an even share of its SMs, tensor cores, HBM and L2 bandwidth. Uniform routing keeps the
/// ranks in step (each runs the same kernel at about the same time), so each draws on the
/// device as one of `ranks` equal users.
fn rank_share(target: &Target, topology: &Topology, ranks: u32) -> Target {
    if !topology.virtual_ranks || ranks <= 1 {
        return target.clone();
    }
    let share = f64::from(ranks);
    Target {
        sm_count: (target.sm_count / ranks).max(1),
        peak_bf16_flops: target.peak_bf16_flops / share,
        hbm_bytes_per_s: target.hbm_bytes_per_s / share,
        l2_bytes_per_s: target.l2_bytes_per_s / share,
        ..target.clone()
    }
}

/// A plan, a topology and one call's routing: everything a schedule run needs.
pub(super) struct Machine<'a> {
    ep: &'a ExpertParallelPlan,
    regime: &'a ExpertParallelRegime,
    /// What one rank has of its device: the whole target, or for virtual ranks its share.
    target: Target,
    topology: &'a Topology,
    traffic: &'a Traffic,
    hidden: u32,
    ffn: u32,
    /// Shared-expert slices every rank runs on its own tokens after its local experts.
    shared_slices: u32,
    row_bytes: f64,
    /// Token lanes of the combine kernel's grid for this call (blocks times lanes each).
    combine_lanes: u32,
    /// The fused decode that runs this call in place of the table, on one node, where the
    /// plan has one covering the call.
    fused: Option<&'a FusedDecode>,
    /// How results return in the schedules: the plan's route on one node (and on emulated
    /// nodes, one GPU); across real nodes the design's pair rows, which the topology-aware
    /// schedule reduces per node. (The kernels as built return node partials across nodes,
    /// summed at a relay of each node: the as-built schedule models them apart.)
    results: CombineRoute,
}

impl<'a> Machine<'a> {
    pub(super) fn new(
        plan: &'a Plan,
        ep: &'a ExpertParallelPlan,
        regime: &'a ExpertParallelRegime,
        topology: &'a Topology,
        traffic: &'a Traffic,
        fused_decode: bool,
    ) -> Self {
        Machine {
            ep,
            regime,
            target: rank_share(&plan.target, topology, ep.ranks),
            topology,
            traffic,
            hidden: plan.shape.hidden,
            ffn: plan.shape.ffn,
            shared_slices: plan.shape.shared_slices,
            row_bytes: f64::from(plan.shape.hidden) * 2.0,
            combine_lanes: regime.combine_lanes(&ep.combine_kernel, traffic.tokens_per_rank),
            fused: regime.fused_decode.as_ref().filter(|fused| {
                fused_decode && ep.network.is_none() && fused.covers(traffic.tokens_per_rank)
            }),
            results: if ep.network.is_some() && !topology.virtual_ranks {
                CombineRoute::PairRows
            } else {
                ep.combine_route
            },
        }
    }

    /// The fused decode that runs a call under `schedule`: the kernels' own (fine-grained)
    /// schedules only; the bulk-synchronous baseline runs the table.
    fn fused_for(&self, schedule: Schedule) -> Option<&'a FusedDecode> {
        self.fused.filter(|_| schedule != Schedule::BulkSynchronous)
    }

    /// The combine's grid: the table's combine kernel, or the fused decode's blocks (a
    /// token of 128 threads each).
    fn combine_grid(&self, fused: Option<&FusedDecode>) -> model::CombineGrid<'_> {
        model::CombineGrid {
            target: &self.target,
            lanes: fused.map_or(self.combine_lanes, |fused| {
                fused.launch.grid.blocks(self.traffic.tokens_per_rank)
            }),
            one_device: self.topology.virtual_ranks,
        }
    }

    fn class(&self, a: u32, b: u32) -> Class {
        if a == b {
            Class::Local
        } else if self.topology.virtual_ranks || self.traffic.node_of(a) == self.traffic.node_of(b)
        {
            Class::NvLink
        } else {
            Class::Network
        }
    }

    fn bandwidth(&self, class: Class) -> f64 {
        match class {
            // Virtual ranks copy within one device: read and write, half of the rank's
            // share of the copy rate each, as the planner assumes.
            Class::NvLink if self.topology.virtual_ranks => self.target.hbm_bytes_per_s / 2.0,
            Class::Local => self.target.hbm_bytes_per_s / 2.0,
            Class::NvLink => {
                self.topology.nvlink.bandwidth_bytes_per_s as f64 * model::NVLINK_STORE_EFFICIENCY
            }
            Class::Network => {
                self.topology.network.bandwidth_bytes_per_s as f64 * model::NETWORK_EFFICIENCY
            }
        }
    }

    fn latency(&self, class: Class) -> f64 {
        let flag = if self.topology.virtual_ranks {
            model::FLAG_LATENCY_ONE_GPU_S
        } else {
            model::FLAG_LATENCY_DEVICES_S
        };
        let link = match class {
            Class::Local => 0.0,
            Class::NvLink if self.topology.virtual_ranks => 0.0,
            Class::NvLink => self.topology.nvlink.latency_ns as f64 * 1e-9,
            Class::Network => self.topology.network.latency_ns as f64 * 1e-9,
        };
        if class == Class::Local {
            flag
        } else {
            link + flag
        }
    }

    /// A transfer of `bytes` from `a` to `b` starting at `start`, moved at most at `cap`:
    /// when its last byte has landed.
    fn transfer(&self, ports: &mut Ports, start: f64, a: u32, b: u32, bytes: f64, cap: f64) -> f64 {
        let own = start + bytes / cap;
        let class = self.class(a, b);
        if class == Class::Local {
            return own;
        }
        let bandwidth = self.bandwidth(class);
        let out = ports.reserve(Ports::index(a, class, OUT), start, bytes, bandwidth);
        let inn = ports.reserve(Ports::index(b, class, IN), start, bytes, bandwidth);
        own.max(out).max(inn)
    }

    /// Seconds HBM needs for `bytes` of a rank's GEMMs at `share` times the rank's part
    /// of it ([`Machine::hbm_shares`]).
    fn hbm_seconds(&self, bytes: f64, share: f64) -> f64 {
        model::hbm_seconds(&self.target, bytes) / share
    }

    /// Per rank, how many times its even part of HBM the GEMMs of its fused decode stream
    /// at: 1 on a GPU of its own. Virtual ranks share one HBM as equal users while all
    /// stream, so a rank that loads more than another keeps going at a larger part once the
    /// other is done: rank `d`, loading `b_d` (`gemm_bytes(d)`), ends when
    /// `Σ_r min(b_r, b_d)` have been read, which is `R · b_d / Σ_r min(b_r, b_d)` times its
    /// even part. With even loads every share is 1. A few tokens per rank hit few experts,
    /// and unevenly (two virtual ranks of one H200, Mixtral-8x7B at one token per rank,
    /// 2026-12-04: rank 0 read one expert's weights, rank 1 three). Checked on the fused
    /// decode's cells (one kernel per rank, streaming weights from its start to its end:
    /// Mixtral-8x7B at one token +41% → −4%, DeepSeek-V3 +16% → +4%); the table's cells at
    /// one token came out 19-26% short with it (a rank's two GEMM kernels on half the SMs
    /// take over less of the device than this assumes), so the table keeps even parts.
    fn hbm_shares(&self, gemm_bytes: impl Fn(u32) -> f64) -> Vec<f64> {
        let ranks = self.ep.ranks;
        if !self.topology.virtual_ranks || ranks <= 1 {
            return vec![1.0; ranks as usize];
        }
        let bytes: Vec<f64> = (0..ranks).map(gemm_bytes).collect();
        processor_shares(&bytes)
    }

    /// The farthest link's latency: what a flag barrier of every rank costs.
    fn barrier_s(&self) -> f64 {
        let class = if self.traffic.nodes() > 1 {
            Class::Network
        } else {
            Class::NvLink
        };
        self.latency(class)
    }

    /// Items of token rows of `origin`, in the order of `targets`: chunks, or pieces when
    /// the call has fewer chunks than blocks.
    fn token_items(&self, origin: u32, targets: &[To], fused: bool) -> VecDeque<Item> {
        let total = |to: &To| match *to {
            To::Rank(d) => self.traffic.tokens_to(origin, d),
            To::Node { node, .. } => self.traffic.tokens_to_node(origin, node),
        };
        let chunk = self.ep.dispatch_chunk.max(1);
        let chunks: u32 = targets.iter().map(|to| total(to).div_ceil(chunk)).sum();
        // The fused decode sends a row per work unit.
        let unit = if fused {
            1
        } else if chunks < self.regime.comm_blocks {
            self.ep.dispatch_piece.max(1)
        } else {
            chunk
        };
        let mut items = VecDeque::new();
        for to in targets {
            let total = total(to);
            let mut pos = 0;
            while pos < total {
                let rows = unit.min(total - pos);
                pos += rows;
                items.push_back(Item {
                    to: *to,
                    origin,
                    rows,
                    pos_end: pos,
                });
            }
        }
        items
    }

    /// As built across nodes, when the chunk steps are on the network stream: the
    /// metadata's arrival from the farthest rail peer, then, where the call moves the
    /// routed rows, the host's read-back of the rows per chunk ([`HOST_READBACK_S`]). No
    /// row crosses the network before.
    fn chunk_steps_enqueued(&self) -> f64 {
        let readback = if self.moves_whole_chunks() {
            0.0
        } else {
            HOST_READBACK_S
        };
        self.metadata_released() + self.latency(Class::Network) + readback
    }

    /// Whether the call, as built across nodes, moves whole chunks (the plan's choice at
    /// its bound, every rank's tokens per rank).
    fn moves_whole_chunks(&self) -> bool {
        self.ep
            .network
            .as_ref()
            .is_some_and(|network| network.moves_whole_chunks(self.traffic.tokens_per_rank))
    }

    /// The rows the network carries from `origin` to another node for `visiting` rows of
    /// its tokens, as built: those rows, or with whole chunks every token's row up to the
    /// bound. (Whole chunks to a node no token of the origin visits are left out: the
    /// simulation has no item for them.)
    fn network_rows(&self, visiting: u32) -> u32 {
        if self.moves_whole_chunks() {
            self.traffic.tokens_per_rank.max(visiting)
        } else {
            visiting
        }
    }

    /// Runs every rank's communication blocks over its queue from `start[rank]`.
    fn communicate(
        &self,
        ports: &mut Ports,
        mut queues: Vec<VecDeque<Item>>,
        start: &[f64],
        blocks: u32,
        timeline: &mut [RankTimeline],
        schedule: Schedule,
    ) -> CommResult {
        let ranks = self.ep.ranks;
        let mut result = CommResult {
            arrivals: vec![Vec::new(); (ranks * ranks) as usize],
            last_arrival: 0.0,
        };
        let mut heap = BinaryHeap::new();
        for rank in 0..ranks {
            for _ in 0..blocks.min(queues[rank as usize].len() as u32) {
                heap.push((Time(start[rank as usize]), Event::BlockFree { rank }));
            }
        }
        while let Some((Time(now), event)) = heap.pop() {
            match event {
                Event::BlockFree { rank } => {
                    let Some(item) = queues[rank as usize].pop_front() else {
                        continue;
                    };
                    let bytes = f64::from(item.rows) * self.row_bytes;
                    let (first_hop, label) = match item.to {
                        To::Rank(d) => (d, format!("to {d}")),
                        To::Node { node, relay } => (relay, format!("to node {node}")),
                    };
                    let class = self.class(rank, first_hop);
                    let (done, block_free) = if class == Class::Network {
                        // Rows for another node: the block copies them into this rank's
                        // outbox (its own memory) and the network moves them from there
                        // (NCCL, on the network stream) while the block goes on. The port
                        // is reserved now, from the staged time: an item staged sooner by
                        // another block but taken later queues behind it (items are alike
                        // in size, so little is lost).
                        let staged = now + bytes / COMM_BLOCK_BYTES_PER_S;
                        let sendable = if schedule == Schedule::AsBuilt {
                            staged.max(self.chunk_steps_enqueued())
                        } else {
                            staged
                        };
                        let wire_bytes = match (schedule, item.to) {
                            // As built, whole chunks carry every token's row to another
                            // node: this item's share of them.
                            (Schedule::AsBuilt, To::Node { node, .. }) => {
                                let visiting = self.traffic.tokens_to_node(item.origin, node);
                                let carried = self.network_rows(visiting);
                                bytes * f64::from(carried) / f64::from(visiting.max(1))
                            }
                            _ => bytes,
                        };
                        (
                            self.transfer(
                                ports,
                                sendable,
                                rank,
                                first_hop,
                                wire_bytes,
                                f64::INFINITY,
                            ),
                            staged,
                        )
                    } else {
                        let done = self.transfer(
                            ports,
                            now,
                            rank,
                            first_hop,
                            bytes,
                            COMM_BLOCK_BYTES_PER_S,
                        );
                        let link = match class {
                            Class::NvLink if !self.topology.virtual_ranks => {
                                self.topology.nvlink.latency_ns as f64 * 1e-9
                            }
                            _ => 0.0,
                        };
                        // The block's fence waits for its stores to land.
                        (done, done + link)
                    };
                    let arrival = done + self.latency(class);
                    if let Some(lane) = timeline.get_mut(rank as usize) {
                        lane.comm.push(Span {
                            start: now,
                            end: block_free,
                            label,
                        });
                    }
                    heap.push((Time(block_free), Event::BlockFree { rank }));
                    match item.to {
                        To::Rank(d) => {
                            self.arrive(&mut result, item.origin, d, item.pos_end, arrival)
                        }
                        To::Node { node, relay } => {
                            let node_total = self.traffic.tokens_to_node(item.origin, node);
                            let prev = item.pos_end - item.rows;
                            for d in self.node_ranks(node) {
                                let sent = u64::from(self.traffic.tokens_to(item.origin, d));
                                let part = |pos: u32| {
                                    (sent * u64::from(pos) / u64::from(node_total)) as u32
                                };
                                let (from, to) = (part(prev), part(item.pos_end));
                                if to > from {
                                    heap.push((
                                        Time(arrival),
                                        Event::Forward {
                                            relay,
                                            origin: item.origin,
                                            destination: d,
                                            rows: to - from,
                                            pos_end: to,
                                        },
                                    ));
                                }
                            }
                        }
                    }
                }
                Event::Forward {
                    relay,
                    origin,
                    destination,
                    rows,
                    pos_end,
                } => {
                    let bytes = f64::from(rows) * self.row_bytes;
                    let done = self.transfer(
                        ports,
                        now,
                        relay,
                        destination,
                        bytes,
                        COMM_BLOCK_BYTES_PER_S,
                    );
                    let arrival = if relay == destination {
                        now
                    } else {
                        done + self.latency(self.class(relay, destination))
                    };
                    self.arrive(&mut result, origin, destination, pos_end, arrival);
                }
            }
        }
        for list in &mut result.arrivals {
            list.sort_by_key(|&(pos, _)| pos);
            let mut latest: f64 = 0.0;
            for entry in list.iter_mut() {
                latest = latest.max(entry.1);
                entry.1 = latest;
            }
        }
        result
    }

    fn arrive(&self, result: &mut CommResult, origin: u32, d: u32, pos_end: u32, at: f64) {
        result.arrivals[(origin * self.ep.ranks + d) as usize].push((pos_end, at));
        result.last_arrival = result.last_arrival.max(at);
    }

    fn node_ranks(&self, node: u32) -> std::ops::Range<u32> {
        let g = self.traffic.gpus_per_node;
        node * g..((node + 1) * g).min(self.ep.ranks)
    }

    /// The rank of `node` with `rank`'s local index: its relay there (its rail peer).
    fn relay(&self, node: u32, rank: u32) -> u32 {
        let g = self.traffic.gpus_per_node;
        (node * g + rank % g).min(self.ep.ranks - 1)
    }

    /// When slot `pos` (1-based end) of `origin`'s tokens at `d` has arrived.
    fn ready(arrivals: &[Vec<(u32, f64)>], ranks: u32, origin: u32, d: u32, pos: u32) -> f64 {
        let list = &arrivals[(origin * ranks + d) as usize];
        let i = list.partition_point(|&(end, _)| end < pos);
        list.get(i).or(list.last()).map_or(0.0, |&(_, t)| t)
    }

    /// Rank `d`'s GEMMs from `start`, GEMM1 row tiles ready as `ready` says, GEMM2
    /// following as `gemm2` says; returns when they end and when each origin's results are
    /// stored, and adds the rows per origin to `rows`.
    #[allow(clippy::too_many_arguments)]
    fn gemms(
        &self,
        d: u32,
        start: f64,
        ready: &dyn Fn(u32, u32) -> f64,
        rows: &mut [u64],
        gemm2: Gemm2Start,
        lane: Option<&mut RankTimeline>,
        hbm_share: f64,
    ) -> GemmEnds {
        let order = &self.ep.receive_order[d as usize];
        let g1 = &self.regime.gemm1;
        // Per expert in tile order: its row tiles' readiness, its row tiles done per phase,
        // and its rows per phase (GEMM2 takes its tiles in the same phase-major order).
        let mut experts: Vec<(Vec<f64>, Vec<u32>, Vec<u32>)> = Vec::new();
        // The shared slices first, as the kernels order them: a row per own token each,
        // read from x (ready at once), in the first phase (this rank's own source); no
        // pair is dispatched for them.
        let own = self.traffic.tokens_per_rank;
        for _ in 0..self.shared_slices {
            let m_tiles = own.div_ceil(g1.tile.m);
            let mut phases = vec![0; order.len()];
            phases[0] = own;
            experts.push((
                vec![start; m_tiles as usize],
                vec![m_tiles; order.len()],
                phases,
            ));
        }
        for local in 0..self.ep.experts_per_rank {
            // Rows per source in receive order (the kernels' phases), empty ones included.
            let segments: Vec<(u32, u32)> = order
                .iter()
                .map(|&s| (s, self.traffic.pairs_to(s, d, local)))
                .collect();
            let expert_rows: u32 = segments.iter().map(|&(_, n)| n).sum();
            for &(s, n) in &segments {
                rows[s as usize] += u64::from(n);
            }
            let bm = g1.tile.m;
            let m_tiles = expert_rows.div_ceil(bm);
            // Readiness of each row tile: the latest chunk its rows sit in.
            let mut row_ready = vec![start; m_tiles as usize];
            let phase_rows: Vec<u32> = segments.iter().map(|&(_, n)| n).collect();
            let m_done = row_tiles_done(&phase_rows, bm);
            let mut first = 0u32;
            for &(s, n) in &segments {
                if n > 0 {
                    let sent = self.traffic.tokens_to(s, d);
                    for m in first / bm..=(first + n - 1) / bm {
                        let last = ((m + 1) * bm).min(first + n) - 1 - first;
                        let pos =
                            (u64::from(last + 1) * u64::from(sent)).div_ceil(u64::from(n)) as u32;
                        let slot = &mut row_ready[m as usize];
                        *slot = slot.max(ready(s, pos));
                    }
                }
                first += n;
            }
            experts.push((row_ready, m_done, phase_rows));
        }
        let n1 = self.ffn / g1.tile.n;
        let total: u32 = experts
            .iter()
            .map(|(row_ready, _, _)| row_ready.len() as u32 * n1)
            .sum();
        // GEMM1's tiles in the kernels' order: phase, expert (shared slices first), n-tile,
        // m-tile.
        let mut tiles1 = Vec::new();
        let mut hbm1 = 0.0;
        for phase in 0..order.len() {
            for (e, (row_ready, m_done, rows)) in experts.iter().enumerate() {
                let m_tiles = row_ready.len() as u32;
                let expert_rows: u32 = rows.iter().sum();
                let begin_m = if phase == 0 { 0 } else { m_done[phase - 1] };
                let end_m = m_done[phase];
                // Per row tile: its time (an expert's last is partly empty) and its bytes.
                let costs: Vec<(f64, f64)> = (begin_m..end_m)
                    .map(|m| {
                        let tile_rows = (expert_rows - m * g1.tile.m).min(g1.tile.m);
                        let shape = [m_tiles, n1];
                        model::tile_cost(&self.target, g1, self.hidden, shape, total, tile_rows)
                    })
                    .collect();
                hbm1 += f64::from(n1) * costs.iter().map(|&(_, bytes)| bytes).sum::<f64>();
                for _ in 0..n1 {
                    for (m, &(duration, _)) in (begin_m..end_m).zip(&costs) {
                        tiles1.push(Tile1 {
                            expert: e,
                            m,
                            ready: row_ready[m as usize],
                            duration,
                        });
                    }
                }
            }
        }
        let phase_rows: Vec<Vec<u32>> = experts.into_iter().map(|(_, _, rows)| rows).collect();
        match gemm2 {
            Gemm2Start::AfterGemm1 => {
                self.gemms_in_turn(start, &tiles1, hbm1, order, &phase_rows, lane, hbm_share)
            }
            Gemm2Start::WithGemm1 => {
                self.gemms_together(start, &tiles1, hbm1, order, &phase_rows, lane, hbm_share)
            }
            Gemm2Start::Fused { blocks } => self.gemms_fused(
                start,
                &tiles1,
                hbm1,
                order,
                &phase_rows,
                blocks,
                lane,
                hbm_share,
            ),
        }
    }

    /// The fused decode's GEMMs: `blocks` blocks claim every GEMM1 tile, then every GEMM2
    /// tile, from one ticket in that order (a block takes the next when it is free); a
    /// GEMM1 tile starts once its rows have arrived, a GEMM2 tile once its expert's GEMM1
    /// tiles are stored. No launch between them.
    #[allow(clippy::too_many_arguments)]
    fn gemms_fused(
        &self,
        start: f64,
        tiles1: &[Tile1],
        hbm1: f64,
        order: &[u32],
        phase_rows: &[Vec<u32>],
        blocks: u32,
        mut lane: Option<&mut RankTimeline>,
        hbm_share: f64,
    ) -> GemmEnds {
        // Blocks by when they are free, the earliest first (`Time` orders so).
        let mut free: BinaryHeap<(Time, usize)> = (0..blocks.max(1) as usize)
            .map(|b| (Time(start), b))
            .collect();
        let mut expert_stored = vec![start; phase_rows.len()];
        let mut end1 = start;
        for tile in tiles1 {
            let (Time(at), b) = free.pop().expect("a block");
            let begin = at.max(tile.ready);
            let end = begin + tile.duration;
            record_tile(&mut lane, b, begin, end, "GEMM1");
            expert_stored[tile.expert] = expert_stored[tile.expert].max(end);
            end1 = end1.max(end);
            free.push((Time(end), b));
        }
        // Streaming GEMM1's weights sets its pace where the tiles would outrun HBM.
        let end1 = end1.max(start + self.hbm_seconds(hbm1, hbm_share));
        // Every row goes to its origin's slot, whatever the table's combine route.
        let (tiles2, hbm2) = self.gemm2_tiles(phase_rows, CombineRoute::PairRows);
        let mut start2 = f64::INFINITY;
        let mut tiles_end = start;
        let mut results: Vec<Option<(f64, f64)>> = vec![None; self.ep.ranks as usize];
        for tile in &tiles2 {
            let (Time(at), b) = free.pop().expect("a block");
            let begin = at.max(expert_stored[tile.expert]);
            let end = begin + tile.duration;
            record_tile(&mut lane, b, begin, end, "GEMM2");
            tile.store(&mut results, order, &phase_rows[tile.expert], begin, end);
            start2 = start2.min(begin);
            tiles_end = tiles_end.max(end);
            free.push((Time(end), b));
        }
        let start2 = if start2.is_finite() { start2 } else { end1 };
        // Both GEMMs stream their weights through one HBM: together no faster than that.
        let end2 = tiles_end
            .max(end1)
            .max(start + self.hbm_seconds(hbm1 + hbm2, hbm_share));
        stretch_results(&mut results, start2, tiles_end.max(start2), end2);
        GemmEnds::recorded(lane, [start, end1], start2, end2, hbm1 + hbm2, results)
    }

    /// GEMM1's tiles on its grid, taken as the kernels take them ([`GridBlocks`]), then
    /// GEMM2 as a kernel of its own after it, its tiles the same way.
    #[allow(clippy::too_many_arguments)]
    fn gemms_in_turn(
        &self,
        start: f64,
        tiles1: &[Tile1],
        hbm1: f64,
        order: &[u32],
        phase_rows: &[Vec<u32>],
        mut lane: Option<&mut RankTimeline>,
        hbm_share: f64,
    ) -> GemmEnds {
        let gemm1 = &self.regime.gemm1;
        let mut blocks1 = GridBlocks::new(gemm1.claims_units(), gemm1.grid_blocks, start);
        for (id, tile) in tiles1.iter().enumerate() {
            let (b, free) = blocks1.take(id);
            let begin = free.max(tile.ready);
            let end = begin + tile.duration;
            blocks1.busy_until(b, end);
            record_tile(&mut lane, b, begin, end, "GEMM1");
        }
        let end1 = blocks1.done(start + self.hbm_seconds(hbm1, hbm_share));
        let start2 = end1 + self.target.launch_overhead_s;
        let (tiles2, hbm2) = self.gemm2_tiles(phase_rows, self.results);
        let gemm2 = &self.regime.gemm2;
        let mut blocks2 = GridBlocks::new(gemm2.claims_units(), gemm2.grid_blocks, start2);
        let mut results: Vec<Option<(f64, f64)>> = vec![None; self.ep.ranks as usize];
        for (id, tile) in tiles2.iter().enumerate() {
            let (b, begin) = blocks2.take(id);
            let end = begin + tile.duration;
            blocks2.busy_until(b, end);
            record_tile(&mut lane, b, begin, end, "GEMM2");
            tile.store(&mut results, order, &phase_rows[tile.expert], begin, end);
        }
        let tiles_end = blocks2.done(start2);
        let end2 = tiles_end.max(start2 + self.hbm_seconds(hbm2, hbm_share));
        stretch_results(&mut results, start2, tiles_end, end2);
        GemmEnds::recorded(lane, [start, end1], start2, end2, hbm1 + hbm2, results)
    }

    /// Both GEMMs as one grid of GEMM1's blocks, each tile once its inputs are there
    /// (Comet's GEMM-to-GEMM overlap): GEMM1's tiles and GEMM2's are two queues, each
    /// taken in its order, and a free block takes the head of GEMM2's queue if every GEMM1
    /// tile of its rows is stored, else the head of GEMM1's if its chunks have arrived,
    /// else waits for whichever is ready first. So GEMM2 fills the time GEMM1's blocks
    /// would wait for arriving chunks, and no block waits on a tile that holds a later
    /// place (a GEMM2 tile is taken only once its rows are stored).
    #[allow(clippy::too_many_arguments)]
    fn gemms_together(
        &self,
        start: f64,
        tiles1: &[Tile1],
        hbm1: f64,
        order: &[u32],
        phase_rows: &[Vec<u32>],
        mut lane: Option<&mut RankTimeline>,
        hbm_share: f64,
    ) -> GemmEnds {
        let g1 = &self.regime.gemm1;
        let (bm1, n1) = (g1.tile.m, self.ffn / g1.tile.n);
        let (tiles2, hbm2) = self.gemm2_tiles(phase_rows, self.results);
        // Per expert and GEMM1 row tile: its column tiles not yet taken, and when the
        // taken ones end.
        let mut columns_left: Vec<Vec<u32>> = phase_rows
            .iter()
            .map(|rows| vec![n1; rows.iter().sum::<u32>().div_ceil(bm1) as usize])
            .collect();
        let mut stored: Vec<Vec<f64>> = columns_left
            .iter()
            .map(|tiles| vec![start; tiles.len()])
            .collect();
        // When a GEMM2 tile's rows are stored (None: a GEMM1 tile of them is not yet taken).
        let rows_stored = |tile: &Tile2, left: &[Vec<u32>], stored: &[Vec<f64>]| {
            (tile.row0 / bm1..=(tile.row1 - 1) / bm1).try_fold(start, |at, m| {
                (left[tile.expert][m as usize] == 0)
                    .then(|| at.max(stored[tile.expert][m as usize]))
            })
        };
        // Free blocks by time (block 0 is the one the timeline shows).
        let mut blocks: BinaryHeap<(Time, std::cmp::Reverse<usize>)> = (0..g1.grid_blocks.max(1)
            as usize)
            .map(|b| (Time(start), std::cmp::Reverse(b)))
            .collect();
        let mut results: Vec<Option<(f64, f64)>> = vec![None; self.ep.ranks as usize];
        let (mut next1, mut next2) = (0, 0);
        let (mut end1, mut start2, mut tiles_end) = (start, f64::INFINITY, start);
        while next1 < tiles1.len() || next2 < tiles2.len() {
            let (Time(now), std::cmp::Reverse(b)) = blocks.pop().expect("a block");
            let ready2 = tiles2
                .get(next2)
                .and_then(|tile| rows_stored(tile, &columns_left, &stored));
            let ready1 = tiles1.get(next1).map(|tile| tile.ready);
            let (label, end) = if ready2.is_some_and(|at| at <= now) {
                let tile = &tiles2[next2];
                next2 += 1;
                let end = now + tile.duration;
                tile.store(&mut results, order, &phase_rows[tile.expert], now, end);
                start2 = start2.min(now);
                ("GEMM2", end)
            } else if ready1.is_some_and(|at| at <= now) {
                let tile = &tiles1[next1];
                next1 += 1;
                let end = now + tile.duration;
                columns_left[tile.expert][tile.m as usize] -= 1;
                let slot = &mut stored[tile.expert][tile.m as usize];
                *slot = slot.max(end);
                end1 = end1.max(end);
                ("GEMM1", end)
            } else {
                // Nothing ready: come back when the first of the two heads is (a GEMM2
                // head not yet ready waits on GEMM1 tiles still queued, so GEMM1's head
                // has a time).
                let at = ready2
                    .into_iter()
                    .chain(ready1)
                    .fold(f64::INFINITY, f64::min);
                blocks.push((Time(at), std::cmp::Reverse(b)));
                continue;
            };
            tiles_end = tiles_end.max(end);
            blocks.push((Time(end), std::cmp::Reverse(b)));
            record_tile(&mut lane, b, now, end, label);
        }
        let end2 = tiles_end.max(start + self.hbm_seconds(hbm1 + hbm2, hbm_share));
        stretch_results(&mut results, start, tiles_end, end2);
        let stretched = stretch(start, tiles_end, end2);
        let start2 = if start2.is_finite() {
            stretched(start2)
        } else {
            end2
        };
        GemmEnds::recorded(
            lane,
            [start, stretched(end1)],
            start2,
            end2,
            hbm1 + hbm2,
            results,
        )
    }

    /// GEMM2's tiles over experts with `phase_rows[e][p]` rows of phase `p` (source
    /// `order[p]`) each, in the kernels' order: phase (of a tile's last row), expert,
    /// n-tile, m-tile; and the bytes they load.
    fn gemm2_tiles(&self, phase_rows: &[Vec<u32>], route: CombineRoute) -> (Vec<Tile2>, f64) {
        let g2 = &self.regime.gemm2;
        let n2 = self.hidden / g2.tile.n;
        let bm = g2.tile.m;
        let expert_rows: Vec<u32> = phase_rows.iter().map(|p| p.iter().sum()).collect();
        let total: u32 = expert_rows.iter().map(|rows| rows.div_ceil(bm) * n2).sum();
        let m_done: Vec<Vec<u32>> = phase_rows.iter().map(|p| row_tiles_done(p, bm)).collect();
        let phases = phase_rows.first().map_or(0, Vec::len);
        let mut tiles = Vec::new();
        let mut hbm_bytes = 0.0;
        for phase in 0..phases {
            for (e, &rows) in expert_rows.iter().enumerate() {
                let m_tiles = rows.div_ceil(bm);
                let first = if phase == 0 { 0 } else { m_done[e][phase - 1] };
                let last = m_done[e][phase];
                // Per row tile: its rows and time (a tile multiplies and its epilogue stores
                // its rows only: an expert's last row tile is partly empty), and its bytes.
                let row_tiles: Vec<(u32, u32, f64, f64)> = (first..last)
                    .map(|m| {
                        let (row0, row1) = (m * bm, ((m + 1) * bm).min(rows));
                        let shape = [m_tiles, n2];
                        let (multiply, bytes) =
                            model::tile_cost(&self.target, g2, self.ffn, shape, total, row1 - row0);
                        let one_device = self.topology.virtual_ranks;
                        let store =
                            model::gemm2_epilogue_seconds(g2, route, one_device, row1 - row0);
                        (row0, row1, multiply + store, bytes)
                    })
                    .collect();
                hbm_bytes += f64::from(n2) * row_tiles.iter().map(|t| t.3).sum::<f64>();
                for _ in 0..n2 {
                    for &(row0, row1, duration, _) in &row_tiles {
                        tiles.push(Tile2 {
                            expert: e,
                            row0,
                            row1,
                            duration,
                        });
                    }
                }
            }
        }
        (tiles, hbm_bytes)
    }

    /// When a rank's route kernel has released its metadata flags: its busiest block
    /// places the (token, k) pairs of its share of the call's metadata tiles.
    fn metadata_released(&self) -> f64 {
        let tokens = self.traffic.tokens_per_rank;
        let tile = self.ep.metadata_tile_tokens.max(1);
        let blocks = self
            .regime
            .launches
            .iter()
            .find(|l| l.kernel == self.ep.route_kernel)
            .expect("an expert-parallel regime launches its route kernel")
            .grid
            .blocks(tokens)
            .max(1);
        let tiles_per_block = tokens.div_ceil(tile).div_ceil(blocks);
        let pairs = tokens.min(tiles_per_block * tile) * self.traffic.top_k;
        model::METADATA_S + f64::from(pairs) * model::METADATA_PAIR_S
    }

    /// When a rank's dispatch blocks start copying.
    fn dispatch_started(&self) -> f64 {
        self.metadata_released() + model::DISPATCH_KERNEL_START_S
    }

    /// In the fused decode, when `d`'s blocks have every source's ids (a flag latency
    /// after the launch, from the farthest source) and have laid out the call's rows.
    fn laid_out(&self, d: u32) -> f64 {
        let farthest = (0..self.ep.ranks)
            .map(|s| self.latency(self.class(s, d)))
            .fold(0.0, f64::max);
        let pairs = f64::from(self.traffic.tokens_per_rank * self.traffic.top_k * self.ep.ranks);
        self.target.launch_overhead_s
            + farthest
            + model::FUSED_LAYOUT_S
            + pairs * model::FUSED_LAYOUT_PAIR_S
    }

    /// When the metadata of every source has reached `d` and arrange has laid out its rows.
    fn arranged(&self, d: u32) -> f64 {
        let farthest = (0..self.ep.ranks)
            .map(|s| self.latency(self.class(s, d)))
            .fold(0.0, f64::max);
        self.metadata_released() + farthest + model::ARRANGE_S
    }

    /// How GEMM2 follows GEMM1 in `schedule`: across real nodes the topology-aware
    /// schedule (the design to build there) runs both in one grid, GEMM2's tiles as soon as
    /// their rows are stored; elsewhere GEMM2 is a kernel after GEMM1, phases in receive
    /// order, as the kernels run it (see the module documentation).
    fn gemm2_start(&self, schedule: Schedule) -> Gemm2Start {
        if schedule == Schedule::FineGrainedTopologyAware
            && self.traffic.nodes() > 1
            && !self.topology.virtual_ranks
        {
            Gemm2Start::WithGemm1
        } else {
            Gemm2Start::AfterGemm1
        }
    }

    /// The send targets of `source` for `schedule`: its peers (its own rows stay where
    /// they are, GEMM1 reads them from x).
    fn targets(&self, source: u32, schedule: Schedule) -> Vec<To> {
        match schedule {
            Schedule::FineGrainedNaive => (0..self.ep.ranks)
                .filter(|&d| d != source)
                .map(To::Rank)
                .collect(),
            Schedule::BulkSynchronous => self.ep.send_order[source as usize]
                .iter()
                .filter(|&&d| d != source)
                .map(|&d| To::Rank(d))
                .collect(),
            Schedule::FineGrainedTopologyAware | Schedule::AsBuilt => {
                let home = self.traffic.node_of(source);
                let mut seen = vec![false; self.traffic.nodes() as usize];
                let mut targets = Vec::new();
                for &d in &self.ep.send_order[source as usize] {
                    let node = self.traffic.node_of(d);
                    if d == source {
                        continue;
                    }
                    if node == home {
                        targets.push(To::Rank(d));
                    } else if !seen[node as usize] {
                        seen[node as usize] = true;
                        let relay = self.relay(node, source);
                        targets.push(To::Node { node, relay });
                    }
                }
                targets
            }
        }
    }

    /// One call under `schedule`, recording the first `record` ranks.
    pub(super) fn run(&self, schedule: Schedule, record: u32) -> ScheduleReport {
        let ranks = self.ep.ranks;
        let r = ranks as usize;
        let mut timeline = vec![RankTimeline::default(); record.min(ranks) as usize];
        let mut ports = Ports::new(ranks);
        let launch = self.target.launch_overhead_s;
        let fused = self.fused_for(schedule);
        let queues = (0..ranks)
            .map(|s| self.token_items(s, &self.targets(s, schedule), fused.is_some()))
            .collect();
        // The fused decode's blocks send rows as their first work units, right after their
        // launch; the table's dispatch kernel starts after the metadata kernel.
        let (dispatch_start, senders) = match fused {
            Some(fused) => (
                launch + model::FUSED_SEND_START_S,
                fused.launch.grid.blocks(self.traffic.tokens_per_rank),
            ),
            None => (self.dispatch_started(), self.regime.comm_blocks),
        };
        let dispatch = self.communicate(
            &mut ports,
            queues,
            &vec![dispatch_start; r],
            senders,
            &mut timeline,
            schedule,
        );
        let mut accounting = Accounting {
            pairs_routed: (0..ranks)
                .map(|s| (0..ranks).map(|d| self.traffic.pairs_to_rank(s, d)).sum())
                .collect(),
            pairs_dispatched: vec![0; r],
            pairs_combined: Vec::new(),
            token_mismatches: Vec::new(),
        };
        for s in 0..ranks {
            for d in (0..ranks).filter(|&d| d != s) {
                let list = &dispatch.arrivals[(s * ranks + d) as usize];
                // Items end at increasing positions (none delivered twice) up to every token.
                let delivered = list.last().map_or(0, |&(pos, _)| pos);
                let once = list.windows(2).all(|pair| pair[0].0 < pair[1].0);
                if !once || delivered != self.traffic.tokens_to(s, d) {
                    accounting.token_mismatches.push((s, d));
                }
            }
        }
        let bulk = schedule == Schedule::BulkSynchronous;
        let barrier1 = dispatch.last_arrival + self.barrier_s();
        let rank_gemms =
            |d: u32, rows: &mut [u64], lane: Option<&mut RankTimeline>, hbm_share: f64| {
                // Bulk-synchronous, as the bench's baseline (a) runs it: arrange is launched
                // after the barrier, then GEMM1.
                let start = match fused {
                    Some(_) => self.laid_out(d),
                    None if bulk => barrier1 + launch + model::ARRANGE_S + launch,
                    // As built across nodes the host enqueues the compute kernels only
                    // after the chunk steps (the runtime's order: nothing waits behind a
                    // command that waits for a later one in a shared hardware queue).
                    None if schedule == Schedule::AsBuilt => {
                        self.arranged(d)
                            .max(self.chunk_steps_enqueued() + launch + model::ARRANGE_S)
                            + launch
                    }
                    None => self.arranged(d) + launch,
                };
                let ready = |s: u32, pos: u32| {
                    if bulk || pos == 0 || s == d {
                        0.0
                    } else {
                        Self::ready(&dispatch.arrivals, ranks, s, d, pos)
                    }
                };
                let gemm2 = match fused {
                    Some(fused) => Gemm2Start::Fused {
                        blocks: fused.launch.grid.blocks(self.traffic.tokens_per_rank),
                    },
                    None => self.gemm2_start(schedule),
                };
                self.gemms(d, start, &ready, rows, gemm2, lane, hbm_share)
            };
        let shares = match fused {
            Some(_) => self.hbm_shares(|d| rank_gemms(d, &mut vec![0; r], None, 1.0).hbm_bytes),
            None => vec![1.0; r],
        };
        let mut ends = Vec::with_capacity(r);
        for d in 0..ranks {
            let lane = timeline.get_mut(d as usize);
            ends.push(rank_gemms(
                d,
                &mut accounting.pairs_dispatched,
                lane,
                shares[d as usize],
            ));
        }
        let last_gemm2 = ends.iter().map(|e| e.end2).fold(0.0, f64::max);
        // Bulk-synchronous as the bench's baseline (a): every rank waits for every rank's
        // GEMMs before the combine (pair rows: GEMM2 stored into the origins as it went).
        let barrier2 = if bulk {
            last_gemm2 + self.barrier_s()
        } else {
            0.0
        };
        // The fused decode stores GEMM2's rows at their origins (pair rows) in any plan; as
        // built across nodes results return as rank partials, summed per node at a relay.
        let as_built = schedule == Schedule::AsBuilt;
        let partials = fused.is_none() && (as_built || self.results == CombineRoute::RankPartials);
        let (arrived, combined, passes_end) = if as_built {
            self.relayed_partials(&mut ports, &ends, barrier2, &mut timeline)
        } else if partials {
            let (arrived, combined, passes_end, _) =
                self.partial_results(&mut ports, &ends, barrier2, &mut timeline, false);
            (arrived, combined, passes_end)
        } else {
            let (arrived, combined) = self.streamed_results(&mut ports, &ends, schedule);
            (arrived, combined, vec![0.0; r])
        };
        accounting.pairs_combined = combined;
        // Rows an origin sums per token: its K slots, or a partial per rank its tokens visit
        // (on average, rounded up).
        let rows_per_token = |s: u32| {
            if partials {
                let visits: u64 = (0..ranks)
                    .map(|d| u64::from(self.traffic.tokens_to(s, d)))
                    .sum();
                visits.div_ceil(u64::from(self.traffic.tokens_per_rank.max(1))) as u32
            } else {
                self.traffic.top_k
            }
        };
        let mut layer: f64 = 0.0;
        // The fused decode's blocks sum their tokens in the same kernel, no launch between.
        let combine_launch = if fused.is_some() { 0.0 } else { launch };
        for (s, (&at, end)) in arrived.iter().zip(&ends).enumerate() {
            let begin = at
                .max(end.end2 + combine_launch)
                .max(barrier2)
                .max(passes_end[s]);
            let finish = begin
                + model::combine_seconds(
                    self.combine_grid(fused),
                    self.traffic.tokens_per_rank,
                    rows_per_token(s as u32),
                    self.hidden,
                );
            if let Some(lane) = timeline.get_mut(s) {
                lane.kernels.push(Span {
                    start: begin,
                    end: finish,
                    label: "combine".into(),
                });
            }
            layer = layer.max(finish);
        }
        let compute = (0..ranks)
            .map(|d| {
                let ends = self.gemms(
                    d,
                    0.0,
                    &|_, _| 0.0,
                    &mut vec![0; r],
                    Gemm2Start::AfterGemm1,
                    None,
                    1.0,
                );
                // Both GEMMs from 0 without the launch between them.
                ends.end2 - launch
            })
            .fold(0.0, f64::max);
        let network_bw = self.bandwidth(Class::Network);
        let network = (0..ranks)
            .map(|rank| {
                let out = ports.bytes[Ports::index(rank, Class::Network, OUT)];
                let inn = ports.bytes[Ports::index(rank, Class::Network, IN)];
                out.max(inn) / network_bw
            })
            .fold(0.0, f64::max);
        ScheduleReport {
            schedule,
            layer_s: layer,
            dispatch_s: if bulk {
                barrier1
            } else {
                dispatch.last_arrival
            },
            combine_s: layer - last_gemm2,
            compute_s: compute,
            network_s: network,
            accounting,
            timeline,
        }
    }

    /// Rank partials: after its GEMM2 (bulk-synchronous: after the barrier behind every
    /// rank's), each rank's combine sums its received tokens' rows and stores one partial
    /// row per (token, origin) there as it goes; an origin has its contributions when the
    /// last partial lands. With `via_relays` (as built across nodes) a partial for another
    /// node's origin goes to the relay of the origin's rail on this node instead, and counts
    /// in the relay's `stored` (when the last partial stored there landed). Returns the
    /// arrivals per origin, the pairs combined per origin, when each rank's own pass ends
    /// (its reduce follows in the same kernel), and `stored` per rank.
    fn partial_results(
        &self,
        ports: &mut Ports,
        ends: &[GemmEnds],
        barrier2: f64,
        timeline: &mut [RankTimeline],
        via_relays: bool,
    ) -> (Vec<f64>, Vec<u64>, Vec<f64>, Vec<f64>) {
        let ranks = self.ep.ranks;
        let mut at = vec![0.0f64; ranks as usize];
        let mut pairs = vec![0u64; ranks as usize];
        let mut passes_end = vec![0.0f64; ranks as usize];
        let mut stored = vec![0.0f64; ranks as usize];
        for d in 0..ranks {
            let (begin, end) = self.partials_pass(d, ends, barrier2, timeline);
            passes_end[d as usize] = end;
            let node = self.traffic.node_of(d);
            for s in 0..ranks {
                let sent = self.traffic.tokens_to(s, d);
                if sent == 0 {
                    continue;
                }
                pairs[s as usize] += self.traffic.pairs_to_rank(s, d);
                let relayed = via_relays && self.traffic.node_of(s) != node;
                let to = if relayed { self.relay(node, s) } else { s };
                let bytes = f64::from(sent) * self.row_bytes;
                let done = self.transfer(ports, begin, d, to, bytes, f64::INFINITY);
                let arrival = done.max(end) + self.latency(self.class(d, to));
                let slot = if relayed {
                    &mut stored[to as usize]
                } else {
                    &mut at[s as usize]
                };
                *slot = slot.max(arrival);
            }
        }
        (at, pairs, passes_end, stored)
    }

    /// When rank `d`'s combine pass over its received tokens (their rows summed into rank
    /// partials) begins and ends: after its GEMM2 (bulk-synchronous: after the barrier
    /// behind every rank's) and the combine's launch. Drawn on `d`'s timeline.
    fn partials_pass(
        &self,
        d: u32,
        ends: &[GemmEnds],
        barrier2: f64,
        timeline: &mut [RankTimeline],
    ) -> (f64, f64) {
        let ranks = self.ep.ranks;
        let begin = ends[d as usize].end2.max(barrier2) + self.target.launch_overhead_s;
        let tokens: u32 = (0..ranks).map(|s| self.traffic.tokens_to(s, d)).sum();
        let rows: u64 = (0..ranks).map(|s| self.traffic.pairs_to_rank(s, d)).sum();
        let end =
            begin + model::partials_seconds(self.combine_grid(None), tokens, rows, self.hidden);
        if let Some(lane) = timeline.get_mut(d as usize) {
            lane.kernels.push(Span {
                start: begin,
                end,
                label: "partials".into(),
            });
        }
        (begin, end)
    }

    /// As built across nodes: each rank's combine sums its received tokens' rows into rank
    /// partials and stores a partial for an origin of its node there, one for another
    /// node's origin at the relay of the origin's rail on this node
    /// ([`Machine::partial_results`] via relays). A relay, once every rank of its node has
    /// stored (their passes ended, their partials landed), sums them in one more pass, and
    /// the network stream then sends each rail origin the node partials of its tokens
    /// visiting the node (packed, as the rows came). Returns as
    /// [`Machine::partial_results`] does, without `stored`, a relay's pass ending after its
    /// sums.
    fn relayed_partials(
        &self,
        ports: &mut Ports,
        ends: &[GemmEnds],
        barrier2: f64,
        timeline: &mut [RankTimeline],
    ) -> (Vec<f64>, Vec<u64>, Vec<f64>) {
        let ranks = self.ep.ranks;
        let (mut at, pairs, mut passes_end, stored) =
            self.partial_results(ports, ends, barrier2, timeline, true);
        for relay in 0..ranks {
            let node = self.traffic.node_of(relay);
            let origins: Vec<u32> = (0..self.traffic.nodes())
                .filter(|&n| n != node)
                .map(|n| self.relay(n, relay))
                .collect();
            if origins.is_empty() {
                continue;
            }
            let node_done = self
                .node_ranks(node)
                .map(|d| passes_end[d as usize])
                .fold(stored[relay as usize], f64::max);
            // The sums walk each rail origin's tokens; a token's partials are the ranks of
            // this node it visited.
            let visited: u32 = origins
                .iter()
                .map(|&s| self.traffic.tokens_to_node(s, node))
                .sum();
            let partials: u32 = origins
                .iter()
                .flat_map(|&s| self.node_ranks(node).map(move |d| (s, d)))
                .map(|(s, d)| self.traffic.tokens_to(s, d))
                .sum();
            let sums = model::combine_seconds(
                self.combine_grid(None),
                visited,
                partials.div_ceil(visited.max(1)).max(1),
                self.hidden,
            );
            let ready = node_done + sums;
            passes_end[relay as usize] = passes_end[relay as usize].max(ready);
            for s in origins {
                let visiting = self.traffic.tokens_to_node(s, node);
                let bytes = f64::from(self.network_rows(visiting)) * self.row_bytes;
                let done = self.transfer(ports, ready, relay, s, bytes, f64::INFINITY);
                at[s as usize] = at[s as usize].max(done + self.latency(self.class(relay, s)));
            }
        }
        (at, pairs, passes_end)
    }

    /// Fine-grained combine: GEMM2's epilogues store an origin's result rows as an even
    /// stream from its first tile to its last (the kernels take tiles phase by phase, so an
    /// early source's results leave early); topology-aware, rows for another node go to
    /// the rank there with the origin's local index, are reduced per token, and cross once.
    fn streamed_results(
        &self,
        ports: &mut Ports,
        ends: &[GemmEnds],
        schedule: Schedule,
    ) -> (Vec<f64>, Vec<u64>) {
        let ranks = self.ep.ranks;
        // (first store, last store, destination rank, origin).
        let mut stores: Vec<(f64, f64, u32, u32)> = Vec::new();
        for d in 0..ranks {
            for s in 0..ranks {
                let at_d = &ends[d as usize];
                if self.traffic.pairs_to_rank(s, d) > 0 {
                    let (first, last) =
                        at_d.results[s as usize].unwrap_or((at_d.start2, at_d.end2));
                    stores.push((first, last, d, s));
                }
            }
        }
        stores.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut at = vec![0.0f64; ranks as usize];
        let mut pairs = vec![0u64; ranks as usize];
        let nodes = self.traffic.nodes() as usize;
        // Per (origin, node): when the relay has every contribution of that node.
        let mut relay_ready = vec![0.0f64; ranks as usize * nodes];
        let hierarchical = schedule == Schedule::FineGrainedTopologyAware;
        for &(first, last, d, s) in &stores {
            let n = self.traffic.pairs_to_rank(s, d);
            pairs[s as usize] += n;
            let bytes = n as f64 * self.row_bytes;
            let node = self.traffic.node_of(d);
            let remote = node != self.traffic.node_of(s) && !self.topology.virtual_ranks;
            let hop = if remote && hierarchical {
                self.relay(node, s)
            } else {
                s
            };
            // Results for another node go through NCCL once GEMM2 is done (the network
            // stream waits for it); over NVLink they leave as GEMM2 stores them.
            let leave = if self.class(d, hop) == Class::Network {
                ends[d as usize].end2
            } else {
                first
            };
            let done = self.transfer(ports, leave, d, hop, bytes, f64::INFINITY);
            let arrival = done.max(last) + self.latency(self.class(d, hop));
            if hop == s {
                at[s as usize] = at[s as usize].max(arrival);
            } else {
                let slot = &mut relay_ready[s as usize * nodes + node as usize];
                *slot = slot.max(arrival);
            }
        }
        if hierarchical {
            let mut sends: Vec<(f64, u32, u32)> = Vec::new();
            for s in 0..ranks {
                for node in 0..nodes as u32 {
                    let ready = relay_ready[s as usize * nodes + node as usize];
                    if ready > 0.0 {
                        sends.push((ready, s, node));
                    }
                }
            }
            sends.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (ready, s, node) in sends {
                let relay = self.relay(node, s);
                let tokens = self.traffic.tokens_to_node(s, node);
                let reduce =
                    model::combine_seconds(self.combine_grid(None), tokens, 1, self.hidden);
                let bytes = f64::from(tokens) * self.row_bytes;
                let begin = ready + reduce;
                let done = self.transfer(ports, begin, relay, s, bytes, f64::INFINITY);
                at[s as usize] = at[s as usize].max(done + self.latency(self.class(relay, s)));
            }
        }
        (at, pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::Routing;

    /// A claiming grid gives each tile to the block free first (the lowest on a tie); a
    /// dealing one gives tile `id` to block `id % grid` whenever that block is free.
    #[test]
    fn tiles_go_to_the_block_free_first_where_units_are_claimed() {
        let durations = [5.0, 1.0, 2.0, 1.0, 1.0, 1.0];
        let taken = |claims: bool| {
            let mut grid = GridBlocks::new(claims, 3, 0.0);
            let blocks: Vec<usize> = durations
                .iter()
                .enumerate()
                .map(|(id, duration)| {
                    let (b, free) = grid.take(id);
                    grid.busy_until(b, free + duration);
                    b
                })
                .collect();
            (blocks, grid.done(0.0))
        };
        // Blocks 0, 1, 2 take the first wave; block 1 is free first (at 1), then block 1
        // again (at 2, before block 2 at 2: the lower index), then block 2 (at 2)...
        assert_eq!(taken(true), (vec![0, 1, 2, 1, 1, 2], 5.0));
        assert_eq!(taken(false), (vec![0, 1, 2, 0, 1, 2], 6.0));
    }

    /// Rank 0's GEMMs at 1024 tokens per rank of a four-rank layer on `nodes` nodes (of
    /// 4 / `nodes` GPUs), uniform routing, `schedule`'s GEMM2 start (checked to be `gemm2`),
    /// the rows of the last source in receive order arriving at `late`, the others' at
    /// once: their ends and rank 0's receive order.
    fn rank0_gemms(
        nodes: u32,
        schedule: Schedule,
        gemm2: Gemm2Start,
        late: f64,
    ) -> (GemmEnds, Vec<u32>) {
        let gpus = 4 / nodes;
        let text = format!(
            "topology t {{\n gpus_per_node = {gpus}\n nodes = {nodes}\n nvlink = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}}\nlayer four {{\n hidden = 4096\n ffn = 512\n experts = 16\n top_k = 4\n max_tokens = 1024\n parallel {{ expert = 4 }}\n topology = t\n}}\n"
        );
        let module = crate::compile_source("four.moe", &text).expect("checks");
        let layer = &module.layers[0];
        let plan = crate::plan::plan(layer, &crate::plan::Target::h200()).expect("plans");
        let ep = plan.expert_parallel.as_ref().expect("four ranks");
        let tokens = 1024;
        let regime = &ep.regimes[ep.regime_index_for(tokens).expect("a regime")];
        let topology = Topology::of(&layer.topology);
        let traffic = Traffic::draw(Routing::Uniform, 4, 16, 4, gpus, tokens).expect("draws");
        let machine = Machine::new(&plan, ep, regime, &topology, &traffic, false);
        assert_eq!(machine.gemm2_start(schedule), gemm2);
        let order = ep.receive_order[0].clone();
        let last = order[3];
        let ready = |s: u32, _: u32| if s == last { late } else { 0.0 };
        let ends = machine.gemms(0, 0.0, &ready, &mut [0; 4], gemm2, None, 1.0);
        (ends, order)
    }

    /// Users with even loads get even parts; one that loads three times another's gets
    /// half the resource while both run and all of it after: 1.5 times its even part.
    #[test]
    fn uneven_loads_pass_the_early_users_part_on() {
        assert_eq!(processor_shares(&[2.0, 2.0, 2.0]), vec![1.0; 3]);
        assert_eq!(processor_shares(&[1.0, 3.0]), vec![1.0, 1.5]);
        assert_eq!(processor_shares(&[0.0, 5.0]), vec![1.0, 2.0]);
    }

    /// GEMM2 takes its tiles phase by phase, as the kernels do: a rank's own rows (its
    /// first phase) are stored before its GEMM2 ends, the last source's only at the end, and
    /// every source with rows here has a window within GEMM2's span.
    #[test]
    fn gemm2_stores_an_early_sources_results_before_its_end() {
        let (ends, order) = rank0_gemms(
            1,
            Schedule::FineGrainedTopologyAware,
            Gemm2Start::AfterGemm1,
            0.0,
        );
        let window = |s: u32| ends.results[s as usize].expect("rows from every source");
        let (own_first, own_last) = window(order[0]);
        let (_, last_source_last) = window(order[3]);
        // Its own rows are the first of four phases: stored in the first half of GEMM2
        // (expert-major, every source's rows would be stored until the end).
        let half = ends.start2 + 0.5 * (ends.end2 - ends.start2);
        assert!(
            ends.start2 <= own_first && own_last < half,
            "{:?}",
            ends.results
        );
        assert!(
            (last_source_last - ends.end2).abs() < 1e-9,
            "{:?}",
            ends.results
        );
        for s in 0..4 {
            let (first, last) = window(s);
            assert!(ends.start2 <= first && first <= last && last <= ends.end2 + 1e-9);
        }
    }

    /// Across nodes the topology-aware schedule runs GEMM2 in one grid with GEMM1: while
    /// the last source's rows are on their way, GEMM2 computes and stores the others' (in
    /// a GEMM2 after GEMM1, as the naive schedule runs it, nothing is stored before they
    /// arrive); the late rows' results still come after their arrival, and the whole ends
    /// sooner. With every row there at once, the one grid does the same work: it ends no
    /// later than the two kernels, and not impossibly sooner.
    #[test]
    fn across_nodes_the_aware_gemm2_computes_while_late_rows_arrive() {
        let in_turn =
            |late| rank0_gemms(2, Schedule::FineGrainedNaive, Gemm2Start::AfterGemm1, late).0;
        let together = |late| {
            rank0_gemms(
                2,
                Schedule::FineGrainedTopologyAware,
                Gemm2Start::WithGemm1,
                late,
            )
        };
        let at_once = in_turn(0.0);
        let late = 2.0 * at_once.end2;
        let (after, (with, order)) = (in_turn(late), together(late));
        assert!(after.start2 > late, "{} {late}", after.start2);
        let window = |s: u32| with.results[s as usize].expect("rows from every source");
        assert!(
            with.start2 < late && window(order[0]).1 < late,
            "{:?}",
            with.results
        );
        assert!(window(order[3]).0 > late && window(order[3]).1 <= with.end2 + 1e-9);
        assert!(with.end2 < after.end2, "{} {}", with.end2, after.end2);
        let (with_at_once, _) = together(0.0);
        assert!(
            with_at_once.end2 <= at_once.end2 && with_at_once.end2 > 0.8 * at_once.end2,
            "{} {}",
            with_at_once.end2,
            at_once.end2
        );
    }
}
