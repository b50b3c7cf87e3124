//! Expert parallelism across nodes: ranks on other nodes exchange their metadata, token
//! rows and results through NCCL send/recv in chunks, while peers on the same node keep
//! the one-node protocol (stores through CUDA IPC mappings, then a release of the flag).
//!
//! The kernels stage what a network peer is sent in this rank's own memory (its
//! *outboxes*) and release a local *ready* flag per piece; what arrives lands where a
//! same-node peer would have stored it. Per call, each rank's network stream runs the
//! steps of [`NetworkPlan::steps`] in order, every rank the same sequence (NCCL matches a
//! rank's sends to a peer with that peer's receives in issue order):
//!
//! 1. **metadata**: waits (`cuStreamWaitValue32`) until `ep_route` has staged the receive
//!    index and counts for every network peer; one NCCL group sends them into each peer's
//!    receive index and receives the peers' into this rank's; then each network source's
//!    metadata flag is released with the call's epoch (`cuStreamWriteValue32`), the flag
//!    the arrange kernel already waits on.
//! 2. **dispatch chunk c**, for every chunk of a source's capacity: waits until
//!    `ep_dispatch` has staged chunk `c` for every network peer, one group moves it, then
//!    each network source's chunk flag `c` is released: the flag GEMM1's tiles on those
//!    rows wait on, so GEMM1 starts on the first chunk, not the last.
//! 3. **return chunk c**: results across nodes return as *rank partials*, one row per
//!    (token, rank visited): `ep_combine`'s first pass sums each received token's rows
//!    here and stores a network origin's partial in this rank's return outbox; once every
//!    lane of it is done, its last lane releases `net_partials_ready`, which each return
//!    step waits on. One group sends the partials of each network origin's tokens of chunk
//!    `c` and receives those of this rank's own; then the return flag of (source, chunk)
//!    is released, which `ep_combine`'s second pass waits on. (Pair rows would send every
//!    slot of every token of the bound: K plus the shared slices times the bytes.)
//!
//! NCCL needs every byte count on the host when a transfer is enqueued, but the device
//! decides the routing, and reading counts back would synchronise the call. So every
//! transfer is a fixed slice of the plan's capacity, cut at the call's *tokens bound*:
//! the most tokens any rank passes in the call, which the ranks agree on beforehand on
//! the host (the runtime's `EpLayer::bound_tokens`; `max_tokens` until they do). A source
//! sends a peer at most one slot per token, so its rows fill only chunks below the bound
//! and each receive-index segment only its first `bound` entries; the steps move exactly
//! those ([`NetworkPlan::steps`]): no routing can overflow them and nothing is read back.
//! A call moves [`NetworkPlan::bytes_per_peer`] of its bound whatever its routing.
//!
//! On emulated nodes ([`NetworkTransport::Loopback`]: virtual ranks of one GPU standing for
//! the nodes' GPUs) the kernels and steps are the same; the runtime runs every rank's
//! steps on one stream, each send a device copy into its receiver's buffer.
//!
//! Hierarchical traffic (one transfer per remote node, fanned out over NVLink there) fits
//! the same shape: a relay rank's steps would receive a node's aggregate and its kernels
//! forward rows to the node's other ranks through the IPC path. It is not planned yet.

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
    /// [`NetworkPlan::peers`] is its slot in the rank's outboxes and inboxes.
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
    /// Bytes this rank sends each network peer in a call of `max_tokens` bound (metadata,
    /// rows and results; receives are as many): the most a call moves.
    pub call_bytes_per_peer: u64,
    /// CTAs NCCL may run (the communicator's `maxCTAs`): the SMs the plan keeps free for
    /// NCCL's kernels beside the compute grids, so a transfer GEMM1 waits for always runs.
    /// On emulated nodes, the SM each rank keeps free for the loopback's copies.
    pub nccl_ctas: u32,
    pub nccl_reason: String,
    /// Bound on the host's wait for a call's transfers (ms): past it the runtime reports
    /// the stalled transfer (which step, which peers) instead of waiting for ever.
    pub wait_limit_ms: u64,
    pub wait_reason: String,
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
    let call_bytes_per_peer = bytes_per_peer(shape, shape.experts / ranks, slots);
    let bandwidth = topology.network.bandwidth_bytes_per_s;
    let (nccl_ctas, nccl_reason) = match transport {
        NetworkTransport::Nccl => (
            ((bandwidth as f64 / NCCL_CTA_BYTES_PER_S).ceil() as u32).clamp(1, NCCL_MAX_CTAS),
            format!(
                "enough for the network's {:.0} GB/s at {:.1} GB/s per CTA (NCCL's all-to-all across the two H200s: 295 GB/s on at most 32 channels)",
                bandwidth as f64 / 1e9,
                NCCL_CTA_BYTES_PER_S / 1e9
            ),
        ),
        NetworkTransport::Loopback => (
            1,
            "emulated nodes: one SM per rank kept free for the loopback's device copies, should the driver run them on SMs".to_string(),
        ),
    };
    let transfer_seconds =
        4.0 * call_bytes_per_peer as f64 * f64::from(peers_per_rank) / bandwidth.max(1) as f64;
    let wait_seconds = 2.0 * flag_seconds + transfer_seconds.max(MIN_TRANSFER_SECONDS);
    Some(NetworkPlan {
        transport,
        nodes: topology.nodes,
        gpus_per_node,
        peers_per_rank,
        bandwidth_bytes_per_s: bandwidth,
        latency_ns: topology.network.latency_ns,
        chunk_tokens: chunk,
        chunks,
        call_bytes_per_peer,
        nccl_ctas,
        nccl_reason,
        wait_limit_ms: (wait_seconds * 1e3).ceil() as u64,
        wait_reason: format!(
            "two flag bounds ({flag_seconds:.1} s each: a peer's staging may wait one for its credits, this rank's kernels one more) plus four times a call's {:.1} MB to its {peers_per_rank} network peers at the network's bandwidth, at least {MIN_TRANSFER_SECONDS:.0} s",
            call_bytes_per_peer as f64 * f64::from(peers_per_rank) / 1e6
        ),
    })
}

/// Bytes a rank sends each network peer in a call of `tokens_bound` (receives are as
/// many): per local expert the three arrays of the receive index up to the bound, the
/// counts, the rows of the bound's tokens and their partials.
fn bytes_per_peer(shape: &LayerShape, experts_per_rank: u32, tokens_bound: u32) -> u64 {
    let tokens = u64::from(tokens_bound.min(shape.max_tokens));
    let local = u64::from(experts_per_rank);
    let row_bytes = u64::from(shape.hidden) * 2;
    let metadata = 3 * 4 * local * tokens + 4 * (local + 1);
    metadata + 2 * tokens * row_bytes
}

/// The element of `NetPartialsReady` the combine writes the epoch into (element 0 counts
/// its lanes).
const PARTIALS_READY_EPOCH: u64 = 1;

impl NetworkPlan {
    /// Bytes a rank sends each network peer in a call whose tokens bound is
    /// `tokens_bound` (see [`NetworkPlan::steps`]), whatever the routing.
    pub fn bytes_per_peer(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        tokens_bound: u32,
    ) -> u64 {
        bytes_per_peer(shape, ep.experts_per_rank, tokens_bound)
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

    /// Elements per network peer of the ready flags: the metadata's, then one per chunk.
    pub fn ready_stride(&self) -> u64 {
        1 + u64::from(self.chunks)
    }

    /// The NCCL groups of one call on `rank` in which no rank passes more than
    /// `tokens_bound` tokens, in the order every rank issues them: the metadata (each
    /// receive-index segment up to the bound), then a dispatch step per chunk the bound
    /// spans (the last one cut at the bound), then as many return steps. Every rank of a
    /// call must pass the same bound: NCCL pairs a rank's sends to a peer with that peer's
    /// receives in issue order and size.
    pub fn steps(
        &self,
        ep: &ExpertParallelPlan,
        shape: &LayerShape,
        rank: u32,
        tokens_bound: u32,
    ) -> Vec<NetworkStep> {
        let peers = self.peers(rank, ep.ranks);
        let ranks = u64::from(ep.ranks);
        let local = u64::from(ep.experts_per_rank);
        let segment = u64::from(ep.rows_per_segment);
        let slots = u64::from(ep.slots_per_source);
        let hidden = u64::from(shape.hidden);
        let chunk = u64::from(self.chunk_tokens);
        let chunks = u64::from(self.chunks);
        // No source sends a peer more slots than it has tokens, nor more than a segment's
        // rows for one local expert.
        let bound = u64::from(tokens_bound).min(slots);
        let call_chunks = u64::from(self.chunks_within(tokens_bound));
        let indexed = segment.min(bound);
        let with_slots = || {
            peers
                .iter()
                .enumerate()
                .map(|(slot, &peer)| (slot as u64, peer))
        };
        let transfer = |peer: u32, buffer: BufferId, first: u64, elems: u64| Transfer {
            peer,
            buffer,
            offset_bytes: first * buffer.elem().size_bytes(),
            bytes: elems * buffer.elem().size_bytes(),
        };
        let flag = |buffer: BufferId, index: u64| FlagRef { buffer, index };
        let mut steps = Vec::with_capacity(1 + 2 * call_chunks as usize);

        // The receive index: per local expert one segment of each array, then the counts.
        let mut sends = Vec::new();
        let mut receives = Vec::new();
        for (slot, peer) in with_slots() {
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
        }
        steps.push(NetworkStep {
            kind: StepKind::Metadata,
            wait_for: with_slots()
                .map(|(slot, _)| flag(BufferId::NetReady, slot * self.ready_stride()))
                .collect(),
            sends,
            receives,
            release: peers
                .iter()
                .map(|&peer| flag(BufferId::MetaFlags, u64::from(peer)))
                .collect(),
        });

        for c in 0..call_chunks {
            let rows = chunk.min(bound - c * chunk);
            steps.push(NetworkStep {
                kind: StepKind::Dispatch { chunk: c as u32 },
                wait_for: with_slots()
                    .map(|(slot, _)| flag(BufferId::NetReady, slot * self.ready_stride() + 1 + c))
                    .collect(),
                sends: with_slots()
                    .map(|(slot, peer)| {
                        transfer(
                            peer,
                            BufferId::NetSendX,
                            (slot * slots + c * chunk) * hidden,
                            rows * hidden,
                        )
                    })
                    .collect(),
                receives: with_slots()
                    .map(|(_, peer)| {
                        transfer(
                            peer,
                            BufferId::RecvX,
                            (u64::from(peer) * slots + c * chunk) * hidden,
                            rows * hidden,
                        )
                    })
                    .collect(),
                release: peers
                    .iter()
                    .map(|&peer| flag(BufferId::ChunkFlags, u64::from(peer) * chunks + c))
                    .collect(),
            });
        }

        // Results, by the origin's tokens: chunk c holds the partials of its tokens
        // [c·chunk, (c+1)·chunk) below the bound (a token that visited no expert here
        // leaves stale bytes, which its origin does not read).
        for c in 0..call_chunks {
            let rows = chunk.min(bound - c * chunk);
            let first = |slot: u64| (slot * slots + c * chunk) * hidden;
            steps.push(NetworkStep {
                kind: StepKind::Return { chunk: c as u32 },
                wait_for: vec![flag(BufferId::NetPartialsReady, PARTIALS_READY_EPOCH)],
                sends: with_slots()
                    .map(|(slot, peer)| {
                        transfer(peer, BufferId::NetReturnX, first(slot), rows * hidden)
                    })
                    .collect(),
                receives: with_slots()
                    .map(|(slot, peer)| {
                        transfer(peer, BufferId::NetReturnedX, first(slot), rows * hidden)
                    })
                    .collect(),
                release: with_slots()
                    .map(|(slot, _)| flag(BufferId::NetReturnFlags, slot * chunks + c))
                    .collect(),
            });
        }
        steps
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
        // A call of max_tokens moves the receive index, 512 rows and 512 tokens' partials;
        // a call of 3 tokens three entries of each index segment, 3 rows and 3 partials.
        let metadata = 3 * 4 * 4 * 512 + 4 * 5;
        assert_eq!(
            network.call_bytes_per_peer,
            metadata + 512 * 128 * 2 + 512 * 128 * 2
        );
        assert_eq!(
            network.bytes_per_peer(ep, &plan.shape, 512),
            network.call_bytes_per_peer
        );
        assert_eq!(
            network.bytes_per_peer(ep, &plan.shape, 3),
            3 * 4 * 4 * 3 + 4 * 5 + 3 * 128 * 2 + 3 * 128 * 2
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
                assert_eq!(
                    network.steps(ep, &emulated.shape, rank, bound),
                    real_network.steps(real_ep, &real.shape, rank, bound)
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
            // Chunks of 16 token slots, 512 of them: the bound's chunks, at most 32.
            assert_eq!(
                network_of(&plan).1.chunks_within(bound),
                bound.min(512).div_ceil(16)
            );
            assert_steps_pair_up(&plan, bound);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The same over random node counts (dividing the 8 experts), GPUs per node,
        /// max_tokens, chunks (dividing max_tokens or not) and bounds.
        #[test]
        fn steps_pair_up_for_any_layer_and_bound(
            nodes in proptest::sample::select(vec![2u32, 4]),
            gpus in 1u32..=2,
            max_tokens in 1u32..=300,
            chunk in 1u32..=64,
            bound in 0u32..=400,
            shared in proptest::bool::ANY,
        ) {
            let extra = if shared { " shared_experts {\n  count = 1\n  ffn = 256\n }\n" } else { "" };
            let text = spec(nodes, gpus, extra)
                .replace("max_tokens = 512", &format!("max_tokens = {max_tokens}"))
                .replace("dispatch_chunk = 16 tokens", &format!("dispatch_chunk = {chunk} tokens"));
            let module = crate::compile_source("l.moe", &text).expect("checks");
            let plan = plan(&module.layers[0], &Target::h200()).expect("plans");
            assert_steps_pair_up(&plan, bound);
        }
    }

    /// For a call of `plan` whose tokens bound is `bound`, on every rank: each step's sends
    /// to a peer match that peer's receives in that step (same order, same bytes), every
    /// range fits its buffer, a peer is sent `bytes_per_peer` of the bound, and the call
    /// waits for every staging flag of the chunks it moves and releases every flag the
    /// kernels of such a call wait on, once.
    fn assert_steps_pair_up(plan: &Plan, bound: u32) {
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
            .map(|r| network.steps(ep, &plan.shape, r, bound))
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
        for (rank, rank_steps) in steps.iter().enumerate() {
            for peer in network.peers(rank as u32, ranks) {
                let sent: u64 = rank_steps
                    .iter()
                    .flat_map(|s| &s.sends)
                    .filter(|t| t.peer == peer)
                    .map(|t| t.bytes)
                    .sum();
                assert_eq!(sent, network.bytes_per_peer(ep, &plan.shape, bound));
            }
            let mut released = HashMap::new();
            let mut waited = HashMap::new();
            for (i, step) in rank_steps.iter().enumerate() {
                for t in step.sends.iter().chain(&step.receives) {
                    assert!(
                        t.bytes > 0 && t.offset_bytes + t.bytes <= size(t.buffer),
                        "{t:?}"
                    );
                    assert_eq!(network.route(rank as u32, t.peer), Route::Network);
                }
                for peer in network.peers(rank as u32, ranks) {
                    let sent: Vec<u64> = step
                        .sends
                        .iter()
                        .filter(|t| t.peer == peer)
                        .map(|t| t.bytes)
                        .collect();
                    let received: Vec<u64> = steps[peer as usize][i]
                        .receives
                        .iter()
                        .filter(|t| t.peer == rank as u32)
                        .map(|t| t.bytes)
                        .collect();
                    assert!(!sent.is_empty());
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
            let chunks = u64::from(network.chunks);
            // Each network source's metadata flag and the flags of the chunks the bound
            // spans (a chunk of rows per source, a token chunk's return flag per network
            // peer): the flags a call's kernels wait on with at most `bound` tokens per
            // rank. Once each.
            assert_eq!(released.len() as u64, peers * (1 + 2 * call_chunks));
            assert!(released.values().all(|&n| n == 1));
            for peer in network.peers(rank as u32, ranks) {
                let slot = u64::from(network.slot(rank as u32, peer).unwrap());
                assert!(released.contains_key(&(BufferId::MetaFlags, u64::from(peer))));
                for c in 0..call_chunks {
                    for flag in [
                        (BufferId::ChunkFlags, u64::from(peer) * chunks + c),
                        (BufferId::NetReturnFlags, slot * chunks + c),
                    ] {
                        assert!(released.contains_key(&flag), "{flag:?} at bound {bound}");
                    }
                }
            }
            // The staging flags of the metadata and of those chunks, each peer's, once;
            // and before each return step, the combine's flag of its partials.
            let partials = (BufferId::NetPartialsReady, PARTIALS_READY_EPOCH);
            assert_eq!(waited.remove(&partials).unwrap_or(0), call_chunks);
            assert_eq!(waited.len() as u64, peers * (1 + call_chunks));
            assert!(waited.values().all(|&n| n == 1));
        }
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
