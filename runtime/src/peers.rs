//! In-run peers for `moeforge bench --peers`: the PyTorch pipeline and the vLLM-style
//! Triton fused-MoE pair of `benches/single_gpu_peers.py` (built into this crate), run by
//! `python3` on the same GPU, the same layer shapes and the same routing as moeforge's
//! rows (each token count's first timed input, written to files), their times read back
//! from the script's JSON.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use moeforge_compiler::ir::Activation;
use moeforge_compiler::plan::LayerShape;
use serde::{Deserialize, Serialize};

use crate::bench::rotated_workloads;
use crate::workload::Routing;

/// The script, as this build carries it.
const SCRIPT: &str = include_str!("../../benches/single_gpu_peers.py");
/// The script's exit status when torch, triton or a CUDA device is missing.
const UNAVAILABLE: i32 = 77;

/// One token count's peers, µs per call (none at zero tokens).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerRow {
    pub tokens: u32,
    pub torch_us: Option<f64>,
    pub triton_us: Option<f64>,
    /// The Triton pair with its alignment done before the timed calls.
    pub triton_no_align_us: Option<f64>,
    /// The Triton block shape that was fastest at this token count.
    pub triton_config: Option<String>,
    /// The Triton pair's output against the torch pipeline's: max error over max |y|.
    pub agree: Option<f64>,
}

/// What the script reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerReport {
    pub torch: String,
    pub triton: String,
    /// `grouped_mm`, or `mm_loop` where torch._grouped_mm is missing or wrong.
    pub gemm_backend: String,
    pub notes: Vec<String>,
    pub rows: Vec<PeerRow>,
}

impl PeerReport {
    pub fn row(&self, tokens: u32) -> Option<&PeerRow> {
        self.rows.iter().find(|r| r.tokens == tokens)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PeersError {
    #[error(
        "the peers need an activation they implement (SwiGLU or GPT-OSS's clamped SwiGLU), not {0:?}"
    )]
    Activation(Activation),
    #[error("{what} `{}`: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start python3 (the peers need python3 with torch and triton): {0}")]
    Python(std::io::Error),
    #[error(
        "the peers did not run: python3 lacks torch or triton, or sees no CUDA device (its message is above)"
    )]
    Unavailable,
    #[error("the peers' script failed ({0}; its messages are above)")]
    Script(String),
    #[error("the peers' JSON `{}`: {source}", path.display())]
    Output {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Times the peers at `tokens` on `shape` (routing and seed as moeforge's bench rows use),
/// `calls` back-to-back calls per pass (the script's docstring says how that differs from
/// moeforge's per-call timing). Works in a fresh, private temporary folder, removed after,
/// also on an error or a panic.
pub fn run_peers(
    shape: &LayerShape,
    tokens: &[u32],
    routing: Routing,
    seed: u64,
    calls: usize,
) -> Result<PeerReport, PeersError> {
    let activation = match shape.activation {
        Activation::Swiglu => "swiglu",
        Activation::ClampedSwiglu => "gpt_oss_swiglu",
        other => return Err(PeersError::Activation(other)),
    };
    // A folder of its own (unpredictable name, owner-only) so no other user can swap the
    // script python3 runs; dropping it removes the routing files, tens of MB at large T.
    let folder = tempfile::Builder::new()
        .prefix("moeforge-peers-")
        .tempdir()
        .map_err(io("creating", &std::env::temp_dir()))?;
    run_in(
        folder.path(),
        shape,
        tokens,
        routing,
        seed,
        calls,
        activation,
    )
}

fn run_in(
    folder: &Path,
    shape: &LayerShape,
    tokens: &[u32],
    routing: Routing,
    seed: u64,
    calls: usize,
    activation: &str,
) -> Result<PeerReport, PeersError> {
    for &t in tokens {
        let workload = rotated_workloads(shape, t, routing, seed).swap_remove(0);
        let ids: Vec<u8> = workload
            .topk_ids
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let weights: Vec<u8> = workload
            .topk_weights
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let ids_path = folder.join(format!("topk_ids_{t}.i32"));
        std::fs::write(&ids_path, ids).map_err(io("writing", &ids_path))?;
        let weights_path = folder.join(format!("topk_weights_{t}.f32"));
        std::fs::write(&weights_path, weights).map_err(io("writing", &weights_path))?;
    }
    let script = folder.join("single_gpu_peers.py");
    std::fs::write(&script, SCRIPT).map_err(io("writing", &script))?;
    let json = folder.join("peers.json");
    let token_list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    // The script's progress and messages go straight to the user's terminal.
    let status = Command::new("python3")
        .arg(&script)
        .args(["--hidden", &shape.hidden.to_string()])
        .args(["--ffn", &shape.ffn.to_string()])
        .args(["--experts", &shape.experts.to_string()])
        .args(["--top-k", &shape.top_k.to_string()])
        .args(["--shared-slices", &shape.shared_slices.to_string()])
        .args(["--activation", activation])
        .args(["--tokens", &token_list.join(",")])
        .arg("--routing-dir")
        .arg(folder)
        .args(["--calls", &calls.to_string()])
        .args(["--seed", &seed.to_string()])
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .map_err(PeersError::Python)?;
    match status.code() {
        Some(0) => {}
        Some(UNAVAILABLE) => return Err(PeersError::Unavailable),
        _ => return Err(PeersError::Script(status.to_string())),
    }
    let text = std::fs::read_to_string(&json).map_err(io("reading", &json))?;
    serde_json::from_str(&text).map_err(|source| PeersError::Output { path: json, source })
}

/// The error for `what` (creating, writing, reading) failing on `path`.
fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PeersError {
    let path = path.to_path_buf();
    move |source| PeersError::Io { what, path, source }
}
