//! What a device holds for a plan (the weights of the experts it runs and the workspace
//! buffers) against the target's memory, and, for a layer that does not fit, the largest
//! `max_tokens` that would: most buffers grow with it.

use super::ep::Placement;
use super::{Buffer, BufferId, Plan, PlanError, Target};

/// The share of a target's memory a plan may fill: the rest holds the CUDA context, the
/// caller's inputs and outputs, and NCCL's own buffers across nodes.
pub const USABLE_MEMORY_SHARE: f64 = 0.95;

/// What a plan may fill of `target`'s memory: its [`USABLE_MEMORY_SHARE`].
pub fn usable_bytes(target: &Target) -> u64 {
    (target.memory_bytes as f64 * USABLE_MEMORY_SHARE) as u64
}

/// Bytes one GPU, or one rank, holds.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryUse {
    /// Its experts' W1 and W2 (and their biases), and the router's gate where there is one.
    pub weights: u64,
    pub workspace: u64,
    /// The largest workspace buffers, largest first (at most [`LARGEST_LISTED`]).
    pub largest: Vec<(BufferId, u64)>,
}

/// How many of the largest buffers a [`MemoryUse`] lists.
pub const LARGEST_LISTED: usize = 3;

impl MemoryUse {
    fn of(plan: &Plan, experts: u32, buffers: &[Buffer]) -> Self {
        let shape = &plan.shape;
        let (w1_rows, hidden, ffn) = (
            u64::from(shape.w1_rows()),
            u64::from(shape.hidden),
            u64::from(shape.ffn),
        );
        let bias_bytes = if shape.expert_bias {
            (w1_rows + hidden) * 4
        } else {
            0
        };
        let expert_bytes = (w1_rows * hidden + hidden * ffn) * 2 + bias_bytes;
        let gate_bytes = plan
            .router
            .as_ref()
            .map_or(0, |_| u64::from(shape.experts) * hidden * 2);
        let mut largest: Vec<(BufferId, u64)> = buffers.iter().map(|b| (b.id, b.bytes())).collect();
        largest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.name().cmp(b.0.name())));
        largest.truncate(LARGEST_LISTED);
        MemoryUse {
            weights: u64::from(experts) * expert_bytes + gate_bytes,
            workspace: buffers.iter().map(Buffer::bytes).sum(),
            largest,
        }
    }

    pub fn total(&self) -> u64 {
        self.weights + self.workspace
    }
}

/// What a plan's devices hold.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceMemory {
    /// The single-GPU path: every expert on one GPU.
    pub one_gpu: MemoryUse,
    /// The expert-parallel path: one rank (its routed experts and the shared slices).
    pub per_rank: Option<MemoryUse>,
    /// Ranks that share one device (all of them for virtual ranks, else one).
    pub ranks_per_device: u32,
}

impl DeviceMemory {
    pub fn of(plan: &Plan) -> Self {
        DeviceMemory {
            one_gpu: MemoryUse::of(plan, plan.shape.gemm_experts(), &plan.workspace),
            per_rank: plan.expert_parallel.as_ref().map(|ep| {
                MemoryUse::of(
                    plan,
                    ep.experts_per_rank + plan.shape.shared_slices,
                    &ep.workspace,
                )
            }),
            ranks_per_device: plan.expert_parallel.as_ref().map_or(1, |ep| {
                if ep.placement == Placement::Virtual {
                    ep.ranks
                } else {
                    1
                }
            }),
        }
    }

    /// What the path the spec asks for needs on one device: its ranks there where it has
    /// an expert-parallel part, else the single-GPU path.
    pub fn per_device(&self) -> u64 {
        match &self.per_rank {
            Some(rank) => rank.total() * u64::from(self.ranks_per_device),
            None => self.one_gpu.total(),
        }
    }
}

/// A plan whose devices cannot hold what it needs.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryProblem {
    /// "per rank" (expert-parallel, one rank per device), "per GPU" (virtual ranks or the
    /// single-GPU path).
    pub what: &'static str,
    pub needs: u64,
    /// The target's memory times [`USABLE_MEMORY_SHARE`].
    pub usable: u64,
    pub target: String,
    /// Ranks on one device (virtual ranks: all of them), each holding `holds`.
    pub ranks_per_device: u32,
    /// What one rank (or the one GPU) holds.
    pub holds: MemoryUse,
    /// The largest `max_tokens` whose plan fits; `None` where even one token's does not
    /// (the weights alone are too many).
    pub fits_max_tokens: Option<u32>,
}

impl std::fmt::Display for MemoryProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |bytes: u64| format!("{:.1} GB", bytes as f64 / 1e9);
        let largest = self
            .holds
            .largest
            .iter()
            .map(|(id, bytes)| format!("{} {}", id.name(), gb(*bytes)))
            .collect::<Vec<_>>()
            .join(", ");
        write!(
            f,
            "the plan needs {} {} and the {} leaves {} for it ({}experts {}, buffers {}, the largest {largest}): ",
            gb(self.needs),
            self.what,
            self.target,
            gb(self.usable),
            if self.ranks_per_device > 1 {
                format!("{} ranks on the GPU, each: ", self.ranks_per_device)
            } else {
                String::new()
            },
            gb(self.holds.weights),
            gb(self.holds.workspace),
        )?;
        match self.fits_max_tokens {
            Some(tokens) => write!(
                f,
                "allocating its buffers fails; they grow with max_tokens, and max_tokens = {tokens} fits"
            ),
            None => write!(
                f,
                "allocating fails even at one token; spread the experts over more ranks"
            ),
        }
    }
}

/// The largest `max_tokens` (below `max_tokens`, which needs `needs` bytes) whose plan needs
/// at most `usable` bytes, where `needs_at(t)` is what the plan of `t` tokens needs. A
/// plan's buffers grow about linearly with max_tokens (regimes and tiles change in steps),
/// so the line through `max_tokens` and half of it gives a first guess; a guess that does
/// not fit is scaled down by its overshoot until one does (few plans: planning thousands
/// of ranks takes a second). `None` where one token does not fit.
fn fitting_max_tokens(
    max_tokens: u32,
    needs: u64,
    usable: u64,
    needs_at: impl Fn(u32) -> Option<u64>,
) -> Option<u32> {
    const GUESSES: usize = 4;
    if max_tokens <= 1 {
        // No smaller max_tokens to try.
        return None;
    }
    let half = (max_tokens / 2).max(1);
    let needs_half = needs_at(half)?;
    let per_token = (needs as f64 - needs_half as f64) / f64::from(max_tokens - half).max(1.0);
    let mut guess = if needs_half <= usable && per_token > 0.0 {
        half + ((usable - needs_half) as f64 / per_token) as u32
    } else {
        (f64::from(half) * usable as f64 / needs_half as f64) as u32
    }
    .clamp(1, max_tokens - 1);
    for _ in 0..GUESSES {
        let need = needs_at(guess)?;
        if need <= usable {
            return Some(guess);
        }
        if guess == 1 {
            return None;
        }
        guess = ((f64::from(guess) * usable as f64 / need as f64) as u32).clamp(1, guess - 1);
    }
    (needs_at(guess)? <= usable).then_some(guess)
}

/// Whether `plan` fits its target's devices; `None` where it does (or the target's memory is
/// not known). `at_size(t)` plans the same layer with `max_tokens = t`.
pub fn memory_problem(
    plan: &Plan,
    at_size: impl Fn(u32) -> Result<Plan, PlanError>,
) -> Option<MemoryProblem> {
    let target = &plan.target;
    if target.memory_bytes == 0 {
        return None;
    }
    let usable = usable_bytes(target);
    let memory = DeviceMemory::of(plan);
    let needs = memory.per_device();
    if needs <= usable {
        return None;
    }
    let fits_max_tokens = fitting_max_tokens(plan.shape.max_tokens, needs, usable, |tokens| {
        at_size(tokens)
            .ok()
            .map(|plan| DeviceMemory::of(&plan).per_device())
    });
    let (what, holds) = match memory.per_rank {
        Some(rank) if memory.ranks_per_device == 1 => ("per rank", rank),
        Some(rank) => ("per GPU", rank),
        None => ("per GPU", memory.one_gpu),
    };
    Some(MemoryProblem {
        what,
        needs,
        usable,
        target: target.name.clone(),
        ranks_per_device: memory.ranks_per_device,
        holds,
        fits_max_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Target, plan};

    #[test]
    fn the_fitting_max_tokens_of_linear_and_stepped_needs() {
        // 1000 B fixed and 10 B per token: 400 tokens fill 5000 B exactly.
        let linear = |t: u32| Some(1000 + 10 * u64::from(t));
        assert_eq!(
            fitting_max_tokens(1024, linear(1024).unwrap(), 5000, linear),
            Some(400)
        );
        // A step of 2000 B past 300 tokens (another regime's buffers): the line through
        // 1024 and 512 overshoots, and the guess is scaled down until it fits.
        let stepped = |t: u32| Some(1000 + 10 * u64::from(t) + if t > 300 { 2000 } else { 0 });
        let fits = fitting_max_tokens(1024, stepped(1024).unwrap(), 5000, stepped).unwrap();
        assert!(fits <= 300 && stepped(fits).unwrap() <= 5000, "{fits}");
        // The weights alone overflow: nothing fits.
        let heavy = |t: u32| Some(6000 + u64::from(t));
        assert_eq!(
            fitting_max_tokens(1024, heavy(1024).unwrap(), 5000, heavy),
            None
        );
        // A layer of one token that does not fit has nothing smaller to try.
        assert_eq!(fitting_max_tokens(1, heavy(1).unwrap(), 5000, heavy), None);
    }

    /// DeepSeek-V3 on 64 ranks with 32768 tokens per rank needs more than an H200 per rank
    /// (GEMM2's rows of every source's tokens, kept for the partials, at capacity): the
    /// plan says so and how many tokens fit (16384 do: across nodes the outboxes and
    /// inboxes are per node, not per peer); the shipped example, at 4096, fits.
    #[test]
    fn a_plan_too_large_for_its_devices_says_what_fits() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../dsl-examples/deepseek_v3_ep64.moe"
        );
        let shipped = std::fs::read_to_string(path).expect("the example");
        let plan_of = |text: &str| {
            let module = crate::compile_source("ep64.moe", text).expect("checks");
            plan(&module.layers[0], &Target::h200()).expect("plans")
        };
        let fitting = plan_of(&shipped);
        assert!(DeviceMemory::of(&fitting).per_device() <= 134_000_000_000);
        assert!(
            !fitting.limitations.iter().any(|l| l.contains("allocating")),
            "{:?}",
            fitting.limitations
        );
        let large = plan_of(&shipped.replace("max_tokens = 4096", "max_tokens = 32768"));
        let note = large
            .limitations
            .iter()
            .find(|l| l.contains("allocating its buffers fails"))
            .expect("a note on memory");
        assert!(
            note.contains("per rank") && note.contains("pair_results"),
            "{note}"
        );
        let fits: u32 = note
            .rsplit("max_tokens = ")
            .next()
            .and_then(|tail| tail.split(' ').next())
            .and_then(|n| n.parse().ok())
            .expect("a token count");
        assert!((16384..32768).contains(&fits), "{note}");
    }
}
