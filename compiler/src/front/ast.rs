//! The syntax tree of a `.moe` file, as written: every node carries its byte span, numbers
//! keep their literal text, and comments are kept aside so that `fmt` can print them back.
//!
//! Architecture invariant: the AST says nothing about meaning. Which keys exist, which
//! units fit them and which values are valid is the checker's business, so the grammar stays
//! small and every mistake of meaning gets a diagnostic that names the rule.

/// A half-open byte range `start..end` into the source text (debug-printed as `start..end`).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// A whole file: its items in source order, and its comments in source order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct File {
    pub items: Vec<Item>,
    pub comments: Vec<Comment>,
}

/// `# text` or `// text` (the text includes its marker, trailing spaces removed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Comment {
    pub text: String,
    pub span: Span,
}

/// A top-level item: `KIND NAME { ... }`, e.g. `layer deepseek_v3 { ... }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub kind: Ident,
    pub name: Ident,
    pub body: Block,
    pub span: Span,
}

/// A name with its span.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident {
    pub text: String,
    pub span: Span,
}

/// `{ entry* }`; the span covers both braces.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub entries: Vec<Entry>,
    pub span: Span,
}

/// One line of a block: a setting, or a named section (one level deep: sections hold
/// settings only).
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Setting(Setting),
    Section(Section),
}

/// `key = value, value, ...`, e.g. `nvlink = 450 GB/s, 3 us` or `gemm1.tile = 128x128x64`.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    pub key: Key,
    pub values: Vec<Value>,
    pub span: Span,
}

/// A possibly dotted key: `hidden`, `gemm1.tile`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    pub parts: Vec<Ident>,
    pub span: Span,
}

impl Key {
    /// The key as written, parts joined by `.`.
    pub fn dotted(&self) -> String {
        let parts: Vec<&str> = self.parts.iter().map(|part| part.text.as_str()).collect();
        parts.join(".")
    }
}

/// `name { setting* }`, e.g. `router { scoring = sigmoid }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    pub name: Ident,
    pub settings: Vec<Setting>,
    /// Byte offset of the `{` (the formatter keeps a comment that follows it on its line).
    pub open_brace: usize,
    pub span: Span,
}

/// One value of a setting.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// A number as written (`16_384`, `2.5`), with its unit if any.
    Number {
        literal: NumberLiteral,
        unit: Option<Unit>,
    },
    /// A word: `swiglu`, `true`, `h200_node`.
    Word(String),
    /// A tile shape as written: `128x128x64`.
    Tile(String),
}

/// A number's text, and whether it was written as an integer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumberLiteral {
    pub text: String,
    pub is_integer: bool,
}

/// Units a number may carry. Bandwidths are bytes per second (decimal `KB` = 1000 B,
/// binary `KiB` = 1024 B), latencies are nanoseconds, and `tokens` counts tokens. Bit rates
/// (`Gb/s`) are units too, so that the checker can say "write GB/s" instead of the lexer
/// rejecting the `/`; no setting accepts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    BytesPerSecond,
    KilobytesPerSecond,
    MegabytesPerSecond,
    GigabytesPerSecond,
    TerabytesPerSecond,
    KibibytesPerSecond,
    MebibytesPerSecond,
    GibibytesPerSecond,
    TebibytesPerSecond,
    BitsPerSecond,
    KilobitsPerSecond,
    MegabitsPerSecond,
    GigabitsPerSecond,
    TerabitsPerSecond,
    Nanoseconds,
    Microseconds,
    Milliseconds,
    Tokens,
}

/// What a unit measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dimension {
    Bandwidth,
    Latency,
    Tokens,
}

impl Dimension {
    /// What values of this dimension are, with their units (for messages).
    pub fn describe(self) -> &'static str {
        match self {
            Dimension::Bandwidth => {
                "a bandwidth (B/s, KB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, TiB/s)"
            }
            Dimension::Latency => "a latency (ns, us, ms)",
            Dimension::Tokens => "a token count (tokens)",
        }
    }

    /// A value of this dimension as a setting would hold it (for hints).
    pub fn example(self) -> &'static str {
        match self {
            Dimension::Bandwidth => "450 GB/s",
            Dimension::Latency => "3 us",
            Dimension::Tokens => "64 tokens",
        }
    }
}

impl Unit {
    /// The unit as written in source.
    pub fn symbol(self) -> &'static str {
        match self {
            Unit::BytesPerSecond => "B/s",
            Unit::KilobytesPerSecond => "KB/s",
            Unit::MegabytesPerSecond => "MB/s",
            Unit::GigabytesPerSecond => "GB/s",
            Unit::TerabytesPerSecond => "TB/s",
            Unit::KibibytesPerSecond => "KiB/s",
            Unit::MebibytesPerSecond => "MiB/s",
            Unit::GibibytesPerSecond => "GiB/s",
            Unit::TebibytesPerSecond => "TiB/s",
            Unit::BitsPerSecond => "b/s",
            Unit::KilobitsPerSecond => "Kb/s",
            Unit::MegabitsPerSecond => "Mb/s",
            Unit::GigabitsPerSecond => "Gb/s",
            Unit::TerabitsPerSecond => "Tb/s",
            Unit::Nanoseconds => "ns",
            Unit::Microseconds => "us",
            Unit::Milliseconds => "ms",
            Unit::Tokens => "tokens",
        }
    }

    pub fn dimension(self) -> Dimension {
        match self {
            Unit::Nanoseconds | Unit::Microseconds | Unit::Milliseconds => Dimension::Latency,
            Unit::Tokens => Dimension::Tokens,
            _ => Dimension::Bandwidth,
        }
    }

    /// The byte rate with the same prefix, for a bit rate (`Gb/s` → `GB/s`); `None` for
    /// every other unit.
    pub fn byte_rate_of_bit_rate(self) -> Option<Unit> {
        match self {
            Unit::BitsPerSecond => Some(Unit::BytesPerSecond),
            Unit::KilobitsPerSecond => Some(Unit::KilobytesPerSecond),
            Unit::MegabitsPerSecond => Some(Unit::MegabytesPerSecond),
            Unit::GigabitsPerSecond => Some(Unit::GigabytesPerSecond),
            Unit::TerabitsPerSecond => Some(Unit::TerabytesPerSecond),
            _ => None,
        }
    }

    /// How many base units (bytes per second, nanoseconds, tokens; bits per second for a
    /// bit rate) one of this unit is.
    pub fn scale(self) -> u64 {
        match self {
            Unit::BytesPerSecond | Unit::BitsPerSecond | Unit::Nanoseconds | Unit::Tokens => 1,
            Unit::KilobytesPerSecond | Unit::KilobitsPerSecond | Unit::Microseconds => 1_000,
            Unit::MegabytesPerSecond | Unit::MegabitsPerSecond | Unit::Milliseconds => 1_000_000,
            Unit::GigabytesPerSecond | Unit::GigabitsPerSecond => 1_000_000_000,
            Unit::TerabytesPerSecond | Unit::TerabitsPerSecond => 1_000_000_000_000,
            Unit::KibibytesPerSecond => 1 << 10,
            Unit::MebibytesPerSecond => 1 << 20,
            Unit::GibibytesPerSecond => 1 << 30,
            Unit::TebibytesPerSecond => 1 << 40,
        }
    }
}
