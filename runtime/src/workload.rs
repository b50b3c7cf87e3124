//! Random inputs for `run`, `bench` and the GPU tests: activations, expert choices and
//! routing weights for T tokens, drawn from a seeded generator (fresh seed per run unless
//! one is given, so that checks see new data every time). The draws are the compiler's
//! (`moeforge_compiler::inputs`), which the simulator replays to route a measured call as
//! the bench did.

use moeforge_compiler::inputs;
use moeforge_compiler::plan::LayerShape;

use crate::bf16;

pub use moeforge_compiler::inputs::SplitMix64;

/// `given`, or a seed from the clock (fresh every run; callers print it for replay).
pub fn fresh_seed(given: Option<u64>) -> u64 {
    given.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    })
}

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// K distinct experts per token, uniformly.
    Uniform,
    /// Every token's first choice is expert 0 (one expert takes every token); the other
    /// K − 1 choices are uniform and distinct.
    Skewed,
    /// Like `Uniform`, but the first expert (0), a middle one (E/2) and the last (E − 1)
    /// are never chosen, so that they get no rows. Needs E ≥ K + 3 (see
    /// [`Routing::fits`]).
    EmptyExperts,
    /// Pair j of token t goes to expert (t·K + j) mod E: every expert gets ⌊T·K/E⌋ or
    /// ⌈T·K/E⌉ rows, the best case for filling row tiles (against `Uniform`, it tells
    /// what the row tiles an expert's spread of rows leaves part empty cost). Weights
    /// and activations are `Uniform`'s of the same seed.
    Balanced,
}

impl Routing {
    /// Whether this routing can give every token K distinct experts of `shape`.
    pub fn fits(self, shape: &LayerShape) -> bool {
        match self {
            Routing::Uniform | Routing::Skewed | Routing::Balanced => shape.experts >= shape.top_k,
            Routing::EmptyExperts => shape.experts >= shape.top_k + 3,
        }
    }

    /// The experts this routing may choose (besides Skewed's fixed first choice).
    fn choosable(self, experts: u32) -> Vec<i32> {
        let empty =
            |e: u32| self == Routing::EmptyExperts && [0, experts / 2, experts - 1].contains(&e);
        (0..experts)
            .filter(|&e| !empty(e))
            .map(|e| e as i32)
            .collect()
    }
}

/// Inputs of one forward call, on the host.
#[derive(Clone, Debug)]
pub struct Workload {
    pub tokens: u32,
    /// bf16 [T, H].
    pub x: Vec<u16>,
    /// [T, K], distinct per token.
    pub topk_ids: Vec<i32>,
    /// [T, K], positive, summing to 1 per token.
    pub topk_weights: Vec<f32>,
}

impl Workload {
    /// # Panics
    ///
    /// When `routing` does not fit the layer ([`Routing::fits`]): the choice could never
    /// be made.
    pub fn random(shape: &LayerShape, tokens: u32, routing: Routing, seed: u64) -> Self {
        assert!(
            routing.fits(shape),
            "{routing:?} routing cannot give {} distinct experts of {} to each token",
            shape.top_k,
            shape.experts
        );
        let mut x = Vec::with_capacity(tokens as usize * shape.hidden as usize);
        let first = (routing == Routing::Skewed).then_some(0);
        let mut choices = inputs::draw_call(
            shape.hidden,
            tokens,
            shape.top_k,
            &routing.choosable(shape.experts),
            first,
            seed,
            |value| x.push(bf16::from_f32(value)),
        );
        if routing == Routing::Balanced {
            for (pair, id) in choices.topk_ids.iter_mut().enumerate() {
                *id = (pair % shape.experts as usize) as i32;
            }
        }
        Workload {
            tokens,
            x,
            topk_ids: choices.topk_ids,
            topk_weights: choices.topk_weights,
        }
    }
}

/// Weight scale for uniform [-s, s) entries keeping activations near unit size: the
/// variance of a dot product over `fan_in` terms is `fan_in · s² / 3`.
pub fn weight_scale(fan_in: u32) -> f32 {
    (3.0 / fan_in as f32).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeforge_compiler::ir::Activation;

    fn shape() -> LayerShape {
        LayerShape {
            hidden: 64,
            ffn: 64,
            experts: 8,
            top_k: 3,
            activation: Activation::Swiglu,
            expert_bias: false,
            max_tokens: 64,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    #[test]
    fn choices_are_distinct_in_range_and_weights_sum_to_one() {
        for routing in [
            Routing::Uniform,
            Routing::Skewed,
            Routing::EmptyExperts,
            Routing::Balanced,
        ] {
            let w = Workload::random(&shape(), 50, routing, 7);
            assert_eq!(w.x.len(), 50 * 64);
            for t in 0..50 {
                let ids = &w.topk_ids[t * 3..t * 3 + 3];
                assert!(ids.iter().all(|&e| (0..8).contains(&e)));
                assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
                if routing == Routing::Skewed {
                    assert_eq!(ids[0], 0);
                }
                if routing == Routing::EmptyExperts {
                    assert!(ids.iter().all(|e| ![0, 4, 7].contains(e)), "{ids:?}");
                }
                let sum: f32 = w.topk_weights[t * 3..t * 3 + 3].iter().sum();
                assert!((sum - 1.0).abs() < 1e-5);
            }
        }
        let a = Workload::random(&shape(), 5, Routing::Uniform, 1);
        let b = Workload::random(&shape(), 5, Routing::Uniform, 2);
        assert_ne!(a.x, b.x, "different seeds give different data");
    }

    #[test]
    fn balanced_routing_gives_every_expert_its_share_of_rows() {
        // 50 tokens × 3 pairs over 8 experts: 150 = 8 × 18 + 6, so six experts get 19 rows.
        let w = Workload::random(&shape(), 50, Routing::Balanced, 7);
        let mut rows = [0; 8];
        for &id in &w.topk_ids {
            rows[id as usize] += 1;
        }
        assert_eq!(rows, [19, 19, 19, 19, 19, 19, 18, 18]);
        let uniform = Workload::random(&shape(), 50, Routing::Uniform, 7);
        assert_eq!((w.x, w.topk_weights), (uniform.x, uniform.topk_weights));
    }

    #[test]
    fn empty_experts_needs_three_spare_experts() {
        let mut small = shape();
        small.experts = 5;
        assert!(Routing::Uniform.fits(&small) && Routing::Skewed.fits(&small));
        assert!(!Routing::EmptyExperts.fits(&small));
        small.experts = 6;
        assert!(Routing::EmptyExperts.fits(&small));
        let w = Workload::random(&small, 40, Routing::EmptyExperts, 3);
        // Experts 0, 3 and 5 are left out: every token takes exactly 1, 2 and 4.
        for ids in w.topk_ids.chunks(3) {
            let mut ids = ids.to_vec();
            ids.sort_unstable();
            assert_eq!(ids, [1, 2, 4]);
        }
    }
}
