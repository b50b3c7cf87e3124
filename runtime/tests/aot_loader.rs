//! The AOT loader on damaged input: a `plan.json` with any byte changed, removed or
//! inserted either loads the very plan that was written (a change JSON does not see, such
//! as whitespace) or is refused with a typed error; it never panics.

use std::path::Path;

use moeforge_runtime::aot;
use proptest::prelude::*;

fn tiny_plan_file() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels-generated/tiny/plan.json");
    std::fs::read_to_string(path).expect("kernels-generated/tiny/plan.json")
}

#[derive(Debug, Clone)]
enum Damage {
    Replace(usize, u8),
    Remove(usize),
    Insert(usize, u8),
}

fn damage() -> impl Strategy<Value = Vec<Damage>> {
    let one = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Damage::Replace(at, byte)),
        any::<usize>().prop_map(Damage::Remove),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Damage::Insert(at, byte)),
        // Digits are the likeliest silent edits of a plan: sizes, grids, counts.
        (any::<usize>(), b'0'..=b'9').prop_map(|(at, byte)| Damage::Replace(at, byte)),
    ];
    prop::collection::vec(one, 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn a_damaged_plan_file_loads_unchanged_or_is_refused(damages in damage()) {
        let original = tiny_plan_file();
        let path = Path::new("plan.json");
        let expected = aot::parse_plan_file(&original, path).expect("the shipped file loads");
        let mut bytes = original.into_bytes();
        for damage in damages {
            match damage {
                Damage::Replace(at, byte) => {
                    let at = at % bytes.len();
                    bytes[at] = byte;
                }
                Damage::Remove(at) => {
                    let at = at % bytes.len();
                    bytes.remove(at);
                }
                Damage::Insert(at, byte) => {
                    let at = at % (bytes.len() + 1);
                    bytes.insert(at, byte);
                }
            }
        }
        let Ok(text) = String::from_utf8(bytes) else { return Ok(()) };
        if let Ok(layers) = aot::parse_plan_file(&text, path) {
            prop_assert_eq!(layers.len(), expected.len());
            for (got, want) in layers.iter().zip(&expected) {
                prop_assert_eq!(&got.plan, &want.plan);
            }
        }
    }
}

/// A plan that names its PTX outside its directory (an absolute path or `..`) is refused
/// whatever the hashes say: the directory's files are the plan's own.
#[test]
fn a_ptx_named_outside_the_directory_is_refused() {
    let original = tiny_plan_file();
    let ptx = "\"file\": \"tiny.ptx\"";
    assert!(original.contains(ptx), "the shipped plan names tiny.ptx");
    for outside in ["/tmp/tiny.ptx", "../tiny/tiny.ptx"] {
        let text = original.replace(ptx, &format!("\"file\": \"{outside}\""));
        match aot::parse_plan_file(&text, Path::new("plan.json")) {
            Err(aot::AotError::NotPlainName { file, what, .. }) => {
                assert_eq!((file.as_str(), what), (outside, "PTX"));
            }
            other => panic!("{outside}: {:?}", other.map(|layers| layers.len())),
        }
    }
}
