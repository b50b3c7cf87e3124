//! The event loop and the per-rank GEMM walk behind [`super::simulate`].

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use super::model::{self, COMM_BLOCK_BYTES_PER_S};
use super::{Accounting, RankTimeline, Schedule, ScheduleReport, Span, Topology, Traffic};
use crate::plan::ep::{CombineRoute, ExpertParallelPlan, ExpertParallelRegime};
use crate::plan::{GemmPlan, Plan, Target};

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

/// When one rank's GEMMs end, and when GEMM2 stores each origin's results.
struct GemmEnds {
    start2: f64,
    end2: f64,
    /// Per origin rank: when GEMM2's first tile holding its rows starts and its last one
    /// ends (`None`: none of its rows are here).
    results: Vec<Option<(f64, f64)>>,
}

/// What a run of the communication blocks produced.
struct CommResult {
    /// Per (origin, destination): (end position, arrival time) of each delivered item.
    arrivals: Vec<Vec<(u32, f64)>>,
    last_arrival: f64,
}

/// A plan, a topology and one call's routing: everything a schedule run needs.
pub(super) struct Machine<'a> {
    ep: &'a ExpertParallelPlan,
    regime: &'a ExpertParallelRegime,
    target: &'a Target,
    topology: &'a Topology,
    traffic: &'a Traffic,
    hidden: u32,
    ffn: u32,
    /// Shared-expert slices every rank runs on its own tokens after its local experts.
    shared_slices: u32,
    row_bytes: f64,
}

impl<'a> Machine<'a> {
    pub(super) fn new(
        plan: &'a Plan,
        ep: &'a ExpertParallelPlan,
        regime: &'a ExpertParallelRegime,
        topology: &'a Topology,
        traffic: &'a Traffic,
    ) -> Self {
        Machine {
            ep,
            regime,
            target: &plan.target,
            topology,
            traffic,
            hidden: plan.shape.hidden,
            ffn: plan.shape.ffn,
            shared_slices: plan.shape.shared_slices,
            row_bytes: f64::from(plan.shape.hidden) * 2.0,
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
            // Virtual ranks copy within one device: read and write, half the copy rate
            // each, as the planner assumes.
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
    fn token_items(&self, origin: u32, targets: &[To]) -> VecDeque<Item> {
        let total = |to: &To| match *to {
            To::Rank(d) => self.traffic.tokens_to(origin, d),
            To::Node { node, .. } => self.traffic.tokens_to_node(origin, node),
        };
        let chunk = self.ep.dispatch_chunk.max(1);
        let chunks: u32 = targets.iter().map(|to| total(to).div_ceil(chunk)).sum();
        let unit = if chunks < self.regime.comm_blocks {
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

    /// Runs every rank's communication blocks over its queue from `start[rank]`.
    fn communicate(
        &self,
        ports: &mut Ports,
        mut queues: Vec<VecDeque<Item>>,
        start: &[f64],
        timeline: &mut [RankTimeline],
    ) -> CommResult {
        let ranks = self.ep.ranks;
        let mut result = CommResult {
            arrivals: vec![Vec::new(); (ranks * ranks) as usize],
            last_arrival: 0.0,
        };
        let mut heap = BinaryHeap::new();
        for rank in 0..ranks {
            for _ in 0..self
                .regime
                .comm_blocks
                .min(queues[rank as usize].len() as u32)
            {
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
                        (
                            self.transfer(ports, staged, rank, first_hop, bytes, f64::INFINITY),
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

    /// When slot `pos` (1-based end) of `origin`'s tokens at `d` has arrived.
    fn ready(arrivals: &[Vec<(u32, f64)>], ranks: u32, origin: u32, d: u32, pos: u32) -> f64 {
        let list = &arrivals[(origin * ranks + d) as usize];
        let i = list.partition_point(|&(end, _)| end < pos);
        list.get(i).or(list.last()).map_or(0.0, |&(_, t)| t)
    }

    /// Rank `d`'s GEMMs from `start`, GEMM1 row tiles ready as `ready` says; returns when
    /// they end and when each origin's results are stored, and adds the rows per origin
    /// to `rows`.
    fn gemms(
        &self,
        d: u32,
        start: f64,
        ready: &dyn Fn(u32, u32) -> f64,
        rows: &mut [u64],
        gemm2_last_first: bool,
        lane: Option<&mut RankTimeline>,
    ) -> GemmEnds {
        let order = &self.ep.receive_order[d as usize];
        let (g1, g2) = (&self.regime.gemm1, &self.regime.gemm2);
        let mut tiles = Vec::new();
        let mut block1 = vec![start; g1.grid_blocks.max(1) as usize];
        // Per expert in tile order, its rows per phase (GEMM2 takes its tiles in the same
        // phase-major order as GEMM1).
        let mut block2_rows: Vec<Vec<u32>> = Vec::new();
        // The shared slices first, as the kernels order them: a row per own token each,
        // read from x (ready at once), in the first phase (this rank's own source); no
        // pair is dispatched for them.
        let own = self.traffic.tokens_per_rank;
        for _ in 0..self.shared_slices {
            let m_tiles = own.div_ceil(g1.tile.m);
            let mut phases = vec![0; order.len()];
            phases[0] = own;
            block2_rows.push(phases);
            tiles.push((vec![start; m_tiles as usize], vec![m_tiles; order.len()]));
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
            tiles.push((row_ready, m_done));
            block2_rows.push(phase_rows);
        }
        let n1 = self.ffn / g1.tile.n;
        let total: u32 = tiles
            .iter()
            .map(|(row_ready, _)| row_ready.len() as u32 * n1)
            .sum();
        let mut id = 0usize;
        let mut record = lane;
        let mut hbm_bytes = 0.0;
        // Tiles in the kernels' order: phase, expert (shared slices first), n-tile, m-tile.
        for phase in 0..order.len() {
            for (row_ready, m_done) in &tiles {
                let m_tiles = row_ready.len() as u32;
                let (duration, bytes) =
                    model::tile_cost(self.target, g1, self.hidden, [m_tiles, n1], total);
                let begin_m = if phase == 0 { 0 } else { m_done[phase - 1] } as usize;
                let phase_tiles = &row_ready[begin_m..m_done[phase] as usize];
                hbm_bytes += bytes * f64::from(n1) * phase_tiles.len() as f64;
                for _ in 0..n1 {
                    for &r in phase_tiles {
                        let b = id % block1.len();
                        let begin = block1[b].max(r);
                        block1[b] = begin + duration;
                        if b == 0
                            && let Some(lane) = record.as_deref_mut()
                        {
                            lane.tiles.push(Span {
                                start: begin,
                                end: begin + duration,
                                label: "GEMM1".into(),
                            });
                        }
                        id += 1;
                    }
                }
            }
        }
        let end1 = block1
            .iter()
            .copied()
            .fold(start + model::hbm_seconds(self.target, hbm_bytes), f64::max);
        let start2 = end1 + self.target.launch_overhead_s;
        let (end2, results) = self.gemm2(
            g2,
            start2,
            order,
            &block2_rows,
            gemm2_last_first,
            record.as_deref_mut(),
        );
        if let Some(lane) = record {
            lane.kernels.push(Span {
                start,
                end: end1,
                label: "GEMM1".into(),
            });
            lane.kernels.push(Span {
                start: start2,
                end: end2,
                label: "GEMM2".into(),
            });
        }
        GemmEnds {
            start2,
            end2,
            results,
        }
    }

    /// GEMM2 over experts with `phase_rows[e][p]` rows of phase `p` (source `order[p]`)
    /// each, every row present at `start`, its tiles in the kernels' order: phase (of a
    /// tile's last row; from the last with `last_first`), expert, n-tile, m-tile. Returns its end and, per source rank, when
    /// its first tile started and its last ended (`None`: no rows here).
    fn gemm2(
        &self,
        g2: &GemmPlan,
        start: f64,
        order: &[u32],
        phase_rows: &[Vec<u32>],
        last_first: bool,
        mut lane: Option<&mut RankTimeline>,
    ) -> (f64, Vec<Option<(f64, f64)>>) {
        let mut blocks = vec![start; g2.grid_blocks.max(1) as usize];
        let n2 = self.hidden / g2.tile.n;
        let bm = g2.tile.m;
        let expert_rows: Vec<u32> = phase_rows.iter().map(|p| p.iter().sum()).collect();
        let total: u32 = expert_rows.iter().map(|rows| rows.div_ceil(bm) * n2).sum();
        let mut id = 0usize;
        let mut hbm_bytes = 0.0;
        let mut results: Vec<Option<(f64, f64)>> = vec![None; self.ep.ranks as usize];
        let m_done: Vec<Vec<u32>> = phase_rows.iter().map(|p| row_tiles_done(p, bm)).collect();
        let phases: Vec<usize> = if last_first {
            (0..order.len()).rev().collect()
        } else {
            (0..order.len()).collect()
        };
        for phase in phases {
            for (e, &rows) in expert_rows.iter().enumerate() {
                let m_tiles = rows.div_ceil(bm);
                let (tile, bytes) =
                    model::tile_cost(self.target, g2, self.ffn, [m_tiles, n2], total);
                let first = if phase == 0 { 0 } else { m_done[e][phase - 1] };
                let last = m_done[e][phase];
                hbm_bytes += bytes * f64::from(n2 * (last - first));
                for _ in 0..n2 {
                    for m in first..last {
                        // A tile's epilogue stores its rows only (an expert's last row tile
                        // is partly empty).
                        let (row0, row1) = (m * bm, ((m + 1) * bm).min(rows));
                        let duration = tile
                            + model::gemm2_epilogue_seconds(g2, self.ep.combine_route, row1 - row0);
                        let b = id % blocks.len();
                        let begin = blocks[b];
                        blocks[b] += duration;
                        if b == 0
                            && let Some(lane) = lane.as_deref_mut()
                        {
                            lane.tiles.push(Span {
                                start: begin,
                                end: blocks[b],
                                label: "GEMM2".into(),
                            });
                        }
                        // The sources whose rows the tile holds.
                        let mut phase_start = 0;
                        for (p, &n) in phase_rows[e].iter().enumerate() {
                            let phase_end = phase_start + n;
                            if n > 0 && phase_start < row1 && row0 < phase_end {
                                let slot = &mut results[order[p] as usize];
                                *slot = Some(slot.map_or((begin, blocks[b]), |(first, last)| {
                                    (first.min(begin), last.max(blocks[b]))
                                }));
                            }
                            phase_start = phase_end;
                        }
                        id += 1;
                    }
                }
            }
        }
        let tiles_end = blocks.iter().copied().fold(start, f64::max);
        let end = tiles_end.max(start + model::hbm_seconds(self.target, hbm_bytes));
        // Where HBM, not the tiles, sets the end, every tile runs that much slower.
        let stretch = if tiles_end > start {
            (end - start) / (tiles_end - start)
        } else {
            1.0
        };
        let stretched = |t: f64| start + (t - start) * stretch;
        for slot in results.iter_mut().flatten() {
            *slot = (stretched(slot.0), stretched(slot.1));
        }
        (end, results)
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

    /// When the metadata of every source has reached `d` and arrange has laid out its rows.
    fn arranged(&self, d: u32) -> f64 {
        let farthest = (0..self.ep.ranks)
            .map(|s| self.latency(self.class(s, d)))
            .fold(0.0, f64::max);
        self.metadata_released() + farthest + model::ARRANGE_S
    }

    /// Whether GEMM2 takes its phases from the last in `schedule`: the topology-aware
    /// schedule across real nodes, whose results go back through the node's relay as
    /// GEMM2 stores them (see the module documentation).
    fn gemm2_last_first(&self, schedule: Schedule) -> bool {
        schedule == Schedule::FineGrainedTopologyAware
            && self.traffic.nodes() > 1
            && !self.topology.virtual_ranks
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
            Schedule::FineGrainedTopologyAware => {
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
                        let relay = (node * self.traffic.gpus_per_node
                            + source % self.traffic.gpus_per_node)
                            .min(self.ep.ranks - 1);
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
        let queues = (0..ranks)
            .map(|s| self.token_items(s, &self.targets(s, schedule)))
            .collect();
        let dispatch = self.communicate(
            &mut ports,
            queues,
            &vec![self.dispatch_started(); r],
            &mut timeline,
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
        let mut ends = Vec::with_capacity(r);
        for d in 0..ranks {
            // Bulk-synchronous, as the bench's baseline (a) runs it: arrange is launched
            // after the barrier, then GEMM1.
            let start = if bulk {
                barrier1 + launch + model::ARRANGE_S
            } else {
                self.arranged(d)
            } + launch;
            let ready = |s: u32, pos: u32| {
                if bulk || pos == 0 || s == d {
                    0.0
                } else {
                    Self::ready(&dispatch.arrivals, ranks, s, d, pos)
                }
            };
            let lane = timeline.get_mut(d as usize);
            ends.push(self.gemms(
                d,
                start,
                &ready,
                &mut accounting.pairs_dispatched,
                self.gemm2_last_first(schedule),
                lane,
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
        let partials = self.ep.combine_route == CombineRoute::RankPartials;
        let (arrived, combined, passes_end) = if partials {
            self.partial_results(&mut ports, &ends, barrier2, &mut timeline)
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
        for (s, (&at, end)) in arrived.iter().zip(&ends).enumerate() {
            let begin = at.max(end.end2 + launch).max(barrier2).max(passes_end[s]);
            let finish = begin
                + model::combine_seconds(
                    self.target,
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
                let ends = self.gemms(d, 0.0, &|_, _| 0.0, &mut vec![0; r], false, None);
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
    /// last partial lands. Returns the arrivals per origin, the pairs combined per origin,
    /// and when each rank's own pass ends (its reduce follows in the same kernel).
    fn partial_results(
        &self,
        ports: &mut Ports,
        ends: &[GemmEnds],
        barrier2: f64,
        timeline: &mut [RankTimeline],
    ) -> (Vec<f64>, Vec<u64>, Vec<f64>) {
        let ranks = self.ep.ranks;
        let launch = self.target.launch_overhead_s;
        let mut at = vec![0.0f64; ranks as usize];
        let mut pairs = vec![0u64; ranks as usize];
        let mut passes_end = vec![0.0f64; ranks as usize];
        for d in 0..ranks {
            let begin = ends[d as usize].end2.max(barrier2) + launch;
            let tokens: u32 = (0..ranks).map(|s| self.traffic.tokens_to(s, d)).sum();
            let rows: u64 = (0..ranks).map(|s| self.traffic.pairs_to_rank(s, d)).sum();
            let end = begin + model::partials_seconds(self.target, tokens, rows, self.hidden);
            passes_end[d as usize] = end;
            if let Some(lane) = timeline.get_mut(d as usize) {
                lane.kernels.push(Span {
                    start: begin,
                    end,
                    label: "partials".into(),
                });
            }
            for s in 0..ranks {
                let sent = self.traffic.tokens_to(s, d);
                if sent == 0 {
                    continue;
                }
                pairs[s as usize] += self.traffic.pairs_to_rank(s, d);
                let bytes = f64::from(sent) * self.row_bytes;
                let done = self.transfer(ports, begin, d, s, bytes, f64::INFINITY);
                let arrival = done.max(end) + self.latency(self.class(d, s));
                at[s as usize] = at[s as usize].max(arrival);
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
        let g = self.traffic.gpus_per_node;
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
                (node * g + s % g).min(ranks - 1)
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
                let relay = (node * g + s % g).min(ranks - 1);
                let tokens = self.traffic.tokens_to_node(s, node);
                let reduce = model::combine_seconds(self.target, tokens, 1, self.hidden);
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

    /// Rank 0's GEMMs at 1024 tokens per rank of a four-rank layer on `nodes` nodes (of
    /// 4 / `nodes` GPUs), uniform routing, GEMM2 in `schedule`'s phase order (checked to
    /// be last first exactly where `last_first` says): their ends and rank 0's receive order.
    fn rank0_gemms(nodes: u32, schedule: Schedule, last_first: bool) -> (GemmEnds, Vec<u32>) {
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
        let machine = Machine::new(&plan, ep, regime, &topology, &traffic);
        assert_eq!(machine.gemm2_last_first(schedule), last_first);
        let ends = machine.gemms(
            0,
            0.0,
            &|_, _| 0.0,
            &mut [0; 4],
            machine.gemm2_last_first(schedule),
            None,
        );
        (ends, ep.receive_order[0].clone())
    }

    /// GEMM2 takes its tiles phase by phase, as the kernels do: a rank's own rows (its
    /// first phase) are stored before its GEMM2 ends, the last source's only at the end, and
    /// every source with rows here has a window within GEMM2's span.
    #[test]
    fn gemm2_stores_an_early_sources_results_before_its_end() {
        let (ends, order) = rank0_gemms(1, Schedule::FineGrainedTopologyAware, false);
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

    /// Across nodes the topology-aware schedule has GEMM2 take its phases from the last:
    /// the last source in receive order (on the other node) is stored from GEMM2's first
    /// tile and done before its end, the rank's own rows at the end (in receive order it is
    /// the other way round: see the test above).
    #[test]
    fn across_nodes_the_aware_gemm2_stores_the_farthest_sources_results_first() {
        let (ends, order) = rank0_gemms(2, Schedule::FineGrainedTopologyAware, true);
        // The naive schedule keeps the receive order (rank0_gemms checks which it takes).
        rank0_gemms(2, Schedule::FineGrainedNaive, false);
        let window = |s: u32| ends.results[s as usize].expect("rows from every source");
        let (farthest_first, farthest_last) = window(order[3]);
        let (_, own_last) = window(order[0]);
        assert!(
            (farthest_first - ends.start2).abs() < 1e-9 && farthest_last < ends.end2 - 1e-9,
            "{:?}",
            ends.results
        );
        assert!((own_last - ends.end2).abs() < 1e-9, "{:?}", ends.results);
    }
}
