//! The CPU reference of the router: from `x` and the gate's weights to each token's top-k
//! experts and routing weights, by the rule the spec's `router { }` section states
//! ([`ir::Router`]: Mixtral's and Qwen3-MoE's softmax, DeepSeek-V3's sigmoid with a
//! score correction and group-limited top-k, GPT-OSS's top-k then softmax).
//!
//! The arithmetic, which the generated router kernels follow step by step:
//!
//! 1. logits `l = x · W_gateᵀ`, bf16 inputs, products accumulated in f32 ([`gate_logits`]);
//!    a [`RouterBias::Logits`] bias is added to them;
//! 2. scores: `softmax(l)` over all experts (max subtracted first), `sigmoid(l)`, or `l`
//!    itself for [`Scoring::TopkSoftmax`];
//! 3. selection values: the scores plus a [`RouterBias::ScoreCorrection`] bias; NaN counts
//!    as −∞, so a NaN is never chosen over a number;
//! 4. with a group limit, a group's value is the sum of its two best selection values (its
//!    one value when a group holds one expert); the `kept` best groups (ties: the lower
//!    group first) hold the only eligible experts (an expert outside them is never chosen:
//!    the checker made sure they hold at least k);
//! 5. the k eligible experts with the highest selection values, in that order, ties broken
//!    by the lower index first (what `torch.topk` returns on the reference models);
//! 6. weights: the chosen experts' scores without the correction, or for `TopkSoftmax` a
//!    softmax over their logits; when `normalize`, divided by `Σ + 1e-20` (DeepSeek-V3's
//!    guard against 0/0; a no-op for any sum above 1e-12); times `scale`.

use moeforge_compiler::ir::{self, RouterBias, Scoring};
/// Added to the sum a normalised weight is divided by (DeepSeek-V3's reference does); the
/// plan's constant, which the kernels use too.
pub use moeforge_compiler::plan::router::NORMALIZE_EPSILON;

use crate::bf16;
use crate::reference::on_every_core;

/// Tokens' expert choices and routing weights, `[tokens, top_k]` each.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub topk_ids: Vec<i32>,
    pub topk_weights: Vec<f32>,
}

/// `x · W_gateᵀ` in f32: `x` bf16 [T, H], `gate` bf16 [E, H]; the logits [T, E].
pub fn gate_logits(x: &[u16], gate: &[u16], hidden: usize, experts: usize) -> Vec<f32> {
    let gate: Vec<f32> = gate[..experts * hidden]
        .iter()
        .map(|&v| bf16::to_f32(v))
        .collect();
    let mut logits = Vec::with_capacity(x.len() / hidden.max(1) * experts);
    let mut row = vec![0f32; hidden];
    for token in x.chunks_exact(hidden) {
        for (r, &v) in row.iter_mut().zip(token) {
            *r = bf16::to_f32(v);
        }
        logits.extend(
            gate.chunks_exact(hidden)
                .map(|w| w.iter().zip(&row).map(|(a, b)| a * b).sum::<f32>()),
        );
    }
    logits
}

/// Routes every token of `logits` ([T, E], as [`gate_logits`] gives them, without any
/// bias) by `rule`: `bias` `[E]` is the gate's bias when `rule.bias` is not `None`.
///
/// # Panics
/// When `rule.bias` asks for a bias and `bias` is `None`, or `bias` holds fewer than E
/// values: a caller's set-up mistake (the runtime checks the gate weights it is given).
pub fn route(
    rule: &ir::Router,
    experts: usize,
    top_k: usize,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> Routed {
    let mut routed = Routed {
        topk_ids: Vec::with_capacity(logits.len() / experts.max(1) * top_k),
        topk_weights: Vec::with_capacity(logits.len() / experts.max(1) * top_k),
    };
    for row in logits.chunks_exact(experts) {
        let (ids, weights) = route_token(rule, top_k, row, bias);
        routed.topk_ids.extend(ids.iter().map(|&e| e as i32));
        routed.topk_weights.extend(weights);
    }
    routed
}

/// One token's `top_k` experts (best first) and their routing weights, from its logits.
pub fn route_token(
    rule: &ir::Router,
    top_k: usize,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> (Vec<usize>, Vec<f32>) {
    let logits = biased_logits(rule, logits, bias);
    let scores = scores(rule.scoring, &logits);
    let selection = selection_values(rule, &scores, bias);
    let eligible = eligible_experts(rule.group_limit, &selection);
    let ids = top_indices(&selection, top_k, |e| eligible[e]);
    let weights = weights_of(rule, &logits, &scores, &ids);
    (ids, weights)
}

/// Step 3: the values experts are chosen by: the scores, plus the score correction when
/// the rule has one.
fn selection_values(rule: &ir::Router, scores: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    scores
        .iter()
        .enumerate()
        .map(|(e, &s)| {
            let corrected = match rule.bias {
                RouterBias::ScoreCorrection => s + bias_of(bias, e),
                RouterBias::None | RouterBias::Logits => s,
            };
            comparable(corrected)
        })
        .collect()
}

/// Whether `got` (a kernel's choice) differs from the reference's choice from the same
/// logits only through near-ties: the kernel's `expf` and sums in another order move a
/// selection value by a few f32 ulps, which can flip a choice between values closer than
/// [`SELECTION_TOLERANCE`]. With a group limit, every group the kernel chose from must be
/// one the reference keeps or one within the tolerance of the last kept group's value;
/// then, among the groups the reference surely keeps and those the kernel chose from, the
/// k-th best expert's selection value must be within the tolerance of the kernel's k-th.
fn near_tie(rule: &ir::Router, logits: &[f32], bias: Option<&[f32]>, got: &[usize]) -> bool {
    let logits = biased_logits(rule, logits, bias);
    let scores = scores(rule.scoring, &logits);
    let selection = selection_values(rule, &scores, bias);
    let close =
        |a: f32, b: f32| (a - b).abs() <= SELECTION_TOLERANCE * a.abs().max(b.abs()).max(1.0);
    let mut distinct = got.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != got.len() || got.iter().any(|&e| e >= selection.len()) {
        return false;
    }
    let eligible: Vec<bool> = match rule.group_limit {
        None => vec![true; selection.len()],
        Some(limit) => {
            let size = selection.len() / limit.groups as usize;
            let values = group_values(&selection, size);
            let kept = top_indices(&values, limit.kept as usize, |_| true);
            let Some(&last_kept) = kept.last() else {
                return false;
            };
            let threshold = values[last_kept];
            let sure = |g: usize| values[g] > threshold && !close(values[g], threshold);
            let tied = |g: usize| close(values[g], threshold);
            if !got.iter().all(|&e| sure(e / size) || tied(e / size)) {
                return false;
            }
            (0..selection.len())
                .map(|e| sure(e / size) || got.iter().any(|&c| c / size == e / size))
                .collect()
        }
    };
    let want = top_indices(&selection, got.len(), |e| eligible[e]);
    want.len() == got.len()
        && got
            .iter()
            .zip(&want)
            .all(|(&g, &w)| close(selection[g], selection[w]))
}

/// A group's value: the sum of its two best selection values.
fn group_values(selection: &[f32], size: usize) -> Vec<f32> {
    selection
        .chunks_exact(size)
        .map(|group| {
            let best = top_indices(group, 2, |_| true);
            comparable(best.iter().map(|&i| group[i]).sum())
        })
        .collect()
}

/// The weights `rule` gives the chosen experts `ids` of a token with these logits (without
/// any bias): what [`route_token`] returns beside `ids`. Lets a check compare a kernel's
/// weights for the experts the kernel chose.
pub fn token_weights(
    rule: &ir::Router,
    logits: &[f32],
    bias: Option<&[f32]>,
    ids: &[usize],
) -> Vec<f32> {
    let logits = biased_logits(rule, logits, bias);
    let scores = scores(rule.scoring, &logits);
    weights_of(rule, &logits, &scores, ids)
}

fn bias_of(bias: Option<&[f32]>, expert: usize) -> f32 {
    bias.expect("the router's rule has a bias, so the caller passes one")[expert]
}

/// The logits with a [`RouterBias::Logits`] bias added (unchanged otherwise).
fn biased_logits(rule: &ir::Router, logits: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    logits
        .iter()
        .enumerate()
        .map(|(e, &l)| match rule.bias {
            RouterBias::Logits => l + bias_of(bias, e),
            RouterBias::None | RouterBias::ScoreCorrection => l,
        })
        .collect()
}

/// Step 2: the scores of all experts.
fn scores(scoring: Scoring, logits: &[f32]) -> Vec<f32> {
    match scoring {
        Scoring::Softmax => softmax(logits),
        Scoring::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        Scoring::TopkSoftmax => logits.to_vec(),
    }
}

/// `exp(v − max) / Σ exp(v − max)`.
fn softmax(values: &[f32]) -> Vec<f32> {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = values.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|&e| e / sum).collect()
}

/// A value as selection compares it: NaN is below every number.
fn comparable(value: f32) -> f32 {
    if value.is_nan() {
        f32::NEG_INFINITY
    } else {
        value
    }
}

/// The `count` indices of the highest `values` among those `allowed` accepts, highest
/// first, ties broken by the lower index (`values` hold no NaN).
fn top_indices(values: &[f32], count: usize, allowed: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).filter(|&i| allowed(i)).collect();
    // A stable sort keeps equal values in index order; -0 equals +0, as the kernels
    // compare them.
    order.sort_by(|&a, &b| {
        values[b]
            .partial_cmp(&values[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    order.truncate(count);
    order
}

/// Step 4: which experts may be chosen (all without a group limit).
fn eligible_experts(limit: Option<ir::GroupLimit>, selection: &[f32]) -> Vec<bool> {
    let Some(limit) = limit else {
        return vec![true; selection.len()];
    };
    let size = selection.len() / limit.groups as usize;
    let group_values = group_values(selection, size);
    let kept = top_indices(&group_values, limit.kept as usize, |_| true);
    (0..selection.len())
        .map(|e| kept.contains(&(e / size)))
        .collect()
}

/// Step 6: the routing weights of the chosen experts.
fn weights_of(rule: &ir::Router, logits: &[f32], scores: &[f32], ids: &[usize]) -> Vec<f32> {
    let mut weights: Vec<f32> = match rule.scoring {
        Scoring::TopkSoftmax => softmax(&ids.iter().map(|&e| logits[e]).collect::<Vec<_>>()),
        Scoring::Softmax | Scoring::Sigmoid => ids.iter().map(|&e| scores[e]).collect(),
    };
    if rule.normalize {
        let sum = weights.iter().sum::<f32>() + NORMALIZE_EPSILON;
        for w in &mut weights {
            *w /= sum;
        }
    }
    let scale = rule.scale as f32;
    for w in &mut weights {
        *w *= scale;
    }
    weights
}

/// How a router's output on the GPU compares with this reference, over some tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterCheck {
    /// Tokens compared.
    pub tokens: usize,
    /// Logits further from the reference's than [`LOGIT_TOLERANCE`] of their magnitude.
    pub logits_out_of_bound: usize,
    /// The largest logit error, as a fraction of its bound.
    pub worst_logit_ratio: f32,
    /// Tokens whose chosen experts (in order) differ from what the reference chooses from
    /// the kernel's own logits, other than through near-ties (below).
    pub mismatched_tokens: Vec<usize>,
    /// Tokens whose choice differs only through near-ties of selection values (see
    /// [`SELECTION_TOLERANCE`]): accepted, and counted so that a run says how many.
    pub near_tie_tokens: Vec<usize>,
    /// Weights further than [`WEIGHT_TOLERANCE`] (relative) from the reference's weights of
    /// the same experts.
    pub weights_out_of_bound: usize,
    /// The largest relative weight error.
    pub worst_weight_error: f32,
}

/// A kernel's logit may differ from the reference's by this fraction of `Σ_h |x_h·w_h|`:
/// both accumulate in f32, in different orders (the sum of H rounded terms is off by at
/// most about `H · 2⁻²⁴` of that magnitude in the worst case, far less in practice); a
/// logit of the wrong token or expert, or missing a 64-wide slice of H, is off by far more.
pub const LOGIT_TOLERANCE: f32 = 1.0 / 4096.0;
/// A kernel's weight may differ from the reference's by this fraction: `expf` against the
/// host's `exp` and sums in another order move it by a few f32 ulps.
pub const WEIGHT_TOLERANCE: f32 = 1e-5;
/// Two selection values (or group values) closer than this fraction of the larger (at
/// least of 1) may be ordered either way: the kernel's `expf` is within 2 ulps of the
/// correctly rounded value, a sigmoid and a correction add a rounding each, and a group's
/// value sums two, so both sides may differ by up to about 8 ulps (8 · 2⁻²³ ≈ 9.5e-7).
pub const SELECTION_TOLERANCE: f32 = 8.0 * f32::EPSILON;

impl RouterCheck {
    pub fn passed(&self) -> bool {
        self.logits_out_of_bound == 0
            && self.mismatched_tokens.is_empty()
            && self.weights_out_of_bound == 0
    }
}

impl std::fmt::Display for RouterCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "router over {} tokens: {} logits out of bound (worst {:.2} of its bound), {} tokens with other experts{}, {} near-tie flips accepted{}, {} weights out of bound (worst relative error {:.1e})",
            self.tokens,
            self.logits_out_of_bound,
            self.worst_logit_ratio,
            self.mismatched_tokens.len(),
            match self.mismatched_tokens.first() {
                Some(token) => format!(" (first: token {token})"),
                None => String::new(),
            },
            self.near_tie_tokens.len(),
            match self.near_tie_tokens.first() {
                Some(token) => format!(" (first: token {token})"),
                None => String::new(),
            },
            self.weights_out_of_bound,
            self.worst_weight_error
        )
    }
}

/// What a router kernel produced for a call: its logits [T, E], chosen experts and
/// weights [T, K].
pub struct KernelRouting<'a> {
    pub logits: &'a [f32],
    pub topk_ids: &'a [i32],
    pub topk_weights: &'a [f32],
}

/// Tokens per work item of [`compare`]: a token costs `2·E·H` multiply-adds (its logits
/// and their magnitudes), so an item is a few milliseconds of a large layer's work, and a
/// call of a few hundred tokens still spreads over every core.
const TOKENS_PER_ITEM: usize = 32;

/// Compares a router kernel's output for `tokens` (indices into the call) with this
/// reference: its logits against `x · W_gateᵀ` computed here, its choice against the
/// reference's choice from the kernel's own logits, its weights against the reference's
/// weights of the experts it chose. `x` is bf16 [T, H], `gate` bf16 [E, H]. The tokens are
/// compared on every core, each as on one thread, and the findings kept in token order:
/// the result does not depend on the number of cores.
#[allow(clippy::too_many_arguments)]
pub fn compare(
    rule: &ir::Router,
    hidden: usize,
    experts: usize,
    top_k: usize,
    x: &[u16],
    gate: &[u16],
    bias: Option<&[f32]>,
    kernel: &KernelRouting<'_>,
    tokens: &[usize],
) -> RouterCheck {
    let gate_rows: Vec<f32> = gate[..experts * hidden]
        .iter()
        .map(|&v| bf16::to_f32(v))
        .collect();
    let items: Vec<&[usize]> = tokens.chunks(TOKENS_PER_ITEM).collect();
    let compare_item = |item: usize| {
        let mut check = RouterCheck::of_no_tokens();
        for &t in items[item] {
            check.tokens += 1;
            let row: Vec<f32> = x[t * hidden..(t + 1) * hidden]
                .iter()
                .map(|&v| bf16::to_f32(v))
                .collect();
            let kernel_logits = &kernel.logits[t * experts..(t + 1) * experts];
            for (w, &got) in gate_rows.chunks_exact(hidden).zip(kernel_logits) {
                let want: f32 = w.iter().zip(&row).map(|(a, b)| a * b).sum();
                let magnitude: f32 = w.iter().zip(&row).map(|(a, b)| (a * b).abs()).sum();
                let bound = LOGIT_TOLERANCE * magnitude + f32::MIN_POSITIVE;
                let ratio = (got - want).abs() / bound;
                if ratio > 1.0 || ratio.is_nan() {
                    check.logits_out_of_bound += 1;
                }
                check.worst_logit_ratio = check.worst_logit_ratio.max(ratio);
            }
            let (want_ids, _) = route_token(rule, top_k, kernel_logits, bias);
            let got_ids: Vec<usize> = kernel.topk_ids[t * top_k..(t + 1) * top_k]
                .iter()
                .map(|&id| usize::try_from(id).unwrap_or(usize::MAX))
                .collect();
            if got_ids != want_ids {
                if near_tie(rule, kernel_logits, bias, &got_ids) {
                    check.near_tie_tokens.push(t);
                } else {
                    check.mismatched_tokens.push(t);
                    continue;
                }
            }
            let want = token_weights(rule, kernel_logits, bias, &got_ids);
            for (&got, &want) in kernel.topk_weights[t * top_k..(t + 1) * top_k]
                .iter()
                .zip(&want)
            {
                let error = (got - want).abs() / want.abs().max(f32::MIN_POSITIVE);
                if error > WEIGHT_TOLERANCE || error.is_nan() {
                    check.weights_out_of_bound += 1;
                }
                check.worst_weight_error = check.worst_weight_error.max(error);
            }
        }
        check
    };
    on_every_core(items.len(), compare_item).into_iter().fold(
        RouterCheck::of_no_tokens(),
        |mut all, item| {
            all.add(item);
            all
        },
    )
}

impl RouterCheck {
    /// The check of no tokens: nothing compared, nothing wrong.
    fn of_no_tokens() -> Self {
        RouterCheck {
            tokens: 0,
            logits_out_of_bound: 0,
            worst_logit_ratio: 0.0,
            mismatched_tokens: Vec::new(),
            near_tie_tokens: Vec::new(),
            weights_out_of_bound: 0,
            worst_weight_error: 0.0,
        }
    }

    /// Adds the findings of `later`, a check of tokens after this one's.
    fn add(&mut self, later: RouterCheck) {
        self.tokens += later.tokens;
        self.logits_out_of_bound += later.logits_out_of_bound;
        // `f32::max` ignores a NaN operand, as the comparison of each token does: the
        // largest of the items' largest is the largest over all tokens.
        self.worst_logit_ratio = self.worst_logit_ratio.max(later.worst_logit_ratio);
        self.mismatched_tokens.extend(later.mismatched_tokens);
        self.near_tie_tokens.extend(later.near_tie_tokens);
        self.weights_out_of_bound += later.weights_out_of_bound;
        self.worst_weight_error = self.worst_weight_error.max(later.worst_weight_error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(scoring: Scoring, bias: RouterBias, normalize: bool, scale: f64) -> ir::Router {
        ir::Router {
            scoring,
            bias,
            group_limit: None,
            normalize,
            scale,
        }
    }

    fn mixtral() -> ir::Router {
        rule(Scoring::Softmax, RouterBias::None, true, 1.0)
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }

    /// The logit whose sigmoid is `p`.
    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn gate_logits_are_dot_products_of_bf16_rows() {
        let b = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let x = b(&[1.0, 2.0, -1.0, 0.5, 0.0, 4.0]); // two tokens of H = 3
        let gate = b(&[1.0, 1.0, 1.0, 2.0, 0.0, -1.0]); // two experts
        assert_eq!(
            gate_logits(&x, &gate, 3, 2),
            vec![2.0, 3.0, 4.5, -3.0],
            "[1+2-1, 2+0+1], [0.5+0+4, 1+0-4]"
        );
    }

    #[test]
    fn mixtral_softmax_top_k_renormalised() {
        // softmax then renormalising over {3, 2}: e^3 / (e^3 + e^2) = 1 / (1 + e^-1).
        let (ids, weights) = route_token(&mixtral(), 2, &[1.0, 3.0, 2.0, 0.0], None);
        assert_eq!(ids, vec![1, 2]);
        let first = 1.0 / (1.0 + (-1.0f32).exp());
        assert_close(&weights, &[first, 1.0 - first]);
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let (ids, weights) = route_token(&mixtral(), 2, &[2.0, 5.0, 5.0, 1.0, 5.0], None);
        assert_eq!(
            ids,
            vec![1, 2],
            "three experts tie at 5: the two lowest win"
        );
        assert_close(&weights, &[0.5, 0.5]);
        let (ids, _) = route_token(&mixtral(), 3, &[5.0, 5.0, 5.0, 5.0], None);
        assert_eq!(ids, vec![0, 1, 2]);
    }

    #[test]
    fn qwen3_normalize_on_and_off() {
        // softmax of ln 1..=4 is 1/10, 2/10, 3/10, 4/10.
        let logits = [1f32, 2.0, 3.0, 4.0].map(f32::ln);
        let plain = rule(Scoring::Softmax, RouterBias::None, false, 1.0);
        let (ids, weights) = route_token(&plain, 2, &logits, None);
        assert_eq!(ids, vec![3, 2]);
        assert_close(&weights, &[0.4, 0.3]);
        let (ids, weights) = route_token(&mixtral(), 2, &logits, None);
        assert_eq!(ids, vec![3, 2]);
        assert_close(&weights, &[4.0 / 7.0, 3.0 / 7.0]);
    }

    /// Eight experts in four groups of two, two groups kept, top 2, scaled by 2.5.
    fn deepseek() -> ir::Router {
        ir::Router {
            scoring: Scoring::Sigmoid,
            bias: RouterBias::ScoreCorrection,
            group_limit: Some(ir::GroupLimit { groups: 4, kept: 2 }),
            normalize: true,
            scale: 2.5,
        }
    }

    /// Sigmoid scores 0.9, 0.1 | 0.6, 0.6 | 0.75, 0.2 | 0.4, 0.5 (groups of two).
    fn deepseek_logits() -> Vec<f32> {
        [0.9, 0.1, 0.6, 0.6, 0.75, 0.2, 0.4, 0.5]
            .map(logit)
            .to_vec()
    }

    #[test]
    fn group_limit_excludes_experts_of_dropped_groups() {
        let no_correction = [0f32; 8];
        // Group values 1.0, 1.2, 0.95, 0.9: groups 1 and 0 are kept, so expert 4 (0.75,
        // the second best overall) is out; 2 and 3 tie at 0.6 and 2 wins.
        let (ids, weights) = route_token(&deepseek(), 2, &deepseek_logits(), Some(&no_correction));
        assert_eq!(ids, vec![0, 2]);
        assert_close(&weights, &[2.5 * 0.9 / 1.5, 2.5 * 0.6 / 1.5]);
        // Without the group limit expert 4 is chosen.
        let unlimited = ir::Router {
            group_limit: None,
            ..deepseek()
        };
        let (ids, _) = route_token(&unlimited, 2, &deepseek_logits(), Some(&no_correction));
        assert_eq!(ids, vec![0, 4]);
    }

    #[test]
    fn correction_bias_chooses_but_the_uncorrected_scores_weigh() {
        // +0.3 on group 2: corrected 0.9, 0.1 | 0.6, 0.6 | 1.05, 0.5 | 0.4, 0.5, group
        // values 1.0, 1.2, 1.55, 0.9: groups 2 and 1 kept; expert 0, the best
        // uncorrected score, is out. Chosen: 4 (1.05), then 2 (0.6, tied with 3).
        let correction = [0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.0, 0.0];
        let (ids, weights) = route_token(&deepseek(), 2, &deepseek_logits(), Some(&correction));
        assert_eq!(ids, vec![4, 2]);
        // Weights from the scores 0.75 and 0.6, not 1.05 and 0.6.
        assert_close(&weights, &[2.5 * 0.75 / 1.35, 2.5 * 0.6 / 1.35]);
        assert_close(
            &token_weights(&deepseek(), &deepseek_logits(), Some(&correction), &ids),
            &weights,
        );
    }

    #[test]
    fn sigmoid_without_normalize_is_only_scaled() {
        let rule = rule(Scoring::Sigmoid, RouterBias::None, false, 2.0);
        let (ids, weights) = route_token(&rule, 2, &[logit(0.25), logit(0.8), 0.0], None);
        assert_eq!(ids, vec![1, 2]);
        assert_close(&weights, &[1.6, 1.0]);
    }

    #[test]
    fn gpt_oss_top_k_of_biased_logits_then_softmax_over_them() {
        let gpt_oss = rule(Scoring::TopkSoftmax, RouterBias::Logits, false, 1.0);
        // Biased logits 1, 2, 2, 3: 3 first, then the tie at 2 goes to expert 1.
        let bias = [0.0, -2.0, 0.0, 0.0];
        let (ids, weights) = route_token(&gpt_oss, 2, &[1.0, 4.0, 2.0, 3.0], Some(&bias));
        assert_eq!(ids, vec![3, 1]);
        let first = 1.0 / (1.0 + (-1.0f32).exp());
        assert_close(&weights, &[first, 1.0 - first]);
        // The same bias as a score correction chooses the same experts but weighs their
        // uncorrected logits 3 and 4.
        let corrected = rule(
            Scoring::TopkSoftmax,
            RouterBias::ScoreCorrection,
            false,
            1.0,
        );
        let (ids, weights) = route_token(&corrected, 2, &[1.0, 4.0, 2.0, 3.0], Some(&bias));
        assert_eq!(ids, vec![3, 1]);
        assert_close(&weights, &[1.0 - first, first]);
    }

    #[test]
    fn nan_is_never_chosen_over_a_number() {
        let (ids, _) = route_token(&mixtral(), 2, &[f32::NAN, -50.0, 1.0], None);
        assert_eq!(ids.len(), 2);
        let sigmoid = rule(Scoring::Sigmoid, RouterBias::None, false, 1.0);
        let (ids, _) = route_token(&sigmoid, 2, &[f32::NAN, -50.0, 1.0], None);
        assert_eq!(ids, vec![2, 1]);
    }

    #[test]
    fn route_lays_tokens_out_row_by_row() {
        let logits = [1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 9.0];
        let routed = route(&mixtral(), 4, 1, &logits, None);
        assert_eq!(routed.topk_ids, vec![1, 3]);
        assert_close(&routed.topk_weights, &[1.0, 1.0]);
    }

    #[test]
    fn the_reference_passes_its_own_check_and_a_wrong_choice_fails() {
        let b = |v: &[f32]| v.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let x = b(&[1.0, 0.5, -1.0, 2.0]); // two tokens of H = 2
        let gate = b(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]); // three experts
        let logits = gate_logits(&x, &gate, 2, 3);
        let routed = route(&mixtral(), 3, 2, &logits, None);
        let kernel = KernelRouting {
            logits: &logits,
            topk_ids: &routed.topk_ids,
            topk_weights: &routed.topk_weights,
        };
        let check = compare(&mixtral(), 2, 3, 2, &x, &gate, None, &kernel, &[0, 1]);
        assert!(check.passed(), "{check}");
        let mut swapped = routed.topk_ids.clone();
        swapped.swap(0, 1);
        let kernel = KernelRouting {
            topk_ids: &swapped,
            ..kernel
        };
        let check = compare(&mixtral(), 2, 3, 2, &x, &gate, None, &kernel, &[0, 1]);
        assert_eq!(check.mismatched_tokens, vec![0]);
        let mut off = logits.clone();
        off[4] += 0.5;
        let kernel = KernelRouting {
            logits: &off,
            topk_ids: &routed.topk_ids,
            topk_weights: &routed.topk_weights,
        };
        let check = compare(&mixtral(), 2, 3, 2, &x, &gate, None, &kernel, &[0, 1]);
        assert_eq!(check.logits_out_of_bound, 1, "{check}");
    }

    /// A call of several work items finds what checking its tokens one at a time finds,
    /// in token order: wrong choices, near-ties, out-of-bound logits and weights, and the
    /// worst errors.
    #[test]
    fn many_tokens_compare_as_their_tokens_one_by_one() {
        use crate::workload::SplitMix64;
        let (hidden, experts, top_k, tokens) = (24, 6, 2, 5 * TOKENS_PER_ITEM + 3);
        let mut rng = SplitMix64::new(5);
        let mut draw =
            |n: usize| -> Vec<u16> { (0..n).map(|_| bf16::from_f32(rng.signed())).collect() };
        let (x, gate) = (draw(tokens * hidden), draw(experts * hidden));
        let mut logits = gate_logits(&x, &gate, hidden, experts);
        let mut routed = route(&mixtral(), experts, top_k, &logits, None);
        // Faults spread over the items: a logit off, a choice swapped, a weight off.
        for t in (0..tokens).step_by(7) {
            logits[t * experts + 1] += 0.25;
        }
        for t in (3..tokens).step_by(11) {
            routed.topk_ids.swap(t * top_k, t * top_k + 1);
        }
        for t in (5..tokens).step_by(13) {
            routed.topk_weights[t * top_k] *= 1.01;
        }
        let kernel = KernelRouting {
            logits: &logits,
            topk_ids: &routed.topk_ids,
            topk_weights: &routed.topk_weights,
        };
        let all: Vec<usize> = (0..tokens).collect();
        let check = |tokens: &[usize]| {
            compare(
                &mixtral(),
                hidden,
                experts,
                top_k,
                &x,
                &gate,
                None,
                &kernel,
                tokens,
            )
        };
        let together = check(&all);
        let one_by_one = all.iter().fold(RouterCheck::of_no_tokens(), |mut sum, &t| {
            sum.add(check(&[t]));
            sum
        });
        assert_eq!(together, one_by_one);
        assert!(
            together.logits_out_of_bound > 0
                && together.mismatched_tokens.len() > 1
                && together.weights_out_of_bound > 0,
            "{together}"
        );
    }

    /// The logits themselves choose (top-k of the logits), so selection values are exact.
    fn by_logits(group_limit: Option<ir::GroupLimit>) -> ir::Router {
        ir::Router {
            group_limit,
            ..rule(Scoring::TopkSoftmax, RouterBias::None, false, 1.0)
        }
    }

    #[test]
    fn a_flip_between_values_an_ulp_apart_is_a_near_tie() {
        let logits = [0.5, 0.5 + f32::EPSILON, 0.1, -1.0];
        let reference = route_token(&by_logits(None), 1, &logits, None).0;
        assert_eq!(reference, vec![1]);
        assert!(near_tie(&by_logits(None), &logits, None, &[0]));
    }

    #[test]
    fn a_clearly_worse_choice_is_not_a_near_tie() {
        let logits = [0.5, 0.6, 0.1, -1.0];
        assert!(!near_tie(&by_logits(None), &logits, None, &[0]));
        assert!(
            !near_tie(&by_logits(None), &logits, None, &[1, 1]),
            "an expert twice"
        );
        assert!(
            !near_tie(&by_logits(None), &logits, None, &[7]),
            "no such expert"
        );
    }

    #[test]
    fn a_group_kept_through_a_near_tie_may_supply_the_experts() {
        // Four groups of two; one is kept. Groups 0 and 1 are worth 1.0 and 1.0 + ε: the
        // reference keeps group 1 (experts 2, 3); a kernel that kept group 0 chose
        // expert 0, whose value is close to the reference's pick 2 as well.
        let limit = Some(ir::GroupLimit { groups: 4, kept: 1 });
        let logits = [0.6, 0.4, 0.6 + f32::EPSILON, 0.4, 0.1, 0.1, 0.0, 0.0];
        assert_eq!(route_token(&by_logits(limit), 1, &logits, None).0, vec![2]);
        assert!(near_tie(&by_logits(limit), &logits, None, &[0]));
        // Group 2 is far behind: choosing from it is a real mismatch.
        assert!(!near_tie(&by_logits(limit), &logits, None, &[4]));
        // Group 0 tied, but its second expert is not the best of it.
        assert!(!near_tie(&by_logits(limit), &logits, None, &[1]));
    }
}
