//! The CPU reference of the layer contract (DESIGN.md, "The layer contract"), in f32.
//!
//! `y[t] = Σ_k topk_weights[t,k] · W2_e · act(W1_e · x[t])` with `e = topk_ids[t,k]`.
//! Inputs are bf16 bits; everything after is f32 (the intermediate is not rounded), so the
//! difference to the GPU is the kernels' bf16 storage of the intermediate and the output.
//! This function defines the answer the kernels are checked against.

use moeforge_compiler::ir::Activation;
use moeforge_compiler::plan::LayerShape;

use crate::bf16;

/// One expert's weights on the host, checkpoint layout: `w1` [w1_rows, H], `w2` [H, F].
pub struct HostExpert<'a> {
    pub w1: &'a [u16],
    pub w2: &'a [u16],
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

fn gelu_tanh(v: f32) -> f32 {
    0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044_715 * v * v * v)).tanh())
}

fn dot(row: &[u16], x: &[f32]) -> f32 {
    row.iter().zip(x).map(|(&w, &v)| bf16::to_f32(w) * v).sum()
}

/// The layer output of one token, `[H]` in f32.
///
/// `experts(e)` gives expert `e`'s weights; ids outside `0..E` are the caller's error and
/// are skipped here as the kernels skip them.
pub fn token_output<'a>(
    shape: &LayerShape,
    x: &[u16],
    topk_ids: &[i32],
    topk_weights: &[f32],
    experts: impl Fn(usize) -> HostExpert<'a>,
) -> Vec<f32> {
    let hidden = shape.hidden as usize;
    let ffn = shape.ffn as usize;
    let x: Vec<f32> = x.iter().map(|&v| bf16::to_f32(v)).collect();
    let mut y = vec![0.0f32; hidden];
    let mut intermediate = vec![0.0f32; ffn];
    for (&id, &weight) in topk_ids.iter().zip(topk_weights) {
        let Ok(e) = usize::try_from(id) else { continue };
        if e >= shape.experts as usize {
            continue;
        }
        let expert = experts(e);
        for (f, value) in intermediate.iter_mut().enumerate() {
            let h = dot(&expert.w1[f * hidden..(f + 1) * hidden], &x);
            *value = match shape.activation {
                Activation::Swiglu | Activation::Geglu => {
                    let up = dot(&expert.w1[(ffn + f) * hidden..(ffn + f + 1) * hidden], &x);
                    let gate = if shape.activation == Activation::Swiglu {
                        silu(h)
                    } else {
                        gelu_tanh(h)
                    };
                    gate * up
                }
                Activation::Gelu => gelu_tanh(h),
                Activation::Relu => h.max(0.0),
                Activation::Silu => silu(h),
            };
        }
        for (o, out) in y.iter_mut().enumerate() {
            *out += weight * dot(&expert.w2[o * ffn..(o + 1) * ffn], &intermediate);
        }
    }
    y
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

    fn shape(activation: Activation) -> LayerShape {
        LayerShape {
            hidden: 2,
            ffn: 1,
            experts: 2,
            top_k: 2,
            activation,
            max_tokens: 1,
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    #[test]
    fn hand_computed_swiglu_token() {
        // x = [1, 2]. Expert 0: gate row [1, 0] -> 1, up row [0, 1] -> 2, act = silu(1)*2.
        // W2 = [[1], [2]] -> [act, 2 act]. Expert 1 is the same but weighted 0.25.
        let one = bf16::from_f32(1.0);
        let two = bf16::from_f32(2.0);
        let zero = bf16::from_f32(0.0);
        let w1 = [one, zero, zero, one];
        let w2 = [one, two];
        let x = [one, two];
        let y = token_output(
            &shape(Activation::Swiglu),
            &x,
            &[0, 1],
            &[0.75, 0.25],
            |_| HostExpert { w1: &w1, w2: &w2 },
        );
        let act = silu(1.0) * 2.0;
        assert!(
            (y[0] - act).abs() < 1e-6 && (y[1] - 2.0 * act).abs() < 1e-6,
            "{y:?}"
        );
        // An out-of-range id contributes nothing.
        let y = token_output(
            &shape(Activation::Swiglu),
            &x,
            &[0, 7],
            &[0.75, 0.25],
            |_| HostExpert { w1: &w1, w2: &w2 },
        );
        assert!((y[0] - 0.75 * act).abs() < 1e-6, "{y:?}");
    }

    #[test]
    fn relative_error_is_zero_for_equal_and_nan_for_nan() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(relative_error(&[f32::NAN, 2.0], &[1.0, 2.0]).is_nan());
        assert!((relative_error(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
    }
}
