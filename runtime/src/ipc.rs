//! The GPU side of a group of rank processes on one node (see [`crate::process_group`]):
//! workspace buffers another process can map, the NCCL communicator and the exchange of
//! CUDA IPC handles that gives each rank the same peer table a single process builds.
//!
//! - **Exportable memory.** cudarc allocates from the stream-ordered pool
//!   (`cuMemAllocAsync`), whose allocations `cuIpcGetMemHandle` cannot export. The buffers
//!   peers write ([`ExpertParallelPlan::peer_buffers`]) are therefore allocated with
//!   `cuMemAlloc` (`ExportableBuffer`) and freed with `cuMemFree`.
//! - **NCCL.** Rank 0 draws NCCL's unique id and sends it over the control channel; every
//!   rank then joins the communicator ([`GroupComm`], through cudarc's `nccl` feature:
//!   `ncclCommInitRankConfig` held to the plan's `nccl_ctas` when ranks span nodes, else
//!   `ncclCommInitRank`). NVLink multicast must stay off: joining is refused unless
//!   `NCCL_NVLS_ENABLE=0` (the CLI sets it when it is unset).
//! - **Handles.** Each rank's IPC handles (64 bytes per peer buffer) travel in one NCCL
//!   all-gather, as `docs/design.md` has it: the communicator that will carry traffic
//!   between nodes also carries the set-up, and the control channel stays a small
//!   bootstrap. The all-gather's completion is awaited with a deadline, never unbounded.
//!   Each rank opens its peers' handles (`cuIpcOpenMemHandle`, peer access enabled
//!   lazily) into `PeerMappings`, which close them when dropped.
//!
//! Before any of that, the ranks compare what they are about to run over the control
//! channel: the same plan (a hash of its JSON) and one GPU each (two processes on one GPU
//! would time-slice it, and the expert-parallel kernels need every rank's blocks resident
//! at once).
//!
//! [`ExpertParallelPlan::peer_buffers`]: moeforge_compiler::plan::ep::ExpertParallelPlan::peer_buffers

use std::ffi::c_char;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::Id;
use moeforge_compiler::plan::Plan;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::gpu::{DriverContext, GpuError};
use crate::nccl_pipeline::{NcclPipelineError, nccl_available};
use crate::network::{GroupComm, NetworkError};
use crate::process_group::{ChannelError, ControlChannel};

#[derive(Debug, Error)]
pub enum GroupError {
    #[error(transparent)]
    Channel(#[from] ChannelError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("rank processes need NCCL to start: {0}")]
    NoNccl(#[source] Box<NcclPipelineError>),
    #[error("NCCL failed while {context}: {result}")]
    Nccl { context: String, result: String },
    #[error(transparent)]
    Network(#[from] NetworkError),
    #[error(
        "NCCL_NVLS_ENABLE is {value:?}; set NCCL_NVLS_ENABLE=0 before starting the rank processes (NVLink multicast stays off on the project's machines)"
    )]
    MulticastNotOff { value: String },
    #[error(
        "{call} failed while {context}: {result}; CUDA IPC needs every rank on one node, each process on its own GPU, with peer access between the GPUs"
    )]
    Ipc {
        call: &'static str,
        context: String,
        result: String,
    },
    #[error(
        "WORLD_SIZE={world_size} but the plan has {ranks} expert-parallel ranks; launch {ranks} processes (WORLD_SIZE={ranks}), or plan for {world_size} ranks"
    )]
    WorldSize { world_size: u32, ranks: u32 },
    #[error(
        "ranks {first} and {second} run on the same GPU; the expert-parallel kernels need every rank's blocks resident at once, so give each process its own GPU (LOCAL_RANK, or CUDA_VISIBLE_DEVICES)"
    )]
    SharedGpu { first: u32, second: u32 },
    #[error(
        "rank {peer} planned another layer than rank {rank} (plan hashes {theirs} and {mine}); launch every rank with the same file, --layer, --target and rank count"
    )]
    PlanMismatch {
        rank: u32,
        peer: u32,
        mine: String,
        theirs: String,
    },
    #[error(
        "the NCCL all-gather of IPC handles did not finish within {seconds:.0} s; a rank stopped during set-up"
    )]
    Timeout { seconds: f64 },
    #[error("the plan could not be written as JSON to compare it across ranks: {0}")]
    PlanJson(#[source] serde_json::Error),
}

/// An [`GroupError::Nccl`] maker for `map_err` (cudarc's `NcclError` is no
/// `std::error::Error`; its result code says what failed).
fn nccl(context: &str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> GroupError + '_ {
    move |e| GroupError::Nccl {
        context: context.to_string(),
        result: format!("{:?}", e.0),
    }
}

fn ipc_error(call: &'static str, context: impl Into<String>, result: CUresult) -> GroupError {
    GroupError::Ipc {
        call,
        context: context.into(),
        result: format!("{result:?}"),
    }
}

/// Device memory another process can map: allocated with `cuMemAlloc`, zeroed, seen by
/// moeforge's code as the [`CudaSlice`] it wraps, freed with `cuMemFree` (never given back
/// to cudarc, which would free it into the stream-ordered pool).
pub(crate) struct ExportableBuffer {
    /// Taken out only in `Drop`, to be leaked and freed with `cuMemFree`.
    slice: ManuallyDrop<CudaSlice<u8>>,
}

impl ExportableBuffer {
    /// `bytes` zeroed bytes on `stream`'s device.
    pub(crate) fn zeroed(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self, GpuError> {
        stream
            .context()
            .bind_to_thread()
            .context("binding a context")?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: `address` is a valid out-pointer; the stream's context is current.
        let result = unsafe { sys::cuMemAlloc_v2(&mut address, bytes) };
        if result != CUresult::CUDA_SUCCESS {
            return Err(GpuError::Driver {
                context: format!("allocating {bytes} exportable bytes (cuMemAlloc)"),
                source: cudarc::driver::DriverError(result),
            });
        }
        // SAFETY: `address` holds `bytes` bytes of this device, owned by the new value
        // until its `Drop` frees them with `cuMemFree`.
        let slice = unsafe { stream.upgrade_device_ptr::<u8>(address, bytes) };
        let mut buffer = ExportableBuffer {
            slice: ManuallyDrop::new(slice),
        };
        stream
            .memset_zeros(buffer.slice_mut())
            .context("zeroing an exportable buffer")?;
        Ok(buffer)
    }

    pub(crate) fn slice(&self) -> &CudaSlice<u8> {
        &self.slice
    }

    pub(crate) fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.slice
    }

    /// The handle another process opens this buffer with.
    fn handle(&self) -> Result<sys::CUipcMemHandle, GroupError> {
        let slice = self.slice();
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: the address is the base of a live cuMemAlloc allocation.
        let result = unsafe {
            sys::cuIpcGetMemHandle(&mut handle, crate::layer::ptr(slice, slice.stream()))
        };
        if result != CUresult::CUDA_SUCCESS {
            return Err(ipc_error(
                "cuIpcGetMemHandle",
                "exporting a workspace buffer",
                result,
            ));
        }
        Ok(handle)
    }
}

impl Drop for ExportableBuffer {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let stream = Arc::clone(slice.stream());
        // Work still queued may use the buffer; a failed wait leaves nothing better to do
        // than free it anyway.
        let _ = stream.synchronize();
        let address = slice.leak();
        let _ = stream.context().bind_to_thread();
        // SAFETY: allocated by cuMemAlloc in `zeroed`, freed once, here, after the
        // stream's work on it finished.
        unsafe { sys::cuMemFree_v2(address) };
    }
}

/// Bytes of one CUDA IPC memory handle.
const IPC_HANDLE_BYTES: usize = 64;

/// Peers' buffers opened in this process: closed when dropped.
pub(crate) struct PeerMappings {
    ctx: Arc<CudaContext>,
    addresses: Vec<sys::CUdeviceptr>,
}

impl Drop for PeerMappings {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for &address in &self.addresses {
            // SAFETY: opened by cuIpcOpenMemHandle in this context, closed once.
            unsafe { sys::cuIpcCloseMemHandle(address) };
        }
    }
}

/// What one rank of a group learns at set-up: every rank's addresses of the buffers peers
/// write, valid in this process, and the mappings that keep them valid.
pub(crate) struct PeerAddresses {
    /// `table[d]`: rank `d`'s buffers, in the order of [`ExpertParallelPlan::peer_buffers`].
    pub table: Vec<Vec<u64>>,
    pub mappings: PeerMappings,
}

/// A short fingerprint of a plan, for checking that every rank runs the same one.
pub fn plan_fingerprint(plan: &Plan) -> Result<String, GroupError> {
    let json = serde_json::to_vec(plan).map_err(GroupError::PlanJson)?;
    let digest = Sha256::digest(&json);
    Ok(digest.iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// Checks that every rank of `channel`'s group runs `plan` with as many ranks as the plan
/// has, each on a GPU of its own.
pub(crate) fn check_group(
    channel: &mut ControlChannel,
    plan: &Plan,
    ranks: u32,
    ctx: &CudaContext,
) -> Result<(), GroupError> {
    if channel.world_size() != ranks {
        return Err(GroupError::WorldSize {
            world_size: channel.world_size(),
            ranks,
        });
    }
    let rank = channel.rank();
    let mine = plan_fingerprint(plan)?;
    for (peer, theirs) in channel.all_gather(mine.as_bytes())?.into_iter().enumerate() {
        if theirs != mine.as_bytes() {
            return Err(GroupError::PlanMismatch {
                rank,
                peer: peer as u32,
                mine,
                theirs: String::from_utf8_lossy(&theirs).into_owned(),
            });
        }
    }
    let uuid = ctx.uuid().context("reading the GPU's UUID")?;
    let uuid: Vec<u8> = uuid.bytes.iter().map(|&b| b as u8).collect();
    let uuids = channel.all_gather(&uuid)?;
    for (first, a) in uuids.iter().enumerate() {
        if let Some(second) = uuids[first + 1..].iter().position(|b| b == a) {
            return Err(GroupError::SharedGpu {
                first: first as u32,
                second: (first + 1 + second) as u32,
            });
        }
    }
    Ok(())
}

/// Joins the group's NCCL communicator on `stream`'s device: rank 0 draws the unique id,
/// the control channel carries it to the others. With `max_ctas` (a plan with traffic
/// between nodes) NCCL is held to that many CTAs.
pub(crate) fn join_nccl(
    channel: &mut ControlChannel,
    stream: &Arc<CudaStream>,
    max_ctas: Option<u32>,
) -> Result<GroupComm, GroupError> {
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(value) if value.trim() == "0" => {}
        Ok(value) => return Err(GroupError::MulticastNotOff { value }),
        Err(_) => {
            return Err(GroupError::MulticastNotOff {
                value: "unset".to_string(),
            });
        }
    }
    nccl_available().map_err(|e| GroupError::NoNccl(Box::new(e)))?;
    let drawn = if channel.rank() == 0 {
        let id = Id::new().map_err(nccl("drawing the unique id"))?;
        id.internal().iter().map(|&c| c as u8).collect()
    } else {
        Vec::new()
    };
    let ids = channel.all_gather(&drawn)?;
    let mut internal = [0 as c_char; 128];
    if ids[0].len() != internal.len() {
        return Err(GroupError::Nccl {
            context: "receiving the unique id from rank 0".to_string(),
            result: format!("{} bytes instead of {}", ids[0].len(), internal.len()),
        });
    }
    for (slot, &byte) in internal.iter_mut().zip(&ids[0]) {
        *slot = byte as c_char;
    }
    Ok(GroupComm::init(
        stream.context(),
        channel.rank(),
        channel.world_size(),
        internal,
        max_ctas,
        channel.timeout(),
    )?)
}

/// Exchanges `buffers`' IPC handles with every rank through `comm` on `stream` (an NCCL
/// all-gather, awaited for at most `timeout`) and opens in this process the buffers of the
/// peers `reachable` says share this node. A peer on another node gets an empty row (its
/// handles cannot be opened here; the network path reaches it).
pub(crate) fn exchange(
    comm: &GroupComm,
    stream: &Arc<CudaStream>,
    buffers: &[&ExportableBuffer],
    reachable: impl Fn(u32) -> bool,
    timeout: Duration,
) -> Result<PeerAddresses, GroupError> {
    let ctx = Arc::clone(stream.context());
    let rank = comm.rank() as usize;
    let world = comm.world_size() as usize;
    let mut mine = Vec::with_capacity(buffers.len() * IPC_HANDLE_BYTES);
    for buffer in buffers {
        mine.extend(buffer.handle()?.reserved.iter().map(|&c| c as u8));
    }
    let send = stream.clone_htod(&mine).context("uploading IPC handles")?;
    let mut gathered = stream
        .alloc_zeros::<u8>(mine.len() * world)
        .context("allocating the gathered IPC handles")?;
    comm.all_gather(&send, &mut gathered, stream)?;
    if let Err(error) = wait_bounded(stream, timeout) {
        // The all-gather may wait for a lost peer for ever: the communicator is left as it
        // is, and its buffers leaked, not freed (a free ordered after the stuck transfer
        // would wait for it too).
        comm.abandon();
        std::mem::forget(send);
        std::mem::forget(gathered);
        return Err(error);
    }
    let all = stream
        .clone_dtoh(&gathered)
        .context("downloading the gathered IPC handles")?;
    let mut mappings = PeerMappings {
        ctx: Arc::clone(&ctx),
        addresses: Vec::new(),
    };
    ctx.bind_to_thread().context("binding a context")?;
    let mut table = Vec::with_capacity(world);
    for (peer, handles) in all.chunks_exact(mine.len().max(1)).enumerate().take(world) {
        if peer == rank {
            table.push(
                buffers
                    .iter()
                    .map(|b| crate::layer::ptr(b.slice(), stream))
                    .collect(),
            );
            continue;
        }
        if !reachable(peer as u32) {
            table.push(Vec::new());
            continue;
        }
        let mut row = Vec::with_capacity(buffers.len());
        for (i, bytes) in handles.chunks_exact(IPC_HANDLE_BYTES).enumerate() {
            let mut handle = sys::CUipcMemHandle {
                reserved: [0; IPC_HANDLE_BYTES],
            };
            for (slot, &byte) in handle.reserved.iter_mut().zip(bytes) {
                *slot = byte as c_char;
            }
            let mut address: sys::CUdeviceptr = 0;
            // SAFETY: a handle rank `peer` exported from a live allocation; `address` is a
            // valid out-pointer; the context of this rank is current.
            let result = unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut address,
                    handle,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            };
            if result != CUresult::CUDA_SUCCESS {
                return Err(ipc_error(
                    "cuIpcOpenMemHandle",
                    format!("opening buffer {i} of rank {peer}"),
                    result,
                ));
            }
            mappings.addresses.push(address);
            row.push(address);
        }
        table.push(row);
    }
    Ok(PeerAddresses { table, mappings })
}

/// Waits for `stream`'s work for at most `timeout` (an NCCL collective with a peer that
/// stopped would otherwise wait for ever).
fn wait_bounded(stream: &CudaStream, timeout: Duration) -> Result<(), GroupError> {
    let deadline = Instant::now() + timeout;
    loop {
        // SAFETY: the stream is alive.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            CUresult::CUDA_SUCCESS => return Ok(()),
            CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            CUresult::CUDA_ERROR_NOT_READY => {
                return Err(GroupError::Timeout {
                    seconds: timeout.as_secs_f64(),
                });
            }
            other => {
                return Err(GpuError::Driver {
                    context: "waiting for the NCCL all-gather".to_string(),
                    source: cudarc::driver::DriverError(other),
                }
                .into());
            }
        }
    }
}
