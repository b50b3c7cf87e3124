//! Reading one setting's values: whole numbers of a given width, quantities with units
//! (resolved to bytes per second, nanoseconds or tokens), words from a fixed set, booleans,
//! positive reals, links and tile shapes. Each reader reports what is wrong and returns
//! `None`, so the checker can go on and find the next error.

use crate::diagnostics::{Error, short, suggest};
use crate::front::ast::{Dimension, NumberLiteral, Setting, Span, Value, ValueKind};
use crate::ir::{Link, TileShape};

/// The single value of `setting`, or an error if it has several.
pub fn single<'a>(
    setting: &'a Setting,
    expected: &'static str,
    errors: &mut Vec<Error>,
) -> Option<&'a Value> {
    match setting.values.as_slice() {
        [value] => Some(value),
        values => {
            errors.push(Error::WrongValueCount {
                span: Span::new(values[0].span.start, setting.span.end),
                key: setting.key.dotted(),
                expected,
                found: values.len(),
            });
            None
        }
    }
}

/// How a value reads in messages: "the word `x`", "the number `3 us`".
fn describe(value: &Value) -> String {
    match &value.kind {
        ValueKind::Number { .. } => format!(
            "the number `{}`",
            short(&crate::front::format::format_value(value))
        ),
        ValueKind::Word(word) => format!("the word `{}`", short(word)),
        ValueKind::Tile(tile) => format!("the tile shape `{}`", short(tile)),
    }
}

fn wrong_kind(setting: &Setting, value: &Value, expected: &str, hint: String) -> Error {
    Error::WrongValueKind {
        span: value.span,
        key: setting.key.dotted(),
        expected: expected.to_string(),
        found: describe(value),
        hint,
    }
}

/// Parses a whole-number literal (underscores allowed) that must fit in `bits` bits.
fn parse_whole(
    setting: &Setting,
    literal: &NumberLiteral,
    span: Span,
    bits: u32,
) -> Result<u64, Error> {
    let key = setting.key.dotted();
    if !literal.is_integer {
        return Err(Error::NotAnInteger {
            span,
            key,
            value: literal.text.clone(),
        });
    }
    let max = if bits == 32 {
        u64::from(u32::MAX)
    } else {
        u64::MAX
    };
    let digits: String = literal.text.chars().filter(|c| *c != '_').collect();
    match digits.parse::<u64>() {
        Ok(number) if number <= max => Ok(number),
        _ => Err(Error::NumberTooLarge {
            span,
            key,
            value: short(&literal.text),
            bits,
            max,
            unit: "",
        }),
    }
}

/// A whole number without a unit (or with `tokens` when `tokens_allowed`), at least `min`.
pub fn count(
    setting: &Setting,
    min: u32,
    tokens_allowed: bool,
    errors: &mut Vec<Error>,
) -> Option<u32> {
    let value = single(setting, "one whole number", errors)?;
    let ValueKind::Number { literal, unit } = &value.kind else {
        errors.push(wrong_kind(
            setting,
            value,
            "a whole number",
            "write the number in digits, such as `64` (`_` may group digits: `16_384`)".into(),
        ));
        return None;
    };
    if let Some(unit) = unit
        && !(tokens_allowed && unit.dimension() == Dimension::Tokens)
    {
        errors.push(Error::WrongUnit {
            span: value.span,
            key: setting.key.dotted(),
            expected: if tokens_allowed {
                "a token count (a plain number or `N tokens`)".into()
            } else {
                "a plain number".into()
            },
            unit: unit.symbol(),
            unit_dimension: unit_dimension_name(unit.dimension()),
        });
        return None;
    }
    let number = parse_whole(setting, literal, value.span, 32)
        .map_err(|error| errors.push(error))
        .ok()?;
    if number < u64::from(min) {
        errors.push(Error::TooSmall {
            span: value.span,
            key: setting.key.dotted(),
            value: number,
            min: u64::from(min),
        });
        return None;
    }
    u32::try_from(number).ok()
}

fn unit_dimension_name(dimension: Dimension) -> &'static str {
    match dimension {
        Dimension::Bandwidth => "a bandwidth",
        Dimension::Latency => "a latency",
        Dimension::Tokens => "a token count",
    }
}

/// A quantity of `dimension` in base units (bytes per second or nanoseconds); fractions
/// are allowed (`1.5 TB/s`) and rounded to the nearest base unit.
fn quantity(
    setting: &Setting,
    value: &Value,
    dimension: Dimension,
    errors: &mut Vec<Error>,
) -> Option<u64> {
    let key = setting.key.dotted();
    let ValueKind::Number { literal, unit } = &value.kind else {
        errors.push(wrong_kind(
            setting,
            value,
            dimension.describe(),
            format!(
                "write a number and its unit, such as `{}`",
                dimension.example()
            ),
        ));
        return None;
    };
    let Some(unit) = unit else {
        errors.push(Error::MissingUnit {
            span: value.span,
            key,
            expected: dimension.describe(),
        });
        return None;
    };
    if unit.dimension() != dimension {
        errors.push(Error::WrongUnit {
            span: value.span,
            key,
            expected: dimension.describe().to_string(),
            unit: unit.symbol(),
            unit_dimension: unit_dimension_name(unit.dimension()),
        });
        return None;
    }
    if let Some(byte_unit) = unit.byte_rate_of_bit_rate() {
        errors.push(Error::BitRateUnit {
            span: value.span,
            key,
            unit: unit.symbol(),
            byte_unit: byte_unit.symbol(),
            conversion: bit_rate_in_bytes(literal, unit.symbol(), byte_unit.symbol()),
        });
        return None;
    }
    // Sizes are kept in bytes per second and nanoseconds.
    let base_unit = match dimension {
        Dimension::Bandwidth => " B/s",
        Dimension::Latency => " ns",
        Dimension::Tokens => "",
    };
    let too_large = || Error::NumberTooLarge {
        span: value.span,
        key: key.clone(),
        value: short(&crate::front::format::format_value(value)),
        bits: 64,
        max: u64::MAX,
        unit: base_unit,
    };
    if literal.is_integer {
        let number = parse_whole(setting, literal, value.span, 64)
            .map_err(|error| errors.push(error))
            .ok()?;
        number.checked_mul(unit.scale()).or_else(|| {
            errors.push(too_large());
            None
        })
    } else {
        let number = parse_real(literal).unwrap_or(f64::INFINITY) * unit.scale() as f64;
        // 2^64 is exactly representable; anything at or above it does not fit.
        if number.is_finite() && number < 18_446_744_073_709_551_616.0 {
            Some(number.round() as u64)
        } else {
            errors.push(too_large());
            None
        }
    }
}

/// The durations a key accepts, in nanoseconds, and the same bounds as written in a spec.
pub struct DurationRange {
    pub min_ns: u64,
    pub max_ns: u64,
    pub min: &'static str,
    pub max: &'static str,
}

/// One duration (`ns`, `us`, `ms`; fractions rounded to the nearest nanosecond) within
/// `range`, in nanoseconds.
pub fn duration(setting: &Setting, range: DurationRange, errors: &mut Vec<Error>) -> Option<u64> {
    let value = single(setting, "one duration", errors)?;
    let ns = quantity(setting, value, Dimension::Latency, errors)?;
    if !(range.min_ns..=range.max_ns).contains(&ns) {
        errors.push(Error::DurationOutOfRange {
            span: value.span,
            key: setting.key.dotted(),
            value: short(&crate::front::format::format_value(value)),
            min: range.min,
            max: range.max,
            below: ns < range.min_ns,
        });
        return None;
    }
    Some(ns)
}

/// "400 Gb/s = 50 GB/s": a bit rate as written and in bytes per second with the same prefix;
/// one unit's worth when the number is too long to show.
fn bit_rate_in_bytes(literal: &NumberLiteral, bit_unit: &str, byte_unit: &str) -> String {
    match parse_real(literal) {
        // Beyond 1e15 `{}` would print every digit; the per-unit ratio says as much.
        Some(bits) if bits < 1e15 => {
            format!("{} {bit_unit} = {} {byte_unit}", literal.text, bits / 8.0)
        }
        _ => format!("1 {bit_unit} = 0.125 {byte_unit}"),
    }
}

/// `bandwidth, latency` (either order): `450 GB/s, 3 us`.
pub fn link(setting: &Setting, errors: &mut Vec<Error>) -> Option<Link> {
    let key = setting.key.dotted();
    let [first, second] = setting.values.as_slice() else {
        errors.push(Error::WrongValueCount {
            span: Span::new(setting.values[0].span.start, setting.span.end),
            key,
            expected: "a bandwidth and a latency, e.g. `450 GB/s, 3 us`",
            found: setting.values.len(),
        });
        return None;
    };
    let is_latency = |value: &Value| matches!(&value.kind, ValueKind::Number { unit: Some(unit), .. } if unit.dimension() == Dimension::Latency);
    let (bandwidth, latency) = if is_latency(first) {
        (second, first)
    } else {
        (first, second)
    };
    let bandwidth_bytes_per_s = quantity(setting, bandwidth, Dimension::Bandwidth, errors);
    let latency_ns = quantity(setting, latency, Dimension::Latency, errors);
    let bandwidth_bytes_per_s = bandwidth_bytes_per_s?;
    if bandwidth_bytes_per_s == 0 {
        let written_above_zero = matches!(&bandwidth.kind, ValueKind::Number { literal, .. }
            if parse_real(literal).is_some_and(|number| number > 0.0));
        errors.push(Error::ZeroBandwidth {
            span: bandwidth.span,
            key,
            value: short(&crate::front::format::format_value(bandwidth)),
            rounds_to_zero: written_above_zero,
        });
        return None;
    }
    Some(Link {
        bandwidth_bytes_per_s,
        latency_ns: latency_ns?,
    })
}

/// A word of `choices`, mapped to its meaning.
pub fn choice<T: Copy>(
    setting: &Setting,
    choices: &[(&'static str, T)],
    listed: &'static str,
    errors: &mut Vec<Error>,
) -> Option<T> {
    let value = single(setting, "one word", errors)?;
    let ValueKind::Word(word) = &value.kind else {
        errors.push(wrong_kind(
            setting,
            value,
            &format!("one of: {listed}"),
            format!("write one of: {listed}"),
        ));
        return None;
    };
    if let Some((_, meaning)) = choices.iter().find(|(name, _)| name == word) {
        return Some(*meaning);
    }
    errors.push(Error::UnknownChoice {
        span: value.span,
        key: setting.key.dotted(),
        found: short(word),
        choices: listed,
        suggestion: suggest(word, choices.iter().map(|(name, _)| *name)),
    });
    None
}

/// `true` or `false`.
pub fn boolean(setting: &Setting, errors: &mut Vec<Error>) -> Option<bool> {
    let value = single(setting, "one word", errors)?;
    let note = match &value.kind {
        ValueKind::Word(word) if word == "true" => return Some(true),
        ValueKind::Word(word) if word == "false" => return Some(false),
        ValueKind::Word(word)
            if word.eq_ignore_ascii_case("true") || word.eq_ignore_ascii_case("false") =>
        {
            " (in lower case)"
        }
        ValueKind::Number { .. } => " (numbers are not booleans)",
        _ => "",
    };
    // `normalize = 1`, `= True` or `= yes` are the likeliest slips: say how booleans are
    // written.
    let key = setting.key.dotted();
    errors.push(wrong_kind(
        setting,
        value,
        "`true` or `false`",
        format!("`{key}` is a switch: write `{key} = true` or `{key} = false`{note}"),
    ));
    None
}

/// A name (of a topology, say) and where it is written.
pub fn name<'a>(setting: &'a Setting, errors: &mut Vec<Error>) -> Option<(&'a str, Span)> {
    let value = single(setting, "one name", errors)?;
    match &value.kind {
        ValueKind::Word(word) => Some((word.as_str(), value.span)),
        _ => {
            errors.push(wrong_kind(
                setting,
                value,
                "a name",
                "write a name: letters, digits and `_`, not starting with a digit".into(),
            ));
            None
        }
    }
}

/// The value of a decimal or integer literal (`_` allowed), `None` if it is not a number.
fn parse_real(literal: &NumberLiteral) -> Option<f64> {
    let digits: String = literal.text.chars().filter(|c| *c != '_').collect();
    digits.parse::<f64>().ok()
}

/// A positive real number without a unit (`2.5`, `1`) that multiplies 32-bit floats: above
/// zero and finite once rounded to `f32`.
pub fn positive_f32(setting: &Setting, errors: &mut Vec<Error>) -> Option<f64> {
    let value = single(setting, "one number", errors)?;
    let key = setting.key.dotted();
    match &value.kind {
        ValueKind::Number {
            literal,
            unit: None,
        } => {
            let number = parse_real(literal).unwrap_or(f64::INFINITY);
            if number > f64::from(f32::MAX) {
                errors.push(Error::RealTooLarge {
                    span: value.span,
                    key,
                    value: short(&literal.text),
                });
                return None;
            }
            // Rounding to the nearest f32 (what `as` does) turns the tiniest values into 0.
            if number as f32 > 0.0 {
                return Some(number);
            }
            errors.push(Error::NotPositive {
                span: value.span,
                key,
                value: short(&literal.text),
                rounds_to_zero: number > 0.0,
            });
            None
        }
        ValueKind::Number {
            unit: Some(unit), ..
        } => {
            errors.push(Error::WrongUnit {
                span: value.span,
                key,
                expected: "a plain number".into(),
                unit: unit.symbol(),
                unit_dimension: unit_dimension_name(unit.dimension()),
            });
            None
        }
        _ => {
            errors.push(wrong_kind(
                setting,
                value,
                "a number",
                "write a plain number such as `2.5`".into(),
            ));
            None
        }
    }
}

/// `MxNxK` with each dimension a positive multiple of 16.
pub fn tile(setting: &Setting, errors: &mut Vec<Error>) -> Option<TileShape> {
    let value = single(setting, "one tile shape", errors)?;
    let key = setting.key.dotted();
    let ValueKind::Tile(text) = &value.kind else {
        errors.push(wrong_kind(
            setting,
            value,
            "a tile shape `MxNxK`, e.g. `128x128x64`",
            "write rows, columns and depth joined by `x`, without spaces: `128x128x64`".into(),
        ));
        return None;
    };
    let parts: Vec<&str> = text.split('x').collect();
    if parts.len() != 3 {
        errors.push(wrong_kind(
            setting,
            value,
            "a tile shape `MxNxK`, e.g. `128x128x64`",
            format!(
                "a tile has three dimensions, rows, columns and depth, joined by `x` (this one has {}): `128x128x64`",
                parts.len()
            ),
        ));
        return None;
    }
    let mut dimensions = [0u32; 3];
    let mut ok = true;
    for ((part, slot), dimension) in parts.iter().zip(dimensions.iter_mut()).zip(["m", "n", "k"]) {
        let digits: String = part.chars().filter(|c| *c != '_').collect();
        match digits.parse::<u32>() {
            Ok(number) if number > 0 && number % 16 == 0 => *slot = number,
            Ok(number) => {
                errors.push(Error::TileNotAligned {
                    span: value.span,
                    key: key.clone(),
                    dimension,
                    value: number,
                });
                ok = false;
            }
            Err(_) => {
                errors.push(Error::NumberTooLarge {
                    span: value.span,
                    key: key.clone(),
                    value: short(part),
                    bits: 32,
                    max: u64::from(u32::MAX),
                    unit: "",
                });
                ok = false;
            }
        }
    }
    let [m, n, k] = dimensions;
    ok.then_some(TileShape { m, n, k })
}
