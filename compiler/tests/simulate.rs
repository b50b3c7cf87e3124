//! The schedule simulator on real plans: deadlock of a plan edited past residency, every
//! pair dispatched and combined once, capacities under worst-case routing, speed.

use std::time::Instant;

use moeforge_compiler::ir;
use moeforge_compiler::plan::ep::CombineRoute;
use moeforge_compiler::plan::{self, Plan, Target};
use moeforge_compiler::simulate::{
    self, Options, Routing, Schedule, ScheduleReport, SimError, Topology,
};

fn layer(example: &str) -> ir::Layer {
    let path = format!(
        "{}/../dsl-examples/{example}.moe",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("the example exists");
    let module = moeforge_compiler::compile_source(&path, &text).expect("the example checks");
    module.layers[0].clone()
}

fn planned(layer: &ir::Layer) -> (Plan, Topology) {
    let plan = plan::plan(layer, &Target::h200()).expect("the example plans");
    (plan, Topology::of(&layer.topology))
}

fn options(tokens: u32, routing: Routing) -> Options {
    Options {
        tokens_per_rank: tokens,
        routing,
        timeline_ranks: 0,
        fused_decode: false,
    }
}

/// `plan`'s prediction for `schedule` at `tokens` per rank, uniformly routed.
fn simulated(plan: &Plan, topology: &Topology, tokens: u32, schedule: Schedule) -> ScheduleReport {
    simulate::simulate(plan, topology, &options(tokens, Routing::Uniform))
        .unwrap()
        .schedules
        .into_iter()
        .find(|s| s.schedule == schedule)
        .unwrap_or_else(|| panic!("the {schedule:?} schedule"))
}

#[test]
fn virtual_ranks_whose_grids_exceed_the_device_deadlock() {
    let (mut plan, topology) = planned(&layer("tiny"));
    let ok = simulate::simulate(&plan, &topology, &options(100, Routing::Uniform)).unwrap();
    assert!(ok.deadlock.is_none(), "{:?}", ok.deadlock);
    assert_eq!(ok.schedules.len(), 3);
    // Each virtual rank's GEMM1 grid as large as the device: rank 3's dispatch blocks can
    // never find an SM while ranks 0-2 spin on its chunks.
    let sms = plan.target.sm_count;
    for regime in &mut plan.expert_parallel.as_mut().unwrap().regimes {
        regime.gemm1.grid_blocks = sms;
    }
    let report = simulate::simulate(&plan, &topology, &options(100, Routing::Uniform)).unwrap();
    let deadlock = report.deadlock.expect("reported as a deadlock");
    assert!(deadlock.waiting.contains("GEMM1"), "{deadlock:?}");
    assert!(deadlock.waits_for.contains("chunk flag"), "{deadlock:?}");
    assert!(
        deadlock.reason.contains(&format!("the device has {sms}")),
        "{deadlock:?}"
    );
    assert!(report.schedules.is_empty());
}

/// An example over `gpus` GPUs of one node.
fn over_gpus(example: &str, gpus: u32) -> ir::Layer {
    let mut layer = layer(example);
    layer.parallel.expert = gpus;
    layer.topology.gpus_per_node = gpus;
    layer.topology.nodes = 1;
    layer
}

#[test]
fn every_pair_is_dispatched_and_combined_once() {
    for (example, tokens, layer) in [
        ("tiny", 77, layer("tiny")),
        ("deepseek_v3_ep64", 300, layer("deepseek_v3_ep64")),
        ("mixtral_8x7b", 1000, layer("mixtral_8x7b")),
        // Results as rank partials.
        ("qwen3_30b_a3b over 2", 500, over_gpus("qwen3_30b_a3b", 2)),
    ] {
        let (plan, topology) = planned(&layer);
        for routing in [Routing::Uniform, Routing::Skewed] {
            let report = simulate::simulate(&plan, &topology, &options(tokens, routing)).unwrap();
            let k = u64::from(plan.shape.top_k);
            for schedule in &report.schedules {
                let a = &schedule.accounting;
                let ranks = report.ranks as usize;
                assert_eq!(
                    a.pairs_routed,
                    vec![u64::from(tokens) * k; ranks],
                    "{example}"
                );
                assert_eq!(
                    a.pairs_dispatched, a.pairs_routed,
                    "{example} {:?}",
                    schedule.schedule
                );
                assert_eq!(
                    a.pairs_combined, a.pairs_routed,
                    "{example} {:?}",
                    schedule.schedule
                );
                assert!(
                    a.token_mismatches.is_empty(),
                    "{example} {:?}: {:?}",
                    schedule.schedule,
                    a.token_mismatches
                );
                assert!(schedule.layer_s > schedule.dispatch_s && schedule.dispatch_s > 0.0);
            }
        }
    }
}

#[test]
fn capacities_hold_under_worst_case_routing() {
    for example in ["tiny", "mixtral_8x7b", "deepseek_v3", "qwen3_30b_a3b"] {
        let (plan, topology) = planned(&layer(example));
        let max = plan.shape.max_tokens;
        let report = simulate::simulate(&plan, &topology, &options(max, Routing::Skewed));
        assert!(report.is_ok(), "{example}: {report:?}");
    }
    // One slot fewer than max_tokens per source: the skewed call overflows it.
    let (mut plan, topology) = planned(&layer("tiny"));
    plan.expert_parallel.as_mut().unwrap().slots_per_source -= 1;
    let error = simulate::simulate(
        &plan,
        &topology,
        &options(plan.shape.max_tokens, Routing::Skewed),
    )
    .unwrap_err();
    assert!(matches!(error, SimError::Overflow(_)), "{error}");
    let error = simulate::simulate(
        &plan,
        &topology,
        &options(plan.shape.max_tokens + 1, Routing::Uniform),
    )
    .unwrap_err();
    assert!(matches!(error, SimError::TooManyTokens { .. }), "{error}");
}

#[test]
fn deepseek_v3_over_64_ranks_simulates_in_seconds() {
    let (plan, topology) = planned(&layer("deepseek_v3_ep64"));
    let started = Instant::now();
    let report = simulate::simulate(&plan, &topology, &options(4096, Routing::Uniform)).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    // About 0.1 s in release; a generous bound for debug builds and busy machines.
    assert!(seconds < 20.0, "{seconds} s");
    assert_eq!(report.nodes, 8);
    let of = |s: Schedule| report.schedules.iter().find(|r| r.schedule == s).unwrap();
    let aware = of(Schedule::FineGrainedTopologyAware);
    let naive = of(Schedule::FineGrainedNaive);
    // Node aggregation sends fewer bytes over the network than per-rank sends.
    assert!(aware.network_s < naive.network_s);
}

/// The design across nodes, as DeepSeek-V3 routes (4 of 8 groups): at 1024 tokens per rank
/// the topology-aware exchange at least 50% shorter than the bulk-synchronous one and the
/// layer within 1.15x the larger of compute and network (issue 10's targets: 50%, 1.1x).
/// The design returns pair rows reduced per node whatever the kernels as built return
/// (rank partials across nodes, 2026-12-05, which had briefly made the design's exchange
/// only 26% shorter).
#[test]
fn deepseek_v3_over_64_ranks_keeps_the_designs_exchange() {
    let (plan, topology) = planned(&layer("deepseek_v3_ep64"));
    let routing = Routing::GroupLimited { groups: 8, kept: 4 };
    let report = simulate::simulate(&plan, &topology, &options(1024, routing)).unwrap();
    let of = |s: Schedule| report.schedules.iter().find(|r| r.schedule == s).unwrap();
    let (aware, bulk) = (
        of(Schedule::FineGrainedTopologyAware),
        of(Schedule::BulkSynchronous),
    );
    let exchange = |r: &simulate::ScheduleReport| r.dispatch_s + r.combine_s;
    assert!(
        exchange(aware) <= 0.5 * exchange(bulk),
        "{} against {} s",
        exchange(aware),
        exchange(bulk)
    );
    assert!(aware.layer_s <= 1.15 * aware.compute_s.max(aware.network_s));
}

/// Across real nodes the report adds what the kernels as built run: the design's
/// hierarchical exchange with chunks sized by the routing (the same bytes on the network
/// port, fewer with the group limit), but GEMM2 after GEMM1 and the node partials sent once
/// the relay has every rank's, so the layer takes longer than the design. One node has no
/// such schedule (the topology-aware one is what its kernels run).
#[test]
fn the_as_built_schedule_moves_routed_chunks_across_nodes() {
    let (plan, topology) = planned(&layer("deepseek_v3_ep64"));
    let mut network = Vec::new();
    for routing in [
        Routing::Uniform,
        Routing::GroupLimited { groups: 8, kept: 4 },
    ] {
        let report = simulate::simulate(&plan, &topology, &options(1024, routing)).unwrap();
        let of = |s: Schedule| report.schedules.iter().find(|r| r.schedule == s).unwrap();
        let (built, design) = (
            of(Schedule::AsBuilt),
            of(Schedule::FineGrainedTopologyAware),
        );
        assert!(
            (built.network_s - design.network_s).abs() <= 1e-3 * design.network_s,
            "{routing:?}: {} vs {}",
            built.network_s,
            design.network_s
        );
        assert!(design.layer_s < built.layer_s, "{routing:?}");
        assert!(
            built.layer_s < of(Schedule::BulkSynchronous).layer_s,
            "{routing:?}"
        );
        network.push(built.network_s);
    }
    assert!(
        network[1] < network[0],
        "the group limit sends less: {network:?}"
    );
    let qwen = over_gpus("qwen3_30b_a3b", 2);
    let (plan, topology) = planned(&qwen);
    let report = simulate::simulate(&plan, &topology, &options(128, Routing::Uniform)).unwrap();
    assert!(
        report
            .schedules
            .iter()
            .all(|r| r.schedule != Schedule::AsBuilt)
    );
}

/// As built, a call within the plan's whole-chunks bound (DeepSeek-V3 at EP = 64: 4 tokens
/// per rank) skips the host's read-back of the rows per chunk and sends every token's row
/// instead: faster than the same call moving the routed rows (`whole_chunks = 0`), by at
/// most the read-back, with more bytes on the network port.
#[test]
fn whole_chunks_trade_the_read_back_for_bytes() {
    let planned_layer = layer("deepseek_v3_ep64");
    let mut routed_layer = planned_layer.clone();
    routed_layer.schedule.whole_chunks = Some(0);
    let as_built = |layer: &ir::Layer| {
        let (plan, topology) = planned(layer);
        assert_eq!(
            plan.expert_parallel
                .as_ref()
                .unwrap()
                .network
                .as_ref()
                .unwrap()
                .whole_chunks_up_to,
            if layer.schedule.whole_chunks == Some(0) {
                0
            } else {
                4
            }
        );
        simulated(&plan, &topology, 1, Schedule::AsBuilt)
    };
    let (whole, routed) = (as_built(&planned_layer), as_built(&routed_layer));
    let saved = routed.layer_s - whole.layer_s;
    assert!(
        saved > 0.0 && saved <= plan::network::HOST_READBACK_S,
        "{} vs {} s",
        whole.layer_s,
        routed.layer_s
    );
    assert!(whole.network_s > routed.network_s);
}

/// Each rank runs the shared slices on its own tokens: the same plan without them
/// simulates less GEMM time, and the same pairs cross the links.
#[test]
fn shared_experts_add_gemm_time_on_every_rank_but_no_traffic() {
    let (plan, topology) = planned(&layer("deepseek_v3"));
    assert_eq!(plan.shape.shared_slices, 1);
    let mut routed_only = plan.clone();
    routed_only.shape.shared_slices = 0;
    let run = |plan: &Plan| simulated(plan, &topology, 512, Schedule::BulkSynchronous);
    let (with, without) = (run(&plan), run(&routed_only));
    assert!(
        with.compute_s > without.compute_s,
        "{} vs {}",
        with.compute_s,
        without.compute_s
    );
    // One slice beside eight routed pairs a token: well under half again.
    assert!(with.compute_s < 1.5 * without.compute_s);
    assert_eq!(
        with.accounting.pairs_dispatched,
        without.accounting.pairs_dispatched
    );
}

/// Qwen3-30B-A3B over two GPUs at 4096 tokens per rank: its results return as rank
/// partials, and the simulator predicts them faster than pair rows, as measured
/// (2026-11-30: 985.9 → 843.8 µs).
#[test]
fn rank_partials_are_predicted_faster_where_a_rank_holds_several_pairs() {
    let layer = over_gpus("qwen3_30b_a3b", 2);
    let (plan, topology) = planned(&layer);
    let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
    assert_eq!(ep.combine_route, CombineRoute::RankPartials);
    let mut pair_rows = plan.clone();
    pair_rows.expert_parallel.as_mut().unwrap().combine_route = CombineRoute::PairRows;
    let layer_s =
        |plan: &Plan| simulated(plan, &topology, 4096, Schedule::FineGrainedTopologyAware).layer_s;
    let (partials, pairs) = (layer_s(&plan), layer_s(&pair_rows));
    assert!(
        partials < 0.95 * pairs,
        "rank partials {partials} s, pair rows {pairs} s"
    );
}

/// Two virtual ranks share one GPU's HBM: a weight-bound call (16 tokens per rank, every
/// rank streaming its experts' weights) computes about twice as long as on a GPU per rank,
/// as the bench measured (2026-12-04: Qwen3-30B-A3B's GEMM stage 318 µs on two virtual ranks,
/// 159 µs on two H200s in 2026-12-01's files).
#[test]
fn virtual_ranks_share_their_device() {
    let devices = over_gpus("qwen3_30b_a3b", 2);
    let mut one_gpu = devices.clone();
    one_gpu.topology.gpus_per_node = 1;
    one_gpu.topology.virtual_ranks = Some(2);
    let compute_s = |layer: &ir::Layer| {
        let (plan, topology) = planned(layer);
        simulated(&plan, &topology, 16, Schedule::BulkSynchronous).compute_s
    };
    let ratio = compute_s(&one_gpu) / compute_s(&devices);
    // Without the sharing the model gave 1.77 (the virtual plan's smaller grids alone).
    assert!((1.9..2.4).contains(&ratio), "virtual / devices: {ratio}");
}

/// Where the plan runs a call as the ranks' fused decode, the kernels' own schedules are
/// predicted as that kernel (one launch, rows sent as the grid's first units, no metadata,
/// arrange or combine kernels): shorter than the table at one token per rank, every pair
/// still dispatched and combined once; the bulk-synchronous baseline, which runs the table,
/// is the same either way; larger calls than the fused decode covers are unchanged.
#[test]
fn the_fused_decode_is_predicted_where_the_plan_runs_it() {
    let mut layer = layer("qwen3_30b_a3b");
    layer.parallel.expert = 2;
    layer.topology.gpus_per_node = 1;
    layer.topology.virtual_ranks = Some(2);
    let (plan, topology) = planned(&layer);
    let fused_max = plan.expert_parallel.as_ref().unwrap().regimes[0]
        .fused_decode
        .as_ref()
        .expect("the decode rank regime fuses")
        .max_tokens;
    let run = |tokens: u32, fused_decode: bool| {
        let options = Options {
            fused_decode,
            ..options(tokens, Routing::Uniform)
        };
        simulate::simulate(&plan, &topology, &options).unwrap()
    };
    let layer_us = |report: &simulate::Report, schedule: Schedule| {
        report.schedule(schedule).unwrap().layer_s * 1e6
    };
    let (fused, table) = (run(1, true), run(1, false));
    let aware = Schedule::FineGrainedTopologyAware;
    assert!(
        layer_us(&fused, aware) < layer_us(&table, aware),
        "fused {} µs against the table's {} µs",
        layer_us(&fused, aware),
        layer_us(&table, aware)
    );
    assert_eq!(
        layer_us(&fused, Schedule::BulkSynchronous),
        layer_us(&table, Schedule::BulkSynchronous)
    );
    let k = u64::from(plan.shape.top_k);
    for schedule in &fused.schedules {
        let combined: u64 = schedule.accounting.pairs_combined.iter().sum();
        assert_eq!(combined, 2 * k, "{:?}", schedule.schedule);
        assert!(schedule.accounting.token_mismatches.is_empty());
    }
    let (above, above_table) = (run(fused_max + 1, true), run(fused_max + 1, false));
    assert_eq!(layer_us(&above, aware), layer_us(&above_table, aware));
}
