mod common;
#[test]
fn dump() {
    for l in common::real_layers() {
        let plan = moeforge_compiler::plan::plan(&l, &moeforge_compiler::plan::Target::h200()).unwrap();
        for r in &plan.regimes {
            eprintln!("{} {} {}..{} g1 {:?} st{} grid{} est {:.1}us | g2 {:?} st{} grid{} est {:.1}us", l.name, r.name, r.min_tokens, r.max_tokens,
              r.gemm1.tile, r.gemm1.stages, r.gemm1.grid_blocks, r.gemm1.estimate.seconds*1e6, r.gemm2.tile, r.gemm2.stages, r.gemm2.grid_blocks, r.gemm2.estimate.seconds*1e6);
        }
        let src = moeforge_compiler::codegen::generate(&plan).unwrap();
        std::fs::write(format!("/tmp/{}", src.file_name), src.source).unwrap();
    }
}
