//! Generates the `.moe` parser from `src/front/grammar.lalrpop`.
fn main() {
    lalrpop::Configuration::new()
        .use_cargo_dir_conventions()
        .emit_rerun_directives(true)
        .process()
        .expect("the grammar in src/front/grammar.lalrpop must be valid LR(1)");
}
