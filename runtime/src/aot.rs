//! Ahead-of-time output: what `moeforge compile FILE -o DIR` writes, and loading it back
//! without NVRTC or the language.
//!
//! Layout of DIR: `plan.json` and, per layer, `<symbol>.cu` (the generated source) and
//! `<symbol>.ptx` (left out by `moeforge compile --no-ptx`). The driver JIT-compiles the PTX
//! when the module is loaded.
//!
//! `plan.json` is a [`PlanFile`]: a format version, the moeforge version that wrote it, and
//! per layer the plan with the SHA-256 of the plan itself, of the source generated from it
//! and of the PTX compiled from that source. Loading checks all of them, validates the plan
//! ([`Plan::validate`]) and checks every PTX entry point's parameters against the plan's
//! launch table, so a stale, edited or mismatched directory is a typed error before any
//! kernel is launched.

use std::path::{Path, PathBuf};

use moeforge_compiler::codegen::{self, CodegenError};
use moeforge_compiler::plan::{ParamType, Plan, PlanInvalid};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::jit::{
    CacheOutcome, CompileOptions, CompiledModule, Jit, JitError, remove_stale_temporaries,
    unique_suffix,
};

pub const PLAN_FILE: &str = "plan.json";
/// The version of [`PlanFile`]'s layout; a file with another version is refused.
pub const FORMAT_VERSION: u32 = 12;
/// The value of [`PlanFile::format`].
const FORMAT_NAME: &str = "moeforge-plan";
const WRITTEN_BY: &str = concat!("moeforge ", env!("CARGO_PKG_VERSION"));

#[derive(Debug, Error)]
pub enum AotError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a moeforge plan file: {source}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{} has format version {found}, this moeforge reads version {FORMAT_VERSION}; regenerate it with `moeforge compile`",
        path.display()
    )]
    FormatVersion { path: PathBuf, found: String },
    #[error("{} has no layer `{wanted}` (it has: {})", path.display(), available.join(", "))]
    NoSuchLayer {
        path: PathBuf,
        wanted: String,
        available: Vec<String>,
    },
    #[error("{} holds {count} layers; name one ({})", path.display(), available.join(", "))]
    AmbiguousLayer {
        path: PathBuf,
        count: usize,
        available: Vec<String>,
    },
    #[error(
        "{}: {what} of layer `{layer}` does not match the hash recorded when it was written (edited, or from another moeforge version); regenerate the directory with `moeforge compile`",
        path.display()
    )]
    HashMismatch {
        path: PathBuf,
        layer: String,
        what: &'static str,
    },
    #[error("{}: layer `{layer}` was written without PTX (`moeforge compile --no-ptx`); compile it again where NVRTC is installed", path.display())]
    NoPtx { path: PathBuf, layer: String },
    #[error(
        "{}: entry point `{kernel}` {problem}; the PTX does not belong to this plan, regenerate the directory",
        path.display()
    )]
    EntryMismatch {
        path: PathBuf,
        kernel: String,
        problem: String,
    },
    #[error("cannot write {}: {source}; nothing in the directory was changed", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot replace {}: {source}; the directory may now hold files of two compiles: fix the cause, then compile into it again", path.display())]
    Replace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: layer `{layer}` names its {what} `{file}`, which is not a file of the directory (a plain name); regenerate the directory with `moeforge compile`",
        path.display()
    )]
    NotPlainName {
        path: PathBuf,
        layer: String,
        what: &'static str,
        file: String,
    },
    #[error(transparent)]
    InvalidPlan(#[from] PlanInvalid),
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    #[error(transparent)]
    Jit(#[from] JitError),
    #[error("cannot serialise the plans: {0}")]
    Serialise(#[from] serde_json::Error),
}

/// The contents of `plan.json`.
#[derive(Debug, Serialize, Deserialize)]
pub struct PlanFile {
    /// Always `moeforge-plan`.
    pub format: String,
    pub format_version: u32,
    /// The moeforge version that wrote the file (no commit: the output stays reproducible).
    pub written_by: String,
    pub layers: Vec<LayerArtifacts>,
}

/// One layer of an AOT directory.
#[derive(Debug, Serialize, Deserialize)]
pub struct LayerArtifacts {
    pub plan: Plan,
    /// SHA-256 of the plan serialised as compact JSON.
    pub plan_sha256: String,
    pub source: Artifact,
    /// Absent when the directory was compiled with `--no-ptx`.
    pub ptx: Option<Artifact>,
}

/// A file of the directory and the SHA-256 of its contents.
#[derive(Debug, Serialize, Deserialize)]
pub struct Artifact {
    pub file: String,
    pub sha256: String,
}

/// One file of an AOT directory.
pub struct OutputFile {
    pub name: String,
    pub contents: Vec<u8>,
}

/// NVRTC options of every generated unit (JIT and AOT alike).
pub fn compile_options(plan: &Plan) -> CompileOptions {
    CompileOptions::new(plan.symbol.clone(), plan.target.arch.clone()).flag("-std=c++17")
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn plan_sha256(plan: &Plan) -> Result<String, serde_json::Error> {
    Ok(sha256(&serde_json::to_vec(plan)?))
}

/// What [`render`] makes of a file's plans: the directory's files, and the JIT's notes on
/// the way (cache entries or dumps it could not write, entries it replaced), each once.
pub struct AotOutput {
    pub files: Vec<OutputFile>,
    pub notes: Vec<String>,
}

/// The files of an AOT directory for `plans`, in a stable order: each layer's source, its
/// PTX when `jit` is given, then `plan.json`.
pub fn render(plans: &[Plan], jit: Option<&Jit>) -> Result<AotOutput, AotError> {
    let mut files = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut layers = Vec::new();
    for plan in plans {
        let source = codegen::generate(plan)?;
        let ptx = match jit {
            Some(jit) => {
                let module = jit.compile(&source.source, &compile_options(plan))?;
                for note in module.notes {
                    if !notes.contains(&note) {
                        notes.push(note);
                    }
                }
                Some(module.ptx)
            }
            None => None,
        };
        layers.push(LayerArtifacts {
            plan: plan.clone(),
            plan_sha256: plan_sha256(plan)?,
            source: Artifact {
                file: source.file_name.clone(),
                sha256: sha256(source.source.as_bytes()),
            },
            ptx: ptx.as_ref().map(|ptx| Artifact {
                file: ptx_file_name(plan),
                sha256: sha256(ptx.as_bytes()),
            }),
        });
        files.push(OutputFile {
            name: source.file_name,
            contents: source.source.into_bytes(),
        });
        if let Some(ptx) = ptx {
            files.push(OutputFile {
                name: ptx_file_name(plan),
                contents: ptx.into_bytes(),
            });
        }
    }
    let plan_file = PlanFile {
        format: FORMAT_NAME.to_string(),
        format_version: FORMAT_VERSION,
        written_by: WRITTEN_BY.to_string(),
        layers,
    };
    let json = serde_json::to_string_pretty(&plan_file)? + "\n";
    files.push(OutputFile {
        name: PLAN_FILE.to_string(),
        contents: json.into_bytes(),
    });
    Ok(AotOutput { files, notes })
}

/// Writes `files` (distinct names) into `dir` (which must exist) so that a failure leaves
/// what was there: every file to a temporary name first, then each renamed onto its own in
/// order ([`render`]'s, `plan.json` last, so that the plan never names files of another
/// compile). A write that fails (a full disk), or a name a folder holds, removes the
/// temporary files and is the error before anything is replaced; only a rename failing
/// midway (rare: within one folder) can leave files of two compiles. Temporary files of a
/// compile killed while it wrote, older than an hour, are removed; the notes say so.
pub fn write_files(dir: &Path, files: &[OutputFile]) -> Result<Vec<String>, AotError> {
    // The JIT cache's temporary names: unique per process, call and moment.
    let temporary = |name: &str| dir.join(format!(".{name}.{}.tmp", unique_suffix()));
    for (index, file) in files.iter().enumerate() {
        let target = dir.join(&file.name);
        let duplicate = files[..index].iter().any(|f| f.name == file.name);
        let folder = std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir());
        if duplicate || folder {
            return Err(AotError::Write {
                path: target,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    if duplicate {
                        "named twice in one compile's output"
                    } else {
                        "a folder has this name"
                    },
                ),
            });
        }
    }
    let mut written: Vec<PathBuf> = Vec::new();
    let remove_all = |paths: &[PathBuf]| {
        for path in paths {
            // Best effort: a file the failed write never created is not there to remove.
            let _ = std::fs::remove_file(path);
        }
    };
    for file in files {
        let path = temporary(&file.name);
        if let Err(source) = std::fs::write(&path, &file.contents) {
            written.push(path);
            remove_all(&written);
            return Err(AotError::Write {
                path: dir.join(&file.name),
                source,
            });
        }
        written.push(path);
    }
    for (file, path) in files.iter().zip(&written) {
        let target = dir.join(&file.name);
        if let Err(source) = std::fs::rename(path, &target) {
            remove_all(&written);
            return Err(AotError::Replace {
                path: target,
                source,
            });
        }
    }
    let mut notes = Vec::new();
    if let Ok(listing) = std::fs::read_dir(dir) {
        let listing: Vec<std::fs::DirEntry> = listing.filter_map(Result::ok).collect();
        let output_file = |target: &str| {
            target == PLAN_FILE || target.ends_with(".cu") || target.ends_with(".ptx")
        };
        remove_stale_temporaries(&listing, output_file, "temporary output file", &mut notes);
    }
    Ok(notes)
}

/// The `plan.json` of `dir` as JSON, where it is one of moeforge's (of any format version).
fn earlier_plan(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join(PLAN_FILE)).ok()?;
    let value = serde_json::from_str::<serde_json::Value>(&text).ok()?;
    (value["format"] == FORMAT_NAME).then_some(value)
}

/// The files of `files` that writing them into `dir` would replace although they are not as
/// an earlier compile there left them: a `plan.json` that is not moeforge's, a `.cu` or
/// `.ptx` the earlier `plan.json` does not name (a file of the user's) or that was changed
/// since, each unless it already holds what would be written. `moeforge compile` replaces
/// them only when told to.
pub fn files_not_from_a_compile(dir: &Path, files: &[OutputFile]) -> Vec<PathBuf> {
    let plan_is_ours = earlier_plan(dir).is_some();
    let earlier = earlier_layer_files(dir);
    files
        .iter()
        .filter(|file| {
            let ours = if file.name == PLAN_FILE {
                plan_is_ours
            } else {
                earlier
                    .iter()
                    .any(|e| e.name == file.name && e.unchanged_in(dir))
            };
            let path = dir.join(&file.name);
            !ours
                && path.exists()
                && std::fs::read(&path).map_or(true, |bytes| bytes != file.contents)
        })
        .map(|file| dir.join(&file.name))
        .collect()
}

/// A layer file (source or PTX) an earlier compile wrote into a directory, as that
/// compile's `plan.json` recorded it.
pub struct EarlierFile {
    pub name: String,
    sha256: String,
}

impl EarlierFile {
    /// Whether the file in `dir` still holds what that compile wrote: not edited since, nor
    /// overwritten by a file of another case on a filesystem that ignores case.
    pub fn unchanged_in(&self, dir: &Path) -> bool {
        std::fs::read(dir.join(&self.name)).is_ok_and(|bytes| sha256(&bytes) == self.sha256)
    }
}

/// The layer files the `plan.json` of `dir` names, where it is one of moeforge's (read
/// loosely, so that a directory of another format version counts too): plain `.cu` and
/// `.ptx` names of the directory, with their recorded hashes; none where there is no such
/// file. `moeforge compile` removes those a new compile into `dir` leaves out and nobody
/// has changed, so that the directory holds one compile's files.
pub fn earlier_layer_files(dir: &Path) -> Vec<EarlierFile> {
    let Some(value) = earlier_plan(dir) else {
        return Vec::new();
    };
    let layers = value["layers"].as_array().map_or(&[][..], Vec::as_slice);
    layers
        .iter()
        .flat_map(|layer| [&layer["source"], &layer["ptx"]])
        .filter_map(|artifact| {
            let name = artifact["file"].as_str()?;
            let sha256 = artifact["sha256"].as_str()?;
            let plain = is_plain_name(name);
            let layer_file = name.ends_with(".cu") || name.ends_with(".ptx");
            (plain && layer_file).then(|| EarlierFile {
                name: name.to_string(),
                sha256: sha256.to_string(),
            })
        })
        .collect()
}

/// Whether `name` is a file of the directory itself: no folder, no `..`, not absolute.
fn is_plain_name(name: &str) -> bool {
    Path::new(name).file_name() == Some(std::ffi::OsStr::new(name))
}

/// The PTX file name of a plan's unit.
pub fn ptx_file_name(plan: &Plan) -> String {
    format!("{}.ptx", plan.symbol)
}

/// Reads `plan.json` of an AOT directory: the format version first (so that another
/// version is reported as such, not as a parse error), then every layer, each validated and
/// checked against its recorded hash.
pub fn read_plans(dir: &Path) -> Result<Vec<LayerArtifacts>, AotError> {
    let path = dir.join(PLAN_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| AotError::Read {
        path: path.clone(),
        source,
    })?;
    parse_plan_file(&text, &path)
}

/// [`read_plans`] on text already read from `path`.
pub fn parse_plan_file(text: &str, path: &Path) -> Result<Vec<LayerArtifacts>, AotError> {
    let parse_error = |source| AotError::Parse {
        path: path.to_path_buf(),
        source,
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(parse_error)?;
    let version = value.get("format_version");
    let is_plan_file = value.get("format").and_then(|f| f.as_str()) == Some(FORMAT_NAME);
    if !is_plan_file || version.and_then(|v| v.as_u64()) != Some(u64::from(FORMAT_VERSION)) {
        return Err(AotError::FormatVersion {
            path: path.to_path_buf(),
            found: match version {
                Some(v) if is_plan_file => v.to_string(),
                _ => "none (written before versions, or not a plan file)".to_string(),
            },
        });
    }
    let file: PlanFile = serde_json::from_value(value).map_err(parse_error)?;
    for layer in &file.layers {
        // Files outside the directory are not its layer's, whatever their hashes say.
        let named = [("source", Some(&layer.source)), ("PTX", layer.ptx.as_ref())];
        for (what, artifact) in named {
            if let Some(artifact) = artifact.filter(|a| !is_plain_name(&a.file)) {
                return Err(AotError::NotPlainName {
                    path: path.to_path_buf(),
                    layer: layer.plan.layer.clone(),
                    what,
                    file: artifact.file.clone(),
                });
            }
        }
        layer.plan.validate()?;
        if plan_sha256(&layer.plan)? != layer.plan_sha256 {
            return Err(AotError::HashMismatch {
                path: path.to_path_buf(),
                layer: layer.plan.layer.clone(),
                what: "the plan",
            });
        }
        // The source this moeforge generates from the plan must be the one the PTX was
        // compiled from: templates of another version would launch other kernels.
        let source = codegen::generate(&layer.plan)?;
        if sha256(source.source.as_bytes()) != layer.source.sha256 {
            return Err(AotError::HashMismatch {
                path: path.to_path_buf(),
                layer: layer.plan.layer.clone(),
                what: "the generated source",
            });
        }
    }
    Ok(file.layers)
}

/// One layer of an AOT directory: its plan and its PTX, checked, ready for
/// [`crate::gpu::Gpu::load`].
pub fn load_layer(dir: &Path, layer: Option<&str>) -> Result<(Plan, CompiledModule), AotError> {
    let mut layers = read_plans(dir)?;
    let path = dir.join(PLAN_FILE);
    let available: Vec<String> = layers.iter().map(|l| l.plan.layer.clone()).collect();
    let position = match layer {
        Some(wanted) => layers.iter().position(|l| l.plan.layer == wanted),
        None if layers.len() == 1 => Some(0),
        None => {
            return Err(AotError::AmbiguousLayer {
                path,
                count: available.len(),
                available,
            });
        }
    };
    let Some(position) = position else {
        return Err(AotError::NoSuchLayer {
            path,
            wanted: layer.unwrap_or_default().to_string(),
            available,
        });
    };
    let chosen = layers.swap_remove(position);
    let plan = chosen.plan;
    let Some(artifact) = chosen.ptx else {
        return Err(AotError::NoPtx {
            path,
            layer: plan.layer.clone(),
        });
    };
    let ptx_path = dir.join(&artifact.file);
    let ptx = std::fs::read_to_string(&ptx_path).map_err(|source| AotError::Read {
        path: ptx_path.clone(),
        source,
    })?;
    if sha256(ptx.as_bytes()) != artifact.sha256 {
        return Err(AotError::HashMismatch {
            path: ptx_path,
            layer: plan.layer.clone(),
            what: "the PTX",
        });
    }
    check_ptx_entries(&plan, &ptx).map_err(|(kernel, problem)| AotError::EntryMismatch {
        path: ptx_path,
        kernel,
        problem,
    })?;
    let module = CompiledModule {
        name: plan.symbol.clone(),
        arch: plan.target.arch.clone(),
        ptx,
        cubin: None,
        log: String::new(),
        key: String::new(),
        cache: CacheOutcome::Disabled,
        notes: Vec::new(),
    };
    Ok((plan, module))
}

/// Checks that every entry point the plan launches is in `ptx` with exactly the plan's
/// parameters: as many, in order, each a 64-bit pointer, a 32-bit integer or a 128-byte
/// tensor map aligned to 64, as the plan says. On a mismatch, the kernel and what is wrong.
pub fn check_ptx_entries(plan: &Plan, ptx: &str) -> Result<(), (String, String)> {
    for launch in plan.launches() {
        let kernel = &launch.kernel;
        let params = ptx_entry_params(ptx, kernel)
            .ok_or_else(|| (kernel.clone(), "is missing from the PTX".to_string()))?;
        let expected: Vec<&str> = launch
            .params
            .iter()
            .map(|p| match p.arg.param_type() {
                ParamType::Pointer(_) => ".u64",
                ParamType::I32 | ParamType::U32 => ".u32",
                ParamType::TensorMap => TENSOR_MAP_PTX,
            })
            .collect();
        if params != expected {
            return Err((
                kernel.clone(),
                format!(
                    "takes ({}) in the PTX, the plan passes ({})",
                    params.join(", "),
                    expected.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// How a tensor-map parameter reads in [`ptx_entry_params`]: 128 bytes aligned to 64.
const TENSOR_MAP_PTX: &str = ".align 64 .b8[128]";

/// The PTX types (`.u64`, `.u32`, …) of the parameters of `.entry kernel(...)`, in order; a
/// byte-array parameter (a struct passed by value) reads `.align A .b8[N]`.
pub fn ptx_entry_params(ptx: &str, kernel: &str) -> Option<Vec<String>> {
    let header = format!(".entry {kernel}(");
    let start = ptx.find(&header)? + header.len();
    let end = start + ptx[start..].find(')')?;
    Some(
        ptx[start..end]
            .split(',')
            .filter_map(|param| {
                let words: Vec<&str> = param.split_whitespace().collect();
                match words.as_slice() {
                    [".param", ".align", align, ".b8", name, ..] => {
                        let length = name.split_once('[')?.1;
                        Some(format!(".align {align} .b8[{length}"))
                    }
                    [".param", kind, ..] => Some(kind.to_string()),
                    _ => None,
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_parameters_are_read_from_ptx() {
        let ptx = ".visible .entry k(\n\t.param .u64 .ptr .align 1 k_param_0,\n\t.param .u32 k_param_1,\n\t.param .align 64 .b8 k_param_2[128]\n)\n{\n}\n.visible .entry k2()\n{\n}\n";
        assert_eq!(
            ptx_entry_params(ptx, "k"),
            Some(vec![
                ".u64".to_string(),
                ".u32".to_string(),
                TENSOR_MAP_PTX.to_string()
            ])
        );
        assert_eq!(ptx_entry_params(ptx, "k2"), Some(vec![]));
        assert_eq!(ptx_entry_params(ptx, "k3"), None);
    }

    #[test]
    fn output_refused_before_writing_leaves_the_directory_as_it_was() {
        let dir = std::env::temp_dir().join(format!("moeforge-aot-write-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = |name: &str, contents: &str| OutputFile {
            name: name.to_string(),
            contents: contents.as_bytes().to_vec(),
        };
        write_files(&dir, &[file("a.cu", "old a"), file(PLAN_FILE, "old plan")])
            .expect("first write");
        // The second file's name taken by a folder, then named twice: refused before any
        // file is replaced.
        std::fs::rename(dir.join(PLAN_FILE), dir.join("plan.old")).expect("move");
        std::fs::create_dir(dir.join(PLAN_FILE)).expect("blocker");
        let failed = write_files(&dir, &[file("a.cu", "new a"), file(PLAN_FILE, "new plan")]);
        std::fs::remove_dir(dir.join(PLAN_FILE)).expect("blocker gone");
        std::fs::rename(dir.join("plan.old"), dir.join(PLAN_FILE)).expect("move back");
        let twice = write_files(&dir, &[file("a.cu", "new a"), file("a.cu", "newer a")]);
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).expect("read");
        let after = (read("a.cu"), read(PLAN_FILE));
        let leftovers: Vec<String> = std::fs::read_dir(&dir)
            .expect("list")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".tmp"))
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        for result in [failed, twice] {
            assert!(
                matches!(result, Err(AotError::Write { .. })),
                "{:?}",
                result.err()
            );
        }
        assert_eq!(after, ("old a".to_string(), "old plan".to_string()));
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    /// A compile killed between its writes and renames leaves hidden temporary files; the
    /// next compile into the folder removes those older than an hour, and nothing else.
    #[test]
    fn writing_removes_an_earlier_compiles_stale_temporary_files() {
        let dir = std::env::temp_dir().join(format!("moeforge-aot-stale-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let old = std::time::SystemTime::now() - 2 * crate::jit::STALE_TEMPORARY;
        let write =
            |name: &str, modified| crate::jit::tests::write_aged(&dir.join(name), 10, modified);
        let stale = [
            write(".other.ptx.77-0-5.tmp", old),
            write(".plan.json.77-1-6.tmp", old),
        ];
        let kept = [
            write(".other.cu.78-0-7.tmp", std::time::SystemTime::now()),
            write(".notes.txt.77-2-8.tmp", old),
            write(".other.cu.tmp", old),
        ];
        let files = [OutputFile {
            name: PLAN_FILE.to_string(),
            contents: b"{}".to_vec(),
        }];
        let notes = write_files(&dir, &files).expect("write");
        let gone = stale.iter().map(|p| !p.exists()).collect::<Vec<_>>();
        let there = kept.iter().map(|p| p.exists()).collect::<Vec<_>>();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(gone, [true; 2]);
        assert_eq!(
            there, [true; 3],
            "a live write, a file of the user's, another name"
        );
        assert_eq!(
            notes,
            ["removed 2 temporary output files (0.0 MB) left by writes that never finished"]
        );
    }

    #[test]
    fn file_names_outside_the_directory_are_not_plain() {
        for name in ["tiny.ptx", "tiny.cu", ".tiny.ptx"] {
            assert!(is_plain_name(name), "{name}");
        }
        for name in [
            "/tmp/tiny.ptx",
            "../tiny.ptx",
            "sub/tiny.ptx",
            "..",
            ".",
            "",
        ] {
            assert!(!is_plain_name(name), "{name}");
        }
    }
}
