//! TMA tensor maps: what the warp-specialised GEMMs read their weights through. A map
//! describes a bf16 matrix in device memory and the box one copy moves (a tile's rows by
//! 64 columns, 128-byte swizzled as the kernels' shared-memory stages are); the plan's
//! launch table says which GEMM gets a map of which weights and with how many box rows
//! (`LaunchArg::W1Tiles` / `W2Tiles`), and the runtime encodes it once per layer, since
//! the weights do not move.

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::{
    self, CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use moeforge_compiler::plan::{LaunchArg, LayerShape, TENSOR_MAP_BYTES};

use crate::layer::LayerError;

/// Columns of one box: 64 bf16, one 128-byte swizzled shared-memory row.
const BOX_COLUMNS: u32 = 64;

/// A tensor map as a kernel parameter (passed by value; the kernel declares it
/// `const __grid_constant__`).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct TensorMap(CUtensorMap);

// SAFETY: a plain 128-byte C struct the driver copies into the kernel's parameter space, as
// the kernel's `TensorMap` parameter (the same size, checked at compile time below).
unsafe impl DeviceRepr for TensorMap {}

const _: () = assert!(std::mem::size_of::<CUtensorMap>() == TENSOR_MAP_BYTES as usize);

/// The weight matrix a map argument covers, as (rows, columns) of one 2-D bf16 matrix over
/// `experts` experts, and the box rows; `None` for arguments that are not maps.
pub(crate) fn weight_map_shape(
    arg: LaunchArg,
    shape: &LayerShape,
    experts: u32,
) -> Option<(u64, u64, u32)> {
    let experts = u64::from(experts);
    match arg {
        LaunchArg::W1Tiles { box_rows } => Some((
            experts * u64::from(shape.w1_rows()),
            u64::from(shape.hidden),
            box_rows,
        )),
        LaunchArg::W2Tiles { box_rows } => Some((
            experts * u64::from(shape.hidden),
            u64::from(shape.ffn),
            box_rows,
        )),
        _ => None,
    }
}

impl TensorMap {
    /// A map over the row-major bf16 matrix of `rows` x `columns` at device address
    /// `address`, copying boxes of `box_rows` x 64 with the 128-byte swizzle.
    pub(crate) fn bf16_rows(
        what: &'static str,
        address: u64,
        rows: u64,
        columns: u64,
        box_rows: u32,
    ) -> Result<Self, LayerError> {
        let global_dims = [columns, rows];
        // Bytes from one row to the next (the innermost stride is implied).
        let global_strides = [columns * 2];
        let box_dims = [BOX_COLUMNS, box_rows];
        let element_strides = [1u32, 1];
        let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
        // SAFETY: every pointer is to a live local array of the rank the call is given (2);
        // the driver only encodes (it reads no device memory) and writes `map`.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                address as *mut std::ffi::c_void,
                global_dims.as_ptr(),
                global_strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if result != CUresult::CUDA_SUCCESS {
            return Err(LayerError::TensorMap {
                what,
                rows,
                columns,
                box_rows,
                result: format!("{result:?}"),
            });
        }
        // SAFETY: the driver wrote the whole map on success; zeroed before in any case.
        Ok(TensorMap(unsafe { map.assume_init() }))
    }
}
