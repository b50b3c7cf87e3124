//! The CPU reference of the layer contract, and how close a kernel's output must come to it.
//!
//! `y[t] = Σ_k topk_weights[t,k] · W2_e · bf16(act(W1_e · x[t]))` with `e = topk_ids[t,k]`
//! (with expert biases, `W2_e · bf16(act(W1_e · x[t] + b1_e)) + b2_e`, f32 biases), plus
//! `g[t] · Σ_s W2_s · bf16(act(W1_s · x[t]))` over the shared slices `s = E..E + S`, where
//! `g[t]` is 1, or `sigmoid(x[t] · w_gate)` for a gated shared expert ([`HostExpert`]'s
//! `shared_gate`, the f32 sum of bf16 products):
//! bf16 inputs, products accumulated in f32, the intermediate rounded to bf16 (the kernels
//! store it so), the output left in f32. This defines the answer the kernels are checked
//! against. The kernels round twice more, each (token, k) combine slot and then the output
//! to bf16; [`Tolerance`] bounds what that may change, element by element.
//!
//! [`layer_output`] groups the (token, k) pairs by expert and splits them into items of a
//! few dozen rows that all cores take in turn, so that thousands of tokens of a large layer
//! take seconds, not minutes.
//!
//! [`router`] is the reference of the router, which chooses `topk_ids` and
//! `topk_weights` from `x` when the spec has one.

pub mod router;

use std::sync::atomic::{AtomicUsize, Ordering};

use moeforge_compiler::ir::{Activation, CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT};
use moeforge_compiler::plan::LayerShape;

use crate::bf16;
use crate::workload::Workload;

/// One expert's weights on the host, checkpoint layout: `w1` [w1_rows, H], `w2` [H, F];
/// and its biases, when the layer has them (`expert_bias = true`).
pub struct HostExpert<'a> {
    pub w1: &'a [u16],
    pub w2: &'a [u16],
    pub biases: Option<HostExpertBias<'a>>,
    /// A shared slice of a gated shared expert: the gate's weights `[H]`, which weigh the
    /// slice's rows of token t by `sigmoid(x[t] · w_gate)`; `None` for a routed expert and
    /// an ungated slice (weight 1).
    pub shared_gate: Option<&'a [u16]>,
}

/// One expert's biases: `b1` `[w1_rows]` added to GEMM1's output (gate, then up) before the
/// activation, `b2` `[H]` to GEMM2's before the routing weight.
#[derive(Clone, Copy)]
pub struct HostExpertBias<'a> {
    pub b1: &'a [f32],
    pub b2: &'a [f32],
}

/// The reference output of some tokens of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    /// The workload's tokens, one output row each, in row order.
    pub tokens: Vec<usize>,
    pub hidden: usize,
    /// [tokens, H]: the layer output.
    pub y: Vec<f32>,
    /// [tokens, H]: `Σ_k |topk_weights[t,k] · (W2_e · …)|`, the size of the terms each
    /// output element sums (at least `|y|`; more where they cancel). The kernels' bf16
    /// roundings of those terms and of their sum scale with it.
    pub magnitude: Vec<f32>,
}

/// A gated shared expert's weight of the token whose row is `x`: `sigmoid(x · gate)`, the
/// bf16 products summed in f32.
pub fn shared_gate_weight(x: &[u16], gate: &[u16]) -> f32 {
    let logit: f32 = x
        .iter()
        .zip(gate)
        .map(|(&a, &b)| bf16::to_f32(a) * bf16::to_f32(b))
        .sum();
    1.0 / (1.0 + (-logit).exp())
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// GPT-OSS's activation as transformers' `GptOssExperts` writes it: `gate.clamp(max=limit)`,
/// `up.clamp(-limit, limit)`, `glu = gate * sigmoid(gate * alpha)`, `(up + 1) * glu`.
fn clamped_swiglu(gate: f32, up: f32) -> f32 {
    let gate = gate.min(CLAMPED_SWIGLU_LIMIT);
    let up = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT);
    let glu = gate / (1.0 + (-CLAMPED_SWIGLU_ALPHA * gate).exp());
    glu * (up + 1.0)
}

fn gelu_tanh(v: f32) -> f32 {
    0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044_715 * v * v * v)).tanh())
}

/// GEMM1's epilogue: `gate` is the (first) W1 row's dot product, `up` the up row's when
/// the activation is gated (ignored otherwise).
fn activate(activation: Activation, gate: f32, up: f32) -> f32 {
    match activation {
        Activation::Swiglu => silu(gate) * up,
        Activation::ClampedSwiglu => clamped_swiglu(gate, up),
        Activation::Geglu => gelu_tanh(gate) * up,
        Activation::Gelu => gelu_tanh(gate),
        Activation::Relu => gate.max(0.0),
        Activation::Silu => silu(gate),
    }
}

/// The intermediate as the kernels store it.
fn round_bf16(v: f32) -> f32 {
    bf16::to_f32(bf16::from_f32(v))
}

// The products below are computed in blocks of `W_BLOCK` weight vectors against `X_BLOCK`
// rows: each `L`-lane piece of a vector or row is loaded once for all the products it takes
// part in (7 loads per 12 multiply-adds, where one vector against one row takes 2 per
// one), with `L` independent accumulators per product, which the compiler keeps in vector
// registers: `L` = 4 (one SSE2 register) in the portable build, 8 (one AVX2 register,
// fused multiply-adds, `dot_block_avx2`) where the CPU has AVX2 and FMA. The operands are copied
// into buffers padded with zeros to whole blocks and whole pieces; the padding adds exact
// zeros. The sum order differs from a sequential one by f32 rounding only. All of it is
// inlined into `expert_rows_in`, so that `expert_rows_avx2` compiles it with AVX2 and FMA.

/// Weight vectors per block.
const W_BLOCK: usize = 4;
/// Rows per block.
const X_BLOCK: usize = 3;

/// Rows of `len` values as f32, each padded with zeros to `stride` values (a multiple of
/// `L`), and zero rows after them up to a multiple of `block` rows.
struct PaddedRows {
    values: Vec<f32>,
    stride: usize,
}

impl PaddedRows {
    #[inline(always)]
    fn new<const L: usize>(
        rows: usize,
        len: usize,
        block: usize,
        value: impl Fn(usize, usize) -> f32,
    ) -> Self {
        let stride = len.next_multiple_of(L);
        let mut padded = PaddedRows {
            values: vec![0f32; rows.next_multiple_of(block) * stride],
            stride,
        };
        padded.fill(rows, len, value);
        padded
    }

    /// Rows `0..rows` from `value(row, i)` and the rows after them zero (the padding of each
    /// row past `len` stays zero).
    #[inline(always)]
    fn fill(&mut self, rows: usize, len: usize, value: impl Fn(usize, usize) -> f32) {
        for (r, row) in self.values.chunks_exact_mut(self.stride).enumerate() {
            if r < rows {
                for (i, v) in row[..len].iter_mut().enumerate() {
                    *v = value(r, i);
                }
            } else {
                row[..len].fill(0.0);
            }
        }
    }

    /// Rows `first..first + N`.
    #[inline(always)]
    fn block<const L: usize, const N: usize>(&self, first: usize) -> [&[[f32; L]]; N] {
        std::array::from_fn(|j| {
            let row = &self.values[(first + j) * self.stride..(first + j + 1) * self.stride];
            row.as_chunks::<L>().0
        })
    }
}

/// `[w[i] · x[r]]` for one block: `W_BLOCK` vectors and `X_BLOCK` rows of whole pieces.
#[inline(always)]
fn dot_block<const L: usize, const AVX2_FMA: bool>(
    w: [&[[f32; L]]; W_BLOCK],
    x: [&[[f32; L]]; X_BLOCK],
) -> [[f32; X_BLOCK]; W_BLOCK] {
    #[cfg(target_arch = "x86_64")]
    if AVX2_FMA {
        // SAFETY: only `expert_rows_avx2` asks for AVX2 and FMA, and it runs where the CPU
        // has both.
        return unsafe { dot_block_avx2(w.map(|v| v.as_flattened()), x.map(|v| v.as_flattened())) };
    }
    let mut acc = [[[0f32; L]; X_BLOCK]; W_BLOCK];
    let pieces = w[0]
        .iter()
        .zip(w[1])
        .zip(w[2])
        .zip(w[3])
        .zip(x[0])
        .zip(x[1])
        .zip(x[2]);
    for ((((((w0, w1), w2), w3), x0), x1), x2) in pieces {
        for (acc, w) in acc.iter_mut().zip([w0, w1, w2, w3]) {
            for (acc, x) in acc.iter_mut().zip([x0, x1, x2]) {
                for l in 0..L {
                    acc[l] += w[l] * x[l];
                }
            }
        }
    }
    acc.map(|products| products.map(|lanes| lanes.iter().sum()))
}

/// [`dot_block`] in AVX2 registers with fused multiply-adds, 8 lanes per piece. Written with
/// intrinsics: compiled for AVX2, the portable loop's blocks were not vectorised (with or
/// without `f32::mul_add`) and ran about 10 times slower. The portable loop serves CPUs
/// without AVX2 and FMA; in the baseline (SSE2) build it is vectorised: 18.8 G
/// multiply-adds/s on the build machine, against 9.6 for the one-vector products before.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_block_avx2(w: [&[f32]; W_BLOCK], x: [&[f32]; X_BLOCK]) -> [[f32; X_BLOCK]; W_BLOCK] {
    use std::arch::x86_64::{
        __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let len = w[0].len();
    assert!(
        len.is_multiple_of(8)
            && w.iter().all(|v| v.len() == len)
            && x.iter().all(|r| r.len() == len)
    );
    let mut acc: [[__m256; X_BLOCK]; W_BLOCK] = [[_mm256_setzero_ps(); X_BLOCK]; W_BLOCK];
    for c in (0..len).step_by(8) {
        // SAFETY: every vector and row holds `len` values, and c + 8 <= len.
        let pieces = x.map(|r| unsafe { _mm256_loadu_ps(r.as_ptr().add(c)) });
        for (acc, v) in acc.iter_mut().zip(w) {
            // SAFETY: as above.
            let weights = unsafe { _mm256_loadu_ps(v.as_ptr().add(c)) };
            for (acc, &piece) in acc.iter_mut().zip(&pieces) {
                *acc = _mm256_fmadd_ps(weights, piece, *acc);
            }
        }
    }
    acc.map(|products| {
        products.map(|lanes| {
            let mut values = [0f32; 8];
            // SAFETY: `values` holds the 8 lanes stored.
            unsafe { _mm256_storeu_ps(values.as_mut_ptr(), lanes) };
            values.iter().sum()
        })
    })
}

/// `out[r · vectors + i] = w_i · x_r` for the bf16 vectors `weights` ([vectors, len], widened
/// to f32 a block at a time) and the rows of `x` ([rows, len], f32); `out` is [rows, vectors].
#[inline(always)]
fn dot_rows<const L: usize, const AVX2_FMA: bool>(
    weights: &[u16],
    x: &[f32],
    len: usize,
    out: &mut [f32],
) {
    let vectors = weights.len() / len;
    let rows = x.len() / len;
    let x = PaddedRows::new::<L>(rows, len, X_BLOCK, |r, i| x[r * len + i]);
    // One block of weight vectors at a time, widened into a buffer that stays in cache
    // while every row passes it (a layer's whole W1 in f32 would be 117 MB per thread for
    // DeepSeek-V3).
    let mut w = PaddedRows::new::<L>(W_BLOCK, len, W_BLOCK, |_, _| 0.0);
    for v in (0..vectors).step_by(W_BLOCK) {
        w.fill(W_BLOCK.min(vectors - v), len, |j, i| {
            bf16::to_f32(weights[(v + j) * len + i])
        });
        for r in (0..rows).step_by(X_BLOCK) {
            let products = dot_block::<L, AVX2_FMA>(w.block(0), x.block(r));
            for (i, column) in products.iter().enumerate().filter(|(i, _)| v + i < vectors) {
                for (j, &p) in column.iter().enumerate().filter(|(j, _)| r + j < rows) {
                    out[(r + j) * vectors + v + i] = p;
                }
            }
        }
    }
}

/// (token, k) pairs per work item. An item widens its expert's weights to f32 once, so
/// more rows make that a smaller share of its work; fewer keep an expert that takes every
/// token (skewed routing) spread over all cores.
const ROWS_PER_ITEM: usize = 32;

/// The output rows of `tokens` (indices into `workload`), computed on every core.
///
/// `experts(e)` gives expert `e`'s weights (`E..E + S`: the shared slices); it is asked
/// only for experts that some pair of `tokens` chooses, and for every shared slice. Ids
/// outside `0..E` are skipped, as the kernels skip them (the route kernel reports them).
pub fn layer_output<'a>(
    shape: &LayerShape,
    workload: &Workload,
    tokens: Vec<usize>,
    experts: impl Fn(usize) -> HostExpert<'a> + Sync,
) -> Reference {
    let hidden = shape.hidden as usize;
    let (k, slots) = (shape.top_k as usize, shape.slots_per_token() as usize);
    let routed = shape.experts as usize;
    // Slots as `row · slots + j` (row indexes `tokens`; j < K routed, then the shared
    // slices), grouped by expert.
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); shape.gemm_experts() as usize];
    for (row, &t) in tokens.iter().enumerate() {
        for (j, &id) in workload.topk_ids[t * k..(t + 1) * k].iter().enumerate() {
            if let Some(pairs) = usize::try_from(id)
                .ok()
                .filter(|&e| e < routed)
                .and_then(|e| by_expert.get_mut(e))
            {
                pairs.push(row * slots + j);
            }
        }
        for (s, pairs) in by_expert[routed..].iter_mut().enumerate() {
            pairs.push(row * slots + k + s);
        }
    }
    let items: Vec<(usize, &[usize])> = by_expert
        .iter()
        .enumerate()
        .flat_map(|(e, pairs)| pairs.chunks(ROWS_PER_ITEM).map(move |c| (e, c)))
        .collect();

    let results = on_every_core(items.len(), |i| {
        let (e, pairs) = items[i];
        expert_rows(shape, &experts(e), workload, &tokens, pairs)
    });

    let mut y = vec![0f32; tokens.len() * hidden];
    let mut magnitude = vec![0f32; tokens.len() * hidden];
    for (&(_, pairs), rows) in items.iter().zip(&results) {
        for (&pair, row) in pairs.iter().zip(rows.chunks_exact(hidden)) {
            let out = (pair / slots) * hidden..(pair / slots + 1) * hidden;
            let out_y = y[out.clone()].iter_mut();
            for ((sum, size), &v) in out_y.zip(&mut magnitude[out]).zip(row) {
                *sum += v;
                *size += v.abs();
            }
        }
    }
    Reference {
        tokens,
        hidden,
        y,
        magnitude,
    }
}

/// `work(i)` for every `i` in `0..items`, in that order, computed on every core: each
/// thread takes the next unclaimed item until none is left, so that items of unequal
/// cost (an expert that takes every token) keep all cores busy. Each result is what
/// `work` computes on one thread, so it is the same on any number of cores.
pub(crate) fn on_every_core<T: Send>(items: usize, work: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items)
        .max(1);
    let mut results: Vec<(usize, T)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= items {
                            break done;
                        }
                        done.push((i, work(i)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, result)| result).collect()
}

/// `topk_weight · (W2_e · bf16(act(W1_e · x + b1_e)) + b2_e)` for some slots of one
/// expert, [slots, H] (without the biases when the expert has none; for a shared slice the
/// weight is 1, or its token's [`shared_gate_weight`] where the shared expert is gated).
fn expert_rows(
    shape: &LayerShape,
    expert: &HostExpert<'_>,
    workload: &Workload,
    tokens: &[usize],
    pairs: &[usize],
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: this CPU has AVX2 and FMA, the features `expert_rows_avx2` is compiled for.
        return unsafe { expert_rows_avx2(shape, expert, workload, tokens, pairs) };
    }
    expert_rows_in::<4, false>(shape, expert, workload, tokens, pairs)
}

/// [`expert_rows`] compiled for AVX2 and FMA: on the 2-core AMD EPYC build machine, 37 G
/// multiply-adds per second for Qwen3-30B-A3B's experts scaled to H = 1024, F = 384, and 30
/// for DeepSeek-V3's (H = 1024, F = 512), against 14 and 12 for the AVX2 build of the
/// one-vector products before these blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn expert_rows_avx2(
    shape: &LayerShape,
    expert: &HostExpert<'_>,
    workload: &Workload,
    tokens: &[usize],
    pairs: &[usize],
) -> Vec<f32> {
    expert_rows_in::<8, true>(shape, expert, workload, tokens, pairs)
}

#[inline(always)]
fn expert_rows_in<const L: usize, const AVX2_FMA: bool>(
    shape: &LayerShape,
    expert: &HostExpert<'_>,
    workload: &Workload,
    tokens: &[usize],
    pairs: &[usize],
) -> Vec<f32> {
    let hidden = shape.hidden as usize;
    let ffn = shape.ffn as usize;
    let (k, slots) = (shape.top_k as usize, shape.slots_per_token() as usize);
    let n = pairs.len();
    let mut x = Vec::with_capacity(n * hidden);
    let mut route_weights = Vec::with_capacity(n);
    for &pair in pairs {
        let (t, j) = (tokens[pair / slots], pair % slots);
        x.extend(
            workload.x[t * hidden..(t + 1) * hidden]
                .iter()
                .map(|&v| bf16::to_f32(v)),
        );
        let row = &workload.x[t * hidden..(t + 1) * hidden];
        route_weights.push(if j < k {
            workload.topk_weights[t * k + j]
        } else {
            expert
                .shared_gate
                .map_or(1.0, |gate| shared_gate_weight(row, gate))
        });
    }

    let gated = shape.activation.is_gated();
    // [n, W1 rows]: every row's products with the gate rows, then the up rows.
    let w1_rows = expert.w1.len() / hidden;
    let mut products = vec![0f32; n * w1_rows];
    dot_rows::<L, AVX2_FMA>(expert.w1, &x, hidden, &mut products);
    let mut intermediate = vec![0f32; n * ffn];
    for (row, products) in intermediate
        .chunks_exact_mut(ffn)
        .zip(products.chunks_exact(w1_rows))
    {
        for (f, value) in row.iter_mut().enumerate() {
            let (gate_bias, up_bias) = expert.biases.map_or((0.0, 0.0), |b| {
                (b.b1[f], if gated { b.b1[ffn + f] } else { 0.0 })
            });
            let up = if gated { products[ffn + f] } else { 0.0 };
            *value = round_bf16(activate(
                shape.activation,
                products[f] + gate_bias,
                up + up_bias,
            ));
        }
    }

    let mut out = vec![0f32; n * hidden];
    dot_rows::<L, AVX2_FMA>(expert.w2, &intermediate, ffn, &mut out);
    for (row, &weight) in out.chunks_exact_mut(hidden).zip(&route_weights) {
        for (o, value) in row.iter_mut().enumerate() {
            let bias = expert.biases.map_or(0.0, |b| b.b2[o]);
            *value = weight * (*value + bias);
        }
    }
    out
}

/// How far a kernel's bf16 output element may lie from the reference:
/// `|got − want| ≤ rtol · magnitude + atol` (see [`Reference::magnitude`]).
///
/// Why these constants. A correct kernel differs from the reference by
/// 1. rounding each combine slot `s_k` to bf16: at most half an ulp, `2⁻⁸·|s_k|`;
/// 2. rounding the output sum to bf16: `2⁻⁸·|y| ≤ 2⁻⁸·Σ|s_k|`;
/// 3. its f32 summation order and `__expf`: relative errors near 1e-6, visible only where
///    they flip the bf16 rounding of an intermediate element by one ulp, which moves one
///    of the F terms of a slot by `|W2[o,f]|·2⁻⁷·|i_f|`.
///
/// 1 and 2 together are at most `2⁻⁷ · magnitude`, so `rtol = 2⁻⁶` is twice the rounding
/// bound. `atol = 2⁻⁶ · RMS(y)` absorbs 3 and elements whose terms all nearly vanish. The
/// bound scales with the magnitude rather than `|want|` because a sum whose slots cancel
/// keeps their rounding error. In a CPU emulation of the kernels' roundings with another
/// summation order (H = 1024, F = 512, 400 tokens, K = 2 and 8) the worst element used
/// 0.38 of the bound with `atol = 2⁻⁷ · RMS(y)`, and 0.78 with every element pushed one
/// more ulp away. 3 is rare but not always small: a flipped intermediate of a few units
/// moves its term by up to `w·|W2[o,f]|·2⁻⁵`, about 1 % of the output's RMS in the tiny
/// GEGLU layer (H = 128, F = 256, K = 2); there, with `2⁻⁷ · RMS(y)`, one element of
/// 128000 (1000 tokens, `MOEFORGE_SEED=1796134739848143054`, an H200 on 2026-12-01)
/// reached 1.01 of its bound, every time, where earlier runs stayed under 0.46. Hence
/// `2⁻⁶`. The median element's bound is then about 3 % (K = 1) to 5 % (K = 8) of the
/// output's RMS, 6 % at the 90th percentile: one element wrong by more fails the check,
/// and a tile computed from the wrong rows or expert, or missing a 64-deep slice of the
/// reduction, is wrong by far more in most of its elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rtol: f32,
    pub atol: f32,
}

impl Tolerance {
    pub const RTOL: f32 = 1.0 / 64.0;
    /// `atol` as a fraction of the reference output's RMS.
    pub const ATOL_PER_RMS: f32 = 1.0 / 64.0;

    /// The tolerance for comparing with `reference` (`atol` from its RMS).
    pub fn for_reference(reference: &Reference) -> Self {
        let squares: f64 = reference.y.iter().map(|&v| f64::from(v).powi(2)).sum();
        let rms = (squares / reference.y.len().max(1) as f64).sqrt() as f32;
        Tolerance {
            rtol: Self::RTOL,
            atol: Self::ATOL_PER_RMS * rms,
        }
    }

    pub fn bound(&self, magnitude: f32) -> f32 {
        self.rtol * magnitude + self.atol
    }
}

/// One output element next to its reference value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ElementError {
    pub token: usize,
    pub column: usize,
    pub got: f32,
    pub want: f32,
    /// The largest `|got − want|` the tolerance allows for this element.
    pub bound: f32,
}

impl ElementError {
    pub fn error(&self) -> f32 {
        (self.got - self.want).abs()
    }

    /// The error as a fraction of its bound: above 1 is out of bound; infinite for NaN.
    pub fn ratio(&self) -> f32 {
        let error = self.error();
        if error.is_nan() {
            f32::INFINITY
        } else if error == 0.0 {
            0.0
        } else {
            error / self.bound
        }
    }
}

/// A kernel output compared with the reference, element by element.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub tolerance: Tolerance,
    pub elements: u64,
    /// Elements whose error exceeds their bound (NaN included).
    pub out_of_bound: u64,
    /// The element with the largest error relative to its bound; `None` without elements.
    pub worst: Option<ElementError>,
}

/// Compares the rows of `reference.tokens` in `y` (bf16 [T, H], the whole kernel output)
/// with the reference.
pub fn compare(y: &[u16], reference: &Reference) -> Comparison {
    let tolerance = Tolerance::for_reference(reference);
    let hidden = reference.hidden;
    let mut out_of_bound = 0;
    let mut worst: Option<ElementError> = None;
    for (row, &token) in reference.tokens.iter().enumerate() {
        let got_row = &y[token * hidden..(token + 1) * hidden];
        let want_row = &reference.y[row * hidden..(row + 1) * hidden];
        let magnitude_row = &reference.magnitude[row * hidden..(row + 1) * hidden];
        for (column, ((&got, &want), &magnitude)) in
            got_row.iter().zip(want_row).zip(magnitude_row).enumerate()
        {
            let element = ElementError {
                token,
                column,
                got: bf16::to_f32(got),
                want,
                bound: tolerance.bound(magnitude),
            };
            // The ratio is infinite for NaN, so NaN counts as out of bound.
            if element.ratio() > 1.0 {
                out_of_bound += 1;
            }
            if worst.is_none_or(|w| element.ratio() > w.ratio()) {
                worst = Some(element);
            }
        }
    }
    Comparison {
        tolerance,
        elements: (reference.tokens.len() * hidden) as u64,
        out_of_bound,
        worst,
    }
}

/// ‖a − b‖ / ‖b‖ over all elements (NaN in `a` gives NaN).
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += f64::from(x - y).powi(2);
        norm += f64::from(y).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Routing, SplitMix64, weight_scale};

    fn shape(
        hidden: u32,
        ffn: u32,
        experts: u32,
        top_k: u32,
        activation: Activation,
    ) -> LayerShape {
        LayerShape {
            hidden,
            ffn,
            experts,
            top_k,
            activation,
            expert_bias: false,
            max_tokens: 4096,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    /// Random bf16 weights of every expert, scaled as the device fill scales them.
    fn random_experts(shape: &LayerShape, seed: u64) -> Vec<(Vec<u16>, Vec<u16>)> {
        let mut rng = SplitMix64::new(seed);
        let mut fill = |len: u32, scale: f32| -> Vec<u16> {
            (0..len)
                .map(|_| bf16::from_f32(scale * rng.signed()))
                .collect()
        };
        (0..shape.experts)
            .map(|_| {
                let w1 = fill(shape.w1_rows() * shape.hidden, weight_scale(shape.hidden));
                let w2 = fill(shape.hidden * shape.ffn, weight_scale(shape.ffn));
                (w1, w2)
            })
            .collect()
    }

    fn host<'a>(experts: &'a [(Vec<u16>, Vec<u16>)]) -> impl Fn(usize) -> HostExpert<'a> + Sync {
        |e| HostExpert {
            w1: &experts[e].0,
            w2: &experts[e].1,
            biases: None,
            shared_gate: None,
        }
    }

    /// The contract spelled out one pair at a time with sequential sums: the oracle of the
    /// grouped, vectorised path. Returns each token's K weighted expert outputs (zero for
    /// an id outside 0..E).
    fn token_slots(
        shape: &LayerShape,
        workload: &Workload,
        token: usize,
        experts: &[(Vec<u16>, Vec<u16>)],
    ) -> Vec<Vec<f32>> {
        let (hidden, ffn, k) = (
            shape.hidden as usize,
            shape.ffn as usize,
            shape.top_k as usize,
        );
        let x: Vec<f32> = workload.x[token * hidden..(token + 1) * hidden]
            .iter()
            .map(|&v| bf16::to_f32(v))
            .collect();
        let dot = |row: &[u16], v: &[f32]| -> f32 {
            row.iter().zip(v).map(|(&w, &v)| bf16::to_f32(w) * v).sum()
        };
        (0..k)
            .map(|j| {
                let id = workload.topk_ids[token * k + j];
                let Some((w1, w2)) = usize::try_from(id).ok().and_then(|e| experts.get(e)) else {
                    return vec![0.0; hidden];
                };
                let intermediate: Vec<f32> = (0..ffn)
                    .map(|f| {
                        let gate = dot(&w1[f * hidden..(f + 1) * hidden], &x);
                        let up = if shape.activation.is_gated() {
                            dot(&w1[(ffn + f) * hidden..(ffn + f + 1) * hidden], &x)
                        } else {
                            0.0
                        };
                        round_bf16(activate(shape.activation, gate, up))
                    })
                    .collect();
                let weight = workload.topk_weights[token * k + j];
                (0..hidden)
                    .map(|o| weight * dot(&w2[o * ffn..(o + 1) * ffn], &intermediate))
                    .collect()
            })
            .collect()
    }

    /// What a correct kernel stores: each slot rounded to bf16, summed in k order in f32,
    /// the sum rounded to bf16.
    fn kernel_like_output(
        shape: &LayerShape,
        workload: &Workload,
        experts: &[(Vec<u16>, Vec<u16>)],
    ) -> Vec<u16> {
        (0..workload.tokens as usize)
            .flat_map(|t| {
                let slots = token_slots(shape, workload, t, experts);
                (0..shape.hidden as usize).map(move |o| {
                    let sum: f32 = slots.iter().map(|s| round_bf16(s[o])).sum();
                    bf16::from_f32(sum)
                })
            })
            .collect()
    }

    #[test]
    fn hand_computed_swiglu_token() {
        // x = [1, 2]. Expert 0: gate row [1, 0] -> 1, up row [0, 1] -> 2, act = silu(1)*2,
        // stored as bf16. W2 = [[1], [2]] -> [act, 2 act]. Expert 1 is the same, weighted 0.25.
        let one = bf16::from_f32(1.0);
        let two = bf16::from_f32(2.0);
        let zero = bf16::from_f32(0.0);
        let w1 = [one, zero, zero, one];
        let w2 = [one, two];
        let shape = shape(2, 1, 2, 2, Activation::Swiglu);
        let mut workload = Workload {
            tokens: 1,
            x: vec![one, two],
            topk_ids: vec![0, 1],
            topk_weights: vec![0.75, 0.25],
        };
        let experts = |_| HostExpert {
            w1: &w1,
            w2: &w2,
            biases: None,
            shared_gate: None,
        };
        let act = round_bf16(silu(1.0) * 2.0);
        assert_ne!(act, silu(1.0) * 2.0, "the intermediate is rounded");
        let out = layer_output(&shape, &workload, vec![0], experts);
        assert!(
            (out.y[0] - act).abs() < 1e-6 && (out.y[1] - 2.0 * act).abs() < 1e-6,
            "{out:?}"
        );
        assert_eq!(out.y, out.magnitude, "positive terms: magnitude = y");
        // An out-of-range id contributes nothing.
        workload.topk_ids = vec![0, 7];
        let out = layer_output(&shape, &workload, vec![0], experts);
        assert!((out.y[0] - 0.75 * act).abs() < 1e-6, "{out:?}");
    }

    /// Shared experts as slices: one MLP of FFN 2F, cut into two always-hit experts of FFN
    /// F (gate and up rows, down columns), adds exactly that MLP's output, unweighted, to
    /// the routed output; gated, that output times sigmoid(x · w_gate), worked out here in
    /// sequential sums.
    #[test]
    fn shared_slices_add_the_whole_shared_mlp_unweighted_or_gated() {
        let routed_shape = shape(8, 2, 3, 2, Activation::Swiglu);
        let shared_shape = LayerShape {
            shared_slices: 2,
            shared_gated: false,
            ..routed_shape.clone()
        };
        let (hidden, ffn, joint) = (8, 2, 4);
        let mut rng = SplitMix64::new(11);
        let mut draw =
            |n: usize| -> Vec<u16> { (0..n).map(|_| bf16::from_f32(rng.signed())).collect() };
        let routed = random_experts(&routed_shape, 3);
        let (gate, up, down) = (
            draw(joint * hidden),
            draw(joint * hidden),
            draw(hidden * joint),
        );
        let slices: Vec<(Vec<u16>, Vec<u16>)> = (0..2)
            .map(|s| {
                let rows = s * ffn * hidden..(s + 1) * ffn * hidden;
                let w1 = [&gate[rows.clone()], &up[rows]].concat();
                let w2 = down
                    .chunks_exact(joint)
                    .flat_map(|row| row[s * ffn..(s + 1) * ffn].to_vec())
                    .collect();
                (w1, w2)
            })
            .collect();
        let all: Vec<_> = routed.iter().chain(&slices).cloned().collect();
        let workload = Workload::random(&routed_shape, 5, Routing::Uniform, 9);
        let tokens: Vec<usize> = (0..5).collect();
        let shared_gate = draw(hidden);
        let without = layer_output(&routed_shape, &workload, tokens.clone(), host(&routed));
        let with = layer_output(&shared_shape, &workload, tokens.clone(), host(&all));
        let gated_shape = LayerShape {
            shared_gated: true,
            ..shared_shape.clone()
        };
        let gated = layer_output(&gated_shape, &workload, tokens, |e| HostExpert {
            shared_gate: (e >= 3).then_some(shared_gate.as_slice()),
            ..host(&all)(e)
        });
        let value = |bits: &[u16], i: usize| bf16::to_f32(bits[i]);
        let mut weights = Vec::new();
        for t in 0..5 {
            let x: Vec<f32> = (0..hidden)
                .map(|h| value(&workload.x, t * hidden + h))
                .collect();
            let dot = |w: &[u16], f: usize| {
                (0..hidden)
                    .map(|h| value(w, f * hidden + h) * x[h])
                    .sum::<f32>()
            };
            let act: Vec<f32> = (0..joint)
                .map(|f| round_bf16(silu(dot(&gate, f)) * dot(&up, f)))
                .collect();
            let logit: f32 = (0..hidden).map(|h| value(&shared_gate, h) * x[h]).sum();
            let weight = 1.0 / (1.0 + (-logit).exp());
            weights.push(weight);
            for h in 0..hidden {
                let mlp: f32 = (0..joint)
                    .map(|f| value(&down, h * joint + f) * act[f])
                    .sum();
                for (output, scale) in [(&with, 1.0), (&gated, weight)] {
                    let want = without.y[t * hidden + h] + scale * mlp;
                    let got = output.y[t * hidden + h];
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "token {t} column {h} (shared weight {scale}): {got} vs {want}"
                    );
                }
            }
        }
        // The gate weighs the tokens apart, none by 1 (else the check could not tell).
        assert!(
            weights.iter().all(|w| (0.02..0.98).contains(w)),
            "{weights:?}"
        );
        assert!(
            weights.iter().any(|&w| (w - weights[0]).abs() > 1e-3),
            "{weights:?}"
        );
    }

    #[test]
    fn hand_computed_clamped_swiglu_tokens_with_biases() {
        // H = 2, F = 1, one expert: gate row [4, 3], up row [-2, -3], b1 = [-1 (gate), -1
        // (up)]; W2 = [[1], [2]], b2 = [0.5, -0.25]; routing weight 0.5.
        let bits = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<u16>>();
        let w1 = bits(&[4.0, 3.0, -2.0, -3.0]);
        let w2 = bits(&[1.0, 2.0]);
        let (b1, b2) = ([-1.0, -1.0], [0.5, -0.25]);
        let mut shape = shape(2, 1, 1, 1, Activation::ClampedSwiglu);
        shape.expert_bias = true;
        let workload = Workload {
            tokens: 3,
            x: bits(&[1.0, 2.0, 0.5, 0.0, -4.0, 0.0]),
            topk_ids: vec![0, 0, 0],
            topk_weights: vec![0.5, 0.5, 0.5],
        };
        let experts = |_| HostExpert {
            w1: &w1,
            w2: &w2,
            biases: Some(HostExpertBias { b1: &b1, b2: &b2 }),
            shared_gate: None,
        };
        let out = layer_output(&shape, &workload, vec![0, 1, 2], experts);
        let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
        // Token 0: gate 10 - 1 = 9 clamps to 7; up -8 - 1 = -9 clamps to -7.
        // Token 1: gate 2 - 1 = 1 and up -1 - 1 = -2, inside the clamps.
        // Token 2: gate -16 - 1 = -17 stays (clamped above only); up 8 - 1 = 7, at the clamp.
        let acts = [
            7.0 * sigmoid(1.702 * 7.0) * (-7.0 + 1.0),
            sigmoid(1.702) * (-2.0 + 1.0),
            -17.0 * sigmoid(1.702 * -17.0) * (7.0 + 1.0),
        ];
        for (t, act) in acts.into_iter().enumerate() {
            let act = round_bf16(act);
            let want = [0.5 * (act + 0.5), 0.5 * (2.0 * act - 0.25)];
            let got = &out.y[2 * t..2 * t + 2];
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "token {t}: {got:?} vs {want:?}"
                );
            }
        }
        // Without the clamps token 0's activation would be 9 · sigmoid(15.3) · (-8).
        assert!((out.y[0] - 0.5 * (round_bf16(-72.0) + 0.5)).abs() > 10.0);
    }

    /// Whether this CPU runs the AVX2 and FMA products (the test then checks them too).
    fn fused_multiply_adds() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    #[test]
    fn dot_products_match_f64_sums_for_every_length() {
        // Vector and row counts that leave blocks partly full, lengths that leave lane tails.
        let mut rng = SplitMix64::new(11);
        for len in [1, 7, 8, 9, 16, 17, 64, 67] {
            for (vectors, rows) in [(1, 1), (4, 3), (7, 7), (9, 4)] {
                let w: Vec<u16> = (0..vectors * len)
                    .map(|_| bf16::from_f32(rng.signed()))
                    .collect();
                let x: Vec<f32> = (0..rows * len).map(|_| rng.signed()).collect();
                let (mut out4, mut out8) = (vec![0f32; rows * vectors], vec![0f32; rows * vectors]);
                dot_rows::<4, false>(&w, &x, len, &mut out4);
                if fused_multiply_adds() {
                    dot_rows::<8, true>(&w, &x, len, &mut out8);
                } else {
                    out8.copy_from_slice(&out4);
                }
                for r in 0..rows {
                    for v in 0..vectors {
                        let (got4, got8) = (out4[r * vectors + v], out8[r * vectors + v]);
                        let want: f64 = w[v * len..(v + 1) * len]
                            .iter()
                            .zip(&x[r * len..(r + 1) * len])
                            .map(|(&a, &b)| f64::from(bf16::to_f32(a)) * f64::from(b))
                            .sum();
                        for got in [got4, got8] {
                            assert!(
                                (f64::from(got) - want).abs() < 1e-5,
                                "len {len}, {vectors} vectors, {rows} rows: row {r} vector {v}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_path_matches_the_per_pair_oracle() {
        // Odd sizes exercise the vector tails; skewed routing puts every token on expert 0
        // (more than one item); one bad id and a token subset in shuffled order.
        for (activation, routing) in [
            (Activation::Swiglu, Routing::Skewed),
            (Activation::Geglu, Routing::Uniform),
            (Activation::Gelu, Routing::EmptyExperts),
            (Activation::Relu, Routing::Uniform),
            (Activation::Silu, Routing::Skewed),
        ] {
            let shape = shape(44, 20, 7, 3, activation);
            let experts = random_experts(&shape, 5);
            let mut workload = Workload::random(&shape, 80, routing, 9);
            workload.topk_ids[3 * 3 + 1] = -1;
            let tokens: Vec<usize> = (0..80).rev().step_by(3).chain([3]).collect();
            let out = layer_output(&shape, &workload, tokens.clone(), host(&experts));
            assert_eq!(out.tokens, tokens);
            for (row, &t) in tokens.iter().enumerate() {
                let slots = token_slots(&shape, &workload, t, &experts);
                for o in 0..44 {
                    let want: f32 = slots.iter().map(|s| s[o]).sum();
                    let magnitude: f32 = slots.iter().map(|s| s[o].abs()).sum();
                    let got = out.y[row * 44 + o];
                    // Only the summation order differs: f32 noise, plus the rare one-ulp
                    // flip of an intermediate element's bf16 rounding.
                    assert!(
                        (got - want).abs() <= 1e-3 * magnitude + 1e-6,
                        "{activation:?} token {t} column {o}: {got} vs {want}"
                    );
                    assert!(
                        (out.magnitude[row * 44 + o] - magnitude).abs() <= 1e-3 * magnitude + 1e-6
                    );
                }
            }
        }
    }

    /// A random layer, its reference over all tokens, and what a correct kernel outputs.
    fn kernel_and_reference(top_k: u32) -> (Vec<u16>, Reference) {
        let shape = shape(128, 64, 8, top_k, Activation::Swiglu);
        let experts = random_experts(&shape, 21);
        let workload = Workload::random(&shape, 60, Routing::Uniform, 22);
        let reference = layer_output(&shape, &workload, (0..60).collect(), host(&experts));
        (kernel_like_output(&shape, &workload, &experts), reference)
    }

    #[test]
    fn kernel_rounding_passes_and_one_ulp_more_still_passes() {
        for top_k in [1, 2, 4] {
            let (got, reference) = kernel_and_reference(top_k);
            let result = compare(&got, &reference);
            assert_eq!(result.elements, 60 * 128);
            assert_eq!(result.out_of_bound, 0, "K={top_k}: {result:?}");
            // Every element one further ulp away from the reference (the kernel's bf16
            // rounding gone the wrong way everywhere) still passes.
            let nudged: Vec<u16> = got
                .iter()
                .zip(&reference.y)
                .map(|(&g, &want)| {
                    // bf16 bits order magnitudes: +1 moves away from zero. Zeros stay.
                    let away_from_zero = (bf16::to_f32(g) >= want) == (g & 0x8000 == 0);
                    match (g & 0x7fff, away_from_zero) {
                        (0, _) => g,
                        (_, true) => g + 1,
                        (_, false) => g - 1,
                    }
                })
                .collect();
            let result = compare(&nudged, &reference);
            assert_eq!(result.out_of_bound, 0, "K={top_k} nudged: {result:?}");
        }
    }

    #[test]
    fn one_wrong_element_fails_and_is_named() {
        let (got, reference) = kernel_and_reference(2);
        let (token, column) = (17, 33);
        let index = token * 128 + column;
        let want = reference.y[index];
        let bound = Tolerance::for_reference(&reference).bound(reference.magnitude[index]);
        let neighbour = bf16::to_f32(got[index + 1]);
        // The corruptions below are errors at this element (checked, so the test means
        // what it says).
        assert!(want.abs() > 2.0 * bound && (neighbour - want).abs() > 2.0 * bound);
        let wrong_by_twice_the_bound = want + 2.0 * bound * want.signum();
        for (what, value) in [
            ("NaN (unwritten)", bf16::NAN),
            ("zero", bf16::from_f32(0.0)),
            ("the next column's value", got[index + 1]),
            (
                "off by twice its bound",
                bf16::from_f32(wrong_by_twice_the_bound),
            ),
        ] {
            let mut corrupted = got.clone();
            corrupted[index] = value;
            let result = compare(&corrupted, &reference);
            assert_eq!(result.out_of_bound, 1, "{what}: {result:?}");
            let worst = result.worst.expect("elements were compared");
            assert_eq!((worst.token, worst.column), (token, column), "{what}");
            assert!(worst.ratio() > 1.0, "{what}: {worst:?}");
        }
    }

    #[test]
    fn no_tokens_compare_nothing() {
        let reference = Reference {
            tokens: Vec::new(),
            hidden: 4,
            y: Vec::new(),
            magnitude: Vec::new(),
        };
        let result = compare(&[], &reference);
        assert_eq!(
            (result.elements, result.out_of_bound, result.worst),
            (0, 0, None)
        );
    }

    #[test]
    fn relative_error_is_zero_for_equal_and_nan_for_nan() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(relative_error(&[f32::NAN, 2.0], &[1.0, 2.0]).is_nan());
        assert!((relative_error(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
    }
}
