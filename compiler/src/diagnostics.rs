//! Errors in `.moe` files: one typed variant per rule, each with the byte span it is about,
//! a message that states the rule and a hint that says how to fix it; rendered with file,
//! line, column and caret by codespan-reporting.
//!
//! Architecture invariant: the compiler never prints. It returns [`Diagnostics`]; the edge
//! (the CLI, the proc macro) decides where and how they are shown.

use std::borrow::Cow;

use codespan_reporting::diagnostic::{Diagnostic, Label};
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term;

use crate::front::ast::Span;

/// Diagnostics beyond this many are counted but not rendered.
pub const MAX_RENDERED_ERRORS: usize = 100;

/// The lexer, the parser and the checker each stop collecting errors after this many, so
/// that a huge file of garbage costs bounded memory.
pub const MAX_ERRORS: usize = 1000;

/// One error in a `.moe` file.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Error {
    // ---- reading and lexing ----
    #[error("the file is not valid UTF-8")]
    InvalidUtf8 { span: Span },
    #[error("unexpected character {found:?}")]
    InvalidCharacter { span: Span, found: char },
    #[error("`{written}`: names are joined with `_`, not `-`")]
    HyphenInName {
        span: Span,
        written: String,
        with_underscores: String,
    },
    #[error("`{number}{word}`: a number with a name right after it")]
    NumberGluedToName {
        span: Span,
        number: String,
        word: String,
    },
    #[error("`{word}` after `{number}` is not a unit `.moe` knows")]
    UnknownUnit {
        span: Span,
        number: String,
        word: String,
    },

    // ---- syntax ----
    #[error("unexpected {found}, expected {expected}")]
    UnexpectedToken {
        span: Span,
        found: String,
        expected: String,
    },
    #[error("this `,` ends its line, so the next setting's `{key}` was read as one more value")]
    TrailingComma { span: Span, key: String },
    #[error("`{word}` after the value `{value}` is neither a unit nor a setting")]
    StrayWord {
        span: Span,
        word: String,
        value: String,
        /// The unit it is likely a misspelling of.
        unit: Option<String>,
    },
    #[error("unexpected end of file, expected {expected}")]
    UnexpectedEnd { span: Span, expected: String },

    // ---- items, sections and keys ----
    #[error("unknown item kind `{found}`: a file holds `topology` and `layer` items")]
    UnknownItemKind {
        span: Span,
        found: String,
        suggestion: Option<String>,
    },
    #[error("{kind} `{name}` is defined twice")]
    DuplicateItem {
        span: Span,
        kind: &'static str,
        name: String,
        first: Span,
    },
    #[error("unknown key `{key}` in {section}")]
    UnknownKey {
        span: Span,
        key: String,
        section: String,
        suggestion: Option<String>,
        known: String,
    },
    #[error("`{key}` is a checkpoint config's name, not a key of {written_in}")]
    ConfigNameElsewhere {
        span: Span,
        key: String,
        written_in: String,
        /// The key it names, and where that key is written.
        ours: &'static str,
        home: &'static str,
    },
    #[error("`{key}` is set twice in {section}")]
    DuplicateKey {
        span: Span,
        key: String,
        section: String,
        first: Span,
    },
    #[error("{section} is missing the required key `{key}`")]
    MissingKey {
        span: Span,
        key: &'static str,
        section: String,
        example: String,
    },
    #[error("`{key}` does not belong in {written_in}: it is a key of {belongs_in}")]
    MisplacedKey {
        span: Span,
        key: String,
        written_in: String,
        belongs_in: String,
        /// A key of `written_in` the user may have meant instead (`expert` → `experts`).
        suggestion: Option<String>,
    },
    #[error("`{key}` is a section, not a setting")]
    ExpectedSection { span: Span, key: String },
    #[error("`{key}` is a setting, not a section")]
    ExpectedSetting { span: Span, key: String },

    // ---- values ----
    #[error("`{key}` takes {expected}, but {found} {} given", if *found == 1 { "value is" } else { "values are" })]
    WrongValueCount {
        span: Span,
        key: String,
        expected: &'static str,
        found: usize,
    },
    #[error("`{key}` takes {expected}, found {found}")]
    WrongValueKind {
        span: Span,
        key: String,
        expected: String,
        found: String,
        /// How to write a value of the expected kind.
        hint: String,
    },
    #[error("`{key}` takes {expected}, but `{unit}` is {unit_dimension}")]
    WrongUnit {
        span: Span,
        key: String,
        expected: String,
        unit: &'static str,
        unit_dimension: &'static str,
    },
    #[error("`{key}` takes bytes per second, but `{unit}` is bits per second")]
    BitRateUnit {
        span: Span,
        key: String,
        unit: &'static str,
        byte_unit: &'static str,
        /// The value converted to bytes per second: `400 Gb/s = 50 GB/s`.
        conversion: String,
    },
    #[error("`{key}` needs a unit: {expected}")]
    MissingUnit {
        span: Span,
        key: String,
        expected: &'static str,
    },
    #[error("`{key}` = {value} does not fit in {bits} bits (at most {max}{unit})")]
    NumberTooLarge {
        span: Span,
        key: String,
        value: String,
        bits: u32,
        max: u64,
        /// The unit `max` is in, with a leading space (` B/s`, ` ns`), or empty.
        unit: &'static str,
    },
    #[error("`{key}` takes a whole number, found `{value}`")]
    NotAnInteger {
        span: Span,
        key: String,
        value: String,
    },
    #[error("`{key}` must be at least {min}, found {value}")]
    TooSmall {
        span: Span,
        key: String,
        value: u64,
        min: u64,
    },
    #[error("`{key}` must be positive, {}", if *rounds_to_zero { format!("but `{value}` rounds to 0 as a 32-bit float") } else { format!("found `{value}`") })]
    NotPositive {
        span: Span,
        key: String,
        value: String,
        /// The value is above zero as written but below the smallest 32-bit float.
        rounds_to_zero: bool,
    },
    #[error("`{key}` = {value} does not fit in a 32-bit float (at most about 3.4e38)")]
    RealTooLarge {
        span: Span,
        key: String,
        value: String,
    },
    #[error("`{key}` has no bandwidth: `{value}` {}", if *rounds_to_zero { "rounds to 0 bytes per second" } else { "is zero" })]
    ZeroBandwidth {
        span: Span,
        key: String,
        value: String,
        /// The value is above zero as written but below one byte per second.
        rounds_to_zero: bool,
    },
    #[error("unknown {key} `{found}`")]
    UnknownChoice {
        span: Span,
        key: String,
        found: String,
        choices: &'static str,
        suggestion: Option<String>,
    },
    #[error("`{key}` = {value} is outside {min} to {max}")]
    DurationOutOfRange {
        span: Span,
        key: String,
        value: String,
        min: &'static str,
        max: &'static str,
        /// Below the range (else above it).
        below: bool,
    },
    #[error("{what}: not supported yet")]
    Unsupported {
        span: Span,
        what: String,
        hint: &'static str,
    },

    // ---- layer rules ----
    #[error("`{key}` = {value} is above the limit of {max}")]
    AboveLimit {
        span: Span,
        key: String,
        value: u32,
        max: u32,
    },
    #[error("`{key}` = {value} tokens is above the layer's max_tokens of {max_tokens}")]
    AboveMaxTokens {
        span: Span,
        key: String,
        value: u32,
        max_tokens: u32,
    },
    #[error("`{key}` = {value} is not a multiple of {alignment}")]
    Misaligned {
        span: Span,
        key: String,
        value: u32,
        alignment: u32,
    },
    #[error("experts = {value} is above the {max} experts the routing kernel supports")]
    TooManyExperts { span: Span, value: u32, max: u32 },
    #[error(
        "max_tokens × top_k = {max_tokens} × {top_k} (token, k) pairs do not fit the kernels' 32-bit index (at most {max_pairs})"
    )]
    TooManyPairs {
        span: Span,
        max_tokens: u32,
        top_k: u32,
        top_k_span: Span,
        max_pairs: u64,
    },
    #[error("{experts} experts cannot be spread evenly over {degree} expert-parallel ranks")]
    ExpertsNotDivisible {
        span: Span,
        experts: u32,
        degree: u32,
        degree_span: Span,
    },
    #[error("top_k = {top_k} is out of range: it must be between 1 and experts = {experts}")]
    TopKOutOfRange {
        span: Span,
        top_k: u32,
        experts: u32,
    },
    #[error(
        "the shared experts' FFN, count × ffn = {count} × {ffn}, is not a multiple of the routed experts' ffn = {routed_ffn}"
    )]
    SharedExpertsNotSlices {
        span: Span,
        count: u32,
        ffn: u32,
        routed_ffn: u32,
        routed_span: Span,
    },
    #[error(
        "the shared experts' FFN, count × ffn = {count} × {ffn}, is {slices} times the routed experts' ffn = {routed_ffn}, above the {max} the kernels run"
    )]
    TooManySharedSlices {
        span: Span,
        count: u32,
        ffn: u32,
        routed_ffn: u32,
        slices: u64,
        max: u32,
    },
    #[error("router groups = {groups} does not divide experts = {experts}")]
    GroupsDoNotDivideExperts {
        span: Span,
        groups: u32,
        experts: u32,
    },
    #[error("groups_kept = {kept} is out of range: it must be between 1 and groups = {groups}")]
    GroupsKeptOutOfRange { span: Span, kept: u32, groups: u32 },
    #[error("top_k = {top_k} exceeds the {eligible} experts the kept groups hold")]
    TopKExceedsKeptGroups {
        span: Span,
        top_k: u32,
        eligible: u32,
    },
    #[error("`groups_kept` is set without `groups`")]
    GroupsKeptWithoutGroups { span: Span },
    #[error("`normalize` does not apply to `scoring = topk_softmax`")]
    NormalizeWithTopkSoftmax { span: Span, scoring_span: Span },
    #[error("`{key}` tile {dimension} = {value} is not a positive multiple of 16")]
    TileNotAligned {
        span: Span,
        key: String,
        dimension: &'static str,
        value: u32,
    },
    #[error(
        "expert-parallel degree {degree} does not match the {ranks} ranks of topology `{topology}`"
    )]
    RanksMismatch {
        span: Span,
        degree: u32,
        ranks: u32,
        topology: String,
        topology_span: Span,
    },
    #[error(
        "virtual ranks share one GPU, but topology `{topology}` has {gpus} GPUs, neither one nor one per virtual rank"
    )]
    VirtualRanksNeedOneGpu {
        span: Span,
        topology: String,
        gpus: u64,
    },
    #[error("topology `{topology}` has 2^32 ranks or more")]
    TooManyRanks { span: Span, topology: String },
    #[error(
        "topology `{topology}` has {gpus_per_node} GPUs per node on several nodes; across nodes a node holds at most 32 (a token's visits to a node are one 32-bit mask)"
    )]
    TooManyGpusPerNode {
        span: Span,
        topology: String,
        gpus_per_node: u32,
    },
    #[error("unknown topology `{name}`")]
    UnknownTopology {
        span: Span,
        name: String,
        suggestion: Option<String>,
        known: String,
    },
    #[error("schedule hint `{setting}` cannot be planned for the {target}: {reason}")]
    InfeasibleHint {
        span: Span,
        /// The hint as written: `gemm1.tile = 64x96x64`.
        setting: String,
        target: String,
        /// The planner's reason.
        reason: String,
        /// What would work instead, found by asking the planner about nearby hints.
        suggestion: String,
    },

    // ---- planning ----
    #[error("{message}")]
    PlanRefused {
        span: Span,
        /// The planner's error, as it words it.
        message: String,
        hint: String,
        /// The schedule hint the planner refused, when the error is about one.
        hint_span: Option<Span>,
    },

    // ---- limits ----
    #[error("too many errors: stopped looking after {MAX_ERRORS}")]
    TooManyErrors { span: Span },
}

impl Error {
    /// The bytes of the source this error is about.
    pub fn span(&self) -> Span {
        use Error::*;
        match self {
            InvalidUtf8 { span }
            | InvalidCharacter { span, .. }
            | HyphenInName { span, .. }
            | NumberGluedToName { span, .. }
            | UnknownUnit { span, .. }
            | UnexpectedToken { span, .. }
            | TrailingComma { span, .. }
            | StrayWord { span, .. }
            | UnexpectedEnd { span, .. }
            | UnknownItemKind { span, .. }
            | DuplicateItem { span, .. }
            | UnknownKey { span, .. }
            | ConfigNameElsewhere { span, .. }
            | MisplacedKey { span, .. }
            | DuplicateKey { span, .. }
            | MissingKey { span, .. }
            | ExpectedSection { span, .. }
            | ExpectedSetting { span, .. }
            | WrongValueCount { span, .. }
            | WrongValueKind { span, .. }
            | WrongUnit { span, .. }
            | BitRateUnit { span, .. }
            | MissingUnit { span, .. }
            | NumberTooLarge { span, .. }
            | NotAnInteger { span, .. }
            | TooSmall { span, .. }
            | NotPositive { span, .. }
            | RealTooLarge { span, .. }
            | ZeroBandwidth { span, .. }
            | UnknownChoice { span, .. }
            | DurationOutOfRange { span, .. }
            | Unsupported { span, .. }
            | AboveLimit { span, .. }
            | AboveMaxTokens { span, .. }
            | TooManyExperts { span, .. }
            | TooManyPairs { span, .. }
            | Misaligned { span, .. }
            | ExpertsNotDivisible { span, .. }
            | TopKOutOfRange { span, .. }
            | SharedExpertsNotSlices { span, .. }
            | TooManySharedSlices { span, .. }
            | GroupsDoNotDivideExperts { span, .. }
            | GroupsKeptOutOfRange { span, .. }
            | TopKExceedsKeptGroups { span, .. }
            | GroupsKeptWithoutGroups { span }
            | NormalizeWithTopkSoftmax { span, .. }
            | TileNotAligned { span, .. }
            | RanksMismatch { span, .. }
            | VirtualRanksNeedOneGpu { span, .. }
            | TooManyRanks { span, .. }
            | TooManyGpusPerNode { span, .. }
            | UnknownTopology { span, .. }
            | InfeasibleHint { span, .. }
            | PlanRefused { span, .. }
            | TooManyErrors { span } => *span,
        }
    }

    /// Other places worth showing, with what they are.
    pub fn related(&self) -> Vec<(Span, String)> {
        match self {
            Error::DuplicateItem { first, .. } => vec![(*first, "first defined here".to_string())],
            Error::DuplicateKey { first, .. } => vec![(*first, "first set here".to_string())],
            Error::ExpertsNotDivisible {
                degree_span,
                degree,
                ..
            } => {
                vec![(*degree_span, format!("{degree} expert-parallel ranks"))]
            }
            Error::RanksMismatch {
                topology_span,
                ranks,
                ..
            } => {
                vec![(
                    *topology_span,
                    format!("this topology provides {ranks} ranks"),
                )]
            }
            Error::TooManyPairs {
                top_k_span, top_k, ..
            } => vec![(*top_k_span, format!("{top_k} pairs per token"))],
            Error::SharedExpertsNotSlices {
                routed_span,
                routed_ffn,
                ..
            } => vec![(
                *routed_span,
                format!("each routed expert's FFN: {routed_ffn}"),
            )],
            Error::NormalizeWithTopkSoftmax { scoring_span, .. } => vec![(
                *scoring_span,
                "the weights are a softmax over the chosen experts".to_string(),
            )],
            Error::PlanRefused {
                hint_span: Some(hint_span),
                ..
            } => vec![(*hint_span, "the schedule hint refused".to_string())],
            _ => Vec::new(),
        }
    }

    /// How to fix it. Every error has one.
    pub fn hint(&self) -> String {
        use Error::*;
        let did_you_mean = |suggestion: &Option<String>| {
            suggestion.as_ref().map(|s| format!("did you mean `{s}`?"))
        };
        match self {
            InvalidUtf8 { .. } => "save the file as UTF-8 text".into(),
            HyphenInName {
                with_underscores, ..
            } => format!("write `{with_underscores}`"),
            InvalidCharacter { found: '-', .. } => {
                "numbers in a `.moe` file have no sign: every quantity is zero or more".into()
            }
            InvalidCharacter {
                found: '\u{b5}' | '\u{3bc}',
                ..
            } => "microseconds are written `us`, after a space".into(),
            InvalidCharacter { found, .. } if found.is_alphabetic() => {
                "names are ASCII: letters `A-Z` `a-z`, digits and `_`, starting with a letter \
                 or `_`"
                    .into()
            }
            InvalidCharacter { .. } => {
                "a `.moe` file holds names, numbers with units, tile shapes like `128x128x64`, \
                 `{ } = , .` and comments starting with `#` or `//`"
                    .into()
            }
            NumberGluedToName { number, word, .. } => format!(
                "`.moe` numbers take no suffix: write the number in full, and a unit \
                 (`tokens`, `GB/s`, `us`, `ms`, `ns`), usually after a space; the file is read \
                 on as if `{number}` stood without `{word}`"
            ),
            UnknownUnit { number, word, .. } => format!(
                "{}; the file is read on as if `{number}` stood alone",
                unit_suggestion(number, word)
            ),
            UnexpectedToken { found, .. } if found.starts_with("unit `") => {
                let unit = found.trim_start_matches("unit ");
                format!(
                    "{unit} is a unit, and units are reserved words: give the item or key \
                     another name, such as `{}_1`",
                    unit.trim_matches('`')
                )
            }
            TrailingComma { .. } => "remove this `,`: a setting's values continue after a comma \
                                     (`nvlink = 450 GB/s, 3 us`), and a new setting needs none"
                .into(),
            StrayWord { word, value, unit, .. } => match unit {
                Some(unit) => format!("did you mean `{value} {unit}`?"),
                None => format!(
                    "a setting holds one value, or several separated by `,` (`nvlink = 450 GB/s, \
                     3 us`); delete `{word}`, or give it a line of its own as `{word} = ...`"
                ),
            },
            UnexpectedToken { .. } | UnexpectedEnd { .. } => {
                "settings read `key = value`, sections `name { ... }`, items `layer NAME { ... }` \
                 or `topology NAME { ... }`"
                    .into()
            }
            UnknownItemKind { suggestion, .. } => did_you_mean(suggestion)
                .unwrap_or_else(|| "start the item with `layer` or `topology`".into()),
            DuplicateItem { .. } => "rename one of them or delete the copy".into(),
            UnknownKey {
                suggestion, known, ..
            } => did_you_mean(suggestion)
                .unwrap_or_else(|| format!("the keys allowed here are: {known}")),
            ConfigNameElsewhere { ours, home, .. } => format!("write `{ours}` in {home}"),
            MisplacedKey {
                key,
                belongs_in,
                suggestion,
                ..
            } => {
                let move_it = format!("move `{key}` into {belongs_in}");
                match suggestion {
                    Some(suggestion) => format!("{move_it}, or did you mean `{suggestion}`?"),
                    None => move_it,
                }
            }
            DuplicateKey { .. } => "keep one of the two settings".into(),
            MissingKey { example, .. } => format!("add `{example}`"),
            ExpectedSection { key, .. } => format!("write `{key} {{ ... }}`"),
            ExpectedSetting { key, .. } => format!("write `{key} = ...`"),
            WrongValueCount {
                expected, found, ..
            } => {
                if expected.starts_with("one ") && *found > 1 {
                    "write a single value: this key takes no list".into()
                } else {
                    format!("give exactly {expected}")
                }
            }
            WrongValueKind { hint, .. } => hint.clone(),
            WrongUnit { expected, unit, .. } if expected.starts_with("a plain number") => {
                format!("drop `{unit}`: write the number alone")
            }
            WrongUnit { .. } => {
                "write the number with a unit of the right kind, e.g. `450 GB/s` for a bandwidth, \
                 `3 us` for a latency, `64 tokens` or a plain number for a token count"
                    .into()
            }
            BitRateUnit {
                byte_unit,
                conversion,
                ..
            } => format!(
                "bandwidth is in bytes per second: write {byte_unit}; {conversion} (8 bits to a byte)"
            ),
            MissingUnit { expected, .. } => format!("write the number with {expected}"),
            NumberTooLarge { .. } => "use a smaller number".into(),
            NotAnInteger { value, .. } => {
                let digits: String = value.chars().filter(|c| *c != '_').collect();
                match digits.parse::<f64>() {
                    // An exponent (`4e3`) of a whole number: the digits it means.
                    Ok(number)
                        if number.fract() == 0.0 && number.abs() < 1e18 && !digits.contains('.') =>
                    {
                        format!("write it in digits: `{}`", number as i64)
                    }
                    _ => "drop the fraction".into(),
                }
            }
            TooSmall { min, .. } => format!("use {min} or more"),
            NotPositive { key, .. } => format!(
                "`{key}` multiplies the 32-bit routing weights: use a positive factor such as \
                 `1.0` (no scaling) or `2.5` (DeepSeek-V3)"
            ),
            RealTooLarge { key, .. } => format!(
                "`{key}` multiplies the 32-bit routing weights, which would become infinite; \
                 real models use factors near 1 (DeepSeek-V3: 2.5)"
            ),
            ZeroBandwidth { .. } => {
                "a link must move data: give it a positive bandwidth such as `450 GB/s` \
                 (bandwidths are rounded to whole bytes per second)"
                    .into()
            }
            UnknownChoice {
                suggestion,
                choices,
                ..
            } => did_you_mean(suggestion).unwrap_or_else(|| format!("choose one of: {choices}")),
            DurationOutOfRange { below: true, min, .. } => format!(
                "use at least {min}: a shorter wait would report correct calls as time-outs; the \
                 default, about 2 s, suits every correct call"
            ),
            DurationOutOfRange {
                below: false, max, ..
            } => format!(
                "use at most {max}: a kernel that waits this long for one flag reports a \
                 time-out instead of hanging; the default, about 2 s, suits every correct call, \
                 and under a sanitizer or debugger about `60_000 ms` does"
            ),
            Unsupported { hint, .. } => (*hint).to_string(),
            AboveLimit { max, .. } => format!(
                "moeforge keeps every size it derives within 64 bits, so this is capped at {max}; \
                 no real model comes close"
            ),
            TooManyExperts { max, .. } => format!(
                "the routing kernel counts (token, k) pairs per expert in one thread block's \
                 shared memory, {max} entries; use at most {max} routed experts"
            ),
            AboveMaxTokens { key, max_tokens, .. } => format!(
                "a call holds at most max_tokens tokens, so `{key}` counts at most that many: \
                 write `{key} = {max_tokens} tokens` or less, or raise `max_tokens`"
            ),
            TooManyPairs {
                top_k, max_pairs, ..
            } => format!(
                "the kernels index (token, k) pairs, row offsets and `expert_offsets` as 32-bit \
                 `int`; with top_k = {top_k}, use `max_tokens = {}` or less and split larger \
                 batches into several calls",
                max_pairs / u64::from((*top_k).max(1))
            ),
            Misaligned {
                value, alignment, ..
            } => {
                let below = value / alignment * alignment;
                let above = below + alignment;
                let nearest = if below == 0 {
                    format!("the smallest is {above}")
                } else {
                    format!("the nearest are {below} and {above}")
                };
                format!(
                    "kernels move rows as 16-byte vectors of bf16 and tile the reduction {alignment} deep, \
                     so sizes must be multiples of {alignment}; {nearest}"
                )
            }
            ExpertsNotDivisible {
                experts, degree, ..
            } => format!(
                "each rank holds experts / degree experts; choose a degree that divides {experts} \
                 (or pad the experts to a multiple of {degree})"
            ),
            TopKOutOfRange { .. } => "a token goes to at least one and at most all experts".into(),
            SharedExpertsNotSlices { routed_ffn, .. } => format!(
                "moeforge runs the shared experts in the routed experts' grouped GEMMs, as \
                 always-hit experts of ffn = {routed_ffn} each (an MLP of FFN n·F is the sum of n \
                 MLPs of FFN F); make count × ffn a multiple of {routed_ffn}, as DeepSeek-V3 \
                 (1 × 2048 beside 2048) and Qwen2-MoE (1 × 5632 beside 1408) are"
            ),
            TooManySharedSlices { max, routed_ffn, .. } => format!(
                "each routed-FFN-sized slice of the shared experts is one more always-hit expert \
                 in every call; at most {max} slices (count × ffn up to {})",
                u64::from(*max) * u64::from(*routed_ffn)
            ),
            GroupsDoNotDivideExperts { experts, .. } => format!(
                "every group holds the same number of experts; choose a divisor of {experts}"
            ),
            GroupsKeptOutOfRange { .. } => {
                "keep at least one group and no more than there are".into()
            }
            TopKExceedsKeptGroups { .. } => {
                "raise `groups_kept`, or lower `top_k` to at most groups_kept × experts / groups"
                    .into()
            }
            GroupsKeptWithoutGroups { .. } => "add `groups = N`, or delete `groups_kept`".into(),
            NormalizeWithTopkSoftmax { .. } => {
                "a softmax over the k chosen logits already sums to one: delete `normalize` \
                 (or use `scoring = softmax`, a softmax over all experts, to choose renormalising)"
                    .into()
            }
            TileNotAligned { .. } => {
                "tensor-core instructions work on 16×16 fragments; use multiples of 16 such as 64 or 128"
                    .into()
            }
            RanksMismatch { ranks, .. } => format!(
                "every rank holds a slice of the experts; set `parallel {{ expert = {ranks} }}` or change the topology"
            ),
            VirtualRanksNeedOneGpu { .. } => {
                "set `gpus_per_node = 1` and `nodes = 1`, or as many GPUs as virtual ranks to emulate nodes on one GPU (`gpus_per_node = 2`, `nodes = 2` for `virtual_ranks = 4`), or drop `virtual_ranks`".into()
            }
            TooManyRanks { .. } => "use fewer GPUs per node or fewer nodes".into(),
            TooManyGpusPerNode { .. } => {
                "use at most 32 GPUs per node (more nodes of fewer GPUs), or one node".into()
            }
            UnknownTopology {
                suggestion, known, ..
            } => did_you_mean(suggestion).unwrap_or_else(|| {
                if known.is_empty() {
                    "define it in this file: `topology NAME { ... }`".into()
                } else {
                    format!("the topologies in this file are: {known}")
                }
            }),
            InfeasibleHint { suggestion, .. } => suggestion.clone(),
            PlanRefused { hint, .. } => hint.clone(),
            TooManyErrors { .. } => {
                "fix the errors above first; is this really a `.moe` file?".into()
            }
        }
    }
}

/// Every error of one file, with the file's name and text so that they can be rendered.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostics {
    pub file_name: String,
    pub source: String,
    pub errors: Vec<Error>,
}

impl Diagnostics {
    /// Renders every error (up to [`MAX_RENDERED_ERRORS`]) as plain text with file, line,
    /// column, the source line, a caret under the span and the hint.
    pub fn render(&self) -> String {
        let text = lf_line_breaks(&self.source);
        let file = SimpleFile::new(self.file_name.as_str(), text.as_ref());
        let config = term::Config::default();
        let mut out = String::new();
        for (error, diagnostic) in self.errors.iter().zip(self.to_codespan(&text)) {
            match term::emit_into_string(&config, &file, &diagnostic) {
                Ok(rendered) => out.push_str(&rendered),
                Err(_) => out.push_str(&format!("error: {error}\n")),
            }
        }
        out.push_str(&self.omitted_note());
        out
    }

    /// Writes the diagnostics to stderr, in colour when `colour` is set (the CLI sets it
    /// when stderr is a terminal); otherwise exactly [`Diagnostics::render`]'s text.
    pub fn emit_to_stderr(&self, colour: bool) {
        if !colour {
            eprint!("{}", self.render());
            return;
        }
        let text = lf_line_breaks(&self.source);
        let file = SimpleFile::new(self.file_name.as_str(), text.as_ref());
        let config = term::Config::default();
        let styles = term::Styles::default();
        let stream = term::termcolor::StandardStream::stderr(term::termcolor::ColorChoice::Always);
        let mut writer = term::StylesWriter::new(stream.lock(), &styles);
        for diagnostic in self.to_codespan(&text) {
            // A closed stderr leaves nobody to tell.
            let _ = term::emit_to_write_style(&mut writer, &config, &file, &diagnostic);
        }
        eprint!("{}", self.omitted_note());
    }

    /// The first [`MAX_RENDERED_ERRORS`] errors as codespan diagnostics: message, caret
    /// labels (unless the line is too long to echo), and the hint as a note. `text` is the
    /// source with [`lf_line_breaks`].
    fn to_codespan<'a>(&'a self, text: &'a str) -> impl Iterator<Item = Diagnostic<()>> + 'a {
        self.errors
            .iter()
            .take(MAX_RENDERED_ERRORS)
            .map(move |error| {
                let span = clamp(error.span(), text);
                let mut diagnostic = Diagnostic::error().with_message(error.to_string());
                let mut notes = Vec::new();
                if line_is_short(text, span.start) {
                    let mut labels = vec![Label::primary((), span)];
                    for (related, message) in error.related() {
                        let related = clamp(related, text);
                        if line_is_short(text, related.start) {
                            labels.push(Label::secondary((), related).with_message(message));
                        }
                    }
                    diagnostic = diagnostic.with_labels(labels);
                } else {
                    let (line, column) = line_and_column(text, span.start);
                    notes.push(format!(
                        "at {}:{line}:{column} (the line is too long to show)",
                        self.file_name
                    ));
                }
                notes.push(format!("hint: {}", error.hint()));
                diagnostic.with_notes(notes)
            })
    }

    fn omitted_note(&self) -> String {
        if self.errors.len() > MAX_RENDERED_ERRORS {
            format!(
                "note: {} more errors in {} not shown\n",
                self.errors.len() - MAX_RENDERED_ERRORS,
                self.file_name
            )
        } else {
            String::new()
        }
    }
}

/// Lines longer than this are not echoed under a diagnostic (a 10 MB line would be).
const MAX_ECHOED_LINE: usize = 500;

fn line_is_short(source: &str, offset: usize) -> bool {
    let start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = source[offset..]
        .find('\n')
        .map_or(source.len(), |i| offset + i);
    end - start <= MAX_ECHOED_LINE
}

/// `source` with every lone `\r` (an old Mac line break) turned into `\n`. codespan-reporting
/// counts lines by `\n` only (it trims the `\r` of `\r\n` itself), so diagnostics are
/// rendered from this text; it has the same length and character boundaries, so every span
/// still points at the same characters.
pub fn lf_line_breaks(source: &str) -> Cow<'_, str> {
    if !source.contains('\r') {
        return Cow::Borrowed(source);
    }
    let mut text = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        let lone_cr = c == '\r' && chars.peek() != Some(&'\n');
        text.push(if lone_cr { '\n' } else { c });
    }
    Cow::Owned(text)
}

/// 1-based line and column (in characters) of a byte offset; `\n`, `\r\n` and a lone `\r`
/// each end a line.
pub fn line_and_column(source: &str, offset: usize) -> (usize, usize) {
    let text = lf_line_breaks(source);
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// Keeps a span inside the text and on character boundaries, so rendering cannot fail.
fn clamp(span: Span, source: &str) -> std::ops::Range<usize> {
    let mut start = span.start.min(source.len());
    let mut end = span.end.clamp(start, source.len());
    while !source.is_char_boundary(start) {
        start -= 1;
    }
    while !source.is_char_boundary(end) {
        end += 1;
    }
    start..end
}

impl std::fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render())
    }
}

impl std::error::Error for Diagnostics {}

/// Text quoted in a message, shortened (fuzzers write names a megabyte long).
pub fn short(text: &str) -> String {
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// The closest of `candidates` to `word`, if it is close enough to be a likely typo. Case
/// is ignored (`SwiGLU` suggests `swiglu`): every word of the language is lower case.
pub fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let length = word.chars().count();
    if length > 64 {
        return None;
    }
    let limit = (length / 3).max(1);
    let word = word.to_lowercase();
    candidates
        .into_iter()
        .map(|candidate| (edit_distance(&word, &candidate.to_lowercase()), candidate))
        .filter(|(distance, _)| *distance <= limit)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate.to_string())
}

/// Levenshtein distance between two short words (by characters).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current.push(substitution.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

/// What to write instead of `number word`, where `word` reads as a unit `.moe` does not
/// have (`front::lexer::reads_as_unit`): the value in a unit it has where one fits.
fn unit_suggestion(number: &str, word: &str) -> String {
    let value = number.replace('_', "").parse::<f64>().ok();
    let in_ms = |factor: f64| match value {
        Some(value) => format!(
            "durations and latencies are in `ns`, `us` or `ms`: `{number} {word}` is `{} ms`",
            // Rounded to a millionth, so that `2.3 s` reads 2300, not 2299.9999999999995.
            (value * factor * 1e6).round() / 1e6
        ),
        None => "durations and latencies are in `ns`, `us` or `ms`".into(),
    };
    let lower = word.to_ascii_lowercase();
    match lower.as_str() {
        "s" | "sec" | "secs" | "second" | "seconds" => in_ms(1e3),
        "min" | "mins" | "minute" | "minutes" => in_ms(60e3),
        "h" | "hr" | "hrs" | "hour" | "hours" => in_ms(3600e3),
        "usec" | "usecs" | "msec" | "msecs" | "nsec" | "nsecs" => {
            format!("write `{number} {}s`", &lower[..1])
        }
        "ps" => "latencies are in `ns`, `us` or `ms`, and `.moe` keeps whole nanoseconds".into(),
        "tok" | "toks" => format!("write `{number} tokens`"),
        "bytes" => format!("bandwidth is in bytes per second: write `{number} B/s`"),
        _ => {
            // Bits where the word's `b` is lower case (`Gb`, `Mbps`), bytes where it is `B`
            // (`GB`, `GBps`, `KiB`): `.moe` reads `Gb/s` as bits too.
            let stem = if lower.ends_with("ps") {
                &word[..word.len() - 2]
            } else {
                word
            };
            let bits = stem.ends_with('b');
            // `k`, `Ki`, `G`, ... as `.moe` spells it: the first letter upper case.
            let mut letters = stem[..stem.len() - 1].chars();
            let prefix = letters.next().map_or(String::new(), |first| {
                first.to_ascii_uppercase().to_string() + &letters.as_str().to_ascii_lowercase()
            });
            match value {
                Some(value) if bits => format!(
                    "bandwidth is in bytes per second: `{number} {word}` as bits per second is \
                     `{} {prefix}B/s` (8 bits to a byte)",
                    value / 8.0
                ),
                None if bits => format!("bandwidth is in bytes per second: write `{prefix}B/s`"),
                _ => format!("bandwidth is in bytes per second: write `{number} {prefix}B/s`"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One error of each variant, in declaration order.
    fn one_of_each() -> Vec<Error> {
        let span = Span::new(0, 1);
        let text = String::from;
        vec![
            Error::InvalidUtf8 { span },
            Error::InvalidCharacter { span, found: '@' },
            Error::UnexpectedToken {
                span,
                found: text("`}`"),
                expected: text("a name"),
            },
            Error::UnexpectedEnd {
                span,
                expected: text("`}`"),
            },
            Error::UnknownItemKind {
                span,
                found: text("lyer"),
                suggestion: None,
            },
            Error::DuplicateItem {
                span,
                kind: "layer",
                name: text("a"),
                first: span,
            },
            Error::UnknownKey {
                span,
                key: text("zzz"),
                section: text("layer `a`"),
                suggestion: None,
                known: text("hidden"),
            },
            Error::DuplicateKey {
                span,
                key: text("hidden"),
                section: text("layer `a`"),
                first: span,
            },
            Error::MissingKey {
                span,
                key: "hidden",
                section: text("layer `a`"),
                example: "hidden = 4096".into(),
            },
            Error::MisplacedKey {
                span,
                key: text("stages"),
                written_in: text("layer `a`"),
                belongs_in: text("the layer's `schedule { }` section"),
                suggestion: None,
            },
            Error::ExpectedSection {
                span,
                key: text("router"),
            },
            Error::ExpectedSetting {
                span,
                key: text("hidden"),
            },
            Error::WrongValueCount {
                span,
                key: text("hidden"),
                expected: "one whole number",
                found: 2,
            },
            Error::WrongValueKind {
                span,
                key: text("hidden"),
                expected: text("a whole number"),
                found: text("the word `x`"),
                hint: text("write digits"),
            },
            Error::WrongUnit {
                span,
                key: text("hidden"),
                expected: text("a plain number"),
                unit: "us",
                unit_dimension: "a latency",
            },
            Error::BitRateUnit {
                span,
                key: text("nvlink"),
                unit: "Gb/s",
                byte_unit: "GB/s",
                conversion: text("400 Gb/s = 50 GB/s"),
            },
            Error::MissingUnit {
                span,
                key: text("nvlink"),
                expected: "a latency (ns, us, ms)",
            },
            Error::NumberTooLarge {
                span,
                key: text("hidden"),
                value: text("99999999999"),
                bits: 32,
                max: u64::from(u32::MAX),
                unit: "",
            },
            Error::NotAnInteger {
                span,
                key: text("hidden"),
                value: text("2.5"),
            },
            Error::TooSmall {
                span,
                key: text("hidden"),
                value: 0,
                min: 1,
            },
            Error::NotPositive {
                span,
                key: text("scale"),
                value: text("0"),
                rounds_to_zero: false,
            },
            Error::RealTooLarge {
                span,
                key: text("scale"),
                value: text("1e39"),
            },
            Error::ZeroBandwidth {
                span,
                key: text("nvlink"),
                value: text("0 GB/s"),
                rounds_to_zero: false,
            },
            Error::UnknownChoice {
                span,
                key: text("activation"),
                found: text("swish"),
                choices: "swiglu, geglu",
                suggestion: None,
            },
            Error::Unsupported {
                span,
                what: text("fp8"),
                hint: "use bf16",
            },
            Error::AboveLimit {
                span,
                key: text("hidden"),
                value: 1 << 21,
                max: 1 << 20,
            },
            Error::TooManyExperts {
                span,
                value: 2048,
                max: 1024,
            },
            Error::TooManyPairs {
                span,
                max_tokens: u32::MAX,
                top_k: 8,
                top_k_span: span,
                max_pairs: 1 << 31,
            },
            Error::Misaligned {
                span,
                key: text("hidden"),
                value: 100,
                alignment: 64,
            },
            Error::ExpertsNotDivisible {
                span,
                experts: 9,
                degree: 2,
                degree_span: span,
            },
            Error::TopKOutOfRange {
                span,
                top_k: 9,
                experts: 8,
            },
            Error::GroupsDoNotDivideExperts {
                span,
                groups: 3,
                experts: 8,
            },
            Error::GroupsKeptOutOfRange {
                span,
                kept: 9,
                groups: 8,
            },
            Error::TopKExceedsKeptGroups {
                span,
                top_k: 8,
                eligible: 4,
            },
            Error::GroupsKeptWithoutGroups { span },
            Error::NormalizeWithTopkSoftmax {
                span,
                scoring_span: span,
            },
            Error::TileNotAligned {
                span,
                key: text("gemm1.tile"),
                dimension: "m",
                value: 10,
            },
            Error::RanksMismatch {
                span,
                degree: 2,
                ranks: 8,
                topology: text("node"),
                topology_span: span,
            },
            Error::VirtualRanksNeedOneGpu {
                span,
                topology: text("node"),
                gpus: 8,
            },
            Error::TooManyRanks {
                span,
                topology: text("node"),
            },
            Error::TooManyGpusPerNode {
                span,
                topology: text("node"),
                gpus_per_node: 64,
            },
            Error::UnknownTopology {
                span,
                name: text("nod"),
                suggestion: None,
                known: String::new(),
            },
            Error::InfeasibleHint {
                span,
                setting: text("stages = 1"),
                target: text("NVIDIA H200"),
                reason: text("pipeline stages must be between 2 and 8"),
                suggestion: text("use 2 to 8"),
            },
            Error::PlanRefused {
                span,
                message: text("layer `a`: no tile fits"),
                hint: text("lower `stages`"),
                hint_span: None,
            },
            Error::SharedExpertsNotSlices {
                span,
                count: 1,
                ffn: 1000,
                routed_ffn: 768,
                routed_span: span,
            },
            Error::TooManySharedSlices {
                span,
                count: 64,
                ffn: 4096,
                routed_ffn: 256,
                slices: 1024,
                max: 64,
            },
            Error::DurationOutOfRange {
                span,
                key: text("flag_timeout"),
                value: text("10 us"),
                min: "1 ms",
                max: "3_600_000 ms (an hour)",
                below: true,
            },
            Error::TooManyErrors { span },
            Error::AboveMaxTokens {
                span,
                key: text("dispatch_chunk"),
                value: 1024,
                max_tokens: 512,
            },
            Error::NumberGluedToName {
                span,
                number: text("64"),
                word: text("k"),
            },
            Error::UnknownUnit {
                span,
                number: text("3"),
                word: text("s"),
            },
            Error::HyphenInName {
                span,
                written: text("top-k"),
                with_underscores: text("top_k"),
            },
            Error::TrailingComma {
                span,
                key: text("nvlink"),
            },
            Error::ConfigNameElsewhere {
                span,
                key: text("norm_topk_prob"),
                written_in: text("layer `a`"),
                ours: "normalize",
                home: "the layer's `router { }` section",
            },
            Error::StrayWord {
                span,
                word: text("tokenss"),
                value: text("64"),
                unit: Some(text("tokens")),
            },
        ]
    }

    /// How many variants [`Error`] has: the indices [`variant_index`] gives are `0..VARIANTS`.
    const VARIANTS: usize = 55;

    /// The position of `error`'s variant in the enum. The match has no catch-all, so a new
    /// variant does not compile until it is listed here (and [`VARIANTS`] raised), and the
    /// test below then asks for a sample of it.
    fn variant_index(error: &Error) -> usize {
        use Error::*;
        match error {
            InvalidUtf8 { .. } => 0,
            InvalidCharacter { .. } => 1,
            HyphenInName { .. } => 51,
            TrailingComma { .. } => 52,
            ConfigNameElsewhere { .. } => 53,
            StrayWord { .. } => 54,
            UnexpectedToken { .. } => 2,
            UnexpectedEnd { .. } => 3,
            UnknownItemKind { .. } => 4,
            DuplicateItem { .. } => 5,
            UnknownKey { .. } => 6,
            DuplicateKey { .. } => 7,
            MissingKey { .. } => 8,
            MisplacedKey { .. } => 9,
            ExpectedSection { .. } => 10,
            ExpectedSetting { .. } => 11,
            WrongValueCount { .. } => 12,
            WrongValueKind { .. } => 13,
            WrongUnit { .. } => 14,
            BitRateUnit { .. } => 15,
            MissingUnit { .. } => 16,
            NumberTooLarge { .. } => 17,
            NotAnInteger { .. } => 18,
            TooSmall { .. } => 19,
            NotPositive { .. } => 20,
            RealTooLarge { .. } => 21,
            ZeroBandwidth { .. } => 22,
            UnknownChoice { .. } => 23,
            Unsupported { .. } => 24,
            AboveLimit { .. } => 25,
            TooManyExperts { .. } => 26,
            TooManyPairs { .. } => 27,
            Misaligned { .. } => 28,
            ExpertsNotDivisible { .. } => 29,
            TopKOutOfRange { .. } => 30,
            GroupsDoNotDivideExperts { .. } => 31,
            GroupsKeptOutOfRange { .. } => 32,
            TopKExceedsKeptGroups { .. } => 33,
            GroupsKeptWithoutGroups { .. } => 34,
            NormalizeWithTopkSoftmax { .. } => 35,
            TileNotAligned { .. } => 36,
            RanksMismatch { .. } => 37,
            VirtualRanksNeedOneGpu { .. } => 38,
            TooManyRanks { .. } => 39,
            TooManyGpusPerNode { .. } => 40,
            UnknownTopology { .. } => 41,
            InfeasibleHint { .. } => 42,
            PlanRefused { .. } => 43,
            SharedExpertsNotSlices { .. } => 44,
            TooManySharedSlices { .. } => 45,
            DurationOutOfRange { .. } => 46,
            TooManyErrors { .. } => 47,
            AboveMaxTokens { .. } => 48,
            NumberGluedToName { .. } => 49,
            UnknownUnit { .. } => 50,
        }
    }

    #[test]
    fn every_variant_has_a_message_and_a_hint() {
        let samples = one_of_each();
        let indices: Vec<usize> = samples.iter().map(variant_index).collect();
        let every_variant: Vec<usize> = (0..VARIANTS).collect();
        assert_eq!(indices, every_variant, "one sample per variant, in order");
        for error in &samples {
            assert!(
                !error.to_string().trim().is_empty(),
                "{error:?} has a message"
            );
            let hint = error.hint();
            assert!(!hint.trim().is_empty(), "{error:?} has a hint");
            assert_ne!(
                hint,
                error.to_string(),
                "{error:?}: the hint is not the message"
            );
        }
    }

    #[test]
    fn suggests_close_words_only() {
        assert_eq!(suggest("hiden", ["hidden", "ffn"]), Some("hidden".into()));
        assert_eq!(suggest("top_k", ["top_k"]), Some("top_k".into()));
        assert_eq!(suggest("zzzzzz", ["hidden", "ffn"]), None);
        assert_eq!(
            suggest("SwiGLU", ["swiglu", "geglu"]),
            Some("swiglu".into())
        );
        assert_eq!(suggest("Hiden", ["hidden", "ffn"]), Some("hidden".into()));
    }

    #[test]
    fn lines_end_at_lf_crlf_and_lone_cr() {
        for source in ["ab\ncd\nef", "ab\r\ncd\r\nef", "ab\rcd\ref"] {
            let offset = source.find('f').unwrap_or_default();
            assert_eq!(line_and_column(source, offset), (3, 2), "{source:?}");
        }
        assert_eq!(lf_line_breaks("a\rb\r\nc"), "a\nb\r\nc");
    }
}
