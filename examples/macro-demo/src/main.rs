//! A user of `#[moeforge::moe_layer]`: two layers planned at compile time from the
//! repository's specs, the tiny test layer and Mixtral-8x7B. Prints both plans' summaries
//! (no GPU needed); with a GPU, builds the tiny layer with random weights, runs it on
//! random tokens and checks every output element against the CPU reference.
//!
//! `cargo run -p macro-demo` (add `--release` on a GPU machine).

use std::process::ExitCode;

use moeforge::compiler::plan::describe;
use moeforge::embedded::{KernelOrigin, SpecLayer};
use moeforge::moe_layer;
use moeforge::runtime::harness::{CHECKED_TOKENS, Session};
use moeforge::runtime::workload::{Routing, Workload};

/// The tiny layer of the test suite (8 experts, hidden 128).
#[moe_layer(file = "../../dsl-examples/tiny.moe")]
pub fn tiny() {}

/// Mixtral-8x7B's MoE layer (8 experts, top-2, hidden 4096, FFN 14336).
#[moe_layer(file = "../../dsl-examples/mixtral_8x7b.moe", layer = "mixtral_8x7b")]
pub fn mixtral() {}

/// Tokens of the tiny layer's checked call: odd, so the last row tile is ragged.
const TOKENS: u32 = 100;

fn main() -> ExitCode {
    let mut ok = print_plan(tiny()) && print_plan(mixtral());
    match Session::open() {
        Ok(session) => ok &= run_tiny(&session),
        Err(error) => println!("no GPU here ({error}); not running the tiny layer"),
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_plan<const H: usize, const K: usize>(layer: &SpecLayer<H, K>) -> bool {
    let shape = layer.shape();
    println!(
        "== {} (from {}, for the {}): H = {H}, F = {}, E = {}, K = {K}, max_tokens = {}; {}",
        layer.name(),
        layer.spec(),
        layer.target_name(),
        shape.ffn,
        shape.experts,
        shape.max_tokens,
        if layer.ptx().is_some() {
            "PTX embedded"
        } else {
            "source embedded, compiled at first use"
        }
    );
    match layer.plan() {
        Ok(plan) => {
            println!("{}", describe(plan));
            true
        }
        Err(error) => {
            eprintln!("error: {error}");
            false
        }
    }
}

fn run_tiny(session: &Session) -> bool {
    let layer = tiny();
    let result = layer.build_random(session, 1).and_then(|built| {
        let origin = layer.kernels()?.origin;
        let workload = Workload::random(&built.layer.plan().shape, TOKENS, Routing::Uniform, 2);
        let report = session.run_checked(&built, &workload, CHECKED_TOKENS, 3)?;
        Ok((origin, report))
    });
    match result {
        Ok((origin, report)) => {
            let kernels = match origin {
                KernelOrigin::Embedded => "embedded PTX",
                KernelOrigin::CompiledAtFirstUse => "compiled at first use",
            };
            println!("tiny on {} ({kernels}): {report}", session.gpu.name());
            report.passed()
        }
        Err(error) => {
            eprintln!("error: {error}");
            false
        }
    }
}
