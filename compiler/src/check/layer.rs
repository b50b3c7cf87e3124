//! Checking a `layer NAME { ... }` item into an [`ir::Layer`]: shapes, activation, dtypes,
//! shared experts, router, parallelism, topology reference and schedule hints, then the
//! rules that tie them together, and last the planner's verdict on the schedule hints.

use std::collections::BTreeMap;

use crate::check::table::{Schema, Table};
use crate::check::{NamedTopology, values};
use crate::diagnostics::{Error, short, suggest};
use crate::front::ast::{Item, Section, Setting, Span};
use crate::ir::{self, SIZE_ALIGNMENT, TileShape};
use crate::plan::{self, HintKey, HintProblem, Target};

/// `max_tokens` when the layer does not set it.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// Largest `hidden`, `ffn` and shared-expert `ffn` (2^20). With at most
/// [`plan::MAX_EXPERTS`] routed and [`MAX_SHARED_EXPERTS`] shared experts this keeps every
/// weight, buffer and FLOP count the later stages compute well inside `u64`.
pub const MAX_SIZE: u32 = 1 << 20;

/// Largest number of shared experts (2^16). They are not routed, so the routing kernel's
/// limit on experts does not apply to them.
pub const MAX_SHARED_EXPERTS: u32 = 1 << 16;

/// Most (token, k) pairs one call may hold, `max_tokens × top_k`: the kernels index pairs,
/// row offsets and `expert_offsets` as 32-bit `int` (they multiply rows by widths in 64 bits).
pub use crate::plan::MAX_PAIRS;

/// The keys of a `layer` item.
pub const LAYER: Schema = Schema {
    home: "the top level of a `layer` item",
    settings: &[
        "hidden",
        "ffn",
        "experts",
        "top_k",
        "activation",
        "expert_bias",
        "dtype",
        "weight_dtype",
        "max_tokens",
        "topology",
    ],
    sections: &["shared_experts", "router", "parallel", "schedule"],
    aliases: &[],
};
/// The keys of `shared_experts { }`.
pub const SHARED_EXPERTS: Schema = Schema {
    home: "the layer's `shared_experts { }` section",
    settings: &["count", "ffn", "gated"],
    sections: &[],
    aliases: &[],
};
/// The keys of `router { }`.
pub const ROUTER: Schema = Schema {
    home: "the layer's `router { }` section",
    settings: &[
        "scoring",
        "bias",
        "groups",
        "groups_kept",
        "normalize",
        "scale",
    ],
    sections: &[],
    aliases: &[],
};
/// The keys of `parallel { }`.
pub const PARALLEL: Schema = Schema {
    home: "the layer's `parallel { }` section",
    settings: &["expert", "data", "tensor"],
    sections: &[],
    aliases: &[],
};
/// The keys of `schedule { }`.
pub const SCHEDULE: Schema = Schema {
    home: "the layer's `schedule { }` section",
    settings: &[
        "gemm1.tile",
        "gemm2.tile",
        "stages",
        "dispatch_chunk",
        "comm_blocks",
        "traffic",
        "fused_decode",
        "flag_timeout",
        "whole_chunks",
    ],
    sections: &[],
    aliases: &[],
};

const ACTIVATIONS: [(&str, ir::Activation); 6] = [
    ("swiglu", ir::Activation::Swiglu),
    ("clamped_swiglu", ir::Activation::ClampedSwiglu),
    ("geglu", ir::Activation::Geglu),
    ("gelu", ir::Activation::Gelu),
    ("relu", ir::Activation::Relu),
    ("silu", ir::Activation::Silu),
];
const DTYPES: [(&str, ir::DType); 3] = [
    ("bf16", ir::DType::Bf16),
    ("fp8", ir::DType::Fp8E4m3),
    ("fp8_e4m3", ir::DType::Fp8E4m3),
];
const SCORINGS: [(&str, ir::Scoring); 3] = [
    ("softmax", ir::Scoring::Softmax),
    ("sigmoid", ir::Scoring::Sigmoid),
    ("topk_softmax", ir::Scoring::TopkSoftmax),
];
const ROUTER_BIASES: [(&str, ir::RouterBias); 3] = [
    ("none", ir::RouterBias::None),
    ("logits", ir::RouterBias::Logits),
    ("score_correction", ir::RouterBias::ScoreCorrection),
];
const TRAFFIC_ORDERS: [(&str, ir::TrafficOrder); 3] = [
    ("nearest_first", ir::TrafficOrder::NearestFirst),
    ("rotate", ir::TrafficOrder::Rotate),
    ("hierarchical", ir::TrafficOrder::Hierarchical),
];

/// Checks one layer item; `None` when it has errors (all of them pushed to `errors`).
pub fn check_layer(
    item: &Item,
    incomplete: bool,
    topologies: &BTreeMap<&str, NamedTopology>,
    target: &Target,
    errors: &mut Vec<Error>,
) -> Option<ir::Layer> {
    let what = format!("layer `{}`", item.name.text);
    let table = Table::new(
        what,
        item.name.span,
        incomplete,
        &item.body.entries,
        &LAYER,
        errors,
    );
    let errors_before = errors.len();

    let hidden = table
        .required("hidden", "hidden = 4096", errors)
        .and_then(|s| aligned_size(s, errors));
    let ffn = table
        .required("ffn", "ffn = 14336", errors)
        .and_then(|s| aligned_size(s, errors));
    let experts = table
        .required("experts", "experts = 8", errors)
        .and_then(|s| routed_experts(s, errors));
    let top_k_setting = table.required("top_k", "top_k = 2", errors);
    let top_k = top_k_setting.and_then(|s| values::count(s, 1, false, errors));
    let activation = optional(table.setting("activation"), ir::Activation::Swiglu, |s| {
        values::choice(
            s,
            &ACTIVATIONS,
            "swiglu, clamped_swiglu, geglu, gelu, relu, silu",
            errors,
        )
    });
    let expert_bias = optional(table.setting("expert_bias"), false, |s| {
        values::boolean(s, errors)
    });
    let dtype = optional(table.setting("dtype"), ir::DType::Bf16, |s| {
        read_dtype(s, "fp8 activations", errors)
    });
    let weight_dtype = optional(table.setting("weight_dtype"), ir::DType::Bf16, |s| {
        read_dtype(s, "fp8 expert weights", errors)
    });
    let max_tokens = optional(table.setting("max_tokens"), DEFAULT_MAX_TOKENS, |s| {
        values::count(s, 1, true, errors)
    });
    let topology = table
        .required("topology", topology_example(topologies), errors)
        .and_then(|s| resolve_topology(s, topologies, errors));

    let mut shared_ffn_span = None;
    let shared_experts = match table.section("shared_experts") {
        Some(section) => {
            let table = Table::of_section(section, incomplete, &SHARED_EXPERTS, errors);
            let count = optional(table.setting("count"), 1, |s| {
                at_most(
                    s,
                    values::count(s, 1, false, errors)?,
                    MAX_SHARED_EXPERTS,
                    errors,
                )
            });
            let ffn_setting = table.required("ffn", "ffn = 2048", errors);
            let ffn = ffn_setting.and_then(|s| aligned_size(s, errors));
            shared_ffn_span = ffn_setting.map(|s| s.values[0].span);
            let gated = optional(table.setting("gated"), false, |s| {
                values::boolean(s, errors)
            });
            Some(Some(ir::SharedExperts {
                count: count?,
                ffn: ffn?,
                gated: gated?,
            }))
        }
        None => Some(None),
    };

    let router = match table.section("router") {
        Some(section) => router(section, incomplete, experts, top_k, top_k_setting, errors),
        None => Some(None),
    };

    let (parallel, degree_setting) = match table.section("parallel") {
        Some(section) => {
            let table = Table::of_section(section, incomplete, &PARALLEL, errors);
            let expert = table
                .setting("expert")
                .map(|s| values::count(s, 1, false, errors));
            let data = unsupported_degree(table.setting("data"), "data parallelism", errors);
            let tensor = unsupported_degree(table.setting("tensor"), "tensor parallelism", errors);
            (Some((expert, data, tensor)), table.setting("expert"))
        }
        None => (Some((None, Some(1), Some(1))), None),
    };

    let schedule = table
        .section("schedule")
        .map(|section| schedule(section, incomplete, max_tokens, errors));

    // Rules across settings, checked only when their inputs are valid.
    if let (Some(experts), Some(top_k), Some(setting)) = (experts, top_k, top_k_setting)
        && top_k > experts
    {
        errors.push(Error::TopKOutOfRange {
            span: setting.values[0].span,
            top_k,
            experts,
        });
    }
    if let (Some(max_tokens), Some(top_k), Some(top_k_setting)) = (max_tokens, top_k, top_k_setting)
        && u64::from(max_tokens) * u64::from(top_k) > MAX_PAIRS
    {
        errors.push(Error::TooManyPairs {
            // The default max_tokens times the largest top_k fits: it was written.
            span: table
                .setting("max_tokens")
                .map_or(item.name.span, |s| s.values[0].span),
            max_tokens,
            top_k,
            top_k_span: top_k_setting.values[0].span,
            max_pairs: MAX_PAIRS,
        });
    }
    if let (Some(Some(shared)), Some(routed_ffn), Some(span)) =
        (shared_experts, ffn, shared_ffn_span)
    {
        let total = u64::from(shared.count) * u64::from(shared.ffn);
        let slices = total / u64::from(routed_ffn);
        if !total.is_multiple_of(u64::from(routed_ffn)) {
            errors.push(Error::SharedExpertsNotSlices {
                span,
                count: shared.count,
                ffn: shared.ffn,
                routed_ffn,
                routed_span: table
                    .setting("ffn")
                    .map_or(item.name.span, |s| s.values[0].span),
            });
        } else if slices > u64::from(plan::MAX_SHARED_SLICES) {
            errors.push(Error::TooManySharedSlices {
                span,
                count: shared.count,
                ffn: shared.ffn,
                routed_ffn,
                slices,
                max: plan::MAX_SHARED_SLICES,
            });
        }
    }
    let topology = topology?;
    let (expert, data, tensor) = parallel?;
    let expert = match expert {
        Some(written) => written?,
        None => topology.ranks(),
    };
    // A degree left out defaults to the topology's ranks: point there.
    let degree_span = match degree_setting {
        Some(setting) => setting.values[0].span,
        None => topologies
            .get(topology.name.as_str())
            .map_or(item.name.span, |named| named.name_span),
    };
    if let (Some(experts), Some(setting)) = (experts, table.setting("experts"))
        && experts % expert != 0
    {
        errors.push(Error::ExpertsNotDivisible {
            span: setting.values[0].span,
            experts,
            degree: expert,
            degree_span,
        });
    }
    if expert != topology.ranks()
        && let Some(named) = topologies.get(topology.name.as_str())
    {
        errors.push(Error::RanksMismatch {
            span: degree_span,
            degree: expert,
            ranks: topology.ranks(),
            topology: topology.name.clone(),
            topology_span: named.name_span,
        });
    }

    if errors.len() > errors_before {
        return None;
    }
    let layer = ir::Layer {
        name: item.name.text.clone(),
        hidden: hidden?,
        ffn: ffn?,
        experts: experts?,
        top_k: top_k?,
        activation: activation?,
        expert_bias: expert_bias?,
        dtype: dtype?,
        weight_dtype: weight_dtype?,
        max_tokens: max_tokens?,
        shared_experts: shared_experts?,
        router: router?,
        parallel: ir::Parallelism {
            expert,
            data: data?,
            tensor: tensor?,
        },
        topology,
        schedule: schedule.unwrap_or(Some(ir::ScheduleHints::default()))?,
    };
    // Only a valid layer can be planned; the planner holds the rules about hints.
    let mut hint_errors =
        infeasible_hints(&layer, table.section("schedule"), item.name.span, target);
    if hint_errors.is_empty()
        && let Err(refusal) = plan::ep::ranks_fit(&layer, target)
    {
        // At the ranks where the layer sets them, else at its name.
        let span = table
            .section("parallel")
            .and_then(|section| section.settings.iter().find(|s| s.key.dotted() == "expert"))
            .map_or(item.name.span, |setting| setting.values[0].span);
        hint_errors.push(Error::PlanRefused {
            span,
            message: refusal.to_string(),
            hint: refusal.advice().unwrap_or_default(),
            hint_span: None,
        });
    }
    if hint_errors.is_empty() {
        Some(layer)
    } else {
        errors.extend(hint_errors);
        None
    }
}

/// Routed experts: at least one, at most what the routing kernel holds.
fn routed_experts(setting: &Setting, errors: &mut Vec<Error>) -> Option<u32> {
    let experts = values::count(setting, 1, false, errors)?;
    if experts > plan::MAX_EXPERTS {
        errors.push(Error::TooManyExperts {
            span: setting.values[0].span,
            value: experts,
            max: plan::MAX_EXPERTS,
        });
        return None;
    }
    Some(experts)
}

/// `topology = NAME` for the missing-key hint: a topology of the file (the first by name),
/// else one to write, with its definition.
fn topology_example(topologies: &BTreeMap<&str, NamedTopology>) -> String {
    match topologies.keys().next() {
        Some(name) => format!("topology = {name}"),
        // The hint quotes the example in backticks: this one closes and reopens them
        // around the words between the key and the definition.
        None => "topology = one_gpu` and define it: `topology one_gpu { gpus_per_node = 1 \
                 intra_node = 450 GB/s, 3 us network = 50 GB/s, 10 us }"
            .to_string(),
    }
}

/// The schedule hints of a valid layer that the planner refuses on `target`, one error per
/// hint key, at the hint's value, each with a suggestion the planner accepts there.
fn infeasible_hints(
    layer: &ir::Layer,
    schedule: Option<&Section>,
    fallback: Span,
    target: &Target,
) -> Vec<Error> {
    let mut by_key: Vec<(HintKey, Vec<HintProblem>)> = Vec::new();
    for problem in plan::hint_problems(layer, target) {
        match by_key.iter_mut().find(|(key, _)| *key == problem.key) {
            Some((_, problems)) => problems.push(problem),
            None => by_key.push((problem.key, vec![problem])),
        }
    }
    by_key
        .into_iter()
        .map(|(key, problems)| {
            let span = schedule
                .and_then(|section| {
                    section
                        .settings
                        .iter()
                        .find(|setting| setting.key.dotted() == key.name())
                })
                .map_or(fallback, |setting| setting.values[0].span);
            let reasons: Vec<&str> = problems.iter().map(|p| p.reason.as_str()).collect();
            Error::InfeasibleHint {
                span,
                setting: problems[0].hint.clone(),
                target: target.name.clone(),
                reason: reasons.join("; "),
                suggestion: hint_suggestion(layer, key, target),
            }
        })
        .collect()
}

/// What would work instead of `layer`'s hint `key`, which the planner refuses on `target`:
/// found by asking the planner about nearby hints.
pub fn hint_suggestion(layer: &ir::Layer, key: HintKey, target: &Target) -> String {
    match key {
        HintKey::Stages => stages_suggestion(layer, target),
        HintKey::Gemm1Tile | HintKey::Gemm2Tile => tile_suggestion(layer, key, target),
        HintKey::CommBlocks => comm_blocks_suggestion(layer, target),
    }
}

/// The tile dimensions a suggestion is drawn from: the usual tile sizes (powers of two, and
/// three times them) up to 256. Not a rule, the planner's [`plan::hint_problems`] decides
/// what fits: a small space, because a refused hint may try every tile in it.
const SUGGESTED_TILE_SIZES: [u32; 8] = [16, 32, 48, 64, 96, 128, 192, 256];

/// The tile hint of `key` (`None` for `stages`).
fn hinted_tile(layer: &ir::Layer, key: HintKey) -> Option<TileShape> {
    match key {
        HintKey::Gemm1Tile => layer.schedule.gemm1_tile,
        HintKey::Gemm2Tile => layer.schedule.gemm2_tile,
        HintKey::Stages | HintKey::CommBlocks => None,
    }
}

/// Sets the tile hint of `key` (nothing for `stages`).
fn set_tile(layer: &mut ir::Layer, key: HintKey, tile: TileShape) {
    match key {
        HintKey::Gemm1Tile => layer.schedule.gemm1_tile = Some(tile),
        HintKey::Gemm2Tile => layer.schedule.gemm2_tile = Some(tile),
        HintKey::Stages | HintKey::CommBlocks => {}
    }
}

/// Stage counts in words: "2", "2 to 5", "2, 4 to 8" (`counts` ascending, not empty).
fn describe_counts(counts: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &count in counts {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == count => *last = count,
            _ => runs.push((count, count)),
        }
    }
    let runs: Vec<String> = runs
        .into_iter()
        .map(|(first, last)| {
            if first == last {
                first.to_string()
            } else {
                format!("{first} to {last}")
            }
        })
        .collect();
    runs.join(", ")
}

/// For a refused tile hint: the nearest tile the planner accepts with the other hints as
/// written, and the stage counts that would make the written tile fit.
fn tile_suggestion(layer: &ir::Layer, key: HintKey, target: &Target) -> String {
    let accepted = |candidate: &ir::Layer| {
        plan::hint_problems(candidate, target)
            .iter()
            .all(|problem| problem.key != key)
    };
    let remove = format!("or remove `{}` and let the planner choose", key.name());
    let Some(written) = hinted_tile(layer, key) else {
        return remove;
    };
    let sizes = || SUGGESTED_TILE_SIZES.into_iter();
    let mut candidates: Vec<TileShape> = sizes()
        .flat_map(|m| sizes().flat_map(move |n| sizes().map(move |k| TileShape { m, n, k })))
        .collect();
    // Nearest first; among equals the smaller tile, which needs less shared memory.
    candidates.sort_by_key(|tile| {
        (
            tile.m.abs_diff(written.m) + tile.n.abs_diff(written.n) + tile.k.abs_diff(written.k),
            tile.m * tile.n * tile.k,
            (tile.m, tile.n, tile.k),
        )
    });
    // One copy of the layer, its hint rewritten per candidate: thousands may be tried.
    let mut candidate = layer.clone();
    let nearest_tile = candidates.into_iter().find(|&tile| {
        set_tile(&mut candidate, key, tile);
        accepted(&candidate)
    });
    let mut candidate = layer.clone();
    let fitting_stages: Vec<u32> = stage_range()
        .filter(|&stages| {
            candidate.schedule.stages = Some(stages);
            accepted(&candidate)
        })
        .collect();
    let mut ways = Vec::new();
    if let Some(tile) = nearest_tile {
        ways.push(format!(
            "`{} = {}x{}x{}` is the nearest tile the planner accepts here",
            key.name(),
            tile.m,
            tile.n,
            tile.k
        ));
    }
    if !fitting_stages.is_empty() {
        ways.push(format!(
            "keeping this tile, `stages` may be {}",
            describe_counts(&fitting_stages)
        ));
    }
    ways.push(remove);
    ways.join("; ")
}

/// For a refused `stages` hint: the stage counts the planner accepts with the tile hints as
/// written.
fn stages_suggestion(layer: &ir::Layer, target: &Target) -> String {
    let mut candidate = layer.clone();
    let accepted: Vec<u32> = stage_range()
        .filter(|&stages| {
            candidate.schedule.stages = Some(stages);
            plan::hint_problems(&candidate, target).is_empty()
        })
        .collect();
    if accepted.is_empty() {
        format!(
            "no stage count from {} to {} works with the tile hints as written: change the \
             tiles, or remove `stages` and let the planner choose",
            plan::MIN_STAGES,
            plan::MAX_STAGES
        )
    } else {
        format!(
            "with these tiles `stages` may be {}; change it, or remove it and let the planner \
             choose",
            describe_counts(&accepted)
        )
    }
}

/// For a refused `comm_blocks`: the most the ranks leave room for.
fn comm_blocks_suggestion(layer: &ir::Layer, target: &Target) -> String {
    match plan::ep::most_comm_blocks(layer, target) {
        Some(most) if most >= 1 => {
            format!("use at most `comm_blocks = {most}`, or remove it and let the planner choose")
        }
        _ => "remove `comm_blocks` and let the planner choose".to_string(),
    }
}

/// The stage counts a suggestion may offer: the planner's bounds.
fn stage_range() -> std::ops::RangeInclusive<u32> {
    plan::MIN_STAGES..=plan::MAX_STAGES
}

/// The setting's value if written (`None` inside if it is invalid), else the default.
fn optional<T>(
    setting: Option<&Setting>,
    default: T,
    read: impl FnOnce(&Setting) -> Option<T>,
) -> Option<T> {
    match setting {
        Some(setting) => read(setting),
        None => Some(default),
    }
}

/// `value`, or an error if it is above `max`.
fn at_most(setting: &Setting, value: u32, max: u32, errors: &mut Vec<Error>) -> Option<u32> {
    if value > max {
        errors.push(Error::AboveLimit {
            span: setting.values[0].span,
            key: setting.key.dotted(),
            value,
            max,
        });
        return None;
    }
    Some(value)
}

/// A size the kernels tile over: positive and a multiple of [`SIZE_ALIGNMENT`].
fn aligned_size(setting: &Setting, errors: &mut Vec<Error>) -> Option<u32> {
    let size = at_most(
        setting,
        values::count(setting, 1, false, errors)?,
        MAX_SIZE,
        errors,
    )?;
    if size % SIZE_ALIGNMENT != 0 {
        errors.push(Error::Misaligned {
            span: setting.values[0].span,
            key: setting.key.dotted(),
            value: size,
            alignment: SIZE_ALIGNMENT,
        });
        return None;
    }
    Some(size)
}

/// A dtype; only bf16 has kernels today, fp8 is reserved syntax.
fn read_dtype(setting: &Setting, fp8_use: &str, errors: &mut Vec<Error>) -> Option<ir::DType> {
    let dtype = values::choice(
        setting,
        &DTYPES,
        "bf16, fp8 (reserved), fp8_e4m3 (reserved)",
        errors,
    )?;
    if dtype == ir::DType::Fp8E4m3 {
        errors.push(Error::Unsupported {
            span: setting.values[0].span,
            what: format!(
                "{fp8_use} (`{} = {}`)",
                setting.key.dotted(),
                crate::front::format::format_value(&setting.values[0])
            ),
            hint: "use `bf16`; fp8 weights are planned, and the syntax is reserved for them",
        });
        return None;
    }
    Some(dtype)
}

/// The data or tensor degree: accepted, but only 1 today.
fn unsupported_degree(
    setting: Option<&Setting>,
    what: &str,
    errors: &mut Vec<Error>,
) -> Option<u32> {
    let Some(setting) = setting else {
        return Some(1);
    };
    let degree = values::count(setting, 1, false, errors)?;
    if degree != 1 {
        errors.push(Error::Unsupported {
            span: setting.values[0].span,
            what: format!("{what} of degree {degree}"),
            hint: "set it to 1 (or leave it out); only expert parallelism is implemented",
        });
        return None;
    }
    Some(1)
}

fn resolve_topology(
    setting: &Setting,
    topologies: &BTreeMap<&str, NamedTopology>,
    errors: &mut Vec<Error>,
) -> Option<ir::Topology> {
    let (name, span) = values::name(setting, errors)?;
    match topologies.get(name) {
        // A topology with errors has reported them; the layer just cannot use it.
        Some(named) => named.topology.clone(),
        None => {
            let known: Vec<&str> = topologies.keys().copied().collect();
            errors.push(Error::UnknownTopology {
                span,
                name: short(name),
                suggestion: suggest(name, known.iter().copied()),
                known: known.join(", "),
            });
            None
        }
    }
}

/// The router section. The outer `Option` is validity; the inner one is the router.
fn router(
    section: &Section,
    incomplete: bool,
    experts: Option<u32>,
    top_k: Option<u32>,
    top_k_setting: Option<&Setting>,
    errors: &mut Vec<Error>,
) -> Option<Option<ir::Router>> {
    let table = Table::of_section(section, incomplete, &ROUTER, errors);
    let scoring = optional(table.setting("scoring"), ir::Scoring::Softmax, |s| {
        values::choice(s, &SCORINGS, "softmax, sigmoid, topk_softmax", errors)
    });
    let bias = optional(table.setting("bias"), ir::RouterBias::None, |s| {
        values::choice(s, &ROUTER_BIASES, "none, logits, score_correction", errors)
    });
    // A softmax over the k chosen logits sums to one: renormalising it means nothing, so
    // a written `normalize` is refused rather than silently ignored.
    let normalize = match (table.setting("normalize"), scoring) {
        (Some(setting), Some(ir::Scoring::TopkSoftmax)) => {
            errors.push(Error::NormalizeWithTopkSoftmax {
                span: setting.key.span,
                scoring_span: table
                    .setting("scoring")
                    .map_or(setting.key.span, |s| s.values[0].span),
            });
            None
        }
        (_, Some(ir::Scoring::TopkSoftmax)) => Some(false),
        (setting, _) => optional(setting, true, |s| values::boolean(s, errors)),
    };
    let scale = optional(table.setting("scale"), 1.0, |s| {
        values::positive_f32(s, errors)
    });
    let group_limit = match (table.setting("groups"), table.setting("groups_kept")) {
        (None, None) => Some(None),
        (None, Some(kept)) => {
            errors.push(Error::GroupsKeptWithoutGroups {
                span: kept.key.span,
            });
            None
        }
        (Some(groups_setting), kept_setting) => {
            let groups = values::count(groups_setting, 1, false, errors);
            let example = format!(
                "groups_kept = {}",
                groups.map_or(4, |groups| kept_groups_example(groups, experts, top_k))
            );
            let kept_setting =
                kept_setting.or_else(|| table.required("groups_kept", example, errors));
            let kept = kept_setting.and_then(|s| values::count(s, 1, false, errors));
            group_limit(
                groups,
                groups_setting,
                kept,
                kept_setting,
                experts,
                top_k,
                top_k_setting,
                errors,
            )
        }
    };
    Some(Some(ir::Router {
        scoring: scoring?,
        bias: bias?,
        group_limit: group_limit?,
        normalize: normalize?,
        scale: scale?,
    }))
}

/// A `groups_kept` to suggest for `groups` groups: half of them, as DeepSeek-V3 keeps 4 of
/// 8, or more where fewer would hold fewer than `top_k` of the `experts`; at most all.
fn kept_groups_example(groups: u32, experts: Option<u32>, top_k: Option<u32>) -> u32 {
    let half = groups.div_ceil(2);
    let per_group = experts.map_or(1, |experts| (experts / groups).max(1));
    let enough = top_k.map_or(1, |top_k| top_k.div_ceil(per_group));
    half.max(enough).min(groups)
}

/// DeepSeek-V3 style group-limited routing: groups divide the experts, the kept groups are
/// between one and all, and they hold at least top_k experts.
#[allow(clippy::too_many_arguments)]
fn group_limit(
    groups: Option<u32>,
    groups_setting: &Setting,
    kept: Option<u32>,
    kept_setting: Option<&Setting>,
    experts: Option<u32>,
    top_k: Option<u32>,
    top_k_setting: Option<&Setting>,
    errors: &mut Vec<Error>,
) -> Option<Option<ir::GroupLimit>> {
    let groups = groups?;
    let mut valid = true;
    if let Some(experts) = experts
        && experts % groups != 0
    {
        errors.push(Error::GroupsDoNotDivideExperts {
            span: groups_setting.values[0].span,
            groups,
            experts,
        });
        valid = false;
    }
    let kept = kept?;
    let kept_span = kept_setting.map_or(groups_setting.span, |s| s.values[0].span);
    if kept > groups {
        errors.push(Error::GroupsKeptOutOfRange {
            span: kept_span,
            kept,
            groups,
        });
        valid = false;
    }
    if valid
        && let (Some(experts), Some(top_k), Some(top_k_setting)) = (experts, top_k, top_k_setting)
    {
        let eligible = (u64::from(kept) * u64::from(experts) / u64::from(groups)) as u32;
        if top_k > eligible && top_k <= experts {
            errors.push(Error::TopKExceedsKeptGroups {
                span: top_k_setting.values[0].span,
                top_k,
                eligible,
            });
            valid = false;
        }
    }
    valid.then_some(Some(ir::GroupLimit { groups, kept }))
}

fn schedule(
    section: &Section,
    incomplete: bool,
    max_tokens: Option<u32>,
    errors: &mut Vec<Error>,
) -> Option<ir::ScheduleHints> {
    let table = Table::of_section(section, incomplete, &SCHEDULE, errors);
    let read_count =
        |key: &str, min: u32, tokens_allowed: bool, errors: &mut Vec<Error>| match table
            .setting(key)
        {
            Some(setting) => values::count(setting, min, tokens_allowed, errors).map(Some),
            None => Some(None),
        };
    let gemm1_tile = table.setting("gemm1.tile").map(|s| values::tile(s, errors));
    let gemm2_tile = table.setting("gemm2.tile").map(|s| values::tile(s, errors));
    // Above the planner's most, `stages` is the planner's error (with the range).
    let stages = read_count("stages", plan::MIN_STAGES, false, errors);
    // A chunk of one call's tokens: at most max_tokens (the kernels size their chunks by it
    // as an `int`).
    let dispatch_chunk = match (
        read_count("dispatch_chunk", 1, true, errors),
        max_tokens,
        table.setting("dispatch_chunk"),
    ) {
        (Some(Some(value)), Some(max_tokens), Some(setting)) if value > max_tokens => {
            errors.push(Error::AboveMaxTokens {
                span: setting.values[0].span,
                key: "dispatch_chunk".to_string(),
                value,
                max_tokens,
            });
            None
        }
        (count, ..) => count,
    };
    let comm_blocks = read_count("comm_blocks", 1, false, errors);
    // Bounds on the calls they serve, so one above max_tokens serves every call. 0 turns the
    // fused decode off where the planner would choose it.
    let fused_decode = read_count("fused_decode", 0, true, errors);
    // 0: every call across nodes moves the routed rows (the host reads them back).
    let whole_chunks = read_count("whole_chunks", 0, true, errors);
    let flag_timeout_ns = match table.setting("flag_timeout") {
        Some(setting) => values::duration(setting, FLAG_TIMEOUT_RANGE, errors).map(Some),
        None => Some(None),
    };
    let traffic_order = table.setting("traffic").map(|s| {
        values::choice(
            s,
            &TRAFFIC_ORDERS,
            "nearest_first, rotate, hierarchical",
            errors,
        )
    });
    Some(ir::ScheduleHints {
        gemm1_tile: gemm1_tile.map_or(Some(None), |tile| tile.map(Some))?,
        gemm2_tile: gemm2_tile.map_or(Some(None), |tile| tile.map(Some))?,
        stages: stages?,
        dispatch_chunk: dispatch_chunk?,
        comm_blocks: comm_blocks?,
        traffic_order: traffic_order.map_or(Some(None), |order| order.map(Some))?,
        fused_decode: fused_decode?,
        flag_timeout_ns: flag_timeout_ns?,
        whole_chunks: whole_chunks?,
    })
}

/// The flag time-outs a spec may ask for: from 1 ms (a correct call waits microseconds
/// for a flag, a large one milliseconds) to an hour (a sanitizer slows kernels a
/// thousandfold).
const FLAG_TIMEOUT_RANGE: values::DurationRange = values::DurationRange {
    min_ns: 1_000_000,
    max_ns: 3_600_000_000_000,
    min: "1 ms",
    max: "3_600_000 ms (an hour)",
};

#[cfg(test)]
mod tests {
    use super::{describe_counts, kept_groups_example};

    /// The suggestion is itself valid: between one and all groups, holding top_k experts.
    #[test]
    fn a_suggested_groups_kept_is_in_range_and_holds_top_k() {
        assert_eq!(
            kept_groups_example(8, Some(256), Some(8)),
            4,
            "DeepSeek-V3's"
        );
        assert_eq!(kept_groups_example(3, Some(8), Some(2)), 2);
        assert_eq!(kept_groups_example(1, Some(8), Some(2)), 1);
        assert_eq!(kept_groups_example(8, Some(16), Some(8)), 4);
        assert_eq!(
            kept_groups_example(8, Some(16), Some(12)),
            6,
            "two experts a group"
        );
        assert_eq!(kept_groups_example(4, None, None), 2);
    }

    #[test]
    fn stage_counts_read_as_runs() {
        assert_eq!(describe_counts(&[3]), "3");
        assert_eq!(describe_counts(&[2, 3, 4, 5]), "2 to 5");
        assert_eq!(describe_counts(&[2, 4, 5, 6, 8]), "2, 4 to 6, 8");
    }
}
