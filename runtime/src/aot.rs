//! Ahead-of-time output: what `moeforge compile FILE -o DIR` writes, and loading it back
//! without NVRTC or the language.
//!
//! Layout of DIR: `plan.json` (a JSON array with the plan of every layer of the file), and
//! per layer `<symbol>.cu` (the generated source) and `<symbol>.ptx` (when NVRTC was
//! present at compile time). The driver JIT-compiles the PTX when the module is loaded.

use std::path::{Path, PathBuf};

use moeforge_compiler::plan::Plan;
use thiserror::Error;

use moeforge_compiler::codegen::{self, CodegenError};

use crate::jit::{CacheOutcome, CompileOptions, CompiledModule, Jit, JitError};

pub const PLAN_FILE: &str = "plan.json";

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
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    #[error(transparent)]
    Jit(#[from] JitError),
    #[error("cannot serialise the plans: {0}")]
    Serialise(#[from] serde_json::Error),
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

/// The files of an AOT directory for `plans`, in a stable order: each layer's source, its
/// PTX when `jit` is given, then `plan.json`.
pub fn render(plans: &[Plan], jit: Option<&Jit>) -> Result<Vec<OutputFile>, AotError> {
    let mut files = Vec::new();
    for plan in plans {
        let source = codegen::generate(plan)?;
        if let Some(jit) = jit {
            let module = jit.compile(&source.source, &compile_options(plan))?;
            files.push(OutputFile {
                name: source.file_name,
                contents: source.source.into_bytes(),
            });
            files.push(OutputFile {
                name: ptx_file_name(plan),
                contents: module.ptx.into_bytes(),
            });
        } else {
            files.push(OutputFile {
                name: source.file_name,
                contents: source.source.into_bytes(),
            });
        }
    }
    let json = serde_json::to_string_pretty(plans)? + "\n";
    files.push(OutputFile {
        name: PLAN_FILE.to_string(),
        contents: json.into_bytes(),
    });
    Ok(files)
}

/// The PTX file name of a plan's unit.
pub fn ptx_file_name(plan: &Plan) -> String {
    format!("{}.ptx", plan.symbol)
}

/// Reads the plans of an AOT directory.
pub fn read_plans(dir: &Path) -> Result<Vec<Plan>, AotError> {
    let path = dir.join(PLAN_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| AotError::Read {
        path: path.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| AotError::Parse { path, source })
}

/// One layer of an AOT directory: its plan and its PTX, ready for [`crate::gpu::Gpu::load`].
pub fn load_layer(dir: &Path, layer: Option<&str>) -> Result<(Plan, CompiledModule), AotError> {
    let plans = read_plans(dir)?;
    let path = dir.join(PLAN_FILE);
    let available: Vec<String> = plans.iter().map(|p| p.layer.clone()).collect();
    let plan = match layer {
        Some(wanted) => plans
            .into_iter()
            .find(|p| p.layer == wanted)
            .ok_or_else(|| AotError::NoSuchLayer {
                path,
                wanted: wanted.to_string(),
                available,
            })?,
        None if plans.len() == 1 => plans.into_iter().next().expect("one plan"),
        None => {
            return Err(AotError::AmbiguousLayer {
                path,
                count: available.len(),
                available,
            });
        }
    };
    let ptx_path = dir.join(ptx_file_name(&plan));
    let ptx = std::fs::read_to_string(&ptx_path).map_err(|source| AotError::Read {
        path: ptx_path,
        source,
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
