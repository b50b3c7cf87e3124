// The checker accepts the layer (its hint fits the H200), the planner for the A100 does
// not: the error names the hint, as `moeforge explain --target a100` does.
#[moeforge::moe_layer(file = "../../../../tests/fixtures/wgmma_only_tile.moe", target = "a100")]
fn on_a100() {}

fn main() {}
