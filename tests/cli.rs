//! Tests of the `moeforge` binary: `explain` output of every example against committed
//! snapshots in `tests/explain/` (`MOEFORGE_BLESS=1` rewrites them), `check` and `fmt` on
//! the examples, and the exit statuses (0 valid, 1 invalid input, 2 usage).

use std::path::{Path, PathBuf};

mod common;
use common::{moeforge, moeforge_with_env};

fn examples() -> Vec<PathBuf> {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("dsl-examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(directory)
        .expect("dsl-examples exists")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "moe"))
        .collect();
    files.sort();
    files
}

fn relative(path: &Path) -> String {
    path.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn every_example_checks_and_is_formatted() {
    let files: Vec<String> = examples().iter().map(|path| relative(path)).collect();
    assert!(files.len() >= 7);
    let mut args = vec!["check"];
    args.extend(files.iter().map(String::as_str));
    let output = moeforge(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut args = vec!["fmt", "--check"];
    args.extend(files.iter().map(String::as_str));
    let output = moeforge(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The snapshots are the H200's plans: `--target h200` keeps them so on a machine whose GPU
/// is another (an H100 plans otherwise).
#[test]
fn explain_output_matches_snapshots() {
    let bless = std::env::var_os("MOEFORGE_BLESS").is_some_and(|value| value == "1");
    let mut mismatches = Vec::new();
    for example in examples() {
        let output = moeforge(&["explain", &relative(&example), "--target", "h200"]);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8(output.stdout).expect("explain prints UTF-8");
        let stem = example
            .file_stem()
            .and_then(|stem| stem.to_str())
            .unwrap_or("?");
        let snapshot = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/explain")
            .join(format!("{stem}.txt"));
        if bless {
            std::fs::write(&snapshot, &text).expect("writable snapshot");
        } else if std::fs::read_to_string(&snapshot).unwrap_or_default() != text {
            mismatches.push(format!("{stem}:\n{text}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "explain changed (MOEFORGE_BLESS=1 to accept):\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn invalid_input_exits_1_with_a_rendered_diagnostic() {
    let output = moeforge(&["check", "compiler/tests/diagnostics/misaligned.moe"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("misaligned.moe:"), "{stderr}");
    assert!(stderr.contains("^^^^"), "{stderr}");
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn invalid_utf8_is_a_diagnostic_not_a_crash() {
    let output = moeforge(&["check", "compiler/tests/diagnostics/invalid_utf8.moe"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not valid UTF-8"));
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(moeforge(&["check"]).status.code(), Some(2));
    assert_eq!(moeforge(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(
        moeforge(&["check", "no/such/file.moe"]).status.code(),
        Some(2)
    );
    assert_eq!(
        moeforge(&["fmt", "--check", "--stdout", "dsl-examples/tiny.moe"])
            .status
            .code(),
        Some(2)
    );
    // A bench file's token counts and routing are the file's.
    let measured_and_tokens = moeforge(&[
        "simulate",
        "dsl-examples/qwen3_30b_a3b.moe",
        "--measured",
        "benches/results/2026-11-30_qwen3_30b_a3b_ep2_uniform.json",
        "--tokens",
        "7",
    ]);
    assert_eq!(measured_and_tokens.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&measured_and_tokens.stderr).contains("--measured"));
    // A JIT setting that is not understood is an error, not PTX silently left out.
    let out = std::env::temp_dir().join(format!("moeforge-cli-test-{}", std::process::id()));
    let bad_dump = moeforge_with_env(
        &[
            "compile",
            "dsl-examples/tiny.moe",
            "-o",
            out.to_str().expect("a UTF-8 temporary folder"),
        ],
        &[("MOEFORGE_DUMP", "1")],
    );
    assert_eq!(bad_dump.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_dump.stderr).contains("MOEFORGE_DUMP"));
    assert!(!out.exists());
    // The SVG path names a folder: refused before simulating.
    let svg_folder = moeforge(&["simulate", "dsl-examples/tiny.moe", "--svg", "tests"]);
    assert_eq!(svg_folder.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&svg_folder.stdout).is_empty());
    // Output that cannot be written is one line of error, not a panic.
    #[cfg(target_os = "linux")]
    {
        let full = std::fs::File::create("/dev/full").expect("/dev/full opens");
        let unwritable = std::process::Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(["explain", "dsl-examples/tiny.moe"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(full)
            .output()
            .expect("the moeforge binary runs");
        let stderr = String::from_utf8_lossy(&unwritable.stderr);
        assert_eq!(unwritable.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.starts_with("error: failed printing to stdout"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // The in-run peers are single-GPU layers.
    let peers_over_gpus = moeforge(&["bench", "dsl-examples/tiny.moe", "--peers", "--gpus", "2"]);
    assert_eq!(peers_over_gpus.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&peers_over_gpus.stderr).contains("--peers"));
}

#[test]
fn every_command_has_help() {
    for command in [
        &["--help"][..],
        &["check", "--help"],
        &["explain", "--help"],
        &["fmt", "--help"],
    ] {
        let output = moeforge(command);
        assert!(output.status.success());
        assert!(String::from_utf8_lossy(&output.stdout).contains("Usage"));
    }
}

#[test]
fn fmt_rewrites_in_place_keeping_comments_and_check_flags_unformatted_files() {
    let directory = std::env::temp_dir().join(format!("moeforge-fmt-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("temp dir");
    let path = directory.join("messy.moe");
    std::fs::write(
        &path,
        "# header\ntopology t {gpus_per_node=1 nvlink=1 GB/s,1 us // link\n network = 1 GB/s, 1 us}\n\
         layer l{hidden=64 ffn=64 experts=1 top_k=1 topology=t}\n",
    )
    .expect("write temp file");
    let file = path.to_str().expect("UTF-8 temp path");
    assert_eq!(moeforge(&["fmt", "--check", file]).status.code(), Some(1));
    assert!(moeforge(&["fmt", file]).status.success());
    let formatted = std::fs::read_to_string(&path).expect("read back");
    assert_eq!(
        formatted,
        "# header\ntopology t {\n  gpus_per_node = 1\n  nvlink = 1 GB/s, 1 us // link\n  network = 1 GB/s, 1 us\n}\n\n\
         layer l {\n  hidden = 64\n  ffn = 64\n  experts = 1\n  top_k = 1\n  topology = t\n}\n"
    );
    assert!(moeforge(&["fmt", "--check", file]).status.success());
    assert!(moeforge(&["check", file]).status.success());
    let _ = std::fs::remove_dir_all(&directory);
}

/// A layer whose buffers cannot fit an H200 (DeepSeek-V3 on 64 ranks at 32768 tokens per
/// rank): `check` accepts it (a spec may exist only to be simulated) with a note saying
/// what it needs and which max_tokens fits; the shipped example (4096) gets none.
#[test]
fn check_notes_a_layer_too_large_for_its_gpus() {
    let directory = std::env::temp_dir().join(format!("moeforge-memory-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("temp dir");
    let path = directory.join("ep64_32k.moe");
    let shipped =
        std::fs::read_to_string("dsl-examples/deepseek_v3_ep64.moe").expect("the example");
    std::fs::write(
        &path,
        shipped.replace("max_tokens = 4096", "max_tokens = 32768"),
    )
    .expect("write temp file");
    let output = moeforge(&["check", path.to_str().expect("UTF-8 temp path")]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.contains("note: layer `deepseek_v3_ep64`: the plan needs 229.4 GB per rank")
            && stdout.contains("max_tokens = 19107 fits"),
        "{stdout}"
    );
    let shipped = moeforge(&["check", "dsl-examples/deepseek_v3_ep64.moe"]);
    assert!(!String::from_utf8_lossy(&shipped.stdout).contains("note:"));
    let _ = std::fs::remove_dir_all(&directory);
}

/// A file with no layer is valid (`check` passes it) but leaves the other commands nothing
/// to do: `check` says so, `compile` refuses it.
#[test]
fn check_notes_a_file_without_a_layer() {
    let directory = std::env::temp_dir().join(format!("moeforge-nolayer-{}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("temp dir");
    let path = directory.join("empty.moe");
    std::fs::write(&path, "# nothing yet\n").expect("write temp file");
    let file = path.to_str().expect("UTF-8 temp path");
    let output = moeforge(&["check", file]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.contains("ok (0 topologies, 0 layers)")
            && stdout.contains("note: no layer: nothing for compile, run or simulate"),
        "{stdout}"
    );
    let out = directory.join("out");
    let compiled = moeforge(&[
        "compile",
        file,
        "-o",
        out.to_str().expect("UTF-8 temp path"),
    ]);
    assert_eq!(compiled.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&compiled.stderr).contains("defines no layer"));
    let _ = std::fs::remove_dir_all(&directory);
}

/// Compiling into a folder an earlier compile wrote removes the layer files its plan.json
/// named that the new one does not (here another layer's source), and nothing else: not a
/// file of the user's, nor such a layer file changed since.
#[test]
fn compile_into_a_used_folder_leaves_one_compiles_files() {
    let directory = std::env::temp_dir().join(format!("moeforge-reused-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    let out = directory.to_str().expect("UTF-8 temp path");
    let compile = |example: &str| {
        let output = moeforge(&["compile", example, "-o", out, "--no-ptx"]);
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    compile("dsl-examples/tiny.moe");
    std::fs::write(directory.join("notes.txt"), "mine").expect("write a user file");
    let second = compile("dsl-examples/tiny_two_nodes.moe");
    assert!(
        second.contains("tiny.cu (an earlier compile's, not in the new plan.json)"),
        "{second}"
    );
    // A layer file changed since its compile wrote it stays.
    compile("dsl-examples/tiny.moe");
    std::fs::write(directory.join("tiny.cu"), "// edited").expect("edit the source");
    let fourth = compile("dsl-examples/tiny_two_nodes.moe");
    assert!(
        fourth.contains(
            "tiny.cu: an earlier compile's file, not in the new plan.json, changed since"
        ),
        "{fourth}"
    );
    std::fs::remove_file(directory.join("tiny.cu")).expect("remove the edited source");
    let mut left: Vec<String> = std::fs::read_dir(&directory)
        .expect("the folder")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    left.sort();
    assert_eq!(left, ["notes.txt", "plan.json", "tiny_two_nodes.cu"]);
    let _ = std::fs::remove_dir_all(&directory);
}

/// A file of the output's names that is not as an earlier compile left it (the user's own
/// `tiny.cu`, a `plan.json` of something else, a compiled `tiny.cu` edited since) is kept
/// and the compile refused, unless `--force`.
#[test]
fn compile_keeps_files_it_did_not_write_unless_forced() {
    let directory = std::env::temp_dir().join(format!("moeforge-not-ours-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).expect("temp dir");
    let out = directory.to_str().expect("UTF-8 temp path");
    let compile = |extra: &[&str]| {
        let mut args = vec!["compile", "dsl-examples/tiny.moe", "-o", out, "--no-ptx"];
        args.extend(extra);
        moeforge(&args)
    };
    let read = |name: &str| std::fs::read_to_string(directory.join(name)).expect("read");
    for (name, mine) in [("tiny.cu", "// mine"), ("plan.json", "{\"mine\": true}")] {
        std::fs::write(directory.join(name), mine).expect("write a file of the user's");
        let refused = compile(&[]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{name}: {stderr}");
        assert!(
            stderr.contains(&format!("{name} is not as an earlier compile"))
                && stderr.contains("--force"),
            "{stderr}"
        );
        assert_eq!(read(name), mine, "{name} kept");
        std::fs::remove_file(directory.join(name)).expect("remove");
    }
    std::fs::write(directory.join("tiny.cu"), "// mine").expect("write");
    let forced = compile(&["--force"]);
    assert!(forced.status.success(), "{forced:?}");
    assert_ne!(read("tiny.cu"), "// mine");
    // Its own output, compiled again, needs no force; edited since, it does.
    let again = compile(&[]);
    assert!(again.status.success(), "{again:?}");
    std::fs::write(directory.join("tiny.cu"), "// edited").expect("edit");
    let edited = compile(&[]);
    assert_eq!(edited.status.code(), Some(2), "{edited:?}");
    assert_eq!(read("tiny.cu"), "// edited");
    let _ = std::fs::remove_dir_all(&directory);
}

/// Without NVRTC, `compile` is an error with a hint and creates nothing (the runtime would
/// refuse a directory without PTX); `--no-ptx` writes the source and plan alone. The
/// binary runs from a copy outside the repository, with an empty environment, so that it
/// finds no toolkit (not the repository's `.venv/`, nor `python3`'s); skipped, saying so,
/// where a toolkit sits in a place it always looks (`/usr/local/cuda`, a `.venv/` above
/// the temporary folder).
#[test]
fn compile_without_nvrtc_is_an_error_unless_no_ptx() {
    let root = std::env::temp_dir().join(format!("moeforge-no-nvrtc-{}", std::process::id()));
    let always_looked_in = ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|lib| {
            Path::new("/usr/local/cuda")
                .join(lib)
                .join("libnvrtc.so.13")
        })
        .chain(root.ancestors().map(|dir| dir.join(".venv")));
    if let Some(found) = always_looked_in.into_iter().find(|path| path.exists()) {
        eprintln!(
            "note: skipped: {} holds a toolkit the binary would find",
            found.display()
        );
        return;
    }
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("bin")).expect("temp dir");
    let binary = root.join("bin/moeforge");
    std::fs::copy(env!("CARGO_BIN_EXE_moeforge"), &binary).expect("copy the binary");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("dsl-examples/tiny.moe");
    let out = root.join("out");
    let compile = |extra: &[&str]| {
        std::process::Command::new(&binary)
            .arg("compile")
            .arg(&example)
            .arg("-o")
            .arg(&out)
            .args(extra)
            .env_clear()
            .env("PATH", root.join("bin"))
            .env("HOME", &root)
            .env(
                "MOEFORGE_TUNING_CACHE",
                "/nonexistent/moeforge-tests/tuning.json",
            )
            .current_dir(&root)
            .output()
            .expect("the copied binary runs")
    };
    let refused = compile(&[]);
    let refused_stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    let out_made = out.exists();
    let written = compile(&["--no-ptx"]);
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .map(|listing| {
            listing
                .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(refused.status.code(), Some(2), "{refused_stderr}");
    assert!(
        refused_stderr.contains("cannot compile the PTX: no CUDA toolkit with libnvrtc.so.13")
            && refused_stderr.contains("pass --no-ptx"),
        "{refused_stderr}"
    );
    assert!(!out_made, "the refused compile created {}", out.display());
    assert!(written.status.success(), "{written:?}");
    assert_eq!(files, ["plan.json", "tiny.cu"]);
}

/// `-` reads standard input: `check` names it `<stdin>`, `fmt` prints the formatted text.
#[test]
fn a_file_of_dash_is_standard_input() {
    use std::io::Write;
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("dsl-examples/tiny.moe"),
    )
    .expect("tiny.moe");
    let with_stdin = |args: &[&str], input: &str| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_moeforge"))
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the moeforge binary runs");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
        child.wait_with_output().expect("it ends")
    };
    let checked = with_stdin(&["check", "-"], &text);
    assert!(checked.status.success(), "{checked:?}");
    assert!(String::from_utf8_lossy(&checked.stdout).starts_with("<stdin>: ok"));
    let broken = with_stdin(&["check", "-"], "layer x {\n");
    assert_eq!(broken.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&broken.stderr).contains("<stdin>:1:10"));
    let formatted = with_stdin(&["fmt", "-"], &text);
    assert!(formatted.status.success(), "{formatted:?}");
    assert_eq!(String::from_utf8_lossy(&formatted.stdout), text);
}

/// A layer only the target can refuse: `check` accepts it for the H200, `check`, `explain`
/// and `compile` for that target exit 1 with a diagnostic at the hint (file:line:column,
/// caret, a hint that names that target's nearest tile).
#[test]
fn a_layer_the_target_cannot_run_is_refused_with_its_span() {
    let file = "tests/fixtures/wgmma_only_tile.moe";
    assert_eq!(moeforge(&["check", file]).status.code(), Some(0));
    for args in [
        vec!["check", file, "--target", "a100"],
        vec!["explain", file, "--target", "a100"],
        vec![
            "compile",
            file,
            "--target",
            "a100",
            "--no-ptx",
            "-o",
            "target/refused",
        ],
    ] {
        let output = moeforge(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("wgmma_only_tile.moe:18:18"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains("^^^^"), "{stderr}");
        assert!(
            stderr.contains("`gemm1.tile = 128x128x64` cannot be planned for the NVIDIA A100"),
            "{stderr}"
        );
        assert!(
            stderr.contains("hint: `gemm1.tile = 64x128x64` is the nearest tile"),
            "{stderr}"
        );
    }
    let output = moeforge(&["explain", file, "--target", "h200"]);
    assert_eq!(output.status.code(), Some(0));
    let output = moeforge(&["explain", file, "--target", "b300"]);
    assert_eq!(
        output.status.code(),
        Some(2),
        "an unknown target is a usage error"
    );
}

/// `run --ranks R` plans the expert-parallel kernels: without a GPU it compiles them (the
/// metadata, dispatch, arrange and combine kernels besides the GEMMs, and the ranks' fused
/// decode) and says it did not run; with one it runs every rank and checks it against the
/// CPU reference.
#[test]
fn run_over_virtual_ranks_compiles_or_checks_every_rank() {
    let out = moeforge(&[
        "run",
        "dsl-examples/tiny.moe",
        "--tokens",
        "16",
        "--ranks",
        "2",
        "--check",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let compiled_only = stdout.contains("not run: no GPU") && stdout.contains("11 kernels");
    let ran = stdout.contains("rank 0 T=16") && stdout.contains("rank 1 T=16");
    assert!(compiled_only || ran, "{stdout}{stderr}");
    if ran {
        assert!(!stdout.contains("FAIL"), "{stdout}");
    }
    assert_eq!(
        moeforge(&[
            "run",
            "dsl-examples/tiny.moe",
            "--tokens",
            "1",
            "--ranks",
            "0"
        ])
        .status
        .code(),
        Some(2)
    );
    let uneven = moeforge(&[
        "run",
        "dsl-examples/tiny.moe",
        "--tokens",
        "1",
        "--ranks",
        "3",
    ]);
    assert_eq!(uneven.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&uneven.stderr).contains("evenly"));
}

#[test]
fn simulate_prints_three_schedules_and_the_bench_comparison() {
    let output = moeforge(&["simulate", "dsl-examples/tiny.moe", "--tokens", "16,100"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    for schedule in [
        "  bulk-synchronous",
        "  fine-grained, naive order",
        "  fine-grained, topology-aware",
        "  the topology-aware exchange (dispatch + combine) is ",
    ] {
        assert_eq!(
            stdout.lines().filter(|l| l.starts_with(schedule)).count(),
            2,
            "{stdout}"
        );
    }
    let output = moeforge(&[
        "simulate",
        "dsl-examples/qwen3_30b_a3b.moe",
        "--measured",
        "benches/results/2026-11-30_qwen3_30b_a3b_ep2_uniform.json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("| 4096 ")).count(),
        1,
        "{stdout}"
    );
    // A file with the GEMM stage's kernels split gets GEMM1 and GEMM2 beside them.
    let output = moeforge(&[
        "simulate",
        "dsl-examples/qwen3_30b_a3b.moe",
        "--measured",
        "benches/results/2026-12-01_ep2_at_e323b9f/2026-12-01_qwen3_30b_a3b_ep2_uniform_at_e323b9f.json",
    ]);
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| 1024 "))
        .unwrap_or_else(|| panic!("no 1024-token row: {stdout}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    assert_eq!(cells.len(), 10, "{row}");
    assert!(
        cells[7].starts_with("180.0 / ") && cells[8].starts_with("90.6 / "),
        "{row}"
    );
    // A file of virtual ranks is planned on virtual ranks, and DeepSeek-V3 without the
    // shared expert the bench left out; both stay within 15% of the measured layer at
    // 1024 tokens per rank.
    for (example, measured) in [("qwen3_30b_a3b", "347.3 / "), ("deepseek_v3", "5407.5 / ")] {
        let file = format!(
            "benches/results/2026-12-04_simulator_virtual_ranks/call2_combine_lanes/2026-12-04_{example}_ep2v_uniform_at_6ebe978-dirty.json"
        );
        let output = moeforge(&[
            "simulate",
            &format!("dsl-examples/{example}.moe"),
            "--measured",
            &file,
        ]);
        assert!(output.status.success());
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.contains("on 2 virtual ranks on one"), "{stdout}");
        let row = stdout
            .lines()
            .find(|l| l.starts_with("| 1024 "))
            .unwrap_or_else(|| panic!("no 1024-token row: {stdout}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(cells[7].starts_with(measured), "{row}");
        let layer: Vec<f64> = cells[2]
            .split(['/', '('])
            .take(2)
            .map(|v| v.trim().parse().expect("a number"))
            .collect();
        assert!((layer[1] / layer[0] - 1.0).abs() < 0.15, "{row}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            stderr.contains("shared expert"),
            example == "deepseek_v3",
            "{stderr}"
        );
    }
    // A bench file of another layer is a usage error naming both.
    let output = moeforge(&[
        "simulate",
        "dsl-examples/mixtral_8x7b.moe",
        "--measured",
        "benches/results/2026-12-01_ep2_at_e323b9f/2026-12-01_qwen3_30b_a3b_ep2_uniform_at_e323b9f.json",
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("measured layer `qwen3_30b_a3b`, not `mixtral_8x7b`"),
        "{stderr}"
    );
    // Fewer ranks than experts allow is a usage error, not a panic.
    let output = moeforge(&["simulate", "dsl-examples/tiny.moe", "--ranks", "3"]);
    assert_eq!(output.status.code(), Some(2));
}

/// A layer of one rank has nothing to simulate: a usage error that says how to give it ranks.
#[test]
fn simulate_of_one_rank_says_to_pass_ranks() {
    let spec = std::env::temp_dir().join(format!("moeforge-one-rank-{}.moe", std::process::id()));
    std::fs::write(
        &spec,
        "topology t {\n  gpus_per_node = 1\n  nvlink = 450 GB/s, 3 us\n  network = 50 GB/s, 10 us\n}\n\
         layer l {\n  hidden = 128\n  ffn = 256\n  experts = 8\n  top_k = 2\n  topology = t\n}\n",
    )
    .expect("write the spec");
    let output = moeforge(&["simulate", spec.to_str().expect("UTF-8"), "--tokens", "16"]);
    let _ = std::fs::remove_file(&spec);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("has one expert-parallel rank") && stderr.contains("pass --ranks R"),
        "{stderr}"
    );
}

/// A spec of emulated nodes is simulated as it runs, on one GPU, and says so and how to
/// simulate the nodes it stands for; `--ranks` puts the ranks on GPUs of their own.
#[test]
fn simulate_says_where_emulated_nodes_run() {
    let file = "dsl-examples/tiny_emulated_nodes.moe";
    let as_written = moeforge(&["simulate", file, "--tokens", "16"]);
    let stdout = String::from_utf8_lossy(&as_written.stdout);
    assert!(as_written.status.success(), "{as_written:?}");
    assert!(
        stdout.contains("4 virtual ranks on one GPU (emulating 2 nodes")
            && stdout.contains("`--ranks 4` puts them on GPUs of their own"),
        "{stdout}"
    );
    let on_gpus = moeforge(&["simulate", file, "--tokens", "16", "--ranks", "4"]);
    let stdout = String::from_utf8_lossy(&on_gpus.stdout);
    assert!(stdout.contains("4 ranks on 2 nodes"), "{stdout}");
}

/// A long simulation (1024 ranks at 256 tokens per rank, top_k 8: 2.1 million routed pairs,
/// seconds a schedule) says on stderr what it simulates and each schedule as it ends; a
/// short one (16 tokens per rank) prints nothing there.
#[test]
fn a_long_simulation_shows_its_progress() {
    let output = moeforge(&[
        "simulate",
        "tests/fixtures/ep1024.moe",
        "--tokens",
        "16,256",
    ]);
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 5, "{stderr}");
    assert!(
        lines[0].starts_with(
            "simulating ep1024 at 256 tokens per rank on 1024 ranks (2097152 routed pairs"
        ),
        "{stderr}"
    );
    for (i, line) in lines[1..].iter().enumerate() {
        assert!(
            line.starts_with(&format!("  {} of 4 schedules simulated (", i + 1)),
            "{stderr}"
        );
    }
}

/// The default token counts stop at a small layer's max_tokens (tiny's 512), saying so; a
/// count above it, or of no tokens, is a usage error before anything is simulated.
#[test]
fn simulate_checks_every_token_count_first() {
    let output = moeforge(&["simulate", "dsl-examples/tiny.moe"]);
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the default token counts are 1,16,128,512"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(", 512 tokens per rank,"), "{stdout}");
    for (tokens, said) in [
        (
            "1,9999",
            "--tokens 9999 exceeds the layer's max_tokens of 512",
        ),
        ("0", "--tokens 0: this command needs at least 1"),
    ] {
        let output = moeforge(&["simulate", "dsl-examples/tiny.moe", "--tokens", tokens]);
        assert_eq!(output.status.code(), Some(2), "--tokens {tokens}");
        assert!(String::from_utf8_lossy(&output.stderr).contains(said));
        assert!(
            output.stdout.is_empty(),
            "nothing simulated at --tokens {tokens}"
        );
    }
}

/// Grouped routing takes the router's group limit (DeepSeek-V3's 4 of 8), or the flags; a
/// layer without one, or the flags without grouped routing, is a usage error saying why.
#[test]
fn simulate_routes_within_the_routers_group_limit() {
    let output = moeforge(&[
        "simulate",
        "dsl-examples/deepseek_v3_ep64.moe",
        "--tokens",
        "128",
        "--routing",
        "grouped",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("group-limited (4 of 8 groups) routing"),
        "{stdout}"
    );
    // Across nodes the report adds the kernels as built, and how far they are from the
    // design.
    let as_built = stdout
        .split("as built, the layer takes ")
        .nth(1)
        .and_then(|rest| rest.split('x').next())
        .and_then(|ratio| ratio.parse::<f64>().ok());
    assert!(
        as_built.is_some_and(|ratio| (1.0..2.0).contains(&ratio)),
        "{stdout}"
    );
    let without = moeforge(&["simulate", "dsl-examples/tiny.moe", "--routing", "grouped"]);
    assert_eq!(without.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&without.stderr).contains("--groups and --groups-kept"));
    let flags = moeforge(&["simulate", "dsl-examples/tiny.moe", "--groups", "2"]);
    assert_eq!(flags.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&flags.stderr).contains("go with --routing grouped"));
    let given = moeforge(&[
        "simulate",
        "dsl-examples/tiny.moe",
        "--tokens",
        "16",
        "--routing",
        "grouped",
        "--groups",
        "4",
        "--groups-kept",
        "2",
    ]);
    assert!(
        given.status.success(),
        "{}",
        String::from_utf8_lossy(&given.stderr)
    );
}

/// A process launched as a rank of a group with a launch variable missing, a world size
/// the layer does not have, virtual ranks or the single-GPU peers, is a usage error that
/// says what to set (before any GPU or network work, so these run anywhere).
#[test]
fn rank_processes_launched_wrong_say_what_to_set() {
    let run = ["run", "dsl-examples/tiny.moe", "--tokens", "4"];
    let full = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29555"),
    ];
    for missing in ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        let vars: Vec<(&str, &str)> = full
            .iter()
            .copied()
            .filter(|(k, _)| *k != missing)
            .collect();
        let output = moeforge_with_env(&run, &vars);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{missing}: {stderr}");
        assert!(
            stderr.contains(&format!("{missing} is not set"))
                && stderr.contains(&format!("set {missing}")),
            "{missing}: {stderr}"
        );
    }
    // tiny.moe has 4 expert-parallel ranks; two processes are not its group.
    let output = moeforge_with_env(&run, &full);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("WORLD_SIZE=2 but the layer has 4 expert-parallel ranks")
            && stderr.contains("--gpus 2"),
        "{stderr}"
    );
    // Three processes cannot hold its 8 experts: --gpus 3 is not offered.
    let three: Vec<(&str, &str)> = full
        .iter()
        .map(|&(k, v)| if k == "WORLD_SIZE" { (k, "3") } else { (k, v) })
        .collect();
    let output = moeforge_with_env(&run, &three);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("3 ranks cannot split its 8 experts evenly")
            && !stderr.contains("--gpus 3"),
        "{stderr}"
    );
    for command in ["run", "bench"] {
        let output = moeforge_with_env(
            &[
                command,
                "dsl-examples/tiny.moe",
                "--tokens",
                "4",
                "--ranks",
                "2",
            ],
            &full,
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{command}: {stderr}");
        assert!(stderr.contains("drop --ranks"), "{command}: {stderr}");
    }
    // A rank without a GPU fails, and first meets the group to leave it, so that its peers
    // learn at once rather than wait out their bound: two such ranks both end within
    // seconds of a 60 s bound. (Where a GPU is present the ranks would run: not here.)
    let rendezvous = tempfile::tempdir().expect("a temp dir");
    let file = format!("file:{}", rendezvous.path().join("group").display());
    let rank = |r: &'static str| {
        let file = file.clone();
        move || {
            let vars = [
                ("RANK", r),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", r),
                ("MOEFORGE_RENDEZVOUS", file.as_str()),
                ("MOEFORGE_RENDEZVOUS_TIMEOUT", "60"),
            ];
            moeforge_with_env(
                &[
                    "run",
                    "dsl-examples/tiny.moe",
                    "--tokens",
                    "4",
                    "--gpus",
                    "2",
                ],
                &vars,
            )
        }
    };
    let started = std::time::Instant::now();
    let (rank_0, rank_1) = std::thread::scope(|scope| {
        let rank_0 = scope.spawn(rank("0"));
        let rank_1 = scope.spawn(rank("1"));
        (
            rank_0.join().expect("rank 0"),
            rank_1.join().expect("rank 1"),
        )
    });
    let said_0 = String::from_utf8_lossy(&rank_0.stderr);
    if said_0.contains("needs a GPU") {
        let said_1 = String::from_utf8_lossy(&rank_1.stderr);
        assert_eq!(rank_0.status.code(), Some(2), "{said_0}");
        assert_eq!(rank_1.status.code(), Some(2), "{said_1}");
        assert!(said_1.contains("rank 1: needs a GPU"), "{said_1}");
        // Each met the group and left it, and nothing else went wrong.
        for (rank, said) in [(0, &said_0), (1, &said_1)] {
            assert!(
                said.contains(&format!("rank {rank}: left the group")),
                "{said}"
            );
            assert_eq!(said.matches("error:").count(), 1, "{said}");
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the ranks left at once: {:?}\n{said_0}\n{said_1}",
            started.elapsed()
        );
    }
    // The single-GPU peers are not something a rank of a group runs.
    let output = moeforge_with_env(
        &["bench", "dsl-examples/tiny.moe", "--tokens", "4", "--peers"],
        &full,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--peers times single-GPU peers"),
        "{stderr}"
    );
}
