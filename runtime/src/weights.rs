//! Where a layer's routed-expert weights come from, and putting them on the device.
//!
//! [`Weights`] names the source: random (seeded, generated on the host), host buffers the
//! caller already holds in the kernels' layout, or one layer of a safetensors checkpoint
//! ([`CheckpointLayer`]). [`Weights::host`] gives the experts of one layer, all of them or
//! one expert-parallel rank's share, as [`HostWeights`]; [`upload`] copies them to a
//! device as the [`ExpertWeights`] a [`crate::layer::MoeLayer`] or [`crate::ep::EpLayer`]
//! takes. Nothing here chooses a layout: it is the checkpoints' own `[out, in]` matrices,
//! W1 each expert's gate rows then its up rows (see [`crate::checkpoint`]).
//!
//! The router's gate, for a spec with a router, comes from the same source:
//! [`Weights::gate`] draws it, or reads it from the checkpoint; [`upload_gate`] puts it on
//! a device as the [`GateWeights`] [`crate::layer::MoeLayer::with_gate`] takes.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use moeforge_compiler::ir::{self, RouterBias};
use moeforge_compiler::plan::LayerShape;

use crate::bf16;
use crate::checkpoint::{
    CheckpointError, CheckpointLayer, ExpertSet, HostBiases, HostGate, HostWeights,
};
use crate::gpu::{DriverContext, GpuError};
use crate::layer::{ExpertBiases, ExpertWeights, GateWeights};
use crate::workload::{SplitMix64, weight_scale};

/// The source of a layer's routed-expert weights.
pub enum Weights {
    /// Uniform in ±`sqrt(3 / fan_in)` (H for W1, F for W2), drawn on the host from
    /// `seed`, expert by expert: a rank's share equals the same experts of the whole
    /// layer. Not the values `moeforge run` fills on the device for the same seed; for
    /// tests and demos (a large layer takes seconds to draw).
    Random { seed: u64 },
    /// Weights the caller holds, in the kernels' layout; they must hold every expert
    /// asked for.
    Host(HostWeights),
    /// One layer of a safetensors checkpoint, its prefix and family resolved.
    Checkpoint(CheckpointLayer),
}

impl Weights {
    /// The experts `which` of a layer of `shape` on the host: drawn, copied out of the
    /// caller's buffers, or read from the checkpoint (checking every tensor's name,
    /// shape and dtype).
    pub fn host(
        &self,
        shape: &LayerShape,
        which: ExpertSet,
    ) -> Result<HostWeights, CheckpointError> {
        match self {
            Weights::Random { seed } => Ok(random(shape, which.range(shape)?, *seed)),
            Weights::Host(weights) => weights.select(shape, which),
            Weights::Checkpoint(layer) => layer.load(shape, which),
        }
    }
}

impl Weights {
    /// What expert-parallel rank `rank` of `ranks` holds: its routed experts, then the
    /// layer's shared slices when it has them (every rank runs those on its own tokens),
    /// for [`upload_parts`].
    pub fn rank_parts(
        &self,
        shape: &LayerShape,
        rank: u32,
        ranks: u32,
    ) -> Result<Vec<HostWeights>, CheckpointError> {
        ExpertSet::held_by_rank(rank, ranks)
            .into_iter()
            .map(|which| self.host(shape, which))
            .collect()
    }
}

impl Weights {
    /// The router's gate of a layer of `shape` whose rule is `rule`: drawn (see
    /// [`random_gate`]), or read from the checkpoint with the bias the rule adds; `None`
    /// for host weights, which hold experts only (such a layer runs caller-routed calls).
    pub fn gate(
        &self,
        shape: &LayerShape,
        rule: &ir::Router,
    ) -> Result<Option<HostGate>, CheckpointError> {
        match self {
            Weights::Random { seed } => Ok(Some(random_gate(shape, rule.bias, *seed))),
            Weights::Host(_) => Ok(None),
            Weights::Checkpoint(layer) => layer.load_gate(shape, rule.bias).map(Some),
        }
    }
}

/// Keeps the gate's random stream apart from the experts' for the same seed.
const GATE_SEED_SALT: u64 = 0x6a7e_0000_5eed_0001;
/// Half-width of a random gate bias of `bias`'s kind: a trained router's loads are about
/// balanced (DeepSeek-V3's correction bias exists to balance them), so a random bias
/// changes about a quarter of the tokens' choices (the bias path is exercised) while the
/// busiest expert's load stays within about 15% of the unbiased gate's. A per-expert bias
/// moves that expert's share of every call: with ±0.1, DeepSeek-V3's sigmoid scores were
/// re-chosen for every token and the busiest expert got 3.6 times the mean load at 4096
/// tokens (some experts none), which self-routed benches and tunes then timed
/// (`benches/results/2026-12-07_random_router_loads.md`).
fn random_bias_range(bias: RouterBias) -> Option<f32> {
    match bias {
        RouterBias::None => None,
        // Shifts softmax logits of order one (GPT-OSS).
        RouterBias::Logits => Some(0.05),
        // Shifts only the choice among sigmoid scores, whose top ones lie close together
        // (DeepSeek-V3's: ±0.1 re-chose every token, ±0.01 41% of them).
        RouterBias::ScoreCorrection => Some(0.005),
    }
}

/// A uniform random gate of a layer of `shape`: W_gate in ±`sqrt(3 / H)` (logits of order
/// one for inputs in ±1), and with a `bias` rule a bias of a half-width set by its kind
/// (`random_bias_range`).
pub fn random_gate(shape: &LayerShape, bias: RouterBias, seed: u64) -> HostGate {
    let mut rng = SplitMix64::new(seed ^ GATE_SEED_SALT);
    let scale = weight_scale(shape.hidden);
    let weight = (0..u64::from(shape.experts) * u64::from(shape.hidden))
        .map(|_| bf16::from_f32(rng.signed() * scale))
        .collect();
    let bias = random_bias_range(bias)
        .map(|range| (0..shape.experts).map(|_| rng.signed() * range).collect());
    HostGate { weight, bias }
}

/// Copies `gate` to `stream`'s device and waits for the copies.
pub fn upload_gate(stream: &Arc<CudaStream>, gate: &HostGate) -> Result<GateWeights, GpuError> {
    let weight = stream
        .clone_htod(&gate.weight)
        .context("uploading the router's gate weight")?;
    let bias = gate
        .bias
        .as_ref()
        .map(|bias| {
            stream
                .clone_htod(bias)
                .context("uploading the router's gate bias")
        })
        .transpose()?;
    stream
        .synchronize()
        .context("waiting for the gate's upload")?;
    Ok(GateWeights { weight, bias })
}

/// Half-width of random expert biases: of the order of a projection's outputs (about ±1
/// for inputs in ±1), so that they move them without deciding them.
pub const RANDOM_EXPERT_BIAS_RANGE: f32 = 0.5;

/// Uniform random weights of the experts `experts` of a layer of `shape` (see
/// [`Weights::Random`]), with biases in ±[`RANDOM_EXPERT_BIAS_RANGE`] when the layer has
/// them. Expert `e`'s values depend only on `seed` and `e`.
pub fn random(shape: &LayerShape, experts: Range<u32>, seed: u64) -> HostWeights {
    let (hidden, ffn) = (shape.hidden as usize, shape.ffn as usize);
    let w1_rows = shape.w1_rows() as usize;
    let w1_len = w1_rows * hidden;
    let (w1_scale, w2_scale) = (weight_scale(shape.hidden), weight_scale(shape.ffn));
    let count = experts.len();
    let mut w1 = Vec::with_capacity(count * w1_len);
    let mut w2 = Vec::with_capacity(count * hidden * ffn);
    let mut b1 = Vec::new();
    let mut b2 = Vec::new();
    for e in experts.clone() {
        let mut rng = SplitMix64::new(seed ^ u64::from(e).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        w1.extend((0..w1_len).map(|_| bf16::from_f32(rng.signed() * w1_scale)));
        w2.extend((0..hidden * ffn).map(|_| bf16::from_f32(rng.signed() * w2_scale)));
        if shape.expert_bias {
            b1.extend((0..w1_rows).map(|_| rng.signed() * RANDOM_EXPERT_BIAS_RANGE));
            b2.extend((0..hidden).map(|_| rng.signed() * RANDOM_EXPERT_BIAS_RANGE));
        }
    }
    let biases = shape.expert_bias.then_some(HostBiases { b1, b2 });
    let shared_gate =
        HostWeights::holds_shared_gate(shape, &experts).then(|| random_shared_gate(shape, seed));
    HostWeights {
        experts,
        w1,
        w2,
        biases,
        shared_gate,
    }
}

/// Keeps the shared expert gate's random stream apart from the experts' and the router's.
const SHARED_GATE_SEED_SALT: u64 = 0x5ea7_0000_6a7e_0002;

/// A uniform random shared expert gate of a layer of `shape`, `[H]` in ±`sqrt(3 / H)`:
/// logits of order one for inputs in ±1, so the tokens' weights spread over (0, 1).
pub fn random_shared_gate(shape: &LayerShape, seed: u64) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed ^ SHARED_GATE_SEED_SALT);
    let scale = weight_scale(shape.hidden);
    (0..shape.hidden)
        .map(|_| bf16::from_f32(rng.signed() * scale))
        .collect()
}

/// Copies `weights` to `stream`'s device and waits for the copies, so the buffers may be
/// used from any stream of that device.
pub fn upload(stream: &Arc<CudaStream>, weights: &HostWeights) -> Result<ExpertWeights, GpuError> {
    upload_parts(stream, std::slice::from_ref(weights))
}

/// [`upload`] of several sets of experts, one after another in one buffer each (a rank's
/// routed experts, then the shared slices: [`Weights::rank_parts`]). Each part is copied
/// straight into its place: a full layer's weights are not staged twice on the host.
pub fn upload_parts(
    stream: &Arc<CudaStream>,
    parts: &[HostWeights],
) -> Result<ExpertWeights, GpuError> {
    let held: Vec<String> = parts
        .iter()
        .map(|p| format!("{}..{}", p.experts.start, p.experts.end))
        .collect();
    let what = |tensor: &str| format!("uploading {tensor} of experts {}", held.join(" and "));
    let w1 = upload_joined(stream, parts, |p| &p.w1, &what("W1"))?;
    let w2 = upload_joined(stream, parts, |p| &p.w2, &what("W2"))?;
    let biases: Option<Vec<&HostBiases>> = parts.iter().map(|p| p.biases.as_ref()).collect();
    let biases = match biases {
        Some(biases) if !biases.is_empty() => Some(ExpertBiases {
            b1: upload_joined(stream, &biases, |b| &b.b1, &what("b1"))?,
            b2: upload_joined(stream, &biases, |b| &b.b2, &what("b2"))?,
        }),
        _ => None,
    };
    let shared_gate = parts
        .iter()
        .find_map(|p| p.shared_gate.as_deref())
        .map(|gate| {
            stream
                .clone_htod(gate)
                .context(what("the shared expert gate"))
        })
        .transpose()?;
    stream
        .synchronize()
        .context("waiting for the weights' upload")?;
    Ok(ExpertWeights {
        w1,
        w2,
        biases,
        shared_gate,
    })
}

/// The experts `held` (ranges of expert indices, in order) of `weights` on `from`'s
/// device, with their biases and the shared expert gate (which every rank holds whole),
/// copied onto `to`'s device (staged through the host, which
/// works between any two devices: set-up, not a call's work). A rank's experts of a layer
/// built whole: its routed experts, then the shared slices.
pub fn copy_experts(
    from: &Arc<CudaStream>,
    to: &Arc<CudaStream>,
    weights: &ExpertWeights,
    shape: &LayerShape,
    held: &[Range<usize>],
) -> Result<ExpertWeights, GpuError> {
    let (hidden, w1_rows) = (shape.hidden as usize, shape.w1_rows() as usize);
    let copied = ExpertWeights {
        w1: copy_rows(from, to, &weights.w1, w1_rows * hidden, held, "W1")?,
        w2: copy_rows(
            from,
            to,
            &weights.w2,
            hidden * shape.ffn as usize,
            held,
            "W2",
        )?,
        biases: match &weights.biases {
            Some(biases) => Some(ExpertBiases {
                b1: copy_rows(from, to, &biases.b1, w1_rows, held, "b1")?,
                b2: copy_rows(from, to, &biases.b2, hidden, held, "b2")?,
            }),
            None => None,
        },
        shared_gate: match &weights.shared_gate {
            Some(gate) => Some(
                from.clone_dtoh(gate)
                    .and_then(|values| to.clone_htod(&values))
                    .context("copying the shared expert gate to a rank")?,
            ),
            None => None,
        },
    };
    to.synchronize().context("placing a rank's weights")?;
    Ok(copied)
}

/// `per_expert` values of each expert `held` of `source`, one after another on `to`.
fn copy_rows<T: DeviceRepr + ValidAsZeroBits>(
    from: &Arc<CudaStream>,
    to: &Arc<CudaStream>,
    source: &CudaSlice<T>,
    per_expert: usize,
    held: &[Range<usize>],
    tensor: &str,
) -> Result<CudaSlice<T>, GpuError> {
    let mut values = Vec::new();
    for range in held {
        values.extend(
            from.clone_dtoh(&source.slice(range.start * per_expert..range.end * per_expert))
                .context(format!("downloading a rank's {tensor}"))?,
        );
    }
    to.clone_htod(&values)
        .context(format!("uploading a rank's {tensor}"))
}

/// One device buffer holding `tensor` of every part, in order, each copied into its place.
fn upload_joined<P, T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    parts: &[P],
    tensor: impl Fn(&P) -> &[T],
    what: &str,
) -> Result<CudaSlice<T>, GpuError> {
    let len: usize = parts.iter().map(|p| tensor(p).len()).sum();
    let mut joined = stream
        .alloc_zeros::<T>(len.max(1))
        .context(what.to_string())?;
    let mut offset = 0;
    for part in parts {
        let values = tensor(part);
        if values.is_empty() {
            continue;
        }
        stream
            .memcpy_htod(values, &mut joined.slice_mut(offset..offset + values.len()))
            .context(what.to_string())?;
        offset += values.len();
    }
    Ok(joined)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::router::{gate_logits, route};
    use crate::workload::{Routing, Workload};

    /// The random bias of each kind changes a fair share of the tokens' choices and keeps
    /// the loads about as balanced as the unbiased gate's (at ±0.1 DeepSeek-V3's busiest
    /// expert got 3.6 times the mean load).
    #[test]
    fn a_random_bias_changes_choices_without_unbalancing_the_experts() {
        for (name, source) in [
            (
                "deepseek_v3.moe",
                include_str!("../../dsl-examples/deepseek_v3.moe"),
            ),
            (
                "gpt_oss_120b.moe",
                include_str!("../../dsl-examples/gpt_oss_120b.moe"),
            ),
        ] {
            let module = moeforge_compiler::compile_source(name, source).expect("compiles");
            let layer = &module.layers[0];
            let rule = layer.router.as_ref().expect("a router");
            let shape =
                moeforge_compiler::plan::plan(layer, &moeforge_compiler::plan::Target::h200())
                    .expect("plans")
                    .shape;
            let (experts, top_k) = (shape.experts as usize, shape.top_k as usize);
            let gate = random_gate(&shape, rule.bias, 7);
            let tokens = 2048;
            let x = Workload::random(&shape, tokens, Routing::Uniform, 7).x;
            let logits = gate_logits(&x, &gate.weight, shape.hidden as usize, experts);
            let biased = route(rule, experts, top_k, &logits, gate.bias.as_deref());
            let unbiased = route(rule, experts, top_k, &logits, Some(&vec![0.0; experts]));
            let busiest = |ids: &[i32]| {
                let mut load = vec![0u32; experts];
                for &id in ids {
                    load[id as usize] += 1;
                }
                load.into_iter().max().unwrap_or(0)
            };
            let chosen = |ids: &[i32], t: usize| {
                let mut set = ids[t * top_k..(t + 1) * top_k].to_vec();
                set.sort_unstable();
                set
            };
            let changed = (0..tokens as usize)
                .filter(|&t| chosen(&biased.topk_ids, t) != chosen(&unbiased.topk_ids, t))
                .count() as f64
                / f64::from(tokens);
            let (with_bias, without) = (busiest(&biased.topk_ids), busiest(&unbiased.topk_ids));
            assert!(
                (0.1..0.5).contains(&changed),
                "{name}: {changed} of the tokens re-chosen"
            );
            assert!(
                f64::from(with_bias) <= 1.2 * f64::from(without),
                "{name}: the busiest expert gets {with_bias} rows with the bias, {without} without"
            );
        }
    }
}
