//! Checking a `topology NAME { ... }` item into an [`ir::Topology`].

use crate::check::table::{Schema, Table};
use crate::check::values;
use crate::diagnostics::Error;
use crate::front::ast::Item;
use crate::ir;

/// The keys of a `topology` item.
/// GPUs per node when ranks span nodes: the kernels mark the ranks of a node a token
/// visits as bits of one u32 (its visit mask).
pub const MAX_GPUS_PER_NODE_ACROSS_NODES: u32 = 32;

pub const TOPOLOGY: Schema = Schema {
    home: "a `topology` item",
    settings: &[
        "gpus_per_node",
        "nodes",
        "nvlink",
        "network",
        "virtual_ranks",
    ],
    sections: &[],
    aliases: &[("intra_node", "nvlink")],
};

/// Checks one topology item; `None` when it has errors (all of them pushed to `errors`).
pub fn check_topology(
    item: &Item,
    incomplete: bool,
    errors: &mut Vec<Error>,
) -> Option<ir::Topology> {
    let what = format!("topology `{}`", item.name.text);
    let table = Table::new(
        what,
        item.name.span,
        incomplete,
        &item.body.entries,
        &TOPOLOGY,
        errors,
    );

    let gpus_per_node = table
        .required("gpus_per_node", "gpus_per_node = 8", errors)
        .and_then(|setting| values::count(setting, 1, false, errors));
    let nodes = match table.setting("nodes") {
        Some(setting) => values::count(setting, 1, false, errors),
        None => Some(1),
    };
    let intra_node = table
        .required("nvlink", "nvlink = 450 GB/s, 3 us", errors)
        .and_then(|setting| values::link(setting, errors));
    let network = table
        .required("network", "network = 50 GB/s, 10 us", errors)
        .and_then(|setting| values::link(setting, errors));
    let virtual_ranks = match table.setting("virtual_ranks") {
        Some(setting) => Some(values::count(setting, 1, false, errors)?),
        None => None,
    };

    let (gpus_per_node, nodes) = (gpus_per_node?, nodes?);
    let gpus = u64::from(gpus_per_node) * u64::from(nodes);
    // Virtual ranks share one GPU; a topology of one GPU per virtual rank emulates its
    // nodes there (their network steps become device copies).
    if let Some(setting) = table.setting("virtual_ranks")
        && gpus != 1
        && virtual_ranks.map(u64::from) != Some(gpus)
    {
        errors.push(Error::VirtualRanksNeedOneGpu {
            span: setting.span,
            topology: item.name.text.clone(),
            gpus,
        });
        return None;
    }
    if virtual_ranks.is_none() && u32::try_from(gpus).is_err() {
        errors.push(Error::TooManyRanks {
            span: item.name.span,
            topology: item.name.text.clone(),
        });
        return None;
    }
    if nodes > 1 && gpus_per_node > MAX_GPUS_PER_NODE_ACROSS_NODES {
        let span = table
            .setting("gpus_per_node")
            .map_or(item.name.span, |setting| setting.span);
        errors.push(Error::TooManyGpusPerNode {
            span,
            topology: item.name.text.clone(),
            gpus_per_node,
        });
        return None;
    }
    Some(ir::Topology {
        name: item.name.text.clone(),
        gpus_per_node,
        nodes,
        intra_node: intra_node?,
        network: network?,
        virtual_ranks,
    })
}
