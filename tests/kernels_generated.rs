//! `kernels-generated/` is the AOT output (`moeforge compile`) of every example, checked in.
//! This test regenerates it and fails on any difference; `MOEFORGE_BLESS=1` rewrites it.
//! PTX is compared when NVRTC is present (always in CI, which sets MOEFORGE_REQUIRE_NVRTC=1).

use std::path::Path;

use moeforge::compiler::plan::{self, Target};
use moeforge::runtime::aot;
use moeforge::runtime::jit::{Jit, JitSettings};
use moeforge::runtime::toolkit::nvrtc_for_tests;

#[test]
fn kernels_generated_is_fresh() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bless = std::env::var("MOEFORGE_BLESS").is_ok_and(|v| v == "1");
    let jit = nvrtc_for_tests()
        .map(|tk| Jit::new(tk, JitSettings::from_env().expect("JIT settings")).expect("JIT"));
    let mut examples: Vec<_> = std::fs::read_dir(root.join("dsl-examples"))
        .expect("dsl-examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "moe"))
        .collect();
    examples.sort();
    // One thread per example: NVRTC compiles independent programs concurrently.
    let stale: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = examples
            .iter()
            .map(|example| scope.spawn(|| regenerate(root, example, jit.as_ref(), bless)))
            .collect();
        workers
            .into_iter()
            .flat_map(|worker| worker.join().expect("an example's regeneration panicked"))
            .collect()
    });
    assert!(
        stale.is_empty(),
        "kernels-generated/ is stale: {}\nregenerate with MOEFORGE_BLESS=1 cargo test --test kernels_generated",
        stale.join(", ")
    );
}

/// Regenerates one example's AOT output: writes it (`bless`) or returns the stale paths.
fn regenerate(root: &Path, example: &Path, jit: Option<&Jit>, bless: bool) -> Vec<String> {
    let text = std::fs::read_to_string(example).expect("readable example");
    let module = moeforge::compiler::compile_source(&example.display().to_string(), &text)
        .expect("example checks");
    // As `moeforge compile` plans on a machine with no tuning cache of its own.
    let shipped = moeforge::tuning::shipped().expect("the shipped tuning table");
    let plans: Vec<_> = module
        .layers
        .iter()
        .map(|l| plan::plan_tuned(l, &Target::h200(), &shipped).expect("example plans"))
        .collect();
    let files = aot::render(&plans, jit).expect("AOT output").files;
    let dir = root
        .join("kernels-generated")
        .join(example.file_stem().expect("file name"));
    let mut stale = Vec::new();
    for file in files {
        let path = dir.join(&file.name);
        if bless {
            std::fs::create_dir_all(&dir).expect("create kernels-generated/<example>");
            std::fs::write(&path, &file.contents).expect("write");
        } else if std::fs::read(&path).ok().as_deref() != Some(&file.contents[..]) {
            stale.push(path.display().to_string());
        }
    }
    stale
}

/// A deployment loads the AOT directory without the language: the plan read back from
/// `plan.json` is the one the compiler makes, and the PTX holds every entry point with the
/// plan's parameters.
#[test]
fn aot_directory_loads_without_the_language() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("dsl-examples/tiny.moe")).expect("tiny.moe");
    let module = moeforge::compiler::compile_source("tiny.moe", &text).expect("tiny checks");
    let planned = plan::plan(&module.layers[0], &Target::h200()).expect("tiny plans");
    let (loaded, compiled) =
        aot::load_layer(&root.join("kernels-generated/tiny"), None).expect("AOT directory loads");
    assert_eq!(
        loaded, planned,
        "plans round-trip exactly through plan.json"
    );
    assert_eq!(aot::check_ptx_entries(&loaded, &compiled.ptx), Ok(()));
    let missing = aot::load_layer(&root.join("kernels-generated/tiny"), Some("nope"));
    assert!(matches!(missing, Err(aot::AotError::NoSuchLayer { .. })));
}

/// A copy of `kernels-generated/tiny` in a fresh temporary folder, with `edit` applied to
/// the named file's text.
fn edited_copy(file: &str, edit: impl Fn(String) -> String) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels-generated/tiny");
    let dir = std::env::temp_dir().join(format!(
        "moeforge-aot-{}-{}",
        std::process::id(),
        file.replace('.', "-")
    ));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    for entry in std::fs::read_dir(&root).expect("kernels-generated/tiny") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .to_string();
        let text = std::fs::read_to_string(&path).expect("text file");
        let text = if name == file { edit(text) } else { text };
        std::fs::write(dir.join(&name), text).expect("write copy");
    }
    dir
}

#[test]
fn an_edited_stale_or_foreign_aot_directory_is_refused() {
    // A launch's grid edited by hand: the plan no longer matches its hash.
    let dir = edited_copy("plan.json", |t| {
        t.replacen("\"fixed\": 528", "\"fixed\": 529", 1)
    });
    let result = aot::load_layer(&dir, None);
    assert!(
        matches!(
            result,
            Err(aot::AotError::HashMismatch {
                what: "the plan",
                ..
            })
        ),
        "{result:?}"
    );
    // Shared memory edited beyond what the GEMM's layout adds up to: refused by validation
    // before any hash is looked at.
    let dir = edited_copy("plan.json", |t| {
        t.replacen("\"smem_bytes\": 41216", "\"smem_bytes\": 41217", 1)
    });
    let result = aot::load_layer(&dir, None);
    assert!(
        matches!(result, Err(aot::AotError::InvalidPlan(_))),
        "{result:?}"
    );
    // A plan file of the previous format (before the mma.sync GEMMs could route small
    // calls in their blocks, with their routing tables and arguments in the plan).
    let dir = edited_copy("plan.json", |t| {
        t.replacen("\"format_version\": 12", "\"format_version\": 11", 1)
    });
    let result = aot::load_layer(&dir, None);
    assert!(
        matches!(result, Err(aot::AotError::FormatVersion { .. })),
        "{result:?}"
    );
    // PTX that is not the one the plan was written with.
    let dir = edited_copy("tiny.ptx", |t| t.replacen("tiny_route", "tiny_rout3", 2));
    let result = aot::load_layer(&dir, None);
    assert!(
        matches!(
            result,
            Err(aot::AotError::HashMismatch {
                what: "the PTX",
                ..
            })
        ),
        "{result:?}"
    );
}

/// NVRTC gives every variable at file or class scope device storage and a relocation, used
/// or not, and the driver sets each one up on every module load: with the ~500 `constexpr`
/// constants the units once had, a layer's cached load took 8-15 ms instead of 1-2 (one
/// H200, 2026-12-01). The templates declare constants as enumerators; this keeps it so. The
/// only globals allowed are the unit's explicit `__device__` tables and NVRTC's own.
#[test]
fn generated_units_give_constants_no_device_storage() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels-generated");
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).expect("kernels-generated/") {
        let dir = entry.expect("entry").path();
        let name = dir.file_name().expect("name").to_string_lossy().to_string();
        let source = std::fs::read_to_string(dir.join(format!("{name}.cu"))).expect("the unit");
        let Ok(ptx) = std::fs::read_to_string(dir.join(format!("{name}.ptx"))) else {
            continue;
        };
        let tables: Vec<&str> = source
            .lines()
            .filter_map(|line| line.strip_prefix("__device__ const int "))
            .filter_map(|rest| rest.split('[').next())
            .collect();
        let globals: Vec<&str> = ptx
            .lines()
            .filter(|line| {
                [".global", ".visible .global", ".const", ".visible .const"]
                    .iter()
                    .any(|space| line.starts_with(space))
            })
            .filter_map(|line| {
                // `.global .align 4 .b8 NAME[256] = {...};`: the last word before `=` or `;`.
                let declaration = line.split(['=', ';']).next()?;
                let word = declaration.split_whitespace().last()?;
                word.split('[').next()
            })
            .collect();
        let stray: Vec<&&str> = globals
            .iter()
            .filter(|g| !tables.contains(g) && !g.contains("__nv_"))
            .collect();
        assert!(
            stray.is_empty(),
            "{name}: constants with device storage: {stray:?}; declare them as enumerators (see layer.cu's constants)"
        );
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} units with PTX were checked");
}
