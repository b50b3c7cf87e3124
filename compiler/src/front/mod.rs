//! The front end: `.moe` text to a syntax tree. [`lexer`] splits the text into tokens,
//! the lalrpop grammar (`grammar.lalrpop`) builds the [`ast`], and [`mod@format`] prints an AST
//! back in canonical form.
//!
//! Architecture invariant: parsing always returns a tree (possibly partial) and the list of
//! every syntax error found; it never panics, whatever the input bytes.

pub mod ast;
pub mod format;
pub mod lexer;

use lalrpop_util::{ParseError, lalrpop_mod};

use crate::diagnostics::{Error, MAX_ERRORS, short};
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

/// The item kinds a file may hold.
pub const ITEM_KINDS: [&str; 2] = ["topology", "layer"];

/// A `-` between two parts of a name (`top-k`, `groups-kept`): the whole name as written,
/// and its span, where the language joins such parts with `_`.
fn hyphenated_name<'src>(
    source: &'src str,
    invalid: &lexer::InvalidCharacter,
) -> Option<(Span, &'src str)> {
    let part = |byte: u8| byte.is_ascii_alphanumeric() || byte == b'_';
    let bytes = source.as_bytes();
    let (at, after) = (invalid.span.start, invalid.span.start + 1);
    let joins = invalid.found == '-'
        && at > 0
        && part(bytes[at - 1])
        && bytes
            .get(after)
            .is_some_and(|&b| b.is_ascii_alphabetic() || b == b'_');
    if !joins {
        return None;
    }
    let in_name = |byte: u8| part(byte) || byte == b'-';
    let start = bytes[..at]
        .iter()
        .rposition(|&b| !in_name(b))
        .map_or(0, |i| i + 1);
    let end = bytes[after..]
        .iter()
        .position(|&b| !in_name(b))
        .map_or(bytes.len(), |i| after + i);
    let written = &source[start..end];
    // A name starts with a letter or `_`: `2-k` is a number and a name.
    let first = written.as_bytes()[0];
    (first.is_ascii_alphabetic() || first == b'_').then(|| (Span::new(start, end), written))
}

/// Parses `.moe` source text into a syntax tree, recovering after errors so that all of
/// them are reported. Meaning (keys, units, rules) is checked later by [`crate::check`].
pub fn parse(source: &str) -> Parsed {
    let lexed = lexer::lex(source);
    let mut errors = SyntaxErrors {
        errors: Vec::new(),
        source,
        between_items: false,
    };
    // The end of the last name reported as joined with `-`: its other hyphens are its error.
    let mut hyphenated_until = 0;
    for invalid in &lexed.invalid {
        if invalid.span.start < hyphenated_until {
            continue;
        }
        errors.push(match hyphenated_name(source, invalid) {
            Some((span, written)) => {
                hyphenated_until = span.end;
                Error::HyphenInName {
                    span,
                    with_underscores: short(&written.replace('-', "_")),
                    written: short(written),
                }
            }
            None => Error::InvalidCharacter {
                span: invalid.span,
                found: invalid.found,
            },
        });
    }
    for glued in &lexed.glued {
        errors.push(Error::NumberGluedToName {
            span: glued.span,
            number: glued.number.to_string(),
            word: glued.word.to_string(),
        });
    }
    for unknown in &lexed.unknown_units {
        errors.push(Error::UnknownUnit {
            span: unknown.span,
            number: unknown.number.to_string(),
            word: unknown.word.to_string(),
        });
    }
    let result =
        grammar::FileParser::new().parse(&mut errors, lexed.tokens.iter().map(|&token| Ok(token)));
    let items = match result {
        Ok(items) => items,
        Err(error) => {
            errors.record(error);
            Vec::new()
        }
    };
    let mut errors = errors.errors;
    errors.sort_by_key(|error| error.span().start);
    Parsed {
        file: ast::File {
            items,
            comments: lexed.comments,
        },
        errors,
    }
}

/// How many lines `text` ends: `\n`, `\r\n` and a lone `\r` (old Mac files) each end one.
pub fn count_line_breaks(text: &str) -> usize {
    let bytes = text.as_bytes();
    bytes
        .iter()
        .enumerate()
        .filter(|&(index, &byte)| {
            byte == b'\n' || (byte == b'\r' && bytes.get(index + 1) != Some(&b'\n'))
        })
        .count()
}

/// The syntax errors the parser has met while recovering, at most [`MAX_ERRORS`] of them
/// (then one [`Error::TooManyErrors`]), so that garbage input costs bounded memory.
pub struct SyntaxErrors<'src> {
    errors: Vec<Error>,
    source: &'src str,
    /// Whether an error outside any item has been recorded since the last item parsed.
    between_items: bool,
}

impl SyntaxErrors<'_> {
    /// Records a parser error (called from the grammar's recovery rules).
    pub fn record(&mut self, error: ParseError<usize, Token<'_>, std::convert::Infallible>) {
        if self.errors.len() <= MAX_ERRORS
            && let Some(error) = syntax_error(error, self.source)
        {
            self.push(error);
        }
    }

    /// Records an error outside any item (a broken item header, or text between items):
    /// only the first until an item of a known kind parses again. Recovery there resumes at
    /// the next name, which in a broken item's body is its next key (`layer a b {`:
    /// `hidden = 64` reads as an item `hidden` missing its name), so each line after it
    /// would be an error too.
    pub fn record_between_items(
        &mut self,
        error: ParseError<usize, Token<'_>, std::convert::Infallible>,
    ) {
        if !self.between_items {
            self.between_items = true;
            self.record(error);
        }
    }

    /// Whether an item of `kind` that parsed whole is one: after an error between items,
    /// only an item of a known kind is; the others are pieces of the broken item's body
    /// (`topology = t` then `schedule { ... }` read as an item `t schedule { ... }`), dropped
    /// unreported.
    pub fn item_parsed(&mut self, kind: &str) -> bool {
        if self.between_items && !ITEM_KINDS.contains(&kind) {
            return false;
        }
        self.between_items = false;
        true
    }

    fn push(&mut self, error: Error) {
        match self.errors.len() {
            count if count < MAX_ERRORS => self.errors.push(error),
            MAX_ERRORS => self
                .errors
                .push(Error::TooManyErrors { span: error.span() }),
            _ => {}
        }
    }
}

/// Turns a parser error into a diagnostic; `None` for errors at an invalid character, which
/// the lexer has already reported.
fn syntax_error(
    error: ParseError<usize, Token<'_>, std::convert::Infallible>,
    source: &str,
) -> Option<Error> {
    let end = source.len();
    match error {
        ParseError::UnrecognizedToken {
            token: (_, Token::Invalid, _),
            ..
        }
        | ParseError::ExtraToken {
            token: (_, Token::Invalid, _),
        } => None,
        ParseError::UnrecognizedToken {
            token: (start, Token::Equals, _),
            ..
        } if let Some((comma, key)) = comma_ending_the_line_before(source, start) => {
            Some(Error::TrailingComma {
                span: comma,
                key: key.to_string(),
            })
        }
        ParseError::UnrecognizedToken {
            token: (start, _, _),
            ref expected,
        } if expected.iter().any(|e| e == "\"=\"")
            && let Some(after) = word_after_a_value(source, start) =>
        {
            let WordAfterValue::Stray { span, word, value } = after else {
                return None;
            };
            // A unit it may misspell, where the value is a number without one (not a tile).
            let bare_number = value.starts_with(|c: char| c.is_ascii_digit())
                && value
                    .chars()
                    .all(|c| c.is_ascii_digit() || matches!(c, '_' | '.' | 'e' | 'E' | '+' | '-'));
            Some(Error::StrayWord {
                span,
                word: short(word),
                value: short(value),
                unit: bare_number
                    .then(|| crate::diagnostics::suggest(word, lexer::UNITS.iter().copied()))
                    .flatten(),
            })
        }
        ParseError::UnrecognizedToken {
            token: (start, token, stop),
            expected,
        } => Some(Error::UnexpectedToken {
            span: Span::new(start, stop),
            found: token.to_string(),
            expected: describe_expected(&expected),
        }),
        ParseError::ExtraToken {
            token: (start, token, stop),
        } => Some(Error::UnexpectedToken {
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

/// Where an unexpected `=` at `equals` follows a key that starts its line and the line
/// before (comments and blank lines aside) ends with `,`: that comma's span and the key. A
/// setting's values continue after a comma, so the parser read the key as one of them.
fn comma_ending_the_line_before(source: &str, equals: usize) -> Option<(Span, &str)> {
    let before = source[..equals].trim_end_matches([' ', '\t']);
    // The key's characters are ASCII, so the byte after the last other character starts it.
    let key_start = before
        .bytes()
        .rposition(|b| !(b.is_ascii_alphanumeric() || b == b'_'))
        .map_or(0, |i| i + 1);
    let key = &before[key_start..];
    let before_key_line = before[..key_start].trim_end_matches([' ', '\t']);
    if key.is_empty() || !(before_key_line.is_empty() || before_key_line.ends_with('\n')) {
        return None;
    }
    // Back over the lines before the key's, from the end of the one just before it.
    let mut end = before_key_line.len();
    while end > 0 {
        let text = &source[..end - 1];
        let start = text.rfind('\n').map_or(0, |i| i + 1);
        let line = &text[start..];
        let comment = line.find('#').into_iter().chain(line.find("//")).min();
        let code = line[..comment.unwrap_or(line.len())].trim_end();
        if !code.is_empty() {
            let comma = start + code.len() - 1;
            return code
                .ends_with(',')
                .then(|| (Span::new(comma, comma + 1), key));
        }
        end = start;
    }
    None
}

/// A name after a value on its line, read as the next setting's key ([`word_after_a_value`]).
enum WordAfterValue<'src> {
    /// The first on its line: the error, at the word.
    Stray {
        span: Span,
        word: &'src str,
        value: &'src str,
    },
    /// Another after one already reported (`swiglu gelu relu`): no second error.
    AfterAnother,
}

/// Where the parser, having read a name as the next setting's key, finds no `=` at `next`:
/// the name and the value before it on its line, if it follows one (`max_tokens = 64
/// tokenss`, `activation = swiglu gelu`). Then that name is the error (a misspelt unit, a
/// second value), not the token after it, which may be a line further on.
fn word_after_a_value(source: &str, next: usize) -> Option<WordAfterValue<'_>> {
    // Back over blank and comment-only lines to the code the name ends.
    let mut end = next;
    let code = loop {
        let start = source[..end].rfind(['\n', '\r']).map_or(0, |i| i + 1);
        let line = &source[start..end];
        let comment = line.find('#').into_iter().chain(line.find("//")).min();
        let code = line[..comment.unwrap_or(line.len())].trim_end();
        if !code.is_empty() {
            break (start, code);
        }
        if start == 0 {
            return None;
        }
        end = start - 1;
    };
    let (line_start, code) = code;
    let word_start = code
        .bytes()
        .rposition(|b| !(b.is_ascii_alphanumeric() || b == b'_'))
        .map_or(0, |i| i + 1);
    let word = &code[word_start..];
    let before = &code[..word_start];
    let starts_a_name = word
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if !starts_a_name || !before.ends_with([' ', '\t']) {
        return None;
    }
    let (_, values) = before.rsplit_once('=')?;
    let values = values.trim();
    let complete = !values.is_empty() && !values.ends_with(',') && !values.contains(['{', '}']);
    if !complete {
        return None;
    }
    // The last of several values is the one the word follows.
    let value = values.rsplit(',').next().unwrap_or(values).trim();
    // A value of two words other than a number and its unit holds a stray word already
    // reported (`swiglu gelu relu`): one error a line.
    if let Some((number, unit)) = value.split_once([' ', '\t'])
        && !(number.starts_with(|c: char| c.is_ascii_digit())
            && lexer::UNITS.contains(&unit.trim()))
    {
        return Some(WordAfterValue::AfterAnother);
    }
    let start = line_start + word_start;
    Some(WordAfterValue::Stray {
        span: Span::new(start, start + word.len()),
        word,
        value,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use ast::{Entry, ValueKind};

    #[test]
    fn parses_items_sections_dotted_keys_and_value_lists() {
        let parsed = parse(
            "topology t { nvlink = 450 GB/s, 3 us }\n\
             layer l { hidden = 16_384 router { scale = 2.5 } schedule { gemm1.tile = 128x128x64 } }",
        );
        assert_eq!(parsed.errors, []);
        let [topology, layer] = parsed.file.items.as_slice() else {
            panic!("two items")
        };
        assert_eq!(
            (topology.kind.text.as_str(), topology.name.text.as_str()),
            ("topology", "t")
        );
        let Entry::Setting(nvlink) = &topology.body.entries[0] else {
            panic!("a setting")
        };
        assert_eq!(nvlink.values.len(), 2);
        assert_eq!(
            &"topology t { nvlink = 450 GB/s, 3 us }"[nvlink.span.start..nvlink.span.end],
            "nvlink = 450 GB/s, 3 us"
        );
        let Entry::Section(schedule) = &layer.body.entries[2] else {
            panic!("a section")
        };
        assert_eq!(schedule.settings[0].key.dotted(), "gemm1.tile");
        assert!(
            matches!(&schedule.settings[0].values[0].kind, ValueKind::Tile(tile) if tile == "128x128x64")
        );
    }

    #[test]
    fn recovers_and_reports_every_syntax_error() {
        let parsed = parse(
            "layer a { hidden = = 1 ffn = 64 }\nlayer b { experts 8 top_k = 2 }\nlayer c { top_k = 1 }",
        );
        assert_eq!(parsed.errors.len(), 2, "{:?}", parsed.errors);
        let names: Vec<&str> = parsed
            .file
            .items
            .iter()
            .map(|item| item.name.text.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        let Entry::Setting(ffn) = &parsed.file.items[0].body.entries[0] else {
            panic!("ffn survives")
        };
        assert_eq!(ffn.key.dotted(), "ffn");
    }

    #[test]
    fn every_line_break_convention_counts_once() {
        assert_eq!(count_line_breaks("a\nb\r\nc\rd"), 3);
        assert_eq!(count_line_breaks("\r\r\n\n"), 3);
        assert_eq!(count_line_breaks("no break"), 0);
    }

    #[test]
    fn sections_do_not_nest() {
        let parsed = parse("layer a { router { inner { x = 1 } } }");
        assert!(!parsed.errors.is_empty());
    }
}
