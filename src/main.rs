//! The `moeforge` command-line tool.
fn main() {
    eprintln!("moeforge: no commands yet");
    std::process::exit(2);
}
