//! The grouped GEMMs' tile schedule, run on the GPU (ignored by default; run with
//! `--include-ignored` on the GPU machine).
//!
//! The test appends a probe kernel to a plan's generated CUDA unit. The probe calls the
//! very device functions the GEMMs call, `tile_schedule<BM, N_TILES, EXPERTS, PHASES>` and
//! `locate_tile<BM, BN, EXPERTS, PHASES>`, and writes every tile (expert, n0, row0, rows)
//! to a buffer. The host then checks, for expert row counts from many routings (empty
//! first, middle and last experts, everything on one expert, no rows at all), each split
//! into PHASES runs per expert (1, as on one GPU; 3, as the sources of an expert-parallel
//! rank): the tile count is the tight one, Σ_e ⌈rows_e / BM⌉ · N_TILES; every tile has
//! 1..=BM rows inside its expert and an n-tile below N_TILES; every (expert, row) is
//! covered exactly once per n-tile; tiles come in the order of the phase of their last row,
//! and within a phase the shared slices' tiles come before the routed experts'; nothing is
//! written past the last tile.
//!
//! A second probe does the same for cluster pairs (`tile_schedule<…, CLUSTER = 2>` and
//! `locate_pair_tile`, both blocks of every work unit): a unit is two m-tiles of one column
//! tile sharing its weight panel, or two column tiles of an expert's last m-tile (an odd
//! count), and every (expert, row) is still covered once per column tile.

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use moeforge_compiler::codegen;
use moeforge_compiler::ir::{Activation, Layer, ScheduleHints, SharedExperts, TileShape};
use moeforge_compiler::plan::{self, Plan};
use moeforge_runtime::aot;
use moeforge_runtime::harness::Session;
use moeforge_runtime::jit::CompileOptions;
use moeforge_runtime::workload::{Routing, SplitMix64, Workload};

mod layers;

/// Experts of the probed layer's grouped GEMMs, routed then shared slices: more than the
/// 32 lanes of the scan in `tile_schedule`, so that lanes sum runs of several experts, and
/// not a multiple of 32, so that some lanes have none.
const EXPERTS: u32 = ROUTED_EXPERTS + SHARED_SLICES;
/// The probed layer's routed experts, then its shared-expert slices (one shared expert of
/// twice the FFN: two slices), the last experts of the grouped GEMMs.
const ROUTED_EXPERTS: u32 = 70;
const SHARED_SLICES: u32 = 2;
const PROBE_THREADS: u32 = 128;
/// What the probe's output holds before it runs; no field of a real tile is negative.
const UNWRITTEN: i32 = -7;

/// The probe, appended to the generated unit (which defines `GEMM_EXPERTS`, `GemmTile`,
/// `tile_schedule` and `locate_tile`). out[0] = the schedule's tile count; out[1 + 4i ..]
/// = expert, n0, row0 and rows of tile i, for i < capacity.
const PROBE_TEMPLATE: &str = r#"
// ---------------------------------------------------------------------------------------
// Appended by moeforge's tile-schedule test: every tile of the GEMMs' schedule, written out.
// ---------------------------------------------------------------------------------------
template <int BM, int BN, int N_TILES, int PHASES>
__device__ void probe_tiles(const int* __restrict__ row_offsets, int* s_tile_start, int* __restrict__ out, int capacity) {
    tile_schedule<BM, N_TILES, GEMM_EXPERTS, PHASES>(row_offsets, s_tile_start);
    const int total = s_tile_start[GEMM_EXPERTS * PHASES];
    if (threadIdx.x == 0) out[0] = total;
    for (int tile = threadIdx.x; tile < total && tile < capacity; tile += blockDim.x) {
        const GemmTile t = locate_tile<BM, BN, GEMM_EXPERTS, PHASES>(tile, s_tile_start, row_offsets);
        int* record = out + 1 + 4 * tile;
        record[0] = t.expert;
        record[1] = t.n0;
        record[2] = t.row0;
        record[3] = t.rows;
    }
}

// A cluster pair's schedule: per work unit, both blocks' tiles (expert, n0, row0, rows,
// whether they share the weight panel).
constexpr int PAIR_RECORD = 5;
template <int BM, int BN, int N_TILES>
__device__ void probe_pairs(const int* __restrict__ row_offsets, int* s_tile_start, int* __restrict__ out, int capacity) {
    tile_schedule<BM, N_TILES, GEMM_EXPERTS, 1, 2>(row_offsets, s_tile_start);
    const int total = s_tile_start[GEMM_EXPERTS];
    if (threadIdx.x == 0) out[0] = total;
    for (int unit = threadIdx.x; unit < total && unit < capacity; unit += blockDim.x) {
        for (int rank = 0; rank < 2; ++rank) {
            const GemmTile t = locate_pair_tile<BM, BN, N_TILES, GEMM_EXPERTS, 1>(unit, rank, s_tile_start, row_offsets);
            int* record = out + 1 + PAIR_RECORD * (2 * unit + rank);
            record[0] = t.expert;
            record[1] = t.n0;
            record[2] = t.row0;
            record[3] = t.rows;
            record[4] = t.weights_shared;
        }
    }
}
"#;

/// Ints per tile of the pair probe's records.
const PAIR_RECORD: usize = 5;

/// Runs of rows per expert in the phased schedule (as the sources of an expert-parallel
/// rank with three ranks).
const PHASES: u32 = 3;

/// One instantiation of the schedule: tile rows, tile columns, column tiles, and runs of
/// rows per expert.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Config {
    bm: u32,
    bn: u32,
    n_tiles: u32,
    phases: u32,
}

impl Config {
    fn kernel(&self) -> String {
        format!(
            "moeforge_probe_tiles_{}_{}_{}_{}",
            self.bm, self.bn, self.n_tiles, self.phases
        )
    }

    fn entry_point(&self) -> String {
        format!(
            "extern \"C\" __global__ void {}(const int* row_offsets, int* out, int capacity) {{\n    \
             __shared__ int s_tile_start[GEMM_EXPERTS * {} + 1];\n    \
             probe_tiles<{}, {}, {}, {}>(row_offsets, s_tile_start, out, capacity);\n}}\n",
            self.kernel(),
            self.phases,
            self.bm,
            self.bn,
            self.n_tiles,
            self.phases
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

/// A layer with ROUTED_EXPERTS experts and SHARED_SLICES shared slices whose GEMMs are
/// pinned to one tile, so that its unit has one regime (the probe needs the unit's device
/// functions, not many GEMM kernels).
fn probed_layer() -> Layer {
    let mut layer = layers::tiny(Activation::Relu);
    layer.name = "tile_schedule_probe".into();
    layer.experts = ROUTED_EXPERTS;
    layer.ffn = 192;
    layer.shared_experts = Some(SharedExperts {
        count: 1,
        ffn: SHARED_SLICES * layer.ffn,
        gated: false,
    });
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
                phases: 1,
            },
            Config {
                bm: r.gemm2.tile.m,
                bn: r.gemm2.tile.n,
                n_tiles: shape.hidden / r.gemm2.tile.n,
                phases: 1,
            },
        ]
    });
    let others = [
        Config {
            bm: 16,
            bn: 64,
            n_tiles: 1,
            phases: 1,
        },
        Config {
            bm: 64,
            bn: 128,
            n_tiles: 2,
            phases: 1,
        },
        Config {
            bm: 128,
            bn: 64,
            n_tiles: 5,
            phases: 1,
        },
    ];
    let mut configs = Vec::new();
    for config in from_plan.chain(others) {
        for phases in [1, PHASES] {
            let config = Config { phases, ..config };
            if !configs.contains(&config) {
                configs.push(config);
            }
        }
    }
    configs
}

/// Each expert's rows split into `phases` runs (some empty, some not), expert-major: the
/// row counts of the offsets a phased schedule reads.
fn runs_of(counts: &[u32], phases: u32) -> Vec<u32> {
    let mut rng = SplitMix64::new(0x9a5e ^ u64::from(phases));
    let mut runs = Vec::with_capacity(counts.len() * phases as usize);
    for &count in counts {
        let mut left = count;
        for phase in 0..phases {
            let run = if phase + 1 == phases {
                left
            } else {
                match rng.below(4) {
                    0 => 0,
                    1 => left,
                    _ => rng.below(left + 1),
                }
            };
            runs.push(run);
            left -= run;
        }
    }
    runs
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
        // Every token is a row of each shared slice.
        let mut counts = vec![4096; e];
        counts[..ROUTED_EXPERTS as usize].fill(0);
        for &id in &workload.topk_ids {
            counts[id as usize] += 1;
        }
        cases.push((format!("4096 tokens, {routing:?} routing"), counts));
    }
    cases
}

/// What the probe wrote for rows split into `runs` (`config.phases` per expert), checked
/// against the rules of the schedule.
fn check_tiles(config: Config, runs: &[u32], out: &[i32]) -> Result<usize, String> {
    let phases = config.phases as usize;
    let mut run_starts = vec![0u32];
    for &r in runs {
        run_starts.push(run_starts.last().copied().unwrap_or(0) + r);
    }
    let offsets: Vec<u32> = run_starts.iter().step_by(phases).copied().collect();
    let counts: Vec<u32> = runs.chunks(phases).map(|c| c.iter().sum()).collect();
    let total_rows = offsets[counts.len()];
    // The phase of a row: the run holding it, counted within its expert.
    let phase_of = |row: u32| (run_starts.partition_point(|&start| start <= row) - 1) % phases;
    // (phase, whether routed) of the last tile: never decreasing.
    let mut last_place = (0, false);
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
        let place = (
            phase_of((row0 + rows - 1) as u32),
            expert < ROUTED_EXPERTS as i32,
        );
        if place < last_place {
            return fail(&format!(
                "its last row is in phase {} ({}), after a tile in phase {} ({})",
                place.0,
                if place.1 { "routed" } else { "shared slice" },
                last_place.0,
                if last_place.1 {
                    "routed"
                } else {
                    "shared slice"
                },
            ));
        }
        last_place = place;
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

/// The probed layer's generated unit with the probe and `entry_points` appended, compiled
/// (with the options `Session::compile` uses for the plan's own unit, under another name)
/// and loaded.
fn load_probe(
    session: &Session,
    plan: &Plan,
    entry_points: &[String],
    name: &str,
) -> Arc<CudaModule> {
    let mut source = codegen::generate(plan).expect("codegen").source;
    source.push_str(PROBE_TEMPLATE);
    for entry_point in entry_points {
        source.push_str(entry_point);
    }
    let options = CompileOptions {
        name: format!("{}_{name}", plan.symbol),
        ..aot::compile_options(plan)
    };
    let module = session
        .jit
        .compile(&source, &options)
        .expect("the generated unit compiles with the probe");
    session.gpu.load(&module).expect("load the probe")
}

/// Runs probe `function` on one block over `offsets` with room for `capacity` records of
/// `record_ints` each, and returns what it wrote (the count, then the records).
fn run_probe(
    session: &Session,
    function: &CudaFunction,
    offsets: &[i32],
    capacity: u32,
    record_ints: usize,
) -> Vec<i32> {
    let stream = &session.gpu.stream;
    let offsets_dev = stream.clone_htod(offsets).expect("upload offsets");
    let mut out_dev = stream
        .clone_htod(&vec![UNWRITTEN; 1 + record_ints * capacity as usize])
        .expect("upload the output");
    let capacity_arg = capacity as i32;
    let mut launch = stream.launch_builder(function);
    launch
        .arg(&offsets_dev)
        .arg(&mut out_dev)
        .arg(&capacity_arg);
    let launch_config = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (PROBE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the probe reads at most offsets.len() offsets (EXPERTS · phases + 1) and writes
    // at most 1 + record_ints · capacity ints, the sizes of the two buffers.
    unsafe { launch.launch(launch_config) }.expect("launch the probe");
    stream.clone_dtoh(&out_dev).expect("download the records")
}

/// Logs one probed case (`count` records of `what`, or why it failed) and keeps a failure.
fn note_case(label: &str, what: &str, checked: Result<usize, String>, failures: &mut Vec<String>) {
    match checked {
        Ok(count) => log(&format!("{label}: {count} {what}: ok")),
        Err(error) => {
            log(&format!("{label}: FAIL: {error}"));
            failures.push(format!("{label}: {error}"));
        }
    }
}

fn assert_none_failed(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} failing cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Prefix sums of `counts`, from 0: the row offsets a probe reads.
fn offsets_of(counts: &[u32]) -> Vec<i32> {
    let mut offsets = vec![0i32];
    for &c in counts {
        offsets.push(offsets.last().copied().unwrap_or(0) + c as i32);
    }
    offsets
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tile_schedule_covers_every_row_once_per_column_tile() {
    let session = Session::open().expect("GPU session");
    let target = session.gpu.target().expect("the device's target");
    let plan = plan::plan(&probed_layer(), &target).expect("the probed layer plans");
    let configs = configs(&plan);
    let entry_points: Vec<String> = configs.iter().map(Config::entry_point).collect();
    let loaded = load_probe(&session, &plan, &entry_points, "probe");
    let mut failures = Vec::new();
    for config in &configs {
        let function = loaded
            .load_function(&config.kernel())
            .expect("the probe's entry point");
        for (name, counts) in routings(&plan) {
            let runs = runs_of(&counts, config.phases);
            let capacity = config.capacity(counts.iter().sum());
            let out = run_probe(&session, &function, &offsets_of(&runs), capacity, 4);
            let label = format!(
                "tile schedule BM={} BN={} N_TILES={} PHASES={}, {name}",
                config.bm, config.bn, config.n_tiles, config.phases
            );
            note_case(
                &label,
                "tiles",
                check_tiles(*config, &runs, &out),
                &mut failures,
            );
        }
    }
    assert_none_failed(&failures);
}

/// What a probe of `capacity` records would hold after writing `tiles` and a count of
/// `total`.
fn probe_output(capacity: u32, tiles: &[[i32; 4]], total: i32) -> Vec<i32> {
    let mut out = vec![UNWRITTEN; 1 + 4 * capacity as usize];
    out[0] = total;
    for (i, t) in tiles.iter().enumerate() {
        out[1 + 4 * i..5 + 4 * i].copy_from_slice(t);
    }
    out
}

/// The host-side rules catch what a broken schedule would write (no GPU needed).
#[test]
fn the_host_check_rejects_broken_schedules() {
    let config = Config {
        bm: 16,
        bn: 64,
        n_tiles: 2,
        phases: 1,
    };
    // Expert 0: 20 rows (2 row tiles), expert 1: none, expert 2: 5 rows (1 row tile); the
    // last shared slice: 3 rows (1 row tile), first in the order.
    let shared = EXPERTS as i32 - 1;
    let mut counts = vec![0; EXPERTS as usize];
    counts[0] = 20;
    counts[2] = 5;
    counts[shared as usize] = 3;
    let tiles = [
        [shared, 0, 25, 3],
        [shared, 64, 25, 3],
        [0, 0, 0, 16],
        [0, 0, 16, 4],
        [0, 64, 0, 16],
        [0, 64, 16, 4],
        [2, 0, 20, 5],
        [2, 64, 20, 5],
    ];
    let write = |tiles: &[[i32; 4]], total: i32| probe_output(config.capacity(28), tiles, total);
    assert_eq!(check_tiles(config, &counts, &write(&tiles, 8)), Ok(8));

    let mut overlapping = tiles;
    overlapping[3] = [0, 0, 15, 4];
    let mut outside = tiles;
    outside[6] = [1, 0, 20, 5];
    let mut wide = tiles;
    wide[7] = [2, 128, 20, 5];
    let mut empty = tiles;
    empty[3] = [0, 0, 16, 0];
    let mut shared_last = tiles;
    shared_last.rotate_left(2);
    let mut past_the_end = write(&tiles, 8);
    past_the_end[1 + 4 * 8] = 0;
    for (what, out) in [
        ("one tile too many", write(&tiles, 9)),
        ("one tile too few", write(&tiles[..7], 7)),
        ("overlapping rows", write(&overlapping, 8)),
        ("rows of another expert", write(&outside, 8)),
        ("a column tile past N", write(&wide, 8)),
        ("an empty tile", write(&empty, 8)),
        (
            "a shared slice's tiles after a routed expert's",
            write(&shared_last, 8),
        ),
        ("a write past the last tile", past_the_end),
    ] {
        assert!(check_tiles(config, &counts, &out).is_err(), "{what}");
    }

    // Two phases: expert 0 has 20 rows then 5 (its second row tile ends in phase 1),
    // expert 2 has 5 rows in phase 0 only: both of its tiles come before expert 0's
    // second row tile.
    let phased = Config {
        phases: 2,
        ..config
    };
    let mut runs = vec![0; 2 * EXPERTS as usize];
    runs[0] = 20;
    runs[1] = 5;
    runs[4] = 5;
    let in_order = [
        [0, 0, 0, 16],
        [0, 64, 0, 16],
        [2, 0, 25, 5],
        [2, 64, 25, 5],
        [0, 0, 16, 9],
        [0, 64, 16, 9],
    ];
    let write = |tiles: &[[i32; 4]]| probe_output(phased.capacity(30), tiles, tiles.len() as i32);
    assert_eq!(check_tiles(phased, &runs, &write(&in_order)), Ok(6));
    let mut out_of_order = in_order;
    out_of_order.swap(2, 4);
    assert!(
        check_tiles(phased, &runs, &write(&out_of_order)).is_err(),
        "a tile waiting for phase 1 before one of phase 0"
    );
}

/// A cluster pair's schedule: tile rows, tile columns and column tiles (one run of rows per
/// expert: pairs run on one GPU).
#[derive(Clone, Copy, Debug, PartialEq)]
struct PairConfig {
    bm: u32,
    bn: u32,
    n_tiles: u32,
}

impl PairConfig {
    fn kernel(&self) -> String {
        format!(
            "moeforge_probe_pairs_{}_{}_{}",
            self.bm, self.bn, self.n_tiles
        )
    }

    fn entry_point(&self) -> String {
        format!(
            "extern \"C\" __global__ void {}(const int* row_offsets, int* out, int capacity) {{\n    \
             __shared__ int s_tile_start[GEMM_EXPERTS + 1];\n    \
             probe_pairs<{}, {}, {}>(row_offsets, s_tile_start, out, capacity);\n}}\n",
            self.kernel(),
            self.bm,
            self.bn,
            self.n_tiles
        )
    }

    /// Units the output holds: at most one per tile of any schedule of `rows` rows, plus a
    /// few to catch writes past it.
    fn capacity(&self, total_rows: u32) -> u32 {
        (total_rows / self.bm + EXPERTS) * self.n_tiles + 8
    }

    /// Work units of an expert of `rows` rows, stated here as the schedule means it: each
    /// pair of m-tiles shares a weight panel, one unit per column tile; the last m-tile of
    /// an odd count runs alone, its column tiles two at a time.
    fn units(&self, rows: u32) -> u32 {
        let m_tiles = rows.div_ceil(self.bm);
        m_tiles / 2 * self.n_tiles + m_tiles % 2 * self.n_tiles.div_ceil(2)
    }
}

/// What the pair probe wrote for `counts` rows per expert, checked against the rules: the
/// unit count; in a unit sharing a weight panel, two consecutive m-tiles of one expert and
/// column tile, both with rows; otherwise two column tiles of the expert's last m-tile,
/// the second empty past the last column tile; every (expert, row) once per column tile;
/// nothing past the last unit.
fn check_pairs(config: PairConfig, counts: &[u32], out: &[i32]) -> Result<usize, String> {
    let mut offsets = vec![0u32];
    for &c in counts {
        offsets.push(offsets.last().copied().unwrap_or(0) + c);
    }
    let expected: u32 = counts.iter().map(|&c| config.units(c)).sum();
    if out[0] != expected as i32 {
        return Err(format!(
            "the schedule has {} units; the rule gives {expected}",
            out[0]
        ));
    }
    let (bm, bn) = (config.bm as i32, config.bn as i32);
    let records: Vec<&[i32]> = out[1..].chunks_exact(PAIR_RECORD).collect();
    let mut covered = vec![vec![0u32; offsets[counts.len()] as usize]; config.n_tiles as usize];
    for unit in 0..expected as usize {
        let (a, b) = (records[2 * unit], records[2 * unit + 1]);
        let fail = |what: &str| Err(format!("unit {unit} = {a:?}, {b:?}: {what}"));
        if a[0] != b[0] || a[4] != b[4] || a[3] < 1 {
            return fail("not one expert, or a first tile without rows");
        }
        let rows_ok = |t: &[i32]| {
            let expert = t[0] as usize;
            expert < counts.len()
                && t[2] >= offsets[expert] as i32
                && t[2] + t[3] <= offsets[expert + 1] as i32
                && (0..=bm).contains(&t[3])
                && t[1] % bn == 0
                && t[1] / bn < config.n_tiles as i32
        };
        if !rows_ok(a) || !rows_ok(b) {
            return fail("rows outside the expert, or a column tile past N");
        }
        let shared = a[4] != 0;
        if shared && (a[1] != b[1] || b[2] != a[2] + bm || b[3] < 1) {
            return fail("a shared panel that is not two m-tiles of one column tile");
        }
        let last_m_tile = a[2] + a[3] == offsets[a[0] as usize + 1] as i32;
        if !shared && (a[2] != b[2] || !last_m_tile || (b[3] > 0 && b[1] != a[1] + bn)) {
            return fail("tiles alone that are not two column tiles of the last m-tile");
        }
        for t in [a, b] {
            for row in t[2]..t[2] + t[3] {
                covered[(t[1] / bn) as usize][row as usize] += 1;
            }
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
    if records[2 * expected as usize..]
        .iter()
        .any(|r| r.iter().any(|&v| v != UNWRITTEN))
    {
        return Err("a record past the last unit was written".into());
    }
    Ok(expected as usize)
}

/// Rows per expert that leave the last m-tile of 128-row tiles full, nearly empty or in
/// between, at odd and even counts of m-tiles, with empty experts between.
fn rows_around_tile_edges() -> Vec<u32> {
    const EDGES: [u32; 12] = [
        0,
        1,
        64,
        65,
        128,
        129,
        192,
        193,
        200,
        384 + 5,
        448,
        4 * 128 + 100,
    ];
    (0..EXPERTS as usize)
        .map(|e| EDGES[e % EDGES.len()])
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cluster_pairs_cover_every_row_once_per_column_tile() {
    let session = Session::open().expect("GPU session");
    let target = session.gpu.target().expect("the device's target");
    let plan = plan::plan(&probed_layer(), &target).expect("the probed layer plans");
    let configs = [
        PairConfig {
            bm: 128,
            bn: 64,
            n_tiles: 5,
        },
        PairConfig {
            bm: 128,
            bn: 128,
            n_tiles: 2,
        },
        PairConfig {
            bm: 128,
            bn: 256,
            n_tiles: 1,
        },
    ];
    let entry_points: Vec<String> = configs.iter().map(PairConfig::entry_point).collect();
    let loaded = load_probe(&session, &plan, &entry_points, "pair_probe");
    let mut cases = routings(&plan);
    cases.push((
        "rows around the tiles' edges".into(),
        rows_around_tile_edges(),
    ));
    let mut failures = Vec::new();
    for config in &configs {
        let function = loaded
            .load_function(&config.kernel())
            .expect("the probe's entry point");
        for (name, counts) in &cases {
            let capacity = config.capacity(counts.iter().sum());
            let out = run_probe(
                &session,
                &function,
                &offsets_of(counts),
                capacity,
                2 * PAIR_RECORD,
            );
            let label = format!(
                "cluster pairs BM={} BN={} N_TILES={}, {name}",
                config.bm, config.bn, config.n_tiles
            );
            note_case(
                &label,
                "units",
                check_pairs(*config, counts, &out),
                &mut failures,
            );
        }
    }
    assert_none_failed(&failures);
}

/// The host-side pair rules catch a broken pair schedule (no GPU needed).
#[test]
fn the_pair_check_rejects_broken_pair_schedules() {
    let config = PairConfig {
        bm: 128,
        bn: 64,
        n_tiles: 2,
    };
    // Expert 0: 130 rows (m-tiles of 128 and 2: a pair on each column tile); expert 1:
    // 3 rows (one m-tile, alone, both column tiles in one unit); the rest empty.
    let mut counts = vec![0; EXPERTS as usize];
    counts[0] = 130;
    counts[1] = 3;
    let write = |units: &[[[i32; PAIR_RECORD]; 2]], total: i32| {
        let mut out = vec![UNWRITTEN; 1 + 2 * PAIR_RECORD * config.capacity(133) as usize];
        out[0] = total;
        for (i, tile) in units.iter().flatten().enumerate() {
            out[1 + PAIR_RECORD * i..1 + PAIR_RECORD * (i + 1)].copy_from_slice(tile);
        }
        out
    };
    let units = [
        [[0, 0, 0, 128, 1], [0, 0, 128, 2, 1]],
        [[0, 64, 0, 128, 1], [0, 64, 128, 2, 1]],
        [[1, 0, 130, 3, 0], [1, 64, 130, 3, 0]],
    ];
    assert_eq!(check_pairs(config, &counts, &write(&units, 3)), Ok(3));
    let mut not_consecutive = units;
    not_consecutive[0][1][1] = 64;
    let mut first_m_tile_alone = units;
    first_m_tile_alone[0] = [[0, 0, 0, 128, 0], [0, 64, 0, 128, 0]];
    first_m_tile_alone[1] = [[0, 0, 128, 2, 0], [0, 64, 128, 2, 0]];
    let mut past_the_end = write(&units, 3);
    past_the_end[1 + 2 * PAIR_RECORD * 3] = 0;
    for (what, out) in [
        ("one unit too many", write(&units, 4)),
        (
            "a shared panel over two column tiles",
            write(&not_consecutive, 3),
        ),
        ("a first m-tile alone", write(&first_m_tile_alone, 3)),
        ("a write past the last unit", past_the_end),
    ] {
        assert!(check_pairs(config, &counts, &out).is_err(), "{what}");
    }
}
