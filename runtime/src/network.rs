//! The host side of traffic between nodes (the plan's `network` part, see
//! `moeforge_compiler::plan::network`): the group's NCCL communicator and the network
//! stream that runs the plan's steps in every call.
//!
//! - **Communicator.** [`GroupComm`] is the group's one NCCL communicator (rank 0 draws
//!   the unique id, the control channel carries it), made through cudarc's raw `nccl`
//!   bindings so that it can be held to the plan's CTAs (`ncclConfig_t::maxCTAs`: the SMs
//!   the plan keeps free for NCCL beside the compute grids) and send and receive any byte
//!   range of the workspace on any stream.
//! - **Steps.** [`NetworkPath`] resolves the plan's steps of this rank into device
//!   addresses (each range checked against its buffer) and enqueues them per call on its
//!   own stream: before a step, `cuStreamWaitValue32` on each flag the kernels release for
//!   it (their staging of metadata and rows; for results, the combine's partials); then
//!   one NCCL group of sends and receives; then `cuStreamWriteValue32` of the call's epoch
//!   into each flag the kernels wait on. The metadata step is sized by the call's tokens
//!   bound (resolved again only when the bound changes); after it the stream copies the
//!   rows per chunk ([`ChunkRows`]: this rank's for each other node, its rail peers' for
//!   this node) into pinned host memory, and the host, while the communication kernels
//!   run, waits for that copy (bounded, `HostReadback`) and enqueues the dispatch steps
//!   sized by them; the compute kernels follow, then the return steps (the order
//!   `EpLayer::forward` keeps, and why: docs/runtime.md). No other step waits on the host,
//!   and a call within the plan's `whole_chunks_up_to` neither copies nor waits: its steps
//!   move whole chunks ([`ChunkRows::full`]).
//! - **Bounded waits.** A transfer with a peer that stopped never completes, and NCCL
//!   cannot tell over every transport. `NetworkPath::wait` polls the network stream (and a
//!   call's read-back of its rows per chunk polls their copy) until the plan's
//!   `wait_limit_ms` per call enqueued since the last wait; past it, the
//!   first unfinished step of the oldest call in flight (by the event recorded after each;
//!   the host runs at most `CALLS_AHEAD` calls ahead, `CallsInFlight`) is a
//!   [`NetworkError::Stalled`] naming this rank, the step, its call and the peers it waits
//!   for. The path is then abandoned: its communicator is never destroyed (tearing it down
//!   is a collective call of every rank on the node, the dead one too, and would wait for
//!   it) and nothing more is enqueued on its stream.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self as driver, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{result as nccl_result, sys as nccl_sys};
use moeforge_compiler::plan::ep::ExpertParallelPlan;
use moeforge_compiler::plan::network::{
    ChunkRows, ChunkRowsError, FlagRef, NetworkPlan, NetworkStep, StepKind, Transfer,
};
use moeforge_compiler::plan::{BufferId, LayerShape};
use thiserror::Error;

use crate::gpu::{DriverContext, GpuError};

#[derive(Debug, Error)]
pub enum NetworkError {
    #[error(
        "rank {rank}: the NCCL transfers of {step} ({call}) with rank(s) {peers} did not finish within {seconds:.1} s (the plan's bound per call waited for); a peer on another node stopped or never sent. The network path is abandoned: rebuild the layer (this process's NCCL stream stays blocked on the transfer, so leave the process)"
    )]
    Stalled {
        rank: u32,
        step: StepKind,
        /// Which call in flight: the last, or how many calls before it.
        call: String,
        peers: String,
        seconds: f64,
    },
    #[error(
        "rank {rank}: an earlier call's NCCL transfers stalled and the network path was abandoned; rebuild the layer"
    )]
    Abandoned { rank: u32 },
    #[error(
        "rank {rank}: NCCL could not exchange a probe with rank(s) {peers} within {seconds:.0} s at set-up; every rank must reach its peers on other nodes (check that they all started, and NCCL's network settings)"
    )]
    Unreachable {
        rank: u32,
        peers: String,
        seconds: f64,
    },
    #[error(
        "the loopback of emulated nodes waited {seconds:.1} s in {step} for the flags of rank(s) {ranks} (its staging, or its combine's partials), which no kernel released; it released them, and those of every call in flight, itself so that the layer can go on (the results of those calls are wrong; take_error reports the kernels' errors and restarts the exchange)"
    )]
    LoopbackStalled {
        step: String,
        ranks: String,
        seconds: f64,
    },
    #[error(
        "the loopback of emulated nodes was abandoned (it stayed blocked after a stall even with its flags released, or read impossible rows per chunk); rebuild the layer"
    )]
    LoopbackAbandoned,
    #[error(
        "rank {rank}: the rows per chunk read back after the metadata step are impossible ({source}); the kernels or the transfer of the counts failed. The network path (or the emulated nodes' loopback) is abandoned: rebuild the layer"
    )]
    ImpossibleRows {
        rank: u32,
        #[source]
        source: ChunkRowsError,
    },
    #[error("the plan's network steps do not pair up in {step}: {detail}")]
    Unpaired { step: String, detail: String },
    #[error("NCCL failed while {context}: {result}")]
    Nccl { context: String, result: String },
    #[error(
        "rank {rank}: joining the NCCL communicator did not finish within {seconds:.0} s (the rendezvous bound, at least 30 s); a rank stopped during set-up: see its output (NCCL's set-up stays blocked, so leave the process)"
    )]
    JoinTimeout { rank: u32, seconds: f64 },
    #[error(
        "the plan's network step moves bytes {offset}..{end} of `{buffer}`, which holds {bytes}; the plan and its workspace disagree"
    )]
    OutOfBuffer {
        buffer: &'static str,
        offset: u64,
        end: u64,
        bytes: u64,
    },
    #[error("the plan's network steps use workspace buffer `{buffer}`, which it does not list")]
    MissingBuffer { buffer: &'static str },
    #[error("{call} failed while {context}: {result:?}")]
    StreamOp {
        call: &'static str,
        context: String,
        result: CUresult,
    },
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// A [`NetworkError::Nccl`] maker for `map_err` (cudarc's `NcclError` is no
/// `std::error::Error`; its result code says what failed).
pub(crate) fn nccl_failed(
    context: impl Into<String>,
) -> impl FnOnce(nccl_result::NcclError) -> NetworkError {
    move |e| NetworkError::Nccl {
        context: context.into(),
        result: format!("{:?}", e.0),
    }
}

/// The flags the network stream waits on (`cuStreamWaitValue32`) or writes
/// (`cuStreamWriteValue32`). They are allocated with `cuMemAlloc`, not from the
/// stream-ordered pool: on the two-H200 machine (driver 580, 2026-11-30) the first wait
/// was refused with CUDA_ERROR_INVALID_VALUE while its flag was a pool allocation (and the
/// context was not bound before the call, which [`NetworkPath`] now also does); with both
/// changed, every wait and write succeeded.
pub(crate) const STREAM_MEMOP_FLAGS: [BufferId; 5] = [
    BufferId::MetaFlags,
    BufferId::NetReady,
    BufferId::NetArrived,
    BufferId::NetReturnFlags,
    BufferId::NetPartialsReady,
];

/// NCCL's "not set" for an integer field of `ncclConfig_t` (`NCCL_CONFIG_UNDEF_INT`).
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` writes.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// `NCCL_CONFIG_INITIALIZER` with `maxCTAs` set. The struct is cudarc's (NCCL 2.30's
/// layout); NCCL reads `min(size, its own size)` bytes of it, and every release since 2.14
/// only appended fields, so an older library (the machine's 2.28) reads the same prefix.
/// `version` is the library's own, so it applies no compatibility defaults.
fn config_with_max_ctas(max_ctas: u32, version: c_int) -> nccl_sys::ncclConfig_t {
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: version as u32,
        blocking: CONFIG_UNDEF_INT,
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: max_ctas as c_int,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
        graphUsageMode: CONFIG_UNDEF_INT,
        numRmaCtx: CONFIG_UNDEF_INT,
        maxP2pPeers: CONFIG_UNDEF_INT,
    }
}

/// The shortest wait for NCCL's set-up, whatever the rendezvous bound: a rendezvous
/// bound cut short for quick tests must not cut off a healthy set-up.
pub const LEAST_JOIN_WAIT: Duration = Duration::from_secs(30);

/// A communicator just made, on its way from the thread that joined it.
struct JoinedComm(nccl_sys::ncclComm_t);

// SAFETY: the thread that made it hands it over and never touches it again.
unsafe impl Send for JoinedComm {}

/// Joins the communicator (the device must be current): see [`GroupComm::init`].
fn join_communicator(
    rank: u32,
    world_size: u32,
    id: [c_char; 128],
    max_ctas: Option<u32>,
) -> Result<JoinedComm, NetworkError> {
    let id = nccl_sys::ncclUniqueId { internal: id };
    let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
    match max_ctas {
        Some(max_ctas) => {
            let version =
                nccl_result::get_nccl_version().map_err(nccl_failed("reading NCCL's version"))?;
            let mut config = config_with_max_ctas(max_ctas, version);
            // SAFETY: valid out-pointer and config; the id came from rank 0.
            unsafe {
                nccl_result::comm_init_rank_config(
                    &mut comm,
                    world_size as c_int,
                    id,
                    rank as c_int,
                    &mut config,
                )
            }
            .map_err(nccl_failed(format!(
                "joining the communicator with at most {max_ctas} CTAs (ncclCommInitRankConfig)"
            )))?;
        }
        None => {
            // SAFETY: valid out-pointer; the id came from rank 0.
            unsafe {
                nccl_result::comm_init_rank(&mut comm, world_size as c_int, id, rank as c_int)
            }
            .map_err(nccl_failed("joining the communicator (ncclCommInitRank)"))?;
        }
    }
    Ok(JoinedComm(comm))
}

/// The group's NCCL communicator.
pub struct GroupComm {
    comm: nccl_sys::ncclComm_t,
    rank: u32,
    world_size: u32,
    /// Set once a transfer stalled: the communicator is then left as it is.
    abandoned: Cell<bool>,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time; a `GroupComm`
// is owned by one layer (or set-up call) and is not `Sync`, so only its owner's thread
// uses it.
unsafe impl Send for GroupComm {}

impl GroupComm {
    /// Joins the communicator of `world_size` ranks as `rank` with the unique id `id` on
    /// `ctx`'s device, held to `max_ctas` CTAs when given. NCCL's set-up waits for every
    /// rank, and one that died after the id went round would hold it for ever: it runs on a
    /// thread of its own, awaited for `timeout` (at least [`LEAST_JOIN_WAIT`]). Past it the
    /// error is [`NetworkError::JoinTimeout`], and the thread is left blocked in NCCL with
    /// its hold on the context (a communicator it makes later is never destroyed): the
    /// process should leave, as the CLI does.
    pub(crate) fn init(
        ctx: &Arc<CudaContext>,
        rank: u32,
        world_size: u32,
        id: [c_char; 128],
        max_ctas: Option<u32>,
        timeout: Duration,
    ) -> Result<Self, NetworkError> {
        let (sent, joined) = std::sync::mpsc::channel();
        let ctx = Arc::clone(ctx);
        std::thread::Builder::new()
            .name(format!("nccl-join-{rank}"))
            .spawn(move || {
                let comm = ctx
                    .bind_to_thread()
                    .map_err(|e| NetworkError::Nccl {
                        context: "binding the device to the joining thread".to_string(),
                        result: e.to_string(),
                    })
                    .and_then(|()| join_communicator(rank, world_size, id, max_ctas));
                // The receiver is gone after a time-out: the communicator is left then.
                let _ = sent.send(comm);
            })
            .map_err(|e| NetworkError::Nccl {
                context: "starting the thread that joins the communicator".to_string(),
                result: e.to_string(),
            })?;
        let timeout = timeout.max(LEAST_JOIN_WAIT);
        match joined.recv_timeout(timeout) {
            Ok(comm) => Ok(GroupComm {
                comm: comm?.0,
                rank,
                world_size,
                abandoned: Cell::new(false),
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(NetworkError::JoinTimeout {
                rank,
                seconds: timeout.as_secs_f64(),
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(NetworkError::Nccl {
                context: "joining the communicator".to_string(),
                result: "the joining thread ended without an answer (it panicked)".to_string(),
            }),
        }
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Enqueues an all-gather of `send` (the same length on every rank) into `gathered`
    /// on `stream`.
    pub(crate) fn all_gather(
        &self,
        send: &CudaSlice<u8>,
        gathered: &mut CudaSlice<u8>,
        stream: &CudaStream,
    ) -> Result<(), NetworkError> {
        let (from, _read) = cudarc::driver::DevicePtr::device_ptr(send, stream);
        let (into, _written) = cudarc::driver::DevicePtrMut::device_ptr_mut(gathered, stream);
        // SAFETY: `gathered` holds world_size times `send`'s bytes, both on this device.
        unsafe {
            nccl_result::all_gather(
                from as *const c_void,
                into as *mut c_void,
                send.len(),
                nccl_sys::ncclDataType_t::ncclUint8,
                self.comm,
                stream.cu_stream() as nccl_sys::cudaStream_t,
            )
        }
        .map_err(nccl_failed("all-gathering"))?;
        Ok(())
    }

    /// Enqueues one NCCL group of `sends` and `receives` (peer, device address, bytes) on
    /// `stream`.
    ///
    /// # Safety
    /// Every address must hold its bytes on this device until the stream has run the group.
    unsafe fn group(
        &self,
        sends: &[(u32, u64, u64)],
        receives: &[(u32, u64, u64)],
        stream: &CudaStream,
        what: &str,
    ) -> Result<(), NetworkError> {
        let raw_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
        nccl_result::group_start().map_err(nccl_failed(format!("opening the group of {what}")))?;
        let mut failed = None;
        for &(peer, address, bytes) in sends {
            // SAFETY: the caller's contract.
            let sent = unsafe {
                nccl_result::send(
                    address as *const c_void,
                    bytes as usize,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    peer as c_int,
                    self.comm,
                    raw_stream,
                )
            };
            if let Err(e) = sent {
                failed.get_or_insert(nccl_failed(format!("sending {what} to rank {peer}"))(e));
            }
        }
        for &(peer, address, bytes) in receives {
            // SAFETY: the caller's contract.
            let received = unsafe {
                nccl_result::recv(
                    address as *mut c_void,
                    bytes as usize,
                    nccl_sys::ncclDataType_t::ncclUint8,
                    peer as c_int,
                    self.comm,
                    raw_stream,
                )
            };
            if let Err(e) = received {
                failed.get_or_insert(nccl_failed(format!("receiving {what} from rank {peer}"))(e));
            }
        }
        // The group is closed even after a failed call, so NCCL's group state stays sound.
        let closed = nccl_result::group_end().map_err(nccl_failed(format!("enqueuing {what}")));
        match failed {
            Some(error) => Err(error),
            None => closed.map(|_| ()),
        }
    }
}

impl GroupComm {
    /// Leaves the communicator as it is from now on (a transfer waits for a lost peer):
    /// see its `Drop`.
    pub(crate) fn abandon(&self) {
        self.abandoned.set(true);
    }
}

impl Drop for GroupComm {
    fn drop(&mut self) {
        if self.abandoned.get() {
            // A transfer with a dead peer never finishes: destroying or aborting the
            // communicator is a collective of every rank on the node and would wait for it.
            return;
        }
        // SAFETY: created by `init`, released once, here; every rank of a healthy group
        // drops its communicator after the layer's last call.
        let _ = unsafe { nccl_result::comm_abort(self.comm) };
    }
}

/// A step of the plan resolved to this rank's device addresses.
#[derive(Clone)]
pub(crate) struct ResolvedStep {
    pub(crate) kind: StepKind,
    /// Addresses of the flags to wait for (the kernels release them).
    pub(crate) wait_for: Vec<u64>,
    /// (peer, device address, bytes) of each send and receive, in issue order.
    pub(crate) sends: Vec<(u32, u64, u64)>,
    pub(crate) receives: Vec<(u32, u64, u64)>,
    pub(crate) release: Vec<u64>,
    /// Its place among the steps of a call of max_tokens: the index of the event recorded
    /// after its releases.
    pub(crate) position: usize,
}

/// Whether `event` (the end of `what`) has completed by `deadline`: polled, spinning for
/// [`READBACK_SPIN`] (the host waits for it on the path of a call), then sleeping between
/// polls, so the host never blocks on a stream that may wait for a lost peer.
fn event_done_by(event: &CudaEvent, deadline: Instant, what: &str) -> Result<bool, NetworkError> {
    let spin_until = Instant::now() + READBACK_SPIN;
    loop {
        if event.try_is_complete().context(format!("polling {what}"))? {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        if now < spin_until {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Calls a network stream may hold before the host enqueues another: past them the host
/// waits (bounded) for the oldest to end. A call moving whole chunks has no host wait of
/// its own, and a stream waiting for a lost peer never drains: this bounds how far the
/// host runs ahead of it and finds the stall in `forward`, within this many calls' bounds.
pub(crate) const CALLS_AHEAD: usize = 4;

/// One call's place in [`CallsInFlight`].
struct CallSlot<S> {
    epoch: Cell<u32>,
    /// The call's steps in stream order (its metadata, then its chunk steps once they are
    /// known, the return steps listed before they are enqueued).
    steps: RefCell<Vec<S>>,
    /// One per step of a call of max_tokens (the metadata, each dispatch chunk, each
    /// return chunk), recorded after the step: where a stalled call stopped.
    done: Vec<CudaEvent>,
    /// Recorded after the call's return steps, or when the next call begins if the call
    /// stopped short of them (an error while it was enqueued).
    end: CudaEvent,
    /// Whether `end` was recorded for this slot's current call.
    end_recorded: Cell<bool>,
}

/// The last [`CALLS_AHEAD`] calls on a network stream (or the emulated nodes' loopback), in
/// a ring: each call's steps, an event after each and one at its end. The host waits for
/// the end of the call [`CALLS_AHEAD`] back before it begins another
/// ([`CallsInFlight::oldest_ended_by`]), so a slot is reused only once its call is done;
/// a stall is looked for from the oldest call in flight on, since every step after a
/// stalled one waits behind it.
pub(crate) struct CallsInFlight<S> {
    slots: Vec<CallSlot<S>>,
    /// Calls begun so far: the current call is in slot `(begun - 1) % CALLS_AHEAD`.
    begun: Cell<usize>,
}

/// A step that a stall stopped at, and its call.
pub(crate) struct StalledStep<'a, S> {
    pub(crate) step: std::cell::Ref<'a, S>,
    pub(crate) epoch: u32,
    /// 0 for the last call begun, 1 for the one before it, …
    pub(crate) calls_before_last: usize,
}

impl<S> StalledStep<'_, S> {
    /// Which call, for errors.
    pub(crate) fn call(&self) -> String {
        call_in_flight(self.calls_before_last)
    }
}

/// The call in flight with `calls_before_last` calls begun after it, for errors.
fn call_in_flight(calls_before_last: usize) -> String {
    match calls_before_last {
        0 => "in the last call".to_string(),
        1 => "in the call before the last".to_string(),
        n => format!("in the call {n} before the last"),
    }
}

impl<S> CallsInFlight<S> {
    pub(crate) fn new(stream: &CudaStream, network: &NetworkPlan) -> Result<Self, NetworkError> {
        let ctx = stream.context();
        let event = |what: &str| {
            ctx.new_event(Some(driver::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .context(format!("creating {what}"))
        };
        let slots = (0..CALLS_AHEAD)
            .map(|_| {
                Ok(CallSlot {
                    epoch: Cell::new(0),
                    steps: RefCell::new(Vec::new()),
                    done: (0..1 + 2 * network.chunks)
                        .map(|_| event("a network step's event"))
                        .collect::<Result<_, _>>()?,
                    end: event("a call's end event")?,
                    end_recorded: Cell::new(false),
                })
            })
            .collect::<Result<_, NetworkError>>()?;
        Ok(CallsInFlight {
            slots,
            begun: Cell::new(0),
        })
    }

    /// Whether the call `CALLS_AHEAD` before the next one has ended by `deadline` (polled
    /// as a read-back is: the calls queued behind it may be short; true when fewer calls
    /// were begun).
    pub(crate) fn oldest_ended_by(&self, deadline: Instant) -> Result<bool, NetworkError> {
        let begun = self.begun.get();
        if begun < CALLS_AHEAD {
            return Ok(true);
        }
        event_done_by(
            &self.slots[begun % CALLS_AHEAD].end,
            deadline,
            "a call's end",
        )
    }

    fn current(&self) -> &CallSlot<S> {
        &self.slots[(self.begun.get() + CALLS_AHEAD - 1) % CALLS_AHEAD]
    }

    /// Begins the call of `epoch` with its first step (its metadata), in the slot of the
    /// call `CALLS_AHEAD` before it. A previous call that never recorded its end (an error
    /// stopped it short of its return steps) gets it now, after what it enqueued on
    /// `stream`, so that its slot is not taken while that part may still run.
    pub(crate) fn begin(
        &self,
        stream: &CudaStream,
        epoch: u32,
        metadata: S,
    ) -> Result<(), NetworkError> {
        if self.begun.get() > 0 && !self.current().end_recorded.get() {
            self.record_end(stream)?;
        }
        let slot = &self.slots[self.begun.get() % CALLS_AHEAD];
        slot.epoch.set(epoch);
        *slot.steps.borrow_mut() = vec![metadata];
        slot.end_recorded.set(false);
        self.begun.set(self.begun.get() + 1);
        Ok(())
    }

    /// Adds the current call's chunk steps, once they are known.
    pub(crate) fn extend(&self, steps: impl IntoIterator<Item = S>) {
        self.current().steps.borrow_mut().extend(steps);
    }

    /// The current call's steps.
    pub(crate) fn steps(&self) -> std::cell::Ref<'_, Vec<S>> {
        self.current().steps.borrow()
    }

    /// The event recorded after the current call's step at `position`.
    pub(crate) fn done(&self, position: usize) -> &CudaEvent {
        &self.current().done[position]
    }

    /// Records the end of the current call (after its return steps on `stream`).
    pub(crate) fn record_end(&self, stream: &CudaStream) -> Result<(), NetworkError> {
        let current = self.current();
        current
            .end
            .record(stream)
            .context("recording a call's end")?;
        current.end_recorded.set(true);
        Ok(())
    }

    /// The calls in flight, oldest first, each with how many calls were begun after it.
    fn in_flight(&self) -> impl Iterator<Item = (&CallSlot<S>, usize)> {
        slots_oldest_first(self.begun.get()).map(|(slot, after)| (&self.slots[slot], after))
    }

    /// The first step not done, from the oldest call in flight on (`position` gives a
    /// step's event); `None` where every step is done.
    pub(crate) fn first_unfinished(
        &self,
        position: impl Fn(&S) -> usize,
    ) -> Option<StalledStep<'_, S>> {
        self.in_flight().find_map(|(slot, after)| {
            let steps = slot.steps.borrow();
            let index = steps
                .iter()
                .position(|s| !slot.done[position(s)].try_is_complete().unwrap_or(false))?;
            Some(StalledStep {
                step: std::cell::Ref::map(steps, |steps| &steps[index]),
                epoch: slot.epoch.get(),
                calls_before_last: after,
            })
        })
    }

    /// Every step of the calls in flight, oldest call first, until `each` fails.
    pub(crate) fn try_for_each_step<E>(
        &self,
        mut each: impl FnMut(&S) -> Result<(), E>,
    ) -> Result<(), E> {
        for (slot, _) in self.in_flight() {
            slot.steps.borrow().iter().try_for_each(&mut each)?;
        }
        Ok(())
    }
}

/// The slots of the calls in flight once `begun` calls were begun, oldest first, each with
/// how many calls were begun after it.
fn slots_oldest_first(begun: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..begun.min(CALLS_AHEAD))
        .rev()
        .map(move |after| ((begun - 1 - after) % CALLS_AHEAD, after))
}

/// The metadata step of calls of one tokens bound, resolved.
struct MetadataStep {
    tokens_bound: u32,
    step: ResolvedStep,
}

/// Pinned host memory that a stream copies device words into, and the event after the
/// copies, polled so that the host's wait is bounded: a rank's rows per chunk
/// (`NetSendRows` and `RecvRows`, once its metadata step is done: the host's one wait per
/// call across nodes), or a stalled step's flags.
pub(crate) struct HostReadback {
    ctx: Arc<CudaContext>,
    /// What is read, for errors.
    what: &'static str,
    host: *mut u32,
    /// (device address, u32 elements) of each range copied, in order.
    sources: Vec<(u64, usize)>,
    copied: CudaEvent,
}

// SAFETY: the pinned memory belongs to this value alone; it is read only after the copies
// into it are done, and freed once.
unsafe impl Send for HostReadback {}

/// What the read-back after the metadata step holds, for errors.
pub(crate) const ROWS_PER_CHUNK: &str = "the chunks' row counts";

/// How long the host spins (yielding) on a read-back's copy before it sleeps between polls.
/// The copy may wait behind the previous call's steps on the stream (a call is tens of
/// milliseconds at most at the shipped sizes), and the chunk steps and compute kernels wait
/// for the host: a copy within this is read within microseconds of landing.
const READBACK_SPIN: Duration = Duration::from_millis(50);

impl HostReadback {
    /// Host memory for `sources` (device address, u32 elements) of `what`, on `stream`'s
    /// context.
    pub(crate) fn new(
        stream: &CudaStream,
        what: &'static str,
        sources: Vec<(u64, usize)>,
    ) -> Result<Self, NetworkError> {
        let elems: usize = sources.iter().map(|&(_, elems)| elems).sum();
        let ctx = stream.context();
        ctx.bind_to_thread()
            .context("binding the network stream's context")?;
        // SAFETY: a fresh page-locked allocation of at least one u32, freed in `Drop`.
        let host = unsafe { cudarc::driver::result::malloc_host(elems.max(1) * 4, 0) }
            .context(format!("allocating pinned host memory for {what}"))?
            as *mut u32;
        let copied = ctx
            .new_event(Some(driver::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .context(format!("creating the event after reading {what}"))?;
        Ok(HostReadback {
            ctx: Arc::clone(ctx),
            what,
            host,
            sources,
            copied,
        })
    }

    /// Enqueues the copies of every source on `stream`, then the event.
    pub(crate) fn enqueue(&self, stream: &CudaStream) -> Result<(), NetworkError> {
        let mut at = 0;
        for &(address, elems) in &self.sources {
            // SAFETY: `host` holds every source's elements in order; `address` is a checked
            // device range of `elems` u32 that lives as long as the layer.
            let result = unsafe {
                driver::cuMemcpyDtoHAsync_v2(
                    self.host.add(at).cast(),
                    address,
                    elems * 4,
                    stream.cu_stream(),
                )
            };
            stream_op(result, "cuMemcpyDtoHAsync", || {
                format!("reading back {}", self.what)
            })?;
            at += elems;
        }
        self.copied
            .record(stream)
            .context(format!("recording the copy of {}", self.what))?;
        Ok(())
    }

    /// Each source's words from the copies enqueued last, once they are done by
    /// `deadline` (polled); `None` past it.
    pub(crate) fn read_by(&self, deadline: Instant) -> Result<Option<Vec<Vec<u32>>>, NetworkError> {
        if !event_done_by(
            &self.copied,
            deadline,
            &format!("the copy of {}", self.what),
        )? {
            return Ok(None);
        }
        let mut at = 0;
        let counts = self
            .sources
            .iter()
            .map(|&(_, elems)| {
                // SAFETY: the copies into these elements are done, and the next are enqueued
                // only after this returns (by the same thread).
                let counts = unsafe { std::slice::from_raw_parts(self.host.add(at), elems) };
                at += elems;
                counts.to_vec()
            })
            .collect();
        Ok(Some(counts))
    }
}

impl Drop for HostReadback {
    fn drop(&mut self) {
        // A copy still pending (its stream stuck behind a lost peer) would land in freed
        // memory: the allocation is leaked then.
        if self.copied.try_is_complete().unwrap_or(false) && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host` in `new`, freed once, with no copy pending.
            let _ = unsafe { cudarc::driver::result::free_host(self.host.cast()) };
        }
    }
}

/// The workspace buffers a rank's steps move: device address and bytes, by id.
pub(crate) struct StepBuffers(Vec<(BufferId, u64, u64)>);

impl StepBuffers {
    /// Each buffer's device range, `[start, end)`.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0
            .iter()
            .map(|&(_, address, bytes)| (address, address + bytes))
    }

    /// The buffers `steps` name (transfers, flags waited on and released), each from
    /// `buffer(id)`: its device address and bytes.
    pub(crate) fn for_steps(
        steps: &[NetworkStep],
        buffer: impl Fn(BufferId) -> Result<(u64, u64), NetworkError>,
    ) -> Result<Self, NetworkError> {
        let mut ids: Vec<BufferId> = steps
            .iter()
            .flat_map(|step| {
                step.sends
                    .iter()
                    .chain(&step.receives)
                    .map(|t| t.buffer)
                    .chain(step.release.iter().chain(&step.wait_for).map(|f| f.buffer))
                    .collect::<Vec<_>>()
            })
            .collect();
        ids.sort_by_key(|id| id.name());
        ids.dedup();
        Ok(StepBuffers(
            ids.into_iter()
                .map(|id| buffer(id).map(|(base, bytes)| (id, base, bytes)))
                .collect::<Result<_, _>>()?,
        ))
    }

    /// The address of `bytes` bytes at `offset` of buffer `id`, checked against its size.
    fn address(&self, id: BufferId, offset: u64, bytes: u64) -> Result<u64, NetworkError> {
        let &(_, base, size) = self
            .0
            .iter()
            .find(|(b, _, _)| *b == id)
            .ok_or(NetworkError::MissingBuffer { buffer: id.name() })?;
        if offset + bytes > size {
            return Err(NetworkError::OutOfBuffer {
                buffer: id.name(),
                offset,
                end: offset + bytes,
                bytes: size,
            });
        }
        Ok(base + offset)
    }

    /// Where a rank's rows per chunk are read back from: its `NetSendRows`, then its
    /// `RecvRows` (device address, u32 elements: other nodes × chunks each).
    pub(crate) fn rows_sources(
        &self,
        network: &NetworkPlan,
    ) -> Result<[(u64, usize); 2], NetworkError> {
        let elems = u64::from(network.other_nodes() * network.chunks);
        let source = |id: BufferId| -> Result<(u64, usize), NetworkError> {
            Ok((self.address(id, 0, 4 * elems)?, elems as usize))
        };
        Ok([source(BufferId::NetSendRows)?, source(BufferId::RecvRows)?])
    }

    /// The plan's `steps` resolved to addresses, each placed among `chunks` chunks.
    pub(crate) fn resolve(
        &self,
        steps: Vec<NetworkStep>,
        chunks: u32,
    ) -> Result<Vec<ResolvedStep>, NetworkError> {
        let flag = |f: &FlagRef| self.address(f.buffer, f.index * 4, 4);
        let transfers = |transfers: &[Transfer]| {
            transfers
                .iter()
                .map(|t| {
                    Ok((
                        t.peer,
                        self.address(t.buffer, t.offset_bytes, t.bytes)?,
                        t.bytes,
                    ))
                })
                .collect::<Result<Vec<_>, NetworkError>>()
        };
        steps
            .into_iter()
            .map(|step| {
                Ok(ResolvedStep {
                    kind: step.kind,
                    wait_for: step.wait_for.iter().map(flag).collect::<Result<_, _>>()?,
                    sends: transfers(&step.sends)?,
                    receives: transfers(&step.receives)?,
                    release: step
                        .release
                        .iter()
                        .map(flag)
                        .collect::<Result<Vec<_>, _>>()?,
                    position: match step.kind {
                        StepKind::Metadata => 0,
                        StepKind::Dispatch { chunk } => 1 + chunk as usize,
                        StepKind::Return { chunk } => 1 + (chunks + chunk) as usize,
                    },
                })
            })
            .collect()
    }
}

/// This rank's traffic between nodes: its communicator, stream and the steps of its calls.
pub struct NetworkPath {
    comm: GroupComm,
    stream: Arc<CudaStream>,
    /// What the steps are planned from: the layer's expert-parallel plan, its network part
    /// and its shape.
    ep: ExpertParallelPlan,
    network: NetworkPlan,
    shape: LayerShape,
    buffers: StepBuffers,
    /// The metadata step of the last tokens bound enqueued.
    metadata: RefCell<MetadataStep>,
    /// This rank's rows per chunk, copied back after each metadata step.
    rows: HostReadback,
    /// The steps of the calls in flight, the events after them and the calls' ends: how
    /// far the host may run ahead of the stream, and where a stall is.
    calls: CallsInFlight<ResolvedStep>,
    limit: Duration,
    /// Calls whose steps were enqueued since the last wait: the host's bound is one
    /// `limit` per call, so that a backlog of calls (a bench's timed loop) that runs at
    /// its pace is not taken for a stall.
    calls_outstanding: Cell<u32>,
}

impl NetworkPath {
    /// This rank's path for `network`, `ep`'s network part, with `buffer(id)` giving a
    /// workspace buffer's device address and bytes on `stream`'s device. Resolves the
    /// metadata step of a call of max_tokens (every range of every step such a call can
    /// have checked against its buffer): the default bound.
    pub(crate) fn new(
        comm: GroupComm,
        stream: Arc<CudaStream>,
        ep: &ExpertParallelPlan,
        network: &NetworkPlan,
        shape: &LayerShape,
        buffer: impl Fn(BufferId) -> Result<(u64, u64), NetworkError>,
    ) -> Result<Self, NetworkError> {
        let rank = comm.rank();
        let bound = shape.max_tokens;
        let full = ChunkRows::full(network, shape, bound);
        let steps = network.steps(ep, shape, rank, bound, &full);
        let buffers = StepBuffers::for_steps(&steps, buffer)?;
        let mut resolved = buffers.resolve(steps, network.chunks)?;
        let metadata = MetadataStep {
            tokens_bound: bound,
            step: resolved.remove(0),
        };
        let rows = HostReadback::new(
            &stream,
            ROWS_PER_CHUNK,
            buffers.rows_sources(network)?.to_vec(),
        )?;
        let calls = CallsInFlight::new(&stream, network)?;
        Ok(NetworkPath {
            comm,
            stream,
            ep: ep.clone(),
            network: network.clone(),
            shape: shape.clone(),
            buffers,
            metadata: RefCell::new(metadata),
            rows,
            calls,
            limit: Duration::from_millis(network.wait_limit_ms),
            calls_outstanding: Cell::new(0),
        })
    }

    /// Makes the metadata step of this rank's calls that of `tokens_bound`, resolving it
    /// when the bound differs from the last call's.
    fn metadata_for(&self, tokens_bound: u32) -> Result<(), NetworkError> {
        if self.metadata.borrow().tokens_bound == tokens_bound {
            return Ok(());
        }
        let step =
            self.network
                .metadata_step(&self.ep, &self.shape, self.comm.rank(), tokens_bound);
        let mut resolved = self.buffers.resolve(vec![step], self.network.chunks)?;
        *self.metadata.borrow_mut() = MetadataStep {
            tokens_bound,
            step: resolved.remove(0),
        };
        Ok(())
    }

    /// Opens NCCL's connections to every network peer with one small exchange, waited
    /// for at most `timeout`: a peer that cannot be reached is a set-up error, not a
    /// stall in the first call.
    pub(crate) fn connect(&self, peers: &[u32], timeout: Duration) -> Result<(), NetworkError> {
        const PROBE_BYTES: usize = 1024;
        let bytes = PROBE_BYTES * peers.len().max(1);
        let send = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .context("allocating the connection probe")?;
        let received = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .context("allocating the connection probe")?;
        let at = |slice: &CudaSlice<u8>, i: usize| {
            crate::layer::ptr(slice, &self.stream) + (i * PROBE_BYTES) as u64
        };
        let sends: Vec<_> = peers
            .iter()
            .enumerate()
            .map(|(i, &peer)| (peer, at(&send, i), PROBE_BYTES as u64))
            .collect();
        let receives: Vec<_> = peers
            .iter()
            .enumerate()
            .map(|(i, &peer)| (peer, at(&received, i), PROBE_BYTES as u64))
            .collect();
        // SAFETY: both probes hold every peer's range and live until the wait below.
        unsafe {
            self.comm
                .group(&sends, &receives, &self.stream, "the connection probe")?
        };
        if !idle_by(&self.stream, Instant::now() + timeout)? {
            self.abandon();
            // The stuck probe may still receive into these: leaked, not freed. (Freeing
            // is ordered on this stream after the stuck transfer where the device frees
            // asynchronously, and would wait for it forever where it does not.)
            std::mem::forget(send);
            std::mem::forget(received);
            return Err(NetworkError::Unreachable {
                rank: self.comm.rank(),
                peers: peers
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                seconds: timeout.as_secs_f64(),
            });
        }
        Ok(())
    }

    /// The stream the steps run on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// How long the host waits for one call's steps (the plan's `wait_limit_ms`).
    pub(crate) fn wait_limit(&self) -> Duration {
        self.limit
    }

    /// An error once the path was abandoned (after a stall, or a failure part-way through
    /// enqueueing a call's steps).
    pub(crate) fn refuse_if_abandoned(&self) -> Result<(), NetworkError> {
        if self.abandoned() {
            return Err(NetworkError::Abandoned {
                rank: self.comm.rank(),
            });
        }
        Ok(())
    }

    /// Before a call is enqueued: waits (at most the plan's bound) until the stream holds
    /// fewer than [`CALLS_AHEAD`] calls; past the bound the oldest stalled
    /// ([`NetworkError::Stalled`], naming its first unfinished step).
    pub(crate) fn make_room(&self) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        if self.calls.oldest_ended_by(Instant::now() + self.limit)? {
            return Ok(());
        }
        Err(self.stalled(self.limit))
    }

    /// Enqueues the metadata step of the call of `epoch`, in which no rank passes more than
    /// `tokens_bound` tokens (the same bound on every rank: see
    /// [`NetworkPlan::metadata_step`]), after the flags the kernels release for it, then the
    /// copy of the rows per chunk to the host. [`NetworkPath::enqueue_dispatch`] follows.
    pub(crate) fn enqueue_metadata(
        &self,
        epoch: u32,
        tokens_bound: u32,
    ) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        self.abandon_on_error(self.metadata_for(tokens_bound))?;
        // The stream memory operations below are raw driver calls: they resolve their
        // addresses in the thread's current context.
        self.stream
            .context()
            .bind_to_thread()
            .context("binding the network stream's context")?;
        self.calls_outstanding
            .set(self.calls_outstanding.get().saturating_add(1));
        let metadata = self.metadata.borrow();
        self.abandon_on_error(self.calls.begin(&self.stream, epoch, metadata.step.clone()))?;
        let enqueued = self.enqueue_step(&metadata.step, epoch).and_then(|()| {
            if self.network.moves_whole_chunks(metadata.tokens_bound) {
                Ok(())
            } else {
                self.rows.enqueue(&self.stream)
            }
        });
        self.abandon_on_error(enqueued)
    }

    /// Enqueues the dispatch steps of the call whose metadata step was enqueued last, each
    /// after the flags the kernels release for it: whole chunks where the plan moves them
    /// at the call's bound, else exactly the routed rows, once the host has read them back
    /// (waiting at most the plan's bound: past it [`NetworkError::Stalled`], the metadata
    /// never arrived: a peer stopped). The return steps follow with
    /// [`NetworkPath::enqueue_results`], after the compute kernels (whose combine releases
    /// them).
    pub(crate) fn enqueue_dispatch(&self, epoch: u32) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        let tokens_bound = self.metadata.borrow().tokens_bound;
        let rows = if self.network.moves_whole_chunks(tokens_bound) {
            Ok(ChunkRows::full(&self.network, &self.shape, tokens_bound))
        } else {
            self.read_rows()
        };
        // Whatever stops this call's chunk steps short leaves its NCCL groups out of step
        // with its peers': the path is abandoned then.
        let enqueued = rows.and_then(|rows| {
            let steps = self.network.chunk_steps(
                &self.ep,
                &self.shape,
                self.comm.rank(),
                tokens_bound,
                &rows,
            );
            self.calls
                .extend(self.buffers.resolve(steps, self.network.chunks)?);
            self.enqueue(epoch, |kind| matches!(kind, StepKind::Dispatch { .. }))
        });
        self.abandon_on_error(enqueued)
    }

    /// Enqueues the return steps of the call whose dispatch steps were enqueued last (each
    /// waits for this rank's combine to release its partials).
    pub(crate) fn enqueue_results(&self, epoch: u32) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        let enqueued = self
            .enqueue(epoch, |kind| matches!(kind, StepKind::Return { .. }))
            .and_then(|()| self.calls.record_end(&self.stream));
        self.abandon_on_error(enqueued)
    }

    /// Enqueues the current call's steps whose kind is `chosen`, in the plan's order.
    fn enqueue(&self, epoch: u32, chosen: impl Fn(&StepKind) -> bool) -> Result<(), NetworkError> {
        self.stream
            .context()
            .bind_to_thread()
            .context("binding the network stream's context")?;
        self.calls
            .steps()
            .iter()
            .filter(|step| chosen(&step.kind))
            .try_for_each(|step| self.enqueue_step(step, epoch))
    }

    /// The rows per chunk of the call whose metadata step was enqueued last, once the
    /// stream has copied them, checked. The copy follows every call enqueued since the last
    /// wait: past the plan's bound per such call, a transfer ahead of it never finished
    /// ([`NetworkError::Stalled`], naming it).
    fn read_rows(&self) -> Result<ChunkRows, NetworkError> {
        let bound = self
            .limit
            .saturating_mul(self.calls_outstanding.get().max(1));
        let Some(counts) = self.rows.read_by(Instant::now() + bound)? else {
            return Err(self.stalled(bound));
        };
        let rank = self.comm.rank();
        let tokens_bound = self.metadata.borrow().tokens_bound;
        ChunkRows::read(
            &self.network,
            &self.shape,
            tokens_bound,
            &counts[0],
            &counts[1],
        )
        .map_err(|source| NetworkError::ImpossibleRows { rank, source })
    }

    /// One step after its flags: its waits, group, releases and event.
    fn enqueue_step(&self, step: &ResolvedStep, epoch: u32) -> Result<(), NetworkError> {
        for &flag in &step.wait_for {
            stream_wait_value(&self.stream, flag, epoch, &step.kind)?;
        }
        self.run(step, epoch)
    }

    /// A call whose steps were enqueued only in part leaves this rank's NCCL operations
    /// out of step with its peers' (the next call's would pair with their leftovers, and
    /// equal sizes would pass unnoticed): the path cannot be used again.
    fn abandon_on_error<T>(&self, enqueued: Result<T, NetworkError>) -> Result<T, NetworkError> {
        if enqueued.is_err() {
            self.abandon();
        }
        enqueued
    }

    /// One step's group, releases and event.
    fn run(&self, step: &ResolvedStep, epoch: u32) -> Result<(), NetworkError> {
        // SAFETY: every address was checked against its workspace buffer, which the layer
        // holds for as long as it holds this path (and it waits for this stream, bounded,
        // before freeing them).
        let what = step.kind.to_string();
        unsafe {
            self.comm
                .group(&step.sends, &step.receives, &self.stream, &what)?
        };
        release_flags(
            &self.stream,
            &step.release,
            epoch,
            &step.kind,
            self.calls.done(step.position),
        )
    }

    /// Waits for every enqueued step, at most the plan's bound per call enqueued since the
    /// last wait; a step that does not finish is [`NetworkError::Stalled`], after which
    /// the path is abandoned.
    pub(crate) fn wait(&self) -> Result<(), NetworkError> {
        self.refuse_if_abandoned()?;
        match drain(&self.stream, self.limit, &self.calls_outstanding)? {
            None => Ok(()),
            Some(bound) => Err(self.stalled(bound)),
        }
    }

    /// The error for calls whose steps did not finish within `bound`, naming the first
    /// unfinished step; abandons the path.
    fn stalled(&self, bound: Duration) -> NetworkError {
        self.abandon();
        let peers_of = |step: &ResolvedStep| {
            let mut peers: Vec<u32> = step.receives.iter().map(|r| r.0).collect();
            peers.dedup();
            let peers: Vec<String> = peers.iter().map(u32::to_string).collect();
            peers.join(", ")
        };
        // Every step may have finished by now (the bound passed just before): then the
        // last one enqueued is named.
        let (step, peers, call) = match self.calls.first_unfinished(|s| s.position) {
            Some(stalled) => (stalled.step.kind, peers_of(&stalled.step), stalled.call()),
            None => {
                let steps = self.calls.steps();
                let (step, peers) = steps
                    .last()
                    .map_or((StepKind::Metadata, String::new()), |s| {
                        (s.kind, peers_of(s))
                    });
                (step, peers, call_in_flight(0))
            }
        };
        NetworkError::Stalled {
            rank: self.comm.rank(),
            step,
            call,
            peers,
            seconds: bound.as_secs_f64(),
        }
    }

    /// Leaves the communicator as it is from now on (a peer is gone: tearing it down would
    /// wait for that peer).
    pub(crate) fn abandon(&self) {
        self.comm.abandon();
    }

    /// Whether the path was abandoned after a stall.
    pub(crate) fn abandoned(&self) -> bool {
        self.comm.abandoned.get()
    }
}

/// After a step's transfers on `stream`: writes `epoch` into each flag of `release` (the
/// write fences the transfers' data before the flag), then records `done`.
pub(crate) fn release_flags(
    stream: &CudaStream,
    release: &[u64],
    epoch: u32,
    kind: &StepKind,
    done: &CudaEvent,
) -> Result<(), NetworkError> {
    for &flag in release {
        stream_write_value(stream, flag, epoch, kind)?;
    }
    done.record(stream).context("recording a network step")?;
    Ok(())
}

/// Waits until `stream` has run every call `outstanding` counts, at most `limit` per call
/// (polled: the host never blocks on a stream that may wait for ever). `None` once it did
/// (the count restarts at 0); else the bound waited, the count left as it is.
pub(crate) fn drain(
    stream: &CudaStream,
    limit: Duration,
    outstanding: &Cell<u32>,
) -> Result<Option<Duration>, NetworkError> {
    let calls = outstanding.get();
    if calls == 0 {
        return Ok(None);
    }
    let bound = limit.saturating_mul(calls);
    if !idle_by(stream, Instant::now() + bound)? {
        return Ok(Some(bound));
    }
    outstanding.set(0);
    Ok(None)
}

/// Whether `stream` has run everything enqueued on it by `deadline` (polled, so the host
/// never blocks on a stream that may wait for a lost peer).
pub(crate) fn idle_by(stream: &CudaStream, deadline: Instant) -> Result<bool, NetworkError> {
    loop {
        // SAFETY: the stream is alive.
        match unsafe { driver::cuStreamQuery(stream.cu_stream()) } {
            CUresult::CUDA_ERROR_NOT_READY => {}
            other => {
                stream_op(other, "cuStreamQuery", || {
                    "waiting for a stream".to_string()
                })?;
                return Ok(true);
            }
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A stream memory operation's result as a [`NetworkError::StreamOp`] naming `call` and
/// what it was for.
pub(crate) fn stream_op(
    result: CUresult,
    call: &'static str,
    context: impl FnOnce() -> String,
) -> Result<(), NetworkError> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(NetworkError::StreamOp {
            call,
            context: context(),
            result: other,
        }),
    }
}

/// `stream` waits until the u32 at `flag` reaches `epoch` (cyclic comparison).
pub(crate) fn stream_wait_value(
    stream: &CudaStream,
    flag: u64,
    epoch: u32,
    what: &StepKind,
) -> Result<(), NetworkError> {
    // SAFETY: `flag` is a checked address of this device's workspace.
    let result = unsafe {
        driver::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            flag,
            epoch,
            driver::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    };
    stream_op(result, "cuStreamWaitValue32", || {
        format!("waiting for the staging of {what} (flag at {flag:#x})")
    })
}

/// `stream` writes `epoch` into the u32 at `flag` once its earlier work is done (the
/// default flags fence that work's memory before the write).
pub(crate) fn stream_write_value(
    stream: &CudaStream,
    flag: u64,
    epoch: u32,
    what: &StepKind,
) -> Result<(), NetworkError> {
    // SAFETY: `flag` is a checked address of this device's workspace.
    let result = unsafe {
        driver::cuStreamWriteValue32_v2(
            stream.cu_stream(),
            flag,
            epoch,
            driver::CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    };
    stream_op(result, "cuStreamWriteValue32", || {
        format!("releasing the flags of {what} (flag at {flag:#x})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stall is looked for from the oldest call in flight on: the ring's slots in the
    /// order their calls were begun, the last begun last.
    #[test]
    fn calls_in_flight_are_walked_oldest_first() {
        assert_eq!(CALLS_AHEAD, 4, "the cases below are for a ring of 4");
        let walk = |begun| slots_oldest_first(begun).collect::<Vec<_>>();
        assert_eq!(walk(0), []);
        assert_eq!(walk(1), [(0, 0)]);
        assert_eq!(walk(3), [(0, 2), (1, 1), (2, 0)]);
        assert_eq!(walk(4), [(0, 3), (1, 2), (2, 1), (3, 0)]);
        // Calls 2..=5 in flight: call 4 took call 0's slot, call 5 call 1's.
        assert_eq!(walk(6), [(2, 3), (3, 2), (0, 1), (1, 0)]);
    }
}
