//! moeforge's compiler: turns an MoE layer description into a plan and CUDA source.
//!
//! The stages, each in its own module with a typed boundary:
//! - [`front`]: `.moe` text to a syntax tree (lexer, grammar, AST, canonical printer).
//! - [`check`]: syntax tree to a validated [`ir::Module`] (units, defaults, rules).
//! - [`diagnostics`]: the typed errors of both, with spans, hints and rendering.
//! - [`ir`]: the checked layer (the checker's output, every later stage's input).
//! - [`plan`]: tiles, regimes, buffers and the launch table, chosen by a cost model.
//! - [`codegen`]: the plan written out as one CUDA C++ unit.
//!
//! Entry points: [`compile_source`] (text to checked module), [`parse`] (text to syntax
//! tree), [`format_source`] (text to canonical text).
pub mod check;
pub mod codegen;
pub mod diagnostics;
pub mod front;
pub mod ir;
pub mod plan;

pub use diagnostics::{Diagnostics, Error};
pub use front::{Parsed, parse};

/// Checks a whole `.moe` file: lexes, parses and checks `text`, returning the validated
/// module (every topology and layer, defaults applied, units resolved) or every error found.
/// `name` is the file name shown in diagnostics.
pub fn compile_source(name: &str, text: &str) -> Result<ir::Module, Diagnostics> {
    let parsed = parse(text);
    let syntax_spans: Vec<_> = parsed.errors.iter().map(Error::span).collect();
    let mut errors = parsed.errors;
    match check::check(&parsed.file, &syntax_spans) {
        Ok(module) if errors.is_empty() => return Ok(module),
        Ok(_) => {}
        Err(check_errors) => errors.extend(check_errors),
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
    compile_source(name, decode(name, bytes)?)
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
