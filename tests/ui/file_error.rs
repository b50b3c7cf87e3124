// A spec file with a mistake: the error is at the `file` argument, with the file's
// path:line:column.
#[moeforge::moe_layer(file = "../../../../tests/ui/bad_top_k.moe")]
fn bad_top_k() {}

fn main() {}
