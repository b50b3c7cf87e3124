//! Fuzzes the whole front end on arbitrary bytes: decoding, lexing, parsing, checking and
//! rendering diagnostics must not panic; for text that parses, formatting must be
//! idempotent and must not change what the file means.
//!
//! Run from `fuzz/` (seed the corpus with the examples first):
//! `mkdir -p corpus/front && cp ../dsl-examples/*.moe corpus/front/ &&
//!  RUSTC_BOOTSTRAP=1 cargo fuzz run front -- -dict=moe.dict -max_len=4096 -max_total_time=600`
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeforge_compiler::{compile_bytes, compile_source, format_source};

fuzz_target!(|bytes: &[u8]| {
    let compiled = compile_bytes("fuzz.moe", bytes);
    if let Err(diagnostics) = &compiled {
        let _ = diagnostics.render();
    }
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(formatted) = format_source("fuzz.moe", text) else { return };
    let reformatted = format_source("fuzz.moe", &formatted).expect("formatted text must parse");
    assert_eq!(formatted, reformatted, "formatting must be idempotent");
    if let Ok(module) = compiled {
        assert_eq!(compile_source("fuzz.moe", &formatted).ok(), Some(module), "formatting must keep the meaning");
    }
});
