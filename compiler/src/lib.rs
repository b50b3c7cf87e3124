//! moeforge's compiler: turns an MoE layer description into a plan and CUDA source.
//!
//! The stages, each in its own module with a typed boundary:
//! - [`front`]: `.moe` text to a syntax tree (lexer, grammar, AST, canonical printer).
//! - [`check`]: syntax tree to a validated [`ir::Module`] (units, defaults, rules).
//! - [`diagnostics`]: the typed errors of both, with spans, hints and rendering.
//! - [`ir`]: the checked layer (the checker's output, every later stage's input).
//! - [`plan`]: tiles, regimes, buffers and the launch table, chosen by a cost model.
//! - [`simulate`]: a discrete-event model of a plan's expert-parallel schedule.
//! - [`inputs`]: the seeded draws of a call's inputs, shared with the runtime.
//! - [`codegen`]: the plan written out as one CUDA C++ unit.
//!
//! Entry points: [`compile_source`] (text to checked module), [`parse`] (text to syntax
//! tree), [`format_source`] (text to canonical text), [`plan_diagnostics`] (a planner error
//! shown like a checker error).
pub mod check;
pub mod codegen;
pub mod diagnostics;
pub mod front;
pub mod inputs;
pub mod ir;
pub mod plan;
pub mod simulate;

pub use diagnostics::{Diagnostics, Error};
pub use front::{Parsed, parse};

/// Checks a whole `.moe` file: lexes, parses and checks `text`, returning the validated
/// module (every topology and layer, defaults applied, units resolved) or every error found.
/// `name` is the file name shown in diagnostics. Schedule hints and ranks are checked for
/// the H200, the default target ([`compile_source_for`] takes another).
pub fn compile_source(name: &str, text: &str) -> Result<ir::Module, Diagnostics> {
    compile_source_for(name, text, &plan::Target::h200())
}

/// [`compile_source`], with the schedule hints and ranks checked against what the planner
/// can do on `target` rather than on the H200, the default target.
pub fn compile_source_for(
    name: &str,
    text: &str,
    target: &plan::Target,
) -> Result<ir::Module, Diagnostics> {
    let parsed = parse(text);
    let syntax_spans: Vec<_> = parsed.errors.iter().map(Error::span).collect();
    let mut errors = parsed.errors;
    // A number with a name set aside after it (`7k`, `3 s`) was read as the number alone:
    // what the checker says of that number (`hidden` = 7 is misaligned, a latency needs a
    // unit) follows from the error already reported there.
    let glued: Vec<_> = errors
        .iter()
        .filter(|error| {
            matches!(
                error,
                Error::NumberGluedToName { .. } | Error::UnknownUnit { .. }
            )
        })
        .map(Error::span)
        .collect();
    // A number before an invalid character on its line (`3 µs`), or before a word that is
    // no unit (`3 uss`), was kept without the unit the character or word broke: its missing
    // unit follows from that error.
    let invalid_starts: Vec<usize> = errors
        .iter()
        .filter_map(|error| match error {
            Error::InvalidCharacter { span, .. } | Error::StrayWord { span, .. } => {
                Some(span.start)
            }
            _ => None,
        })
        .collect();
    let unit_broken = |error: &Error| {
        let Error::MissingUnit { span, .. } = error else {
            return false;
        };
        let after = &text[span.end..];
        let next = span.end + after.len() - after.trim_start_matches([' ', '\t']).len();
        invalid_starts.contains(&next)
    };
    // A `,` that ended a line ran the next setting's key into the values before it: what
    // the checker says of those values (too many for their key) spans that comma.
    let trailing_commas: Vec<_> = errors
        .iter()
        .filter(|error| matches!(error, Error::TrailingComma { .. }))
        .map(Error::span)
        .collect();
    // An error outside every parsed item is a broken item (`topology one-gpu {`, dropped
    // whole): a layer's unknown topology may be that one.
    let item_dropped = syntax_spans.iter().any(|error| {
        !parsed
            .file
            .items
            .iter()
            .any(|item| item.span.start <= error.start && error.start < item.span.end)
    });
    match check::check(&parsed.file, &syntax_spans, target) {
        Ok(module) if errors.is_empty() => return Ok(module),
        Ok(_) => {}
        Err(check_errors) => errors.extend(check_errors.into_iter().filter(|error| {
            let at = error.span();
            let inside = |span: &front::ast::Span| span.start <= at.start && at.end <= span.end;
            let around = |comma: &front::ast::Span| at.start <= comma.start && comma.end <= at.end;
            !glued.iter().any(inside)
                && !trailing_commas.iter().any(around)
                && !unit_broken(error)
                && (!item_dropped || !matches!(error, Error::UnknownTopology { .. }))
        })),
    }
    errors.sort_by_key(|error| error.span().start);
    Err(Diagnostics {
        file_name: name.to_string(),
        source: text.to_string(),
        errors,
    })
}

/// Like [`compile_source`], for raw bytes: text that is not UTF-8 is an error pointing at
/// the first invalid byte.
pub fn compile_bytes(name: &str, bytes: &[u8]) -> Result<ir::Module, Diagnostics> {
    compile_bytes_for(name, bytes, &plan::Target::h200())
}

/// [`compile_bytes`] for `target` (see [`compile_source_for`]).
pub fn compile_bytes_for(
    name: &str,
    bytes: &[u8],
    target: &plan::Target,
) -> Result<ir::Module, Diagnostics> {
    compile_source_for(name, decode(name, bytes)?, target)
}

/// The bytes of a `.moe` file as text, or a diagnostic at the first byte that is not UTF-8.
pub fn decode<'a>(name: &str, bytes: &'a [u8]) -> Result<&'a str, Diagnostics> {
    std::str::from_utf8(bytes).map_err(|error| {
        let offset = error.valid_up_to();
        let length = error.error_len().unwrap_or(bytes.len() - offset);
        let source = String::from_utf8_lossy(bytes).into_owned();
        // The lossy text keeps the valid prefix byte for byte, so the offset still points at
        // the bad byte (now U+FFFD, three bytes).
        Diagnostics {
            file_name: name.to_string(),
            source,
            errors: vec![Error::InvalidUtf8 {
                span: front::ast::Span::new(offset, offset + length.min(3)),
            }],
        }
    })
}

/// Prints `text` in canonical form (see [`front::format`]), or returns its syntax errors:
/// a file that does not parse is never reformatted.
pub fn format_source(name: &str, text: &str) -> Result<String, Diagnostics> {
    let parsed = parse(text);
    if parsed.errors.is_empty() {
        Ok(front::format::format_file(&parsed.file, text))
    } else {
        Err(Diagnostics {
            file_name: name.to_string(),
            source: text.to_string(),
            errors: parsed.errors,
        })
    }
}

/// A planner error about `layer`, planned for `target`, of the file `file_name` (whose
/// text is `text`), as a diagnostic at the layer's name: the layer as planned may differ
/// from the one the checker passed (other ranks, `--ranks`; another target than the
/// checker's), so the planner may refuse a checked layer. When the error is about a schedule hint, the hint's value is
/// shown too, with what would work as planned. A layer name not found in `text` puts the
/// diagnostic at the start of the file.
pub fn plan_diagnostics(
    file_name: &str,
    text: &str,
    layer: &ir::Layer,
    target: &plan::Target,
    error: &plan::PlanError,
) -> Diagnostics {
    let parsed = parse(text);
    let item = parsed
        .file
        .items
        .iter()
        .find(|item| item.kind.text == "layer" && item.name.text == layer.name);
    let hint_setting = |key: plan::HintKey| {
        item?.body.entries.iter().find_map(|entry| match entry {
            front::ast::Entry::Section(section) if section.name.text == "schedule" => section
                .settings
                .iter()
                .find(|setting| setting.key.dotted() == key.name())
                .map(|setting| setting.values[0].span),
            _ => None,
        })
    };
    let (hint, hint_span) = match error {
        plan::PlanError::TooManyExperts { max, .. } => (
            format!("the routing kernel holds at most {max} experts; use fewer routed experts"),
            None,
        ),
        plan::PlanError::ImpossibleHint { problem, .. } => (
            format!(
                "the hint passed the check of the spec as written, but not the layer planned \
                 here (other ranks or another GPU): {}",
                check::layer::hint_suggestion(layer, problem.key, target)
            ),
            hint_setting(problem.key),
        ),
        plan::PlanError::NoFeasibleTile { .. } => (
            "no tile the planner tries fits this target: lower or remove `stages` in \
             `schedule { }`, or plan for a target with more shared memory per block"
                .to_string(),
            None,
        ),
        plan::PlanError::RanksDoNotFit { .. } => (error.advice().unwrap_or_default(), None),
    };
    Diagnostics {
        file_name: file_name.to_string(),
        source: text.to_string(),
        errors: vec![Error::PlanRefused {
            span: item.map_or(front::ast::Span::new(0, 0), |item| item.name.span),
            message: error.to_string(),
            hint,
            hint_span,
        }],
    }
}
