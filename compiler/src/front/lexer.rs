//! The lexer: `.moe` text to tokens with byte spans (logos).
//!
//! Architecture invariant: lexing never fails and never panics. Characters that start no
//! token become [`Token::Invalid`] (with what they broke), which the parser skips as an
//! unexpected token (the lexer's diagnostic is the one reported); comments are kept aside
//! for the formatter instead of being dropped.

use logos::Logos;

use crate::diagnostics::MAX_ERRORS;
use crate::front::ast::{Comment, Span, Unit};

/// One token of a `.moe` file. Words that are units (`us`, `GB/s`, `tokens`, ...) are their
/// own tokens, so a unit can follow a number with no ambiguity and values need no separators.
#[derive(Logos, Clone, Copy, Debug, PartialEq, Eq)]
#[logos(skip r"[ \t\r\n\f\u{FEFF}]+")]
pub enum Token<'src> {
    #[token("{")]
    LBrace,
    #[token("}")]
    RBrace,
    #[token("=")]
    Equals,
    #[token(",")]
    Comma,
    #[token(".")]
    Dot,
    /// A name or a word value: `layer`, `hidden`, `swiglu`, `true`.
    #[regex(r"[A-Za-z_][A-Za-z0-9_]*")]
    Ident(&'src str),
    /// A decimal integer, `_` allowed between digits: `16384`, `16_384`.
    #[regex(r"[0-9][0-9_]*")]
    Integer(&'src str),
    /// A decimal number with a fraction or an exponent: `2.5`, `1e-3`.
    #[regex(r"[0-9][0-9_]*\.[0-9][0-9_]*([eE][+-]?[0-9]+)?")]
    #[regex(r"[0-9][0-9_]*[eE][+-]?[0-9]+")]
    Float(&'src str),
    /// A GEMM tile shape `MxNxK`: `128x128x64`. Any count of parts lexes as one (the
    /// checker says a tile has three), so that `128x128` is not a number and a name.
    #[regex(r"[0-9][0-9_]*(x[0-9][0-9_]*)+")]
    Tile(&'src str),
    #[token("B/s", |_| Unit::BytesPerSecond)]
    #[token("KB/s", |_| Unit::KilobytesPerSecond)]
    #[token("MB/s", |_| Unit::MegabytesPerSecond)]
    #[token("GB/s", |_| Unit::GigabytesPerSecond)]
    #[token("TB/s", |_| Unit::TerabytesPerSecond)]
    #[token("KiB/s", |_| Unit::KibibytesPerSecond)]
    #[token("MiB/s", |_| Unit::MebibytesPerSecond)]
    #[token("GiB/s", |_| Unit::GibibytesPerSecond)]
    #[token("TiB/s", |_| Unit::TebibytesPerSecond)]
    #[token("b/s", |_| Unit::BitsPerSecond)]
    #[token("Kb/s", |_| Unit::KilobitsPerSecond)]
    #[token("Mb/s", |_| Unit::MegabitsPerSecond)]
    #[token("Gb/s", |_| Unit::GigabitsPerSecond)]
    #[token("Tb/s", |_| Unit::TerabitsPerSecond)]
    #[token("ns", |_| Unit::Nanoseconds)]
    #[token("us", |_| Unit::Microseconds)]
    #[token("ms", |_| Unit::Milliseconds)]
    #[token("token", |_| Unit::Tokens)]
    #[token("tokens", |_| Unit::Tokens)]
    Unit(Unit),
    /// `# ...` or `// ...` up to the end of the line, which `\n`, `\r\n` or a lone `\r` (old
    /// Mac files) ends.
    #[regex(r"#[^\r\n]*", allow_greedy = true)]
    #[regex(r"//[^\r\n]*", allow_greedy = true)]
    Comment(&'src str),
    /// A character that starts no token; the lexer has already reported it.
    Invalid,
}

impl std::fmt::Display for Token<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::LBrace => f.write_str("`{`"),
            Token::RBrace => f.write_str("`}`"),
            Token::Equals => f.write_str("`=`"),
            Token::Comma => f.write_str("`,`"),
            Token::Dot => f.write_str("`.`"),
            Token::Ident(word) => write!(f, "name `{word}`"),
            Token::Integer(text) | Token::Float(text) => write!(f, "number `{text}`"),
            Token::Tile(text) => write!(f, "tile shape `{text}`"),
            Token::Unit(unit) => write!(f, "unit `{}`", unit.symbol()),
            Token::Comment(_) => f.write_str("comment"),
            Token::Invalid => f.write_str("invalid character"),
        }
    }
}

/// A character the lexer could not place in any token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidCharacter {
    pub span: Span,
    pub found: char,
}

/// A name right after a number that the file cannot mean as a name, set aside from the
/// tokens and reported, so that the file parses on as if the number stood alone:
/// - a word that reads as a unit `.moe` does not have ([`reads_as_unit`]: `3 s`, `50 GB`,
///   `100Gbps`), glued to it or after spaces on its line: no key is named so, and an
///   item's name never follows a number;
/// - any other name glued to it, nothing between (`64k`, `128abc`): never a valid pair, as
///   units are their own tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordAfterNumber<'src> {
    /// The number and the name together.
    pub span: Span,
    pub number: &'src str,
    pub word: &'src str,
}

/// The units `.moe` has, as written (each its own token above; a test lexes every one).
pub const UNITS: &[&str] = &[
    "B/s", "KB/s", "MB/s", "GB/s", "TB/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s", "b/s", "Kb/s",
    "Mb/s", "Gb/s", "Tb/s", "ns", "us", "ms", "token", "tokens",
];

/// Words that read as a unit `.moe` does not have: seconds, minutes and hours, byte sizes
/// without `/s`, bit rates spelt `bps`, short forms of `tokens`. Compared ignoring case.
const UNIT_LIKE_WORDS: &[&str] = &[
    "s", "sec", "secs", "second", "seconds", "min", "mins", "minute", "minutes", "h", "hr", "hrs",
    "hour", "hours", "ps", "usec", "usecs", "msec", "msecs", "nsec", "nsecs", "b", "kb", "mb",
    "gb", "tb", "kib", "mib", "gib", "tib", "bytes", "bps", "kbps", "mbps", "gbps", "tbps", "tok",
    "toks",
];

/// Whether `word` reads as a unit `.moe` does not have (see [`WordAfterNumber`]).
pub fn reads_as_unit(word: &str) -> bool {
    UNIT_LIKE_WORDS
        .iter()
        .any(|unit| unit.eq_ignore_ascii_case(word))
}

/// The lexed file: the tokens the parser reads, the comments the formatter keeps, the
/// characters that started no token, and the names after numbers set aside
/// ([`WordAfterNumber`]): glued to them, or unit-like after spaces.
#[derive(Clone, Debug, Default)]
pub struct Lexed<'src> {
    pub tokens: Vec<(usize, Token<'src>, usize)>,
    pub comments: Vec<Comment>,
    pub invalid: Vec<InvalidCharacter>,
    pub glued: Vec<WordAfterNumber<'src>>,
    pub unknown_units: Vec<WordAfterNumber<'src>>,
}

/// Splits `source` into tokens. An invalid character becomes a [`Token::Invalid`] that
/// also takes the word or number glued before it (`top-k`, `3µs`) and the rest of its line
/// up to a brace or a comment (`ffn = 256 — the intermediate size`), so the parser skips
/// what the character broke instead of reading its pieces as keys and values. Each run of
/// invalid characters in it is one [`InvalidCharacter`] (its first character); at most
/// [`MAX_ERRORS`] are listed.
pub fn lex(source: &str) -> Lexed<'_> {
    let mut lexed = Lexed::default();
    let mut lexer = Token::lexer(source);
    // Where the last invalid character ended: the next one right there is the same run.
    let mut run_end = usize::MAX;
    while let Some(result) = lexer.next() {
        let range = lexer.span();
        if let Some(&(start, Token::Invalid, end)) = lexed.tokens.last()
            && !source[end..range.start].contains(['\n', '\r'])
            && !matches!(
                result,
                Ok(Token::LBrace | Token::RBrace | Token::Comment(_))
            )
        {
            if result.is_err() {
                if range.start != run_end {
                    lexed.report_invalid(source, &range);
                }
                run_end = range.end;
            }
            lexed.tokens.pop();
            lexed.tokens.push((start, Token::Invalid, range.end));
            continue;
        }
        match result {
            Ok(Token::Comment(text)) => lexed.comments.push(Comment {
                text: text.trim_end().to_string(),
                span: Span::new(range.start, range.end),
            }),
            Ok(Token::Ident(name)) => {
                let after_number = match lexed.tokens.last() {
                    Some(&(start, Token::Integer(number) | Token::Float(number), end)) => {
                        let gap = &source[end..range.start];
                        let on_its_line = gap.bytes().all(|byte| byte == b' ' || byte == b'\t');
                        let set_aside = if on_its_line && reads_as_unit(name) {
                            Some(&mut lexed.unknown_units)
                        } else if gap.is_empty() {
                            Some(&mut lexed.glued)
                        } else {
                            None
                        };
                        set_aside.map(|list| (list, start, number))
                    }
                    _ => None,
                };
                match after_number {
                    Some((list, start, number)) => {
                        if list.len() <= MAX_ERRORS {
                            list.push(WordAfterNumber {
                                span: Span::new(start, range.end),
                                number,
                                word: name,
                            });
                        }
                    }
                    None => lexed
                        .tokens
                        .push((range.start, Token::Ident(name), range.end)),
                }
            }
            Ok(token) => lexed.tokens.push((range.start, token, range.end)),
            Err(()) => {
                lexed.report_invalid(source, &range);
                run_end = range.end;
                let start = match lexed.tokens.last() {
                    Some(&(start, token, end))
                        if end == range.start && token.is_word_or_number() =>
                    {
                        lexed.tokens.pop();
                        start
                    }
                    _ => range.start,
                };
                lexed.tokens.push((start, Token::Invalid, range.end));
            }
        }
    }
    lexed
}

impl Token<'_> {
    /// A name, number, tile or unit: what an invalid character glued to it takes along.
    fn is_word_or_number(self) -> bool {
        matches!(
            self,
            Token::Ident(_) | Token::Integer(_) | Token::Float(_) | Token::Tile(_) | Token::Unit(_)
        )
    }
}

impl Lexed<'_> {
    /// Lists the invalid character starting `range` (up to [`MAX_ERRORS`] and one more).
    fn report_invalid(&mut self, source: &str, range: &std::ops::Range<usize>) {
        if self.invalid.len() <= MAX_ERRORS {
            self.invalid.push(InvalidCharacter {
                span: Span::new(range.start, range.end),
                found: source[range.clone()].chars().next().unwrap_or('\u{fffd}'),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(source: &str) -> Vec<Token<'_>> {
        lex(source)
            .tokens
            .into_iter()
            .map(|(_, token, _)| token)
            .collect()
    }

    #[test]
    fn a_unit_like_word_after_a_number_on_its_line_is_set_aside_and_a_key_is_not() {
        let lexed = lex(
            "latency = 3 s\nnetwork = 50\tGB, 2 SEC\nhidden = 64\nffn = 1 # s\nk = 2\ns = 1\nt = 7ms 5min",
        );
        let unknown: Vec<(&str, &str)> = lexed
            .unknown_units
            .iter()
            .map(|w| (w.number, w.word))
            .collect();
        assert_eq!(
            unknown,
            [("3", "s"), ("50", "GB"), ("2", "SEC"), ("5", "min")]
        );
        assert_eq!(lexed.unknown_units[0].span, Span::new(10, 13));
        assert!(lexed.glued.is_empty());
        let names: Vec<&str> = lexed
            .tokens
            .iter()
            .filter_map(|(_, token, _)| match token {
                Token::Ident(name) => Some(*name),
                _ => None,
            })
            .collect();
        // A unit-like word on the next line is a name (here a key the checker rejects).
        assert_eq!(
            names,
            ["latency", "network", "hidden", "ffn", "k", "s", "t"]
        );
    }

    #[test]
    fn a_name_glued_to_a_number_is_set_aside_and_a_unit_is_not() {
        let lexed = lex("hidden = 64k\nscale = 2.5x\nchunk = 16tokens\ntile = 2x");
        let glued: Vec<(&str, &str)> = lexed.glued.iter().map(|g| (g.number, g.word)).collect();
        assert_eq!(glued, [("64", "k"), ("2.5", "x"), ("2", "x")]);
        assert_eq!(lexed.glued[0].span, Span::new(9, 12));
        let kinds: Vec<Token<'_>> = lexed.tokens.into_iter().map(|(_, t, _)| t).collect();
        assert_eq!(
            kinds[..6],
            [
                Token::Ident("hidden"),
                Token::Equals,
                Token::Integer("64"),
                Token::Ident("scale"),
                Token::Equals,
                Token::Float("2.5"),
            ]
        );
        assert!(
            kinds.contains(&Token::Unit(Unit::Tokens)),
            "16tokens: a number and a unit"
        );
    }

    /// The list the parser suggests units from is the lexer's units, each one token.
    #[test]
    fn every_listed_unit_is_a_unit_token() {
        for unit in UNITS {
            assert!(
                matches!(kinds(unit).as_slice(), [Token::Unit(_)]),
                "{unit}: {:?}",
                kinds(unit)
            );
        }
    }

    #[test]
    fn units_numbers_and_tiles_are_distinct_tokens() {
        assert_eq!(
            kinds("nvlink = 450 GB/s, 3 us gemm1.tile = 128x128x64 scale = 2.5"),
            vec![
                Token::Ident("nvlink"),
                Token::Equals,
                Token::Integer("450"),
                Token::Unit(Unit::GigabytesPerSecond),
                Token::Comma,
                Token::Integer("3"),
                Token::Unit(Unit::Microseconds),
                Token::Ident("gemm1"),
                Token::Dot,
                Token::Ident("tile"),
                Token::Equals,
                Token::Tile("128x128x64"),
                Token::Ident("scale"),
                Token::Equals,
                Token::Float("2.5"),
            ]
        );
    }

    #[test]
    fn bit_rates_are_units_not_invalid_characters() {
        let lexed = lex("network = 400 Gb/s, 3 us");
        assert!(lexed.invalid.is_empty());
        assert!(
            lexed
                .tokens
                .iter()
                .any(|(_, token, _)| *token == Token::Unit(Unit::GigabitsPerSecond))
        );
    }

    #[test]
    fn comments_are_kept_aside() {
        let lexed = lex("# one\nhidden = 64 // two\n");
        assert_eq!(lexed.tokens.len(), 3);
        let texts: Vec<_> = lexed.comments.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["# one", "// two"]);
    }

    #[test]
    fn comments_end_at_every_kind_of_line_break() {
        for source in [
            "# one\rhidden = 64 // two\r",
            "# one\r\nhidden = 64 // two\r\n",
        ] {
            let lexed = lex(source);
            assert_eq!(lexed.tokens.len(), 3, "{source:?}");
            let texts: Vec<_> = lexed.comments.iter().map(|c| c.text.as_str()).collect();
            assert_eq!(texts, ["# one", "// two"], "{source:?}");
        }
    }

    #[test]
    fn a_byte_order_mark_is_whitespace() {
        let lexed = lex("\u{FEFF}layer");
        assert_eq!(lexed.tokens.len(), 1);
        assert!(lexed.invalid.is_empty());
    }

    #[test]
    fn numbers_words_and_reserved_units() {
        assert_eq!(
            kinds("16_384 1.5e3 1e-3 usable us tokens 128x5"),
            vec![
                Token::Integer("16_384"),
                Token::Float("1.5e3"),
                Token::Float("1e-3"),
                Token::Ident("usable"),
                Token::Unit(Unit::Microseconds),
                Token::Unit(Unit::Tokens),
                // A tile of two parts, which the checker refuses as one value.
                Token::Tile("128x5"),
            ]
        );
    }

    #[test]
    fn runs_of_invalid_characters_become_one_token() {
        let lexed = lex("a = @@@\u{0}\nb");
        assert_eq!(lexed.invalid.len(), 1);
        assert_eq!(lexed.invalid[0].found, '@');
        assert_eq!(
            kinds("a = @@@\u{0}\nb"),
            vec![
                Token::Ident("a"),
                Token::Equals,
                Token::Invalid,
                Token::Ident("b")
            ]
        );
    }

    /// An invalid token takes the word or number glued before it and the rest of its line,
    /// up to a brace or a comment; each run of invalid characters in it is reported.
    #[test]
    fn an_invalid_character_takes_what_it_broke() {
        let source = "top-k = 2\nffn = 256 — the size; x\nt { nvlink = 3 µs # c\n10μs }";
        let lexed = lex(source);
        let tokens: Vec<(&str, Token<'_>)> = lexed
            .tokens
            .iter()
            .map(|&(start, token, end)| (&source[start..end], token))
            .collect();
        assert_eq!(
            tokens,
            [
                ("top-k = 2", Token::Invalid),
                ("ffn", Token::Ident("ffn")),
                ("=", Token::Equals),
                ("256", Token::Integer("256")),
                ("— the size; x", Token::Invalid),
                ("t", Token::Ident("t")),
                ("{", Token::LBrace),
                ("nvlink", Token::Ident("nvlink")),
                ("=", Token::Equals),
                ("3", Token::Integer("3")),
                ("µs", Token::Invalid),
                ("10μs", Token::Invalid),
                ("}", Token::RBrace),
            ]
        );
        let found: Vec<char> = lexed.invalid.iter().map(|c| c.found).collect();
        assert_eq!(found, ['-', '—', ';', 'µ', 'μ']);
        assert_eq!(lexed.comments.len(), 1);
    }
}
