//! Loading routed-expert weights from safetensors checkpoints: tiny files written with the
//! `safetensors` serializer in a temp folder, per family, sharded or not; every element of
//! the re-laid-out buffers against the source tensors; every error kind; picking the layer
//! and family from the names; writing experts back; the weight sources agreeing rank by
//! rank; the router's gate and its biases by each family's names. CPU only.

use std::path::Path;

use moeforge_compiler::ir::Activation;
use moeforge_compiler::ir::RouterBias;
use moeforge_compiler::plan::LayerShape;
use moeforge_runtime::bf16;
use moeforge_runtime::checkpoint::{
    Checkpoint, CheckpointError, CheckpointLayer, ExpertSet, ExpertStorage, Family, HostWeights,
    INDEX_FILE, ReadableDtypes, write_experts, write_layer,
};
use moeforge_runtime::reference::layer_output;
use moeforge_runtime::weights::{self, Weights};
use moeforge_runtime::workload::Workload;
use safetensors::tensor::{Dtype, TensorView};

const H: usize = 16;
const F: usize = 8;
const E: usize = 4;
const PREFIX: &str = "model.layers.3.";

fn shape(activation: Activation) -> LayerShape {
    LayerShape {
        hidden: H as u32,
        ffn: F as u32,
        experts: E as u32,
        top_k: 2,
        activation,
        expert_bias: false,
        max_tokens: 64,
        shared_slices: 0,
        shared_gated: false,
        spec_ranks: 1,
        executed_ranks: 1,
    }
}

/// Distinct bf16 bits for element `i` of projection `p` (0 gate, 1 up, 2 down) of expert `e`.
fn value(e: usize, p: usize, i: usize) -> u16 {
    ((e << 12) | (p << 10) | i) as u16
}

fn names(family: Family, prefix: &str, e: usize) -> [String; 3] {
    let (base, parts) = match family {
        Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    parts.map(|p| format!("{prefix}{base}.experts.{e}.{p}.weight"))
}

/// A named tensor to serialize: dtype, shape, little-endian bytes.
type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

fn bf16_tensor(name: String, shape: Vec<usize>, bits: impl Iterator<Item = u16>) -> Tensor {
    (
        name,
        Dtype::BF16,
        shape,
        bits.flat_map(u16::to_le_bytes).collect(),
    )
}

/// Expert `e`'s gate, up and down tensors under `prefix`, bf16, values from [`value`].
fn one_expert(family: Family, prefix: &str, e: usize) -> [Tensor; 3] {
    let [gate, up, down] = names(family, prefix, e);
    [
        bf16_tensor(gate, vec![F, H], (0..F * H).map(|i| value(e, 0, i))),
        bf16_tensor(up, vec![F, H], (0..F * H).map(|i| value(e, 1, i))),
        bf16_tensor(down, vec![H, F], (0..H * F).map(|i| value(e, 2, i))),
    ]
}

/// The expert tensors of `experts` under PREFIX, bf16, values from [`value`], plus a
/// router weight so each file holds a non-expert tensor too.
fn expert_tensors(family: Family, experts: std::ops::Range<usize>) -> Vec<Tensor> {
    let mut out = vec![bf16_tensor(
        format!("{PREFIX}router.weight"),
        vec![E, H],
        (0..E * H).map(|i| i as u16),
    )];
    for e in experts {
        out.extend(one_expert(family, PREFIX, e));
    }
    out
}

fn write(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn replace(tensors: &mut [Tensor], name: &str, with: Tensor) {
    let slot = tensors.iter_mut().find(|t| t.0 == name).unwrap();
    *slot = with;
}

/// Checks every element of `w` against [`value`], indexing the kernels' layout by hand:
/// w1[l, r, h] with r < F the gate row r and r >= F the up row r - F; w2[l, o, f].
fn check_layout(w: &HostWeights) {
    let count = w.experts.len();
    assert_eq!(w.w1.len(), count * 2 * F * H);
    assert_eq!(w.w2.len(), count * H * F);
    for (l, e) in w.experts.clone().enumerate() {
        let e = e as usize;
        for r in 0..2 * F {
            for h in 0..H {
                let (p, f) = if r < F { (0, r) } else { (1, r - F) };
                assert_eq!(
                    w.w1[(l * 2 * F + r) * H + h],
                    value(e, p, f * H + h),
                    "w1 expert {e} row {r} col {h}"
                );
            }
        }
        for o in 0..H {
            for f in 0..F {
                assert_eq!(
                    w.w2[(l * H + o) * F + f],
                    value(e, 2, o * F + f),
                    "w2 expert {e} row {o} col {f}"
                );
            }
        }
    }
}

fn load(path: &Path, family: Family, which: ExpertSet) -> Result<HostWeights, CheckpointError> {
    Checkpoint::open(path)?.load_experts(family, PREFIX, &shape(Activation::Swiglu), which)
}

#[test]
fn each_family_loads_into_the_kernel_layout() {
    for family in [Family::Mixtral, Family::Qwen3Moe, Family::DeepseekV3] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        write(&file, &expert_tensors(family, 0..E));
        let w = load(&file, family, ExpertSet::All).unwrap();
        assert_eq!(w.experts, 0..E as u32);
        check_layout(&w);
        // A folder holding that one file loads the same.
        assert_eq!(load(dir.path(), family, ExpertSet::All).unwrap(), w);
    }
}

#[test]
fn a_rank_loads_its_share_of_the_experts() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &expert_tensors(Family::Qwen3Moe, 0..E));
    let all = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap();
    for ranks in [1u32, 2, 4] {
        let local = E / ranks as usize;
        for rank in 0..ranks {
            let which = ExpertSet::Rank { rank, ranks };
            let w = load(&file, Family::Qwen3Moe, which).unwrap();
            let r = rank as usize;
            assert_eq!(w.experts, rank * local as u32..(rank + 1) * local as u32);
            check_layout(&w);
            let (w1_len, w2_len) = (local * 2 * F * H, local * H * F);
            assert_eq!(w.w1, all.w1[r * w1_len..(r + 1) * w1_len]);
            assert_eq!(w.w2, all.w2[r * w2_len..(r + 1) * w2_len]);
        }
    }
    for (rank, ranks) in [(0, 0), (2, 2), (0, 3)] {
        let err = load(&file, Family::Qwen3Moe, ExpertSet::Rank { rank, ranks }).unwrap_err();
        assert!(
            matches!(err, CheckpointError::Rank { experts: 4, .. }),
            "{err}"
        );
    }
}

/// Experts 0..2 in one shard, 2..4 (and the router) in another.
fn write_shards(dir: &Path, family: Family) {
    let mut first = expert_tensors(family, 0..2);
    first.remove(0);
    write(&dir.join("model-00001-of-00002.safetensors"), &first);
    write(
        &dir.join("model-00002-of-00002.safetensors"),
        &expert_tensors(family, 2..E),
    );
}

fn write_index(dir: &Path, family: Family, shard_of: impl Fn(usize) -> String) {
    let mut map = serde_json::Map::new();
    map.insert(
        format!("{PREFIX}router.weight"),
        "model-00002-of-00002.safetensors".into(),
    );
    for e in 0..E {
        for name in names(family, PREFIX, e) {
            map.insert(name, shard_of(e).into());
        }
    }
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": map });
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
}

fn shard_name(e: usize) -> String {
    format!(
        "model-0000{}-of-00002.safetensors",
        if e < 2 { 1 } else { 2 }
    )
}

#[test]
fn sharded_folders_load_with_and_without_an_index() {
    let dir = tempfile::tempdir().unwrap();
    write_shards(dir.path(), Family::Mixtral);
    let unindexed = load(dir.path(), Family::Mixtral, ExpertSet::All).unwrap();
    check_layout(&unindexed);
    write_index(dir.path(), Family::Mixtral, shard_name);
    let indexed = load(dir.path(), Family::Mixtral, ExpertSet::All).unwrap();
    assert_eq!(indexed, unindexed);
    let rank1 = load(
        dir.path(),
        Family::Mixtral,
        ExpertSet::Rank { rank: 1, ranks: 2 },
    );
    check_layout(&rank1.unwrap());
}

#[test]
fn index_errors_name_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    write_shards(dir.path(), Family::Qwen3Moe);
    write_index(dir.path(), Family::Qwen3Moe, |e| {
        if e == 3 {
            "model-00003-of-00002.safetensors".into()
        } else {
            shard_name(e)
        }
    });
    // A shard not there is an error only where one of its tensors is read: the rank whose
    // experts are all there loads, as a layer whose shards are downloaded does.
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let layer = shape(Activation::Swiglu);
    let rank_0 = ExpertSet::Rank { rank: 0, ranks: 2 };
    check_layout(
        &checkpoint
            .load_experts(Family::Qwen3Moe, PREFIX, &layer, rank_0)
            .unwrap(),
    );
    let err = checkpoint
        .load_experts(Family::Qwen3Moe, PREFIX, &layer, ExpertSet::All)
        .unwrap_err();
    let CheckpointError::MissingShard {
        shard,
        tensor,
        folder: false,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert!(shard.ends_with("model-00003-of-00002.safetensors"));
    assert_eq!(tensor, &names(Family::Qwen3Moe, PREFIX, 3)[0]);
    assert!(
        err.to_string().ends_with("but that file is not there"),
        "{err}"
    );

    // A folder where the shard should be says so.
    std::fs::create_dir(dir.path().join("model-00003-of-00002.safetensors")).unwrap();
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .load_experts(Family::Qwen3Moe, PREFIX, &layer, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::MissingShard { folder: true, .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .ends_with("but that is a folder, not a file"),
        "{err}"
    );
    // Without an index, a folder named like a shard is not one.
    std::fs::remove_file(dir.path().join(INDEX_FILE)).unwrap();
    check_layout(&load(dir.path(), Family::Qwen3Moe, ExpertSet::All).unwrap());

    // Every shard exists, but expert 1's tensors are said to be in the second one.
    write_index(dir.path(), Family::Qwen3Moe, |e| {
        shard_name(if e == 1 { 2 } else { e })
    });
    let err = Checkpoint::open(dir.path()).err().unwrap();
    let CheckpointError::IndexMismatch { tensor, .. } = &err else {
        panic!("{err}")
    };
    assert!(tensor.contains("experts.1."), "{err}");

    std::fs::write(dir.path().join(INDEX_FILE), "{\"weights\": {}}").unwrap();
    let err = Checkpoint::open(dir.path()).err().unwrap();
    assert!(matches!(err, CheckpointError::Index { .. }), "{err}");
}

#[test]
fn a_tensor_in_two_unindexed_shards_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.safetensors"),
        &expert_tensors(Family::Mixtral, 0..1),
    );
    write(
        &dir.path().join("b.safetensors"),
        &expert_tensors(Family::Mixtral, 1..2),
    );
    let err = Checkpoint::open(dir.path()).err().unwrap();
    let CheckpointError::DuplicateTensor { tensor, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(tensor, &format!("{PREFIX}router.weight"));
}

#[test]
fn missing_tensors_name_the_nearest_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let mut tensors = expert_tensors(Family::Mixtral, 0..E);
    tensors.retain(|t| !t.0.contains("experts.2.w3"));
    write(&file, &tensors);
    let err = load(&file, Family::Mixtral, ExpertSet::All).unwrap_err();
    let message = err.to_string();
    let CheckpointError::MissingTensor {
        tensor, nearest, ..
    } = err
    else {
        panic!("{message}")
    };
    assert_eq!(
        tensor,
        format!("{PREFIX}block_sparse_moe.experts.2.w3.weight")
    );
    assert_eq!(
        nearest.as_deref(),
        Some("model.layers.3.block_sparse_moe.experts.2.w1.weight"),
        "{message}"
    );
    // The rank that does not hold expert 2 loads.
    load(
        &file,
        Family::Mixtral,
        ExpertSet::Rank { rank: 0, ranks: 2 },
    )
    .unwrap();

    // The wrong family: the hint shows the names the file uses.
    let err = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap_err();
    let CheckpointError::MissingTensor { nearest, .. } = &err else {
        panic!("{err}")
    };
    assert!(nearest.as_deref().unwrap().starts_with(PREFIX), "{err}");
    assert!(err.to_string().contains("mlp.experts.0.gate_proj"), "{err}");

    // The wrong layer: the nearest name is under another prefix.
    let err = Checkpoint::open(&file)
        .unwrap()
        .load_experts(
            Family::Mixtral,
            "model.layers.7.",
            &shape(Activation::Swiglu),
            ExpertSet::All,
        )
        .unwrap_err();
    let CheckpointError::MissingTensor { nearest, .. } = &err else {
        panic!("{err}")
    };
    assert!(nearest.as_deref().unwrap().starts_with("model.layers."));
}

#[test]
fn experts_past_the_specs_count_or_missing_ones_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let module = format!("{PREFIX}mlp.experts.");

    // Twice the spec's experts: loading the first E would drop the others unsaid.
    write(&file, &expert_tensors(Family::Qwen3Moe, 0..2 * E));
    for which in [ExpertSet::All, ExpertSet::Rank { rank: 0, ranks: 2 }] {
        let err = load(&file, Family::Qwen3Moe, which).unwrap_err();
        let CheckpointError::ExpertCount {
            module: named_under,
            family,
            named,
            highest,
            missing,
            spec,
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(named_under, &module);
        assert_eq!(*family, Family::Qwen3Moe);
        assert_eq!(
            (*named, *highest, *missing, *spec),
            (2 * E, 2 * E as u32 - 1, None, E as u32)
        );
        assert_eq!(
            err.to_string(),
            format!(
                "the checkpoint names 8 experts under `{module}` (Qwen3-MoE naming), numbered up to 7; \
                 the spec's layer has `experts = 4`"
            )
        );
    }

    // Expert 2 absent altogether (its shard not downloaded, say): not a wrong family. The
    // rank that does not hold it loads.
    let mut tensors = expert_tensors(Family::Mixtral, 0..E);
    tensors.retain(|t| !t.0.contains(".experts.2."));
    write(&file, &tensors);
    let rank = |rank| ExpertSet::Rank { rank, ranks: 2 };
    check_layout(&load(&file, Family::Mixtral, rank(0)).unwrap());
    let err = load(&file, Family::Mixtral, rank(1)).unwrap_err();
    assert!(
        matches!(
            &err,
            CheckpointError::ExpertCount {
                named: 3,
                highest: 3,
                missing: Some(2),
                spec: 4,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "the checkpoint names 3 experts under `{PREFIX}block_sparse_moe.experts.` (Mixtral naming); \
             the spec's layer has `experts = 4`, and expert 2 is not there"
        )
    );

    // The last expert absent: fewer than the spec's, numbered below it.
    let mut tensors = expert_tensors(Family::Qwen3Moe, 0..E);
    tensors.retain(|t| !t.0.contains(".experts.3."));
    write(&file, &tensors);
    let err = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap_err();
    assert!(
        matches!(
            &err,
            CheckpointError::ExpertCount {
                named: 3,
                missing: Some(3),
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn shape_and_dtype_errors_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let [_, _, down] = names(Family::Qwen3Moe, PREFIX, 1);
    // down_proj stored transposed, [F, H] instead of [H, F].
    let mut tensors = expert_tensors(Family::Qwen3Moe, 0..E);
    replace(
        &mut tensors,
        &down,
        bf16_tensor(down.clone(), vec![F, H], (0..F * H).map(|i| i as u16)),
    );
    write(&file, &tensors);
    let err = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap_err();
    let message = err.to_string();
    let CheckpointError::Shape {
        tensor,
        expected,
        found,
    } = err
    else {
        panic!("{message}")
    };
    assert_eq!(
        (tensor.as_str(), expected, found),
        (down.as_str(), vec![H, F], vec![F, H])
    );
    assert!(
        message.contains("[16, 8]") && message.contains("[8, 16]"),
        "{message}"
    );

    // A shape that suits another layer size: H = 16, F = 8 read as F = 4.
    let mut tensors = expert_tensors(Family::Qwen3Moe, 0..E);
    write(&file, &tensors);
    let mut small = shape(Activation::Swiglu);
    small.ffn = 4;
    let err = Checkpoint::open(&file)
        .unwrap()
        .load_experts(Family::Qwen3Moe, PREFIX, &small, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Shape { expected, .. } if expected == &vec![4, H]),
        "{err}"
    );

    // FP8 E5M2 is not read (E4M3 with block scales is: the FP8 tests below).
    replace(
        &mut tensors,
        &down,
        (down.clone(), Dtype::F8_E5M2, vec![H, F], vec![0; H * F]),
    );
    write(&file, &tensors);
    let err = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&down) && message.contains("F8_E5M2"),
        "{message}"
    );
    assert!(matches!(
        err,
        CheckpointError::Dtype {
            found: Dtype::F8_E5M2,
            readable: ReadableDtypes::Matrix,
            ..
        }
    ));
    assert!(message.ends_with("is F8_E5M2; the loader reads it as BF16, F16, F32, or F8_E4M3 with `<name>_scale_inv` block scales"), "{message}");
}

#[test]
fn f32_and_f16_tensors_are_rounded_to_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let mut tensors = expert_tensors(Family::Mixtral, 0..E);
    let [gate, up, _] = names(Family::Mixtral, PREFIX, 2);
    // f32 values, some exact in bf16, some that round (ties to even included).
    let f32s: Vec<f32> = (0..F * H)
        .map(|i| (i as f32 - 40.0) * (1.0 + 1.0 / 256.0) + i as f32 / 4096.0)
        .collect();
    replace(
        &mut tensors,
        &gate,
        (
            gate.clone(),
            Dtype::F32,
            vec![F, H],
            f32s.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    // f16 bits of i / 8 - 4 (exact in f16 and in bf16): 0x4400 is 4.0, 0x3800 is 0.5, …
    let f16s: Vec<(u16, f32)> = (0..F * H)
        .map(|i| {
            let v = i as f32 / 8.0 - 4.0;
            (f16_bits(v), v)
        })
        .collect();
    replace(
        &mut tensors,
        &up,
        (
            up.clone(),
            Dtype::F16,
            vec![F, H],
            f16s.iter().flat_map(|(b, _)| b.to_le_bytes()).collect(),
        ),
    );
    write(&file, &tensors);
    let w = load(&file, Family::Mixtral, ExpertSet::All).unwrap();
    let base = 2 * 2 * F * H;
    for (i, v) in f32s.iter().enumerate() {
        assert_eq!(w.w1[base + i], bf16::from_f32(*v), "gate element {i}");
    }
    for (i, (_, v)) in f16s.iter().enumerate() {
        assert_eq!(bf16::to_f32(w.w1[base + F * H + i]), *v, "up element {i}");
    }
}

/// f16 bits of `v`, which must be a multiple of 1/8 in [-4, 12) (exact, normal or zero).
fn f16_bits(v: f32) -> u16 {
    if v == 0.0 {
        return 0;
    }
    let sign = if v < 0.0 { 0x8000 } else { 0 };
    let a = v.abs();
    let exponent = a.log2().floor() as i32;
    let mantissa = ((a / 2f32.powi(exponent) - 1.0) * 1024.0) as u16;
    sign | (((exponent + 15) as u16) << 10) | mantissa
}

#[test]
fn unreadable_files_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(&dir.path().join("absent.safetensors"))
        .err()
        .unwrap();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err}");

    let err = Checkpoint::open(dir.path()).err().unwrap();
    assert!(matches!(err, CheckpointError::NoShards { .. }), "{err}");

    let garbage = dir.path().join("model.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    let err = Checkpoint::open(&garbage).err().unwrap();
    assert!(matches!(err, CheckpointError::Format { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    // The index of a folder given for the folder.
    let index = dir.path().join(INDEX_FILE);
    std::fs::write(&index, "{\"weight_map\": {}}").unwrap();
    let err = Checkpoint::open(&index).err().unwrap();
    assert!(
        matches!(&err, CheckpointError::JsonFile { path } if *path == index),
        "{err}"
    );

    // A file cut short (an incomplete download) says so; bytes left over are a format error.
    let file = dir.path().join("cut.safetensors");
    write(&file, &expert_tensors(Family::Mixtral, 0..1));
    let whole = std::fs::read(&file).unwrap();
    std::fs::write(&file, &whole[..whole.len() - 10]).unwrap();
    let err = Checkpoint::open(&file).err().unwrap();
    let (size, needed) = (whole.len() as u64 - 10, whole.len() as u64);
    assert!(
        matches!(&err, CheckpointError::Truncated { size: s, needed: n, .. } if (*s, *n) == (size, needed)),
        "{err}"
    );
    assert!(err.to_string().ends_with(&format!("is cut short: it holds {size} bytes, but its header places tensor data up to byte {needed}")), "{err}");
    let mut longer = whole.clone();
    longer.extend([0; 10]);
    std::fs::write(&file, &longer).unwrap();
    let err = Checkpoint::open(&file).err().unwrap();
    assert!(matches!(err, CheckpointError::Format { .. }), "{err}");
}

#[test]
fn gpt_oss_experts_on_a_plain_swiglu_layer_and_a_foreign_activation_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &expert_tensors(Family::Mixtral, 0..E));
    let err = load(&file, Family::GptOss, ExpertSet::All).unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::Activation {
                family: Family::GptOss,
                activation: Activation::Swiglu,
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("clamped_swiglu"), "{err}");

    let err = Checkpoint::open(&file)
        .unwrap()
        .load_experts(
            Family::Mixtral,
            PREFIX,
            &shape(Activation::Gelu),
            ExpertSet::All,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::Activation {
                activation: Activation::Gelu,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn detect_reports_the_families_named_under_a_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let detect = |tensors: &[Tensor], prefix: &str| {
        write(&file, tensors);
        Checkpoint::open(&file).unwrap().detect(prefix)
    };
    let mixtral = expert_tensors(Family::Mixtral, 0..E);
    assert_eq!(detect(&mixtral, PREFIX), [Family::Mixtral]);
    assert_eq!(detect(&mixtral, "model.layers.4."), []);

    let mut qwen = expert_tensors(Family::Qwen3Moe, 0..E);
    assert_eq!(detect(&qwen, PREFIX), [Family::Qwen3Moe]);
    // DeepSeek-V2's layer: shared experts, no correction bias; then V3's, with both.
    let mut deepseek = qwen.clone();
    deepseek.extend(shared_tensors());
    assert_eq!(detect(&deepseek, PREFIX), [Family::DeepseekV3]);
    let bias = bf16_tensor(
        format!("{PREFIX}mlp.gate.e_score_correction_bias"),
        vec![E],
        0..E as u16,
    );
    deepseek.push(bias.clone());
    assert_eq!(detect(&deepseek, PREFIX), [Family::DeepseekV3]);
    qwen.push(bias);
    assert_eq!(detect(&qwen, PREFIX), [Family::DeepseekV3]);
    // Qwen2-MoE's gated shared expert.
    let mut qwen2 = expert_tensors(Family::Qwen2Moe, 0..E);
    qwen2.extend(qwen2_shared_tensors());
    assert_eq!(detect(&qwen2, PREFIX), [Family::Qwen2Moe]);

    let gpt_oss = [bf16_tensor(
        format!("{PREFIX}mlp.experts.gate_up_proj"),
        vec![E, H, 2 * F],
        (0..E * H * 2 * F).map(|i| i as u16),
    )];
    assert_eq!(detect(&gpt_oss, PREFIX), [Family::GptOss]);
}

/// The CPU reference on loaded weights computes what the model's expert MLP computes,
/// `y = Σ_k w_k · down_e(silu(gate_e x) · up_e x)`, written here from the source tensors
/// (so a swapped gate and up, or a transposed matrix, would not pass).
#[test]
fn the_reference_on_loaded_weights_is_the_models_expert_mlp() {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut random = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        bf16::from_f32(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5)
    };
    let mut tensors = Vec::new();
    let mut source = Vec::new();
    for e in 0..E {
        let [gate, up, down] = names(Family::Qwen3Moe, PREFIX, e);
        let values: [Vec<u16>; 3] = std::array::from_fn(|_| (0..F * H).map(|_| random()).collect());
        tensors.push(bf16_tensor(gate, vec![F, H], values[0].iter().copied()));
        tensors.push(bf16_tensor(up, vec![F, H], values[1].iter().copied()));
        tensors.push(bf16_tensor(down, vec![H, F], values[2].iter().copied()));
        source.push(values.map(|v| v.into_iter().map(bf16::to_f32).collect::<Vec<f32>>()));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &tensors);
    let w = load(&file, Family::Qwen3Moe, ExpertSet::All).unwrap();

    let workload = Workload {
        tokens: 3,
        x: (0..3 * H).map(|_| random()).collect(),
        topk_ids: vec![0, 3, 2, 1, 1, 2],
        topk_weights: vec![0.75, 0.25, 0.5, 0.5, 0.125, 0.875],
    };
    let layer = shape(Activation::Swiglu);
    let reference = layer_output(&layer, &workload, vec![0, 1, 2], |e| w.expert(&layer, e));
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
    let silu = |v: f32| v / (1.0 + (-v).exp());
    for t in 0..3 {
        let x: Vec<f32> = workload.x[t * H..(t + 1) * H]
            .iter()
            .map(|&b| bf16::to_f32(b))
            .collect();
        let mut y = [0f32; H];
        for k in 0..2 {
            let [gate, up, down] = &source[workload.topk_ids[t * 2 + k] as usize];
            let act: Vec<f32> = (0..F)
                .map(|f| {
                    let row = f * H..(f + 1) * H;
                    silu(dot(&gate[row.clone()], &x)) * dot(&up[row], &x)
                })
                .collect();
            for (o, y) in y.iter_mut().enumerate() {
                *y += workload.topk_weights[t * 2 + k] * dot(&down[o * F..(o + 1) * F], &act);
            }
        }
        for (o, want) in y.iter().enumerate() {
            let (got, magnitude) = (reference.y[t * H + o], reference.magnitude[t * H + o]);
            // The reference rounds the intermediate to bf16 (2^-8 relative) as the kernels do.
            assert!(
                (got - want).abs() <= 1e-2 * magnitude + 1e-6,
                "token {t} output {o}: reference {got}, model {want}"
            );
        }
    }
}

/// Experts of `family` under each of `prefixes`, in one file.
fn write_layers(path: &Path, family: Family, prefixes: &[&str]) {
    let mut tensors = Vec::new();
    for prefix in prefixes {
        for e in 0..E {
            tensors.extend(one_expert(family, prefix, e));
        }
    }
    write(path, &tensors);
}

#[test]
fn the_only_layer_and_its_family_are_picked_from_the_names() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_layers(&file, Family::Qwen3Moe, &[PREFIX]);
    let layer = CheckpointLayer::open(&file, None, None).unwrap();
    assert_eq!((layer.prefix(), layer.family()), (PREFIX, Family::Qwen3Moe));
    assert_eq!(
        layer.to_string(),
        format!(
            "layer `{PREFIX}` (the only one), Qwen3-MoE naming (detected), of {}",
            file.display()
        )
    );
    let w = layer
        .load(&shape(Activation::Swiglu), ExpertSet::All)
        .unwrap();
    check_layout(&w);

    // A given prefix may leave out its final dot; a given family is taken as given.
    let layer =
        CheckpointLayer::open(&file, Some("model.layers.3"), Some(Family::DeepseekV3)).unwrap();
    assert_eq!(
        (layer.prefix(), layer.family()),
        (PREFIX, Family::DeepseekV3)
    );
    assert_eq!(
        layer.to_string(),
        format!(
            "layer `{PREFIX}`, DeepSeek-V3 naming, of {}",
            file.display()
        )
    );
    // A given family whose expert names are not there, another's being, is refused at
    // opening (before its activation is held against the spec's).
    for (given, expected) in [
        (Family::Mixtral, "block_sparse_moe.experts.0.w1.weight"),
        (Family::GptOss, "mlp.experts.gate_up_proj"),
    ] {
        let err = CheckpointLayer::open(&file, None, Some(given))
            .err()
            .unwrap();
        assert!(
            matches!(
                &err,
                CheckpointError::GivenFamilyMismatch { given: g, named_as, .. }
                    if *g == given && named_as == &[Family::Qwen3Moe]
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "the family given is {given}, whose experts under `{PREFIX}` would be named like \
                 `{PREFIX}{expected}`, but the checkpoint names them as Qwen3-MoE does"
            )
        );
    }
    // Where no family's experts are named under the prefix, a wrong family fails at
    // loading, naming the tensor and its shape.
    let mut tensors = expert_tensors(Family::Qwen3Moe, 0..E);
    tensors.retain(|t| !t.0.contains(".experts.0."));
    write(&file, &tensors);
    let err = CheckpointLayer::open(&file, Some(PREFIX), Some(Family::Mixtral))
        .unwrap()
        .load(&shape(Activation::Swiglu), ExpertSet::All)
        .unwrap_err();
    let CheckpointError::MissingTensor { expected, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(expected, &vec![F, H]);
    assert!(err.to_string().contains("shape [8, 16]"), "{err}");
}

#[test]
fn several_layers_need_a_prefix_and_a_wrong_prefix_lists_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let prefixes = ["model.layers.10.", "model.layers.2.", "model.layers.1."];
    write_layers(&file, Family::Mixtral, &prefixes);
    let checkpoint = Checkpoint::open(&file).unwrap();
    assert_eq!(
        checkpoint.expert_layers(),
        ["model.layers.1.", "model.layers.2.", "model.layers.10."],
        "natural order"
    );

    let err = CheckpointLayer::open(&file, None, None).err().unwrap();
    assert!(
        matches!(&err, CheckpointError::SeveralLayers { layers } if layers.len() == 3),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("3 layers (`model.layers.1.`, `model.layers.2.`"),
        "{err}"
    );

    let layer = CheckpointLayer::open(&file, Some("model.layers.10"), None).unwrap();
    assert_eq!(
        (layer.prefix(), layer.family()),
        ("model.layers.10.", Family::Mixtral)
    );

    // No tensor under the prefix: the error lists the layers there are.
    let err = CheckpointLayer::open(&file, Some("model.layers.7."), None)
        .err()
        .unwrap();
    let CheckpointError::NoExpertsUnderPrefix { prefix, layers } = &err else {
        panic!("{err}")
    };
    assert_eq!(prefix, "model.layers.7.");
    assert_eq!(layers.len(), 3);
    assert!(err.to_string().contains("`model.layers.10.`"), "{err}");

    // Tensors under the prefix, but no experts there (the router's only).
    let mut tensors = expert_tensors(Family::Mixtral, 0..E);
    tensors.push(bf16_tensor(
        "model.layers.0.mlp.gate.weight".into(),
        vec![E, H],
        (0..E * H).map(|i| i as u16),
    ));
    write(&file, &tensors);
    let err = CheckpointLayer::open(&file, Some("model.layers.0."), None)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains(&format!("the only layer with routed experts is `{PREFIX}`")),
        "{err}"
    );
}

#[test]
fn a_checkpoint_without_experts_and_two_families_under_one_prefix_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(
        &file,
        &[bf16_tensor(
            "lm_head.weight".into(),
            vec![4, H],
            0..4 * H as u16,
        )],
    );
    let err = CheckpointLayer::open(&file, None, None).err().unwrap();
    assert!(
        matches!(&err, CheckpointError::NoExpertLayers { count: 1, example: Some(name) } if name == "lm_head.weight"),
        "{err}"
    );

    let mut tensors = expert_tensors(Family::Mixtral, 0..E);
    tensors.extend(expert_tensors(Family::Qwen3Moe, 0..E).into_iter().skip(1));
    write(&file, &tensors);
    let err = CheckpointLayer::open(&file, None, None).err().unwrap();
    assert!(
        matches!(&err, CheckpointError::SeveralFamilies { families, .. } if families == &[Family::Mixtral, Family::Qwen3Moe]),
        "{err}"
    );
    let layer = CheckpointLayer::open(&file, None, Some(Family::Mixtral)).unwrap();
    check_layout(
        &layer
            .load(&shape(Activation::Swiglu), ExpertSet::All)
            .unwrap(),
    );
}

#[test]
fn written_experts_read_back_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let layer = shape(Activation::Swiglu);
    let all = weights::random(&layer, 0..E as u32, 7);
    for family in [Family::Mixtral, Family::Qwen3Moe, Family::DeepseekV3] {
        let file = dir.path().join(format!("{family}.safetensors"));
        write_experts(&file, family, PREFIX, &layer, &all).unwrap();
        let checkpoint = Checkpoint::open(&file).unwrap();
        assert_eq!(
            checkpoint
                .load_experts(family, PREFIX, &layer, ExpertSet::All)
                .unwrap(),
            all
        );
        // One rank's share alone names that rank's experts.
        let rank = all
            .select(&layer, ExpertSet::Rank { rank: 1, ranks: 2 })
            .unwrap();
        write_experts(&file, family, PREFIX, &layer, &rank).unwrap();
        let checkpoint = Checkpoint::open(&file).unwrap();
        assert_eq!(checkpoint.names().count(), 3 * E / 2);
        assert_eq!(
            checkpoint
                .load_experts(
                    family,
                    PREFIX,
                    &layer,
                    ExpertSet::Rank { rank: 1, ranks: 2 }
                )
                .unwrap(),
            rank
        );
    }
    let err = write_experts(
        &dir.path().join("x.safetensors"),
        Family::GptOss,
        PREFIX,
        &layer,
        &all,
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Activation { .. }), "{err}");
    let err = write_experts(
        &dir.path().join("missing/x.safetensors"),
        Family::Mixtral,
        PREFIX,
        &layer,
        &all,
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Write { .. }), "{err}");
}

#[test]
fn the_gate_and_its_bias_load_by_each_familys_names() {
    let dir = tempfile::tempdir().unwrap();
    let layer = shape(Activation::Swiglu);
    let all = weights::random(&layer, 0..E as u32, 7);
    let cases = [
        (Family::Mixtral, RouterBias::None, "block_sparse_moe.gate"),
        (Family::Qwen3Moe, RouterBias::None, "mlp.gate"),
        (Family::DeepseekV3, RouterBias::ScoreCorrection, "mlp.gate"),
    ];
    for (family, bias, module) in cases {
        let gate = weights::random_gate(&layer, bias, 11);
        assert_eq!(gate.bias.is_some(), bias != RouterBias::None);
        let file = dir.path().join(format!("{family}_gate.safetensors"));
        write_layer(&file, family, PREFIX, &layer, &all, Some((&gate, bias))).unwrap();
        let checkpoint = Checkpoint::open(&file).unwrap();
        assert!(
            checkpoint
                .names()
                .any(|n| n == format!("{PREFIX}{module}.weight")),
            "{family}: the gate is `{module}.weight`"
        );
        assert_eq!(
            checkpoint.load_gate(family, PREFIX, &layer, bias).unwrap(),
            gate,
            "{family}: read back bit for bit"
        );
        // A rule with a bias the checkpoint lacks names the tensor and its shape.
        if bias == RouterBias::None {
            let err = checkpoint
                .load_gate(family, PREFIX, &layer, RouterBias::ScoreCorrection)
                .unwrap_err();
            let message = err.to_string();
            assert!(
                matches!(err, CheckpointError::MissingTensor { .. })
                    && message.contains(&format!("{module}.e_score_correction_bias"))
                    && message.contains(&format!("[{E}]")),
                "{message}"
            );
        }
    }
    // GPT-OSS's router: a Linear with a bias, the bias stored in bf16 and read as f32.
    let file = dir.path().join("gpt_oss_router.safetensors");
    let weight: Vec<u16> = (0..E * H).map(|i| i as u16).collect();
    let bias = [0.5f32, -1.25, 3.0, 0.0];
    write(
        &file,
        &[
            bf16_tensor(
                format!("{PREFIX}mlp.router.weight"),
                vec![E, H],
                weight.iter().copied(),
            ),
            bf16_tensor(
                format!("{PREFIX}mlp.router.bias"),
                vec![E],
                bias.iter().map(|&b| bf16::from_f32(b)),
            ),
        ],
    );
    let checkpoint = Checkpoint::open(&file).unwrap();
    let gate = checkpoint
        .load_gate(Family::GptOss, PREFIX, &layer, RouterBias::Logits)
        .unwrap();
    assert_eq!(gate.weight, weight);
    assert_eq!(gate.bias.as_deref(), Some(&bias[..]));
    // A gate of the wrong size names the tensor and the shape the layer needs.
    let mut small = layer.clone();
    small.experts = 2;
    let err = checkpoint
        .load_gate(Family::GptOss, PREFIX, &small, RouterBias::Logits)
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Shape { tensor, expected, .. }
            if tensor.ends_with("mlp.router.weight") && expected == &vec![2, H]),
        "{err}"
    );
}

#[test]
fn weight_sources_give_the_same_experts_for_a_rank_as_for_the_layer() {
    let layer = shape(Activation::Swiglu);
    let random = Weights::Random { seed: 11 };
    let all = random.host(&layer, ExpertSet::All).unwrap();
    all.check(&layer).unwrap();
    assert_ne!(
        all,
        weights::random(&layer, 0..E as u32, 12),
        "the seed matters"
    );
    // Bounded by the fan-in scale, not all zero.
    let bound = weights::random(&layer, 0..1, 11)
        .w1
        .iter()
        .map(|&b| bf16::to_f32(b).abs())
        .fold(0f32, f32::max);
    assert!(
        bound > 0.0 && bound <= (3.0 / H as f32).sqrt() * 1.01,
        "{bound}"
    );

    let host = Weights::Host(all.clone());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_experts(&file, Family::Mixtral, PREFIX, &layer, &all).unwrap();
    let checkpoint = Weights::Checkpoint(CheckpointLayer::open(&file, None, None).unwrap());
    for ranks in [1u32, 2, 4] {
        for rank in 0..ranks {
            let which = ExpertSet::Rank { rank, ranks };
            let share = all.select(&layer, which).unwrap();
            for source in [&random, &host, &checkpoint] {
                assert_eq!(source.host(&layer, which).unwrap(), share);
            }
        }
    }

    // Host weights must hold the experts asked for, at the layer's sizes.
    let half = all
        .select(&layer, ExpertSet::Rank { rank: 0, ranks: 2 })
        .unwrap();
    let err = Weights::Host(half)
        .host(&layer, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::HostExperts { held, wanted } if *held == (0..2) && *wanted == (0..4)),
        "{err}"
    );
    let mut short = all.clone();
    short.w2.pop();
    let err = Weights::Host(short)
        .host(&layer, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::HostSize { what: "w2", .. }),
        "{err}"
    );
}

/// GPT-OSS's fused tensors as its dequantized checkpoints hold them: `gate_up_proj`
/// [E, H, 2F] with element (e, h, c) coded `e << 12 | c << 4 | h` (bf16 bits),
/// `down_proj` [E, F, H] coded `e << 12 | 1 << 11 | f << 4 | h`, biases
/// `100 e + c` and `-(100 e + h)` in f32.
fn gpt_oss_tensors() -> Vec<Tensor> {
    let bits = |v: Vec<u16>| v.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    let floats = |v: Vec<f32>| v.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    let mut gate_up = Vec::new();
    let mut down = Vec::new();
    let mut gate_up_bias = Vec::new();
    let mut down_bias = Vec::new();
    for e in 0..E {
        for h in 0..H {
            gate_up.extend((0..2 * F).map(|c| ((e << 12) | (c << 4) | h) as u16));
        }
        for f in 0..F {
            down.extend((0..H).map(|h| ((e << 12) | (1 << 11) | (f << 4) | h) as u16));
        }
        gate_up_bias.extend((0..2 * F).map(|c| (100 * e + c) as f32));
        down_bias.extend((0..H).map(|h| -((100 * e + h) as f32)));
    }
    let name = |suffix: &str| format!("{PREFIX}mlp.experts.{suffix}");
    vec![
        (
            name("gate_up_proj"),
            Dtype::BF16,
            vec![E, H, 2 * F],
            bits(gate_up),
        ),
        (
            name("gate_up_proj_bias"),
            Dtype::F32,
            vec![E, 2 * F],
            floats(gate_up_bias),
        ),
        (name("down_proj"), Dtype::BF16, vec![E, F, H], bits(down)),
        (
            name("down_proj_bias"),
            Dtype::F32,
            vec![E, H],
            floats(down_bias),
        ),
    ]
}

fn gpt_oss_shape() -> LayerShape {
    LayerShape {
        expert_bias: true,
        ..shape(Activation::ClampedSwiglu)
    }
}

#[test]
fn gpt_oss_fused_experts_load_deinterleaved_and_transposed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &gpt_oss_tensors());
    let checkpoint = Checkpoint::open(&file).unwrap();
    assert_eq!(checkpoint.detect(PREFIX), vec![Family::GptOss]);
    let shape = gpt_oss_shape();
    let which = ExpertSet::Rank { rank: 1, ranks: 2 };
    let w = checkpoint
        .load_experts(Family::GptOss, PREFIX, &shape, which)
        .unwrap();
    assert_eq!(w.experts, 2..4);
    let biases = w.biases.as_ref().unwrap();
    for (local, e) in (2..4).enumerate() {
        for f in 0..F {
            for h in 0..H {
                let w1 = &w.w1[local * 2 * F * H..];
                assert_eq!(
                    w1[f * H + h],
                    ((e << 12) | ((2 * f) << 4) | h) as u16,
                    "gate"
                );
                assert_eq!(
                    w1[(F + f) * H + h],
                    ((e << 12) | ((2 * f + 1) << 4) | h) as u16,
                    "up"
                );
                let down = ((e << 12) | (1 << 11) | (f << 4) | h) as u16;
                assert_eq!(w.w2[local * H * F + h * F + f], down, "down");
            }
            assert_eq!(biases.b1[local * 2 * F + f], (100 * e + 2 * f) as f32);
            assert_eq!(
                biases.b1[local * 2 * F + F + f],
                (100 * e + 2 * f + 1) as f32
            );
        }
        for h in 0..H {
            assert_eq!(biases.b2[local * H + h], -((100 * e + h) as f32));
        }
    }
    // Writing all experts back under GPT-OSS's names and loading them gives them again.
    let all = checkpoint
        .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
        .unwrap();
    let copy = dir.path().join("copy.safetensors");
    write_experts(&copy, Family::GptOss, PREFIX, &shape, &all).unwrap();
    let again = Checkpoint::open(&copy)
        .unwrap()
        .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
        .unwrap();
    assert_eq!(again, all);
}

#[test]
fn gpt_oss_fused_experts_of_another_count_say_how_many_they_hold() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &gpt_oss_tensors());
    let checkpoint = Checkpoint::open(&file).unwrap();
    for spec in [2 * E as u32, E as u32 / 2] {
        let shape = LayerShape {
            experts: spec,
            ..gpt_oss_shape()
        };
        let err = checkpoint
            .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
            .unwrap_err();
        let missing = (spec > E as u32).then_some(E as u32);
        assert!(
            matches!(
                &err,
                CheckpointError::ExpertCount { named, highest, missing: m, spec: s, .. }
                    if *named == E && *highest == E as u32 - 1 && *m == missing && *s == spec
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains(&format!(
                "names {E} experts under `{PREFIX}mlp.experts.` (GPT-OSS naming)"
            )),
            "{err}"
        );
    }
}

#[test]
fn gpt_oss_needs_its_expert_math() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write(&file, &gpt_oss_tensors());
    let checkpoint = Checkpoint::open(&file).unwrap();
    let no_bias = shape(Activation::ClampedSwiglu);
    let err = checkpoint
        .load_experts(Family::GptOss, PREFIX, &no_bias, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(
            err,
            CheckpointError::ExpertBias {
                family: Family::GptOss,
                spec: false
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("expert_bias = true"), "{err}");
}

/// 2^k as f32, exactly (for the expected values below, independent of the loader's
/// decoding).
fn pow2(k: i32) -> f32 {
    f32::powi(2.0, k)
}

/// An MXFP4 matrix [rows, cols] per expert, as GPT-OSS's release stores it: returns the
/// blocks [E, rows, G, 16], the scales [E, rows, G] and the values they code, [E, rows,
/// cols] in f32 (exact in bf16). Codes and scales vary with every index; cols need not be
/// a multiple of 32 (the last block's extra codes are padding).
fn mxfp4_matrix(rows: usize, cols: usize, salt: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    // The E2M1 codes' values, spelled out: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    let magnitude = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let groups = cols.div_ceil(32);
    let (mut blocks, mut scales, mut values) = (Vec::new(), Vec::new(), Vec::new());
    for e in 0..E {
        for r in 0..rows {
            let mut row = vec![0f32; groups * 32];
            for g in 0..groups {
                let exponent = 120 + ((e + 3 * r + 5 * g + salt) % 12) as u8;
                scales.push(exponent);
                for b in 0..16 {
                    let code = |c: usize| ((e * 7 + r * 3 + c * 5 + salt) % 16) as u8;
                    let (lo, hi) = (code(32 * g + 2 * b), code(32 * g + 2 * b + 1));
                    blocks.push(lo | (hi << 4));
                    for (c, code) in [(32 * g + 2 * b, lo), (32 * g + 2 * b + 1, hi)] {
                        let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
                        row[c] =
                            sign * magnitude[(code & 7) as usize] * pow2(i32::from(exponent) - 127);
                    }
                }
            }
            values.extend_from_slice(&row[..cols]);
        }
    }
    (blocks, scales, values)
}

/// GPT-OSS's experts at sizes `h`, `f` as its MXFP4 release stores them (blocks and scales
/// from [`mxfp4_matrix`], with biases), and the dequantized (bf16) checkpoint of the values
/// they code.
fn gpt_oss_mxfp4_pair(h: usize, f: usize) -> (Vec<Tensor>, Vec<Tensor>) {
    let name = |suffix: &str| format!("{PREFIX}mlp.experts.{suffix}");
    let bytes = |v: &[f32]| v.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    let bits = |v: &[u16]| v.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    let (gate_up_blocks, gate_up_scales, gate_up) = mxfp4_matrix(2 * f, h, 0);
    let (down_blocks, down_scales, down) = mxfp4_matrix(h, f, 1);
    let gate_up_bias: Vec<f32> = (0..E * 2 * f).map(|i| i as f32 * 0.25).collect();
    let down_bias: Vec<f32> = (0..E * h).map(|i| -(i as f32)).collect();
    let biases = [
        (
            name("gate_up_proj_bias"),
            Dtype::F32,
            vec![E, 2 * f],
            bytes(&gate_up_bias),
        ),
        (
            name("down_proj_bias"),
            Dtype::F32,
            vec![E, h],
            bytes(&down_bias),
        ),
    ];
    let mut quantized = vec![
        (
            name("gate_up_proj_blocks"),
            Dtype::U8,
            vec![E, 2 * f, h.div_ceil(32), 16],
            gate_up_blocks,
        ),
        (
            name("gate_up_proj_scales"),
            Dtype::U8,
            vec![E, 2 * f, h.div_ceil(32)],
            gate_up_scales,
        ),
        (
            name("down_proj_blocks"),
            Dtype::U8,
            vec![E, h, f.div_ceil(32), 16],
            down_blocks,
        ),
        (
            name("down_proj_scales"),
            Dtype::U8,
            vec![E, h, f.div_ceil(32)],
            down_scales,
        ),
    ];
    quantized.extend(biases.iter().cloned());

    // The dequantized checkpoint holds the transposes: gate_up_proj [E, H, 2F], down_proj
    // [E, F, H].
    let transpose = |v: &[f32], rows: usize, cols: usize| -> Vec<u16> {
        let mut out = vec![0u16; v.len()];
        for e in 0..E {
            for r in 0..rows {
                for c in 0..cols {
                    let value = v[(e * rows + r) * cols + c];
                    let exact = bf16::from_f32(value);
                    assert_eq!(bf16::to_f32(exact), value, "MXFP4 values are exact in bf16");
                    out[(e * cols + c) * rows + r] = exact;
                }
            }
        }
        out
    };
    let mut plain = vec![
        (
            name("gate_up_proj"),
            Dtype::BF16,
            vec![E, h, 2 * f],
            bits(&transpose(&gate_up, 2 * f, h)),
        ),
        (
            name("down_proj"),
            Dtype::BF16,
            vec![E, f, h],
            bits(&transpose(&down, h, f)),
        ),
    ];
    plain.extend(biases.iter().cloned());
    (quantized, plain)
}

#[test]
fn gpt_oss_mxfp4_experts_load_as_their_dequantized_bf16_checkpoint() {
    // Sizes whose rows take two MXFP4 blocks (H = 48: a full block and a half one) and one
    // (F = 24), with biases, as gpt-oss-120b's release stores them.
    const H: usize = 48;
    const F: usize = 24;
    let shape = LayerShape {
        hidden: H as u32,
        ffn: F as u32,
        expert_bias: true,
        ..shape(Activation::ClampedSwiglu)
    };
    let (quantized_tensors, plain_tensors) = gpt_oss_mxfp4_pair(H, F);
    let name = |suffix: &str| format!("{PREFIX}mlp.experts.{suffix}");
    let dir = tempfile::tempdir().unwrap();
    let quantized = dir.path().join("mxfp4.safetensors");
    write(&quantized, &quantized_tensors);
    let plain = dir.path().join("bf16.safetensors");
    write(&plain, &plain_tensors);

    let load = |path: &Path, which| {
        let checkpoint = Checkpoint::open(path).unwrap();
        assert_eq!(checkpoint.detect(PREFIX), vec![Family::GptOss]);
        checkpoint
            .load_experts(Family::GptOss, PREFIX, &shape, which)
            .unwrap()
    };
    for which in [ExpertSet::All, ExpertSet::Rank { rank: 1, ranks: 2 }] {
        let w = load(&quantized, which);
        assert_eq!(w, load(&plain, which));
        assert!(w.w1.iter().any(|&b| b & 0x7fff != 0), "not all zero");
    }
    // One element by hand: expert 1's W1 row F + 2 (up row 2: gate_up row 5) column 40
    // (block 1, byte 4, low nibble), and its W2 (down row 7, column 3: block 0, byte 1).
    let w = load(&quantized, ExpertSet::All);
    let storage = |path: &Path| CheckpointLayer::open(path, None, None).unwrap().storage();
    assert_eq!(storage(&quantized), ExpertStorage::Mxfp4);
    assert_eq!(storage(&plain), ExpertStorage::Plain);
    assert_eq!(
        ExpertStorage::Fp8 {
            block: Some([128, 128])
        }
        .to_string(),
        "FP8 E4M3 with 128 x 128 block scales, dequantized to bf16"
    );
    let code = |e: usize, r: usize, c: usize, salt: usize| (e * 7 + r * 3 + c * 5 + salt) % 16;
    assert_eq!(code(1, 5, 40, 0), 14, "-4.0");
    let scale = pow2(120 + (1 + 3 * 5 + 5) % 12 - 127);
    assert_eq!(scale, 4.0);
    assert_eq!(bf16::to_f32(w.w1[(2 * F + F + 2) * H + 40]), -16.0);
    assert_eq!(code(1, 7, 3, 1), 12, "-2.0");
    let scale = pow2(120 + (1 + 3 * 7 + 1) % 12 - 127);
    assert_eq!(scale, 16.0);
    assert_eq!(bf16::to_f32(w.w2[(H + 7) * F + 3]), -32.0);

    // A scale tensor of the wrong dtype, or missing, is named.
    let mut wrong = tensors_without(&quantized, &name("down_proj_scales"));
    let down_scales = quantized_tensors
        .iter()
        .find(|t| t.0 == name("down_proj_scales"))
        .expect("scales");
    wrong.push((
        down_scales.0.clone(),
        Dtype::I8,
        down_scales.2.clone(),
        down_scales.3.clone(),
    ));
    write(&quantized, &wrong);
    let err = Checkpoint::open(&quantized)
        .unwrap()
        .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Dtype { tensor, found: Dtype::I8, readable: ReadableDtypes::Mxfp4 } if *tensor == name("down_proj_scales")),
        "{err}"
    );
    write(
        &quantized,
        &tensors_without(&quantized, &name("down_proj_scales")),
    );
    let err = Checkpoint::open(&quantized)
        .unwrap()
        .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(&err, CheckpointError::MissingTensor { tensor, expected, .. }
            if *tensor == name("down_proj_scales") && *expected == vec![E, H, 1]),
        "{err}"
    );
}

/// The tensors of the safetensors file at `path`, less `name`.
fn tensors_without(path: &Path, name: &str) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .map(|(n, view)| (n, view.dtype(), view.shape().to_vec(), view.data().to_vec()))
        .collect()
}

/// An FP8 E4M3 code's value, spelled out from its fields (bias 7, subnormals below
/// exponent 1), for codes that are not NaN.
fn e4m3(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exponent, mantissa) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    if exponent == 0 {
        sign * mantissa / 8.0 * pow2(-6)
    } else {
        sign * (8.0 + mantissa) / 8.0 * pow2(exponent - 7)
    }
}

/// DeepSeek-V3's FP8 form of a layer of `experts` experts of sizes `h`, `f` and two shared
/// slices: every expert projection and the shared experts' as F8_E4M3 codes with `<name>_scale_inv` [ceil(rows/B0), ceil(cols/B1)]
/// (varying per block), and the bf16 checkpoint of the values they code.
fn deepseek_fp8_pair(block: [usize; 2], [h, f, experts]: [usize; 3]) -> (Vec<Tensor>, Vec<Tensor>) {
    let (mut quantized, mut plain) = (Vec::new(), Vec::new());
    let mut matrix = |name: String, rows: usize, cols: usize, salt: usize| {
        let [b0, b1] = block;
        let (sr, sc) = (rows.div_ceil(b0), cols.div_ceil(b1));
        // As a release's scales (amax / 448) are, not powers of two: the products round to
        // bf16 from f32, which a loader that rounded the scale first would not match.
        let scales: Vec<f32> = (0..sr * sc)
            .map(|i| pow2((i + salt) as i32 % 7 - 3) * 0.3)
            .collect();
        // Codes 0..=0x7e and their negatives: never NaN (0x7f, 0xff).
        let codes: Vec<u8> = (0..rows * cols)
            .map(|i| ((i * 37 + salt * 11) % 0x7f) as u8 | if i % 3 == 0 { 0x80 } else { 0 })
            .collect();
        let values = codes.iter().enumerate().map(|(i, &code)| {
            bf16::from_f32(e4m3(code) * scales[i / cols / b0 * sc + i % cols / b1])
        });
        plain.push(bf16_tensor(name.clone(), vec![rows, cols], values));
        let scale_bytes = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        quantized.push((
            format!("{name}_scale_inv"),
            Dtype::F32,
            vec![sr, sc],
            scale_bytes,
        ));
        quantized.push((name, Dtype::F8_E4M3, vec![rows, cols], codes));
    };
    for e in 0..experts {
        let [gate, up, down] = names(Family::DeepseekV3, PREFIX, e);
        matrix(gate, f, h, 3 * e);
        matrix(up, f, h, 3 * e + 1);
        matrix(down, h, f, 3 * e + 2);
    }
    let shared = |p: &str| format!("{PREFIX}mlp.shared_experts.{p}.weight");
    matrix(shared("gate_proj"), 2 * f, h, 90);
    matrix(shared("up_proj"), 2 * f, h, 91);
    matrix(shared("down_proj"), h, 2 * f, 92);
    let bias = (
        format!("{PREFIX}mlp.gate.e_score_correction_bias"),
        Dtype::F32,
        vec![experts],
        vec![0; 4 * experts],
    );
    quantized.push(bias.clone());
    plain.push(bias);
    (quantized, plain)
}

#[test]
fn deepseek_v3_fp8_experts_load_as_their_dequantized_bf16_checkpoint() {
    let shape = LayerShape {
        shared_slices: 2,
        ..shape(Activation::Swiglu)
    };
    // Blocks of the release (128 x 128: one block here, no config.json), and blocks that
    // split the matrices, partly (3 x 5), as a config.json can say.
    for (block, config) in [
        ([128, 128], None),
        (
            [3, 5],
            Some(
                r#"{"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "weight_block_size": [3, 5]}}"#,
            ),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (quantized, plain) = deepseek_fp8_pair(block, [H, F, E]);
        write(&dir.path().join("bf16.safetensors"), &plain);
        let fp8 = dir.path().join("fp8");
        std::fs::create_dir(&fp8).unwrap();
        write(&fp8.join("model.safetensors"), &quantized);
        if let Some(config) = config {
            std::fs::write(fp8.join("config.json"), config).unwrap();
        }
        for which in [
            ExpertSet::All,
            ExpertSet::Rank { rank: 1, ranks: 2 },
            ExpertSet::SharedSlices,
        ] {
            let load = |path: &Path| {
                let layer = CheckpointLayer::open(path, None, None).unwrap();
                assert_eq!(layer.family(), Family::DeepseekV3);
                let stored = if path.ends_with("fp8") {
                    ExpertStorage::Fp8 { block: Some(block) }
                } else {
                    ExpertStorage::Plain
                };
                assert_eq!(layer.storage(), stored);
                layer.load(&shape, which).unwrap()
            };
            let w = load(&fp8);
            assert_eq!(
                w,
                load(&dir.path().join("bf16.safetensors")),
                "block {block:?}, {which:?}"
            );
            assert!(w.w1.iter().any(|&b| b & 0x7fff != 0), "not all zero");
        }
    }
}

#[test]
fn large_fp8_matrices_dequantize_on_every_core_as_on_one() {
    // Gate and up [1100, 1000]: matrices the loader splits by rows over the cores (at least
    // 2^20 elements; on 2 to 8 cores each part but the first starts inside a row of blocks),
    // with 128 x 128 blocks, the last ones partial both ways, against the bf16 checkpoint
    // of their values.
    const HIDDEN: usize = 1000;
    const FFN: usize = 1100;
    let shape = LayerShape {
        hidden: HIDDEN as u32,
        ffn: FFN as u32,
        experts: 2,
        top_k: 1,
        shared_slices: 2,
        ..shape(Activation::Swiglu)
    };
    let dir = tempfile::tempdir().unwrap();
    let (quantized, plain) = deepseek_fp8_pair([128, 128], [HIDDEN, FFN, 2]);
    write(&dir.path().join("fp8.safetensors"), &quantized);
    write(&dir.path().join("bf16.safetensors"), &plain);
    let load = |name: &str| {
        Checkpoint::open(&dir.path().join(name))
            .unwrap()
            .load_experts(Family::DeepseekV3, PREFIX, &shape, ExpertSet::All)
            .unwrap()
    };
    assert!(load("fp8.safetensors") == load("bf16.safetensors"));
}

#[test]
fn large_mxfp4_layers_dequantize_on_every_core_as_on_one() {
    // 4 experts of H = 511, F = 257: 1.6 M codes, which the loader splits over the cores;
    // odd sizes, so each row's last block ends inside a byte.
    let (h, f) = (511, 257);
    let shape = LayerShape {
        hidden: h as u32,
        ffn: f as u32,
        expert_bias: true,
        ..shape(Activation::ClampedSwiglu)
    };
    let dir = tempfile::tempdir().unwrap();
    let (quantized, plain) = gpt_oss_mxfp4_pair(h, f);
    write(&dir.path().join("mxfp4.safetensors"), &quantized);
    write(&dir.path().join("bf16.safetensors"), &plain);
    let load = |name: &str| {
        Checkpoint::open(&dir.path().join(name))
            .unwrap()
            .load_experts(Family::GptOss, PREFIX, &shape, ExpertSet::All)
            .unwrap()
    };
    assert!(load("mxfp4.safetensors") == load("bf16.safetensors"));
}

#[test]
fn fp8_errors_name_the_scales_and_the_config() {
    let shape = LayerShape {
        shared_slices: 2,
        ..shape(Activation::Swiglu)
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let (quantized, _) = deepseek_fp8_pair([128, 128], [H, F, E]);
    let load = || {
        Checkpoint::open(&file)
            .unwrap()
            .load_experts(Family::DeepseekV3, PREFIX, &shape, ExpertSet::All)
            .unwrap_err()
    };
    let [gate, ..] = names(Family::DeepseekV3, PREFIX, 0);
    let scales = format!("{gate}_scale_inv");
    write(
        &file,
        &quantized
            .iter()
            .filter(|t| t.0 != scales)
            .cloned()
            .collect::<Vec<_>>(),
    );
    let err = load();
    assert!(
        matches!(&err, CheckpointError::MissingScales { tensor, scales: named, expected }
            if *tensor == gate && *named == scales && *expected == vec![1, 1]),
        "{err}"
    );
    assert!(err.to_string().contains("_scale_inv"), "{err}");

    // Scales for other blocks than the config's are a shape error naming them.
    write(&file, &quantized);
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"quantization_config": {"weight_block_size": [4, 4]}}"#,
    )
    .unwrap();
    let err = load();
    assert!(
        matches!(&err, CheckpointError::Shape { tensor, expected, found }
            if *tensor == scales && *expected == vec![F / 4, H / 4] && *found == vec![1, 1]),
        "{err}"
    );
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    assert!(matches!(load(), CheckpointError::Config { .. }));
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"quantization_config": {"weight_block_size": [0, 128]}}"#,
    )
    .unwrap();
    assert!(matches!(load(), CheckpointError::BlockSize { .. }));
}

/// Each dtype error says what that tensor is read as: FP8 block scales and biases as
/// values, GPT-OSS's fused matrices without FP8 (its quantized release is MXFP4).
#[test]
fn dtype_errors_say_what_each_tensor_is_read_as() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let retyped = |tensors: &[Tensor], name: &str, dtype: Dtype| -> Vec<Tensor> {
        tensors
            .iter()
            .map(|t| {
                let mut t = t.clone();
                if t.0 == name {
                    let elements: usize = t.2.iter().product();
                    t.1 = dtype;
                    t.3 = vec![0; elements * dtype.bitsize() / 8];
                }
                t
            })
            .collect()
    };
    let dtype_error = |err: CheckpointError| match err {
        CheckpointError::Dtype {
            tensor,
            found,
            readable,
        } => (tensor, found, readable),
        other => panic!("{other}"),
    };

    let (quantized, _) = deepseek_fp8_pair([128, 128], [H, F, E]);
    let [gate, ..] = names(Family::DeepseekV3, PREFIX, 0);
    let scales = format!("{gate}_scale_inv");
    write(&file, &retyped(&quantized, &scales, Dtype::U8));
    let fp8_shape = LayerShape {
        shared_slices: 2,
        ..shape(Activation::Swiglu)
    };
    let err = Checkpoint::open(&file)
        .unwrap()
        .load_experts(Family::DeepseekV3, PREFIX, &fp8_shape, ExpertSet::All)
        .unwrap_err();
    assert!(
        err.to_string()
            .ends_with("is U8; the loader reads it as F32, BF16 or F16 values"),
        "{err}"
    );
    assert_eq!(
        dtype_error(err),
        (scales, Dtype::U8, ReadableDtypes::Values)
    );

    let gate_up = format!("{PREFIX}mlp.experts.gate_up_proj");
    write(
        &file,
        &retyped(&gpt_oss_tensors(), &gate_up, Dtype::F8_E4M3),
    );
    let err = Checkpoint::open(&file)
        .unwrap()
        .load_experts(Family::GptOss, PREFIX, &gpt_oss_shape(), ExpertSet::All)
        .unwrap_err();
    assert!(!err.to_string().contains("F8_E4M3 with"), "{err}");
    assert_eq!(
        dtype_error(err),
        (gate_up, Dtype::F8_E4M3, ReadableDtypes::FusedMatrix)
    );

    let bias = format!("{PREFIX}mlp.gate.e_score_correction_bias");
    let mut tensors = expert_tensors(Family::DeepseekV3, 0..E);
    tensors.push(bf16_tensor(
        format!("{PREFIX}mlp.gate.weight"),
        vec![E, H],
        (0..E * H).map(|i| i as u16),
    ));
    tensors.push(bf16_tensor(bias.clone(), vec![E], 0..E as u16));
    write(&file, &retyped(&tensors, &bias, Dtype::I64));
    let err = Checkpoint::open(&file)
        .unwrap()
        .load_gate(
            Family::DeepseekV3,
            PREFIX,
            &shape(Activation::Swiglu),
            RouterBias::ScoreCorrection,
        )
        .unwrap_err();
    assert_eq!(dtype_error(err), (bias, Dtype::I64, ReadableDtypes::Values));
}

/// The layer's tensors a spec leaves unread are notes, not errors: shared experts without
/// a `shared_experts { }`, a router bias its rule does not add; nothing about the gate when
/// the spec has no router (the caller routes).
#[test]
fn tensors_the_spec_leaves_unread_are_noted() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let mut tensors = expert_tensors(Family::DeepseekV3, 0..E);
    tensors.extend(shared_tensors());
    tensors.push(bf16_tensor(
        format!("{PREFIX}mlp.gate.weight"),
        vec![E, H],
        (0..E * H).map(|i| i as u16),
    ));
    let bias = format!("{PREFIX}mlp.gate.e_score_correction_bias");
    tensors.push(bf16_tensor(bias.clone(), vec![E], 0..E as u16));
    write(&file, &tensors);
    let layer = CheckpointLayer::open(&file, None, None).unwrap();
    assert_eq!(layer.family(), Family::DeepseekV3);
    let routed_only = shape(Activation::Swiglu);
    let shared_note = format!(
        "the layer's shared experts (`{PREFIX}mlp.shared_experts.down_proj.weight`, \
         `{PREFIX}mlp.shared_experts.gate_proj.weight`, `{PREFIX}mlp.shared_experts.up_proj.weight`) \
         are not read: the spec has no `shared_experts {{ }}`, so the layer computes its routed experts only"
    );
    let bias_note = format!(
        "the router's bias `{bias}` is not read: the spec's router has no `bias = score_correction`, \
         so it chooses experts without it"
    );
    assert_eq!(
        layer.unused_tensors(&routed_only, None),
        std::slice::from_ref(&shared_note)
    );
    assert_eq!(
        layer.unused_tensors(&routed_only, Some(RouterBias::None)),
        [shared_note, bias_note]
    );
    let whole = LayerShape {
        shared_slices: 2,
        ..routed_only
    };
    assert!(
        layer
            .unused_tensors(&whole, Some(RouterBias::ScoreCorrection))
            .is_empty()
    );

    // Qwen2-MoE's gated shared expert, and GPT-OSS's router bias under a rule without one.
    let mut tensors = expert_tensors(Family::Qwen2Moe, 0..E);
    tensors.extend(qwen2_shared_tensors());
    write(&file, &tensors);
    let layer = CheckpointLayer::open(&file, None, None).unwrap();
    let notes = layer.unused_tensors(&routed_only, None);
    assert!(
        notes.len() == 1 && notes[0].contains("mlp.shared_expert_gate.weight"),
        "{notes:?}"
    );
    let mut tensors = gpt_oss_tensors();
    tensors.push(bf16_tensor(
        format!("{PREFIX}mlp.router.bias"),
        vec![E],
        0..E as u16,
    ));
    write(&file, &tensors);
    let layer = CheckpointLayer::open(&file, None, None).unwrap();
    assert!(
        layer
            .unused_tensors(&gpt_oss_shape(), Some(RouterBias::Logits))
            .is_empty()
    );
    assert_eq!(
        layer.unused_tensors(&gpt_oss_shape(), Some(RouterBias::None)),
        [format!(
            "the router's bias `{PREFIX}mlp.router.bias` is not read: the spec's router has no \
             `bias = logits`, so it chooses experts without it"
        )]
    );
    assert!(layer.unused_tensors(&gpt_oss_shape(), None).is_empty());
}

/// DeepSeek-V3's shared experts, one MLP of FFN 2F: `gate_proj`/`up_proj` [2F, H] and
/// `down_proj` [H, 2F] under `mlp.shared_experts`, values from [`value`] as expert E.
fn shared_tensors() -> [Tensor; 3] {
    let name = |p: &str| format!("{PREFIX}mlp.shared_experts.{p}.weight");
    [
        bf16_tensor(
            name("gate_proj"),
            vec![2 * F, H],
            (0..2 * F * H).map(|i| value(E, 0, i)),
        ),
        bf16_tensor(
            name("up_proj"),
            vec![2 * F, H],
            (0..2 * F * H).map(|i| value(E, 1, i)),
        ),
        bf16_tensor(
            name("down_proj"),
            vec![H, 2 * F],
            (0..2 * H * F).map(|i| value(E, 2, i)),
        ),
    ]
}

#[test]
fn shared_experts_load_as_slices_of_the_routed_ffn_and_write_back() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let mut tensors = expert_tensors(Family::DeepseekV3, 0..E);
    tensors.extend(shared_tensors());
    write(&file, &tensors);
    let layer = LayerShape {
        shared_slices: 2,
        shared_gated: false,
        ..shape(Activation::Swiglu)
    };
    let checkpoint = Checkpoint::open(&file).unwrap();
    let all = checkpoint
        .load_experts(Family::DeepseekV3, PREFIX, &layer, ExpertSet::All)
        .unwrap();
    assert_eq!(all.experts, 0..E as u32 + 2);
    let routed = HostWeights {
        experts: 0..E as u32,
        w1: all.w1[..E * 2 * F * H].to_vec(),
        w2: all.w2[..E * H * F].to_vec(),
        biases: None,
        shared_gate: None,
    };
    check_layout(&routed);
    // Slice s: gate and up rows s·F.., down columns s·F.. of the one shared MLP.
    for s in 0..2 {
        let w1 = &all.w1[(E + s) * 2 * F * H..(E + s + 1) * 2 * F * H];
        let w2 = &all.w2[(E + s) * H * F..(E + s + 1) * H * F];
        for f in 0..F {
            for h in 0..H {
                assert_eq!(
                    w1[f * H + h],
                    value(E, 0, (s * F + f) * H + h),
                    "gate {s} {f} {h}"
                );
                assert_eq!(
                    w1[(F + f) * H + h],
                    value(E, 1, (s * F + f) * H + h),
                    "up {s} {f} {h}"
                );
                assert_eq!(
                    w2[h * F + f],
                    value(E, 2, h * 2 * F + s * F + f),
                    "down {s} {h} {f}"
                );
            }
        }
    }
    // A rank's share is routed experts only: no shared tensor is read.
    let rank = checkpoint
        .load_experts(
            Family::DeepseekV3,
            PREFIX,
            &layer,
            ExpertSet::Rank { rank: 1, ranks: 2 },
        )
        .unwrap();
    assert_eq!(rank.experts, 2..4);
    // Written back under the family's names, they read back bit for bit.
    let copy = dir.path().join("copy.safetensors");
    write_experts(&copy, Family::DeepseekV3, PREFIX, &layer, &all).unwrap();
    let reread = Checkpoint::open(&copy)
        .unwrap()
        .load_experts(Family::DeepseekV3, PREFIX, &layer, ExpertSet::All)
        .unwrap();
    assert_eq!(reread, all);
}

#[test]
fn shared_experts_missing_or_foreign_to_the_family_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let layer = LayerShape {
        shared_slices: 2,
        shared_gated: false,
        ..shape(Activation::Swiglu)
    };
    write(&file, &expert_tensors(Family::DeepseekV3, 0..E));
    let checkpoint = Checkpoint::open(&file).unwrap();
    let err = checkpoint
        .load_experts(Family::DeepseekV3, PREFIX, &layer, ExpertSet::All)
        .unwrap_err();
    match &err {
        CheckpointError::MissingTensor {
            tensor, expected, ..
        } => {
            assert_eq!(
                tensor,
                &format!("{PREFIX}mlp.shared_experts.gate_proj.weight")
            );
            assert_eq!(expected, &vec![2 * F, H]);
        }
        other => panic!("expected a missing shared tensor, got {other}"),
    }
    for family in [Family::Mixtral, Family::Qwen3Moe] {
        write(&file, &expert_tensors(family, 0..E));
        let err = Checkpoint::open(&file)
            .unwrap()
            .load_experts(family, PREFIX, &layer, ExpertSet::All)
            .unwrap_err();
        assert!(
            matches!(err, CheckpointError::NoSharedExperts { family: f } if f == family),
            "{err}"
        );
        assert!(err.to_string().contains("shared_experts"), "{err}");
    }
}

mod corrupted {
    //! Files a user may hand over by mistake: tensors reshaped to other factorisations of
    //! their elements, other dtypes of the same width, renamed, or the file cut short or with
    //! bytes changed anywhere. Loading them is a typed error (or, where the change keeps
    //! every tensor as expected, the weights), never a panic.

    use super::*;
    use proptest::prelude::*;

    /// Every shape whose elements multiply to `elements`: 1-D, and 2-D and 3-D splits.
    fn reshapes(elements: usize) -> Vec<Vec<usize>> {
        let divisors: Vec<usize> = (1..=elements)
            .filter(|&d| elements.is_multiple_of(d))
            .collect();
        let mut shapes = vec![vec![elements]];
        for &a in &divisors {
            shapes.push(vec![a, elements / a]);
            for &b in divisors
                .iter()
                .filter(|&&b| (elements / a).is_multiple_of(b))
            {
                shapes.push(vec![a, b, elements / a / b]);
            }
        }
        shapes
    }

    /// Loads everything a `run --weights` of the family reads: the experts (all, and a
    /// rank's share) and the gate with each kind of bias.
    fn load_all(path: &Path, family: Family) {
        let Ok(checkpoint) = Checkpoint::open(path) else {
            return;
        };
        let _ = checkpoint.detect(PREFIX);
        let _ = checkpoint.expert_layers();
        let shape = shape(Activation::Swiglu);
        for which in ExpertSet::held_by_rank(1, 2)
            .into_iter()
            .chain([ExpertSet::All])
        {
            let _ = checkpoint.load_experts(family, PREFIX, &shape, which);
        }
        for bias in [
            RouterBias::None,
            RouterBias::Logits,
            RouterBias::ScoreCorrection,
        ] {
            let _ = checkpoint.load_gate(family, PREFIX, &shape, bias);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn reshaped_retyped_or_renamed_tensors_are_errors_not_panics(
            family in prop::sample::select(vec![Family::Mixtral, Family::Qwen3Moe, Family::DeepseekV3]),
            which in 0usize..(3 * E + 1),
            change in 0usize..3,
            pick in any::<prop::sample::Index>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("model.safetensors");
            let mut tensors = expert_tensors(family, 0..E);
            let count = tensors.len();
            let tensor = &mut tensors[which % count];
            let elements: usize = tensor.2.iter().product();
            match change {
                0 => tensor.2 = pick.get(&reshapes(elements)).clone(),
                1 => tensor.1 = *pick.get(&[Dtype::F16, Dtype::I16, Dtype::U16]),
                _ => tensor.0.push_str(".renamed"),
            }
            write(&file, &tensors);
            load_all(&file, family);
        }

        #[test]
        fn cut_or_changed_bytes_are_errors_not_panics(
            family in prop::sample::select(vec![Family::Mixtral, Family::Qwen3Moe, Family::DeepseekV3]),
            cut in any::<prop::sample::Index>(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            header_only in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("model.safetensors");
            write(&file, &expert_tensors(family, 0..E));
            let mut bytes = std::fs::read(&file).unwrap();
            // The header: an 8-byte length, then that much JSON.
            let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            for (at, value) in flips {
                let span = if header_only { header } else { bytes.len() };
                bytes[at.index(span)] = value;
            }
            if header_only {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            std::fs::write(&file, &bytes).unwrap();
            load_all(&file, family);
        }

        #[test]
        fn quantized_tensors_reshaped_retyped_or_renamed_are_errors_not_panics(
            mxfp4 in any::<bool>(),
            which in any::<prop::sample::Index>(),
            change in 0usize..3,
            pick in any::<prop::sample::Index>(),
        ) {
            // DeepSeek-V3's FP8 release (codes and their block scales) or gpt-oss's MXFP4 one
            // (blocks, scales and biases), one tensor of it changed.
            let (mut tensors, shape, family) = if mxfp4 {
                let shape = LayerShape {
                    hidden: 48,
                    ffn: 24,
                    expert_bias: true,
                    ..shape(Activation::ClampedSwiglu)
                };
                (gpt_oss_mxfp4_pair(48, 24).0, shape, Family::GptOss)
            } else {
                let shape = LayerShape {
                    shared_slices: 2,
                    ..shape(Activation::Swiglu)
                };
                (deepseek_fp8_pair([128, 128], [H, F, E]).0, shape, Family::DeepseekV3)
            };
            let count = tensors.len();
            let tensor = &mut tensors[which.index(count)];
            let elements: usize = tensor.2.iter().product();
            match change {
                0 => tensor.2 = pick.get(&reshapes(elements)).clone(),
                1 => {
                    // Another dtype of the same width, so that the file stays well formed.
                    let width = tensor.1.bitsize();
                    let same: Vec<Dtype> = [
                        Dtype::U8, Dtype::I8, Dtype::F8_E5M2, Dtype::F8_E4M3, Dtype::BF16,
                        Dtype::F16, Dtype::I16, Dtype::F32, Dtype::I32, Dtype::U32,
                    ]
                    .into_iter()
                    .filter(|d| d.bitsize() == width)
                    .collect();
                    tensor.1 = *pick.get(&same);
                }
                _ => tensor.0.push_str(".renamed"),
            }
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("model.safetensors");
            write(&file, &tensors);
            let Ok(layer) = CheckpointLayer::open(&file, None, Some(family)) else {
                return Ok(());
            };
            let _ = layer.storage();
            for which in [ExpertSet::All, ExpertSet::Rank { rank: 1, ranks: 2 }] {
                let _ = layer.load(&shape, which);
            }
        }
    }
}

/// Qwen2-MoE's shared MLP (`mlp.shared_expert.*`, singular) with its gate
/// `mlp.shared_expert_gate.weight` [1, H], as its checkpoints name them.
fn qwen2_shared_tensors() -> [Tensor; 4] {
    let name = |p: &str| format!("{PREFIX}mlp.shared_expert.{p}.weight");
    let [gate, up, down] = shared_tensors().map(|(_, _, shape, bytes)| (shape, bytes));
    [
        (name("gate_proj"), Dtype::BF16, gate.0, gate.1),
        (name("up_proj"), Dtype::BF16, up.0, up.1),
        (name("down_proj"), Dtype::BF16, down.0, down.1),
        bf16_tensor(
            format!("{PREFIX}mlp.shared_expert_gate.weight"),
            vec![1, H],
            (0..H).map(|i| value(E + 1, 3, i)),
        ),
    ]
}

/// A Qwen2-MoE layer is told from a Qwen3-MoE one by its shared expert gate; its shared
/// MLP loads as the slices DeepSeek-V3's does, and its gate with them for a spec that says
/// `gated = true` (the gate goes with the shared slices, not a rank's routed experts), bit
/// for bit, written back and read again. A spec that does not gate a gated family's shared
/// expert, or gates another family's, is an error saying which way to fix it.
#[test]
fn qwen2_moe_reads_its_gated_shared_expert() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let mut tensors = expert_tensors(Family::Qwen2Moe, 0..E);
    tensors.extend(qwen2_shared_tensors());
    write(&file, &tensors);
    let checkpoint = Checkpoint::open(&file).unwrap();
    assert_eq!(checkpoint.detect(PREFIX), [Family::Qwen2Moe]);
    let gated = LayerShape {
        shared_slices: 2,
        shared_gated: true,
        ..shape(Activation::Swiglu)
    };
    let all = checkpoint
        .load_experts(Family::Qwen2Moe, PREFIX, &gated, ExpertSet::All)
        .unwrap();
    let want: Vec<u16> = (0..H).map(|i| value(E + 1, 3, i)).collect();
    assert_eq!(all.shared_gate.as_deref(), Some(want.as_slice()));
    // The same slices as DeepSeek-V3's named `mlp.shared_experts`.
    let mut deepseek = expert_tensors(Family::DeepseekV3, 0..E);
    deepseek.extend(shared_tensors());
    let deepseek_file = dir.path().join("deepseek.safetensors");
    write(&deepseek_file, &deepseek);
    let ungated = LayerShape {
        shared_gated: false,
        ..gated.clone()
    };
    let slices = Checkpoint::open(&deepseek_file)
        .unwrap()
        .load_experts(Family::DeepseekV3, PREFIX, &ungated, ExpertSet::All)
        .unwrap();
    assert_eq!((&all.w1, &all.w2), (&slices.w1, &slices.w2));
    // The reference weighs the shared slices, and only them, by the gate.
    assert!(all.expert(&gated, E).shared_gate.is_some());
    assert!(all.expert(&gated, E - 1).shared_gate.is_none());
    let shared = checkpoint
        .load_experts(Family::Qwen2Moe, PREFIX, &gated, ExpertSet::SharedSlices)
        .unwrap();
    assert_eq!(shared.shared_gate, all.shared_gate);
    let rank = checkpoint
        .load_experts(
            Family::Qwen2Moe,
            PREFIX,
            &gated,
            ExpertSet::Rank { rank: 0, ranks: 2 },
        )
        .unwrap();
    assert_eq!(rank.shared_gate, None);
    assert_eq!(all.select(&gated, ExpertSet::SharedSlices).unwrap(), shared);
    let copy = dir.path().join("copy.safetensors");
    write_experts(&copy, Family::Qwen2Moe, PREFIX, &gated, &all).unwrap();
    let reread = Checkpoint::open(&copy).unwrap();
    assert_eq!(reread.detect(PREFIX), [Family::Qwen2Moe]);
    assert_eq!(
        reread
            .load_experts(Family::Qwen2Moe, PREFIX, &gated, ExpertSet::All)
            .unwrap(),
        all
    );

    let err = checkpoint
        .load_experts(Family::Qwen2Moe, PREFIX, &ungated, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::SharedGate { gated: true, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("set `gated = true`"), "{err}");
    let err = Checkpoint::open(&deepseek_file)
        .unwrap()
        .load_experts(Family::DeepseekV3, PREFIX, &gated, ExpertSet::All)
        .unwrap_err();
    assert!(
        matches!(err, CheckpointError::SharedGate { gated: false, .. }),
        "{err}"
    );
    // Host weights with a gate they may not hold, or without one they need, are refused.
    let mut stray = slices.clone();
    stray.shared_gate = Some(want);
    assert!(matches!(
        stray.check(&ungated),
        Err(CheckpointError::HostSharedGate { needed: false })
    ));
    assert!(matches!(
        slices.check(&gated),
        Err(CheckpointError::HostSharedGate { needed: true })
    ));
}
