//! CUDA graphs of a single-GPU layer's repeated small calls
//! ([`Plan::call_graph_max_tokens`](moeforge_compiler::plan::Plan::call_graph_max_tokens)).
//!
//! A call's launches reach the GPU one host launch after another; replayed from a graph they
//! go as one, which took 1.4-6.3 µs off a small call that starts on an idle GPU (H200,
//! `benches/results/2026-12-03_call_graphs.md`). A graph holds the call's token count and
//! pointers, so it serves only a call that repeats them: the first such call runs its
//! launches and is remembered, the second is captured into a graph (which then runs it),
//! later ones replay that graph. Up to [`KEPT_GRAPHS`] graphs are kept per layer, the least
//! recently used dropped first; a layer whose graphs keep being dropped before they paid
//! for their capture captures only now and then ([`UNPAID_CAPTURES_BEFORE_STOPPING`],
//! [`PROBE_EVERY`]), and one whose capture failed runs every call's launches from then on.
//! A call made while the caller captures the layer's stream runs its launches into the
//! caller's graph, as without this module.
//!
//! The launches are captured from a stream of the layer's own, never the stream the layer
//! launches on: whatever else is enqueued there meanwhile (another thread's copy) stays out
//! of the graph, which is then launched on the layer's stream.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{
    self, CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus,
};
use cudarc::driver::{CudaGraph, CudaStream, DriverError};

use crate::gpu::{DriverContext, GpuError};
use crate::layer::LayerError;

/// Graphs a layer keeps: a decode loop's batch sizes, each on a few rotating buffers.
const KEPT_GRAPHS: usize = 32;
/// Calls remembered as seen once, waiting for a repeat to be captured.
const REMEMBERED_CALLS: usize = 64;
/// Replays a graph must have had when it is dropped for its capture to have paid: a capture
/// and instantiation took the host 67-88 µs, a replay 2-7 µs against 22-27 µs for the
/// layer's first call's launches (a 4-token call on an H200, two machines, 2026-12-03;
/// docs/runtime.md).
const PAYING_REPLAYS: u32 = 16;
/// Graphs dropped before they paid after which the layer captures no more: its calls cycle
/// through more keys than it keeps (a pool handing out other buffers each call), and every
/// capture would cost more than the replays it buys. The graphs it holds still replay; a
/// graph that reaches [`PAYING_REPLAYS`] replays takes one off the count.
const UNPAID_CAPTURES_BEFORE_STOPPING: u32 = 8;
/// While it does not capture, a layer still captures one in this many repeated calls, so
/// that a workload that settles on few keys gets its graphs back.
const PROBE_EVERY: u32 = 64;

/// What a call's launches bake in that can differ between calls: everything else they read
/// (weights, workspace, tensor maps, the layer's switches) is fixed when the layer is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallKey {
    pub tokens: u32,
    pub x: u64,
    pub y: u64,
    pub topk_ids: u64,
    pub topk_weights: u64,
    pub self_routed: bool,
}

/// How a call runs, from the calls seen before it.
#[derive(Debug, PartialEq, Eq)]
enum Sighting<'a, G> {
    /// Its launches, eagerly: a call not seen before.
    First,
    /// Its launches captured into a graph, then the graph: the call's first repeat.
    Capture,
    /// The graph of an earlier repeat.
    Replay(&'a G),
}

/// A kept graph and how often it was replayed.
#[derive(Debug)]
struct KeptGraph<G> {
    key: CallKey,
    graph: G,
    replays: u32,
}

/// The graphs kept and the calls seen once, least recent first.
#[derive(Debug)]
struct RecentCalls<G> {
    graphs: VecDeque<KeptGraph<G>>,
    seen_once: VecDeque<CallKey>,
    /// Graphs dropped with fewer than [`PAYING_REPLAYS`] replays, less those that reached
    /// them, at most [`UNPAID_CAPTURES_BEFORE_STOPPING`].
    unpaid_captures: u32,
    /// Repeated calls not captured while the layer did not capture ([`PROBE_EVERY`]).
    held_back: u32,
    /// Whether a capture failed: the layer then captures no more.
    gave_up: bool,
}

impl<G> RecentCalls<G> {
    fn new() -> Self {
        RecentCalls {
            graphs: VecDeque::new(),
            seen_once: VecDeque::new(),
            unpaid_captures: 0,
            held_back: 0,
            gave_up: false,
        }
    }

    /// Whether the layer captures every repeated call ([`UNPAID_CAPTURES_BEFORE_STOPPING`]).
    fn captures(&self) -> bool {
        self.unpaid_captures < UNPAID_CAPTURES_BEFORE_STOPPING
    }

    /// Captures no more (a capture failed); the graphs it holds still replay.
    fn give_up(&mut self) {
        self.gave_up = true;
    }

    /// Notes a call of `key` and says how it runs.
    fn sight(&mut self, key: CallKey) -> Sighting<'_, G> {
        if let Some(i) = self.graphs.iter().position(|kept| kept.key == key)
            && let Some(mut kept) = self.graphs.remove(i)
        {
            kept.replays = kept.replays.saturating_add(1);
            if kept.replays == PAYING_REPLAYS {
                self.unpaid_captures = self.unpaid_captures.saturating_sub(1);
            }
            self.graphs.push_back(kept);
            return self
                .graphs
                .back()
                .map_or(Sighting::First, |kept| Sighting::Replay(&kept.graph));
        }
        if self.gave_up {
            return Sighting::First;
        }
        if let Some(i) = self.seen_once.iter().position(|k| *k == key) {
            if !self.captures() {
                self.held_back = self.held_back.wrapping_add(1);
                if !self.held_back.is_multiple_of(PROBE_EVERY) {
                    return Sighting::First;
                }
            }
            self.seen_once.remove(i);
            return Sighting::Capture;
        }
        if self.seen_once.len() == REMEMBERED_CALLS {
            self.seen_once.pop_front();
        }
        self.seen_once.push_back(key);
        Sighting::First
    }

    /// Keeps `graph` for `key`, dropping the least recently used graph when full.
    fn keep(&mut self, key: CallKey, graph: G) -> Option<&G> {
        if self.graphs.len() == KEPT_GRAPHS
            && let Some(dropped) = self.graphs.pop_front()
            && dropped.replays < PAYING_REPLAYS
        {
            self.unpaid_captures = (self.unpaid_captures + 1).min(UNPAID_CAPTURES_BEFORE_STOPPING);
        }
        self.graphs.push_back(KeptGraph {
            key,
            graph,
            replays: 0,
        });
        self.graphs.back().map(|kept| &kept.graph)
    }
}

/// A captured call's graph, instantiated.
struct CapturedCall(CudaGraph);

impl CapturedCall {
    /// Enqueues the graph on `stream` (cudarc's `CudaGraph::launch` would enqueue it on the
    /// stream it was captured from).
    fn launch_on(&self, stream: &CudaStream) -> Result<(), DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: the graph is instantiated and alive while `self` is, the stream while
        // `stream` is, and both belong to one context.
        unsafe { sys::cuGraphLaunch(self.0.cu_graph_exec(), stream.cu_stream()) }.result()
    }
}

// SAFETY: a CUDA graph may be launched from any thread with its context current
// (`launch_on` binds it) and destroyed from any thread; the graph is only reached through
// `CallGraphs`' mutex, so no two threads use it at once.
unsafe impl Send for CapturedCall {}

/// A layer's graphs of repeated calls of 1 to `max_tokens` tokens (0: none).
pub(crate) struct CallGraphs {
    max_tokens: u32,
    /// The stream calls are captured from (none where `max_tokens` is 0).
    capture: Option<Arc<CudaStream>>,
    recent: Mutex<RecentCalls<CapturedCall>>,
    /// Why a capture failed, if one did (the layer then captures no more).
    failure: Mutex<Option<String>>,
}

// Graphs are destroyed with the layer's context current (cudarc's `CudaGraph` does not bind
// it), so that a failure is recorded on that context rather than on whichever is current.
impl Drop for CallGraphs {
    fn drop(&mut self) {
        if let Some(capture) = &self.capture {
            // Nothing to report from a drop: without the binding the destroy still runs.
            let _ = capture.context().bind_to_thread();
        }
    }
}

/// Ends a capture begun on `stream` when dropped before [`Capturing::end`]: a launch that
/// panicked would otherwise leave the stream capturing.
struct Capturing<'a> {
    stream: &'a Arc<CudaStream>,
    ended: bool,
}

impl Capturing<'_> {
    /// Ends the capture and instantiates its graph.
    fn end(mut self) -> Result<Option<CudaGraph>, DriverError> {
        self.ended = true;
        self.stream.end_capture(CUgraphInstantiate_flags(0))
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if !self.ended {
            // The call's error, or its panic, is what the caller sees.
            let _ = self.stream.end_capture(CUgraphInstantiate_flags(0));
        }
    }
}

impl CallGraphs {
    /// Graphs of the layer's calls on `stream`'s context; `max_tokens` 0 keeps none.
    pub fn new(stream: &CudaStream, max_tokens: u32) -> Result<Self, GpuError> {
        let capture = if max_tokens > 0 {
            Some(
                stream
                    .context()
                    .new_stream()
                    .context("creating the stream repeated calls are captured from")?,
            )
        } else {
            None
        };
        Ok(CallGraphs {
            max_tokens,
            capture,
            recent: Mutex::new(RecentCalls::new()),
            failure: Mutex::new(None),
        })
    }

    /// The largest calls it captures (0: none).
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Why a capture failed, if one did: the layer then runs every call's launches (the
    /// graphs it holds still replay).
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Graphs kept now.
    pub fn kept(&self) -> usize {
        self.recent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .graphs
            .len()
    }

    /// Runs the call `key` on `stream`: `launch` enqueues its launches on the stream it is
    /// given (`stream`, or the capture stream while a graph of the call is captured); a
    /// call that repeats replays that graph on `stream` instead. A capture that fails runs
    /// the call's launches on `stream` after all, keeps the reason ([`CallGraphs::failure`])
    /// and stops capturing.
    pub fn run(
        &self,
        stream: &CudaStream,
        key: CallKey,
        launch: impl Fn(&CudaStream) -> Result<(), LayerError>,
    ) -> Result<(), LayerError> {
        let Some(capture) = self.capture.as_ref() else {
            return launch(stream);
        };
        if !(1..=self.max_tokens).contains(&key.tokens) || caller_captures(stream)? {
            return launch(stream);
        }
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        match recent.sight(key) {
            Sighting::First => launch(stream),
            Sighting::Replay(graph) => Ok(graph
                .launch_on(stream)
                .context("replaying a repeated call's CUDA graph")?),
            Sighting::Capture => match captured(capture, &launch) {
                Ok(None) => launch(stream),
                Ok(Some(graph)) => match recent.keep(key, CapturedCall(graph)) {
                    Some(graph) => Ok(graph
                        .launch_on(stream)
                        .context("launching a repeated call's CUDA graph")?),
                    None => launch(stream),
                },
                Err(reason) => {
                    recent.give_up();
                    *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
                    launch(stream)
                }
            },
        }
    }
}

/// The call's launches captured from `capture` into a graph (`None`: they captured no
/// work), or why that failed.
fn captured(
    capture: &Arc<CudaStream>,
    launch: &impl Fn(&CudaStream) -> Result<(), LayerError>,
) -> Result<Option<CudaGraph>, String> {
    capture
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("beginning a capture: {e}"))?;
    let capturing = Capturing {
        stream: capture,
        ended: false,
    };
    let launched = launch(capture);
    // End the capture whatever the launches said, so that the stream is usable.
    let graph = capturing.end();
    launched.map_err(|e| format!("launching into a capture: {e}"))?;
    graph.map_err(|e| format!("instantiating a captured call: {e}"))
}

/// Whether the caller is capturing `stream` into a graph of its own.
fn caller_captures(stream: &CudaStream) -> Result<bool, LayerError> {
    let status = stream
        .capture_status()
        .context("asking whether the layer's stream is being captured")?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tokens: u32, x: u64) -> CallKey {
        CallKey {
            tokens,
            x,
            y: 0x2000,
            topk_ids: 0x3000,
            topk_weights: 0x4000,
            self_routed: false,
        }
    }

    #[test]
    fn a_call_is_captured_at_its_first_repeat_and_replayed_after() {
        let mut recent = RecentCalls::new();
        assert_eq!(recent.sight(key(1, 0x1000)), Sighting::First);
        assert_eq!(recent.sight(key(2, 0x1000)), Sighting::First);
        assert_eq!(recent.sight(key(1, 0x1000)), Sighting::Capture);
        assert_eq!(recent.keep(key(1, 0x1000), 10), Some(&10));
        assert_eq!(recent.sight(key(1, 0x1000)), Sighting::Replay(&10));
        assert_eq!(recent.sight(key(1, 0x1000)), Sighting::Replay(&10));
        // Another buffer, routing mode or token count is another call.
        assert_eq!(recent.sight(key(1, 0x1100)), Sighting::First);
        let routed = CallKey {
            self_routed: true,
            ..key(1, 0x1000)
        };
        assert_eq!(recent.sight(routed), Sighting::First);
        assert_eq!(recent.sight(key(2, 0x1000)), Sighting::Capture);
    }

    #[test]
    fn the_least_recently_used_graph_goes_first() {
        let mut recent = RecentCalls::new();
        for x in 0..KEPT_GRAPHS as u64 {
            recent.keep(key(1, x), x);
        }
        // Replaying the oldest makes the second oldest the one to go.
        assert_eq!(recent.sight(key(1, 0)), Sighting::Replay(&0));
        recent.keep(key(1, 99), 99);
        assert_eq!(recent.graphs.len(), KEPT_GRAPHS);
        assert_eq!(recent.sight(key(1, 0)), Sighting::Replay(&0));
        assert_eq!(recent.sight(key(1, 99)), Sighting::Replay(&99));
        assert_eq!(recent.sight(key(1, 1)), Sighting::First);
    }

    /// Calls cycling through twice as many keys as the layer keeps graphs: most graphs are
    /// dropped before their key comes back, so after a few such drops the layer stops
    /// capturing all but one in [`PROBE_EVERY`] repeats, runs the other calls' launches and
    /// replays the graphs it holds.
    #[test]
    fn calls_cycling_through_more_keys_than_kept_stop_the_captures() {
        let mut recent = RecentCalls::new();
        let keys = 2 * KEPT_GRAPHS as u64;
        let mut captures_per_round = Vec::new();
        for round in 0..40 {
            let mut captures = 0;
            for x in 0..keys {
                if recent.sight(key(1, x)) == Sighting::Capture {
                    captures += 1;
                    recent.keep(key(1, x), round);
                }
            }
            captures_per_round.push(captures);
        }
        // Round 1 fills the slots and drops unpaid graphs until the limit.
        assert_eq!(
            captures_per_round[1],
            KEPT_GRAPHS + UNPAID_CAPTURES_BEFORE_STOPPING as usize,
            "{captures_per_round:?}"
        );
        // Later, a graph that pays lets one capture through, and probes let a few more: far
        // from the capture every other call that cycling keys would cost without the limit.
        let late: usize = captures_per_round[20..].iter().sum();
        let late_calls = 20 * keys as usize;
        assert!(
            late * 8 <= late_calls,
            "{late} captures in {late_calls} calls: {captures_per_round:?}"
        );
    }

    /// After a failed capture no call is captured again; the graphs held still replay.
    #[test]
    fn a_failed_capture_stops_the_captures_for_good() {
        let mut recent = RecentCalls::new();
        assert_eq!(recent.sight(key(1, 0)), Sighting::First);
        assert_eq!(recent.sight(key(1, 0)), Sighting::Capture);
        recent.keep(key(1, 0), 0);
        recent.give_up();
        for _ in 0..2 * PROBE_EVERY {
            assert_eq!(recent.sight(key(1, 1)), Sighting::First);
        }
        assert_eq!(recent.sight(key(1, 0)), Sighting::Replay(&0));
    }

    /// Graphs replayed often enough before they are dropped do not count against capturing.
    #[test]
    fn graphs_that_paid_do_not_stop_the_captures() {
        let mut recent = RecentCalls::new();
        for x in 0..(KEPT_GRAPHS + 2 * UNPAID_CAPTURES_BEFORE_STOPPING as usize) as u64 {
            assert_eq!(recent.sight(key(1, x)), Sighting::First);
            assert_eq!(recent.sight(key(1, x)), Sighting::Capture);
            recent.keep(key(1, x), x);
            for _ in 0..PAYING_REPLAYS {
                assert_eq!(recent.sight(key(1, x)), Sighting::Replay(&x));
            }
        }
        assert!(recent.captures());
        assert_eq!(recent.graphs.len(), KEPT_GRAPHS);
    }

    #[test]
    fn calls_seen_once_are_forgotten_oldest_first() {
        let mut recent: RecentCalls<u64> = RecentCalls::new();
        for x in 0..=REMEMBERED_CALLS as u64 {
            assert_eq!(recent.sight(key(1, x)), Sighting::First);
        }
        // The first was forgotten when the list was full; the second is still there.
        assert_eq!(recent.sight(key(1, 1)), Sighting::Capture);
        assert_eq!(recent.sight(key(1, 0)), Sighting::First);
    }
}
