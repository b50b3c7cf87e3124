//! The checker: lowers a parsed file into a validated [`ir::Module`], resolving units,
//! applying defaults, resolving topology names and enforcing every rule the kernels rely on.
//! [`table`] sorts keys, [`values`] reads values, [`topology`] and [`layer`] check items.
//!
//! Architecture invariant: the checker reports every error it can find in a file (it goes
//! on after each one) and returns a module only when there are none; a returned module
//! satisfies every rule documented in `docs/language.md`.

pub mod layer;
pub mod table;
pub mod topology;
pub mod values;

use std::collections::BTreeMap;

use crate::diagnostics::{Error, MAX_ERRORS, short, suggest};
use crate::front::ITEM_KINDS;
use crate::front::ast::{File, Item, Span};
use crate::ir;
use crate::plan::Target;
use table::Schema;

/// Every item and section of the language, so that a key written in the wrong one can be
/// told where it belongs.
pub const SCHEMAS: [&Schema; 6] = [
    &topology::TOPOLOGY,
    &layer::LAYER,
    &layer::SHARED_EXPERTS,
    &layer::ROUTER,
    &layer::PARALLEL,
    &layer::SCHEDULE,
];

/// A topology as layers see it while checking: where it is named, and its checked form
/// (`None` if it had errors, which are already reported).
pub struct NamedTopology {
    pub name_span: Span,
    pub topology: Option<ir::Topology>,
}

/// Checks a parsed file. `syntax_errors` are the spans of the parser's errors: items that
/// contain one are checked too, but without "missing key" errors (the key may just have
/// failed to parse). Schedule hints and ranks are checked against what the planner can do
/// on `target`.
pub fn check(
    file: &File,
    syntax_errors: &[Span],
    target: &Target,
) -> Result<ir::Module, Vec<Error>> {
    let mut errors = Vec::new();
    let incomplete = |item: &Item| {
        syntax_errors
            .iter()
            .any(|span| item.span.start <= span.start && span.start < item.span.end)
    };

    let mut first_definitions: BTreeMap<(&str, &str), Span> = BTreeMap::new();
    let mut unique_items = Vec::new();
    for item in &file.items {
        if errors.len() >= MAX_ERRORS {
            errors.push(Error::TooManyErrors { span: item.span });
            return Err(capped(errors));
        }
        let kind = item.kind.text.as_str();
        if !ITEM_KINDS.contains(&kind) {
            errors.push(Error::UnknownItemKind {
                span: item.kind.span,
                found: short(kind),
                suggestion: suggest(kind, ITEM_KINDS),
            });
            continue;
        }
        let kind: &'static str = if kind == "layer" { "layer" } else { "topology" };
        match first_definitions.get(&(kind, item.name.text.as_str())) {
            Some(first) => errors.push(Error::DuplicateItem {
                span: item.name.span,
                kind,
                name: short(&item.name.text),
                first: *first,
            }),
            None => {
                first_definitions.insert((kind, &item.name.text), item.name.span);
                unique_items.push((kind, item));
            }
        }
    }

    let mut topologies: BTreeMap<&str, NamedTopology> = BTreeMap::new();
    let mut checked_topologies = Vec::new();
    for (_, item) in unique_items.iter().filter(|(kind, _)| *kind == "topology") {
        if errors.len() >= MAX_ERRORS {
            errors.push(Error::TooManyErrors { span: item.span });
            return Err(capped(errors));
        }
        let topology = topology::check_topology(item, incomplete(item), &mut errors);
        if let Some(topology) = &topology {
            checked_topologies.push(topology.clone());
        }
        topologies.insert(
            &item.name.text,
            NamedTopology {
                name_span: item.name.span,
                topology,
            },
        );
    }

    let mut layers = Vec::new();
    for (_, item) in unique_items.iter().filter(|(kind, _)| *kind == "layer") {
        if errors.len() >= MAX_ERRORS {
            errors.push(Error::TooManyErrors { span: item.span });
            break;
        }
        if let Some(layer) =
            layer::check_layer(item, incomplete(item), &topologies, target, &mut errors)
        {
            layers.push(layer);
        }
    }

    if errors.is_empty() {
        Ok(ir::Module {
            topologies: checked_topologies,
            layers,
        })
    } else {
        Err(capped(errors))
    }
}

/// `errors` in file order, at most [`MAX_ERRORS`] of them: one item can hold more than the
/// cap (a layer of 5000 unknown keys), so the first MAX_ERRORS stand, then one error, at
/// the first left out (or where checking stopped), says the rest were not listed.
fn capped(mut errors: Vec<Error>) -> Vec<Error> {
    errors.sort_by_key(|error| error.span().start);
    let stopped = errors.iter().find_map(|error| match error {
        Error::TooManyErrors { span } => Some(*span),
        _ => None,
    });
    errors.retain(|error| !matches!(error, Error::TooManyErrors { .. }));
    let first_left_out = errors.get(MAX_ERRORS).map(Error::span).or(stopped);
    if let Some(span) = first_left_out {
        errors.truncate(MAX_ERRORS);
        errors.push(Error::TooManyErrors { span });
    }
    errors
}
