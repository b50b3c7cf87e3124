//! `moeforge run --inputs FILE [--outputs FILE]`: a call on activations (and routing) read
//! from a safetensors file, its results written to one. Without a GPU, `run` reads and
//! checks the inputs, compiles and says it did not run (and that nothing was written); with
//! one it runs them and, with `--check`, compares with the CPU reference. Every way the
//! inputs can be wrong is an error naming the tensor, with the status `run` documents
//! (2 for a file that cannot be read, 1 for inputs that do not fit the layer).

use std::path::Path;
use std::process::Output;

mod common;
use common::moeforge;

use safetensors::tensor::{Dtype, TensorView};

const TINY: &str = "dsl-examples/tiny.moe";
/// The tiny layer's hidden size, top-k and experts.
const HIDDEN: usize = 128;
const TOP_K: usize = 2;

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temp path")
}

/// A safetensors file of `(name, dtype, shape, bytes)`.
fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, dims, bytes)| {
            (
                *name,
                TensorView::new(*dtype, dims.clone(), bytes).expect("a valid view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("written");
}

/// `x` [tokens, H] of small bf16 values.
fn x(tokens: usize) -> (&'static str, Dtype, Vec<usize>, Vec<u8>) {
    let bytes = (0..tokens * HIDDEN)
        .flat_map(|i| {
            // bf16 bits of ±(1 + i mod 8 / 8)
            let magnitude = 0x3f80u16 + ((i % 8) as u16) * 0x10;
            let sign = if i % 3 == 0 { 0x8000 } else { 0 };
            (magnitude | sign).to_le_bytes()
        })
        .collect();
    ("x", Dtype::BF16, vec![tokens, HIDDEN], bytes)
}

/// The caller's routing: token t takes experts t mod 8 and (t + 3) mod 8, weights ¾ and ¼.
fn routing(tokens: usize) -> [(&'static str, Dtype, Vec<usize>, Vec<u8>); 2] {
    let ids = (0..tokens)
        .flat_map(|t| [(t % 8) as i32, ((t + 3) % 8) as i32])
        .flat_map(i32::to_le_bytes)
        .collect();
    let weights = (0..tokens)
        .flat_map(|_| [0.75f32, 0.25])
        .flat_map(f32::to_le_bytes)
        .collect();
    [
        ("topk_ids", Dtype::I32, vec![tokens, TOP_K], ids),
        ("topk_weights", Dtype::F32, vec![tokens, TOP_K], weights),
    ]
}

/// The tiny layer with a Mixtral router, written next to the inputs.
fn tiny_with_router(dir: &Path) -> String {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(TINY))
        .expect("tiny.moe")
        .replace(
            "  max_tokens = 512\n",
            "  max_tokens = 512\n  router {\n    scoring = softmax\n    normalize = true\n  }\n",
        );
    let path = dir.join("tiny_router.moe");
    std::fs::write(&path, text).expect("spec written");
    path_arg(&path).to_owned()
}

/// Inputs with the caller's routing run (or compile only, without a GPU); `--outputs`
/// writes `y` and the routing used, or says it was not written.
#[test]
fn inputs_with_routing_run_and_write_outputs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let inputs = dir.path().join("inputs.safetensors");
    let outputs = dir.path().join("outputs.safetensors");
    let [ids, weights] = routing(37);
    write(&inputs, &[x(37), ids, weights]);
    let output = moeforge(&[
        "run",
        TINY,
        "--ranks",
        "1",
        "--inputs",
        path_arg(&inputs),
        "--outputs",
        path_arg(&outputs),
        "--check",
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stderr.contains("read 37 tokens from ")
            && stderr.contains(", with the caller's topk_ids and topk_weights"),
        "{stderr}"
    );
    if stdout.contains("not run: no GPU") {
        assert!(stderr.contains("is not written: nothing runs"), "{stderr}");
        assert!(!outputs.exists());
    } else {
        assert!(
            stdout.contains("tiny T=37:") && stdout.contains("PASS"),
            "{stdout}{stderr}"
        );
        let bytes = std::fs::read(&outputs).expect("outputs written");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        assert_eq!(file.tensor("y").expect("y").shape(), [37, HIDDEN]);
        let [ids, _] = routing(37);
        assert_eq!(file.tensor("topk_ids").expect("ids").data(), ids.3);
        assert!(file.tensor("router_logits").is_err(), "caller-routed");
    }
}

/// `x` alone, for a spec with a router: the layer chooses, and the outputs carry its
/// logits.
#[test]
fn x_alone_routes_through_the_specs_router() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = tiny_with_router(dir.path());
    let inputs = dir.path().join("x.safetensors");
    let outputs = dir.path().join("outputs.safetensors");
    write(&inputs, &[x(5)]);
    let output = moeforge(&[
        "run",
        &spec,
        "--ranks",
        "1",
        "--inputs",
        path_arg(&inputs),
        "--outputs",
        path_arg(&outputs),
        "--check",
    ]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("read 5 tokens from "), "{stderr}");
    if !stdout.contains("not run: no GPU") {
        assert!(
            stderr.contains("the spec's router's routing"),
            "{stdout}{stderr}"
        );
        assert!(stdout.contains("PASS"), "{stdout}{stderr}");
        let bytes = std::fs::read(&outputs).expect("outputs written");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        assert_eq!(
            file.tensor("router_logits").expect("logits").shape(),
            [5, 8]
        );
    }
}

/// Every wrong inputs file: exit status and the message naming the tensor, with a hint.
#[test]
fn wrong_inputs_are_typed_errors_with_hints() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tmp = dir.path();
    let spec_with_router = tiny_with_router(tmp);
    let file = |name: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]| -> String {
        let path = tmp.join(format!("{name}.safetensors"));
        write(&path, tensors);
        path_arg(&path).to_owned()
    };
    let [ids, weights] = routing(4);
    let x_f32 = ("x", Dtype::F32, vec![4, HIDDEN], vec![0u8; 4 * HIDDEN * 4]);
    let x_3d = ("x", Dtype::BF16, vec![1, 4, HIDDEN], x(4).3);
    let ids_i64 = (
        "topk_ids",
        Dtype::I64,
        vec![4, TOP_K],
        vec![0u8; 4 * TOP_K * 8],
    );
    let weights_short = (
        "topk_weights",
        Dtype::F32,
        vec![3, TOP_K],
        vec![0u8; 3 * TOP_K * 4],
    );
    let ids_out_of_range = (
        "topk_ids",
        Dtype::I32,
        vec![4, TOP_K],
        [0i32, 1, 2, 8, 0, 1, 0, 1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    );
    let garbage = tmp.join("garbage.safetensors");
    std::fs::write(&garbage, b"not safetensors").expect("written");
    let absent = tmp.join("absent.safetensors");

    let cases: Vec<(&str, String, String, i32, &str)> = vec![
        (
            "no such file",
            TINY.into(),
            path_arg(&absent).into(),
            2,
            "error: cannot read the inputs <TMP>/absent.safetensors",
        ),
        (
            "not safetensors",
            TINY.into(),
            path_arg(&garbage).into(),
            1,
            "error: the inputs <TMP>/garbage.safetensors are not a safetensors file",
        ),
        (
            "no x",
            TINY.into(),
            file("no_x", &[ids.clone(), weights.clone()]),
            1,
            "hold no tensor `x` (the activations, [tokens, 128] BF16); they hold `topk_ids`, `topk_weights`",
        ),
        (
            "x in f32",
            TINY.into(),
            file("x_f32", &[x_f32]),
            1,
            "tensor `x` of <TMP>/x_f32.safetensors is F32; it must be BF16\nhint: store x as bfloat16",
        ),
        (
            "x of three dimensions",
            TINY.into(),
            file("x_3d", &[x_3d]),
            1,
            "has shape [1, 4, 128]; the layer needs [tokens, 128]\nhint: x is one row per token",
        ),
        (
            "more tokens than max_tokens",
            TINY.into(),
            file("too_many", &[x(513)]),
            1,
            "holds 513 tokens, more than the layer's max_tokens of 512",
        ),
        (
            "no routing and no router",
            TINY.into(),
            file("x_only", &[x(4)]),
            1,
            "hold no routing (`topk_ids`, `topk_weights`) and the layer has no router",
        ),
        (
            "ids without weights",
            spec_with_router,
            file("half", &[x(4), ids.clone()]),
            1,
            "hold `topk_ids` but not `topk_weights`",
        ),
        (
            "ids in i64",
            TINY.into(),
            file("ids_i64", &[x(4), ids_i64, weights.clone()]),
            1,
            "tensor `topk_ids` of <TMP>/ids_i64.safetensors is I64; it must be I32\nhint: store topk_ids as int32",
        ),
        (
            "weights of another token count",
            TINY.into(),
            file("weights_short", &[x(4), ids, weights_short]),
            1,
            "tensor `topk_weights` of <TMP>/weights_short.safetensors has shape [3, 2]; the layer needs [4, 2]",
        ),
        (
            "an expert out of range",
            TINY.into(),
            file("out_of_range", &[x(4), ids_out_of_range, weights]),
            1,
            "gives token 1 expert 8 (choice 1); the layer has experts 0..8",
        ),
    ];
    let mut failures = Vec::new();
    for (what, spec, inputs, status, message) in &cases {
        let output = moeforge(&["run", spec, "--ranks", "1", "--inputs", inputs]);
        let (stdout, stderr) = text(&output);
        let stderr = stderr.replace(path_arg(tmp), "<TMP>");
        if output.status.code() != Some(*status) || !stderr.contains(message) || !stdout.is_empty()
        {
            failures.push(format!(
                "{what}: exit {:?}, want {status} and `{message}`; stderr:\n{stderr}{stdout}",
                output.status.code()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `--inputs` replaces `--tokens` and the random routing, and runs on one GPU only.
#[test]
fn inputs_flags_are_documented_and_exclusive() {
    let (stdout, _) = text(&moeforge(&["run", "--help"]));
    for flag in ["--inputs <FILE>", "--outputs <FILE>", "--tokens <TOKENS>"] {
        assert!(stdout.contains(flag), "{stdout}");
    }
    for args in [
        &["run", TINY][..],
        &["run", TINY, "--inputs", "x", "--tokens", "4"],
        &["run", TINY, "--inputs", "x", "--routing", "skewed"],
        &["run", TINY, "--inputs", "x", "--ranks", "4"],
        &[
            "run",
            TINY,
            "--tokens",
            "4",
            "--outputs",
            "y",
            "--gpus",
            "2",
        ],
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
