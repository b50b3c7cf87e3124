//! Checking a `layer NAME { ... }` item into an [`ir::Layer`]: shapes, activation, dtypes,
//! shared experts, router, parallelism, topology reference and schedule hints, then the
//! rules that tie them together.

use std::collections::BTreeMap;

use crate::check::table::{Schema, Table};
use crate::check::{NamedTopology, values};
use crate::diagnostics::{Error, short, suggest};
use crate::front::ast::{Item, Section, Setting};
use crate::ir::{self, SIZE_ALIGNMENT};

/// `max_tokens` when the layer does not set it.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// Largest `hidden`, `ffn` and shared-expert `ffn` (2^20). With [`MAX_EXPERTS`] this keeps
/// every weight, buffer and FLOP count the later stages compute well inside `u64`.
pub const MAX_SIZE: u32 = 1 << 20;

/// Largest number of routed experts (2^16).
pub const MAX_EXPERTS: u32 = 1 << 16;

/// The keys of a `layer` item.
pub const LAYER: Schema = Schema {
    home: "the top level of a `layer` item",
    settings: &[
        "hidden",
        "ffn",
        "experts",
        "top_k",
        "activation",
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
    settings: &["count", "ffn"],
    sections: &[],
    aliases: &[],
};
/// The keys of `router { }`.
pub const ROUTER: Schema = Schema {
    home: "the layer's `router { }` section",
    settings: &["scoring", "groups", "groups_kept", "normalize", "scale"],
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
    ],
    sections: &[],
    aliases: &[],
};

const ACTIVATIONS: [(&str, ir::Activation); 5] = [
    ("swiglu", ir::Activation::Swiglu),
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
const SCORINGS: [(&str, ir::Scoring); 2] = [
    ("softmax", ir::Scoring::Softmax),
    ("sigmoid", ir::Scoring::Sigmoid),
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
        .and_then(|s| at_most(s, values::count(s, 1, false, errors)?, MAX_EXPERTS, errors));
    let top_k_setting = table.required("top_k", "top_k = 2", errors);
    let top_k = top_k_setting.and_then(|s| values::count(s, 1, false, errors));
    let activation = optional(table.setting("activation"), ir::Activation::Swiglu, |s| {
        values::choice(s, &ACTIVATIONS, "swiglu, geglu, gelu, relu, silu", errors)
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
        .required("topology", "topology = h200_node", errors)
        .and_then(|s| resolve_topology(s, topologies, errors));

    let shared_experts = match table.section("shared_experts") {
        Some(section) => {
            let table = Table::of_section(section, incomplete, &SHARED_EXPERTS, errors);
            let count = optional(table.setting("count"), 1, |s| {
                at_most(s, values::count(s, 1, false, errors)?, MAX_EXPERTS, errors)
            });
            let ffn = table
                .required("ffn", "ffn = 2048", errors)
                .and_then(|s| aligned_size(s, errors));
            Some(Some(ir::SharedExperts {
                count: count?,
                ffn: ffn?,
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
        .map(|section| schedule(section, incomplete, errors));

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
    Some(ir::Layer {
        name: item.name.text.clone(),
        hidden: hidden?,
        ffn: ffn?,
        experts: experts?,
        top_k: top_k?,
        activation: activation?,
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
    })
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
        values::choice(s, &SCORINGS, "softmax, sigmoid", errors)
    });
    let normalize = optional(table.setting("normalize"), true, |s| {
        values::boolean(s, errors)
    });
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
            let kept_setting =
                kept_setting.or_else(|| table.required("groups_kept", "groups_kept = 4", errors));
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
        group_limit: group_limit?,
        normalize: normalize?,
        scale: scale?,
    }))
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
    errors: &mut Vec<Error>,
) -> Option<ir::ScheduleHints> {
    let table = Table::of_section(section, incomplete, &SCHEDULE, errors);
    let read_count =
        |key: &str, tokens_allowed: bool, errors: &mut Vec<Error>| match table.setting(key) {
            Some(setting) => values::count(setting, 1, tokens_allowed, errors).map(Some),
            None => Some(None),
        };
    let gemm1_tile = table.setting("gemm1.tile").map(|s| values::tile(s, errors));
    let gemm2_tile = table.setting("gemm2.tile").map(|s| values::tile(s, errors));
    let stages = read_count("stages", false, errors);
    let dispatch_chunk = read_count("dispatch_chunk", true, errors);
    let comm_blocks = read_count("comm_blocks", false, errors);
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
    })
}
