//! The keys of one item or section: finds unknown keys (with "did you mean"), keys of another
//! item or section written in the wrong place (with where they belong), keys set twice,
//! settings written as sections and the reverse, and reports missing required keys.

use std::collections::BTreeMap;

use crate::check::SCHEMAS;
use crate::diagnostics::{Error, short, suggest};
use crate::front::ast::{Entry, Section, Setting, Span};

/// The keys an item or section accepts.
pub struct Schema {
    /// Where these keys are written, for "it belongs in ..." messages: "a `topology` item",
    /// "the layer's `router { }` section". Unique among [`SCHEMAS`].
    pub home: &'static str,
    /// Keys written `key = value`.
    pub settings: &'static [&'static str],
    /// Keys written `key { ... }`.
    pub sections: &'static [&'static str],
    /// Other spellings of a setting key: (alias, key).
    pub aliases: &'static [(&'static str, &'static str)],
}

/// The settings and sections of one item or section, by canonical key.
pub struct Table<'a> {
    /// What this is, for messages: "layer `mixtral`", "section `router`".
    pub what: String,
    /// Where missing keys are reported: the item's or section's name.
    pub header: Span,
    /// The item has syntax errors, so a missing key may just have failed to parse: missing
    /// keys are then not reported.
    pub incomplete: bool,
    settings: BTreeMap<&'static str, &'a Setting>,
    sections: BTreeMap<&'static str, &'a Section>,
    /// Canonical keys an unknown key's "did you mean" named: that error already says what
    /// is missing, so [`Table::required`] does not say it again.
    suggested: Vec<String>,
}

impl Schema {
    /// Whether `key` is one of these settings (or their aliases) or sections.
    fn accepts(&self, key: &str) -> bool {
        self.settings.contains(&key)
            || self.sections.contains(&key)
            || self.aliases.iter().any(|(alias, _)| *alias == key)
    }
}

impl<'a> Table<'a> {
    /// Sorts `entries` by key, reporting every entry the schema does not accept.
    pub fn new(
        what: String,
        header: Span,
        incomplete: bool,
        entries: impl IntoIterator<Item = &'a Entry>,
        schema: &Schema,
        errors: &mut Vec<Error>,
    ) -> Self {
        let mut table = Table {
            what,
            header,
            incomplete,
            settings: BTreeMap::new(),
            sections: BTreeMap::new(),
            suggested: Vec::new(),
        };
        for entry in entries {
            match entry {
                Entry::Setting(setting) => table.add_setting(setting, schema, errors),
                Entry::Section(section) => table.add_section(section, schema, errors),
            }
        }
        table
    }

    /// A table of settings only (the inside of a section).
    pub fn of_section(
        section: &'a Section,
        incomplete: bool,
        schema: &Schema,
        errors: &mut Vec<Error>,
    ) -> Self {
        let mut table = Table {
            what: format!("section `{}`", section.name.text),
            header: section.name.span,
            incomplete,
            settings: BTreeMap::new(),
            sections: BTreeMap::new(),
            suggested: Vec::new(),
        };
        for setting in &section.settings {
            table.add_setting(setting, schema, errors);
        }
        table
    }

    fn add_setting(&mut self, setting: &'a Setting, schema: &Schema, errors: &mut Vec<Error>) {
        let written = setting.key.dotted();
        let canonical = schema
            .aliases
            .iter()
            .find(|(alias, _)| *alias == written)
            .map(|(_, key)| *key)
            .or_else(|| schema.settings.iter().copied().find(|key| *key == written));
        match canonical {
            Some(key) => {
                if let Some(first) = self.settings.get(key) {
                    errors.push(Error::DuplicateKey {
                        span: setting.key.span,
                        key: short(&written),
                        section: self.what.clone(),
                        first: first.key.span,
                    });
                } else {
                    self.settings.insert(key, setting);
                }
            }
            None if schema.sections.contains(&written.as_str()) => {
                errors.push(Error::ExpectedSection {
                    span: setting.key.span,
                    key: short(&written),
                });
            }
            None => {
                let error = self.unknown_key(written, setting.key.span, schema);
                self.note_suggestion(&error, schema);
                errors.push(error);
            }
        }
    }

    /// Remembers the key an unknown-key error suggests, by its canonical name.
    fn note_suggestion(&mut self, error: &Error, schema: &Schema) {
        if let Error::UnknownKey {
            suggestion: Some(suggested),
            ..
        } = error
        {
            let canonical = schema
                .aliases
                .iter()
                .find(|(alias, _)| alias == suggested)
                .map_or(suggested.as_str(), |(_, key)| key);
            self.suggested.push(canonical.to_string());
        }
    }

    fn add_section(&mut self, section: &'a Section, schema: &Schema, errors: &mut Vec<Error>) {
        let written = section.name.text.as_str();
        match schema.sections.iter().copied().find(|key| *key == written) {
            Some(key) => {
                if let Some(first) = self.sections.get(key) {
                    errors.push(Error::DuplicateKey {
                        span: section.name.span,
                        key: written.to_string(),
                        section: self.what.clone(),
                        first: first.name.span,
                    });
                } else {
                    self.sections.insert(key, section);
                }
            }
            None if schema.settings.contains(&written)
                || schema.aliases.iter().any(|(alias, _)| *alias == written) =>
            {
                errors.push(Error::ExpectedSetting {
                    span: section.name.span,
                    key: written.to_string(),
                });
            }
            None => errors.push(self.unknown_key(written.to_string(), section.name.span, schema)),
        }
    }

    /// A key this schema does not accept: misplaced when another item or section takes it,
    /// else unknown.
    fn unknown_key(&self, key: String, span: Span, schema: &Schema) -> Error {
        let candidates = || {
            schema
                .settings
                .iter()
                .chain(schema.sections)
                .chain(schema.aliases.iter().map(|(alias, _)| alias))
        };
        // The other items and sections that take `key`.
        let homes_of = |key: &str| -> Vec<&'static str> {
            SCHEMAS
                .iter()
                .filter(|other| other.home != schema.home && other.accepts(key))
                .map(|other| other.home)
                .collect()
        };
        // A checkpoint config's name says for sure what it means; spelling only guesses.
        let config_name = config_name_for(&key);
        let suggestion = config_name
            .filter(|ours| candidates().any(|candidate| candidate == ours))
            .map(str::to_string)
            .or_else(|| suggest(&key, candidates().copied()));
        // A config name for a key of another section (`norm_topk_prob` at the top of a
        // layer, the router's `normalize`): that key, and where it is written.
        if let Some(ours) = config_name
            && suggestion.is_none()
            && let Some(&home) = homes_of(ours).first()
        {
            return Error::ConfigNameElsewhere {
                span,
                key: short(&key),
                written_in: self.what.clone(),
                ours,
                home,
            };
        }
        let homes = homes_of(&key);
        if !homes.is_empty() {
            return Error::MisplacedKey {
                span,
                key: short(&key),
                written_in: self.what.clone(),
                belongs_in: homes.join(" or "),
                suggestion,
            };
        }
        let known: Vec<&str> = schema
            .settings
            .iter()
            .chain(schema.sections)
            .copied()
            .collect();
        Error::UnknownKey {
            span,
            key: short(&key),
            section: self.what.clone(),
            suggestion,
            known: known.join(", "),
        }
    }

    pub fn setting(&self, key: &str) -> Option<&'a Setting> {
        self.settings.get(key).copied()
    }

    pub fn section(&self, key: &str) -> Option<&'a Section> {
        self.sections.get(key).copied()
    }

    /// The setting, or a "missing key" error that shows `example`.
    pub fn required(
        &self,
        key: &'static str,
        example: impl Into<String>,
        errors: &mut Vec<Error>,
    ) -> Option<&'a Setting> {
        let setting = self.setting(key);
        let suggested = self.suggested.iter().any(|k| k == key);
        if setting.is_none() && !self.incomplete && !suggested {
            errors.push(Error::MissingKey {
                span: self.header,
                key,
                section: self.what.clone(),
                example: example.into(),
            });
        }
        setting
    }
}

/// The key of this language for a name a model's checkpoint config uses (Hugging Face's
/// `config.json`), which a user copying sizes from one may write.
fn config_name_for(key: &str) -> Option<&'static str> {
    Some(match key {
        "hidden_size" => "hidden",
        "intermediate_size" | "moe_intermediate_size" | "expert_intermediate_size" => "ffn",
        "num_experts" | "num_local_experts" | "n_routed_experts" => "experts",
        "num_experts_per_tok" | "experts_per_token" => "top_k",
        "n_group" => "groups",
        "topk_group" => "groups_kept",
        "norm_topk_prob" => "normalize",
        "routed_scaling_factor" => "scale",
        _ => return None,
    })
}
