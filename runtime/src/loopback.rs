//! The network of emulated nodes (the plan's `NetworkTransport::Loopback`): virtual ranks
//! of one GPU stand for the GPUs of several nodes, run the kernels of real nodes, and one
//! loopback stream runs what every rank's NCCL steps would (see [`crate::network`]).
//!
//! - **Steps in lock step.** Every rank issues the same sequence of steps (the metadata,
//!   each dispatch chunk of the call's tokens bound, each return chunk of partials). For
//!   step `i` the stream waits (`cuStreamWaitValue32`) on every rank's flags of step `i`
//!   (staging, or the combine's partials), copies each send into the receive NCCL would
//!   pair it with (the n-th send of `a` to `b` meets the n-th receive of `b` from `a`;
//!   sizes are checked when the steps are resolved), then writes the call's epoch into
//!   every rank's flags of step `i`. Lock step is sound: what a rank releases for step `i`
//!   depends only on what earlier steps delivered and on the last call, which a call's
//!   joins order before it. As on real nodes, the chunk steps are sized by the rows per
//!   chunk: after the metadata step the stream copies every rank's counts to the host,
//!   which waits for them (bounded) before it pairs and enqueues the chunk steps: the
//!   dispatch steps before the ranks' compute kernels, the return steps after them.
//! - **Bounded waits.** As for NCCL, the host waits at most the plan's bound per call
//!   enqueued. A stall is a flag no kernel released (a kernel fault): the error
//!   names the step and the ranks whose flags are missing (read on a side stream, polled:
//!   a bounded wait, as that read may queue behind the stall); the loopback then releases
//!   the flags of every call in flight itself from the side stream so that its stream
//!   drains (those calls' results are wrong; the kernels' own time-outs follow in
//!   `take_error`, which restarts the exchange) and the layer can be called again.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::driver::sys as driver;
use moeforge_compiler::plan::ep::ExpertParallelPlan;
use moeforge_compiler::plan::network::{ChunkRows, NetworkPlan, NetworkStep, StepKind};
use moeforge_compiler::plan::{BufferId, LayerShape};

use crate::gpu::DriverContext;
use crate::network::{
    CallsInFlight, HostReadback, NetworkError, ROWS_PER_CHUNK, ResolvedStep, StepBuffers, drain,
    idle_by, release_flags, stream_op, stream_wait_value, stream_write_value,
};

/// How long a stall's report waits for the read of the stalled step's flags.
const FLAG_READ_LIMIT: Duration = Duration::from_millis(200);

/// One device copy: `rows` sends of rank `from` into the receives of rank `to` they pair
/// with, each `bytes` long, the next `source_pitch` and `destination_pitch` bytes on (a
/// receive-index array's segments per local expert: contiguous at the sender, strided by
/// the ranks at the receiver). One row is a plain copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LoopbackCopy {
    pub(crate) from: u32,
    pub(crate) to: u32,
    pub(crate) source: u64,
    pub(crate) destination: u64,
    pub(crate) bytes: u64,
    pub(crate) rows: u64,
    pub(crate) source_pitch: u64,
    pub(crate) destination_pitch: u64,
}

impl LoopbackCopy {
    /// A single copy of `bytes` bytes.
    fn single(from: u32, to: u32, source: u64, destination: u64, bytes: u64) -> Self {
        LoopbackCopy {
            from,
            to,
            source,
            destination,
            bytes,
            rows: 1,
            source_pitch: bytes,
            destination_pitch: bytes,
        }
    }

    /// Whether `next` continues this run as its next row: the same ranks and size, its
    /// source and destination in the buffers of this run's (a 2D copy spans one allocation
    /// on each side; rows of different buffers could sit a pitch apart by chance, and the
    /// driver refuses such a copy).
    fn continued_by(&self, next: &LoopbackCopy, buffers: &BufferRanges) -> bool {
        let row =
            |pitch: u64, at: u64, start: u64| at.checked_sub(start) == Some(pitch * self.rows);
        (next.from, next.to, next.bytes, next.rows) == (self.from, self.to, self.bytes, 1)
            && buffers.same(self.source, next.source)
            && buffers.same(self.destination, next.destination)
            && if self.rows == 1 {
                // The second row sets the pitches: at least a row apart, so rows never overlap.
                next.source >= self.source + self.bytes
                    && next.destination >= self.destination + self.bytes
            } else {
                row(self.source_pitch, next.source, self.source)
                    && row(self.destination_pitch, next.destination, self.destination)
            }
    }

    /// Appends `next` (which [`LoopbackCopy::continued_by`] accepted) as a row.
    fn extend(&mut self, next: &LoopbackCopy) {
        if self.rows == 1 {
            self.source_pitch = next.source - self.source;
            self.destination_pitch = next.destination - self.destination;
        }
        self.rows += 1;
    }
}

/// The device ranges of every rank's buffers the steps name, sorted by start.
#[derive(Debug)]
pub(crate) struct BufferRanges(Vec<(u64, u64)>);

impl BufferRanges {
    pub(crate) fn of(buffers: &[StepBuffers]) -> Self {
        let mut ranges: Vec<(u64, u64)> = buffers.iter().flat_map(StepBuffers::ranges).collect();
        ranges.sort_unstable();
        BufferRanges(ranges)
    }

    /// The range holding `address`.
    fn holding(&self, address: u64) -> Option<usize> {
        let after = self.0.partition_point(|&(start, _)| start <= address);
        after.checked_sub(1).filter(|&i| address < self.0[i].1)
    }

    /// Whether `a` and `b` lie in one buffer.
    fn same(&self, a: u64, b: u64) -> bool {
        let range = self.holding(a);
        range.is_some() && range == self.holding(b)
    }
}

/// `copies` with each run of rows that one 2D copy can move merged (in order).
fn coalesced(copies: Vec<LoopbackCopy>, buffers: &BufferRanges) -> Vec<LoopbackCopy> {
    let mut runs: Vec<LoopbackCopy> = Vec::with_capacity(copies.len());
    for copy in copies {
        match runs.last_mut() {
            Some(run) if run.continued_by(&copy, buffers) => run.extend(&copy),
            _ => runs.push(copy),
        }
    }
    runs
}

/// Step `i` of every rank, as the loopback runs it.
#[derive(Clone, Debug)]
pub(crate) struct LoopbackStep {
    pub(crate) kind: StepKind,
    position: usize,
    /// (rank, flag address) of every rank's flags released for it.
    wait_for: Vec<(u32, u64)>,
    pub(crate) copies: Vec<LoopbackCopy>,
    release: Vec<u64>,
}

/// Every rank's steps (`per_rank[r]`: rank `r`'s, resolved) joined into the loopback's:
/// each send paired with the receive NCCL would match it with.
pub(crate) fn pair_steps(
    per_rank: Vec<Vec<ResolvedStep>>,
    buffers: &BufferRanges,
) -> Result<Vec<LoopbackStep>, NetworkError> {
    let count = per_rank.first().map_or(0, Vec::len);
    if per_rank.iter().any(|steps| steps.len() != count) {
        return Err(NetworkError::Unpaired {
            step: "a call".to_string(),
            detail: "the ranks' calls have different numbers of steps".to_string(),
        });
    }
    let mut ranks: Vec<std::vec::IntoIter<ResolvedStep>> =
        per_rank.into_iter().map(Vec::into_iter).collect();
    let mut joined = Vec::with_capacity(count);
    for _ in 0..count {
        let steps: Vec<ResolvedStep> = ranks.iter_mut().filter_map(Iterator::next).collect();
        joined.push(pair_step(steps, buffers)?);
    }
    Ok(joined)
}

/// Step `i` of every rank (`steps[r]`: rank `r`'s) as one loopback step.
fn pair_step(
    steps: Vec<ResolvedStep>,
    buffers: &BufferRanges,
) -> Result<LoopbackStep, NetworkError> {
    let kind = steps[0].kind;
    let unpaired = |detail: String| NetworkError::Unpaired {
        step: kind.to_string(),
        detail,
    };
    if steps.iter().any(|s| s.kind != kind) {
        return Err(unpaired("the ranks' steps differ in kind".to_string()));
    }
    // Each rank's receives, by source, in issue order: the n-th send from a source meets
    // the n-th of these.
    let mut pending: Vec<Vec<std::collections::VecDeque<(u64, u64)>>> = steps
        .iter()
        .enumerate()
        .map(|(to, step)| {
            let mut by_source = vec![std::collections::VecDeque::new(); steps.len()];
            for &(peer, address, bytes) in &step.receives {
                by_source
                    .get_mut(peer as usize)
                    .ok_or_else(|| {
                        unpaired(format!(
                            "rank {to} receives from rank {peer}, which is not one of the {} ranks",
                            steps.len()
                        ))
                    })?
                    .push_back((address, bytes));
            }
            Ok(by_source)
        })
        .collect::<Result<_, NetworkError>>()?;
    let mut copies = Vec::new();
    for (from, step) in steps.iter().enumerate() {
        for &(to, source, bytes) in &step.sends {
            let received = pending
                .get_mut(to as usize)
                .and_then(|by_source| by_source[from].pop_front());
            match received {
                Some((destination, expected)) if expected == bytes => copies.push(
                    LoopbackCopy::single(from as u32, to, source, destination, bytes),
                ),
                Some((_, expected)) => {
                    return Err(unpaired(format!(
                        "rank {from} sends rank {to} {bytes} B, which receives {expected} B"
                    )));
                }
                None => {
                    return Err(unpaired(format!(
                        "rank {from} sends rank {to} {bytes} B that no receive of it takes"
                    )));
                }
            }
        }
    }
    for (to, by_source) in pending.iter().enumerate() {
        if let Some(from) = by_source.iter().position(|queue| !queue.is_empty()) {
            return Err(unpaired(format!(
                "rank {to} receives from rank {from} more than it sends"
            )));
        }
    }
    let position = steps[0].position;
    let wait_for = steps
        .iter()
        .enumerate()
        .flat_map(|(rank, step)| step.wait_for.iter().map(move |&flag| (rank as u32, flag)))
        .collect();
    let release = steps.into_iter().flat_map(|step| step.release).collect();
    Ok(LoopbackStep {
        kind,
        position,
        wait_for,
        copies: coalesced(copies, buffers),
        release,
    })
}

/// The loopback's metadata step of calls of one tokens bound.
struct LoopbackMetadata {
    tokens_bound: u32,
    step: LoopbackStep,
}

/// The emulated nodes' network: one stream that runs every rank's steps.
pub(crate) struct LoopbackPath {
    stream: Arc<CudaStream>,
    /// Releases a stalled call's flags (never waits on the loopback stream).
    side: Arc<CudaStream>,
    ep: ExpertParallelPlan,
    network: NetworkPlan,
    shape: LayerShape,
    /// Per rank, the workspace buffers its steps move.
    buffers: Vec<StepBuffers>,
    /// Where 2D copies may run: every rank's buffers.
    ranges: BufferRanges,
    metadata: RefCell<LoopbackMetadata>,
    /// Every rank's rows per chunk (its `NetSendRows`, then its `RecvRows`), copied back
    /// after each metadata step.
    rows: HostReadback,
    /// The steps of the calls in flight, the events after them and the calls' ends: how
    /// far the host may run ahead of the stream, where a stall is, and the flags a stall
    /// releases.
    calls: CallsInFlight<LoopbackStep>,
    limit: Duration,
    calls_outstanding: Cell<u32>,
    /// The epoch of the last call enqueued: what a stall releases the flags of the calls in
    /// flight with (each waits for at least its own call's).
    last_epoch: Cell<u32>,
    /// Set when even the released flags did not drain the stream: nothing more is
    /// enqueued, and the layer leaks its buffers rather than free them under it.
    abandoned: Cell<bool>,
}

impl LoopbackPath {
    /// The loopback of `network` for `ranks` virtual ranks, `buffer(rank, id)` giving the
    /// device address and bytes of a rank's workspace buffer; every step of a call of
    /// max_tokens resolved (every range checked, every send paired), its metadata kept.
    pub(crate) fn new(
        stream: Arc<CudaStream>,
        side: Arc<CudaStream>,
        ep: &ExpertParallelPlan,
        network: &NetworkPlan,
        shape: &LayerShape,
        buffer: impl Fn(u32, BufferId) -> Result<(u64, u64), NetworkError>,
    ) -> Result<Self, NetworkError> {
        let bound = shape.max_tokens;
        // Every chunk full on every rank: each range such a call can have is checked.
        let full = ChunkRows::full(network, shape, bound);
        let buffers = (0..ep.ranks)
            .map(|rank| {
                let steps = network.steps(ep, shape, rank, bound, &full);
                StepBuffers::for_steps(&steps, |id| buffer(rank, id))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ranges = BufferRanges::of(&buffers);
        let mut steps = resolve_paired(&buffers, &ranges, network.chunks, |rank| {
            network.steps(ep, shape, rank, bound, &full)
        })?;
        let metadata = LoopbackMetadata {
            tokens_bound: bound,
            step: steps.remove(0),
        };
        let mut sources = Vec::with_capacity(2 * buffers.len());
        for rank_buffers in &buffers {
            sources.extend(rank_buffers.rows_sources(network)?);
        }
        let rows = HostReadback::new(&stream, ROWS_PER_CHUNK, sources)?;
        let calls = CallsInFlight::new(&stream, network)?;
        Ok(LoopbackPath {
            stream,
            side,
            ep: ep.clone(),
            network: network.clone(),
            shape: shape.clone(),
            buffers,
            ranges,
            metadata: RefCell::new(metadata),
            rows,
            calls,
            limit: Duration::from_millis(network.wait_limit_ms),
            calls_outstanding: Cell::new(0),
            last_epoch: Cell::new(0),
            abandoned: Cell::new(false),
        })
    }

    /// The stream the steps run on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes the metadata step of the calls that of `tokens_bound`.
    fn metadata_for(&self, tokens_bound: u32) -> Result<(), NetworkError> {
        if self.metadata.borrow().tokens_bound == tokens_bound {
            return Ok(());
        }
        let mut steps = resolve_paired(&self.buffers, &self.ranges, self.network.chunks, |rank| {
            vec![
                self.network
                    .metadata_step(&self.ep, &self.shape, rank, tokens_bound),
            ]
        })?;
        *self.metadata.borrow_mut() = LoopbackMetadata {
            tokens_bound,
            step: steps.remove(0),
        };
        Ok(())
    }

    fn refuse_if_abandoned(&self) -> Result<(), NetworkError> {
        if self.abandoned.get() {
            return Err(NetworkError::LoopbackAbandoned);
        }
        Ok(())
    }

    /// Before a call is enqueued: waits (at most the plan's bound) until the stream holds
    /// fewer than [`CALLS_AHEAD`](crate::network::CALLS_AHEAD) calls; past the bound, the
    /// stall [`LoopbackPath::wait`] reports.
    pub(crate) fn make_room(&self) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        if self.calls.oldest_ended_by(Instant::now() + self.limit)? {
            return Ok(());
        }
        Err(self.recover(self.limit)?)
    }

    /// Enqueues the metadata step of every rank for the call of `epoch`, in which no rank
    /// passes more than `tokens_bound` tokens, then (unless the call moves whole chunks) the
    /// copy of every rank's rows per chunk to the host; [`LoopbackPath::enqueue_dispatch`]
    /// follows.
    pub(crate) fn enqueue_metadata(
        &self,
        epoch: u32,
        tokens_bound: u32,
    ) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        self.metadata_for(tokens_bound)?;
        self.calls_outstanding
            .set(self.calls_outstanding.get().saturating_add(1));
        self.last_epoch.set(epoch);
        let metadata = self.metadata.borrow();
        self.calls
            .begin(&self.stream, epoch, metadata.step.clone())?;
        self.bind()?;
        self.enqueue_step(&metadata.step, epoch)?;
        if self.network.moves_whole_chunks(tokens_bound) {
            return Ok(());
        }
        self.rows.enqueue(&self.stream)
    }

    /// Pairs every rank's chunk steps of the call whose metadata was enqueued last and
    /// enqueues the dispatch ones: whole chunks where the plan moves them at the call's
    /// bound, else sized by the rows per chunk, once the host has read them back (waiting at
    /// most the plan's bound: past it, the stall [`LoopbackPath::wait`] reports). The
    /// return steps follow with [`LoopbackPath::enqueue_results`] (after the ranks' compute
    /// kernels, or the bulk-synchronous variant's combine kernels).
    pub(crate) fn enqueue_dispatch(&self, epoch: u32) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        let tokens_bound = self.metadata.borrow().tokens_bound;
        let rows = if self.network.moves_whole_chunks(tokens_bound) {
            let full = ChunkRows::full(&self.network, &self.shape, tokens_bound);
            vec![full; self.ep.ranks as usize]
        } else {
            self.read_rows(tokens_bound)?
        };
        let steps = resolve_paired(&self.buffers, &self.ranges, self.network.chunks, |rank| {
            self.network.chunk_steps(
                &self.ep,
                &self.shape,
                rank,
                tokens_bound,
                &rows[rank as usize],
            )
        })?;
        self.calls.extend(steps);
        self.enqueue(epoch, |kind| matches!(kind, StepKind::Dispatch { .. }))
    }

    /// Every rank's rows per chunk of the call whose metadata was enqueued last, once the
    /// stream has copied them, checked against `tokens_bound`. The copy follows every call
    /// enqueued since the last wait: past the plan's bound per such call, a step ahead of it
    /// waits for a flag no kernel released.
    fn read_rows(&self, tokens_bound: u32) -> Result<Vec<ChunkRows>, NetworkError> {
        let bound = self
            .limit
            .saturating_mul(self.calls_outstanding.get().max(1));
        let Some(counts) = self.rows.read_by(Instant::now() + bound)? else {
            return Err(self.recover(bound)?);
        };
        counts
            .chunks(2)
            .enumerate()
            .map(|(rank, counts)| {
                ChunkRows::read(
                    &self.network,
                    &self.shape,
                    tokens_bound,
                    &counts[0],
                    &counts[1],
                )
                .map_err(|source| NetworkError::ImpossibleRows {
                    rank: rank as u32,
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .inspect_err(|_| self.abandoned.set(true))
    }

    /// Enqueues the return steps of every rank for the call of `epoch` (each waits for
    /// every rank's combine to release its partials).
    pub(crate) fn enqueue_results(&self, epoch: u32) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        self.calls_outstanding
            .set(self.calls_outstanding.get().max(1));
        self.enqueue(epoch, |kind| matches!(kind, StepKind::Return { .. }))?;
        self.calls.record_end(&self.stream)
    }

    /// The stream memory operations are raw driver calls: they resolve their addresses in
    /// the thread's current context.
    fn bind(&self) -> Result<(), NetworkError> {
        self.stream
            .context()
            .bind_to_thread()
            .context("binding the loopback stream's context")?;
        Ok(())
    }

    /// Enqueues the chunk steps of the current call whose kind is `chosen`.
    fn enqueue(&self, epoch: u32, chosen: impl Fn(&StepKind) -> bool) -> Result<(), NetworkError> {
        self.bind()?;
        for step in self.calls.steps().iter().filter(|s| chosen(&s.kind)) {
            self.enqueue_step(step, epoch)?;
        }
        Ok(())
    }

    /// One step after every rank's flags of it.
    fn enqueue_step(&self, step: &LoopbackStep, epoch: u32) -> Result<(), NetworkError> {
        for &(_, flag) in &step.wait_for {
            stream_wait_value(&self.stream, flag, epoch, &step.kind)?;
        }
        self.run(step, epoch)
    }

    /// One step's copies, releases and event.
    fn run(&self, step: &LoopbackStep, epoch: u32) -> Result<(), NetworkError> {
        for copy in &step.copies {
            let shape = driver::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: driver::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: copy.source,
                srcArray: std::ptr::null_mut(),
                srcPitch: copy.source_pitch as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: driver::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: copy.destination,
                dstArray: std::ptr::null_mut(),
                dstPitch: copy.destination_pitch as usize,
                WidthInBytes: copy.bytes as usize,
                Height: copy.rows as usize,
            };
            // SAFETY: every row of both ranges was checked against its rank's workspace
            // buffer, which the layer holds as long as this path (and it waits for this
            // stream, bounded, before freeing them); `shape` outlives the call.
            let result = unsafe { driver::cuMemcpy2DAsync_v2(&shape, self.stream.cu_stream()) };
            stream_op(result, "cuMemcpy2DAsync", || {
                format!(
                    "copying {} of rank {} to rank {}",
                    step.kind, copy.from, copy.to
                )
            })?;
        }
        release_flags(
            &self.stream,
            &step.release,
            epoch,
            &step.kind,
            self.calls.done(step.position),
        )
    }

    /// Waits for every enqueued step, at most the plan's bound per call enqueued since the
    /// last wait. A stall is [`NetworkError::LoopbackStalled`], after the stalled flags
    /// were released from the side stream so that the stream drains.
    pub(crate) fn wait(&self) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        match drain(&self.stream, self.limit, &self.calls_outstanding)? {
            None => Ok(()),
            Some(bound) => Err(self.recover(bound)?),
        }
    }

    /// After a stall of `bound`: the error naming it, once the flags of every step of the
    /// calls in flight were released (with the last call's epoch: the waits are for at
    /// least their call's) from the side stream so that the loopback stream drains (else it
    /// is abandoned).
    fn recover(&self, bound: Duration) -> Result<NetworkError, NetworkError> {
        // Reading and writing flags below are raw driver calls on the side stream.
        self.bind()?;
        let stalled = self.stalled(bound);
        let epoch = self.last_epoch.get();
        self.calls.try_for_each_step(|step| {
            step.wait_for
                .iter()
                .try_for_each(|&(_, flag)| stream_write_value(&self.side, flag, epoch, &step.kind))
        })?;
        if !idle_by(&self.stream, Instant::now() + self.limit)? {
            self.abandoned.set(true);
        }
        self.calls_outstanding.set(0);
        Ok(stalled)
    }

    /// The error of a stall after `bound`: the first step not done, from the oldest call
    /// in flight on, and the ranks whose flags it still waits for.
    fn stalled(&self, bound: Duration) -> NetworkError {
        let Some(stalled) = self.calls.first_unfinished(|s| s.position) else {
            return NetworkError::LoopbackStalled {
                step: "the last call's last step".to_string(),
                ranks: "none known".to_string(),
                seconds: bound.as_secs_f64(),
            };
        };
        let step = &stalled.step;
        let ranks = match self.read_flags(&step.wait_for) {
            Some(values) => {
                let mut ranks: Vec<String> = step
                    .wait_for
                    .iter()
                    .zip(values)
                    .filter(|&(_, value)| (value.wrapping_sub(stalled.epoch) as i32) < 0)
                    .map(|(&(rank, _), _)| rank.to_string())
                    .collect();
                ranks.dedup();
                if ranks.is_empty() {
                    "none known (each was released by the time they were read)".to_string()
                } else {
                    ranks.join(", ")
                }
            }
            None => "unknown (their flags could not be read in time)".to_string(),
        };
        NetworkError::LoopbackStalled {
            step: format!("{} ({})", step.kind, stalled.call()),
            ranks,
            seconds: bound.as_secs_f64(),
        }
    }

    /// The u32 at each flag of `flags` (rank, device address), copied on the side stream
    /// into pinned memory and polled for at most [`FLAG_READ_LIMIT`]: the copy may wait
    /// behind the stalled step in a hardware queue the streams share, where a synchronous
    /// read would wait for ever. `None` if it failed or did not land in time.
    fn read_flags(&self, flags: &[(u32, u64)]) -> Option<Vec<u32>> {
        let sources = flags.iter().map(|&(_, flag)| (flag, 1)).collect();
        let readback = HostReadback::new(&self.side, "a stalled step's flags", sources).ok()?;
        readback.enqueue(&self.side).ok()?;
        let words = readback.read_by(Instant::now() + FLAG_READ_LIMIT).ok()??;
        Some(words.into_iter().flatten().collect())
    }

    /// Whether a stall left the stream blocked even after its flags were released.
    pub(crate) fn abandoned(&self) -> bool {
        self.abandoned.get()
    }
}

/// Every rank's steps (`steps_of(rank)`), resolved in its `buffers` and paired (copies
/// merged within `ranges`).
fn resolve_paired(
    buffers: &[StepBuffers],
    ranges: &BufferRanges,
    chunks: u32,
    steps_of: impl Fn(u32) -> Vec<NetworkStep>,
) -> Result<Vec<LoopbackStep>, NetworkError> {
    let per_rank = buffers
        .iter()
        .enumerate()
        .map(|(rank, buffers)| buffers.resolve(steps_of(rank as u32), chunks))
        .collect::<Result<Vec<_>, _>>()?;
    pair_steps(per_rank, ranges)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use moeforge_compiler::plan::network::NetworkTransport;
    use moeforge_compiler::plan::{Plan, Target};

    use super::*;

    /// The tiny layer (8 experts, top 2, max_tokens 512, chunks of 16) on 4 virtual ranks
    /// emulating 2 nodes of 2 GPUs.
    fn emulated() -> Plan {
        let text = "topology t {\n gpus_per_node = 2\n nodes = 2\n virtual_ranks = 4\n nvlink = 450 GB/s, 3 us\n network = 50 GB/s, 10 us\n}\nlayer l {\n hidden = 128\n ffn = 256\n experts = 8\n top_k = 2\n max_tokens = 512\n parallel { expert = 4 }\n topology = t\n schedule {\n  gemm1.tile = 32x64x64\n  gemm2.tile = 32x64x64\n  stages = 2\n  dispatch_chunk = 16 tokens\n  comm_blocks = 2\n }\n}\n";
        let module = moeforge_compiler::compile_source("l.moe", text).expect("checks");
        moeforge_compiler::plan::plan(&module.layers[0], &Target::h200()).expect("plans")
    }

    /// Rank `rank`'s buffer `id` at a made-up address: ranks 1 GiB apart, buffers in
    /// workspace order, each 1 MiB aligned.
    fn layout(ep: &ExpertParallelPlan) -> HashMap<(u32, BufferId), (u64, u64)> {
        let mut at = HashMap::new();
        for rank in 0..ep.ranks {
            let mut next = u64::from(rank + 1) << 30;
            for buffer in &ep.workspace {
                at.insert((rank, buffer.id), (next, buffer.bytes()));
                next += buffer.bytes().next_multiple_of(1 << 20);
            }
        }
        at
    }

    #[test]
    fn every_send_meets_the_receive_nccl_would_pair_it_with() {
        let plan = emulated();
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel");
        let network = ep.network.as_ref().expect("a network part");
        assert_eq!(network.transport, NetworkTransport::Loopback);
        let at = layout(ep);
        let shape = &plan.shape;
        let full = ChunkRows::full(network, shape, shape.max_tokens);
        let buffers: Vec<StepBuffers> = (0..ep.ranks)
            .map(|rank| {
                let steps = network.steps(ep, shape, rank, shape.max_tokens, &full);
                StepBuffers::for_steps(&steps, |id| Ok(at[&(rank, id)])).expect("buffers")
            })
            .collect();
        let ranges = BufferRanges::of(&buffers);
        let owner = |address: u64| ((address >> 30) - 1) as u32;
        // Every chunk full, or half full (the same on every rank, so each receives what its
        // rail peer sends).
        let half = |bound: u32| {
            let counts: Vec<u32> = (0..network.other_nodes() * network.chunks)
                .map(|i| network.chunk_rows_within(shape, bound, i % network.chunks) / 2)
                .collect();
            ChunkRows::read(network, shape, bound, &counts, &counts).expect("within the chunks")
        };
        for (bound, rows) in [0, 1, 17, 48, 512].into_iter().flat_map(|bound| {
            [
                (bound, ChunkRows::full(network, shape, bound)),
                (bound, half(bound)),
            ]
        }) {
            let steps_of = |rank: u32| network.steps(ep, shape, rank, bound, &rows);
            let steps = resolve_paired(&buffers, &ranges, network.chunks, steps_of).expect("pairs");
            let per_rank: Vec<Vec<_>> = (0..ep.ranks).map(steps_of).collect();
            assert_eq!(steps.len(), per_rank[0].len());
            for (i, step) in steps.iter().enumerate() {
                // As many rows as sends, each from its sender's memory into its receiver's,
                // every receive filled exactly once, with a receive's bytes.
                let sends: usize = per_rank.iter().map(|s| s[i].sends.len()).sum();
                let at = &at;
                let receives: Vec<(u64, u64)> = per_rank
                    .iter()
                    .enumerate()
                    .flat_map(|(rank, s)| {
                        s[i].receives.iter().map(move |t| {
                            (at[&(rank as u32, t.buffer)].0 + t.offset_bytes, t.bytes)
                        })
                    })
                    .collect();
                let rows: Vec<(u32, u32, u64, u64, u64)> =
                    step.copies.iter().flat_map(copy_rows).collect();
                assert_eq!((rows.len(), sends), (receives.len(), receives.len()));
                let mut filled = std::collections::HashSet::new();
                for &(from, to, source, destination, bytes) in &rows {
                    assert_eq!(owner(source), from);
                    assert_eq!(owner(destination), to);
                    assert!(
                        network.route(from, to) == moeforge_compiler::plan::network::Route::Network
                    );
                    assert!(receives.contains(&(destination, bytes)), "{:?}", step.kind);
                    assert!(filled.insert(destination), "{:?}", step.kind);
                }
                // One 2D copy per (rank, peer, receive-index array) in the metadata step:
                // each array's segments per local expert, and the counts; and per rank the
                // visit masks and the rows per chunk for its one rail peer.
                if step.kind == StepKind::Metadata && bound > 0 {
                    let pairs = 4 * 2;
                    assert_eq!(step.copies.len(), pairs * 4 + 2 * 4, "{:?}", step.copies);
                }
            }
        }
        // Dispatch chunk 1 of a full call: rank 0's rows for node 1 (its node slot 0), tokens
        // 16..32, land in its rail peer's (rank 2's) inbox from node slot 0, rows 16..32.
        let steps = resolve_paired(&buffers, &ranges, network.chunks, |rank| {
            network.steps(ep, shape, rank, 512, &full)
        })
        .expect("pairs");
        let chunk = steps
            .iter()
            .find(|s| s.kind == StepKind::Dispatch { chunk: 1 })
            .expect("chunk 1");
        let copy = chunk
            .copies
            .iter()
            .find(|c| (c.from, c.to) == (0, 2))
            .expect("0 to 2");
        let row = u64::from(plan.shape.hidden) * 2;
        assert_eq!(copy.source, at[&(0, BufferId::NetSendX)].0 + 16 * row);
        assert_eq!(copy.destination, at[&(2, BufferId::NetRecvX)].0 + 16 * row);
        assert_eq!(copy.bytes, 16 * row);
    }

    /// A copy's rows: (from, to, source, destination, bytes) each.
    fn copy_rows(copy: &LoopbackCopy) -> Vec<(u32, u32, u64, u64, u64)> {
        (0..copy.rows)
            .map(|row| {
                (
                    copy.from,
                    copy.to,
                    copy.source + row * copy.source_pitch,
                    copy.destination + row * copy.destination_pitch,
                    copy.bytes,
                )
            })
            .collect()
    }

    #[test]
    fn steps_that_do_not_pair_are_refused() {
        let step = |kind, sends, receives| ResolvedStep {
            kind,
            wait_for: Vec::new(),
            sends,
            receives,
            release: Vec::new(),
            position: 0,
        };
        let metadata = StepKind::Metadata;
        let buffers = BufferRanges(vec![(0x1000, 0x1100), (0x2000, 0x2400)]);
        // Rank 0 sends 64 B to rank 1, which expects 32 B.
        let sizes = pair_steps(
            vec![
                vec![step(metadata, vec![(1, 0x1000, 64)], Vec::new())],
                vec![step(metadata, Vec::new(), vec![(0, 0x2000, 32)])],
            ],
            &buffers,
        );
        assert!(matches!(sizes, Err(NetworkError::Unpaired { .. })));
        // Rank 1 waits for a send that never comes.
        let missing = pair_steps(
            vec![
                vec![step(metadata, Vec::new(), Vec::new())],
                vec![step(metadata, Vec::new(), vec![(0, 0x2000, 32)])],
            ],
            &buffers,
        );
        assert!(matches!(missing, Err(NetworkError::Unpaired { .. })));
        let paired = pair_steps(
            vec![
                vec![step(metadata, vec![(1, 0x1000, 32)], Vec::new())],
                vec![step(metadata, Vec::new(), vec![(0, 0x2000, 32)])],
            ],
            &buffers,
        )
        .expect("pairs");
        assert_eq!(
            paired[0].copies,
            vec![LoopbackCopy::single(0, 1, 0x1000, 0x2000, 32)]
        );
        // Rows at constant strides merge into one copy; a row off the stride starts another.
        let sends = vec![
            (1, 0x1000, 32),
            (1, 0x1020, 32),
            (1, 0x1040, 32),
            (1, 0x1070, 32),
        ];
        let receives = vec![
            (0, 0x2000, 32),
            (0, 0x2100, 32),
            (0, 0x2200, 32),
            (0, 0x2300, 32),
        ];
        let merged = pair_steps(
            vec![
                vec![step(metadata, sends.clone(), Vec::new())],
                vec![step(metadata, Vec::new(), receives.clone())],
            ],
            &buffers,
        )
        .expect("pairs");
        let copies = &merged[0].copies;
        assert_eq!(copies.len(), 2, "{copies:?}");
        assert_eq!(
            (
                copies[0].rows,
                copies[0].source_pitch,
                copies[0].destination_pitch
            ),
            (3, 0x20, 0x100)
        );
        assert_eq!(copy_rows(&copies[1]), vec![(0, 1, 0x1070, 0x2300, 32)]);
        // Rows of different buffers never merge, however they are spaced: a 2D copy spans
        // one allocation on each side.
        let split = BufferRanges(vec![(0x1000, 0x1020), (0x1020, 0x1100), (0x2000, 0x2400)]);
        let apart = pair_steps(
            vec![
                vec![step(metadata, sends[..2].to_vec(), Vec::new())],
                vec![step(metadata, Vec::new(), receives[..2].to_vec())],
            ],
            &split,
        )
        .expect("pairs");
        assert_eq!(apart[0].copies.len(), 2, "{:?}", apart[0].copies);
    }
}
