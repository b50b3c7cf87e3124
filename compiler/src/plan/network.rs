//! Expert parallelism across nodes: ranks on other nodes exchange their metadata, token
//! rows and results through NCCL send/recv in chunks, while peers on the same node keep
//! the one-node protocol (stores through CUDA IPC mappings, then a release of the flag).
//!
//! Traffic between nodes is hierarchical: a token's row crosses the network once per
//! remote node it visits (not once per rank there), and its results come back once per
//! node, reduced there first. Source `s` reaches node `n` through its *rail peer* there,
//! the rank of `n` with `s`'s local index (each rail's NICs carry their own traffic): that
//! *relay* receives the rows, copies each to the ranks of its node that need it (itself
//! too) and releases their chunk flags, then sums their partials per token and returns
//! one partial per (token, node). Only the receive index travels to every network peer
//! directly (it is per destination, and small).
//!
//! The kernels stage what leaves the node in this rank's own memory (its *outboxes*) and
//! release a local *ready* flag per piece. Rows for a node are *packed per token chunk*:
//! chunk `c`'s rows of the tokens visiting the node, in token order, from the chunk's
//! first row on; the relay finds a row's token by the same packing of the visit masks, and
//! the node partials return at the rows the token rows had. Rows and results across nodes
//! then sit at their token's index only at the destinations (where a same-node peer would
//! have stored them). Per call, each rank's network stream runs the steps of
//! [`NetworkPlan::steps`] in order, every rank the same sequence (NCCL matches a rank's
//! sends to a peer with that peer's receives in issue order and size):
//!
//! 1. **metadata**: waits (`cuStreamWaitValue32`) until `ep_route` has staged the receive
//!    index and counts for every network peer, and for each rail peer the *visit masks*
//!    (per token, a bit per rank of that node it visits) and the rows of each token chunk
//!    (`NetSendRows`); one NCCL group sends them and receives the peers'; then each network
//!    source's metadata flag is released with the call's epoch (`cuStreamWriteValue32`),
//!    the flag the arrange kernel (and a relay's forwarding) already waits on.
//! 2. **dispatch chunk c**: waits until `ep_dispatch` has staged token chunk `c` for every
//!    other node, one group moves its rows between rail peers into the relays' inboxes,
//!    then each rail source's arrival flag of chunk `c` is released; the relay's dispatch
//!    then copies the chunk's rows to its node's ranks (itself too, at the token's index
//!    of their `recv_x`) and releases their chunk flags `c`, which GEMM1's tiles on those
//!    rows wait on. GEMM1 starts on the first chunk, not the last.
//! 3. **return chunk c**: results across nodes return as *node partials*, one row per
//!    (token, node visited): `ep_combine`'s first pass sums each received token's rows
//!    into a rank partial and stores a network origin's at the relay of its rail (IPC),
//!    then releases the relay's flag of this rank; the relay's combine, once every rank of
//!    its node has, sums each token's rank partials (in rank order, the visit mask's
//!    bits) into its return outbox and releases `net_partials_ready`, which each return
//!    step waits on. One group sends the node partials of each rail origin's tokens of
//!    chunk `c` and receives those of this rank's own; then the return flag of (node,
//!    chunk) is released, which `ep_combine`'s second pass waits on.
//!
//! NCCL needs every byte count on the host when a transfer is enqueued, and the device
//! decides the routing. The metadata step's sizes come from the call's *tokens bound*: the
//! most tokens any rank passes in the call, which the ranks agree on beforehand on the
//! host (the runtime's `EpLayer::bound_tokens`; `max_tokens` until they do); no segment of
//! the receive index holds more. The chunk steps' sizes come from the routing: once the
//! metadata step is done, the host reads back [`ChunkRows`] (this rank's rows per chunk
//! for each other node, and its rail peers' for this node: one wait per call, while the
//! communication kernels run; the compute kernels are enqueued after the rows' transfer
//! steps) and [`NetworkPlan::chunk_steps`] moves exactly those rows, so a node that few
//! tokens visit costs few bytes. A call whose bound is at most
//! [`NetworkPlan::whole_chunks_up_to`] moves whole chunks instead ([`ChunkRows::full`]),
//! sized on the host: no read-back, no host wait, a few bytes more. A call moves at most
//! [`NetworkPlan::bytes_per_call`] of its bound.
//!
//! On emulated nodes ([`NetworkTransport::Loopback`]: virtual ranks of one GPU standing for
//! the nodes' GPUs) the kernels and steps are the same; the runtime runs every rank's
//! steps on one stream, each send a device copy into its receiver's buffer.

use serde::{Deserialize, Serialize};

use super::ep::ExpertParallelPlan;
use super::{BufferId, LayerShape};
use crate::ir;

/// How rows travel from one rank to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// A rank's own rows: GEMM1 reads them from `x`.
    Own,
    /// A peer on the same node: stores through CUDA IPC (or peer access), then a flag.
    Link,
    /// A peer on another node: staged here, then NCCL send/recv.
    Network,
}

/// What carries a call's network steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkTransport {
    /// NCCL send/recv between rank processes on different nodes.
    #[default]
    Nccl,
    /// Emulated nodes: every rank is a virtual rank of one GPU, and each step's sends are
    /// device-to-device copies into the receiving rank's buffers, run for all ranks on one
    /// stream (the runtime's loopback path). The kernels are those of real nodes.
    Loopback,
}

/// The network part of an expert-parallel plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetworkPlan {
    #[serde(default)]
    pub transport: NetworkTransport,
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// Peers on other nodes of every rank (ranks less those of its node). A peer's place in
    /// [`NetworkPlan::peers`] is its slot in the rank's receive-index outboxes.
    pub peers_per_rank: u32,
    /// The network's bandwidth one way (bytes per second) and latency (ns), from the
    /// topology.
    pub bandwidth_bytes_per_s: u64,
    pub latency_ns: u64,
    /// Token slots per NCCL transfer of rows and of results: the dispatch chunk, so that
    /// one arrival releases exactly the flag GEMM1 waits on.
    pub chunk_tokens: u32,
    /// Transfers of rows per peer and call, and of results: the chunks of a source's
    /// capacity.
    pub chunks: u32,
    /// The most bytes this rank sends in a call (a tokens bound of `max_tokens`, every token
    /// visiting every other node: the receive index to every network peer, rows and node
    /// partials to its rail peers; receives are as many).
    pub call_bytes: u64,
    /// CTAs NCCL may run (the communicator's `maxCTAs`): the SMs the plan keeps free for
    /// NCCL's kernels beside the compute grids, so a transfer GEMM1 waits for always runs.
    /// On emulated nodes, the SM each rank keeps free for the loopback's copies.
    pub nccl_ctas: u32,
    pub nccl_reason: String,
    /// Bound on the host's wait for a call's transfers (ms): past it the runtime reports
    /// the stalled transfer (which step, which peers) instead of waiting for ever.
    pub wait_limit_ms: u64,
    pub wait_reason: String,
    /// Calls whose tokens bound is at most this move whole token chunks (every chunk's
    /// rows up to the bound, whichever tokens visit), sized on the host alone: no read-back
    /// of the rows per chunk, no host wait in the call ([`NetworkPlan::moves_whole_chunks`]).
    /// Larger calls move the routed rows. 0: every call with tokens reads them back.
    #[serde(default)]
    pub whole_chunks_up_to: u32,
    #[serde(default)]
    pub whole_chunks_reason: String,
}

/// One element of a workspace buffer: a flag the network stream waits on or releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlagRef {
    pub buffer: BufferId,
    /// Element index (u32 elements).
    pub index: u64,
}

/// A byte range of a workspace buffer sent to or received from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub peer: u32,
    pub buffer: BufferId,
    pub offset_bytes: u64,
    pub bytes: u64,
}

/// What a step of the network stream carries, for messages and `explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    Metadata,
    Dispatch { chunk: u32 },
    Return { chunk: u32 },
}

impl std::fmt::Display for StepKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepKind::Metadata => write!(f, "the metadata"),
            StepKind::Dispatch { chunk } => write!(f, "dispatch chunk {chunk}"),
            StepKind::Return { chunk } => write!(f, "the results of token chunk {chunk}"),
        }
    }
}

/// One NCCL group of a call on one rank, with its stream-ordered wait before and its
/// releases after.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkStep {
    pub kind: StepKind,
    /// Flags that must hold at least the call's epoch before the step
    /// (`cuStreamWaitValue32`, GEQ: cyclic), released by this rank's kernels.
    pub wait_for: Vec<FlagRef>,
    pub sends: Vec<Transfer>,
    pub receives: Vec<Transfer>,
    /// Flags written with the call's epoch once the receives are in
    /// (`cuStreamWriteValue32`, which fences the received data before the flag).
    pub release: Vec<FlagRef>,
}

/// Assumed rate of one NCCL CTA: NCCL's all-to-all moved 295 GB/s across the two H200s'
/// NVLink (2026-11-29) with its default channels, at most 32, so a CTA carries at least
/// this much. Not measured over a real network here.
const NCCL_CTA_BYTES_PER_S: f64 = 295e9 / 32.0;
/// NCCL's channel limit (MAXCHANNELS).
const NCCL_MAX_CTAS: u32 = 32;
/// Floor of the host's wait bound: a correct call of any size finishes its transfers
/// within this much beyond the flag bounds.
const MIN_TRANSFER_SECONDS: f64 = 1.0;
/// From the metadata's arrival to the first chunk group on the network stream when the
/// host sizes the groups by the routing: the copy of the rows per chunk to pinned host
/// memory, the host noticing it (it spins), and the first group enqueued. Assumed, not
/// measured: no call has crossed real nodes here yet.
pub const HOST_READBACK_S: f64 = 20e-6;

/// The SMs each rank keeps for the network beside its own blocks on `topology` (none on one
/// node), and why: NCCL's CTAs, or on emulated nodes one SM for the loopback's copies.
pub(crate) fn network_sms(topology: &ir::Topology) -> (u32, String) {
    if topology.nodes <= 1 {
        return (0, "one node: no network".to_string());
    }
    if topology.virtual_ranks.is_some() {
        return (
            1,
            "emulated nodes: one SM per rank kept free for the loopback's device copies, should the driver run them on SMs".to_string(),
        );
    }
    let bandwidth = topology.network.bandwidth_bytes_per_s as f64;
    (
        ((bandwidth / NCCL_CTA_BYTES_PER_S).ceil() as u32).clamp(1, NCCL_MAX_CTAS),
        format!(
            "enough for the network's {:.0} GB/s at {:.1} GB/s per CTA (NCCL's all-to-all across the two H200s: 295 GB/s on at most 32 channels)",
            bandwidth / 1e9,
            NCCL_CTA_BYTES_PER_S / 1e9
        ),
    )
}

/// The network plan of `ranks` ranks on `layer`'s topology, with `chunk` tokens per
/// transfer and kernels that wait at most `flag_seconds` for a flag; `None` on one node.
pub(crate) fn plan_network(
    layer: &ir::Layer,
    shape: &LayerShape,
    ranks: u32,
    chunk: u32,
    flag_seconds: f64,
) -> Option<NetworkPlan> {
    let topology = &layer.topology;
    if topology.nodes <= 1 {
        return None;
    }
    // The checker allows several nodes with virtual ranks only as one GPU per rank.
    let transport = if topology.virtual_ranks.is_some() {
        NetworkTransport::Loopback
    } else {
        NetworkTransport::Nccl
    };
    let gpus_per_node = topology.gpus_per_node.max(1);
    let peers_per_rank = ranks - gpus_per_node.min(ranks);
    let slots = shape.max_tokens;
    let chunks = slots.div_ceil(chunk);
    let call_bytes = bytes_per_call(
        shape,
        shape.experts / ranks,
        peers_per_rank,
        topology.nodes - 1,
        chunk,
        slots,
    );
    let bandwidth = topology.network.bandwidth_bytes_per_s;
    let (nccl_ctas, nccl_reason) = network_sms(topology);
    let transfer_seconds = 4.0 * call_bytes as f64 / bandwidth.max(1) as f64;
    let wait_seconds = 2.0 * flag_seconds + transfer_seconds.max(MIN_TRANSFER_SECONDS);
    let (whole_chunks_up_to, whole_chunks_reason) =
        whole_chunks(layer, shape, topology.nodes - 1, bandwidth);
    Some(NetworkPlan {
        transport,
        nodes: topology.nodes,
        gpus_per_node,
        peers_per_rank,
        bandwidth_bytes_per_s: bandwidth,
        latency_ns: topology.network.latency_ns,
        chunk_tokens: chunk,
        chunks,
        call_bytes,
        nccl_ctas,
        nccl_reason,
        wait_limit_ms: (wait_seconds * 1e3).ceil() as u64,
        wait_reason: format!(
            "two flag bounds ({flag_seconds:.1} s each: a peer's staging may wait one for its credits, this rank's kernels one more) plus four times a call's {:.1} MB across the network at its bandwidth, at least {MIN_TRANSFER_SECONDS:.0} s",
            call_bytes as f64 / 1e6
        ),
        whole_chunks_up_to,
        whole_chunks_reason,
    })
}

/// Up to which tokens bound calls move whole chunks, and why: the spec's `whole_chunks`,
/// else the largest bound whose whole chunks (rows out and node partials back, to each
/// other node) cross this rank's network port within [`HOST_READBACK_S`], the host wait
/// they save; bytes beyond the routed rows cost no more than that wait, whatever the
/// routing.
fn whole_chunks(
    layer: &ir::Layer,
    shape: &LayerShape,
    other_nodes: u32,
    bandwidth_bytes_per_s: u64,
) -> (u32, String) {
    if let Some(tokens) = layer.schedule.whole_chunks {
        let tokens = tokens.min(shape.max_tokens);
        return (tokens, "the spec's whole_chunks".to_string());
    }
    let bytes_per_token = 2.0 * f64::from(other_nodes) * f64::from(shape.hidden) * 2.0;
    let budget = HOST_READBACK_S * bandwidth_bytes_per_s as f64;
    let tokens = ((budget / bytes_per_token).floor() as u32).min(shape.max_tokens);
    (
        tokens,
        format!(
            "the largest bound, up to max_tokens, whose whole chunks ({:.1} KB per token of the bound: a row to each of {other_nodes} other node(s), a node partial back) cross the network at {:.0} GB/s within the {:.0} us host read-back of the rows per chunk they save (assumed); `whole_chunks` in schedule sets it",
            bytes_per_token / 1e3,
            bandwidth_bytes_per_s as f64 / 1e9,
            HOST_READBACK_S * 1e6
        ),
    )
}

/// The most bytes a rank sends in a call of `tokens_bound` (receives are as many): to each
/// of its `peers` on other nodes, per local expert there the three arrays of the receive
/// index up to the bound, and the counts; to each of its rail peers (one per other node),
/// the visit masks, the rows per chunk of `chunk_tokens`, and the rows and node partials of
/// the bound's tokens, should every token visit every node.
fn bytes_per_call(
    shape: &LayerShape,
    experts_per_rank: u32,
    peers: u32,
    other_nodes: u32,
    chunk_tokens: u32,
    tokens_bound: u32,
) -> u64 {
    let tokens = u64::from(tokens_bound.min(shape.max_tokens));
    let local = u64::from(experts_per_rank);
    let row_bytes = u64::from(shape.hidden) * 2;
    let index = 3 * 4 * local * tokens + 4 * (local + 1);
    let rail =
        4 * tokens + 4 * tokens.div_ceil(u64::from(chunk_tokens.max(1))) + 2 * tokens * row_bytes;
    u64::from(peers) * index + u64::from(other_nodes) * rail
}

/// The element of `NetPartialsReady` the combine writes the epoch into (elements 0 and 1
/// count its lanes done storing rank partials and done summing node partials).
const PARTIALS_READY_EPOCH: u64 = 2;

impl NetworkPlan {
    /// The most bytes a rank sends in a call whose tokens bound is `tokens_bound` (see
    /// [`NetworkPlan::steps`]): every token visiting every other node.
    pub fn bytes_per_call(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        tokens_bound: u32,
    ) -> u64 {
        bytes_per_call(
            shape,
            ep.experts_per_rank,
            self.peers_per_rank,
            self.other_nodes(),
            self.chunk_tokens,
            tokens_bound,
        )
    }

    /// Whether a call of `tokens_bound` moves whole chunks ([`ChunkRows::full`], known on
    /// the host) rather than the routed rows the host reads back after the metadata step.
    pub fn moves_whole_chunks(&self, tokens_bound: u32) -> bool {
        tokens_bound <= self.whole_chunks_up_to
    }

    /// Nodes besides a rank's own: its rail peers, and the slots of its per-node outboxes.
    pub fn other_nodes(&self) -> u32 {
        self.nodes - 1
    }

    /// The chunks of a source's token slots that a call of `tokens_bound` can fill: its
    /// dispatch steps, and its return steps (chunks of the origin's tokens).
    pub fn chunks_within(&self, tokens_bound: u32) -> u32 {
        tokens_bound
            .min(self.chunks * self.chunk_tokens)
            .div_ceil(self.chunk_tokens)
    }

    /// The node of `rank`: ranks fill nodes in order.
    pub fn node_of(&self, rank: u32) -> u32 {
        rank / self.gpus_per_node
    }

    /// How rows travel from `source` to `destination`.
    pub fn route(&self, source: u32, destination: u32) -> Route {
        if source == destination {
            Route::Own
        } else if self.node_of(source) == self.node_of(destination) {
            Route::Link
        } else {
            Route::Network
        }
    }

    /// `rank`'s peers on other nodes, ascending; a peer's position is its slot.
    pub fn peers(&self, rank: u32, ranks: u32) -> Vec<u32> {
        (0..ranks)
            .filter(|&peer| self.route(rank, peer) == Route::Network)
            .collect()
    }

    /// `peer`'s slot among `rank`'s network peers (`None` on the same node).
    pub fn slot(&self, rank: u32, peer: u32) -> Option<u32> {
        if self.route(rank, peer) != Route::Network {
            return None;
        }
        let node_start = self.node_of(rank) * self.gpus_per_node;
        Some(if peer < node_start {
            peer
        } else {
            peer - self.gpus_per_node
        })
    }

    /// `rank`'s rail peers: on each other node, in node order, the rank with its local
    /// index (its relay there, and the origin it relays for).
    pub fn rail_peers(&self, rank: u32) -> Vec<u32> {
        let local = rank % self.gpus_per_node;
        (0..self.nodes)
            .filter(|&node| node != self.node_of(rank))
            .map(|node| node * self.gpus_per_node + local)
            .collect()
    }

    /// The slot of `peer`'s node among `rank`'s other nodes (`None` on the same node): its
    /// place in the per-node outboxes and inboxes. Every rank of a node numbers the other
    /// nodes alike.
    pub fn node_slot(&self, rank: u32, peer: u32) -> Option<u32> {
        let (mine, theirs) = (self.node_of(rank), self.node_of(peer));
        match theirs.cmp(&mine) {
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Less => Some(theirs),
            std::cmp::Ordering::Greater => Some(theirs - 1),
        }
    }

    /// The element of `NetReady` with the epoch of the metadata staged for the network
    /// peer in `slot`.
    pub fn metadata_ready(&self, slot: u32) -> u64 {
        u64::from(slot)
    }

    /// The element of `NetReady` with the epoch token chunk `chunk` was staged in for the
    /// other node in `node_slot`: after every peer's metadata flag.
    pub fn chunk_ready(&self, node_slot: u32, chunk: u32) -> u64 {
        u64::from(self.peers_per_rank)
            + u64::from(node_slot) * u64::from(self.chunks)
            + u64::from(chunk)
    }

    /// Elements of `NetReady`: a metadata flag per network peer, a chunk flag per (other
    /// node, chunk).
    pub fn ready_flags(&self) -> u64 {
        self.chunk_ready(self.other_nodes(), 0)
    }

    /// The NCCL groups of one call on `rank` in which no rank passes more than
    /// `tokens_bound` tokens and whose chunks carry `rows`, in the order every rank issues
    /// them: [`NetworkPlan::metadata_step`], then [`NetworkPlan::chunk_steps`].
    pub fn steps(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        rank: u32,
        tokens_bound: u32,
        rows: &ChunkRows,
    ) -> Vec<NetworkStep> {
        let mut steps = vec![self.metadata_step(ep, shape, rank, tokens_bound)];
        steps.extend(self.chunk_steps(ep, shape, rank, tokens_bound, rows));
        steps
    }

    /// The first group of a call on `rank` in which no rank passes more than
    /// `tokens_bound` tokens: to every network peer each receive-index segment up to the
    /// bound and the counts; to each rail peer the visit masks up to the bound and the rows
    /// of each chunk the bound spans. Every rank of a call must pass the same bound: NCCL
    /// pairs a rank's sends to a peer with that peer's receives in issue order and size.
    pub fn metadata_step(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        rank: u32,
        tokens_bound: u32,
    ) -> NetworkStep {
        let peers = self.peers(rank, ep.ranks);
        let ranks = u64::from(ep.ranks);
        let local = u64::from(ep.experts_per_rank);
        let segment = u64::from(ep.rows_per_segment);
        let max_tokens = u64::from(shape.max_tokens);
        let chunks = u64::from(self.chunks);
        // No segment holds more of a source's pairs than it has tokens.
        let bound = u64::from(tokens_bound).min(u64::from(ep.slots_per_source));
        let call_chunks = u64::from(self.chunks_within(tokens_bound));
        let indexed = segment.min(bound);
        let mut sends = Vec::new();
        let mut receives = Vec::new();
        for (slot, &peer) in peers.iter().enumerate() {
            let slot = slot as u64;
            for (outbox, inbox) in [
                (BufferId::NetSendSlot, BufferId::RecvSlot),
                (BufferId::NetSendPair, BufferId::RecvPair),
                (BufferId::NetSendWeight, BufferId::RecvWeight),
            ] {
                for e in (0..local).filter(|_| indexed > 0) {
                    sends.push(transfer(
                        peer,
                        outbox,
                        (slot * local + e) * segment,
                        indexed,
                    ));
                    receives.push(transfer(
                        peer,
                        inbox,
                        (e * ranks + u64::from(peer)) * segment,
                        indexed,
                    ));
                }
            }
            sends.push(transfer(
                peer,
                BufferId::NetSendCounts,
                slot * (local + 1),
                local + 1,
            ));
            receives.push(transfer(
                peer,
                BufferId::RecvCounts,
                u64::from(peer) * (local + 1),
                local + 1,
            ));
            if let Some(here) = self.rail_slot(rank, peer)
                && bound > 0
            {
                for (outbox, inbox, at, elems) in [
                    (
                        BufferId::NetSendMask,
                        BufferId::RecvMask,
                        here * max_tokens,
                        bound,
                    ),
                    (
                        BufferId::NetSendRows,
                        BufferId::RecvRows,
                        here * chunks,
                        call_chunks,
                    ),
                ] {
                    sends.push(transfer(peer, outbox, at, elems));
                    receives.push(transfer(peer, inbox, at, elems));
                }
            }
        }
        NetworkStep {
            kind: StepKind::Metadata,
            wait_for: (0..peers.len() as u32)
                .map(|slot| flag(BufferId::NetReady, self.metadata_ready(slot)))
                .collect(),
            sends,
            receives,
            release: peers
                .iter()
                .map(|&peer| flag(BufferId::MetaFlags, u64::from(peer)))
                .collect(),
        }
    }

    /// The groups of a call on `rank` after its metadata, `rows` saying what each chunk
    /// carries (read back once the metadata step is done, or [`ChunkRows::full`] for a call
    /// moving whole chunks): a dispatch step per chunk the
    /// bound spans, then as many return steps, both between rail peers only, each moving
    /// exactly the chunk's rows (a transfer of none is left out on both sides, which know
    /// the same count), packed from the chunk's first row on.
    pub fn chunk_steps(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        rank: u32,
        tokens_bound: u32,
        rows: &ChunkRows,
    ) -> Vec<NetworkStep> {
        let rails: Vec<(u32, u64)> = self
            .rail_peers(rank)
            .into_iter()
            .filter_map(|peer| Some((peer, u64::from(self.node_slot(rank, peer)?))))
            .collect();
        let max_tokens = u64::from(shape.max_tokens);
        let hidden = u64::from(shape.hidden);
        let chunk = u64::from(self.chunk_tokens);
        let chunks = u64::from(self.chunks);
        let call_chunks = self.chunks_within(tokens_bound.min(ep.slots_per_source));
        // Chunk c's rows for (or from) the node in `slot` start at its first token's row.
        let at = |slot: u64, c: u32| (slot * max_tokens + u64::from(c) * chunk) * hidden;
        let moves = |buffer: BufferId, count: fn(&ChunkRows, u32, u32) -> u32, c: u32| {
            rails
                .iter()
                .filter_map(|&(peer, slot)| {
                    let rows = u64::from(count(rows, slot as u32, c));
                    (rows > 0).then(|| transfer(peer, buffer, at(slot, c), rows * hidden))
                })
                .collect::<Vec<_>>()
        };
        let mut steps = Vec::with_capacity(2 * call_chunks as usize);
        for c in 0..call_chunks {
            steps.push(NetworkStep {
                kind: StepKind::Dispatch { chunk: c },
                wait_for: rails
                    .iter()
                    .map(|&(_, slot)| flag(BufferId::NetReady, self.chunk_ready(slot as u32, c)))
                    .collect(),
                sends: moves(BufferId::NetSendX, ChunkRows::sent, c),
                receives: moves(BufferId::NetRecvX, ChunkRows::received, c),
                release: rails
                    .iter()
                    .map(|&(_, slot)| flag(BufferId::NetArrived, slot * chunks + u64::from(c)))
                    .collect(),
            });
        }
        // Results, by the origin's tokens: chunk c holds the node partials of its tokens
        // [c·chunk, (c+1)·chunk) visiting the node, at the rows their token rows had.
        for c in 0..call_chunks {
            steps.push(NetworkStep {
                kind: StepKind::Return { chunk: c },
                wait_for: vec![flag(BufferId::NetPartialsReady, PARTIALS_READY_EPOCH)],
                sends: moves(BufferId::NetReturnX, ChunkRows::received, c),
                receives: moves(BufferId::NetReturnedX, ChunkRows::sent, c),
                release: rails
                    .iter()
                    .map(|&(_, slot)| flag(BufferId::NetReturnFlags, slot * chunks + u64::from(c)))
                    .collect(),
            });
        }
        steps
    }

    /// The slot of `peer`'s node among `rank`'s other nodes when `peer` is a rail peer of
    /// `rank` (`None` otherwise).
    fn rail_slot(&self, rank: u32, peer: u32) -> Option<u64> {
        (peer % self.gpus_per_node == rank % self.gpus_per_node)
            .then(|| self.node_slot(rank, peer))
            .flatten()
            .map(u64::from)
    }
}

/// A transfer of `elems` elements of `buffer` from element `first` on, with `peer`.
fn transfer(peer: u32, buffer: BufferId, first: u64, elems: u64) -> Transfer {
    Transfer {
        peer,
        buffer,
        offset_bytes: first * buffer.elem().size_bytes(),
        bytes: elems * buffer.elem().size_bytes(),
    }
}

fn flag(buffer: BufferId, index: u64) -> FlagRef {
    FlagRef { buffer, index }
}

/// The rows of each token chunk a call moves between a rank and its rail peers, by node
/// slot then chunk: what the rank's `ep_route` counted for each other node
/// (`NetSendRows`), and what each rail peer's counted for this node (`RecvRows`, brought by
/// the metadata step). NCCL needs every count on the host when a transfer is enqueued, and
/// the routing is on the device: the host reads both back once the metadata step is done
/// (one wait per call), then [`NetworkPlan::chunk_steps`] sizes each transfer by them; a
/// call moving whole chunks takes [`ChunkRows::full`] instead (the counts then go unread).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkRows {
    chunks: u32,
    sent: Vec<u32>,
    received: Vec<u32>,
}

/// A count read back from the device that no call of the bound can have (a fault in the
/// kernels or the transfer): the chunk steps would move more than the chunk holds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{direction} rows of token chunk {chunk} for the other node in slot {node_slot}: {rows}, where a chunk of a call with at most {tokens_bound} tokens per rank holds at most {most}"
)]
pub struct ChunkRowsError {
    pub direction: &'static str,
    pub node_slot: u32,
    pub chunk: u32,
    pub rows: u32,
    pub most: u32,
    pub tokens_bound: u32,
}

impl ChunkRows {
    /// Every chunk below `tokens_bound` full, on every rail: what a call whose tokens all
    /// visit every other node moves (the most any routing does).
    pub fn full(network: &NetworkPlan, shape: &LayerShape, tokens_bound: u32) -> Self {
        let per_node: Vec<u32> = (0..network.chunks)
            .map(|c| network.chunk_rows_within(shape, tokens_bound, c))
            .collect();
        let all = per_node.repeat(network.other_nodes() as usize);
        ChunkRows {
            chunks: network.chunks,
            sent: all.clone(),
            received: all,
        }
    }

    /// The counts read back (`sent`: this rank's `NetSendRows`, `received`: its
    /// `RecvRows`, each other nodes × chunks), checked against what a chunk of a call of
    /// `tokens_bound` on `shape` holds; only the chunks the bound spans count (the rest
    /// stay 0).
    pub fn read(
        network: &NetworkPlan,
        shape: &LayerShape,
        tokens_bound: u32,
        sent: &[u32],
        received: &[u32],
    ) -> Result<Self, ChunkRowsError> {
        let nodes = network.other_nodes();
        let call_chunks = network.chunks_within(tokens_bound);
        let checked = |direction: &'static str, counts: &[u32]| {
            let mut kept = vec![0u32; (nodes * network.chunks) as usize];
            for node_slot in 0..nodes {
                for chunk in 0..call_chunks {
                    let i = (node_slot * network.chunks + chunk) as usize;
                    let rows = counts.get(i).copied().unwrap_or(0);
                    let most = network.chunk_rows_within(shape, tokens_bound, chunk);
                    if rows > most {
                        return Err(ChunkRowsError {
                            direction,
                            node_slot,
                            chunk,
                            rows,
                            most,
                            tokens_bound,
                        });
                    }
                    kept[i] = rows;
                }
            }
            Ok(kept)
        };
        Ok(ChunkRows {
            chunks: network.chunks,
            sent: checked("sent", sent)?,
            received: checked("received", received)?,
        })
    }

    /// Rows of token chunk `chunk` this rank sends the other node in `node_slot`.
    pub fn sent(&self, node_slot: u32, chunk: u32) -> u32 {
        self.sent[(node_slot * self.chunks + chunk) as usize]
    }

    /// Rows of token chunk `chunk` the rail peer on the other node in `node_slot` sends
    /// this rank.
    pub fn received(&self, node_slot: u32, chunk: u32) -> u32 {
        self.received[(node_slot * self.chunks + chunk) as usize]
    }
}

impl NetworkPlan {
    /// The most rows token chunk `chunk` holds in a call of `tokens_bound` on `shape`: its
    /// tokens below the bound and max_tokens.
    pub fn chunk_rows_within(&self, shape: &LayerShape, tokens_bound: u32, chunk: u32) -> u32 {
        let first = chunk * self.chunk_tokens;
        tokens_bound
            .min(shape.max_tokens)
            .saturating_sub(first)
            .min(self.chunk_tokens)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::plan::ep::{CombineRoute, EXCHANGE_STATE, Placement};
    use crate::plan::{FlagWaitLimit, Plan, Target, plan};

    /// The tiny layer (8 experts, top 2, max_tokens 512, chunks of 16) on `nodes` nodes of
    /// `gpus` GPUs each.
    fn planned(nodes: u32, gpus: u32, extra: &str) -> Plan {
        let module = crate::compile_source("l.moe", &spec(nodes, gpus, extra)).expect("checks");
        plan(&module.layers[0], &Target::h200()).expect("plans")
    }

    /// The text `planned` plans.
    fn spec(nodes: u32, gpus: u32, extra: &str) -> String {
        let ranks = nodes * gpus;
        format!(
            "topology t {{\n gpus_per_node = {gpus}\n nodes = {nodes}\n nvlink = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}}\nlayer l {{\n hidden = 128\n ffn = 256\n experts = 8\n top_k = 2\n max_tokens = 512\n{extra} parallel {{ expert = {ranks} }}\n topology = t\n schedule {{\n  gemm1.tile = 32x64x64\n  gemm2.tile = 32x64x64\n  stages = 2\n  dispatch_chunk = 16 tokens\n  comm_blocks = 2\n }}\n}}\n"
        )
    }

    fn network_of(plan: &Plan) -> (&ExpertParallelPlan, &NetworkPlan) {
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel");
        (ep, ep.network.as_ref().expect("a network part"))
    }

    /// Whole chunks up to the largest bound whose bytes cross the network within the
    /// host's read-back (8 nodes of one GPU: 7 rows and 7 node partials of 256 B per token,
    /// 50 GB/s: 279 tokens); the spec's `whole_chunks` sets the bound instead, 0 for none,
    /// at most max_tokens.
    #[test]
    fn calls_move_whole_chunks_up_to_the_bound_the_read_back_would_cost() {
        let default = planned(8, 1, "");
        let (_, network) = network_of(&default);
        assert_eq!(network.whole_chunks_up_to, 279);
        assert!(network.moves_whole_chunks(279) && !network.moves_whole_chunks(280));
        let hinted = |value: &str| {
            let text = spec(8, 1, "").replace(
                "comm_blocks = 2\n",
                &format!("comm_blocks = 2\n  whole_chunks = {value}\n"),
            );
            let module = crate::compile_source("l.moe", &text).expect("checks");
            let plan = plan(&module.layers[0], &Target::h200()).expect("plans");
            let (_, network) = network_of(&plan);
            (
                network.whole_chunks_up_to,
                network.whole_chunks_reason.clone(),
            )
        };
        assert_eq!(hinted("0").0, 0);
        assert_eq!(hinted("16 tokens"), (16, "the spec's whole_chunks".into()));
        assert_eq!(hinted("100_000 tokens").0, 512);
        // Two nodes of the tiny layer: every call's whole chunks are cheaper.
        assert_eq!(network_of(&planned(2, 1, "")).1.whole_chunks_up_to, 512);
    }

    #[test]
    fn one_node_has_no_network_part() {
        let plan = planned(1, 2, "");
        assert!(plan.expert_parallel.as_ref().unwrap().network.is_none());
        assert!(
            !plan.limitations.iter().any(|l| l.contains("NCCL")),
            "{:?}",
            plan.limitations
        );
    }

    #[test]
    fn two_nodes_of_one_gpu_route_everything_over_the_network() {
        let plan = planned(2, 1, "");
        plan.validate().expect("valid");
        let (ep, network) = network_of(&plan);
        assert_eq!(ep.placement, Placement::Devices);
        assert_eq!(
            (network.nodes, network.gpus_per_node, network.peers_per_rank),
            (2, 1, 1)
        );
        assert_eq!(network.route(0, 1), Route::Network);
        assert_eq!(network.route(1, 1), Route::Own);
        assert_eq!(network.peers(0, 2), vec![1]);
        assert_eq!(network.slot(1, 0), Some(0));
        // Transfers are the dispatch chunk; a source's 512 slots are 32 of them.
        assert_eq!((network.chunk_tokens, network.chunks), (16, 32));
        // NCCL's CTAs come out of the compute SMs, beside the communication blocks, and
        // every compute grid has a block per compute SM at most: whatever SMs its blocks
        // take, NCCL's find empty ones.
        for regime in &ep.regimes {
            assert_eq!(
                regime.comm_blocks.max(2) + network.nccl_ctas + regime.compute_sms,
                132
            );
            for launch in &regime.launches {
                if launch.stream == crate::plan::StreamRole::Compute {
                    assert!(
                        launch.grid.blocks(512) <= regime.compute_sms,
                        "{}",
                        launch.kernel
                    );
                }
            }
        }
        // A call of max_tokens moves at most the receive index, 512 visit masks, 32
        // chunks' row counts, rows and node partials to its one network peer (also its
        // rail peer); a call of 3 tokens three entries of each index segment, 3 masks, one
        // chunk's count, 3 rows and 3 partials.
        let metadata = 3 * 4 * 4 * 512 + 4 * 5;
        assert_eq!(
            network.call_bytes,
            metadata + 4 * 512 + 4 * 32 + 512 * 128 * 2 + 512 * 128 * 2
        );
        assert_eq!(
            network.bytes_per_call(ep, &plan.shape, 512),
            network.call_bytes
        );
        assert_eq!(
            network.bytes_per_call(ep, &plan.shape, 3),
            3 * 4 * 4 * 3 + 4 * 5 + 4 * 3 + 4 + 3 * 128 * 2 + 3 * 128 * 2
        );
        assert!(plan.limitations.iter().any(|l| l.contains("NCCL")));
        let text = crate::plan::describe(&plan);
        assert!(text.contains("network steps"), "{text}");
    }

    #[test]
    fn emulated_nodes_plan_the_steps_of_real_ones_on_one_gpu() {
        let text = spec(2, 2, "").replace(" nodes = 2\n", " nodes = 2\n virtual_ranks = 4\n");
        let module = crate::compile_source("l.moe", &text).expect("checks");
        let emulated = plan(&module.layers[0], &Target::h200()).expect("plans");
        emulated.validate().expect("valid");
        let real = planned(2, 2, "");
        let (ep, network) = network_of(&emulated);
        let (real_ep, real_network) = network_of(&real);
        assert_eq!(ep.placement, Placement::Virtual);
        assert_eq!(
            (network.transport, real_network.transport),
            (NetworkTransport::Loopback, NetworkTransport::Nccl)
        );
        assert_eq!(
            (network.chunk_tokens, network.chunks),
            (real_network.chunk_tokens, real_network.chunks)
        );
        // The same steps, rank by rank, at every bound: the loopback runs what NCCL would.
        for rank in 0..4 {
            for bound in [0, 1, 17, 512] {
                let rows = routed_rows(network, &emulated.shape, 4, bound, u64::from(rank + bound));
                assert_eq!(
                    network.steps(ep, &emulated.shape, rank, bound, &rows[rank as usize]),
                    real_network.steps(real_ep, &real.shape, rank, bound, &rows[rank as usize])
                );
            }
        }
        // Every rank keeps an SM free for the copies beside its live blocks.
        for regime in &ep.regimes {
            assert!(4 * (regime.comm_blocks + regime.compute_sms + network.nccl_ctas) <= 132);
        }
        let described = crate::plan::describe(&emulated);
        assert!(described.contains("emulated on one GPU"), "{described}");
        // A virtual-rank plan that claims NCCL is refused.
        let mut wrong = emulated.clone();
        let ep = wrong.expert_parallel.as_mut().expect("expert-parallel");
        ep.network.as_mut().expect("network").transport = NetworkTransport::Nccl;
        assert!(wrong.validate().is_err());
    }

    #[test]
    fn network_peers_are_staged_first_and_received_last() {
        let plan = planned(2, 2, "");
        let (ep, network) = network_of(&plan);
        assert_eq!(network.peers(1, 4), vec![2, 3]);
        assert_eq!(network.slot(2, 1), Some(1));
        assert_eq!(network.slot(2, 3), None);
        // Rank 1: itself, its network peers rotated from it (2, 3), then its node's (0).
        assert_eq!(ep.send_order[1], vec![1, 2, 3, 0]);
        // It receives its node's peer first, then the network sources in the order they
        // reach it: 2 and 3 both send to it second (2: [2, 0, 1, 3], 3: [3, 0, 1, 2]), 3
        // the nearer in rotation.
        assert_eq!(ep.send_order[2], vec![2, 0, 1, 3]);
        assert_eq!(ep.receive_order[1], vec![1, 0, 3, 2]);
    }

    /// Over every pair of ranks on different nodes and tokens bounds from none to beyond
    /// max_tokens: see [`assert_steps_pair_up`].
    /// A rank's rail peers are the ranks with its local index on the other nodes, each
    /// its relay there and relayed for here; every rank of a node numbers the other nodes
    /// alike, and a rail peer's slot is its place among the rail peers.
    #[test]
    fn rail_peers_pair_up_and_nodes_are_numbered_alike() {
        let plan = planned(4, 2, "");
        let (ep, network) = network_of(&plan);
        assert_eq!(network.rail_peers(1), vec![3, 5, 7]);
        assert_eq!(network.rail_peers(4), vec![0, 2, 6]);
        for rank in 0..ep.ranks {
            let rails = network.rail_peers(rank);
            for (position, &rail) in rails.iter().enumerate() {
                assert!(network.rail_peers(rail).contains(&rank));
                assert_eq!(network.node_slot(rank, rail), Some(position as u32));
            }
            for peer in 0..ep.ranks {
                let same_node = network.node_of(peer) == network.node_of(rank);
                assert_eq!(network.node_slot(rank, peer).is_none(), same_node);
                let node_first = network.node_of(rank) * network.gpus_per_node;
                assert_eq!(
                    network.node_slot(rank, peer),
                    network.node_slot(node_first, peer)
                );
            }
        }
        assert_eq!(network.ready_flags(), 6 + 3 * u64::from(network.chunks));
    }

    #[test]
    fn every_send_meets_a_receive_of_the_same_bytes_within_the_buffers() {
        for ((nodes, gpus, extra), bound) in [
            (2, 1, ""),
            (2, 2, ""),
            (4, 2, " shared_experts {\n  count = 1\n  ffn = 256\n }\n"),
        ]
        .into_iter()
        .flat_map(|layer| [0, 1, 17, 48, 512, 4096].map(|bound| (layer, bound)))
        {
            let plan = planned(nodes, gpus, extra);
            let (ep, network) = network_of(&plan);
            // Chunks of 16 token slots, 512 of them: the bound's chunks, at most 32.
            assert_eq!(network.chunks_within(bound), bound.min(512).div_ceil(16));
            // Every token visiting every node: the most a call of the bound moves.
            let full = vec![ChunkRows::full(network, &plan.shape, bound); ep.ranks as usize];
            let sent = assert_steps_pair_up(&plan, bound, &full);
            assert!(
                sent.iter()
                    .all(|&s| s == network.bytes_per_call(ep, &plan.shape, bound))
            );
            for seed in 0..4 {
                let routed = routed_rows(network, &plan.shape, ep.ranks, bound, seed);
                let sent = assert_steps_pair_up(&plan, bound, &routed);
                assert!(
                    sent.iter()
                        .all(|&s| s <= network.bytes_per_call(ep, &plan.shape, bound))
                );
            }
        }
    }

    /// Rows per chunk as a call's routing would give them to each of `ranks` ranks: a
    /// pseudo-random count (`seed`) up to what each chunk of `bound` holds, zeros included,
    /// each rank's received counts its rail peers' sent ones.
    fn routed_rows(
        network: &NetworkPlan,
        shape: &LayerShape,
        ranks: u32,
        bound: u32,
        seed: u64,
    ) -> Vec<ChunkRows> {
        let nodes = network.other_nodes();
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let sent: Vec<Vec<u32>> = (0..ranks)
            .map(|_| {
                (0..nodes * network.chunks)
                    .map(|i| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        let most = network.chunk_rows_within(shape, bound, i % network.chunks);
                        (state % u64::from(most + 2)).min(u64::from(most)) as u32
                    })
                    .collect()
            })
            .collect();
        (0..ranks)
            .map(|rank| {
                let mut received = vec![0; (nodes * network.chunks) as usize];
                for rail in network.rail_peers(rank) {
                    let here = network.node_slot(rank, rail).expect("another node");
                    let there = network.node_slot(rail, rank).expect("another node");
                    for c in 0..network.chunks {
                        received[(here * network.chunks + c) as usize] =
                            sent[rail as usize][(there * network.chunks + c) as usize];
                    }
                }
                ChunkRows::read(network, shape, bound, &sent[rank as usize], &received)
                    .expect("within the chunks")
            })
            .collect()
    }

    #[test]
    fn counts_read_back_beyond_a_chunk_are_refused() {
        let plan = planned(2, 2, "");
        let (_, network) = network_of(&plan);
        let mut sent = vec![0u32; network.chunks as usize];
        // Chunk 1 of a bound of 20 tokens holds tokens 16..20: 4 rows at most.
        sent[1] = 5;
        let error = ChunkRows::read(network, &plan.shape, 20, &sent, &sent).expect_err("refused");
        assert_eq!((error.chunk, error.rows, error.most), (1, 5, 4));
        assert!(error.to_string().contains("at most 20 tokens"), "{error}");
        // Chunks beyond the bound are not read.
        sent[1] = 4;
        sent[5] = 1000;
        let rows = ChunkRows::read(network, &plan.shape, 20, &sent, &sent).expect("fits");
        assert_eq!((rows.sent(0, 1), rows.received(0, 5)), (4, 0));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The same over random nodes and GPUs per node (their ranks dividing the 8
        /// experts), max_tokens, chunks (dividing max_tokens or not; at most max_tokens), bounds and routings.
        #[test]
        fn steps_pair_up_for_any_layer_and_bound(
            (nodes, gpus) in proptest::sample::select(vec![(2u32, 1u32), (2, 2), (2, 4), (4, 1), (4, 2)]),
            max_tokens in 1u32..=300,
            chunk in 1u32..=64,
            bound in 0u32..=400,
            shared in proptest::bool::ANY,
            seed in proptest::num::u64::ANY,
        ) {
            let extra = if shared { " shared_experts {\n  count = 1\n  ffn = 256\n }\n" } else { "" };
            let text = spec(nodes, gpus, extra)
                .replace("max_tokens = 512", &format!("max_tokens = {max_tokens}"))
                .replace("dispatch_chunk = 16 tokens", &format!("dispatch_chunk = {} tokens", chunk.min(max_tokens)));
            let module = crate::compile_source("l.moe", &text).expect("checks");
            let plan = plan(&module.layers[0], &Target::h200()).expect("plans");
            let (ep, network) = network_of(&plan);
            let full = vec![ChunkRows::full(network, &plan.shape, bound); ep.ranks as usize];
            assert_steps_pair_up(&plan, bound, &full);
            assert_steps_pair_up(&plan, bound, &routed_rows(network, &plan.shape, ep.ranks, bound, seed));
        }
    }

    /// For a call of `plan` whose tokens bound is `bound` and whose chunks carry `rows[r]`
    /// on rank `r`, on every rank: each step's sends to a peer match that peer's receives in
    /// that step (same order, same bytes), every range fits its buffer, rows and results go
    /// to rail peers only, each chunk step moves that chunk's rows, and the call waits for
    /// every staging flag of the chunks it moves and releases every flag the kernels of
    /// such a call wait on, once. Returns the bytes each rank sends.
    fn assert_steps_pair_up(plan: &Plan, bound: u32, rows: &[ChunkRows]) -> Vec<u64> {
        plan.validate().expect("valid");
        let (ep, network) = network_of(plan);
        let ranks = ep.ranks;
        let size = |id: BufferId| {
            ep.workspace
                .iter()
                .find(|b| b.id == id)
                .unwrap_or_else(|| panic!("no {}", id.name()))
                .bytes()
        };
        let steps: Vec<Vec<NetworkStep>> = (0..ranks)
            .map(|r| network.steps(ep, &plan.shape, r, bound, &rows[r as usize]))
            .collect();
        let call_chunks = u64::from(network.chunks_within(bound));
        let slots = u64::from(ep.slots_per_source);
        assert_eq!(
            call_chunks,
            u64::from(bound)
                .min(slots)
                .div_ceil(u64::from(network.chunk_tokens))
        );
        assert!(steps.iter().all(|s| s.len() as u64 == 1 + 2 * call_chunks));
        let row_bytes = u64::from(plan.shape.hidden) * 2;
        let mut sent_per_rank = Vec::new();
        for (rank, rank_steps) in steps.iter().enumerate() {
            let rank = rank as u32;
            let rails = network.rail_peers(rank);
            assert_eq!(rails.len() as u32, network.nodes - 1);
            sent_per_rank.push(
                rank_steps
                    .iter()
                    .flat_map(|s| &s.sends)
                    .map(|t| t.bytes)
                    .sum(),
            );
            let mut released = HashMap::new();
            let mut waited = HashMap::new();
            for (i, step) in rank_steps.iter().enumerate() {
                for t in step.sends.iter().chain(&step.receives) {
                    assert!(
                        t.bytes > 0 && t.offset_bytes + t.bytes <= size(t.buffer),
                        "{t:?}"
                    );
                    assert_eq!(network.route(rank, t.peer), Route::Network);
                    if i > 0 {
                        assert!(rails.contains(&t.peer), "{t:?} from {rank}");
                    }
                }
                // A chunk step moves the chunk's rows with each rail peer: token rows out
                // and in, then node partials back the other way.
                let chunk_rows = |c: u32, out: bool| -> u64 {
                    rails
                        .iter()
                        .map(|&rail| {
                            let slot = network.node_slot(rank, rail).expect("another node");
                            let r = &rows[rank as usize];
                            u64::from(if out {
                                r.sent(slot, c)
                            } else {
                                r.received(slot, c)
                            })
                        })
                        .sum::<u64>()
                        * row_bytes
                };
                let bytes = |transfers: &[Transfer]| transfers.iter().map(|t| t.bytes).sum::<u64>();
                match step.kind {
                    StepKind::Metadata => {}
                    StepKind::Dispatch { chunk } => {
                        assert_eq!(bytes(&step.sends), chunk_rows(chunk, true));
                        assert_eq!(bytes(&step.receives), chunk_rows(chunk, false));
                    }
                    StepKind::Return { chunk } => {
                        assert_eq!(bytes(&step.sends), chunk_rows(chunk, false));
                        assert_eq!(bytes(&step.receives), chunk_rows(chunk, true));
                    }
                }
                for peer in network.peers(rank, ranks) {
                    let sent: Vec<u64> = step
                        .sends
                        .iter()
                        .filter(|t| t.peer == peer)
                        .map(|t| t.bytes)
                        .collect();
                    let received: Vec<u64> = steps[peer as usize][i]
                        .receives
                        .iter()
                        .filter(|t| t.peer == rank)
                        .map(|t| t.bytes)
                        .collect();
                    assert!(i > 0 || !sent.is_empty());
                    assert_eq!(sent, received, "step {i} from {rank} to {peer}");
                }
                for flag in &step.release {
                    *released.entry((flag.buffer, flag.index)).or_insert(0) += 1;
                    assert!((flag.index + 1) * 4 <= size(flag.buffer));
                }
                for flag in &step.wait_for {
                    *waited.entry((flag.buffer, flag.index)).or_insert(0) += 1;
                }
            }
            let peers = u64::from(network.peers_per_rank);
            let nodes = u64::from(network.other_nodes());
            let chunks = u64::from(network.chunks);
            // Each network source's metadata flag and the flags of the chunks the bound
            // spans (a chunk's arrival per rail source, a token chunk's return flag per
            // other node), whatever they carry: the flags a call's kernels wait on with at
            // most `bound` tokens per rank. Once each.
            assert_eq!(released.len() as u64, peers + 2 * nodes * call_chunks);
            assert!(released.values().all(|&n| n == 1));
            for peer in network.peers(rank, ranks) {
                assert!(released.contains_key(&(BufferId::MetaFlags, u64::from(peer))));
            }
            for &rail in &rails {
                let slot = u64::from(network.node_slot(rank, rail).expect("another node"));
                for c in 0..call_chunks {
                    for flag in [
                        (BufferId::NetArrived, slot * chunks + c),
                        (BufferId::NetReturnFlags, slot * chunks + c),
                    ] {
                        assert!(released.contains_key(&flag), "{flag:?} at bound {bound}");
                    }
                }
            }
            // The staging flags of the metadata (each peer's) and of those chunks (each
            // other node's), once; and before each return step, the combine's flag of its
            // node partials.
            let partials = (BufferId::NetPartialsReady, PARTIALS_READY_EPOCH);
            assert_eq!(waited.remove(&partials).unwrap_or(0), call_chunks);
            assert_eq!(waited.len() as u64, peers + nodes * call_chunks);
            assert!(waited.values().all(|&n| n == 1));
        }
        sent_per_rank
    }

    /// The spec's `flag_timeout` bounds every flag wait of the kernels, and the host's wait
    /// for a call's transfers counts two of them.
    #[test]
    fn the_flag_timeout_bounds_the_kernels_waits_and_the_hosts() {
        let default = planned(2, 1, "");
        let text = spec(2, 1, "").replace(
            "comm_blocks = 2\n",
            "comm_blocks = 2\n  flag_timeout = 60_000 ms\n",
        );
        let module = crate::compile_source("l.moe", &text).expect("checks");
        let hinted = plan(&module.layers[0], &Target::h200()).expect("plans");
        assert_eq!(
            hinted.flag_wait_limit,
            FlagWaitLimit {
                cycles: 118_800_000_000,
                hinted: true
            }
        );
        assert_eq!(default.flag_wait_limit, FlagWaitLimit::default());
        let wait_ms = |plan: &Plan| network_of(plan).1.wait_limit_ms;
        assert!(wait_ms(&hinted) >= 120_000, "{}", wait_ms(&hinted));
        assert!(wait_ms(&default) < 10_000, "{}", wait_ms(&default));
        let source = crate::codegen::generate(&hinted).expect("generates").source;
        assert!(source.contains("SPIN_LIMIT_CYCLES = 118800000000LL"));
    }

    /// The flags the network stream waits on restart with the exchange after a time-out.
    #[test]
    fn the_network_flags_are_exchange_state() {
        assert!(EXCHANGE_STATE.contains(&BufferId::NetReady));
        assert!(EXCHANGE_STATE.contains(&BufferId::NetArrived));
        assert!(EXCHANGE_STATE.contains(&BufferId::NetReturnFlags));
        assert!(EXCHANGE_STATE.contains(&BufferId::NetPartialsReady));
    }

    /// Across nodes results return as rank partials (a plan with pair rows is refused),
    /// and the combine writes a network origin's partials into the return outbox.
    #[test]
    fn results_across_nodes_return_as_rank_partials() {
        let plan = planned(2, 1, "");
        let (ep, _) = network_of(&plan);
        assert_eq!(ep.combine_route, CombineRoute::RankPartials);
        let source = crate::codegen::generate(&plan).expect("generates").source;
        assert!(
            source.contains("net_partials_ready"),
            "the combine releases the partials"
        );
        let mut wrong = plan.clone();
        wrong.expert_parallel.as_mut().unwrap().combine_route = CombineRoute::PairRows;
        let error = wrong.validate().expect_err("refused").to_string();
        assert!(error.contains("rank partials"), "{error}");
    }

    #[test]
    fn validation_refuses_a_transfer_that_is_not_a_chunk() {
        let mut plan = planned(2, 1, "");
        let ep = plan.expert_parallel.as_mut().unwrap();
        ep.network.as_mut().unwrap().chunk_tokens = 32;
        let error = plan.validate().expect_err("refused").to_string();
        assert!(error.contains("network"), "{error}");
    }

    /// The results' chunks cover max_tokens; more receive slots than that would make the
    /// steps' last chunks start past the tokens.
    #[test]
    fn validation_refuses_receive_slots_beyond_max_tokens() {
        let mut plan = planned(2, 1, "");
        let ep = plan.expert_parallel.as_mut().unwrap();
        ep.slots_per_source += ep.dispatch_chunk;
        ep.chunks_per_source += 1;
        ep.network.as_mut().unwrap().chunks += 1;
        let error = plan.validate().expect_err("refused").to_string();
        assert!(error.contains("are not max_tokens"), "{error}");
    }
}
