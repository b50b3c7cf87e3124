//! Seeded inputs of a call, shared by the runtime (the random activations and routing of
//! `moeforge run`, `bench` and the GPU tests) and the simulator (`simulate --measured`
//! routes each measured call exactly as the bench drew it): one generator and one order of
//! draws, so that a seed means the same call to both.

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

/// The expert choices and routing weights of a call, `[tokens, top_k]` each.
#[derive(Clone, Debug, PartialEq)]
pub struct Choices {
    pub topk_ids: Vec<i32>,
    pub topk_weights: Vec<f32>,
}

/// The draws of one call of `tokens` tokens from `seed`, in their order: first the
/// activations, `tokens × hidden` values uniform in [-1, 1) handed to `activation` in row
/// order, then per token `top_k` distinct experts among `choosable` (the first one `first`
/// where given) and their weights (positive, summing to 1).
///
/// # Panics
///
/// When `choosable` (with `first`) cannot give `top_k` distinct experts: the draw would
/// never end.
pub fn draw_call(
    hidden: u32,
    tokens: u32,
    top_k: u32,
    choosable: &[i32],
    first: Option<i32>,
    seed: u64,
    mut activation: impl FnMut(f32),
) -> Choices {
    let k = top_k as usize;
    let distinct = choosable.len() + usize::from(first.is_some_and(|f| !choosable.contains(&f)));
    assert!(
        distinct >= k,
        "{distinct} experts cannot give {k} distinct choices"
    );
    let mut rng = SplitMix64::new(seed);
    for _ in 0..u64::from(tokens) * u64::from(hidden) {
        activation(rng.signed());
    }
    let mut topk_ids = Vec::with_capacity(tokens as usize * k);
    let mut topk_weights = Vec::with_capacity(tokens as usize * k);
    for _ in 0..tokens {
        let start = topk_ids.len();
        while topk_ids.len() - start < k {
            let candidate = match first {
                Some(expert) if topk_ids.len() == start => expert,
                _ => choosable[rng.below(choosable.len() as u32) as usize],
            };
            if !topk_ids[start..].contains(&candidate) {
                topk_ids.push(candidate);
            }
        }
        let raw: Vec<f32> = (0..k).map(|_| 0.05 + rng.unit()).collect();
        let total: f32 = raw.iter().sum();
        topk_weights.extend(raw.iter().map(|w| w / total));
    }
    Choices {
        topk_ids,
        topk_weights,
    }
}

/// The seed of rank `rank`'s inputs at `tokens` tokens per rank in the expert-parallel
/// bench whose seed is `seed` (each rank and token count draws its own call).
pub fn expert_parallel_rank_seed(seed: u64, tokens: u32, rank: u32) -> u64 {
    seed ^ (u64::from(tokens) << 8) ^ u64::from(rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The activations come first in the stream: a caller that skips them gets the same
    /// choices as one that keeps them, and the seed decides both.
    #[test]
    fn choices_follow_the_activations_and_the_seed() {
        let experts: Vec<i32> = (0..16).collect();
        let mut kept = Vec::new();
        let a = draw_call(8, 5, 3, &experts, None, 7, |v| kept.push(v));
        let b = draw_call(8, 5, 3, &experts, None, 7, |_| {});
        assert_eq!(a, b);
        assert_eq!(kept.len(), 40);
        assert!(kept.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_ne!(a, draw_call(8, 5, 3, &experts, None, 8, |_| {}));
        let first = draw_call(8, 5, 3, &experts, Some(0), 7, |_| {});
        assert!(first.topk_ids.chunks(3).all(|ids| ids[0] == 0));
    }
}
