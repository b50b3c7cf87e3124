//! Measuring a layer: median CUDA-event time per token count, over input sets rotated so
//! that L2 does not hold them between calls, next to the cuBLAS baseline run in the same
//! process, with the roofline floor beside both (docs/design.md, "Performance method").
//! The call is also timed replayed from a CUDA graph, as an engine that captures its
//! decode step runs it: without the host's launch latency. A layer with a router is timed
//! routing itself (router, then the layer on its choices), beside the floor of both on
//! those choices, and caller-routed on the router's own choices: the difference is what
//! the router costs.

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use moeforge_compiler::inputs;
use moeforge_compiler::plan::{LayerShape, Target};
use serde::Serialize;

use crate::baseline::{BaselineError, CublasBaseline};
use crate::bf16;
use crate::ep::{DispatchStageSplit, EpLayer, GemmStageSplit, StageMarks, StageTimes};
use crate::gpu::{DriverContext, GpuError};
use crate::harness::{BuiltLayer, DeviceWorkload, HarnessError, Session, upload_poisoned};
use crate::layer::{ForwardArgs, RoutedForwardArgs};
use crate::nccl_pipeline::{NcclPipeline, NcclPipelineError, Phase};
use crate::process_group::ChannelError;
use crate::reference;
use crate::workload::{Routing, Workload};

/// Input sets each measurement rotates through.
const ROTATED_INPUTS: usize = 3;
// Calls in turns step through the sets so that none follows one on its own set: that needs
// more than two.
const _: () = assert!(ROTATED_INPUTS > 2);
/// Calls before the timed ones: each input set twice, so that a call the layer replays as a
/// CUDA graph (docs/runtime.md) has been captured before any timed call.
const WARMUP_CALLS: usize = 2 * ROTATED_INPUTS;

/// Passes of pipelined calls the single-process expert-parallel bench times per schedule;
/// it reports the median pass. One pass's wall time per call swung by 10 µs between runs
/// at one token per rank on two H200s (Qwen3-30B-A3B, 2026-11-30: 71 and 84 µs, with
/// equal GEMM times), more than the changes it was to measure.
pub const PIPELINED_PASSES: usize = 5;

/// The median of PIPELINED_PASSES results of `pass` (each a wall time per call in µs).
fn median_of_passes<E>(mut pass: impl FnMut() -> Result<f64, E>) -> Result<f64, E> {
    let mut times = (0..PIPELINED_PASSES)
        .map(|_| pass())
        .collect::<Result<Vec<_>, E>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Work and traffic of one call, and the floor they imply.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    pub flops: f64,
    /// Weights of the experts hit plus activations in and out.
    pub bytes: f64,
    pub floor_us: f64,
    /// Whether the floor is set by memory (else by arithmetic).
    pub memory_bound: bool,
}

impl Roofline {
    /// The floor of one call on `workload` with every expert on one GPU (the shared
    /// slices are hit experts with a row per token).
    pub fn of(shape: &LayerShape, workload: &Workload, target: &Target) -> Self {
        let mut hit = vec![false; shape.experts as usize];
        for &id in &workload.topk_ids {
            if let Some(slot) = usize::try_from(id).ok().and_then(|e| hit.get_mut(e)) {
                *slot = true;
            }
        }
        let always_hit = if workload.tokens > 0 {
            f64::from(shape.shared_slices)
        } else {
            0.0
        };
        let hit_experts = hit.iter().filter(|&&h| h).count() as f64 + always_hit;
        let tokens = f64::from(workload.tokens);
        let pairs = tokens * f64::from(shape.slots_per_token());
        // x in and y out per token, and each routed pair's id and weight.
        let activation_bytes =
            tokens * f64::from(shape.hidden) * 2.0 * 2.0 + tokens * f64::from(shape.top_k) * 8.0;
        Self::of_work(shape, pairs, hit_experts, activation_bytes, target)
    }

    /// This floor plus the router's work for `tokens` tokens: the gate GEMM (x · W_gateᵀ,
    /// reading W_gate [E, H]) and its logits written and read back (f32).
    pub fn with_router(&self, shape: &LayerShape, tokens: u32, target: &Target) -> Self {
        let (t, h, e) = (
            f64::from(tokens),
            f64::from(shape.hidden),
            f64::from(shape.experts),
        );
        let flops = self.flops + 2.0 * t * h * e;
        let bytes = self.bytes + e * h * 2.0 + t * e * 4.0 * 2.0;
        Self::of_totals(flops, bytes, target)
    }

    /// The floor of `pairs` (token, expert) pairs over `hit_experts` distinct experts,
    /// moving `activation_bytes` besides the hit experts' weights.
    fn of_work(
        shape: &LayerShape,
        pairs: f64,
        hit_experts: f64,
        activation_bytes: f64,
        target: &Target,
    ) -> Self {
        let (h, f) = (f64::from(shape.hidden), f64::from(shape.ffn));
        let w1_rows = f64::from(shape.w1_rows());
        let flops = 2.0 * pairs * h * (w1_rows + f);
        let weight_bytes = hit_experts * (w1_rows * h + h * f) * 2.0;
        Self::of_totals(flops, weight_bytes + activation_bytes, target)
    }

    /// The floor of `flops` and `bytes` on `target`'s ceilings.
    fn of_totals(flops: f64, bytes: f64, target: &Target) -> Self {
        let compute_s = flops / target.peak_bf16_flops;
        let memory_s = bytes / target.hbm_bytes_per_s;
        Roofline {
            flops,
            bytes,
            floor_us: compute_s.max(memory_s) * 1e6,
            memory_bound: memory_s >= compute_s,
        }
    }
}

/// One row of the bench table.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub tokens: u32,
    pub regime: String,
    pub moeforge_us: f64,
    pub tflops: f64,
    pub gbps: f64,
    pub roofline: Roofline,
    /// floor / measured: 1.0 would be at the floor.
    pub fraction_of_floor: f64,
    pub cublas_us: Option<f64>,
    /// Relative difference between the baseline's output and moeforge's, as a sanity check
    /// that both computed the same layer.
    pub cublas_agreement: Option<f64>,
    /// A layer with a router: the call that routes itself (router, then the layer on its
    /// choices, which are not the workload's), and the floor of both on those choices.
    pub self_routed_us: Option<f64>,
    pub self_routed_floor_us: Option<f64>,
    /// The caller-routed call given the router's own choices: the self-routed call less
    /// this is what the router costs, on equal routing.
    pub on_its_routing_us: Option<f64>,
    /// The caller-routed call replayed from a CUDA graph (captured once per input set);
    /// none at T = 0, which launches nothing.
    pub graph_us: Option<f64>,
    /// The caller-routed call timed as the in-run peers are: calls back to back, the mean
    /// per call (`time_back_to_back`); none at T = 0.
    pub back_to_back_us: Option<f64>,
    pub iterations: usize,
}

/// Median of CUDA-event times of `call` over `iterations`, after warm-up; `call(i)` gets
/// the index of the rotated input set to use.
pub(crate) fn time_calls<E: From<GpuError>>(
    session: &Session,
    iterations: usize,
    mut call: impl FnMut(usize) -> Result<(), E>,
) -> Result<f64, E> {
    warm_up(&mut call)?;
    let mut times = Vec::with_capacity(iterations);
    for i in 0..iterations {
        times.push(event_span(session, || call(i % ROTATED_INPUTS))?);
    }
    Ok(median(times))
}

/// Passes of back-to-back calls in [`time_back_to_back`], as the peers' script times them.
const BACK_TO_BACK_PASSES: usize = 5;

/// The mean time per call of `iterations` calls enqueued back to back (one event pair
/// around them, no wait between them), median over [`BACK_TO_BACK_PASSES`] passes, after
/// warm-up: the in-run peers' method (`benches/single_gpu_peers.py`), so that moeforge and
/// the peers can be compared alike. A call's first launch may then start behind the
/// previous call's last as the GPU frees up, as in a model's stream of layers. Input sets
/// rotate as in [`time_calls`] (the peers repeat one, which favours them where the weights
/// a call reads fit in L2).
pub(crate) fn time_back_to_back<E: From<GpuError>>(
    session: &Session,
    iterations: usize,
    mut call: impl FnMut(usize) -> Result<(), E>,
) -> Result<f64, E> {
    warm_up(&mut call)?;
    let calls = iterations.max(1);
    let mut per_call = Vec::with_capacity(BACK_TO_BACK_PASSES);
    for _ in 0..BACK_TO_BACK_PASSES {
        let us = event_span(session, || {
            (0..calls).try_for_each(|i| call(i % ROTATED_INPUTS))
        })?;
        per_call.push(us / calls as f64);
    }
    Ok(median(per_call))
}

/// Medians of CUDA-event times of `first` and `second` over `iterations` each, after
/// warm-up, the two taken in turns so that what drifts over a run (clocks under a power
/// limit) moves both alike and their difference measures what separates them; which of
/// the two opens a turn alternates, so that neither always follows the other (every other
/// turn boundary, a closure then follows itself, on another set). `first` takes the even
/// steps' input sets and `second` the odd ones (modulo the rotated sets, more than two):
/// no call follows one on its own set, whose rows and experts' weights it would find in
/// L2.
pub(crate) fn time_calls_in_turns<E: From<GpuError>>(
    session: &Session,
    iterations: usize,
    mut first: impl FnMut(usize) -> Result<(), E>,
    mut second: impl FnMut(usize) -> Result<(), E>,
) -> Result<(f64, f64), E> {
    warm_up(&mut first)?;
    warm_up(&mut second)?;
    let mut times = (
        Vec::with_capacity(iterations),
        Vec::with_capacity(iterations),
    );
    for i in 0..iterations {
        let mut time_first = || event_span(session, || first(2 * i % ROTATED_INPUTS));
        let mut time_second = || event_span(session, || second((2 * i + 1) % ROTATED_INPUTS));
        if i % 2 == 0 {
            times.0.push(time_first()?);
            times.1.push(time_second()?);
        } else {
            times.1.push(time_second()?);
            times.0.push(time_first()?);
        }
    }
    Ok((median(times.0), median(times.1)))
}

fn warm_up<E>(call: &mut impl FnMut(usize) -> Result<(), E>) -> Result<(), E> {
    (0..WARMUP_CALLS).try_for_each(|i| call(i % ROTATED_INPUTS))
}

/// µs between CUDA events recorded on the session's stream before and after what `enqueue`
/// enqueues, once the second has been reached.
fn event_span<E: From<GpuError>>(
    session: &Session,
    enqueue: impl FnOnce() -> Result<(), E>,
) -> Result<f64, E> {
    let ctx = &session.gpu.ctx;
    let stream = &session.gpu.stream;
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .context("creating an event")?;
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .context("creating an event")?;
    start.record(stream).context("recording an event")?;
    enqueue()?;
    end.record(stream).context("recording an event")?;
    end.synchronize().context("waiting for an event")?;
    Ok(f64::from(start.elapsed_ms(&end).context("reading an event")?) * 1e3)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A self-routed call measured against the same call given the router's choices.
struct SelfRouted {
    self_routed_us: f64,
    /// The floor of the router and the layer on the router's choices (first input set).
    floor_us: f64,
    on_its_routing_us: f64,
}

/// Times the calls that route themselves on `inputs`' x and, in turns with them, the
/// caller-routed call on the choices the router made for each input set (collected first,
/// by one self-routed call each).
fn time_self_routed(
    session: &Session,
    built: &BuiltLayer,
    workloads: &[Workload],
    inputs: &mut [DeviceWorkload],
    iterations: usize,
) -> Result<SelfRouted, BenchError> {
    let plan = built.layer.plan();
    let chosen: Vec<Workload> = workloads
        .iter()
        .map(|w| {
            let outputs = session.run_routed_collect(built, w.tokens, &w.x)?;
            Ok(Workload {
                tokens: w.tokens,
                x: w.x.clone(),
                topk_ids: outputs.topk_ids,
                topk_weights: outputs.topk_weights,
            })
        })
        .collect::<Result<_, HarnessError>>()?;
    let mut chosen_inputs: Vec<DeviceWorkload> = chosen
        .iter()
        .map(|w| session.upload(&plan.shape, w))
        .collect::<Result<_, _>>()?;
    let (self_routed_us, on_its_routing_us) = time_calls_in_turns::<BenchError>(
        session,
        iterations,
        |i| Ok(built.layer.forward_routed(inputs[i].routed_args())?),
        |i| Ok(session.forward(&built.layer, &mut chosen_inputs[i])?),
    )?;
    built.layer.take_error()?;
    let floor = Roofline::of(&plan.shape, &chosen[0], &plan.target).with_router(
        &plan.shape,
        chosen[0].tokens,
        &plan.target,
    );
    Ok(SelfRouted {
        self_routed_us,
        floor_us: floor.floor_us,
        on_its_routing_us,
    })
}

/// The caller-routed call on each input set captured into a CUDA graph, the graphs
/// replayed as `time_calls` times calls. The first set's replay must write exactly what
/// the eager call wrote (`eager_y`): the kernels are deterministic.
fn time_graph_replays(
    session: &Session,
    built: &BuiltLayer,
    inputs: &mut [DeviceWorkload],
    iterations: usize,
    eager_y: &[u16],
    tokens: u32,
) -> Result<f64, BenchError> {
    let stream = &session.gpu.stream;
    stream
        .synchronize()
        .context("synchronising before capture")?;
    let mut graphs = Vec::with_capacity(inputs.len());
    for io in inputs.iter_mut() {
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning a stream capture")?;
        let forward = session.forward(&built.layer, io);
        // End the capture whatever the forward said, so that the stream is usable after.
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .context("ending a stream capture");
        forward?;
        let graph: CudaGraph = graph?.ok_or(BenchError::EmptyGraph { tokens })?;
        graph.upload().context("uploading a graph")?;
        graphs.push(graph);
    }
    let us = time_calls::<BenchError>(session, iterations, |i| {
        Ok(graphs[i].launch().context("replaying a graph")?)
    })?;
    built.layer.take_error()?;
    session.fill_bits(&mut inputs[0].y, bf16::NAN)?;
    graphs[0].launch().context("replaying a graph")?;
    let replayed = stream.clone_dtoh(&inputs[0].y).context("downloading y")?;
    if replayed != eager_y {
        return Err(BenchError::GraphReplayDiffers { tokens });
    }
    Ok(us)
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Harness(#[from] HarnessError),
    #[error(transparent)]
    Baseline(#[from] BaselineError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("the NCCL pipeline (baseline b): {0}")]
    NcclPipeline(Box<NcclPipelineError>),
    #[error(transparent)]
    Channel(#[from] ChannelError),
    #[error(
        "T = {tokens}: the call replayed from a CUDA graph wrote another y than the same call run eagerly"
    )]
    GraphReplayDiffers { tokens: u32 },
    #[error("T = {tokens}: capturing the call into a CUDA graph captured no work")]
    EmptyGraph { tokens: u32 },
}

impl From<NcclPipelineError> for BenchError {
    fn from(e: NcclPipelineError) -> Self {
        BenchError::NcclPipeline(Box::new(e))
    }
}

impl From<crate::layer::LayerError> for BenchError {
    fn from(e: crate::layer::LayerError) -> Self {
        BenchError::Harness(e.into())
    }
}

/// The input sets a timing rotates through at `tokens` tokens.
pub(crate) fn rotated_workloads(
    shape: &LayerShape,
    tokens: u32,
    routing: Routing,
    seed: u64,
) -> Vec<Workload> {
    (0..ROTATED_INPUTS)
        .map(|i| {
            Workload::random(
                shape,
                tokens,
                routing,
                seed ^ (u64::from(tokens) << 8) ^ i as u64,
            )
        })
        .collect()
}

/// [`rotated_workloads`], uploaded: what [`time_calls`]'s `call(i)` indexes.
pub(crate) fn uploaded_inputs(
    session: &Session,
    shape: &LayerShape,
    tokens: u32,
    routing: Routing,
    seed: u64,
) -> Result<Vec<DeviceWorkload>, BenchError> {
    Ok(rotated_workloads(shape, tokens, routing, seed)
        .iter()
        .map(|w| session.upload(shape, w))
        .collect::<Result<_, _>>()?)
}

/// Benchmarks `built` at each token count, with the baseline when it applies.
/// `progress` receives one line per finished row.
pub fn bench_layer(
    session: &Session,
    built: &BuiltLayer,
    token_counts: &[u32],
    routing: Routing,
    iterations: usize,
    seed: u64,
    mut progress: impl FnMut(&BenchRow),
) -> Result<(Vec<BenchRow>, Option<String>), BenchError> {
    let plan = built.layer.plan();
    let shape = plan.shape.clone();
    let baseline = match CublasBaseline::new(session, plan) {
        Ok(b) => Ok(b),
        Err(e @ (BaselineError::Activation(_) | BaselineError::NoCublas)) => Err(e.to_string()),
        Err(e) => return Err(e.into()),
    };
    let mut rows = Vec::new();
    for &tokens in token_counts {
        let workloads = rotated_workloads(&shape, tokens, routing, seed);
        let mut inputs: Vec<DeviceWorkload> = workloads
            .iter()
            .map(|w| session.upload(&shape, w))
            .collect::<Result<_, _>>()?;
        let moeforge_us = time_calls::<BenchError>(session, iterations, |i| {
            Ok(session.forward(&built.layer, &mut inputs[i])?)
        })?;
        built.layer.take_error()?;
        let back_to_back_us = if tokens > 0 {
            Some(time_back_to_back::<BenchError>(session, iterations, |i| {
                Ok(session.forward(&built.layer, &mut inputs[i])?)
            })?)
        } else {
            None
        };
        built.layer.take_error()?;
        let ours = session
            .gpu
            .stream
            .clone_dtoh(&inputs[0].y)
            .context("downloading y")?;

        let graph_us = if tokens > 0 {
            Some(time_graph_replays(
                session,
                built,
                &mut inputs,
                iterations,
                &ours,
                tokens,
            )?)
        } else {
            None
        };

        let (cublas_us, cublas_agreement) = match &baseline {
            Ok(baseline) if tokens > 0 => {
                let us = time_calls::<BenchError>(session, iterations, |i| {
                    Ok(baseline.forward(session, &built.layer, &mut inputs[i])?)
                })?;
                let theirs = session
                    .gpu
                    .stream
                    .clone_dtoh(&inputs[0].y)
                    .context("downloading y")?;
                let to_f32 = |v: &[u16]| v.iter().map(|&b| bf16::to_f32(b)).collect::<Vec<f32>>();
                (
                    Some(us),
                    Some(reference::relative_error(&to_f32(&theirs), &to_f32(&ours))),
                )
            }
            _ => (None, None),
        };
        let roofline = Roofline::of(&shape, &workloads[0], &plan.target);
        let (self_routed_us, self_routed_floor_us, on_its_routing_us) =
            if built.layer.routes_itself() && tokens > 0 {
                let routed = time_self_routed(session, built, &workloads, &mut inputs, iterations)?;
                (
                    Some(routed.self_routed_us),
                    Some(routed.floor_us),
                    Some(routed.on_its_routing_us),
                )
            } else {
                (None, None, None)
            };
        // A call its regime's fused decode runs says so.
        let regime = plan
            .regime_for(tokens)
            .map(|r| {
                if built.layer.runs_fused(tokens) {
                    format!("{} (fused)", r.name)
                } else {
                    r.name.clone()
                }
            })
            .unwrap_or_default();
        let row = BenchRow {
            tokens,
            regime,
            moeforge_us,
            tflops: roofline.flops / moeforge_us * 1e-6,
            gbps: roofline.bytes / moeforge_us * 1e-3,
            fraction_of_floor: roofline.floor_us / moeforge_us,
            roofline,
            cublas_us,
            cublas_agreement,
            self_routed_us,
            self_routed_floor_us,
            on_its_routing_us,
            graph_us,
            back_to_back_us,
            iterations,
        };
        progress(&row);
        rows.push(row);
    }
    Ok((rows, baseline.err()))
}

/// Baseline (b) on the same inputs: wall time per call over pipelined calls, and its
/// phases alone (medians of event-timed runs).
fn time_nccl_pipeline(
    pipeline: &mut NcclPipeline,
    workloads: &[Workload],
    inputs: &mut [DeviceWorkload],
    iterations: usize,
) -> Result<(f64, StageTimes), BenchError> {
    let ids: Vec<&[i32]> = workloads.iter().map(|w| w.topk_ids.as_slice()).collect();
    pipeline.set_routing(&ids)?;
    let mut args: Vec<ForwardArgs<'_>> = inputs.iter_mut().map(DeviceWorkload::args).collect();
    for _ in 0..WARMUP_CALLS {
        pipeline.forward(&mut args)?;
    }
    pipeline.synchronize()?;
    pipeline.take_error()?;
    let call_us = median_of_passes(|| -> Result<f64, BenchError> {
        let started = std::time::Instant::now();
        for _ in 0..iterations {
            pipeline.forward(&mut args)?;
        }
        pipeline.synchronize()?;
        Ok(started.elapsed().as_secs_f64() * 1e6 / iterations as f64)
    })?;
    let mut median_us = |phase| -> Result<f64, BenchError> {
        let mut seconds = pipeline.time(phase, &mut args, MARKED_CALLS)?;
        seconds.sort_by(f64::total_cmp);
        Ok(seconds[seconds.len() / 2] * 1e6)
    };
    let stages = StageTimes {
        dispatch_us: median_us(Phase::Dispatch)?,
        gemm_us: median_us(Phase::Gemms)?,
        combine_us: median_us(Phase::Combine)?,
    };
    pipeline.take_error()?;
    Ok((call_us, stages))
}

/// The roofline floor of the busiest rank when rank `d` computes every pair of every
/// workload whose expert lives there.
fn busiest_rank_floor_us(
    shape: &LayerShape,
    workloads: &[Workload],
    ranks: u32,
    target: &Target,
) -> f64 {
    let per_rank = (shape.experts / ranks) as usize;
    let row_bytes = f64::from(shape.hidden) * 2.0;
    (0..ranks as usize)
        .map(|d| {
            let mut hit = vec![false; per_rank];
            let mut pairs = 0u64;
            for id in workloads.iter().flat_map(|w| &w.topk_ids) {
                if let Ok(e) = usize::try_from(*id)
                    && e / per_rank == d
                {
                    hit[e % per_rank] = true;
                    pairs += 1;
                }
            }
            let hit = hit.iter().filter(|&&h| h).count() as f64;
            let pairs = pairs as f64;
            // Each pair's row in and its result row out.
            Roofline::of_work(shape, pairs, hit, pairs * row_bytes * 2.0, target).floor_us
        })
        .fold(0.0, f64::max)
}

/// The two schedules of the expert-parallel layer a bench times.
#[derive(Clone, Copy)]
enum Schedule {
    Overlapped,
    BulkSynchronous,
}

/// What a bench runs: token counts (per rank), routing, timed calls and the seed.
#[derive(Clone, Copy)]
pub struct BenchSettings<'a> {
    pub token_counts: &'a [u32],
    pub routing: Routing,
    pub iterations: usize,
    pub seed: u64,
}

/// One token count of the expert-parallel bench.
#[derive(Clone, Debug, Serialize)]
pub struct ExpertParallelRow {
    pub tokens_per_rank: u32,
    pub ranks: u32,
    /// Wall time per call over pipelined calls, the median of [`PIPELINED_PASSES`] passes
    /// (host launches included: one call is 6 launches per rank on two streams, or the
    /// fused decode's one, with no host synchronisation between calls).
    pub expert_parallel_us: f64,
    /// Whether that call (and the self-routed ones) ran the ranks' fused decode, one
    /// kernel per rank, rather than the table (the bulk-synchronous baseline and the stage
    /// times always run the table).
    pub fused_decode: bool,
    /// The same tokens of every rank (R · T) on one GPU with every expert, moeforge's
    /// single-GPU kernels (CUDA events); `None` above max_tokens.
    pub one_gpu_us: Option<f64>,
    /// Token rows that crossed to another rank, per second of the whole call (bytes of
    /// rows, not of pairs).
    pub crossed_gb_per_s: f64,
    /// The busiest sender's row bytes to other ranks over the bulk-synchronous dispatch
    /// stage's time: the rate one rank's dispatch reached (one way; metadata and the
    /// stage's barrier included in its time).
    pub dispatch_gb_per_s: f64,
    /// The communication blocks that dispatched it: the plan's, in the regime of this call
    /// (a `*_long` regime gives the dispatch only as many as hide it behind GEMM1's local
    /// tiles, so its rate is low by design).
    pub dispatch_blocks: u32,
    /// The busiest rank's roofline floor: its pairs' GEMM work at peak bf16 rate or its
    /// hit experts' weights (and its rows) at HBM rate, whichever is slower.
    pub floor_us: f64,
    /// Baseline (a): the same kernels, every rank waiting for every rank between stages
    /// (wall time per call over pipelined calls, like `expert_parallel_us`, their passes
    /// taken in turns).
    pub bulk_synchronous_us: f64,
    /// The stages of bulk-synchronous calls, each alone (CUDA events on rank 0 after
    /// barriers of every rank; mean over the marked calls).
    pub stages: StageTimes,
    /// Rank 0's dispatch stage kernel by kernel (same calls, mean).
    pub dispatch_split: DispatchStageSplit,
    /// Rank 0's GEMM stage kernel by kernel (same calls, mean).
    pub gemm_split: GemmStageSplit,
    /// Every rank's GEMM1 alone, by rank (same calls, mean): where ranks' loads differ,
    /// the slowest sets the layer.
    pub gemm1_per_rank_us: Vec<f64>,
    /// Baseline (b), on real GPUs when NCCL loads: NCCL all-to-all, moeforge's single-GPU
    /// layer per rank, NCCL all-to-all back (wall time per call over pipelined calls).
    pub nccl_us: Option<f64>,
    /// Its phases alone (CUDA events on rank 0 between barriers; median of the runs).
    pub nccl_stages: Option<StageTimes>,
    /// Of the communication stages' time (dispatch + combine), the share the overlapped
    /// schedule hid: (sum of the stages − overlapped call) / (dispatch + combine), in [0, 1].
    pub hidden_share: f64,
    /// Where the layer has a router: the overlapped call routing itself (each rank's
    /// router on its own x, then the call on its choices), wall time per call as
    /// `expert_parallel_us`.
    pub self_routed_us: Option<f64>,
    /// The overlapped call given those same choices by the caller (the routers' of the
    /// last self-routed call): the self-routed call less this is what the routers cost.
    pub on_its_routing_us: Option<f64>,
    /// Every rank's router alone ([`EpLayer::route`]), pipelined the same way.
    pub routers_alone_us: Option<f64>,
}

/// Wall time per call of `one_call` on `ep` (after warm-up calls): the median of
/// [`PIPELINED_PASSES`] passes of `iterations` calls with no host synchronisation
/// between them, the host's launches included.
fn pipelined_call_us(
    ep: &mut EpLayer,
    iterations: usize,
    mut one_call: impl FnMut(&mut EpLayer) -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    for _ in 0..WARMUP_CALLS {
        one_call(ep)?;
    }
    ep.take_error()?;
    let us = median_of_passes(|| pipelined_pass_us(ep, iterations, &mut one_call))?;
    ep.take_error()?;
    Ok(us)
}

/// [`pipelined_call_us`] of two kinds of call (`call(ep, true)` and `call(ep, false)`),
/// their passes taken in turn, so that a drift of the clock between passes falls on both
/// alike (a power-limited cell's passes drift by 5-10%, more than a router costs or than
/// the overlap gains in some cells).
fn interleaved_pipelined_call_us(
    ep: &mut EpLayer,
    iterations: usize,
    mut call: impl FnMut(&mut EpLayer, bool) -> Result<(), BenchError>,
) -> Result<(f64, f64), BenchError> {
    for _ in 0..WARMUP_CALLS {
        call(ep, true)?;
        call(ep, false)?;
    }
    ep.take_error()?;
    let (mut times_a, mut times_b) = (Vec::new(), Vec::new());
    for _ in 0..PIPELINED_PASSES {
        times_a.push(pipelined_pass_us(ep, iterations, &mut |ep| call(ep, true))?);
        times_b.push(pipelined_pass_us(ep, iterations, &mut |ep| {
            call(ep, false)
        })?);
    }
    ep.take_error()?;
    Ok((median(times_a), median(times_b)))
}

/// One pass: `iterations` calls of `one_call` back to back, then a synchronisation; wall
/// time per call in µs.
fn pipelined_pass_us(
    ep: &mut EpLayer,
    iterations: usize,
    one_call: &mut impl FnMut(&mut EpLayer) -> Result<(), BenchError>,
) -> Result<f64, BenchError> {
    let started = std::time::Instant::now();
    for _ in 0..iterations {
        one_call(ep)?;
    }
    ep.synchronize()?;
    Ok(started.elapsed().as_secs_f64() * 1e6 / iterations as f64)
}

/// What the self-routed expert-parallel bench measures (see [`ExpertParallelRow`]).
struct SelfRoutedTimes {
    self_routed_us: f64,
    on_its_routing_us: f64,
    routers_alone_us: f64,
}

/// One self-routed call on `inputs` (`whole`), or only its routers.
fn routed_call(
    ep: &mut EpLayer,
    inputs: &mut [DeviceWorkload],
    whole: bool,
) -> Result<(), BenchError> {
    let mut args: Vec<RoutedForwardArgs<'_>> =
        inputs.iter_mut().map(DeviceWorkload::routed_args).collect();
    if whole {
        ep.forward_routed(&mut args)?;
    } else {
        ep.route(&mut args)?;
    }
    Ok(())
}

/// Times every rank's router alone, then the overlapped call on `inputs` routing itself
/// and the same call given the choices its routers made as the caller's, their passes
/// taken in turn.
fn time_self_routed_expert_parallel(
    ep: &mut EpLayer,
    inputs: &mut [DeviceWorkload],
    iterations: usize,
) -> Result<SelfRoutedTimes, BenchError> {
    let routers_alone_us = pipelined_call_us(ep, iterations, |ep| routed_call(ep, inputs, false))?;
    // One call for the routers' choices (the same x routes the same way every call).
    routed_call(ep, inputs, true)?;
    ep.take_error()?;
    let shape = ep.plan().shape.clone();
    let mut chosen = Vec::with_capacity(inputs.len());
    for (r, io) in inputs.iter().enumerate() {
        let stream = ep.stream(r);
        let (topk_ids, topk_weights) = ep.routed_choices(r, io.tokens)?;
        let workload = Workload {
            tokens: io.tokens,
            x: stream.clone_dtoh(&io.x).context("downloading x")?,
            topk_ids,
            topk_weights,
        };
        chosen.push(upload_poisoned(stream, &shape, &workload)?);
    }
    let (self_routed_us, on_its_routing_us) =
        interleaved_pipelined_call_us(ep, iterations, |ep, routes_itself| {
            if routes_itself {
                return routed_call(ep, inputs, true);
            }
            let mut args: Vec<ForwardArgs<'_>> =
                chosen.iter_mut().map(DeviceWorkload::args).collect();
            Ok(ep.forward(&mut args)?)
        })?;
    Ok(SelfRoutedTimes {
        self_routed_us,
        on_its_routing_us,
        routers_alone_us,
    })
}

/// Bulk-synchronous calls whose stages are timed with events (each is synchronised).
const MARKED_CALLS: usize = 10;

/// Times the expert-parallel layer `ep` (built from `built`) at each token count per rank,
/// next to `built`'s single-GPU layer on all ranks' tokens together.
pub fn bench_expert_parallel(
    session: &Session,
    built: &BuiltLayer,
    ep: &mut EpLayer,
    mut nccl: Option<&mut NcclPipeline>,
    settings: &BenchSettings<'_>,
    mut progress: impl FnMut(&ExpertParallelRow),
) -> Result<Vec<ExpertParallelRow>, BenchError> {
    let BenchSettings {
        token_counts,
        routing,
        iterations,
        seed,
    } = *settings;
    let shape = built.layer.plan().shape.clone();
    let ranks = ep.ranks() as u32;
    let per_rank = shape.experts / ranks;
    let mut rows = Vec::new();
    for &tokens in token_counts {
        // Every rank passes `tokens`: on emulated nodes the loopback moves what they fill.
        ep.bound_tokens(Some(tokens)).map_err(HarnessError::from)?;
        let workloads: Vec<Workload> = (0..ranks)
            .map(|r| {
                Workload::random(
                    &shape,
                    tokens,
                    routing,
                    inputs::expert_parallel_rank_seed(seed, tokens, r),
                )
            })
            .collect();
        let mut inputs = workloads
            .iter()
            .enumerate()
            .map(|(r, w)| upload_poisoned(ep.stream(r), &shape, w))
            .collect::<Result<Vec<_>, _>>()?;
        let mut call = |ep: &mut EpLayer,
                        schedule: Schedule,
                        marks: Option<&StageMarks>|
         -> Result<(), BenchError> {
            let mut args: Vec<ForwardArgs<'_>> =
                inputs.iter_mut().map(DeviceWorkload::args).collect();
            match schedule {
                Schedule::Overlapped => ep.forward(&mut args)?,
                Schedule::BulkSynchronous => ep.forward_bulk_synchronous(&mut args, marks)?,
            }
            Ok(())
        };
        // In turns: baseline (a) against the overlapped call is the comparison that
        // matters, and a power-limited cell drifts between passes.
        let (expert_parallel_us, bulk_synchronous_us) =
            interleaved_pipelined_call_us(ep, iterations, |ep, overlapped| {
                let schedule = if overlapped {
                    Schedule::Overlapped
                } else {
                    Schedule::BulkSynchronous
                };
                call(ep, schedule, None)
            })?;
        let marks = StageMarks::new(ep)?;
        let mut stages = StageTimes::default();
        let mut dispatch_split = DispatchStageSplit::default();
        let mut gemm_split = GemmStageSplit::default();
        let mut gemm1_per_rank_us = vec![0.0; ranks as usize];
        let share = 1.0 / MARKED_CALLS as f64;
        for _ in 0..MARKED_CALLS {
            call(ep, Schedule::BulkSynchronous, Some(&marks))?;
            let t = marks.times()?;
            stages.dispatch_us += t.dispatch_us * share;
            stages.gemm_us += t.gemm_us * share;
            stages.combine_us += t.combine_us * share;
            let split = marks.dispatch_split()?;
            dispatch_split.metadata_us += split.metadata_us * share;
            dispatch_split.rows_us += split.rows_us * share;
            let split = marks.gemm_split()?;
            gemm_split.arrange_us += split.arrange_us * share;
            gemm_split.gemm1_us += split.gemm1_us * share;
            gemm_split.gemm2_us += split.gemm2_us * share;
            for (mean, us) in gemm1_per_rank_us.iter_mut().zip(marks.gemm1_per_rank_us()?) {
                *mean += us * share;
            }
        }
        ep.take_error()?;
        let (nccl_us, nccl_stages) = match nccl.as_deref_mut() {
            Some(pipeline) => {
                ep.synchronize()?;
                let (us, stages) =
                    time_nccl_pipeline(pipeline, &workloads, &mut inputs, iterations)?;
                (Some(us), Some(stages))
            }
            None => (None, None),
        };
        let routed = if ep.routes_itself() {
            Some(time_self_routed_expert_parallel(
                ep,
                &mut inputs,
                iterations,
            )?)
        } else {
            None
        };
        let communication = stages.dispatch_us + stages.combine_us;
        let hidden_share =
            ((communication + stages.gemm_us - expert_parallel_us) / communication).clamp(0.0, 1.0);

        // Rows that leave their rank: tokens with an expert on another rank, once per rank.
        let k = shape.top_k as usize;
        let sent_per_rank: Vec<u64> = workloads
            .iter()
            .enumerate()
            .map(|(r, w)| {
                (0..w.tokens as usize)
                    .map(|t| {
                        let mut destinations: Vec<u32> = w.topk_ids[t * k..(t + 1) * k]
                            .iter()
                            .map(|&e| e as u32 / per_rank)
                            .filter(|&d| d != r as u32)
                            .collect();
                        destinations.sort_unstable();
                        destinations.dedup();
                        destinations.len() as u64
                    })
                    .sum::<u64>()
            })
            .collect();
        let row_bytes = f64::from(shape.hidden) * 2.0;
        let crossed_bytes = sent_per_rank.iter().sum::<u64>() as f64 * row_bytes;
        let crossed_gb_per_s = crossed_bytes / (expert_parallel_us * 1e-6) / 1e9;
        let busiest_sender = sent_per_rank.iter().copied().max().unwrap_or(0) as f64 * row_bytes;
        let dispatch_gb_per_s = busiest_sender / (stages.dispatch_us * 1e-6) / 1e9;
        let dispatch_blocks = ep
            .plan()
            .expert_parallel
            .as_ref()
            .and_then(|plan| {
                plan.regime_index_for(tokens)
                    .map(|i| plan.regimes[i].comm_blocks)
            })
            .unwrap_or(0);

        let together = tokens * ranks;
        let one_gpu_us = if together <= shape.max_tokens {
            let workload = Workload::random(&shape, together, routing, seed ^ 0x0e9);
            let mut io = session.upload(&shape, &workload)?;
            Some(time_calls::<BenchError>(session, iterations, |_| {
                Ok(session.forward(&built.layer, &mut io)?)
            })?)
        } else {
            None
        };
        let row = ExpertParallelRow {
            tokens_per_rank: tokens,
            ranks,
            expert_parallel_us,
            fused_decode: ep.runs_fused(&vec![tokens; ranks as usize]),
            one_gpu_us,
            crossed_gb_per_s,
            dispatch_gb_per_s,
            dispatch_blocks,
            floor_us: busiest_rank_floor_us(&shape, &workloads, ranks, &built.layer.plan().target),
            bulk_synchronous_us,
            stages,
            dispatch_split,
            gemm_split,
            gemm1_per_rank_us,
            nccl_us,
            nccl_stages,
            hidden_share,
            self_routed_us: routed.as_ref().map(|t| t.self_routed_us),
            on_its_routing_us: routed.as_ref().map(|t| t.on_its_routing_us),
            routers_alone_us: routed.as_ref().map(|t| t.routers_alone_us),
        };
        progress(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// One token count of the bench of a group of rank processes.
#[derive(Clone, Debug, Serialize)]
pub struct GroupBenchRow {
    /// Tokens per rank.
    pub tokens: u32,
    /// Every rank's mean wall time per call, in µs, in rank order.
    pub per_rank_us: Vec<f64>,
    /// The layer's time per call: the slowest rank's.
    pub layer_us: f64,
}

/// This process's part of the bench when the ranks are processes (see
/// [`EpLayer::join_group`]): per token count, after warm-up and a meeting of every rank,
/// the mean host wall time of `iterations` back-to-back overlapped calls, synchronised at
/// the end; every rank's number gathered over the group's control channel. (CUDA events
/// do not cross processes, and the bulk-synchronous variant needs barriers between
/// processes, so neither is measured here.) Every rank calls it with the same settings.
pub fn bench_group_rank(
    ep: &mut EpLayer,
    shape: &LayerShape,
    settings: &BenchSettings<'_>,
    mut progress: impl FnMut(&GroupBenchRow),
) -> Result<Vec<GroupBenchRow>, BenchError> {
    let rank = ep.rank_index(0);
    let mut rows = Vec::new();
    for &tokens in settings.token_counts {
        // The seeds of the single-process bench's workloads, rank for rank.
        let workload = Workload::random(
            shape,
            tokens,
            settings.routing,
            inputs::expert_parallel_rank_seed(settings.seed, tokens, rank),
        );
        // Every rank passes `tokens`: across nodes, NCCL moves what they can fill.
        ep.bound_tokens(Some(tokens)).map_err(HarnessError::from)?;
        let mut input = upload_poisoned(ep.stream(0), shape, &workload)?;
        for _ in 0..WARMUP_CALLS {
            ep.forward(&mut [input.args()])
                .map_err(HarnessError::from)?;
        }
        ep.take_error().map_err(HarnessError::from)?;
        if let Some(channel) = ep.group_channel() {
            channel.barrier()?;
        }
        let started = std::time::Instant::now();
        for _ in 0..settings.iterations {
            ep.forward(&mut [input.args()])
                .map_err(HarnessError::from)?;
        }
        ep.synchronize().map_err(HarnessError::from)?;
        let us = started.elapsed().as_secs_f64() * 1e6 / settings.iterations.max(1) as f64;
        ep.take_error().map_err(HarnessError::from)?;
        let per_rank_us = match ep.group_channel() {
            Some(channel) => channel
                .all_gather(&us.to_le_bytes())?
                .iter()
                .map(|bytes| {
                    // A peer's message is its 8 bytes; anything else reads as unknown.
                    bytes
                        .as_slice()
                        .try_into()
                        .map_or(f64::NAN, f64::from_le_bytes)
                })
                .collect(),
            None => vec![us],
        };
        let row = GroupBenchRow {
            tokens,
            layer_us: per_rank_us.iter().copied().fold(f64::NAN, f64::max),
            per_rank_us,
        };
        progress(&row);
        rows.push(row);
    }
    Ok(rows)
}
