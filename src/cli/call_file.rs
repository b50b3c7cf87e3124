//! `run --inputs FILE` and `run --outputs FILE`: a call's activations (and, optionally, the
//! caller's routing) read from a safetensors file instead of drawn at random, and what the
//! call produced written to one (see [`moeforge::runtime::call_file`] for the tensors).
//! Turns each error into a message, a hint and an exit status.

use std::path::Path;
use std::process::ExitCode;

use moeforge::compiler::plan::LayerShape;
use moeforge::runtime::call_file::{self, CallFileError, CallInputs, CallOutputs};

use super::{invalid_input, usage_error};

/// The inputs in `path` for a layer of `shape`, said on stderr, or the exit status after
/// reporting why not.
pub fn read(path: &Path, shape: &LayerShape, has_router: bool) -> Result<CallInputs, ExitCode> {
    let inputs = call_file::read_inputs(path, shape, has_router).map_err(|error| report(&error))?;
    eprintln!(
        "read {} tokens from {}{}",
        inputs.tokens,
        path.display(),
        if inputs.routing.is_some() {
            ", with the caller's topk_ids and topk_weights"
        } else {
            ""
        }
    );
    Ok(inputs)
}

/// Writes `outputs` to `path`, said on stderr, or the exit status after reporting why not.
pub fn write(path: &Path, shape: &LayerShape, outputs: &CallOutputs) -> Result<(), ExitCode> {
    call_file::write_outputs(path, shape, outputs).map_err(|error| report(&error))?;
    eprintln!(
        "wrote y, topk_ids, topk_weights{} to {}",
        if outputs.router_logits.is_some() {
            ", router_logits"
        } else {
            ""
        },
        path.display()
    );
    Ok(())
}

/// Prints `error` and its hint; returns the exit status: 2 when a file cannot be read or
/// written, 1 when the inputs do not fit the layer.
fn report(error: &CallFileError) -> ExitCode {
    eprintln!("error: {error}");
    if let Some(hint) = hint(error) {
        eprintln!("hint: {hint}");
    }
    match error {
        CallFileError::Io { .. } | CallFileError::Write { .. } => usage_error(),
        _ => invalid_input(),
    }
}

fn hint(error: &CallFileError) -> Option<&'static str> {
    Some(match error {
        CallFileError::MissingX { .. } | CallFileError::Format { .. } => {
            "--inputs takes a safetensors file holding `x` [tokens, hidden] BF16, and optionally \
             `topk_ids` [tokens, top_k] I32 with `topk_weights` [tokens, top_k] F32"
        }
        CallFileError::Dtype { tensor: "x", .. } => {
            "store x as bfloat16 (torch: x.to(torch.bfloat16)); it is not converted, so that both \
             programs see the same bits"
        }
        CallFileError::Dtype {
            tensor: "topk_ids", ..
        } => "store topk_ids as int32 (torch.topk returns int64: .to(torch.int32))",
        CallFileError::Dtype { .. } => "store topk_weights as float32",
        CallFileError::XShape { .. } => {
            "x is one row per token: flatten batch and sequence into [tokens, hidden]"
        }
        CallFileError::TooManyTokens { .. } => "raise max_tokens in the spec, or pass fewer tokens",
        CallFileError::HalfRouting { .. } | CallFileError::NoRouting { .. } => {
            "write both topk_ids and topk_weights, or neither and give the spec a `router { }`"
        }
        CallFileError::RoutingShape { .. } => "one row per token of x, top_k columns",
        CallFileError::ExpertOutOfRange { .. } => {
            "expert ids count from 0 and must be below the spec's `experts`"
        }
        CallFileError::Io { .. } | CallFileError::Write { .. } => return None,
    })
}
