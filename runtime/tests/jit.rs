//! NVRTC JIT tests: PTX/CUBIN output, compile errors, the disk cache and `ptxas` reports.
//!
//! They skip (with a note) when NVRTC is absent, unless `MOEFORGE_REQUIRE_NVRTC=1`.

use std::path::PathBuf;

use moeforge_compiler::codegen;
use moeforge_compiler::ir::Activation;
use moeforge_compiler::plan::{self, Target};
use moeforge_runtime::aot;
use moeforge_runtime::jit::{CacheOutcome, CompileOptions, DumpKinds, Jit, JitError, JitSettings};
use moeforge_runtime::toolkit::nvrtc_for_tests;

mod layers;

/// A self-contained bf16 kernel: no includes, bf16 <-> float by bit operations.
const AXPY_BF16: &str = r#"
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_to_float(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u); // quiet NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest even
    return (bf16_t)(u >> 16);
}

extern "C" __global__ void axpy_bf16(const bf16_t* x, bf16_t* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = float_to_bf16(a * bf16_to_float(x[i]) + bf16_to_float(y[i]));
    }
}
"#;

/// A JIT with its own cache folder (emptied first), or `None` to skip.
fn jit(test: &str) -> Option<(Jit, PathBuf)> {
    let toolkit = nvrtc_for_tests()?;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("jit-{test}"));
    // The folder may not exist yet.
    let _ = std::fs::remove_dir_all(&dir);
    let settings = JitSettings {
        cache_dir: Some(dir.join("cache")),
        ..JitSettings::default()
    };
    let jit = Jit::new(toolkit, settings).expect("NVRTC loads");
    Some((jit, dir))
}

#[test]
fn bf16_kernel_compiles_to_ptx_and_cubin() {
    let Some((jit, _)) = jit("bf16") else { return };
    let m = jit
        .compile(AXPY_BF16, &CompileOptions::new("axpy_bf16", "sm_90a"))
        .expect("compiles");
    assert!(m.ptx.contains(".entry axpy_bf16"), "{}", m.ptx);
    assert!(m.ptx.contains(".target sm_90a"), "{}", m.ptx);
    assert!(
        m.ptx.contains(".version 9.0"),
        "PTX ISA of CUDA 13.0 expected: {}",
        m.ptx
    );
    let cubin = m.cubin.expect("a CUBIN for a real architecture");
    assert_eq!(&cubin[..4], b"\x7fELF");
    assert_eq!(m.cache, CacheOutcome::Miss);

    let virt = jit
        .compile(AXPY_BF16, &CompileOptions::new("axpy_bf16", "compute_90a"))
        .expect("compiles");
    assert!(virt.cubin.is_none());
    assert_ne!(virt.key, m.key);
}

#[test]
fn syntax_error_quotes_the_offending_line() {
    let Some((jit, _)) = jit("syntax") else {
        return;
    };
    let source = "extern \"C\" __global__ void broken(float* out) {\n    float x = 1.0f\n    out[0] = x;\n}\n";
    let err = jit
        .compile(source, &CompileOptions::new("broken", "sm_90a"))
        .expect_err("does not compile");
    let JitError::Compile { diagnostics, .. } = &err else {
        panic!("unexpected error: {err}")
    };
    assert!(!diagnostics.is_empty());
    let message = err.to_string();
    assert!(message.contains("broken.cu:3"), "{message}");
    assert!(message.contains("3 |     out[0] = x;"), "{message}");
    assert!(
        message.contains("NVRTC could not compile kernel unit `broken` for sm_90a"),
        "{message}"
    );
}

#[test]
fn bad_arch_is_a_typed_error() {
    let Some((jit, _)) = jit("arch") else { return };
    let err = jit
        .compile(AXPY_BF16, &CompileOptions::new("a", "sm90"))
        .expect_err("invalid");
    assert!(matches!(err, JitError::InvalidArch(_)), "{err}");
}

#[test]
fn cache_hits_and_survives_a_corrupt_entry() {
    let Some((jit, dir)) = jit("cache") else {
        return;
    };
    let options = CompileOptions::new("axpy_bf16", "sm_90a").flag("-std=c++17");
    let first = jit.compile(AXPY_BF16, &options).expect("compiles");
    assert_eq!(first.cache, CacheOutcome::Miss);
    // No cache problem to report (a toolkit setting passed over is the machine's, not the
    // cache's).
    let cache_notes: Vec<&String> = first
        .notes
        .iter()
        .filter(|note| !note.contains("holds no libnvrtc"))
        .collect();
    assert!(cache_notes.is_empty(), "{cache_notes:?}");
    let second = jit.compile(AXPY_BF16, &options).expect("compiles");
    assert!(second.cache_hit());
    assert_eq!(
        (&second.ptx, &second.cubin, &second.key),
        (&first.ptx, &first.cubin, &first.key)
    );

    let other = jit
        .compile(AXPY_BF16, &options.clone().flag("--use_fast_math"))
        .expect("compiles");
    assert_eq!(
        other.cache,
        CacheOutcome::Miss,
        "different flags, different key"
    );

    let entries: Vec<PathBuf> = std::fs::read_dir(dir.join("cache/jit"))
        .expect("cache folder")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(
        entries
            .iter()
            .all(|p| p.extension().is_some_and(|e| e == "mfjit")),
        "no temp files left"
    );
    for entry in &entries {
        let mut bytes = std::fs::read(entry).expect("read entry");
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(entry, &bytes).expect("corrupt entry");
    }
    let third = jit.compile(AXPY_BF16, &options).expect("recompiles");
    assert!(
        matches!(third.cache, CacheOutcome::Recompiled { .. }),
        "{:?}",
        third.cache
    );
    assert_eq!(third.ptx, first.ptx);
    assert!(
        jit.compile(AXPY_BF16, &options)
            .expect("compiles")
            .cache_hit(),
        "entry replaced"
    );

    for entry in &entries {
        std::fs::write(entry, b"").expect("truncate entry");
    }
    let fourth = jit.compile(AXPY_BF16, &options).expect("recompiles");
    assert!(!fourth.cache_hit());
}

#[test]
fn no_cache_and_dumps() {
    let Some((jit, dir)) = jit("dump") else {
        return;
    };
    let settings = JitSettings {
        cache_dir: None,
        cache_max_bytes: None,
        dump: DumpKinds {
            ptx: true,
            cubin: true,
            source: true,
        },
        dump_dir: Some(dir.join("dump")),
        no_cache_folder: false,
    };
    let jit = Jit::new(jit.toolkit().clone(), settings).expect("NVRTC loads");
    let m = jit
        .compile(AXPY_BF16, &CompileOptions::new("axpy_bf16", "sm_90a"))
        .expect("compiles");
    assert_eq!(m.cache, CacheOutcome::Disabled);
    let stem = format!("axpy_bf16-{}", &m.key[..32]);
    let ptx =
        std::fs::read_to_string(dir.join("dump").join(format!("{stem}.ptx"))).expect("PTX dumped");
    assert_eq!(ptx, m.ptx);
    assert!(dir.join("dump").join(format!("{stem}.cubin")).is_file());
    assert!(dir.join("dump").join(format!("{stem}.cu")).is_file());
}

#[test]
fn ptxas_reports_registers_and_no_spills() {
    let Some((jit, _)) = jit("ptxas") else { return };
    if jit.toolkit().ptxas.is_none() && std::env::var("MOEFORGE_REQUIRE_NVRTC").is_err() {
        eprintln!("note: skipping, the toolkit has no ptxas");
        return;
    }
    let m = jit
        .compile(AXPY_BF16, &CompileOptions::new("axpy_bf16", "sm_90a"))
        .expect("compiles");
    let report = jit.ptxas_report(&m.ptx, "sm_90a").expect("ptxas runs");
    let k = report
        .function("axpy_bf16")
        .unwrap_or_else(|| panic!("no axpy_bf16 in {}", report.raw));
    assert!(k.entry);
    assert!(k.registers > 0 && k.registers < 64, "{k}");
    assert_eq!(
        (k.spill_stores, k.spill_loads, k.stack_frame),
        (0, 0, 0),
        "{k}"
    );
    assert_eq!(report.spilling().count(), 0);
}

#[test]
fn ptxas_sees_stack_and_spills() {
    let Some((jit, _)) = jit("spill") else { return };
    if jit.toolkit().ptxas.is_none() && std::env::var("MOEFORGE_REQUIRE_NVRTC").is_err() {
        eprintln!("note: skipping, the toolkit has no ptxas");
        return;
    }
    // A big local array indexed by data lives on the stack.
    let local = r#"
extern "C" __global__ void local_array(float* out, const int* idx) {
    float scratch[1024];
    for (int i = 0; i < 1024; ++i) scratch[i] = out[i] * (float)i;
    out[threadIdx.x] = scratch[idx[threadIdx.x] & 1023];
}
"#;
    let m = jit
        .compile(local, &CompileOptions::new("local_array", "sm_90a"))
        .expect("compiles");
    let report = jit.ptxas_report(&m.ptx, "sm_90a").expect("ptxas runs");
    let k = report
        .function("local_array")
        .unwrap_or_else(|| panic!("{}", report.raw));
    assert!(k.stack_frame >= 4096, "{k}");

    // Many live values under a 32-register cap (1024 threads, 2 blocks per SM) must spill.
    let pressure = r#"
extern "C" __global__ void __launch_bounds__(1024, 2) pressure(float* out, const float* in) {
    float v[64];
    #pragma unroll
    for (int i = 0; i < 64; ++i) v[i] = in[threadIdx.x * 64 + i];
    float s = 0.0f;
    #pragma unroll
    for (int r = 0; r < 8; ++r) {
        #pragma unroll
        for (int i = 0; i < 64; ++i) { v[i] = v[i] * v[(i + r + 1) & 63] + 1.0f; s += v[i]; }
    }
    out[threadIdx.x] = s;
}
"#;
    let options = CompileOptions::new("pressure", "sm_90a");
    let m = jit.compile(pressure, &options).expect("compiles");
    let report = jit.ptxas_report(&m.ptx, "sm_90a").expect("ptxas runs");
    let k = report
        .function("pressure")
        .unwrap_or_else(|| panic!("{}", report.raw));
    assert!(
        k.spill_stores > 0 && k.spill_loads > 0,
        "{k}\n{}",
        report.raw
    );
    assert_eq!(report.spilling().count(), 1);
}

#[test]
fn discovered_toolkit_is_nvrtc_13() {
    let Some((jit, _)) = jit("toolkit") else {
        return;
    };
    let tk = jit.toolkit();
    eprintln!(
        "toolkit from {}: {} (ptxas: {:?}), NVRTC {}",
        tk.source,
        tk.nvrtc_lib.display(),
        tk.ptxas,
        jit.nvrtc_version()
    );
    assert!(tk.nvrtc_lib.is_file());
    assert_eq!(jit.nvrtc_version().major, 13);
    // The build beside the version: the library's file (links followed) and its size,
    // then the builtins library's, which a cache key of another patch release differs by.
    let fingerprint = tk.fingerprint();
    let parts: Vec<&str> = fingerprint.split(' ').collect();
    assert_eq!(parts.len(), 2, "{fingerprint}");
    for (part, library) in parts
        .iter()
        .zip(["libnvrtc.so.13", "libnvrtc-builtins.so.13"])
    {
        let (name, bytes) = part.split_once(':').expect("name:size");
        assert!(name.starts_with(library), "{fingerprint}");
        assert!(bytes.parse::<u64>().is_ok_and(|b| b > 0), "{fingerprint}");
    }
    assert_eq!(fingerprint, tk.fingerprint(), "the same each time");
}

/// A generated layer unit compiled kernel by kernel: one whole-program module per entry
/// point, in the order of the entry points, each holding its entry point and no other,
/// together every entry point with the parameters the plan passes, and each the same PTX as
/// the whole unit compiled for that kernel alone.
#[test]
fn a_layer_unit_compiles_kernel_by_kernel() {
    let Some((jit, _dir)) = jit("kernel-by-kernel") else {
        return;
    };
    let layer = layers::tiny_with_shared_expert(Activation::Swiglu);
    let plan = plan::plan(&layer, &Target::h200()).expect("the tiny layer plans");
    let source = codegen::generate(&plan).expect("codegen");
    let kernels = jit
        .compile_kernels(
            &source.source,
            &source.entry_points,
            &aot::compile_options(&plan),
        )
        .expect("every kernel compiles alone");
    let compiled: Vec<&String> = kernels.modules.iter().flat_map(|m| &m.kernels).collect();
    let expected: Vec<&String> = source.entry_points.iter().collect();
    assert_eq!(compiled, expected, "one module per entry point, in order");
    for module in &kernels.modules {
        let entries: Vec<&str> = module
            .module
            .ptx
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix(".visible .entry "))
            .map(|rest| rest.split('(').next().unwrap_or(rest))
            .collect();
        assert_eq!(
            entries, module.kernels,
            "the module of {:?}",
            module.kernels
        );
    }
    let every: String = kernels
        .modules
        .iter()
        .map(|m| m.module.ptx.as_str())
        .collect();
    aot::check_ptx_entries(&plan, &every).expect("every entry point the plan launches");
    // Each module compiled its kernel's share of the unit (`codegen::kernel_unit_source`):
    // the same PTX as the whole unit with the kernel's defines, which is what the share
    // leaves out.
    let options = aot::compile_options(&plan);
    for module in &kernels.modules {
        let whole = jit
            .compile(&source.source, &options.only_kernels(&module.kernels))
            .expect("the whole unit compiles for one kernel");
        assert!(
            whole.ptx == module.module.ptx,
            "the PTX of {:?} from its share of the unit differs from the whole unit's",
            module.kernels
        );
    }
}
