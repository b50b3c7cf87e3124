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
//! `MASTER_ADDR:MASTER_PORT`, or on a free loopback port it writes into the rendezvous
//! file, which must not exist yet and which it removes once every rank is in), every other
//! rank connects (retrying while rank 0 is not up yet) and keeps its connection for the
//! layer's life. It carries small, rare messages only (NCCL's unique id, device and plan
//! fingerprints and rank 0's seed at set-up, the bench's start barrier and every rank's
//! times, and after a time-out the agreement to restart the exchange):
//! [`ControlChannel::all_gather`] and [`ControlChannel::barrier`]. Every read and write
//! has a deadline, and a peer that exits closes its socket, so a dead peer is an error
//! here within the bound, never a hang. The GPU traffic itself never touches this
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
        "{var}={value:?} is not a number of seconds up to a day; set it to how long a rank waits for the others (default {default} s)"
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
                Ok(seconds) if seconds > 0.0 && seconds <= MOST_RENDEZVOUS_TIMEOUT_S => {
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
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            rendezvous,
            timeout,
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
    #[error(
        "rank 0 cannot listen on {addr}: {source}; pick another MASTER_PORT (is an earlier run still holding it?)"
    )]
    Listen {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "rank {rank}: rank 0 did not answer at {addr} within {seconds:.0} s (last error: {source}); start every rank with the same MASTER_ADDR and MASTER_PORT"
    )]
    Connect {
        rank: u32,
        addr: String,
        seconds: f64,
        #[source]
        source: io::Error,
    },
    #[error(
        "rank 0: {missing} of {world_size} ranks did not connect within {seconds:.0} s{}; launch WORLD_SIZE={world_size} processes with the same MASTER_ADDR and MASTER_PORT",
        ignored_connections(*ignored, named)
    )]
    Incomplete {
        missing: u32,
        world_size: u32,
        seconds: f64,
        /// Connections set aside as no moeforge rank's.
        ignored: u32,
        /// The first few of them: who, and what they sent.
        named: Vec<String>,
    },
    #[error(
        "rank 0 was contacted by {what}; every rank needs the same WORLD_SIZE={world_size} and a RANK of its own"
    )]
    BadHandshake { what: String, world_size: u32 },
    #[error(
        "rank {rank} lost rank {peer} while {doing}: {source} (the peer process exited or stopped answering within the bound)"
    )]
    PeerLost {
        rank: u32,
        peer: u32,
        doing: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("rank {rank}: rank {peer} sent a message of {bytes} bytes, above the channel's limit")]
    Oversized { rank: u32, peer: u32, bytes: u32 },
    #[error(
        "rank 0: the rendezvous file {} exists already (from an earlier launch?); remove it, or name a new file in MOEFORGE_RENDEZVOUS",
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
        "rank {rank}: rank 0 did not write the rendezvous file {} within {seconds:.0} s; start every rank with the same MOEFORGE_RENDEZVOUS",
        path.display()
    )]
    NoRendezvousFile {
        rank: u32,
        path: PathBuf,
        seconds: f64,
    },
}

/// The group's host-side channel (see the module documentation). Rank 0 holds one
/// connection per other rank (index `r - 1`); every other rank holds one, to rank 0.
pub struct ControlChannel {
    rank: u32,
    world_size: u32,
    timeout: Duration,
    links: Vec<TcpStream>,
}

impl ControlChannel {
    /// Meets the other ranks of `env`'s group: rank 0 listens and waits for every other
    /// rank; the others connect to it. Returns once all are connected, or an error within
    /// `env.timeout`.
    pub fn connect(env: &LaunchEnv) -> Result<Self, ChannelError> {
        let deadline = Instant::now() + env.timeout;
        let links = match (&env.rendezvous, env.rank) {
            (Rendezvous::Tcp { addr, port }, 0) => {
                let addr = resolve(addr, *port)?;
                accept_ranks(listen(addr)?, env, deadline)?
            }
            (Rendezvous::Tcp { addr, port }, _) => {
                vec![connect_to_master(resolve(addr, *port)?, env, deadline)?]
            }
            (Rendezvous::File(path), 0) => {
                let listener = publish(path)?;
                let links = accept_ranks(listener, env, deadline);
                // Every rank has read it (or the group failed): the next launch may reuse the name.
                let _ = std::fs::remove_file(path);
                links?
            }
            (Rendezvous::File(path), rank) => {
                let addr = read_rendezvous_file(path, rank, env.timeout, deadline)?;
                vec![connect_to_master(addr, env, deadline)?]
            }
        };
        Ok(ControlChannel {
            rank: env.rank,
            world_size: env.world_size,
            timeout: env.timeout,
            links,
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
    /// call it the same number of times; a peer that has exited or does not answer within
    /// the bound is [`ChannelError::PeerLost`].
    pub fn all_gather(&mut self, message: &[u8]) -> Result<Vec<Vec<u8>>, ChannelError> {
        let deadline = Instant::now() + self.timeout;
        let rank = self.rank;
        if rank == 0 {
            let mut all = vec![message.to_vec()];
            for (i, link) in self.links.iter_mut().enumerate() {
                let peer = i as u32 + 1;
                all.push(read_frame(link, deadline).map_err(|e| e.about(rank, peer))?);
            }
            for (i, link) in self.links.iter_mut().enumerate() {
                let peer = i as u32 + 1;
                for part in &all {
                    write_frame(link, part, deadline).map_err(|e| e.about(rank, peer))?;
                }
            }
            Ok(all)
        } else {
            let link = &mut self.links[0];
            write_frame(link, message, deadline).map_err(|e| e.about(rank, 0))?;
            (0..self.world_size)
                .map(|_| read_frame(link, deadline).map_err(|e| e.about(rank, 0)))
                .collect()
        }
    }

    /// Returns once every rank has called it (or with the error of a lost peer).
    pub fn barrier(&mut self) -> Result<(), ChannelError> {
        self.all_gather(&[]).map(drop)
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

/// Rank 0's listener on `addr`.
fn listen(addr: SocketAddr) -> Result<TcpListener, ChannelError> {
    TcpListener::bind(addr).map_err(|source| ChannelError::Listen {
        addr: addr.to_string(),
        source,
    })
}

/// Rank 0 of a file rendezvous: listens on a free loopback port and writes its address
/// into `path` (a new file, renamed into place whole, so a reader never sees half of it).
fn publish(path: &std::path::Path) -> Result<TcpListener, ChannelError> {
    if path.exists() {
        return Err(ChannelError::StaleRendezvousFile {
            path: path.to_owned(),
        });
    }
    let listener = listen(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let file_error = |doing, source| ChannelError::RendezvousFile {
        rank: 0,
        doing,
        path: path.to_owned(),
        source,
    };
    let addr = listener.local_addr().map_err(|e| file_error("write", e))?;
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(&partial, addr.to_string()).map_err(|e| file_error("write", e))?;
    std::fs::rename(&partial, path).map_err(|e| file_error("write", e))?;
    Ok(listener)
}

/// A rank other than 0 of a file rendezvous: waits (until `deadline`) for rank 0 to write
/// `path`, then reads the address in it.
fn read_rendezvous_file(
    path: &std::path::Path,
    rank: u32,
    timeout: Duration,
    deadline: Instant,
) -> Result<SocketAddr, ChannelError> {
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                return text
                    .trim()
                    .parse()
                    .map_err(|_| ChannelError::RendezvousFile {
                        rank,
                        doing: "understand",
                        path: path.to_owned(),
                        source: io::Error::other(format!("{text:?} is not an address")),
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if Instant::now() >= deadline {
                    return Err(ChannelError::NoRendezvousFile {
                        rank,
                        path: path.to_owned(),
                        seconds: timeout.as_secs_f64(),
                    });
                }
                std::thread::sleep(CONNECT_RETRY);
            }
            Err(source) => {
                return Err(ChannelError::RendezvousFile {
                    rank,
                    doing: "read",
                    path: path.to_owned(),
                    source,
                });
            }
        }
    }
}

/// " (ignored N connection(s) that were no moeforge rank's: …)" for the time-out's message,
/// naming the first few; empty where none were.
fn ignored_connections(ignored: u32, named: &[String]) -> String {
    if ignored == 0 {
        return String::new();
    }
    let more = ignored as usize - named.len();
    format!(
        " (ignored {ignored} connection(s) that were no moeforge rank's: {}{})",
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
/// its handshake; the links in rank order. A connection that sends no moeforge handshake
/// within [`HANDSHAKE_WAIT`] (a port scan, a health check) is set aside; one from a rank
/// launched for another group is an error.
fn accept_ranks(
    listener: TcpListener,
    env: &LaunchEnv,
    deadline: Instant,
) -> Result<Vec<TcpStream>, ChannelError> {
    let addr = listener
        .local_addr()
        .map_or_else(|_| env.rendezvous.to_string(), |a| a.to_string());
    let listen_error = |source| ChannelError::Listen {
        addr: addr.clone(),
        source,
    };
    // Non-blocking so that the deadline holds while nobody connects.
    listener.set_nonblocking(true).map_err(listen_error)?;
    let mut links: Vec<Option<TcpStream>> = (1..env.world_size).map(|_| None).collect();
    let (mut ignored, mut named) = (0u32, Vec::new());
    while links.iter().any(Option::is_none) {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream.set_nonblocking(false).map_err(listen_error)?;
                let handshake_by = deadline.min(Instant::now() + HANDSHAKE_WAIT);
                let peer = match read_handshake(&mut stream, env.world_size, handshake_by) {
                    Ok(peer) => peer,
                    Err(HandshakeError::NotMoeforge(what)) => {
                        ignored = ignored.saturating_add(1);
                        if named.len() < NAMED_IGNORED {
                            named.push(format!("{from}: {what}"));
                        }
                        continue;
                    }
                    Err(HandshakeError::OtherGroup(what)) => {
                        return Err(ChannelError::BadHandshake {
                            what: format!("{from}: {what}"),
                            world_size: env.world_size,
                        });
                    }
                };
                let slot = &mut links[peer as usize - 1];
                if slot.is_some() {
                    return Err(ChannelError::BadHandshake {
                        what: format!("two processes claiming RANK={peer}"),
                        world_size: env.world_size,
                    });
                }
                let _ = stream.set_nodelay(true);
                *slot = Some(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(ChannelError::Incomplete {
                        missing: links.iter().filter(|l| l.is_none()).count() as u32,
                        world_size: env.world_size,
                        seconds: env.timeout.as_secs_f64(),
                        ignored,
                        named,
                    });
                }
                std::thread::sleep(CONNECT_RETRY);
            }
            Err(e) => return Err(listen_error(e)),
        }
    }
    Ok(links.into_iter().flatten().collect())
}

/// What was wrong with a connection's handshake.
enum HandshakeError {
    /// Nothing, or something other than a moeforge handshake, in time.
    NotMoeforge(String),
    /// A moeforge rank, but not one of this group.
    OtherGroup(String),
}

/// Reads a rank's handshake (magic, world size, rank); the rank, or what was wrong.
fn read_handshake(
    stream: &mut TcpStream,
    world_size: u32,
    deadline: Instant,
) -> Result<u32, HandshakeError> {
    let not_moeforge = || HandshakeError::NotMoeforge("not a moeforge handshake".to_string());
    let words = read_frame(stream, deadline)
        .map_err(|e| HandshakeError::NotMoeforge(format!("no handshake ({e:?})")))?;
    let [magic, world, rank] = match words.as_slice() {
        [a, b, c, d, e, f, g, h, i, j, k, l] => [
            u32::from_le_bytes([*a, *b, *c, *d]),
            u32::from_le_bytes([*e, *f, *g, *h]),
            u32::from_le_bytes([*i, *j, *k, *l]),
        ],
        _ => return Err(not_moeforge()),
    };
    if magic != HANDSHAKE_MAGIC {
        return Err(not_moeforge());
    }
    if world != world_size {
        return Err(HandshakeError::OtherGroup(format!(
            "a rank launched with WORLD_SIZE={world}"
        )));
    }
    if rank == 0 || rank >= world_size {
        return Err(HandshakeError::OtherGroup(format!(
            "a second process claiming RANK={rank}"
        )));
    }
    Ok(rank)
}

/// A rank other than 0: connects to rank 0 (retrying until the deadline while it is not
/// listening yet) and sends its handshake.
fn connect_to_master(
    addr: SocketAddr,
    env: &LaunchEnv,
    deadline: Instant,
) -> Result<TcpStream, ChannelError> {
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)));
        match attempt {
            Ok(stream) => break stream,
            Err(source) if Instant::now() + CONNECT_RETRY >= deadline => {
                return Err(ChannelError::Connect {
                    rank: env.rank,
                    addr: addr.to_string(),
                    seconds: env.timeout.as_secs_f64(),
                    source,
                });
            }
            Err(_) => std::thread::sleep(CONNECT_RETRY),
        }
    };
    let _ = stream.set_nodelay(true);
    let handshake: Vec<u8> = [HANDSHAKE_MAGIC, env.world_size, env.rank]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    write_frame(&mut stream, &handshake, deadline).map_err(|e| e.about(env.rank, 0))?;
    Ok(stream)
}

/// A failed frame read or write, before it is said which ranks it was between.
#[derive(Debug)]
enum FrameError {
    Io(io::Error, &'static str),
    Oversized(u32),
}

impl FrameError {
    fn about(self, rank: u32, peer: u32) -> ChannelError {
        match self {
            FrameError::Io(source, doing) => ChannelError::PeerLost {
                rank,
                peer,
                doing,
                source,
            },
            FrameError::Oversized(bytes) => ChannelError::Oversized { rank, peer, bytes },
        }
    }
}

/// Sets `stream`'s read and write time-outs to what is left until `deadline`.
fn bound(stream: &TcpStream, deadline: Instant, doing: &'static str) -> Result<(), FrameError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(FrameError::Io(io::ErrorKind::TimedOut.into(), doing));
    }
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| FrameError::Io(e, doing))
}

/// Writes one message: its length (u32, little-endian), then its bytes.
fn write_frame(
    stream: &mut TcpStream,
    message: &[u8],
    deadline: Instant,
) -> Result<(), FrameError> {
    const DOING: &str = "sending";
    bound(stream, deadline, DOING)?;
    let len = u32::try_from(message.len())
        .ok()
        .filter(|&len| len <= MAX_MESSAGE_BYTES)
        .ok_or(FrameError::Oversized(u32::MAX))?;
    stream
        .write_all(&len.to_le_bytes())
        .and_then(|()| stream.write_all(message))
        .map_err(|e| FrameError::Io(e, DOING))
}

/// Reads one message written by [`write_frame`].
fn read_frame(stream: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, FrameError> {
    const DOING: &str = "waiting for its message";
    bound(stream, deadline, DOING)?;
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| FrameError::Io(e, DOING))?;
    let len = u32::from_le_bytes(len);
    if len > MAX_MESSAGE_BYTES {
        return Err(FrameError::Oversized(len));
    }
    let mut message = vec![0u8; len as usize];
    stream
        .read_exact(&mut message)
        .map_err(|e| FrameError::Io(e, DOING))?;
    Ok(message)
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
                "is not a number of seconds up to a day",
            ),
            (RENDEZVOUS_TIMEOUT_VAR, "NaN", "is not a number of seconds"),
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
        };
        let said: Vec<Vec<Vec<u8>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = [1, 2, 0]
                .into_iter()
                .map(|rank| {
                    let env = env(rank);
                    scope.spawn(move || {
                        let mut channel = ControlChannel::connect(&env).expect("connected");
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
        let error = ControlChannel::connect(&env(0))
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
        let error = ControlChannel::connect(&lonely).err().expect("no rank 0");
        assert!(
            matches!(error, ChannelError::NoRendezvousFile { rank: 1, .. }),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn three_ranks_gather_every_message_in_rank_order() {
        let results = on_ranks(3, Duration::from_secs(20), |env| {
            let mut channel = ControlChannel::connect(&env).expect("connected");
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

    #[test]
    fn a_peer_that_leaves_is_an_error_in_the_survivor_not_a_hang() {
        let started = Instant::now();
        let results = on_ranks(2, Duration::from_secs(30), |env| {
            let mut channel = ControlChannel::connect(&env).expect("connected");
            if env.rank == 1 {
                // Leaves without taking part in the gather, as a process that exited.
                return None;
            }
            Some(channel.all_gather(b"still here"))
        });
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
        let error = ControlChannel::connect(&env_of(0, 2, port, Duration::from_millis(300)))
            .err()
            .expect("nobody connects");
        assert!(
            matches!(error, ChannelError::Incomplete { missing: 1, .. }),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        let error = ControlChannel::connect(&env_of(1, 2, port, Duration::from_millis(300)))
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
                ControlChannel::connect(&env_of(0, 2, port, Duration::from_secs(20)))
            });
            // A client that writes a frame that is no handshake, then the real rank 1.
            let _stray = stray_client(port, &[4, 0, 0, 0, b'G', b'E', b'T', b' ']);
            let rank_1 = ControlChannel::connect(&env_of(1, 2, port, Duration::from_secs(20)));
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
                ControlChannel::connect(&env_of(0, 2, port, Duration::from_millis(800)))
            });
            let _stray = stray_client(port, &[1, 0, 0, 0, 0]);
            let error = group.join().expect("rank 0").err().expect("incomplete");
            assert!(
                error.to_string().contains("ignored 1 connection(s)")
                    && error.to_string().contains("not a moeforge handshake"),
                "{error}"
            );
        });
    }

    #[test]
    fn a_rank_with_another_world_size_is_refused() {
        let port = free_port();
        let timeout = Duration::from_secs(10);
        std::thread::scope(|scope| {
            let stray = scope.spawn(move || ControlChannel::connect(&env_of(1, 3, port, timeout)));
            let error = ControlChannel::connect(&env_of(0, 2, port, timeout))
                .err()
                .expect("refused");
            assert!(error.to_string().contains("WORLD_SIZE=3"), "{error}");
            // The stray rank connected and sent its handshake; what it sees next is not
            // this test's concern.
            let _ = stray.join();
        });
    }
}
