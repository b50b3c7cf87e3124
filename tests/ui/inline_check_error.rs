// A rule of the checker broken inline: the error is at the literal, with the Rust file's
// line and column of the offending value and the CLI's hint.
#[moeforge::moe_layer(r#"
topology one_gpu {
  gpus_per_node = 1
  nvlink = 450 GB/s, 3 us
  network = 50 GB/s, 10 us
}
layer bad {
  hidden = 100
  ffn = 256
  experts = 8
  top_k = 2
  topology = one_gpu
}
"#)]
fn bad() {}

fn main() {
    bad();
}
