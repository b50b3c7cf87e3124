//! `moeforge run --weights`: tiny checkpoints of `dsl-examples/tiny.moe`'s layer written in
//! a temp folder. Without a GPU, `run` loads and checks the weights, compiles and says it
//! did not run (as `run` does without `--weights`); with one it runs them and checks the
//! output against the CPU reference on the same weights, on one GPU and on four virtual
//! ranks that each load their own experts. Every error case's exit status and stderr is
//! compared with a snapshot in `tests/weights/` (`MOEFORGE_BLESS=1` rewrites them), the
//! temp folder shown as `<TMP>`.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::moeforge;

use moeforge::compiler::compile_source;
use moeforge::compiler::ir::{Activation, RouterBias};
use moeforge::compiler::plan::{self, LayerShape, Target};
use moeforge::runtime::checkpoint::{Family, INDEX_FILE, write_experts, write_layer};
use moeforge::runtime::weights;
use safetensors::tensor::{Dtype, TensorView};

const TINY: &str = "dsl-examples/tiny.moe";

/// The tiny layer's sizes, as the planner gives them.
fn tiny_shape() -> LayerShape {
    let text = include_str!("../dsl-examples/tiny.moe");
    let module = compile_source("tiny.moe", text).expect("tiny.moe checks");
    plan::plan(&module.layers[0], &Target::h200())
        .expect("tiny plans for the H200")
        .shape
}

/// Random experts of the tiny layer under `prefix`, as `family` names them.
fn write_tiny(path: &Path, family: Family, prefix: &str, seed: u64) {
    let shape = tiny_shape();
    let experts = weights::random(&shape, 0..shape.experts, seed);
    write_experts(path, family, prefix, &shape, &experts).expect("the checkpoint is written");
}

/// A safetensors file of bf16-sized tensors of zeros (or `dtype`'s bytes), named freely.
fn write_raw(path: &Path, tensors: &[(String, Dtype, Vec<usize>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, shape)| vec![0u8; shape.iter().product::<usize>() * dtype.bitsize() / 8])
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, dtype, shape), data)| {
            (
                name.as_str(),
                TensorView::new(*dtype, shape.clone(), data).expect("a valid view"),
            )
        })
        .collect();
    std::fs::write(
        path,
        safetensors::serialize(views, None).expect("serialized"),
    )
    .expect("written");
}

/// The tiny layer's expert tensors in Qwen3-MoE naming under `model.layers.0.`, with
/// `change` applied to the list (drop, reshape or retype one).
fn write_tiny_raw(path: &Path, change: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>)>)) {
    let shape = tiny_shape();
    let (h, f) = (shape.hidden as usize, shape.ffn as usize);
    let mut tensors = Vec::new();
    for e in 0..shape.experts {
        for (projection, dims) in [
            ("gate", vec![f, h]),
            ("up", vec![f, h]),
            ("down", vec![h, f]),
        ] {
            tensors.push((
                format!("model.layers.0.mlp.experts.{e}.{projection}_proj.weight"),
                Dtype::BF16,
                dims,
            ));
        }
    }
    change(&mut tensors);
    write_raw(path, &tensors);
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

/// One layer, every expert on one GPU: loaded, then compiled only (no GPU) or run and
/// checked against the CPU reference on the loaded weights.
#[test]
fn run_with_weights_loads_them_then_compiles_or_checks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("model.safetensors");
    write_tiny(&file, Family::Qwen3Moe, "model.layers.0.", 1);
    let output = moeforge(&[
        "run",
        TINY,
        "--tokens",
        "37",
        "--check",
        "--weights",
        path_arg(&file),
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains(
            "loaded the 8 routed experts of layer `model.layers.0.` (the only one), Qwen3-MoE naming (detected), of "
        ),
        "{stderr}"
    );
    let compiled_only = stdout.contains("not run: no GPU");
    let checked = stdout.contains("tiny T=37:") && stdout.contains("PASS");
    assert!(compiled_only || checked, "{stdout}{stderr}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    if checked {
        assert!(
            stderr.contains("uploading the checkpoint's weights"),
            "{stderr}"
        );
    }
}

/// Four virtual ranks on a sharded folder holding two layers: the prefix picks one; each
/// rank's experts are read for that rank (checked against the reference on a GPU).
#[test]
fn run_with_weights_over_virtual_ranks_loads_each_ranks_experts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_tiny(
        &dir.path().join(shards[0]),
        Family::Mixtral,
        "model.layers.1.",
        2,
    );
    write_tiny(
        &dir.path().join(shards[1]),
        Family::Mixtral,
        "model.layers.2.",
        3,
    );
    write_index(
        dir.path(),
        Family::Mixtral,
        &[(1, shards[0]), (2, shards[1])],
    );

    let folder = path_arg(dir.path());
    let output = moeforge(&[
        "run",
        TINY,
        "--tokens",
        "16",
        "--ranks",
        "4",
        "--check",
        "--weights",
        folder,
        "--layer-prefix",
        "model.layers.2",
        "--family",
        "mixtral",
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains("layer `model.layers.2.`, Mixtral naming, of "),
        "{stderr}"
    );
    let compiled_only = stdout.contains("not run: no GPU") && stdout.contains("11 kernels");
    let ran = (0..4).all(|r| stdout.contains(&format!("tiny rank {r} T=16:")));
    assert!(compiled_only || ran, "{stdout}{stderr}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
}

/// `tiny.moe` with a router (softmax, renormalised), written into `dir`; its path.
fn write_routed_tiny(dir: &Path) -> PathBuf {
    let spec = dir.join("tiny_routed.moe");
    let routed = std::fs::read_to_string(TINY)
        .expect("tiny.moe is readable")
        .replace(
            "  parallel {",
            "  router {\n    scoring = softmax\n    normalize = true\n  }\n\n  parallel {",
        );
    std::fs::write(&spec, routed).expect("spec written");
    spec
}

/// The tiny layer with a router (softmax, renormalised) over four virtual ranks, from a
/// checkpoint that holds the gate too: each rank loads its experts and the gate, routes its
/// own tokens with it (its choices checked against the CPU router on a GPU), then the
/// exchange runs on them.
#[test]
fn run_with_weights_routes_each_rank_with_the_checkpoints_gate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = write_routed_tiny(dir.path());
    let file = dir.path().join("model.safetensors");
    let shape = tiny_shape();
    let experts = weights::random(&shape, 0..shape.experts, 4);
    let gate = weights::random_gate(&shape, RouterBias::None, 5);
    write_layer(
        &file,
        Family::Qwen3Moe,
        "model.layers.0.",
        &shape,
        &experts,
        Some((&gate, RouterBias::None)),
    )
    .expect("the checkpoint is written");
    let output = moeforge(&[
        "run",
        path_arg(&spec),
        "--tokens",
        "16",
        "--ranks",
        "4",
        "--check",
        "--weights",
        path_arg(&file),
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    let compiled_only = stdout.contains("not run: no GPU");
    let ran = (0..4).all(|r| {
        stdout.lines().any(|line| {
            line.starts_with(&format!("tiny rank {r} T=16:"))
                && line.contains("router over 16 tokens")
        })
    });
    assert!(compiled_only || ran, "{stdout}{stderr}");
    if ran {
        assert!(stderr.contains("the spec's router's routing"), "{stderr}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
}

/// Two layers in two shards, one index, and the second shard not downloaded.
fn write_partial_download(dir: &Path) {
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_tiny(&dir.join(shards[0]), Family::Qwen3Moe, "model.layers.0.", 6);
    write_index(dir, Family::Qwen3Moe, &[(0, shards[0]), (1, shards[1])]);
}

/// `model.safetensors.index.json` in `dir` naming every expert tensor of the tiny layer
/// `model.layers.{layer}.` in its shard, for each (layer, shard), as `family` names them.
fn write_index(dir: &Path, family: Family, layers: &[(u32, &str)]) {
    let (module, projections) = match family {
        Family::Mixtral => ("block_sparse_moe", ["w1", "w2", "w3"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let mut map = serde_json::Map::new();
    for &(layer, shard) in layers {
        for e in 0..tiny_shape().experts {
            for p in projections {
                map.insert(
                    format!("model.layers.{layer}.{module}.experts.{e}.{p}.weight"),
                    shard.into(),
                );
            }
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).expect("index written");
}

/// A partial download: the layer whose shard is there loads (then compiles or runs).
#[test]
fn run_with_weights_loads_a_layer_whose_shard_is_there() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_partial_download(dir.path());
    let output = moeforge(&[
        "run",
        TINY,
        "--tokens",
        "8",
        "--ranks",
        "1",
        "--weights",
        path_arg(dir.path()),
        "--layer-prefix",
        "model.layers.0",
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains(
            "loaded the 8 routed experts of layer `model.layers.0.`, Qwen3-MoE naming (detected)"
        ),
        "{stderr}"
    );
}

/// A DeepSeek-style layer (shared experts, the router's correction bias) run with a spec
/// that has neither: it runs, and says once, before running, what it leaves unread.
#[test]
fn run_with_weights_warns_of_the_tensors_the_spec_leaves_unread() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = write_routed_tiny(dir.path());
    let shape = tiny_shape();
    let with_shared = LayerShape {
        shared_slices: 1,
        ..shape.clone()
    };
    let experts = weights::random(&with_shared, 0..with_shared.gemm_experts(), 8);
    let gate = weights::random_gate(&shape, RouterBias::ScoreCorrection, 9);
    let file = dir.path().join("model.safetensors");
    write_layer(
        &file,
        Family::DeepseekV3,
        "model.layers.0.",
        &with_shared,
        &experts,
        Some((&gate, RouterBias::ScoreCorrection)),
    )
    .expect("the checkpoint is written");
    let output = moeforge(&[
        "run",
        path_arg(&spec),
        "--tokens",
        "8",
        "--ranks",
        "1",
        "--weights",
        path_arg(&file),
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("warning: "))
        .collect();
    assert_eq!(
        warnings,
        [
            "warning: the layer's shared experts (`model.layers.0.mlp.shared_experts.down_proj.weight`, \
             `model.layers.0.mlp.shared_experts.gate_proj.weight`, `model.layers.0.mlp.shared_experts.up_proj.weight`) \
             are not read: the spec has no `shared_experts { }`, so the layer computes its routed experts only",
            "warning: the router's bias `model.layers.0.mlp.gate.e_score_correction_bias` is not read: the spec's \
             router has no `bias = score_correction`, so it chooses experts without it",
        ],
        "{stderr}"
    );
    let loaded_at = stderr.find("loaded the 8 routed experts").expect("loaded");
    assert!(
        stderr.find("warning: ").is_some_and(|at| at > loaded_at),
        "{stderr}"
    );
}

/// Runs `moeforge run SPEC --tokens 4 ARGS...` and compares its exit status and stderr
/// (`tmp` shown as `<TMP>`) with `tests/weights/NAME.txt`; nothing goes to stdout.
fn check_error(name: &str, spec: &str, args: &[String], tmp: &Path, mismatches: &mut Vec<String>) {
    let mut all = vec!["run", spec, "--tokens", "4"];
    all.extend(args.iter().map(String::as_str));
    let output = moeforge(&all);
    let (stdout, stderr) = text(&output);
    assert!(stdout.is_empty(), "{name}: {stdout}");
    let shown = format!(
        "exit {}\n{}",
        output
            .status
            .code()
            .map_or("signal".to_owned(), |c| c.to_string()),
        stderr.replace(path_arg(tmp), "<TMP>")
    );
    let snapshot = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/weights")
        .join(format!("{name}.txt"));
    if std::env::var_os("MOEFORGE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&snapshot, &shown).expect("writable snapshot");
    } else if std::fs::read_to_string(&snapshot).unwrap_or_default() != shown {
        mismatches.push(format!("{name}:\n{shown}"));
    }
}

/// Every way `--weights` can be wrong: the status (2 for a wrong flag or an unreadable
/// path, 1 for a checkpoint that does not hold the spec's layer), the message naming the
/// tensor and the shape the layer needs, and a hint naming the flag to change.
#[test]
fn weights_errors_are_typed_with_hints() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tmp = dir.path();
    let file = |name: &str| -> String { path_arg(&tmp.join(name)).to_owned() };
    let shape = tiny_shape();
    let (h, f) = (shape.hidden as usize, shape.ffn as usize);

    write_tiny(
        &tmp.join("good.safetensors"),
        Family::Qwen3Moe,
        "model.layers.0.",
        4,
    );
    write_tiny_raw(&tmp.join("missing.safetensors"), |t| {
        t.retain(|(name, ..)| name != "model.layers.0.mlp.experts.5.up_proj.weight");
    });
    // Expert 1's down projection stored transposed; expert 1's up projection in FP8 without
    // its block scales;
    // expert 0's gate projection as integers.
    write_tiny_raw(&tmp.join("transposed.safetensors"), |t| t[5].2 = vec![f, h]);
    write_tiny_raw(&tmp.join("fp8.safetensors"), |t| t[4].1 = Dtype::F8_E4M3);
    write_tiny_raw(&tmp.join("i32.safetensors"), |t| t[0].1 = Dtype::I32);
    write_raw(
        &tmp.join("dense.safetensors"),
        &[(
            "model.layers.0.mlp.gate_proj.weight".into(),
            Dtype::BF16,
            vec![f, h],
        )],
    );
    std::fs::write(tmp.join("garbage.safetensors"), b"not a checkpoint").expect("written");
    write_tiny_raw(&tmp.join("two_layers.safetensors"), |t| {
        let more: Vec<_> = t
            .iter()
            .map(|(name, dtype, dims)| {
                (name.replace("layers.0.", "layers.1."), *dtype, dims.clone())
            })
            .collect();
        t.extend(more);
    });
    // Twice the spec's experts; expert 7 of 8 absent altogether (a shard not downloaded).
    write_tiny_raw(&tmp.join("sixteen_experts.safetensors"), |t| {
        let more: Vec<_> = t
            .iter()
            .map(|(name, dtype, dims)| {
                let e: u32 = name
                    .split('.')
                    .nth(5)
                    .and_then(|e| e.parse().ok())
                    .expect("an expert");
                let renamed =
                    name.replace(&format!(".experts.{e}."), &format!(".experts.{}.", e + 8));
                (renamed, *dtype, dims.clone())
            })
            .collect();
        t.extend(more);
    });
    write_tiny_raw(&tmp.join("seven_experts.safetensors"), |t| {
        t.retain(|(name, ..)| !name.contains(".experts.7."));
    });
    // The tiny layer as GPT-OSS stores it: its expert math is not tiny.moe's.
    let gpt_oss_shape = LayerShape {
        activation: Activation::ClampedSwiglu,
        expert_bias: true,
        ..shape.clone()
    };
    let gpt_oss_experts = weights::random(&gpt_oss_shape, 0..shape.experts, 5);
    write_experts(
        &tmp.join("gpt_oss.safetensors"),
        Family::GptOss,
        "model.layers.0.",
        &gpt_oss_shape,
        &gpt_oss_experts,
    )
    .expect("the checkpoint is written");
    std::fs::create_dir(tmp.join("empty")).expect("empty folder");
    std::fs::create_dir(tmp.join("partial")).expect("folder");
    // A DeepSeek layer whose shared MLP is one routed FFN, for a spec that says two.
    let one_slice = LayerShape {
        shared_slices: 1,
        ..shape.clone()
    };
    let deepseek = weights::random(&one_slice, 0..one_slice.gemm_experts(), 7);
    write_experts(
        &tmp.join("deepseek.safetensors"),
        Family::DeepseekV3,
        "model.layers.0.",
        &one_slice,
        &deepseek,
    )
    .expect("the checkpoint is written");
    let with_shared = tmp.join("two_shared_slices.moe");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(TINY))
        .expect("tiny.moe")
        .replace(
            "  parallel {",
            "  shared_experts {\n    count = 2\n    ffn = 256\n  }\n\n  parallel {",
        );
    std::fs::write(&with_shared, text).expect("spec written");
    write_partial_download(&tmp.join("partial"));
    // A sharded folder's index given for the folder; a file cut short.
    let sharded = tmp.join("sharded");
    std::fs::create_dir(&sharded).expect("folder");
    std::fs::write(sharded.join(INDEX_FILE), "{\"weight_map\": {}}").expect("written");
    let whole = std::fs::read(tmp.join("good.safetensors")).expect("readable");
    std::fs::write(tmp.join("cut.safetensors"), &whole[..whole.len() / 2]).expect("written");
    // A spec whose ffn is half the checkpoints'.
    let half_ffn = tmp.join("half_ffn.moe");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(TINY))
        .expect("tiny.moe")
        .replace("ffn = 256", "ffn = 128");
    std::fs::write(&half_ffn, text).expect("spec written");

    let weights = |name: &str, more: &[&str]| -> Vec<String> {
        let mut args = vec!["--weights".to_owned(), file(name)];
        args.extend(more.iter().map(|a| a.to_string()));
        args
    };
    let cases: [(&str, &str, Vec<String>); 21] = [
        ("no_such_file", TINY, weights("absent.safetensors", &[])),
        ("empty_folder", TINY, weights("empty", &[])),
        ("not_safetensors", TINY, weights("garbage.safetensors", &[])),
        (
            "index_for_the_folder",
            TINY,
            weights(&format!("sharded/{INDEX_FILE}"), &[]),
        ),
        ("cut_short", TINY, weights("cut.safetensors", &[])),
        (
            "shard_not_downloaded",
            TINY,
            weights("partial", &["--layer-prefix", "model.layers.1"]),
        ),
        ("no_experts", TINY, weights("dense.safetensors", &[])),
        (
            "several_layers",
            TINY,
            weights("two_layers.safetensors", &[]),
        ),
        (
            "prefix_matches_nothing_of_one_layer",
            TINY,
            weights("good.safetensors", &["--layer-prefix", "model.layers.7"]),
        ),
        (
            "shared_experts_of_another_size",
            path_arg(&with_shared),
            weights("deepseek.safetensors", &[]),
        ),
        (
            "prefix_matches_nothing",
            TINY,
            weights(
                "two_layers.safetensors",
                &["--layer-prefix", "model.layers.7"],
            ),
        ),
        ("missing_tensor", TINY, weights("missing.safetensors", &[])),
        (
            "more_experts_than_the_spec",
            TINY,
            weights("sixteen_experts.safetensors", &[]),
        ),
        (
            "an_expert_missing",
            TINY,
            weights("seven_experts.safetensors", &[]),
        ),
        (
            "wrong_family",
            TINY,
            weights("good.safetensors", &["--family", "mixtral"]),
        ),
        ("mis_shaped", TINY, weights("transposed.safetensors", &[])),
        ("fp8_without_scales", TINY, weights("fp8.safetensors", &[])),
        ("int_dtype", TINY, weights("i32.safetensors", &[])),
        (
            "gpt_oss_family",
            TINY,
            weights("good.safetensors", &["--family", "gpt-oss"]),
        ),
        (
            "gpt_oss_checkpoint_swiglu_spec",
            TINY,
            weights("gpt_oss.safetensors", &[]),
        ),
        (
            "layer_of_another_size",
            path_arg(&half_ffn),
            weights("good.safetensors", &[]),
        ),
    ];
    let mut mismatches = Vec::new();
    for (name, spec, args) in &cases {
        check_error(name, spec, args, tmp, &mut mismatches);
    }
    assert!(
        mismatches.is_empty(),
        "stderr changed (MOEFORGE_BLESS=1 to accept):\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn weights_flags_are_documented_and_need_weights() {
    let output = moeforge(&["run", "--help"]);
    let (stdout, _) = text(&output);
    for flag in [
        "--weights <PATH>",
        "--layer-prefix <PREFIX>",
        "--family <FAMILY>",
    ] {
        assert!(stdout.contains(flag), "{stdout}");
    }
    for args in [
        &[
            "run",
            TINY,
            "--tokens",
            "4",
            "--layer-prefix",
            "model.layers.0.",
        ][..],
        &["run", TINY, "--tokens", "4", "--family", "mixtral"],
        &[
            "run",
            TINY,
            "--tokens",
            "4",
            "--weights",
            "x",
            "--family",
            "llama",
        ],
        // Only `run` takes weights: explain and compile are unchanged.
        &["explain", TINY, "--weights", "x"],
        &["compile", TINY, "--weights", "x", "-o", "target/never"],
    ] {
        let output = moeforge(args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {:?}",
            text(&output)
        );
    }
}
