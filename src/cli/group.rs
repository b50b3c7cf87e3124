//! `run` and `bench` launched as a group of rank processes, one GPU each (as `torchrun`
//! launches them: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; see
//! [`moeforge::runtime::process_group`]), on one node or, as the spec's topology places
//! them, on several (ranks on other nodes exchange through NCCL).
//!
//! Every process plans the layer for WORLD_SIZE ranks (the spec's
//! `parallel { expert = R }`, or `--gpus R` in its place; either must equal WORLD_SIZE),
//! meets the others on the control channel, takes rank 0's seed, builds the whole layer
//! from it on its own GPU (the same random weights on every rank, so each has the CPU
//! reference's weights) and keeps its own experts in its rank of the expert-parallel
//! layer.

use std::path::Path;
use std::process::ExitCode;

use moeforge::compiler::plan::ep::Placement;
use moeforge::compiler::plan::{Plan, Target};
use moeforge::runtime::ep::EpLayer;
use moeforge::runtime::harness::{BuiltLayer, Session};
use moeforge::runtime::ipc::plan_fingerprint;
use moeforge::runtime::process_group::{ControlChannel, LaunchEnv};

use super::planning::{RankChoice, build_on_gpu_on, one_layer, plan_file_over, plan_one};
use super::{compile_file, invalid_input, usage_error};

/// The launch variables when this process was launched as a rank of a group; `None` when
/// it was not (no `RANK` or `WORLD_SIZE`). A wrong launch (a variable missing or
/// malformed, `--ranks` given) is reported and is `Err`.
pub fn launched(ranks_flag: Option<u32>) -> Result<Option<LaunchEnv>, ExitCode> {
    if !LaunchEnv::requested() {
        return Ok(None);
    }
    let env = LaunchEnv::from_env().map_err(|error| {
        eprintln!("error: {error}");
        usage_error()
    })?;
    if ranks_flag.is_some() {
        eprintln!(
            "error: RANK and WORLD_SIZE are set, so this process is one rank of a group, one GPU each; virtual ranks (--ranks) live in one process: drop --ranks (or unset RANK and WORLD_SIZE)"
        );
        return Err(usage_error());
    }
    Ok(Some(env))
}

/// The layer planned for `env`'s group: as many ranks as the spec's
/// `parallel { expert = R }`, or `gpus` when given, which must be WORLD_SIZE. With `gpus`
/// (or a spec whose ranks are virtual) the ranks are one node of that many GPUs; otherwise
/// the spec's topology places them, over several nodes if it has them (then ranks on other
/// nodes exchange through NCCL).
pub fn plan(
    file: &Path,
    layer: Option<&str>,
    target: &Target,
    gpus: Option<u32>,
    env: &LaunchEnv,
) -> Result<Plan, ExitCode> {
    let (ranks, spec_plan) = match gpus {
        Some(gpus) => (gpus, None),
        None => {
            let plan = plan_one(file, layer, target)?;
            (plan.shape.spec_ranks, Some(plan))
        }
    };
    if ranks != env.world_size {
        let said = match gpus {
            Some(_) => "--gpus".to_string(),
            None => "the spec's `parallel { expert = .. }`".to_string(),
        };
        let experts = match &spec_plan {
            Some(plan) => plan.shape.experts,
            None => {
                let (_, module) = compile_file(file, target)?;
                one_layer(file, &module, layer)?.experts
            }
        };
        let world = env.world_size;
        // Offer --gpus only where that many ranks can hold the experts.
        let otherwise = if world > 0 && experts.is_multiple_of(world) {
            format!(", or pass --gpus {world} to plan it for {world} ranks")
        } else {
            format!(" ({world} ranks cannot split its {experts} experts evenly)")
        };
        eprintln!(
            "error: WORLD_SIZE={world} but the layer has {ranks} expert-parallel ranks ({said}); launch {ranks} processes (WORLD_SIZE={ranks}){otherwise}"
        );
        return Err(usage_error());
    }
    // The spec's own placement, when its ranks are GPUs (one node or several).
    if let Some(plan) = spec_plan
        && plan
            .expert_parallel
            .as_ref()
            .is_some_and(|ep| ep.placement == Placement::Devices)
    {
        return Ok(plan);
    }
    let choice = RankChoice {
        ranks,
        virtual_ranks: false,
    };
    let mut plans = plan_file_over(file, layer, target, Some(choice), false)?;
    if plans.len() != 1 {
        eprintln!(
            "error: {} has several layers; pick one with --layer",
            file.display()
        );
        return Err(usage_error());
    }
    Ok(plans.remove(0))
}

/// This process's rank, built: the session on its GPU, the whole layer (for the
/// reference) and its rank of the expert-parallel layer, with the group's seed (rank 0's).
pub struct RankBuilt {
    pub session: Session,
    pub built: BuiltLayer,
    pub ep: EpLayer,
    pub seed: u64,
}

/// Meets the group, agrees on rank 0's `seed`, builds the layer on GPU `LOCAL_RANK` and
/// joins the expert-parallel layer. `settings` says what the command does on every rank
/// alike (the calls a rank makes, a bench's token counts): a rank whose settings differ
/// from rank 0's would wait in a collective the others never reach, so every rank
/// refuses such a group at once. Each rank reports its own failures; its peers then see
/// it leave.
pub fn start(
    env: &LaunchEnv,
    plan: Plan,
    seed: u64,
    settings: &str,
) -> Result<RankBuilt, ExitCode> {
    let rank = env.rank;
    let fail = |status: ExitCode| {
        move |error: &dyn std::fmt::Display| {
            eprintln!("error: rank {rank}: {error}");
            status
        }
    };
    eprintln!(
        "rank {rank} of {}: meeting the group at {} ...",
        env.world_size, env.rendezvous
    );
    let fingerprint = plan_fingerprint(&plan).map_err(|e| fail(invalid_input())(&e))?;
    let mut channel =
        ControlChannel::connect(env, &fingerprint).map_err(|e| fail(usage_error())(&e))?;
    let mut mine = seed.to_le_bytes().to_vec();
    mine.extend_from_slice(settings.as_bytes());
    let all = channel
        .all_gather(&mine)
        .map_err(|e| fail(invalid_input())(&e))?;
    let Some((seed, leaders)) = all[0].split_first_chunk::<8>() else {
        return Err(fail(invalid_input())(&"rank 0 sent no seed"));
    };
    let seed = u64::from_le_bytes(*seed);
    if let Some(other) = all
        .iter()
        .position(|theirs| theirs.get(8..) != Some(leaders))
    {
        let said =
            |bytes: &[u8]| String::from_utf8_lossy(bytes.get(8..).unwrap_or_default()).into_owned();
        return Err(fail(usage_error())(&format!(
            "rank {other} was launched with other settings than rank 0 ({}, rank 0: {}); launch every rank with the same ones",
            said(&all[other]),
            said(&all[0])
        )));
    }
    let (session, built) = build_on_gpu_on(env.local_rank as usize, plan, seed)?;
    let ep = session
        .join_expert_parallel_group(&built, channel)
        .map_err(|e| {
            let status = fail(invalid_input())(&e);
            if e.left_a_transfer_stuck() {
                leave_now();
            }
            status
        })?;
    Ok(RankBuilt {
        session,
        built,
        ep,
        seed,
    })
}

/// A rank that cannot take part (`why`: no GPU here, a flag it refuses) says so, then meets the group and
/// leaves it at once, telling the others why ([`ControlChannel::leave`]), rather than
/// leave them waiting out their bound. Always a usage error.
pub fn leave_without_taking_part(env: &LaunchEnv, plan: &Plan, why: &str) -> ExitCode {
    eprintln!(
        "error: rank {}: {why}; meeting the group at {} to leave it ...",
        env.rank, env.rendezvous
    );
    let left = plan_fingerprint(plan)
        .map_err(|e| e.to_string())
        .and_then(|fingerprint| {
            ControlChannel::connect(env, &fingerprint).map_err(|e| e.to_string())
        });
    match left {
        Ok(channel) => {
            channel.leave(why);
            eprintln!("rank {}: left the group, telling the others why", env.rank);
        }
        Err(error) => eprintln!("error: rank {}: {error}", env.rank),
    }
    usage_error()
}

/// Leaves the process at once when `ep`'s network path was abandoned after a stall. The
/// network stream stays blocked on the lost peer's transfer, and the driver's exit-time
/// tear-down waits for it: on the two-H200 machine (2026-11-30) `exit(1)` after a stall
/// had not returned 55 s later. The kernel's clean-up of a process that is gone ends that
/// transfer.
pub fn exit_if_network_abandoned(ep: &EpLayer) {
    if ep.network_abandoned() {
        leave_now();
    }
}

/// Ends the process at once with status 1, without the driver's exit-time tear-down
/// (see [`exit_if_network_abandoned`]).
fn leave_now() -> ! {
    // SAFETY: `_exit` ends the process at once; nothing runs after it.
    unsafe { libc::_exit(1) }
}
