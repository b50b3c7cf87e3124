//! Baseline (b) of the expert-parallel bench (issue 7): the pipeline a user assembles from
//! NCCL and a single-GPU MoE kernel. One process drives G GPUs, one rank per GPU, each
//! with its own NCCL communicator (cudarc's `nccl` feature, loaded at run time; a missing
//! library is [`NcclPipelineError::NoNccl`], never a panic). Per call, on every rank:
//!
//! 1. **Dispatch**: a pack kernel copies one row per (token, k) pair into a send buffer,
//!    grouped by destination rank and, within it, by local expert (expert `e` lives on rank
//!    `e / (E/G)`), with the pair's local expert index and routing weight; then an
//!    all-to-all of variable sizes, as NCCL send/recv pairs inside one
//!    `ncclGroupStart`/`ncclGroupEnd` covering every rank.
//! 2. **GEMMs**: moeforge's single-GPU layer, planned for this rank's `E/G` experts with
//!    top-1 routing, runs on the received rows (row id = local expert, weight = the pair's
//!    routing weight), so each row comes out already weighted.
//! 3. **Combine**: the all-to-all back (the same sizes, reversed), then a kernel sums each
//!    token's K returned rows in k order into `y` (deterministic).
//!
//! What it is not: a real pipeline. The routing is known on the host, so the host works out
//! the send counts and every pair's send row ([`DispatchLayout`]) and uploads the send
//! order once per routing ([`NcclPipeline::set_routing`]); [`NcclPipeline::forward`] then
//! enqueues a call with no host synchronisation. A real pipeline computes that layout on
//! the device and exchanges the counts first, one more all-to-all and a host
//! synchronisation per call (as `benches/ep_torch_baseline.py` does): this baseline leaves
//! those costs out, which favours it. A token bound for two experts of one rank crosses
//! the link twice (one row per pair). It runs on real GPUs only: NCCL puts one rank
//! per device, so virtual ranks are not supported.
//!
//! Timing ([`NcclPipeline::time`]): the whole call or one phase alone, with CUDA events on
//! rank 0 between cross-rank event barriers, so a time is the slowest rank's.
//!
//! NVLink multicast must stay off on the project's machines: [`NcclPipeline::new`] refuses
//! to create communicators unless `NCCL_NVLS_ENABLE=0` is set.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, group_end, group_start};
use moeforge_compiler::ir;
use moeforge_compiler::plan::{self, MAX_PAIRS, Plan, PlanError};
use thiserror::Error;

use crate::gpu::{DriverContext, Gpu, GpuError};
use crate::harness::{BuiltLayer, HarnessError, Session};
use crate::jit::{CompileOptions, JitError};
use crate::layer::{ForwardArgs, LayerError, MoeLayer};
use crate::weights::copy_experts;

#[derive(Debug, Error)]
pub enum NcclPipelineError {
    #[error(
        "NCCL could not be loaded: cudarc opens it as libnccl.so (or libnccl.so.<CUDA major>){}; install NCCL 2 and put its lib folder on LD_LIBRARY_PATH",
        versioned_hint(*.versioned)
    )]
    NoNccl {
        /// Whether `libnccl.so.2` itself could be opened.
        versioned: bool,
    },
    #[error("NCCL failed while {context}: {result}")]
    Nccl { context: String, result: String },
    #[error(
        "NCCL_NVLS_ENABLE is {value:?}; set NCCL_NVLS_ENABLE=0 before building the NCCL pipeline (NVLink multicast stays off on the project's machines)"
    )]
    MulticastNotOff { value: String },
    #[error("{given} {what} were given to an NCCL pipeline of {ranks} ranks")]
    RankCount {
        ranks: usize,
        given: usize,
        what: &'static str,
    },
    #[error("the layer's {experts} experts do not split evenly over {ranks} ranks")]
    ExpertsNotDivisible { experts: u32, ranks: usize },
    #[error(
        "ranks {first} and {second} are both on device {ordinal}: NCCL runs one rank per GPU, so this baseline needs one context per device"
    )]
    SharedDevice {
        first: usize,
        second: usize,
        ordinal: usize,
    },
    #[error(
        "the local layer would take {rows} rows per call (ranks x max_tokens x top_k), above the {max} pairs the kernels index; lower max_tokens"
    )]
    LocalTooLarge { rows: u64, max: u64 },
    #[error(
        "rank {rank}: topk_ids holds {len} entries, not a whole number of tokens of top_k = {top_k}"
    )]
    RaggedRouting { rank: usize, len: usize, top_k: u32 },
    #[error(
        "rank {rank}: topk_ids[{token}, {k}] = {id} is not an expert of this layer (valid ids are 0..{experts})"
    )]
    ExpertIdOutOfRange {
        rank: usize,
        token: usize,
        k: usize,
        id: i32,
        experts: u32,
    },
    #[error(
        "rank {rank}: {tokens} tokens exceed the layer's max_tokens of {max}; raise `max_tokens` in the spec or split the call"
    )]
    TooManyTokens { rank: usize, tokens: u32, max: u32 },
    #[error("no routing is set: call `set_routing` with the call's topk_ids first")]
    NoRouting,
    #[error(
        "rank {rank} was given {given} tokens but the routing was set for {routed}; call `set_routing` with this call's topk_ids"
    )]
    RoutingMismatch {
        rank: usize,
        given: u32,
        routed: usize,
    },
    #[error("rank {rank}: {source}")]
    Rank {
        rank: usize,
        #[source]
        source: LayerError,
    },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Jit(#[from] JitError),
    #[error(transparent)]
    Harness(#[from] HarnessError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Layer(#[from] LayerError),
}

fn versioned_hint(versioned: bool) -> &'static str {
    if versioned {
        "; libnccl.so.2 is installed but no libnccl.so link to it is on the library path: add one"
    } else {
        ", and libnccl.so.2 is not on the library path either"
    }
}

/// An [`NcclPipelineError::Nccl`] maker for `map_err`. (cudarc's `NcclError` is not a
/// `std::error::Error`; its result code is what says what failed.)
fn nccl(context: impl Into<String>) -> impl FnOnce(NcclError) -> NcclPipelineError {
    move |e| NcclPipelineError::Nccl {
        context: context.into(),
        result: format!("{:?}", e.0),
    }
}

/// NCCL's library name with its ABI version.
const NCCL_SONAME: &str = "libnccl.so.2";

/// `Ok` when cudarc can load NCCL, else [`NcclPipelineError::NoNccl`]. cudarc panics at the
/// first NCCL call when it cannot find the library, so this runs before any.
pub fn nccl_available() -> Result<(), NcclPipelineError> {
    // SAFETY: only opens (and closes) the library under the names cudarc loads it by.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    // SAFETY: opening NCCL runs no initialiser with effects beyond the library itself.
    let versioned = unsafe { libloading::Library::new(NCCL_SONAME) }.is_ok();
    Err(NcclPipelineError::NoNccl { versioned })
}

/// Where every (token, k) pair of every rank travels in one call, worked out on the host
/// from the routing (experts placed contiguously, `E / G` per rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchLayout {
    /// Tokens per rank.
    tokens: Vec<usize>,
    /// `counts[s][d]`: rows rank `s` sends to rank `d`.
    counts: Vec<Vec<usize>>,
    /// Per source rank, the pair `t * K + k` of each send row: grouped by destination rank,
    /// within it by local expert, pairs in increasing order within an expert. With
    /// contiguous placement that is the pairs sorted stably by expert id.
    send_pairs: Vec<Vec<i32>>,
    /// Per source rank, the send row of each pair: the inverse of `send_pairs`.
    pair_rows: Vec<Vec<i32>>,
}

impl DispatchLayout {
    /// The layout of a call where rank `r` routes `topk_ids[r]` ([T_r, K], row-major) over
    /// `experts` experts split evenly over `topk_ids.len()` ranks.
    pub fn new(topk_ids: &[&[i32]], experts: u32, top_k: u32) -> Result<Self, NcclPipelineError> {
        let ranks = topk_ids.len();
        if ranks == 0 || !(experts as usize).is_multiple_of(ranks) {
            return Err(NcclPipelineError::ExpertsNotDivisible { experts, ranks });
        }
        let per_rank = experts as usize / ranks;
        let k = top_k as usize;
        let mut layout = DispatchLayout {
            tokens: Vec::with_capacity(ranks),
            counts: Vec::with_capacity(ranks),
            send_pairs: Vec::with_capacity(ranks),
            pair_rows: Vec::with_capacity(ranks),
        };
        for (rank, ids) in topk_ids.iter().enumerate() {
            if k == 0 || ids.len() % k != 0 {
                return Err(NcclPipelineError::RaggedRouting {
                    rank,
                    len: ids.len(),
                    top_k,
                });
            }
            // A counting sort by expert id: count, prefix-sum, place in pair order.
            let mut expert_start = vec![0usize; experts as usize + 1];
            for (pair, &id) in ids.iter().enumerate() {
                let e = usize::try_from(id)
                    .ok()
                    .filter(|&e| e < experts as usize)
                    .ok_or(NcclPipelineError::ExpertIdOutOfRange {
                        rank,
                        token: pair / k,
                        k: pair % k,
                        id,
                        experts,
                    })?;
                expert_start[e + 1] += 1;
            }
            for e in 0..experts as usize {
                expert_start[e + 1] += expert_start[e];
            }
            let counts = (0..ranks)
                .map(|d| expert_start[(d + 1) * per_rank] - expert_start[d * per_rank])
                .collect();
            let mut next = expert_start;
            let mut send_pairs = vec![0i32; ids.len()];
            let mut pair_rows = vec![0i32; ids.len()];
            for (pair, &id) in ids.iter().enumerate() {
                let row = &mut next[id as usize];
                send_pairs[*row] = pair as i32;
                pair_rows[pair] = *row as i32;
                *row += 1;
            }
            layout.tokens.push(ids.len() / k);
            layout.counts.push(counts);
            layout.send_pairs.push(send_pairs);
            layout.pair_rows.push(pair_rows);
        }
        Ok(layout)
    }

    pub fn ranks(&self) -> usize {
        self.tokens.len()
    }

    pub fn tokens(&self, rank: usize) -> usize {
        self.tokens[rank]
    }

    /// Rows rank `src` sends to rank `dst`.
    pub fn count(&self, src: usize, dst: usize) -> usize {
        self.counts[src][dst]
    }

    /// First row of `src`'s send buffer bound for `dst` (and of its buffer of returned rows
    /// coming back from `dst`).
    pub fn send_offset(&self, src: usize, dst: usize) -> usize {
        self.counts[src][..dst].iter().sum()
    }

    /// First row of `dst`'s receive buffer that comes from `src` (and of its expert output
    /// going back to `src`): sources in rank order.
    pub fn recv_offset(&self, dst: usize, src: usize) -> usize {
        self.counts[..src].iter().map(|c| c[dst]).sum()
    }

    /// Rows rank `dst` receives in all.
    pub fn received(&self, dst: usize) -> usize {
        self.recv_offset(dst, self.ranks())
    }
}

/// The single-GPU layer each rank runs on the rows it receives: its `E / G` experts, one
/// routed expert per row, room for every row all ranks can send it (`G · max_tokens · K`).
fn local_layer(plan: &Plan, ranks: usize) -> Result<ir::Layer, NcclPipelineError> {
    let shape = &plan.shape;
    let rows = ranks as u64 * u64::from(shape.max_tokens) * u64::from(shape.top_k);
    if rows > MAX_PAIRS {
        return Err(NcclPipelineError::LocalTooLarge {
            rows,
            max: MAX_PAIRS,
        });
    }
    // Links matter only to the expert-parallel planner; this layer has one rank.
    let link = ir::Link {
        bandwidth_bytes_per_s: 0,
        latency_ns: 0,
    };
    Ok(ir::Layer {
        name: format!("{}_nccl_local{ranks}", plan.layer),
        hidden: shape.hidden,
        ffn: shape.ffn,
        experts: shape.experts / ranks as u32,
        top_k: 1,
        activation: shape.activation,
        expert_bias: shape.expert_bias,
        dtype: ir::DType::Bf16,
        weight_dtype: ir::DType::Bf16,
        max_tokens: rows as u32,
        shared_experts: None,
        router: None,
        parallel: ir::Parallelism {
            expert: 1,
            data: 1,
            tensor: 1,
        },
        topology: ir::Topology {
            name: "one_gpu".into(),
            gpus_per_node: 1,
            nodes: 1,
            intra_node: link,
            network: link,
            virtual_ranks: None,
        },
        schedule: ir::ScheduleHints::default(),
    })
}

const SOURCE: &str = include_str!("nccl_pipeline.cu");
const PACK_KERNEL: &str = "nccl_pipeline_pack";
const COMBINE_KERNEL: &str = "nccl_pipeline_combine";
/// Threads per block of both helper kernels (one block per row or token).
const ROW_THREADS: u32 = 256;
const BF16_BYTES: usize = 2;

fn rows_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A part of a call, for timing it alone ([`NcclPipeline::time`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The whole call: dispatch, GEMMs, combine.
    Call,
    /// Pack and the all-to-all to the experts.
    Dispatch,
    /// The local layer on the received rows.
    Gemms,
    /// The all-to-all back and the sum over k.
    Combine,
}

/// One rank: its stream (everything of the rank runs on it, NCCL included), local layer,
/// helper kernels and buffers, sized for `max_tokens` tokens on every rank.
struct Rank {
    stream: Arc<CudaStream>,
    local: MoeLayer,
    pack: CudaFunction,
    combine: CudaFunction,
    /// The layout's `send_pairs` and `pair_rows` of this rank, [max_tokens · K] each.
    send_pairs: CudaSlice<i32>,
    pair_rows: CudaSlice<i32>,
    /// Send rows: x rows [max_tokens · K, H], local expert ids and routing weights.
    send_x: CudaSlice<u16>,
    send_ids: CudaSlice<i32>,
    send_weights: CudaSlice<f32>,
    /// Received rows, by source rank: [G · max_tokens · K, H], ids, weights.
    recv_x: CudaSlice<u16>,
    recv_ids: CudaSlice<i32>,
    recv_weights: CudaSlice<f32>,
    /// The local layer's weighted output rows, in receive order.
    expert_out: CudaSlice<u16>,
    /// The rows back from the experts, in send order.
    returned: CudaSlice<u16>,
}

pub struct NcclPipeline {
    /// One communicator per rank, `comms[r]` enqueuing on `ranks[r].stream`. First, so
    /// that they are torn down before the buffers they moved.
    comms: Vec<Comm>,
    ranks: Vec<Rank>,
    hidden: usize,
    top_k: u32,
    experts: u32,
    max_tokens: u32,
    layout: Option<DispatchLayout>,
}

impl NcclPipeline {
    /// Builds the pipeline: rank `r` on `contexts[r]` (one per GPU) with experts
    /// `r·E/G .. (r+1)·E/G` copied from `built`'s weights, so that the CPU reference of
    /// `built` checks it. Plans and compiles the local layer (`E/G` experts, top-1) and the
    /// helper kernels for the session's GPU, and creates the communicators.
    pub fn new(
        session: &Session,
        built: &BuiltLayer,
        contexts: &[Arc<CudaContext>],
    ) -> Result<Self, NcclPipelineError> {
        nccl_available()?;
        match std::env::var("NCCL_NVLS_ENABLE") {
            Ok(value) if value == "0" => {}
            other => {
                return Err(NcclPipelineError::MulticastNotOff {
                    value: other.unwrap_or_else(|_| "unset".into()),
                });
            }
        }
        let full = built.layer.plan();
        let shape = &full.shape;
        let ranks = contexts.len();
        if ranks == 0 || !(shape.experts as usize).is_multiple_of(ranks) {
            return Err(NcclPipelineError::ExpertsNotDivisible {
                experts: shape.experts,
                ranks,
            });
        }
        for (first, a) in contexts.iter().enumerate() {
            if let Some(offset) = contexts[first + 1..]
                .iter()
                .position(|b| b.ordinal() == a.ordinal())
            {
                return Err(NcclPipelineError::SharedDevice {
                    first,
                    second: first + 1 + offset,
                    ordinal: a.ordinal(),
                });
            }
        }

        let local_plan = plan::plan(&local_layer(full, ranks)?, &session.gpu.target()?)?;
        let (local_module, _) = session.compile(&local_plan)?;
        let helpers = session.jit.compile(
            SOURCE,
            &CompileOptions::new("moeforge_nccl_pipeline", session.gpu.arch()?),
        )?;

        let (h, k) = (shape.hidden as usize, shape.top_k as usize);
        let send_rows = (shape.max_tokens as usize * k).max(1);
        let recv_rows = ranks * send_rows;
        let per_rank = shape.experts as usize / ranks;
        let weights = built.layer.weights();
        let mut built_ranks = Vec::with_capacity(ranks);
        for (r, ctx) in contexts.iter().enumerate() {
            let stream = ctx.new_stream().context("creating a rank's stream")?;
            let rank_weights = copy_experts(
                &session.gpu.stream,
                &stream,
                weights,
                shape,
                std::slice::from_ref(&(r * per_rank..(r + 1) * per_rank)),
            )?;
            let gpu = Gpu {
                ctx: Arc::clone(ctx),
                stream: Arc::clone(&stream),
            };
            let local = MoeLayer::new(
                &gpu,
                local_plan.clone(),
                Gpu::load_kernels_into(ctx, &local_module, &local_plan.single_gpu_entry_points())?,
                rank_weights,
            )
            .map_err(|source| NcclPipelineError::Rank { rank: r, source })?;
            let module = Gpu::load_into(ctx, &helpers)?;
            let load = |name: &str| {
                module
                    .load_function(name)
                    .context(format!("loading `{name}`"))
            };
            let bf16 = |rows: usize, what: &str| {
                stream
                    .alloc_zeros::<u16>(rows * h)
                    .context(format!("allocating {what}"))
            };
            let ints = |rows: usize, what: &str| {
                stream
                    .alloc_zeros::<i32>(rows)
                    .context(format!("allocating {what}"))
            };
            let floats = |rows: usize, what: &str| {
                stream
                    .alloc_zeros::<f32>(rows)
                    .context(format!("allocating {what}"))
            };
            built_ranks.push(Rank {
                pack: load(PACK_KERNEL)?,
                combine: load(COMBINE_KERNEL)?,
                send_pairs: ints(send_rows, "the send order")?,
                pair_rows: ints(send_rows, "each pair's send row")?,
                send_x: bf16(send_rows, "the send rows")?,
                send_ids: ints(send_rows, "the send rows' expert ids")?,
                send_weights: floats(send_rows, "the send rows' weights")?,
                recv_x: bf16(recv_rows, "the receive rows")?,
                recv_ids: ints(recv_rows, "the receive rows' expert ids")?,
                recv_weights: floats(recv_rows, "the receive rows' weights")?,
                expert_out: bf16(recv_rows, "the expert output")?,
                returned: bf16(send_rows, "the returned rows")?,
                stream,
                local,
            });
        }
        let streams = built_ranks.iter().map(|r| Arc::clone(&r.stream)).collect();
        let comms = Comm::from_devices(streams).map_err(nccl("creating the communicators"))?;
        let pipeline = NcclPipeline {
            comms,
            ranks: built_ranks,
            hidden: h,
            top_k: shape.top_k,
            experts: shape.experts,
            max_tokens: shape.max_tokens,
            layout: None,
        };
        pipeline.synchronize()?;
        Ok(pipeline)
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s stream: upload its inputs there, read its output after it.
    pub fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.ranks[rank].stream
    }

    /// Waits for every rank's stream.
    pub fn synchronize(&self) -> Result<(), NcclPipelineError> {
        for rank in &self.ranks {
            rank.stream.synchronize().context("synchronising a rank")?;
        }
        Ok(())
    }

    /// Sets the routing of the calls that follow: rank `r` routes `topk_ids[r]` ([T_r, K],
    /// the same ids as its device `topk_ids`). Works out the [`DispatchLayout`] on the host
    /// and uploads each rank's send order (host-to-device copies from pageable memory,
    /// which may wait for the rank's stream): set-up, outside the timed calls.
    pub fn set_routing(&mut self, topk_ids: &[&[i32]]) -> Result<(), NcclPipelineError> {
        if topk_ids.len() != self.ranks.len() {
            return Err(NcclPipelineError::RankCount {
                ranks: self.ranks.len(),
                given: topk_ids.len(),
                what: "routings",
            });
        }
        let layout = DispatchLayout::new(topk_ids, self.experts, self.top_k)?;
        if let Some((rank, &tokens)) = layout
            .tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t > self.max_tokens as usize)
        {
            return Err(NcclPipelineError::TooManyTokens {
                rank,
                tokens: tokens as u32,
                max: self.max_tokens,
            });
        }
        // No layout holds while the device copies change: a failed upload leaves none.
        self.layout = None;
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            if layout.tokens(r) > 0 {
                let stream = &rank.stream;
                stream
                    .memcpy_htod(&layout.send_pairs[r], &mut rank.send_pairs)
                    .context("uploading the send order")?;
                stream
                    .memcpy_htod(&layout.pair_rows[r], &mut rank.pair_rows)
                    .context("uploading each pair's send row")?;
            }
        }
        self.layout = Some(layout);
        Ok(())
    }

    /// Enqueues one call: `args[r]` is rank `r`'s tokens (on its device, routed as the last
    /// [`NcclPipeline::set_routing`] said). Does not synchronise the host.
    pub fn forward(&mut self, args: &mut [ForwardArgs<'_>]) -> Result<(), NcclPipelineError> {
        self.enqueue(Phase::Call, args)
    }

    /// Times `iterations` runs of `phase` alone with CUDA events on rank 0's stream, and
    /// returns each run's seconds. Every run sits between two cross-rank event barriers
    /// (each rank's stream waits for every other's): it is timed from rank 0 leaving the
    /// first barrier to rank 0 seeing every rank done, i.e. the slowest rank plus one
    /// barrier's latency. `args` must hold the routed call's inputs; a phase alone reads
    /// what the previous phase left (run [`NcclPipeline::forward`] once first).
    /// Synchronises at the end.
    pub fn time(
        &mut self,
        phase: Phase,
        args: &mut [ForwardArgs<'_>],
        iterations: usize,
    ) -> Result<Vec<f64>, NcclPipelineError> {
        let timer = |stream: &CudaStream| {
            stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .context("recording a timing event")
        };
        let mut events = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            self.barrier()?;
            let start = timer(&self.ranks[0].stream)?;
            self.enqueue(phase, args)?;
            self.barrier()?;
            events.push((start, timer(&self.ranks[0].stream)?));
        }
        events
            .iter()
            .map(|(start, end)| {
                let ms = start.elapsed_ms(end).context("reading a timing event")?;
                Ok(f64::from(ms) / 1e3)
            })
            .collect()
    }

    /// Waits for every rank and reports the first kernel error of any rank's local layer.
    pub fn take_error(&self) -> Result<(), NcclPipelineError> {
        for (r, rank) in self.ranks.iter().enumerate() {
            rank.local
                .take_error()
                .map_err(|source| NcclPipelineError::Rank { rank: r, source })?;
        }
        Ok(())
    }

    /// Every rank's stream waits for the work enqueued so far on every other rank's.
    fn barrier(&self) -> Result<(), NcclPipelineError> {
        let reached = self
            .ranks
            .iter()
            .map(|rank| rank.stream.record_event(None))
            .collect::<Result<Vec<_>, _>>()
            .context("recording a barrier event")?;
        for (r, rank) in self.ranks.iter().enumerate() {
            for (other, event) in reached.iter().enumerate() {
                if other != r {
                    rank.stream.wait(event).context("waiting at a barrier")?;
                }
            }
        }
        Ok(())
    }

    /// Checks `args` against the layout and enqueues `phase` on every rank.
    fn enqueue(
        &mut self,
        phase: Phase,
        args: &mut [ForwardArgs<'_>],
    ) -> Result<(), NcclPipelineError> {
        // Taken out while the phases borrow `self` mutably, and put back after.
        let layout = self.layout.take().ok_or(NcclPipelineError::NoRouting)?;
        let enqueued = self.check_args(&layout, args).and_then(|()| {
            if matches!(phase, Phase::Call | Phase::Dispatch) {
                self.dispatch(&layout, args)?;
            }
            if matches!(phase, Phase::Call | Phase::Gemms) {
                self.gemms(&layout)?;
            }
            if matches!(phase, Phase::Call | Phase::Combine) {
                self.combine(&layout, args)?;
            }
            Ok(())
        });
        self.layout = Some(layout);
        enqueued
    }

    fn check_args(
        &self,
        layout: &DispatchLayout,
        args: &[ForwardArgs<'_>],
    ) -> Result<(), NcclPipelineError> {
        if args.len() != self.ranks.len() {
            return Err(NcclPipelineError::RankCount {
                ranks: self.ranks.len(),
                given: args.len(),
                what: "ranks' inputs",
            });
        }
        for (rank, a) in args.iter().enumerate() {
            if a.tokens as usize != layout.tokens(rank) {
                return Err(NcclPipelineError::RoutingMismatch {
                    rank,
                    given: a.tokens,
                    routed: layout.tokens(rank),
                });
            }
            a.check(self.hidden as u32, self.top_k)?;
        }
        Ok(())
    }

    /// Phase 1: pack on every rank, then one NCCL group of every rank's sends and receives.
    fn dispatch(
        &mut self,
        layout: &DispatchLayout,
        args: &[ForwardArgs<'_>],
    ) -> Result<(), NcclPipelineError> {
        let (h, k) = (self.hidden as i32, self.top_k as i32);
        let experts_per_rank = (self.experts as usize / self.ranks.len()) as i32;
        for (r, (rank, a)) in self.ranks.iter_mut().zip(args).enumerate() {
            let rows = layout.tokens(r) * self.top_k as usize;
            if rows == 0 {
                continue;
            }
            let mut launch = rank.stream.launch_builder(&rank.pack);
            launch
                .arg(a.x)
                .arg(a.topk_ids)
                .arg(a.topk_weights)
                .arg(&rank.send_pairs)
                .arg(&k)
                .arg(&h)
                .arg(&experts_per_rank)
                .arg(&mut rank.send_x)
                .arg(&mut rank.send_ids)
                .arg(&mut rank.send_weights);
            // SAFETY: nccl_pipeline_pack(const bf16*, const int*, const float*, const int*,
            // int, int, int, bf16*, int*, float*); one block per send row, `rows` = T·K
            // rows, every buffer checked or sized to hold them; send_pairs holds this
            // routing's pairs, each below T·K.
            unsafe { launch.launch(rows_config(rows)) }
                .context(format!("packing rank {r}'s send rows"))?;
        }
        let hidden = self.hidden;
        grouped("dispatching", || {
            for (r, (rank, comm)) in self.ranks.iter_mut().zip(&self.comms).enumerate() {
                for peer in 0..layout.ranks() {
                    let out = layout.send_offset(r, peer)
                        ..layout.send_offset(r, peer) + layout.count(r, peer);
                    let into = layout.recv_offset(r, peer)
                        ..layout.recv_offset(r, peer) + layout.count(peer, r);
                    let p = peer as i32;
                    let context = || format!("dispatching from rank {r} to rank {peer}");
                    if !out.is_empty() {
                        let rows = rank.send_x.slice(out.start * hidden..out.end * hidden);
                        comm.send(&as_bytes(rows), p).map_err(nccl(context()))?;
                        comm.send(&rank.send_ids.slice(out.clone()), p)
                            .map_err(nccl(context()))?;
                        comm.send(&rank.send_weights.slice(out), p)
                            .map_err(nccl(context()))?;
                    }
                    let context = || format!("receiving on rank {r} from rank {peer}");
                    if !into.is_empty() {
                        let mut rows = rank
                            .recv_x
                            .slice_mut(into.start * hidden..into.end * hidden);
                        comm.recv(&mut as_bytes_mut(&mut rows), p)
                            .map_err(nccl(context()))?;
                        comm.recv(&mut rank.recv_ids.slice_mut(into.clone()), p)
                            .map_err(nccl(context()))?;
                        comm.recv(&mut rank.recv_weights.slice_mut(into), p)
                            .map_err(nccl(context()))?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Phase 2: every rank's local layer on the rows it received.
    fn gemms(&mut self, layout: &DispatchLayout) -> Result<(), NcclPipelineError> {
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            rank.local
                .forward(ForwardArgs {
                    tokens: layout.received(r) as u32,
                    x: &rank.recv_x,
                    topk_ids: &rank.recv_ids,
                    topk_weights: &rank.recv_weights,
                    y: &mut rank.expert_out,
                })
                .map_err(|source| NcclPipelineError::Rank { rank: r, source })?;
        }
        Ok(())
    }

    /// Phase 3: one NCCL group sending every expert output row back, then the sum over k
    /// on every rank.
    fn combine(
        &mut self,
        layout: &DispatchLayout,
        args: &mut [ForwardArgs<'_>],
    ) -> Result<(), NcclPipelineError> {
        let hidden = self.hidden;
        grouped("combining", || {
            for (r, (rank, comm)) in self.ranks.iter_mut().zip(&self.comms).enumerate() {
                for peer in 0..layout.ranks() {
                    let back = layout.recv_offset(r, peer)
                        ..layout.recv_offset(r, peer) + layout.count(peer, r);
                    let home = layout.send_offset(r, peer)
                        ..layout.send_offset(r, peer) + layout.count(r, peer);
                    let p = peer as i32;
                    if !back.is_empty() {
                        let rows = rank
                            .expert_out
                            .slice(back.start * hidden..back.end * hidden);
                        comm.send(&as_bytes(rows), p).map_err(nccl(format!(
                            "returning rows from rank {r} to rank {peer}"
                        )))?;
                    }
                    if !home.is_empty() {
                        let mut rows = rank
                            .returned
                            .slice_mut(home.start * hidden..home.end * hidden);
                        comm.recv(&mut as_bytes_mut(&mut rows), p)
                            .map_err(nccl(format!(
                                "receiving rank {r}'s rows back from rank {peer}"
                            )))?;
                    }
                }
            }
            Ok(())
        })?;
        let (h, k) = (self.hidden as i32, self.top_k as i32);
        for (r, (rank, a)) in self.ranks.iter_mut().zip(args.iter_mut()).enumerate() {
            let tokens = layout.tokens(r);
            if tokens == 0 {
                continue;
            }
            let mut launch = rank.stream.launch_builder(&rank.combine);
            launch
                .arg(&rank.returned)
                .arg(&rank.pair_rows)
                .arg(&k)
                .arg(&h)
                .arg(&mut *a.y);
            // SAFETY: nccl_pipeline_combine(const bf16*, const int*, int, int, bf16*); one
            // block per token; pair_rows holds T·K rows below T·K, `returned` T·K rows, y
            // was checked to hold T rows.
            unsafe { launch.launch(rows_config(tokens)) }
                .context(format!("combining rank {r}'s rows"))?;
        }
        Ok(())
    }
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`, ending the group even when a
/// call fails. With one thread driving every GPU, NCCL needs every rank's sends and
/// receives in one group.
fn grouped(
    what: &str,
    calls: impl FnOnce() -> Result<(), NcclPipelineError>,
) -> Result<(), NcclPipelineError> {
    group_start().map_err(nccl(format!("starting the group for {what}")))?;
    let issued = calls();
    let ended = group_end()
        .map(drop)
        .map_err(nccl(format!("{what} (ending the group)")));
    issued.and(ended)
}

/// A bf16 view as bytes: NCCL only moves the bytes, and cudarc's safe API has no bf16
/// type over `u16`.
fn as_bytes(rows: CudaView<'_, u16>) -> CudaView<'_, u8> {
    let bytes = rows.len() * BF16_BYTES;
    // SAFETY: any bytes are valid u8s; the byte view covers exactly the same memory.
    unsafe { rows.transmute::<u8>(bytes) }.expect("bf16 rows are whole bytes")
}

/// A bf16 view as bytes, to receive into (see [`as_bytes`]).
fn as_bytes_mut<'a>(rows: &'a mut CudaViewMut<'_, u16>) -> CudaViewMut<'a, u8> {
    let bytes = rows.len() * BF16_BYTES;
    // SAFETY: any bytes are valid bf16 bit patterns; the byte view covers exactly the same
    // memory.
    unsafe { rows.transmute_mut::<u8>(bytes) }.expect("bf16 rows are whole bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jit::{Jit, JitSettings};
    use crate::toolkit::nvrtc_for_tests;
    use crate::workload::{Routing, Workload};
    use moeforge_compiler::plan::{LayerShape, Target};

    #[test]
    fn layout_groups_pairs_by_destination_then_local_expert() {
        // 2 ranks, 4 experts (0, 1 on rank 0; 2, 3 on rank 1), top-2.
        let rank0 = [3, 0, 1, 2, 2, 0]; // tokens: (3, 0), (1, 2), (2, 0)
        let rank1 = [1, 3]; // one token
        let layout = DispatchLayout::new(&[&rank0, &rank1], 4, 2).expect("valid routing");
        // Rank 0's pairs by expert: e0: pairs 1, 5; e1: 2; e2: 3, 4; e3: 0.
        assert_eq!(layout.send_pairs[0], [1, 5, 2, 3, 4, 0]);
        assert_eq!(layout.pair_rows[0], [5, 0, 2, 3, 4, 1]);
        assert_eq!(layout.send_pairs[1], [0, 1]);
        assert_eq!((layout.tokens(0), layout.tokens(1)), (3, 1));
        assert_eq!(layout.counts, [[3, 3], [1, 1]]);
        assert_eq!(layout.send_offset(0, 1), 3);
        assert_eq!(layout.send_offset(1, 1), 1);
        // Rank 1 receives rank 0's three rows, then rank 1's one.
        assert_eq!(layout.recv_offset(1, 0), 0);
        assert_eq!(layout.recv_offset(1, 1), 3);
        assert_eq!(layout.received(1), 4);
        assert_eq!(layout.received(0), 4);
    }

    #[test]
    fn every_pair_is_sent_once_in_expert_order() {
        let shape = LayerShape {
            hidden: 64,
            ffn: 64,
            experts: 16,
            top_k: 4,
            activation: ir::Activation::Swiglu,
            expert_bias: false,
            max_tokens: 300,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 4,
            executed_ranks: 1,
        };
        for routing in [Routing::Uniform, Routing::Skewed, Routing::EmptyExperts] {
            let workloads: Vec<Workload> = [0, 1, 77, 300]
                .iter()
                .map(|&t| Workload::random(&shape, t, routing, 11 + u64::from(t)))
                .collect();
            let ids: Vec<&[i32]> = workloads.iter().map(|w| &w.topk_ids[..]).collect();
            let layout = DispatchLayout::new(&ids, 16, 4).expect("valid routing");
            for (r, w) in workloads.iter().enumerate() {
                let pairs = &layout.send_pairs[r];
                let mut seen = vec![false; pairs.len()];
                for (row, &pair) in pairs.iter().enumerate() {
                    assert!(!seen[pair as usize], "pair {pair} sent twice");
                    seen[pair as usize] = true;
                    assert_eq!(layout.pair_rows[r][pair as usize], row as i32);
                }
                let experts: Vec<i32> = pairs.iter().map(|&p| w.topk_ids[p as usize]).collect();
                assert!(experts.windows(2).all(|e| e[0] <= e[1]), "{experts:?}");
                for dst in 0..4 {
                    let start = layout.send_offset(r, dst);
                    let bound = &experts[start..start + layout.count(r, dst)];
                    assert!(bound.iter().all(|&e| e as usize / 4 == dst), "{bound:?}");
                }
            }
            for dst in 0..4 {
                let total: usize = (0..4).map(|src| layout.count(src, dst)).sum();
                assert_eq!(layout.received(dst), total);
            }
            let all: usize = (0..4).map(|dst| layout.received(dst)).sum();
            assert_eq!(all, (1 + 77 + 300) * 4, "every pair of every rank");
        }
    }

    #[test]
    fn bad_routing_is_a_typed_error() {
        let error = DispatchLayout::new(&[&[0, 1], &[2, 9]], 4, 2).expect_err("id 9 of 4");
        assert!(
            matches!(
                error,
                NcclPipelineError::ExpertIdOutOfRange {
                    rank: 1,
                    token: 0,
                    k: 1,
                    id: 9,
                    ..
                }
            ),
            "{error}"
        );
        let error = DispatchLayout::new(&[&[0, 1, 2], &[]], 4, 2).expect_err("ragged");
        assert!(matches!(
            error,
            NcclPipelineError::RaggedRouting { rank: 0, .. }
        ));
        let error = DispatchLayout::new(&[&[0], &[1], &[2]], 4, 1).expect_err("4 over 3");
        assert!(matches!(
            error,
            NcclPipelineError::ExpertsNotDivisible { ranks: 3, .. }
        ));
    }

    #[test]
    fn the_local_layer_plans_for_the_h200() {
        let full_plan = plan::plan(&tiny_layer(), &Target::h200()).expect("the full layer plans");
        let local = local_layer(&full_plan, 2).expect("fits");
        assert_eq!((local.experts, local.top_k, local.max_tokens), (4, 1, 4000));
        let local_plan = plan::plan(&local, &Target::h200()).expect("the local layer plans");
        assert_eq!(local_plan.shape.hidden, full_plan.shape.hidden);
        assert!(local_plan.expert_parallel.is_none());
        let huge = Plan {
            shape: LayerShape {
                max_tokens: u32::MAX / 4,
                shared_slices: 0,
                shared_gated: false,
                ..full_plan.shape.clone()
            },
            ..full_plan
        };
        assert!(matches!(
            local_layer(&huge, 2),
            Err(NcclPipelineError::LocalTooLarge { .. })
        ));
    }

    /// A one-GPU SwiGLU layer: H = 128, F = 256, 8 experts, top-2, up to 1000 tokens.
    fn tiny_layer() -> ir::Layer {
        let link = ir::Link {
            bandwidth_bytes_per_s: 0,
            latency_ns: 0,
        };
        ir::Layer {
            name: "tiny".into(),
            hidden: 128,
            ffn: 256,
            experts: 8,
            top_k: 2,
            activation: ir::Activation::Swiglu,
            expert_bias: false,
            dtype: ir::DType::Bf16,
            weight_dtype: ir::DType::Bf16,
            max_tokens: 1000,
            shared_experts: None,
            router: None,
            parallel: ir::Parallelism {
                expert: 1,
                data: 1,
                tensor: 1,
            },
            topology: ir::Topology {
                name: "one_gpu".into(),
                gpus_per_node: 1,
                nodes: 1,
                intra_node: link,
                network: link,
                virtual_ranks: None,
            },
            schedule: ir::ScheduleHints::default(),
        }
    }

    #[test]
    fn missing_nccl_is_a_typed_error_not_a_panic() {
        match nccl_available() {
            Ok(()) => {}
            Err(error @ NcclPipelineError::NoNccl { .. }) => {
                assert!(error.to_string().contains("LD_LIBRARY_PATH"), "{error}")
            }
            Err(other) => panic!("unexpected error: {other}"),
        }
    }

    #[test]
    fn helper_kernels_compile() {
        let Some(toolkit) = nvrtc_for_tests() else {
            return;
        };
        let jit = Jit::new(toolkit, JitSettings::default()).expect("NVRTC loads");
        let module = jit
            .compile(
                SOURCE,
                &CompileOptions::new("moeforge_nccl_pipeline", "sm_90a"),
            )
            .expect("the helper kernels compile");
        for name in [PACK_KERNEL, COMBINE_KERNEL] {
            assert!(module.ptx.contains(&format!(".entry {name}")), "{name}");
        }
    }
}
