//! Finding the CUDA toolkit (NVRTC and `ptxas`) and the CUDA driver.
//!
//! cudarc loads `libnvrtc` and `libcuda` by bare name through the dynamic loader and
//! panics when they are missing, and it never reads `CUDA_HOME`. This module resolves the
//! toolkit itself, loads NVRTC by full path *before* cudarc looks for it (glibc then
//! hands cudarc the already loaded library, matched by its soname `libnvrtc.so.13`), and
//! turns every absence into a [`ToolkitError`] that says what to install.
//!
//! # Discovery order
//!
//! [`Toolkit::discover`] takes the first candidate that holds `libnvrtc.so.13`:
//!
//! 1. `$CUDA_HOME` (libraries in `lib64/`, `lib/` or `targets/x86_64-linux/lib/`, `ptxas` in `bin/`);
//! 2. `$CUDA_PATH` (same layout);
//! 3. `$MOEFORGE_NVRTC_WHEEL`: a Python environment, or the wheel's `nvidia/cu13` folder itself;
//! 4. `/usr/local/cuda` (after the toolkit variables: a setting wins over the default);
//! 5. `$VIRTUAL_ENV` (the active Python virtual environment);
//! 6. a `.venv/` in the current directory or any of its parents, then in any parent of the
//!    running executable (so `target/debug/...` finds the repository's `.venv/`);
//! 7. the site-packages that `python3` reports (`site.getsitepackages()` and the user site),
//!    only tried when everything above failed.
//!
//! In a Python environment the pip wheels (`nvidia-cuda-nvrtc`, `nvidia-cuda-nvcc`) put
//! NVRTC in `lib/python3.*/site-packages/nvidia/cu13/lib` and `ptxas` in `.../cu13/bin`.
//! Candidates that exist but lack NVRTC are skipped and listed in the error.

use std::ffi::c_int;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// File name (and soname) of the NVRTC library for the CUDA major version cudarc is built for.
pub const NVRTC_LIB: &str = "libnvrtc.so.13";
/// Pip packages that provide NVRTC and `ptxas`, pinned to the GPU machine's CUDA.
pub const PIP_PACKAGES: &str = "nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88";
/// Environment variable that turns "NVRTC missing, test skipped" into a test failure.
pub const REQUIRE_NVRTC_VAR: &str = "MOEFORGE_REQUIRE_NVRTC";

/// Where a [`Toolkit`] was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolkitSource {
    /// `$CUDA_HOME`.
    CudaHome,
    /// `$CUDA_PATH`.
    CudaPath,
    /// `/usr/local/cuda`.
    UsrLocalCuda,
    /// `$MOEFORGE_NVRTC_WHEEL`.
    WheelOverride,
    /// `$VIRTUAL_ENV`.
    VirtualEnv,
    /// A `.venv/` next to the current directory or the executable, or one of their parents.
    DotVenv,
    /// The site-packages reported by `python3`.
    Python3,
}

impl fmt::Display for ToolkitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ToolkitSource::CudaHome => "$CUDA_HOME",
            ToolkitSource::CudaPath => "$CUDA_PATH",
            ToolkitSource::UsrLocalCuda => USR_LOCAL_CUDA,
            ToolkitSource::WheelOverride => "$MOEFORGE_NVRTC_WHEEL",
            ToolkitSource::VirtualEnv => "$VIRTUAL_ENV",
            ToolkitSource::DotVenv => ".venv/",
            ToolkitSource::Python3 => "python3 site-packages",
        })
    }
}

/// A CUDA toolkit (or the pip wheel's equivalent) with NVRTC in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toolkit {
    /// The toolkit's root: `/usr/local/cuda`, or the wheel's `.../site-packages/nvidia/cu13`.
    pub root: PathBuf,
    /// Full path of `libnvrtc.so.13`.
    pub nvrtc_lib: PathBuf,
    /// Full path of `ptxas`, when the toolkit has one (the `nvidia-cuda-nvcc` wheel).
    pub ptxas: Option<PathBuf>,
    /// Which rule of the discovery order found it.
    pub source: ToolkitSource,
    /// Toolkit settings set but holding no NVRTC, passed over on the way (`$CUDA_HOME =
    /// DIR`, ...): likely a mistake the user would want to hear of.
    pub passed_over: Vec<String>,
}

/// NVRTC's version, as reported by `nvrtcVersion`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NvrtcVersion {
    /// Major version (13 for CUDA 13.0).
    pub major: i32,
    /// Minor version.
    pub minor: i32,
}

impl fmt::Display for NvrtcVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why the toolkit or the driver cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ToolkitError {
    /// No candidate directory held NVRTC.
    #[error(
        "no CUDA toolkit with {NVRTC_LIB} found (looked in: {}); either set CUDA_HOME to a CUDA 13 toolkit, \
         or create a Python environment with `python3 -m venv .venv && .venv/bin/pip install {PIP_PACKAGES}` \
         (scripts/test.sh does this) and activate it or set MOEFORGE_NVRTC_WHEEL to it",
        looked_in.join(", ")
    )]
    NotFound {
        /// Every place that was examined, with what was missing.
        looked_in: Vec<String>,
    },
    /// The library file exists but the dynamic loader refused it.
    #[error("found {} but could not load it: {reason}; check that it is a 64-bit Linux library of CUDA 13 (reinstall the wheel or toolkit)", path.display())]
    Load {
        /// The library that failed to load.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// After loading, cudarc still could not find NVRTC by name.
    #[error(
        "loaded {} but cudarc cannot find NVRTC by name; add its folder to LD_LIBRARY_PATH",
        path.display()
    )]
    NotVisibleToCudarc {
        /// The library that was loaded.
        path: PathBuf,
    },
    /// cudarc resolved a different NVRTC than the one discovered.
    #[error(
        "the discovered NVRTC {} is version {found} but cudarc resolved another NVRTC, version {cudarc}; \
         remove the other libnvrtc from LD_LIBRARY_PATH or point CUDA_HOME at the one you want",
        path.display()
    )]
    VersionMismatch {
        /// The discovered library.
        path: PathBuf,
        /// Version of the discovered library.
        found: NvrtcVersion,
        /// Version of the library cudarc uses.
        cudarc: NvrtcVersion,
    },
    /// `nvrtcVersion` failed.
    #[error("nvrtcVersion failed ({0:?}); the NVRTC installation looks broken, reinstall it")]
    Version(cudarc::nvrtc::sys::nvrtcResult),
    /// No `libcuda` (the driver) could be loaded.
    #[error(
        "no CUDA driver found (libcuda.so.1 is not loadable); install the NVIDIA driver or run on the GPU machine. \
         Compiling to PTX/CUBIN works without a driver, launching kernels does not"
    )]
    NoDriver,
    /// The driver is present but `cuInit` failed (no GPU, or a driver/toolkit mismatch).
    #[error(
        "the CUDA driver is present but cuInit failed ({0:?}); check `nvidia-smi` and that the driver supports CUDA 13"
    )]
    DriverInit(cudarc::driver::sys::CUresult),
}

impl Toolkit {
    /// Finds a toolkit in the documented order (see the module documentation).
    pub fn discover() -> Result<Toolkit, ToolkitError> {
        let var = |name: &str| std::env::var_os(name);
        let mut starts = Vec::new();
        if let Ok(cwd) = std::env::current_dir() {
            starts.push(cwd);
        }
        if let Some(exe_dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            starts.push(exe_dir);
        }
        let candidates = fixed_candidates(&var, &starts, Path::new(USR_LOCAL_CUDA));
        discover_among(candidates, python3_site_packages)
    }

    /// Loads this toolkit's NVRTC so that cudarc uses it, and returns its version.
    ///
    /// Idempotent. The libraries stay loaded for the life of the process.
    pub fn load_nvrtc(&self) -> Result<NvrtcVersion, ToolkitError> {
        let found = {
            let mut loaded = LOADED
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(lib) = self.builtins_lib() {
                open_global(&lib, &mut loaded)?;
            }
            let handle = open_global(&self.nvrtc_lib, &mut loaded)?;
            version_via(handle, &self.nvrtc_lib)?
        };
        // SAFETY: dlopen of NVRTC by name; the library was loaded above, so its
        // initialisers have already run.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(ToolkitError::NotVisibleToCudarc {
                path: self.nvrtc_lib.clone(),
            });
        }
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: NVRTC is present (checked above); the pointers are valid for writes.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| ToolkitError::Version(e.0))?;
        let cudarc = NvrtcVersion { major, minor };
        if cudarc != found {
            return Err(ToolkitError::VersionMismatch {
                path: self.nvrtc_lib.clone(),
                found,
                cudarc,
            });
        }
        Ok(found)
    }

    /// Which NVRTC build this is, beyond the major.minor `nvrtcVersion` reports (every
    /// 13.0.x says 13.0): the file name and size of the NVRTC library, followed through its
    /// links (`libnvrtc.so.13.0.88` in a toolkit), and of its builtins library. A patch
    /// release changes a size; reading whole libraries would cost a cached load its
    /// milliseconds. Modification times are left out so that a cache carried to another
    /// machine of the same toolkit still serves.
    pub fn fingerprint(&self) -> String {
        let identity = |path: &Path| {
            let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            let name = real.file_name().map(|n| n.to_string_lossy().into_owned());
            let bytes = std::fs::metadata(&real).map(|m| m.len()).ok();
            format!("{}:{}", name.unwrap_or_default(), bytes.unwrap_or(0))
        };
        let builtins = self.builtins_lib().map(|lib| identity(&lib));
        format!(
            "{} {}",
            identity(&self.nvrtc_lib),
            builtins.unwrap_or_default()
        )
    }

    /// `libnvrtc-builtins.so.*` next to the NVRTC library (NVRTC opens it at compile time).
    fn builtins_lib(&self) -> Option<PathBuf> {
        let dir = self.nvrtc_lib.parent()?;
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
            })
            .collect();
        names.sort();
        names.pop()
    }
}

/// Checks that the CUDA driver (`libcuda`) can be loaded and initialised.
pub fn driver_available() -> Result<(), ToolkitError> {
    // SAFETY: only dlopens libcuda by name.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ToolkitError::NoDriver);
    }
    // SAFETY: the driver library is present (checked above); cuInit(0) is always valid.
    unsafe { cudarc::driver::sys::cuInit(0) }
        .result()
        .map_err(|e| ToolkitError::DriverInit(e.0))
}

/// For tests: the toolkit with NVRTC loaded, or `None` (after printing why) to skip.
///
/// # Panics
///
/// When `MOEFORGE_REQUIRE_NVRTC=1` is set and NVRTC cannot be found or loaded, so that CI
/// fails instead of silently skipping.
pub fn nvrtc_for_tests() -> Option<Toolkit> {
    let result = Toolkit::discover().and_then(|tk| tk.load_nvrtc().map(|_| tk));
    match result {
        Ok(tk) => Some(tk),
        Err(err) if std::env::var(REQUIRE_NVRTC_VAR).is_ok_and(|v| v == "1") => {
            panic!("{REQUIRE_NVRTC_VAR}=1 but NVRTC is unusable: {err}")
        }
        Err(err) => {
            eprintln!("note: skipping test that needs NVRTC: {err}");
            None
        }
    }
}

/// Libraries opened by [`Toolkit::load_nvrtc`], kept open for the life of the process.
static LOADED: Mutex<Vec<(PathBuf, libloading::os::unix::Library)>> = Mutex::new(Vec::new());

/// Opens `path` with `RTLD_NOW | RTLD_GLOBAL` once, and returns the handle.
fn open_global<'a>(
    path: &Path,
    loaded: &'a mut Vec<(PathBuf, libloading::os::unix::Library)>,
) -> Result<&'a libloading::os::unix::Library, ToolkitError> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let index = match loaded.iter().position(|(p, _)| p == path) {
        Some(index) => index,
        None => {
            // SAFETY: loading a CUDA library runs its initialisers, which have no
            // preconditions on our side.
            let lib =
                unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
                    ToolkitError::Load {
                        path: path.to_path_buf(),
                        reason: e.to_string(),
                    }
                })?;
            loaded.push((path.to_path_buf(), lib));
            loaded.len() - 1
        }
    };
    Ok(&loaded[index].1)
}

/// Calls `nvrtcVersion` through our own handle (not cudarc's), to compare the two.
fn version_via(
    lib: &libloading::os::unix::Library,
    path: &Path,
) -> Result<NvrtcVersion, ToolkitError> {
    type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
    // SAFETY: `nvrtcVersion` has this signature in every NVRTC release.
    let version: libloading::os::unix::Symbol<VersionFn> = unsafe { lib.get(b"nvrtcVersion\0") }
        .map_err(|e| ToolkitError::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: valid pointers; the symbol is NVRTC's nvrtcVersion.
    let status = unsafe { version(&mut major, &mut minor) };
    if status != 0 {
        return Err(ToolkitError::Load {
            path: path.to_path_buf(),
            reason: format!("nvrtcVersion returned status {status}"),
        });
    }
    Ok(NvrtcVersion { major, minor })
}

/// The default toolkit root, rule 4 of the discovery order.
const USR_LOCAL_CUDA: &str = "/usr/local/cuda";

/// Candidates 1 to 6 of the discovery order, in order: from the settings `var` reads, the
/// toolkit root `usr_local_cuda`, and the `.venv/` folders in `starts` and their parents
/// (the current directory, then the executable's). The process's view is passed in so
/// that tests can check the order without touching the process's environment.
fn fixed_candidates(
    var: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    starts: &[PathBuf],
    usr_local_cuda: &Path,
) -> Vec<(ToolkitSource, PathBuf)> {
    let env_dir = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let mut out = Vec::new();
    for (name, source) in [
        ("CUDA_HOME", ToolkitSource::CudaHome),
        ("CUDA_PATH", ToolkitSource::CudaPath),
        ("MOEFORGE_NVRTC_WHEEL", ToolkitSource::WheelOverride),
    ] {
        if let Some(dir) = env_dir(name) {
            out.push((source, dir));
        }
    }
    out.push((ToolkitSource::UsrLocalCuda, usr_local_cuda.to_path_buf()));
    if let Some(dir) = env_dir("VIRTUAL_ENV") {
        out.push((ToolkitSource::VirtualEnv, dir));
    }
    for start in starts {
        for dir in start.ancestors() {
            let venv = dir.join(".venv");
            if venv.is_dir() && !out.iter().any(|(_, d)| *d == venv) {
                out.push((ToolkitSource::DotVenv, venv));
            }
        }
    }
    out
}

/// The first of `candidates` that holds NVRTC, else the first of the site-packages
/// `python3` reports (asked only then: it starts a process); the settings passed over on
/// the way are kept in the toolkit, every place looked in goes into the error.
fn discover_among(
    candidates: Vec<(ToolkitSource, PathBuf)>,
    python3: impl FnOnce() -> Vec<PathBuf>,
) -> Result<Toolkit, ToolkitError> {
    let mut looked_in = Vec::new();
    let mut passed_over = Vec::new();
    for (source, dir) in candidates {
        let found = match source {
            ToolkitSource::CudaHome | ToolkitSource::CudaPath | ToolkitSource::UsrLocalCuda => {
                toolkit_in_cuda_root(&dir, source)
            }
            _ => toolkit_in_python_env(&dir, source),
        };
        match found {
            Some(tk) => return Ok(Toolkit { passed_over, ..tk }),
            None => {
                let place = format!("{source} = {}", dir.display());
                let setting = matches!(
                    source,
                    ToolkitSource::CudaHome
                        | ToolkitSource::CudaPath
                        | ToolkitSource::WheelOverride
                );
                if setting {
                    passed_over.push(place.clone());
                }
                looked_in.push(place);
            }
        }
    }
    for dir in python3() {
        if let Some(tk) = toolkit_in_site_packages(&dir, ToolkitSource::Python3) {
            return Ok(Toolkit { passed_over, ..tk });
        }
        looked_in.push(format!("python3 site-packages {}", dir.display()));
    }
    Err(ToolkitError::NotFound { looked_in })
}

/// A classic toolkit layout: `ROOT/{lib64,lib,targets/x86_64-linux/lib}/libnvrtc.so.13`, `ROOT/bin/ptxas`.
fn toolkit_in_cuda_root(root: &Path, source: ToolkitSource) -> Option<Toolkit> {
    ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|sub| root.join(sub).join(NVRTC_LIB))
        .find(|lib| lib.is_file())
        .map(|nvrtc_lib| Toolkit {
            root: root.to_path_buf(),
            nvrtc_lib,
            ptxas: Some(root.join("bin/ptxas")).filter(|p| p.is_file()),
            source,
            passed_over: Vec::new(),
        })
}

/// A Python environment (or the wheel's `nvidia/cu13` folder itself).
fn toolkit_in_python_env(dir: &Path, source: ToolkitSource) -> Option<Toolkit> {
    if let Some(tk) = toolkit_in_cu13(dir, source) {
        return Some(tk);
    }
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(dir.join(lib)) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .map(|e| e.path().join("site-packages"))
            .collect();
        pythons.sort();
        if let Some(tk) = pythons
            .iter()
            .rev()
            .find_map(|sp| toolkit_in_site_packages(sp, source))
        {
            return Some(tk);
        }
    }
    None
}

fn toolkit_in_site_packages(site_packages: &Path, source: ToolkitSource) -> Option<Toolkit> {
    toolkit_in_cu13(&site_packages.join("nvidia/cu13"), source)
}

/// The wheel's layout: `cu13/lib/libnvrtc.so.13`, `cu13/bin/ptxas`.
fn toolkit_in_cu13(cu13: &Path, source: ToolkitSource) -> Option<Toolkit> {
    let nvrtc_lib = cu13.join("lib").join(NVRTC_LIB);
    nvrtc_lib.is_file().then(|| Toolkit {
        root: cu13.to_path_buf(),
        nvrtc_lib,
        ptxas: Some(cu13.join("bin/ptxas")).filter(|p| p.is_file()),
        source,
        passed_over: Vec::new(),
    })
}

/// Site-packages folders reported by `python3`; empty when there is no `python3`.
fn python3_site_packages() -> Vec<PathBuf> {
    let script =
        "import site\nfor p in site.getsitepackages() + [site.getusersitepackages()]: print(p)";
    match Command::new("python3").args(["-c", script]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_layout_is_recognised() {
        let root = std::env::temp_dir().join(format!("moeforge-tk-{}", std::process::id()));
        let sp = root.join("lib/python3.11/site-packages/nvidia/cu13");
        std::fs::create_dir_all(sp.join("lib")).expect("create temp dirs");
        std::fs::create_dir_all(sp.join("bin")).expect("create temp dirs");
        std::fs::write(sp.join("lib").join(NVRTC_LIB), b"").expect("write");
        std::fs::write(sp.join("bin/ptxas"), b"").expect("write");
        let tk = toolkit_in_python_env(&root, ToolkitSource::VirtualEnv).expect("found");
        assert_eq!(tk.root, sp);
        assert_eq!(tk.ptxas, Some(sp.join("bin/ptxas")));
        let direct = toolkit_in_python_env(&sp, ToolkitSource::WheelOverride).expect("found");
        assert_eq!(direct.nvrtc_lib, sp.join("lib").join(NVRTC_LIB));
        assert!(toolkit_in_cuda_root(&root, ToolkitSource::CudaHome).is_none());
        std::fs::remove_dir_all(&root).expect("clean up");
    }

    /// Makes `dir` a Python environment holding the NVRTC wheel (an empty library file: the
    /// discovery looks for the file, it does not load it).
    fn fake_wheel_env(dir: &Path) {
        let lib = dir.join("lib/python3.12/site-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).expect("create temp dirs");
        std::fs::write(lib.join(NVRTC_LIB), b"").expect("write");
    }

    /// Every rule of the documented order, each taken away in turn: the first candidate
    /// that holds NVRTC wins, a setting that holds none is passed over and named.
    #[test]
    fn discovery_follows_the_documented_order() {
        let root = std::env::temp_dir().join(format!("moeforge-order-{}", std::process::id()));
        // A `.venv/` above the temporary folder would be rule 6 too, before the last step.
        if let Some(venv) = root
            .ancestors()
            .map(|dir| dir.join(".venv"))
            .find(|venv| venv.is_dir())
        {
            eprintln!("note: skipped: {} would be found as rule 6", venv.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&root);
        let dir = |name: &str| root.join(name);
        std::fs::create_dir_all(dir("empty")).expect("create temp dirs");
        for toolkit in ["cuda_path", "usr_local_cuda"] {
            std::fs::create_dir_all(dir(toolkit).join("lib64")).expect("create temp dirs");
            std::fs::write(dir(toolkit).join("lib64").join(NVRTC_LIB), b"").expect("write");
        }
        for env in ["wheel", "virtual_env", "project/.venv", "python3/env"] {
            fake_wheel_env(&dir(env));
        }
        std::fs::create_dir_all(dir("project/src")).expect("create temp dirs");
        let python3_site = dir("python3/env/lib/python3.12/site-packages");

        let mut vars: Vec<(&str, PathBuf)> = vec![
            ("CUDA_HOME", dir("empty")),
            ("CUDA_PATH", dir("cuda_path")),
            ("MOEFORGE_NVRTC_WHEEL", dir("wheel")),
            ("VIRTUAL_ENV", dir("virtual_env")),
        ];
        let mut usr_local_cuda = dir("usr_local_cuda");
        let starts = [dir("project/src")];
        let mut expected = vec![
            (ToolkitSource::CudaPath, dir("cuda_path")),
            (ToolkitSource::WheelOverride, dir("wheel")),
            (ToolkitSource::UsrLocalCuda, dir("usr_local_cuda")),
            (ToolkitSource::VirtualEnv, dir("virtual_env")),
            (ToolkitSource::DotVenv, dir("project/.venv")),
            (ToolkitSource::Python3, dir("python3/env")),
        ];
        let discover = |vars: &[(&str, PathBuf)], usr_local_cuda: &Path| {
            let var = |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, dir)| dir.clone().into_os_string())
            };
            let candidates = fixed_candidates(&var, &starts, usr_local_cuda);
            discover_among(candidates, || vec![python3_site.clone()])
        };
        // Rule 1 first: `$CUDA_HOME` holding NVRTC wins over everything, passing nothing over.
        let mut home_first = vars.clone();
        home_first[0].1 = dir("cuda_path");
        let tk = discover(&home_first, &usr_local_cuda).expect("CUDA_HOME holds NVRTC");
        assert_eq!(tk.source, ToolkitSource::CudaHome);
        assert!(tk.passed_over.is_empty());
        while !expected.is_empty() {
            let (source, place) = expected.remove(0);
            let tk = discover(&vars, &usr_local_cuda).expect("a candidate holds NVRTC");
            assert_eq!(tk.source, source);
            assert!(
                tk.root.starts_with(&place),
                "{source}: {}",
                tk.root.display()
            );
            let empty_home = format!("$CUDA_HOME = {}", dir("empty").display());
            assert_eq!(tk.passed_over, vec![empty_home]);
            // Take the winner away: the next rule must win.
            match source {
                ToolkitSource::UsrLocalCuda => usr_local_cuda = dir("missing"),
                ToolkitSource::DotVenv => {
                    std::fs::remove_dir_all(dir("project/.venv")).expect("clean up")
                }
                ToolkitSource::Python3 => {
                    std::fs::remove_dir_all(dir("python3")).expect("clean up")
                }
                _ => {
                    let name = match source {
                        ToolkitSource::CudaPath => "CUDA_PATH",
                        ToolkitSource::WheelOverride => "MOEFORGE_NVRTC_WHEEL",
                        _ => "VIRTUAL_ENV",
                    };
                    vars.retain(|(n, _)| *n != name);
                }
            }
        }
        match discover(&vars, &usr_local_cuda) {
            Err(ToolkitError::NotFound { looked_in }) => {
                assert!(looked_in[0].starts_with("$CUDA_HOME"), "{looked_in:?}");
                assert!(
                    looked_in
                        .iter()
                        .any(|l| l.starts_with("python3 site-packages"))
                );
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
        std::fs::remove_dir_all(&root).expect("clean up");
    }

    #[test]
    fn driver_check_does_not_panic() {
        if let Err(err) = driver_available() {
            assert!(!err.to_string().is_empty());
        }
    }
}
