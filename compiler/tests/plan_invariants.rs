//! Planner invariants over many generated layers: the plan is feasible on the target, its
//! regimes cover 0..=max_tokens, its tiles divide the problem, everything a block holds in
//! shared memory fits, every plan passes `Plan::validate`, and validation catches edits.
//! (The tile schedule is tested on the GPU, by running the kernels' own device code:
//! `runtime/tests/`.)

use moeforge_compiler::ir::{
    Activation, GroupLimit, Layer, Router, RouterBias, Scoring, TileShape,
};
use moeforge_compiler::plan::ep::CombineRoute;
use moeforge_compiler::plan::router::GateEngine;
use moeforge_compiler::plan::tuning::ChoiceSource;
use moeforge_compiler::plan::{
    self, BufferId, GemmPlan, Grid, HintKey, Plan, PlanError, StreamRole, Target,
};
use proptest::prelude::*;

mod common;

fn arbitrary_layer() -> impl Strategy<Value = Layer> {
    (
        1u32..=64,
        1u32..=64,
        prop::sample::select(vec![1u32, 2, 4, 8, 16, 64, 128, 256]),
        1u32..=8,
        1u32..=20_000,
        0usize..5,
    )
        .prop_map(|(h, f, experts, k, max_tokens, act)| {
            let activation = [
                Activation::Swiglu,
                Activation::Geglu,
                Activation::Gelu,
                Activation::Relu,
                Activation::Silu,
            ][act];
            common::layer(
                "generated",
                64 * h,
                64 * f,
                experts,
                k.min(experts),
                activation,
                max_tokens,
            )
        })
}

fn check_gemm(plan: &Plan, gemm: &GemmPlan, n: u32, k: u32) {
    let target = &plan.target;
    assert!(gemm.smem.total_bytes() <= target.smem_per_block, "{gemm:?}");
    assert!(gemm.smem.static_bytes >= (plan.shape.experts + 1) * 4);
    assert!(gemm.engine.takes_tile_k(gemm.tile.k), "{gemm:?}");
    assert_eq!(n % gemm.tile.n, 0, "tile columns divide the output width");
    // A last 128-deep mma.sync stage may be half full.
    assert_eq!(k % plan::TILE_K, 0, "64-deep k-tiles divide the reduction");
    assert_eq!(gemm.tile.m % (16 * gemm.warps_m), 0);
    assert_eq!(gemm.tile.n % (16 * gemm.warps_n), 0);
    assert!(gemm.grid_blocks >= target.sm_count && gemm.blocks_per_sm >= 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn plans_are_feasible_and_cover_every_token_count(layer in arbitrary_layer()) {
        let plan = match plan::plan(&layer, &Target::h200()) {
            Ok(plan) => plan,
            Err(PlanError::NoFeasibleTile { .. }) => return Ok(()),
            Err(other) => panic!("{other}"),
        };
        let mut next = 0;
        for regime in &plan.regimes {
            prop_assert_eq!(regime.min_tokens, next);
            prop_assert!(regime.max_tokens >= regime.min_tokens);
            next = regime.max_tokens + 1;
            check_gemm(&plan, &regime.gemm1, layer.ffn, layer.hidden);
            check_gemm(&plan, &regime.gemm2, layer.hidden, layer.ffn);
        }
        prop_assert_eq!(next, layer.max_tokens + 1);
        prop_assert!(plan.regime_for(layer.max_tokens + 1).is_none());
    }

    #[test]
    fn every_plan_validates_and_edits_are_caught(layer in arbitrary_layer(), which in 0usize..7) {
        let Ok(plan) = plan::plan(&layer, &Target::h200()) else { return Ok(()) };
        prop_assert_eq!(plan.validate(), Ok(()));
        let mut edited = plan.clone();
        let last = edited.regimes.len() - 1;
        match which {
            0 => edited.regimes[last].max_tokens += 1,
            1 => edited.regimes[0].gemm1.smem_bytes += 16,
            2 => edited.regimes[0].launches[1].block_threads *= 2,
            3 => edited.workspace[1].elems -= 1,
            4 => {
                let first = edited.regimes[0].launches[0].params[0];
                edited.regimes[0].launches[0].params.push(first);
            }
            5 => edited.call_graph_max_tokens = edited.shape.max_tokens + 1,
            _ => edited.shape.top_k = edited.shape.experts + 1,
        }
        prop_assert!(edited.validate().is_err(), "edit {} went unnoticed", which);
    }
}

/// A layer with one of the four reference rules (Mixtral, Qwen3-MoE without
/// renormalising, DeepSeek-V3 with a group limit, GPT-OSS), groups as the experts allow.
fn arbitrary_routed_layer() -> impl Strategy<Value = Layer> {
    (arbitrary_layer(), 0usize..4, 0u32..4).prop_map(|(mut layer, rule, group_power)| {
        let groups = (1u32 << group_power).min(layer.experts);
        let per_group = layer.experts / groups;
        let kept = groups.div_ceil(2).max(layer.top_k.div_ceil(per_group));
        let (scoring, bias, normalize, group_limit, scale) = match rule {
            0 => (Scoring::Softmax, RouterBias::None, true, None, 1.0),
            1 => (Scoring::Softmax, RouterBias::None, false, None, 1.0),
            2 => (
                Scoring::Sigmoid,
                RouterBias::ScoreCorrection,
                true,
                Some(GroupLimit { groups, kept }),
                2.5,
            ),
            _ => (Scoring::TopkSoftmax, RouterBias::Logits, false, None, 1.0),
        };
        layer.router = Some(Router {
            scoring,
            bias,
            group_limit,
            normalize,
            scale,
        });
        layer
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    #[test]
    fn router_plans_cover_every_expert_and_edits_are_caught(
        layer in arbitrary_routed_layer(),
        which in 0usize..7,
        on_h100 in any::<bool>(),
    ) {
        let target = if on_h100 { Target::h100() } else { Target::h200() };
        let Ok(plan) = plan::plan(&layer, &target) else { return Ok(()) };
        prop_assert_eq!(plan.validate(), Ok(()));
        let router = plan.router.as_ref().expect("the layer has a router");
        prop_assert_eq!(router.regimes.len(), plan.regimes.len());
        for regime in &router.regimes {
            for (i, gate) in regime.gates.iter().enumerate() {
                prop_assert!(gate.expert_tiles * gate.tile_experts >= layer.experts);
                prop_assert!(gate.smem_bytes <= plan.target.smem_per_block);
                let blocks = regime.launches[i].grid.blocks(gate.max_tokens);
                prop_assert!(blocks >= gate.max_tokens.div_ceil(gate.tile_tokens));
            }
        }
        // A gate's split over blocks, for every call of its regime: whole steps per block,
        // never more than at one token (a fused router unrolls its sum to that), within one
        // block per SM where it splits at all, its partial logits within the buffer, and a
        // split router's arrival counter per tile within `router_tiles_done`.
        let logits = plan
            .workspace
            .iter()
            .find(|b| b.id == plan::BufferId::RouterLogits)
            .expect("a router's logits")
            .elems;
        let tiles_done = plan
            .workspace
            .iter()
            .find(|b| b.id == plan::BufferId::RouterTilesDone)
            .expect("a router's counters")
            .elems;
        for (regime, router_regime) in plan.regimes.iter().zip(&router.regimes) {
            // The gates cover the regime's calls, each call running exactly one of them.
            for tokens in regime.min_tokens.max(1)..=regime.max_tokens {
                let runs: Vec<usize> = router_regime.launches_for(tokens).collect();
                let covering: Vec<usize> = (0..router_regime.gates.len())
                    .filter(|&i| {
                        let gate = &router_regime.gates[i];
                        (gate.min_tokens..=gate.max_tokens).contains(&tokens)
                    })
                    .collect();
                prop_assert_eq!(covering.len(), 1);
                prop_assert_eq!(runs[0], covering[0]);
            }
        }
        for router_regime in &router.regimes {
          for (i, gate) in router_regime.gates.iter().enumerate() {
            let k_tiles_per_group = layer.hidden / 64 / gate.warps_k;
            for tokens in gate.min_tokens.max(1)..=gate.max_tokens {
                let splits = gate.splits(tokens);
                let unsplit = gate.token_tiles(tokens) * gate.expert_tiles;
                prop_assert!(k_tiles_per_group.is_multiple_of(splits));
                prop_assert!(splits <= gate.splits(1));
                // A cluster gate splits over its cluster at every call, its grid in waves
                // of clusters; the others within one block per SM.
                let cluster = gate.engine.cluster_blocks();
                let split_fits = if gate.engine.selects() {
                    splits == cluster && gate.expert_tiles == 1
                } else {
                    splits == 1 || unsplit * splits <= plan.target.sm_count
                };
                prop_assert!(split_fits, "gate {} splits {} ways at {} tokens", i, splits, tokens);
                prop_assert_eq!(router_regime.launches[i].grid.blocks(tokens), unsplit * splits);
                prop_assert!(u64::from(gate.logits_slices(tokens) * tokens * layer.experts) <= logits);
                prop_assert!(
                    router_regime.fused || gate.engine.selects() || splits == 1 || u64::from(unsplit) <= tiles_done
                );
                // A gate that selects runs alone; the others are followed by the select.
                let runs: Vec<usize> = router_regime.launches_for(tokens).collect();
                let followed = !router_regime.fused && !gate.engine.selects();
                prop_assert_eq!(runs.len(), if followed { 2 } else { 1 });
                if followed {
                    prop_assert_eq!(Some(runs[1]), router_regime.select_launch());
                }
            }
          }
          prop_assert_eq!(
              router_regime.launches.len(),
              router_regime.gates.len() + usize::from(router_regime.select_launch().is_some())
          );
        }
        let mut edited = plan.clone();
        let edited_router = edited.router.as_mut().expect("the layer has a router");
        match which {
            0 => edited_router.regimes[0].gates[0].smem_bytes += 128,
            1 => {
                edited_router.regimes[0].launches[0].params.remove(1);
            }
            2 => edited_router.regimes[0].fused = !edited_router.regimes[0].fused,
            3 => edited_router.regimes[0].gates[0].k_split.steps += 1,
            4 => {
                let gate = edited_router.regimes.last_mut().unwrap().gates.last_mut().unwrap();
                gate.engine = match gate.engine {
                    GateEngine::MmaSync => GateEngine::WarpSpecialized,
                    GateEngine::WarpSpecialized | GateEngine::Cluster { .. } => GateEngine::MmaSync,
                };
            }
            5 => {
                let regime = &mut edited_router.regimes[0];
                regime.gemm1_starts_early = !regime.gemm1_starts_early;
            }
            _ => {
                edited_router.regimes.pop();
            }
        };
        prop_assert!(edited.validate().is_err(), "router edit {} went unnoticed", which);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// Any layer, with or without a router, that asks for a fused decode gets one that
    /// validates and fits (or a limitation saying why not), and codegen writes its entry.
    #[test]
    fn fused_decodes_fit_validate_and_generate(
        layer in prop_oneof![arbitrary_layer(), arbitrary_routed_layer()],
        tokens in 1u32..=64,
    ) {
        let mut layer = layer;
        layer.schedule.fused_decode = Some(tokens);
        let Ok(plan) = plan::plan(&layer, &Target::h200()) else { return Ok(()) };
        prop_assert_eq!(plan.validate(), Ok(()));
        let regime = &plan.regimes[0];
        match &regime.fused_decode {
            Some(fused) => {
                prop_assert_eq!(fused.max_tokens, tokens.min(regime.max_tokens));
                prop_assert_eq!(fused.max_rows, fused.max_tokens * plan.shape.slots_per_token());
                let launch = &fused.launch;
                prop_assert!(launch.smem_bytes + launch.static_smem_bytes <= plan.target.smem_per_block);
                prop_assert!(fused.blocks_per_sm >= 1);
                prop_assert_eq!(launch.grid, Grid::Fixed(plan.target.sm_count * fused.blocks_per_sm));
                let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
                prop_assert!(source.entry_points.contains(&launch.kernel));
                let call = format!(
                    "fused_decode<{0}_gemm1, {0}_gemm2, {1}, {2}>",
                    regime.name, fused.max_rows, launch.static_smem_bytes
                );
                prop_assert!(source.source.contains(&call), "{}", call);
            }
            None => prop_assert!(
                plan.hints_not_honoured.iter().any(|l| l.contains("fused decode")),
                "no fused decode and no reason: {:?}", plan.hints_not_honoured
            ),
        }
    }
}

#[test]
fn impossible_hints_are_errors_with_a_reason() {
    let mut layer = common::layer("hinted", 4096, 14336, 8, 2, Activation::Swiglu, 4096);
    layer.schedule.gemm1_tile = Some(TileShape {
        m: 128,
        n: 256,
        k: 64,
    });
    let error = plan::plan(&layer, &Target::h200()).unwrap_err().to_string();
    assert!(
        error.contains("gemm1.tile = 128x256x64") && error.contains("accumulators"),
        "{error}"
    );
    layer.schedule.gemm1_tile = Some(TileShape {
        m: 64,
        n: 64,
        k: 32,
    });
    let error = plan::plan(&layer, &Target::h200()).unwrap_err().to_string();
    assert!(error.contains("reduction depth must be 64"), "{error}");
    layer.schedule.gemm1_tile = Some(TileShape {
        m: 64,
        n: 96,
        k: 64,
    });
    let error = plan::plan(&layer, &Target::h200()).unwrap_err().to_string();
    assert!(error.contains("columns must divide"), "{error}");
}

#[test]
fn hint_problems_name_the_hint_and_stages_out_of_range() {
    let mut layer = common::layer("hinted", 4096, 14336, 8, 2, Activation::Swiglu, 4096);
    layer.schedule.stages = Some(1);
    let problems = plan::hint_problems(&layer, &Target::h200());
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].key, HintKey::Stages);
    assert!(
        problems[0].reason.contains("between 2 and 8"),
        "{problems:?}"
    );
    layer.schedule.stages = Some(3);
    layer.schedule.gemm2_tile = Some(TileShape {
        m: 256,
        n: 4096,
        k: 64,
    });
    let problems = plan::hint_problems(&layer, &Target::h200());
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].key, HintKey::Gemm2Tile);
    assert!(plan::plan(&layer, &Target::h200()).is_err());
    layer.schedule.gemm2_tile = Some(TileShape {
        m: 64,
        n: 128,
        k: 64,
    });
    assert_eq!(plan::hint_problems(&layer, &Target::h200()), vec![]);
    // A tile that fits the H200 may not fit a smaller target: the planner still refuses it.
    layer.schedule.gemm1_tile = Some(TileShape {
        m: 128,
        n: 128,
        k: 64,
    });
    layer.schedule.stages = Some(4);
    assert_eq!(plan::hint_problems(&layer, &Target::h200()), vec![]);
    let a100 = plan::hint_problems(&layer, &Target::a100());
    assert!(a100.iter().any(|p| p.key == HintKey::Gemm1Tile), "{a100:?}");
}

#[test]
fn decode_and_prefill_get_different_tiles() {
    let layer = common::layer("mixtral", 4096, 14336, 8, 2, Activation::Swiglu, 16384);
    let plan = plan::plan(&layer, &Target::h200()).unwrap();
    let decode = plan.regime_for(1).unwrap();
    let prefill = plan.regime_for(16384).unwrap();
    assert_ne!(decode.name, prefill.name);
    let config = |g: &plan::GemmPlan| (g.engine, g.tile, g.stages, g.grid_blocks);
    assert_ne!(
        config(&decode.gemm1),
        config(&prefill.gemm1),
        "few tokens and many get different GEMM1 plans"
    );
}

#[test]
fn hinted_tiles_are_used_for_every_regime() {
    let mut layer = common::layer("hinted", 512, 1024, 8, 2, Activation::Swiglu, 4096);
    let tile = TileShape {
        m: 64,
        n: 128,
        k: 64,
    };
    layer.schedule.gemm2_tile = Some(tile);
    let plan = plan::plan(&layer, &Target::h200()).unwrap();
    assert!(
        plan.regimes
            .iter()
            .all(|r| r.gemm2.tile == tile && r.gemm2.source == ChoiceSource::Hint)
    );
}

/// The expert-parallel plan's capacities hold the worst routing, and are tight: random
/// routings over R ranks never need more slots, segment rows or intermediate rows than
/// the plan reserves, and routing every token of every source to one rank's experts needs
/// exactly that much.
#[test]
fn expert_parallel_capacities_hold_every_routing() {
    for (ranks, experts, top_k, virtual_ranks) in [
        (2, 8, 2, false),
        (4, 16, 4, true),
        (8, 64, 8, true),
        (2, 4, 4, false),
    ] {
        let mut layer = common::layer("ep", 512, 256, experts, top_k, Activation::Swiglu, 64);
        layer.parallel.expert = ranks;
        layer.topology.gpus_per_node = ranks;
        layer.topology.virtual_ranks = virtual_ranks.then_some(ranks);
        let plan = plan::plan(&layer, &Target::h200()).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let ep = plan
            .expert_parallel
            .as_ref()
            .expect("an expert-parallel plan");
        let per_rank = experts / ranks;
        let tokens = layer.max_tokens;
        // Per destination: token slots used per source, rows per (expert, source), rows.
        let usage = |choose: &dyn Fn(u32, u32) -> Vec<u32>| {
            let (mut slots, mut segment, mut rows) = (0u32, 0u32, vec![0u64; ranks as usize]);
            for d in 0..ranks {
                for s in 0..ranks {
                    let mut per_expert = vec![0u32; per_rank as usize];
                    let mut sent = 0;
                    for t in 0..tokens {
                        let here: Vec<u32> = choose(s, t)
                            .into_iter()
                            .filter(|e| e / per_rank == d)
                            .collect();
                        sent += u32::from(!here.is_empty());
                        for e in &here {
                            per_expert[(e % per_rank) as usize] += 1;
                        }
                        rows[d as usize] += here.len() as u64;
                    }
                    slots = slots.max(sent);
                    segment = segment.max(per_expert.into_iter().max().unwrap_or(0));
                }
            }
            (slots, segment, rows.into_iter().max().unwrap_or(0))
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = move |n: u32| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % u64::from(n)) as u32
        };
        let draws: Vec<Vec<Vec<u32>>> = (0..ranks)
            .map(|_| {
                (0..tokens)
                    .map(|_| {
                        let mut chosen: Vec<u32> = Vec::new();
                        while chosen.len() < top_k as usize {
                            let e = random(experts);
                            if !chosen.contains(&e) {
                                chosen.push(e);
                            }
                        }
                        chosen
                    })
                    .collect()
            })
            .collect();
        let (slots, segment, rows) = usage(&|s, t| draws[s as usize][t as usize].clone());
        assert!(
            slots <= ep.slots_per_source
                && segment <= ep.rows_per_segment
                && rows <= ep.intermediate_rows
        );
        // Everything to rank 0's experts (as many distinct ones as K allows, the rest elsewhere).
        let worst = |_: u32, _: u32| -> Vec<u32> {
            (0..top_k)
                .map(|k| if k < per_rank { k } else { per_rank + k })
                .collect()
        };
        let (slots, segment, rows) = usage(&worst);
        assert_eq!(
            (slots, segment, rows),
            (
                ep.slots_per_source,
                ep.rows_per_segment,
                ep.intermediate_rows
            ),
            "R={ranks} E={experts} K={top_k}"
        );
    }
}

/// Virtual ranks share one GPU: per rank, the largest communication grid plus the largest
/// compute grid, over every rank, fit one block per SM (so a block waiting to start always
/// finds an empty SM, whichever blocks spin), and a plan whose compute grid grows past
/// that is refused.
#[test]
fn virtual_ranks_fit_one_block_per_sm() {
    let target = Target::h200();
    for (ranks, experts) in [(2, 8), (4, 16), (8, 64)] {
        let mut layer = common::layer("ep", 512, 256, experts, 2, Activation::Swiglu, 4096);
        layer.parallel.expert = ranks;
        layer.topology.gpus_per_node = 1;
        layer.topology.virtual_ranks = Some(ranks);
        let plan = plan::plan(&layer, &target).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
        for regime in &ep.regimes {
            let live = |role: StreamRole| {
                regime
                    .launches
                    .iter()
                    .filter(|l| l.stream == role)
                    .map(|l| l.grid.blocks(layer.max_tokens))
                    .max()
                    .unwrap()
            };
            let per_rank = live(StreamRole::Comm) + live(StreamRole::Compute);
            assert!(
                ranks * per_rank <= target.sm_count,
                "R={ranks}: {per_rank} live blocks per rank"
            );
        }
        let mut inflated = plan.clone();
        let ep = inflated.expert_parallel.as_mut().unwrap();
        let gemm = ep.regimes[0]
            .launches
            .iter_mut()
            .find(|l| l.kernel.ends_with("ep_gemm1"))
            .unwrap();
        gemm.grid = Grid::Fixed(ep.compute_sms * 2);
        assert!(
            inflated.validate().is_err(),
            "R={ranks}: a GEMM grid of two blocks per compute SM is refused"
        );
    }
}

/// The metadata kernel runs a block per tile of the regime's largest call, at most the
/// regime's communication blocks (which the residency accounting reserves for it), and
/// validation refuses a grid past them.
#[test]
fn the_metadata_grid_is_its_tiles_within_the_communication_blocks() {
    let target = Target::h200();
    let mut layer = common::layer("ep", 2048, 768, 128, 8, Activation::Swiglu, 16384);
    layer.parallel.expert = 2;
    layer.topology.gpus_per_node = 2;
    let plan = plan::plan(&layer, &target).expect("plans");
    let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
    assert_eq!(ep.metadata_tile_tokens, 2048 / 8);
    for regime in &ep.regimes {
        let metadata = regime
            .launches
            .iter()
            .find(|l| l.kernel == ep.route_kernel)
            .expect("a metadata launch");
        let tiles = regime.max_tokens.div_ceil(ep.metadata_tile_tokens);
        assert_eq!(
            metadata.grid,
            Grid::Fixed(tiles.clamp(1, regime.comm_blocks)),
            "regime {}",
            regime.name
        );
    }
    let mut inflated = plan.clone();
    let ep = inflated.expert_parallel.as_mut().unwrap();
    let route = ep.route_kernel.clone();
    let regime = &mut ep.regimes[0];
    let too_many = regime.comm_blocks + 1;
    regime
        .launches
        .iter_mut()
        .find(|l| l.kernel == route)
        .unwrap()
        .grid = Grid::Fixed(too_many);
    let error = inflated
        .validate()
        .expect_err("a metadata grid past the communication blocks");
    assert!(error.to_string().contains("metadata"), "{error}");
}

/// A rank's fused decode: planned for the first rank regimes where both GEMMs are mma.sync,
/// on every SM of a rank's own GPU and on a rank's share with virtual ranks (every rank's
/// grid resident at once), with its counters in the workspace; the fused regimes cover the
/// calls up to the default bound between them, 16-row tiles below 32-row ones (Qwen3-30B-A3B
/// on 8 ranks: a mean of 16 rows per expert at 32 tokens); `fused_decode = 0` and ranks on
/// several nodes plan none; validation refuses an edited grid or token bound.
#[test]
fn a_ranks_fused_decode_is_planned_and_checked() {
    let target = Target::h200();
    let plan = example_plan("qwen3_30b_a3b");
    let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
    let fusing = ep
        .regimes
        .iter()
        .take_while(|r| r.fused_decode.is_some())
        .count();
    assert_eq!(fusing, 2, "16-row tiles, then 32-row ones");
    let rows: Vec<u32> = ep.regimes[..fusing]
        .iter()
        .map(|r| r.gemm1.tile.m)
        .collect();
    assert_eq!(rows, [16, 32]);
    assert_eq!(ep.regimes[1].min_tokens, ep.regimes[0].max_tokens + 1);
    let fused = ep.regimes[fusing - 1].fused_decode.as_ref().unwrap();
    assert_eq!(
        fused.max_tokens,
        plan::fused_decode::DEFAULT_RANK_FUSED_DECODE_TOKENS
    );
    for regime in &ep.regimes[..fusing] {
        let fused = regime.fused_decode.as_ref().unwrap();
        assert_eq!(fused.max_tokens, regime.max_tokens.min(fused.max_tokens));
        assert_eq!(
            fused.launch.grid,
            Grid::Fixed(target.sm_count * fused.blocks_per_sm)
        );
    }
    assert!(
        ep.regimes[fusing..]
            .iter()
            .all(|r| r.fused_decode.is_none())
    );
    assert!(
        ep.workspace
            .iter()
            .any(|b| b.id == BufferId::RankFusedCounters)
    );
    assert!(
        plan.expert_parallel_entry_points()
            .contains(&fused.launch.kernel)
    );

    let mut layer = common::layer("ep", 1024, 384, 128, 8, Activation::Swiglu, 4096);
    layer.parallel.expert = 4;
    layer.topology.gpus_per_node = 1;
    layer.topology.virtual_ranks = Some(4);
    let virtual_plan = plan::plan(&layer, &target).expect("plans");
    assert_eq!(virtual_plan.validate(), Ok(()));
    let fused = virtual_plan.expert_parallel.as_ref().unwrap().regimes[0]
        .fused_decode
        .as_ref()
        .expect("virtual ranks fuse too");
    assert_eq!(
        (fused.launch.grid, fused.blocks_per_sm),
        (Grid::Fixed(33), 1)
    );

    for (which, edit) in [
        (
            "grid",
            Box::new(|f: &mut plan::FusedDecode| f.launch.grid = Grid::Fixed(66))
                as Box<dyn Fn(&mut plan::FusedDecode)>,
        ),
        (
            "token bound",
            Box::new(|f: &mut plan::FusedDecode| f.max_tokens += 1),
        ),
        (
            "rows",
            Box::new(|f: &mut plan::FusedDecode| f.max_rows -= 1),
        ),
    ] {
        let mut edited = virtual_plan.clone();
        let regime = &mut edited.expert_parallel.as_mut().unwrap().regimes[0];
        edit(regime.fused_decode.as_mut().unwrap());
        assert!(edited.validate().is_err(), "edited {which} went unnoticed");
    }

    layer.schedule.fused_decode = Some(0);
    let off = plan::plan(&layer, &target).expect("plans");
    let off = off.expert_parallel.expect("expert-parallel plan");
    assert!(off.regimes.iter().all(|r| r.fused_decode.is_none()));
    assert!(
        off.workspace
            .iter()
            .all(|b| b.id != BufferId::RankFusedCounters),
        "no counters without a fused decode"
    );

    // Asked for where the ranks' first regime cannot run one: the plan says why.
    let path = format!(
        "{}/../dsl-examples/mixtral_8x7b.moe",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("the example exists");
    let mut mixtral = moeforge_compiler::compile_source(&path, &text)
        .expect("the example checks")
        .layers
        .remove(0);
    // The cost model's best decode GEMM2 for Mixtral's ranks is on wgmma: the plan draws
    // regimes on mma.sync for the fused decode, and says so. One expert per rank gets a mean
    // of 2 rows per token of a call: 16-row tiles up to 6 tokens (a mean of 12 rows), 32-row
    // ones up to 14 (28); larger calls run the cost model's regimes.
    let drawn = plan::plan(&mixtral, &target).expect("plans");
    assert_eq!(drawn.validate(), Ok(()));
    let ep = drawn.expert_parallel.as_ref().unwrap();
    let spans: Vec<(u32, u32, u32)> = ep.regimes[..2]
        .iter()
        .map(|r| (r.min_tokens, r.max_tokens, r.gemm1.tile.m))
        .collect();
    assert_eq!(spans, [(0, 6, 16), (7, 14, 32)]);
    for regime in &ep.regimes[..2] {
        assert_eq!(
            regime.fused_decode.as_ref().map(|f| f.max_tokens),
            Some(regime.max_tokens),
            "Mixtral's ranks fuse every call of {}",
            regime.name
        );
        for gemm in [&regime.gemm1, &regime.gemm2] {
            assert_eq!(gemm.engine, plan::MmaEngine::MmaSync);
            assert_eq!(gemm.source, ChoiceSource::FusedDecode);
        }
    }
    assert_eq!(
        ep.regimes[2].min_tokens, 15,
        "the next regime starts after them"
    );
    assert!(ep.regimes[2..].iter().all(|r| r.fused_decode.is_none()));

    // A hinted GEMM2 tile on wgmma keeps the ranks from fusing: asked for, the plan says why.
    mixtral.schedule.gemm2_tile = Some(TileShape {
        m: 64,
        n: 64,
        k: 64,
    });
    mixtral.schedule.fused_decode = Some(16);
    let asked = plan::plan(&mixtral, &target).expect("plans");
    assert_eq!(asked.validate(), Ok(()));
    let ep = asked.expert_parallel.as_ref().unwrap();
    assert!(
        ep.regimes[0].fused_decode.is_none(),
        "the hinted GEMM2 is on wgmma"
    );
    assert!(
        asked.hints_not_honoured.iter().any(|l| l
            .contains("fused_decode = 16 tokens: the expert-parallel ranks run no fused decode")),
        "{:?}",
        asked.hints_not_honoured
    );

    let two_nodes = example_plan("tiny_two_nodes");
    let ep = two_nodes.expert_parallel.expect("expert-parallel plan");
    assert!(ep.network.is_some());
    assert!(
        ep.regimes.iter().all(|r| r.fused_decode.is_none()),
        "NCCL carries part of the exchange"
    );
}

/// A rank's fused decode of one block per SM: both GEMMs of its regime hold the deepest
/// rings that fit a block beside its tables (one stage more would not fit, or they are at
/// the deepest the planner allows), on every shipped example that has one.
#[test]
fn a_ranks_fused_decode_gets_the_deepest_rings() {
    let target = Target::h200();
    let mut checked = 0;
    for name in ["qwen3_30b_a3b", "deepseek_v3", "mixtral_8x7b"] {
        let plan = example_plan(name);
        let ep = plan.expert_parallel.expect("expert-parallel plan");
        assert!(
            ep.regimes[0].fused_decode.is_some(),
            "{name}: the ranks fuse"
        );
        let Some((first, fused)) = ep.regimes.iter().find_map(|r| {
            r.fused_decode
                .as_ref()
                .filter(|fused| fused.blocks_per_sm == 1)
                .map(|fused| (r, fused))
        }) else {
            panic!("{name}: no fused decode of one block per SM");
        };
        let reserved = fused.launch.static_smem_bytes;
        for gemm in [&first.gemm1, &first.gemm2] {
            let deeper = gemm.smem_bytes + gemm.smem.stage_bytes;
            assert!(
                gemm.stages == plan::MAX_STAGES
                    || deeper + reserved > target.smem_per_block
                    || deeper + reserved + 1024 > target.smem_per_sm,
                "{name}: {} stages of {} B leave room for another beside {reserved} B",
                gemm.stages,
                gemm.smem.stage_bytes
            );
            assert_eq!(gemm.blocks_per_sm, 1, "{name}");
        }
        checked += 1;
    }
    assert_eq!(checked, 3);
}

/// A plan read from outside cannot size a rank's buffers otherwise than its sizes imply
/// (the kernels index them by those sizes), nor pass the experts' split by overflowing
/// 32 bits: on a one-node, a two-node and a self-routed expert-parallel plan, every
/// buffer one element short or long is caught, and on the two ranks of the two-node plan
/// a count of experts a rank that wraps to the split is refused as a split.
#[test]
fn a_ranks_workspace_and_split_are_checked_exactly() {
    for name in ["qwen3_30b_a3b", "tiny_two_nodes", "deepseek_v3"] {
        let plan = example_plan(name);
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
        for index in 0..ep.workspace.len() {
            for change in [-1i64, 1] {
                let mut edited = plan.clone();
                let buffer = &mut edited.expert_parallel.as_mut().unwrap().workspace[index];
                buffer.elems = buffer.elems.saturating_add_signed(change);
                let id = buffer.id;
                assert!(
                    edited.validate().is_err(),
                    "{name}: `{}` {change:+} elements went unnoticed",
                    id.name()
                );
            }
        }
        // On two ranks, 2^31 + E/2 experts a rank times 2 wraps to E in 32 bits.
        if ep.ranks == 2 {
            let mut edited = plan.clone();
            edited.expert_parallel.as_mut().unwrap().experts_per_rank =
                (1 << 31) + plan.shape.experts / 2;
            let error = edited.validate().expect_err("a split that wraps");
            assert!(
                error.to_string().contains("do not split"),
                "{name}: {error}"
            );
        }
    }
}

/// The H200 plan of the shipped example `name`, validated.
fn example_plan(name: &str) -> plan::Plan {
    let plan = plan::plan(&example_layer(name), &Target::h200()).expect("the example plans");
    plan.validate().expect("the plan is consistent");
    plan
}

/// Mixtral-8x7B's plan, whose prefill GEMMs run in cluster pairs and whose GEMM2 loads its
/// rows as tiles: validation catches a pair on the wrong engine, a weight box that is not
/// the pair's half, a GEMM2 that stops loading tiles while its launch still passes them, and
/// 16-byte epilogue stores asked of the mma.sync engine.
#[test]
fn cluster_pairs_and_row_tiles_are_checked() {
    let plan = example_plan("mixtral_8x7b");
    let prefill = plan.regimes.len() - 1;
    let gemm2 = &plan.regimes[prefill].gemm2;
    assert_eq!(gemm2.cluster, 2, "Mixtral's prefill GEMM2 runs in pairs");
    assert_eq!(gemm2.a_load, plan::RowLoad::Tiles);

    let mut on_mma_sync = plan.clone();
    on_mma_sync.regimes[0].gemm1.cluster = 2;
    assert!(on_mma_sync.validate().is_err(), "a pair of mma.sync blocks");

    let mut whole_boxes = plan.clone();
    let gemm2_kernel = whole_boxes.regimes[prefill].gemm2_kernel.clone();
    let launch = whole_boxes.regimes[prefill]
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm2_kernel)
        .expect("GEMM2 is launched");
    for param in &mut launch.params {
        if let plan::LaunchArg::W2Tiles { box_rows } = &mut param.arg {
            *box_rows *= 2;
        }
    }
    assert!(
        whole_boxes.validate().is_err(),
        "whole-panel boxes in a pair"
    );

    let mut gathered = plan.clone();
    gathered.regimes[prefill].gemm2.a_load = plan::RowLoad::Gathered;
    assert!(
        gathered.validate().is_err(),
        "a gathered GEMM2 passed intermediate tiles"
    );

    assert_eq!(gemm2.store, plan::OutputStore::QuadVectors);
    let mut vectors_on_mma_sync = plan.clone();
    vectors_on_mma_sync.regimes[0].gemm2.store = plan::OutputStore::QuadVectors;
    assert_eq!(
        vectors_on_mma_sync.regimes[0].gemm2.engine,
        plan::MmaEngine::MmaSync
    );
    assert!(
        vectors_on_mma_sync.validate().is_err(),
        "16-byte stores without the wgmma epilogue"
    );
}

/// The generated entry point `kernel` in `source`, from its name to the end of its body.
fn entry_point<'a>(source: &'a str, kernel: &str) -> &'a str {
    let start = source
        .find(&format!(" {kernel}("))
        .unwrap_or_else(|| panic!("`{kernel}` in the source"));
    let end = start + source[start..].find("\n}\n").expect("its body ends");
    &source[start..end]
}

/// The warp-specialised GEMMs, one GPU's and a rank's, claim their work units from their
/// workspace's two tickets (GEMM1 the first, GEMM2 the second, in the generated CUDA too);
/// the mma.sync GEMMs take none. Validation catches a ticket missing from a launch or from either workspace.
#[test]
fn warp_specialised_gemms_claim_units_from_the_tickets() {
    let plan = example_plan("deepseek_v3");
    let tickets = plan::LaunchArg::Workspace(BufferId::UnitTickets);
    let takes = |kernel: &str| {
        plan.launches()
            .find(|l| l.kernel == kernel)
            .expect("the kernel is launched")
            .params
            .iter()
            .any(|param| param.arg == tickets)
    };
    let ep = plan
        .expert_parallel
        .as_ref()
        .expect("DeepSeek-V3 spans ranks");
    // The generated entry of `kernel`, up to the end of its body.
    let source = moeforge_compiler::codegen::generate(&plan)
        .expect("codegen")
        .source;
    let entry = |kernel: &str| entry_point(&source, kernel);
    // Each GEMM claims from its own ticket (GEMM2 may start while GEMM1 runs).
    let gemms = |regimes: Vec<[(&plan::GemmPlan, &String); 2]>| {
        let mut warp_specialised = 0;
        for [gemm1, gemm2] in regimes {
            for (ticket, (gemm, kernel)) in [gemm1, gemm2].into_iter().enumerate() {
                let claims = gemm.engine == plan::MmaEngine::WgmmaWarpSpecialized;
                warp_specialised += usize::from(claims);
                assert_eq!(takes(kernel), claims, "{kernel}");
                let passes = entry(kernel).contains(&format!("unit_tickets + {ticket}"));
                assert_eq!(passes, claims, "{kernel}: ticket {ticket}");
            }
        }
        warp_specialised
    };
    let one_gpu = plan
        .regimes
        .iter()
        .map(|r| [(&r.gemm1, &r.gemm1_kernel), (&r.gemm2, &r.gemm2_kernel)]);
    assert!(
        gemms(one_gpu.collect()) >= 2,
        "DeepSeek-V3's prefill GEMMs are warp-specialised"
    );
    let ranks = ep
        .regimes
        .iter()
        .map(|r| [(&r.gemm1, &r.gemm1_kernel), (&r.gemm2, &r.gemm2_kernel)]);
    assert!(
        gemms(ranks.collect()) >= 2,
        "a rank's prefill GEMMs are warp-specialised"
    );
    for workspace in [&plan.workspace, &ep.workspace] {
        let buffer = workspace
            .iter()
            .find(|buffer| buffer.id == BufferId::UnitTickets)
            .expect("the workspace holds the tickets");
        assert_eq!(buffer.elems, 2);
    }

    let mut without_ticket = plan.clone();
    let prefill = without_ticket.regimes.last_mut().expect("a prefill regime");
    let gemm1_kernel = prefill.gemm1_kernel.clone();
    let launch = prefill
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm1_kernel)
        .expect("GEMM1 is launched");
    launch.params.retain(|param| param.arg != tickets);
    assert!(
        without_ticket.validate().is_err(),
        "GEMM1 without its ticket"
    );

    let mut no_buffer = plan.clone();
    no_buffer
        .workspace
        .retain(|buffer| buffer.id != BufferId::UnitTickets);
    assert!(no_buffer.validate().is_err(), "no tickets in the workspace");

    let mut rank_without_ticket = plan.clone();
    let rank_prefill = rank_without_ticket
        .expert_parallel
        .as_mut()
        .and_then(|ep| ep.regimes.last_mut())
        .expect("a rank's prefill regime");
    let gemm2_kernel = rank_prefill.gemm2_kernel.clone();
    rank_prefill
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm2_kernel)
        .expect("a rank's GEMM2 is launched")
        .params
        .retain(|param| param.arg != tickets);
    assert!(
        rank_without_ticket.validate().is_err(),
        "a rank's GEMM2 without its ticket"
    );

    let mut rank_no_buffer = plan.clone();
    if let Some(ep) = &mut rank_no_buffer.expert_parallel {
        ep.workspace
            .retain(|buffer| buffer.id != BufferId::UnitTickets);
    }
    assert!(
        rank_no_buffer.validate().is_err(),
        "no tickets in a rank's workspace"
    );
}

/// GPT-OSS-120B's expert biases reach every GEMM: one GPU's, each rank regime's and the
/// ranks' fused decode, in the launches and in the generated CUDA (not `nullptr`); a layer
/// without biases passes none. Validation catches a rank's GEMM2 left without its bias.
#[test]
fn expert_biases_reach_every_gemm_on_one_gpu_and_on_the_ranks() {
    let plan = example_plan("gpt_oss_120b");
    let ep = plan
        .expert_parallel
        .as_ref()
        .expect("GPT-OSS-120B spans ranks, biases and all");
    let source = moeforge_compiler::codegen::generate(&plan)
        .expect("codegen")
        .source;
    let entry = |kernel: &str| entry_point(&source, kernel);
    let takes = |launches: &[plan::Launch], kernel: &str, arg: plan::LaunchArg| {
        launches
            .iter()
            .find(|l| l.kernel == kernel)
            .unwrap_or_else(|| panic!("`{kernel}` is launched"))
            .params
            .iter()
            .any(|param| param.arg == arg)
    };
    let (w1_bias, w2_bias) = (plan::LaunchArg::W1Bias, plan::LaunchArg::W2Bias);
    let mut gemms = Vec::new();
    for r in &plan.regimes {
        gemms.push((&r.launches, &r.gemm1_kernel, &r.gemm2_kernel));
    }
    for r in &ep.regimes {
        gemms.push((&r.launches, &r.gemm1_kernel, &r.gemm2_kernel));
    }
    for (launches, gemm1, gemm2) in gemms {
        assert!(takes(launches, gemm1, w1_bias), "{gemm1}");
        assert!(takes(launches, gemm2, w2_bias), "{gemm2}");
        // The body's call passes the parameter where the bias goes (after the weights).
        assert!(
            entry(gemm1).contains(", w1_bias, SlotWeights{},"),
            "{gemm1}"
        );
        assert!(entry(gemm2).contains(", w2_bias, "), "{gemm2}");
    }
    let fused = ep
        .regimes
        .iter()
        .find_map(|r| r.fused_decode.as_ref())
        .expect("the ranks' decode is fused");
    assert!(takes(
        std::slice::from_ref(&fused.launch),
        &fused.launch.kernel,
        w1_bias
    ));
    assert!(takes(
        std::slice::from_ref(&fused.launch),
        &fused.launch.kernel,
        w2_bias
    ));
    assert!(
        entry(&fused.launch.kernel).contains("x, w1, w1_bias, w2, w2_bias,"),
        "the ranks' fused decode passes both biases"
    );

    let unbiased = example_plan("qwen3_30b_a3b");
    let unbiased_ep = unbiased
        .expert_parallel
        .as_ref()
        .expect("Qwen3 spans ranks");
    assert!(
        unbiased
            .launches()
            .chain(unbiased_ep.regimes.iter().flat_map(|r| r.all_launches()))
            .all(|l| l
                .params
                .iter()
                .all(|p| p.arg != w1_bias && p.arg != w2_bias)),
        "a layer without biases passes none"
    );

    let mut dropped = plan.clone();
    let rank_prefill = dropped
        .expert_parallel
        .as_mut()
        .and_then(|ep| ep.regimes.last_mut())
        .expect("a rank's prefill regime");
    let gemm2_kernel = rank_prefill.gemm2_kernel.clone();
    rank_prefill
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm2_kernel)
        .expect("a rank's GEMM2 is launched")
        .params
        .retain(|param| param.arg != w2_bias);
    let error = dropped
        .validate()
        .expect_err("a rank's GEMM2 without its bias");
    assert!(error.to_string().contains("w2_bias"), "{error}");
}

/// Qwen1.5-MoE-A2.7B's gated shared expert: every one-GPU regime's GEMM1 computes the
/// weights before its tiles (it takes x, the token count and the gate) and its GEMM2 reads
/// them (passed to the epilogue beside the routing weights), and no one-GPU table has a
/// launch of its own for them; each rank launches the gate on its compute stream right
/// before arrange, which reads them; the ranks' fused decode (on by default) and one GPU's
/// (where the spec asks) take the gate, their shared-slice GEMM2 tiles computing the
/// weights. Layers without the gate compute none and read none. Validation catches a GEMM2
/// without the weights, a GEMM1 that does not compute them, a fused decode without the
/// gate and a rank that launches the gate after arrange.
#[test]
fn a_gated_shared_expert_weighs_the_shared_slices_on_one_gpu_and_on_the_ranks() {
    let plan = example_plan("qwen1_5_moe_a2_7b");
    assert!(plan.shape.shared_gated && plan.shape.shared_slices == 4);
    let kernel = plan
        .shared_gate_kernel
        .clone()
        .expect("a gated shared expert has its gate's kernel");
    let gate = plan::LaunchArg::Workspace(plan::BufferId::SharedGate);
    let reads = |launch: &plan::Launch| launch.params.iter().any(|p| p.arg == gate);
    let source = moeforge_compiler::codegen::generate(&plan)
        .expect("codegen")
        .source;
    for regime in &plan.regimes {
        assert!(
            regime.launches.iter().all(|l| l.kernel != kernel),
            "{}: one GPU launches no gate of its own",
            regime.name
        );
        let gemm1 = regime
            .launches
            .iter()
            .find(|l| l.kernel == regime.gemm1_kernel)
            .expect("GEMM1 is launched");
        for arg in [
            plan::LaunchArg::X,
            plan::LaunchArg::Tokens,
            plan::LaunchArg::SharedExpertGate,
        ] {
            assert!(
                gemm1.params.contains(&plan::KernelParam {
                    arg,
                    access: plan::Access::Read
                }),
                "{}: {arg:?}",
                regime.gemm1_kernel
            );
        }
        assert!(
            gemm1.params.contains(&plan::KernelParam {
                arg: gate,
                access: plan::Access::Write
            }),
            "{}",
            regime.gemm1_kernel
        );
        assert!(
            entry_point(&source, &regime.gemm1_kernel)
                .contains("shared_gate_weights(x, shared_expert_gate, tokens, shared_gate);"),
            "{}",
            regime.gemm1_kernel
        );
        let gemm2 = regime
            .launches
            .iter()
            .find(|l| l.kernel == regime.gemm2_kernel)
            .expect("GEMM2 is launched");
        assert!(reads(gemm2), "{}", regime.gemm2_kernel);
        assert!(
            entry_point(&source, &regime.gemm2_kernel)
                .contains("SlotWeights{topk_weights, shared_gate}"),
            "{}",
            regime.gemm2_kernel
        );
    }
    assert!(source.contains("enum : bool { SHARED_GATED = true };"));
    let ep = plan.expert_parallel.as_ref().expect("four ranks");
    for regime in &ep.regimes {
        let at = regime
            .launches
            .iter()
            .position(|l| l.kernel == ep.arrange_kernel)
            .expect("arrange is launched");
        assert_eq!(regime.launches[at - 1].kernel, kernel, "{}", regime.name);
        assert_eq!(regime.launches[at - 1].stream, plan::StreamRole::Compute);
        assert!(reads(&regime.launches[at]));
    }
    let takes_gate = |fused: &plan::FusedDecode| {
        fused.launch.params.contains(&plan::KernelParam {
            arg: plan::LaunchArg::SharedExpertGate,
            access: plan::Access::Read,
        })
    };
    let rank_fused = ep.regimes[0]
        .fused_decode
        .as_ref()
        .expect("the ranks fuse their decode by default");
    assert!(takes_gate(rank_fused));
    assert!(
        entry_point(&source, &rank_fused.launch.kernel)
            .contains("w2, nullptr, shared_expert_gate, topk_ids"),
        "the rank's fused decode passes the gate on"
    );
    let mut asked = example_layer("qwen1_5_moe_a2_7b");
    asked.schedule.fused_decode = Some(16);
    let fused_plan = plan::plan(&asked, &Target::h200()).expect("plans");
    fused_plan.validate().expect("valid");
    let fused = fused_plan.regimes[0]
        .fused_decode
        .as_ref()
        .expect("one GPU fuses where asked");
    assert!(fused.max_tokens >= 16 && takes_gate(fused));
    let mut gateless = fused_plan.clone();
    gateless.regimes[0]
        .fused_decode
        .as_mut()
        .expect("fused")
        .launch
        .params
        .retain(|p| p.arg != plan::LaunchArg::SharedExpertGate);
    let error = gateless
        .validate()
        .expect_err("a fused decode without the gate");
    assert!(
        error
            .to_string()
            .contains("is not given the shared expert gate"),
        "{error}"
    );
    assert!(
        ep.workspace
            .iter()
            .any(|b| b.id == plan::BufferId::SharedGate)
    );
    assert!(entry_point(&source, &ep.arrange_kernel).contains("shared_gate"));

    let ungated = example_plan("deepseek_v3");
    assert!(ungated.shared_gate_kernel.is_none());
    assert!(
        ungated.launches().all(|l| !reads(l)
            && l.params
                .iter()
                .all(|p| p.arg != plan::LaunchArg::SharedExpertGate)),
        "a layer without the gate reads none"
    );

    let mut dropped = plan.clone();
    let regime = &mut dropped.regimes[0];
    let gemm2_kernel = regime.gemm2_kernel.clone();
    regime
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm2_kernel)
        .expect("GEMM2")
        .params
        .retain(|p| p.arg != gate);
    let error = dropped
        .validate()
        .expect_err("a GEMM2 without the gate's weights");
    assert!(error.to_string().contains("shared_gate"), "{error}");

    let mut ungated_gemm1 = plan.clone();
    let regime = &mut ungated_gemm1.regimes[1];
    let gemm1_kernel = regime.gemm1_kernel.clone();
    regime
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm1_kernel)
        .expect("GEMM1")
        .params
        .retain(|p| p.arg != gate);
    let error = ungated_gemm1
        .validate()
        .expect_err("a GEMM1 that does not compute the gate's weights");
    assert!(
        error
            .to_string()
            .contains("must compute the shared expert gate's weights"),
        "{error}"
    );

    let mut late = plan.clone();
    let launches = &mut late.expert_parallel.as_mut().expect("ranks").regimes[0].launches;
    let at = launches
        .iter()
        .position(|l| l.kernel == kernel)
        .expect("the ranks launch the gate");
    let launch = launches.remove(at);
    launches.push(launch);
    let error = late.validate().expect_err("the gate after arrange");
    assert!(error.to_string().contains("right before"), "{error}");
}

/// GEMM1 loads x's rows sorted by expert where `gemm1_row_load` says (Mixtral-8x7B's
/// 128-row prefill tiles, F = 14336; not Qwen3-30B-A3B's, F = 768, nor any 64-row or
/// mma.sync regime), after the invert and sort kernels; validation catches a sort or its
/// inverse missing, a sort after GEMM1, on another grid or with other parameters, a
/// gathering GEMM1 that is still sorted for, and GEMM1 passed the intermediate's map
/// instead of sorted x's.
#[test]
fn gemm1_sorts_rows_where_it_pays_and_validation_checks_the_sort() {
    let plan = example_plan("mixtral_8x7b");
    let prefill = plan.regimes.len() - 1;
    let regime = &plan.regimes[prefill];
    assert_eq!(regime.gemm1.a_load, plan::RowLoad::Tiles);
    assert_eq!(regime.gemm1.tile.m, 128);
    for other in &plan.regimes[..prefill] {
        assert_eq!(
            other.gemm1.a_load,
            plan::RowLoad::Gathered,
            "{}",
            other.name
        );
    }
    let qwen3 = example_plan("qwen3_30b_a3b");
    assert!(
        qwen3
            .regimes
            .iter()
            .all(|r| r.gemm1.a_load == plan::RowLoad::Gathered)
    );
    assert!(
        qwen3
            .workspace
            .iter()
            .all(|b| b.id != plan::BufferId::SortedX)
    );
    let position = |plan: &plan::Plan, kernel: &str| {
        plan.regimes[prefill]
            .launches
            .iter()
            .position(|l| l.kernel == kernel)
    };
    let sort = position(&plan, &plan.sort_rows_kernel).expect("the prefill regime sorts");
    assert!(sort < position(&plan, &regime.gemm1_kernel).expect("GEMM1 is launched"));
    plan.validate().expect("the plan as made");

    let invert = position(&plan, &plan.invert_rows_kernel).expect("the prefill regime inverts");
    assert!(
        invert < sort,
        "the row order's inverse before the sort reads it"
    );

    let mut missing = plan.clone();
    missing.regimes[prefill].launches.remove(sort);
    assert!(missing.validate().is_err(), "no sort before a sorted GEMM1");

    let mut no_inverse = plan.clone();
    no_inverse.regimes[prefill].launches.remove(invert);
    assert!(no_inverse.validate().is_err(), "a sort without the inverse");

    let mut after = plan.clone();
    let launch = after.regimes[prefill].launches.remove(sort);
    after.regimes[prefill].launches.push(launch);
    assert!(after.validate().is_err(), "the sort after GEMM1");

    let mut one_block = plan.clone();
    one_block.regimes[prefill].launches[sort].grid = plan::Grid::Fixed(1);
    assert!(one_block.validate().is_err(), "a sort on one block");

    let mut no_row_table = plan.clone();
    no_row_table.regimes[prefill].launches[sort]
        .params
        .remove(2);
    assert!(
        no_row_table.validate().is_err(),
        "a sort without the row table"
    );

    let mut gathered = plan.clone();
    gathered.regimes[prefill].gemm1.a_load = plan::RowLoad::Gathered;
    assert!(
        gathered.validate().is_err(),
        "a gathering GEMM1 still sorted for"
    );

    let mut wrong_map = plan.clone();
    let gemm1_kernel = regime.gemm1_kernel.clone();
    let launch = wrong_map.regimes[prefill]
        .launches
        .iter_mut()
        .find(|l| l.kernel == gemm1_kernel)
        .expect("GEMM1 is launched");
    for param in &mut launch.params {
        if let plan::LaunchArg::SortedXTiles { box_rows } = param.arg {
            param.arg = plan::LaunchArg::IntermediateTiles { box_rows };
        }
    }
    assert!(
        wrong_map.validate().is_err(),
        "GEMM1 over the intermediate's map"
    );
}

/// Qwen3-30B-A3B's prefill and mid calls (up to 131072 and 8192 pairs) route over several
/// blocks, its decode calls (up to 2048) on one: validation catches count and place
/// launches on different grids, place before count, blocks of other than the kernels'
/// 1024 threads, a regime with neither routing, and a fused router (which replaces the
/// one-block route) on a regime that routes over blocks.
#[test]
fn routing_over_several_blocks_is_planned_and_checked() {
    let plan = example_plan("qwen3_30b_a3b");
    let prefill = plan.regimes.len() - 1;
    let grids = |regime: &plan::Regime, kernel: &str| -> Vec<plan::Grid> {
        regime
            .launches
            .iter()
            .filter(|l| l.kernel == kernel)
            .map(|l| l.grid)
            .collect()
    };
    let top = &plan.regimes[prefill];
    assert_eq!(
        grids(top, &plan.route_count_kernel),
        vec![plan::Grid::Fixed(32)],
        "16384 tokens x 8 pairs, 4096 pairs per block"
    );
    assert_eq!(
        grids(top, &plan.route_place_kernel),
        vec![plan::Grid::Fixed(32)]
    );
    assert!(grids(top, &plan.route_kernel).is_empty());
    let decode = &plan.regimes[0];
    assert_eq!(decode.max_tokens * 8, 2048, "Qwen3's decode regime");
    assert_eq!(
        grids(decode, &plan.route_kernel),
        vec![plan::Grid::Fixed(1)]
    );
    assert_eq!(
        grids(&plan.regimes[1], &plan.route_count_kernel),
        vec![plan::Grid::Fixed(2)],
        "the mid regime's 1024 tokens x 8 pairs"
    );
    assert!(plan.is_route_kernel(&plan.route_place_kernel));
    assert!(!plan.is_route_kernel(&plan.combine_kernel));

    let mut uneven = plan.clone();
    let place = plan.route_place_kernel.clone();
    for launch in &mut uneven.regimes[prefill].launches {
        if launch.kernel == place {
            launch.grid = plan::Grid::Fixed(16);
        }
    }
    let refusal = uneven
        .validate()
        .expect_err("count and place on different grids")
        .to_string();
    assert!(refusal.contains("one grid of several blocks"), "{refusal}");

    let mut swapped = plan.clone();
    swapped.regimes[prefill].launches.swap(0, 1);
    assert!(swapped.validate().is_err(), "place before count");

    let mut narrow = plan.clone();
    narrow.regimes[prefill].launches[0].block_threads = 512;
    assert!(
        narrow.validate().is_err(),
        "a routing block narrower than the kernels' strides"
    );

    let mut unrouted = plan.clone();
    let count = plan.route_count_kernel.clone();
    unrouted.regimes[prefill]
        .launches
        .retain(|l| l.kernel != count && l.kernel != place);
    assert!(unrouted.validate().is_err(), "a regime without routing");

    let mut fused = plan.clone();
    fused
        .router
        .as_mut()
        .expect("Qwen3's spec has a router")
        .regimes[prefill]
        .fused = true;
    let refusal = fused
        .validate()
        .expect_err("a fused router over blocks")
        .to_string();
    assert!(refusal.contains("fused router"), "{refusal}");
}

/// Results return as rank partials where a rank a token visits holds at least two of its
/// pairs on average (Qwen3-30B-A3B over 2 GPUs: 4.01), with the buffers they need; as
/// pair rows where it holds fewer (top-2 of 8 experts over 2 GPUs: 14/11) or where ranks
/// on other nodes take them back through NCCL; and validation refuses rank partials
/// across nodes.
#[test]
fn results_return_as_rank_partials_where_a_rank_holds_several_pairs() {
    assert!((plan::ep::pairs_per_visited_rank(8, 2, 2) - 14.0 / 11.0).abs() < 1e-9);
    let planned = |experts, top_k, gpus_per_node, nodes| {
        let mut layer = common::layer("ep", 2048, 768, experts, top_k, Activation::Swiglu, 16384);
        layer.parallel.expert = gpus_per_node * nodes;
        layer.topology.gpus_per_node = gpus_per_node;
        layer.topology.nodes = nodes;
        let plan = plan::plan(&layer, &Target::h200()).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        plan
    };
    let elems = |plan: &Plan, id: BufferId| {
        let ep = plan.expert_parallel.as_ref().expect("expert-parallel plan");
        ep.workspace.iter().find(|b| b.id == id).map(|b| b.elems)
    };

    let qwen = planned(128, 8, 2, 1);
    let ep = qwen.expert_parallel.as_ref().unwrap();
    assert_eq!(
        ep.combine_route,
        CombineRoute::RankPartials,
        "{}",
        ep.combine_reason
    );
    assert_eq!(elems(&qwen, BufferId::CombineSlots), Some(16384 * 2 * 2048));
    assert_eq!(
        elems(&qwen, BufferId::PairResults),
        Some(ep.intermediate_rows * 2048)
    );
    assert_eq!(
        elems(&qwen, BufferId::ReceivedPairRows),
        Some((2 * 16384 + 16384) * 8)
    );
    assert_eq!(elems(&qwen, BufferId::ReceivedTokens), Some(2));

    let top2 = planned(8, 2, 2, 1);
    let ep = top2.expert_parallel.as_ref().unwrap();
    assert_eq!(
        ep.combine_route,
        CombineRoute::PairRows,
        "{}",
        ep.combine_reason
    );
    assert_eq!(elems(&top2, BufferId::CombineSlots), Some(16384 * 2 * 2048));
    assert_eq!(elems(&top2, BufferId::PairResults), None);

    // Across nodes always partials, however few pairs a rank holds: a relay sums them
    // into one node partial per token, where pair rows would carry every slot of a token.
    let mut two_nodes = planned(128, 8, 1, 2);
    let ep = two_nodes.expert_parallel.as_mut().unwrap();
    assert_eq!(
        ep.combine_route,
        CombineRoute::RankPartials,
        "{}",
        ep.combine_reason
    );
    assert!(
        ep.combine_reason.contains("node partial"),
        "{}",
        ep.combine_reason
    );
    ep.combine_route = CombineRoute::PairRows;
    let error = two_nodes.validate().expect_err("pair rows across nodes");
    assert!(error.to_string().contains("rank partials"), "{error}");
}

/// The single-GPU combine spreads a token's row over ceil(H / 1024) blocks of 128 threads:
/// DeepSeek-V3 (H = 7168) takes 7, and validation refuses fewer blocks or threads, either
/// of which would leave columns unwritten.
#[test]
fn the_combine_covers_every_column() {
    let plan = example_plan("deepseek_v3");
    let combine_at = |plan: &Plan, regime: usize| {
        plan.regimes[regime]
            .launches
            .iter()
            .position(|l| l.kernel == plan.combine_kernel)
            .expect("the regime combines")
    };
    let at = combine_at(&plan, 0);
    assert_eq!(
        plan.regimes[0].launches[at].grid,
        Grid::TokenTiles {
            tokens_per_tile: 1,
            blocks_per_tile: 7
        }
    );
    let mut one_block = plan.clone();
    one_block.regimes[0].launches[at].grid = Grid::TokenTiles {
        tokens_per_tile: 1,
        blocks_per_tile: 1,
    };
    assert!(one_block.validate().is_err(), "one block per token");
    let mut half_threads = plan.clone();
    half_threads.regimes[0].launches[at].block_threads = 64;
    assert!(half_threads.validate().is_err(), "64 threads per block");
    // Codegen reads the blocks per token from the launches and refuses regimes that differ.
    let mut differing = plan.clone();
    let last = differing.regimes.len() - 1;
    let at_last = combine_at(&plan, last);
    differing.regimes[last].launches[at_last].grid = Grid::TokenTiles {
        tokens_per_tile: 1,
        blocks_per_tile: 8,
    };
    let error = moeforge_compiler::codegen::generate(&differing).expect_err("regimes differ");
    assert!(error.to_string().contains("blocks_per_tile: 8"), "{error}");
}

/// A layer on one GPU and a rank of the expert-parallel layer load only the kernels they
/// launch; together those are every entry point of the unit, and the one-GPU set holds
/// the router's and no expert-parallel kernel. An expert-parallel rank of a layer with a
/// router routes its own tokens: it loads the router's kernels and holds the router's
/// buffers, sized as on one GPU (a rank's calls have at most `max_tokens` tokens too).
#[test]
fn each_way_of_running_loads_the_kernels_it_launches() {
    for name in ["deepseek_v3", "tiny_two_nodes", "gpt_oss_120b"] {
        let plan = example_plan(name);
        let single = plan.single_gpu_entry_points();
        let ranks = plan.expert_parallel_entry_points();
        let mut both: Vec<_> = single.iter().chain(&ranks).cloned().collect();
        both.sort();
        both.dedup();
        let mut all = plan.entry_points();
        all.sort();
        assert_eq!(both, all, "{name}");
        if let Some(router) = &plan.router {
            for launch in router.regimes.iter().flat_map(|r| &r.launches) {
                assert!(single.contains(&launch.kernel), "{name}: {}", launch.kernel);
            }
        }
        match &plan.expert_parallel {
            Some(ep) => {
                for launch in ep.regimes.iter().flat_map(|r| &r.launches) {
                    assert!(ranks.contains(&launch.kernel), "{name}: {}", launch.kernel);
                }
                assert_eq!(ep.routes_itself, plan.router.is_some(), "{name}");
                for launch in plan
                    .router
                    .iter()
                    .flat_map(|r| &r.regimes)
                    .flat_map(|r| &r.launches)
                {
                    assert!(ranks.contains(&launch.kernel), "{name}: {}", launch.kernel);
                }
                for id in plan::ROUTER_BUFFERS {
                    let on_one_gpu = plan.workspace.iter().find(|b| b.id == id);
                    let on_a_rank = ep.workspace.iter().find(|b| b.id == id);
                    assert_eq!(
                        on_a_rank,
                        on_one_gpu.filter(|_| ep.routes_itself),
                        "{name}: {id:?}"
                    );
                }
                assert!(
                    single.len() < all.len(),
                    "{name}: the one-GPU set is smaller"
                );
            }
            None => assert!(ranks.is_empty(), "{name}"),
        }
    }
}

/// The JIT's compile order holds every entry point once, the GEMM kernels (which compile
/// longest) before any other.
#[test]
fn the_compile_order_starts_with_the_gemms() {
    for name in ["mixtral_8x7b", "deepseek_v3", "deepseek_v3_ep64", "tiny"] {
        let plan = example_plan(name);
        let order = plan.entry_points_in_compile_order();
        let mut sorted = order.clone();
        sorted.sort();
        let mut all = plan.entry_points();
        all.sort();
        assert_eq!(sorted, all, "{name}: every entry point once");
        let is_gemm = |k: &String| plan.gemm_kernels().any(|(_, gemm)| gemm == k);
        let gemms = order.iter().take_while(|k| is_gemm(k)).count();
        assert!(gemms >= 2, "{name}: GEMMs first");
        assert!(
            order[gemms..].iter().all(|k| !is_gemm(k)),
            "{name}: no GEMM after another kernel: {order:?}"
        );
    }
}

/// Stream-K on the examples' decode GEMMs follows the measurements it was fitted to (one
/// H200, 2026-12-01, one token): DeepSeek-V3's GEMM1 splits 288 tiles on 264 blocks (a
/// last wave of 24 tiles of 1.8 MB) and Mixtral's GEMM2 its 64 tiles of 3.7 MB; DeepSeek-V3's
/// GEMM2 (last wave 480), Mixtral's GEMM1 (184), Qwen3-30B-A3B's (96 and 128 tiles of at
/// most 0.5 MB) and GPT-OSS's (180) do not. The warp-specialised and the expert-parallel
/// GEMMs never split; the workspace holds two partial tiles per block of the largest split
/// GEMM and a counter per tile; validation catches a split on the wgmma engine.
#[test]
fn short_last_waves_of_large_tiles_split_stream_k() {
    let decode_splits = |name: &str, gemm1_tiles: u32, gemm2_tiles: u32| {
        let plan = example_plan(name);
        let decode = &plan.regimes[0];
        (
            // One token: a routed expert has one row.
            decode.gemm1.runs_stream_k(f64::from(gemm1_tiles), 1.0),
            decode.gemm2.runs_stream_k(f64::from(gemm2_tiles), 1.0),
        )
    };
    assert_eq!(decode_splits("deepseek_v3", 288, 1008), (true, false));
    // A routed expert with more rows than one m-tile holds never splits (the route places
    // its rows in atomic order, and a row's sums must not depend on its tile).
    let deepseek = example_plan("deepseek_v3");
    let gemm1 = &deepseek.regimes[0].gemm1;
    assert!(!gemm1.runs_stream_k(288.0, f64::from(gemm1.tile.m + 1)));
    assert_eq!(decode_splits("mixtral_8x7b", 448, 64), (false, true));
    assert_eq!(decode_splits("qwen3_30b_a3b", 96, 128), (false, false));
    assert_eq!(decode_splits("gpt_oss_120b", 180, 180), (false, false));

    let plan = example_plan("deepseek_v3");
    let single_gpu: Vec<&GemmPlan> = plan
        .regimes
        .iter()
        .flat_map(|r| [&r.gemm1, &r.gemm2])
        .collect();
    for gemm in &single_gpu {
        if gemm.engine == plan::MmaEngine::WgmmaWarpSpecialized {
            assert_eq!(gemm.stream_k, None);
        }
    }
    let ep = plan
        .expert_parallel
        .as_ref()
        .expect("DeepSeek-V3 is expert-parallel");
    for regime in &ep.regimes {
        assert_eq!((regime.gemm1.stream_k, regime.gemm2.stream_k), (None, None));
    }

    let elems = |id: BufferId| {
        plan.workspace
            .iter()
            .find(|b| b.id == id)
            .map(|b| b.elems)
            .expect("the workspace holds the stream-K buffers")
    };
    let most_partials = single_gpu.iter().map(|g| g.stream_k_partial_floats()).max();
    assert_eq!(
        most_partials,
        Some(2 * 528 * 16 * 64),
        "the decode GEMMs: 264 blocks of 16x(2x64) tiles, 528 of 16x64"
    );
    assert_eq!(Some(elems(BufferId::StreamKPartials)), most_partials);
    let most_tiles = single_gpu
        .iter()
        .filter_map(|g| g.stream_k.map(|tail| u64::from(tail.max_tiles)))
        .max();
    assert_eq!(Some(elems(BufferId::StreamKTilesDone)), most_tiles);

    let prefill = plan.regimes.len() - 1;
    let mut split_wgmma = plan.clone();
    let wgmma = &mut split_wgmma.regimes[prefill].gemm1;
    wgmma.stream_k = plan.regimes[0].gemm1.stream_k;
    let its_partials = wgmma.stream_k_partial_floats();
    // The workspace grown to match, so that only the engine is wrong.
    for buffer in &mut split_wgmma.workspace {
        if buffer.id == BufferId::StreamKPartials {
            buffer.elems = buffer.elems.max(its_partials);
        }
    }
    let error = split_wgmma
        .validate()
        .expect_err("stream-K on the wgmma engine");
    assert!(error.what.contains("stream-K"), "{error}");
}

/// The layer of the shipped example `name`, as checked.
fn example_layer(name: &str) -> Layer {
    let path = format!("{}/../dsl-examples/{name}.moe", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("the example exists");
    let module = moeforge_compiler::compile_source(&path, &text).expect("the example checks");
    module.layers.into_iter().next().expect("a layer")
}

/// With `fused_decode = 16 tokens`, every example's first regime runs its calls of up to
/// 16 tokens as one kernel: the regime's GEMM threads, a grid that is resident all at once
/// (for speed), counters in the workspace; larger calls run the table. Without the hint
/// there is none (the planner's default, until it is measured); a hint past the first
/// regime is capped and said so; 0 turns it off. Validation catches an edited grid or
/// token bound.
#[test]
fn small_calls_run_fused_where_the_spec_asks() {
    for name in [
        "qwen3_30b_a3b",
        "deepseek_v3",
        "mixtral_8x7b",
        "gpt_oss_120b",
    ] {
        let mut layer = example_layer(name);
        let unhinted = plan::plan(&layer, &Target::h200()).expect("plans");
        assert!(
            unhinted.regimes.iter().all(|r| r.fused_decode.is_none()),
            "{name}: off unless asked"
        );
        assert!(
            unhinted
                .workspace
                .iter()
                .all(|b| b.id != BufferId::FusedDecodeCounters),
            "{name}"
        );
        layer.schedule.fused_decode = Some(16);
        let plan = plan::plan(&layer, &Target::h200()).expect("plans");
        plan.validate().expect("consistent");
        let regime = &plan.regimes[0];
        let fused = regime.fused_decode.as_ref().expect("a fused decode");
        assert!(
            plan.regimes[1..].iter().all(|r| r.fused_decode.is_none()),
            "{name}"
        );
        let target = &plan.target;
        assert_eq!(fused.max_tokens, 16.min(regime.max_tokens), "{name}");
        assert_eq!(
            fused.max_rows,
            fused.max_tokens * plan.shape.slots_per_token(),
            "{name}"
        );
        let per_block = fused.launch.smem_bytes + fused.launch.static_smem_bytes + 1024;
        assert!(
            fused.blocks_per_sm * per_block <= target.smem_per_sm,
            "{name}: resident"
        );
        assert_eq!(
            fused.launch.grid,
            Grid::Fixed(target.sm_count * fused.blocks_per_sm),
            "{name}"
        );
        assert_eq!(fused.launch.block_threads, regime.gemm1.threads(), "{name}");
        assert_eq!(
            regime.all_launches().last(),
            Some(&fused.launch),
            "{name}: the table's launches, then the fused decode's"
        );
        assert!(
            plan.single_gpu_entry_points()
                .contains(&fused.launch.kernel),
            "{name}"
        );
        let counters = plan
            .workspace
            .iter()
            .find(|b| b.id == BufferId::FusedDecodeCounters)
            .expect("the fused decode's counters");
        assert_eq!(
            counters.elems,
            2 * u64::from(plan.shape.gemm_experts())
                + u64::from(plan.shape.hidden / regime.gemm2.tile.n)
                + 2,
            "{name}: per expert two, per column tile one, a ticket and a count"
        );
        for edit in [
            |f: &mut plan::FusedDecode| f.max_tokens += 1,
            |f: &mut plan::FusedDecode| f.launch.grid = Grid::Fixed(10_000),
            |f: &mut plan::FusedDecode| f.blocks_per_sm += 1,
        ] {
            let mut edited = plan.clone();
            edit(edited.regimes[0].fused_decode.as_mut().expect("fused"));
            let error = edited.validate().expect_err("an edited fused decode");
            assert!(
                error.to_string().contains("fused decode"),
                "{name}: {error}"
            );
        }
        layer.schedule.fused_decode = Some(100_000);
        let capped = plan::plan(&layer, &Target::h200()).expect("plans");
        let regime = &capped.regimes[0];
        assert_eq!(
            regime.fused_decode.as_ref().map(|f| f.max_tokens),
            Some(regime.max_tokens),
            "{name}"
        );
        assert!(
            capped
                .hints_not_honoured
                .iter()
                .any(|l| l.contains("fused_decode = 100000 tokens")),
            "{name}: {:?}",
            capped.hints_not_honoured
        );
        layer.schedule.fused_decode = Some(0);
        let off = plan::plan(&layer, &Target::h200()).expect("plans");
        assert!(
            off.regimes.iter().all(|r| r.fused_decode.is_none()),
            "{name}: 0 is off"
        );
        assert!(
            !off.hints_not_honoured
                .iter()
                .chain(&off.limitations)
                .any(|l| l.contains("fused")),
            "{name}"
        );
    }
}

/// A fused decode the first regime cannot give (its GEMMs on the warp-specialised engine)
/// is a hint the plan does not follow, not an error, and the table runs those calls.
#[test]
fn a_fused_decode_on_wgmma_tiles_is_refused_with_the_reason() {
    let mut layer = example_layer("qwen3_30b_a3b");
    layer.schedule.gemm1_tile = Some(TileShape {
        m: 64,
        n: 128,
        k: 64,
    });
    layer.schedule.fused_decode = Some(4);
    let plan = plan::plan(&layer, &Target::h200()).expect("plans");
    assert!(plan.regimes.iter().all(|r| r.fused_decode.is_none()));
    assert!(
        plan.hints_not_honoured
            .iter()
            .any(|l| l.contains("fused decode of up to 4 tokens") && l.contains("mma.sync")),
        "{:?}",
        plan.hints_not_honoured
    );
}

/// The examples with a router, on one GPU each.
const ROUTED_EXAMPLES: [&str; 4] = [
    "mixtral_8x7b",
    "qwen3_30b_a3b",
    "deepseek_v3",
    "gpt_oss_120b",
];

/// Behind a fused router, GEMM1 starts early where the target measured that faster (the
/// H200's default) and as the router's blocks finish on the H100, where starting early
/// lost (`Target::early_gemm1_behind_fused_router`); a split router, or a sort of x's rows
/// between the router and GEMM1 (Mixtral-8x7B's mid regime as tuned on the H100), keeps
/// GEMM1's early start. The table's GEMM1 launch starts early either way.
#[test]
fn gemm1_waits_for_a_fused_router_where_the_target_measured_it_faster() {
    let starts = |name: &str, target: &Target| -> Vec<(bool, bool, bool)> {
        let plan = plan::plan(&example_layer(name), target).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let router = plan.router.as_ref().expect("a router");
        plan.regimes
            .iter()
            .zip(&router.regimes)
            .map(|(regime, router_regime)| {
                let gemm1 = regime
                    .launches
                    .iter()
                    .find(|l| l.kernel == regime.gemm1_kernel)
                    .expect("the table runs GEMM1");
                assert!(gemm1.early_start, "{name}: the table's GEMM1 starts early");
                (
                    router_regime.fused,
                    regime.sorts_x_rows(),
                    router_regime.gemm1_starts_early,
                )
            })
            .collect()
    };
    for name in ROUTED_EXAMPLES {
        for (fused, sorted, early) in starts(name, &Target::h200()) {
            assert!(early, "{name} on the H200 (fused {fused}, sorted {sorted})");
        }
        let on_h100 = starts(name, &Target::h100());
        for &(fused, sorted, early) in &on_h100 {
            assert_eq!(early, !fused || sorted, "{name} on the H100");
        }
        // The decode regime on the H100: a fused router with GEMM1 next.
        assert_eq!(on_h100[0], (true, false, false), "{name}");
    }
    // The router's generated config says it: Mixtral's decode router lets GEMM1 start once
    // it has waited on the H200, and never signals on the H100.
    let decode_router = |target: &Target| -> String {
        let plan = plan::plan(&example_layer("mixtral_8x7b"), target).expect("plans");
        let source = moeforge_compiler::codegen::generate(&plan)
            .expect("codegen")
            .source;
        let config = source
            .find("struct decode_router_gate {")
            .expect("the decode router's config");
        let end = config + source[config..].find("\n};").expect("its end");
        source[config..end].to_string()
    };
    assert!(decode_router(&Target::h200()).contains("NEXT_STARTS_EARLY = true"));
    assert!(decode_router(&Target::h100()).contains("NEXT_STARTS_EARLY = false"));
}

/// GEMM1 lets GEMM2 start early beside it only for calls of up to
/// `GEMM2_BESIDE_GEMM1_MAX_TOKENS` tokens where a GEMM2 block fits an SM beside GEMM1's
/// resident blocks: DeepSeek-V3's decode regime on the H100 on the GEMMs the shipped tuning
/// gives its smallest calls (one 123 KB GEMM1 block per SM) for the whole regime, as shipped
/// before the tuner cut it in two (0..=4 on those GEMMs, where every call is within the
/// bound; 5..=512 on wgmma); none of the examples' regimes on the H200 (two 110 KB blocks per
/// SM, or wgmma); GEMM1's generated entry signals for those calls only.
#[test]
fn gemm2_starts_early_beside_gemm1_only_for_small_calls() {
    let mut shipped: moeforge_compiler::plan::tuning::TuningTable =
        serde_json::from_str(include_str!("../../tuning/shipped.json")).expect("the shipped table");
    let h100_decode_parts = |e: &moeforge_compiler::plan::tuning::TunedRegime| {
        e.gpu == Target::h100().name && e.shape.experts == 256 && e.max_tokens <= 512
    };
    let mut whole = shipped
        .entries
        .iter()
        .find(|e| h100_decode_parts(e) && e.min_tokens == 0)
        .expect("DeepSeek-V3's first decode part on the H100")
        .clone();
    whole.max_tokens = 512;
    shipped.entries.retain(|e| !h100_decode_parts(e));
    shipped.entries.push(whole);
    let tuned = |name: &str, target: &Target| {
        plan::plan_tuned(&example_layer(name), target, &shipped).expect("plans")
    };
    let early = |name: &str, target: &Target| -> Vec<Option<u32>> {
        let plan = tuned(name, target);
        plan.regimes
            .iter()
            .map(|regime| regime.gemm2_early_max_tokens(target.smem_per_sm))
            .collect()
    };
    for name in ROUTED_EXAMPLES {
        assert!(
            early(name, &Target::h200()).iter().all(Option::is_none),
            "{name} on the H200"
        );
    }
    let plan = tuned("deepseek_v3", &Target::h100());
    let decode = &plan.regimes[0];
    // A GEMM2 block fits beside the one GEMM1 block of each SM.
    assert_eq!(
        (decode.gemm1.blocks_per_sm, decode.gemm2.blocks_per_sm),
        (1, 3),
        "DeepSeek-V3's decode GEMMs on the H100 as tuned"
    );
    assert_eq!(
        decode.gemm2_early_max_tokens(plan.target.smem_per_sm),
        Some(plan::GEMM2_BESIDE_GEMM1_MAX_TOKENS)
    );
    assert!(plan.regimes[1..].iter().all(|regime| {
        regime
            .gemm2_early_max_tokens(plan.target.smem_per_sm)
            .is_none()
    }));
    let source = moeforge_compiler::codegen::generate(&plan)
        .expect("codegen")
        .source;
    let entry = source
        .find(&format!(" {}(", decode.gemm1_kernel))
        .expect("GEMM1's entry");
    let body = &source[entry..entry + source[entry..].find("\n}").expect("its end")];
    assert!(
        body.contains(&format!(
            "if (tokens <= {}) let_next_kernel_start();",
            plan::GEMM2_BESIDE_GEMM1_MAX_TOKENS
        )),
        "{body}"
    );
    assert!(!body.contains("start_after_previous_kernel"), "{body}");
}

/// A fused router's gate widens its expert tile (same 16-token height) for the calls
/// where the regime's tile would give more blocks than SMs, each such range its own fused
/// kernel: DeepSeek-V3's decode regime on the H100 (0..=512 tokens) runs 16 x 32 up to 256
/// tokens and 16 x 64 above; on the H200 (0..=256) 16 x 16 up to 128 and 16 x 32 above;
/// Qwen3-30B-A3B's 16 x 16 tile keeps one wave through its regime and its one kernel's
/// name. Each call runs the gate of its range, alone; `explain` lists both.
#[test]
fn fused_routers_widen_their_tile_where_the_grid_passes_one_wave() {
    let fused_gates = |name: &str, target: &Target| -> Vec<(u32, u32, u32, u32, String)> {
        let plan = plan::plan(&example_layer(name), target).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let router = plan.router.as_ref().expect("a router");
        let regime = &router.regimes[0];
        assert!(regime.fused, "{name}: the decode regime's router is fused");
        for gate in &regime.gates {
            let blocks = plan::router::gate_blocks(
                gate.tile_tokens,
                gate.tile_experts,
                plan.shape.experts,
                gate.max_tokens,
            );
            assert!(
                blocks <= target.sm_count,
                "{name}: {blocks} blocks at {} tokens",
                gate.max_tokens
            );
            for tokens in [gate.min_tokens.max(1), gate.max_tokens] {
                let runs: Vec<usize> = regime.launches_for(tokens).collect();
                let index = regime.gates.iter().position(|g| g == gate).unwrap();
                assert_eq!(runs, vec![index], "{name} at {tokens} tokens");
            }
        }
        regime
            .gates
            .iter()
            .zip(&regime.launches)
            .map(|(g, l)| {
                (
                    g.min_tokens,
                    g.max_tokens,
                    g.tile_tokens,
                    g.tile_experts,
                    l.kernel.clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        fused_gates("deepseek_v3", &Target::h100()),
        vec![
            (
                0,
                256,
                16,
                32,
                "deepseek_v3_decode_router_16x32".to_string()
            ),
            (
                257,
                512,
                16,
                64,
                "deepseek_v3_decode_router_16x64".to_string()
            ),
        ]
    );
    assert_eq!(
        fused_gates("deepseek_v3", &Target::h200()),
        vec![
            (
                0,
                128,
                16,
                16,
                "deepseek_v3_decode_router_16x16".to_string()
            ),
            (
                129,
                256,
                16,
                32,
                "deepseek_v3_decode_router_16x32".to_string()
            ),
        ]
    );
    assert_eq!(
        fused_gates("qwen3_30b_a3b", &Target::h200()),
        vec![(0, 256, 16, 16, "qwen3_30b_a3b_decode_router".to_string())]
    );
    let explained =
        plan::describe(&plan::plan(&example_layer("deepseek_v3"), &Target::h100()).expect("plans"));
    assert!(
        explained.contains("gate   257..=512 tokens: mma.sync tile 16 tokens x 64 experts"),
        "{explained}"
    );
}

/// A fused gate's tile at a call: the regime tile while its grid fits one wave; past that
/// the narrowest wider expert tile that fits one wave and whose scratch fits a block; the
/// regime tile where none does (or E leaves no wider tile).
#[test]
fn a_fused_gate_widens_to_the_narrowest_tile_of_one_wave() {
    use plan::router::fused_gate_tile_at;
    let any = |_| true;
    // 256 experts on 132 SMs: 16 x 16 is 16 blocks per 16 tokens.
    assert_eq!(fused_gate_tile_at(256, (16, 16), 128, 132, any), (16, 16));
    assert_eq!(fused_gate_tile_at(256, (16, 16), 129, 132, any), (16, 32));
    assert_eq!(fused_gate_tile_at(256, (16, 16), 512, 132, any), (16, 64));
    assert_eq!(
        fused_gate_tile_at(256, (16, 16), 512, 132, |(_, n)| n != 64),
        (16, 128)
    );
    assert_eq!(
        fused_gate_tile_at(256, (16, 16), 512, 132, |_| false),
        (16, 16)
    );
    assert_eq!(fused_gate_tile_at(256, (16, 16), 4096, 132, any), (16, 16));
    // Mixtral's 8 experts: 16 covers them, nothing is wider.
    assert_eq!(fused_gate_tile_at(8, (16, 16), 4096, 132, any), (16, 16));
}

/// A split router's gate runs on wgmma where the target has it and each of its blocks
/// takes a long enough run of the reduction (Qwen3-30B-A3B from 4097 tokens, DeepSeek-V3
/// from 2049, with every expert in one tile), in clusters or mma.sync elsewhere and on
/// targets without wgmma; a fused router's gate is mma.sync; `explain` names the engine.
#[test]
fn split_gates_run_on_wgmma_where_their_blocks_have_long_reductions() {
    let engines = |name: &str, target: &Target| -> Vec<(u32, GateEngine, u32, u32)> {
        let plan = plan::plan(&example_layer(name), target).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let router = plan.router.as_ref().expect("a router");
        router
            .regimes
            .iter()
            .flat_map(|regime| {
                regime.gates.iter().map(move |g| {
                    assert!(!regime.fused || g.engine == GateEngine::MmaSync);
                    (g.max_tokens, g.engine, g.tile_tokens, g.tile_experts)
                })
            })
            .collect()
    };
    let h200 = Target::h200();
    let wgmma_from = |gates: &[(u32, GateEngine, u32, u32)]| {
        gates
            .iter()
            .find(|g| g.1 == GateEngine::WarpSpecialized)
            .map(|g| g.0)
    };
    let qwen3 = engines("qwen3_30b_a3b", &h200);
    assert_eq!(wgmma_from(&qwen3), Some(8192), "{qwen3:?}");
    assert_eq!(
        qwen3.last(),
        Some(&(16384, GateEngine::WarpSpecialized, 128, 128))
    );
    let deepseek = engines("deepseek_v3", &h200);
    assert_eq!(wgmma_from(&deepseek), Some(8192), "{deepseek:?}");
    assert!(deepseek.contains(&(8192, GateEngine::WarpSpecialized, 64, 256)));
    // The wgmma gates start at 4097 tokens for Qwen3 (a 64-token tile split in two would
    // take 16 k-tiles a block) and at 2049 for DeepSeek-V3 (56).
    let first_wgmma = |gates: &[(u32, GateEngine, u32, u32)]| {
        let i = gates
            .iter()
            .position(|g| g.1 == GateEngine::WarpSpecialized)
            .unwrap();
        gates[i - 1].0 + 1
    };
    assert_eq!(first_wgmma(&qwen3), 4097);
    assert_eq!(first_wgmma(&deepseek), 2049);
    // Mixtral's 8 experts are not whole 16-expert pieces.
    assert_eq!(wgmma_from(&engines("mixtral_8x7b", &h200)), None);
    assert_eq!(wgmma_from(&engines("qwen3_30b_a3b", &Target::a100())), None);

    let explained =
        plan::describe(&plan::plan(&example_layer("qwen3_30b_a3b"), &h200).expect("plans"));
    assert!(
        explained.contains("8193..=16384 tokens: wgmma tile 128 tokens x 128 experts"),
        "{explained}"
    );
}

/// A split router's gates for calls of a few hundred tokens run in clusters on sm_90a: one
/// cluster per token tile across every expert, its blocks splitting H / 64 evenly and
/// selecting their tokens themselves, so that a regime whose gates all select has no select
/// launch; only where every cluster runs at once (15 of 8 blocks on the H200 at one block
/// per SM: 16 would take two waves) and the blocks' selects are short; else, and on a
/// target without clusters, the mma.sync gates and the select; `explain` says so.
#[test]
fn split_gates_of_a_few_hundred_tokens_run_in_clusters_that_select() {
    let h200 = Target::h200();
    let gates_at = |name: &str, target: &Target, tokens: u32| {
        let plan = plan::plan(&example_layer(name), target).expect("plans");
        assert_eq!(plan.validate(), Ok(()));
        let router = plan.router.clone().expect("a router");
        let regime = &router.regimes[plan.regime_index_for(tokens).expect("a regime")];
        let gate = regime.gates[regime.launches_for(tokens).next().expect("a gate")];
        (plan, gate, regime.launches_for(tokens).count())
    };
    for (name, tokens, blocks, tile) in [
        ("qwen3_30b_a3b", 1024, 8, (64, 128)),
        ("qwen3_30b_a3b", 512, 8, (32, 128)),
        ("mixtral_8x7b", 1024, 8, (64, 16)),
    ] {
        let (plan, gate, launches) = gates_at(name, &h200, tokens);
        assert_eq!(gate.engine, GateEngine::Cluster { blocks }, "{name}");
        assert_eq!((gate.tile_tokens, gate.tile_experts), tile, "{name}");
        assert_eq!(launches, 1, "{name}: the gate selects");
        assert!(
            plan::describe(&plan).contains(&format!("mma.sync in clusters of {blocks} blocks")),
            "{name}"
        );
    }
    let (plan, gate, _) = gates_at("qwen3_30b_a3b", &h200, 1024);
    let router = plan.router.as_ref().expect("a router");
    let mid = &router.regimes[plan.regime_index_for(1024).expect("a regime")];
    assert!(mid.gates.iter().all(|g| g.engine.selects()) && mid.select_launch().is_none());
    assert_eq!(gate.logits_slices(1024), 1);
    // The wgmma gates of the largest calls still hand over to the select.
    let prefill = router.regimes.last().expect("a regime");
    assert_eq!(prefill.select_launch(), Some(prefill.gates.len()));
    // A cluster of 8 blocks per 64-token tile at 1024 tokens fits two blocks to an SM
    // (16 clusters, 30 at once); DeepSeek-V3's wider tile does not, nor would its longer
    // reduction pay: the mma.sync gate and the select serve it.
    assert!(gate.smem_bytes <= h200.smem_per_sm / 2 - 1024);
    let (_, gate, launches) = gates_at("deepseek_v3", &h200, 1024);
    assert_eq!((gate.engine, launches), (GateEngine::MmaSync, 2));
    // An A100 has no clusters.
    let (_, gate, launches) = gates_at("qwen3_30b_a3b", &Target::a100(), 1024);
    assert_eq!((gate.engine, launches), (GateEngine::MmaSync, 2));
    // Nor do virtual ranks route in them: beside their spinning blocks a cluster may find
    // no GPC with enough free SMs.
    let mut on_virtual_ranks = example_layer("qwen3_30b_a3b");
    on_virtual_ranks.parallel.expert = 2;
    on_virtual_ranks.topology.gpus_per_node = 1;
    on_virtual_ranks.topology.virtual_ranks = Some(2);
    let plan = plan::plan(&on_virtual_ranks, &h200).expect("plans");
    assert_eq!(plan.validate(), Ok(()));
    assert!(
        plan.expert_parallel
            .as_ref()
            .is_some_and(|ep| ep.routes_itself)
    );
    let gates = plan
        .router
        .iter()
        .flat_map(|r| &r.regimes)
        .flat_map(|r| &r.gates);
    assert!(gates.clone().count() > 0);
    for gate in gates {
        assert!(
            !matches!(gate.engine, GateEngine::Cluster { .. }),
            "{gate:?}"
        );
    }
    // Validation holds a virtual-rank plan to it: the one-GPU plan's router, which has
    // cluster gates, is refused there.
    let mut clustered = plan.clone();
    clustered.router = plan::plan(&example_layer("qwen3_30b_a3b"), &h200)
        .expect("plans")
        .router;
    let error = clustered
        .validate()
        .expect_err("cluster gates on virtual ranks");
    assert!(error.to_string().contains("does not add up"), "{error}");
}

/// Every expert count a cluster gate may take (whole float4s up to 256) and a few
/// reductions plan a router that validates: a tile of E rounded up to 16 that its warps
/// cannot cover in whole 16 × 16 pieces (80, 112, 160, ... experts) gets the mma.sync gate.
#[test]
fn cluster_gates_validate_for_every_expert_count() {
    let base = example_layer("qwen3_30b_a3b");
    for experts in (4..=256).step_by(4) {
        for hidden in [512, 1024, 2048] {
            let mut layer = base.clone();
            layer.experts = experts;
            layer.top_k = layer.top_k.min(experts);
            layer.hidden = hidden;
            layer.max_tokens = 2048;
            layer.parallel.expert = 1;
            let plan = plan::plan(&layer, &Target::h200())
                .unwrap_or_else(|e| panic!("E = {experts}, H = {hidden}: {e}"));
            assert_eq!(plan.validate(), Ok(()), "E = {experts}, H = {hidden}");
        }
    }
}

/// The examples' decode regimes (both GEMMs mma.sync) route calls of up to 128 (token, k)
/// pairs in the GEMMs' blocks, and only those; regimes on wgmma and the expert-parallel
/// GEMMs never do; a fused router leaves the metadata out for those calls; the GEMMs that
/// do take the call's ids, token count and switch (GEMM1 the error word too), and
/// validation catches a GEMM that routes in its blocks without
/// its tables or arguments.
#[test]
fn small_calls_route_in_the_gemms_blocks() {
    for (name, top_k_tokens) in [
        ("qwen3_30b_a3b", 16),
        ("deepseek_v3", 16),
        ("gpt_oss_120b", 32),
        ("mixtral_8x7b", 64),
    ] {
        let plan = example_plan(name);
        let top_k = plan.shape.top_k;
        let decode = &plan.regimes[0];
        let routing = decode
            .block_routing(top_k)
            .expect("the decode regime routes in blocks");
        assert_eq!(
            (routing.max_pairs, routing.max_tokens(top_k)),
            (plan::BLOCK_ROUTING_MAX_PAIRS, top_k_tokens),
            "{name}"
        );
        for tokens in [0, 1, top_k_tokens] {
            assert!(decode.routes_in_blocks(tokens, top_k), "{name} at {tokens}");
        }
        assert!(!decode.routes_in_blocks(top_k_tokens + 1, top_k), "{name}");
        // A fused router leaves the metadata out for those calls (no fused decode here).
        assert_eq!(
            decode.router_metadata_left_out_max_tokens(top_k),
            top_k_tokens,
            "{name}"
        );
        for regime in &plan.regimes[1..] {
            assert_eq!(regime.block_routing(top_k), None, "{name} {}", regime.name);
        }
        for (gemm, launch, up) in [
            (
                &decode.gemm1,
                &decode
                    .launches
                    .iter()
                    .find(|l| l.kernel == decode.gemm1_kernel),
                true,
            ),
            (
                &decode.gemm2,
                &decode
                    .launches
                    .iter()
                    .find(|l| l.kernel == decode.gemm2_kernel),
                false,
            ),
        ] {
            let args: Vec<&str> = launch
                .expect("launched")
                .params
                .iter()
                .map(|p| p.arg.name())
                .collect();
            assert!(
                args.ends_with(if up {
                    &["topk_ids", "tokens", "routes_in_blocks", "error_word"]
                } else {
                    &["topk_ids", "tokens", "routes_in_blocks"]
                }),
                "{name}: {args:?}"
            );
            assert!(gemm.block_routing.is_some());
        }
        if let Some(ep) = &plan.expert_parallel {
            for regime in &ep.regimes {
                assert_eq!(
                    (regime.gemm1.block_routing, regime.gemm2.block_routing),
                    (None, None)
                );
            }
        }
        plan.validate().expect("valid");

        // Tables without the routing, or the routing without its tables, are refused.
        let mut edited = plan.clone();
        edited.regimes[0].gemm2.block_routing = None;
        assert!(edited.validate().is_err(), "{name}: routing taken away");
        let mut edited = plan.clone();
        let last = edited.regimes.len() - 1;
        edited.regimes[last].gemm1.block_routing = Some(routing);
        assert!(edited.validate().is_err(), "{name}: routing on wgmma");
    }
}
