//! moeforge against the reference implementation: runs `benches/hf_reference_check.py`,
//! which builds Mixtral's, Qwen3-MoE's, Qwen2-MoE's (a shared expert scaled by its own
//! sigmoid gate), DeepSeek-V3's (sigmoid group-limited router with its score correction
//! and scale, shared experts) and GPT-OSS's (router bias, top-k then softmax, clamped
//! SwiGLU experts with biases) MoE blocks from Hugging Face transformers,
//! saves their weights under the checkpoints' names (for DeepSeek-V3 and GPT-OSS also
//! quantized as their published releases store them: FP8 with block scales, MXFP4, the
//! block computing with the values those code) and compares their output, chosen
//! experts and routing weights with `moeforge run --inputs --outputs` on the same weights
//! and inputs (the tolerances and why are in the script's docstring).
//!
//! On the GPU machine, from the repository root:
//!
//! ```sh
//! cargo test --test hf_reference -- --include-ignored
//! ```
//!
//! `MOEFORGE_PYTHON` names the interpreter (default `python3`); `MOEFORGE_HF_REAL_SIZES=1`
//! adds each family at a real model's layer sizes (Mixtral-8x7B, Qwen3-30B-A3B,
//! Qwen1.5-MoE-A2.7B, DeepSeek-V3, gpt-oss-120b; DeepSeek-V3's layer alone is 22.5 GB of bf16 weights, held
//! on the GPU, in host memory and on disk at once, one case at a time). Without
//! torch, transformers, safetensors or a CUDA device the test says SKIPPED on stderr (past
//! the test harness's capture) and returns: a skip, not a pass.

use std::io::Write;
use std::path::Path;
use std::process::Command;

/// The script's exit status when it cannot run here (it says why).
const SKIP_EXIT: i32 = 77;

/// Written straight to stderr, so that it shows whatever the harness captures.
fn log(text: &str) {
    let _ = std::io::stderr().write_all(format!("{text}\n").as_bytes());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn moeforge_agrees_with_transformers() {
    let python = std::env::var("MOEFORGE_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/hf_reference_check.py");
    let mut command = Command::new(&python);
    command
        .arg(&script)
        .arg("--moeforge")
        .arg(env!("CARGO_BIN_EXE_moeforge"));
    if std::env::var("MOEFORGE_HF_REAL_SIZES").as_deref() == Ok("1") {
        command.arg("--real-sizes");
    }
    let output = match command.output() {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            log(&format!(
                "SKIPPED moeforge_agrees_with_transformers: no `{python}` \
                 here (set MOEFORGE_PYTHON to a python with torch, transformers and safetensors)"
            ));
            return;
        }
        Err(error) => panic!("cannot start `{python}`: {error}"),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    log(&format!("{stdout}{stderr}"));
    match output.status.code() {
        Some(0) => {}
        Some(SKIP_EXIT) => log(&format!(
            "SKIPPED moeforge_agrees_with_transformers: {} (not a pass)",
            stdout.trim().trim_start_matches("SKIPPED: ")
        )),
        status => panic!(
            "{} exited {status:?}: moeforge disagrees with transformers, or the check could not run (output above)",
            script.display()
        ),
    }
}
