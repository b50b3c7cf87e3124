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
    /// Fraction of `peak_bf16_flops` moeforge's wgmma GEMMs reach (0 where there is no wgmma).
    pub wgmma_fraction: f64,
    /// Measured device-memory copy bandwidth (bytes read + written per second).
    pub hbm_bytes_per_s: f64,
    /// Bandwidth from L2 into the SMs' shared memory, summed over SMs (bytes per second).
    /// Not measured here yet: about 2.5x HBM, as reported for Hopper.
    pub l2_bytes_per_s: f64,
    /// Fixed cost of one kernel launch in a stream, seconds.
    pub launch_overhead_s: f64,
}

impl Target {
    /// The H200 of the project's GPU machine: 132 SMs, 227 KiB opt-in shared memory per
    /// block, about 790 TFLOP/s dense bf16 and 4.3 TB/s copy bandwidth, as measured there
    /// (TOOLCHAIN.md). The mma.sync fraction is what moeforge's mma.sync GEMMs reached in
    /// the bench of 2026-11-29 (about 270 TFLOP/s at large T); the wgmma fraction is a lead
    /// until the bench measures it.
    pub fn h200() -> Self {
        Target {
            name: "NVIDIA H200".to_string(),
            arch: "sm_90a".to_string(),
            sm_count: 132,
            smem_per_block: 232_448,
            smem_per_sm: 233_472,
            peak_bf16_flops: 790e12,
            mma_sync_fraction: 0.35,
            wgmma_fraction: 0.6,
            hbm_bytes_per_s: 4.3e12,
            l2_bytes_per_s: 10e12,
            launch_overhead_s: 4e-6,
        }
    }

    /// Whether the target has Hopper's warpgroup MMA (the `a` feature set of sm_90).
    pub fn has_wgmma(&self) -> bool {
        self.arch == "sm_90a"
    }
}
