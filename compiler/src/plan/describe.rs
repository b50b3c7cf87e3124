//! The plan as readable text (`moeforge explain`), stable enough to snapshot.

use std::fmt::Write as _;

use super::{Access, Grid, Plan};

/// One fact per line; `write!` into a `String` cannot fail.
pub fn describe(plan: &Plan) -> String {
    let mut out = String::new();
    let shape = &plan.shape;
    let _ = writeln!(
        out,
        "plan for {} on {} ({}, {} SMs)",
        plan.layer, plan.target.name, plan.target.arch, plan.target.sm_count
    );
    let _ = writeln!(
        out,
        "  ranks                {} in the spec, {} executed (all {} experts on one GPU)",
        shape.spec_ranks, shape.executed_ranks, shape.experts
    );
    for regime in &plan.regimes {
        let _ = writeln!(
            out,
            "  regime {:<13} {}..={} tokens",
            regime.name, regime.min_tokens, regime.max_tokens
        );
        for (name, gemm) in [("gemm1", &regime.gemm1), ("gemm2", &regime.gemm2)] {
            let e = &gemm.estimate;
            let _ = writeln!(
                out,
                "    {name}  {} tile {}x{}x{}{}, {} stages, {}x{} warps, {} B smem, {} blocks ({}/SM); model at T={}: {:.1} us (compute {:.1}, memory {:.1}, L2 {:.1})",
                gemm.engine.name(),
                gemm.tile.m,
                gemm.tile.n,
                gemm.tile.k,
                if gemm.hinted { " (hint)" } else { "" },
                gemm.stages,
                gemm.warps_m,
                gemm.warps_n,
                gemm.smem_bytes,
                gemm.grid_blocks,
                gemm.blocks_per_sm,
                e.tokens,
                e.seconds * 1e6,
                e.compute_seconds * 1e6,
                e.memory_seconds * 1e6,
                e.l2_seconds * 1e6,
            );
        }
        for launch in &regime.launches {
            let grid = match launch.grid {
                Grid::Fixed(n) => format!("{n} blocks"),
                Grid::PerToken => "1 block per token".to_string(),
            };
            // Written parameters carry a `*`, as in `&mut`: what the kernel produces.
            let params: Vec<String> = launch
                .params
                .iter()
                .map(|p| match p.access {
                    Access::Read => p.arg.name().to_string(),
                    Access::Write => format!("*{}", p.arg.name()),
                })
                .collect();
            let _ = writeln!(
                out,
                "    launch {} <<<{grid}, {} threads, {} B + {} B static>>>({})",
                launch.kernel,
                launch.block_threads,
                launch.smem_bytes,
                launch.static_smem_bytes,
                params.join(", ")
            );
        }
    }
    let _ = writeln!(out, "  workspace");
    for buffer in &plan.workspace {
        let _ = writeln!(
            out,
            "    {:<15} {:>14} B  {}",
            buffer.id.name(),
            buffer.bytes(),
            buffer.purpose
        );
    }
    for limitation in &plan.limitations {
        let _ = writeln!(out, "  note: {limitation}");
    }
    out
}
