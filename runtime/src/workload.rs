//! Random inputs for `run`, `bench` and the GPU tests: activations, expert choices and
//! routing weights for T tokens, drawn from a seeded generator (fresh seed per run unless
//! one is given, so that checks see new data every time).

use moeforge_compiler::plan::LayerShape;

use crate::bf16;

/// A small, fast, seedable generator (SplitMix64); the same seed gives the same stream on
/// every machine.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    pub fn signed(&mut self) -> f32 {
        2.0 * self.unit() - 1.0
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * u64::from(n)) >> 32) as u32
    }
}

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
}

impl Routing {
    /// Whether this routing can give every token K distinct experts of `shape`.
    pub fn fits(self, shape: &LayerShape) -> bool {
        match self {
            Routing::Uniform | Routing::Skewed => shape.experts >= shape.top_k,
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
        let choosable = routing.choosable(shape.experts);
        let mut rng = SplitMix64::new(seed);
        let x = (0..u64::from(tokens) * u64::from(shape.hidden))
            .map(|_| bf16::from_f32(rng.signed()))
            .collect();
        let k = shape.top_k as usize;
        let mut topk_ids = Vec::with_capacity(tokens as usize * k);
        let mut topk_weights = Vec::with_capacity(tokens as usize * k);
        for _ in 0..tokens {
            let start = topk_ids.len();
            while topk_ids.len() - start < k {
                let candidate = if routing == Routing::Skewed && topk_ids.len() == start {
                    0
                } else {
                    choosable[rng.below(choosable.len() as u32) as usize]
                };
                if !topk_ids[start..].contains(&candidate) {
                    topk_ids.push(candidate);
                }
            }
            let raw: Vec<f32> = (0..k).map(|_| 0.05 + rng.unit()).collect();
            let total: f32 = raw.iter().sum();
            topk_weights.extend(raw.iter().map(|w| w / total));
        }
        Workload {
            tokens,
            x,
            topk_ids,
            topk_weights,
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
            spec_ranks: 1,
            executed_ranks: 1,
        }
    }

    #[test]
    fn choices_are_distinct_in_range_and_weights_sum_to_one() {
        for routing in [Routing::Uniform, Routing::Skewed, Routing::EmptyExperts] {
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
