//! Expert-parallel ranks as processes: two `moeforge` processes, one per GPU, launched as
//! torchrun launches a group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as
//! one node of two GPUs (the CUDA IPC path) and as two nodes of one GPU each (every
//! exchange through NCCL: the network path). Each checks its own output against the CPU
//! reference (uniform and skewed routing; T = 0, 1, ragged and max_tokens, unequal between
//! the ranks; across nodes 1000 calls in a row each); a peer that exits before its call, is
//! killed mid-run or (across nodes) stops sending mid-run makes the survivor report an
//! error within the wait bound; the
//! bench's group mode prints every rank's time. Needs two GPUs: on a machine with fewer it
//! says so and checks nothing. Run on the GPU machine: `cargo test -- --include-ignored`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use moeforge::runtime::toolkit;

/// The layer of every case: 8 experts, here over 2 ranks (4 each), max_tokens 512.
const SPEC: &str = "dsl-examples/tiny.moe";
/// The same layer on two nodes of one GPU each: the ranks exchange through NCCL.
const TWO_NODES_SPEC: &str = "dsl-examples/tiny_two_nodes.moe";

/// Calls each pair of rank processes makes across nodes: epochs, not resets, carry the
/// flags from call to call.
const CALLS_ACROSS_NODES: u32 = 1000;

/// The cases of the two correctness tests: (routing, rank 0's and rank 1's tokens): none,
/// one on one side only, ragged and unequal, and the layer's max_tokens. Each pair of
/// processes costs about 3.5 s (start, NCCL, the check), so each test runs every token
/// case once and takes the routings in turn; the two-node test takes the other routing
/// of each case (`other_routing`), so that between them every case meets both.
const CASES: [(&str, [u32; 2]); 4] = [
    ("uniform", [0, 0]),
    ("skewed", [1, 0]),
    ("uniform", [77, 90]),
    ("skewed", [512, 512]),
];

fn other_routing(routing: &str) -> &'static str {
    if routing == "uniform" {
        "skewed"
    } else {
        "uniform"
    }
}

/// How long one pair of rank processes may take, compile and check included: far above
/// what a correct run needs (seconds), so that only a hang reaches it.
const PAIR_LIMIT: Duration = Duration::from_secs(300);

/// One line straight to stderr, so the GPU log shows it without --nocapture.
fn say(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// `None` when two GPUs are visible, else why the test cannot run here.
fn two_gpus_missing() -> Option<String> {
    if let Err(error) = toolkit::driver_available() {
        return Some(error.to_string());
    }
    match CudaContext::device_count() {
        Ok(count) if count >= 2 => None,
        Ok(count) => Some(format!("{count} GPU(s) visible, 2 needed")),
        Err(error) => Some(format!("counting GPUs failed: {error}")),
    }
}

macro_rules! needs_two_gpus {
    () => {
        if let Some(reason) = two_gpus_missing() {
            say(&format!("SKIPPED (checked nothing): {reason}"));
            return;
        }
    };
}

/// A port nobody listens on now, for rank 0 to listen on.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("an ephemeral port")
        .port()
}

/// A rank process and the threads draining its output (so it never blocks on a full pipe).
struct RankProcess {
    rank: u32,
    child: Child,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
    /// Its stderr so far, as the draining thread reads it.
    stderr_so_far: Arc<Mutex<String>>,
}

/// What a rank process did.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    /// When it was seen to have exited.
    at: Instant,
}

/// Reads `pipe` to its end, line by line into `so_far`; returns all of it.
fn drain(pipe: impl Read + Send + 'static, so_far: Arc<Mutex<String>>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut lines = BufReader::new(pipe);
        let mut line = String::new();
        while matches!(lines.read_line(&mut line), Ok(n) if n > 0) {
            if let Ok(mut text) = so_far.lock() {
                text.push_str(&line);
            }
            line.clear();
        }
        so_far.lock().map(|text| text.clone()).unwrap_or_default()
    })
}

/// Starts rank `rank` of a group of two: `moeforge ARGS` with the launch variables and
/// multicast off.
fn spawn_rank(rank: u32, port: u16, args: &[String]) -> RankProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moeforge"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("MOEFORGE_RENDEZVOUS_TIMEOUT", "120")
        .env("NCCL_NVLS_ENABLE", "0")
        .env("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        .env("NVSHMEM_DISABLE_NVLS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the moeforge binary starts");
    let stderr_so_far = Arc::new(Mutex::new(String::new()));
    let stdout = drain(
        child.stdout.take().expect("piped stdout"),
        Arc::new(Mutex::new(String::new())),
    );
    let stderr = drain(
        child.stderr.take().expect("piped stderr"),
        Arc::clone(&stderr_so_far),
    );
    RankProcess {
        rank,
        child,
        stdout,
        stderr,
        stderr_so_far,
    }
}

impl RankProcess {
    /// Waits until the process has written `marker` to stderr, at most until `deadline`;
    /// fails if it exits first.
    fn wait_for(&mut self, marker: &str, deadline: Instant) {
        loop {
            let stderr = self
                .stderr_so_far
                .lock()
                .map(|text| text.clone())
                .unwrap_or_default();
            if stderr.contains(marker) {
                return;
            }
            let exited = self.child.try_wait().expect("polling a rank process");
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "rank {} never wrote {marker:?} ({}); stderr:\n{stderr}",
                self.rank,
                exited.map_or("still running".to_string(), |status| status.to_string())
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the process (SIGKILL: no clean-up of any kind) and reaps it; returns when.
    fn kill(mut self) -> Instant {
        self.child.kill().expect("killing a rank process");
        let _ = self.child.wait();
        Instant::now()
    }

    /// Waits for the process until `deadline`; past it the process is killed and the test
    /// fails as a hang.
    fn finish(mut self, deadline: Instant) -> Finished {
        let status = loop {
            match self.child.try_wait().expect("polling a rank process") {
                Some(status) => break status,
                None if Instant::now() >= deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!(
                        "rank {} did not finish in time (a hang); stderr:\n{}",
                        self.rank,
                        self.stderr.join().unwrap_or_default()
                    );
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let at = Instant::now();
        Finished {
            status,
            stdout: self.stdout.join().unwrap_or_default(),
            stderr: self.stderr.join().unwrap_or_default(),
            at,
        }
    }
}

fn run_args(tokens: u32, routing: &str, seed: u64) -> Vec<String> {
    [
        "run",
        SPEC,
        "--gpus",
        "2",
        "--check",
        "--tokens",
        &tokens.to_string(),
        "--routing",
        routing,
        "--seed",
        &seed.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// `run` of the two-node spec (its own topology: no --gpus), `calls` calls in a row.
fn two_node_args(tokens: u32, routing: &str, seed: u64, calls: u32) -> Vec<String> {
    [
        "run",
        TWO_NODES_SPEC,
        "--check",
        "--tokens",
        &tokens.to_string(),
        "--routing",
        routing,
        "--seed",
        &seed.to_string(),
        "--calls",
        &calls.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_rank_processes_match_the_reference() {
    needs_two_gpus!();
    let seed = 20_261_201;
    for (routing, tokens) in CASES {
        let port = free_port();
        let ranks: Vec<RankProcess> = (0..2u32)
            .map(|r| spawn_rank(r, port, &run_args(tokens[r as usize], routing, seed)))
            .collect();
        let deadline = Instant::now() + PAIR_LIMIT;
        for (r, rank) in ranks.into_iter().enumerate() {
            let done = rank.finish(deadline);
            let expected = format!("rank {r} T={}: ", tokens[r]);
            say(&format!(
                "{routing} T={tokens:?} rank {r}: {}",
                done.stdout.trim()
            ));
            assert!(
                done.status.success()
                    && done.stdout.contains(&expected)
                    && done.stdout.contains("PASS"),
                "{routing} T={tokens:?} rank {r} ({}):\nstdout:\n{}\nstderr:\n{}",
                done.status,
                done.stdout,
                done.stderr
            );
        }
    }
}

/// Two processes as two nodes: every exchange (metadata, rows, results) goes through
/// NCCL in chunks, each arrival releasing the flags the kernels wait on.
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_nodes_over_nccl_match_the_reference_for_a_thousand_calls() {
    needs_two_gpus!();
    let seed = 20_261_202;
    for (routing, tokens) in CASES.map(|(routing, tokens)| (other_routing(routing), tokens)) {
        let port = free_port();
        let started = Instant::now();
        let ranks: Vec<RankProcess> = (0..2u32)
            .map(|r| {
                let args = two_node_args(tokens[r as usize], routing, seed, CALLS_ACROSS_NODES);
                spawn_rank(r, port, &args)
            })
            .collect();
        let deadline = Instant::now() + PAIR_LIMIT;
        for (r, rank) in ranks.into_iter().enumerate() {
            let done = rank.finish(deadline);
            let expected = format!("rank {r} T={}: ", tokens[r]);
            say(&format!(
                "two nodes, {routing} T={tokens:?} rank {r}, {CALLS_ACROSS_NODES} calls in {:.1} s: {}",
                done.at.duration_since(started).as_secs_f64(),
                done.stdout.trim()
            ));
            assert!(
                done.status.success()
                    && done.stdout.contains(&expected)
                    && done.stdout.contains("PASS")
                    && done
                        .stderr
                        .contains(&format!("call {CALLS_ACROSS_NODES} of")),
                "two nodes, {routing} T={tokens:?} rank {r} ({}):\nstdout:\n{}\nstderr:\n{}",
                done.status,
                done.stdout,
                done.stderr
            );
        }
    }
}

/// Across nodes, a peer killed (SIGKILL) while both ranks are making calls: the survivor's
/// transfers with it never finish, and it reports so, naming itself, within the plan's
/// bound (a few seconds: two flag bounds plus the transfers), then exits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_peer_killed_mid_run_is_an_error_in_the_survivor_within_the_bound() {
    needs_two_gpus!();
    let port = free_port();
    // Far more calls than run before the kill.
    let calls = 1_000_000;
    let survivor = spawn_rank(0, port, &two_node_args(64, "uniform", 11, calls));
    let mut victim = spawn_rank(1, port, &two_node_args(64, "uniform", 11, calls));
    victim.wait_for("call 200 of", Instant::now() + PAIR_LIMIT);
    let killed = victim.kill();
    let bound = Duration::from_secs(60);
    let done = survivor.finish(killed + bound);
    let after = done.at.duration_since(killed).as_secs_f64();
    say(&format!(
        "survivor after {after:.1} s: {}",
        done.stderr
            .lines()
            .find(|l| l.starts_with("error:"))
            .unwrap_or_default()
    ));
    assert_eq!(done.status.code(), Some(1), "{}", done.stderr);
    assert!(
        done.stderr.contains("error: rank 0 (after"),
        "the survivor reports an error:\n{}",
        done.stderr
    );
}

/// Across nodes, a peer that stops sending in the middle of a run (it enqueues nothing
/// that sends at its 50th call, then waits for its own call): the survivor's NCCL
/// transfers with it never finish, and it reports which step with which peer stalled,
/// within the plan's bound, and leaves.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_peer_that_stops_sending_mid_run_is_a_stalled_transfer_in_the_survivor() {
    needs_two_gpus!();
    let port = free_port();
    let survivor = spawn_rank(0, port, &two_node_args(64, "uniform", 13, 1000));
    let mut quiet_args = two_node_args(64, "uniform", 13, 1000);
    quiet_args.extend(["--stop-sending-at-call".to_string(), "50".to_string()]);
    let mut quiet = spawn_rank(1, port, &quiet_args);
    quiet.wait_for("call 50 sends nothing", Instant::now() + PAIR_LIMIT);
    let stopped = Instant::now();
    // Two flag bounds and the transfers (the plan's wait_limit_ms, about 5 s) and leaving.
    let bound = Duration::from_secs(60);
    let done = survivor.finish(stopped + bound);
    let after = done.at.duration_since(stopped).as_secs_f64();
    let error = done
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default()
        .to_string();
    say(&format!("survivor after {after:.1} s: {error}"));
    let _ = quiet.finish(Instant::now() + PAIR_LIMIT);
    assert_eq!(done.status.code(), Some(1), "{}", done.stderr);
    assert!(
        error.contains("error: rank 0")
            && error.contains("NCCL transfers of")
            && error.contains("with rank(s) 1 did not finish within"),
        "the survivor reports the stalled transfer:\n{}",
        done.stderr
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_peer_that_dies_before_sending_is_a_time_out_in_the_survivor() {
    needs_two_gpus!();
    let port = free_port();
    let survivor = spawn_rank(0, port, &run_args(64, "uniform", 7));
    let mut dying_args = run_args(64, "uniform", 7);
    dying_args.push("--exit-before-call".to_string());
    let dying = spawn_rank(1, port, &dying_args);
    let died = dying.finish(Instant::now() + PAIR_LIMIT);
    assert_eq!(
        died.status.code(),
        Some(3),
        "rank 1 exits on purpose before its call:\n{}",
        died.stderr
    );
    // Every spin-wait is bounded by about 2 s (the plan's flag_wait_limit); reading the
    // error, the failed agreement with the dead peer and tearing down take moments.
    let bound = Duration::from_secs(60);
    let done = survivor.finish(died.at + bound);
    say(&format!(
        "survivor after {:.1} s: {}",
        done.at.duration_since(died.at).as_secs_f64(),
        done.stderr.lines().last().unwrap_or_default()
    ));
    assert_eq!(done.status.code(), Some(1), "{}", done.stderr);
    assert!(
        done.stderr.contains("error: rank 0 (after")
            && done.stderr.contains("waited too long")
            && done.stderr.contains("a peer stopped or never sent"),
        "the survivor reports a flag time-out:\n{}",
        done.stderr
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_bench_of_two_rank_processes_prints_every_ranks_time() {
    needs_two_gpus!();
    let port = free_port();
    let args: Vec<String> = [
        "bench",
        SPEC,
        "--gpus",
        "2",
        "--tokens",
        "1,128",
        "--iterations",
        "5",
        "--seed",
        "3",
    ]
    .map(String::from)
    .to_vec();
    let ranks: Vec<RankProcess> = (0..2u32).map(|r| spawn_rank(r, port, &args)).collect();
    let deadline = Instant::now() + PAIR_LIMIT;
    let done: Vec<Finished> = ranks.into_iter().map(|r| r.finish(deadline)).collect();
    for (r, finished) in done.iter().enumerate() {
        assert!(finished.status.success(), "rank {r}:\n{}", finished.stderr);
    }
    say(&done[0].stdout);
    for tokens in [1, 128] {
        let row = done[0]
            .stdout
            .lines()
            .find(|line| {
                line.trim_start_matches('|')
                    .trim()
                    .starts_with(&tokens.to_string())
            })
            .unwrap_or_else(|| panic!("no row for T={tokens}:\n{}", done[0].stdout));
        let times: Vec<f64> = row
            .split('|')
            .filter_map(|cell| cell.trim().parse().ok())
            .collect();
        // tokens, the slowest rank, then each rank.
        assert_eq!(times.len(), 4, "{row}");
        assert!(
            times[1..].iter().all(|&us| us > 0.0 && us.is_finite()),
            "{row}"
        );
        assert!(
            (times[1] - times[2].max(times[3])).abs() < 0.05 + 1e-3 * times[1],
            "{row}"
        );
    }
}
