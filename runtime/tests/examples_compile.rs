//! Every shipped example's kernels compile through NVRTC for sm_90a; ptxas reports no
//! spills and no serialised wgmma for any of them, and exactly the static shared memory the
//! plan states; every entry point in the PTX takes exactly the parameters of the plan's
//! launch table. Needs NVRTC (skips without it, fails under MOEFORGE_REQUIRE_NVRTC=1); no GPU.
//! Also, without NVRTC: the GPU suite's sorted-rows layer sorts on every Hopper target, so
//! the suite covers sorted rows on an H100 as on an H200.

use moeforge_compiler::plan::{self, RowLoad, Target};
use moeforge_runtime::aot;
use moeforge_runtime::jit::{FunctionResources, Jit, JitSettings, PtxasReport};
use moeforge_runtime::toolkit::nvrtc_for_tests;

mod layers;

#[test]
fn every_example_compiles_for_sm90a_without_spills() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let target = Target::h200();
    // One thread per example: NVRTC and ptxas work on independent programs concurrently.
    let layers = layers::examples();
    let checked: usize = std::thread::scope(|scope| {
        let workers: Vec<_> = layers
            .iter()
            .map(|layer| scope.spawn(|| check_example(&jit, &target, layer)))
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("an example's check panicked"))
            .sum()
    });
    println!("{checked} kernels compiled without spills");
    assert!(
        checked >= 7 * 4,
        "every example has at least route, gemm1, gemm2 and combine"
    );
}

#[test]
fn the_sorted_rows_layer_sorts_on_every_hopper_target() {
    for target in [Target::h200(), Target::h100()] {
        let plan = plan::plan(&layers::sorted_rows(), &target).expect("plans");
        assert!(
            plan.regimes
                .iter()
                .all(|r| r.gemm1.a_load == RowLoad::Tiles),
            "{}: GEMM1 gathers its rows in some regime",
            target.name
        );
    }
}

/// Layers no example covers compile without spills too: a large top-k, whose combine sums
/// 33 slots (loaded in batches, so its registers stay bounded), and expert parallelism
/// whose results return as rank partials (a visited rank holds about 2 of a token's 4
/// pairs), whose combine sums one partial per rank.
#[test]
fn a_large_top_k_and_rank_partials_compile_without_spills() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let target = Target::h200();
    let mut wide = layers::tiny_with_shared_expert(moeforge_compiler::ir::Activation::Swiglu);
    wide.name = "tiny_top32".into();
    wide.experts = 64;
    wide.top_k = 32;
    let mut partials = layers::tiny_with_shared_expert(moeforge_compiler::ir::Activation::Swiglu);
    partials.name = "tiny_rank_partials".into();
    partials.top_k = 4;
    partials.parallel.expert = 2;
    partials.topology.gpus_per_node = 2;
    let plan = plan::plan(&partials, &target).expect("the rank-partials layer plans");
    assert_eq!(
        plan.expert_parallel.as_ref().map(|ep| ep.combine_route),
        Some(plan::ep::CombineRoute::RankPartials),
        "the case returns its results as rank partials"
    );
    for layer in [&wide, &partials] {
        assert!(check_example(&jit, &target, layer) >= 4, "{}", layer.name);
    }
}

/// The fused decode kernel (`fused_decode = 16 tokens`) of five examples (one with a gated
/// shared expert, whose shared-slice tiles compute the gate), and the router that runs
/// before it, compile as the runtime compiles them, a module each: no spills, and the
/// static shared memory (for the fused decode, the routing each block lays out) the plan
/// states.
#[test]
fn fused_decode_kernels_compile_without_spills() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let target = Target::h200();
    let names = [
        "qwen3_30b_a3b",
        "deepseek_v3",
        "mixtral_8x7b",
        "gpt_oss_120b",
        "qwen1_5_moe_a2_7b",
    ];
    let layers: Vec<_> = layers::examples()
        .into_iter()
        .filter(|l| names.contains(&l.name.as_str()))
        .map(|mut layer| {
            layer.schedule.fused_decode = Some(16);
            layer
        })
        .collect();
    assert_eq!(layers.len(), names.len());
    std::thread::scope(|scope| {
        for layer in &layers {
            let (jit, target) = (&jit, &target);
            scope.spawn(move || {
                let plan = plan::plan(layer, target).expect("the example plans");
                let launch = plan.regimes[0]
                    .fused_decode
                    .as_ref()
                    .map(|fused| fused.launch.clone())
                    .expect("a fused decode");
                let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
                // The router's launches too: the first regime's fused router leaves the
                // metadata to the fused decode.
                let router = plan.router.iter().flat_map(|r| &r.regimes[0].launches);
                let launches: Vec<_> = std::iter::once(&launch).chain(router).collect();
                let names: Vec<String> = launches.iter().map(|l| l.kernel.clone()).collect();
                let kernels = jit
                    .compile_kernels(&source.source, &names, &aot::compile_options(&plan))
                    .expect("NVRTC compiles the fused decode and the router");
                for launch in &launches {
                    let m = kernels
                        .modules
                        .iter()
                        .find(|m| m.kernels.contains(&launch.kernel))
                        .expect("a module per kernel");
                    let report = jit
                        .ptxas_report(&m.module.ptx, &plan.target.arch)
                        .expect("ptxas -v");
                    let function = clean_function(&report, &launch.kernel, &layer.name);
                    assert_eq!(
                        function.shared_mem,
                        u64::from(launch.static_smem_bytes),
                        "{}: ptxas's static shared memory against the plan's",
                        launch.kernel
                    );
                }
            });
        }
    });
}

/// A plan whose launch table disagrees with the compiled kernels is caught: the check is
/// not vacuous.
#[test]
fn a_launch_table_that_disagrees_with_the_ptx_is_caught() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let layer = layers::tiny(moeforge_compiler::ir::Activation::Swiglu);
    let plan = plan::plan(&layer, &Target::h200()).expect("tiny plans");
    let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
    let module = jit
        .compile(&source.source, &aot::compile_options(&plan))
        .expect("NVRTC compiles tiny");
    assert_eq!(aot::check_ptx_entries(&plan, &module.ptx), Ok(()));
    let mut edited = plan.clone();
    edited.regimes[0].launches[0].params.swap(0, 1);
    let (kernel, problem) =
        aot::check_ptx_entries(&edited, &module.ptx).expect_err("swapped parameters are caught");
    assert_eq!(kernel, plan.route_kernel);
    assert!(problem.contains(".u64, .u32"), "{problem}");
}

/// Compiles one example and checks its kernels; returns how many it checked.
fn check_example(jit: &Jit, target: &Target, layer: &moeforge_compiler::ir::Layer) -> usize {
    let plan = plan::plan(layer, target).expect("every example plans");
    let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
    let module = jit
        .compile(&source.source, &aot::compile_options(&plan))
        .expect("NVRTC compiles the example");
    let report = jit
        .ptxas_report(&module.ptx, &plan.target.arch)
        .expect("ptxas -v");
    if let Err((kernel, problem)) = aot::check_ptx_entries(&plan, &module.ptx) {
        panic!("{}: entry `{kernel}` {problem}", layer.name);
    }
    for entry in &source.entry_points {
        let function = clean_function(&report, entry, &layer.name);
        let launch = plan
            .launches()
            .find(|l| &l.kernel == entry)
            .expect("every entry point is launched");
        assert_eq!(
            function.shared_mem,
            u64::from(launch.static_smem_bytes),
            "{entry}: ptxas's static shared memory against the plan's"
        );
    }
    source.entry_points.len()
}

/// `kernel` of `layer` as `ptxas` reported it, asserting that it neither spills nor has its
/// wgmma serialised.
fn clean_function<'a>(report: &'a PtxasReport, kernel: &str, layer: &str) -> &'a FunctionResources {
    let function = report
        .function(kernel)
        .unwrap_or_else(|| panic!("ptxas reports {kernel}"));
    assert_eq!(
        (function.spill_stores, function.spill_loads),
        (0, 0),
        "{kernel} of {layer} spills: {function:?}"
    );
    assert!(
        !function.wgmma_serialized,
        "ptxas serialises the wgmma of {kernel} of {layer}"
    );
    function
}

/// Every example's kernels, compiled module by module as the runtime does
/// ([`Jit::compile_kernels`]: each kernel a whole-program module of its own), have no
/// spills, no serialised wgmma and no dropped `setmaxnreg` (ptxas drops it from
/// relocatable code, which the warp-specialised GEMMs must not be).
#[test]
fn every_example_compiles_module_by_module_as_the_runtime_loads_it() {
    let Some(toolkit) = nvrtc_for_tests() else {
        return;
    };
    let jit = Jit::new(toolkit, JitSettings::from_env().expect("JIT settings")).expect("JIT");
    let target = Target::h200();
    let layers = layers::examples();
    std::thread::scope(|scope| {
        for layer in &layers {
            let (jit, target) = (&jit, &target);
            scope.spawn(move || {
                let plan = plan::plan(layer, target).expect("every example plans");
                let source = moeforge_compiler::codegen::generate(&plan).expect("codegen");
                let kernels = jit
                    .compile_kernels(
                        &source.source,
                        &source.entry_points,
                        &aot::compile_options(&plan),
                    )
                    .expect("NVRTC compiles every kernel");
                for m in &kernels.modules {
                    let report = jit
                        .ptxas_report(&m.module.ptx, &plan.target.arch)
                        .expect("ptxas -v");
                    assert!(
                        !report.setmaxnreg_ignored,
                        "{:?} of {}: ptxas dropped setmaxnreg",
                        m.kernels, layer.name
                    );
                    for kernel in &m.kernels {
                        clean_function(&report, kernel, &layer.name);
                    }
                }
            });
        }
    });
}
