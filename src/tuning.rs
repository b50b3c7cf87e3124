//! Where tuning tables live: the entries shipped in the repository (`tuning/shipped.json`,
//! built into the binary) and the user's cache, which `moeforge tune` writes and the
//! commands that plan a layer to run or compile read (the cache's entries win over the
//! shipped ones). The engine API (`moeforge::engine`) plans with the shipped entries only,
//! so that a program embedding moeforge does not depend on its user's cache.
//!
//! The cache is `$MOEFORGE_TUNING_CACHE` when set, else
//! `$XDG_CACHE_HOME/moeforge/tuning.json` (when that folder is absolute), else
//! `$HOME/.cache/moeforge/tuning.json`. `MOEFORGE_TUNING=off` plans with the cost model
//! alone (no shipped entries, no cache).

use std::path::{Path, PathBuf};

use std::io::Write as _;

use moeforge_compiler::plan::tuning::{TunedRegime, TuningTable};

/// The shipped entries' JSON, as built into the binary.
const SHIPPED: &str = include_str!("../tuning/shipped.json");

#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    #[error("reading the tuning table {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the tuning table {path} is not valid JSON of a tuning table (line {line}, column {column}): {reason}; remove it or run `moeforge tune` again"
    )]
    Parse {
        path: PathBuf,
        line: usize,
        column: usize,
        reason: String,
    },
    #[error("writing the tuning table {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("MOEFORGE_TUNING is `{0}`; it takes `off` (plan with the cost model alone) or `on`")]
    InvalidSwitch(String),
    #[error("no cache folder: set MOEFORGE_TUNING_CACHE, XDG_CACHE_HOME or HOME")]
    NoCacheFolder,
}

fn parse(path: &Path, text: &str) -> Result<TuningTable, TuningError> {
    serde_json::from_str(text).map_err(|e| TuningError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        reason: e.to_string(),
    })
}

/// The entries shipped with this build.
pub fn shipped() -> Result<TuningTable, TuningError> {
    parse(Path::new("tuning/shipped.json (built in)"), SHIPPED)
}

/// The user's cache file (it need not exist).
pub fn cache_path() -> Result<PathBuf, TuningError> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(path) = var("MOEFORGE_TUNING_CACHE") {
        return Ok(PathBuf::from(path));
    }
    // A relative XDG_CACHE_HOME is ignored, as the XDG Base Directory rules say (and as
    // the JIT cache does).
    let base = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|dir| dir.is_absolute())
        .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .ok_or(TuningError::NoCacheFolder)?;
    Ok(base.join("moeforge").join("tuning.json"))
}

/// The table at `path`; empty when there is no file.
pub fn load(path: &Path) -> Result<TuningTable, TuningError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(path, &text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TuningTable::default()),
        Err(source) => Err(TuningError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Records `entries` (a regime's one, or the parts of its cut) in the table at `path` in
/// one write, the table read again just before it, so that entries another run wrote
/// meanwhile are kept.
pub fn update(path: &Path, entries: &[TunedRegime]) -> Result<(), TuningError> {
    let mut table = load(path)?;
    for entry in entries {
        table.record(entry.clone());
    }
    save(path, &table)
}

/// Writes `table` to `path` (creating its folder), through a temporary file of this
/// process renamed into place, so that a reader never sees half a table.
pub fn save(path: &Path, table: &TuningTable) -> Result<(), TuningError> {
    let write = |source| TuningError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder).map_err(write)?;
    }
    let text = serde_json::to_string_pretty(table).map_err(|e| write(std::io::Error::other(e)))?;
    let temporary = path.with_extension(format!("json.{}.partial", std::process::id()));
    let mut file = std::fs::File::create(&temporary).map_err(write)?;
    file.write_all((text + "\n").as_bytes()).map_err(write)?;
    file.sync_all().map_err(write)?;
    std::fs::rename(&temporary, path).map_err(write)
}

/// Whether planning uses tuning entries at all: not with `MOEFORGE_TUNING=off`.
fn enabled() -> Result<bool, TuningError> {
    match moeforge_runtime::env_value("MOEFORGE_TUNING").as_deref() {
        None | Some("") | Some("on") => Ok(true),
        Some("off") => Ok(false),
        Some(other) => Err(TuningError::InvalidSwitch(other.to_string())),
    }
}

/// What the commands plan with: the shipped entries and then the cache's (none where
/// there is no cache folder), unless `MOEFORGE_TUNING=off`.
pub fn for_planning() -> Result<TuningTable, TuningError> {
    if !enabled()? {
        return Ok(TuningTable::default());
    }
    let cache = match cache_path() {
        Ok(path) => load(&path)?,
        Err(TuningError::NoCacheFolder) => TuningTable::default(),
        Err(error) => return Err(error),
    };
    planning_with(&cache)
}

/// What planning with `cache` as the cache uses: the shipped entries and then the
/// cache's, unless `MOEFORGE_TUNING=off`.
pub fn planning_with(cache: &TuningTable) -> Result<TuningTable, TuningError> {
    if !enabled()? {
        return Ok(TuningTable::default());
    }
    Ok(shipped()?.merged_with(cache))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_table_parses() {
        shipped().expect("tuning/shipped.json is a tuning table");
    }

    /// Every shipped entry applies: planning the example it was tuned on, for its GPU,
    /// takes it in the regime it was measured for. A planner change that moves a regime's
    /// bounds would otherwise leave its entries unused without a word: re-tune then.
    #[test]
    fn every_shipped_entry_applies_to_its_example() {
        use moeforge_compiler::plan::tuning::TunedShape;
        use moeforge_compiler::plan::{self, Target};
        let table = shipped().expect("tuning/shipped.json is a tuning table");
        let mut applied = 0;
        for example in [
            "deepseek_v3",
            "gpt_oss_120b",
            "mixtral_8x7b",
            "qwen1_5_moe_a2_7b",
            "qwen3_30b_a3b",
        ] {
            let path = format!("{}/dsl-examples/{example}.moe", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).expect("a shipped example");
            let module = moeforge_compiler::compile_source(&path, &text).expect("it checks");
            for target in [Target::h200(), Target::h100()] {
                let plan = plan::plan_tuned(&module.layers[0], &target, &table).expect("it plans");
                let shape = TunedShape::of(&plan.shape);
                let entries = table
                    .entries
                    .iter()
                    .filter(|e| e.gpu == target.name && e.shape == shape)
                    .count();
                let tuned: Vec<_> = plan
                    .regimes
                    .iter()
                    .filter(|r| r.tuned.is_some())
                    .map(|r| (r.min_tokens, r.max_tokens))
                    .collect();
                assert_eq!(
                    tuned.len(),
                    entries,
                    "{example} on the {}: {entries} shipped entries, but only the regimes {tuned:?} of {} take one",
                    target.name,
                    plan.regimes.len()
                );
                applied += entries;
            }
        }
        assert_eq!(
            applied,
            table.entries.len(),
            "a shipped entry is for no example on the H200 or the H100"
        );
    }

    #[test]
    fn a_missing_cache_is_empty_and_a_saved_one_reads_back() {
        let folder = std::env::temp_dir().join(format!("moeforge-tuning-{}", std::process::id()));
        let path = folder.join("nested").join("tuning.json");
        assert_eq!(load(&path).expect("no file"), TuningTable::default());
        save(&path, &TuningTable::default()).expect("saves");
        assert_eq!(load(&path).expect("reads"), TuningTable::default());
        std::fs::write(&path, "{\"entries\": [ {\"gpu\": 3} ]}").expect("writes");
        let error = load(&path).expect_err("not a table");
        assert!(
            matches!(error, TuningError::Parse { line: 1, .. }),
            "{error}"
        );
        std::fs::remove_dir_all(&folder).expect("cleans up");
    }
}
