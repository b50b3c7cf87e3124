//! Checks that a plan read from outside (an AOT `plan.json`, possibly stale or edited) is one
//! the kernels and the runtime can execute safely: the runtime launches kernels through
//! `unsafe` calls whose soundness rests on these facts.
//!
//! Architecture invariant: every plan [`super::plan`] makes passes [`Plan::validate`]; a plan
//! that passes it has regimes covering `0..=max_tokens`, launches whose parameters name
//! buffers of the workspace with the sizes the shape implies, shared memory within the
//! target, and GEMM layouts that add up.

use thiserror::Error;

use super::ep::{CombineRoute, ExpertParallelPlan, ExpertParallelRegime, Placement};
use super::launch::{StreamRole, shared_gate_launch, shared_gate_params};
use super::network::{NetworkPlan, NetworkTransport};
use super::router::{self, GateEngine, RouterPlan};
use super::{
    Access, BufferId, CLUSTER_PAIR, COMBINE_THREADS, GemmKind, GemmPlan, GemmProblem, Grid,
    INVERT_ROWS_THREADS, LaunchArg, MAX_EXPERTS, MAX_PAIRS, MAX_SHARED_SLICES, MAX_WGMMA_WIDTH,
    MmaEngine, OutputStore, Plan, ROUTE_THREADS, ROUTER_BUFFERS, Regime, RegimeParts, RouterSpace,
    RowLoad, SORT_ROWS_THREADS, SmemLayout, StreamKSpace, TILE_K, c_identifier,
    combine_blocks_per_token, fused_decode, sorts_x_rows, unit_tickets, workspace,
};
use crate::check::layer::MAX_SIZE;

/// Why a plan cannot be executed as it stands.
#[derive(Debug, Error, PartialEq)]
#[error(
    "the plan of layer `{layer}` is inconsistent: {what}; regenerate it with `moeforge compile`"
)]
pub struct PlanInvalid {
    pub layer: String,
    pub what: String,
}

impl Plan {
    /// Checks every fact the runtime relies on; see the module documentation.
    pub fn validate(&self) -> Result<(), PlanInvalid> {
        self.check().map_err(|what| PlanInvalid {
            layer: self.layer.clone(),
            what,
        })
    }

    fn check(&self) -> Result<(), String> {
        let shape = &self.shape;
        if self.symbol != c_identifier(&self.symbol) {
            return Err(format!("symbol `{}` is not a C identifier", self.symbol));
        }
        if shape.hidden == 0
            || shape.ffn == 0
            || shape.hidden > MAX_SIZE
            || shape.ffn > MAX_SIZE
            || !shape.hidden.is_multiple_of(TILE_K)
            || !shape.ffn.is_multiple_of(TILE_K)
        {
            return Err(format!(
                "hidden {} and ffn {} must be multiples of {TILE_K} in 1..={MAX_SIZE}",
                shape.hidden, shape.ffn
            ));
        }
        if shape.experts == 0 || shape.experts > MAX_EXPERTS {
            return Err(format!(
                "{} experts is outside 1..={MAX_EXPERTS}",
                shape.experts
            ));
        }
        if shape.top_k == 0 || shape.top_k > shape.experts {
            return Err(format!("top_k {} is outside 1..=experts", shape.top_k));
        }
        if shape.shared_slices > MAX_SHARED_SLICES {
            return Err(format!(
                "{} shared-expert slices is above {MAX_SHARED_SLICES}",
                shape.shared_slices
            ));
        }
        if shape.max_pairs() > MAX_PAIRS {
            return Err(
                "max_tokens · (top_k + shared slices) does not fit the kernels' 32-bit indices"
                    .into(),
            );
        }
        if self.call_graph_max_tokens > shape.max_tokens {
            return Err(format!(
                "calls of up to {} tokens replay as graphs, beyond max_tokens {}",
                self.call_graph_max_tokens, shape.max_tokens
            ));
        }
        let router_space = self
            .router
            .as_ref()
            .map(|router| RouterSpace::of(router, shape));
        self.check_shared_gate()?;
        let route_blocks = self
            .regimes
            .iter()
            .map(|regime| self.route_blocks_of(regime))
            .collect::<Result<Vec<u32>, String>>()?;
        if let Some(router) = &self.router {
            let fused_on_blocks = router
                .regimes
                .iter()
                .zip(&route_blocks)
                .any(|(r, &blocks)| r.fused && blocks > 1);
            if fused_on_blocks {
                return Err(
                    "a fused router replaces the one-block route launch, but its regime routes over several blocks"
                        .into(),
                );
            }
        }
        let most_route_blocks = route_blocks.iter().copied().max().unwrap_or(1);
        let stream_k = StreamKSpace::of(self.regimes.iter().flat_map(|r| [&r.gemm1, &r.gemm2]));
        let sorted_x = sorts_x_rows(&self.regimes);
        let fused_counters = fused_decode::counters_needed(shape, &self.regimes);
        if self.workspace
            != workspace(
                shape,
                most_route_blocks,
                sorted_x,
                router_space,
                stream_k,
                fused_counters,
                unit_tickets(self.regimes.iter().flat_map(|r| [&r.gemm1, &r.gemm2])),
            )
        {
            return Err("the workspace buffers do not match the layer's shape".into());
        }
        for regime in &self.regimes {
            if let Some(fused) = &regime.fused_decode {
                let kernel = &fused.launch.kernel;
                let expected = fused_decode::plan_fused_decode(
                    &self.target,
                    shape,
                    regime,
                    kernel,
                    fused.launch.early_start,
                    fused.max_tokens,
                );
                if *kernel != c_identifier(kernel) || expected.as_ref() != Ok(fused) {
                    return Err(format!(
                        "regime `{}`: its fused decode is not one its GEMMs allow on {} (grid, shared memory, token bound or parameters edited)",
                        regime.name, self.target.name
                    ));
                }
            }
        }
        if let Some(router) = &self.router {
            self.check_router(router)
                .map_err(|e| format!("router: {e}"))?;
        }

        self.check_regimes(
            self.regimes.iter().map(Regime::parts),
            shape.gemm_experts(),
            1,
        )?;
        // The combine covers a token's row only with as many blocks (of COMBINE_THREADS
        // threads, a 16-byte vector each) as its columns need.
        let combine_grid = Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile: combine_blocks_per_token(shape.hidden),
        };
        let wrong_combine = self.regimes.iter().flat_map(|r| &r.launches).find(|l| {
            l.kernel == self.combine_kernel
                && (l.grid != combine_grid || l.block_threads != COMBINE_THREADS)
        });
        if let Some(launch) = wrong_combine {
            return Err(format!(
                "`{}` is launched on {:?} of {} threads; a hidden size of {} needs {combine_grid:?} of {COMBINE_THREADS}",
                launch.kernel, launch.grid, launch.block_threads, shape.hidden
            ));
        }
        for regime in &self.regimes {
            self.check_sort_rows(regime)?;
        }
        let ep_sorts = self
            .expert_parallel
            .iter()
            .flat_map(|ep| &ep.regimes)
            .flat_map(|r| &r.launches)
            .find(|l| l.kernel == self.sort_rows_kernel || l.kernel == self.invert_rows_kernel);
        if let Some(launch) = ep_sorts {
            return Err(format!(
                "an expert-parallel regime launches `{}`, a single-GPU kernel",
                launch.kernel
            ));
        }
        if let Some(ep) = &self.expert_parallel {
            self.check_expert_parallel(ep)?;
            let regimes = ep.regimes.iter().map(ExpertParallelRegime::parts);
            self.check_regimes(
                regimes,
                (ep.experts_per_rank + shape.shared_slices) * ep.ranks,
                ep.ranks,
            )
            .map_err(|e| format!("expert-parallel: {e}"))?;
        }
        Ok(())
    }

    /// A gated shared expert's weights reach the shared slices' rows on every path: each
    /// one-GPU regime's GEMM1 computes them (it takes x, the token count, the gate's
    /// weights and writes the buffer: [`shared_gate_params`]) and its GEMM2 reads them;
    /// each rank's table launches the gate (the plan's kernel, which exactly the layers with
    /// ranks have) on its compute stream right before arrange, which reads them; a fused
    /// decode, one GPU's or a rank's, takes the gate (its shared-slice tiles compute their
    /// weights). A layer without the gate computes none and nothing reads it (checked per
    /// launch).
    fn check_shared_gate(&self) -> Result<(), String> {
        let gated = self.shape.shared_gated;
        if gated && self.shape.shared_slices == 0 {
            return Err("the layer gates a shared expert it does not have".into());
        }
        let wants_kernel = gated && self.expert_parallel.is_some();
        if self.shared_gate_kernel.is_some() != wants_kernel {
            return Err(format!(
                "the plan {} a rank's shared expert gate kernel, but the layer {}",
                if wants_kernel { "has no" } else { "has" },
                match (gated, self.expert_parallel.is_some()) {
                    (false, _) => "does not gate its shared expert",
                    (true, false) => "has no expert-parallel ranks",
                    (true, true) => "gates its shared expert on its ranks",
                }
            ));
        }
        if !gated {
            return Ok(());
        }
        let reads = |launch: &super::Launch| {
            launch
                .params
                .iter()
                .any(|p| p.arg == LaunchArg::Workspace(BufferId::SharedGate))
        };
        for regime in &self.regimes {
            let find = |kernel: &str| regime.launches.iter().find(|l| l.kernel == kernel);
            // Every parameter the gate needs, x and the token count among them, with its
            // access (no launch takes one twice: checked per launch).
            let computes = find(&regime.gemm1_kernel).is_some_and(|gemm1| {
                shared_gate_params(&[])
                    .iter()
                    .all(|param| gemm1.params.contains(param))
            });
            if !computes {
                return Err(format!(
                    "regime `{}` must compute the shared expert gate's weights in `{}` (taking {})",
                    regime.name,
                    regime.gemm1_kernel,
                    shared_gate_params(&[])
                        .iter()
                        .map(|p| p.arg.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if !find(&regime.gemm2_kernel).is_some_and(reads) {
                return Err(format!(
                    "`{}` is not given the shared expert gate's weights (`shared_gate`)",
                    regime.gemm2_kernel
                ));
            }
        }
        let fused = self
            .regimes
            .iter()
            .filter_map(|regime| regime.fused_decode.as_ref())
            .chain(
                self.expert_parallel
                    .iter()
                    .flat_map(|ep| &ep.regimes)
                    .filter_map(|regime| regime.fused_decode.as_ref()),
            );
        for fused in fused {
            let gate = super::KernelParam {
                arg: LaunchArg::SharedExpertGate,
                access: super::Access::Read,
            };
            if !fused.launch.params.contains(&gate) {
                return Err(format!(
                    "the fused decode `{}` is not given the shared expert gate",
                    fused.launch.kernel
                ));
            }
        }
        let Some(kernel) = &self.shared_gate_kernel else {
            return Ok(());
        };
        for regime in self.expert_parallel.iter().flat_map(|ep| &ep.regimes) {
            let arrange = self
                .expert_parallel
                .as_ref()
                .map_or("", |ep| ep.arrange_kernel.as_str());
            let at = regime.launches.iter().position(|l| l.kernel == arrange);
            let before = at
                .and_then(|at| at.checked_sub(1))
                .map(|i| &regime.launches[i]);
            // Any grid covers the call; the residency check below bounds a rank's.
            let rank_gate = |launch: &super::Launch| {
                launch.grid.blocks(1) >= 1 && *launch == shared_gate_launch(kernel, launch.grid)
            };
            if !before.is_some_and(rank_gate) || !at.is_some_and(|at| reads(&regime.launches[at])) {
                return Err(format!(
                    "expert-parallel regime `{}` must launch the shared expert gate right before `{arrange}` and give arrange its weights",
                    regime.name
                ));
            }
        }
        Ok(())
    }

    /// The blocks `regime` routes over. Its launches must begin with the routing, of
    /// [`ROUTE_THREADS`] threads per block (the kernels' strides), and no other launch may
    /// be a routing one: the one-block route kernel, or the count then the place launch on
    /// one grid of at least two blocks.
    fn route_blocks_of(&self, regime: &Regime) -> Result<u32, String> {
        let routing = |launch: &super::Launch, kernel: &str| {
            (launch.kernel == kernel && launch.block_threads == ROUTE_THREADS)
                .then_some(launch.grid)
        };
        let first_two: Vec<&super::Launch> = regime.launches.iter().take(2).collect();
        let blocks = match first_two.as_slice() {
            [route, ..] if routing(route, &self.route_kernel) == Some(Grid::Fixed(1)) => Some(1),
            [count, place] => match (
                routing(count, &self.route_count_kernel),
                routing(place, &self.route_place_kernel),
            ) {
                (Some(Grid::Fixed(c)), Some(Grid::Fixed(p))) if c == p && c >= 2 => Some(c),
                _ => None,
            },
            _ => None,
        };
        let routing_launches = regime
            .launches
            .iter()
            .filter(|l| self.is_route_kernel(&l.kernel))
            .count();
        match blocks {
            Some(blocks) if routing_launches == if blocks == 1 { 1 } else { 2 } => Ok(blocks),
            _ => Err(format!(
                "regime `{}` must begin with one launch of `{}` on one block, or `{}` then `{}` on one grid of several blocks, of {ROUTE_THREADS} threads per block, and route nowhere else",
                regime.name, self.route_kernel, self.route_count_kernel, self.route_place_kernel
            )),
        }
    }

    /// Each rank regime's fused decode is the one its GEMMs allow (planned again from the
    /// plan's own sizes): within the buffers, resident at once on every rank, one node.
    fn check_rank_fused_decodes(&self, ep: &ExpertParallelPlan) -> Result<(), String> {
        let shape = &self.shape;
        let rank = fused_decode::RankFusedShape::of(&self.target, shape, ep);
        for regime in &ep.regimes {
            let Some(fused) = &regime.fused_decode else {
                continue;
            };
            let expected = fused_decode::plan_rank_fused_decode(
                &self.target,
                shape,
                &rank,
                (&regime.name, regime.min_tokens, regime.max_tokens),
                (&regime.gemm1, &regime.gemm2),
                &fused.launch.kernel,
                fused.max_tokens,
            );
            let kernel = &fused.launch.kernel;
            if ep.network.is_some()
                || *kernel != c_identifier(kernel)
                || expected.as_ref() != Ok(fused)
            {
                return Err(format!(
                    "rank regime `{}`: its fused decode is not one its GEMMs allow on {} (grid, shared memory, token bound or parameters edited, or ranks on several nodes)",
                    regime.name, self.target.name
                ));
            }
            let blocks =
                u64::from(fused.launch.grid.blocks(fused.max_tokens)) * u64::from(ep.ranks);
            let resident = u64::from(self.target.sm_count) * u64::from(fused.blocks_per_sm);
            if ep.placement == Placement::Virtual && blocks > resident {
                return Err(format!(
                    "rank regime `{}`: {} virtual ranks' fused decodes need {blocks} blocks at once, more than {resident}",
                    regime.name, ep.ranks
                ));
            }
        }
        Ok(())
    }

    fn check_expert_parallel(&self, ep: &ExpertParallelPlan) -> Result<(), String> {
        let shape = &self.shape;
        if ep
            .regimes
            .iter()
            .any(|r| r.gemm1.stream_k.is_some() || r.gemm2.stream_k.is_some())
        {
            return Err(
                "an expert-parallel GEMM splits tiles stream-K, which only the single-GPU GEMMs do"
                    .into(),
            );
        }
        let ranks = ep.ranks;
        if ranks < 2
            || !shape.experts.is_multiple_of(ranks)
            || u64::from(ep.experts_per_rank) * u64::from(ranks) != u64::from(shape.experts)
        {
            return Err(format!(
                "{ranks} ranks do not split {} experts",
                shape.experts
            ));
        }
        if ep.dispatch_chunk == 0
            || ep.slots_per_source < shape.max_tokens
            || ep.rows_per_segment < shape.max_tokens
            || ep.chunks_per_source != ep.slots_per_source.div_ceil(ep.dispatch_chunk)
        {
            return Err("the receive capacities do not hold max_tokens per source".into());
        }
        if ep.dispatch_piece == 0 || !ep.dispatch_chunk.is_multiple_of(ep.dispatch_piece) {
            return Err(format!(
                "a dispatch piece of {} tokens does not divide the chunk of {}",
                ep.dispatch_piece, ep.dispatch_chunk
            ));
        }
        let worst_rows = u64::from(ranks)
            * u64::from(shape.max_tokens)
            * u64::from(shape.top_k.min(ep.experts_per_rank))
            + u64::from(shape.max_tokens) * u64::from(shape.shared_slices);
        if ep.intermediate_rows < worst_rows {
            return Err("the intermediate cannot hold the worst-case rows of one rank".into());
        }
        let permutation = |order: &Vec<u32>, first: u32| {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            order.first() == Some(&first) && sorted == (0..ranks).collect::<Vec<_>>()
        };
        let orders_ok = ep.send_order.len() == ranks as usize
            && ep.receive_order.len() == ranks as usize
            && (0..ranks).all(|r| {
                permutation(&ep.send_order[r as usize], r)
                    && permutation(&ep.receive_order[r as usize], r)
            });
        if !orders_ok {
            return Err(
                "the send and receive orders are not permutations starting at each rank itself"
                    .into(),
            );
        }
        let tile_pairs = u64::from(ep.metadata_tile_tokens) * u64::from(self.shape.top_k);
        if ep.metadata_tile_tokens == 0 || tile_pairs >= u64::from(u16::MAX) {
            return Err(format!(
                "a metadata tile of {} tokens holds {tile_pairs} pairs; its shared arrays count them in 16 bits",
                ep.metadata_tile_tokens
            ));
        }
        for regime in &ep.regimes {
            let metadata_blocks = regime
                .launches
                .iter()
                .find(|l| l.kernel == ep.route_kernel)
                .map(|l| l.grid.blocks(self.shape.max_tokens));
            if metadata_blocks.is_none_or(|blocks| blocks > regime.comm_blocks) {
                return Err(format!(
                    "regime `{}`: the metadata kernel `{}` needs a launch of at most its {} communication blocks",
                    regime.name, ep.route_kernel, regime.comm_blocks
                ));
            }
        }
        self.check_rank_fused_decodes(ep)?;
        let sms = self.target.sm_count;
        if ep.comm_blocks == 0 || ep.compute_sms == 0 {
            return Err("an expert-parallel rank has no communication or no compute blocks".into());
        }
        match ep.placement {
            Placement::Virtual => {
                // Per rank one kernel per stream is live at a time; all live blocks of all
                // ranks must fit one per SM, so a waiting block always finds an empty SM.
                for regime in &ep.regimes {
                    let live = |role| {
                        regime
                            .launches
                            .iter()
                            .filter(|l| l.stream == role)
                            .map(|l| l.grid.blocks(self.shape.max_tokens))
                            .max()
                            .unwrap_or(0)
                    };
                    // Emulated nodes keep SMs free for the loopback's copies too.
                    let per_rank = live(StreamRole::Comm)
                        .saturating_add(live(StreamRole::Compute))
                        .saturating_add(ep.network.as_ref().map_or(0, |n| n.nccl_ctas));
                    if u64::from(ranks) * u64::from(per_rank) > u64::from(sms) {
                        return Err(format!(
                            "{ranks} virtual ranks × {per_rank} live blocks (and SMs kept free) exceed the {sms} SMs of {}: spin-waits could wait on blocks that never run",
                            self.target.name
                        ));
                    }
                }
            }
            Placement::Devices => {
                let nccl_sms = ep.network.as_ref().map_or(0, |n| n.nccl_ctas);
                for regime in &ep.regimes {
                    // Across nodes GEMM1 and combine wait for NCCL's kernels: the count of
                    // live blocks must leave them empty SMs, as for virtual ranks.
                    let oversized = regime.launches.iter().find(|l| {
                        l.stream == StreamRole::Compute
                            && l.grid.blocks(self.shape.max_tokens) > regime.compute_sms
                    });
                    if let (Some(_), Some(launch)) = (&ep.network, oversized) {
                        return Err(format!(
                            "regime `{}`: `{}` has more blocks than the {} compute SMs; NCCL's CTAs could find no SM while its blocks wait for them",
                            regime.name, launch.kernel, regime.compute_sms
                        ));
                    }
                    let per_device = regime
                        .comm_blocks
                        .saturating_add(nccl_sms)
                        .saturating_add(regime.compute_sms);
                    if regime.comm_blocks == 0 || regime.compute_sms == 0 || per_device > sms {
                        return Err(format!(
                            "regime `{}`: {} communication blocks, {nccl_sms} NCCL CTAs and {} compute SMs per device do not fit the {sms} of {}: spin-waits could wait on blocks that never run",
                            regime.name, regime.comm_blocks, regime.compute_sms, self.target.name
                        ));
                    }
                }
            }
        }
        // The peer table holds every rank's address of each buffer peers write.
        let table = u64::from(ep.ranks) * ep.peer_buffers.len() as u64;
        if !ep
            .workspace
            .iter()
            .any(|b| b.id == BufferId::PeerTable && b.elems == table)
        {
            return Err(format!(
                "the peer table does not hold {} ranks' addresses of {} buffers",
                ep.ranks,
                ep.peer_buffers.len()
            ));
        }
        if let Some(network) = &ep.network {
            if ep.combine_route != CombineRoute::RankPartials {
                return Err(
                    "results return as pair rows, but ranks on other nodes take them back through NCCL as rank partials".to_string(),
                );
            }
            self.check_network(ep, network)
                .map_err(|e| format!("network: {e}"))?;
        }
        // The kernels index every buffer by the plan's sizes: a rank's workspace must be
        // exactly what they imply (a hand-edited `elems` would let them write past it).
        let router_buffers = self
            .workspace
            .iter()
            .filter(|b| ROUTER_BUFFERS.contains(&b.id))
            .cloned();
        if ep.workspace != ep.expected_workspace(shape, router_buffers) {
            return Err(
                "a rank's workspace does not match the buffers its sizes, shape and router imply"
                    .into(),
            );
        }
        Ok(())
    }

    /// The network part matches the ranks and the chunks, its buffers hold what its
    /// transfers move, and NCCL's CTAs are within its limit.
    fn check_network(&self, ep: &ExpertParallelPlan, network: &NetworkPlan) -> Result<(), String> {
        let ranks = ep.ranks;
        if network.nodes < 2
            || network.gpus_per_node == 0
            || u64::from(network.nodes) * u64::from(network.gpus_per_node) != u64::from(ranks)
            || network.peers_per_rank != ranks - network.gpus_per_node
        {
            return Err(format!(
                "{} nodes of {} GPUs do not hold the {ranks} ranks",
                network.nodes, network.gpus_per_node
            ));
        }
        let placement = match network.transport {
            NetworkTransport::Nccl => Placement::Devices,
            NetworkTransport::Loopback => Placement::Virtual,
        };
        if ep.placement != placement {
            return Err(
                "ranks on several nodes need one GPU each, or are all virtual ranks of one GPU (emulated nodes, through the loopback)"
                    .into(),
            );
        }
        if network.chunk_tokens != ep.dispatch_chunk || network.chunks != ep.chunks_per_source {
            return Err("a transfer is not one dispatch chunk".into());
        }
        if ep.slots_per_source != self.shape.max_tokens {
            return Err(
                "the receive slots per source are not max_tokens, which the transfers' chunks of results cover"
                    .into(),
            );
        }
        if network.nccl_ctas == 0 || network.wait_limit_ms == 0 {
            return Err("NCCL has no CTAs, or the host's wait has no bound".into());
        }
        let shape = &self.shape;
        let peers = u64::from(network.peers_per_rank);
        let nodes = u64::from(network.other_nodes());
        let tokens = u64::from(shape.max_tokens);
        let node_rows = nodes * tokens * u64::from(shape.hidden);
        let needed = [
            (BufferId::NetSendX, node_rows),
            (
                BufferId::NetSendSlot,
                peers * u64::from(ep.experts_per_rank) * u64::from(ep.rows_per_segment),
            ),
            (BufferId::NetSendMask, nodes * tokens),
            (BufferId::RecvMask, nodes * tokens),
            (BufferId::NetSendRows, nodes * u64::from(network.chunks)),
            (BufferId::RecvRows, nodes * u64::from(network.chunks)),
            (BufferId::NetSendRow, nodes * tokens),
            (BufferId::NetRecvRow, nodes * tokens),
            (BufferId::NetRecvX, node_rows),
            (BufferId::NetArrived, nodes * u64::from(network.chunks)),
            (BufferId::NetReady, network.ready_flags()),
            (
                BufferId::NodePartials,
                u64::from(network.gpus_per_node) * node_rows,
            ),
            (
                BufferId::NodePartialsReady,
                u64::from(network.gpus_per_node),
            ),
            (BufferId::NetReturnX, node_rows),
            (BufferId::NetReturnedX, node_rows),
            (BufferId::NetReturnFlags, nodes * u64::from(network.chunks)),
            (BufferId::NetPartialsReady, 3),
        ];
        // A token's visit mask has a bit per rank of a node.
        if network.gpus_per_node > crate::check::topology::MAX_GPUS_PER_NODE_ACROSS_NODES {
            return Err(format!(
                "{} GPUs per node: a visit mask holds 32",
                network.gpus_per_node
            ));
        }
        for (id, elems) in needed {
            match ep.workspace.iter().find(|b| b.id == id) {
                Some(buffer) if buffer.elems >= elems => {}
                _ => return Err(format!("`{}` cannot hold {elems} elements", id.name())),
            }
        }
        Ok(())
    }

    /// One router regime per single-GPU regime; the rule's group limit and scale are
    /// usable; each gate runs an engine its regime and the target allow, its tile is
    /// whole 16-row and 16-expert pieces with its warps (a warp-specialised one whole
    /// warpgroups of 64 tokens and one wgmma wide), its split over blocks, stages and
    /// shared memory (its rings, or a fused router's scratch) are its layout's
    /// ([`router::gate_layout`]) and it covers every expert; the regime is fused exactly
    /// when its largest call has few pairs and the scratch fits a block; its launches are
    /// exactly those of that tile, shape and rule (grids, threads, shared memory,
    /// parameters: the bias exactly when the rule has one).
    fn check_router(&self, router: &RouterPlan) -> Result<(), String> {
        let experts = self.shape.experts;
        if router.regimes.len() != self.regimes.len() {
            return Err(format!(
                "{} router regimes for {} regimes",
                router.regimes.len(),
                self.regimes.len()
            ));
        }
        if let Some(limit) = router.rule.group_limit {
            let eligible =
                u64::from(limit.kept) * u64::from(experts) / u64::from(limit.groups.max(1));
            if limit.groups == 0
                || !experts.is_multiple_of(limit.groups)
                || limit.kept == 0
                || limit.kept > limit.groups
                || u64::from(self.shape.top_k) > eligible
            {
                return Err("the group limit does not fit the experts and top_k".into());
            }
        }
        if !(router.rule.scale > 0.0 && (router.rule.scale as f32).is_finite()) {
            return Err("the routing scale is not a positive 32-bit float".into());
        }
        let on_virtual_ranks = self
            .expert_parallel
            .as_ref()
            .is_some_and(|ep| ep.placement == Placement::Virtual);
        for (index, regime) in router.regimes.iter().enumerate() {
            let name = &self.regimes[index].name;
            let (min_tokens, max_tokens) = (
                self.regimes[index].min_tokens,
                self.regimes[index].max_tokens,
            );
            let scratch_of = |tile_tokens, tile_experts| {
                router::gate_scratch(
                    &router.rule,
                    experts,
                    self.shape.gemm_experts(),
                    self.shape.hidden,
                    self.target.smem_per_block,
                    (tile_tokens, tile_experts),
                )
            };
            let (fused_tokens, fused_experts) =
                router::fused_gate_tile(experts, max_tokens, self.target.sm_count);
            let fused = router::fused(
                max_tokens,
                self.shape.top_k,
                scratch_of(fused_tokens, fused_experts),
                self.target.smem_per_block,
            );
            let covered = regime.gates.first().map(|g| g.min_tokens) == Some(min_tokens)
                && regime.gates.last().map(|g| g.max_tokens) == Some(max_tokens)
                && regime
                    .gates
                    .windows(2)
                    .all(|pair| pair[1].min_tokens == pair[0].max_tokens + 1)
                && regime.gates.iter().all(|g| g.min_tokens <= g.max_tokens);
            if !covered {
                return Err(format!(
                    "the gates of regime `{name}` do not cover its calls {min_tokens}..={max_tokens} in order"
                ));
            }
            for gate in &regime.gates {
                let allowed = match gate.engine {
                    GateEngine::MmaSync => true,
                    GateEngine::WarpSpecialized => {
                        !regime.fused && router::wgmma_gate_allowed(experts, &self.target)
                    }
                    // Not beside virtual ranks' spinning blocks (see `router::split_gate_tile`).
                    GateEngine::Cluster { .. } => {
                        !regime.fused
                            && router::cluster_gate_allowed(experts, &self.target)
                            && gate.tile_experts == experts.next_multiple_of(16)
                            && !on_virtual_ranks
                    }
                };
                let tile = (gate.tile_tokens, gate.tile_experts);
                let layout = router::gate_layout(
                    gate.engine,
                    tile,
                    (&router.rule, experts, self.shape.hidden),
                    &self.target,
                    regime.fused.then(|| scratch_of(tile.0, tile.1)),
                );
                let whole_warps = |layout: &router::GateLayout| match gate.engine {
                    GateEngine::MmaSync | GateEngine::Cluster { .. } => {
                        gate.tile_tokens.is_multiple_of(16 * layout.warps_m)
                            && gate.tile_experts.is_multiple_of(16 * layout.warps_n)
                    }
                    GateEngine::WarpSpecialized => {
                        gate.tile_tokens.is_multiple_of(64) && gate.tile_experts <= MAX_WGMMA_WIDTH
                    }
                };
                let laid_out = layout.is_some_and(|layout| {
                    whole_warps(&layout)
                        && (
                            gate.warps_m,
                            gate.warps_n,
                            gate.warps_k,
                            gate.k_split,
                            gate.stages,
                            gate.smem_bytes,
                        ) == (
                            layout.warps_m,
                            layout.warps_n,
                            layout.warps_k,
                            layout.k_split,
                            layout.stages,
                            layout.smem_bytes,
                        )
                });
                if !allowed
                    || gate.tile_tokens == 0
                    || gate.tile_experts == 0
                    || !gate.tile_tokens.is_multiple_of(16)
                    || !gate.tile_experts.is_multiple_of(16)
                    || !laid_out
                    || gate.expert_tiles != experts.div_ceil(gate.tile_experts)
                    || gate.smem_bytes > self.target.smem_per_block
                {
                    return Err(format!("a gate tile of regime `{name}` does not add up"));
                }
            }
            let expected = router::router_launches(
                &router.rule,
                experts,
                &regime.gates,
                regime.fused,
                &self.symbol,
                name,
                self.target.has_programmatic_launch(),
            );
            if regime.fused != fused || regime.launches != expected {
                return Err(format!(
                    "the router launches of regime `{name}` disagree with the gate tile and the rule"
                ));
            }
            if regime.gemm1_starts_early
                != router::gemm1_starts_early_behind(
                    regime.fused,
                    !self.regimes[index].sorts_x_rows(),
                    &self.target,
                )
            {
                return Err(format!(
                    "whether GEMM1 starts early behind the router of regime `{name}` disagrees with the target"
                ));
            }
            for launch in &regime.launches {
                self.check_launch(launch)?;
            }
        }
        Ok(())
    }

    /// Regimes cover 0..=max_tokens in order under names of their own (they name the
    /// kernels); each GEMM's tile divides its problem, its
    /// shared-memory layout (for `tile_groups` groups of rows in `row_phases` phases, and
    /// the tables of its block routing) adds up, its warps fit the tile, and its launch
    /// agrees with it; every launch is well formed.
    fn check_regimes<'a>(
        &self,
        regimes: impl Iterator<Item = RegimeParts<'a>>,
        tile_groups: u32,
        row_phases: u32,
    ) -> Result<(), String> {
        let shape = &self.shape;
        let mut next_min = 0u64;
        let mut names = std::collections::BTreeSet::new();
        for regime in regimes {
            if !names.insert(regime.name) {
                return Err(format!("two regimes are named `{}`", regime.name));
            }
            if u64::from(regime.min_tokens) != next_min || regime.max_tokens < regime.min_tokens {
                return Err(format!(
                    "regime `{}` covers {}..={}, expected to start at {next_min}",
                    regime.name, regime.min_tokens, regime.max_tokens
                ));
            }
            next_min = u64::from(regime.max_tokens) + 1;
            let [(gemm1, kernel1), (gemm2, kernel2)] = regime.gemms;
            for (gemm, kernel, n, k, up) in [
                (gemm1, kernel1, shape.ffn, shape.hidden, true),
                (gemm2, kernel2, shape.hidden, shape.ffn, false),
            ] {
                let tile = gemm.tile;
                if !gemm.engine.takes_tile_k(tile.k)
                    || tile.n == 0
                    || tile.m == 0
                    || n % tile.n != 0
                    || k % TILE_K != 0
                {
                    return Err(format!("the tile of `{kernel}` does not divide {n}x{k}"));
                }
                // Only one GPU's mma.sync GEMMs route in their blocks (the expert-parallel
                // path has more groups of rows than experts).
                let kind = if up { GemmKind::Up } else { GemmKind::Down };
                let problem = GemmProblem::for_layer(shape, kind, row_phases);
                if gemm.block_routing != problem.block_routing(gemm.engine) {
                    return Err(format!(
                        "`{kernel}` routes in its blocks where its plan cannot, or not where it can"
                    ));
                }
                let routing_ints = gemm
                    .block_routing
                    .map_or(0, |routing| routing.table_ints(&problem));
                let layout = SmemLayout::new(
                    gemm.engine,
                    tile,
                    gemm.b_rows,
                    gemm.stages,
                    tile_groups,
                    routing_ints,
                );
                if gemm.smem != layout || gemm.smem_bytes != layout.dynamic_bytes {
                    return Err(format!(
                        "the shared-memory layout of `{kernel}` does not add up"
                    ));
                }
                let wgmma_rows = gemm.engine.is_wgmma() && gemm.warps_m * 16 != tile.m;
                let roles_match_engine =
                    gemm.warp_roles.is_some() == (gemm.engine == MmaEngine::WgmmaWarpSpecialized);
                if wgmma_rows || !roles_match_engine || gemm.warps_m == 0 || gemm.warps_n == 0 {
                    return Err(format!(
                        "the warp layout of `{kernel}` does not fit its tile"
                    ));
                }
                let launch = regime
                    .launches
                    .iter()
                    .find(|l| &l.kernel == kernel)
                    .ok_or_else(|| format!("regime `{}` never launches `{kernel}`", regime.name))?;
                if launch.block_threads != gemm.threads()
                    || launch.smem_bytes != gemm.smem_bytes
                    || launch.static_smem_bytes != gemm.smem.static_bytes
                {
                    return Err(format!(
                        "the launch of `{kernel}` disagrees with its GEMM plan"
                    ));
                }
                Self::check_gemm_loads(gemm, launch, kernel, up)?;
                // The warp-specialised GEMMs claim their units from a ticket.
                let claims = gemm.claims_units();
                let ticket = LaunchArg::Workspace(BufferId::UnitTickets);
                if launch.params.iter().any(|param| param.arg == ticket) != claims {
                    return Err(format!(
                        "`{kernel}` {} the unit tickets (the warp-specialised GEMMs claim their units from them; no other GEMM takes them)",
                        if claims { "is not given" } else { "is given" }
                    ));
                }
                // A layer's expert biases reach every GEMM, one GPU's and each rank's (a
                // GEMM without its bias would drop it silently).
                let bias = if up {
                    LaunchArg::W1Bias
                } else {
                    LaunchArg::W2Bias
                };
                if shape.expert_bias && !launch.params.iter().any(|param| param.arg == bias) {
                    return Err(format!(
                        "`{kernel}` is not given `{}`, the layer's expert biases",
                        bias.name()
                    ));
                }
            }
            for launch in regime.launches {
                self.check_launch(launch)?;
            }
        }
        if next_min != u64::from(shape.max_tokens) + 1 {
            return Err(format!(
                "the regimes end at {} tokens, not at max_tokens {}",
                next_min.saturating_sub(1),
                shape.max_tokens
            ));
        }
        Ok(())
    }

    /// A GEMM1 that loads its A rows as tiles reads x sorted into the expert-major order:
    /// the invert kernel, then the sort kernel, run before it, each one block per token (the
    /// most rows a call has: a token's worth per block), with their own threads and
    /// parameters; a regime that gathers runs neither.
    fn check_sort_rows(&self, regime: &Regime) -> Result<(), String> {
        let position = |kernel: &str| regime.launches.iter().position(|l| l.kernel == kernel);
        let steps = [
            (
                &self.invert_rows_kernel,
                INVERT_ROWS_THREADS,
                super::launch::invert_rows_params(),
            ),
            (
                &self.sort_rows_kernel,
                SORT_ROWS_THREADS,
                super::launch::sort_rows_params(),
            ),
        ];
        let positions: Vec<Option<usize>> = steps.iter().map(|(k, _, _)| position(k)).collect();
        if regime.gemm1.a_load == RowLoad::Gathered {
            return match positions.iter().flatten().next() {
                None => Ok(()),
                Some(&at) => Err(format!(
                    "regime `{}` launches `{}`, but `{}` gathers x's rows",
                    regime.name, regime.launches[at].kernel, regime.gemm1_kernel
                )),
            };
        }
        if self.shape.slots_per_token() > SORT_ROWS_THREADS {
            return Err(format!(
                "`{}` loads x's rows as tiles, but a token's {} rows are more than the sort kernel's {SORT_ROWS_THREADS} threads look up",
                regime.gemm1_kernel,
                self.shape.slots_per_token()
            ));
        }
        let gemm1 = position(&regime.gemm1_kernel);
        let in_order = matches!(
            (positions[0], positions[1], gemm1),
            (Some(invert), Some(sort), Some(gemm1)) if invert < sort && sort < gemm1
        );
        if !in_order {
            return Err(format!(
                "`{}` loads x's rows as tiles, but regime `{}` does not invert, then sort them before it",
                regime.gemm1_kernel, regime.name
            ));
        }
        let grid = Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile: 1,
        };
        for ((_, threads, params), at) in steps.iter().zip(positions.into_iter().flatten()) {
            let launch = &regime.launches[at];
            if launch.grid != grid || launch.block_threads != *threads || launch.params != *params {
                return Err(format!(
                    "`{}` is launched on {:?} of {} threads with ({}), not {grid:?} of {threads} with its own parameters",
                    launch.kernel,
                    launch.grid,
                    launch.block_threads,
                    launch
                        .params
                        .iter()
                        .map(|p| p.arg.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        Ok(())
    }

    /// A cluster pair is a warp-specialised 128-row tile on a grid of whole pairs; a
    /// warp-specialised stage's B rows fit one wgmma; the tensor maps the launch passes
    /// have the boxes the GEMM loads (weights in boxes of `weight_box_rows`, A rows in
    /// tiles of `BM` exactly when the plan loads them so: sorted x for GEMM1 (`up`), the
    /// intermediate for GEMM2).
    fn check_gemm_loads(
        gemm: &GemmPlan,
        launch: &super::Launch,
        kernel: &str,
        up: bool,
    ) -> Result<(), String> {
        let warp_specialized = gemm.engine == MmaEngine::WgmmaWarpSpecialized;
        if warp_specialized && gemm.b_rows > MAX_WGMMA_WIDTH {
            return Err(format!(
                "`{kernel}`'s {} B rows per stage exceed one wgmma's {MAX_WGMMA_WIDTH}",
                gemm.b_rows
            ));
        }
        let pair_fits = gemm.cluster == 1 || (gemm.cluster == CLUSTER_PAIR && gemm.can_pair());
        if !pair_fits {
            return Err(format!(
                "`{kernel}` cannot run in clusters of {} blocks",
                gemm.cluster
            ));
        }
        if gemm.stream_k.is_some() && warp_specialized {
            return Err(format!(
                "`{kernel}` splits tiles stream-K, which only the mma.sync engine does"
            ));
        }
        // A GEMM that routes in its blocks reads the call's ids and token count, and
        // whether the call routes so; GEMM1, the call's first kernel then, also clears and
        // writes the error word.
        let takes = |arg: LaunchArg| launch.params.iter().any(|param| param.arg == arg);
        let routing_args = [
            LaunchArg::TopkIds,
            LaunchArg::Tokens,
            LaunchArg::RoutesInBlocks,
        ];
        let routes_in_blocks = routing_args.into_iter().all(takes)
            && (!up || takes(LaunchArg::Workspace(BufferId::ErrorWord)));
        if gemm.block_routing.is_some() && !routes_in_blocks {
            return Err(format!(
                "`{kernel}` routes in its blocks but is not given the call's ids, token count, whether it routes so and the error word"
            ));
        }
        if gemm.a_load == RowLoad::Tiles && !warp_specialized {
            return Err(format!(
                "`{kernel}` loads A rows as tiles without a producer"
            ));
        }
        if gemm.store == OutputStore::QuadVectors
            && !(warp_specialized && gemm.tile.n.is_multiple_of(32))
        {
            return Err(format!(
                "`{kernel}` stores 16 bytes per lane, which needs the wgmma epilogue and a tile width that is a multiple of 32"
            ));
        }
        let mut takes_a_tiles = false;
        for param in &launch.params {
            let boxes_agree = match param.arg {
                LaunchArg::W1Tiles { box_rows } | LaunchArg::W2Tiles { box_rows } => {
                    box_rows == gemm.weight_box_rows()
                }
                LaunchArg::SortedXTiles { box_rows } => {
                    takes_a_tiles = true;
                    up && box_rows == gemm.tile.m
                }
                LaunchArg::IntermediateTiles { box_rows } => {
                    takes_a_tiles = true;
                    !up && box_rows == gemm.tile.m
                }
                _ => true,
            };
            if !boxes_agree {
                return Err(format!(
                    "the boxes of `{kernel}`'s `{}` disagree with its tile, or the map is over another GEMM's rows",
                    param.arg.name()
                ));
            }
        }
        if takes_a_tiles != (gemm.a_load == RowLoad::Tiles) {
            return Err(format!(
                "`{kernel}`'s parameters disagree with how it loads its A rows"
            ));
        }
        Ok(())
    }

    fn check_launch(&self, launch: &super::Launch) -> Result<(), String> {
        let kernel = &launch.kernel;
        if *kernel != c_identifier(kernel) || !kernel.starts_with(&self.symbol) {
            return Err(format!(
                "kernel `{kernel}` is not an entry point of this layer"
            ));
        }
        if launch.block_threads == 0
            || launch.block_threads > 1024
            || !launch.block_threads.is_multiple_of(32)
        {
            return Err(format!(
                "`{kernel}` has {} threads per block",
                launch.block_threads
            ));
        }
        let empty = match launch.grid {
            Grid::Fixed(blocks) => blocks == 0,
            Grid::TokenTiles {
                tokens_per_tile,
                blocks_per_tile,
            } => tokens_per_tile == 0 || blocks_per_tile == 0,
            Grid::SplitTokenTiles {
                tokens_per_tile,
                blocks_per_tile,
                k_split,
            } => {
                tokens_per_tile == 0
                    || blocks_per_tile == 0
                    || k_split.steps == 0
                    || k_split.most_blocks == 0
            }
        };
        if empty {
            return Err(format!("`{kernel}` has an empty grid"));
        }
        if launch.early_start && !self.target.has_programmatic_launch() {
            return Err(format!(
                "`{kernel}` starts early, which {} cannot",
                self.target.arch
            ));
        }
        let smem = u64::from(launch.smem_bytes) + u64::from(launch.static_smem_bytes);
        if smem > u64::from(self.target.smem_per_block) {
            return Err(format!(
                "`{kernel}` uses {smem} B of shared memory, more than the {} of {}",
                self.target.smem_per_block, self.target.name
            ));
        }
        for (i, param) in launch.params.iter().enumerate() {
            if launch.params[..i].iter().any(|p| p.arg == param.arg) {
                return Err(format!("`{kernel}` takes `{}` twice", param.arg.name()));
            }
            let inputs = matches!(
                param.arg,
                LaunchArg::X
                    | LaunchArg::TopkIds
                    | LaunchArg::TopkWeights
                    | LaunchArg::W1
                    | LaunchArg::W2
                    | LaunchArg::GateWeight
                    | LaunchArg::GateBias
                    | LaunchArg::W1Bias
                    | LaunchArg::W2Bias
                    | LaunchArg::SharedExpertGate
            );
            let shared_gate_arg = matches!(
                param.arg,
                LaunchArg::SharedExpertGate | LaunchArg::Workspace(BufferId::SharedGate)
            );
            if shared_gate_arg && !self.shape.shared_gated {
                return Err(format!(
                    "`{kernel}` takes `{}`, but the layer's shared expert is not gated",
                    param.arg.name()
                ));
            }
            if matches!(param.arg, LaunchArg::W1Bias | LaunchArg::W2Bias) && !self.shape.expert_bias
            {
                return Err(format!(
                    "`{kernel}` takes `{}`, but the layer has no expert biases",
                    param.arg.name()
                ));
            }
            if inputs && param.access == Access::Write {
                return Err(format!(
                    "`{kernel}` would write the caller's `{}`",
                    param.arg.name()
                ));
            }
        }
        Ok(())
    }
}
