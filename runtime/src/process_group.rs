//! Expert-parallel ranks as processes, on one node or several: how a process learns its
//! rank and meets the others.
//!
//! A process is launched as one rank of a group, in the style of `torchrun`: `RANK` (this
//! process's rank), `WORLD_SIZE` (how many processes), `LOCAL_RANK` (its GPU on this node),
//! `MASTER_ADDR` and `MASTER_PORT` (where rank 0 listens), or instead of those two
//! `MOEFORGE_RENDEZVOUS=file:PATH` (a file all processes see, through which rank 0 says
//! where it listens: no port to choose). [`LaunchEnv::from_env`] reads them; a missing or
//! malformed one is a [`LaunchError`] that says what to set.
//!
//! [`ControlChannel`] is the group's host-side channel: rank 0 listens (on
//! `MASTER_PORT` of every interface, or only of loopback for a loopback `MASTER_ADDR`; or
//! on a free loopback port it writes into the rendezvous file, which it creates new and
//! removes once every rank is in), every other rank connects (retrying while rank 0 is not
//! up yet, reading the file again before each attempt) and keeps its connection for the
//! layer's life. A rank's handshake names its world size, rank, run id and plan
//! fingerprint; rank 0 answers it, and refuses (and goes on waiting) a rank of another run
//! that found the same port or file, which then fails at once rather than join the wrong
//! group. The channel carries small, rare messages only (NCCL's unique id, device and plan
//! fingerprints, rank 0's seed and the command's settings at set-up, the calls' tokens
//! bound, the bench's start barrier and every rank's times, and after a time-out the agreement to restart the
//! exchange): [`ControlChannel::all_gather`] and [`ControlChannel::barrier`]. Every message
//! has a deadline (applied to each read, so a trickle cannot stretch it), and a peer that
//! exits closes its socket, so a dead peer is an error here within the bound, never a
//! hang; rank 0 then tells the others why it ended the group. The GPU traffic itself never touches this
//! channel: the kernels exchange data through CUDA IPC mappings of each other's workspace
//! on one node (see [`crate::ep`]), and through NCCL across nodes (see
//! [`crate::network`]).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use thiserror::Error;

/// How long a rank waits for the others at a meeting point unless
/// `MOEFORGE_RENDEZVOUS_TIMEOUT` says otherwise: ranks reach set-up after compiling and
/// filling weights, which can take a minute on a cold JIT cache and full-size layers.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest rendezvous wait the environment may ask for (a day): deadlines are
/// `Instant`s, which a wait of centuries would overflow.
const MOST_RENDEZVOUS_TIMEOUT_S: f64 = 86_400.0;
/// The shortest rendezvous wait the environment may ask for (a millisecond): less would
/// be no wait at all.
const LEAST_RENDEZVOUS_TIMEOUT_S: f64 = 0.001;
/// How long rank 0 waits for a connection's handshake, which a rank sends as soon as it
/// connects, before it sets the connection aside as no rank's.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);

/// The environment variable that overrides [`DEFAULT_RENDEZVOUS_TIMEOUT`], in seconds.
pub const RENDEZVOUS_TIMEOUT_VAR: &str = "MOEFORGE_RENDEZVOUS_TIMEOUT";

/// The environment variable that names a rendezvous file (`file:PATH`) instead of
/// `MASTER_ADDR` and `MASTER_PORT`.
pub const RENDEZVOUS_VAR: &str = "MOEFORGE_RENDEZVOUS";

/// Opens every message of the channel's handshake, so that a stray client on the port
/// (another program, a rank of another run) is refused rather than misread.
const HANDSHAKE_MAGIC: u32 = 0x6d6f_6566; // "moef"

/// The largest message a rank accepts: the channel carries fingerprints and ids, not data.
const MAX_MESSAGE_BYTES: u32 = 1 << 20;

/// Pause between attempts to connect to rank 0 before it listens.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

/// The longest one attempt to connect to rank 0 may take (a dropped SYN), so that a file
/// rendezvous reads its file again and the deadline is kept.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(5);

/// A frame length no message has: rank 0 ends the group, the reason follows as a frame.
const GROUP_ENDED: u32 = u32::MAX;

/// How long rank 0 tries to tell the other ranks why it ended the group.
const END_NOTICE_WAIT: Duration = Duration::from_secs(1);

/// How much longer than rank 0 the other ranks wait in a gather: rank 0's notice of an
/// ended group has time to arrive. (A rank that enters a gather long before rank 0 may
/// still time out first: then the message says rank 0 may be waiting for another rank.)
const NOTICE_MARGIN: Duration = Duration::from_secs(3);

/// The variables that name a run, in the order they are read ([`LaunchEnv::run_id`]).
const RUN_ID_VARS: &str = "MOEFORGE_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID";

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error(
        "{var} is not set: a process of an expert-parallel group needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (as torchrun sets them); {hint}"
    )]
    Missing {
        var: &'static str,
        hint: &'static str,
    },
    #[error("{var}={value:?} is not {what}; {hint}")]
    Malformed {
        var: &'static str,
        value: String,
        what: &'static str,
        hint: &'static str,
    },
    #[error(
        "RANK={rank} is not below WORLD_SIZE={world_size}; ranks count from 0 to WORLD_SIZE - 1"
    )]
    RankOutOfRange { rank: u32, world_size: u32 },
    #[error(
        "WORLD_SIZE=1: a group of one process is the single-GPU layer; unset RANK and WORLD_SIZE (or launch 2 or more processes)"
    )]
    WorldOfOne,
    #[error(
        "{var}={value:?} is not a number of seconds from 0.001 up to a day; set it to how long a rank waits for the others (default {default} s)"
    )]
    Timeout {
        var: &'static str,
        value: String,
        default: u64,
    },
}

/// What a process of a group was told at launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: u32,
    pub world_size: u32,
    /// The GPU of this process on its node.
    pub local_rank: u32,
    pub rendezvous: Rendezvous,
    /// The bound on every wait of the [`ControlChannel`].
    pub timeout: Duration,
    /// What names this run among others that may meet at the same address:
    /// `MOEFORGE_RUN_ID`, else `TORCHELASTIC_RUN_ID` (torchrun's `--rdzv-id`) unless it is
    /// torchrun's default `none`. Rank 0 refuses a rank whose id differs.
    pub run_id: Option<String>,
}

/// Where the ranks of a group meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 listens on `addr:port` (`MASTER_ADDR`, `MASTER_PORT`).
    Tcp { addr: String, port: u16 },
    /// Rank 0 listens on a free loopback port and writes `127.0.0.1:PORT` into this file
    /// (`MOEFORGE_RENDEZVOUS=file:PATH`); the others wait for it. One node.
    File(PathBuf),
}

impl fmt::Display for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rendezvous::Tcp { addr, port } => write!(f, "{addr}:{port}"),
            Rendezvous::File(path) => write!(f, "the address in {}", path.display()),
        }
    }
}

impl LaunchEnv {
    /// Whether the process was launched as a rank of a group: `RANK` or `WORLD_SIZE` is set
    /// (a process with only one of them is launched wrong, which [`LaunchEnv::from_env`]
    /// then says).
    pub fn requested() -> bool {
        Self::requested_in(crate::env_value)
    }

    /// [`LaunchEnv::requested`] over any variable lookup (for tests).
    pub fn requested_in(var: impl Fn(&str) -> Option<String>) -> bool {
        var("RANK").is_some() || var("WORLD_SIZE").is_some()
    }

    /// Reads the launch variables of this process.
    pub fn from_env() -> Result<Self, LaunchError> {
        Self::from_vars(crate::env_value)
    }

    /// Reads the launch variables through `var` (the process environment, or a table in
    /// tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, LaunchError> {
        let get = |name: &'static str, hint: &'static str| {
            var(name).ok_or(LaunchError::Missing { var: name, hint })
        };
        let number = |name: &'static str, hint: &'static str| -> Result<u32, LaunchError> {
            let value = get(name, hint)?;
            value.trim().parse().map_err(|_| LaunchError::Malformed {
                var: name,
                value,
                what: "a whole number",
                hint,
            })
        };
        let rank = number(
            "RANK",
            "set RANK to this process's rank, 0 to WORLD_SIZE - 1",
        )?;
        let world_size = number(
            "WORLD_SIZE",
            "set WORLD_SIZE to the number of processes (the plan's expert-parallel ranks)",
        )?;
        if world_size == 0 {
            return Err(LaunchError::Malformed {
                var: "WORLD_SIZE",
                value: "0".to_string(),
                what: "a number of processes",
                hint: "set WORLD_SIZE to the number of processes (the plan's expert-parallel ranks)",
            });
        }
        if world_size == 1 {
            return Err(LaunchError::WorldOfOne);
        }
        if rank >= world_size {
            return Err(LaunchError::RankOutOfRange { rank, world_size });
        }
        let local_rank = number(
            "LOCAL_RANK",
            "set LOCAL_RANK to this process's GPU on its node (on one node, the same as RANK)",
        )?;
        let rendezvous = match var(RENDEZVOUS_VAR) {
            Some(value) => match value.strip_prefix("file:") {
                Some(path) if !path.is_empty() => Rendezvous::File(PathBuf::from(path)),
                _ => {
                    return Err(LaunchError::Malformed {
                        var: RENDEZVOUS_VAR,
                        value,
                        what: "file:PATH",
                        hint: "name a file every rank can see that does not exist yet, e.g. MOEFORGE_RENDEZVOUS=file:/tmp/moeforge-run-1, or unset it and set MASTER_ADDR and MASTER_PORT",
                    });
                }
            },
            None => {
                let addr = get(
                    "MASTER_ADDR",
                    "set MASTER_ADDR to the address rank 0 listens on (127.0.0.1 on one node), or MOEFORGE_RENDEZVOUS=file:PATH instead of MASTER_ADDR and MASTER_PORT",
                )?;
                let port_hint = "set MASTER_PORT to a free TCP port rank 0 listens on, e.g. 29500";
                let port_value = get("MASTER_PORT", port_hint)?;
                let port = match port_value.trim().parse::<u16>() {
                    Ok(port) if port > 0 => port,
                    _ => {
                        return Err(LaunchError::Malformed {
                            var: "MASTER_PORT",
                            value: port_value,
                            what: "a TCP port (1 to 65535)",
                            hint: port_hint,
                        });
                    }
                };
                Rendezvous::Tcp { addr, port }
            }
        };
        let timeout = match var(RENDEZVOUS_TIMEOUT_VAR) {
            None => DEFAULT_RENDEZVOUS_TIMEOUT,
            Some(value) => match value.trim().parse::<f64>() {
                Ok(seconds)
                    if (LEAST_RENDEZVOUS_TIMEOUT_S..=MOST_RENDEZVOUS_TIMEOUT_S)
                        .contains(&seconds) =>
                {
                    Duration::from_secs_f64(seconds)
                }
                _ => {
                    return Err(LaunchError::Timeout {
                        var: RENDEZVOUS_TIMEOUT_VAR,
                        value,
                        default: DEFAULT_RENDEZVOUS_TIMEOUT.as_secs(),
                    });
                }
            },
        };
        let run_id = ["MOEFORGE_RUN_ID", "TORCHELASTIC_RUN_ID"]
            .into_iter()
            .filter_map(&var)
            .map(|id| id.trim().to_string())
            .find(|id| !id.is_empty() && id != "none");
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            rendezvous,
            timeout,
            run_id,
        })
    }
}

#[derive(Debug, Error)]
pub enum ChannelError {
    #[error("MASTER_ADDR={addr:?} does not resolve to an address: {source}")]
    Resolve {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("rank 0 cannot listen on {addr}: {source}; {}", listen_hint(source))]
    Listen {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "rank {rank}: rank 0 did not answer at {addr} within {} (last error: {source}); {hint}",
        in_seconds(*seconds)
    )]
    Connect {
        rank: u32,
        addr: String,
        seconds: f64,
        #[source]
        source: io::Error,
        hint: String,
    },
    #[error(
        "rank {rank}: the process at {addr} answered the handshake with something no moeforge rank 0 sends; another program holds the port: give the group one of its own"
    )]
    NotRankZero { rank: u32, addr: String },
    #[error(
        "rank {rank}: rank 0 at {addr} took the connection but did not answer the handshake ({what}); it may have given up waiting for the group (see its output), or the port is another program's"
    )]
    NoAnswer {
        rank: u32,
        addr: String,
        what: String,
    },
    #[error("rank {rank}: rank 0 at {addr} refused this process: {reason}")]
    Refused {
        rank: u32,
        addr: String,
        reason: String,
    },
    #[error(
        "rank 0: {missing} of {world_size} ranks did not connect within {}{}; {hint}",
        in_seconds(*seconds),
        ignored_connections(*ignored, named)
    )]
    Incomplete {
        missing: u32,
        world_size: u32,
        seconds: f64,
        /// Connections set aside as no rank of this group.
        ignored: u32,
        /// The first few of them: who, and why.
        named: Vec<String>,
        hint: String,
    },
    #[error(
        "rank {rank} lost rank {peer} while {doing}: {source} (the peer process exited: see its output)"
    )]
    PeerLost {
        rank: u32,
        peer: u32,
        doing: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "rank {rank}: rank {peer} sent nothing for {} while {doing}; {}",
        in_seconds(*seconds),
        if *peer == 0 && *rank != 0 {
            format!("rank 0 passes on every rank's message, so rank 0 or any other rank may be stuck, have failed before this point, or be slower than the bound ({RENDEZVOUS_TIMEOUT_VAR}): see their output")
        } else {
            format!("it is stuck, failed before this point, or is slower than the bound ({RENDEZVOUS_TIMEOUT_VAR}): see its output")
        }
    )]
    PeerSilent {
        rank: u32,
        peer: u32,
        doing: &'static str,
        seconds: f64,
    },
    #[error("rank {rank}: the group ended: {reason}")]
    GroupEnded { rank: u32, reason: String },
    #[error("rank {rank}: rank {peer} sent a message of {bytes} bytes, above the channel's limit")]
    Oversized { rank: u32, peer: u32, bytes: u32 },
    #[error(
        "rank {rank}: a message of {bytes} bytes is above the channel's limit of {MAX_MESSAGE_BYTES} (the channel carries ids and fingerprints, not data)"
    )]
    MessageTooLong { rank: u32, bytes: usize },
    #[error(
        "rank 0: the rendezvous file {} exists already (from an earlier launch, or another run's); remove it, or name a new file in MOEFORGE_RENDEZVOUS",
        path.display()
    )]
    StaleRendezvousFile { path: PathBuf },
    #[error("rank {rank}: cannot {doing} the rendezvous file {}: {source}", path.display())]
    RendezvousFile {
        rank: u32,
        doing: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "rank {rank}: rank 0 did not write the rendezvous file {} within {}; start every rank with the same MOEFORGE_RENDEZVOUS",
        path.display(),
        in_seconds(*seconds)
    )]
    NoRendezvousFile {
        rank: u32,
        path: PathBuf,
        seconds: f64,
    },
}

/// A bound in words: whole seconds, or tenths below ten (a test's 0.3 s is not "0 s").
fn in_seconds(seconds: f64) -> String {
    if seconds < 10.0 {
        format!("{seconds:.1} s")
    } else {
        format!("{seconds:.0} s")
    }
}

/// What to do about a listener rank 0 cannot open.
fn listen_hint(source: &io::Error) -> &'static str {
    match source.kind() {
        io::ErrorKind::AddrInUse => {
            "another program or an earlier run holds the port: give each run a MASTER_PORT of its own"
        }
        io::ErrorKind::AddrNotAvailable => {
            "MASTER_ADDR is not an address of this host: set it to rank 0's host"
        }
        _ => "pick another MASTER_PORT",
    }
}

/// What every rank must share, for the time-outs' messages.
fn meeting_hint(rendezvous: &Rendezvous, world_size: u32) -> String {
    match rendezvous {
        Rendezvous::Tcp { .. } => format!(
            "launch WORLD_SIZE={world_size} processes with the same MASTER_ADDR and MASTER_PORT, rank 0 among them"
        ),
        Rendezvous::File(path) => format!(
            "launch WORLD_SIZE={world_size} processes with the same MOEFORGE_RENDEZVOUS, rank 0 among them; a file {} left by a killed run names a rank 0 that is gone: remove it and launch again",
            path.display()
        ),
    }
}

/// The group's host-side channel (see the module documentation). Rank 0 holds one
/// connection per other rank (index `r - 1`); every other rank holds one, to rank 0.
pub struct ControlChannel {
    rank: u32,
    world_size: u32,
    timeout: Duration,
    links: Vec<TcpStream>,
    /// Why the group ended, once a gather failed: every later gather is that error at
    /// once (the ranks' messages are out of step after a failure).
    ended: Option<String>,
}

/// What a rank says about itself when it connects, and rank 0 checks: a rank of another
/// group (another run on the same port, a stale rendezvous file) is refused, not taken in.
struct Handshake {
    world_size: u32,
    rank: u32,
    /// [`LaunchEnv::run_id`], empty where none was given.
    run_id: String,
    /// What every rank of one run computes alike (the plan's fingerprint).
    fingerprint: String,
}

impl Handshake {
    fn encode(&self) -> Vec<u8> {
        let mut bytes: Vec<u8> = [HANDSHAKE_MAGIC, self.world_size, self.rank]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        bytes.extend_from_slice(format!("{}\n{}", self.run_id, self.fingerprint).as_bytes());
        bytes
    }

    /// The handshake in `bytes`, or `None` for bytes that are no moeforge handshake.
    fn decode(bytes: &[u8]) -> Option<Handshake> {
        let word = |i: usize| {
            Some(u32::from_le_bytes(
                bytes.get(i * 4..i * 4 + 4)?.try_into().ok()?,
            ))
        };
        if word(0)? != HANDSHAKE_MAGIC {
            return None;
        }
        let text = std::str::from_utf8(bytes.get(12..)?).ok()?;
        let (run_id, fingerprint) = text.split_once('\n')?;
        Some(Handshake {
            world_size: word(1)?,
            rank: word(2)?,
            run_id: run_id.to_string(),
            fingerprint: fingerprint.to_string(),
        })
    }

    /// Why rank 0 (`ours`) refuses `self`, if it does.
    fn refusal(&self, ours: &Handshake) -> Option<String> {
        if self.run_id != ours.run_id {
            let id = |id: &str| {
                if id.is_empty() {
                    "none".to_string()
                } else {
                    format!("{id:?}")
                }
            };
            return Some(format!(
                "a rank of another run (run id {}, this group's {}; {RUN_ID_VARS})",
                id(&self.run_id),
                id(&ours.run_id)
            ));
        }
        if self.world_size != ours.world_size {
            return Some(format!(
                "a rank launched with WORLD_SIZE={} (this group has {})",
                self.world_size, ours.world_size
            ));
        }
        if self.fingerprint != ours.fingerprint {
            return Some(format!(
                "a rank that planned another layer (plan {}, rank 0's {}): every rank needs the same spec, flags and moeforge build",
                self.fingerprint, ours.fingerprint
            ));
        }
        if self.rank == 0 || self.rank >= ours.world_size {
            return Some(format!("a second process claiming RANK={}", self.rank));
        }
        None
    }
}

/// Rank 0's answer to a handshake: [`HANDSHAKE_MAGIC`], then 0 (taken in) or 1 (refused,
/// the reason following).
const ANSWER_TAKEN: u32 = 0;
const ANSWER_REFUSED: u32 = 1;

fn answer(status: u32, reason: &str) -> Vec<u8> {
    let mut bytes: Vec<u8> = [HANDSHAKE_MAGIC, status]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    bytes.extend_from_slice(reason.as_bytes());
    bytes
}

impl ControlChannel {
    /// Meets the other ranks of `env`'s group: rank 0 listens and waits for every other
    /// rank; the others connect to it. `fingerprint` is what every rank of the run computes
    /// alike (the CLI passes the plan's, [`crate::ipc::plan_fingerprint`]): rank 0 refuses a
    /// rank whose fingerprint, world size or [`LaunchEnv::run_id`] differs from its own, and
    /// that rank fails at once. Returns once all are connected, or an error within
    /// `env.timeout`.
    pub fn connect(env: &LaunchEnv, fingerprint: &str) -> Result<Self, ChannelError> {
        let deadline = Instant::now() + env.timeout;
        let mine = Handshake {
            world_size: env.world_size,
            rank: env.rank,
            run_id: env.run_id.clone().unwrap_or_default(),
            fingerprint: fingerprint.to_string(),
        };
        let links = match (&env.rendezvous, env.rank) {
            (Rendezvous::Tcp { addr, port }, 0) => {
                let resolved = resolve(addr, *port)?;
                let listener = listen(listening_address(addr, resolved))?;
                accept_ranks(listener, env, &mine, deadline)?
            }
            (Rendezvous::Tcp { addr, port }, _) => {
                let master = resolve(addr, *port)?;
                vec![connect_to_master(|| Ok(master), env, &mine, deadline)?]
            }
            (Rendezvous::File(path), 0) => {
                let listener = publish(path)?;
                let links = accept_ranks(listener, env, &mine, deadline);
                // Every rank has read it (or the group failed): the next launch may reuse the
                // name. The file is this rank's: it was created new.
                let _ = std::fs::remove_file(path);
                links?
            }
            (Rendezvous::File(path), rank) => {
                // Read again before every attempt: a file replaced by a new launch names
                // its rank 0, not the gone one of the file read first.
                let master = || read_rendezvous_file(path, rank, env.timeout, deadline);
                vec![connect_to_master(master, env, &mine, deadline)?]
            }
        };
        Ok(ControlChannel {
            rank: env.rank,
            world_size: env.world_size,
            timeout: env.timeout,
            links,
            ended: None,
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// The bound on every wait of this channel (and of the group's set-up).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Every rank's `message`, in rank order (this rank's own included). Each rank must
    /// call it the same number of times. A peer that has exited or does not answer within
    /// the bound is [`ChannelError::PeerLost`] or [`ChannelError::PeerSilent`] in rank 0,
    /// which then ends the group: every other rank gets [`ChannelError::GroupEnded`] with
    /// rank 0's reason, rather than a lost rank 0. After a failure the channel stays
    /// ended: every later gather is that `GroupEnded` at once.
    pub fn all_gather(&mut self, message: &[u8]) -> Result<Vec<Vec<u8>>, ChannelError> {
        let deadline = Instant::now() + self.timeout;
        let (rank, seconds) = (self.rank, self.timeout.as_secs_f64());
        if let Some(reason) = &self.ended {
            return Err(ChannelError::GroupEnded {
                rank,
                reason: reason.clone(),
            });
        }
        if message.len() > MAX_MESSAGE_BYTES as usize {
            return Err(ChannelError::MessageTooLong {
                rank,
                bytes: message.len(),
            });
        }
        if rank != 0 {
            // Past rank 0's own bound, so that a rank that came first hears why rank 0
            // ended the group rather than blame rank 0.
            let deadline = deadline + NOTICE_MARGIN;
            let link = &mut self.links[0];
            let gathered = write_frame(link, message, deadline)
                .and_then(|()| {
                    (0..self.world_size)
                        .map(|_| read_frame(link, deadline))
                        .collect()
                })
                .map_err(|e| e.about(rank, 0, seconds));
            if let Err(error) = &gathered {
                self.ended = Some(end_reason(error));
            }
            return gathered;
        }
        let gathered = self.gather_and_share(message, deadline);
        if let Err(error) = &gathered {
            self.end_group(error);
        }
        gathered
    }

    /// Rank 0's part of [`ControlChannel::all_gather`].
    fn gather_and_share(
        &mut self,
        message: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, ChannelError> {
        let seconds = self.timeout.as_secs_f64();
        let mut all = vec![message.to_vec()];
        for (i, link) in self.links.iter_mut().enumerate() {
            let peer = i as u32 + 1;
            all.push(read_frame(link, deadline).map_err(|e| e.about(0, peer, seconds))?);
        }
        for (i, link) in self.links.iter_mut().enumerate() {
            let peer = i as u32 + 1;
            for part in &all {
                write_frame(link, part, deadline).map_err(|e| e.about(0, peer, seconds))?;
            }
        }
        Ok(all)
    }

    /// Rank 0, after a failed gather: tells every other rank why (see [`end_group`]); the
    /// reason a rank gave for leaving is passed on as it came. A rank whose frames of the
    /// gather were all written before the failure has returned from it: it hears the
    /// notice at its next gather.
    fn end_group(&mut self, error: &ChannelError) {
        let reason = end_reason(error);
        end_group(self.links.iter_mut(), &reason);
        self.ended = Some(reason);
    }

    /// Leaves the group, telling the others why: rank 0 tells every rank; another rank
    /// tells rank 0, which ends the group at its next gather and passes the reason on
    /// ([`ChannelError::GroupEnded`] everywhere).
    pub fn leave(mut self, reason: &str) {
        let reason = format!("rank {} left the group: {reason}", self.rank);
        end_group(self.links.iter_mut(), &reason);
    }

    /// Returns once every rank has called it (or with the error of a lost peer).
    pub fn barrier(&mut self) -> Result<(), ChannelError> {
        self.all_gather(&[]).map(drop)
    }
}

/// Why a group ends after `error`: a reason that came with a notice is passed on as it
/// came.
fn end_reason(error: &ChannelError) -> String {
    match error {
        ChannelError::GroupEnded { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// Tells the ranks at the other end of `links` why the group ends, best effort (a lost
/// peer's link fails, and each write is bounded), so that they report the cause.
fn end_group<'a>(links: impl Iterator<Item = &'a mut TcpStream>, reason: &str) {
    for link in links {
        // Each link its own time: one blocked peer leaves the others theirs.
        let deadline = Instant::now() + END_NOTICE_WAIT;
        let _ = write_all_by(
            link,
            &GROUP_ENDED.to_le_bytes(),
            deadline,
            "ending the group",
        )
        .and_then(|()| write_frame(link, reason.as_bytes(), deadline));
    }
}

/// The first address `addr:port` resolves to.
fn resolve(addr: &str, port: u16) -> Result<SocketAddr, ChannelError> {
    let resolve_error = |source| ChannelError::Resolve {
        addr: addr.to_string(),
        source,
    };
    (addr, port)
        .to_socket_addrs()
        .map_err(resolve_error)?
        .next()
        .ok_or_else(|| resolve_error(io::Error::other("no address")))
}

/// Where rank 0 listens for `MASTER_ADDR` (`given`, resolved to `resolved`): there, when
/// it is a loopback address (one node, nothing else can reach it), else on every
/// interface of that family. The other nodes reach rank 0's host by an address that
/// need not be the one its own name resolves to here (a host name that /etc/hosts maps
/// to 127.0.1.1).
fn listening_address(given: &str, resolved: SocketAddr) -> SocketAddr {
    let literal_loopback = given == "localhost"
        || given
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if literal_loopback {
        return resolved;
    }
    let any: std::net::IpAddr = match resolved {
        SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    SocketAddr::new(any, resolved.port())
}

/// Rank 0's listener on `addr`.
fn listen(addr: SocketAddr) -> Result<TcpListener, ChannelError> {
    TcpListener::bind(addr).map_err(|source| ChannelError::Listen {
        addr: addr.to_string(),
        source,
    })
}

/// Rank 0 of a file rendezvous: listens on a free loopback port and writes its address
/// into `path`, a file it creates (refused if it exists: another launch's, or a stale
/// one). The address ends with a newline: a reader that finds none yet reads again.
fn publish(path: &std::path::Path) -> Result<TcpListener, ChannelError> {
    let file_error = |doing, source| ChannelError::RendezvousFile {
        rank: 0,
        doing,
        path: path.to_owned(),
        source,
    };
    let listener = listen(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let addr = listener.local_addr().map_err(|e| file_error("write", e))?;
    let mut file = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(ChannelError::StaleRendezvousFile {
                path: path.to_owned(),
            });
        }
        Err(e) => return Err(file_error("create", e)),
    };
    if let Err(e) = writeln!(file, "{addr}") {
        let _ = std::fs::remove_file(path);
        return Err(file_error("write", e));
    }
    Ok(listener)
}

/// A rank other than 0 of a file rendezvous: waits (until `deadline`) for rank 0 to write
/// `path`, then reads the address in it. A folder that does not exist is an error at
/// once: rank 0 cannot create the file there either.
fn read_rendezvous_file(
    path: &std::path::Path,
    rank: u32,
    timeout: Duration,
    deadline: Instant,
) -> Result<SocketAddr, ChannelError> {
    let file_error = |doing, source| ChannelError::RendezvousFile {
        rank,
        doing,
        path: path.to_owned(),
        source,
    };
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty())
        && !folder.is_dir()
    {
        let missing = io::Error::new(io::ErrorKind::NotFound, "its folder does not exist");
        return Err(file_error("wait for", missing));
    }
    loop {
        match std::fs::read_to_string(path) {
            // Complete once its newline is written.
            Ok(text) if text.ends_with('\n') => {
                return text.trim().parse().map_err(|_| {
                    file_error(
                        "understand",
                        io::Error::other(format!("{text:?} is not an address")),
                    )
                });
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(file_error("read", source)),
        }
        if Instant::now() >= deadline {
            return Err(ChannelError::NoRendezvousFile {
                rank,
                path: path.to_owned(),
                seconds: timeout.as_secs_f64(),
            });
        }
        std::thread::sleep(CONNECT_RETRY);
    }
}

/// " (set aside N connection(s): …)" for the time-out's message, naming the first few;
/// empty where none were.
fn ignored_connections(ignored: u32, named: &[String]) -> String {
    if ignored == 0 {
        return String::new();
    }
    let more = ignored as usize - named.len();
    format!(
        " (set aside {ignored} connection(s) that were no rank of this group: {}{})",
        named.join("; "),
        if more > 0 {
            format!("; {more} more")
        } else {
            String::new()
        }
    )
}

/// How many of the connections rank 0 set aside its time-out names.
const NAMED_IGNORED: usize = 4;

/// Rank 0: takes one connection on `listener` from every other rank, each opening with
/// its handshake, which rank 0 answers; the links in rank order. A connection that sends
/// no moeforge handshake within [`HANDSHAKE_WAIT`] (a port scan, a health check) is set
/// aside; one from a rank of another group (see [`Handshake::refusal`]) or claiming a
/// rank already taken is refused and set aside, as is a connection that fails: rank 0
/// goes on waiting for its own. If it gives up, the ranks it took in hear why.
fn accept_ranks(
    listener: TcpListener,
    env: &LaunchEnv,
    mine: &Handshake,
    deadline: Instant,
) -> Result<Vec<TcpStream>, ChannelError> {
    let addr = listener
        .local_addr()
        .map_or_else(|_| env.rendezvous.to_string(), |a| a.to_string());
    // Non-blocking so that the deadline holds while nobody connects.
    listener
        .set_nonblocking(true)
        .map_err(|source| ChannelError::Listen { addr, source })?;
    // Each connection's handshake is read on a thread of its own: a silent connection (a
    // port scan) holds up no rank behind it.
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    let mut links: Vec<Option<TcpStream>> = (1..env.world_size).map(|_| None).collect();
    let mut set_aside = SetAside::default();
    while links.iter().any(Option::is_none) {
        let mut progressed = false;
        match listener.accept() {
            Ok((stream, from)) => {
                progressed = true;
                let read_tx = read_tx.clone();
                let handshake_by = Instant::now() + HANDSHAKE_WAIT;
                let spawned = stream.set_nonblocking(false).and_then(|()| {
                    std::thread::Builder::new()
                        .name("moeforge-handshake".to_string())
                        .spawn(move || {
                            let mut stream = stream;
                            let read = read_frame(&mut stream, handshake_by);
                            // Gone once the group is complete: the connection closes then.
                            let _ = read_tx.send((stream, from, read));
                        })
                });
                if let Err(e) = spawned {
                    set_aside.add(format!("{from}: its handshake could not be read ({e})"));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // A client's failed connection (accept(2) says to retry), or no file left.
            Err(e) => set_aside.add(format!("a connection that failed ({e})")),
        }
        while let Ok((mut stream, from, read)) = read_rx.try_recv() {
            progressed = true;
            // A rank's answer has its own time, even near the group's deadline.
            let answer_by = Instant::now() + HANDSHAKE_WAIT;
            let refusal = match read {
                Ok(bytes) => match Handshake::decode(&bytes) {
                    Some(theirs) => match theirs.refusal(mine) {
                        None if links[theirs.rank as usize - 1].is_some() => format!(
                            "a second process claiming RANK={} (two runs on one MASTER_PORT? give each its own, or set MOEFORGE_RUN_ID)",
                            theirs.rank
                        ),
                        None => {
                            match write_frame(&mut stream, &answer(ANSWER_TAKEN, ""), answer_by) {
                                Ok(()) => {
                                    let _ = stream.set_nodelay(true);
                                    links[theirs.rank as usize - 1] = Some(stream);
                                }
                                Err(e) => set_aside.add(format!(
                                    "{from}: RANK={} left before its answer ({})",
                                    theirs.rank,
                                    e.describe()
                                )),
                            }
                            continue;
                        }
                        Some(refusal) => refusal,
                    },
                    None => "not a moeforge handshake".to_string(),
                },
                Err(e) => {
                    set_aside.add(format!("{from}: no handshake ({})", e.describe()));
                    continue;
                }
            };
            let _ = write_frame(&mut stream, &answer(ANSWER_REFUSED, &refusal), answer_by);
            set_aside.add(format!("{from}: {refusal}"));
        }
        if !links.iter().any(Option::is_none) {
            break;
        }
        if Instant::now() >= deadline {
            let error = ChannelError::Incomplete {
                missing: links.iter().filter(|l| l.is_none()).count() as u32,
                world_size: env.world_size,
                seconds: env.timeout.as_secs_f64(),
                ignored: set_aside.count,
                named: set_aside.named,
                hint: meeting_hint(&env.rendezvous, env.world_size),
            };
            // The ranks taken in hear why rank 0 gives up.
            end_group(links.iter_mut().flatten(), &error.to_string());
            return Err(error);
        }
        if !progressed {
            std::thread::sleep(CONNECT_RETRY);
        }
    }
    Ok(links.into_iter().flatten().collect())
}

/// The connections rank 0 set aside as no rank of its group: how many, the first few
/// named (who, and why).
#[derive(Default)]
struct SetAside {
    count: u32,
    named: Vec<String>,
}

impl SetAside {
    fn add(&mut self, what: String) {
        self.count = self.count.saturating_add(1);
        if self.named.len() < NAMED_IGNORED {
            self.named.push(what);
        }
    }
}

/// A rank other than 0: connects to rank 0 at the address `master` gives (asked again
/// before every attempt; retrying until the deadline while nobody listens yet), sends its
/// handshake and waits for rank 0's answer.
fn connect_to_master(
    master: impl Fn() -> Result<SocketAddr, ChannelError>,
    env: &LaunchEnv,
    mine: &Handshake,
    deadline: Instant,
) -> Result<TcpStream, ChannelError> {
    let seconds = env.timeout.as_secs_f64();
    let (mut stream, addr) = loop {
        let addr = master()?;
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
        match TcpStream::connect_timeout(&addr, attempt) {
            Ok(stream) => break (stream, addr.to_string()),
            Err(source) if Instant::now() + CONNECT_RETRY >= deadline => {
                return Err(ChannelError::Connect {
                    rank: env.rank,
                    addr: addr.to_string(),
                    seconds,
                    source,
                    hint: meeting_hint(&env.rendezvous, env.world_size),
                });
            }
            Err(_) => std::thread::sleep(CONNECT_RETRY),
        }
    };
    let _ = stream.set_nodelay(true);
    let no_answer = |e: FrameError| match e {
        // Bytes no rank 0 sends before it takes a rank.
        FrameError::Oversized(_) | FrameError::Ended(_) => ChannelError::NotRankZero {
            rank: env.rank,
            addr: addr.clone(),
        },
        e => ChannelError::NoAnswer {
            rank: env.rank,
            addr: addr.clone(),
            what: e.describe(),
        },
    };
    write_frame(&mut stream, &mine.encode(), deadline).map_err(no_answer)?;
    let reply = read_frame(&mut stream, deadline).map_err(no_answer)?;
    let word = |i: usize| {
        reply
            .get(i * 4..i * 4 + 4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
    };
    match (word(0), word(1)) {
        (Some(HANDSHAKE_MAGIC), Some(ANSWER_TAKEN)) => Ok(stream),
        (Some(HANDSHAKE_MAGIC), Some(ANSWER_REFUSED)) => Err(ChannelError::Refused {
            rank: env.rank,
            addr,
            reason: String::from_utf8_lossy(&reply[8..]).into_owned(),
        }),
        _ => Err(ChannelError::NotRankZero {
            rank: env.rank,
            addr,
        }),
    }
}

/// A failed frame read or write, before it is said which ranks it was between.
#[derive(Debug)]
enum FrameError {
    /// The connection closed or failed.
    Lost(io::Error, &'static str),
    /// Nothing came (or could be sent) before the deadline.
    TimedOut(&'static str),
    /// The peer announced a message above [`MAX_MESSAGE_BYTES`].
    Oversized(u32),
    /// Rank 0 ended the group, for this reason.
    Ended(String),
}

impl FrameError {
    fn about(self, rank: u32, peer: u32, seconds: f64) -> ChannelError {
        match self {
            FrameError::Lost(source, doing) => ChannelError::PeerLost {
                rank,
                peer,
                doing,
                source,
            },
            FrameError::TimedOut(doing) => ChannelError::PeerSilent {
                rank,
                peer,
                doing,
                seconds,
            },
            FrameError::Oversized(bytes) => ChannelError::Oversized { rank, peer, bytes },
            FrameError::Ended(reason) => ChannelError::GroupEnded { rank, reason },
        }
    }

    /// In words, for a connection that is no rank's.
    fn describe(&self) -> String {
        match self {
            FrameError::Lost(source, _) => format!("the connection failed: {source}"),
            FrameError::TimedOut(_) => "nothing came in time".to_string(),
            FrameError::Oversized(bytes) => format!("a message of {bytes} bytes announced"),
            FrameError::Ended(_) => "a notice that the group ended".to_string(),
        }
    }
}

/// Sets `stream`'s read and write time-outs to what is left until `deadline`.
fn bound(stream: &TcpStream, deadline: Instant, doing: &'static str) -> Result<(), FrameError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(FrameError::TimedOut(doing));
    }
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| FrameError::Lost(e, doing))
}

/// Whether `error` is a socket time-out (the kind depends on the platform).
fn timed_out(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Moves `len` bytes through `stream` by `deadline` with `step` (a read or a write of the
/// bytes from `done` on, returning how many it moved), the time left applied again before
/// every step: a peer that trickles bytes cannot stretch the bound.
fn move_all_by(
    stream: &mut TcpStream,
    len: usize,
    deadline: Instant,
    doing: &'static str,
    mut step: impl FnMut(&mut TcpStream, usize) -> io::Result<usize>,
) -> Result<(), FrameError> {
    let mut done = 0;
    while done < len {
        bound(stream, deadline, doing)?;
        match step(stream, done) {
            Ok(0) => {
                let closed = io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed");
                return Err(FrameError::Lost(closed, doing));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err(FrameError::TimedOut(doing)),
            Err(e) => return Err(FrameError::Lost(e, doing)),
        }
    }
    Ok(())
}

/// Fills `buf` from `stream` by `deadline` ([`move_all_by`]).
fn read_all_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    doing: &'static str,
) -> Result<(), FrameError> {
    let len = buf.len();
    move_all_by(stream, len, deadline, doing, |s, done| {
        s.read(&mut buf[done..])
    })
}

/// Writes `bytes` to `stream` by `deadline` ([`move_all_by`]).
fn write_all_by(
    stream: &mut TcpStream,
    bytes: &[u8],
    deadline: Instant,
    doing: &'static str,
) -> Result<(), FrameError> {
    move_all_by(stream, bytes.len(), deadline, doing, |s, done| {
        s.write(&bytes[done..])
    })
}

/// Writes one message (at most [`MAX_MESSAGE_BYTES`]): its length (u32, little-endian),
/// then its bytes.
fn write_frame(
    stream: &mut TcpStream,
    message: &[u8],
    deadline: Instant,
) -> Result<(), FrameError> {
    const DOING: &str = "sending";
    debug_assert!(message.len() <= MAX_MESSAGE_BYTES as usize);
    let mut frame = (message.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(message);
    write_all_by(stream, &frame, deadline, DOING)
}

/// Reads one message written by [`write_frame`], or the reason rank 0 sent after
/// [`GROUP_ENDED`].
fn read_frame(stream: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, FrameError> {
    const DOING: &str = "waiting for its message";
    let read_length = |stream: &mut TcpStream| -> Result<u32, FrameError> {
        let mut len = [0u8; 4];
        read_all_by(stream, &mut len, deadline, DOING)?;
        Ok(u32::from_le_bytes(len))
    };
    let read_body = |stream: &mut TcpStream, len: u32| -> Result<Vec<u8>, FrameError> {
        if len > MAX_MESSAGE_BYTES {
            return Err(FrameError::Oversized(len));
        }
        let mut message = vec![0u8; len as usize];
        read_all_by(stream, &mut message, deadline, DOING)?;
        Ok(message)
    };
    let len = read_length(stream)?;
    if len == GROUP_ENDED {
        let len = read_length(stream)?;
        let reason = read_body(stream, len)?;
        return Err(FrameError::Ended(
            String::from_utf8_lossy(&reason).into_owned(),
        ));
    }
    read_body(stream, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let table: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| table.get(name).cloned()
    }

    const FULL: [(&str, &str); 5] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn without(name: &str) -> Vec<(&'static str, &'static str)> {
        FULL.iter().copied().filter(|(k, _)| *k != name).collect()
    }

    fn with(name: &'static str, value: &'static str) -> Vec<(&'static str, &'static str)> {
        let mut pairs = without(name);
        pairs.push((name, value));
        pairs
    }

    #[test]
    fn a_full_torchrun_environment_parses() {
        let env = LaunchEnv::from_vars(vars(&FULL)).expect("valid");
        assert_eq!(
            env,
            LaunchEnv {
                rank: 1,
                world_size: 2,
                local_rank: 1,
                rendezvous: Rendezvous::Tcp {
                    addr: "127.0.0.1".to_string(),
                    port: 29500,
                },
                timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
                run_id: None,
            }
        );
        assert!(LaunchEnv::requested_in(vars(&FULL)));
        assert!(!LaunchEnv::requested_in(vars(&[("LOCAL_RANK", "0")])));
    }

    #[test]
    fn each_missing_variable_is_named_with_what_to_set() {
        for name in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            let error = LaunchEnv::from_vars(vars(&without(name))).expect_err(name);
            let text = error.to_string();
            assert!(
                matches!(error, LaunchError::Missing { var, .. } if var == name),
                "{name}: {text}"
            );
            assert!(text.starts_with(&format!("{name} is not set")), "{text}");
            assert!(text.contains(&format!("set {name}")), "{text}");
        }
    }

    #[test]
    fn malformed_values_are_refused_saying_what_is_expected() {
        let cases = [
            ("RANK", "one", "RANK=\"one\" is not a whole number"),
            (
                "WORLD_SIZE",
                "-2",
                "WORLD_SIZE=\"-2\" is not a whole number",
            ),
            ("MASTER_PORT", "0", "is not a TCP port"),
            ("MASTER_PORT", "70000", "is not a TCP port"),
            (RENDEZVOUS_TIMEOUT_VAR, "soon", "is not a number of seconds"),
            (
                RENDEZVOUS_TIMEOUT_VAR,
                "1e20",
                "is not a number of seconds from 0.001 up to a day",
            ),
            (RENDEZVOUS_TIMEOUT_VAR, "NaN", "is not a number of seconds"),
            (
                RENDEZVOUS_TIMEOUT_VAR,
                "1e-12",
                "is not a number of seconds",
            ),
            (
                "WORLD_SIZE",
                "0",
                "WORLD_SIZE=\"0\" is not a number of processes",
            ),
        ];
        for (name, value, said) in cases {
            let error = LaunchEnv::from_vars(vars(&with(name, value))).expect_err(name);
            assert!(error.to_string().contains(said), "{name}={value}: {error}");
        }
        let error = LaunchEnv::from_vars(vars(&with("RANK", "2"))).expect_err("rank 2 of 2");
        assert!(matches!(
            error,
            LaunchError::RankOutOfRange {
                rank: 2,
                world_size: 2
            }
        ));
        let error = LaunchEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
        ]))
        .expect_err("a world of one");
        assert!(matches!(error, LaunchError::WorldOfOne), "{error}");
        let env = LaunchEnv::from_vars(vars(&with(RENDEZVOUS_TIMEOUT_VAR, "2.5"))).expect("valid");
        assert_eq!(env.timeout, Duration::from_millis(2500));
    }

    /// The plan fingerprint of the tests' groups.
    const PLAN: &str = "0123abcd";

    /// A port nobody listens on now (the test then listens on it itself).
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("an ephemeral port")
            .port()
    }

    fn env_of(rank: u32, world_size: u32, port: u16, timeout: Duration) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank: rank,
            rendezvous: Rendezvous::Tcp {
                addr: "127.0.0.1".to_string(),
                port,
            },
            timeout,
            run_id: None,
        }
    }

    /// Runs `body` as every rank of a group of `world_size` on threads (rank 0 last, so
    /// that the others must retry until it listens); each rank's result in rank order.
    fn on_ranks<T: Send>(
        world_size: u32,
        timeout: Duration,
        body: impl Fn(LaunchEnv) -> T + Sync,
    ) -> Vec<T> {
        let port = free_port();
        std::thread::scope(|scope| {
            let body = &body;
            let mut handles: Vec<_> = (1..world_size)
                .map(|rank| scope.spawn(move || body(env_of(rank, world_size, port, timeout))))
                .collect();
            std::thread::sleep(Duration::from_millis(200));
            handles.insert(
                0,
                scope.spawn(move || body(env_of(0, world_size, port, timeout))),
            );
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank's thread panicked"))
                .collect()
        })
    }

    #[test]
    fn a_rendezvous_file_replaces_master_addr_and_port() {
        let pairs = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            (RENDEZVOUS_VAR, "file:/tmp/moeforge-group"),
        ];
        let env = LaunchEnv::from_vars(vars(&pairs)).expect("valid without MASTER_*");
        assert_eq!(
            env.rendezvous,
            Rendezvous::File(PathBuf::from("/tmp/moeforge-group"))
        );
        for bad in ["/tmp/x", "file:", "tcp:1.2.3.4"] {
            let mut pairs = pairs.to_vec();
            pairs[3] = (RENDEZVOUS_VAR, bad);
            let error = LaunchEnv::from_vars(vars(&pairs)).expect_err(bad);
            assert!(
                error.to_string().contains("is not file:PATH"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn three_ranks_meet_through_a_file_that_rank_0_removes_after() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("rendezvous");
        let env = |rank| LaunchEnv {
            rank,
            world_size: 3,
            local_rank: rank,
            rendezvous: Rendezvous::File(path.clone()),
            timeout: Duration::from_secs(20),
            run_id: None,
        };
        let said: Vec<Vec<Vec<u8>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = [1, 2, 0]
                .into_iter()
                .map(|rank| {
                    let env = env(rank);
                    scope.spawn(move || {
                        let mut channel = ControlChannel::connect(&env, PLAN).expect("connected");
                        (rank, channel.all_gather(&[rank as u8]).expect("gathered"))
                    })
                })
                .collect();
            let mut results: Vec<_> = handles
                .into_iter()
                .map(|h| h.join().expect("a rank's thread panicked"))
                .collect();
            results.sort_by_key(|(rank, _)| *rank);
            results.into_iter().map(|(_, gathered)| gathered).collect()
        });
        for gathered in said {
            assert_eq!(gathered, [vec![0u8], vec![1], vec![2]]);
        }
        assert!(
            !path.exists(),
            "rank 0 removes the file once every rank is in"
        );

        // A file left by an earlier launch is refused by rank 0, not trusted.
        std::fs::write(&path, "127.0.0.1:1").expect("a stale file");
        let error = ControlChannel::connect(&env(0), PLAN)
            .err()
            .expect("a stale file");
        assert!(
            matches!(error, ChannelError::StaleRendezvousFile { .. }),
            "{error}"
        );
        std::fs::remove_file(&path).expect("removed");

        // A rank whose rank 0 never writes the file gives up at the bound.
        let lonely = LaunchEnv {
            timeout: Duration::from_millis(300),
            ..env(1)
        };
        let started = Instant::now();
        let error = ControlChannel::connect(&lonely, PLAN)
            .err()
            .expect("no rank 0");
        assert!(
            matches!(error, ChannelError::NoRendezvousFile { rank: 1, .. }),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));

        // A folder that does not exist is an error at once, not at the bound.
        let nowhere = LaunchEnv {
            rendezvous: Rendezvous::File(dir.path().join("missing").join("rendezvous")),
            ..env(1)
        };
        let started = Instant::now();
        let error = ControlChannel::connect(&nowhere, PLAN)
            .err()
            .expect("no folder");
        assert!(
            error.to_string().contains("its folder does not exist"),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_rank_that_read_a_stale_file_follows_the_new_one() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("rendezvous");
        // A killed run's file names a rank 0 that is gone.
        std::fs::write(&path, format!("127.0.0.1:{}\n", free_port())).expect("a stale file");
        let env = |rank| LaunchEnv {
            rank,
            world_size: 2,
            local_rank: rank,
            rendezvous: Rendezvous::File(path.clone()),
            timeout: Duration::from_secs(20),
            run_id: None,
        };
        std::thread::scope(|scope| {
            let rank_1 = scope.spawn(|| ControlChannel::connect(&env(1), PLAN));
            std::thread::sleep(Duration::from_millis(300));
            std::fs::remove_file(&path).expect("the stale file removed");
            let rank_0 = ControlChannel::connect(&env(0), PLAN);
            assert!(rank_0.is_ok(), "rank 0 formed the group");
            assert!(
                rank_1.join().expect("rank 1").is_ok(),
                "rank 1 joined the new rank 0"
            );
        });
    }

    #[test]
    fn three_ranks_gather_every_message_in_rank_order() {
        let results = on_ranks(3, Duration::from_secs(20), |env| {
            let mut channel = ControlChannel::connect(&env, PLAN).expect("connected");
            let first = channel
                .all_gather(format!("rank {}", env.rank).as_bytes())
                .expect("first gather");
            channel.barrier().expect("barrier");
            let second = channel
                .all_gather(&vec![env.rank as u8; env.rank as usize * 1000])
                .expect("second gather");
            (first, second)
        });
        for (first, second) in results {
            let said: Vec<String> = first
                .iter()
                .map(|m| String::from_utf8_lossy(m).into_owned())
                .collect();
            assert_eq!(said, ["rank 0", "rank 1", "rank 2"]);
            for (r, message) in second.iter().enumerate() {
                assert_eq!(message, &vec![r as u8; r * 1000]);
            }
        }
    }

    /// A group of `world_size` ranks on threads in which rank `gone` leaves without
    /// taking part in a gather, as a process that exited; the others' gathers, in rank
    /// order (`None` for the one gone).
    fn gather_with_one_gone(
        world_size: u32,
        gone: u32,
    ) -> Vec<Option<Result<Vec<Vec<u8>>, ChannelError>>> {
        on_ranks(world_size, Duration::from_secs(30), |env| {
            let mut channel = ControlChannel::connect(&env, PLAN).expect("connected");
            (env.rank != gone).then(|| channel.all_gather(b"still here"))
        })
    }

    #[test]
    fn a_peer_that_leaves_is_an_error_in_the_survivor_not_a_hang() {
        let started = Instant::now();
        let results = gather_with_one_gone(2, 1);
        let error = results[0]
            .as_ref()
            .expect("rank 0 gathered")
            .as_ref()
            .expect_err("rank 1 left");
        assert!(
            matches!(
                error,
                ChannelError::PeerLost {
                    rank: 0,
                    peer: 1,
                    ..
                }
            ),
            "{error}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a closed socket is seen at once, not at the time-out"
        );
    }

    #[test]
    fn a_missing_rank_times_out_at_the_bound() {
        let port = free_port();
        let started = Instant::now();
        let error = ControlChannel::connect(&env_of(0, 2, port, Duration::from_millis(300)), PLAN)
            .err()
            .expect("nobody connects");
        assert!(
            matches!(error, ChannelError::Incomplete { missing: 1, .. }),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        let error = ControlChannel::connect(&env_of(1, 2, port, Duration::from_millis(300)), PLAN)
            .err()
            .expect("nobody listens");
        assert!(
            error.to_string().contains("rank 0 did not answer"),
            "{error}"
        );
    }

    /// A client of rank 0's port that is no rank: it connects (retrying until rank 0
    /// listens) and writes `bytes`; the stream stays open while it lives.
    fn stray_client(port: u16, bytes: &[u8]) -> TcpStream {
        use std::io::Write;
        let stream = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(stream) => break stream,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        (&stream).write_all(bytes).expect("written");
        stream
    }

    #[test]
    fn a_connection_that_is_no_ranks_is_set_aside_and_named_at_the_time_out() {
        let port = free_port();
        std::thread::scope(|scope| {
            let group = scope.spawn(move || {
                ControlChannel::connect(&env_of(0, 2, port, Duration::from_secs(20)), PLAN)
            });
            // A client that writes a frame that is no handshake, then the real rank 1.
            let _stray = stray_client(port, &[4, 0, 0, 0, b'G', b'E', b'T', b' ']);
            let rank_1 =
                ControlChannel::connect(&env_of(1, 2, port, Duration::from_secs(20)), PLAN);
            assert!(rank_1.is_ok(), "rank 1 joined");
            assert!(
                group.join().expect("rank 0").is_ok(),
                "rank 0 formed the group"
            );
        });
        // With no rank 1, the time-out says what was set aside.
        let port = free_port();
        std::thread::scope(|scope| {
            let group = scope.spawn(move || {
                ControlChannel::connect(&env_of(0, 2, port, Duration::from_millis(800)), PLAN)
            });
            let _stray = stray_client(port, &[1, 0, 0, 0, 0]);
            let error = group.join().expect("rank 0").err().expect("incomplete");
            assert!(
                error.to_string().contains("set aside 1 connection(s)")
                    && error.to_string().contains("not a moeforge handshake"),
                "{error}"
            );
        });
    }

    #[test]
    fn a_silent_connection_holds_up_no_rank_behind_it() {
        let port = free_port();
        std::thread::scope(|scope| {
            let group = scope.spawn(move || {
                ControlChannel::connect(&env_of(0, 2, port, Duration::from_secs(30)), PLAN)
            });
            // Connects and says nothing, as a port scan does.
            let _silent = stray_client(port, &[]);
            let started = Instant::now();
            let rank_1 =
                ControlChannel::connect(&env_of(1, 2, port, Duration::from_secs(30)), PLAN);
            assert!(rank_1.is_ok(), "rank 1 joined");
            assert!(
                group.join().expect("rank 0").is_ok(),
                "rank 0 formed the group"
            );
            assert!(
                started.elapsed() < HANDSHAKE_WAIT / 2,
                "not held up by the silent connection: {:?}",
                started.elapsed()
            );
        });
    }

    #[test]
    fn ranks_of_another_run_are_refused_and_rank_0_waits_for_its_own() {
        let port = free_port();
        let timeout = Duration::from_secs(20);
        let other_run = |rank, world, plan: &'static str, run_id: Option<&str>| {
            let env = LaunchEnv {
                run_id: run_id.map(str::to_string),
                ..env_of(rank, world, port, timeout)
            };
            let error = ControlChannel::connect(&env, plan).err().expect("refused");
            assert!(
                matches!(error, ChannelError::Refused { rank: 1, .. }),
                "{error}"
            );
            error.to_string()
        };
        std::thread::scope(|scope| {
            let group = scope.spawn(move || {
                let env = LaunchEnv {
                    run_id: Some("job-a".to_string()),
                    ..env_of(0, 2, port, timeout)
                };
                ControlChannel::connect(&env, PLAN)
            });
            let started = Instant::now();
            let said = other_run(1, 2, PLAN, Some("job-b"));
            assert!(
                said.contains("another run") && said.contains("job-b"),
                "{said}"
            );
            let said = other_run(1, 3, PLAN, Some("job-a"));
            assert!(said.contains("WORLD_SIZE=3"), "{said}");
            let said = other_run(1, 2, "ffff0000", Some("job-a"));
            assert!(said.contains("planned another layer"), "{said}");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "a refused rank fails at once, not at the time-out"
            );
            let env = LaunchEnv {
                run_id: Some("job-a".to_string()),
                ..env_of(1, 2, port, timeout)
            };
            let mut rank_1 = ControlChannel::connect(&env, PLAN).expect("rank 1 joined");
            let mut rank_0 = group
                .join()
                .expect("rank 0")
                .expect("rank 0 formed the group");
            let gathered = std::thread::scope(|inner| {
                let other = inner.spawn(move || rank_1.all_gather(b"one").expect("gathered"));
                let mine = rank_0.all_gather(b"zero").expect("gathered");
                assert_eq!(other.join().expect("rank 1"), mine);
                mine
            });
            assert_eq!(gathered, [b"zero".to_vec(), b"one".to_vec()]);
        });
        // A second process claiming a rank already taken is refused; the group stands.
        let port = free_port();
        std::thread::scope(|scope| {
            let group =
                scope.spawn(move || ControlChannel::connect(&env_of(0, 3, port, timeout), PLAN));
            let first =
                ControlChannel::connect(&env_of(1, 3, port, timeout), PLAN).expect("rank 1");
            let error = ControlChannel::connect(&env_of(1, 3, port, timeout), PLAN)
                .err()
                .expect("a second rank 1");
            assert!(
                error
                    .to_string()
                    .contains("a second process claiming RANK=1"),
                "{error}"
            );
            let third =
                ControlChannel::connect(&env_of(2, 3, port, timeout), PLAN).expect("rank 2");
            assert!(
                group.join().expect("rank 0").is_ok(),
                "rank 0 formed the group"
            );
            drop((first, third));
        });
    }

    #[test]
    fn a_rank_that_finds_no_moeforge_rank_0_says_so() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = listener.local_addr().expect("its address").port();
        std::thread::scope(|scope| {
            // A server that answers every connection with an HTTP status line.
            scope.spawn(move || {
                let (mut stream, _) = listener.accept().expect("a connection");
                let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            });
            let error = ControlChannel::connect(&env_of(1, 2, port, Duration::from_secs(5)), PLAN)
                .err()
                .expect("no rank 0 there");
            assert!(
                matches!(error, ChannelError::NotRankZero { rank: 1, .. }),
                "{error}"
            );
        });
    }

    #[test]
    fn a_trickling_peer_cannot_stretch_the_bound() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let addr = listener.local_addr().expect("its address");
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let (mut stream, _) = listener.accept().expect("a connection");
                let _ = stream.write_all(&100u32.to_le_bytes());
                for _ in 0..40 {
                    if stream.write_all(&[0]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
            let mut stream = TcpStream::connect(addr).expect("connected");
            let started = Instant::now();
            let error = read_frame(&mut stream, started + Duration::from_millis(300))
                .expect_err("the message never completes");
            assert!(matches!(error, FrameError::TimedOut(_)), "{error:?}");
            assert!(
                started.elapsed() < Duration::from_millis(1500),
                "the deadline holds across reads: {:?}",
                started.elapsed()
            );
        });
    }

    #[test]
    fn the_ranks_learn_why_rank_0_ended_the_group() {
        let results = gather_with_one_gone(3, 2);
        let error = results[1]
            .as_ref()
            .expect("rank 1 gathered")
            .as_ref()
            .expect_err("rank 2 left");
        assert!(
            matches!(error, ChannelError::GroupEnded { rank: 1, .. })
                && error.to_string().contains("lost rank 2"),
            "{error}"
        );
    }

    #[test]
    fn a_rank_that_leaves_says_why_to_every_other() {
        let results = on_ranks(3, Duration::from_secs(30), |env| {
            let mut channel = ControlChannel::connect(&env, PLAN).expect("connected");
            if env.rank == 1 {
                channel.leave("needs a GPU");
                return None;
            }
            let first = channel.all_gather(b"here");
            // The group stays ended: the next gather is the same error, at once.
            let started = Instant::now();
            let again = channel.all_gather(b"again");
            Some((first, again, started.elapsed()))
        });
        for rank in [0, 2] {
            let (first, again, took) = results[rank].as_ref().expect("gathered");
            for error in [first, again] {
                let error = error.as_ref().expect_err("rank 1 left");
                assert!(
                    matches!(error, ChannelError::GroupEnded { .. })
                        && error
                            .to_string()
                            .contains("rank 1 left the group: needs a GPU"),
                    "rank {rank}: {error}"
                );
            }
            assert!(*took < Duration::from_millis(100), "rank {rank}: {took:?}");
        }
    }

    #[test]
    fn a_short_or_odd_handshake_is_no_handshake() {
        let magic = HANDSHAKE_MAGIC.to_le_bytes();
        for len in 0..12 {
            let bytes: Vec<u8> = magic.iter().copied().cycle().take(len).collect();
            assert!(Handshake::decode(&bytes).is_none(), "{len} bytes");
        }
        let mut no_newline = magic.to_vec();
        no_newline.extend_from_slice(&[2, 0, 0, 0, 1, 0, 0, 0]);
        no_newline.extend_from_slice(b"plan");
        assert!(Handshake::decode(&no_newline).is_none());
        no_newline.extend_from_slice(&[0xFF, 0xFE]);
        assert!(Handshake::decode(&no_newline).is_none(), "not UTF-8");
    }

    #[test]
    fn rank_0_listens_on_every_interface_unless_told_loopback() {
        let resolved: SocketAddr = "127.0.1.1:29500".parse().expect("an address");
        assert_eq!(
            listening_address("my-host", resolved),
            "0.0.0.0:29500".parse().expect("an address")
        );
        let loopback: SocketAddr = "127.0.0.1:29500".parse().expect("an address");
        assert_eq!(listening_address("127.0.0.1", loopback), loopback);
        assert_eq!(listening_address("localhost", loopback), loopback);
        let v6: SocketAddr = "[fd00::1]:29500".parse().expect("an address");
        assert_eq!(
            listening_address("fd00::1", v6),
            "[::]:29500".parse().expect("an address")
        );
    }

    #[test]
    fn a_run_id_comes_from_moeforge_or_torchrun() {
        let id = |pairs: &[(&'static str, &'static str)]| {
            let mut all = FULL.to_vec();
            all.extend_from_slice(pairs);
            LaunchEnv::from_vars(vars(&all)).expect("valid").run_id
        };
        assert_eq!(id(&[]), None);
        assert_eq!(id(&[("TORCHELASTIC_RUN_ID", "none")]), None);
        assert_eq!(
            id(&[("TORCHELASTIC_RUN_ID", "abc")]).as_deref(),
            Some("abc")
        );
        assert_eq!(
            id(&[("TORCHELASTIC_RUN_ID", "abc"), ("MOEFORGE_RUN_ID", "mine")]).as_deref(),
            Some("mine")
        );
    }
}
