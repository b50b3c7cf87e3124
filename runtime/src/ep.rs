//! The expert-parallel layer: R ranks, each with its experts, its workspace and two streams
//! (communication and compute), plus, for a rank with peers on other nodes, the network
//! stream of [`crate::network`] (NCCL steps between dispatch and combine), exchanging
//! tokens and results through the plan's expert-parallel kernels
//! (`moeforge_compiler::plan::ep`).
//!
//! Ranks live on one GPU (virtual ranks: the same kernels, every peer address on one
//! device), on one GPU each driven from this process with peer access enabled
//! ([`EpLayer::new`]), or on one GPU each, one process per rank ([`EpLayer::join_group`]:
//! this process holds its own rank; the peers' buffers are CUDA IPC mappings, see
//! [`crate::ipc`]). Only the peer table differs, and the network path of ranks on several
//! nodes. Virtual ranks may also emulate several nodes (the plan's loopback transport): one
//! loopback stream then runs every rank's network steps as device copies
//! (`runtime/src/loopback.rs`). A call enqueues, per rank: the communication stream waits for
//! the compute stream's earlier work, then takes the metadata and dispatch kernels; the
//! compute stream takes arrange, the GEMMs and combine, then waits for the communication
//! stream. A call that routes itself ([`EpLayer::forward_routed`]) first runs the layer's
//! router on each rank's own tokens, on its compute stream, ahead of both. Within a call
//! the ranks synchronise only through the kernels' flags; each call raises the epoch the
//! flags compare against, so no flag is ever reset.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use moeforge_compiler::plan::ep::{EXCHANGE_STATE, ExpertParallelPlan};
use moeforge_compiler::plan::network::{NetworkPlan, NetworkTransport, Route};
use moeforge_compiler::plan::{BufferId, Launch, LaunchArg, Plan, StreamRole};

use crate::gpu::{DriverContext, GpuError, LoadedKernels};
use crate::ipc::{self, ExportableBuffer, PeerMappings};
use crate::layer::{
    ArgValue, ExpertWeights, ForwardArgs, GateWeights, LayerError, RoutedForwardArgs,
    WeightTensorMaps, check_len, fused_decode_from, kernel_error, launch_with, load_kernel, ptr,
    read_error_word, read_words,
};
use crate::loopback::LoopbackPath;
use crate::network::{self, NetworkError, NetworkPath, STREAM_MEMOP_FLAGS};
use crate::process_group::ControlChannel;
use crate::tensor_map::TensorMap;

/// Where a kernel parameter's value comes from, resolved once per rank.
#[derive(Clone, Copy)]
enum Binding {
    /// The caller's buffers and token count.
    X,
    TopkIds,
    TopkWeights,
    Y,
    Tokens,
    W1,
    W2,
    /// The rank's experts' biases (GEMM1's, GEMM2's).
    W1Bias,
    W2Bias,
    /// The shared expert gate's weights, which every rank holds.
    SharedExpertGate,
    Rank,
    Epoch,
    Workspace(usize),
    /// The tensor map at this position of the rank's `tensor_maps`.
    TensorMap(usize),
    /// The router's gate weights and bias, on the rank's device.
    GateWeight,
    GateBias,
    /// 0 for a fused router's `lays_out_routing`: the expert-parallel kernels route.
    NoRoutingLayout,
    /// A null pointer: a fused router's routing-metadata buffers, which it leaves alone
    /// when it lays out no routing metadata.
    Unused,
}

/// A fused router's routing-metadata buffers (the single-GPU route's), which a rank does
/// not hold: its router lays out no metadata.
const ROUTER_METADATA: [BufferId; 3] = [
    BufferId::ExpertOffsets,
    BufferId::RowPair,
    BufferId::ErrorWord,
];

/// One rank's buffers for one call, as device addresses: the caller's, or (a call that
/// routes itself) the rank's own choices in place of `topk_ids` and `topk_weights`.
#[derive(Clone, Copy)]
struct RankCall {
    tokens: u32,
    x: u64,
    y: u64,
    topk_ids: u64,
    topk_weights: u64,
}

/// A workspace buffer's memory: from the stream-ordered pool, or, for the buffers peers
/// write when the peers are other processes, memory they can map (`cuMemAlloc`; also the
/// flags the network stream's memory operations wait on or write).
enum WorkspaceMemory {
    Pool(CudaSlice<u8>),
    Exportable(ExportableBuffer),
}

impl WorkspaceMemory {
    fn slice(&self) -> &CudaSlice<u8> {
        match self {
            WorkspaceMemory::Pool(slice) => slice,
            WorkspaceMemory::Exportable(buffer) => buffer.slice(),
        }
    }

    fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        match self {
            WorkspaceMemory::Pool(slice) => slice,
            WorkspaceMemory::Exportable(buffer) => buffer.slice_mut(),
        }
    }
}

/// One rank: its streams, module, buffers, experts and resolved launches.
struct Rank {
    /// Its rank in the layer (`0..R`), the kernels' `rank` argument.
    index: u32,
    compute: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    workspace: Vec<(BufferId, WorkspaceMemory)>,
    weights: ExpertWeights,
    /// Tensor maps over this rank's experts' weights.
    tensor_maps: Vec<(LaunchArg, TensorMap)>,
    /// Per regime, each launch's function and bindings (in the plan's launch order, the
    /// fused decode's last where the regime has one).
    regime_kernels: Vec<Vec<(CudaFunction, Vec<Binding>)>>,
    /// The router's gate on this rank's device and, per single-GPU regime, the router's
    /// launches (empty until [`EpLayer::with_router`]).
    gate: Option<GateWeights>,
    router_kernels: Vec<Vec<(CudaFunction, Vec<Binding>)>>,
    module: LoadedKernels,
}

pub struct EpLayer {
    plan: Plan,
    /// `plan`'s expert-parallel part.
    ep: ExpertParallelPlan,
    /// The ranks this process drives: all of them, or its own one in a group.
    ranks: Vec<Rank>,
    /// This process's part in a group of rank processes, when it is one.
    group: Option<Group>,
    /// The epoch of the last call; flags start at 0, so the first call is epoch 1.
    epoch: u32,
    /// The most tokens any rank passes in a call, as the ranks agreed
    /// ([`EpLayer::bound_tokens`]; max_tokens until they do): the network steps move
    /// what so many tokens can fill, and rank processes run the fused decode by it.
    tokens_bound: u32,
    /// Fault injection: the rank whose communication the next call leaves out.
    withheld: Option<usize>,
    /// The network of emulated nodes, when the ranks are virtual ranks standing for
    /// several nodes.
    loopback: Option<LoopbackPath>,
    /// Whether calls a rank regime's fused decode covers run it (all ranks must take the
    /// same path: one process driving every rank decides from every rank's count, rank
    /// processes from the tokens bound they agreed on); `MOEFORGE_FUSED_DECODE=0` runs the
    /// table instead, as on one GPU.
    fused_decode: bool,
}

/// This process's membership of a group of rank processes.
struct Group {
    /// Where the ranks meet after a time-out, and before tearing down.
    channel: ControlChannel,
    /// The buffers of the peers on this node, mapped here; the peer table holds their
    /// addresses.
    _mappings: PeerMappings,
    /// Traffic with the ranks on other nodes, when the plan has some.
    network: Option<NetworkPath>,
}

/// The tokens bound of a group: the largest of this rank's `mine` and every rank's value
/// gathered in `messages` (4 little-endian bytes each, as [`EpLayer::bound_tokens`] sends
/// them).
fn agreed_tokens_bound(mine: u32, messages: &[Vec<u8>]) -> Result<u32, LayerError> {
    messages.iter().try_fold(mine, |bound, message| {
        let bytes: [u8; 4] =
            message
                .as_slice()
                .try_into()
                .map_err(|_| LayerError::TokensBoundMessage {
                    bytes: message.len(),
                })?;
        Ok(bound.max(u32::from_le_bytes(bytes)))
    })
}

/// Enables access from `from` to `to`'s memory (one process, several GPUs).
fn enable_peer_access(from: &CudaContext, to: &CudaContext) -> Result<(), GpuError> {
    from.bind_to_thread().context("binding a context")?;
    // SAFETY: both contexts are alive; the call only changes the current context's mappings.
    let result = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    match result {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => Err(GpuError::PeerAccess {
            from: from.ordinal(),
            to: to.ordinal(),
            result: format!("{other:?}"),
        }),
    }
}

/// Loads a kernel's code now. Under CUDA's lazy loading a kernel is loaded at its first
/// launch, which can wait for the device while peers' kernels spin on flags that the
/// loading kernel would release: expert-parallel kernels must all be resident-ready first.
fn load_now(ctx: &CudaContext, function: &CudaFunction, name: &str) -> Result<(), GpuError> {
    ctx.bind_to_thread().context("binding a context")?;
    // SAFETY: the function handle belongs to a module loaded in `ctx`, which is alive.
    let result = unsafe { sys::cuFuncLoad(function.cu_function()) };
    if result != CUresult::CUDA_SUCCESS {
        return Err(GpuError::Driver {
            context: format!("loading the code of `{name}`"),
            source: cudarc::driver::DriverError(result),
        });
    }
    Ok(())
}

/// Lets device `accessor` read and write what `owner` allocates from its current memory
/// pool: cudarc allocates stream-ordered from that pool, and context peer access does not
/// cover pool allocations.
fn grant_pool_access(owner: &CudaContext, accessor: &CudaContext) -> Result<(), GpuError> {
    owner.bind_to_thread().context("binding a context")?;
    let failed = |call: &str, result: CUresult| GpuError::PeerAccess {
        from: accessor.ordinal(),
        to: owner.ordinal(),
        result: format!("{call}: {result:?}"),
    };
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; the device belongs to a live context.
    let result = unsafe { sys::cuDeviceGetMemPool(&mut pool, owner.cu_device()) };
    if result != CUresult::CUDA_SUCCESS {
        return Err(failed("cuDeviceGetMemPool", result));
    }
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: accessor.ordinal() as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid access descriptor for a pool the driver returned.
    let result = unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) };
    if result != CUresult::CUDA_SUCCESS {
        return Err(failed("cuMemPoolSetAccess", result));
    }
    Ok(())
}

impl EpLayer {
    /// Builds the layer: rank `r` runs on `contexts[r]` (all the same context for virtual
    /// ranks) with `modules[r]`, the plan's expert-parallel kernels loaded there, and
    /// `weights[r]`, its `E / R` routed experts then the shared slices, in checkpoint
    /// layout.
    pub fn new(
        plan: Plan,
        contexts: &[Arc<CudaContext>],
        modules: Vec<LoadedKernels>,
        weights: Vec<ExpertWeights>,
    ) -> Result<Self, LayerError> {
        let ep = expert_parallel_part(&plan)?;
        if let Some(network) = &ep.network
            && network.transport == NetworkTransport::Nccl
        {
            return Err(LayerError::AcrossNodes {
                nodes: network.nodes,
            });
        }
        let ranks = ep.ranks as usize;
        if contexts.len() != ranks || modules.len() != ranks || weights.len() != ranks {
            return Err(LayerError::RankCount {
                ranks: ep.ranks,
                given: contexts.len().min(modules.len()).min(weights.len()),
            });
        }
        for (i, a) in contexts.iter().enumerate() {
            for b in &contexts[i + 1..] {
                if a.ordinal() != b.ordinal() {
                    enable_peer_access(a, b)?;
                    enable_peer_access(b, a)?;
                    grant_pool_access(a, b)?;
                    grant_pool_access(b, a)?;
                }
            }
        }
        let mut built = Vec::with_capacity(ranks);
        for (index, ((ctx, module), weights)) in
            contexts.iter().zip(modules).zip(weights).enumerate()
        {
            built.push(build_rank(
                &plan,
                &ep,
                index as u32,
                ctx,
                module,
                weights,
                false,
            )?);
        }
        // With peer access (or one device) an address is valid on every rank's device.
        let table = built
            .iter()
            .map(|rank| {
                ep.peer_buffers
                    .iter()
                    .map(|id| Ok(ptr(workspace(&rank.workspace, *id)?, &rank.compute)))
                    .collect::<Result<Vec<u64>, LayerError>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        // On emulated nodes a rank reaches a peer on another node only as real nodes do:
        // through the network steps, never by address.
        for (me, rank) in built.iter_mut().enumerate() {
            let mut mine = table.clone();
            if let Some(network) = &ep.network {
                out_of_reach(&mut mine, &ep, network, me as u32);
            }
            write_peer_table(rank, &mine)?;
        }
        let loopback = match &ep.network {
            None => None,
            Some(network) => Some(loopback(&plan, &ep, network, &built, &contexts[0])?),
        };
        let max_tokens = plan.shape.max_tokens;
        let layer = EpLayer {
            plan,
            ep,
            ranks: built,
            group: None,
            loopback,
            epoch: 0,
            tokens_bound: max_tokens,
            withheld: None,
            fused_decode: fused_decode_from(crate::env_value)?,
        };
        layer.synchronize()?;
        Ok(layer)
    }

    /// Builds this process's rank of a group of rank processes, one GPU each: rank
    /// `channel.rank()` on `ctx` with `module` (the plan's expert-parallel kernels loaded
    /// there) and `weights` (its `E / R` routed experts, then the shared slices). Every
    /// rank of the group calls it with the same plan; it returns once every rank's peer
    /// table is in place. Checks that the group
    /// has the plan's rank count and a GPU per rank, joins the NCCL communicator,
    /// exchanges the IPC handles of the buffers peers write and maps those of the peers on
    /// this node. When the plan spans nodes, it keeps the communicator for the network
    /// path (see [`crate::network`]): the peer table's row of a peer on another node is
    /// zeros (the kernels reach it only through the network steps), and the first exchange
    /// with every such peer is made here, bounded.
    pub fn join_group(
        plan: Plan,
        ctx: &Arc<CudaContext>,
        module: LoadedKernels,
        weights: ExpertWeights,
        mut channel: ControlChannel,
    ) -> Result<Self, LayerError> {
        let ep = expert_parallel_part(&plan)?;
        if let Some(network) = &ep.network
            && network.transport == NetworkTransport::Loopback
        {
            return Err(LayerError::EmulatedNodesInGroup {
                nodes: network.nodes,
            });
        }
        ipc::check_group(&mut channel, &plan, ep.ranks, ctx)?;
        let me = channel.rank();
        let mut rank = build_rank(&plan, &ep, me, ctx, module, weights, true)?;
        let max_ctas = ep.network.as_ref().map(|network| network.nccl_ctas);
        let comm = ipc::join_nccl(&mut channel, &rank.compute, max_ctas)?;
        let exported = ep
            .peer_buffers
            .iter()
            .map(|id| match rank.workspace.iter().find(|(b, _)| b == id) {
                Some((_, WorkspaceMemory::Exportable(buffer))) => Ok(buffer),
                _ => Err(LayerError::MissingWorkspace { buffer: id.name() }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let on_this_node = |peer: u32| {
            ep.network
                .as_ref()
                .is_none_or(|network| network.route(me, peer) != Route::Network)
        };
        let mut peers = ipc::exchange(
            &comm,
            &rank.compute,
            &exported,
            on_this_node,
            channel.timeout(),
        )?;
        if let Some(network) = &ep.network {
            out_of_reach(&mut peers.table, &ep, network, me);
        }
        write_peer_table(&mut rank, &peers.table)?;
        rank.compute
            .synchronize()
            .context("placing the peer table")?;
        let network = match &ep.network {
            None => {
                // Every rank's all-gather has finished: one node needs no more of the
                // communicator.
                drop(comm);
                None
            }
            Some(network) => {
                let stream = ctx.new_stream().context("creating the network stream")?;
                let buffer = |id: BufferId| {
                    let slice = workspace(&rank.workspace, id)
                        .map_err(|_| NetworkError::MissingBuffer { buffer: id.name() })?;
                    Ok((ptr(slice, &rank.compute), slice.len() as u64))
                };
                let path = NetworkPath::new(comm, stream, &ep, network, &plan.shape, buffer)?;
                path.connect(&network.peers(me, ep.ranks), channel.timeout())?;
                Some(path)
            }
        };
        // Every rank's table is in place: every rank may start calling.
        channel.barrier().map_err(ipc::GroupError::from)?;
        let max_tokens = plan.shape.max_tokens;
        Ok(EpLayer {
            plan,
            ep,
            ranks: vec![rank],
            group: Some(Group {
                channel,
                _mappings: peers.mappings,
                network,
            }),
            loopback: None,
            epoch: 0,
            tokens_bound: max_tokens,
            withheld: None,
            fused_decode: fused_decode_from(crate::env_value)?,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// How many ranks this process drives (one in a group of rank processes).
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The layer's rank of the `r`-th rank this process drives (`r` itself unless this
    /// process is one rank of a group).
    pub fn rank_index(&self, r: usize) -> u32 {
        self.ranks[r].index
    }

    /// The control channel of this process's group, when the ranks are processes: for
    /// meeting the other ranks (a bench's start line, gathering results).
    pub fn group_channel(&mut self) -> Option<&mut ControlChannel> {
        self.group.as_mut().map(|group| &mut group.channel)
    }

    /// Rank `r`'s compute stream: upload its inputs there, read its output after it.
    pub fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.ranks[rank].compute
    }

    /// Agrees on the tokens bound of the calls that follow: `most` is the most tokens this
    /// process will pass any of its ranks in a call (`None`: up to max_tokens) until the
    /// next agreement. In a group of rank processes every rank calls it before the same
    /// call (it meets the others on the control channel) and the bound is the largest any
    /// rank gave. Across nodes a call's NCCL steps then move only what so many tokens can
    /// fill (the chunks below the bound, each receive-index segment up to it) instead of
    /// max_tokens' worth, which a decode call would otherwise pay for; on one node rank
    /// processes run the ranks' fused decode where it covers the bound (each sees only its
    /// own count, and all must take the same path). Returns the bound; a call that passes
    /// a rank more tokens is refused ([`LayerError::BeyondTokensBound`]).
    pub fn bound_tokens(&mut self, most: Option<u32>) -> Result<u32, LayerError> {
        let max = self.plan.shape.max_tokens;
        let mine = most.unwrap_or(max);
        if mine > max {
            return Err(LayerError::TooManyTokens { tokens: mine, max });
        }
        let bound = match self.group.as_mut() {
            None => mine,
            Some(group) => agreed_tokens_bound(
                mine,
                &group
                    .channel
                    .all_gather(&mine.to_le_bytes())
                    .map_err(ipc::GroupError::from)?,
            )?,
        };
        self.tokens_bound = bound.min(max);
        Ok(self.tokens_bound)
    }

    /// The tokens bound of the calls that follow (see [`EpLayer::bound_tokens`]).
    pub fn tokens_bound(&self) -> u32 {
        self.tokens_bound
    }

    /// Waits for every rank's streams; for the network stream at most the plan's bound (a
    /// stalled transfer is [`NetworkError::Stalled`]; an abandoned path is not waited for).
    pub fn synchronize(&self) -> Result<(), LayerError> {
        // Once the network path is abandoned the rank's streams may wait on its stuck
        // stream (a call enqueued after the stalled one joins it): refuse, never block.
        if let Some(network) = self.network() {
            network.wait()?;
        }
        if let Some(loopback) = &self.loopback {
            loopback.wait()?;
        }
        for rank in &self.ranks {
            rank.comm.synchronize().context("synchronising a rank")?;
            rank.compute.synchronize().context("synchronising a rank")?;
        }
        Ok(())
    }

    /// The layer with its router: `gates[r]` is the gate (the same weights on every rank)
    /// on the device of the `r`-th rank this process drives. Its calls may then route
    /// themselves ([`EpLayer::forward_routed`]). The plan must have a router. Given again,
    /// the new gates replace the old.
    pub fn with_router(mut self, gates: Vec<GateWeights>) -> Result<Self, LayerError> {
        let router = match &self.plan.router {
            Some(router) if self.ep.routes_itself => router,
            _ => return Err(LayerError::NoRouter),
        };
        self.check_rank_count(gates.len())?;
        let shape = &self.plan.shape;
        for (rank, gate) in self.ranks.iter_mut().zip(gates) {
            gate.check(shape, router)?;
            // An earlier gate's maps go (they come after the experts' maps, whose
            // positions the expert-parallel launches hold).
            rank.tensor_maps
                .retain(|(arg, _)| !matches!(arg, LaunchArg::GateWeightTiles { .. }));
            let ctx = rank.compute.context();
            let mut tensor_maps = WeightTensorMaps {
                shape,
                experts: self.ep.experts_per_rank + shape.shared_slices,
                weights: &rank.weights,
                gate_weight: Some(&gate.weight),
                stream: &rank.compute,
                maps: std::mem::take(&mut rank.tensor_maps),
            };
            let mut loaded = Vec::new();
            let mut kernels = Vec::with_capacity(router.regimes.len());
            for regime in &router.regimes {
                let mut launches = Vec::with_capacity(regime.launches.len());
                for launch in &regime.launches {
                    let function = load_kernel(&rank.module, &mut loaded, launch)?;
                    load_now(ctx, &function, &launch.kernel)?;
                    let bindings = launch
                        .params
                        .iter()
                        .map(|p| bind_router(p.arg, &rank.workspace, &mut tensor_maps))
                        .collect::<Result<Vec<_>, _>>()?;
                    launches.push((function, bindings));
                }
                kernels.push(launches);
            }
            rank.tensor_maps = tensor_maps.maps;
            rank.router_kernels = kernels;
            rank.gate = Some(gate);
        }
        Ok(self)
    }

    /// Whether the layer's calls can route themselves: it has a router and
    /// [`EpLayer::with_router`] gave it the gate.
    pub fn routes_itself(&self) -> bool {
        self.ranks.iter().all(|rank| rank.gate.is_some())
    }

    /// Rank `r`'s workspace buffer `id` (bytes; the plan gives its element type): after a
    /// call that routed itself, `routed_ids`, `routed_weights` and `router_logits` hold its
    /// router's choices and logits.
    pub fn workspace_buffer(&self, r: usize, id: BufferId) -> Option<&CudaSlice<u8>> {
        workspace(&self.ranks.get(r)?.workspace, id).ok()
    }

    /// Enqueues one call: `args[r]` is rank `r`'s tokens (on its device; in a group, one
    /// entry, this process's rank). Does not synchronise. The ranks meet only through the
    /// kernels' flags; in a group every rank makes the same sequence of calls.
    pub fn forward(&mut self, args: &mut [ForwardArgs<'_>]) -> Result<(), LayerError> {
        let calls = self.caller_routed_calls(args)?;
        self.forward_calls(&calls, false)
    }

    /// Enqueues one call that routes itself: each rank's router chooses the experts and
    /// weights of `args[r]`'s tokens (into its `routed_ids` and `routed_weights`), then
    /// the call runs as [`EpLayer::forward`] on those choices. Needs
    /// [`EpLayer::with_router`]. Does not synchronise.
    pub fn forward_routed(&mut self, args: &mut [RoutedForwardArgs<'_>]) -> Result<(), LayerError> {
        let calls = self.routed_calls(args)?;
        self.forward_calls(&calls, true)
    }

    /// Enqueues only each rank's router for `args[r]`'s tokens, on its compute stream, as
    /// [`EpLayer::forward_routed`] starts a call: what the routers take on their own (the
    /// bench's). Exchanges nothing. Does not synchronise.
    pub fn route(&mut self, args: &mut [RoutedForwardArgs<'_>]) -> Result<(), LayerError> {
        for (r, call) in self.routed_calls(args)?.iter().enumerate() {
            self.enqueue_router(r, call)?;
        }
        Ok(())
    }

    /// Checks a self-routed call's arguments and resolves them to device addresses, each
    /// rank's own choices in place of the caller's.
    fn routed_calls(
        &self,
        args: &mut [RoutedForwardArgs<'_>],
    ) -> Result<Vec<RankCall>, LayerError> {
        if !self.routes_itself() {
            return Err(if self.plan.router.is_some() {
                LayerError::NoGateWeights
            } else {
                LayerError::NoRouter
            });
        }
        self.check_rank_count(args.len())?;
        let hidden = u64::from(self.plan.shape.hidden);
        args.iter()
            .zip(&self.ranks)
            .map(|(a, rank)| {
                let t = u64::from(a.tokens);
                check_len("x", a.x.len(), t * hidden)?;
                check_len("y", a.y.len(), t * hidden)?;
                let stream = &rank.comm;
                Ok(RankCall {
                    tokens: a.tokens,
                    x: ptr(a.x, stream),
                    y: ptr(a.y, stream),
                    topk_ids: ptr(workspace(&rank.workspace, BufferId::RoutedIds)?, stream),
                    topk_weights: ptr(workspace(&rank.workspace, BufferId::RoutedWeights)?, stream),
                })
            })
            .collect()
    }

    /// That `given` (gates, or a call's arguments) is one per rank this process drives.
    fn check_rank_count(&self, given: usize) -> Result<(), LayerError> {
        if given == self.ranks.len() {
            return Ok(());
        }
        Err(LayerError::RankCount {
            ranks: self.ranks.len() as u32,
            given,
        })
    }

    /// Rank `r`'s router choices of the last call that routed itself with `tokens` tokens:
    /// its `topk_ids` and `topk_weights`, read back on its compute stream.
    pub fn routed_choices(
        &self,
        r: usize,
        tokens: u32,
    ) -> Result<(Vec<i32>, Vec<f32>), LayerError> {
        let rank = self.ranks.get(r).ok_or(LayerError::NoSuchRank {
            rank: r,
            ranks: self.ranks.len(),
        })?;
        let pairs = tokens as usize * self.plan.shape.top_k as usize;
        let ids = read_words(
            &rank.compute,
            workspace(&rank.workspace, BufferId::RoutedIds)?,
            pairs,
        )?;
        let weights = read_words(
            &rank.compute,
            workspace(&rank.workspace, BufferId::RoutedWeights)?,
            pairs,
        )?;
        Ok((ids, weights))
    }

    /// Checks a caller-routed call's arguments and resolves them to device addresses.
    fn caller_routed_calls(
        &self,
        args: &mut [ForwardArgs<'_>],
    ) -> Result<Vec<RankCall>, LayerError> {
        let shape = &self.plan.shape;
        self.check_rank_count(args.len())?;
        args.iter()
            .zip(&self.ranks)
            .map(|(a, rank)| {
                a.check(shape.hidden, shape.top_k)?;
                let stream = &rank.comm;
                Ok(RankCall {
                    tokens: a.tokens,
                    x: ptr(a.x, stream),
                    y: ptr(a.y, stream),
                    topk_ids: ptr(a.topk_ids, stream),
                    topk_weights: ptr(a.topk_weights, stream),
                })
            })
            .collect()
    }

    /// Enqueues one call on `calls` (see [`EpLayer::forward`]); with `routed`, each rank's
    /// router first.
    fn forward_calls(&mut self, calls: &[RankCall], routed: bool) -> Result<(), LayerError> {
        self.make_network_room()?;
        let regimes = self.begin_call(calls)?;
        let withheld = self.withheld.take();
        // Each rank's router first, on its compute stream, which the communication stream
        // then waits for with the rest of that stream's work: no kernel of the rank's call
        // spins on a flag meanwhile, so the router has the rank's SMs.
        if routed {
            for (r, call) in calls.iter().enumerate() {
                self.enqueue_router(r, call)?;
            }
        }
        for rank in &self.ranks {
            rank.comm
                .join(&rank.compute)
                .context("ordering communication after the previous call")?;
        }
        // The kernels restage the outboxes only after the last call's sends (or copies),
        // the combine refills the return outbox only after the last call's partials went,
        // and the receives land only after the last call's kernels read the inboxes: the
        // same joins for a rank's network stream as for the loopback of every rank.
        let network_stream = self
            .network()
            .map(NetworkPath::stream)
            .or(self.loopback.as_ref().map(LoopbackPath::stream));
        if let Some(stream) = network_stream {
            for rank in &self.ranks {
                rank.comm
                    .join(stream)
                    .context("ordering the staging after the last call's sends")?;
                rank.compute
                    .join(stream)
                    .context("ordering the combine after the last call's partials went")?;
            }
            for rank in &self.ranks {
                stream
                    .join(&rank.compute)
                    .context("ordering the receives after the last call's kernels")?;
            }
        }
        if let Some(regime) = self.fused_regime(calls, withheld) {
            for (r, call) in calls.iter().enumerate() {
                self.enqueue_fused(r, call, regime)?;
            }
            return Ok(());
        }
        // Communication first on every rank: the compute kernels wait on it.
        for (r, call) in calls.iter().enumerate() {
            if withheld != Some(r) {
                self.enqueue(r, call, regimes[r], |l| l.stream == StreamRole::Comm)?;
            }
        }
        // Then the network's metadata step (it waits on the device for the flags the kernels
        // release for it) and the dispatch chunk steps: whole chunks where the plan moves
        // them at the call's bound, else sized by the rows per chunk the host reads back
        // after the metadata step (its one wait per call); only then the compute kernels,
        // and the return steps last. Streams share the device's hardware queues
        // (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set), and a command that waits before it
        // starts (a launch behind its stream's unfinished kernel, an event or value wait)
        // holds back what is queued behind it: no such command may wait for one enqueued
        // after it (a kernel already launched may spin on a later release). With the chunk
        // steps after the compute kernels, a GEMM2 queued ahead of them waited for its GEMM1,
        // which waited for their rows (8 virtual ranks emulating 2 nodes of 4 hung so on an
        // H200, 2026-12-05). A withheld rank sends nothing, as a dead one would; on emulated
        // nodes a loopback waiting for it would wait for ever, so the call's network traffic
        // is left out on every rank (every wait for it times out, as if the network had
        // failed).
        let network = self.network().filter(|_| withheld != Some(0));
        let loopback = self.loopback.as_ref().filter(|_| withheld.is_none());
        if let Some(network) = network {
            network.enqueue_metadata(self.epoch, self.tokens_bound)?;
            network.enqueue_dispatch(self.epoch)?;
        }
        if let Some(loopback) = loopback {
            loopback.enqueue_metadata(self.epoch, self.tokens_bound)?;
            loopback.enqueue_dispatch(self.epoch)?;
        }
        let compute = calls.iter().enumerate().try_for_each(|(r, call)| {
            self.enqueue(r, call, regimes[r], |l| l.stream == StreamRole::Compute)
        });
        if let Some(network) = network
            && compute.is_err()
        {
            // Its dispatch groups went without the call's return groups: out of step with
            // its peers from now on.
            network.abandon();
        }
        compute?;
        if let Some(network) = network {
            network.enqueue_results(self.epoch)?;
        }
        if let Some(loopback) = loopback {
            loopback.enqueue_results(self.epoch)?;
        }
        for rank in &self.ranks {
            rank.compute
                .join(&rank.comm)
                .context("joining the communication stream")?;
        }
        Ok(())
    }

    /// Enqueues one call of the bulk-synchronous variant, the baseline the overlapped
    /// schedule is measured against: the same kernels, with every rank waiting for every
    /// rank between the stages (metadata and dispatch; arrange and both GEMMs; combine), so
    /// no stage overlaps another and the flag waits of arrange and the GEMMs find their
    /// flags already set (on emulated nodes a relay's dispatch waits for the loopback's
    /// steps within the dispatch stage, and the combine's second pass for the partials'
    /// copies within the combine stage). With pair rows GEMM2's stores into the origins'
    /// combine slots stay in the GEMM stage; with rank partials GEMM2 stores locally and the
    /// partials cross in the combine stage. With `marks`, records the stage boundaries on
    /// rank 0 (see [`StageMarks`]).
    pub fn forward_bulk_synchronous(
        &mut self,
        args: &mut [ForwardArgs<'_>],
        marks: Option<&StageMarks>,
    ) -> Result<(), LayerError> {
        if self.group.is_some() {
            // Its barriers are stream events, which do not cross processes.
            return Err(LayerError::BulkSynchronousInGroup);
        }
        self.make_network_room()?;
        let calls = self.caller_routed_calls(args)?;
        let regimes = self.begin_call(&calls)?;
        let combine = self.ep.combine_kernel.clone();
        let streams = |role: StreamRole| -> Vec<Arc<CudaStream>> {
            self.ranks
                .iter()
                .map(|rank| match role {
                    StreamRole::Comm => Arc::clone(&rank.comm),
                    StreamRole::Compute => Arc::clone(&rank.compute),
                })
                .collect()
        };
        let (comm, compute) = (streams(StreamRole::Comm), streams(StreamRole::Compute));
        let loopback = self
            .loopback
            .as_ref()
            .map(|l| (l, std::slice::from_ref(l.stream())));
        // The previous call is over on every rank before any rank starts this one.
        barrier(&compute, &comm)?;
        if let Some((_, stream)) = loopback {
            barrier(&compute, stream)?;
        }
        mark(marks, 0, &comm[0])?;
        for (r, a) in calls.iter().enumerate() {
            if r == 0 && marks.is_some() {
                // Rank 0's metadata, then its token rows, each followed by a mark.
                let route = &self.ep.route_kernel;
                self.enqueue(r, a, regimes[r], |l| &l.kernel == route)?;
                mark(marks, 1, &comm[0])?;
                self.enqueue(r, a, regimes[r], |l| {
                    l.stream == StreamRole::Comm && &l.kernel != route
                })?;
                mark(marks, 2, &comm[0])?;
            } else {
                self.enqueue(r, a, regimes[r], |l| l.stream == StreamRole::Comm)?;
            }
        }
        // Emulated nodes: the network's metadata and dispatch steps are part of the dispatch
        // stage, beside the dispatch kernels (each waits on the flags those release, and a
        // relay's kernel forwards what they bring).
        if let Some((loopback, stream)) = loopback {
            loopback.enqueue_metadata(self.epoch, self.tokens_bound)?;
            loopback.enqueue_dispatch(self.epoch)?;
            barrier(stream, &compute)?;
        }
        barrier(&comm, &compute)?;
        mark(marks, 3, &compute[0])?;
        for (r, a) in calls.iter().enumerate() {
            let regime = &self.ep.regimes[regimes[r]];
            // With marks, every rank's arrange (after the shared expert gate, where the
            // layer has one), GEMM1 and GEMM2 one at a time: rank 0's followed by the
            // stage marks, every rank's GEMM1 between its own two events.
            let shared_gate = self.plan.shared_gate_kernel.as_ref();
            let steps: [&dyn Fn(&Launch) -> bool; 3] = [
                &|l| l.kernel == self.ep.arrange_kernel || Some(&l.kernel) == shared_gate,
                &|l| l.kernel == regime.gemm1_kernel,
                &|l| l.kernel == regime.gemm2_kernel,
            ];
            if let Some(marks) = marks {
                for (step, chosen) in steps.iter().enumerate() {
                    self.enqueue(r, a, regimes[r], chosen)?;
                    if step < 2 {
                        if r == 0 {
                            mark(Some(marks), 4 + step, &compute[0])?;
                        }
                        marks.gemm1_per_rank[r][step]
                            .record(&compute[r])
                            .context("recording a rank's GEMM1 mark")?;
                    }
                }
            } else {
                self.enqueue(r, a, regimes[r], |l| {
                    l.stream == StreamRole::Compute && l.kernel != combine
                })?;
            }
        }
        barrier(&compute, &compute)?;
        mark(marks, 6, &compute[0])?;
        for (r, a) in calls.iter().enumerate() {
            self.enqueue(r, a, regimes[r], |l| l.kernel == combine)?;
        }
        // Emulated nodes: the partials' copies are part of the combine stage, between its
        // two passes (the copies wait for the first, the second for them): no barrier.
        // Enqueued after the combine kernels, which a waiting copy step must not hold back
        // in a hardware queue they share (see `forward_calls`).
        if let Some((loopback, _)) = loopback {
            loopback.enqueue_results(self.epoch)?;
        }
        if marks.is_some() {
            barrier(&compute, &compute[..1])?;
            mark(marks, 7, &compute[0])?;
        }
        Ok(())
    }

    /// Raises the epoch and returns each rank's regime for `calls` (checked already).
    fn begin_call(&mut self, calls: &[RankCall]) -> Result<Vec<usize>, LayerError> {
        let shape = &self.plan.shape;
        let mut regimes = Vec::with_capacity(calls.len());
        for (a, rank) in calls.iter().zip(&self.ranks) {
            if a.tokens > self.tokens_bound {
                return Err(LayerError::BeyondTokensBound {
                    rank: rank.index,
                    tokens: a.tokens,
                    bound: self.tokens_bound,
                });
            }
            regimes.push(
                self.ep
                    .regime_index_for(a.tokens)
                    .ok_or(LayerError::TooManyTokens {
                        tokens: a.tokens,
                        max: shape.max_tokens,
                    })?,
            );
        }
        // Wraps through 0 like every flag: a flag compares by signed difference, so after
        // 0xFFFFFFFF comes 0 (skipping it would leave a credit of 0xFFFFFFFF one short of
        // the 0 the next call waits for).
        self.epoch = self.epoch.wrapping_add(1);
        Ok(regimes)
    }

    /// Enqueues rank `r`'s router launches for `call`'s token count on its compute stream
    /// (none at T = 0: nothing to route).
    fn enqueue_router(&self, r: usize, call: &RankCall) -> Result<(), LayerError> {
        let rank = &self.ranks[r];
        let router = self.plan.router.as_ref().ok_or(LayerError::NoRouter)?;
        let index = self
            .plan
            .regime_index_for(call.tokens)
            .ok_or(LayerError::TooManyTokens {
                tokens: call.tokens,
                max: self.plan.shape.max_tokens,
            })?;
        if call.tokens == 0 {
            return Ok(());
        }
        let regime = &router.regimes[index];
        for launch in regime.launches_for(call.tokens) {
            let (function, bindings) = &rank.router_kernels[index][launch];
            self.launch(
                rank,
                &rank.compute,
                &regime.launches[launch],
                function,
                bindings,
                call,
            )?;
        }
        Ok(())
    }

    /// The regime whose fused decode runs this call on every rank: where this process
    /// drives every rank (so that all of them take the same path), the switch is on and
    /// the regime of the largest call fuses calls that large. A withheld rank's call (fault
    /// injection) takes the table, whose communication can be left out.
    fn fused_regime(&self, calls: &[RankCall], withheld: Option<usize>) -> Option<usize> {
        self.fused_regime_for(calls.iter().map(|call| call.tokens), withheld)
    }

    /// [`EpLayer::fused_regime`] of a call of `tokens` tokens on each rank this process
    /// drives. A rank process sees only its own count, so a group decides from the tokens
    /// bound its ranks agreed on, the same on every rank and at least every rank's count.
    fn fused_regime_for(
        &self,
        tokens: impl Iterator<Item = u32>,
        withheld: Option<usize>,
    ) -> Option<usize> {
        if !self.fused_decode || withheld.is_some() {
            return None;
        }
        let most = if self.group.is_some() {
            self.tokens_bound
        } else {
            tokens.max()?
        };
        let regime = self.ep.regime_index_for(most)?;
        self.ep.regimes[regime].fuses(most).then_some(regime)
    }

    /// Whether a call of `tokens[r]` tokens on rank `r` runs the ranks' fused decode
    /// (docs/runtime.md) rather than the table.
    pub fn runs_fused(&self, tokens: &[u32]) -> bool {
        self.fused_regime_for(tokens.iter().copied(), self.withheld)
            .is_some()
    }

    /// Enqueues rank `r`'s fused decode of `regime` on its compute stream.
    fn enqueue_fused(&self, r: usize, call: &RankCall, regime: usize) -> Result<(), LayerError> {
        let rank = &self.ranks[r];
        let plan_regime = &self.ep.regimes[regime];
        let fused = plan_regime
            .fused_decode
            .as_ref()
            .ok_or_else(|| LayerError::MissingKernel {
                name: format!("the fused decode of rank regime `{}`", plan_regime.name),
            })?;
        let (function, bindings) = &rank.regime_kernels[regime][plan_regime.launches.len()];
        self.launch(rank, &rank.compute, &fused.launch, function, bindings, call)
    }

    /// Enqueues rank `r`'s launches of `regime` that `chosen` picks, each on its stream.
    fn enqueue(
        &self,
        r: usize,
        a: &RankCall,
        regime: usize,
        chosen: impl Fn(&Launch) -> bool,
    ) -> Result<(), LayerError> {
        let rank = &self.ranks[r];
        for (launch, (function, bindings)) in self.ep.regimes[regime]
            .launches
            .iter()
            .zip(&rank.regime_kernels[regime])
        {
            if !chosen(launch) {
                continue;
            }
            let stream = match launch.stream {
                StreamRole::Comm => &rank.comm,
                StreamRole::Compute => &rank.compute,
            };
            self.launch(rank, stream, launch, function, bindings, a)?;
        }
        Ok(())
    }

    /// Enqueues `launch` of `rank` on `stream` with `call`'s values; a launch whose grid
    /// is empty (blocks per token at T = 0) is skipped. None starts early, the router's
    /// included (whose single-GPU launches may): its blocks would wait beside the previous
    /// call's spinning ones, outside the residency bound.
    fn launch(
        &self,
        rank: &Rank,
        stream: &CudaStream,
        launch: &Launch,
        function: &CudaFunction,
        bindings: &[Binding],
        call: &RankCall,
    ) -> Result<(), LayerError> {
        let blocks = launch.grid.blocks(call.tokens);
        if blocks == 0 {
            return Ok(());
        }
        let gate = rank.gate.as_ref();
        let values: Vec<ArgValue> = bindings
            .iter()
            .map(|binding| match *binding {
                Binding::X => ArgValue::Pointer(call.x),
                Binding::TopkIds => ArgValue::Pointer(call.topk_ids),
                Binding::TopkWeights => ArgValue::Pointer(call.topk_weights),
                Binding::Y => ArgValue::Pointer(call.y),
                Binding::Tokens => ArgValue::Int(call.tokens as i32),
                Binding::W1 => ArgValue::Pointer(ptr(&rank.weights.w1, stream)),
                Binding::W2 => ArgValue::Pointer(ptr(&rank.weights.w2, stream)),
                // `build_rank` checked that the weights hold biases exactly when the layer
                // has them, which is when the plan's launches take them.
                Binding::W1Bias => ArgValue::Pointer(rank.weights.bias_pointer(true, stream)),
                Binding::W2Bias => ArgValue::Pointer(rank.weights.bias_pointer(false, stream)),
                Binding::SharedExpertGate => {
                    ArgValue::Pointer(rank.weights.shared_gate_pointer(stream))
                }
                Binding::Rank => ArgValue::Int(rank.index as i32),
                Binding::Epoch => ArgValue::Int(self.epoch as i32),
                Binding::Workspace(i) => {
                    ArgValue::Pointer(ptr(rank.workspace[i].1.slice(), stream))
                }
                Binding::TensorMap(i) => ArgValue::TensorMap(rank.tensor_maps[i].1),
                // Router launches are bound only with a gate (`with_router` checked that it
                // has a bias exactly where the rule takes one).
                Binding::GateWeight => {
                    ArgValue::Pointer(gate.map_or(0, |g| ptr(&g.weight, stream)))
                }
                Binding::GateBias => ArgValue::Pointer(
                    gate.and_then(|g| g.bias.as_ref())
                        .map_or(0, |bias| ptr(bias, stream)),
                ),
                Binding::NoRoutingLayout => ArgValue::Int(0),
                Binding::Unused => ArgValue::Pointer(0),
            })
            .collect();
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (launch.block_threads, 1, 1),
            shared_mem_bytes: launch.smem_bytes,
        };
        // SAFETY: codegen wrote this kernel's parameters from `launch.params` (pointers
        // for buffers, 32-bit integers for tokens, rank, epoch and the router's layout
        // switch, tensor maps by value over this rank's weights or gate); `new` validated
        // the plan and sized every workspace buffer from it, the caller's buffers were
        // checked in `forward` or `forward_routed`, and a router told to lay out no
        // metadata never touches the null pointers of its metadata buffers.
        unsafe { launch_with(stream, function, config, &values, false) }.context(format!(
            "launching `{}` on rank {}",
            launch.kernel, rank.index
        ))?;
        Ok(())
    }

    /// Every rank's error word (code, then details), after waiting for every rank: for
    /// diagnosing a time-out, where one rank's wait is the symptom of another's.
    pub fn error_words(&self) -> Result<Vec<[i32; 4]>, LayerError> {
        self.synchronize()?;
        self.read_error_words()
    }

    /// Every rank's error word, read on its compute stream.
    fn read_error_words(&self) -> Result<Vec<[i32; 4]>, LayerError> {
        self.ranks
            .iter()
            .map(|rank| {
                read_error_word(
                    &rank.compute,
                    workspace(&rank.workspace, BufferId::ErrorWord)?,
                )
            })
            .collect()
    }

    /// Waits for every rank, reads and reports the first kernel error of any rank (a
    /// time-out lists every other rank's timed-out wait beside it). After a
    /// time-out the ranks' flags disagree: this also zeroes every rank's exchange state
    /// (`plan::ep::EXCHANGE_STATE`) and restarts the epochs, so the next call starts clean.
    ///
    /// In a group of rank processes it reports this process's rank's error, and is a
    /// meeting point: every rank calls it after the same calls, and the ranks agree over
    /// the control channel whether any timed out; if one did, every rank restarts its
    /// exchange. A peer that has exited cannot agree: this rank's own error (its time-out)
    /// is still what is reported.
    pub fn take_error(&mut self) -> Result<(), LayerError> {
        if self.group.is_some() {
            return self.take_group_error();
        }
        // A stalled loopback has released its flags by the time it reports: the ranks'
        // streams drain, their errors are read, and the exchange restarts.
        let stalled = self.loopback.as_ref().and_then(|l| l.wait().err());
        let words = self.error_words()?;
        let mut errors: Vec<LayerError> = words
            .into_iter()
            .filter_map(|word| kernel_error(word, self.plan.shape.experts).err())
            .collect();
        if let Some(network) = stalled {
            self.restart_exchange()?;
            return Err(LayerError::NetworkStalled {
                network,
                kernel: (!errors.is_empty()).then(|| Box::new(errors.remove(0))),
            });
        }
        if errors.is_empty() {
            return Ok(());
        }
        let mut first = errors.remove(0);
        let later_waits = errors.into_iter().filter_map(|e| match e {
            LayerError::FlagTimeout { wait, .. } => Some(wait),
            _ => None,
        });
        match &mut first {
            LayerError::FlagTimeout { others, .. } => {
                others.0.extend(later_waits);
                self.restart_exchange()?;
            }
            _ if later_waits.count() > 0 => self.restart_exchange()?,
            _ => {}
        }
        Err(first)
    }

    /// Every rank's error word once its streams are idle, without synchronising: `None`
    /// if they are still busy after `limit` (waiting on a stalled network stream).
    fn error_words_once_idle(&self, limit: Duration) -> Option<Vec<[i32; 4]>> {
        let deadline = Instant::now() + limit;
        let idle = self.ranks.iter().all(|rank| {
            [&rank.comm, &rank.compute]
                .into_iter()
                .all(|stream| network::idle_by(stream, deadline).unwrap_or(false))
        });
        if !idle {
            return None;
        }
        self.read_error_words().ok()
    }

    /// [`EpLayer::take_error`] for this process's rank of a group.
    fn take_group_error(&mut self) -> Result<(), LayerError> {
        if let Some(network) = self.network()
            && let Err(stalled) = network.wait()
        {
            // The kernels' waits are bounded, but a call enqueued after the stalled one made
            // this rank's streams wait on the stuck network stream: read the error word
            // only if they drain within the wait bound.
            let kernel = self
                .error_words_once_idle(network.wait_limit())
                .and_then(|words| {
                    words
                        .into_iter()
                        .find_map(|word| kernel_error(word, self.plan.shape.experts).err())
                })
                .map(Box::new);
            return Err(LayerError::NetworkStalled {
                network: stalled,
                kernel,
            });
        }
        let words = self.error_words()?;
        let error = words
            .into_iter()
            .find_map(|word| kernel_error(word, self.plan.shape.experts).err());
        let timed_out = matches!(error, Some(LayerError::FlagTimeout { .. }));
        let Some(group) = &mut self.group else {
            return error.map_or(Ok(()), Err);
        };
        let agreed = group.channel.all_gather(&[u8::from(timed_out)]);
        let any_timed_out = match agreed {
            Ok(votes) => votes.iter().any(|vote| vote.first() == Some(&1)),
            // A lost peer: this rank's own error says what happened to its call.
            Err(lost) => return Err(error.unwrap_or(ipc::GroupError::from(lost).into())),
        };
        if any_timed_out {
            self.restart_exchange()?;
        }
        error.map_or(Ok(()), Err)
    }

    /// Zeroes every rank's exchange state and restarts the epochs at 1. Every rank's
    /// streams must be idle (the caller synchronised). In a group, returns once every
    /// rank has zeroed its state, so no rank's next call finds a peer's stale flags.
    fn restart_exchange(&mut self) -> Result<(), LayerError> {
        for rank in &mut self.ranks {
            for (id, memory) in &mut rank.workspace {
                if EXCHANGE_STATE.contains(id) {
                    rank.compute
                        .memset_zeros(memory.slice_mut())
                        .context(format!("zeroing `{}` after a time-out", id.name()))?;
                }
            }
        }
        self.synchronize()?;
        self.epoch = 0;
        if let Some(group) = &mut self.group {
            group.channel.barrier().map_err(ipc::GroupError::from)?;
        }
        Ok(())
    }

    /// Fault injection, for testing the time-out path: the next call launches nothing on
    /// `rank`'s communication stream (nor, across nodes, on its network stream), as if that
    /// rank had died before sending. Its peers' waits (and its own, for its local rows)
    /// time out; `take_error` reports the first.
    pub fn withhold_sends_once(&mut self, rank: usize) {
        self.withheld = Some(rank);
    }

    /// Whether this process's network path was abandoned after a stalled transfer (its
    /// stream stays blocked on it: the process should leave rather than tear down).
    pub fn network_abandoned(&self) -> bool {
        self.network().is_some_and(|network| network.abandoned())
    }

    /// This process's network path, when its rank has peers on other nodes.
    fn network(&self) -> Option<&NetworkPath> {
        self.group.as_ref().and_then(|group| group.network.as_ref())
    }

    /// Before a call across nodes: refuses an abandoned network path, and waits (bounded)
    /// until its stream (or the loopback's) holds fewer than `network::CALLS_AHEAD` calls,
    /// so that the host never runs further ahead of a stream that may wait for a lost peer
    /// (a call moving whole chunks has no host wait of its own).
    fn make_network_room(&self) -> Result<(), LayerError> {
        if let Some(network) = self.network() {
            network.make_room()?;
        }
        if let Some(loopback) = &self.loopback {
            loopback.make_room()?;
        }
        Ok(())
    }
}

/// Makes the rows of `table` (rank `me`'s peer table) of its peers on other nodes zeros,
/// one per peer buffer of `ep`: the kernels reach those peers only through the network
/// steps (a stray use faults at once).
fn out_of_reach(table: &mut [Vec<u64>], ep: &ExpertParallelPlan, network: &NetworkPlan, me: u32) {
    for peer in network.peers(me, ep.ranks) {
        table[peer as usize] = vec![0; ep.peer_buffers.len()];
    }
}

/// The loopback of emulated nodes over `ranks` (virtual ranks on `ctx`'s device) for
/// `network`, on a stream of its own with a side stream.
fn loopback(
    plan: &Plan,
    ep: &ExpertParallelPlan,
    network: &NetworkPlan,
    ranks: &[Rank],
    ctx: &Arc<CudaContext>,
) -> Result<LoopbackPath, LayerError> {
    let stream = ctx.new_stream().context("creating the loopback stream")?;
    let side = ctx
        .new_stream()
        .context("creating the loopback's side stream")?;
    let buffer = |rank: u32, id: BufferId| {
        let rank = &ranks[rank as usize];
        let slice = workspace(&rank.workspace, id)
            .map_err(|_| NetworkError::MissingBuffer { buffer: id.name() })?;
        Ok((ptr(slice, &rank.compute), slice.len() as u64))
    };
    Ok(LoopbackPath::new(
        stream,
        side,
        ep,
        network,
        &plan.shape,
        buffer,
    )?)
}

impl Drop for EpLayer {
    /// In a group, waits for the peers before the buffers they write are freed: a peer may
    /// still be returning credits into them after this rank's last call ended.
    fn drop(&mut self) {
        if self.loopback.is_some() && self.synchronize().is_err() {
            // `synchronize` released a stalled loopback's flags; past that, a stuck copy
            // may still write the ranks' workspace: leak it rather than free it under it.
            if self
                .loopback
                .as_ref()
                .is_some_and(|loopback| loopback.abandoned())
            {
                std::mem::forget(std::mem::take(&mut self.ranks));
                std::mem::forget(self.loopback.take());
                return;
            }
        }
        if self.network_abandoned() {
            // A stuck NCCL transfer still reads and writes this rank's workspace, and
            // freeing device memory would wait for it: leak the ranks (streams, workspace)
            // and the group; the process is expected to leave (see `moeforge run`).
            std::mem::forget(std::mem::take(&mut self.ranks));
            std::mem::forget(self.group.take());
            return;
        }
        if self.group.is_some() {
            let _ = self.synchronize();
        }
        if let Some(group) = &mut self.group {
            // A peer that has exited cannot meet: nothing to wait for then. Nor can it join
            // the tear-down of the communicator (a collective of the node's ranks), which
            // is then left as it is.
            if group.channel.barrier().is_err()
                && let Some(network) = &group.network
            {
                network.abandon();
            }
        }
    }
}

/// The plan's expert-parallel part, after validating the plan.
fn expert_parallel_part(plan: &Plan) -> Result<ExpertParallelPlan, LayerError> {
    plan.validate()?;
    plan.expert_parallel
        .clone()
        .ok_or(LayerError::NotExpertParallel)
}

/// Builds rank `index` on `ctx`: streams, zeroed workspace (the buffers peers write
/// exportable to other processes when `exportable`), resolved launches, kernels loaded.
fn build_rank(
    plan: &Plan,
    ep: &ExpertParallelPlan,
    index: u32,
    ctx: &Arc<CudaContext>,
    module: LoadedKernels,
    weights: ExpertWeights,
    exportable: bool,
) -> Result<Rank, LayerError> {
    // The rank's routed experts, then the shared slices it runs on its own tokens.
    let experts_here = ep.experts_per_rank + plan.shape.shared_slices;
    weights.check(&plan.shape, experts_here)?;
    let compute = ctx.new_stream().context("creating a compute stream")?;
    let comm = ctx
        .new_stream()
        .context("creating a communication stream")?;
    let mut workspace = Vec::new();
    for buffer in &ep.workspace {
        let bytes = (buffer.bytes() as usize).max(1);
        let what = || format!("allocating `{}` ({bytes} bytes)", buffer.id.name());
        // Zeroed: flags and counters start below every epoch and at zero.
        let memop_flag = STREAM_MEMOP_FLAGS.contains(&buffer.id);
        let plain = ep.peer_buffers.contains(&buffer.id) || memop_flag;
        // The flags a network or loopback stream waits on are `cuMemAlloc`ed (see
        // `STREAM_MEMOP_FLAGS`) whether or not other processes map them.
        let memory = if (exportable && plain) || (memop_flag && ep.network.is_some()) {
            WorkspaceMemory::Exportable(ExportableBuffer::zeroed(&compute, bytes)?)
        } else {
            WorkspaceMemory::Pool(compute.alloc_zeros::<u8>(bytes).context(what())?)
        };
        workspace.push((buffer.id, memory));
    }
    let mut tensor_maps = WeightTensorMaps {
        shape: &plan.shape,
        experts: experts_here,
        weights: &weights,
        gate_weight: None,
        stream: &compute,
        maps: Vec::new(),
    };
    let mut regime_kernels = Vec::new();
    let mut loaded = Vec::new();
    for regime in &ep.regimes {
        let mut launches = Vec::new();
        for launch in regime.all_launches() {
            let function = load_kernel(&module, &mut loaded, launch)?;
            load_now(ctx, &function, &launch.kernel)?;
            let bindings = launch
                .params
                .iter()
                .map(|p| bind(p.arg, &workspace, &mut tensor_maps))
                .collect::<Result<Vec<_>, _>>()?;
            launches.push((function, bindings));
        }
        regime_kernels.push(launches);
    }
    let tensor_maps = tensor_maps.maps;
    Ok(Rank {
        index,
        compute,
        comm,
        workspace,
        weights,
        tensor_maps,
        regime_kernels,
        gate: None,
        router_kernels: Vec::new(),
        module,
    })
}

/// Every stream of `waiters` waits for the work enqueued so far on every stream of
/// `producers` (events work across devices of one process).
fn barrier(producers: &[Arc<CudaStream>], waiters: &[Arc<CudaStream>]) -> Result<(), LayerError> {
    let events = producers
        .iter()
        .map(|stream| stream.record_event(None))
        .collect::<Result<Vec<_>, _>>()
        .context("recording a stage boundary")?;
    for waiter in waiters {
        for event in &events {
            waiter.wait(event).context("waiting for a stage boundary")?;
        }
    }
    Ok(())
}

fn mark(marks: Option<&StageMarks>, index: usize, stream: &CudaStream) -> Result<(), LayerError> {
    if let Some(marks) = marks {
        marks.events[index]
            .record(stream)
            .context("recording a stage mark")?;
    }
    Ok(())
}

/// Timing events of one bulk-synchronous call on rank 0, each after a barrier of every
/// rank (start, dispatch done, GEMMs done, combine done) or after one of rank 0's kernels
/// (metadata done, token rows sent, arrange done, GEMM1 done).
pub struct StageMarks {
    events: Vec<CudaEvent>,
    /// Per rank, in its context: before and after its GEMM1.
    gemm1_per_rank: Vec<[CudaEvent; 2]>,
}

const STAGE_MARKS: usize = 8;

/// The stages of one bulk-synchronous call, in µs, across all ranks.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StageTimes {
    /// Metadata and token rows to every rank.
    pub dispatch_us: f64,
    /// Arrange and both GEMMs (GEMM2 stores results into the origins' combine slots).
    pub gemm_us: f64,
    /// The reduce at the origin.
    pub combine_us: f64,
}

/// Rank 0's part of the dispatch stage of one bulk-synchronous call, kernel by kernel, in
/// µs: what the stage's barrier adds is the rest of the stage.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DispatchStageSplit {
    /// The metadata kernel (counts and receive index to every destination).
    pub metadata_us: f64,
    /// The token rows to every peer.
    pub rows_us: f64,
}

/// Rank 0's part of the GEMM stage of one bulk-synchronous call, kernel by kernel, in µs.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct GemmStageSplit {
    pub arrange_us: f64,
    pub gemm1_us: f64,
    /// GEMM2 until every rank's GEMMs are done (the stage's barrier).
    pub gemm2_us: f64,
}

impl StageMarks {
    /// Timing events in the context of the layer's rank 0.
    pub fn new(layer: &EpLayer) -> Result<Self, LayerError> {
        // A timing event in the context of `rank`'s stream.
        let event = |rank: &Rank| {
            rank.compute
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .context("creating a timing event")
        };
        Ok(StageMarks {
            events: (0..STAGE_MARKS)
                .map(|_| event(&layer.ranks[0]))
                .collect::<Result<_, _>>()?,
            gemm1_per_rank: layer
                .ranks
                .iter()
                .map(|rank| Ok([event(rank)?, event(rank)?]))
                .collect::<Result<_, LayerError>>()?,
        })
    }

    fn us(&self, from: usize, to: usize) -> Result<f64, LayerError> {
        elapsed_us(&self.events[from], &self.events[to])
    }

    /// The stage times of the call that recorded these marks (waits for it).
    pub fn times(&self) -> Result<StageTimes, LayerError> {
        Ok(StageTimes {
            dispatch_us: self.us(0, 3)?,
            gemm_us: self.us(3, 6)?,
            combine_us: self.us(6, 7)?,
        })
    }

    /// Rank 0's dispatch stage of the call that recorded these marks, kernel by kernel.
    pub fn dispatch_split(&self) -> Result<DispatchStageSplit, LayerError> {
        Ok(DispatchStageSplit {
            metadata_us: self.us(0, 1)?,
            rows_us: self.us(1, 2)?,
        })
    }

    /// Every rank's GEMM1 in the call that recorded these marks, in µs by rank (the
    /// simulator predicts each; the stage marks time rank 0's alone).
    pub fn gemm1_per_rank_us(&self) -> Result<Vec<f64>, LayerError> {
        self.gemm1_per_rank
            .iter()
            .map(|[start, end]| elapsed_us(start, end))
            .collect()
    }

    /// Rank 0's GEMM stage of the call that recorded these marks, kernel by kernel.
    pub fn gemm_split(&self) -> Result<GemmStageSplit, LayerError> {
        Ok(GemmStageSplit {
            arrange_us: self.us(3, 4)?,
            gemm1_us: self.us(4, 5)?,
            gemm2_us: self.us(5, 6)?,
        })
    }
}

/// Microseconds from `start` to `end`, two timing events of one context.
fn elapsed_us(start: &CudaEvent, end: &CudaEvent) -> Result<f64, LayerError> {
    Ok(f64::from(start.elapsed_ms(end).context("reading a stage mark")?) * 1e3)
}

/// Writes `rank`'s peer table: row `d` holds rank `d`'s addresses, valid on `rank`'s
/// device, of the buffers peers write, in the plan's order.
fn write_peer_table(rank: &mut Rank, table: &[Vec<u64>]) -> Result<(), LayerError> {
    let bytes: Vec<u8> = table
        .iter()
        .flatten()
        .flat_map(|a| a.to_le_bytes())
        .collect();
    let slot = rank
        .workspace
        .iter_mut()
        .find(|(b, _)| *b == BufferId::PeerTable)
        .map(|(_, memory)| memory.slice_mut())
        .ok_or(LayerError::MissingWorkspace {
            buffer: BufferId::PeerTable.name(),
        })?;
    // A short row would shift every later one: the kernels would read wrong addresses.
    if bytes.len() != slot.len() || table.iter().any(|row| row.len() != table[0].len()) {
        return Err(LayerError::PeerTableSize {
            bytes: bytes.len(),
            expected: slot.len(),
        });
    }
    rank.compute
        .memcpy_htod(&bytes, slot)
        .context("uploading the peer table")?;
    Ok(())
}

fn workspace(
    buffers: &[(BufferId, WorkspaceMemory)],
    id: BufferId,
) -> Result<&CudaSlice<u8>, LayerError> {
    buffers
        .iter()
        .find(|(b, _)| *b == id)
        .map(|(_, memory)| memory.slice())
        .ok_or(LayerError::MissingWorkspace { buffer: id.name() })
}

fn bind(
    arg: LaunchArg,
    workspace: &[(BufferId, WorkspaceMemory)],
    tensor_maps: &mut WeightTensorMaps<'_>,
) -> Result<Binding, LayerError> {
    Ok(match arg {
        LaunchArg::W1 => Binding::W1,
        LaunchArg::W2 => Binding::W2,
        LaunchArg::W1Bias => Binding::W1Bias,
        LaunchArg::W2Bias => Binding::W2Bias,
        LaunchArg::SharedExpertGate => Binding::SharedExpertGate,
        LaunchArg::W1Tiles { .. } | LaunchArg::W2Tiles { .. } => {
            Binding::TensorMap(tensor_maps.position(arg)?)
        }
        LaunchArg::Rank => Binding::Rank,
        LaunchArg::Epoch => Binding::Epoch,
        LaunchArg::Workspace(id) => Binding::Workspace(
            workspace
                .iter()
                .position(|(b, _)| *b == id)
                .ok_or(LayerError::MissingWorkspace { buffer: id.name() })?,
        ),
        LaunchArg::X => Binding::X,
        LaunchArg::TopkIds => Binding::TopkIds,
        LaunchArg::TopkWeights => Binding::TopkWeights,
        LaunchArg::Y => Binding::Y,
        LaunchArg::Tokens => Binding::Tokens,
        LaunchArg::GateWeight
        | LaunchArg::GateWeightTiles { .. }
        | LaunchArg::GateBias
        | LaunchArg::IntermediateTiles { .. }
        | LaunchArg::SortedXTiles { .. }
        | LaunchArg::RoutesInBlocks
        | LaunchArg::LaysOutRouting => {
            return Err(LayerError::SingleGpuArg { arg: arg.name() });
        }
    })
}

/// [`bind`] for a router launch on a rank: its gate, no routing metadata (see
/// [`ROUTER_METADATA`]), the rest as the expert-parallel kernels bind them.
fn bind_router(
    arg: LaunchArg,
    workspace: &[(BufferId, WorkspaceMemory)],
    tensor_maps: &mut WeightTensorMaps<'_>,
) -> Result<Binding, LayerError> {
    Ok(match arg {
        LaunchArg::GateWeight => Binding::GateWeight,
        LaunchArg::GateBias => Binding::GateBias,
        LaunchArg::GateWeightTiles { .. } => Binding::TensorMap(tensor_maps.position(arg)?),
        LaunchArg::LaysOutRouting => Binding::NoRoutingLayout,
        LaunchArg::Workspace(id) if ROUTER_METADATA.contains(&id) => Binding::Unused,
        _ => bind(arg, workspace, tensor_maps)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_agrees_on_the_largest_tokens_bound() {
        let sent = |t: u32| t.to_le_bytes().to_vec();
        assert_eq!(
            agreed_tokens_bound(7, &[sent(7), sent(90), sent(0)]).unwrap(),
            90
        );
        assert_eq!(agreed_tokens_bound(5, &[]).unwrap(), 5);
        let error = agreed_tokens_bound(5, &[sent(5), vec![1, 2]]).unwrap_err();
        assert!(
            matches!(error, LayerError::TokensBoundMessage { bytes: 2 }),
            "{error}"
        );
    }

    /// A rank process's table from the IPC exchange has empty rows for peers on other
    /// nodes; they become whole rows of zeros, so later rows keep their places.
    #[test]
    fn peers_on_other_nodes_get_whole_rows_of_zeros() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../dsl-examples/tiny_emulated_nodes.moe"
        ))
        .expect("the example");
        let module = moeforge_compiler::compile_source("e.moe", &text).expect("checks");
        let plan = moeforge_compiler::plan::plan(
            &module.layers[0],
            &moeforge_compiler::plan::Target::h200(),
        )
        .expect("plans");
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel");
        let network = ep.network.as_ref().expect("a network part");
        let width = ep.peer_buffers.len();
        // Rank 1 (node 0): rank 0 mapped, ranks 2 and 3 on node 1 unmapped.
        let mut table = vec![vec![7; width], vec![1; width], Vec::new(), Vec::new()];
        out_of_reach(&mut table, ep, network, 1);
        assert_eq!(
            table,
            vec![
                vec![7; width],
                vec![1; width],
                vec![0; width],
                vec![0; width]
            ]
        );
    }
}
