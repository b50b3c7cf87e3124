//! Planner invariants over many generated layers: the plan is feasible on the target, its
//! regimes cover 0..=max_tokens, its tiles divide the problem, and the tile schedule the
//! kernels follow (modelled here on the CPU, from the plan's numbers) covers every
//! (token, k) pair exactly once, with ragged row tiles masked.

use moeforge_compiler::ir::{Activation, Layer, TileShape};
use moeforge_compiler::plan::{self, GemmPlan, Plan, PlanError, TILE_K, Target};
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
    assert!(
        gemm.smem_bytes + (plan.shape.experts + 1) * 4 <= target.smem_per_block,
        "{gemm:?}"
    );
    assert_eq!(gemm.tile.k, TILE_K);
    assert_eq!(n % gemm.tile.n, 0, "tile columns divide the output width");
    assert_eq!(k % gemm.tile.k, 0, "tile depth divides the reduction");
    assert_eq!(gemm.tile.m % (16 * gemm.warps_m), 0);
    assert_eq!(gemm.tile.n % (16 * gemm.warps_n), 0);
    assert!(gemm.grid_blocks >= target.sm_count && gemm.blocks_per_sm >= 1);
}

/// The kernels' routing and tile schedule, on the CPU: counts -> offsets -> expert-major
/// rows; tiles (expert, n-tile, m-tile) of `tile.m` rows, the last one ragged.
fn covered_pairs(ids: &[i32], experts: u32, tile: TileShape, n: u32) -> Vec<u32> {
    let mut counts = vec![0u32; experts as usize];
    for &e in ids {
        counts[e as usize] += 1;
    }
    let mut offsets = vec![0u32; experts as usize + 1];
    for e in 0..experts as usize {
        offsets[e + 1] = offsets[e] + counts[e];
    }
    let mut cursor = offsets.clone();
    let mut row_pair = vec![u32::MAX; ids.len()];
    for (p, &e) in ids.iter().enumerate() {
        row_pair[cursor[e as usize] as usize] = p as u32;
        cursor[e as usize] += 1;
    }
    let mut seen = vec![0u32; ids.len()];
    for e in 0..experts as usize {
        let rows = offsets[e + 1] - offsets[e];
        for _n_tile in 0..n / tile.n {
            for m_tile in 0..rows.div_ceil(tile.m) {
                let row0 = offsets[e] + m_tile * tile.m;
                let valid = tile.m.min(offsets[e + 1] - row0);
                assert!(
                    valid >= 1 && valid <= tile.m,
                    "a tile masks its ragged rows"
                );
                for r in row0..row0 + valid {
                    seen[row_pair[r as usize] as usize] += 1;
                }
            }
        }
    }
    seen.iter().map(|&s| s / (n / tile.n)).collect()
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
    fn tile_schedule_covers_each_pair_exactly_once(
        layer in arbitrary_layer(),
        seed in any::<u64>(),
        skew in any::<bool>(),
    ) {
        let Ok(plan) = plan::plan(&layer, &Target::h200()) else { return Ok(()) };
        let tokens = (seed % u64::from(layer.max_tokens.min(3000) + 1)) as u32;
        let mut state = seed;
        let ids: Vec<i32> = (0..tokens * layer.top_k)
            .map(|p| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if skew && p % layer.top_k == 0 { 0 } else { ((state >> 33) % u64::from(layer.experts)) as i32 }
            })
            .collect();
        let Some(regime) = plan.regime_for(tokens) else { panic!("T={tokens} has a regime") };
        for (gemm, n) in [(&regime.gemm1, layer.ffn), (&regime.gemm2, layer.hidden)] {
            let seen = covered_pairs(&ids, layer.experts, gemm.tile, n);
            prop_assert!(seen.iter().all(|&s| s == 1), "every (token, k) pair exactly once");
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
            .all(|r| r.gemm2.tile == tile && r.gemm2.hinted)
    );
}
