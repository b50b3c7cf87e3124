//! The canonical printer behind `moeforge fmt`: one setting per line, two-space indent,
//! sections opened on their own line, one blank line between items, at most one blank line
//! kept where the source had some, every comment kept (own-line comments stay on their own
//! line, end-of-line comments stay at the end of their line). The source may end its lines
//! with `\n`, `\r\n` or a lone `\r`; the output always uses `\n`, so a file's meaning and
//! its formatting do not depend on the editor that saved it.
//!
//! Architecture invariant: formatting changes layout only. Parsing the output gives the same
//! tree of items, settings and values as parsing the input, and formatting is idempotent.

use crate::front::ast::{Comment, Entry, File, Item, Section, Setting, Span, Value, ValueKind};
use crate::front::count_line_breaks;

const INDENT: &str = "  ";

/// Prints `file` (parsed from `source`, whose comments and blank lines it keeps) in
/// canonical form.
pub fn format_file(file: &File, source: &str) -> String {
    let mut printer = Printer {
        source,
        comments: &file.comments,
        next_comment: 0,
        out: String::new(),
        last_end: 0,
    };
    for (index, item) in file.items.iter().enumerate() {
        printer.item(item, index == 0);
    }
    printer.own_line_comments(source.len(), 0);
    printer.out
}

/// Canonical text of one value: the number as written plus its unit's symbol, the word,
/// or the tile shape.
pub fn format_value(value: &Value) -> String {
    match &value.kind {
        ValueKind::Number {
            literal,
            unit: Some(unit),
        } => format!("{} {}", literal.text, unit.symbol()),
        ValueKind::Number {
            literal,
            unit: None,
        } => literal.text.clone(),
        ValueKind::Word(word) => word.clone(),
        ValueKind::Tile(tile) => tile.clone(),
    }
}

struct Printer<'a> {
    source: &'a str,
    comments: &'a [Comment],
    next_comment: usize,
    out: String,
    /// End of the last source construct printed, for blank-line and same-line decisions.
    last_end: usize,
}

impl Printer<'_> {
    fn item(&mut self, item: &Item, first: bool) {
        if !first {
            self.out.push('\n');
        }
        self.own_line_comments(item.span.start, 0);
        self.blank_line_if_source_has_one(item.span.start);
        // Comments between the item's name and its `{` move above it.
        self.own_line_comments(item.body.span.start, 0);
        self.out
            .push_str(&format!("{} {} {{", item.kind.text, item.name.text));
        self.last_end = item.body.span.start + 1;
        self.end_of_line_comment();
        self.entries(&item.body.entries, 1);
        self.close(item.body.span, 0);
    }

    fn entries(&mut self, entries: &[Entry], depth: usize) {
        for entry in entries {
            match entry {
                Entry::Setting(setting) => self.setting(setting, depth),
                Entry::Section(section) => self.section(section, depth),
            }
        }
    }

    fn section(&mut self, section: &Section, depth: usize) {
        // The blank line before the section is decided before comments written between its
        // name and brace move above it (they would hide it).
        self.own_line_comments(section.span.start, depth);
        self.blank_line_if_source_has_one(section.span.start);
        self.own_line_comments(section.open_brace, depth);
        self.indent(depth);
        self.out.push_str(&format!("{} {{", section.name.text));
        self.last_end = section.open_brace + 1;
        self.end_of_line_comment();
        for setting in &section.settings {
            self.setting(setting, depth + 1);
        }
        self.close(section.span, depth);
    }

    fn setting(&mut self, setting: &Setting, depth: usize) {
        self.own_line_comments(setting.span.start, depth);
        self.blank_line_if_source_has_one(setting.span.start);
        // Comments written inside the setting (between its tokens) move above it, after
        // the blank line the source has before the setting.
        self.own_line_comments(setting.span.end, depth);
        self.indent(depth);
        let values: Vec<String> = setting.values.iter().map(format_value).collect();
        self.out
            .push_str(&format!("{} = {}", setting.key.dotted(), values.join(", ")));
        self.last_end = setting.span.end;
        self.end_of_line_comment();
    }

    /// Comments before the closing brace, then the brace.
    fn close(&mut self, block: Span, depth: usize) {
        let closing_brace = block.end.saturating_sub(1);
        self.own_line_comments(closing_brace, depth + 1);
        self.indent(depth);
        self.out.push('}');
        self.last_end = block.end;
        self.end_of_line_comment();
    }

    /// Prints, each on its own line, the comments that start before `before`.
    fn own_line_comments(&mut self, before: usize, depth: usize) {
        while let Some(comment) = self.comments.get(self.next_comment) {
            if comment.span.start >= before {
                break;
            }
            self.blank_line_if_source_has_one(comment.span.start);
            self.indent(depth);
            self.out.push_str(&comment.text);
            self.out.push('\n');
            self.last_end = comment.span.end;
            self.next_comment += 1;
        }
    }

    /// Ends the current line, keeping a comment that follows on the same source line.
    fn end_of_line_comment(&mut self) {
        if let Some(comment) = self.comments.get(self.next_comment)
            && comment.span.start >= self.last_end
            && self.source[self.last_end..comment.span.start]
                .trim()
                .is_empty()
            && count_line_breaks(&self.source[self.last_end..comment.span.start]) == 0
        {
            self.out.push(' ');
            self.out.push_str(&comment.text);
            self.last_end = comment.span.end;
            self.next_comment += 1;
        }
        self.out.push('\n');
    }

    /// Keeps one blank line where the source had at least one between the last construct
    /// printed and `start`, except right after an opening brace or at the start of the file.
    fn blank_line_if_source_has_one(&mut self, start: usize) {
        if self.out.is_empty() || self.out.ends_with("\n\n") || self.out.trim_end().ends_with('{') {
            return;
        }
        let between = self.source.get(self.last_end..start).unwrap_or("");
        if count_line_breaks(between) >= 2 && between.trim().is_empty() {
            self.out.push('\n');
        }
    }

    fn indent(&mut self, depth: usize) {
        for _ in 0..depth {
            self.out.push_str(INDENT);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::format_source;

    const LF: &str =
        "# a layer\nlayer l { # opens\n  hidden = 64\n\n\n  # own line\n  ffn = 64 // end\n}\n";

    #[test]
    fn crlf_and_lone_cr_files_format_like_lf_files() {
        let expected = format_source("lf.moe", LF).expect("parses");
        assert_eq!(
            expected,
            "# a layer\nlayer l { # opens\n  hidden = 64\n\n  # own line\n  ffn = 64 // end\n}\n"
        );
        for (name, text) in [
            ("crlf.moe", LF.replace('\n', "\r\n")),
            ("cr.moe", LF.replace('\n', "\r")),
        ] {
            assert_eq!(format_source(name, &text).as_ref(), Ok(&expected), "{name}");
        }
    }

    #[test]
    fn a_blank_line_stays_before_a_setting_or_section_with_a_comment_inside() {
        let text = "layer l {\n  hidden = 64\n\n  ffn # mid\n  = 64\n\n  router # r\n  {\n  }\n}\n";
        let formatted = format_source("mid.moe", text).expect("parses");
        assert_eq!(
            formatted,
            "layer l {\n  hidden = 64\n\n  # mid\n  ffn = 64\n\n  # r\n  router {\n  }\n}\n"
        );
        assert_eq!(
            format_source("mid.moe", &formatted).as_ref(),
            Ok(&formatted)
        );
    }
}
