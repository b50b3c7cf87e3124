//! `moeforge tune` on the GPU: it writes an entry per regime of a small layer with no
//! schedule hints (`tests/fixtures/untuned_small.moe`), or two where it cuts one, planning
//! with that cache takes every entry, and the tuned layer still computes what the CPU
//! reference computes; entries in use (one per regime, or a cut regime's two) are timed
//! against the new choice and the verdict is what is written. On the CPU: the command's
//! refusals.

use std::path::PathBuf;

mod common;
use common::{moeforge, moeforge_with_env};

/// Three regimes, no hints: every GEMM is the cost model's to choose.
const SMALL: &str = "tests/fixtures/untuned_small.moe";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moeforge-tune-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `moeforge tune` on [`SMALL`] into a cache in `dir` with `extra` arguments (seed 7):
/// the cache's path and the command's output.
fn tune_small(dir: &std::path::Path, extra: &[&str]) -> (String, std::process::Output) {
    let cache_arg = dir.join("tuning.json").display().to_string();
    let mut args = vec!["tune", SMALL, "--cache", &cache_arg, "--seed", "7"];
    args.extend_from_slice(extra);
    let output = moeforge(&args);
    (cache_arg, output)
}

/// A quick tune of the regime holding 1000 tokens, with no new cut: one entry (which the
/// tests of entries in use edit before tuning the same regime again).
const ONE_REGIME_ARGS: [&str; 7] = [
    "--tokens",
    "1000",
    "--candidates",
    "1",
    "--iterations",
    "2",
    "--keep-regimes",
];

/// The entries of the tuning cache at `path`, as JSON.
fn cache_entries(path: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("the cache was written");
    let table: serde_json::Value = serde_json::from_str(&text).expect("the cache is JSON");
    table["entries"].as_array().expect("entries").clone()
}

/// `moeforge run` of [`SMALL`] at `tokens` with `env` matches the CPU reference.
fn assert_matches_reference(tokens: impl ToString, env: &[(&str, &str)]) {
    let tokens = tokens.to_string();
    let run = moeforge_with_env(
        &["run", SMALL, "--tokens", &tokens, "--check", "--seed", "7"],
        env,
    );
    assert!(
        run.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

/// Lines of `explain` output that start (after indentation) with `prefix`.
fn explain_lines(text: &str, prefix: &str) -> usize {
    text.lines()
        .filter(|l| l.trim_start().starts_with(prefix))
        .count()
}

/// The name of the regime of `explain` output (`  regime mid   65..=256 tokens`) that holds
/// `tokens`: where the regimes split depends on the GPU planned for.
fn regime_holding(text: &str, tokens: u32) -> String {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix("regime "))
        .find_map(|rest| {
            let mut words = rest.split_whitespace();
            let name = words.next()?;
            let (low, high) = words.next()?.split_once("..=")?;
            let holds = low.parse::<u32>().ok()? <= tokens && tokens <= high.parse().ok()?;
            holds.then(|| name.to_string())
        })
        .unwrap_or_else(|| panic!("no regime holds {tokens} tokens:\n{text}"))
}

#[test]
fn bad_arguments_are_usage_errors() {
    let output = moeforge(&["tune", "dsl-examples/tiny.moe", "--candidates", "0"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--candidates"));
}

#[test]
fn token_counts_beyond_the_layer_are_usage_errors() {
    let output = moeforge(&["tune", SMALL, "--tokens", "1,4096"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--tokens 4096") && stderr.contains("2048 tokens"),
        "{stderr}"
    );
}

#[test]
fn a_spec_that_hints_every_gemm_has_nothing_to_tune() {
    let output = moeforge(&["tune", "dsl-examples/tiny.moe"]);
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stdout).contains("nothing to tune"));
}

#[test]
fn an_unknown_layer_is_named_with_the_file_s_layers() {
    let output = moeforge(&["tune", "dsl-examples/tiny.moe", "--layer", "nope"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no layer `nope`") && stderr.contains("tiny"),
        "{stderr}"
    );
}

#[test]
fn a_malformed_cache_is_refused_before_any_measuring() {
    let dir = scratch("malformed");
    std::fs::create_dir_all(&dir).expect("scratch folder");
    let cache = dir.join("tuning.json");
    std::fs::write(&cache, "not json").expect("writes");
    let cache_arg = cache.display().to_string();
    let output = moeforge(&["tune", SMALL, "--cache", &cache_arg]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("not valid JSON") && stderr.contains(&cache_arg),
        "{stderr}"
    );
    // Every command that plans reads the same cache and says the same.
    let explain = moeforge_with_env(
        &["explain", "dsl-examples/tiny.moe"],
        &[("MOEFORGE_TUNING_CACHE", &cache_arg)],
    );
    assert_eq!(explain.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&explain.stderr).contains("not valid JSON"));
    let off = moeforge_with_env(
        &["explain", "dsl-examples/tiny.moe"],
        &[
            ("MOEFORGE_TUNING_CACHE", &cache_arg),
            ("MOEFORGE_TUNING", "off"),
        ],
    );
    assert!(
        off.status.success(),
        "{}",
        String::from_utf8_lossy(&off.stderr)
    );
    std::fs::remove_dir_all(&dir).expect("cleans up");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tune_writes_an_entry_per_regime_that_planning_takes_and_the_layer_stays_correct() {
    let dir = scratch("gpu");
    let (cache_arg, output) = tune_small(&dir, &["--candidates", "2", "--iterations", "3"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("(as the cost model chose it)"), "{stderr}");
    let env = [("MOEFORGE_TUNING_CACHE", cache_arg.as_str())];
    let explain = moeforge_with_env(&["explain", SMALL], &env);
    let text = String::from_utf8_lossy(&explain.stdout);
    assert!(explain.status.success());
    // Three regimes, and one more for each the tuner cut in two.
    let regimes = explain_lines(&text, "regime ");
    let tuned = explain_lines(&text, "tuned ");
    let entries = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && l.contains("..="))
        .count();
    let cuts = entries.saturating_sub(3);
    assert!(
        regimes == 3 + cuts && tuned == regimes,
        "{regimes} regimes, {tuned} tuned, {cuts} cut:\n{text}\n{stdout}"
    );
    // The tuned layer against the CPU reference, at a ragged count of every regime.
    for tokens in [1, 77, 300, 1500] {
        assert_matches_reference(tokens, &env);
    }
    std::fs::remove_dir_all(&dir).expect("cleans up");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tune_with_token_counts_touches_only_their_regimes() {
    let dir = scratch("gpu-tokens");
    let (cache_arg, output) = tune_small(&dir, &ONE_REGIME_ARGS);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let env = [("MOEFORGE_TUNING_CACHE", cache_arg.as_str())];
    let explain = moeforge_with_env(&["explain", SMALL], &env);
    let text = String::from_utf8_lossy(&explain.stdout);
    // Every timed candidate belongs to the regime holding 1000 tokens on this GPU, and so
    // does every batch of candidates compiled before them (one per GEMM).
    let regime = regime_holding(&text, 1000);
    let timed: Vec<&str> = stderr.lines().filter(|l| l.contains("] ")).collect();
    assert!(
        !timed.is_empty() && timed.iter().all(|l| l.contains(&regime)),
        "{regime}: {stderr}"
    );
    let compiled: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains(": compiling "))
        .collect();
    assert!(
        compiled.len() == 2 && compiled.iter().all(|l| l.contains(&regime)),
        "{regime}: {stderr}"
    );
    let tuned = explain_lines(&text, "tuned ");
    assert_eq!(tuned, 1, "{text}");
    std::fs::remove_dir_all(&dir).expect("cleans up");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_entry_in_use_is_timed_against_the_new_choice_and_the_verdict_is_what_is_written() {
    let dir = scratch("gpu-in-use");
    let (cache_arg, first) = tune_small(&dir, &ONE_REGIME_ARGS);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    // The entry as the sweep wrote it, its GEMM1 swapped for another valid configuration
    // at a ring depth the planner never picks for it (so no candidate of the sweep): the
    // entry "in use" when the same regime is tuned again.
    let read_entry = || -> serde_json::Value {
        let entries = cache_entries(&cache_arg);
        assert_eq!(entries.len(), 1, "{entries:?}");
        entries[0].clone()
    };
    let mut entry = read_entry();
    let swapped = serde_json::json!({
        "engine": "mma_sync", "tile": { "m": 16, "n": 128, "k": 64 }, "stages": 2, "cluster": 1
    });
    let other = serde_json::json!({
        "engine": "mma_sync", "tile": { "m": 32, "n": 64, "k": 64 }, "stages": 2, "cluster": 1
    });
    entry["gemm1"] = if entry["gemm1"] == swapped {
        other
    } else {
        swapped
    };
    let in_use = (entry["gemm1"].clone(), entry["gemm2"].clone());
    let table = serde_json::json!({ "entries": [entry] });
    std::fs::write(&cache_arg, table.to_string()).expect("writes the cache");

    let (_, second) = tune_small(&dir, &ONE_REGIME_ARGS);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains(" in use ("))
        .unwrap_or_else(|| panic!("no line for the entry in use:\n{stderr}"));
    assert!(!line.contains("left out"), "{line}");
    // Timed in turns with the new choice (two of this small layer fit at once).
    assert!(line.contains("(in turns;"), "{line}");
    let kept = line.contains("kept:");
    assert!(kept || line.contains("replaced"), "{line}");
    // What was said is what was written: the entry in use, both GEMMs, or another GEMM1.
    let written = read_entry();
    let as_in_use = (written["gemm1"].clone(), written["gemm2"].clone()) == in_use;
    assert_eq!(as_in_use, kept, "{line}\n{written}");
    assert_eq!(written["gemm1"] == in_use.0, kept, "{line}\n{written}");
    std::fs::remove_dir_all(&dir).expect("cleans up");
}

/// A regime cut in two in use (as a tune that cut it leaves the cache): both parts are
/// timed as one plan against the new choice, each named with the verdict, and what is
/// written is the two parts with their GEMMs as they were and this tune's times (kept) or
/// the new choice alone (replaced).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cut_regime_in_use_is_timed_whole_and_kept_or_replaced_whole() {
    let dir = scratch("gpu-cut-in-use");
    let (cache_arg, first) = tune_small(&dir, &ONE_REGIME_ARGS);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let read_entries = || cache_entries(&cache_arg);
    let entries = read_entries();
    assert_eq!(entries.len(), 1, "{entries:?}");
    // The regime's entry cut in the middle, the upper part on another valid GEMM1.
    let (min, max) = (
        entries[0]["min_tokens"].as_u64().expect("min"),
        entries[0]["max_tokens"].as_u64().expect("max"),
    );
    let middle = (min + max) / 2;
    let mut lower = entries[0].clone();
    lower["max_tokens"] = middle.into();
    let mut upper = entries[0].clone();
    upper["min_tokens"] = (middle + 1).into();
    upper["gemm1"] = serde_json::json!({
        "engine": "mma_sync", "tile": { "m": 32, "n": 64, "k": 64 }, "stages": 2, "cluster": 1
    });
    let planted = vec![lower, upper];
    let table = serde_json::json!({ "entries": planted });
    std::fs::write(&cache_arg, table.to_string()).expect("writes the cache");
    let env = [("MOEFORGE_TUNING_CACHE", cache_arg.as_str())];
    let explain = moeforge_with_env(&["explain", SMALL], &env);
    let text = String::from_utf8_lossy(&explain.stdout);
    assert_eq!(explain_lines(&text, "regime "), 4, "{text}");

    let (_, second) = tune_small(&dir, &ONE_REGIME_ARGS);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains(" in use (")).collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines.iter().all(|l| !l.contains("left out")), "{stderr}");
    let kept = lines[0].contains("kept:");
    assert!(kept || lines[0].contains("replaced"), "{stderr}");
    assert_eq!(lines[1].contains("kept:"), kept, "{stderr}");
    let written = read_entries();
    if kept {
        assert_eq!(written.len(), 2, "{written:?}");
        let counts = |entry: &serde_json::Value| -> Vec<u64> {
            let timed = entry["timed_tokens"].as_array().expect("timed_tokens");
            timed.iter().map(|t| t.as_u64().expect("a count")).collect()
        };
        let mut timed = Vec::new();
        for (part, was) in written.iter().zip(&planted) {
            for key in ["min_tokens", "max_tokens", "gemm1", "gemm2"] {
                assert_eq!(part[key], was[key], "{key}: {written:?}");
            }
            // Each part holds some of the regime's timed counts, and their times.
            let bound = |key: &str| was[key].as_u64().expect("a token count");
            let range = bound("min_tokens")..=bound("max_tokens");
            let own = counts(part);
            assert!(!own.is_empty(), "{written:?}");
            assert!(own.iter().all(|t| range.contains(t)), "{written:?}");
            timed.extend(own);
        }
        assert_eq!(timed, counts(&entries[0]), "{written:?}");
    } else {
        assert_eq!(written.len(), 1, "{written:?}");
        assert_eq!(
            (
                written[0]["min_tokens"].as_u64(),
                written[0]["max_tokens"].as_u64()
            ),
            (Some(min), Some(max))
        );
    }
    // Either way the layer computes what the CPU reference computes on both sides of the cut.
    for tokens in [middle, middle + 1] {
        assert_matches_reference(tokens, &env);
    }
    std::fs::remove_dir_all(&dir).expect("cleans up");
}
