//! Who sends what to whom in one call: the (token, expert) pairs of every source rank,
//! counted per destination rank, per destination expert and per destination node.
//!
//! Routing is drawn per token (every token picks `top_k` distinct experts) and then only
//! the counts are kept: the simulator never looks at single tokens again.

use super::SimError;
use crate::inputs::{self, SplitMix64};

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// Every token picks `top_k` distinct experts uniformly at random (seeded, so a report
    /// is reproducible), as the bench's uniform routing does.
    Uniform,
    /// Every token of every rank picks experts `0..top_k`: the worst case for the ranks
    /// holding those experts and for their receive buffers.
    Skewed,
    /// As DeepSeek-V3's router limits them: the experts split into `groups` equal groups
    /// (in index order), every token picks `kept` distinct groups uniformly at random, then
    /// `top_k` distinct experts uniformly among theirs (seeded). With experts placed on
    /// ranks in index order, a group is a block of ranks (at EP = 64 over 8 nodes,
    /// DeepSeek-V3's 8 groups are the 8 nodes), so a token reaches at most `kept` of them.
    GroupLimited { groups: u32, kept: u32 },
    /// On every rank token `t`'s pairs go to experts `t·K, t·K + 1, …` (mod E), as the
    /// bench's balanced routing sends them: every expert gets `T·K/E` rows of each source
    /// (±1), so its row tiles are as full as they can be.
    Balanced,
    /// Uniform, as `moeforge bench --seed` drew it: every rank's call replayed from the
    /// bench's seed (`inputs::draw_call`; the draws start with the activations, so the
    /// layer's hidden size is part of the routing). At a few tokens per rank which experts a
    /// rank hits decides the call, so `simulate --measured` predicts the bench's own.
    Benched { seed: u64, hidden: u32 },
}

impl Routing {
    /// Why `groups` groups with `kept` kept cannot limit `top_k` of `experts` experts, if
    /// they cannot.
    pub fn group_limit_error(experts: u32, top_k: u32, groups: u32, kept: u32) -> Option<String> {
        if groups == 0 || !experts.is_multiple_of(groups) {
            Some(format!(
                "{groups} groups do not split the {experts} experts evenly"
            ))
        } else if kept == 0 || kept > groups {
            Some(format!(
                "{kept} kept groups is not between 1 and the {groups} groups"
            ))
        } else if top_k > kept * (experts / groups) {
            Some(format!(
                "{kept} kept groups of {} experts hold fewer than top_k = {top_k}",
                experts / groups
            ))
        } else {
            None
        }
    }

    pub fn name(self) -> String {
        match self {
            Routing::Uniform => "uniform".into(),
            Routing::Skewed => "skewed".into(),
            Routing::GroupLimited { groups, kept } => {
                format!("group-limited ({kept} of {groups} groups)")
            }
            Routing::Benched { seed, .. } => format!("uniform, as the bench drew it (seed {seed})"),
            Routing::Balanced => "balanced".into(),
        }
    }
}

/// Seed of the uniform draws: any fixed value; fixed so that two runs print the same.
const SEED: u64 = 0x6d6f_6566_6f72_6765;

/// The counts of one call.
#[derive(Clone, Debug)]
pub struct Traffic {
    pub ranks: u32,
    pub experts_per_rank: u32,
    pub tokens_per_rank: u32,
    pub top_k: u32,
    pub gpus_per_node: u32,
    /// `[source][expert]`: pairs of `source` routed to `expert`.
    pub pairs: Vec<u32>,
    /// `[source][destination]`: distinct tokens `source` sends to `destination` (a token
    /// with two experts there travels once).
    pub tokens: Vec<u32>,
    /// `[source][node]`: distinct tokens `source` sends to any rank of `node`.
    pub node_tokens: Vec<u32>,
}

impl Traffic {
    /// Draws the routing of `tokens_per_rank` tokens on each of `ranks` ranks.
    pub fn draw(
        routing: Routing,
        ranks: u32,
        experts: u32,
        top_k: u32,
        gpus_per_node: u32,
        tokens_per_rank: u32,
    ) -> Result<Self, SimError> {
        if top_k == 0 || top_k > experts || ranks == 0 || !experts.is_multiple_of(ranks) {
            return Err(SimError::Shape(format!(
                "{experts} experts, top_k {top_k}, {ranks} ranks: experts must split evenly over the ranks and top_k be between 1 and the experts"
            )));
        }
        if let Routing::GroupLimited { groups, kept } = routing
            && let Some(why) = Routing::group_limit_error(experts, top_k, groups, kept)
        {
            return Err(SimError::Shape(format!("group-limited routing: {why}")));
        }
        let (r, e) = (ranks as usize, experts as usize);
        let per_rank = experts / ranks;
        let nodes = ranks.div_ceil(gpus_per_node) as usize;
        let mut traffic = Traffic {
            ranks,
            experts_per_rank: per_rank,
            tokens_per_rank,
            top_k,
            gpus_per_node,
            pairs: vec![0; r * e],
            tokens: vec![0; r * r],
            node_tokens: vec![0; r * nodes],
        };
        let mut rng = SplitMix64::new(SEED);
        let mut chosen: Vec<u32> = Vec::with_capacity(top_k as usize);
        let mut kept_groups: Vec<u32> = Vec::new();
        let mut last_rank = vec![u32::MAX; r];
        let mut last_node = vec![u32::MAX; nodes];
        let all_experts: Vec<i32> = (0..experts as i32).collect();
        for source in 0..ranks {
            let benched = match routing {
                Routing::Benched { seed, hidden } => {
                    inputs::draw_call(
                        hidden,
                        tokens_per_rank,
                        top_k,
                        &all_experts,
                        None,
                        inputs::expert_parallel_rank_seed(seed, tokens_per_rank, source),
                        |_| {},
                    )
                    .topk_ids
                }
                _ => Vec::new(),
            };
            for token in 0..tokens_per_rank {
                chosen.clear();
                match routing {
                    Routing::Benched { .. } => {
                        let k = top_k as usize;
                        let first = token as usize * k;
                        chosen.extend(benched[first..first + k].iter().map(|&e| e as u32));
                    }
                    Routing::Skewed => chosen.extend(0..top_k),
                    Routing::Balanced => chosen.extend((0..top_k).map(|j| {
                        ((u64::from(token) * u64::from(top_k) + u64::from(j)) % u64::from(experts))
                            as u32
                    })),
                    Routing::Uniform => distinct(&mut rng, experts, top_k, &mut chosen),
                    Routing::GroupLimited { groups, kept } => {
                        // Kept groups, then top_k of their experts, numbered group by group.
                        let size = experts / groups;
                        distinct(&mut rng, groups, kept, &mut kept_groups);
                        distinct(&mut rng, kept * size, top_k, &mut chosen);
                        for expert in chosen.iter_mut() {
                            *expert =
                                kept_groups[(*expert / size) as usize] * size + *expert % size;
                        }
                    }
                }
                let stamp = source * tokens_per_rank + token;
                for &expert in &chosen {
                    traffic.pairs[source as usize * e + expert as usize] += 1;
                    let destination = expert / per_rank;
                    if last_rank[destination as usize] != stamp {
                        last_rank[destination as usize] = stamp;
                        traffic.tokens[source as usize * r + destination as usize] += 1;
                    }
                    let node = (destination / gpus_per_node) as usize;
                    if last_node[node] != stamp {
                        last_node[node] = stamp;
                        traffic.node_tokens[source as usize * nodes + node] += 1;
                    }
                }
            }
        }
        Ok(traffic)
    }

    pub fn nodes(&self) -> u32 {
        self.ranks.div_ceil(self.gpus_per_node)
    }

    pub fn node_of(&self, rank: u32) -> u32 {
        rank / self.gpus_per_node
    }

    /// Distinct tokens `source` sends to `destination`.
    pub fn tokens_to(&self, source: u32, destination: u32) -> u32 {
        self.tokens[(source * self.ranks + destination) as usize]
    }

    /// Distinct tokens `source` sends to the ranks of `node`.
    pub fn tokens_to_node(&self, source: u32, node: u32) -> u32 {
        self.node_tokens[(source * self.nodes() + node) as usize]
    }

    /// Pairs of `source` for local expert `local` of `destination`.
    pub fn pairs_to(&self, source: u32, destination: u32, local: u32) -> u32 {
        let expert = destination * self.experts_per_rank + local;
        self.pairs[(source * self.ranks * self.experts_per_rank + expert) as usize]
    }

    /// Pairs of `source` for any expert of `destination`.
    pub fn pairs_to_rank(&self, source: u32, destination: u32) -> u64 {
        (0..self.experts_per_rank)
            .map(|local| u64::from(self.pairs_to(source, destination, local)))
            .sum()
    }
}

/// `count` distinct values of `0..n` into `out` (cleared first), uniformly at random:
/// Floyd's algorithm, `count` draws.
fn distinct(rng: &mut SplitMix64, n: u32, count: u32, out: &mut Vec<u32>) {
    out.clear();
    for j in n - count..n {
        let t = (rng.next_u64() % u64::from(j + 1)) as u32;
        out.push(if out.contains(&t) { j } else { t });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a rank per group, a token of group-limited routing reaches at most `kept`
    /// ranks, and every token still has its `top_k` pairs.
    #[test]
    fn group_limited_tokens_reach_at_most_their_kept_groups() {
        let (ranks, tokens, top_k) = (8u32, 500u32, 8u32);
        let routing = Routing::GroupLimited { groups: 8, kept: 2 };
        let traffic = Traffic::draw(routing, ranks, 64, top_k, 8, tokens).expect("draws");
        for source in 0..ranks {
            let reached: u32 = (0..ranks).map(|d| traffic.tokens_to(source, d)).sum();
            let pairs: u64 = (0..ranks).map(|d| traffic.pairs_to_rank(source, d)).sum();
            assert!(reached >= tokens && reached <= 2 * tokens, "{reached}");
            assert_eq!(pairs, u64::from(tokens * top_k));
        }
        // Uniform routing over the same experts reaches far more ranks per token.
        let uniform = Traffic::draw(Routing::Uniform, ranks, 64, top_k, 8, tokens).expect("draws");
        let reached: u32 = (0..ranks).map(|d| uniform.tokens_to(0, d)).sum();
        assert!(reached > 4 * tokens, "{reached}");
    }

    /// Balanced routing gives every expert the same rows of each source (T·K/E where E
    /// divides T·K), and a token's pairs distinct experts.
    #[test]
    fn balanced_routing_fills_every_expert_alike() {
        let (ranks, experts, top_k, tokens) = (2u32, 16u32, 4u32, 100u32);
        let traffic =
            Traffic::draw(Routing::Balanced, ranks, experts, top_k, 2, tokens).expect("draws");
        for source in 0..ranks {
            for expert in 0..experts {
                assert_eq!(traffic.pairs[(source * experts + expert) as usize], 25);
            }
            // A token's four experts start at a multiple of 4: one rank holds them all.
            let reached: u32 = (0..ranks).map(|d| traffic.tokens_to(source, d)).sum();
            assert_eq!(reached, tokens);
        }
    }

    #[test]
    fn group_limits_that_cannot_hold_top_k_are_refused() {
        for (groups, kept) in [(0, 1), (7, 2), (8, 0), (8, 9), (8, 1)] {
            let routing = Routing::GroupLimited { groups, kept };
            assert!(
                Traffic::draw(routing, 8, 64, 16, 8, 10).is_err(),
                "{groups} groups, {kept} kept"
            );
        }
    }
}
