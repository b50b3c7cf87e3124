//! Records the commit the binary was built from, for benchmark results (`MOEFORGE_COMMIT`):
//! the short hash of HEAD, with `-dirty` when tracked files differ from it (a build of
//! uncommitted changes must not pass for the commit it started from).
fn main() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(hash) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|changes| !changes.is_empty());
            if dirty { format!("{hash}-dirty") } else { hash }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=MOEFORGE_COMMIT={commit}");
    // HEAD moves, the index changes, or a source file is edited: look again.
    for path in [
        ".git/HEAD",
        ".git/refs/heads",
        ".git/index",
        "Cargo.toml",
        "src",
        "compiler",
        "runtime",
        "macros",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
}
