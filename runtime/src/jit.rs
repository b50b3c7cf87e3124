//! NVRTC compilation of generated CUDA C++, with a disk cache and `ptxas` resource reports.
//!
//! [`Jit::compile`] turns one kernel unit (a self-contained `.cu` source) into PTX, and
//! into CUBIN as well when the target is a real architecture (`sm_90a`, not
//! `compute_90a`). Failures are [`JitError`]s; a compile error quotes the generated source
//! line of every `unit.cu(LINE): error` in the NVRTC log.
//!
//! [`Jit::compile_kernels`] compiles a generated layer unit once per entry point instead,
//! each a whole-program module of its own (the unit builds only the kernel its defines
//! name), on as many threads as the machine has: NVRTC is single-threaded per program.
//! Each module compiles (and is cached under) its entry point's share of the unit
//! ([`kernel_unit_source`]: the sections that entry point uses and those all share), so an
//! edit to one kernel's configuration, or a `moeforge tune` candidate, compiles only the
//! modules of the kernels it changed.
//! DeepSeek-V3's 22 kernels took 7.0 s as one program and 1.75 s kernel by kernel on the
//! H200 machine's 16 cores (2026-11-30). At most one NVRTC compile per core runs in the
//! process at a time, however many threads ask. A module's load once cost milliseconds,
//! because NVRTC gave each of the unit's ~500 file- and class-scope constants device storage
//! that the driver set up on every load; with the constants as enumerators, DeepSeek-V3's
//! 16 one-GPU modules load in about 1 ms in all (one H200, 2026-12-01, `benches/results/`
//! `2026-12-01_module_load_constants.md`), so kernels are no longer linked into one image
//! to save loads (relocatable code also cost the warp-specialised GEMMs their `setmaxnreg`).
//!
//! # Cache
//!
//! Compiled modules are cached on disk, one file per module, under `DIR/jit/`, where DIR is
//! `$MOEFORGE_CACHE_DIR`, else `$XDG_CACHE_HOME/moeforge`, else `$HOME/.cache/moeforge`.
//! The key is a SHA-256 of (cache format, unit name, arch, NVRTC's flags, NVRTC version and
//! build ([`Toolkit::fingerprint`]), source). `MOEFORGE_CACHE_DIR` and `MOEFORGE_DUMP_DIR`
//! must be absolute paths; a relative `XDG_CACHE_HOME` is ignored.
//! Entries are written to a temporary file in the same folder and renamed into place, so
//! concurrent processes share the cache safely; each entry carries a checksum, and an
//! entry that is unreadable or corrupt is recompiled and replaced, never fatal. Failing to
//! write the cache is not fatal either (see [`CompiledModule::notes`]).
//! `MOEFORGE_NO_CACHE=1` disables the cache.
//!
//! The cache is bounded: `MOEFORGE_CACHE_MAX_MB` (default [`DEFAULT_CACHE_MAX_MB`]; `0`: no
//! bound). Every changed kernel (its share of the unit) is a new key, so entries of older
//! builds and edited layers pile up (one DeepSeek-V3 layer is about 25 MB of entries). A hit refreshes its
//! entry's modification time; after a miss is stored, if the entries total more than the
//! bound, the least recently used go until they total at most 3/4 of it (the one just
//! written stays), and the module's notes say how many.
//!
//! # Dumps
//!
//! `MOEFORGE_DUMP` is a comma-separated list of `ptx`, `cubin`, `cu` (the source compiled:
//! for a layer's module, its kernel's share of the unit) or `all`:
//! every compiled (or cache-loaded) module then writes `NAME-KEY.{ptx,cubin,cu}` to
//! `$MOEFORGE_DUMP_DIR`, else `DIR/dump/` next to the cache, else
//! `$TMPDIR/moeforge-dump/` when the cache is disabled.
//!
//! # Resource reports
//!
//! [`ptxas_report`] runs `ptxas -arch=ARCH -v` on PTX and parses registers, spill bytes,
//! stack frame and shared memory per function; CI uses it to check that generated kernels
//! do not spill.

use std::ffi::CString;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use moeforge_compiler::codegen::kernel_unit_source;
use sha2::{Digest, Sha256};

use crate::toolkit::{NVRTC_LIB, NvrtcVersion, PIP_PACKAGES, Toolkit, ToolkitError};

/// What to compile a kernel unit for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    /// The kernel unit's name: the NVRTC program is `NAME.cu`; used in errors and file names.
    pub name: String,
    /// Target architecture: `sm_90a` (PTX and CUBIN) or `compute_90a` (PTX only).
    pub arch: String,
    /// Further NVRTC flags, e.g. `-std=c++17` or `--use_fast_math`.
    pub flags: Vec<String>,
}

impl CompileOptions {
    /// Options for unit `name` on `arch`, with no extra flags.
    pub fn new(name: impl Into<String>, arch: impl Into<String>) -> Self {
        CompileOptions {
            name: name.into(),
            arch: arch.into(),
            flags: Vec::new(),
        }
    }

    /// Adds one NVRTC flag.
    pub fn flag(mut self, flag: impl Into<String>) -> Self {
        self.flags.push(flag.into());
        self
    }

    /// These options for entry points `kernels` of a generated layer unit only: the unit
    /// builds only the kernels that `MOEFORGE_KERNEL_<kernel>` names.
    pub fn only_kernels(&self, kernels: &[String]) -> Self {
        let mut only = CompileOptions {
            name: format!("{}-{}", self.name, kernels.join("+")),
            ..self.clone()
        }
        .flag("-DMOEFORGE_ONE_KERNEL");
        for kernel in kernels {
            only = only.flag(format!("-DMOEFORGE_KERNEL_{kernel}"));
        }
        only
    }
}

/// What the disk cache did for one compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// No cache directory (or `MOEFORGE_NO_CACHE=1`).
    Disabled,
    /// Loaded from the cache; NVRTC was not run.
    Hit,
    /// Not in the cache: compiled and stored.
    Miss,
    /// The entry was unreadable or corrupt: compiled again and replaced.
    Recompiled {
        /// What was wrong with the entry.
        reason: String,
    },
}

/// The result of compiling one kernel unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledModule {
    /// The kernel unit's name.
    pub name: String,
    /// The architecture it was compiled for.
    pub arch: String,
    /// PTX text.
    pub ptx: String,
    /// CUBIN, when `arch` is a real architecture (`sm_*`).
    pub cubin: Option<Vec<u8>>,
    /// NVRTC's log (warnings); empty when there were none.
    pub log: String,
    /// Hex SHA-256 cache key.
    pub key: String,
    /// What the cache did.
    pub cache: CacheOutcome,
    /// Non-fatal problems (cache or dump files that could not be written).
    pub notes: Vec<String>,
}

impl CompiledModule {
    /// Whether the module came from the disk cache.
    pub fn cache_hit(&self) -> bool {
        self.cache == CacheOutcome::Hit
    }
}

/// A layer's kernels as compiled modules: its unit compiled whole (an AOT directory,
/// embedded PTX), or one module per entry point ([`Jit::compile_kernels`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledKernels {
    /// The unit's name.
    pub name: String,
    pub modules: Vec<KernelModule>,
}

/// One module of [`CompiledKernels`] and the entry points it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelModule {
    /// The entry points it was compiled for; empty: every entry point of the unit.
    pub kernels: Vec<String>,
    pub module: CompiledModule,
}

impl CompiledKernels {
    /// A unit compiled whole.
    pub fn whole(module: CompiledModule) -> Self {
        CompiledKernels {
            name: module.name.clone(),
            modules: vec![KernelModule {
                kernels: Vec::new(),
                module,
            }],
        }
    }

    /// The modules that hold `entry_points` (and any of the whole unit), in order.
    pub fn modules_for<'a>(
        &'a self,
        entry_points: &'a [String],
    ) -> impl Iterator<Item = &'a KernelModule> {
        self.modules
            .iter()
            .filter(|m| m.kernels.is_empty() || m.kernels.iter().any(|k| entry_points.contains(k)))
    }

    /// What the cache did: a hit when every module came from it, else the first other
    /// outcome.
    pub fn cache(&self) -> CacheOutcome {
        self.modules
            .iter()
            .map(|m| &m.module.cache)
            .find(|&cache| *cache != CacheOutcome::Hit)
            .cloned()
            .unwrap_or(CacheOutcome::Hit)
    }

    /// Whether every module came from the disk cache.
    pub fn cache_hit(&self) -> bool {
        self.cache() == CacheOutcome::Hit
    }

    /// Non-fatal problems of every module (cache entries or dumps that could not be
    /// written), each once.
    pub fn notes(&self) -> Vec<&str> {
        let mut notes: Vec<&str> = Vec::new();
        for note in self.modules.iter().flat_map(|m| &m.module.notes) {
            if !notes.contains(&note.as_str()) {
                notes.push(note);
            }
        }
        notes
    }

    /// Bytes of PTX over all modules.
    pub fn ptx_bytes(&self) -> usize {
        self.modules.iter().map(|m| m.module.ptx.len()).sum()
    }
}

/// A turn at NVRTC: at most one compile per core runs in this process at a time, so that
/// layers compiled side by side, each kernel by kernel, do not run hundreds of compiles
/// (each holding its own memory) at once.
struct NvrtcSlot;

static NVRTC_SLOTS_IN_USE: Mutex<usize> = Mutex::new(0);
static NVRTC_SLOT_FREED: Condvar = Condvar::new();

impl NvrtcSlot {
    fn take() -> NvrtcSlot {
        let limit = std::thread::available_parallelism().map_or(1, usize::from);
        let mut in_use = NVRTC_SLOTS_IN_USE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while *in_use >= limit {
            in_use = NVRTC_SLOT_FREED
                .wait(in_use)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *in_use += 1;
        NvrtcSlot
    }
}

impl Drop for NvrtcSlot {
    fn drop(&mut self) {
        let mut in_use = NVRTC_SLOTS_IN_USE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *in_use -= 1;
        NVRTC_SLOT_FREED.notify_one();
    }
}

/// One `unit.cu(LINE): error: ...` line of an NVRTC log, with the source line it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceDiagnostic {
    /// 1-based line in the generated source.
    pub line: usize,
    /// The message after `error: `.
    pub message: String,
    /// The offending source line, when the line number is inside the source.
    pub source_line: Option<String>,
}

/// Why compiling or inspecting a kernel failed.
#[derive(Debug, thiserror::Error)]
pub enum JitError {
    /// No usable toolkit.
    #[error(transparent)]
    Toolkit(#[from] ToolkitError),
    /// The architecture string is not `sm_NN[a|f]` or `compute_NN[a|f]`.
    #[error(
        "invalid GPU architecture `{0}`: expected e.g. `sm_90a` (PTX + CUBIN) or `compute_90a` (PTX only)"
    )]
    InvalidArch(String),
    /// The source or a flag contains a NUL byte, which NVRTC cannot take.
    #[error("kernel unit `{name}`: the {what} contains a NUL byte; this is a code generator bug")]
    NulByte {
        /// The kernel unit.
        name: String,
        /// "source" or "flag `...`".
        what: String,
    },
    /// NVRTC rejected the source or the options.
    #[error("{}", render_compile_error(.name, .arch, .status, .log, .diagnostics))]
    Compile {
        /// The kernel unit.
        name: String,
        /// The target architecture.
        arch: String,
        /// NVRTC's status, e.g. `NVRTC_ERROR_COMPILATION`.
        status: String,
        /// The full NVRTC log.
        log: String,
        /// Each error in the log with its source line.
        diagnostics: Vec<SourceDiagnostic>,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error(
        "kernel unit `{name}`: {call} failed ({status:?}); the NVRTC installation may be broken"
    )]
    Nvrtc {
        /// The kernel unit.
        name: String,
        /// The NVRTC function.
        call: &'static str,
        /// Its status.
        status: nvrtc_sys::nvrtcResult,
    },
    /// A `MOEFORGE_*` variable has a value this module does not understand.
    #[error("{var}={value:?} is not understood: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it may be.
        expected: &'static str,
    },
    /// The toolkit has no `ptxas`.
    #[error("no ptxas in the CUDA toolkit at {}; install it with `pip install {PIP_PACKAGES}` or use a full CUDA toolkit", root.display())]
    NoPtxas {
        /// The toolkit's root.
        root: PathBuf,
    },
    /// Running `ptxas` failed or it rejected the PTX.
    #[error("ptxas ({}) failed for {arch}: {detail}", ptxas.display())]
    Ptxas {
        /// The `ptxas` binary.
        ptxas: PathBuf,
        /// The target architecture.
        arch: String,
        /// Its output or the I/O error.
        detail: String,
    },
    /// A temporary file for `ptxas` could not be written.
    #[error("could not write temporary file {}: {source}; check TMPDIR", path.display())]
    TempFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

fn render_compile_error(
    name: &str,
    arch: &str,
    status: &str,
    log: &str,
    diagnostics: &[SourceDiagnostic],
) -> String {
    let mut out = format!(
        "NVRTC could not compile kernel unit `{name}` for {arch} ({status}):\n{}",
        log.trim_end()
    );
    for d in diagnostics {
        out.push_str(&format!(
            "\n\nerror: {}\n  --> {name}.cu:{}",
            d.message, d.line
        ));
        if let Some(src) = &d.source_line {
            let width = d.line.to_string().len();
            out.push_str(&format!(
                "\n{:width$} |\n{} | {src}\n{:width$} |",
                "", d.line, ""
            ));
        }
    }
    out
}

/// Which artefacts `MOEFORGE_DUMP` asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DumpKinds {
    /// Write the PTX.
    pub ptx: bool,
    /// Write the CUBIN (when there is one).
    pub cubin: bool,
    /// Write the CUDA source.
    pub source: bool,
}

impl DumpKinds {
    /// Parses `ptx,cubin,cu` / `all`; the empty string dumps nothing.
    pub fn parse(value: &str) -> Result<Self, JitError> {
        let mut kinds = DumpKinds::default();
        for word in value.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match word {
                "ptx" => kinds.ptx = true,
                "cubin" => kinds.cubin = true,
                "cu" | "source" => kinds.source = true,
                "all" => {
                    kinds = DumpKinds {
                        ptx: true,
                        cubin: true,
                        source: true,
                    }
                }
                _ => {
                    return Err(JitError::InvalidEnv {
                        var: "MOEFORGE_DUMP",
                        value: value.to_string(),
                        expected: "a comma-separated list of ptx, cubin, cu, all",
                    });
                }
            }
        }
        Ok(kinds)
    }

    fn any(self) -> bool {
        self.ptx || self.cubin || self.source
    }
}

/// The cache's bound when `MOEFORGE_CACHE_MAX_MB` is unset, in MB (10^6 bytes).
pub const DEFAULT_CACHE_MAX_MB: u64 = 2000;

/// Where the cache and dumps go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JitSettings {
    /// Cache root (entries go to `cache_dir/jit/`); `None` disables the cache.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes the cache's entries may take before the least recently used go;
    /// `None`: no bound.
    pub cache_max_bytes: Option<u64>,
    /// Artefacts to dump.
    pub dump: DumpKinds,
    /// Dump folder; `None` means `cache_dir/dump`, or `$TMPDIR/moeforge-dump` without a cache.
    pub dump_dir: Option<PathBuf>,
    /// The cache is off for want of a folder (no `MOEFORGE_CACHE_DIR`, absolute
    /// `XDG_CACHE_HOME` or `HOME`), not by `MOEFORGE_NO_CACHE`: each module says so in its
    /// notes, as every run then compiles its kernels again.
    pub no_cache_folder: bool,
}

impl JitSettings {
    /// Reads `MOEFORGE_CACHE_DIR`, `XDG_CACHE_HOME`, `HOME`, `MOEFORGE_NO_CACHE`,
    /// `MOEFORGE_CACHE_MAX_MB`, `MOEFORGE_DUMP` and `MOEFORGE_DUMP_DIR`.
    pub fn from_env() -> Result<Self, JitError> {
        Self::from_vars(crate::env_value)
    }

    /// Like [`JitSettings::from_env`], reading variables through `lookup`.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, JitError> {
        let var = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let no_cache = match var("MOEFORGE_NO_CACHE").as_deref() {
            Some("1") | Some("true") => true,
            Some("0") | Some("false") | None => false,
            Some(other) => {
                return Err(JitError::InvalidEnv {
                    var: "MOEFORGE_NO_CACHE",
                    value: other.to_string(),
                    expected: "1 (disable the cache) or 0",
                });
            }
        };
        // A relative folder would move with the working directory (and `~` is the shell's,
        // not expanded here): moeforge's own variables must be absolute, and a relative
        // XDG_CACHE_HOME is ignored, as the XDG Base Directory rules say.
        let absolute = |name: &'static str| match var(name) {
            Some(value) if !Path::new(&value).is_absolute() => Err(JitError::InvalidEnv {
                var: name,
                value,
                expected: "an absolute path (`~` is not expanded)",
            }),
            value => Ok(value.map(PathBuf::from)),
        };
        let chosen_cache_dir = absolute("MOEFORGE_CACHE_DIR")?;
        let cache_dir = if no_cache {
            None
        } else {
            chosen_cache_dir
                .or_else(|| {
                    var("XDG_CACHE_HOME")
                        .map(PathBuf::from)
                        .filter(|d| d.is_absolute())
                        .map(|d| d.join("moeforge"))
                })
                .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache/moeforge")))
        };
        let cache_max_bytes = match var("MOEFORGE_CACHE_MAX_MB") {
            None => Some(DEFAULT_CACHE_MAX_MB * 1_000_000),
            Some(value) => match value.parse::<u64>() {
                Ok(0) => None,
                Ok(mb) => Some(mb.saturating_mul(1_000_000)),
                Err(_) => {
                    return Err(JitError::InvalidEnv {
                        var: "MOEFORGE_CACHE_MAX_MB",
                        value,
                        expected: "a whole number of megabytes (0: no bound)",
                    });
                }
            },
        };
        let dump = DumpKinds::parse(&var("MOEFORGE_DUMP").unwrap_or_default())?;
        Ok(JitSettings {
            no_cache_folder: !no_cache && cache_dir.is_none(),
            cache_dir,
            cache_max_bytes,
            dump,
            dump_dir: absolute("MOEFORGE_DUMP_DIR")?,
        })
    }
}

/// An NVRTC compiler bound to one toolkit and one set of [`JitSettings`].
#[derive(Debug, Clone)]
pub struct Jit {
    toolkit: Toolkit,
    version: NvrtcVersion,
    /// Which NVRTC build compiles, for the cache key ([`Toolkit::fingerprint`]).
    fingerprint: String,
    settings: JitSettings,
}

impl Jit {
    /// Loads the toolkit's NVRTC and uses `settings`.
    pub fn new(toolkit: Toolkit, settings: JitSettings) -> Result<Self, JitError> {
        let version = toolkit.load_nvrtc()?;
        let fingerprint = toolkit.fingerprint();
        Ok(Jit {
            toolkit,
            version,
            fingerprint,
            settings,
        })
    }

    /// Discovers the toolkit and reads the settings from the environment.
    pub fn from_env() -> Result<Self, JitError> {
        // The settings first: a variable the user got wrong is reported with or without NVRTC.
        let settings = JitSettings::from_env()?;
        Jit::new(Toolkit::discover()?, settings)
    }

    /// The toolkit in use.
    pub fn toolkit(&self) -> &Toolkit {
        &self.toolkit
    }

    /// NVRTC's version.
    pub fn nvrtc_version(&self) -> NvrtcVersion {
        self.version
    }

    /// The settings in use.
    pub fn settings(&self) -> &JitSettings {
        &self.settings
    }

    /// Compiles one kernel unit, through the cache.
    pub fn compile(
        &self,
        source: &str,
        options: &CompileOptions,
    ) -> Result<CompiledModule, JitError> {
        let real_arch = parse_arch(&options.arch)?;
        let key = cache_key(source, options, self.version, &self.fingerprint);
        let stem = format!("{}-{}", file_stem(&options.name), &key[..32]);
        let mut notes = Vec::new();
        let entry = self
            .settings
            .cache_dir
            .as_ref()
            .map(|d| d.join("jit").join(format!("{stem}.mfjit")));

        if self.settings.no_cache_folder {
            notes.push(
                "no JIT cache: set MOEFORGE_CACHE_DIR (or HOME) to keep compiled kernels between runs"
                    .to_string(),
            );
        }
        if !self.toolkit.passed_over.is_empty() {
            notes.push(format!(
                "{} holds no {NVRTC_LIB}: using the NVRTC of {} ({})",
                self.toolkit.passed_over.join(", "),
                self.toolkit.source,
                self.toolkit.nvrtc_lib.display()
            ));
        }
        let (cached, cache) = read_entry(entry.as_deref(), &key);
        if let (CacheOutcome::Recompiled { reason }, Some(path)) = (&cache, &entry) {
            notes.push(format!(
                "replaced cache entry {} ({reason})",
                path.display()
            ));
        }
        let artefacts = match cached {
            Some(artefacts) => {
                if let Some(path) = &entry {
                    touch(path);
                }
                artefacts
            }
            None => {
                let artefacts = {
                    let _slot = NvrtcSlot::take();
                    nvrtc_compile(source, options, real_arch)?
                };
                store_entry(entry.as_deref(), &artefacts, &key, &mut notes);
                if let Some(path) = &entry {
                    prune_cache(path, self.settings.cache_max_bytes, &mut notes);
                }
                artefacts
            }
        };
        if self.settings.dump.any() {
            self.dump(&stem, source, &artefacts, &mut notes);
        }
        Ok(CompiledModule {
            name: options.name.clone(),
            arch: options.arch.clone(),
            ptx: artefacts.ptx,
            cubin: artefacts.cubin,
            log: artefacts.log,
            key,
            cache,
            notes,
        })
    }

    /// Compiles each entry point of `kernels` of a generated layer unit into a
    /// whole-program module of its own, side by side (see the module docs), each from its
    /// share of the unit ([`kernel_unit_source`]) through the cache, starting them in the
    /// order of `kernels` (longest first is quickest:
    /// [`Plan::entry_points_in_compile_order`](moeforge_compiler::plan::Plan::entry_points_in_compile_order)).
    /// The modules come in the order of `kernels` (each once); the first error in that
    /// order is the result.
    pub fn compile_kernels(
        &self,
        source: &str,
        kernels: &[String],
        options: &CompileOptions,
    ) -> Result<CompiledKernels, JitError> {
        let mut units: Vec<&String> = Vec::new();
        for kernel in kernels {
            if !units.contains(&kernel) {
                units.push(kernel);
            }
        }
        let next = AtomicUsize::new(0);
        let workers = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(units.len())
            .max(1);
        let mut results: Vec<(usize, Result<CompiledModule, JitError>)> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..workers)
                    .map(|_| {
                        scope.spawn(|| {
                            let mut done = Vec::new();
                            loop {
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(&kernel) = units.get(i) else {
                                    break done;
                                };
                                let only = std::slice::from_ref(kernel);
                                let unit = options.only_kernels(only);
                                let unit_source = kernel_unit_source(source, only);
                                done.push((i, self.compile(&unit_source, &unit)));
                            }
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|handle| match handle.join() {
                        Ok(done) => done,
                        Err(panic) => std::panic::resume_unwind(panic),
                    })
                    .collect()
            });
        results.sort_by_key(|(i, _)| *i);
        let modules = results
            .into_iter()
            .zip(units)
            .map(|((_, module), kernel)| {
                Ok(KernelModule {
                    kernels: vec![kernel.clone()],
                    module: module?,
                })
            })
            .collect::<Result<Vec<_>, JitError>>()?;
        Ok(CompiledKernels {
            name: options.name.clone(),
            modules,
        })
    }

    /// Runs this toolkit's `ptxas` on `ptx`; see [`ptxas_report`].
    pub fn ptxas_report(&self, ptx: &str, arch: &str) -> Result<PtxasReport, JitError> {
        run_ptxas(&self.toolkit, ptx, arch)
    }

    fn dump(&self, stem: &str, source: &str, artefacts: &Artefacts, notes: &mut Vec<String>) {
        let dir =
            self.settings
                .dump_dir
                .clone()
                .unwrap_or_else(|| match &self.settings.cache_dir {
                    Some(cache) => cache.join("dump"),
                    None => std::env::temp_dir().join("moeforge-dump"),
                });
        let kinds = self.settings.dump;
        let mut files: Vec<(&str, &[u8])> = Vec::new();
        if kinds.ptx {
            files.push(("ptx", artefacts.ptx.as_bytes()));
        }
        if kinds.source {
            files.push(("cu", source.as_bytes()));
        }
        if let (true, Some(cubin)) = (kinds.cubin, &artefacts.cubin) {
            files.push(("cubin", cubin));
        }
        for (ext, bytes) in files {
            let path = dir.join(format!("{stem}.{ext}"));
            if let Err(e) = write_atomic(&path, bytes) {
                notes.push(format!("could not dump {}: {e}", path.display()));
            }
        }
    }
}

/// Compiles with a toolkit discovered and settings read from the environment.
///
/// Each call rediscovers the toolkit; hold a [`Jit`] to compile many units.
pub fn compile(source: &str, options: &CompileOptions) -> Result<CompiledModule, JitError> {
    Jit::from_env()?.compile(source, options)
}

/// Resources `ptxas -v` reports for one function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FunctionResources {
    /// The (mangled) function name.
    pub name: String,
    /// Whether it is a kernel (`.entry`) rather than a non-inlined device function.
    pub entry: bool,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes per thread.
    pub stack_frame: u64,
    /// Bytes stored to local memory by register spills.
    pub spill_stores: u64,
    /// Bytes loaded from local memory by register spills.
    pub spill_loads: u64,
    /// Static shared memory bytes.
    pub shared_mem: u64,
    /// Whether `ptxas` serialised the function's `wgmma.mma_async` instructions (its
    /// performance warning C7518: each multiply then waits for the one before, typically
    /// because a branch around them could diverge within a warpgroup).
    pub wgmma_serialized: bool,
}

/// The parsed output of `ptxas -v`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PtxasReport {
    /// One entry per function, in the order `ptxas` reported them.
    pub functions: Vec<FunctionResources>,
    /// Whether `ptxas` dropped the module's `setmaxnreg` (its performance note C7504, which
    /// names no function; it gives it for relocatable code, which the JIT no longer
    /// compiles): warp-specialised kernels then run every warpgroup on the budget of the
    /// launch bounds.
    pub setmaxnreg_ignored: bool,
    /// The raw output.
    pub raw: String,
}

impl PtxasReport {
    /// The function called `name`.
    pub fn function(&self, name: &str) -> Option<&FunctionResources> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// Functions with spill stores or loads.
    pub fn spilling(&self) -> impl Iterator<Item = &FunctionResources> {
        self.functions
            .iter()
            .filter(|f| f.spill_stores > 0 || f.spill_loads > 0)
    }

    /// Parses `ptxas -v` output.
    pub fn parse(raw: &str) -> PtxasReport {
        let mut functions: Vec<FunctionResources> = Vec::new();
        let mut entries: Vec<String> = Vec::new();
        let mut current: Option<usize> = None;
        for line in raw.lines() {
            let line = line.trim();
            let info = line
                .strip_prefix("ptxas info")
                .map(|l| l.trim_start_matches([' ', ':']));
            let mut index_of = |name: &str| {
                functions
                    .iter()
                    .position(|f| f.name == name)
                    .unwrap_or_else(|| {
                        functions.push(FunctionResources {
                            name: name.to_string(),
                            ..Default::default()
                        });
                        functions.len() - 1
                    })
            };
            if let Some(name) = info.and_then(|l| l.strip_prefix("Compiling entry function ")) {
                entries.push(quoted(name).to_string());
            } else if let Some(name) = info.and_then(|l| l.strip_prefix("Function properties for "))
            {
                current = Some(index_of(name.trim()));
            } else if line.contains("wgmma.mma_async instructions are serialized")
                && let Some((_, name)) = line.rsplit_once("in the function ")
            {
                let index = index_of(quoted(name));
                functions[index].wgmma_serialized = true;
            } else if let Some(used) = info.and_then(|l| l.strip_prefix("Used ")) {
                // "Used N registers, ... N bytes smem, ..." belongs to the last entry compiled.
                let Some(index) = entries
                    .last()
                    .and_then(|e| functions.iter().position(|f| &f.name == e))
                else {
                    continue;
                };
                for (value, unit) in number_unit_pairs(used) {
                    match unit {
                        "registers" => functions[index].registers = value as u32,
                        "bytes smem" => functions[index].shared_mem = value,
                        _ => {}
                    }
                }
            } else if let Some(index) = current.filter(|_| line.contains("stack frame")) {
                for (value, unit) in number_unit_pairs(line) {
                    match unit {
                        "bytes stack frame" => functions[index].stack_frame = value,
                        "bytes spill stores" => functions[index].spill_stores = value,
                        "bytes spill loads" => functions[index].spill_loads = value,
                        _ => {}
                    }
                }
                current = None;
            }
        }
        for f in &mut functions {
            f.entry = entries.contains(&f.name);
        }
        PtxasReport {
            functions,
            setmaxnreg_ignored: raw.contains("'setmaxnreg' ignored"),
            raw: raw.to_string(),
        }
    }
}

/// Runs the discovered toolkit's `ptxas -arch=ARCH -v` on whole-program `ptx` and parses
/// the report.
pub fn ptxas_report(ptx: &str, arch: &str) -> Result<PtxasReport, JitError> {
    run_ptxas(&Toolkit::discover()?, ptx, arch)
}

fn run_ptxas(toolkit: &Toolkit, ptx: &str, arch: &str) -> Result<PtxasReport, JitError> {
    if !parse_arch(arch)? {
        return Err(JitError::InvalidArch(format!(
            "{arch} (ptxas needs a real sm_ architecture)"
        )));
    }
    let ptxas = toolkit.ptxas.clone().ok_or_else(|| JitError::NoPtxas {
        root: toolkit.root.clone(),
    })?;
    let input = TempFile::create("ptx", ptx.as_bytes())?;
    let output = TempFile {
        path: input.path.with_extension("cubin"),
    };
    let result = Command::new(&ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(&input.path)
        .arg("-o")
        .arg(&output.path)
        .output()
        .map_err(|e| JitError::Ptxas {
            ptxas: ptxas.clone(),
            arch: arch.to_string(),
            detail: e.to_string(),
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    if !result.status.success() {
        return Err(JitError::Ptxas {
            ptxas,
            arch: arch.to_string(),
            detail: format!("{}\n{text}", result.status),
        });
    }
    Ok(PtxasReport::parse(&text))
}

/// A temporary file removed on drop.
struct TempFile {
    path: PathBuf,
}

impl TempFile {
    fn create(ext: &str, bytes: &[u8]) -> Result<TempFile, JitError> {
        let path = std::env::temp_dir().join(format!("moeforge-{}.{ext}", unique_suffix()));
        let file = TempFile { path };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&file.path)
            .map_err(|source| JitError::TempFile {
                path: file.path.clone(),
                source,
            })?;
        f.write_all(bytes).map_err(|source| JitError::TempFile {
            path: file.path.clone(),
            source,
        })?;
        Ok(file)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        // Nothing to do if it is already gone (ptxas may not have written its output).
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A suffix no other temporary file of this or another process takes: process id, a
/// counter and the nanoseconds (the JIT cache's and the AOT output's temporary names).
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Text between the first pair of single quotes, or the trimmed input.
fn quoted(s: &str) -> &str {
    let s = s.trim();
    s.split('\'').nth(1).unwrap_or(s)
}

/// "8 registers, 1024 bytes smem" -> [(8, "registers"), (1024, "bytes smem")].
fn number_unit_pairs(s: &str) -> Vec<(u64, &str)> {
    s.split(',')
        .filter_map(|part| {
            let part = part.trim();
            let (num, unit) = part.split_once(' ')?;
            Some((num.parse().ok()?, unit.trim()))
        })
        .collect()
}

/// Validates `arch`; returns whether it is a real architecture (CUBIN possible).
fn parse_arch(arch: &str) -> Result<bool, JitError> {
    let (real, rest) = if let Some(rest) = arch.strip_prefix("sm_") {
        (true, rest)
    } else if let Some(rest) = arch.strip_prefix("compute_") {
        (false, rest)
    } else {
        return Err(JitError::InvalidArch(arch.to_string()));
    };
    let digits = rest.strip_suffix(['a', 'f']).unwrap_or(rest);
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(JitError::InvalidArch(arch.to_string()));
    }
    Ok(real)
}

/// `name` reduced to `[A-Za-z0-9_-]`, at most 64 characters.
fn file_stem(name: &str) -> String {
    let stem: String = name
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if stem.is_empty() {
        "unit".to_string()
    } else {
        stem
    }
}

const CACHE_FORMAT: &[u8] = b"moeforge-jit-cache-v1";
const ENTRY_MAGIC: &[u8] = b"MFJIT01\n";

/// NVRTC's options for `options`: the architecture, then the caller's flags (the cache key
/// hashes these, so that a flag added here cannot serve entries compiled without it).
fn nvrtc_flags(options: &CompileOptions) -> Vec<String> {
    let mut flags = vec![format!("--gpu-architecture={}", options.arch)];
    flags.extend(options.flags.iter().cloned());
    flags
}

/// The cache key of `source` compiled with `options` by NVRTC `version` of the library
/// `toolkit` identifies ([`Toolkit::fingerprint`]: `nvrtcVersion` says only major.minor).
fn cache_key(
    source: &str,
    options: &CompileOptions,
    version: NvrtcVersion,
    toolkit: &str,
) -> String {
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    };
    field(CACHE_FORMAT);
    field(options.name.as_bytes());
    let flags = nvrtc_flags(options);
    field(&(flags.len() as u64).to_le_bytes());
    for flag in &flags {
        field(flag.as_bytes());
    }
    field(version.to_string().as_bytes());
    field(toolkit.as_bytes());
    field(source.as_bytes());
    hex(&hasher.finalize())
}

/// Reads cache entry `path` for `key`: the artefacts and [`CacheOutcome::Hit`], or none
/// and why.
fn read_entry(path: Option<&Path>, key: &str) -> (Option<Artefacts>, CacheOutcome) {
    let Some(path) = path else {
        return (None, CacheOutcome::Disabled);
    };
    match std::fs::read(path) {
        Ok(bytes) => match decode_entry(&bytes, key) {
            Ok(artefacts) => (Some(artefacts), CacheOutcome::Hit),
            Err(reason) => (None, CacheOutcome::Recompiled { reason }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, CacheOutcome::Miss),
        Err(e) => (
            None,
            CacheOutcome::Recompiled {
                reason: format!("unreadable: {e}"),
            },
        ),
    }
}

/// Stores `artefacts` as cache entry `path`; a failure becomes a note, never an error.
fn store_entry(path: Option<&Path>, artefacts: &Artefacts, key: &str, notes: &mut Vec<String>) {
    if let Some(path) = path
        && let Err(e) = write_atomic(path, &encode_entry(artefacts, key))
    {
        notes.push(format!(
            "could not write cache entry {}: {e}",
            path.display()
        ));
    }
}

/// Marks cache entry `path` as just used (its modification time), so that pruning keeps it
/// longest. Best effort: another process may have pruned it meanwhile.
fn touch(path: &Path) {
    if let Ok(file) = std::fs::File::options().append(true).open(path) {
        let _ = file.set_modified(std::time::SystemTime::now());
    }
}

/// One cache entry as pruning sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheFile {
    path: PathBuf,
    bytes: u64,
    used: std::time::SystemTime,
}

/// The entries to delete so that `entries` total at most 3/4 of `max` once they are over
/// it: the least recently used first, never `keep`.
fn entries_to_prune(mut entries: Vec<CacheFile>, max: u64, keep: &Path) -> Vec<CacheFile> {
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    if total <= max {
        return Vec::new();
    }
    let target = max / 4 * 3;
    entries.sort_by(|a, b| a.used.cmp(&b.used).then_with(|| a.path.cmp(&b.path)));
    let mut pruned = Vec::new();
    for entry in entries {
        if total <= target {
            break;
        }
        if entry.path != keep {
            total -= entry.bytes;
            pruned.push(entry);
        }
    }
    pruned
}

/// Keeps the cache folder of `written` (just stored) within `max` bytes of entries, where
/// there is a bound (see the module docs), and clears it of stale temporary files; says in
/// `notes` what went. Failures are skipped: another process may prune the same folder at
/// the same time.
fn prune_cache(written: &Path, max: Option<u64>, notes: &mut Vec<String>) {
    let Some(dir) = written.parent() else {
        return;
    };
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    let listing: Vec<std::fs::DirEntry> = listing.filter_map(Result::ok).collect();
    remove_stale_temporaries(
        &listing,
        |target| target.ends_with(".mfjit"),
        "temporary cache file",
        notes,
    );
    let Some(max) = max else {
        return;
    };
    let entries: Vec<CacheFile> = listing
        .iter()
        .filter(|e| e.path().extension().is_some_and(|x| x == "mfjit"))
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some(CacheFile {
                path: e.path(),
                bytes: meta.len(),
                used: meta.modified().ok()?,
            })
        })
        .collect();
    let pruned: Vec<CacheFile> = entries_to_prune(entries, max, written)
        .into_iter()
        .filter(|e| std::fs::remove_file(&e.path).is_ok())
        .collect();
    if !pruned.is_empty() {
        let bytes: u64 = pruned.iter().map(|e| e.bytes).sum();
        notes.push(format!(
            "removed {} least recently used cache entries ({:.1} MB) to keep {} within {:.0} MB (MOEFORGE_CACHE_MAX_MB)",
            pruned.len(),
            bytes as f64 / 1e6,
            dir.display(),
            max as f64 / 1e6
        ));
    }
}

/// How old a temporary file must be before it is taken for the leftover of a process
/// killed while it wrote (a live write takes milliseconds).
pub(crate) const STALE_TEMPORARY: std::time::Duration = std::time::Duration::from_secs(3600);

/// The file a temporary name stands in for: `TARGET` of `.TARGET.PID-COUNT-NANOS.tmp`, the
/// names `write_atomic` and `aot::write_files` write to first ([`unique_suffix`]).
pub(crate) fn temporary_target(file_name: &str) -> Option<&str> {
    let inner = file_name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (target, suffix) = inner.rsplit_once('.')?;
    let numbers: Vec<&str> = suffix.split('-').collect();
    let unique = numbers.len() == 3
        && numbers
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    (unique && !target.is_empty()).then_some(target)
}

/// Removes, among `listing`, the temporary files older than [`STALE_TEMPORARY`] whose
/// target passes `ours` (nothing else would ever remove them), and says so in `notes`,
/// naming them `what` ("temporary cache file").
pub(crate) fn remove_stale_temporaries(
    listing: &[std::fs::DirEntry],
    ours: impl Fn(&str) -> bool,
    what: &str,
    notes: &mut Vec<String>,
) {
    let now = std::time::SystemTime::now();
    let mut removed = (0usize, 0u64);
    for entry in listing {
        let name = entry.file_name();
        let temporary = temporary_target(&name.to_string_lossy()).is_some_and(&ours);
        let Some(meta) = temporary.then(|| entry.metadata().ok()).flatten() else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|modified| now.duration_since(modified).ok())
            .is_some_and(|age| age > STALE_TEMPORARY);
        if old && meta.is_file() && std::fs::remove_file(entry.path()).is_ok() {
            removed.0 += 1;
            removed.1 += meta.len();
        }
    }
    if removed.0 > 0 {
        notes.push(format!(
            "removed {} {what}{} ({:.1} MB) left by writes that never finished",
            removed.0,
            if removed.0 == 1 { "" } else { "s" },
            removed.1 as f64 / 1e6
        ));
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What NVRTC produced.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Artefacts {
    ptx: String,
    cubin: Option<Vec<u8>>,
    log: String,
}

/// Layout: magic, key (hex, 64 bytes), then length-prefixed ptx, log, cubin (length
/// `u64::MAX` = none), then the SHA-256 of everything before it.
fn encode_entry(a: &Artefacts, key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(a.ptx.len() + a.cubin.as_ref().map_or(0, Vec::len) + 256);
    out.extend_from_slice(ENTRY_MAGIC);
    out.extend_from_slice(key.as_bytes());
    for part in [
        Some(a.ptx.as_bytes()),
        Some(a.log.as_bytes()),
        a.cubin.as_deref(),
    ] {
        match part {
            Some(bytes) => {
                out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                out.extend_from_slice(bytes);
            }
            None => out.extend_from_slice(&u64::MAX.to_le_bytes()),
        }
    }
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    out
}

fn decode_entry(bytes: &[u8], key: &str) -> Result<Artefacts, String> {
    let body_len = bytes.len().checked_sub(32).ok_or("truncated")?;
    let (body, digest) = bytes.split_at(body_len);
    if Sha256::digest(body).as_slice() != digest {
        return Err("checksum mismatch".to_string());
    }
    let mut rest = body
        .strip_prefix(ENTRY_MAGIC)
        .ok_or("not a moeforge cache entry")?;
    rest = rest
        .strip_prefix(key.as_bytes())
        .ok_or("stored for another key")?;
    let mut parts: Vec<Option<&[u8]>> = Vec::new();
    for _ in 0..3 {
        let (len, tail) = rest.split_first_chunk::<8>().ok_or("truncated")?;
        let len = u64::from_le_bytes(*len);
        if len == u64::MAX {
            parts.push(None);
            rest = tail;
            continue;
        }
        let len = usize::try_from(len).map_err(|_| "bad length")?;
        if len > tail.len() {
            return Err("truncated".to_string());
        }
        let (part, tail) = tail.split_at(len);
        parts.push(Some(part));
        rest = tail;
    }
    if !rest.is_empty() {
        return Err("trailing bytes".to_string());
    }
    let text = |part: Option<&[u8]>| {
        part.ok_or("missing text")
            .and_then(|p| String::from_utf8(p.to_vec()).map_err(|_| "text is not UTF-8"))
    };
    Ok(Artefacts {
        ptx: text(parts[0])?,
        log: text(parts[1])?,
        cubin: parts[2].map(<[u8]>::to_vec),
    })
}

/// Writes `bytes` to a temporary file in `path`'s folder, then renames it onto `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.{}.tmp", unique_suffix()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        // Best effort: the temporary file may not exist.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here. A failure to free
        // cannot be acted upon.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn nvrtc_compile(
    source: &str,
    options: &CompileOptions,
    real_arch: bool,
) -> Result<Artefacts, JitError> {
    let name = &options.name;
    let nul = |what: String| JitError::NulByte {
        name: name.clone(),
        what,
    };
    let c_source = CString::new(source).map_err(|_| nul("source".to_string()))?;
    let program_name = format!("{}.cu", file_stem(name));
    let c_name = CString::new(program_name.clone()).map_err(|_| nul("name".to_string()))?;
    let flags = nvrtc_flags(options);
    if let Some(flag) = flags.iter().find(|flag| flag.contains('\0')) {
        return Err(nul(format!("flag `{}`", flag.replace('\0', "\\0"))));
    }
    let failed = |call, status: nvrtc::NvrtcError| JitError::Nvrtc {
        name: name.clone(),
        call,
        status: status.0,
    };

    let program = Program(
        nvrtc::create_program(&c_source, Some(&c_name))
            .map_err(|e| failed("nvrtcCreateProgram", e))?,
    );
    // SAFETY: `program` is live until dropped at the end of this function; the flags have
    // no NUL bytes (checked above).
    let compiled = unsafe { nvrtc::compile_program(program.0, &flags) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(program.0) }
        .map_err(|e| failed("nvrtcGetProgramLog", e))?;
    let log = c_chars_to_string(&log);
    if let Err(status) = compiled {
        let diagnostics = diagnostics(&log, &program_name, source);
        return Err(JitError::Compile {
            name: name.clone(),
            arch: options.arch.clone(),
            status: format!("{:?}", status.0),
            log,
            diagnostics,
        });
    }
    // SAFETY: as above; the program compiled.
    let ptx = unsafe { nvrtc::get_ptx(program.0) }.map_err(|e| failed("nvrtcGetPTX", e))?;
    let cubin = if real_arch {
        let mut size = 0usize;
        // SAFETY: as above; `size` is valid for writes.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size) }
            .result()
            .map_err(|e| failed("nvrtcGetCUBINSize", e))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }
            .result()
            .map_err(|e| failed("nvrtcGetCUBIN", e))?;
        Some(cubin)
    } else {
        None
    };
    Ok(Artefacts {
        ptx: c_chars_to_string(&ptx),
        cubin,
        log: log.trim_end().to_string(),
    })
}

/// NUL-terminated C characters to a `String`.
fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Every `PROGRAM(LINE): ...error...: MESSAGE` line of `log`, with its source line.
fn diagnostics(log: &str, program_name: &str, source: &str) -> Vec<SourceDiagnostic> {
    let lines: Vec<&str> = source.lines().collect();
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(program_name)?.strip_prefix('(')?;
            let (line, rest) = rest.split_once("): ")?;
            let line: usize = line.parse().ok()?;
            let (severity, message) = rest.split_once(": ")?;
            severity.contains("error").then(|| SourceDiagnostic {
                line,
                message: message.to_string(),
                source_line: line
                    .checked_sub(1)
                    .and_then(|i| lines.get(i))
                    .map(|s| s.to_string()),
            })
        })
        .collect()
}

impl fmt::Display for FunctionResources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} registers, {} bytes stack, {} bytes spill stores, {} bytes spill loads, {} bytes smem",
            self.name,
            self.registers,
            self.stack_frame,
            self.spill_stores,
            self.spill_loads,
            self.shared_mem
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes `bytes` zero bytes to `path`, last modified at `modified` (a file left by a
    /// write long ago); returns the path.
    pub(crate) fn write_aged(
        path: &Path,
        bytes: usize,
        modified: std::time::SystemTime,
    ) -> PathBuf {
        std::fs::write(path, vec![0u8; bytes]).expect("write");
        std::fs::File::options()
            .append(true)
            .open(path)
            .and_then(|f| f.set_modified(modified))
            .expect("set mtime");
        path.to_path_buf()
    }

    #[test]
    fn arch_validation() {
        assert_eq!(parse_arch("sm_90a").ok(), Some(true));
        assert_eq!(parse_arch("sm_100f").ok(), Some(true));
        assert_eq!(parse_arch("compute_90").ok(), Some(false));
        for bad in ["sm90", "sm_", "sm_9", "sm_90b", "gfx90a", ""] {
            assert!(parse_arch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cache_entry_round_trip_and_corruption() {
        let a = Artefacts {
            ptx: "ptx".into(),
            cubin: Some(vec![1, 2, 3]),
            log: String::new(),
        };
        let key = "k".repeat(64);
        let bytes = encode_entry(&a, &key);
        assert_eq!(decode_entry(&bytes, &key), Ok(a.clone()));
        let none = Artefacts { cubin: None, ..a };
        assert_eq!(decode_entry(&encode_entry(&none, &key), &key), Ok(none));
        let mut flipped = bytes.clone();
        flipped[10] ^= 1;
        assert!(decode_entry(&flipped, &key).is_err());
        assert!(decode_entry(&bytes[..bytes.len() - 1], &key).is_err());
        assert!(decode_entry(b"", &key).is_err());
        assert!(decode_entry(&bytes, &"x".repeat(64)).is_err());
    }

    #[test]
    fn log_lines_are_quoted() {
        let log = "unit.cu(2): error: expected a \";\"\nunit.cu(1): warning #177-D: unused\nother.h(3): error: x\n";
        let d = diagnostics(log, "unit.cu", "int a;\nint b = \n");
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].line, 2);
        assert_eq!(d[0].source_line.as_deref(), Some("int b = "));
    }

    #[test]
    fn settings_from_variables() {
        let settings = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            JitSettings::from_vars(|name| {
                vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
            })
        };
        let home = settings(&[("HOME", "/h")]).expect("valid");
        assert_eq!(home.cache_dir, Some(PathBuf::from("/h/.cache/moeforge")));
        assert!(!home.no_cache_folder);
        let homeless = settings(&[("XDG_CACHE_HOME", "relative")]).expect("valid");
        assert!(homeless.cache_dir.is_none() && homeless.no_cache_folder);
        let xdg = settings(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]).expect("valid");
        assert_eq!(xdg.cache_dir, Some(PathBuf::from("/x/moeforge")));
        let own =
            settings(&[("XDG_CACHE_HOME", "/x"), ("MOEFORGE_CACHE_DIR", "/c")]).expect("valid");
        assert_eq!(own.cache_dir, Some(PathBuf::from("/c")));
        let off =
            settings(&[("MOEFORGE_CACHE_DIR", "/c"), ("MOEFORGE_NO_CACHE", "1")]).expect("valid");
        assert_eq!(off.cache_dir, None);
        assert!(!off.no_cache_folder, "turned off, not for want of a folder");
        let dump =
            settings(&[("MOEFORGE_DUMP", "ptx"), ("MOEFORGE_DUMP_DIR", "/d")]).expect("valid");
        assert!(dump.dump.ptx && !dump.dump.cubin);
        assert_eq!(dump.dump_dir, Some(PathBuf::from("/d")));
        assert!(settings(&[("MOEFORGE_NO_CACHE", "yes")]).is_err());
        assert!(settings(&[("MOEFORGE_DUMP", "sass")]).is_err());
        assert_eq!(home.cache_max_bytes, Some(DEFAULT_CACHE_MAX_MB * 1_000_000));
        let small = settings(&[("MOEFORGE_CACHE_MAX_MB", "300")]).expect("valid");
        assert_eq!(small.cache_max_bytes, Some(300_000_000));
        let unbounded = settings(&[("MOEFORGE_CACHE_MAX_MB", "0")]).expect("valid");
        assert_eq!(unbounded.cache_max_bytes, None);
        assert!(settings(&[("MOEFORGE_CACHE_MAX_MB", "2GB")]).is_err());
        // Folders that would move with the working directory.
        let relative_xdg = settings(&[("HOME", "/h"), ("XDG_CACHE_HOME", "x")]).expect("valid");
        assert_eq!(relative_xdg.cache_dir, home.cache_dir);
        // Checked when unused too, as every variable here: a wrong one is said at once.
        assert!(settings(&[("MOEFORGE_CACHE_DIR", "rel"), ("MOEFORGE_NO_CACHE", "1")]).is_err());
        for (var, value) in [
            ("MOEFORGE_CACHE_DIR", "rel"),
            ("MOEFORGE_CACHE_DIR", "~/cache"),
            ("MOEFORGE_CACHE_DIR", " /c"),
            ("MOEFORGE_DUMP_DIR", "d"),
        ] {
            match settings(&[(var, value)]) {
                Err(JitError::InvalidEnv { var: named, .. }) => assert_eq!(named, var),
                other => panic!("{var}={value:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_key_tells_nvrtc_builds_and_flags_apart() {
        let options = CompileOptions::new("unit".to_string(), "sm_90a".to_string());
        let version = NvrtcVersion {
            major: 13,
            minor: 0,
        };
        let key =
            |options: &CompileOptions, build: &str| cache_key("source", options, version, build);
        let base = key(&options, "libnvrtc.so.13.0.88:1000");
        assert_ne!(base, key(&options, "libnvrtc.so.13.0.99:1001"));
        assert_ne!(
            base,
            key(
                &options.clone().flag("-lineinfo"),
                "libnvrtc.so.13.0.88:1000"
            )
        );
        assert_eq!(base, key(&options, "libnvrtc.so.13.0.88:1000"));
    }

    #[test]
    fn temporary_names_give_their_target() {
        let name = format!(".unit-abc.mfjit.{}.tmp", unique_suffix());
        assert_eq!(temporary_target(&name), Some("unit-abc.mfjit"));
        assert_eq!(temporary_target(".plan.json.1-2-3.tmp"), Some("plan.json"));
        for other in [
            ".notes.tmp",
            "plan.json.1-2-3.tmp",
            ".plan.json.1-2.tmp",
            ".plan.json.1-x-3.tmp",
            "..1-2-3.tmp",
            ".plan.json.1-2-3.tmp.bak",
        ] {
            assert_eq!(temporary_target(other), None, "{other}");
        }
    }

    #[test]
    fn pruning_removes_temporary_files_a_killed_write_left() {
        let dir = std::env::temp_dir().join(format!("moeforge-stale-tmp-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let old = std::time::SystemTime::now() - 2 * STALE_TEMPORARY;
        let write = |name: &str, modified| write_aged(&dir.join(name), 100, modified);
        let stale = write(".unit-abc.mfjit.4242-0-1.tmp", old);
        let live = write(".unit-def.mfjit.4242-0-2.tmp", std::time::SystemTime::now());
        let other = write(".notes.tmp", old);
        let entry = write("unit-abc.mfjit", old);
        let mut notes = Vec::new();
        prune_cache(&entry, None, &mut notes);
        let kept = [
            !stale.exists(),
            live.exists(),
            other.exists(),
            entry.exists(),
        ];
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            kept, [true; 4],
            "stale gone; the live write, another file, the entry kept"
        );
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].starts_with("removed 1 temporary cache file ("),
            "{notes:?}"
        );
    }

    #[test]
    fn pruning_takes_the_least_recently_used_down_to_three_quarters() {
        let at = |seconds| std::time::UNIX_EPOCH + std::time::Duration::from_secs(seconds);
        let entry = |name: &str, bytes, used| CacheFile {
            path: PathBuf::from(name),
            bytes,
            used: at(used),
        };
        let entries = vec![
            entry("new", 40, 40),
            entry("old", 30, 10),
            entry("older", 30, 5),
            entry("mid", 30, 20),
        ];
        // 130 bytes over 100: the oldest go until 75 or less remain.
        let pruned = entries_to_prune(entries.clone(), 100, Path::new("new"));
        let names: Vec<_> = pruned
            .iter()
            .map(|e| e.path.to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["older", "old"]);
        // Within the bound, nothing goes.
        assert!(entries_to_prune(entries.clone(), 130, Path::new("new")).is_empty());
        // The entry just written stays, even when it is the oldest.
        let pruned = entries_to_prune(entries, 40, Path::new("older"));
        assert!(pruned.iter().all(|e| e.path != Path::new("older")));
        assert_eq!(pruned.len(), 3);
    }

    #[test]
    fn pruning_a_cache_folder_keeps_the_entry_just_written_and_says_so() {
        let dir = std::env::temp_dir().join(format!("moeforge-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("folder");
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for (name, bytes) in [("a.mfjit", 600), ("b.mfjit", 600), ("other.txt", 5000)] {
            let path = dir.join(name);
            std::fs::write(&path, vec![0u8; bytes]).expect("write");
            std::fs::File::options()
                .append(true)
                .open(&path)
                .and_then(|f| f.set_modified(old))
                .expect("age it");
        }
        let written = dir.join("c.mfjit");
        std::fs::write(&written, vec![0u8; 600]).expect("write");
        let mut notes = Vec::new();
        prune_cache(&written, Some(1000), &mut notes);
        let left: Vec<bool> = ["a.mfjit", "b.mfjit", "c.mfjit", "other.txt"]
            .iter()
            .map(|n| dir.join(n).exists())
            .collect();
        // 1800 bytes of entries over 1000: both old entries go (600 left), other files stay.
        assert_eq!(left, [false, false, true, true]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("removed 2 least recently used cache entries"),
            "{notes:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn dump_kinds_parse() {
        assert_eq!(DumpKinds::parse("").ok(), Some(DumpKinds::default()));
        assert_eq!(
            DumpKinds::parse("ptx").ok(),
            Some(DumpKinds {
                ptx: true,
                ..Default::default()
            })
        );
        assert_eq!(
            DumpKinds::parse("all").ok(),
            Some(DumpKinds {
                ptx: true,
                cubin: true,
                source: true
            })
        );
        assert!(DumpKinds::parse("sass").is_err());
    }

    #[test]
    fn ptxas_output_is_parsed() {
        let raw = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
ptxas info    : Function properties for k\n\
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]\n";
        let r = PtxasReport::parse(raw);
        let k = r.function("k").expect("k reported");
        assert!(k.entry);
        assert_eq!(
            (
                k.registers,
                k.stack_frame,
                k.spill_stores,
                k.spill_loads,
                k.shared_mem
            ),
            (40, 16, 8, 4, 1024)
        );
        assert_eq!(r.spilling().count(), 1);
        assert!(!k.wgmma_serialized);
    }

    #[test]
    fn serialized_wgmma_is_reported_per_function() {
        let raw = "ptxas info    : Compiling entry function 'g' for 'sm_90a'\n\
ptxas info    : Function properties for g\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 168 registers, used 1 barriers, 640 bytes smem\n\
ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP in divergent path in the function 'g'\n\
ptxas info    : Compiling entry function 'h' for 'sm_90a'\n\
ptxas info    : Function properties for h\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        let r = PtxasReport::parse(raw);
        assert!(r.function("g").expect("g reported").wgmma_serialized);
        assert!(!r.function("h").expect("h reported").wgmma_serialized);
        assert_eq!(r.functions.len(), 2);
        assert!(!r.setmaxnreg_ignored);
    }

    #[test]
    fn a_dropped_setmaxnreg_is_reported() {
        let raw = "ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility across compilation units.\n\
ptxas info    : Compiling entry function 'w' for 'sm_90a'\n\
ptxas info    : Function properties for w\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 167 registers, used 2 barriers\n";
        let r = PtxasReport::parse(raw);
        assert!(r.setmaxnreg_ignored);
        assert_eq!(r.function("w").expect("w reported").registers, 167);
    }
}
