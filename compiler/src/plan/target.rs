//! Facts about the GPU a plan is made for. The planner reads them; nothing here is guessed
//! at run time.

use serde::{Deserialize, Serialize};

/// The device a plan targets, with the ceilings the cost model divides by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub name: String,
    /// NVRTC architecture, e.g. `sm_90a`.
    pub arch: String,
    pub sm_count: u32,
    /// Largest dynamic shared memory one block may opt in to, in bytes.
    pub smem_per_block: u32,
    /// Shared memory of one SM, in bytes (bounds blocks per SM).
    pub smem_per_sm: u32,
    /// Measured dense bf16 tensor-core rate (wgmma), FLOP/s.
    pub peak_bf16_flops: f64,
    /// Fraction of `peak_bf16_flops` moeforge's `mma.sync` GEMMs reach on this chip.
    pub mma_sync_fraction: f64,
    /// Fraction of `peak_bf16_flops` moeforge's wgmma GEMMs reach at the widest tile (256
    /// columns) with two consumer warpgroups (0 where there is no wgmma).
    pub wgmma_fraction: f64,
    /// Measured device-memory copy bandwidth (bytes read + written per second).
    pub hbm_bytes_per_s: f64,
    /// Bandwidth from L2 into the SMs' shared memory, summed over SMs (bytes per second).
    /// Not measured here yet: about 2.5x HBM, as reported for Hopper.
    pub l2_bytes_per_s: f64,
    /// Fixed cost of one kernel launch in a stream, seconds.
    pub launch_overhead_s: f64,
    /// Device memory, bytes (the datasheet's), against which `explain` sets what a rank
    /// holds.
    #[serde(default)]
    pub memory_bytes: u64,
    /// Thread-block clusters of 1 to 8 blocks (index: blocks - 1) that run at once when one
    /// block fits an SM (first row) or two do (second row), as the driver reports them
    /// (`cuOccupancyMaxActiveClusters`, `benches/cluster_occupancy.py`). A cluster's blocks
    /// share a GPC, so where a cluster's size does not divide a GPC's SMs fewer run than the
    /// SMs divided by the size. Zeros: not measured, taken as that quotient
    /// ([`Target::clusters_at_once`]).
    #[serde(default)]
    pub clusters_at_once: [[u32; 8]; 2],
    /// SM clock the kernels' `clock64` counts at (Hz, the boost clock): what turns a time
    /// bound into the cycles a flag wait compares against.
    #[serde(default = "h200_clock_hz")]
    pub clock_hz: f64,
    /// Whether GEMM1, run right behind a fused router (a self-routed call), starts early
    /// beside it (its blocks resident as soon as the router's have waited for the kernel
    /// ahead) rather than as the router's blocks finish: a measured fact about moeforge's
    /// kernels on this GPU
    /// ([`RouterRegime::gemm1_starts_early`](super::router::RouterRegime::gemm1_starts_early)).
    #[serde(default = "starts_early_by_default")]
    pub early_gemm1_behind_fused_router: bool,
}

/// Plans written before [`Target::early_gemm1_behind_fused_router`] and
/// [`RouterRegime::gemm1_starts_early`](super::router::RouterRegime::gemm1_starts_early)
/// started GEMM1 early behind every router.
pub(super) fn starts_early_by_default() -> bool {
    true
}

/// The H200's boost clock, 1.98 GHz (the H100 SXM's too).
fn h200_clock_hz() -> f64 {
    1.98e9
}

impl Target {
    /// The H200 of the project's GPU machine: 132 SMs, 227 KiB opt-in shared memory per
    /// block, about 790 TFLOP/s dense bf16 and 4.3 TB/s copy bandwidth, as measured there
    /// (TOOLCHAIN.md). The mma.sync fraction is what moeforge's mma.sync GEMMs reached in
    /// the bench of 2026-11-29 (about 270 TFLOP/s at large T); the wgmma fraction is set so
    /// that with the cost model's width factor it gives what the warp-specialised engine
    /// reached on Mixtral-8x7B at 16384 tokens (0.69 of peak, 543 TFLOP/s, 2026-11-30,
    /// tiles 128 wide gated and 256 wide).
    pub fn h200() -> Self {
        Target {
            name: "NVIDIA H200".to_string(),
            arch: "sm_90a".to_string(),
            sm_count: 132,
            smem_per_block: 232_448,
            smem_per_sm: 233_472,
            peak_bf16_flops: 790e12,
            mma_sync_fraction: 0.35,
            wgmma_fraction: 0.75,
            hbm_bytes_per_s: 4.3e12,
            l2_bytes_per_s: 10e12,
            launch_overhead_s: 4e-6,
            memory_bytes: 141_000_000_000,
            // Measured on the project's H200 (2026-12-03): 15 clusters of 8 where 132 SMs
            // would hold 16. Another die may differ by a cluster or two.
            clusters_at_once: [
                [132, 66, 39, 30, 22, 17, 15, 15],
                [264, 132, 79, 62, 47, 39, 32, 30],
            ],
            clock_hz: h200_clock_hz(),
            // Not yet measured against GEMM1 starting as the router finishes on an H200
            // (on the H100 starting early lost).
            early_gemm1_behind_fused_router: true,
        }
    }

    /// An H100 SXM: the H200's SMs, clocks and shared memory with HBM3 at 3.35 TB/s. Its
    /// ceilings are the H200's measured compute and the datasheet bandwidth scaled by the
    /// H200's measured fraction of its own; not measured on an H100 (its clusters neither:
    /// the SMs' quotient). Its GEMM1 behind a fused router starts as the router's blocks
    /// finish: started early beside them it cost self-routed decode calls up to 3.3%
    /// (Mixtral-8x7B at 64 tokens 959-964 against 928-932 µs) and was never faster beyond
    /// the noise (`benches/results/2026-12-06_h100_early_start_by_launch.md`). The cost
    /// follows the decode GEMM1's 16-row tiles, likely their L2 hits on weights two blocks
    /// share, which early placement upsets; 32-row tiles did not pay it
    /// (`benches/results/2026-12-06_tail_placement.md`).
    pub fn h100() -> Self {
        Target {
            name: "NVIDIA H100 SXM".to_string(),
            hbm_bytes_per_s: 4.3e12 * 3.35 / 4.8,
            memory_bytes: 80_000_000_000,
            clusters_at_once: [[0; 8]; 2],
            early_gemm1_behind_fused_router: false,
            ..Target::h200()
        }
    }

    /// An A100 SXM (sm_80: mma.sync only, 164 KiB of shared memory per SM). Ceilings are
    /// datasheet figures (312 TFLOP/s dense bf16, 2.0 TB/s), not measured here.
    pub fn a100() -> Self {
        Target {
            name: "NVIDIA A100 SXM".to_string(),
            arch: "sm_80".to_string(),
            sm_count: 108,
            smem_per_block: 166_912,
            smem_per_sm: 167_936,
            peak_bf16_flops: 312e12,
            mma_sync_fraction: 0.6,
            wgmma_fraction: 0.0,
            hbm_bytes_per_s: 2.0e12,
            l2_bytes_per_s: 5e12,
            launch_overhead_s: 4e-6,
            memory_bytes: 80_000_000_000,
            clusters_at_once: [[0; 8]; 2],
            // The A100's boost clock.
            clock_hz: 1.41e9,
            // No programmatic dependent launch before sm_90: nothing starts early.
            early_gemm1_behind_fused_router: true,
        }
    }

    /// The targets `--target` accepts, by name; the first is the default.
    pub fn known() -> [(&'static str, Target); 3] {
        [
            ("h200", Target::h200()),
            ("h100", Target::h100()),
            ("a100", Target::a100()),
        ]
    }

    /// The known target called `name` (case-insensitive).
    pub fn named(name: &str) -> Option<Target> {
        Target::known()
            .into_iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(name))
            .map(|(_, target)| target)
    }

    /// The known target of the chip a device name (`NVIDIA H100 80GB HBM3`, as the driver
    /// or a bench file spells it) names, if any.
    pub fn known_for_device_name(device_name: &str) -> Option<Target> {
        Target::known()
            .into_iter()
            .map(|(_, target)| target)
            .find(|t| device_name.contains(t.name.trim_end_matches(" SXM")))
    }

    /// The target for a device read at run time: its own SM count and shared-memory limits,
    /// with the ceilings of the known target of the same architecture (the H200's when none
    /// is known) scaled by the SM count. A known chip gets its known target exactly.
    pub fn for_device(device: &DeviceFacts) -> Target {
        if let Some(exact) = Target::known_for_device_name(&device.name).filter(|t| {
            t.arch == device.arch
                && t.sm_count == device.sm_count
                && t.smem_per_block == device.smem_per_block
        }) {
            return exact;
        }
        let known = Target::known().map(|(_, t)| t);
        let base = known
            .iter()
            .find(|t| t.arch == device.arch)
            .cloned()
            .unwrap_or_else(Target::h200);
        let scale = f64::from(device.sm_count) / f64::from(base.sm_count);
        Target {
            name: device.name.clone(),
            arch: device.arch.clone(),
            sm_count: device.sm_count,
            smem_per_block: device.smem_per_block,
            smem_per_sm: device.smem_per_sm,
            peak_bf16_flops: base.peak_bf16_flops * scale,
            wgmma_fraction: if device.arch == "sm_90a" {
                base.wgmma_fraction
            } else {
                0.0
            },
            clusters_at_once: [[0; 8]; 2],
            ..base
        }
    }

    /// Clusters of `blocks` blocks (1 to 8) that run at once with `blocks_per_sm` blocks
    /// per SM (1, or 2 and more, which count as 2): the measured table, else the SMs'
    /// quotient; 0 for clusters of more than 8 blocks.
    pub fn clusters_at_once(&self, blocks: u32, blocks_per_sm: u32) -> u32 {
        let row = usize::from(blocks_per_sm >= 2);
        match blocks
            .checked_sub(1)
            .and_then(|i| self.clusters_at_once[row].get(i as usize))
        {
            Some(&0) => self.sm_count * blocks_per_sm.clamp(1, 2) / blocks,
            Some(&measured) => measured,
            None => 0,
        }
    }

    /// Why a plan made for `self` cannot run on `device`, if it cannot: the kernels were
    /// compiled for one architecture, and grids and shared memory sized for one chip.
    pub fn mismatch(&self, device: &DeviceFacts) -> Option<String> {
        if self.arch != device.arch {
            return Some(format!(
                "it was made for {} ({}), the device is {} ({})",
                self.name, self.arch, device.name, device.arch
            ));
        }
        if self.sm_count != device.sm_count || self.smem_per_block > device.smem_per_block {
            return Some(format!(
                "it was made for {} SMs and {} B of shared memory per block, the device ({}) has {} SMs and {} B",
                self.sm_count,
                self.smem_per_block,
                device.name,
                device.sm_count,
                device.smem_per_block
            ));
        }
        None
    }

    /// Whether the target has Hopper's warpgroup MMA (the `a` feature set of sm_90).
    pub fn has_wgmma(&self) -> bool {
        self.arch == "sm_90a"
    }

    /// Whether kernels can start before the one ahead of them in the stream has finished
    /// (programmatic stream serialization and `griddepcontrol`, sm_90 and later).
    pub fn has_programmatic_launch(&self) -> bool {
        self.arch_version().is_some_and(|version| version >= 90)
    }

    /// Whether blocks can run in thread-block clusters with distributed shared memory
    /// (`__cluster_dims__`, `mapa`, `barrier.cluster`: sm_90 and later).
    pub fn has_clusters(&self) -> bool {
        self.arch_version().is_some_and(|version| version >= 90)
    }

    /// The architecture's number: 90 for `sm_90a`.
    fn arch_version(&self) -> Option<u32> {
        self.arch.strip_prefix("sm_").and_then(|v| {
            v.trim_end_matches(|c: char| c.is_ascii_alphabetic())
                .parse::<u32>()
                .ok()
        })
    }
}

/// What the runtime reads off a GPU to plan for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    pub name: String,
    /// `sm_XY`, with the `a` suffix on sm_90 (wgmma and setmaxnreg need it).
    pub arch: String,
    pub sm_count: u32,
    /// Largest dynamic shared memory one block may opt in to, bytes.
    pub smem_per_block: u32,
    pub smem_per_sm: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200_facts() -> DeviceFacts {
        let h200 = Target::h200();
        DeviceFacts {
            name: "NVIDIA H200".into(),
            arch: h200.arch,
            sm_count: h200.sm_count,
            smem_per_block: h200.smem_per_block,
            smem_per_sm: h200.smem_per_sm,
        }
    }

    #[test]
    fn a_known_device_gets_its_known_target() {
        assert_eq!(Target::for_device(&h200_facts()), Target::h200());
        assert_eq!(Target::h200().mismatch(&h200_facts()), None);
    }

    #[test]
    fn an_unknown_device_keeps_its_own_limits() {
        let facts = DeviceFacts {
            name: "NVIDIA H20".into(),
            sm_count: 78,
            ..h200_facts()
        };
        let target = Target::for_device(&facts);
        assert_eq!((target.sm_count, target.name.as_str()), (78, "NVIDIA H20"));
        assert!(target.peak_bf16_flops < Target::h200().peak_bf16_flops);
        assert!(Target::h200().mismatch(&facts).is_some());
    }

    #[test]
    fn another_architecture_is_a_mismatch() {
        let facts = DeviceFacts {
            arch: "sm_80".into(),
            ..h200_facts()
        };
        let why = Target::h200().mismatch(&facts).expect("a mismatch");
        assert!(why.contains("sm_80"), "{why}");
        assert_eq!(Target::named("A100"), Some(Target::a100()));
        assert_eq!(Target::named("b200"), None);
    }
}
