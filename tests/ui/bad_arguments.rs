// Mistakes in the macro's own arguments and in the annotated item.
#[moeforge::moe_layer(file = "../../../../dsl-examples/mixtral_8x7b.moe", target = "b200")]
fn unknown_target() {}

#[moeforge::moe_layer(file = "../../../../dsl-examples/mixtral_8x7b.moe", layer = "mixtral")]
fn unknown_layer() {}

#[moeforge::moe_layer(file = "../../../../dsl-examples/no_such_file.moe")]
fn missing_file() {}

#[moeforge::moe_layer(file = "../../../../dsl-examples/tiny.moe", speed = "fast")]
fn unknown_argument() {}

#[moeforge::moe_layer(file = "../../../../dsl-examples/tiny.moe")]
fn with_body(tokens: u32) -> u32 {
    tokens
}

fn main() {
    // The original items are still there: this call type-checks against `with_body`.
    let _: u32 = with_body(1);
}
