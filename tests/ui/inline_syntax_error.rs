// A syntax error inline, and a key the checker does not know: every error is reported.
#[moeforge::moe_layer(r#"layer broken { hidden = = 128  expertz = 8 }"#)]
fn broken() {}

fn main() {}
