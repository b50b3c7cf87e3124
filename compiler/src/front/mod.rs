//! The front end: `.moe` text to a syntax tree. [`lexer`] splits the text into tokens,
//! the lalrpop grammar (`grammar.lalrpop`) builds the [`ast`], and [`format`] prints an AST
//! back in canonical form.
//!
//! Architecture invariant: parsing always returns a tree (possibly partial) and the list of
//! every syntax error found; it never panics, whatever the input bytes.

pub mod ast;
pub mod format;
pub mod lexer;

use lalrpop_util::{ErrorRecovery, ParseError, lalrpop_mod};

use crate::diagnostics::Error;
use ast::Span;
use lexer::Token;

lalrpop_mod!(
    #[allow(clippy::all, clippy::pedantic, unused_qualifications)]
    grammar,
    "/front/grammar.rs"
);

/// The result of parsing: the tree of everything that parsed, and every syntax error.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub file: ast::File,
    pub errors: Vec<Error>,
}

/// Parses `.moe` source text into a syntax tree, recovering after errors so that all of
/// them are reported. Meaning (keys, units, rules) is checked later by [`crate::check`].
pub fn parse(source: &str) -> Parsed {
    let lexed = lexer::lex(source);
    let mut errors: Vec<Error> = lexed
        .invalid
        .iter()
        .map(|invalid| Error::InvalidCharacter { span: invalid.span, found: invalid.found })
        .collect();
    let mut recovered = Vec::new();
    let result = grammar::FileParser::new().parse(&mut recovered, lexed.tokens.iter().map(|&token| Ok(token)));
    let items = match result {
        Ok(items) => items,
        Err(error) => {
            recovered.push(ErrorRecovery { error, dropped_tokens: Vec::new() });
            Vec::new()
        }
    };
    errors.extend(recovered.into_iter().filter_map(|recovery| syntax_error(recovery.error, source.len())));
    errors.sort_by_key(|error| error.span().start);
    Parsed { file: ast::File { items, comments: lexed.comments }, errors }
}

/// Turns a parser error into a diagnostic; `None` for errors at an invalid character, which
/// the lexer has already reported.
fn syntax_error(error: ParseError<usize, Token<'_>, std::convert::Infallible>, end: usize) -> Option<Error> {
    match error {
        ParseError::UnrecognizedToken { token: (_, Token::Invalid, _), .. }
        | ParseError::ExtraToken { token: (_, Token::Invalid, _) } => None,
        ParseError::UnrecognizedToken { token: (start, token, stop), expected } => Some(Error::UnexpectedToken {
            span: Span::new(start, stop),
            found: token.to_string(),
            expected: describe_expected(&expected),
        }),
        ParseError::ExtraToken { token: (start, token, stop) } => Some(Error::UnexpectedToken {
            span: Span::new(start, stop),
            found: token.to_string(),
            expected: "the end of the file".into(),
        }),
        ParseError::UnrecognizedEof { location, expected } => Some(Error::UnexpectedEnd {
            span: Span::new(location.min(end), location.min(end)),
            expected: describe_expected(&expected),
        }),
        ParseError::InvalidToken { location } => Some(Error::UnexpectedToken {
            span: Span::new(location, location),
            found: "invalid token".into(),
            expected: "a token".into(),
        }),
        ParseError::User { error } => match error {},
    }
}

/// Lists the terminals the grammar expected in words: "a name, `=` or `{`".
fn describe_expected(expected: &[String]) -> String {
    let mut words: Vec<&str> = Vec::new();
    for terminal in expected {
        let word = match terminal.as_str() {
            "IDENT" => "a name",
            "INTEGER" | "FLOAT" => "a number",
            "TILE" => "a tile shape",
            "UNIT" => "a unit",
            "\"{\"" => "`{`",
            "\"}\"" => "`}`",
            "\"=\"" => "`=`",
            "\",\"" => "`,`",
            "\".\"" => "`.`",
            _ => continue,
        };
        if !words.contains(&word) {
            words.push(word);
        }
    }
    match words.as_slice() {
        [] => "something else".into(),
        [one] => (*one).into(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}
