//! The grouped GEMMs' tile schedule, run on the GPU (ignored by default; run with
//! `--include-ignored` on the GPU machine).
//!
//! The test appends a probe kernel to a plan's generated CUDA unit. The probe calls the
//! very device functions the GEMMs call, `tile_schedule<BM, N_TILES>` and
//! `locate_tile<BM, BN>`, and writes every tile (expert, n0, row0, rows) to a buffer. The
//! host then checks, for expert row counts from many routings (empty first, middle and
//! last experts, everything on one expert, no rows at all): the tile count is the tight
//! one, Σ_e ⌈rows_e / BM⌉ · N_TILES; every tile has 1..=BM rows inside its expert and an
//! n-tile below N_TILES; every (expert, row) is covered exactly once per n-tile; nothing is
//! written past the last tile.

use std::io::Write;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use moeforge_compiler::codegen;
use moeforge_compiler::ir::{Activation, Layer, ScheduleHints, TileShape};
use moeforge_compiler::plan::{self, Plan};
use moeforge_runtime::aot;
use moeforge_runtime::harness::Session;
use moeforge_runtime::jit::CompileOptions;
use moeforge_runtime::workload::{Routing, SplitMix64, Workload};

mod layers;

/// Experts of the probed layer: more than the 32 lanes of the scan in `tile_schedule`, so
/// that lanes sum runs of several experts, and not a multiple of 32, so that some lanes
/// have none.
const EXPERTS: u32 = 72;
const PROBE_THREADS: u32 = 128;
/// What the probe's output holds before it runs; no field of a real tile is negative.
const UNWRITTEN: i32 = -7;

/// The probe, appended to the generated unit (which defines `EXPERTS`, `GemmTile`,
/// `tile_schedule` and `locate_tile`). out[0] = the schedule's tile count; out[1 + 4i ..]
/// = expert, n0, row0 and rows of tile i, for i < capacity.
const PROBE_TEMPLATE: &str = r#"
// ---------------------------------------------------------------------------------------
// Appended by moeforge's tile-schedule test: every tile of the GEMMs' schedule, written out.
// ---------------------------------------------------------------------------------------
template <int BM, int BN, int N_TILES>
__device__ void probe_tiles(const int* __restrict__ expert_offsets, int* s_tile_start, int* __restrict__ out, int capacity) {
    tile_schedule<BM, N_TILES>(expert_offsets, s_tile_start);
    const int total = s_tile_start[EXPERTS];
    if (threadIdx.x == 0) out[0] = total;
    for (int tile = threadIdx.x; tile < total && tile < capacity; tile += blockDim.x) {
        const GemmTile t = locate_tile<BM, BN>(tile, s_tile_start, expert_offsets);
        int* record = out + 1 + 4 * tile;
        record[0] = t.expert;
        record[1] = t.n0;
        record[2] = t.row0;
        record[3] = t.rows;
    }
}
"#;

/// One instantiation of the schedule: tile rows, tile columns, column tiles.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Config {
    bm: u32,
    bn: u32,
    n_tiles: u32,
}

impl Config {
    fn kernel(&self) -> String {
        format!(
            "moeforge_probe_tiles_{}_{}_{}",
            self.bm, self.bn, self.n_tiles
        )
    }

    fn entry_point(&self) -> String {
        format!(
            "extern \"C\" __global__ void {}(const int* expert_offsets, int* out, int capacity) {{\n    \
             __shared__ int s_tile_start[EXPERTS + 1];\n    \
             probe_tiles<{}, {}, {}>(expert_offsets, s_tile_start, out, capacity);\n}}\n",
            self.kernel(),
            self.bm,
            self.bn,
            self.n_tiles
        )
    }

    /// Records the output buffer holds: the most tiles any schedule of `rows` rows over
    /// EXPERTS experts could need (⌈r/BM⌉ ≤ r/BM + 1), plus a few to catch writes past it.
    fn capacity(&self, total_rows: u32) -> u32 {
        (total_rows / self.bm + EXPERTS) * self.n_tiles + 8
    }
}

fn log(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// A layer with EXPERTS experts whose GEMMs are pinned to one tile, so that its unit has
/// one regime (the probe needs the unit's device functions, not many GEMM kernels).
fn probed_layer() -> Layer {
    let mut layer = layers::tiny(Activation::Relu);
    layer.name = "tile_schedule_probe".into();
    layer.experts = EXPERTS;
    layer.ffn = 192;
    let tile = TileShape {
        m: 32,
        n: 64,
        k: 64,
    };
    layer.schedule = ScheduleHints {
        gemm1_tile: Some(tile),
        gemm2_tile: Some(tile),
        stages: Some(3),
        ..ScheduleHints::default()
    };
    layer
}

/// The plan's own GEMM instantiations, then other tile heights and widths.
fn configs(plan: &Plan) -> Vec<Config> {
    let shape = &plan.shape;
    let from_plan = plan.regimes.iter().flat_map(|r| {
        [
            Config {
                bm: r.gemm1.tile.m,
                bn: r.gemm1.tile.n,
                n_tiles: shape.ffn / r.gemm1.tile.n,
            },
            Config {
                bm: r.gemm2.tile.m,
                bn: r.gemm2.tile.n,
                n_tiles: shape.hidden / r.gemm2.tile.n,
            },
        ]
    });
    let others = [
        Config {
            bm: 16,
            bn: 64,
            n_tiles: 1,
        },
        Config {
            bm: 64,
            bn: 128,
            n_tiles: 2,
        },
        Config {
            bm: 128,
            bn: 64,
            n_tiles: 5,
        },
    ];
    let mut configs = Vec::new();
    for config in from_plan.chain(others) {
        if !configs.contains(&config) {
            configs.push(config);
        }
    }
    configs
}

/// Rows per expert for each routing the test runs, with a name.
fn routings(plan: &Plan) -> Vec<(String, Vec<u32>)> {
    let e = EXPERTS as usize;
    let mut rng = SplitMix64::new(0x7e57);
    let mut random = |max: u32| rng.below(max + 1);
    let mut cases: Vec<(String, Vec<u32>)> = Vec::new();
    cases.push(("no rows at all".into(), vec![0; e]));
    for (name, expert) in [("first", 0), ("a middle", e / 2), ("the last", e - 1)] {
        let mut counts = vec![0; e];
        counts[expert] = 1000;
        cases.push((format!("1000 rows, all on {name} expert"), counts));
    }
    let mut holes: Vec<u32> = (0..e).map(|_| 1 + random(299)).collect();
    for expert in [0, e / 2, e - 1] {
        holes[expert] = 0;
    }
    cases.push(("first, middle and last experts empty".into(), holes));
    cases.push((
        "half the experts empty, at random".into(),
        (0..e)
            .map(|_| if random(1) == 0 { 0 } else { random(200) })
            .collect(),
    ));
    cases.push(("one row per expert".into(), vec![1; e]));
    cases.push(("256 rows per expert (whole tiles)".into(), vec![256; e]));
    cases.push(("257 rows per expert".into(), vec![257; e]));
    let mut hot = vec![0; e];
    hot[5] = 32768;
    hot[6] = 3;
    cases.push(("32768 rows on one expert".into(), hot));
    for routing in [Routing::Uniform, Routing::Skewed, Routing::EmptyExperts] {
        let workload = Workload::random(&plan.shape, 4096, routing, 0xface);
        let mut counts = vec![0; e];
        for &id in &workload.topk_ids {
            counts[id as usize] += 1;
        }
        cases.push((format!("4096 tokens, {routing:?} routing"), counts));
    }
    cases
}

/// What the probe wrote, checked against the rules of the schedule.
fn check_tiles(config: Config, counts: &[u32], out: &[i32]) -> Result<usize, String> {
    let mut offsets = vec![0u32];
    for &c in counts {
        offsets.push(offsets.last().copied().unwrap_or(0) + c);
    }
    let total_rows = offsets[counts.len()];
    let expected: u32 = counts
        .iter()
        .map(|c| c.div_ceil(config.bm) * config.n_tiles)
        .sum();
    let total = out[0];
    if total != expected as i32 {
        return Err(format!(
            "the schedule has {total} tiles; a tight one has {expected}"
        ));
    }
    let records: Vec<&[i32]> = out[1..].chunks_exact(4).collect();
    // covered[n_tile][row]: how many tiles cover it.
    let mut covered = vec![vec![0u32; total_rows as usize]; config.n_tiles as usize];
    for (i, record) in records.iter().enumerate().take(expected as usize) {
        let &[expert, n0, row0, rows] = *record else {
            unreachable!("chunks of 4")
        };
        let fail = |what: &str| {
            Err(format!(
                "tile {i} = (expert {expert}, n0 {n0}, row0 {row0}, rows {rows}): {what}"
            ))
        };
        if !(0..EXPERTS as i32).contains(&expert) {
            return fail("no such expert");
        }
        if !(1..=config.bm as i32).contains(&rows) {
            return fail("rows outside 1..=BM");
        }
        let bn = config.bn as i32;
        if n0 < 0 || n0 % bn != 0 || n0 / bn >= config.n_tiles as i32 {
            return fail("n0 is not the start of a column tile");
        }
        let (begin, end) = (
            offsets[expert as usize] as i32,
            offsets[expert as usize + 1] as i32,
        );
        if row0 < begin || row0 + rows > end {
            return fail(&format!("rows outside the expert's {begin}..{end}"));
        }
        for row in row0..row0 + rows {
            covered[(n0 / bn) as usize][row as usize] += 1;
        }
    }
    for (n_tile, rows) in covered.iter().enumerate() {
        if let Some(row) = rows.iter().position(|&c| c != 1) {
            return Err(format!(
                "row {row} is covered {} times in column tile {n_tile}",
                rows[row]
            ));
        }
    }
    if let Some(i) = records[expected as usize..]
        .iter()
        .position(|r| r.iter().any(|&v| v != UNWRITTEN))
    {
        return Err(format!(
            "record {} past the last tile was written",
            expected as usize + i
        ));
    }
    Ok(expected as usize)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tile_schedule_covers_every_row_once_per_column_tile() {
    let session = Session::open().expect("GPU session");
    let target = session.gpu.target().expect("the device's target");
    let plan = plan::plan(&probed_layer(), &target).expect("the probed layer plans");
    let configs = configs(&plan);
    let mut source = codegen::generate(&plan).expect("codegen").source;
    source.push_str(PROBE_TEMPLATE);
    for config in &configs {
        source.push_str(&config.entry_point());
    }
    // The options `Session::compile` uses for the plan's own unit, under another name.
    let options = CompileOptions {
        name: format!("{}_probe", plan.symbol),
        ..aot::compile_options(&plan)
    };
    let module = session
        .jit
        .compile(&source, &options)
        .expect("the generated unit compiles with the probe");
    let loaded = session.gpu.load(&module).expect("load the probe");
    let stream = &session.gpu.stream;

    let mut failures = Vec::new();
    for config in &configs {
        let function = loaded
            .load_function(&config.kernel())
            .expect("the probe's entry point");
        for (name, counts) in routings(&plan) {
            let mut offsets = vec![0i32];
            for &c in &counts {
                offsets.push(offsets.last().copied().unwrap_or(0) + c as i32);
            }
            let total_rows = counts.iter().sum();
            let capacity = config.capacity(total_rows);
            let offsets_dev = stream.clone_htod(&offsets).expect("upload offsets");
            let mut out_dev = stream
                .clone_htod(&vec![UNWRITTEN; 1 + 4 * capacity as usize])
                .expect("upload the output");
            let capacity_arg = capacity as i32;
            let mut launch = stream.launch_builder(&function);
            launch
                .arg(&offsets_dev)
                .arg(&mut out_dev)
                .arg(&capacity_arg);
            let launch_config = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (PROBE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the probe reads EXPERTS + 1 offsets and writes 1 + 4 · capacity ints,
            // the sizes of the two buffers.
            unsafe { launch.launch(launch_config) }.expect("launch the probe");
            let out = stream.clone_dtoh(&out_dev).expect("download the tiles");
            let label = format!(
                "tile schedule BM={} BN={} N_TILES={}, {name}",
                config.bm, config.bn, config.n_tiles
            );
            match check_tiles(*config, &counts, &out) {
                Ok(tiles) => log(&format!("{label}: {tiles} tiles: ok")),
                Err(error) => {
                    log(&format!("{label}: FAIL: {error}"));
                    failures.push(format!("{label}: {error}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The host-side rules catch what a broken schedule would write (no GPU needed).
#[test]
fn the_host_check_rejects_broken_schedules() {
    let config = Config {
        bm: 16,
        bn: 64,
        n_tiles: 2,
    };
    // Expert 0: 20 rows (2 row tiles), expert 1: none, expert 2: 5 rows (1 row tile).
    let mut counts = vec![0; EXPERTS as usize];
    counts[0] = 20;
    counts[2] = 5;
    let tiles = [
        [0, 0, 0, 16],
        [0, 0, 16, 4],
        [0, 64, 0, 16],
        [0, 64, 16, 4],
        [2, 0, 20, 5],
        [2, 64, 20, 5],
    ];
    let capacity = config.capacity(25) as usize;
    let write = |tiles: &[[i32; 4]], total: i32| -> Vec<i32> {
        let mut out = vec![UNWRITTEN; 1 + 4 * capacity];
        out[0] = total;
        for (i, t) in tiles.iter().enumerate() {
            out[1 + 4 * i..5 + 4 * i].copy_from_slice(t);
        }
        out
    };
    assert_eq!(check_tiles(config, &counts, &write(&tiles, 6)), Ok(6));

    let mut overlapping = tiles;
    overlapping[1] = [0, 0, 15, 4];
    let mut outside = tiles;
    outside[4] = [1, 0, 20, 5];
    let mut wide = tiles;
    wide[5] = [2, 128, 20, 5];
    let mut empty = tiles;
    empty[1] = [0, 0, 16, 0];
    let mut past_the_end = write(&tiles, 6);
    past_the_end[1 + 4 * 6] = 0;
    for (what, out) in [
        ("one tile too many", write(&tiles, 7)),
        ("one tile too few", write(&tiles[..5], 5)),
        ("overlapping rows", write(&overlapping, 6)),
        ("rows of another expert", write(&outside, 6)),
        ("a column tile past N", write(&wide, 6)),
        ("an empty tile", write(&empty, 6)),
        ("a write past the last tile", past_the_end),
    ] {
        assert!(check_tiles(config, &counts, &out).is_err(), "{what}");
    }
}
