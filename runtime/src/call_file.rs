//! One forward call's inputs and outputs as safetensors files, so that a call can run on
//! activations another program made (a model's reference implementation, a recorded
//! batch) and its results be read back by that program.
//!
//! [`read_inputs`] reads `x` [T, H] (BF16) and, optionally, the caller's routing:
//! `topk_ids` [T, K] (I32, each in `0..E`) and `topk_weights` [T, K] (F32), both or
//! neither. Without them the layer must have a router, which then chooses. T is `x`'s
//! first dimension, at most the layer's `max_tokens`. Every tensor's presence, dtype and
//! shape is checked, and each failure is a [`CallFileError`] naming the file, the tensor
//! and what the layer needs. Dtypes are taken exactly as stated, never converted: the point
//! of the file is that both programs see the same bits.
//!
//! [`write_outputs`] writes what a call produced ([`CallOutputs`]): `y` [T, H] BF16, the
//! routing the layer used (`topk_ids` [T, K] I32, `topk_weights` [T, K] F32: the caller's
//! or the router's) and, for a call that routed itself, `router_logits` [T, E] F32.

use std::path::{Path, PathBuf};

use moeforge_compiler::plan::LayerShape;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};
use thiserror::Error;

/// The inputs of one call read from a file.
#[derive(Clone, Debug, PartialEq)]
pub struct CallInputs {
    pub tokens: u32,
    /// bf16 bits, [T, H].
    pub x: Vec<u16>,
    /// The caller's choice of experts, when the file holds one.
    pub routing: Option<GivenRouting>,
}

/// Experts and weights the caller chose for every token.
#[derive(Clone, Debug, PartialEq)]
pub struct GivenRouting {
    /// [T, K], each in `0..E`.
    pub topk_ids: Vec<i32>,
    /// [T, K].
    pub topk_weights: Vec<f32>,
}

/// What one call produced, on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct CallOutputs {
    pub tokens: u32,
    /// bf16 bits, [T, H].
    pub y: Vec<u16>,
    /// [T, K]: the experts the call used (the caller's, or the router's, best first).
    pub topk_ids: Vec<i32>,
    /// [T, K].
    pub topk_weights: Vec<f32>,
    /// [T, E], f32: the router's logits, for a call that routed itself.
    pub router_logits: Option<Vec<f32>>,
}

#[derive(Debug, Error)]
pub enum CallFileError {
    #[error("cannot read the inputs {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the inputs {} are not a safetensors file: {source}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
    #[error("the inputs {} hold no tensor `x` (the activations, [tokens, {hidden}] BF16); they hold {}", path.display(), listed(found))]
    MissingX {
        path: PathBuf,
        hidden: u32,
        found: Vec<String>,
    },
    #[error("tensor `{tensor}` of {} is {found:?}; it must be {expected:?}", path.display())]
    Dtype {
        path: PathBuf,
        tensor: &'static str,
        expected: Dtype,
        found: Dtype,
    },
    #[error("tensor `x` of {} has shape {found:?}; the layer needs [tokens, {hidden}]", path.display())]
    XShape {
        path: PathBuf,
        hidden: u32,
        found: Vec<usize>,
    },
    #[error("tensor `x` of {} holds {tokens} tokens, more than the layer's max_tokens of {max_tokens}", path.display())]
    TooManyTokens {
        path: PathBuf,
        tokens: usize,
        max_tokens: u32,
    },
    #[error("tensor `{tensor}` of {} has shape {found:?}; the layer needs {expected:?} (x's tokens, top_k)", path.display())]
    RoutingShape {
        path: PathBuf,
        tensor: &'static str,
        expected: [usize; 2],
        found: Vec<usize>,
    },
    #[error("the inputs {} hold `{present}` but not `{absent}`: the caller's routing needs both", path.display())]
    HalfRouting {
        path: PathBuf,
        present: &'static str,
        absent: &'static str,
    },
    #[error("the inputs {} hold no routing (`topk_ids`, `topk_weights`) and the layer has no router to choose experts", path.display())]
    NoRouting { path: PathBuf },
    #[error("`topk_ids` of {} gives token {token} expert {id} (choice {choice}); the layer has experts 0..{experts}", path.display())]
    ExpertOutOfRange {
        path: PathBuf,
        token: usize,
        choice: usize,
        id: i32,
        experts: u32,
    },
    #[error("cannot write the outputs {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
}

/// The names of `found`, quoted, or "no tensor".
fn listed(found: &[String]) -> String {
    if found.is_empty() {
        return "no tensor".to_owned();
    }
    let quoted: Vec<String> = found.iter().map(|name| format!("`{name}`")).collect();
    quoted.join(", ")
}

/// Reads a call's inputs for a layer of `shape` from `path`; `has_router` says whether the
/// layer can choose experts itself (else the file must hold the caller's routing).
pub fn read_inputs(
    path: &Path,
    shape: &LayerShape,
    has_router: bool,
) -> Result<CallInputs, CallFileError> {
    let bytes = std::fs::read(path).map_err(|source| CallFileError::Io {
        path: path.to_owned(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|source| CallFileError::Format {
        path: path.to_owned(),
        source,
    })?;
    let x = file.tensor("x").map_err(|_| {
        let mut found: Vec<String> = file.names().into_iter().map(str::to_owned).collect();
        found.sort();
        CallFileError::MissingX {
            path: path.to_owned(),
            hidden: shape.hidden,
            found,
        }
    })?;
    expect_dtype(path, "x", &x, Dtype::BF16)?;
    let tokens = match x.shape() {
        &[tokens, hidden] if hidden == shape.hidden as usize => tokens,
        found => {
            return Err(CallFileError::XShape {
                path: path.to_owned(),
                hidden: shape.hidden,
                found: found.to_vec(),
            });
        }
    };
    if tokens > shape.max_tokens as usize {
        return Err(CallFileError::TooManyTokens {
            path: path.to_owned(),
            tokens,
            max_tokens: shape.max_tokens,
        });
    }
    let x_bits = x
        .data()
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let routing = match (
        file.tensor("topk_ids").ok(),
        file.tensor("topk_weights").ok(),
    ) {
        (Some(ids), Some(weights)) => Some(read_routing(path, shape, tokens, &ids, &weights)?),
        (None, None) if has_router => None,
        (None, None) => {
            return Err(CallFileError::NoRouting {
                path: path.to_owned(),
            });
        }
        (Some(_), None) => {
            return Err(CallFileError::HalfRouting {
                path: path.to_owned(),
                present: "topk_ids",
                absent: "topk_weights",
            });
        }
        (None, Some(_)) => {
            return Err(CallFileError::HalfRouting {
                path: path.to_owned(),
                present: "topk_weights",
                absent: "topk_ids",
            });
        }
    };
    Ok(CallInputs {
        // At most max_tokens, a u32.
        tokens: tokens as u32,
        x: x_bits,
        routing,
    })
}

fn expect_dtype(
    path: &Path,
    tensor: &'static str,
    view: &TensorView<'_>,
    expected: Dtype,
) -> Result<(), CallFileError> {
    if view.dtype() == expected {
        Ok(())
    } else {
        Err(CallFileError::Dtype {
            path: path.to_owned(),
            tensor,
            expected,
            found: view.dtype(),
        })
    }
}

fn read_routing(
    path: &Path,
    shape: &LayerShape,
    tokens: usize,
    ids: &TensorView<'_>,
    weights: &TensorView<'_>,
) -> Result<GivenRouting, CallFileError> {
    let expected = [tokens, shape.top_k as usize];
    for (tensor, view, dtype) in [
        ("topk_ids", ids, Dtype::I32),
        ("topk_weights", weights, Dtype::F32),
    ] {
        expect_dtype(path, tensor, view, dtype)?;
        if view.shape() != expected {
            return Err(CallFileError::RoutingShape {
                path: path.to_owned(),
                tensor,
                expected,
                found: view.shape().to_vec(),
            });
        }
    }
    let four = |b: &[u8]| [b[0], b[1], b[2], b[3]];
    let topk_ids: Vec<i32> = ids
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(four(b)))
        .collect();
    let k = shape.top_k as usize;
    if let Some((at, &id)) = topk_ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| u32::try_from(id).map_or(true, |id| id >= shape.experts))
    {
        return Err(CallFileError::ExpertOutOfRange {
            path: path.to_owned(),
            token: at / k,
            choice: at % k,
            id,
            experts: shape.experts,
        });
    }
    let topk_weights = weights
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(four(b)))
        .collect();
    Ok(GivenRouting {
        topk_ids,
        topk_weights,
    })
}

/// Writes `outputs` of a call of a layer of `shape` to `path` (see the module's
/// documentation for the tensors).
pub fn write_outputs(
    path: &Path,
    shape: &LayerShape,
    outputs: &CallOutputs,
) -> Result<(), CallFileError> {
    let t = outputs.tokens as usize;
    let (h, k, e) = (
        shape.hidden as usize,
        shape.top_k as usize,
        shape.experts as usize,
    );
    let y: Vec<u8> = outputs.y[..t * h]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let ids: Vec<u8> = outputs.topk_ids[..t * k]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let weights: Vec<u8> = outputs.topk_weights[..t * k]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let logits: Option<Vec<u8>> = outputs
        .router_logits
        .as_ref()
        .map(|l| l[..t * e].iter().flat_map(|v| v.to_le_bytes()).collect());
    let write_error = |source| CallFileError::Write {
        path: path.to_owned(),
        source,
    };
    let mut views = vec![
        ("y", TensorView::new(Dtype::BF16, vec![t, h], &y)),
        ("topk_ids", TensorView::new(Dtype::I32, vec![t, k], &ids)),
        (
            "topk_weights",
            TensorView::new(Dtype::F32, vec![t, k], &weights),
        ),
    ];
    if let Some(logits) = &logits {
        views.push((
            "router_logits",
            TensorView::new(Dtype::F32, vec![t, e], logits),
        ));
    }
    let views = views
        .into_iter()
        .map(|(name, view)| view.map(|view| (name, view)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(write_error)?;
    safetensors::serialize_to_file(views, None, path).map_err(write_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeforge_compiler::ir::Activation;

    fn shape() -> LayerShape {
        LayerShape {
            hidden: 64,
            ffn: 64,
            experts: 4,
            top_k: 2,
            activation: Activation::Swiglu,
            max_tokens: 8,
            shared_slices: 0,
            shared_gated: false,
            spec_ranks: 1,
            executed_ranks: 1,
            expert_bias: false,
        }
    }

    /// A file of `tensors` (name, dtype, shape), each filled with `fill` bytes.
    fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>)], fill: u8) {
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, dtype, dims)| {
                vec![fill; dims.iter().product::<usize>() * dtype.bitsize() / 8]
            })
            .collect();
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, dtype, dims), bytes)| {
                (*name, TensorView::new(*dtype, dims.clone(), bytes).unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn outputs_written_read_back_as_inputs_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("call.safetensors");
        let shape = shape();
        let outputs = CallOutputs {
            tokens: 3,
            y: (0..3 * 64).map(|v| v as u16).collect(),
            topk_ids: vec![0, 3, 2, 1, 1, 0],
            topk_weights: vec![0.75, 0.25, 0.5, 0.5, 0.875, 0.125],
            router_logits: Some((0..12).map(|v| v as f32 - 6.0).collect()),
        };
        write_outputs(&path, &shape, &outputs).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(file.tensor("router_logits").unwrap().shape(), [3, 4]);
        // Renaming `y` to `x` makes the outputs another call's inputs.
        let y = file.tensor("y").unwrap();
        let ids = file.tensor("topk_ids").unwrap();
        let weights = file.tensor("topk_weights").unwrap();
        let inputs_path = dir.path().join("inputs.safetensors");
        safetensors::serialize_to_file(
            [("x", y), ("topk_ids", ids), ("topk_weights", weights)],
            None,
            &inputs_path,
        )
        .unwrap();
        let inputs = read_inputs(&inputs_path, &shape, false).unwrap();
        assert_eq!(inputs.tokens, 3);
        assert_eq!(inputs.x, outputs.y);
        assert_eq!(
            inputs.routing,
            Some(GivenRouting {
                topk_ids: outputs.topk_ids,
                topk_weights: outputs.topk_weights
            })
        );
    }

    #[test]
    fn x_alone_is_enough_for_a_layer_with_a_router() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &[("x", Dtype::BF16, vec![0, 64])], 0);
        let inputs = read_inputs(&path, &shape(), true).unwrap();
        assert_eq!((inputs.tokens, inputs.x.len()), (0, 0));
        assert_eq!(inputs.routing, None);
        assert!(matches!(
            read_inputs(&path, &shape(), false),
            Err(CallFileError::NoRouting { .. })
        ));
    }

    #[test]
    fn every_wrong_input_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let shape = shape();
        let case = |name: &str, tensors: &[(&str, Dtype, Vec<usize>)], fill: u8| {
            let path = dir.path().join(format!("{name}.safetensors"));
            write(&path, tensors, fill);
            read_inputs(&path, &shape, true).expect_err(name)
        };
        let x = ("x", Dtype::BF16, vec![5, 64]);
        let ids = ("topk_ids", Dtype::I32, vec![5, 2]);
        let weights = ("topk_weights", Dtype::F32, vec![5, 2]);
        assert!(matches!(
            case("no_x", &[("y", Dtype::BF16, vec![5, 64])], 0),
            CallFileError::MissingX { found, .. } if found == ["y"]
        ));
        assert!(matches!(
            case("x_f32", &[("x", Dtype::F32, vec![5, 64])], 0),
            CallFileError::Dtype {
                tensor: "x",
                expected: Dtype::BF16,
                found: Dtype::F32,
                ..
            }
        ));
        assert!(matches!(
            case("x_transposed", &[("x", Dtype::BF16, vec![64, 5])], 0),
            CallFileError::XShape { found, .. } if found == [64, 5]
        ));
        assert!(matches!(
            case("x_3d", &[("x", Dtype::BF16, vec![1, 5, 64])], 0),
            CallFileError::XShape { .. }
        ));
        assert!(matches!(
            case("too_many", &[("x", Dtype::BF16, vec![9, 64])], 0),
            CallFileError::TooManyTokens {
                tokens: 9,
                max_tokens: 8,
                ..
            }
        ));
        assert!(matches!(
            case("half", &[x.clone(), ids.clone()], 0),
            CallFileError::HalfRouting {
                present: "topk_ids",
                absent: "topk_weights",
                ..
            }
        ));
        assert!(matches!(
            case(
                "ids_i64",
                &[
                    x.clone(),
                    ("topk_ids", Dtype::I64, vec![5, 2]),
                    weights.clone()
                ],
                0
            ),
            CallFileError::Dtype {
                tensor: "topk_ids",
                found: Dtype::I64,
                ..
            }
        ));
        assert!(matches!(
            case(
                "weights_short",
                &[x.clone(), ids.clone(), ("topk_weights", Dtype::F32, vec![4, 2])],
                0
            ),
            CallFileError::RoutingShape { tensor: "topk_weights", expected: [5, 2], found, .. }
                if found == [4, 2]
        ));
        // Every byte 1: expert 0x01010101.
        assert!(matches!(
            case("out_of_range", &[x, ids, weights], 1),
            CallFileError::ExpertOutOfRange {
                token: 0,
                choice: 0,
                id: 0x0101_0101,
                experts: 4,
                ..
            }
        ));
        let garbage = dir.path().join("garbage.safetensors");
        std::fs::write(&garbage, b"not safetensors").unwrap();
        assert!(matches!(
            read_inputs(&garbage, &shape, true),
            Err(CallFileError::Format { .. })
        ));
        assert!(matches!(
            read_inputs(&dir.path().join("absent.safetensors"), &shape, true),
            Err(CallFileError::Io { .. })
        ));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any mix of the three tensors, each of any dtype, rank and size, filled with any
        /// byte: an input or a typed error, never a panic.
        #[test]
        fn any_tensors_are_inputs_or_typed_errors(
            tensors in proptest::collection::vec(
                (
                    0usize..4,
                    0usize..5,
                    proptest::collection::vec(0usize..70, 0..4),
                ),
                0..4,
            ),
            fill in proptest::prelude::any::<u8>(),
            has_router in proptest::prelude::any::<bool>(),
        ) {
            let names = ["x", "topk_ids", "topk_weights", "other"];
            let dtypes = [Dtype::BF16, Dtype::F32, Dtype::I32, Dtype::F16, Dtype::U8];
            let mut chosen: Vec<(&str, Dtype, Vec<usize>)> = Vec::new();
            for (name, dtype, dims) in tensors {
                if chosen.iter().all(|(n, _, _)| *n != names[name]) {
                    chosen.push((names[name], dtypes[dtype], dims));
                }
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("call.safetensors");
            write(&path, &chosen, fill);
            let _ = read_inputs(&path, &shape(), has_router);
        }
    }
}
