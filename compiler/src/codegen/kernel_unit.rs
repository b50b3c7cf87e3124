//! One entry point's share of a generated unit, as the JIT compiles it.
//!
//! The JIT builds each entry point of a layer as a module of its own (`-DMOEFORGE_ONE_KERNEL
//! -DMOEFORGE_KERNEL_<name>`). Every section of the unit that only some entry points use
//! (an entry point, a GEMM's or a gate's configuration, a wgmma width, the sorted-rows
//! constants) sits in a kernel guard naming them, written by [`kernel_guard`].
//! [`kernel_unit_source`] keeps, for a set of entry points, the unguarded sections and the
//! guarded ones that name one of them (less the guard lines), and drops the other guarded
//! sections and every blank or comment-only line: what the preprocessor would keep of the
//! guarded code, without the words. The JIT compiles and caches that text, so a module and
//! its cache entry change only with its own kernel's code and the sections every kernel
//! shares: a plan that changes one regime's GEMMs (a `moeforge tune` candidate, an edited
//! tile hint) compiles those GEMMs' modules again, not every module of the layer (28 for
//! Qwen3-30B-A3B).

const GUARD_OPENING: &str = "#if MOEFORGE_ALL_KERNELS";
const KERNEL_DEFINE: &str = "MOEFORGE_KERNEL_";

/// The `#if` line of a section only `kernels` use (closed by `#endif`); in a unit built
/// whole (no `MOEFORGE_ONE_KERNEL`) every section is in.
pub fn kernel_guard<S: AsRef<str>>(kernels: &[S]) -> String {
    let mut guard = GUARD_OPENING.to_string();
    for kernel in kernels {
        guard.push_str(" || defined(");
        guard.push_str(KERNEL_DEFINE);
        guard.push_str(kernel.as_ref());
        guard.push(')');
    }
    guard
}

/// The entry points a kernel guard line names, or `None` for any other line.
fn guarded_kernels(line: &str) -> Option<Vec<&str>> {
    let mut rest = line.trim().strip_prefix(GUARD_OPENING)?;
    let mut kernels = Vec::new();
    while !rest.is_empty() {
        let define = rest.strip_prefix(" || defined(")?;
        let (name, after) = define.split_once(')')?;
        kernels.push(name.strip_prefix(KERNEL_DEFINE)?);
        rest = after;
    }
    Some(kernels)
}

/// A preprocessor conditional's part, by its directive.
#[derive(Clone, Copy, PartialEq)]
enum Conditional {
    Opens,
    Branches,
    Closes,
}

fn conditional(line: &str) -> Option<Conditional> {
    let directive = line.trim_start().strip_prefix('#')?.trim_start();
    let word = directive
        .split(|c: char| !c.is_ascii_alphanumeric())
        .next()?;
    match word {
        "if" | "ifdef" | "ifndef" => Some(Conditional::Opens),
        "else" | "elif" | "elifdef" | "elifndef" => Some(Conditional::Branches),
        "endif" => Some(Conditional::Closes),
        _ => None,
    }
}

/// The text of `source` (a unit from [`super::generate`]) that builds `kernels`: see the
/// module docs. A unit whose guards it cannot follow (unbalanced, or a guard with an
/// `#else`) comes back whole, which compiles the same kernels, only without the narrower
/// cache key.
pub fn kernel_unit_source<S: AsRef<str>>(source: &str, kernels: &[S]) -> String {
    keep_for(source, kernels).unwrap_or_else(|| source.to_string())
}

fn keep_for<S: AsRef<str>>(source: &str, kernels: &[S]) -> Option<String> {
    let wanted = |name: &str| kernels.iter().any(|k| k.as_ref() == name);
    let mut kept = String::with_capacity(source.len() / 2);
    // Open conditionals, innermost last: whether each is a kept kernel guard (whose
    // `#endif` goes too) or another conditional (kept as written).
    let mut open: Vec<bool> = Vec::new();
    // Inside a dropped guard: how deep, counting the guard itself.
    let mut dropping = 0usize;
    for line in source.lines() {
        let part = conditional(line);
        if dropping > 0 {
            match part {
                Some(Conditional::Opens) => dropping += 1,
                Some(Conditional::Branches) if dropping == 1 => return None,
                Some(Conditional::Closes) => dropping -= 1,
                _ => {}
            }
            continue;
        }
        if let Some(names) = guarded_kernels(line) {
            if names.iter().any(|name| wanted(name)) {
                open.push(true);
            } else {
                dropping = 1;
            }
            continue;
        }
        match part {
            Some(Conditional::Opens) => open.push(false),
            Some(Conditional::Branches) if open.last() == Some(&true) => return None,
            Some(Conditional::Closes) => {
                // A kept guard's `#endif` goes with its `#if`.
                let closes_kept_guard = open.pop()?;
                if closes_kept_guard {
                    continue;
                }
            }
            _ => {}
        }
        let text = line.trim_start();
        if text.is_empty() || text.starts_with("//") {
            continue;
        }
        kept.push_str(line);
        kept.push('\n');
    }
    (open.is_empty() && dropping == 0).then_some(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: &str = "\
// A layer.
enum : int { HIDDEN = 64 };
#ifdef MOEFORGE_ONE_KERNEL
#define MOEFORGE_ALL_KERNELS 0
#endif
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_up) || defined(MOEFORGE_KERNEL_fused)
struct up_config { enum : int { BM = 16 }; };
#endif
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_up)
extern \"C\" __global__ void up() {
#if __CUDA_ARCH__ >= 900
    // Hopper only.
    hopper();
#endif
}
#endif

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_down)
extern \"C\" __global__ void down() {
#if __CUDA_ARCH__ >= 900
    hopper();
#else
    other();
#endif
}
#endif
";

    #[test]
    fn guard_lines_round_trip() {
        let guard = kernel_guard(&["a_gemm1", "a_fused"]);
        assert_eq!(
            guard,
            "#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_a_gemm1) || defined(MOEFORGE_KERNEL_a_fused)"
        );
        assert_eq!(guarded_kernels(&guard), Some(vec!["a_gemm1", "a_fused"]));
        assert_eq!(guarded_kernels("#if __CUDA_ARCH__ >= 900"), None);
        assert_eq!(guarded_kernels("#if MOEFORGE_ALL_KERNELS || x"), None);
    }

    #[test]
    fn keeps_the_kernels_sections_and_drops_the_others_and_the_words() {
        let up = kernel_unit_source(UNIT, &["up"]);
        assert_eq!(
            up,
            "\
enum : int { HIDDEN = 64 };
#ifdef MOEFORGE_ONE_KERNEL
#define MOEFORGE_ALL_KERNELS 0
#endif
struct up_config { enum : int { BM = 16 }; };
extern \"C\" __global__ void up() {
#if __CUDA_ARCH__ >= 900
    hopper();
#endif
}
"
        );
        let down = kernel_unit_source(UNIT, &["down"]);
        assert!(!down.contains("up_config") && !down.contains("void up"));
        assert!(down.contains("#else\n    other();\n#endif\n}\n"));
        let fused = kernel_unit_source(UNIT, &["fused"]);
        assert!(fused.contains("struct up_config") && !fused.contains("void up"));
    }

    #[test]
    fn a_unit_it_cannot_follow_comes_back_whole() {
        let unbalanced = "#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_up)\nint a;\n";
        assert_eq!(kernel_unit_source(unbalanced, &["down"]), unbalanced);
        let branched = "#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_up)\nint a;\n#else\nint b;\n#endif\n";
        assert_eq!(kernel_unit_source(branched, &["up"]), branched);
        assert_eq!(kernel_unit_source(branched, &["down"]), branched);
        let stray = "int a;\n#endif\n";
        assert_eq!(kernel_unit_source(stray, &["up"]), stray);
    }
}
