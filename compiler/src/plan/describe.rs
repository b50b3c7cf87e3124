//! The plan as readable text (`moeforge explain`), stable enough to snapshot.

use std::fmt::Write as _;

use super::ep::{CombineRoute, ExpertParallelPlan, Placement};
use super::memory::{DeviceMemory, MemoryUse, usable_bytes};
use super::network::{NetworkPlan, NetworkTransport};
use super::router::{GateEngine, RouterRegime};
use super::tuning::ChoiceSource;
use super::{
    Access, Grid, Launch, LayerShape, OutputStore, Plan, Regime, RegimeParts, RowLoad, StreamRole,
};

/// One fact per line; `write!` into a `String` cannot fail.
pub fn describe(plan: &Plan) -> String {
    let mut out = String::new();
    let shape = &plan.shape;
    let _ = writeln!(
        out,
        "plan for {} on {} ({}, {} SMs)",
        plan.layer, plan.target.name, plan.target.arch, plan.target.sm_count
    );
    let _ = writeln!(
        out,
        "  ranks                {} in the spec, {} executed (all {} experts on one GPU)",
        shape.spec_ranks, shape.executed_ranks, shape.experts
    );
    if shape.shared_slices > 0 {
        let _ = writeln!(
            out,
            "  shared experts       {} always-hit experts of FFN {} (experts {}..{} of the grouped GEMMs, each token's slots {}..{}, {})",
            shape.shared_slices,
            shape.ffn,
            shape.experts,
            shape.gemm_experts(),
            shape.top_k,
            shape.slots_per_token(),
            if shape.shared_gated {
                "weight sigmoid(x · w_gate) per token: one GPU's GEMM1 computes it before its tiles and GEMM2 gives it to their rows; a rank's gate launch computes it before arrange, which gives it to them"
            } else {
                "weight 1"
            }
        );
    }
    if let Some(router) = &plan.router {
        let _ = writeln!(
            out,
            "  router               {}: a self-routed call runs the regime's router launches (a fused router in place of the route launch), then the table with *routed_ids and *routed_weights as topk_ids and topk_weights; a caller-routed call runs the table as it is (less the route launch where the GEMMs' blocks route it)",
            super::router::rule_summary(&router.rule)
        );
    }
    if plan.call_graph_max_tokens > 0 {
        let _ = writeln!(
            out,
            "  call graphs          a call of 1..={} tokens that repeats (same tokens, routing mode and buffers) replays a CUDA graph of its launches, captured at its second call (MOEFORGE_CALL_GRAPHS=0: never); not inside the caller's own capture",
            plan.call_graph_max_tokens
        );
    }
    let flag_wait = &plan.flag_wait_limit;
    let _ = writeln!(
        out,
        "  flag waits           each at most {} ({} cycles at {:.2} GHz; {}), then the kernel records a time-out naming the wait, which the runtime reports",
        seconds_or_ms(flag_wait.seconds(&plan.target)),
        flag_wait.cycles,
        plan.target.clock_hz / 1e9,
        if flag_wait.hinted {
            "the spec's flag_timeout"
        } else {
            "the default; `flag_timeout` in schedule sets it"
        }
    );
    for (i, regime) in plan.regimes.iter().enumerate() {
        describe_regime(&mut out, "regime", regime.parts());
        describe_block_routing(&mut out, regime, plan.shape.top_k);
        if let Some(max_tokens) = regime.gemm2_early_max_tokens(plan.target.smem_per_sm) {
            let _ = writeln!(
                out,
                "    gemm2  starts early beside GEMM1 for calls of up to {max_tokens} tokens; larger calls start it as GEMM1's blocks finish (its blocks fit an SM beside GEMM1's, and resident there from GEMM1's start they cost the larger calls)"
            );
        }
        if let Some(router_regime) = plan.router.as_ref().and_then(|r| r.regimes.get(i)) {
            describe_router_regime(&mut out, router_regime);
        }
    }
    if let Some(ep) = &plan.expert_parallel {
        describe_expert_parallel(&mut out, ep, shape);
    }
    describe_modules(&mut out, plan);
    let _ = writeln!(out, "  workspace");
    for buffer in &plan.workspace {
        let _ = writeln!(
            out,
            "    {:<15} {:>14} B  {}",
            buffer.id.name(),
            buffer.bytes(),
            buffer.purpose
        );
    }
    describe_memory(&mut out, plan);
    for note in plan.hints_not_honoured.iter().chain(&plan.limitations) {
        let _ = writeln!(out, "  note: {note}");
    }
    out
}

/// A duration in seconds (two decimals) from one second up, else in milliseconds.
fn seconds_or_ms(seconds: f64) -> String {
    if seconds >= 1.0 {
        format!("{seconds:.2} s")
    } else {
        format!("{:.3} ms", seconds * 1e3)
    }
}

/// How the JIT compiles and loads the kernels.
fn describe_modules(out: &mut String, plan: &Plan) {
    let _ = writeln!(
        out,
        "  modules              {} kernels, each compiled whole-program as a module of its own (side by side), those a layer launches loaded when it loads",
        plan.entry_points().len()
    );
}

/// What one GPU holds (all experts), and on the expert-parallel path what each rank holds
/// (its experts, the shared slices, its buffers), against the share of the target's memory
/// a plan may fill (`memory::USABLE_MEMORY_SHARE`).
fn describe_memory(out: &mut String, plan: &Plan) {
    let memory = DeviceMemory::of(plan);
    let target = &plan.target;
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let usable = usable_bytes(target);
    let line = |out: &mut String, what: String, held: &MemoryUse, on_device: u64| {
        let verdict = if target.memory_bytes == 0 {
            String::new()
        } else if on_device > usable {
            format!(
                ", more than the {:.0} GB of {}'s {:.0} GB a plan may fill: it cannot run there with these buffers",
                gb(usable),
                target.name,
                gb(target.memory_bytes)
            )
        } else {
            format!(" of {}'s {:.0} GB", target.name, gb(target.memory_bytes))
        };
        let _ = writeln!(
            out,
            "  device memory        {what}: weights {:.2} GB + workspace {:.2} GB = {:.2} GB{verdict}",
            gb(held.weights),
            gb(held.workspace),
            gb(held.total())
        );
    };
    line(
        out,
        "one GPU".to_string(),
        &memory.one_gpu,
        memory.one_gpu.total(),
    );
    if let Some(rank) = &memory.per_rank {
        let what = if memory.ranks_per_device > 1 {
            format!(
                "per rank ({} on one GPU: {:.2} GB)",
                memory.ranks_per_device,
                gb(memory.per_device())
            )
        } else {
            "per rank".to_string()
        };
        line(out, what, rank, memory.per_device());
    }
}

fn describe_expert_parallel(out: &mut String, ep: &ExpertParallelPlan, shape: &LayerShape) {
    let hidden = shape.hidden;
    let placement = match ep.placement {
        Placement::Virtual => "virtual ranks on one GPU",
        Placement::Devices => "one GPU per rank",
    };
    let _ = writeln!(
        out,
        "  expert parallelism   {} ranks ({placement}), {} expert{} each, flags at .{} scope, epoch-tagged",
        ep.ranks,
        ep.experts_per_rank,
        if ep.experts_per_rank == 1 { "" } else { "s" },
        ep.scope.ptx()
    );
    let _ = writeln!(
        out,
        "    dispatch chunk     {} tokens ({} B): {}; a call with fewer chunks than communication blocks copies them in pieces of down to {} tokens",
        ep.dispatch_chunk,
        u64::from(ep.dispatch_chunk) * u64::from(hidden) * 2,
        ep.chunk_reason,
        ep.dispatch_piece
    );
    let _ = writeln!(
        out,
        "    capacity           {} token slots and {} chunk flags per source; {} rows per (local expert, source) segment; {} intermediate rows (worst case: every token of every source here, each token once per rank, each pair once)",
        ep.slots_per_source, ep.chunks_per_source, ep.rows_per_segment, ep.intermediate_rows
    );
    let _ = writeln!(
        out,
        "    blocks             at most {} communication ({}) and at least {} compute SMs per rank; each rank regime below says its own",
        ep.comm_blocks, ep.comm_reason, ep.compute_sms
    );
    let _ = writeln!(out, "    residency          {}", ep.residency);
    if ep.routes_itself {
        let _ = writeln!(
            out,
            "    router             a self-routed call: each rank routes its own tokens with the layer's router (its launches for the count, on the rank's compute stream ahead of both streams' kernels, a fused one laying out no metadata), then the kernels here read its choices"
        );
    }
    let orders = |orders: &[Vec<u32>]| {
        orders
            .iter()
            .enumerate()
            .map(|(rank, order)| {
                // Up to 8 ranks read best one by one; past that, as runs.
                let listed = if order.len() > 8 {
                    rank_runs(order)
                } else {
                    order
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                format!("{rank}: {listed}")
            })
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let send_rule = match ep.network {
        None => "itself first, then rotated; one distance class on one node",
        Some(_) => {
            "itself first, then its network peers (staged for NCCL: the longest path), then its node's peers, each rotated"
        }
    };
    let _ = writeln!(
        out,
        "    send order         ({}: {send_rule}) {}",
        ep.traffic.name(),
        orders(&ep.send_order)
    );
    let _ = writeln!(
        out,
        "    GEMM row order     (per local expert, sources local first, then by arrival) {}",
        orders(&ep.receive_order)
    );
    if let Some(network) = &ep.network {
        describe_network(out, ep, network, shape);
    }
    let _ = writeln!(
        out,
        "    GEMM tile order    by the source of a tile's last row, in the order above, then expert, column tile, row tile: every tile on local rows runs before any that waits for a peer\n    GEMM waits         a GEMM1 tile acquires the flag of each chunk its rows were sent in, (source, slot / {}), before it loads them; {}\n    results            {}",
        ep.dispatch_chunk,
        match ep.combine_route {
            CombineRoute::PairRows => "GEMM2 releases each origin token's combine counter",
            CombineRoute::RankPartials => {
                "the combine releases each origin token's counter once per rank partial"
            }
        },
        ep.combine_reason
    );
    for regime in &ep.regimes {
        describe_regime(out, "rank regime", regime.parts());
        let _ = writeln!(
            out,
            "    blocks {} communication ({}), {} compute SMs",
            regime.comm_blocks, regime.comm_reason, regime.compute_sms
        );
    }
}

/// Ranks in order, each run of three or more consecutive ranks written `a-b`, ascending
/// or descending (`0 8-63 1-7`, `0 7-1 63-8`: 64 ranks in a few characters).
fn rank_runs(order: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut start = 0;
    while start < order.len() {
        let mut end = start;
        let step = |from: u32, to: u32| i64::from(to) - i64::from(from);
        if let Some(&next) = order.get(start + 1)
            && step(order[start], next).abs() == 1
        {
            let direction = step(order[start], next);
            while end + 1 < order.len() && step(order[end], order[end + 1]) == direction {
                end += 1;
            }
        }
        if end - start >= 2 {
            parts.push(format!("{}-{}", order[start], order[end]));
        } else {
            parts.extend(order[start..=end].iter().map(u32::to_string));
        }
        start = end + 1;
    }
    parts.join(" ")
}

/// `bytes` in decimal units, three significant digits (`14.5 KB`, `2.35 GB`).
pub(crate) fn decimal_bytes(bytes: u64) -> String {
    let mut value = bytes as f64;
    let mut unit = "B";
    for next in ["KB", "MB", "GB", "TB"] {
        if value < 1000.0 {
            break;
        }
        value /= 1000.0;
        unit = next;
    }
    match unit {
        "B" => format!("{bytes} B"),
        _ if value >= 100.0 => format!("{value:.0} {unit}"),
        _ if value >= 10.0 => format!("{value:.1} {unit}"),
        _ => format!("{value:.2} {unit}"),
    }
}

fn describe_network(
    out: &mut String,
    ep: &ExpertParallelPlan,
    network: &NetworkPlan,
    shape: &LayerShape,
) {
    let chunk_bytes = u64::from(network.chunk_tokens) * u64::from(shape.hidden) * 2;
    let (nodes, carrier, link_peers) = match network.transport {
        NetworkTransport::Nccl => ("", "NCCL send/recv (", "CUDA IPC stores"),
        NetworkTransport::Loopback => (
            " emulated on one GPU",
            "the loopback's device copies, in the steps NCCL would run (planned for ",
            "stores",
        ),
    };
    let _ = writeln!(
        out,
        "    network            {} nodes of {} GPUs{nodes}; each rank reaches its {} peers on other nodes through {carrier}{:.0} GB/s, {:.0} us), its node's peers through {link_peers} as on one node",
        network.nodes,
        network.gpus_per_node,
        network.peers_per_rank,
        network.bandwidth_bytes_per_s as f64 / 1e9,
        network.latency_ns as f64 / 1e3
    );
    let _ = writeln!(
        out,
        "    network routes     hierarchical: a token crosses to each other node it visits once, to its rail peer there (the rank with the sender's local index, one of {} per rank), which forwards the row to the ranks of its node the token visits ({link_peers}, in its dispatch kernel, then releases their chunk flags) and sums their partials of it (in its combine, once each rank of its node stored them there): one node partial per (token, node) returns. Only the receive index goes to every network peer directly",
        network.other_nodes()
    );
    // The bounds a reader compares: one token, each regime's largest call, max_tokens.
    let mut bounds: Vec<u32> = std::iter::once(1)
        .chain(ep.regimes.iter().map(|r| r.max_tokens))
        .collect();
    bounds.dedup();
    let moved = bounds
        .iter()
        .map(|&b| {
            format!(
                "{} at {b}",
                decimal_bytes(network.bytes_per_call(ep, shape, b))
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        out,
        "    network steps      per call, in this order on every rank: 1 metadata group (the receive index to every network peer; the visit masks and the rows of each token chunk to the rail peers), sized by the call's tokens bound (the most tokens any rank passes in the call, agreed on the host beforehand: EpLayer::bound_tokens; max_tokens until the ranks agree on one); then a dispatch group per chunk of {} tokens (at most {chunk_bytes} B) per rail peer up to the bound (at most {}), then as many return groups (the node partials of a chunk's {} origin tokens, once the relay's combine summed them), each sized by the routing above the whole-chunks bound (below): the chunk's rows that visit the node, packed, which the host reads back once the metadata step is done (one wait per call, while the kernels run). Bytes a rank sends per call at most (every token visiting every node) by bound: {moved}",
        network.chunk_tokens, network.chunks, network.chunk_tokens,
    );
    let whole = match network.whole_chunks_up_to {
        0 => "none: every call's chunk groups move the routed rows".to_string(),
        tokens if tokens >= shape.max_tokens => {
            "every call: its chunk groups move whole chunks (each chunk's rows up to the bound, whichever tokens visit), sized on the host, with no read-back and no host wait".to_string()
        }
        tokens => format!(
            "calls with a tokens bound of at most {tokens}: their chunk groups move whole chunks (each chunk's rows up to the bound, whichever tokens visit), sized on the host, with no read-back and no host wait; larger ones the routed rows"
        ),
    };
    let _ = writeln!(
        out,
        "    whole chunks       {whole} ({})",
        network.whole_chunks_reason
    );
    let _ = writeln!(
        out,
        "    network stream     before a group, cuStreamWaitValue32 on the flags the kernels released for it (ep_route's staging for each peer, ep_dispatch's for each other node; before results, net_partials_ready, which the combine's last lane releases once it summed every rail origin's node partials into this rank's return outbox); after it, cuStreamWriteValue32 of the call's epoch into the flag the kernels wait on (a source's metadata flag, arrival flag (rail source, c), whose rows the relay's ep_dispatch then copies to its node's ranks before it releases their chunk flags, return flag (node, c)); after the metadata group of a call moving the routed rows, a copy of this rank's rows per chunk (net_send_rows, recv_rows) to pinned host memory, which the host waits for before it enqueues the chunk groups"
    );
    let _ = match network.transport {
        NetworkTransport::Nccl => writeln!(
            out,
            "    NCCL               {} CTAs at most (the communicator's maxCTAs), SMs kept free of compute: {}",
            network.nccl_ctas, network.nccl_reason
        ),
        NetworkTransport::Loopback => writeln!(
            out,
            "    loopback           one stream runs every rank's steps in turn, each send a device copy into its receiver's buffer; {}",
            network.nccl_reason
        ),
    };
    let _ = writeln!(
        out,
        "    host wait bound    {} ms for a call's transfers, then a stalled transfer is an error naming its step and peers: {}",
        network.wait_limit_ms, network.wait_reason
    );
}

fn describe_regime(out: &mut String, label: &str, regime: RegimeParts<'_>) {
    let _ = writeln!(
        out,
        "  {label} {:<13} {}..={} tokens",
        regime.name, regime.min_tokens, regime.max_tokens
    );
    if let Some(entry) = regime.tuned {
        let tokens: Vec<String> = entry.timed_tokens.iter().map(u32::to_string).collect();
        let _ = writeln!(
            out,
            "    tuned  the tuning table's GEMMs (those the spec hints nothing for): {:.1} us against {:.1} us for the cost model's choice, summed over T = {} ({}), measured on {} by {}",
            entry.measured_us,
            entry.model_choice_us,
            tokens.join(", "),
            if entry.self_routed {
                "self-routed calls"
            } else {
                "calls on uniform routing"
            },
            entry.measured_on,
            entry.measured_by
        );
    }
    for (name, (gemm, _)) in ["gemm1", "gemm2"].into_iter().zip(regime.gemms) {
        let e = &gemm.estimate;
        let _ = writeln!(
            out,
            "    {name}  {} tile {}x{}x{}{}, {} stages, {}x{} warps{}{}, {} B smem, {} blocks ({}/SM{}); model at T={}: {:.1} us (compute {:.1}, memory {:.1}, L2 {:.1})",
            gemm.engine.name(),
            gemm.tile.m,
            gemm.tile.n,
            gemm.tile.k,
            match gemm.source {
                ChoiceSource::CostModel => "",
                ChoiceSource::Hint => " (hint)",
                ChoiceSource::Tuned => " (tuned)",
                ChoiceSource::FusedDecode => " (mma.sync for the fused decode)",
            },
            gemm.stages,
            gemm.warps_m,
            gemm.warps_n,
            match (gemm.a_load, name) {
                (RowLoad::Tiles, "gemm1") => ", A rows as TMA tiles (x sorted by expert first)",
                (RowLoad::Tiles, _) => ", A rows as TMA tiles",
                (RowLoad::Gathered, _) => "",
            },
            match gemm.store {
                OutputStore::QuadVectors => ", 16-byte stores",
                OutputStore::Pairs => "",
            },
            gemm.smem_bytes,
            gemm.grid_blocks,
            gemm.blocks_per_sm,
            if gemm.cluster > 1 {
                format!(", clusters of {} sharing weight stages", gemm.cluster)
            } else if let Some(tail) = gemm.stream_k {
                format!(
                    ", stream-K where a last wave has 1..={} tiles and no routed expert more rows than a tile",
                    tail.max_last_wave
                )
            } else {
                String::new()
            },
            e.tokens,
            e.seconds * 1e6,
            e.compute_seconds * 1e6,
            e.memory_seconds * 1e6,
            e.l2_seconds * 1e6,
        );
    }
    for launch in regime.launches {
        describe_launch(out, launch);
    }
    if let (Some(fused), true) = (regime.fused_decode, regime.expert_parallel) {
        let _ = writeln!(
            out,
            "    fused  calls of up to {} tokens on every rank run one persistent kernel per rank instead: each block hands one peer this rank's ids and weights, then token rows to peers, GEMM1 tiles and GEMM2 tiles are claimed in order from a ticket; before its first tile a block lays out every source's rows in its shared memory; GEMM2 stores each row at its origin, and each rank sums its own tokens once their counters are complete; {} block{} per SM",
            fused.max_tokens,
            fused.blocks_per_sm,
            if fused.blocks_per_sm == 1 { "" } else { "s" }
        );
        describe_launch(out, &fused.launch);
    } else if let Some(fused) = regime.fused_decode {
        let _ = writeln!(
            out,
            "    fused  calls of up to {} tokens run one persistent kernel instead: each block routes the call in its shared memory, GEMM1 tiles then GEMM2 tiles claimed in order from a ticket (each GEMM2 tile waits for its own expert's GEMM1 tiles only), the last GEMM2 tile of a column tile sums it into y; {} block{} per SM",
            fused.max_tokens,
            fused.blocks_per_sm,
            if fused.blocks_per_sm == 1 { "" } else { "s" }
        );
        describe_launch(out, &fused.launch);
    }
}

fn describe_block_routing(out: &mut String, regime: &Regime, top_k: u32) {
    if let Some(routing) = regime.block_routing(top_k) {
        let _ = writeln!(
            out,
            "    route  calls of up to {} tokens ({} (token, k) pairs) run without the route launch: each block of both GEMMs routes the call in its shared memory, rows in pair order (GEMM1's block 0 clears the error word and reports ids out of range)",
            routing.max_tokens(top_k),
            routing.max_pairs
        );
    }
}

fn describe_router_regime(out: &mut String, regime: &RouterRegime) {
    let several = if regime.gates.len() > 1 {
        ", the kernel of the call's gate (by its token count)"
    } else {
        ""
    };
    let gemm1 = if regime.gemm1_starts_early {
        ""
    } else {
        "; GEMM1 behind it starts as its blocks finish, not early beside them (measured faster so on this GPU)"
    };
    let fused = format!(
        "fused, in place of route{several}: gate, then select by each token tile's last block, then routing metadata by the last token tile's{gemm1}"
    );
    let _ = writeln!(
        out,
        "    router {}",
        if regime.fused {
            fused.as_str()
        } else if regime.select_launch().is_none() {
            "split, before the table: the gate for the call's token count, whose clusters select their tokens"
        } else if regime.gates.iter().any(|gate| gate.engine.selects()) {
            "split, before the table: the gate for the call's token count, then (unless its clusters select their tokens) select over the whole GPU"
        } else {
            "split, before the table: the gate for the call's token count, then select over the whole GPU"
        },
    );
    for gate in &regime.gates {
        let floor = &gate.floor;
        let warps = match gate.engine {
            GateEngine::MmaSync => format!(
                "mma.sync tile {} tokens x {} experts x 64, {} stages, {}x{} warps x {} groups splitting the reduction",
                gate.tile_tokens,
                gate.tile_experts,
                gate.stages,
                gate.warps_m,
                gate.warps_n,
                gate.warps_k
            ),
            GateEngine::WarpSpecialized => format!(
                "wgmma tile {} tokens x {} experts x 64, {} stages, a producer warpgroup (x rows by cp.async, W_gate by TMA) and a consumer warpgroup per 64 tokens",
                gate.tile_tokens, gate.tile_experts, gate.stages
            ),
            GateEngine::Cluster { blocks } => format!(
                "mma.sync in clusters of {blocks} blocks, a cluster per tile of {} tokens x {} experts, each block 1/{blocks} of the reduction in k-tiles of 64 ({} stages, {}x{} warps x {} groups splitting them); the partial logits summed in distributed shared memory in block order, then each block selects up to {} of the tile's tokens",
                gate.tile_tokens,
                gate.tile_experts,
                gate.stages,
                gate.warps_m,
                gate.warps_n,
                gate.warps_k,
                gate.tile_tokens.div_ceil(blocks)
            ),
        };
        let _ = writeln!(
            out,
            "    gate   {}..={} tokens: {warps}{}, {} B smem, {} expert tiles; floor at T={}: {:.1} us ({:.2} GFLOP, {:.1} MB)",
            gate.min_tokens,
            gate.max_tokens,
            if gate.splits(1) > 1 && !gate.engine.selects() {
                format!(
                    "; a tile split over {} blocks along the reduction at 1 token (as many as keep the grid within {} blocks; fewer for more token tiles)",
                    gate.splits(1),
                    gate.k_split.most_blocks
                )
            } else {
                String::new()
            },
            gate.smem_bytes,
            gate.expert_tiles,
            floor.tokens,
            floor.seconds * 1e6,
            floor.flops / 1e9,
            floor.bytes / 1e6,
        );
    }
    for launch in &regime.launches {
        describe_launch(out, launch);
    }
}

fn describe_launch(out: &mut String, launch: &Launch) {
    let grid = match launch.grid {
        Grid::Fixed(n) => format!("{n} blocks"),
        Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile: 1,
        } => "1 block per token".to_string(),
        Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile,
        } => format!("{blocks_per_tile} blocks per token"),
        Grid::TokenTiles {
            tokens_per_tile,
            blocks_per_tile: 1,
        } => format!("1 block per {tokens_per_tile} tokens"),
        Grid::TokenTiles {
            tokens_per_tile,
            blocks_per_tile,
        } => format!("{blocks_per_tile} blocks per {tokens_per_tile} tokens"),
        Grid::SplitTokenTiles {
            tokens_per_tile,
            blocks_per_tile,
            k_split,
        } => format!(
            "{blocks_per_tile} block{} per {tokens_per_tile} tokens, each splitting its reduction over up to {} blocks",
            if blocks_per_tile == 1 { "" } else { "s" },
            k_split.splits(blocks_per_tile)
        ),
    };
    // Written parameters carry a `*`, as in `&mut`: what the kernel produces.
    let params: Vec<String> = launch
        .params
        .iter()
        .map(|p| match p.access {
            Access::Read | Access::ReadShared => p.arg.name().to_string(),
            Access::Write => format!("*{}", p.arg.name()),
        })
        .collect();
    let _ = writeln!(
        out,
        "    launch {}{} <<<{grid}, {} threads, {} B + {} B static>>>({}){}",
        match launch.stream {
            StreamRole::Comm => "[comm] ",
            StreamRole::Compute => "",
        },
        launch.kernel,
        launch.block_threads,
        launch.smem_bytes,
        launch.static_smem_bytes,
        params.join(", "),
        if launch.early_start {
            ", starts early (waits for the kernel ahead)"
        } else {
            ""
        }
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn rank_runs_write_three_or_more_consecutive_ranks_as_a_range() {
        let order: Vec<u32> = std::iter::once(9)
            .chain(16..64)
            .chain(0..8)
            .chain(10..16)
            .chain([8])
            .collect();
        assert_eq!(super::rank_runs(&order), "9 16-63 0-7 10-15 8");
        assert_eq!(super::rank_runs(&[1, 2, 0]), "1 2 0");
        assert_eq!(super::rank_runs(&[3, 0, 1, 2]), "3 0-2");
        let receive: Vec<u32> = [0]
            .into_iter()
            .chain((1..8).rev())
            .chain((8..64).rev())
            .collect();
        assert_eq!(super::rank_runs(&receive), "0 7-1 63-8");
        assert_eq!(super::rank_runs(&[5, 4, 6, 7, 8]), "5 4 6-8");
        assert_eq!(super::rank_runs(&[]), "");
    }

    #[test]
    fn decimal_bytes_keeps_three_significant_digits() {
        let cases = [
            (0, "0 B"),
            (999, "999 B"),
            (1_000, "1.00 KB"),
            (14_532, "14.5 KB"),
            (917_504, "918 KB"),
            (2_349_600_000, "2.35 GB"),
        ];
        for (bytes, text) in cases {
            assert_eq!(super::decimal_bytes(bytes), text);
        }
    }
}
