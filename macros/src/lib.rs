//! The attribute-macro front end of moeforge: a `#[moe_layer(...)]` macro that reads the
//! same language as `.moe` files and maps diagnostics onto Rust spans.
//!
//! Not built yet: a later issue fills this crate. It exists now so that the workspace has
//! the shape the project is known by.
